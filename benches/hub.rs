//! What K MariaDB tenants of one server cost the server: K relays each on its own binlog dump
//! connection (the baseline) against K tenants sharing one (`source::mysql::hub`), in one run,
//! one after the other, in this process (`pipeline::run` with a memory sink, nothing to relay).
//! For each, over `OUTBOXD_BENCH_HUB_SECONDS` (default 60) of idle streaming: the server's
//! binlog dump threads, their CPU (from `/proc/<mariadbd>/task/<TID>/stat`, the thread ids from
//! `information_schema.PROCESSLIST.TID`), the whole server's CPU, the bytes the server sent on
//! this process's connections (`ss -tinp`, `bytes_received` of each socket to the server), the
//! binlog bytes written meanwhile (`Binlog_bytes_written`), and this process's CPU.
//!
//! `OUTBOXD_BENCH_HUB_TENANTS` (default 10) is K; `OUTBOXD_BENCH_MY_PORT` (default 3306) the
//! server (root without a password from 127.0.0.1; a private one from
//! `scripts/services/mariadb-private.sh` is quiet, the shared one carries other tests' writes).

use mysql_async::prelude::Queryable;
use outboxd::names::{ColumnMap, TableName};
use outboxd::pipeline::{PositionLostPolicy, RunConfig};
use outboxd::relay::RelayOptions;
use outboxd::sink::options::SinkOptions;
use outboxd::sink::SinkDsn;
use outboxd::source::mysql::hub::{HubOptions, MysqlHub};
use outboxd::source::mysql::log::{outbox_tables, MyLog, MySqlOptions};
use outboxd::source::snapshot::SnapshotMode;
use outboxd::state::mysql::MyStateStore;
use outboxd::MemorySink;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const DDL: &str = include_str!("../migrations/mysql/001_outbox.sql");

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn opts(port: u16, db: Option<&str>) -> mysql_async::OptsBuilder {
    mysql_async::OptsBuilder::default()
        .ip_or_hostname("127.0.0.1")
        .tcp_port(port)
        .user(Some("root"))
        .db_name(db)
        .prefer_socket(false)
}

fn config(name: &str, stop: &CancellationToken) -> RunConfig {
    RunConfig {
        name: name.to_string(),
        tables: vec![TableName::parse("outbox").unwrap()],
        columns: ColumnMap::default(),
        sink: SinkDsn::stdout(),
        commit_offsets: false,
        max_inflight_bytes: 64 * 1024 * 1024,
        relay: RelayOptions {
            stop: Some(stop.clone()),
            ..RelayOptions::default()
        },
        snapshot: SnapshotMode::All,
        on_position_lost: PositionLostPolicy::Fail,
        replay_since: None,
        recovery_margin: Duration::from_secs(60),
        ha: false,
        sink_options: SinkOptions::default(),
        accept_new_source: false,
    }
}

fn ticks(path: &str) -> u64 {
    let s = std::fs::read_to_string(path).unwrap_or_default();
    let after = s.rsplit_once(')').map(|(_, a)| a).unwrap_or("");
    let f: Vec<&str> = after.split_whitespace().collect();
    let n = |i: usize| f.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    // Fields 14 and 15 (utime, stime), counted after the name.
    n(11) + n(12)
}

/// Bytes received on this process's TCP connections to `port`.
fn received(port: u16) -> u64 {
    let out = std::process::Command::new("ss")
        .args(["-tinpH", "state", "established"])
        .output()
        .expect("ss");
    let text = String::from_utf8_lossy(&out.stdout);
    let me = format!("pid={},", std::process::id());
    let mut total = 0;
    let mut ours = false;
    for line in text.lines() {
        if !line.starts_with(char::is_whitespace) {
            ours = line.contains(&me) && line.contains(&format!(":{port} "));
            continue;
        }
        if ours {
            if let Some(v) = line
                .split_whitespace()
                .find_map(|w| w.strip_prefix("bytes_received:"))
            {
                total += v.parse::<u64>().unwrap_or(0);
            }
        }
    }
    total
}

struct Server {
    port: u16,
    pid: u32,
    admin: mysql_async::Conn,
}

impl Server {
    async fn value(&mut self, sql: &str) -> u64 {
        let v: Option<mysql_async::Row> = self.admin.query_first(sql).await.unwrap();
        v.and_then(|r| r.get::<Option<u64>, _>(0).flatten())
            .unwrap_or(0)
    }

    async fn dump_tids(&mut self, dbs: &[String]) -> Vec<u64> {
        let list: Vec<String> = dbs.iter().map(|d| format!("'{d}'")).collect();
        self.admin
            .query(format!(
                "SELECT TID FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%' AND DB IN ({})",
                list.join(",")
            ))
            .await
            .unwrap()
    }
}

struct Figures {
    dumps: usize,
    dump_cpu_ms: f64,
    server_cpu_ms: f64,
    shipped: f64,
    written: f64,
    own_cpu_ms: f64,
}

async fn measure(server: &mut Server, dbs: &[String], seconds: u64) -> Figures {
    let tick_ms = 10.0;
    let tids = server.dump_tids(dbs).await;
    let pid = server.pid;
    let task = |t: u64| format!("/proc/{pid}/task/{t}/stat");
    let proc_stat = format!("/proc/{pid}/stat");
    let d0: u64 = tids.iter().map(|t| ticks(&task(*t))).sum();
    let s0 = ticks(&proc_stat);
    let o0 = ticks("/proc/self/stat");
    let r0 = received(server.port);
    let w0 = server
        .value("SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'BINLOG_BYTES_WRITTEN'")
        .await;
    let t0 = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let per_min = 60.0 / t0.elapsed().as_secs_f64();
    let d1: u64 = tids.iter().map(|t| ticks(&task(*t))).sum();
    let w1 = server
        .value("SELECT VARIABLE_VALUE FROM information_schema.GLOBAL_STATUS WHERE VARIABLE_NAME = 'BINLOG_BYTES_WRITTEN'")
        .await;
    Figures {
        dumps: tids.len(),
        dump_cpu_ms: (d1 - d0) as f64 * tick_ms * per_min,
        server_cpu_ms: (ticks(&proc_stat) - s0) as f64 * tick_ms * per_min,
        shipped: (received(server.port) - r0) as f64 * per_min,
        written: (w1 - w0) as f64 * per_min,
        own_cpu_ms: (ticks("/proc/self/stat") - o0) as f64 * tick_ms * per_min,
    }
}

async fn run_mode(server: &mut Server, k: usize, seconds: u64, shared: bool) -> Figures {
    let tag = uuid::Uuid::new_v4().simple().to_string()[..8].to_string();
    let mut dbs = Vec::new();
    for i in 0..k {
        let name = format!("bench_hub_{tag}_{i}");
        server
            .admin
            .query_drop(format!("CREATE DATABASE `{name}`"))
            .await
            .unwrap();
        let mut c = mysql_async::Conn::new(opts(server.port, Some(&name)))
            .await
            .unwrap();
        c.query_drop(DDL).await.unwrap();
        let _ = c.disconnect().await;
        dbs.push(name);
    }
    let hub_db = format!("bench_hub_{tag}_hub");
    server
        .admin
        .query_drop(format!("CREATE DATABASE `{hub_db}`"))
        .await
        .unwrap();
    let dsn = |db: &str| {
        let outboxd::dsn::SourceDsn::Mysql(d) =
            outboxd::dsn::SourceDsn::parse(&format!("mysql://root@127.0.0.1:{}/{db}", server.port))
                .unwrap()
        else {
            unreachable!()
        };
        d
    };
    let hub = if shared {
        Some(
            MysqlHub::connect(dsn(&hub_db), HubOptions::new(&format!("bench-{tag}")))
                .await
                .unwrap(),
        )
    } else {
        None
    };
    let stop = CancellationToken::new();
    let mut runs = Vec::new();
    for (i, db) in dbs.iter().enumerate() {
        let d = dsn(db);
        let options = MySqlOptions::default();
        let tables = outbox_tables(
            &d,
            &[TableName::parse("outbox").unwrap()],
            &ColumnMap::default(),
            options.time_zone,
        )
        .unwrap();
        let name = format!("bench-{tag}-{i}");
        let log = MyLog {
            dsn: d.clone(),
            name: name.clone(),
            tables,
            options,
        };
        let store = MyStateStore::new(d);
        let (sink, _handle) = MemorySink::new();
        let cfg = config(&name, &stop);
        let token = stop.clone();
        let hub = hub.clone();
        runs.push(tokio::spawn(async move {
            let r = match hub {
                Some(h) => {
                    outboxd::pipeline::run(h.subscribe(log), store, move || Ok(sink), &cfg, token)
                        .await
                }
                None => outboxd::pipeline::run(log, store, move || Ok(sink), &cfg, token).await,
            };
            r.map(|_| ())
        }));
    }
    // Streaming: K dump threads, or every tenant on the hub's one.
    let mut all = dbs.clone();
    all.push(hub_db.clone());
    let want = if shared { 1 } else { k };
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let attached = hub
            .as_ref()
            .map_or(k, |h| h.stats().attached.load(Ordering::Relaxed));
        if attached == k && server.dump_tids(&all).await.len() == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the tenants did not settle within 120 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let f = measure(server, &all, seconds).await;
    stop.cancel();
    for r in runs {
        r.await.unwrap().expect("a tenant's run");
    }
    drop(hub);
    for db in all {
        let _ = server
            .admin
            .query_drop(format!("DROP DATABASE `{db}`"))
            .await;
    }
    f
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let k: usize = env("OUTBOXD_BENCH_HUB_TENANTS", 10);
    let seconds: u64 = env("OUTBOXD_BENCH_HUB_SECONDS", 60);
    let port: u16 = env("OUTBOXD_BENCH_MY_PORT", 3306);
    let mut admin = mysql_async::Conn::new(opts(port, None)).await.unwrap();
    let pid_file: String = admin
        .query_first("SELECT @@pid_file")
        .await
        .unwrap()
        .unwrap();
    let pid = std::fs::read_to_string(&pid_file)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or_else(|| panic!("the server's pid from {pid_file}"));
    let mut server = Server { port, pid, admin };
    println!(
        "{k} idle tenants of one MariaDB server (port {port}), {seconds} s each, per minute:\n"
    );
    println!("| tenants read by | dump threads | dump threads' CPU ms/min | server CPU ms/min | bytes sent to the tenants/min | binlog bytes written/min | this process's CPU ms/min |");
    println!("|---|---:|---:|---:|---:|---:|---:|");
    let mut rows = Vec::new();
    for shared in [false, true] {
        let f = run_mode(&mut server, k, seconds, shared).await;
        println!(
            "| {} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            if shared {
                "one shared stream (hub)"
            } else {
                "one dump connection each"
            },
            f.dumps,
            f.dump_cpu_ms,
            f.server_cpu_ms,
            f.shipped,
            f.written,
            f.own_cpu_ms
        );
        rows.push(f);
    }
    let (b, s) = (&rows[0], &rows[1]);
    let r = |a: f64, b: f64| {
        if a > 0.0 {
            format!("{:.2}", b / a)
        } else {
            "n/a".into()
        }
    };
    println!(
        "| shared ÷ separate | {} | {} | {} | {} | {} | {} |",
        r(b.dumps as f64, s.dumps as f64),
        r(b.dump_cpu_ms, s.dump_cpu_ms),
        r(b.server_cpu_ms, s.server_cpu_ms),
        r(b.shipped, s.shipped),
        r(b.written, s.written),
        r(b.own_cpu_ms, s.own_cpu_ms)
    );
}
