//! The command line (docs/configuration.md): every flag also read from `OUTBOXD_<FLAG>`, secrets taken
//! from the environment or a file and never echoed, and one function per command.
//!
//! This file holds the top-level `Cli`, its dispatch (`execute`), the option groups several
//! commands share (`SourceArgs`, `PartitionArgs`; the sink's, `SinkArgs`, in `sink`), how a
//! source is resolved from them, and the value parsers and checks of common flags. Each
//! command's own flags and function are in a file of their own: `run` (also the flags of
//! `config`), `check`, `status`, `offset`, `setup` (`setup` and `teardown`), `health`,
//! `topology`, `crypto` (`keys`, `encrypt`, `decrypt`, `reencrypt`) and `consumer` (`prune`).

use crate::dsn::{self, SourceDsn};
use crate::outbox::{ColumnMap, TableName};
use crate::Error;
use clap::parser::ValueSource;
use clap::{ArgMatches, Args, Parser, Subcommand, ValueEnum};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

mod check;
pub mod config_file;
pub mod consumer;
pub mod crypto;
pub mod fleet;
mod health;
mod offset;
mod run;
mod setup;
pub mod sink;
mod status;
pub mod topology;

use check::check;
use offset::offset;
use run::run;
use setup::{setup, teardown};
use status::status;

pub use check::CheckArgs;
pub use health::HealthArgs;
pub use offset::OffsetCommand;
pub use run::RunArgs;
pub use setup::{SetupArgs, TeardownArgs};
pub use status::StatusArgs;

/// `outboxd --version`: the crate version and the git commit it was built from (`build.rs`).
pub const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("OUTBOXD_COMMIT"),
    ")"
);

/// The `run` and `check` flags for partitions (flattened into the sink's flags).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct PartitionArgs {
    /// Partition queues <exchange>.p0 … p<N-1>: every event of one aggregate goes to one of
    /// them, in commit order (0 = off). The partition is Kafka's murmur2 of the aggregate id,
    /// sent as header x-partition.
    #[arg(long, env = "OUTBOXD_PARTITIONS", default_value_t = 0)]
    pub partitions: u32,
    /// Also send x-partition-<N> for each of these partition counts (comma separated), for
    /// consumer groups declared with `outboxd topology --group NAME --partitions N`.
    #[arg(long, env = "OUTBOXD_GROUP_PARTITIONS", value_delimiter = ',')]
    pub group_partitions: Vec<u32>,
    /// x-queue-type of the partition queues this relay declares.
    #[arg(long, env = "OUTBOXD_QUEUE_TYPE", value_enum, default_value_t = crate::sink::partition::QueueType::Classic)]
    pub queue_type: crate::sink::partition::QueueType,
    /// headers: the relay computes the partition; consistent-hash: RabbitMQ's plugin places
    /// aggregates (its ring can move keys when the broker restarts).
    #[arg(long, env = "OUTBOXD_PARTITION_ROUTING", value_enum, default_value_t = crate::sink::partition::PartitionRouting::Headers)]
    pub partition_routing: crate::sink::partition::PartitionRouting,
}

impl PartitionArgs {
    /// The settings as given, for the sink's validation.
    pub fn spec(&self) -> crate::sink::partition::PartitionSpec {
        crate::sink::partition::PartitionSpec {
            partitions: self.partitions,
            group_partitions: self.group_partitions.clone(),
            queue_type: self.queue_type,
            partition_routing: self.partition_routing,
        }
    }

    /// The validated partitioning (`PartitionSpec::validate`).
    pub fn validate(&self) -> Result<crate::sink::partition::Partitioning, Error> {
        self.spec().validate()
    }
}

#[derive(Debug, Parser)]
#[command(
    name = "outboxd",
    version = VERSION,
    about = "Transactional outbox relay: database log → RabbitMQ, at least once, in commit order"
)]
pub struct Cli {
    /// Log level filter (error, warn, info, debug, trace, or a tracing directive).
    #[arg(long, global = true, env = "OUTBOXD_LOG_LEVEL", default_value = "info")]
    pub log_level: String,
    /// Log line format.
    #[arg(long, global = true, env = "OUTBOXD_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// TOML file of flags (keys are the long flags with `_` for `-`, e.g. `source_file`);
    /// flags and the environment override it; secrets only by reference (`*_file`, env).
    #[arg(long, global = true, env = "OUTBOXD_CONFIG", value_name = "PATH")]
    pub config: Option<std::path::PathBuf>,
    /// How often long work (a snapshot, a replay, catching up, reencrypt, prune, a consumer's
    /// --until-empty) logs its progress, besides a line at each tenth of its estimated total.
    #[arg(long, global = true, env = "OUTBOXD_PROGRESS_INTERVAL", value_parser = parse_duration, default_value = "10s")]
    pub progress_interval: Duration,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

// Parsed once per process: the size difference between the variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Relay outbox events from the source to the sink until SIGINT/SIGTERM.
    Run(RunArgs),
    /// Run many sources in one process (one <name>.toml each in --sources DIR), each its own
    /// relay with its own lease; `fleet status` lists them.
    Fleet(fleet::FleetArgs),
    /// Idempotently create what the relay needs: state table, publication and slot.
    Setup(SetupArgs),
    /// Drop the relay's slot, publication and state (an abandoned slot fills the disk).
    Teardown(TeardownArgs),
    /// Preflight: one line per check, each failure with its fix; exit 0 when ready, 1 otherwise.
    Check(CheckArgs),
    /// Stored position, server head, lag, slot state and lease holder.
    Status(StatusArgs),
    /// Read or deliberately move the stored position.
    #[command(subcommand)]
    Offset(OffsetCommand),
    /// Probe a running relay's /readyz (or /healthz): exit 0 when it answers 200, 1 otherwise
    /// (a container healthcheck that needs no curl or wget in the image).
    Health(HealthArgs),
    /// Declare a consumer group's partition queues (or the relay's own), idempotently.
    Topology(topology::TopologyArgs),
    /// Field-level encryption keys: generate, rotate, list, retire, blind-index.
    #[command(subcommand)]
    Keys(crate::commands::crypto::KeysCommand),
    /// Encrypt the schema's x-gdpr-sensitive fields of the JSON payload on stdin.
    Encrypt(crate::commands::crypto::EncryptArgs),
    /// Decrypt every encrypted field of the JSON payload on stdin.
    Decrypt(crate::commands::crypto::DecryptArgs),
    /// Rewrite outbox rows under the current key, in small batches (resumable).
    Reencrypt(crate::commands::crypto::ReencryptArgs),
    /// Delete old processed_messages or outbox rows in small batches.
    Prune(crate::commands::consumer::PruneArgs),
    /// Print the effective configuration of `run` (flags, environment, --config file and
    /// defaults, each value's origin), secrets redacted; takes the same flags as `run`.
    Config(RunArgs),
    /// Print the outboxd config file equivalent to a Debezium connector's configuration (Kafka
    /// Connect JSON or Debezium Server application.properties), naming each option it cannot
    /// carry over and why.
    FromDebezium(FromDebeziumArgs),
}

/// `outboxd from-debezium`.
#[derive(Debug, Clone, Args)]
pub struct FromDebeziumArgs {
    /// The connector's configuration file (`-` for standard input).
    #[arg(value_name = "PATH")]
    pub path: std::path::PathBuf,
}

/// Where the source is. The DSN may carry a password; prefer `--source-file` or the
/// environment, which are never echoed.
#[derive(Debug, Clone, Args)]
pub struct SourceArgs {
    /// Source DSN: postgres://user@host:5432/db?sslmode=…, mysql://…, file:///path/binlog.000001
    #[arg(long, env = "OUTBOXD_SOURCE", hide_env_values = true)]
    pub source: Option<crate::dsn::DsnArg>,
    /// File holding the source DSN, or only its password (the file's first line).
    #[arg(long, env = "OUTBOXD_SOURCE_FILE")]
    pub source_file: Option<std::path::PathBuf>,
    /// Outbox table (`schema.table` on Postgres, `db.table` for binlog files); repeat it (or
    /// separate with commas) to relay several tables through one slot / binlog stream.
    #[arg(
        long = "table",
        env = "OUTBOXD_TABLE",
        value_delimiter = ',',
        default_value = "outbox"
    )]
    pub tables: Vec<String>,
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

// The one duration parser, shared with consumer binaries (they cannot see this module).
pub use outboxd::consumer::cli::parse_duration;

// The one size parser, shared with the sinks' own flags (compiled into the library).
pub use outboxd::internal::values::parse_bytes;

/// Checks `--name` (docs/configuration.md).
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

/// Checks `--slot` and `--publication`: the characters Postgres allows in a replication slot
/// name ([a-z0-9_]) and at most 63 of them (its identifier limit), so neither can carry SQL
/// nor be truncated by the server into another relay's name.
pub fn validate_pg_object(flag: &str, value: &str) -> Result<(), Error> {
    if value.is_empty()
        || value.len() > 63
        || !value
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    {
        return Err(Error::config(
            format!("{flag} {value:?} is not valid"),
            format!("use 1 to 63 characters of [a-z0-9_], e.g. {flag} outboxd_billing"),
        ));
    }
    Ok(())
}

/// The first line of a `--*-file`: opened once and checked as every secret file is
/// ([`crate::secret_file`]: owner, no group/other bits).
fn read_secret_file(path: &std::path::Path) -> Result<String, Error> {
    let text = crate::secret_file::read_string(path).map_err(|e| e.into_config())?;
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
            if dsn::has_secret(d) {
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
    tables: Vec<TableName>,
    columns: ColumnMap,
}

/// `--table`, repeated: each parsed, none twice.
fn parse_tables(specs: &[String]) -> Result<Vec<TableName>, Error> {
    let mut tables: Vec<TableName> = Vec::with_capacity(specs.len());
    for s in specs {
        let t = TableName::parse(s.trim())?;
        if tables.contains(&t) {
            return Err(Error::config(
                format!("--table {t} is given twice"),
                "name each outbox table once",
            ));
        }
        tables.push(t);
    }
    if tables.is_empty() {
        return Err(Error::config("no --table given", "pass --table outbox"));
    }
    Ok(tables)
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
    validate_pg_object("--slot", &slot)?;
    validate_pg_object("--publication", &publication)?;
    Ok(Resolved {
        source,
        name: args.name.clone(),
        slot,
        publication,
        tables: parse_tables(&args.tables)?,
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
        Command::Fleet(args) => fleet::fleet(args, sub, shutdown).await,
        Command::Setup(args) => setup(args, sub).await,
        Command::Teardown(args) => teardown(args, sub).await,
        Command::Check(args) => check(args, sub).await,
        Command::Status(args) => status(args, sub).await,
        Command::Offset(cmd) => {
            let sub = sub.subcommand().map(|(_, m)| m).unwrap_or(sub);
            offset(cmd, sub).await
        }
        Command::Health(args) => crate::telemetry::probe(&args.addr, &args.path).await,
        Command::Topology(args) => topology::run(args, sub).await,
        Command::Keys(cmd) => crate::commands::crypto::keys(cmd, sub).await,
        Command::Encrypt(args) => crate::commands::crypto::encrypt(args, sub).await,
        Command::Decrypt(args) => crate::commands::crypto::decrypt(args, sub).await,
        Command::Reencrypt(args) => crate::commands::crypto::reencrypt(args, sub, shutdown).await,
        Command::Prune(args) => crate::commands::consumer::prune(args, sub, shutdown).await,
        Command::FromDebezium(args) => from_debezium(&args),
        Command::Config(_) => {
            use clap::CommandFactory;
            let root = Cli::command();
            let cmd = root
                .find_subcommand("config")
                .expect("the config subcommand exists");
            print!(
                "{}",
                crate::commands::config_file::render_effective(cmd, sub)
            );
            Ok(())
        }
    }
}

/// `outboxd from-debezium PATH`: the translated file on stdout.
fn from_debezium(args: &FromDebeziumArgs) -> Result<(), Error> {
    let text = if args.path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| {
            Error::config(
                format!("reading standard input: {e}"),
                "pipe the connector's configuration in, or give its path",
            )
        })?;
        s
    } else {
        std::fs::read_to_string(&args.path).map_err(|e| {
            Error::config(
                format!("cannot read {}: {e}", args.path.display()),
                "give the path of the connector's JSON (Kafka Connect) or application.properties (Debezium Server)",
            )
        })?
    };
    let t = crate::debezium::config::translate(&text)?;
    print!("{}", t.toml);
    if !t.not_carried.is_empty() {
        eprintln!(
            "{} option{} not carried over: listed, with why, at the end of the file",
            t.not_carried.len(),
            if t.not_carried.len() == 1 {
                " is"
            } else {
                "s are"
            }
        );
    }
    Ok(())
}

fn postgres_only(source: SourceDsn, command: &str) -> Result<crate::dsn::DbDsn, Error> {
    match source {
        SourceDsn::Postgres(d) => Ok(d),
        _ => Err(Error::config(
            format!("{command} supports Postgres sources in this build"),
            "use a postgres:// source",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// `--table a,b` is `--table a --table b` (the relay's multi-table tests run the relay
    /// in-process, past the command line).
    #[test]
    fn a_comma_separated_table_flag_is_the_flag_repeated() {
        use clap::Parser;
        let tables = |flags: &[&str]| {
            let argv = [&["outboxd", "run"][..], flags].concat();
            match Cli::try_parse_from(argv).expect("parses").command {
                Command::Run(args) => args.source.tables,
                _ => unreachable!("a run"),
            }
        };
        let comma = tables(&["--table", "outbox,outbox_b"]);
        assert_eq!(comma, ["outbox", "outbox_b"]);
        assert_eq!(comma, tables(&["--table", "outbox", "--table", "outbox_b"]));
    }

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
        // Larger than a Duration holds, and overflowing f64 to infinity: errors, no panic.
        assert!(parse_duration("99999999999999999999999d").is_err());
        assert!(parse_duration(&"9".repeat(400)).is_err());
        assert!(parse_duration("1.5.5s").is_err());
        assert!(validate_pg_object("--slot", "outboxd_billing").is_ok());
        assert!(validate_pg_object("--slot", &"a".repeat(63)).is_ok());
        for bad in ["", "Slot", "a-b", "x'; DROP TABLE t; --", "a b", "é"] {
            let err = validate_pg_object("--publication", bad)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("--publication") && err.contains("[a-z0-9_]"),
                "{err}"
            );
        }
        assert!(validate_pg_object("--slot", &"a".repeat(64)).is_err());
        assert!(validate_name("billing_2").is_ok());
        assert!(validate_name("Billing").is_err());
        assert!(validate_name("").is_err());
        assert!(validate_name(&"a".repeat(41)).is_err());
        assert_eq!(parse_bytes("16MiB").unwrap(), 16 * 1024 * 1024);
        assert_eq!(parse_bytes("4096").unwrap(), 4096);
        assert_eq!(parse_bytes("2 KiB").unwrap(), 2048);
        assert_eq!(parse_bytes("1MB").unwrap(), 1_000_000);
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("12 parsecs").is_err());
    }
}
