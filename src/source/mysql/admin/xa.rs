//! Prepared XA transactions on the server, as a start position must take them into account.
//! Both servers write an XA transaction's rows in the group that ends with its `XA PREPARE`,
//! and only its outcome (`XA COMMIT`) later: a stream that starts between the two never reads
//! the rows, and the commit publishes nothing. So a start position is checked here: `XA
//! RECOVER` lists the transactions prepared and not ended (every database's), the binlog
//! (`SHOW BINLOG EVENTS`, read in bounded pages) says whether each one's `XA PREPARE` is at or
//! after the position (then the stream reads it) and, for those before it, which tables their
//! group wrote: one that wrote an outbox table (or whose group is not found, purged or too far
//! back) is a reason to refuse the position, one that wrote only other tables is not.

use super::{binlog_files, binlog_logs, text};
use crate::dsn::DbDsn;
use crate::event::binlog_file_seq;
use crate::source::mysql::decode::Xid;
use crate::Error;
use chrono::{DateTime, TimeZone, Utc};
use futures::StreamExt;
use mysql_async::prelude::Queryable;
use mysql_async::{BinlogStreamRequest, Conn, Row};
use std::time::Duration;

/// Events read per `SHOW BINLOG EVENTS` page: bounds the memory a long binlog takes.
const PAGE: usize = 5_000;
/// How far back before a start position a prepared transaction's group is looked for: a
/// bound on the start's time when one was prepared long ago (one not found is refused).
const BACKWARD_BYTES: u64 = 1 << 30;

/// The XA transactions prepared on the server and not yet committed or rolled back.
pub(crate) async fn recover(conn: &mut Conn) -> Result<Vec<Xid>, Error> {
    let rows: Vec<Row> = match conn.query("XA RECOVER").await {
        Ok(rows) => rows,
        // MySQL 8.0.14+ lists them only to holders of XA_RECOVER_ADMIN (MariaDB to anyone):
        // without the list, a start cannot know whether it would lose a prepared one's rows.
        Err(e) if crate::db::mysql::server_code(&e) == Some(1227) => {
            return Err(Error::config(
                format!("XA RECOVER was refused ({e}): a start must see the prepared XA transactions to know that none of their rows would be lost"),
                "GRANT XA_RECOVER_ADMIN ON *.* TO '<user>'@'<host>';  (run as an administrator, naming the relay's user)",
            ))
        }
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    for r in rows {
        let format: i64 = text(&r, 0).parse().unwrap_or(0);
        let g: usize = text(&r, 1).parse().unwrap_or(0);
        let data: Vec<u8> = match r.as_ref(3) {
            Some(mysql_async::Value::Bytes(b)) => b.clone(),
            _ => Vec::new(),
        };
        let g = g.min(data.len());
        out.push(Xid {
            format,
            gtrid: data[..g].to_vec(),
            bqual: data[g..].to_vec(),
        });
    }
    Ok(out)
}

/// A prepared XA transaction whose `XA PREPARE` is before a start position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PreparedBefore {
    pub xid: Xid,
    /// Where its group (`XA START`) starts, when the server still has it.
    pub start: Option<(String, u64)>,
    /// The tables its group wrote (`db.table`), as the binlog's table maps name them.
    pub tables: Vec<String>,
}

impl PreparedBefore {
    /// The statements that end it: either one, on the server.
    pub(crate) fn end_statements(&self) -> String {
        format!("XA COMMIT {0}; or XA ROLLBACK {0};", self.xid)
    }
}

impl std::fmt::Display for PreparedBefore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.start {
            Some((file, pos)) => write!(
                f,
                "{} (XA START at {file}:{pos}, writes {})",
                self.xid,
                if self.tables.is_empty() {
                    "no table".to_string()
                } else {
                    self.tables.join(", ")
                }
            ),
            None => write!(
                f,
                "{} (its XA START is not in the last GiB of binlog before the position: the tables it wrote are unknown)",
                self.xid
            ),
        }
    }
}

/// The prepared XA transactions whose `XA PREPARE` is before `file:pos` and that wrote a table
/// `ours` accepts (`db.table`), or whose group is not found (purged, or more than
/// [`BACKWARD_BYTES`] of binlog back: it may have): a stream from `file:pos` would never
/// publish their rows. Those that wrote only other tables
/// are logged and left alone.
pub(crate) async fn prepared_before(
    conn: &mut Conn,
    file: &str,
    pos: u64,
    ours: impl Fn(&str) -> bool,
) -> Result<Vec<PreparedBefore>, Error> {
    let mut open = recover(conn).await?;
    if open.is_empty() {
        return Ok(Vec::new());
    }
    // Forward from the position: a prepare found there is read by the stream.
    let mut from = (file.to_string(), pos);
    for attempt in 0..2 {
        if attempt > 0 {
            // A transaction the server lists as prepared may reach the binlog a moment later
            // (its binlog write is part of its prepare): one more look before refusing.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let files = binlog_files(conn).await?;
        let from_seq = binlog_file_seq(&from.0);
        for f in files.iter().filter(|f| binlog_file_seq(f) >= from_seq) {
            let start = if *f == from.0 { from.1 } else { 4 };
            let end = walk(conn, f, start, PAGE, |_, info| {
                if let Some(i) = open.iter().position(|x| is_stmt(info, "XA PREPARE", x)) {
                    open.remove(i);
                }
                !open.is_empty()
            })
            .await?;
            from = (f.clone(), end);
            if open.is_empty() {
                return Ok(Vec::new());
            }
        }
    }
    // Backward from the position: each remaining transaction's group and the tables it wrote.
    let mut found: Vec<PreparedBefore> = open
        .iter()
        .map(|x| PreparedBefore {
            xid: x.clone(),
            start: None,
            tables: Vec::new(),
        })
        .collect();
    let logs = binlog_logs(conn).await?;
    let mut read = 0u64;
    for log in logs
        .iter()
        .rev()
        .filter(|l| binlog_file_seq(&l.name) <= binlog_file_seq(file))
    {
        if read >= BACKWARD_BYTES {
            // Not found that far back: left unknown, so refused (the fix ends it either way).
            break;
        }
        let f = &log.name;
        let stop_at = (*f == file).then_some(pos);
        read += stop_at.unwrap_or(log.size);
        // The last group of each transaction in this file (an XID may be used again after
        // it ended): (its start, the tables it wrote).
        let mut hits: Vec<Option<(u64, Vec<String>)>> = vec![None; found.len()];
        // The group being read: (index in `found`, its start, tables so far).
        let mut group: Option<(usize, u64, Vec<String>)> = None;
        walk(conn, f, 4, PAGE, |at, info| {
            if stop_at.is_some_and(|s| at >= s) {
                return false;
            }
            if let Some(i) = found
                .iter()
                .position(|p| p.start.is_none() && is_stmt(info, "XA START", &p.xid))
            {
                group = Some((i, at, Vec::new()));
            } else if let Some((i, start, tables)) = group.as_mut() {
                if let Some(t) = table_of(info) {
                    if !tables.contains(&t) {
                        tables.push(t);
                    }
                } else if is_stmt(info, "XA PREPARE", &found[*i].xid) {
                    hits[*i] = Some((*start, std::mem::take(tables)));
                    group = None;
                }
            }
            true
        })
        .await?;
        for (p, hit) in found.iter_mut().zip(hits) {
            if let Some((start, tables)) = hit {
                p.start = Some((f.clone(), start));
                p.tables = tables;
            }
        }
        if found.iter().all(|p| p.start.is_some()) {
            break;
        }
    }
    let (theirs, refused): (Vec<_>, Vec<_>) = found
        .into_iter()
        .partition(|p| p.start.is_some() && !p.tables.iter().any(|t| ours(t)));
    for p in theirs {
        tracing::info!(xa = %p, "an XA transaction prepared before the start position is still open; it wrote no outbox table, so starting after its prepare loses nothing");
    }
    Ok(refused)
}

/// Why a start at `at` is refused while the transactions of `list` are prepared before it,
/// and the fix: end them (a first start then takes its snapshot after their outcome, so a
/// committed one's rows are in it) or, for a position set by hand (`offset_set`), a
/// position at or before their XA START.
pub(crate) fn prepared_before_error(at: &str, list: &[PreparedBefore], offset_set: bool) -> Error {
    let names = list
        .iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join("; ");
    let ends = list
        .iter()
        .map(|p| p.end_statements())
        .collect::<Vec<_>>()
        .join(" ");
    let problem = format!(
        "{} XA transaction(s) prepared before the start position {at} are still open: {names}. Their rows are in the binlog at their XA PREPARE, before {at}, so a stream from there would never read them and their XA COMMIT would publish nothing",
        list.len()
    );
    let earliest = list
        .iter()
        .filter_map(|p| p.start.as_ref())
        .min_by_key(|(f, p)| (binlog_file_seq(f), *p));
    let fix = match (offset_set, earliest) {
        (true, Some((f, p))) => format!(
            "set a position at or before their XA START (outboxd offset set --binlog-position {f}:{p}), or end them on the server first: {ends}"
        ),
        (true, None) => format!("end them on the server first: {ends}"),
        (false, _) => format!(
            "end them on the server ({ends}), then start again: a first start's snapshot then holds the rows of those committed"
        ),
    };
    Error::config(problem, fix)
}

/// The prepared XA transaction whose group starts at `file:pos` (a stored position held
/// before its prepare), if one of `open` does.
pub(crate) async fn starting_at(
    conn: &mut Conn,
    file: &str,
    pos: u64,
    open: &[Xid],
) -> Result<Option<Xid>, Error> {
    let mut hit = None;
    let mut seen = 0;
    // MySQL writes its GTID event first, then `XA START`: a few events are enough.
    walk(conn, file, pos, 3, |_, info| {
        hit = open.iter().find(|x| is_stmt(info, "XA START", x)).cloned();
        seen += 1;
        hit.is_none() && seen < 3
    })
    .await?;
    Ok(hit)
}

/// When the server wrote the event that starts at `file:pos`, from its header (`SHOW BINLOG
/// EVENTS` shows no times): a short non-blocking binlog dump as replica `server_id`.
pub(crate) async fn event_time(
    dsn: &DbDsn,
    server_id: u32,
    file: &str,
    pos: u64,
) -> Result<Option<DateTime<Utc>>, Error> {
    let mut conn = crate::db::mysql::connect_sql(dsn).await?;
    conn.query_drop("SET @mariadb_slave_capability = 4").await?;
    let mut stream = conn
        .get_binlog_stream(
            BinlogStreamRequest::new(server_id)
                .with_non_blocking()
                .with_filename(file.as_bytes())
                .with_pos(pos),
        )
        .await?;
    let mut found = None;
    // The server sends a Rotate and the file's format description first (their positions are
    // not `pos`), then the event asked for.
    for _ in 0..8 {
        let Ok(Some(ev)) = tokio::time::timeout(Duration::from_secs(5), stream.next()).await else {
            break;
        };
        let ev = ev?;
        let h = ev.header();
        let (end, size) = (h.log_pos() as u64, h.event_size() as u64);
        if end >= size && end - size == pos && h.timestamp() != 0 {
            found = Utc.timestamp_opt(h.timestamp() as i64, 0).single();
            break;
        }
    }
    let _ = stream.close().await;
    Ok(found)
}

/// Reads the events of `file` from `from` (an event's start) in pages of `page`, calling `f(start,
/// info)` for each until it returns false or the file ends; returns where reading stopped.
async fn walk(
    conn: &mut Conn,
    file: &str,
    from: u64,
    page: usize,
    mut f: impl FnMut(u64, &str) -> bool,
) -> Result<u64, Error> {
    let mut at = from;
    loop {
        let page_from = at;
        // SHOW statements take no placeholders: the file name is quoted here.
        let rows: Vec<Row> = conn
            .query(format!(
                "SHOW BINLOG EVENTS IN '{}' FROM {at} LIMIT {page}",
                file.replace('\\', "\\\\").replace('\'', "''")
            ))
            .await?;
        let n = rows.len();
        for r in &rows {
            // Pos, End_log_pos, Info (Info may hold bytes that are not UTF-8).
            let start: u64 = text(r, 1).parse().unwrap_or(at);
            let end: u64 = text(r, 4).parse().unwrap_or(0);
            if !f(start, &text(r, 5)) {
                return Ok(start);
            }
            if end > at {
                at = end;
            }
        }
        // A page that did not move on (no end positions) would repeat forever.
        if n < page || at == page_from {
            return Ok(at);
        }
    }
}

/// Whether a binlog event's Info is `verb` for `xid` (`XA START X'…',X'…',1 …`).
fn is_stmt(info: &str, verb: &str, xid: &Xid) -> bool {
    let want = format!("{verb} {xid}").to_ascii_uppercase();
    let got = info.trim_start().to_ascii_uppercase();
    got.starts_with(&want)
        && got[want.len()..]
            .chars()
            .next()
            .is_none_or(|c| c.is_whitespace() || c == ';')
}

/// The `db.table` of a table map event's Info (`table_id: 32 (db.t)`).
fn table_of(info: &str) -> Option<String> {
    let rest = info.strip_prefix("table_id: ")?;
    let open = rest.find('(')?;
    let close = rest.rfind(')')?;
    (close > open).then(|| rest[open + 1..close].to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn xid(g: &str, b: &str, format: i64) -> Xid {
        Xid {
            format,
            gtrid: g.as_bytes().to_vec(),
            bqual: b.as_bytes().to_vec(),
        }
    }

    #[test]
    fn binlog_infos_name_the_xid_and_tables() {
        let x = xid("probe1", "b2", 7);
        assert!(is_stmt(
            "XA START X'70726f626531',X'6232',7 GTID 0-1-46",
            "XA START",
            &x
        ));
        assert!(is_stmt(
            "XA PREPARE X'70726F626531',X'6232',7",
            "XA PREPARE",
            &x
        ));
        // Another format id, or a longer gtrid with the same prefix: not this one.
        assert!(!is_stmt(
            "XA PREPARE X'70726f626531',X'6232',71",
            "XA PREPARE",
            &x
        ));
        assert!(!is_stmt(
            "XA END X'70726f626531',X'6232',7",
            "XA PREPARE",
            &x
        ));
        assert_eq!(
            table_of("table_id: 32 (xa_probe.t)").as_deref(),
            Some("xa_probe.t")
        );
        assert_eq!(table_of("table_id: 32 flags: STMT_END_F"), None);
    }
}
