//! Consumer kit benchmark, one run for every figure in docs/consumer.md: consumer throughput
//! with and without the inbox (Postgres and MariaDB, 1 and 4 workers), and `prune` speed on
//! both databases. Run with `cargo bench --bench consumer` (needs the local services;
//! `scripts/services.sh`).
//!
//! Throughput: `OUTBOXD_BENCH_MESSAGES` (default 20,000) invoice events are published to a
//! fresh queue, then the runner drains it (`until_empty`) with the invoice projection's effect
//! (an upsert of the customer's total and a ledger insert), one transaction per message or 20
//! (`--batch-size`), with the claim (inbox) or without it. Time runs from the runner's start
//! to its return.
//!
//! Prune: `OUTBOXD_BENCH_PRUNE_ROWS` (default 500,000) `processed_messages` rows older than
//! the window plus as many younger ones, pruned with `--batch 10000 --pause 0s`.

use futures::future::join_all;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::BasicProperties;
use outboxd::consumer::prune::{self, PruneOptions};
use outboxd::consumer::runner::{Runner, RunnerOptions};
use outboxd::consumer::{
    ConsumerError, Handler, Inbox, Message, MyProcessor, PgProcessor, Processor,
};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// (workers, messages per transaction) for each throughput run.
const RUNS: [(usize, usize); 3] = [(1, 1), (4, 1), (1, 20)];

const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
const PG_ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";

#[derive(serde::Deserialize)]
struct Invoice {
    invoice_id: i64,
    customer: String,
    total_cents: i64,
}

/// The invoice projection's effect (examples/invoice_projection.rs), without its extras.
struct Projection;

impl Handler<tokio_postgres::Transaction<'_>> for Projection {
    async fn handle(
        &self,
        tx: &mut tokio_postgres::Transaction<'_>,
        msg: &Message,
    ) -> Result<(), ConsumerError> {
        let ev: Invoice = msg.json()?;
        tx.execute(
            "INSERT INTO invoice_totals (customer, invoices, total_cents) VALUES ($1, 1, $2)
             ON CONFLICT (customer) DO UPDATE SET invoices = invoice_totals.invoices + 1,
               total_cents = invoice_totals.total_cents + EXCLUDED.total_cents",
            &[&ev.customer, &ev.total_cents],
        )
        .await?;
        tx.execute(
            "INSERT INTO invoice_ledger (event_id, invoice_id, customer, delta_cents) VALUES ($1, $2, $3, $4)",
            &[&msg.id, &ev.invoice_id, &ev.customer, &ev.total_cents],
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
        let ev: Invoice = msg.json()?;
        tx.exec_drop(
            "INSERT INTO invoice_totals (customer, invoices, total_cents) VALUES (?, 1, ?)
             ON DUPLICATE KEY UPDATE invoices = invoices + 1, total_cents = total_cents + VALUES(total_cents)",
            (&ev.customer, ev.total_cents),
        )
        .await?;
        tx.exec_drop(
            "INSERT INTO invoice_ledger (event_id, invoice_id, customer, delta_cents) VALUES (?, ?, ?, ?)",
            (msg.id.as_bytes().to_vec(), ev.invoice_id, &ev.customer, ev.total_cents),
        )
        .await?;
        Ok(())
    }
}

const PG_TABLES: &str = "
CREATE TABLE invoice_totals (customer text PRIMARY KEY, invoices bigint NOT NULL, total_cents bigint NOT NULL);
CREATE TABLE invoice_ledger (event_id uuid NOT NULL, invoice_id bigint NOT NULL, customer text NOT NULL, delta_cents bigint NOT NULL);";
const MY_TABLES: &str = "
CREATE TABLE invoice_totals (customer VARCHAR(100) PRIMARY KEY, invoices BIGINT NOT NULL, total_cents BIGINT NOT NULL);
CREATE TABLE invoice_ledger (event_id BINARY(16) NOT NULL, invoice_id BIGINT NOT NULL, customer VARCHAR(100) NOT NULL, delta_cents BIGINT NOT NULL);";

async fn pg(conninfo: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("Postgres at {conninfo}: {e}; run scripts/services.sh"));
    tokio::spawn(conn);
    c
}

async fn my(db: Option<&str>) -> mysql_async::Conn {
    mysql_async::Conn::new(
        mysql_async::OptsBuilder::default()
            .ip_or_hostname("127.0.0.1")
            .tcp_port(3306)
            .user(Some("root"))
            .db_name(db)
            .prefer_socket(false),
    )
    .await
    .unwrap_or_else(|e| panic!("MariaDB at 127.0.0.1:3306: {e}; run scripts/services.sh"))
}

/// Declares `queue` and fills it with `n` invoice events (publishes pipelined, all confirmed).
async fn fill(queue: &str, n: usize) {
    let conn = lapin::Connection::connect(AMQP, lapin::ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672; run scripts/services.sh");
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
        let mut pending = Vec::new();
        for &i in chunk {
            let customer = format!("cust-{}", i % 97);
            let mut h = FieldTable::default();
            h.insert(
                "x-aggregate-id".into(),
                AMQPValue::LongString(customer.clone().into()),
            );
            let props = BasicProperties::default()
                .with_message_id(uuid::Uuid::now_v7().to_string().into())
                .with_type("invoice.issued".into())
                .with_delivery_mode(2)
                .with_headers(h);
            let body = serde_json::json!({"invoice_id": i, "customer": customer, "total_cents": 100 + i % 1000})
                .to_string();
            pending.push(
                ch.basic_publish(
                    "".into(),
                    queue.into(),
                    BasicPublishOptions::default(),
                    body.as_bytes(),
                    props,
                )
                .await
                .unwrap(),
            );
        }
        for c in join_all(pending).await {
            c.unwrap();
        }
    }
    let _ = conn.close(200, "OK".into()).await;
}

async fn delete_queue(queue: &str) {
    if let Ok(conn) = lapin::Connection::connect(AMQP, lapin::ConnectionProperties::default()).await
    {
        if let Ok(ch) = conn.create_channel().await {
            let _ = ch.queue_delete(queue.into(), Default::default()).await;
        }
        let _ = conn.close(200, "OK".into()).await;
    }
}

/// Drains a queue of `n` fresh events with `processors`; messages per second.
async fn drain<P: Processor>(queue: &str, n: usize, processors: Vec<P>, batch: usize) -> f64 {
    fill(queue, n).await;
    let mut o = RunnerOptions::new(AMQP, queue);
    o.prefetch = 200;
    o.until_empty = true;
    o.batch_size = batch;
    let runner = Runner::new(o, processors);
    let stats = runner.stats();
    let start = Instant::now();
    runner
        .run(CancellationToken::new())
        .await
        .expect("runner failed");
    let secs = start.elapsed().as_secs_f64();
    let settled = stats.settled() as usize;
    assert!(settled >= n, "{settled} of {n} messages settled");
    if settled > n {
        // Redeliveries (a broker restart by another test suite on a shared machine): the
        // figure is then not comparable.
        eprintln!("note: {queue}: {} messages came twice", settled - n);
    }
    n as f64 / secs
}

fn pg_dsn(db: &str) -> outboxd::dsn::DbDsn {
    match outboxd::dsn::SourceDsn::parse(&format!("postgres://postgres@127.0.0.1:5432/{db}"))
        .unwrap()
    {
        outboxd::dsn::SourceDsn::Postgres(d) => d,
        _ => unreachable!(),
    }
}

fn my_dsn(db: &str) -> outboxd::dsn::DbDsn {
    match outboxd::dsn::SourceDsn::parse(&format!("mysql://root@127.0.0.1:3306/{db}")).unwrap() {
        outboxd::dsn::SourceDsn::Mysql(d) => d,
        _ => unreachable!(),
    }
}

fn prune_opts(table: &str) -> PruneOptions {
    PruneOptions {
        table: outboxd::outbox::TableName::parse(table).unwrap(),
        columns: Default::default(),
        older_than: Duration::from_secs(7 * 86400),
        batch: 10_000,
        pause: Duration::ZERO,
        dry_run: false,
        force: false,
        mode: outboxd::outbox::Mode::Cdc,
        consumer: None,
    }
}

#[tokio::main]
async fn main() {
    // `cargo test --all-targets` runs bench targets too (without --bench): this one is minutes
    // of load, so it runs only under `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        println!("consumer: skipped (run it with `cargo bench --bench consumer`)");
        return;
    }
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    // The figures depend on what else runs on the machine: say so next to them.
    let load = || {
        std::fs::read_to_string("/proc/loadavg")
            .unwrap_or_default()
            .split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    };
    let load_start = load();
    let started = Instant::now();
    let n = env("OUTBOXD_BENCH_MESSAGES", 20_000);
    let prune_rows = env("OUTBOXD_BENCH_PRUNE_ROWS", 500_000);
    let tag = std::process::id();
    let mut table = Vec::new();

    // Postgres.
    let db = format!("bench_consumer_{tag}");
    let admin = pg(PG_ADMIN).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let conninfo = format!("host=127.0.0.1 port=5432 user=postgres dbname={db}");
    let c = pg(&conninfo).await;
    c.batch_execute(include_str!(
        "../migrations/postgres/003_processed_messages.sql"
    ))
    .await
    .unwrap();
    c.batch_execute(PG_TABLES).await.unwrap();
    let dsn = pg_dsn(&db);
    for (workers, batch) in RUNS {
        for with_inbox in [true, false] {
            let q = format!("bench_consumer_{tag}_pg_{workers}_{batch}_{with_inbox}");
            let ps: Vec<_> = (0..workers)
                .map(|_| {
                    let p = PgProcessor::new(dsn.clone(), Inbox::new("bench").unwrap(), Projection);
                    if with_inbox {
                        p
                    } else {
                        p.without_inbox()
                    }
                })
                .collect();
            let rate = drain(&q, n, ps, batch).await;
            delete_queue(&q).await;
            table.push(format!(
                "| Postgres | {workers} | {batch} | {} | {n} | {rate:.0} msg/s |",
                if with_inbox { "yes" } else { "no" }
            ));
            eprintln!("{}", table.last().unwrap());
        }
    }
    c.batch_execute(&format!(
        "TRUNCATE processed_messages;
         INSERT INTO processed_messages (consumer, message_id, processed_at)
           SELECT 'bench', gen_random_uuid(), now() - interval '8 days' - g * interval '1 millisecond'
             FROM generate_series(1, {prune_rows}) g;
         INSERT INTO processed_messages (consumer, message_id, processed_at)
           SELECT 'bench', gen_random_uuid(), now() - g * interval '1 millisecond'
             FROM generate_series(1, {prune_rows}) g;"
    ))
    .await
    .unwrap();
    c.batch_execute("VACUUM ANALYZE processed_messages")
        .await
        .unwrap();
    let r = prune::prune_postgres(
        &dsn,
        &prune_opts("processed_messages"),
        &mut |_| {},
        &CancellationToken::new(),
    )
    .await
    .unwrap();
    assert_eq!(r.rows as usize, prune_rows);
    let pg_prune = format!(
        "| Postgres | {} | {} | {:.1} s | {:.0} rows/s |",
        r.rows,
        r.batches,
        r.elapsed.as_secs_f64(),
        r.rows_per_sec()
    );
    eprintln!("{pg_prune}");
    drop(c);
    admin
        .batch_execute(&format!("DROP DATABASE {db} WITH (FORCE)"))
        .await
        .unwrap();

    // MariaDB.
    {
        use mysql_async::prelude::Queryable;
        let mut admin = my(None).await;
        admin
            .query_drop(format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
        let mut c = my(Some(&db)).await;
        c.query_drop(include_str!(
            "../migrations/mysql/003_processed_messages.sql"
        ))
        .await
        .unwrap();
        c.query_drop(MY_TABLES).await.unwrap();
        let dsn = my_dsn(&db);
        for (workers, batch) in RUNS {
            for with_inbox in [true, false] {
                let q = format!("bench_consumer_{tag}_my_{workers}_{batch}_{with_inbox}");
                let ps: Vec<_> = (0..workers)
                    .map(|_| {
                        let p =
                            MyProcessor::new(dsn.clone(), Inbox::new("bench").unwrap(), Projection);
                        if with_inbox {
                            p
                        } else {
                            p.without_inbox()
                        }
                    })
                    .collect();
                let rate = drain(&q, n, ps, batch).await;
                delete_queue(&q).await;
                table.push(format!(
                    "| MariaDB | {workers} | {batch} | {} | {n} | {rate:.0} msg/s |",
                    if with_inbox { "yes" } else { "no" }
                ));
                eprintln!("{}", table.last().unwrap());
            }
        }
        c.query_drop(format!(
            "TRUNCATE processed_messages;
             INSERT INTO processed_messages (consumer, message_id, processed_at)
               SELECT 'bench', UNHEX(MD5(CONCAT('o', seq))), NOW(6) - INTERVAL 8 DAY - INTERVAL seq MICROSECOND
                 FROM seq_1_to_{prune_rows};
             INSERT INTO processed_messages (consumer, message_id, processed_at)
               SELECT 'bench', UNHEX(MD5(CONCAT('y', seq))), NOW(6) - INTERVAL seq MICROSECOND
                 FROM seq_1_to_{prune_rows};
             ANALYZE TABLE processed_messages;"
        ))
        .await
        .unwrap();
        let r = prune::prune_mysql(
            &dsn,
            &prune_opts("processed_messages"),
            &mut |_| {},
            &CancellationToken::new(),
        )
        .await
        .unwrap();
        assert_eq!(r.rows as usize, prune_rows);
        let my_prune = format!(
            "| MariaDB | {} | {} | {:.1} s | {:.0} rows/s |",
            r.rows,
            r.batches,
            r.elapsed.as_secs_f64(),
            r.rows_per_sec()
        );
        eprintln!("{my_prune}");
        let _ = c.disconnect().await;
        admin
            .query_drop(format!("DROP DATABASE {db}"))
            .await
            .unwrap();

        println!("\n| database | workers | batch | inbox | messages | throughput |\n|---|---|---|---|---|---|");
        for l in &table {
            println!("{l}");
        }
        println!("\n| database | rows pruned | batches | time | speed |\n|---|---|---|---|---|");
        println!("{pg_prune}");
        println!("{my_prune}");
        println!(
            "\nload average {load_start} at the start, {} at the end; {:.0} s in all; {} CPUs",
            load(),
            started.elapsed().as_secs_f64(),
            std::thread::available_parallelism().map_or(0, |n| n.get())
        );
    }
}
