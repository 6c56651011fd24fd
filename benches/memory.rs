//! Memory benchmark: the relay's peak RSS draining a small and a large backlog, and while a
//! huge transaction on another table passes through the log. Run with
//! `cargo bench --bench memory` (needs the local services; `scripts/services.sh`).
//!
//! For Postgres and MariaDB, each in a fresh database and with the stdout sink (the memory in
//! question is the relay's, not the broker's):
//! - backlogs of `OUTBOXD_BENCH_BACKLOGS` events (default `10000,1000000`, ~300-byte JSON in
//!   transactions of 1,000) written while the relay is stopped, then drained; RSS sampled every
//!   10 ms from start until the last line;
//! - then, with that relay idle, one transaction inserting `OUTBOXD_BENCH_UNRELATED_ROWS`
//!   (default 1,000,000) rows into another table, followed by one outbox row; RSS sampled until
//!   that row came out.
//!
//! The goal (issue 12): peak RSS of the largest backlog ≤ 1.2 × the smallest's.

#[path = "support/mod.rs"]
mod support;

use mysql_async::prelude::Queryable;
use std::time::{Duration, Instant};
use support::*;

const LIMIT: Duration = Duration::from_secs(900);

struct Row {
    source: &'static str,
    what: String,
    peak: u64,
    median: u64,
    took: Duration,
}

async fn postgres(backlog: usize, unrelated: Option<usize>) -> Vec<Row> {
    let (db, dsn, client) = pg_database("mem").await;
    let name = "mem";
    let ok = std::process::Command::new(BIN)
        .args(["setup", "--source", &dsn, "--name", name])
        .stdout(std::process::Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "outboxd setup failed");
    let t = Instant::now();
    pg_backlog(&client, backlog, 1_000).await;
    eprintln!(
        "postgres: {backlog} backlog written in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let mut relay = Relay::stdout(&["--source", &dsn, "--name", name]);
    let (peak, median, took) = relay.sample_until(backlog, LIMIT).await;
    let mut rows = vec![Row {
        source: "Postgres",
        what: format!("drain {backlog} backlogged events"),
        peak,
        median,
        took,
    }];
    if let Some(n) = unrelated {
        client
            .batch_execute(&format!(
                "CREATE TABLE other (id bigint, pad text);
                 INSERT INTO other SELECT g, repeat('y', 100) FROM generate_series(1, {n}) g;"
            ))
            .await
            .unwrap();
        pg_backlog(&client, 1, 1).await;
        let (peak, median, took) = relay.sample_until(backlog + 1, LIMIT).await;
        rows.push(Row {
            source: "Postgres",
            what: format!("idle, one {n}-row transaction on another table"),
            peak,
            median,
            took,
        });
    }
    relay.stop();
    drop(client);
    pg_drop(&db, &format!("outboxd_{name}")).await;
    rows
}

async fn mariadb(backlog: usize, unrelated: Option<usize>) -> Vec<Row> {
    let (db, dsn, mut c) = my_database("mem").await;
    let name = "mem";
    my_first_start(&mut c, &dsn, name).await;
    let t = Instant::now();
    my_backlog(&mut c, backlog, 1_000).await;
    eprintln!(
        "mariadb: {backlog} backlog written in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let mut relay = Relay::stdout(&["--source", &dsn, "--name", name]);
    let (peak, median, took) = relay.sample_until(backlog, LIMIT).await;
    let mut rows = vec![Row {
        source: "MariaDB",
        what: format!("drain {backlog} backlogged events"),
        peak,
        median,
        took,
    }];
    if let Some(n) = unrelated {
        c.query_drop("CREATE TABLE other (id BIGINT, pad VARCHAR(200))")
            .await
            .unwrap();
        c.query_drop(format!(
            "INSERT INTO other SELECT seq, REPEAT('y', 100) FROM seq_1_to_{n}"
        ))
        .await
        .unwrap();
        my_backlog(&mut c, 1, 1).await;
        let (peak, median, took) = relay.sample_until(backlog + 1, LIMIT).await;
        rows.push(Row {
            source: "MariaDB",
            what: format!("idle, one {n}-row transaction on another table"),
            peak,
            median,
            took,
        });
    }
    relay.stop();
    drop(c);
    my_drop_db(&db).await;
    rows
}

#[tokio::main]
async fn main() {
    if skip_unless_bench("memory") {
        return;
    }
    let backlogs = env_list("OUTBOXD_BENCH_BACKLOGS", "10000,1000000");
    let unrelated = env_list("OUTBOXD_BENCH_UNRELATED_ROWS", "1000000")
        .first()
        .copied();
    let mut rows = Vec::new();
    for (i, &n) in backlogs.iter().enumerate() {
        // The unrelated transaction runs once, after the largest backlog's drain.
        let big = if i + 1 == backlogs.len() {
            unrelated
        } else {
            None
        };
        rows.extend(postgres(n, big).await);
        rows.extend(mariadb(n, big).await);
    }
    println!("| source | what | peak RSS | median RSS | time |");
    println!("|---|---|---:|---:|---:|");
    for r in &rows {
        println!(
            "| {} | {} | {:.1} MiB | {:.1} MiB | {:.1} s |",
            r.source,
            r.what,
            mib(r.peak),
            mib(r.median),
            r.took.as_secs_f64()
        );
    }
    for source in ["Postgres", "MariaDB"] {
        let drains: Vec<&Row> = rows
            .iter()
            .filter(|r| r.source == source && r.what.starts_with("drain"))
            .collect();
        if let (Some(first), Some(last)) = (drains.first(), drains.last()) {
            println!(
                "{source}: peak RSS {} / {} = {:.2} (goal ≤ 1.2)",
                last.what,
                first.what,
                last.peak as f64 / first.peak.max(1) as f64
            );
        }
    }
}
