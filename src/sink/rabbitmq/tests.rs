//! Unit tests of the RabbitMQ sink that need no broker: URL parsing and redaction, message
//! properties and headers, poison records, header sizes and declaration error texts. They
//! sit in their own file so the sink's code files stay short; the broker tests are in
//! `tests/postgres/pg_rabbitmq.rs`.

use super::declare::describe_mismatch;
use super::*;
use crate::sink::partition::QueueType;
use crate::sink::DeclareMode;
use lapin::types::{AMQPValue, FieldTable};
use std::time::Duration;

fn sink(max: usize) -> RabbitSink {
    RabbitSink::new(RabbitConfig {
        url: "amqp://guest:secret@127.0.0.1:5672".into(),
        exchange: "outbox".into(),
        declare: DeclareMode::Auto,
        max_message_bytes: max,
        op_timeout: Duration::from_secs(5),
        ca_file: None,
        cert_file: None,
        key_file: None,
        connection_name: "test".into(),
        partitioning: Default::default(),
        dead_queue_type: QueueType::Classic,
        message: Default::default(),
    })
    .unwrap()
}

fn event() -> OutboxEvent {
    crate::sink::test_event()
}

impl RabbitSink {
    /// `render` with the constant exchange (no broker needed).
    fn render_static(&self, event: &OutboxEvent, limit: usize) -> Outgoing {
        let route = self
            .cfg
            .message
            .routing_key(event)
            .map(|rk| (self.cfg.exchange.clone(), rk));
        self.render(event, limit, route)
    }
}

#[test]
fn url_host_vhost_and_redaction() {
    let s = sink(10);
    assert_eq!(s.endpoint.uri.authority.host, "127.0.0.1");
    assert_eq!(s.endpoint.uri.vhost, "/");
    assert!(!format!("{:?}", s.cfg).contains("secret"));
    let s2 = RabbitSink::new(RabbitConfig {
        url: "amqp://u:p@[::1]:5673/prod".into(),
        ..s.cfg.clone()
    })
    .unwrap();
    assert_eq!(s2.endpoint.uri.authority.host, "::1");
    assert_eq!(s2.endpoint.uri.authority.port, 5673);
    assert_eq!(s2.endpoint.uri.vhost, "prod");
    let tls_on_plain = RabbitSink::new(RabbitConfig {
        ca_file: Some("/nonexistent".into()),
        ..s.cfg.clone()
    });
    assert!(tls_on_plain.is_err());
}

#[test]
fn message_properties_and_headers() {
    let s = sink(DEFAULT_MAX_MESSAGE_BYTES);
    let mut ev = event();
    ev.headers = Some(
        serde_json::json!({"tenant": "acme", "n": 3, "big": 18446744073709551615u64,
            "f": 1.5, "ok": true, "none": null, "list": [1, "a"], "nested": {"k": "v"},
            "x-source-position": "forged"})
        .as_object()
        .unwrap()
        .clone(),
    );
    let out = s.render_static(&ev, MAX_HEADER_BYTES);
    assert!(out.dead.is_none());
    assert_eq!(out.exchange, "outbox");
    assert_eq!(out.routing_key, "invoice.issued");
    assert_eq!(&out.body[..], br#"{"a": 1}"#);
    let p = &out.props;
    assert_eq!(p.delivery_mode(), &Some(2));
    assert_eq!(
        p.message_id().as_ref().unwrap().as_str(),
        "0190a5c4-7e2b-7000-8000-00000000abcd"
    );
    assert_eq!(p.timestamp(), &Some(1_750_000_000));
    assert_eq!(p.kind().as_ref().unwrap().as_str(), "invoice.issued");
    assert_eq!(p.app_id().as_ref().unwrap().as_str(), "outboxd");
    assert_eq!(
        p.content_type().as_ref().unwrap().as_str(),
        "application/json"
    );
    let h = p.headers().as_ref().unwrap().inner();
    let get = |k: &str| h.get(k).cloned().unwrap();
    assert_eq!(get("x-aggregate-id"), AMQPValue::LongString("agg-1".into()));
    assert_eq!(
        get("x-outbox-created-at"),
        AMQPValue::LongString("2025-06-15T15:06:40.123456Z".into())
    );
    assert_eq!(
        get("x-source-position"),
        AMQPValue::LongString("00000000/016B3748:0000000003".into()),
        "the relay's own header wins over the row's"
    );
    assert_eq!(get("x-aggregate-version"), AMQPValue::LongLongInt(7));
    assert_eq!(get("n"), AMQPValue::LongLongInt(3));
    assert_eq!(
        get("big"),
        AMQPValue::LongString("18446744073709551615".into())
    );
    assert_eq!(get("f"), AMQPValue::Double(1.5));
    assert_eq!(get("ok"), AMQPValue::Boolean(true));
    assert_eq!(get("none"), AMQPValue::Void);
    assert!(matches!(get("list"), AMQPValue::FieldArray(_)));
    assert!(matches!(get("nested"), AMQPValue::FieldTable(_)));
    assert!(!h.contains_key("x-source-gtid"));
}

/// `--header` columns keep their type as AMQP field values (Debezium's router puts a boolean
/// column in a header as a boolean): booleans, integers, floats; the rest is a long string.
#[test]
fn column_headers_keep_their_type() {
    use crate::event::{ColumnValue, Typed};
    use crate::sink::format::parse_column_headers;
    let mut s = sink(DEFAULT_MAX_MESSAGE_BYTES);
    s.cfg.message.headers = parse_column_headers(&crate::sink::specs(
        "paid=x-paid,qty=x-qty,rate=x-rate,w=x-w,note=x-note,id=id",
    ))
    .unwrap();
    let mut ev = event();
    let typed = |text: &str, typed| ColumnValue {
        text: text.into(),
        typed,
    };
    ev.extra = vec![
        ("paid".into(), typed("t", Typed::Bool(true))),
        ("qty".into(), typed("-3", Typed::Int(-3))),
        ("rate".into(), typed("0.25", Typed::Float(0.25))),
        ("w".into(), typed("1.5", Typed::Float32(1.5))),
        ("note".into(), "12".into()),
    ];
    let out = s.render_static(&ev, MAX_HEADER_BYTES);
    let h = out.props.headers().as_ref().unwrap().inner();
    let get = |k: &str| h.get(k).cloned().unwrap();
    assert_eq!(get("x-paid"), AMQPValue::Boolean(true));
    assert_eq!(get("x-qty"), AMQPValue::LongLongInt(-3));
    assert_eq!(get("x-rate"), AMQPValue::Double(0.25));
    assert_eq!(get("x-w"), AMQPValue::Float(1.5));
    assert_eq!(get("x-note"), AMQPValue::LongString("12".into()));
    assert_eq!(
        get("id"),
        AMQPValue::LongString("0190a5c4-7e2b-7000-8000-00000000abcd".into())
    );
}

#[test]
fn partition_headers_with_partitions_on() {
    let mut s = sink(DEFAULT_MAX_MESSAGE_BYTES);
    s.cfg.partitioning = crate::sink::partition::PartitionSpec {
        partitions: 4,
        group_partitions: vec![3],
        ..Default::default()
    }
    .validate()
    .unwrap();
    let out = s.render_static(&event(), MAX_HEADER_BYTES);
    let h = out.props.headers().as_ref().unwrap().inner();
    let p4 = crate::sink::partition::partition_of("agg-1", 4).to_string();
    let p3 = crate::sink::partition::partition_of("agg-1", 3).to_string();
    assert_eq!(
        h.get("x-partition"),
        Some(&AMQPValue::LongString(p4.clone().into()))
    );
    assert_eq!(
        h.get("x-partition-4"),
        Some(&AMQPValue::LongString(p4.into()))
    );
    assert_eq!(
        h.get("x-partition-3"),
        Some(&AMQPValue::LongString(p3.into()))
    );
    // Off: no partition header at all.
    let out = sink(DEFAULT_MAX_MESSAGE_BYTES).render_static(&event(), MAX_HEADER_BYTES);
    let h = out.props.headers().as_ref().unwrap().inner();
    assert!(h.keys().all(|k| !k.as_str().starts_with("x-partition")));
}

#[test]
fn poison_becomes_a_dead_record_without_body() {
    let s = sink(7);
    let out = s.render_static(&event(), MAX_HEADER_BYTES);
    assert_eq!(out.exchange, "");
    assert_eq!(out.routing_key, "outbox.dead");
    assert!(out.body.is_empty());
    assert!(out.dead.as_ref().unwrap().contains("--max-message-bytes 7"));
    let h = out.props.headers().as_ref().unwrap().inner();
    assert_eq!(h.get("x-original-size"), Some(&AMQPValue::LongLongInt(8)));
    assert_eq!(
        h.get("x-original-topic"),
        Some(&AMQPValue::LongString("invoice.issued".into()))
    );
    assert_eq!(out.props.delivery_mode(), &Some(2));
    assert!(out.props.content_type().is_none());

    let s = sink(DEFAULT_MAX_MESSAGE_BYTES);
    let mut ev = event();
    ev.topic = "t".repeat(300);
    assert!(s
        .render_static(&ev, MAX_HEADER_BYTES)
        .dead
        .unwrap()
        .contains("300 bytes"));
    let mut ev = event();
    ev.headers = Some(
        serde_json::json!({ "k".repeat(256): 1 })
            .as_object()
            .unwrap()
            .clone(),
    );
    assert!(s
        .render_static(&ev, MAX_HEADER_BYTES)
        .dead
        .unwrap()
        .contains("header name"));
    let mut ev = event();
    ev.headers = Some(
        serde_json::json!({ "big": "v".repeat(200_000) })
            .as_object()
            .unwrap()
            .clone(),
    );
    assert!(s
        .render_static(&ev, MAX_HEADER_BYTES)
        .dead
        .unwrap()
        .contains("headers encode"));
    let mut ev = event();
    ev.poison = Some("aggregate_id is NULL".into());
    assert_eq!(
        s.render_static(&ev, MAX_HEADER_BYTES).dead.as_deref(),
        Some("aggregate_id is NULL")
    );
}

#[test]
fn table_size_matches_the_wire_encoding() {
    let mut t = FieldTable::default();
    t.insert("a".into(), AMQPValue::LongString("xyz".into()));
    t.insert("b".into(), AMQPValue::LongLongInt(1));
    // 4 (length) + [1+1+1+4+3] + [1+1+1+8]
    assert_eq!(table_size(&t), 4 + 10 + 11);
}

#[test]
fn mismatch_text_names_the_argument() {
    let t = "PRECONDITION_FAILED - inequivalent arg 'alternate-exchange' for exchange 'outbox' in vhost '/': received the value 'outbox.unrouted' of type 'longstr' but current is none";
    let d = describe_mismatch(t);
    assert!(
        d.starts_with("argument \"alternate-exchange\" differs:"),
        "{d}"
    );
    assert!(d.contains("current is none"));
    assert!(validate_exchange("outbox").is_ok());
    assert!(validate_exchange("amq.topic").is_err());
    assert!(validate_exchange("a b").is_err());
    assert!(validate_exchange(&"x".repeat(247)).is_err());
}

#[test]
fn the_brokers_message_size_refusal_is_recognised() {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};
    let refusal = |kind, text: &str| -> lapin::Error {
        lapin::ErrorKind::ProtocolError(AMQPError::new(kind, text.into())).into()
    };
    let size = || AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED);
    assert_eq!(
        encode::broker_size_limit(&refusal(
            size(),
            "PRECONDITION_FAILED - message size 2048 is larger than configured max size 1024"
        )),
        Some(1024)
    );
    // At RabbitMQ's hard limit the word "configured" is missing.
    assert_eq!(
        encode::size_refusal_limit(
            "PRECONDITION_FAILED - message size 536870913 is larger than max size 536870912"
        ),
        Some(536870912)
    );
    // Other 406s (a topology mismatch) and other codes say nothing about sizes.
    assert_eq!(
        encode::broker_size_limit(&refusal(
            size(),
            "PRECONDITION_FAILED - inequivalent arg 'durable' for queue 'q' in vhost '/'"
        )),
        None
    );
    assert_eq!(
        encode::broker_size_limit(&refusal(
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED),
            "message size 2048 is larger than configured max size 1024"
        )),
        None
    );
}

#[test]
fn a_body_over_the_brokers_learned_limit_is_dead_lettered_with_the_reason() {
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};
    let s = sink(DEFAULT_MAX_MESSAGE_BYTES);
    let ev = event();
    // Until the broker refused one, nothing is known: a normal message.
    assert!(s.render_static(&ev, MAX_HEADER_BYTES).dead.is_none());
    // The publish's channel is closed for its size: what the sink's publish records.
    let max = ev.payload.len() - 1;
    let refusal: lapin::Error = lapin::ErrorKind::ProtocolError(AMQPError::new(
        AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED),
        format!(
            "PRECONDITION_FAILED - message size {} is larger than configured max size {max}",
            ev.payload.len()
        )
        .as_str()
        .into(),
    ))
    .into();
    encode::learn_size_limit(&refusal, &s.broker_max_message);
    // The republish of the same event: a dead record with the reason, not refused again.
    let out = s.render_static(&ev, MAX_HEADER_BYTES);
    let reason = out.dead.expect("dead-lettered");
    assert!(
        reason.contains(&format!(
            "more than RabbitMQ's max_message_size {}",
            ev.payload.len() - 1
        )) && reason.contains("406 PRECONDITION_FAILED"),
        "{reason}"
    );
    assert_eq!(out.routing_key, "outbox.dead");
    assert!(out.body.is_empty());
    // A body within the limit still goes out as a message.
    s.broker_max_message
        .store(ev.payload.len(), std::sync::atomic::Ordering::Release);
    assert!(s.render_static(&ev, MAX_HEADER_BYTES).dead.is_none());
}
