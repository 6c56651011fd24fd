//! The NATS JetStream sink in the sink registry: `nats://` and `tls://`, its flag of its own
//! (`--subject`), its settings built from the shared ones for `run` and `check` alike, and
//! the checks of `outboxd check` (the connection and the stream's settings).

use super::{NatsConfig, NatsSink};
use crate::diagnostics::{CheckLine, Level};
use crate::sink::registry::{self, Descriptor};
use crate::sink::template::Template;
use crate::sink::{AnySink, SinkContext, SinkDsn, SinkKind, SinkOptions};
use futures::future::LocalBoxFuture;

pub const DESCRIPTOR: Descriptor = Descriptor {
    kind: SinkKind::Nats,
    name: "nats",
    words: &[],
    schemes: &["nats", "tls"],
    example: "nats://host:4222",
    is_url: true,
    build: |dsn, o, ctx| {
        Ok(AnySink::Nats(Box::new(NatsSink::new(config(
            dsn.url(),
            o,
            ctx,
        ))?)))
    },
    check,
    columns: registry::no_columns,
    ignored: |o| {
        let p = &o.partitioning;
        (!p.header_counts.is_empty() && p.header_counts != [p.partitions]).then_some(
            "--group-partitions applies to a RabbitMQ sink: the NATS sink ignores it (subjects carry the relay's own partition)",
        )
    },
    password: registry::url_password,
};

/// What only the NATS sink reads (its stream is [`SinkOptions::stream`]).
#[derive(Debug, Clone)]
pub struct Options {
    pub subject: Template,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            subject: Template::parse(super::config::DEFAULT_SUBJECT)
                .expect("the default subject parses"),
        }
    }
}

/// The NATS sink's settings.
pub(crate) fn config(url: &str, o: &SinkOptions, ctx: &SinkContext<'_>) -> NatsConfig {
    NatsConfig {
        url: url.to_string(),
        subject: o.sinks.nats.subject.clone(),
        stream: o.stream.clone(),
        declare: o.declare,
        max_message_bytes: o.max_message_bytes,
        op_timeout: ctx.op_timeout,
        window: ctx.window,
        ca_file: o.tls.ca_file.clone(),
        cert_file: o.tls.cert_file.clone(),
        key_file: o.tls.key_file.clone(),
        connection_name: format!("outboxd {}", ctx.name),
        partitions: o.partitioning.partitions,
        headers: o.message.headers.clone(),
    }
}

/// `check` with a `nats://`/`tls://` sink: the connection and the stream's settings.
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
                "nats settings",
                e.to_string(),
                None,
            )];
        }
        super::declare::check(&cfg).await
    })
}
