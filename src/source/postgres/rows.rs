//! Turns pgoutput rows of the outbox table into events: columns found by name (with the
//! `--column` renames), types checked when the relation is announced, values parsed from the
//! text format. A row that cannot be a message becomes a poison event with the reason; a table
//! that lost or changed a mapped column stops the relay with the fix.

use super::pgoutput::{Relation, Value};
use crate::event::{ColumnValue, OutboxEvent, SourcePosition, Typed};
use crate::outbox::{ColumnMap, TableName};
use crate::source::contract::{self, Column, Json, Poison, PoisonReason, RowMeta, RowValues};
use crate::Error;
use bytes::Bytes;
use chrono::{DateTime, NaiveDateTime, TimeZone, Utc};
use std::collections::HashMap;
use std::sync::Arc;
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
const BOOL_OID: u32 = 16;
const FLOAT4_OID: u32 = 700;
const FLOAT8_OID: u32 = 701;

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

/// A column's index in the tuple and its type oid.
type TypedColumn = (usize, u32);

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
    /// Extra columns templates and `--header` name: key, and tuple index and type oid (`None`:
    /// an optional one the table lacks).
    extra: Vec<(std::sync::Arc<str>, Option<TypedColumn>)>,
    /// `--payload-content-type` or a content type column: text/binary payloads are bytes.
    opaque: bool,
    /// `x-outbox-table` of this relation's events (several tables only).
    label: Option<std::sync::Arc<str>>,
}

pub(crate) struct RowMapper {
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
    pub(crate) fn new(table: TableName, columns: ColumnMap) -> Self {
        Self::for_tables(vec![table], columns)
    }

    /// A mapper for several outbox tables sharing one column map: their events carry the
    /// table's name (`x-outbox-table`) so consumers can tell them apart.
    pub(crate) fn for_tables(tables: Vec<TableName>, columns: ColumnMap) -> Self {
        RowMapper {
            tables,
            columns,
            relations: HashMap::new(),
        }
    }

    /// Learns (or re-learns after an ALTER TABLE) a relation's columns. A partitioned table
    /// published with `publish_via_partition_root` announces itself as the root: same names.
    pub(crate) fn relation(&mut self, rel: Relation) -> Result<(), Error> {
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
        let find = |logical: Column,
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
                        Column::Id => "uuid",
                        Column::Payload | Column::Headers => "jsonb",
                        Column::CreatedAt => "timestamptz",
                        Column::Version => "bigint",
                        _ => "text",
                    }),
                )),
            }
        };
        use Kind::*;
        let mut extra = Vec::with_capacity(self.columns.extra().len());
        for e in self.columns.extra() {
            let index = rel
                .columns
                .iter()
                .position(|c| c.name == e.column)
                .map(|i| (i, rel.columns[i].type_oid));
            if index.is_none() && e.required {
                return Err(Error::config(
                    format!(
                        "the outbox table {table} has no column {:?}, which a template, --header or --envelope-field names ({{{}}})",
                        e.column, e.key
                    ),
                    format!("add the column (ALTER TABLE {table} ADD COLUMN {} text) or fix the --routing-key/--exchange/--header/--envelope-field that names it", e.column),
                ));
            }
            extra.push((e.key.clone(), index));
        }
        let content_type = if self.columns.reads_content_type() {
            Some(find(Column::ContentType, &[Text], true)?.expect("required"))
        } else {
            None
        };
        let mapping = Mapping {
            id: find(Column::Id, &[Uuid, Text], true)?.expect("required"),
            aggregate_id: find(Column::AggregateId, &[Int, Text, Uuid], true)?.expect("required"),
            topic: find(Column::Topic, &[Text], true)?.expect("required"),
            payload: find(Column::Payload, &[Json, Jsonb, Text, Bytea], true)?.expect("required"),
            created_at: find(Column::CreatedAt, &[Timestamptz, Timestamp], false)?,
            headers: find(Column::Headers, &[Json, Jsonb, Text], false)?,
            version: find(Column::Version, &[Int], false)?,
            content_type,
            extra,
            opaque: self.columns.opaque_payloads(),
            label,
        };
        self.relations.insert(rel.id, Some(mapping));
        Ok(())
    }

    /// The event of an inserted row; `None` when the row is not in the outbox table.
    pub(crate) fn insert(
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
        // Snapshot rows have no commit time (0 stands for none).
        let committed_at = (commit_time_micros != 0)
            .then(|| pg_time(commit_time_micros))
            .flatten();
        let row = PgRow {
            mapping,
            tuple,
            default_content_type: self.columns.payload_content_type(),
        };
        Ok(Some(contract::event(
            &row,
            RowMeta {
                position: SourcePosition::Pg { commit_lsn, index },
                gtid: None,
                committed_at,
                table: mapping.label.clone(),
            },
        )))
    }
}

/// One pgoutput tuple (or a row read over SQL as text) of a mapped outbox relation.
struct PgRow<'a> {
    mapping: &'a Mapping,
    tuple: &'a [Value],
    default_content_type: Option<&'a Arc<str>>,
}

impl PgRow<'_> {
    /// The text of a column the message needs; `None` with the reason pushed.
    fn text(&self, (i, _): (usize, Kind), column: Column, poison: &mut Poison) -> Option<Bytes> {
        match self.tuple.get(i) {
            Some(Value::Text(b)) => Some(b.clone()),
            Some(Value::Null) => {
                poison.push(PoisonReason::Null(column));
                None
            }
            Some(other) => {
                poison.push(PoisonReason::Unexpected(column, format!("{other:?}")));
                None
            }
            None => {
                poison.push(PoisonReason::Missing(column));
                None
            }
        }
    }

    /// The same as UTF-8 text.
    fn string(&self, col: (usize, Kind), column: Column, poison: &mut Poison) -> Option<String> {
        let b = self.text(col, column, poison)?;
        match std::str::from_utf8(&b) {
            Ok(s) => Some(s.to_string()),
            Err(_) => {
                poison.push(PoisonReason::NotUtf8(column));
                None
            }
        }
    }

    /// The text of an optional column; `None` when the table lacks it or it is NULL.
    fn optional(&self, col: Option<(usize, Kind)>) -> Option<&Bytes> {
        match col.and_then(|(i, _)| self.tuple.get(i)) {
            Some(Value::Text(b)) => Some(b),
            _ => None,
        }
    }
}

impl RowValues for PgRow<'_> {
    fn id(&self, poison: &mut Poison) -> Option<Uuid> {
        let s = self.string(self.mapping.id, Column::Id, poison)?;
        match Uuid::parse_str(s.trim()) {
            Ok(u) => Some(u),
            Err(_) => {
                poison.push(PoisonReason::NotUuid(s));
                None
            }
        }
    }

    fn aggregate_id(&self, poison: &mut Poison) -> String {
        self.string(self.mapping.aggregate_id, Column::AggregateId, poison)
            .unwrap_or_default()
    }

    fn topic(&self, poison: &mut Poison) -> String {
        self.string(self.mapping.topic, Column::Topic, poison)
            .unwrap_or_default()
    }

    fn json_payload_column(&self) -> bool {
        matches!(self.mapping.payload.1, Kind::Json | Kind::Jsonb)
    }

    fn opaque_payloads(&self) -> bool {
        self.mapping.opaque
    }

    fn row_content_type(&self) -> Option<Bytes> {
        self.optional(self.mapping.content_type).cloned()
    }

    fn default_content_type(&self) -> Option<&Arc<str>> {
        self.default_content_type
    }

    fn payload(&self, poison: &mut Poison) -> Json {
        let Some(text) = self.text(self.mapping.payload, Column::Payload, poison) else {
            return Json::Unreadable;
        };
        match self.mapping.payload.1 {
            Kind::Json | Kind::Jsonb => Json::Typed(text),
            Kind::Bytea => match decode_bytea(&text) {
                Some(b) => Json::Text(b),
                None => {
                    poison.push(PoisonReason::NotBytea);
                    Json::Unreadable
                }
            },
            _ => Json::Text(text),
        }
    }

    fn created_at(&self, poison: &mut Poison) -> Option<Option<DateTime<Utc>>> {
        let col = self.mapping.created_at?;
        let s = self.string(col, Column::CreatedAt, poison);
        Some(
            s.and_then(|s| match parse_timestamp(&s, col.1 == Kind::Timestamptz) {
                Some(t) => Some(t),
                None => {
                    poison.push(PoisonReason::NotTimestamp(s));
                    None
                }
            }),
        )
    }

    fn headers(&self) -> Option<Json> {
        self.optional(self.mapping.headers)
            .map(|b| Json::Text(b.clone()))
    }

    fn version(&self, poison: &mut Poison) -> Option<i64> {
        let b = self.optional(self.mapping.version)?;
        let v = std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<i64>().ok());
        if v.is_none() {
            poison.push(PoisonReason::VersionNotInteger);
        }
        v
    }

    fn extra(&self) -> Vec<(Arc<str>, ColumnValue)> {
        self.mapping
            .extra
            .iter()
            .filter_map(|(key, col)| {
                let (i, oid) = (*col)?;
                match self.tuple.get(i) {
                    Some(Value::Text(b)) => Some((key.clone(), typed_text(b, oid))),
                    _ => None,
                }
            })
            .collect()
    }
}

/// An extra column's text and, for a boolean, integer or floating point column, its typed
/// value (Postgres' text forms: `t`/`f`, decimal, `1.5`, `Infinity`, `NaN`).
fn typed_text(b: &[u8], oid: u32) -> ColumnValue {
    let text = String::from_utf8_lossy(b).into_owned();
    let typed = match oid {
        BOOL_OID => match text.as_str() {
            "t" => Typed::Bool(true),
            "f" => Typed::Bool(false),
            _ => Typed::Text,
        },
        o if INT_OIDS.contains(&o) => text.parse().map(Typed::Int).unwrap_or(Typed::Text),
        FLOAT8_OID => text.parse().map(Typed::Float).unwrap_or(Typed::Text),
        FLOAT4_OID => text.parse().map(Typed::Float32).unwrap_or(Typed::Text),
        _ => Typed::Text,
    };
    ColumnValue { text, typed }
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
pub(crate) fn text_tuple(row: &tokio_postgres::Row) -> Vec<Value> {
    (0..row.len())
        .map(|i| match row.get::<_, Option<String>>(i) {
            Some(s) => Value::Text(Bytes::from(s)),
            None => Value::Null,
        })
        .collect()
}

/// A pgoutput timestamp (microseconds since 2000-01-01) as UTC.
pub(crate) fn pg_time(micros: i64) -> Option<DateTime<Utc>> {
    Utc.timestamp_micros(micros.saturating_add(PG_EPOCH_OFFSET_MICROS))
        .single()
}

/// Parses Postgres' ISO timestamp text. With `with_offset`, the offset in the text is used
/// (`+00`, `+05:30`, `-03:00:00`); without, the value is taken as UTC.
pub(crate) fn parse_timestamp(s: &str, with_offset: bool) -> Option<DateTime<Utc>> {
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
    use crate::source::postgres::pgoutput::Column as RelColumn;

    /// `public.outbox` with a text payload (and no other optional column).
    fn text_payload_mapper() -> RowMapper {
        let table = TableName {
            schema: Some("public".into()),
            name: "outbox".into(),
        };
        let mut mapper = RowMapper::new(table, ColumnMap::default());
        let col = |name: &str, type_oid| RelColumn {
            flags: 0,
            name: name.into(),
            type_oid,
            type_modifier: -1,
        };
        mapper
            .relation(Relation {
                id: 1,
                namespace: "public".into(),
                name: "outbox".into(),
                replica_identity: b'd',
                columns: vec![
                    col("id", UUID_OID),
                    col("aggregate_id", 25),
                    col("topic", 25),
                    col("payload", 25),
                ],
            })
            .unwrap();
        mapper
    }

    fn row(payload: Value) -> Vec<Value> {
        let text = |s: &str| Value::Text(Bytes::from(s.to_string()));
        vec![
            text("0190b1c4-7a8e-7cc4-9c1e-1d4c6a3e2f10"),
            text("a1"),
            text("order.created"),
            payload,
        ]
    }

    /// A text payload must be JSON, an empty one too (it went out as an empty body claimed to
    /// be JSON before the row contract was shared with MySQL, which refused it).
    #[test]
    fn an_empty_text_payload_is_poison() {
        let mapper = text_payload_mapper();
        let good = mapper
            .insert(1, &row(Value::Text(Bytes::from_static(b"{}"))), 16, 0, 0)
            .unwrap()
            .unwrap();
        assert_eq!(good.poison, None);
        let empty = mapper
            .insert(1, &row(Value::Text(Bytes::new())), 16, 1, 0)
            .unwrap()
            .unwrap();
        assert_eq!(empty.poison.as_deref(), Some("payload is not valid JSON"));
        let null = mapper
            .insert(1, &row(Value::Null), 16, 2, 0)
            .unwrap()
            .unwrap();
        assert_eq!(null.poison.as_deref(), Some("payload is NULL"));
    }

    /// Extra columns keep the type a header can carry: booleans from `t`/`f`, integers, floats
    /// (`Infinity` too); the text stays Postgres' (templates use it); other types are text.
    #[test]
    fn extra_columns_are_typed_by_their_oid() {
        assert_eq!(typed_text(b"t", BOOL_OID).typed, Typed::Bool(true));
        assert_eq!(typed_text(b"f", BOOL_OID).typed, Typed::Bool(false));
        assert_eq!(typed_text(b"t", BOOL_OID).text, "t");
        assert_eq!(typed_text(b"-7", 23).typed, Typed::Int(-7));
        assert_eq!(
            typed_text(b"9223372036854775807", 20).typed,
            Typed::Int(i64::MAX)
        );
        assert_eq!(typed_text(b"1.5", FLOAT8_OID).typed, Typed::Float(1.5));
        assert_eq!(typed_text(b"0.1", FLOAT4_OID).typed, Typed::Float32(0.1));
        assert_eq!(
            typed_text(b"Infinity", FLOAT8_OID).typed,
            Typed::Float(f64::INFINITY)
        );
        assert_eq!(typed_text(b"12.50", 1700).typed, Typed::Text, "numeric");
        assert_eq!(typed_text(b"x", 25).typed, Typed::Text);
    }

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
