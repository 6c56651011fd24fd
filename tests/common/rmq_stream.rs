//! The local RabbitMQ stream port for tests: a stream of the test's own (deleted at the end)
//! and reading back every message it holds, in stream order.
#![allow(dead_code)]

use futures::StreamExt;
use rabbitmq_stream_client::types::{OffsetSpecification, SimpleValue};
use rabbitmq_stream_client::Environment;
use std::time::{Duration, Instant};
use uuid::Uuid;

pub const PORT: u16 = 5552;
/// How the plugin is enabled, for the message of a test that cannot reach the stream port.
pub const ENABLE: &str =
    "sudo scripts/services.sh (or: rabbitmq-plugins enable rabbitmq_stream, no restart needed)";

pub fn url_via(port: u16) -> String {
    format!("rabbitmq-stream://guest:guest@127.0.0.1:{port}/%2f")
}

pub fn url() -> String {
    url_via(PORT)
}

pub async fn env() -> Environment {
    Environment::builder()
        .host("127.0.0.1")
        .port(PORT)
        .load_balancer_mode(true)
        .build()
        .await
        .unwrap_or_else(|e| {
            panic!("the RabbitMQ stream port 127.0.0.1:{PORT} does not answer ({e}). Enable it with {ENABLE}")
        })
}

/// One message as the tests look at it.
#[derive(Debug, Clone)]
pub struct Msg {
    pub id: Uuid,
    pub aggregate: String,
    pub position: String,
    pub publishing_id: u64,
    pub offset: u64,
}

fn text(v: Option<&SimpleValue>) -> String {
    match v {
        Some(SimpleValue::String(s)) => s.clone(),
        other => format!("{other:?}"),
    }
}

/// A stream name of the test's own; [`TestStream::delete`] removes the stream (and its
/// partitions' streams) at the end.
pub struct TestStream {
    pub name: String,
}

impl TestStream {
    pub fn new(tag: &str) -> TestStream {
        TestStream {
            name: super::unique(tag),
        }
    }

    /// The relay arguments for this stream.
    pub fn args(&self) -> Vec<String> {
        vec!["--sink".into(), url(), "--stream".into(), self.name.clone()]
    }

    /// `outboxd run` of relay `name` on `dsn` into this stream, with `extra` arguments.
    pub fn run_args(&self, dsn: &str, name: &str, extra: &[&str]) -> Vec<String> {
        let mut a: Vec<String> = ["run", "--source", dsn, "--name", name]
            .into_iter()
            .chain(extra.iter().copied())
            .map(String::from)
            .collect();
        a.extend(self.args());
        a
    }

    /// Every message of `stream`, in stream order: reads until at least `at_least` arrived
    /// (giving up after `patience`), then until the stream stays silent for a moment, so
    /// copies past the expected count are read too.
    pub async fn read_stream(stream: &str, at_least: usize, patience: Duration) -> Vec<Msg> {
        let env = env().await;
        let give_up = Instant::now() + patience;
        // The relay declares its stream when its sink connects, which may come after the test
        // saw the source streaming: a stream not there yet is waited for, within `patience`.
        let mut consumer = loop {
            match env
                .consumer()
                .offset(OffsetSpecification::First)
                .build(stream)
                .await
            {
                Ok(c) => break c,
                Err(_) if Instant::now() < give_up => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(_) => return Vec::new(),
            }
        };
        let mut out = Vec::new();
        loop {
            // The end of a stream is silence: a short wait once enough arrived, a long one
            // before (a loaded machine delivers chunks late).
            let wait = if out.len() >= at_least || Instant::now() > give_up {
                Duration::from_millis(800)
            } else {
                give_up.saturating_duration_since(Instant::now()) + Duration::from_millis(800)
            };
            match tokio::time::timeout(wait, consumer.next()).await {
                Ok(Some(Ok(d))) => {
                    let m = d.message();
                    let app = m.application_properties();
                    let get = |k: &str| app.and_then(|a| a.get(k));
                    let id = m
                        .properties()
                        .and_then(|p| p.message_id.as_ref())
                        .and_then(|id| <&String>::try_from(id).ok())
                        .and_then(|s| Uuid::parse_str(s).ok())
                        .unwrap_or_default();
                    out.push(Msg {
                        id,
                        aggregate: text(get("x-aggregate-id")),
                        position: text(get("x-source-position")),
                        // A long (int when small); earlier versions wrote a ulong.
                        publishing_id: match get("x-outbox-publishing-id") {
                            Some(SimpleValue::Ulong(n)) => *n,
                            Some(SimpleValue::Long(n)) => *n as u64,
                            Some(SimpleValue::Int(n)) => *n as u64,
                            _ => 0,
                        },
                        offset: d.offset(),
                    });
                }
                _ => break,
            }
        }
        let _ = consumer.handle().close().await;
        out
    }

    /// Whether the stream holds at least `n` messages: reads no further than the `n`-th, so
    /// that it answers while a relay keeps publishing (`read` waits for silence).
    pub async fn holds_at_least(&self, n: usize, patience: Duration) -> bool {
        let env = env().await;
        let Ok(mut consumer) = env
            .consumer()
            .offset(OffsetSpecification::First)
            .build(&self.name)
            .await
        else {
            return false;
        };
        let mut seen = 0;
        while seen < n {
            match tokio::time::timeout(patience, consumer.next()).await {
                Ok(Some(Ok(_))) => seen += 1,
                _ => break,
            }
        }
        let _ = consumer.handle().close().await;
        seen >= n
    }

    pub async fn read(&self, at_least: usize, patience: Duration) -> Vec<Msg> {
        Self::read_stream(&self.name, at_least, patience).await
    }

    pub async fn delete(&self, partitions: u32) {
        let env = env().await;
        let _ = env.delete_stream(&self.name).await;
        for k in 0..partitions {
            let _ = env.delete_stream(&format!("{}-{k}", self.name)).await;
        }
    }
}

/// Panics unless the messages of one stream carry strictly increasing publishing ids and, per
/// aggregate, strictly increasing source positions (commit order).
pub fn assert_ordered(msgs: &[Msg]) {
    for w in msgs.windows(2) {
        assert!(
            w[0].publishing_id < w[1].publishing_id,
            "publishing ids not increasing at offset {}: {} then {}",
            w[1].offset,
            w[0].publishing_id,
            w[1].publishing_id
        );
    }
    let mut last: std::collections::HashMap<&str, &str> = Default::default();
    for m in msgs {
        let p = super::source_db::Pos::of_event_indexed(&m.position)
            .unwrap_or_else(|| panic!("unreadable x-source-position {:?}", m.position));
        if let Some(prev) = last.insert(&m.aggregate, &m.position) {
            let q = super::source_db::Pos::of_event_indexed(prev).unwrap();
            assert!(
                q < p,
                "aggregate {} out of commit order: {prev} before {}",
                m.aggregate,
                m.position
            );
        }
    }
}
