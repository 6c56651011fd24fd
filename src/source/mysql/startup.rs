//! The start of a MySQL/MariaDB relay, from its first SQL session to the binlog position its
//! stream opens at: the server and table checks, the lease (through the relay's state store:
//! `outboxd_state` or an offset file; as a standby under `--ha`), the stored position checked
//! against the server's binlog (`--on-position-lost` recovery when it is gone), and a first
//! start's snapshot or the position an interrupted first start stored. Its order is what makes a
//! start safe to interrupt at any step: a lost position stays stored until its replay is
//! confirmed, a first start goes on from where an earlier run stored it, never from the binlog
//! head, and its position is stored before its first event is published. A position a start
//! chooses itself (first start, recovery) is refused while an XA transaction prepared before it
//! that wrote the outbox table is still open (see [`admin::xa`]). The result is a
//! [`StartPlan`] for the source and the lease keeper; the SQL it runs is in [`admin`], the
//! state it reads and writes goes through [`StateStore`].

use super::rows::OutboxTable;
use super::snapshot::Snapshot;
use super::{admin, FirstStart, Resume};
use crate::dsn::DbDsn;
use crate::event::Checkpoint;
use crate::source::snapshot::{SnapshotKey, SnapshotMode, SnapshotPlan};
use crate::source::startup::{self, PositionLostPolicy, StartOptions};
use crate::state::{Lease, StateStore};
use crate::Error;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What a MySQL/MariaDB relay's start works on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Source<'a> {
    pub dsn: &'a DbDsn,
    /// The outbox tables (`--table`), all in the DSN's database.
    pub tables: &'a [OutboxTable],
}

/// Where a MySQL/MariaDB source begins, as its start decided.
pub(crate) struct MyStart {
    /// Whether the server writes MariaDB GTIDs.
    pub mariadb: bool,
    /// Where the stream starts.
    pub start: Resume,
    /// What the source publishes from the tables before streaming.
    pub first: FirstStart,
    /// Which server the relay reads (`crate::identity`); `None` when it would not say.
    pub identity: Option<crate::identity::SourceIdentity>,
}

/// How a MySQL/MariaDB relay streams (see [`startup::StartPlan`]).
pub(crate) type StartPlan<St> = startup::StartPlan<St, MyStart>;

/// Prepares the start of a MySQL/MariaDB relay on `store` (see the module's documentation);
/// `None` when a standby was asked to stop before it got the lease.
pub(crate) async fn start_plan<St: StateStore>(
    src: Source<'_>,
    store: St,
    opts: &StartOptions,
    shutdown: &CancellationToken,
) -> Result<Option<StartPlan<St>>, Error> {
    let mut sql = super::connect_state(src.dsn).await?;
    let mariadb = admin::require_binlog(&mut sql).await?.mariadb;
    for t in src.tables {
        admin::require_table(&mut sql, t).await?;
    }
    let Some((mut store, mut lease, stored)) = startup::take_lease(store, opts, shutdown).await?
    else {
        return Ok(None);
    };
    let mut at = At {
        sql,
        src,
        opts,
        mariadb,
    };
    // A first start an earlier run began stored where it started (before publishing): this one
    // goes on from there, never from the binlog head (which would skip what was committed in
    // between).
    let (stored, first_start_at) = if lease.first_start {
        (None, stored)
    } else {
        (stored, None)
    };
    let mut resume_from = stored.as_ref().and_then(Resume::from_checkpoint);
    // Whether the stored position was already checked against the server's binlog.
    let mut checked = false;
    // Its coordinates are not this server's but the server holds its GTID state: why.
    let mut relocate_to = None;
    let mut recovery = None;
    if let (Some(resume), PositionLostPolicy::Poll) = (&resume_from, opts.on_position_lost) {
        // With recovery on, a purged stored file counts as lost even where the GTID state
        // might still resume: a needless replay gives duplicates, a wrong guess a gap.
        let verdict = admin::require_position(&mut at.sql, &opts.name, resume, mariadb, true).await;
        checked = verdict.is_ok();
        if let Ok(admin::Verdict::ByGtid(why)) = &verdict {
            relocate_to = Some(why.clone());
        }
        if let Err(Error::PositionLost { problem, .. }) = verdict {
            recovery = Some(at.recover(&mut store, &lease, resume, &problem).await?);
            // The old position stays stored until the replay's rows are confirmed: a crash
            // before that replays again.
            resume_from = None;
        }
    }
    crate::progress::table_phase(match recovery {
        Some(_) => crate::progress::Phase::Replay,
        None => crate::progress::Phase::Snapshot,
    });
    let (start, first, store_first) = match (resume_from, recovery) {
        (Some(resume), _) => {
            let stored_at = resume.checkpoint();
            let (start, moved) = resumable(
                &mut at.sql,
                &opts.name,
                mariadb,
                resume,
                checked,
                relocate_to,
            )
            .await?;
            if let Some(why) = moved {
                // The forward-only rule would never let this server's coordinates replace
                // the other binlog's (they may sort before them): the same GTID state is
                // stored at this server's coordinates before anything is published.
                store.replace_position(&lease, &start.checkpoint()).await?;
                log_relocated(&stored_at, &start, &why);
            }
            (start, FirstStart::No, None)
        }
        (None, Some(snap)) => (snap.at.clone(), FirstStart::Snapshot(snap), None),
        (None, None) => at.first_start(&mut store, first_start_at).await?,
    };
    if !matches!(first, FirstStart::No) {
        if let Err(e) = at.refuse_open_xa(&mut store, &lease, &start).await {
            let _ = at.sql.disconnect().await;
            return Err(e);
        }
    }
    if let Some((position, done)) = &store_first {
        // Before the first event is published: a relay killed at any moment of its first
        // start resumes here.
        store.store_start(&lease, position, *done).await?;
        tracing::info!(position = %position, "first start: position stored");
        if *done {
            lease.first_start = false;
        }
    }
    let identity = super::identity::identity_or_unknown(&mut at.sql, mariadb).await;
    tracing::info!(position = %start.checkpoint(), "resuming");
    let _ = at.sql.disconnect().await;
    // As for Postgres: a run that publishes a snapshot stores its marks first, which sort
    // before the start position.
    let resumed = (!matches!(first, FirstStart::Snapshot(_))).then(|| start.checkpoint());
    Ok(Some(StartPlan {
        store,
        lease,
        resumed,
        source: MyStart {
            mariadb,
            start,
            first,
            identity,
        },
    }))
}

/// What the steps of a start share: its SQL session and what it starts.
struct At<'a> {
    sql: mysql_async::Conn,
    src: Source<'a>,
    opts: &'a StartOptions,
    mariadb: bool,
}

impl At<'_> {
    /// `--on-position-lost poll` after the stored position `resume` was found lost (`problem`):
    /// a snapshot of the rows created since the last durable commit (minus the margin), whose
    /// position the stream goes on from.
    async fn recover<St: StateStore>(
        &mut self,
        store: &mut St,
        lease: &Lease,
        resume: &Resume,
        problem: &str,
    ) -> Result<Snapshot, Error> {
        let opts = self.opts;
        // From the store the position came from: an offset file keeps no commit times, so
        // the replay starts earlier.
        let commit = store
            .load(&opts.name)
            .await?
            .map(|s| s.commit)
            .unwrap_or_default();
        // Binlog commit times are whole seconds (truncated): one more second of margin.
        let since = startup::replay_start(
            &commit,
            None,
            opts.replay_since,
            opts.recovery_margin,
            Duration::from_secs(2),
        );
        let plans = super::snapshot::plan_tables(
            &mut self.sql,
            self.src.tables,
            &SnapshotMode::Since(since),
        )
        .await?;
        let mut snap =
            super::snapshot::begin(super::connect_sql(self.src.dsn).await?, self.mariadb, plans)
                .await?;
        if !snap.at.checkpoint().is_after(&resume.checkpoint()) {
            // The new binlog's positions sort before the lost one (it started again, or
            // another server's numbers are lower): the store would never let them replace
            // it. A marker sorting before all of them stands in, still a lost position to
            // a start that finds it, so a replay cut off runs again.
            let marker = admin::lost_marker(&resume.file);
            store.replace_position(lease, &marker).await?;
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
        Ok(snap)
    }

    /// A first start (docs/message-format.md): the rows already in the table come from a
    /// consistent snapshot whose binlog position is where streaming starts; an interrupted one
    /// goes on from the position it stored (`restarted_at`). Returns the start, what is
    /// published first, and the position to store before that (and whether the first start
    /// is over with it).
    async fn first_start<St: StateStore>(
        &mut self,
        store: &mut St,
        restarted_at: Option<Checkpoint>,
    ) -> Result<(Resume, FirstStart, Option<(Checkpoint, bool)>), Error> {
        let (opts, mariadb) = (self.opts, self.mariadb);
        let sql = &mut self.sql;
        // A first look at the tables before the position is read, so `auto` on a non-empty
        // table without a status column refuses before anything is stored.
        let mut plans = super::snapshot::plan_tables(sql, self.src.tables, &opts.snapshot).await?;
        let auto = opts.snapshot == SnapshotMode::Auto;
        let restarted = match restarted_at.as_ref().and_then(Resume::from_checkpoint) {
            Some(r) => {
                let stored_at = r.checkpoint();
                let (at, moved) = resumable(sql, &opts.name, mariadb, r, false, None).await?;
                // Stored below (store_start) before anything is published.
                if let Some(why) = moved {
                    log_relocated(&stored_at, &at, &why);
                }
                Some(at)
            }
            None => None,
        };
        // Read before the empty tables are looked at again: a row committed after the first
        // look is in the stream from here, or seen by the second look.
        let nothing =
            |plans: &[(_, SnapshotPlan)]| plans.iter().all(|(_, p)| *p == SnapshotPlan::Nothing);
        let empty_at = match (&restarted, nothing(&plans)) {
            (None, true) => Some(super::current_position(sql, mariadb).await?),
            _ => None,
        };
        let appeared = match &empty_at {
            Some(_) if auto => super::snapshot::look_again(sql, &mut plans).await?,
            _ => false,
        };
        if nothing(&plans) {
            let at = match (restarted, empty_at) {
                (Some(at), _) | (None, Some(at)) => at,
                (None, None) => super::current_position(sql, mariadb).await?,
            };
            let position = at.checkpoint();
            return Ok((at, FirstStart::Empty, Some((position, true))));
        }
        if auto {
            // A table empty at the first look, in a snapshot taken after it: the rows
            // committed in between sort before the snapshot's position, so they come from the
            // snapshot or not at all.
            for (_, plan) in plans.iter_mut() {
                if *plan == SnapshotPlan::Nothing {
                    *plan = super::snapshot::appeared_since_empty();
                }
            }
        }
        let mut snap =
            super::snapshot::begin(super::connect_sql(self.src.dsn).await?, mariadb, plans).await?;
        if let (true, Some(at)) = (appeared, empty_at) {
            // The stream starts where the tables were looked at again, before the snapshot:
            // what committed in between is in both (duplicates, never a gap).
            snap.at = at;
        }
        if let Some(at) = restarted {
            // The snapshot is newer than the stored start: streaming from the start repeats
            // what was committed in between (duplicates, never a gap), and the rows an earlier
            // run got durable are not read again.
            tracing::info!(position = %at.checkpoint(), "first start: an earlier run was interrupted; streaming from the position it stored");
            snap.at = at;
            let key = store.load(&opts.name).await?.and_then(|s| s.snapshot_key);
            snap.after = key.and_then(|k| SnapshotKey::decode(&k));
        }
        let at = snap.at.clone();
        let position = at.checkpoint();
        Ok((at, FirstStart::Snapshot(snap), Some((position, false))))
    }

    /// A position this start chose (a first start's, or a recovery's): an XA transaction
    /// prepared before it and committed after it would have its rows before the stream's start,
    /// never read. Refused, naming each one and the statements that end it.
    async fn refuse_open_xa<St: StateStore>(
        &mut self,
        store: &mut St,
        lease: &Lease,
        start: &Resume,
    ) -> Result<(), Error> {
        let tables = self.src.tables;
        let ours = |t: &str| {
            tables
                .iter()
                .any(|o| t.eq_ignore_ascii_case(&format!("{}.{}", o.database, o.table)))
        };
        let open = admin::xa::prepared_before(&mut self.sql, &start.file, start.pos, ours).await?;
        if open.is_empty() {
            return Ok(());
        }
        // This start's position was not stored: the lease goes back at once, so the start
        // after the fix need not wait for it to expire.
        let _ = store.release(lease).await;
        Err(admin::xa::prepared_before_error(
            &format!("{}:{}", start.file, start.pos),
            &open,
            false,
        ))
    }
}

/// Names the server's own coordinates of the stored GTID state after a GTID resume on another
/// binlog.
fn log_relocated(stored: &Checkpoint, start: &Resume, why: &str) {
    tracing::warn!(
        stored = %stored,
        position = %start.checkpoint(),
        reason = %why,
        "resuming by GTID on another binlog: the stored GTID state is at {}:{} on this server; its position is stored in this server's coordinates from now on",
        start.file,
        start.pos
    );
}

/// A stored position checked for resuming (unless `checked` already): against the server's
/// binlog files, their sizes and (MariaDB) GTID state, so that a binlog that started again or
/// another server is a lost position, never a silent skip (see [`admin::position_verdict`]). A
/// purged file is lost by file and position; by GTID the server itself says whether it still
/// has what follows. Where the coordinates are not this server's but it holds the stored GTID
/// state (`relocate`, or found here), the start is that state at this server's coordinates,
/// returned with the reason.
async fn resumable(
    sql: &mut mysql_async::Conn,
    name: &str,
    mariadb: bool,
    mut resume: Resume,
    checked: bool,
    mut relocate: Option<String>,
) -> Result<(Resume, Option<String>), Error> {
    if !checked {
        if let admin::Verdict::ByGtid(why) =
            admin::require_position(sql, name, &resume, mariadb, false).await?
        {
            relocate = Some(why);
        }
    }
    if let Some(why) = relocate {
        let found = match (&resume.gtid, &resume.mysql_gtids) {
            (Some(state), _) if mariadb => admin::relocate::locate_mariadb(sql, state).await?,
            (_, Some(set)) if !mariadb => admin::relocate::locate_mysql(sql, set).await?,
            _ => None,
        };
        let Some((file, pos)) = found else {
            return Err(Error::PositionLost {
                problem: format!(
                    "{why}, but no binlog position of the server has exactly that state (its domains interleave otherwise)"
                ),
                fix: admin::replaced_binlog_fix(name),
            });
        };
        resume.file = file;
        resume.pos = pos;
        return Ok((resume, Some(why)));
    }
    if mariadb && !resume.by_gtid(mariadb) && resume.gtid.is_none() {
        // Track the GTID state from here on, complete in every domain.
        resume.gtid = Some(admin::gtid_at(sql, &resume.file, resume.pos).await?);
    }
    Ok((resume, None))
}
