//! Helpers for the consumer-kit tests (`tests/consumer_*.rs`): MariaDB databases of their own,
//! the example consumer as a child process, and publishing straight to the broker (copies of
//! relayed messages, hand-made events). Kept apart from `tests/common` so the shared harness
//! stays as it is.
#![allow(dead_code)]

use crate::common::unique;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeleteOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation};
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

pub const MY_DDL: &str = include_str!("../../migrations/mysql/003_processed_messages.sql");
pub const PG_DDL: &str = include_str!("../../migrations/postgres/003_processed_messages.sql");

/// A session as root on the local MariaDB (the shared harness's).
pub async fn my_conn(db: Option<&str>) -> mysql_async::Conn {
    crate::common::my_connect(db).await
}

/// A fresh MariaDB database holding the inbox tables; dropped at the end of the test.
pub struct MariaDb {
    pub name: String,
}

impl MariaDb {
    pub async fn create(prefix: &str) -> MariaDb {
        use mysql_async::prelude::Queryable;
        let name = unique(prefix);
        let mut admin = my_conn(None).await;
        admin
            .query_drop(format!("CREATE DATABASE `{name}`"))
            .await
            .unwrap();
        let db = MariaDb { name };
        db.conn().await.query_drop(MY_DDL).await.unwrap();
        db
    }

    pub fn dsn(&self) -> String {
        format!("mysql://root@127.0.0.1:3306/{}", self.name)
    }

    pub fn db_dsn(&self) -> outboxd::dsn::DbDsn {
        match outboxd::dsn::SourceDsn::parse(&self.dsn()).unwrap() {
            outboxd::dsn::SourceDsn::Mysql(d) => d,
            _ => unreachable!(),
        }
    }

    pub async fn conn(&self) -> mysql_async::Conn {
        my_conn(Some(&self.name)).await
    }

    /// One integer of a single-row query.
    pub async fn count(&self, sql: &str) -> i64 {
        use mysql_async::prelude::Queryable;
        let mut c = self.conn().await;
        let v: Option<i64> = c.query_first(sql).await.unwrap();
        let _ = c.disconnect().await;
        v.unwrap_or(0)
    }
}

impl Drop for MariaDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                use mysql_async::prelude::Queryable;
                let Ok(mut c) = tokio::time::timeout(Duration::from_secs(10), my_conn(None)).await
                else {
                    return;
                };
                let _ = c
                    .query_drop(format!("DROP DATABASE IF EXISTS `{name}`"))
                    .await;
                let _ = c.disconnect().await;
            });
        })
        .join();
    }
}

pub fn pg_db_dsn(dsn: &str) -> outboxd::dsn::DbDsn {
    match outboxd::dsn::SourceDsn::parse(dsn).unwrap() {
        outboxd::dsn::SourceDsn::Postgres(d) => d,
        _ => unreachable!(),
    }
}

/// `target/<profile>/examples/invoice_projection`, built by `cargo test` (and by
/// `cargo build --all-targets` in scripts/test.sh).
pub fn example_bin() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().and_then(|d| d.parent()).unwrap();
    let p = dir.join("examples").join("invoice_projection");
    assert!(
        p.exists(),
        "{} is missing: build it with `cargo build --example invoice_projection` (a plain `cargo test` builds it)",
        p.display()
    );
    p
}

/// A child process (the outboxd binary or the example) with its output collected.
pub struct Proc {
    pub child: Child,
    pub lines: Arc<Mutex<Vec<String>>>,
    pub stderr: Arc<Mutex<String>>,
    readers: Vec<std::thread::JoinHandle<()>>,
    label: String,
    /// The exit code once [`Proc::wait_exit`] saw it (-1 for a signal).
    pub exit: Option<i32>,
}

impl Proc {
    pub fn start(program: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Proc {
        let label = program
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut cmd = Command::new(program);
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove("RUST_LOG");
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", program.display()));
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
        let tag = label.clone();
        let r2 = std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if std::env::var_os("OUTBOXD_TEST_VERBOSE").is_some() {
                    eprintln!("[{tag}] {line}");
                }
                let mut s = e.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        Proc {
            child,
            lines,
            stderr,
            readers: vec![r1, r2],
            label,
            exit: None,
        }
    }

    pub fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    pub fn sigkill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        self.join_readers();
    }

    fn join_readers(&mut self) {
        for r in self.readers.drain(..) {
            let _ = r.join();
        }
    }

    pub fn running(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }

    /// The exit code (-1 for a signal), panicking with stderr after `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                self.join_readers();
                let code = status.code().unwrap_or(-1);
                self.exit = Some(code);
                return code;
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!(
                    "{} did not exit within {timeout:?}; stderr:\n{}",
                    self.label,
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until stderr contains `needle`, panicking with `what` and stderr after `timeout`
    /// (or at once when the process exited without printing it).
    pub async fn wait_stderr(&mut self, what: &str, timeout: Duration, needle: &str) {
        let deadline = Instant::now() + timeout;
        while !self.stderr().contains(needle) {
            if Instant::now() > deadline || !self.running() {
                panic!(
                    "waiting for {what} ({needle:?}); stderr:\n{}",
                    self.stderr()
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The example's final counters (`{"stats": {…}}`), after it exited.
    pub fn stats(&self) -> serde_json::Value {
        self.lines()
            .iter()
            .rev()
            .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .and_then(|v| v.get("stats").cloned())
            .unwrap_or_else(|| panic!("no stats line; stderr:\n{}", self.stderr()))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The example consumer on `db` (a DSN) reading `queue`; broker and database through the
/// environment, as passwords should travel.
pub fn start_consumer(db: &str, queue: &str, consumer: &str, extra: &[&str]) -> Proc {
    start_consumer_via(&crate::common::amqp::url(), db, queue, consumer, extra)
}

/// [`start_consumer`] with another broker URL (a fault proxy).
pub fn start_consumer_via(
    broker: &str,
    db: &str,
    queue: &str,
    consumer: &str,
    extra: &[&str],
) -> Proc {
    let mut args = vec![
        "run",
        "--queue",
        queue,
        "--consumer",
        consumer,
        "--retry-min",
        "20ms",
        "--retry-max",
        "500ms",
    ];
    args.extend_from_slice(extra);
    Proc::start(
        &example_bin(),
        &args,
        &[("OUTBOXD_BROKER", broker), ("OUTBOXD_DB", db)],
    )
}

/// Creates the inbox and projection tables through the example (`setup`).
pub async fn setup_projection(db: &str) {
    let mut p = Proc::start(&example_bin(), &["setup"], &[("OUTBOXD_DB", db)]);
    let code = p.wait_exit(Duration::from_secs(60)).await;
    assert_eq!(code, 0, "setup failed: {}", p.stderr());
}

/// A queue this test declared itself (with arguments `Topology::bind_queue` does not give);
/// deleted on drop.
pub struct OwnQueue {
    pub name: String,
}

impl OwnQueue {
    pub async fn declare(
        ch: &Channel,
        name: &str,
        exchange: &str,
        pattern: &str,
        single_active: bool,
    ) -> OwnQueue {
        let mut args = FieldTable::default();
        if single_active {
            args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        }
        ch.queue_declare(
            name.into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await
        .unwrap();
        if !exchange.is_empty() {
            ch.queue_bind(
                name.into(),
                exchange.into(),
                pattern.into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        }
        OwnQueue {
            name: name.to_string(),
        }
    }
}

impl Drop for OwnQueue {
    fn drop(&mut self) {
        let names = [self.name.clone(), format!("{}.dead", self.name)];
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let conn = crate::common::amqp::connect().await;
                for q in names {
                    if let Ok(ch) = conn.create_channel().await {
                        let _ = ch
                            .queue_delete(q.into(), QueueDeleteOptions::default())
                            .await;
                    }
                }
                let _ = conn.close(200, "OK".into()).await;
            });
        })
        .join();
    }
}

/// A confirm-mode channel for publishing test messages.
pub async fn publisher() -> Channel {
    let conn = crate::common::amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    // The connection lives as long as the channel is used: leak it into a task.
    tokio::spawn(async move {
        let _keep = conn;
        futures::future::pending::<()>().await;
    });
    ch
}

/// Publishes and waits for the broker's confirm.
pub async fn publish(
    ch: &Channel,
    exchange: &str,
    routing_key: &str,
    props: BasicProperties,
    body: &[u8],
) {
    let c = ch
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            body,
            props,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(
        matches!(c, Confirmation::Ack(None)),
        "publish to {exchange:?}/{routing_key:?} not taken: {c:?}"
    );
}

/// An invoice event as the relay would send it (message id, type, aggregate headers).
pub fn invoice_props(
    id: Uuid,
    topic: &str,
    customer: &str,
    version: Option<i64>,
) -> BasicProperties {
    let mut h = FieldTable::default();
    h.insert(
        "x-aggregate-id".into(),
        AMQPValue::LongString(customer.into()),
    );
    if let Some(v) = version {
        h.insert("x-aggregate-version".into(), AMQPValue::LongLongInt(v));
    }
    BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_type(topic.into())
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_headers(h)
}

pub fn invoice_body(invoice: i64, customer: &str, cents: i64) -> Vec<u8> {
    serde_json::json!({"invoice_id": invoice, "customer": customer, "total_cents": cents})
        .to_string()
        .into_bytes()
}

/// Messages ready in `queue` right now (0 when it does not exist). A channel per call: a
/// failed passive declaration closes its channel.
pub async fn ready(conn: &lapin::Connection, queue: &str) -> u32 {
    let Ok(ch) = conn.create_channel().await else {
        panic!("the test's broker connection is gone");
    };
    let n = ch
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|q| q.message_count())
        .unwrap_or(0);
    let _ = ch.close(200, "OK".into()).await;
    n
}

/// Takes exactly `n` messages from `queue` (auto-ack), panicking after a minute.
pub async fn take(
    conn: &lapin::Connection,
    queue: &str,
    n: usize,
) -> Vec<lapin::message::Delivery> {
    use futures::StreamExt;
    let ch = conn.create_channel().await.unwrap();
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            unique("take").into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let mut out = Vec::new();
    while out.len() < n {
        match tokio::time::timeout(Duration::from_secs(60), consumer.next()).await {
            Ok(Some(Ok(d))) => out.push(d),
            other => panic!("{} of {n} messages from {queue}: {other:?}", out.len()),
        }
    }
    let _ = ch.close(200, "OK".into()).await;
    out
}

/// Runs consumers started by `start` (which must pass `--until-empty`) one after the other
/// until one exits with the queue empty behind it: every copy and requeued message has then
/// been settled. Returns the exited processes (their stats).
pub async fn drain(
    conn: &lapin::Connection,
    queue: &str,
    start: impl Fn() -> Proc,
    timeout: Duration,
) -> Vec<Proc> {
    let mut done = Vec::new();
    for _ in 0..10 {
        let mut p = start();
        let code = p.wait_exit(timeout).await;
        assert_eq!(code, 0, "consumer stderr:\n{}", p.stderr());
        done.push(p);
        if ready(conn, queue).await == 0 {
            return done;
        }
    }
    panic!("{queue} did not stay empty");
}

/// SIGTERM, then the exit code must be 0 (graceful stop).
pub async fn stop(p: &mut Proc, timeout: Duration) {
    p.signal("TERM");
    let code = p.wait_exit(timeout).await;
    assert_eq!(code, 0, "consumer stderr:\n{}", p.stderr());
}
