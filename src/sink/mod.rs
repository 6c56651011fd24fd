//! Where events go. A sink says, for every event, whether it is merely accepted (durable once
//! the sink is flushed) or pending a broker confirmation; only durable events let the relay
//! advance the stored position. Recovery (reconnect, republish in order) belongs to the relay,
//! so every sink gets it the same way.

pub(crate) mod declare;
pub mod format;
pub mod headers;
// The in-memory double: for tests only (the `test-util` feature), never in a release build.
#[cfg(any(test, feature = "test-util"))]
pub(crate) mod memory;
pub mod options;
pub mod partition;
// What the broker sinks share: with fewer sinks compiled, some of it is unused.
#[cfg_attr(
    not(all(
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "rabbitmq-stream"
    )),
    allow(dead_code)
)]
pub(crate) mod registry;
pub mod template;
// RabbitMQ partition layouts: the AMQP sink's and `outboxd topology`'s.
#[cfg(feature = "rabbitmq")]
pub mod topology;

// The sinks, each in its own folder behind its own feature (which gates its broker's client).
// A new sink is a folder, a line here and one in the list below, and a feature.
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "nats")]
pub mod nats;
#[cfg(feature = "rabbitmq")]
pub mod rabbitmq;
#[cfg(feature = "rabbitmq-stream")]
pub mod rabbitmq_stream;
pub mod stdout;

pub use declare::DeclareMode;
pub use options::{SinkContext, SinkOptions};
pub use registry::{Descriptor, SinkDsn};

use crate::event::OutboxEvent;
use futures::future::BoxFuture;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// How an event was taken by a sink.
pub enum Delivery {
    /// Written; durable after the next successful [`Sink::flush`].
    Accepted,
    /// Handed to a broker; durable when the future resolves `Ok`.
    Pending(BoxFuture<'static, Result<(), SinkError>>),
}

#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// The connection is gone or unusable; reconnect and republish.
    #[error("sink connection: {0}")]
    Connection(String),
    /// The broker returned the message as unroutable (or refused it for good reason that
    /// holds for the messages after it as well).
    #[error("sink rejected the message: {0}")]
    Rejected(String),
    /// The broker refused the message but may accept the ones written after it: a RabbitMQ
    /// nack (a queue with `x-overflow=reject-publish` that is full), a JetStream stream full
    /// under `discard new`. Those later messages are already on the wire, so their first
    /// delivery can come before this one's: the relay flags it (`OrderAtRisk`).
    #[error("sink rejected the message: {0}")]
    Nacked(String),
    /// No confirmation within the confirm timeout.
    #[error("no confirmation within {0:?}")]
    ConfirmTimeout(std::time::Duration),
    /// Configuration or permission problem: retrying cannot help.
    #[error("{problem}\n  fix: {fix}")]
    Config { problem: String, fix: String },
    /// Writing to a local stream failed (stdout closed).
    #[error("sink io: {0}")]
    Io(#[from] std::io::Error),
}

impl SinkError {
    /// A short name of the kind of failure (a metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            SinkError::Connection(_) => "connection",
            // One label for both refusals: the metric's documented causes stay the same.
            SinkError::Rejected(_) | SinkError::Nacked(_) => "rejected",
            SinkError::ConfirmTimeout(_) => "timeout",
            SinkError::Config { .. } => "config",
            SinkError::Io(_) => "io",
        }
    }

    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            SinkError::Connection(_)
                | SinkError::Rejected(_)
                | SinkError::Nacked(_)
                | SinkError::ConfirmTimeout(_)
        )
    }
}

/// A destination for outbox events. Not object-safe on purpose: the relay is generic over it.
pub trait Sink: Send {
    /// Short name for logs (`stdout`, `rabbitmq`).
    fn name(&self) -> &'static str;

    /// Whether positions acknowledged through this sink may be stored. The stdout sink stores
    /// none unless asked (`--commit-offsets`), so trying it never moves a production position.
    fn stores_position(&self) -> bool;

    /// (Re)establish the connection. Called before the first publish and after a retryable
    /// failure, before the unconfirmed events are republished in order.
    fn connect(&mut self) -> impl std::future::Future<Output = Result<(), SinkError>> + Send;

    /// Hand one event to the sink.
    fn publish(
        &mut self,
        event: &OutboxEvent,
    ) -> impl std::future::Future<Output = Result<Delivery, SinkError>> + Send;

    /// Make every `Accepted` event durable.
    fn flush(&mut self) -> impl std::future::Future<Output = Result<(), SinkError>> + Send;

    /// Whether the connection is known to be gone, so the relay reconnects before the next
    /// event needs it (and readiness tells the truth while nothing flows).
    fn is_broken(&self) -> bool {
        false
    }

    /// Publishing is gated by `fence` (the lease): a sink whose client library writes from its
    /// own buffers (frames queued before a pause, written after it) drops its connection when
    /// the gate closes, so nothing more reaches the wire. Called once, before `connect`.
    fn guard_wire(&mut self, fence: crate::state::Fence) {
        let _ = fence;
    }

    /// Who publishes and from which log (`crate::identity::Origin`): the sink writes both on
    /// every message, and a sink that recognises what a broker already holds compares them.
    /// Called before `connect`, once the source's identity is known; a sink that was never
    /// told names only its relay.
    fn set_origin(&mut self, origin: &crate::identity::Origin) {
        let _ = origin;
    }

    /// Whether the destination holds publishing back on purpose (RabbitMQ's resource alarms):
    /// confirmations are then late by design, so the relay's confirm timeout does not run out
    /// across a block — reconnecting would only republish into the same block.
    fn flow_control(&self) -> Option<Arc<FlowControl>> {
        None
    }
}

/// A destination's flow control as the relay sees it: blocked now, and a count of blocks so far
/// (a block that began and ended between two looks still shows as a new count).
#[derive(Debug, Default)]
pub struct FlowControl {
    blocked: AtomicBool,
    blocks: AtomicU64,
}

impl FlowControl {
    pub fn block(&self) {
        self.blocks.fetch_add(1, Ordering::Relaxed);
        self.blocked.store(true, Ordering::Relaxed);
    }

    pub fn unblock(&self) {
        self.blocked.store(false, Ordering::Relaxed);
    }

    pub(crate) fn is_blocked(&self) -> bool {
        self.blocked.load(Ordering::Relaxed)
    }

    /// How many blocks began so far.
    pub fn blocks(&self) -> u64 {
        self.blocks.load(Ordering::Relaxed)
    }
}

// The registry: every sink of this build, in the order `--sink`'s help and errors list them.
registry::sinks! {
    Stdout => stdout::StdoutSink,
    #[cfg(feature = "rabbitmq")]
    Rabbit => rabbitmq::RabbitSink,
    #[cfg(feature = "nats")]
    Nats => nats::NatsSink,
    #[cfg(feature = "kafka")]
    Kafka => kafka::KafkaSink,
    #[cfg(feature = "rabbitmq-stream")]
    RabbitStream => rabbitmq_stream::RabbitStreamSink,
}

/// A comma-separated flag value as clap hands it over (`--header a=b,c=d`): one item each.
#[cfg(test)]
pub(crate) fn specs(s: &str) -> Vec<String> {
    s.split(',').map(String::from).collect()
}

/// One event as the sinks' unit tests use it.
#[cfg(test)]
pub(crate) fn test_event() -> OutboxEvent {
    use chrono::TimeZone;
    OutboxEvent {
        id: uuid::Uuid::parse_str("0190a5c4-7e2b-7000-8000-00000000abcd").unwrap(),
        aggregate_id: "agg-1".into(),
        topic: "invoice.issued".into(),
        payload: bytes::Bytes::from_static(br#"{"a": 1}"#),
        created_at: chrono::Utc.timestamp_micros(1_750_000_000_123_456).unwrap(),
        position: crate::event::SourcePosition::Pg {
            commit_lsn: 0x16B3748,
            index: 3,
        },
        headers: None,
        version: Some(7),
        gtid: None,
        committed_at: None,
        poison: None,
        table: None,
        extra: Vec::new(),
        content_type: None,
        empty_payload: false,
        read_at: None,
    }
}
