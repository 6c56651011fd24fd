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
        conflicts_with_all = ["replay_since", "binlog_position", "from_debezium"],
        required_unless_present_any = ["replay_since", "binlog_position", "from_debezium"]
    )]
    pub lsn: Option<String>,
    /// On the next start, publish again every row created since this RFC 3339 time, then stream.
    #[arg(long, conflicts_with_all = ["binlog_position", "from_debezium"])]
    pub replay_since: Option<String>,
    /// MySQL/MariaDB: resume from this binlog position, FILE:POS — a transaction boundary, such
    /// as the end position in an event's x-source-position. Earlier replays, later skips.
    #[arg(long, conflicts_with = "from_debezium")]
    pub binlog_position: Option<String>,
    /// Take over from a Debezium connector: its stored offset (the JSON value, a file holding
    /// it or printed offsets-topic records, or Debezium Server's offset file). Postgres: moves
    /// --slot (the connector's) past what it published; MySQL/MariaDB: stores the binlog
    /// position after it.
    #[arg(long, env = "OUTBOXD_FROM_DEBEZIUM", value_name = "OFFSET|PATH")]
    pub from_debezium: Option<String>,
    /// With --from-debezium on MariaDB: the connector ran with include.query=true (its event
    /// counts include ANNOTATE_ROWS events).
    #[arg(
        long,
        env = "OUTBOXD_DEBEZIUM_INCLUDE_QUERY",
        requires = "from_debezium"
    )]
    pub debezium_include_query: bool,
    /// MySQL/MariaDB: store the position in this offset file (as `run --offset-file`) instead
    /// of the outboxd_state table.
    #[arg(long, value_name = "PATH")]
    pub offset_file: Option<std::path::PathBuf>,
}

/// The Debezium offset `--from-debezium` gives: inline JSON, or a file's bytes.
fn debezium_offset(arg: &str) -> Result<crate::debezium::offset::DebeziumOffset, Error> {
    let t = arg.trim_start();
    if t.starts_with('{') || t.starts_with('[') {
        return crate::debezium::offset::parse(t.as_bytes());
    }
    let bytes = std::fs::read(arg).map_err(|e| {
        Error::config(
            format!("--from-debezium {arg:?}: not an offset, and not a readable file: {e}"),
            "give the connector's offset value ('{\"lsn_commit\": …}' / '{\"file\": …, \"pos\": …}') or the path of a file holding it",
        )
    })?;
    crate::debezium::offset::parse(&bytes)
}

pub(super) async fn offset(cmd: OffsetCommand, m: &ArgMatches) -> Result<(), Error> {
    match cmd {
        OffsetCommand::Show(args) => status(args, m).await,
        OffsetCommand::Set(args) => {
            let r = resolve_source(&args.source, m)?;
            let from_debezium = args
                .from_debezium
                .as_deref()
                .map(debezium_offset)
                .transpose()?;
            if args.offset_file.is_some()
                && args.binlog_position.is_none()
                && from_debezium.is_none()
            {
                return Err(Error::config(
                    "--offset-file stores a MySQL/MariaDB binlog position",
                    "give it with --binlog-position FILE:POS or --from-debezium",
                ));
            }
            if let SourceDsn::Mysql(dsn) = &r.source {
                use crate::debezium::offset::DebeziumOffset;
                let at = match (&from_debezium, args.binlog_position.as_deref()) {
                    (Some(DebeziumOffset::Binlog { file, pos, event, row, .. }), _) => {
                        let tables = crate::source::mysql::log::outbox_tables(dsn, &r.tables, &r.columns, Default::default())?;
                        let t = crate::source::mysql::takeover::resolve(
                            dsn,
                            &r.name,
                            tables,
                            (file, *pos, *event, *row),
                            args.debezium_include_query,
                        )
                        .await?;
                        println!("ok   {}", t.summary);
                        t.at
                    }
                    (Some(DebeziumOffset::Postgres { .. }), _) => {
                        return Err(Error::config(
                            "--from-debezium: the offset is a Postgres connector's (lsn), the source is MySQL/MariaDB",
                            "give the offset of the connector that read this database",
                        ))
                    }
                    (None, Some(at)) => at.to_string(),
                    (None, None) => {
                        return Err(Error::config(
                            "a MySQL source's position is a binlog position",
                            "use offset set --binlog-position FILE:POS (or --from-debezium to take a Debezium connector's)",
                        ))
                    }
                };
                let stored = crate::source::mysql::diagnostics::set_position(
                    dsn,
                    &r.name,
                    &at,
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
            if let Some(offset) = from_debezium {
                let crate::debezium::offset::DebeziumOffset::Postgres {
                    lsn_commit, lsn, ..
                } = offset
                else {
                    return Err(Error::config(
                        "--from-debezium: the offset is a MySQL/MariaDB connector's (file, pos), the source is Postgres",
                        "give the offset of the connector that read this database",
                    ));
                };
                let client = pg::connect_sql(&dsn, "outboxd_offset").await?;
                let (target, summary) = crate::source::postgres::takeover::resolve(
                    &client,
                    &r.slot,
                    &r.publication,
                    &r.tables,
                    lsn_commit,
                    lsn,
                )
                .await?;
                println!("ok   {summary}");
                let end = crate::source::postgres::diagnostics::advance_slot(
                    &dsn,
                    &r.name,
                    &r.slot,
                    &crate::event::format_lsn(target),
                )
                .await?;
                println!("ok   slot {} moved to {end}: `outboxd run` with this --slot and --publication resumes there (give --snapshot never on its first start)", r.slot);
                return Ok(());
            }
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
