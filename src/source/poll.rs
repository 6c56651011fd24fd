//! Poll mode (the classic polling relay), for databases where the log cannot be read: one short
//! READ COMMITTED transaction per batch — claim pending rows with `FOR UPDATE SKIP LOCKED`,
//! hand them to the sink, wait until every one is confirmed, mark them published, commit.
//! Batches overlap on [`SESSIONS`] sessions: while one awaits its confirms, the next is
//! claimed (skipping the first one's locked rows) and handed over, so the broker's pipeline
//! never drains between batches; and a confirmed batch is marked and committed while the next
//! is claimed, so the database's round trips for one batch overlap each other's too.
//! Publish first, mark second: a crash between the two gives a duplicate, never a loss.
//! Several relays on one table take disjoint batches; they need no lease. Rows are claimed in
//! `(created_at, seq)` order (`id` without `seq`), so a transaction's rows keep their insert
//! order. A lost database session is replaced (reconnect with backoff; the rows it held are
//! claimed again), and a batch released at its deadline makes the next claims smaller and wait
//! for the relay to catch up, so a slow broker still sees progress. The loop is one for
//! both databases ([`run`]); each database supplies its statements through [`PollTable`]
//! (Postgres in `source::postgres::poll`, MySQL/MariaDB in `source::mysql::poll`).

use crate::backoff::Backoff;
use crate::event::{Checkpoint, OutboxEvent};
use crate::source::{Outlet, SourceLink};
use crate::telemetry::events::{InternalEvent, SourceKind, SourceReconnecting, SourceRunning};
use crate::Error;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// The command line's poll settings.
#[derive(Debug, Clone)]
pub struct PollOptions {
    pub batch: i64,
    pub interval: Duration,
    pub notify: bool,
}

impl PollOptions {
    pub(crate) fn loop_config(&self, deadline: Duration) -> LoopConfig {
        LoopConfig {
            batch: self.batch,
            interval: self.interval,
            deadline,
        }
    }
}

/// What the loop needs to know, whatever the database.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    pub batch: i64,
    pub interval: Duration,
    /// Longest a batch's transaction may stay open (handing rows over and waiting for their
    /// confirms); shorter than the server's lock timeouts, so a slow broker never holds rows
    /// (or producers) for long.
    pub deadline: Duration,
}

/// One database's side of the poll loop: a session that runs one short transaction per batch.
/// A failed call leaves the session unusable: the loop drops every session and, for an error
/// a new session may not meet, opens new ones (see [`run`]); otherwise it stops with the error.
pub trait PollTable: Send {
    /// How a claimed row is named again when it is marked.
    type Id: Send + Sync;
    /// Whose log lines and reconnects these are.
    const SOURCE: SourceKind;

    /// Opens a READ COMMITTED transaction whose locks and idleness the server bounds.
    fn begin(&mut self) -> impl Future<Output = Result<(), Error>> + Send;
    /// Claims up to `limit` pending rows, oldest first, skipping rows other relays hold; each
    /// mapped to the event it publishes.
    fn claim(
        &mut self,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<(Self::Id, OutboxEvent)>, Error>> + Send;
    /// Marks the claimed rows published.
    fn mark(&mut self, ids: &[Self::Id]) -> impl Future<Output = Result<(), Error>> + Send;
    fn commit(&mut self) -> impl Future<Output = Result<(), Error>> + Send;
    fn rollback(&mut self) -> impl Future<Output = Result<(), Error>> + Send;

    /// [`begin`](Self::begin), then [`claim`](Self::claim); a database whose client pipelines
    /// sends both at once (one round trip instead of two).
    fn begin_and_claim(
        &mut self,
        limit: i64,
    ) -> impl Future<Output = Result<Vec<(Self::Id, OutboxEvent)>, Error>> + Send {
        async move {
            self.begin().await?;
            self.claim(limit).await
        }
    }

    /// [`mark`](Self::mark), then [`commit`](Self::commit); pipelined where the client can.
    /// A failed mark fails the commit as well (the server rolls the transaction back), so the
    /// rows stay pending.
    fn mark_and_commit(
        &mut self,
        ids: &[Self::Id],
    ) -> impl Future<Output = Result<(), Error>> + Send {
        async move {
            self.mark(ids).await?;
            self.commit().await
        }
    }
}

/// Sessions the loop keeps: while one batch's rows await their confirms (its transaction open,
/// its rows locked), the next session claims the following batch (`SKIP LOCKED` passes over
/// the locked rows) and hands it over, so the broker is never idle waiting for a mark and a
/// commit. Three: one batch being marked and committed, one in the broker's pipeline, one being
/// claimed. Measured on a shared 2-core host (docs/benchmarks.md): a fourth drained no faster.
pub const SESSIONS: usize = 3;

/// A batch handed over and not yet marked: its session, its rows, and when its transaction
/// must end.
struct InFlight<D: PollTable> {
    db: D,
    batch: u64,
    ids: Vec<D::Id>,
    deadline: tokio::time::Instant,
}

/// Waits until the relay says batch `batch` (and so every earlier one) is confirmed; `false`
/// when the relay ended.
async fn confirmed(acks: &mut watch::Receiver<Option<Checkpoint>>, batch: u64) -> bool {
    loop {
        if let Some(Checkpoint::Batch(b)) = &*acks.borrow_and_update() {
            if *b >= batch {
                return true;
            }
        }
        if acks.changed().await.is_err() {
            return false;
        }
    }
}

/// Runs the poll loop until `shutdown`; the batches in flight are finished first. `wake`
/// ticks when rows may have arrived before the interval is over (Postgres NOTIFY).
///
/// A database error that a new session may not meet (a connection cut or reset, a session the
/// server ended, the server restarting: [`Error::is_retryable`]) does not end the loop: every
/// session is dropped (the server rolls their open batches back, so those rows stay pending
/// and are claimed again: duplicates of what was already handed over, never a loss), and
/// after a backoff ([`Backoff::standard`], reset once a new session has claimed) `reopen`
/// opens a new set. Each reconnect is logged and counted like the log sources' reconnects
/// ([`SourceReconnecting`]). Any other error ends the loop with it.
pub async fn run<D, R, F>(
    dbs: Vec<D>,
    mut reopen: R,
    cfg: LoopConfig,
    mut wake: watch::Receiver<u64>,
    link: SourceLink,
    shutdown: CancellationToken,
) -> Result<(), Error>
where
    D: PollTable,
    R: FnMut() -> F + Send,
    F: Future<Output = Result<Vec<D>, Error>> + Send,
{
    let SourceLink { outlet, mut acks } = link;
    let mut state = LoopState {
        // Batch numbers rise across reconnects: the relay may still acknowledge a batch of the
        // sessions that were lost, and that must never confirm a batch claimed after them.
        batch_no: 0,
        waking: true,
        limit: BatchLimit(AtomicI64::new(cfg.batch)),
    };
    let mut backoff = Backoff::standard();
    let mut dbs = dbs;
    loop {
        let claimed = AtomicBool::new(false);
        let err = match sessions(
            dbs, &cfg, &mut wake, &outlet, &mut acks, &shutdown, &mut state, &claimed,
        )
        .await
        {
            Ok(()) => return Ok(()),
            Err(e) if e.is_retryable() => e,
            Err(e) => return Err(e),
        };
        if claimed.load(Ordering::Relaxed) {
            backoff.reset();
        }
        let mut err = err;
        dbs = loop {
            let d = backoff.next_delay();
            SourceReconnecting {
                source: D::SOURCE,
                message: "poll session failed; reconnecting (rows of the batches in flight stay pending and are claimed again)",
                error: Some(&err),
                timeout: None,
                retry_in: Some(d),
            }
            .emit();
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(d) => {}
            }
            // The relay ended meanwhile (it says why): nothing more to poll for.
            if acks.has_changed().is_err() {
                return Ok(());
            }
            match reopen().await {
                Ok(dbs) => break dbs,
                Err(e) if e.is_retryable() => err = e,
                Err(e) => return Err(e),
            }
        };
        SourceRunning.emit();
    }
}

/// What outlives one set of sessions.
struct LoopState {
    /// The last batch number handed to the relay.
    batch_no: u64,
    /// Whether the wake channel is still open (a closed one leaves the interval).
    waking: bool,
    /// Rows the next claim asks for: `--poll-batch`, halved after each batch released at its
    /// deadline, doubled again (up to `--poll-batch`) after each batch confirmed quickly (see
    /// the finisher). A broker (or relay) that cannot confirm a full batch in time would
    /// otherwise see the same batch released and claimed again, at the same size, forever:
    /// every released batch's events stay queued ahead of the next one's, so none is ever
    /// confirmed in time and no row is ever marked. Smaller batches are confirmed within the
    /// deadline once the queue ahead of them drains.
    limit: BatchLimit,
}

/// The rows the next claim asks for (see [`LoopState::limit`]); both halves of the loop
/// adjust it.
struct BatchLimit(AtomicI64);

impl BatchLimit {
    fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }

    /// A batch of `rows` was released at its deadline: the next claims ask for half as many
    /// (at least one). Several batches released in a row, all claimed at one size, halve it
    /// once. Returns the new limit.
    fn shrink(&self, rows: usize) -> i64 {
        let half = (rows as i64 / 2).max(1);
        let before = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| Some(l.min(half)))
            .unwrap_or(half);
        before.min(half)
    }

    /// A batch was confirmed with time to spare: the next claims may ask for twice as many,
    /// up to `max`.
    fn grow(&self, max: i64) {
        let _ = self
            .0
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
                Some(l.saturating_mul(2).min(max))
            });
    }
}

/// The poll loop on one set of sessions, until `shutdown`, the relay's end, or an error of a
/// session (which ends them all). `claimed` is set once a claim went through.
///
/// Each session in `dbs` carries at most one batch. Two halves run side by side: the claimer
/// claims a batch on a free session and hands it over, each batch only once the previous one is
/// wholly handed over, so the relay sees the rows in claim order; the finisher waits for the
/// oldest batch's confirms, then marks and commits it, batch after batch in claim order, and
/// frees its session. While one batch is marked and committed, the next is claimed on another
/// session: the database's work for one batch overlaps the broker's for the others.
#[allow(clippy::too_many_arguments)]
async fn sessions<D: PollTable>(
    dbs: Vec<D>,
    cfg: &LoopConfig,
    wake: &mut watch::Receiver<u64>,
    outlet: &Outlet,
    acks: &mut watch::Receiver<Option<Checkpoint>>,
    shutdown: &CancellationToken,
    state: &mut LoopState,
    claimed: &AtomicBool,
) -> Result<(), Error> {
    let sessions = dbs.len().max(1);
    // Every session is in exactly one place: free, with the claimer, in flight or with the
    // finisher; so neither channel ever holds more than `sessions` and no send waits.
    let (free_tx, mut free) = mpsc::channel::<D>(sessions);
    for db in dbs {
        let _ = free_tx.try_send(db);
    }
    let (flight_tx, flight) = mpsc::channel::<InFlight<D>>(sessions);
    // Cancelled by the finisher when the relay ended: the claimer then stops at once (rows it
    // holds stay pending when its sessions close).
    let ended = CancellationToken::new();
    let LoopState {
        batch_no,
        waking,
        limit,
    } = state;
    let limit: &BatchLimit = limit;
    // Set when a batch is released at its deadline; the claimer then lets the relay confirm
    // everything already handed over before it claims again (see the claimer).
    let released = AtomicBool::new(false);
    let released = &released;
    let mut drain_acks = acks.clone();

    let claimer = {
        let free_tx = free_tx.clone();
        let ended = ended.clone();
        async move {
            // The last claim was full: there may be more to claim at once.
            let mut more = true;
            // The last batch wholly handed over (its checkpoint sent).
            let mut last_handed = *batch_no;
            loop {
                if !more {
                    // The last claim was short: wait for the interval or a wake.
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = ended.cancelled() => break,
                        _ = tokio::time::sleep(cfg.interval) => {}
                        // A closed wake channel (no NOTIFY, or its session ended) leaves the
                        // interval.
                        r = wake.changed(), if *waking => *waking = r.is_ok(),
                    }
                }
                let mut db = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = ended.cancelled() => break,
                    db = free.recv() => match db {
                        Some(db) => db,
                        None => break,
                    },
                };
                // A batch was released at its deadline: its events, and those of every batch
                // handed over before it, are still queued in the relay (they are published
                // anyway). A batch claimed now would wait behind all of them and time out in
                // turn, adding its own events to the queue: with a slow broker no batch would
                // ever be confirmed in time. So the claimer waits, holding no rows, until the
                // relay has confirmed what was handed over; the next claim (smaller, see
                // `BatchLimit`) then has the broker to itself. Checked once a session is free:
                // the release that frees it sets the flag first.
                if released.swap(false, Ordering::Relaxed) && last_handed > 0 {
                    tracing::info!(
                        batch = last_handed,
                        next_batch = limit.get(),
                        "a batch was released at its deadline: claiming again once the relay has confirmed what was handed over"
                    );
                    tokio::select! {
                        _ = shutdown.cancelled() => break,
                        _ = ended.cancelled() => break,
                        ok = confirmed(&mut drain_acks, last_handed) => if !ok { break },
                    }
                }
                let deadline = tokio::time::Instant::now() + cfg.deadline;
                let want = limit.get();
                let rows = db.begin_and_claim(want).await?;
                claimed.store(true, Ordering::Relaxed);
                let n = rows.len();
                more = n as i64 >= want;
                if n == 0 {
                    db.commit().await?;
                    let _ = free_tx.try_send(db);
                    continue;
                }
                *batch_no += 1;
                let batch = *batch_no;
                let mut ids = Vec::with_capacity(n);
                let hand_over = async {
                    for (i, (id, mut event)) in rows.into_iter().enumerate() {
                        event.position = crate::event::SourcePosition::Poll {
                            batch,
                            index: i as u32,
                        };
                        ids.push(id);
                        outlet.send_event(event).await?;
                    }
                    outlet.send_checkpoint(Checkpoint::Batch(batch)).await
                };
                // The handing over counts against the transaction's deadline: a sink that takes
                // nothing must not keep the transaction open either.
                let handed = tokio::select! {
                    // The relay ended (and says why); its outlet may be closed already.
                    _ = ended.cancelled() => break,
                    r = tokio::time::timeout_at(deadline, hand_over) => r,
                };
                match handed {
                    Ok(Ok(())) => {
                        last_handed = batch;
                        let _ = flight_tx
                            .send(InFlight {
                                db,
                                batch,
                                ids,
                                deadline,
                            })
                            .await;
                    }
                    Ok(Err(e)) => return Err(e),
                    Err(_) => {
                        let next = limit.shrink(n);
                        released.store(true, Ordering::Relaxed);
                        tracing::warn!(batch, rows = n, deadline = ?cfg.deadline, next_batch = next, "batch not handed over in time; releasing its rows and claiming fewer");
                        db.rollback().await?;
                        let _ = free_tx.try_send(db);
                    }
                }
            }
            // Dropping `flight_tx` here tells the finisher that no batch follows.
            Ok::<(), Error>(())
        }
    };

    let finisher = finish(flight, acks, free_tx, ended, limit, released, cfg);

    futures::try_join!(claimer, finisher)?;
    Ok(())
}

/// The finisher half of [`sessions`]: waits for the oldest batch's confirms, then marks and
/// commits it, batch after batch in claim order, and frees its session; a batch not confirmed
/// by its deadline is rolled back (its rows stay pending) and the next claims are smaller.
/// Cancels `ended` when the relay ended.
async fn finish<D: PollTable>(
    mut flight: mpsc::Receiver<InFlight<D>>,
    acks: &mut watch::Receiver<Option<Checkpoint>>,
    free_tx: mpsc::Sender<D>,
    ended: CancellationToken,
    limit: &BatchLimit,
    released: &AtomicBool,
    cfg: &LoopConfig,
) -> Result<(), Error> {
    let deadline_cfg = cfg.deadline;
    while let Some(mut front) = flight.recv().await {
        let batch = front.batch;
        match tokio::time::timeout_at(front.deadline, confirmed(acks, batch)).await {
            Ok(true) => {
                // Confirmed within a sixth of the deadline of its claim: even [`SESSIONS`]
                // batches twice this size, one behind the other, would be confirmed in
                // time, so the next claims may ask for twice as many.
                let quick = deadline_cfg / (2 * SESSIONS as u32);
                if tokio::time::Instant::now() + (deadline_cfg - quick) <= front.deadline {
                    limit.grow(cfg.batch);
                }
                front.db.mark_and_commit(&front.ids).await?;
                tracing::debug!(batch, rows = front.ids.len(), "batch published and marked");
                let _ = free_tx.try_send(front.db);
            }
            // The relay ended (it failed, and says why): the rows stay pending.
            Ok(false) => {
                ended.cancel();
                return Ok(());
            }
            Err(_) => {
                // Not confirmed in time: let the rows go; this or another relay publishes
                // them again (a duplicate, never a loss). Later batches keep their own
                // deadlines: an ack of a later batch confirms them as well.
                let next = limit.shrink(front.ids.len());
                released.store(true, Ordering::Relaxed);
                tracing::warn!(batch, rows = front.ids.len(), deadline = ?deadline_cfg, next_batch = next, "batch not confirmed in time; releasing its rows and claiming fewer");
                front.db.rollback().await?;
                let _ = free_tx.try_send(front.db);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::{Budget, Outlet, SourceMsg};
    use std::sync::{Arc, Mutex};
    use tokio::sync::mpsc;

    /// A row of the fake table: who holds its lock, and whether it is published.
    #[derive(Default)]
    struct Row {
        locked_by: Option<usize>,
        marked: bool,
        published: bool,
    }

    /// An in-memory table with `SKIP LOCKED` claims; each session holds its locks until it
    /// commits or rolls back.
    #[derive(Clone)]
    struct FakeTable(Arc<Mutex<Vec<Row>>>);

    struct FakeSession {
        table: FakeTable,
        me: usize,
        /// When set, each claim takes a permit first: a test holds claims back with it.
        gate: Option<Arc<tokio::sync::Semaphore>>,
        /// When set, claims left (across the sessions sharing it) before one fails as a cut
        /// connection does; 0 = none fails.
        fail: Option<Arc<std::sync::atomic::AtomicUsize>>,
    }

    /// A session that goes away rolls its transaction back, as the server does.
    impl Drop for FakeSession {
        fn drop(&mut self) {
            self.end(false);
        }
    }

    impl FakeSession {
        fn end(&mut self, commit: bool) {
            for r in self.table.0.lock().unwrap().iter_mut() {
                if r.locked_by == Some(self.me) {
                    r.locked_by = None;
                    r.published |= commit && r.marked;
                    r.marked = false;
                }
            }
        }
    }

    impl PollTable for FakeSession {
        type Id = usize;
        const SOURCE: SourceKind = SourceKind::Postgres;

        async fn begin(&mut self) -> Result<(), Error> {
            Ok(())
        }

        async fn claim(&mut self, limit: i64) -> Result<Vec<(usize, OutboxEvent)>, Error> {
            if let Some(gate) = &self.gate {
                gate.acquire().await.expect("gate open").forget();
            }
            if let Some(left) = &self.fail {
                let before =
                    left.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
                if before == Ok(1) {
                    return Err(Error::source("connection reset by peer", true));
                }
            }
            let mut rows = self.table.0.lock().unwrap();
            let mut out = Vec::new();
            for (i, r) in rows.iter_mut().enumerate() {
                if out.len() as i64 == limit {
                    break;
                }
                if !r.published && r.locked_by.is_none() {
                    r.locked_by = Some(self.me);
                    let mut e = crate::sink::test_event();
                    e.topic = format!("row.{i}");
                    out.push((i, e));
                }
            }
            Ok(out)
        }

        async fn mark(&mut self, ids: &[usize]) -> Result<(), Error> {
            let mut rows = self.table.0.lock().unwrap();
            for &i in ids {
                assert_eq!(rows[i].locked_by, Some(self.me), "marks only its own rows");
                rows[i].marked = true;
            }
            Ok(())
        }

        async fn commit(&mut self) -> Result<(), Error> {
            self.end(true);
            Ok(())
        }

        async fn rollback(&mut self) -> Result<(), Error> {
            self.end(false);
            Ok(())
        }
    }

    /// For tests whose sessions never fail: a reconnect would be a bug.
    async fn no_reopen() -> Result<Vec<FakeSession>, Error> {
        Err(Error::config("the test's sessions failed", "none: a bug"))
    }

    /// The loop's link to a test: where its messages arrive, and the sender of acknowledgements.
    fn test_link() -> (
        SourceLink,
        mpsc::Receiver<SourceMsg>,
        watch::Sender<Option<Checkpoint>>,
    ) {
        let (tx, rx) = mpsc::channel(64);
        let (ack_tx, acks) = watch::channel(None);
        let link = SourceLink {
            outlet: Outlet {
                events: tx,
                budget: Budget::new(1 << 20),
            },
            acks,
        };
        (link, rx, ack_tx)
    }

    /// The next message from the loop, bounded so that a loop that stops handing over fails
    /// the test instead of hanging it.
    async fn next(rx: &mut mpsc::Receiver<SourceMsg>) -> Option<SourceMsg> {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .ok()
            .flatten()
    }

    #[tokio::test]
    async fn the_next_batch_is_claimed_and_handed_over_before_the_first_is_confirmed() {
        let table = FakeTable(Arc::new(Mutex::new(
            (0..6).map(|_| Row::default()).collect(),
        )));
        let dbs = (0..SESSIONS)
            .map(|me| FakeSession {
                table: table.clone(),
                me,
                gate: None,
                fail: None,
            })
            .collect();
        let (link, mut rx, ack_tx) = test_link();
        let cfg = LoopConfig {
            batch: 2,
            interval: Duration::from_secs(3600),
            // Far longer than the test: no batch is released for being late.
            deadline: Duration::from_secs(3600),
        };
        let (_wake_tx, wake) = watch::channel(0u64);
        let shutdown = CancellationToken::new();
        let poller = tokio::spawn(run(dbs, no_reopen, cfg, wake, link, shutdown.clone()));

        // Batch 1 is never acknowledged on its own: a stop-and-wait loop would wait for it
        // forever and hand nothing more over.
        let mut topics = Vec::new();
        let mut handed = Vec::new();
        while handed.len() < 2 {
            match next(&mut rx).await {
                Some(SourceMsg::Event(e, _)) => topics.push(e.topic.clone()),
                Some(SourceMsg::Checkpoint(Checkpoint::Batch(b))) => handed.push(b),
                Some(SourceMsg::Checkpoint(other)) => panic!("unexpected checkpoint {other:?}"),
                None => panic!("batch 2 was not handed over while batch 1 awaited its confirms"),
            }
        }
        assert_eq!(handed, [1, 2]);
        // Batch 2 skipped batch 1's locked rows, and the relay sees rows in claim order.
        assert_eq!(topics, ["row.0", "row.1", "row.2", "row.3"]);
        assert!(
            !table.0.lock().unwrap().iter().any(|r| r.published),
            "nothing is marked before its confirm"
        );

        // One ack for both (the relay confirms in order); then every later batch in turn.
        ack_tx.send_replace(Some(Checkpoint::Batch(2)));
        while handed.len() < 3 {
            match next(&mut rx).await {
                Some(SourceMsg::Event(e, _)) => topics.push(e.topic.clone()),
                Some(SourceMsg::Checkpoint(cp)) => {
                    if let Checkpoint::Batch(b) = cp {
                        handed.push(b);
                    }
                    ack_tx.send_replace(Some(cp));
                }
                None => panic!("the last rows were not handed over"),
            }
        }
        assert_eq!(handed, [1, 2, 3]);
        assert_eq!(topics[4..], ["row.4", "row.5"]);
        // Shutdown finishes the batches in flight: every row ends marked.
        shutdown.cancel();
        let done = tokio::time::timeout(Duration::from_secs(10), poller).await;
        done.expect("the loop ends on shutdown")
            .expect("no panic")
            .expect("no error");
        assert!(table.0.lock().unwrap().iter().all(|r| r.published));
    }

    #[tokio::test]
    async fn confirmed_batches_are_marked_while_the_next_claim_is_still_running() {
        let table = FakeTable(Arc::new(Mutex::new(
            (0..8).map(|_| Row::default()).collect(),
        )));
        // Three claims go through; the fourth waits until the test lets it.
        let gate = Arc::new(tokio::sync::Semaphore::new(3));
        let dbs = (0..3)
            .map(|me| FakeSession {
                table: table.clone(),
                me,
                gate: Some(gate.clone()),
                fail: None,
            })
            .collect();
        let (link, mut rx, ack_tx) = test_link();
        let cfg = LoopConfig {
            batch: 2,
            interval: Duration::from_secs(3600),
            deadline: Duration::from_secs(3600),
        };
        let (_wake_tx, wake) = watch::channel(0u64);
        let shutdown = CancellationToken::new();
        let poller = tokio::spawn(run(dbs, no_reopen, cfg, wake, link, shutdown.clone()));
        let mut handed = 0;
        while handed < 3 {
            match next(&mut rx).await {
                Some(SourceMsg::Checkpoint(Checkpoint::Batch(_))) => handed += 1,
                Some(_) => {}
                None => panic!("three batches were not handed over"),
            }
        }
        // All three confirmed while the fourth claim hangs: a loop that claims and marks on one
        // strand would wait in that claim and leave batches 2 and 3 unmarked.
        ack_tx.send_replace(Some(Checkpoint::Batch(3)));
        let marked = || table.0.lock().unwrap().iter().take(6).all(|r| r.published);
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while !marked() {
            assert!(
                tokio::time::Instant::now() < until,
                "batches 2 and 3 were not marked while the next claim ran"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // Let the claims go: the last batch is handed over, confirmed and marked too.
        gate.add_permits(100);
        loop {
            match next(&mut rx).await {
                Some(SourceMsg::Checkpoint(cp)) => {
                    ack_tx.send_replace(Some(cp));
                    break;
                }
                Some(_) => {}
                None => panic!("the last batch was not handed over"),
            }
        }
        shutdown.cancel();
        let done = tokio::time::timeout(Duration::from_secs(10), poller).await;
        done.expect("the loop ends on shutdown")
            .expect("no panic")
            .expect("no error");
        assert!(table.0.lock().unwrap().iter().all(|r| r.published));
    }

    #[tokio::test]
    async fn a_lost_session_is_replaced_and_batch_numbers_keep_rising() {
        let table = FakeTable(Arc::new(Mutex::new(
            (0..4).map(|_| Row::default()).collect(),
        )));
        // The second claim fails like a cut connection.
        let fail = Arc::new(std::sync::atomic::AtomicUsize::new(2));
        let sessions = |first: usize| {
            (0..SESSIONS)
                .map(|i| FakeSession {
                    table: table.clone(),
                    me: first + i,
                    gate: None,
                    fail: Some(fail.clone()),
                })
                .collect::<Vec<_>>()
        };
        let dbs = sessions(0);
        let reopened = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let reopen = {
            let (table, fail, reopened) = (table.clone(), fail.clone(), reopened.clone());
            move || {
                let n = reopened.fetch_add(1, Ordering::SeqCst) + 1;
                let dbs: Vec<FakeSession> = (0..SESSIONS)
                    .map(|i| FakeSession {
                        table: table.clone(),
                        me: 10 * n + i,
                        gate: None,
                        fail: Some(fail.clone()),
                    })
                    .collect();
                async move { Ok(dbs) }
            }
        };
        let (link, mut rx, ack_tx) = test_link();
        let cfg = LoopConfig {
            batch: 2,
            interval: Duration::from_secs(3600),
            deadline: Duration::from_secs(3600),
        };
        let (_wake_tx, wake) = watch::channel(0u64);
        let shutdown = CancellationToken::new();
        let poller = tokio::spawn(run(dbs, reopen, cfg, wake, link, shutdown.clone()));

        let mut topics = Vec::new();
        let mut handed = Vec::new();
        while handed.len() < 3 {
            match next(&mut rx).await {
                Some(SourceMsg::Event(e, _)) => topics.push(e.topic.clone()),
                Some(SourceMsg::Checkpoint(Checkpoint::Batch(b))) => handed.push(b),
                Some(SourceMsg::Checkpoint(other)) => panic!("unexpected checkpoint {other:?}"),
                None => panic!("the loop did not carry on after the lost session: {handed:?}"),
            }
        }
        assert_eq!(reopened.load(Ordering::SeqCst), 1, "one reconnect");
        // Batch 1's rows were released with the lost sessions and claimed again, as batch 2:
        // an acknowledgement of batch 1 (still in the relay) must not confirm them.
        assert_eq!(handed, [1, 2, 3]);
        assert_eq!(
            topics,
            ["row.0", "row.1", "row.0", "row.1", "row.2", "row.3"]
        );
        ack_tx.send_replace(Some(Checkpoint::Batch(1)));
        ack_tx.send_replace(Some(Checkpoint::Batch(3)));
        let marked = || table.0.lock().unwrap().iter().all(|r| r.published);
        let until = tokio::time::Instant::now() + Duration::from_secs(10);
        while !marked() {
            assert!(
                tokio::time::Instant::now() < until,
                "the rows were not marked after the reconnect"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        shutdown.cancel();
        let done = tokio::time::timeout(Duration::from_secs(10), poller).await;
        done.expect("the loop ends on shutdown")
            .expect("no panic")
            .expect("no error");
    }

    /// A batch the relay does not confirm in time is released; the next claim waits until the
    /// relay has confirmed what was handed over (no rows held meanwhile), asks for half as
    /// many rows, and grows again once batches are confirmed quickly.
    #[tokio::test(start_paused = true)]
    async fn a_released_batch_is_claimed_again_smaller_once_the_relay_caught_up() {
        let table = FakeTable(Arc::new(Mutex::new(
            (0..4).map(|_| Row::default()).collect(),
        )));
        let dbs = vec![FakeSession {
            table: table.clone(),
            me: 0,
            gate: None,
            fail: None,
        }];
        let (link, mut rx, ack_tx) = test_link();
        let cfg = LoopConfig {
            batch: 4,
            interval: Duration::from_secs(3600),
            deadline: Duration::from_secs(1),
        };
        let (_wake_tx, wake) = watch::channel(0u64);
        let shutdown = CancellationToken::new();
        let poller = tokio::spawn(run(dbs, no_reopen, cfg, wake, link, shutdown.clone()));
        // One batch handed over: its topics, then its checkpoint number.
        async fn batch(rx: &mut mpsc::Receiver<SourceMsg>) -> (Vec<String>, u64) {
            let mut topics = Vec::new();
            loop {
                match next(rx).await {
                    Some(SourceMsg::Event(e, _)) => topics.push(e.topic.clone()),
                    Some(SourceMsg::Checkpoint(Checkpoint::Batch(b))) => return (topics, b),
                    Some(SourceMsg::Checkpoint(other)) => panic!("unexpected checkpoint {other:?}"),
                    None => panic!("no batch handed over; so far {topics:?}"),
                }
            }
        }
        assert_eq!(
            batch(&mut rx).await,
            (
                vec![
                    "row.0".into(),
                    "row.1".into(),
                    "row.2".into(),
                    "row.3".into()
                ],
                1
            )
        );
        // Never confirmed: released at its deadline; nothing is claimed while the relay still
        // holds batch 1 unconfirmed (virtual time runs far past the deadline here).
        assert!(
            tokio::time::timeout(Duration::from_secs(60), rx.recv())
                .await
                .is_err(),
            "claimed again while the relay had not confirmed what was handed over"
        );
        assert!(
            table
                .0
                .lock()
                .unwrap()
                .iter()
                .all(|r| r.locked_by.is_none() && !r.published),
            "batch 1 was released, not marked"
        );
        ack_tx.send_replace(Some(Checkpoint::Batch(1)));
        assert_eq!(
            batch(&mut rx).await,
            (vec!["row.0".into(), "row.1".into()], 2)
        );
        ack_tx.send_replace(Some(Checkpoint::Batch(2)));
        assert_eq!(
            batch(&mut rx).await,
            (vec!["row.2".into(), "row.3".into()], 3)
        );
        ack_tx.send_replace(Some(Checkpoint::Batch(3)));
        shutdown.cancel();
        let done = tokio::time::timeout(Duration::from_secs(10), poller).await;
        done.expect("the loop ends on shutdown")
            .expect("no panic")
            .expect("no error");
        assert!(table.0.lock().unwrap().iter().all(|r| r.published));
        // Confirmed at once: the limit is back at the full batch.
        let grown = LoopState {
            batch_no: 0,
            waking: true,
            limit: BatchLimit(AtomicI64::new(2)),
        };
        grown.limit.grow(4);
        assert_eq!(grown.limit.get(), 4);
        assert_eq!(grown.limit.shrink(4), 2);
        assert_eq!(
            grown.limit.shrink(4),
            2,
            "several releases of one size halve once"
        );
        assert_eq!(grown.limit.shrink(1), 1, "never below one row");
    }
}
