//! Taking over from Debezium's MySQL or MariaDB connector (`outboxd offset set
//! --from-debezium`): its stored offset as the binlog position outboxd resumes from, so that
//! the switch publishes nothing twice and misses nothing.
//!
//! An offset without `event`/`row` is a transaction boundary: the position as it is. One with
//! them was stored while the connector was inside the transaction starting at `file:pos` (its
//! records carry the offset of the row they came from): it had emitted the rows of that
//! transaction's first `event` events (counted from its first event, as the connector counts
//! them) and the first `row` rows of the next rows event. That transaction is read here from
//! the server's binlog with outboxd's own decoder: when every one of its outbox rows was
//! emitted, outboxd resumes after it; when none was, at its start; a transaction the connector
//! stopped inside is refused with both choices (a boundary is all a position can be).

use super::decode::{span, Decoder, Step};
use super::rows::OutboxTable;
use crate::dsn::DbDsn;
use crate::Error;
use futures::StreamExt;
use mysql_async::prelude::Queryable;
use mysql_async::BinlogStreamRequest;
use std::time::Duration;

/// Where the takeover resumes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Takeover {
    /// A transaction boundary, `FILE:POS`.
    pub at: String,
    /// What the connector's offset came to, for the operator.
    pub summary: String,
}

/// How the rows of the offset's transaction split between emitted and not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub(crate) emitted: usize,
    pub total: usize,
}

/// Rows events (`WRITE`/`UPDATE`/`DELETE`, v1 and v2, MySQL's partial update, MariaDB's
/// compressed ones): the events a connector's records come from.
fn is_rows_event(kind: u8) -> bool {
    matches!(kind, 23..=25 | 30..=32 | 39) || (166..=171).contains(&kind)
}

/// The outbox rows of the transaction's events (by the connector's event index) and whether
/// the event at `event` is a rows event: which of them the connector emitted, by its restart
/// rule (the events before `event` whole, then `row` rows of the next rows event).
pub fn split(
    rows_by_event: &[(u64, usize)],
    kinds: &[u8],
    event: u64,
    row: u64,
) -> Result<Split, String> {
    if row > 0 {
        match kinds.get(event as usize) {
            Some(k) if is_rows_event(*k) => {}
            _ => {
                return Err(format!(
                    "the offset's event {event} (row {row}) is not a rows event of the transaction as outboxd reads it: the connector counted the events otherwise (a MariaDB connector with include.query=true also counts ANNOTATE_ROWS events: add --debezium-include-query)"
                ))
            }
        }
    }
    let mut s = Split {
        emitted: 0,
        total: 0,
    };
    for (i, n) in rows_by_event {
        s.total += n;
        s.emitted += match i.cmp(&event) {
            std::cmp::Ordering::Less => *n,
            std::cmp::Ordering::Equal => (*n).min(row as usize),
            std::cmp::Ordering::Greater => 0,
        };
    }
    Ok(s)
}

/// Resolves a Debezium binlog offset against the server's binlog (see the module's
/// documentation). `include_query`: the connector (MariaDB) ran with `include.query=true`, so its
/// event counts include ANNOTATE_ROWS events, which this reader is not sent.
pub async fn resolve(
    dsn: &DbDsn,
    name: &str,
    tables: Vec<OutboxTable>,
    (file, pos, event, row): (&str, u64, u64, u64),
    include_query: bool,
) -> Result<Takeover, Error> {
    if event == 0 && row == 0 {
        return Ok(Takeover {
            at: format!("{file}:{pos}"),
            summary: format!("the connector's offset is the transaction boundary {file}:{pos}"),
        });
    }
    let mut sql = super::connect_sql(dsn).await?;
    let mariadb = super::admin::settings(&mut sql).await?.mariadb;
    let annotate: Vec<u64> = if include_query && mariadb {
        let rows: Vec<mysql_async::Row> = sql
            .query(format!(
                "SHOW BINLOG EVENTS IN '{}' FROM {pos} LIMIT 100000",
                file.replace('\'', "''")
            ))
            .await?;
        rows.into_iter()
            .filter_map(|r| {
                let kind: String = r.get(2)?;
                let at: u64 = r.get(1)?;
                (kind == "Annotate_rows").then_some(at)
            })
            .collect()
    } else {
        Vec::new()
    };
    let _ = sql.disconnect().await;

    let mut conn = super::connect_sql(dsn).await?;
    if mariadb {
        // As the connector's client: GTID events, not BEGIN queries.
        conn.query_drop("SET @mariadb_slave_capability = 4").await?;
    }
    // A server id of its own: the relay's (stopped) and the connector's are left alone.
    let id = super::server_id_for(&format!("{name}:debezium-offset"));
    let mut stream = conn
        .get_binlog_stream(
            BinlogStreamRequest::new(id)
                .with_filename(file.as_bytes())
                .with_pos(pos)
                .with_non_blocking(),
        )
        .await
        .map_err(|e| {
            Error::config(
                format!("the server cannot send the binlog from the connector's position {file}:{pos}: {e}"),
                "the offset is older than the binlogs the server keeps (or names another server): outboxd cannot resume there; start over with outboxd run --snapshot since=<time of the last event Debezium published>",
            )
        })?;
    let mut decoder = Decoder::new(tables, file, None);
    let mut kinds: Vec<u8> = Vec::new();
    let mut rows_by_event: Vec<(u64, usize)> = Vec::new();
    let mut started = false;
    // Events of the transaction this reader was sent.
    let mut ours: u64 = 0;
    let end = 'read: loop {
        let next = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .map_err(|_| Error::Other("reading the binlog timed out".into()))?;
        let Some(ev) = next else {
            return Err(Error::config(
                format!("the transaction at {file}:{pos} has no end in the binlog"),
                "the connector's offset must name a transaction the server has written whole; take it again once the connector has stopped",
            ));
        };
        let ev = ev.map_err(crate::db::mysql::classify)?;
        let (start, _) = span(&ev);
        // The dump begins with the file's format description (and MariaDB's GTID list):
        // the transaction starts at the offset's position.
        started |= start == pos;
        let steps = decoder.feed(&ev)?;
        if !started {
            continue;
        }
        // The connector's count of this event: the ANNOTATE_ROWS events it was sent (and this
        // reader was not) come before it.
        let index = ours
            + annotate
                .iter()
                .filter(|a| (pos..start).contains(*a))
                .count() as u64;
        ours += 1;
        while (kinds.len() as u64) < index {
            kinds.push(ANNOTATE_ROWS);
        }
        kinds.push(ev.header().event_type_raw());
        for step in steps {
            match step {
                Step::Rows(r) => rows_by_event.push((index, r.len())),
                Step::Commit { checkpoint, .. } => match checkpoint {
                    crate::event::Checkpoint::Binlog { file, pos, .. } => break 'read (file, pos),
                    other => return Err(Error::Other(format!("unexpected checkpoint {other}"))),
                },
                _ => {}
            }
        }
    };
    let _ = stream.close().await;
    let s = split(&rows_by_event, &kinds, event, row).map_err(|problem| {
        Error::config(
            problem,
            "run offset set again with the flag, or give the position by hand with --binlog-position FILE:POS",
        )
    })?;
    let (end_file, end_pos) = end;
    let what = format!(
        "the connector's offset ({file}:{pos}, event {event}, row {row}) is inside a transaction with {} outbox row{}, {} of them published",
        s.total,
        if s.total == 1 { "" } else { "s" },
        s.emitted
    );
    if s.emitted == s.total {
        Ok(Takeover {
            at: format!("{end_file}:{end_pos}"),
            summary: format!("{what}: resuming after it"),
        })
    } else if s.emitted == 0 {
        Ok(Takeover {
            at: format!("{file}:{pos}"),
            summary: format!("{what}: resuming at its start"),
        })
    } else {
        Err(Error::config(
            format!("{what}: the connector stopped inside it, and outboxd resumes at transaction boundaries"),
            format!(
                "either publish the whole transaction again ({} repeated): outboxd offset set --binlog-position {file}:{pos}; or skip the rest of it ({} never published): outboxd offset set --binlog-position {end_file}:{end_pos}; or let the connector run until it has published the transaction and take its offset again",
                s.emitted,
                s.total - s.emitted
            ),
        ))
    }
}

/// MariaDB's ANNOTATE_ROWS event type.
const ANNOTATE_ROWS: u8 = 160;

#[cfg(test)]
mod tests {
    use super::*;

    /// A MariaDB transaction: GTID, TABLE_MAP, WRITE_ROWS (2 outbox rows), TABLE_MAP,
    /// WRITE_ROWS (1), XID.
    const KINDS: [u8; 6] = [162, 19, 30, 19, 30, 16];
    const ROWS: [(u64, usize); 2] = [(2, 2), (4, 1)];

    #[test]
    fn the_connectors_restart_rule_splits_the_transaction() {
        let at = |event, row| split(&ROWS, &KINDS, event, row).unwrap();
        assert_eq!(
            at(2, 1),
            Split {
                emitted: 1,
                total: 3
            }
        );
        assert_eq!(
            at(2, 2),
            Split {
                emitted: 2,
                total: 3
            }
        );
        assert_eq!(
            at(4, 1),
            Split {
                emitted: 3,
                total: 3
            }
        );
        assert_eq!(
            at(5, 0),
            Split {
                emitted: 3,
                total: 3
            }
        );
        assert_eq!(
            at(1, 0),
            Split {
                emitted: 0,
                total: 3
            }
        );
    }

    /// Counted otherwise (ANNOTATE_ROWS events the connector saw and this reader did not), the
    /// event would not be a rows event: refused rather than guessed.
    #[test]
    fn an_event_count_that_misses_the_rows_event_is_refused() {
        let e = split(&ROWS, &KINDS, 3, 1).unwrap_err();
        assert!(e.contains("include.query"), "{e}");
    }
}
