//! The start of a MySQL/MariaDB relay, from its first SQL session to the binlog position its
//! stream opens at: the server and table checks, the lease (in `outboxd_state` or an offset
//! file; as a standby under `--ha`), the stored position checked against the server's binlog
//! (`--on-position-lost` recovery when it is gone), and a first start's snapshot or the
//! position an interrupted first start stored. It is one function because its order is what
//! makes a start safe to interrupt at any step: a lost position stays stored until its replay
//! is confirmed, a first start goes on from where an earlier run stored it, never from the
//! binlog head. A position a start chooses itself (first start, recovery) is refused while an
//! XA transaction prepared before it that wrote the outbox table is still open (see
//! [`admin::xa`]). The result is a [`StartPlan`] for the source and the lease keeper; the SQL it
//! runs is in [`admin`] and `state::mysql`.

use super::rows::OutboxTable;
use super::{admin, FirstStart, Resume};
use crate::dsn::DbDsn;
use crate::event::Checkpoint;
use crate::source::snapshot::{SnapshotKey, SnapshotMode, SnapshotPlan};
use crate::source::startup::{self, PositionLostPolicy, StartOptions};
use crate::state::{self, file::FileStore, Lease};
use crate::Error;
use std::path::Path;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What a MySQL/MariaDB relay's start works on.
#[derive(Debug, Clone, Copy)]
pub struct Source<'a> {
    pub dsn: &'a DbDsn,
    /// The outbox tables (`--table`), all in the DSN's database.
    pub tables: &'a [OutboxTable],
    /// `--offset-file`: the position and the lease are kept in this file instead of
    /// `outboxd_state`.
    pub offset_file: Option<&'a Path>,
}

/// How a MySQL/MariaDB relay streams, as its start decided.
pub struct StartPlan {
    pub lease: Lease,
    /// Whether the server writes MariaDB GTIDs.
    pub mariadb: bool,
    /// Where the stream starts.
    pub start: Resume,
    /// What the source publishes from the tables before streaming.
    pub first: FirstStart,
    /// The first start's position (and whether that start is over with it), stored before the
    /// first event is published.
    pub store_first: Option<(Checkpoint, bool)>,
    /// The floor of the positions the lease keeper stores: the start position, or none when a
    /// snapshot is published (its marks sort before the start position).
    pub resumed: Option<Checkpoint>,
    /// The offset file's store under `--offset-file` (else the state is `outboxd_state`).
    pub file_store: Option<FileStore>,
}

/// Prepares the start of a MySQL/MariaDB relay (see the module's documentation); `None` when a
/// standby was asked to stop before it got the lease.
pub async fn start_plan(
    src: Source<'_>,
    opts: &StartOptions,
    shutdown: &CancellationToken,
) -> Result<Option<StartPlan>, Error> {
    let Source {
        dsn,
        tables,
        offset_file,
    } = src;
    let mut sql = super::connect_state(dsn).await?;
    let settings = admin::require_binlog(&mut sql).await?;
    for t in tables {
        admin::require_table(&mut sql, t).await?;
    }
    let holder = state::holder_id();
    let (name, holder_ref) = (opts.name.as_str(), holder.as_str());
    let Some((mut sql, (lease, stored, mut file_store))) =
        startup::acquire_lease(sql, opts.ha, shutdown, |mut sql| async move {
            let attempt = match offset_file {
                Some(path) => FileStore::acquire(path, name, holder_ref)
                    .map(|(store, lease, at)| (lease, at, Some(store))),
                None => state::mysql::acquire(&mut sql, name, holder_ref)
                    .await
                    .map(|(lease, at)| (lease, at, None)),
            };
            (sql, attempt)
        })
        .await?
    else {
        return Ok(None);
    };
    tracing::info!(name = %opts.name, epoch = lease.epoch, holder = %lease.holder, "lease acquired");
    // A first start an earlier run began stored where it started (before publishing): this one
    // goes on from there, never from the binlog head (which would skip what was committed in
    // between).
    let (stored, first_start_at) = if lease.first_start {
        (None, stored)
    } else {
        (stored, None)
    };
    let mut first = FirstStart::No;
    // The first start's position, stored before the first event is published.
    let mut store_first: Option<(Checkpoint, bool)> = None;
    let mut resume_from = stored.as_ref().and_then(Resume::from_checkpoint);
    // Whether the stored position was already checked against the server's binlog.
    let mut checked = false;
    if let (Some(resume), PositionLostPolicy::Poll) = (&resume_from, opts.on_position_lost) {
        // With recovery on, a purged stored file counts as lost even where the GTID state
        // might still resume: a needless replay gives duplicates, a wrong guess a gap.
        let verdict =
            admin::require_position(&mut sql, &opts.name, resume, settings.mariadb, true).await;
        checked = verdict.is_ok();
        if let Err(Error::PositionLost { problem, .. }) = verdict {
            // From the store the position came from: an offset-file setup has no
            // `outboxd_state` (the file keeps no commit times, so the replay starts earlier).
            let commit = match &mut file_store {
                Some(store) => state::StateStore::load(store, &opts.name)
                    .await?
                    .map(|s| s.commit)
                    .unwrap_or_default(),
                None => state::mysql::load_commit(&mut sql, &opts.name).await?,
            };
            // Binlog commit times are whole seconds (truncated): one more second of margin.
            let since = startup::replay_start(
                &commit,
                None,
                opts.replay_since,
                opts.recovery_margin,
                Duration::from_secs(2),
            );
            let plans =
                super::snapshot::plan_tables(&mut sql, tables, &SnapshotMode::Since(since)).await?;
            let mut snap =
                super::snapshot::begin(super::connect_sql(dsn).await?, settings.mariadb, plans)
                    .await?;
            if !snap.at.checkpoint().is_after(&resume.checkpoint()) {
                // The new binlog's positions sort before the lost one (it started again, or
                // another server's numbers are lower): the store would never let them replace
                // it. A marker sorting before all of them stands in, still a lost position to
                // a start that finds it, so a replay cut off runs again.
                let marker = admin::lost_marker(&resume.file);
                match &mut file_store {
                    Some(store) => store.mark_lost(&marker).await?,
                    None => state::mysql::mark_lost(&mut sql, &lease, &marker).await?,
                }
                tracing::warn!(marker = %marker, "the new binlog's positions sort before the lost one: stored a marker until the replay is confirmed");
            }
            let rows = snap.rows().await?;
            tracing::error!(
                problem = %problem,
                stored_commit_at = %commit.commit_at.map(|t| t.to_rfc3339()).unwrap_or_else(|| "unknown".into()),
                max_commit_gap_ms = commit.max_gap_ms.unwrap_or(0),
                replay_since = %since.to_rfc3339(),
                rows,
                "POSITION LOST: recovering through the table (--on-position-lost poll): streaming from the current binlog position and publishing again every row created since replay_since; expect duplicates"
            );
            // The old position stays stored until the replay's rows are confirmed: a crash
            // before that replays again.
            resume_from = None;
            first = FirstStart::Snapshot(snap);
        }
    }
    let start = match resume_from {
        Some(resume) => resumable(&mut sql, &opts.name, settings.mariadb, resume, checked).await?,
        None if matches!(first, FirstStart::Snapshot(_)) => match &first {
            FirstStart::Snapshot(snap) => snap.at.clone(),
            _ => unreachable!("matched above"),
        },
        None => {
            // First start (docs/message-format.md): the rows already in the table come from a consistent
            // snapshot whose binlog position is where streaming starts. The position and the
            // first start's end are stored once the snapshot is durable.
            // A first look at the tables before the position is read, so `auto` on a
            // non-empty table without a status column refuses before anything is stored.
            let mut plans = super::snapshot::plan_tables(&mut sql, tables, &opts.snapshot).await?;
            let auto = opts.snapshot == SnapshotMode::Auto;
            let restarted = match first_start_at.as_ref().and_then(Resume::from_checkpoint) {
                Some(r) => Some(resumable(&mut sql, &opts.name, settings.mariadb, r, false).await?),
                None => None,
            };
            // Read before the empty tables are looked at again: a row committed after the
            // first look is in the stream from here, or seen by the second look.
            let empty_at = match (
                &restarted,
                plans.iter().all(|(_, p)| *p == SnapshotPlan::Nothing),
            ) {
                (None, true) => Some(super::current_position(&mut sql, settings.mariadb).await?),
                _ => None,
            };
            let appeared = match &empty_at {
                Some(_) if auto => super::snapshot::look_again(&mut sql, &mut plans).await?,
                _ => false,
            };
            if plans.iter().all(|(_, p)| *p == SnapshotPlan::Nothing) {
                first = FirstStart::Empty;
                let at = match (restarted, empty_at) {
                    (Some(at), _) | (None, Some(at)) => at,
                    (None, None) => super::current_position(&mut sql, settings.mariadb).await?,
                };
                store_first = Some((at.checkpoint(), true));
                at
            } else {
                if auto {
                    // A table empty at the first look, in a snapshot taken after it: the rows
                    // committed in between sort before the snapshot's position, so they come
                    // from the snapshot or not at all.
                    for (_, plan) in plans.iter_mut() {
                        if *plan == SnapshotPlan::Nothing {
                            *plan = super::snapshot::appeared_since_empty();
                        }
                    }
                }
                let mut snap =
                    super::snapshot::begin(super::connect_sql(dsn).await?, settings.mariadb, plans)
                        .await?;
                if appeared {
                    // The stream starts where the tables were looked at again, before the
                    // snapshot: what committed in between is in both (duplicates, never a gap).
                    if let Some(at) = empty_at {
                        snap.at = at;
                    }
                }
                if let Some(at) = restarted {
                    // The snapshot is newer than the stored start: streaming from the start
                    // repeats what was committed in between (duplicates, never a gap), and the
                    // rows an earlier run got durable are not read again.
                    tracing::info!(position = %at.checkpoint(), "first start: an earlier run was interrupted; streaming from the position it stored");
                    snap.at = at;
                    let key = match &file_store {
                        Some(store) => store.snapshot_key().map(str::to_string),
                        None => state::mysql::load_snapshot_key(&mut sql, &opts.name).await?,
                    };
                    snap.after = key.and_then(|k| SnapshotKey::decode(&k));
                }
                let at = snap.at.clone();
                store_first = Some((at.checkpoint(), false));
                first = FirstStart::Snapshot(snap);
                at
            }
        }
    };
    if !matches!(first, FirstStart::No) {
        // A position this start chose (a first start's, or a recovery's): an XA transaction
        // prepared before it and committed after it would have its rows before the stream's
        // start, never read. Refused, naming each one and the statements that end it.
        let ours = |t: &str| {
            tables
                .iter()
                .any(|o| t.eq_ignore_ascii_case(&format!("{}.{}", o.database, o.table)))
        };
        let open = admin::xa::prepared_before(&mut sql, &start.file, start.pos, ours).await?;
        if !open.is_empty() {
            // This start's position was not stored: the lease goes back at once, so the
            // start after the fix need not wait for it to expire.
            match &mut file_store {
                Some(store) => {
                    let _ = state::StateStore::release(store, &lease).await;
                }
                None => {
                    let _ = state::mysql::release(&mut sql, &lease).await;
                }
            }
            let _ = sql.disconnect().await;
            return Err(admin::xa::prepared_before_error(
                &format!("{}:{}", start.file, start.pos),
                &open,
                false,
            ));
        }
    }
    tracing::info!(position = %start.checkpoint(), "resuming");
    let _ = sql.disconnect().await;
    // As for Postgres: a run that publishes a snapshot stores its marks first, which sort
    // before the start position.
    let resumed = (!matches!(first, FirstStart::Snapshot(_))).then(|| start.checkpoint());
    Ok(Some(StartPlan {
        lease,
        mariadb: settings.mariadb,
        start,
        first,
        store_first,
        resumed,
        file_store,
    }))
}

/// A stored position checked for resuming (unless `checked` already): against the server's
/// binlog files, their sizes and (MariaDB) GTID state, so that a binlog that started again or
/// another server is a lost position, never a silent skip (see [`admin::position_problem`]). A
/// purged file is lost by file and position; by GTID the server itself says whether it still
/// has what follows.
async fn resumable(
    sql: &mut mysql_async::Conn,
    name: &str,
    mariadb: bool,
    mut resume: Resume,
    checked: bool,
) -> Result<Resume, Error> {
    if !checked {
        admin::require_position(sql, name, &resume, mariadb, false).await?;
    }
    if mariadb && !resume.by_gtid(mariadb) && resume.gtid.is_none() {
        // Track the GTID state from here on, complete in every domain.
        resume.gtid = Some(admin::gtid_at(sql, &resume.file, resume.pos).await?);
    }
    Ok(resume)
}
