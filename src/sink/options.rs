//! The sink settings of `outboxd run`, grouped by who reads them: what every broker sink
//! shares (`--declare`, `--max-message-bytes`, the TLS files, `--partitions`, the message's
//! shape, `--stream`) beside what only one sink reads; and the one place that builds the sink
//! `--sink` names from them, so the pipeline holds no per-sink wiring.

use super::format::MessageOptions;
use super::kafka::{KafkaConfig, KafkaOptions, KafkaSink};
use super::nats::{NatsConfig, NatsSink};
use super::partition::{Partitioning, QueueType};
use super::rabbitmq::{DeclareMode, RabbitConfig, RabbitSink};
use super::rabbitmq_stream::{RabbitStreamSink, StreamSinkConfig};
use super::stdout::StdoutSink;
use super::template::Template;
use super::AnySink;
use crate::dsn::SinkDsn;
use crate::Error;
use std::path::PathBuf;
use std::time::Duration;

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
    pub rabbit: RabbitOptions,
    pub nats: NatsOptions,
    pub rabbit_stream: RabbitStreamOptions,
    pub kafka: KafkaOptions,
}

impl Default for SinkOptions {
    fn default() -> Self {
        SinkOptions {
            declare: DeclareMode::default(),
            max_message_bytes: 0,
            tls: TlsFiles::default(),
            partitioning: Partitioning::default(),
            message: MessageOptions::default(),
            stream: super::nats::config::DEFAULT_STREAM.into(),
            rabbit: RabbitOptions::default(),
            nats: NatsOptions::default(),
            rabbit_stream: RabbitStreamOptions::default(),
            kafka: KafkaOptions::default(),
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

/// What only the AMQP sink reads.
#[derive(Debug, Clone, Default)]
pub struct RabbitOptions {
    pub exchange: String,
    /// `--dead-queue-type`.
    pub dead_queue_type: QueueType,
}

/// What only the NATS sink reads (its stream is [`SinkOptions::stream`]).
#[derive(Debug, Clone)]
pub struct NatsOptions {
    pub subject: Template,
}

impl Default for NatsOptions {
    fn default() -> Self {
        NatsOptions {
            subject: Template::parse(super::nats::config::DEFAULT_SUBJECT)
                .expect("the default subject parses"),
        }
    }
}

/// Retention of a stream the RabbitMQ stream sink creates (`--declare auto`).
#[derive(Debug, Clone, Default)]
pub struct RabbitStreamOptions {
    pub max_bytes: Option<u64>,
    pub max_age: Option<Duration>,
}

/// What the relay, not the sink options, decides about a sink.
#[derive(Debug, Clone)]
pub struct SinkContext<'a> {
    /// The relay's `--name`: names the connection, the producer, the transactional identity.
    pub name: &'a str,
    /// How long one broker operation may take (`--confirm-timeout`).
    pub op_timeout: Duration,
    /// The relay's window (`--window`): the NATS sink sizes its pipeline with it.
    pub window: usize,
    /// `--commit-offsets` (stdout).
    pub commit_offsets: bool,
}

impl SinkOptions {
    /// The AMQP sink's settings; the stream sink renders its messages with the same ones.
    fn rabbit_config(&self, url: &str, ctx: &SinkContext<'_>) -> RabbitConfig {
        RabbitConfig {
            url: url.to_string(),
            exchange: self.rabbit.exchange.clone(),
            declare: self.declare,
            max_message_bytes: self.max_message_bytes,
            op_timeout: ctx.op_timeout,
            ca_file: self.tls.ca_file.clone(),
            cert_file: self.tls.cert_file.clone(),
            key_file: self.tls.key_file.clone(),
            connection_name: format!("outboxd {}", ctx.name),
            partitioning: self.partitioning.clone(),
            dead_queue_type: self.rabbit.dead_queue_type,
            message: self.message.clone(),
        }
    }

    /// Builds the sink `dsn` names. Nothing connects here: a bad setting is reported before
    /// the relay creates a replication slot or takes a lease.
    pub fn build(&self, dsn: &SinkDsn, ctx: &SinkContext<'_>) -> Result<AnySink, Error> {
        let p = &self.partitioning;
        Ok(match dsn {
            SinkDsn::Stdout => {
                if p.partitions > 0 || p.sends_headers() {
                    tracing::warn!("--partitions and --group-partitions apply to a RabbitMQ sink: the stdout sink ignores them");
                }
                AnySink::Stdout(StdoutSink::new(ctx.commit_offsets))
            }
            SinkDsn::Amqp(url) => {
                AnySink::Rabbit(Box::new(RabbitSink::new(self.rabbit_config(url, ctx))?))
            }
            SinkDsn::Kafka(url) => {
                if p.partitions > 0 {
                    tracing::warn!("--partitions applies to RabbitMQ and NATS: a Kafka topic has partitions of its own (--kafka-partitions), and the record key (the aggregate id) keeps each aggregate in one");
                }
                AnySink::Kafka(Box::new(KafkaSink::new(KafkaConfig {
                    url: url.clone(),
                    name: ctx.name.to_string(),
                    options: self.kafka.clone(),
                    message: self.message.clone(),
                    declare: self.declare,
                    op_timeout: ctx.op_timeout,
                    ca_file: self.tls.ca_file.clone(),
                    cert_file: self.tls.cert_file.clone(),
                    key_file: self.tls.key_file.clone(),
                })?))
            }
            SinkDsn::RabbitStream(url) => {
                AnySink::RabbitStream(Box::new(RabbitStreamSink::new(StreamSinkConfig {
                    url: url.clone(),
                    stream: self.stream.clone(),
                    declare: self.declare,
                    max_bytes: self.rabbit_stream.max_bytes,
                    max_age: self.rabbit_stream.max_age,
                    op_timeout: ctx.op_timeout,
                    relay_name: ctx.name.to_string(),
                    message: self.rabbit_config(url, ctx),
                })?))
            }
            SinkDsn::Nats(url) => {
                if !p.header_counts.is_empty() && p.header_counts != [p.partitions] {
                    tracing::warn!("--group-partitions applies to a RabbitMQ sink: the NATS sink ignores it (subjects carry the relay's own partition)");
                }
                AnySink::Nats(Box::new(NatsSink::new(NatsConfig {
                    url: url.clone(),
                    subject: self.nats.subject.clone(),
                    stream: self.stream.clone(),
                    declare: self.declare,
                    max_message_bytes: self.max_message_bytes,
                    op_timeout: ctx.op_timeout,
                    window: ctx.window,
                    ca_file: self.tls.ca_file.clone(),
                    cert_file: self.tls.cert_file.clone(),
                    key_file: self.tls.key_file.clone(),
                    connection_name: format!("outboxd {}", ctx.name),
                    partitions: p.partitions,
                    headers: self.message.headers.clone(),
                })?))
            }
        })
    }
}
