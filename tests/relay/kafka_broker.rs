//! What the broker the tests use enforces, checked on it (docs/kafka.md, "The test broker"):
//! the Kafka sink's no-duplicate design relies on acknowledged records (`acks=all`) being
//! readable, with their headers, in the partition the producer chose, in the order produced —
//! which holds. Its idempotent producer relies on the broker's sequence checks (a retried batch
//! is not stored twice), which tansu enforces (shown with Produce requests written by hand).
//! The transactional design would rely on fencing, which tansu does, and on `read_committed`
//! hiding aborted records, which it does not: that test proves the claim the sink's design is
//! built around, and fails (telling us to reconsider) on a broker that does.

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

/// A Kafka client written by hand for what no client API exposes: Produce requests with a
/// producer id, epoch and sequence of the test's choosing (InitProducerId v4, Produce v3), one
/// record per batch.
mod wire {
    use std::io::{Read, Write};
    use std::net::TcpStream;

    pub struct Conn {
        s: TcpStream,
        correlation: i32,
    }

    fn string(b: &mut Vec<u8>, s: Option<&str>) {
        match s {
            Some(s) => {
                b.extend((s.len() as i16).to_be_bytes());
                b.extend(s.as_bytes());
            }
            None => b.extend((-1i16).to_be_bytes()),
        }
    }

    fn varint(b: &mut Vec<u8>, v: i64) {
        let mut z = ((v << 1) ^ (v >> 63)) as u64;
        while z >= 0x80 {
            b.push((z as u8) | 0x80);
            z >>= 7;
        }
        b.push(z as u8);
    }

    /// CRC-32C (Castagnoli), the checksum of a record batch.
    fn crc32c(data: &[u8]) -> u32 {
        let mut crc = !0u32;
        for &byte in data {
            crc ^= byte as u32;
            for _ in 0..8 {
                crc = if crc & 1 == 1 {
                    (crc >> 1) ^ 0x82F6_3B78
                } else {
                    crc >> 1
                };
            }
        }
        !crc
    }

    /// A record batch (magic 2) of one record with `value`, written as producer `pid`/`epoch`
    /// with `sequence`.
    pub fn batch(pid: i64, epoch: i16, sequence: i32, value: &[u8]) -> Vec<u8> {
        let mut rec = Vec::new();
        rec.push(0); // attributes
        varint(&mut rec, 0); // timestamp delta
        varint(&mut rec, 0); // offset delta
        varint(&mut rec, -1); // no key
        varint(&mut rec, value.len() as i64);
        rec.extend(value);
        varint(&mut rec, 0); // no headers
        let mut records = Vec::new();
        varint(&mut records, rec.len() as i64);
        records.extend(rec);
        let now = chrono::Utc::now().timestamp_millis();
        // From the attributes on: what the CRC covers.
        let mut tail = Vec::new();
        tail.extend(0i16.to_be_bytes()); // attributes
        tail.extend(0i32.to_be_bytes()); // last offset delta
        tail.extend(now.to_be_bytes()); // base timestamp
        tail.extend(now.to_be_bytes()); // max timestamp
        tail.extend(pid.to_be_bytes());
        tail.extend(epoch.to_be_bytes());
        tail.extend(sequence.to_be_bytes());
        tail.extend(1i32.to_be_bytes()); // one record
        tail.extend(records);
        let mut after_length = Vec::new();
        after_length.extend((-1i32).to_be_bytes()); // partition leader epoch
        after_length.push(2); // magic
        after_length.extend(crc32c(&tail).to_be_bytes());
        after_length.extend(tail);
        let mut b = Vec::new();
        b.extend(0i64.to_be_bytes()); // base offset
        b.extend((after_length.len() as i32).to_be_bytes());
        b.extend(after_length);
        b
    }

    impl Conn {
        pub fn open(port: u16) -> Conn {
            let s = TcpStream::connect(("127.0.0.1", port)).expect("connect to the broker");
            s.set_read_timeout(Some(std::time::Duration::from_secs(30)))
                .unwrap();
            Conn { s, correlation: 0 }
        }

        /// Sends one request and returns its response after the correlation id.
        fn call(&mut self, api_key: i16, version: i16, flexible: bool, body: &[u8]) -> Vec<u8> {
            self.correlation += 1;
            let mut req = Vec::new();
            req.extend(api_key.to_be_bytes());
            req.extend(version.to_be_bytes());
            req.extend(self.correlation.to_be_bytes());
            string(&mut req, Some("outboxd-wire-test"));
            if flexible {
                req.push(0); // no tagged fields
            }
            req.extend(body);
            let mut framed = (req.len() as i32).to_be_bytes().to_vec();
            framed.extend(req);
            self.s.write_all(&framed).expect("send");
            let mut len = [0u8; 4];
            self.s.read_exact(&mut len).expect("response length");
            let mut resp = vec![0u8; i32::from_be_bytes(len) as usize];
            self.s.read_exact(&mut resp).expect("response");
            assert_eq!(
                i32::from_be_bytes(resp[..4].try_into().unwrap()),
                self.correlation,
                "the response's correlation id"
            );
            // A flexible response header has tagged fields (none) after the correlation id.
            resp[if flexible { 5 } else { 4 }..].to_vec()
        }

        /// InitProducerId v4 (flexible) without a transactional id: (producer id, epoch).
        pub fn init_producer_id(&mut self) -> (i64, i16) {
            let mut body = vec![0]; // transactional id: null (compact)
            body.extend(60_000i32.to_be_bytes());
            body.extend((-1i64).to_be_bytes()); // producer id
            body.extend((-1i16).to_be_bytes()); // producer epoch
            body.push(0); // no tagged fields
            let r = self.call(22, 4, true, &body);
            // throttle_time_ms, error_code, producer_id, producer_epoch
            let error = i16::from_be_bytes(r[4..6].try_into().unwrap());
            assert_eq!(error, 0, "InitProducerId failed with error code {error}");
            (
                i64::from_be_bytes(r[6..14].try_into().unwrap()),
                i16::from_be_bytes(r[14..16].try_into().unwrap()),
            )
        }

        /// Produce v3 (acks=all) of `batch` to `topic`/0: (error code, base offset).
        pub fn produce(&mut self, topic: &str, batch: &[u8]) -> (i16, i64) {
            let mut body = Vec::new();
            string(&mut body, None); // transactional id
            body.extend((-1i16).to_be_bytes()); // acks=all
            body.extend(30_000i32.to_be_bytes());
            body.extend(1i32.to_be_bytes()); // one topic
            string(&mut body, Some(topic));
            body.extend(1i32.to_be_bytes()); // one partition
            body.extend(0i32.to_be_bytes()); // partition 0
            body.extend((batch.len() as i32).to_be_bytes());
            body.extend(batch);
            let r = self.call(0, 3, false, &body);
            // [topic: name, [partition: index, error_code, base_offset, log_append_time]]
            let name_len = i16::from_be_bytes(r[4..6].try_into().unwrap()) as usize;
            let p = 6 + name_len + 4; // past the name and the partitions' count
            let error = i16::from_be_bytes(r[p + 4..p + 6].try_into().unwrap());
            let offset = i64::from_be_bytes(r[p + 6..p + 14].try_into().unwrap());
            (error, offset)
        }
    }
}

/// Kafka's error codes the sequence checks answer with.
const DUPLICATE_SEQUENCE_NUMBER: i16 = 46;
const OUT_OF_ORDER_SEQUENCE_NUMBER: i16 = 45;

/// The idempotent producer's sequence checks, with Produce requests written by hand: a batch
/// sent again with the same producer id, epoch and sequence is not stored twice, and one that
/// skips sequences is refused. tansu enforces both (it answers the repeat with
/// DUPLICATE_SEQUENCE_NUMBER where Apache Kafka answers with the first copy's offset; either
/// way nothing is appended).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_kafka_broker_enforces_the_idempotent_producers_sequence_checks() {
    kafka::require();
    let topic = unique("kbroker-seq");
    kafka::create_topic(&topic, 1).await;
    let t = topic.clone();
    let (first, repeated, skipped, next) = blocking(move || {
        let mut c = wire::Conn::open(kafka::PORT);
        let (pid, epoch) = c.init_producer_id();
        assert!(pid >= 0 && epoch >= 0, "a producer id: {pid}/{epoch}");
        (
            c.produce(&t, &wire::batch(pid, epoch, 0, b"seq0")),
            c.produce(&t, &wire::batch(pid, epoch, 0, b"seq0-again")),
            c.produce(&t, &wire::batch(pid, epoch, 5, b"seq5")),
            c.produce(&t, &wire::batch(pid, epoch, 1, b"seq1")),
        )
    })
    .await;
    assert_eq!(first, (0, 0), "the first batch is stored at offset 0");
    assert!(
        repeated.0 == DUPLICATE_SEQUENCE_NUMBER || repeated == (0, 0),
        "a repeated sequence is a duplicate, not a new record: {repeated:?}"
    );
    assert_eq!(
        skipped.0, OUT_OF_ORDER_SEQUENCE_NUMBER,
        "a skipped sequence is refused: {skipped:?}"
    );
    assert_eq!(next, (0, 1), "the next sequence is stored after the first");
    let t = topic.clone();
    let got = blocking(move || kafka::read_all(&t, false)).await;
    assert_eq!(
        values(&got),
        ["seq0", "seq1"],
        "the partition holds neither the repeat nor the out-of-order batch"
    );
}

/// Fencing: a second transactional producer with the same `transactional.id` fences the first,
/// whose next write and commit fail and whose later record is not stored. The first one's
/// record written before the fence (its transaction aborted by the fence) stays visible to
/// `read_committed`: tansu does not hide aborted records (above).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn test_kafka_broker_fences_an_old_transactional_producer() {
    kafka::require();
    let topic = unique("kbroker-fence");
    kafka::create_topic(&topic, 1).await;
    let txid = unique("kbroker-fence-id");
    let producer = || -> FutureProducer {
        kafka::client_config(kafka::PORT)
            .set("transactional.id", &txid)
            .set("enable.idempotence", "true")
            .set("acks", "all")
            .create()
            .expect("producer")
    };
    let old = producer();
    let q = old.clone();
    blocking(move || q.init_transactions(T))
        .await
        .expect("init old");
    old.begin_transaction().expect("begin");
    old.send(FutureRecord::to(&topic).key("k").payload("old-1"), T)
        .await
        .unwrap_or_else(|(e, _)| panic!("send: {e}"));
    let new = producer();
    let q = new.clone();
    blocking(move || q.init_transactions(T))
        .await
        .expect("the second producer's init");
    let old_send = old
        .send(FutureRecord::to(&topic).key("k").payload("old-2"), T)
        .await
        .map(|_| ())
        .map_err(|(e, _)| e.to_string());
    assert!(
        old_send
            .as_ref()
            .is_err_and(|e| e.contains("ProducerFenced")),
        "the old producer is fenced: {old_send:?}"
    );
    let q = old.clone();
    let old_commit = blocking(move || q.commit_transaction(T)).await;
    assert!(old_commit.is_err(), "the fenced producer committed");
    new.begin_transaction().expect("begin");
    new.send(FutureRecord::to(&topic).key("k").payload("new-1"), T)
        .await
        .unwrap_or_else(|(e, _)| panic!("send: {e}"));
    let q = new.clone();
    blocking(move || q.commit_transaction(T))
        .await
        .expect("the new producer commits");
    let t = topic.clone();
    let got = blocking(move || kafka::read_all(&t, true)).await;
    assert_eq!(
        values(&got),
        ["old-1", "new-1"],
        "the fenced write is not stored; the aborted one is visible"
    );
}
