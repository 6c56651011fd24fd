//! Latency benchmark: commit → consume through the relay, beside a bare lapin publisher's
//! publish → consume, at the same steady rates. Run with `cargo bench --bench latency` (needs
//! the local services; `scripts/services.sh`).
//!
//! For each rate (`OUTBOXD_BENCH_RATES`, default `1000,5000` events/s) and
//! `OUTBOXD_BENCH_SECONDS` (default 10) seconds:
//! - relay: a producer commits one outbox row per transaction on a fixed schedule; a consumer
//!   on the relay's exchange records when each message arrives; latency = arrival − the time
//!   the producer's COMMIT returned.
//! - raw: a lapin publisher (persistent, confirms, pipelined) publishes the same bodies on the
//!   same schedule to a queue; latency = arrival − publish call.
//!
//! The relay runs once on Postgres and once on MariaDB (`OUTBOXD_BENCH_SOURCES`, default
//! `postgres,mariadb`), each with its own producer writing the same bodies.
//!
//! Both consumers run in this process with the same clock. Prints p50 / p99 / p99.9 per row.

pub(crate) mod support;

use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions,
    QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties, ExchangeKind};
use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";
const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
/// Producer connections sharing the commit schedule.
const PRODUCERS: usize = 8;

pub(crate) async fn pg(conninfo: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("Postgres at {conninfo}: {e}; run scripts/services.sh"));
    tokio::spawn(conn);
    c
}

/// Milliseconds from each id's start to its arrival (ids that never arrived are left out).
pub(crate) fn latencies_ms(
    start: &HashMap<String, Instant>,
    arrivals: &HashMap<String, Instant>,
) -> Vec<f64> {
    start
        .iter()
        .filter_map(|(id, t)| {
            arrivals
                .get(id)
                .map(|a| a.saturating_duration_since(*t).as_secs_f64() * 1000.0)
        })
        .collect()
}

/// One measured run: what was offered, what the producer achieved, and the latencies of the
/// messages that arrived (those that never did are counted, and fail the bench).
pub(crate) struct Run {
    pub achieved: f64,
    pub sent: usize,
    pub latencies_ms: Vec<f64>,
}

impl Run {
    /// Messages sent that never arrived within the deadline.
    pub fn lost(&self) -> usize {
        self.sent - self.latencies_ms.len()
    }

    /// A table row: the achieved rate and the number of messages each percentile is over; a
    /// percentile is printed only when enough messages were measured for it to mean anything
    /// (p99 needs 100, p99.9 1,000).
    pub fn row(&self, path: &str, rate: u64) -> String {
        let n = self.latencies_ms.len();
        let mut v = self.latencies_ms.clone();
        v.sort_by(|a, b| a.partial_cmp(b).unwrap());
        let at = |q: f64, min: usize| -> String {
            if n == 0 || n < min {
                format!("n/a (n={n})")
            } else {
                format!("{:.2} (n={n})", v[((n as f64 - 1.0) * q).round() as usize])
            }
        };
        format!(
            "| {path} | {rate}/s | {:.0}/s | {} | {} | {} | {n} | {} |",
            self.achieved,
            at(0.5, 1),
            at(0.99, 100),
            at(0.999, 1000),
            self.lost()
        )
    }
}

#[allow(dead_code)] // benches/poll.rs uses it
pub(crate) fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64, usize) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), at(0.999), v.len())
}

/// Consumes `queue`, recording the arrival time of each message id.
pub(crate) async fn consume(
    conn: &Connection,
    queue: &str,
    arrivals: Arc<Mutex<HashMap<String, Instant>>>,
) {
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(1000, Default::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "lat".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let now = Instant::now();
            if let Some(id) = d.properties.message_id() {
                arrivals.lock().unwrap().insert(id.to_string(), now);
            }
        }
    });
}

pub(crate) async fn declare_queue(conn: &Connection, exchange: Option<&str>, queue: &str) {
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
    if let Some(x) = exchange {
        ch.queue_bind(
            queue.into(),
            x.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    }
}

pub(crate) fn body(i: usize) -> String {
    format!(
        "{{\"invoice_id\":{i},\"customer_name\":\"Muhammet Şafak\",\"tax_id\":\"1234567890\",\"total\":\"1499.90\",\"currency\":\"TRY\",\"lines\":[{{\"sku\":\"A-100\",\"qty\":2,\"price\":\"499.95\"}},{{\"sku\":\"B-200\",\"qty\":1,\"price\":\"500.00\"}}],\"note\":\"{}\"}}",
        "x".repeat(60)
    )
}

/// The database side of a latency run: one outbox row per transaction, as a producer writes it.
// One value per run: its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Producer {
    Postgres {
        admin: tokio_postgres::Client,
        client: tokio_postgres::Client,
        insert: tokio_postgres::Statement,
    },
    MariaDb {
        admin: mysql_async::Conn,
        conn: mysql_async::Conn,
    },
}

impl Producer {
    async fn create(source: &str, db: &str) -> (Producer, String) {
        if source == "mariadb" {
            let conn = support::my_create_db(db).await;
            let admin = support::my_connect(None).await;
            let dsn = format!("mysql://root@127.0.0.1:3306/{db}?ssl-mode=disabled");
            return (Producer::MariaDb { admin, conn }, dsn);
        }
        let admin = pg(ADMIN).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
        let client = pg(&format!(
            "host=127.0.0.1 port=5432 user=postgres dbname={db}"
        ))
        .await;
        client
            .batch_execute(include_str!("../migrations/postgres/001_outbox.sql"))
            .await
            .unwrap();
        let insert = client
            .prepare("INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ($1, $2, 'invoice.issued', $3::text::json)")
            .await
            .unwrap();
        let dsn = format!("postgres://postgres@127.0.0.1:5432/{db}?sslmode=disable");
        (
            Producer::Postgres {
                admin,
                client,
                insert,
            },
            dsn,
        )
    }

    fn label(&self) -> &'static str {
        match self {
            Producer::Postgres { .. } => "Postgres",
            Producer::MariaDb { .. } => "MariaDB",
        }
    }

    /// Whether the relay's log stream into `db` is open.
    async fn streaming(&mut self, db: &str) -> bool {
        match self {
            Producer::Postgres { admin, .. } => admin
                .query_opt("SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid WHERE s.slot_name = 'outboxd_lat' AND s.database = $1", &[&db])
                .await
                .unwrap()
                .is_some(),
            Producer::MariaDb { admin, .. } => support::my_streaming(admin, db).await,
        }
    }

    /// Another producer connection to the same database (several share the schedule: one
    /// connection's commit, a log flush, can take longer than the gap between two events).
    async fn writer(&self, db: &str) -> Producer {
        match self {
            Producer::Postgres { .. } => {
                let admin = pg(ADMIN).await;
                let client = pg(&format!(
                    "host=127.0.0.1 port=5432 user=postgres dbname={db}"
                ))
                .await;
                let insert = client
                    .prepare("INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ($1, $2, 'invoice.issued', $3::text::json)")
                    .await
                    .unwrap();
                Producer::Postgres {
                    admin,
                    client,
                    insert,
                }
            }
            Producer::MariaDb { .. } => Producer::MariaDb {
                admin: support::my_connect(None).await,
                conn: support::my_connect(Some(db)).await,
            },
        }
    }

    /// Commits one row (autocommit: one transaction); returns when the commit did.
    async fn commit_one(&mut self, id: uuid::Uuid, i: usize) {
        match self {
            Producer::Postgres { client, insert, .. } => {
                client
                    .execute(&*insert, &[&id, &format!("agg-{}", i % 1000), &body(i)])
                    .await
                    .unwrap();
            }
            Producer::MariaDb { conn, .. } => {
                use mysql_async::prelude::Queryable;
                conn.exec_drop(
                    "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (?, ?, 'invoice.issued', ?, UTC_TIMESTAMP(6))",
                    (id.as_bytes().to_vec(), (i % 1000) as u64, body(i)),
                )
                .await
                .unwrap();
            }
        }
    }

    async fn drop_db(self, db: &str) {
        match self {
            Producer::Postgres { admin, client, .. } => {
                drop(client);
                let _ = admin
                    .batch_execute(&format!(
                        "SELECT pg_drop_replication_slot('outboxd_lat'); DROP DATABASE {db} WITH (FORCE)"
                    ))
                    .await;
            }
            Producer::MariaDb { conn, .. } => {
                drop(conn);
                support::my_drop_db(db).await;
            }
        }
    }
}

async fn relay_run(
    source: &str,
    rate: u64,
    seconds: u64,
    amqp: &Connection,
) -> (&'static str, Run) {
    let db = format!("lat_{}_{source}_{rate}", std::process::id());
    let (mut producer, dsn) = Producer::create(source, &db).await;
    let exchange = db.clone();
    let bin = env!("CARGO_BIN_EXE_outboxd");
    let mut relay = Command::new(bin)
        .args([
            "run",
            "--source",
            &dsn,
            "--name",
            "lat",
            "--sink",
            AMQP,
            "--exchange",
            &exchange,
            "--log-level",
            "warn",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // Wait for the relay's topology, then bind our queue.
    let queue = format!("{exchange}.all");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ch = amqp.create_channel().await.unwrap();
        let ok = ch
            .exchange_declare(
                exchange.clone().into(),
                ExchangeKind::Topic,
                ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok();
        if ok && producer.streaming(&db).await {
            break;
        }
        assert!(Instant::now() < deadline, "relay did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    declare_queue(amqp, Some(&exchange), &queue).await;
    let arrivals = Arc::new(Mutex::new(HashMap::new()));
    consume(amqp, &queue, arrivals.clone()).await;

    let n = (rate * seconds) as usize;
    let writers = PRODUCERS.min(n.max(1));
    let mut tasks = Vec::with_capacity(writers);
    let start = Instant::now();
    for w in 0..writers {
        let mut writer = producer.writer(&db).await;
        tasks.push(tokio::spawn(async move {
            let mut committed = Vec::with_capacity(n / writers + 1);
            for i in (w..n).step_by(writers) {
                let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    tokio::time::sleep(wait).await;
                }
                let id = uuid::Uuid::now_v7();
                writer.commit_one(id, i).await;
                committed.push((id.to_string(), Instant::now()));
            }
            committed
        }));
    }
    let mut committed: HashMap<String, Instant> = HashMap::with_capacity(n);
    for t in tasks {
        committed.extend(t.await.unwrap());
    }
    let achieved = n as f64 / start.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(120);
    while arrivals.lock().unwrap().len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    let _ = relay.wait();
    let arr = arrivals.lock().unwrap().clone();
    let lat = latencies_ms(&committed, &arr);
    let label = producer.label();
    eprintln!(
        "relay on {label}: offered {rate}/s, achieved {achieved:.0}/s, {} of {n} arrived",
        lat.len()
    );
    let ch = amqp.create_channel().await.unwrap();
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    producer.drop_db(&db).await;
    (
        label,
        Run {
            achieved,
            sent: n,
            latencies_ms: lat,
        },
    )
}

async fn raw_run(rate: u64, seconds: u64, amqp: &Connection) -> Run {
    let queue = format!("lat_raw_{}_{rate}", std::process::id());
    declare_queue(amqp, None, &queue).await;
    let arrivals = Arc::new(Mutex::new(HashMap::new()));
    consume(amqp, &queue, arrivals.clone()).await;
    let ch = amqp.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    let n = (rate * seconds) as usize;
    let mut sent: HashMap<String, Instant> = HashMap::with_capacity(n);
    let mut confirms = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0..n {
        let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
        let id = uuid::Uuid::now_v7().to_string();
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(id.clone().into())
            .with_content_type("application/json".into());
        sent.insert(id, Instant::now());
        let c = ch
            .basic_publish(
                "".into(),
                queue.clone().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body(i).as_bytes(),
                props,
            )
            .await
            .unwrap();
        confirms.push(c);
    }
    let achieved = n as f64 / start.elapsed().as_secs_f64();
    for c in confirms {
        let _ = c.await;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while arrivals.lock().unwrap().len() < n && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let arr = arrivals.lock().unwrap().clone();
    let lat: Vec<f64> = sent
        .iter()
        .filter_map(|(id, t)| {
            arr.get(id)
                .map(|a| a.saturating_duration_since(*t).as_secs_f64() * 1000.0)
        })
        .collect();
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    Run {
        achieved,
        sent: n,
        latencies_ms: lat,
    }
}

#[tokio::main]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("latency: skipped (run it with `cargo bench --bench latency`)");
        return;
    }
    let rates: Vec<u64> = std::env::var("OUTBOXD_BENCH_RATES")
        .unwrap_or_else(|_| "1000,5000".into())
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .collect();
    let seconds: u64 = std::env::var("OUTBOXD_BENCH_SECONDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10);
    let sources: Vec<String> = std::env::var("OUTBOXD_BENCH_SOURCES")
        .unwrap_or_else(|_| "postgres,mariadb".into())
        .split(',')
        .map(|s| s.trim().to_lowercase())
        .collect();
    let load_before = support::load_average();
    let amqp = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672; run scripts/services.sh");
    println!("| path | offered rate | achieved rate | p50 ms | p99 ms | p99.9 ms | measured | never arrived |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    let mut lost = Vec::new();
    for rate in rates {
        let path = "raw lapin publish → consume";
        let run = raw_run(rate, seconds, &amqp).await;
        println!("{}", run.row(path, rate));
        if run.lost() > 0 {
            lost.push(format!(
                "{path} at {rate}/s: {} of {}",
                run.lost(),
                run.sent
            ));
        }
        for source in &sources {
            let (label, run) = relay_run(source, rate, seconds, &amqp).await;
            let path = format!("outboxd: {label} commit → consume");
            println!("{}", run.row(&path, rate));
            if run.lost() > 0 {
                lost.push(format!(
                    "{path} at {rate}/s: {} of {}",
                    run.lost(),
                    run.sent
                ));
            }
        }
    }
    println!(
        "\nload average before: {load_before}, after: {}",
        support::load_average()
    );
    // A message that never arrived is not a slow one: the figures above would hide it.
    if !lost.is_empty() {
        eprintln!(
            "latency: FAILED, messages never arrived: {}",
            lost.join("; ")
        );
        std::process::exit(1);
    }
}
