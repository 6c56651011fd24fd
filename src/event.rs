//! What flows down the data path: one outbox row as an [`OutboxEvent`], the source position it
//! came from, and the [`Checkpoint`] a source can resume from once every event before it is
//! durable in the sink.

use bytes::Bytes;
use chrono::{DateTime, SecondsFormat, Utc};
use std::cmp::Ordering;
use std::fmt;
use uuid::Uuid;

/// Where an event sits in the source's commit order. Rendered as the `x-source-position`
/// header; the rendering is zero-padded so that comparing the strings gives commit order too.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SourcePosition {
    /// Postgres: the commit LSN of the event's transaction and its index in that transaction.
    Pg { commit_lsn: u64, index: u32 },
    /// MySQL/MariaDB: binlog file, end position of the transaction, index in the transaction.
    Binlog {
        file: String,
        end_pos: u64,
        index: u32,
    },
    /// Poll mode: no log position; the row's `created_at` order within one batch.
    Poll { batch: u64, index: u32 },
}

impl fmt::Display for SourcePosition {
    // Every published event renders its position (the `x-source-position` header): the
    // padded numbers are written by hand, which costs about a tenth of `write!`'s padding
    // machinery (a callgrind count of the relay put that at 5 % of its instructions per event).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut buf = [0u8; 20];
        match self {
            SourcePosition::Pg { commit_lsn, index } => {
                f.write_str(lsn_hex(*commit_lsn).as_str())?;
                f.write_str(":")?;
                f.write_str(decimal_pad10(u64::from(*index), &mut buf))
            }
            SourcePosition::Binlog {
                file,
                end_pos,
                index,
            } => {
                f.write_str(file)?;
                f.write_str(":")?;
                f.write_str(decimal_pad10(*end_pos, &mut buf))?;
                f.write_str(":")?;
                f.write_str(decimal_pad10(u64::from(*index), &mut buf))
            }
            SourcePosition::Poll { batch, index } => write!(f, "poll:{batch:016}:{index:010}"),
        }
    }
}

/// `n` in decimal, zero-padded to at least 10 digits (what `{n:010}` writes).
fn decimal_pad10(mut n: u64, buf: &mut [u8; 20]) -> &str {
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    let start = i.min(buf.len() - 10);
    buf[start..i].fill(b'0');
    std::str::from_utf8(&buf[start..]).unwrap_or_default()
}

/// An LSN as `XXXXXXXX/XXXXXXXX`: upper-case hex, eight digits on each side.
struct LsnHex([u8; 17]);

impl LsnHex {
    fn as_str(&self) -> &str {
        std::str::from_utf8(&self.0).unwrap_or_default()
    }
}

fn lsn_hex(lsn: u64) -> LsnHex {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = [b'/'; 17];
    for k in 0..8 {
        out[k] = HEX[((lsn >> (60 - 4 * k)) & 0xf) as usize];
        out[9 + k] = HEX[((lsn >> (28 - 4 * k)) & 0xf) as usize];
    }
    LsnHex(out)
}

impl SourcePosition {
    /// Reads back what `Display` wrote, for the positions a sink stores at the broker (the
    /// Kafka sink's positions topic). Poll positions are numbered per process and mean nothing
    /// to another one: `None`, as for anything that is not a position.
    pub fn parse_stored(s: &str) -> Option<SourcePosition> {
        let s = s.trim();
        if s.starts_with("poll:") {
            return None;
        }
        let (head, index) = s.rsplit_once(':')?;
        let index: u32 = index.parse().ok()?;
        if let Some(lsn) = (!head.contains(':')).then(|| parse_lsn(head)).flatten() {
            return Some(SourcePosition::Pg {
                commit_lsn: lsn,
                index,
            });
        }
        let (file, end_pos) = head.rsplit_once(':')?;
        if file.is_empty() {
            return None;
        }
        Some(SourcePosition::Binlog {
            file: file.to_string(),
            end_pos: end_pos.parse().ok()?,
            index,
        })
    }

    /// Order of two positions of the same source (commit order); `None` across kinds.
    pub fn compare(&self, other: &SourcePosition) -> Option<Ordering> {
        use SourcePosition::*;
        match (self, other) {
            (
                Pg { commit_lsn, index },
                Pg {
                    commit_lsn: l,
                    index: i,
                },
            ) => Some(commit_lsn.cmp(l).then(index.cmp(i))),
            (
                Binlog {
                    file,
                    end_pos,
                    index,
                },
                Binlog {
                    file: f,
                    end_pos: p,
                    index: i,
                },
            ) => Some(
                binlog_file_seq(file)
                    .cmp(&binlog_file_seq(f))
                    .then(end_pos.cmp(p))
                    .then(index.cmp(i)),
            ),
            (Poll { batch, index }, Poll { batch: b, index: i }) => {
                Some(batch.cmp(b).then(index.cmp(i)))
            }
            _ => None,
        }
    }
}

/// The id of the dead record of a row that has no usable id of its own (NULL, or not a UUID,
/// in the id column): a UUIDv8 from SHA-256 over the event's source position, its table (with
/// several `--table`) and what the row holds (`created_at`, aggregate id, topic, payload).
/// Distinct for every row of the log, so two such rows are two dead records and not one
/// "duplicate" (the nil UUID they would otherwise share is one `Nats-Msg-Id`, one idempotency
/// key); the same on every replay of the row; and another row at a reused position (a database
/// restored elsewhere, a binlog reset) gets another id, so a deduplicating sink never takes its
/// dead record for the earlier one's. Poll positions are per process: in poll mode every row
/// has a UUID id (it is how rows are marked), so only a literal nil id gets here.
pub fn dead_record_id(event: &OutboxEvent) -> Uuid {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(b"outboxd dead record\n");
    h.update(event.table.as_deref().unwrap_or("").as_bytes());
    h.update(b"\n");
    h.update(event.position.to_string().as_bytes());
    // Each part with its length: no two rows' parts run together into the same bytes.
    for part in [
        event.created_at_rfc3339().as_bytes(),
        event.aggregate_id.as_bytes(),
        event.topic.as_bytes(),
        &event.payload[..],
    ] {
        h.update((part.len() as u64).to_le_bytes());
        h.update(part);
    }
    let digest = h.finalize();
    let mut bytes = [0u8; 16];
    bytes.copy_from_slice(&digest[..16]);
    Uuid::new_v8(bytes)
}

/// `0/16B3748` (how Postgres prints an LSN).
pub fn format_lsn(lsn: u64) -> String {
    format!("{:X}/{:X}", lsn >> 32, lsn & 0xffff_ffff)
}

/// `00000000/016B3748`: sortable as a string.
pub fn format_lsn_padded(lsn: u64) -> String {
    lsn_hex(lsn).as_str().to_string()
}

/// Parses `16/B374D848` (Postgres' form, padded or not).
pub fn parse_lsn(s: &str) -> Option<u64> {
    let (hi, lo) = s.trim().split_once('/')?;
    let hi = u64::from_str_radix(hi, 16).ok()?;
    let lo = u64::from_str_radix(lo, 16).ok()?;
    if hi > u32::MAX as u64 || lo > u32::MAX as u64 {
        return None;
    }
    Some((hi << 32) | lo)
}

/// An extra column's value (see [`OutboxEvent::extra`]): its text as the database renders it
/// (what templates use: `t` for a Postgres boolean) and the type a message header keeps
/// (docs/message-format.md, "Header values from columns").
#[derive(Debug, Clone, PartialEq)]
pub struct ColumnValue {
    pub text: String,
    pub typed: Typed,
}

/// The type of a column value, where a header can carry it: booleans, integers and floating
/// point numbers; everything else (numeric, dates and times, UUIDs, JSON, text) is text.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Typed {
    Text,
    Bool(bool),
    Int(i64),
    /// A double (Postgres `float8`, MySQL `DOUBLE`).
    Float(f64),
    /// A single-precision float (Postgres `real`, MySQL `FLOAT`).
    Float32(f32),
}

impl ColumnValue {
    /// A text value.
    pub fn text(text: impl Into<String>) -> ColumnValue {
        ColumnValue {
            text: text.into(),
            typed: Typed::Text,
        }
    }
}

impl From<&str> for ColumnValue {
    fn from(s: &str) -> Self {
        ColumnValue::text(s)
    }
}

/// One outbox row, decoded. `payload` holds the JSON text exactly as the server rendered it:
/// it becomes the message body byte for byte.
#[derive(Debug, Clone)]
pub struct OutboxEvent {
    pub id: Uuid,
    pub aggregate_id: String,
    pub topic: String,
    pub payload: Bytes,
    pub created_at: DateTime<Utc>,
    pub position: SourcePosition,
    /// The row's optional `headers` JSON object, copied into message headers.
    pub headers: Option<serde_json::Map<String, serde_json::Value>>,
    /// The row's optional aggregate version.
    pub version: Option<i64>,
    /// The server's GTID of the event's transaction, where it has one.
    pub gtid: Option<String>,
    /// Commit time of the event's transaction, where the source knows it (latency metrics).
    pub committed_at: Option<DateTime<Utc>>,
    /// Set when the row cannot be published as a message (NULL in a required column, invalid
    /// JSON, …): the sink sends a dead-letter record with this reason instead of the body.
    pub poison: Option<String>,
    /// The outbox table the row came from, set only when the relay reads several tables
    /// (`x-outbox-table`); one table's messages stay as docs/message-format.md has them.
    pub table: Option<std::sync::Arc<str>>,
    /// Values of the extra columns templates and `--header` name (empty unless configured;
    /// a NULL value is absent): their text, and their type where a header keeps it.
    pub extra: Vec<(std::sync::Arc<str>, ColumnValue)>,
    /// The payload's content type when it is not JSON (`--payload-content-type`, or the row's
    /// content type column); `None` is `application/json`.
    pub content_type: Option<std::sync::Arc<str>>,
    /// The payload is NULL or blank and nothing else is wrong with the row: a dead record like
    /// any poison on every sink, but a tombstone on Kafka with `--kafka-tombstones` (Debezium's
    /// `route.tombstone.on.empty.payload`).
    pub empty_payload: bool,
    /// When the source read the row from the server (`None` until it is handed to the
    /// relay, which stamps it then): the relay's stage metrics measure from it.
    pub read_at: Option<std::time::Instant>,
}

impl OutboxEvent {
    /// Bytes this event holds in memory, for the in-flight byte budget.
    pub fn size(&self) -> usize {
        self.payload.len()
            + self.aggregate_id.len()
            + self.topic.len()
            + self
                .extra
                .iter()
                .map(|(k, v)| k.len() + v.text.len() + 32)
                .sum::<usize>()
            + 128
    }

    /// The value of an extra column (see [`OutboxEvent::extra`]).
    pub fn extra_value(&self, key: &str) -> Option<&str> {
        self.extra
            .iter()
            .find(|(k, _)| &**k == key)
            .map(|(_, v)| v.text.as_str())
    }

    /// An extra column's value with its type (see [`OutboxEvent::extra`]).
    pub fn extra_column(&self, key: &str) -> Option<&ColumnValue> {
        self.extra.iter().find(|(k, _)| &**k == key).map(|(_, v)| v)
    }

    /// Whether the payload is JSON (the default) rather than bytes of another content type.
    pub fn payload_is_json(&self) -> bool {
        self.content_type.is_none()
    }

    /// `created_at` as RFC 3339 with microseconds in UTC (`x-outbox-created-at`).
    pub fn created_at_rfc3339(&self) -> String {
        self.created_at.to_rfc3339_opts(SecondsFormat::Micros, true)
    }

    /// The id this event's dead record carries (message id, `Nats-Msg-Id`): the row's id, or,
    /// when the row has no usable one (read as the nil UUID), [`dead_record_id`] of its
    /// position.
    pub fn dead_record_id(&self) -> Uuid {
        if self.id.is_nil() {
            dead_record_id(self)
        } else {
            self.id
        }
    }
}

/// A position a source can resume from. Sent by the source after the last event of a
/// transaction (or on an idle keepalive), acknowledged back by the relay only when every event
/// sent before it is durable in the sink.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checkpoint {
    /// Postgres: an LSN to confirm to the slot (a commit's end LSN or an idle keepalive's
    /// `wal_end`).
    Lsn(u64),
    /// Poll mode: a batch of rows this process handed over; acknowledged, the batch's rows
    /// may be marked published.
    Batch(u64),
    /// MySQL/MariaDB: the binlog coordinates after a transaction, and the GTID state there.
    Binlog {
        file: String,
        pos: u64,
        gtid_state: Option<String>,
    },
    /// A first start's snapshot: every snapshot row up to `key` (in the snapshot's order) is
    /// durable. `seq` counts the marks of one run; every streamed position comes after them.
    /// The key is stored so that a snapshot interrupted by a crash goes on after it.
    Snapshot { seq: u64, key: String },
}

impl Checkpoint {
    /// The LSN of a Postgres position; `None` for any other kind.
    pub fn lsn(&self) -> Option<u64> {
        match self {
            Checkpoint::Lsn(l) => Some(*l),
            _ => None,
        }
    }

    /// Order of two checkpoints of the same source; `None` across kinds.
    pub fn compare(&self, other: &Checkpoint) -> Option<Ordering> {
        match (self, other) {
            (Checkpoint::Lsn(a), Checkpoint::Lsn(b)) => Some(a.cmp(b)),
            (Checkpoint::Batch(a), Checkpoint::Batch(b)) => Some(a.cmp(b)),
            (Checkpoint::Snapshot { seq: a, .. }, Checkpoint::Snapshot { seq: b, .. }) => {
                Some(a.cmp(b))
            }
            // The snapshot is published before the stream, at its start position.
            (Checkpoint::Snapshot { .. }, Checkpoint::Lsn(_) | Checkpoint::Binlog { .. }) => {
                Some(Ordering::Less)
            }
            (Checkpoint::Lsn(_) | Checkpoint::Binlog { .. }, Checkpoint::Snapshot { .. }) => {
                Some(Ordering::Greater)
            }
            (
                Checkpoint::Binlog {
                    file: fa, pos: pa, ..
                },
                Checkpoint::Binlog {
                    file: fb, pos: pb, ..
                },
            ) => Some(
                binlog_file_seq(fa)
                    .cmp(&binlog_file_seq(fb))
                    .then(pa.cmp(pb)),
            ),
            _ => None,
        }
    }

    /// Whether `self` is strictly after `other`.
    pub fn is_after(&self, other: &Checkpoint) -> bool {
        self.compare(other) == Some(Ordering::Greater)
    }
}

impl fmt::Display for Checkpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Checkpoint::Lsn(lsn) => f.write_str(&format_lsn(*lsn)),
            Checkpoint::Batch(b) => write!(f, "batch {b}"),
            Checkpoint::Snapshot { key, .. } => write!(f, "snapshot after {key}"),
            Checkpoint::Binlog {
                file,
                pos,
                gtid_state,
            } => match gtid_state {
                Some(g) if !g.is_empty() => write!(f, "{file}:{pos} gtid={g}"),
                _ => write!(f, "{file}:{pos}"),
            },
        }
    }
}

/// The numeric suffix of a binlog file name (`mariadb-bin.000042` → 42); files compare by it.
pub fn binlog_file_seq(file: &str) -> u64 {
    file.rsplit('.')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stored_positions_read_back_as_written() {
        for p in [
            SourcePosition::Pg {
                commit_lsn: 0x1_16B3748,
                index: 3,
            },
            SourcePosition::Binlog {
                file: "mysql-bin.000012".into(),
                end_pos: 4711,
                index: 0,
            },
            SourcePosition::Binlog {
                file: "odd:name.000001".into(),
                end_pos: 9,
                index: 2,
            },
        ] {
            assert_eq!(SourcePosition::parse_stored(&p.to_string()), Some(p));
        }
        let poll = SourcePosition::Poll { batch: 1, index: 2 };
        assert_eq!(SourcePosition::parse_stored(&poll.to_string()), None);
        for bad in ["", "x", "0/1", ":1:2", "a:b:c"] {
            assert_eq!(SourcePosition::parse_stored(bad), None, "{bad}");
        }
    }

    #[test]
    fn dead_record_ids_are_distinct_per_row_and_stable() {
        let row = |commit_lsn, index| {
            let mut e = OutboxEvent {
                id: Uuid::nil(),
                aggregate_id: "7".into(),
                topic: "t".into(),
                payload: Bytes::from_static(b"{}"),
                created_at: DateTime::from_timestamp(1_750_000_000, 0).unwrap(),
                position: SourcePosition::Pg { commit_lsn, index },
                headers: None,
                version: None,
                gtid: None,
                committed_at: None,
                poison: Some("no id".into()),
                table: None,
                extra: Vec::new(),
                content_type: None,
                empty_payload: false,
                read_at: None,
            };
            e.position = SourcePosition::Pg { commit_lsn, index };
            e
        };
        let a = row(0x16B3748, 0).dead_record_id();
        assert_eq!(a, row(0x16B3748, 0).dead_record_id(), "a replay: same id");
        assert_eq!(a.get_version_num(), 8);
        assert!(!a.is_nil());
        let mut in_table = row(0x16B3748, 0);
        in_table.table = Some("billing.outbox".into());
        // Another row at the same position (a restored server): another payload, another id.
        let mut reused = row(0x16B3748, 0);
        reused.payload = Bytes::from_static(b"{\"other\": 1}");
        let mut binlog = row(0, 0);
        binlog.position = SourcePosition::Binlog {
            file: "mariadb-bin.000001".into(),
            end_pos: 0x16B3748,
            index: 0,
        };
        let others = [
            row(0x16B3748, 1).dead_record_id(),
            row(0x16B3749, 0).dead_record_id(),
            in_table.dead_record_id(),
            reused.dead_record_id(),
            binlog.dead_record_id(),
        ];
        assert!(others.iter().all(|o| *o != a), "{a} {others:?}");
        // A row with an id keeps it.
        let mut with_id = row(1, 0);
        with_id.id = Uuid::from_u128(5);
        assert_eq!(with_id.dead_record_id(), Uuid::from_u128(5));
    }

    #[test]
    fn positions_compare_in_commit_order() {
        let pg = |commit_lsn, index| SourcePosition::Pg { commit_lsn, index };
        assert_eq!(pg(5, 9).compare(&pg(6, 0)), Some(Ordering::Less));
        assert_eq!(pg(6, 1).compare(&pg(6, 0)), Some(Ordering::Greater));
        assert_eq!(pg(6, 1).compare(&pg(6, 1)), Some(Ordering::Equal));
        let bl = |file: &str, end_pos, index| SourcePosition::Binlog {
            file: file.into(),
            end_pos,
            index,
        };
        // A later file sorts after, whatever the offsets.
        assert_eq!(
            bl("b.000002", 4, 0).compare(&bl("b.000001", 900, 3)),
            Some(Ordering::Greater)
        );
        assert_eq!(
            bl("b.000001", 900, 2).compare(&bl("b.000001", 900, 3)),
            Some(Ordering::Less)
        );
        assert_eq!(pg(1, 0).compare(&bl("b.000001", 1, 0)), None);
    }

    /// The hand-written rendering is the padded `format!` one, at the edges of every field.
    #[test]
    fn positions_render_as_the_padded_format() {
        for lsn in [0, 1, 0x16B3748, 0xA476_0B98_0000_0001, u64::MAX] {
            for index in [0, 7, 1_000_000_000, u32::MAX] {
                assert_eq!(
                    SourcePosition::Pg {
                        commit_lsn: lsn,
                        index
                    }
                    .to_string(),
                    format!("{:08X}/{:08X}:{index:010}", lsn >> 32, lsn & 0xffff_ffff)
                );
                for end_pos in [0, 4, 9_999_999_999, 10_000_000_000, u64::MAX] {
                    assert_eq!(
                        SourcePosition::Binlog {
                            file: "mariadb-bin.000012".into(),
                            end_pos,
                            index
                        }
                        .to_string(),
                        format!("mariadb-bin.000012:{end_pos:010}:{index:010}")
                    );
                }
            }
            assert_eq!(
                format_lsn_padded(lsn),
                format!("{:08X}/{:08X}", lsn >> 32, lsn & 0xffff_ffff)
            );
        }
    }

    #[test]
    fn lsn_round_trips_and_sorts_as_text() {
        let a = parse_lsn("0/16B3748").unwrap();
        let b = parse_lsn("1/0").unwrap();
        assert_eq!(format_lsn(a), "0/16B3748");
        assert_eq!(parse_lsn(&format_lsn_padded(b)), Some(b));
        let pa = SourcePosition::Pg {
            commit_lsn: a,
            index: 9,
        }
        .to_string();
        let pb = SourcePosition::Pg {
            commit_lsn: b,
            index: 0,
        }
        .to_string();
        let pa10 = SourcePosition::Pg {
            commit_lsn: a,
            index: 10,
        }
        .to_string();
        assert!(pa < pa10 && pa10 < pb, "{pa} {pa10} {pb}");
        assert_eq!(parse_lsn("x/1"), None);
        assert_eq!(parse_lsn("1"), None);
    }

    #[test]
    fn checkpoints_order_within_a_kind_only() {
        let a = Checkpoint::Binlog {
            file: "b.000009".into(),
            pos: 900,
            gtid_state: None,
        };
        let b = Checkpoint::Binlog {
            file: "b.000010".into(),
            pos: 4,
            gtid_state: None,
        };
        assert!(b.is_after(&a));
        assert!(!a.is_after(&b));
        assert_eq!(Checkpoint::Lsn(1).compare(&a), None);
        assert!(Checkpoint::Lsn(2).is_after(&Checkpoint::Lsn(1)));
    }
}
