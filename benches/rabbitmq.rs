//! RabbitMQ benchmark: how close the relay gets to the broker's own ceiling, for a Postgres and
//! a MariaDB backlog. Run with `cargo bench --bench rabbitmq` (needs the local services;
//! `scripts/services.sh`); `OUTBOXD_BENCH_SOURCES=postgres,mariadb` (default both) picks the
//! sources.
//!
//! In one run, for each source it
//! 1. writes `OUTBOXD_BENCH_EVENTS` (default 200,000) outbox rows of ~300-byte JSON in
//!    transactions of 100 while no relay runs (a backlog in the slot, or in the binlog after the
//!    relay's stored position);
//! 2. publishes the same bodies with a bare lapin publisher — persistent, mandatory, publisher
//!    confirms, the relay's headers, a pipelined window of 100, 1,000 and 5,000 unconfirmed —
//!    into the same topology the relay uses (topic exchange with alternate exchange, one durable
//!    queue bound with `#`);
//! 3. starts `outboxd run --snapshot never` on the backlog (default `--window 1000`, then the
//!    raw publisher's best window) and measures from process start until the last event is
//!    confirmed (Postgres: the slot confirmed the last commit; MariaDB: the queue holds every
//!    event);
//! 4. prints a Markdown table with the rates and the relay / best raw ratio of that source.
//!
//! The queue is purged before every run so that each starts against an empty queue.

mod support;

use futures::StreamExt;
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeleteOptions, QueueDeleteOptions,
    QueuePurgeOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use support::{confirmed_lsn, cpu_secs, new_backlog, pg, pg_backlog, queue_len, rss_kib, wal_end};

const ADMIN: &str = "host=127.0.0.1 port=5432 user=postgres dbname=test";
const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

#[derive(Clone, Copy, PartialEq, Eq)]
enum Source {
    Postgres,
    MariaDb,
}

impl Source {
    fn label(self) -> &'static str {
        match self {
            Source::Postgres => "Postgres",
            Source::MariaDb => "MariaDB",
        }
    }

    /// The headers the relay sends for an event of this source, same sizes.
    fn headers(self, seq: usize) -> Vec<(&'static str, String)> {
        let created = (
            "x-outbox-created-at",
            "2026-12-02T14:13:24.125386Z".to_string(),
        );
        match self {
            Source::Postgres => vec![
                ("x-aggregate-id", "agg-123".to_string()),
                created,
                ("x-source-position", format!("00000000/A4760B98:{seq:010}")),
            ],
            Source::MariaDb => vec![
                ("x-aggregate-id", "123".to_string()),
                created,
                (
                    "x-source-position",
                    format!("mariadb-bin.000012:{}:{}", 100_000_000 + seq, seq % 100),
                ),
                ("x-source-gtid", format!("0-1-{}", 1_000_000 + seq)),
            ],
        }
    }
}

/// Publishes every body with at most `window` unconfirmed in all, on `channels` channels
/// (message `seq` on channel `seq % channels`; with more than one, each message also carries
/// `x-partition` = its channel, so a partition layout puts each channel's messages in a queue
/// of their own, as the relay's `--partitions` does); returns messages per second.
async fn raw_publish(
    conn: &Connection,
    x: &str,
    bodies: &[Vec<u8>],
    window: usize,
    channels: usize,
    source: Source,
) -> f64 {
    let mut chans = Vec::new();
    for _ in 0..channels {
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        chans.push(ch);
    }
    // Oldest first across every channel, as the relay waits for its window.
    let mut inflight = futures::stream::FuturesOrdered::new();
    let t = Instant::now();
    for (seq, body) in bodies.iter().enumerate() {
        if inflight.len() >= window {
            let c: lapin::Result<Confirmation> = inflight.next().await.unwrap();
            assert!(matches!(c, Ok(Confirmation::Ack(None))), "{c:?}");
        }
        let lane = seq % channels;
        let ch = &chans[lane];
        // The relay's headers, so the raw messages are the same size on the wire.
        let mut headers = FieldTable::default();
        for (k, v) in source.headers(seq) {
            headers.insert(k.into(), AMQPValue::LongString(v.into()));
        }
        if channels > 1 {
            headers.insert(
                "x-partition".into(),
                AMQPValue::LongString(lane.to_string().into()),
            );
            headers.insert(
                format!("x-partition-{channels}").into(),
                AMQPValue::LongString(lane.to_string().into()),
            );
        }
        let props = BasicProperties::default()
            .with_headers(headers)
            .with_timestamp(1_796_220_000)
            .with_delivery_mode(2)
            .with_content_type("application/json".into())
            .with_message_id(uuid::Uuid::now_v7().hyphenated().to_string().into())
            .with_type("invoice.issued".into())
            .with_app_id("outboxd-bench".into());
        let confirm = ch
            .basic_publish(
                x.into(),
                "invoice.issued".into(),
                BasicPublishOptions {
                    mandatory: true,
                    immediate: false,
                },
                body,
                props,
            )
            .await
            .unwrap();
        inflight.push_back(confirm);
    }
    while let Some(c) = inflight.next().await {
        assert!(matches!(c, Ok(Confirmation::Ack(None))), "{c:?}");
    }
    let rate = bodies.len() as f64 / t.elapsed().as_secs_f64();
    for ch in chans {
        let _ = ch.close(200, "OK".into()).await;
    }
    rate
}

async fn purge(ch: &Channel, q: &str) {
    ch.queue_purge(q.into(), QueuePurgeOptions::default())
        .await
        .unwrap();
}

/// Runs the relay until `done` says the backlog is confirmed; returns (seconds, peak RSS KiB,
/// CPU seconds).
async fn relay_drain(
    bin: &str,
    dsn: &str,
    x: &str,
    run: RelayRun,
    mut done: impl AsyncFnMut() -> bool,
) -> (f64, u64, f64, (f64, f64)) {
    let t = Instant::now();
    let host_before = support::host_cpu();
    let mut extra = Vec::new();
    // No flag at all for the defaults: the row then shows what a user gets untuned.
    if let Some(w) = run.window {
        extra.extend(["--window".to_string(), w.to_string()]);
    }
    if run.partitions > 0 {
        extra.extend(["--partitions".to_string(), run.partitions.to_string()]);
    }
    let mut child = Command::new(bin)
        .args([
            "run",
            // The backlog is in the slot already: a first-start snapshot of the pending rows
            // would publish every event twice.
            "--snapshot",
            "never",
            "--source",
            dsn,
            "--name",
            "bench",
            "--exchange",
            x,
            "--log-level",
            "warn",
        ])
        .args(&extra)
        .env("OUTBOXD_SINK", AMQP)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let mut peak = 0;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("outboxd exited early: {status}");
        }
        peak = peak.max(rss_kib(child.id()).unwrap_or(0));
        if done().await {
            break;
        }
        assert!(
            t.elapsed() < Duration::from_secs(1800),
            "drain took over 30 min"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let secs = t.elapsed().as_secs_f64();
    let cpu = cpu_secs(child.id()).unwrap_or(0.0);
    let host_after = support::host_cpu();
    let host = (host_after.0 - host_before.0, host_after.1 - host_before.1);
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = child.wait().unwrap();
    assert!(status.success(), "outboxd stop: {status}");
    (secs, peak, cpu, host)
}

/// How one relay run is started: `window: None` passes no `--window` (the default).
#[derive(Clone, Copy)]
struct RelayRun {
    window: Option<usize>,
    partitions: u32,
}

impl RelayRun {
    fn window_label(self) -> String {
        match self.window {
            None => format!("{} (default)", outboxd::relay::DEFAULT_WINDOW),
            Some(w) => w.to_string(),
        }
    }
}

/// One row of the result table.
struct Row {
    what: String,
    channels: usize,
    window: String,
    rate: f64,
    /// Against the best raw run with the same number of channels.
    ratio: f64,
    /// The goal this row has, if any: (minimum ratio, its name).
    goal: Option<f64>,
    relay: Option<(f64, f64, u64)>,
    /// CPU seconds of the publishing process: the relay's, or the raw publisher's own.
    publisher_cpu: f64,
    /// CPU seconds the database servers and the broker used during the run.
    host: (f64, f64),
}

/// One raw run: its window, msg/s, the host's (servers', broker's) CPU seconds, and the
/// CPU seconds this process (the raw publisher, its runtime and lapin's I/O thread) used.
type RawRun = (usize, f64, (f64, f64), f64);

/// The raw publisher on `bodies` with `windows` in all over `channels` channels, each run into
/// the queues `queues` (purged first, checked to hold every body after); returns each run and
/// the best (window, rate).
#[allow(clippy::too_many_arguments)]
async fn raw_runs(
    conn: &Connection,
    ch: &Channel,
    x: &str,
    queues: &[String],
    bodies: &[Vec<u8>],
    source: Source,
    channels: usize,
    windows: &[usize],
) -> (Vec<RawRun>, (usize, f64)) {
    let mut raw = Vec::new();
    for &window in windows {
        for q in queues {
            purge(ch, q).await;
        }
        let before = support::host_cpu();
        // The publisher's own CPU in the same run, measured as the relay's is (from /proc), so
        // the two per-event figures compare: only the raw publisher runs in this process now.
        let own_before = cpu_secs(std::process::id()).unwrap_or(0.0);
        let rate = raw_publish(conn, x, bodies, window, channels, source).await;
        let own = cpu_secs(std::process::id()).unwrap_or(0.0) - own_before;
        let after = support::host_cpu();
        let host = (after.0 - before.0, after.1 - before.1);
        let mut held = 0;
        for q in queues {
            held += queue_len(ch, q).await as usize;
        }
        assert_eq!(
            held,
            bodies.len(),
            "the raw publisher's messages in {queues:?}"
        );
        eprintln!(
            "{}: raw lapin, {channels} channel(s), window {window}: {rate:.0} msg/s",
            source.label()
        );
        raw.push((window, rate, host, own));
    }
    let best = raw
        .iter()
        .map(|&(w, r, _, _)| (w, r))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .unwrap();
    (raw, best)
}

/// The relay's runs on one channel: its defaults (no flag), and the raw publisher's best
/// window when that is another.
fn relay_runs(best_window: usize) -> Vec<RelayRun> {
    let mut runs = vec![RelayRun {
        window: None,
        partitions: 0,
    }];
    if best_window != outboxd::relay::DEFAULT_WINDOW {
        runs.push(RelayRun {
            window: Some(best_window),
            partitions: 0,
        });
    }
    runs
}

/// The goal of the default run: ≥ 0.9 × the best raw window on one channel; of a partitioned
/// run: ≥ 0.8 × the best raw run on as many channels.
fn goal_of(run: RelayRun) -> Option<f64> {
    match (run.window, run.partitions) {
        (None, 0) => Some(0.9),
        (None, _) => Some(0.8),
        _ => None,
    }
}

fn raw_rows(source: Source, channels: usize, raw: &[RawRun], best: f64) -> Vec<Row> {
    raw.iter()
        .map(|&(w, r, host, own)| Row {
            what: format!("raw lapin publisher, {} bodies", source.label()),
            channels,
            window: w.to_string(),
            rate: r,
            ratio: r / best,
            goal: None,
            relay: None,
            publisher_cpu: own,
            host,
        })
        .collect()
}

fn relay_row(source: Source, run: RelayRun, best: f64, r: (f64, u64, f64, f64, (f64, f64))) -> Row {
    let (rate, peak, cpu, secs, host) = r;
    let what = if run.partitions > 0 {
        format!(
            "outboxd relay `--partitions {}`, {} backlog → RabbitMQ",
            run.partitions,
            source.label()
        )
    } else {
        format!("outboxd relay, {} backlog → RabbitMQ", source.label())
    };
    Row {
        what,
        channels: (run.partitions as usize).max(1),
        window: run.window_label(),
        rate,
        ratio: rate / best,
        goal: goal_of(run),
        relay: Some((cpu, secs, peak)),
        publisher_cpu: cpu,
        host,
    }
}

/// Channels (and partitions) of the multi-channel ceiling and the partitioned relay run.
const LANES: usize = 4;

/// Declares the relay's own partition layout for `x` (`<x>.partitioned` and `<x>.p0…`) the way
/// the relay does, with `outboxd topology`; returns the queue names.
fn declare_partitions(bin: &str, x: &str, n: usize) -> Vec<String> {
    let ok = Command::new(bin)
        .args(["topology", "--exchange", x, "--partitions", &n.to_string()])
        .env("OUTBOXD_SINK", AMQP)
        .stdout(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(
        ok,
        "outboxd topology --exchange {x} --partitions {n} failed"
    );
    (0..n).map(|k| format!("{x}.p{k}")).collect()
}

async fn postgres(
    bin: &str,
    events: usize,
    conn: &Connection,
    ch: &Channel,
    x: &str,
) -> (Vec<Row>, usize) {
    let pid = std::process::id();
    let db = format!("bench_rmq_{pid}");
    let admin = pg(ADMIN).await;
    admin
        .batch_execute(&format!("CREATE DATABASE {db}"))
        .await
        .unwrap();
    let conninfo = format!("host=127.0.0.1 port=5432 user=postgres dbname={db}");
    let dsn = format!("postgres://postgres@127.0.0.1:5432/{db}?sslmode=disable");
    let client = pg(&conninfo).await;
    client
        .batch_execute(include_str!("../migrations/postgres/001_outbox.sql"))
        .await
        .unwrap();
    let ok = Command::new(bin)
        .args(["setup", "--source", &dsn, "--name", "bench"])
        .stdout(Stdio::null())
        .status()
        .unwrap()
        .success();
    assert!(ok, "outboxd setup failed");

    let t = Instant::now();
    pg_backlog(&client, events, 100).await;
    eprintln!(
        "Postgres: wrote {events} events in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    // The bodies exactly as the relay will send them.
    let bodies: Vec<Vec<u8>> = client
        .query("SELECT payload::text FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, String>(0).into_bytes())
        .collect();
    let avg = bodies.iter().map(Vec::len).sum::<usize>() / bodies.len();
    let all = vec![format!("{x}.all")];
    let src = Source::Postgres;
    let (raw, (best_window, best)) =
        raw_runs(conn, ch, x, &all, &bodies, src, 1, &[100, 1000, 5000]).await;
    let mut out = raw_rows(src, 1, &raw, best);
    // The ceiling past one channel: the same bodies on LANES channels, each into a partition
    // queue of its own (the layout `--partitions LANES` uses), same total windows.
    let xp = format!("{x}_p{LANES}");
    let pqueues = declare_partitions(bin, &xp, LANES);
    let (raw_p, (_, best_p)) =
        raw_runs(conn, ch, &xp, &pqueues, &bodies, src, LANES, &[1000, 5000]).await;
    let mut runs: Vec<(RelayRun, &str, &[String], f64)> = relay_runs(best_window)
        .into_iter()
        .map(|r| (r, x, all.as_slice(), best))
        .collect();
    let partitioned = RelayRun {
        window: None,
        partitions: LANES as u32,
    };
    runs.push((partitioned, &xp, pqueues.as_slice(), best_p));

    // On a new backlog for every run after the first: a slot cannot be rewound.
    for (k, (run, exchange, queues, ceiling)) in runs.into_iter().enumerate() {
        if k > 0 {
            new_backlog(bin, &dsn, &admin, &client, events).await;
        }
        for q in queues {
            purge(ch, q).await;
        }
        let end = wal_end(&client).await;
        let (secs, peak, cpu, host) = relay_drain(bin, &dsn, exchange, run, async || {
            confirmed_lsn(&admin, "outboxd_bench").await >= end
        })
        .await;
        let mut got = 0;
        for q in queues {
            got += queue_len(ch, q).await as usize;
        }
        assert!(got >= events, "relay delivered {got} of {events}");
        let rate = events as f64 / secs;
        eprintln!("Postgres: relay, window {}, partitions {}: {rate:.0} events/s in {secs:.1}s, {cpu:.1} CPU s, peak RSS {peak} KiB ({got} messages)", run.window_label(), run.partitions);
        if run.partitions > 0 {
            out.extend(raw_rows(src, LANES, &raw_p, best_p));
        }
        out.push(relay_row(src, run, ceiling, (rate, peak, cpu, secs, host)));
    }
    delete_partitions(ch, &xp, &pqueues).await;
    let _ = admin
        .batch_execute(&format!(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = '{db}';
             DROP DATABASE {db} WITH (FORCE);"
        ))
        .await;
    (out, avg)
}

async fn delete_partitions(ch: &Channel, x: &str, queues: &[String]) {
    for q in queues
        .iter()
        .cloned()
        .chain([format!("{x}.unrouted"), format!("{x}.dead")])
    {
        let _ = ch
            .queue_delete(q.into(), QueueDeleteOptions::default())
            .await;
    }
    for e in [
        format!("{x}.partitioned"),
        format!("{x}.unrouted"),
        x.to_string(),
    ] {
        let _ = ch
            .exchange_delete(e.into(), ExchangeDeleteOptions::default())
            .await;
    }
}

async fn mariadb(
    bin: &str,
    events: usize,
    conn: &Connection,
    ch: &Channel,
    x: &str,
) -> (Vec<Row>, usize) {
    let db = format!("bench_rmq_{}", std::process::id());
    let mut c = support::my_create_db(&db).await;
    let dsn = format!("mysql://root@127.0.0.1:3306/{db}?ssl-mode=disabled");
    // The backlog starts here; each relay run is sent back here with `offset set`.
    let start = support::my_head(&mut c).await;
    let t = Instant::now();
    support::my_write_backlog(&mut c, events).await;
    eprintln!(
        "MariaDB: wrote {events} events in {:.1}s",
        t.elapsed().as_secs_f64()
    );
    let bodies: Vec<Vec<u8>> = {
        use mysql_async::prelude::Queryable;
        c.query("SELECT payload FROM outbox").await.unwrap()
    };
    let avg = bodies.iter().map(Vec::len).sum::<usize>() / bodies.len();
    let all = format!("{x}.all");
    let src = Source::MariaDb;
    let (raw, (best_window, best)) = raw_runs(
        conn,
        ch,
        x,
        std::slice::from_ref(&all),
        &bodies,
        src,
        1,
        &[100, 1000, 5000],
    )
    .await;
    let mut out = raw_rows(src, 1, &raw, best);

    for run in relay_runs(best_window) {
        let ok = Command::new(bin)
            .args(["offset", "set", "--source", &dsn, "--name", "bench"])
            .args(["--binlog-position", &start])
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success();
        assert!(ok, "outboxd offset set failed");
        purge(ch, &all).await;
        let (secs, peak, cpu, host) = relay_drain(bin, &dsn, x, run, async || {
            queue_len(ch, &all).await as usize >= events
        })
        .await;
        let got = queue_len(ch, &all).await as usize;
        let rate = events as f64 / secs;
        eprintln!("MariaDB: relay, window {}: {rate:.0} events/s in {secs:.1}s, {cpu:.1} CPU s, peak RSS {peak} KiB ({got} messages)", run.window_label());
        out.push(relay_row(src, run, best, (rate, peak, cpu, secs, host)));
    }
    drop(c);
    support::my_drop_db(&db).await;
    (out, avg)
}

#[tokio::main]
async fn main() {
    // `cargo test --all-targets` runs bench targets too: this is minutes of load, so it runs
    // only under `cargo bench`.
    if !std::env::args().any(|a| a == "--bench") {
        println!("rabbitmq: skipped (run it with `cargo bench --bench rabbitmq`)");
        return;
    }
    let events: usize = std::env::var("OUTBOXD_BENCH_EVENTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(200_000);
    let sources = std::env::var("OUTBOXD_BENCH_SOURCES")
        .unwrap_or_else(|_| "postgres,mariadb".into())
        .to_lowercase();
    let bin = env!("CARGO_BIN_EXE_outboxd");
    let x = format!("bench_rmq_{}", std::process::id());
    let load_before = support::load_average();
    let t0 = Instant::now();

    let conn = Connection::connect(AMQP, ConnectionProperties::default())
        .await
        .expect("RabbitMQ at 127.0.0.1:5672; run scripts/services.sh");
    let ch = conn.create_channel().await.unwrap();
    support::declare_with_one_queue(&ch, &x).await;

    let mut table = Vec::new();
    let mut sizes = Vec::new();
    if sources.contains("postgres") {
        let (rows, avg) = postgres(bin, events, &conn, &ch, &x).await;
        table.extend(rows);
        sizes.push(format!("Postgres {avg}"));
    }
    if sources.contains("mariadb") {
        let (rows, avg) = mariadb(bin, events, &conn, &ch, &x).await;
        table.extend(rows);
        sizes.push(format!("MariaDB {avg}"));
    }

    println!(
        "\n| run | channels | window | msg/s | vs best raw (same bodies, same channels) | goal | relay CPU | publisher CPU per event | peak RSS | database servers' CPU | broker CPU |"
    );
    println!("|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|");
    for r in &table {
        let goal = match r.goal {
            Some(g) if r.ratio >= g => format!("≥ {g} met"),
            Some(g) => format!("≥ {g} **missed**"),
            None => String::new(),
        };
        let (server, broker) = r.host;
        let per_event = r.publisher_cpu * 1e6 / events as f64;
        match r.relay {
            None => println!(
                "| {} | {} | {} | {:.0} | {:.2} | | | {per_event:.1} µs | | {server:.1} s | {broker:.1} s |",
                r.what, r.channels, r.window, r.rate, r.ratio
            ),
            Some((cpu, secs, peak)) => println!(
                "| {} | {} | {} | {:.0} | **{:.2}** | {goal} | {cpu:.1} s of {secs:.1} s | {per_event:.1} µs | {} MiB | {server:.1} s | {broker:.1} s |",
                r.what,
                r.channels,
                r.window,
                r.rate,
                r.ratio,
                peak / 1024
            ),
        }
    }
    println!(
        "\n{events} events per source, average body bytes: {}; persistent, mandatory, publisher confirms, one durable queue bound with #.",
        sizes.join(", ")
    );
    println!(
        "CPU columns are seconds used during the run (user + system, from /proc) on a host of {} cores: the relay's own (per event: the relay's, or the raw publisher process's own in its run), the database servers' (`postgres`, `mariadbd`; the raw publisher does not read the database, so its runs show only what else ran) and the broker's (`beam.smp`).",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "load average before: {load_before}, after: {}; {:.0} s in all.",
        support::load_average(),
        t0.elapsed().as_secs_f64()
    );

    // Clean up the exchanges and queues.
    let all = format!("{x}.all");
    for q in [all, format!("{x}.unrouted"), format!("{x}.dead")] {
        let _ = ch
            .queue_delete(q.into(), QueueDeleteOptions::default())
            .await;
    }
    for e in [format!("{x}.unrouted"), x.clone()] {
        let _ = ch
            .exchange_delete(e.into(), ExchangeDeleteOptions::default())
            .await;
    }
    let _ = conn.close(200, "OK".into()).await;
}
