//! `outboxd run`: wires one source, the relay and one sink together with the state store, and
//! owns the order of a graceful stop — the source stops at a transaction boundary, the relay
//! drains every confirmation, the final position reaches the server and the state table, and
//! the lease is released.

use crate::dsn::{DbDsn, SinkDsn};
use crate::event::{format_lsn, Checkpoint};
use crate::outbox::{ColumnMap, TableName};
use crate::relay::{self, RelayOptions, RelayStats};
use crate::sink::rabbitmq::{DeclareMode, RabbitConfig, RabbitSink};
use crate::sink::stdout::StdoutSink;
use crate::sink::{AnySink, Sink};
use crate::source::postgres::snapshot::{self, SnapshotMode, SnapshotPlan};
use crate::source::postgres::{self as pg, admin, PgSourceConfig};
use crate::source::{Budget, Outlet, SourceLink};
use crate::state;
use crate::Error;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// Everything `run` needs, already validated.
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub name: String,
    pub slot: String,
    pub publication: String,
    pub table: TableName,
    pub columns: ColumnMap,
    /// MySQL/MariaDB source settings (ignored by other sources).
    pub mysql: MySqlOptions,
    pub sink: SinkDsn,
    pub commit_offsets: bool,
    pub max_inflight_bytes: usize,
    pub relay: RelayOptions,
    /// What a first start publishes of the rows already in the table.
    pub snapshot: SnapshotMode,
    /// What to do when the log position cannot be resumed.
    pub on_position_lost: PositionLostPolicy,
    /// Recovery replays rows created since this time instead of the computed one.
    pub replay_since: Option<chrono::DateTime<chrono::Utc>>,
    /// Smallest margin recovery subtracts from the last durable commit time.
    pub recovery_margin: Duration,
    /// High availability: wait as a standby while another relay holds the lease, and stop
    /// publishing by our own clock before our lease can expire.
    pub ha: bool,
    pub rabbit: RabbitOptions,
}

/// RabbitMQ sink settings from the command line (the URL is in [`RunConfig::sink`]).
#[derive(Debug, Clone, Default)]
pub struct RabbitOptions {
    pub exchange: String,
    pub declare: DeclareMode,
    pub max_message_bytes: usize,
    pub ca_file: Option<std::path::PathBuf>,
    pub cert_file: Option<std::path::PathBuf>,
    pub key_file: Option<std::path::PathBuf>,
    /// `--partitions`, `--group-partitions`, `--queue-type`, `--partition-routing`.
    pub partitioning: crate::sink::partition::Partitioning,
}

/// `--on-position-lost`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum PositionLostPolicy {
    /// Stop with exit 3 and the fix.
    #[default]
    Fail,
    /// Open a fresh position and publish again, from the table, every row that may have been
    /// committed after the last confirmed one; then stream.
    Poll,
}

/// Where a replay through the table starts after a lost position: the last durable commit
/// time minus a margin no smaller than the largest commit-vs-`created_at` gap seen (so a long
/// producer transaction's row is not missed), or `--replay-since`.
pub fn recovery_since(
    row: &state::postgres::StateRow,
    replay_since: Option<chrono::DateTime<chrono::Utc>>,
    margin: Duration,
) -> chrono::DateTime<chrono::Utc> {
    if let Some(s) = replay_since {
        return s;
    }
    let gap = Duration::from_millis(row.commit_gap_ms.unwrap_or(0).max(0) as u64 + 1000);
    let margin = chrono::Duration::from_std(margin.max(gap)).unwrap_or(chrono::Duration::days(1));
    let base = row
        .position_commit_at
        .or(row.created_at)
        .unwrap_or(chrono::DateTime::<chrono::Utc>::MIN_UTC + chrono::Duration::days(1));
    base - margin
}

/// Runs a Postgres relay until `shutdown` is cancelled (then stops gracefully) or an error.
pub async fn run_postgres(
    dsn: DbDsn,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    let app = format!("outboxd_{}", cfg.name);
    let mut sql = pg::connect_sql(&dsn, &app).await?;
    admin::require_logical(&sql).await?;
    admin::require_table(&sql, &cfg.table).await?;
    let holder = state::holder_id();
    let lease = loop {
        match state::postgres::acquire(&mut sql, &cfg.name, &cfg.slot, &cfg.publication, &holder)
            .await
        {
            Err(Error::LeaseHeld(who)) if cfg.ha => {
                tracing::info!(held = %who, "standby: waiting for the lease");
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(Arc::new(RelayStats::default())),
                    _ = tokio::time::sleep(state::RENEW_INTERVAL) => {}
                }
            }
            other => break other?,
        }
    };
    tracing::info!(name = %cfg.name, epoch = lease.epoch, holder = %lease.holder, "lease acquired");
    if cfg.ha {
        // A paused old leader's walsender may still hold the slot: end it, or the stream
        // cannot start. Its relay has stopped publishing by its own clock already.
        let ended = sql
            .execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active AND active_pid <> pg_backend_pid()",
                &[&cfg.slot],
            )
            .await?;
        if ended > 0 {
            tracing::warn!(slot = %cfg.slot, "took over: ended the previous leader's walsender");
        }
    }
    admin::ensure_publication(&sql, &cfg.publication, &cfg.table).await?;

    // Decided before the slot exists, so `auto` on a non-empty table without a status column
    // refuses without leaving a slot behind.
    let plan = match (&lease.replay_since, lease.first_start) {
        (Some(since), _) => {
            snapshot::plan(&sql, &cfg.table, &cfg.columns, &SnapshotMode::Since(*since)).await?
        }
        (None, true) => snapshot::plan(&sql, &cfg.table, &cfg.columns, &cfg.snapshot).await?,
        (None, false) => SnapshotPlan::Nothing,
    };
    let mut plan = plan;
    let mut lease = lease;
    let mut slot_info = admin::slot(&sql, &cfg.slot).await?;
    let lost = match &slot_info {
        None if !lease.first_start => Some(format!("replication slot {:?} of relay {:?} does not exist, but its state does: it was dropped", cfg.slot, cfg.name)),
        Some(s) if s.wal_status.as_deref() == Some("lost") => Some(format!("replication slot {:?} was invalidated (wal_status = lost): the WAL it needed was removed", cfg.slot)),
        _ => None,
    };
    if let (Some(problem), PositionLostPolicy::Poll) = (&lost, cfg.on_position_lost) {
        let row = state::postgres::load(&sql, &cfg.name)
            .await?
            .ok_or_else(|| Error::Other("state row vanished".into()))?;
        let since = recovery_since(&row, cfg.replay_since, cfg.recovery_margin);
        if slot_info.is_some() {
            admin::drop_slot(&sql, &cfg.slot).await?;
            slot_info = None;
        }
        // Recorded first: if this run dies before the replay is durable, the next one
        // replays again.
        state::postgres::set_replay(&sql, &lease, since).await?;
        lease.replay_since = Some(since);
        lease.first_start = true;
        plan = snapshot::plan(&sql, &cfg.table, &cfg.columns, &SnapshotMode::Since(since)).await?;
        let rows: i64 = sql
            .query_one(
                &format!(
                    "SELECT count(*) FROM {} WHERE {} >= $1",
                    cfg.table.pg_quoted(),
                    crate::outbox::pg_ident(cfg.columns.get("created_at"))
                ),
                &[&since],
            )
            .await?
            .get(0);
        tracing::error!(
            problem = %problem,
            replay_since = %since.to_rfc3339(),
            rows,
            "POSITION LOST: recovering through the table (--on-position-lost poll): opening a fresh slot and publishing again every row created since then; expect duplicates"
        );
    }
    let start = match slot_info {
        Some(slot) => {
            if slot.wal_status.as_deref() == Some("lost") {
                return Err(Error::PositionLost {
                    problem: format!("replication slot {:?} was invalidated (wal_status = lost): the WAL it needed was removed", cfg.slot),
                    fix: admin::lost_slot_fix(&cfg.name, &cfg.slot),
                });
            }
            if slot.plugin.as_deref() != Some("pgoutput") || slot.database.as_deref() != Some(dsn.database.as_str()) {
                return Err(Error::config(
                    format!("slot {:?} exists but is not a pgoutput slot of database {:?} (plugin {:?}, database {:?})", cfg.slot, dsn.database, slot.plugin, slot.database),
                    format!("use another --slot, or SELECT pg_drop_replication_slot('{}'); if nothing else uses it", cfg.slot),
                ));
            }
            // The slot learns durable positions through status updates, the state table through
            // the lease keeper, each on its own one-second clock: after a SIGKILL either may be
            // behind. Both only ever hold positions the sink made durable, so resume from the
            // later one; the server skips transactions that committed before it.
            let confirmed = slot.confirmed_flush_lsn.unwrap_or(0);
            let stored = state::postgres::load(&sql, &cfg.name)
                .await?
                .and_then(|row| row.position_lsn)
                .unwrap_or(0);
            if stored > confirmed {
                tracing::info!(slot_position = %format_lsn(confirmed), stored = %format_lsn(stored), "the stored position is ahead of the slot's: resuming from it");
            }
            confirmed.max(stored)
        }
        // The slot first, the table read after: overlap gives duplicates, never a gap.
        None if lease.first_start => admin::create_slot(&sql, &cfg.slot).await?,
        None => {
            return Err(Error::PositionLost {
                problem: format!("replication slot {:?} of relay {:?} does not exist, but its state does: it was dropped", cfg.slot, cfg.name),
                fix: admin::lost_slot_fix(&cfg.name, &cfg.slot),
            })
        }
    };
    tracing::info!(slot = %cfg.slot, position = %format_lsn(start), "resuming");

    let source_cfg = PgSourceConfig {
        dsn: dsn.clone(),
        name: cfg.name.clone(),
        table: cfg.table.clone(),
        columns: cfg.columns.clone(),
        slot: cfg.slot.clone(),
        publication: cfg.publication.clone(),
        status_interval: Duration::from_secs(1),
        snapshot: plan,
    };
    let (commits_tx, commits_rx) = watch::channel(state::DurableCommit::default());
    let store = state::postgres::PgStateStore::new(dsn.clone(), app.clone()).with_slot(&cfg.slot);
    drive(&cfg, store, lease, commits_rx, move |link| {
        pg::run(source_cfg, link, start, commits_tx, shutdown)
    })
    .await
}

/// Builds the sink named by `--sink`.
pub fn make_sink(cfg: &RunConfig) -> Result<AnySink, Error> {
    Ok(match &cfg.sink {
        SinkDsn::Stdout => {
            let p = &cfg.rabbit.partitioning;
            if p.partitions > 0 || p.sends_headers() {
                tracing::warn!("--partitions and --group-partitions apply to a RabbitMQ sink: the stdout sink ignores them");
            }
            AnySink::Stdout(StdoutSink::new(cfg.commit_offsets))
        }
        SinkDsn::Amqp(url) => AnySink::Rabbit(Box::new(RabbitSink::new(RabbitConfig {
            url: url.clone(),
            exchange: cfg.rabbit.exchange.clone(),
            declare: cfg.rabbit.declare,
            max_message_bytes: cfg.rabbit.max_message_bytes,
            op_timeout: cfg.relay.confirm_timeout,
            ca_file: cfg.rabbit.ca_file.clone(),
            cert_file: cfg.rabbit.cert_file.clone(),
            key_file: cfg.rabbit.key_file.clone(),
            connection_name: format!("outboxd {}", cfg.name),
            partitioning: cfg.rabbit.partitioning.clone(),
        })?)),
    })
}

/// Runs poll mode on a Postgres table until `shutdown`. No lease: several relays may poll one
/// table, `SKIP LOCKED` keeps their batches apart.
pub async fn run_poll_postgres(
    dsn: DbDsn,
    cfg: RunConfig,
    poll: crate::source::poll::PollOptions,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    let mut sink = make_sink(&cfg)?;
    if !sink.stores_position() {
        return Err(Error::config(
            "poll mode marks rows published once the sink has them, which the stdout sink does only with --commit-offsets",
            "add --commit-offsets (or use an amqp:// sink)",
        ));
    }
    {
        let sql = pg::connect_sql(&dsn, &format!("outboxd_{}", cfg.name)).await?;
        admin::require_table(&sql, &cfg.table).await?;
    }
    let (ack_tx, ack_rx) = watch::channel::<Option<Checkpoint>>(None);
    let (ev_tx, ev_rx) = mpsc::channel(4096);
    let link = SourceLink {
        outlet: Outlet {
            events: ev_tx,
            budget: Budget::new(cfg.max_inflight_bytes),
        },
        acks: ack_rx,
    };
    let poll_cfg = crate::source::poll::PollConfig {
        dsn,
        name: cfg.name.clone(),
        table: cfg.table.clone(),
        columns: cfg.columns.clone(),
        batch: poll.batch,
        interval: poll.interval,
        // Bounded by the confirm timeout: a batch waits at most that long for its confirms.
        deadline: cfg.relay.confirm_timeout.max(Duration::from_secs(1)),
        notify_channel: poll
            .notify
            .then(|| crate::source::poll::notify_channel(&cfg.table)),
    };
    let stats = Arc::new(RelayStats::default());
    let t = crate::telemetry::get();
    t.mark_started();
    // Poll mode has no stream: it is "streaming" while it can poll.
    t.source_streaming.set(1);
    let source = crate::source::poll::run(poll_cfg, link, shutdown);
    relay_and_source(&mut sink, ev_rx, ack_tx, &cfg.relay, &stats, source).await?;
    Ok(stats)
}

async fn relay_and_source<S: Sink>(
    sink: &mut S,
    ev_rx: mpsc::Receiver<crate::source::SourceMsg>,
    ack_tx: watch::Sender<Option<Checkpoint>>,
    opts: &RelayOptions,
    stats: &RelayStats,
    source: impl std::future::Future<Output = Result<(), Error>>,
) -> Result<(), Error> {
    let relay = async move {
        // ack_tx is dropped when the relay ends: that tells the source the last
        // acknowledgement has been given.
        relay::run(sink, ev_rx, ack_tx, opts, stats).await
    };
    tokio::try_join!(relay, source).map(|_| ())
}

// ---------------------------------------------------------------------------------------------
// MySQL / MariaDB
// ---------------------------------------------------------------------------------------------

/// MySQL/MariaDB source settings from the command line.
#[derive(Debug, Clone)]
pub struct MySqlOptions {
    /// The zone `DATETIME` values are written in (`--source-time-zone`).
    pub time_zone: crate::source::mysql::rows::SourceTz,
    /// Largest transaction held until its commit (`--txn-buffer`).
    pub txn_buffer_bytes: usize,
    /// Heartbeat period asked of the server; the read timeout is three of them plus 2 s.
    pub heartbeat: Duration,
}

impl Default for MySqlOptions {
    fn default() -> Self {
        MySqlOptions {
            time_zone: Default::default(),
            txn_buffer_bytes: 16 * 1024 * 1024,
            heartbeat: Duration::from_secs(1),
        }
    }
}

/// The outbox table of a MySQL source: `--table` in the DSN's database.
pub fn mysql_table(
    dsn: &DbDsn,
    cfg: &RunConfig,
) -> Result<crate::source::mysql::rows::OutboxTable, Error> {
    mysql_outbox_table(dsn, &cfg.table, &cfg.columns, cfg.mysql.time_zone)
}

/// The outbox table of a MySQL source: `--table` in the DSN's database.
pub fn mysql_outbox_table(
    dsn: &DbDsn,
    table: &TableName,
    columns: &ColumnMap,
    tz: crate::source::mysql::rows::SourceTz,
) -> Result<crate::source::mysql::rows::OutboxTable, Error> {
    if dsn.database.is_empty() {
        return Err(Error::config(
            "the MySQL DSN names no database: the relay reads the outbox table of the DSN's database and keeps its state there",
            "add the database to the DSN, e.g. mysql://user@host:3306/app",
        ));
    }
    if let Some(db) = &table.schema {
        if *db != dsn.database {
            return Err(Error::config(
                format!(
                    "--table {db}.{} is not in the DSN's database {:?}",
                    table.name, dsn.database
                ),
                format!(
                    "name the table's database in the DSN (mysql://…/{db}) and pass --table {}",
                    table.name
                ),
            ));
        }
    }
    Ok(crate::source::mysql::rows::OutboxTable {
        database: dsn.database.clone(),
        table: table.name.clone(),
        columns: columns.clone(),
        tz,
    })
}

/// Runs a MySQL/MariaDB relay until `shutdown` is cancelled (then stops gracefully) or an error.
pub async fn run_mysql(
    dsn: DbDsn,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    use crate::source::mysql::{self as my, admin as my_admin};
    let table = mysql_table(&dsn, &cfg)?;
    let mut sql = my::connect_state(&dsn).await?;
    let settings = my_admin::require_binlog(&mut sql).await?;
    my_admin::require_table(&mut sql, &table).await?;
    let holder = state::holder_id();
    let (lease, stored) = state::mysql::acquire(&mut sql, &cfg.name, &holder).await?;
    tracing::info!(name = %cfg.name, epoch = lease.epoch, holder = %lease.holder, "lease acquired");
    let mut first = my::FirstStart::No;
    let start = match stored.as_ref().and_then(my::Resume::from_checkpoint) {
        Some(mut resume) => {
            // By GTID the server itself says whether it still has what follows; by file and
            // position, the file must still be there.
            if !resume.by_gtid(settings.mariadb) {
                my_admin::require_position(&mut sql, &cfg.name, &resume.file).await?;
                if settings.mariadb && resume.gtid.is_none() {
                    // Track the GTID state from here on, complete in every domain.
                    resume.gtid =
                        Some(my_admin::gtid_at(&mut sql, &resume.file, resume.pos).await?);
                }
            }
            resume
        }
        None => {
            // First start (CONTRACT §3): the rows already in the table come from a consistent
            // snapshot whose binlog position is where streaming starts. The position and the
            // first start's end are stored once the snapshot is durable.
            let plan = my::snapshot::plan(&mut sql, &table, &cfg.snapshot).await?;
            if plan == SnapshotPlan::Nothing {
                first = my::FirstStart::Empty;
                my::current_position(&mut sql, settings.mariadb).await?
            } else {
                let snap =
                    my::snapshot::begin(my::connect_sql(&dsn).await?, settings.mariadb, plan)
                        .await?;
                let at = snap.at.clone();
                first = my::FirstStart::Snapshot(snap);
                at
            }
        }
    };
    tracing::info!(position = %start.checkpoint(), "resuming");
    let _ = sql.disconnect().await;

    let source_cfg = my::MySqlSourceConfig {
        dsn: dsn.clone(),
        name: cfg.name.clone(),
        table,
        server_id: my::server_id_for(&cfg.name),
        heartbeat: cfg.mysql.heartbeat,
        read_timeout: cfg.mysql.heartbeat * 3 + Duration::from_secs(2),
        txn_buffer_bytes: cfg.mysql.txn_buffer_bytes,
        mariadb: settings.mariadb,
    };
    let store = state::mysql::MyStateStore::new(dsn.clone());
    // The binlog source reports no commit times yet: recovery through the table is
    // Postgres-only for now.
    let (_commits_tx, commits_rx) = watch::channel(state::DurableCommit::default());
    drive(&cfg, store, lease, commits_rx, move |link| {
        my::run(source_cfg, link, start, first, shutdown)
    })
    .await
}

/// Runs a source, the relay and the configured sink with a lease keeper beside them, until the
/// source ends (graceful stop) or something fails; then stores the final position and releases
/// the lease.
async fn drive<St, F, Fut>(
    cfg: &RunConfig,
    store: St,
    lease: state::Lease,
    commits: watch::Receiver<state::DurableCommit>,
    source: F,
) -> Result<Arc<RelayStats>, Error>
where
    St: state::StateStore + 'static,
    F: FnOnce(SourceLink) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    let (ack_tx, ack_rx) = watch::channel::<Option<Checkpoint>>(None);
    let (ev_tx, ev_rx) = mpsc::channel(4096);
    let link = SourceLink {
        outlet: Outlet {
            events: ev_tx,
            budget: Budget::new(cfg.max_inflight_bytes),
        },
        acks: ack_rx.clone(),
    };
    let lease_stop = CancellationToken::new();
    let mut sink = make_sink(cfg)?;
    let mut lease_task = tokio::spawn(state::keep_lease(
        store,
        lease,
        ack_rx,
        commits,
        cfg.ha,
        lease_stop.clone(),
    ));
    let source = source(link);
    let stats = Arc::new(RelayStats::default());
    crate::telemetry::get().mark_started();
    let work = relay_and_source(&mut sink, ev_rx, ack_tx, &cfg.relay, &stats, source);
    let result = tokio::select! {
        r = work => r,
        r = &mut lease_task => {
            // The lease keeper only ends early on a lost lease.
            return Err(r.unwrap_or_else(|e| Err(Error::Other(format!("lease task: {e}")))).err().unwrap_or_else(|| Error::Other("lease keeper stopped".into())));
        }
    };
    lease_stop.cancel();
    let lease_result = lease_task
        .await
        .unwrap_or_else(|e| Err(Error::Other(format!("lease task: {e}"))));
    result?;
    lease_result?;
    Ok(stats)
}
