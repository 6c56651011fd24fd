//! `outboxd prune` (docs/configuration.md): its flags, each with its `OUTBOXD_<FLAG>`
//! environment variable. The flags a consumer binary built on the runner shares are in the
//! library, `outboxd::consumer::cli`, where such binaries find them.

use super::parse_duration;
use crate::consumer::prune::{self, PruneOptions, PruneReport};
use crate::dsn::SourceDsn;
use crate::outbox::Mode;
use crate::outbox::{ColumnMap, TableName};
use crate::progress::{Progress, Unit};
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args};
use std::time::Duration;
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

/// `outboxd prune`: its progress (a bar on a terminal, else lines), then the summary (rows,
/// rows/s).
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
    let mut tracker: Option<Progress> = None;
    let mut progress = |r: &PruneReport| {
        tracker
            .get_or_insert_with(|| Progress::command("prune", &r.table, Unit::Rows, r.estimated))
            .set(r.rows);
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
    if let Some(t) = tracker.filter(|_| !report.interrupted) {
        t.finish();
    }
    println!("{report}");
    if args.dry_run {
        if let Err(e) = prune::check_window(report.kind, args.older_than, args.force) {
            println!("note: without --dry-run this would be refused: {e}");
        }
    }
    Ok(())
}
