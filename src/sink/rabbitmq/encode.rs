//! One event as what goes on the wire: a persistent message with its properties and
//! headers, or, when it cannot be one (poison), a body-less dead record that always fits in
//! a frame. Pure and broker-free, so the rules for what becomes poison and how JSON headers
//! map onto AMQP field values can be read and unit-tested on their own.

use super::config::RabbitConfig;
use super::config::{APP_ID, DEAD_VALUE_MAX};
use super::RabbitSink;
use crate::event::OutboxEvent;
use crate::identity::Origin;
use crate::sink::format::Body;
use crate::sink::headers::{self, HeaderValue};
use bytes::Bytes;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::BasicProperties;

impl RabbitSink {
    /// What the event is sent as (see [`render`]), under the broker's size limit learnt so far.
    pub(super) fn render(
        &self,
        event: &OutboxEvent,
        header_limit: usize,
        route: Result<(String, String), String>,
    ) -> Outgoing {
        let broker_max = self
            .broker_max_message
            .load(std::sync::atomic::Ordering::Acquire);
        render(
            &self.cfg,
            broker_max,
            event,
            header_limit,
            route,
            &self.origin,
        )
    }
}

/// Headers of a normal message, or the reason it is poison.
fn headers(
    cfg: &RabbitConfig,
    event: &OutboxEvent,
    body: &Body,
    limit: usize,
    origin: &Origin,
) -> Result<FieldTable, String> {
    let mut t = FieldTable::default();
    // The row's headers never include a reserved name (see `sink::headers`): a row can
    // neither forge the relay's headers nor route its message elsewhere with `CC`/`BCC`.
    for (k, v) in headers::row_headers(event) {
        let key = ShortString::try_new(k.as_str())
            .map_err(|_| format!("header name of {} bytes: AMQP allows at most 255", k.len()))?;
        t.insert(key, json_to_amqp(v)?);
    }
    // `--header COLUMN=NAME` (names checked at start: none is reserved) wins over the
    // row's headers object.
    for (k, v) in cfg.message.column_headers(event) {
        t.insert(k.into(), amqp_value(v));
    }
    for (k, v) in body.headers.iter().cloned() {
        t.insert(k.into(), amqp_value(v));
    }
    for (k, v) in standard_headers(event, origin) {
        t.insert(k.into(), v);
    }
    for (k, v) in cfg.partitioning.headers(&event.aggregate_id) {
        t.insert(k, v);
    }
    let size = table_size(&t);
    if size > limit {
        return Err(format!(
            "headers encode to {size} bytes, more than the {limit} allowed"
        ));
    }
    Ok(t)
}

/// What the event is sent as: a normal message, or a dead-letter record with a reason.
/// `broker_max` is the broker's message size limit when known (0: not known). Shared with the
/// RabbitMQ stream sink, whose messages carry the same properties and headers.
pub(crate) fn render(
    cfg: &RabbitConfig,
    broker_max: usize,
    event: &OutboxEvent,
    header_limit: usize,
    route: Result<(String, String), String>,
    origin: &Origin,
) -> Outgoing {
    let reason = if let Some(p) = &event.poison {
        Some(p.clone())
    } else if event.payload.len() > cfg.max_message_bytes {
        Some(format!(
            "payload is {} bytes, more than --max-message-bytes {}",
            event.payload.len(),
            cfg.max_message_bytes
        ))
    } else if event.topic.len() > 255 {
        Some(format!(
            "topic is {} bytes: a message type holds at most 255",
            event.topic.len()
        ))
    } else {
        route.as_ref().err().cloned()
    };
    let message = match reason {
            Some(r) => Err(r),
            None => cfg.message.body(event).and_then(|body| {
                if body.bytes.len() > cfg.max_message_bytes {
                    return Err(format!(
                        "the {:?} body is {} bytes, more than --max-message-bytes {}",
                        cfg.message.format,
                        body.bytes.len(),
                        cfg.max_message_bytes
                    ));
                }
                if broker_max > 0 && body.bytes.len() > broker_max {
                    return Err(format!(
                        "the {:?} body is {} bytes, more than RabbitMQ's max_message_size {broker_max} \
                         (the broker closed the channel with 406 PRECONDITION_FAILED for it; \
                         raise max_message_size in rabbitmq.conf, or lower --max-message-bytes)",
                        cfg.message.format,
                        body.bytes.len(),
                    ));
                }
                let h = headers(cfg, event, &body, header_limit, origin)?;
                Ok((body, h))
            }),
        };
    let props = BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(event.id.hyphenated().to_string().into())
        .with_timestamp(event.created_at.timestamp().max(0) as u64)
        .with_app_id(APP_ID.into());
    match (message, route) {
        (Ok((body, h)), Ok((exchange, routing_key))) => Outgoing {
            exchange,
            routing_key,
            body: body.bytes,
            props: props
                .with_content_type(body.content_type.into())
                .with_type(event.topic.clone().into())
                .with_headers(h),
            dead: None,
        },
        (Ok(_), Err(reason)) | (Err(reason), _) => {
            let mut h = FieldTable::default();
            for (k, v) in [
                ("x-dead-reason", truncate(&reason)),
                ("x-source-position", event.position.to_string()),
                ("x-original-topic", truncate(&event.topic)),
                ("x-aggregate-id", truncate(&event.aggregate_id)),
                ("x-outbox-created-at", event.created_at_rfc3339()),
            ]
            .into_iter()
            .chain(headers::identity_headers(event, origin))
            {
                h.insert(k.into(), AMQPValue::LongString(v.into()));
            }
            h.insert(
                "x-original-size".into(),
                AMQPValue::LongLongInt(event.payload.len() as i64),
            );
            Outgoing {
                exchange: String::new(),
                routing_key: format!("{}.dead", cfg.exchange),
                body: Bytes::new(),
                // A row without a usable id gets one from its position: dead records
                // never share the nil UUID (one idempotency key for all of them).
                props: props
                    .with_message_id(event.dead_record_id().hyphenated().to_string().into())
                    .with_headers(h),
                dead: Some(reason),
            }
        }
    }
}

/// The broker's message size limit when `e` is its refusal of a message over it: RabbitMQ
/// closes the channel with `406 PRECONDITION_FAILED - message size N is larger than
/// configured max size M` (`… than max size M` at its hard limit).
pub(super) fn broker_size_limit(e: &lapin::Error) -> Option<usize> {
    use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
    match e.kind() {
        lapin::ErrorKind::ProtocolError(p)
            if matches!(
                p.kind(),
                AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED)
            ) =>
        {
            size_refusal_limit(p.get_message().as_str())
        }
        _ => None,
    }
}

/// Records the broker's size limit in `known` when `e` is a refusal for size (see
/// [`broker_size_limit`]); [`RabbitSink::render`] then dead-letters a larger body.
pub(super) fn learn_size_limit(e: &lapin::Error, known: &std::sync::atomic::AtomicUsize) {
    if let Some(max) = broker_size_limit(e) {
        if known.swap(max, std::sync::atomic::Ordering::AcqRel) != max {
            tracing::warn!(max_message_size = max, "RabbitMQ refuses message bodies over {max} bytes (its max_message_size): such events are dead-lettered from now on");
        }
    }
}

/// `M` of RabbitMQ's "message size N is larger than [configured] max size M".
pub(super) fn size_refusal_limit(text: &str) -> Option<usize> {
    let rest = &text[text.find("message size ")?..];
    let tail = &rest[rest.find("max size ")? + "max size ".len()..];
    let digits: &str = &tail[..tail
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(tail.len())];
    digits.parse().ok()
}

/// One message ready to go out.
pub(crate) struct Outgoing {
    pub(crate) exchange: String,
    pub(crate) routing_key: String,
    pub(crate) body: Bytes,
    pub(crate) props: BasicProperties,
    /// The dead-letter reason when this is a poison record.
    pub(crate) dead: Option<String>,
}

/// The relay's own headers in AMQP encoding.
fn standard_headers(event: &OutboxEvent, origin: &Origin) -> Vec<(&'static str, AMQPValue)> {
    headers::relay_headers(event, origin)
        .into_iter()
        .map(|(k, v)| (k, amqp_value(v)))
        .collect()
}

fn amqp_value(v: HeaderValue) -> AMQPValue {
    match v {
        HeaderValue::Str(s) => AMQPValue::LongString(s.into()),
        HeaderValue::Int(i) => AMQPValue::LongLongInt(i),
        HeaderValue::Bool(b) => AMQPValue::Boolean(b),
        HeaderValue::Float(f) => AMQPValue::Double(f),
        HeaderValue::Float32(f) => AMQPValue::Float(f),
    }
}

/// JSON → AMQP field value: strings as long strings, integers as signed 64-bit (larger ones
/// as their decimal text, which loses nothing), other numbers as doubles, arrays as field
/// arrays, objects as nested tables, null as void.
pub fn json_to_amqp(v: &serde_json::Value) -> Result<AMQPValue, String> {
    use serde_json::Value as J;
    Ok(match v {
        J::Null => AMQPValue::Void,
        J::Bool(b) => AMQPValue::Boolean(*b),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            (None, _) if n.is_u64() => AMQPValue::LongString(n.to_string().into()),
            (None, Some(f)) => AMQPValue::Double(f),
            (None, None) => AMQPValue::LongString(n.to_string().into()),
        },
        J::String(s) => AMQPValue::LongString(LongString::from(s.as_bytes())),
        J::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(json_to_amqp).collect::<Result<Vec<_>, _>>()?,
        )),
        J::Object(o) => {
            let mut t = FieldTable::default();
            for (k, v) in o {
                let key = ShortString::try_new(k.as_str()).map_err(|_| {
                    format!("header name of {} bytes: AMQP allows at most 255", k.len())
                })?;
                t.insert(key, json_to_amqp(v)?);
            }
            AMQPValue::FieldTable(t)
        }
    })
}

/// Encoded size of a field table in bytes (AMQP 0-9-1 as RabbitMQ reads it).
pub fn table_size(t: &FieldTable) -> usize {
    4 + t
        .inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + 1 + value_size(v))
        .sum::<usize>()
}

fn value_size(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.len(),
        AMQPValue::ByteArray(b) => 4 + b.len(),
        AMQPValue::FieldArray(a) => {
            4 + a
                .as_slice()
                .iter()
                .map(|v| 1 + value_size(v))
                .sum::<usize>()
        }
        AMQPValue::FieldTable(t) => table_size(t),
        AMQPValue::Void => 0,
    }
}

fn truncate(s: &str) -> String {
    if s.len() <= DEAD_VALUE_MAX {
        return s.to_string();
    }
    let mut end = DEAD_VALUE_MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}
