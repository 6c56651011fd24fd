//! A stored position on another server: whether that server's binlog holds the stored GTID
//! state (so a GTID resume is exact whatever its files are called), and where that state lies
//! in its binlog, so the relay's position is stored in that server's own coordinates from then
//! on. Both flavours: MariaDB GTID states (`domain-server-seq` per domain) and MySQL GTID sets
//! (`server_uuid:1-n`). The decisions are pure functions over what the server says; the SQL
//! that asks is at the end.

use super::text;
use crate::source::mysql::gtid::{Gtid, GtidState, MysqlGtidSet};
use crate::Error;
use mysql_async::prelude::Queryable;
use mysql_async::{Conn, Row};

/// Whether a server's binlog holds a stored GTID state and everything after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Holding {
    Held,
    /// It does not: why, and whether the reason is retention (purged).
    Missing {
        problem: String,
        purged: bool,
    },
}

/// The identity a MariaDB server's GTIDs carry: its `@@server_id` (every GTID it writes names
/// it). One function so that whatever else compares servers uses the same rule.
pub(crate) fn mariadb_server_identity(server_id: u32) -> u32 {
    server_id
}

/// MariaDB: whether a server whose `@@gtid_binlog_state` is `binlog_state`, whose oldest
/// binlog file starts at `first_state` and whose own server id is `own_id` holds `stored`:
///
/// - each stored GTID `d-s-n` must be in its binlog history: the binlog state lists domain `d`
///   and server `s` at `n` or later. A promoted replica that logged what it replicated
///   (`log_slave_updates`) lists the old primary's server id there; one that did not, or a
///   server whose binlog is behind the relay (a failover that rolled transactions back),
///   does not.
/// - a GTID the server wrote itself (`s` = its own id) proves nothing when its coordinates do
///   not match: the same server with another binlog was reset (`RESET MASTER`) or restored,
///   and may have written other transactions under the same numbers since.
/// - the oldest binlog file must start at or before it in every domain (nothing that follows
///   was purged).
pub(crate) fn holds(
    stored: &GtidState,
    binlog_state: &[Gtid],
    first_state: Option<&GtidState>,
    own_id: Option<u32>,
) -> Holding {
    let missing = |problem: String| Holding::Missing {
        problem,
        purged: false,
    };
    for g in stored.domains() {
        let same_server = binlog_state
            .iter()
            .find(|b| b.domain == g.domain && b.server == g.server);
        let newest = binlog_state
            .iter()
            .filter(|b| b.domain == g.domain)
            .max_by_key(|b| b.seq);
        match (same_server, newest) {
            (_, None) => {
                return missing(format!(
                    "the server's binlog has no transaction of domain {} (the relay read GTID {g} there): its history is older than the relay's \
                     (a replica promoted without log_slave_updates has none of its old primary's transactions in its binlog)",
                    g.domain
                ))
            }
            (_, Some(n)) if n.seq < g.seq => {
                return missing(format!(
                    "the relay has read GTID {g} in domain {}, but the server's binlog ends at {n} there: its history is older than \
                     the relay's (a failover to a server that had not received every transaction the relay published, or RESET MASTER)",
                    g.domain
                ))
            }
            (Some(s), _) if s.seq >= g.seq => {
                if own_id.is_some_and(|id| mariadb_server_identity(id) == g.server) {
                    return missing(format!(
                        "GTID {g} was written by this server itself (server_id {}), whose binlog no longer has it where the relay read it: \
                         its binlog was reset or restored, and the same numbers may name other transactions now",
                        g.server
                    ));
                }
            }
            _ => {
                return missing(format!(
                    "the server's binlog does not hold GTID {g} (server_id {} is not in its binlog state for domain {}: a replica promoted \
                     without log_slave_updates, or another history)",
                    g.server, g.domain
                ))
            }
        }
        if let Some(first) = first_state.and_then(|f| f.get(g.domain)) {
            if first.seq > g.seq {
                return Holding::Missing {
                    problem: format!(
                        "the server's oldest binlog file starts after GTID {g} (at {first}): what follows it was purged"
                    ),
                    purged: true,
                };
            }
        }
    }
    Holding::Held
}

/// MySQL: whether a server whose `@@gtid_executed` is `executed` and `@@gtid_purged` is
/// `purged` holds the stored executed set: every stored transaction is executed there
/// (otherwise the server's history is older than the relay's) and every purged one is in the
/// stored set (otherwise the server can no longer send what the relay has not read).
pub(crate) fn holds_mysql(
    stored: &MysqlGtidSet,
    executed: &MysqlGtidSet,
    purged: &MysqlGtidSet,
) -> Holding {
    if let Some(missing) = first_not_in(stored, executed) {
        return Holding::Missing {
            problem: format!(
                "the relay has read GTID {missing}, which the server has not executed (@@gtid_executed {executed}): its history is \
                 older than the relay's (a failover to a server that had not received every transaction the relay published)"
            ),
            purged: false,
        };
    }
    if let Some(gone) = first_not_in(purged, stored) {
        return Holding::Missing {
            problem: format!(
                "GTID {gone} was purged from the server's binlog (@@gtid_purged {purged}) before the relay read it"
            ),
            purged: true,
        };
    }
    Holding::Held
}

/// The first GTID of `a` that `b` lacks, as text.
fn first_not_in(a: &MysqlGtidSet, b: &MysqlGtidSet) -> Option<String> {
    for (uuid, tag, intervals) in a.entries() {
        for &(s, e) in intervals {
            // Jump over each interval of `b` that holds `n`: the walk is one step per
            // interval, not per transaction.
            let mut n = s;
            while n < e {
                if !b.contains(*uuid, tag, n) {
                    return Some(crate::source::mysql::gtid::mysql_gtid_text(*uuid, tag, n));
                }
                n = next_gap(b, uuid, tag, n).unwrap_or(e);
            }
        }
    }
    None
}

/// The first number at or after `n` that `set` lacks for `uuid:tag` (`None`: none before
/// the end of its interval holding `n`, which the caller bounds).
fn next_gap(set: &MysqlGtidSet, uuid: &[u8; 16], tag: &str, n: u64) -> Option<u64> {
    set.entries()
        .filter(|(u, t, _)| *u == uuid && *t == tag)
        .flat_map(|(_, _, iv)| iv.iter())
        .find(|&&(s, e)| s <= n && n < e)
        .map(|&(_, e)| e)
}

/// One transaction start in a binlog file: the offset of its GTID event (a boundary) and the
/// GTID it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Start {
    MariaDb(u64, Gtid),
    MySql(u64, [u8; 16], String, u64),
}

/// A binlog state that can be compared with a stored one and moved by a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Tracked {
    MariaDb(GtidState),
    MySql(MysqlGtidSet),
}

impl Tracked {
    /// Whether this state is the stored one: MariaDB in every domain the stored state has;
    /// MySQL the same set.
    fn is(&self, stored: &Tracked) -> bool {
        match (self, stored) {
            (Tracked::MariaDb(a), Tracked::MariaDb(b)) => b
                .domains()
                .all(|g| a.get(g.domain).is_some_and(|x| x.seq == g.seq)),
            (Tracked::MySql(a), Tracked::MySql(b)) => a == b,
            _ => false,
        }
    }

    fn apply(&mut self, s: &Start) {
        match (self, s) {
            (Tracked::MariaDb(st), Start::MariaDb(_, g)) => st.apply(*g),
            (Tracked::MySql(set), Start::MySql(_, u, t, n)) => set.add(*u, t, *n),
            _ => {}
        }
    }
}

/// Where in one binlog file the state is exactly `stored`: the file starts at `start` (its
/// GTID_LIST / Previous_gtids), `starts` are its transactions in order and `end` is where the
/// file ends. The first boundary whose state is the stored one (the start of the transaction
/// after the stored state, or the file's end); `None` when the file never passes through it.
pub(crate) fn locate_in_file(
    start: Tracked,
    starts: &[Start],
    end: u64,
    stored: &Tracked,
) -> Option<u64> {
    let mut state = start;
    for s in starts {
        if state.is(stored) {
            return Some(match s {
                Start::MariaDb(p, _) | Start::MySql(p, ..) => *p,
            });
        }
        state.apply(s);
    }
    state.is(stored).then_some(end)
}

/// MariaDB: where the server's binlog holds the state `stored` — the file whose GTID_LIST is
/// the newest at or before it, read with `SHOW BINLOG EVENTS` (in pages) up to the boundary.
/// `None` when no boundary has exactly that state (several domains interleaved otherwise).
pub(crate) async fn locate_mariadb(
    conn: &mut Conn,
    stored: &GtidState,
) -> Result<Option<(String, u64)>, Error> {
    let files = super::binlog_logs(conn).await?;
    // Newest first: the first file that starts at or before the stored state in every one of
    // its domains holds it (or the stored state is where a later file starts).
    for f in files.iter().rev() {
        let Some(start) = super::gtid_at_opt(conn, &f.name, 4).await? else {
            continue;
        };
        let before = stored
            .domains()
            .all(|g| start.get(g.domain).is_none_or(|s| s.seq <= g.seq));
        if !before {
            continue;
        }
        let mut starts = Vec::new();
        let mut end = 4;
        let mut from = 4u64;
        let q = f.name.replace('\\', "\\\\").replace('\'', "''");
        loop {
            let rows: Vec<Row> = conn
                .query(format!(
                    "SHOW BINLOG EVENTS IN '{q}' FROM {from} LIMIT 5000"
                ))
                .await?;
            let Some(last) = rows.last() else { break };
            for r in &rows {
                let pos: u64 = text(r, 1).parse().unwrap_or(0);
                end = text(r, 4).parse().unwrap_or(end);
                if text(r, 2) == "Gtid" {
                    if let Some(g) = gtid_of_info(&text(r, 5)) {
                        starts.push(Start::MariaDb(pos, g));
                    }
                }
            }
            let next: u64 = text(last, 4).parse().unwrap_or(0);
            if rows.len() < 5000 || next <= from {
                break;
            }
            from = next;
        }
        let found = locate_in_file(
            Tracked::MariaDb(start),
            &starts,
            end,
            &Tracked::MariaDb(stored.clone()),
        );
        return Ok(found.map(|p| (f.name.clone(), p)));
    }
    Ok(None)
}

/// The GTID of a MariaDB `Gtid` event as `SHOW BINLOG EVENTS` prints it: `BEGIN GTID 0-1-5`,
/// `GTID 0-1-5` (DDL), either followed by ` cid=…` or XA details.
fn gtid_of_info(info: &str) -> Option<Gtid> {
    info.split_whitespace()
        .skip_while(|w| *w != "GTID")
        .nth(1)
        .and_then(Gtid::parse)
}

/// MySQL: where the server's binlog holds the executed set `stored` — the newest file whose
/// `Previous_gtids` is within it, read with `SHOW BINLOG EVENTS` (MySQL prints a GTID event as
/// `SET @@SESSION.GTID_NEXT= 'uuid[:tag]:n'` and `Previous_gtids` as the set). `None` when no
/// boundary has exactly that set. Not run against a MySQL server here (none is reachable);
/// the same walk is proven on MySQL binlog files by `file_starts` (its tests).
pub(crate) async fn locate_mysql(
    conn: &mut Conn,
    stored: &MysqlGtidSet,
) -> Result<Option<(String, u64)>, Error> {
    let files = super::binlog_logs(conn).await?;
    for f in files.iter().rev() {
        let q = f.name.replace('\\', "\\\\").replace('\'', "''");
        let mut starts = Vec::new();
        let mut previous = None;
        let mut end = 4;
        let mut from = 4u64;
        loop {
            let rows: Vec<Row> = conn
                .query(format!(
                    "SHOW BINLOG EVENTS IN '{q}' FROM {from} LIMIT 5000"
                ))
                .await?;
            let Some(last) = rows.last() else { break };
            for r in &rows {
                let pos: u64 = text(r, 1).parse().unwrap_or(0);
                end = text(r, 4).parse().unwrap_or(end);
                match text(r, 2).as_str() {
                    "Previous_gtids" => previous = MysqlGtidSet::parse(&text(r, 5)),
                    "Gtid" | "Gtid_tagged" => {
                        if let Some((u, t, n)) = mysql_gtid_of_info(&text(r, 5)) {
                            starts.push(Start::MySql(pos, u, t, n));
                        }
                    }
                    _ => {}
                }
            }
            // Only the newest file whose start is within the stored set can hold it.
            if previous.as_ref().is_some_and(|p| !within(p, stored)) {
                break;
            }
            let next: u64 = text(last, 4).parse().unwrap_or(0);
            if rows.len() < 5000 || next <= from {
                break;
            }
            from = next;
        }
        let Some(start) = previous.filter(|p| within(p, stored)) else {
            continue;
        };
        let found = locate_in_file(
            Tracked::MySql(start),
            &starts,
            end,
            &Tracked::MySql(stored.clone()),
        );
        return Ok(found.map(|p| (f.name.clone(), p)));
    }
    Ok(None)
}

/// Whether every transaction of `a` is in `b`.
fn within(a: &MysqlGtidSet, b: &MysqlGtidSet) -> bool {
    first_not_in(a, b).is_none()
}

/// The GTID of a MySQL `Gtid` event as `SHOW BINLOG EVENTS` prints it:
/// `SET @@SESSION.GTID_NEXT= '3e11fa47-…:7'` (8.4 tagged: `'3e11fa47-…:blue:7'`).
pub(crate) fn mysql_gtid_of_info(info: &str) -> Option<([u8; 16], String, u64)> {
    let quoted = info.split('\'').nth(1)?;
    let mut parts = quoted.split(':');
    let uuid = uuid::Uuid::parse_str(parts.next()?.trim())
        .ok()?
        .into_bytes();
    let rest: Vec<&str> = parts.collect();
    let (tag, n) = match rest.as_slice() {
        [n] => (String::new(), n.parse().ok()?),
        [t, n] => (t.to_ascii_lowercase(), n.parse().ok()?),
        _ => return None,
    };
    Some((uuid, tag, n))
}

/// The start state and transaction starts of one binlog file's events (the file source's
/// framing): MariaDB's GTID_LIST and GTID events, or MySQL's Previous_gtids and GTID events.
/// What [`locate_in_file`] walks; the binlog fixtures prove it on real MySQL and MariaDB bytes.
/// Only its tests call it on whole files.
#[cfg(test)]
pub(crate) fn file_starts(
    events: &[crate::source::mysql::file::FileEvent],
) -> Result<(Option<Tracked>, Vec<Start>, u64), Error> {
    use crate::source::mysql::gtid::{parse_gtid_event, parse_gtid_list};
    use mysql_async::binlog::events::{GtidEvent, PreviousGtidsEvent};
    let mut start = None;
    let mut starts = Vec::new();
    let mut end = 4;
    for fe in events {
        let h = fe.event.header();
        end = fe.offset + u64::from(h.event_size());
        match h.event_type_raw() {
            // MariaDB GTID_LIST: the state at the file's start.
            163 if start.is_none() => {
                let list = parse_gtid_list(fe.event.data())
                    .ok_or_else(|| Error::Decode("a short GTID_LIST event".into()))?;
                start = Some(Tracked::MariaDb(GtidState::from_list(&list)));
            }
            162 => {
                let g = parse_gtid_event(fe.event.data(), h.server_id())
                    .ok_or_else(|| Error::Decode("a short GTID event".into()))?;
                starts.push(Start::MariaDb(fe.offset, g.gtid));
            }
            // MySQL Previous_gtids: the executed set at the file's start.
            35 => {
                if !crate::source::mysql::gtid::previous_gtids_fit(fe.event.data()) {
                    return Err(Error::Decode("a corrupt Previous_gtids event".into()));
                }
                let p: PreviousGtidsEvent<'_> = fe
                    .event
                    .read_event()
                    .map_err(|e| Error::Decode(format!("Previous_gtids: {e}")))?;
                let mut set = MysqlGtidSet::default();
                for sid in p.sids() {
                    let tag = sid.tag().map(|t| t.to_string()).unwrap_or_default();
                    for iv in sid.intervals() {
                        set.add_interval(
                            sid.uuid(),
                            &tag.to_ascii_lowercase(),
                            iv.start(),
                            iv.end(),
                        );
                    }
                }
                start = Some(Tracked::MySql(set));
            }
            // MySQL GTID (33) and 8.4 tagged GTID (42) events.
            33 | 42 => {
                let g: GtidEvent = fe
                    .event
                    .read_event()
                    .map_err(|e| Error::Decode(format!("GTID event: {e}")))?;
                let tag = g.tag().map(|t| t.to_string()).unwrap_or_default();
                starts.push(Start::MySql(
                    fe.offset,
                    g.sid(),
                    tag.to_ascii_lowercase(),
                    g.gno(),
                ));
            }
            _ => {}
        }
    }
    Ok((start, starts, end))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(s: &str) -> GtidState {
        GtidState::parse(s).unwrap()
    }

    fn binlog_state(s: &str) -> Vec<Gtid> {
        s.split(',').filter_map(Gtid::parse).collect()
    }

    #[test]
    fn a_promoted_replica_that_logged_the_old_primarys_gtids_holds_them() {
        // Old primary server 1, replica server 2 with log_slave_updates, promoted and written.
        let srv = binlog_state("0-1-500,0-2-520");
        assert_eq!(holds(&state("0-1-480"), &srv, None, Some(2)), Holding::Held);
        assert_eq!(holds(&state("0-1-500"), &srv, None, Some(2)), Holding::Held);
        // Its own later GTIDs too, read by a relay that followed it, on a third server.
        assert_eq!(holds(&state("0-2-510"), &srv, None, Some(3)), Holding::Held);
    }

    #[test]
    fn a_state_the_server_does_not_hold_is_refused_with_the_reason() {
        let srv = binlog_state("0-1-500,0-2-520");
        // Ahead: the replica had not received everything the relay read.
        let Holding::Missing { problem, purged } = holds(&state("0-1-530"), &srv, None, Some(2))
        else {
            panic!()
        };
        assert!(!purged && problem.contains("ends at 0-2-520"), "{problem}");
        // A server id the server never logged (promoted without log_slave_updates).
        let Holding::Missing { problem, .. } = holds(&state("0-3-100"), &srv, None, Some(2)) else {
            panic!()
        };
        assert!(problem.contains("log_slave_updates"), "{problem}");
        // A domain it never saw.
        assert!(matches!(
            holds(&state("0-1-1,4-1-1"), &srv, None, Some(2)),
            Holding::Missing { .. }
        ));
        // Its own GTIDs where its binlog no longer has them: reset or restored.
        let Holding::Missing { problem, .. } = holds(&state("0-2-510"), &srv, None, Some(2)) else {
            panic!()
        };
        assert!(problem.contains("reset or restored"), "{problem}");
        // Purged: the oldest file starts after the stored state.
        let Holding::Missing { purged, .. } =
            holds(&state("0-1-300"), &srv, Some(&state("0-1-400")), Some(2))
        else {
            panic!()
        };
        assert!(purged);
        assert_eq!(
            holds(&state("0-1-400"), &srv, Some(&state("0-1-400")), Some(2)),
            Holding::Held
        );
    }

    #[test]
    fn mysql_sets_are_held_when_executed_and_not_purged_past() {
        let u = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
        let v = "4f22fa47-71ca-11e1-9e33-c80aa9429563";
        let set = |s: &str| MysqlGtidSet::parse(s).unwrap();
        let executed = set(&format!("{u}:1-100,{v}:1-20"));
        assert_eq!(
            holds_mysql(&set(&format!("{u}:1-90")), &executed, &set("")),
            Holding::Held
        );
        assert_eq!(
            holds_mysql(
                &set(&format!("{u}:1-90,{v}:1-20")),
                &executed,
                &set(&format!("{u}:1-50"))
            ),
            Holding::Held
        );
        let Holding::Missing { problem, purged } =
            holds_mysql(&set(&format!("{u}:1-101")), &executed, &set(""))
        else {
            panic!()
        };
        assert!(
            !purged && problem.contains(&format!("{u}:101")),
            "{problem}"
        );
        let Holding::Missing { purged, problem } = holds_mysql(
            &set(&format!("{u}:1-40")),
            &executed,
            &set(&format!("{u}:1-50")),
        ) else {
            panic!()
        };
        assert!(purged && problem.contains(&format!("{u}:41")), "{problem}");
    }

    /// Every boundary of a real binlog file is found again from the state there: MySQL 8.0
    /// GTIDs, 8.4 tagged GTIDs and a MariaDB binlog, from the fixtures.
    #[test]
    fn every_state_of_the_binlog_fixtures_is_located_at_its_boundary() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/mysql-binlogs");
        for (file, mysql) in [
            ("binlog_transaction_with_GTID.000001", true),
            ("binlog_transaction_with_GTID_TAG.000001", true),
            ("mariadb-bin.000001", false),
        ] {
            let bytes = std::fs::read(format!("{dir}/{file}")).unwrap();
            let events = crate::source::mysql::file::events_from_bytes(file, &bytes).unwrap();
            let boundaries: Vec<u64> = events.iter().map(|e| e.offset).collect();
            let (start, starts, end) = file_starts(&events).unwrap();
            let start = start.unwrap_or_else(|| panic!("{file}: no start state"));
            assert!(matches!(start, Tracked::MySql(_)) == mysql, "{file}");
            assert!(!starts.is_empty(), "{file}: no GTIDs");
            // The state before transaction k is found at transaction k's GTID event.
            let mut state = start.clone();
            for s in &starts {
                let at = match s {
                    Start::MariaDb(p, _) | Start::MySql(p, ..) => *p,
                };
                assert!(
                    boundaries.contains(&at),
                    "{file}: {at} is no event boundary"
                );
                let found = locate_in_file(start.clone(), &starts, end, &state);
                // A GTID repeated in a file (none here) would find the first occurrence.
                assert_eq!(found, Some(at), "{file}: the state {state:?}");
                state.apply(s);
            }
            assert_eq!(
                locate_in_file(start.clone(), &starts, end, &state),
                Some(end)
            );
            // A state the file never passes through (a GTID the server does not have).
            let mut ahead = state.clone();
            match (&mut ahead, starts.last().unwrap()) {
                (Tracked::MySql(set), Start::MySql(_, u, t, n)) => set.add(*u, t, n + 5),
                (Tracked::MariaDb(st), Start::MariaDb(_, g)) => st.apply(Gtid {
                    seq: g.seq + 5,
                    ..*g
                }),
                _ => unreachable!(),
            }
            assert_eq!(locate_in_file(start, &starts, end, &ahead), None, "{file}");
            eprintln!("{file}: {} transactions located", starts.len());
        }
    }

    #[test]
    fn mysql_show_binlog_events_gtids_parse() {
        let u = "3e11fa47-71ca-11e1-9e33-c80aa9429562";
        let (uuid, tag, n) =
            mysql_gtid_of_info(&format!("SET @@SESSION.GTID_NEXT= '{u}:7'")).unwrap();
        assert_eq!(
            (uuid::Uuid::from_bytes(uuid).to_string(), tag.as_str(), n),
            (u.to_string(), "", 7)
        );
        let (_, tag, n) =
            mysql_gtid_of_info(&format!("SET @@SESSION.GTID_NEXT= '{u}:Blue:9'")).unwrap();
        assert_eq!((tag.as_str(), n), ("blue", 9));
        assert!(mysql_gtid_of_info("SET @@SESSION.GTID_NEXT= 'ANONYMOUS'").is_none());
    }

    #[test]
    fn the_boundary_of_a_state_is_found_in_a_file() {
        let g = |s: &str| Gtid::parse(s).unwrap();
        let starts = vec![
            Start::MariaDb(400, g("0-1-11")),
            Start::MariaDb(900, g("0-1-12")),
            Start::MariaDb(1400, g("0-1-13")),
        ];
        let start = Tracked::MariaDb(state("0-1-10"));
        let at =
            |s: &str| locate_in_file(start.clone(), &starts, 1900, &Tracked::MariaDb(state(s)));
        assert_eq!(at("0-1-10"), Some(400));
        assert_eq!(at("0-1-12"), Some(1400));
        assert_eq!(at("0-1-13"), Some(1900));
        assert_eq!(at("0-1-14"), None);
        assert_eq!(at("0-1-9"), None);
        assert_eq!(gtid_of_info("BEGIN GTID 0-1-12 cid=7"), Some(g("0-1-12")));
        assert_eq!(gtid_of_info("GTID 3-2-1"), Some(g("3-2-1")));
        assert_eq!(gtid_of_info("COMMIT /* xid=4 */"), None);
    }
}
