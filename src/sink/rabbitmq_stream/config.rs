//! What the RabbitMQ stream sink is given (`--sink rabbitmq-stream://…`, `--stream`,
//! `--declare`, `--partitions`) and the endpoint parsed out of its URL. Kept apart from the
//! broker code so the redacting `Debug` (the URL holds the password) sits next to the fields it
//! must cover, and so the URL rules can be unit-tested without a broker.

use crate::dsn::redact;
use crate::sink::rabbitmq::{DeclareMode, RabbitConfig};
use std::time::Duration;
use zeroize::Zeroizing;

/// The stream port RabbitMQ listens on when the URL names none.
pub const DEFAULT_PORT: u16 = 5552;
/// RabbitMQ's stream TLS port (`stream.listeners.ssl`) when a `rabbitmq-stream+tls://` URL
/// names none.
pub const DEFAULT_TLS_PORT: u16 = 5551;

/// Everything the sink needs, already validated by the command line.
#[derive(Clone)]
pub struct StreamSinkConfig {
    /// `rabbitmq-stream://user:password@host:5552/vhost`: never log it unredacted.
    pub url: String,
    /// The stream (with `--partitions N`: the prefix of `<stream>-0` … `<stream>-<N-1>`).
    pub stream: String,
    pub declare: DeclareMode,
    /// `--stream-max-bytes` / `--stream-max-age`: retention of a stream `--declare auto` creates.
    pub max_bytes: Option<u64>,
    pub max_age: Option<Duration>,
    /// Bounds connecting, declaring and reading a stream's tail.
    pub op_timeout: Duration,
    /// The relay's name (`--name`): with the stream, the name of the broker-side producer.
    pub relay_name: String,
    /// How an event becomes a message: the same properties, headers, body formats and limits
    /// as the AMQP sink's (its URL and exchange are not used).
    pub message: RabbitConfig,
}

impl StreamSinkConfig {
    /// The partitions' streams in order (one stream without `--partitions`).
    pub fn streams(&self) -> Vec<String> {
        match self.message.partitioning.partitions {
            0 => vec![self.stream.clone()],
            n => (0..n).map(|k| format!("{}-{k}", self.stream)).collect(),
        }
    }

    /// The producer name on `stream`: the same for every run of this relay, so the broker's
    /// deduplication sequence carries over a restart, and different for two relays (their
    /// publishing ids are two sequences).
    pub fn producer_name(&self, stream: &str) -> String {
        format!("outboxd.{}.{stream}", self.relay_name)
    }
}

impl std::fmt::Debug for StreamSinkConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamSinkConfig")
            .field("url", &redact(&self.url))
            .field("stream", &self.stream)
            .field("declare", &self.declare)
            .field("max_bytes", &self.max_bytes)
            .field("max_age", &self.max_age)
            .field("op_timeout", &self.op_timeout)
            .field("relay_name", &self.relay_name)
            .field("message", &self.message)
            .finish()
    }
}

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

fn url_err(problem: String) -> crate::Error {
    crate::Error::config(
        problem,
        "use --sink rabbitmq-stream://user@host:5552/vhost, or rabbitmq-stream+tls://user@host:5551/vhost with --sink-ca (the password in the URL or from --sink-file; %2f for the vhost /)",
    )
}

impl StreamEndpoint {
    /// Parses `rabbitmq-stream://user:password@host:port/vhost`; an empty path is the vhost `/`.
    pub fn parse(url: &str) -> Result<StreamEndpoint, crate::Error> {
        let redacted = redact(url);
        let u = url::Url::parse(url)
            .map_err(|e| url_err(format!("cannot parse the sink {redacted}: {e}")))?;
        let tls = match u.scheme() {
            "rabbitmq-stream" => false,
            "rabbitmq-stream+tls" => true,
            _ => {
                return Err(url_err(format!(
                    "the sink {redacted} is not a rabbitmq-stream:// or rabbitmq-stream+tls:// URL"
                )))
            }
        };
        let host = u
            .host_str()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| url_err(format!("the sink {redacted} names no host")))?
            .trim_matches(|c| c == '[' || c == ']')
            .to_string();
        if u.query().is_some() {
            return Err(url_err(format!(
                "the sink {redacted} has URL options: the stream sink takes none"
            )));
        }
        let decode = |s: &str| {
            percent_encoding::percent_decode_str(s)
                .decode_utf8()
                .map(|c| c.into_owned())
                .map_err(|_| url_err(format!("the sink {redacted} has invalid UTF-8 escapes")))
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
}
