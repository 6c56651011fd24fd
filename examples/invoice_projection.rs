//! A complete effectively-once consumer: it keeps invoice totals per customer from the
//! `invoice.issued` / `invoice.cancelled` events the relay publishes, on Postgres or
//! MySQL/MariaDB, with outboxd's inbox and runner.
//!
//! The effect is deliberately *not* idempotent on its own — it adds to a running total and
//! appends a ledger row with no unique key — so every repeat that got through would show. The
//! inbox makes it run once per event.
//!
//! ```text
//! export OUTBOXD_BROKER=amqp://guest:guest@127.0.0.1:5672/%2f
//! export OUTBOXD_DB=postgres://postgres@127.0.0.1:5432/app
//! cargo run --example invoice_projection -- setup             # tables, then exit
//! cargo run --example invoice_projection -- run --consumer invoice_projection \
//!     --queue invoices --exchange outbox --bind 'invoice.#' --on-poison park
//!
//! # or read the relay's RabbitMQ stream (offsets stored on the broker under --consumer):
//! OUTBOXD_BROKER=rabbitmq-stream://guest:guest@127.0.0.1:5552/%2f \
//!     cargo run --example invoice_projection -- run --consumer invoice_projection --stream outbox
//! ```
//!
//! SIGINT/SIGTERM stop it gracefully (the message in hand is finished and acked); it then
//! prints its counters as one JSON line on stdout.

use clap::Parser;
use outboxd::consumer::cli::{ConsumeArgs, Database};
use outboxd::consumer::runner::Runner;
use outboxd::consumer::{
    ConsumerError, Handler, IdempotencyKey, Message, MyProcessor, PgProcessor,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Parser)]
#[command(about = "Invoice totals per customer from outboxd's invoice events, effectively once")]
struct Cli {
    /// Log level filter.
    #[arg(
        long,
        global = true,
        env = "OUTBOXD_LOG_LEVEL",
        default_value = "info,lapin=warn"
    )]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Create the inbox tables (migrations/) and the projection tables, then exit.
    Setup {
        /// postgres://… or mysql://…
        #[arg(long, env = "OUTBOXD_DB", hide_env_values = true)]
        db: String,
    },
    /// Consume until SIGINT/SIGTERM (or, with --until-empty, until the queue is drained).
    Run(Box<RunArgs>),
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    #[command(flatten)]
    consume: ConsumeArgs,
    /// Fault injection for tests: abort right after the Nth commit, before its ack or offset
    /// store (the crash the inbox exists for).
    #[arg(long, env = "OUTBOXD_CRASH_AFTER_COMMITS", hide = true)]
    crash_after_commits: Option<u64>,
}

/// What an invoice event carries.
#[derive(Debug, serde::Deserialize)]
struct InvoiceEvent {
    invoice_id: i64,
    customer: String,
    total_cents: i64,
}

const PG_PROJECTION: &str = "
CREATE TABLE IF NOT EXISTS invoice_totals (
    customer     text   PRIMARY KEY,
    invoices     bigint NOT NULL,
    total_cents  bigint NOT NULL
);
-- No unique key on purpose: a repeated effect would add a second row.
CREATE TABLE IF NOT EXISTS invoice_ledger (
    event_id     uuid   NOT NULL,
    invoice_id   bigint NOT NULL,
    customer     text   NOT NULL,
    delta_cents  bigint NOT NULL,
    einvoice_key uuid   NOT NULL,
    applied_at   timestamptz NOT NULL DEFAULT now()
);";

const MY_PROJECTION: &str = "
CREATE TABLE IF NOT EXISTS invoice_totals (
    customer     VARCHAR(100) NOT NULL PRIMARY KEY,
    invoices     BIGINT NOT NULL,
    total_cents  BIGINT NOT NULL
) ENGINE = InnoDB;
CREATE TABLE IF NOT EXISTS invoice_ledger (
    event_id     BINARY(16) NOT NULL,
    invoice_id   BIGINT NOT NULL,
    customer     VARCHAR(100) NOT NULL,
    delta_cents  BIGINT NOT NULL,
    einvoice_key CHAR(36) NOT NULL,
    applied_at   DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    KEY (event_id)
) ENGINE = InnoDB;";

/// The projection: the same effect on either database.
struct Projection {
    consumer: String,
}

impl Projection {
    /// How the event changes the totals: (invoices, cents).
    fn delta(&self, msg: &Message) -> Result<(InvoiceEvent, i64, i64), ConsumerError> {
        let ev: InvoiceEvent = msg.json()?;
        let (n, cents) = match msg.topic.as_str() {
            "invoice.issued" => (1, ev.total_cents),
            "invoice.cancelled" => (-1, -ev.total_cents),
            other => return Err(ConsumerError::permanent(format!("unknown topic {other:?}"))),
        };
        Ok((ev, n, cents))
    }

    /// The key an e-invoice API would deduplicate on (its ETTN is a UUID): the same on every
    /// redelivery of this event, so a call repeated after a crash creates no second invoice.
    fn einvoice_key(&self, msg: &Message) -> uuid::Uuid {
        IdempotencyKey::derive(msg.id, &self.consumer, "e-invoice").uuid()
    }
}

impl Handler<tokio_postgres::Transaction<'_>> for Projection {
    async fn handle(
        &self,
        tx: &mut tokio_postgres::Transaction<'_>,
        msg: &Message,
    ) -> Result<(), ConsumerError> {
        let (ev, n, cents) = self.delta(msg)?;
        tx.execute(
            "INSERT INTO invoice_totals (customer, invoices, total_cents) VALUES ($1, $2, $3)
             ON CONFLICT (customer) DO UPDATE
             SET invoices = invoice_totals.invoices + EXCLUDED.invoices,
                 total_cents = invoice_totals.total_cents + EXCLUDED.total_cents",
            &[&ev.customer, &n, &cents],
        )
        .await?;
        tx.execute(
            "INSERT INTO invoice_ledger (event_id, invoice_id, customer, delta_cents, einvoice_key)
             VALUES ($1, $2, $3, $4, $5)",
            &[
                &msg.id,
                &ev.invoice_id,
                &ev.customer,
                &cents,
                &self.einvoice_key(msg),
            ],
        )
        .await?;
        Ok(())
    }
}

impl Handler<mysql_async::Transaction<'_>> for Projection {
    async fn handle(
        &self,
        tx: &mut mysql_async::Transaction<'_>,
        msg: &Message,
    ) -> Result<(), ConsumerError> {
        use mysql_async::prelude::Queryable;
        let (ev, n, cents) = self.delta(msg)?;
        tx.exec_drop(
            "INSERT INTO invoice_totals (customer, invoices, total_cents) VALUES (?, ?, ?)
             ON DUPLICATE KEY UPDATE invoices = invoices + VALUES(invoices),
                                     total_cents = total_cents + VALUES(total_cents)",
            (&ev.customer, n, cents),
        )
        .await?;
        tx.exec_drop(
            "INSERT INTO invoice_ledger (event_id, invoice_id, customer, delta_cents, einvoice_key)
             VALUES (?, ?, ?, ?, ?)",
            (
                msg.id.as_bytes().to_vec(),
                ev.invoice_id,
                &ev.customer,
                cents,
                self.einvoice_key(msg).to_string(),
            ),
        )
        .await?;
        Ok(())
    }
}

async fn setup(db: &Database) -> Result<(), ConsumerError> {
    // The kit's setup: the inbox tables of migrations/*/003_processed_messages.sql, and an
    // in-place migration of those an earlier release created.
    let migrated = match db {
        Database::Postgres(dsn) => {
            let mut c = outboxd::source::postgres::connect_sql(dsn, "invoice_projection").await?;
            let done = outboxd::consumer::setup::postgres(&mut c).await?;
            c.batch_execute(PG_PROJECTION).await?;
            done
        }
        Database::Mysql(dsn) => {
            use mysql_async::prelude::Queryable;
            let mut c = outboxd::consumer::mysql::connect(dsn).await?;
            let done = outboxd::consumer::setup::mysql(&mut c).await?;
            c.query_drop(MY_PROJECTION).await?;
            let _ = c.disconnect().await;
            done
        }
    };
    for step in migrated {
        println!("ok   migrated {step}");
    }
    println!("ok   inbox and projection tables");
    Ok(())
}

/// SIGINT/SIGTERM: graceful stop; a second one exits at once.
async fn watch_signals(shutdown: CancellationToken) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return;
    };
    tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
    tracing::info!("stopping: finishing the message in hand (signal again to exit at once)");
    shutdown.cancel();
    tokio::select! { _ = int.recv() => {}, _ = term.recv() => {} }
    std::process::exit(1);
}

async fn run(cli: RunArgs) -> Result<(), ConsumerError> {
    let db = cli.consume.database()?;
    let opts = cli.consume.runner_options()?;
    let inbox = cli.consume.inbox()?;
    // One worker per stream on a stream port; --concurrency on a queue.
    let workers = opts.workers(cli.consume.concurrency);
    let shutdown = CancellationToken::new();
    tokio::spawn(watch_signals(shutdown.clone()));

    let commits = Arc::new(AtomicU64::new(0));
    let crash_after = cli.crash_after_commits;
    let hook: outboxd::consumer::runner::CommitHook = Arc::new(move |msg, claim| {
        let n = commits.fetch_add(1, Ordering::SeqCst) + 1;
        if crash_after == Some(n) {
            eprintln!(
                "invoice_projection: crash injected after commit {n} ({} {}), before its ack or offset store",
                msg.id,
                claim.kind()
            );
            std::process::abort();
        }
    });
    let projection = || Projection {
        consumer: inbox.consumer().to_string(),
    };
    let stats;
    let result = match db {
        Database::Postgres(dsn) => {
            let ps = (0..workers)
                .map(|_| PgProcessor::new(dsn.clone(), inbox.clone(), projection()))
                .collect();
            let runner = Runner::new(opts, ps).on_commit(hook);
            stats = runner.stats();
            runner.run(shutdown).await
        }
        Database::Mysql(dsn) => {
            let ps = (0..workers)
                .map(|_| MyProcessor::new(dsn.clone(), inbox.clone(), projection()))
                .collect();
            let runner = Runner::new(opts, ps).on_commit(hook);
            stats = runner.stats();
            runner.run(shutdown).await
        }
    };
    println!("{}", serde_json::json!({ "stats": stats.json() }));
    result
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The relay's subscriber: the AMQP client's frame dumps (with the broker password) are
    // never logged, whatever --log-level says.
    outboxd::telemetry::init_logging(&cli.log_level, false);
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("invoice_projection: error: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match cli.command {
            Command::Setup { db } => {
                let db = match outboxd::dsn::SourceDsn::parse(&db)? {
                    outboxd::dsn::SourceDsn::Postgres(d) => Database::Postgres(d),
                    outboxd::dsn::SourceDsn::Mysql(d) => Database::Mysql(d),
                    outboxd::dsn::SourceDsn::File(_) => {
                        return Err(ConsumerError::config(
                            "--db is a binlog file",
                            "use postgres://… or mysql://…",
                        ))
                    }
                };
                setup(&db).await
            }
            Command::Run(args) => run(*args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("invoice_projection: error: {e}");
            let code = if matches!(e, ConsumerError::Config { .. }) {
                2
            } else {
                1
            };
            std::process::ExitCode::from(code)
        }
    }
}
