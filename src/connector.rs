//! `outboxd run`: wires one source, the relay and one sink together with the state store, and
//! owns the order of a graceful stop — the source stops at a transaction boundary, the relay
//! drains every confirmation, the final position reaches the server and the state table, and
//! the lease is released.

use crate::dsn::{DbDsn, SinkDsn};
use crate::event::{format_lsn, Checkpoint};
use crate::outbox::{ColumnMap, TableName};
use crate::relay::{self, RelayOptions, RelayStats};
use crate::sink::stdout::StdoutSink;
use crate::sink::Sink;
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

    let start = match admin::slot(&sql, &cfg.slot).await? {
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
            if lease.first_start {
                state::postgres::mark_initialized(&sql, &lease).await?;
            }
            slot.confirmed_flush_lsn.unwrap_or(0)
        }
        None if lease.first_start => {
            let at = admin::create_slot(&sql, &cfg.slot).await?;
            state::postgres::mark_initialized(&sql, &lease).await?;
            at
        }
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
    let mut lease_task = tokio::spawn(state::keep_lease(
        state::postgres::PgStateStore::new(dsn.clone(), app.clone()),
        lease.clone(),
        ack_rx,
        lease_stop.clone(),
    ));
    let source = pg::run(source_cfg, link, start, shutdown.clone());
    let stats = Arc::new(RelayStats::default());

    let work = async {
        match &cfg.sink {
            SinkDsn::Stdout => {
                let mut sink = StdoutSink::new(cfg.commit_offsets);
                relay_and_source(&mut sink, ev_rx, ack_tx, &cfg.relay, &stats, source).await
            }
            SinkDsn::Amqp(_) => Err(Error::config(
                "the RabbitMQ sink is not built yet",
                "use --sink stdout",
            )),
        }
    };
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
    if dsn.database.is_empty() {
        return Err(Error::config(
            "the MySQL DSN names no database: the relay reads the outbox table of the DSN's database and keeps its state there",
            "add the database to the DSN, e.g. mysql://user@host:3306/app",
        ));
    }
    if let Some(db) = &cfg.table.schema {
        if *db != dsn.database {
            return Err(Error::config(
                format!(
                    "--table {db}.{} is not in the DSN's database {:?}",
                    cfg.table.name, dsn.database
                ),
                format!(
                    "name the table's database in the DSN (mysql://…/{db}) and pass --table {}",
                    cfg.table.name
                ),
            ));
        }
    }
    Ok(crate::source::mysql::rows::OutboxTable {
        database: dsn.database.clone(),
        table: cfg.table.name.clone(),
        columns: cfg.columns.clone(),
        tz: cfg.mysql.time_zone,
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
            // First start: stream from the server's current position. Rows already in the
            // table are the first-start snapshot's job (CONTRACT §3, `--snapshot`): it will
            // take a consistent snapshot here and return the position it was taken at.
            let resume = my::current_position(&mut sql, settings.mariadb).await?;
            state::mysql::mark_initialized(&mut sql, &lease, &resume.checkpoint()).await?;
            resume
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
    drive(&cfg, store, lease, shutdown.clone(), move |link| {
        my::run(source_cfg, link, start, shutdown)
    })
    .await
}

/// Runs a source, the relay and the configured sink with a lease keeper beside them, until the
/// source ends (graceful stop) or something fails; then stores the final position and releases
/// the lease. (The Postgres path has the same shape inline in [`run_postgres`].)
async fn drive<St, F, Fut>(
    cfg: &RunConfig,
    store: St,
    lease: state::Lease,
    _shutdown: CancellationToken,
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
    let mut lease_task = tokio::spawn(state::keep_lease(store, lease, ack_rx, lease_stop.clone()));
    let source = source(link);
    let stats = Arc::new(RelayStats::default());
    let work = async {
        match &cfg.sink {
            SinkDsn::Stdout => {
                let mut sink = StdoutSink::new(cfg.commit_offsets);
                relay_and_source(&mut sink, ev_rx, ack_tx, &cfg.relay, &stats, source).await
            }
            SinkDsn::Amqp(_) => Err(Error::config(
                "the RabbitMQ sink is not built yet",
                "use --sink stdout",
            )),
        }
    };
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
