//! One row of an outbox table → an `OutboxEvent`: the mapped columns' values (as [`Cell`]s,
//! read from a row image or converted from `mysql_common` values) checked, a row that cannot
//! be a message turned into a poison event with the reason.

use super::image::{render_jsonb, Cell};
use super::{Col, Kind, Mapping, OutboxTable, SourceTz};
use crate::event::{OutboxEvent, SourcePosition};
use crate::source::contract::{self, Column, Json, Poison, PoisonReason, RowMeta, RowValues};
use crate::Error;
use bytes::Bytes;
use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use mysql_common::binlog::value::BinlogValue;
use uuid::Uuid;

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
            (Column::Id, self.id),
            (Column::AggregateId, self.aggregate_id),
            (Column::Topic, self.topic),
            (Column::Payload, self.payload),
        ];
        if let Some(c) = self.created_at {
            mapped.push((Column::CreatedAt, c));
        }
        if let Some(h) = self.headers {
            mapped.push((Column::Headers, h));
        }
        if let Some(v) = self.version {
            mapped.push((Column::Version, v));
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

    /// The event of one row decoded by `mysql_common` (the snapshot and poll mode read rows
    /// as such), whose value for table column `i` is `value(i)`.
    pub fn event_from<'v>(
        &self,
        value: impl Fn(usize) -> Option<&'v BinlogValue<'v>>,
        ctx: RowContext<'_>,
        tz: SourceTz,
    ) -> OutboxEvent {
        let cells: Vec<Option<Cell<'v>>> = (0..self.columns)
            .map(|i| value(i).map(Cell::from_binlog))
            .collect();
        self.event_cells(|i| cells.get(i).and_then(Option::as_ref), ctx, tz)
    }

    /// The event of one row whose value for table column `i` is `value(i)` (`None`: not in
    /// the row image).
    pub fn event_cells<'r, 'v: 'r>(
        &self,
        value: impl Fn(usize) -> Option<&'r Cell<'v>>,
        ctx: RowContext<'_>,
        tz: SourceTz,
    ) -> OutboxEvent {
        let row = MyRow {
            mapping: self,
            value,
            tz,
        };
        contract::event(
            &row,
            RowMeta {
                position: SourcePosition::Binlog {
                    file: ctx.file.to_string(),
                    end_pos: 0,
                    index: ctx.index,
                },
                gtid: ctx.gtid,
                committed_at: ctx.committed_at,
                table: self.label.clone(),
            },
        )
    }
}

/// One row of a mapped outbox table: `value(i)` is table column `i`'s value.
struct MyRow<'m, F> {
    mapping: &'m Mapping,
    value: F,
    tz: SourceTz,
}

impl<'r, 'v: 'r, F: Fn(usize) -> Option<&'r Cell<'v>>> MyRow<'_, F> {
    fn slot(&self, c: Col) -> Option<&'r Cell<'v>> {
        (self.value)(c.index)
    }

    /// The value of an optional column; `None` when the table lacks it or it is NULL.
    fn optional(&self, c: Option<Col>) -> Option<&'r Cell<'v>> {
        match c.map(|c| self.slot(c)) {
            None | Some(None) | Some(Some(Cell::Null)) => None,
            Some(v) => v,
        }
    }
}

impl<'r, 'v: 'r, F: Fn(usize) -> Option<&'r Cell<'v>>> RowValues for MyRow<'_, F> {
    fn id(&self, poison: &mut Poison) -> Option<Uuid> {
        let col = self.mapping.id;
        let b = match self.slot(col) {
            Some(Cell::Bytes(b)) => pad(b, col),
            other => {
                poison.push(bad(Column::Id, other));
                return None;
            }
        };
        let id = if col.binary {
            <[u8; 16]>::try_from(&*b)
                .map(Uuid::from_bytes)
                .map_err(|_| PoisonReason::UuidLength(b.len()))
        } else {
            std::str::from_utf8(&b)
                .ok()
                .and_then(|s| Uuid::parse_str(s.trim_end()).ok())
                .ok_or_else(|| PoisonReason::NotUuid(String::from_utf8_lossy(&b).into_owned()))
        };
        id.map_err(|r| poison.push(r)).ok()
    }

    fn aggregate_id(&self, poison: &mut Poison) -> String {
        let col = self.mapping.aggregate_id;
        match self.slot(col) {
            Some(Cell::Int(i)) => i.to_string(),
            Some(Cell::UInt(u)) => u.to_string(),
            Some(Cell::Bytes(b)) => {
                let b = pad(b, col);
                if col.binary && b.len() == 16 {
                    Uuid::from_bytes((&*b).try_into().expect("16 bytes")).to_string()
                } else {
                    match std::str::from_utf8(&b) {
                        Ok(s) if col.kind == Kind::Fixed && !col.binary => {
                            s.trim_end_matches(' ').to_string()
                        }
                        Ok(s) => s.to_string(),
                        Err(_) => {
                            poison.push(PoisonReason::NotUtf8(Column::AggregateId));
                            String::new()
                        }
                    }
                }
            }
            other => {
                poison.push(bad(Column::AggregateId, other));
                String::new()
            }
        }
    }

    fn topic(&self, poison: &mut Poison) -> String {
        match self.slot(self.mapping.topic) {
            Some(Cell::Bytes(b)) => match std::str::from_utf8(b) {
                Ok(s) if self.mapping.topic.kind == Kind::Fixed => {
                    s.trim_end_matches(' ').to_string()
                }
                Ok(s) => s.to_string(),
                Err(_) => {
                    poison.push(PoisonReason::NotUtf8(Column::Topic));
                    String::new()
                }
            },
            other => {
                poison.push(bad(Column::Topic, other));
                String::new()
            }
        }
    }

    fn json_payload_column(&self) -> bool {
        // MariaDB's JSON is LONGTEXT: only MySQL 8's binary JSON is known to be JSON by type.
        self.mapping.payload.kind == Kind::Json
    }

    fn opaque_payloads(&self) -> bool {
        self.mapping.opaque
    }

    fn row_content_type(&self) -> Option<Bytes> {
        match self.mapping.content_type.map(|c| self.slot(c)) {
            Some(Some(Cell::Bytes(b))) => Some(Bytes::copy_from_slice(b)),
            _ => None,
        }
    }

    fn default_content_type(&self) -> Option<&std::sync::Arc<str>> {
        self.mapping.payload_content_type.as_ref()
    }

    fn payload(&self, poison: &mut Poison) -> Json {
        json_value(self.slot(self.mapping.payload), Column::Payload).unwrap_or_else(|r| {
            poison.push(r);
            Json::Unreadable
        })
    }

    fn created_at(&self, poison: &mut Poison) -> Option<Option<DateTime<Utc>>> {
        let col = self.mapping.created_at?;
        // DATETIME is wall-clock time in the source zone; a TIMESTAMP read as a date (the
        // snapshot reads with the session zone at UTC) is UTC.
        let tz = if col.kind == Kind::Timestamp {
            SourceTz::Utc
        } else {
            self.tz
        };
        let at = match self.slot(col) {
            Some(Cell::Date(y, mo, d, h, mi, s, us)) => {
                let naive = NaiveDate::from_ymd_opt(*y as i32, *mo as u32, *d as u32)
                    .and_then(|date| date.and_hms_micro_opt(*h as u32, *mi as u32, *s as u32, *us));
                match naive {
                    Some(n) => tz
                        .to_utc(n)
                        .ok_or_else(|| PoisonReason::NoSuchLocalTime(n.to_string())),
                    None => Err(PoisonReason::InvalidDate(format!(
                        "{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{us:06}"
                    ))),
                }
            }
            // TIMESTAMP(n) from the binlog: seconds and microseconds since the epoch (the
            // same instant as its text, `seconds.micros`, reads as below).
            Some(Cell::Epoch(secs, micros)) => (0..1_000_000)
                .contains(micros)
                .then(|| {
                    Utc.timestamp_opt(i64::from(*secs), *micros as u32 * 1000)
                        .single()
                })
                .flatten()
                .ok_or_else(|| {
                    PoisonReason::NotTimestamp(
                        Cell::Epoch(*secs, *micros).epoch_text().unwrap_or_default(),
                    )
                }),
            // TIMESTAMP(n) as text: "seconds" or "seconds.micros" since the epoch.
            Some(Cell::Bytes(b)) => parse_epoch(b)
                .ok_or_else(|| PoisonReason::NotTimestamp(String::from_utf8_lossy(b).into_owned())),
            Some(Cell::Int(secs)) => Ok(Utc.timestamp_opt(*secs, 0).single().unwrap_or_default()),
            other => Err(bad(Column::CreatedAt, other)),
        };
        Some(at.map_err(|r| poison.push(r)).ok())
    }

    fn headers(&self) -> Option<Json> {
        let v = self.optional(self.mapping.headers)?;
        Some(json_value(Some(v), Column::Headers).unwrap_or(Json::Unreadable))
    }

    fn version(&self, poison: &mut Poison) -> Option<i64> {
        let v = match self.optional(self.mapping.version)? {
            Cell::Int(i) => Ok(*i),
            Cell::UInt(u) => i64::try_from(*u).map_err(|_| PoisonReason::VersionOutOfRange(*u)),
            _ => Err(PoisonReason::VersionNotInteger),
        };
        v.map_err(|r| poison.push(r)).ok()
    }

    fn extra(&self) -> Vec<(std::sync::Arc<str>, crate::event::ColumnValue)> {
        self.mapping
            .extra
            .iter()
            .filter_map(|(key, index)| {
                let v = index.and_then(&self.value)?;
                let text = value_text(v)?;
                Some((
                    key.clone(),
                    crate::event::ColumnValue {
                        text,
                        typed: value_type(v),
                    },
                ))
            })
            .collect()
    }
}

/// The type an extra column's value keeps in a header: integers (TINYINT … BIGINT, so also
/// `BOOLEAN`, which is `TINYINT(1)`: 0 or 1), `FLOAT` and `DOUBLE`; anything else is text.
fn value_type(v: &Cell<'_>) -> crate::event::Typed {
    use crate::event::Typed;
    match v {
        Cell::Int(i) => Typed::Int(*i),
        Cell::UInt(u) => i64::try_from(*u).map_or(Typed::Text, Typed::Int),
        Cell::Float(f) => Typed::Float32(*f),
        Cell::Double(f) => Typed::Float(*f),
        _ => Typed::Text,
    }
}

/// An extra column's value as text (`None` for NULL): numbers in decimal, dates in ISO form,
/// text as is (bytes that are not UTF-8 lossily), MySQL 8 JSON rendered.
fn value_text(v: &Cell<'_>) -> Option<String> {
    Some(match v {
        Cell::Null => return None,
        Cell::Bytes(b) => String::from_utf8_lossy(b).into_owned(),
        Cell::Epoch(..) => v.epoch_text()?,
        Cell::Int(i) => i.to_string(),
        Cell::UInt(u) => u.to_string(),
        Cell::Float(f) => f.to_string(),
        Cell::Double(f) => f.to_string(),
        Cell::Date(y, mo, d, h, mi, s, us) => {
            format!("{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}.{us:06}")
        }
        Cell::Time(neg, d, h, mi, s, us) => format!(
            "{}{:02}:{mi:02}:{s:02}.{us:06}",
            if *neg { "-" } else { "" },
            *d * 24 + u32::from(*h)
        ),
        Cell::Jsonb(raw) => render_jsonb(raw).ok()?,
        Cell::Decoded(BinlogValue::Jsonb(j)) => {
            serde_json::Value::try_from(j.clone()).ok()?.to_string()
        }
        Cell::Decoded(_) => return None,
    })
}

/// Pads a CHAR/BINARY value back to the column length: the binlog drops trailing 0x00 of
/// BINARY values (and trailing spaces of CHAR ones).
fn pad<'b>(b: &'b [u8], col: Col) -> std::borrow::Cow<'b, [u8]> {
    if col.kind == Kind::Fixed && b.len() < col.len {
        let mut v = b.to_vec();
        v.resize(col.len, if col.binary { 0 } else { b' ' });
        std::borrow::Cow::Owned(v)
    } else {
        std::borrow::Cow::Borrowed(b)
    }
}

/// Why a column the message needs has no usable value.
fn bad(column: Column, v: Option<&Cell<'_>>) -> PoisonReason {
    match v {
        None => PoisonReason::Missing(column),
        Some(Cell::Null) => PoisonReason::Null(column),
        Some(other) => PoisonReason::Unexpected(column, short_debug(other)),
    }
}

/// A value as `mysql_common` would print it, cut at 80 bytes.
fn short_debug(v: &Cell<'_>) -> String {
    let mut s = format!("{:?}", v.to_binlog());
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

/// A JSON-bearing column's value: text byte for byte, MySQL 8 binary JSON rendered as text.
fn json_value(v: Option<&Cell<'_>>, column: Column) -> Result<Json, PoisonReason> {
    match v {
        Some(Cell::Bytes(b)) => Ok(Json::Text(Bytes::copy_from_slice(b))),
        Some(Cell::Jsonb(raw)) => match render_jsonb(raw) {
            Ok(text) => Ok(Json::Typed(Bytes::from(text))),
            Err(e) => Err(PoisonReason::JsonUnrenderable(e)),
        },
        Some(Cell::Decoded(BinlogValue::Jsonb(j))) => {
            match serde_json::Value::try_from(j.clone()) {
                Ok(value) => Ok(Json::Typed(Bytes::from(value.to_string()))),
                Err(e) => Err(PoisonReason::JsonUnrenderable(e.to_string())),
            }
        }
        other => Err(bad(column, other)),
    }
}

/// JSON text of a payload value: text columns byte for byte (validated), MySQL 8 binary JSON
/// rendered as text.
pub fn json_text(v: Option<&BinlogValue<'_>>) -> Result<Bytes, PoisonReason> {
    match json_value(v.map(Cell::from_binlog).as_ref(), Column::Payload)? {
        Json::Text(b) if serde_json::from_slice::<serde::de::IgnoredAny>(&b).is_err() => {
            Err(PoisonReason::NotJson(Column::Payload))
        }
        Json::Text(b) | Json::Typed(b) => Ok(b),
        Json::Unreadable => Err(PoisonReason::Null(Column::Payload)),
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
    use crate::source::mysql::rows::fixed_len;

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
