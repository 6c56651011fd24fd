//! What identifies an event across the relay's lives, across relays and across servers, and
//! the one rule every "already published" check follows (docs/guarantees.md, "An event's
//! identity").
//!
//! A source position alone is not an identity: the same number can mean another row (a
//! snapshot resumed by another process), another relay (two relays writing one stream or
//! topic) or another server (a database restored elsewhere, a binlog reset, a failover to a
//! server whose binlog is numbered differently). So a published message carries who wrote it
//! (`x-outbox-relay`) and which log it was read from (`x-outbox-source`, a
//! [`SourceIdentity`]), and a sink that recognises what a broker already holds compares an
//! [`EventKey`]: the source, the position *and* the event's id together — or, for a binlog
//! transaction with a GTID, the GTID instead of the server-local coordinates, because a GTID
//! names the same transaction on every server of a replication topology. Two different events
//! never share a key, so a comparison of keys can only miss (a duplicate), never skip an event
//! that was not published.
//!
//! The newest record a relay finds of its own is also checked against the log it reads now
//! ([`Origin::check_tail`]): a record from another source whose transaction this server does
//! not hold, or one ahead of the server's head, means the broker holds events of a log this
//! relay is not reading (a restored or replaced database, another relay under this name), and
//! the relay stops with the fix instead of guessing.

use crate::event::SourcePosition;
use std::cmp::Ordering;
use std::collections::{HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;
use uuid::Uuid;

/// The header naming the relay (`--name`) that wrote a message.
pub(crate) const RELAY_HEADER: &str = "x-outbox-relay";
/// The header naming the log a message was read from ([`SourceIdentity::id`]).
pub(crate) const SOURCE_HEADER: &str = "x-outbox-source";

/// Which GTIDs a MySQL/MariaDB server holds: a test over one GTID's text (`0-1-57`,
/// `3e11fa47-71ca-11e1-9e33-c80aa9429562:23`). Supplied by the source, which knows its
/// server's GTID format.
pub(crate) type GtidHistory = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// The log a relay reads, as far as telling logs apart goes.
#[derive(Clone, Default)]
pub struct SourceIdentity {
    /// `postgres:<system identifier>/<database>` (the cluster's identifier: a physical standby
    /// shares it, a restore into another cluster does not), `mariadb:<server_id>`,
    /// `mysql:<server_uuid>`; empty when the source has none (binlog files, tests).
    pub id: String,
    /// The log's head when the relay started: nothing this server wrote is after it, so a
    /// record of this source beyond it (and beyond what this process published) was written
    /// from a log this server no longer has (a restore to an earlier point, a binlog reset).
    pub head: Option<SourcePosition>,
    /// MySQL/MariaDB: the GTIDs this server holds when the relay started. A record of another
    /// server whose GTID is among them is this server's history too (a promoted replica).
    pub gtids: Option<GtidHistory>,
}

impl fmt::Debug for SourceIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SourceIdentity")
            .field("id", &self.id)
            .field("head", &self.head.as_ref().map(|h| h.to_string()))
            .field("gtids", &self.gtids.is_some())
            .finish()
    }
}

/// Who publishes: the relay's name and the log it reads. Every message carries both.
#[derive(Debug, Clone, Default)]
pub struct Origin {
    pub relay: String,
    pub source: SourceIdentity,
    /// `--accept-new-source`: records of another source are taken for an earlier life of this
    /// one (a database restored elsewhere on purpose) instead of stopping the relay.
    pub accept_new_source: bool,
}

/// One message as read back from a broker: what its headers say about it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadBack {
    /// `x-outbox-source`; `None` on records written before the header existed.
    pub source: Option<String>,
    /// `x-source-position`, as written.
    pub position: String,
    /// `x-source-gtid`, where the transaction had one.
    pub gtid: Option<String>,
    /// The message's id: the event id, or a dead record's id.
    pub message_id: String,
}

/// What identifies one published message: the id it carries — the row's event id (which the
/// producer made unique, and which consumers already deduplicate by), or a dead record's id
/// (derived from the row's position and content where the row has no usable id). The same
/// event read twice — by a resumed snapshot, by a snapshot and the stream, from a promoted
/// replica or a restored copy of the database — is recognised; another row at a reused
/// position never is. Only a relay's own records are compared (`x-outbox-relay`): another
/// relay's copy of an event is that relay's, not this one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct EventKey(Uuid);

impl EventKey {
    /// The key of a message about to be published with `message_id`.
    pub(crate) fn of(message_id: Uuid) -> EventKey {
        EventKey(message_id)
    }

    /// The key of a record read back; `None` when its id is no UUID (not written by outboxd).
    pub(crate) fn of_record(r: &ReadBack) -> Option<EventKey> {
        Uuid::parse_str(&r.message_id).ok().map(EventKey)
    }
}

/// How many of the keys a sink published itself it remembers: a row that a first start's
/// snapshot published and the stream then carries again (it was committed after the stream's
/// start position but before the snapshot read it) comes within this many events, unless the
/// snapshot resumed after a long outage; past it the row is published twice, never lost.
pub(crate) const RECENT: usize = 100_000;

/// What a sink knows a broker holds of this relay's messages, on one connection: the keys read
/// back when it connected, and the last [`RECENT`] keys it published since. Memory stays
/// bounded: the read-back by the sink's scan limit, the rest by [`RECENT`].
#[derive(Debug, Default)]
pub(crate) struct Held {
    read_back: HashSet<EventKey>,
    recent: HashSet<EventKey>,
    order: VecDeque<EventKey>,
}

impl Held {
    pub(crate) fn new(read_back: HashSet<EventKey>) -> Held {
        Held {
            read_back,
            ..Held::default()
        }
    }

    pub(crate) fn contains(&self, key: &EventKey) -> bool {
        self.read_back.contains(key) || self.recent.contains(key)
    }

    /// A message handed to the broker on this connection (if it fails, the connection is
    /// replaced and with it this record).
    pub(crate) fn published(&mut self, key: EventKey) {
        if self.recent.insert(key) {
            self.order.push_back(key);
            if self.order.len() > RECENT {
                if let Some(old) = self.order.pop_front() {
                    self.recent.remove(&old);
                }
            }
        }
    }
}

/// Why a relay does not go on with what a broker holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TailMismatch {
    /// The relay's newest record there was read from another log, which this server does not
    /// hold.
    OtherSource { record: String, ours: String },
    /// The relay's newest record there is of this source but beyond the server's head.
    AheadOfHead { record: String, head: String },
}

impl fmt::Display for TailMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TailMismatch::OtherSource { record, ours } => write!(
                f,
                "was read from the source {record}, but this relay reads {ours} and that server does not hold the record's transaction"
            ),
            TailMismatch::AheadOfHead { record, head } => write!(
                f,
                "is at {record}, beyond the source's head {head}: it was written from a log this server no longer has"
            ),
        }
    }
}

impl Origin {
    /// Whether the relay's newest record in a stream or topic (`tail`) belongs to the log it
    /// reads now. `published` is the newest position this process handed to the sink: a
    /// record up to it is this process's own.
    pub fn check_tail(
        &self,
        tail: &ReadBack,
        published: Option<&SourcePosition>,
    ) -> Result<(), TailMismatch> {
        let ours = &self.source.id;
        let Some(source) = tail.source.as_deref() else {
            // Written before records named their source: nothing to compare.
            return Ok(());
        };
        if ours.is_empty() {
            return Ok(());
        }
        if source != ours {
            let held = match (&tail.gtid, &self.source.gtids) {
                (Some(g), Some(history)) => history(g),
                _ => false,
            };
            if held || self.accept_new_source {
                return Ok(());
            }
            return Err(TailMismatch::OtherSource {
                record: source.to_string(),
                ours: ours.clone(),
            });
        }
        let (Some(head), Some(position)) = (
            &self.source.head,
            SourcePosition::parse_stored(&tail.position),
        ) else {
            return Ok(());
        };
        let beyond = |p: &SourcePosition| position.compare(p) == Some(Ordering::Greater);
        if beyond(head) && published.is_none_or(beyond) {
            return Err(TailMismatch::AheadOfHead {
                record: tail.position.clone(),
                head: head.to_string(),
            });
        }
        Ok(())
    }

    /// The fix for a [`TailMismatch`] in `place` (a stream, a topic partition).
    pub fn mismatch_fix(&self, place: &str) -> String {
        format!(
            "if this database replaces the one the record came from (restored, or moved to another server) and the events in {place} are to stay, \
             start the relay once with --accept-new-source (events the broker holds are then recognised only by their exact identity: some may be published again); \
             if another relay named {:?} writes {place}, give one of them another --name",
            self.relay
        )
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

    fn record(source: Option<&str>, position: &SourcePosition, id: Uuid) -> ReadBack {
        ReadBack {
            source: source.map(str::to_string),
            position: position.to_string(),
            gtid: None,
            message_id: id.to_string(),
        }
    }

    #[test]
    fn a_record_is_recognised_by_the_id_it_carries() {
        let id = Uuid::from_u128(7);
        let k = EventKey::of(id);
        // The same event from another source, position or reading (a promoted replica, a
        // snapshot row that the stream carries too), written before records named a source.
        for r in [
            record(Some("postgres:1/app"), &pg(10, 0), id),
            record(Some("postgres:2/app"), &pg(99, 4), id),
            record(None, &pg(10, 0), id),
        ] {
            assert_eq!(EventKey::of_record(&r), Some(k));
        }
        // Another row at the same position (a renumbered snapshot, a restored server).
        assert_ne!(
            EventKey::of_record(&record(
                Some("postgres:1/app"),
                &pg(10, 0),
                Uuid::from_u128(8)
            )),
            Some(k)
        );
        let mut foreign = record(None, &pg(10, 0), id);
        foreign.message_id = "not-a-uuid".into();
        assert_eq!(EventKey::of_record(&foreign), None);
    }

    #[test]
    fn a_sink_remembers_what_it_read_back_and_the_last_keys_it_published() {
        let k = |n| EventKey::of(Uuid::from_u128(n));
        let mut h = Held::new([k(1)].into_iter().collect());
        assert!(h.contains(&k(1)) && !h.contains(&k(2)));
        h.published(k(2));
        assert!(h.contains(&k(2)));
        for n in 10..(10 + RECENT as u128) {
            h.published(k(n));
        }
        assert!(
            !h.contains(&k(2)),
            "the oldest published key is forgotten past RECENT"
        );
        assert!(h.contains(&k(1)), "what was read back stays");
        assert_eq!(h.recent.len(), RECENT);
    }

    fn origin(id: &str, head: Option<SourcePosition>) -> Origin {
        Origin {
            relay: "r1".into(),
            source: SourceIdentity {
                id: id.into(),
                head,
                gtids: None,
            },
            accept_new_source: false,
        }
    }

    #[test]
    fn a_tail_of_another_source_or_beyond_the_head_is_refused() {
        let o = origin("postgres:1/app", Some(pg(100, 0)));
        let id = Uuid::from_u128(1);
        assert_eq!(
            o.check_tail(&record(Some("postgres:1/app"), &pg(90, 3), id), None),
            Ok(())
        );
        assert!(matches!(
            o.check_tail(&record(Some("postgres:2/app"), &pg(90, 3), id), None),
            Err(TailMismatch::OtherSource { .. })
        ));
        assert!(matches!(
            o.check_tail(&record(Some("postgres:1/app"), &pg(120, 0), id), None),
            Err(TailMismatch::AheadOfHead { .. })
        ));
        // Beyond the start's head, but this process published that far.
        assert_eq!(
            o.check_tail(
                &record(Some("postgres:1/app"), &pg(120, 0), id),
                Some(&pg(130, 0))
            ),
            Ok(())
        );
        // Records that name no source are not compared.
        assert_eq!(o.check_tail(&record(None, &pg(120, 0), id), None), Ok(()));
        let accepting = Origin {
            accept_new_source: true,
            ..o.clone()
        };
        assert_eq!(
            accepting.check_tail(&record(Some("postgres:2/app"), &pg(90, 3), id), None),
            Ok(())
        );
    }

    #[test]
    fn a_record_of_a_former_primary_is_ours_when_this_server_holds_its_gtid() {
        let mut o = origin("mariadb:2", None);
        o.source.gtids = Some(Arc::new(|g: &str| g == "0-1-57"));
        let mut r = record(
            Some("mariadb:1"),
            &SourcePosition::Binlog {
                file: "a.000009".into(),
                end_pos: 900,
                index: 0,
            },
            Uuid::from_u128(1),
        );
        r.gtid = Some("0-1-57".into());
        assert_eq!(o.check_tail(&r, None), Ok(()));
        r.gtid = Some("0-1-58".into());
        assert!(o.check_tail(&r, None).is_err());
    }
}
