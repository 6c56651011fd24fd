//! What the broker the tests use enforces, checked on it (docs/kafka.md, "The test broker"):
//! the Kafka sink's no-duplicate design relies on acknowledged records (`acks=all`) being
//! readable, with their headers, in the partition the producer chose, in the order produced —
//! which holds. The transactional design relies on `read_committed` hiding aborted records,
//! which tansu does not do: the second test proves the claim the sink's design is built
//! around, and fails (telling us to reconsider) on a broker that does.

use crate::common::{kafka, unique};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::time::Duration;

const T: Duration = Duration::from_secs(30);

async fn blocking<R: Send + 'static>(f: impl FnOnce() -> R + Send + 'static) -> R {
    tokio::task::spawn_blocking(f).await.expect("blocking task")
}

fn values(records: &[kafka::Record]) -> Vec<String> {
    records.iter().map(|r| r.value_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_kafka_broker_keeps_acknowledged_records_in_their_partition_in_order() {
    kafka::require();
    let topic = unique("kbroker");
    kafka::create_topic(&topic, 3).await;
    let p: FutureProducer = kafka::client_config(kafka::PORT)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .expect("producer");
    let mut sent = Vec::new();
    for i in 0..30 {
        let partition = i % 3;
        let value = format!("v{i}");
        let h = OwnedHeaders::new().insert(Header {
            key: "x-source-position",
            value: Some(&format!("p{i}")),
        });
        let rec = FutureRecord::to(&topic)
            .partition(partition)
            .key("k")
            .payload(&value)
            .headers(h);
        // Pipelined: all handed over before the first report is awaited.
        sent.push((
            partition,
            value.clone(),
            p.send_result(rec).expect("queued"),
        ));
    }
    for (_, v, d) in sent.drain(..) {
        d.await
            .expect("delivery report")
            .unwrap_or_else(|(e, _)| panic!("{v}: {e}"));
    }
    let t = topic.clone();
    let got = blocking(move || kafka::read_all(&t, false)).await;
    assert_eq!(got.len(), 30, "every acknowledged record is readable");
    for part in 0..3 {
        let in_part: Vec<String> = got
            .iter()
            .filter(|r| r.partition == part)
            .map(|r| r.value_str())
            .collect();
        let want: Vec<String> = (0..30)
            .filter(|i| i % 3 == part)
            .map(|i| format!("v{i}"))
            .collect();
        assert_eq!(in_part, want, "partition {part} in produce order");
    }
    let r = got.iter().find(|r| r.value_str() == "v7").expect("v7");
    assert_eq!(r.header("x-source-position"), Some("p7"));
    assert_eq!(r.key.as_deref(), Some("k"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_kafka_broker_does_not_hide_aborted_records_from_read_committed() {
    kafka::require();
    let topic = unique("kbroker-tx");
    kafka::create_topic(&topic, 1).await;
    let p: FutureProducer = kafka::client_config(kafka::PORT)
        .set("transactional.id", unique("kbroker-txid"))
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
        .expect("producer");
    let q = p.clone();
    blocking(move || q.init_transactions(T))
        .await
        .expect("init");
    p.begin_transaction().expect("begin");
    p.send(FutureRecord::to(&topic).key("k").payload("aborted"), T)
        .await
        .unwrap_or_else(|(e, _)| panic!("send: {e}"));
    let q = p.clone();
    blocking(move || q.abort_transaction(T))
        .await
        .expect("the broker accepted the abort");
    p.begin_transaction().expect("begin");
    p.send(FutureRecord::to(&topic).key("k").payload("committed"), T)
        .await
        .unwrap_or_else(|(e, _)| panic!("send: {e}"));
    let q = p.clone();
    blocking(move || q.commit_transaction(T))
        .await
        .expect("commit");
    let t = topic.clone();
    let committed = blocking(move || kafka::read_all(&t, true)).await;
    assert_eq!(
        values(&committed),
        ["aborted", "committed"],
        "the test broker now hides aborted records from read_committed: a transactional design \
         (docs/kafka.md, \"Why not transactions\") can be tested here"
    );
}
