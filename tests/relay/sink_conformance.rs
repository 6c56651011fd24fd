//! The `Sink` conformance suite: every sink — stdout, RabbitMQ, NATS JetStream, and the
//! in-memory double the relay's in-process tests use — held to what the relay relies on:
//!
//! - every event handed over resolves (`Accepted` after a flush, `Pending` when confirmed),
//!   and the destination holds the events in the order they were handed over;
//! - after a reconnect (what the relay does after a failure), the same events handed over
//!   again are taken again: the destination holds each at least once, first copies in order
//!   (RabbitMQ and stdout hold the copies, JetStream drops them by `Nats-Msg-Id`);
//! - a destination that refuses an event makes its delivery fail, never resolve `Ok`.
//!
//! A new sink is one `impl Kind` and one line in the list of tests at the end.

use crate::common::amqp::{self as rabbit, Topology};
use crate::common::*;
use futures::FutureExt;
use outboxd::event::SourcePosition;
use outboxd::sink::nats::{NatsConfig, NatsSink};
use outboxd::sink::rabbitmq::{RabbitConfig, RabbitSink};
use outboxd::sink::stdout::StdoutSink;
use outboxd::sink::template::Template;
use outboxd::sink::DeclareMode;
use outboxd::{Delivery, MemoryHandle, MemorySink, OutboxEvent, Sink};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use uuid::Uuid;

/// One `Sink` implementation on its destination.
trait Kind {
    type Sink: Sink;
    fn sink(&mut self) -> &mut Self::Sink;
    /// Called once the sink is connected (RabbitMQ: bind a queue to the declared exchange).
    async fn connected(&mut self) {}
    /// The ids the destination holds, in its order.
    async fn received(&self) -> Vec<Uuid>;
    /// Makes the destination refuse the events of `topic` from now on; `false` where the
    /// destination cannot be made to (the refusal case is skipped for it).
    async fn refuse_topic(&mut self, _topic: &str) -> bool {
        false
    }
}

/// `n` new events: each call's positions follow the previous call's, as a source's do (a sink
/// that recognises what it wrote by position, Kafka's, would take repeats for replays).
fn events(tag: &str, n: u32) -> Vec<OutboxEvent> {
    static NEXT_LSN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0x100_0000);
    let lsn = NEXT_LSN.fetch_add(0x1000, std::sync::atomic::Ordering::Relaxed);
    (0..n)
        .map(|i| OutboxEvent {
            id: Uuid::now_v7(),
            aggregate_id: format!("agg-{}", i % 3),
            topic: format!("{tag}.created"),
            payload: bytes::Bytes::from(format!(r#"{{"n": {i}}}"#)),
            created_at: chrono::Utc::now(),
            position: SourcePosition::Pg {
                commit_lsn: lsn,
                index: i,
            },
            headers: None,
            version: None,
            gtid: None,
            committed_at: None,
            poison: None,
            table: None,
            extra: Vec::new(),
            content_type: None,
            empty_payload: false,
            read_at: None,
        })
        .collect()
}

/// Hands `events` over in order, then settles every delivery as the relay does (a flush for
/// the accepted ones); returns each delivery's outcome.
async fn hand_over<S: Sink>(sink: &mut S, events: &[OutboxEvent]) -> Vec<Result<(), String>> {
    let mut pending = Vec::new();
    for e in events {
        match sink.publish(e).await {
            Ok(Delivery::Accepted) => pending.push(None),
            Ok(Delivery::Pending(f)) => pending.push(Some(f)),
            // A refusal may come at once (the RabbitMQ stream sink's producer closes when its
            // stream is deleted): it is that event's failed delivery.
            Err(e) => pending.push(Some(futures::future::ready(Err(e)).boxed())),
        }
    }
    let flushed = sink.flush().await.map_err(|e| e.to_string());
    let mut out = Vec::new();
    for p in pending {
        out.push(match p {
            None => flushed.clone(),
            Some(f) => tokio::time::timeout(Duration::from_secs(30), f)
                .await
                .expect("a delivery resolves within 30s")
                .map_err(|e| e.to_string()),
        });
    }
    out
}

async fn wait_received<K: Kind>(kind: &K, at_least: usize) -> Vec<Uuid> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let got = kind.received().await;
        if got.len() >= at_least || std::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn first_copies(got: &[Uuid]) -> Vec<Uuid> {
    let mut seen = std::collections::HashSet::new();
    got.iter().copied().filter(|id| seen.insert(*id)).collect()
}

async fn sink_suite<K: Kind>(mut kind: K) {
    let tag = unique("conf");
    kind.sink().connect().await.expect("connect");
    kind.connected().await;

    // In order, every delivery resolved.
    let first = events(&tag, 20);
    let ids: Vec<Uuid> = first.iter().map(|e| e.id).collect();
    for (i, r) in hand_over(kind.sink(), &first).await.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("delivery {i} failed: {e}"));
    }
    assert_eq!(
        wait_received(&kind, ids.len()).await,
        ids,
        "the destination's order"
    );

    // Republish after a reconnect: each at least once, first copies in order.
    kind.sink().connect().await.expect("reconnect");
    for r in hand_over(kind.sink(), &first[10..]).await {
        r.expect("a republished delivery");
    }
    // Later in the source than the first batch, as a source hands them over (the stream sink
    // confirms an event at or before its stream's tail position without sending it).
    let mut more = events(&tag, 5);
    for e in &mut more {
        if let SourcePosition::Pg { commit_lsn, .. } = &mut e.position {
            *commit_lsn += 1;
        }
    }
    for r in hand_over(kind.sink(), &more).await {
        r.expect("a delivery after the republish");
    }
    let all: Vec<Uuid> = ids
        .iter()
        .chain(more.iter().map(|e| &e.id))
        .copied()
        .collect();
    let got = wait_received(&kind, all.len()).await;
    assert_eq!(first_copies(&got), all, "first copies in order");
    assert!(
        got.len() <= all.len() + 10,
        "more copies than were republished"
    );

    // A refusal fails its delivery.
    let refused = format!("{tag}-refused");
    if kind.refuse_topic(&refused).await {
        let mut bad = events(&refused, 1);
        bad[0].topic = format!("{refused}.x");
        let outcome = hand_over(kind.sink(), &bad).await;
        assert!(
            outcome[0].is_err(),
            "a refused event's delivery must fail: {outcome:?}"
        );
    }
}

/// What the stdout sink writes, readable by the test.
#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

struct Stdout(StdoutSink<Buffer>, Buffer);

impl Kind for Stdout {
    type Sink = StdoutSink<Buffer>;
    fn sink(&mut self) -> &mut Self::Sink {
        &mut self.0
    }
    async fn received(&self) -> Vec<Uuid> {
        let text = String::from_utf8(self.1 .0.lock().unwrap().clone()).unwrap();
        let lines: Vec<String> = text.lines().map(String::from).collect();
        ids_of(&lines)
    }
}

struct Memory(MemorySink, MemoryHandle);

impl Kind for Memory {
    type Sink = MemorySink;
    fn sink(&mut self) -> &mut MemorySink {
        &mut self.0
    }
    async fn received(&self) -> Vec<Uuid> {
        self.1.confirmed_ids()
    }
    async fn refuse_topic(&mut self, topic: &str) -> bool {
        let topic = topic.to_string();
        self.1.refuse_when(move |e| {
            e.topic
                .starts_with(&topic)
                .then(|| "refused by the test".to_string())
        });
        true
    }
}

struct Rabbit {
    sink: RabbitSink,
    topology: Topology,
    queue: Option<String>,
}

impl Kind for Rabbit {
    type Sink = RabbitSink;
    fn sink(&mut self) -> &mut RabbitSink {
        &mut self.sink
    }
    async fn connected(&mut self) {
        self.queue = Some(self.topology.bind_queue("all", "#").await);
    }
    async fn received(&self) -> Vec<Uuid> {
        use lapin::options::BasicGetOptions;
        let queue = self.queue.clone().expect("bound after connect");
        let ch = self.topology.channel().await;
        let mut ids = Vec::new();
        // Read everything unacknowledged: closing the channel puts it back, in order.
        while let Some(m) = ch
            .basic_get(queue.clone().into(), BasicGetOptions::default())
            .await
            .expect("basic.get")
        {
            ids.push(rabbit::message_id(&m.delivery));
        }
        let _ = ch.close(200, "read".into()).await;
        ids
    }
}

struct Nats {
    sink: NatsSink,
    stream: nats::TestStream,
}

impl Kind for Nats {
    type Sink = NatsSink;
    fn sink(&mut self) -> &mut NatsSink {
        &mut self.sink
    }
    async fn received(&self) -> Vec<Uuid> {
        self.stream
            .messages()
            .await
            .iter()
            .map(|m| {
                nats::header(m, "Nats-Msg-Id")
                    .expect("Nats-Msg-Id")
                    .parse()
                    .expect("a UUID")
            })
            .collect()
    }
}

// One line per sink.
#[tokio::test]
async fn sink_conformance_stdout() {
    let buf = Buffer::default();
    sink_suite(Stdout(StdoutSink::with_writer(buf.clone(), true), buf)).await;
}
#[tokio::test]
async fn sink_conformance_memory() {
    let (sink, handle) = MemorySink::new();
    sink_suite(Memory(sink, handle)).await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_conformance_rabbitmq() {
    let topology = Topology::new("conf_sink").await;
    let sink = RabbitSink::new(RabbitConfig {
        url: rabbit::url(),
        exchange: topology.exchange.clone(),
        declare: DeclareMode::Auto,
        max_message_bytes: 1 << 20,
        op_timeout: Duration::from_secs(10),
        ca_file: None,
        cert_file: None,
        key_file: None,
        connection_name: "outboxd sink conformance".into(),
        partitioning: Default::default(),
        dead_queue_type: outboxd::sink::partition::QueueType::Classic,
        message: Default::default(),
    })
    .expect("RabbitMQ sink");
    sink_suite(Rabbit {
        sink,
        topology,
        queue: None,
    })
    .await;
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sink_conformance_nats() {
    let stream = nats::TestStream::new("conf_sink").await;
    let sink = NatsSink::new(NatsConfig {
        url: nats::url(),
        subject: Template::parse(&format!("{}.{{topic}}", stream.prefix)).unwrap(),
        stream: stream.name.clone(),
        declare: DeclareMode::Auto,
        max_message_bytes: 1 << 20,
        op_timeout: Duration::from_secs(10),
        window: 64,
        ca_file: None,
        cert_file: None,
        key_file: None,
        connection_name: "outboxd sink conformance".into(),
        partitions: 0,
        headers: Vec::new(),
    })
    .expect("NATS sink");
    sink_suite(Nats { sink, stream }).await;
}

// The RabbitMQ stream sink: its own block (a stream of the test's own, read back from its
// start; a refusal is the stream deleted under the open producer).
mod rabbitmq_stream {
    use super::*;
    use crate::common::rmq_stream::{self, TestStream};
    use outboxd::sink::rabbitmq_stream::{RabbitStreamSink, StreamSinkConfig};

    struct Stream {
        sink: RabbitStreamSink,
        stream: TestStream,
    }

    impl Kind for Stream {
        type Sink = RabbitStreamSink;
        fn sink(&mut self) -> &mut RabbitStreamSink {
            &mut self.sink
        }
        async fn received(&self) -> Vec<Uuid> {
            self.stream
                .read(0, Duration::from_secs(5))
                .await
                .into_iter()
                .map(|m| m.id)
                .collect()
        }
        async fn refuse_topic(&mut self, _topic: &str) -> bool {
            // Every topic goes into the one stream: deleting it refuses them all, which is all
            // the suite hands over from here on.
            rmq_stream::env()
                .await
                .delete_stream(&self.stream.name)
                .await
                .expect("delete the stream");
            true
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sink_conformance_rabbitmq_stream() {
        let stream = TestStream::new("conf_sink");
        let sink = RabbitStreamSink::new(StreamSinkConfig {
            url: rmq_stream::url(),
            stream: stream.name.clone(),
            declare: DeclareMode::Auto,
            max_bytes: None,
            max_age: None,
            op_timeout: Duration::from_secs(10),
            relay_name: unique("conf"),
            message: RabbitConfig {
                url: String::new(),
                exchange: String::new(),
                declare: DeclareMode::Auto,
                max_message_bytes: 1 << 20,
                op_timeout: Duration::from_secs(10),
                ca_file: None,
                cert_file: None,
                key_file: None,
                connection_name: "outboxd sink conformance".into(),
                partitioning: Default::default(),
                dead_queue_type: outboxd::sink::partition::QueueType::Classic,
                message: Default::default(),
            },
        })
        .expect("RabbitMQ stream sink");
        sink_suite(Stream { sink, stream }).await;
    }
}

// The Kafka sink (its own block: the sinks above are listed one line each).
mod kafka_sink {
    use super::{sink_suite, Kind};
    use crate::common::{kafka, unique};
    use outboxd::sink::format::MessageOptions;
    use outboxd::sink::kafka::{KafkaConfig, KafkaOptions, KafkaSink};
    use outboxd::sink::template::Template;
    use outboxd::sink::DeclareMode;
    use std::time::Duration;
    use uuid::Uuid;

    /// Events go to `<prefix>.<topic>`; the destination is every such topic but the dead
    /// topic (the suite writes one before its refusal case).
    struct Kafka {
        sink: KafkaSink,
        prefix: String,
    }

    impl Kind for Kafka {
        type Sink = KafkaSink;
        fn sink(&mut self) -> &mut KafkaSink {
            &mut self.sink
        }
        async fn received(&self) -> Vec<Uuid> {
            let prefix = format!("{}.", self.prefix);
            tokio::task::spawn_blocking(move || {
                let mut ids = Vec::new();
                for t in kafka::topics_on(kafka::PORT, &prefix) {
                    if t.ends_with(".dead") {
                        continue;
                    }
                    for r in kafka::read_all(&t, true) {
                        ids.push(r.header("id").expect("id header").parse().expect("a UUID"));
                    }
                }
                ids
            })
            .await
            .expect("reader")
        }
        // No refusal: the test broker (tansu) enforces no topic's max.message.bytes and has no
        // ACLs, so nothing makes it refuse a record the sink hands over (a record too large
        // for the producer becomes a dead record: tests/relay/kafka_sink.rs).
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sink_conformance_kafka() {
        kafka::require();
        let prefix = unique("conf-kafka").replace('_', "-");
        let sink = KafkaSink::new(KafkaConfig {
            url: kafka::url(),
            name: unique("conf-relay"),
            options: KafkaOptions {
                dead_topic: format!("{prefix}.dead"),
                ..KafkaOptions::default()
            },
            message: MessageOptions {
                routing_key: Template::parse(&format!("{prefix}.{{topic}}")).unwrap(),
                ..MessageOptions::default()
            },
            declare: DeclareMode::Auto,
            op_timeout: Duration::from_secs(10),
            ca_file: None,
            cert_file: None,
            key_file: None,
        })
        .expect("Kafka sink");
        sink_suite(Kafka { sink, prefix }).await;
    }
}
