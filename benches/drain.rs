//! Drain benchmark: how fast the relay empties a backlog, and how much memory it takes doing
//! so. Run with `cargo bench --bench drain` (needs the local services; `scripts/services.sh`).
//!
//! It writes `OUTBOXD_BENCH_EVENTS` (default 200,000) outbox rows of ~300-byte JSON in
//! transactions of 100 while the relay is stopped, then starts `outboxd run` and measures the
//! time from start until the slot has confirmed the last commit, sampling the process's RSS.
//! The stdout sink's output goes to a pipe that is read and counted.

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";

async fn connect(conninfo: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("Postgres at {conninfo}: {e}; run scripts/services.sh"));
    tokio::spawn(conn);
    c
}

fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

#[tokio::main]
async fn main() {
    // `cargo test --all-targets` runs bench targets too (without --bench): the benchmark is
    // minutes of load, so it runs only under `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        println!("drain: skipped (run it with `cargo bench --bench drain`)");
        return;
    }
    let events: usize = std::env::var("OUTBOXD_BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let bin = env!("CARGO_BIN_EXE_outboxd");
    let db = format!("bench_{}", std::process::id());
    let admin = connect(ADMIN).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let conninfo = format!("host=127.0.0.1 port=5432 user=postgres dbname={db}");
    let dsn = format!("postgres://postgres@127.0.0.1:5432/{db}?sslmode=disable");
    let client = connect(&conninfo).await;
    client
        .batch_execute(include_str!("../migrations/postgres/001_outbox.sql"))
        .await
        .unwrap();
    let name = "bench";
    let ok = Command::new(bin)
        .args(["setup", "--source", &dsn, "--name", name])
        .stdout(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "outboxd setup failed");

    let t = Instant::now();
    let txs = events / 100;
    for i in 0..txs {
        client
            .batch_execute(&format!(
                "INSERT INTO outbox (id, aggregate_id, topic, payload)
                 SELECT gen_random_uuid(), 'agg-' || (g % 1000), 'invoice.issued',
                        json_build_object('invoice_id', g, 'customer_name', 'Muhammet Şafak', 'tax_id', '1234567890',
                                          'total', '1499.90', 'currency', 'TRY', 'lines', json_build_array(
                                          json_build_object('sku', 'A-100', 'qty', 2, 'price', '499.95'),
                                          json_build_object('sku', 'B-200', 'qty', 1, 'price', '500.00')),
                                          'note', repeat('x', 60))
                   FROM generate_series({}, {}) g",
                i * 100,
                i * 100 + 99
            ))
            .await
            .unwrap();
    }
    let head: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let payload_len: i32 = client
        .query_one("SELECT length(payload::text) FROM outbox LIMIT 1", &[])
        .await
        .unwrap()
        .get(0);
    eprintln!(
        "backlog: {events} events ({payload_len}-byte payloads) written in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    let start = Instant::now();
    let mut child = Command::new(bin)
        .args([
            "run",
            // The backlog is in the slot already: a first-start snapshot of the pending rows
            // would publish every event twice.
            "--snapshot",
            "never",
            "--source",
            &dsn,
            "--name",
            name,
            "--commit-offsets",
            "--log-level",
            "warn",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let pid = child.id();
    let mut out = child.stdout.take().unwrap();
    let counter = std::thread::spawn(move || {
        let mut buf = vec![0u8; 1 << 20];
        let mut lines = 0usize;
        while let Ok(n) = out.read(&mut buf) {
            if n == 0 {
                break;
            }
            lines += buf[..n].iter().filter(|&&b| b == b'\n').count();
        }
        lines
    });
    let mut peak_rss = 0u64;
    let mut samples = Vec::new();
    loop {
        if let Some(r) = rss_kib(pid) {
            peak_rss = peak_rss.max(r);
            samples.push(r);
        }
        let done: bool = client
            .query_one(
                "SELECT coalesce(confirmed_flush_lsn >= $1::text::pg_lsn, false) FROM pg_replication_slots WHERE slot_name = 'outboxd_bench'",
                &[&head],
            )
            .await
            .unwrap()
            .get(0);
        if done {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(600),
            "drain did not finish in 10 minutes"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let elapsed = start.elapsed();
    let _ = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status();
    let _ = child.wait();
    let lines = counter.join().unwrap();
    assert!(lines >= events, "only {lines} of {events} events came out");
    let rate = events as f64 / elapsed.as_secs_f64();
    samples.sort_unstable();
    let median = samples.get(samples.len() / 2).copied().unwrap_or(0);
    println!("| drain, Postgres → stdout | {events} events | {:.2} s | {:.0} events/s | peak RSS {:.1} MiB | median RSS {:.1} MiB |",
        elapsed.as_secs_f64(), rate, peak_rss as f64 / 1024.0, median as f64 / 1024.0);

    drop(client);
    let _ = admin
        .batch_execute(&format!(
            "SELECT pg_drop_replication_slot('outboxd_bench'); DROP DATABASE {db} WITH (FORCE)"
        ))
        .await;
}
