//! Drain benchmark: how fast the relay empties a Postgres backlog into the stdout sink, and how
//! much memory it takes doing so. Run with `cargo bench --bench drain` (needs the local
//! services; `scripts/services.sh`).
//!
//! It writes `OUTBOXD_BENCH_EVENTS` (default 200,000) outbox rows of ~300-byte JSON in
//! transactions of 100 behind a relay's slot while no relay runs, then starts `outboxd run`
//! and measures from start until the last line came out of the stdout sink, sampling the
//! process's RSS. (`cargo bench --bench memory` does the same for 10k and 1M events on both
//! databases.)

#[path = "support/mod.rs"]
mod support;

use std::time::{Duration, Instant};
use support::*;

#[tokio::main]
async fn main() {
    if skip_unless_bench("drain") {
        return;
    }
    let events = env_list("OUTBOXD_BENCH_EVENTS", "200000")[0];
    let (db, dsn, client) = pg_database("bench").await;
    let name = "bench";
    let ok = std::process::Command::new(BIN)
        .args(["setup", "--source", &dsn, "--name", name])
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "outboxd setup failed");
    let t = Instant::now();
    pg_backlog(&client, events, 100).await;
    eprintln!(
        "backlog: {events} events written in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    let mut relay = Relay::stdout(&["--source", &dsn, "--name", name]);
    let (peak, median, took) = relay.sample_until(events, Duration::from_secs(600)).await;
    relay.stop();
    println!(
        "| drain, Postgres → stdout | {events} events | {:.2} s | {:.0} events/s | peak RSS {:.1} MiB | median RSS {:.1} MiB |",
        took.as_secs_f64(),
        events as f64 / took.as_secs_f64(),
        mib(peak),
        mib(median)
    );
    drop(client);
    pg_drop(&db, "outboxd_bench").await;
}
