//! Command-line pieces of the consumer kit: `outboxd prune` (docs/configuration.md) and [`ConsumeArgs`],
//! the flags a consumer binary built on the runner shares (`examples/invoice_projection.rs`
//! flattens them). Every flag has its `OUTBOXD_<FLAG>` environment variable.

use super::parse_duration;
use crate::consumer::prune::{self, PruneOptions, PruneReport};
use crate::consumer::runner::{Declare, OnPoison, RunnerOptions};
use crate::consumer::{ConsumerError, Inbox};
use crate::dsn::{redact, DbDsn, SourceDsn};
use crate::outbox::Mode;
use crate::outbox::{ColumnMap, TableName};
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Args)]
pub struct PruneArgs {
    /// Database DSN: postgres://user@host:5432/db or mysql://user@host:3306/db.
    #[arg(long, env = "OUTBOXD_SOURCE", hide_env_values = true)]
    pub source: Option<crate::dsn::DsnArg>,
    /// File holding the DSN, or only its password (the file's first line).
    #[arg(long, env = "OUTBOXD_SOURCE_FILE")]
    pub source_file: Option<std::path::PathBuf>,
    /// The table: processed_messages (the consumers' dedupe table) or outbox, qualified if
    /// needed (app.outbox). Which kind it is comes from its columns.
    #[arg(long, env = "OUTBOXD_TABLE")]
    pub table: String,
    /// Outbox column renames: logical=actual, comma separated (created_at, status).
    #[arg(long = "column", env = "OUTBOXD_COLUMN", value_delimiter = ';')]
    pub columns: Vec<String>,
    /// Delete rows older than this (7d, 36h). Under 1d is refused without --force.
    #[arg(long, env = "OUTBOXD_OLDER_THAN", value_parser = parse_duration, default_value = "7d")]
    pub older_than: Duration,
    /// Rows per DELETE (one short transaction each).
    #[arg(long, env = "OUTBOXD_BATCH", default_value_t = 10_000)]
    pub batch: u64,
    /// Pause between batches (lets replicas and other writers keep up).
    #[arg(long, env = "OUTBOXD_PAUSE", value_parser = parse_duration, default_value = "10ms")]
    pub pause: Duration,
    /// Count what would be deleted; delete nothing.
    #[arg(long, env = "OUTBOXD_DRY_RUN")]
    pub dry_run: bool,
    /// Prune a window shorter than the 1 day replay horizon anyway.
    #[arg(long, env = "OUTBOXD_FORCE")]
    pub force: bool,
    /// The relay's mode: in poll mode only outbox rows already `published` are deleted.
    #[arg(long, env = "OUTBOXD_MODE", value_enum, default_value_t = Mode::Cdc)]
    pub mode: Mode,
    /// Only this consumer's processed_messages rows.
    #[arg(long, env = "OUTBOXD_CONSUMER")]
    pub consumer: Option<String>,
}

/// `outboxd prune`: progress at most once a second, then the summary (rows, rows/s).
pub async fn prune(
    args: PruneArgs,
    m: &ArgMatches,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let from_argv = m.value_source("source") == Some(ValueSource::CommandLine);
    let dsn = crate::commands::resolve_dsn(
        args.source.as_deref(),
        args.source_file.as_deref(),
        from_argv,
        "source",
    )?
    .ok_or_else(|| {
        Error::config(
            "no database given",
            "pass --source postgres://user@host:5432/db or mysql://user@host:3306/db (or OUTBOXD_SOURCE, or --source-file)",
        )
    })?;
    if args.batch == 0 {
        return Err(Error::config(
            "--batch 0 would delete nothing",
            "use --batch 10000",
        ));
    }
    let opts = PruneOptions {
        table: TableName::parse(&args.table)?,
        columns: ColumnMap::parse(&args.columns)?,
        older_than: args.older_than,
        batch: args.batch,
        pause: args.pause,
        dry_run: args.dry_run,
        force: args.force,
        mode: args.mode,
        consumer: args.consumer.clone(),
    };
    let mut printed: Option<Instant> = None;
    let mut progress = move |r: &PruneReport| {
        if printed.is_none_or(|t| t.elapsed() >= Duration::from_secs(1)) {
            println!(
                "progress: {} rows deleted from {} in {}, {:.0} rows/s",
                r.rows,
                r.table,
                prune::batches_text(r.batches),
                r.rows_per_sec()
            );
            printed = Some(Instant::now());
        }
    };
    let report = match SourceDsn::parse(&dsn)? {
        SourceDsn::Postgres(d) => prune::prune_postgres(&d, &opts, &mut progress, &shutdown).await,
        SourceDsn::Mysql(d) => prune::prune_mysql(&d, &opts, &mut progress, &shutdown).await,
        SourceDsn::File(_) => {
            return Err(Error::config(
                "prune needs a database, not binlog files",
                "pass --source postgres://… or mysql://…",
            ))
        }
    }?;
    println!("{report}");
    if args.dry_run {
        if let Err(e) = prune::check_window(report.kind, args.older_than, args.force) {
            println!("note: without --dry-run this would be refused: {e}");
        }
    }
    Ok(())
}

/// The flags of a consumer binary: where to consume, where the effect goes, and how failures
/// are handled.
#[derive(Debug, Clone, Args)]
pub struct ConsumeArgs {
    /// Broker URL, amqp://user:pass@host:5672/vhost (give it in the environment: it holds a
    /// password).
    #[arg(long, env = "OUTBOXD_BROKER", hide_env_values = true)]
    pub broker: crate::dsn::DsnArg,
    /// Queue to consume.
    #[arg(long, env = "OUTBOXD_QUEUE")]
    pub queue: String,
    /// This consumer's name: the first half of the processed_messages key.
    #[arg(long, env = "OUTBOXD_CONSUMER")]
    pub consumer: String,
    /// Database of the effect and the inbox: postgres://… or mysql://…
    #[arg(long, env = "OUTBOXD_DB", hide_env_values = true)]
    pub db: crate::dsn::DsnArg,
    /// Unacked messages the broker sends ahead.
    #[arg(long, env = "OUTBOXD_PREFETCH", default_value_t = 64)]
    pub prefetch: u16,
    /// Workers (database connections); messages are spread by aggregate, so each aggregate
    /// keeps its order.
    #[arg(long, env = "OUTBOXD_CONCURRENCY", default_value_t = 1)]
    pub concurrency: usize,
    /// Failures of one message before --on-poison applies (retryable errors do not count).
    #[arg(long, env = "OUTBOXD_MAX_FAILURES", default_value_t = 5)]
    pub max_failures: u32,
    /// What to do with a message that failed --max-failures times.
    #[arg(long, env = "OUTBOXD_ON_POISON", value_enum, default_value_t = OnPoison::Halt)]
    pub on_poison: OnPoison,
    /// First delay of the in-place retry.
    #[arg(long, env = "OUTBOXD_RETRY_MIN", value_parser = parse_duration, default_value = "100ms")]
    pub retry_min: Duration,
    /// Longest delay of the in-place retry.
    #[arg(long, env = "OUTBOXD_RETRY_MAX", value_parser = parse_duration, default_value = "30s")]
    pub retry_max: Duration,
    /// Drop messages whose x-aggregate-version is not newer than the last applied one.
    #[arg(long, env = "OUTBOXD_STALE_GATE")]
    pub stale_gate: bool,
    /// Declare the queue and bind it to this exchange (the relay's --exchange).
    #[arg(long, env = "OUTBOXD_EXCHANGE", requires = "bindings")]
    pub exchange: Option<String>,
    /// Routing-key patterns to bind with --exchange (comma separated), e.g. 'invoice.#'.
    #[arg(
        long = "bind",
        env = "OUTBOXD_BIND",
        value_delimiter = ',',
        requires = "exchange"
    )]
    pub bindings: Vec<String>,
    /// With --exchange: declare the queue single-active-consumer (ordered).
    #[arg(long, env = "OUTBOXD_SINGLE_ACTIVE")]
    pub single_active: bool,
    /// Stop once the queue is empty and nothing is in hand (a batch run).
    #[arg(long, env = "OUTBOXD_UNTIL_EMPTY")]
    pub until_empty: bool,
    /// Most messages committed in one transaction (of those already delivered; 1 = one
    /// transaction per message). A failing message is retried alone; order holds.
    #[arg(long, env = "OUTBOXD_BATCH_SIZE", default_value_t = 1)]
    pub batch_size: usize,
}

/// The database a consumer writes to.
pub enum Database {
    Postgres(DbDsn),
    Mysql(DbDsn),
}

impl ConsumeArgs {
    pub fn runner_options(&self) -> Result<RunnerOptions, ConsumerError> {
        for (flag, url, env) in [
            ("--broker", &self.broker, "OUTBOXD_BROKER"),
            ("--db", &self.db, "OUTBOXD_DB"),
        ] {
            let has_password = url::Url::parse(url).is_ok_and(|u| u.password().is_some());
            if has_password && std::env::var_os(env).is_none() {
                tracing::warn!("the {flag} URL on the command line carries a password, which other users can read in the process list; use {env} instead");
            }
        }
        if self.concurrency == 0 {
            return Err(ConsumerError::config(
                "--concurrency 0 would process nothing",
                "use --concurrency 1",
            ));
        }
        let mut o = RunnerOptions::new(&self.broker, &self.queue);
        o.prefetch = self.prefetch.max(1);
        o.max_failures = self.max_failures;
        o.on_poison = self.on_poison;
        o.retry_min = self.retry_min;
        o.retry_max = self.retry_max.max(self.retry_min);
        o.until_empty = self.until_empty;
        o.batch_size = self.batch_size.max(1);
        o.connection_name = format!("outboxd consumer {} on {}", self.consumer, self.queue);
        o.declare = self.exchange.as_ref().map(|x| Declare {
            exchange: x.clone(),
            bindings: self.bindings.clone(),
            single_active: self.single_active,
        });
        Ok(o)
    }

    pub fn inbox(&self) -> Result<Inbox, ConsumerError> {
        let inbox = Inbox::new(&self.consumer)?;
        if self.stale_gate {
            inbox.with_stale_gate(None)
        } else {
            Ok(inbox)
        }
    }

    pub fn database(&self) -> Result<Database, ConsumerError> {
        match SourceDsn::parse(&self.db)? {
            SourceDsn::Postgres(d) => Ok(Database::Postgres(d)),
            SourceDsn::Mysql(d) => Ok(Database::Mysql(d)),
            SourceDsn::File(_) => Err(ConsumerError::config(
                format!("--db {} is not a database", redact(&self.db)),
                "use postgres://user@host:5432/db or mysql://user@host:3306/db",
            )),
        }
    }
}
