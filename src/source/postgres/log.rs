//! The Postgres source behind [`LogSource`]: its settings ([`PgOptions`]), its position
//! ([`Lsn`]), and the two steps `outboxd run` takes with it — the start
//! ([`super::startup::start_plan`]) and the stream ([`super::run`]).

use super::snapshot::{SnapshotKey, SnapshotPlan};
use super::startup::{self, PgStart};
use super::{admin, PgSourceConfig};
use crate::dsn::DbDsn;
use crate::event::{format_lsn, Checkpoint};
use crate::identity::SourceIdentity;
use crate::outbox::{ColumnMap, TableName};
use crate::source::log::{Begin, LogPosition, LogSource};
use crate::source::startup::{StartOptions, StartPlan};
use crate::source::SourceLink;
use crate::state::checkpoint::Checkpointer;
use crate::state::{self, StateStore};
use crate::Error;
use std::fmt;
use tokio_util::sync::CancellationToken;

/// The settings only a Postgres relay has (`--slot`, `--publication`).
#[derive(Debug, Clone)]
pub struct PgOptions {
    pub slot: String,
    pub publication: String,
}

/// A position in a Postgres cluster's WAL.
#[derive(Debug, Clone)]
pub struct Lsn {
    pub lsn: u64,
    /// The cluster and database it was read from.
    pub source: SourceIdentity,
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&format_lsn(self.lsn))
    }
}

impl LogPosition for Lsn {
    fn source(&self) -> &SourceIdentity {
        &self.source
    }

    fn checkpoint(&self) -> Checkpoint {
        Checkpoint::Lsn(self.lsn)
    }

    /// A run starts at the later of the slot's and the stored position, which the row holds:
    /// the slot is confirmed up to it already.
    fn confirmed_upstream(&self) -> u64 {
        self.lsn
    }
}

/// What a Postgres source publishes before streaming (a first start or a replay), as its start
/// decided.
pub struct Before {
    /// The rows of each table to publish.
    pub snapshot: Vec<(TableName, SnapshotPlan)>,
    /// How far an interrupted run got through that snapshot.
    pub(crate) snapshot_after: Option<SnapshotKey>,
}

/// A Postgres relay's source: one slot and one publication serving its outbox tables.
#[derive(Debug, Clone)]
pub struct PgLog {
    pub dsn: DbDsn,
    /// The relay's name (`--name`).
    pub name: String,
    pub options: PgOptions,
    /// The outbox tables (`--table`, one or more), sharing one column map.
    pub tables: Vec<TableName>,
    pub columns: ColumnMap,
    /// Largest replication message accepted ([`super::wire_message_limit`]).
    pub max_wire_message_bytes: usize,
}

impl PgLog {
    /// The `application_name` of the relay's SQL sessions.
    pub fn app(&self) -> String {
        format!("outboxd_{}", self.name)
    }

    /// The relay's state table in the source database (`outboxd_state`), recording this
    /// source's slot and publication.
    pub fn state_store(&self) -> state::postgres::PgStateStore {
        state::postgres::PgStateStore::new(self.dsn.clone(), self.app())
            .with_slot(&self.options.slot)
            .with_publication(&self.options.publication)
    }
}

impl LogSource for PgLog {
    type Position = Lsn;
    type Start = Before;
    /// The start's SQL session (see [`PgStart::session`]).
    type Held = tokio_postgres::Client;

    async fn start_plan<St: StateStore>(
        &self,
        store: St,
        opts: &StartOptions,
        shutdown: &CancellationToken,
    ) -> Result<Option<StartPlan<St, Begin<Self>>>, Error> {
        let app = self.app();
        let src = startup::Source {
            dsn: &self.dsn,
            app: &app,
            slot: &self.options.slot,
            publication: &self.options.publication,
            tables: &self.tables,
            columns: &self.columns,
        };
        let Some(plan) = startup::start_plan(src, store, opts, shutdown).await? else {
            return Ok(None);
        };
        let StartPlan {
            store,
            lease,
            resumed,
            source:
                PgStart {
                    session,
                    start,
                    snapshot,
                    snapshot_after,
                },
        } = plan;
        let source = admin::identity_or_unknown(&session)
            .await
            .unwrap_or_default();
        Ok(Some(StartPlan {
            store,
            lease,
            resumed,
            source: Begin {
                at: Lsn { lsn: start, source },
                start: Before {
                    snapshot,
                    snapshot_after,
                },
                held: session,
            },
        }))
    }

    async fn run(
        self,
        at: Lsn,
        start: Before,
        link: SourceLink,
        returns: Checkpointer,
        shutdown: CancellationToken,
    ) -> Result<(), Error> {
        let cfg = PgSourceConfig {
            dsn: self.dsn,
            name: self.name,
            tables: self.tables,
            columns: self.columns,
            slot: self.options.slot,
            publication: self.options.publication,
            // Durable positions reach the slot promptly (at most every STORE_INTERVAL while
            // they move; the library sends nothing more while they do not).
            status_interval: state::STORE_INTERVAL,
            snapshot: start.snapshot,
            snapshot_after: start.snapshot_after,
            max_wire_message_bytes: self.max_wire_message_bytes,
        };
        super::run(cfg, link, at.lsn, returns, shutdown).await
    }
}
