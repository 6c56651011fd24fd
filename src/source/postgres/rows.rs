//! Turns pgoutput rows of the outbox table into events: columns found by name (with the
//! `--column` renames), types checked when the relation is announced, values parsed from the
//! text format. A row that cannot be a message becomes a poison event with the reason; a table
//! that lost or changed a mapped column stops the relay with the fix.

use super::pgoutput::{Relation, Value};
use crate::event::{OutboxEvent, SourcePosition};
use crate::outbox::{ColumnMap, TableName};
use crate::Error;
use bytes::Bytes;
use chrono::{DateTime, NaiveDateTime, TimeZone, Utc};
use std::collections::HashMap;
use uuid::Uuid;

// Type OIDs from pg_type.
const INT_OIDS: [u32; 3] = [20, 21, 23];
const TEXT_OIDS: [u32; 3] = [25, 1043, 1042];
const UUID_OID: u32 = 2950;
const JSON_OID: u32 = 114;
const JSONB_OID: u32 = 3802;
const TIMESTAMPTZ_OID: u32 = 1184;
const TIMESTAMP_OID: u32 = 1114;
const BYTEA_OID: u32 = 17;

/// Microseconds between 1970-01-01 and 2000-01-01 (Postgres' epoch).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Uuid,
    Text,
    Int,
    Json,
    Jsonb,
    Timestamptz,
    Timestamp,
    Bytea,
}

#[derive(Debug, Clone)]
struct Mapping {
    id: (usize, Kind),
    aggregate_id: (usize, Kind),
    topic: (usize, Kind),
    payload: (usize, Kind),
    /// `None`: the table has no created_at column; the commit time stands in.
    created_at: Option<(usize, Kind)>,
    headers: Option<(usize, Kind)>,
    version: Option<(usize, Kind)>,
    /// `--column content_type=<column>`: the row's payload content type.
    content_type: Option<(usize, Kind)>,
    /// Extra columns templates and `--header` name: key and tuple index (`None`: an optional
    /// one the table lacks).
    extra: Vec<(std::sync::Arc<str>, Option<usize>)>,
    /// `--payload-content-type` or a content type column: text/binary payloads are bytes.
    opaque: bool,
    /// `x-outbox-table` of this relation's events (several tables only).
    label: Option<std::sync::Arc<str>>,
}

pub struct RowMapper {
    /// The outbox tables (`--table`, one or more); inserts into other relations are skipped.
    tables: Vec<TableName>,
    columns: ColumnMap,
    relations: HashMap<u32, Option<Mapping>>,
}

fn kind_of(oid: u32) -> Option<Kind> {
    Some(match oid {
        UUID_OID => Kind::Uuid,
        JSON_OID => Kind::Json,
        JSONB_OID => Kind::Jsonb,
        TIMESTAMPTZ_OID => Kind::Timestamptz,
        TIMESTAMP_OID => Kind::Timestamp,
        BYTEA_OID => Kind::Bytea,
        o if INT_OIDS.contains(&o) => Kind::Int,
        o if TEXT_OIDS.contains(&o) => Kind::Text,
        _ => return None,
    })
}

impl RowMapper {
    pub fn new(table: TableName, columns: ColumnMap) -> Self {
        Self::for_tables(vec![table], columns)
    }

    /// A mapper for several outbox tables sharing one column map: their events carry the
    /// table's name (`x-outbox-table`) so consumers can tell them apart.
    pub fn for_tables(tables: Vec<TableName>, columns: ColumnMap) -> Self {
        RowMapper {
            tables,
            columns,
            relations: HashMap::new(),
        }
    }

    /// Learns (or re-learns after an ALTER TABLE) a relation's columns. A partitioned table
    /// published with `publish_via_partition_root` announces itself as the root: same names.
    pub fn relation(&mut self, rel: Relation) -> Result<(), Error> {
        let Some(t) = self
            .tables
            .iter()
            .find(|t| rel.namespace == t.pg_schema() && rel.name == t.name)
        else {
            self.relations.insert(rel.id, None);
            return Ok(());
        };
        let label = (self.tables.len() > 1).then(|| std::sync::Arc::from(t.to_string()));
        let table = t.pg_quoted();
        let find = |logical: &str,
                    allowed: &[Kind],
                    required: bool|
         -> Result<Option<(usize, Kind)>, Error> {
            let actual = self.columns.get(logical);
            let Some((i, col)) = rel
                .columns
                .iter()
                .enumerate()
                .find(|(_, c)| c.name == actual)
            else {
                if required {
                    return Err(Error::config(
                        format!("the outbox table {table} has no column {actual:?} (the {logical} column); the relay stops rather than publish half a row"),
                        format!("ALTER TABLE {table} ADD COLUMN ... or map it with --column {logical}=<column>"),
                    ));
                }
                return Ok(None);
            };
            match kind_of(col.type_oid).filter(|k| allowed.contains(k)) {
                Some(k) => Ok(Some((i, k))),
                None => Err(Error::config(
                    format!("column {actual:?} of {table} has type oid {} which cannot hold the {logical} column", col.type_oid),
                    format!("use one of the types docs/message-format.md lists for {logical} (e.g. ALTER TABLE {table} ALTER COLUMN {actual} TYPE {} USING ...)", match logical {
                        "id" => "uuid",
                        "payload" | "headers" => "jsonb",
                        "created_at" => "timestamptz",
                        "version" => "bigint",
                        _ => "text",
                    }),
                )),
            }
        };
        use Kind::*;
        let mut extra = Vec::with_capacity(self.columns.extra().len());
        for e in self.columns.extra() {
            let index = rel.columns.iter().position(|c| c.name == e.column);
            if index.is_none() && e.required {
                return Err(Error::config(
                    format!(
                        "the outbox table {table} has no column {:?}, which a template or --header names ({{{}}})",
                        e.column, e.key
                    ),
                    format!("add the column (ALTER TABLE {table} ADD COLUMN {} text) or fix the --routing-key/--exchange/--header that names it", e.column),
                ));
            }
            extra.push((e.key.clone(), index));
        }
        let content_type = if self.columns.reads_content_type() {
            Some(find("content_type", &[Text], true)?.expect("required"))
        } else {
            None
        };
        let mapping = Mapping {
            id: find("id", &[Uuid, Text], true)?.expect("required"),
            aggregate_id: find("aggregate_id", &[Int, Text, Uuid], true)?.expect("required"),
            topic: find("topic", &[Text], true)?.expect("required"),
            payload: find("payload", &[Json, Jsonb, Text, Bytea], true)?.expect("required"),
            created_at: find("created_at", &[Timestamptz, Timestamp], false)?,
            headers: find("headers", &[Json, Jsonb, Text], false)?,
            version: find("version", &[Int], false)?,
            content_type,
            extra,
            opaque: self.columns.opaque_payloads(),
            label,
        };
        self.relations.insert(rel.id, Some(mapping));
        Ok(())
    }

    /// The event of an inserted row; `None` when the row is not in the outbox table.
    pub fn insert(
        &self,
        relation_id: u32,
        tuple: &[Value],
        commit_lsn: u64,
        index: u32,
        commit_time_micros: i64,
    ) -> Result<Option<OutboxEvent>, Error> {
        let mapping = match self.relations.get(&relation_id) {
            Some(Some(m)) => m,
            Some(None) => return Ok(None),
            None => {
                return Err(Error::Decode(format!(
                    "insert for relation {relation_id} before its Relation message"
                )))
            }
        };
        let mut poison: Vec<String> = Vec::new();
        let text = |(i, _): (usize, Kind), what: &str, poison: &mut Vec<String>| -> Option<Bytes> {
            match tuple.get(i) {
                Some(Value::Text(b)) => Some(b.clone()),
                Some(Value::Null) => {
                    poison.push(format!("{what} is NULL"));
                    None
                }
                Some(other) => {
                    poison.push(format!("{what}: unexpected value {other:?}"));
                    None
                }
                None => {
                    poison.push(format!("{what}: missing from the row"));
                    None
                }
            }
        };
        let utf8 = |b: &Bytes, what: &str, poison: &mut Vec<String>| -> Option<String> {
            match std::str::from_utf8(b) {
                Ok(s) => Some(s.to_string()),
                Err(_) => {
                    poison.push(format!("{what} is not UTF-8"));
                    None
                }
            }
        };

        let id = text(mapping.id, "id", &mut poison)
            .and_then(|b| utf8(&b, "id", &mut poison))
            .and_then(|s| match Uuid::parse_str(s.trim()) {
                Ok(u) => Some(u),
                Err(_) => {
                    poison.push(format!("id {s:?} is not a UUID"));
                    None
                }
            })
            .unwrap_or(Uuid::nil());
        let aggregate_id = text(mapping.aggregate_id, "aggregate_id", &mut poison)
            .and_then(|b| utf8(&b, "aggregate_id", &mut poison))
            .unwrap_or_default();
        let topic = text(mapping.topic, "topic", &mut poison)
            .and_then(|b| utf8(&b, "topic", &mut poison))
            .unwrap_or_default();
        if topic.is_empty() && !poison.iter().any(|p| p.starts_with("topic")) {
            poison.push("topic is empty: not a routing key".into());
        } else if topic.len() > 255 {
            poison.push(format!(
                "topic is {} bytes: a routing key holds at most 255",
                topic.len()
            ));
        }
        let mut payload = text(mapping.payload, "payload", &mut poison).unwrap_or_default();
        if mapping.payload.1 == Kind::Bytea {
            match decode_bytea(&payload) {
                Some(b) => payload = b,
                None => poison.push("payload is not bytea text (\\x…)".into()),
            }
        }
        let json_column = matches!(mapping.payload.1, Kind::Json | Kind::Jsonb);
        let content_type = if json_column || !mapping.opaque {
            None
        } else {
            let row_ct = match mapping.content_type.and_then(|(i, _)| tuple.get(i)) {
                Some(Value::Text(b)) => std::str::from_utf8(b)
                    .ok()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(std::sync::Arc::<str>::from),
                _ => None,
            };
            Some(
                row_ct
                    .or_else(|| self.columns.payload_content_type().cloned())
                    .unwrap_or_else(|| "application/octet-stream".into()),
            )
        };
        if !json_column
            && content_type.as_deref().is_none_or(is_json_type)
            && !payload.is_empty()
            && serde_json::from_slice::<serde::de::IgnoredAny>(&payload).is_err()
        {
            poison.push("payload is not valid JSON".into());
        }
        // Snapshot rows have no commit time (0 stands for none).
        let committed_at = (commit_time_micros != 0)
            .then(|| pg_time(commit_time_micros))
            .flatten();
        let created_at = match mapping.created_at {
            Some(col) => text(col, "created_at", &mut poison)
                .and_then(|b| utf8(&b, "created_at", &mut poison))
                .and_then(|s| match parse_timestamp(&s, col.1 == Kind::Timestamptz) {
                    Some(t) => Some(t),
                    None => {
                        poison.push(format!("created_at {s:?} is not a timestamp"));
                        None
                    }
                })
                .unwrap_or_default(),
            // No created_at column: the commit time (a snapshot row's read time).
            None => committed_at.unwrap_or_else(Utc::now),
        };
        let extra = mapping
            .extra
            .iter()
            .filter_map(|(key, index)| match index.and_then(|i| tuple.get(i)) {
                Some(Value::Text(b)) => {
                    Some((key.clone(), String::from_utf8_lossy(b).into_owned()))
                }
                _ => None,
            })
            .collect();
        let headers = match mapping.headers.and_then(|(i, _)| tuple.get(i)) {
            Some(Value::Text(b)) => match serde_json::from_slice::<serde_json::Value>(b) {
                Ok(serde_json::Value::Object(m)) => Some(m),
                Ok(serde_json::Value::Null) => None,
                _ => {
                    poison.push("headers is not a JSON object".into());
                    None
                }
            },
            _ => None,
        };
        let version = match mapping.version.and_then(|(i, _)| tuple.get(i)) {
            Some(Value::Text(b)) => match std::str::from_utf8(b)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
            {
                Some(v) => Some(v),
                None => {
                    poison.push("version is not an integer".into());
                    None
                }
            },
            _ => None,
        };
        Ok(Some(OutboxEvent {
            id,
            aggregate_id,
            topic,
            payload,
            created_at,
            position: SourcePosition::Pg { commit_lsn, index },
            headers,
            version,
            gtid: None,
            committed_at,
            poison: if poison.is_empty() {
                None
            } else {
                Some(poison.join("; "))
            },
            table: mapping.label.clone(),
            extra,
            content_type,
        }))
    }
}

/// Whether a content type is JSON (`application/json`, `…+json`): such payloads must parse.
pub fn is_json_type(ct: &str) -> bool {
    let base = ct.split(';').next().unwrap_or("").trim();
    base.eq_ignore_ascii_case("application/json") || base.to_ascii_lowercase().ends_with("+json")
}

/// A bytea value in Postgres' text form (`\x` and hex digits) as its bytes.
fn decode_bytea(text: &[u8]) -> Option<Bytes> {
    let hex = text.strip_prefix(b"\\x")?;
    if hex.len() % 2 != 0 {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    let mut out = Vec::with_capacity(hex.len() / 2);
    for pair in hex.chunks(2) {
        out.push(digit(pair[0])? << 4 | digit(pair[1])?);
    }
    Some(Bytes::from(out))
}

/// A row read over SQL with every column cast to text, as the tuple pgoutput would carry: the
/// snapshot and poll mode then map and validate it exactly as the stream does.
pub fn text_tuple(row: &tokio_postgres::Row) -> Vec<Value> {
    (0..row.len())
        .map(|i| match row.get::<_, Option<String>>(i) {
            Some(s) => Value::Text(Bytes::from(s)),
            None => Value::Null,
        })
        .collect()
}

/// A pgoutput timestamp (microseconds since 2000-01-01) as UTC.
pub fn pg_time(micros: i64) -> Option<DateTime<Utc>> {
    Utc.timestamp_micros(micros.saturating_add(PG_EPOCH_OFFSET_MICROS))
        .single()
}

/// Parses Postgres' ISO timestamp text. With `with_offset`, the offset in the text is used
/// (`+00`, `+05:30`, `-03:00:00`); without, the value is taken as UTC.
pub fn parse_timestamp(s: &str, with_offset: bool) -> Option<DateTime<Utc>> {
    let s = s.trim();
    if with_offset {
        // chrono wants the offset as +HH:MM; Postgres prints +HH, +HH:MM or +HH:MM:SS.
        let split = s.rfind(['+', '-']).filter(|&i| i > 10)?;
        let (dt, off) = s.split_at(split);
        let sign = if off.starts_with('-') { -1 } else { 1 };
        let mut parts = off[1..].split(':').map(|p| p.parse::<i32>());
        let h = parts.next()?.ok()?;
        let m = parts.next().transpose().ok()?.unwrap_or(0);
        let sec = parts.next().transpose().ok()?.unwrap_or(0);
        // Checked: the text comes off the wire, and an absurd offset is no timestamp.
        let secs = h
            .checked_mul(3600)?
            .checked_add(m.checked_mul(60)?)?
            .checked_add(sec)?;
        let offset = chrono::FixedOffset::east_opt(sign * secs)?;
        let naive = NaiveDateTime::parse_from_str(dt, "%Y-%m-%d %H:%M:%S%.f").ok()?;
        offset
            .from_local_datetime(&naive)
            .single()
            .map(|t| t.with_timezone(&Utc))
    } else {
        NaiveDateTime::parse_from_str(s, "%Y-%m-%d %H:%M:%S%.f")
            .ok()
            .map(|n| n.and_utc())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_keep_their_offset() {
        let utc = parse_timestamp("2026-06-22 10:00:00.123456+00", true).unwrap();
        let ist = parse_timestamp("2026-06-22 15:30:00.123456+05:30", true).unwrap();
        let neg = parse_timestamp("2026-06-22 07:00:00.123456-03", true).unwrap();
        assert_eq!(utc, ist);
        assert_eq!(utc, neg);
        assert_eq!(utc.timestamp_subsec_micros(), 123456);
        let naive = parse_timestamp("2026-06-22 10:00:00.123456", false).unwrap();
        assert_eq!(naive, utc);
        assert!(parse_timestamp("infinity", true).is_none());
        assert!(parse_timestamp("2026-06-22 10:00:00", true).is_none());
    }
}
