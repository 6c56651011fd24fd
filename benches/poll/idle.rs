//! The idle cost of CDC relays (the `idle` part of the poll bench, after the idle poller): a
//! relay streaming from an empty outbox, with nothing to relay, per source and sink. For each,
//! over `OUTBOXD_BENCH_IDLE_SECONDS`: the relay's CPU (utime + stime from /proc), its wake-ups
//! (context switches of all its threads, from /proc/PID/task/*/status), its resident memory and
//! threads, the CPU it spent starting (until it streams), and what it costs the database
//! server: the walsender (Postgres: CPU, resident and private memory from /proc) or the binlog
//! dump thread (MariaDB: CPU from /proc/PID/task/TID, memory from its `MEMORY_USED`), and the
//! relay's other sessions (the lease's renewals).
//!
//! `OUTBOXD_BENCH_IDLE_CASES` (default `postgres:amqp,mariadb:amqp,postgres:nats,postgres:stream`)
//! picks the cases. With `OUTBOXD_BENCH_BASELINE=<path of another outboxd binary>` every case
//! runs that binary beside this build, at the same time on databases of their own, so the
//! ratio between them is measured in one run under one host load.
//!
//! `OUTBOXD_BENCH_IDLE_FLEET=K` (default 0: none) then runs K idle relays at once on K
//! databases of one server, per source (RabbitMQ sink), each binary's fleet after the other:
//! what one relay per database costs when the databases share a server (every relay's lease
//! renewal is a write to the server's one WAL or binlog, which every walsender or dump thread
//! of the server reads).

use super::latency::support::{self, brokers::stream_env};
use super::{clk_tck, cpu_ticks, pg, stop, Db, Fresh, AMQP, PG_ADMIN};
use mysql_async::prelude::Queryable;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const NATS: &str = "nats://127.0.0.1:4222";
const STREAM: &str = "rabbitmq-stream://guest:guest@127.0.0.1:5552/%2f";

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Sink {
    Amqp,
    Nats,
    Stream,
}

impl Sink {
    fn label(self) -> &'static str {
        match self {
            Sink::Amqp => "RabbitMQ",
            Sink::Nats => "NATS JetStream",
            Sink::Stream => "RabbitMQ stream",
        }
    }
}

/// The cases named by `OUTBOXD_BENCH_IDLE_CASES`.
pub fn cases() -> Vec<(Db, Sink)> {
    std::env::var("OUTBOXD_BENCH_IDLE_CASES")
        .unwrap_or_else(|_| "postgres:amqp,mariadb:amqp,postgres:nats,postgres:stream".into())
        .split(',')
        .filter(|c| !c.trim().is_empty())
        .map(|c| {
            let (db, sink) = c.trim().split_once(':').unwrap_or((c.trim(), "amqp"));
            let db = match db {
                "postgres" => Db::Postgres,
                "mariadb" => Db::Maria,
                other => panic!(
                    "OUTBOXD_BENCH_IDLE_CASES: unknown database {other:?} (postgres, mariadb)"
                ),
            };
            let sink = match sink {
                "amqp" => Sink::Amqp,
                "nats" => Sink::Nats,
                "stream" => Sink::Stream,
                other => {
                    panic!("OUTBOXD_BENCH_IDLE_CASES: unknown sink {other:?} (amqp, nats, stream)")
                }
            };
            (db, sink)
        })
        .collect()
}

/// What one idle relay cost over the window.
#[derive(Debug, Default, Clone)]
pub struct Figures {
    /// CPU ms from the start until the relay streamed.
    pub start_ms: f64,
    /// Relay CPU ms per minute.
    pub cpu: f64,
    /// Context switches of the relay's threads per minute: its wake-ups.
    pub wakeups: f64,
    pub rss_mib: f64,
    pub threads: usize,
    /// The walsender's / dump thread's CPU ms per minute.
    pub server_cpu: f64,
    /// The relay's other sessions' server CPU ms per minute (the lease's renewals).
    pub sessions_cpu: f64,
    /// Walsender: resident / private MiB (Postgres); dump thread: `MEMORY_USED` MiB (MariaDB).
    pub server_mem: String,
}

/// One relay under measurement, with its database and the server side found for it.
struct Running {
    fresh: Fresh,
    sink: Sink,
    child: Child,
    start_ticks: u64,
    /// /proc stat paths of the walsender / dump thread, and of the relay's other sessions.
    server: Vec<String>,
    sessions: Vec<String>,
    walsender: Option<u32>,
}

fn start(bin: &str, fresh: &Fresh, sink: Sink) -> Child {
    let name = &fresh.name;
    let mut args: Vec<String> = vec![
        "run".into(),
        "--source".into(),
        fresh.dsn(),
        "--name".into(),
        name.clone(),
        "--log-level".into(),
        "warn".into(),
    ];
    match sink {
        Sink::Amqp => args.extend([
            "--sink".into(),
            AMQP.into(),
            "--exchange".into(),
            name.clone(),
        ]),
        Sink::Nats => args.extend([
            "--sink".into(),
            NATS.into(),
            "--stream".into(),
            name.clone(),
            "--subject".into(),
            format!("{name}.{{topic}}"),
        ]),
        Sink::Stream => args.extend([
            "--sink".into(),
            STREAM.into(),
            "--stream".into(),
            name.clone(),
        ]),
    }
    Command::new(bin)
        .args(&args)
        .stdout(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {bin}: {e}"))
}

fn mariadbd() -> String {
    Command::new("pgrep")
        .args(["-x", "mariadbd"])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or("0")
                .trim()
                .to_string()
        })
        .unwrap_or_default()
}

/// Waits until the relay streams (its walsender holds the slot, or its dump thread runs) and
/// finds its sessions on the server.
async fn running(fresh: Fresh, sink: Sink, child: Child, started: Instant) -> Running {
    let stat = format!("/proc/{}/stat", child.id());
    let slot = format!("outboxd_{}", fresh.name);
    loop {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{}: the relay did not stream within 60 s",
            fresh.name
        );
        let found: Option<(Vec<String>, Vec<String>, Option<u32>)> = match fresh.db {
            Db::Postgres => {
                let admin = pg(PG_ADMIN).await;
                let wal: Option<i32> = admin
                    .query_opt(
                        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = $1 AND active",
                        &[&slot],
                    )
                    .await
                    .unwrap()
                    .and_then(|r| r.get(0));
                match wal {
                    Some(pid) => {
                        let others = admin
                            .query(
                                "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND backend_type = 'client backend'",
                                &[&fresh.name],
                            )
                            .await
                            .unwrap()
                            .iter()
                            .map(|r| format!("/proc/{}/stat", r.get::<_, i32>(0)))
                            .collect();
                        Some((vec![format!("/proc/{pid}/stat")], others, Some(pid as u32)))
                    }
                    None => None,
                }
            }
            Db::Maria => {
                let server = mariadbd();
                let mut c = support::my_connect(None).await;
                let rows: Vec<(u64, String)> = c
                    .exec(
                        "SELECT TID, COMMAND FROM information_schema.PROCESSLIST WHERE DB = ? AND ID <> CONNECTION_ID()",
                        (&fresh.name,),
                    )
                    .await
                    .unwrap();
                let _ = c.disconnect().await;
                let path = |t: u64| format!("/proc/{server}/task/{t}/stat");
                let dump: Vec<String> = rows
                    .iter()
                    .filter(|(_, cmd)| cmd.starts_with("Binlog Dump"))
                    .map(|(t, _)| path(*t))
                    .collect();
                (!dump.is_empty()).then(|| {
                    let others = rows
                        .iter()
                        .filter(|(_, cmd)| !cmd.starts_with("Binlog Dump"))
                        .map(|(t, _)| path(*t))
                        .collect();
                    (dump, others, None)
                })
            }
        };
        if let Some((server, sessions, walsender)) = found {
            return Running {
                start_ticks: cpu_ticks(&stat),
                fresh,
                sink,
                child,
                server,
                sessions,
                walsender,
            };
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Voluntary plus involuntary context switches of every live thread of `pid`.
fn switches(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .map(|s| {
            s.lines()
                .filter(|l| l.contains("ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

fn threads(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Resident and private (not shared with other server processes) memory of a process, MiB.
fn resident_and_private(pid: u32) -> (f64, f64) {
    let rss = support::rss_kib(pid).unwrap_or(0) as f64 / 1024.0;
    let private = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>() as f64
        / 1024.0;
    (rss, private)
}

async fn dump_thread_memory(db: &str) -> Option<f64> {
    let mut c = support::my_connect(None).await;
    let used: Option<i64> = c
        .exec_first(
            "SELECT MEMORY_USED FROM information_schema.PROCESSLIST WHERE DB = ? AND COMMAND LIKE 'Binlog Dump%'",
            (db,),
        )
        .await
        .ok()
        .flatten();
    let _ = c.disconnect().await;
    used.map(|b| b as f64 / 1024.0 / 1024.0)
}

/// Runs one case for every binary in `bins` at once and returns their figures, in order.
pub async fn run_case(db: Db, sink: Sink, bins: &[(&str, &str)], seconds: u64) -> Vec<Figures> {
    let mut all = Vec::new();
    for (i, (_, bin)) in bins.iter().enumerate() {
        let tag = format!(
            "i{}{}_{i}",
            if db == Db::Postgres { "pg" } else { "my" },
            match sink {
                Sink::Amqp => "a",
                Sink::Nats => "n",
                Sink::Stream => "s",
            }
        );
        let fresh = Fresh::new(db, &tag).await;
        let started = Instant::now();
        let child = start(bin, &fresh, sink);
        all.push((fresh, child, started));
    }
    let mut runs = Vec::new();
    for (fresh, child, started) in all {
        runs.push(running(fresh, sink, child, started).await);
    }
    // Past the start's own work (declarations, the first renewals) before the window opens.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let ticks = |paths: &[String]| paths.iter().map(|p| cpu_ticks(p)).sum::<u64>();
    let before: Vec<_> = runs
        .iter()
        .map(|r| {
            let pid = r.child.id();
            (
                cpu_ticks(&format!("/proc/{pid}/stat")),
                switches(pid),
                ticks(&r.server),
                ticks(&r.sessions),
            )
        })
        .collect();
    let window = Instant::now();
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let secs = window.elapsed().as_secs_f64();
    let per_min = |ticks: u64| ticks as f64 / clk_tck() * 1000.0 * 60.0 / secs;
    let mut out = Vec::new();
    for (r, (cpu0, sw0, srv0, ses0)) in runs.iter().zip(before) {
        let pid = r.child.id();
        let server_mem = match (r.fresh.db, r.walsender) {
            (Db::Postgres, Some(w)) => {
                let (rss, private) = resident_and_private(w);
                format!("{rss:.1} / {private:.1}")
            }
            _ => dump_thread_memory(&r.fresh.name)
                .await
                .map_or("?".into(), |m| format!("{m:.2}")),
        };
        out.push(Figures {
            start_ms: (r.start_ticks as f64) / clk_tck() * 1000.0,
            cpu: per_min(cpu_ticks(&format!("/proc/{pid}/stat")).saturating_sub(cpu0)),
            wakeups: switches(pid).saturating_sub(sw0) as f64 * 60.0 / secs,
            rss_mib: support::rss_kib(pid).unwrap_or(0) as f64 / 1024.0,
            threads: threads(pid),
            server_cpu: per_min(ticks(&r.server).saturating_sub(srv0)),
            sessions_cpu: per_min(ticks(&r.sessions).saturating_sub(ses0)),
            server_mem,
        });
    }
    for r in runs {
        stop(r.child);
        cleanup(&r.fresh.name, r.sink).await;
        r.fresh.drop_db().await;
    }
    out
}

/// Deletes what the relay declared on its broker.
async fn cleanup(name: &str, sink: Sink) {
    match sink {
        Sink::Amqp => {
            let Ok(conn) =
                lapin::Connection::connect(AMQP, lapin::ConnectionProperties::default()).await
            else {
                return;
            };
            if let Ok(ch) = conn.create_channel().await {
                for q in ["dead", "unrouted"] {
                    let _ = ch
                        .queue_delete(format!("{name}.{q}").into(), Default::default())
                        .await;
                }
                for x in [name.to_string(), format!("{name}.unrouted")] {
                    let _ = ch.exchange_delete(x.into(), Default::default()).await;
                }
            }
            let _ = conn.close(0, "".into()).await;
        }
        Sink::Nats => {
            if let Ok(client) = async_nats::connect(NATS).await {
                let js = async_nats::jetstream::new(client);
                let _ = js.delete_stream(name).await;
            }
        }
        Sink::Stream => {
            let _ = stream_env().await.delete_stream(name).await;
        }
    }
}

/// K relays of one binary at once, one per database of the same server: the mean and the
/// largest figure per relay, and the server side's total.
async fn fleet(db: Db, label: &str, bin: &str, k: usize, seconds: u64) {
    let bins: Vec<(&str, &str)> = (0..k).map(|_| (label, bin)).collect();
    let figs = run_case(db, Sink::Amqp, &bins, seconds).await;
    let n = figs.len() as f64;
    let mean = |f: fn(&Figures) -> f64| figs.iter().map(f).sum::<f64>() / n;
    let max = |f: fn(&Figures) -> f64| figs.iter().map(f).fold(0.0, f64::max);
    let src = if db == Db::Postgres {
        "Postgres"
    } else {
        "MariaDB"
    };
    println!(
        "| {src} | {label} | {k} | {:.0} (max {:.0}) | {:.0} | {:.1} | {:.0} | {:.0} |",
        mean(|f| f.cpu),
        max(|f| f.cpu),
        mean(|f| f.wakeups),
        mean(|f| f.rss_mib),
        figs.iter().map(|f| f.server_cpu).sum::<f64>(),
        figs.iter().map(|f| f.sessions_cpu).sum::<f64>(),
    );
}

/// Prints the table of every case: one row per binary, and with a baseline the ratios.
pub async fn report(seconds: u64) {
    let this = env!("CARGO_BIN_EXE_outboxd");
    let baseline = std::env::var("OUTBOXD_BENCH_BASELINE").ok();
    let mut bins: Vec<(&str, &str)> = Vec::new();
    if let Some(b) = baseline.as_deref() {
        bins.push(("baseline", b));
    }
    bins.push(("this build", this));
    println!(
        "\nIdle CDC relay (empty outbox, streaming, nothing to relay) over {seconds} s{}:\n",
        if bins.len() > 1 {
            ", the baseline binary beside this build at the same time"
        } else {
            ""
        }
    );
    println!("| source → sink | binary | relay CPU ms/min | relay wake-ups/min | relay RSS MiB | threads | start CPU ms | walsender / dump thread CPU ms/min | its memory MiB (walsender RSS / private; dump thread MEMORY_USED) | relay's other sessions' server CPU ms/min |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    for (db, sink) in cases() {
        let figs = run_case(db, sink, &bins, seconds).await;
        let src = if db == Db::Postgres {
            "Postgres"
        } else {
            "MariaDB"
        };
        for ((label, _), f) in bins.iter().zip(&figs) {
            println!(
                "| {src} → {} | {label} | {:.0} | {:.0} | {:.1} | {} | {:.0} | {:.0} | {} | {:.0} |",
                sink.label(),
                f.cpu,
                f.wakeups,
                f.rss_mib,
                f.threads,
                f.start_ms,
                f.server_cpu,
                f.server_mem,
                f.sessions_cpu
            );
        }
        if let [b, t] = figs.as_slice() {
            let ratio = |a: f64, b: f64| {
                if a > 0.0 {
                    format!("{:.2}", b / a)
                } else {
                    "n/a".into()
                }
            };
            println!(
                "| {src} → {} | this ÷ baseline | {} | {} | {} | | | {} | | {} |",
                sink.label(),
                ratio(b.cpu, t.cpu),
                ratio(b.wakeups, t.wakeups),
                ratio(b.rss_mib, t.rss_mib),
                ratio(b.server_cpu, t.server_cpu),
                ratio(b.sessions_cpu, t.sessions_cpu)
            );
        }
    }
    let k: usize = std::env::var("OUTBOXD_BENCH_IDLE_FLEET")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if k > 0 {
        println!("\n{k} idle relays at once, one per database of the same server (RabbitMQ sink), over {seconds} s; per relay:\n");
        println!("| source | binary | relays | relay CPU ms/min, mean | wake-ups/min, mean | RSS MiB, mean | walsenders / dump threads CPU ms/min, all | the relays' other sessions' server CPU ms/min, all |");
        println!("|---|---|---:|---:|---:|---:|---:|---:|");
        let mut dbs: Vec<Db> = Vec::new();
        for (d, _) in cases() {
            if !dbs.contains(&d) {
                dbs.push(d);
            }
        }
        for db in dbs {
            for (label, bin) in &bins {
                fleet(db, label, bin, k, seconds).await;
            }
        }
    }
}

/// `OUTBOXD_BENCH_IDLE_FLEET_PROCESS=K[,k]`: K idle Postgres sources in one `outboxd fleet`
/// process, beside k (default 10) of them as one `outboxd run` process each — both on the
/// server at `OUTBOXD_BENCH_FLEET_PG_PORT` (default 5432; it needs K + k replication slots and
/// walsenders and twice as many connections, which the shared test server does not give: see
/// docs/benchmarks.md for the private server the figures were taken on), each source its own
/// database, stdout sink with `--commit-offsets` (no broker, so the figures are the relays' own).
/// For each: the start (wall time until every source streams: the fleet's `/status` says
/// running, the relays' slots are active), then over the window the processes' CPU per minute
/// and resident memory, in total and per source.
pub async fn fleet_process_report(seconds: u64) {
    let Ok(spec) = std::env::var("OUTBOXD_BENCH_IDLE_FLEET_PROCESS") else {
        return;
    };
    let mut parts = spec.split(',').map(|v| v.trim().parse::<usize>().ok());
    let big = parts.next().flatten().unwrap_or(0);
    let small = parts.next().flatten().unwrap_or(10);
    if big == 0 {
        return;
    }
    let port: u16 = std::env::var("OUTBOXD_BENCH_FLEET_PG_PORT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5432);
    println!("\nIdle Postgres sources (empty outboxes, streaming), stdout sink, over {seconds} s; server on port {port}:\n");
    println!("| how | sources | start (wall s, until all stream) | CPU ms/min, all | CPU ms/min per source | RSS MiB, all | RSS MiB per source | processes | one busy source among them, events/s |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
    let bin = env!("CARGO_BIN_EXE_outboxd");
    for (how, k) in [
        ("one fleet process", big),
        ("one relay process each", small),
    ] {
        let dbs = fleet_dbs(
            port,
            k,
            if how.starts_with("one fleet") {
                "f"
            } else {
                "r"
            },
        )
        .await;
        let dir = std::env::temp_dir().join(format!("outboxd_bench_fleet_{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let admin = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
        let started = Instant::now();
        let mut children: Vec<Child> = Vec::new();
        let addr = format!("127.0.0.1:{}", free_port());
        if how.starts_with("one fleet") {
            for db in &dbs {
                std::fs::write(
                    dir.join(format!("{db}.toml")),
                    format!("source = \"postgres://postgres@127.0.0.1:{port}/{db}?sslmode=disable\"\nsink = \"stdout\"\ncommit_offsets = true\n"),
                )
                .unwrap();
            }
            children.push(
                Command::new(bin)
                    .args([
                        "fleet",
                        "--sources",
                        dir.to_str().unwrap(),
                        "--metrics-addr",
                        &addr,
                        "--log-level",
                        "warn",
                    ])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .unwrap(),
            );
        } else {
            for db in &dbs {
                children.push(
                    Command::new(bin)
                        .args([
                            "run",
                            "--source",
                            &format!("postgres://postgres@127.0.0.1:{port}/{db}?sslmode=disable"),
                            "--name",
                            db,
                            "--commit-offsets",
                            "--log-level",
                            "warn",
                        ])
                        .stdout(Stdio::piped())
                        .stderr(Stdio::null())
                        .spawn()
                        .unwrap(),
                );
            }
        }
        // Lines printed by the process of the first source (the busy one below).
        let printed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut readers = Vec::new();
        for c in children.iter_mut() {
            let out = c.stdout.take().unwrap();
            let p = printed.clone();
            readers.push(std::thread::spawn(move || {
                use std::io::BufRead;
                for _ in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                    p.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
            }));
        }
        // Started when every source's slot is active (its walsender streams).
        let client = pg(&admin).await;
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name LIKE 'outboxd_bfl%'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            if n as usize >= k {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{how}: only {n} of {k} sources streaming after 600 s"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let start_s = started.elapsed().as_secs_f64();
        // Past the start's own work before the window opens.
        tokio::time::sleep(Duration::from_secs(3)).await;
        let cpu = |c: &[Child]| {
            c.iter()
                .map(|c| cpu_ticks(&format!("/proc/{}/stat", c.id())))
                .sum::<u64>()
        };
        let before = cpu(&children);
        let window = Instant::now();
        tokio::time::sleep(Duration::from_secs(seconds)).await;
        let secs = window.elapsed().as_secs_f64();
        let cpu_min =
            cpu(&children).saturating_sub(before) as f64 / clk_tck() * 1000.0 * 60.0 / secs;
        let rss: f64 = children
            .iter()
            .map(|c| support::rss_kib(c.id()).unwrap_or(0) as f64 / 1024.0)
            .sum();
        // One source gets busy among the idle: `busy` events written into the first database,
        // 100 per transaction; the time from the first insert until the last is printed.
        let busy = std::env::var("OUTBOXD_BENCH_FLEET_BUSY")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20_000u64);
        let producer = pg(&format!(
            "host=127.0.0.1 port={port} user=postgres dbname={}",
            dbs[0]
        ))
        .await;
        let t0 = Instant::now();
        for _ in 0..busy / 100 {
            producer
                .batch_execute(
                    "INSERT INTO outbox (id, aggregate_id, topic, payload)
                     SELECT gen_random_uuid(), 'a' || g, 'bench.busy', '{\"n\":1}'::json FROM generate_series(1, 100) g",
                )
                .await
                .unwrap();
        }
        let deadline = Instant::now() + Duration::from_secs(600);
        while printed.load(std::sync::atomic::Ordering::Relaxed) < busy / 100 * 100 {
            assert!(
                Instant::now() < deadline,
                "{how}: the busy source did not drain in 600 s"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let drain_s = t0.elapsed().as_secs_f64();
        println!(
            "| {how} | {k} | {start_s:.1} | {cpu_min:.0} | {:.1} | {rss:.0} | {:.2} | {} | {:.0} |",
            cpu_min / k as f64,
            rss / k as f64,
            children.len(),
            (busy / 100 * 100) as f64 / drain_s
        );
        for c in children {
            stop(c);
        }
        for r in readers {
            let _ = r.join();
        }
        for db in &dbs {
            let _ = client
                .batch_execute(&format!("DROP DATABASE IF EXISTS {db} WITH (FORCE)"))
                .await;
        }
        for db in &dbs {
            let _ = client
                .execute("SELECT pg_drop_replication_slot($1) FROM pg_replication_slots WHERE slot_name = $1", &[&format!("outboxd_{db}")])
                .await;
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `k` fresh databases with the outbox table on the server at `port`, named `bfl<tag><i>_<pid>`.
async fn fleet_dbs(port: u16, k: usize, tag: &str) -> Vec<String> {
    let admin = pg(&format!(
        "host=127.0.0.1 port={port} user=postgres dbname=postgres"
    ))
    .await;
    let mut out = Vec::new();
    for i in 0..k {
        let db = format!("bfl{tag}{i}_{}", std::process::id());
        admin
            .batch_execute(&format!("CREATE DATABASE {db}"))
            .await
            .unwrap();
        pg(&format!(
            "host=127.0.0.1 port={port} user=postgres dbname={db}"
        ))
        .await
        .batch_execute(include_str!("../../migrations/postgres/001_outbox.sql"))
        .await
        .unwrap();
        out.push(db);
    }
    out
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
