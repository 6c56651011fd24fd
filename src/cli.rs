//! The command line (CONTRACT §1–§2): every flag also read from `OUTBOXD_<FLAG>`, secrets taken
//! from the environment or a file and never echoed, and one function per command.

use crate::connector::{self, RunConfig};
use crate::dsn::{self, SinkDsn, SourceDsn};
use crate::outbox::{ColumnMap, TableName};
use crate::relay::RelayOptions;
use crate::source::postgres::{self as pg, admin};
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Parser, Subcommand, ValueEnum};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(
    name = "outboxd",
    version,
    about = "Transactional outbox relay: database log → RabbitMQ, at least once, in commit order"
)]
pub struct Cli {
    /// Log level filter (error, warn, info, debug, trace, or a tracing directive).
    #[arg(long, global = true, env = "OUTBOXD_LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    /// Log line format.
    #[arg(long, global = true, env = "OUTBOXD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Relay outbox events from the source to the sink until SIGINT/SIGTERM.
    Run(RunArgs),
    /// Idempotently create what the relay needs: state table, publication and slot.
    Setup(SetupArgs),
    /// Drop the relay's slot, publication and state (an abandoned slot fills the disk).
    Teardown(TeardownArgs),
    /// Field-level encryption keys: generate, rotate, list, retire, blind-index.
    #[command(subcommand)]
    Keys(crate::crypto::cli::KeysCommand),
    /// Encrypt the schema's x-gdpr-sensitive fields of the JSON payload on stdin.
    Encrypt(crate::crypto::cli::EncryptArgs),
    /// Decrypt every encrypted field of the JSON payload on stdin.
    Decrypt(crate::crypto::cli::DecryptArgs),
    /// Rewrite outbox rows under the current key, in small batches (resumable).
    Reencrypt(crate::crypto::cli::ReencryptArgs),
}

/// Where the source is. The DSN may carry a password; prefer `--source-file` or the
/// environment, which are never echoed.
#[derive(Debug, Clone, Args)]
pub struct SourceArgs {
    /// Source DSN: postgres://user@host:5432/db?sslmode=…, mysql://…, file:///path/binlog.000001
    #[arg(long, env = "OUTBOXD_SOURCE", hide_env_values = true)]
    pub source: Option<String>,
    /// File holding the source DSN, or only its password (the file's first line).
    #[arg(long, env = "OUTBOXD_SOURCE_FILE")]
    pub source_file: Option<std::path::PathBuf>,
    /// Outbox table (`schema.table` on Postgres, `db.table` for binlog files).
    #[arg(long, env = "OUTBOXD_TABLE", default_value = "outbox")]
    pub table: String,
    /// Relay name: names its state, lease and slot ([a-z0-9_], at most 40 characters).
    #[arg(long, env = "OUTBOXD_NAME", default_value = "outboxd")]
    pub name: String,
    /// Replication slot (default outboxd_<name>).
    #[arg(long, env = "OUTBOXD_SLOT")]
    pub slot: Option<String>,
    /// Publication (default outboxd_<name>).
    #[arg(long, env = "OUTBOXD_PUBLICATION")]
    pub publication: Option<String>,
    /// Column renames: logical=actual, comma separated (or the preset `debezium`).
    #[arg(long = "column", env = "OUTBOXD_COLUMN", value_delimiter = ';')]
    pub columns: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Cdc,
    Poll,
}

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Sink: stdout, or amqp://user@host:5672/vhost (amqps:// for TLS).
    #[arg(
        long,
        env = "OUTBOXD_SINK",
        hide_env_values = true,
        default_value = "stdout"
    )]
    pub sink: String,
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
    #[arg(long, env = "OUTBOXD_WINDOW", default_value_t = 1000)]
    pub window: usize,
    /// A broker confirmation that takes longer is a failure (reconnect, republish).
    #[arg(long, env = "OUTBOXD_CONFIRM_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub confirm_timeout: Duration,
    /// Bound on the graceful stop after SIGINT/SIGTERM.
    #[arg(long, env = "OUTBOXD_SHUTDOWN_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub shutdown_timeout: Duration,
}

#[derive(Debug, Clone, Args)]
pub struct SetupArgs {
    #[command(flatten)]
    pub source: SourceArgs,
}

#[derive(Debug, Clone, Args)]
pub struct TeardownArgs {
    #[command(flatten)]
    pub source: SourceArgs,
    /// Confirm: the slot, publication and stored position are dropped.
    #[arg(long)]
    pub yes: bool,
}

/// `30s`, `500ms`, `2m`, `1h`, `7d`, or plain seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 30s"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m, h, d)")),
    };
    Ok(Duration::from_secs_f64(secs))
}

/// Checks `--name` (CONTRACT §1).
pub fn validate_name(name: &str) -> Result<(), Error> {
    if name.is_empty()
        || name.len() > 40
        || !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(Error::config(
            format!("--name {name:?} is not valid"),
            "use 1 to 40 characters of [a-z0-9_], e.g. --name billing",
        ));
    }
    Ok(())
}

fn read_secret_file(path: &std::path::Path) -> Result<String, Error> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        Error::config(
            format!("cannot read {}: {e}", path.display()),
            "point the flag at a readable file",
        )
    })?;
    Ok(text.lines().next().unwrap_or("").trim().to_string())
}

/// The DSN from flag, environment or file; warns when a password came in argv.
pub(crate) fn resolve_dsn(
    value: Option<&str>,
    file: Option<&std::path::Path>,
    from_argv: bool,
    flag: &str,
) -> Result<Option<String>, Error> {
    let mut dsn = value.map(str::to_string);
    if let Some(path) = file {
        let secret = read_secret_file(path)?;
        if secret.contains("://") {
            dsn = Some(secret);
        } else {
            let base = dsn.ok_or_else(|| {
                Error::config(
                    format!("--{flag}-file holds a password but --{flag} is not given"),
                    format!(
                        "give --{flag} without the password, e.g. --{flag} postgres://user@host/db"
                    ),
                )
            })?;
            dsn = Some(dsn::with_password(&base, &secret)?);
        }
    } else if from_argv {
        if let Some(d) = &dsn {
            if url::Url::parse(d)
                .ok()
                .and_then(|u| u.password().map(|_| ()))
                .is_some()
            {
                tracing::warn!(
                    "the --{flag} DSN on the command line carries a password, which other users can read in the process list; \
                     use OUTBOXD_{} or --{flag}-file instead",
                    flag.to_uppercase()
                );
            }
        }
    }
    Ok(dsn)
}

struct Resolved {
    source: SourceDsn,
    name: String,
    slot: String,
    publication: String,
    table: TableName,
    columns: ColumnMap,
}

fn resolve_source(args: &SourceArgs, m: &ArgMatches) -> Result<Resolved, Error> {
    validate_name(&args.name)?;
    let from_argv = m.value_source("source") == Some(ValueSource::CommandLine);
    let dsn = resolve_dsn(
        args.source.as_deref(),
        args.source_file.as_deref(),
        from_argv,
        "source",
    )?
    .ok_or_else(|| {
        Error::config(
            "no source given",
            "pass --source postgres://user@host:5432/db (or set OUTBOXD_SOURCE, or --source-file)",
        )
    })?;
    let source = SourceDsn::parse(&dsn)?;
    let slot = args
        .slot
        .clone()
        .unwrap_or_else(|| format!("outboxd_{}", args.name));
    let publication = args
        .publication
        .clone()
        .unwrap_or_else(|| format!("outboxd_{}", args.name));
    Ok(Resolved {
        source,
        name: args.name.clone(),
        slot,
        publication,
        table: TableName::parse(&args.table)?,
        columns: ColumnMap::parse(&args.columns)?,
    })
}

/// Runs a parsed command. `matches` tells where each value came from (argv warnings).
pub async fn execute(
    cli: Cli,
    matches: &ArgMatches,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    let sub = matches.subcommand().map(|(_, m)| m).unwrap_or(matches);
    match cli.command {
        Command::Run(args) => run(args, sub, shutdown).await,
        Command::Setup(args) => setup(args, sub).await,
        Command::Teardown(args) => teardown(args, sub).await,
        Command::Keys(cmd) => crate::crypto::cli::keys(cmd, sub).await,
        Command::Encrypt(args) => crate::crypto::cli::encrypt(args, sub).await,
        Command::Decrypt(args) => crate::crypto::cli::decrypt(args, sub).await,
        Command::Reencrypt(args) => crate::crypto::cli::reencrypt(args, sub, shutdown).await,
    }
}

async fn run(args: RunArgs, m: &ArgMatches, shutdown: CancellationToken) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    let sink_from_argv = m.value_source("sink") == Some(ValueSource::CommandLine);
    let sink = resolve_dsn(
        Some(&args.sink),
        args.sink_file.as_deref(),
        sink_from_argv,
        "sink",
    )?
    .unwrap_or_else(|| "stdout".into());
    let sink = SinkDsn::parse(&sink)?;
    if args.mode == Mode::Poll {
        return Err(Error::config(
            "--mode poll is not available in this build",
            "use --mode cdc",
        ));
    }
    if args.window == 0 {
        return Err(Error::config(
            "--window 0 would never publish",
            "use --window 1000",
        ));
    }
    let cfg = RunConfig {
        name: r.name,
        slot: r.slot,
        publication: r.publication,
        table: r.table,
        columns: r.columns,
        sink,
        commit_offsets: args.commit_offsets,
        max_inflight_bytes: args.max_inflight_bytes,
        relay: RelayOptions {
            window: args.window,
            confirm_timeout: args.confirm_timeout,
            ..RelayOptions::default()
        },
    };
    match r.source {
        SourceDsn::Postgres(dsn) => {
            let stats = connector::run_postgres(dsn, cfg, shutdown).await?;
            tracing::info!(
                published = stats.published.load(std::sync::atomic::Ordering::Relaxed),
                confirmed = stats.confirmed.load(std::sync::atomic::Ordering::Relaxed),
                "stopped"
            );
            Ok(())
        }
        SourceDsn::Mysql(_) | SourceDsn::File(_) => Err(Error::config(
            "the MySQL/MariaDB and binlog-file sources are not available in this build",
            "use a postgres:// source",
        )),
    }
}

async fn setup(args: SetupArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    let SourceDsn::Postgres(dsn) = r.source else {
        return Err(Error::config(
            "setup supports Postgres sources in this build",
            "use a postgres:// source",
        ));
    };
    let client = pg::connect_sql(&dsn, "outboxd_setup").await?;
    admin::require_logical(&client).await?;
    admin::require_table(&client, &r.table).await?;
    crate::state::postgres::ensure_table(&client).await?;
    println!("ok   state table outboxd_state");
    let created = admin::ensure_publication(&client, &r.publication, &r.table).await?;
    println!(
        "ok   publication {} on {} ({})",
        r.publication,
        r.table.pg_quoted(),
        if created { "created" } else { "exists" }
    );
    match admin::slot(&client, &r.slot).await? {
        Some(_) => println!("ok   replication slot {} (exists)", r.slot),
        None => {
            let state = crate::state::postgres::load(&client, &r.name).await?;
            if state.is_some_and(|s| s.initialized) {
                return Err(Error::PositionLost {
                    problem: format!(
                        "relay {:?} has state but its slot {:?} is gone",
                        r.name, r.slot
                    ),
                    fix: admin::lost_slot_fix(&r.name, &r.slot),
                });
            }
            admin::create_slot(&client, &r.slot).await?;
            println!("ok   replication slot {} (created)", r.slot);
        }
    }
    Ok(())
}

async fn teardown(args: TeardownArgs, m: &ArgMatches) -> Result<(), Error> {
    let r = resolve_source(&args.source, m)?;
    let SourceDsn::Postgres(dsn) = r.source else {
        return Err(Error::config(
            "teardown supports Postgres sources in this build",
            "use a postgres:// source",
        ));
    };
    if !args.yes {
        return Err(Error::config(
            format!(
                "teardown drops slot {}, publication {} and the stored position of relay {:?}",
                r.slot, r.publication, r.name
            ),
            "add --yes to confirm",
        ));
    }
    let client = pg::connect_sql(&dsn, "outboxd_teardown").await?;
    if let Some(state) = crate::state::postgres::load(&client, &r.name).await? {
        if state.lease_live {
            if let Some(h) = state
                .lease_holder
                .filter(|h| !crate::state::holder_is_dead_locally(h))
            {
                return Err(Error::config(
                    format!("relay {:?} is running (lease held by {h})", r.name),
                    "stop it first",
                ));
            }
        }
    }
    let dropped = admin::drop_slot(&client, &r.slot).await?;
    println!(
        "ok   replication slot {} ({})",
        r.slot,
        if dropped { "dropped" } else { "absent" }
    );
    admin::drop_publication(&client, &r.publication).await?;
    println!("ok   publication {} (dropped)", r.publication);
    let n = crate::state::postgres::delete(&client, &r.name).await?;
    println!(
        "ok   state of {} ({} row{})",
        r.name,
        n,
        if n == 1 { "" } else { "s" }
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_and_names() {
        assert_eq!(parse_duration("30s").unwrap(), Duration::from_secs(30));
        assert_eq!(parse_duration("250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(
            parse_duration("7d").unwrap(),
            Duration::from_secs(7 * 86400)
        );
        assert_eq!(parse_duration("5").unwrap(), Duration::from_secs(5));
        assert!(parse_duration("5 parsecs").is_err());
        assert!(validate_name("billing_2").is_ok());
        assert!(validate_name("Billing").is_err());
        assert!(validate_name("").is_err());
        assert!(validate_name(&"a".repeat(41)).is_err());
    }
}
