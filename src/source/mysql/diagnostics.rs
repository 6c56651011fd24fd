//! The operator's commands for a MySQL/MariaDB source: `check` (one line per check, the exact
//! fix for each failure, prepared XA transactions among them) and `status` / `offset show`
//! (stored position, server head, lag, dump thread, lease, and the prepared XA transaction
//! that holds the stored position back, with its age).

use super::rows::OutboxTable;
use super::{admin, connect_sql, snapshot};
use crate::diagnostics::{CheckLine, Level};
use crate::dsn::DbDsn;
use crate::event::{binlog_file_seq, Checkpoint};
use crate::outbox::{my_ident, Column};
use crate::Error;
use mysql_async::prelude::Queryable;
use mysql_async::Conn;
use serde::Serialize;

fn line(level: Level, check: &str, detail: impl Into<String>, fix: Option<String>) -> CheckLine {
    CheckLine {
        level,
        check: check.into(),
        detail: detail.into(),
        fix,
    }
}

/// Runs every MySQL check (of CDC mode, or of poll mode when `poll`); never stops at the first
/// failure.
pub async fn check_mysql(
    dsn: &DbDsn,
    name: &str,
    table: &OutboxTable,
    poll: bool,
) -> Vec<CheckLine> {
    let mut out = Vec::new();
    let mut conn = match connect_sql(dsn).await {
        Ok(c) => {
            out.push(line(
                Level::Ok,
                "connect",
                format!("{}:{} database {}", dsn.host, dsn.port, dsn.database),
                None,
            ));
            c
        }
        Err(e) => {
            out.push(line(
                Level::Fail,
                "connect",
                e.to_string(),
                Some(format!(
                    "make the server reachable at {}:{} for user {} (grants, password, ssl-mode)",
                    dsn.host, dsn.port, dsn.user
                )),
            ));
            return out;
        }
    };
    let checked = if poll {
        check_poll(&mut conn, table, &mut out).await
    } else {
        check_server(&mut conn, name, table, &mut out).await
    };
    if let Err(e) = checked {
        out.push(line(Level::Fail, "query", e.to_string(), None));
    }
    let _ = conn.disconnect().await;
    out
}

/// Poll mode needs no binlog: the table with its status and published_at columns, the
/// `(status, created_at)` index the claim scans, and the grants to claim and mark rows.
async fn check_poll(
    conn: &mut Conn,
    table: &OutboxTable,
    out: &mut Vec<CheckLine>,
) -> Result<(), Error> {
    let s = admin::settings(conn).await?;
    out.push(line(Level::Ok, "server", s.version.clone(), None));
    if !check_table(conn, table, out).await? {
        return Ok(());
    }
    let status = table.columns.get(Column::Status);
    let created = table.columns.get(Column::CreatedAt);
    let infos = snapshot::table_columns(conn, table).await?;
    let missing: Vec<&str> = [status, table.columns.get(Column::PublishedAt)]
        .into_iter()
        .filter(|c| !infos.iter().any(|i| i.name.eq_ignore_ascii_case(c)))
        .collect();
    if !missing.is_empty() {
        out.push(line(
            Level::Fail,
            "status column",
            format!("{} has no {}", table.quoted(), missing.join(", ")),
            Some(super::poll::status_fix(table)),
        ));
        return Ok(());
    }
    out.push(line(
        Level::Ok,
        "status column",
        format!("{status} and {}", table.columns.get(Column::PublishedAt)),
        None,
    ));
    // An index that starts with (status, created_at): the claim reads pending rows in order
    // from it instead of scanning (and locking its way through) the table.
    let idx: Vec<(String, u64, String)> = conn
        .exec(
            "SELECT INDEX_NAME, SEQ_IN_INDEX, COLUMN_NAME FROM information_schema.STATISTICS
              WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? AND SEQ_IN_INDEX <= 2
              ORDER BY INDEX_NAME, SEQ_IN_INDEX",
            (&table.database, &table.table),
        )
        .await?;
    let found = idx.iter().find_map(|(name, seq, col)| {
        (*seq == 1
            && col.eq_ignore_ascii_case(status)
            && idx
                .iter()
                .any(|(n, s, c)| n == name && *s == 2 && c.eq_ignore_ascii_case(created)))
        .then(|| name.clone())
    });
    out.push(match found {
        Some(name) => line(
            Level::Ok,
            "dispatch index",
            format!("{name} ({status}, {created})"),
            None,
        ),
        None => line(
            Level::Fail,
            "dispatch index",
            format!("no index on ({status}, {created}): every poll scans the table"),
            Some(format!(
                "ALTER TABLE {} ADD KEY idx_dispatch ({}, {});",
                table.quoted(),
                my_ident(status),
                my_ident(created)
            )),
        ),
    });
    // The grants, by trying the statements themselves in a transaction that changes nothing.
    let tried = async {
        conn.query_drop("START TRANSACTION").await?;
        conn.query_drop(format!(
            "SELECT {} FROM {} WHERE {} = 'pending' ORDER BY {} LIMIT 1 FOR UPDATE SKIP LOCKED",
            my_ident(table.columns.get(Column::Id)),
            table.quoted(),
            my_ident(status),
            my_ident(created)
        ))
        .await?;
        conn.query_drop(format!(
            "UPDATE {} SET {} = 'published' WHERE 1 = 0",
            table.quoted(),
            my_ident(status)
        ))
        .await
    }
    .await;
    let _ = conn.query_drop("ROLLBACK").await;
    out.push(match tried {
        Ok(()) => line(
            Level::Ok,
            "grants",
            "SELECT … FOR UPDATE SKIP LOCKED and UPDATE on the table allowed",
            None,
        ),
        Err(e) if matches!(super::server_code(&e), Some(1142 | 1143 | 1044)) => line(
            Level::Fail,
            "grants",
            e.to_string(),
            Some(format!(
                "GRANT SELECT, UPDATE ON {} TO '<user>'@'<host>';",
                table.quoted()
            )),
        ),
        Err(e) if super::server_code(&e) == Some(1064) => line(
            Level::Fail,
            "skip locked",
            format!(
                "{}: the server does not understand FOR UPDATE SKIP LOCKED",
                s.version
            ),
            Some("poll mode needs MariaDB 10.6+ or MySQL 8.0+".into()),
        ),
        Err(e) => return Err(e.into()),
    });
    Ok(())
}

/// The outbox table mapped exactly as the stream maps it; false when it cannot be.
async fn check_table(
    conn: &mut Conn,
    table: &OutboxTable,
    out: &mut Vec<CheckLine>,
) -> Result<bool, Error> {
    let infos = snapshot::table_columns(conn, table).await?;
    if infos.is_empty() {
        let account = crate::state::mysql::current_account(conn).await?;
        out.push(line(
            Level::Fail,
            "outbox table",
            format!(
                "{} does not exist, or user {account} has no privilege on it",
                table.quoted()
            ),
            Some(admin::not_visible_fix(table).replace("the relay's user", &account)),
        ));
        return Ok(false);
    }
    match table.map_columns(&infos) {
        Ok(_) => out.push(line(
            Level::Ok,
            "outbox table",
            format!(
                "{} ({} columns, mapped by name)",
                table.quoted(),
                infos.len()
            ),
            None,
        )),
        Err(Error::Config { problem, fix }) => {
            out.push(line(Level::Fail, "outbox table", problem, Some(fix)));
            return Ok(false);
        }
        Err(e) => return Err(e),
    }
    Ok(true)
}

async fn check_server(
    conn: &mut Conn,
    name: &str,
    table: &OutboxTable,
    out: &mut Vec<CheckLine>,
) -> Result<(), Error> {
    let s = admin::settings(conn).await?;
    out.push(line(Level::Ok, "server", s.version.clone(), None));
    let problems = admin::problems(&s);
    for (key, ok_detail) in [
        ("binary log", "log_bin = ON".to_string()),
        ("server_id", format!("server_id = {}", s.server_id)),
        ("binlog_format", "ROW".to_string()),
        ("binlog_row_image", "FULL".to_string()),
        ("binlog_row_metadata", "FULL".to_string()),
    ] {
        let needle = match key {
            "binary log" => "binary log is off",
            "server_id" => "server_id is 0",
            other => other,
        };
        match problems.iter().find(|(what, _)| what.contains(needle)) {
            Some((what, fix)) => out.push(line(Level::Fail, key, what.clone(), Some(fix.clone()))),
            None => out.push(line(Level::Ok, key, ok_detail, None)),
        }
    }
    out.push(match s.expire_seconds {
        0 => line(
            Level::Ok,
            "binlog retention",
            "kept until purged by hand",
            None,
        ),
        n if n < 86400 => line(
            Level::Warn,
            "binlog retention",
            format!("{n} s: a relay stopped longer than that loses its position"),
            Some("SET GLOBAL binlog_expire_logs_seconds = 604800; (and in the option file)".into()),
        ),
        n => line(
            Level::Ok,
            "binlog retention",
            format!("{} days", n / 86400),
            None,
        ),
    });

    // Grants: what SHOW GRANTS says for the current user.
    let grants: Vec<String> = conn.query("SHOW GRANTS").await?;
    let all = grants.join(" ").to_ascii_uppercase();
    let has = |p: &str| all.contains("ALL PRIVILEGES ON *.*") || all.contains(p);
    let mut missing = Vec::new();
    if !has("REPLICATION SLAVE") && !has("REPLICATION REPLICA") {
        missing.push("REPLICATION SLAVE");
    }
    if !has("REPLICATION CLIENT") && !has("BINLOG MONITOR") {
        missing.push(if s.mariadb {
            "BINLOG MONITOR"
        } else {
            "REPLICATION CLIENT"
        });
    }
    let account = crate::state::mysql::current_account(conn).await?;
    out.push(if missing.is_empty() {
        line(
            Level::Ok,
            "grants",
            "replication and binlog status allowed",
            None,
        )
    } else {
        line(
            Level::Fail,
            "grants",
            format!("user {account} lacks {}", missing.join(", ")),
            Some(format!(
                "GRANT {} ON *.* TO {account};  (as an administrator)",
                missing.join(", ")
            )),
        )
    });

    // The table and its columns, mapped exactly as the stream maps them.
    if check_table(conn, table, out).await? {
        check_select(conn, table, &account, out).await?;
    }
    if !check_state_table(conn, &account, out).await? {
        return check_xa(conn, out).await;
    }

    // The relay's state and whether its position can still be read.
    match crate::state::mysql::load(conn, name).await? {
        None => out.push(line(
            Level::Ok,
            "state",
            format!("no state for {name:?} yet: the first start takes a snapshot (--snapshot)"),
            None,
        )),
        Some(row) => match &row.position {
            Some(cp @ Checkpoint::Binlog { file, pos, .. }) if row.initialized => {
                let resume = super::Resume::from_checkpoint(cp).expect("a binlog checkpoint");
                let mariadb = s.mariadb;
                let server = admin::server_log(conn, &resume, mariadb).await?;
                let server_gtid = match &server.gtid_binlog_state {
                    Some(list) => {
                        crate::source::mysql::gtid::GtidState::from_list(list).to_string()
                    }
                    None => {
                        admin::head_status(conn, Some(s.flavour))
                            .await?
                            .gtid_executed
                    }
                };
                let gtids = format!(
                    "stored GTID state {}, the server's {}",
                    match resume.checkpoint() {
                        Checkpoint::Binlog {
                            gtid_state: Some(g),
                            ..
                        } => g,
                        _ => "-".into(),
                    },
                    if server_gtid.is_empty() {
                        "-".to_string()
                    } else {
                        server_gtid
                    }
                );
                match admin::position_verdict(name, &resume, mariadb, false, &server) {
                    admin::Verdict::Streams => out.push(line(
                        Level::Ok,
                        "stored position",
                        format!("{file}:{pos} ({gtids})"),
                        None,
                    )),
                    admin::Verdict::ByGtid(why) => out.push(line(
                        Level::Ok,
                        "stored position",
                        format!("{file}:{pos} is not this server's binlog position, but it resumes by GTID ({gtids}): {why}"),
                        None,
                    )),
                    admin::Verdict::Lost(lost) => {
                        let Error::PositionLost { problem, fix } = lost.into_error(name) else {
                            unreachable!("a lost position")
                        };
                        out.push(line(
                            Level::Fail,
                            "stored position",
                            format!("{problem} ({gtids})"),
                            Some(fix),
                        ));
                    }
                }
            }
            _ => out.push(line(
                Level::Ok,
                "state",
                format!("{name:?} has not finished its first start"),
                None,
            )),
        },
    }

    check_xa(conn, out).await
}

/// Whether the user may read the outbox table's rows (the snapshot of a first start, a
/// replay): the catalog shows a table on any privilege, a column-level one included.
async fn check_select(
    conn: &mut Conn,
    table: &OutboxTable,
    account: &str,
    out: &mut Vec<CheckLine>,
) -> Result<(), Error> {
    match conn
        .query_drop(format!("SELECT 1 FROM {} WHERE FALSE", table.quoted()))
        .await
    {
        Ok(()) => {}
        Err(e) if matches!(super::server_code(&e), Some(1142 | 1143 | 1044)) => out.push(line(
            Level::Fail,
            "table privilege",
            format!("user {account} cannot SELECT {}", table.quoted()),
            Some(format!("GRANT SELECT ON {} TO {account};", table.quoted())),
        )),
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

/// `outboxd_state`: there and complete, and the user may read and write it (each missing
/// privilege with its `GRANT`). Returns whether the state row can be read.
async fn check_state_table(
    conn: &mut Conn,
    account: &str,
    out: &mut Vec<CheckLine>,
) -> Result<bool, Error> {
    let db: Option<Option<String>> = conn.query_first("SELECT DATABASE()").await?;
    let table = format!(
        "`{}`.outboxd_state",
        db.flatten().unwrap_or_default().replace('`', "``")
    );
    let gap = crate::state::mysql::gap(conn).await?;
    if let Some(crate::state::Gap::Columns(missing)) = &gap {
        out.push(line(
            Level::Warn,
            "state table",
            format!(
                "outboxd_state lacks the columns {} of this version (the next start adds them if user {account} has ALTER on it)",
                missing.join(", ")
            ),
            Some("outboxd setup  (as the setup user, docs/operations.md \"Grants\")".into()),
        ));
    }
    if gap == Some(crate::state::Gap::Table) {
        out.push(line(
            Level::Warn,
            "state table",
            format!("outboxd_state does not exist, or user {account} has no privilege on it (`outboxd setup` creates it; so does the first run of a user with CREATE on it)"),
            Some(format!("outboxd setup  (as the setup user, docs/operations.md \"Grants\"); then GRANT SELECT, INSERT, UPDATE ON {table} TO {account};")),
        ));
        return Ok(false);
    }
    let missing = crate::state::mysql::missing_state_privileges(conn).await?;
    out.push(if missing.is_empty() {
        line(
            Level::Ok,
            "state table",
            format!("user {account} may read and write outboxd_state"),
            None,
        )
    } else {
        line(
            Level::Fail,
            "state table",
            format!(
                "user {account} lacks {} on outboxd_state",
                missing.join(", ")
            ),
            Some(format!(
                "GRANT {} ON {table} TO {account};",
                missing.join(", ")
            )),
        )
    });
    Ok(!missing.contains(&"SELECT"))
}

/// Prepared XA transactions: one with outbox rows left open holds a relay's stored position
/// before its prepare, and a first start after its prepare is refused.
async fn check_xa(conn: &mut Conn, out: &mut Vec<CheckLine>) -> Result<(), Error> {
    match admin::xa::recover(conn).await {
        Ok(open) if open.is_empty() => {
            out.push(line(Level::Ok, "prepared XA", "none open", None))
        }
        Ok(open) => out.push(line(
            Level::Warn,
            "prepared XA",
            format!(
                "{} open: {} (one that wrote the outbox holds a relay's stored position before its prepare until it ends; a first start after its prepare is refused)",
                open.len(),
                open.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(" ")
            ),
            Some(format!(
                "end each one its application no longer will: {}",
                open.iter()
                    .map(|x| format!("XA COMMIT {x}; or XA ROLLBACK {x};"))
                    .collect::<Vec<_>>()
                    .join(" ")
            )),
        )),
        Err(Error::Config { problem, fix }) => {
            out.push(line(Level::Fail, "prepared XA", problem, Some(fix)))
        }
        Err(e) => return Err(e),
    }
    Ok(())
}

/// `check`'s lines for `--sync-replica` (see [`super::replicas::replica_lines`]): the
/// primary's GTID position and registered replicas, and each named replica's state.
pub async fn sync_replica_lines(dsn: &DbDsn, replicas: &[DbDsn]) -> Vec<CheckLine> {
    let read = async {
        let mut conn = connect_sql(dsn).await?;
        let s = admin::settings(&mut conn).await?;
        let primary_gtid = if s.mariadb {
            let g: Option<Option<String>> = conn.query_first("SELECT @@gtid_binlog_pos").await?;
            g.flatten().unwrap_or_default()
        } else {
            admin::head_status(&mut conn, Some(s.flavour))
                .await?
                .gtid_executed
        };
        let connected = super::replicas::registered_replicas(&mut conn).await;
        let _ = conn.disconnect().await;
        let mut states = Vec::new();
        for r in replicas {
            states.push(super::replicas::replica_state(r, s.mariadb).await);
        }
        Ok::<_, Error>(super::replicas::replica_lines(
            &states,
            connected,
            &primary_gtid,
        ))
    };
    match read.await {
        Ok(lines) => lines,
        Err(e) => vec![line(Level::Fail, "sync replicas", e.to_string(), None)],
    }
}

/// What `status` shows for a MySQL source.
#[derive(Debug, Clone, Serialize)]
pub struct MyStatus {
    pub name: String,
    pub stored_position: Option<String>,
    pub stored_gtid: Option<String>,
    pub server_head: String,
    pub(crate) server_gtid: Option<String>,
    /// Binlog bytes between the stored position and the head (every file in between counted).
    pub lag_bytes: Option<u64>,
    /// Binlog files the stored position still needs.
    pub(crate) retained_files: Option<usize>,
    pub streaming: bool,
    pub lease_holder: Option<String>,
    pub lease_live: bool,
    pub epoch: Option<i64>,
    /// A prepared XA transaction the stored position is held before (it starts there), and
    /// when the server prepared it.
    pub(crate) xa_prepare: Option<XaHold>,
    /// What the lease holder's running snapshot or replay has got to, as it last stored it
    /// (`crate::progress::summary`).
    pub progress: Option<serde_json::Value>,
    /// How the next start resumes on this server from the stored position: as stored, by
    /// GTID at this server's coordinates (another server's position), or lost (why).
    pub resume: Option<String>,
    /// `status --sync-replica`: each named replica's GTID state.
    pub replicas: Vec<super::replicas::ReplicaState>,
}

/// A prepared XA transaction that holds a relay's stored position back.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct XaHold {
    pub xid: String,
    pub(crate) prepared_at: Option<String>,
    pub(crate) age_seconds: Option<i64>,
}

pub async fn status_mysql(dsn: &DbDsn, name: &str, replicas: &[DbDsn]) -> Result<MyStatus, Error> {
    let mut conn = connect_sql(dsn).await?;
    let s = admin::settings(&mut conn).await?;
    let (head_file, head_pos) = admin::head(&mut conn).await?;
    let server_gtid = if s.mariadb {
        let g: Option<Option<String>> = conn.query_first("SELECT @@gtid_binlog_pos").await?;
        g.flatten()
    } else {
        None
    };
    let logs: Vec<(String, u64)> = conn
        .query::<mysql_async::Row, _>("SHOW BINARY LOGS")
        .await?
        .into_iter()
        .filter_map(|r| {
            let name: String = r.get(0)?;
            let size: u64 = r.get(1)?;
            Some((name, size))
        })
        .collect();
    let row = crate::state::mysql::load(&mut conn, name).await?;
    let stored = row.as_ref().and_then(|r| r.position.clone());
    let (lag, retained) = match &stored {
        Some(Checkpoint::Binlog { file, pos, .. }) => {
            let seq = binlog_file_seq(file);
            let needed: Vec<&(String, u64)> = logs
                .iter()
                .filter(|(n, _)| binlog_file_seq(n) >= seq)
                .collect();
            let lag = if needed.first().map(|(n, _)| n.as_str()) == Some(file.as_str()) {
                Some(
                    needed
                        .iter()
                        .map(|(n, size)| {
                            if n == file {
                                size.saturating_sub(*pos)
                            } else {
                                *size
                            }
                        })
                        .sum(),
                )
            } else {
                None
            };
            (lag, Some(needed.len()))
        }
        _ => (None, None),
    };
    let streaming: Option<i64> = conn
        .exec_first(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%' AND DB = ?",
            (&dsn.database,),
        )
        .await?;
    // The relay holds its stored position at the start of a prepared XA transaction with
    // outbox rows: the one starting there, if it is still open, is what holds it.
    let mut xa_prepare = None;
    if let Some(Checkpoint::Binlog { file, pos, .. }) = &stored {
        let open = admin::xa::recover(&mut conn).await?;
        if !open.is_empty() {
            if let Some(xid) = admin::xa::starting_at(&mut conn, file, *pos, &open).await? {
                let id = super::server_id_for(&format!("{name}\u{0}status"));
                let at = admin::xa::event_time(dsn, id, file, *pos)
                    .await
                    .ok()
                    .flatten();
                xa_prepare = Some(XaHold {
                    xid: xid.to_string(),
                    prepared_at: at.map(|t| t.to_rfc3339()),
                    age_seconds: at.map(|t| (chrono::Utc::now() - t).num_seconds().max(0)),
                });
            }
        }
    }
    let progress = crate::state::mysql::load_progress(&mut conn, name)
        .await
        .and_then(|p| serde_json::from_str(&p).ok());
    let resume = match stored.as_ref().and_then(super::Resume::from_checkpoint) {
        Some(r) if row.as_ref().is_some_and(|r| r.initialized) => {
            let server = admin::server_log(&mut conn, &r, s.mariadb).await?;
            Some(match admin::position_verdict(name, &r, s.mariadb, false, &server) {
                admin::Verdict::Streams => "from the stored position".to_string(),
                admin::Verdict::ByGtid(_) => "by GTID: the stored position is not this server's, but its binlog holds the stored GTID state (the next start stores it at this server's coordinates)".to_string(),
                admin::Verdict::Lost(l) => format!("LOST: {}", l.problem),
            })
        }
        _ => None,
    };
    let _ = conn.disconnect().await;
    let mut replica_states = Vec::new();
    for r in replicas {
        replica_states.push(super::replicas::replica_state(r, s.mariadb).await);
    }
    Ok(MyStatus {
        resume,
        replicas: replica_states,
        name: name.to_string(),
        stored_position: stored.as_ref().map(|c| match c {
            Checkpoint::Binlog { file, pos, .. } => format!("{file}:{pos}"),
            other => other.to_string(),
        }),
        stored_gtid: stored.as_ref().and_then(|c| match c {
            Checkpoint::Binlog { gtid_state, .. } => gtid_state.clone(),
            _ => None,
        }),
        server_head: format!("{head_file}:{head_pos}"),
        server_gtid,
        lag_bytes: lag,
        retained_files: retained,
        streaming: streaming.unwrap_or(0) > 0,
        lease_holder: row.as_ref().and_then(|r| r.lease_holder.clone()),
        lease_live: row.as_ref().is_some_and(|r| r.lease_live),
        epoch: row.as_ref().map(|r| r.epoch),
        xa_prepare,
        progress,
    })
}

impl std::fmt::Display for MyStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let o = |v: &Option<String>| v.clone().unwrap_or_else(|| "-".into());
        writeln!(f, "relay            {}", self.name)?;
        writeln!(
            f,
            "stored position  {} (gtid {})",
            o(&self.stored_position),
            o(&self.stored_gtid)
        )?;
        writeln!(
            f,
            "server head      {} (gtid {})",
            self.server_head,
            o(&self.server_gtid)
        )?;
        writeln!(
            f,
            "lag              {} binlog bytes in {} file(s)",
            self.lag_bytes.map(|b| b.to_string()).unwrap_or("-".into()),
            self.retained_files
                .map(|n| n.to_string())
                .unwrap_or("-".into())
        )?;
        writeln!(
            f,
            "binlog dump      {}",
            if self.streaming {
                "connected"
            } else {
                "not connected"
            }
        )?;
        if let Some(r) = &self.resume {
            writeln!(f, "resumes          {r}")?;
        }
        for r in &self.replicas {
            writeln!(
                f,
                "sync replica     {} applied {}{}",
                r.at,
                o(&r.applied),
                r.problem
                    .as_ref()
                    .map(|p| format!(" ({p})"))
                    .unwrap_or_default()
            )?;
        }
        crate::diagnostics::write_lease(f, self.lease_holder.as_deref(), self.lease_live)?;
        crate::diagnostics::write_progress(f, self.progress.as_ref(), self.lease_live)?;
        if let Some(x) = &self.xa_prepare {
            write!(
                f,
                "\nxa prepare       {} prepared {} ({}s ago) holds the stored position before its XA PREPARE: every restart publishes again what was committed since; end it: XA COMMIT {0}; or XA ROLLBACK {0};",
                x.xid,
                o(&x.prepared_at),
                x.age_seconds.map(|a| a.to_string()).unwrap_or("?".into()),
            )?;
        }
        Ok(())
    }
}

/// `offset set --binlog-position FILE:POS`: where the next start resumes. The file must still
/// be on the server and the position inside it; on MariaDB the GTID state there is stored with
/// it. Refused while the relay runs, and while an XA transaction prepared before the position
/// that wrote the DSN's database is still open. Returns the stored position.
pub async fn set_position(
    dsn: &DbDsn,
    name: &str,
    at: &str,
    offset_file: Option<&std::path::Path>,
) -> Result<String, Error> {
    let fix = "write FILE:POS, e.g. mariadb-bin.000042:1234 (the end position of a transaction, as in x-source-position)";
    let (file, pos) = at
        .rsplit_once(':')
        .and_then(|(f, p)| Some((f.to_string(), p.parse::<u64>().ok()?)))
        .ok_or_else(|| Error::config(format!("--binlog-position {at:?} is not FILE:POS"), fix))?;
    let mut conn = connect_sql(dsn).await?;
    let s = admin::settings(&mut conn).await?;
    let logs: Vec<(String, u64)> = conn
        .query::<mysql_async::Row, _>("SHOW BINARY LOGS")
        .await?
        .into_iter()
        .filter_map(|r| Some((r.get::<String, _>(0)?, r.get::<u64, _>(1)?)))
        .collect();
    match logs.iter().find(|(n, _)| *n == file) {
        None => {
            return Err(Error::config(
                format!(
                    "binlog file {file:?} is not on the server (it has {})",
                    logs.iter()
                        .map(|(n, _)| n.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                fix,
            ))
        }
        Some((_, size)) if pos < 4 || pos > *size => {
            return Err(Error::config(
                format!("position {pos} is outside {file} (4 … {size})"),
                fix,
            ))
        }
        _ => {}
    }
    // An XA transaction prepared before the position and still open would have its rows
    // before it, never read by the next start. `offset set` knows no --table: one that wrote
    // any table of the DSN's database counts.
    let db_prefix = format!("{}.", dsn.database);
    let open = admin::xa::prepared_before(&mut conn, &file, pos, |t| {
        t.get(..db_prefix.len())
            .is_some_and(|p| p.eq_ignore_ascii_case(&db_prefix))
    })
    .await?;
    if !open.is_empty() {
        let _ = conn.disconnect().await;
        return Err(admin::xa::prepared_before_error(
            &format!("{file}:{pos}"),
            &open,
            true,
        ));
    }
    let gtid = if s.mariadb {
        Some(admin::gtid_at(&mut conn, &file, pos).await?.to_string())
    } else {
        None
    };
    match offset_file {
        Some(path) => {
            let cp = crate::event::Checkpoint::Binlog {
                file: file.clone(),
                pos,
                gtid_state: gtid.clone(),
            };
            crate::state::file::set_position(path, name, &cp)?
        }
        None => {
            crate::state::mysql::set_position(&mut conn, name, &file, pos, gtid.as_deref()).await?
        }
    }
    let _ = conn.disconnect().await;
    Ok(match gtid {
        Some(g) if !g.is_empty() => format!("{file}:{pos} (gtid {g})"),
        _ => format!("{file}:{pos}"),
    })
}
