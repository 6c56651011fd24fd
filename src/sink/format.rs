//! What a message is made of, independent of the broker: where it goes (the routing key and
//! exchange templates), the headers copied from columns (`--header COLUMN=NAME`), and the body
//! (`--format raw`, `envelope`, `cloudevents`, `cloudevents-binary`; docs/message-format.md).
//! Everything is parsed and checked once at start; per event only templates are rendered and,
//! for the non-raw formats, one JSON object is written.

use super::headers::{self, HeaderValue};
use super::template::{event_field, Template};
use crate::event::OutboxEvent;
use base64::Engine;
use bytes::Bytes;
use serde::Serialize;
use serde_json::value::RawValue;
use std::borrow::Cow;

/// `--format`: the message body.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BodyFormat {
    /// The payload column byte for byte (content type `application/json`, or the payload's
    /// own content type).
    #[default]
    Raw,
    /// A JSON object: id, aggregate, topic, payload, created_at, position.
    Envelope,
    /// A CloudEvents 1.0 event in structured mode (`application/cloudevents+json`).
    Cloudevents,
    /// CloudEvents binary mode: the payload as body, the attributes as `cloudEvents:*` headers.
    CloudeventsBinary,
}

/// `--header COLUMN=NAME`: one column's value copied into a header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnHeader {
    /// A field every event has (`id`, `topic`, …), a logical column or the table's column.
    pub column: String,
    /// The header's name.
    pub name: String,
}

/// Parses the `--header` values, refusing names the relay reserves.
pub fn parse_column_headers(specs: &[String]) -> Result<Vec<ColumnHeader>, crate::Error> {
    let mut out: Vec<ColumnHeader> = Vec::new();
    for spec in specs.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let Some((column, name)) = spec.split_once('=') else {
            return Err(crate::Error::config(
                format!("--header {spec:?} is not COLUMN=NAME"),
                "write e.g. --header traceparent=traceparent --header tenant_id=x-tenant",
            ));
        };
        let (column, name) = (column.trim(), name.trim());
        let plain = |s: &str| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '$')
        };
        if !plain(column) {
            return Err(crate::Error::config(
                format!("--header {spec:?}: {column:?} is not a column name"),
                "name the column without quotes or spaces, e.g. --header traceparent=traceparent",
            ));
        }
        if name.is_empty() || name.len() > 255 || name.chars().any(|c| c.is_control()) {
            return Err(crate::Error::config(
                format!("--header {spec:?}: {name:?} is not a header name"),
                "use 1 to 255 printable characters, e.g. --header tenant_id=x-tenant",
            ));
        }
        if headers::is_reserved(name) {
            return Err(crate::Error::config(
                format!("--header {spec:?}: the header name {name:?} is the relay's own (or the broker's routing header)"),
                format!("choose another name, e.g. --header {column}=x-app-{}", name.trim_start_matches("x-").to_ascii_lowercase()),
            ));
        }
        if out.iter().any(|h| h.name.eq_ignore_ascii_case(name)) {
            return Err(crate::Error::config(
                format!("--header: the header name {name:?} is given twice"),
                "give each header once",
            ));
        }
        out.push(ColumnHeader {
            column: column.to_string(),
            name: name.to_string(),
        });
    }
    Ok(out)
}

/// `--envelope-field COLUMN[=ALIAS]`: a column placed beside the payload in the body, as
/// Debezium's Outbox Event Router places `col:envelope:alias` additional fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvelopeField {
    /// A field every event has, a logical column or the table's column (as `--header`'s).
    pub column: String,
    /// The field's name in the body (the column's name when not given).
    pub alias: String,
}

/// Parses the `--envelope-field` values.
pub fn parse_envelope_fields(specs: &[String]) -> Result<Vec<EnvelopeField>, crate::Error> {
    let mut out: Vec<EnvelopeField> = Vec::new();
    for spec in specs.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let (column, alias) = match spec.split_once('=') {
            Some((c, a)) => (c.trim(), a.trim()),
            None => (spec, spec),
        };
        if column.is_empty()
            || !column
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$')
        {
            return Err(crate::Error::config(
                format!("--envelope-field {spec:?}: {column:?} is not a column name"),
                "write COLUMN or COLUMN=ALIAS, e.g. --envelope-field type=eventType",
            ));
        }
        if alias.is_empty() || alias.chars().any(|c| c.is_control()) {
            return Err(crate::Error::config(
                format!("--envelope-field {spec:?}: {alias:?} is not a field name"),
                "write COLUMN or COLUMN=ALIAS, e.g. --envelope-field type=eventType",
            ));
        }
        if alias == "payload" || out.iter().any(|f| f.alias == alias) {
            return Err(crate::Error::config(
                format!("--envelope-field {spec:?}: the body already has a field {alias:?}"),
                "give each field its own alias (\"payload\" holds the payload), e.g. --envelope-field payload=body_copy",
            ));
        }
        out.push(EnvelopeField {
            column: column.to_string(),
            alias: alias.to_string(),
        });
    }
    Ok(out)
}

/// The `--header` columns of `event` (see [`MessageOptions::column_headers`]), for a sink
/// that takes no other message option (NATS).
pub fn column_headers<'a>(
    headers: &'a [ColumnHeader],
    event: &'a OutboxEvent,
) -> impl Iterator<Item = (&'a str, HeaderValue)> + 'a {
    headers.iter().filter_map(move |h| {
        let value = match event.extra_column(&h.column) {
            Some(v) if !crate::names::EVENT_FIELDS.contains(&h.column.as_str()) => {
                HeaderValue::of_column(v)
            }
            _ => HeaderValue::Str(lookup(event, &h.column)?.into_owned()),
        };
        Some((h.name.as_str(), value))
    })
}

/// Where a message goes and what it is made of, for every sink.
#[derive(Debug, Clone)]
pub struct MessageOptions {
    /// `--routing-key` (default `{topic}`; `outbox.event.{aggregate_type}` with
    /// `--column debezium`).
    pub routing_key: Template,
    /// `--exchange` when it has placeholders (a constant exchange stays the sink's own).
    pub exchange: Option<Template>,
    pub headers: Vec<ColumnHeader>,
    pub format: BodyFormat,
    /// `--cloudevents-source`: the CloudEvents `source` attribute.
    pub ce_source: Template,
    /// `--envelope-field`: with `--format raw`, the body becomes `{"payload": …, <alias>: …}`.
    pub envelope_fields: Vec<EnvelopeField>,
}

impl Default for MessageOptions {
    fn default() -> Self {
        MessageOptions {
            routing_key: Template::parse("{topic}").expect("valid"),
            exchange: None,
            headers: Vec::new(),
            format: BodyFormat::Raw,
            ce_source: Template::parse("/outboxd").expect("valid"),
            envelope_fields: Vec::new(),
        }
    }
}

impl MessageOptions {
    /// Every name a template or `--header` reads, so the sources carry those columns.
    pub fn columns(&self) -> impl Iterator<Item = &str> {
        self.routing_key
            .vars()
            .chain(self.exchange.iter().flat_map(|t| t.vars()))
            .chain(self.headers.iter().map(|h| h.column.as_str()))
            .chain(self.envelope_fields.iter().map(|f| f.column.as_str()))
            .chain(
                (matches!(
                    self.format,
                    BodyFormat::Cloudevents | BodyFormat::CloudeventsBinary
                ))
                .then(|| self.ce_source.vars())
                .into_iter()
                .flatten(),
            )
    }

    /// The routing key of an event, or why it has none.
    pub fn routing_key(&self, event: &OutboxEvent) -> Result<String, String> {
        let rk = self.routing_key.render(|n| lookup(event, n))?;
        if rk.len() > 255 {
            return Err(format!(
                "routing key is {} bytes: a routing key holds at most 255",
                rk.len()
            ));
        }
        Ok(rk)
    }

    /// Headers copied from columns (a NULL column sets none), typed as the column is: a
    /// boolean, integer or float column keeps its type, anything else is its text.
    pub fn column_headers<'a>(
        &'a self,
        event: &'a OutboxEvent,
    ) -> impl Iterator<Item = (&'a str, HeaderValue)> + 'a {
        column_headers(&self.headers, event)
    }

    /// The body, its content type and the format's own headers (CloudEvents binary mode).
    pub fn body(&self, event: &OutboxEvent) -> Result<Body, String> {
        let payload_ct = event
            .content_type
            .as_deref()
            .unwrap_or("application/json")
            .to_string();
        match self.format {
            BodyFormat::Raw if !self.envelope_fields.is_empty() => Ok(Body {
                bytes: self.debezium_envelope(event)?,
                content_type: "application/json".into(),
                headers: Vec::new(),
            }),
            BodyFormat::Raw => Ok(Body {
                bytes: event.payload.clone(),
                content_type: payload_ct,
                headers: Vec::new(),
            }),
            BodyFormat::Envelope => {
                let (payload, payload_base64) = payload_json(event);
                let env = Envelope {
                    id: event.id.hyphenated().to_string(),
                    aggregate: Aggregate {
                        id: &event.aggregate_id,
                        r#type: event.extra_value("aggregate_type"),
                        version: event.version,
                    },
                    topic: &event.topic,
                    content_type: event.content_type.as_deref(),
                    payload,
                    payload_base64,
                    created_at: event.created_at_rfc3339(),
                    position: event.position.to_string(),
                    table: event.table.as_deref(),
                };
                Ok(Body {
                    bytes: to_bytes(&env)?,
                    content_type: "application/json".into(),
                    headers: Vec::new(),
                })
            }
            BodyFormat::Cloudevents => {
                let (data, data_base64) = payload_json(event);
                let ce = CloudEvent {
                    specversion: "1.0",
                    id: event.id.hyphenated().to_string(),
                    source: self.ce_source.render(|n| lookup(event, n))?,
                    r#type: &event.topic,
                    subject: &event.aggregate_id,
                    time: event.created_at_rfc3339(),
                    datacontenttype: &payload_ct,
                    outboxposition: event.position.to_string(),
                    data,
                    data_base64,
                };
                Ok(Body {
                    bytes: to_bytes(&ce)?,
                    content_type: "application/cloudevents+json".into(),
                    headers: Vec::new(),
                })
            }
            BodyFormat::CloudeventsBinary => {
                let s = HeaderValue::Str;
                Ok(Body {
                    bytes: event.payload.clone(),
                    content_type: payload_ct,
                    headers: vec![
                        ("cloudEvents:specversion", s("1.0".into())),
                        ("cloudEvents:id", s(event.id.hyphenated().to_string())),
                        (
                            "cloudEvents:source",
                            s(self.ce_source.render(|n| lookup(event, n))?),
                        ),
                        ("cloudEvents:type", s(event.topic.clone())),
                        ("cloudEvents:subject", s(event.aggregate_id.clone())),
                        ("cloudEvents:time", s(event.created_at_rfc3339())),
                        ("cloudEvents:outboxposition", s(event.position.to_string())),
                    ],
                })
            }
        }
    }
}

impl MessageOptions {
    /// The body Debezium's Outbox Event Router writes with `col:envelope:alias` fields (as
    /// Kafka Connect's JsonConverter writes it without schemas, the payload expanded as with
    /// `table.expand.json.payload`): `{"payload": <payload>, "<alias>": <value>, …}` in
    /// `--envelope-field` order. A JSON payload is inline, other UTF-8 text a string, other bytes
    /// base64 (as the converter writes bytes); a value keeps its column's type (boolean, number,
    /// else its text), NULL is `null`.
    fn debezium_envelope(&self, event: &OutboxEvent) -> Result<Bytes, String> {
        let mut out = String::with_capacity(event.payload.len() + 64);
        out.push_str("{\"payload\":");
        match payload_json(event) {
            (Some(PayloadValue::Json(raw)), _) => out.push_str(raw.get()),
            (Some(PayloadValue::Text(t)), _) => out.push_str(&json_text(&t)?),
            (None, Some(b64)) => out.push_str(&json_text(&b64)?),
            (None, None) => out.push_str("null"),
        }
        for f in &self.envelope_fields {
            out.push(',');
            out.push_str(&json_text(&f.alias)?);
            out.push(':');
            out.push_str(&json_text(&field_json(event, &f.column))?);
        }
        out.push('}');
        Ok(Bytes::from(out))
    }
}

fn json_text(v: &impl Serialize) -> Result<String, String> {
    serde_json::to_string(v).map_err(|e| format!("the body cannot be written as JSON: {e}"))
}

/// A column's value as a JSON value of its type (see [`MessageOptions::debezium_envelope`]):
/// a float that JSON cannot hold (NaN, infinity) is its text, as for a header.
fn field_json(event: &OutboxEvent, column: &str) -> serde_json::Value {
    use crate::event::Typed;
    use serde_json::Value as J;
    if crate::names::EVENT_FIELDS.contains(&column) {
        return lookup(event, column).map_or(J::Null, |v| J::String(v.into_owned()));
    }
    let Some(v) = event.extra_column(column) else {
        return J::Null;
    };
    let number = |text: &str| -> J {
        serde_json::from_str::<serde_json::Number>(text)
            .map(J::Number)
            .unwrap_or_else(|_| J::String(text.to_string()))
    };
    match v.typed {
        Typed::Bool(b) => J::Bool(b),
        Typed::Int(i) => J::from(i),
        // Their shortest decimal text, so a `real` 0.1 stays 0.1 (not 0.10000000149…).
        Typed::Float(f) if f.is_finite() => number(&format!("{f}")),
        Typed::Float32(f) if f.is_finite() => number(&format!("{f}")),
        Typed::Float(_) | Typed::Float32(_) => J::String(v.text.clone()),
        Typed::Text => J::String(v.text.clone()),
    }
}

/// A rendered body.
#[derive(Debug, Clone)]
pub struct Body {
    pub bytes: Bytes,
    pub content_type: String,
    /// Headers the format itself sets (reserved names: a row cannot set them).
    pub headers: Vec<(&'static str, HeaderValue)>,
}

/// A template name's value: a field every event has, or an extra column's.
pub(crate) fn lookup<'a>(event: &'a OutboxEvent, name: &str) -> Option<Cow<'a, str>> {
    event_field(event, name)
}

fn to_bytes(v: &impl Serialize) -> Result<Bytes, String> {
    serde_json::to_vec(v)
        .map(Bytes::from)
        .map_err(|e| format!("the body cannot be written as JSON: {e}"))
}

/// The payload inside a JSON body: the JSON value itself, a string for text of another content
/// type, or base64 (`payload_base64` / `data_base64`) for bytes that are not UTF-8.
fn payload_json(event: &OutboxEvent) -> (Option<PayloadValue<'_>>, Option<String>) {
    let text = std::str::from_utf8(&event.payload).ok();
    match (event.payload_is_json(), text) {
        (true, Some(t)) if !t.trim().is_empty() => match serde_json::from_str::<&RawValue>(t) {
            Ok(raw) => (Some(PayloadValue::Json(raw)), None),
            Err(_) => (Some(PayloadValue::Text(t)), None),
        },
        (true, Some(_)) => (None, None),
        (false, Some(t)) => (Some(PayloadValue::Text(t)), None),
        (_, None) => (
            None,
            Some(base64::engine::general_purpose::STANDARD.encode(&event.payload)),
        ),
    }
}

#[derive(Serialize)]
#[serde(untagged)]
enum PayloadValue<'a> {
    Json(&'a RawValue),
    Text(&'a str),
}

#[derive(Serialize)]
struct Aggregate<'a> {
    id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    r#type: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    version: Option<i64>,
}

#[derive(Serialize)]
struct Envelope<'a> {
    id: String,
    aggregate: Aggregate<'a>,
    topic: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    content_type: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload: Option<PayloadValue<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    payload_base64: Option<String>,
    created_at: String,
    position: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    table: Option<&'a str>,
}

#[derive(Serialize)]
struct CloudEvent<'a> {
    specversion: &'static str,
    id: String,
    source: String,
    r#type: &'a str,
    subject: &'a str,
    time: String,
    datacontenttype: &'a str,
    outboxposition: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    data: Option<PayloadValue<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    data_base64: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(format: BodyFormat) -> MessageOptions {
        MessageOptions {
            format,
            ..Default::default()
        }
    }

    /// `--envelope-field`: Debezium's `col:envelope:alias` body, as JsonConverter writes it
    /// without schemas and with the payload expanded: the payload under "payload", each field
    /// under its alias in flag order, typed as its column.
    #[test]
    fn envelope_fields_wrap_the_payload_as_debeziums_router_does() {
        use crate::event::{ColumnValue, Typed};
        let mut o = opts(BodyFormat::Raw);
        o.envelope_fields = parse_envelope_fields(&crate::sink::specs(
            "type=eventType,paid,qty,note,gone,id=eventId",
        ))
        .unwrap();
        let mut ev = crate::sink::test_event();
        ev.extra = vec![
            ("type".into(), "Order".into()),
            (
                "paid".into(),
                ColumnValue {
                    text: "f".into(),
                    typed: Typed::Bool(false),
                },
            ),
            (
                "qty".into(),
                ColumnValue {
                    text: "0.1".into(),
                    typed: Typed::Float32(0.1),
                },
            ),
            ("note".into(), "7".into()),
        ];
        let b = o.body(&ev).unwrap();
        assert_eq!(b.content_type, "application/json");
        assert_eq!(
            std::str::from_utf8(&b.bytes).unwrap(),
            r#"{"payload":{"a": 1},"eventType":"Order","paid":false,"qty":0.1,"note":"7","gone":null,"eventId":"0190a5c4-7e2b-7000-8000-00000000abcd"}"#
        );
        // Bytes that are not UTF-8: base64, as the converter writes a bytes field.
        ev.payload = Bytes::from_static(b"\xff\x00");
        ev.content_type = Some("application/octet-stream".into());
        let v: serde_json::Value = serde_json::from_slice(&o.body(&ev).unwrap().bytes).unwrap();
        assert_eq!(v["payload"], "/wA=");
        for bad in ["a b", "x=payload", "a=x,b=x", "=x"] {
            assert!(
                parse_envelope_fields(&crate::sink::specs(bad)).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn envelope_and_cloudevents_carry_the_documented_fields() {
        let mut ev = crate::sink::test_event();
        ev.extra = vec![("aggregate_type".into(), "invoice".into())];
        let b = opts(BodyFormat::Envelope).body(&ev).unwrap();
        let v: serde_json::Value = serde_json::from_slice(&b.bytes).unwrap();
        assert_eq!(b.content_type, "application/json");
        assert_eq!(v["id"], "0190a5c4-7e2b-7000-8000-00000000abcd");
        assert_eq!(v["aggregate"]["id"], "agg-1");
        assert_eq!(v["aggregate"]["type"], "invoice");
        assert_eq!(v["aggregate"]["version"], 7);
        assert_eq!(v["topic"], "invoice.issued");
        assert_eq!(v["payload"], serde_json::json!({"a": 1}));
        assert_eq!(v["created_at"], "2025-06-15T15:06:40.123456Z");
        assert_eq!(v["position"], "00000000/016B3748:0000000003");

        let b = opts(BodyFormat::Cloudevents).body(&ev).unwrap();
        assert_eq!(b.content_type, "application/cloudevents+json");
        let v: serde_json::Value = serde_json::from_slice(&b.bytes).unwrap();
        assert_eq!(v["specversion"], "1.0");
        assert_eq!(v["type"], "invoice.issued");
        assert_eq!(v["subject"], "agg-1");
        assert_eq!(v["source"], "/outboxd");
        assert_eq!(v["datacontenttype"], "application/json");
        assert_eq!(v["data"], serde_json::json!({"a": 1}));

        let b = opts(BodyFormat::CloudeventsBinary).body(&ev).unwrap();
        assert_eq!(&b.bytes[..], br#"{"a": 1}"#);
        assert!(b.headers.iter().all(|(k, _)| headers::is_reserved(k)));
        assert_eq!(b.headers.len(), 7);
    }

    #[test]
    fn opaque_payloads_become_strings_or_base64() {
        let mut ev = crate::sink::test_event();
        ev.content_type = Some("text/plain".into());
        ev.payload = Bytes::from_static(b"hello");
        let v: serde_json::Value =
            serde_json::from_slice(&opts(BodyFormat::Envelope).body(&ev).unwrap().bytes).unwrap();
        assert_eq!(v["payload"], "hello");
        assert_eq!(v["content_type"], "text/plain");
        ev.payload = Bytes::from_static(&[0xff, 0x00]);
        let v: serde_json::Value =
            serde_json::from_slice(&opts(BodyFormat::Cloudevents).body(&ev).unwrap().bytes)
                .unwrap();
        assert_eq!(v["data_base64"], "/wA=");
        assert!(v.get("data").is_none());
        assert_eq!(
            opts(BodyFormat::Raw).body(&ev).unwrap().content_type,
            "text/plain"
        );
    }

    #[test]
    fn column_headers_refuse_reserved_names() {
        let h = parse_column_headers(&[
            "traceparent=traceparent".into(),
            "tenant_id=x-tenant".into(),
        ])
        .unwrap();
        assert_eq!(h.len(), 2);
        for bad in [
            "a=x-aggregate-id",
            "a=CC",
            "a=cloudEvents:id",
            "a",
            "a b=c",
            "a=",
        ] {
            assert!(parse_column_headers(&[bad.into()]).is_err(), "{bad}");
        }
        let e = parse_column_headers(&["v=x-aggregate-version".into()]).unwrap_err();
        assert!(e.to_string().contains("relay's own"), "{e}");
    }

    #[test]
    fn routing_keys_render_from_columns() {
        let mut ev = crate::sink::test_event();
        ev.extra = vec![("tenant".into(), "acme".into())];
        let o = MessageOptions {
            routing_key: Template::parse("{tenant}.{topic}").unwrap(),
            ..Default::default()
        };
        assert_eq!(o.routing_key(&ev).unwrap(), "acme.invoice.issued");
        ev.extra.clear();
        assert!(o
            .routing_key(&ev)
            .unwrap_err()
            .contains("no value for {tenant}"));
    }
}
