//! The MySQL/MariaDB source behind [`LogSource`]: its settings ([`MySqlOptions`]), its position
//! ([`BinlogCoord`]), the outbox tables a DSN and `--table` name ([`outbox_tables`]), and the
//! two steps `outboxd run` takes with it — the start ([`super::startup::start_plan`]) and the
//! stream ([`super::run`]).

use super::rows::{OutboxTable, SourceTz};
use super::startup::{self, MyStart};
use super::{FirstStart, MySqlSourceConfig, Resume};
use crate::dsn::DbDsn;
use crate::event::Checkpoint;
use crate::identity::SourceIdentity;
use crate::outbox::{ColumnMap, TableName};
use crate::source::log::{Begin, LogPosition, LogSource};
use crate::source::startup::{StartOptions, StartPlan};
use crate::source::SourceLink;
use crate::state::checkpoint::Checkpointer;
use crate::state::StateStore;
use crate::Error;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// MySQL/MariaDB source settings from the command line.
#[derive(Debug, Clone)]
pub struct MySqlOptions {
    /// The zone `DATETIME` values are written in (`--source-time-zone`).
    pub time_zone: SourceTz,
    /// Largest transaction held until its commit (`--txn-buffer`).
    pub txn_buffer_bytes: usize,
    /// Largest uncompressed size a compressed transaction may declare
    /// (`--max-txn-payload-bytes`).
    pub max_payload_bytes: u64,
    /// Heartbeat period asked of the server; the read timeout is three of them plus 2 s.
    pub heartbeat: Duration,
    /// `--offset-file`: keep the position and the lease in this file instead of `outboxd_state`.
    pub offset_file: Option<std::path::PathBuf>,
    /// `--xa-prepare-limit`: how long a prepared XA transaction may hold the position back.
    pub xa_prepare_limit: Duration,
    /// `--xa-prepare-expired`: what happens after that.
    pub xa_prepare_expired: super::xa_pin::XaExpired,
    /// `--sync-replica`: publish only what these replicas have applied.
    pub sync_replicas: Vec<DbDsn>,
}

impl Default for MySqlOptions {
    fn default() -> Self {
        MySqlOptions {
            time_zone: Default::default(),
            txn_buffer_bytes: 16 * 1024 * 1024,
            max_payload_bytes: super::decode::DEFAULT_PAYLOAD_LIMIT,
            heartbeat: Duration::from_secs(1),
            offset_file: None,
            xa_prepare_limit: super::xa_pin::DEFAULT_LIMIT,
            xa_prepare_expired: Default::default(),
            sync_replicas: Vec::new(),
        }
    }
}

/// The outbox tables of a MySQL source: every `--table` in the DSN's database.
pub fn outbox_tables(
    dsn: &DbDsn,
    tables: &[TableName],
    columns: &ColumnMap,
    tz: SourceTz,
) -> Result<Vec<OutboxTable>, Error> {
    let several = tables.len() > 1;
    tables
        .iter()
        .map(|t| {
            let mut table = outbox_table(dsn, t, columns, tz)?;
            table.label = several.then(|| Arc::from(t.to_string()));
            Ok(table)
        })
        .collect()
}

/// The outbox table of a MySQL source: `--table` in the DSN's database.
pub fn outbox_table(
    dsn: &DbDsn,
    table: &TableName,
    columns: &ColumnMap,
    tz: SourceTz,
) -> Result<OutboxTable, Error> {
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
    Ok(OutboxTable {
        database: dsn.database.clone(),
        table: table.name.clone(),
        columns: columns.clone(),
        tz,
        label: None,
    })
}

/// The outbox tables of a binlog-file source (`--source file://…`): each `--table` names its
/// database, since the files hold every database's tables.
pub(crate) fn file_tables(
    tables: &[TableName],
    columns: &ColumnMap,
    tz: SourceTz,
) -> Result<Vec<OutboxTable>, Error> {
    let several = tables.len() > 1;
    tables
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
            Ok(OutboxTable {
                database,
                table: t.name.clone(),
                columns: columns.clone(),
                tz,
                label: several.then(|| Arc::from(t.to_string())),
            })
        })
        .collect()
}

/// A position in a MySQL/MariaDB server's binlog: a transaction boundary (file, offset, and the
/// GTID state there).
#[derive(Debug, Clone)]
pub struct BinlogCoord {
    pub resume: Resume,
    /// The server it was read from.
    pub source: SourceIdentity,
}

impl fmt::Display for BinlogCoord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.resume.checkpoint(), f)
    }
}

impl LogPosition for BinlogCoord {
    fn source(&self) -> &SourceIdentity {
        &self.source
    }

    fn checkpoint(&self) -> Checkpoint {
        self.resume.checkpoint()
    }

    /// The binlog keeps nothing for a relay: the stored position is the whole of it.
    fn confirmed_upstream(&self) -> u64 {
        0
    }
}

/// How a MySQL/MariaDB stream opens, as its start decided.
#[derive(Debug)]
pub struct Stream {
    /// Whether the server writes MariaDB GTIDs.
    pub mariadb: bool,
    /// What the source publishes from the tables before streaming.
    pub first: FirstStart,
}

/// A MySQL/MariaDB relay's source: one binlog stream serving its outbox tables.
#[derive(Debug, Clone)]
pub struct MyLog {
    pub dsn: DbDsn,
    /// The relay's name (`--name`): its server id too.
    pub name: String,
    /// The outbox tables, all in the DSN's database ([`outbox_tables`]).
    pub tables: Vec<OutboxTable>,
    pub options: MySqlOptions,
}

impl MyLog {
    /// The stream's settings, for a server that writes MariaDB GTIDs or not (`mariadb`).
    pub(super) fn config(self, mariadb: bool) -> MySqlSourceConfig {
        let o = self.options;
        MySqlSourceConfig {
            server_id: super::server_id_for(&self.name),
            dsn: self.dsn,
            name: self.name,
            tables: self.tables,
            heartbeat: o.heartbeat,
            read_timeout: o.heartbeat * 3 + Duration::from_secs(2),
            txn_buffer_bytes: o.txn_buffer_bytes,
            max_payload_bytes: o.max_payload_bytes,
            mariadb,
            xa_prepare_limit: o.xa_prepare_limit,
            xa_prepare_expired: o.xa_prepare_expired,
            sync_replicas: o.sync_replicas,
        }
    }
}

impl LogSource for MyLog {
    type Position = BinlogCoord;
    type Start = Stream;
    type Held = ();

    async fn start_plan<St: StateStore>(
        &self,
        store: St,
        opts: &StartOptions,
        shutdown: &CancellationToken,
    ) -> Result<Option<StartPlan<St, Begin<Self>>>, Error> {
        let src = startup::Source {
            dsn: &self.dsn,
            tables: &self.tables,
        };
        let Some(plan) = startup::start_plan(src, store, opts, shutdown).await? else {
            return Ok(None);
        };
        let StartPlan {
            store,
            lease,
            resumed,
            source:
                MyStart {
                    mariadb,
                    start,
                    first,
                    identity,
                },
        } = plan;
        Ok(Some(StartPlan {
            store,
            lease,
            resumed,
            source: Begin {
                at: BinlogCoord {
                    resume: start,
                    source: identity.unwrap_or_default(),
                },
                start: Stream { mariadb, first },
                held: (),
            },
        }))
    }

    async fn run(
        self,
        at: BinlogCoord,
        start: Stream,
        link: SourceLink,
        returns: Checkpointer,
        shutdown: CancellationToken,
    ) -> Result<(), Error> {
        let cfg = self.config(start.mariadb);
        super::run(cfg, link, at.resume, start.first, returns, shutdown).await
    }
}
