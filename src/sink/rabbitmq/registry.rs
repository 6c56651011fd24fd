//! The RabbitMQ sink in the sink registry: `amqp://` and `amqps://`, its one flag of its own
//! (`--dead-queue-type`), its settings built from the shared ones for `run` and `check` alike,
//! and the checks of `outboxd check` (connect, the topology the relay uses, the
//! consistent-hash plugin when the partitions need it).

use super::{RabbitConfig, RabbitSink};
use crate::diagnostics::{CheckLine, Level};
use crate::sink::partition::{PartitionRouting, QueueType};
use crate::sink::registry::{self, Descriptor};
use crate::sink::topology::{check_line, consistent_hash_plugin, Layout};
use crate::sink::{AnySink, DeclareMode, SinkContext, SinkDsn, SinkError, SinkKind, SinkOptions};
use futures::future::LocalBoxFuture;
use std::time::Duration;

pub const DESCRIPTOR: Descriptor = Descriptor {
    kind: SinkKind::Rabbit,
    name: "rabbitmq",
    words: &[],
    schemes: &["amqp", "amqps"],
    example: "amqp://user@host:5672/%2f",
    is_url: true,
    build: |dsn, o, ctx| {
        Ok(AnySink::Rabbit(Box::new(RabbitSink::new(config(
            dsn.url(),
            o,
            ctx,
        ))?)))
    },
    check,
    columns: registry::no_columns,
    ignored: registry::ignores_nothing,
    password: registry::url_password,
};

/// What only the AMQP sink reads.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// `--dead-queue-type`.
    pub dead_queue_type: QueueType,
}

/// The AMQP sink's settings; the RabbitMQ stream sink renders its messages with the same ones.
pub(crate) fn config(url: &str, o: &SinkOptions, ctx: &SinkContext<'_>) -> RabbitConfig {
    RabbitConfig {
        url: url.to_string(),
        exchange: o.exchange.clone(),
        declare: o.declare,
        max_message_bytes: o.max_message_bytes,
        op_timeout: ctx.op_timeout,
        ca_file: o.tls.ca_file.clone(),
        cert_file: o.tls.cert_file.clone(),
        key_file: o.tls.key_file.clone(),
        connection_name: format!("outboxd {}", ctx.name),
        partitioning: o.partitioning.clone(),
        dead_queue_type: o.sinks.rabbitmq.dead_queue_type,
        message: o.message.clone(),
    }
}

fn check<'a>(
    dsn: &'a SinkDsn,
    o: &'a SinkOptions,
    ctx: &'a SinkContext<'a>,
) -> LocalBoxFuture<'a, Vec<CheckLine>> {
    Box::pin(check_rabbitmq(dsn, o, ctx))
}

/// The RabbitMQ checks of `outboxd check`: connect, the topology the relay uses (its
/// partition queues included), and the consistent-hash plugin when `--partition-routing
/// consistent-hash` asks for it. Never stops at the first failure.
async fn check_rabbitmq(dsn: &SinkDsn, o: &SinkOptions, ctx: &SinkContext<'_>) -> Vec<CheckLine> {
    let mut out = Vec::new();
    // Probing only: nothing is declared here, whatever `--declare` says (it only decides
    // whether something missing is a warning or a failure).
    let cfg = RabbitConfig {
        declare: DeclareMode::Passive,
        ..config(dsn.url(), o, ctx)
    };
    let partitioning = cfg.partitioning.clone();
    let sink = match RabbitSink::new(cfg) {
        Ok(s) => s,
        Err(e) => {
            out.push(check_line(
                Level::Fail,
                "rabbitmq settings",
                e.to_string(),
                None,
            ));
            return out;
        }
    };
    let conn = match tokio::time::timeout(Duration::from_secs(15), sink.connection()).await {
        Ok(Ok(c)) => {
            out.push(check_line(Level::Ok, "rabbitmq connect", "connected", None));
            c
        }
        Ok(Err(e)) => {
            let (detail, fix) = split_fix(&e);
            out.push(check_line(Level::Fail, "rabbitmq connect", detail, fix));
            return out;
        }
        Err(_) => {
            out.push(check_line(
                Level::Fail,
                "rabbitmq connect",
                "no answer within 15s",
                Some("check the host and port of --sink and that RabbitMQ runs".into()),
            ));
            return out;
        }
    };
    if partitioning.routing == PartitionRouting::ConsistentHash {
        out.push(consistent_hash_plugin(&conn).await);
    }
    let _ = conn.close(200, "OK".into()).await;
    if o.declare != DeclareMode::Off {
        let layouts: Vec<Layout> = Layout::relay(&o.exchange, &partitioning)
            .into_iter()
            .collect();
        let what = match layouts.first() {
            Some(l) => format!(
                "exchange {x}, {x}.unrouted, {x}.dead, {} and queues {} … {}",
                l.exchange(),
                l.queue(0),
                l.queue(l.partitions - 1),
                x = o.exchange
            ),
            None => format!("exchange {x}, {x}.unrouted, {x}.dead", x = o.exchange),
        };
        match sink.declare_layouts(&layouts).await {
            Ok(_) => out.push(check_line(
                Level::Ok,
                "rabbitmq topology",
                format!("{what} exist"),
                None,
            )),
            Err(e) => {
                let (detail, fix) = split_fix(&e);
                let level = match (&e, o.declare) {
                    // The relay declares what is missing itself.
                    (SinkError::Config { .. }, DeclareMode::Auto) => Level::Warn,
                    _ => Level::Fail,
                };
                let detail = if level == Level::Warn {
                    format!("{detail} (the relay declares it with --declare auto)")
                } else {
                    detail
                };
                out.push(check_line(level, "rabbitmq topology", detail, fix));
            }
        }
    }
    out
}

/// A sink error as a check line's detail and fix.
pub(crate) fn split_fix(e: &SinkError) -> (String, Option<String>) {
    match e {
        SinkError::Config { problem, fix } => (problem.clone(), Some(fix.clone())),
        other => (other.to_string(), None),
    }
}
