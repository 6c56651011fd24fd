//! `outboxd offset`: show the stored position, or move it deliberately (a Postgres slot
//! forward to an LSN, a replay from the table, a MySQL/MariaDB binlog position).

use super::status::{status, StatusArgs};
use super::{postgres_only, resolve_source, SourceArgs};
use crate::dsn::SourceDsn;
use crate::source::postgres as pg;
use crate::Error;
use clap::{ArgMatches, Args, Subcommand};

#[derive(Debug, Clone, Subcommand)]
pub enum OffsetCommand {
    /// Show the stored position and the slot's.
    Show(StatusArgs),
    /// Move the position: forward to an LSN (skips events), or replay rows from the table.
    Set(OffsetSetArgs),
}

#[derive(Debug, Clone, Args)]
pub struct OffsetSetArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Skip forward to this LSN (e.g. 0/16B3748). Slots cannot move backwards.
    #[arg(
        long,
        conflicts_with_all = ["replay_since", "binlog_position"],
        required_unless_present_any = ["replay_since", "binlog_position"]
    )]
    pub lsn: Option<String>,
    /// On the next start, publish again every row created since this RFC 3339 time, then stream.
    #[arg(long, conflicts_with = "binlog_position")]
    pub replay_since: Option<String>,
    /// MySQL/MariaDB: resume from this binlog position, FILE:POS — a transaction boundary, such
    /// as the end position in an event's x-source-position. Earlier replays, later skips.
    #[arg(long)]
    pub binlog_position: Option<String>,
    /// MySQL/MariaDB: store the position in this offset file (as `run --offset-file`) instead
    /// of the outboxd_state table.
    #[arg(long, value_name = "PATH", requires = "binlog_position")]
    pub offset_file: Option<std::path::PathBuf>,
}

pub(super) async fn offset(cmd: OffsetCommand, m: &ArgMatches) -> Result<(), Error> {
    match cmd {
        OffsetCommand::Show(args) => status(args, m).await,
        OffsetCommand::Set(args) => {
            let r = resolve_source(&args.source, m)?;
            if let SourceDsn::Mysql(dsn) = &r.source {
                let Some(at) = args.binlog_position.as_deref() else {
                    return Err(Error::config(
                        "a MySQL source's position is a binlog position",
                        "use offset set --binlog-position FILE:POS",
                    ));
                };
                let stored = crate::source::mysql::diagnostics::set_position(
                    dsn,
                    &r.name,
                    at,
                    args.offset_file.as_deref(),
                )
                .await?;
                println!("ok   the next start of {} resumes from {stored}", r.name);
                return Ok(());
            }
            if args.binlog_position.is_some() {
                return Err(Error::config(
                    "--binlog-position is for MySQL/MariaDB sources",
                    "use --lsn or --replay-since with a Postgres source",
                ));
            }
            let dsn = postgres_only(r.source, "offset set")?;
            if let Some(lsn) = args.lsn {
                let end = crate::source::postgres::diagnostics::advance_slot(
                    &dsn, &r.name, &r.slot, &lsn,
                )
                .await?;
                println!("ok   slot {} moved to {end}", r.slot);
            } else if let Some(since) = args.replay_since {
                let since = chrono::DateTime::parse_from_rfc3339(since.trim())
                    .map_err(|e| {
                        Error::config(
                            format!("--replay-since {since}: {e}"),
                            "write e.g. 2026-06-22T10:00:00Z",
                        )
                    })?
                    .with_timezone(&chrono::Utc);
                let client = pg::connect_sql(&dsn, "outboxd_offset").await?;
                crate::state::postgres::request_replay(&client, &r.name, since).await?;
                println!(
                    "ok   the next start of {} publishes rows created since {} again, then streams",
                    r.name,
                    since.to_rfc3339()
                );
            }
            Ok(())
        }
    }
}
