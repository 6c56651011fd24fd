//! The start of a Postgres relay, from its first SQL session to the position its stream opens
//! at: the server and table checks, the lease (as a standby under `--ha`, then ending a paused
//! old leader's walsender), the publication, what a first start or a replay publishes from the
//! tables, the position checks (a state row from another server; a slot dropped, invalidated
//! or replaced), `--on-position-lost` recovery, and which of the slot's and the state row's
//! positions streaming resumes from. It is one function because its order is what makes a
//! start safe to interrupt at any step: the plan is decided before the slot exists (an empty
//! table is looked at again once it does), a replay is recorded before it is published, a
//! first start is marked done before its first event. The result is a [`StartPlan`] for the
//! source and the lease keeper; the SQL it runs is in [`admin`] and `state::postgres`.

use super::admin;
use super::snapshot::{self, SnapshotKey, SnapshotMode, SnapshotPlan};
use crate::dsn::DbDsn;
use crate::event::{format_lsn, Checkpoint};
use crate::outbox::{ColumnMap, TableName};
use crate::source::startup::{self, PositionLostPolicy, StartOptions};
use crate::state::{self, Lease};
use crate::Error;
use std::time::Duration;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

/// What a Postgres relay's start works on.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    pub dsn: &'a DbDsn,
    /// The `application_name` of the start's SQL session.
    pub app: &'a str,
    pub slot: &'a str,
    pub publication: &'a str,
    /// The outbox tables (`--table`), sharing one column map.
    pub tables: &'a [TableName],
    pub columns: &'a ColumnMap,
}

/// How a Postgres relay streams, as its start decided.
pub struct StartPlan {
    /// The SQL session the start ran on. The relay holds it until it stops, so the sessions
    /// the server lists for it are the same from its start to its stop.
    pub session: Client,
    /// The lease, with `first_start` and `replay_since` as they stand once the start is done.
    pub lease: Lease,
    /// Where the stream starts: the later of the slot's and the stored position.
    pub start: u64,
    /// What is published from each table before streaming (a first start or a replay).
    pub snapshot: Vec<(TableName, SnapshotPlan)>,
    /// How far an interrupted run got through that snapshot.
    pub snapshot_after: Option<SnapshotKey>,
    /// The floor of the positions the lease keeper stores: the start position, or none while
    /// a snapshot is pending (its marks sort before every stream position).
    pub resumed: Option<Checkpoint>,
}

/// Prepares the start of a Postgres relay (see the module's documentation); `None` when a
/// standby was asked to stop before it got the lease.
pub async fn start_plan(
    src: Source<'_>,
    opts: &StartOptions,
    shutdown: &CancellationToken,
) -> Result<Option<StartPlan>, Error> {
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
    let holder = state::holder_id();
    let (name, holder_ref) = (opts.name.as_str(), holder.as_str());
    let Some((sql, lease)) = startup::acquire_lease(sql, opts.ha, shutdown, |mut sql| async move {
        let lease =
            state::postgres::acquire(&mut sql, name, slot_name, publication, holder_ref).await;
        (sql, lease)
    })
    .await?
    else {
        return Ok(None);
    };
    tracing::info!(name = %opts.name, epoch = lease.epoch, holder = %lease.holder, "lease acquired");
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
    let plan = match (&lease.replay_since, lease.first_start) {
        (Some(since), _) => {
            snapshot::plan_tables(&sql, tables, columns, &SnapshotMode::Since(*since)).await?
        }
        (None, true) => snapshot::plan_tables(&sql, tables, columns, &opts.snapshot).await?,
        (None, false) => Vec::new(),
    };
    let mut plan = plan;
    let mut lease = lease;
    let mut slot_info = admin::slot(&sql, slot_name).await?;
    let row = state::postgres::load(&sql, &opts.name).await?;
    // A state row carried over from another server: checked first, because its positions
    // also decide whether the slot counts as replaced.
    let flush = admin::flush_lsn(&sql).await?;
    let foreign = row
        .as_ref()
        .and_then(|row| state::postgres::foreign_position(row, flush));
    // A slot dropped and created again under our name (see state::postgres::slot_replaced),
    // also during a first start: from the slot's creation on, it is confirmed only up to
    // positions the row holds.
    let replaced = match (&slot_info, &row, &foreign) {
        (Some(s), Some(row), None) => state::postgres::slot_replaced(row, s.confirmed_flush_lsn),
        _ => None,
    };
    // A first start an earlier run began (it recorded the slot it created) whose slot is gone:
    // the rows it published stand on that slot's position, and a new slot starts later.
    let interrupted = match (&slot_info, &row) {
        (None, Some(row)) if lease.first_start && row.slot_created_lsn.is_some() => Some(format!(
            "replication slot {:?} of relay {:?} does not exist, but an interrupted first start created it: it was dropped, \
             so rows committed since could be in neither that start's snapshot (published up to its last durable row) nor a new slot",
            slot_name, opts.name
        )),
        _ => None,
    };
    let lost = match &slot_info {
        _ if foreign.is_some() => foreign.clone(),
        _ if interrupted.is_some() => interrupted.clone(),
        None if !lease.first_start => Some(format!("replication slot {:?} of relay {:?} does not exist, but its state does: it was dropped", slot_name, opts.name)),
        Some(s) if s.wal_status.as_deref() == Some("lost") => Some(format!("replication slot {:?} was invalidated (wal_status = lost): the WAL it needed was removed", slot_name)),
        _ => replaced.clone(),
    };
    if let (Some(problem), PositionLostPolicy::Fail) = (&foreign, opts.on_position_lost) {
        return Err(Error::PositionLost {
            problem: problem.clone(),
            fix: admin::foreign_position_fix(&opts.name),
        });
    }
    if let (Some(problem), PositionLostPolicy::Fail) = (
        interrupted.as_ref().or(replaced.as_ref()),
        opts.on_position_lost,
    ) {
        return Err(Error::PositionLost {
            problem: problem.clone(),
            fix: if lease.first_start {
                admin::interrupted_first_start_fix(&opts.name)
            } else {
                admin::replaced_slot_fix(&opts.name, slot_name)
            },
        });
    }
    let first_start_lost = lost.is_some() && lease.first_start && lease.replay_since.is_none();
    if let (Some(problem), PositionLostPolicy::Poll, true) =
        (&lost, opts.on_position_lost, first_start_lost)
    {
        // A first start has no delivered position to replay from: the rows its snapshot
        // still had to publish may be older than anything it published. It starts over, from
        // a fresh slot and the beginning of its snapshot.
        if slot_info.is_some() {
            admin::drop_slot(&sql, slot_name).await?;
            slot_info = None;
        }
        state::postgres::restart_first_start(&sql, &lease).await?;
        tracing::error!(
            problem = %problem,
            "POSITION LOST: starting the interrupted first start over (--on-position-lost poll): opening a fresh slot and publishing its snapshot again from the beginning; expect duplicates"
        );
    }
    if let (Some(problem), PositionLostPolicy::Poll, false) =
        (&lost, opts.on_position_lost, first_start_lost)
    {
        let row = row
            .as_ref()
            .ok_or_else(|| Error::Other("state row vanished".into()))?;
        let since = recovery_since(row, opts.replay_since, opts.recovery_margin);
        if slot_info.is_some() {
            admin::drop_slot(&sql, slot_name).await?;
            slot_info = None;
        }
        // Recorded first: if this run dies before the replay is durable, the next one
        // replays again. The lost position is forgotten with it (see set_replay).
        state::postgres::set_replay(&sql, &lease, since).await?;
        lease.replay_since = Some(since);
        lease.first_start = true;
        plan = snapshot::plan_tables(&sql, tables, columns, &SnapshotMode::Since(since)).await?;
        let mut rows: i64 = 0;
        for t in tables {
            rows += admin::rows_created_since(&sql, t, columns, since).await?;
        }
        tracing::error!(
            problem = %problem,
            replay_since = %since.to_rfc3339(),
            rows,
            "POSITION LOST: recovering through the table (--on-position-lost poll): opening a fresh slot and publishing again every row created since then; expect duplicates"
        );
    }
    let created_slot = slot_info.is_none();
    let start = match slot_info {
        Some(slot) => {
            if slot.wal_status.as_deref() == Some("lost") {
                return Err(Error::PositionLost {
                    problem: format!("replication slot {:?} was invalidated (wal_status = lost): the WAL it needed was removed", slot_name),
                    fix: admin::lost_slot_fix(&opts.name, slot_name),
                });
            }
            if slot.plugin.as_deref() != Some("pgoutput") || slot.database.as_deref() != Some(dsn.database.as_str()) {
                return Err(Error::config(
                    format!("slot {:?} exists but is not a pgoutput slot of database {:?} (plugin {:?}, database {:?})", slot_name, dsn.database, slot.plugin, slot.database),
                    format!("use another --slot, or SELECT pg_drop_replication_slot('{}'); if nothing else uses it", slot_name),
                ));
            }
            // The slot learns durable positions through status updates, the state table through
            // the lease keeper, each on its own one-second clock: after a SIGKILL either may be
            // behind. Both only ever hold positions the sink made durable, so resume from the
            // later one; the server skips transactions that committed before it.
            // The stored one is this server's: a foreign one stopped or was reset above.
            let confirmed = slot.confirmed_flush_lsn.unwrap_or(0);
            let stored = row.as_ref().and_then(|row| row.position_lsn).unwrap_or(0);
            if stored > confirmed {
                tracing::info!(slot_position = %format_lsn(confirmed), stored = %format_lsn(stored), "the stored position is ahead of the slot's: resuming from it");
            }
            confirmed.max(stored)
        }
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
    let mut snapshot_after = None;
    if lease.first_start || lease.replay_since.is_some() {
        if plan.iter().all(|(_, p)| *p == SnapshotPlan::Nothing) {
            // Nothing to publish from the table: the slot alone is the first start's position,
            // and it is durable now. Marked done before the first event, so a relay killed at
            // any moment from here on resumes from the slot, not from a new one.
            state::postgres::mark_initialized(&sql, &lease).await?;
            lease.first_start = false;
            lease.replay_since = None;
        } else {
            let row = state::postgres::load(&sql, &opts.name).await?;
            if lease.replay_since.is_none()
                && row.as_ref().is_some_and(|r| r.position_lsn.is_some())
            {
                // A stream position is stored only once the snapshot's end was acknowledged:
                // an earlier run finished this first start and was killed before marking it
                // done. Publishing the table again would only repeat it.
                tracing::info!(
                    "first start: an earlier run finished the snapshot; marking it done"
                );
                state::postgres::mark_initialized(&sql, &lease).await?;
                lease.first_start = false;
                plan.clear();
            } else {
                // An earlier run of this first start got this far through the snapshot.
                snapshot_after = row
                    .and_then(|row| row.snapshot_key)
                    .and_then(|k| SnapshotKey::decode(&k));
            }
        }
    }
    state::postgres::record_slot_start(&sql, &lease, start, created_slot).await?;
    // The snapshot's progress marks sort before every stream position, the start included: a
    // run that publishes one has no floor but its own marks (the keeper's ForwardOnly).
    let snapshot_pending = (lease.first_start || lease.replay_since.is_some())
        && plan.iter().any(|(_, p)| *p != SnapshotPlan::Nothing);
    Ok(Some(StartPlan {
        session: sql,
        lease,
        start,
        snapshot: plan,
        snapshot_after,
        resumed: (!snapshot_pending).then_some(Checkpoint::Lsn(start)),
    }))
}

/// Where a replay through the table starts after a lost position, from a Postgres state row
/// (see [`startup::replay_start`]): the last durable commit time minus a margin no smaller than
/// the largest commit-vs-`created_at` gap seen (so a long producer transaction's row is not
/// missed), or `--replay-since`.
pub fn recovery_since(
    row: &state::postgres::StateRow,
    replay_since: Option<chrono::DateTime<chrono::Utc>>,
    margin: Duration,
) -> chrono::DateTime<chrono::Utc> {
    startup::replay_start(
        &state::DurableCommit {
            commit_at: row.position_commit_at,
            max_gap_ms: row.commit_gap_ms,
        },
        row.created_at,
        replay_since,
        margin,
        Duration::from_secs(1),
    )
}
