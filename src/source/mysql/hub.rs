//! The shared binlog stream of one MySQL/MariaDB server ([`MysqlHub`]): one dump connection
//! whose events go to every tenant (a relay of one database of that server, with its own outbox
//! tables, pipeline, state store and lease) that joined it, instead of one dump connection per
//! tenant each reading the whole binlog. A tenant is a [`LogSource`] ([`HubLog`], from
//! [`MysqlHub::subscribe`]), so `pipeline::run` drives it unchanged; the hub only shares the
//! reading.
//!
//! Routing: the hub reads each table map's schema (nothing else of it) and sends a table map,
//! and the rows events of its table id, only to the tenants of that schema; every other event
//! (GTIDs, commits, rotates, heartbeats) goes to all of them, so each tenant's decoder sees
//! every transaction boundary and its stored position follows the server's head while its own
//! tables are quiet. Rows of other schemas are never decoded by a tenant.
//!
//! Positions: each tenant keeps its own. It starts on its own dump connection at its stored
//! position (exactly as an unshared relay does) and asks the hub to join. The hub answers at
//! its next transaction boundary `B` (file and end position) and from then on queues the
//! tenant's events after `B`, with a mark after each transaction. The tenant reads its own
//! stream on until its own boundary reaches `B` (then it closes its connection and goes on
//! with the queue), or passes `B` (then it drops queued events up to the mark equal to its
//! position). Either way the events it decodes are exactly the binlog's, in order, from its
//! stored position: nothing skipped, nothing twice. A tenant added behind the others catches up
//! this way on its own connection while the others go on untouched; the hub never goes back
//! for it (which would hold every other tenant back while one catches up). Where the tenant's
//! boundaries and the hub's marks disagree, the tenant leaves the hub and reads on its own.
//!
//! Backpressure: the hub never waits for a tenant. Each tenant's queue is bounded in bytes
//! ([`HubOptions::queue_bytes`]); a tenant whose queue passes the bound (a slow sink, a
//! transaction it holds) is detached: it reads what is queued, opens its own dump connection
//! at its last boundary and asks to join again after [`JOIN_RETRY`]. So a slow tenant costs
//! the server one more dump connection while it lags, never the others' progress, and its
//! memory is at most the bound plus one event. A transaction too large for a tenant's
//! `--txn-buffer` (which must be read twice) and a hub that loses its connection detach the
//! same way. The hub opens its dump connection at the server's head when the first tenant asks
//! to join and closes it when no tenant is left.

use super::decode::{self, Decoder, Step, TableRef};
use super::log::{BinlogCoord, MyLog, Stream};
use super::{MySqlSourceConfig, Resume};
use crate::backoff::Backoff;
use crate::dsn::DbDsn;
use crate::event::Checkpoint;
use crate::source::log::{Begin, LogSource};
use crate::source::startup::{StartOptions, StartPlan};
use crate::source::SourceLink;
use crate::state::checkpoint::Checkpointer;
use crate::state::StateStore;
use crate::Error;
use futures::StreamExt;
use mysql_async::binlog::events::Event;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::{CancellationToken, DropGuard};

/// The default bound of one tenant's queue.
pub const DEFAULT_QUEUE_BYTES: usize = 8 * 1024 * 1024;

/// How long a tenant reads on its own after it left the hub (or the hub detached it) before it
/// asks to join again: a tenant too slow for the hub does not fill and drop a queue all the time.
pub const JOIN_RETRY: Duration = Duration::from_secs(5);

/// What a mark counts for in a queue's bound.
const MARK_BYTES: usize = 64;

/// The hub's settings.
#[derive(Debug, Clone)]
pub struct HubOptions {
    /// Names the hub's dump connection: its replica server id is derived from it, apart from
    /// every relay's (one server id per name, as for relays).
    pub name: String,
    /// Most bytes of events queued for one tenant before it is detached to its own stream.
    pub queue_bytes: usize,
    /// Heartbeat period asked of the server; the read timeout is three of them plus 2 s.
    pub heartbeat: Duration,
}

impl HubOptions {
    pub fn new(name: &str) -> HubOptions {
        HubOptions {
            name: name.to_string(),
            queue_bytes: DEFAULT_QUEUE_BYTES,
            heartbeat: Duration::from_secs(1),
        }
    }
}

/// What the hub did, for tests and status.
#[derive(Debug, Default)]
pub struct HubStats {
    /// Dump connections the hub opened.
    pub dumps_opened: AtomicU64,
    /// Tenants that joined the hub's stream.
    pub joins: AtomicU64,
    /// Tenants the hub detached (queue over its bound, or the hub's stream broke).
    pub detaches: AtomicU64,
    /// Tenants reading from the hub's stream now (joined, not yet left).
    pub attached: AtomicUsize,
}

/// A transaction boundary: the file and the end position of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Mark {
    file: String,
    pos: u64,
}

impl Mark {
    pub(super) fn of(r: &Resume) -> Mark {
        Mark {
            file: r.file.clone(),
            pos: r.pos,
        }
    }

    fn after(&self, other: &Mark) -> bool {
        let cp = |m: &Mark| Checkpoint::Binlog {
            file: m.file.clone(),
            pos: m.pos,
            gtid_state: None,
        };
        cp(self).is_after(&cp(other))
    }
}

impl std::fmt::Display for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}", self.file, self.pos)
    }
}

/// What the hub queues for a tenant.
enum Msg {
    /// The first message: the boundary after which the queue's events come.
    Joined(Mark),
    Event(Arc<Event>),
    /// The end of a transaction (after every event of it, the copies of a compressed one too).
    Mark(Mark),
}

/// A queue's shared accounting.
#[derive(Default)]
struct Queue {
    bytes: AtomicUsize,
    detached: AtomicBool,
}

/// A tenant as the hub holds it.
struct Sub {
    name: String,
    schemas: Vec<Vec<u8>>,
    tx: mpsc::UnboundedSender<Msg>,
    queue: Arc<Queue>,
}

/// One server's shared binlog stream. Cheap to clone; the hub's task ends when the last clone
/// (the tenants hold one each) is dropped.
#[derive(Clone)]
pub struct MysqlHub {
    inner: Arc<Inner>,
}

struct Inner {
    joins: mpsc::UnboundedSender<Sub>,
    stats: Arc<HubStats>,
    _stop: DropGuard,
}

impl MysqlHub {
    /// Checks the server's binlog settings through `dsn` (any database of the server; the user
    /// needs what a relay needs of the binlog) and starts the hub's task. The dump connection
    /// opens when the first tenant asks to join.
    pub async fn connect(dsn: DbDsn, opts: HubOptions) -> Result<MysqlHub, Error> {
        let mut sql = super::connect_sql(&dsn).await?;
        let settings = super::admin::require_binlog(&mut sql).await;
        let _ = mysql_async::Conn::disconnect(sql).await;
        let mariadb = settings?.mariadb;
        let defaults = super::log::MySqlOptions::default();
        let cfg = MySqlSourceConfig {
            server_id: super::server_id_for(&format!("hub:{}", opts.name)),
            dsn,
            name: opts.name.clone(),
            tables: Vec::new(),
            heartbeat: opts.heartbeat,
            read_timeout: opts.heartbeat * 3 + Duration::from_secs(2),
            txn_buffer_bytes: defaults.txn_buffer_bytes,
            max_payload_bytes: defaults.max_payload_bytes,
            mariadb,
            xa_prepare_limit: defaults.xa_prepare_limit,
            xa_prepare_expired: defaults.xa_prepare_expired,
            sync_replicas: Vec::new(),
        };
        let (joins, rx) = mpsc::unbounded_channel();
        let stop = CancellationToken::new();
        let stats = Arc::new(HubStats::default());
        let hub = Hub {
            cfg,
            queue_bytes: opts.queue_bytes,
            stats: stats.clone(),
            subs: Vec::new(),
            pending: Vec::new(),
        };
        tokio::spawn(hub.run(rx, stop.clone()));
        Ok(MysqlHub {
            inner: Arc::new(Inner {
                joins,
                stats,
                _stop: stop.drop_guard(),
            }),
        })
    }

    /// The tenant `log` (one relay's source, its DSN on this hub's server) as a log source
    /// that reads through the hub.
    pub fn subscribe(&self, log: MyLog) -> HubLog {
        HubLog {
            log,
            hub: self.clone(),
        }
    }

    /// What the hub did so far.
    pub fn stats(&self) -> &HubStats {
        &self.inner.stats
    }

    fn join(&self, name: &str, schemas: &[Vec<u8>]) -> Option<Joining> {
        let (tx, rx) = mpsc::unbounded_channel();
        let queue = Arc::new(Queue::default());
        let sub = Sub {
            name: name.to_string(),
            schemas: schemas.to_vec(),
            tx,
            queue: queue.clone(),
        };
        self.inner.joins.send(sub).ok()?;
        Some(Joining {
            rx,
            queue,
            at: None,
            skip_to: None,
            attached: false,
        })
    }
}

/// A tenant of a [`MysqlHub`]: one relay's MySQL source whose binlog reading is shared.
pub struct HubLog {
    log: MyLog,
    hub: MysqlHub,
}

impl LogSource for HubLog {
    type Position = BinlogCoord;
    type Start = Stream;
    type Held = ();

    /// The tenant's own start (its lease, its stored position), as an unshared relay's.
    async fn start_plan<St: StateStore>(
        &self,
        store: St,
        opts: &StartOptions,
        shutdown: &CancellationToken,
    ) -> Result<Option<StartPlan<St, Begin<Self>>>, Error> {
        let Some(plan) = self.log.start_plan(store, opts, shutdown).await? else {
            return Ok(None);
        };
        let StartPlan {
            store,
            lease,
            resumed,
            source: Begin { at, start, held },
        } = plan;
        Ok(Some(StartPlan {
            store,
            lease,
            resumed,
            source: Begin { at, start, held },
        }))
    }

    async fn run(
        self,
        at: BinlogCoord,
        start: Stream,
        link: SourceLink,
        returns: Checkpointer,
        shutdown: CancellationToken,
    ) -> Result<(), Error> {
        let mut schemas: Vec<Vec<u8>> = Vec::new();
        for t in &self.log.tables {
            if !schemas.iter().any(|s| s == t.database.as_bytes()) {
                schemas.push(t.database.as_bytes().to_vec());
            }
        }
        let feed = Feed {
            hub: self.hub,
            name: self.log.name.clone(),
            schemas,
            joining: None,
            retry_at: Instant::now(),
        };
        let cfg = self.log.config(start.mariadb);
        super::run_with(
            cfg,
            link,
            at.resume,
            start.first,
            returns,
            shutdown,
            Some(feed),
        )
        .await
    }
}

/// A tenant's side of the hub, held by its run loop.
pub(super) struct Feed {
    hub: MysqlHub,
    name: String,
    schemas: Vec<Vec<u8>>,
    joining: Option<Joining>,
    /// No join asked before this.
    retry_at: Instant,
}

struct Joining {
    rx: mpsc::UnboundedReceiver<Msg>,
    queue: Arc<Queue>,
    /// The hub's boundary the queue starts after, once its first message was read.
    at: Option<Mark>,
    /// Queued events up to this mark were read on the tenant's own stream: dropped.
    skip_to: Option<Mark>,
    attached: bool,
}

impl Feed {
    /// At a transaction boundary of the tenant's own stream (`here`, no compressed
    /// transaction's copies outstanding): whether it goes on with the hub's queue now. Asks to
    /// join where it has not (and may again).
    pub(super) fn ready(&mut self, here: &Resume, now: Instant) -> bool {
        let Some(j) = self.joining.as_mut() else {
            if now >= self.retry_at {
                self.joining = self.hub.join(&self.name, &self.schemas);
                if self.joining.is_some() {
                    tracing::debug!(tenant = %self.name, "asked to join the shared binlog stream");
                }
            }
            return false;
        };
        if j.queue.detached.load(Ordering::Relaxed) {
            self.leave(now);
            return false;
        }
        if j.at.is_none() {
            match j.rx.try_recv() {
                Ok(Msg::Joined(b)) => j.at = Some(b),
                Ok(_) | Err(mpsc::error::TryRecvError::Disconnected) => {
                    self.leave(now);
                    return false;
                }
                Err(mpsc::error::TryRecvError::Empty) => return false,
            }
        }
        let b = j.at.as_ref().expect("set above");
        let here = Mark::of(here);
        if here == *b {
            j.skip_to = None;
        } else if here.after(b) {
            j.skip_to = Some(here.clone());
        } else {
            return false;
        }
        j.attached = true;
        self.hub.stats().attached.fetch_add(1, Ordering::Relaxed);
        tracing::info!(tenant = %self.name, at = %here, hub_at = %b, "reading from the shared binlog stream");
        true
    }

    /// The next event of the hub's stream for an attached tenant at `here`; `None` when it
    /// reads on its own from here (the hub detached it, stopped, or disagreed on a boundary).
    /// Cancel-safe: nothing is taken from the queue but at its one await.
    pub(super) async fn recv(&mut self, here: &Mark) -> Option<Arc<Event>> {
        loop {
            let j = self.joining.as_mut()?;
            let Some(msg) = j.rx.recv().await else {
                tracing::info!(tenant = %self.name, at = %here, "left the shared binlog stream: reading on its own");
                self.leave(Instant::now());
                return None;
            };
            match msg {
                Msg::Event(ev) => {
                    j.queue
                        .bytes
                        .fetch_sub(ev.header().event_size() as usize, Ordering::Relaxed);
                    if j.skip_to.is_none() {
                        return Some(ev);
                    }
                }
                Msg::Mark(m) => {
                    j.queue.bytes.fetch_sub(MARK_BYTES, Ordering::Relaxed);
                    let expected = j.skip_to.as_ref().unwrap_or(here);
                    if m == *expected {
                        j.skip_to = None;
                    } else if j.skip_to.is_none() || m.after(expected) {
                        tracing::warn!(tenant = %self.name, at = %here, hub_at = %m, "the shared binlog stream's boundary is not the tenant's: reading on its own");
                        self.leave(Instant::now());
                        return None;
                    }
                }
                Msg::Joined(_) => {}
            }
        }
    }

    /// Leaves the hub (or gives up joining): asks again after [`JOIN_RETRY`].
    pub(super) fn leave(&mut self, now: Instant) {
        if let Some(j) = self.joining.take() {
            if j.attached {
                self.hub.stats().attached.fetch_sub(1, Ordering::Relaxed);
            }
        }
        self.retry_at = now + JOIN_RETRY;
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.leave(Instant::now());
    }
}

/// The hub's task.
struct Hub {
    cfg: MySqlSourceConfig,
    queue_bytes: usize,
    stats: Arc<HubStats>,
    subs: Vec<Sub>,
    /// Asked to join: registered at the next boundary.
    pending: Vec<Sub>,
}

impl Hub {
    async fn run(mut self, mut joins: mpsc::UnboundedReceiver<Sub>, stop: CancellationToken) {
        let mut backoff = Backoff::standard();
        loop {
            if self.pending.is_empty() && self.subs.is_empty() {
                tokio::select! {
                    j = joins.recv() => match j {
                        Some(s) => self.pending.push(s),
                        None => return,
                    },
                    _ = stop.cancelled() => return,
                }
            }
            match self.stream(&mut joins, &stop).await {
                Ok(()) => backoff.reset(),
                Err(e) => {
                    self.detach_all();
                    let d = backoff.next_delay();
                    tracing::warn!(hub = %self.cfg.name, error = %e, retry_in = ?d, "the shared binlog stream broke: its tenants read on their own until it is back");
                    tokio::select! {
                        _ = tokio::time::sleep(d) => {}
                        _ = stop.cancelled() => {}
                    }
                }
            }
            if stop.is_cancelled() {
                self.detach_all();
                return;
            }
        }
    }

    fn detach_all(&mut self) {
        for s in self.subs.drain(..).chain(self.pending.drain(..)) {
            s.queue.detached.store(true, Ordering::Relaxed);
            self.stats.detaches.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One dump connection, from the server's head, until no tenant is left (`Ok`), the stop,
    /// or an error.
    async fn stream(
        &mut self,
        joins: &mut mpsc::UnboundedReceiver<Sub>,
        stop: &CancellationToken,
    ) -> Result<(), Error> {
        let cfg = &self.cfg;
        let at = {
            let mut sql = super::connect_sql(&cfg.dsn).await?;
            let at = super::current_position(&mut sql, cfg.mariadb).await;
            let _ = mysql_async::Conn::disconnect(sql).await;
            at?
        };
        let mut stream = super::open_stream(cfg, &at, None).await?;
        self.stats.dumps_opened.fetch_add(1, Ordering::Relaxed);
        tracing::info!(hub = %cfg.name, file = %at.file, pos = at.pos, "shared binlog stream open");
        let mut dec = Decoder::boundaries(&at.file, None);
        dec.restart(
            &at.file,
            cfg.mariadb.then(|| at.gtid.clone().unwrap_or_default()),
            if cfg.mariadb {
                None
            } else {
                at.mysql_gtids.clone()
            },
        );
        // Table id → schema, from the table maps of the current file.
        let mut schemas: HashMap<u64, Arc<[u8]>> = HashMap::new();
        let mut copies = VecDeque::<(u8, u32)>::new();
        let mut boundary: Option<Mark> = None;
        let read_timeout = cfg.read_timeout;
        // One deadline for the next event or heartbeat, kept across joins (a timeout made anew
        // at each wake-up would never run out while tenants keep asking).
        let mut read_by = tokio::time::Instant::now() + read_timeout;
        loop {
            let item = tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok(()),
                j = joins.recv() => {
                    if let Some(s) = j {
                        self.pending.push(s);
                    }
                    continue;
                }
                r = tokio::time::timeout_at(
                    read_by,
                    futures::FutureExt::catch_unwind(std::panic::AssertUnwindSafe(stream.next())),
                ) => r,
            };
            read_by = tokio::time::Instant::now() + read_timeout;
            let ev = match item {
                Ok(Ok(Some(Ok(ev)))) => Arc::new(ev),
                Ok(Ok(Some(Err(e)))) => return Err(super::classify(e)),
                Ok(Ok(None)) => {
                    return Err(Error::Other("the server ended the binlog stream".into()))
                }
                Ok(Err(_)) => {
                    return Err(Error::Decode(
                        "the binlog client library failed (panicked) on an event".into(),
                    ))
                }
                Err(_) => {
                    return Err(Error::Other(format!(
                        "no binlog event and no heartbeat within {read_timeout:?}"
                    )))
                }
            };
            let h = ev.header();
            let (kind, size) = (h.event_type_raw(), h.event_size());
            let mut target: Option<Arc<[u8]>> = None;
            if copies.front() == Some(&(kind, size)) {
                // The library's copy of a compressed transaction's event: every tenant's
                // decoder expects it, unrouted.
                copies.pop_front();
            } else {
                match decode::table_ref(&ev) {
                    TableRef::Map { id, schema } => {
                        let schema: Arc<[u8]> = schema.into();
                        schemas.insert(id, schema.clone());
                        target = Some(schema);
                    }
                    TableRef::Rows { id } => target = schemas.get(&id).cloned(),
                    TableRef::None => {
                        if kind == decode::ROTATE_EVENT {
                            schemas.clear();
                        }
                        for step in self.steps(&mut dec, &ev, &mut copies)? {
                            if let Step::Commit {
                                checkpoint: Checkpoint::Binlog { file, pos, .. },
                                ..
                            } = step
                            {
                                boundary = Some(Mark { file, pos });
                            }
                        }
                    }
                }
            }
            let limit = self.queue_bytes;
            let stats = &self.stats;
            self.subs.retain(|s| {
                if let Some(t) = &target {
                    if !s.schemas.iter().any(|x| **x == **t) {
                        return true;
                    }
                }
                forward(s, Msg::Event(ev.clone()), size as usize, limit, stats)
            });
            if copies.is_empty() {
                if let Some(b) = boundary.take() {
                    self.subs
                        .retain(|s| forward(s, Msg::Mark(b.clone()), MARK_BYTES, limit, stats));
                    for p in self.pending.drain(..) {
                        if p.tx.send(Msg::Joined(b.clone())).is_ok() {
                            stats.joins.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(hub = %self.cfg.name, tenant = %p.name, at = %b, "a tenant joins");
                            self.subs.push(p);
                        }
                    }
                    if self.subs.is_empty() {
                        tracing::info!(hub = %self.cfg.name, "no tenant left: shared binlog stream closed");
                        return Ok(());
                    }
                }
            }
        }
    }

    /// What the boundary decoder makes of `ev` (a compressed transaction's inner events one by
    /// one, noting the copies the library sends after it).
    fn steps(
        &self,
        dec: &mut Decoder,
        ev: &Event,
        copies: &mut VecDeque<(u8, u32)>,
    ) -> Result<Vec<Step>, Error> {
        let Some(mut inner) = dec.payload_events(ev)? else {
            return dec.feed(ev);
        };
        let mut steps = Vec::new();
        loop {
            match inner.next_event() {
                Ok(Some(e)) => {
                    copies.push_back((e.header().event_type_raw(), e.header().event_size()));
                    steps.extend(dec.feed_inner(&e, ev)?);
                }
                Ok(None) => return Ok(steps),
                Err(m) => return Err(dec.payload_err(decode::span(ev).0, m)),
            }
        }
    }
}

/// Queues `msg` for `s`; false when `s` is gone or now detached (its queue passed `limit`).
fn forward(s: &Sub, msg: Msg, size: usize, limit: usize, stats: &HubStats) -> bool {
    let queued = s.queue.bytes.fetch_add(size, Ordering::Relaxed) + size;
    if queued > limit {
        s.queue.detached.store(true, Ordering::Relaxed);
        stats.detaches.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(tenant = %s.name, queued, limit, "a tenant's queue passed its bound: it reads on its own until it catches up");
        return false;
    }
    s.tx.send(msg).is_ok()
}
