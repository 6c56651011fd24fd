//! MariaDB drain and latency benchmark. Run with `cargo bench --bench drain_mysql` (needs the
//! local MariaDB; `scripts/services.sh`).
//!
//! Drain: `OUTBOXD_BENCH_EVENTS` (default 200,000) outbox rows of ~300-byte JSON in transactions
//! of 100 are written while the relay is stopped (after a first start stored its position);
//! then `outboxd run` with the stdout sink is timed from start until the last line came out,
//! sampling its RSS. Latency: `OUTBOXD_BENCH_LATENCY_EVENTS` (default 2,000) one-row
//! transactions, one every 2 ms, each timed from its COMMIT returning to its stdout line.

mod support;

use mysql_async::prelude::Queryable;
use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::{my_connect as connect, rss_kib};

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[tokio::main]
async fn main() {
    // `cargo test --all-targets` runs bench targets too: minutes of load, so only under
    // `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        println!("drain_mysql: skipped (run it with `cargo bench --bench drain_mysql`)");
        return;
    }
    let events = env_usize("OUTBOXD_BENCH_EVENTS", 200_000);
    let latency_events = env_usize("OUTBOXD_BENCH_LATENCY_EVENTS", 2_000);
    let bin = env!("CARGO_BIN_EXE_outboxd");
    let db = format!("bench_{}", std::process::id());
    let mut admin = connect(None).await;
    admin
        .query_drop(format!("CREATE DATABASE `{db}`"))
        .await
        .unwrap();
    let mut c = connect(Some(&db)).await;
    c.query_drop(include_str!("../migrations/mysql/001_outbox.sql"))
        .await
        .unwrap();
    let dsn = format!("mysql://root@127.0.0.1:3306/{db}");
    let name = "bench";
    let run_args = [
        "run",
        "--source",
        &dsn,
        "--name",
        name,
        "--commit-offsets",
        "--log-level",
        "warn",
    ];

    // First start: stores the position the backlog will be read from.
    let mut first = Command::new(bin)
        .args(run_args)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    loop {
        let n: Option<i64> = c
            .query_first("SELECT COUNT(*) FROM outboxd_state WHERE initialized_at IS NOT NULL")
            .await
            .unwrap_or(Some(0));
        if n == Some(1) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &first.id().to_string()])
        .status();
    let _ = first.wait();

    let t = Instant::now();
    support::my_write_backlog(&mut c, events).await;
    let payload_len: Option<i64> = c
        .query_first("SELECT LENGTH(payload) FROM outbox LIMIT 1")
        .await
        .unwrap();
    eprintln!(
        "backlog: {events} events ({}-byte payloads) written in {:.1}s",
        payload_len.unwrap_or(0),
        t.elapsed().as_secs_f64()
    );

    let start = Instant::now();
    let mut child = Command::new(bin)
        .args(run_args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let pid = child.id();
    let out = child.stdout.take().unwrap();
    let lines = Arc::new(AtomicUsize::new(0));
    let arrivals: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let reader = {
        let lines = lines.clone();
        let arrivals = arrivals.clone();
        std::thread::spawn(move || {
            for line in BufReader::with_capacity(1 << 20, out)
                .lines()
                .map_while(Result::ok)
            {
                let n = lines.fetch_add(1, Ordering::Relaxed) + 1;
                if n > events {
                    // {"id":"<36 chars>",…
                    if let Some(id) = line.get(7..43) {
                        arrivals
                            .lock()
                            .unwrap()
                            .insert(id.to_string(), Instant::now());
                    }
                }
            }
        })
    };
    let mut peak_rss = 0u64;
    let mut samples = Vec::new();
    while lines.load(Ordering::Relaxed) < events {
        if let Some(r) = rss_kib(pid) {
            peak_rss = peak_rss.max(r);
            samples.push(r);
        }
        assert!(
            start.elapsed() < Duration::from_secs(600),
            "drain did not finish in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let elapsed = start.elapsed();
    let rate = events as f64 / elapsed.as_secs_f64();
    samples.sort_unstable();
    let median = samples.get(samples.len() / 2).copied().unwrap_or(0);
    println!("| drain, MariaDB → stdout | {events} events | {:.2} s | {:.0} events/s | peak RSS {:.1} MiB | median RSS {:.1} MiB |",
        elapsed.as_secs_f64(), rate, peak_rss as f64 / 1024.0, median as f64 / 1024.0);

    // Latency: one-row transactions, commit → stdout line.
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let mut committed: Vec<(String, Instant)> = Vec::with_capacity(latency_events);
    let mut tick = tokio::time::interval(Duration::from_millis(2));
    for i in 0..latency_events {
        tick.tick().await;
        let mut tx = c.start_transaction(Default::default()).await.unwrap();
        let id = outbox
            .write(
                &mut tx,
                "latency.probe",
                &(i % 1000).to_string(),
                &serde_json::json!({"probe": i, "note": "x".repeat(200)}),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        committed.push((id.hyphenated().to_string(), Instant::now()));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while lines.load(Ordering::Relaxed) < events + latency_events && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = child.wait();
    let _ = reader.join();
    let mut lat: Vec<Duration> = {
        let arrivals = arrivals.lock().unwrap();
        committed
            .iter()
            .filter_map(|(id, at)| arrivals.get(id).map(|a| a.saturating_duration_since(*at)))
            .collect()
    };
    lat.sort_unstable();
    println!(
        "| latency, MariaDB commit → stdout line | {} of {latency_events} events | p50 {:.2} ms | p99 {:.2} ms | max {:.2} ms |",
        lat.len(),
        percentile(&lat, 0.5).as_secs_f64() * 1000.0,
        percentile(&lat, 0.99).as_secs_f64() * 1000.0,
        lat.last().copied().unwrap_or_default().as_secs_f64() * 1000.0
    );

    drop(c);
    let _ = admin.query_drop(format!("DROP DATABASE `{db}`")).await;
}
