//! What the benchmarks share: process figures from /proc, connections to the local services,
//! databases with the outbox table and backlogs written the same way on both databases, the
//! brokers' destinations, readers and bare publishers (`brokers`), a relay
//! child process whose stdout lines are counted, percentiles. Each bench is its own crate and
//! includes this file (`mod support;`, or `#[path = "support/mod.rs"]`); not every bench uses
//! every item.
#![allow(dead_code)]

pub mod brokers;

use mysql_async::prelude::Queryable;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Resident set size of a process, KiB.
pub fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
}

/// User + system CPU seconds of a process (from /proc/PID/stat, in clock ticks of 1/100 s).
pub fn cpu_secs(pid: u32) -> Option<f64> {
    stat_secs(pid, 11..=12)
}

/// [`cpu_secs`] plus the CPU of the process's children that ended and were waited for
/// (cutime + cstime): a Postgres backend that ends during a run moves its CPU into the
/// postmaster's, so a sum over the live server processes never goes backwards.
pub fn cpu_secs_with_reaped(pid: u32) -> Option<f64> {
    stat_secs(pid, 11..=14)
}

/// The sum of /proc/PID/stat's clock-tick fields `fields`, counted after the command name
/// (which is in parentheses and may hold spaces), in seconds.
fn stat_secs(pid: u32, fields: std::ops::RangeInclusive<usize>) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields
        .map(|i| f.get(i).and_then(|v| v.parse::<u64>().ok()))
        .sum::<Option<u64>>()?;
    Some(ticks as f64 / 100.0)
}

/// User + system CPU seconds of every live process whose command name is one of `names` (the
/// database server's processes, the broker's `beam.smp`) and of their ended children: what
/// the host spent beside the relay.
pub fn cpu_of(names: &[&str]) -> f64 {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0.0;
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| names.contains(&c.trim_end()))
        })
        .filter_map(cpu_secs_with_reaped)
        .sum()
}

/// CPU seconds the database servers (`postgres`, `mariadbd`) and the broker (`beam.smp`) have
/// used so far: sampled before and after a run, the difference is the run's host cost.
pub fn host_cpu() -> (f64, f64) {
    (
        cpu_of(&["postgres", "mariadbd", "mysqld"]),
        cpu_of(&["beam.smp"]),
    )
}

/// The 1-, 5- and 15-minute load average, as /proc/loadavg says it.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

pub fn my_opts(db: Option<&str>) -> mysql_async::OptsBuilder {
    mysql_async::OptsBuilder::default()
        .ip_or_hostname("127.0.0.1")
        .tcp_port(3306)
        .user(Some("root"))
        .db_name(db)
        .prefer_socket(false)
}

pub async fn my_connect(db: Option<&str>) -> mysql_async::Conn {
    mysql_async::Conn::new(my_opts(db))
        .await
        .unwrap_or_else(|e| panic!("MariaDB at 127.0.0.1:3306: {e}; run scripts/services.sh"))
}

/// Creates database `db` with the contract's outbox table; returns a session in it.
pub async fn my_create_db(db: &str) -> mysql_async::Conn {
    let mut admin = my_connect(None).await;
    admin
        .query_drop(format!("CREATE DATABASE `{db}`"))
        .await
        .unwrap();
    let mut c = my_connect(Some(db)).await;
    c.query_drop(include_str!("../../migrations/mysql/001_outbox.sql"))
        .await
        .unwrap();
    c
}

pub async fn my_drop_db(db: &str) {
    let mut admin = my_connect(None).await;
    let _ = admin.query_drop(format!("DROP DATABASE `{db}`")).await;
}

/// `events` outbox rows of ~300-byte JSON in transactions of 100 (the rows of the Postgres
/// benches, as MariaDB's JSON_OBJECT renders them).
pub async fn my_write_backlog(c: &mut mysql_async::Conn, events: usize) {
    my_backlog(c, events, 100).await
}

/// The server's binlog head, `FILE:POS`.
pub async fn my_head(c: &mut mysql_async::Conn) -> String {
    let row: mysql_async::Row = c.query_first("SHOW MASTER STATUS").await.unwrap().unwrap();
    let file: String = row.get(0).unwrap();
    let pos: u64 = row.get(1).unwrap();
    format!("{file}:{pos}")
}

/// Whether a binlog dump thread serves database `db` (the relay streams).
pub async fn my_streaming(c: &mut mysql_async::Conn, db: &str) -> bool {
    let n: Option<i64> = c
        .exec_first(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%' AND DB = ?",
            (db,),
        )
        .await
        .unwrap();
    n.unwrap_or(0) > 0
}

pub const PG_ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";
pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const BIN: &str = env!("CARGO_BIN_EXE_outboxd");

/// `cargo test --all-targets` runs bench targets too (without `--bench`): a benchmark is
/// minutes of load, so it runs only under `cargo bench`.
pub fn skip_unless_bench(name: &str) -> bool {
    if std::env::args().any(|a| a == "--bench") {
        return false;
    }
    println!("{name}: skipped (run it with `cargo bench --bench {name}`)");
    true
}

pub fn env_list(name: &str, default: &str) -> Vec<usize> {
    std::env::var(name)
        .unwrap_or_else(|_| default.into())
        .split(',')
        .filter_map(|v| v.trim().replace('_', "").parse().ok())
        .collect()
}

pub async fn pg(conninfo: &str) -> tokio_postgres::Client {
    let (c, conn) = tokio_postgres::connect(conninfo, tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("Postgres at {conninfo}: {e}; run scripts/services.sh"));
    tokio::spawn(conn);
    c
}

/// p50 / p99 / p99.9 of a sample (sorted here).
pub fn percentiles(mut v: Vec<f64>) -> (f64, f64, f64) {
    if v.is_empty() {
        return (f64::NAN, f64::NAN, f64::NAN);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (at(0.5), at(0.99), at(0.999))
}

/// One ~300-byte invoice body per row, the same on both databases (`g` is the row number).
pub const PG_BODY: &str =
    "json_build_object('invoice_id', g, 'customer_name', 'Muhammet Şafak', 'tax_id', '1234567890',
    'total', '1499.90', 'currency', 'TRY', 'lines', json_build_array(
    json_build_object('sku', 'A-100', 'qty', 2, 'price', '499.95'),
    json_build_object('sku', 'B-200', 'qty', 1, 'price', '500.00')), 'note', repeat('x', 60))";

/// A fresh Postgres database with the outbox table; returns (database, DSN, client).
pub async fn pg_database(prefix: &str) -> (String, String, tokio_postgres::Client) {
    let db = format!("{prefix}_{}", std::process::id());
    let admin = pg(PG_ADMIN).await;
    // Two statements: a multi-statement batch runs in one transaction, which DROP DATABASE
    // refuses.
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await
        .unwrap();
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let client = pg(&format!(
        "host=127.0.0.1 port=5432 user=postgres dbname={db}"
    ))
    .await;
    client
        .batch_execute(include_str!("../../migrations/postgres/001_outbox.sql"))
        .await
        .unwrap();
    let dsn = format!("postgres://postgres@127.0.0.1:5432/{db}?sslmode=disable");
    (db, dsn, client)
}

pub async fn pg_drop(db: &str, slot: &str) {
    let admin = pg(PG_ADMIN).await;
    let _ = admin
        .batch_execute(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = '{slot}'"
        ))
        .await;
    let _ = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
        .await;
}

/// Writes `events` outbox rows in transactions of `per_tx`.
pub async fn pg_backlog(client: &tokio_postgres::Client, events: usize, per_tx: usize) {
    let mut from = 0;
    while from < events {
        let to = (from + per_tx).min(events) - 1;
        client
            .batch_execute(&format!(
                "INSERT INTO outbox (id, aggregate_id, topic, payload)
                 SELECT gen_random_uuid(), 'agg-' || (g % 1000), 'invoice.issued', {PG_BODY}
                   FROM generate_series({from}, {to}) g"
            ))
            .await
            .unwrap();
        from = to + 1;
    }
}

/// A fresh MariaDB database with the outbox table; returns (database, DSN, connection).
pub async fn my_database(prefix: &str) -> (String, String, mysql_async::Conn) {
    let db = format!("{prefix}_{}", std::process::id());
    my_drop_db(&db).await;
    let c = my_create_db(&db).await;
    let dsn = format!("mysql://root@127.0.0.1:3306/{db}");
    (db, dsn, c)
}

/// Writes `events` outbox rows in transactions of `per_tx` (MariaDB's sequence engine).
pub async fn my_backlog(c: &mut mysql_async::Conn, events: usize, per_tx: usize) {
    let mut from = 0;
    while from < events {
        let to = (from + per_tx).min(events) - 1;
        c.query_drop(format!(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
             SELECT UNHEX(REPLACE(UUID(), '-', '')), seq % 1000, 'invoice.issued',
                    JSON_OBJECT('invoice_id', seq, 'customer_name', 'Muhammet Şafak', 'tax_id', '1234567890',
                                'total', '1499.90', 'currency', 'TRY', 'lines', JSON_ARRAY(
                                JSON_OBJECT('sku', 'A-100', 'qty', 2, 'price', '499.95'),
                                JSON_OBJECT('sku', 'B-200', 'qty', 1, 'price', '500.00')),
                                'note', REPEAT('x', 60)),
                    NOW(6)
               FROM seq_{from}_to_{to}"
        ))
        .await
        .unwrap();
        from = to + 1;
    }
}

/// Starts and stops a MariaDB relay once, so its position is stored: a backlog written after
/// it is then read from the binlog (a first start with `--snapshot never` begins at the head).
pub async fn my_first_start(c: &mut mysql_async::Conn, dsn: &str, name: &str) {
    let mut relay = Relay::stdout(&["--source", dsn, "--name", name]);
    my_wait_initialized(c, name).await;
    relay.stop();
}

/// Waits until relay `name`'s first start is done (its position stored).
pub async fn my_wait_initialized(c: &mut mysql_async::Conn, name: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let n: Option<i64> = c
            .query_first(format!(
                "SELECT COUNT(*) FROM outboxd_state WHERE name = '{name}' AND initialized_at IS NOT NULL"
            ))
            .await
            .unwrap_or(Some(0));
        if n == Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{name}: the first start did not store a position"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// An `outboxd run` child with the stdout sink, its lines counted by a reader thread.
pub struct Relay {
    pub child: Child,
    pub lines: Arc<AtomicUsize>,
}

impl Relay {
    /// `outboxd run --sink stdout --commit-offsets --snapshot never --log-level warn ARGS`.
    pub fn stdout(args: &[&str]) -> Relay {
        let mut child = Command::new(BIN)
            .args([
                "run",
                "--commit-offsets",
                "--snapshot",
                "never",
                "--log-level",
                "warn",
            ])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn outboxd");
        let out = child.stdout.take().unwrap();
        let lines = Arc::new(AtomicUsize::new(0));
        let counter = lines.clone();
        std::thread::spawn(move || {
            let mut r = BufReader::with_capacity(1 << 20, out);
            let mut buf = Vec::new();
            while r
                .read_until(b'\n', &mut buf)
                .map(|n| n > 0)
                .unwrap_or(false)
            {
                counter.fetch_add(1, Ordering::Relaxed);
                buf.clear();
            }
        });
        Relay { child, lines }
    }

    pub fn lines(&self) -> usize {
        self.lines.load(Ordering::Relaxed)
    }

    /// Samples RSS every 10 ms until `n` lines came out; returns (peak KiB, median KiB, time).
    pub async fn sample_until(&self, n: usize, limit: Duration) -> (u64, u64, Duration) {
        let start = Instant::now();
        let mut samples = Vec::new();
        while self.lines() < n {
            if let Some(r) = rss_kib(self.child.id()) {
                samples.push(r);
            }
            assert!(
                start.elapsed() < limit,
                "only {} of {n} lines within {limit:?}",
                self.lines()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = start.elapsed();
        samples.sort_unstable();
        let peak = samples.last().copied().unwrap_or(0);
        let median = samples.get(samples.len() / 2).copied().unwrap_or(0);
        (peak, median, took)
    }

    /// SIGTERM and wait.
    pub fn stop(&mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let _ = self.child.wait();
    }
}

pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// The relay's own topology for exchange `x` — a durable topic exchange whose alternate
/// exchange `x.unrouted` (fanout) feeds the queue `x.unrouted`, and the queue `x.dead` — plus
/// the measured queue `x.all` bound with `#`; returns `x.all`. Declared before a relay starts,
/// so the relay finds what it would declare itself.
pub async fn declare_with_one_queue(ch: &lapin::Channel, x: &str) -> String {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable};
    use lapin::ExchangeKind;
    let durable = ExchangeDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let q = QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    let unrouted = format!("{x}.unrouted");
    ch.exchange_declare(
        unrouted.clone().into(),
        ExchangeKind::Fanout,
        durable,
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(unrouted.clone().into(), q, FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(
        unrouted.clone().into(),
        unrouted.clone().into(),
        "".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut args = FieldTable::default();
    args.insert(
        "alternate-exchange".into(),
        AMQPValue::LongString(unrouted.into()),
    );
    ch.exchange_declare(x.into(), ExchangeKind::Topic, durable, args)
        .await
        .unwrap();
    ch.queue_declare(format!("{x}.dead").into(), q, FieldTable::default())
        .await
        .unwrap();
    let all = format!("{x}.all");
    ch.queue_declare(all.clone().into(), q, FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(
        all.clone().into(),
        x.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    all
}

pub async fn queue_len(ch: &lapin::Channel, q: &str) -> u32 {
    ch.queue_declare(
        q.into(),
        lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        lapin::types::FieldTable::default(),
    )
    .await
    .unwrap()
    .message_count()
}

pub async fn confirmed_lsn(admin: &tokio_postgres::Client, slot: &str) -> u64 {
    let s: Option<String> = admin
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    s.and_then(|s| outboxd::event::parse_lsn(&s)).unwrap_or(0)
}

pub async fn wal_end(c: &tokio_postgres::Client) -> u64 {
    let s: String = c
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    outboxd::event::parse_lsn(&s).unwrap()
}

/// Fresh slot and state, then a backlog of `events`.
pub async fn new_backlog(
    bin: &str,
    dsn: &str,
    admin: &tokio_postgres::Client,
    client: &tokio_postgres::Client,
    events: usize,
) {
    let _ = admin
        .batch_execute("SELECT pg_drop_replication_slot('outboxd_bench')")
        .await;
    // The state table exists only after the first setup.
    let _ = client
        .batch_execute("DELETE FROM outboxd_state WHERE name = 'bench'")
        .await;
    client.batch_execute("TRUNCATE outbox").await.unwrap();
    let ok = Command::new(bin)
        .args(["setup", "--source", dsn, "--name", "bench"])
        .stdout(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "outboxd setup failed");
    pg_backlog(client, events, 100).await;
}

/// The CPU each process group runs on in a pinned run (`OUTBOXD_BENCH_PIN=1`): cgroup v1
/// cpusets, one per CPU, so that the host's contention can be told apart from the relay's own
/// latency. With two CPUs the groups share: CPU 0 holds the database servers and the bench
/// process (producer and consumer), CPU 1 the broker and the relay. Processes are moved whole
/// (every thread; children they start later stay in their group); dropping the value moves
/// every one of them back to the root cpuset and removes the groups.
pub struct Pinning {
    groups: Vec<String>,
    /// What went where, for the report.
    pub placement: Vec<String>,
}

const CPUSET: &str = "/sys/fs/cgroup/cpuset";

impl Pinning {
    /// Creates the groups and pins the servers and this process; fails with what is missing.
    pub fn start() -> Result<Pinning, String> {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cpus < 2 {
            return Err(format!("pinning needs 2 CPUs, the host has {cpus}"));
        }
        if !std::path::Path::new(CPUSET).join("cgroup.procs").exists() {
            return Err(format!(
                "pinning needs the cgroup v1 cpuset controller at {CPUSET} (and root)"
            ));
        }
        let mems = std::fs::read_to_string(format!("{CPUSET}/cpuset.mems"))
            .map_err(|e| format!("{CPUSET}/cpuset.mems: {e}"))?;
        let mut p = Pinning {
            groups: Vec::new(),
            placement: Vec::new(),
        };
        for cpu in 0..2 {
            let dir = format!("{CPUSET}/outboxd_bench_cpu{cpu}");
            std::fs::create_dir_all(&dir).map_err(|e| format!("{dir}: {e} (root needed)"))?;
            // A cpuset takes tasks only once it has CPUs and memory nodes.
            std::fs::write(format!("{dir}/cpuset.cpus"), cpu.to_string())
                .and_then(|_| std::fs::write(format!("{dir}/cpuset.mems"), mems.trim()))
                .map_err(|e| format!("{dir}: {e}"))?;
            p.groups.push(dir);
        }
        let servers = |names: &[&str]| -> Vec<u32> {
            std::fs::read_dir("/proc")
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
                .filter(|pid| {
                    std::fs::read_to_string(format!("/proc/{pid}/comm"))
                        .is_ok_and(|c| names.contains(&c.trim_end()))
                })
                .collect()
        };
        for pid in servers(&["postgres", "mariadbd", "mysqld"]) {
            p.pin(0, pid)?;
        }
        for pid in servers(&["beam.smp", "epmd", "erl_child_setup", "inet_gethost"]) {
            p.pin(1, pid)?;
        }
        p.pin(0, std::process::id())?;
        p.placement = vec![
            "CPU 0: the database servers (postgres, mariadbd) and the bench process (producers, the dual write's publisher, the raw publisher, the consumer)".into(),
            "CPU 1: the broker (beam.smp) and the relay (outboxd run)".into(),
        ];
        Ok(p)
    }

    /// Moves process `pid` (every thread) into CPU `cpu`'s group.
    pub fn pin(&self, cpu: usize, pid: u32) -> Result<(), String> {
        let procs = format!("{}/cgroup.procs", self.groups[cpu]);
        match std::fs::write(&procs, pid.to_string()) {
            Ok(()) => Ok(()),
            // A process that ended meanwhile (a Postgres backend) has nothing to pin.
            Err(_) if !std::path::Path::new(&format!("/proc/{pid}")).exists() => Ok(()),
            Err(e) => Err(format!("{procs} ← {pid}: {e}")),
        }
    }
}

impl Drop for Pinning {
    fn drop(&mut self) {
        for dir in &self.groups {
            let procs = std::fs::read_to_string(format!("{dir}/cgroup.procs")).unwrap_or_default();
            for pid in procs.lines() {
                let _ = std::fs::write(format!("{CPUSET}/cgroup.procs"), pid);
            }
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// A free local TCP port (bound and released at once) for a child's `--metrics-addr`.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free local port")
}

/// The relay's Prometheus text from `GET /metrics` on `port` (empty when it does not answer).
pub fn scrape_metrics(port: u16) -> String {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return String::new();
    };
    let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n");
    let mut text = String::new();
    let _ = s.read_to_string(&mut text);
    text
}

/// One histogram of a Prometheus text: count, mean and the upper bound of the bucket that holds
/// quantile `q` (the buckets double, so this bound is within 2× of the true quantile).
pub fn histogram(text: &str, name: &str, q: f64) -> Option<(u64, f64, f64)> {
    let value = |suffix: &str| -> Option<f64> {
        let key = format!("{name}_{suffix} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse().ok())
    };
    let count = value("count")? as u64;
    if count == 0 {
        return None;
    }
    let mean = value("sum")? / count as f64;
    let prefix = format!("{name}_bucket{{le=\"");
    let bound = text
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|l| {
            let (le, n) = l.split_once("\"} ")?;
            Some((
                le.parse::<f64>().unwrap_or(f64::INFINITY),
                n.trim().parse::<f64>().ok()?,
            ))
        })
        .find(|&(_, n)| n >= q * count as f64)
        .map_or(f64::INFINITY, |(le, _)| le);
    Some((count, mean, bound))
}
