//! Kafka benchmark: the relay draining a Postgres backlog into a topic against a bare rdkafka
//! producer with the same messages in the same run. Run with `cargo bench --bench kafka` (needs
//! the local services and the Kafka broker; `scripts/services.sh`).
//!
//! In one run it
//! 1. writes `OUTBOXD_BENCH_EVENTS` (default 50,000) outbox rows of ~300-byte JSON in
//!    transactions of 100 behind a fresh slot while no relay runs;
//! 2. produces as many records of the same size with a bare rdkafka producer configured as the
//!    relay's (idempotent, `acks=all`, `linger.ms=5`), keyed by aggregate, with the relay's
//!    headers, at most 1,000 delivery reports outstanding, to a topic of one partition;
//! 3. starts `outboxd run --snapshot never --sink kafka://…` on the backlog into another topic
//!    of one partition and measures from process start until a reader has seen every record.

mod support;

use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use std::collections::VecDeque;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use support::{
    env_list, load_average, new_backlog, pg, pg_database, pg_drop, skip_unless_bench, BIN, PG_ADMIN,
};

const BROKER: &str = "127.0.0.1:9092";

fn body(i: usize) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "invoice_id": i, "customer_name": "Muhammet Şafak", "tax_id": "1234567890",
        "total": "1499.90", "currency": "TRY",
        "lines": [{"sku": "A-100", "qty": 2, "price": "499.95"}, {"sku": "B-200", "qty": 1, "price": "500.00"}],
        "note": "x".repeat(60)
    }))
    .unwrap()
}

fn config() -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", BROKER);
    c
}

fn create_topic(topic: &str) {
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        config().create().unwrap();
    let t = rdkafka::admin::NewTopic::new(topic, 1, rdkafka::admin::TopicReplication::Fixed(1));
    futures::executor::block_on(admin.create_topics([&t], &rdkafka::admin::AdminOptions::new()))
        .expect("create topic");
}

/// The bare producer: `n` records, at most `window` delivery reports outstanding.
async fn raw(topic: &str, n: usize, window: usize) -> Duration {
    let p: FutureProducer = config()
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("linger.ms", "5")
        .create()
        .unwrap();
    let t = Instant::now();
    let mut pending = VecDeque::with_capacity(window);
    for i in 0..n {
        let key = format!("agg-{}", i % 1000);
        let id = uuid::Uuid::now_v7().to_string();
        let pos = format!("0/{i:X}:0");
        let h = [
            ("id", id.as_str()),
            ("x-aggregate-id", key.as_str()),
            ("x-outbox-created-at", "2026-12-03T09:00:00.000000Z"),
            ("x-source-position", pos.as_str()),
            ("x-outbox-relay", "bench"),
        ]
        .iter()
        .fold(OwnedHeaders::new(), |h, (k, v)| {
            h.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            })
        });
        let b = body(i);
        let mut rec = FutureRecord::to(topic)
            .partition(0)
            .key(&key)
            .payload(&b)
            .headers(h);
        // A full queue hands the record back: wait for room, as the sink does.
        let d = loop {
            match p.send_result(rec) {
                Ok(d) => break d,
                Err((_, back)) => {
                    rec = back;
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
        };
        pending.push_back(d);
        if pending.len() >= window {
            pending.pop_front().unwrap().await.unwrap().unwrap();
        }
    }
    for d in pending {
        d.await.unwrap().unwrap();
    }
    t.elapsed()
}

/// Reads `topic` from its start until `n` records came; returns when.
fn read_until(topic: &str, n: usize, limit: Duration) -> Instant {
    let c: BaseConsumer = config()
        .set("group.id", "outboxd-bench-reader")
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    c.assign(&tpl).unwrap();
    let t = Instant::now();
    let mut seen = 0;
    while seen < n {
        assert!(t.elapsed() < limit, "only {seen} of {n} within {limit:?}");
        if let Some(Ok(_)) = c.poll(Duration::from_millis(100)) {
            seen += 1;
        }
    }
    Instant::now()
}

fn relay(dsn: &str, topic: &str) -> Child {
    Command::new(BIN)
        .args([
            "run",
            "--source",
            dsn,
            "--name",
            "bench",
            "--snapshot",
            "never",
        ])
        .args(["--log-level", "warn", "--routing-key", topic])
        .args(["--kafka-dead-topic", &format!("{topic}.dead")])
        .env("OUTBOXD_SINK", format!("kafka://{BROKER}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn outboxd")
}

#[tokio::main]
async fn main() {
    if skip_unless_bench("kafka") {
        return;
    }
    let events = env_list("OUTBOXD_BENCH_EVENTS", "50000")[0];
    let pid = std::process::id();
    let (raw_topic, topic) = (format!("benchraw-{pid}"), format!("bench-{pid}"));
    let (db, dsn, client) = pg_database("bench_kafka").await;
    let admin = pg(PG_ADMIN).await;
    new_backlog(BIN, &dsn, &admin, &client, events).await;
    eprintln!("backlog: {events} events");
    let load_before = load_average();

    create_topic(&raw_topic);
    let raw_took = raw(&raw_topic, events, 1000).await;
    let raw_rate = events as f64 / raw_took.as_secs_f64();
    eprintln!("raw: {raw_rate:.0}/s");

    create_topic(&topic);
    let t = Instant::now();
    let reader = {
        let topic = topic.clone();
        tokio::task::spawn_blocking(move || read_until(&topic, events, Duration::from_secs(600)))
    };
    let mut child = relay(&dsn, &topic);
    let took = reader.await.unwrap() - t;
    let rate = events as f64 / took.as_secs_f64();
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let _ = child.wait();

    println!("| Kafka (tansu, memory), Postgres backlog of {events} | events/s | time |");
    println!("|---|---|---|");
    println!(
        "| bare rdkafka producer (idempotent, acks=all, window 1,000) | {raw_rate:.0} | {:.2} s |",
        raw_took.as_secs_f64()
    );
    println!(
        "| outboxd run (defaults), from process start to the last record read | {rate:.0} | {:.2} s |",
        took.as_secs_f64()
    );
    println!("| relay / raw | {:.2} | |", rate / raw_rate);
    println!(
        "load average before / after: {load_before} / {}",
        load_average()
    );
    drop(client);
    pg_drop(&db, "outboxd_bench").await;
}
