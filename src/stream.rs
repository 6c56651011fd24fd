//! The RabbitMQ stream protocol pieces the stream sink (`sink::rabbitmq_stream`) and the
//! consumer kit's stream runner (`consumer::runner`) share: reading a `rabbitmq-stream://` URL
//! ([`StreamEndpoint`]), the client's TLS settings with every file checked first
//! ([`tls_configuration`]), connecting ([`environment`], [`client_options`]), and turning AMQP
//! 0-9-1 header values into AMQP 1.0 application properties and back ([`to_simple`],
//! [`to_amqp`]), so a message the sink wrote reads back with the headers it was rendered with.

use crate::dsn::redact;
#[cfg(feature = "rabbitmq")]
use lapin::types::{AMQPValue, FieldTable};
#[cfg(feature = "rabbitmq")]
use lapin::BasicProperties;
#[cfg(feature = "rabbitmq")]
use rabbitmq_stream_client::types::{Message, SimpleValue};
use rabbitmq_stream_client::{ClientOptions, Environment, TlsConfiguration};
use zeroize::Zeroizing;

/// The application property holding a message's publishing id (the sink's deduplication id).
pub(crate) const PUBLISHING_ID_HEADER: &str = "x-outbox-publishing-id";

/// The stream port RabbitMQ listens on when the URL names none.
pub(crate) const DEFAULT_PORT: u16 = 5552;
/// RabbitMQ's stream TLS port (`stream.listeners.ssl`) when a `rabbitmq-stream+tls://` URL
/// names none.
pub(crate) const DEFAULT_TLS_PORT: u16 = 5551;

/// The broker address and credentials of a `rabbitmq-stream://` URL.
pub struct StreamEndpoint {
    pub host: String,
    pub port: u16,
    pub user: String,
    pub password: Zeroizing<String>,
    pub vhost: String,
    /// `rabbitmq-stream+tls://`: TLS to the stream port.
    pub tls: bool,
    /// The URL without its password, for logs.
    pub redacted: String,
}

impl std::fmt::Debug for StreamEndpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.redacted)
    }
}

/// How the errors about a URL name it and say how to write it: the sink's `--sink` and the
/// consumer's `--broker` are read by the same rules.
#[derive(Debug, Clone, Copy)]
pub struct Wording {
    /// "the sink", "the broker URL".
    pub what: &'static str,
    pub fix: &'static str,
    /// The names of the CA, certificate and key files where this URL's user gives them.
    pub ca: &'static str,
    pub cert: &'static str,
    pub key: &'static str,
}

/// The relay's `--sink rabbitmq-stream://…`.
pub const SINK: Wording = Wording {
    what: "the sink",
    fix: "use --sink rabbitmq-stream://user@host:5552/vhost, or rabbitmq-stream+tls://user@host:5551/vhost with --sink-ca (the password in the URL or from --sink-file; %2f for the vhost /)",
    ca: "--sink-ca",
    cert: "--sink-cert",
    key: "--sink-key",
};

/// A consumer's `--broker rabbitmq-stream://…` (TLS files as URL options, as on `amqps://`).
pub(crate) const BROKER: Wording = Wording {
    what: "the broker URL",
    fix: "use rabbitmq-stream://user@host:5552/vhost, or rabbitmq-stream+tls://user@host:5551/vhost?cacertfile=/path/ca.pem (%2f for the vhost /)",
    ca: "cacertfile",
    cert: "certfile",
    key: "keyfile",
};

impl StreamEndpoint {
    /// Parses the sink's `rabbitmq-stream://user:password@host:port/vhost`; an empty path is
    /// the vhost `/`.
    pub fn parse(url: &str) -> Result<StreamEndpoint, crate::Error> {
        Self::parse_as(url, &SINK)
    }

    /// [`StreamEndpoint::parse`], with errors worded for where the URL was given.
    pub(crate) fn parse_as(url: &str, w: &Wording) -> Result<StreamEndpoint, crate::Error> {
        let url_err = |problem: String| crate::Error::config(problem, w.fix);
        let what = w.what;
        let redacted = redact(url);
        let u = url::Url::parse(url)
            .map_err(|e| url_err(format!("cannot parse {what} {redacted}: {e}")))?;
        let tls = match u.scheme() {
            "rabbitmq-stream" => false,
            "rabbitmq-stream+tls" => true,
            _ => {
                return Err(url_err(format!(
                    "{what} {redacted} is not a rabbitmq-stream:// or rabbitmq-stream+tls:// URL"
                )))
            }
        };
        let host = u
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| url_err(format!("{what} {redacted} names no host")))?
            .trim_matches(|c| c == '[' || c == ']')
            .to_string();
        if u.query().is_some() {
            return Err(url_err(format!(
                "{what} {redacted} has URL options it does not take"
            )));
        }
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| url_err(format!("{what} {redacted} has invalid UTF-8 escapes")))
        };
        let user = match u.username() {
            "" => "guest".to_string(),
            name => decode(name)?,
        };
        let password = Zeroizing::new(match u.password() {
            Some(p) => decode(p)?,
            None if user == "guest" => "guest".to_string(),
            None => String::new(),
        });
        let vhost = match u.path().trim_start_matches('/') {
            "" => "/".to_string(),
            v => decode(v)?,
        };
        Ok(StreamEndpoint {
            host,
            port: u
                .port()
                .unwrap_or(if tls { DEFAULT_TLS_PORT } else { DEFAULT_PORT }),
            user,
            password,
            vhost,
            tls,
            redacted,
        })
    }
}

/// The stream client's TLS settings for `endpoint`, every file checked here: the client reads
/// them itself on each connect and panics on a CA file it cannot read, a key that is not
/// PKCS#8 or a certificate it cannot use, and it has no system roots to fall back on. `w`
/// names the files as the user gives them (the sink's flags, the consumer's URL options).
pub(crate) fn tls_configuration(
    endpoint: &StreamEndpoint,
    ca: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    w: &Wording,
) -> Result<TlsConfiguration, crate::Error> {
    let what = w.what;
    if !endpoint.tls {
        if ca.is_some() || cert.is_some() {
            return Err(crate::Error::config(
                format!("{}/{} are given but {what} {} is not TLS", w.ca, w.cert, endpoint.redacted),
                "use rabbitmq-stream+tls://host:5551/… for TLS to the stream port, or drop the TLS files",
            ));
        }
        let mut off = TlsConfiguration::default();
        off.enable(false);
        return Ok(off);
    }
    let Some(ca) = ca else {
        return Err(crate::Error::config(
            format!("{what} {} needs {}", endpoint.redacted, w.ca),
            format!("name the PEM file of the CA that signed the broker's certificate with {} (the stream client trusts only the CA it is given, no system roots)", w.ca),
        ));
    };
    if rustls::pki_types::ServerName::try_from(endpoint.host.as_str()).is_err() {
        return Err(crate::Error::config(
            format!(
                "the host {:?} of {what} is not a name TLS can verify",
                endpoint.host
            ),
            "use the host name or IP address the broker's certificate names",
        ));
    }
    // The same checks the relay's own TLS makes (readable, PEM, a key the secret-file rules
    // allow, certificate and key usable together), plus the client's one restriction.
    crate::tls::client_config(&crate::dsn::TlsSettings {
        mode: crate::dsn::TlsMode::VerifyFull,
        ca_file: Some(ca.clone()),
        cert_file: cert.clone(),
        key_file: key.clone(),
    })?;
    let mut b = TlsConfiguration::builder()
        .enable(true)
        .add_root_certificates(ca);
    if let (Some(cert), Some(key)) = (cert, key) {
        if !matches!(
            crate::tls::load_key(&key)?,
            rustls::pki_types::PrivateKeyDer::Pkcs8(_)
        ) {
            return Err(crate::Error::config(
                format!("{} {key} is not a PKCS#8 key (BEGIN PRIVATE KEY), the only kind the stream client reads", w.key),
                format!("convert it: openssl pkcs8 -topk8 -nocrypt -in {key} -out client.pk8.pem"),
            ));
        }
        b = b.add_client_certificates_keys(cert, key);
    }
    Ok(b.build())
}

/// The connection settings of `e` on a builder of the client: its client options and its
/// environment have the same settings under two spellings (`user`/`username`,
/// `v_host`/`virtual_host`) and no conversion between them, so they are written once here.
/// Connect where the URL says and check that the node there leads the stream, instead of
/// following the advertised host: the relay and the consumers reach the broker through that
/// address (a load balancer, a proxy, a container's published port).
macro_rules! connect_to {
    ($builder:expr, $e:expr, $tls:expr, $user:ident, $vhost:ident) => {
        $builder
            .host(&$e.host)
            .port($e.port)
            .$user(&$e.user)
            .password(&$e.password)
            .$vhost(&$e.vhost)
            .load_balancer_mode(true)
            .tls($tls.clone())
    };
}

/// The options of one client connection to `e`.
pub(crate) fn client_options(e: &StreamEndpoint, tls: &TlsConfiguration) -> ClientOptions {
    connect_to!(ClientOptions::builder(), e, tls, user, v_host).build()
}

/// An environment (producers and consumers) on `e`, connecting as [`client_options`] does.
pub async fn environment(
    e: &StreamEndpoint,
    tls: &TlsConfiguration,
) -> Result<Environment, rabbitmq_stream_client::error::ClientError> {
    connect_to!(Environment::builder(), e, tls, username, virtual_host)
        .build()
        .await
}

/// A stream message with AMQP 0-9-1 properties `p` carried over into AMQP 1.0 sections (the
/// topic in `subject`, the headers as application properties) and publishing id
/// `publishing_id` (also in the `x-outbox-publishing-id` property).
#[cfg(feature = "rabbitmq")]
pub fn to_message(p: &BasicProperties, body: &[u8], publishing_id: u64) -> Message {
    let mut props = Message::builder()
        .publising_id(publishing_id)
        .body(body.to_vec())
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
            app = app.insert(k.as_str(), to_simple(v));
        }
    }
    if let Some(a) = p.app_id() {
        app = app.insert("app-id", a.as_str());
    }
    // A `long`, not the id's own `ulong`: RabbitMQ 3.10 cannot convert an unsigned long
    // application property for AMQP 0-9-1 consumers of the stream (`x-stream-offset`), and
    // closes their connection when it meets one.
    app.insert(
        PUBLISHING_ID_HEADER,
        long(i64::try_from(publishing_id).unwrap_or(i64::MAX)),
    )
    .message_builder()
    .build()
}

/// An integer as an application property. The stream client (0.4.4) sizes a `long` between
/// -128 and 127 one byte larger than it writes it (the one-byte `smalllong` encoding), so a
/// frame holding one announces a byte it never sends: the broker waits for it, reads the next
/// frame's first byte into the message, and confirms nothing more on that connection. Those
/// values go as an `int`, whose small encoding the client sizes right; they read back as the
/// same number.
#[cfg(feature = "rabbitmq")]
fn long(i: i64) -> SimpleValue {
    match i32::try_from(i) {
        Ok(small) if i8::try_from(i).is_ok() => SimpleValue::Int(small),
        _ => SimpleValue::Long(i),
    }
}

/// A header value as an application property: AMQP 1.0 application properties hold only
/// simple values, so an array or a table travels as its JSON text.
#[cfg(feature = "rabbitmq")]
pub(crate) fn to_simple(v: &AMQPValue) -> SimpleValue {
    match v {
        AMQPValue::Boolean(b) => SimpleValue::Boolean(*b),
        AMQPValue::LongLongInt(i) => long(*i),
        AMQPValue::LongInt(i) => long(i64::from(*i)),
        AMQPValue::Double(d) => SimpleValue::Double((*d).into()),
        AMQPValue::Float(f) => SimpleValue::Float((*f).into()),
        AMQPValue::LongString(s) => {
            SimpleValue::String(String::from_utf8_lossy(s.as_bytes()).into_owned())
        }
        AMQPValue::ShortString(s) => SimpleValue::String(s.as_str().to_string()),
        AMQPValue::Void => SimpleValue::Null,
        other => SimpleValue::String(to_json(other).to_string()),
    }
}

/// A nested header value as JSON (the row's headers object is JSON to begin with).
#[cfg(feature = "rabbitmq")]
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

/// The AMQP 0-9-1 properties and body of a stream message, the inverse of [`to_message`]:
/// `message-id` (as text whatever its AMQP 1.0 type), `subject` as the `type`, the content
/// type, `app-id`, and every other application property as a header, so the consumer kit reads
/// a stream message with the rules it reads a queue's delivery with (`consumer::Message`).
#[cfg(feature = "rabbitmq")]
pub(crate) fn from_message(m: &Message) -> (BasicProperties, Vec<u8>) {
    let mut props = BasicProperties::default();
    if let Some(p) = m.properties() {
        // The id's type is not exported by the client: its variants are tried one by one.
        let id = p.message_id.as_ref().and_then(|id| {
            if let Ok(s) = <&String>::try_from(id) {
                Some(s.clone())
            } else if let Ok(u) = <&uuid::Uuid>::try_from(id) {
                Some(u.to_string())
            } else if let Ok(n) = <&u64>::try_from(id) {
                Some(n.to_string())
            } else if let Ok(n) = <&i64>::try_from(id) {
                Some(n.to_string())
            } else {
                <&Vec<u8>>::try_from(id)
                    .ok()
                    .map(|b| String::from_utf8_lossy(b).into_owned())
            }
        });
        if let Some(id) = id {
            props = props.with_message_id(id.into());
        }
        if let Some(s) = &p.subject {
            props = props.with_type(s.clone().into());
        }
        if let Some(ct) = &p.content_type {
            props = props.with_content_type(ct.as_str().into());
        }
    }
    let mut headers = FieldTable::default();
    if let Some(app) = m.application_properties() {
        for (k, v) in app.iter() {
            match (k.as_str(), v) {
                ("app-id", SimpleValue::String(a)) => props = props.with_app_id(a.clone().into()),
                _ => {
                    headers.insert(k.clone().into(), to_amqp(v));
                }
            }
        }
    }
    let body = m.data().map(<[u8]>::to_vec).unwrap_or_default();
    (props.with_headers(headers), body)
}

/// An application property as a header value, the inverse of [`to_simple`] for the values it
/// writes (an unsigned 64-bit value above `i64::MAX` and the rarer types become text).
#[cfg(feature = "rabbitmq")]
pub(crate) fn to_amqp(v: &SimpleValue) -> AMQPValue {
    match v {
        SimpleValue::Null => AMQPValue::Void,
        SimpleValue::Boolean(b) => AMQPValue::Boolean(*b),
        SimpleValue::Ubyte(i) => AMQPValue::ShortShortUInt(*i),
        SimpleValue::Ushort(i) => AMQPValue::ShortUInt(*i),
        SimpleValue::Uint(i) => AMQPValue::LongUInt(*i),
        SimpleValue::Ulong(i) => match i64::try_from(*i) {
            Ok(i) => AMQPValue::LongLongInt(i),
            Err(_) => AMQPValue::LongString(i.to_string().into()),
        },
        SimpleValue::Byte(i) => AMQPValue::ShortShortInt(*i),
        SimpleValue::Short(i) => AMQPValue::ShortInt(*i),
        SimpleValue::Int(i) => AMQPValue::LongInt(*i),
        SimpleValue::Long(i) => AMQPValue::LongLongInt(*i),
        SimpleValue::String(s) => AMQPValue::LongString(s.as_str().into()),
        SimpleValue::Symbol(s) => AMQPValue::LongString(s.as_str().into()),
        SimpleValue::Uuid(u) => AMQPValue::LongString(u.to_string().into()),
        SimpleValue::Binary(b) => AMQPValue::ByteArray(b.clone().into()),
        other => AMQPValue::LongString(format!("{other:?}").into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_credentials_port_and_vhost() {
        let e =
            StreamEndpoint::parse("rabbitmq-stream://app:s%40cret@broker:5553/prod%2fa").unwrap();
        assert_eq!(
            (
                e.host.as_str(),
                e.port,
                e.user.as_str(),
                e.password.as_str(),
                e.vhost.as_str()
            ),
            ("broker", 5553, "app", "s@cret", "prod/a")
        );
        assert!(!format!("{e:?}").contains("s%40cret"), "{e:?}");
        let d = StreamEndpoint::parse("rabbitmq-stream://127.0.0.1").unwrap();
        assert_eq!(
            (d.port, d.vhost.as_str(), d.user.as_str()),
            (DEFAULT_PORT, "/", "guest")
        );
        assert!(!d.tls);
        let t = StreamEndpoint::parse("rabbitmq-stream+tls://localhost").unwrap();
        assert!(t.tls);
        assert_eq!(t.port, DEFAULT_TLS_PORT);
    }

    #[test]
    fn refuses_other_schemes_and_options() {
        for bad in [
            "amqp://h",
            "rabbitmq-stream://",
            "rabbitmq-stream://h?x=1",
            "rabbitmq-streams://h",
        ] {
            let e = StreamEndpoint::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains("rabbitmq-stream://user@host:5552/vhost"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_message_reads_back_with_the_properties_and_headers_it_was_written_with() {
        let mut h = FieldTable::default();
        h.insert(
            "x-aggregate-id".into(),
            AMQPValue::LongString("cust-7".into()),
        );
        h.insert("x-aggregate-version".into(), AMQPValue::LongLongInt(42));
        h.insert("x-flag".into(), AMQPValue::Boolean(true));
        let id = "0190a5c4-7e2b-7000-8000-00000000abcd";
        let props = BasicProperties::default()
            .with_message_id(id.into())
            .with_type("invoice.issued".into())
            .with_content_type("application/json".into())
            .with_app_id("billing".into())
            .with_headers(h);
        let m = to_message(&props, b"{}", 9);
        let (back, body) = from_message(&m);
        assert_eq!(body, b"{}");
        assert_eq!(back.message_id().as_ref().map(|s| s.as_str()), Some(id));
        assert_eq!(
            back.kind().as_ref().map(|s| s.as_str()),
            Some("invoice.issued")
        );
        assert_eq!(back.app_id().as_ref().map(|s| s.as_str()), Some("billing"));
        let hb = back.headers().clone().unwrap();
        let get = |k: &str| hb.inner().get(k).cloned();
        assert_eq!(
            get("x-aggregate-id"),
            Some(AMQPValue::LongString("cust-7".into()))
        );
        assert_eq!(get("x-aggregate-version"), Some(AMQPValue::LongInt(42)));
        assert_eq!(get("x-flag"), Some(AMQPValue::Boolean(true)));
        assert_eq!(get(PUBLISHING_ID_HEADER), Some(AMQPValue::LongInt(9)));
        assert_eq!(to_simple(&AMQPValue::LongLongInt(7)), SimpleValue::Int(7));
        assert_eq!(
            to_simple(&AMQPValue::LongLongInt(-128)),
            SimpleValue::Int(-128)
        );
        assert_eq!(
            to_simple(&AMQPValue::LongLongInt(128)),
            SimpleValue::Long(128)
        );
        assert_eq!(
            to_amqp(&SimpleValue::Ulong(u64::MAX)),
            AMQPValue::LongString(u64::MAX.to_string().into())
        );
    }
}
