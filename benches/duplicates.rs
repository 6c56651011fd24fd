//! Duplicates benchmark: how many events a SIGKILL of the relay at full speed makes the broker
//! see twice, against the bound the design gives. Run with `cargo bench --bench duplicates`
//! (needs the local services; `scripts/services.sh`).
//!
//! Full speed, for Postgres and MariaDB: a backlog of `OUTBOXD_BENCH_EVENTS` (default 200,000)
//! events in transactions of 100 is drained to RabbitMQ by a relay at its default settings;
//! `OUTBOXD_BENCH_FULL_KILLS` (default 5) times, at evenly spaced points of the drain, the relay
//! is killed with SIGKILL and started again at once; then the bench waits until every event id
//! arrived. Each repeated id is charged to the last SIGKILL before it arrived. The goal per
//! SIGKILL: the in-flight window (published, not yet confirmed) + 200 ms of traffic at the drain
//! rate measured over the half second before that kill (what was confirmed but not yet stored:
//! the relay's acknowledgement interval, 100 ms, plus the source's store period, the Postgres
//! status update or the MariaDB position write, at most every 100 ms while the position moves).
//!
//! Then a crash loop on each source (`tests/common/killloop.rs`, stdout sink, `--snapshot
//! never`, `--window 100`): a producer commits `OUTBOXD_BENCH_RATE` (default 300) single-row
//! transactions per second while the relay is SIGKILLed and restarted at once
//! `OUTBOXD_BENCH_KILLS` (default 20) times, each life 0.4–0.9 s. Reported: duplicates per
//! SIGKILL against the goal, the window + 200 ms of the producer's traffic.

#[path = "support/mod.rs"]
mod support;

#[path = "../tests/common/mod.rs"]
mod common;

use futures::StreamExt;
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use std::collections::HashSet;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::*;

/// The relay runs with its defaults: the in-flight window is the default `--window`.
const WINDOW: usize = outboxd::relay::DEFAULT_WINDOW;
const TX: usize = 100;
const ACK_INTERVAL: f64 = 0.1;
const STORE_PERIOD: f64 = 0.1;

fn relay(source: &str, exchange: &str) -> Child {
    Command::new(BIN)
        .env("OUTBOXD_SINK", AMQP)
        .args([
            "run",
            "--source",
            source,
            "--name",
            "dup",
            "--exchange",
            exchange,
        ])
        .args(["--snapshot", "never", "--log-level", "warn"])
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn outboxd")
}

fn signal(child: &mut Child, sig: &str) {
    let _ = Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status();
    let _ = child.wait();
}

/// Waits for the relay's exchange, then binds a queue of our own and consumes it: every
/// message id received, repeats included.
async fn consume(conn: &Connection, exchange: &str) -> Arc<Mutex<Vec<String>>> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let ch = conn.create_channel().await.unwrap();
        let passive = ExchangeDeclareOptions {
            passive: true,
            ..Default::default()
        };
        if ch
            .exchange_declare(
                exchange.into(),
                ExchangeKind::Topic,
                passive,
                FieldTable::default(),
            )
            .await
            .is_ok()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the relay did not declare {exchange}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ch = conn.create_channel().await.unwrap();
    let queue = format!("{exchange}.probe");
    let q = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    ch.queue_declare(queue.clone().into(), q, FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(
        queue.clone().into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.basic_qos(5_000, Default::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "dup".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let ids: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = ids.clone();
    tokio::spawn(async move {
        let _keep = ch;
        while let Some(Ok(d)) = consumer.next().await {
            if let Some(id) = d.properties.message_id() {
                sink.lock().unwrap().push(id.to_string());
            }
        }
    });
    ids
}

/// One SIGKILL of the full-speed loop: the drain rate just before it and the repeats that
/// arrived after it (until the next kill or the end).
struct Kill {
    rate: f64,
    duplicates: usize,
}

impl Kill {
    /// The goal for one SIGKILL: the in-flight window plus 200 ms of traffic (the
    /// acknowledgement interval and the store period, 100 ms each, confirmed but not stored).
    fn goal(&self) -> usize {
        WINDOW + (self.rate * (ACK_INTERVAL + STORE_PERIOD)).ceil() as usize
    }
}

struct Outcome {
    source: &'static str,
    events: usize,
    kills: Vec<Kill>,
    duplicates: usize,
    distinct: usize,
    seconds: f64,
}

/// Consumption rate over the last ~500 ms of `samples` (time, messages received so far): the
/// speed at the moment of the kill, not the life's average with its start in it.
fn recent_rate(samples: &[(Instant, usize)]) -> f64 {
    let Some(&(t1, n1)) = samples.last() else {
        return 0.0;
    };
    let from = samples
        .iter()
        .find(|(t, _)| t1.duration_since(*t) <= Duration::from_millis(500))
        .copied()
        .unwrap_or((t1, n1));
    let dt = t1.duration_since(from.0).as_secs_f64();
    if dt <= 0.0 {
        0.0
    } else {
        (n1 - from.1) as f64 / dt
    }
}

/// The trial itself, once the relay's position is stored and the backlog written: `kills`
/// SIGKILLs at evenly spaced points of the drain (each life restarted at once), then until every
/// id arrived. Each repeat is charged to the last SIGKILL before its arrival.
async fn kill_loop(
    source: &'static str,
    dsn: &str,
    exchange: &str,
    ids: Arc<Mutex<Vec<String>>>,
    events: usize,
    kills: usize,
) -> Outcome {
    let start = Instant::now();
    let deadline = start + Duration::from_secs(900);
    let mut r = relay(dsn, exchange);
    let mut marks = Vec::new(); // (index in `ids` at the kill, rate)
    for k in 1..=kills {
        let target = events * k / (kills + 1);
        let mut samples = Vec::new();
        loop {
            let n = ids.lock().unwrap().len();
            samples.push((Instant::now(), n));
            if n >= target {
                break;
            }
            assert!(Instant::now() < deadline, "{source}: drain stalled at {n}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        signal(&mut r, "-KILL");
        marks.push((ids.lock().unwrap().len(), recent_rate(&samples)));
        r = relay(dsn, exchange);
    }
    loop {
        let distinct = ids.lock().unwrap().iter().collect::<HashSet<_>>().len();
        if distinct >= events {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{source}: {distinct} of {events} arrived"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let seconds = start.elapsed().as_secs_f64();
    signal(&mut r, "-TERM");
    let all = ids.lock().unwrap().clone();
    let mut seen = HashSet::new();
    let mut kills_out: Vec<Kill> = marks
        .iter()
        .map(|&(_, rate)| Kill {
            rate,
            duplicates: 0,
        })
        .collect();
    let mut repeats_before_first = 0;
    for (i, id) in all.iter().enumerate() {
        if seen.insert(id.as_str()) {
            continue;
        }
        match marks.iter().rposition(|&(at, _)| at <= i) {
            Some(k) => kills_out[k].duplicates += 1,
            None => repeats_before_first += 1,
        }
    }
    // Without a crash the relay publishes each event once: a repeat before the first SIGKILL
    // is a bug, not a crash's cost.
    assert_eq!(
        repeats_before_first, 0,
        "{source}: repeats before any SIGKILL"
    );
    Outcome {
        source,
        events,
        kills: kills_out,
        duplicates: all.len() - seen.len(),
        distinct: seen.len(),
        seconds,
    }
}

async fn postgres(conn: &Connection, events: usize, kills: usize) -> Outcome {
    let (db, dsn, client) = pg_database("dup").await;
    let exchange = format!("dup_pg_{}", std::process::id());
    // First start on the empty table: declares the exchange and stores the position.
    let mut first = relay(&dsn, &exchange);
    let ids = consume(conn, &exchange).await;
    let deadline = Instant::now() + Duration::from_secs(60);
    while client
        .query_opt(
            "SELECT 1 FROM outboxd_state WHERE initialized_at IS NOT NULL",
            &[],
        )
        .await
        .ok()
        .flatten()
        .is_none()
    {
        assert!(
            Instant::now() < deadline,
            "postgres: first start did not finish"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    signal(&mut first, "-TERM");
    pg_backlog(&client, events, TX).await;
    let out = kill_loop("Postgres", &dsn, &exchange, ids, events, kills).await;
    drop(client);
    pg_drop(&db, "outboxd_dup").await;
    out
}

async fn mariadb(conn: &Connection, events: usize, kills: usize) -> Outcome {
    let (db, dsn, mut c) = my_database("dup").await;
    let exchange = format!("dup_my_{}", std::process::id());
    let mut first = relay(&dsn, &exchange);
    let ids = consume(conn, &exchange).await;
    my_wait_initialized(&mut c, "dup").await;
    signal(&mut first, "-TERM");
    my_backlog(&mut c, events, TX).await;
    let out = kill_loop("MariaDB", &dsn, &exchange, ids, events, kills).await;
    drop(c);
    my_drop_db(&db).await;
    out
}

#[tokio::main]
async fn main() {
    if skip_unless_bench("duplicates") {
        return;
    }
    let events = env_list("OUTBOXD_BENCH_EVENTS", "200000")[0];
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672; run scripts/services.sh");
    let kills = env_list("OUTBOXD_BENCH_FULL_KILLS", "5")[0];
    let rows = vec![
        postgres(&conn, events, kills).await,
        mariadb(&conn, events, kills).await,
    ];
    println!(
        "| full speed | events | SIGKILLs | drain rate at the kills | duplicates | per SIGKILL (worst) | goal for that SIGKILL (window + 200 ms) | all within | wall time |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---|---:|");
    for o in &rows {
        assert_eq!(o.distinct, o.events, "{}: events lost", o.source);
        let worst = o
            .kills
            .iter()
            .max_by_key(|k| k.duplicates)
            .expect("at least one SIGKILL");
        let (lo, hi) = o.kills.iter().fold((f64::MAX, 0f64), |(lo, hi), k| {
            (lo.min(k.rate), hi.max(k.rate))
        });
        let within = o.kills.iter().all(|k| k.duplicates <= k.goal());
        println!(
            "| {} | {} | {} | {:.0}–{:.0}/s | {} | {} | {} | {} | {:.1} s |",
            o.source,
            o.events,
            o.kills.len(),
            lo,
            hi,
            o.duplicates,
            worst.duplicates,
            worst.goal(),
            if within { "yes" } else { "NO" },
            o.seconds,
        );
    }
    println!();
    println!("| full speed, per SIGKILL | # | drain rate before it | duplicates after it | goal (window + 200 ms) |");
    println!("|---|---:|---:|---:|---:|");
    for o in &rows {
        for (i, k) in o.kills.iter().enumerate() {
            println!(
                "| {} | {} | {:.0}/s | {} | {} |",
                o.source,
                i + 1,
                k.rate,
                k.duplicates,
                k.goal()
            );
        }
    }
    kill_loops().await;
}

/// The crash loop on both sources: duplicates per SIGKILL against window + 200 ms of traffic.
async fn kill_loops() {
    use common::killloop::{self, Plan};
    const KILL_WINDOW: usize = 100;
    let kills = env_list("OUTBOXD_BENCH_KILLS", "20")[0];
    let rate = env_list("OUTBOXD_BENCH_RATE", "300")[0] as u32;
    let plan = Plan {
        kills,
        lives: [400, 700, 500, 900, 600, 800]
            .iter()
            .map(|&m| Duration::from_millis(m))
            .collect(),
        rate,
        produce_after: Some("resuming"),
    };
    let window = KILL_WINDOW.to_string();
    let base = |dsn: String, name: String| {
        let v = [
            "run",
            "--source",
            &dsn,
            "--name",
            &name,
            "--commit-offsets",
            "--window",
            &window,
            "--snapshot",
            "never",
        ];
        v.iter().map(|s| s.to_string()).collect::<Vec<String>>()
    };
    let mut rows = Vec::new();
    {
        let mut db = common::PgDb::create("dup_kl").await;
        let name = common::unique("kl");
        db.slots.push(format!("outboxd_{name}"));
        let args = base(db.dsn(), name);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = killloop::run(&args, &plan, Vec::new(), || {
            killloop::pg_producer(&db, rate, "kl.bench")
        })
        .await;
        rows.push(("Postgres", out));
    }
    {
        let db = common::MyDb::create("dup_kl").await;
        let name = common::unique("kl");
        let args = base(db.dsn(), name);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = killloop::run(&args, &plan, Vec::new(), || {
            killloop::my_producer(&db, rate, "kl.bench")
        })
        .await;
        rows.push(("MariaDB", out));
    }
    println!();
    println!("| crash loop | SIGKILLs | events | producer rate | lost | duplicates | per SIGKILL | goal per SIGKILL (window + 200 ms) | within |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---|");
    for (source, o) in &rows {
        let per_kill = o.duplicates() as f64 / o.kills.max(1) as f64;
        let goal = KILL_WINDOW as f64 + o.rate() * 0.2;
        println!(
            "| {source} | {} | {} | {:.0}/s | {} | {} | {per_kill:.1} | {goal:.0} | {} |",
            o.kills,
            o.expected.len(),
            o.rate(),
            o.lost().len(),
            o.duplicates(),
            if o.lost().is_empty() && per_kill <= goal {
                "yes"
            } else {
                "NO"
            }
        );
    }
}
