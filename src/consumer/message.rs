//! A received message as the consumer kit sees it: the event id from `message_id`, the
//! relay's headers (docs/message-format.md) decoded, the body untouched. Built from a lapin delivery by
//! the runner, or by hand ([`Message::new`]) for events that arrive some other way.

use super::ConsumerError;
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use uuid::Uuid;

#[derive(Debug, Clone)]
pub struct Message {
    /// The event id (`message_id`): the key of `processed_messages`.
    pub id: Uuid,
    /// The event's topic: the `type` property, else the routing key.
    pub topic: String,
    /// `x-aggregate-type`, when present: with the id, what the stale gate keys on (order 42
    /// and invoice 42 are different aggregates).
    pub aggregate_type: Option<String>,
    /// `x-aggregate-id`, when present.
    pub aggregate_id: Option<String>,
    /// `x-outbox-table`, when the relay reads several outbox tables: with the type and the
    /// id, what the stale gate keys on (aggregate 7 of one table is not aggregate 7 of another).
    pub table: Option<String>,
    /// `x-aggregate-version`, when present: what the stale gate compares.
    pub version: Option<i64>,
    /// `x-partition`, when the relay partitions.
    pub partition: Option<u32>,
    /// The broker delivered it before (to this or another consumer) without an ack.
    pub redelivered: bool,
    pub exchange: String,
    pub routing_key: String,
    /// All properties and headers as received (parking keeps them).
    pub properties: BasicProperties,
    pub body: Vec<u8>,
}

impl Message {
    /// A message built by hand: id, topic and body; add the aggregate with
    /// [`Message::with_aggregate`].
    pub fn new(id: Uuid, topic: &str, body: impl Into<Vec<u8>>) -> Message {
        Message {
            id,
            topic: topic.to_string(),
            aggregate_type: None,
            aggregate_id: None,
            table: None,
            version: None,
            partition: None,
            redelivered: false,
            exchange: String::new(),
            routing_key: topic.to_string(),
            properties: BasicProperties::default().with_message_id(id.to_string().into()),
            body: body.into(),
        }
    }

    pub fn with_aggregate(mut self, aggregate_id: &str, version: Option<i64>) -> Message {
        self.aggregate_id = Some(aggregate_id.to_string());
        self.version = version;
        self
    }

    /// Sets the outbox table the event came from (`x-outbox-table`).
    pub fn with_table(mut self, table: &str) -> Message {
        self.table = Some(table.to_string());
        self
    }

    /// Sets the aggregate's type (`x-aggregate-type`).
    pub fn with_aggregate_type(mut self, aggregate_type: &str) -> Message {
        self.aggregate_type = Some(aggregate_type.to_string());
        self
    }

    /// Reads the envelope of a delivery. An unusable envelope is a [`ConsumerError::BadMessage`]:
    /// without a UUID message id there is nothing to deduplicate on.
    pub fn from_parts(
        exchange: &str,
        routing_key: &str,
        redelivered: bool,
        properties: BasicProperties,
        body: Vec<u8>,
    ) -> Result<Message, ConsumerError> {
        let raw_id = properties
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .ok_or_else(|| {
                ConsumerError::BadMessage(
                    "no message_id property: the event id is what makes a repeat recognisable"
                        .into(),
                )
            })?;
        let id = Uuid::parse_str(raw_id.trim()).map_err(|e| {
            ConsumerError::BadMessage(format!("message_id {raw_id:?} is not a UUID: {e}"))
        })?;
        let headers = properties.headers().clone().unwrap_or_default();
        let aggregate_type = header_string(&headers, "x-aggregate-type");
        let aggregate_id = header_string(&headers, "x-aggregate-id");
        let table = header_string(&headers, "x-outbox-table");
        let version = match headers.inner().get("x-aggregate-version") {
            None | Some(AMQPValue::Void) => None,
            Some(v) => Some(header_int(v).ok_or_else(|| {
                ConsumerError::BadMessage(format!("x-aggregate-version {v:?} is not an integer"))
            })?),
        };
        let partition = headers
            .inner()
            .get("x-partition")
            .and_then(header_int)
            .and_then(|p| u32::try_from(p).ok());
        let topic = properties
            .kind()
            .as_ref()
            .map(|t| t.as_str().to_string())
            .unwrap_or_else(|| routing_key.to_string());
        Ok(Message {
            id,
            topic,
            aggregate_type,
            aggregate_id,
            table,
            version,
            partition,
            redelivered,
            exchange: exchange.to_string(),
            routing_key: routing_key.to_string(),
            properties,
            body,
        })
    }

    /// The body as JSON. A body that does not decode is a permanent failure of the message
    /// (it counts towards `--max-failures`, then `--on-poison` decides).
    pub fn json<T: serde::de::DeserializeOwned>(&self) -> Result<T, ConsumerError> {
        serde_json::from_slice(&self.body).map_err(|e| {
            ConsumerError::permanent(format!("body of {} is not the expected JSON: {e}", self.id))
        })
    }

    /// A header as text (strings, and integers rendered in decimal).
    pub fn header(&self, name: &str) -> Option<String> {
        let h = self.properties.headers().as_ref()?;
        header_string(h, name)
    }
}

fn header_string(h: &FieldTable, name: &str) -> Option<String> {
    match h.inner().get(name)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_string()),
        v => header_int(v).map(|i| i.to_string()),
    }
}

/// Integer headers arrive in whatever width the publisher chose (the relay sends a signed
/// 64-bit value); other publishers send decimal strings.
fn header_int(v: &AMQPValue) -> Option<i64> {
    Some(match v {
        AMQPValue::ShortShortInt(i) => *i as i64,
        AMQPValue::ShortShortUInt(i) => *i as i64,
        AMQPValue::ShortInt(i) => *i as i64,
        AMQPValue::ShortUInt(i) => *i as i64,
        AMQPValue::LongInt(i) => *i as i64,
        AMQPValue::LongUInt(i) => *i as i64,
        AMQPValue::LongLongInt(i) => *i,
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes())
            .ok()?
            .trim()
            .parse()
            .ok()?,
        AMQPValue::ShortString(s) => s.as_str().trim().parse().ok()?,
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(id: &str, headers: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut t = FieldTable::default();
        for (k, v) in headers {
            t.insert((*k).into(), v.clone());
        }
        BasicProperties::default()
            .with_message_id(id.into())
            .with_type("invoice.issued".into())
            .with_headers(t)
    }

    #[test]
    fn reads_the_relays_envelope() {
        let id = "0190a5c4-7e2b-7000-8000-00000000abcd";
        let m = Message::from_parts(
            "outbox",
            "invoice.issued",
            true,
            props(
                id,
                &[
                    ("x-aggregate-id", AMQPValue::LongString("cust-7".into())),
                    ("x-aggregate-type", AMQPValue::LongString("customer".into())),
                    ("x-aggregate-version", AMQPValue::LongLongInt(42)),
                    ("x-partition", AMQPValue::LongString("3".into())),
                ],
            ),
            br#"{"total_cents": 1250}"#.to_vec(),
        )
        .unwrap();
        assert_eq!(m.id.to_string(), id);
        assert_eq!(m.topic, "invoice.issued");
        assert_eq!(m.aggregate_id.as_deref(), Some("cust-7"));
        assert_eq!(m.aggregate_type.as_deref(), Some("customer"));
        assert_eq!(m.version, Some(42));
        assert_eq!(m.partition, Some(3));
        assert!(m.redelivered);
        let v: serde_json::Value = m.json().unwrap();
        assert_eq!(v["total_cents"], 1250);
        assert_eq!(m.header("x-aggregate-version").as_deref(), Some("42"));
    }

    #[test]
    fn bad_envelopes_are_bad_messages() {
        let none = Message::from_parts("x", "t", false, BasicProperties::default(), vec![]);
        assert!(matches!(none, Err(ConsumerError::BadMessage(_))));
        let not_uuid = Message::from_parts("x", "t", false, props("order-17", &[]), vec![]);
        assert!(matches!(not_uuid, Err(ConsumerError::BadMessage(_))));
        let bad_version = Message::from_parts(
            "x",
            "t",
            false,
            props(
                "0190a5c4-7e2b-7000-8000-00000000abcd",
                &[("x-aggregate-version", AMQPValue::LongString("seven".into()))],
            ),
            vec![],
        );
        assert!(matches!(bad_version, Err(ConsumerError::BadMessage(_))));
        let m = Message::new(Uuid::nil(), "t", b"not json".to_vec());
        let e = m.json::<serde_json::Value>().unwrap_err();
        assert!(!e.is_retryable());
    }
}
