//! Shared test harness: real services (each test gets its own database, slot and names), the
//! outboxd binary as a child process, and polling with deadlines instead of sleeps.
#![allow(dead_code)]
pub mod proxy;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const PG_ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";

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
    let (client, conn) = match tokio_postgres::connect(conninfo, tokio_postgres::NoTls).await {
        Ok(c) => c,
        Err(e) => panic!(
            "Postgres is not reachable ({conninfo}): {e}. Start and configure it with `sudo scripts/services.sh`"
        ),
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
}

pub const OUTBOX_DDL: &str = include_str!("../../migrations/postgres/001_outbox.sql");

impl PgDb {
    pub async fn create(prefix: &str) -> PgDb {
        let admin = pg_connect(PG_ADMIN).await;
        let level: String = admin.query_one("SHOW wal_level", &[]).await.unwrap().get(0);
        assert_eq!(
            level, "logical",
            "Postgres runs with wal_level={level}: run `sudo scripts/services.sh` to configure it"
        );
        let name = unique(prefix);
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap();
        let db = PgDb {
            name,
            slots: Vec::new(),
        };
        db.client().await.batch_execute(OUTBOX_DDL).await.unwrap();
        db
    }

    pub fn dsn(&self) -> String {
        format!("postgres://postgres@127.0.0.1:5432/{}", self.name)
    }

    pub fn dsn_via(&self, port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/{}", self.name)
    }

    pub fn conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port=5432 user=postgres dbname={}",
            self.name
        )
    }

    pub async fn client(&self) -> tokio_postgres::Client {
        pg_connect(&self.conninfo()).await
    }

    /// Slot `outboxd_<name>` exists and is held by a walsender. (`active` alone is not enough:
    /// `pg_create_logical_replication_slot` holds the slot too, from an ordinary backend, until
    /// the slot's consistent point, and a transaction committed before that point is never
    /// decoded.)
    pub async fn slot_active(&self, slot: &str) -> bool {
        let c = pg_connect(PG_ADMIN).await;
        c.query_opt(
            "SELECT 1 FROM pg_replication_slots s JOIN pg_stat_replication r ON r.pid = s.active_pid
              WHERE s.slot_name = $1 AND s.active",
            &[&slot],
        )
        .await
        .unwrap()
        .is_some()
    }

    pub async fn slot_confirmed(&self, slot: &str) -> Option<String> {
        let c = pg_connect(PG_ADMIN).await;
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
        // Slots are cluster-wide and keep WAL: never leave one behind.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                let Ok((c, conn)) = tokio_postgres::connect(PG_ADMIN, tokio_postgres::NoTls).await else {
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
        let tx = client.transaction().await.unwrap();
        for i in 0..per_tx {
            let payload = serde_json::json!({"invoice": t * per_tx + i, "total": "12.50", "customer": "Ayşe 🧾"});
            let id = outbox
                .write(
                    &tx,
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
}

impl Relay {
    pub fn start(args: &[&str]) -> Relay {
        Self::start_with_env(args, &[])
    }

    pub fn start_with_env(args: &[&str], env: &[(&str, &str)]) -> Relay {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_outboxd"));
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
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                l.lock().unwrap().push(line);
            }
        });
        let err = child.stderr.take().unwrap();
        let e = stderr.clone();
        std::thread::spawn(move || {
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

    pub fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -{sig} failed");
    }

    pub fn sigkill(&mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    /// Waits for the exit code (panics after `timeout`, showing stderr).
    pub async fn wait_exit(&mut self, timeout: Duration) -> i32 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                // Let the reader threads take the last lines.
                for _ in 0..40 {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
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
