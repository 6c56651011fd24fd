//! The topics under `--declare`: `auto` creates what is missing (the dead topic at connect,
//! each event topic the first time a link writes to it), `passive` only checks that they
//! exist and says how to create them, `off` assumes they do. A missing event topic refuses its
//! events (with the command that creates it) and the relay retries with backoff, without
//! moving its position.

use super::config::KafkaConfig;
use crate::sink::DeclareMode;
use crate::sink::SinkError;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::types::RDKafkaErrorCode;

pub(crate) type Admin = AdminClient<super::logs::Quiet>;

/// The fix for a missing topic: the command that creates it as `auto` would (with
/// `--kafka-partitions` and `--kafka-replication`).
pub(super) fn create_fix(cfg: &KafkaConfig, name: &str) -> String {
    format!(
        "kafka-topics.sh --bootstrap-server <broker> --create --topic {name} --partitions {} --replication-factor {} (or run with --declare auto)",
        cfg.options.partitions, cfg.options.replication
    )
}

/// The number of partitions of `topic` (0: it does not exist, or the broker reports an error
/// for it). Blocking (a metadata request): run it on a blocking thread.
pub(crate) fn partition_count(cfg: &KafkaConfig, topic: &str) -> Result<usize, SinkError> {
    let c: BaseConsumer<super::logs::Quiet> = cfg
        .client()?
        .set("allow.auto.create.topics", "false")
        .create_with_context(super::logs::Quiet)
        .map_err(|e| SinkError::Connection(format!("creating a metadata client: {e}")))?;
    let meta = c
        .fetch_metadata(Some(topic), cfg.op_timeout)
        .map_err(|e| SinkError::Connection(format!("reading the metadata of {topic}: {e}")))?;
    Ok(meta
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none())
        .map_or(0, |t| t.partitions().len()))
}

/// Whether `topic` exists. Blocking.
pub(crate) fn exists(cfg: &KafkaConfig, topic: &str) -> Result<bool, SinkError> {
    Ok(partition_count(cfg, topic)? > 0)
}

async fn exists_async(cfg: &KafkaConfig, topic: &str) -> Result<bool, SinkError> {
    let (cfg, topic) = (cfg.clone(), topic.to_string());
    tokio::task::spawn_blocking(move || exists(&cfg, &topic))
        .await
        .map_err(|e| SinkError::Connection(format!("metadata task: {e}")))?
}

async fn create(admin: &Admin, cfg: &KafkaConfig, name: &str) -> Result<(), SinkError> {
    let t = NewTopic::new(
        name,
        cfg.options.partitions,
        TopicReplication::Fixed(cfg.options.replication),
    );
    let opts = AdminOptions::new().operation_timeout(Some(cfg.op_timeout));
    let results = admin
        .create_topics([&t], &opts)
        .await
        .map_err(|e| SinkError::Connection(format!("creating topic {name}: {e}")))?;
    for r in results {
        match r {
            Ok(_) => tracing::info!(topic = name, "created Kafka topic"),
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => {
                return Err(SinkError::Config {
                    problem: format!("the broker refused to create topic {name}: {code}"),
                    fix: create_fix(cfg, name),
                })
            }
        }
    }
    Ok(())
}

/// Makes sure `topic` exists as `--declare` asks.
pub(crate) async fn ensure(admin: &Admin, cfg: &KafkaConfig, topic: &str) -> Result<(), SinkError> {
    match cfg.declare {
        DeclareMode::Off => Ok(()),
        DeclareMode::Passive => {
            if exists_async(cfg, topic).await? {
                Ok(())
            } else {
                // An event topic that is missing is refused again at every attempt until it is
                // created: retryable (the relay backs off), not a reason to stop.
                Err(SinkError::Rejected(format!(
                    "topic {topic} does not exist and --declare passive does not create it; fix: {}",
                    create_fix(cfg, topic)
                )))
            }
        }
        DeclareMode::Auto => {
            if exists_async(cfg, topic).await? {
                Ok(())
            } else {
                create(admin, cfg, topic).await
            }
        }
    }
}
