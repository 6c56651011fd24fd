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
    /// The outbox tables (`--table`, repeatable; at least one), sharing one column map.
    pub tables: Vec<TableName>,
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
    /// NATS JetStream sink settings (used when the sink is `nats://` or `tls://`).
    pub nats: NatsOptions,
}

/// NATS sink settings from the command line (the URL is in [`RunConfig::sink`]; `--declare`,
/// `--max-message-bytes`, `--partitions` and the TLS files are shared with RabbitMQ's).
#[derive(Debug, Clone)]
pub struct NatsOptions {
    pub subject: crate::sink::template::Template,
    pub stream: String,
}

impl Default for NatsOptions {
    fn default() -> Self {
        NatsOptions {
            subject: crate::sink::template::Template::parse(
                crate::sink::nats::config::DEFAULT_SUBJECT,
            )
            .expect("the default subject parses"),
            stream: crate::sink::nats::config::DEFAULT_STREAM.into(),
        }
    }
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
    /// `--dead-queue-type`.
    pub dead_queue_type: crate::sink::partition::QueueType,
    /// `--routing-key`, a templated `--exchange`, `--header`, `--format`.
    pub message: crate::sink::format::MessageOptions,
}

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

/// Where a replay through the table starts after a lost position: the last durable commit
/// time minus a margin no smaller than the largest commit-vs-`created_at` gap seen (so a long
/// producer transaction's row is not missed), or `--replay-since`.
pub fn recovery_since(
    row: &state::postgres::StateRow,
    replay_since: Option<chrono::DateTime<chrono::Utc>>,
    margin: Duration,
) -> chrono::DateTime<chrono::Utc> {
    replay_start(
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

/// [`recovery_since`] for any source: `commit` as stored, `fallback` when no commit time was
/// (the state row's creation), and `precision` — how coarse the source's commit times are —
/// added to the gap.
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

/// Runs a Postgres relay until `shutdown` is cancelled (then stops gracefully) or an error.
pub async fn run_postgres(
    dsn: DbDsn,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    let app = format!("outboxd_{}", cfg.name);
    let mut sql = pg::connect_sql(&dsn, &app).await?;
    admin::require_logical(&sql).await?;
    for t in &cfg.tables {
        admin::require_table(&sql, t).await?;
    }
    let holder = state::holder_id();
    let lease = loop {
        match state::postgres::acquire(&mut sql, &cfg.name, &cfg.slot, &cfg.publication, &holder)
            .await
        {
            Err(Error::LeaseHeld(who)) if cfg.ha => {
                if !standby(&who, &shutdown).await {
                    return Ok(Arc::new(RelayStats::default()));
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
    admin::ensure_publication(&sql, &cfg.publication, &cfg.tables).await?;

    // Decided before the slot exists, so `auto` on a non-empty table without a status column
    // refuses without leaving a slot behind.
    let plan = match (&lease.replay_since, lease.first_start) {
        (Some(since), _) => plan_tables(&sql, &cfg, &SnapshotMode::Since(*since)).await?,
        (None, true) => plan_tables(&sql, &cfg, &cfg.snapshot).await?,
        (None, false) => Vec::new(),
    };
    let mut plan = plan;
    let mut lease = lease;
    let mut slot_info = admin::slot(&sql, &cfg.slot).await?;
    // A slot dropped and created again under our name (see state::postgres::slot_replaced).
    let replaced = match (&slot_info, lease.first_start) {
        (Some(s), false) => state::postgres::load(&sql, &cfg.name)
            .await?
            .and_then(|row| state::postgres::slot_replaced(&row, s.confirmed_flush_lsn)),
        _ => None,
    };
    let lost = match &slot_info {
        None if !lease.first_start => Some(format!("replication slot {:?} of relay {:?} does not exist, but its state does: it was dropped", cfg.slot, cfg.name)),
        Some(s) if s.wal_status.as_deref() == Some("lost") => Some(format!("replication slot {:?} was invalidated (wal_status = lost): the WAL it needed was removed", cfg.slot)),
        _ => replaced.clone(),
    };
    if let (Some(problem), PositionLostPolicy::Fail) = (&replaced, cfg.on_position_lost) {
        return Err(Error::PositionLost {
            problem: problem.clone(),
            fix: admin::replaced_slot_fix(&cfg.name, &cfg.slot),
        });
    }
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
        plan = plan_tables(&sql, &cfg, &SnapshotMode::Since(since)).await?;
        let mut rows: i64 = 0;
        for t in &cfg.tables {
            rows += sql
                .query_one(
                    &format!(
                        "SELECT count(*) FROM {} WHERE {} >= $1",
                        t.pg_quoted(),
                        crate::outbox::pg_ident(cfg.columns.get("created_at"))
                    ),
                    &[&since],
                )
                .await?
                .get::<_, i64>(0);
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
            let row = state::postgres::load(&sql, &cfg.name).await?;
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
                    .and_then(|k| snapshot::SnapshotKey::decode(&k));
            }
        }
    }
    state::postgres::record_slot_start(&sql, &lease, start, created_slot).await?;
    // The snapshot's progress marks sort before every stream position, the start included: a
    // run that publishes one has no floor but its own marks (the keeper's ForwardOnly).
    let snapshot_pending = (lease.first_start || lease.replay_since.is_some())
        && plan.iter().any(|(_, p)| *p != SnapshotPlan::Nothing);

    let source_cfg = PgSourceConfig {
        dsn: dsn.clone(),
        name: cfg.name.clone(),
        tables: cfg.tables.clone(),
        columns: cfg.columns.clone(),
        slot: cfg.slot.clone(),
        publication: cfg.publication.clone(),
        // Durable positions reach the slot promptly (at most every STORE_INTERVAL while they
        // move; the library sends nothing more while they do not).
        status_interval: state::STORE_INTERVAL,
        snapshot: plan,
        snapshot_after,
        max_wire_message_bytes: pg::wire_message_limit(cfg.rabbit.max_message_bytes),
    };
    let (commits_tx, commits_rx) = watch::channel(state::DurableCommit::default());
    // The slot is confirmed only up to what the state row holds (pg::run).
    let (stored_tx, stored_rx) = watch::channel(start);
    // A server shutting down waits for the replication stream to close (pg::run).
    let (stopping_tx, stopping_rx) = watch::channel(None);
    let store = state::postgres::PgStateStore::new(dsn.clone(), app.clone())
        .with_slot(&cfg.slot)
        .with_stored(stored_tx)
        .with_server_stopping(stopping_tx);
    let resumed = (!snapshot_pending).then_some(Checkpoint::Lsn(start));
    drive(&cfg, store, lease, None, resumed, commits_rx, move |link| {
        pg::run(
            source_cfg,
            link,
            start,
            stored_rx,
            commits_tx,
            stopping_rx,
            shutdown,
        )
    })
    .await
}

/// What a first start (or a replay) publishes of each table's existing rows.
async fn plan_tables(
    sql: &tokio_postgres::Client,
    cfg: &RunConfig,
    mode: &SnapshotMode,
) -> Result<Vec<(TableName, SnapshotPlan)>, Error> {
    let mut plans = Vec::with_capacity(cfg.tables.len());
    for t in &cfg.tables {
        plans.push((t.clone(), snapshot::plan(sql, t, &cfg.columns, mode).await?));
    }
    Ok(plans)
}

/// Poll mode reads one table: several are refused with the fix rather than polled in turn
/// (one claim transaction per table would interleave their batches without a common order).
pub fn single_table(cfg: &RunConfig) -> Result<&TableName, Error> {
    match cfg.tables.as_slice() {
        [t] => Ok(t),
        ts => Err(Error::config(
            format!(
                "poll mode reads one outbox table, {} were given ({})",
                ts.len(),
                ts.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
            ),
            "run one poll-mode relay per table (each with its own --name), or use --mode cdc, which reads several tables through one slot",
        )),
    }
}

/// `--ha`: another relay holds the lease; waits one renewal period before the next attempt.
/// False when asked to stop meanwhile.
async fn standby(held: &str, shutdown: &CancellationToken) -> bool {
    tracing::info!(held = %held, "standby: waiting for the lease");
    tokio::select! {
        _ = shutdown.cancelled() => false,
        _ = tokio::time::sleep(state::RENEW_INTERVAL) => true,
    }
}

/// Checks the sink's settings before the source is touched: the RabbitMQ sink reads its TLS
/// files (`--sink-ca`, `--sink-cert`, and `--sink-key` as a secret file) when it is built, the
/// NATS sink checks its secret files (`--sink-key`, a `creds=` file), and a wrong one must stop
/// the relay before it creates a replication slot or takes a lease.
/// Nothing connects here.
pub fn check_sink(cfg: &RunConfig) -> Result<(), Error> {
    match cfg.sink {
        SinkDsn::Amqp(_) | SinkDsn::Nats(_) => make_sink(cfg).map(drop),
        _ => Ok(()),
    }
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
            dead_queue_type: cfg.rabbit.dead_queue_type,
            message: cfg.rabbit.message.clone(),
        })?)),
        SinkDsn::Nats(url) => {
            let p = &cfg.rabbit.partitioning;
            if !p.header_counts.is_empty() && p.header_counts != [p.partitions] {
                tracing::warn!("--group-partitions applies to a RabbitMQ sink: the NATS sink ignores it (subjects carry the relay's own partition)");
            }
            AnySink::Nats(Box::new(crate::sink::nats::NatsSink::new(
                crate::sink::nats::NatsConfig {
                    url: url.clone(),
                    subject: cfg.nats.subject.clone(),
                    stream: cfg.nats.stream.clone(),
                    declare: cfg.rabbit.declare,
                    max_message_bytes: cfg.rabbit.max_message_bytes,
                    op_timeout: cfg.relay.confirm_timeout,
                    window: cfg.relay.window,
                    ca_file: cfg.rabbit.ca_file.clone(),
                    cert_file: cfg.rabbit.cert_file.clone(),
                    key_file: cfg.rabbit.key_file.clone(),
                    connection_name: format!("outboxd {}", cfg.name),
                    partitions: p.partitions,
                },
            )?))
        }
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
    let table = single_table(&cfg)?.clone();
    {
        let sql = pg::connect_sql(&dsn, &format!("outboxd_{}", cfg.name)).await?;
        admin::require_table(&sql, &table).await?;
    }
    let poll_cfg = crate::source::poll::PollConfig {
        dsn,
        name: cfg.name.clone(),
        table: table.clone(),
        columns: cfg.columns.clone(),
        // Bounded by the confirm timeout: a batch waits at most that long for its confirms.
        run: poll.loop_config(cfg.relay.confirm_timeout.max(Duration::from_secs(1))),
        notify_channel: poll
            .notify
            .then(|| crate::source::poll::notify_channel(&table)),
    };
    run_poll(&cfg, move |link| {
        crate::source::poll::run_postgres(poll_cfg, link, shutdown)
    })
    .await
}

/// Runs poll mode on a MySQL/MariaDB table until `shutdown` (no lease either).
pub async fn run_poll_mysql(
    dsn: DbDsn,
    cfg: RunConfig,
    poll: crate::source::poll::PollOptions,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    use crate::source::mysql::{self as my, poll as my_poll};
    if poll.notify {
        return Err(Error::config(
            "--notify is a Postgres feature (LISTEN/NOTIFY); MySQL has no way to wake a poller",
            "drop --notify, and lower --poll-interval for lower latency",
        ));
    }
    let table = mysql_outbox_table(&dsn, single_table(&cfg)?, &cfg.columns, cfg.mysql.time_zone)?;
    let lock_wait = {
        let mut sql = my::connect_sql(&dsn).await?;
        my::admin::require_table(&mut sql, &table).await?;
        let w = my_poll::lock_wait_timeout(&mut sql).await?;
        let _ = sql.disconnect().await;
        w
    };
    let deadline = my_poll::deadline(cfg.relay.confirm_timeout, lock_wait);
    if deadline < cfg.relay.confirm_timeout {
        tracing::info!(?deadline, innodb_lock_wait_timeout = ?lock_wait, "a batch's transaction is bounded below the server's lock wait timeout");
    }
    let run = poll.loop_config(deadline);
    run_poll(&cfg, move |link| async move {
        let mut dbs = Vec::with_capacity(crate::source::poll::SESSIONS);
        for _ in 0..crate::source::poll::SESSIONS {
            dbs.push(my_poll::MyPoll::open(&dsn, &table, &run).await?);
        }
        // No NOTIFY on MySQL: a wake channel that never ticks.
        let (_never, wake) = watch::channel(0u64);
        crate::source::poll::run(dbs, run, wake, link, shutdown).await
    })
    .await
}

/// The relay and a poll source together, with the configured sink.
async fn run_poll<F, Fut>(cfg: &RunConfig, source: F) -> Result<Arc<RelayStats>, Error>
where
    F: FnOnce(SourceLink) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    let mut sink = make_sink(cfg)?;
    if !sink.stores_position() {
        return Err(Error::config(
            "poll mode marks rows published once the sink has them, which the stdout sink does only with --commit-offsets",
            "add --commit-offsets (or use an amqp:// sink)",
        ));
    }
    let (link, ev_rx, ack_tx) = source_link(cfg);
    let stats = Arc::new(RelayStats::default());
    let t = crate::telemetry::get();
    t.mark_started();
    // Poll mode has no stream: it is "streaming" while it can poll.
    t.source_streaming.set(1);
    relay_and_source(&mut sink, ev_rx, ack_tx, &cfg.relay, &stats, source(link)).await?;
    Ok(stats)
}

/// The channels between a source and the relay: the source's link (events out, the relay's
/// acknowledgements in), the relay's event input and its acknowledgement output.
fn source_link(
    cfg: &RunConfig,
) -> (
    SourceLink,
    mpsc::Receiver<crate::source::SourceMsg>,
    watch::Sender<Option<Checkpoint>>,
) {
    let (ack_tx, ack_rx) = watch::channel::<Option<Checkpoint>>(None);
    let (ev_tx, ev_rx) = mpsc::channel(4096);
    let link = SourceLink {
        outlet: Outlet {
            events: ev_tx,
            budget: Budget::new(cfg.max_inflight_bytes),
        },
        acks: ack_rx,
    };
    (link, ev_rx, ack_tx)
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
    /// Largest uncompressed size a compressed transaction may declare
    /// (`--max-txn-payload-bytes`).
    pub max_payload_bytes: u64,
    /// Heartbeat period asked of the server; the read timeout is three of them plus 2 s.
    pub heartbeat: Duration,
    /// `--offset-file`: keep the position and the lease in this file instead of `outboxd_state`.
    pub offset_file: Option<std::path::PathBuf>,
}

impl Default for MySqlOptions {
    fn default() -> Self {
        MySqlOptions {
            time_zone: Default::default(),
            txn_buffer_bytes: 16 * 1024 * 1024,
            max_payload_bytes: crate::source::mysql::decode::DEFAULT_PAYLOAD_LIMIT,
            heartbeat: Duration::from_secs(1),
            offset_file: None,
        }
    }
}

/// The outbox tables of a MySQL source: every `--table` in the DSN's database.
pub fn mysql_tables(
    dsn: &DbDsn,
    tables: &[TableName],
    columns: &ColumnMap,
    tz: crate::source::mysql::rows::SourceTz,
) -> Result<Vec<crate::source::mysql::rows::OutboxTable>, Error> {
    let several = tables.len() > 1;
    tables
        .iter()
        .map(|t| {
            let mut table = mysql_outbox_table(dsn, t, columns, tz)?;
            table.label = several.then(|| std::sync::Arc::from(t.to_string()));
            Ok(table)
        })
        .collect()
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
        label: None,
    })
}

/// Replays binlog files (`--source file://…`) through the relay into the sink, then ends. No
/// lease, no stored position, no first start: the files are the whole input (docs/mysql.md).
pub async fn run_file(
    files: crate::dsn::FileDsn,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    use crate::source::mysql::file;
    let several = cfg.tables.len() > 1;
    let tables = cfg
        .tables
        .iter()
        .map(|t| {
            let Some(database) = t.schema.clone() else {
                return Err(Error::config(
                    format!(
                        "--table {} names no database: binlog files hold every database's tables",
                        t.name
                    ),
                    format!("name it with its database: --table app.{}", t.name),
                ));
            };
            Ok(crate::source::mysql::rows::OutboxTable {
                database,
                table: t.name.clone(),
                columns: cfg.columns.clone(),
                tz: cfg.mysql.time_zone,
                label: several.then(|| Arc::from(t.to_string())),
            })
        })
        .collect::<Result<Vec<_>, Error>>()?;
    let paths = file::binlog_files(&files)?;
    let mut sink = make_sink(&cfg)?;
    let (link, ev_rx, ack_tx) = source_link(&cfg);
    let stats = Arc::new(RelayStats::default());
    let t = crate::telemetry::get();
    t.mark_started();
    t.source_streaming.set(1);
    let limits = file::Limits {
        txn_buffer_bytes: cfg.mysql.txn_buffer_bytes,
        max_payload_bytes: cfg.mysql.max_payload_bytes,
    };
    let source = file::run(paths, tables, limits, link, shutdown);
    relay_and_source(&mut sink, ev_rx, ack_tx, &cfg.relay, &stats, source).await?;
    Ok(stats)
}

/// Runs a MySQL/MariaDB relay until `shutdown` is cancelled (then stops gracefully) or an error.
pub async fn run_mysql(
    dsn: DbDsn,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    use crate::source::mysql::{self as my, admin as my_admin};
    let tables = mysql_tables(&dsn, &cfg.tables, &cfg.columns, cfg.mysql.time_zone)?;
    let mut sql = my::connect_state(&dsn).await?;
    let settings = my_admin::require_binlog(&mut sql).await?;
    for t in &tables {
        my_admin::require_table(&mut sql, t).await?;
    }
    let holder = state::holder_id();
    let (lease, stored, mut file_store) = loop {
        let attempt = match &cfg.mysql.offset_file {
            Some(path) => state::file::FileStore::acquire(path, &cfg.name, &holder)
                .map(|(store, lease, at)| (lease, at, Some(store))),
            None => state::mysql::acquire(&mut sql, &cfg.name, &holder)
                .await
                .map(|(lease, at)| (lease, at, None)),
        };
        match attempt {
            Err(Error::LeaseHeld(who)) if cfg.ha => {
                if !standby(&who, &shutdown).await {
                    return Ok(Arc::new(RelayStats::default()));
                }
            }
            other => break other?,
        }
    };
    tracing::info!(name = %cfg.name, epoch = lease.epoch, holder = %lease.holder, "lease acquired");
    // A first start an earlier run began stored where it started (before publishing): this one
    // goes on from there, never from the binlog head (which would skip what was committed in
    // between).
    let (stored, first_start_at) = if lease.first_start {
        (None, stored)
    } else {
        (stored, None)
    };
    let mut first = my::FirstStart::No;
    // The first start's position, stored before the first event is published.
    let mut store_first: Option<(crate::event::Checkpoint, bool)> = None;
    let mut resume_from = stored.as_ref().and_then(my::Resume::from_checkpoint);
    // Whether the stored position was already checked against the server's binlog.
    let mut checked = false;
    if let (Some(resume), PositionLostPolicy::Poll) = (&resume_from, cfg.on_position_lost) {
        // With recovery on, a purged stored file counts as lost even where the GTID state
        // might still resume: a needless replay gives duplicates, a wrong guess a gap.
        let verdict =
            my_admin::require_position(&mut sql, &cfg.name, resume, settings.mariadb, true).await;
        checked = verdict.is_ok();
        if let Err(Error::PositionLost { problem, .. }) = verdict {
            let commit = state::mysql::load_commit(&mut sql, &cfg.name).await?;
            // Binlog commit times are whole seconds (truncated): one more second of margin.
            let since = replay_start(
                &commit,
                None,
                cfg.replay_since,
                cfg.recovery_margin,
                Duration::from_secs(2),
            );
            let mut plans = Vec::with_capacity(tables.len());
            for t in &tables {
                let plan = my::snapshot::plan(&mut sql, t, &SnapshotMode::Since(since)).await?;
                plans.push((t.clone(), plan));
            }
            let mut snap =
                my::snapshot::begin(my::connect_sql(&dsn).await?, settings.mariadb, plans).await?;
            if !snap.at.checkpoint().is_after(&resume.checkpoint()) {
                // The new binlog's positions sort before the lost one (it started again, or
                // another server's numbers are lower): the store would never let them replace
                // it. A marker sorting before all of them stands in, still a lost position to
                // a start that finds it, so a replay cut off runs again.
                let marker = my_admin::lost_marker(&resume.file);
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
            first = my::FirstStart::Snapshot(snap);
        }
    }
    let start = match resume_from {
        Some(resume) => resumable(&mut sql, &cfg.name, settings.mariadb, resume, checked).await?,
        None if matches!(first, my::FirstStart::Snapshot(_)) => match &first {
            my::FirstStart::Snapshot(snap) => snap.at.clone(),
            _ => unreachable!("matched above"),
        },
        None => {
            // First start (docs/message-format.md): the rows already in the table come from a consistent
            // snapshot whose binlog position is where streaming starts. The position and the
            // first start's end are stored once the snapshot is durable.
            let mut plans = Vec::with_capacity(tables.len());
            for t in &tables {
                plans.push((
                    t.clone(),
                    my::snapshot::plan(&mut sql, t, &cfg.snapshot).await?,
                ));
            }
            let restarted = match first_start_at
                .as_ref()
                .and_then(my::Resume::from_checkpoint)
            {
                Some(r) => Some(resumable(&mut sql, &cfg.name, settings.mariadb, r, false).await?),
                None => None,
            };
            if plans.iter().all(|(_, p)| *p == SnapshotPlan::Nothing) {
                first = my::FirstStart::Empty;
                let at = match restarted {
                    Some(at) => at,
                    None => my::current_position(&mut sql, settings.mariadb).await?,
                };
                store_first = Some((at.checkpoint(), true));
                at
            } else {
                let mut snap =
                    my::snapshot::begin(my::connect_sql(&dsn).await?, settings.mariadb, plans)
                        .await?;
                if let Some(at) = restarted {
                    // The snapshot is newer than the stored start: streaming from the start
                    // repeats what was committed in between (duplicates, never a gap), and the
                    // rows an earlier run got durable are not read again.
                    tracing::info!(position = %at.checkpoint(), "first start: an earlier run was interrupted; streaming from the position it stored");
                    snap.at = at;
                    let key = match &file_store {
                        Some(store) => store.snapshot_key().map(str::to_string),
                        None => state::mysql::load_snapshot_key(&mut sql, &cfg.name).await?,
                    };
                    snap.after = key.and_then(|k| snapshot::SnapshotKey::decode(&k));
                }
                let at = snap.at.clone();
                store_first = Some((at.checkpoint(), false));
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
        tables,
        server_id: my::server_id_for(&cfg.name),
        heartbeat: cfg.mysql.heartbeat,
        read_timeout: cfg.mysql.heartbeat * 3 + Duration::from_secs(2),
        txn_buffer_bytes: cfg.mysql.txn_buffer_bytes,
        max_payload_bytes: cfg.mysql.max_payload_bytes,
        mariadb: settings.mariadb,
    };
    let (commits_tx, commits_rx) = watch::channel(state::DurableCommit::default());
    // As for Postgres: a run that publishes a snapshot stores its marks first, which sort
    // before the start position.
    let resumed = (!matches!(first, my::FirstStart::Snapshot(_))).then(|| start.checkpoint());
    let source = move |link| my::run(source_cfg, link, start, first, commits_tx, shutdown);
    match file_store {
        Some(store) => drive(&cfg, store, lease, store_first, resumed, commits_rx, source).await,
        None => {
            let store = state::mysql::MyStateStore::new(dsn.clone());
            drive(&cfg, store, lease, store_first, resumed, commits_rx, source).await
        }
    }
}

/// A stored position checked for resuming (unless `checked` already): against the server's
/// binlog files, their sizes and (MariaDB) GTID state, so that a binlog that started again or
/// another server is a lost position, never a silent skip (see
/// `source::mysql::admin::position_problem`). A purged file is lost by file and position; by
/// GTID the server itself says whether it still has what follows.
async fn resumable(
    sql: &mut mysql_async::Conn,
    name: &str,
    mariadb: bool,
    mut resume: crate::source::mysql::Resume,
    checked: bool,
) -> Result<crate::source::mysql::Resume, Error> {
    use crate::source::mysql::admin as my_admin;
    if !checked {
        my_admin::require_position(sql, name, &resume, mariadb, false).await?;
    }
    if mariadb && !resume.by_gtid(mariadb) && resume.gtid.is_none() {
        // Track the GTID state from here on, complete in every domain.
        resume.gtid = Some(my_admin::gtid_at(sql, &resume.file, resume.pos).await?);
    }
    Ok(resume)
}

/// Runs a source, the relay and the configured sink with a lease keeper beside them, until the
/// source ends (graceful stop) or something fails; then stores the final position and releases
/// the lease. `first` is a first start's position (and whether that start is over with it),
/// stored before the source may publish anything; `resumed` is where the source starts: no
/// position older than it is stored.
async fn drive<St, F, Fut>(
    cfg: &RunConfig,
    mut store: St,
    mut lease: state::Lease,
    first: Option<(Checkpoint, bool)>,
    resumed: Option<Checkpoint>,
    commits: watch::Receiver<state::DurableCommit>,
    source: F,
) -> Result<Arc<RelayStats>, Error>
where
    St: state::StateStore + 'static,
    F: FnOnce(SourceLink) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    let (link, ev_rx, ack_tx) = source_link(cfg);
    let ack_rx = link.acks.clone();
    let lease_stop = CancellationToken::new();
    let mut sink = make_sink(cfg)?;
    if let Some((start, done)) = &first {
        store.store_start(&lease, start, *done).await?;
        tracing::info!(position = %start, "first start: position stored");
        if *done {
            lease.first_start = false;
        }
    }
    // The relay publishes only while the lease keeper's last renewal is fresh.
    let fence = state::Fence::new(state::SELF_FENCE_AFTER);
    let relay_opts = RelayOptions {
        fence: Some(fence.clone()),
        ..cfg.relay.clone()
    };
    let mut lease_task = tokio::spawn(state::keep_lease(
        state::forward::ForwardOnly::new(store, resumed),
        lease,
        ack_rx,
        commits,
        cfg.ha,
        fence,
        lease_stop.clone(),
    ));
    let source = source(link);
    let stats = Arc::new(RelayStats::default());
    crate::telemetry::get().mark_started();
    let work = relay_and_source(&mut sink, ev_rx, ack_tx, &relay_opts, &stats, source);
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
