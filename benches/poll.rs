//! Poll-mode benchmark, per database in one run (`cargo bench --bench poll`; needs the local
//! services, `scripts/services.sh`):
//! - latency: commit → consume at `OUTBOXD_BENCH_RATE` (default 1,000) events/s for
//!   `OUTBOXD_BENCH_SECONDS` (default 10) s, one row per transaction, through RabbitMQ: CDC
//!   mode beside poll mode (default `--poll-interval` 200 ms; on Postgres also with
//!   `--notify`). Each run has its own database, so no run sees another's rows.
//! - throughput: a backlog of `OUTBOXD_BENCH_BACKLOG` (default 50,000) pending rows drained by
//!   one poll relay, then (rows reset to pending) by three at once; time until no row is pending.
//! - idle cost: the server CPU (utime + stime of the server process or thread serving the
//!   poller's session, from /proc) over `OUTBOXD_BENCH_IDLE_SECONDS` (default 30) s of an
//!   idle poller on an empty table at the default interval, and the relay process's own;
//!   then idle CDC relays per source and sink, with their walsender or binlog dump thread
//!   (benches/poll/idle.rs: `OUTBOXD_BENCH_IDLE_CASES`, and `OUTBOXD_BENCH_BASELINE` for
//!   another binary measured beside this build). `OUTBOXD_BENCH_SOURCES=none` leaves the
//!   poller out.
//!
//! `OUTBOXD_BENCH_PARTS` (default `latency,drain,idle`) picks the parts, `OUTBOXD_BENCH_SOURCES`
//! (default `postgres,mariadb`) the databases, and `OUTBOXD_BENCH_POLL_ARGS` (whitespace
//! separated, e.g. `--poll-batch 2000`) is added to the draining relays' command line, so one
//! build compares settings.
//!
//! The consumer and the timing helpers are the latency benchmark's (benches/latency.rs), the
//! MariaDB connection the shared bench support's (benches/support/mod.rs).

#[allow(dead_code)]
#[path = "latency.rs"]
mod latency;

#[path = "poll/idle.rs"]
mod idle;

use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use latency::support::my_connect as my;
use latency::{body, percentiles, pg};
use mysql_async::prelude::Queryable;
use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const PG_ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";
const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Db {
    Postgres,
    Maria,
}

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// A fresh database with the contract's outbox table; dropped by [`Fresh::drop_db`].
struct Fresh {
    db: Db,
    name: String,
}

impl Fresh {
    async fn new(db: Db, tag: &str) -> Fresh {
        let name = format!("bpoll_{tag}_{}", std::process::id());
        match db {
            Db::Postgres => {
                pg(PG_ADMIN)
                    .await
                    .batch_execute(&format!("CREATE DATABASE {name}"))
                    .await
                    .unwrap();
                pg(&self_conninfo(&name))
                    .await
                    .batch_execute(include_str!("../migrations/postgres/001_outbox.sql"))
                    .await
                    .unwrap();
            }
            Db::Maria => {
                my(None)
                    .await
                    .query_drop(format!("CREATE DATABASE {name}"))
                    .await
                    .unwrap();
                my(Some(&name))
                    .await
                    .query_drop(include_str!("../migrations/mysql/001_outbox.sql"))
                    .await
                    .unwrap();
            }
        }
        Fresh { db, name }
    }

    fn dsn(&self) -> String {
        match self.db {
            Db::Postgres => format!(
                "postgres://postgres@127.0.0.1:5432/{}?sslmode=disable",
                self.name
            ),
            Db::Maria => format!("mysql://root@127.0.0.1:3306/{}?ssl-mode=disable", self.name),
        }
    }

    async fn producer(&self) -> Producer {
        match self.db {
            Db::Postgres => {
                let c = pg(&self_conninfo(&self.name)).await;
                let s = c
                    .prepare("INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ($1, $2, 'invoice.issued', $3::text::json)")
                    .await
                    .unwrap();
                Producer::Pg(c, s)
            }
            Db::Maria => Producer::My(my(Some(&self.name)).await),
        }
    }

    async fn pending(&self) -> i64 {
        let q = "SELECT COUNT(*) FROM outbox WHERE status = 'pending'";
        match self.db {
            Db::Postgres => pg(&self_conninfo(&self.name))
                .await
                .query_one(q, &[])
                .await
                .unwrap()
                .get(0),
            Db::Maria => {
                let mut c = my(Some(&self.name)).await;
                let n: Option<i64> = c.query_first(q).await.unwrap();
                let _ = c.disconnect().await;
                n.unwrap_or(0)
            }
        }
    }

    /// CPU seconds the relays' own poll sessions have cost the server so far (Postgres: their
    /// backends' utime + stime, from /proc; `None` on MariaDB, whose sessions are threads):
    /// unlike the whole server's CPU, no other client of the shared server is in it.
    async fn poller_backends_cpu(&self) -> Option<f64> {
        if self.db != Db::Postgres {
            return None;
        }
        let rows = pg(&self_conninfo(&self.name))
            .await
            .query(
                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name LIKE 'outboxd\\_%\\_poll'",
                &[&self.name],
            )
            .await
            .unwrap();
        Some(
            rows.iter()
                .filter_map(|r| latency::support::cpu_secs(r.get::<_, i32>(0) as u32))
                .sum(),
        )
    }

    async fn exec(&self, sql: &str) {
        match self.db {
            Db::Postgres => pg(&self_conninfo(&self.name))
                .await
                .batch_execute(sql)
                .await
                .unwrap(),
            Db::Maria => my(Some(&self.name)).await.query_drop(sql).await.unwrap(),
        }
    }

    async fn drop_db(self) {
        match self.db {
            Db::Postgres => {
                // Two requests: in one query string the DROP would run inside the implicit
                // transaction of the string and fail (the database was left behind).
                let admin = pg(PG_ADMIN).await;
                let _ = admin
                    .batch_execute(&format!(
                        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{}'",
                        self.name
                    ))
                    .await;
                admin
                    .batch_execute(&format!("DROP DATABASE {} WITH (FORCE)", self.name))
                    .await
                    .unwrap();
            }
            Db::Maria => {
                let _ = my(None)
                    .await
                    .query_drop(format!("DROP DATABASE IF EXISTS {}", self.name))
                    .await;
            }
        }
    }
}

fn self_conninfo(db: &str) -> String {
    format!("host=127.0.0.1 port=5432 user=postgres dbname={db}")
}

enum Producer {
    Pg(tokio_postgres::Client, tokio_postgres::Statement),
    My(mysql_async::Conn),
}

impl Producer {
    /// One event in its own (autocommit) transaction; returns once committed.
    async fn insert(&mut self, id: uuid::Uuid, i: usize) {
        match self {
            Producer::Pg(c, s) => {
                c.execute(&*s, &[&id, &format!("agg-{}", i % 1000), &body(i)])
                    .await
                    .unwrap();
            }
            Producer::My(c) => {
                c.exec_drop(
                    "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (?, ?, 'invoice.issued', ?, UTC_TIMESTAMP(6))",
                    (id.as_bytes().to_vec(), (i % 1000) as u64, body(i)),
                )
                .await
                .unwrap();
            }
        }
    }

    /// `n` pending rows in transactions of 1,000.
    async fn backlog(&mut self, n: usize) {
        let mut i = 0;
        while i < n {
            let k = 1000.min(n - i);
            match self {
                Producer::Pg(c, s) => {
                    let tx = c.transaction().await.unwrap();
                    for j in i..i + k {
                        tx.execute(
                            &*s,
                            &[
                                &uuid::Uuid::now_v7(),
                                &format!("agg-{}", j % 1000),
                                &body(j),
                            ],
                        )
                        .await
                        .unwrap();
                    }
                    tx.commit().await.unwrap();
                }
                Producer::My(c) => {
                    let mut tx = c
                        .start_transaction(mysql_async::TxOpts::default())
                        .await
                        .unwrap();
                    tx.exec_batch(
                        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (?, ?, 'invoice.issued', ?, UTC_TIMESTAMP(6))",
                        (i..i + k).map(|j| {
                            (uuid::Uuid::now_v7().as_bytes().to_vec(), (j % 1000) as u64, body(j))
                        }),
                    )
                    .await
                    .unwrap();
                    tx.commit().await.unwrap();
                }
            }
            i += k;
        }
    }
}

fn relay(dsn: &str, name: &str, sink: &str, exchange: &str, extra: &[&str]) -> Child {
    Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "run",
            "--source",
            dsn,
            "--name",
            name,
            "--sink",
            sink,
            "--exchange",
            exchange,
            "--log-level",
            "warn",
        ])
        .args(extra)
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

fn stop(mut child: Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
}

async fn exchange_exists(amqp: &Connection, exchange: &str) -> bool {
    let ch = amqp.create_channel().await.unwrap();
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .is_ok()
}

/// Commit → consume latency of one relay configuration at `rate` events/s.
async fn latency_run(
    db: Db,
    tag: &str,
    mode: &[&str],
    rate: u64,
    seconds: u64,
    amqp: &Connection,
) -> (f64, f64, f64, usize) {
    let fresh = Fresh::new(db, tag).await;
    if mode.contains(&"--notify") {
        // The trigger that wakes the poller, as `setup --notify` installs it.
        let ok = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args([
                "setup",
                "--mode",
                "poll",
                "--notify",
                "--source",
                &fresh.dsn(),
            ])
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success();
        assert!(ok, "setup --notify failed");
    }
    let exchange = format!("bpoll_{tag}_{}", std::process::id());
    let child = relay(&fresh.dsn(), tag, AMQP, &exchange, mode);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !exchange_exists(amqp, &exchange).await {
        assert!(
            Instant::now() < deadline,
            "{tag}: relay did not declare its exchange"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let queue = format!("{exchange}.all");
    declare_queue(amqp, Some(&exchange), &queue).await;
    let arrivals = Arc::new(Mutex::new(HashMap::new()));
    consume(amqp, &queue, arrivals.clone()).await;
    let mut producer = fresh.producer().await;
    // Warm-up: the relay is running (CDC: streaming) once one event made it through.
    let warm = uuid::Uuid::now_v7();
    producer.insert(warm, 0).await;
    while !arrivals.lock().unwrap().contains_key(&warm.to_string()) {
        assert!(
            Instant::now() < deadline,
            "{tag}: the warm-up event did not arrive"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let n = (rate * seconds) as usize;
    let mut committed: HashMap<String, Instant> = HashMap::with_capacity(n);
    let start = Instant::now();
    for i in 0..n {
        let due = start + Duration::from_secs_f64(i as f64 / rate as f64);
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            tokio::time::sleep(wait).await;
        }
        let id = uuid::Uuid::now_v7();
        producer.insert(id, i).await;
        committed.insert(id.to_string(), Instant::now());
    }
    let achieved = n as f64 / start.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(120);
    while arrivals.lock().unwrap().len() < n + 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop(child);
    let arr = arrivals.lock().unwrap().clone();
    let lat = latency::latencies_ms(&committed, &arr);
    eprintln!(
        "{tag}: offered {rate}/s, achieved {achieved:.0}/s, {} of {n} arrived",
        lat.len()
    );
    let ch = amqp.create_channel().await.unwrap();
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    drop(producer);
    fresh.drop_db().await;
    percentiles(lat)
}

/// Seconds for `relays` poll relays to drain a backlog of `n` rows.
/// How long `relays` poll relays take to drain `n` pending rows, and the CPU seconds the relays,
/// the database servers and the broker used meanwhile.
async fn drain_run(
    fresh: &Fresh,
    tag: &str,
    relays: usize,
    n: usize,
    args: &[&str],
    amqp: &Connection,
) -> (f64, f64, (f64, f64), Option<f64>) {
    let exchange = format!("bpoll_{tag}_{relays}_{}", std::process::id());
    let host_before = latency::support::host_cpu();
    let start = Instant::now();
    let children: Vec<Child> = (0..relays)
        .map(|r| relay(&fresh.dsn(), &format!("{tag}{r}"), AMQP, &exchange, args))
        .collect();
    let deadline = Instant::now() + Duration::from_secs(600);
    let mut left = fresh.pending().await;
    while left > 0 {
        assert!(
            Instant::now() < deadline,
            "{tag}: {left} of {n} rows still pending"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = fresh.pending().await;
    }
    let secs = start.elapsed().as_secs_f64();
    let host_after = latency::support::host_cpu();
    // The sessions are the relays' first ones (a reconnect would show in their log).
    let sessions_cpu = fresh.poller_backends_cpu().await;
    let relay_cpu: f64 = children
        .iter()
        .filter_map(|c| latency::support::cpu_secs(c.id()))
        .sum();
    for c in children {
        stop(c);
    }
    let ch = amqp.create_channel().await.unwrap();
    for q in [format!("{exchange}.unrouted"), format!("{exchange}.dead")] {
        let _ = ch
            .queue_delete(q.into(), QueueDeleteOptions::default())
            .await;
    }
    let host = (host_after.0 - host_before.0, host_after.1 - host_before.1);
    (secs, relay_cpu, host, sessions_cpu)
}

fn cpu_ticks(stat_path: &str) -> u64 {
    let s = std::fs::read_to_string(stat_path).unwrap_or_default();
    // Fields after the command name (which may hold spaces) start at ") ".
    let rest = s.rsplit_once(") ").map(|(_, r)| r).unwrap_or("");
    let f: Vec<&str> = rest.split_whitespace().collect();
    let get = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after the state.
    get(11) + get(12)
}

fn clk_tck() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

/// CPU of the server side of an idle poller and of the relay, in ms per minute.
async fn idle_run(db: Db, seconds: u64) -> (f64, f64) {
    let fresh = Fresh::new(db, "idle").await;
    let child = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "run",
            "--mode",
            "poll",
            "--source",
            &fresh.dsn(),
            "--name",
            "idle",
            "--commit-offsets",
            "--log-level",
            "warn",
        ])
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    // The relay opens `SESSIONS` database sessions; wait until all of them are connected
    // (bounded), then measure every one of them: an idle poller costs what all its sessions do.
    let want = outboxd::source::poll::SESSIONS;
    // The MariaDB server's pid, looked up once: its sessions are threads of this one process.
    let mariadbd = Command::new("pgrep")
        .args(["-x", "mariadbd"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("0")
                .trim()
                .to_string()
        })
        .unwrap_or_default();
    let waited = Instant::now();
    let server_stats: Vec<String> = loop {
        let stats = match db {
            Db::Postgres => pg(PG_ADMIN)
                .await
                .query(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'outboxd_idle_poll' AND datname = $1",
                    &[&fresh.name],
                )
                .await
                .expect("the poller's sessions")
                .iter()
                .map(|r| format!("/proc/{}/stat", r.get::<_, i32>(0)))
                .collect::<Vec<_>>(),
            Db::Maria => {
                let mut c = my(None).await;
                let tids: Vec<u64> = c
                    .exec(
                        "SELECT TID FROM information_schema.PROCESSLIST WHERE DB = ? AND ID <> CONNECTION_ID()",
                        (&fresh.name,),
                    )
                    .await
                    .unwrap();
                tids.iter()
                    .map(|t| format!("/proc/{mariadbd}/task/{t}/stat"))
                    .collect()
            }
        };
        if stats.len() >= want {
            break stats;
        }
        assert!(
            waited.elapsed() < Duration::from_secs(30),
            "the idle poller opened {} of its {want} sessions within 30 s",
            stats.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let server_ticks = || server_stats.iter().map(|p| cpu_ticks(p)).sum::<u64>();
    let relay_stat = format!("/proc/{}/stat", child.id());
    let (s0, r0) = (server_ticks(), cpu_ticks(&relay_stat));
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let (s1, r1) = (server_ticks(), cpu_ticks(&relay_stat));
    stop(child);
    fresh.drop_db().await;
    let per_min = |d: u64| d as f64 / clk_tck() * 1000.0 * 60.0 / seconds as f64;
    (per_min(s1 - s0), per_min(r1 - r0))
}

#[tokio::main]
async fn main() {
    if !std::env::args().any(|a| a == "--bench") {
        println!("poll: skipped (run it with `cargo bench --bench poll`)");
        return;
    }
    let rate = env_u64("OUTBOXD_BENCH_RATE", 1000);
    let seconds = env_u64("OUTBOXD_BENCH_SECONDS", 10);
    let backlog = env_u64("OUTBOXD_BENCH_BACKLOG", 50_000) as usize;
    let idle = env_u64("OUTBOXD_BENCH_IDLE_SECONDS", 30);
    let parts =
        std::env::var("OUTBOXD_BENCH_PARTS").unwrap_or_else(|_| "latency,drain,idle".into());
    let sources =
        std::env::var("OUTBOXD_BENCH_SOURCES").unwrap_or_else(|_| "postgres,mariadb".into());
    let picked = |db: Db| match db {
        Db::Postgres => sources.contains("postgres"),
        Db::Maria => sources.contains("mariadb"),
    };
    let drain_args = std::env::var("OUTBOXD_BENCH_POLL_ARGS").unwrap_or_default();
    let drain_args: Vec<&str> = ["--mode", "poll"]
        .into_iter()
        .chain(drain_args.split_whitespace())
        .collect();
    let amqp = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672; run scripts/services.sh");
    let started = Instant::now();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    if parts.contains("latency") {
        println!(
        "Latency, commit → consume at {rate} events/s for {seconds} s (one row per transaction):\n"
    );
        println!("| database | mode | p50 ms | p99 ms | p99.9 ms | messages |");
        println!("|---|---|---:|---:|---:|---:|");
        let runs: [(Db, &str, &str, &[&str]); 5] = [
            (Db::Postgres, "pgcdc", "CDC", &["--snapshot", "never"]),
            (Db::Postgres, "pgpoll", "poll (200 ms)", &["--mode", "poll"]),
            (
                Db::Postgres,
                "pgnotify",
                "poll (200 ms) + NOTIFY",
                &["--mode", "poll", "--notify"],
            ),
            (Db::Maria, "mycdc", "CDC", &["--snapshot", "never"]),
            (Db::Maria, "mypoll", "poll (200 ms)", &["--mode", "poll"]),
        ];
        for (db, tag, label, mode) in runs {
            if !picked(db) {
                continue;
            }
            let (p50, p99, p999, n) = latency_run(db, tag, mode, rate, seconds, &amqp).await;
            let name = if db == Db::Postgres {
                "Postgres"
            } else {
                "MariaDB"
            };
            println!("| {name} | {label} | {p50:.2} | {p99:.2} | {p999:.2} | {n} |");
        }
    }
    if parts.contains("drain") {
        println!("\nThroughput, draining {backlog} pending rows (poll mode, RabbitMQ sink, relay arguments `{}`):\n", drain_args.join(" "));
        println!("| database | relays | seconds | events/s | relays' CPU | database server's CPU (all clients) | the poll sessions' server CPU per row | broker CPU |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|");
        for db in [Db::Postgres, Db::Maria].into_iter().filter(|d| picked(*d)) {
            let fresh = Fresh::new(db, "drain").await;
            fresh.producer().await.backlog(backlog).await;
            let name = if db == Db::Postgres {
                "Postgres"
            } else {
                "MariaDB"
            };
            for relays in [1, 3] {
                if relays == 3 {
                    fresh
                        .exec("UPDATE outbox SET status = 'pending', published_at = NULL")
                        .await;
                }
                let (secs, relay_cpu, (server, broker), sessions) =
                    drain_run(&fresh, "drain", relays, backlog, &drain_args, &amqp).await;
                let per_row = sessions.map_or("n/a".to_string(), |c| {
                    format!("{:.1} µs", c * 1e6 / backlog as f64)
                });
                println!(
                "| {name} | {relays} | {secs:.1} | {:.0} | {relay_cpu:.1} s | {server:.1} s | {per_row} | {broker:.1} s |",
                backlog as f64 / secs
            );
            }
            fresh.drop_db().await;
        }
    }
    if parts.contains("idle") {
        println!(
        "\nIdle poller (empty table, --poll-interval 200 ms) over {idle} s, CPU ms per minute:\n"
    );
        println!("| database | server (the poller's sessions) | relay process |");
        println!("|---|---:|---:|");
        for db in [Db::Postgres, Db::Maria].into_iter().filter(|d| picked(*d)) {
            let (server, relay) = idle_run(db, idle).await;
            let name = if db == Db::Postgres {
                "Postgres"
            } else {
                "MariaDB"
            };
            println!("| {name} | {server:.0} | {relay:.0} |");
        }
        idle::report(idle).await;
        idle::fleet_process_report(idle).await;
    }
    let three = |l: &str| l.split_whitespace().take(3).collect::<Vec<_>>().join(" ");
    println!(
        "\n(load average at start: {}, at the end: {}; took {:.0} s)",
        three(&load),
        three(&std::fs::read_to_string("/proc/loadavg").unwrap_or_default()),
        started.elapsed().as_secs_f64()
    );
}

/// Consumes `queue`, recording the arrival time of each message id.
async fn consume(conn: &Connection, queue: &str, arrivals: Arc<Mutex<HashMap<String, Instant>>>) {
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
            // The first arrival counts: a redelivered duplicate does not move it.
            if let Some(id) = d.properties.message_id() {
                arrivals
                    .lock()
                    .unwrap()
                    .entry(id.to_string())
                    .or_insert(now);
            }
        }
    });
}

async fn declare_queue(conn: &Connection, exchange: Option<&str>, queue: &str) {
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
