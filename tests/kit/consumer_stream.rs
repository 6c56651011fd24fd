//! The consumer kit reading a RabbitMQ stream (`--broker rabbitmq-stream://…`): the example
//! consumer (`examples/invoice_projection.rs`) as a child process on MariaDB, messages
//! published the way the relay's stream sink writes them (`outboxd::stream::to_message`, the
//! sink's own encoding). Each test has its own streams (deleted at the end) and database.
//! Needs the stream port 127.0.0.1:5552 (`scripts/services.sh` enables the plugin).

use crate::common::rmq_stream::{self, TestStream};
use crate::consumer_support::*;
use futures::StreamExt;
use rabbitmq_stream_client::error::ClientError;
use rabbitmq_stream_client::types::{OffsetSpecification, ResponseCode, SimpleValue};
use rabbitmq_stream_client::Client;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);

/// An invoice event as the test publishes it.
#[derive(Debug, Clone)]
struct Ev {
    id: Uuid,
    customer: String,
    invoice: i64,
    topic: &'static str,
}

fn events(n: usize, customers: usize, first_invoice: i64) -> Vec<Ev> {
    (0..n)
        .map(|i| Ev {
            id: Uuid::now_v7(),
            customer: format!("cust-{}", i % customers),
            invoice: first_invoice + i as i64,
            topic: "invoice.issued",
        })
        .collect()
}

/// Creates `stream` (idempotently).
async fn create(stream: &str) {
    let env = rmq_stream::env().await;
    match env.stream_creator().create(stream).await {
        Ok(())
        | Err(rabbitmq_stream_client::error::StreamCreateError::Create {
            status: ResponseCode::StreamAlreadyExists,
            ..
        }) => {}
        Err(e) => panic!("creating {stream}: {e}"),
    }
}

/// Publishes `evs` into `stream` as the sink does (properties, aggregate headers, publishing
/// id), each confirmed; `raw` overrides the message id (for a message without a UUID id).
async fn publish(stream: &str, evs: &[(Ev, Option<&str>)]) {
    let env = rmq_stream::env().await;
    let producer = env.producer().batch_size(1).build(stream).await.unwrap();
    for (n, (e, raw)) in evs.iter().enumerate() {
        let mut props = invoice_props(e.id, e.topic, &e.customer, Some(e.invoice));
        if let Some(raw) = raw {
            props = props.with_message_id((*raw).into());
        }
        let body = invoice_body(e.invoice, &e.customer, 100);
        let m = outboxd::stream::to_message(&props, &body, n as u64 + 1);
        let st = producer.batch_send_with_confirm(vec![m]).await.unwrap();
        assert!(st.iter().all(|s| s.confirmed()), "{stream}: not confirmed");
    }
    let _ = producer.close().await;
}

async fn client() -> Client {
    Client::connect(
        rabbitmq_stream_client::ClientOptions::builder()
            .host("127.0.0.1")
            .port(rmq_stream::PORT)
            .build(),
    )
    .await
    .unwrap_or_else(|e| {
        panic!(
            "the RabbitMQ stream port 127.0.0.1:{} does not answer ({e}). Enable it with {}",
            rmq_stream::PORT,
            rmq_stream::ENABLE
        )
    })
}

/// The offset the broker holds for `consumer` on `stream` (None: none stored).
async fn stored(consumer: &str, stream: &str) -> Option<u64> {
    let c = client().await;
    let r = c.query_offset(consumer.to_string(), stream).await;
    let _ = c.close().await;
    match r {
        Ok(o) => Some(o),
        Err(ClientError::RequestError(ResponseCode::OffsetNotFound)) => None,
        Err(e) => panic!("query_offset {consumer}/{stream}: {e}"),
    }
}

/// A consumer (without a name) reading `stream` from its first message.
async fn from_first(stream: &str) -> rabbitmq_stream_client::Consumer {
    let env = rmq_stream::env().await;
    env.consumer()
        .offset(OffsetSpecification::First)
        .build(stream)
        .await
        .unwrap()
}

/// The offset of the `n`-th message of `stream`. Offsets count the broker's own offset-tracking
/// entries too, so after a store they run ahead of the messages published.
async fn offset_of(stream: &str, n: usize) -> u64 {
    let mut c = from_first(stream).await;
    let mut last = 0;
    for _ in 0..n {
        last = tokio::time::timeout(T, c.next())
            .await
            .expect("reading the stream")
            .unwrap()
            .unwrap()
            .offset();
    }
    let _ = c.handle().close().await;
    last
}

/// Polls until the stored offset is `want` (the store is asynchronous on the broker).
async fn wait_stored(consumer: &str, stream: &str, want: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let got = stored(consumer, stream).await;
        if got == Some(want) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "stored offset of {consumer} on {stream}: {got:?}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A stream and a database with the inbox and projection tables, both the test's own.
async fn fixture(tag: &str) -> (TestStream, MariaDb) {
    let s = TestStream::new(&format!("kit_{tag}"));
    create(&s.name).await;
    let db = MariaDb::create(tag).await;
    setup_projection(&db.dsn()).await;
    (s, db)
}

/// `evs` published once each, in order.
async fn publish_once(stream: &str, evs: &[Ev]) -> usize {
    let wire: Vec<_> = evs.iter().map(|e| (e.clone(), None)).collect();
    publish(stream, &wire).await;
    wire.len()
}

fn stream_consumer(db: &MariaDb, stream: &str, name: &str, extra: &[&str]) -> Proc {
    stream_consumer_at(rmq_stream::PORT, db, stream, name, extra)
}

/// The example consumer reading `stream` through the stream port `port` (a fault proxy's).
fn stream_consumer_at(port: u16, db: &MariaDb, stream: &str, name: &str, extra: &[&str]) -> Proc {
    start_consumer_via(&rmq_stream::url_via(port), &db.dsn(), stream, name, extra)
}

/// The consumer `proj` on `stream` with `--until-empty` and `extra`, run to its end (exit 0).
async fn drain(db: &MariaDb, stream: &str, extra: &[&str]) -> Proc {
    let mut args = vec!["--until-empty"];
    args.extend_from_slice(extra);
    let mut p = stream_consumer(db, stream, "proj", &args);
    assert_eq!(p.wait_exit(T).await, 0, "{}", p.stderr());
    p
}

fn stat(p: &Proc, k: &str) -> i64 {
    p.stats()[k].as_i64().unwrap_or(0)
}

/// Every ledger row once, and per customer in publish (invoice id) order.
async fn assert_once_in_order(db: &MariaDb, want: &[Ev]) {
    use mysql_async::prelude::Queryable;
    assert_eq!(
        db.count("SELECT COUNT(*) FROM (SELECT event_id FROM invoice_ledger GROUP BY event_id HAVING COUNT(*) <> 1) x")
            .await,
        0,
        "an event applied twice"
    );
    let mut c = db.conn().await;
    let rows: Vec<(String, i64)> = c
        .query("SELECT customer, invoice_id FROM invoice_ledger ORDER BY applied_at, invoice_id")
        .await
        .unwrap();
    let _ = c.disconnect().await;
    let mut got: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for (cust, inv) in rows {
        got.entry(cust).or_default().push(inv);
    }
    let mut expect: BTreeMap<String, Vec<i64>> = BTreeMap::new();
    for e in want {
        expect
            .entry(e.customer.clone())
            .or_default()
            .push(e.invoice);
    }
    assert_eq!(got, expect, "effects per customer, in order");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_consumer_applies_each_event_once_in_order_and_resumes_after_its_stored_offset() {
    let (s, db) = fixture("stream_e2e").await;
    // 200 events over 7 customers; every 10th published twice (a relay's replay).
    let evs = events(200, 7, 1);
    let mut wire = Vec::new();
    for (i, e) in evs.iter().enumerate() {
        wire.push((e.clone(), None));
        if i % 10 == 0 {
            wire.push((e.clone(), None));
        }
    }
    publish(&s.name, &wire).await;
    let p = drain(&db, &s.name, &[]).await;
    assert_eq!((stat(&p, "applied"), stat(&p, "duplicates")), (200, 20));
    assert_once_in_order(&db, &evs).await;
    // Stored at the stop: the last offset.
    wait_stored("proj", &s.name, offset_of(&s.name, wire.len()).await).await;

    // Again: resumes after the stored offset, reads nothing old.
    let again = drain(&db, &s.name, &[]).await;
    assert_eq!(again.stats()["applied"], 0);
    assert_eq!(again.stats()["duplicates"], 0);

    // New events: only those, in batches of 8.
    let more = events(30, 7, 1000);
    let n2 = publish_once(&s.name, &more).await;
    let third = drain(&db, &s.name, &["--batch-size", "8"]).await;
    assert_eq!(
        (stat(&third, "applied"), stat(&third, "duplicates")),
        (30, 0)
    );
    let all: Vec<Ev> = evs.iter().chain(&more).cloned().collect();
    assert_once_in_order(&db, &all).await;
    let last = offset_of(&s.name, wire.len() + n2).await;
    wait_stored("proj", &s.name, last).await;
    s.delete(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_commit_and_offset_store_rereads_the_claimed_messages_without_effect() {
    let (s, db) = fixture("stream_crash").await;
    let evs = events(100, 5, 1);
    publish_once(&s.name, &evs).await;

    // Offsets stored every 30 messages only: the abort at commit 70 (after its effect
    // committed, before anything of it is recorded) leaves the stored offset behind.
    let mut first = stream_consumer(
        &db,
        &s.name,
        "proj",
        &[
            "--offset-every",
            "30",
            "--offset-interval",
            "1h",
            "--crash-after-commits",
            "70",
        ],
    );
    assert_ne!(first.wait_exit(T).await, 0, "the consumer was to crash");
    assert!(first.stderr().contains("crash injected after commit 70"));
    assert_eq!(db.count("SELECT COUNT(*) FROM invoice_ledger").await, 70);
    // The fault is real: the broker's offset lags the committed effects (offset 59 after the
    // second store; offsets are 0-based, so 69 is the 70th message).
    wait_stored("proj", &s.name, 59).await;
    let lag = 69 - 59;

    let second = drain(&db, &s.name, &[]).await;
    // Re-read: the 10 committed after the stored offset were found claimed.
    assert_eq!(stat(&second, "duplicates"), lag);
    assert_eq!(stat(&second, "applied"), 30);
    assert_eq!(db.count("SELECT COUNT(*) FROM invoice_ledger").await, 100);
    assert_once_in_order(&db, &evs).await;
    wait_stored("proj", &s.name, 99).await;
    s.delete(0).await;
}

/// The application properties of every message in `stream`.
async fn dead_letters(stream: &str, n: usize) -> Vec<BTreeMap<String, String>> {
    let mut c = from_first(stream).await;
    let mut out = Vec::new();
    while out.len() < n {
        let d = tokio::time::timeout(T, c.next())
            .await
            .expect("dead letters")
            .unwrap()
            .unwrap();
        let mut m = BTreeMap::new();
        if let Some(app) = d.message().application_properties() {
            for (k, v) in app.iter() {
                let v = match v {
                    SimpleValue::String(s) => s.clone(),
                    other => format!("{other:?}"),
                };
                m.insert(k.clone(), v);
            }
        }
        out.push(m);
    }
    let _ = c.handle().close().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poison_on_a_stream_halts_before_it_or_is_parked_and_no_healthy_message_is_skipped() {
    let (s, db) = fixture("stream_poison").await;
    let healthy = events(10, 3, 1);
    let mut bad_topic = events(1, 1, 500).remove(0);
    bad_topic.topic = "invoice.unknown";
    let no_uuid = events(1, 1, 600).remove(0);
    // offsets: 0-3 healthy, 4 unknown topic, 5-7 healthy, 8 no UUID id, 9-11 healthy
    let mut wire: Vec<(Ev, Option<&str>)> = Vec::new();
    for e in &healthy[..4] {
        wire.push((e.clone(), None));
    }
    wire.push((bad_topic.clone(), None));
    for e in &healthy[4..7] {
        wire.push((e.clone(), None));
    }
    wire.push((no_uuid.clone(), Some("order-17")));
    for e in &healthy[7..] {
        wire.push((e.clone(), None));
    }
    publish(&s.name, &wire).await;

    // halt: stops at offset 4 with 0-3 applied and their offset stored, nothing after it.
    let mut halt = stream_consumer(&db, &s.name, "proj", &["--max-failures", "2"]);
    assert_eq!(halt.wait_exit(T).await, 1, "{}", halt.stderr());
    assert!(halt.stderr().contains("halted on poison message"));
    assert_eq!(stat(&halt, "applied"), 4);
    assert_eq!(db.count("SELECT COUNT(*) FROM invoice_ledger").await, 4);
    wait_stored("proj", &s.name, 3).await;

    // park: from offset 4 on, both poison messages to <stream>.dead, every healthy one applied.
    let park = drain(
        &db,
        &s.name,
        &["--max-failures", "2", "--on-poison", "park"],
    )
    .await;
    assert_eq!((stat(&park, "applied"), stat(&park, "parked")), (6, 2));
    assert_eq!(stat(&park, "failures"), 2, "the unknown topic failed twice");
    assert_once_in_order(&db, &healthy).await;
    wait_stored("proj", &s.name, offset_of(&s.name, wire.len()).await).await;
    let dead = format!("{}.dead", s.name);
    let letters = dead_letters(&dead, 2).await;
    assert_eq!(letters[0]["x-outboxd-offset"], "Int(4)");
    assert_eq!(letters[0]["x-outboxd-stream"], s.name);
    assert!(letters[0]["x-outboxd-error"].contains("unknown topic"));
    assert_eq!(letters[0]["x-aggregate-id"], bad_topic.customer);
    assert_eq!(letters[1]["x-outboxd-offset"], "Int(8)");
    assert!(letters[1]["x-outboxd-error"].contains("not a UUID"));
    s.delete(0).await;
    let env = rmq_stream::env().await;
    let _ = env.delete_stream(&dead).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_streams_are_read_one_reader_each_with_their_own_offsets() {
    let s = TestStream::new("kit_stream_parts");
    for k in 0..3 {
        create(&format!("{}-{k}", s.name)).await;
    }
    let db = MariaDb::create("stream_parts").await;
    setup_projection(&db.dsn()).await;
    let evs = events(90, 9, 1);
    // A customer's events all go to one partition, as the sink places them by aggregate.
    let part = |e: &Ev| {
        e.customer
            .trim_start_matches("cust-")
            .parse::<usize>()
            .unwrap()
            % 3
    };
    let mut sizes = [0u64; 3];
    for (k, size) in sizes.iter_mut().enumerate() {
        let wire: Vec<_> = evs
            .iter()
            .filter(|e| part(e) == k)
            .map(|e| (e.clone(), None))
            .collect();
        *size = wire.len() as u64;
        publish(&format!("{}-{k}", s.name), &wire).await;
    }
    let p = drain(&db, &s.name, &["--partitions", "3"]).await;
    assert_eq!(stat(&p, "applied"), 90);
    assert_once_in_order(&db, &evs).await;
    for (k, n) in sizes.iter().enumerate() {
        let stream = format!("{}-{k}", s.name);
        wait_stored("proj", &stream, offset_of(&stream, *n as usize).await).await;
    }
    s.delete(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_stream_stops_the_consumer_with_the_fix() {
    let db = MariaDb::create("stream_missing").await;
    setup_projection(&db.dsn()).await;
    let name = crate::common::unique("kit_stream_none");
    let mut p = stream_consumer(&db, &name, "proj", &[]);
    assert_eq!(p.wait_exit(T).await, 2, "{}", p.stderr());
    assert!(p.stderr().contains("does not exist"), "{}", p.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_connections_cut_twice_mid_stream_change_nothing() {
    let (s, db) = fixture("stream_cut").await;
    let evs = events(300, 7, 1);
    let n = publish_once(&s.name, &evs).await;
    let upstream = ([127, 0, 0, 1], rmq_stream::PORT).into();
    let proxy = crate::common::proxy::FaultProxy::start(upstream)
        .await
        .unwrap();
    let extra = ["--until-empty", "--offset-every", "50"];
    let mut p = stream_consumer_at(proxy.port(), &db, &s.name, "proj", &extra);
    // Cut every broker connection once 100, then 200 effects are committed.
    for at in [100, 200] {
        let deadline = Instant::now() + T;
        while db.count("SELECT COUNT(*) FROM invoice_ledger").await < at {
            assert!(Instant::now() < deadline && p.running(), "{}", p.stderr());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let before = proxy.accepted();
        proxy.cut();
        // The reader connects again (through the proxy) before the next cut.
        let deadline = Instant::now() + T;
        while proxy.accepted() == before {
            assert!(Instant::now() < deadline, "no reconnect: {}", p.stderr());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    assert_eq!(p.wait_exit(T).await, 0, "{}", p.stderr());
    assert!(
        p.stderr().contains("stream connection lost; reconnecting"),
        "{}",
        p.stderr()
    );
    // Read on after the last message taken: nothing skipped, nothing read twice.
    assert_eq!((stat(&p, "applied"), stat(&p, "duplicates")), (300, 0));
    assert_once_in_order(&db, &evs).await;
    wait_stored("proj", &s.name, offset_of(&s.name, n).await).await;
    s.delete(0).await;
}

/// The stream deleted and created again under a running consumer (what a relay's `--declare
/// auto` does when its stream disappears): the new stream numbers its messages from 0 again.
/// The consumer notices — the offset it read last holds another message, or none — says so,
/// and reads the new stream from its first message: every event of it applied once, none of
/// its offsets skipped as "already read", and the offset it stores afterwards is the new
/// stream's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_created_again_under_the_consumer_is_read_from_its_start() {
    let (s, db) = fixture("stream_again").await;
    let old = events(60, 5, 1);
    publish_once(&s.name, &old).await;
    let mut p = stream_consumer(&db, &s.name, "proj", &["--offset-every", "10"]);
    let deadline = Instant::now() + T;
    while db.count("SELECT COUNT(*) FROM invoice_ledger").await < old.len() as i64 {
        assert!(Instant::now() < deadline && p.running(), "{}", p.stderr());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    s.delete(0).await;
    create(&s.name).await;
    let new = events(30, 5, 1000);
    let n = publish_once(&s.name, &new).await;
    let want = (old.len() + new.len()) as i64;
    let deadline = Instant::now() + T;
    while db.count("SELECT COUNT(*) FROM invoice_ledger").await < want {
        assert!(
            Instant::now() < deadline && p.running(),
            "the consumer applied {} of the new stream's {} events; stderr:\n{}",
            db.count("SELECT COUNT(*) FROM invoice_ledger").await - old.len() as i64,
            new.len(),
            p.stderr()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    p.signal("TERM");
    assert_eq!(p.wait_exit(T).await, 0, "{}", p.stderr());
    assert!(
        p.stderr().contains("deleted and created again"),
        "the consumer said nothing; stderr:\n{}",
        p.stderr()
    );
    let all: Vec<Ev> = old.iter().chain(&new).cloned().collect();
    assert_once_in_order(&db, &all).await;
    wait_stored("proj", &s.name, offset_of(&s.name, n).await).await;
    s.delete(0).await;
}

/// The offset stored for the consumer is beyond the stream's last message — a stream created
/// again under the name, with the offset an earlier reader stored on it: read from there, the
/// consumer would wait for that offset and pass over every message before it. It says so and
/// reads the stream from its first message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_offset_beyond_the_streams_end_is_reported_and_the_stream_read_whole() {
    let (s, db) = fixture("stream_beyond").await;
    let evs = events(30, 3, 1);
    publish_once(&s.name, &evs).await;
    let c = client().await;
    c.store_offset("proj", &s.name, 500).await.unwrap();
    let _ = c.close().await;
    wait_stored("proj", &s.name, 500).await;
    let p = drain(&db, &s.name, &[]).await;
    assert!(
        p.stderr().contains("beyond the stream's last message"),
        "{}",
        p.stderr()
    );
    assert_eq!(stat(&p, "applied"), 30, "{}", p.stderr());
    assert_once_in_order(&db, &evs).await;
    s.delete(0).await;
}
