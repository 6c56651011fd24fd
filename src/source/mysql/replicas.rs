//! `--sync-replica`: publish only what the named replicas hold — the MySQL/MariaDB counterpart
//! of PostgreSQL's `synchronized_standby_slots`. A gate between the binlog source and the
//! relay holds every event and checkpoint until each replica has applied the GTID state at the
//! end of its transaction (MariaDB `MASTER_GTID_WAIT`, MySQL `WAIT_FOR_EXECUTED_GTID_SET`,
//! both on the replica), so a failover to one of them never rolls back a transaction whose
//! events were published, and the stored position is never ahead of them. Waits are batched:
//! one wait covers everything that arrived while the previous one ran. Held events keep their
//! share of `--max-inflight-bytes`, so memory stays bounded by it while a replica lags; a
//! replica that cannot be reached holds publishing back (with a warning every 10 s) until it
//! can, as `synchronized_standby_slots` does.

use crate::dsn::DbDsn;
use crate::event::Checkpoint;
use crate::source::{Outlet, SourceMsg};
use crate::Error;
use mysql_async::prelude::Queryable;
use std::collections::VecDeque;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// How long one wait on a replica may block before it is asked again (and a lag warned).
const WAIT_SLICE: Duration = Duration::from_secs(1);
/// How often a replica that holds publishing back is warned about.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// What the replica is asked to have applied: a MariaDB GTID state or a MySQL GTID set, as
/// the checkpoint carries it.
fn wait_statement(mariadb: bool) -> &'static str {
    if mariadb {
        // 0 when reached, -1 on timeout.
        "SELECT MASTER_GTID_WAIT(?, ?)"
    } else {
        // 0 when reached, 1 on timeout.
        "SELECT WAIT_FOR_EXECUTED_GTID_SET(?, ?)"
    }
}

/// One replica the relay waits for.
struct Replica {
    dsn: DbDsn,
    conn: Option<mysql_async::Conn>,
}

impl Replica {
    fn at(&self) -> String {
        format!("{}:{}", self.dsn.host, self.dsn.port)
    }

    /// Waits up to one slice for `gtid`; `Ok(true)` once the replica has applied it.
    async fn wait_slice(&mut self, mariadb: bool, gtid: &str) -> Result<bool, Error> {
        if self.conn.is_none() {
            self.conn = Some(super::connect_sql(&self.dsn).await?);
        }
        let conn = self.conn.as_mut().expect("connected");
        let r: Result<Option<Option<i64>>, _> = conn
            .exec_first(wait_statement(mariadb), (gtid, WAIT_SLICE.as_secs_f64()))
            .await;
        match r {
            Ok(v) => Ok(v.flatten() == Some(0)),
            Err(e) => {
                self.conn = None;
                Err(super::classify(e))
            }
        }
    }

    /// What the replica has applied, for the warning.
    async fn applied(&mut self, mariadb: bool) -> String {
        let q = if mariadb {
            "SELECT @@gtid_slave_pos"
        } else {
            "SELECT @@gtid_executed"
        };
        match self.conn.as_mut() {
            Some(c) => c
                .query_first::<Option<String>, _>(q)
                .await
                .ok()
                .flatten()
                .flatten()
                .unwrap_or_else(|| "?".into()),
            None => "unreachable".into(),
        }
    }
}

/// The gate: the outlet the source sends to, and the task that forwards to `outlet` what the
/// replicas hold. `start_gtid` is the GTID state of the stream's start (what a first start's
/// snapshot rows, read before it, need on the replicas). The task ends when the source's
/// outlet is dropped (forwarding what the replicas already hold) or at `shutdown`.
pub fn gate(
    replicas: &[DbDsn],
    mariadb: bool,
    start_gtid: Option<String>,
    outlet: Outlet,
    shutdown: CancellationToken,
) -> (Outlet, tokio::task::JoinHandle<Result<(), Error>>) {
    let (tx, rx) = mpsc::channel(1024);
    let source_side = Outlet {
        events: tx,
        budget: outlet.budget.clone(),
    };
    let replicas = replicas
        .iter()
        .map(|dsn| Replica {
            dsn: dsn.clone(),
            conn: None,
        })
        .collect();
    let task = tokio::spawn(run(replicas, mariadb, start_gtid, rx, outlet, shutdown));
    (source_side, task)
}

/// The GTID state a message needs on the replicas before it may go on: a binlog checkpoint's
/// own; a snapshot mark the stream start's.
fn required(msg: &SourceMsg, start_gtid: &Option<String>) -> Option<Option<String>> {
    match msg {
        SourceMsg::Event(..) => None,
        SourceMsg::Checkpoint(Checkpoint::Binlog { gtid_state, .. }) => Some(gtid_state.clone()),
        SourceMsg::Checkpoint(_) => Some(start_gtid.clone()),
    }
}

async fn run(
    mut replicas: Vec<Replica>,
    mariadb: bool,
    start_gtid: Option<String>,
    mut rx: mpsc::Receiver<SourceMsg>,
    outlet: Outlet,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let mut held: VecDeque<SourceMsg> = VecDeque::new();
    loop {
        let Some(first) = rx.recv().await else { break };
        held.push_back(first);
        while let Ok(m) = rx.try_recv() {
            held.push_back(m);
        }
        // Everything up to the last checkpoint held goes on once the replicas have its state
        // (every event before it belongs to a transaction at or before it).
        let Some(last) = held
            .iter()
            .rposition(|m| required(m, &start_gtid).is_some())
        else {
            continue;
        };
        let need = required(&held[last], &start_gtid).flatten();
        match need {
            Some(gtid) if !gtid.is_empty() => {
                if !wait_all(&mut replicas, mariadb, &gtid, &shutdown).await? {
                    return Ok(());
                }
            }
            _ => {
                return Err(Error::config(
                    "--sync-replica needs GTIDs, but a position the relay read carries none",
                    "turn GTIDs on (MySQL: gtid_mode=ON, enforce_gtid_consistency=ON; MariaDB writes them always), or run without --sync-replica",
                ))
            }
        }
        for m in held.drain(..=last) {
            outlet
                .events
                .send(m)
                .await
                .map_err(|_| Error::Other("relay stopped".into()))?;
        }
    }
    // The source stopped: what is held past the last checkpoint is read again by the next
    // start (the stored position is before it).
    Ok(())
}

/// Waits until every replica has applied `gtid`; `false` when `shutdown` came first.
async fn wait_all(
    replicas: &mut [Replica],
    mariadb: bool,
    gtid: &str,
    shutdown: &CancellationToken,
) -> Result<bool, Error> {
    for r in replicas.iter_mut() {
        let since = Instant::now();
        let mut warned = since;
        loop {
            let reached = tokio::select! {
                r = r.wait_slice(mariadb, gtid) => r,
                _ = shutdown.cancelled() => return Ok(false),
            };
            match reached {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) if e.is_retryable() => {
                    tracing::warn!(replica = %r.at(), error = %e, "--sync-replica: replica unreachable; publishing waits for it");
                    tokio::select! {
                        _ = tokio::time::sleep(WAIT_SLICE) => {}
                        _ = shutdown.cancelled() => return Ok(false),
                    }
                }
                Err(e) => return Err(e),
            }
            if warned.elapsed() >= WARN_EVERY {
                warned = Instant::now();
                let applied = r.applied(mariadb).await;
                tracing::warn!(
                    replica = %r.at(),
                    waiting_for = %gtid,
                    replica_applied = %applied,
                    waited_s = since.elapsed().as_secs(),
                    "--sync-replica: the replica has not applied the next transactions yet; publishing waits for it"
                );
            }
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_message_needs_the_state_of_its_checkpoint() {
        let start = Some("0-1-5".to_string());
        let cp = |g: Option<&str>| {
            SourceMsg::Checkpoint(Checkpoint::Binlog {
                file: "f.000001".into(),
                pos: 9,
                gtid_state: g.map(str::to_string),
            })
        };
        assert_eq!(
            required(&cp(Some("0-1-9")), &start),
            Some(Some("0-1-9".into()))
        );
        assert_eq!(required(&cp(None), &start), Some(None));
        let snap = SourceMsg::Checkpoint(Checkpoint::Snapshot {
            seq: 1,
            key: "k".into(),
        });
        assert_eq!(required(&snap, &start), Some(start.clone()));
        assert!(wait_statement(true).contains("MASTER_GTID_WAIT"));
        assert!(wait_statement(false).contains("WAIT_FOR_EXECUTED_GTID_SET"));
    }
}
