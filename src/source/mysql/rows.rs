//! Turns binlog rows of the outbox table into events. Columns are found by name in the table
//! map's optional metadata (`binlog_row_metadata=FULL`), with the `--column` renames; types are
//! checked when the table map arrives (again after every `ALTER TABLE`, which gives a new map).
//! A row that cannot be a message becomes a poison event with the reason; a table that lost or
//! changed a mapped column, or a row image that lacks one, stops the relay with the fix.

use crate::event::{OutboxEvent, SourcePosition};
use crate::outbox::ColumnMap;
use crate::Error;
use bytes::Bytes;
use chrono::{DateTime, FixedOffset, NaiveDate, NaiveDateTime, TimeZone, Utc};
use mysql_common::binlog::events::{OptionalMetaExtractor, TableMapEvent};
use mysql_common::binlog::row::BinlogRow;
use mysql_common::binlog::value::BinlogValue;
use mysql_common::constants::ColumnType;
use mysql_common::value::Value;
use uuid::Uuid;

/// The `binary` collation id: BINARY, VARBINARY and BLOB columns carry it.
const BINARY_CHARSET: u16 = 63;

/// The zone `DATETIME` values are written in (`--source-time-zone`). `TIMESTAMP` values are
/// stored in UTC by the server and need none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SourceTz {
    #[default]
    Utc,
    Fixed(FixedOffset),
    Named(chrono_tz::Tz),
}

impl SourceTz {
    /// `UTC`, `+02:00`, `-0530`, or an IANA name such as `Europe/Berlin`.
    pub fn parse(s: &str) -> Result<SourceTz, Error> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("utc") || t == "Z" || t == "+00:00" || t == "00:00" {
            return Ok(SourceTz::Utc);
        }
        if let Some(sign) = t.chars().next().filter(|c| *c == '+' || *c == '-') {
            let digits: String = t[1..].chars().filter(|c| *c != ':').collect();
            if digits.len() == 4 && digits.chars().all(|c| c.is_ascii_digit()) {
                let h: i32 = digits[..2].parse().unwrap_or(99);
                let m: i32 = digits[2..].parse().unwrap_or(99);
                let secs = (h * 3600 + m * 60) * if sign == '-' { -1 } else { 1 };
                if h <= 14 && m < 60 {
                    if let Some(off) = FixedOffset::east_opt(secs) {
                        return Ok(SourceTz::Fixed(off));
                    }
                }
            }
        } else if let Ok(tz) = t.parse::<chrono_tz::Tz>() {
            return Ok(SourceTz::Named(tz));
        }
        Err(Error::config(
            format!("--source-time-zone {t:?} is not a time zone"),
            "use UTC, an offset like +02:00, or an IANA name like Europe/Berlin (the zone the producers' DATETIME values are written in)",
        ))
    }

    /// The wall-clock time in this zone at an instant.
    pub fn from_utc(&self, t: DateTime<Utc>) -> NaiveDateTime {
        match self {
            SourceTz::Utc => t.naive_utc(),
            SourceTz::Fixed(off) => t.with_timezone(off).naive_local(),
            SourceTz::Named(tz) => t.with_timezone(tz).naive_local(),
        }
    }

    /// The instant a wall-clock `DATETIME` value in this zone stands for. A time that repeats
    /// (the hour a DST change turns back) is taken as its first occurrence; a time that never
    /// existed (the hour skipped) gives `None`.
    pub fn to_utc(&self, naive: NaiveDateTime) -> Option<DateTime<Utc>> {
        match self {
            SourceTz::Utc => Some(naive.and_utc()),
            SourceTz::Fixed(off) => off
                .from_local_datetime(&naive)
                .earliest()
                .map(|t| t.with_timezone(&Utc)),
            SourceTz::Named(tz) => tz
                .from_local_datetime(&naive)
                .earliest()
                .map(|t| t.with_timezone(&Utc)),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// TINYINT … BIGINT (signed or unsigned).
    Int,
    /// CHAR / BINARY (fixed length, `len` bytes).
    Fixed,
    /// VARCHAR / VARBINARY.
    Var,
    /// TEXT / BLOB (MariaDB's JSON is LONGTEXT).
    Blob,
    /// MySQL 8 binary JSON.
    Json,
    /// DATETIME(n): wall-clock time in `--source-time-zone`.
    DateTime,
    /// TIMESTAMP(n): seconds since the epoch.
    Timestamp,
}

#[derive(Debug, Clone, Copy)]
struct Col {
    /// Index in the table (and in a full row image).
    index: usize,
    kind: Kind,
    /// Binary collation (BINARY, VARBINARY, BLOB): bytes, not text.
    binary: bool,
    /// Column length in bytes for CHAR/BINARY: the binlog strips trailing pad bytes of
    /// BINARY values (0x00) and CHAR values (spaces), so they are padded back to it.
    len: usize,
}

/// One column of the table as the relay sees it: from a table map (binlog) or from
/// `information_schema.COLUMNS` (the first-start snapshot).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnInfo {
    pub name: String,
    /// `None`: a type the relay has no use for.
    pub ty: Option<ColumnType>,
    /// Binary collation (BINARY, VARBINARY, BLOB).
    pub binary: bool,
    /// Byte length of CHAR/BINARY and VARCHAR/VARBINARY columns.
    pub len: usize,
}

/// How the logical columns sit in one version of the outbox table.
#[derive(Debug, Clone)]
pub struct Mapping {
    columns: usize,
    id: Col,
    aggregate_id: Col,
    topic: Col,
    payload: Col,
    /// `None`: the table has no created_at column; the commit time stands in.
    created_at: Option<Col>,
    headers: Option<Col>,
    version: Option<Col>,
    /// `--column content_type=<column>`: the row's payload content type.
    content_type: Option<Col>,
    /// Extra columns templates and `--header` name: key and table index (`None`: an optional
    /// one the table lacks).
    extra: Vec<(std::sync::Arc<str>, Option<usize>)>,
    /// `--payload-content-type`/a content type column: text and BLOB payloads are bytes.
    opaque: bool,
    payload_content_type: Option<std::sync::Arc<str>>,
    /// `x-outbox-table` of this table's events (several tables only).
    label: Option<std::sync::Arc<str>>,
}

/// The outbox table the relay reads: `<database>.<table>` and its column names.
#[derive(Debug, Clone)]
pub struct OutboxTable {
    pub database: String,
    pub table: String,
    pub columns: ColumnMap,
    pub tz: SourceTz,
    /// Set when the relay reads several tables: their events carry `x-outbox-table`.
    pub label: Option<std::sync::Arc<str>>,
}

impl OutboxTable {
    pub fn quoted(&self) -> String {
        format!(
            "{}.{}",
            crate::outbox::my_ident(&self.database),
            crate::outbox::my_ident(&self.table)
        )
    }

    /// Whether a table map names the outbox table.
    pub fn matches(&self, tme: &TableMapEvent<'_>) -> bool {
        tme.database_name_raw() == self.database.as_bytes()
            && tme.table_name_raw() == self.table.as_bytes()
    }

    /// Maps the logical columns onto a table map of the outbox table, by name.
    pub fn map(&self, tme: &TableMapEvent<'_>) -> Result<Mapping, Error> {
        let table = self.quoted();
        let meta = OptionalMetaExtractor::new(tme.iter_optional_meta())
            .map_err(|e| Error::Decode(format!("table map of {table}: {e}")))?;
        let names: Vec<String> = meta
            .iter_column_name()
            .map(|n| n.map(|n| n.name().into_owned()))
            .collect::<Result<_, _>>()
            .map_err(|e| Error::Decode(format!("column names in the table map of {table}: {e}")))?;
        let ncols = tme.columns_count() as usize;
        if names.len() != ncols {
            return Err(Error::config(
                format!(
                    "the binlog's table map of {table} carries no column names (binlog_row_metadata is not FULL), \
                     so columns cannot be mapped by name"
                ),
                "SET GLOBAL binlog_row_metadata = FULL; and put binlog_row_metadata=FULL under [mariadbd] (MySQL: [mysqld]) in the server's option file; then restart outboxd",
            ));
        }
        // Per-column type, charset (character columns) and length.
        let mut charsets = meta.iter_charset();
        let mut infos = Vec::with_capacity(ncols);
        for (i, name) in names.into_iter().enumerate() {
            let ty = tme.get_column_type(i).ok().flatten();
            let charset = match ty {
                Some(t) if t.is_character_type() => charsets.next().and_then(|c| c.ok()),
                _ => None,
            };
            let meta_bytes = tme.get_column_metadata(i).unwrap_or(&[]);
            let len = match ty {
                Some(ColumnType::MYSQL_TYPE_STRING) => fixed_len(meta_bytes),
                Some(ColumnType::MYSQL_TYPE_VARCHAR) | Some(ColumnType::MYSQL_TYPE_VAR_STRING) => {
                    meta_bytes
                        .get(..2)
                        .map(|b| u16::from_le_bytes([b[0], b[1]]) as usize)
                        .unwrap_or(0)
                }
                _ => 0,
            };
            infos.push(ColumnInfo {
                name,
                ty,
                binary: charset == Some(BINARY_CHARSET),
                len,
            });
        }
        self.map_columns(&infos)
    }

    /// Maps the logical columns onto the table's columns, by name (case-insensitive, as MySQL
    /// compares column names).
    pub fn map_columns(&self, infos: &[ColumnInfo]) -> Result<Mapping, Error> {
        let table = self.quoted();
        let find = |logical: &str,
                    allowed: &[Kind],
                    required: bool|
         -> Result<Option<Col>, Error> {
            let actual = self.columns.get(logical);
            let Some(index) = infos
                .iter()
                .position(|c| c.name.eq_ignore_ascii_case(actual))
            else {
                if required {
                    return Err(Error::config(
                        format!("the outbox table {table} has no column {actual:?} (the {logical} column); the relay stops rather than publish half a row"),
                        format!("ALTER TABLE {table} ADD COLUMN {actual} ... (see migrations/mysql/001_outbox.sql), or map it with --column {logical}=<column>"),
                    ));
                }
                return Ok(None);
            };
            let info = &infos[index];
            let ty = info.ty;
            let kind = ty.and_then(kind_of);
            match kind.filter(|k| allowed.contains(k)) {
                Some(kind) => Ok(Some(Col {
                    index,
                    kind,
                    binary: info.binary,
                    len: info.len,
                })),
                None => Err(Error::config(
                    format!(
                        "column {actual:?} of {table} has type {} which cannot hold the {logical} column",
                        ty.map(|t| format!("{t:?}")).unwrap_or_else(|| "unknown".into())
                    ),
                    format!(
                        "use one of the types docs/message-format.md lists for {logical} (e.g. ALTER TABLE {table} MODIFY {actual} {})",
                        match logical {
                            "id" => "BINARY(16) NOT NULL",
                            "aggregate_id" => "BIGINT NOT NULL",
                            "payload" => "JSON NOT NULL",
                            "headers" => "JSON NULL",
                            "created_at" => "DATETIME(6) NOT NULL",
                            "version" => "BIGINT NULL",
                            _ => "VARCHAR(120) NOT NULL",
                        }
                    ),
                )),
            }
        };
        use Kind::*;
        let id = find("id", &[Fixed, Var], true)?.expect("required");
        let aggregate_id = find("aggregate_id", &[Int, Fixed, Var], true)?.expect("required");
        let topic = find("topic", &[Fixed, Var, Blob], true)?.expect("required");
        let payload = find("payload", &[Json, Blob, Var], true)?.expect("required");
        let created_at = find("created_at", &[DateTime, Timestamp], false)?;
        let headers = find("headers", &[Json, Blob, Var], false)?;
        let version = find("version", &[Int], false)?;
        let content_type = if self.columns.reads_content_type() {
            find("content_type", &[Fixed, Var, Blob], true)?
        } else {
            None
        };
        let mut extra = Vec::with_capacity(self.columns.extra().len());
        for e in self.columns.extra() {
            let index = infos
                .iter()
                .position(|c| c.name.eq_ignore_ascii_case(&e.column));
            if index.is_none() && e.required {
                return Err(Error::config(
                    format!(
                        "the outbox table {table} has no column {:?}, which a template or --header names ({{{}}})",
                        e.column, e.key
                    ),
                    format!("add the column (ALTER TABLE {table} ADD COLUMN {} VARCHAR(255) NULL) or fix the --routing-key/--exchange/--header that names it", e.column),
                ));
            }
            extra.push((e.key.clone(), index));
        }
        Ok(Mapping {
            columns: infos.len(),
            id,
            aggregate_id,
            topic,
            payload,
            created_at,
            headers,
            version,
            content_type,
            extra,
            opaque: self.columns.opaque_payloads(),
            payload_content_type: self.columns.payload_content_type().cloned(),
            label: self.label.clone(),
        })
    }
}

fn kind_of(t: ColumnType) -> Option<Kind> {
    use ColumnType::*;
    Some(match t {
        MYSQL_TYPE_TINY | MYSQL_TYPE_SHORT | MYSQL_TYPE_INT24 | MYSQL_TYPE_LONG
        | MYSQL_TYPE_LONGLONG => Kind::Int,
        MYSQL_TYPE_STRING => Kind::Fixed,
        MYSQL_TYPE_VARCHAR | MYSQL_TYPE_VAR_STRING => Kind::Var,
        MYSQL_TYPE_TINY_BLOB | MYSQL_TYPE_MEDIUM_BLOB | MYSQL_TYPE_LONG_BLOB | MYSQL_TYPE_BLOB => {
            Kind::Blob
        }
        MYSQL_TYPE_JSON => Kind::Json,
        MYSQL_TYPE_DATETIME2 | MYSQL_TYPE_DATETIME => Kind::DateTime,
        MYSQL_TYPE_TIMESTAMP2 | MYSQL_TYPE_TIMESTAMP => Kind::Timestamp,
        _ => return None,
    })
}

/// The byte length of a CHAR/BINARY column from its table-map metadata (the same rule as the
/// server's `Field_string::pack_length_from_metadata`).
fn fixed_len(meta: &[u8]) -> usize {
    match meta {
        [b0, b1, ..] if *b0 >= 1 => {
            let (b0, b1) = (*b0 as usize, *b1 as usize);
            if (b0 & 0x30) != 0x30 {
                b1 | (((b0 & 0x30) ^ 0x30) << 4)
            } else {
                b1
            }
        }
        [b0, b1, ..] => u16::from_le_bytes([*b0, *b1]) as usize,
        _ => 0,
    }
}

/// Where in the binlog a row was read: file, the transaction's index counter and commit data.
pub struct RowContext<'a> {
    pub file: &'a str,
    pub index: u32,
    pub gtid: Option<String>,
    pub committed_at: Option<DateTime<Utc>>,
}

impl Mapping {
    /// Checks a write-rows event's column bitmap: every mapped column must be in the image.
    pub fn check_image(
        &self,
        present: &bitvec::slice::BitSlice<u8>,
        table: &OutboxTable,
    ) -> Result<(), Error> {
        let mut mapped = vec![
            ("id", self.id),
            ("aggregate_id", self.aggregate_id),
            ("topic", self.topic),
            ("payload", self.payload),
        ];
        if let Some(c) = self.created_at {
            mapped.push(("created_at", c));
        }
        if let Some(h) = self.headers {
            mapped.push(("headers", h));
        }
        if let Some(v) = self.version {
            mapped.push(("version", v));
        }
        for (logical, col) in mapped {
            if !present.get(col.index).map(|b| *b).unwrap_or(false) {
                return Err(Error::config(
                    format!(
                        "an insert into {} lacks the {logical} column {:?} in the binlog row image (binlog_row_image is not FULL); the relay stops rather than publish half a row",
                        table.quoted(),
                        table.columns.get(logical)
                    ),
                    "SET GLOBAL binlog_row_image = FULL; and put binlog_row_image=FULL in the server's option file; then restart outboxd",
                ));
            }
        }
        Ok(())
    }

    /// The event of one inserted row (its position's `end_pos` is filled in at commit).
    pub fn event(
        &self,
        row: &BinlogRow,
        present: &bitvec::slice::BitSlice<u8>,
        ctx: RowContext<'_>,
        tz: SourceTz,
    ) -> OutboxEvent {
        // A row holds values only for the columns in the image, in table order.
        self.event_from(
            |index| {
                if index >= self.columns || index >= present.len() {
                    return None;
                }
                row.as_ref(present[..index].count_ones())
            },
            ctx,
            tz,
        )
    }

    /// The event of one row whose value for table column `i` is `value(i)`.
    pub fn event_from<'v>(
        &self,
        value: impl Fn(usize) -> Option<&'v BinlogValue<'v>>,
        ctx: RowContext<'_>,
        tz: SourceTz,
    ) -> OutboxEvent {
        let slot = |c: Col| -> Option<&'v BinlogValue<'v>> { value(c.index) };
        let mut poison: Vec<String> = Vec::new();

        let id = match slot(self.id) {
            Some(BinlogValue::Value(Value::Bytes(b))) => {
                let b = pad(b, self.id);
                if self.id.binary {
                    match <[u8; 16]>::try_from(b.as_slice()) {
                        Ok(a) => Some(Uuid::from_bytes(a)),
                        Err(_) => {
                            poison.push(format!("id is {} bytes, not a 16-byte UUID", b.len()));
                            None
                        }
                    }
                } else {
                    match std::str::from_utf8(&b)
                        .ok()
                        .and_then(|s| Uuid::parse_str(s.trim_end()).ok())
                    {
                        Some(u) => Some(u),
                        None => {
                            poison.push(format!(
                                "id {:?} is not a UUID",
                                String::from_utf8_lossy(&b)
                            ));
                            None
                        }
                    }
                }
            }
            other => {
                poison.push(describe_bad("id", other));
                None
            }
        }
        .unwrap_or(Uuid::nil());

        let aggregate_id = match slot(self.aggregate_id) {
            Some(BinlogValue::Value(Value::Int(i))) => i.to_string(),
            Some(BinlogValue::Value(Value::UInt(u))) => u.to_string(),
            Some(BinlogValue::Value(Value::Bytes(b))) => {
                let b = pad(b, self.aggregate_id);
                if self.aggregate_id.binary && b.len() == 16 {
                    Uuid::from_bytes(b.as_slice().try_into().expect("16 bytes")).to_string()
                } else {
                    match String::from_utf8(b) {
                        Ok(s)
                            if self.aggregate_id.kind == Kind::Fixed
                                && !self.aggregate_id.binary =>
                        {
                            s.trim_end_matches(' ').to_string()
                        }
                        Ok(s) => s,
                        Err(_) => {
                            poison.push("aggregate_id is not UTF-8".into());
                            String::new()
                        }
                    }
                }
            }
            other => {
                poison.push(describe_bad("aggregate_id", other));
                String::new()
            }
        };

        let topic = match slot(self.topic) {
            Some(BinlogValue::Value(Value::Bytes(b))) => match std::str::from_utf8(b) {
                Ok(s) if self.topic.kind == Kind::Fixed => s.trim_end_matches(' ').to_string(),
                Ok(s) => s.to_string(),
                Err(_) => {
                    poison.push("topic is not UTF-8".into());
                    String::new()
                }
            },
            other => {
                poison.push(describe_bad("topic", other));
                String::new()
            }
        };
        if topic.is_empty() && !poison.iter().any(|p| p.starts_with("topic")) {
            poison.push("topic is empty: not a routing key".into());
        } else if topic.len() > 255 {
            poison.push(format!(
                "topic is {} bytes: a routing key holds at most 255",
                topic.len()
            ));
        }

        // MariaDB's JSON is LONGTEXT: only MySQL 8's binary JSON is known to be JSON by type.
        let content_type = if !self.opaque || self.payload.kind == Kind::Json {
            None
        } else {
            let row_ct = match self.content_type.map(slot) {
                Some(Some(BinlogValue::Value(Value::Bytes(b)))) => std::str::from_utf8(b)
                    .ok()
                    .map(str::trim)
                    .filter(|s| !s.is_empty())
                    .map(std::sync::Arc::<str>::from),
                _ => None,
            };
            Some(
                row_ct
                    .or_else(|| self.payload_content_type.clone())
                    .unwrap_or_else(|| "application/octet-stream".into()),
            )
        };
        let payload = match content_type.as_deref() {
            Some(ct) if !crate::source::postgres::rows::is_json_type(ct) => {
                match slot(self.payload) {
                    Some(BinlogValue::Value(Value::Bytes(b))) => Bytes::copy_from_slice(b),
                    other => {
                        poison.push(describe_bad("payload", other));
                        Bytes::new()
                    }
                }
            }
            _ => match json_text(slot(self.payload)) {
                Ok(b) => b,
                Err(why) => {
                    poison.push(format!("payload {why}"));
                    Bytes::new()
                }
            },
        };

        // DATETIME is wall-clock time in the source zone; a TIMESTAMP read as a date (the
        // snapshot reads with the session zone at UTC) is UTC.
        let tz = if self.created_at.is_some_and(|c| c.kind == Kind::Timestamp) {
            SourceTz::Utc
        } else {
            tz
        };
        let created_slot = match self.created_at {
            Some(c) => slot(c),
            // No created_at column: the commit time (a snapshot row's read time) stands in.
            None => Some(&CREATED_PLACEHOLDER),
        };
        let created_at = match created_slot {
            Some(BinlogValue::Value(Value::NULL)) if self.created_at.is_none() => {
                Some(ctx.committed_at.unwrap_or_else(Utc::now))
            }
            Some(BinlogValue::Value(Value::Date(y, mo, d, h, mi, s, us))) => {
                let naive = NaiveDate::from_ymd_opt(*y as i32, *mo as u32, *d as u32)
                    .and_then(|date| date.and_hms_micro_opt(*h as u32, *mi as u32, *s as u32, *us));
                match naive {
                    Some(n) => match tz.to_utc(n) {
                        Some(t) => Some(t),
                        None => {
                            poison.push(format!(
                                "created_at {n} does not exist in the source time zone"
                            ));
                            None
                        }
                    },
                    None => {
                        poison.push(format!(
                            "created_at {y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{us:06} is not a valid date"
                        ));
                        None
                    }
                }
            }
            Some(BinlogValue::Value(Value::Bytes(b))) => {
                // TIMESTAMP(n): "seconds" or "seconds.micros" since the epoch.
                match parse_epoch(b) {
                    Some(t) => Some(t),
                    None => {
                        poison.push(format!(
                            "created_at {:?} is not a timestamp",
                            String::from_utf8_lossy(b)
                        ));
                        None
                    }
                }
            }
            Some(BinlogValue::Value(Value::Int(secs))) => Utc.timestamp_opt(*secs, 0).single(),
            other => {
                poison.push(describe_bad("created_at", other));
                None
            }
        }
        .unwrap_or_default();

        let headers = match self.headers.map(slot) {
            None | Some(None) | Some(Some(BinlogValue::Value(Value::NULL))) => None,
            Some(v) => match json_text(v)
                .ok()
                .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
            {
                Some(serde_json::Value::Object(m)) => Some(m),
                Some(serde_json::Value::Null) => None,
                _ => {
                    poison.push("headers is not a JSON object".into());
                    None
                }
            },
        };

        let version = match self.version.map(slot) {
            None | Some(None) | Some(Some(BinlogValue::Value(Value::NULL))) => None,
            Some(Some(BinlogValue::Value(Value::Int(i)))) => Some(*i),
            Some(Some(BinlogValue::Value(Value::UInt(u)))) => match i64::try_from(*u) {
                Ok(v) => Some(v),
                Err(_) => {
                    poison.push(format!("version {u} does not fit a signed 64-bit integer"));
                    None
                }
            },
            Some(Some(_)) => {
                poison.push("version is not an integer".into());
                None
            }
        };

        let extra = self
            .extra
            .iter()
            .filter_map(|(key, index)| {
                value_text(index.and_then(&value)?).map(|v| (key.clone(), v))
            })
            .collect();

        OutboxEvent {
            id,
            aggregate_id,
            topic,
            payload,
            created_at,
            extra,
            content_type,
            position: SourcePosition::Binlog {
                file: ctx.file.to_string(),
                end_pos: 0,
                index: ctx.index,
            },
            headers,
            version,
            gtid: ctx.gtid,
            committed_at: ctx.committed_at,
            poison: if poison.is_empty() {
                None
            } else {
                Some(poison.join("; "))
            },
            table: self.label.clone(),
        }
    }
}

/// Stands for the created_at value of a table without that column (never read as a date).
static CREATED_PLACEHOLDER: BinlogValue<'static> = BinlogValue::Value(Value::NULL);

/// An extra column's value as text (`None` for NULL): numbers in decimal, dates in ISO form,
/// text as is (bytes that are not UTF-8 lossily), MySQL 8 JSON rendered.
fn value_text(v: &BinlogValue<'_>) -> Option<String> {
    Some(match v {
        BinlogValue::Value(Value::NULL) => return None,
        BinlogValue::Value(Value::Bytes(b)) => String::from_utf8_lossy(b).into_owned(),
        BinlogValue::Value(Value::Int(i)) => i.to_string(),
        BinlogValue::Value(Value::UInt(u)) => u.to_string(),
        BinlogValue::Value(Value::Float(f)) => f.to_string(),
        BinlogValue::Value(Value::Double(f)) => f.to_string(),
        BinlogValue::Value(Value::Date(y, mo, d, h, mi, s, us)) => {
            format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{us:06}")
        }
        BinlogValue::Value(Value::Time(neg, d, h, mi, s, us)) => format!(
            "{}{:02}:{mi:02}:{s:02}.{us:06}",
            if *neg { "-" } else { "" },
            *d * 24 + u32::from(*h)
        ),
        BinlogValue::Jsonb(j) => serde_json::Value::try_from(j.clone()).ok()?.to_string(),
        BinlogValue::JsonDiff(_) => return None,
    })
}

/// Pads a CHAR/BINARY value back to the column length: the binlog drops trailing 0x00 of
/// BINARY values (and trailing spaces of CHAR ones).
fn pad(b: &[u8], col: Col) -> Vec<u8> {
    let mut v = b.to_vec();
    if col.kind == Kind::Fixed && v.len() < col.len {
        v.resize(col.len, if col.binary { 0 } else { b' ' });
    }
    v
}

fn describe_bad(what: &str, v: Option<&BinlogValue<'_>>) -> String {
    match v {
        None => format!("{what}: missing from the row"),
        Some(BinlogValue::Value(Value::NULL)) => format!("{what} is NULL"),
        Some(other) => format!("{what}: unexpected value {}", short_debug(other)),
    }
}

fn short_debug(v: &BinlogValue<'_>) -> String {
    let mut s = format!("{v:?}");
    if s.len() > 80 {
        let mut cut = 80;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push('…');
    }
    s
}

/// Whether every column of a table map carries the type metadata its type needs (bytes
/// `mysql_common` indexes without checking when it decodes a row value: a corrupt table map
/// would make it panic). Checked before any row of a table map is decoded.
pub fn table_map_fits(tme: &TableMapEvent<'_>) -> Result<(), String> {
    use ColumnType::*;
    for i in 0..tme.columns_count() as usize {
        let ty = tme
            .get_column_type(i)
            .map_err(|e| format!("column {}: {e}", i + 1))?;
        let need = match ty {
            Some(
                MYSQL_TYPE_TINY_BLOB
                | MYSQL_TYPE_MEDIUM_BLOB
                | MYSQL_TYPE_LONG_BLOB
                | MYSQL_TYPE_BLOB
                | MYSQL_TYPE_GEOMETRY
                | MYSQL_TYPE_VECTOR
                | MYSQL_TYPE_DOUBLE
                | MYSQL_TYPE_FLOAT
                | MYSQL_TYPE_TIME2
                | MYSQL_TYPE_DATETIME2
                | MYSQL_TYPE_TIMESTAMP2
                | MYSQL_TYPE_JSON,
            ) => 1,
            Some(
                MYSQL_TYPE_VARCHAR
                | MYSQL_TYPE_VAR_STRING
                | MYSQL_TYPE_STRING
                | MYSQL_TYPE_BIT
                | MYSQL_TYPE_NEWDECIMAL
                | MYSQL_TYPE_ENUM
                | MYSQL_TYPE_SET,
            ) => 2,
            _ => 0,
        };
        let meta = tme.get_column_metadata(i).unwrap_or(&[]);
        if meta.len() < need {
            return Err(format!(
                "column {} ({ty:?}) has {} metadata bytes, its type needs {need}",
                i + 1,
                meta.len()
            ));
        }
        // DECIMAL(precision, scale): 1..=65 digits, scale at most 30 and the precision.
        if ty == Some(MYSQL_TYPE_NEWDECIMAL)
            && !(1..=65).contains(&meta[0]) | (meta[1] > 30) | (meta[1] > meta[0])
        {
            return Err(format!(
                "column {}: DECIMAL({}, {})",
                i + 1,
                meta[0],
                meta[1]
            ));
        }
    }
    Ok(())
}

/// JSON text of a payload/headers value: text columns byte for byte (validated), MySQL 8
/// binary JSON rendered as text.
pub fn json_text(v: Option<&BinlogValue<'_>>) -> Result<Bytes, String> {
    match v {
        Some(BinlogValue::Value(Value::Bytes(b))) => {
            if serde_json::from_slice::<serde::de::IgnoredAny>(b).is_ok() {
                Ok(Bytes::copy_from_slice(b))
            } else {
                Err("is not valid JSON".into())
            }
        }
        Some(BinlogValue::Jsonb(j)) => match serde_json::Value::try_from(j.clone()) {
            Ok(value) => Ok(Bytes::from(value.to_string())),
            Err(e) => Err(format!("binary JSON cannot be rendered: {e}")),
        },
        Some(BinlogValue::Value(Value::NULL)) => Err("is NULL".into()),
        None => Err("is missing from the row".into()),
        Some(other) => Err(format!("has an unexpected value {}", short_debug(other))),
    }
}

fn parse_epoch(b: &[u8]) -> Option<DateTime<Utc>> {
    let s = std::str::from_utf8(b).ok()?;
    let (secs, frac) = match s.split_once('.') {
        Some((a, f)) => (a, f),
        None => (s, ""),
    };
    let secs: i64 = secs.parse().ok()?;
    let micros: u32 = if frac.is_empty() {
        0
    } else {
        if frac.len() > 6 || !frac.chars().all(|c| c.is_ascii_digit()) {
            return None;
        }
        format!("{frac:0<6}").parse().ok()?
    };
    Utc.timestamp_opt(secs, micros * 1000).single()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_zones_parse_and_convert() {
        let n = NaiveDate::from_ymd_opt(2026, 6, 22)
            .unwrap()
            .and_hms_micro_opt(12, 0, 0, 123456)
            .unwrap();
        assert_eq!(
            SourceTz::parse("UTC").unwrap().to_utc(n).unwrap(),
            n.and_utc()
        );
        let plus2 = SourceTz::parse("+02:00").unwrap();
        assert_eq!(
            plus2.to_utc(n).unwrap().to_rfc3339(),
            "2026-06-22T10:00:00.123456+00:00"
        );
        let berlin = SourceTz::parse("Europe/Berlin").unwrap();
        assert_eq!(berlin.to_utc(n), plus2.to_utc(n), "CEST in June");
        // The skipped hour of the spring change does not exist.
        let gap = NaiveDate::from_ymd_opt(2026, 3, 29)
            .unwrap()
            .and_hms_opt(2, 30, 0)
            .unwrap();
        assert!(berlin.to_utc(gap).is_none());
        assert!(SourceTz::parse("Mars/Olympus").is_err());
        assert!(SourceTz::parse("+25:00").is_err());
        assert_eq!(
            SourceTz::parse("-0530").unwrap(),
            SourceTz::Fixed(FixedOffset::west_opt(5 * 3600 + 1800).unwrap())
        );
    }

    #[test]
    fn epoch_text_and_fixed_lengths() {
        assert_eq!(
            parse_epoch(b"1782129600.000123")
                .unwrap()
                .timestamp_subsec_micros(),
            123
        );
        assert_eq!(
            parse_epoch(b"1782129600.5")
                .unwrap()
                .timestamp_subsec_micros(),
            500000
        );
        assert!(parse_epoch(b"x").is_none());
        assert!(parse_epoch(b"1.1234567").is_none());
        // BINARY(16): real type 254, length 16.
        assert_eq!(fixed_len(&[254, 16]), 16);
        // CHAR(36) utf8mb4 = 144 bytes.
        assert_eq!(fixed_len(&[254, 144]), 144);
        // CHAR(255) utf8mb4 = 1020 bytes: the high bits live in the type byte.
        assert_eq!(fixed_len(&[0xce, 0xfc]), 1020);
    }
}
