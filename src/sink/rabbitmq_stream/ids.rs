//! Publishing ids that a restarted relay computes again for the same event (docs/rabbitmq-stream.md).
//!
//! The broker keeps, per producer name and stream, the last publishing id it stored, and drops
//! every message whose id is at or below it. The stream itself is the record of which events it
//! holds: every message carries its source position (`x-source-position`) and its publishing id
//! (`x-outbox-publishing-id`), and messages are stored in the relay's order, which is the
//! source's commit order. So on every (re)connect the sink asks the broker for the last id `S`
//! and reads the message that has it — the stream's *tail* of this producer, at position `T`.
//! An event at or before `T` in commit order is already in the stream (it is confirmed without
//! being sent again); the events after `T` get `S+1, S+2, …` in order. A replay from any stored
//! position therefore yields the same ids for the same events, and a new event never gets an id
//! the broker would drop. No state outside the stream is written, so the position store, the
//! checkpoint and `offset set` stay as they are.

use crate::event::SourcePosition;
use std::cmp::Ordering;
use uuid::Uuid;

pub use crate::stream::PUBLISHING_ID_HEADER;

/// The last message of this relay's producer in a stream, as read back from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tail {
    pub position: SourcePosition,
    /// The `message-id` of that message (the event id, or a dead record's id).
    pub message_id: Uuid,
}

/// What to do with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Assign {
    /// The stream already holds it: confirm it without sending.
    Held,
    /// Send it with this publishing id.
    Publish(u64),
}

/// The source's positions do not line up with what the stream holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mismatch {
    pub tail: Tail,
    pub position: SourcePosition,
    pub message_id: Uuid,
}

/// One stream's publishing ids.
#[derive(Debug)]
pub struct PublishingIds {
    /// The last id given out (or, before the first, the broker's last stored id).
    last: u64,
    /// Until the first event past it: the tail read from the stream.
    tail: Option<Tail>,
}

impl PublishingIds {
    /// `last`: the broker's last stored id for the producer (0: none); `tail`: the message
    /// that carries it, when it could be read.
    pub fn new(last: u64, tail: Option<Tail>) -> PublishingIds {
        PublishingIds { last, tail }
    }

    /// The last id given out so far.
    pub fn last(&self) -> u64 {
        self.last
    }

    /// Whether events are still compared with the tail.
    pub fn before_tail(&self) -> bool {
        self.tail.is_some()
    }

    /// The decision for the next event in the relay's order.
    pub fn assign(
        &mut self,
        position: &SourcePosition,
        message_id: Uuid,
    ) -> Result<Assign, Mismatch> {
        // Poll positions are numbered per process: they cannot be compared across a restart,
        // so in poll mode every event gets a new id (at-least-once, never a wrong drop).
        if let (Some(tail), false) = (&self.tail, matches!(position, SourcePosition::Poll { .. })) {
            match position.compare(&tail.position) {
                Some(Ordering::Less) => return Ok(Assign::Held),
                Some(Ordering::Equal) if message_id == tail.message_id => {
                    self.tail = None;
                    return Ok(Assign::Held);
                }
                Some(Ordering::Greater) => self.tail = None,
                Some(Ordering::Equal) | None => {
                    return Err(Mismatch {
                        tail: tail.clone(),
                        position: position.clone(),
                        message_id,
                    })
                }
            }
        }
        self.last += 1;
        Ok(Assign::Publish(self.last))
    }
}

/// Reads `x-source-position` back (the inverse of `SourcePosition`'s `Display`).
pub fn parse_position(s: &str) -> Option<SourcePosition> {
    if let Some(rest) = s.strip_prefix("poll:") {
        let (batch, index) = rest.split_once(':')?;
        return Some(SourcePosition::Poll {
            batch: batch.parse().ok()?,
            index: index.parse().ok()?,
        });
    }
    let mut parts = s.rsplitn(3, ':');
    let index: u32 = parts.next()?.parse().ok()?;
    let second = parts.next()?;
    match parts.next() {
        // `HHHHHHHH/LLLLLLLL:index`: a Postgres commit LSN.
        None => Some(SourcePosition::Pg {
            commit_lsn: crate::event::parse_lsn(second)?,
            index,
        }),
        Some(file) => Some(SourcePosition::Binlog {
            file: file.to_string(),
            end_pos: second.parse().ok()?,
            index,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pg(lsn: u64, index: u32) -> SourcePosition {
        SourcePosition::Pg {
            commit_lsn: lsn,
            index,
        }
    }

    #[test]
    fn positions_read_back_as_written() {
        for p in [
            pg(0x16B3748, 3),
            pg(u64::MAX, u32::MAX),
            SourcePosition::Binlog {
                file: "mysql-bin.000012".into(),
                end_pos: 4711,
                index: 0,
            },
            SourcePosition::Poll { batch: 9, index: 2 },
        ] {
            assert_eq!(parse_position(&p.to_string()), Some(p.clone()), "{p}");
        }
        assert_eq!(parse_position("nonsense"), None);
        assert_eq!(parse_position("0/1:x"), None);
    }

    #[test]
    fn a_replay_gets_the_same_ids_and_skips_what_the_stream_holds() {
        let a = Uuid::from_u128(1);
        let b = Uuid::from_u128(2);
        let c = Uuid::from_u128(3);
        let d = Uuid::from_u128(4);
        // First run: a fresh stream numbers a, b, c from 1.
        let mut first = PublishingIds::new(0, None);
        let got: Vec<_> = [(pg(10, 0), a), (pg(10, 1), b), (pg(20, 0), c)]
            .iter()
            .map(|(p, id)| first.assign(p, *id).unwrap())
            .collect();
        assert_eq!(
            got,
            [Assign::Publish(1), Assign::Publish(2), Assign::Publish(3)]
        );
        // The broker stored up to b (id 2); the replay starts before a.
        let mut again = PublishingIds::new(
            2,
            Some(Tail {
                position: pg(10, 1),
                message_id: b,
            }),
        );
        assert_eq!(again.assign(&pg(10, 0), a), Ok(Assign::Held));
        assert!(again.before_tail());
        assert_eq!(again.assign(&pg(10, 1), b), Ok(Assign::Held));
        assert!(!again.before_tail());
        assert_eq!(again.assign(&pg(20, 0), c), Ok(Assign::Publish(3)));
        assert_eq!(again.assign(&pg(30, 0), d), Ok(Assign::Publish(4)));
    }

    #[test]
    fn a_replay_that_starts_past_the_tail_continues_the_sequence() {
        let mut ids = PublishingIds::new(
            7,
            Some(Tail {
                position: pg(10, 0),
                message_id: Uuid::from_u128(1),
            }),
        );
        assert_eq!(
            ids.assign(&pg(11, 0), Uuid::from_u128(9)),
            Ok(Assign::Publish(8))
        );
        // Past the tail, an earlier position is not compared again.
        assert_eq!(
            ids.assign(&pg(12, 0), Uuid::from_u128(10)),
            Ok(Assign::Publish(9))
        );
    }

    #[test]
    fn a_different_event_at_the_tail_position_is_refused() {
        let tail = Tail {
            position: pg(10, 0),
            message_id: Uuid::from_u128(1),
        };
        let mut ids = PublishingIds::new(5, Some(tail.clone()));
        let e = ids.assign(&pg(10, 0), Uuid::from_u128(2)).unwrap_err();
        assert_eq!(e.tail, tail);
        // A position of another source kind cannot be compared either.
        let mut ids = PublishingIds::new(5, Some(tail));
        let binlog = SourcePosition::Binlog {
            file: "b.000001".into(),
            end_pos: 4,
            index: 0,
        };
        assert!(ids.assign(&binlog, Uuid::from_u128(3)).is_err());
    }

    #[test]
    fn poll_positions_always_get_new_ids() {
        let mut ids = PublishingIds::new(
            4,
            Some(Tail {
                position: SourcePosition::Poll { batch: 9, index: 0 },
                message_id: Uuid::from_u128(1),
            }),
        );
        let early = SourcePosition::Poll { batch: 1, index: 0 };
        assert_eq!(
            ids.assign(&early, Uuid::from_u128(2)),
            Ok(Assign::Publish(5))
        );
    }
}
