//! Shared test harness: real services (each test gets its own database, slot and names), the
//! outboxd binary as a child process, and polling with deadlines instead of sleeps.
#![allow(dead_code)]
pub mod inproc;
pub mod kafka;
pub mod killloop;
pub mod nats;
pub mod partitions;
pub mod poll;
pub mod proxy;
pub mod rmq_stream;
pub mod source_db;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const PG_ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";
/// The system server's port: the default every test uses unless it names a version.
pub const PG_PORT: u16 = 5432;
/// The private servers of `scripts/services/postgres-versions.sh`: (major version, port) on
/// 127.0.0.1. The script pins the same ports: change both together.
pub const PG_VERSIONS: [(u32, u16); 4] = [(14, 5414), (16, 5416), (17, 5417), (18, 5418)];

/// The admin connection string of the server on `port` (database `test`).
pub fn pg_admin(port: u16) -> String {
    format!("host=127.0.0.1 port={port} user=postgres dbname=test")
}

/// Connects to the admin database of the server on `port`; a server that does not answer is
/// reported with the command that starts it.
pub async fn pg_admin_connect(port: u16) -> tokio_postgres::Client {
    let fix = match PG_VERSIONS.iter().find(|(_, p)| *p == port) {
        None => "Start and configure it with `sudo scripts/services.sh`".to_string(),
        Some((major, _)) => format!(
            "PostgreSQL {major}: install and start it with `sudo scripts/services/postgres-versions.sh` \
             (or all services: `sudo scripts/services.sh`)"
        ),
    };
    pg_connect_or(&pg_admin(port), &fix).await
}

/// Polls `cond` until it holds or `timeout` passes; panics with `what` on timeout.
pub async fn wait_for<F, Fut>(what: &str, timeout: Duration, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if cond().await {
            return;
        }
        if Instant::now() > deadline {
            panic!("timed out after {timeout:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A unique lowercase name for this test run.
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}_{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    )
}

pub async fn pg_connect(conninfo: &str) -> tokio_postgres::Client {
    pg_connect_or(
        conninfo,
        "Start and configure it with `sudo scripts/services.sh`",
    )
    .await
}

/// [`pg_connect`] naming `fix` when the server does not answer.
async fn pg_connect_or(conninfo: &str, fix: &str) -> tokio_postgres::Client {
    let (client, conn) = match tokio_postgres::connect(conninfo, tokio_postgres::NoTls).await {
        Ok(c) => c,
        Err(e) => panic!("Postgres is not reachable ({conninfo}): {e}. {fix}"),
    };
    tokio::spawn(async move {
        let _ = conn.await;
    });
    client
}

/// A fresh database holding the contract's outbox table; dropped (with any test slots) at the
/// end of the test.
pub struct PgDb {
    pub name: String,
    pub slots: Vec<String>,
    /// The server's port on 127.0.0.1: [`PG_PORT`] or one of [`PG_VERSIONS`].
    pub port: u16,
}

pub const OUTBOX_DDL: &str = include_str!("../../migrations/postgres/001_outbox.sql");

impl PgDb {
    pub async fn create(prefix: &str) -> PgDb {
        PgDb::create_on(PG_PORT, prefix).await
    }

    /// The same on the server listening on `port` (one of [`PG_VERSIONS`]).
    pub async fn create_on(port: u16, prefix: &str) -> PgDb {
        let admin = pg_admin_connect(port).await;
        let level: String = admin.query_one("SHOW wal_level", &[]).await.unwrap().get(0);
        assert_eq!(
            level, "logical",
            "Postgres on port {port} runs with wal_level={level}: run `sudo scripts/services.sh` to configure it"
        );
        let name = unique(prefix);
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let db = PgDb {
            name,
            slots: Vec::new(),
            port,
        };
        db.client().await.batch_execute(OUTBOX_DDL).await.unwrap();
        db
    }

    pub fn dsn(&self) -> String {
        self.dsn_via(self.port)
    }

    pub fn dsn_via(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/{}", self.name)
    }

    pub fn conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={}",
            self.port, self.name
        )
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        pg_connect(&self.conninfo()).await
    }

    /// Slot `slot` is streaming to a walsender (not merely being created by a backend).
    pub async fn slot_active(&self, slot: impl AsRef<str>) -> bool {
        let slot = slot.as_ref();
        let c = pg_connect(&pg_admin(self.port)).await;
        c.query_opt(
            "SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
              WHERE s.slot_name = $1 AND s.confirmed_flush_lsn IS NOT NULL",
            &[&slot],
        )
        .await
        .unwrap()
        .is_some()
    }

    /// Drops `slot` once no walsender holds it. A relay that exited has closed its
    /// connection, but the server's walsender notices that a moment later: dropping before it
    /// has gone fails with 55006 ("replication slot ... is active").
    pub async fn drop_released_slot(&self, slot: &str) {
        let c = pg_connect(&pg_admin(self.port)).await;
        wait_for(
            "the slot released by its walsender",
            Duration::from_secs(30),
            || {
                let c = &c;
                async move {
                    c.query_opt(
                        "SELECT 1 FROM pg_replication_slots WHERE slot_name = $1 AND NOT active",
                        &[&slot],
                    )
                    .await
                    .unwrap()
                    .is_some()
                }
            },
        )
        .await;
        c.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
            .await
            .unwrap();
    }

    pub async fn slot_confirmed(&self, slot: &str) -> Option<String> {
        let c = pg_connect(&pg_admin(self.port)).await;
        c.query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .and_then(|r| r.get(0))
    }
}

impl Drop for PgDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let admin = pg_admin(self.port);
        // Slots are cluster-wide and keep WAL: never leave one behind.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let Ok((c, conn)) = tokio_postgres::connect(&admin, tokio_postgres::NoTls).await else {
                    return;
                };
                tokio::spawn(conn);
                for _ in 0..50 {
                    let r = c
                        .batch_execute(&format!(
                            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE database = '{name}' AND active;
                             SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{name}';"
                        ))
                        .await;
                    if r.is_ok() {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                let _ = c
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await;
            });
        })
        .join();
    }
}

/// Writes `n_tx` transactions of `per_tx` events with the producer helper; returns the ids in
/// commit order.
pub async fn write_events(
    client: &mut tokio_postgres::Client,
    n_tx: usize,
    per_tx: usize,
    topic: &str,
) -> Vec<uuid::Uuid> {
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let mut ids = Vec::with_capacity(n_tx * per_tx);
    for t in 0..n_tx {
        let mut tx = client.transaction().await.unwrap();
        for i in 0..per_tx {
            let payload = serde_json::json!({"invoice": t * per_tx + i, "total": "12.50", "customer": "Ayşe 🧾"});
            let id = outbox
                .write(
                    &mut tx,
                    topic,
                    &format!("agg-{}", (t * per_tx + i) % 97),
                    &payload,
                )
                .await
                .unwrap();
            ids.push(id);
        }
        tx.commit().await.unwrap();
    }
    ids
}

/// The outboxd binary as a child process, its stdout lines collected.
pub struct Relay {
    pub child: Child,
    pub lines: Arc<Mutex<Vec<String>>>,
    pub stderr: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Relay {
    pub fn start(args: &[&str]) -> Relay {
        Self::start_with_env(args, &[])
    }

    /// `OUTBOXD_TEST_BIN` runs the relay tests against another build (an older one, to see a
    /// test fail without the fix it covers), else this crate's binary.
    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Relay {
        match std::env::var("OUTBOXD_TEST_BIN") {
            Ok(bin) => Self::start_bin(&bin, args, env),
            Err(_) => Self::start_bin(env!("CARGO_BIN_EXE_outboxd"), args, env),
        }
    }

    /// Another outboxd binary than this crate's (an older build, to compare).
    pub fn start_bin(bin: &str, args: &[&str], env: &[(&str, &str)]) -> Relay {
        let mut cmd = Command::new(bin);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove("RUST_LOG");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().expect("spawn outboxd");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let out = child.stdout.take().unwrap();
        let l = lines.clone();
        let r1 = std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                l.lock().unwrap().push(line);
            }
        });
        let err = child.stderr.take().unwrap();
        let e = stderr.clone();
        let r2 = std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if std::env::var_os("OUTBOXD_TEST_VERBOSE").is_some() {
                    eprintln!("[outboxd] {line}");
                }
                let mut s = e.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Relay {
            child,
            lines,
            stderr,
            readers: vec![r1, r2],
        }
    }

    pub fn line_count(&self) -> usize {
        self.lines.lock().unwrap().len()
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// stderr without terminal colour codes (for matching `key=value` log fields).
    pub fn stderr_plain(&self) -> String {
        let s = self.stderr();
        let mut out = String::with_capacity(s.len());
        let mut chars = s.chars();
        while let Some(c) = chars.next() {
            if c == '\x1b' {
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    /// SIGKILL, then wait until every line the process wrote has been read.
    pub fn sigkill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
        self.join_readers();
    }

    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    /// Waits for the exit code (panics after `timeout`, showing stderr).
    pub async fn wait_exit(&mut self, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                self.join_readers();
                return status.code().unwrap_or(-1);
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "outboxd did not exit within {timeout:?}; stderr:\n{}",
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Relay {
    /// Waits for `n` stdout lines, stops the relay with SIGTERM, checks that it exits with 0
    /// and that exactly `n` lines came; returns them.
    pub async fn lines_then_stop(&mut self, n: usize, timeout: Duration) -> Vec<String> {
        let relay = &*self;
        wait_for(&format!("{n} lines"), timeout, || {
            let c = relay.line_count();
            async move { c >= n }
        })
        .await;
        self.signal("TERM");
        assert_eq!(self.wait_exit(timeout).await, 0, "{}", self.stderr());
        let lines = self.lines();
        assert_eq!(lines.len(), n, "{lines:?}");
        lines
    }

    /// Polls `cond` like [`wait_for`] while the relay runs: panics at once if the relay exits,
    /// and on timeout, showing its stderr either way (a relay that died or hangs at startup
    /// says where).
    pub async fn wait_running<F, Fut>(&mut self, what: &str, timeout: Duration, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + timeout;
        loop {
            if cond().await {
                return;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                self.join_readers();
                panic!(
                    "outboxd exited ({status}) while waiting for: {what}; stderr:\n{}",
                    self.stderr()
                );
            }
            if Instant::now() > deadline {
                panic!(
                    "timed out after {timeout:?} waiting for: {what}; the relay's stderr:\n{}",
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until stderr holds every one of `needles`; on timeout, panics showing stderr.
    pub async fn wait_for_stderr(&self, needles: &[&str], timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let err = self.stderr();
            if needles.iter().all(|n| err.contains(n)) {
                return;
            }
            if Instant::now() > deadline {
                let missing: Vec<&&str> = needles.iter().filter(|n| !err.contains(**n)).collect();
                panic!("timed out after {timeout:?} waiting for {missing:?} in the relay's stderr:\n{err}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Parsed stdout lines: `id` → line.
pub fn parse_lines(lines: &[String]) -> Vec<serde_json::Value> {
    lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON: {l:?}: {e}")))
        .collect()
}

/// RabbitMQ helpers: each test names its own exchange (and so its own `.unrouted`/`.dead`
/// queues) with [`amqp::Topology`], which deletes everything it named when dropped.
pub mod amqp {
    use futures::StreamExt;
    use lapin::message::Delivery;
    use lapin::options::{
        BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ExchangeDeclareOptions,
        ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions, QueueDeleteOptions,
    };
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
    use std::time::{Duration, Instant};

    pub const HOST_PORT: u16 = 5672;

    /// The sink URL for the local broker, optionally through another port (a proxy).
    pub fn url_via(port: u16) -> String {
        format!("amqp://guest:guest@127.0.0.1:{port}/%2f")
    }

    pub fn url() -> String {
        url_via(HOST_PORT)
    }

    /// Connects to the local broker, waiting up to a minute: other tests on the machine may be
    /// restarting it.
    pub async fn connect() -> Connection {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match Connection::connect(&url(), ConnectionProperties::default()).await {
                Ok(c) => return c,
                Err(e) if Instant::now() > deadline => panic!(
                    "RabbitMQ is not reachable at 127.0.0.1:{HOST_PORT}: {e}. Start it with `sudo scripts/services.sh`"
                ),
                Err(_) => tokio::time::sleep(Duration::from_millis(250)).await,
            }
        }
    }

    /// A header value as a string (long strings only).
    pub fn header_str(d: &Delivery, key: &str) -> Option<String> {
        match d.properties.headers().as_ref()?.inner().get(key)? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.to_string()),
            _ => None,
        }
    }

    pub fn header(d: &Delivery, key: &str) -> Option<AMQPValue> {
        d.properties.headers().as_ref()?.inner().get(key).cloned()
    }

    pub fn message_id(d: &Delivery) -> uuid::Uuid {
        d.properties
            .message_id()
            .as_ref()
            .expect("message_id")
            .as_str()
            .parse()
            .expect("message_id is a UUID")
    }

    pub struct Topology {
        pub exchange: String,
        /// Reopened when the broker was restarted.
        conn: tokio::sync::Mutex<Connection>,
        queues: Vec<String>,
        /// Further exchanges to delete on drop (partition layouts).
        exchanges: Vec<String>,
    }

    impl Topology {
        pub async fn new(prefix: &str) -> Topology {
            let exchange = super::unique(prefix);
            Topology {
                queues: vec![format!("{exchange}.unrouted"), format!("{exchange}.dead")],
                exchange,
                conn: tokio::sync::Mutex::new(connect().await),
                exchanges: Vec::new(),
            }
        }

        /// Deletes these queues and exchanges too when dropped (declared by the relay or by
        /// `outboxd topology`).
        pub fn adopt(&mut self, queues: &[String], exchanges: &[String]) {
            self.queues.extend_from_slice(queues);
            self.exchanges.extend_from_slice(exchanges);
        }

        /// Adopts a partition layout: `<prefix>.p0 … p<n-1>` and `<prefix>.partitioned`, and for
        /// a consumer group its `<prefix>.unrouted`; returns the queue names in partition order.
        pub fn adopt_partitions(&mut self, prefix: &str, n: u32, group: bool) -> Vec<String> {
            let queues: Vec<String> = (0..n).map(|k| format!("{prefix}.p{k}")).collect();
            self.adopt(&queues, &[format!("{prefix}.partitioned")]);
            if group {
                let u = format!("{prefix}.unrouted");
                self.adopt(std::slice::from_ref(&u), std::slice::from_ref(&u));
            }
            queues
        }

        pub fn unrouted(&self) -> String {
            format!("{}.unrouted", self.exchange)
        }

        pub fn dead(&self) -> String {
            format!("{}.dead", self.exchange)
        }

        pub async fn channel(&self) -> Channel {
            let mut conn = self.conn.lock().await;
            if !conn.status().connected() {
                *conn = connect().await;
            }
            conn.create_channel().await.expect("channel")
        }

        /// Waits until the relay has declared the exchange (a passive declaration succeeds).
        pub async fn wait_declared(&self, timeout: Duration) {
            let x = self.exchange.clone();
            super::wait_for(&format!("exchange {x} to be declared"), timeout, || {
                let x = x.clone();
                async move {
                    // A failed passive declaration closes the channel: a new one each time.
                    let ch = self.channel().await;
                    ch.exchange_declare(
                        x.into(),
                        ExchangeKind::Topic,
                        ExchangeDeclareOptions {
                            passive: true,
                            ..Default::default()
                        },
                        FieldTable::default(),
                    )
                    .await
                    .is_ok()
                }
            })
            .await;
        }

        /// Declares a durable queue `<exchange>.<suffix>` bound with `pattern`; deleted on drop.
        pub async fn bind_queue(&mut self, suffix: &str, pattern: &str) -> String {
            let q = format!("{}.{suffix}", self.exchange);
            let ch = self.channel().await;
            ch.queue_declare(
                q.clone().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .expect("queue.declare");
            ch.queue_bind(
                q.clone().into(),
                self.exchange.clone().into(),
                pattern.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .expect("queue.bind");
            self.queues.push(q.clone());
            q
        }

        /// Messages ready in `queue` (0 when it does not exist).
        pub async fn queue_len(&self, queue: &str) -> u32 {
            let ch = self.channel().await;
            match ch
                .queue_declare(
                    queue.into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
            {
                Ok(q) => q.message_count(),
                Err(_) => 0,
            }
        }

        /// Consumes exactly `n` messages from `queue` (auto-ack), panicking at the deadline.
        pub async fn take(&self, queue: &str, n: usize, timeout: Duration) -> Vec<Delivery> {
            let ch = self.channel().await;
            ch.basic_qos(2000, BasicQosOptions::default())
                .await
                .expect("basic.qos");
            let tag = super::unique("c");
            let mut consumer = ch
                .basic_consume(
                    queue.into(),
                    tag.clone().into(),
                    BasicConsumeOptions {
                        no_ack: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .expect("basic.consume");
            let deadline = Instant::now() + timeout;
            let mut out = Vec::with_capacity(n);
            while out.len() < n {
                let left = deadline.saturating_duration_since(Instant::now());
                match tokio::time::timeout(left, consumer.next()).await {
                    Ok(Some(Ok(d))) => out.push(d),
                    Ok(other) => panic!("consumer on {queue} ended: {other:?}"),
                    Err(_) => panic!(
                        "timed out after {timeout:?}: {} of {n} messages from {queue}",
                        out.len()
                    ),
                }
            }
            let _ = ch
                .basic_cancel(tag.into(), BasicCancelOptions::default())
                .await;
            out
        }

        /// Everything in `queue` now (use when nothing publishes any more).
        pub async fn take_all(&self, queue: &str) -> Vec<Delivery> {
            let n = self.queue_len(queue).await as usize;
            let got = self.take(queue, n, Duration::from_secs(60)).await;
            assert_eq!(
                self.queue_len(queue).await,
                0,
                "{queue} is empty after taking {n}"
            );
            got
        }
    }

    /// The management API on 127.0.0.1:15672 as guest: (status, body). `curl` does the HTTP.
    pub fn mgmt(method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let mut cmd = std::process::Command::new("curl");
        cmd.args([
            "-s",
            "-u",
            "guest:guest",
            "-X",
            method,
            "-w",
            "\n%{http_code}",
        ])
        .arg(format!("http://127.0.0.1:15672/api/{path}"));
        if let Some(b) = body {
            cmd.args(["-H", "content-type: application/json", "--data-binary", b]);
        }
        let out = cmd.output().unwrap_or_else(|e| {
            panic!("curl cannot run ({e}): install it with `apt-get install -y curl`")
        });
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        let code: u16 = code.trim().parse().unwrap_or(0);
        assert!(
            code != 0,
            "RabbitMQ's management API at 127.0.0.1:15672 does not answer: run `scripts/services.sh` (as root) to enable it"
        );
        (code, body.to_string())
    }

    /// Messages published on each channel of the open connection the client named
    /// `connection_name` (the relay names its connection `outboxd <name>`), from the
    /// management API; empty while no such connection is open. The broker refreshes these
    /// statistics every few seconds, so wait for a condition on them rather than read once.
    pub fn published_per_channel(connection_name: &str) -> Vec<u64> {
        let (code, body) = mgmt("GET", "connections?columns=name,user_provided_name", None);
        assert_eq!(code, 200, "list connections: {body}");
        let conns: Vec<serde_json::Value> = serde_json::from_str(&body).expect("connections JSON");
        let Some(conn) = conns
            .iter()
            .find(|c| c["user_provided_name"].as_str() == Some(connection_name))
            .and_then(|c| c["name"].as_str())
        else {
            return Vec::new();
        };
        let enc = percent_encoding::utf8_percent_encode(conn, percent_encoding::NON_ALPHANUMERIC);
        let (code, body) = mgmt("GET", &format!("connections/{enc}/channels"), None);
        if code == 404 {
            return Vec::new();
        }
        assert_eq!(code, 200, "channels of {conn}: {body}");
        let chans: Vec<serde_json::Value> = serde_json::from_str(&body).expect("channels JSON");
        chans
            .iter()
            .map(|c| c["message_stats"]["publish"].as_u64().unwrap_or(0))
            .collect()
    }

    /// A broker user of the test's own (a unique name, full rights on vhost `/`), deleted on
    /// drop: a login with a password the test chose, without touching `guest`.
    pub struct TempUser {
        pub name: String,
        pub password: String,
    }

    impl TempUser {
        pub fn create(prefix: &str, password: &str) -> TempUser {
            let name = super::unique(prefix);
            let body = serde_json::json!({"password": password, "tags": ""}).to_string();
            let (code, text) = mgmt("PUT", &format!("users/{name}"), Some(&body));
            assert!(
                code == 201 || code == 204,
                "create user {name}: {code} {text}"
            );
            let rights = r#"{"configure": ".*", "write": ".*", "read": ".*"}"#;
            let (code, text) = mgmt("PUT", &format!("permissions/%2F/{name}"), Some(rights));
            assert!(
                code == 201 || code == 204,
                "permissions of {name}: {code} {text}"
            );
            TempUser {
                name,
                password: password.to_string(),
            }
        }

        /// `amqp://name:password@127.0.0.1:port/%2f`.
        pub fn url(&self, port: u16) -> String {
            format!(
                "amqp://{}:{}@127.0.0.1:{port}/%2f",
                self.name, self.password
            )
        }
    }

    impl Drop for TempUser {
        fn drop(&mut self) {
            let _ = mgmt("DELETE", &format!("users/{}", self.name), None);
        }
    }

    impl Drop for Topology {
        fn drop(&mut self) {
            let x = self.exchange.clone();
            let queues = std::mem::take(&mut self.queues);
            let mut exchanges = std::mem::take(&mut self.exchanges);
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    let Ok(Ok(conn)) = tokio::time::timeout(
                        Duration::from_secs(10),
                        Connection::connect(&url(), ConnectionProperties::default()),
                    )
                    .await
                    else {
                        return;
                    };
                    for q in queues {
                        if let Ok(ch) = conn.create_channel().await {
                            let _ = ch
                                .queue_delete(q.into(), QueueDeleteOptions::default())
                                .await;
                        }
                    }
                    exchanges.extend([format!("{x}.unrouted"), x]);
                    for e in exchanges {
                        if let Ok(ch) = conn.create_channel().await {
                            let _ = ch
                                .exchange_delete(e.into(), ExchangeDeleteOptions::default())
                                .await;
                        }
                    }
                    let _ = conn.close(200, "OK".into()).await;
                });
            })
            .join();
        }
    }
}

// ---------------------------------------------------------------------------------------------
// MariaDB
// ---------------------------------------------------------------------------------------------

pub const MY_HOST: &str = "127.0.0.1";
pub const MY_PORT: u16 = 3306;
pub const MY_OUTBOX_DDL: &str = include_str!("../../migrations/mysql/001_outbox.sql");

fn my_opts(db: Option<&str>, port: u16) -> mysql_async::OptsBuilder {
    mysql_async::OptsBuilder::default()
        .ip_or_hostname(MY_HOST)
        .tcp_port(port)
        .user(Some("root"))
        .db_name(db)
        .prefer_socket(false)
}

/// A session as root (the database may be `None`); panics with the way to start the server.
pub async fn my_connect(db: Option<&str>) -> mysql_async::Conn {
    match tokio::time::timeout(
        Duration::from_secs(20),
        mysql_async::Conn::new(my_opts(db, MY_PORT)),
    )
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => panic!(
            "MariaDB is not reachable ({MY_HOST}:{MY_PORT}, root): {e}. Start and configure it with `sudo scripts/services.sh`"
        ),
        Err(_) => panic!(
            "MariaDB did not answer within 20s ({MY_HOST}:{MY_PORT}). Start and configure it with `sudo scripts/services.sh`"
        ),
    }
}

/// Runs statements (several allowed, `;`-separated) and drops their results.
pub async fn my_exec(conn: &mut mysql_async::Conn, sql: &str) {
    use mysql_async::prelude::Queryable;
    conn.query_drop(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
}

/// One value of a single-row query, as text.
pub async fn my_value(conn: &mut mysql_async::Conn, sql: &str) -> Option<String> {
    use mysql_async::prelude::Queryable;
    let row: Option<mysql_async::Row> = conn
        .query_first(sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    row.and_then(|r| match r.as_ref(0) {
        Some(mysql_async::Value::Bytes(b)) => Some(String::from_utf8_lossy(b).into_owned()),
        Some(mysql_async::Value::Int(i)) => Some(i.to_string()),
        Some(mysql_async::Value::UInt(u)) => Some(u.to_string()),
        Some(mysql_async::Value::NULL) | None => None,
        Some(other) => Some(format!("{other:?}")),
    })
}

/// A fresh database holding the contract's outbox table; dropped at the end of the test.
pub struct MyDb {
    pub name: String,
}

impl MyDb {
    pub async fn create(prefix: &str) -> MyDb {
        let mut admin = my_connect(None).await;
        let settings = my_value(
            &mut admin,
            "SELECT CONCAT_WS(' ', @@log_bin, @@binlog_format, @@binlog_row_image, @@binlog_row_metadata)",
        )
        .await
        .unwrap_or_default();
        assert!(
            settings == "1 ROW FULL FULL" || settings == "ON ROW FULL FULL",
            "MariaDB runs with log_bin binlog_format binlog_row_image binlog_row_metadata = {settings}: run `sudo scripts/services.sh` to configure it"
        );
        let name = unique(prefix);
        my_exec(&mut admin, &format!("CREATE DATABASE `{name}`")).await;
        let db = MyDb { name };
        let mut c = db.conn().await;
        my_exec(&mut c, MY_OUTBOX_DDL).await;
        db
    }

    pub fn dsn(&self) -> String {
        format!("mysql://root@{MY_HOST}:{MY_PORT}/{}", self.name)
    }

    pub fn dsn_via(&self, port: u16) -> String {
        format!("mariadb://root@{MY_HOST}:{port}/{}", self.name)
    }

    pub async fn conn(&self) -> mysql_async::Conn {
        my_connect(Some(&self.name)).await
    }

    /// The stored position of relay `name`: (file, pos, gtid state).
    pub async fn stored(&self, name: &str) -> Option<(String, u64, Option<String>)> {
        use mysql_async::prelude::Queryable;
        let mut c = self.conn().await;
        let exists = my_value(
            &mut c,
            &format!(
                "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = '{}' AND TABLE_NAME = 'outboxd_state'",
                self.name
            ),
        )
        .await;
        if exists.as_deref() != Some("1") {
            return None;
        }
        let row: Option<(Option<String>, Option<u64>, Option<String>)> = c
            .exec_first(
                "SELECT binlog_file, binlog_pos, gtid_state FROM outboxd_state WHERE name = ?",
                (name,),
            )
            .await
            .unwrap();
        row.and_then(|(f, p, g)| Some((f?, p?, g)))
    }

    /// The processlist id of a binlog dump thread serving this database (the relay's stream).
    pub async fn dump_thread(&self) -> Option<u64> {
        let mut c = my_connect(None).await;
        my_value(
            &mut c,
            &format!(
                "SELECT ID FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%' AND DB = '{}' ORDER BY ID DESC LIMIT 1",
                self.name
            ),
        )
        .await
        .and_then(|s| s.parse().ok())
    }

    pub async fn streaming(&self) -> bool {
        self.dump_thread().await.is_some()
    }
}

impl Drop for MyDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        run_detached(async move {
            use mysql_async::prelude::Queryable;
            let Ok(Ok(mut c)) = tokio::time::timeout(
                Duration::from_secs(10),
                mysql_async::Conn::new(my_opts(None, MY_PORT)),
            )
            .await
            else {
                return;
            };
            let _ = c
                .query_drop(format!("DROP DATABASE IF EXISTS `{name}`"))
                .await;
            let _ = c.disconnect().await;
        });
    }
}

/// The server's current binlog head: (file, pos).
pub async fn my_head() -> (String, u64) {
    use mysql_async::prelude::Queryable;
    let mut c = my_connect(None).await;
    let row: mysql_async::Row = c.query_first("SHOW MASTER STATUS").await.unwrap().unwrap();
    let file: String = row.get(0).unwrap();
    let pos: u64 = row.get(1).unwrap();
    (file, pos)
}

impl MyDb {
    /// Where this database's relay ends up storing once everything written so far is
    /// confirmed: the end of the last transaction in the binlog that wrote anything but this
    /// database's `outboxd_state`. The relay's own lease and position writes never move its
    /// position (each would cause the next), so the raw head, taken while a relay renews its
    /// lease every second, may never be reached.
    pub async fn head_past_writes(&self) -> (String, u64) {
        use mysql_async::prelude::Queryable;
        let mut c = my_connect(None).await;
        let own = format!("({}.outboxd_state)", self.name);
        let files: Vec<String> = c
            .query_map("SHOW BINARY LOGS", |row: mysql_async::Row| {
                row.get::<String, _>(0).unwrap()
            })
            .await
            .unwrap();
        for file in files.iter().rev() {
            let events: Vec<(String, u64, String)> = c
                .query_map(
                    format!("SHOW BINLOG EVENTS IN '{file}'"),
                    |row: mysql_async::Row| {
                        (
                            row.get::<String, _>(2).unwrap(),
                            row.get::<u64, _>(4).unwrap(),
                            row.get::<Vec<u8>, _>(5)
                                .map(|b| String::from_utf8_lossy(&b).into_owned())
                                .unwrap_or_default(),
                        )
                    },
                )
                .await
                .unwrap();
            // (all its tables were our state table, it wrote some table, it is transactional)
            let mut open: Option<(bool, bool, bool)> = None;
            let mut last = None;
            for (kind, end, info) in events {
                match kind.as_str() {
                    "Gtid" => open = Some((true, false, info.starts_with("BEGIN"))),
                    "Table_map" => {
                        if let Some(t) = open.as_mut() {
                            t.1 = true;
                            t.0 &= info.ends_with(&own);
                        }
                    }
                    "Xid" => {
                        if let Some((only_own, wrote, _)) = open.take() {
                            if !(only_own && wrote) {
                                last = Some(end);
                            }
                        }
                    }
                    "Query" => match open {
                        // A transaction's COMMIT (non-transactional tables) ends it.
                        Some((only_own, wrote, true)) if info == "COMMIT" => {
                            open = None;
                            if !(only_own && wrote) {
                                last = Some(end);
                            }
                        }
                        // A statement of its own (DDL) is a transaction of its own.
                        Some((_, _, false)) => {
                            open = None;
                            last = Some(end);
                        }
                        _ => {}
                    },
                    _ => {}
                }
            }
            if let Some(end) = last {
                return (file.clone(), end);
            }
        }
        panic!("no transaction in the binlog but {own}")
    }
}

/// Orders binlog coordinates like the server does (file sequence, then position).
pub fn binlog_ge(a: &(String, u64), b: &(String, u64)) -> bool {
    let seq = |f: &str| -> u64 {
        f.rsplit('.')
            .next()
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    };
    (seq(&a.0), a.1) >= (seq(&b.0), b.1)
}

/// Writes `n_tx` transactions of `per_tx` events with the producer helper; returns the ids in
/// commit order.
pub async fn my_write_events(
    conn: &mut mysql_async::Conn,
    n_tx: usize,
    per_tx: usize,
    topic: &str,
) -> Vec<uuid::Uuid> {
    use mysql_async::prelude::Queryable;
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let mut ids = Vec::with_capacity(n_tx * per_tx);
    for t in 0..n_tx {
        let mut tx = conn
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .unwrap();
        for i in 0..per_tx {
            let n = t * per_tx + i;
            let payload =
                serde_json::json!({"invoice": n, "total": "12.50", "customer": "Ayşe 🧾"});
            let id = outbox
                .write(&mut tx, topic, &format!("{}", n % 97), &payload)
                .await
                .unwrap();
            ids.push(id);
        }
        tx.commit().await.unwrap();
    }
    let _ = conn.ping().await;
    ids
}

/// The test CA directory of `scripts/services.sh` (`OUTBOXD_PG_TLS_DIR`, default
/// /etc/outboxd/tls): `ca.crt` signed the Postgres and MariaDB server certificates (both name
/// `localhost` and `127.0.0.1`); `ca-other.crt` signed nothing here.
pub fn tls_dir() -> std::path::PathBuf {
    std::env::var_os("OUTBOXD_PG_TLS_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/etc/outboxd/tls"))
}

/// A file of the test CA directory, which must exist: a missing one fails the test.
pub fn tls_file(name: &str) -> String {
    let path = tls_dir().join(name);
    assert!(
        path.is_file(),
        "{} does not exist: the TLS tests need the test CA and the server certificates. \
         Run `sudo scripts/services.sh` (it creates them in {} and turns TLS on in Postgres and \
         MariaDB; OUTBOXD_PG_TLS_DIR points both it and the tests elsewhere)",
        path.display(),
        tls_dir().display()
    );
    path.to_str().unwrap().to_string()
}

/// Runs `f` to completion on a runtime of its own, in a thread of its own: cleanup from `Drop`,
/// which may run inside a runtime or outside one.
pub fn run_detached<F: std::future::Future<Output = ()> + Send + 'static>(f: F) {
    let _ = std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f)
    })
    .join();
}

/// The event ids a stdout relay printed, in order.
pub fn printed_ids(relay: &Relay) -> Vec<uuid::Uuid> {
    ids_of(&relay.lines())
}

/// The ids of stdout event lines, in their order.
pub fn ids_of(lines: &[String]) -> Vec<uuid::Uuid> {
    parse_lines(lines)
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// How many ids of `got` repeat an earlier one.
pub fn dups(got: &[uuid::Uuid]) -> usize {
    got.len() - got.iter().collect::<std::collections::HashSet<_>>().len()
}

/// Every expected id is in `got` (at least once).
pub fn assert_none_lost(expected: &[uuid::Uuid], got: &[uuid::Uuid]) {
    let set: std::collections::HashSet<_> = got.iter().collect();
    let lost: Vec<_> = expected.iter().filter(|i| !set.contains(i)).collect();
    assert!(
        lost.is_empty(),
        "{} of {} events lost, first {:?}",
        lost.len(),
        expected.len(),
        lost.first()
    );
}

/// Waits until every id of `expected` was printed by one of `relays`.
pub async fn wait_all_printed(relays: &[&Relay], expected: &[uuid::Uuid], timeout: Duration) {
    wait_for("every event", timeout, || {
        let got: std::collections::HashSet<uuid::Uuid> =
            relays.iter().flat_map(|r| printed_ids(r)).collect();
        let all = expected.iter().all(|i| got.contains(i));
        async move { all }
    })
    .await;
}

/// `--ha`: watches a leader cut off from its database and a standby until the leader exited and
/// the standby printed its first event. Returns, counted from the call: when the leader exited,
/// its exit code, when the standby first published.
pub async fn watch_takeover(
    leader: &mut Relay,
    standby: &Relay,
    timeout: Duration,
) -> (Duration, i32, Duration) {
    let start = Instant::now();
    let mut leader_exit: Option<(Duration, i32)> = None;
    let mut standby_first: Option<Duration> = None;
    while start.elapsed() < timeout && (leader_exit.is_none() || standby_first.is_none()) {
        if leader_exit.is_none() {
            if let Some(status) = leader.child.try_wait().unwrap() {
                leader_exit = Some((start.elapsed(), status.code().unwrap_or(-1)));
            }
        }
        if standby_first.is_none() && standby.line_count() > 0 {
            standby_first = Some(start.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (exited, code) = leader_exit.expect("the stalled leader stopped");
    let first = standby_first.expect("the standby took over");
    (exited, code, first)
}

/// `--ha`: waits until `standby` says it is waiting for the lease.
pub async fn wait_standby(standby: &Relay, timeout: Duration) {
    wait_for("the standby waits", timeout, || {
        let s = standby.stderr();
        async move { s.contains("standby: waiting for the lease") }
    })
    .await;
}

/// Waits until a stdout relay printed at least `n` events.
pub async fn wait_lines(what: &str, relay: &Relay, n: usize, timeout: Duration) {
    wait_for(what, timeout, || {
        let got = relay.line_count();
        async move { got >= n }
    })
    .await;
}

/// A TCP port free on 127.0.0.1 just now (for `--metrics-addr`).
pub fn free_local_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The relay's `/metrics` text on `127.0.0.1:port` (empty when it does not answer).
pub async fn scrape_metrics(port: u16) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await else {
        return String::new();
    };
    let _ = s
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        .await;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out.split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default()
}

/// The value of one series (`name{labels}` exactly as rendered) in a metrics text.
pub fn metric_value(body: &str, series: &str) -> Option<f64> {
    body.lines()
        .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// The relay's `outboxd_reconnects_total{cause="sink"}` on `127.0.0.1:port` (0 while it does not
/// answer).
pub async fn sink_reconnects(port: u16) -> f64 {
    metric_value(
        &scrape_metrics(port).await,
        "outboxd_reconnects_total{cause=\"sink\"}",
    )
    .unwrap_or(0.0)
}

/// `--ha`: pauses `leader` (SIGSTOP) past its lease until `standby` has published `n` events,
/// then resumes it (SIGCONT) and waits for it to exit. Returns how many lines the leader had
/// printed when it was resumed, and its exit code. The pause is long (≥ the lease TTL) so the
/// reader thread has every line the leader wrote before it stopped.
pub async fn pause_until_taken_over(
    leader: &mut Relay,
    standby: &Relay,
    n: usize,
    timeout: Duration,
) -> (usize, i32) {
    leader.signal("STOP");
    let paused = Instant::now();
    wait_lines("the standby publishes", standby, n, timeout).await;
    eprintln!(
        "the standby published after the leader was paused for {:?}",
        paused.elapsed()
    );
    let printed = leader.line_count();
    leader.signal("CONT");
    let code = leader.wait_exit(timeout).await;
    (printed, code)
}
