//! Latency benchmark: commit → consume through the relay, beside the two baselines it is judged
//! against, at the same steady rates. Run with `cargo bench --bench latency` (needs the local
//! services; `scripts/services.sh`).
//!
//! For each rate (`OUTBOXD_BENCH_RATES`, default `1000,5000` events/s) and each broker
//! (`OUTBOXD_BENCH_BROKERS`: `amqp` — the default, a classic queue —, `kafka`, `stream`; the
//! destinations, readers and bare publishers are `support::brokers`), each row runs
//! `OUTBOXD_BENCH_SECONDS` (default 10) seconds:
//! - raw: a bare publisher of the broker's client (AMQP persistent with confirms, Kafka
//!   idempotent with `acks=all`, a named stream producer; pipelined) publishes the bodies on a
//!   fixed schedule, with no database beside it; latency = arrival − publish call.
//! - dual write, per source: the naive pattern the outbox replaces. The relay row's producer
//!   (the same `PRODUCERS` connections, the same schedule, one row of the outbox table's shape
//!   per autocommit transaction) commits the row, then publishes the message itself
//!   with a bare publisher of the broker's client (on AMQP persistent, `mandatory`, to a topic
//!   exchange bound to the queue) and waits for its confirm (Kafka: the delivery report; one
//!   producer shared by the connections, as an application's workers share one)
//!   before its next commit; no relay runs. Latency = arrival − the time the
//!   COMMIT returned: the floor for any relay under the same database load.
//! - relay, per source: the same producer commits only; an `outboxd run` child tails the log
//!   and publishes to its exchange; latency = arrival − the time the COMMIT returned. The
//!   schedule starts once a first row came through (its time is printed below the table as
//!   the relay's start): the rows measure streaming, not the stream's opening.
//!
//! The sources are Postgres and MariaDB (`OUTBOXD_BENCH_SOURCES`, default `postgres,mariadb`);
//! every dual-write and relay row has its own fresh database. All rows are consumed by the same
//! in-process consumer (one arrival per message id, the first) with the same clock.
//!
//! Prints one Markdown table on stdout (progress goes to stderr): per rate and source, the
//! offered and achieved rate, messages sent and received, p50 / p99 / p99.9 over the received
//! messages, and on each relay row its p99 ÷ the dual-write p99 of the same source and rate
//! against the goal of ≤ 3×, flagged when the two producers' achieved rates differ by more than
//! 10 % (the dual write's producer waits for each confirm and can fall behind). A message that
//! never arrived within 120 s after the last send fails the bench (after the table is printed).
//!
//! A second table breaks each relay row down by stage from the relay's own histograms
//! (`--metrics-addr`, scraped before it stops), mean, p50 and p99 each: commit → sent by the
//! server (Postgres: the walsender's timestamp on the message), sent → read by the source (the
//! socket, the replication client's buffer), read → taken by the relay (decoding, the byte
//! budget, the relay's queue), taken → published (the sink's publish call), published →
//! confirmed, then confirmed → consumed (the bench's commit → consume minus the relay's commit
//! → confirm, by the means); and the relay's context switches (all threads) and CPU time per
//! event over the schedule, which do not move with the host's load as the times do.
//!
//! `OUTBOXD_BENCH_RELAY_THREADS=N` runs each relay with N tokio worker threads (default: one per
//! CPU).
//!
//! `OUTBOXD_BENCH_PIN=1` (root, cgroup v1 cpuset controller) runs every row with the database
//! servers and this process on CPU 0 and the broker and the relay on CPU 1 (see
//! `support::Pinning`), so host contention and the relay's own latency can be told apart; the
//! placement is printed under the tables.

pub(crate) mod support;

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::brokers::Broker;

const ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";
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

/// One measured run: what the producer achieved, how many messages it sent, and the latencies
/// of the messages that arrived (those that never did are counted, and fail the bench).
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

    /// Quantile `q` of the received messages' latencies, when enough were measured for it to
    /// mean anything (p50 needs 1 message, p99 100, p99.9 1,000).
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let n = self.latencies_ms.len();
        let min = if q >= 0.999 {
            1000
        } else if q >= 0.99 {
            100
        } else {
            1
        };
        if n < min {
            return None;
        }
        let mut v = self.latencies_ms.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        Some(v[((n as f64 - 1.0) * q).round() as usize])
    }

    /// A table row (the columns of `HEADER`); `ratio` is the last cell.
    pub fn row(&self, source: &str, path: &str, rate: u64, ratio: &str) -> String {
        let at = |q: f64| {
            self.quantile(q)
                .map_or_else(|| "n/a".to_string(), |v| format!("{v:.2}"))
        };
        format!(
            "| {source} | {path} | {rate}/s | {:.0}/s | {} | {} | {} | {} | {} | {} | {ratio} |",
            self.achieved,
            self.sent,
            self.latencies_ms.len(),
            at(0.5),
            at(0.99),
            at(0.999),
            self.lost()
        )
    }
}

/// The columns of `Run::row`.
const HEADER: &str = "| source | path | offered rate | achieved rate | sent | received | p50 ms | p99 ms | p99.9 ms | never arrived | relay p99 ÷ dual-write p99 (goal ≤ 3×) |\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|";

/// The goal: the relay's p99 at most this many times the dual write's, same source and rate.
const GOAL_RATIO: f64 = 3.0;

/// The last cell of a relay row: its p99 ÷ the dual write's, and whether the goal is met.
/// The dual write's producer waits for each confirm, so it can fall behind the schedule where
/// the relay's producer does not: when the two achieved rates differ by more than 10 % the
/// cell says so, the two p99s being then under different loads.
fn ratio_cell(relay: &Run, dual: &Run) -> String {
    let mut cell = match (relay.quantile(0.99), dual.quantile(0.99)) {
        (Some(r), Some(d)) if d > 0.0 => {
            let x = r / d;
            let verdict = if x <= GOAL_RATIO { "met" } else { "missed" };
            format!("{x:.1}× ({verdict})")
        }
        _ => "n/a (too few messages for a p99)".into(),
    };
    let (lo, hi) = if relay.achieved < dual.achieved {
        (relay.achieved, dual.achieved)
    } else {
        (dual.achieved, relay.achieved)
    };
    if lo < 0.9 * hi {
        cell += &format!(
            "; unequal load: dual write {:.0}/s, relay {:.0}/s",
            dual.achieved, relay.achieved
        );
    }
    cell
}

#[allow(dead_code)] // benches/poll.rs uses it
pub(crate) fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64, usize) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), at(0.999), v.len())
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

    /// Commits one row with `payload` (autocommit: one transaction); returns when the commit
    /// did.
    async fn commit_one(&mut self, id: uuid::Uuid, i: usize, payload: &str) {
        match self {
            Producer::Postgres { client, insert, .. } => {
                client
                    .execute(&*insert, &[&id, &format!("agg-{}", i % 1000), &payload])
                    .await
                    .unwrap();
            }
            Producer::MariaDb { conn, .. } => {
                use mysql_async::prelude::Queryable;
                conn.exec_drop(
                    "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (?, ?, 'invoice.issued', ?, UTC_TIMESTAMP(6))",
                    (id.as_bytes().to_vec(), (i % 1000) as u64, payload),
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
                // Two statements: a multi-statement batch runs in one transaction, which DROP
                // DATABASE refuses. A dual-write run has no slot.
                let _ = admin
                    .batch_execute(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = 'outboxd_lat'",
                    )
                    .await;
                let _ = admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                    .await;
            }
            Producer::MariaDb { conn, .. } => {
                drop(conn);
                support::my_drop_db(db).await;
            }
        }
    }
}

/// Commits `n` rows, row `i` due at `i / rate` s after the start, from `PRODUCERS` connections
/// to `db` taking turns (row `i` on connection `i % PRODUCERS`). With `publish` (a connection
/// and an exchange) each producer connection then publishes the row's message itself on a
/// confirm channel of its own and waits for the confirm before its next row: the dual write.
/// Returns when each row's COMMIT returned, by message id, and the achieved rate (rows ÷ the
/// time from the start until the last producer finished).
async fn produce(
    producer: &Producer,
    db: &str,
    rate: u64,
    n: usize,
    publish: Option<(Broker, &str)>,
) -> (HashMap<String, Instant>, f64) {
    let writers = PRODUCERS.min(n.max(1));
    // Every connection and channel is open before the schedule starts.
    let mut ready = Vec::with_capacity(writers);
    let mut first: Option<support::brokers::Publisher> = None;
    for _ in 0..writers {
        let writer = producer.writer(db).await;
        // A Kafka producer is shared by the writers, as by an application's workers.
        let publisher = match (publish, first.as_ref().and_then(|p| p.share())) {
            (Some(_), Some(shared)) => Some(shared),
            (Some((broker, dest)), None) => {
                let mut p = broker.publisher(dest).await;
                p.warm().await;
                first = p.share();
                Some(p)
            }
            (None, _) => None,
        };
        ready.push((writer, publisher));
    }
    let start = Instant::now();
    let mut tasks = Vec::with_capacity(writers);
    for (w, (mut writer, mut publisher)) in ready.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let mut committed = Vec::with_capacity(n / writers + 1);
            for i in (w..n).step_by(writers) {
                let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    tokio::time::sleep(wait).await;
                }
                let id = uuid::Uuid::now_v7();
                let payload = body(i);
                writer.commit_one(id, i, &payload).await;
                let at = Instant::now();
                let id = id.to_string();
                if let Some(p) = publisher.as_mut() {
                    // The dual write: publish the committed row's message, wait for the
                    // broker's confirm before the next row (a refusal panics in `send`).
                    let key = format!("agg-{}", i % 1000);
                    p.send(&id, &key, i, payload.as_bytes()).await.await;
                }
                committed.push((id, at));
            }
            committed
        }));
    }
    let mut committed: HashMap<String, Instant> = HashMap::with_capacity(n);
    for t in tasks {
        committed.extend(t.await.unwrap());
    }
    (committed, n as f64 / start.elapsed().as_secs_f64())
}

/// Waits (up to 120 s) until every one of `sent` arrived; returns the latencies of those that
/// did, in ms from their start.
async fn arrived(
    sent: &HashMap<String, Instant>,
    arrivals: &Arc<Mutex<HashMap<String, Instant>>>,
) -> Vec<f64> {
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let all = {
            let arr = arrivals.lock().unwrap();
            sent.keys().all(|id| arr.contains_key(id))
        };
        if all {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let arr = arrivals.lock().unwrap().clone();
    latencies_ms(sent, &arr)
}

/// One stage of a relay row from the relay's own histogram: events, mean, and the upper bounds
/// of the buckets that hold the p50 and the p99 (ms).
#[derive(Clone, Copy)]
struct Stage {
    n: u64,
    mean: f64,
    p50: f64,
    p99: f64,
}

fn stage(text: &str, name: &str) -> Option<Stage> {
    let (n, mean, p50) = support::histogram(text, name, 0.5)?;
    let (_, _, p99) = support::histogram(text, name, 0.99)?;
    Some(Stage {
        n,
        mean: mean * 1000.0,
        p50: p50 * 1000.0,
        p99: p99 * 1000.0,
    })
}

/// The relay's stages in path order and their histograms. The first two are measured on
/// Postgres only (the walsender stamps each message with its send time; a binlog event has
/// whole-second timestamps and no send time).
const STAGES: [(&str, &str); 5] = [
    ("commit → sent", "outboxd_stage_commit_sent_seconds"),
    ("sent → read", "outboxd_stage_sent_read_seconds"),
    ("read → taken", "outboxd_stage_read_taken_seconds"),
    ("taken → published", "outboxd_stage_taken_published_seconds"),
    ("published → confirmed", "outboxd_publish_confirm_seconds"),
];

/// What a relay row measured of the relay itself: its stage histograms (`None`: /metrics did not
/// answer), its commit → confirmed histogram, and its context switches and CPU time (ms) per
/// event over the schedule (load-independent where the stage times are not).
struct Stages {
    stages: Option<Vec<Option<Stage>>>,
    commit_confirm: Option<Stage>,
    switches_per_event: Option<f64>,
    cpu_us_per_event: Option<f64>,
}

/// Voluntary and involuntary context switches of every thread of `pid`, and its CPU time in
/// clock ticks (user + system).
fn proc_counts(pid: u32) -> Option<(u64, u64)> {
    let mut switches = 0;
    for task in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let status = std::fs::read_to_string(task.ok()?.path().join("status")).ok()?;
        switches += status
            .lines()
            .filter(|l| l.contains("ctxt_switches:"))
            .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
            .sum::<u64>();
    }
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command's closing parenthesis: utime and stime are the 12th and 13th.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((switches, ticks))
}

async fn relay_run(
    source: &str,
    rate: u64,
    seconds: u64,
    broker: Broker,
    pinning: Option<&support::Pinning>,
) -> (&'static str, Run, Duration, Stages) {
    let db = format!("lat_{}_{source}_{rate}", std::process::id());
    let (mut producer, dsn) = Producer::create(source, &db).await;
    // The destination exists before the relay starts (on AMQP with the relay's own topology,
    // which it finds as it would declare it), and is read from its start.
    broker.create(&db).await;
    let arrivals = Arc::new(Mutex::new(HashMap::new()));
    let reader = broker.read(&db, arrivals.clone()).await;
    let bin = env!("CARGO_BIN_EXE_outboxd");
    let metrics = support::free_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let mut relay = Command::new(bin)
        .args([
            "run",
            "--metrics-addr",
            &metrics_addr,
            "--source",
            &dsn,
            "--name",
            "lat",
            "--log-level",
            "warn",
        ])
        .args(broker.relay_args(&db))
        // `OUTBOXD_BENCH_RELAY_THREADS=N`: the relay's runtime with N worker threads (tokio's
        // `TOKIO_WORKER_THREADS`), this process's own runtime as it is.
        .envs(
            std::env::var("OUTBOXD_BENCH_RELAY_THREADS")
                .ok()
                .map(|n| ("TOKIO_WORKER_THREADS", n)),
        )
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    if let Some(p) = pinning {
        p.pin(1, relay.id()).expect("pinning the relay");
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while !producer.streaming(&db).await {
        assert!(Instant::now() < deadline, "relay did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The stream is open once the server lists it, but events flow only after the server has
    // found the start: MariaDB, opening by GTID, first reads the binlog file up to it (about
    // half a second per GB here). One row through the whole path before the schedule starts,
    // so the rows measure the relay streaming, not its start.
    let warm = uuid::Uuid::now_v7();
    let started = Instant::now();
    producer.commit_one(warm, 0, &body(0)).await;
    let warm = warm.to_string();
    while !arrivals.lock().unwrap().contains_key(&warm) {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "relay on {source}: the warm-up row did not arrive within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let warm_up = started.elapsed();
    arrivals.lock().unwrap().clear();

    let n = (rate * seconds) as usize;
    let before = proc_counts(relay.id());
    let (committed, achieved) = produce(&producer, &db, rate, n, None).await;
    let lat = arrived(&committed, &arrivals).await;
    let after = proc_counts(relay.id());
    let text = support::scrape_metrics(metrics);
    // Clock ticks are 10 ms here (USER_HZ 100).
    let per_event = |(s0, t0): (u64, u64), (s1, t1): (u64, u64)| {
        (
            (s1 - s0) as f64 / n as f64,
            (t1 - t0) as f64 * 10_000.0 / n as f64,
        )
    };
    let counts = before.zip(after).map(|(b, a)| per_event(b, a));
    let stages = Stages {
        stages: text
            .contains("# TYPE")
            .then(|| STAGES.iter().map(|(_, name)| stage(&text, name)).collect()),
        commit_confirm: stage(&text, "outboxd_commit_confirm_seconds"),
        switches_per_event: counts.map(|c| c.0),
        cpu_us_per_event: counts.map(|c| c.1),
    };
    let _ = Command::new("kill")
        .args(["-TERM", &relay.id().to_string()])
        .status();
    let _ = relay.wait();
    let label = producer.label();
    eprintln!(
        "relay on {label}: first row through after {:.0} ms; offered {rate}/s, achieved {achieved:.0}/s, {} of {n} arrived",
        warm_up.as_secs_f64() * 1000.0,
        lat.len()
    );
    reader.stop().await;
    broker.delete(&db).await;
    producer.drop_db(&db).await;
    (
        label,
        Run {
            achieved,
            sent: n,
            latencies_ms: lat,
        },
        warm_up,
        stages,
    )
}

/// A row of the stage table: where a relay row's commit → consume went, stage by stage (mean,
/// p50 and p99 bucket bounds of the relay's histograms), what is left after the confirmation
/// (the bench's commit → consume minus the relay's commit → confirm, by the means), and the
/// relay's context switches and CPU per event.
fn stage_row(label: &str, rate: u64, relay: &Run, stages: &Stages) -> String {
    let mean = relay.latencies_ms.iter().sum::<f64>() / relay.latencies_ms.len().max(1) as f64;
    let at = |q: f64| {
        relay
            .quantile(q)
            .map_or_else(|| "n/a".into(), |v| format!("{v:.2}"))
    };
    let mariadb = label.starts_with("MariaDB");
    let Some(parts) = &stages.stages else {
        return format!(
            "| {label} | {rate}/s | the relay's /metrics did not answer | | | | | | {mean:.2} / {} / {} | |",
            at(0.5),
            at(0.99)
        );
    };
    let cells: Vec<String> = parts
        .iter()
        .map(|s| match s {
            Some(s) => format!("{:.2} / ≤ {:.2} / ≤ {:.1}", s.mean, s.p50, s.p99),
            // The binlog source has no server send time; its commit time has whole seconds.
            None if mariadb => "n/a".into(),
            None => "none".into(),
        })
        .collect();
    // A binlog event's timestamp has whole seconds: commit → confirmed is off by up to a second
    // there, so what follows the confirmation is not shown either.
    let after_confirm = match stages.commit_confirm {
        Some(c) if !mariadb => format!("{:.2}", mean - c.mean),
        _ => "n/a".into(),
    };
    let counts = match (stages.switches_per_event, stages.cpu_us_per_event) {
        (Some(s), Some(c)) => format!("{s:.2} / {c:.0} µs"),
        _ => "n/a".into(),
    };
    let events = parts.iter().flatten().map(|s| s.n).max().unwrap_or(0);
    format!(
        "| {label} | {rate}/s | {events} | {} | {after_confirm} | {mean:.2} / {} / {} | {counts} |",
        cells.join(" | "),
        at(0.5),
        at(0.99)
    )
}

/// The naive dual write on `source`: the relay run's producer commits each row and then
/// publishes its message with a bare publisher of `broker`'s client and waits for the
/// confirm; no relay runs.
async fn dual_run(source: &str, rate: u64, seconds: u64, broker: Broker) -> (&'static str, Run) {
    let db = format!("lat_{}_{source}_{rate}_dual", std::process::id());
    let (producer, _) = Producer::create(source, &db).await;
    broker.create(&db).await;
    let arrivals = Arc::new(Mutex::new(HashMap::new()));
    let reader = broker.read(&db, arrivals.clone()).await;
    let n = (rate * seconds) as usize;
    let (committed, achieved) = produce(&producer, &db, rate, n, Some((broker, &db))).await;
    let lat = arrived(&committed, &arrivals).await;
    let label = producer.label();
    eprintln!(
        "dual write on {label}: offered {rate}/s, achieved {achieved:.0}/s, {} of {n} arrived",
        lat.len()
    );
    reader.stop().await;
    broker.delete(&db).await;
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

/// `broker` alone: a bare publisher on the schedule, no database; latency = arrival − the
/// publish call.
async fn raw_run(rate: u64, seconds: u64, broker: Broker) -> Run {
    let dest = format!("lat_raw_{}_{rate}", std::process::id());
    broker.create(&dest).await;
    let arrivals = Arc::new(Mutex::new(HashMap::new()));
    let reader = broker.read(&dest, arrivals.clone()).await;
    let mut publisher = broker.publisher(&dest).await;
    publisher.warm().await;
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
        sent.insert(id.clone(), Instant::now());
        let key = format!("agg-{}", i % 1000);
        confirms.push(publisher.send(&id, &key, i, body(i).as_bytes()).await);
    }
    let achieved = n as f64 / start.elapsed().as_secs_f64();
    for c in confirms {
        c.await;
    }
    let lat = arrived(&sent, &arrivals).await;
    eprintln!(
        "raw publisher ({}): offered {rate}/s, achieved {achieved:.0}/s, {} of {n} arrived",
        broker.label(),
        lat.len()
    );
    drop(publisher);
    reader.stop().await;
    broker.delete(&dest).await;
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
    let pinning = (std::env::var("OUTBOXD_BENCH_PIN").as_deref() == Ok("1")).then(|| {
        support::Pinning::start()
            .unwrap_or_else(|e| panic!("OUTBOXD_BENCH_PIN=1: {e}; or run without it"))
    });
    let brokers = Broker::list("OUTBOXD_BENCH_BROKERS", "amqp");
    println!("{HEADER}");
    let mut lost = Vec::new();
    let mut starts = Vec::new();
    let mut stage_rows = Vec::new();
    let mut check = |what: String, run: &Run| {
        if run.lost() > 0 {
            lost.push(format!("{what}: {} of {}", run.lost(), run.sent));
        }
    };
    for rate in rates {
        for &broker in &brokers {
            let b = broker.label();
            let path = format!("{b}: raw publish → consume");
            let run = raw_run(rate, seconds, broker).await;
            println!("{}", run.row("— (broker only)", &path, rate, ""));
            check(format!("{path} at {rate}/s"), &run);
            for source in &sources {
                let (label, dual) = dual_run(source, rate, seconds, broker).await;
                let path = format!("{b}: dual write: commit, publish, confirm → consume");
                println!("{}", dual.row(label, &path, rate, "1 (the floor)"));
                check(format!("{label} {path} at {rate}/s"), &dual);
                let (label, relay, warm_up, stages) =
                    relay_run(source, rate, seconds, broker, pinning.as_ref()).await;
                let label_b = format!("{label} → {b}");
                stage_rows.push(stage_row(&label_b, rate, &relay, &stages));
                starts.push(format!(
                    "{label_b} at {rate}/s {:.0} ms",
                    warm_up.as_secs_f64() * 1000.0
                ));
                let path = format!("{b}: outboxd: commit → consume");
                println!(
                    "{}",
                    relay.row(label, &path, rate, &ratio_cell(&relay, &dual))
                );
                check(format!("{label} {path} at {rate}/s"), &relay);
            }
        }
    }
    // Not in the percentiles: each relay row starts its schedule once a first row came through.
    println!(
        "\nrelay start (a first row committed as soon as the server lists the relay's stream → consumed; each relay row's schedule starts after it): {}",
        starts.join(", ")
    );
    println!(
        "\nThe relay rows by stage (ms, from the relay's own histograms: mean / p50 / p99, the percentiles as the upper bounds of buckets 1.5× apart; commit and sent are the server's timestamps, the rest this host's clock; MariaDB's binlog has no send time and whole-second commit times, so its first two stages are n/a):\n\n| source | rate | events | commit → sent (walsender) | sent → read (socket, replication client) | read → taken (decode, budget, relay queue) | taken → published (publish call) | published → confirmed | confirmed → consumed, mean | commit → consumed (bench): mean / p50 / p99 | relay context switches / CPU per event |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    );
    for row in &stage_rows {
        println!("{row}");
    }
    if let Some(p) = &pinning {
        println!("\npinned (cgroup v1 cpusets): {}", p.placement.join("; "));
    }
    println!(
        "\nload average before: {load_before}, after: {}",
        support::load_average()
    );
    support::brokers::finish().await;
    // A message that never arrived is not a slow one: the figures above would hide it.
    assert!(
        lost.is_empty(),
        "latency: FAILED, messages never arrived within 120 s: {}",
        lost.join("; ")
    );
}
