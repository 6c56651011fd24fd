//! The Postgres transaction assembler: fed the replication stream's messages (transaction
//! begin and commit, decoded pgoutput messages, keepalives), it returns the outbox events to
//! forward and the checkpoints after them, and skips what a reconnect repeats
//! ([`Redelivery`], keyed by the commit LSN). No I/O, and no clock of its own: the run loop
//! reads, delivers, and stamps each keepalive with the time it came.

use super::pgoutput;
use super::rows::{pg_time, RowMapper};
use crate::event::Checkpoint;
use crate::source::assemble::{Output, Redelivery, Replay};
use crate::Error;
use chrono::{DateTime, Utc};
use std::time::{Duration, Instant};

/// How often an idle keepalive becomes a checkpoint at most. Every stored position is a write
/// to `outboxd_state` in the slot's own database, and its WAL brings the next keepalive with
/// a newer end: a checkpoint per keepalive had an idle relay store a position every
/// `STORE_INTERVAL` for ever (and its walsender decode and its database flush each of them).
/// At this pace the slot stays within a few seconds of the head beside busy tables, and the
/// store adds no write of its own: a stored position renews the lease, which is written every
/// second anyway.
pub(crate) const IDLE_CHECKPOINT_INTERVAL: Duration = Duration::from_secs(5);

/// One message of the replication stream, as the assembler takes it.
#[derive(Debug)]
pub(crate) enum Input {
    /// A transaction that commits at `final_lsn` begins.
    Begin {
        final_lsn: u64,
        commit_time_micros: i64,
    },
    /// A pgoutput message inside (or, for relations, between) transactions.
    Message(pgoutput::Message),
    /// The open transaction committed; the next one starts after `end_lsn`.
    Commit { end_lsn: u64 },
    /// The server has sent everything before `wal_end`; the keepalive came `at`.
    KeepAlive { wal_end: u64, at: Instant },
}

struct Txn {
    commit_lsn: u64,
    commit_time_micros: i64,
    index: u32,
    replay: Replay,
    /// The earliest `created_at` of its rows.
    min_created: Option<DateTime<Utc>>,
}

/// See the module doc.
pub(crate) struct Assembler {
    mapper: RowMapper,
    redelivery: Redelivery<u64>,
    txn: Option<Txn>,
    last_idle_checkpoint: u64,
    /// When the last idle checkpoint was made (kept across reconnects: the pace is the
    /// store's, not the stream's).
    last_idle_at: Option<Instant>,
}

impl Assembler {
    pub(crate) fn new(mapper: RowMapper) -> Assembler {
        Assembler {
            mapper,
            redelivery: Redelivery::default(),
            txn: None,
            last_idle_checkpoint: 0,
            last_idle_at: None,
        }
    }

    /// Inside a transaction: a stop waits for its end.
    pub(crate) fn in_txn(&self) -> bool {
        self.txn.is_some()
    }

    /// A new stream (a reconnect): it starts at a transaction boundary.
    pub(crate) fn restart(&mut self) {
        self.txn = None;
        self.last_idle_checkpoint = 0;
    }

    /// Takes one message; `acked` is the newest position the relay acknowledged (an idle
    /// keepalive behind it is no news).
    pub(crate) fn feed(&mut self, input: Input, acked: u64) -> Result<Option<Output>, Error> {
        match input {
            Input::Begin {
                final_lsn,
                commit_time_micros,
            } => {
                self.txn = Some(Txn {
                    commit_lsn: final_lsn,
                    commit_time_micros,
                    index: 0,
                    replay: self.redelivery.begin(&final_lsn),
                    min_created: None,
                });
                Ok(None)
            }
            Input::Message(pgoutput::Message::Relation(rel)) => {
                self.mapper.relation(rel)?;
                Ok(None)
            }
            Input::Message(pgoutput::Message::Insert { relation_id, tuple }) => {
                self.insert(relation_id, &tuple)
            }
            // publish = 'insert' keeps these away; other messages are not ours.
            Input::Message(_) => Ok(None),
            Input::Commit { end_lsn } => Ok(self.commit(end_lsn)),
            Input::KeepAlive { wal_end, at } => {
                // Everything before a keepalive has been sent to us, so once the events before
                // it are durable the slot may move here: an idle outbox beside busy tables
                // keeps the slot near the head. At most one per IDLE_CHECKPOINT_INTERVAL: the
                // keepalives that come sooner are dropped, a later one carries a newer end.
                let due = self
                    .last_idle_at
                    .is_none_or(|t| at.saturating_duration_since(t) >= IDLE_CHECKPOINT_INTERVAL);
                if self.txn.is_none()
                    && due
                    && wal_end > self.last_idle_checkpoint
                    && wal_end > acked
                {
                    self.last_idle_checkpoint = wal_end;
                    self.last_idle_at = Some(at);
                    return Ok(Some(Output::Checkpoint(Checkpoint::Lsn(wal_end))));
                }
                Ok(None)
            }
        }
    }

    fn insert(
        &mut self,
        relation_id: u32,
        tuple: &[pgoutput::Value],
    ) -> Result<Option<Output>, Error> {
        let Some(txn) = self.txn.as_mut() else {
            return Err(Error::Decode("insert outside a transaction".into()));
        };
        let Some(event) = self.mapper.insert(
            relation_id,
            tuple,
            txn.commit_lsn,
            txn.index,
            txn.commit_time_micros,
        )?
        else {
            return Ok(None);
        };
        let index = txn.index;
        txn.index += 1;
        txn.min_created = Some(
            txn.min_created
                .map_or(event.created_at, |m| m.min(event.created_at)),
        );
        if txn.replay.skips(index) {
            return Ok(None);
        }
        self.redelivery.sent(&txn.commit_lsn, txn.index);
        Ok(Some(Output::Event(Box::new(event))))
    }

    fn commit(&mut self, end_lsn: u64) -> Option<Output> {
        let txn = self.txn.take()?;
        if txn.replay.whole {
            return None;
        }
        self.redelivery.committed(txn.commit_lsn);
        let commit_at = pg_time(txn.commit_time_micros);
        let end = Checkpoint::Lsn(end_lsn);
        Some(Output::Committed {
            checkpoint: end.clone(),
            end,
            commit_at,
            // Snapshot-like zero times carry no commit time for the gap.
            gap: commit_at
                .filter(|_| txn.commit_time_micros != 0)
                .zip(txn.min_created),
        })
    }
}

#[cfg(test)]
mod tests;
