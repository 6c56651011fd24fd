//! One event as a Kafka record: its topic (the `--routing-key` template, as Debezium's Outbox
//! Event Router names topics with `--column debezium`), its key (the aggregate id, so Kafka's
//! partitioner keeps each aggregate in one partition, in order), its value (the body of
//! `--format`; CloudEvents binary mode uses the Kafka binding's `ce_` headers) and its headers
//! (the row's, `--header` columns, the relay's own as on every sink, and `id` = the event id as
//! the Outbox Event Router sets it; `x-outbox-relay` = the relay's name, by which it finds its
//! own records in a partition's tail). An event that cannot be a record becomes a body-less dead
//! record on the dead topic that says why.

use super::config::{valid_topic, KafkaConfig};
use crate::event::OutboxEvent;
use crate::identity::{Origin, RELAY_HEADER};
use crate::sink::headers;
use bytes::Bytes;

/// Bytes a header costs in a record beyond its name and value (two varint lengths).
const HEADER_OVERHEAD: usize = 10;

/// A record ready to go out.
#[derive(Debug, Clone)]
pub(crate) struct Outgoing {
    pub topic: String,
    pub key: String,
    pub value: Bytes,
    /// A tombstone: the record has no value at all (not an empty one).
    pub tombstone: bool,
    pub headers: Vec<(String, String)>,
    /// The record's timestamp (milliseconds since the epoch): the event's `created_at`, or its
    /// transaction's commit time when the table has none, as Debezium's Outbox Event Router
    /// takes it from `table.field.event.timestamp`.
    pub timestamp_ms: i64,
    /// The partition the row names (`--kafka-partition-column`); `None`: the key's.
    pub partition: Option<i32>,
    /// The reason, when this is a dead record instead of the event.
    pub dead: Option<String>,
}

impl Outgoing {
    /// What the record weighs against `--kafka-max-message-bytes`.
    pub(crate) fn size(&self) -> usize {
        self.key.len()
            + self.value.len()
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len() + HEADER_OVERHEAD)
                .sum::<usize>()
    }
}

/// Sets `name`, replacing an earlier value: Kafka keeps repeated header names, and a consumer
/// reading the first of two `id`s would read the wrong one.
fn put(h: &mut Vec<(String, String)>, name: &str, value: String) {
    h.retain(|(k, _)| k != name);
    h.push((name.to_string(), value));
}

/// The CloudEvents attribute header `cloudEvents:x` (AMQP binding) as the Kafka binding names
/// it: `ce_x`.
fn kafka_header_name(name: &str) -> String {
    match name.strip_prefix("cloudEvents:") {
        Some(attr) => format!("ce_{attr}"),
        None => name.to_string(),
    }
}

/// The topic of an event, or why it has none.
pub(crate) fn topic(cfg: &KafkaConfig, event: &OutboxEvent) -> Result<String, String> {
    let t = cfg.message.routing_key(event)?;
    valid_topic(&t)?;
    if t == cfg.options.dead_topic {
        return Err(format!(
            "its topic {t} is the dead topic, where dead records go: rename the topic, or change --routing-key"
        ));
    }
    Ok(t)
}

/// The partition `event` names in `--kafka-partition-column`: `None` without one, or when the
/// row's value is NULL (the key places it then, as Debezium's router leaves the partition to
/// the producer); an error for a value that is no partition number.
fn named_partition(cfg: &KafkaConfig, event: &OutboxEvent) -> Result<Option<i32>, String> {
    let Some(column) = &cfg.options.partition_column else {
        return Ok(None);
    };
    let Some(v) = event.extra_column(column) else {
        return Ok(None);
    };
    match v.typed {
        crate::event::Typed::Int(n) => i32::try_from(n)
            .ok()
            .filter(|p| *p >= 0)
            .map(Some)
            .ok_or_else(|| {
                format!("--kafka-partition-column {column}: {n} is not a partition number")
            }),
        _ => Err(format!(
            "--kafka-partition-column {column}: {:?} is not an integer column's value",
            headers::dead_value(&v.text)
        )),
    }
}

/// The partition of `out` in a topic of `partitions`: the one its row names, or Kafka's default
/// partitioner over the key. A named partition the topic does not have is the reason the event
/// cannot be a record.
pub(crate) fn partition(out: &Outgoing, partitions: i32) -> Result<i32, String> {
    match out.partition {
        None => Ok(crate::sink::partition::partition_of(&out.key, partitions as u32) as i32),
        Some(p) if p < partitions => Ok(p),
        Some(p) => Err(format!(
            "its partition column names partition {p}, but topic {} has {partitions} partitions",
            out.topic
        )),
    }
}

fn normal(cfg: &KafkaConfig, event: &OutboxEvent, origin: &Origin) -> Result<Outgoing, String> {
    let tombstone = cfg.options.tombstones && event.empty_payload;
    if let Some(p) = &event.poison {
        if !tombstone {
            return Err(p.clone());
        }
    }
    let topic = topic(cfg, event)?;
    let partition = named_partition(cfg, event)?;
    let body = if tombstone {
        None
    } else {
        Some(cfg.message.body(event)?)
    };
    let mut h: Vec<(String, String)> = Vec::new();
    // The row's headers never include a reserved name (see `sink::headers`).
    for (k, v) in headers::row_headers(event) {
        let text = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        put(&mut h, k, text);
    }
    for (k, v) in cfg.message.column_headers(event) {
        put(&mut h, k, v.to_text());
    }
    if let Some(body) = &body {
        for (k, v) in &body.headers {
            put(&mut h, &kafka_header_name(k), v.to_text());
        }
        put(&mut h, "content-type", body.content_type.clone());
    }
    for (k, v) in headers::relay_headers(event, origin) {
        put(&mut h, k, v.to_text());
    }
    put(&mut h, "id", event.id.hyphenated().to_string());
    put(&mut h, RELAY_HEADER, cfg.name.clone());
    let out = Outgoing {
        topic,
        key: event.aggregate_id.clone(),
        value: body.map(|b| b.bytes).unwrap_or_default(),
        tombstone,
        headers: h,
        timestamp_ms: event.created_at.timestamp_millis(),
        partition,
        dead: None,
    };
    let limit = cfg.options.max_message_bytes;
    if out.size() > limit {
        return Err(format!(
            "the record is {} bytes with its key and headers, more than --kafka-max-message-bytes {limit}",
            out.size()
        ));
    }
    Ok(out)
}

/// The event as it goes out: the record, or its dead record. `refused` is the broker's reason
/// when it already refused this event's record as too large.
pub(crate) fn render(
    cfg: &KafkaConfig,
    event: &OutboxEvent,
    refused: Option<&str>,
    origin: &Origin,
) -> Outgoing {
    let rendered = match refused {
        Some(r) => Err(r.to_string()),
        None => normal(cfg, event, origin),
    };
    match rendered {
        Ok(o) => o,
        Err(reason) => {
            let mut h: Vec<(String, String)> = Vec::new();
            for (k, v) in headers::dead_headers(event, &reason, origin) {
                put(&mut h, k, v);
            }
            put(
                &mut h,
                "id",
                event.dead_record_id().hyphenated().to_string(),
            );
            put(&mut h, RELAY_HEADER, cfg.name.clone());
            Outgoing {
                topic: cfg.options.dead_topic.clone(),
                key: headers::dead_value(&event.aggregate_id),
                value: Bytes::new(),
                tombstone: false,
                headers: h,
                timestamp_ms: event.created_at.timestamp_millis(),
                // The dead topic's partitions keep no order: the key places dead records.
                partition: None,
                dead: Some(reason),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The record of `e` as a relay that names no source renders it.
    fn render(cfg: &KafkaConfig, e: &OutboxEvent, refused: Option<&str>) -> Outgoing {
        super::render(cfg, e, refused, &Origin::default())
    }
    use crate::sink::format::{BodyFormat, MessageOptions};
    use crate::sink::kafka::config::KafkaOptions;
    use crate::sink::template::Template;
    use crate::sink::DeclareMode;
    use std::time::Duration;

    fn cfg(template: &str, format: BodyFormat) -> KafkaConfig {
        KafkaConfig {
            url: "kafka://127.0.0.1:9092".into(),
            name: "r1".into(),
            options: KafkaOptions::default(),
            message: MessageOptions {
                routing_key: Template::parse(template).unwrap(),
                format,
                ..MessageOptions::default()
            },
            declare: DeclareMode::Auto,
            op_timeout: Duration::from_secs(30),
            ca_file: None,
            cert_file: None,
            key_file: None,
        }
    }

    fn header<'a>(o: &'a Outgoing, name: &str) -> Vec<&'a str> {
        o.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    #[test]
    fn an_event_becomes_a_keyed_record_with_the_id_header() {
        let mut e = crate::sink::test_event();
        e.headers =
            Some(serde_json::from_str(r#"{"id": "forged", "traceparent": "00-ab"}"#).unwrap());
        let o = render(&cfg("outbox.event.{topic}", BodyFormat::Raw), &e, None);
        assert_eq!(o.dead, None);
        assert_eq!(o.topic, "outbox.event.invoice.issued");
        assert_eq!(o.key, "agg-1");
        assert_eq!(&o.value[..], br#"{"a": 1}"#);
        assert_eq!(header(&o, "id"), [e.id.hyphenated().to_string()]);
        assert_eq!(header(&o, "traceparent"), ["00-ab"]);
        assert_eq!(header(&o, "x-aggregate-id"), ["agg-1"]);
        assert_eq!(header(&o, "x-aggregate-version"), ["7"]);
        assert_eq!(header(&o, "content-type"), ["application/json"]);
        assert_eq!(header(&o, "x-outbox-relay"), ["r1"]);
    }

    /// The record's timestamp is the event's time (`created_at`, or the commit time without
    /// one), as Debezium's router sets it from `table.field.event.timestamp`; not the produce
    /// time.
    #[test]
    fn the_record_timestamp_is_the_events_time() {
        let e = crate::sink::test_event();
        let o = render(&cfg("{topic}", BodyFormat::Raw), &e, None);
        assert_eq!(o.timestamp_ms, 1_750_000_000_123);
        let mut poison = e.clone();
        poison.poison = Some("payload is NULL".into());
        let dead = render(&cfg("{topic}", BodyFormat::Raw), &poison, None);
        assert_eq!(
            (dead.dead.is_some(), dead.timestamp_ms),
            (true, 1_750_000_000_123)
        );
    }

    /// `--kafka-tombstones`: a NULL or blank payload is a record without a value, with its key
    /// and headers (Debezium's `route.tombstone.on.empty.payload`); without the flag, a dead
    /// record as before. Other poison stays dead either way.
    #[test]
    fn an_empty_payload_is_a_tombstone_only_when_asked() {
        let mut e = crate::sink::test_event();
        e.payload = Bytes::new();
        e.empty_payload = true;
        e.poison = Some("payload is NULL".into());
        let off = render(&cfg("{topic}", BodyFormat::Raw), &e, None);
        assert_eq!(off.dead.as_deref(), Some("payload is NULL"));
        let mut on = cfg("{topic}", BodyFormat::Raw);
        on.options.tombstones = true;
        let t = render(&on, &e, None);
        assert_eq!(t.dead, None);
        assert!(t.tombstone);
        assert_eq!(
            (t.topic.as_str(), t.key.as_str()),
            ("invoice.issued", "agg-1")
        );
        assert_eq!(header(&t, "id"), [e.id.hyphenated().to_string()]);
        assert!(header(&t, "content-type").is_empty());
        let mut bad = e.clone();
        bad.empty_payload = false;
        bad.poison = Some("id is NULL; payload is NULL".into());
        let d = render(&on, &bad, None);
        assert!(d.dead.is_some() && !d.tombstone);
        let normal = render(&on, &crate::sink::test_event(), None);
        assert!(!normal.tombstone && normal.dead.is_none());
    }

    /// `--kafka-partition-column`: the row's integer names the partition (Debezium's
    /// `col:partition`); NULL leaves it to the key; a value the topic has no partition for, or
    /// one that is no integer, makes a dead record.
    #[test]
    fn the_partition_column_names_the_partition() {
        use crate::event::{ColumnValue, Typed};
        let mut c = cfg("{topic}", BodyFormat::Raw);
        c.options.partition_column = Some("shard".into());
        let mut e = crate::sink::test_event();
        let keyed = render(&c, &e, None);
        assert_eq!(keyed.partition, None);
        assert_eq!(
            partition(&keyed, 4).unwrap(),
            crate::sink::partition::partition_of("agg-1", 4) as i32
        );
        e.extra = vec![(
            "shard".into(),
            ColumnValue {
                text: "2".into(),
                typed: Typed::Int(2),
            },
        )];
        let named = render(&c, &e, None);
        assert_eq!(named.partition, Some(2));
        assert_eq!(partition(&named, 4), Ok(2));
        let err = partition(&named, 2).unwrap_err();
        assert!(
            err.contains("partition 2") && err.contains("has 2 partitions"),
            "{err}"
        );
        e.extra = vec![("shard".into(), "two".into())];
        assert!(render(&c, &e, None)
            .dead
            .unwrap()
            .contains("not an integer"));
        e.extra = vec![(
            "shard".into(),
            ColumnValue {
                text: "-1".into(),
                typed: Typed::Int(-1),
            },
        )];
        assert!(render(&c, &e, None).dead.unwrap().contains("-1"));
    }

    /// Typed `--header` columns as Kafka Connect's SimpleHeaderConverter writes them.
    #[test]
    fn typed_column_headers_are_written_as_kafka_connect_writes_them() {
        use crate::event::{ColumnValue, Typed};
        let mut c = cfg("{topic}", BodyFormat::Raw);
        c.message.headers = crate::sink::format::parse_column_headers(&crate::sink::specs(
            "paid=paid,qty=qty,rate=rate",
        ))
        .unwrap();
        let mut e = crate::sink::test_event();
        e.extra = vec![
            (
                "paid".into(),
                ColumnValue {
                    text: "t".into(),
                    typed: Typed::Bool(true),
                },
            ),
            (
                "qty".into(),
                ColumnValue {
                    text: "3".into(),
                    typed: Typed::Int(3),
                },
            ),
            (
                "rate".into(),
                ColumnValue {
                    text: "1e-05".into(),
                    typed: Typed::Float(1e-5),
                },
            ),
        ];
        let o = render(&c, &e, None);
        assert_eq!(header(&o, "paid"), ["true"]);
        assert_eq!(header(&o, "qty"), ["3"]);
        assert_eq!(header(&o, "rate"), ["1.0E-5"]);
    }

    #[test]
    fn cloudevents_binary_mode_uses_the_kafka_binding_names() {
        let e = crate::sink::test_event();
        let o = render(&cfg("{topic}", BodyFormat::CloudeventsBinary), &e, None);
        assert_eq!(header(&o, "ce_id"), [e.id.hyphenated().to_string()]);
        assert_eq!(header(&o, "ce_type"), ["invoice.issued"]);
        assert_eq!(header(&o, "ce_specversion"), ["1.0"]);
        assert!(o
            .headers
            .iter()
            .all(|(k, _)| !k.starts_with("cloudEvents:")));
    }

    #[test]
    fn what_cannot_be_a_record_becomes_a_dead_record_with_the_reason() {
        let e = crate::sink::test_event();
        let bad_topic = render(&cfg("bad topic {topic}", BodyFormat::Raw), &e, None);
        assert_eq!(bad_topic.topic, "outbox.dead");
        assert!(bad_topic
            .dead
            .as_deref()
            .unwrap()
            .contains("[A-Za-z0-9._-]"));
        assert!(bad_topic.value.is_empty());
        let own = render(&cfg("outbox.dead", BodyFormat::Raw), &e, None);
        assert!(own.dead.as_deref().unwrap().contains("dead topic"));
        let mut small = cfg("{topic}", BodyFormat::Raw);
        small.options.max_message_bytes = 100;
        let big = render(&small, &e, None);
        assert!(big
            .dead
            .as_deref()
            .unwrap()
            .contains("--kafka-max-message-bytes 100"));
        assert_eq!(header(&big, "x-original-topic"), ["invoice.issued"]);
        let refused = render(
            &cfg("{topic}", BodyFormat::Raw),
            &e,
            Some("too large for the broker"),
        );
        assert_eq!(
            header(&refused, "x-dead-reason"),
            ["too large for the broker"]
        );
        assert_eq!(
            header(&refused, "id"),
            [e.dead_record_id().hyphenated().to_string()]
        );
    }
}
