//! Publishing ids that never make the broker drop an event it does not hold
//! (docs/rabbitmq-stream.md).
//!
//! The broker keeps, per producer name and stream, the last publishing id it stored, and drops
//! every message whose id is at or below it. So on every (re)connect the sink asks the broker
//! for that id `S`, and new events get `S+1, S+2, …` in the relay's order: a new event never
//! gets an id the broker would drop.
//!
//! What the stream already holds is decided by identity, never by order: before a lane's first
//! publish after a connect, the sink reads back this relay's messages from the stream's end to
//! the first one older than the event about to go out (`read_back` in the sink), and keeps
//! their identities (`crate::identity::EventKey`: source, position or GTID, and the message's
//! id). A replayed event whose identity is among them is confirmed without being sent again;
//! every other event is published, so what the read-back misses is a duplicate, never a loss.
//! No state outside the stream is written, so the position store, the checkpoint and
//! `offset set` stay as they are.

use crate::identity::{EventKey, Held};
use std::collections::HashSet;

pub(crate) use crate::stream::PUBLISHING_ID_HEADER;

/// What to do with an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Assign {
    /// The stream already holds it: confirm it without sending.
    Held,
    /// Send it with this publishing id.
    Publish(u64),
}

/// One stream's publishing ids and what the stream was found to hold.
#[derive(Debug)]
pub(crate) struct PublishingIds {
    /// The last id given out (or, before the first, the broker's last stored id).
    last: u64,
    /// The identities of this relay's messages read back from the stream, and of those sent
    /// since; `None` until read.
    held: Option<Held>,
}

impl PublishingIds {
    /// `last`: the broker's last stored id for the producer (0: none).
    pub(crate) fn new(last: u64) -> PublishingIds {
        PublishingIds {
            last,
            // A producer that stored nothing has nothing to read back.
            held: (last == 0).then(Held::default),
        }
    }

    /// The last id given out so far.
    pub(crate) fn last(&self) -> u64 {
        self.last
    }

    /// Whether the stream still has to be read back before the next decision: the producer
    /// stored something, and nothing was read since the connect.
    pub(crate) fn needs_read_back(&self) -> bool {
        self.held.is_none()
    }

    /// What the read-back found.
    pub(crate) fn set_held(&mut self, read_back: HashSet<EventKey>) {
        self.held = Some(Held::new(read_back));
    }

    /// The decision for the next event in the relay's order, by the key of the message it
    /// goes out as.
    pub(crate) fn assign(&mut self, key: &EventKey) -> Assign {
        let held = self.held.get_or_insert_with(Held::default);
        if held.contains(key) {
            return Assign::Held;
        }
        held.published(*key);
        self.last += 1;
        Assign::Publish(self.last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn key(id: u128) -> EventKey {
        EventKey::of(Uuid::from_u128(id))
    }

    #[test]
    fn a_replay_confirms_what_the_stream_holds_and_continues_the_sequence() {
        // First run: a fresh stream numbers from 1, nothing to read back.
        let mut first = PublishingIds::new(0);
        assert!(!first.needs_read_back());
        assert_eq!(first.assign(&key(1)), Assign::Publish(1));
        assert_eq!(first.assign(&key(2)), Assign::Publish(2));
        // The broker stored up to 2; the replay starts before the first event.
        let mut again = PublishingIds::new(2);
        assert!(again.needs_read_back());
        again.set_held([key(1), key(2)].into_iter().collect());
        assert!(!again.needs_read_back());
        assert_eq!(again.assign(&key(1)), Assign::Held);
        assert_eq!(again.assign(&key(2)), Assign::Held);
        assert_eq!(again.assign(&key(3)), Assign::Publish(3));
        assert_eq!(again.last(), 3);
    }

    #[test]
    fn an_event_the_stream_does_not_hold_is_published_whatever_came_before() {
        let mut ids = PublishingIds::new(5);
        ids.set_held([key(1), key(3)].into_iter().collect());
        assert_eq!(ids.assign(&key(2)), Assign::Publish(6));
        assert_eq!(ids.assign(&key(3)), Assign::Held);
        assert_eq!(ids.assign(&key(4)), Assign::Publish(7));
    }

    /// A row the snapshot sent and the stream carries again, in one life.
    #[test]
    fn an_event_sent_on_this_connection_is_not_sent_again() {
        let mut ids = PublishingIds::new(0);
        assert_eq!(ids.assign(&key(1)), Assign::Publish(1));
        assert_eq!(ids.assign(&key(1)), Assign::Held);
        assert_eq!(ids.assign(&key(2)), Assign::Publish(2));
    }
}
