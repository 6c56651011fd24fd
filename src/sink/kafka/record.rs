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
pub struct Outgoing {
    pub topic: String,
    pub key: String,
    pub value: Bytes,
    pub headers: Vec<(String, String)>,
    /// The reason, when this is a dead record instead of the event.
    pub dead: Option<String>,
}

impl Outgoing {
    /// What the record weighs against `--kafka-max-message-bytes`.
    pub fn size(&self) -> usize {
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
pub fn topic(cfg: &KafkaConfig, event: &OutboxEvent) -> Result<String, String> {
    let t = cfg.message.routing_key(event)?;
    valid_topic(&t)?;
    if t == cfg.options.dead_topic {
        return Err(format!(
            "its topic {t} is the dead topic, where dead records go: rename the topic, or change --routing-key"
        ));
    }
    Ok(t)
}

fn normal(cfg: &KafkaConfig, event: &OutboxEvent, origin: &Origin) -> Result<Outgoing, String> {
    if let Some(p) = &event.poison {
        return Err(p.clone());
    }
    let topic = topic(cfg, event)?;
    let body = cfg.message.body(event)?;
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
        put(&mut h, k, v);
    }
    for (k, v) in &body.headers {
        put(&mut h, &kafka_header_name(k), v.to_text());
    }
    put(&mut h, "content-type", body.content_type.clone());
    for (k, v) in headers::relay_headers(event, origin) {
        put(&mut h, k, v.to_text());
    }
    put(&mut h, "id", event.id.hyphenated().to_string());
    put(&mut h, RELAY_HEADER, cfg.name.clone());
    let out = Outgoing {
        topic,
        key: event.aggregate_id.clone(),
        value: body.bytes,
        headers: h,
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
pub fn render(
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
                headers: h,
                dead: Some(reason),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::format::{BodyFormat, MessageOptions};
    use crate::sink::kafka::config::KafkaOptions;
    use crate::sink::rabbitmq::DeclareMode;
    use crate::sink::template::Template;
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
        let o = render(
            &cfg("outbox.event.{topic}", BodyFormat::Raw),
            &e,
            None,
            &Origin::default(),
        );
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

    #[test]
    fn cloudevents_binary_mode_uses_the_kafka_binding_names() {
        let e = crate::sink::test_event();
        let o = render(
            &cfg("{topic}", BodyFormat::CloudeventsBinary),
            &e,
            None,
            &Origin::default(),
        );
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
        let bad_topic = render(
            &cfg("bad topic {topic}", BodyFormat::Raw),
            &e,
            None,
            &Origin::default(),
        );
        assert_eq!(bad_topic.topic, "outbox.dead");
        assert!(bad_topic
            .dead
            .as_deref()
            .unwrap()
            .contains("[A-Za-z0-9._-]"));
        assert!(bad_topic.value.is_empty());
        let own = render(
            &cfg("outbox.dead", BodyFormat::Raw),
            &e,
            None,
            &Origin::default(),
        );
        assert!(own.dead.as_deref().unwrap().contains("dead topic"));
        let mut small = cfg("{topic}", BodyFormat::Raw);
        small.options.max_message_bytes = 100;
        let big = render(&small, &e, None, &Origin::default());
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
            &Origin::default(),
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
