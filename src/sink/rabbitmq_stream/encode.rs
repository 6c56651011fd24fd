//! One event as an AMQP 1.0 message for a stream: the AMQP sink's rendering (the same
//! properties, relay headers, row headers, formats and poison rules, see
//! docs/message-format.md) carried over into AMQP 1.0 sections, plus the publishing id.
//! AMQP 1.0 application properties hold only simple values, so a row header that is a JSON
//! array or object travels as its JSON text.

use crate::sink::rabbitmq::Outgoing;
use rabbitmq_stream_client::types::Message;

/// The stream message of a rendered event, with its publishing id.
pub(super) fn to_message(out: &Outgoing, publishing_id: u64) -> Message {
    crate::stream::to_message(&out.props, &out.body, publishing_id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::rabbitmq::{render, RabbitConfig};
    use crate::stream::PUBLISHING_ID_HEADER;
    use rabbitmq_stream_client::types::SimpleValue;

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
            &crate::identity::Origin::default(),
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
        assert_eq!(get(PUBLISHING_ID_HEADER), Some(SimpleValue::Int(42)));
        assert_eq!(
            get("x-aggregate-id"),
            Some(SimpleValue::String("agg-1".into()))
        );
        assert_eq!(get("x-aggregate-version"), Some(SimpleValue::Int(7)));
        assert_eq!(
            get("x-source-position"),
            Some(SimpleValue::String(event.position.to_string()))
        );
        assert_eq!(get("tenant"), Some(SimpleValue::String("acme".into())));
        assert_eq!(get("tags"), Some(SimpleValue::String(r#"["a",1]"#.into())));
        let _: &RabbitConfig = &cfg;
    }
}
