//! `outboxd check` for the RabbitMQ stream sink: whether the stream port answers, whether each
//! stream the relay publishes into exists (with `--partitions N`, `<stream>-0` …), and each
//! stream's retention, each problem with its fix. The stream protocol has no command that
//! returns a stream's arguments, so the retention is read from the management HTTP API (a
//! plain `GET /api/queues/<vhost>/<stream>`); where that does not answer, the check says so and
//! names the command that shows the settings instead of guessing.

use super::{missing_stream, RabbitStreamSink};
use crate::diagnostics::{CheckLine, Level};
use crate::sink::topology::check_line;
use crate::sink::DeclareMode;
use base64::Engine;
use rabbitmq_stream_client::types::ResponseCode;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The management API's port when `--stream-management-url` names none.
pub(crate) const MANAGEMENT_PORT: u16 = 15672;

/// One stream's retention as the broker holds it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Retention {
    /// `x-max-length-bytes` / `x-max-age` from the stream's arguments.
    pub max_bytes: Option<u64>,
    pub max_age: Option<String>,
    /// The policy applied to it and the retention keys that policy sets.
    pub policy: Option<String>,
    pub policy_max_bytes: Option<u64>,
    pub policy_max_age: Option<String>,
}

impl Retention {
    /// From the management API's queue object.
    pub(crate) fn from_json(v: &serde_json::Value) -> Retention {
        let args = &v["arguments"];
        let policy = &v["effective_policy_definition"];
        let age = |v: &serde_json::Value| v.as_str().map(String::from);
        Retention {
            max_bytes: args["x-max-length-bytes"].as_u64(),
            max_age: age(&args["x-max-age"]),
            policy: v["policy"].as_str().map(String::from),
            policy_max_bytes: policy["max-length-bytes"].as_u64(),
            policy_max_age: age(&policy["max-age"]),
        }
    }

    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(b) = self.max_bytes {
            parts.push(format!("max-length-bytes {b}"));
        }
        if let Some(a) = &self.max_age {
            parts.push(format!("max-age {a}"));
        }
        if let Some(p) = &self.policy {
            let mut keys = Vec::new();
            if let Some(b) = self.policy_max_bytes {
                keys.push(format!("max-length-bytes {b}"));
            }
            if let Some(a) = &self.policy_max_age {
                keys.push(format!("max-age {a}"));
            }
            parts.push(format!("policy {p:?} ({})", keys.join(", ")));
        }
        parts.join(", ")
    }

    fn bounded(&self) -> bool {
        self.max_bytes.is_some()
            || self.max_age.is_some()
            || self.policy_max_bytes.is_some()
            || self.policy_max_age.is_some()
    }
}

/// The retention the stream's flags ask for, in the broker's spelling of `max-age`.
fn wanted(sink: &RabbitStreamSink) -> (Option<u64>, Option<String>) {
    (
        sink.cfg.max_bytes,
        sink.cfg.max_age.map(|a| format!("{}s", a.as_secs().max(1))),
    )
}

/// Seconds of a RabbitMQ `max-age` (`7D`, `12h`, `604800s`, …), to compare two spellings.
fn age_secs(a: &str) -> Option<u64> {
    let split = a.find(|c: char| !c.is_ascii_digit())?;
    let n: u64 = a[..split].parse().ok()?;
    let unit = match &a[split..] {
        "Y" => 365 * 86400,
        "M" => 30 * 86400,
        "D" => 86400,
        "h" => 3600,
        "m" => 60,
        "s" => 1,
        _ => return None,
    };
    Some(n * unit)
}

impl RabbitStreamSink {
    /// The check lines for this sink; `management`: the management API's base URL
    /// (`http://host:15672`, default: the stream URL's host and credentials).
    pub async fn check(&self, management: Option<&str>) -> Vec<CheckLine> {
        let mut out = Vec::new();
        let admin = match tokio::time::timeout(
            self.cfg.op_timeout,
            rabbitmq_stream_client::Client::connect(self.client_options()),
        )
        .await
        {
            Ok(Ok(c)) => c,
            Ok(Err(e)) => {
                out.push(check_line(
                    Level::Fail,
                    "stream connect",
                    format!(
                        "the stream port at {} does not answer: {e}",
                        self.endpoint.redacted
                    ),
                    Some("enable the stream plugin (rabbitmq-plugins enable rabbitmq_stream, port 5552) or correct the URL's host, port and credentials".into()),
                ));
                return out;
            }
            Err(_) => {
                out.push(check_line(
                    Level::Fail,
                    "stream connect",
                    format!(
                        "the stream port at {} did not answer within {:?}",
                        self.endpoint.redacted, self.cfg.op_timeout
                    ),
                    Some(
                        "check the host and port (a firewall or a proxy that holds the connection)"
                            .into(),
                    ),
                ));
                return out;
            }
        };
        out.push(check_line(
            Level::Ok,
            "stream connect",
            format!("the stream port at {} answers", self.endpoint.redacted),
            None,
        ));
        let streams = self.cfg.streams();
        let meta = admin.metadata(streams.clone()).await;
        let _ = admin.close().await;
        let meta = match meta {
            Ok(m) => m,
            Err(e) => {
                out.push(check_line(
                    Level::Fail,
                    "stream metadata",
                    format!("reading the streams' metadata: {e}"),
                    None,
                ));
                return out;
            }
        };
        let mgmt = Management::new(self, management);
        for stream in &streams {
            let check = format!("stream {stream}");
            if meta.get(stream).map(|m| &m.response_code) != Some(&ResponseCode::Ok) {
                let fix = match missing_stream(stream) {
                    crate::sink::SinkError::Config { fix, .. } => fix,
                    e => e.to_string(),
                };
                out.push(match self.cfg.declare {
                    DeclareMode::Auto => check_line(
                        Level::Warn,
                        &check,
                        "does not exist yet: the relay creates it (--declare auto)",
                        None,
                    ),
                    _ => check_line(Level::Fail, &check, "does not exist", Some(fix)),
                });
                continue;
            }
            out.push(check_line(Level::Ok, &check, "exists", None));
            out.push(self.retention_line(stream, &mgmt).await);
        }
        out
    }

    async fn retention_line(&self, stream: &str, mgmt: &Management) -> CheckLine {
        let check = format!("stream {stream} retention");
        let r = match mgmt.retention(&self.endpoint.vhost, stream).await {
            Ok(r) => r,
            Err(e) => {
                return check_line(
                    Level::Warn,
                    &check,
                    format!("not read: the management API at {} {e}", mgmt.shown),
                    Some(format!(
                        "enable it (rabbitmq-plugins enable rabbitmq_management) or name it with --stream-management-url; by hand: rabbitmqctl list_queues -p {} name arguments effective_policy_definition",
                        self.endpoint.vhost
                    )),
                );
            }
        };
        let policy_fix = |what: &str| {
            format!(
                "{what}: rabbitmqctl set_policy -p {} outbox-retention '^{}$' '{{\"max-length-bytes\":20000000000}}' --apply-to queues (or a max-age)",
                self.endpoint.vhost,
                regex_escape(stream)
            )
        };
        if !r.bounded() {
            return check_line(
                Level::Warn,
                &check,
                "none: the stream keeps every message until the disk fills and the broker's disk alarm blocks publishing",
                Some(policy_fix("bound it with a policy")),
            );
        }
        let (bytes, age) = wanted(self);
        let differs = bytes.is_some_and(|b| Some(b) != r.max_bytes)
            || age
                .as_deref()
                .is_some_and(|a| r.max_age.as_deref().and_then(age_secs) != age_secs(a));
        if differs {
            return check_line(
                Level::Warn,
                &check,
                format!(
                    "{}; --stream-max-bytes/--stream-max-age ask for other values, which apply only to a stream --declare auto creates",
                    r.describe()
                ),
                Some(policy_fix("to change an existing stream's retention, set a policy")),
            );
        }
        check_line(Level::Ok, &check, r.describe(), None)
    }
}

/// A stream name as a literal in a policy's pattern.
fn regex_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// Where the management API is and how to ask it.
struct Management {
    host: String,
    port: u16,
    auth: String,
    /// The address without credentials, for the check's text.
    shown: String,
}

impl Management {
    fn new(sink: &RabbitStreamSink, url: Option<&str>) -> Management {
        let e = &sink.endpoint;
        let parsed = url.and_then(|u| url::Url::parse(u).ok());
        let host = parsed
            .as_ref()
            .and_then(|u| u.host_str().map(String::from))
            .unwrap_or_else(|| e.host.clone());
        let port = parsed
            .as_ref()
            .and_then(|u| u.port())
            .unwrap_or(MANAGEMENT_PORT);
        let (user, password) = match parsed.as_ref().filter(|u| !u.username().is_empty()) {
            Some(u) => (
                u.username().to_string(),
                u.password().unwrap_or_default().to_string(),
            ),
            None => (e.user.clone(), e.password.to_string()),
        };
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        Management {
            shown: format!("http://{host}:{port}"),
            host,
            port,
            auth,
        }
    }

    /// `GET /api/queues/<vhost>/<stream>` (HTTP/1.0: one plain body, no chunks).
    async fn retention(&self, vhost: &str, stream: &str) -> Result<Retention, String> {
        let enc = |s: &str| {
            percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
        };
        let request = format!(
            "GET /api/queues/{}/{} HTTP/1.0\r\nHost: {}\r\nAuthorization: Basic {}\r\n\r\n",
            enc(vhost),
            enc(stream),
            self.host,
            self.auth
        );
        let exchange = async {
            let mut conn = tokio::net::TcpStream::connect((self.host.as_str(), self.port))
                .await
                .map_err(|e| format!("does not answer ({e})"))?;
            conn.write_all(request.as_bytes())
                .await
                .map_err(|e| format!("failed ({e})"))?;
            let mut reply = Vec::new();
            conn.take(4 << 20)
                .read_to_end(&mut reply)
                .await
                .map_err(|e| format!("failed ({e})"))?;
            Ok::<_, String>(reply)
        };
        let reply = tokio::time::timeout(Duration::from_secs(10), exchange)
            .await
            .map_err(|_| "did not answer within 10s".to_string())??;
        let text = String::from_utf8_lossy(&reply);
        let (head, body) = text
            .split_once("\r\n\r\n")
            .ok_or_else(|| "sent no HTTP reply".to_string())?;
        let status = head.split(' ').nth(1).unwrap_or("");
        if status != "200" {
            return Err(format!(
                "answered {}",
                head.lines().next().unwrap_or_default()
            ));
        }
        let v: serde_json::Value =
            serde_json::from_str(body).map_err(|e| format!("sent unreadable JSON ({e})"))?;
        Ok(Retention::from_json(&v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retention_from_arguments_and_policy() {
        let v = serde_json::json!({
            "arguments": {"x-max-age": "7D", "x-max-length-bytes": 1000, "x-queue-type": "stream"},
            "policy": "keep",
            "effective_policy_definition": {"max-age": "1h"}
        });
        let r = Retention::from_json(&v);
        assert!(r.bounded());
        assert_eq!(
            r.describe(),
            "max-length-bytes 1000, max-age 7D, policy \"keep\" (max-age 1h)"
        );
        assert!(!Retention::from_json(&serde_json::json!({"arguments": {}})).bounded());
    }

    #[test]
    fn ages_compare_across_spellings() {
        assert_eq!(age_secs("7D"), age_secs("604800s"));
        assert_eq!(age_secs("2h"), Some(7200));
        assert_eq!(age_secs("x"), None);
        assert_eq!(regex_escape("a.b-1"), "a\\.b-1");
    }
}
