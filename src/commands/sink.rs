//! The sink's flags, shared by `run` and `check` (`SinkArgs`): the ones every sink reads (the
//! message's shape, `--declare`, the TLS files, `--partitions`, `--stream`, the exchange) and,
//! flattened in, each sink's own (`sink::SinkFlags`, generated from the sink registry). Both
//! commands turn them into the same `SinkOptions` and column map here, so what `check` probes
//! is what `run` builds.

use super::{parse_bytes, PartitionArgs};
use crate::outbox::ColumnMap;
use crate::sink::format::{self, BodyFormat, MessageOptions};
use crate::sink::options::{SinkOptions, TlsFiles};
use crate::sink::template::Template;
use crate::sink::{DeclareMode, SinkDsn, SinkFlags};
use crate::Error;
use clap::Args;
use std::path::PathBuf;

/// The sink settings of `run` and `check` (docs/message-format.md, docs/configuration.md).
#[derive(Debug, Clone, Args)]
pub struct SinkArgs {
    /// Topic exchange events are published to (also names <exchange>.unrouted and <exchange>.dead);
    /// a template over the row's columns (e.g. `{aggregate_type}.events`) routes each row to its
    /// own exchange, declared under --declare auto (dead records then go to <base-exchange>.dead).
    #[arg(long, env = "OUTBOXD_EXCHANGE", default_value = "outbox")]
    pub exchange: String,
    /// With a templated --exchange: the exchange whose .dead queue takes records that cannot be
    /// published (and whose topology the relay declares at start).
    #[arg(long, env = "OUTBOXD_BASE_EXCHANGE", default_value = "outbox")]
    pub base_exchange: String,
    /// Routing key template over the row's columns (default `{topic}`; with --column debezium
    /// `outbox.event.{aggregate_type}`), e.g. `{tenant_id}.{topic}`; the Kafka sink's topic.
    #[arg(long, env = "OUTBOXD_ROUTING_KEY")]
    pub routing_key: Option<String>,
    /// Copy a column's value into a message header: COLUMN=NAME (repeat it, or comma
    /// separate), e.g. traceparent=traceparent. A NULL value sets no header.
    #[arg(long = "header", env = "OUTBOXD_HEADER", value_delimiter = ',')]
    pub headers: Vec<String>,
    /// Place a column beside the payload in the body, as Debezium's `col:envelope:alias`:
    /// COLUMN or COLUMN=ALIAS (repeat it, or comma separate). The body becomes
    /// {"payload": <payload>, "<alias>": <value>, …}; needs --format raw.
    #[arg(
        long = "envelope-field",
        env = "OUTBOXD_ENVELOPE_FIELD",
        value_delimiter = ','
    )]
    pub envelope_fields: Vec<String>,
    /// Message body: raw (the payload), envelope (JSON with id, aggregate, topic, payload,
    /// created_at, position), cloudevents (structured, application/cloudevents+json) or
    /// cloudevents-binary (the payload, with cloudEvents:* headers).
    #[arg(long, env = "OUTBOXD_FORMAT", value_enum, default_value_t = BodyFormat::Raw)]
    pub format: BodyFormat,
    /// CloudEvents `source` attribute (a template, e.g. `/orders/{aggregate_type}`).
    #[arg(long, env = "OUTBOXD_CLOUDEVENTS_SOURCE", default_value = "/outboxd")]
    pub cloudevents_source: String,
    /// Content type of payloads in text or binary columns (bytea, BLOB, TEXT): they are then
    /// published as bytes instead of being checked as JSON (a `content_type` column mapped
    /// with --column content_type=<column> overrides it per row).
    #[arg(long, env = "OUTBOXD_PAYLOAD_CONTENT_TYPE")]
    pub payload_content_type: Option<String>,
    /// auto: declare the topology; passive: only check it exists; off: check nothing. For
    /// `check`: with auto, something missing is a warning (the relay declares it), with
    /// passive a failure.
    #[arg(long, env = "OUTBOXD_DECLARE", value_enum, default_value_t = DeclareMode::Auto)]
    pub declare: DeclareMode,
    /// Larger payloads go to <exchange>.dead as a record without the body (e.g. 16MiB, 512KiB, 4096).
    #[arg(long, env = "OUTBOXD_MAX_MESSAGE_BYTES", value_parser = parse_bytes, default_value = "16MiB")]
    pub max_message_bytes: usize,
    /// PEM CA certificate for a TLS sink (amqps://, tls://, kafkas://, rabbitmq-stream+tls://):
    /// replaces the public roots (pins a private CA).
    #[arg(long, env = "OUTBOXD_SINK_CA")]
    pub sink_ca: Option<PathBuf>,
    /// PEM client certificate for a TLS sink (needs --sink-key).
    #[arg(long, env = "OUTBOXD_SINK_CERT")]
    pub sink_cert: Option<PathBuf>,
    /// PEM private key of --sink-cert.
    #[arg(long, env = "OUTBOXD_SINK_KEY")]
    pub sink_key: Option<PathBuf>,
    #[command(flatten)]
    pub partitions: PartitionArgs,
    /// NATS sink: the JetStream stream (declared with --declare auto, checked with passive);
    /// RabbitMQ stream sink: the stream (with --partitions N: <stream>-0 … <stream>-<N-1>).
    #[arg(long, env = "OUTBOXD_STREAM", default_value = crate::sink::options::DEFAULT_STREAM)]
    pub stream: String,
    #[command(flatten)]
    pub sinks: SinkFlags,
}

/// `--routing-key` parsed, or its default: `{topic}`, and with `--column debezium` the topic
/// Debezium's Outbox Event Router uses, `outbox.event.{aggregate_type}`.
pub fn routing_template(text: Option<&str>, columns: &ColumnMap) -> Result<Template, Error> {
    match text {
        Some(t) => Template::parse(t)
            .map_err(|e| Error::config(format!("--routing-key: {e}"), TEMPLATE_FIX)),
        None if columns.is_debezium() => {
            Ok(Template::parse("outbox.event.{aggregate_type}").expect("valid"))
        }
        None => Ok(Template::parse("{topic}").expect("valid")),
    }
}

const TEMPLATE_FIX: &str = "write placeholders as {column}, e.g. {topic} or {aggregate_type}.{topic} ({{ and }} for literal braces)";

impl SinkArgs {
    /// The message options (templates parsed, header names checked) and the column map
    /// extended by the columns they read.
    pub fn message(&self, mut columns: ColumnMap) -> Result<(MessageOptions, ColumnMap), Error> {
        let template = |flag: &str, text: &str| {
            Template::parse(text).map_err(|e| Error::config(format!("{flag}: {e}"), TEMPLATE_FIX))
        };
        let routing_key = routing_template(self.routing_key.as_deref(), &columns)?;
        let exchange = template("--exchange", &self.exchange)?;
        let mut headers = format::parse_column_headers(&self.headers)?;
        // Debezium's event router puts the event id in the header `id`.
        if columns.is_debezium() && !headers.iter().any(|h| h.name.eq_ignore_ascii_case("id")) {
            headers.push(format::ColumnHeader {
                column: "id".into(),
                name: "id".into(),
            });
        }
        let envelope_fields = format::parse_envelope_fields(&self.envelope_fields)?;
        if !envelope_fields.is_empty() && self.format != BodyFormat::Raw {
            return Err(Error::config(
                format!("--envelope-field places columns beside the payload of --format raw; --format {:?} has a body of its own", self.format),
                "drop --format (raw is the default), or drop --envelope-field and use --header for the columns",
            ));
        }
        let message = MessageOptions {
            routing_key,
            exchange: (!exchange.is_constant()).then_some(exchange),
            headers,
            format: self.format,
            ce_source: template("--cloudevents-source", &self.cloudevents_source)?,
            envelope_fields,
        };
        for name in message.columns() {
            columns.require_extra(name, true);
        }
        // The aggregate's type, when the table has the column: the `x-aggregate-type` header
        // (consumers key the stale gate on type and id) and the envelope's aggregate.type.
        columns.require_extra(crate::outbox::Column::AggregateType.name(), false);
        if let Some(ct) = &self.payload_content_type {
            if ct.trim().is_empty() || ct.len() > 255 || ct.chars().any(|c| c.is_control()) {
                return Err(Error::config(
                    format!("--payload-content-type {ct:?} is not a content type"),
                    "write e.g. --payload-content-type text/plain or application/octet-stream",
                ));
            }
        }
        columns.set_payload_content_type(self.payload_content_type.as_deref().map(str::trim));
        Ok((message, columns))
    }

    /// Every sink's settings, with `message` from [`SinkArgs::message`].
    pub fn options(&self, message: MessageOptions) -> Result<SinkOptions, Error> {
        let partitioning = self.partitions.validate()?;
        let exchange = if message.exchange.is_some() {
            if partitioning.partitions > 0 {
                return Err(Error::config(
                    "--partitions needs one exchange to feed its partition layout; --exchange is a template",
                    "use a constant --exchange with --partitions, or route by --routing-key instead",
                ));
            }
            self.base_exchange.clone()
        } else {
            self.exchange.clone()
        };
        crate::sink::rabbitmq::validate_exchange(&exchange)?;
        Ok(SinkOptions {
            declare: self.declare,
            max_message_bytes: self.max_message_bytes,
            tls: TlsFiles {
                ca_file: self.sink_ca.clone(),
                cert_file: self.sink_cert.clone(),
                key_file: self.sink_key.clone(),
            },
            partitioning,
            message,
            stream: self.stream.clone(),
            exchange,
            sinks: self.sinks.options()?,
        })
    }
}

/// `columns` extended by the columns the sink `dsn` names reads of its own (the Kafka
/// partition column), so `run` maps them and `check` checks the table has them.
pub fn sink_columns(
    dsn: &SinkDsn,
    options: &SinkOptions,
    mut columns: ColumnMap,
) -> Result<ColumnMap, Error> {
    for name in (dsn.descriptor().columns)(options)? {
        columns.require_extra(&name, true);
    }
    Ok(columns)
}

#[cfg(test)]
mod tests {
    use super::super::{Cli, Command};
    use super::*;
    use clap::Parser;

    /// The sink flags of `run` and of `check`, parsed from the same words.
    fn both(flags: &[&str]) -> (SinkArgs, SinkArgs) {
        let parse = |cmd: &str| {
            let argv: Vec<&str> = ["outboxd", cmd]
                .into_iter()
                .chain(flags.iter().copied())
                .collect();
            match Cli::try_parse_from(argv).expect("parses").command {
                Command::Run(a) => a.sink_args,
                Command::Check(a) => a.sink_args,
                _ => unreachable!(),
            }
        };
        (parse("run"), parse("check"))
    }

    /// What `check` probes is what `run` builds: the same flags give the same settings and the
    /// same column map, and a setting `run` refuses is refused for `check` too.
    #[test]
    fn run_and_check_build_the_same_sink_settings() {
        let columns = ColumnMap::parse(&["debezium".into()]).unwrap();
        for flags in [
            &[][..],
            &[
                "--exchange",
                "{aggregate_type}.events",
                "--base-exchange",
                "events",
            ],
            &[
                "--header",
                "tenant=x-tenant",
                "--format",
                "envelope",
                "--declare",
                "passive",
            ],
            &[
                "--partitions",
                "4",
                "--group-partitions",
                "8",
                "--stream",
                "S",
                "--subject",
                "o.{topic}",
            ],
            &[
                "--kafka-partition-column",
                "shard",
                "--kafka-dead-topic",
                "dead",
                "--stream-max-age",
                "7d",
            ],
        ] {
            let (run, check) = both(flags);
            let (run_msg, run_cols) = run.message(columns.clone()).unwrap();
            let (check_msg, check_cols) = check.message(columns.clone()).unwrap();
            assert_eq!(run_cols, check_cols, "{flags:?}");
            let run_opts = run.options(run_msg).unwrap();
            let check_opts = check.options(check_msg).unwrap();
            assert_eq!(
                format!("{run_opts:?}"),
                format!("{check_opts:?}"),
                "{flags:?}"
            );
        }
        // A templated exchange is published through --base-exchange, for `check` as for `run`.
        let (_, check) = both(&["--exchange", "{aggregate_type}.events"]);
        let (msg, _) = check.message(columns.clone()).unwrap();
        assert_eq!(check.options(msg).unwrap().exchange, "outbox");
        for bad in [
            &["--partitions", "4", "--exchange", "{aggregate_type}.x"][..],
            &["--subject", "{unclosed"],
        ] {
            let (run, check) = both(bad);
            let run_err = run
                .message(columns.clone())
                .and_then(|(m, _)| run.options(m))
                .unwrap_err()
                .to_string();
            let check_err = check
                .message(columns.clone())
                .and_then(|(m, _)| check.options(m))
                .unwrap_err()
                .to_string();
            assert_eq!(run_err, check_err, "{bad:?}");
        }
    }
}
