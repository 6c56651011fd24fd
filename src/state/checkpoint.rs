//! The return path of a run, in one type: what the relay acknowledged goes to the state store,
//! what the store wrote may go upstream (Postgres: the slot is confirmed; the binlog has
//! nothing upstream to tell), and the commit times of the stored transactions go into the
//! store beside the position, for a recovery through the table.
//!
//! It lives in `state` because what it carries is what the store holds: the relay only
//! acknowledges (it knows no store), the store only writes (it knows no slot), the source only
//! reads the log and applies the confirm on the connection it owns (a reconnect replaces it).
//! The run wiring (`pipeline`) creates one per run and hands it to the source's `run` and to
//! the store as a parameter (`StateStore::return_path`); neither names the wiring. The
//! [`Checkpointer`] is the one place those meet, and the Postgres rule — the slot is never
//! confirmed past what the state row holds — is the one function [`slot_confirm`].
//!
//! Who calls what, in order: the source notes each transaction it forwards
//! ([`Checkpointer::forwarded`], [`Checkpointer::observe`]); the lease keeper takes each
//! acknowledged position to store ([`Checkpointer::to_store`], which returns the commit times
//! to store with it); the Postgres store reports what the row holds after the write
//! ([`Checkpointer::written`]) or that the server is shutting down
//! ([`Checkpointer::server_stopping`]); the Postgres source follows [`Checkpointer::upstream`].

use super::DurableCommit;
use crate::event::{binlog_file_seq, format_lsn, Checkpoint};
use chrono::{DateTime, Utc};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use tokio::sync::watch;

/// What the upstream side of the return path may do now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Upstream {
    /// How far the slot may be confirmed: stored in the row and acknowledged by the relay.
    pub confirm: u64,
    /// When a store write last found the server shutting down (see
    /// [`Checkpointer::server_stopping`]).
    pub(crate) server_stopping: Option<Instant>,
}

/// The return path of one run; cheap to clone (every clone is the same path).
#[derive(Clone)]
pub struct Checkpointer(Arc<Shared>);

impl std::fmt::Debug for Checkpointer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Checkpointer")
            .field("upstream", &*self.0.upstream.borrow())
            .finish()
    }
}

struct Shared {
    inner: Mutex<Inner>,
    upstream: watch::Sender<Upstream>,
}

#[derive(Default)]
struct Inner {
    /// Forwarded transactions not yet stored: their end position (in log order) and commit
    /// time, oldest first.
    pending: VecDeque<(LogOrder, Option<DateTime<Utc>>)>,
    /// The largest commit-vs-`created_at` gap seen.
    max_gap_ms: Option<i64>,
    /// What is known of the newest stored transaction's commit.
    durable: DurableCommit,
    /// The newest LSN the lease keeper took to store (the relay acknowledged it).
    acked: Option<u64>,
    /// A row position ahead of this run's own, already warned about.
    foreign_seen: Option<u64>,
}

/// Where a position sits in its log: (binlog file sequence, offset), or (0, LSN).
type LogOrder = (u64, u64);

/// Where a position sits in its log, for ordering commit times against acknowledgements;
/// `None` for positions that are not a log's (a snapshot mark, a poll batch).
fn log_order(cp: &Checkpoint) -> Option<LogOrder> {
    match cp {
        Checkpoint::Lsn(l) => Some((0, *l)),
        Checkpoint::Binlog { file, pos, .. } => Some((binlog_file_seq(file), *pos)),
        Checkpoint::Batch(_) | Checkpoint::Snapshot { .. } => None,
    }
}

/// The slot never passes the row. After the store wrote `wrote` and the row answered that it
/// holds `row_holds`, with the relay's acknowledgements up to `acked` and the slot confirmed
/// to `confirmed`: the position the slot may be confirmed to now, `None` for no move.
///
/// Only a row that holds exactly what was written counts: a row already past it kept its own
/// value, which this run never streamed (a run resumes at or after the stored position, so its
/// own positions only grow from there), and confirming the slot on the word of that value would
/// let the next start resume from a position nobody delivered up to. Nothing past the relay's
/// acknowledgement is confirmed either, and the slot never moves back.
pub(crate) fn slot_confirm(
    confirmed: u64,
    acked: u64,
    wrote: u64,
    row_holds: Option<u64>,
) -> Option<u64> {
    if row_holds != Some(wrote) {
        return None;
    }
    let to = wrote.min(acked);
    (to > confirmed).then_some(to)
}

impl Checkpointer {
    /// A return path whose upstream is confirmed up to `confirmed` (Postgres: the position the
    /// run starts from, which the row holds; the binlog: 0, nothing is confirmed upstream).
    pub fn new(confirmed: u64) -> Checkpointer {
        let (upstream, _) = watch::channel(Upstream {
            confirm: confirmed,
            server_stopping: None,
        });
        Checkpointer(Arc::new(Shared {
            inner: Mutex::new(Inner::default()),
            upstream,
        }))
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Nothing panics while holding the lock; a poisoned one still holds consistent data.
        self.0.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Source: a row created at `created` was committed at `committed`.
    pub(crate) fn observe(&self, committed: DateTime<Utc>, created: DateTime<Utc>) {
        let gap = (committed - created).num_milliseconds().max(0);
        let mut inner = self.inner();
        inner.max_gap_ms = Some(inner.max_gap_ms.map_or(gap, |g| g.max(gap)));
    }

    /// Source: a transaction ending at `end`, committed at `commit_at`, went to the relay.
    pub fn forwarded(&self, end: &Checkpoint, commit_at: Option<DateTime<Utc>>) {
        if let Some(at) = log_order(end) {
            self.inner().pending.push_back((at, commit_at));
        }
    }

    /// Lease keeper: `position` (when given) is the relay's newest acknowledgement, about to be
    /// stored. Returns what is known of the commit of the newest transaction up to it, to be
    /// stored with it.
    pub(crate) fn to_store(&self, position: Option<&Checkpoint>) -> DurableCommit {
        let mut inner = self.inner();
        if let Some(pos) = position {
            if let Checkpoint::Lsn(l) = pos {
                inner.acked = Some(inner.acked.map_or(*l, |a| a.max(*l)));
            }
            if let Some(upto) = log_order(pos) {
                while let Some(&(end, t)) = inner.pending.front() {
                    if end > upto {
                        break;
                    }
                    if t.is_some() {
                        inner.durable.commit_at = t;
                    }
                    inner.pending.pop_front();
                }
            }
        }
        inner.durable.max_gap_ms = inner.max_gap_ms;
        inner.durable.clone()
    }

    /// Postgres store: it wrote `wrote`, and the row holds `row_holds` afterwards. Moves the
    /// slot's confirmable position as [`slot_confirm`] allows.
    pub fn written(&self, wrote: u64, row_holds: Option<u64>) {
        let mut inner = self.inner();
        let confirmed = self.0.upstream.borrow().confirm;
        let acked = inner.acked.unwrap_or(wrote);
        if let Some(to) = slot_confirm(confirmed, acked, wrote, row_holds) {
            self.0.upstream.send_modify(|u| u.confirm = to);
        } else if row_holds.is_some_and(|h| h > wrote) && inner.foreign_seen != row_holds {
            inner.foreign_seen = row_holds;
            tracing::warn!(
                position = %format_lsn(wrote),
                stored = %row_holds.map(format_lsn).unwrap_or_default(),
                "the state row holds a position this relay never stored: not confirming the slot past what the row agrees with"
            );
        }
    }

    /// Postgres store: a write found the server shutting down. Its walsender keeps it from
    /// stopping until the slot is confirmed up to its shutdown checkpoint, which can no longer
    /// be stored and so is never confirmed: the source closes its stream instead.
    pub(crate) fn server_stopping(&self) {
        self.0
            .upstream
            .send_modify(|u| u.server_stopping = Some(Instant::now()));
    }

    /// Postgres source: what the slot may be confirmed to, and whether the server is stopping;
    /// changes as the store writes.
    pub fn upstream(&self) -> watch::Receiver<Upstream> {
        self.0.upstream.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_never_passes_the_row() {
        // The row holds what was written: confirmed up to it.
        assert_eq!(slot_confirm(100, 300, 300, Some(300)), Some(300));
        // Never past the relay's acknowledgement.
        assert_eq!(slot_confirm(100, 200, 300, Some(300)), Some(200));
        // The row kept a position of its own (ahead, foreign): not a word of it counts.
        assert_eq!(slot_confirm(100, 300, 300, Some(900)), None);
        // The row holds less than written (or nothing): nothing moves.
        assert_eq!(slot_confirm(100, 300, 300, Some(250)), None);
        assert_eq!(slot_confirm(100, 300, 300, None), None);
        // Never backwards, never the same position twice.
        assert_eq!(slot_confirm(400, 300, 300, Some(300)), None);
        assert_eq!(slot_confirm(300, 300, 300, Some(300)), None);
    }

    #[test]
    fn the_checkpointer_confirms_only_what_the_row_holds() {
        let cp = Checkpointer::new(10);
        let up = cp.upstream();
        cp.to_store(Some(&Checkpoint::Lsn(50)));
        cp.written(50, Some(80));
        assert_eq!(
            up.borrow().confirm,
            10,
            "a foreign row position moves nothing"
        );
        cp.written(50, Some(50));
        assert_eq!(up.borrow().confirm, 50);
        // A write the relay has not acknowledged (cannot happen in a run): capped.
        cp.written(70, Some(70));
        assert_eq!(up.borrow().confirm, 50);
        assert!(up.borrow().server_stopping.is_none());
        cp.server_stopping();
        assert!(up.borrow().server_stopping.is_some());
    }

    #[test]
    fn commit_times_are_stored_with_the_position_that_covers_them() {
        let t = |s: i64| DateTime::<Utc>::from_timestamp(s, 0).unwrap();
        let cp = Checkpointer::new(0);
        let bin = |file: &str, pos| Checkpoint::Binlog {
            file: file.into(),
            pos,
            gtid_state: None,
        };
        cp.observe(t(100), t(97));
        cp.forwarded(&bin("b.000001", 500), Some(t(100)));
        cp.forwarded(&bin("b.000002", 4), Some(t(200)));
        // Nothing stored yet: only the gap is known.
        let d = cp.to_store(None);
        assert_eq!((d.commit_at, d.max_gap_ms), (None, Some(3000)));
        // The first transaction is durable, the second is not (a later file).
        let d = cp.to_store(Some(&bin("b.000001", 900)));
        assert_eq!(d.commit_at, Some(t(100)));
        let d = cp.to_store(Some(&bin("b.000002", 4)));
        assert_eq!(d.commit_at, Some(t(200)));
        // A snapshot mark covers no transaction, and keeps what is known.
        let d = cp.to_store(Some(&Checkpoint::Snapshot {
            seq: 1,
            key: "k".into(),
        }));
        assert_eq!(d.commit_at, Some(t(200)));
    }
}
