//! The `StateStore` conformance suite: every store — `outboxd_state` on Postgres and on
//! MariaDB, the offset file, and the in-memory double the relay's in-process tests use — held
//! to one contract, so the double cannot drift from the real stores:
//!
//! - a first acquire takes epoch ≥ 1 for its holder, a first start, no position;
//! - a live lease is refused to another holder (`LeaseHeld`); released, it is taken with the
//!   next epoch and the stored position;
//! - a stored position never moves backwards: an older one leaves the newer in place;
//! - a holder that provably no longer exists is taken over at once, with the next epoch, and
//!   (where the old store can outlive its lease) the old lease's writes are refused;
//! - a finished first start is on record for the next acquire;
//! - a restart forgets the position, the snapshot's progress and the stream start (a fresh
//!   stream's lower positions are stored next; the next start is a first start), and records a
//!   requested replay where the store
//!   keeps one (refused where it does not) until the first start is marked done;
//! - a position replaced by a marker may move backwards, but only under the current lease;
//! - a stream start is recorded where the store keeps one: kept, unless the stream was just
//!   created.
//!
//! A new store is one `impl Kind` and one line in the list of tests at the end.

use crate::common::*;
use outboxd::dsn::{DbDsn, SourceDsn};
use outboxd::state::file::FileStore;
use outboxd::state::mysql::MyStateStore;
use outboxd::state::postgres::PgStateStore;
use outboxd::state::{holder_id, DurableCommit};
use outboxd::{Checkpoint, Error, MemoryStore, MemoryStoreHandle, StateStore};
use std::collections::HashMap;
use std::sync::Mutex;

/// How the previous holder of a lease goes away before another process takes it over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fencing {
    /// By epoch and holder: the old store lives on, and its writes are refused.
    Epoch,
    /// By a lock the holder's process owns (an offset file's `flock`): while the old store
    /// exists nobody else gets in, and it is gone (its process died) before a takeover.
    Lock,
}

/// One `StateStore` implementation on its backend.
trait Kind {
    type Store: StateStore;
    /// A store for relay `name` (each call a new one: another process's view).
    async fn open(&self, name: &str) -> Self::Store;
    /// The `i`-th position of this store's source, in order.
    fn position(&self, i: u64) -> Checkpoint;
    fn fencing(&self) -> Fencing;
    /// Whether the store keeps a replay and a stream start (a Postgres source's records; a
    /// binlog source's recovery needs neither).
    fn keeps_replay(&self) -> bool {
        false
    }
}

fn db_dsn(dsn: &str) -> DbDsn {
    match SourceDsn::parse(dsn).expect("test DSN") {
        SourceDsn::Postgres(d) | SourceDsn::Mysql(d) => d,
        SourceDsn::File(_) => unreachable!("a database DSN"),
    }
}

fn binlog(i: u64) -> Checkpoint {
    Checkpoint::Binlog {
        file: "mariadb-bin.000007".into(),
        pos: 4 + 100 * i,
        gtid_state: None,
    }
}

struct Postgres(PgDb);

impl Kind for Postgres {
    type Store = PgStateStore;
    async fn open(&self, _name: &str) -> PgStateStore {
        PgStateStore::new(db_dsn(&self.0.dsn()), "outboxd_conformance".into())
            .with_slot("conformance_slot")
            .with_publication("conformance_pub")
    }
    fn position(&self, i: u64) -> Checkpoint {
        Checkpoint::Lsn(0x1_0000 + 0x100 * i)
    }
    fn fencing(&self) -> Fencing {
        Fencing::Epoch
    }
    fn keeps_replay(&self) -> bool {
        true
    }
}

struct Mariadb(MyDb);

impl Kind for Mariadb {
    type Store = MyStateStore;
    async fn open(&self, _name: &str) -> MyStateStore {
        MyStateStore::new(db_dsn(&self.0.dsn()))
    }
    fn position(&self, i: u64) -> Checkpoint {
        binlog(i)
    }
    fn fencing(&self) -> Fencing {
        Fencing::Epoch
    }
}

struct OffsetFile(tempfile::TempDir);

impl Kind for OffsetFile {
    type Store = FileStore;
    async fn open(&self, name: &str) -> FileStore {
        FileStore::open(&self.0.path().join(format!("{name}.offset")))
    }
    fn position(&self, i: u64) -> Checkpoint {
        binlog(i)
    }
    fn fencing(&self) -> Fencing {
        Fencing::Lock
    }
}

/// One record per relay name, as the databases keep one row per name.
#[derive(Default)]
struct Memory(Mutex<HashMap<String, MemoryStoreHandle>>);

impl Kind for Memory {
    type Store = MemoryStore;
    async fn open(&self, name: &str) -> MemoryStore {
        let mut records = self.0.lock().unwrap();
        match records.get(name) {
            Some(h) => MemoryStore::reopen(h),
            None => {
                let (store, handle) = MemoryStore::new();
                records.insert(name.to_string(), handle);
                store
            }
        }
    }
    fn position(&self, i: u64) -> Checkpoint {
        binlog(i)
    }
    fn fencing(&self) -> Fencing {
        Fencing::Epoch
    }
    // The double models every store: it keeps what the Postgres one keeps.
    fn keeps_replay(&self) -> bool {
        true
    }
}

const NO_COMMIT: DurableCommit = DurableCommit {
    commit_at: None,
    max_gap_ms: None,
};

async fn stored_position<S: StateStore>(s: &mut S, name: &str) -> Option<Checkpoint> {
    s.load(name)
        .await
        .expect("load")
        .expect("a record after the first acquire")
        .position
}

/// The holder id of a process of this machine that has exited: provably gone.
fn dead_holder() -> String {
    let mut child = std::process::Command::new("true")
        .spawn()
        .expect("spawn true");
    let pid = child.id();
    child.wait().expect("wait for true");
    // host:pid:nonce:boot=…:pidns=… with the exited child's PID.
    let live = holder_id();
    let mut parts: Vec<&str> = live.splitn(3, ':').collect();
    let pid = pid.to_string();
    parts[1] = &pid;
    parts.join(":")
}

async fn first_acquire_and_never_backwards<K: Kind>(kind: &K) {
    let name = unique("conf_first");
    let mut s = kind.open(&name).await;
    let (lease, at) = s.acquire(&name, &holder_id()).await.expect("first acquire");
    assert!(
        lease.epoch >= 1,
        "a first acquire takes epoch ≥ 1: {lease:?}"
    );
    assert!(
        lease.first_start,
        "a new record is a first start: {lease:?}"
    );
    assert_eq!(at, None, "a new record holds no position");
    assert_eq!(stored_position(&mut s, &name).await, None);

    for i in [1, 3] {
        s.renew(&lease, Some(&kind.position(i)), &NO_COMMIT)
            .await
            .expect("renew with a newer position");
        assert_eq!(stored_position(&mut s, &name).await, Some(kind.position(i)));
    }
    // An older position: refused or ignored, never stored over the newer one.
    let _ = s.renew(&lease, Some(&kind.position(2)), &NO_COMMIT).await;
    assert_eq!(
        stored_position(&mut s, &name).await,
        Some(kind.position(3)),
        "an older position moved the stored one backwards"
    );
    // A renewal without a position keeps it.
    s.renew(&lease, None, &NO_COMMIT).await.expect("renew");
    assert_eq!(stored_position(&mut s, &name).await, Some(kind.position(3)));
    s.release(&lease).await.expect("release");
}

async fn live_lease_refused_then_released<K: Kind>(kind: &K) {
    let name = unique("conf_held");
    let mut a = kind.open(&name).await;
    let (first, _) = a.acquire(&name, &holder_id()).await.expect("acquire");
    a.renew(&first, Some(&kind.position(1)), &NO_COMMIT)
        .await
        .expect("renew");

    let mut b = kind.open(&name).await;
    match b.acquire(&name, &holder_id()).await {
        Err(Error::LeaseHeld(_)) => {}
        other => panic!("a live lease must be refused to another holder: {other:?}"),
    }

    a.release(&first).await.expect("release");
    let (second, at) = b
        .acquire(&name, &holder_id())
        .await
        .expect("a released lease is free");
    assert_eq!(
        second.epoch,
        first.epoch + 1,
        "each acquire takes the next epoch"
    );
    assert_eq!(
        at,
        Some(kind.position(1)),
        "the position outlives the lease"
    );
    b.release(&second).await.expect("release");
}

async fn dead_holder_taken_over<K: Kind>(kind: &K) {
    let name = unique("conf_takeover");
    let mut a = kind.open(&name).await;
    let (old, _) = a.acquire(&name, &dead_holder()).await.expect("acquire");
    a.renew(&old, Some(&kind.position(1)), &NO_COMMIT)
        .await
        .expect("renew");
    // With a lock, the holder's process is gone, and so is its lock; by epoch, its store
    // lives on and tries to write.
    let mut survivor = match kind.fencing() {
        Fencing::Lock => {
            drop(a);
            None
        }
        Fencing::Epoch => Some(a),
    };

    let mut b = kind.open(&name).await;
    let (new, at) = b
        .acquire(&name, &holder_id())
        .await
        .expect("a lease whose holder provably no longer exists is taken over at once");
    assert_eq!(new.epoch, old.epoch + 1, "a takeover takes the next epoch");
    assert_eq!(
        at,
        Some(kind.position(1)),
        "the takeover resumes from the stored position"
    );

    if let Some(a) = survivor.as_mut() {
        match a.renew(&old, Some(&kind.position(5)), &NO_COMMIT).await {
            Err(Error::Leadership(_)) => {}
            other => panic!("the superseded lease's renewal must fail with Leadership: {other:?}"),
        }
        assert_eq!(
            stored_position(&mut b, &name).await,
            Some(kind.position(1)),
            "the superseded holder's position was stored"
        );
    }
    b.renew(&new, Some(&kind.position(2)), &NO_COMMIT)
        .await
        .expect("the new holder renews");
    assert_eq!(stored_position(&mut b, &name).await, Some(kind.position(2)));
    b.release(&new).await.expect("release");
}

async fn first_start_recorded<K: Kind>(kind: &K) {
    let name = unique("conf_init");
    let mut s = kind.open(&name).await;
    let (lease, _) = s.acquire(&name, &holder_id()).await.expect("acquire");
    assert!(lease.first_start);
    // A first start stores where it streams from before it publishes, then marks itself done
    // once its snapshot is durable. (Postgres keeps that position in its slot: its store need
    // not store it, and its row holds none until the first renewal.)
    s.store_start(&lease, &kind.position(1), false)
        .await
        .expect("store_start");
    s.renew(&lease, Some(&kind.position(1)), &NO_COMMIT)
        .await
        .expect("renew");
    s.mark_initialized(&lease).await.expect("mark_initialized");
    assert!(
        s.load(&name)
            .await
            .expect("load")
            .expect("record")
            .initialized
    );
    s.release(&lease).await.expect("release");

    let mut again = kind.open(&name).await;
    let (next, _) = again.acquire(&name, &holder_id()).await.expect("acquire");
    assert!(
        !next.first_start,
        "a finished first start is on record: {next:?}"
    );
    again.release(&next).await.expect("release");
}

async fn restart_forgets_the_position<K: Kind>(kind: &K) {
    let name = unique("conf_restart");
    let mut s = kind.open(&name).await;
    let (mut lease, _) = s.acquire(&name, &holder_id()).await.expect("acquire");
    s.store_start(&lease, &kind.position(2), true)
        .await
        .expect("store_start");
    s.renew(&lease, Some(&kind.position(3)), &NO_COMMIT)
        .await
        .expect("renew");
    s.restart(&lease, None).await.expect("restart");
    let stored = s.load(&name).await.expect("load").expect("record");
    assert_eq!(
        (&stored.position, &stored.snapshot_key, &stored.stream_start),
        (&None, &None, &None)
    );
    // Begun again, the next start is a first start (Postgres: it never was done).
    assert!(!stored.initialized, "{stored:?}");
    // The fresh stream's positions may sort below the forgotten one.
    s.renew(&lease, Some(&kind.position(1)), &NO_COMMIT)
        .await
        .expect("renew");
    assert_eq!(stored_position(&mut s, &name).await, Some(kind.position(1)));

    // A lost position's recovery records its replay, where the store keeps one.
    let since = chrono::DateTime::from_timestamp(1_700_000_000, 0).unwrap();
    let replay = s.restart(&lease, Some(since)).await;
    if !kind.keeps_replay() {
        assert!(replay.is_err(), "a replay it cannot keep is refused");
        s.release(&lease).await.expect("release");
        return;
    }
    replay.expect("restart with a replay");
    s.release(&lease).await.expect("release");
    let mut again = kind.open(&name).await;
    (lease, _) = again.acquire(&name, &holder_id()).await.expect("acquire");
    assert_eq!(lease.replay_since, Some(since), "the replay is on record");
    again
        .mark_initialized(&lease)
        .await
        .expect("mark_initialized");
    again.release(&lease).await.expect("release");
    let mut last = kind.open(&name).await;
    let (lease, _) = last.acquire(&name, &holder_id()).await.expect("acquire");
    assert_eq!(lease.replay_since, None, "a durable replay is done");
    last.release(&lease).await.expect("release");
}

async fn replaced_position_moves_backwards<K: Kind>(kind: &K) {
    let name = unique("conf_replace");
    let mut s = kind.open(&name).await;
    let (lease, _) = s.acquire(&name, &holder_id()).await.expect("acquire");
    s.store_start(&lease, &kind.position(2), true)
        .await
        .expect("store_start");
    s.renew(&lease, Some(&kind.position(3)), &NO_COMMIT)
        .await
        .expect("renew");
    s.replace_position(&lease, &kind.position(0))
        .await
        .expect("replace_position");
    assert_eq!(stored_position(&mut s, &name).await, Some(kind.position(0)));
    if kind.fencing() == Fencing::Epoch {
        // Taken over (a dead holder's lease): the old lease replaces nothing.
        s.release(&lease).await.expect("release");
        let mut b = kind.open(&name).await;
        let (new, _) = b.acquire(&name, &holder_id()).await.expect("acquire");
        let stale = s.replace_position(&lease, &kind.position(5)).await;
        assert!(matches!(stale, Err(Error::Leadership(_))), "{stale:?}");
        assert_eq!(stored_position(&mut b, &name).await, Some(kind.position(0)));
        b.release(&new).await.expect("release");
    } else {
        s.release(&lease).await.expect("release");
    }
}

async fn stream_start_recorded<K: Kind>(kind: &K) {
    let name = unique("conf_stream");
    let mut s = kind.open(&name).await;
    let (lease, _) = s.acquire(&name, &holder_id()).await.expect("acquire");
    let start = |s: Option<outboxd::Stored>| s.expect("record").stream_start;
    s.record_stream_start(&lease, &kind.position(1), false)
        .await
        .expect("record_stream_start");
    s.record_stream_start(&lease, &kind.position(2), false)
        .await
        .expect("record_stream_start");
    let kept = kind.keeps_replay().then(|| kind.position(1));
    assert_eq!(
        start(s.load(&name).await.expect("load")),
        kept,
        "the first one is kept"
    );
    s.record_stream_start(&lease, &kind.position(3), true)
        .await
        .expect("record_stream_start");
    let created = kind.keeps_replay().then(|| kind.position(3));
    assert_eq!(
        start(s.load(&name).await.expect("load")),
        created,
        "a new stream replaces it"
    );
    s.release(&lease).await.expect("release");
}

async fn state_store_suite<K: Kind>(kind: K) {
    first_acquire_and_never_backwards(&kind).await;
    live_lease_refused_then_released(&kind).await;
    dead_holder_taken_over(&kind).await;
    first_start_recorded(&kind).await;
    restart_forgets_the_position(&kind).await;
    replaced_position_moves_backwards(&kind).await;
    stream_start_recorded(&kind).await;
}

// One line per store.
#[tokio::test]
async fn state_store_conformance_postgres() {
    state_store_suite(Postgres(PgDb::create("conf_state").await)).await;
}
#[tokio::test]
async fn state_store_conformance_mariadb() {
    state_store_suite(Mariadb(MyDb::create("conf_state").await)).await;
}
#[tokio::test]
async fn state_store_conformance_offset_file() {
    state_store_suite(OffsetFile(tempfile::tempdir().unwrap())).await;
}
#[tokio::test]
async fn state_store_conformance_memory() {
    state_store_suite(Memory::default()).await;
}
