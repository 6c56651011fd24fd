//! The sink settings of `outboxd run` and `outboxd check`: what every broker sink shares
//! (`--declare`, `--max-message-bytes`, the TLS files, `--partitions`, the message's shape,
//! `--stream`, the exchange) beside each sink's own (`SinkOptions::sinks`, one field per sink
//! of the registry); and the one place that builds the sink `--sink` names from them, through
//! its descriptor, so neither the pipeline nor the commands hold per-sink wiring.

use super::format::MessageOptions;
use super::partition::Partitioning;
use super::{AnySink, DeclareMode, PerSink, SinkDsn};
use crate::Error;
use std::path::PathBuf;
use std::time::Duration;

/// Default `--stream`: the NATS JetStream stream, or the RabbitMQ stream.
pub const DEFAULT_STREAM: &str = "OUTBOX";

/// Settings every broker sink reads, and each sink's own.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    /// `--declare`: create what is missing, only check it, or neither.
    pub declare: DeclareMode,
    /// `--max-message-bytes`: a larger message is dead-lettered (AMQP, NATS).
    pub max_message_bytes: usize,
    /// `--sink-ca`, `--sink-cert`, `--sink-key`.
    pub tls: TlsFiles,
    /// `--partitions`, `--group-partitions`, `--queue-type`, `--partition-routing`.
    pub partitioning: Partitioning,
    /// `--routing-key`, a templated `--exchange`, `--header`, `--format`.
    pub message: MessageOptions,
    /// `--stream`: the NATS JetStream stream, or the RabbitMQ stream (with `--partitions N`,
    /// `<stream>-0` … `<stream>-<N-1>`).
    pub stream: String,
    /// The exchange the relay declares and dead-letters through: `--exchange`, or with a
    /// templated one `--base-exchange` (AMQP, and the RabbitMQ stream sink's messages).
    pub exchange: String,
    /// Each sink's own settings.
    pub sinks: PerSink,
}

impl Default for SinkOptions {
    fn default() -> Self {
        SinkOptions {
            declare: DeclareMode::default(),
            max_message_bytes: 0,
            tls: TlsFiles::default(),
            partitioning: Partitioning::default(),
            message: MessageOptions::default(),
            stream: DEFAULT_STREAM.into(),
            exchange: String::new(),
            sinks: PerSink::default(),
        }
    }
}

/// The client certificate and the CA a sink's TLS connection uses (files; the key is a secret
/// and is checked for owner and mode where it is read).
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

/// What the relay (or `check`), not the sink options, decides about a sink.
#[derive(Debug, Clone)]
pub struct SinkContext<'a> {
    /// The relay's `--name` (`check` for `outboxd check`): names the connection, the
    /// producer, the transactional identity.
    pub name: &'a str,
    /// How long one broker operation may take (`--confirm-timeout`).
    pub op_timeout: Duration,
    /// The relay's window (`--window`): the NATS sink sizes its pipeline with it.
    pub window: usize,
    /// `--commit-offsets` (stdout).
    pub commit_offsets: bool,
}

impl SinkContext<'static> {
    /// The context of `outboxd check`: its own connection name, a 15 s bound on each probe.
    pub fn check() -> SinkContext<'static> {
        SinkContext {
            name: "check",
            op_timeout: Duration::from_secs(15),
            window: 1,
            commit_offsets: false,
        }
    }
}

impl SinkOptions {
    /// Builds the sink `dsn` names. Nothing connects here: a bad setting is reported before
    /// the relay creates a replication slot or takes a lease.
    pub fn build(&self, dsn: &SinkDsn, ctx: &SinkContext<'_>) -> Result<AnySink, Error> {
        (dsn.descriptor().build)(dsn, self, ctx)
    }

    /// Logs, once before the relay starts, the settings given that the sink ignores.
    pub(crate) fn warn_ignored(&self, dsn: &SinkDsn) {
        if let Some(w) = (dsn.descriptor().ignored)(self) {
            tracing::warn!("{w}");
        }
    }
}
