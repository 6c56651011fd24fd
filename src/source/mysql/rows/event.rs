//! One row of an outbox table → an `OutboxEvent`: the mapped columns' values read and
//! checked, a row that cannot be a message turned into a poison event with the reason.

use super::{Col, Kind, Mapping, OutboxTable, SourceTz};
use crate::event::{OutboxEvent, SourcePosition};
use crate::Error;
use bytes::Bytes;
use chrono::{DateTime, NaiveDate, TimeZone, Utc};
use mysql_common::binlog::row::BinlogRow;
use mysql_common::binlog::value::BinlogValue;
use mysql_common::value::Value;
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
