//! What the NATS sink is told at start, checked once: the server address and its credentials
//! (never shown unredacted), the subject template and the names derived from it (the stream's
//! subject filter and the dead subject), and the stream's name.

use crate::dsn::redact;
use crate::sink::template::{self, Template};
use crate::sink::DeclareMode;
use std::path::PathBuf;
use std::time::Duration;

/// Default `--subject`.
pub(crate) const DEFAULT_SUBJECT: &str = "outbox.{topic}";
/// The duplicate window a declared stream gets, and the least `check` accepts: a relay that
/// restarts within it republishes nothing the stream keeps twice.
pub(crate) const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// A rendered subject longer than this is a poison event (NATS has no hard limit; a bound
/// keeps a runaway column value out of every consumer's subject filter).
pub(crate) const MAX_SUBJECT_BYTES: usize = 1024;

/// Everything the sink needs, validated by [`NatsConfig::new`].
#[derive(Clone)]
pub struct NatsConfig {
    /// `nats://` or `tls://` URL, credentials included: never log it unredacted.
    pub url: String,
    pub subject: Template,
    pub stream: String,
    pub declare: DeclareMode,
    pub max_message_bytes: usize,
    /// Bounds connecting, declaring and handing one message to the client.
    pub op_timeout: Duration,
    /// The relay's window: the client keeps at least this many acknowledgements in flight.
    pub window: usize,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// Shown in the server's connection list.
    pub connection_name: String,
    /// `--partitions N`: subjects `<prefix>.p<k>.<rest>`; 0 = off.
    pub partitions: u32,
    /// `--header COLUMN=NAME`: columns copied into headers, as text (see `sink::headers`).
    pub headers: Vec<crate::sink::format::ColumnHeader>,
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &redact(&self.url))
            .field("subject", &self.subject.to_string())
            .field("stream", &self.stream)
            .field("declare", &self.declare)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("op_timeout", &self.op_timeout)
            .field("window", &self.window)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .field("partitions", &self.partitions)
            .finish()
    }
}

/// The server address split from its credentials.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// `nats://host:port` or `tls://host:port`, without credentials.
    pub address: String,
    pub tls: bool,
    pub user: Option<String>,
    pub password: Option<String>,
    /// A user without a password in the URL is a token (`nats://TOKEN@host`), as NATS reads it.
    pub token: Option<String>,
    /// `?creds=/path/user.creds`: a decentralised-auth credentials file.
    pub creds_file: Option<PathBuf>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("address", &self.address)
            .field("tls", &self.tls)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("token", &self.token.as_ref().map(|_| "<redacted>"))
            .field("creds_file", &self.creds_file)
            .finish()
    }
}

fn config_err(problem: impl Into<String>, fix: impl Into<String>) -> crate::Error {
    crate::Error::config(problem, fix)
}

/// Splits `nats://[user[:password]@]host[:port][?creds=PATH]` (or `tls://`).
pub(crate) fn endpoint(url: &str) -> Result<Endpoint, crate::Error> {
    let shown = redact(url);
    let u = url::Url::parse(url.trim()).map_err(|e| {
        config_err(
            format!("cannot parse the sink {shown}: {e}"),
            "use nats://host:4222 (tls://host:4222 for TLS)",
        )
    })?;
    let tls = match u.scheme() {
        "nats" => false,
        "tls" => true,
        other => {
            return Err(config_err(
                format!("{other}:// is not a NATS sink"),
                "use nats://host:4222 or tls://host:4222",
            ))
        }
    };
    let host = u.host_str().filter(|h| !h.is_empty()).ok_or_else(|| {
        config_err(
            format!("the sink {shown} names no host"),
            "use nats://host:4222",
        )
    })?;
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let mut creds_file = None;
    for (k, v) in u.query_pairs() {
        match k.as_ref() {
            "creds" => creds_file = Some(PathBuf::from(v.as_ref())),
            other => {
                return Err(config_err(
                    format!("unknown option {other:?} in the NATS sink {shown}"),
                    "a NATS sink takes creds=/path/user.creds; TLS files are --sink-ca, --sink-cert and --sink-key",
                ))
            }
        }
    }
    let (user, password, token) = match (u.username(), u.password()) {
        ("", _) => (None, None, None),
        (t, None) => (None, None, Some(decode(t))),
        (user, Some(p)) => (Some(decode(user)), Some(decode(p)), None),
    };
    let port = u.port().unwrap_or(4222);
    Ok(Endpoint {
        address: format!("{}://{host}:{port}", u.scheme()),
        tls,
        user,
        password,
        token,
        creds_file,
    })
}

/// Checks a stream name: JetStream refuses spaces, `.`, `*`, `>` and path separators.
pub(crate) fn validate_stream(name: &str) -> Result<(), crate::Error> {
    let ok = !name.is_empty()
        && name.len() <= 255
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_');
    if !ok {
        return Err(config_err(
            format!("--stream {name:?} is not a usable JetStream stream name"),
            "use 1 to 255 characters of [A-Za-z0-9-_], e.g. --stream OUTBOX",
        ));
    }
    Ok(())
}

/// The literal tokens a subject template starts with (`outbox` of `outbox.{topic}`): the
/// stream captures `<prefix>.>`, the dead subject is `<prefix>.dead` and partitions insert
/// `p<k>` after it. A template without one would make the stream capture every subject.
pub(crate) fn subject_prefix(subject: &Template) -> Result<String, crate::Error> {
    // Rendering with a marker no literal contains finds where the first placeholder starts.
    const MARK: char = '\u{0}';
    let rendered = subject
        .render(|_| Some(std::borrow::Cow::Owned(MARK.to_string())))
        .unwrap_or_default();
    let head = match rendered.find(MARK) {
        Some(i) => &rendered[..i],
        None => rendered.as_str(),
    };
    let prefix = match head.rfind('.') {
        Some(i) => &head[..i],
        None => "",
    };
    let tokens_ok = !prefix.is_empty()
        && prefix.split('.').all(|t| {
            !t.is_empty() && t != "*" && t != ">" && !t.chars().any(|c| c.is_whitespace())
        });
    if !tokens_ok {
        return Err(config_err(
            format!("--subject {subject:?} does not start with a literal subject token followed by '.'"),
            "start the template with a fixed token, e.g. --subject outbox.{topic}: the stream then captures outbox.> and poison records go to outbox.dead",
        ));
    }
    Ok(prefix.to_string())
}

impl NatsConfig {
    /// Checks the template's placeholders, the stream name and the address.
    pub fn validate(&self) -> Result<(), crate::Error> {
        let ep = endpoint(&self.url)?;
        // Files holding a secret (a `.creds` file's NKey seed, the client key) are checked for
        // owner and mode as every secret file of the relay is, before anything starts.
        let secrets = [
            (
                ep.creds_file.as_deref(),
                "NATS credentials file (creds= in --sink)",
            ),
            (self.key_file.as_deref(), "TLS private key (--sink-key)"),
        ];
        for (path, what) in secrets {
            if let Some(path) = path {
                crate::secret_file::read(path)
                    .map_err(|e| config_err(format!("{what}: {e}"), e.fix()))?;
            }
        }
        validate_stream(&self.stream)?;
        self.subject
            .check_vars(template::EVENT_FIELDS.iter().copied())
            .map_err(|e| {
                config_err(
                    format!("--subject: {e}"),
                    "use the fields an event has, e.g. --subject outbox.{topic}",
                )
            })?;
        subject_prefix(&self.subject)?;
        if self.partitions > crate::sink::partition::MAX_PARTITIONS {
            return Err(config_err(
                format!(
                    "--partitions {} is more than the {} allowed",
                    self.partitions,
                    crate::sink::partition::MAX_PARTITIONS
                ),
                "use fewer partitions",
            ));
        }
        Ok(())
    }
}

/// Whether `subject` is one a message can be published to: dot-separated, non-empty tokens,
/// no wildcards, no whitespace or control characters.
pub(crate) fn publishable(subject: &str) -> Result<(), String> {
    if subject.len() > MAX_SUBJECT_BYTES {
        return Err(format!(
            "subject is {} bytes, more than the {MAX_SUBJECT_BYTES} allowed",
            subject.len()
        ));
    }
    for token in subject.split('.') {
        if token.is_empty() {
            return Err(format!(
                "subject {subject:?} has an empty token (a leading, trailing or doubled '.')"
            ));
        }
        if token == "*" || token == ">" {
            return Err(format!(
                "subject {subject:?} has the wildcard token {token:?}"
            ));
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!(
                "subject {subject:?} contains whitespace or a control character"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_split_credentials_and_never_show_them() {
        let e = endpoint("nats://app:s%40cret@nats.example:4333").unwrap();
        assert_eq!(e.address, "nats://nats.example:4333");
        assert_eq!(e.user.as_deref(), Some("app"));
        assert_eq!(e.password.as_deref(), Some("s@cret"));
        assert!(!format!("{e:?}").contains("cret"));
        let t = endpoint("tls://tok3n@127.0.0.1").unwrap();
        assert!(t.tls);
        assert_eq!(t.address, "tls://127.0.0.1:4222");
        assert_eq!(t.token.as_deref(), Some("tok3n"));
        assert!(!format!("{t:?}").contains("tok3n"));
        assert!(endpoint("nats://h?bogus=1").is_err());
        assert!(endpoint("amqp://h").is_err());
    }

    #[test]
    fn prefixes_come_from_the_literal_head_of_the_template() {
        let p = |s: &str| subject_prefix(&Template::parse(s).unwrap());
        assert_eq!(p("outbox.{topic}").unwrap(), "outbox");
        assert_eq!(p("acme.orders.{topic}.v1").unwrap(), "acme.orders");
        assert_eq!(p("acme.all").unwrap(), "acme");
        assert_eq!(p("acme.x{topic}").unwrap(), "acme");
        for bad in [
            "{topic}",
            "outbox{topic}",
            "events",
            "*.{topic}",
            ".{topic}",
        ] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains("--subject outbox.{topic}"), "{bad}: {e}");
        }
    }

    #[test]
    fn publishable_subjects() {
        assert!(publishable("outbox.invoice.issued").is_ok());
        for bad in [
            "outbox..x",
            "outbox.x.",
            "outbox.*",
            "outbox.>",
            "outbox.a b",
            "outbox.a\r\n",
        ] {
            assert!(publishable(bad).is_err(), "{bad}");
        }
        assert!(publishable(&format!("outbox.{}", "a".repeat(2000))).is_err());
    }

    #[test]
    fn stream_names() {
        assert!(validate_stream("OUTBOX").is_ok());
        assert!(validate_stream("outbox-2_a").is_ok());
        for bad in ["", "OUT.BOX", "OUT BOX", "a>", "a/b"] {
            assert!(validate_stream(bad).is_err(), "{bad}");
        }
    }
}
