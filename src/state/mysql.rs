//! `outboxd_state` in a MySQL/MariaDB source database: the same columns and rules as the
//! Postgres one (lease with holder, epoch and expiry; a position that never moves backwards and
//! is written only by the lease holder of the current epoch). The position is the binlog file
//! and end position of the last transaction whose events are all durable, plus the server's
//! full GTID state there (MariaDB: every domain).
//!
//! Every write here is itself a binlog transaction that the relay reads back. The source never
//! turns a transaction that only wrote this table into a checkpoint, so a stored position is
//! always one another transaction moved, and storing it causes no further write.

use super::{holder_is_dead_locally, Lease, StateStore, Stored, LEASE_TTL};
use crate::dsn::DbDsn;
use crate::event::{binlog_file_seq, Checkpoint};
use crate::Error;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, TxOpts};

pub const DDL: &str = "CREATE TABLE IF NOT EXISTS outboxd_state (
    name              VARCHAR(64)  NOT NULL PRIMARY KEY,
    source            VARCHAR(16)  NOT NULL,
    slot              VARCHAR(128) NULL,
    publication       VARCHAR(128) NULL,
    epoch             BIGINT       NOT NULL DEFAULT 0,
    lease_holder      VARCHAR(255) NULL,
    lease_renewed_at  DATETIME(6)  NULL,
    lease_expires_at  DATETIME(6)  NULL,
    position          TEXT         NULL,
    position_lsn      VARCHAR(32)  NULL,
    binlog_file       VARCHAR(255) NULL,
    binlog_pos        BIGINT UNSIGNED NULL,
    gtid_state        TEXT         NULL,
    commit_gap_ms     BIGINT       NULL,
    position_commit_at DATETIME(6) NULL,
    initialized_at    DATETIME(6)  NULL,
    created_at        DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    updated_at        DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6)
) ENGINE=InnoDB";

/// What the state row says about a relay name. Times are UTC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateRow {
    pub name: String,
    pub source: String,
    pub epoch: i64,
    pub lease_holder: Option<String>,
    pub lease_live: bool,
    pub position: Option<Checkpoint>,
    pub initialized: bool,
}

/// Columns added after the first release: (name, definition). Added to older state tables by
/// [`ensure_table`] (MySQL 8 has no `ADD COLUMN IF NOT EXISTS`, so it looks first).
const ADDED_COLUMNS: [(&str, &str); 3] = [
    ("position_commit_at", "DATETIME(6) NULL"),
    ("snapshot_key", "TEXT NULL"),
    ("progress", "TEXT NULL"),
];

pub async fn ensure_table(conn: &mut Conn) -> Result<(), Error> {
    // Looked at first, so that a complete table needs no DDL: the relay's own user then needs
    // no CREATE or ALTER (CREATE TABLE IF NOT EXISTS wants CREATE even when the table exists).
    let mut have = state_columns(conn).await?;
    if have.is_empty() {
        if let Err(e) = conn.query_drop(DDL).await {
            return Err(refused(conn, e, &super::Gap::Table).await);
        }
        have = state_columns(conn).await?;
    }
    let missing: Vec<&'static str> = ADDED_COLUMNS
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !have.iter().any(|c| c.eq_ignore_ascii_case(name)))
        .collect();
    for (name, def) in ADDED_COLUMNS {
        if missing.contains(&name) {
            match conn
                .query_drop(format!("ALTER TABLE outboxd_state ADD COLUMN {name} {def}"))
                .await
            {
                // Added by a relay starting at the same moment (duplicate column name).
                Err(e) if crate::db::mysql::server_code(&e) == Some(1060) => {}
                Err(e) => {
                    let gap = super::Gap::Columns(missing.clone());
                    return Err(refused(conn, e, &gap).await);
                }
                Ok(()) => {}
            }
        }
    }
    Ok(())
}

/// What the state table lacks for this version, as the session's user sees it (a table it has
/// no privilege on looks missing).
pub async fn gap(conn: &mut Conn) -> Result<Option<super::Gap>, Error> {
    let have = state_columns(conn).await?;
    if have.is_empty() {
        return Ok(Some(super::Gap::Table));
    }
    let missing: Vec<&'static str> = ADDED_COLUMNS
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !have.iter().any(|c| c.eq_ignore_ascii_case(name)))
        .collect();
    Ok((!missing.is_empty()).then_some(super::Gap::Columns(missing)))
}

/// The columns of `outboxd_state` the session's user can see (none: no such table, or no
/// privilege on it).
async fn state_columns(conn: &mut Conn) -> Result<Vec<String>, Error> {
    Ok(conn
        .query(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS
              WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outboxd_state'",
        )
        .await?)
}

/// Whether a server error is a privilege refusal: table (1142), column (1143) or database
/// (1044) access denied.
fn denied(e: &mysql_async::Error) -> bool {
    matches!(crate::db::mysql::server_code(e), Some(1142 | 1143 | 1044))
}

/// The session's account as a `GRANT` names it: `'relay'@'%'`.
pub(crate) async fn current_account(conn: &mut Conn) -> Result<String, Error> {
    let who: Option<String> = conn.query_first("SELECT CURRENT_USER()").await?;
    let who = who.unwrap_or_default();
    Ok(match who.rsplit_once('@') {
        Some((user, host)) => format!("'{user}'@'{host}'"),
        None => format!("'{who}'"),
    })
}

/// A refused change of `outboxd_state` (creating it, adding columns) as the fix says it: the
/// setup user makes it (docs/operations.md), the relay's user only reads and writes rows.
async fn refused(conn: &mut Conn, e: mysql_async::Error, gap: &super::Gap) -> Error {
    use super::Gap;
    if !denied(&e) {
        return e.into();
    }
    let Ok(account) = current_account(conn).await else {
        return e.into();
    };
    let db: Option<Option<String>> = conn.query_first("SELECT DATABASE()").await.unwrap_or(None);
    let table = format!(
        "`{}`.outboxd_state",
        db.flatten().unwrap_or_default().replace('`', "``")
    );
    let why = match &e {
        mysql_async::Error::Server(s) => s.message.clone(),
        other => other.to_string(),
    };
    match gap {
        Gap::Table => Error::config(
            format!("outboxd_state does not exist, or user {account} has no privilege on it, and the user may not create it ({why})"),
            format!(
                "run `outboxd setup` as the setup user (docs/operations.md, \"Grants\"), then GRANT SELECT, INSERT, UPDATE ON {table} TO {account};"
            ),
        ),
        Gap::Columns(missing) => Error::config(
            format!(
                "outboxd_state lacks the columns {} that this version of outboxd uses, and user {account} may not add them ({why})",
                missing.join(", ")
            ),
            format!(
                "run `outboxd setup` as the setup user (docs/operations.md, \"Grants\"), or as a user with ALTER on it: {}",
                ADDED_COLUMNS
                    .iter()
                    .filter(|(name, _)| missing.contains(name))
                    .map(|(name, def)| format!("ALTER TABLE {table} ADD COLUMN {name} {def};"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
        ),
    }
}

/// Which of SELECT, INSERT and UPDATE on `outboxd_state` the session's user lacks, found by
/// running each statement on no row inside a transaction that is rolled back (so roles and
/// every grant level count, and nothing is written or logged).
pub(crate) async fn missing_state_privileges(conn: &mut Conn) -> Result<Vec<&'static str>, Error> {
    conn.query_drop("START TRANSACTION").await?;
    let mut missing = Vec::new();
    for (privilege, probe) in [
        ("SELECT", "SELECT name FROM outboxd_state WHERE FALSE"),
        (
            "INSERT",
            "INSERT INTO outboxd_state (name, source) SELECT 'x', 'x' FROM DUAL WHERE FALSE",
        ),
        ("UPDATE", "UPDATE outboxd_state SET epoch = 0 WHERE FALSE"),
    ] {
        match conn.query_drop(probe).await {
            Ok(()) => {}
            Err(e) if denied(&e) => missing.push(privilege),
            Err(e) => {
                let _ = conn.query_drop("ROLLBACK").await;
                return Err(e.into());
            }
        }
    }
    conn.query_drop("ROLLBACK").await?;
    Ok(missing)
}

/// An error of a statement on `outboxd_state`: a missing privilege becomes the `GRANT` that
/// fixes it (probed, so it names exactly what is missing).
pub(crate) async fn state_refused(conn: &mut Conn, e: Error) -> Error {
    // The client's classifier makes every privilege refusal a configuration error; anything
    // else (a lease held by another relay, which a standby meets every second) is as it is.
    if !matches!(e, Error::Config { .. }) {
        return e;
    }
    let Ok(missing) = missing_state_privileges(conn).await else {
        return e;
    };
    if missing.is_empty() {
        return e;
    }
    let Ok(account) = current_account(conn).await else {
        return e;
    };
    let db: Option<Option<String>> = conn.query_first("SELECT DATABASE()").await.unwrap_or(None);
    Error::config(
        format!(
            "user {account} lacks {} on outboxd_state",
            missing.join(", ")
        ),
        format!(
            "GRANT {} ON `{}`.outboxd_state TO {account};",
            missing.join(", "),
            db.flatten().unwrap_or_default().replace('`', "``")
        ),
    )
}

/// Creates the state row of `name` when missing, in a statement of its own: inside the
/// transaction that then locks the row, several relays starting at once would each hold a
/// shared lock from the duplicate-key check and deadlock wanting the exclusive one.
async fn insert_row(conn: &mut Conn, name: &str) -> Result<(), Error> {
    conn.exec_drop(
        "INSERT IGNORE INTO outboxd_state (name, source) VALUES (?, 'mysql')",
        (name,),
    )
    .await?;
    Ok(())
}

/// The commit time of the last durable transaction and the largest commit-vs-`created_at` gap
/// seen (ms), as stored for relay `name`.
pub(crate) async fn load_commit(
    conn: &mut Conn,
    name: &str,
) -> Result<super::DurableCommit, Error> {
    let row: Option<(Option<String>, Option<i64>)> = conn
        .exec_first(
            "SELECT DATE_FORMAT(position_commit_at, '%Y-%m-%d %H:%i:%s.%f'), commit_gap_ms
               FROM outboxd_state WHERE name = ?",
            (name,),
        )
        .await?;
    let (at, gap) = row.unwrap_or((None, None));
    Ok(super::DurableCommit {
        commit_at: at
            .and_then(|t| chrono::NaiveDateTime::parse_from_str(&t, "%Y-%m-%d %H:%M:%S%.f").ok())
            .map(|t| t.and_utc()),
        max_gap_ms: gap,
    })
}

pub async fn table_exists(conn: &mut Conn) -> Result<bool, Error> {
    let n: Option<i64> = conn
        .query_first(
            "SELECT COUNT(*) FROM information_schema.TABLES
              WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outboxd_state'",
        )
        .await?;
    Ok(n.unwrap_or(0) > 0)
}

type Raw = (
    String,
    String,
    i64,
    Option<String>,
    i64,
    Option<String>,
    Option<u64>,
    Option<String>,
    i64,
);

fn checkpoint(file: Option<String>, pos: Option<u64>, gtid: Option<String>) -> Option<Checkpoint> {
    Some(Checkpoint::Binlog {
        file: file?,
        pos: pos?,
        gtid_state: gtid.filter(|g| !g.is_empty()),
    })
}

const SELECT_ROW: &str = "SELECT name, source, epoch, lease_holder,
        COALESCE(lease_expires_at > UTC_TIMESTAMP(6), 0), binlog_file, binlog_pos, gtid_state,
        initialized_at IS NOT NULL
   FROM outboxd_state WHERE name = ?";

fn to_row(r: Raw) -> StateRow {
    StateRow {
        name: r.0,
        source: r.1,
        epoch: r.2,
        lease_holder: r.3,
        lease_live: r.4 != 0,
        position: checkpoint(r.5, r.6, r.7),
        initialized: r.8 != 0,
    }
}

pub async fn load(conn: &mut Conn, name: &str) -> Result<Option<StateRow>, Error> {
    if !table_exists(conn).await? {
        return Ok(None);
    }
    let r: Option<Raw> = match conn.exec_first(SELECT_ROW, (name,)).await {
        Ok(r) => r,
        Err(e) => return Err(state_refused(conn, e.into()).await),
    };
    Ok(r.map(to_row))
}

/// Takes the lease for `name`, creating the state row on first use. Refused while another
/// live process holds it. Returns the lease and the stored position: on a first start, the
/// position an earlier, interrupted run of it started from (if it got that far).
pub async fn acquire(
    conn: &mut Conn,
    name: &str,
    holder: &str,
) -> Result<(Lease, Option<Checkpoint>), Error> {
    ensure_table(conn).await?;
    match acquire_row(conn, name, holder).await {
        Err(e) => Err(state_refused(conn, e).await),
        ok => ok,
    }
}

async fn acquire_row(
    conn: &mut Conn,
    name: &str,
    holder: &str,
) -> Result<(Lease, Option<Checkpoint>), Error> {
    insert_row(conn, name).await?;
    let mut tx = conn.start_transaction(TxOpts::default()).await?;
    let row: Raw = tx
        .exec_first(format!("{SELECT_ROW} FOR UPDATE"), (name,))
        .await?
        .ok_or_else(|| Error::Other(format!("state row of {name:?} vanished")))?;
    let row = to_row(row);
    if row.source != "mysql" {
        tx.rollback().await?;
        return Err(Error::config(
            format!(
                "relay name {name:?} belongs to a {} source in this database",
                row.source
            ),
            "choose another --name",
        ));
    }
    if let Err(e) = super::take_over(name, row.lease_holder.as_deref(), row.lease_live, holder) {
        // Rolled back now, not when the session is next used: a standby (`--ha`) keeps this
        // session idle between attempts, and the row lock would stall the leader's renewals
        // until it fences itself.
        tx.rollback().await?;
        return Err(e);
    }
    tx.exec_drop(
        "UPDATE outboxd_state SET epoch = epoch + 1, lease_holder = ?,
                lease_renewed_at = UTC_TIMESTAMP(6),
                lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL ? SECOND,
                updated_at = UTC_TIMESTAMP(6)
          WHERE name = ?",
        (holder, LEASE_TTL.as_secs(), name),
    )
    .await?;
    let epoch: i64 = tx
        .exec_first("SELECT epoch FROM outboxd_state WHERE name = ?", (name,))
        .await?
        .unwrap_or(0);
    tx.commit().await?;
    Ok((
        Lease {
            name: name.to_string(),
            holder: holder.to_string(),
            epoch,
            first_start: !row.initialized,
            replay_since: None,
        },
        row.position,
    ))
}

use super::lost;

fn parts(cp: &Checkpoint) -> Result<(String, u64, Option<String>), Error> {
    match cp {
        Checkpoint::Binlog {
            file,
            pos,
            gtid_state,
        } => Ok((file.clone(), *pos, gtid_state.clone())),
        other => Err(Error::Other(format!(
            "a {other} position cannot be stored for a binlog source"
        ))),
    }
}

/// How far an unfinished first start's snapshot got (the last row whose publication is
/// durable), as stored for relay `name`.
pub(crate) async fn load_snapshot_key(
    conn: &mut Conn,
    name: &str,
) -> Result<Option<String>, Error> {
    let key: Option<Option<String>> = conn
        .exec_first(
            "SELECT snapshot_key FROM outboxd_state WHERE name = ?",
            (name,),
        )
        .await?;
    Ok(key.flatten())
}

/// Stores a first start's position before its first event is published (`done`: it has no
/// snapshot, so the first start is over). Only where no position is stored yet: a restarted
/// first start keeps the position its first run stored.
pub async fn store_start(
    conn: &mut Conn,
    lease: &Lease,
    start: &Checkpoint,
    done: bool,
) -> Result<(), Error> {
    let (file, pos, gtid) = parts(start)?;
    let mut tx = conn.start_transaction(TxOpts::default()).await?;
    tx.exec_drop(
        "UPDATE outboxd_state SET initialized_at = IF(?, COALESCE(initialized_at, UTC_TIMESTAMP(6)), initialized_at),
                updated_at = UTC_TIMESTAMP(6)
          WHERE name = ? AND epoch = ? AND lease_holder = ?",
        (done, &lease.name, lease.epoch, &lease.holder),
    )
    .await?;
    if tx.affected_rows() == 0 {
        tx.rollback().await?;
        return Err(lost(lease));
    }
    tx.exec_drop(
        "UPDATE outboxd_state SET binlog_file = ?, binlog_pos = ?, gtid_state = ?, position = ?
          WHERE name = ? AND epoch = ? AND lease_holder = ? AND binlog_file IS NULL",
        (
            &file,
            pos,
            &gtid,
            format!("{file}:{pos}"),
            &lease.name,
            lease.epoch,
            &lease.holder,
        ),
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Marks the first start as done: its snapshot (if any) is durable and a position is stored.
/// Stores what the running phase has got to (see `crate::progress::summary`).
pub(crate) async fn report_progress(
    conn: &mut Conn,
    lease: &Lease,
    progress: Option<&str>,
) -> Result<(), Error> {
    conn.exec_drop(
        "UPDATE outboxd_state SET progress = ? WHERE name = ? AND epoch = ? AND lease_holder = ?",
        (progress, &lease.name, lease.epoch, &lease.holder),
    )
    .await?;
    Ok(())
}

/// What the lease holder of relay `name` last said of its running phase; `None` when nothing
/// runs, or before the column exists.
pub(crate) async fn load_progress(conn: &mut Conn, name: &str) -> Option<String> {
    conn.exec_first::<Option<String>, _, _>(
        "SELECT progress FROM outboxd_state WHERE name = ?",
        (name,),
    )
    .await
    .ok()??
}

pub async fn mark_initialized(conn: &mut Conn, lease: &Lease) -> Result<(), Error> {
    conn.exec_drop(
        "UPDATE outboxd_state SET initialized_at = COALESCE(initialized_at, UTC_TIMESTAMP(6)),
                snapshot_key = NULL, updated_at = UTC_TIMESTAMP(6)
          WHERE name = ? AND epoch = ? AND lease_holder = ?",
        (&lease.name, lease.epoch, &lease.holder),
    )
    .await?;
    if conn.affected_rows() == 0 {
        return Err(lost(lease));
    }
    Ok(())
}

/// Renews the lease and, when given, stores a newer position. A position older than the stored
/// one is ignored by the statement itself, so the row never moves backwards.
///
/// Each statement commits on its own, never inside an open transaction: a relay paused
/// between two statements of one (SIGSTOP, a VM pause, a long GC stall) would keep the row
/// locked for as long as it stays paused, and the standby's takeover (`acquire` locks the row)
/// would wait behind it instead of taking the expired lease. Every statement checks the epoch
/// and holder itself, so none needs the others to be safe. Needs a session with found-rows
/// semantics ([`crate::db::mysql::connect_state`]).
pub async fn renew(
    conn: &mut Conn,
    lease: &Lease,
    position: Option<&Checkpoint>,
    commit: &super::DurableCommit,
) -> Result<(), Error> {
    let commit_at = commit
        .commit_at
        .map(|t| t.naive_utc().format("%Y-%m-%d %H:%M:%S%.6f").to_string());
    // Commit time and gap only ever grow (NULL leaves them as they are).
    conn.exec_drop(
        "UPDATE outboxd_state SET lease_renewed_at = UTC_TIMESTAMP(6),
                lease_expires_at = UTC_TIMESTAMP(6) + INTERVAL ? SECOND,
                position_commit_at = CASE WHEN ? IS NOT NULL
                     AND (position_commit_at IS NULL OR position_commit_at < ?)
                    THEN ? ELSE position_commit_at END,
                commit_gap_ms = CASE WHEN ? IS NOT NULL
                     AND (commit_gap_ms IS NULL OR commit_gap_ms < ?)
                    THEN ? ELSE commit_gap_ms END,
                updated_at = UTC_TIMESTAMP(6)
          WHERE name = ? AND epoch = ? AND lease_holder = ?",
        (
            LEASE_TTL.as_secs(),
            &commit_at,
            &commit_at,
            &commit_at,
            commit.max_gap_ms,
            commit.max_gap_ms,
            commit.max_gap_ms,
            &lease.name,
            lease.epoch,
            &lease.holder,
        ),
    )
    .await?;
    if conn.affected_rows() == 0 {
        return Err(lost(lease));
    }
    if let Some(Checkpoint::Snapshot { key, .. }) = position {
        conn.exec_drop(
            "UPDATE outboxd_state SET snapshot_key = ? WHERE name = ? AND epoch = ? AND lease_holder = ?",
            (key, &lease.name, lease.epoch, &lease.holder),
        )
        .await?;
    } else if let Some(cp) = position {
        let (file, pos, gtid) = parts(cp)?;
        let seq = binlog_file_seq(&file);
        conn.exec_drop(
            "UPDATE outboxd_state SET binlog_file = ?, binlog_pos = ?, gtid_state = ?, position = ?
              WHERE name = ? AND epoch = ? AND lease_holder = ?
                AND (binlog_file IS NULL
                     OR CAST(SUBSTRING_INDEX(binlog_file, '.', -1) AS UNSIGNED) < ?
                     OR (CAST(SUBSTRING_INDEX(binlog_file, '.', -1) AS UNSIGNED) = ? AND binlog_pos < ?))",
            (
                &file,
                pos,
                &gtid,
                format!("{file}:{pos}"),
                &lease.name,
                lease.epoch,
                &lease.holder,
                seq,
                seq,
                pos,
            ),
        )
        .await?;
    }
    Ok(())
}

/// Moves the stored position by hand (`offset set`), backwards or forwards; refused while a
/// live relay holds the lease. The first start counts as done: the next start resumes there.
pub async fn set_position(
    conn: &mut Conn,
    name: &str,
    file: &str,
    pos: u64,
    gtid: Option<&str>,
) -> Result<(), Error> {
    ensure_table(conn).await?;
    insert_row(conn, name).await?;
    let mut tx = conn.start_transaction(TxOpts::default()).await?;
    let row: Raw = tx
        .exec_first(format!("{SELECT_ROW} FOR UPDATE"), (name,))
        .await?
        .ok_or_else(|| Error::Other(format!("state row of {name:?} vanished")))?;
    let row = to_row(row);
    if row.source != "mysql" {
        return Err(Error::config(
            format!(
                "relay name {name:?} belongs to a {} source in this database",
                row.source
            ),
            "choose another --name",
        ));
    }
    if let Some(h) = row.lease_holder.as_deref() {
        if row.lease_live && !holder_is_dead_locally(h) {
            return Err(Error::config(
                format!("relay {name:?} is running (lease held by {h})"),
                "stop it first",
            ));
        }
    }
    tx.exec_drop(
        "UPDATE outboxd_state SET binlog_file = ?, binlog_pos = ?, gtid_state = ?, position = ?,
                initialized_at = COALESCE(initialized_at, UTC_TIMESTAMP(6)), snapshot_key = NULL,
                updated_at = UTC_TIMESTAMP(6)
          WHERE name = ?",
        (file, pos, gtid, format!("{file}:{pos}"), name),
    )
    .await?;
    tx.commit().await?;
    Ok(())
}

/// Replaces the stored position by `marker` (see `source::mysql::admin::lost_marker`)
/// while this lease holds: a recovery whose new positions sort before the lost one, which the
/// forward-only rule would otherwise never let replace it.
pub(crate) async fn mark_lost(
    conn: &mut Conn,
    lease: &Lease,
    marker: &Checkpoint,
) -> Result<(), Error> {
    let (file, pos, gtid) = parts(marker)?;
    conn.exec_drop(
        "UPDATE outboxd_state SET binlog_file = ?, binlog_pos = ?, gtid_state = ?, position = ?,
                updated_at = UTC_TIMESTAMP(6)
          WHERE name = ? AND epoch = ? AND lease_holder = ?",
        (
            &file,
            pos,
            &gtid,
            format!("{file}:{pos}"),
            &lease.name,
            lease.epoch,
            &lease.holder,
        ),
    )
    .await?;
    if conn.affected_rows() == 0 {
        return Err(lost(lease));
    }
    Ok(())
}

/// Gives the lease up at a clean shutdown, so the next start need not wait for it to expire.
pub async fn release(conn: &mut Conn, lease: &Lease) -> Result<(), Error> {
    conn.exec_drop(
        "UPDATE outboxd_state SET lease_holder = NULL, lease_expires_at = NULL, updated_at = UTC_TIMESTAMP(6)
          WHERE name = ? AND epoch = ? AND lease_holder = ?",
        (&lease.name, lease.epoch, &lease.holder),
    )
    .await?;
    Ok(())
}

/// Deletes the state of `name` (teardown).
pub async fn delete(conn: &mut Conn, name: &str) -> Result<u64, Error> {
    if !table_exists(conn).await? {
        return Ok(0);
    }
    conn.exec_drop("DELETE FROM outboxd_state WHERE name = ?", (name,))
        .await?;
    Ok(conn.affected_rows())
}

/// The lease keeper's view of a MySQL state table: one session, reconnected on demand.
pub struct MyStateStore {
    dsn: DbDsn,
    conn: Option<Conn>,
}

impl MyStateStore {
    pub fn new(dsn: DbDsn) -> Self {
        MyStateStore { dsn, conn: None }
    }

    /// The session, taken out of the store for one call: a call that fails, or that is
    /// cancelled half-way (the keeper times renewals out), drops it with whatever state it was
    /// left in, and the next call starts on a fresh one.
    async fn take_conn(&mut self) -> Result<Conn, Error> {
        match self.conn.take() {
            Some(c) => Ok(c),
            None => crate::db::mysql::connect_state(&self.dsn).await,
        }
    }

    fn put_back<T>(&mut self, conn: Conn, r: &Result<T, Error>) {
        if matches!(r, Ok(_) | Err(Error::Leadership(_))) {
            self.conn = Some(conn);
        }
    }
}

/// A call that takes longer than this failed (a stalled connection must not hold the keeper).
const STATEMENT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(4);

fn no_answer() -> Error {
    Error::timeout(format!(
        "state store: no answer within {STATEMENT_TIMEOUT:?}"
    ))
}

impl StateStore for MyStateStore {
    // Not bounded by STATEMENT_TIMEOUT: relays starting together wait for each other's row
    // lock here, and a start has no lease to keep yet.
    async fn acquire(
        &mut self,
        name: &str,
        holder: &str,
    ) -> Result<(Lease, Option<Checkpoint>), Error> {
        let mut conn = self.take_conn().await?;
        let r = acquire(&mut conn, name, holder).await;
        // A refusal rolled its transaction back: the session is clean for the next attempt
        // (a standby retries on it every renewal period).
        if matches!(r, Err(Error::LeaseHeld(_))) {
            self.conn = Some(conn);
        } else {
            self.put_back(conn, &r);
        }
        r
    }

    async fn load(&mut self, name: &str) -> Result<Option<Stored>, Error> {
        let mut conn = self.take_conn().await?;
        let r = async {
            let Some(row) = load(&mut conn, name).await? else {
                return Ok(None);
            };
            Ok(Some(Stored {
                position: row.position,
                initialized: row.initialized,
                snapshot_key: load_snapshot_key(&mut conn, name).await?,
                commit: load_commit(&mut conn, name).await?,
                stream_start: None,
                created_at: None,
            }))
        }
        .await;
        self.put_back(conn, &r);
        r
    }

    async fn renew(
        &mut self,
        lease: &Lease,
        position: Option<&Checkpoint>,
        commit: &super::DurableCommit,
    ) -> Result<(), Error> {
        tokio::time::timeout(STATEMENT_TIMEOUT, async {
            let mut conn = self.take_conn().await?;
            let r = renew(&mut conn, lease, position, commit).await;
            self.put_back(conn, &r);
            r
        })
        .await
        .unwrap_or_else(|_| Err(no_answer()))
    }

    async fn store_start(
        &mut self,
        lease: &Lease,
        start: &Checkpoint,
        done: bool,
    ) -> Result<(), Error> {
        tokio::time::timeout(STATEMENT_TIMEOUT, async {
            let mut conn = self.take_conn().await?;
            let r = store_start(&mut conn, lease, start, done).await;
            self.put_back(conn, &r);
            r
        })
        .await
        .unwrap_or_else(|_| Err(no_answer()))
    }

    async fn mark_initialized(&mut self, lease: &Lease) -> Result<(), Error> {
        tokio::time::timeout(STATEMENT_TIMEOUT, async {
            let mut conn = self.take_conn().await?;
            let r = mark_initialized(&mut conn, lease).await;
            self.put_back(conn, &r);
            r
        })
        .await
        .unwrap_or_else(|_| Err(no_answer()))
    }

    async fn report_progress(
        &mut self,
        lease: &Lease,
        progress: Option<&str>,
    ) -> Result<(), Error> {
        tokio::time::timeout(STATEMENT_TIMEOUT, async {
            let mut conn = self.take_conn().await?;
            let r = report_progress(&mut conn, lease, progress).await;
            self.put_back(conn, &r);
            r
        })
        .await
        .unwrap_or_else(|_| Err(no_answer()))
    }

    async fn release(&mut self, lease: &Lease) -> Result<(), Error> {
        tokio::time::timeout(STATEMENT_TIMEOUT, async {
            let mut conn = self.take_conn().await?;
            let r = release(&mut conn, lease).await;
            self.put_back(conn, &r);
            r
        })
        .await
        .unwrap_or_else(|_| Err(no_answer()))
    }

    async fn restart(
        &mut self,
        lease: &Lease,
        replay_since: Option<chrono::DateTime<chrono::Utc>>,
    ) -> Result<(), Error> {
        if replay_since.is_some() {
            return Err(no_replay());
        }
        let mut conn = self.take_conn().await?;
        let r = forget_position(&mut conn, lease).await;
        self.put_back(conn, &r);
        r
    }

    async fn replace_position(&mut self, lease: &Lease, marker: &Checkpoint) -> Result<(), Error> {
        let mut conn = self.take_conn().await?;
        let r = mark_lost(&mut conn, lease, marker).await;
        self.put_back(conn, &r);
        r
    }
}

/// A binlog source's recovery keeps the lost position stored until its replay is confirmed
/// (see `source::mysql::startup`), so its stores record no replay.
pub(crate) fn no_replay() -> Error {
    Error::Other(
        "a binlog source's state records no replay: its recovery keeps the lost position until the replay is confirmed"
            .into(),
    )
}

/// Forgets the stored position and the snapshot's progress (see [`StateStore::restart`]).
async fn forget_position(conn: &mut Conn, lease: &Lease) -> Result<(), Error> {
    conn.exec_drop(
        "UPDATE outboxd_state SET binlog_file = NULL, binlog_pos = NULL, gtid_state = NULL, position = NULL,
                snapshot_key = NULL, initialized_at = NULL, updated_at = UTC_TIMESTAMP(6)
          WHERE name = ? AND epoch = ? AND lease_holder = ?",
        (&lease.name, lease.epoch, &lease.holder),
    )
    .await?;
    if conn.affected_rows() == 0 {
        return Err(lost(lease));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_migration_file_is_the_ddl() {
        let file = include_str!("../../migrations/mysql/002_outboxd_state.sql");
        let ddl: String = file
            .lines()
            .filter(|l| !l.starts_with("--"))
            .collect::<Vec<_>>()
            .join("\n");
        assert_eq!(ddl.trim().trim_end_matches(';'), super::DDL);
    }
}
