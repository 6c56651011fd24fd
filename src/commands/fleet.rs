//! `outboxd fleet`: the flags of a fleet process and of `fleet status`, and the loader that
//! reads one source file (`DIR/<name>.toml`) into a run — the keys of `outboxd run`'s
//! configuration file, read by `config_file` and parsed by `run`'s own flags, so every `run`
//! flag works per source and is checked the same way. The supervision is the library's
//! (`crate::fleet`).

use super::config_file;
use super::run::{plan, RunArgs};
use super::{parse_duration, Cli};
use crate::fleet::members::Members;
use crate::fleet::{Fleet, FleetOptions, Loader, Tenant};
use crate::Error;
use clap::{Args, CommandFactory, FromArgMatches, Subcommand};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct FleetArgs {
    #[command(subcommand)]
    pub command: Option<FleetCommand>,
    /// Directory of source files, one `<name>.toml` per source (the keys of `run`'s config
    /// file; the file name is the relay's --name). Read again every --rescan-interval and on
    /// SIGHUP.
    #[arg(long, env = "OUTBOXD_SOURCES", value_name = "DIR")]
    pub sources: Option<PathBuf>,
    /// How often the directory is read again for added, changed and removed files.
    #[arg(long, env = "OUTBOXD_RESCAN_INTERVAL", value_parser = parse_duration, default_value = "2s")]
    pub rescan_interval: Duration,
    /// Serve /metrics, /healthz, /readyz and /status (every source's state) on HOST:PORT.
    #[arg(long, env = "OUTBOXD_METRICS_ADDR")]
    pub metrics_addr: Option<String>,
    /// Several fleet processes on one directory: the Postgres database where they keep their
    /// heartbeat rows (table outboxd_fleet_members); each runs its share of the sources.
    #[arg(long, env = "OUTBOXD_MEMBERS", hide_env_values = true)]
    pub members: Option<crate::dsn::DsnArg>,
    /// File holding the --members DSN, or only its password.
    #[arg(long, env = "OUTBOXD_MEMBERS_FILE")]
    pub members_file: Option<PathBuf>,
    /// The fleet's name in --members (processes of one fleet share it).
    #[arg(long, env = "OUTBOXD_FLEET_NAME", default_value = "outboxd")]
    pub fleet_name: String,
    /// A member whose heartbeat is older than this is gone: its sources move to the others.
    #[arg(long, env = "OUTBOXD_MEMBER_TTL", value_parser = parse_duration, default_value = "5s")]
    pub member_ttl: Duration,
    /// Bound on the graceful stop after SIGINT/SIGTERM (every source stops at once).
    #[arg(long, env = "OUTBOXD_SHUTDOWN_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub shutdown_timeout: Duration,
}

#[derive(Debug, Clone, Subcommand)]
pub enum FleetCommand {
    /// Every source of a running fleet and its state, read from its /status.
    Status(FleetStatusArgs),
}

#[derive(Debug, Clone, Args)]
pub struct FleetStatusArgs {
    /// The fleet's --metrics-addr.
    #[arg(long, env = "OUTBOXD_METRICS_ADDR", default_value = "127.0.0.1:9187")]
    pub addr: String,
}

pub(super) async fn fleet(
    args: FleetArgs,
    m: &clap::ArgMatches,
    shutdown: CancellationToken,
) -> Result<(), Error> {
    if let Some(FleetCommand::Status(s)) = &args.command {
        return status(&s.addr).await;
    }
    let dir = args.sources.clone().ok_or_else(|| {
        Error::config(
            "no --sources given",
            "pass --sources DIR, a directory with one <name>.toml per source",
        )
    })?;
    let mut opts = FleetOptions::new(dir);
    opts.rescan = args.rescan_interval.max(Duration::from_millis(100));
    let mut fleet = Fleet::new(opts, loader());
    let from_argv = m.value_source("members") == Some(clap::parser::ValueSource::CommandLine);
    let members = match super::resolve_dsn(
        args.members.as_deref(),
        args.members_file.as_deref(),
        from_argv,
        "members",
    )? {
        None => None,
        Some(dsn) => {
            super::validate_name(&args.fleet_name)?;
            let crate::dsn::SourceDsn::Postgres(dsn) = crate::dsn::SourceDsn::parse(&dsn)? else {
                return Err(Error::config(
                    "--members takes a Postgres DSN",
                    "name the coordination database as postgres://user@host:5432/db",
                ));
            };
            let members = Members::join(dsn, &args.fleet_name, args.member_ttl).await?;
            tracing::info!(member = %members.me(), fleet = %args.fleet_name, "joined the fleet");
            fleet = fleet.with_share(members.clone());
            tokio::spawn(members.clone().keep(shutdown.clone()));
            Some(members)
        }
    };
    crate::telemetry::set_fleet(fleet.status());
    if let Some(addr) = &args.metrics_addr {
        crate::telemetry::serve(addr).await?;
    }
    let rescan = fleet.rescan_trigger();
    tokio::spawn(async move {
        use tokio::signal::unix::{signal, SignalKind};
        let Ok(mut hup) = signal(SignalKind::hangup()) else {
            tracing::warn!(
                "cannot install the SIGHUP handler: the directory is read on its interval only"
            );
            return;
        };
        while hup.recv().await.is_some() {
            rescan.notify_one();
        }
    });
    let result = fleet.run(shutdown).await;
    if let Some(m) = members {
        m.leave().await;
    }
    result
}

/// The command line's loader: a source file into a run plan.
pub fn loader() -> Loader {
    Arc::new(
        |name: &str, path: &Path| -> Result<Arc<dyn Tenant>, Error> {
            Ok(Arc::new(load(name, path)?))
        },
    )
}

/// Flags a source file may not set: the fleet owns them.
const FLEET_KEYS: &[(&str, &str)] = &[
    (
        "OUTBOXD_METRICS_ADDR",
        "the fleet serves one endpoint: set --metrics-addr on `outboxd fleet`",
    ),
    (
        "OUTBOXD_SHUTDOWN_TIMEOUT",
        "the fleet stops every source at once: set --shutdown-timeout on `outboxd fleet`",
    ),
];

/// Reads source `name`'s file at `path` as `outboxd run --config path --name name --ha` would,
/// with nothing from the environment (the fleet's environment is not every source's).
pub fn load(name: &str, path: &Path) -> Result<crate::pipeline::RunPlan, Error> {
    let root = Cli::command();
    let vars = config_file::load(&root, path, &["run".to_string()])?;
    let run = root
        .find_subcommand("run")
        .expect("the run subcommand exists")
        .clone()
        .mut_args(|a| a.env(None::<&'static str>));
    let bad = |problem: String, fix: &str| {
        Error::config(format!("{}: {problem}", path.display()), fix.to_string())
    };
    let mut argv: Vec<OsString> =
        vec!["run".into(), format!("--name={name}").into(), "--ha".into()];
    let flags = root
        .find_subcommand("run")
        .expect("the run subcommand exists");
    for (env, value) in vars {
        if let Some((_, fix)) = FLEET_KEYS.iter().find(|(e, _)| *e == env) {
            return Err(bad(format!("{env} is the fleet's, not a source's"), fix));
        }
        let Some(arg) = flags
            .get_arguments()
            .find(|a| a.get_env().is_some_and(|e| e == env.as_str()))
        else {
            return Err(bad(
                format!("{env} is not a flag of `outboxd run`"),
                "a source file holds `run`'s keys only (the fleet's log level and format are its own)",
            ));
        };
        let long = arg.get_long().unwrap_or_default();
        match long {
            "name" if value != name => {
                return Err(bad(
                    format!("name = {value:?}, but the file is {name}.toml"),
                    "the file's name is the relay's name: remove the name key, or rename the file",
                ))
            }
            "name" | "ha" => continue,
            _ => {}
        }
        if matches!(arg.get_action(), clap::ArgAction::SetTrue) {
            if matches!(value.as_str(), "true" | "1" | "yes" | "on") {
                argv.push(format!("--{long}").into());
            }
            continue;
        }
        argv.push(format!("--{long}={value}").into());
    }
    let m = run.try_get_matches_from(argv).map_err(|e| {
        bad(
            e.render()
                .to_string()
                .lines()
                .next()
                .unwrap_or_default()
                .to_string(),
            "correct the key (`outboxd run --help` lists them)",
        )
    })?;
    let args = RunArgs::from_arg_matches(&m).map_err(|e| bad(e.to_string(), "correct the key"))?;
    plan(&args, &m)
}

/// `outboxd fleet status`: one line per source.
async fn status(addr: &str) -> Result<(), Error> {
    let body = crate::telemetry::fetch(addr, "/status").await?;
    let v: serde_json::Value = serde_json::from_str(&body)
        .map_err(|e| Error::Other(format!("{addr}/status: not a fleet's answer: {e}")))?;
    let rows = v["sources"].as_array().cloned().unwrap_or_default();
    println!(
        "{:<24} {:<10} {:>10} {:>10} {:<24} detail",
        "source", "state", "published", "confirmed", "position"
    );
    for r in rows {
        let text = |k: &str| r[k].as_str().unwrap_or("").to_string();
        let detail = [text("reason"), text("config_error"), text("lease_holder")]
            .into_iter()
            .filter(|s| !s.is_empty())
            .collect::<Vec<_>>()
            .join("; ");
        println!(
            "{:<24} {:<10} {:>10} {:>10} {:<24} {}",
            text("name"),
            text("state"),
            r["published"].as_u64().unwrap_or(0),
            r["confirmed"].as_u64().unwrap_or(0),
            r["position"].as_str().unwrap_or("-"),
            detail
        );
    }
    Ok(())
}
