//! The contract between an outbox row and the message it becomes, whatever database the row
//! was read from and however (a log stream, a snapshot, poll mode): one mapper, [`event`],
//! applies every rule a message must satisfy (a routing key of 1–255 bytes, a JSON payload
//! where its content type says JSON, headers as a JSON object, the content type of an opaque
//! payload), while each database only reads its typed values through [`RowValues`]. A row
//! that breaks a rule becomes a poison event whose reasons are a typed list ([`Poison`]),
//! rendered into one string only at the end.

use crate::event::{OutboxEvent, SourcePosition};
use bytes::Bytes;
use chrono::{DateTime, Utc};
use std::fmt;
use std::sync::Arc;
use uuid::Uuid;

/// A poison reason names its column by the contract's column type (its text is the contract
/// name, `aggregate_id`, whatever `--column` renamed it to).
pub(crate) use crate::names::Column;

/// Why a row cannot be published as a message. The text of each is part of the wire contract
/// (the dead-letter record's reason; docs/message-format.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoisonReason {
    /// NULL in a column the message needs.
    Null(Column),
    /// The column's value is not in the row (its image lacks it).
    Missing(Column),
    /// A value of a type the column cannot hold, as the database showed it.
    Unexpected(Column, String),
    NotUtf8(Column),
    /// The id's text is not a UUID.
    NotUuid(String),
    /// A binary id of this many bytes (a UUID has 16).
    UuidLength(usize),
    EmptyTopic,
    /// A topic of this many bytes: a routing key holds at most 255.
    TopicTooLong(usize),
    /// A bytea payload not in Postgres' hex text form.
    NotBytea,
    /// Not valid JSON where the content type says JSON.
    NotJson(Column),
    /// MySQL 8 binary JSON that cannot be rendered as text.
    JsonUnrenderable(String),
    /// The created_at text is not a timestamp.
    NotTimestamp(String),
    /// A created_at date that is not a valid calendar date.
    InvalidDate(String),
    /// A wall-clock created_at that the source time zone skips.
    NoSuchLocalTime(String),
    HeadersNotObject,
    VersionNotInteger,
    /// An unsigned version above `i64::MAX`.
    VersionOutOfRange(u64),
}

impl PoisonReason {
    /// The column this reason is about.
    pub fn column(&self) -> Column {
        match self {
            PoisonReason::Null(c)
            | PoisonReason::Missing(c)
            | PoisonReason::Unexpected(c, _)
            | PoisonReason::NotUtf8(c)
            | PoisonReason::NotJson(c) => *c,
            PoisonReason::NotUuid(_) | PoisonReason::UuidLength(_) => Column::Id,
            PoisonReason::EmptyTopic | PoisonReason::TopicTooLong(_) => Column::Topic,
            PoisonReason::NotBytea | PoisonReason::JsonUnrenderable(_) => Column::Payload,
            PoisonReason::NotTimestamp(_)
            | PoisonReason::InvalidDate(_)
            | PoisonReason::NoSuchLocalTime(_) => Column::CreatedAt,
            PoisonReason::HeadersNotObject => Column::Headers,
            PoisonReason::VersionNotInteger | PoisonReason::VersionOutOfRange(_) => Column::Version,
        }
    }
}

impl fmt::Display for PoisonReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoisonReason::Null(c) => write!(f, "{c} is NULL"),
            PoisonReason::Missing(c) => write!(f, "{c}: missing from the row"),
            PoisonReason::Unexpected(c, v) => write!(f, "{c}: unexpected value {v}"),
            PoisonReason::NotUtf8(c) => write!(f, "{c} is not UTF-8"),
            PoisonReason::NotUuid(s) => write!(f, "id {s:?} is not a UUID"),
            PoisonReason::UuidLength(n) => write!(f, "id is {n} bytes, not a 16-byte UUID"),
            PoisonReason::EmptyTopic => f.write_str("topic is empty: not a routing key"),
            PoisonReason::TopicTooLong(n) => {
                write!(f, "topic is {n} bytes: a routing key holds at most 255")
            }
            PoisonReason::NotBytea => f.write_str("payload is not bytea text (\\x…)"),
            PoisonReason::NotJson(c) => write!(f, "{c} is not valid JSON"),
            PoisonReason::JsonUnrenderable(e) => {
                write!(f, "payload binary JSON cannot be rendered: {e}")
            }
            PoisonReason::NotTimestamp(s) => write!(f, "created_at {s:?} is not a timestamp"),
            PoisonReason::InvalidDate(s) => write!(f, "created_at {s} is not a valid date"),
            PoisonReason::NoSuchLocalTime(s) => {
                write!(f, "created_at {s} does not exist in the source time zone")
            }
            PoisonReason::HeadersNotObject => f.write_str("headers is not a JSON object"),
            PoisonReason::VersionNotInteger => f.write_str("version is not an integer"),
            PoisonReason::VersionOutOfRange(u) => {
                write!(f, "version {u} does not fit a signed 64-bit integer")
            }
        }
    }
}

/// The reasons a row cannot be a message, in the order its columns were read.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Poison(Vec<PoisonReason>);

impl Poison {
    pub(crate) fn push(&mut self, reason: PoisonReason) {
        self.0.push(reason);
    }

    pub(crate) fn reasons(&self) -> &[PoisonReason] {
        &self.0
    }

    /// Whether a reason about `column` was already given.
    pub(crate) fn concerns(&self, column: Column) -> bool {
        self.0.iter().any(|r| r.column() == column)
    }

    /// The event's poison reason: every reason, `; `-separated; `None` for a good row.
    pub(crate) fn into_reason(self) -> Option<String> {
        if self.0.is_empty() {
            return None;
        }
        Some(
            self.0
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
        )
    }
}

/// A JSON-bearing value as a database read it (a payload, the headers).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Json {
    /// Bytes that must parse as JSON where JSON is required (a text column).
    Text(Bytes),
    /// JSON by the column's type (Postgres `json`/`jsonb`, MySQL 8 binary JSON rendered).
    Typed(Bytes),
    /// Not readable; the reason is already in the [`Poison`] list.
    Unreadable,
}

/// What one database reads from one outbox row, column by column. [`event`] calls the readers
/// in the contract's order (id, aggregate_id, topic, payload, created_at, headers, version),
/// so the reasons of a poison event come in that order whatever the database.
pub(crate) trait RowValues {
    /// The id; `None` (the nil UUID goes out) with the reason pushed.
    fn id(&self, poison: &mut Poison) -> Option<Uuid>;
    /// The aggregate id as text; empty with the reason pushed when unreadable.
    fn aggregate_id(&self, poison: &mut Poison) -> String;
    /// The topic as text; empty with the reason pushed when unreadable.
    fn topic(&self, poison: &mut Poison) -> String;
    /// Whether the payload column's type is JSON (its content type is then JSON, whatever
    /// `--payload-content-type` says).
    fn json_payload_column(&self) -> bool;
    /// Whether payloads are opaque (`--payload-content-type` or a content type column).
    fn opaque_payloads(&self) -> bool;
    /// The row's own content type (a content type column), untrimmed.
    fn row_content_type(&self) -> Option<Bytes>;
    /// `--payload-content-type`.
    fn default_content_type(&self) -> Option<&Arc<str>>;
    fn payload(&self, poison: &mut Poison) -> Json;
    /// `None` when the table has no created_at column (the commit time stands in);
    /// `Some(None)` when the column's value is unreadable (the reason pushed).
    fn created_at(&self, poison: &mut Poison) -> Option<Option<DateTime<Utc>>>;
    /// `None` when the table has no headers column or the value is NULL.
    fn headers(&self) -> Option<Json>;
    /// `None` when the table has no version column or the value is NULL.
    fn version(&self, poison: &mut Poison) -> Option<i64>;
    /// The extra columns' values (templates, `--header`), NULL ones absent.
    fn extra(&self) -> Vec<(Arc<str>, crate::event::ColumnValue)>;
}

/// Where and when a row was read, as its source knows it.
#[derive(Debug, Clone)]
pub(crate) struct RowMeta {
    pub position: SourcePosition,
    pub gtid: Option<String>,
    /// The transaction's commit time (a snapshot or poll row has none).
    pub committed_at: Option<DateTime<Utc>>,
    /// `x-outbox-table` (several tables only).
    pub table: Option<Arc<str>>,
}

/// Whether a content type is JSON (`application/json`, `…+json`): such payloads must parse.
pub(crate) fn is_json_type(ct: &str) -> bool {
    let base = ct.split(';').next().unwrap_or("").trim();
    base.eq_ignore_ascii_case("application/json") || base.to_ascii_lowercase().ends_with("+json")
}

fn is_json(b: &[u8]) -> bool {
    serde_json::from_slice::<serde::de::IgnoredAny>(b).is_ok()
}

/// One outbox row as the message it becomes, or a poison event with every reason.
pub(crate) fn event(row: &impl RowValues, meta: RowMeta) -> OutboxEvent {
    let mut poison = Poison::default();
    let id = row.id(&mut poison).unwrap_or(Uuid::nil());
    let aggregate_id = row.aggregate_id(&mut poison);
    let topic = row.topic(&mut poison);
    if topic.is_empty() && !poison.concerns(Column::Topic) {
        poison.push(PoisonReason::EmptyTopic);
    } else if topic.len() > 255 {
        poison.push(PoisonReason::TopicTooLong(topic.len()));
    }
    let content_type = content_type(row);
    let payload = match row.payload(&mut poison) {
        Json::Text(b) => {
            if content_type.as_deref().is_none_or(is_json_type) && !is_json(&b) {
                poison.push(PoisonReason::NotJson(Column::Payload));
            }
            b
        }
        Json::Typed(b) => b,
        Json::Unreadable => Bytes::new(),
    };
    let created_at = match row.created_at(&mut poison) {
        Some(read) => read.unwrap_or_default(),
        // No created_at column: the commit time (a snapshot or poll row's read time).
        None => meta.committed_at.unwrap_or_else(Utc::now),
    };
    let headers = row.headers().and_then(|h| headers_object(h, &mut poison));
    let version = row.version(&mut poison);
    // Debezium's `route.tombstone.on.empty.payload` test: NULL, or nothing but whitespace.
    let empty_payload = payload.trim_ascii().is_empty()
        && poison.reasons().iter().all(|r| {
            matches!(
                r,
                PoisonReason::Null(Column::Payload) | PoisonReason::NotJson(Column::Payload)
            )
        });
    OutboxEvent {
        id,
        aggregate_id,
        topic,
        payload,
        created_at,
        position: meta.position,
        headers,
        version,
        gtid: meta.gtid,
        committed_at: meta.committed_at,
        empty_payload,
        poison: poison.into_reason(),
        table: meta.table,
        extra: row.extra(),
        content_type,
        read_at: None,
    }
}

/// The payload's content type when it is not JSON: `None` (JSON) unless payloads are opaque
/// and the column is not JSON by type; then the row's own, `--payload-content-type`, or
/// `application/octet-stream`.
fn content_type(row: &impl RowValues) -> Option<Arc<str>> {
    if row.json_payload_column() || !row.opaque_payloads() {
        return None;
    }
    let own = row
        .row_content_type()
        .as_deref()
        .and_then(|b| std::str::from_utf8(b).ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(Arc::<str>::from);
    Some(
        own.or_else(|| row.default_content_type().cloned())
            .unwrap_or_else(|| "application/octet-stream".into()),
    )
}

/// The headers column as a JSON object; JSON `null` is no headers.
fn headers_object(
    value: Json,
    poison: &mut Poison,
) -> Option<serde_json::Map<String, serde_json::Value>> {
    let parsed = match value {
        Json::Text(b) | Json::Typed(b) => serde_json::from_slice::<serde_json::Value>(&b).ok(),
        Json::Unreadable => None,
    };
    match parsed {
        Some(serde_json::Value::Object(m)) => Some(m),
        Some(serde_json::Value::Null) => None,
        _ => {
            poison.push(PoisonReason::HeadersNotObject);
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A row of fixed values, as any database could read it.
    #[derive(Default)]
    struct Row {
        id: Option<Uuid>,
        /// `None`: NULL.
        topic: Option<String>,
        payload: Option<Json>,
        json_column: bool,
        opaque: bool,
        own_type: Option<&'static [u8]>,
        default_type: Option<Arc<str>>,
        headers: Option<Json>,
        created: Option<Option<DateTime<Utc>>>,
    }

    impl RowValues for Row {
        fn id(&self, poison: &mut Poison) -> Option<Uuid> {
            if self.id.is_none() {
                poison.push(PoisonReason::Null(Column::Id));
            }
            self.id
        }
        fn aggregate_id(&self, _: &mut Poison) -> String {
            "a1".into()
        }
        fn topic(&self, poison: &mut Poison) -> String {
            self.topic.clone().unwrap_or_else(|| {
                poison.push(PoisonReason::Null(Column::Topic));
                String::new()
            })
        }
        fn json_payload_column(&self) -> bool {
            self.json_column
        }
        fn opaque_payloads(&self) -> bool {
            self.opaque
        }
        fn row_content_type(&self) -> Option<Bytes> {
            self.own_type.map(Bytes::from_static)
        }
        fn default_content_type(&self) -> Option<&Arc<str>> {
            self.default_type.as_ref()
        }
        fn payload(&self, poison: &mut Poison) -> Json {
            self.payload.clone().unwrap_or_else(|| {
                poison.push(PoisonReason::Null(Column::Payload));
                Json::Unreadable
            })
        }
        fn created_at(&self, _: &mut Poison) -> Option<Option<DateTime<Utc>>> {
            self.created
        }
        fn headers(&self) -> Option<Json> {
            self.headers.clone()
        }
        fn version(&self, _: &mut Poison) -> Option<i64> {
            None
        }
        fn extra(&self) -> Vec<(Arc<str>, crate::event::ColumnValue)> {
            Vec::new()
        }
    }

    fn good() -> Row {
        Row {
            id: Some(Uuid::from_u128(7)),
            topic: Some("order.created".into()),
            payload: Some(Json::Text(Bytes::from_static(b"{\"n\":1}"))),
            ..Row::default()
        }
    }

    fn meta(committed_at: Option<DateTime<Utc>>) -> RowMeta {
        RowMeta {
            position: SourcePosition::Pg {
                commit_lsn: 1,
                index: 0,
            },
            gtid: None,
            committed_at,
            table: None,
        }
    }

    #[test]
    fn a_good_row_is_a_message() {
        let e = event(&good(), meta(None));
        assert_eq!(e.poison, None);
        assert_eq!(e.id, Uuid::from_u128(7));
        assert_eq!(&e.payload[..], b"{\"n\":1}");
        assert_eq!(e.content_type, None);
    }

    #[test]
    fn every_reason_is_given_in_column_order() {
        let row = Row {
            id: None,
            topic: Some("t".repeat(256)),
            payload: Some(Json::Text(Bytes::from_static(b"{not json"))),
            headers: Some(Json::Text(Bytes::from_static(b"[1]"))),
            ..Row::default()
        };
        let e = event(&row, meta(None));
        assert_eq!(
            e.poison.as_deref(),
            Some(
                "id is NULL; topic is 256 bytes: a routing key holds at most 255; \
                 payload is not valid JSON; headers is not a JSON object"
            )
        );
        assert_eq!(e.id, Uuid::nil());
    }

    #[test]
    fn an_empty_topic_is_poison_once() {
        let e = event(
            &Row {
                topic: Some(String::new()),
                ..good()
            },
            meta(None),
        );
        assert_eq!(
            e.poison.as_deref(),
            Some("topic is empty: not a routing key")
        );
        // A topic already reported unreadable is not reported empty as well.
        let e = event(
            &Row {
                topic: None,
                ..good()
            },
            meta(None),
        );
        assert_eq!(e.poison.as_deref(), Some("topic is NULL"));
    }

    /// An empty text payload is not JSON: the same rule for every database (Postgres let an
    /// empty text payload through before the contract was shared).
    #[test]
    fn an_empty_text_payload_is_not_json() {
        let row = Row {
            payload: Some(Json::Text(Bytes::new())),
            ..good()
        };
        assert_eq!(
            event(&row, meta(None)).poison.as_deref(),
            Some("payload is not valid JSON")
        );
        // An unreadable payload gives its own reason only.
        let row = Row {
            payload: None,
            ..good()
        };
        assert_eq!(
            event(&row, meta(None)).poison.as_deref(),
            Some("payload is NULL")
        );
    }

    #[test]
    fn opaque_payloads_carry_their_content_type_and_are_not_parsed() {
        let binary = |own: Option<&'static [u8]>, default: Option<&str>| Row {
            payload: Some(Json::Text(Bytes::from_static(b"\x00\x01"))),
            opaque: true,
            own_type: own,
            default_type: default.map(Arc::from),
            ..good()
        };
        let e = event(
            &binary(Some(b" image/png "), Some("text/plain")),
            meta(None),
        );
        assert_eq!(
            (e.content_type.as_deref(), e.poison),
            (Some("image/png"), None)
        );
        let e = event(&binary(Some(b"  "), Some("text/plain")), meta(None));
        assert_eq!(e.content_type.as_deref(), Some("text/plain"));
        let e = event(&binary(None, None), meta(None));
        assert_eq!(e.content_type.as_deref(), Some("application/octet-stream"));
        // A JSON content type on an opaque payload still requires JSON.
        let e = event(&binary(Some(b"application/vnd.x+json"), None), meta(None));
        assert_eq!(e.poison.as_deref(), Some("payload is not valid JSON"));
        // A JSON column is JSON whatever the options say.
        let e = event(
            &Row {
                json_column: true,
                ..binary(Some(b"image/png"), None)
            },
            meta(None),
        );
        assert_eq!(e.content_type, None);
    }

    /// A NULL or blank payload on an otherwise good row is marked empty (a Kafka tombstone
    /// with `--kafka-tombstones`); a row with another problem, or a payload that is merely not
    /// JSON, is not.
    #[test]
    fn an_empty_payload_is_marked_for_tombstones() {
        let null = event(
            &Row {
                payload: None,
                ..good()
            },
            meta(None),
        );
        assert!(null.empty_payload && null.poison.is_some());
        let blank = event(
            &Row {
                payload: Some(Json::Text(Bytes::from_static(b"  "))),
                ..good()
            },
            meta(None),
        );
        assert!(blank.empty_payload);
        let garbage = event(
            &Row {
                payload: Some(Json::Text(Bytes::from_static(b"{nope"))),
                ..good()
            },
            meta(None),
        );
        assert!(!garbage.empty_payload);
        let no_id = event(
            &Row {
                id: None,
                payload: None,
                ..good()
            },
            meta(None),
        );
        assert!(!no_id.empty_payload);
        assert!(!event(&good(), meta(None)).empty_payload);
    }

    #[test]
    fn headers_are_an_object_or_nothing() {
        let with = |h: Json| Row {
            headers: Some(h),
            ..good()
        };
        let e = event(
            &with(Json::Typed(Bytes::from_static(b"{\"k\":1}"))),
            meta(None),
        );
        assert_eq!(e.headers.unwrap()["k"], 1);
        let e = event(&with(Json::Text(Bytes::from_static(b"null"))), meta(None));
        assert_eq!((e.headers, e.poison), (None, None));
        let e = event(&with(Json::Unreadable), meta(None));
        assert_eq!(e.poison.as_deref(), Some("headers is not a JSON object"));
    }

    #[test]
    fn without_a_created_at_column_the_commit_time_stands_in() {
        let at = DateTime::from_timestamp(1_782_129_600, 0).unwrap();
        let e = event(&good(), meta(Some(at)));
        assert_eq!(e.created_at, at);
        let e = event(
            &Row {
                created: Some(None),
                ..good()
            },
            meta(Some(at)),
        );
        assert_eq!(
            e.created_at,
            DateTime::<Utc>::default(),
            "an unreadable one"
        );
    }
}
