//! What a first start's snapshot is, whichever database it reads: which existing rows it
//! publishes (`--snapshot`: [`SnapshotMode`]), what it will read of each table
//! ([`SnapshotPlan`]), and how far an interrupted one got ([`SnapshotKey`], stored with the
//! relay's state so that a restart reads only the rows after it). Reading the rows is each
//! database's own (`postgres::snapshot`, `mysql::snapshot`).

use crate::Error;
use chrono::{DateTime, Utc};

/// Which existing rows a first start publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotMode {
    /// With a `status` column: pending rows; without: nothing if empty, else refuse.
    Auto,
    All,
    Never,
    Since(DateTime<Utc>),
}

impl SnapshotMode {
    pub fn parse(s: &str) -> Result<SnapshotMode, Error> {
        let fix = "use --snapshot auto, all, never or since=2026-06-22T10:00:00Z";
        Ok(match s.trim() {
            "auto" => SnapshotMode::Auto,
            "all" => SnapshotMode::All,
            "never" => SnapshotMode::Never,
            other => match other.strip_prefix("since=") {
                Some(ts) => SnapshotMode::Since(
                    DateTime::parse_from_rfc3339(ts.trim())
                        .map_err(|e| Error::config(format!("--snapshot since={ts}: {e}"), fix))?
                        .with_timezone(&Utc),
                ),
                None => {
                    return Err(Error::config(
                        format!("--snapshot {other:?} is not a mode"),
                        fix,
                    ))
                }
            },
        })
    }
}

/// What the snapshot will read, decided before the slot is created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotPlan {
    Nothing,
    /// A WHERE clause on the table (empty = every row) and why.
    Rows {
        filter: String,
        what: String,
    },
}

/// How far an interrupted snapshot got: every row of the planned tables before `table` (an
/// index into the plan), and every row of that table up to (`created_at`, `id`) in the
/// snapshot's order, is durable in the sink. A restart reads only the rows after it, so a relay
/// that keeps dying mid-snapshot still gets through the table. The values are the source's text
/// forms (MySQL tags the id with its type); `created_at` is `None` for a table without that
/// column (Debezium's), which the snapshot reads in `id` order.
///
/// `seq` is how many snapshot rows came before the next one: the snapshot's events are numbered
/// on from it after a restart, so a row keeps the position (and with it the identity,
/// `crate::identity`) it had in the life that first published it, instead of a count that
/// starts again at zero in every life.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SnapshotKey {
    pub table: usize,
    pub created_at: Option<String>,
    pub id: String,
    /// Written by versions that numbered every life from zero: 0.
    #[serde(default)]
    pub seq: u64,
}

impl SnapshotKey {
    pub fn encode(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// A stored key; an unreadable one (it was stored by this code, so only a hand edit) starts
    /// the snapshot over, which gives duplicates, never a gap.
    pub fn decode(s: &str) -> Option<SnapshotKey> {
        let key = serde_json::from_str(s).ok();
        if key.is_none() {
            tracing::warn!(
                key = s,
                "unreadable snapshot progress: reading the table from the start"
            );
        }
        key
    }

    /// Where the snapshot's numbering goes on: after the last durable row, or from the start.
    pub(crate) fn next_index(key: Option<&SnapshotKey>) -> u64 {
        key.map_or(0, |k| k.seq)
    }

    /// The resume filter for the table at `index`: `Some(true)` to read after the key,
    /// `Some(false)` to read the whole plan, `None` when the table is done.
    pub fn applies(key: Option<&SnapshotKey>, index: usize) -> Option<bool> {
        match key {
            None => Some(false),
            Some(k) if index < k.table => None,
            Some(k) => Some(index == k.table),
        }
    }
}

/// Adds `extra` (a condition) to `filter` (empty or a `WHERE` clause).
pub(crate) fn and_where(filter: &str, extra: &str) -> String {
    if filter.trim().is_empty() {
        format!("WHERE {extra}")
    } else {
        format!("{filter} AND {extra}")
    }
}

/// Refuses `--snapshot since=…` on a table without the `created_at` column it compares.
pub(crate) fn require_created_at(
    mode: &SnapshotMode,
    table: &str,
    column: &str,
) -> Result<(), Error> {
    match mode {
        SnapshotMode::Since(_) => Err(Error::config(
            format!("--snapshot since=… reads the rows created since a time, and {table} has no {column} column"),
            "use --snapshot all (every row) or never, or name the column that holds the creation time with --column created_at=COLUMN",
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Keys stored by earlier versions (a `created_at` string, no `seq`) still read.
    #[test]
    fn keys_read_back_including_those_of_earlier_versions() {
        let k = SnapshotKey {
            table: 1,
            created_at: None,
            id: "x:0a".into(),
            seq: 42,
        };
        assert_eq!(SnapshotKey::decode(&k.encode()), Some(k));
        let old =
            SnapshotKey::decode(r#"{"table":0,"created_at":"2026-01-01 00:00:00+00","id":"7"}"#)
                .unwrap();
        assert_eq!(old.created_at.as_deref(), Some("2026-01-01 00:00:00+00"));
        assert_eq!(SnapshotKey::next_index(Some(&old)), 0);
        assert_eq!(SnapshotKey::next_index(None), 0);
    }

    #[test]
    fn modes_parse() {
        assert_eq!(SnapshotMode::parse("auto").unwrap(), SnapshotMode::Auto);
        assert_eq!(SnapshotMode::parse("never").unwrap(), SnapshotMode::Never);
        assert!(matches!(
            SnapshotMode::parse("since=2026-06-22T10:00:00+03:00").unwrap(),
            SnapshotMode::Since(t) if t.to_rfc3339() == "2026-06-22T07:00:00+00:00"
        ));
        assert!(SnapshotMode::parse("since=yesterday").is_err());
        assert!(SnapshotMode::parse("some").is_err());
    }
}
