//! Turns binlog rows of the outbox table into events. Columns are found by name in the table
//! map's optional metadata (`binlog_row_metadata=FULL`), with the `--column` renames; types are
//! checked when the table map arrives (again after every `ALTER TABLE`, which gives a new map).
//! A row that cannot be a message becomes a poison event with the reason; a table that lost or
//! changed a mapped column, or a row image that lacks one, stops the relay with the fix.
//!
//! The table's columns and their mapping are here; a rows event's row images are read column
//! by column from the table map in `image`, the values of a row become an event in `event`,
//! and DATETIME values are read in the zone of `tz`.

use crate::outbox::{Column, ColumnMap};
use crate::Error;
use mysql_common::binlog::events::{OptionalMetaExtractor, TableMapEvent};
use mysql_common::constants::ColumnType;

mod event;
mod image;
mod tz;

pub use event::{json_text, RowContext};
pub use image::{parse_jsonb, render_jsonb, Cell, Image, Layout};
pub use tz::SourceTz;

/// The `binary` collation id: BINARY, VARBINARY and BLOB columns carry it.
const BINARY_CHARSET: u16 = 63;

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
pub(crate) struct ColumnInfo {
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
    /// Per table column: whether an event reads it (the others are only stepped over when a
    /// row image is read).
    wanted: Vec<bool>,
}

impl Mapping {
    /// Columns of the table version this mapping was made for.
    pub fn columns(&self) -> usize {
        self.columns
    }

    /// Per table column: whether an event reads it.
    pub fn wanted(&self) -> &[bool] {
        &self.wanted
    }
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
    pub(crate) fn map_columns(&self, infos: &[ColumnInfo]) -> Result<Mapping, Error> {
        let table = self.quoted();
        let find = |logical: Column,
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
                            Column::Id => "BINARY(16) NOT NULL",
                            Column::AggregateId => "BIGINT NOT NULL",
                            Column::Payload => "JSON NOT NULL",
                            Column::Headers => "JSON NULL",
                            Column::CreatedAt => "DATETIME(6) NOT NULL",
                            Column::Version => "BIGINT NULL",
                            _ => "VARCHAR(120) NOT NULL",
                        }
                    ),
                )),
            }
        };
        use Kind::*;
        let id = find(Column::Id, &[Fixed, Var], true)?.expect("required");
        let aggregate_id = find(Column::AggregateId, &[Int, Fixed, Var], true)?.expect("required");
        let topic = find(Column::Topic, &[Fixed, Var, Blob], true)?.expect("required");
        let payload = find(Column::Payload, &[Json, Blob, Var], true)?.expect("required");
        let created_at = find(Column::CreatedAt, &[DateTime, Timestamp], false)?;
        let headers = find(Column::Headers, &[Json, Blob, Var], false)?;
        let version = find(Column::Version, &[Int], false)?;
        let content_type = if self.columns.reads_content_type() {
            find(Column::ContentType, &[Fixed, Var, Blob], true)?
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
                        "the outbox table {table} has no column {:?}, which a template, --header or --envelope-field names ({{{}}})",
                        e.column, e.key
                    ),
                    format!("add the column (ALTER TABLE {table} ADD COLUMN {} VARCHAR(255) NULL) or fix the --routing-key/--exchange/--header/--envelope-field that names it", e.column),
                ));
            }
            extra.push((e.key.clone(), index));
        }
        let mut wanted = vec![false; infos.len()];
        let cols = [Some(id), Some(aggregate_id), Some(topic), Some(payload)];
        for c in cols
            .into_iter()
            .chain([created_at, headers, version, content_type])
            .flatten()
        {
            wanted[c.index] = true;
        }
        for i in extra.iter().filter_map(|(_, i)| *i) {
            wanted[i] = true;
        }
        Ok(Mapping {
            wanted,
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
