//! The three brokers the drain and latency benches publish to, behind one small interface: a
//! destination (an AMQP exchange with one queue, a Kafka topic of one partition, a RabbitMQ
//! stream) created before a relay starts, the relay arguments that publish into it, a reader
//! from its start that records when each message id first arrived, and a bare publisher of the
//! broker's own client that hands back a future resolving on the broker's confirm. Every
//! message the benches publish themselves carries the relay's headers, so a raw publisher and
//! the relay move the same bytes.

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable};
use rabbitmq_stream_client::types::{Message as StreamMessage, OffsetSpecification};
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Header, Headers, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::Message as _;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const KAFKA: &str = "127.0.0.1:9092";
pub const STREAM_PORT: u16 = 5552;
/// What an outbox row's topic is; the AMQP routing key and type of every message.
pub const TOPIC: &str = "invoice.issued";

/// Kafka topics [`Broker::delete`] was asked to delete; [`finish`] deletes them.
static KAFKA_DELETED: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Deletes the Kafka topics of every [`Broker::delete`]; call it last, when every reader was
/// stopped and every publisher dropped.
pub async fn finish() {
    let topics = std::mem::take(&mut *KAFKA_DELETED.lock().unwrap());
    if topics.is_empty() {
        return;
    }
    let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
        kafka_config().create().unwrap();
    let names: Vec<&str> = topics.iter().map(String::as_str).collect();
    let _ = admin
        .delete_topics(&names, &rdkafka::admin::AdminOptions::new())
        .await;
}

/// The first arrival of each message id.
pub type Arrivals = Arc<Mutex<HashMap<String, Instant>>>;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Broker {
    /// A durable topic exchange with the relay's topology and one classic queue bound `#`.
    Amqp,
    /// A topic of one partition on the local tansu broker (memory storage).
    Kafka,
    /// A RabbitMQ stream.
    Stream,
}

impl Broker {
    /// `amqp`, `kafka` or `stream`; anything else stops the bench with the accepted names.
    pub fn parse(s: &str) -> Broker {
        match s.trim() {
            "amqp" | "rabbitmq" => Broker::Amqp,
            "kafka" => Broker::Kafka,
            "stream" | "rabbitmq-stream" => Broker::Stream,
            other => panic!("unknown broker {other:?}: use amqp, kafka or stream"),
        }
    }

    /// The brokers named by `var` (comma-separated), or `default`.
    pub fn list(var: &str, default: &str) -> Vec<Broker> {
        std::env::var(var)
            .unwrap_or_else(|_| default.into())
            .split(',')
            .filter(|s| !s.trim().is_empty())
            .map(Broker::parse)
            .collect()
    }

    pub fn label(self) -> &'static str {
        match self {
            Broker::Amqp => "RabbitMQ classic queue",
            Broker::Kafka => "Kafka (tansu, memory)",
            Broker::Stream => "RabbitMQ stream",
        }
    }

    /// Creates destination `name` with what the relay would declare, so it finds it there.
    pub async fn create(self, name: &str) {
        match self {
            Broker::Amqp => {
                let conn = amqp().await;
                let ch = conn.create_channel().await.unwrap();
                super::declare_with_one_queue(&ch, name).await;
                let _ = conn.close(0, "".into()).await;
            }
            Broker::Kafka => {
                let admin: rdkafka::admin::AdminClient<rdkafka::client::DefaultClientContext> =
                    kafka_config().create().unwrap();
                let topics = [name.to_string(), format!("{name}.dead")];
                let new: Vec<_> = topics
                    .iter()
                    .map(|t| {
                        rdkafka::admin::NewTopic::new(
                            t,
                            1,
                            rdkafka::admin::TopicReplication::Fixed(1),
                        )
                    })
                    .collect();
                let made = admin
                    .create_topics(new.iter(), &rdkafka::admin::AdminOptions::new())
                    .await
                    .unwrap_or_else(|e| panic!("Kafka at {KAFKA}: {e}; run scripts/services.sh"));
                for r in made {
                    r.unwrap_or_else(|(t, e)| panic!("creating the topic {t}: {e}"));
                }
            }
            Broker::Stream => {
                let env = stream_env().await;
                env.stream_creator()
                    .create(name)
                    .await
                    .unwrap_or_else(|e| panic!("creating the stream {name}: {e}"));
            }
        }
    }

    /// Deletes what [`Broker::create`] and a relay made for `name`.
    pub async fn delete(self, name: &str) {
        match self {
            Broker::Amqp => {
                let conn = amqp().await;
                let ch = conn.create_channel().await.unwrap();
                for q in ["all", "dead", "unrouted"] {
                    let _ = ch
                        .queue_delete(format!("{name}.{q}").into(), Default::default())
                        .await;
                }
                for x in [name.to_string(), format!("{name}.unrouted")] {
                    let _ = ch.exchange_delete(x.into(), Default::default()).await;
                }
                let _ = conn.close(0, "".into()).await;
            }
            // Deleted by `finish`, once no Kafka client is left: librdkafka (2.x, here against
            // tansu) can crash in a metadata refresh that meets a topic deleted meanwhile.
            Broker::Kafka => KAFKA_DELETED
                .lock()
                .unwrap()
                .extend([name.to_string(), format!("{name}.dead")]),
            Broker::Stream => {
                let _ = stream_env().await.delete_stream(name).await;
            }
        }
    }

    /// `outboxd run` arguments that publish into `name`.
    pub fn relay_args(self, name: &str) -> Vec<String> {
        match self {
            Broker::Amqp => vec![
                "--sink".into(),
                super::AMQP.into(),
                "--exchange".into(),
                name.into(),
            ],
            Broker::Kafka => vec![
                "--sink".into(),
                format!("kafka://{KAFKA}"),
                "--routing-key".into(),
                name.into(),
                "--kafka-dead-topic".into(),
                format!("{name}.dead"),
            ],
            Broker::Stream => vec![
                "--sink".into(),
                format!("rabbitmq-stream://guest:guest@127.0.0.1:{STREAM_PORT}/%2f"),
                "--stream".into(),
                name.into(),
            ],
        }
    }

    /// Reads `name` from its start until the returned reader is dropped, recording the first
    /// arrival of each message id (AMQP `message-id`, Kafka `id` header, stream `message-id`).
    pub async fn read(self, name: &str, arrivals: Arrivals) -> Reader {
        let stop = Arc::new(AtomicBool::new(false));
        let record = move |id: String| {
            let now = Instant::now();
            arrivals.lock().unwrap().entry(id).or_insert(now);
        };
        let task;
        match self {
            Broker::Amqp => {
                let conn = amqp().await;
                let ch = conn.create_channel().await.unwrap();
                ch.basic_qos(1000, Default::default()).await.unwrap();
                let mut consumer = ch
                    .basic_consume(
                        format!("{name}.all").into(),
                        "bench".into(),
                        BasicConsumeOptions {
                            no_ack: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .unwrap();
                let stop2 = stop.clone();
                task = tokio::spawn(async move {
                    let _conn = conn;
                    while let Some(Ok(d)) = consumer.next().await {
                        if stop2.load(Ordering::Relaxed) {
                            break;
                        }
                        if let Some(id) = d.properties.message_id() {
                            record(id.to_string());
                        }
                    }
                });
            }
            Broker::Kafka => {
                let c: BaseConsumer = kafka_config()
                    .set("group.id", "outboxd-bench-reader")
                    .set("enable.auto.commit", "false")
                    .set("fetch.wait.max.ms", "5")
                    .create()
                    .unwrap();
                let mut tpl = rdkafka::TopicPartitionList::new();
                tpl.add_partition_offset(name, 0, rdkafka::Offset::Beginning)
                    .unwrap();
                c.assign(&tpl).unwrap();
                let stop2 = stop.clone();
                task = tokio::task::spawn_blocking(move || {
                    while !stop2.load(Ordering::Relaxed) {
                        if let Some(Ok(m)) = c.poll(Duration::from_millis(50)) {
                            let id = m.headers().and_then(|h| {
                                h.iter()
                                    .find(|h| h.key == "id")
                                    .and_then(|h| h.value)
                                    .map(|v| String::from_utf8_lossy(v).into_owned())
                            });
                            if let Some(id) = id {
                                record(id);
                            }
                        }
                    }
                });
            }
            Broker::Stream => {
                let env = stream_env().await;
                let mut consumer = env
                    .consumer()
                    .offset(OffsetSpecification::First)
                    .build(name)
                    .await
                    .unwrap_or_else(|e| panic!("reading the stream {name}: {e}"));
                let stop2 = stop.clone();
                task = tokio::spawn(async move {
                    while let Some(Ok(d)) = consumer.next().await {
                        if stop2.load(Ordering::Relaxed) {
                            break;
                        }
                        let id = d
                            .message()
                            .properties()
                            .and_then(|p| p.message_id.as_ref())
                            .and_then(|id| <&String>::try_from(id).ok())
                            .cloned();
                        if let Some(id) = id {
                            record(id);
                        }
                    }
                    let _ = consumer.handle().close().await;
                });
            }
        }
        Reader { stop, task }
    }

    /// A bare publisher of this broker's client into `name`, configured as the relay's sink is
    /// (AMQP: persistent, mandatory, confirms; Kafka: idempotent, `acks=all`, `linger.ms=5`;
    /// stream: a named producer with publishing ids, one message per frame).
    pub async fn publisher(self, name: &str) -> Publisher {
        match self {
            Broker::Amqp => {
                let conn = amqp().await;
                let ch = conn.create_channel().await.unwrap();
                ch.confirm_select(ConfirmSelectOptions::default())
                    .await
                    .unwrap();
                Publisher::Amqp {
                    _conn: conn,
                    ch,
                    exchange: name.into(),
                }
            }
            Broker::Kafka => Publisher::Kafka {
                producer: kafka_config()
                    .set("enable.idempotence", "true")
                    .set("acks", "all")
                    .set("linger.ms", "5")
                    .create()
                    .unwrap(),
                topic: name.into(),
            },
            Broker::Stream => {
                let env = stream_env().await;
                let producer = env
                    .producer()
                    .name(&format!("bench-{}", uuid::Uuid::now_v7()))
                    .batch_size(1)
                    .build(name)
                    .await
                    .unwrap_or_else(|e| panic!("a producer on the stream {name}: {e}"));
                Publisher::Stream {
                    producer,
                    next_id: 1,
                }
            }
        }
    }
}

/// A reader of a destination; [`Reader::stop`] ends it (and waits for a Kafka consumer to be
/// gone).
pub struct Reader {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Reader {
    pub async fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        // The AMQP and stream readers wait in `next()`: abort them. The Kafka reader's blocking
        // thread cannot be aborted; it sees the flag within one poll.
        self.task.abort();
        let _ = self.task.await;
    }
}

/// The relay's headers on a message the bench publishes itself.
fn headers(id: &str, key: &str, i: usize) -> [(&'static str, String); 5] {
    [
        ("id", id.to_string()),
        ("x-aggregate-id", key.to_string()),
        ("x-outbox-created-at", "2026-12-03T09:00:00.000000Z".into()),
        ("x-source-position", format!("0/{i:X}:0")),
        ("x-outbox-relay", "bench".into()),
    ]
}

/// Message `i` as a stream message with publishing id `pid`, carrying the relay's headers.
fn stream_message(pid: u64, id: &str, key: &str, i: usize, body: Vec<u8>) -> StreamMessage {
    let mut app = StreamMessage::builder()
        .publising_id(pid)
        .body(body)
        .properties()
        .message_id(id.to_string())
        .content_type("application/json")
        .subject(TOPIC.to_string())
        .message_builder()
        .application_properties();
    for (k, v) in &headers(id, key, i)[1..] {
        app = app.insert(*k, v.as_str());
    }
    app.message_builder().build()
}

// One value per publisher: its size does not matter.
#[allow(clippy::large_enum_variant)]
pub enum Publisher {
    Amqp {
        _conn: lapin::Connection,
        ch: lapin::Channel,
        exchange: String,
    },
    Kafka {
        producer: FutureProducer,
        topic: String,
    },
    Stream {
        producer: rabbitmq_stream_client::Producer<rabbitmq_stream_client::Dedup>,
        next_id: u64,
    },
}

impl Publisher {
    /// Another handle on the same client where an application shares one between its
    /// workers: a Kafka producer (thread-safe, batching for all of them; one producer per
    /// process is what rdkafka's users run). Other brokers: `None`, a connection each.
    pub fn share(&self) -> Option<Publisher> {
        match self {
            Publisher::Kafka { producer, topic } => Some(Publisher::Kafka {
                producer: producer.clone(),
                topic: topic.clone(),
            }),
            _ => None,
        }
    }

    /// One message through, confirmed: the client's connection, metadata and producer id are
    /// in place before a schedule starts (a Kafka producer's first record waits about a
    /// second for them). The message lands in the destination under an id no run counts.
    pub async fn warm(&mut self) {
        let id = uuid::Uuid::now_v7().to_string();
        self.send(&id, "agg-warm", 0, b"{}").await.await;
    }

    /// Hands message `i` (event id `id`, aggregate `key`, `body`) to the broker; the returned
    /// future resolves on its confirm (and panics on a refusal: a bench figure over lost
    /// messages would mean nothing).
    pub async fn send(
        &mut self,
        id: &str,
        key: &str,
        i: usize,
        body: &[u8],
    ) -> BoxFuture<'static, ()> {
        let h = headers(id, key, i);
        match self {
            Publisher::Amqp { ch, exchange, .. } => {
                let mut t = FieldTable::default();
                for (k, v) in &h[1..] {
                    t.insert((*k).into(), AMQPValue::LongString(v.clone().into()));
                }
                let props = lapin::BasicProperties::default()
                    .with_delivery_mode(2)
                    .with_message_id(id.into())
                    .with_content_type("application/json".into())
                    .with_type(TOPIC.into())
                    .with_headers(t);
                let confirm = ch
                    .basic_publish(
                        exchange.clone().into(),
                        TOPIC.into(),
                        BasicPublishOptions {
                            mandatory: true,
                            ..Default::default()
                        },
                        body,
                        props,
                    )
                    .await
                    .unwrap_or_else(|e| panic!("publishing {i}: {e}"));
                async move {
                    match confirm.await {
                        Ok(lapin::Confirmation::Ack(None)) => {}
                        other => panic!("message {i} not confirmed: {other:?}"),
                    }
                }
                .boxed()
            }
            Publisher::Kafka { producer, topic } => {
                let hs = h.iter().fold(OwnedHeaders::new(), |hs, (k, v)| {
                    hs.insert(Header {
                        key: k,
                        value: Some(v.as_bytes()),
                    })
                });
                let mut rec = FutureRecord::to(topic)
                    .partition(0)
                    .key(key)
                    .payload(body)
                    .headers(hs);
                // A full queue hands the record back: wait for room, as the sink does.
                let d = loop {
                    match producer.send_result(rec) {
                        Ok(d) => break d,
                        Err((_, back)) => {
                            rec = back;
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    }
                };
                async move {
                    match d.await {
                        Ok(Ok(_)) => {}
                        Ok(Err((e, _))) => panic!("record {i} not delivered: {e}"),
                        Err(_) => panic!("record {i} dropped"),
                    }
                }
                .boxed()
            }
            Publisher::Stream { producer, next_id } => {
                let msg = stream_message(*next_id, id, key, i, body.to_vec());
                *next_id += 1;
                let (tx, rx) = tokio::sync::oneshot::channel();
                let tx = Mutex::new(Some(tx));
                producer
                    .batch_send(vec![msg], move |r| {
                        let ok = matches!(&r, Ok(s) if s.confirmed());
                        if let Some(tx) = tx.lock().unwrap().take() {
                            let _ = tx.send(ok);
                        }
                        futures::future::ready(())
                    })
                    .await
                    .unwrap_or_else(|e| panic!("publishing {i} into the stream: {e}"));
                async move {
                    assert!(
                        rx.await.unwrap_or(false),
                        "message {i} not confirmed by the stream"
                    );
                }
                .boxed()
            }
        }
    }
}

/// Publishes `n` messages of `body(i)` through `p`, at most `window` confirms outstanding;
/// returns the time from the first send to the last confirm.
pub async fn drain_raw(
    p: &mut Publisher,
    n: usize,
    window: usize,
    body: impl Fn(usize) -> Vec<u8>,
) -> Duration {
    let t = Instant::now();
    let mut pending = std::collections::VecDeque::with_capacity(window);
    for i in 0..n {
        let id = uuid::Uuid::now_v7().to_string();
        let key = format!("agg-{}", i % 1000);
        pending.push_back(p.send(&id, &key, i, &body(i)).await);
        if pending.len() >= window {
            pending.pop_front().unwrap().await;
        }
    }
    for c in pending {
        c.await;
    }
    t.elapsed()
}

/// Waits (up to `limit`) until `arrivals` holds `n` ids; returns when it did.
pub async fn until_arrived(arrivals: &Arrivals, n: usize, limit: Duration) -> Instant {
    let t = Instant::now();
    loop {
        let seen = arrivals.lock().unwrap().len();
        if seen >= n {
            return Instant::now();
        }
        assert!(
            t.elapsed() < limit,
            "only {seen} of {n} arrived within {limit:?}"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

async fn amqp() -> lapin::Connection {
    lapin::Connection::connect(super::AMQP, lapin::ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672; run scripts/services.sh")
}

fn kafka_config() -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", KAFKA);
    c
}

pub async fn stream_env() -> rabbitmq_stream_client::Environment {
    rabbitmq_stream_client::Environment::builder()
        .host("127.0.0.1")
        .port(STREAM_PORT)
        .load_balancer_mode(true)
        .build()
        .await
        .unwrap_or_else(|e| {
            panic!("the RabbitMQ stream port 127.0.0.1:{STREAM_PORT} does not answer ({e}); run scripts/services.sh")
        })
}

/// The stream client's fast path, for comparison: `n` messages of `body(i)` into stream
/// `name` with `per_frame` messages per `batch_send` (one frame, each message its own
/// publishing id: no sub-entry batching), at most `frames` frames unconfirmed; returns the time from
/// the client's start to the last confirm.
pub async fn drain_stream_batched(
    name: &str,
    n: usize,
    per_frame: usize,
    frames: usize,
    body: impl Fn(usize) -> Vec<u8>,
) -> Duration {
    // From the client's start, as the relay is timed from its process start.
    let t = Instant::now();
    let env = stream_env().await;
    let mut producer = env
        .producer()
        .name(&format!("bench-{}", uuid::Uuid::now_v7()))
        .batch_size(per_frame)
        .build(name)
        .await
        .unwrap_or_else(|e| panic!("a producer on the stream {name}: {e}"));
    let mut pending = std::collections::VecDeque::new();
    let mut i = 0;
    while i < n {
        let to = (i + per_frame).min(n);
        let msgs: Vec<StreamMessage> = (i..to)
            .map(|j| {
                let id = uuid::Uuid::now_v7().to_string();
                let key = format!("agg-{}", j % 1000);
                stream_message(j as u64 + 1, &id, &key, j, body(j))
            })
            .collect();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let count = to - i;
        producer
            .batch_send(msgs, move |r| {
                let _ = tx.send(matches!(&r, Ok(s) if s.confirmed()));
                futures::future::ready(())
            })
            .await
            .unwrap_or_else(|e| panic!("publishing into the stream: {e}"));
        pending.push_back((rx, count));
        if pending.len() >= frames {
            confirm_frame(pending.pop_front().unwrap()).await;
        }
        i = to;
    }
    for f in pending {
        confirm_frame(f).await;
    }
    let took = t.elapsed();
    let _ = producer.close().await;
    took
}

async fn confirm_frame((mut rx, count): (tokio::sync::mpsc::UnboundedReceiver<bool>, usize)) {
    for _ in 0..count {
        assert!(
            rx.recv().await.unwrap_or(false),
            "a message of a frame was not confirmed by the stream"
        );
    }
}
