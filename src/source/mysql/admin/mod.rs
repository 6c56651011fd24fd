//! What the MySQL/MariaDB source needs from the server before it streams, each check with the
//! exact fix: the binary log on, in ROW format with FULL row image and FULL row metadata
//! (column names in table maps), the outbox table with mappable columns; and the server's
//! current position, its binlog files and GTID state.
//!
//! The settings and the outbox table are checked here; the server's head, binlog files and
//! GTID state are read in `head`, and whether a stored position can still be streamed from is
//! decided in `position`.

use super::rows::OutboxTable;
use crate::Error;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row};

mod head;
mod position;
pub(crate) mod relocate;
pub(crate) mod xa;

pub use head::{
    binlog_files, binlog_logs, gtid_at, gtid_at_opt, head, head_status, log_status, BinlogFile,
    Flavour, Head,
};
pub use position::{
    lost_marker, lost_position_fix, position_problem, position_verdict, replaced_binlog_fix,
    require_position, server_log, AtPosition, Lost, ServerLog, Verdict,
};

/// The server's binlog settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinlogSettings {
    pub version: String,
    pub(crate) flavour: Flavour,
    pub mariadb: bool,
    pub log_bin: bool,
    pub format: String,
    pub row_image: String,
    /// `None` when the server has no `binlog_row_metadata` (MariaDB < 10.5, MySQL < 8.0.1).
    pub(crate) row_metadata: Option<String>,
    pub server_id: u64,
    /// Binlog retention in seconds (0 = kept forever).
    pub(crate) expire_seconds: u64,
}

/// Column `i` of a row as text (empty for NULL).
pub(crate) fn text_of(row: &Row, i: usize) -> String {
    text(row, i)
}

fn text(row: &Row, i: usize) -> String {
    match row.as_ref(i) {
        Some(mysql_async::Value::Bytes(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(mysql_async::Value::Int(n)) => n.to_string(),
        Some(mysql_async::Value::UInt(n)) => n.to_string(),
        _ => String::new(),
    }
}

/// The optimizer's estimate of the rows `SELECT … FROM table {filter}` reads (`EXPLAIN`: the
/// table's statistics, no scan): a snapshot's or replay's total, said as an estimate. `None`
/// when the server cannot say: an estimate never stops a snapshot.
pub async fn estimate_rows(
    conn: &mut Conn,
    table: &OutboxTable,
    filter: &str,
    params: Vec<mysql_async::Value>,
) -> Option<u64> {
    let sql = format!("EXPLAIN SELECT 1 FROM {} {filter}", table.quoted());
    let rows: Vec<Row> = conn.exec(sql, params).await.ok()?;
    rows.first()?.get_opt::<Option<u64>, _>("rows")?.ok()?
}

pub async fn settings(conn: &mut Conn) -> Result<BinlogSettings, Error> {
    let row: Row = conn
        .query_first(
            "SELECT VERSION(), @@log_bin, @@binlog_format, @@binlog_row_image, @@server_id",
        )
        .await?
        .ok_or_else(|| Error::Decode("SELECT VERSION() returned no row".into()))?;
    let version = text(&row, 0);
    let row_metadata = match conn
        .query_first::<Row, _>("SELECT @@binlog_row_metadata")
        .await
    {
        Ok(r) => r.map(|r| text(&r, 0)),
        // Unknown system variable: the server predates the setting.
        Err(e) if super::server_code(&e) == Some(1193) => None,
        Err(e) => return Err(e.into()),
    };
    let expire_seconds = match conn
        .query_first::<Row, _>("SELECT @@binlog_expire_logs_seconds")
        .await
    {
        Ok(r) => r
            .map(|r| text(&r, 0).parse::<f64>().unwrap_or(0.0) as u64)
            .unwrap_or(0),
        Err(e) if super::server_code(&e) == Some(1193) => {
            let days: Option<Row> = conn.query_first("SELECT @@expire_logs_days").await?;
            days.map(|r| (text(&r, 0).parse::<f64>().unwrap_or(0.0) * 86400.0) as u64)
                .unwrap_or(0)
        }
        Err(e) => return Err(e.into()),
    };
    let flavour = Flavour::detect(&version);
    tracing::debug!(?flavour, %version, "server flavour");
    Ok(BinlogSettings {
        flavour,
        mariadb: flavour.is_mariadb(),
        version,
        log_bin: text(&row, 1) == "1",
        format: text(&row, 2).to_ascii_uppercase(),
        row_image: text(&row, 3).to_ascii_uppercase(),
        row_metadata: row_metadata.map(|s| s.to_ascii_uppercase()),
        server_id: text(&row, 4).parse().unwrap_or(0),
        expire_seconds,
    })
}

fn section(s: &BinlogSettings) -> &'static str {
    if s.mariadb {
        "[mariadbd]"
    } else {
        "[mysqld]"
    }
}

/// Every binlog setting CDC needs, each failure with its fix.
pub(crate) fn problems(s: &BinlogSettings) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let sec = section(s);
    if !s.log_bin {
        out.push((
            "the binary log is off (log_bin = 0)".to_string(),
            format!("put log_bin=mysql-bin, server_id=1, binlog_format=ROW, binlog_row_image=FULL and binlog_row_metadata=FULL under {sec} in the server's option file, then restart the server"),
        ));
    }
    if s.server_id == 0 {
        out.push((
            "server_id is 0: the server cannot serve binlog clients".to_string(),
            format!("SET GLOBAL server_id = 1; and server_id=1 under {sec}"),
        ));
    }
    if s.format != "ROW" {
        out.push((
            format!("binlog_format is {}: INSERTs may be logged as statements, whose rows the relay cannot see", s.format),
            format!("SET GLOBAL binlog_format = ROW; and binlog_format=ROW under {sec} (sessions that set their own format must stop doing so)"),
        ));
    }
    if s.row_image != "FULL" {
        out.push((
            format!(
                "binlog_row_image is {}: an insert may lack mapped columns",
                s.row_image
            ),
            format!("SET GLOBAL binlog_row_image = FULL; and binlog_row_image=FULL under {sec}"),
        ));
    }
    match s.row_metadata.as_deref() {
        Some("FULL") => {}
        Some(other) => out.push((
            format!("binlog_row_metadata is {other}: table maps carry no column names, so columns cannot be mapped by name"),
            format!("SET GLOBAL binlog_row_metadata = FULL; and binlog_row_metadata=FULL under {sec}"),
        )),
        None => out.push((
            format!("server {} has no binlog_row_metadata setting: table maps carry no column names", s.version),
            "upgrade to MariaDB 10.5+ or MySQL 8.0+ and set binlog_row_metadata=FULL".to_string(),
        )),
    }
    out
}

/// Fails with the first problem's fix (all of them listed).
pub async fn require_binlog(conn: &mut Conn) -> Result<BinlogSettings, Error> {
    let s = settings(conn).await?;
    let p = problems(&s);
    if !p.is_empty() {
        return Err(Error::config(
            p.iter()
                .map(|(what, _)| what.as_str())
                .collect::<Vec<_>>()
                .join("; "),
            p.iter()
                .map(|(_, fix)| fix.as_str())
                .collect::<Vec<_>>()
                .join("\n  fix: "),
        ));
    }
    if s.expire_seconds > 0 && s.expire_seconds < 86400 {
        tracing::warn!(
            retention_seconds = s.expire_seconds,
            "binlogs are purged after less than a day: a relay stopped longer than that loses its position (SET GLOBAL binlog_expire_logs_seconds = 604800)"
        );
    }
    Ok(s)
}

/// Fails with the fix when the outbox table does not exist or a required column is missing.
pub async fn require_table(conn: &mut Conn, table: &OutboxTable) -> Result<(), Error> {
    let cols: Vec<(String, String)> = conn
        .exec(
            "SELECT COLUMN_NAME, DATA_TYPE FROM information_schema.COLUMNS
              WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ? ORDER BY ORDINAL_POSITION",
            (&table.database, &table.table),
        )
        .await?;
    if cols.is_empty() {
        return Err(Error::config(
            format!(
                "the outbox table {} does not exist, or this user has no privilege on it",
                table.quoted()
            ),
            not_visible_fix(table),
        ));
    }
    for logical in crate::outbox::REQUIRED {
        let actual = table.columns.get(logical);
        if !cols.iter().any(|(n, _)| n.eq_ignore_ascii_case(actual)) {
            return Err(Error::config(
                format!(
                    "the outbox table {} has no column {actual:?} (the {logical} column)",
                    table.quoted()
                ),
                format!(
                    "ALTER TABLE {} ADD COLUMN {actual} ... (see migrations/mysql/001_outbox.sql), or map it with --column {logical}=<column>",
                    table.quoted()
                ),
            ));
        }
    }
    // Mapped as the stream maps a table map: types, and the columns a template, `--header` or
    // `--envelope-field` names, checked at start rather than at the first row.
    let infos = crate::source::mysql::snapshot::table_columns(conn, table).await?;
    table.map_columns(&infos)?;
    Ok(())
}

/// The fix for an outbox table the catalog does not show: MySQL hides a table from a user
/// without any privilege on it, so "missing" may mean "not granted".
pub(crate) fn not_visible_fix(table: &OutboxTable) -> String {
    format!(
        "create it (migrations/mysql/001_outbox.sql) in database {:?}, or name it with --table; if it exists: GRANT SELECT ON {} TO the relay's user",
        table.database,
        table.quoted()
    )
}

/// Creates the reference outbox table (migrations/mysql/001_outbox.sql) under the table's name
/// when it does not exist; says whether it did.
pub async fn create_outbox_table(conn: &mut Conn, table: &OutboxTable) -> Result<bool, Error> {
    let n: Option<i64> = conn
        .exec_first(
            "SELECT COUNT(*) FROM information_schema.TABLES WHERE TABLE_SCHEMA = ? AND TABLE_NAME = ?",
            (&table.database, &table.table),
        )
        .await?;
    if n.unwrap_or(0) > 0 {
        return Ok(false);
    }
    let ddl = include_str!("../../../../migrations/mysql/001_outbox.sql").replace(
        "IF NOT EXISTS outbox ",
        &format!("IF NOT EXISTS {} ", table.quoted()),
    );
    conn.query_drop(ddl).await?;
    Ok(true)
}
