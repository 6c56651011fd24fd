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
pub(crate) fn gate(
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
/// own (it covers every transaction before it); a snapshot mark the stream start's. Events
/// need their transaction's GTID (`None` here: see [`target`]).
fn required(msg: &SourceMsg, start_gtid: &Option<String>) -> Option<Option<String>> {
    match msg {
        SourceMsg::Event(..) => None,
        SourceMsg::Checkpoint(Checkpoint::Binlog { gtid_state, .. }) => Some(gtid_state.clone()),
        SourceMsg::Checkpoint(_) => Some(start_gtid.clone()),
    }
}

/// What the replicas must have applied before everything held up to an index may go on: the
/// last checkpoint's state, plus the GTIDs of the events after it (a transaction larger than
/// `--txn-buffer` is streamed before its checkpoint: its events go on once its GTID is
/// applied, so the gate never waits for a checkpoint that the byte budget keeps from coming).
/// `floor` is the state of the last checkpoint released. `None` when nothing held needs one.
fn target(
    held: &VecDeque<SourceMsg>,
    floor: &Option<String>,
    start_gtid: &Option<String>,
    mariadb: bool,
) -> Result<Option<(usize, String)>, Error> {
    let no_gtid = || {
        Error::config(
            "--sync-replica needs GTIDs, but a position the relay read carries none",
            "turn GTIDs on (MySQL: gtid_mode=ON, enforce_gtid_consistency=ON; MariaDB writes them always), or run without --sync-replica",
        )
    };
    let mut acc = floor.clone().unwrap_or_default();
    let mut last = None;
    for (i, m) in held.iter().enumerate() {
        match (m, required(m, start_gtid)) {
            (_, Some(state)) => {
                acc = state.filter(|s| !s.is_empty()).ok_or_else(no_gtid)?;
                last = Some(i);
            }
            (SourceMsg::Event(e, _), None) => {
                let Some(g) = e.gtid.as_deref().filter(|g| !g.is_empty()) else {
                    continue;
                };
                acc = merge(&acc, g, mariadb).ok_or_else(|| {
                    Error::Decode(format!("--sync-replica: cannot add GTID {g:?} to {acc:?}"))
                })?;
                last = Some(i);
            }
            (SourceMsg::Checkpoint(_), None) => {}
        }
    }
    Ok(last.map(|i| (i, acc)))
}

/// `state` with one more transaction's GTID: MariaDB `domain-server-seq` moves its domain,
/// MySQL `uuid[:tag]:n` joins the set.
fn merge(state: &str, gtid: &str, mariadb: bool) -> Option<String> {
    use crate::source::mysql::gtid::{Gtid, GtidState, MysqlGtidSet};
    if mariadb {
        let mut s = GtidState::parse(state)?;
        s.apply(Gtid::parse(gtid)?);
        Some(s.to_string())
    } else {
        let mut s = MysqlGtidSet::parse(state)?;
        s.union(&MysqlGtidSet::parse(gtid)?);
        Some(s.to_string())
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
    let mut floor = start_gtid.clone();
    loop {
        let Some(first) = rx.recv().await else { break };
        held.push_back(first);
        while let Ok(m) = rx.try_recv() {
            held.push_back(m);
        }
        let Some((last, gtid)) = target(&held, &floor, &start_gtid, mariadb)? else {
            continue;
        };
        if !wait_all(&mut replicas, mariadb, &gtid, &shutdown).await? {
            return Ok(());
        }
        floor = Some(gtid);
        for m in held.drain(..=last) {
            outlet
                .events
                .send(m)
                .await
                .map_err(|_| Error::Other("relay stopped".into()))?;
        }
    }
    // The source stopped: what is held past the last release is read again by the next start
    // (the stored position is before it).
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

/// What `check` and `status` say of one replica named with `--sync-replica`.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct ReplicaState {
    /// `host:port`.
    pub at: String,
    /// What it has applied: MariaDB `@@gtid_slave_pos`, MySQL `@@gtid_executed`.
    pub applied: Option<String>,
    /// Whether it replicates by GTID (MariaDB `Using_Gtid` not `No`, MySQL `Auto_Position`).
    pub by_gtid: Option<bool>,
    /// `log_slave_updates`: after a promotion its binlog holds what it replicated, which a
    /// GTID resume needs.
    pub logs_updates: Option<bool>,
    /// Why it could not be read, or is no replica.
    pub problem: Option<String>,
}

/// Reads one replica's state; a problem is reported in it, not returned.
pub(crate) async fn replica_state(dsn: &DbDsn, mariadb: bool) -> ReplicaState {
    let at = format!("{}:{}", dsn.host, dsn.port);
    let read = async {
        let mut c = super::connect_sql(dsn).await?;
        let applied: Option<Option<String>> = c
            .query_first(if mariadb {
                "SELECT @@gtid_slave_pos"
            } else {
                "SELECT @@gtid_executed"
            })
            .await?;
        let logs: Option<i64> = c.query_first("SELECT @@log_slave_updates").await?;
        let status: Option<mysql_async::Row> = match c.query_first("SHOW SLAVE STATUS").await {
            Ok(r) => r,
            Err(e) if super::server_code(&e) == Some(1064) => {
                c.query_first("SHOW REPLICA STATUS").await?
            }
            Err(e) => return Err(e.into()),
        };
        let _ = c.disconnect().await;
        let by_gtid = status.as_ref().map(|r| {
            let col = |n: &str| r.get_opt::<String, _>(n).and_then(|v| v.ok());
            match col("Using_Gtid") {
                Some(u) => !u.eq_ignore_ascii_case("no"),
                None => col("Auto_Position").as_deref() == Some("1"),
            }
        });
        Ok::<_, Error>((
            applied.flatten(),
            logs.map(|l| l != 0),
            status.is_some(),
            by_gtid,
        ))
    };
    match read.await {
        Ok((applied, logs_updates, replicating, by_gtid)) => ReplicaState {
            at,
            applied,
            by_gtid,
            logs_updates,
            problem: (!replicating)
                .then(|| "is not replicating (SHOW SLAVE STATUS is empty)".to_string()),
        },
        Err(e) => ReplicaState {
            at,
            problem: Some(e.to_string()),
            ..Default::default()
        },
    }
}

/// The `sync replica` check lines: with none named, whether the primary has replicas a
/// failover could promote (`connected`, from `SHOW SLAVE HOSTS`; `None` when unknown); each
/// named one reachable, replicating by GTID with `log_slave_updates`, and how far it applied
/// against the primary's `primary_gtid`.
pub(crate) fn replica_lines(
    named: &[ReplicaState],
    connected: Option<usize>,
    primary_gtid: &str,
) -> Vec<crate::diagnostics::CheckLine> {
    use crate::diagnostics::{line, Level};
    const FIX: &str = "run the relay with --sync-replica DSN for each replica a failover may promote (docs/operations.md, MariaDB/MySQL failover)";
    if named.is_empty() {
        return vec![match connected {
            Some(n) if n > 0 => line(
                Level::Warn,
                "sync replicas",
                format!("none named (--sync-replica), and {n} replica(s) replicate from this server: the relay publishes a transaction as soon as this server commits it, so a failover to a replica that had not received it rolls back events consumers already have"),
                Some(FIX.into()),
            ),
            _ => line(
                Level::Ok,
                "sync replicas",
                "none named (--sync-replica); no replica registered with this server",
                None,
            ),
        }];
    }
    named
        .iter()
        .map(|r| match r {
            ReplicaState {
                problem: Some(p), ..
            } => line(
                Level::Fail,
                "sync replica",
                format!("{}: {p}: the relay would wait for it and publish nothing", r.at),
                Some("make it reachable for the relay's user, replicating from this server, or remove it from --sync-replica".into()),
            ),
            ReplicaState {
                by_gtid: Some(false),
                ..
            } => line(
                Level::Fail,
                "sync replica",
                format!("{} replicates by file and position: after its promotion the relay cannot find its position by GTID", r.at),
                Some("MariaDB: CHANGE MASTER TO MASTER_USE_GTID = slave_pos; MySQL: CHANGE REPLICATION SOURCE TO SOURCE_AUTO_POSITION = 1 (on the replica, replication stopped)".into()),
            ),
            ReplicaState {
                logs_updates: Some(false),
                ..
            } => line(
                Level::Fail,
                "sync replica",
                format!("{} runs without log_slave_updates: promoted, its binlog lacks what it replicated, and the relay refuses to resume there", r.at),
                Some("log_slave_updates=ON in the replica's option file, then restart it".into()),
            ),
            _ => line(
                Level::Ok,
                "sync replica",
                format!(
                    "{} replicates by GTID with log_slave_updates, applied {} (this server at {}); the relay publishes only what it applied",
                    r.at,
                    r.applied.as_deref().filter(|a| !a.is_empty()).unwrap_or("-"),
                    if primary_gtid.is_empty() { "-" } else { primary_gtid }
                ),
                None,
            ),
        })
        .collect()
}

/// How many replicas registered with the server (`SHOW SLAVE HOSTS`, MySQL 8.4 `SHOW
/// REPLICAS`), outboxd relays not counted (they register with server ids from 2^30, see
/// [`super::server_id_for`]); `None` when it cannot be read.
pub(crate) async fn registered_replicas(conn: &mut mysql_async::Conn) -> Option<usize> {
    let rows = match conn.query::<mysql_async::Row, _>("SHOW SLAVE HOSTS").await {
        Ok(rows) => rows,
        Err(e) if super::server_code(&e) == Some(1064) => conn
            .query::<mysql_async::Row, _>("SHOW REPLICAS")
            .await
            .ok()?,
        Err(_) => return None,
    };
    Some(
        rows.iter()
            .filter(|r| {
                super::admin::text_of(r, 0)
                    .parse::<u64>()
                    .is_ok_and(|id| !is_relay_server_id(id))
            })
            .count(),
    )
}

/// Whether a registered replica's server id is one an outboxd relay uses.
pub(crate) fn is_relay_server_id(id: u64) -> bool {
    id & 0x4000_0000 != 0 && id <= u32::MAX as u64
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

    #[test]
    fn events_of_a_streamed_transaction_go_on_once_their_gtid_is_applied() {
        let ev = |g: Option<&str>| {
            let mut e = crate::sink::test_event();
            e.gtid = g.map(str::to_string);
            SourceMsg::Event(Box::new(e), crate::source::BudgetPermit(None))
        };
        let cp = |g: &str| {
            SourceMsg::Checkpoint(Checkpoint::Binlog {
                file: "f.000001".into(),
                pos: 9,
                gtid_state: Some(g.into()),
            })
        };
        let floor = Some("0-1-5,1-1-2".to_string());
        // Events of a transaction streamed before its checkpoint: their GTID on the floor.
        let held: VecDeque<_> = [ev(Some("0-1-6")), ev(Some("0-1-6"))].into();
        assert_eq!(
            target(&held, &floor, &None, true).unwrap(),
            Some((1, "0-1-6,1-1-2".into()))
        );
        // A checkpoint covers what came before it; events after it add their GTIDs.
        let held: VecDeque<_> = [ev(Some("0-1-6")), cp("0-1-6,1-1-3"), ev(Some("1-1-4"))].into();
        assert_eq!(
            target(&held, &floor, &None, true).unwrap(),
            Some((2, "0-1-6,1-1-4".into()))
        );
        // MySQL sets join.
        let u = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
        let held: VecDeque<_> = [ev(Some(&format!("{u}:8")))].into();
        assert_eq!(
            target(&held, &Some(format!("{u}:1-7")), &None, false).unwrap(),
            Some((0, format!("{u}:1-8")))
        );
        // No GTIDs at all: refused with the fix.
        let held: VecDeque<_> = [SourceMsg::Checkpoint(Checkpoint::Binlog {
            file: "f".into(),
            pos: 4,
            gtid_state: None,
        })]
        .into();
        assert!(matches!(
            target(&held, &None, &None, false),
            Err(Error::Config { .. })
        ));
    }

    #[test]
    fn check_says_whether_replicas_are_named_and_usable() {
        use crate::diagnostics::Level;
        assert!(is_relay_server_id(super::super::server_id_for("x") as u64));
        assert!(!is_relay_server_id(2));
        assert_eq!(replica_lines(&[], Some(2), "0-1-9")[0].level, Level::Warn);
        assert_eq!(replica_lines(&[], Some(0), "0-1-9")[0].level, Level::Ok);
        let good = ReplicaState {
            at: "r:3306".into(),
            applied: Some("0-1-9".into()),
            by_gtid: Some(true),
            logs_updates: Some(true),
            problem: None,
        };
        let l = &replica_lines(std::slice::from_ref(&good), None, "0-1-9")[0];
        assert_eq!(l.level, Level::Ok);
        assert!(l.detail.contains("applied 0-1-9"), "{}", l.detail);
        for bad in [
            ReplicaState {
                logs_updates: Some(false),
                ..good.clone()
            },
            ReplicaState {
                by_gtid: Some(false),
                ..good.clone()
            },
            ReplicaState {
                problem: Some("refused".into()),
                ..good.clone()
            },
        ] {
            let l = &replica_lines(&[bad], None, "0-1-9")[0];
            assert_eq!(l.level, Level::Fail);
            assert!(l.fix.is_some());
        }
    }
}
