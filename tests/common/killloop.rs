//! Crash loops: a producer commits single-row transactions at a steady rate while the relay is
//! SIGKILLed and restarted at once, again and again, some lives shorter than a second; then one
//! last relay runs until every committed event is out. What every life printed is counted: lost
//! events (committed, never printed) and duplicates (printed more than once).
//!
//! Shared by the kill-loop tests of both sources and by `benches/duplicates.rs`.

use super::{parse_lines, Relay};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// How the loop kills.
#[derive(Debug, Clone)]
pub struct Plan {
    /// SIGKILLs (each followed by an immediate restart).
    pub kills: usize,
    /// How long each relay lives, from the moment it logs where it resumes (its start
    /// position decided, its lease taken) to its SIGKILL, cycled through. Counted from there,
    /// not from the spawn, so that a loaded machine's slower startup does not eat the life.
    pub lives: Vec<Duration>,
    /// Producer rate, transactions (one row each) per second.
    pub rate: u32,
    /// The first relay's log line after which the producer starts (`None`: before the relay).
    pub produce_after: Option<&'static str>,
}

/// What a crash loop delivered.
#[derive(Debug)]
pub struct Outcome {
    /// Every event the producer committed (plus any given as committed before it).
    pub expected: Vec<Uuid>,
    /// Every event each life printed, in order, all lives together.
    pub delivered: Vec<Uuid>,
    pub kills: usize,
    /// How many of `expected` the producer committed during the loop.
    pub produced: usize,
    /// From the producer's first commit to the last event delivered.
    pub elapsed: Duration,
    /// Stderr of every life, for a failure message.
    pub stderr: String,
}

impl Outcome {
    pub fn lost(&self) -> Vec<Uuid> {
        let got: HashSet<&Uuid> = self.delivered.iter().collect();
        self.expected
            .iter()
            .filter(|i| !got.contains(i))
            .copied()
            .collect()
    }

    pub fn duplicates(&self) -> usize {
        self.delivered.len() - self.delivered.iter().collect::<HashSet<_>>().len()
    }

    /// The position each life logged it resumes from (`resuming position=…`), in order.
    pub fn resumed_from(&self) -> Vec<String> {
        self.stderr
            .lines()
            .filter(|l| l.contains(" resuming "))
            .filter_map(|l| l.split("position=").nth(1))
            .map(|p| p.split_whitespace().next().unwrap_or("").to_string())
            .collect()
    }

    /// Panics unless at least `min` lives resumed from a position no earlier life resumed
    /// from: a life of well under a second still stores progress for the next one.
    pub fn assert_progress(&self, min: usize) {
        let from = self.resumed_from();
        let distinct: HashSet<&String> = from.iter().collect();
        assert!(
            distinct.len() >= min,
            "the lives resumed from only {} distinct positions (want at least {min}): {from:?}",
            distinct.len()
        );
    }

    /// Events the producer committed per second, as measured.
    pub fn rate(&self) -> f64 {
        self.produced as f64 / self.elapsed.as_secs_f64().max(0.001)
    }

    /// Panics unless every committed event was delivered and the duplicates stay within
    /// `window` plus `traffic` worth of the measured producer rate for each SIGKILL (plus
    /// `extra`).
    pub fn assert_within(&self, window: usize, traffic: Duration, extra: usize) {
        let per_kill = window + (self.rate() * traffic.as_secs_f64()).ceil() as usize;
        let lost = self.lost();
        eprintln!(
            "kill loop: {} events committed ({:.0}/s), {} delivered, {} lost, {} duplicates, {} SIGKILLs, {:.1}s",
            self.expected.len(),
            self.rate(),
            self.delivered.len(),
            lost.len(),
            self.duplicates(),
            self.kills,
            self.elapsed.as_secs_f64()
        );
        let tail = |s: &str| s[s.len().saturating_sub(6000)..].to_string();
        assert!(
            lost.is_empty(),
            "{} of {} committed events were never delivered across {} SIGKILLs (first {:?}); stderr tail:\n{}",
            lost.len(),
            self.expected.len(),
            self.kills,
            lost.first(),
            tail(&self.stderr)
        );
        if std::env::var_os("OUTBOXD_KILL_LOOP_LOG").is_some() {
            eprintln!("{}", self.stderr);
        }
        // The relay refuses (and logs) a store that would move its position backwards: in a
        // crash loop that is a bug of the restart path (it once refused every snapshot mark
        // of a first start, so each life read the whole table again).
        let refused = self
            .stderr
            .lines()
            .filter(|l| l.contains("refused to store a position older"))
            .count();
        assert_eq!(
            refused,
            0,
            "{refused} position stores were refused as backwards; stderr tail:\n{}",
            tail(&self.stderr)
        );
        let bound = per_kill * self.kills + extra;
        assert!(
            self.duplicates() <= bound,
            "{} duplicates for {} events across {} SIGKILLs: more than {bound} ({per_kill} per kill: window {window} + {traffic:?} at {:.0}/s; + {extra}); stderr tail:\n{}",
            self.duplicates(),
            self.expected.len(),
            self.kills,
            self.rate(),
            tail(&self.stderr)
        );
    }
}

/// A producer running in the background until [`Producer::finish`].
pub struct Producer {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Vec<Uuid>>>,
    pub started: Instant,
}

impl Producer {
    /// Stops the producer; returns the ids it committed.
    pub async fn finish(self) -> Vec<Uuid> {
        self.stop.store(true, Ordering::SeqCst);
        let mut ids = Vec::new();
        for t in self.tasks {
            ids.extend(t.await.expect("producer task"));
        }
        ids
    }
}

/// Sessions committing at once: one session's commit latency (an fsync each) would cap the
/// rate far below a few hundred per second on a loaded machine.
const SESSIONS: u32 = 4;

/// One session's share of a rate (per second).
struct Pace {
    start: tokio::time::Instant,
    period: Duration,
    done: u32,
}

impl Pace {
    fn new(rate: u32) -> Pace {
        Pace {
            start: tokio::time::Instant::now(),
            period: Duration::from_secs_f64(SESSIONS as f64 / rate.max(1) as f64),
            done: 0,
        }
    }

    /// One more committed: waits for the next one's turn (at once after a slow commit, so the
    /// rate catches up rather than drifts lower).
    async fn next(&mut self) {
        self.done += 1;
        tokio::time::sleep_until(self.start + self.period * self.done).await;
    }
}

fn producer(spawn: impl Fn(Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<Uuid>>) -> Producer {
    let stop = Arc::new(AtomicBool::new(false));
    Producer {
        tasks: (0..SESSIONS).map(|_| spawn(stop.clone())).collect(),
        stop,
        started: Instant::now(),
    }
}

/// Single-row transactions into the Postgres outbox table of `db`, at `rate` per second.
pub fn pg_producer(db: &super::PgDb, rate: u32, topic: &'static str) -> Producer {
    let conninfo = db.conninfo();
    producer(|stop| {
        let conninfo = conninfo.clone();
        tokio::spawn(async move {
            let mut c = super::pg_connect(&conninfo).await;
            let outbox = outboxd::Outbox::new("outbox").unwrap();
            let (mut pace, mut ids) = (Pace::new(rate), Vec::new());
            while !stop.load(Ordering::SeqCst) {
                let mut tx = c.transaction().await.unwrap();
                let n = ids.len();
                let payload = serde_json::json!({ "n": n });
                let id = outbox
                    .write(&mut tx, topic, &format!("agg-{}", n % 31), &payload)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                ids.push(id);
                pace.next().await;
            }
            ids
        })
    })
}

/// Single-row transactions into the MySQL/MariaDB outbox table of `db`, at `rate` per second.
pub fn my_producer(db: &super::MyDb, rate: u32, topic: &'static str) -> Producer {
    let name = db.name.clone();
    producer(|stop| {
        let name = name.clone();
        tokio::spawn(async move {
            let mut c = super::my_connect(Some(&name)).await;
            let outbox = outboxd::Outbox::new("outbox").unwrap();
            let (mut pace, mut ids) = (Pace::new(rate), Vec::new());
            while !stop.load(Ordering::SeqCst) {
                let mut tx = c
                    .start_transaction(mysql_async::TxOpts::default())
                    .await
                    .unwrap();
                let n = ids.len();
                let payload = serde_json::json!({ "n": n });
                let id = outbox
                    .write(&mut tx, topic, &format!("{}", n % 31), &payload)
                    .await
                    .unwrap();
                tx.commit().await.unwrap();
                ids.push(id);
                pace.next().await;
            }
            ids
        })
    })
}

/// Single-row transactions into the outbox of any source database, from as many writers as
/// the other producers use, each pausing so that together they commit about `rate` per
/// second (paced less exactly than [`pg_producer`]: for loops that need traffic, not a rate).
pub fn source_producer<D: super::source_db::SourceDb>(
    db: &D,
    rate: u32,
    topic: &'static str,
) -> Producer {
    let pause = Duration::from_secs_f64(SESSIONS as f64 / rate.max(1) as f64);
    producer(|stop| db.write_until(stop, 1, pause, topic))
}

fn ids(relay: &Relay) -> Vec<Uuid> {
    parse_lines(&relay.lines())
        .iter()
        .filter_map(|l| l["id"].as_str()?.parse().ok())
        .collect()
}

/// The binary under test: `OUTBOXD_KILL_LOOP_BIN` runs the loop against another build (to see
/// it fail on one without the fix), else this crate's.
fn start(args: &[&str]) -> Relay {
    match std::env::var("OUTBOXD_KILL_LOOP_BIN") {
        Ok(bin) => Relay::start_bin(&bin, args, &[]),
        Err(_) => Relay::start(args),
    }
}

/// Runs the loop: `args` start one relay (stdout sink with `--commit-offsets`),
/// `producer` starts the producer, `before` are events committed before it that must be
/// delivered too (a snapshot's rows).
pub async fn run<P>(args: &[&str], plan: &Plan, before: Vec<Uuid>, producer: P) -> Outcome
where
    P: FnOnce() -> Producer,
{
    run_reading(
        args,
        plan,
        before,
        producer,
        None::<fn(usize) -> std::future::Ready<Vec<Uuid>>>,
    )
    .await
}

/// [`run`] for a sink that prints nothing: `read(n)` reads back everything the sink holds
/// (every copy, in its order), waiting for at least `n` events, in place of the lives' stdout.
pub async fn run_reading<P, R, F>(
    args: &[&str],
    plan: &Plan,
    before: Vec<Uuid>,
    producer: P,
    read: Option<R>,
) -> Outcome
where
    P: FnOnce() -> Producer,
    R: Fn(usize) -> F,
    F: std::future::Future<Output = Vec<Uuid>>,
{
    let deadline = Duration::from_secs(120);
    let mut lives: Vec<Relay> = Vec::new();
    let mut producer = Some(producer);
    let mut running: Option<Producer> = None;
    if plan.produce_after.is_none() {
        running = Some((producer.take().expect("once"))());
    }
    for k in 0..plan.kills {
        let life = plan.lives[k % plan.lives.len()];
        let mut relay = start(args);
        relay.wait_for_stderr(&[" resuming "], deadline).await;
        let resumed = Instant::now();
        if let (Some(line), Some(p)) = (plan.produce_after, producer.take()) {
            relay.wait_for_stderr(&[line], deadline).await;
            running = Some(p());
        }
        tokio::time::sleep(life.saturating_sub(resumed.elapsed())).await;
        relay.sigkill();
        lives.push(relay);
    }
    let last = start(args);
    let running = running.expect("the producer started");
    let produced_from = running.started;
    let committed = running.finish().await;
    let produced = committed.len();
    let mut expected = before;
    expected.extend(committed);
    let want: HashSet<Uuid> = expected.iter().copied().collect();
    let earlier: HashSet<Uuid> = lives.iter().flat_map(ids).collect();
    // Not a panic on timeout: what is missing then is the finding, reported by the caller.
    let give_up = Instant::now() + Duration::from_secs(40);
    loop {
        let now: HashSet<Uuid> = match &read {
            Some(r) => r(want.len()).await,
            None => ids(&last),
        }
        .into_iter()
        .collect();
        if want.iter().all(|i| earlier.contains(i) || now.contains(i)) || Instant::now() > give_up {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let elapsed = produced_from.elapsed();
    let mut last = last;
    last.sigkill();
    lives.push(last);
    let delivered = match &read {
        Some(r) => r(want.len()).await,
        None => lives.iter().flat_map(ids).collect(),
    };
    Outcome {
        expected,
        delivered,
        kills: plan.kills,
        produced,
        elapsed,
        stderr: lives
            .iter()
            .enumerate()
            .map(|(i, r)| format!("--- life {i}\n{}", r.stderr_plain()))
            .collect(),
    }
}
