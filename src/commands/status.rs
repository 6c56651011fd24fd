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
}

pub(super) async fn status(args: StatusArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    if let SourceDsn::Mysql(dsn) = &r.source {
        let st = crate::source::mysql::diagnostics::status_mysql(dsn, &r.name).await?;
        if args.json {
            println!("{}", serde_json::to_string(&st).unwrap_or_default());
        } else {
            println!("{st}");
        }
        return Ok(());
    }
    let dsn = postgres_only(r.source, "status")?;
    let st = crate::source::postgres::diagnostics::status_postgres(&dsn, &r.name, &r.slot).await?;
    if args.json {
        println!("{}", serde_json::to_string(&st).unwrap_or_default());
    } else {
        println!("{st}");
    }
    Ok(())
}
