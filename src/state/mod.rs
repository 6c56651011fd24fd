//! The relay's own state, kept in the source database (`outboxd_state`): which relay `name`
//! owns which slot, its lease (holder, epoch, expiry) and the last position whose events were
//! all confirmed by the sink. The stored position moves only forward and is written only by
//! the lease holder of the current epoch.

pub mod file;
pub mod forward;
pub mod mysql;
pub mod postgres;

use crate::event::Checkpoint;
use crate::Error;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// How long a lease lasts without renewal; a relay renews it about every second.
pub const LEASE_TTL: Duration = Duration::from_secs(5);
/// With `--ha`, a leader that could not renew for this long stops publishing: before its
/// lease can expire and a standby take over, so two relays never publish at once.
pub const SELF_FENCE_AFTER: Duration = Duration::from_millis(3500);
/// One renewal may take this long; a stalled connection must not stall the lease keeper.
pub const RENEW_TIMEOUT: Duration = Duration::from_millis(900);
pub const RENEW_INTERVAL: Duration = Duration::from_secs(1);

/// Identifies this process as a lease holder: `host:pid:nonce`.
pub fn holder_id() -> String {
    format!(
        "{}:{}:{}",
        hostname(),
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Whether a holder id names a process on this host that no longer exists (a relay killed with
/// SIGKILL leaves its lease behind; its successor on the same host need not wait it out).
pub fn holder_is_dead_locally(holder: &str) -> bool {
    let mut parts = holder.rsplitn(3, ':');
    let (_nonce, pid, host) = (parts.next(), parts.next(), parts.next());
    match (host, pid.and_then(|p| p.parse::<u32>().ok())) {
        (Some(host), Some(pid)) if host == hostname() => {
            pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
        }
        _ => false,
    }
}

/// What the source knows about the newest durable transaction: its commit time and the
/// largest commit-vs-`created_at` gap seen so far. Recovery through the table replays from
/// there, minus at least that gap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DurableCommit {
    pub commit_at: Option<chrono::DateTime<chrono::Utc>>,
    pub max_gap_ms: Option<i64>,
}

/// Commit times of forwarded transactions until they are durable, and the largest
/// commit-vs-`created_at` gap seen: what recovery through the table needs. `K` orders
/// positions (a Postgres LSN; a MySQL binlog file sequence and offset).
#[derive(Debug)]
pub struct CommitLog<K> {
    pending: std::collections::VecDeque<(K, Option<chrono::DateTime<chrono::Utc>>)>,
    max_gap_ms: Option<i64>,
}

impl<K> Default for CommitLog<K> {
    fn default() -> Self {
        CommitLog {
            pending: Default::default(),
            max_gap_ms: None,
        }
    }
}

impl<K: Ord + Copy> CommitLog<K> {
    /// A row created at `created` was committed at `committed`.
    pub fn observe(
        &mut self,
        committed: chrono::DateTime<chrono::Utc>,
        created: chrono::DateTime<chrono::Utc>,
    ) {
        let gap = (committed - created).num_milliseconds().max(0);
        self.max_gap_ms = Some(self.max_gap_ms.map_or(gap, |g| g.max(gap)));
    }

    /// A transaction ending at `end` and committed at `commit_at` was handed to the relay.
    pub fn forwarded(&mut self, end: K, commit_at: Option<chrono::DateTime<chrono::Utc>>) {
        self.pending.push_back((end, commit_at));
    }

    /// Everything up to `pos` is durable: publish the newest commit time among them.
    pub fn durable_up_to(&mut self, pos: K, out: &watch::Sender<DurableCommit>) {
        let mut last = None;
        while let Some(&(end, t)) = self.pending.front() {
            if end > pos {
                break;
            }
            last = t.or(last);
            self.pending.pop_front();
        }
        if last.is_some() || self.max_gap_ms != out.borrow().max_gap_ms {
            out.send_modify(|d| {
                if last.is_some() {
                    d.commit_at = last;
                }
                d.max_gap_ms = self.max_gap_ms;
            });
        }
    }
}

/// A lease this process holds.
#[derive(Debug, Clone)]
pub struct Lease {
    pub name: String,
    pub holder: String,
    pub epoch: i64,
    /// No earlier run of this name finished its first start (its snapshot is not yet durable).
    pub first_start: bool,
    /// A replay from the table was requested (`offset set --replay-since`).
    pub replay_since: Option<chrono::DateTime<chrono::Utc>>,
}

/// What the lease keeper needs from a state store: renew the lease (storing a newer position
/// with it, never an older one) and give it up. A store reconnects by itself on the next call
/// after a failure.
pub trait StateStore: Send {
    /// Renews the lease; stores `position` (and what is known of its commit) when given.
    fn renew(
        &mut self,
        lease: &Lease,
        position: Option<&Checkpoint>,
        commit: &DurableCommit,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send;

    /// Records that the first start's snapshot (or a requested replay) is durable.
    fn mark_initialized(
        &mut self,
        _lease: &Lease,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        async { Ok(()) }
    }

    fn release(
        &mut self,
        lease: &Lease,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send;
}

/// Renews the lease about every second and stores the newest durable position with it (only
/// when it changed); at the end, stores the final position and releases the lease. Ends early
/// only when the lease was lost.
pub async fn keep_lease<S: StateStore>(
    mut store: S,
    lease: Lease,
    mut acks: watch::Receiver<Option<Checkpoint>>,
    commits: watch::Receiver<DurableCommit>,
    self_fence: bool,
    stop: CancellationToken,
) -> Result<(), Error> {
    let mut renewed = std::time::Instant::now();
    let mut written: Option<Checkpoint> = None;
    // Until the first acknowledgement, the first start's snapshot (or a requested replay) is
    // not known to be durable: only then is it marked done.
    let mut needs_init = lease.first_start || lease.replay_since.is_some();
    let mut tick = tokio::time::interval(RENEW_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stopping = false;
    let mut failures_while_stopping = 0;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled(), if !stopping => stopping = true,
        }
        let _ = acks.has_changed();
        let pos = acks
            .borrow_and_update()
            .clone()
            .filter(|p| Some(p) != written.as_ref());
        let commit = commits.borrow().clone();
        // With self-fencing, a renewal stuck on a stalled connection must not stall the clock
        // that fences; without it, the store's own timeouts apply (cancelling a store midway
        // can leave its session inside a transaction).
        let attempt = if self_fence {
            tokio::time::timeout(RENEW_TIMEOUT, store.renew(&lease, pos.as_ref(), &commit))
                .await
                .unwrap_or_else(|_| Err(Error::source("lease renewal timed out", true)))
        } else {
            store.renew(&lease, pos.as_ref(), &commit).await
        };
        if attempt.is_err() && self_fence && !stopping && renewed.elapsed() >= SELF_FENCE_AFTER {
            crate::telemetry::get().leader.set(0);
            return Err(Error::Leadership(format!(
                "could not renew the lease of {:?} for {:.1}s: stopping before it can expire (a standby takes over)",
                lease.name,
                renewed.elapsed().as_secs_f64()
            )));
        }
        match attempt {
            Ok(()) => {
                renewed = std::time::Instant::now();
                let t = crate::telemetry::get();
                t.leader.set(1);
                if pos.is_some() {
                    written = pos;
                    t.position_stored();
                }
                if needs_init && written.is_some() {
                    match store.mark_initialized(&lease).await {
                        Ok(()) => needs_init = false,
                        Err(e @ Error::Leadership(_)) => return Err(e),
                        Err(e) => {
                            tracing::warn!(error = %e, "could not mark the first start done; retrying")
                        }
                    }
                }
            }
            Err(e @ Error::Leadership(_)) => {
                crate::telemetry::get().leader.set(0);
                return Err(e);
            }
            Err(e) => {
                tracing::warn!(error = %e, "lease renewal failed; retrying");
                if stopping {
                    failures_while_stopping += 1;
                    if failures_while_stopping >= 3 {
                        tracing::warn!("giving up on storing the final position: the next start resumes from the last stored one");
                        return Ok(());
                    }
                }
                continue;
            }
        }
        if stopping {
            if let Err(e) = store.release(&lease).await {
                tracing::warn!(error = %e, "could not release the lease; it expires by itself");
            }
            crate::telemetry::get().leader.set(0);
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_local_holders_are_recognised() {
        let me = holder_id();
        assert!(!holder_is_dead_locally(&me));
        let dead = format!("{}:{}:abcd1234", hostname(), u32::MAX - 7);
        assert!(holder_is_dead_locally(&dead));
        assert!(!holder_is_dead_locally("some-other-host:1:abcd"));
        assert!(!holder_is_dead_locally("garbage"));
    }
}
