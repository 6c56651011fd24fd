//! One event as a JetStream message: its subject (the template, with the partition token when
//! `--partitions` is on), its headers (`Nats-Msg-Id` = event id, so the stream drops a
//! republished copy within its duplicate window; the relay's headers as on RabbitMQ; the row's
//! headers minus reserved names), or — when it cannot be a message — a body-less dead record
//! on `<prefix>.dead` that says why.

use super::config::{self, NatsConfig};
use crate::event::OutboxEvent;
use crate::identity::Origin;
use crate::sink::headers;
use crate::sink::partition;
use crate::sink::template::event_field;
use async_nats::header::{HeaderMap, HeaderName};
use bytes::Bytes;

/// The header JetStream deduplicates by.
pub(crate) const MSG_ID: &str = "Nats-Msg-Id";
/// `NATS/1.0\r\n` and the blank line that end a header block.
const HEADER_FRAMING: usize = 12;

/// A message ready to go out.
pub(crate) struct Outgoing {
    pub subject: String,
    pub headers: HeaderMap,
    pub payload: Bytes,
    /// The reason, when this is a dead record instead of the event.
    pub dead: Option<String>,
}

/// The subject the event goes to, or why it has none.
pub(crate) fn subject(
    cfg: &NatsConfig,
    prefix: &str,
    event: &OutboxEvent,
) -> Result<String, String> {
    let rendered = cfg.subject.render(|n| event_field(event, n))?;
    let subject = if cfg.partitions > 0 {
        let k = partition::partition_of(&event.aggregate_id, cfg.partitions);
        // The template starts with the literal prefix and a '.', checked at start.
        let rest = rendered.get(prefix.len() + 1..).unwrap_or("");
        format!("{prefix}.p{k}.{rest}")
    } else {
        rendered
    };
    config::publishable(&subject)?;
    Ok(subject)
}

fn header_bytes(h: &HeaderMap) -> usize {
    h.iter()
        .map(|(k, vs)| {
            vs.iter()
                .map(|v| k.to_string().len() + v.as_str().len() + 4)
                .sum::<usize>()
        })
        .sum::<usize>()
        + HEADER_FRAMING
}

/// The headers of a normal message, or why the event is poison.
fn event_headers(
    cfg: &NatsConfig,
    event: &OutboxEvent,
    origin: &Origin,
) -> Result<HeaderMap, String> {
    let mut h = HeaderMap::new();
    // Row headers first: the relay's own (and Nats-*) are reserved, dropped by row_headers.
    for (k, v) in headers::row_headers(event) {
        let name = HeaderName::try_from(k.as_str()).map_err(|_| {
            format!(
                "header name {k:?} cannot be a NATS header (printable ASCII without ':' or spaces)"
            )
        })?;
        let text = match v {
            serde_json::Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        if text.contains(['\r', '\n']) {
            return Err(format!(
                "the value of header {k:?} contains a line break, which NATS headers cannot carry"
            ));
        }
        h.insert(name, text);
    }
    // `--header` columns (names checked at start: none is reserved) win over the row's.
    for (k, v) in crate::sink::format::column_headers(&cfg.headers, event) {
        let text = v.to_text();
        if text.contains(['\r', '\n']) {
            return Err(format!(
                "the value of header {k:?} contains a line break, which NATS headers cannot carry"
            ));
        }
        h.insert(k, text);
    }
    h.insert(MSG_ID, event.id.hyphenated().to_string());
    for (k, v) in headers::relay_headers(event, origin) {
        // Every relay value is ours (ids, times, positions, versions); a line break in an
        // aggregate id or table name would still be refused, not passed to the client.
        let text = v.to_text();
        if text.contains(['\r', '\n']) {
            return Err(format!(
                "{k} contains a line break, which NATS headers cannot carry"
            ));
        }
        h.insert(k, text);
    }
    if cfg.partitions > 0 {
        let k = partition::partition_of(&event.aggregate_id, cfg.partitions);
        h.insert(partition::PARTITION_HEADER, k.to_string());
    }
    Ok(h)
}

/// The largest message (headers and payload together) that can be stored: the smaller of the
/// server's `max_payload` and the stream's `max_msg_size`, and which of the two it is. A
/// message over it would be refused again at every attempt, so it is dead-lettered instead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct SizeLimit {
    /// 0: no limit known.
    pub bytes: usize,
    pub what: &'static str,
}

impl SizeLimit {
    /// From the server's `max_payload` and the stream's `max_msg_size` (≤ 0: unlimited, or the
    /// stream could not be read).
    pub(crate) fn of(max_payload: usize, stream_max_msg_size: Option<i32>) -> SizeLimit {
        match stream_max_msg_size.and_then(|m| usize::try_from(m).ok()) {
            Some(m) if m > 0 && (max_payload == 0 || m < max_payload) => SizeLimit {
                bytes: m,
                what: "the stream's max_msg_size",
            },
            _ => SizeLimit {
                bytes: max_payload,
                what: "the server's max_payload",
            },
        }
    }
}

impl std::fmt::Display for SizeLimit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.what, self.bytes)
    }
}

/// The event as it goes out: the message, or its dead record.
pub(crate) fn render(
    cfg: &NatsConfig,
    prefix: &str,
    event: &OutboxEvent,
    limit: SizeLimit,
    origin: &Origin,
) -> Outgoing {
    let normal = (|| {
        if let Some(p) = &event.poison {
            return Err(p.clone());
        }
        if event.payload.len() > cfg.max_message_bytes {
            return Err(format!(
                "payload is {} bytes, more than --max-message-bytes {}",
                event.payload.len(),
                cfg.max_message_bytes
            ));
        }
        let subject = subject(cfg, prefix, event)?;
        if subject.strip_prefix(prefix) == Some(".dead") {
            // `<prefix>.dead` holds dead records only: an event there would pass for one.
            return Err(format!(
                "its subject {subject} is the poison subject, where dead records go: rename the topic, or change --subject"
            ));
        }
        let headers = event_headers(cfg, event, origin)?;
        let size = event.payload.len() + header_bytes(&headers);
        if limit.bytes > 0 && size > limit.bytes {
            return Err(format!(
                "message is {size} bytes with its headers, more than {limit}"
            ));
        }
        Ok((subject, headers))
    })();
    match normal {
        Ok((subject, headers)) => Outgoing {
            subject,
            headers,
            payload: event.payload.clone(),
            dead: None,
        },
        Err(reason) => {
            let mut h = HeaderMap::new();
            // A row without a usable id gets one from its position: dead records never share
            // the nil UUID, which the stream would store once and acknowledge as a duplicate.
            h.insert(MSG_ID, event.dead_record_id().hyphenated().to_string());
            for (k, v) in headers::dead_headers(event, &reason, origin) {
                h.insert(k, v);
            }
            Outgoing {
                subject: format!("{prefix}.dead"),
                headers: h,
                payload: Bytes::new(),
                dead: Some(reason),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::template::Template;
    use crate::sink::DeclareMode;
    use std::time::Duration;

    fn cfg(partitions: u32) -> NatsConfig {
        NatsConfig {
            url: "nats://127.0.0.1:4222".into(),
            subject: Template::parse("outbox.{topic}").unwrap(),
            stream: "OUTBOX".into(),
            declare: DeclareMode::Auto,
            max_message_bytes: 1024,
            op_timeout: Duration::from_secs(5),
            window: 10,
            ca_file: None,
            cert_file: None,
            key_file: None,
            connection_name: "test".into(),
            partitions,
            headers: Vec::new(),
        }
    }

    fn get(h: &HeaderMap, k: &str) -> Option<String> {
        h.get(k).map(|v| v.as_str().to_string())
    }

    /// `--header` columns on NATS: text, typed values as Kafka Connect writes them (a boolean
    /// column is `true`, not Postgres' `t`).
    #[test]
    fn column_headers_are_text_of_their_type() {
        use crate::event::{ColumnValue, Typed};
        let mut c = cfg(0);
        c.headers =
            crate::sink::format::parse_column_headers(&crate::sink::specs("paid=x-paid,id=id"))
                .unwrap();
        let mut ev = crate::sink::test_event();
        ev.extra = vec![(
            "paid".into(),
            ColumnValue {
                text: "t".into(),
                typed: Typed::Bool(true),
            },
        )];
        let out = render(
            &c,
            "outbox",
            &ev,
            SizeLimit::of(1 << 20, None),
            &Origin::default(),
        );
        assert_eq!(get(&out.headers, "x-paid").as_deref(), Some("true"));
        assert_eq!(
            get(&out.headers, "id").as_deref(),
            Some("0190a5c4-7e2b-7000-8000-00000000abcd")
        );
    }

    #[test]
    fn events_carry_the_msg_id_and_the_relay_headers() {
        let mut ev = crate::sink::test_event();
        ev.headers =
            serde_json::json!({"traceparent": "00-a-b-01", "Nats-Msg-Id": "forged", "n": 5})
                .as_object()
                .cloned();
        let out = render(
            &cfg(0),
            "outbox",
            &ev,
            SizeLimit::of(1 << 20, None),
            &Origin::default(),
        );
        assert!(out.dead.is_none());
        assert_eq!(out.subject, "outbox.invoice.issued");
        assert_eq!(
            get(&out.headers, MSG_ID).unwrap(),
            ev.id.hyphenated().to_string()
        );
        assert_eq!(get(&out.headers, "x-aggregate-id").unwrap(), "agg-1");
        assert_eq!(get(&out.headers, "x-aggregate-version").unwrap(), "7");
        assert_eq!(get(&out.headers, "traceparent").unwrap(), "00-a-b-01");
        assert_eq!(get(&out.headers, "n").unwrap(), "5");
        assert!(get(&out.headers, "x-partition").is_none());
    }

    #[test]
    fn partitions_insert_their_token_after_the_prefix() {
        let ev = crate::sink::test_event();
        let k = partition::partition_of("agg-1", 4);
        let out = render(
            &cfg(4),
            "outbox",
            &ev,
            SizeLimit::of(1 << 20, None),
            &Origin::default(),
        );
        assert_eq!(out.subject, format!("outbox.p{k}.invoice.issued"));
        assert_eq!(get(&out.headers, "x-partition").unwrap(), k.to_string());
    }

    #[test]
    fn poison_goes_to_the_dead_subject_without_body() {
        for (mutate, needle) in [
            (
                Box::new(|e: &mut OutboxEvent| e.topic = "bad topic".into())
                    as Box<dyn Fn(&mut OutboxEvent)>,
                "whitespace",
            ),
            (
                Box::new(|e: &mut OutboxEvent| e.payload = Bytes::from(vec![b'x'; 2000])),
                "--max-message-bytes",
            ),
            (
                Box::new(|e: &mut OutboxEvent| e.poison = Some("not json".into())),
                "not json",
            ),
            (
                Box::new(|e: &mut OutboxEvent| {
                    e.headers = serde_json::json!({"a": "x\r\ny"}).as_object().cloned()
                }),
                "line break",
            ),
            (
                Box::new(|e: &mut OutboxEvent| {
                    e.headers = serde_json::json!({"a b": 1}).as_object().cloned()
                }),
                "cannot be a NATS header",
            ),
            (
                Box::new(|e: &mut OutboxEvent| e.topic = "dead".into()),
                "is the poison subject",
            ),
        ] {
            let mut ev = crate::sink::test_event();
            mutate(&mut ev);
            let out = render(
                &cfg(0),
                "outbox",
                &ev,
                SizeLimit::of(1 << 20, None),
                &Origin::default(),
            );
            let reason = out.dead.expect("dead");
            assert!(reason.contains(needle), "{reason}");
            assert_eq!(out.subject, "outbox.dead");
            assert!(out.payload.is_empty());
            assert_eq!(
                get(&out.headers, MSG_ID).unwrap(),
                ev.id.hyphenated().to_string()
            );
            assert!(get(&out.headers, "x-dead-reason").unwrap().contains(needle));
        }
        let ev = crate::sink::test_event();
        let out = render(
            &cfg(0),
            "outbox",
            &ev,
            SizeLimit::of(100, None),
            &Origin::default(),
        );
        assert!(out.dead.unwrap().contains("max_payload"));
    }

    #[test]
    fn the_smaller_of_the_servers_and_the_streams_limit_applies() {
        let server = SizeLimit::of(1 << 20, None);
        assert_eq!(server.bytes, 1 << 20);
        assert!(server.to_string().contains("max_payload"));
        // -1 and 0 are unlimited streams.
        assert_eq!(SizeLimit::of(1 << 20, Some(-1)), server);
        assert_eq!(SizeLimit::of(1 << 20, Some(0)), server);
        assert_eq!(SizeLimit::of(1 << 20, Some(2 << 20)), server);
        let stream = SizeLimit::of(1 << 20, Some(4096));
        assert_eq!(stream.bytes, 4096);
        assert_eq!(stream.to_string(), "the stream's max_msg_size 4096");
    }
}
