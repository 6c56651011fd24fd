//! The Kafka sink's own flags (`run` and `check`, docs/kafka.md); `--routing-key` (the topic
//! template), `--declare`, the TLS files and the message's shape are shared with the other
//! sinks (the command line's `SinkArgs`).

use super::KafkaOptions;
use crate::consumer::cli::parse_duration;
use crate::values::parse_bytes;
use clap::Args;
use std::time::Duration;

/// Kafka sink settings (docs/kafka.md). The topic is the `--routing-key` template.
#[derive(Debug, Clone, Args)]
pub struct KafkaFlags {
    /// Kafka sink: the topic dead records go to (body-less, with x-dead-reason).
    #[arg(long, env = "OUTBOXD_KAFKA_DEAD_TOPIC", default_value = super::config::DEFAULT_DEAD_TOPIC)]
    pub kafka_dead_topic: String,
    /// Kafka sink: most records read back from the end of a partition, at start and after a
    /// reconnect, to find the events the relay already wrote there.
    #[arg(long, env = "OUTBOXD_KAFKA_SCAN_LIMIT", default_value_t = super::config::DEFAULT_SCAN_LIMIT)]
    pub kafka_scan_limit: i64,
    /// Kafka sink: partitions of a topic --declare auto creates.
    #[arg(long, env = "OUTBOXD_KAFKA_PARTITIONS", default_value_t = 1)]
    pub kafka_partitions: i32,
    /// Kafka sink: replication factor of a topic --declare auto creates.
    #[arg(long, env = "OUTBOXD_KAFKA_REPLICATION", default_value_t = 1)]
    pub kafka_replication: i32,
    /// Kafka sink: a record (key, value and headers) larger than this becomes a dead record.
    #[arg(long, env = "OUTBOXD_KAFKA_MAX_MESSAGE_BYTES", value_parser = parse_bytes, default_value = "1000000")]
    pub kafka_max_message_bytes: usize,
    /// Kafka sink: how long the producer waits to fill a batch (librdkafka's linger.ms).
    #[arg(long, env = "OUTBOXD_KAFKA_LINGER", value_parser = parse_duration, default_value = "5ms")]
    pub kafka_linger: Duration,
    /// Kafka sink: an event whose payload is NULL or blank becomes a tombstone (a record with
    /// the key and no value, for compacted topics) instead of a dead record.
    #[arg(long, env = "OUTBOXD_KAFKA_TOMBSTONES")]
    pub kafka_tombstones: bool,
    /// Kafka sink: the record's partition is this integer column's value (a NULL value leaves
    /// it to the key) instead of the key's murmur2.
    #[arg(long, env = "OUTBOXD_KAFKA_PARTITION_COLUMN", value_name = "COLUMN")]
    pub kafka_partition_column: Option<String>,
}

impl KafkaFlags {
    pub fn options(&self) -> Result<KafkaOptions, crate::Error> {
        Ok(KafkaOptions {
            dead_topic: self.kafka_dead_topic.clone(),
            scan_limit: self.kafka_scan_limit,
            partitions: self.kafka_partitions,
            replication: self.kafka_replication,
            max_message_bytes: self.kafka_max_message_bytes,
            linger: self.kafka_linger,
            tombstones: self.kafka_tombstones,
            partition_column: self
                .kafka_partition_column
                .as_deref()
                .map(|c| c.trim().to_string()),
        })
    }
}
