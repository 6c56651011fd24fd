//! Drain benchmark per broker: the relay draining a Postgres backlog into RabbitMQ (classic
//! queue), Kafka and a RabbitMQ stream, each beside a bare publisher of that broker's own client
//! with the same messages, in one run. Run with `cargo bench --bench brokers` (needs the local
//! services, the stream plugin and the Kafka broker; `scripts/services.sh`).
//!
//! For each broker of `OUTBOXD_BENCH_BROKERS` (default `amqp,kafka,stream`) it
//! 1. publishes `OUTBOXD_BENCH_EVENTS` (default 50,000) ~300-byte JSON bodies with the relay's
//!    headers through a bare publisher configured as the relay's sink (AMQP: persistent,
//!    mandatory, confirms; Kafka: idempotent, `acks=all`, `linger.ms=5`; stream: a named
//!    producer with publishing ids, one message per frame as the relay sends), at most the
//!    relay's default `--window` (5,000) confirms outstanding, into a destination of its own,
//!    timed from the client's start (as the relay is from its process start);
//!    on the stream also with 100 messages per frame (`batch_send`: the client's fast path, no
//!    sub-entry batching, what the relay's one-per-frame costs);
//! 2. writes as many outbox rows in transactions of 100 behind a fresh slot while no relay
//!    runs, starts `outboxd run --snapshot never` with its defaults on that backlog into
//!    another destination, and measures from process start until a reader from the
//!    destination's start has seen every message.
//!
//! Prints one Markdown table: each path's rate, the relay ÷ raw ratio per broker, and each
//! relay's rate ÷ the relay's AMQP classic-queue rate.

mod support;

use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use support::brokers::{drain_raw, until_arrived, Broker};
use support::{
    env_list, load_average, new_backlog, pg, pg_database, pg_drop, skip_unless_bench, BIN, PG_ADMIN,
};

/// The raw publishers' window: the relay's default `--window`.
const WINDOW: usize = outboxd::relay::DEFAULT_WINDOW;

fn body(i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "invoice_id": i, "customer_name": "Muhammet Şafak", "tax_id": "1234567890",
        "total": "1499.90", "currency": "TRY",
        "lines": [{"sku": "A-100", "qty": 2, "price": "499.95"}, {"sku": "B-200", "qty": 1, "price": "500.00"}],
        "note": "x".repeat(60)
    }))
    .unwrap()
}

/// The relay on the backlog of `dsn` into `dest`: events per second from process start until
/// the reader saw all `events`.
async fn relay(broker: Broker, dsn: &str, dest: &str, events: usize) -> f64 {
    broker.create(dest).await;
    let arrivals = Arc::new(Mutex::new(Default::default()));
    let reader = broker.read(dest, arrivals.clone()).await;
    let t = Instant::now();
    let mut child = Command::new(BIN)
        .args([
            "run",
            "--source",
            dsn,
            "--name",
            "bench",
            "--snapshot",
            "never",
        ])
        .args(["--log-level", "warn"])
        .args(broker.relay_args(dest))
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn outboxd");
    let done = until_arrived(&arrivals, events, Duration::from_secs(600)).await;
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();
    reader.stop().await;
    broker.delete(dest).await;
    events as f64 / (done - t).as_secs_f64()
}

async fn raw(broker: Broker, dest: &str, events: usize) -> f64 {
    broker.create(dest).await;
    // From the client's start, as the relay's figure is from its process start.
    let t = Instant::now();
    let mut p = broker.publisher(dest).await;
    drain_raw(&mut p, events, WINDOW, body).await;
    let took = t.elapsed();
    drop(p);
    broker.delete(dest).await;
    events as f64 / took.as_secs_f64()
}

#[tokio::main]
async fn main() {
    if skip_unless_bench("brokers") {
        return;
    }
    let events = env_list("OUTBOXD_BENCH_EVENTS", "50000")[0];
    let brokers = Broker::list("OUTBOXD_BENCH_BROKERS", "amqp,kafka,stream");
    let pid = std::process::id();
    let (db, dsn, client) = pg_database("bench_brokers").await;
    let admin = pg(PG_ADMIN).await;
    let load_before = load_average();
    println!("| broker, {events} events | path | events/s | relay ÷ raw | relay ÷ relay on the classic queue |");
    println!("|---|---|---:|---:|---:|");
    let mut amqp_relay = None;
    for (k, broker) in brokers.into_iter().enumerate() {
        let label = broker.label();
        let raw_rate = raw(broker, &format!("benchraw-{pid}-{k}"), events).await;
        eprintln!("{label}: raw {raw_rate:.0}/s");
        println!("| {label} | bare client publisher, window {WINDOW} | {raw_rate:.0} | | |");
        if broker == Broker::Stream {
            let dest = format!("benchbatch-{pid}-{k}");
            broker.create(&dest).await;
            let took =
                support::brokers::drain_stream_batched(&dest, events, 100, WINDOW / 100, body)
                    .await;
            broker.delete(&dest).await;
            let r = events as f64 / took.as_secs_f64();
            println!(
                "| {label} | bare client publisher, 100 messages per frame, {} frames outstanding | {r:.0} | | |",
                WINDOW / 100
            );
        }
        new_backlog(BIN, &dsn, &admin, &client, events).await;
        let rate = relay(broker, &dsn, &format!("bench-{pid}-{k}"), events).await;
        eprintln!("{label}: relay {rate:.0}/s");
        if broker == Broker::Amqp {
            amqp_relay = Some(rate);
        }
        let vs_amqp = amqp_relay.map_or_else(String::new, |a| format!("{:.2}", rate / a));
        println!(
            "| {label} | outboxd run (defaults), process start → last message read | {rate:.0} | {:.2} | {vs_amqp} |",
            rate / raw_rate
        );
    }
    println!(
        "\nload average before / after: {load_before} / {}",
        load_average()
    );
    support::brokers::finish().await;
    drop(client);
    pg_drop(&db, "outboxd_bench").await;
}
