//! What the startups of both log sources share: the settings of `outboxd run` a start needs
//! ([`StartOptions`]), the shape of what a start decides ([`StartPlan`]), taking the relay's lease (under `--ha`, as a standby while another relay
//! holds it), and where a replay through the table starts after a lost position. Each source's
//! own startup (`postgres::startup`, `mysql::startup`) owns the rest of its start, because the
//! order of its steps depends on what its server keeps (a slot, or binlog files); this module
//! owns only what must not differ between the two. Poll mode and binlog files take no lease and
//! resume nothing, so they use none of it.

use crate::event::Checkpoint;
use crate::source::snapshot::SnapshotMode;
use crate::state::{self, Lease, StateStore};
use crate::Error;
use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `--on-position-lost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PositionLostPolicy {
    /// Stop with exit 3 and the fix.
    #[default]
    Fail,
    /// Open a fresh position and publish again, from the table, every row that may have been
    /// committed after the last confirmed one; then stream.
    Poll,
}

/// The settings of `outboxd run` that decide how a log source starts, whatever the source.
#[derive(Debug, Clone)]
pub struct StartOptions {
    /// The relay's name: its lease and its stored position.
    pub name: String,
    /// High availability: wait as a standby while another relay holds the lease.
    pub ha: bool,
    /// What a first start publishes of the rows already in the table.
    pub snapshot: SnapshotMode,
    /// What to do when the log position cannot be resumed.
    pub on_position_lost: PositionLostPolicy,
    /// Recovery replays rows created since this time instead of the computed one.
    pub replay_since: Option<chrono::DateTime<chrono::Utc>>,
    /// Smallest margin recovery subtracts from the last durable commit time.
    pub recovery_margin: Duration,
}

/// How a log source streams, as its start decided: the same shape for every database.
pub struct StartPlan<St, S> {
    /// The state store the start took the lease through and wrote its first-start records
    /// to; the lease keeper goes on with it.
    pub store: St,
    /// The lease, with `first_start` and `replay_since` as they stand once the start is done.
    pub lease: Lease,
    /// The floor of the positions the lease keeper stores: the start position, or none while a
    /// snapshot is pending (its marks sort before every stream position).
    pub resumed: Option<Checkpoint>,
    /// What the database's source begins with: where it streams from and what it publishes
    /// before.
    pub source: S,
}

/// Takes the lease of relay `opts.name` through `store` for this process (under `--ha` as a
/// standby while another relay holds it); `None` when asked to stop meanwhile. Returns the
/// store, the lease and the stored position.
pub(crate) async fn take_lease<St: StateStore>(
    store: St,
    opts: &StartOptions,
    shutdown: &CancellationToken,
) -> Result<Option<(St, Lease, Option<Checkpoint>)>, Error> {
    let holder = state::holder_id();
    let (name, holder) = (opts.name.as_str(), holder.as_str());
    let taken = acquire_lease(store, opts.ha, shutdown, |mut store| async move {
        let r = store.acquire(name, holder).await;
        (store, r)
    })
    .await?;
    Ok(taken.map(|(store, (lease, at))| {
        tracing::info!(name = %lease.name, epoch = lease.epoch, holder = %lease.holder, "lease acquired");
        (store, lease, at)
    }))
}

/// Takes the lease through `attempt`, which is handed the startup's session and gives it back
/// with its result: each store takes the lease through the session the startup goes on with.
/// Under `--ha` (`ha`), a lease another relay holds is waited for and asked for again; `None`
/// when asked to stop meanwhile. Any other error ends the start.
async fn acquire_lease<C, T, F, Fut>(
    mut session: C,
    ha: bool,
    shutdown: &CancellationToken,
    mut attempt: F,
) -> Result<Option<(C, T)>, Error>
where
    F: FnMut(C) -> Fut,
    Fut: Future<Output = (C, Result<T, Error>)>,
{
    loop {
        let (back, result) = attempt(session).await;
        session = back;
        match result {
            Err(Error::LeaseHeld(who)) if ha => {
                if !standby(&who, shutdown).await {
                    return Ok(None);
                }
            }
            other => return other.map(|lease| Some((session, lease))),
        }
    }
}

/// `--ha`: another relay holds the lease; waits one renewal period before the next attempt.
/// False when asked to stop meanwhile.
async fn standby(held: &str, shutdown: &CancellationToken) -> bool {
    tracing::info!(held = %held, "standby: waiting for the lease");
    crate::telemetry::live::standby(held);
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(state::RENEW_INTERVAL) => true,
    }
}

/// Where a replay through the table starts after a lost position: the last durable commit
/// time minus a margin no smaller than the largest commit-vs-`created_at` gap seen (so a long
/// producer transaction's row is not missed), or `--replay-since`. `commit` as stored,
/// `fallback` when no commit time was (the state row's creation), and `precision` — how coarse
/// the source's commit times are — added to the gap.
pub fn replay_start(
    commit: &state::DurableCommit,
    fallback: Option<chrono::DateTime<chrono::Utc>>,
    replay_since: Option<chrono::DateTime<chrono::Utc>>,
    margin: Duration,
    precision: Duration,
) -> chrono::DateTime<chrono::Utc> {
    if let Some(s) = replay_since {
        return s;
    }
    let gap = Duration::from_millis(commit.max_gap_ms.unwrap_or(0).max(0) as u64) + precision;
    let margin = chrono::Duration::from_std(margin.max(gap)).unwrap_or(chrono::Duration::days(1));
    let base = commit
        .commit_at
        .or(fallback)
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC + chrono::Duration::days(1));
    base - margin
}
