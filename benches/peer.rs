//! A real peer, side by side: outboxd against the npm package `pg-transactional-outbox` (its
//! logical-replication listener; the handler in `benches/peer/listener.js` publishes each
//! message to RabbitMQ on an amqplib confirm channel, persistent and mandatory, and returns
//! only when the broker confirmed it). Run with `cargo bench --bench peer` (needs the local
//! services, `scripts/services.sh`, and node and npm: the bench installs the pinned packages of
//! `benches/peer/package-lock.json` with `npm ci` into `target/bench/peer-node` when they are
//! missing or changed, and fails, saying so, when npm does).
//!
//! In one run, one after the other, each with its own database, slot and queue:
//! 1. drain: `OUTBOXD_BENCH_PEER_EVENTS` (default 5,000; the peer is slow) outbox rows of the
//!    same ~300-byte JSON in transactions of 100, written while no relay runs, then drained
//!    into RabbitMQ (a topic exchange with the relay's alternate exchange, one durable queue
//!    bound with `#`) by
//!    - outboxd at its default settings (`outboxd setup`, then `outboxd run --snapshot never`);
//!    - the peer at its default concurrency (no strategy given: one mutex across all
//!      messages);
//!    - the peer in its order-keeping segment mode
//!      (`createReplicationSegmentMutexConcurrencyController`, the segment = the aggregate id,
//!      1,000 of them);
//!
//!    each timed from process start until every message is in the queue, or until the queue
//!    did not grow for `OUTBOXD_BENCH_STALL_SECONDS` (default 30): the time is then the one of
//!    the last message that came. The queue is then read whole and its message ids checked
//!    against the outbox table's: lost (an id never published), duplicated (an id more than
//!    once), and for the peer how many of the lost ones its table marks processed. CPU seconds
//!    (utime + stime of the relay / node process) and the peak RSS (sampled every 20 ms) beside,
//!    and the lines the peer's logger (at `warn`) wrote: its warnings and errors, such as a
//!    listener restart (copied to stderr).
//! 2. latency: at `OUTBOXD_BENCH_RATE` (default 1,000) rows/s for `OUTBOXD_BENCH_SECONDS`
//!    (default 10) s, one row per autocommit transaction from 8 producer connections (the
//!    latency bench's producer), commit → consumed p50 / p99 for outboxd and the peer's two
//!    modes, with the achieved rate and the counts beside every percentile.
//!
//! The peer's table is the package's own (its `DatabaseSetup` SQL: `id`, `aggregate_type`,
//! `aggregate_id`, `message_type`, `segment`, `payload jsonb`, …, with its publication and slot),
//! created by `node listener.js setup` in the run's database; outboxd's is
//! `migrations/postgres/001_outbox.sql`. Both get the same bodies.
//!
//! Prints two Markdown tables on stdout (progress on stderr). outboxd losing or duplicating a
//! message fails the bench (after the tables); the peer doing so is a measured figure.

mod support;

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, ConnectionProperties};
use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{cpu_secs, mib, pg, queue_len, rss_kib, AMQP, BIN, PG_ADMIN, PG_BODY};

/// Producer connections sharing the latency schedule (as benches/latency.rs).
const PRODUCERS: usize = 8;

/// The relays measured.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Relay {
    Outboxd,
    PeerDefault,
    PeerSegment,
}

impl Relay {
    const ALL: [Relay; 3] = [Relay::Outboxd, Relay::PeerDefault, Relay::PeerSegment];

    fn label(self) -> &'static str {
        match self {
            Relay::Outboxd => "outboxd (defaults)",
            Relay::PeerDefault => "pg-transactional-outbox, default concurrency (one mutex)",
            Relay::PeerSegment => "pg-transactional-outbox, segment mutex (segment = aggregate)",
        }
    }

    fn tag(self) -> &'static str {
        match self {
            Relay::Outboxd => "outboxd",
            Relay::PeerDefault => "peerdef",
            Relay::PeerSegment => "peerseg",
        }
    }

    fn peer_mode(self) -> Option<&'static str> {
        match self {
            Relay::Outboxd => None,
            Relay::PeerDefault => Some("default"),
            Relay::PeerSegment => Some("segment"),
        }
    }
}

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().replace('_', "").parse().ok())
        .unwrap_or(default)
}

/// The npm install of `benches/peer`: `npm ci` into `target/bench/peer-node` unless the
/// packages of the same lock file are there; returns that directory (with `listener.js`).
fn node_dir() -> PathBuf {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR"));
    let src = repo.join("benches/peer");
    let dir = repo.join("target/bench/peer-node");
    std::fs::create_dir_all(&dir).unwrap();
    let lock = std::fs::read(src.join("package-lock.json")).unwrap();
    let installed = std::fs::read(dir.join("package-lock.json")).ok();
    let ready = dir
        .join("node_modules/pg-transactional-outbox/package.json")
        .exists()
        && dir.join("node_modules/amqplib/package.json").exists()
        && installed.as_deref() == Some(lock.as_slice());
    for f in ["package.json", "package-lock.json", "listener.js"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    if !ready {
        eprintln!("peer: npm ci in {}", dir.display());
        let out = Command::new("npm")
            .args(["ci", "--no-audit", "--no-fund"])
            .current_dir(&dir)
            .stdout(Stdio::inherit())
            .stderr(Stdio::inherit())
            .status();
        let ok = matches!(out, Ok(s) if s.success());
        if !ok {
            let _ = std::fs::remove_file(dir.join("package-lock.json"));
            panic!(
                "peer: `npm ci` of benches/peer failed in {} ({out:?}): the bench needs node \
                 (20 or later) and npm on PATH and the npm registry reachable; fix that and run \
                 it again, or run `npm ci --no-audit --no-fund` in that directory yourself",
                dir.display()
            );
        }
    }
    dir
}

async fn undeclare(ch: &Channel, x: &str) {
    for q in [
        format!("{x}.all"),
        format!("{x}.unrouted"),
        format!("{x}.dead"),
    ] {
        let _ = ch
            .queue_delete(q.into(), QueueDeleteOptions::default())
            .await;
    }
    for e in [x.to_string(), format!("{x}.unrouted")] {
        let _ = ch
            .exchange_delete(e.into(), ExchangeDeleteOptions::default())
            .await;
    }
}

/// One run's database: its name, the slot its relay reads, a client in it.
struct Db {
    name: String,
    slot: String,
    client: tokio_postgres::Client,
    dsn: String,
}

/// A fresh database for `relay`, its outbox table, publication and slot, ready for rows.
async fn create_db(relay: Relay, part: &str, node: &Path) -> Db {
    let name = format!("peer_{part}_{}_{}", relay.tag(), std::process::id());
    let admin = pg(PG_ADMIN).await;
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    let client = pg(&format!(
        "host=127.0.0.1 port=5432 user=postgres dbname={name}"
    ))
    .await;
    let dsn = format!("postgres://postgres@127.0.0.1:5432/{name}?sslmode=disable");
    let slot = match relay {
        Relay::Outboxd => {
            client
                .batch_execute(include_str!("../migrations/postgres/001_outbox.sql"))
                .await
                .unwrap();
            let ok = Command::new(BIN)
                .args(["setup", "--source", &dsn, "--name", &name])
                .args(["--log-level", "warn"])
                .stdout(Stdio::null())
                .status()
                .unwrap()
                .success();
            assert!(ok, "outboxd setup failed");
            format!("outboxd_{name}")
        }
        _ => {
            let ok = node_command(node, &name, relay, "")
                .arg("setup")
                .status()
                .unwrap()
                .success();
            assert!(ok, "node listener.js setup failed");
            name.clone()
        }
    };
    Db {
        name,
        slot,
        client,
        dsn,
    }
}

async fn drop_db(db: Db) {
    drop(db.client);
    support::pg_drop(&db.name, &db.slot).await;
}

fn node_command(node: &Path, db: &str, relay: Relay, exchange: &str) -> Command {
    let mut c = Command::new("node");
    c.arg("listener.js")
        .current_dir(node)
        .env("PEER_DB", db)
        .env("PEER_SLOT", db)
        .env("PEER_PUBLICATION", db)
        .env("PEER_MODE", relay.peer_mode().unwrap_or("default"))
        .env("PEER_AMQP", AMQP)
        .env("PEER_EXCHANGE", exchange)
        .stdout(Stdio::null());
    c
}

/// Starts `relay` on `db`, publishing to exchange `x`. The peer's log (its logger at `warn`:
/// every line is a warning or an error, such as a listener restart) is copied to stderr and
/// its lines counted.
fn start(relay: Relay, db: &Db, x: &str, node: &Path) -> (Child, Arc<AtomicUsize>) {
    let logged = Arc::new(AtomicUsize::new(0));
    let child = match relay {
        Relay::Outboxd => Command::new(BIN)
            .args([
                "run",
                "--snapshot",
                "never",
                "--source",
                &db.dsn,
                "--name",
                &db.name,
                "--exchange",
                x,
                "--log-level",
                "warn",
            ])
            // The sink by the environment: a password on the command line draws a warning.
            .env("OUTBOXD_SINK", AMQP)
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn outboxd"),
        _ => {
            let mut child = node_command(node, &db.name, relay, x)
                .arg("listen")
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn node (is node on PATH?)");
            let out = BufReader::new(child.stdout.take().unwrap());
            let count = logged.clone();
            std::thread::spawn(move || {
                for line in out.lines().map_while(Result::ok) {
                    count.fetch_add(1, Ordering::Relaxed);
                    eprintln!("peer log: {line}");
                }
            });
            child
        }
    };
    (child, logged)
}

fn stop(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// Rows `from..to` (row numbers) of the same ~300-byte body into `relay`'s outbox table, in
/// one transaction.
fn insert_rows(relay: Relay, from: usize, to: usize) -> String {
    match relay {
        Relay::Outboxd => format!(
            "INSERT INTO outbox (id, aggregate_id, topic, payload)
             SELECT gen_random_uuid(), 'agg-' || (g % 1000), 'invoice.issued', {PG_BODY}
               FROM generate_series({from}, {to}) g"
        ),
        _ => format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, message_type, segment, payload)
             SELECT gen_random_uuid(), 'invoice', 'agg-' || (g % 1000), 'invoice.issued',
                    'agg-' || (g % 1000), ({PG_BODY})::jsonb
               FROM generate_series({from}, {to}) g"
        ),
    }
}

/// Every message of `queue` now (read and removed): message id → times seen.
async fn read_queue(conn: &Connection, queue: &str) -> HashMap<String, usize> {
    let ch = conn.create_channel().await.unwrap();
    let n = queue_len(&ch, queue).await as usize;
    ch.basic_qos(1000, Default::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "peer-check".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut got = 0;
    while got < n {
        match tokio::time::timeout(Duration::from_secs(10), consumer.next()).await {
            Ok(Some(Ok(d))) => {
                got += 1;
                let id = d
                    .properties
                    .message_id()
                    .as_ref()
                    .map(|s| s.to_string())
                    .unwrap_or_default();
                *seen.entry(id).or_default() += 1;
            }
            _ => panic!("{queue}: read {got} of its {n} messages"),
        }
    }
    let _ = ch.close(200, "OK".into()).await;
    seen
}

/// One drain's figures.
struct Drain {
    relay: Relay,
    events: usize,
    in_queue: usize,
    lost: usize,
    duplicated: usize,
    /// Peer only: of the lost ids, how many its table marks processed.
    lost_marked_processed: Option<usize>,
    secs: f64,
    cpu: f64,
    peak_kib: u64,
    stalled: bool,
    /// Peer only: lines its logger wrote (warnings and errors).
    logged: Option<usize>,
}

impl Drain {
    fn rate(&self) -> f64 {
        (self.in_queue - self.duplicated) as f64 / self.secs
    }

    fn cpu_ms_per_event(&self) -> f64 {
        self.cpu * 1000.0 / (self.in_queue - self.duplicated).max(1) as f64
    }
}

async fn drain(
    relay: Relay,
    events: usize,
    stall: Duration,
    conn: &Connection,
    ch: &Channel,
    node: &Path,
) -> Drain {
    let db = create_db(relay, "drain", node).await;
    let x = db.name.clone();
    let queue = support::declare_with_one_queue(ch, &x).await;
    let mut from = 0;
    while from < events {
        let to = (from + 100).min(events) - 1;
        db.client
            .batch_execute(&insert_rows(relay, from, to))
            .await
            .unwrap();
        from = to + 1;
    }
    let t = Instant::now();
    let (mut child, logged) = start(relay, &db, &x, node);
    let mut peak = 0;
    let (mut last_len, mut last_at) = (0, Instant::now());
    let mut stalled = false;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{}: exited early: {status}", relay.label());
        }
        peak = peak.max(rss_kib(child.id()).unwrap_or(0));
        let len = queue_len(ch, &queue).await as usize;
        if len != last_len {
            (last_len, last_at) = (len, Instant::now());
        }
        if len >= events {
            break;
        }
        if last_at.elapsed() >= stall {
            stalled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = last_at.duration_since(t).as_secs_f64();
    let cpu = cpu_secs(child.id()).unwrap_or(0.0);
    // A last look for late duplicates before the count.
    tokio::time::sleep(Duration::from_millis(500)).await;
    // Before the stop: what the peer logs while shutting down is not counted.
    let logged = logged.load(Ordering::Relaxed);
    stop(&mut child);
    let seen = read_queue(conn, &queue).await;
    let in_queue: usize = seen.values().sum();
    let duplicated = in_queue - seen.len();
    let rows = db
        .client
        .query(
            match relay {
                Relay::Outboxd => "SELECT id::text, false FROM outbox",
                _ => "SELECT id::text, processed_at IS NOT NULL FROM outbox",
            },
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), events, "the outbox table's rows");
    let mut lost = 0;
    let mut lost_processed = 0;
    let mut ids = HashSet::with_capacity(rows.len());
    for r in &rows {
        let id: String = r.get(0);
        if !seen.contains_key(&id) {
            lost += 1;
            if r.get::<_, bool>(1) {
                lost_processed += 1;
            }
        }
        ids.insert(id);
    }
    let strangers = seen.keys().filter(|id| !ids.contains(*id)).count();
    assert_eq!(strangers, 0, "messages in {queue} with no outbox row");
    let d = Drain {
        relay,
        events,
        in_queue,
        lost,
        duplicated,
        lost_marked_processed: (relay != Relay::Outboxd).then_some(lost_processed),
        secs,
        cpu,
        peak_kib: peak,
        stalled,
        logged: (relay != Relay::Outboxd).then_some(logged),
    };
    eprintln!(
        "drain, {}: {} of {events} in {secs:.1}s ({:.0} msg/s), lost {lost}, duplicated {duplicated}, {cpu:.2} CPU s, peak RSS {:.1} MiB{}",
        relay.label(),
        seen.len(),
        d.rate(),
        mib(peak),
        if stalled { ", stalled" } else { "" }
    );
    undeclare(ch, &x).await;
    drop_db(db).await;
    d
}

/// The ~300-byte body of row `i` (benches/latency.rs's).
fn body(i: usize) -> String {
    format!(
        "{{\"invoice_id\":{i},\"customer_name\":\"Muhammet Şafak\",\"tax_id\":\"1234567890\",\"total\":\"1499.90\",\"currency\":\"TRY\",\"lines\":[{{\"sku\":\"A-100\",\"qty\":2,\"price\":\"499.95\"}},{{\"sku\":\"B-200\",\"qty\":1,\"price\":\"500.00\"}}],\"note\":\"{}\"}}",
        "x".repeat(60)
    )
}

/// One latency run's figures.
struct Latency {
    relay: Relay,
    rate: u64,
    achieved: f64,
    sent: usize,
    received: usize,
    duplicated: usize,
    latencies_ms: Vec<f64>,
    /// Peer only: lines its logger wrote (warnings and errors).
    logged: Option<usize>,
}

async fn latency(
    relay: Relay,
    rate: u64,
    seconds: u64,
    stall: Duration,
    conn: &Connection,
    ch: &Channel,
    node: &Path,
) -> Latency {
    let db = create_db(relay, "lat", node).await;
    let x = db.name.clone();
    let queue = support::declare_with_one_queue(ch, &x).await;
    let (mut child, logged) = start(relay, &db, &x, node);
    // The relay streams when its slot is active.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("{}: exited early: {status}", relay.label());
        }
        let active = db
            .client
            .query_opt(
                "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND active",
                &[&db.slot],
            )
            .await
            .unwrap()
            .is_some();
        if active {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{}: did not stream",
            relay.label()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Arrivals: message id → (first arrival, times seen).
    let arrivals: Arc<Mutex<HashMap<String, (Instant, usize)>>> = Arc::default();
    let cch = conn.create_channel().await.unwrap();
    cch.basic_qos(1000, Default::default()).await.unwrap();
    let mut consumer = cch
        .basic_consume(
            queue.clone().into(),
            "peer-lat".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let arr = arrivals.clone();
    let reader = tokio::spawn(async move {
        while let Some(Ok(d)) = consumer.next().await {
            let now = Instant::now();
            if let Some(id) = d.properties.message_id() {
                arr.lock()
                    .unwrap()
                    .entry(id.to_string())
                    .or_insert((now, 0))
                    .1 += 1;
            }
        }
    });

    let n = (rate * seconds) as usize;
    let sql = match relay {
        Relay::Outboxd => "INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ($1, $2, 'invoice.issued', $3::text::json)",
        _ => "INSERT INTO outbox (id, aggregate_type, aggregate_id, message_type, segment, payload) VALUES ($1, 'invoice', $2, 'invoice.issued', $2, $3::text::jsonb)",
    };
    let writers = PRODUCERS.min(n.max(1));
    let mut ready = Vec::with_capacity(writers);
    for _ in 0..writers {
        let c = pg(&format!(
            "host=127.0.0.1 port=5432 user=postgres dbname={}",
            db.name
        ))
        .await;
        let st = c.prepare(sql).await.unwrap();
        ready.push((c, st));
    }
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (w, (c, st)) in ready.into_iter().enumerate() {
        tasks.push(tokio::spawn(async move {
            let mut committed = Vec::with_capacity(n / writers + 1);
            for i in (w..n).step_by(writers) {
                let due = t0 + Duration::from_secs_f64(i as f64 / rate as f64);
                if let Some(wait) = due.checked_duration_since(Instant::now()) {
                    tokio::time::sleep(wait).await;
                }
                let id = uuid::Uuid::now_v7();
                c.execute(&st, &[&id, &format!("agg-{}", i % 1000), &body(i)])
                    .await
                    .unwrap();
                committed.push((id.to_string(), Instant::now()));
            }
            committed
        }));
    }
    let mut committed = HashMap::with_capacity(n);
    for t in tasks {
        committed.extend(t.await.unwrap());
    }
    let achieved = n as f64 / t0.elapsed().as_secs_f64();
    // Until every message came, or none came for `stall`.
    let (mut last, mut last_at) = (0, Instant::now());
    loop {
        let got = arrivals.lock().unwrap().len();
        if got >= n {
            break;
        }
        if got != last {
            (last, last_at) = (got, Instant::now());
        }
        if last_at.elapsed() >= stall {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Before the stop: what the peer logs while shutting down is not counted.
    let logged = logged.load(Ordering::Relaxed);
    stop(&mut child);
    reader.abort();
    let _ = cch.close(200, "OK".into()).await;
    let arr = arrivals.lock().unwrap().clone();
    let mut latencies_ms = Vec::with_capacity(n);
    let mut duplicated = 0;
    for (id, at) in &committed {
        if let Some((a, times)) = arr.get(id) {
            latencies_ms.push(a.saturating_duration_since(*at).as_secs_f64() * 1000.0);
            duplicated += times - 1;
        }
    }
    let l = Latency {
        relay,
        rate,
        achieved,
        sent: n,
        received: latencies_ms.len(),
        duplicated,
        latencies_ms,
        logged: (relay != Relay::Outboxd).then_some(logged),
    };
    eprintln!(
        "latency, {}: offered {rate}/s, achieved {achieved:.0}/s, {} of {n} arrived, {duplicated} duplicated",
        relay.label(),
        l.received
    );
    undeclare(ch, &x).await;
    drop_db(db).await;
    l
}

fn log_cell(n: Option<usize>) -> String {
    n.map_or_else(|| "—".to_string(), |n| n.to_string())
}

fn ratio(x: f64) -> String {
    if x >= 10.0 {
        format!("{x:.0}×")
    } else {
        format!("{x:.2}×")
    }
}

#[tokio::main]
async fn main() {
    if support::skip_unless_bench("peer") {
        return;
    }
    let events = env_num("OUTBOXD_BENCH_PEER_EVENTS", 5_000) as usize;
    let rate = env_num("OUTBOXD_BENCH_RATE", 1_000);
    let seconds = env_num("OUTBOXD_BENCH_SECONDS", 10);
    let stall = Duration::from_secs(env_num("OUTBOXD_BENCH_STALL_SECONDS", 30));
    let load_before = support::load_average();
    let node = node_dir();
    let version = |pkg: &str| {
        let p = node.join(format!("node_modules/{pkg}/package.json"));
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap();
        v["version"].as_str().unwrap_or("?").to_string()
    };
    let node_version = Command::new("node")
        .arg("--version")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|_| "?".into());
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672; run scripts/services.sh");
    let ch = conn.create_channel().await.unwrap();

    let mut drains = Vec::new();
    for relay in Relay::ALL {
        drains.push(drain(relay, events, stall, &conn, &ch, &node).await);
    }
    let mut lats = Vec::new();
    for relay in Relay::ALL {
        lats.push(latency(relay, rate, seconds, stall, &conn, &ch, &node).await);
    }

    println!(
        "pg-transactional-outbox {}, amqplib {}, node {node_version}; drain of {events} backlogged events (~300-byte JSON, transactions of 100) into RabbitMQ, each relay on a fresh database and queue\n",
        version("pg-transactional-outbox"),
        version("amqplib")
    );
    println!("| relay | events | in queue (distinct) | lost | duplicated | lost but marked processed in its table | time to the last message | msg/s | CPU s | CPU ms / event | peak RSS MiB | outboxd msg/s ÷ this | this CPU per event ÷ outboxd's | peer log lines (warn, error) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let base = &drains[0];
    for d in &drains {
        println!(
            "| {} | {} | {} | {} | {} | {} | {:.1} s{} | {:.0} | {:.2} | {:.3} | {:.1} | {} | {} | {} |",
            d.relay.label(),
            d.events,
            d.in_queue - d.duplicated,
            d.lost,
            d.duplicated,
            d.lost_marked_processed
                .map_or_else(|| "—".to_string(), |n| n.to_string()),
            d.secs,
            if d.stalled {
                format!(" (then nothing for {} s)", stall.as_secs())
            } else {
                String::new()
            },
            d.rate(),
            d.cpu,
            d.cpu_ms_per_event(),
            mib(d.peak_kib),
            ratio(base.rate() / d.rate()),
            ratio(d.cpu_ms_per_event() / base.cpu_ms_per_event()),
            log_cell(d.logged),
        );
    }

    println!(
        "\ncommit → consumed at {rate} rows/s offered for {seconds} s (one row per autocommit transaction, {PRODUCERS} producer connections), each relay on a fresh database\n"
    );
    println!("| relay | offered | achieved | sent | received | never arrived | duplicated | p50 ms | p99 ms | this p99 ÷ outboxd's | peer log lines (warn, error) |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    let p = |l: &Latency| {
        let (p50, p99, _) = support::percentiles(l.latencies_ms.clone());
        (p50, p99)
    };
    let base_p99 = p(&lats[0]).1;
    for l in &lats {
        let (p50, p99) = p(l);
        let cell = |v: f64, min: usize| {
            if l.received >= min {
                format!("{v:.1}")
            } else {
                "n/a".into()
            }
        };
        println!(
            "| {} | {}/s | {:.0}/s | {} | {} | {} | {} | {} | {} | {} | {} |",
            l.relay.label(),
            l.rate,
            l.achieved,
            l.sent,
            l.received,
            l.sent - l.received,
            l.duplicated,
            cell(p50, 1),
            cell(p99, 100),
            if l.received >= 100 && lats[0].received >= 100 {
                ratio(p99 / base_p99)
            } else {
                "n/a".into()
            },
            log_cell(l.logged),
        );
    }
    println!(
        "\nload average before: {load_before}, after: {}",
        support::load_average()
    );
    let ours = drains
        .iter()
        .filter(|d| d.relay == Relay::Outboxd)
        .map(|d| (d.lost, d.duplicated))
        .chain(
            lats.iter()
                .filter(|l| l.relay == Relay::Outboxd)
                .map(|l| (l.sent - l.received, l.duplicated)),
        )
        .collect::<Vec<_>>();
    assert!(
        ours.iter().all(|&(lost, dup)| lost == 0 && dup == 0),
        "peer: FAILED, outboxd lost or duplicated messages (lost, duplicated): {ours:?}"
    );
}
