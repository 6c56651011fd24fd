//! Partitions benchmark: what `--partitions 4` costs the relay draining a backlog into
//! RabbitMQ. Run with `cargo bench --bench partitions` (needs the local services;
//! `scripts/services.sh`).
//!
//! In one run, for each round (`OUTBOXD_BENCH_ROUNDS`, default 1) it
//! 1. writes `OUTBOXD_BENCH_EVENTS` (default 200,000) outbox rows of ~300-byte JSON in
//!    transactions of 100 over 1,000 aggregates while no relay runs (a backlog in the slot);
//! 2. starts `outboxd run` without partitions on a fresh exchange with one durable queue bound
//!    with `#`, and measures from process start until the slot has confirmed the last commit;
//! 3. writes the same backlog again and drains it with `--partitions 4` on another fresh
//!    exchange (the relay declares `<exchange>.partitioned` and four queues);
//! 4. prints a Markdown table with both rates, the ratio, relay CPU and peak RSS.
//!
//! Every message is persistent, `mandatory`, confirmed; both runs put each event in exactly one
//! durable queue, so the difference is the partition headers, the headers exchange hop and the
//! spread over four queues.

use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
use lapin::{Channel, Connection, ConnectionProperties};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod support;

use support::{confirmed_lsn, cpu_secs, new_backlog, pg, queue_len, rss_kib, wal_end};

const ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";
const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// Runs the relay until the slot confirmed `end`; returns (seconds, peak RSS KiB, CPU seconds).
async fn relay_drain(
    bin: &str,
    dsn: &str,
    x: &str,
    extra: &[&str],
    admin: &tokio_postgres::Client,
    end: u64,
) -> (f64, u64, f64) {
    let t = Instant::now();
    let mut child = Command::new(bin)
        .args([
            "run",
            "--source",
            dsn,
            "--name",
            "bench",
            "--exchange",
            x,
            // The slot holds the backlog (setup created it before the rows were written):
            // a first-start snapshot of the pending rows would publish every event twice.
            "--snapshot",
            "never",
            "--log-level",
            "warn",
        ])
        .args(extra)
        .env("OUTBOXD_SINK", AMQP)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut peak = 0;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("outboxd exited early: {status}");
        }
        peak = peak.max(rss_kib(child.id()).unwrap_or(0));
        if confirmed_lsn(admin, "outboxd_bench").await >= end {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(1800),
            "drain took over 30 min"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_secs(child.id()).unwrap_or(0.0);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    assert!(status.success(), "outboxd stop: {status}");
    (secs, peak, cpu)
}

async fn delete_all(ch: &Channel, queues: &[String], exchanges: &[String]) {
    for q in queues {
        let _ = ch
            .queue_delete(q.clone().into(), QueueDeleteOptions::default())
            .await;
    }
    for e in exchanges {
        let _ = ch
            .exchange_delete(e.clone().into(), ExchangeDeleteOptions::default())
            .await;
    }
}

struct Run {
    label: &'static str,
    secs: f64,
    peak: u64,
    cpu: f64,
}

#[tokio::main]
async fn main() {
    // `cargo test --all-targets` runs bench targets too: this is minutes of load, so it runs
    // only under `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        println!("partitions: skipped (run it with `cargo bench --bench partitions`)");
        return;
    }
    let events: usize = std::env::var("OUTBOXD_BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let rounds: usize = std::env::var("OUTBOXD_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let bin = env!("CARGO_BIN_EXE_outboxd");
    let pid = std::process::id();
    let db = format!("bench_part_{pid}");
    let admin = pg(ADMIN).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let conninfo = format!("host=127.0.0.1 port=5432 user=postgres dbname={db}");
    let dsn = format!("postgres://postgres@127.0.0.1:5432/{db}?sslmode=disable");
    let client = pg(&conninfo).await;
    client
        .batch_execute(include_str!("../migrations/postgres/001_outbox.sql"))
        .await
        .unwrap();
    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672; run scripts/services.sh");
    let ch = conn.create_channel().await.unwrap();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();

    let mut runs = Vec::new();
    for round in 0..rounds {
        // Without partitions: one durable queue bound with #.
        let x = format!("bench_part_{pid}_{round}_plain");
        support::declare_with_one_queue(&ch, &x).await;
        new_backlog(bin, &dsn, &admin, &client, events).await;
        let end = wal_end(&client).await;
        let (secs, peak, cpu) = relay_drain(bin, &dsn, &x, &[], &admin, end).await;
        let got = queue_len(&ch, &format!("{x}.all")).await as usize;
        // More than `events` only if the relay had to republish (a broker failure).
        assert!(got >= events, "without partitions: {got} of {events}");
        if got != events {
            eprintln!("without partitions: {got} messages for {events} events");
        }
        eprintln!(
            "round {round}, no partitions: {:.0} events/s in {secs:.1}s",
            events as f64 / secs
        );
        runs.push(Run {
            label: "no partitions",
            secs,
            peak,
            cpu,
        });
        delete_all(
            &ch,
            &[
                format!("{x}.all"),
                format!("{x}.unrouted"),
                format!("{x}.dead"),
            ],
            &[format!("{x}.unrouted"), x.clone()],
        )
        .await;

        // --partitions 4: the relay declares the headers exchange and four queues.
        let x = format!("bench_part_{pid}_{round}_p4");
        new_backlog(bin, &dsn, &admin, &client, events).await;
        let end = wal_end(&client).await;
        let (secs, peak, cpu) =
            relay_drain(bin, &dsn, &x, &["--partitions", "4"], &admin, end).await;
        let queues: Vec<String> = (0..4).map(|k| format!("{x}.p{k}")).collect();
        let mut got = 0;
        let mut spread = Vec::new();
        for q in &queues {
            let n = queue_len(&ch, q).await as usize;
            spread.push(n);
            got += n;
        }
        assert!(got >= events, "--partitions 4: {got} of {events}");
        if got != events {
            eprintln!("--partitions 4: {got} messages for {events} events");
        }
        eprintln!(
            "round {round}, --partitions 4: {:.0} events/s in {secs:.1}s, per queue {spread:?}",
            events as f64 / secs
        );
        runs.push(Run {
            label: "--partitions 4",
            secs,
            peak,
            cpu,
        });
        let mut qs = queues.clone();
        qs.extend([format!("{x}.unrouted"), format!("{x}.dead")]);
        delete_all(
            &ch,
            &qs,
            &[
                format!("{x}.partitioned"),
                format!("{x}.unrouted"),
                x.clone(),
            ],
        )
        .await;
    }

    let plain: Vec<f64> = runs
        .iter()
        .filter(|r| r.label == "no partitions")
        .map(|r| events as f64 / r.secs)
        .collect();
    let base = plain.iter().sum::<f64>() / plain.len() as f64;
    println!("\n| run | events/s | vs no partitions (mean) | drain | relay CPU | peak RSS |");
    println!("|---|---:|---:|---:|---:|---:|");
    for r in &runs {
        let rate = events as f64 / r.secs;
        println!(
            "| {} | {rate:.0} | {:.2} | {:.1} s | {:.1} s ({:.0} µs/event) | {} MiB |",
            r.label,
            rate / base,
            r.secs,
            r.cpu,
            r.cpu * 1e6 / events as f64,
            r.peak / 1024
        );
    }
    println!(
        "\n{events} events per run over 1,000 aggregates, transactions of 100, persistent, mandatory, publisher confirms, --window 1000; load average at start: {}",
        load.split_whitespace().take(3).collect::<Vec<_>>().join(" ")
    );

    let _ = admin
        .batch_execute(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{db}';
             DROP DATABASE {db} WITH (FORCE);"
        ))
        .await;
    let _ = conn.close(200, "OK".into()).await;
}
