//! The RabbitMQ stream sink in the sink registry: `rabbitmq-stream://` and
//! `rabbitmq-stream+tls://`, its retention flags, its settings built from the shared ones for
//! `run` and `check` alike (its messages rendered with the AMQP sink's settings), and the
//! checks of `outboxd check` (the stream port, each stream and its retention).

use super::{RabbitStreamSink, StreamSinkConfig};
use crate::diagnostics::{CheckLine, Level};
use crate::sink::registry::{self, Descriptor};
use crate::sink::{AnySink, SinkContext, SinkDsn, SinkKind, SinkOptions};
use futures::future::LocalBoxFuture;
use std::time::Duration;

pub const DESCRIPTOR: Descriptor = Descriptor {
    kind: SinkKind::RabbitStream,
    name: "rabbitmq-stream",
    words: &[],
    schemes: &["rabbitmq-stream", "rabbitmq-stream+tls"],
    example: "rabbitmq-stream://user@host:5552/%2f",
    is_url: true,
    build: |dsn, o, ctx| {
        Ok(AnySink::RabbitStream(Box::new(RabbitStreamSink::new(
            config(dsn.url(), o, ctx),
        )?)))
    },
    check,
    columns: registry::no_columns,
    ignored: registry::ignores_nothing,
    password: registry::url_password,
};

/// What only the RabbitMQ stream sink reads (its stream is [`SinkOptions::stream`]).
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Retention of a stream it creates (`--declare auto`).
    pub max_bytes: Option<u64>,
    pub max_age: Option<Duration>,
    /// `check --stream-management-url`: the management API the retention is read from.
    pub management_url: Option<String>,
}

/// The stream sink's settings.
pub(crate) fn config(url: &str, o: &SinkOptions, ctx: &SinkContext<'_>) -> StreamSinkConfig {
    StreamSinkConfig {
        url: url.to_string(),
        stream: o.stream.clone(),
        declare: o.declare,
        max_bytes: o.sinks.rabbitmq_stream.max_bytes,
        max_age: o.sinks.rabbitmq_stream.max_age,
        op_timeout: ctx.op_timeout,
        relay_name: ctx.name.to_string(),
        message: crate::sink::rabbitmq::registry::config(url, o, ctx),
    }
}

/// `check` with a `rabbitmq-stream://` sink: the stream port, each stream and its retention.
fn check<'a>(
    dsn: &'a SinkDsn,
    o: &'a SinkOptions,
    ctx: &'a SinkContext<'a>,
) -> LocalBoxFuture<'a, Vec<CheckLine>> {
    Box::pin(async move {
        match RabbitStreamSink::new(config(dsn.url(), o, ctx)) {
            Ok(sink) => {
                sink.check(o.sinks.rabbitmq_stream.management_url.as_deref())
                    .await
            }
            Err(e) => vec![crate::diagnostics::line(
                Level::Fail,
                "stream settings",
                e.to_string(),
                None,
            )],
        }
    })
}
