//! `outboxd run` (and the flags `config` prints): the relay's flags — the sink (its settings
//! through `commands::sink`, as `check` reads them), the window, recovery, poll mode, the MySQL
//! settings — turned into a `RunConfig`, then the pipeline for the source and mode.

use super::sink::{sink_columns, SinkArgs};
use super::{parse_bytes, parse_duration, resolve_dsn, resolve_source, SourceArgs};
use crate::dsn::SourceDsn;
use crate::outbox::Mode;
use crate::pipeline::{self, RunConfig, RunPlan};
use crate::relay::RelayOptions;
use crate::sink::SinkDsn;
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Sink: stdout, amqp://user@host:5672/vhost (amqps:// for TLS), NATS JetStream
    /// nats://host:4222 (tls:// for TLS), Kafka kafka://host:9092[,host:9092…] (kafkas:// for
    /// TLS; user:password@ for SASL), or a RabbitMQ stream rabbitmq-stream://user@host:5552/vhost.
    #[arg(
        long,
        env = "OUTBOXD_SINK",
        hide_env_values = true,
        default_value = "stdout"
    )]
    pub sink: crate::dsn::DsnArg,
    /// File holding the sink URL, or only its password.
    #[arg(long, env = "OUTBOXD_SINK_FILE")]
    pub sink_file: Option<std::path::PathBuf>,
    /// cdc (read the database log) or poll (query the table).
    #[arg(long, env = "OUTBOXD_MODE", value_enum, default_value_t = Mode::Cdc)]
    pub mode: Mode,
    /// With the stdout sink: store the position (otherwise trying stdout never moves it).
    #[arg(long, env = "OUTBOXD_COMMIT_OFFSETS")]
    pub commit_offsets: bool,
    /// Most bytes of events between source read and sink confirmation.
    #[arg(long, env = "OUTBOXD_MAX_INFLIGHT_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub max_inflight_bytes: usize,
    /// Most events published and not yet confirmed.
    #[arg(long, env = "OUTBOXD_WINDOW", default_value_t = crate::relay::DEFAULT_WINDOW)]
    pub window: usize,
    /// A broker confirmation that takes longer is a failure (reconnect, republish).
    #[arg(long, env = "OUTBOXD_CONFIRM_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub confirm_timeout: Duration,
    /// When the log position cannot be resumed (slot dropped or invalidated): fail (exit 3) or
    /// poll (open a fresh position and publish again from the table every row committed after
    /// the last confirmed event).
    #[arg(long, env = "OUTBOXD_ON_POSITION_LOST", value_enum, default_value_t = pipeline::PositionLostPolicy::Fail)]
    pub on_position_lost: pipeline::PositionLostPolicy,
    /// Recovery through the table: replay rows created since this RFC 3339 time instead of the
    /// computed one.
    #[arg(long, env = "OUTBOXD_REPLAY_SINCE")]
    pub replay_since: Option<String>,
    /// Recovery through the table: the smallest margin subtracted from the last confirmed
    /// commit time (the largest commit-vs-created_at gap seen is used when larger).
    #[arg(long, env = "OUTBOXD_RECOVERY_MARGIN", value_parser = parse_duration, default_value = "10m")]
    pub recovery_margin: Duration,
    /// High availability: relays with the same --name share one lease; the others wait as
    /// standbys and take over when it expires.
    #[arg(long, env = "OUTBOXD_HA")]
    pub ha: bool,
    /// Deduplicating sinks (Kafka, RabbitMQ stream): the relay's last record there came from
    /// another database (restored or moved to another server on purpose); go on, recognising
    /// what the broker holds only by each event's exact identity. Without it the relay stops
    /// and says so. Needed once, for the first start after the move.
    #[arg(long, env = "OUTBOXD_ACCEPT_NEW_SOURCE")]
    pub accept_new_source: bool,
    /// Serve /metrics, /healthz and /readyz on HOST:PORT (default off).
    #[arg(long, env = "OUTBOXD_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Poll mode: how long to wait before polling again after a batch that was not full.
    #[arg(long, env = "OUTBOXD_POLL_INTERVAL", value_parser = parse_duration, default_value = "200ms")]
    pub poll_interval: Duration,
    /// Poll mode: most rows claimed per batch (one short transaction each); up to three batches
    /// are in flight at once, each on its own database session.
    #[arg(long, env = "OUTBOXD_POLL_BATCH", default_value_t = 500)]
    pub poll_batch: i64,
    /// Poll mode on Postgres: LISTEN for the trigger `setup --notify` installs and poll at once
    /// when rows are committed.
    #[arg(long, env = "OUTBOXD_NOTIFY")]
    pub notify: bool,
    /// First start: which rows already in the table to publish (auto, all, never,
    /// since=RFC3339). With `auto`, a status column selects pending rows; without one, a
    /// non-empty table needs a choice.
    #[arg(long, env = "OUTBOXD_SNAPSHOT", default_value = "auto")]
    pub snapshot: String,
    /// Bound on the graceful stop after SIGINT/SIGTERM.
    #[arg(long, env = "OUTBOXD_SHUTDOWN_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub shutdown_timeout: Duration,
    #[command(flatten)]
    pub sink_args: SinkArgs,
    #[command(flatten)]
    pub mysql: MySqlArgs,
}

/// MySQL/MariaDB source settings.
#[derive(Debug, Clone, Args)]
pub struct MySqlArgs {
    /// Zone of the outbox's DATETIME values (UTC, +02:00, Europe/Berlin); TIMESTAMP needs none.
    #[arg(long, env = "OUTBOXD_SOURCE_TIME_ZONE", default_value = "UTC")]
    pub source_time_zone: String,
    /// Largest transaction (bytes of outbox rows) held until its commit; a larger one is read
    /// twice (once to find its end position, once to stream it).
    #[arg(long, env = "OUTBOXD_TXN_BUFFER", default_value_t = 16 * 1024 * 1024)]
    pub txn_buffer: usize,
    /// Largest uncompressed size a MySQL 8 compressed transaction (TRANSACTION_PAYLOAD) may
    /// declare; a larger one stops the relay (e.g. 256MiB, 1GiB).
    #[arg(long, env = "OUTBOXD_MAX_TXN_PAYLOAD_BYTES", value_parser = parse_bytes, default_value = "256MiB")]
    pub max_txn_payload_bytes: usize,
    /// Keep the position (and the lease, as a lock on PATH.lock) in this file instead of the
    /// outboxd_state table.
    #[arg(long, env = "OUTBOXD_OFFSET_FILE", value_name = "PATH")]
    pub offset_file: Option<std::path::PathBuf>,
    /// How long a prepared XA transaction with outbox rows may hold the stored position back
    /// (each restart meanwhile publishes again everything since its prepare); then
    /// --xa-prepare-expired applies.
    #[arg(long, env = "OUTBOXD_XA_PREPARE_LIMIT", value_parser = parse_duration, default_value = "1h")]
    pub xa_prepare_limit: Duration,
    /// What happens to a prepared XA transaction older than --xa-prepare-limit.
    #[arg(long, env = "OUTBOXD_XA_PREPARE_EXPIRED", value_enum, default_value_t = crate::source::mysql::xa_pin::XaExpired::Stop)]
    pub xa_prepare_expired: crate::source::mysql::xa_pin::XaExpired,
    /// A replica (mysql://… or mariadb://… DSN; repeat, or separate by spaces in the
    /// environment) that must have applied a transaction before its events are published, so
    /// a failover to it never rolls back a published event.
    #[arg(
        long = "sync-replica",
        env = "OUTBOXD_SYNC_REPLICA",
        value_delimiter = ' ',
        hide_env_values = true
    )]
    pub sync_replicas: Vec<crate::dsn::DsnArg>,
}

/// The `--sync-replica` DSNs, each a MySQL/MariaDB one.
pub fn sync_replicas(args: &[crate::dsn::DsnArg]) -> Result<Vec<crate::dsn::DbDsn>, Error> {
    args.iter()
        .filter(|a| !a.trim().is_empty())
        .map(|a| match SourceDsn::parse(a)? {
            SourceDsn::Mysql(d) => Ok(d),
            _ => Err(Error::config(
                "--sync-replica takes a MySQL/MariaDB DSN",
                "name each replica as mysql://user@host:3306/db (or mariadb://…)",
            )),
        })
        .collect()
}

pub(super) async fn run(
    args: RunArgs,
    m: &ArgMatches,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    if let Some(addr) = &args.metrics_addr {
        crate::telemetry::serve(addr).await?;
    }
    let plan = plan(&args, m)?;
    let stats = plan.run(shutdown).await?;
    tracing::info!(
        published = stats.published.load(std::sync::atomic::Ordering::Relaxed),
        confirmed = stats.confirmed.load(std::sync::atomic::Ordering::Relaxed),
        "stopped"
    );
    Ok(())
}

/// `run`'s flags as a validated plan (the sink built once to check its settings; nothing
/// connects). `outboxd fleet` makes each source's plan through here.
pub(super) fn plan(args: &RunArgs, m: &ArgMatches) -> Result<RunPlan, Error> {
    let r = resolve_source(&args.source, m)?;
    crate::tls::warn_if_unverified_source(&r.source);
    let sink_from_argv = m.value_source("sink") == Some(ValueSource::CommandLine);
    let sink = resolve_dsn(
        Some(&args.sink),
        args.sink_file.as_deref(),
        sink_from_argv,
        "sink",
    )?
    .unwrap_or_else(|| "stdout".into());
    let sink = SinkDsn::parse(&sink)?;
    if let Some(w) = crate::tls::plaintext_amqp_warning(sink.url()) {
        tracing::warn!("{w}");
    }
    if args.window == 0 {
        return Err(Error::config(
            "--window 0 would never publish",
            "use --window 5000 (the default)",
        ));
    }
    let (message, columns) = args.sink_args.message(r.columns.clone())?;
    let sink_options = args.sink_args.options(message)?;
    let columns = sink_columns(&sink, &sink_options, columns)?;
    let postgres = crate::source::postgres::log::PgOptions {
        slot: r.slot,
        publication: r.publication,
    };
    let cfg = RunConfig {
        sink_options,
        name: r.name,
        tables: r.tables,
        columns,
        sink,
        commit_offsets: args.commit_offsets,
        max_inflight_bytes: args.max_inflight_bytes,
        relay: RelayOptions {
            window: args.window,
            confirm_timeout: args.confirm_timeout,
            ..RelayOptions::default()
        },
        snapshot: crate::source::postgres::snapshot::SnapshotMode::parse(&args.snapshot)?,
        on_position_lost: args.on_position_lost,
        replay_since: match &args.replay_since {
            None => None,
            Some(t) => Some(
                chrono::DateTime::parse_from_rfc3339(t.trim())
                    .map_err(|e| {
                        Error::config(
                            format!("--replay-since {t}: {e}"),
                            "write e.g. 2026-06-22T10:00:00Z",
                        )
                    })?
                    .with_timezone(&chrono::Utc),
            ),
        },
        recovery_margin: args.recovery_margin,
        ha: args.ha,
        accept_new_source: args.accept_new_source,
    };
    let mysql = crate::source::mysql::log::MySqlOptions {
        time_zone: crate::source::mysql::rows::SourceTz::parse(&args.mysql.source_time_zone)?,
        txn_buffer_bytes: args.mysql.txn_buffer.max(1),
        max_payload_bytes: args.mysql.max_txn_payload_bytes as u64,
        offset_file: args.mysql.offset_file.clone(),
        xa_prepare_limit: args.mysql.xa_prepare_limit,
        xa_prepare_expired: args.mysql.xa_prepare_expired,
        sync_replicas: sync_replicas(&args.mysql.sync_replicas)?,
        ..Default::default()
    };
    if matches!(r.source, SourceDsn::Postgres(_)) && !args.mysql.sync_replicas.is_empty() {
        return Err(Error::config(
            "--sync-replica is for MySQL/MariaDB sources",
            "on Postgres set synchronized_standby_slots on the primary (docs/operations.md, failover per version), and remove --sync-replica",
        ));
    }
    if matches!(r.source, SourceDsn::Postgres(_)) && args.mysql.offset_file.is_some() {
        return Err(Error::config(
            "--offset-file is for MySQL/MariaDB sources: a Postgres relay's position is its replication slot's confirmed_flush_lsn, which the server keeps",
            "remove --offset-file",
        ));
    }
    if args.mode == Mode::Poll && args.poll_batch < 1 {
        return Err(Error::config(
            "--poll-batch must be at least 1",
            "use --poll-batch 500",
        ));
    }
    let poll = crate::source::poll::PollOptions {
        batch: args.poll_batch,
        interval: args.poll_interval,
        notify: args.notify,
    };
    if matches!(r.source, SourceDsn::File(_)) && args.mode == Mode::Poll {
        return Err(Error::config(
            "poll mode queries a database table; a binlog-file source has none",
            "drop --mode poll to replay the files, or poll the database: --source mysql://…",
        ));
    }
    pipeline::check_sink(&cfg)?;
    Ok(RunPlan {
        source: r.source,
        mode: args.mode,
        cfg,
        postgres,
        mysql,
        poll,
    })
}
