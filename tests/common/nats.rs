//! The local NATS JetStream server for tests: a stream and subject prefix of the test's own,
//! deleted at the end, and reading back what the stream holds (counted by `Nats-Msg-Id`).

use async_nats::jetstream::{self, message::StreamMessage};
use futures::StreamExt;
use std::collections::HashMap;
use std::time::{Duration, Instant};

pub const PORT: u16 = 4222;
/// How `scripts/services.sh` starts the server, for the message of a test that cannot reach it.
pub const START: &str = "sudo scripts/services.sh (or: start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log)";

pub fn url_via(port: u16) -> String {
    format!("nats://127.0.0.1:{port}")
}

pub fn url() -> String {
    url_via(PORT)
}

/// Connects, waiting up to a minute (a restart test may have the server down for a moment).
pub async fn connect_port(port: u16) -> async_nats::Client {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(5))
            .connect(format!("127.0.0.1:{port}"))
            .await
        {
            Ok(c) => return c,
            Err(e) if Instant::now() > deadline => {
                panic!("NATS is not reachable at 127.0.0.1:{port}: {e}. Start it with {START}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// One stream of the test's own: `T_<unique>` capturing `<prefix>.>`.
pub struct TestStream {
    pub name: String,
    pub prefix: String,
    pub port: u16,
    pub js: jetstream::Context,
}

impl TestStream {
    /// Names only: the relay declares the stream (`--declare auto`).
    pub async fn new(tag: &str) -> TestStream {
        Self::on_port(tag, PORT).await
    }

    pub async fn on_port(tag: &str, port: u16) -> TestStream {
        let u = super::unique(tag);
        let js = jetstream::new(connect_port(port).await);
        TestStream {
            name: u.to_uppercase(),
            prefix: u,
            port,
            js,
        }
    }

    /// `--stream NAME --subject <prefix>.{topic}`.
    pub fn args(&self) -> Vec<String> {
        vec![
            "--stream".into(),
            self.name.clone(),
            "--subject".into(),
            format!("{}.{{topic}}", self.prefix),
        ]
    }

    pub fn dead(&self) -> String {
        format!("{}.dead", self.prefix)
    }

    /// Messages in the stream now (0 while it does not exist).
    pub async fn len(&self) -> u64 {
        match self.js.get_stream(&self.name).await {
            Ok(mut s) => s.info().await.map(|i| i.state.messages).unwrap_or(0),
            Err(_) => 0,
        }
    }

    pub async fn config(&self) -> jetstream::stream::Config {
        let mut s = self
            .js
            .get_stream(&self.name)
            .await
            .expect("the stream exists");
        s.info().await.unwrap().config.clone()
    }

    /// Every message the stream holds, in stream order.
    pub async fn messages(&self) -> Vec<StreamMessage> {
        let mut s = self
            .js
            .get_stream(&self.name)
            .await
            .expect("the stream exists");
        let info = s.info().await.unwrap().clone();
        if info.state.messages == 0 {
            return Vec::new();
        }
        let s = &s;
        let mut out: Vec<StreamMessage> =
            futures::stream::iter(info.state.first_sequence..=info.state.last_sequence)
                .map(|seq| async move { s.get_raw_message(seq).await.ok() })
                .buffered(32)
                .filter_map(|m| async move { m })
                .collect()
                .await;
        out.sort_by_key(|m| m.sequence);
        out
    }

    /// Each `Nats-Msg-Id` in the stream with how often it is stored.
    pub async fn id_counts(&self) -> (Vec<uuid::Uuid>, HashMap<uuid::Uuid, usize>) {
        let mut order = Vec::new();
        let mut counts = HashMap::new();
        for m in self.messages().await {
            let id = m
                .headers
                .get("Nats-Msg-Id")
                .map(|v| v.as_str().parse::<uuid::Uuid>().expect("a uuid"))
                .expect("every message has a Nats-Msg-Id");
            *counts.entry(id).or_insert(0) += 1;
            order.push(id);
        }
        (order, counts)
    }
}

impl Drop for TestStream {
    fn drop(&mut self) {
        let js = self.js.clone();
        let name = self.name.clone();
        super::run_detached(async move {
            let _ = js.delete_stream(&name).await;
        });
    }
}

/// Header value as text.
pub fn header(m: &StreamMessage, k: &str) -> Option<String> {
    m.headers.get(k).map(|v| v.as_str().to_string())
}
