//! `outboxd check`: the preflight of the source (Postgres or MySQL/MariaDB) and of the sink
//! `--sink` names (its descriptor's `check`, on the settings `run` would build), one line per
//! check.

use super::sink::{sink_columns, SinkArgs};
use super::{postgres_only, resolve_dsn, resolve_source, SourceArgs};
use crate::diagnostics::{CheckLine, Level};
use crate::dsn::SourceDsn;
use crate::outbox::Mode;
use crate::sink::{SinkContext, SinkDsn, SinkOptions};
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use std::path::PathBuf;

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Also check this sink (as `run --sink`); without it (or with stdout) no sink is checked.
    #[arg(long, env = "OUTBOXD_SINK", hide_env_values = true)]
    pub sink: Option<crate::dsn::DsnArg>,
    /// File holding the sink URL, or only its password.
    #[arg(long, env = "OUTBOXD_SINK_FILE")]
    pub sink_file: Option<PathBuf>,
    #[command(flatten)]
    pub sink_args: SinkArgs,
    #[cfg(feature = "rabbitmq-stream")]
    /// RabbitMQ stream sink: the management API the stream's retention is read from
    /// (http://user:password@host:15672; default: the sink's host, port 15672, its credentials).
    #[arg(long, env = "OUTBOXD_STREAM_MANAGEMENT_URL", hide_env_values = true)]
    pub stream_management_url: Option<crate::dsn::DsnArg>,
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
    // The sink's settings as `run` builds them: the table is checked against every column
    // `run` would read with these flags, and the sink is probed as `run` would use it.
    let (message, columns) = args.sink_args.message(r.columns.clone())?;
    let mut sink_lines = Vec::new();
    let sink = match sink_dsn(&args, m) {
        Ok(sink) => sink,
        Err(line) => {
            sink_lines.push(line);
            None
        }
    };
    let sink = match (sink, args.sink_args.options(message)) {
        (Some(dsn), Ok(options)) => {
            r.columns = sink_columns(&dsn, &options, columns)?;
            #[cfg(feature = "rabbitmq-stream")]
            let options = {
                let mut options = options;
                options.sinks.rabbitmq_stream.management_url =
                    args.stream_management_url.as_deref().map(str::to_string);
                options
            };
            Some((dsn, options))
        }
        (Some(dsn), Err(e)) => {
            r.columns = columns;
            sink_lines.push(fail_line(
                &format!("{} settings", dsn.descriptor().name),
                e.to_string(),
            ));
            None
        }
        (None, _) => {
            r.columns = columns;
            None
        }
    };
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
    lines.extend(sink_lines);
    if let Some((dsn, options)) = &sink {
        lines.extend(check_sink(dsn, options).await);
    }
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

/// The sink of `check`, when one is given (stdout has nothing to check); an unreadable or unknown one is a
/// failed line.
fn sink_dsn(args: &CheckArgs, m: &ArgMatches) -> Result<Option<SinkDsn>, CheckLine> {
    let from_argv = m.value_source("sink") == Some(ValueSource::CommandLine);
    let url = resolve_dsn(
        args.sink.as_deref(),
        args.sink_file.as_deref(),
        from_argv,
        "sink",
    )
    .map_err(|e| fail_line("sink", e.to_string()))?;
    match url {
        None => Ok(None),
        Some(url) => SinkDsn::parse(&url)
            .map(Some)
            .map_err(|e| fail_line("sink", e.to_string())),
    }
}

/// The sink's checks: its descriptor's, on the settings `run` would build it with.
async fn check_sink(dsn: &SinkDsn, options: &SinkOptions) -> Vec<CheckLine> {
    let ctx = SinkContext::check();
    (dsn.descriptor().check)(dsn, options, &ctx).await
}

fn fail_line(check: &str, detail: String) -> CheckLine {
    crate::diagnostics::line(Level::Fail, check, detail, None)
}
