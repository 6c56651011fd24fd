//! The command line (docs/configuration.md): every flag also read from `OUTBOXD_<FLAG>`, secrets taken
//! from the environment or a file and never echoed, and one function per command.

use crate::connector::{self, RunConfig};
use crate::dsn::{self, SinkDsn, SourceDsn};
use crate::outbox::{ColumnMap, Mode, TableName};
use crate::relay::RelayOptions;
use crate::sink::rabbitmq::{self, DeclareMode};
use crate::source::postgres::{self as pg, admin};
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Parser, Subcommand, ValueEnum};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub mod config_file;
pub mod consumer;
pub mod crypto;
pub mod topology;
mod values;

/// `outboxd --version`: the crate version and the git commit it was built from (`build.rs`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("OUTBOXD_COMMIT"),
    ")"
);

/// The `run` flags for partitions (flattened into the RabbitMQ sink's flags).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PartitionArgs {
    /// Partition queues <exchange>.p0 … p<N-1>: every event of one aggregate goes to one of
    /// them, in commit order (0 = off). The partition is Kafka's murmur2 of the aggregate id,
    /// sent as header x-partition.
    #[arg(long, env = "OUTBOXD_PARTITIONS", default_value_t = 0)]
    pub partitions: u32,
    /// Also send x-partition-<N> for each of these partition counts (comma separated), for
    /// consumer groups declared with `outboxd topology --group NAME --partitions N`.
    #[arg(long, env = "OUTBOXD_GROUP_PARTITIONS", value_delimiter = ',')]
    pub group_partitions: Vec<u32>,
    /// x-queue-type of the partition queues this relay declares.
    #[arg(long, env = "OUTBOXD_QUEUE_TYPE", value_enum, default_value_t = crate::sink::partition::QueueType::Classic)]
    pub queue_type: crate::sink::partition::QueueType,
    /// headers: the relay computes the partition; consistent-hash: RabbitMQ's plugin places
    /// aggregates (its ring can move keys when the broker restarts).
    #[arg(long, env = "OUTBOXD_PARTITION_ROUTING", value_enum, default_value_t = crate::sink::partition::PartitionRouting::Headers)]
    pub partition_routing: crate::sink::partition::PartitionRouting,
}

impl PartitionArgs {
    /// The settings as given, for the sink's validation.
    pub fn spec(&self) -> crate::sink::partition::PartitionSpec {
        crate::sink::partition::PartitionSpec {
            partitions: self.partitions,
            group_partitions: self.group_partitions.clone(),
            queue_type: self.queue_type,
            partition_routing: self.partition_routing,
        }
    }

    /// The validated partitioning (`PartitionSpec::validate`).
    pub fn validate(&self) -> Result<crate::sink::partition::Partitioning, Error> {
        self.spec().validate()
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "outboxd",
    version = VERSION,
    about = "Transactional outbox relay: database log → RabbitMQ, at least once, in commit order"
)]
pub struct Cli {
    /// Log level filter (error, warn, info, debug, trace, or a tracing directive).
    #[arg(long, global = true, env = "OUTBOXD_LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    /// Log line format.
    #[arg(long, global = true, env = "OUTBOXD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// TOML file of flags (keys are the long flags with `_` for `-`, e.g. `source_file`);
    /// flags and the environment override it; secrets only by reference (`*_file`, env).
    #[arg(long, global = true, env = "OUTBOXD_CONFIG", value_name = "PATH")]
    pub config: Option<std::path::PathBuf>,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

// Parsed once per process: the size difference between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Relay outbox events from the source to the sink until SIGINT/SIGTERM.
    Run(RunArgs),
    /// Idempotently create what the relay needs: state table, publication and slot.
    Setup(SetupArgs),
    /// Drop the relay's slot, publication and state (an abandoned slot fills the disk).
    Teardown(TeardownArgs),
    /// Preflight: one line per check, each failure with its fix; exit 0 when ready, 1 otherwise.
    Check(CheckArgs),
    /// Stored position, server head, lag, slot state and lease holder.
    Status(StatusArgs),
    /// Read or deliberately move the stored position.
    #[command(subcommand)]
    Offset(OffsetCommand),
    /// Probe a running relay's /readyz (or /healthz): exit 0 when it answers 200, 1 otherwise
    /// (a container healthcheck that needs no curl or wget in the image).
    Health(HealthArgs),
    /// Declare a consumer group's partition queues (or the relay's own), idempotently.
    Topology(topology::TopologyArgs),
    /// Field-level encryption keys: generate, rotate, list, retire, blind-index.
    #[command(subcommand)]
    Keys(crate::commands::crypto::KeysCommand),
    /// Encrypt the schema's x-gdpr-sensitive fields of the JSON payload on stdin.
    Encrypt(crate::commands::crypto::EncryptArgs),
    /// Decrypt every encrypted field of the JSON payload on stdin.
    Decrypt(crate::commands::crypto::DecryptArgs),
    /// Rewrite outbox rows under the current key, in small batches (resumable).
    Reencrypt(crate::commands::crypto::ReencryptArgs),
    /// Delete old processed_messages or outbox rows in small batches.
    Prune(crate::commands::consumer::PruneArgs),
    /// Print the effective configuration of `run` (flags, environment, --config file and
    /// defaults, each value's origin), secrets redacted; takes the same flags as `run`.
    Config(RunArgs),
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    #[command(flatten)]
    pub sink: topology::SinkCheckArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Print the checks as JSON lines.
    #[arg(long, env = "OUTBOXD_JSON")]
    pub json: bool,
    /// Check for poll mode (MySQL/MariaDB: the status column, its index and the grants
    /// instead of the binlog).
    #[arg(long, env = "OUTBOXD_MODE", value_enum, default_value_t = Mode::Cdc)]
    pub mode: Mode,
}

#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Print one JSON object (for scripts).
    #[arg(long, env = "OUTBOXD_JSON")]
    pub json: bool,
}

#[derive(Debug, Clone, Subcommand)]
pub enum OffsetCommand {
    /// Show the stored position and the slot's.
    Show(StatusArgs),
    /// Move the position: forward to an LSN (skips events), or replay rows from the table.
    Set(OffsetSetArgs),
}

#[derive(Debug, Clone, Args)]
pub struct OffsetSetArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Skip forward to this LSN (e.g. 0/16B3748). Slots cannot move backwards.
    #[arg(
        long,
        conflicts_with_all = ["replay_since", "binlog_position"],
        required_unless_present_any = ["replay_since", "binlog_position"]
    )]
    pub lsn: Option<String>,
    /// On the next start, publish again every row created since this RFC 3339 time, then stream.
    #[arg(long, conflicts_with = "binlog_position")]
    pub replay_since: Option<String>,
    /// MySQL/MariaDB: resume from this binlog position, FILE:POS — a transaction boundary, such
    /// as the end position in an event's x-source-position. Earlier replays, later skips.
    #[arg(long)]
    pub binlog_position: Option<String>,
    /// MySQL/MariaDB: store the position in this offset file (as `run --offset-file`) instead
    /// of the outboxd_state table.
    #[arg(long, value_name = "PATH", requires = "binlog_position")]
    pub offset_file: Option<std::path::PathBuf>,
}

/// Where the source is. The DSN may carry a password; prefer `--source-file` or the
/// environment, which are never echoed.
#[derive(Debug, Clone, Args)]
pub struct SourceArgs {
    /// Source DSN: postgres://user@host:5432/db?sslmode=…, mysql://…, file:///path/binlog.000001
    #[arg(long, env = "OUTBOXD_SOURCE", hide_env_values = true)]
    pub source: Option<crate::dsn::DsnArg>,
    /// File holding the source DSN, or only its password (the file's first line).
    #[arg(long, env = "OUTBOXD_SOURCE_FILE")]
    pub source_file: Option<std::path::PathBuf>,
    /// Outbox table (`schema.table` on Postgres, `db.table` for binlog files); repeat it (or
    /// separate with commas) to relay several tables through one slot / binlog stream.
    #[arg(
        long = "table",
        env = "OUTBOXD_TABLE",
        value_delimiter = ',',
        default_value = "outbox"
    )]
    pub tables: Vec<String>,
    /// Relay name: names its state, lease and slot ([a-z0-9_], at most 40 characters).
    #[arg(long, env = "OUTBOXD_NAME", default_value = "outboxd")]
    pub name: String,
    /// Replication slot (default outboxd_<name>).
    #[arg(long, env = "OUTBOXD_SLOT")]
    pub slot: Option<String>,
    /// Publication (default outboxd_<name>).
    #[arg(long, env = "OUTBOXD_PUBLICATION")]
    pub publication: Option<String>,
    /// Column renames: logical=actual, comma separated (or the preset `debezium`).
    #[arg(long = "column", env = "OUTBOXD_COLUMN", value_delimiter = ';')]
    pub columns: Vec<String>,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Sink: stdout, amqp://user@host:5672/vhost (amqps:// for TLS), or NATS JetStream
    /// nats://host:4222 (tls:// for TLS).
    #[arg(
        long,
        env = "OUTBOXD_SINK",
        hide_env_values = true,
        default_value = "stdout"
    )]
    pub sink: crate::dsn::DsnArg,
    /// File holding the sink URL, or only its password.
    #[arg(long, env = "OUTBOXD_SINK_FILE")]
    pub sink_file: Option<std::path::PathBuf>,
    /// cdc (read the database log) or poll (query the table).
    #[arg(long, env = "OUTBOXD_MODE", value_enum, default_value_t = Mode::Cdc)]
    pub mode: Mode,
    /// With the stdout sink: store the position (otherwise trying stdout never moves it).
    #[arg(long, env = "OUTBOXD_COMMIT_OFFSETS")]
    pub commit_offsets: bool,
    /// Most bytes of events between source read and sink confirmation.
    #[arg(long, env = "OUTBOXD_MAX_INFLIGHT_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub max_inflight_bytes: usize,
    /// Most events published and not yet confirmed.
    #[arg(long, env = "OUTBOXD_WINDOW", default_value_t = crate::relay::DEFAULT_WINDOW)]
    pub window: usize,
    /// A broker confirmation that takes longer is a failure (reconnect, republish).
    #[arg(long, env = "OUTBOXD_CONFIRM_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub confirm_timeout: Duration,
    /// When the log position cannot be resumed (slot dropped or invalidated): fail (exit 3) or
    /// poll (open a fresh position and publish again from the table every row committed after
    /// the last confirmed event).
    #[arg(long, env = "OUTBOXD_ON_POSITION_LOST", value_enum, default_value_t = connector::PositionLostPolicy::Fail)]
    pub on_position_lost: connector::PositionLostPolicy,
    /// Recovery through the table: replay rows created since this RFC 3339 time instead of the
    /// computed one.
    #[arg(long, env = "OUTBOXD_REPLAY_SINCE")]
    pub replay_since: Option<String>,
    /// Recovery through the table: the smallest margin subtracted from the last confirmed
    /// commit time (the largest commit-vs-created_at gap seen is used when larger).
    #[arg(long, env = "OUTBOXD_RECOVERY_MARGIN", value_parser = parse_duration, default_value = "10m")]
    pub recovery_margin: Duration,
    /// High availability: relays with the same --name share one lease; the others wait as
    /// standbys and take over when it expires.
    #[arg(long, env = "OUTBOXD_HA")]
    pub ha: bool,
    /// Serve /metrics, /healthz and /readyz on HOST:PORT (default off).
    #[arg(long, env = "OUTBOXD_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Poll mode: how long to wait before polling again after a batch that was not full.
    #[arg(long, env = "OUTBOXD_POLL_INTERVAL", value_parser = parse_duration, default_value = "200ms")]
    pub poll_interval: Duration,
    /// Poll mode: most rows claimed per batch (one short transaction each).
    #[arg(long, env = "OUTBOXD_POLL_BATCH", default_value_t = 500)]
    pub poll_batch: i64,
    /// Poll mode on Postgres: LISTEN for the trigger `setup --notify` installs and poll at once
    /// when rows are committed.
    #[arg(long, env = "OUTBOXD_NOTIFY")]
    pub notify: bool,
    /// First start: which rows already in the table to publish (auto, all, never,
    /// since=RFC3339). With `auto`, a status column selects pending rows; without one, a
    /// non-empty table needs a choice.
    #[arg(long, env = "OUTBOXD_SNAPSHOT", default_value = "auto")]
    pub snapshot: String,
    /// Bound on the graceful stop after SIGINT/SIGTERM.
    #[arg(long, env = "OUTBOXD_SHUTDOWN_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub shutdown_timeout: Duration,
    #[command(flatten)]
    pub rabbit: RabbitArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub mysql: MySqlArgs,
}

/// NATS JetStream sink settings (docs/nats.md).
#[derive(Debug, Clone, Args)]
pub struct NatsArgs {
    /// NATS sink: subject template over the event ({topic}, {aggregate_id}, {id}, {table});
    /// its first token is the prefix (<prefix>.dead for poison records, <prefix>.> in the stream).
    #[arg(long, env = "OUTBOXD_SUBJECT", default_value = crate::sink::nats::config::DEFAULT_SUBJECT)]
    pub subject: String,
    /// NATS sink: the JetStream stream (declared with --declare auto, checked with passive).
    #[arg(long, env = "OUTBOXD_STREAM", default_value = crate::sink::nats::config::DEFAULT_STREAM)]
    pub stream: String,
}

impl NatsArgs {
    pub fn options(&self) -> Result<connector::NatsOptions, Error> {
        let subject = crate::sink::template::Template::parse(&self.subject).map_err(|e| {
            Error::config(format!("--subject: {e}"), "e.g. --subject outbox.{topic}")
        })?;
        Ok(connector::NatsOptions {
            subject,
            stream: self.stream.clone(),
        })
    }
}

/// RabbitMQ sink settings (docs/message-format.md).
#[derive(Debug, Clone, Args)]
pub struct RabbitArgs {
    /// Topic exchange events are published to (also names <exchange>.unrouted and <exchange>.dead);
    /// a template over the row's columns (e.g. `{aggregate_type}.events`) routes each row to its
    /// own exchange, declared under --declare auto (dead records then go to <base-exchange>.dead).
    #[arg(long, env = "OUTBOXD_EXCHANGE", default_value = "outbox")]
    pub exchange: String,
    /// With a templated --exchange: the exchange whose .dead queue takes records that cannot be
    /// published (and whose topology the relay declares at start).
    #[arg(long, env = "OUTBOXD_BASE_EXCHANGE", default_value = "outbox")]
    pub base_exchange: String,
    /// Routing key template over the row's columns (default `{topic}`; with --column debezium
    /// `outbox.event.{aggregate_type}`), e.g. `{tenant_id}.{topic}`.
    #[arg(long, env = "OUTBOXD_ROUTING_KEY")]
    pub routing_key: Option<String>,
    /// Copy a column's value into a message header: COLUMN=NAME (repeat it, or comma
    /// separate), e.g. traceparent=traceparent. A NULL value sets no header.
    #[arg(long = "header", env = "OUTBOXD_HEADER", value_delimiter = ',')]
    pub headers: Vec<String>,
    /// Message body: raw (the payload), envelope (JSON with id, aggregate, topic, payload,
    /// created_at, position), cloudevents (structured, application/cloudevents+json) or
    /// cloudevents-binary (the payload, with cloudEvents:* headers).
    #[arg(long, env = "OUTBOXD_FORMAT", value_enum, default_value_t = crate::sink::format::BodyFormat::Raw)]
    pub format: crate::sink::format::BodyFormat,
    /// CloudEvents `source` attribute (a template, e.g. `/orders/{aggregate_type}`).
    #[arg(long, env = "OUTBOXD_CLOUDEVENTS_SOURCE", default_value = "/outboxd")]
    pub cloudevents_source: String,
    /// Content type of payloads in text or binary columns (bytea, BLOB, TEXT): they are then
    /// published as bytes instead of being checked as JSON (a `content_type` column mapped
    /// with --column content_type=<column> overrides it per row).
    #[arg(long, env = "OUTBOXD_PAYLOAD_CONTENT_TYPE")]
    pub payload_content_type: Option<String>,
    /// auto: declare the topology; passive: only check it exists; off: check nothing.
    #[arg(long, env = "OUTBOXD_DECLARE", value_enum, default_value_t = DeclareMode::Auto)]
    pub declare: DeclareMode,
    /// Larger payloads go to <exchange>.dead as a record without the body (e.g. 16MiB, 512KiB, 4096).
    #[arg(long, env = "OUTBOXD_MAX_MESSAGE_BYTES", value_parser = parse_bytes, default_value = "16MiB")]
    pub max_message_bytes: usize,
    /// PEM CA certificate for an amqps:// sink: replaces the public roots (pins a private CA).
    #[arg(long, env = "OUTBOXD_SINK_CA")]
    pub sink_ca: Option<std::path::PathBuf>,
    /// PEM client certificate for an amqps:// sink (needs --sink-key).
    #[arg(long, env = "OUTBOXD_SINK_CERT")]
    pub sink_cert: Option<std::path::PathBuf>,
    /// PEM private key of --sink-cert.
    #[arg(long, env = "OUTBOXD_SINK_KEY")]
    pub sink_key: Option<std::path::PathBuf>,
    #[command(flatten)]
    pub partitions: PartitionArgs,
    /// Queue type of <exchange>.unrouted and <exchange>.dead as --declare auto declares them
    /// (quorum: replicated across a cluster).
    #[arg(long, env = "OUTBOXD_DEAD_QUEUE_TYPE", value_enum, default_value_t = crate::sink::partition::QueueType::Classic)]
    pub dead_queue_type: crate::sink::partition::QueueType,
}

/// MySQL/MariaDB source settings.
#[derive(Debug, Clone, Args)]
pub struct MySqlArgs {
    /// Zone of the outbox's DATETIME values (UTC, +02:00, Europe/Berlin); TIMESTAMP needs none.
    #[arg(long, env = "OUTBOXD_SOURCE_TIME_ZONE", default_value = "UTC")]
    pub source_time_zone: String,
    /// Largest transaction (bytes of outbox rows) held until its commit; a larger one is read
    /// twice (once to find its end position, once to stream it).
    #[arg(long, env = "OUTBOXD_TXN_BUFFER", default_value_t = 16 * 1024 * 1024)]
    pub txn_buffer: usize,
    /// Largest uncompressed size a MySQL 8 compressed transaction (TRANSACTION_PAYLOAD) may
    /// declare; a larger one stops the relay (e.g. 256MiB, 1GiB).
    #[arg(long, env = "OUTBOXD_MAX_TXN_PAYLOAD_BYTES", value_parser = parse_bytes, default_value = "256MiB")]
    pub max_txn_payload_bytes: usize,
    /// Keep the position (and the lease, as a lock on PATH.lock) in this file instead of the
    /// outboxd_state table.
    #[arg(long, env = "OUTBOXD_OFFSET_FILE", value_name = "PATH")]
    pub offset_file: Option<std::path::PathBuf>,
}

#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Also create the outbox table (the columns of migrations/*/001_outbox.sql) when it does not exist.
    #[arg(long, env = "OUTBOXD_CREATE_TABLE")]
    pub create_table: bool,
    /// Install the trigger that wakes poll-mode relays (`run --mode poll --notify`).
    #[arg(long, env = "OUTBOXD_NOTIFY")]
    pub notify: bool,
    /// Poll mode only: create the table (and trigger) but no slot or publication.
    #[arg(long, env = "OUTBOXD_MODE", value_enum, default_value_t = Mode::Cdc)]
    pub mode: Mode,
}

#[derive(Debug, Clone, Args)]
pub struct HealthArgs {
    /// The relay's --metrics-addr (HOST:PORT).
    #[arg(long, env = "OUTBOXD_METRICS_ADDR", default_value = "127.0.0.1:9187")]
    pub addr: String,
    /// Which endpoint: /readyz (streaming and broker connected) or /healthz (process serves).
    #[arg(long, default_value = "/readyz")]
    pub path: String,
}

#[derive(Debug, Clone, Args)]
pub struct TeardownArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Confirm: the slot, publication and stored position are dropped.
    #[arg(long)]
    pub yes: bool,
}

/// The message options of `run` (templates parsed, header names checked) and the column map
/// extended by the columns they read.
pub fn message_options(
    args: &RabbitArgs,
    mut columns: ColumnMap,
) -> Result<(crate::sink::format::MessageOptions, ColumnMap), Error> {
    use crate::sink::format::{self, BodyFormat, MessageOptions};
    use crate::sink::template::Template;
    let template = |flag: &str, text: &str| {
        Template::parse(text).map_err(|e| {
            Error::config(
                format!("{flag}: {e}"),
                "write placeholders as {column}, e.g. {topic} or {aggregate_type}.{topic} ({{ and }} for literal braces)",
            )
        })
    };
    let routing_key = match &args.routing_key {
        Some(t) => template("--routing-key", t)?,
        None if columns.is_debezium() => {
            Template::parse("outbox.event.{aggregate_type}").expect("valid")
        }
        None => Template::parse("{topic}").expect("valid"),
    };
    let exchange = template("--exchange", &args.exchange)?;
    let mut headers = format::parse_column_headers(&args.headers)?;
    // Debezium's event router puts the event id in the header `id`.
    if columns.is_debezium() && !headers.iter().any(|h| h.name.eq_ignore_ascii_case("id")) {
        headers.push(format::ColumnHeader {
            column: "id".into(),
            name: "id".into(),
        });
    }
    let message = MessageOptions {
        routing_key,
        exchange: (!exchange.is_constant()).then_some(exchange),
        headers,
        format: args.format,
        ce_source: template("--cloudevents-source", &args.cloudevents_source)?,
    };
    for name in message.columns() {
        columns.require_extra(name, true);
    }
    if matches!(
        args.format,
        BodyFormat::Envelope | BodyFormat::Cloudevents | BodyFormat::CloudeventsBinary
    ) || columns.is_debezium()
    {
        // The envelope's aggregate.type, when the table has the column.
        columns.require_extra("aggregate_type", false);
    }
    if let Some(ct) = &args.payload_content_type {
        if ct.trim().is_empty() || ct.len() > 255 || ct.chars().any(|c| c.is_control()) {
            return Err(Error::config(
                format!("--payload-content-type {ct:?} is not a content type"),
                "write e.g. --payload-content-type text/plain or application/octet-stream",
            ));
        }
    }
    columns.set_payload_content_type(args.payload_content_type.as_deref().map(str::trim));
    Ok((message, columns))
}

/// `30s`, `500ms`, `2m`, `1h`, `7d`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 30s"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m, h, d)")),
    };
    // try_from: a value too large for a Duration (or one that overflows to infinity) is an
    // error, not a panic.
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{s:?} is out of range"))
}

/// `16MiB`, `512KiB`, `1GiB`, `10MB`, `4096` (bytes).
pub fn parse_bytes(s: &str) -> Result<usize, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: usize = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 16MiB or 4096"))?;
    let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1000,
        "kib" => 1 << 10,
        "m" | "mb" => 1_000_000,
        "mib" => 1 << 20,
        "g" | "gb" => 1_000_000_000,
        "gib" => 1 << 30,
        other => {
            return Err(format!(
                "{s:?}: unknown unit {other:?} (use B, KiB, MiB, GiB, kB, MB, GB)"
            ))
        }
    };
    n.checked_mul(mult)
        .filter(|&b| b > 0)
        .ok_or_else(|| format!("{s:?} is out of range"))
}

/// Checks `--name` (docs/configuration.md).
pub fn validate_name(name: &str) -> Result<(), Error> {
    if name.is_empty()
        || name.len() > 40
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(Error::config(
            format!("--name {name:?} is not valid"),
            "use 1 to 40 characters of [a-z0-9_], e.g. --name billing",
        ));
    }
    Ok(())
}

fn sink_url(sink: &SinkDsn) -> String {
    match sink {
        SinkDsn::Amqp(u) | SinkDsn::Nats(u) => u.clone(),
        SinkDsn::Stdout => String::new(),
    }
}

/// Checks `--slot` and `--publication`: the characters Postgres allows in a replication slot
/// name ([a-z0-9_]) and at most 63 of them (its identifier limit), so neither can carry SQL
/// nor be truncated by the server into another relay's name.
pub fn validate_pg_object(flag: &str, value: &str) -> Result<(), Error> {
    if value.is_empty()
        || value.len() > 63
        || !value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(Error::config(
            format!("{flag} {value:?} is not valid"),
            format!("use 1 to 63 characters of [a-z0-9_], e.g. {flag} outboxd_billing"),
        ));
    }
    Ok(())
}

/// The first line of a `--*-file`: opened once and checked as every secret file is
/// ([`crate::secret_file`]: owner, no group/other bits).
fn read_secret_file(path: &std::path::Path) -> Result<String, Error> {
    let text = crate::secret_file::read_string(path).map_err(|e| e.into_config())?;
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

/// The DSN from flag, environment or file; warns when a password came in argv.
pub(crate) fn resolve_dsn(
    value: Option<&str>,
    file: Option<&std::path::Path>,
    from_argv: bool,
    flag: &str,
) -> Result<Option<String>, Error> {
    let mut dsn = value.map(str::to_string);
    if let Some(path) = file {
        let secret = read_secret_file(path)?;
        if secret.contains("://") {
            dsn = Some(secret);
        } else {
            let base = dsn.ok_or_else(|| {
                Error::config(
                    format!("--{flag}-file holds a password but --{flag} is not given"),
                    format!(
                        "give --{flag} without the password, e.g. --{flag} postgres://user@host/db"
                    ),
                )
            })?;
            dsn = Some(dsn::with_password(&base, &secret)?);
        }
    } else if from_argv {
        if let Some(d) = &dsn {
            if url::Url::parse(d)
                .ok()
                .and_then(|u| u.password().map(|_| ()))
                .is_some()
            {
                tracing::warn!(
                    "the --{flag} DSN on the command line carries a password, which other users can read in the process list; \
                     use OUTBOXD_{} or --{flag}-file instead",
                    flag.to_uppercase()
                );
            }
        }
    }
    Ok(dsn)
}

struct Resolved {
    source: SourceDsn,
    name: String,
    slot: String,
    publication: String,
    tables: Vec<TableName>,
    columns: ColumnMap,
}

/// `--table`, repeated: each parsed, none twice.
fn parse_tables(specs: &[String]) -> Result<Vec<TableName>, Error> {
    let mut tables: Vec<TableName> = Vec::with_capacity(specs.len());
    for s in specs {
        let t = TableName::parse(s.trim())?;
        if tables.contains(&t) {
            return Err(Error::config(
                format!("--table {t} is given twice"),
                "name each outbox table once",
            ));
        }
        tables.push(t);
    }
    if tables.is_empty() {
        return Err(Error::config("no --table given", "pass --table outbox"));
    }
    Ok(tables)
}

fn resolve_source(args: &SourceArgs, m: &ArgMatches) -> Result<Resolved, Error> {
    validate_name(&args.name)?;
    let from_argv = m.value_source("source") == Some(ValueSource::CommandLine);
    let dsn = resolve_dsn(
        args.source.as_deref(),
        args.source_file.as_deref(),
        from_argv,
        "source",
    )?
    .ok_or_else(|| {
        Error::config(
            "no source given",
            "pass --source postgres://user@host:5432/db (or set OUTBOXD_SOURCE, or --source-file)",
        )
    })?;
    let source = SourceDsn::parse(&dsn)?;
    let slot = args
        .slot
        .clone()
        .unwrap_or_else(|| format!("outboxd_{}", args.name));
    let publication = args
        .publication
        .clone()
        .unwrap_or_else(|| format!("outboxd_{}", args.name));
    validate_pg_object("--slot", &slot)?;
    validate_pg_object("--publication", &publication)?;
    Ok(Resolved {
        source,
        name: args.name.clone(),
        slot,
        publication,
        tables: parse_tables(&args.tables)?,
        columns: ColumnMap::parse(&args.columns)?,
    })
}

/// Runs a parsed command. `matches` tells where each value came from (argv warnings).
pub async fn execute(
    cli: Cli,
    matches: &ArgMatches,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let sub = matches.subcommand().map(|(_, m)| m).unwrap_or(matches);
    match cli.command {
        Command::Run(args) => run(args, sub, shutdown).await,
        Command::Setup(args) => setup(args, sub).await,
        Command::Teardown(args) => teardown(args, sub).await,
        Command::Check(args) => check(args, sub).await,
        Command::Status(args) => status(args, sub).await,
        Command::Offset(cmd) => {
            let sub = sub.subcommand().map(|(_, m)| m).unwrap_or(sub);
            offset(cmd, sub).await
        }
        Command::Health(args) => crate::telemetry::probe(&args.addr, &args.path).await,
        Command::Topology(args) => topology::run(args, sub).await,
        Command::Keys(cmd) => crate::commands::crypto::keys(cmd, sub).await,
        Command::Encrypt(args) => crate::commands::crypto::encrypt(args, sub).await,
        Command::Decrypt(args) => crate::commands::crypto::decrypt(args, sub).await,
        Command::Reencrypt(args) => crate::commands::crypto::reencrypt(args, sub, shutdown).await,
        Command::Prune(args) => crate::commands::consumer::prune(args, sub, shutdown).await,
        Command::Config(_) => {
            use clap::CommandFactory;
            let root = Cli::command();
            let cmd = root
                .find_subcommand("config")
                .expect("the config subcommand exists");
            print!(
                "{}",
                crate::commands::config_file::render_effective(cmd, sub)
            );
            Ok(())
        }
    }
}

fn postgres_only(source: SourceDsn, command: &str) -> Result<crate::dsn::DbDsn, Error> {
    match source {
        SourceDsn::Postgres(d) => Ok(d),
        _ => Err(Error::config(
            format!("{command} supports Postgres sources in this build"),
            "use a postgres:// source",
        )),
    }
}

async fn check(args: CheckArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    let lines = if let SourceDsn::Mysql(dsn) = &r.source {
        let mut lines = Vec::new();
        for table in connector::mysql_tables(dsn, &r.tables, &r.columns, Default::default())? {
            let table_lines = crate::source::mysql::operator::check_mysql(
                dsn,
                &r.name,
                &table,
                args.mode == Mode::Poll,
            )
            .await;
            // The server-wide lines once; each further table adds its own.
            let seen: Vec<String> = lines
                .iter()
                .map(|l: &crate::operator::CheckLine| l.to_string())
                .collect();
            lines.extend(
                table_lines
                    .into_iter()
                    .filter(|l| !seen.contains(&l.to_string())),
            );
        }
        lines
    } else {
        let dsn = postgres_only(r.source, "check")?;
        crate::source::postgres::operator::check_postgres(
            &crate::source::postgres::operator::PgTarget {
                dsn: &dsn,
                name: &r.name,
                tables: &r.tables,
                columns: &r.columns,
                slot: &r.slot,
                publication: &r.publication,
            },
        )
        .await
    };
    let mut lines = lines;
    lines.extend(topology::check_rabbitmq(&args.sink, m).await);
    lines.extend(check_nats(&args, m).await);
    for l in &lines {
        if args.json {
            println!("{}", serde_json::to_string(l).unwrap_or_default());
        } else {
            println!("{l}");
        }
    }
    let failed = lines
        .iter()
        .filter(|l| l.level == crate::operator::Level::Fail)
        .count();
    if failed > 0 {
        return Err(Error::Other(format!(
            "{failed} check{} failed",
            if failed == 1 { "" } else { "s" }
        )));
    }
    Ok(())
}

/// `check` with a `nats://`/`tls://` sink: the connection and the stream's settings.
async fn check_nats(args: &CheckArgs, m: &ArgMatches) -> Vec<crate::operator::CheckLine> {
    use crate::operator::{CheckLine, Level};
    let fail = |detail: String| CheckLine {
        level: Level::Fail,
        check: "nats settings".into(),
        detail,
        fix: None,
    };
    let from_argv = m.value_source("sink") == Some(ValueSource::CommandLine);
    let url = match resolve_dsn(
        args.sink.sink.as_deref(),
        args.sink.sink_file.as_deref(),
        from_argv,
        "sink",
    ) {
        Ok(Some(u)) => u,
        Ok(None) => return Vec::new(),
        Err(e) => return vec![fail(e.to_string())],
    };
    let Ok(SinkDsn::Nats(url)) = SinkDsn::parse(&url) else {
        return Vec::new();
    };
    let opts = match args.nats.options() {
        Ok(o) => o,
        Err(e) => return vec![fail(e.to_string())],
    };
    let partitions = match args.sink.partitions.validate() {
        Ok(p) => p.partitions,
        Err(e) => return vec![fail(e.to_string())],
    };
    let cfg = crate::sink::nats::NatsConfig {
        url,
        subject: opts.subject,
        stream: opts.stream,
        declare: args.sink.declare,
        max_message_bytes: rabbitmq::DEFAULT_MAX_MESSAGE_BYTES,
        op_timeout: Duration::from_secs(15),
        window: 1,
        ca_file: args.sink.sink_ca.clone(),
        cert_file: args.sink.sink_cert.clone(),
        key_file: args.sink.sink_key.clone(),
        connection_name: "outboxd check".into(),
        partitions,
    };
    if let Err(e) = cfg.validate() {
        return vec![fail(e.to_string())];
    }
    crate::sink::nats::declare::check(&cfg).await
}

async fn status(args: StatusArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    if let SourceDsn::Mysql(dsn) = &r.source {
        let st = crate::source::mysql::operator::status_mysql(dsn, &r.name).await?;
        if args.json {
            println!("{}", serde_json::to_string(&st).unwrap_or_default());
        } else {
            println!("{st}");
        }
        return Ok(());
    }
    let dsn = postgres_only(r.source, "status")?;
    let st = crate::source::postgres::operator::status_postgres(&dsn, &r.name, &r.slot).await?;
    if args.json {
        println!("{}", serde_json::to_string(&st).unwrap_or_default());
    } else {
        println!("{st}");
    }
    Ok(())
}

async fn offset(cmd: OffsetCommand, m: &ArgMatches) -> Result<(), Error> {
    match cmd {
        OffsetCommand::Show(args) => status(args, m).await,
        OffsetCommand::Set(args) => {
            let r = resolve_source(&args.source, m)?;
            if let SourceDsn::Mysql(dsn) = &r.source {
                let Some(at) = args.binlog_position.as_deref() else {
                    return Err(Error::config(
                        "a MySQL source's position is a binlog position",
                        "use offset set --binlog-position FILE:POS",
                    ));
                };
                let stored = crate::source::mysql::operator::set_position(
                    dsn,
                    &r.name,
                    at,
                    args.offset_file.as_deref(),
                )
                .await?;
                println!("ok   the next start of {} resumes from {stored}", r.name);
                return Ok(());
            }
            if args.binlog_position.is_some() {
                return Err(Error::config(
                    "--binlog-position is for MySQL/MariaDB sources",
                    "use --lsn or --replay-since with a Postgres source",
                ));
            }
            let dsn = postgres_only(r.source, "offset set")?;
            if let Some(lsn) = args.lsn {
                let end =
                    crate::source::postgres::operator::advance_slot(&dsn, &r.name, &r.slot, &lsn)
                        .await?;
                println!("ok   slot {} moved to {end}", r.slot);
            } else if let Some(since) = args.replay_since {
                let since = chrono::DateTime::parse_from_rfc3339(since.trim())
                    .map_err(|e| {
                        Error::config(
                            format!("--replay-since {since}: {e}"),
                            "write e.g. 2026-06-22T10:00:00Z",
                        )
                    })?
                    .with_timezone(&chrono::Utc);
                let client = pg::connect_sql(&dsn, "outboxd_offset").await?;
                crate::state::postgres::request_replay(&client, &r.name, since).await?;
                println!(
                    "ok   the next start of {} publishes rows created since {} again, then streams",
                    r.name,
                    since.to_rfc3339()
                );
            }
            Ok(())
        }
    }
}

async fn run(args: RunArgs, m: &ArgMatches, shutdown: CancellationToken) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    crate::tls::warn_if_unverified_source(&r.source);
    if let Some(addr) = &args.metrics_addr {
        crate::telemetry::serve(addr).await?;
    }
    let sink_from_argv = m.value_source("sink") == Some(ValueSource::CommandLine);
    let sink = resolve_dsn(
        Some(&args.sink),
        args.sink_file.as_deref(),
        sink_from_argv,
        "sink",
    )?
    .unwrap_or_else(|| "stdout".into());
    let sink = SinkDsn::parse(&sink)?;
    if let Some(w) = crate::tls::plaintext_amqp_warning(&sink_url(&sink)) {
        tracing::warn!("{w}");
    }
    if args.window == 0 {
        return Err(Error::config(
            "--window 0 would never publish",
            "use --window 5000 (the default)",
        ));
    }
    let (message, columns) = message_options(&args.rabbit, r.columns.clone())?;
    let exchange = if message.exchange.is_some() {
        if args.rabbit.partitions.validate()?.partitions > 0 {
            return Err(Error::config(
                "--partitions needs one exchange to feed its partition layout; --exchange is a template",
                "use a constant --exchange with --partitions, or route by --routing-key instead",
            ));
        }
        args.rabbit.base_exchange.clone()
    } else {
        args.rabbit.exchange.clone()
    };
    rabbitmq::validate_exchange(&exchange)?;
    let cfg = RunConfig {
        nats: args.nats.options()?,
        rabbit: connector::RabbitOptions {
            message,
            exchange,
            declare: args.rabbit.declare,
            max_message_bytes: args.rabbit.max_message_bytes,
            ca_file: args.rabbit.sink_ca.clone(),
            cert_file: args.rabbit.sink_cert.clone(),
            key_file: args.rabbit.sink_key.clone(),
            partitioning: args.rabbit.partitions.validate()?,
            dead_queue_type: args.rabbit.dead_queue_type,
        },
        name: r.name,
        slot: r.slot,
        publication: r.publication,
        tables: r.tables,
        columns,
        sink,
        commit_offsets: args.commit_offsets,
        max_inflight_bytes: args.max_inflight_bytes,
        relay: RelayOptions {
            window: args.window,
            confirm_timeout: args.confirm_timeout,
            ..RelayOptions::default()
        },
        snapshot: crate::source::postgres::snapshot::SnapshotMode::parse(&args.snapshot)?,
        on_position_lost: args.on_position_lost,
        replay_since: match &args.replay_since {
            None => None,
            Some(t) => Some(
                chrono::DateTime::parse_from_rfc3339(t.trim())
                    .map_err(|e| {
                        Error::config(
                            format!("--replay-since {t}: {e}"),
                            "write e.g. 2026-06-22T10:00:00Z",
                        )
                    })?
                    .with_timezone(&chrono::Utc),
            ),
        },
        recovery_margin: args.recovery_margin,
        ha: args.ha,
        mysql: connector::MySqlOptions {
            time_zone: crate::source::mysql::rows::SourceTz::parse(&args.mysql.source_time_zone)?,
            txn_buffer_bytes: args.mysql.txn_buffer.max(1),
            max_payload_bytes: args.mysql.max_txn_payload_bytes as u64,
            offset_file: args.mysql.offset_file.clone(),
            ..Default::default()
        },
    };
    if matches!(r.source, SourceDsn::Postgres(_)) && args.mysql.offset_file.is_some() {
        return Err(Error::config(
            "--offset-file is for MySQL/MariaDB sources: a Postgres relay's position is its replication slot's confirmed_flush_lsn, which the server keeps",
            "remove --offset-file",
        ));
    }
    if args.mode == Mode::Poll && args.poll_batch < 1 {
        return Err(Error::config(
            "--poll-batch must be at least 1",
            "use --poll-batch 500",
        ));
    }
    let poll = crate::source::poll::PollOptions {
        batch: args.poll_batch,
        interval: args.poll_interval,
        notify: args.notify,
    };
    connector::check_sink(&cfg)?;
    let stats = match (r.source, args.mode) {
        (SourceDsn::Postgres(dsn), Mode::Cdc) => {
            connector::run_postgres(dsn, cfg, shutdown).await?
        }
        (SourceDsn::Postgres(dsn), Mode::Poll) => {
            connector::run_poll_postgres(dsn, cfg, poll, shutdown).await?
        }
        (SourceDsn::Mysql(dsn), Mode::Cdc) => connector::run_mysql(dsn, cfg, shutdown).await?,
        (SourceDsn::Mysql(dsn), Mode::Poll) => {
            connector::run_poll_mysql(dsn, cfg, poll, shutdown).await?
        }
        (SourceDsn::File(files), Mode::Cdc) => connector::run_file(files, cfg, shutdown).await?,
        (SourceDsn::File(_), Mode::Poll) => {
            return Err(Error::config(
                "poll mode queries a database table; a binlog-file source has none",
                "drop --mode poll to replay the files, or poll the database: --source mysql://…",
            ))
        }
    };
    tracing::info!(
        published = stats.published.load(std::sync::atomic::Ordering::Relaxed),
        confirmed = stats.confirmed.load(std::sync::atomic::Ordering::Relaxed),
        "stopped"
    );
    Ok(())
}

async fn setup(args: SetupArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    let dsn = match r.source.clone() {
        SourceDsn::Postgres(dsn) => dsn,
        SourceDsn::Mysql(dsn) => return setup_mysql(dsn, &r, &args).await,
        SourceDsn::File(_) => return Err(Error::config(
            "a binlog-file source needs no setup",
            "run it directly: outboxd run --source file:///path/binlog.000001 --table db.outbox",
        )),
    };
    let client = pg::connect_sql(&dsn, "outboxd_setup").await?;
    for table in &r.tables {
        if args.create_table {
            let created = admin::create_outbox_table(&client, table).await?;
            println!(
                "ok   outbox table {} ({})",
                table.pg_quoted(),
                if created { "created" } else { "exists" }
            );
        }
        admin::require_table(&client, table).await?;
        if args.notify {
            client
                .batch_execute(&crate::source::poll::notify_trigger_sql(table))
                .await?;
            println!(
                "ok   notify trigger on {} (channel {})",
                table.pg_quoted(),
                crate::source::poll::notify_channel(table)
            );
        }
    }
    if args.mode == Mode::Poll {
        return Ok(());
    }
    admin::require_logical(&client).await?;
    crate::state::postgres::ensure_table(&client).await?;
    println!("ok   state table outboxd_state");
    let list = r
        .tables
        .iter()
        .map(TableName::pg_quoted)
        .collect::<Vec<_>>()
        .join(", ");
    match admin::ensure_publication(&client, &r.publication, &r.tables).await? {
        admin::PublicationChange::Created => {
            println!("ok   publication {} on {list} (created)", r.publication)
        }
        admin::PublicationChange::Exists => {
            println!("ok   publication {} on {list} (exists)", r.publication)
        }
        admin::PublicationChange::Added(added) => println!(
            "ok   publication {} on {list}: added {} — a running relay publishes their inserts committed from now on; rows already in them are not published (replay them with `outboxd offset set --replay-since` if needed)",
            r.publication,
            added.iter().map(TableName::pg_quoted).collect::<Vec<_>>().join(", ")
        ),
    }
    match admin::slot(&client, &r.slot).await? {
        Some(_) => println!("ok   replication slot {} (exists)", r.slot),
        None => {
            let state = crate::state::postgres::load(&client, &r.name).await?;
            if state.is_some_and(|s| s.initialized) {
                return Err(Error::PositionLost {
                    problem: format!(
                        "relay {:?} has state but its slot {:?} is gone",
                        r.name, r.slot
                    ),
                    fix: admin::lost_slot_fix(&r.name, &r.slot),
                });
            }
            admin::create_slot(&client, &r.slot).await?;
            println!("ok   replication slot {} (created)", r.slot);
        }
    }
    Ok(())
}

async fn teardown(args: TeardownArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    let dsn = match r.source.clone() {
        SourceDsn::Postgres(dsn) => dsn,
        SourceDsn::Mysql(dsn) => return teardown_mysql(dsn, &r, args.yes).await,
        SourceDsn::File(_) => {
            return Err(Error::config(
                "a binlog-file source keeps no state",
                "nothing to tear down",
            ))
        }
    };
    if !args.yes {
        return Err(Error::config(
            format!(
                "teardown drops slot {}, publication {} and the stored position of relay {:?}",
                r.slot, r.publication, r.name
            ),
            "add --yes to confirm",
        ));
    }
    let client = pg::connect_sql(&dsn, "outboxd_teardown").await?;
    if let Some(state) = crate::state::postgres::load(&client, &r.name).await? {
        if state.lease_live {
            if let Some(h) = state
                .lease_holder
                .filter(|h| !crate::state::holder_is_dead_locally(h))
            {
                return Err(Error::config(
                    format!("relay {:?} is running (lease held by {h})", r.name),
                    "stop it first",
                ));
            }
        }
    }
    let dropped = admin::drop_slot(&client, &r.slot).await?;
    println!(
        "ok   replication slot {} ({})",
        r.slot,
        if dropped { "dropped" } else { "absent" }
    );
    admin::drop_publication(&client, &r.publication).await?;
    println!("ok   publication {} (dropped)", r.publication);
    let n = crate::state::postgres::delete(&client, &r.name).await?;
    println!(
        "ok   state of {} ({} row{})",
        r.name,
        n,
        if n == 1 { "" } else { "s" }
    );
    Ok(())
}

/// `setup` for MySQL/MariaDB: the binlog settings and the table are checked, the state table
/// created. (There is no slot or publication: the binlog is read from a position.)
async fn setup_mysql(dsn: dsn::DbDsn, r: &Resolved, args: &SetupArgs) -> Result<(), Error> {
    use crate::source::mysql::{self as my, admin as my_admin};
    if args.notify {
        return Err(Error::config(
            "--notify installs a Postgres LISTEN/NOTIFY trigger; MySQL has none",
            "drop --notify",
        ));
    }
    let mut conn = my::connect_sql(&dsn).await?;
    let tables = connector::mysql_tables(&dsn, &r.tables, &r.columns, Default::default())?;
    if args.create_table {
        for table in &tables {
            let created = my_admin::create_outbox_table(&mut conn, table).await?;
            println!(
                "ok   outbox table {} ({})",
                table.quoted(),
                if created { "created" } else { "exists" }
            );
        }
    }
    if args.mode == Mode::Poll {
        // No binlog and no state: poll mode needs only the table.
        for table in &tables {
            my_admin::require_table(&mut conn, table).await?;
            println!("ok   outbox table {}", table.quoted());
        }
        return Ok(());
    }
    let settings = my_admin::require_binlog(&mut conn).await?;
    println!(
        "ok   binlog: log_bin=ON binlog_format=ROW binlog_row_image=FULL binlog_row_metadata=FULL ({})",
        settings.version
    );
    for table in &tables {
        my_admin::require_table(&mut conn, table).await?;
        println!("ok   outbox table {}", table.quoted());
    }
    crate::state::mysql::ensure_table(&mut conn).await?;
    println!("ok   state table outboxd_state");
    Ok(())
}

/// `teardown` for MySQL/MariaDB: the relay's state row (its stored position) goes.
async fn teardown_mysql(dsn: dsn::DbDsn, r: &Resolved, yes: bool) -> Result<(), Error> {
    if !yes {
        return Err(Error::config(
            format!("teardown drops the stored position of relay {:?}", r.name),
            "add --yes to confirm",
        ));
    }
    let mut conn = crate::db::mysql::connect_sql(&dsn).await?;
    if let Some(state) = crate::state::mysql::load(&mut conn, &r.name).await? {
        if state.lease_live {
            if let Some(h) = state
                .lease_holder
                .filter(|h| !crate::state::holder_is_dead_locally(h))
            {
                return Err(Error::config(
                    format!("relay {:?} is running (lease held by {h})", r.name),
                    "stop it first",
                ));
            }
        }
    }
    let n = crate::state::mysql::delete(&mut conn, &r.name).await?;
    println!(
        "ok   state of {} ({} row{})",
        r.name,
        n,
        if n == 1 { "" } else { "s" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_names() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert_eq!(parse_duration("5").unwrap(), Duration::from_secs(5));
        assert!(parse_duration("5 parsecs").is_err());
        // Larger than a Duration holds, and overflowing f64 to infinity: errors, no panic.
        assert!(parse_duration("99999999999999999999999d").is_err());
        assert!(parse_duration(&"9".repeat(400)).is_err());
        assert!(parse_duration("1.5.5s").is_err());
        assert!(validate_pg_object("--slot", "outboxd_billing").is_ok());
        assert!(validate_pg_object("--slot", &"a".repeat(63)).is_ok());
        for bad in ["", "Slot", "a-b", "x'; DROP TABLE t; --", "a b", "é"] {
            let err = validate_pg_object("--publication", bad)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("--publication") && err.contains("[a-z0-9_]"),
                "{err}"
            );
        }
        assert!(validate_pg_object("--slot", &"a".repeat(64)).is_err());
        assert!(validate_name("billing_2").is_ok());
        assert!(validate_name("Billing").is_err());
        assert!(validate_name("").is_err());
        assert!(validate_name(&"a".repeat(41)).is_err());
        assert_eq!(parse_bytes("16MiB").unwrap(), 16 * 1024 * 1024);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("2 KiB").unwrap(), 2048);
        assert_eq!(parse_bytes("1MB").unwrap(), 1_000_000);
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("12 parsecs").is_err());
    }
}
