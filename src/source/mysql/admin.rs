//! What the MySQL/MariaDB source needs from the server before it streams, each check with the
//! exact fix: the binary log on, in ROW format with FULL row image and FULL row metadata
//! (column names in table maps), the outbox table with mappable columns; and the server's
//! current position, its binlog files and GTID state.

use super::gtid::GtidState;
use super::rows::OutboxTable;
use crate::Error;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row};

/// The server's binlog settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinlogSettings {
    pub version: String,
    pub flavour: Flavour,
    pub mariadb: bool,
    pub log_bin: bool,
    pub format: String,
    pub row_image: String,
    /// `None` when the server has no `binlog_row_metadata` (MariaDB < 10.5, MySQL < 8.0.1).
    pub row_metadata: Option<String>,
    pub server_id: u64,
    /// Binlog retention in seconds (0 = kept forever).
    pub expire_seconds: u64,
}

fn text(row: &Row, i: usize) -> String {
    match row.as_ref(i) {
        Some(mysql_async::Value::Bytes(b)) => String::from_utf8_lossy(b).into_owned(),
        Some(mysql_async::Value::Int(n)) => n.to_string(),
        Some(mysql_async::Value::UInt(n)) => n.to_string(),
        _ => String::new(),
    }
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
pub fn problems(s: &BinlogSettings) -> Vec<(String, String)> {
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
            format!("the outbox table {} does not exist", table.quoted()),
            format!(
                "create it (migrations/mysql/001_outbox.sql) in database {:?}, or name it with --table",
                table.database
            ),
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
    Ok(())
}

/// The server flavour, detected from `VERSION()` at connect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavour {
    MariaDb { major: u32, minor: u32 },
    MySql { major: u32, minor: u32 },
}

impl Flavour {
    /// `10.11.6-MariaDB-0+deb12u1`, `5.5.5-10.11.6-MariaDB` (the replication-compatible
    /// prefix MariaDB shows old clients), `8.4.3`, `8.0.36-0ubuntu0.22.04.1`.
    pub fn detect(version: &str) -> Flavour {
        let v = if version.to_ascii_lowercase().contains("mariadb") {
            version.strip_prefix("5.5.5-").unwrap_or(version)
        } else {
            version
        };
        let mut nums = v
            .split(|c: char| !c.is_ascii_digit())
            .map(|n| n.parse::<u32>().unwrap_or(0));
        let major = nums.next().unwrap_or(0);
        let minor = nums.next().unwrap_or(0);
        if version.to_ascii_lowercase().contains("mariadb") {
            Flavour::MariaDb { major, minor }
        } else {
            Flavour::MySql { major, minor }
        }
    }

    pub fn is_mariadb(&self) -> bool {
        matches!(self, Flavour::MariaDb { .. })
    }

    /// The statement that shows the binlog head: MySQL 8.2 renamed `SHOW MASTER STATUS` to
    /// `SHOW BINARY LOG STATUS` and 8.4 removed the old name.
    pub fn head_statements(&self) -> [&'static str; 2] {
        match *self {
            Flavour::MySql { major, minor } if (major, minor) >= (8, 2) => {
                ["SHOW BINARY LOG STATUS", "SHOW MASTER STATUS"]
            }
            _ => ["SHOW MASTER STATUS", "SHOW BINARY LOG STATUS"],
        }
    }
}

/// The server's binlog head: file, position and (MySQL with GTIDs) the executed GTID set.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    pub file: String,
    pub pos: u64,
    /// MySQL's `Executed_Gtid_Set` (the fifth column); empty on MariaDB and without GTIDs.
    pub gtid_executed: String,
}

impl Head {
    /// From the columns of `SHOW MASTER STATUS` / `SHOW BINARY LOG STATUS`: File, Position,
    /// Binlog_Do_DB, Binlog_Ignore_DB and (MySQL) Executed_Gtid_Set.
    pub fn from_status_columns(cols: &[String]) -> Option<Head> {
        Some(Head {
            file: cols.first().filter(|f| !f.is_empty())?.clone(),
            pos: cols.get(1)?.parse().ok()?,
            gtid_executed: cols.get(4).cloned().unwrap_or_default(),
        })
    }

    /// From `performance_schema.log_status`'s `LOCAL` column (MySQL 8.0.17+), which the
    /// server fills while it blocks commits, so position and GTID set belong together:
    /// `{"gtid_executed": "…", "binary_log_file": "…", "binary_log_position": N}`.
    pub fn from_log_status(local: &str) -> Option<Head> {
        let v: serde_json::Value = serde_json::from_str(local).ok()?;
        Some(Head {
            file: v
                .get("binary_log_file")?
                .as_str()
                .filter(|f| !f.is_empty())?
                .to_string(),
            pos: v.get("binary_log_position")?.as_u64()?,
            gtid_executed: v
                .get("gtid_executed")
                .and_then(|g| g.as_str())
                .unwrap_or("")
                .to_string(),
        })
    }
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
    let ddl = include_str!("../../../migrations/mysql/001_outbox.sql").replace(
        "IF NOT EXISTS outbox ",
        &format!("IF NOT EXISTS {} ", table.quoted()),
    );
    conn.query_drop(ddl).await?;
    Ok(true)
}

/// The server's current binlog position (the end of the last event written).
pub async fn head(conn: &mut Conn) -> Result<(String, u64), Error> {
    let h = head_status(conn, None).await?;
    Ok((h.file, h.pos))
}

/// The server's binlog head with the flavour's statement first and the other one as the
/// fallback (a syntax error, 1064, means this server does not know that name).
pub async fn head_status(conn: &mut Conn, flavour: Option<Flavour>) -> Result<Head, Error> {
    let [first, second] = flavour
        .unwrap_or(Flavour::MariaDb { major: 0, minor: 0 })
        .head_statements();
    let row: Option<Row> = match conn.query_first(first).await {
        Ok(r) => r,
        Err(e) if super::server_code(&e) == Some(1064) => conn.query_first(second).await?,
        Err(e) => return Err(e.into()),
    };
    let cols: Vec<String> = row
        .map(|r| (0..r.len()).map(|i| text(&r, i)).collect())
        .unwrap_or_default();
    Head::from_status_columns(&cols).ok_or_else(|| {
        Error::config(
            format!(
                "the server reports no binlog position ({first} is empty): the binary log is off"
            ),
            "put log_bin=mysql-bin and server_id=1 in the server's option file, then restart it",
        )
    })
}

/// MySQL: the head from `performance_schema.log_status` (position and GTID set taken
/// together); `None` where it cannot be read (MariaDB, MySQL < 8.0.17, no BACKUP_ADMIN).
pub async fn log_status(conn: &mut Conn) -> Option<Head> {
    let local: Option<String> = conn
        .query_first("SELECT CAST(LOCAL AS CHAR) FROM performance_schema.log_status")
        .await
        .ok()
        .flatten();
    local.as_deref().and_then(Head::from_log_status)
}

/// MariaDB: the GTID state at a binlog position.
pub async fn gtid_at(conn: &mut Conn, file: &str, pos: u64) -> Result<GtidState, Error> {
    let s: Option<Option<String>> = conn
        .exec_first("SELECT BINLOG_GTID_POS(?, ?)", (file, pos))
        .await?;
    let s = s.flatten().unwrap_or_default();
    GtidState::parse(&s).ok_or_else(|| Error::Decode(format!("BINLOG_GTID_POS returned {s:?}")))
}

/// The binlog files the server still has, oldest first.
pub async fn binlog_files(conn: &mut Conn) -> Result<Vec<String>, Error> {
    let rows: Vec<Row> = conn.query("SHOW BINARY LOGS").await?;
    Ok(rows.iter().map(|r| text(r, 0)).collect())
}

pub fn lost_position_fix(name: &str) -> String {
    format!(
        "the binlog events after the stored position were purged, so the events in them may never be published. \
         Recover through the table: run with --on-position-lost poll (it streams from the current position and publishes again every row created since the last confirmed commit, minus a margin; expect duplicates), \
         or publish what was lost by hand (`outboxd run --snapshot since=<time of the last delivered event>` after a teardown), \
         or accept the gap: `outboxd teardown --name {name} --yes`, then start again; and keep binlogs longer than the longest relay outage \
         (SET GLOBAL binlog_expire_logs_seconds = 604800)"
    )
}

/// Checks that a stored position can still be read: its file must still exist.
pub async fn require_position(conn: &mut Conn, name: &str, file: &str) -> Result<(), Error> {
    let files = binlog_files(conn).await?;
    if !files.iter().any(|f| f == file) {
        return Err(Error::PositionLost {
            problem: format!(
                "binlog file {file:?} of relay {name:?}'s stored position was purged (the server has {})",
                match (files.first(), files.last()) {
                    (Some(a), Some(b)) => format!("{a} … {b}"),
                    _ => "no binlog files".into(),
                }
            ),
            fix: lost_position_fix(name),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flavours_heads_and_log_status_parse() {
        use Flavour::*;
        assert_eq!(
            Flavour::detect("10.11.6-MariaDB-0+deb12u1"),
            MariaDb {
                major: 10,
                minor: 11
            }
        );
        assert_eq!(
            Flavour::detect("5.5.5-10.6.16-MariaDB"),
            MariaDb {
                major: 10,
                minor: 6
            }
        );
        assert_eq!(
            Flavour::detect("8.0.36-0ubuntu0.22.04.1"),
            MySql { major: 8, minor: 0 }
        );
        assert_eq!(Flavour::detect("8.4.3"), MySql { major: 8, minor: 4 });
        assert_eq!(
            MySql { major: 8, minor: 4 }.head_statements()[0],
            "SHOW BINARY LOG STATUS"
        );
        assert_eq!(
            MySql { major: 8, minor: 0 }.head_statements()[0],
            "SHOW MASTER STATUS"
        );
        assert_eq!(
            MariaDb {
                major: 11,
                minor: 4
            }
            .head_statements()[0],
            "SHOW MASTER STATUS"
        );

        let cols = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        let h = Head::from_status_columns(&cols(&[
            "binlog.000007",
            "1234",
            "",
            "",
            "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-77",
        ]))
        .unwrap();
        assert_eq!((h.file.as_str(), h.pos), ("binlog.000007", 1234));
        assert_eq!(h.gtid_executed, "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-77");
        let maria =
            Head::from_status_columns(&cols(&["mariadb-bin.000002", "42", "", ""])).unwrap();
        assert_eq!(maria.gtid_executed, "");
        assert!(Head::from_status_columns(&cols(&[])).is_none());
        assert!(Head::from_status_columns(&cols(&["f", "x"])).is_none());

        let local = r#"{"gtid_executed": "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5", "binary_log_file": "binlog.000003", "binary_log_position": 2913}"#;
        let h = Head::from_log_status(local).unwrap();
        assert_eq!((h.file.as_str(), h.pos), ("binlog.000003", 2913));
        assert_eq!(h.gtid_executed, "3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5");
        assert!(Head::from_log_status(r#"{"gtid_executed": ""}"#).is_none());
        assert!(Head::from_log_status("not json").is_none());
    }
}
