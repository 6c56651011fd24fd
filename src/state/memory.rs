//! An in-memory [`StateStore`] for tests of the lease keeper and the relay in one process. It
//! owns one relay's record — lease (holder, epoch, expiry on the tokio clock), position, first
//! start, snapshot progress — with the rules of the real stores: a new epoch per acquisition,
//! writes only from the current epoch's holder, and a position older than the stored one left
//! out, as the SQL stores and the offset file leave it out (`tests/relay/conformance.rs` holds
//! all of them to that). It also records every position it was asked to store, older ones
//! included, so a test sees a relay that tried to move its position backwards
//! ([`MemoryStoreHandle::positions`]).
//! Renewals fail on request (to drive self-fencing). [`MemoryStore::new`] also returns a
//! handle that shares the record, for inspection while the store is owned by a lease keeper.

use super::{lost, DurableCommit, Lease, StateStore, Stored, LEASE_TTL};
use crate::event::Checkpoint;
use crate::Error;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

#[derive(Debug, Default)]
struct Record {
    name: Option<String>,
    epoch: i64,
    holder: Option<String>,
    expires: Option<Instant>,
    position: Option<Checkpoint>,
    initialized: bool,
    snapshot_key: Option<String>,
    commit: DurableCommit,
    /// Where the stream started (see [`StateStore::record_stream_start`]).
    stream_start: Option<Checkpoint>,
    /// A replay recorded by [`StateStore::restart`], until the first start is marked done.
    replay_since: Option<chrono::DateTime<chrono::Utc>>,
    /// When the record was first acquired (the wall clock: recovery replays from it).
    created_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Every position asked to be stored, in order (snapshot marks and refused older ones
    /// included).
    history: Vec<Checkpoint>,
    fail_renewals: bool,
    /// How long each renewal waits before it is applied (a server whose commits queue).
    slow_renewals: Duration,
    renewals: u64,
    failed_renewals: u64,
    releases: u64,
}

/// The store; clones of its [`MemoryStoreHandle`] see the same record.
pub struct MemoryStore {
    shared: Arc<Mutex<Record>>,
}

/// The test's side of a [`MemoryStore`].
#[derive(Clone)]
pub struct MemoryStoreHandle {
    shared: Arc<Mutex<Record>>,
}

fn lock(s: &Mutex<Record>) -> MutexGuard<'_, Record> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemoryStore {
    pub fn new() -> (MemoryStore, MemoryStoreHandle) {
        let shared = Arc::new(Mutex::new(Record::default()));
        (
            MemoryStore {
                shared: shared.clone(),
            },
            MemoryStoreHandle { shared },
        )
    }

    /// Another store on the same record: what a restarted relay (or a second one) opens.
    pub fn reopen(handle: &MemoryStoreHandle) -> MemoryStore {
        MemoryStore {
            shared: handle.shared.clone(),
        }
    }
}

impl MemoryStoreHandle {
    /// Every renewal fails (a retryable error) until called with `false`.
    pub fn fail_renewals(&self, fail: bool) {
        lock(&self.shared).fail_renewals = fail;
    }

    /// Every renewal takes `delay` before it is applied (zero: at once), as on a server whose
    /// commits wait behind a large transaction's binlog write. A renewal given up before then
    /// applies nothing.
    pub fn slow_renewals(&self, delay: Duration) {
        lock(&self.shared).slow_renewals = delay;
    }

    /// Every position it was asked to store, in order, older ones it kept out included: a
    /// relay that moves its position backwards shows here.
    pub fn positions(&self) -> Vec<Checkpoint> {
        lock(&self.shared).history.clone()
    }

    /// The stored position.
    pub fn position(&self) -> Option<Checkpoint> {
        lock(&self.shared).position.clone()
    }

    pub fn epoch(&self) -> i64 {
        lock(&self.shared).epoch
    }

    /// The lease holder; `None` once released.
    pub fn holder(&self) -> Option<String> {
        lock(&self.shared).holder.clone()
    }

    pub fn initialized(&self) -> bool {
        lock(&self.shared).initialized
    }

    /// The snapshot's recorded progress.
    pub fn snapshot_key(&self) -> Option<String> {
        lock(&self.shared).snapshot_key.clone()
    }

    /// The replay a restart recorded, until the first start is marked done.
    pub fn replay_since(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        lock(&self.shared).replay_since
    }

    /// Renewals attempted, and how many of them failed.
    pub fn renewals(&self) -> (u64, u64) {
        let r = lock(&self.shared);
        (r.renewals, r.failed_renewals)
    }

    pub fn releases(&self) -> u64 {
        lock(&self.shared).releases
    }
}

impl Record {
    /// Whether `lease` is the current one: its epoch and holder.
    fn holds(&self, lease: &Lease) -> bool {
        self.epoch == lease.epoch && self.holder.as_deref() == Some(lease.holder.as_str())
    }

    /// Stores `p` unless it is older than the stored position (or not comparable with it).
    fn store(&mut self, p: &Checkpoint) {
        self.history.push(p.clone());
        if let Checkpoint::Snapshot { key, .. } = p {
            // As in the SQL stores: snapshot progress is its own column, not the position.
            self.snapshot_key = Some(key.clone());
            return;
        }
        if let Some(cur) = &self.position {
            if !matches!(
                cur.compare(p),
                Some(std::cmp::Ordering::Less | std::cmp::Ordering::Equal)
            ) {
                return;
            }
        }
        self.position = Some(p.clone());
    }
}

impl StateStore for MemoryStore {
    async fn acquire(
        &mut self,
        name: &str,
        holder: &str,
    ) -> Result<(Lease, Option<Checkpoint>), Error> {
        let mut r = lock(&self.shared);
        if let Some(owner) = r.name.as_deref().filter(|n| *n != name) {
            return Err(Error::config(
                format!("this memory store holds the state of relay {owner:?}, not {name:?}"),
                "give each relay name its own store",
            ));
        }
        let live = r.expires.is_some_and(|e| e > Instant::now());
        super::take_over(name, r.holder.as_deref(), live, holder)?;
        r.name = Some(name.to_string());
        r.created_at.get_or_insert_with(chrono::Utc::now);
        r.epoch += 1;
        r.holder = Some(holder.to_string());
        r.expires = Some(Instant::now() + LEASE_TTL);
        let lease = Lease {
            name: name.to_string(),
            holder: holder.to_string(),
            epoch: r.epoch,
            first_start: !r.initialized,
            replay_since: r.replay_since,
        };
        Ok((lease, r.position.clone()))
    }

    async fn load(&mut self, name: &str) -> Result<Option<Stored>, Error> {
        let r = lock(&self.shared);
        Ok((r.name.as_deref() == Some(name)).then(|| Stored {
            position: r.position.clone(),
            initialized: r.initialized,
            snapshot_key: r.snapshot_key.clone(),
            commit: r.commit.clone(),
            stream_start: r.stream_start.clone(),
            created_at: r.created_at,
        }))
    }

    async fn renew(
        &mut self,
        lease: &Lease,
        position: Option<&Checkpoint>,
        commit: &DurableCommit,
    ) -> Result<(), Error> {
        let delay = lock(&self.shared).slow_renewals;
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        let mut r = lock(&self.shared);
        r.renewals += 1;
        if r.fail_renewals {
            r.failed_renewals += 1;
            return Err(Error::source("injected renewal failure", true));
        }
        if !r.holds(lease) {
            return Err(lost(lease));
        }
        r.expires = Some(Instant::now() + LEASE_TTL);
        if let Some(p) = position {
            r.store(p);
        }
        // Like the SQL stores: commit time and gap only grow.
        r.commit.commit_at = r.commit.commit_at.max(commit.commit_at);
        r.commit.max_gap_ms = r.commit.max_gap_ms.max(commit.max_gap_ms);
        Ok(())
    }

    async fn store_start(
        &mut self,
        lease: &Lease,
        start: &Checkpoint,
        done: bool,
    ) -> Result<(), Error> {
        let mut r = lock(&self.shared);
        if !r.holds(lease) {
            return Err(lost(lease));
        }
        // A restarted first start keeps the position its first run stored.
        if r.position.is_none() {
            r.store(start);
        }
        r.initialized |= done;
        Ok(())
    }

    async fn mark_initialized(&mut self, lease: &Lease) -> Result<(), Error> {
        let mut r = lock(&self.shared);
        if !r.holds(lease) {
            return Err(lost(lease));
        }
        r.initialized = true;
        r.snapshot_key = None;
        r.replay_since = None;
        Ok(())
    }

    async fn record_stream_start(
        &mut self,
        lease: &Lease,
        at: &Checkpoint,
        created: bool,
    ) -> Result<(), Error> {
        let mut r = lock(&self.shared);
        if !r.holds(lease) {
            return Err(lost(lease));
        }
        if created || r.stream_start.is_none() {
            r.stream_start = Some(at.clone());
        }
        Ok(())
    }

    async fn restart(
        &mut self,
        lease: &Lease,
        replay_since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<(), Error> {
        let mut r = lock(&self.shared);
        if !r.holds(lease) {
            return Err(lost(lease));
        }
        r.position = None;
        r.snapshot_key = None;
        r.stream_start = None;
        match replay_since {
            Some(since) => r.replay_since = Some(since),
            // As the Postgres store: only a first start is begun again without a replay.
            None => r.initialized = false,
        }
        Ok(())
    }

    async fn replace_position(&mut self, lease: &Lease, marker: &Checkpoint) -> Result<(), Error> {
        let mut r = lock(&self.shared);
        if !r.holds(lease) {
            return Err(lost(lease));
        }
        r.history.push(marker.clone());
        r.position = Some(marker.clone());
        Ok(())
    }

    async fn release(&mut self, lease: &Lease) -> Result<(), Error> {
        let mut r = lock(&self.shared);
        if r.holds(lease) {
            r.holder = None;
            r.expires = None;
            r.releases += 1;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn commit() -> DurableCommit {
        DurableCommit::default()
    }

    #[tokio::test(start_paused = true)]
    async fn leases_epochs_and_positions_follow_the_real_stores_rules() {
        let (mut a, h) = MemoryStore::new();
        let (lease, at) = a.acquire("r1", "a").await.unwrap();
        assert_eq!((lease.epoch, lease.first_start, at), (1, true, None));
        // Held and live: refused; another name: refused.
        let mut b = MemoryStore::reopen(&h);
        assert!(matches!(
            b.acquire("r1", "b").await,
            Err(Error::LeaseHeld(_))
        ));
        assert!(matches!(
            b.acquire("r2", "b").await,
            Err(Error::Config { .. })
        ));
        a.store_start(&lease, &Checkpoint::Lsn(10), false)
            .await
            .unwrap();
        a.renew(&lease, Some(&Checkpoint::Lsn(20)), &commit())
            .await
            .unwrap();
        a.mark_initialized(&lease).await.unwrap();
        assert_eq!(h.positions(), [Checkpoint::Lsn(10), Checkpoint::Lsn(20)]);
        // Expired (no renewal for the lease's TTL): taken over, and the old epoch is refused.
        tokio::time::advance(LEASE_TTL).await;
        let (lease_b, at) = b.acquire("r1", "b").await.unwrap();
        assert_eq!((lease_b.epoch, lease_b.first_start), (2, false));
        assert_eq!(at, Some(Checkpoint::Lsn(20)));
        assert!(matches!(
            a.renew(&lease, Some(&Checkpoint::Lsn(30)), &commit()).await,
            Err(Error::Leadership(_))
        ));
        assert_eq!(h.position(), Some(Checkpoint::Lsn(20)));
        // Injected failures are counted and store nothing.
        h.fail_renewals(true);
        assert!(b
            .renew(&lease_b, Some(&Checkpoint::Lsn(40)), &commit())
            .await
            .is_err());
        h.fail_renewals(false);
        b.renew(&lease_b, Some(&Checkpoint::Lsn(50)), &commit())
            .await
            .unwrap();
        assert_eq!(h.renewals(), (4, 1));
        assert_eq!(h.position(), Some(Checkpoint::Lsn(50)));
        b.release(&lease_b).await.unwrap();
        assert_eq!((h.holder(), h.releases()), (None, 1));
        let stored = b.load("r1").await.unwrap().unwrap();
        assert!(stored.initialized);
        assert_eq!(stored.position, Some(Checkpoint::Lsn(50)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_live_lease_is_taken_over_only_from_a_provably_dead_local_holder() {
        // This process's holder id, `host:pid:nonce:boot=…:pidns=…`, with another PID (above
        // any `pid_max`: no process has it).
        let me = crate::state::holder_id();
        let f: Vec<&str> = me.rsplitn(5, ':').collect();
        let (pidns, boot, host) = (f[0], f[1], f[4]);
        let gone = 4_194_399;
        let cases = [
            (format!("{host}:{gone}:n:{boot}:{pidns}"), true),
            // The same PID in another PID namespace, on another boot, or written by the
            // previous version (`host:pid:nonce`): nothing is proved, the live lease holds.
            (format!("{host}:{gone}:n:{boot}:pidns=1"), false),
            (format!("{host}:{gone}:n:boot=another-boot:{pidns}"), false),
            (format!("{host}:{gone}:abcd1234"), false),
        ];
        for (holder, taken) in cases {
            let (mut a, h) = MemoryStore::new();
            a.acquire("r1", &holder).await.unwrap();
            let mut b = MemoryStore::reopen(&h);
            let got = b.acquire("r1", &me).await;
            assert_eq!(got.is_ok(), taken, "{holder}: {got:?}");
            if !taken {
                assert!(matches!(got, Err(Error::LeaseHeld(_))), "{got:?}");
                assert_eq!(h.holder(), Some(holder));
            }
        }
    }

    #[tokio::test]
    async fn a_backwards_store_is_kept_out_and_shows() {
        let (mut s, h) = MemoryStore::new();
        let (lease, _) = s.acquire("r1", "a").await.unwrap();
        s.renew(&lease, Some(&Checkpoint::Lsn(20)), &commit())
            .await
            .unwrap();
        let _ = s.renew(&lease, Some(&Checkpoint::Lsn(19)), &commit()).await;
        assert_eq!(h.position(), Some(Checkpoint::Lsn(20)));
        assert_eq!(h.positions(), [Checkpoint::Lsn(20), Checkpoint::Lsn(19)]);
    }
}
