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
use crate::state::{self, Lease};
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
    let lease =
        state::postgres::acquire(&mut sql, &cfg.name, &cfg.slot, &cfg.publication, &holder).await?;
    tracing::info!(name = %cfg.name, epoch = lease.epoch, holder = %lease.holder, "lease acquired");
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
            slot.confirmed_flush_lsn.unwrap_or(0)
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
    let (commits_tx, commits_rx) = watch::channel(state::postgres::DurableCommit::default());
    let mut lease_task = tokio::spawn(keep_lease(
        dsn.clone(),
        app.clone(),
        lease.clone(),
        ack_rx,
        commits_rx,
        lease_stop.clone(),
    ));
    let source = pg::run(source_cfg, link, start, commits_tx, shutdown.clone());
    let stats = Arc::new(RelayStats::default());

    let mut sink = make_sink(&cfg)?;
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

/// Builds the sink named by `--sink`.
pub fn make_sink(cfg: &RunConfig) -> Result<AnySink, Error> {
    Ok(match &cfg.sink {
        SinkDsn::Stdout => AnySink::Stdout(StdoutSink::new(cfg.commit_offsets)),
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

/// Renews the lease about every second and stores the newest durable position with it; at
/// the end, stores the final position and releases the lease.
async fn keep_lease(
    dsn: DbDsn,
    app: String,
    lease: Lease,
    mut acks: watch::Receiver<Option<Checkpoint>>,
    commits: watch::Receiver<state::postgres::DurableCommit>,
    stop: CancellationToken,
) -> Result<(), Error> {
    let mut client: Option<tokio_postgres::Client> = None;
    let mut written: Option<u64> = None;
    // Until the first acknowledgement, the first start's snapshot (or a requested replay) is
    // not known to be durable: only then is it marked done.
    let mut needs_init = lease.first_start || lease.replay_since.is_some();
    let mut tick = tokio::time::interval(state::RENEW_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stopping = false;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.cancelled(), if !stopping => stopping = true,
        }
        let _ = acks.has_changed();
        let pos = match &*acks.borrow_and_update() {
            Some(Checkpoint::Lsn(l)) if Some(*l) != written => Some(*l),
            _ => None,
        };
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = match pg::connect_sql(&dsn, &app).await {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::warn!(error = %e, "state store unreachable; lease renewal retries");
                    if stopping {
                        return Ok(());
                    }
                    continue;
                }
            };
        }
        let c = client.as_ref().expect("connected above");
        let commit = commits.borrow().clone();
        match state::postgres::renew(c, &lease, pos, &commit).await {
            Ok(()) => {
                if pos.is_some() {
                    written = pos;
                }
                if needs_init && written.is_some() {
                    match state::postgres::mark_initialized(c, &lease).await {
                        Ok(()) => needs_init = false,
                        Err(e @ Error::Leadership(_)) => return Err(e),
                        Err(e) => {
                            tracing::warn!(error = %e, "could not mark the first start done; retrying")
                        }
                    }
                }
            }
            Err(e @ Error::Leadership(_)) => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "lease renewal failed; retrying");
                client = None;
                continue;
            }
        }
        if stopping {
            if let Err(e) = state::postgres::release(c, &lease).await {
                tracing::warn!(error = %e, "could not release the lease; it expires by itself");
            }
            return Ok(());
        }
    }
}
