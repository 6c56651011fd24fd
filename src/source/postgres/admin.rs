//! What the Postgres source needs to exist before it streams, and how it is created, inspected
//! and removed: the publication on the outbox table, the logical slot, and the checks that tell
//! an operator the exact SQL to run when something is missing.

use crate::event::{parse_lsn, SourcePosition};
use crate::identity::SourceIdentity;
use crate::outbox::{pg_ident, pg_literal, Column, ColumnMap, TableName};
use crate::Error;
use tokio_postgres::Client;

/// The replication slot as the server sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotInfo {
    pub plugin: Option<String>,
    pub database: Option<String>,
    pub active: bool,
    pub active_pid: Option<i32>,
    pub confirmed_flush_lsn: Option<u64>,
    pub(crate) restart_lsn: Option<u64>,
    pub wal_status: Option<String>,
}

pub async fn slot(client: &Client, slot: &str) -> Result<Option<SlotInfo>, Error> {
    let row = client
        .query_opt(
            "SELECT plugin::text, database::text, active, active_pid, confirmed_flush_lsn::text,
                    restart_lsn::text, wal_status
               FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await?;
    Ok(row.map(|r| SlotInfo {
        plugin: r.get(0),
        database: r.get(1),
        active: r.get(2),
        active_pid: r.get(3),
        confirmed_flush_lsn: r.get::<_, Option<String>>(4).and_then(|s| parse_lsn(&s)),
        restart_lsn: r.get::<_, Option<String>>(5).and_then(|s| parse_lsn(&s)),
        wal_status: r.get(6),
    }))
}

/// How far this server's WAL is durable (on a standby: replayed). Every position a relay
/// stores came through a walsender, which sends only flushed WAL, so a stored position past
/// this one was written by another server.
pub(crate) async fn flush_lsn(client: &Client) -> Result<u64, Error> {
    let lsn: String = client
        .query_one(
            "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn()
                          ELSE pg_current_wal_flush_lsn() END)::text",
            &[],
        )
        .await?
        .get(0);
    parse_lsn(&lsn).ok_or_else(|| Error::Decode(format!("WAL flush LSN {lsn:?}")))
}

/// The identity of the log `client` reads, or unknown when the server will not tell (an old
/// version, a revoked function): that costs duplicates, never events.
pub(crate) async fn identity_or_unknown(client: &Client) -> Option<SourceIdentity> {
    match source_identity(client).await {
        Ok(id) => Some(id),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the source's identity (pg_control_system): records a deduplicating sink reads back are matched without it");
            None
        }
    }
}

/// The identity of the log `client` reads (`crate::identity`): the cluster's system
/// identifier (a physical standby has the primary's; a dump restored into another cluster
/// does not) with the database, and the WAL head now.
pub(crate) async fn source_identity(client: &Client) -> Result<SourceIdentity, Error> {
    let row = client
        .query_one(
            "SELECT (SELECT system_identifier FROM pg_control_system())::text, current_database()",
            &[],
        )
        .await?;
    let (system, database): (String, String) = (row.get(0), row.get(1));
    Ok(SourceIdentity {
        id: format!("postgres:{system}/{database}"),
        head: Some(SourcePosition::Pg {
            commit_lsn: flush_lsn(client).await?,
            index: u32::MAX,
        }),
        gtids: None,
    })
}

pub async fn wal_level(client: &Client) -> Result<String, Error> {
    Ok(client.query_one("SHOW wal_level", &[]).await?.get(0))
}

/// Fails with the fix when logical decoding is off.
pub async fn require_logical(client: &Client) -> Result<(), Error> {
    let level = wal_level(client).await?;
    if level != "logical" {
        return Err(Error::config(
            format!("wal_level is {level}, logical replication needs logical"),
            "ALTER SYSTEM SET wal_level = logical; then restart Postgres",
        ));
    }
    Ok(())
}

/// Fails with the fix when the outbox table does not exist.
pub async fn require_table(client: &Client, table: &TableName) -> Result<(), Error> {
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.pg_quoted()])
        .await?
        .get(0);
    if !exists {
        return Err(Error::config(
            format!("the outbox table {} does not exist", table.pg_quoted()),
            format!(
                "create it (migrations/postgres/001_outbox.sql) or run `outboxd setup --create-table --table {}`",
                table.pg_quoted()
            ),
        ));
    }
    Ok(())
}

/// Fails with the fix when a table cannot be mapped as the stream will map it: a column the
/// contract needs missing (`--column aggregate_id=nope`), one of a type it cannot hold, or a
/// column a template, `--header` or `--envelope-field` names missing. Checked at start, before
/// the lease and the slot, rather than at the first row.
pub(crate) async fn require_columns(
    client: &Client,
    tables: &[TableName],
    columns: &ColumnMap,
) -> Result<(), Error> {
    for t in tables {
        let rel = super::snapshot::table_relation(client, t).await?;
        super::rows::RowMapper::for_tables(tables.to_vec(), columns.clone()).relation(rel)?;
    }
    Ok(())
}

pub use crate::db::postgres::SETUP_LOCK;

/// Runs `body` holding [`SETUP_LOCK`] (a session lock: DDL and checks between them see each
/// other's committed work); the lock is released whatever `body` returns.
pub(crate) async fn with_setup_lock<T, F>(client: &Client, body: F) -> Result<T, Error>
where
    F: std::future::Future<Output = Result<T, Error>>,
{
    client
        .execute("SELECT pg_advisory_lock($1)", &[&SETUP_LOCK])
        .await?;
    let r = body.await;
    if let Err(e) = client
        .execute("SELECT pg_advisory_unlock($1)", &[&SETUP_LOCK])
        .await
    {
        // The session ends soon after on every error path; it takes the lock with it.
        tracing::debug!(error = %e, "could not release the setup lock");
    }
    r
}

/// Creates the contract's outbox table (migrations/postgres/001_outbox.sql's columns) when missing;
/// returns whether it did.
pub async fn create_outbox_table(client: &Client, table: &TableName) -> Result<bool, Error> {
    with_setup_lock(client, create_outbox_table_locked(client, table)).await
}

async fn create_outbox_table_locked(client: &Client, table: &TableName) -> Result<bool, Error> {
    let exists: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.pg_quoted()])
        .await?
        .get(0);
    if exists {
        return Ok(false);
    }
    let ddl = include_str!("../../../migrations/postgres/001_outbox.sql")
        .replace(
            "IF NOT EXISTS outbox ",
            &format!("IF NOT EXISTS {} ", table.pg_quoted()),
        )
        .replace(" ON outbox ", &format!(" ON {} ", table.pg_quoted()))
        .replace("idx_dispatch", &format!("{}_dispatch", table.name))
        .replace("outbox_pending", &format!("{}_pending", table.name));
    client.batch_execute(&ddl).await?;
    Ok(true)
}

/// What [`ensure_publication`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublicationChange {
    Created,
    Exists,
    /// It existed and these tables were added to it: their rows committed before now are not
    /// in the stream.
    Added(Vec<TableName>),
}

/// Makes sure the publication publishes inserts of every outbox table, through the partition
/// root for partitioned ones (`publish_via_partition_root`, so events name the parent). Creates
/// it when missing; adds tables missing from an existing one (a table added later to a running
/// relay's list); refuses, with the fix, a publication that publishes no inserts or publishes
/// a partitioned table by its leaves.
pub async fn ensure_publication(
    client: &Client,
    publication: &str,
    tables: &[TableName],
) -> Result<PublicationChange, Error> {
    with_setup_lock(
        client,
        ensure_publication_locked(client, publication, tables),
    )
    .await
}

async fn ensure_publication_locked(
    client: &Client,
    publication: &str,
    tables: &[TableName],
) -> Result<PublicationChange, Error> {
    let list = tables
        .iter()
        .map(TableName::pg_quoted)
        .collect::<Vec<_>>()
        .join(", ");
    let row = client
        .query_opt(
            "SELECT pubinsert, pubviaroot FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?;
    let Some(row) = row else {
        let create = create_publication_sql(publication, tables);
        if let Some(refusal) = publication_refusal(client, publication, tables, false).await? {
            return Err(refusal.into_error(&create));
        }
        client.batch_execute(&create).await?;
        tracing::info!(publication, tables = %list, "created publication");
        return Ok(PublicationChange::Created);
    };
    let (inserts, via_root): (bool, bool) = (row.get(0), row.get(1));
    if !inserts {
        return Err(Error::config(
            format!("publication {publication:?} exists but does not publish inserts"),
            format!(
                "ALTER PUBLICATION {} SET (publish = 'insert');",
                pg_ident(publication)
            ),
        ));
    }
    let mut missing = Vec::new();
    for t in tables {
        let partitioned = is_partitioned(client, t).await?;
        if partitioned && !via_root {
            return Err(Error::config(
                format!(
                    "{} is partitioned but publication {publication:?} publishes partitions under their own names (publish_via_partition_root is off): events would not name the outbox table",
                    t.pg_quoted()
                ),
                format!(
                    "ALTER PUBLICATION {} SET (publish = 'insert', publish_via_partition_root = true);",
                    pg_ident(publication)
                ),
            ));
        }
        let covers: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                                 WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
                &[&publication, &t.pg_schema(), &t.name],
            )
            .await?
            .get(0);
        if !covers {
            missing.push(t.clone());
        }
    }
    if missing.is_empty() {
        return Ok(PublicationChange::Exists);
    }
    let added = missing
        .iter()
        .map(TableName::pg_quoted)
        .collect::<Vec<_>>()
        .join(", ");
    let alter = format!(
        "ALTER PUBLICATION {} ADD TABLE {added}",
        pg_ident(publication)
    );
    if let Some(refusal) = publication_refusal(client, publication, &missing, true).await? {
        return Err(refusal.into_error(&alter));
    }
    client.batch_execute(&alter).await?;
    tracing::warn!(publication, tables = %added, "added tables to the publication: their inserts are published from now on, rows committed before are not");
    Ok(PublicationChange::Added(missing))
}

/// `CREATE PUBLICATION` as outboxd creates it: inserts only, partitions under their root's name.
pub(crate) fn create_publication_sql(publication: &str, tables: &[TableName]) -> String {
    format!(
        "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
        pg_ident(publication),
        tables
            .iter()
            .map(TableName::pg_quoted)
            .collect::<Vec<_>>()
            .join(", ")
    )
}

/// Why the session's role cannot create the publication (or, `exists`, add `tables` to it),
/// and who can: only a table's owner may add it to a publication, only the publication's owner
/// may alter it, and creating one takes `CREATE` on the database.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicationRefusal {
    pub publication: String,
    pub user: String,
    pub database: String,
    /// Tables the role does not own, with their owners.
    pub(crate) not_owned: Vec<(String, String)>,
    /// The publication's owner, when it exists and the role is not (a member of) it.
    pub(crate) publication_owner: Option<String>,
    /// Creating: the role lacks `CREATE` on the database.
    pub(crate) no_create: bool,
    /// Whether it is created (else tables are added to it).
    pub creating: bool,
}

impl PublicationRefusal {
    /// The roles that can run the statement (the owners, else a superuser).
    pub fn who(&self) -> String {
        let mut owners: Vec<&str> = self.not_owned.iter().map(|(_, o)| o.as_str()).collect();
        owners.extend(self.publication_owner.as_deref());
        owners.sort_unstable();
        owners.dedup();
        // Creating one also takes CREATE on the database, whoever runs it.
        let create = match self.creating {
            true => format!(", with CREATE on database {}", self.database),
            false => String::new(),
        };
        match owners.as_slice() {
            [] => format!("a role with CREATE on database {}", self.database),
            [one] => format!("role {one} (the owner{create}) or a superuser"),
            many => format!(
                "a superuser (or a member of each of {}{create})",
                many.join(", ")
            ),
        }
    }

    /// What is missing, in words.
    pub fn problem(&self) -> String {
        let mut why = Vec::new();
        for (table, owner) in &self.not_owned {
            why.push(format!("{table} belongs to role {owner}, and only a table's owner can add it to a publication"));
        }
        if let Some(owner) = &self.publication_owner {
            why.push(format!(
                "the publication belongs to role {owner}, and only its owner can alter it"
            ));
        }
        if self.no_create {
            why.push(format!(
                "the role lacks CREATE on database {}",
                self.database
            ));
        }
        format!(
            "role {} cannot {} publication {}: {}",
            self.user,
            if self.creating {
                "create the"
            } else {
                "add tables to the"
            },
            self.publication,
            why.join("; ")
        )
    }

    /// The refusal, with the statement for whoever can run it.
    pub fn into_error(self, statement: &str) -> Error {
        let fix = if self.not_owned.is_empty() && self.publication_owner.is_none() {
            format!(
                "GRANT CREATE ON DATABASE {} TO {};  (as the database's owner or a superuser), then run this command again",
                pg_ident(&self.database),
                pg_ident(&self.user)
            )
        } else {
            format!(
                "as {}: {statement};  then run this command again (docs/operations.md, \"Grants\")",
                self.who()
            )
        };
        Error::config(self.problem(), fix)
    }
}

/// The refusal the server would give to creating the publication on `tables` (or, `exists`,
/// adding them to it), found in the catalog before anything runs; `None` when the role may.
pub(crate) async fn publication_refusal(
    client: &Client,
    publication: &str,
    tables: &[TableName],
    exists: bool,
) -> Result<Option<PublicationRefusal>, Error> {
    let row = client
        .query_one(
            "SELECT current_user::text, current_database()::text,
                    has_database_privilege(current_database(), 'CREATE'),
                    (SELECT pg_get_userbyid(pubowner)::text FROM pg_publication
                      WHERE pubname = $1 AND NOT pg_has_role(pubowner, 'USAGE'))",
            &[&publication],
        )
        .await?;
    let mut refusal = PublicationRefusal {
        publication: publication.to_string(),
        user: row.get(0),
        database: row.get(1),
        not_owned: Vec::new(),
        publication_owner: if exists { row.get(3) } else { None },
        no_create: !exists && !row.get::<_, bool>(2),
        creating: !exists,
    };
    for t in tables {
        let owner: Option<String> = client
            .query_opt(
                "SELECT pg_get_userbyid(relowner)::text FROM pg_class
                  WHERE oid = to_regclass($1) AND NOT pg_has_role(relowner, 'USAGE')",
                &[&t.pg_quoted()],
            )
            .await?
            .map(|r| r.get(0));
        if let Some(owner) = owner {
            refusal.not_owned.push((t.pg_quoted(), owner));
        }
    }
    let refused =
        refusal.no_create || !refusal.not_owned.is_empty() || refusal.publication_owner.is_some();
    Ok(refused.then_some(refusal))
}

/// What the publication still needs on `tables` (created, or tables added) when the session's
/// role cannot do it: the refusal and the statement for whoever can. `None` when nothing is
/// needed or the role may do it. (A publication that publishes no inserts is refused by
/// [`ensure_publication`] with its own fix.)
pub async fn publication_blocker(
    client: &Client,
    publication: &str,
    tables: &[TableName],
) -> Result<Option<(PublicationRefusal, String)>, Error> {
    let exists = client
        .query_opt(
            "SELECT 1 FROM pg_publication WHERE pubname = $1",
            &[&publication],
        )
        .await?
        .is_some();
    if !exists {
        let create = create_publication_sql(publication, tables);
        return Ok(publication_refusal(client, publication, tables, false)
            .await?
            .map(|r| (r, create)));
    }
    let mut missing = Vec::new();
    for t in tables {
        let covers: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_publication_tables
                                 WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)",
                &[&publication, &t.pg_schema(), &t.name],
            )
            .await?
            .get(0);
        if !covers {
            missing.push(t.clone());
        }
    }
    if missing.is_empty() {
        return Ok(None);
    }
    let alter = format!(
        "ALTER PUBLICATION {} ADD TABLE {}",
        pg_ident(publication),
        missing
            .iter()
            .map(TableName::pg_quoted)
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(publication_refusal(client, publication, &missing, true)
        .await?
        .map(|r| (r, alter)))
}

/// The owner of the publication when it exists and the session's role is not (a member of)
/// it: only the owner can drop it.
pub async fn publication_foreign_owner(
    client: &Client,
    publication: &str,
) -> Result<Option<String>, Error> {
    Ok(client
        .query_opt(
            "SELECT pg_get_userbyid(pubowner)::text FROM pg_publication
              WHERE pubname = $1 AND NOT pg_has_role(pubowner, 'USAGE')",
            &[&publication],
        )
        .await?
        .map(|r| r.get(0)))
}

/// Whether the table is a partitioned (parent) table.
pub(crate) async fn is_partitioned(client: &Client, table: &TableName) -> Result<bool, Error> {
    Ok(client
        .query_one(
            "SELECT coalesce((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)",
            &[&table.pg_quoted()],
        )
        .await?
        .get(0))
}

/// Creates the logical slot; returns its consistent point. A slot of that name created by
/// someone else a moment earlier (`outboxd setup` beside a first start) is taken as it is:
/// its confirmed position, which is where a new slot would have started too.
pub(crate) async fn create_slot(client: &Client, slot: &str) -> Result<u64, Error> {
    create_slot_as(client, slot, false).await
}

/// [`create_slot`], as a failover slot when `failover` (PostgreSQL 17+: the caller checks the
/// version, see [`super::version`]).
pub async fn create_slot_as(client: &Client, slot: &str, failover: bool) -> Result<u64, Error> {
    let row = match client
        .query_one(super::version::create_slot_sql(failover), &[&slot])
        .await
    {
        Ok(row) => row,
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::DUPLICATE_OBJECT) => {
            if let Some(lsn) = self::slot(client, slot)
                .await?
                .and_then(|s| s.confirmed_flush_lsn)
            {
                tracing::info!(slot, at = %crate::event::format_lsn(lsn), "replication slot created concurrently: using it");
                return Ok(lsn);
            }
            return Err(e.into());
        }
        Err(e) => return Err(e.into()),
    };
    let lsn: String = row.get(0);
    tracing::info!(slot, at = %lsn, failover, "created replication slot");
    parse_lsn(&lsn).ok_or_else(|| Error::Decode(format!("slot LSN {lsn:?}")))
}

pub async fn drop_slot(client: &Client, slot: &str) -> Result<bool, Error> {
    if self::slot(client, slot).await?.is_none() {
        return Ok(false);
    }
    client
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await?;
    Ok(true)
}

/// Ends the walsender of another session that still holds `slot` (a paused old leader's), so
/// that this relay can stream from it; how many sessions it ended. Never this session.
pub(crate) async fn end_other_slot_holder(client: &Client, slot: &str) -> Result<u64, Error> {
    Ok(client
        .execute(
            "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = $1 AND active AND active_pid <> pg_backend_pid()",
            &[&slot],
        )
        .await?)
}

/// How many rows of `table` were created at or after `since` (its `created_at` column as
/// `columns` maps it): what a replay through the table publishes again, for its log line.
pub(crate) async fn rows_created_since(
    client: &Client,
    table: &TableName,
    columns: &ColumnMap,
    since: chrono::DateTime<chrono::Utc>,
) -> Result<i64, Error> {
    Ok(client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE {} >= $1",
                table.pg_quoted(),
                pg_ident(columns.get(Column::CreatedAt))
            ),
            &[&since],
        )
        .await?
        .get::<_, i64>(0))
}

/// The planner's estimate of the rows `SELECT … FROM table {filter}` reads (`pg_class.reltuples`
/// and the column statistics, no scan): a snapshot's or replay's total, said as an estimate.
/// `None` when the planner cannot say: an estimate never stops a snapshot.
pub async fn estimate_rows(client: &Client, table: &TableName, filter: &str) -> Option<u64> {
    let sql = format!(
        "EXPLAIN (FORMAT JSON) SELECT 1 FROM {} {filter}",
        table.pg_quoted()
    );
    let plan: serde_json::Value = client.query_one(&sql, &[]).await.ok()?.try_get(0).ok()?;
    let rows = plan.get(0)?.get("Plan")?.get("Plan Rows")?.as_f64()?;
    Some(rows.max(0.0) as u64)
}

pub async fn drop_publication(client: &Client, publication: &str) -> Result<(), Error> {
    client
        .batch_execute(&format!(
            "DROP PUBLICATION IF EXISTS {}",
            pg_ident(publication)
        ))
        .await?;
    Ok(())
}

/// The fix text for a lost slot.
pub fn lost_slot_fix(name: &str, slot: &str) -> String {
    format!(
        "events written while the slot was missing may not be relayed. Either start over from now \
         (`outboxd teardown --name {name} --yes`, then `outboxd run --snapshot since=<time of the last delivered event> ...`), \
         or re-create the slot and accept the gap: SELECT pg_create_logical_replication_slot({}, 'pgoutput');",
        pg_literal(slot)
    )
}

/// The fix text for a state row whose positions this server never wrote (see
/// `state::postgres::foreign_position`).
pub(crate) fn foreign_position_fix(name: &str) -> String {
    format!(
        "the events since this relay's last delivered one were never relayed from this server. Either publish them \
         again from the table (`outboxd run --on-position-lost poll ...` replays every row created since the last \
         delivered one, then streams from a fresh slot, and stores positions of this server from then on), or start \
         over: `outboxd teardown --name {name} --yes`, then `outboxd run --snapshot since=<time of the last delivered \
         event> ...`"
    )
}

/// The fix text for a first start whose slot was dropped or replaced before it finished.
pub(crate) fn interrupted_first_start_fix(name: &str) -> String {
    format!(
        "the first start must publish its snapshot again from the beginning: `outboxd run --on-position-lost poll ...` \
         starts it over from a fresh slot (expect duplicates of the rows it already published), or start over by hand: \
         `outboxd teardown --name {name} --yes`, then `outboxd run ...`"
    )
}

/// The fix text for a slot that was dropped and created again under the relay's slot name.
pub(crate) fn replaced_slot_fix(name: &str, slot: &str) -> String {
    format!(
        "events committed between the old slot's last position and the new slot's creation were not relayed. \
         Either publish them again from the table (`outboxd run --on-position-lost poll ...` replays every row created since \
         the last delivered one, then streams from a fresh slot), or start over: `outboxd teardown --name {name} --yes`, then \
         `outboxd run --snapshot since=<time of the last delivered event> ...`. If slot {slot:?} was advanced on purpose, \
         record that with `outboxd offset set --name {name} --lsn <its confirmed_flush_lsn>`"
    )
}
