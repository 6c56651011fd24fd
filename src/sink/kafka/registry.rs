//! The Kafka sink in the sink registry: `kafka://` and `kafkas://` (several brokers: no URL),
//! its `--kafka-*` flags, its settings built from the shared ones for `run` and `check` alike,
//! the partition column it reads, and the checks of `outboxd check` (the brokers, idempotence,
//! the topics).

use super::{KafkaConfig, KafkaOptions, KafkaSink};
use crate::diagnostics::{CheckLine, Level};
use crate::sink::registry::Descriptor;
use crate::sink::{AnySink, SinkContext, SinkDsn, SinkKind, SinkOptions};
use crate::Error;
use futures::future::LocalBoxFuture;

pub const DESCRIPTOR: Descriptor = Descriptor {
    kind: SinkKind::Kafka,
    name: "kafka",
    words: &[],
    schemes: &["kafka", "kafkas"],
    example: "kafka://host:9092",
    is_url: false,
    build: |dsn, o, ctx| {
        Ok(AnySink::Kafka(Box::new(KafkaSink::new(config(
            dsn.url(),
            o,
            ctx,
        ))?)))
    },
    check,
    columns,
    ignored: |o| {
        (o.partitioning.partitions > 0).then_some(
            "--partitions applies to RabbitMQ and NATS: a Kafka topic has partitions of its own (--kafka-partitions), and the record key (the aggregate id) keeps each aggregate in one",
        )
    },
    // Several brokers are no URL: the sink's own parser splits them.
    password: |url| super::config::endpoint(url).ok().and_then(|e| e.password),
};

/// What only the Kafka sink reads.
pub type Options = KafkaOptions;

/// The Kafka sink's settings.
pub(crate) fn config(url: &str, o: &SinkOptions, ctx: &SinkContext<'_>) -> KafkaConfig {
    KafkaConfig {
        url: url.to_string(),
        name: ctx.name.to_string(),
        options: o.sinks.kafka.clone(),
        message: o.message.clone(),
        declare: o.declare,
        op_timeout: ctx.op_timeout,
        ca_file: o.tls.ca_file.clone(),
        cert_file: o.tls.cert_file.clone(),
        key_file: o.tls.key_file.clone(),
    }
}

/// `--kafka-partition-column`: the row's column the record's partition is read from.
fn columns(o: &SinkOptions) -> Result<Vec<String>, Error> {
    let Some(c) = &o.sinks.kafka.partition_column else {
        return Ok(Vec::new());
    };
    let flag = "--kafka-partition-column";
    let name = c.trim();
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_alphanumeric() || c == '_' || c == '$')
    {
        return Err(Error::config(
            format!("{flag} {name:?} is not a column name"),
            format!("name the column without quotes or spaces, e.g. {flag} partition"),
        ));
    }
    Ok(vec![name.to_string()])
}

/// `check` with a `kafka://`/`kafkas://` sink: the brokers, idempotence and the topics.
fn check<'a>(
    dsn: &'a SinkDsn,
    o: &'a SinkOptions,
    ctx: &'a SinkContext<'a>,
) -> LocalBoxFuture<'a, Vec<CheckLine>> {
    Box::pin(async move {
        let cfg = config(dsn.url(), o, ctx);
        if let Err(e) = cfg.validate() {
            return vec![crate::diagnostics::line(
                Level::Fail,
                "kafka settings",
                e.to_string(),
                None,
            )];
        }
        super::check::check(&cfg).await
    })
}
