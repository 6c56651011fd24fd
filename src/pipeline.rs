//! `outboxd run`: wires one source, the relay and one sink together with the state store, and
//! owns the order of a graceful stop — the source stops at a transaction boundary, the relay
//! drains every confirmation, the final position reaches the server and the state table, and
//! the lease is released. A log source is anything that implements
//! [`LogSource`](crate::source::log::LogSource): [`run`] is one function generic over it (and
//! over the sink and the state store), so the Postgres WAL and the MySQL/MariaDB binlog take the
//! same path. Where each source starts (lease, resume or first start, lost-position recovery, a
//! first start's position stored) is its own `start_plan`, made through the relay's
//! `StateStore`; this module runs that plan, and creates the run's return path
//! (`state::checkpoint`) from the position it starts at. Poll mode and binlog files, which take
//! no lease and resume nothing, have runners of their own here.

use crate::dsn::DbDsn;
use crate::event::Checkpoint;
use crate::identity::{Origin, SourceIdentity};
use crate::outbox::{ColumnMap, TableName};
use crate::relay::{self, RelayOptions, RelayStats};
use crate::sink::options::{SinkContext, SinkOptions};
use crate::sink::{AnySink, Sink, SinkDsn};
use crate::source::log::{Begin, LogPosition, LogSource};
use crate::source::mysql::log::{MyLog, MySqlOptions};
use crate::source::postgres::log::{PgLog, PgOptions};
use crate::source::postgres::{self as pg, admin};
use crate::source::snapshot::SnapshotMode;
use crate::source::startup::{StartOptions, StartPlan};
use crate::source::{Budget, Outlet, SourceLink};
use crate::state::checkpoint::Checkpointer;
use crate::state::{self, StateStore};
use crate::telemetry::events::{InternalEvent, PipelineStarted, SourceRunning};
use crate::Error;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

/// Everything `run` needs, already validated: the settings every source shares. What only one
/// source has (a slot, the binlog's buffers) is that source's own options
/// ([`PgOptions`], [`MySqlOptions`]).
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub name: String,
    /// The outbox tables (`--table`, repeatable; at least one), sharing one column map.
    pub tables: Vec<TableName>,
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
    /// High availability: wait as a standby while another relay holds the lease, and stop
    /// publishing by our own clock before our lease can expire.
    pub ha: bool,
    /// Every sink's settings (the sink itself is [`RunConfig::sink`]).
    pub sink_options: SinkOptions,
    /// `--accept-new-source`: records a deduplicating sink finds of another source are taken
    /// for an earlier life of this one instead of stopping the relay (`crate::identity`).
    pub accept_new_source: bool,
}

// Defined by the startups that use them; `commands` and the tests name them through here.
pub use crate::source::postgres::startup::recovery_since;
pub use crate::source::startup::{replay_start, PositionLostPolicy};

/// Who publishes: the relay's name, and the identity of the log it reads (unknown where the
/// source has none).
fn origin(cfg: &RunConfig, source: SourceIdentity) -> Origin {
    Origin {
        relay: cfg.name.clone(),
        source,
        accept_new_source: cfg.accept_new_source,
    }
}

/// The settings of `cfg` that decide how a log source starts.
fn start_options(cfg: &RunConfig) -> StartOptions {
    StartOptions {
        name: cfg.name.clone(),
        ha: cfg.ha,
        snapshot: cfg.snapshot.clone(),
        on_position_lost: cfg.on_position_lost,
        replay_since: cfg.replay_since,
        recovery_margin: cfg.recovery_margin,
    }
}

/// Runs log source `source` with its state in `store` and the sink `sink` builds, until
/// `shutdown` is cancelled (then stops gracefully) or an error. The sink is built once the
/// start is decided (a standby waiting for the lease holds no broker connection).
pub async fn run<S, K, St>(
    source: S,
    store: St,
    sink: impl FnOnce() -> Result<K, Error>,
    cfg: &RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error>
where
    S: LogSource,
    K: Sink,
    St: StateStore + 'static,
{
    let Some(plan) = source
        .start_plan(store, &start_options(cfg), &shutdown)
        .await?
    else {
        // A standby asked to stop before it got the lease.
        return Ok(Arc::new(RelayStats::default()));
    };
    let StartPlan {
        mut store,
        lease,
        resumed,
        source:
            Begin {
                at,
                start,
                // Held until the relay stops (see LogSource::Held).
                held: _held,
            },
    } = plan;
    // The return path starts where the server already is: the source confirms upstream only
    // what the store reports it holds past that.
    let returns = Checkpointer::new(at.confirmed_upstream());
    store.return_path(returns.clone());
    let mut sink = sink()?;
    sink.set_origin(&origin(cfg, at.source().clone()));
    let opts = DriveOptions::from(cfg);
    let back = returns.clone();
    drive(&opts, sink, store, lease, resumed, returns, move |link| {
        source.run(at, start, link, back, shutdown)
    })
    .await
}

/// Runs a Postgres relay until `shutdown` is cancelled (then stops gracefully) or an error.
pub async fn run_postgres(
    dsn: DbDsn,
    options: PgOptions,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    let source = PgLog {
        dsn,
        name: cfg.name.clone(),
        options,
        tables: cfg.tables.clone(),
        columns: cfg.columns.clone(),
        max_wire_message_bytes: pg::wire_message_limit(cfg.sink_options.max_message_bytes),
    };
    let store = source.state_store();
    run(source, store, || make_sink(&cfg), &cfg, shutdown).await
}

/// Runs a MySQL/MariaDB relay until `shutdown` is cancelled (then stops gracefully) or an error.
pub async fn run_mysql(
    dsn: DbDsn,
    options: MySqlOptions,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    let tables = crate::source::mysql::log::outbox_tables(
        &dsn,
        &cfg.tables,
        &cfg.columns,
        options.time_zone,
    )?;
    let offset_file = options.offset_file.clone();
    let source = MyLog {
        dsn: dsn.clone(),
        name: cfg.name.clone(),
        tables,
        options,
    };
    // The state lives in the offset file or in `outboxd_state`: past this choice, the start and
    // the lease keeper see only a StateStore.
    let sink = || make_sink(&cfg);
    match offset_file {
        Some(path) => {
            run(
                source,
                state::file::FileStore::open(&path),
                sink,
                &cfg,
                shutdown,
            )
            .await
        }
        None => {
            let store = state::mysql::MyStateStore::new(dsn);
            run(source, store, sink, &cfg, shutdown).await
        }
    }
}

/// Runs a MySQL/MariaDB relay whose binlog is read through `hub`, the shared stream of its
/// server (`source::mysql::hub`): the tenant's own start, state row, lease and position, as
/// [`run_mysql`] with `outboxd_state`. An offset file keeps a relay on its own stream
/// ([`RunPlan`](plan::RunPlan) decides).
pub(crate) async fn run_mysql_shared(
    dsn: DbDsn,
    options: MySqlOptions,
    cfg: RunConfig,
    hub: crate::source::mysql::hub::MysqlHub,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    let tables = crate::source::mysql::log::outbox_tables(
        &dsn,
        &cfg.tables,
        &cfg.columns,
        options.time_zone,
    )?;
    let store = state::mysql::MyStateStore::new(dsn.clone());
    let source = hub.subscribe(MyLog {
        dsn,
        name: cfg.name.clone(),
        tables,
        options,
    });
    run(source, store, || make_sink(&cfg), &cfg, shutdown).await
}

/// Poll mode reads one table: several are refused with the fix rather than polled in turn
/// (one claim transaction per table would interleave their batches without a common order).
pub(crate) fn single_table(cfg: &RunConfig) -> Result<&TableName, Error> {
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

/// Checks the sink's settings before the source is touched: every sink is built here as
/// `run` builds it (the RabbitMQ sink reads its TLS files, `--sink-key` as a secret file; the
/// NATS sink checks its secret files, a `creds=` file), and a wrong one must stop the relay
/// before it creates a replication slot or takes a lease. The settings the sink ignores are
/// named once. Nothing connects here.
pub fn check_sink(cfg: &RunConfig) -> Result<(), Error> {
    cfg.sink_options.warn_ignored(&cfg.sink);
    make_sink(cfg).map(drop)
}

/// Builds the sink named by `--sink`.
pub(crate) fn make_sink(cfg: &RunConfig) -> Result<AnySink, Error> {
    cfg.sink_options.build(
        &cfg.sink,
        &SinkContext {
            name: &cfg.name,
            op_timeout: cfg.relay.confirm_timeout,
            window: cfg.relay.window,
            commit_offsets: cfg.commit_offsets,
        },
    )
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
    let identity = {
        let sql = pg::connect_sql(&dsn, &format!("outboxd_{}", cfg.name)).await?;
        admin::require_table(&sql, &table).await?;
        admin::identity_or_unknown(&sql).await
    };
    let poll_cfg = crate::source::postgres::poll::PollConfig {
        dsn,
        name: cfg.name.clone(),
        table: table.clone(),
        columns: cfg.columns.clone(),
        // Bounded by the confirm timeout: a batch waits at most that long for its confirms.
        run: poll.loop_config(cfg.relay.confirm_timeout.max(Duration::from_secs(1))),
        notify_channel: poll
            .notify
            .then(|| crate::source::postgres::poll::notify_channel(&table)),
    };
    run_poll(&cfg, identity, move |link| {
        crate::source::postgres::poll::run_postgres(poll_cfg, link, shutdown)
    })
    .await
}

/// Runs poll mode on a MySQL/MariaDB table until `shutdown` (no lease either).
pub async fn run_poll_mysql(
    dsn: DbDsn,
    options: MySqlOptions,
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
    let table = my::log::outbox_table(&dsn, single_table(&cfg)?, &cfg.columns, options.time_zone)?;
    let (lock_wait, identity) = {
        let mut sql = my::connect_sql(&dsn).await?;
        my::admin::require_table(&mut sql, &table).await?;
        let w = my_poll::lock_wait_timeout(&mut sql).await?;
        let mariadb = my::admin::settings(&mut sql).await?.mariadb;
        let identity = my::identity::identity_or_unknown(&mut sql, mariadb).await;
        let _ = sql.disconnect().await;
        (w, identity)
    };
    let deadline = my_poll::deadline(cfg.relay.confirm_timeout, lock_wait);
    if deadline < cfg.relay.confirm_timeout {
        tracing::info!(?deadline, innodb_lock_wait_timeout = ?lock_wait, "a batch's transaction is bounded below the server's lock wait timeout");
    }
    let run = poll.loop_config(deadline);
    run_poll(&cfg, identity, move |link| async move {
        let dbs = my_poll::open_sessions(&dsn, &table, &run).await?;
        // No NOTIFY on MySQL: a wake channel that never ticks.
        let (_never, wake) = watch::channel(0u64);
        crate::source::poll::run(
            dbs,
            || my_poll::open_sessions(&dsn, &table, &run),
            run.clone(),
            wake,
            link,
            shutdown,
        )
        .await
    })
    .await
}

/// The relay and a poll source together, with the configured sink.
async fn run_poll<F, Fut>(
    cfg: &RunConfig,
    identity: Option<SourceIdentity>,
    source: F,
) -> Result<Arc<RelayStats>, Error>
where
    F: FnOnce(SourceLink) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    let mut sink = make_sink(cfg)?;
    sink.set_origin(&origin(cfg, identity.unwrap_or_default()));
    if !sink.stores_position() {
        return Err(Error::config(
            "poll mode marks rows published once the sink has them, which the stdout sink does only with --commit-offsets",
            "add --commit-offsets (or use an amqp:// sink)",
        ));
    }
    let (link, ev_rx, ack_tx) = source_link(cfg.max_inflight_bytes);
    let stats = Arc::new(RelayStats::default());
    running(&stats, &link.acks);
    PipelineStarted.emit();
    // Poll mode has no stream: it is "streaming" while it can poll.
    SourceRunning.emit();
    relay_and_source(&mut sink, ev_rx, ack_tx, &cfg.relay, &stats, source(link)).await?;
    Ok(stats)
}

/// The channels between a source and the relay: the source's link (events out, the relay's
/// acknowledgements in), the relay's event input and its acknowledgement output.
fn source_link(
    max_inflight_bytes: usize,
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
            budget: Budget::new(max_inflight_bytes),
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

/// Replays binlog files (`--source file://…`) through the relay into the sink, then ends. No
/// lease, no stored position, no first start: the files are the whole input (docs/mysql.md).
pub async fn run_file(
    files: crate::dsn::FileDsn,
    options: MySqlOptions,
    cfg: RunConfig,
    shutdown: CancellationToken,
) -> Result<Arc<RelayStats>, Error> {
    use crate::source::mysql::file;
    let tables =
        crate::source::mysql::log::file_tables(&cfg.tables, &cfg.columns, options.time_zone)?;
    let paths = file::binlog_files(&files)?;
    let mut sink = make_sink(&cfg)?;
    sink.set_origin(&origin(&cfg, SourceIdentity::default()));
    let (link, ev_rx, ack_tx) = source_link(cfg.max_inflight_bytes);
    let stats = Arc::new(RelayStats::default());
    running(&stats, &link.acks);
    PipelineStarted.emit();
    SourceRunning.emit();
    let limits = file::Limits {
        txn_buffer_bytes: options.txn_buffer_bytes,
        max_payload_bytes: options.max_payload_bytes,
    };
    let source = file::run(paths, tables, limits, link, shutdown);
    relay_and_source(&mut sink, ev_rx, ack_tx, &cfg.relay, &stats, source).await?;
    Ok(stats)
}

/// What a watcher of this run (`telemetry::live`, a fleet's status) reads while it publishes.
struct LiveCounts {
    stats: Arc<RelayStats>,
    acks: watch::Receiver<Option<Checkpoint>>,
}

impl crate::telemetry::live::Counts for LiveCounts {
    fn published(&self) -> u64 {
        self.stats
            .published
            .load(std::sync::atomic::Ordering::Relaxed)
    }
    fn confirmed(&self) -> u64 {
        self.stats
            .confirmed
            .load(std::sync::atomic::Ordering::Relaxed)
    }
    fn position(&self) -> Option<String> {
        self.acks.borrow().as_ref().map(|c| c.to_string())
    }
}

/// The run publishes from now on (for whoever watches it: `telemetry::live`).
fn running(stats: &Arc<RelayStats>, acks: &watch::Receiver<Option<Checkpoint>>) {
    crate::telemetry::live::running(Arc::new(LiveCounts {
        stats: stats.clone(),
        acks: acks.clone(),
    }));
}

/// What [`drive`] takes of a run's settings.
#[derive(Debug, Clone, Default)]
struct DriveOptions {
    relay: RelayOptions,
    max_inflight_bytes: usize,
    /// `--ha`: the lease keeper ends the run when it cannot renew (see `state::keep_lease`).
    ha: bool,
}

impl From<&RunConfig> for DriveOptions {
    fn from(cfg: &RunConfig) -> Self {
        DriveOptions {
            relay: cfg.relay.clone(),
            max_inflight_bytes: cfg.max_inflight_bytes,
            ha: cfg.ha,
        }
    }
}

/// Runs a source, the relay and `sink` with a lease keeper on `store` beside them, until the
/// source ends (graceful stop) or something fails; then stores the final position and releases
/// the lease. The start already wrote what a first start stores before its first event;
/// `resumed` is where the source starts: no position older than it is stored. `checkpoints` is
/// the run's return path, shared with the source.
async fn drive<Si, St, F, Fut>(
    cfg: &DriveOptions,
    mut sink: Si,
    store: St,
    lease: state::Lease,
    resumed: Option<Checkpoint>,
    checkpoints: Checkpointer,
    source: F,
) -> Result<Arc<RelayStats>, Error>
where
    Si: Sink,
    St: state::StateStore + 'static,
    F: FnOnce(SourceLink) -> Fut,
    Fut: std::future::Future<Output = Result<(), Error>>,
{
    let (link, ev_rx, ack_tx) = source_link(cfg.max_inflight_bytes);
    let ack_rx = link.acks.clone();
    let lease_stop = CancellationToken::new();
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
        checkpoints,
        cfg.ha,
        fence,
        lease_stop.clone(),
    ));
    let stats = Arc::new(RelayStats::default());
    running(&stats, &link.acks);
    let source = source(link);
    PipelineStarted.emit();
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

pub(crate) mod plan;
pub use plan::RunPlan;

#[cfg(test)]
mod tests;
