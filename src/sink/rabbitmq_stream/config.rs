//! What the RabbitMQ stream sink is given (`--sink rabbitmq-stream://…`, `--stream`,
//! `--declare`, `--partitions`) and the endpoint parsed out of its URL. Kept apart from the
//! broker code so the redacting `Debug` (the URL holds the password) sits next to the fields it
//! must cover, and so the URL rules can be unit-tested without a broker.

use crate::dsn::redact;
use crate::sink::rabbitmq::RabbitConfig;
use crate::sink::DeclareMode;
use std::time::Duration;

pub(crate) use crate::stream::StreamEndpoint;

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
