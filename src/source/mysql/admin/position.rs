//! Whether a stored position can still be streamed from: its file is on the server, the
//! position is an event boundary inside it and (MariaDB) its GTID state is the one tracked
//! with it; otherwise the position is lost, with the fix that applies (purged by retention,
//! or a binlog replaced under it).

use super::{binlog_logs, gtid_at_opt, head_status, BinlogFile, Flavour};
use crate::source::mysql::gtid::{Gtid, GtidState, MysqlGtidSet};
use crate::Error;
use mysql_async::prelude::Queryable;
use mysql_async::Conn;

/// The fix for a position whose binlog file was purged by retention.
pub fn lost_position_fix(name: &str) -> String {
    format!(
        "the binlog events after the stored position were purged, so the events in them may never be published. \
         Recover through the table: run with --on-position-lost poll (it streams from the current position and publishes again every row created since the last confirmed commit, minus a margin; expect duplicates), \
         or publish what was lost by hand (`outboxd run --snapshot since=<time of the last delivered event>` after a teardown), \
         or accept the gap: `outboxd teardown --name {name} --yes`, then start again; and keep binlogs longer than the longest relay outage \
         (SET GLOBAL binlog_expire_logs_seconds = 604800)"
    )
}

/// The fix for a position the server's binlog does not hold as it was read: its numbering
/// started again (`RESET MASTER`) or it is another server (a failover).
pub fn replaced_binlog_fix(name: &str) -> String {
    format!(
        "the server's binlog is not the one the stored position was read from, so the events committed after the last delivered one \
         cannot be found by position and streaming from it would skip or repeat an unknown stretch. \
         Either publish them again from the table (`outboxd run --on-position-lost poll ...` streams from the server's current position \
         and replays every row created since the last delivered one, minus a margin; expect duplicates), or start over: \
         `outboxd teardown --name {name} --yes`, then `outboxd run --snapshot since=<time of the last delivered event> ...`. \
         After a planned failover to a server that has every transaction the relay delivered, point the relay at that server's position \
         of the last delivered transaction instead: `outboxd offset set --name {name} --binlog-position FILE:POS` \
         (with --offset-file PATH where the relay keeps its position in a file)"
    )
}

/// The position stored while a recovery through the table runs whose new positions sort
/// before the lost one (the server's binlog started again, or another server's numbers are
/// lower): file number 0, which no server writes, so it sorts before every real position (the
/// first one the recovery confirms replaces it) and a start that finds it is a lost position
/// again (the replay did not finish: it runs again).
pub fn lost_marker(lost_file: &str) -> crate::event::Checkpoint {
    crate::event::Checkpoint::Binlog {
        file: format!("{}.000000", split_name(lost_file).0),
        pos: 4,
        gtid_state: None,
    }
}

/// What is at a position in its binlog file, as the server reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AtPosition {
    /// Not looked at: the file is not on the server or is shorter than the position.
    Unread,
    /// An event starts there (or the file ends there); MariaDB: the GTID state there.
    Boundary(Option<GtidState>),
    /// No event starts there.
    NoBoundary,
}

/// What the server's binlog holds, read to check a position before streaming from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerLog {
    /// `SHOW BINARY LOGS`, oldest first.
    pub files: Vec<BinlogFile>,
    /// The current position (`SHOW MASTER STATUS`).
    pub head: (String, u64),
    /// MariaDB: `@@gtid_binlog_state`, every (domain, server id) the binlog has seen; `None`
    /// on MySQL.
    pub gtid_binlog_state: Option<Vec<Gtid>>,
    /// What is at the position in its file.
    pub at: AtPosition,
    /// MariaDB: the GTID state at the start of the server's oldest binlog file (what it can
    /// still send begins there); `None` on MySQL or where it could not be read.
    pub first_state: Option<GtidState>,
    /// The server's own `@@server_id`.
    pub server_id: Option<u32>,
    /// MySQL with GTIDs: `@@gtid_executed` and `@@gtid_purged`; `None` on MariaDB or where
    /// they cannot be read.
    pub mysql_sets: Option<(MysqlGtidSet, MysqlGtidSet)>,
}

/// What a start (or a reconnect) may do with a stored position on this server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Stream from it as stored.
    Streams,
    /// Its coordinates are not this server's (another server after a failover or switchover,
    /// or a binlog laid out otherwise), but the server's binlog holds its GTID state and what
    /// follows: resume by GTID, at this server's coordinates of that state. Says why.
    ByGtid(String),
    /// Lost, with the fix that applies.
    Lost(Lost),
}

/// Why a position cannot be streamed from: the problem and which fix applies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lost {
    pub problem: String,
    /// Its file was purged by retention (rather than the binlog replaced under it).
    pub purged: bool,
}

impl Lost {
    pub fn into_error(self, name: &str) -> Error {
        Error::PositionLost {
            fix: if self.purged {
                lost_position_fix(name)
            } else {
                replaced_binlog_fix(name)
            },
            problem: self.problem,
        }
    }
}

/// `mariadb-bin.000007` → (`mariadb-bin`, 7).
fn split_name(file: &str) -> (&str, Option<u64>) {
    match file.rsplit_once('.') {
        Some((base, n)) => (base, n.parse().ok()),
        None => (file, None),
    }
}

fn file_range(files: &[BinlogFile]) -> String {
    match (files.first(), files.last()) {
        (Some(a), Some(b)) if a == b => a.name.clone(),
        (Some(a), Some(b)) => format!("{} … {}", a.name, b.name),
        _ => "no binlog files".into(),
    }
}

/// Whether the binlog can be streamed from `from` (a stored position at start, the last
/// transaction boundary read at a reconnect), decided from what the server says.
///
/// - its file must be on the server. Missing because it is older than the server's first file
///   is retention (purged); by GTID the server itself then says whether it still has what
///   follows, unless `strict` (recovery on: a needless replay gives duplicates, a wrong guess a
///   gap). Missing otherwise — a number past the server's last file, another base name — means
///   the numbering started again (`RESET MASTER`) or this is another server.
/// - the position must lie inside that file (not past its size, not past the server's current
///   position when it is the current file) and be an event boundary.
/// - MariaDB: the GTID state the server computes there must be the one tracked with it (a
///   file created again under the same name and now longer than the position has other
///   transactions there), and no domain of it may be ahead of the server's binlog state (the
///   server's history is older than the relay's: `RESET MASTER`, or a failover to a server that
///   had not received everything).
pub fn position_problem(
    name: &str,
    from: &crate::source::mysql::Resume,
    mariadb: bool,
    strict: bool,
    server: &ServerLog,
) -> Option<Lost> {
    match position_verdict(name, from, mariadb, strict, server) {
        Verdict::Lost(lost) => Some(lost),
        Verdict::Streams | Verdict::ByGtid(_) => None,
    }
}

/// [`position_problem`], and where the coordinates are not this server's, whether the server
/// still holds the stored GTID state so that a GTID resume is exact:
///
/// - MariaDB: every GTID of the stored state (`domain-server-seq`) is in the server's binlog
///   history — `@@gtid_binlog_state` lists that domain and server id at that sequence number or
///   later (a promoted replica with `log_slave_updates` has the old primary's GTIDs there) —
///   and its oldest binlog file starts at or before the stored state (nothing after it was
///   purged). A state ahead of the server, a GTID the server never logged (a replica without
///   `log_slave_updates`, another history) or a purged one is lost, never a silent skip.
/// - Without a stored GTID state (MySQL, or a position set by hand) nothing but the
///   coordinates can say where to resume: lost as before.
pub fn position_verdict(
    name: &str,
    from: &crate::source::mysql::Resume,
    mariadb: bool,
    strict: bool,
    server: &ServerLog,
) -> Verdict {
    let Some(lost) = coordinates_problem(name, from, mariadb, strict, server) else {
        return Verdict::Streams;
    };
    if lost.purged || !from.by_gtid(mariadb) {
        return Verdict::Lost(lost);
    }
    let (holding, stored) = if mariadb {
        let Some(stored) = from.gtid.as_ref() else {
            return Verdict::Lost(lost);
        };
        let h = super::relocate::holds(
            stored,
            server.gtid_binlog_state.as_deref().unwrap_or(&[]),
            server.first_state.as_ref(),
            server.server_id,
        );
        (h, stored.to_string())
    } else {
        let (Some(stored), Some((executed, purged))) =
            (from.mysql_gtids.as_ref(), &server.mysql_sets)
        else {
            return Verdict::Lost(lost);
        };
        (
            super::relocate::holds_mysql(stored, executed, purged),
            stored.to_string(),
        )
    };
    match holding {
        super::relocate::Holding::Held => Verdict::ByGtid(format!(
            "{}; the server's binlog holds the stored GTID state {stored}, so the relay resumes there by GTID",
            lost.problem
        )),
        super::relocate::Holding::Missing { problem, purged } => Verdict::Lost(Lost {
            problem: format!("{}; and {problem}", lost.problem),
            purged,
        }),
    }
}

fn coordinates_problem(
    name: &str,
    from: &crate::source::mysql::Resume,
    mariadb: bool,
    strict: bool,
    server: &ServerLog,
) -> Option<Lost> {
    let at = format!("{}:{}", from.file, from.pos);
    let lost = |problem: String| {
        Some(Lost {
            problem,
            purged: false,
        })
    };
    let Some(last) = server.files.last() else {
        return lost(format!(
            "relay {name:?}'s position {at} cannot be read: the server lists no binlog files"
        ));
    };
    let first = &server.files[0];
    let by_gtid = from.by_gtid(mariadb);
    let stored_gtid = from.gtid.as_ref().filter(|g| mariadb && !g.is_empty());
    let ahead = || -> Option<Lost> {
        if let (Some(ours), Some(state)) = (stored_gtid, &server.gtid_binlog_state) {
            let server_state = GtidState::from_list(state);
            for g in ours.domains() {
                let theirs = server_state.get(g.domain);
                if theirs.is_none_or(|t| t.seq < g.seq) {
                    return lost(format!(
                    "relay {name:?} has read GTID {g} in domain {}, but the server's binlog {}: its history is older than \
                     the relay's (RESET MASTER, or a failover to a server that had not received every transaction)",
                    g.domain,
                    match theirs {
                        Some(t) => format!("ends at {t} there"),
                        None => "has no transaction of that domain".into(),
                    }
                ));
                }
            }
        }
        None
    };
    match server.files.iter().find(|f| f.name == from.file) {
        None => {
            let (base, seq) = split_name(&from.file);
            let (first_base, first_seq) = split_name(&first.name);
            let purged =
                base == first_base && matches!((seq, first_seq), (Some(s), Some(f)) if s < f);
            if seq == Some(0) {
                return lost(format!(
                    "relay {name:?} lost its position and its recovery through the table (--on-position-lost poll) was cut off \
                     before the replayed rows were confirmed (stored {at}, a marker no server writes)"
                ));
            }
            if purged {
                if strict || !by_gtid {
                    return Some(Lost {
                        problem: format!(
                            "binlog file {:?} of relay {name:?}'s position {at} was purged (the server has {})",
                            from.file,
                            file_range(&server.files)
                        ),
                        purged: true,
                    });
                }
            } else {
                return lost(format!(
                    "binlog file {:?} of relay {name:?}'s position {at} is not on the server, whose binlog runs from {} to {} \
                     (current position {}:{}): its binlog numbering started again (RESET MASTER) or it is another server (a failover)",
                    from.file, first.name, last.name, server.head.0, server.head.1
                ));
            }
        }
        Some(f) => {
            if server.head.0 == f.name && from.pos > server.head.1 {
                return lost(format!(
                    "relay {name:?}'s position {at} is past the server's current position {}:{} in that file: the file was created \
                     again (RESET MASTER) or this is another server (a failover)",
                    server.head.0, server.head.1
                ));
            }
            if from.pos > f.size {
                return lost(format!(
                    "relay {name:?}'s position {at} is past the end of that file on the server ({} bytes): the file was created \
                     again (RESET MASTER) or this is another server (a failover)",
                    f.size
                ));
            }
            if let Some(lost) = ahead() {
                return Some(lost);
            }
            match &server.at {
                _ if from.pos < 4 => {
                    return lost(format!(
                        "relay {name:?}'s position {at} is before the first event of any binlog file (4)"
                    ))
                }
                AtPosition::NoBoundary => {
                    return lost(format!(
                        "no binlog event starts at relay {name:?}'s position {at} on the server: the file was created again \
                         (RESET MASTER) or this is another server (a failover)"
                    ))
                }
                AtPosition::Boundary(Some(there)) => {
                    if let Some(ours) = stored_gtid {
                        if there != ours {
                            return lost(format!(
                                "the server's GTID state at {at} is {:?}, but relay {name:?} read {:?} there: the file was created \
                                 again (RESET MASTER) or this is another server (a failover)",
                                there.to_string(),
                                ours.to_string()
                            ));
                        }
                    }
                }
                AtPosition::Boundary(None) | AtPosition::Unread => {}
            }
        }
    }
    ahead()
}

/// Reads what [`position_problem`] needs from the server.
pub async fn server_log(
    conn: &mut Conn,
    from: &crate::source::mysql::Resume,
    mariadb: bool,
) -> Result<ServerLog, Error> {
    let flavour = (!mariadb).then_some(Flavour::MySql { major: 8, minor: 4 });
    let head = head_status(conn, flavour).await?;
    let files = binlog_logs(conn).await?;
    let gtid_binlog_state = if mariadb {
        let s: Option<Option<String>> = conn.query_first("SELECT @@gtid_binlog_state").await?;
        let s = s.flatten().unwrap_or_default();
        let list: Option<Vec<Gtid>> = s
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(Gtid::parse)
            .collect();
        Some(list.ok_or_else(|| Error::Decode(format!("@@gtid_binlog_state is {s:?}")))?)
    } else {
        None
    };
    let inside = files
        .iter()
        .any(|f| f.name == from.file && from.pos <= f.size && from.pos >= 4);
    let at = if !inside {
        AtPosition::Unread
    } else if mariadb {
        match gtid_at_opt(conn, &from.file, from.pos).await? {
            Some(g) => AtPosition::Boundary(Some(g)),
            None => AtPosition::NoBoundary,
        }
    } else {
        // The file name is one the server listed; quoted all the same.
        let q = from.file.replace('\\', "\\\\").replace('\'', "''");
        match conn
            .query_drop(format!(
                "SHOW BINLOG EVENTS IN '{q}' FROM {} LIMIT 1",
                from.pos
            ))
            .await
        {
            Ok(()) => AtPosition::Boundary(None),
            // "Wrong offset or I/O error": no event starts there.
            Err(e) if crate::source::mysql::server_code(&e) == Some(1220) => AtPosition::NoBoundary,
            Err(e) => return Err(e.into()),
        }
    };
    let first_state = match files.first() {
        Some(f) if mariadb => gtid_at_opt(conn, &f.name, 4).await?,
        _ => None,
    };
    let server_id: Option<u64> = conn.query_first("SELECT @@server_id").await?;
    let mysql_sets = if mariadb {
        None
    } else {
        let sets: Option<(Option<String>, Option<String>)> = conn
            .query_first("SELECT @@gtid_executed, @@gtid_purged")
            .await
            .ok()
            .flatten();
        sets.and_then(|(e, p)| {
            Some((
                MysqlGtidSet::parse(&e.unwrap_or_default())?,
                MysqlGtidSet::parse(&p.unwrap_or_default())?,
            ))
        })
    };
    Ok(ServerLog {
        files,
        head: (head.file, head.pos),
        gtid_binlog_state,
        at,
        first_state,
        server_id: server_id.and_then(|i| u32::try_from(i).ok()),
        mysql_sets,
    })
}

/// Fails with a lost position (and its fix) when the binlog cannot be streamed from `from`
/// (see [`position_verdict`]); otherwise says whether it streams as stored or by GTID at this
/// server's own coordinates.
pub async fn require_position(
    conn: &mut Conn,
    name: &str,
    from: &crate::source::mysql::Resume,
    mariadb: bool,
    strict: bool,
) -> Result<Verdict, Error> {
    let server = server_log(conn, from, mariadb).await?;
    match position_verdict(name, from, mariadb, strict, &server) {
        Verdict::Lost(lost) => {
            tracing::debug!(?server, "the server's binlog, against the position");
            Err(lost.into_error(name))
        }
        v => Ok(v),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn files(list: &[(&str, u64)]) -> Vec<BinlogFile> {
        list.iter()
            .map(|(n, s)| BinlogFile {
                name: n.to_string(),
                size: *s,
            })
            .collect()
    }

    fn gtids(s: &str) -> Vec<Gtid> {
        s.split(',').filter_map(Gtid::parse).collect()
    }

    /// A position as the relay stores it: MariaDB with its GTID state, or by position only.
    fn at(file: &str, pos: u64, gtid: Option<&str>) -> crate::source::mysql::Resume {
        crate::source::mysql::Resume::from_checkpoint(&crate::event::Checkpoint::Binlog {
            file: file.into(),
            pos,
            gtid_state: gtid.map(str::to_string),
        })
        .unwrap()
    }

    fn server(list: &[(&str, u64)], state: &str, at: AtPosition) -> ServerLog {
        let files = files(list);
        let last = files.last().unwrap();
        ServerLog {
            head: (last.name.clone(), last.size),
            files,
            gtid_binlog_state: Some(gtids(state)),
            at,
            first_state: None,
            server_id: Some(1),
            mysql_sets: None,
        }
    }

    fn maria_state(s: &str) -> AtPosition {
        AtPosition::Boundary(Some(GtidState::parse(s).unwrap()))
    }

    #[test]
    fn a_position_the_server_still_has_streams() {
        let srv = server(
            &[("mariadb-bin.000006", 900), ("mariadb-bin.000007", 5000)],
            "0-1-40",
            maria_state("0-1-33"),
        );
        let p = at("mariadb-bin.000007", 1234, Some("0-1-33"));
        assert_eq!(position_problem("r", &p, true, false, &srv), None);
        assert_eq!(position_problem("r", &p, true, true, &srv), None);
        // At the very end of the current file (nothing written since).
        let end = at("mariadb-bin.000007", 5000, Some("0-1-40"));
        let srv = server(
            &[("mariadb-bin.000007", 5000)],
            "0-1-40",
            maria_state("0-1-40"),
        );
        assert_eq!(position_problem("r", &end, true, false, &srv), None);
        // Several server ids in a domain (a failover long ago): the highest counts.
        let srv = server(
            &[("mariadb-bin.000007", 5000)],
            "0-1-10,0-2-40,1-1-3",
            maria_state("0-2-40,1-1-3"),
        );
        let p = at("mariadb-bin.000007", 5000, Some("0-2-40,1-1-3"));
        assert_eq!(position_problem("r", &p, true, false, &srv), None);
        // MySQL by position: an event boundary inside the file.
        let mut my = server(&[("binlog.000003", 9000)], "", AtPosition::Boundary(None));
        my.gtid_binlog_state = None;
        assert_eq!(
            position_problem("r", &at("binlog.000003", 4000, None), false, false, &my),
            None
        );
    }

    #[test]
    fn a_file_after_the_servers_last_one_is_a_binlog_that_started_again() {
        // RESET MASTER (or a failover to a server with lower numbers): the stored file is
        // beyond the server's last one.
        let srv = server(&[("mariadb-bin.000001", 330)], "", AtPosition::Unread);
        for p in [
            at("mariadb-bin.000007", 1234, Some("0-1-500")),
            at("mariadb-bin.000007", 1234, None),
        ] {
            for strict in [false, true] {
                let lost = position_problem("billing", &p, true, strict, &srv).unwrap();
                assert!(!lost.purged, "not retention: {lost:?}");
                assert!(
                    lost.problem.contains("\"mariadb-bin.000007\"")
                        && lost
                            .problem
                            .contains("from mariadb-bin.000001 to mariadb-bin.000001")
                        && lost.problem.contains("RESET MASTER"),
                    "{}",
                    lost.problem
                );
                let Error::PositionLost { fix, .. } = lost.into_error("billing") else {
                    unreachable!()
                };
                for needle in [
                    "--on-position-lost poll",
                    "outboxd teardown --name billing --yes",
                    "--snapshot since=",
                    "outboxd offset set --name billing --binlog-position FILE:POS",
                ] {
                    assert!(fix.contains(needle), "{needle} in {fix}");
                }
            }
        }
        // Another base name: another server (or log_bin changed), not retention.
        let srv = server(&[("mysql-bin.000009", 330)], "", AtPosition::Unread);
        let lost =
            position_problem("r", &at("mariadb-bin.000002", 4, None), true, false, &srv).unwrap();
        assert!(!lost.purged);
    }

    #[test]
    fn a_purged_file_is_retention_and_gtid_resume_is_left_to_the_server() {
        let srv = server(
            &[("mariadb-bin.000009", 400), ("mariadb-bin.000010", 900)],
            "0-1-700",
            AtPosition::Unread,
        );
        // By position: lost, with the retention fix.
        let lost = position_problem(
            "r",
            &at("mariadb-bin.000007", 1234, None),
            true,
            false,
            &srv,
        )
        .unwrap();
        assert!(lost.purged);
        assert!(
            lost.problem.contains("was purged")
                && lost
                    .problem
                    .contains("mariadb-bin.000009 … mariadb-bin.000010"),
            "{}",
            lost.problem
        );
        let Error::PositionLost { fix, .. } = lost.into_error("r") else {
            unreachable!()
        };
        assert!(fix.contains("binlog_expire_logs_seconds"), "{fix}");
        // By GTID the server says whether it still has what follows; with recovery on it
        // counts as lost.
        let by_gtid = at("mariadb-bin.000007", 1234, Some("0-1-500"));
        assert_eq!(position_problem("r", &by_gtid, true, false, &srv), None);
        assert!(
            position_problem("r", &by_gtid, true, true, &srv)
                .unwrap()
                .purged
        );
    }

    #[test]
    fn a_position_past_the_file_or_the_head_is_a_file_created_again() {
        // The stored file exists but is shorter: RESET MASTER started it again.
        let srv = server(
            &[("mariadb-bin.000001", 900), ("mariadb-bin.000002", 600)],
            "0-1-9",
            AtPosition::Unread,
        );
        let lost = position_problem(
            "r",
            &at("mariadb-bin.000001", 5000, Some("0-1-300")),
            true,
            false,
            &srv,
        )
        .unwrap();
        assert!(!lost.purged);
        assert!(
            lost.problem.contains("past the end of that file")
                && lost.problem.contains("900 bytes"),
            "{}",
            lost.problem
        );
        // The current file: past the server's current position.
        let lost =
            position_problem("r", &at("mariadb-bin.000002", 601, None), true, false, &srv).unwrap();
        assert!(
            lost.problem
                .contains("past the server's current position mariadb-bin.000002:600"),
            "{}",
            lost.problem
        );
        // Before the first event.
        let srv = server(&[("binlog.000001", 900)], "", AtPosition::Unread);
        assert!(position_problem("r", &at("binlog.000001", 2, None), false, false, &srv).is_some());
    }

    #[test]
    fn a_file_created_again_and_now_longer_is_told_by_what_is_at_the_position() {
        // No event starts at the position (MariaDB: BINLOG_GTID_POS is NULL; MySQL: SHOW
        // BINLOG EVENTS fails there).
        let srv = server(
            &[("mariadb-bin.000001", 90_000)],
            "0-1-900",
            AtPosition::NoBoundary,
        );
        for gtid in [None, Some("0-1-300")] {
            let lost = position_problem(
                "r",
                &at("mariadb-bin.000001", 5000, gtid),
                true,
                false,
                &srv,
            )
            .unwrap();
            assert!(
                lost.problem.contains("no binlog event starts"),
                "{}",
                lost.problem
            );
        }
        // An event boundary, but the transactions before it are others than the relay read.
        let srv = server(
            &[("mariadb-bin.000001", 90_000)],
            "0-1-900",
            maria_state("0-1-41"),
        );
        let p = at("mariadb-bin.000001", 5000, Some("0-1-300"));
        for strict in [false, true] {
            let lost = position_problem("r", &p, true, strict, &srv).unwrap();
            assert!(
                lost.problem.contains("\"0-1-41\"") && lost.problem.contains("\"0-1-300\""),
                "{}",
                lost.problem
            );
        }
        // A domain the relay tracked is missing at the position: also another history.
        let srv = server(
            &[("mariadb-bin.000001", 90_000)],
            "0-1-900,1-1-5",
            maria_state("0-1-300"),
        );
        assert!(position_problem(
            "r",
            &at("mariadb-bin.000001", 5000, Some("0-1-300,1-1-5")),
            true,
            false,
            &srv
        )
        .is_some());
    }

    #[test]
    fn a_gtid_state_ahead_of_the_servers_binlog_is_an_older_history() {
        // The stored file is purged (so the server would decide by GTID), but the relay has read
        // 0-1-500 and the server's binlog ends at 0-1-480 in that domain: a failover to a server
        // that had not received everything, or a binlog started again.
        let srv = server(
            &[("mariadb-bin.000020", 900)],
            "0-1-480",
            AtPosition::Unread,
        );
        let p = at("mariadb-bin.000012", 1234, Some("0-1-500"));
        let lost = position_problem("r", &p, true, false, &srv).unwrap();
        assert!(!lost.purged);
        assert!(
            lost.problem.contains("GTID 0-1-500") && lost.problem.contains("ends at 0-1-480"),
            "{}",
            lost.problem
        );
        // A domain the server has never seen.
        let srv = server(
            &[("mariadb-bin.000020", 900)],
            "0-1-900",
            AtPosition::Unread,
        );
        let lost = position_problem(
            "r",
            &at("mariadb-bin.000012", 1234, Some("0-1-500,7-3-2")),
            true,
            false,
            &srv,
        )
        .unwrap();
        assert!(
            lost.problem.contains("no transaction of that domain"),
            "{}",
            lost.problem
        );
        // An empty binlog state (RESET MASTER, nothing written yet).
        let srv = server(&[("mariadb-bin.000020", 900)], "", AtPosition::Unread);
        assert!(position_problem("r", &p, true, false, &srv).is_some());
        // MySQL has no MariaDB GTID state to compare.
        let mut my = server(&[("binlog.000020", 900)], "", AtPosition::Unread);
        my.gtid_binlog_state = None;
        assert_eq!(
            position_problem("r", &at("binlog.000012", 1234, None), false, false, &my)
                .map(|l| l.purged),
            Some(true)
        );
    }

    #[test]
    fn another_servers_position_resumes_by_gtid_when_the_server_holds_the_state() {
        // MariaDB: a promoted replica (server 2) whose binlog numbers are lower, holding the
        // old primary's GTIDs (log_slave_updates).
        let mut srv = server(
            &[("mariadb-bin.000001", 90_000)],
            "0-1-500,0-2-520",
            AtPosition::Unread,
        );
        srv.server_id = Some(2);
        let p = at("mariadb-bin.000005", 1234, Some("0-1-480"));
        for strict in [false, true] {
            let Verdict::ByGtid(why) = position_verdict("r", &p, true, strict, &srv) else {
                panic!("{:?}", position_verdict("r", &p, true, strict, &srv))
            };
            assert!(why.contains("holds the stored GTID state 0-1-480"), "{why}");
        }
        // The same file name holding other offsets.
        let mut same = server(
            &[("mariadb-bin.000001", 90_000)],
            "0-1-500,0-2-520",
            maria_state("0-1-33"),
        );
        same.server_id = Some(2);
        let p = at("mariadb-bin.000001", 5000, Some("0-1-480"));
        assert!(matches!(
            position_verdict("r", &p, true, false, &same),
            Verdict::ByGtid(_)
        ));
        // Ahead of it: lost, never a resume.
        let p = at("mariadb-bin.000005", 1234, Some("0-1-530"));
        assert!(matches!(
            position_verdict("r", &p, true, false, &srv),
            Verdict::Lost(_)
        ));
        // By position only (no stored GTID state): nothing says where to resume.
        let p = at("mariadb-bin.000005", 1234, None);
        assert!(matches!(
            position_verdict("r", &p, true, false, &srv),
            Verdict::Lost(_)
        ));

        // MySQL 8: the stored executed set within @@gtid_executed, nothing needed purged.
        let u = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
        let set = |s: &str| MysqlGtidSet::parse(s).unwrap();
        let mut my = server(&[("binlog.000002", 9000)], "", AtPosition::Unread);
        my.gtid_binlog_state = None;
        my.mysql_sets = Some((set(&format!("{u}:1-100")), set(&format!("{u}:1-10"))));
        let p = at("binlog.000007", 4000, Some(&format!("{u}:1-90")));
        assert!(matches!(
            position_verdict("r", &p, false, false, &my),
            Verdict::ByGtid(_)
        ));
        let ahead = at("binlog.000007", 4000, Some(&format!("{u}:1-101")));
        let Verdict::Lost(l) = position_verdict("r", &ahead, false, false, &my) else {
            panic!()
        };
        assert!(l.problem.contains(&format!("{u}:101")), "{}", l.problem);
        let purged = at("binlog.000007", 4000, Some(&format!("{u}:1-5")));
        let Verdict::Lost(l) = position_verdict("r", &purged, false, false, &my) else {
            panic!()
        };
        assert!(l.purged, "{}", l.problem);
    }

    #[test]
    fn no_binlog_files_at_all_is_lost() {
        let srv = ServerLog {
            files: Vec::new(),
            head: ("mariadb-bin.000001".into(), 4),
            gtid_binlog_state: None,
            at: AtPosition::Unread,
            first_state: None,
            server_id: Some(1),
            mysql_sets: None,
        };
        assert!(
            position_problem("r", &at("mariadb-bin.000001", 4, None), true, false, &srv).is_some()
        );
    }
}
