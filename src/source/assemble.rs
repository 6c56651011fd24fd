//! What the log sources' transaction assemblers share: the [`Output`] they hand to their run
//! loop, and [`Redelivery`], the one rule for resuming inside a transaction after a reconnect.
//!
//! Each database has a sans-IO assembler (`postgres::assemble`, `mysql::assemble`): a state
//! machine fed decoded log messages that returns events and checkpoints and does no I/O, so
//! every reconnect case is tested in-process. The run loops only read, feed and
//! [`deliver`].

use crate::event::{Checkpoint, OutboxEvent};
use crate::source::Outlet;
use crate::state::checkpoint::Checkpointer;
use crate::Error;
use chrono::{DateTime, Utc};

/// What an assembler asks its run loop to hand on, in order.
#[derive(Debug)]
pub(crate) enum Output {
    /// An event for the relay.
    Event(Box<OutboxEvent>),
    /// A checkpoint for the relay that ends no transaction of ours (an idle position).
    Checkpoint(Checkpoint),
    /// A transaction with outbox events was forwarded whole: `checkpoint` goes to the relay,
    /// and the return path notes where it `end`s and when it committed, for recovery.
    Committed {
        checkpoint: Checkpoint,
        end: Checkpoint,
        commit_at: Option<DateTime<Utc>>,
        /// When it committed, and the earliest `created_at` of its rows.
        gap: Option<(DateTime<Utc>, DateTime<Utc>)>,
    },
}

/// Hands one output to the relay (and a forwarded transaction's commit to the return path).
pub(crate) async fn deliver(
    out: Output,
    outlet: &Outlet,
    checkpoints: &Checkpointer,
) -> Result<(), Error> {
    match out {
        Output::Event(event) => outlet.send_event(*event).await,
        Output::Checkpoint(cp) => outlet.send_checkpoint(cp).await,
        Output::Committed {
            checkpoint,
            end,
            commit_at,
            gap,
        } => {
            if let Some((committed, created)) = gap {
                checkpoints.observe(committed, created);
            }
            checkpoints.forwarded(&end, commit_at);
            outlet.send_checkpoint(checkpoint).await
        }
    }
}

/// What of a transaction went out before the stream broke, as the server sends it again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Replay {
    /// All of it, its end included: skip every event.
    pub whole: bool,
    /// Its first `sent` events.
    pub sent: u32,
}

impl Replay {
    /// Whether the event at `index` (from 0, in the transaction's order) already went out.
    pub(crate) fn skips(&self, index: u32) -> bool {
        self.whole || index < self.sent
    }
}

/// The one rule for a reconnect: the server sends a transaction again from its start (the
/// stream resumes at a boundary before it), and decodes it the same way each time, so a
/// transaction's key and an event's index in it name the same event. What went out before is
/// skipped; the rest follows, so a dropped connection adds neither gaps nor duplicates.
///
/// `K` names a transaction, ordered as the log is (Postgres: its commit LSN). A source whose
/// stream resumes past every transaction it forwarded whole (the binlog resumes at the last
/// boundary read) never calls [`Redelivery::committed`]: only the cut-off one is repeated.
#[derive(Debug, Clone)]
pub(crate) struct Redelivery<K> {
    /// The latest transaction forwarded whole.
    committed: Option<K>,
    /// The transaction being forwarded when the stream broke, and how many events went out.
    partial: Option<(K, u32)>,
}

impl<K> Default for Redelivery<K> {
    fn default() -> Self {
        Redelivery {
            committed: None,
            partial: None,
        }
    }
}

impl<K: Ord + Clone> Redelivery<K> {
    /// The transaction `txn` begins (again, after a reconnect, or for the first time).
    pub(crate) fn begin(&self, txn: &K) -> Replay {
        Replay {
            whole: self.committed.as_ref().is_some_and(|c| txn <= c),
            sent: match &self.partial {
                Some((k, n)) if k == txn => *n,
                _ => 0,
            },
        }
    }

    /// The first `count` events of `txn` went out.
    pub(crate) fn sent(&mut self, txn: &K, count: u32) {
        self.partial = Some((txn.clone(), count));
    }

    /// `txn` went out whole, its end included: a repeat of it is skipped whole.
    pub(crate) fn committed(&mut self, txn: K) {
        self.partial = None;
        self.committed = Some(txn);
    }

    /// The open transaction ended (and the stream resumes after it): nothing of it repeats.
    pub(crate) fn finished(&mut self) {
        self.partial = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reconnect_skips_exactly_what_went_out() {
        let mut r = Redelivery::<u64>::default();
        // Before any transaction: nothing is skipped.
        assert_eq!(r.begin(&100), Replay::default());
        // Two events of 100 went out, then the stream broke.
        r.sent(&100, 1);
        r.sent(&100, 2);
        let again = r.begin(&100);
        assert_eq!(
            again,
            Replay {
                whole: false,
                sent: 2
            }
        );
        assert!(again.skips(0) && again.skips(1) && !again.skips(2));
        // Another transaction is not affected by 100's progress.
        assert_eq!(r.begin(&200), Replay::default());
        // 100 went out whole: a repeat of it (or of anything before it) is skipped whole.
        r.committed(100);
        assert!(r.begin(&100).whole && r.begin(&50).whole);
        assert!(r.begin(&100).skips(7));
        assert!(!r.begin(&200).whole);
        // A finished transaction that is not remembered as committed repeats nothing of it.
        r.sent(&200, 3);
        r.finished();
        assert_eq!(r.begin(&200), Replay::default());
    }
}
