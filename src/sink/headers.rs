//! The message headers every sink sends, independent of the broker's encoding: the relay's
//! own headers of an event, and the rule that decides which names a row's `headers` object may
//! not supply. The relay's headers carry what consumers trust (order, version, position,
//! partition) and a broker's routing headers (RabbitMQ's `CC`/`BCC`) send a message to other
//! destinations, so a row can never set either: such names are dropped, counted in
//! `outboxd_row_headers_dropped_total` and logged once per name.

use crate::event::OutboxEvent;
use crate::identity::{Origin, RELAY_HEADER, SOURCE_HEADER};
use crate::telemetry::events::{InternalEvent, RowHeaderDropped};
use std::collections::HashSet;
use std::sync::Mutex;

/// A header value before a sink encodes it: an AMQP field value of its type (RabbitMQ, and
/// AMQP 1.0 on a stream), or header bytes (Kafka, NATS) as Kafka Connect's default header
/// converter (`SimpleHeaderConverter`) writes the value Debezium's Outbox Event Router puts in a
/// header: the string itself, `true`/`false`, an integer in decimal, a float as Java's
/// `Double.toString`/`Float.toString` (docs/message-format.md, "Header values from columns").
#[derive(Debug, Clone, PartialEq)]
pub enum HeaderValue {
    Str(String),
    Int(i64),
    Bool(bool),
    Float(f64),
    Float32(f32),
}

impl HeaderValue {
    /// The value as header text (Kafka and NATS headers are bytes).
    pub fn to_text(&self) -> String {
        match self {
            HeaderValue::Str(s) => s.clone(),
            HeaderValue::Int(i) => i.to_string(),
            HeaderValue::Bool(b) => b.to_string(),
            HeaderValue::Float(f) => java_float_text(*f, format!("{f}"), format!("{f:e}")),
            HeaderValue::Float32(f) => {
                java_float_text(f64::from(*f), format!("{f}"), format!("{f:e}"))
            }
        }
    }

    /// A column's value as its header keeps it.
    pub fn of_column(v: &crate::event::ColumnValue) -> HeaderValue {
        use crate::event::Typed;
        match v.typed {
            Typed::Text => HeaderValue::Str(v.text.clone()),
            Typed::Bool(b) => HeaderValue::Bool(b),
            Typed::Int(i) => HeaderValue::Int(i),
            Typed::Float(f) => HeaderValue::Float(f),
            Typed::Float32(f) => HeaderValue::Float32(f),
        }
    }
}

/// Java's `Double.toString` (and `Float.toString`) of `value`, from Rust's shortest renderings
/// of the same number (`plain` as `{}`, `sci` as `{:e}`; the digits are the same, shortest
/// ones): plain with at least one fractional digit from 10⁻³ up to 10⁷, else `d.dddE±n`.
fn java_float_text(value: f64, plain: String, sci: String) -> String {
    if value.is_nan() {
        return "NaN".into();
    }
    if value.is_infinite() {
        return if value > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let abs = value.abs();
    if abs == 0.0 || (1e-3..1e7).contains(&abs) {
        return if plain.contains('.') {
            plain
        } else {
            format!("{plain}.0")
        };
    }
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let mantissa = if mantissa.contains('.') {
        mantissa.to_string()
    } else {
        format!("{mantissa}.0")
    };
    format!("{mantissa}E{exp}")
}

/// Name prefixes the relay owns (compared without case): its own headers, dead-letter records,
/// partition placement, and the brokers' own (`Nats-Msg-Id` deduplicates a JetStream stream).
pub const RESERVED_PREFIXES: &[&str] = &[
    "x-aggregate-",
    "x-source-",
    "x-outbox-",
    // The consumer kit's parked copies say why and where from in these (`x-outboxd-exchange`,
    // `-routing-key`, `-error`, …): a row that set them would mislead whoever triages them.
    "x-outboxd-",
    "x-partition",
    "x-dead-",
    "x-original-",
    "x-death",
    "nats-",
    "cloudevents:",
    "cloudevents_",
    // CloudEvents' Kafka binding (binary mode): `ce_id`, `ce_type`, …
    "ce_",
];

/// Whole names the relay or a broker owns (compared without case): RabbitMQ routes a message
/// to the extra routing keys in `CC` and `BCC`.
pub const RESERVED_NAMES: &[&str] = &["cc", "bcc"];

/// Whether a row's `headers` object may not supply this name.
pub fn is_reserved(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    RESERVED_NAMES.contains(&lower.as_str())
        || RESERVED_PREFIXES.iter().any(|p| lower.starts_with(p))
}

/// The relay's own headers of an event, in the order they are documented. `origin` names the
/// relay and the log the event was read from: with the position and the event id they are the
/// event's identity (`crate::identity`).
pub fn relay_headers(event: &OutboxEvent, origin: &Origin) -> Vec<(&'static str, HeaderValue)> {
    let s = HeaderValue::Str;
    let mut h = vec![
        ("x-aggregate-id", s(event.aggregate_id.clone())),
        ("x-outbox-created-at", s(event.created_at_rfc3339())),
        ("x-source-position", s(event.position.to_string())),
    ];
    h.extend(origin_headers(origin).map(|(k, v)| (k, s(v))));
    if let Some(g) = &event.gtid {
        h.push(("x-source-gtid", s(g.clone())));
    }
    if let Some(v) = event.version {
        h.push(("x-aggregate-version", HeaderValue::Int(v)));
    }
    // With the id, the aggregate's identity: order 42 and invoice 42 are different aggregates,
    // whose versions a consumer's stale gate must not compare.
    if let Some(t) = event.extra_value("aggregate_type") {
        h.push(("x-aggregate-type", s(t.to_string())));
    }
    if let Some(t) = &event.table {
        h.push(("x-outbox-table", s(t.to_string())));
    }
    h
}

/// The entries of the row's `headers` object a sink may copy: every name but the reserved
/// ones, which are dropped here (counted, and logged the first time each name is seen, so a
/// producer that sets one on every row does not flood the log).
pub fn row_headers(
    event: &OutboxEvent,
) -> impl Iterator<Item = (&String, &serde_json::Value)> + '_ {
    event.headers.iter().flatten().filter(move |(k, _)| {
        if !is_reserved(k) {
            return true;
        }
        static WARNED: Mutex<Option<HashSet<String>>> = Mutex::new(None);
        let first_time = WARNED
            .lock()
            .map(|mut w| {
                w.get_or_insert_with(HashSet::new)
                    .insert(k.to_ascii_lowercase())
            })
            .unwrap_or(false);
        RowHeaderDropped {
            name: k,
            event_id: &event.id,
            first_time,
        }
        .emit();
        false
    })
}

/// Values of dead records are cut here, so a record always fits.
pub(crate) const DEAD_VALUE_MAX: usize = 1024;

/// A value for a dead record's header: line breaks become spaces (no broker's headers take
/// them all) and it is cut at [`DEAD_VALUE_MAX`] bytes.
pub(crate) fn dead_value(s: &str) -> String {
    let mut out: String = s
        .chars()
        .map(|c| if c == '\r' || c == '\n' { ' ' } else { c })
        .collect();
    if out.len() > DEAD_VALUE_MAX {
        let mut end = DEAD_VALUE_MAX;
        while !out.is_char_boundary(end) {
            end -= 1;
        }
        out.truncate(end);
    }
    out
}

/// The headers of an event's dead record (body-less: it says why the event could not be
/// published and where it came from), as text.
pub fn dead_headers(
    event: &OutboxEvent,
    reason: &str,
    origin: &Origin,
) -> Vec<(&'static str, String)> {
    let mut h = vec![
        ("x-dead-reason", dead_value(reason)),
        ("x-source-position", dead_value(&event.position.to_string())),
        ("x-original-topic", dead_value(&event.topic)),
        ("x-aggregate-id", dead_value(&event.aggregate_id)),
        ("x-outbox-created-at", event.created_at_rfc3339()),
        ("x-original-size", event.payload.len().to_string()),
    ];
    h.extend(identity_headers(event, origin));
    h
}

/// What a dead record carries of the event's identity besides its position and id: the GTID
/// where the transaction had one, the relay and the source.
pub(crate) fn identity_headers<'a>(
    event: &'a OutboxEvent,
    origin: &'a Origin,
) -> impl Iterator<Item = (&'static str, String)> + 'a {
    event
        .gtid
        .iter()
        .map(|g| ("x-source-gtid", dead_value(g)))
        .chain(origin_headers(origin))
}

/// `x-outbox-relay` and `x-outbox-source`, each where known.
fn origin_headers(origin: &Origin) -> impl Iterator<Item = (&'static str, String)> + '_ {
    [
        (RELAY_HEADER, &origin.relay),
        (SOURCE_HEADER, &origin.source.id),
    ]
    .into_iter()
    .filter(|(_, v)| !v.is_empty())
    .map(|(k, v)| (k, v.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Kafka and NATS header bytes of typed column values: what Kafka Connect's
    /// SimpleHeaderConverter writes for the same Java values (`Boolean.toString`,
    /// `Long.toString`, `Double.toString`, `Float.toString`).
    #[test]
    fn typed_values_are_written_as_kafka_connect_writes_them() {
        let cases: &[(HeaderValue, &str)] = &[
            (HeaderValue::Bool(true), "true"),
            (HeaderValue::Bool(false), "false"),
            (HeaderValue::Int(-42), "-42"),
            (HeaderValue::Str("t".into()), "t"),
            (HeaderValue::Float(1.0), "1.0"),
            (HeaderValue::Float(1.5), "1.5"),
            (HeaderValue::Float(0.001), "0.001"),
            (HeaderValue::Float(0.0001), "1.0E-4"),
            (HeaderValue::Float(1234567.0), "1234567.0"),
            (HeaderValue::Float(12345678.0), "1.2345678E7"),
            (HeaderValue::Float(-2.5e-10), "-2.5E-10"),
            (HeaderValue::Float(1e21), "1.0E21"),
            (HeaderValue::Float(0.0), "0.0"),
            (HeaderValue::Float(-0.0), "-0.0"),
            (HeaderValue::Float(f64::NAN), "NaN"),
            (HeaderValue::Float(f64::NEG_INFINITY), "-Infinity"),
            (HeaderValue::Float32(0.1), "0.1"),
            (HeaderValue::Float32(3.4e38), "3.4E38"),
        ];
        for (v, want) in cases {
            assert_eq!(v.to_text(), *want, "{v:?}");
        }
    }

    #[test]
    fn reserved_names_are_recognised_without_case() {
        for name in [
            "x-aggregate-version",
            "X-Aggregate-Id",
            "x-source-position",
            "x-source-gtid",
            "x-outbox-created-at",
            "x-outbox-table",
            "x-outboxd-exchange",
            "X-Outboxd-Routing-Key",
            "x-outboxd-error",
            "x-partition",
            "x-partition-4",
            "x-dead-reason",
            "x-original-topic",
            "x-death",
            "CC",
            "cc",
            "BCC",
            "Nats-Msg-Id",
            "cloudEvents:id",
        ] {
            assert!(is_reserved(name), "{name} should be reserved");
        }
        for name in [
            "traceparent",
            "tenant_id",
            "x-tenant",
            "ccx",
            "content-kind",
        ] {
            assert!(!is_reserved(name), "{name} should be allowed");
        }
    }

    /// The aggregate's type travels when the table has the column (it is read as an extra
    /// column then), and only then.
    #[test]
    fn the_aggregate_type_is_sent_when_the_row_has_one() {
        let mut event = crate::sink::test_event();
        let names = |e: &OutboxEvent| -> Vec<&'static str> {
            relay_headers(e, &Origin::default())
                .into_iter()
                .map(|(k, _)| k)
                .collect()
        };
        assert!(!names(&event).contains(&"x-aggregate-type"));
        event.extra = vec![("aggregate_type".into(), "order".into())];
        let h = relay_headers(&event, &Origin::default());
        assert!(
            h.contains(&("x-aggregate-type", HeaderValue::Str("order".into()))),
            "{h:?}"
        );
        assert!(is_reserved("x-aggregate-type"), "a row cannot forge it");
    }

    /// Every message names its relay and its source (the event's identity with its position
    /// and id); a dead record too, with the GTID where the transaction had one.
    #[test]
    fn messages_and_dead_records_name_the_relay_and_the_source() {
        let mut event = crate::sink::test_event();
        event.gtid = Some("0-1-57".into());
        let origin = Origin {
            relay: "billing".into(),
            source: crate::identity::SourceIdentity {
                id: "mariadb:1".into(),
                ..Default::default()
            },
            accept_new_source: false,
        };
        let h = relay_headers(&event, &origin);
        assert!(h.contains(&(RELAY_HEADER, HeaderValue::Str("billing".into()))));
        assert!(h.contains(&(SOURCE_HEADER, HeaderValue::Str("mariadb:1".into()))));
        let d = dead_headers(&event, "bad", &origin);
        for (k, v) in [
            (RELAY_HEADER, "billing"),
            (SOURCE_HEADER, "mariadb:1"),
            ("x-source-gtid", "0-1-57"),
        ] {
            assert!(d.contains(&(k, v.to_string())), "{k} in {d:?}");
        }
        // Unknown (binlog files, tests): not sent rather than sent empty.
        let none = relay_headers(&event, &Origin::default());
        assert!(none
            .iter()
            .all(|(k, _)| *k != SOURCE_HEADER && *k != RELAY_HEADER));
    }

    #[test]
    fn row_headers_drop_every_reserved_name_and_count_them() {
        let mut event = crate::sink::test_event();
        let row = serde_json::json!({
            "traceparent": "00-abc-def-01",
            "x-aggregate-version": "not a number",
            "CC": ["other.topic"],
            "x-source-position": "forged",
            "tenant_id": 7
        });
        event.headers = row.as_object().cloned();
        let before = crate::telemetry::get().row_headers_dropped.get();
        let kept: Vec<&str> = row_headers(&event).map(|(k, _)| k.as_str()).collect();
        assert_eq!(kept, ["traceparent", "tenant_id"]);
        assert!(crate::telemetry::get().row_headers_dropped.get() >= before + 3);
    }
}
