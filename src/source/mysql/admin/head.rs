//! The server's binlog as it is now: its flavour, its head (file, position and MySQL's
//! executed GTID set), MariaDB's GTID state at a position, and the binlog files it still has.

use super::text;
use crate::source::mysql::gtid::GtidState;
use crate::Error;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row};

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
        Err(e) if crate::source::mysql::server_code(&e) == Some(1064) => {
            conn.query_first(second).await?
        }
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

/// MariaDB: the GTID state at a binlog position; `None` where no event starts there (the
/// server's `BINLOG_GTID_POS` is NULL for a missing file, a position past the file's end and
/// one inside an event).
pub async fn gtid_at_opt(
    conn: &mut Conn,
    file: &str,
    pos: u64,
) -> Result<Option<GtidState>, Error> {
    let s: Option<Option<String>> = conn
        .exec_first("SELECT BINLOG_GTID_POS(?, ?)", (file, pos))
        .await?;
    match s.flatten() {
        None => Ok(None),
        Some(s) => GtidState::parse(&s)
            .map(Some)
            .ok_or_else(|| Error::Decode(format!("BINLOG_GTID_POS returned {s:?}"))),
    }
}

/// MariaDB: the GTID state at a binlog position, which must be an event boundary.
pub async fn gtid_at(conn: &mut Conn, file: &str, pos: u64) -> Result<GtidState, Error> {
    gtid_at_opt(conn, file, pos).await?.ok_or_else(|| {
        Error::config(
            format!("no binlog event starts at {file}:{pos} on the server"),
            "name the end position of a transaction, as in an event's x-source-position (SHOW BINLOG EVENTS IN '<file>' lists them)",
        )
    })
}

/// A binlog file the server has, with its size in bytes (`SHOW BINARY LOGS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BinlogFile {
    pub name: String,
    pub size: u64,
}

/// The binlog files the server still has, oldest first, with their sizes.
pub async fn binlog_logs(conn: &mut Conn) -> Result<Vec<BinlogFile>, Error> {
    let rows: Vec<Row> = conn.query("SHOW BINARY LOGS").await?;
    Ok(rows
        .iter()
        .map(|r| BinlogFile {
            name: text(r, 0),
            size: text(r, 1).parse().unwrap_or(0),
        })
        .collect())
}

/// The binlog files the server still has, oldest first.
pub async fn binlog_files(conn: &mut Conn) -> Result<Vec<String>, Error> {
    Ok(binlog_logs(conn)
        .await?
        .into_iter()
        .map(|f| f.name)
        .collect())
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
