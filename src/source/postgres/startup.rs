//! The start of a Postgres relay, from its first SQL session to the position its stream opens
//! at: the server and table checks, the lease (as a standby under `--ha`, then ending a paused
//! old leader's walsender), the publication, what a first start or a replay publishes from the
//! tables, the position checks (a state record from another server; a slot dropped,
//! invalidated or replaced), `--on-position-lost` recovery, and which of the slot's and the
//! stored positions streaming resumes from. [`start_plan`] keeps the steps in the order that
//! makes a start safe to interrupt at any step: the plan is decided before the slot exists (an
//! empty table is looked at again once it does), a replay is recorded before it is published,
//! a first start is marked done before its first event. The result is a [`StartPlan`] for the
//! source and the lease keeper; the SQL it runs is in [`admin`], the state it reads and writes
//! goes through [`StateStore`].

use super::admin;
use super::snapshot::{self, SnapshotKey, SnapshotMode, SnapshotPlan};
use crate::dsn::DbDsn;
use crate::event::{format_lsn, Checkpoint};
use crate::outbox::{ColumnMap, TableName};
use crate::source::startup::{self, PositionLostPolicy, StartOptions};
use crate::state::{self, Lease, StateStore, Stored};
use crate::Error;
use std::time::Duration;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

/// What a Postgres relay's start works on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Source<'a> {
    pub dsn: &'a DbDsn,
    /// The `application_name` of the start's SQL session.
    pub app: &'a str,
    pub slot: &'a str,
    pub publication: &'a str,
    /// The outbox tables (`--table`), sharing one column map.
    pub tables: &'a [TableName],
    pub columns: &'a ColumnMap,
}

/// Where a Postgres source begins, as its start decided.
pub(crate) struct PgStart {
    /// The SQL session the start ran on. The relay holds it until it stops, so the sessions
    /// the server lists for it are the same from its start to its stop.
    pub session: Client,
    /// Where the stream starts: the later of the slot's and the stored position.
    pub start: u64,
    /// What is published from each table before streaming (a first start or a replay).
    pub snapshot: Vec<(TableName, SnapshotPlan)>,
    /// How far an interrupted run got through that snapshot.
    pub snapshot_after: Option<SnapshotKey>,
}

/// How a Postgres relay streams (see [`startup::StartPlan`]).
pub(crate) type StartPlan<St> = startup::StartPlan<St, PgStart>;

/// Prepares the start of a Postgres relay on `store` (see the module's documentation); `None`
/// when a standby was asked to stop before it got the lease.
pub(crate) async fn start_plan<St: StateStore>(
    src: Source<'_>,
    store: St,
    opts: &StartOptions,
    shutdown: &CancellationToken,
) -> Result<Option<StartPlan<St>>, Error> {
    let Source {
        dsn,
        app,
        slot: slot_name,
        publication,
        tables,
        columns,
    } = src;
    let sql = super::connect_sql(dsn, app).await?;
    admin::require_logical(&sql).await?;
    for t in tables {
        admin::require_table(&sql, t).await?;
    }
    admin::require_columns(&sql, tables, columns).await?;
    let Some((mut store, mut lease, _)) = startup::take_lease(store, opts, shutdown).await? else {
        return Ok(None);
    };
    if opts.ha {
        // A paused old leader's walsender may still hold the slot: end it, or the stream
        // cannot start. Its relay has stopped publishing by its own clock already.
        let ended = admin::end_other_slot_holder(&sql, slot_name).await?;
        if ended > 0 {
            tracing::warn!(slot = %slot_name, "took over: ended the previous leader's walsender");
        }
    }
    admin::ensure_publication(&sql, publication, tables).await?;

    // A first look before the slot exists, so `auto` on a non-empty table without a status
    // column refuses without leaving a slot behind; an empty one is looked at again once the
    // slot exists (snapshot::look_again), for the rows of transactions its creation waited for.
    let mut plan = match (&lease.replay_since, lease.first_start) {
        (Some(since), _) => {
            snapshot::plan_tables(&sql, tables, columns, &SnapshotMode::Since(*since)).await?
        }
        (None, true) => snapshot::plan_tables(&sql, tables, columns, &opts.snapshot).await?,
        (None, false) => Vec::new(),
    };
    let mut slot_info = admin::slot(&sql, slot_name).await?;
    let stored = store.load(&opts.name).await?;
    let flush = admin::flush_lsn(&sql).await?;
    let checks = Checks::of(
        &opts.name,
        slot_name,
        &lease,
        slot_info.as_ref(),
        stored.as_ref(),
        flush,
    );
    checks.refuse(opts, &lease, slot_name)?;
    if let (Some(problem), PositionLostPolicy::Poll) = (&checks.lost, opts.on_position_lost) {
        // A first start has no delivered position to replay from: the rows its snapshot still
        // had to publish may be older than anything it published. It starts over, from a
        // fresh slot and the beginning of its snapshot.
        let since = match lease.first_start && lease.replay_since.is_none() {
            true => None,
            false => {
                let stored = stored
                    .as_ref()
                    .ok_or_else(|| Error::Other("state row vanished".into()))?;
                Some(recovery_since(
                    stored,
                    opts.replay_since,
                    opts.recovery_margin,
                ))
            }
        };
        if slot_info.is_some() {
            admin::drop_slot(&sql, slot_name).await?;
            slot_info = None;
        }
        match since {
            None => {
                store.restart(&lease, None).await?;
                tracing::error!(
                    problem = %problem,
                    "POSITION LOST: starting the interrupted first start over (--on-position-lost poll): opening a fresh slot and publishing its snapshot again from the beginning; expect duplicates"
                );
            }
            Some(since) => plan = replay(&sql, &mut store, &mut lease, src, since, problem).await?,
        }
    }
    let created_slot = slot_info.is_none();
    let start = match slot_info {
        Some(slot) => resume_at(&slot, src, &opts.name, stored.as_ref())?,
        // The slot first, the table read after: overlap gives duplicates, never a gap.
        None if lease.first_start => admin::create_slot(&sql, slot_name).await?,
        None => {
            return Err(Error::PositionLost {
                problem: format!("replication slot {:?} of relay {:?} does not exist, but its state does: it was dropped", slot_name, opts.name),
                fix: admin::lost_slot_fix(&opts.name, slot_name),
            })
        }
    };
    tracing::info!(slot = %slot_name, position = %format_lsn(start), "resuming");
    if lease.first_start && lease.replay_since.is_none() && opts.snapshot == SnapshotMode::Auto {
        // The position exists now: what the table holds is decided against it.
        snapshot::look_again(&sql, &mut plan).await?;
    }
    let snapshot_after = if lease.first_start || lease.replay_since.is_some() {
        first_start_progress(&mut store, &mut lease, &mut plan, &opts.name).await?
    } else {
        None
    };
    store
        .record_stream_start(&lease, &Checkpoint::Lsn(start), created_slot)
        .await?;
    // The snapshot's progress marks sort before every stream position, the start included: a
    // run that publishes one has no floor but its own marks (the keeper's ForwardOnly).
    let snapshot_pending = (lease.first_start || lease.replay_since.is_some())
        && plan.iter().any(|(_, p)| *p != SnapshotPlan::Nothing);
    crate::progress::table_phase(match lease.replay_since {
        Some(_) => crate::progress::Phase::Replay,
        None => crate::progress::Phase::Snapshot,
    });
    Ok(Some(StartPlan {
        store,
        lease,
        resumed: (!snapshot_pending).then_some(Checkpoint::Lsn(start)),
        source: PgStart {
            session: sql,
            start,
            snapshot: plan,
            snapshot_after,
        },
    }))
}

/// What the stored record and the slot say about the position, before anything changes.
#[derive(Debug, Default, PartialEq, Eq)]
struct Checks {
    /// The record was carried over from another server (see `state::postgres::foreign_position`):
    /// checked first, because its positions also decide whether the slot counts as replaced.
    foreign: Option<String>,
    /// A first start an earlier run began (it recorded the slot it created) whose slot is gone.
    interrupted: Option<String>,
    /// A slot dropped and created again under our name (see `state::postgres::slot_replaced`),
    /// also during a first start: from the slot's creation on, it is confirmed only up to
    /// positions the record holds.
    replaced: Option<String>,
    /// Whatever makes the position lost, the above included: what `--on-position-lost`
    /// decides about.
    lost: Option<String>,
}

impl Checks {
    fn of(
        name: &str,
        slot_name: &str,
        lease: &Lease,
        slot: Option<&admin::SlotInfo>,
        stored: Option<&Stored>,
        flush: u64,
    ) -> Checks {
        let foreign = stored.and_then(|s| state::postgres::foreign_position(name, s, flush));
        let replaced = match (slot, stored, &foreign) {
            (Some(s), Some(stored), None) => {
                state::postgres::slot_replaced(name, slot_name, stored, s.confirmed_flush_lsn)
            }
            _ => None,
        };
        // The rows that start published stand on that slot's position, and a new slot starts
        // later.
        let interrupted = match (slot, stored) {
            (None, Some(stored)) if lease.first_start && stored.stream_start.is_some() => Some(format!(
                "replication slot {:?} of relay {:?} does not exist, but an interrupted first start created it: it was dropped, \
                 so rows committed since could be in neither that start's snapshot (published up to its last durable row) nor a new slot",
                slot_name, name
            )),
            _ => None,
        };
        let lost = match slot {
            _ if foreign.is_some() => foreign.clone(),
            _ if interrupted.is_some() => interrupted.clone(),
            None if !lease.first_start => Some(format!("replication slot {:?} of relay {:?} does not exist, but its state does: it was dropped", slot_name, name)),
            Some(s) if s.wal_status.as_deref() == Some("lost") => Some(format!("replication slot {:?} was invalidated (wal_status = lost): the WAL it needed was removed", slot_name)),
            _ => replaced.clone(),
        };
        Checks {
            foreign,
            interrupted,
            replaced,
            lost,
        }
    }

    /// Under `--on-position-lost fail`, a foreign record, an interrupted first start's lost
    /// slot or a replaced slot stops the start with its fix (a dropped or invalidated slot is
    /// refused where the start position is read).
    fn refuse(&self, opts: &StartOptions, lease: &Lease, slot_name: &str) -> Result<(), Error> {
        if opts.on_position_lost != PositionLostPolicy::Fail {
            return Ok(());
        }
        if let Some(problem) = &self.foreign {
            return Err(Error::PositionLost {
                problem: problem.clone(),
                fix: admin::foreign_position_fix(&opts.name),
            });
        }
        if let Some(problem) = self.interrupted.as_ref().or(self.replaced.as_ref()) {
            return Err(Error::PositionLost {
                problem: problem.clone(),
                fix: if lease.first_start {
                    admin::interrupted_first_start_fix(&opts.name)
                } else {
                    admin::replaced_slot_fix(&opts.name, slot_name)
                },
            });
        }
        Ok(())
    }
}

/// `--on-position-lost poll` after a delivered position was lost (`problem`): records the replay
/// of every row created since `since` (first: if this run dies before the replay is durable,
/// the next one replays again; the lost position is forgotten with it) and returns what it
/// publishes. The slot is already dropped.
async fn replay<St: StateStore>(
    sql: &Client,
    store: &mut St,
    lease: &mut Lease,
    src: Source<'_>,
    since: chrono::DateTime<chrono::Utc>,
    problem: &str,
) -> Result<Vec<(TableName, SnapshotPlan)>, Error> {
    store.restart(lease, Some(since)).await?;
    lease.replay_since = Some(since);
    lease.first_start = true;
    let plan =
        snapshot::plan_tables(sql, src.tables, src.columns, &SnapshotMode::Since(since)).await?;
    let mut rows: i64 = 0;
    for t in src.tables {
        rows += admin::rows_created_since(sql, t, src.columns, since).await?;
    }
    tracing::error!(
        problem = %problem,
        replay_since = %since.to_rfc3339(),
        rows,
        "POSITION LOST: recovering through the table (--on-position-lost poll): opening a fresh slot and publishing again every row created since then; expect duplicates"
    );
    Ok(plan)
}

/// Where streaming resumes from an existing slot: the later of its confirmed position and the
/// stored one. An invalidated slot, or one of another plugin or database, is refused.
fn resume_at(
    slot: &admin::SlotInfo,
    src: Source<'_>,
    name: &str,
    stored: Option<&Stored>,
) -> Result<u64, Error> {
    let slot_name = src.slot;
    if slot.wal_status.as_deref() == Some("lost") {
        return Err(Error::PositionLost {
            problem: format!("replication slot {:?} was invalidated (wal_status = lost): the WAL it needed was removed", slot_name),
            fix: admin::lost_slot_fix(name, slot_name),
        });
    }
    if slot.plugin.as_deref() != Some("pgoutput")
        || slot.database.as_deref() != Some(src.dsn.database.as_str())
    {
        return Err(Error::config(
            format!("slot {:?} exists but is not a pgoutput slot of database {:?} (plugin {:?}, database {:?})", slot_name, src.dsn.database, slot.plugin, slot.database),
            format!("use another --slot, or SELECT pg_drop_replication_slot('{}'); if nothing else uses it", slot_name),
        ));
    }
    // The slot learns durable positions through status updates, the state table through the
    // lease keeper, each on its own one-second clock: after a SIGKILL either may be behind.
    // Both only ever hold positions the sink made durable, so resume from the later one; the
    // server skips transactions that committed before it. The stored one is this server's: a
    // foreign one stopped or was reset before.
    let confirmed = slot.confirmed_flush_lsn.unwrap_or(0);
    let stored = stored
        .and_then(|s| s.position.as_ref())
        .and_then(Checkpoint::lsn)
        .unwrap_or(0);
    if stored > confirmed {
        tracing::info!(slot_position = %format_lsn(confirmed), stored = %format_lsn(stored), "the stored position is ahead of the slot's: resuming from it");
    }
    Ok(confirmed.max(stored))
}

/// A first start (or a replay) once its position exists: marked done at once when the tables
/// have nothing to publish, or when an earlier run finished the snapshot; otherwise how far an
/// earlier run got through it.
async fn first_start_progress<St: StateStore>(
    store: &mut St,
    lease: &mut Lease,
    plan: &mut Vec<(TableName, SnapshotPlan)>,
    name: &str,
) -> Result<Option<SnapshotKey>, Error> {
    if plan.iter().all(|(_, p)| *p == SnapshotPlan::Nothing) {
        // Nothing to publish from the table: the slot alone is the first start's position,
        // and it is durable now. Marked done before the first event, so a relay killed at any
        // moment from here on resumes from the slot, not from a new one.
        store.mark_initialized(lease).await?;
        lease.first_start = false;
        lease.replay_since = None;
        return Ok(None);
    }
    let stored = store.load(name).await?;
    if lease.replay_since.is_none() && stored.as_ref().is_some_and(|s| s.position.is_some()) {
        // A stream position is stored only once the snapshot's end was acknowledged: an
        // earlier run finished this first start and was killed before marking it done.
        // Publishing the table again would only repeat it.
        tracing::info!("first start: an earlier run finished the snapshot; marking it done");
        store.mark_initialized(lease).await?;
        lease.first_start = false;
        plan.clear();
        return Ok(None);
    }
    // An earlier run of this first start got this far through the snapshot.
    Ok(stored
        .and_then(|s| s.snapshot_key)
        .and_then(|k| SnapshotKey::decode(&k)))
}

/// Where a replay through the table starts after a lost position, from a Postgres state record
/// (see [`startup::replay_start`]): the last durable commit time minus a margin no smaller than
/// the largest commit-vs-`created_at` gap seen (so a long producer transaction's row is not
/// missed), or `--replay-since`.
pub fn recovery_since(
    stored: &Stored,
    replay_since: Option<chrono::DateTime<chrono::Utc>>,
    margin: Duration,
) -> chrono::DateTime<chrono::Utc> {
    startup::replay_start(
        &stored.commit,
        stored.created_at,
        replay_since,
        margin,
        Duration::from_secs(1),
    )
}
