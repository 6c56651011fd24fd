//! What the RabbitMQ sink is given: the limits it enforces, `--declare`, and the validated
//! [`RabbitConfig`]. It lives apart so the command line and `outboxd topology` can depend on
//! the settings without the broker code, and so the redacting `Debug` (the URL holds the
//! password) sits next to the fields it must cover.

use crate::dsn::redact;
use crate::sink::format::MessageOptions;
use crate::sink::partition::{Partitioning, QueueType};
use crate::sink::DeclareMode;
use crate::sink::SinkError;
use std::path::PathBuf;
use std::time::Duration;

/// Default `--max-message-bytes`: 16 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// Encoded message headers above this are a poison event (and never more than fits in one
/// AMQP frame: RabbitMQ sends the properties in a single content-header frame).
pub const MAX_HEADER_BYTES: usize = 128 * 1024;
/// Room left in a frame for the other properties (message id, type, …) and framing.
pub(super) const FRAME_RESERVE: usize = 4096;
/// Header values of dead-letter records are cut here, so a record always fits in a frame.
pub(super) const DEAD_VALUE_MAX: usize = 1024;
pub(super) const APP_ID: &str = "outboxd";

/// Everything the sink needs, already validated by the command line.
#[derive(Clone)]
pub struct RabbitConfig {
    /// `amqp://` or `amqps://` URL, password included: never log it unredacted.
    pub url: String,
    pub exchange: String,
    pub declare: DeclareMode,
    pub max_message_bytes: usize,
    /// Bounds connecting, declaring and each socket write (the relay bounds each
    /// confirmation with the same value): a broker that is away can make lapin wait silently.
    pub op_timeout: Duration,
    /// PEM CA certificate(s) trusted for `amqps://` (in addition to the public roots).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and key for `amqps://` with client authentication.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// Shown in the broker's connection list.
    pub connection_name: String,
    /// `--partitions`, `--group-partitions`, `--queue-type`, `--partition-routing`.
    pub partitioning: Partitioning,
    /// `--dead-queue-type`: the type of the `<exchange>.unrouted` and `<exchange>.dead` queues.
    pub dead_queue_type: QueueType,
    /// `--routing-key`, a templated `--exchange`, `--header`, `--format`.
    pub message: MessageOptions,
}

impl std::fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &redact(&self.url))
            .field("exchange", &self.exchange)
            .field("declare", &self.declare)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("op_timeout", &self.op_timeout)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("dead_queue_type", &self.dead_queue_type)
            .field("key_file", &self.key_file)
            .field("partitioning", &self.partitioning)
            .field("message", &self.message)
            .finish()
    }
}

/// Checks an exchange name: AMQP allows letters, digits, `-_.:` and at most 255 bytes, and
/// the derived names (`.unrouted` is the longest suffix) must fit too.
pub fn validate_exchange(name: &str) -> Result<(), crate::Error> {
    let ok_chars = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if name.is_empty()
        || !ok_chars
        || name.len() + ".unrouted".len() > 255
        || name.starts_with("amq.")
    {
        return Err(crate::Error::config(
            format!("--exchange {name:?} is not a usable exchange name"),
            "use 1 to 246 characters of [A-Za-z0-9-_.:], not starting with amq., e.g. --exchange outbox",
        ));
    }
    Ok(())
}

pub(super) fn config_err(problem: impl Into<String>, fix: impl Into<String>) -> SinkError {
    SinkError::Config {
        problem: problem.into(),
        fix: fix.into(),
    }
}
