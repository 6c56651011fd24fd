//! `outboxd check`: the preflight of the source (Postgres or MySQL/MariaDB), the RabbitMQ
//! sink (`topology::check_rabbitmq`), a NATS sink, a RabbitMQ stream sink and a Kafka sink, one
//! line per check.

use super::{
    postgres_only, resolve_dsn, resolve_source, topology, KafkaArgs, NatsArgs, RabbitStreamArgs,
    SourceArgs,
};
use crate::dsn::{SinkDsn, SourceDsn};
use crate::outbox::Mode;
use crate::sink::rabbitmq;
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use std::time::Duration;

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    #[command(flatten)]
    pub sink: topology::SinkCheckArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub rabbit_stream: RabbitStreamArgs,
    /// RabbitMQ stream sink: the management API the stream's retention is read from
    /// (http://user:password@host:15672; default: the sink's host, port 15672, its credentials).
    #[arg(long, env = "OUTBOXD_STREAM_MANAGEMENT_URL", hide_env_values = true)]
    pub stream_management_url: Option<crate::dsn::DsnArg>,
    #[command(flatten)]
    pub kafka: KafkaArgs,
    /// The routing key (Kafka: topic) template, as `run --routing-key` (default `{topic}`, with
    /// --column debezium `outbox.event.{aggregate_type}`): the columns it names must exist.
    #[arg(long, env = "OUTBOXD_ROUTING_KEY")]
    pub routing_key: Option<String>,
    /// As `run --header COLUMN=NAME`: the columns named must exist in the outbox table.
    #[arg(long = "header", env = "OUTBOXD_HEADER", value_delimiter = ',')]
    pub headers: Vec<String>,
    /// As `run --envelope-field COLUMN[=ALIAS]`: the columns named must exist.
    #[arg(
        long = "envelope-field",
        env = "OUTBOXD_ENVELOPE_FIELD",
        value_delimiter = ','
    )]
    pub envelope_fields: Vec<String>,
    /// Print the checks as JSON lines.
    #[arg(long, env = "OUTBOXD_JSON")]
    pub json: bool,
    /// Check for poll mode (MySQL/MariaDB: the status column, its index and the grants
    /// instead of the binlog).
    #[arg(long, env = "OUTBOXD_MODE", value_enum, default_value_t = Mode::Cdc)]
    pub mode: Mode,
    /// Postgres 17+: also check a physical standby (postgres://… DSN) for failover slots —
    /// its sync_replication_slots, hot_standby_feedback, primary_slot_name, the primary's
    /// synchronized_standby_slots, and the relay's slot synchronised there.
    #[arg(long, env = "OUTBOXD_STANDBY", hide_env_values = true)]
    pub standby: Option<crate::dsn::DsnArg>,
    /// MySQL/MariaDB: a replica the relay runs with --sync-replica (DSN; repeat, or separate by
    /// spaces in the environment): reachable, replicating by GTID with log_slave_updates, and
    /// how far it applied. Without it, check says whether replicas exist that a failover could
    /// promote.
    #[arg(
        long = "sync-replica",
        env = "OUTBOXD_SYNC_REPLICA",
        value_delimiter = ' ',
        hide_env_values = true
    )]
    pub sync_replicas: Vec<crate::dsn::DsnArg>,
}

pub(super) async fn check(args: CheckArgs, m: &ArgMatches) -> Result<(), Error> {
    let mut r = resolve_source(&args.source, m)?;
    // The table is checked against every column `run` would read with these flags.
    let kafka_sink = sink_url(&args, m, "sink")
        .ok()
        .flatten()
        .is_some_and(|u| matches!(SinkDsn::parse(&u), Ok(SinkDsn::Kafka(_))));
    r.columns = super::run::columns_named(
        &r.columns,
        args.routing_key.as_deref(),
        &args.sink.exchange,
        &args.headers,
        &args.envelope_fields,
        args.kafka
            .kafka_partition_column
            .as_deref()
            .filter(|_| kafka_sink),
    )?;
    let lines = if let SourceDsn::Mysql(dsn) = &r.source {
        let mut lines = Vec::new();
        for table in crate::source::mysql::log::outbox_tables(
            dsn,
            &r.tables,
            &r.columns,
            Default::default(),
        )? {
            let table_lines = crate::source::mysql::diagnostics::check_mysql(
                dsn,
                &r.name,
                &table,
                args.mode == Mode::Poll,
            )
            .await;
            // The server-wide lines once; each further table adds its own.
            let seen: Vec<String> = lines
                .iter()
                .map(|l: &crate::diagnostics::CheckLine| l.to_string())
                .collect();
            lines.extend(
                table_lines
                    .into_iter()
                    .filter(|l| !seen.contains(&l.to_string())),
            );
        }
        if args.mode == Mode::Cdc {
            let replicas = super::run::sync_replicas(&args.sync_replicas)?;
            lines.extend(
                crate::source::mysql::diagnostics::sync_replica_lines(dsn, &replicas).await,
            );
        }
        lines
    } else {
        if !args.sync_replicas.is_empty() {
            return Err(Error::config(
                "--sync-replica is for MySQL/MariaDB sources",
                "on Postgres give the physical standby with --standby",
            ));
        }
        let dsn = postgres_only(r.source, "check")?;
        let standby = match &args.standby {
            Some(s) => Some(postgres_only(SourceDsn::parse(s)?, "check --standby")?),
            None => None,
        };
        crate::source::postgres::diagnostics::check_postgres(
            &crate::source::postgres::diagnostics::PgTarget {
                dsn: &dsn,
                name: &r.name,
                tables: &r.tables,
                columns: &r.columns,
                slot: &r.slot,
                publication: &r.publication,
                standby: standby.as_ref(),
            },
        )
        .await
    };
    let mut lines = lines;
    lines.extend(topology::check_rabbitmq(&args.sink, m).await);
    lines.extend(check_nats(&args, m).await);
    lines.extend(check_rabbit_stream(&args, m).await);
    lines.extend(check_kafka(&args, m, &r.columns).await);
    for l in &lines {
        if args.json {
            println!("{}", serde_json::to_string(l).unwrap_or_default());
        } else {
            println!("{l}");
        }
    }
    let failed = lines
        .iter()
        .filter(|l| l.level == crate::diagnostics::Level::Fail)
        .count();
    if failed > 0 {
        return Err(Error::Other(format!(
            "{failed} check{} failed",
            if failed == 1 { "" } else { "s" }
        )));
    }
    Ok(())
}

/// The sink URL of `check`, when there is one; an unreadable one is a failed line.
fn sink_url(
    args: &CheckArgs,
    m: &ArgMatches,
    check: &str,
) -> Result<Option<String>, Vec<crate::diagnostics::CheckLine>> {
    let from_argv = m.value_source("sink") == Some(ValueSource::CommandLine);
    resolve_dsn(
        args.sink.sink.as_deref(),
        args.sink.sink_file.as_deref(),
        from_argv,
        "sink",
    )
    .map_err(|e| vec![fail_line(check, e.to_string())])
}

fn fail_line(check: &str, detail: String) -> crate::diagnostics::CheckLine {
    crate::diagnostics::CheckLine {
        level: crate::diagnostics::Level::Fail,
        check: check.into(),
        detail,
        fix: None,
    }
}

/// `check` with a `rabbitmq-stream://` sink: the stream port, each stream and its retention.
async fn check_rabbit_stream(
    args: &CheckArgs,
    m: &ArgMatches,
) -> Vec<crate::diagnostics::CheckLine> {
    let url = match sink_url(args, m, "stream settings") {
        Ok(Some(u)) => u,
        Ok(None) => return Vec::new(),
        Err(lines) => return lines,
    };
    let Ok(SinkDsn::RabbitStream(url)) = SinkDsn::parse(&url) else {
        return Vec::new();
    };
    let partitioning = match args.sink.partitions.validate() {
        Ok(p) => p,
        Err(e) => return vec![fail_line("stream settings", e.to_string())],
    };
    let retention = args.rabbit_stream.options();
    let cfg = crate::sink::rabbitmq_stream::StreamSinkConfig {
        url: url.clone(),
        stream: args.nats.stream.clone(),
        declare: args.sink.declare,
        max_bytes: retention.max_bytes,
        max_age: retention.max_age,
        op_timeout: Duration::from_secs(15),
        relay_name: "check".into(),
        message: rabbitmq::RabbitConfig {
            url,
            exchange: args.sink.exchange.clone(),
            declare: args.sink.declare,
            max_message_bytes: rabbitmq::DEFAULT_MAX_MESSAGE_BYTES,
            op_timeout: Duration::from_secs(15),
            ca_file: args.sink.sink_ca.clone(),
            cert_file: args.sink.sink_cert.clone(),
            key_file: args.sink.sink_key.clone(),
            connection_name: "outboxd check".into(),
            partitioning,
            dead_queue_type: args.sink.dead_queue_type,
            message: Default::default(),
        },
    };
    match crate::sink::rabbitmq_stream::RabbitStreamSink::new(cfg) {
        Ok(sink) => sink.check(args.stream_management_url.as_deref()).await,
        Err(e) => vec![fail_line("stream settings", e.to_string())],
    }
}

/// `check` with a `nats://`/`tls://` sink: the connection and the stream's settings.
async fn check_nats(args: &CheckArgs, m: &ArgMatches) -> Vec<crate::diagnostics::CheckLine> {
    let fail = |detail: String| fail_line("nats settings", detail);
    let url = match sink_url(args, m, "nats settings") {
        Ok(Some(u)) => u,
        Ok(None) => return Vec::new(),
        Err(lines) => return lines,
    };
    let Ok(SinkDsn::Nats(url)) = SinkDsn::parse(&url) else {
        return Vec::new();
    };
    let opts = match args.nats.options() {
        Ok(o) => o,
        Err(e) => return vec![fail(e.to_string())],
    };
    let partitions = match args.sink.partitions.validate() {
        Ok(p) => p.partitions,
        Err(e) => return vec![fail(e.to_string())],
    };
    let cfg = crate::sink::nats::NatsConfig {
        url,
        subject: opts.subject,
        stream: args.nats.stream.clone(),
        declare: args.sink.declare,
        max_message_bytes: rabbitmq::DEFAULT_MAX_MESSAGE_BYTES,
        op_timeout: Duration::from_secs(15),
        window: 1,
        ca_file: args.sink.sink_ca.clone(),
        cert_file: args.sink.sink_cert.clone(),
        key_file: args.sink.sink_key.clone(),
        connection_name: "outboxd check".into(),
        partitions,
        headers: Vec::new(),
    };
    if let Err(e) = cfg.validate() {
        return vec![fail(e.to_string())];
    }
    crate::sink::nats::declare::check(&cfg).await
}

/// `check` with a `kafka://`/`kafkas://` sink: the brokers, idempotence and the topics.
async fn check_kafka(
    args: &CheckArgs,
    m: &ArgMatches,
    columns: &crate::outbox::ColumnMap,
) -> Vec<crate::diagnostics::CheckLine> {
    let fail = |detail: String| vec![fail_line("kafka settings", detail)];
    let url = match sink_url(args, m, "kafka settings") {
        Ok(Some(u)) => u,
        Ok(None) => return Vec::new(),
        Err(lines) => return lines,
    };
    let Ok(SinkDsn::Kafka(url)) = SinkDsn::parse(&url) else {
        return Vec::new();
    };
    let routing_key = match super::run::routing_template(args.routing_key.as_deref(), columns) {
        Ok(t) => t,
        Err(e) => return fail(e.to_string()),
    };
    let cfg = crate::sink::kafka::KafkaConfig {
        url,
        name: "check".into(),
        options: args.kafka.options(),
        message: crate::sink::format::MessageOptions {
            routing_key,
            ..Default::default()
        },
        declare: args.sink.declare,
        op_timeout: Duration::from_secs(15),
        ca_file: args.sink.sink_ca.clone(),
        cert_file: args.sink.sink_cert.clone(),
        key_file: args.sink.sink_key.clone(),
    };
    if let Err(e) = cfg.validate() {
        return fail(e.to_string());
    }
    crate::sink::kafka::check::check(&cfg).await
}
