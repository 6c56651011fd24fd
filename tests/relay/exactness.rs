//! Exactly once that stays exact (docs/guarantees.md, "An event's identity"): the
//! deduplicating sinks (Kafka, the RabbitMQ stream, NATS JetStream) recognise what the broker
//! already holds by an event's identity — its source, its position or GTID, and its id — so
//! that a number used again never makes them skip an event:
//!
//! - a first start's snapshot killed again and again, on both sources into every
//!   deduplicating sink: a resumed snapshot numbers its rows as the life before did, and every
//!   row is in the broker exactly once;
//! - two relays writing one stream: the one restarted never takes the other's messages for
//!   its own;
//! - the relay moved to another database server: the broker's records of the old one stop it
//!   with the fix, instead of new events being held as "already there".

use crate::common;

use common::killloop::{self, Plan};
use common::source_db::SourceDb;
use common::*;
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

/// A deduplicating sink as these tests drive it: its relay arguments and every copy of every
/// event it holds.
#[allow(async_fn_in_trait)]
trait Dedup: Sized {
    const LABEL: &'static str;
    async fn new(tag: &str) -> Self;
    /// `--sink …` and what names this test's destination.
    fn args(&self) -> Vec<String>;
    /// Every event id the destination holds, one per copy, once at least `n` are there (or
    /// after a patience).
    async fn ids(&self, n: usize) -> Vec<Uuid>;
    async fn cleanup(&self) {}
}

/// The events of these tests all go to one topic.
const TOPIC: &str = "exact";

struct Kafka(crate::kafka_sink::Topics);

impl Dedup for Kafka {
    const LABEL: &'static str = "Kafka";
    async fn new(tag: &str) -> Self {
        Kafka(crate::kafka_sink::Topics::new(tag))
    }
    fn args(&self) -> Vec<String> {
        let mut a = vec!["--sink".into(), kafka::url()];
        a.extend(self.0.args());
        a
    }
    async fn ids(&self, n: usize) -> Vec<Uuid> {
        kafka::wait_records(&self.0.topic(TOPIC), n, Duration::from_secs(30))
            .await
            .iter()
            .map(crate::kafka_sink::id_of)
            .collect()
    }
}

struct Stream(rmq_stream::TestStream);

impl Dedup for Stream {
    const LABEL: &'static str = "RabbitMQ stream";
    async fn new(tag: &str) -> Self {
        Stream(rmq_stream::TestStream::new(tag))
    }
    fn args(&self) -> Vec<String> {
        self.0.args()
    }
    async fn ids(&self, n: usize) -> Vec<Uuid> {
        self.0
            .read(n, Duration::from_secs(30))
            .await
            .into_iter()
            .map(|m| m.id)
            .collect()
    }
    async fn cleanup(&self) {
        self.0.delete(0).await;
    }
}

struct Nats(nats::TestStream);

impl Dedup for Nats {
    const LABEL: &'static str = "NATS";
    async fn new(tag: &str) -> Self {
        Nats(nats::TestStream::new(tag).await)
    }
    fn args(&self) -> Vec<String> {
        let mut a = vec!["--sink".into(), nats::url()];
        a.extend(self.0.args());
        a
    }
    async fn ids(&self, n: usize) -> Vec<Uuid> {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while (self.0.len().await as usize) < n && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.0.id_counts().await.0
    }
}

/// Rows already in the table when the relay first starts.
const PREFILL: usize = 8000;

/// A first start with `--snapshot all` over [`PREFILL`] rows, SIGKILLed six times — most
/// lives end inside the snapshot — while a producer writes; then one relay runs to the end.
/// Every row, the snapshot's and the stream's, is in the broker exactly once.
async fn snapshot_kill_loop<D: SourceDb, K: Dedup>() {
    let db = D::create("exsnap").await;
    let sink = K::new("exsnap").await;
    let name = unique("exs");
    let before = db.write(PREFILL / 200, 200, TOPIC).await;
    let mut args: Vec<String> = [
        "run",
        "--source",
        &db.dsn(),
        "--name",
        &name,
        "--snapshot",
        "all",
        "--window",
        "100",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    args.extend(sink.args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let plan = Plan {
        kills: 6,
        lives: [400, 700, 500, 900, 600]
            .iter()
            .map(|&m| Duration::from_millis(m))
            .collect(),
        rate: 100,
        produce_after: None,
    };
    let out = killloop::run_reading(
        &args,
        &plan,
        before,
        || killloop::source_producer(&db, 100, TOPIC),
        Some(|n: usize| sink.ids(n)),
    )
    .await;
    let lost = out.lost();
    let mut copies: HashMap<Uuid, usize> = HashMap::new();
    for id in &out.delivered {
        *copies.entry(*id).or_default() += 1;
    }
    let repeated: Vec<_> = copies.iter().filter(|(_, n)| **n > 1).collect();
    eprintln!(
        "{} ← {}, snapshot kill loop: {} committed ({PREFILL} before the start), {} held, {} lost, {} repeated, {} SIGKILLs",
        K::LABEL,
        D::LABEL,
        out.expected.len(),
        out.delivered.len(),
        lost.len(),
        repeated.len(),
        out.kills
    );
    let tail = |s: &str| s[s.len().saturating_sub(6000)..].to_string();
    // The fault was real: a life took an interrupted snapshot up again after its last
    // durable row, and replayed rows the broker already held.
    assert!(
        out.stderr
            .contains("after the last durable one of an interrupted snapshot"),
        "no life resumed an interrupted snapshot: the kills missed it; stderr tail:\n{}",
        tail(&out.stderr)
    );
    assert!(
        lost.is_empty(),
        "{} of {} committed rows are not in {} (first {:?}); stderr tail:\n{}",
        lost.len(),
        out.expected.len(),
        K::LABEL,
        lost.first(),
        tail(&out.stderr)
    );
    assert!(
        repeated.is_empty(),
        "{} rows are in {} more than once (e.g. {:?}); stderr tail:\n{}",
        repeated.len(),
        K::LABEL,
        &repeated[..repeated.len().min(3)],
        tail(&out.stderr)
    );
    sink.cleanup().await;
}

macro_rules! snapshot_kill_loops {
    ($($name:ident: $sink:ty),* $(,)?) => {$(
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                snapshot_kill_loop::<PgDb, $sink>().await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn mariadb() {
                snapshot_kill_loop::<MyDb, $sink>().await
            }
        }
    )*};
}

snapshot_kill_loops! {
    a_killed_snapshot_is_in_kafka_exactly_once: Kafka,
    a_killed_snapshot_is_in_the_stream_exactly_once: Stream,
    a_killed_snapshot_is_in_nats_exactly_once: Nats,
}

/// How often each id is in `ids`.
fn counts(ids: &[Uuid]) -> HashMap<Uuid, usize> {
    let mut c = HashMap::new();
    for id in ids {
        *c.entry(*id).or_insert(0) += 1;
    }
    c
}

/// Two relays (`a` and `b`) publish one database's outbox into one stream, each event once per
/// relay. `a` stops; 30 events are written; `b` — started after `a` stopped, so that its
/// publishing ids run level with `a`'s — publishes them and stops. `a`, started again, finds
/// `b`'s message with its own last publishing id at the stream's end: it is not `a`'s, and the
/// 30 events `a` had not published go out from `a` too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_never_takes_another_relays_messages_in_its_stream_for_its_own() {
    let mut db = PgDb::create("ex2r").await;
    let s = rmq_stream::TestStream::new("ex2r");
    let (a, b) = (unique("exa"), unique("exb"));
    db.slots.push(format!("outboxd_{a}"));
    db.slots.push(format!("outboxd_{b}"));
    let run = |name: &str| {
        let args = s.run_args(&db.dsn(), name, &["--snapshot", "never"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Relay::start(&args)
    };
    let mut ra = run(&a);
    db.wait_streaming(&a).await;
    let first = db.write(3, 10, TOPIC).await;
    assert!(s.holds_at_least(first.len(), T).await);
    ra.signal("TERM");
    assert_eq!(ra.wait_exit(T).await, 0, "{}", ra.stderr());
    // Written while `a` is down: `b` starts now and numbers them 1…30, as `a` numbered its 30.
    let mut rb = run(&b);
    db.wait_streaming(&b).await;
    let waiting = db.write(3, 10, TOPIC).await;
    assert!(s.holds_at_least(first.len() + waiting.len(), T).await);
    rb.signal("TERM");
    assert_eq!(rb.wait_exit(T).await, 0, "{}", rb.stderr());
    let mut ra = run(&a);
    let want = first.len() + 2 * waiting.len();
    assert!(
        s.holds_at_least(want, T).await,
        "relay a did not publish the events written while it was down; its stderr:\n{}",
        ra.stderr()
    );
    ra.signal("TERM");
    assert_eq!(ra.wait_exit(T).await, 0, "{}", ra.stderr());
    let held = s.read(want, Duration::from_secs(30)).await;
    let c = counts(&held.iter().map(|m| m.id).collect::<Vec<_>>());
    for id in &first {
        assert_eq!(c.get(id), Some(&1), "an event only relay a saw, once");
    }
    for id in &waiting {
        assert_eq!(
            c.get(id),
            Some(&2),
            "an event written while relay a was down, once from each relay; a's stderr:\n{}",
            ra.stderr()
        );
    }
    assert_eq!(held.len(), want, "nothing else in the stream");
    s.delete(0).await;
}

/// Where a relay named as before reads a database of another server.
async fn another_server() -> PgDb {
    let (_, port) = PG_VERSIONS[1];
    PgDb::create_on(port, "exmove").await
}

/// A relay that published from one database server is started on another (a dump restored
/// elsewhere: another Postgres cluster, whose log positions are lower). Its last record in the
/// broker names the first server: the relay stops with the fix instead of taking that record's
/// position for its own, and with `--accept-new-source` every event of the new server is
/// published.
async fn moved_to_another_server<K: Dedup>() {
    let mut old = PgDb::create("exold").await;
    let sink = K::new("exmove").await;
    let name = unique("exm");
    old.slots.push(format!("outboxd_{name}"));
    let run = |db: &PgDb, extra: &[&str]| {
        let mut args: Vec<String> = ["run", "--source", &db.dsn(), "--name", &name]
            .into_iter()
            .chain(["--snapshot", "never"])
            .chain(extra.iter().copied())
            .map(String::from)
            .collect();
        args.extend(sink.args());
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Relay::start(&args)
    };
    let mut relay = run(&old, &[]);
    old.wait_streaming(&name).await;
    let published = old.write(4, 10, TOPIC).await;
    assert_eq!(sink.ids(published.len()).await.len(), published.len());
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    let mut new = another_server().await;
    new.slots.push(format!("outboxd_{name}"));
    let mut relay = run(&new, &[]);
    new.wait_streaming(&name).await;
    let moved = new.write(5, 5, TOPIC).await;
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "a configuration error (exit 2); stderr:\n{err}");
    assert!(
        err.contains("was read from the source postgres:") && err.contains("--accept-new-source"),
        "the error names the other source and the fix; stderr:\n{err}"
    );
    // Nothing of the new server was taken for held, nor published twice.
    let held = counts(&sink.ids(published.len()).await);
    assert!(moved.iter().all(|id| !held.contains_key(id)));

    let mut relay = run(&new, &["--accept-new-source"]);
    let all = sink.ids(published.len() + moved.len()).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let c = counts(&all);
    for id in published.iter().chain(&moved) {
        assert_eq!(
            c.get(id),
            Some(&1),
            "every event once; stderr:\n{}",
            relay.stderr()
        );
    }
    sink.cleanup().await;
}

mod a_relay_moved_to_another_server_stops_with_the_fix {
    use super::*;
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stream() {
        moved_to_another_server::<Stream>().await
    }
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn kafka() {
        moved_to_another_server::<Kafka>().await
    }
}
