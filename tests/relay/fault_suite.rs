//! Randomized fault injection, one test per source (Postgres CDC, MariaDB CDC), run side by
//! side. Each trial has producers write committed and rolled-back transactions while one fault
//! hits at a random point of the producer's progress (after a random transaction, never by the
//! clock, so a short trial cannot finish before its fault): the TCP proxy between relay and
//! database or between relay and RabbitMQ cuts, stalls or slows the traffic, a broker stall
//! outlasts `--confirm-timeout` (timeout, reconnect, republish), or the relay is SIGKILLed and
//! restarted. Every fault must show it was injected (connections were open when it hit, the
//! producer committed while it lasted, a long stall made the relay reconnect, a kill found the
//! relay alive); the run prints the injections per kind and fails if a kind was never injected.
//!
//! After every trial: every committed event arrived at least once, no event of a rolled-back
//! transaction arrived, and the duplicates stay within a bound computed from the configured
//! window and the relay's store period (never from what the test saw stored, so a store period
//! that grows is caught). Across the whole run: first deliveries arrived in commit order, the
//! stored position (sampled from `outboxd_state`) never went backwards, and no relay logged a
//! refused backwards store (the relay's own guard, `state::forward`).
//!
//! `OUTBOXD_FAULT_SEED` replays a run (the seed is printed); `OUTBOXD_FAULT_TRIALS` sets the
//! trials per source (default 36, four per fault kind; 140+ for a long run). No service is
//! restarted here: restarts live in pg_restart.rs, mysql_restart.rs and rabbitmq_restart.rs.

use crate::common;

use common::amqp::{self, Topology};
use common::proxy::FaultProxy;
use common::source_db::Pos;
use common::*;
use futures::StreamExt;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);
/// `--window`: small, so that the duplicate bound means something for trials of a few dozen
/// events.
const WINDOW: usize = 8;
const TOPIC: &str = "fault.suite";
/// Most events in one producer transaction: the "rest of the open source transaction".
const TXN_MAX: usize = 4;
/// `--confirm-timeout`: short, so that a long broker stall outlasts it.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(2);
/// The relay's documented store period (docs/guarantees.md), deliberately not read from the
/// library: a relay whose period grows fails the duplicate bound instead of widening it.
const STORE_PERIOD: Duration = Duration::from_millis(100);
/// How long after a confirmation the relay may take to store the position: the store period
/// plus the acknowledgement interval and the write itself. Events confirmed within this
/// before a kill may come again; anything older must have been stored.
fn store_lag() -> Duration {
    STORE_PERIOD + Duration::from_millis(400)
}
/// The line the relay's backwards-store guard logs.
const BACKWARDS: &str = "refused to store a position older than the stored one";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Fault {
    DbCut,
    DbStall,
    DbSlow,
    BrokerCut,
    BrokerStall,
    BrokerSlow,
    /// A broker stall longer than `--confirm-timeout`.
    BrokerLongStall,
    /// A broker stall that ends in a cut: what the relay published into it never reached the
    /// broker and must be republished, in order.
    BrokerStallCut,
    Kill,
}

const FAULTS: [Fault; 9] = [
    Fault::DbCut,
    Fault::DbStall,
    Fault::DbSlow,
    Fault::BrokerCut,
    Fault::BrokerStall,
    Fault::BrokerSlow,
    Fault::BrokerLongStall,
    Fault::BrokerStallCut,
    Fault::Kill,
];

enum Db {
    Pg(PgDb),
    My(MyDb),
}

/// A producer session (straight to the server, never through the proxy).
enum Producer {
    Pg(tokio_postgres::Client),
    My(mysql_async::Conn),
}

impl Db {
    fn label(&self) -> &'static str {
        match self {
            Db::Pg(_) => "postgres",
            Db::My(_) => "mariadb",
        }
    }

    fn port(&self) -> u16 {
        match self {
            Db::Pg(_) => 5432,
            Db::My(_) => MY_PORT,
        }
    }

    fn dsn_via(&self, port: u16) -> String {
        match self {
            Db::Pg(d) => d.dsn_via(port),
            Db::My(d) => d.dsn_via(port),
        }
    }

    async fn producer(&self) -> Producer {
        match self {
            Db::Pg(d) => Producer::Pg(d.client().await),
            Db::My(d) => Producer::My(d.conn().await),
        }
    }

    /// A session that reads relay `name`'s stored position.
    async fn sampler(&self, name: &str) -> Sampler {
        let conn = match self {
            Db::Pg(d) => SamplerConn::Pg(d.client().await),
            Db::My(d) => SamplerConn::My(d.conn().await),
        };
        Sampler {
            conn,
            name: name.to_string(),
        }
    }
}

enum SamplerConn {
    Pg(tokio_postgres::Client),
    My(mysql_async::Conn),
}

struct Sampler {
    conn: SamplerConn,
    name: String,
}

impl Sampler {
    /// The stored position, if one is stored yet.
    async fn stored(&mut self) -> Option<Pos> {
        match &mut self.conn {
            SamplerConn::Pg(c) => {
                let row = c
                    .query_opt(
                        "SELECT position_lsn::text FROM outboxd_state WHERE name = $1",
                        &[&self.name],
                    )
                    .await
                    .ok()??;
                let lsn: Option<String> = row.get(0);
                lsn.and_then(|l| outboxd::event::parse_lsn(&l))
                    .map(Pos::Lsn)
            }
            SamplerConn::My(c) => {
                use mysql_async::prelude::Queryable;
                let row: Option<(Option<String>, Option<u64>)> = c
                    .exec_first(
                        "SELECT binlog_file, binlog_pos FROM outboxd_state WHERE name = ?",
                        (&self.name,),
                    )
                    .await
                    .ok()?;
                let (f, p) = row?;
                Some(Pos::Binlog(outboxd::event::binlog_file_seq(&f?), p?))
            }
        }
    }
}

impl Producer {
    /// One transaction of `n` events, committed or rolled back; returns the ids.
    async fn txn(&mut self, n: usize, commit: bool, seq: usize) -> Vec<Uuid> {
        let outbox = outboxd::Outbox::new("outbox").unwrap();
        let mut ids = Vec::with_capacity(n);
        let payload = |i: usize| serde_json::json!({"seq": seq, "i": i, "commit": commit});
        let aggregate = format!("{}", seq % 7);
        match self {
            Producer::Pg(c) => {
                let mut tx = c.transaction().await.unwrap();
                for i in 0..n {
                    ids.push(
                        outbox
                            .write(&mut tx, TOPIC, &aggregate, &payload(i))
                            .await
                            .unwrap(),
                    );
                }
                if commit {
                    tx.commit().await
                } else {
                    tx.rollback().await
                }
                .unwrap()
            }
            Producer::My(c) => {
                let mut tx = c
                    .start_transaction(mysql_async::TxOpts::default())
                    .await
                    .unwrap();
                for i in 0..n {
                    let body = payload(i);
                    let id = outbox.write(&mut tx, TOPIC, &aggregate, &body);
                    ids.push(id.await.unwrap());
                }
                if commit {
                    tx.commit().await
                } else {
                    tx.rollback().await
                }
                .unwrap()
            }
        }
        ids
    }
}

/// Every delivery from the test's queue: (id, position, arrival, `x-source-position` text,
/// the trial running when it arrived).
type Deliveries = Arc<Mutex<Vec<(Uuid, Option<Pos>, Instant, String, usize)>>>;

/// The trial under way, for attributing deliveries in failure messages.
static TRIAL: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

async fn consume(topo: &Topology, queue: &str, into: Deliveries) {
    use lapin::options::{BasicConsumeOptions, BasicQosOptions};
    let ch = topo.channel().await;
    ch.basic_qos(1000, BasicQosOptions::default())
        .await
        .expect("basic.qos");
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            unique("c").into(),
            BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .expect("basic.consume");
    tokio::spawn(async move {
        let _ch = ch;
        while let Some(Ok(d)) = consumer.next().await {
            let text = amqp::header_str(&d, "x-source-position").unwrap_or_default();
            let pos = Pos::of_event(&text);
            into.lock().unwrap().push((
                amqp::message_id(&d),
                pos,
                Instant::now(),
                text,
                TRIAL.load(std::sync::atomic::Ordering::Relaxed),
            ));
        }
    });
}

#[derive(Default, Clone, Copy)]
struct Tally {
    trials: usize,
    injected: usize,
    events: usize,
    lost: usize,
    duplicates: usize,
    bound: usize,
    rolled_back_seen: usize,
}

struct Suite {
    db: Db,
    name: String,
    args: Vec<String>,
    sink: String,
    db_proxy: FaultProxy,
    broker_proxy: FaultProxy,
    relay: Relay,
    /// stderr of every relay this run replaced (killed, or exited).
    past_stderr: String,
    /// Stored positions sampled over the whole run: (when, position).
    samples: Arc<Mutex<Vec<(Instant, Pos)>>>,
}

impl Suite {
    fn start_relay(&self) -> Relay {
        let args: Vec<&str> = self.args.iter().map(String::as_str).collect();
        Relay::start_with_env(&args, &[("OUTBOXD_SINK", &self.sink)])
    }

    /// Starts a new relay in place of the one that ended, keeping the old one's stderr.
    fn replace_relay(&mut self) {
        let new = self.start_relay();
        let old = std::mem::replace(&mut self.relay, new);
        self.past_stderr.push_str(&old.stderr());
    }

    /// Sink recoveries logged by the running relay so far.
    fn recoveries(&self) -> usize {
        self.relay
            .stderr()
            .matches("sink failed; reconnecting")
            .count()
    }
}

fn env_usize(key: &str, default: usize) -> usize {
    std::env::var(key)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{key}={v:?} is not a number"))
        })
        .unwrap_or(default)
}

async fn run_suite(db: Db) {
    let label = db.label();
    let seed: u64 = std::env::var("OUTBOXD_FAULT_SEED")
        .ok()
        .map(|s| s.parse().expect("OUTBOXD_FAULT_SEED is a u64"))
        .unwrap_or_else(rand::random);
    let trials = env_usize("OUTBOXD_FAULT_TRIALS", 36);
    // Each source has its own stream from the one seed.
    let mut rng = StdRng::seed_from_u64(seed ^ if label == "postgres" { 0 } else { 0x5eed });
    eprintln!(
        "fault suite {label}: seed {seed} (replay: OUTBOXD_FAULT_SEED={seed}), {trials} trials"
    );
    let started = Instant::now();

    let mut topo = Topology::new("fault").await;
    let db_proxy = FaultProxy::start(format!("127.0.0.1:{}", db.port()).parse().unwrap())
        .await
        .unwrap();
    let broker_proxy = FaultProxy::start(format!("127.0.0.1:{}", amqp::HOST_PORT).parse().unwrap())
        .await
        .unwrap();
    let name = unique("f");
    let confirm_timeout = format!("{}ms", CONFIRM_TIMEOUT.as_millis());
    let args: Vec<String> = [
        "run",
        "--source",
        &db.dsn_via(db_proxy.port()),
        "--name",
        &name,
        "--exchange",
        &topo.exchange,
        "--window",
        &WINDOW.to_string(),
        "--confirm-timeout",
        &confirm_timeout,
        "--log-level",
        "info,lapin=warn",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let sink = amqp::url_via(broker_proxy.port());
    let relay = Relay::start_with_env(
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        &[("OUTBOXD_SINK", &sink)],
    );
    let mut suite = Suite {
        db,
        name,
        args,
        sink,
        db_proxy,
        broker_proxy,
        relay,
        past_stderr: String::new(),
        samples: Arc::new(Mutex::new(Vec::new())),
    };
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("all", "#").await;
    let deliveries: Deliveries = Arc::new(Mutex::new(Vec::new()));
    consume(&topo, &queue, deliveries.clone()).await;

    // Sample the stored position through the whole run (its own session, never proxied).
    let stop_sampling = tokio_util::sync::CancellationToken::new();
    let sampler = {
        let samples = suite.samples.clone();
        let stop = stop_sampling.clone();
        let mut sampler = suite.db.sampler(&suite.name).await;
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                if let Some(p) = sampler.stored().await {
                    samples.lock().unwrap().push((Instant::now(), p));
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    let mut producer = suite.db.producer().await;
    let mut stored_now = suite.db.sampler(&suite.name).await;
    let mut tallies: BTreeMap<Fault, Tally> = BTreeMap::new();
    let mut rolled_back: HashSet<Uuid> = HashSet::new();
    let mut seq = 0usize;
    let mut dups_before = 0usize;
    // Each kind equally often, in a random order.
    let mut kinds: Vec<Fault> = (0..trials).map(|i| FAULTS[i % FAULTS.len()]).collect();
    for i in (1..kinds.len()).rev() {
        kinds.swap(i, rng.random_range(0..=i));
    }
    let mut failures = Vec::new();

    let fault_of: BTreeMap<usize, Fault> = kinds.iter().copied().enumerate().collect();
    for (trial, fault) in kinds.into_iter().enumerate() {
        TRIAL.store(trial, std::sync::atomic::Ordering::Relaxed);
        // A kill comes after at least twice the store lag of steady traffic, so that what
        // was confirmed long enough before it must have been stored (the bound below checks
        // it); about 25 ms a transaction.
        let kill_after = 2 * store_lag();
        let n_txn = match fault {
            Fault::Kill => (kill_after.as_millis() / 25) as usize + rng.random_range(6..=12),
            _ => rng.random_range(6..=12),
        };
        // The fault hits after this many transactions (a kill: once the producer has run for
        // `kill_after`), and the next one commits: the producer is always still writing when
        // the fault begins.
        let mut fault_after = rng.random_range(1..=n_txn / 2);
        let fault_len = match fault {
            Fault::BrokerLongStall => {
                CONFIRM_TIMEOUT + Duration::from_millis(rng.random_range(500..1500))
            }
            _ => Duration::from_millis(rng.random_range(200..1200)),
        };
        let slow = Duration::from_millis(rng.random_range(5..40));
        let restart_after = Duration::from_millis(rng.random_range(0..300));
        let plan: Vec<(usize, bool, u64)> = (0..n_txn)
            .map(|i| {
                (
                    rng.random_range(1..=TXN_MAX),
                    i == fault_after || rng.random_bool(0.75),
                    rng.random_range(0..40),
                )
            })
            .collect();
        let recoveries_before = suite.recoveries();
        let db_accepted_before = suite.db_proxy.accepted();
        let broker_accepted_before = suite.broker_proxy.accepted();
        let t0 = Instant::now();
        let mut committed = Vec::new();
        let mut faulted = false;
        let mut cleared = false;
        // What shows the fault really hit: connections open when it began, a committed
        // transaction written while it lasted (the relay had work to do through it).
        let mut open_at_fault = 0usize;
        let mut bytes_at_fault = 0u64;
        let mut bytes_at_clear = [0u64; 2];
        let mut delayed_before = 0u64;
        let mut committed_during = 0usize;
        let mut killed_alive = false;
        let mut unstored = 0usize;
        let mut kills = 0usize;
        let mut fault_started = t0;
        for (k, (n, commit, pause)) in plan.into_iter().enumerate() {
            if fault == Fault::Kill && !faulted {
                fault_after = if t0.elapsed() >= kill_after || k + 4 >= n_txn {
                    k
                } else {
                    usize::MAX
                };
            }
            if !faulted && k == fault_after {
                faulted = true;
                fault_started = Instant::now();
                let proxy = match fault {
                    Fault::DbCut | Fault::DbStall | Fault::DbSlow => &suite.db_proxy,
                    _ => &suite.broker_proxy,
                };
                open_at_fault = proxy.open_connections();
                bytes_at_fault = proxy_bytes(proxy);
                delayed_before = proxy.delayed_chunks();
                match fault {
                    Fault::DbCut | Fault::BrokerCut => proxy.cut(),
                    Fault::DbStall
                    | Fault::BrokerStall
                    | Fault::BrokerLongStall
                    | Fault::BrokerStallCut => proxy.stall(),
                    Fault::DbSlow | Fault::BrokerSlow => proxy.set_delay(slow),
                    Fault::Kill => {
                        killed_alive = matches!(suite.relay.child.try_wait(), Ok(None));
                        let killed_at = Instant::now();
                        suite.relay.sigkill();
                        kills += 1;
                        // Events whose first delivery came within the store lag before the
                        // kill may not be stored yet: they come again. The broker may still
                        // hand over messages confirmed just before the kill: count them
                        // until the restart.
                        tokio::time::sleep(restart_after.max(Duration::from_millis(100))).await;
                        let since = killed_at.checked_sub(store_lag()).unwrap_or(t0);
                        let d = deliveries.lock().unwrap();
                        let mut seen = HashSet::new();
                        unstored = d
                            .iter()
                            .filter(|(id, _, at, _, _)| seen.insert(*id) && *at >= since)
                            .count();
                        drop(d);
                        suite.replace_relay();
                        cleared = true;
                    }
                }
            }
            let ids = producer.txn(n, commit, seq).await;
            seq += 1;
            if commit {
                if faulted && !cleared || k == fault_after {
                    committed_during += 1;
                }
                committed.extend(ids);
            } else {
                rolled_back.extend(ids);
            }
            if faulted && !cleared && fault_started.elapsed() >= fault_len {
                bytes_at_clear = clear_fault(&suite, fault);
                cleared = true;
            }
            tokio::time::sleep(Duration::from_millis(pause)).await;
        }
        if !cleared {
            let left = fault_len.saturating_sub(fault_started.elapsed());
            tokio::time::sleep(left).await;
            bytes_at_clear = clear_fault(&suite, fault);
        }

        // Every committed event of this trial, at least once.
        let deadline = Instant::now() + T;
        let lost = loop {
            let got: HashSet<Uuid> = deliveries.lock().unwrap().iter().map(|d| d.0).collect();
            let missing = committed.iter().filter(|i| !got.contains(i)).count();
            if missing == 0 || Instant::now() > deadline {
                break missing;
            }
            if let Ok(Some(status)) = suite.relay.child.try_wait() {
                failures.push(format!(
                    "trial {trial} ({fault:?}): the relay exited ({status}):\n{}",
                    suite.relay.stderr()
                ));
                suite.replace_relay();
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        // Then until the stored position is past the trial's last committed event: whatever a
        // restart or a recovery delivers again has been delivered by then, and is counted
        // for this trial rather than the next one.
        let last: Option<Pos> = {
            let last_id = committed.last();
            let d = deliveries.lock().unwrap();
            d.iter()
                .filter(|(id, _, _, _, _)| Some(id) == last_id)
                .find_map(|(_, p, _, _, _)| *p)
        };
        if let Some(last) = last {
            let deadline = Instant::now() + T;
            loop {
                match stored_now.stored().await {
                    Some(s) if !last.after(s) => break,
                    s if Instant::now() > deadline => {
                        failures.push(format!(
                            "trial {trial} ({fault:?}): the stored position {s:?} did not pass the last event at {last:?} within {T:?}"
                        ));
                        break;
                    }
                    _ => tokio::time::sleep(Duration::from_millis(50)).await,
                }
            }
        }
        let (total, distinct, rb_seen) = {
            let d = deliveries.lock().unwrap();
            let distinct: HashSet<Uuid> = d.iter().map(|x| x.0).collect();
            let rb = distinct.iter().filter(|i| rolled_back.contains(i)).count();
            (d.len(), distinct.len(), rb)
        };
        let dups = (total - distinct) - dups_before;
        dups_before = total - distinct;
        let recoveries =
            suite
                .recoveries()
                .saturating_sub(if kills > 0 { 0 } else { recoveries_before });
        // Whether the fault demonstrably hit this trial.
        // A cut found open connections and the relay reconnected; a stall let nothing pass
        // while the producer committed, and traffic flowed after it (it held real data); a
        // long stall also made the relay time out and reconnect; a slowdown delayed traffic;
        // a kill found the relay alive.
        let reconnected = |p: &FaultProxy, before: u64| p.accepted() > before;
        let held = |p: &FaultProxy, i: usize| {
            open_at_fault > 0
                && committed_during > 0
                && bytes_at_clear[i] == bytes_at_fault
                && proxy_bytes(p) > bytes_at_clear[i]
        };
        let injected = match fault {
            Fault::Kill => killed_alive,
            Fault::DbCut => open_at_fault > 0 && reconnected(&suite.db_proxy, db_accepted_before),
            Fault::BrokerCut => {
                open_at_fault > 0 && reconnected(&suite.broker_proxy, broker_accepted_before)
            }
            Fault::DbStall => held(&suite.db_proxy, 0),
            Fault::BrokerStall => held(&suite.broker_proxy, 1),
            Fault::BrokerLongStall => held(&suite.broker_proxy, 1) && recoveries > 0,
            // The stalled bytes were dropped by the cut, so only the reconnect shows.
            Fault::BrokerStallCut => {
                open_at_fault > 0
                    && committed_during > 0
                    && bytes_at_clear[1] == bytes_at_fault
                    && reconnected(&suite.broker_proxy, broker_accepted_before)
            }
            Fault::DbSlow => {
                committed_during > 0 && suite.db_proxy.delayed_chunks() > delayed_before
            }
            Fault::BrokerSlow => {
                committed_during > 0 && suite.broker_proxy.delayed_chunks() > delayed_before
            }
        };
        // In flight (the window) plus the rest of the open source transaction, per
        // interruption, plus what may have been confirmed but not yet stored when the relay
        // died (first delivered within the store lag before the kill).
        let interruptions =
            kills + recoveries + usize::from(matches!(fault, Fault::DbCut | Fault::BrokerStallCut));
        let bound = interruptions * (WINDOW + TXN_MAX) + unstored;
        let t = tallies.entry(fault).or_default();
        t.trials += 1;
        t.injected += usize::from(injected);
        t.events += committed.len();
        t.lost += lost;
        t.duplicates += dups;
        t.bound += bound;
        t.rolled_back_seen = rb_seen;
        if lost > 0 {
            failures.push(format!(
                "trial {trial} ({fault:?}): {lost} of {} committed events lost; relay stderr:\n{}",
                committed.len(),
                suite.relay.stderr()
            ));
        }
        if dups > bound {
            failures.push(format!(
                "trial {trial} ({fault:?}): {dups} duplicates, bound {bound} (kills {kills}, sink recoveries {recoveries}, first delivered within {:?} before the kill {unstored})",
                store_lag()
            ));
        }
        if rb_seen > 0 {
            failures.push(format!(
                "trial {trial} ({fault:?}): {rb_seen} events of rolled-back transactions arrived"
            ));
        }
    }
    stop_sampling.cancel();
    let _ = sampler.await;

    // The stored position never went backwards, across faults and restarts: as sampled from
    // the state table, and as the relay's own guard saw every store it attempted.
    let samples = suite.samples.lock().unwrap().clone();
    for w in samples.windows(2) {
        if w[1].1 < w[0].1 {
            failures.push(format!(
                "the stored position went backwards: {:?} then {:?}",
                w[0].1, w[1].1
            ));
        }
    }
    let all_stderr = format!("{}{}", suite.past_stderr, suite.relay.stderr());
    let backwards = all_stderr.matches(BACKWARDS).count();
    if backwards > 0 {
        failures.push(format!(
            "a relay tried to store a position older than the stored one {backwards} times:\n{}",
            all_stderr
                .lines()
                .filter(|l| l.contains(BACKWARDS))
                .take(5)
                .collect::<Vec<_>>()
                .join("\n")
        ));
    }
    // Guarantee 4: first deliveries in commit order (positions render so that text order is
    // commit order).
    let order_violations = {
        let d = deliveries.lock().unwrap();
        let mut seen = HashSet::new();
        let firsts: Vec<(&str, usize)> = d
            .iter()
            .filter(|(id, _, _, _, _)| seen.insert(*id))
            .map(|(_, _, _, text, trial)| (text.as_str(), *trial))
            .collect();
        let bad: Vec<String> = firsts
            .windows(2)
            .filter(|w| w[1].0 < w[0].0)
            .map(|w| {
                format!(
                    "{} then {} (trial {} {:?})",
                    w[0].0,
                    w[1].0,
                    w[1].1,
                    fault_of.get(&w[1].1)
                )
            })
            .collect();
        (firsts.len(), bad)
    };
    if !order_violations.1.is_empty() {
        failures.push(format!(
            "{} of {} first deliveries arrived out of commit order, e.g. {}",
            order_violations.1.len(),
            order_violations.0,
            order_violations.1[..order_violations.1.len().min(5)].join("; ")
        ));
    }
    let mut all = Tally::default();
    eprintln!("fault suite {label} injections (a fault counts only where it demonstrably hit):");
    for (fault, t) in &tallies {
        eprintln!(
            "fault suite {label} {:<15} trials {:>3}  injected {:>3}  events {:>5}  lost {}  duplicates {:>4}  (bound {:>4})",
            format!("{fault:?}"),
            t.trials,
            t.injected,
            t.events,
            t.lost,
            t.duplicates,
            t.bound
        );
        all.trials += t.trials;
        all.injected += t.injected;
        all.events += t.events;
        all.lost += t.lost;
        all.duplicates += t.duplicates;
        all.bound += t.bound;
    }
    eprintln!(
        "fault suite {label} {:<15} trials {:>3}  injected {:>3}  events {:>5}  lost {}  duplicates {:>4}  (bound {:>4})  rolled back {} (none arrived)  first deliveries in commit order {}  backwards stores refused {backwards}  position samples {}  {:.0}s  seed {seed}",
        "all",
        all.trials,
        all.injected,
        all.events,
        all.lost,
        all.duplicates,
        all.bound,
        rolled_back.len(),
        order_violations.0,
        samples.len(),
        started.elapsed().as_secs_f64()
    );
    for fault in FAULTS {
        if trials >= FAULTS.len() && tallies.get(&fault).is_none_or(|t| t.injected == 0) {
            failures.push(format!(
                "fault {fault:?} was never injected in {} trials",
                tallies.get(&fault).map_or(0, |t| t.trials)
            ));
        }
    }
    assert!(samples.len() > 1, "the stored position was sampled");
    assert!(all.events > 0 && !rolled_back.is_empty());
    assert!(
        failures.is_empty(),
        "{label}: {} failures (replay: OUTBOXD_FAULT_SEED={seed}):\n{}",
        failures.len(),
        failures.join("\n")
    );
    suite.relay.signal("TERM");
    let code = suite.relay.wait_exit(T).await;
    assert_eq!(code, 0, "{}", suite.relay.stderr());
}

/// Ends a stall or slowdown on both proxies; returns the bytes each had forwarded until then
/// (database proxy, broker proxy), so a stall can show nothing passed while it lasted.
fn clear(suite: &Suite) -> [u64; 2] {
    let total = |p: &FaultProxy| {
        let (up, down) = p.bytes();
        up + down
    };
    let before = [total(&suite.db_proxy), total(&suite.broker_proxy)];
    for p in [&suite.db_proxy, &suite.broker_proxy] {
        p.resume();
        p.set_delay(Duration::ZERO);
    }
    before
}

/// Ends the trial's fault: a stall-then-cut cuts the stalled broker connections first (the
/// bytes they held are lost), every other fault just ends.
fn clear_fault(suite: &Suite, fault: Fault) -> [u64; 2] {
    if fault == Fault::BrokerStallCut {
        suite.broker_proxy.cut();
    }
    clear(suite)
}

/// Bytes a proxy forwarded so far, both directions.
fn proxy_bytes(p: &FaultProxy) -> u64 {
    let (up, down) = p.bytes();
    up + down
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_cdc_under_random_faults() {
    run_suite(Db::Pg(PgDb::create("fault").await)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_cdc_under_random_faults() {
    run_suite(Db::My(MyDb::create("fault").await)).await;
}
