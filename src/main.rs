//! The `outboxd` binary: parses the command line, sets up logging and signals, runs the
//! command, and maps its result to the contract's exit codes. The command layer
//! (`src/commands/`, the only place `clap` lives besides the consumer binaries' flags in
//! `outboxd::consumer::cli`) is a module of this binary, not of the library.

// The command files name the library's modules as `crate::…` paths: these imports put the
// modules they use at this crate's root, so those paths read the same as they did inside the
// library. The modules only this binary needs are private to the library; `internal` lends it
// the items it calls from them, under the same paths.
use outboxd::internal::{db, debezium, diagnostics, progress, secret_file};
use outboxd::{
    consumer, crypto, dsn, event, fleet, outbox, pipeline, relay, sink, source, state, telemetry,
    tls, Error,
};

mod commands;

use clap::{CommandFactory, FromArgMatches};
use commands::{Cli, LogFormat};
use outboxd::ExitStatus;
use std::process::ExitCode;
use tokio_util::sync::CancellationToken;

/// Every event's publish allocates on the relay's thread (its message, lapin's frames, the
/// confirmation's future) and frees on another (lapin's I/O thread writes and drops the frames,
/// a runtime worker settles the confirmation). glibc's malloc sends such frees through the
/// allocating thread's arena lock, so on the RabbitMQ path about a third of the relay's CPU
/// was spent in malloc, free and that lock (docs/benchmarks.md); mimalloc frees across threads
/// without a shared lock.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    match try_main() {
        Ok(()) => ExitCode::from(ExitStatus::Done as u8),
        Err(e) => {
            let status = e
                .downcast_ref::<outboxd::Error>()
                .map(|e| e.exit_status())
                .unwrap_or(ExitStatus::Failed);
            eprintln!("outboxd: error: {e:#}");
            ExitCode::from(status as u8)
        }
    }
}

fn try_main() -> anyhow::Result<()> {
    // The config file fills in the environment for flags it names, before clap reads both.
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    commands::config_file::apply(&Cli::command(), &argv)?;
    let matches = match Cli::command().try_get_matches_from(argv) {
        Ok(m) => m,
        Err(e) => {
            // --help and --version print and exit 0; usage errors exit 2.
            e.exit();
        }
    };
    let cli = Cli::from_arg_matches(&matches)?;
    outboxd::telemetry::init_logging(&cli.log_level, cli.log_format == LogFormat::Json);
    // A one-shot command draws a bar only where someone watches: a terminal, text logs.
    let bars =
        std::io::IsTerminal::is_terminal(&std::io::stderr()) && cli.log_format == LogFormat::Text;
    progress::configure(cli.progress_interval, bars);
    let shutdown_timeout = match &cli.command {
        commands::Command::Run(a) => a.shutdown_timeout,
        commands::Command::Fleet(a) => a.shutdown_timeout,
        _ => std::time::Duration::from_secs(30),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let shutdown = CancellationToken::new();
        tokio::spawn(watch_signals(shutdown.clone(), shutdown_timeout));
        commands::execute(cli, &matches, shutdown).await
    })?;
    Ok(())
}

/// First SIGINT/SIGTERM: graceful stop, bounded by the shutdown timeout. Second: exit at once.
async fn watch_signals(shutdown: CancellationToken, timeout: std::time::Duration) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        tracing::error!("cannot install signal handlers");
        return;
    };
    tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
    tracing::info!(timeout = ?timeout, "shutting down: finishing the open transaction and waiting for confirms (signal again to exit at once)");
    shutdown.cancel();
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
        _ = tokio::time::sleep(timeout) => {
            eprintln!("outboxd: error: graceful shutdown did not finish within {timeout:?}; exiting (unconfirmed events will be delivered again)");
            std::process::exit(ExitStatus::Failed as i32);
        }
    }
    eprintln!(
        "outboxd: second signal: exiting at once (unconfirmed events will be delivered again)"
    );
    std::process::exit(ExitStatus::Failed as i32);
}
