//! The relay's own state, kept in the source database (`outboxd_state`): which relay `name`
//! owns which slot, its lease (holder, epoch, expiry) and the last position whose events were
//! all confirmed by the sink. The stored position moves only forward and is written only by
//! the lease holder of the current epoch.

pub mod checkpoint;
pub mod file;
pub(crate) mod forward;
// The in-memory double: for tests only (the `test-util` feature), never in a release build.
#[cfg(any(test, feature = "test-util"))]
pub(crate) mod memory;
pub mod mysql;
pub mod postgres;

use crate::event::Checkpoint;
use crate::telemetry::events::{FenceClosed, FenceOpened, InternalEvent, LeaseEnded, LeaseRenewed};
use crate::Error;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{watch, Notify};
// The tokio clock, not std's: outside paused-time tests it is the same monotonic clock (it keeps
// running while the process is stopped), and under `start_paused` the lease, the fence and the
// keeper's self-fencing follow the test's virtual time, so they can be tested in milliseconds.
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// What an existing `outboxd_state` lacks for this version, or that it is missing: made good
/// by `outboxd setup` (or a start whose role may), never guessed around.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Gap {
    /// No `outboxd_state` (or, on MySQL, none the session's user can see).
    Table,
    /// Columns added after the table was made (by an older outboxd).
    Columns(Vec<&'static str>),
}

/// How long a lease lasts without renewal; a relay renews it about every second.
pub(crate) const LEASE_TTL: Duration = Duration::from_secs(5);
/// A relay whose last successful renewal is older than this publishes nothing (see [`Fence`]):
/// its lease may be about to expire and another relay take over, so two relays never publish
/// at once. With `--ha`, a leader that cannot renew for this long also stops (exit 4).
pub(crate) const SELF_FENCE_AFTER: Duration = Duration::from_millis(3500);
/// One renewal may take this long; a stalled connection must not stall the lease keeper.
pub(crate) const RENEW_TIMEOUT: Duration = Duration::from_millis(900);
/// The final position's write at a graceful stop may take this long. The relay has stopped
/// publishing by then, so no fence waits on it, and a server whose commits queue behind a
/// large transaction (seconds on a busy MariaDB) must not cost the next start a replay of
/// everything since the last stored position. The binary's `--shutdown-timeout` bounds the
/// whole stop.
pub(crate) const FINAL_WRITE_TIMEOUT: Duration = Duration::from_secs(10);
pub(crate) const RENEW_INTERVAL: Duration = Duration::from_secs(1);
/// A newer durable position is stored this soon after the sink confirmed it, and the store is
/// written at most this often: a relay killed at any moment resumes at most this much traffic
/// (plus the relay's window) behind what it had confirmed. Idle, nothing is written.
pub(crate) const STORE_INTERVAL: Duration = Duration::from_millis(100);

/// The gate between the lease and publishing: when the lease was last renewed, shared by the
/// lease keeper (which opens it with every successful renewal) and the relay (which checks it
/// before every publish, republish and flush). A renewal counts from the moment it was sent,
/// not answered: the lease runs from the server's clock at the update, which is no earlier.
/// The clock is monotonic and keeps running while the process is paused (SIGSTOP, a frozen
/// VM), so a leader that resumes after its lease expired finds the gate closed before it can
/// publish, whatever its tasks do first.
#[derive(Clone)]
pub struct Fence(Arc<FenceInner>);

struct FenceInner {
    base: Instant,
    /// Nanoseconds after `base` of the last renewal, plus one; 0 = never renewed.
    renewed: AtomicU64,
    limit: Duration,
    changed: Notify,
}

impl std::fmt::Debug for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fence")
            .field("age", &self.age())
            .field("limit", &self.0.limit)
            .finish()
    }
}

impl Fence {
    /// A gate that stays closed until the first renewal, and closes again `limit` after the
    /// last one.
    pub fn new(limit: Duration) -> Fence {
        Fence(Arc::new(FenceInner {
            base: Instant::now(),
            renewed: AtomicU64::new(0),
            limit,
            changed: Notify::new(),
        }))
    }

    /// A renewal sent at `at` succeeded (an older instant than the recorded one is ignored).
    pub fn renewed(&self, at: impl Into<Instant>) {
        let at: Instant = at.into();
        let ns = at.saturating_duration_since(self.0.base).as_nanos() as u64 + 1;
        self.0.renewed.fetch_max(ns, Ordering::AcqRel);
        self.0.changed.notify_waiters();
    }

    /// Time since the last successful renewal was sent; `None` before the first.
    pub fn age(&self) -> Option<Duration> {
        match self.0.renewed.load(Ordering::Acquire) {
            0 => None,
            ns => Some(
                self.0
                    .base
                    .elapsed()
                    .saturating_sub(Duration::from_nanos(ns - 1)),
            ),
        }
    }

    /// Whether publishing is allowed now.
    pub(crate) fn is_open(&self) -> bool {
        self.age().is_some_and(|a| a < self.0.limit)
    }

    /// How long the gate stays open without another renewal; `None` while it is closed.
    pub fn closes_in(&self) -> Option<Duration> {
        self.age()
            .and_then(|a| self.0.limit.checked_sub(a))
            .filter(|d| !d.is_zero())
    }

    /// Returns once publishing is allowed: at once while the lease is fresh, otherwise after
    /// the next successful renewal. Waits forever when none comes: then the lease keeper ends
    /// the relay (with `--ha`, or when the lease was lost), or it never was the holder.
    pub(crate) async fn wait_open(&self) {
        // When it closed, and whether after a renewal (not merely before the first one).
        let mut closed: Option<(Instant, bool)> = None;
        loop {
            let notified = self.0.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_open() {
                if let Some((since, true)) = closed {
                    FenceOpened {
                        closed: since.elapsed(),
                    }
                    .emit();
                }
                return;
            }
            if closed.is_none() {
                let age = self.age();
                closed = Some((Instant::now(), age.is_some()));
                FenceClosed {
                    age,
                    limit: self.0.limit,
                }
                .emit();
            }
            tokio::select! {
                _ = notified => {}
                // The gate also closes by time alone; a renewal after that wakes us above.
                _ = tokio::time::sleep(Duration::from_secs(1)) => {}
            }
        }
    }
}

/// Identifies this process as a lease holder:
/// `host:pid:nonce:boot=<boot id>:pidns=<PID namespace inode>`. A PID means something only in
/// its PID namespace, on one boot of one machine, and neither a host name (containers and
/// cloned VMs share one) nor a missing `/proc/<pid>` (another PID namespace, `hidepid`) proves
/// that; the boot id and the namespace let a successor tell whether the holder's PID is one it
/// can check. A field this process cannot read is written as `?` (nothing can be proved of it).
/// Older versions, which split the string as `host:pid:nonce` from the right, read a
/// non-numeric PID in it and so never take such a lease over on local evidence either.
pub fn holder_id() -> String {
    let local = Locality::current();
    format!(
        "{}:{}:{}:boot={}:pidns={}",
        hostname(),
        std::process::id(),
        &uuid::Uuid::new_v4().simple().to_string()[..8],
        local.boot.as_deref().unwrap_or("?"),
        local
            .pidns
            .map_or_else(|| "?".to_string(), |i| i.to_string()),
    )
}

pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Where a PID is meaningful: this boot of the kernel and this process's PID namespace.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Locality {
    boot: Option<String>,
    pidns: Option<u64>,
}

impl Locality {
    fn current() -> Locality {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .ok()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty() && !s.contains(':'));
        // The link reads `pid:[4026531836]`.
        let pidns = std::fs::read_link("/proc/self/ns/pid").ok().and_then(|l| {
            l.to_str()?
                .strip_prefix("pid:[")?
                .strip_suffix(']')?
                .parse()
                .ok()
        });
        Locality { boot, pidns }
    }
}

/// A holder id in the current format, with every field this check needs known.
#[derive(Debug, PartialEq, Eq)]
struct ProvableHolder<'a> {
    host: &'a str,
    pid: u32,
    boot: &'a str,
    pidns: u64,
}

/// Parses a holder id written by [`holder_id`]; `None` for one that proves nothing: an older
/// version's `host:pid:nonce`, a field written as `?`, or anything else.
fn parse_holder(holder: &str) -> Option<ProvableHolder<'_>> {
    let mut parts = holder.rsplitn(5, ':');
    let pidns = parts.next()?.strip_prefix("pidns=")?.parse().ok()?;
    let boot = parts.next()?.strip_prefix("boot=")?;
    let _nonce = parts.next()?;
    let pid = parts.next()?.parse().ok()?;
    let host = parts.next()?;
    (boot != "?").then_some(ProvableHolder {
        host,
        pid,
        boot,
        pidns,
    })
}

/// Whether a PID names a process in this PID namespace. `kill(pid, 0)` signals nothing and,
/// unlike a look into `/proc`, is not fooled by `hidepid`: a process this one may not signal
/// still exists (`EPERM`). Only `ESRCH` says it is gone.
fn pid_exists(pid: u32) -> bool {
    // 0 and negative PIDs address process groups: never "gone".
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return true;
    };
    if pid <= 0 {
        return true;
    }
    // SAFETY: signal 0 performs only the existence and permission checks.
    let r = unsafe { libc::kill(pid, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH)
}

/// Whether a holder id names a process that provably no longer exists: on this host, this
/// boot and in this PID namespace, with its PID gone (a relay killed with SIGKILL leaves its
/// lease behind; its successor there need not wait it out). Anything else — another boot or
/// namespace, an unreadable field, an older version's holder id — proves nothing, and the
/// lease is left to expire.
pub fn holder_is_dead_locally(holder: &str) -> bool {
    dead_in(holder, &hostname(), &Locality::current())
}

fn dead_in(holder: &str, host: &str, here: &Locality) -> bool {
    let (Some(h), Some(boot), Some(pidns)) = (parse_holder(holder), &here.boot, here.pidns) else {
        return false;
    };
    h.host == host
        && h.boot == boot
        && h.pidns == pidns
        && h.pid != std::process::id()
        && !pid_exists(h.pid)
}

/// What the source knows about the newest durable transaction: its commit time and the
/// largest commit-vs-`created_at` gap seen so far. Recovery through the table replays from
/// there, minus at least that gap.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DurableCommit {
    pub commit_at: Option<chrono::DateTime<chrono::Utc>>,
    pub max_gap_ms: Option<i64>,
}

/// A lease this process holds.
#[derive(Debug, Clone)]
pub struct Lease {
    pub name: String,
    pub holder: String,
    pub epoch: i64,
    /// No earlier run of this name finished its first start (its snapshot is not yet durable).
    pub first_start: bool,
    /// A replay from the table was requested (`offset set --replay-since`).
    pub replay_since: Option<chrono::DateTime<chrono::Utc>>,
}

/// What a state store holds for a relay name, as a start reads it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stored {
    /// The end of the last transaction whose events were all confirmed (Postgres: what the
    /// row holds; the slot may be ahead of it).
    pub position: Option<Checkpoint>,
    /// A finished first start is on record: later starts resume from the position.
    pub initialized: bool,
    /// How far an unfinished first start's snapshot got (the last row whose publication is
    /// durable).
    pub snapshot_key: Option<String>,
    /// What is known of the position's commit: where a recovery through the table replays from.
    pub commit: DurableCommit,
    /// Where the stream this record follows started, as [`StateStore::record_stream_start`]
    /// recorded it (Postgres: the slot's start, when this relay name created or first adopted
    /// it); `None` for stores whose stream has no start of its own.
    pub stream_start: Option<Checkpoint>,
    /// When the record was created: where a recovery replays from when no commit time is
    /// known (`None` where the store does not keep it).
    pub created_at: Option<chrono::DateTime<chrono::Utc>>,
}

/// The refusal of a write from `lease` after another relay took its epoch over.
pub(crate) fn lost(lease: &Lease) -> Error {
    Error::Leadership(format!(
        "lease of relay {:?} lost: another relay took epoch {} over",
        lease.name, lease.epoch
    ))
}

/// The one lease-takeover rule, for every store that keeps its lease as a record (the SQL
/// tables, memory; an offset file's lease is a `flock`, which the kernel drops with its
/// holder): `holder` may take the lease of relay `name` unless another process, whose lease
/// is still `live`, holds it and is not provably dead on this machine
/// ([`holder_is_dead_locally`]). Refused with `Error::LeaseHeld`, naming the holder; a
/// takeover is logged.
pub(crate) fn take_over(
    name: &str,
    current: Option<&str>,
    live: bool,
    holder: &str,
) -> Result<(), Error> {
    let Some(h) = current else {
        return Ok(());
    };
    if live && h != holder && !holder_is_dead_locally(h) {
        return Err(Error::LeaseHeld(format!(
            "relay {name:?} is already running: lease held by {h} (it expires within {}s of its last renewal; \
             stop that relay, or run this one with another --name)",
            LEASE_TTL.as_secs()
        )));
    }
    if h != holder {
        tracing::info!(name, previous_holder = h, live, "taking over the lease");
    }
    Ok(())
}

/// The one interface to a relay's state, whatever keeps it (the source database's
/// `outboxd_state`, an offset file, memory in tests): take the lease, read what is stored,
/// renew the lease (storing a newer position with it, never an older one), record a first
/// start, and give the lease up. A store reconnects by itself on the next call after a failure.
pub trait StateStore: Send {
    /// Takes the lease of relay `name` for `holder`, creating its record on first use (a new
    /// epoch: the previous holder's writes are refused from now on). `Error::LeaseHeld` while
    /// another live process holds it. Returns the lease and the stored position.
    fn acquire(
        &mut self,
        name: &str,
        holder: &str,
    ) -> impl std::future::Future<Output = Result<(Lease, Option<Checkpoint>), Error>> + Send;

    /// What is stored for relay `name`; `None` when it has no record yet.
    fn load(
        &mut self,
        name: &str,
    ) -> impl std::future::Future<Output = Result<Option<Stored>, Error>> + Send;

    /// Renews the lease; stores `position` (and what is known of its commit) when given.
    fn renew(
        &mut self,
        lease: &Lease,
        position: Option<&Checkpoint>,
        commit: &DurableCommit,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send;

    /// Stores the position a first start streams from, before its first event is published, so
    /// that a relay killed at any moment of its first start resumes there (`done`: there is no
    /// snapshot, the first start is over). Keeps a position already stored. Stores whose
    /// position lives elsewhere (a Postgres slot) need not.
    fn store_start(
        &mut self,
        _lease: &Lease,
        _start: &Checkpoint,
        _done: bool,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        async { Ok(()) }
    }

    /// Records where the stream this relay follows starts (Postgres: where its slot starts):
    /// always when this start just created that stream (`created`), otherwise only when none is
    /// recorded yet. From then on a stream found past both this and the stored position was
    /// moved by something else. Stores whose stream has no start of its own need not.
    fn record_stream_start(
        &mut self,
        _lease: &Lease,
        _at: &Checkpoint,
        _created: bool,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        async { Ok(()) }
    }

    /// Forgets the stored position, the snapshot's progress and the stream start, so a fresh
    /// stream and snapshot begin: without `replay_since`, a first start begun again (the next
    /// start is a first start); with it, a lost position's recovery, whose replay is recorded
    /// until it is durable (see [`Lease::replay_since`]). The commit time and gap stay: a replay cut off starts from
    /// them again. Refused when the lease was lost.
    fn restart(
        &mut self,
        lease: &Lease,
        replay_since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send;

    /// Replaces the stored position by `marker`, even an older one, while this lease holds: a
    /// recovery whose new positions sort before the lost one, which the forward-only rule would
    /// otherwise never let replace it.
    fn replace_position(
        &mut self,
        lease: &Lease,
        marker: &Checkpoint,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send;

    /// Stores what the running phase has got to (`crate::progress::summary`; `None`: none
    /// runs), for `outboxd status`. Stores no status command reads need not.
    fn report_progress(
        &mut self,
        _lease: &Lease,
        _progress: Option<&str>,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        async { Ok(()) }
    }

    /// Records that the first start's snapshot (or a requested replay) is durable.
    fn mark_initialized(
        &mut self,
        _lease: &Lease,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send {
        async { Ok(()) }
    }

    fn release(
        &mut self,
        lease: &Lease,
    ) -> impl std::future::Future<Output = Result<(), Error>> + Send;

    /// A renewal was abandoned midway (it timed out): drop whatever session it used, so the
    /// next call starts on a fresh one instead of queueing behind a stalled one.
    fn abandon(&mut self) {
        // A store without a session of its own (a file, memory) has nothing to drop.
    }

    /// The run's return path (created by the run wiring once the start position is known): a
    /// store whose writes decide what may go upstream reports each write to it (Postgres: what
    /// the row holds after the write, and a server shutting down; see [`checkpoint`]). A store
    /// of a log with nothing upstream to confirm ignores it.
    fn return_path(&mut self, returns: checkpoint::Checkpointer) {
        let _ = returns;
    }
}

/// Why the lease keeper woke up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// The renewal clock.
    Tick,
    /// A newer durable position to store.
    Ack,
    Stop,
}

/// Renews the lease about every second, and stores each newer durable position as soon as the
/// relay acknowledges it (at most every [`STORE_INTERVAL`]; a position write renews the lease
/// too), with the commit times `checkpoints` knows for it. At the end, stores the final
/// position and releases the lease. Every successful
/// renewal opens `fence` (the relay publishes only while it is open). Ends early only when the
/// lease was lost, or with `self_fence` (`--ha`) when it could not be renewed for
/// [`SELF_FENCE_AFTER`].
pub(crate) async fn keep_lease<S: StateStore>(
    mut store: S,
    lease: Lease,
    mut acks: watch::Receiver<Option<Checkpoint>>,
    checkpoints: checkpoint::Checkpointer,
    self_fence: bool,
    fence: Fence,
    stop: CancellationToken,
) -> Result<(), Error> {
    let mut renewed = Instant::now();
    let mut written: Option<Checkpoint> = None;
    // Until the first start's end is acknowledged, its snapshot (or a requested replay) is not
    // known to be durable: only then is it marked done. Snapshot progress marks do not count.
    let mut needs_init = lease.first_start || lease.replay_since.is_some();
    let mut tick = tokio::time::interval(RENEW_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stopping = false;
    let mut failures_while_stopping = 0;
    let mut acks_open = true;
    // When a position was last written: the next one waits until STORE_INTERVAL has passed.
    let mut stored_at: Option<tokio::time::Instant> = None;
    // The progress last stored for `status`.
    let mut reported: Option<String> = None;
    loop {
        let wake = tokio::select! {
            _ = tick.tick() => Wake::Tick,
            _ = stop.cancelled(), if !stopping => Wake::Stop,
            changed = acks.changed(), if acks_open && !stopping => {
                if changed.is_err() {
                    // The relay ended: the stop that follows stores its last acknowledgement.
                    acks_open = false;
                    continue;
                }
                Wake::Ack
            }
        };
        if wake == Wake::Stop {
            stopping = true;
        }
        if wake == Wake::Ack {
            if let Some(at) = stored_at {
                let due = at + STORE_INTERVAL;
                if due > tokio::time::Instant::now() {
                    tokio::select! {
                        _ = tokio::time::sleep_until(due) => {}
                        _ = stop.cancelled(), if !stopping => stopping = true,
                    }
                }
            }
        }
        let _ = acks.has_changed();
        let pos = acks
            .borrow_and_update()
            .clone()
            .filter(|p| Some(p) != written.as_ref());
        if wake == Wake::Ack && pos.is_none() && !stopping {
            continue;
        }
        let commit = checkpoints.to_store(pos.as_ref());
        if pos.is_some() {
            // Failed attempts count too: a store that keeps failing is retried at this pace.
            stored_at = Some(tokio::time::Instant::now());
        }
        // A renewal stuck on a stalled connection must not stall the clock that fences; the
        // store then drops the session it used (it may have been inside a transaction).
        let sent = Instant::now();
        let limit = if stopping {
            FINAL_WRITE_TIMEOUT
        } else {
            RENEW_TIMEOUT
        };
        let attempt =
            match tokio::time::timeout(limit, store.renew(&lease, pos.as_ref(), &commit)).await {
                Ok(r) => r,
                Err(_) => {
                    store.abandon();
                    Err(Error::timeout("lease renewal timed out"))
                }
            };
        if attempt.is_err() && self_fence && !stopping && renewed.elapsed() >= SELF_FENCE_AFTER {
            LeaseEnded.emit();
            return Err(Error::Leadership(format!(
                "could not renew the lease of {:?} for {:.1}s: stopping before it can expire (a standby takes over)",
                lease.name,
                renewed.elapsed().as_secs_f64()
            )));
        }
        match attempt {
            Ok(()) => {
                renewed = sent;
                fence.renewed(sent);
                LeaseRenewed {
                    stored: pos.is_some(),
                }
                .emit();
                if pos.is_some() {
                    // The write renewed the lease: the next renewal is a period from now.
                    tick.reset();
                    written = pos;
                }
                // What a running phase has got to, for `status`: written when it changed, at
                // most once a renewal, and cleared when the relay stops. A failed write is
                // tried again at the next renewal.
                let now = if stopping {
                    None
                } else {
                    crate::progress::summary()
                };
                if now != reported {
                    match store.report_progress(&lease, now.as_deref()).await {
                        Ok(()) => reported = now,
                        Err(e) => tracing::debug!(error = %e, "could not store the progress"),
                    }
                }
                let past_first_start = written
                    .as_ref()
                    .is_some_and(|w| !matches!(w, Checkpoint::Snapshot { .. }));
                if needs_init && past_first_start {
                    match store.mark_initialized(&lease).await {
                        Ok(()) => needs_init = false,
                        Err(e @ Error::Leadership(_)) => return Err(e),
                        Err(e) => {
                            tracing::warn!(error = %e, "could not mark the first start done; retrying")
                        }
                    }
                }
            }
            Err(e @ Error::Leadership(_)) => {
                LeaseEnded.emit();
                return Err(e);
            }
            Err(e) => {
                tracing::warn!(error = %e, "lease renewal failed; retrying");
                if stopping {
                    failures_while_stopping += 1;
                    if failures_while_stopping >= 3 {
                        tracing::warn!("giving up on storing the final position: the next start resumes from the last stored one");
                        return Ok(());
                    }
                }
                continue;
            }
        }
        if stopping {
            if let Err(e) = store.release(&lease).await {
                tracing::warn!(error = %e, "could not release the lease; it expires by itself");
            }
            LeaseEnded.emit();
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_local_holders_are_recognised() {
        let me = holder_id();
        assert!(parse_holder(&me).is_some(), "{me}");
        assert!(!holder_is_dead_locally(&me));
        let here = Locality::current();
        let (boot, ns) = (here.boot.clone().unwrap(), here.pidns.unwrap());
        let host = hostname();
        // Above any `pid_max` (2^22), so no process has it.
        let gone = 4_194_399;
        let dead = format!("{host}:{gone}:abcd1234:boot={boot}:pidns={ns}");
        assert!(holder_is_dead_locally(&dead));
        // A live process (init of this namespace), whether or not it may be signalled.
        assert!(!holder_is_dead_locally(&format!(
            "{host}:1:abcd1234:boot={boot}:pidns={ns}"
        )));
        assert!(!holder_is_dead_locally(&format!(
            "some-other-host:{gone}:abcd1234:boot={boot}:pidns={ns}"
        )));
        assert!(!holder_is_dead_locally("garbage"));
    }

    #[test]
    fn a_holder_elsewhere_than_this_boot_and_pid_namespace_is_never_dead() {
        let here = Locality {
            boot: Some("b1".into()),
            pidns: Some(7),
        };
        // Above any `pid_max` (2^22), so no process has it.
        let gone = 4_194_399;
        assert!(dead_in(&format!("h:{gone}:n:boot=b1:pidns=7"), "h", &here));
        // Another PID namespace (a container sharing the host name, `unshare --pid`).
        assert!(!dead_in(&format!("h:{gone}:n:boot=b1:pidns=8"), "h", &here));
        // Another boot, or another machine with the same host name.
        assert!(!dead_in(&format!("h:{gone}:n:boot=b2:pidns=7"), "h", &here));
        // Fields the holder could not read.
        assert!(!dead_in(&format!("h:{gone}:n:boot=?:pidns=7"), "h", &here));
        assert!(!dead_in(&format!("h:{gone}:n:boot=b1:pidns=?"), "h", &here));
        // What the previous version wrote: readable, but it proves nothing.
        assert!(!dead_in(&format!("h:{gone}:abcd1234"), "h", &here));
        // This process cannot tell where it is.
        let unknown = Locality {
            boot: None,
            pidns: Some(7),
        };
        assert!(!dead_in(
            &format!("h:{gone}:n:boot=b1:pidns=7"),
            "h",
            &unknown
        ));
    }

    #[test]
    fn holder_ids_parse_back() {
        let h = parse_holder("db-1:42:abcd1234:boot=0f-1:pidns=4026531836").unwrap();
        assert_eq!(
            h,
            ProvableHolder {
                host: "db-1",
                pid: 42,
                boot: "0f-1",
                pidns: 4026531836
            }
        );
        // Fits the MySQL column (VARCHAR(255)) with the longest host name Linux allows.
        let longest = format!(
            "{}:4194304:abcd1234:boot={}:pidns={}",
            "h".repeat(64),
            uuid::Uuid::nil(),
            u64::MAX
        );
        assert!(longest.len() <= 255, "{}", longest.len());
    }

    /// `closes_in` is what the sinks' socket guards sleep on: none before the first renewal,
    /// the rest of the limit after one, none once it ran out (a pause counts: the clock ran on).
    #[tokio::test(start_paused = true)]
    async fn the_gate_says_when_it_closes() {
        let limit = Duration::from_millis(3500);
        let fence = Fence::new(limit);
        assert_eq!(fence.closes_in(), None, "closed before the first renewal");
        fence.renewed(Instant::now());
        assert_eq!(fence.closes_in(), Some(limit));
        tokio::time::advance(Duration::from_millis(1000)).await;
        assert_eq!(fence.closes_in(), Some(Duration::from_millis(2500)));
        tokio::time::advance(Duration::from_millis(2500)).await;
        assert_eq!(fence.closes_in(), None, "closed at the limit");
        assert!(!fence.is_open());
        fence.renewed(Instant::now());
        assert_eq!(fence.closes_in(), Some(limit), "a renewal opens it again");
    }
}
