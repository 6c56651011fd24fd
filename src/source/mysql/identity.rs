//! Which binlog a MySQL/MariaDB relay reads, for the event identity every deduplicating sink
//! compares (`crate::identity`): the server (`mysql:<server_uuid>`; MariaDB has no server
//! UUID, so `mariadb:<server_id>`, which replication makes unique among the servers of one
//! topology), its binlog head when the relay starts, and the GTIDs it holds — the test that
//! tells a promoted replica (it holds the former primary's transactions) from an unrelated
//! server.

use super::admin;
use super::gtid::{Gtid, GtidState, MysqlGtidSet};
use crate::event::SourcePosition;
use crate::identity::SourceIdentity;
use crate::Error;
use mysql_async::prelude::Queryable;
use mysql_async::Conn;
use std::sync::Arc;

/// The identity of the server `conn` is connected to, or unknown when it would not say (logged:
/// that costs duplicates a deduplicating sink would have recognised, never events).
pub(crate) async fn identity_or_unknown(conn: &mut Conn, mariadb: bool) -> Option<SourceIdentity> {
    match source_identity(conn, mariadb).await {
        Ok(id) => Some(id),
        Err(e) => {
            tracing::warn!(error = %e, "could not read the source's identity: records a deduplicating sink reads back are matched without it");
            None
        }
    }
}

/// The identity of the server `conn` is connected to.
pub(crate) async fn source_identity(
    conn: &mut Conn,
    mariadb: bool,
) -> Result<SourceIdentity, Error> {
    // No head without a binary log (poll mode needs none): the head check is then not made.
    let head = admin::head(conn)
        .await
        .ok()
        .map(|(file, pos)| SourcePosition::Binlog {
            file,
            end_pos: pos,
            // Every event of the transaction that ends at the head is at or before it.
            index: u32::MAX,
        });
    if mariadb {
        let (server_id, binlog_state, current): (u64, String, String) = conn
            .query_first("SELECT @@server_id, @@gtid_binlog_state, @@gtid_current_pos")
            .await?
            .unwrap_or_default();
        let held = MariaHistory::parse(&binlog_state, &current);
        Ok(SourceIdentity {
            id: format!("mariadb:{server_id}"),
            head,
            gtids: Some(Arc::new(move |g: &str| held.holds(g))),
        })
    } else {
        let (uuid, executed): (String, String) = conn
            .query_first("SELECT @@server_uuid, @@gtid_executed")
            .await?
            .unwrap_or_default();
        let set = MysqlGtidSet::parse(&executed.replace(['\n', ' '], "")).unwrap_or_default();
        Ok(SourceIdentity {
            id: format!("mysql:{uuid}"),
            head,
            gtids: Some(Arc::new(move |g: &str| mysql_holds(&set, g))),
        })
    }
}

/// The MariaDB GTIDs a server holds: the last of every domain and origin server in its
/// binlog (`gtid_binlog_state`), and the last of every domain it applied or wrote
/// (`gtid_current_pos`, which covers a replica that does not log what it applies).
#[derive(Debug, Default)]
struct MariaHistory {
    binlog: Vec<Gtid>,
    current: GtidState,
}

impl MariaHistory {
    fn parse(binlog_state: &str, current: &str) -> MariaHistory {
        MariaHistory {
            binlog: binlog_state
                .split(',')
                .filter_map(|g| Gtid::parse(g.trim()))
                .collect(),
            current: GtidState::parse(current).unwrap_or_default(),
        }
    }

    /// Whether `g` is at or before what the server holds: sequence numbers grow within a
    /// domain (as `gtid_strict_mode` enforces).
    fn holds(&self, g: &str) -> bool {
        let Some(g) = Gtid::parse(g) else {
            return false;
        };
        self.binlog
            .iter()
            .any(|b| b.domain == g.domain && b.server == g.server && b.seq >= g.seq)
            || self.current.get(g.domain).is_some_and(|c| c.seq >= g.seq)
    }
}

/// Whether the executed set holds `g` (`uuid:n` or `uuid:tag:n`).
fn mysql_holds(set: &MysqlGtidSet, g: &str) -> bool {
    let Some((head, gno)) = g.trim().rsplit_once(':') else {
        return false;
    };
    let (uuid, tag) = head.split_once(':').unwrap_or((head, ""));
    match (uuid::Uuid::parse_str(uuid), gno.parse::<u64>()) {
        (Ok(u), Ok(n)) => set.contains(*u.as_bytes(), tag, n),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mariadb_server_holds_what_its_binlog_or_its_applied_position_has() {
        let h = MariaHistory::parse("0-1-57,0-2-60,1-3-9", "0-2-60,1-3-9");
        assert!(h.holds("0-1-57"));
        assert!(h.holds("0-1-12"));
        // Domain 0 was applied through 60: 58 came before it, whichever server wrote it.
        assert!(h.holds("0-1-58"));
        // Applied through domain 0 up to 60, whoever wrote it.
        assert!(h.holds("0-7-58"));
        assert!(!h.holds("0-1-61"));
        assert!(!h.holds("2-1-1"));
        assert!(!h.holds("nonsense"));
        // A replica that logs nothing it applies still holds what it applied.
        let replica = MariaHistory::parse("", "0-1-57");
        assert!(replica.holds("0-1-57"));
        assert!(!replica.holds("0-1-58"));
    }

    #[test]
    fn a_mysql_server_holds_the_gtids_of_its_executed_set() {
        let set = MysqlGtidSet::parse("3e11fa47-71ca-11e1-9e33-c80aa9429562:1-5:9").unwrap();
        assert!(mysql_holds(&set, "3e11fa47-71ca-11e1-9e33-c80aa9429562:5"));
        assert!(mysql_holds(&set, "3e11fa47-71ca-11e1-9e33-c80aa9429562:9"));
        assert!(!mysql_holds(&set, "3e11fa47-71ca-11e1-9e33-c80aa9429562:7"));
        assert!(!mysql_holds(&set, "4e11fa47-71ca-11e1-9e33-c80aa9429562:1"));
        assert!(!mysql_holds(&set, "garbage"));
    }
}
