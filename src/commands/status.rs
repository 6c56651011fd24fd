//! `outboxd status` (and `offset show`): the stored position, the server's head, lag, slot
//! state and lease holder.

use super::{postgres_only, resolve_source, SourceArgs};
use crate::dsn::SourceDsn;
use crate::Error;
use clap::{ArgMatches, Args};

#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Print one JSON object (for scripts).
    #[arg(long, env = "OUTBOXD_JSON")]
    pub json: bool,
    /// Postgres 17+: also show a physical standby's copy of the relay's slot (postgres://…
    /// DSN) and whether a failover to it keeps the slot.
    #[arg(long, env = "OUTBOXD_STANDBY", hide_env_values = true)]
    pub standby: Option<crate::dsn::DsnArg>,
    /// MySQL/MariaDB: also show what this replica (DSN; repeat, or separate by spaces in the
    /// environment) has applied, as the relay's --sync-replica waits for it.
    #[arg(
        long = "sync-replica",
        env = "OUTBOXD_SYNC_REPLICA",
        value_delimiter = ' ',
        hide_env_values = true
    )]
    pub sync_replicas: Vec<crate::dsn::DsnArg>,
}

pub(super) async fn status(args: StatusArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    if let SourceDsn::Mysql(dsn) = &r.source {
        if args.standby.is_some() {
            return Err(Error::config(
                "--standby is for Postgres sources",
                "name MySQL/MariaDB replicas with --sync-replica",
            ));
        }
        let replicas = super::run::sync_replicas(&args.sync_replicas)?;
        let st = crate::source::mysql::diagnostics::status_mysql(dsn, &r.name, &replicas).await?;
        if args.json {
            println!("{}", serde_json::to_string(&st).unwrap_or_default());
        } else {
            println!("{st}");
        }
        return Ok(());
    }
    if !args.sync_replicas.is_empty() {
        return Err(Error::config(
            "--sync-replica is for MySQL/MariaDB sources",
            "give a Postgres physical standby with --standby",
        ));
    }
    let dsn = postgres_only(r.source, "status")?;
    let standby = match &args.standby {
        Some(s) => Some(postgres_only(SourceDsn::parse(s)?, "status --standby")?),
        None => None,
    };
    let st = crate::source::postgres::diagnostics::status_postgres(
        &dsn,
        &r.name,
        &r.slot,
        standby.as_ref(),
    )
    .await?;
    if args.json {
        println!("{}", serde_json::to_string(&st).unwrap_or_default());
    } else {
        println!("{st}");
    }
    Ok(())
}
