//! What the Kafka sink is told at start, checked once: the brokers and the credentials in
//! `--sink` (never shown unredacted), the topic it owns (dead records), what a
//! topic it declares looks like, and how the settings become librdkafka's configuration
//! (TLS and SASL included; the client key is read through the secret-file check).

use crate::dsn::redact;
use crate::sink::format::MessageOptions;
use crate::sink::DeclareMode;
use crate::sink::SinkError;
use rdkafka::config::ClientConfig;
use std::path::PathBuf;
use std::time::Duration;

/// Default `--kafka-dead-topic`.
pub(crate) const DEFAULT_DEAD_TOPIC: &str = "outbox.dead";
/// Default `--kafka-max-message-bytes`: Kafka's default `message.max.bytes` (1,048,588) less
/// room for the record batch around one record.
pub(crate) const DEFAULT_MAX_MESSAGE_BYTES: usize = 1_000_000;
/// Default `--kafka-linger` (librdkafka's `linger.ms`): how long the producer waits for more
/// records to fill a batch.
pub(crate) const DEFAULT_LINGER: Duration = Duration::from_millis(5);
/// Default `--kafka-scan-limit`.
pub(crate) const DEFAULT_SCAN_LIMIT: i64 = 100_000;
/// Kafka's limit on a topic name.
pub(crate) const MAX_TOPIC_BYTES: usize = 249;

/// The Kafka settings of `run` (the URL is the sink; `--declare`, `--format`, `--header`, the
/// topic template (`--routing-key`) and the TLS files are shared with the other sinks).
#[derive(Debug, Clone)]
pub struct KafkaOptions {
    /// Where records that cannot be published go (body-less, with the reason).
    pub dead_topic: String,
    /// Most records read back from the end of a partition to find what the relay already
    /// wrote there (`--kafka-scan-limit`).
    pub scan_limit: i64,
    /// Partitions of a topic the relay creates (`--declare auto`).
    pub partitions: i32,
    /// Replication factor of a topic the relay creates.
    pub replication: i32,
    pub max_message_bytes: usize,
    pub linger: Duration,
    /// `--kafka-tombstones`: an event whose payload is NULL or blank becomes a tombstone (a
    /// record without a value) instead of a dead record (Debezium's
    /// `route.tombstone.on.empty.payload`).
    pub tombstones: bool,
    /// `--kafka-partition-column`: the record's partition is this column's value (Debezium's
    /// `col:partition` placement) instead of the key's.
    pub partition_column: Option<String>,
}

impl Default for KafkaOptions {
    fn default() -> Self {
        KafkaOptions {
            dead_topic: DEFAULT_DEAD_TOPIC.into(),
            scan_limit: DEFAULT_SCAN_LIMIT,
            partitions: 1,
            replication: 1,
            max_message_bytes: DEFAULT_MAX_MESSAGE_BYTES,
            linger: DEFAULT_LINGER,
            tombstones: false,
            partition_column: None,
        }
    }
}

/// Everything the sink needs, validated by [`KafkaConfig::validate`].
#[derive(Clone)]
pub struct KafkaConfig {
    /// `kafka://` or `kafkas://` URL, credentials included: never log it unredacted.
    pub url: String,
    /// The relay's `--name`: every record carries it (`x-outbox-relay`), so that the relay
    /// recognises its own records when it reads a partition's tail back.
    pub name: String,
    pub options: KafkaOptions,
    /// The topic template is `message.routing_key`.
    pub message: MessageOptions,
    pub declare: DeclareMode,
    /// Bounds connecting, declaring, a delivery and a commit.
    pub op_timeout: Duration,
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl std::fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("url", &redact(&self.url))
            .field("name", &self.name)
            .field("options", &self.options)
            .field("topic", &self.message.routing_key.to_string())
            .field("declare", &self.declare)
            .field("op_timeout", &self.op_timeout)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("key_file", &self.key_file)
            .finish()
    }
}

/// The brokers and credentials of `--sink`.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Endpoint {
    /// `host:port,host:port`, as librdkafka's `bootstrap.servers`.
    pub brokers: String,
    pub tls: bool,
    pub user: Option<String>,
    pub password: Option<String>,
    /// `PLAIN`, `SCRAM-SHA-256` or `SCRAM-SHA-512` (with a user).
    pub mechanism: String,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("brokers", &self.brokers)
            .field("tls", &self.tls)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "<redacted>"))
            .field("mechanism", &self.mechanism)
            .finish()
    }
}

fn config_err(problem: impl Into<String>, fix: impl Into<String>) -> crate::Error {
    crate::Error::config(problem, fix)
}

const URL_FIX: &str = "use kafka://host:9092[,host:9092…] (kafkas:// for TLS; user:password@ for SASL, ?sasl=PLAIN|SCRAM-SHA-256|SCRAM-SHA-512)";

/// Splits `kafka://[user[:password]@]host:port[,host:port…][?sasl=MECHANISM]` (`kafkas://`
/// for TLS). Several brokers are not a URL `url` can parse, so the parts are split by hand.
pub(crate) fn endpoint(url: &str) -> Result<Endpoint, crate::Error> {
    let shown = redact(url);
    let s = url.trim();
    let (tls, rest) = if let Some(r) = s.strip_prefix("kafka://") {
        (false, r)
    } else if let Some(r) = s.strip_prefix("kafkas://") {
        (true, r)
    } else {
        return Err(config_err(format!("{shown} is not a Kafka sink"), URL_FIX));
    };
    let (rest, query) = rest.split_once('?').unwrap_or((rest, ""));
    let rest = rest.trim_end_matches('/');
    let (auth, hosts) = match rest.rsplit_once('@') {
        Some((a, h)) => (Some(a), h),
        None => (None, rest),
    };
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let mut brokers = Vec::new();
    for h in hosts.split(',') {
        let h = h.trim();
        let (host, port) = match h.rsplit_once(':') {
            Some((host, port)) if !host.is_empty() => (host, port),
            _ => (h, "9092"),
        };
        let port: u16 = port.parse().map_err(|_| {
            config_err(
                format!("the Kafka sink {shown}: {h:?} is not host:port"),
                URL_FIX,
            )
        })?;
        if host.is_empty() || host.contains(['/', '@', ' ']) {
            return Err(config_err(
                format!("the Kafka sink {shown} names no usable host in {h:?}"),
                URL_FIX,
            ));
        }
        brokers.push(format!("{host}:{port}"));
    }
    let mut mechanism = "SCRAM-SHA-512".to_string();
    for (k, v) in url::form_urlencoded::parse(query.as_bytes()) {
        match k.as_ref() {
            "sasl" => {
                let m = v.to_ascii_uppercase();
                if !["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"].contains(&m.as_str()) {
                    return Err(config_err(
                        format!("the Kafka sink {shown}: SASL mechanism {v:?} is not supported"),
                        "use ?sasl=PLAIN, ?sasl=SCRAM-SHA-256 or ?sasl=SCRAM-SHA-512",
                    ));
                }
                mechanism = m;
            }
            other => {
                return Err(config_err(
                    format!("unknown option {other:?} in the Kafka sink {shown}"),
                    "a Kafka sink takes ?sasl=MECHANISM; TLS files are --sink-ca, --sink-cert and --sink-key",
                ))
            }
        }
    }
    let (user, password) = match auth {
        None => (None, None),
        Some(a) => match a.split_once(':') {
            Some((u, p)) => (Some(decode(u)), Some(decode(p))),
            None => (Some(decode(a)), None),
        },
    };
    if user.as_deref() == Some("") {
        return Err(config_err(
            format!("the Kafka sink {shown} has an empty user name"),
            URL_FIX,
        ));
    }
    Ok(Endpoint {
        brokers: brokers.join(","),
        tls,
        user,
        password,
        mechanism,
    })
}

/// Whether `name` can be a Kafka topic: 1 to 249 of `[A-Za-z0-9._-]`, not `.` or `..`.
pub(crate) fn valid_topic(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_TOPIC_BYTES {
        return Err(format!(
            "topic {name:?} is {} bytes: a Kafka topic has 1 to {MAX_TOPIC_BYTES}",
            name.len()
        ));
    }
    if name == "." || name == ".." {
        return Err(format!("{name:?} cannot be a Kafka topic"));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "topic {name:?} contains {c:?}: a Kafka topic is made of [A-Za-z0-9._-]"
        ));
    }
    Ok(())
}

impl KafkaConfig {
    /// Checks the address, the secret files, the owned topics' names and the numbers.
    pub fn validate(&self) -> Result<(), crate::Error> {
        let ep = endpoint(&self.url)?;
        if ep.user.is_some() && ep.password.is_none() {
            return Err(config_err(
                format!("the Kafka sink {} names a SASL user but no password", redact(&self.url)),
                "put the password in OUTBOXD_SINK (kafka://user:password@host:9092) or in the file --sink-file names (its first line)",
            ));
        }
        if let Some(path) = &self.key_file {
            crate::secret_file::read(path)
                .map_err(|e| config_err(format!("TLS private key (--sink-key): {e}"), e.fix()))?;
        }
        if self.cert_file.is_some() != self.key_file.is_some() {
            return Err(config_err(
                "--sink-cert and --sink-key go together",
                "give both (a client certificate and its key) or neither",
            ));
        }
        valid_topic(&self.options.dead_topic).map_err(|e| {
            config_err(
                format!("--kafka-dead-topic: {e}"),
                "use letters, digits, '.', '_' and '-', e.g. outbox.dead",
            )
        })?;
        if self.options.scan_limit < 1 {
            return Err(config_err(
                "--kafka-scan-limit must be at least 1",
                "use --kafka-scan-limit 100000 (the default)",
            ));
        }
        if self.options.partitions < 1 || self.options.replication < 1 {
            return Err(config_err(
                format!(
                    "--kafka-partitions {} / --kafka-replication {}: both must be at least 1",
                    self.options.partitions, self.options.replication
                ),
                "use e.g. --kafka-partitions 6 --kafka-replication 3",
            ));
        }
        if self.options.max_message_bytes < 1024 {
            return Err(config_err(
                format!(
                    "--kafka-max-message-bytes {} leaves no room for a record",
                    self.options.max_message_bytes
                ),
                "use at least 1KiB; the broker's default limit is 1000000",
            ));
        }
        Ok(())
    }

    /// librdkafka's settings shared by the producer, the admin client and the positions
    /// reader: brokers, TLS, SASL. The result holds the password: never log it.
    pub fn client(&self) -> Result<ClientConfig, SinkError> {
        let ep = endpoint(&self.url).map_err(config_sink_err)?;
        let mut c = ClientConfig::new();
        c.set("bootstrap.servers", &ep.brokers);
        c.set("client.id", format!("outboxd-{}", self.name));
        let protocol = match (ep.tls, ep.user.is_some()) {
            (false, false) => "plaintext",
            (true, false) => "ssl",
            (false, true) => "sasl_plaintext",
            (true, true) => "sasl_ssl",
        };
        c.set("security.protocol", protocol);
        if let Some(user) = &ep.user {
            c.set("sasl.mechanism", &ep.mechanism);
            c.set("sasl.username", user);
            c.set("sasl.password", ep.password.as_deref().unwrap_or(""));
        }
        if let Some(ca) = &self.ca_file {
            c.set("ssl.ca.location", ca.to_string_lossy());
        }
        if let Some(cert) = &self.cert_file {
            c.set("ssl.certificate.location", cert.to_string_lossy());
        }
        if let Some(key) = &self.key_file {
            // Read through the secret-file check (owner, mode) and handed over in memory.
            let pem = crate::secret_file::read_string(key)
                .map_err(|e| config_sink_err(e.into_config()))?;
            c.set("ssl.key.pem", pem.as_str());
        }
        let ms = self.op_timeout.as_millis().clamp(1000, 300_000).to_string();
        c.set("socket.timeout.ms", &ms);
        Ok(c)
    }
}

fn config_sink_err(e: crate::Error) -> SinkError {
    match e {
        crate::Error::Config { problem, fix } => SinkError::Config { problem, fix },
        other => SinkError::Config {
            problem: other.to_string(),
            fix: "check --sink and the TLS files".into(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_split_brokers_and_credentials_and_never_show_them() {
        let e = endpoint("kafka://app:s%40cret@k1:9093,k2:9094?sasl=scram-sha-256").unwrap();
        assert_eq!(e.brokers, "k1:9093,k2:9094");
        assert_eq!(e.user.as_deref(), Some("app"));
        assert_eq!(e.password.as_deref(), Some("s@cret"));
        assert_eq!(e.mechanism, "SCRAM-SHA-256");
        assert!(!e.tls);
        assert!(!format!("{e:?}").contains("cret"));
        let t = endpoint("kafkas://k1").unwrap();
        assert!(t.tls);
        assert_eq!(t.brokers, "k1:9092");
        assert_eq!(t.user, None);
        for bad in [
            "amqp://h",
            "kafka://h:x",
            "kafka://h?bogus=1",
            "kafka://u:p@h?sasl=GSSAPI",
            "kafka://:p@h",
            "kafka://,",
        ] {
            assert!(endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn topic_names() {
        assert!(valid_topic("outbox.event.Order").is_ok());
        assert!(valid_topic("a-b_c.9").is_ok());
        for bad in ["", ".", "..", "a b", "a/b", "ä", &"x".repeat(250)] {
            assert!(valid_topic(bad).is_err(), "{bad}");
        }
    }

    fn cfg(url: &str) -> KafkaConfig {
        KafkaConfig {
            url: url.into(),
            name: "r1".into(),
            options: KafkaOptions::default(),
            message: MessageOptions::default(),
            declare: DeclareMode::Auto,
            op_timeout: Duration::from_secs(30),
            ca_file: None,
            cert_file: None,
            key_file: None,
        }
    }

    #[test]
    fn sasl_and_tls_reach_librdkafka_and_debug_hides_the_password() {
        let mut c = cfg("kafkas://app:hunter2@k1:9093?sasl=PLAIN");
        c.ca_file = Some("/etc/ca.pem".into());
        c.validate().unwrap();
        let rd = c.client().unwrap();
        assert_eq!(rd.get("security.protocol"), Some("sasl_ssl"));
        assert_eq!(rd.get("sasl.mechanism"), Some("PLAIN"));
        assert_eq!(rd.get("sasl.username"), Some("app"));
        assert_eq!(rd.get("sasl.password"), Some("hunter2"));
        assert_eq!(rd.get("ssl.ca.location"), Some("/etc/ca.pem"));
        assert!(!format!("{c:?}").contains("hunter2"));
        let plain = cfg("kafka://k1:9092").client().unwrap();
        assert_eq!(plain.get("security.protocol"), Some("plaintext"));
        assert_eq!(plain.get("sasl.username"), None);
        let e = cfg("kafka://app@k1").validate().unwrap_err().to_string();
        assert!(e.contains("no password"), "{e}");
    }
}
