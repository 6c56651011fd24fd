//! One event as an AMQP 1.0 message for a stream: the AMQP sink's rendering (the same
//! properties, relay headers, row headers, formats and poison rules, see
//! docs/message-format.md) carried over into AMQP 1.0 sections, plus the publishing id.
//! AMQP 1.0 application properties hold only simple values, so a row header that is a JSON
//! array or object travels as its JSON text.

use super::ids::PUBLISHING_ID_HEADER;
use crate::sink::rabbitmq::Outgoing;
use lapin::types::AMQPValue;
use rabbitmq_stream_client::types::{Message, SimpleValue};

/// The stream message of a rendered event, with its publishing id.
pub fn to_message(out: &Outgoing, publishing_id: u64) -> Message {
    let p = &out.props;
    let mut props = Message::builder()
        .publising_id(publishing_id)
        .body(out.body.to_vec())
        .properties();
    if let Some(id) = p.message_id() {
        props = props.message_id(id.as_str().to_string());
    }
    if let Some(ct) = p.content_type() {
        props = props.content_type(ct.as_str());
    }
    // AMQP 1.0 has no `type`: the topic goes into `subject`, where stream clients look for it.
    if let Some(kind) = p.kind() {
        props = props.subject(kind.as_str().to_string());
    }
    if let Some(ts) = p.timestamp() {
        if let Some(t) = chrono::DateTime::from_timestamp(*ts as i64, 0) {
            props = props.creation_time(t);
        }
    }
    let mut app = props.message_builder().application_properties();
    if let Some(h) = p.headers() {
        for (k, v) in h.inner() {
            app = app.insert(k.as_str(), simple(v));
        }
    }
    if let Some(a) = p.app_id() {
        app = app.insert("app-id", a.as_str());
    }
    app.insert(PUBLISHING_ID_HEADER, publishing_id)
        .message_builder()
        .build()
}

fn simple(v: &AMQPValue) -> SimpleValue {
    match v {
        AMQPValue::Boolean(b) => SimpleValue::Boolean(*b),
        AMQPValue::LongLongInt(i) => SimpleValue::Long(*i),
        AMQPValue::LongInt(i) => SimpleValue::Long(i64::from(*i)),
        AMQPValue::Double(d) => SimpleValue::Double((*d).into()),
        AMQPValue::LongString(s) => {
            SimpleValue::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::ShortString(s) => SimpleValue::String(s.as_str().to_string()),
        AMQPValue::Void => SimpleValue::Null,
        other => SimpleValue::String(to_json(other).to_string()),
    }
}

/// A nested header value as JSON (the row's headers object is JSON to begin with).
fn to_json(v: &AMQPValue) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        AMQPValue::Boolean(b) => J::Bool(*b),
        AMQPValue::LongLongInt(i) => J::from(*i),
        AMQPValue::LongInt(i) => J::from(*i),
        AMQPValue::Double(d) => J::from(*d),
        AMQPValue::LongString(s) => J::String(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => J::String(s.as_str().to_string()),
        AMQPValue::FieldArray(a) => J::Array(a.as_slice().iter().map(to_json).collect()),
        AMQPValue::FieldTable(t) => J::Object(
            t.inner()
                .iter()
                .map(|(k, v)| (k.as_str().to_string(), to_json(v)))
                .collect(),
        ),
        AMQPValue::Void => J::Null,
        other => J::String(format!("{other:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::rabbitmq::{render, RabbitConfig};

    #[test]
    fn carries_the_amqp_properties_and_headers_and_the_publishing_id() {
        let mut event = crate::sink::test_event();
        let mut row = serde_json::Map::new();
        row.insert("tenant".into(), serde_json::json!("acme"));
        row.insert("tags".into(), serde_json::json!(["a", 1]));
        event.headers = Some(row);
        let cfg = super::super::tests::message_config();
        let out = render(
            &cfg,
            0,
            &event,
            64 * 1024,
            Ok((String::new(), String::new())),
        );
        let m = to_message(&out, 42);
        assert_eq!(m.publishing_id(), Some(&42));
        assert_eq!(m.data(), Some(&br#"{"a": 1}"#[..]));
        let props = m.properties().unwrap();
        assert_eq!(
            props.message_id,
            Some(event.id.hyphenated().to_string().into())
        );
        assert_eq!(props.subject.as_deref(), Some("invoice.issued"));
        let app = m.application_properties().unwrap();
        let get = |k: &str| app.get(k).cloned();
        assert_eq!(get(PUBLISHING_ID_HEADER), Some(SimpleValue::Ulong(42)));
        assert_eq!(
            get("x-aggregate-id"),
            Some(SimpleValue::String("agg-1".into()))
        );
        assert_eq!(get("x-aggregate-version"), Some(SimpleValue::Long(7)));
        assert_eq!(
            get("x-source-position"),
            Some(SimpleValue::String(event.position.to_string()))
        );
        assert_eq!(get("tenant"), Some(SimpleValue::String("acme".into())));
        assert_eq!(get("tags"), Some(SimpleValue::String(r#"["a",1]"#.into())));
        let _: &RabbitConfig = &cfg;
    }
}
