//! NATS JetStream benchmark: the relay draining a Postgres backlog into a stream against a bare
//! async-nats JetStream publisher in the same run, and the proof that SIGKILL restarts leave
//! every event exactly once. Run with `cargo bench --bench nats` (needs the local services and
//! nats-server with JetStream; `scripts/services.sh`).
//!
//! In one run it
//! 1. writes `OUTBOXD_BENCH_EVENTS` (default 50,000) outbox rows of ~300-byte JSON in
//!    transactions of 100 behind a fresh slot while no relay runs;
//! 2. publishes as many bodies of the same size with a bare async-nats publisher — the relay's
//!    headers and `Nats-Msg-Id`, JetStream acks, a pipelined window of 1,000 — into a stream
//!    declared like the relay's (file storage, 2 min duplicate window);
//! 3. starts `outboxd run --snapshot never --sink nats://…` on the backlog and measures from
//!    process start until the stream holds every event;
//! 4. writes `OUTBOXD_BENCH_KILL_EVENTS` (default 20,000) more rows while a relay runs,
//!    SIGKILLs and restarts it `OUTBOXD_BENCH_KILLS` (default 20) times mid-stream, and counts
//!    what the stream holds by `Nats-Msg-Id`.

mod support;

use async_nats::header::HeaderMap;
use async_nats::jetstream::{self, stream};
use std::collections::{HashSet, VecDeque};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{
    env_list, new_backlog, pg, pg_backlog, pg_database, pg_drop, skip_unless_bench, BIN, PG_ADMIN,
};

const NATS: &str = "nats://127.0.0.1:4222";

fn body(i: usize) -> bytes::Bytes {
    serde_json::to_vec(&serde_json::json!({
        "invoice_id": i, "customer_name": "Muhammet Şafak", "tax_id": "1234567890",
        "total": "1499.90", "currency": "TRY",
        "lines": [{"sku": "A-100", "qty": 2, "price": "499.95"}, {"sku": "B-200", "qty": 1, "price": "500.00"}],
        "note": "x".repeat(60)
    }))
    .unwrap()
    .into()
}

async fn fresh_stream(js: &jetstream::Context, name: &str, prefix: &str) {
    let _ = js.delete_stream(name).await;
    js.create_stream(stream::Config {
        name: name.into(),
        subjects: vec![format!("{prefix}.>")],
        storage: stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        ..Default::default()
    })
    .await
    .unwrap();
}

async fn held(js: &jetstream::Context, name: &str) -> (u64, u64) {
    let mut s = js.get_stream(name).await.unwrap();
    let st = &s.info().await.unwrap().state;
    (st.messages, st.last_sequence)
}

/// The bare publisher: `n` messages, at most `window` acknowledgements outstanding.
async fn raw(js: &jetstream::Context, prefix: &str, n: usize, window: usize) -> Duration {
    let t = Instant::now();
    let mut pending = VecDeque::with_capacity(window);
    for i in 0..n {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", uuid::Uuid::now_v7().to_string());
        h.insert("x-aggregate-id", format!("agg-{}", i % 1000));
        h.insert("x-outbox-created-at", "2026-12-03T09:00:00.000000Z");
        h.insert("x-source-position", format!("0/{i:X}:0"));
        let ack = js
            .publish_with_headers(format!("{prefix}.invoice.issued"), h, body(i))
            .await
            .unwrap();
        pending.push_back(ack);
        if pending.len() >= window {
            pending.pop_front().unwrap().await.unwrap();
        }
    }
    for a in pending {
        a.await.unwrap();
    }
    t.elapsed()
}

fn relay(dsn: &str, stream: &str, prefix: &str) -> Child {
    Command::new(BIN)
        .args([
            "run",
            "--source",
            dsn,
            "--name",
            "bench",
            "--snapshot",
            "never",
            "--log-level",
            "warn",
        ])
        .args([
            "--stream",
            stream,
            "--subject",
            &format!("{prefix}.{{topic}}"),
        ])
        .env("OUTBOXD_SINK", NATS)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn outboxd")
}

async fn wait_held(js: &jetstream::Context, name: &str, n: u64, limit: Duration) {
    let t = Instant::now();
    while held(js, name).await.0 < n {
        assert!(
            t.elapsed() < limit,
            "only {:?} of {n} within {limit:?}",
            held(js, name).await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::main]
async fn main() {
    if skip_unless_bench("nats") {
        return;
    }
    let events = env_list("OUTBOXD_BENCH_EVENTS", "50000")[0];
    let kill_events = env_list("OUTBOXD_BENCH_KILL_EVENTS", "20000")[0];
    let kills = env_list("OUTBOXD_BENCH_KILLS", "20")[0];
    let js = jetstream::new(
        async_nats::connect(NATS)
            .await
            .unwrap_or_else(|e| panic!("NATS at {NATS}: {e}; run scripts/services.sh")),
    );
    let pid = std::process::id();
    let (raw_name, raw_prefix) = (format!("BENCHRAW_{pid}"), format!("benchraw_{pid}"));
    let (name, prefix) = (format!("BENCH_{pid}"), format!("bench_{pid}"));
    let (db, dsn, client) = pg_database("bench_nats").await;
    let admin = pg(PG_ADMIN).await;
    new_backlog(BIN, &dsn, &admin, &client, events).await;
    eprintln!("backlog: {events} events");

    fresh_stream(&js, &raw_name, &raw_prefix).await;
    let raw_took = raw(&js, &raw_prefix, events, 1000).await;
    let raw_rate = events as f64 / raw_took.as_secs_f64();
    eprintln!("raw: {raw_rate:.0}/s");

    fresh_stream(&js, &name, &prefix).await;
    let t = Instant::now();
    let mut child = relay(&dsn, &name, &prefix);
    wait_held(&js, &name, events as u64, Duration::from_secs(600)).await;
    let took = t.elapsed();
    let rate = events as f64 / took.as_secs_f64();
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();

    println!("| NATS JetStream, Postgres backlog of {events} | events/s | time |");
    println!("|---|---|---|");
    println!(
        "| bare async-nats publisher (window 1,000, acks) | {raw_rate:.0} | {:.2} s |",
        raw_took.as_secs_f64()
    );
    println!(
        "| outboxd run (window 1,000), from process start | {rate:.0} | {:.2} s |",
        took.as_secs_f64()
    );
    println!("| relay / raw | {:.2} | |", rate / raw_rate);

    // The proof: kills mid-stream, exactly once by Nats-Msg-Id.
    fresh_stream(&js, &name, &prefix).await;
    new_backlog(BIN, &dsn, &admin, &client, 0).await;
    let mut child = relay(&dsn, &name, &prefix);
    let writer = {
        let conninfo = format!("host=127.0.0.1 port=5432 user=postgres dbname={db}");
        tokio::spawn(async move {
            let c = pg(&conninfo).await;
            for _ in 0..kill_events / 100 {
                pg_backlog(&c, 100, 100).await;
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
    };
    let step = (kill_events / (kills + 1)).max(1) as u64;
    for k in 1..=kills as u64 {
        wait_held(&js, &name, k * step, Duration::from_secs(300)).await;
        let _ = child.kill();
        let _ = child.wait();
        child = relay(&dsn, &name, &prefix);
    }
    writer.await.unwrap();
    wait_held(&js, &name, kill_events as u64, Duration::from_secs(300)).await;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    let (messages, last_seq) = held(&js, &name).await;
    let s = js.get_stream(&name).await.unwrap();
    let mut ids = HashSet::new();
    for seq in 1..=last_seq {
        if let Ok(m) = s.get_raw_message(seq).await {
            ids.insert(
                m.headers
                    .get("Nats-Msg-Id")
                    .map(|v| v.as_str().to_string())
                    .unwrap_or_default(),
            );
        }
    }
    println!();
    println!("| SIGKILL proof | committed | kills | stored | distinct Nats-Msg-Id | stores (last sequence) |");
    println!("|---|---|---|---|---|---|");
    println!("| relay killed and restarted mid-stream | {kill_events} | {kills} | {messages} | {} | {last_seq} |", ids.len());
    assert_eq!(ids.len(), kill_events, "every committed event, once");
    assert_eq!(last_seq as usize, kill_events, "no duplicate stored");

    let _ = js.delete_stream(&name).await;
    let _ = js.delete_stream(&raw_name).await;
    drop(client);
    pg_drop(&db, "outboxd_bench").await;
}
