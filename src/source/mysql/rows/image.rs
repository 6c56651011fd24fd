//! A rows event's row image read column by column straight from the table map: each column's
//! type and metadata become, once per table map, a [`Layout`] that knows how many bytes a
//! value of that column takes (fixed, or a length prefix of a given width); a row is then a
//! walk over the columns present in the image, past the NULL ones, that decodes only the
//! columns the relay reads (the outbox columns) into [`Cell`]s borrowing the event's bytes and
//! steps over every other by its length. Nothing is allocated per row or per column except the
//! text of a DECIMAL or YEAR the relay reads.
//!
//! The values are those `mysql_common`'s generic row decoder (`BinlogRow`) gives for the same
//! bytes (the tests compare both for every column type, on the binlog fixtures and on a live
//! MariaDB table with every type), without its per-row column descriptions. Every length is
//! checked against the bytes that are left: a corrupt image is an error, never a panic.

use mysql_common::binlog::events::{OptionalMetaExtractor, TableMapEvent};
use mysql_common::binlog::value::BinlogValue;
use mysql_common::constants::ColumnType;
use mysql_common::value::Value;
use std::borrow::Cow;

/// One column's value as the relay reads it. Bytes borrow the rows event.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell<'a> {
    Null,
    /// TINYINT … BIGINT (a BIGINT UNSIGNED above `i64::MAX` is `UInt`), ENUM (its index),
    /// TIMESTAMP of servers before 5.6 (seconds).
    Int(i64),
    UInt(u64),
    Float(f32),
    Double(f64),
    /// Character and binary strings, BLOB/TEXT, BIT, SET, GEOMETRY; DECIMAL and YEAR as text.
    Bytes(Cow<'a, [u8]>),
    /// TIMESTAMP(n): seconds and microseconds since the epoch, as stored.
    Epoch(i32, i32),
    /// DATE, DATETIME(n): year, month, day, hour, minute, second, microsecond.
    Date(u16, u8, u8, u8, u8, u8, u32),
    /// TIME(n): negative, days, hours, minutes, seconds, microseconds.
    Time(bool, u32, u8, u8, u8, u32),
    /// MySQL 8 binary JSON as stored (checked to parse when the row was read).
    Jsonb(&'a [u8]),
    /// A value another reader decoded (the snapshot's and poll mode's rows come as
    /// `mysql_common` values): only JSON ones are kept this way.
    Decoded(&'a BinlogValue<'a>),
}

impl<'a> Cell<'a> {
    /// A value decoded by `mysql_common` (the snapshot and poll mode read rows as such).
    pub fn from_binlog(v: &'a BinlogValue<'a>) -> Cell<'a> {
        match v {
            BinlogValue::Value(Value::NULL) => Cell::Null,
            BinlogValue::Value(Value::Int(i)) => Cell::Int(*i),
            BinlogValue::Value(Value::UInt(u)) => Cell::UInt(*u),
            BinlogValue::Value(Value::Float(f)) => Cell::Float(*f),
            BinlogValue::Value(Value::Double(f)) => Cell::Double(*f),
            BinlogValue::Value(Value::Bytes(b)) => Cell::Bytes(Cow::Borrowed(b)),
            BinlogValue::Value(Value::Date(y, mo, d, h, mi, s, us)) => {
                Cell::Date(*y, *mo, *d, *h, *mi, *s, *us)
            }
            BinlogValue::Value(Value::Time(neg, d, h, mi, s, us)) => {
                Cell::Time(*neg, *d, *h, *mi, *s, *us)
            }
            other => Cell::Decoded(other),
        }
    }

    /// The same value as `mysql_common`'s row decoder gives it (the equivalence tests compare
    /// these; a poison reason quotes its debug form).
    pub fn to_binlog(&self) -> BinlogValue<'a> {
        let v = match self {
            Cell::Null => Value::NULL,
            Cell::Int(i) => Value::Int(*i),
            Cell::UInt(u) => Value::UInt(*u),
            Cell::Float(f) => Value::Float(*f),
            Cell::Double(f) => Value::Double(*f),
            Cell::Bytes(b) => Value::Bytes(b.to_vec()),
            Cell::Epoch(..) => Value::Bytes(self.epoch_text().unwrap_or_default().into_bytes()),
            Cell::Date(y, mo, d, h, mi, s, us) => Value::Date(*y, *mo, *d, *h, *mi, *s, *us),
            Cell::Time(neg, d, h, mi, s, us) => Value::Time(*neg, *d, *h, *mi, *s, *us),
            Cell::Jsonb(raw) => {
                return match parse_jsonb(raw) {
                    Ok(j) => BinlogValue::Jsonb(j),
                    Err(_) => BinlogValue::Value(Value::Bytes(raw.to_vec())),
                }
            }
            Cell::Decoded(v) => return (*v).clone(),
        };
        BinlogValue::Value(v)
    }

    /// A TIMESTAMP(n) as `mysql_common` renders it: `seconds` or `seconds.micros`.
    pub fn epoch_text(&self) -> Option<String> {
        match self {
            Cell::Epoch(sec, 0) => Some(sec.to_string()),
            Cell::Epoch(sec, usec) => Some(format!("{sec}.{usec:06}")),
            _ => None,
        }
    }
}

/// MySQL 8 binary JSON parsed by `mysql_common`. Its parser and renderer trust some offsets;
/// the guard turns a panic on corrupt bytes into an error.
pub fn parse_jsonb(raw: &[u8]) -> Result<mysql_common::binlog::jsonb::Value<'_>, String> {
    use mysql_common::io::ParseBuf;
    crate::source::mysql::decode::guarded(|| {
        ParseBuf(raw)
            .parse::<mysql_common::binlog::jsonb::Value<'_>>(())
            .map_err(|e| format!("binary JSON: {e}"))
    })
}

/// MySQL 8 binary JSON rendered as JSON text (through `serde_json`, as the relay always did).
pub fn render_jsonb(raw: &[u8]) -> Result<String, String> {
    crate::source::mysql::decode::guarded(|| {
        let j = parse_jsonb(raw)?;
        serde_json::Value::try_from(j)
            .map(|v| v.to_string())
            .map_err(|e| e.to_string())
    })
}

/// How a column's values are stored in a row image.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A little-endian integer of `size` bytes (1, 2, 3, 4 or 8).
    Int {
        size: u8,
        unsigned: bool,
    },
    Float,
    Double,
    /// TIMESTAMP of servers before 5.6: 4 bytes of seconds.
    OldTimestamp,
    /// TIME before 5.6: 3 bytes, HHMMSS as a number.
    OldTime,
    /// DATETIME before 5.6: 8 bytes, YYYYMMDDHHMMSS as a number.
    OldDateTime,
    /// 1 byte: years since 1900.
    Year,
    /// DATE: 3 bytes.
    Date,
    Bit {
        bytes: u16,
    },
    Timestamp2 {
        dec: u8,
    },
    DateTime2 {
        dec: u8,
    },
    Time2 {
        dec: u8,
    },
    Decimal {
        precision: u8,
        scale: u8,
    },
    Enum {
        bytes: u8,
    },
    Set {
        bytes: u8,
    },
    /// Bytes after a little-endian length of `width` bytes: BLOB/TEXT (1–4), VARCHAR and CHAR
    /// (1 or 2), GEOMETRY, VECTOR.
    Prefixed {
        width: u8,
    },
    /// MySQL 8 binary JSON: a 4-byte length, then the value.
    Json,
    /// A type (or its metadata) the decoder cannot size: a row with a value in it is an error.
    Bad(&'static str),
}

/// Bytes of the fraction of TIME(n), DATETIME(n) and TIMESTAMP(n).
fn frac_bytes(dec: u8) -> usize {
    match dec {
        1 | 2 => 1,
        3 | 4 => 2,
        5 | 6 => 3,
        _ => 0,
    }
}

/// Bytes of a DECIMAL(precision, scale) value: 4 per 9 digits, fewer for the rest, on each
/// side of the point (the server's `decimal_bin_size`).
fn decimal_bytes(precision: u8, scale: u8) -> usize {
    const DIG_TO_BYTES: [usize; 10] = [0, 1, 1, 2, 2, 3, 3, 4, 4, 4];
    let (intg, frac) = ((precision - scale) as usize, scale as usize);
    (intg / 9) * 4 + DIG_TO_BYTES[intg % 9] + (frac / 9) * 4 + DIG_TO_BYTES[frac % 9]
}

impl Kind {
    /// Where the value starts (after its length prefix) and its length, in the bytes `b` that
    /// start with it; `Err` if they are fewer than it needs.
    fn span(self, b: &[u8]) -> Result<(usize, usize), String> {
        let fixed = |n: usize| Ok((0, n));
        match self {
            Kind::Int { size, .. } => fixed(size as usize),
            Kind::Float | Kind::OldTimestamp => fixed(4),
            Kind::Double | Kind::OldDateTime => fixed(8),
            Kind::OldTime | Kind::Date => fixed(3),
            Kind::Year => fixed(1),
            Kind::Bit { bytes } => fixed(bytes as usize),
            Kind::Timestamp2 { dec } => fixed(4 + frac_bytes(dec)),
            Kind::DateTime2 { dec } => fixed(5 + frac_bytes(dec)),
            Kind::Time2 { dec } => fixed(3 + frac_bytes(dec)),
            Kind::Decimal { precision, scale } => fixed(decimal_bytes(precision, scale)),
            Kind::Enum { bytes } | Kind::Set { bytes } => fixed(bytes as usize),
            Kind::Prefixed { width } => {
                let w = width as usize;
                let p = b
                    .get(..w)
                    .ok_or_else(|| format!("a {w}-byte length prefix, {} bytes left", b.len()))?;
                let mut n = [0u8; 4];
                n[..w].copy_from_slice(p);
                Ok((w, u32::from_le_bytes(n) as usize))
            }
            Kind::Json => {
                let p = b
                    .get(..4)
                    .ok_or_else(|| format!("a 4-byte JSON length, {} bytes left", b.len()))?;
                Ok((4, u32::from_le_bytes([p[0], p[1], p[2], p[3]]) as usize))
            }
            Kind::Bad(why) => Err(why.to_string()),
        }
    }

    /// The value in `b` (exactly its bytes, after any length prefix).
    fn decode(self, b: &[u8]) -> Result<Cell<'_>, String> {
        let le = |b: &[u8]| {
            let mut a = [0u8; 8];
            a[..b.len()].copy_from_slice(b);
            u64::from_le_bytes(a)
        };
        let be = |b: &[u8]| b.iter().fold(0u64, |acc, &x| (acc << 8) | x as u64);
        Ok(match self {
            Kind::Int { size, unsigned } => {
                let raw = le(b);
                match (size, unsigned) {
                    (8, false) => Cell::Int(raw as i64),
                    (8, true) => i64::try_from(raw).map_or(Cell::UInt(raw), Cell::Int),
                    (_, true) => Cell::Int(raw as i64),
                    // Sign-extend from `size` bytes (`mysql_common` 0.37 does not for a
                    // MEDIUMINT: it reads -1 as 16777215).
                    (_, false) => {
                        let shift = 64 - 8 * size as u32;
                        Cell::Int(((raw << shift) as i64) >> shift)
                    }
                }
            }
            Kind::Float => Cell::Float(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            Kind::Double => Cell::Double(f64::from_bits(le(b))),
            Kind::OldTimestamp => Cell::Int(le(b) as i64),
            Kind::OldTime => {
                let t = le(b) as u32;
                Cell::Time(
                    false,
                    0,
                    (t / 10000) as u8,
                    ((t % 10000) / 100) as u8,
                    (t % 100) as u8,
                    0,
                )
            }
            Kind::OldDateTime => {
                let raw = le(b);
                let (d, t) = (raw / 1_000_000, raw % 1_000_000);
                Cell::Date(
                    (d / 10000) as u16,
                    ((d % 10000) / 100) as u8,
                    (d % 100) as u8,
                    (t / 10000) as u8,
                    ((t % 10000) / 100) as u8,
                    (t % 100) as u8,
                    0,
                )
            }
            Kind::Year => Cell::Bytes(Cow::Owned((1900 + b[0] as i32).to_string().into_bytes())),
            Kind::Date => {
                let t = le(b) as u32;
                Cell::Date(
                    (t >> 9) as u16,
                    ((t >> 5) & 15) as u8,
                    (t & 31) as u8,
                    0,
                    0,
                    0,
                    0,
                )
            }
            Kind::Bit { .. } | Kind::Set { .. } | Kind::Prefixed { .. } => {
                Cell::Bytes(Cow::Borrowed(b))
            }
            Kind::Enum { .. } => Cell::Int(le(b) as i64),
            Kind::Timestamp2 { dec } => {
                let sec = u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as i32;
                Cell::Epoch(sec, frac_micros(dec, &b[4..]))
            }
            Kind::DateTime2 { dec } => {
                let int = be(&b[..5]) as i64 - 0x80_0000_0000;
                let packed =
                    (((int as u64) << 24) as i64).wrapping_add(frac_micros(dec, &b[5..]) as i64);
                datetime(packed)
            }
            Kind::Time2 { dec } => time(time_packed(dec, b)),
            Kind::Decimal { precision, scale } => {
                if !decimal_groups_fit(b, precision, scale) {
                    return Err("DECIMAL: a digit group out of its range (corrupt)".into());
                }
                let d = mysql_common::binlog::decimal::Decimal::read_bin(
                    b,
                    precision as usize,
                    scale as usize,
                    false,
                )
                .map_err(|e| format!("DECIMAL: {e}"))?;
                Cell::Bytes(Cow::Owned(d.to_string().into_bytes()))
            }
            Kind::Json => {
                parse_jsonb(b)?;
                Cell::Jsonb(b)
            }
            Kind::Bad(why) => return Err(why.to_string()),
        })
    }
}

/// Whether every digit group of a DECIMAL value holds no more digits than it may: what
/// `mysql_common`'s reader assumes (it multiplies the last group up to nine digits and
/// overflows on a corrupt one).
fn decimal_groups_fit(b: &[u8], precision: u8, scale: u8) -> bool {
    const DIG_TO_BYTES: [usize; 10] = [0, 1, 1, 2, 2, 3, 3, 4, 4, 4];
    let (intg, frac) = ((precision - scale) as usize, scale as usize);
    // The sign is the first bit, set for positive values; negative ones are stored inverted.
    let mask = if b.first().is_some_and(|x| x & 0x80 == 0) {
        0xff
    } else {
        0
    };
    let groups = std::iter::once(intg % 9)
        .chain(std::iter::repeat_n(9, intg / 9 + frac / 9))
        .chain(std::iter::once(frac % 9));
    let mut at = 0;
    for digits in groups.filter(|&d| d > 0) {
        let n = DIG_TO_BYTES[digits];
        let Some(group) = b.get(at..at + n) else {
            return false;
        };
        let mut v: u64 = 0;
        for (k, &x) in group.iter().enumerate() {
            let x = if at + k == 0 { x ^ 0x80 } else { x };
            v = (v << 8) | u64::from(x ^ mask);
        }
        if v >= 10u64.pow(digits as u32) {
            return false;
        }
        at += n;
    }
    true
}

/// The signed big-endian fraction of DATETIME(n)/TIMESTAMP(n) in microseconds.
fn frac_micros(dec: u8, b: &[u8]) -> i32 {
    match dec {
        1 | 2 => b[0] as i8 as i32 * 10_000,
        3 | 4 => i16::from_be_bytes([b[0], b[1]]) as i32 * 100,
        // Sign-extended 24 bits.
        5 | 6 => (i32::from_be_bytes([b[0], b[1], b[2], 0])) >> 8,
        _ => 0,
    }
}

/// A DATETIME(n) from its packed form (`datetime_from_packed` of the server).
fn datetime(mut packed: i64) -> Cell<'static> {
    packed = packed.wrapping_abs();
    let usec = packed % (1 << 24);
    let ymdhms = packed >> 24;
    let ymd = ymdhms >> 17;
    let ym = ymd >> 5;
    let hms = ymdhms % (1 << 17);
    Cell::Date(
        (ym / 13) as u32 as u16,
        (ym % 13) as u8,
        (ymd % (1 << 5)) as u8,
        (hms >> 12) as u32 as u8,
        ((hms >> 6) % (1 << 6)) as u8,
        (hms % (1 << 6)) as u8,
        usec as u32,
    )
}

/// The packed form of a TIME(n) value (`my_time_packed_from_binary` of the server).
fn time_packed(dec: u8, b: &[u8]) -> i64 {
    let int = ((b[0] as i64) << 16 | (b[1] as i64) << 8 | b[2] as i64) - 0x80_0000;
    let make = |i: i64, f: i64| (((i as u64) << 24) as i64).wrapping_add(f);
    match dec {
        // The fraction of a negative value counts down from the next whole second, as the
        // server reads it (`mysql_common` 0.37 subtracts in unsigned arithmetic here and gets
        // these values wrong).
        1 | 2 => {
            let (mut int, mut frac) = (int, b[3] as i64);
            if int < 0 && frac > 0 {
                int += 1;
                frac -= 0x100;
            }
            make(int, frac * 10_000)
        }
        3 | 4 => {
            let (mut int, mut frac) = (int, u16::from_be_bytes([b[3], b[4]]) as i32);
            if int < 0 && frac > 0 {
                int += 1;
                frac -= 0x10000;
            }
            make(int, (frac * 100) as i64)
        }
        5 | 6 => {
            let raw = b[..6].iter().fold(0i64, |acc, &x| (acc << 8) | x as i64);
            raw - 0x8000_0000_0000
        }
        _ => make(int, 0),
    }
}

/// A TIME(n) from its packed form (`time_from_packed`).
fn time(mut packed: i64) -> Cell<'static> {
    let neg = packed < 0;
    if neg {
        packed = packed.wrapping_neg();
    }
    let hms = packed >> 24;
    let h = ((hms >> 12) as u32) % (1 << 10);
    Cell::Time(
        neg,
        h / 24,
        (h % 24) as u8,
        (((hms >> 6) as u32) % (1 << 6)) as u8,
        ((hms as u32) % (1 << 6)) as u8,
        (packed % (1 << 24)) as u32,
    )
}

/// TYPED_ARRAY (a multi-valued index's column) holds its element type in its metadata.
fn element_type(ty: ColumnType, m: &[u8]) -> ColumnType {
    if ty == ColumnType::MYSQL_TYPE_TYPED_ARRAY {
        m.first()
            .and_then(|&b| ColumnType::try_from(b).ok())
            .unwrap_or(ty)
    } else {
        ty
    }
}

/// How values of a column of type `ty` with type metadata `m` are stored.
fn kind_of(ty: ColumnType, m: &[u8], unsigned: bool) -> Kind {
    use ColumnType::*;
    let m0 = m.first().copied();
    let m1 = m.get(1).copied();
    let int = |size: u8| Kind::Int { size, unsigned };
    let need = |k: Option<Kind>| k.unwrap_or(Kind::Bad("its type metadata is missing"));
    match ty {
        MYSQL_TYPE_TINY => int(1),
        MYSQL_TYPE_SHORT => int(2),
        MYSQL_TYPE_INT24 => int(3),
        MYSQL_TYPE_LONG => int(4),
        MYSQL_TYPE_LONGLONG => int(8),
        MYSQL_TYPE_FLOAT => Kind::Float,
        MYSQL_TYPE_DOUBLE => Kind::Double,
        MYSQL_TYPE_TIMESTAMP => Kind::OldTimestamp,
        MYSQL_TYPE_TIME => Kind::OldTime,
        MYSQL_TYPE_DATETIME => Kind::OldDateTime,
        MYSQL_TYPE_YEAR => Kind::Year,
        MYSQL_TYPE_NEWDATE | MYSQL_TYPE_DATE => Kind::Date,
        MYSQL_TYPE_BIT => need(m0.zip(m1).map(|(bits, bytes)| Kind::Bit {
            bytes: (bytes as u16 * 8 + bits as u16).div_ceil(8),
        })),
        MYSQL_TYPE_TIMESTAMP2 => need(m0.map(|dec| Kind::Timestamp2 { dec })),
        MYSQL_TYPE_DATETIME2 => need(m0.map(|dec| Kind::DateTime2 { dec })),
        MYSQL_TYPE_TIME2 => need(m0.map(|dec| Kind::Time2 { dec })),
        MYSQL_TYPE_NEWDECIMAL => match (m0, m1) {
            (Some(precision), Some(scale)) if scale <= precision => {
                Kind::Decimal { precision, scale }
            }
            (Some(_), Some(_)) => Kind::Bad("DECIMAL with a scale above its precision"),
            _ => Kind::Bad("its type metadata is missing"),
        },
        MYSQL_TYPE_ENUM => match m1 {
            Some(bytes @ (1 | 2)) => Kind::Enum { bytes },
            _ => Kind::Bad("Unknown ENUM"),
        },
        MYSQL_TYPE_SET => need(m1.map(|bytes| Kind::Set { bytes })),
        MYSQL_TYPE_TINY_BLOB
        | MYSQL_TYPE_MEDIUM_BLOB
        | MYSQL_TYPE_LONG_BLOB
        | MYSQL_TYPE_BLOB
        | MYSQL_TYPE_GEOMETRY
        | MYSQL_TYPE_VECTOR => match m0 {
            Some(width @ 1..=4) => Kind::Prefixed { width },
            _ => Kind::Bad("Unknown BLOB"),
        },
        // The length prefix is 2 bytes when the column's maximum byte length is 256 or more.
        MYSQL_TYPE_VARCHAR | MYSQL_TYPE_VAR_STRING => {
            need(m0.zip(m1).map(|(lo, hi)| Kind::Prefixed {
                width: if u16::from_le_bytes([lo, hi]) < 256 {
                    1
                } else {
                    2
                },
            }))
        }
        MYSQL_TYPE_STRING => need((m.len() >= 2).then(|| Kind::Prefixed {
            width: if super::fixed_len(m) < 256 { 1 } else { 2 },
        })),
        MYSQL_TYPE_JSON => Kind::Json,
        _ => Kind::Bad("Don't know how to handle column"),
    }
}

/// Every column of one table map: how its values are stored.
#[derive(Debug, Clone)]
pub struct Layout {
    kinds: Vec<Kind>,
}

impl Layout {
    /// The layout of a table map's columns (types, metadata, and the signedness of numeric
    /// columns from the optional metadata; without it integers read as signed, as
    /// `mysql_common` reads them).
    pub fn new(tme: &TableMapEvent<'_>) -> Result<Layout, String> {
        let meta = OptionalMetaExtractor::new(tme.iter_optional_meta())
            .map_err(|e| format!("table map optional metadata: {e}"))?;
        let mut unsigned = meta.iter_signedness();
        let n = tme.columns_count() as usize;
        let mut kinds = Vec::with_capacity(n);
        for i in 0..n {
            let kind = match tme.get_column_type(i) {
                Ok(Some(ty)) => {
                    let m = tme.get_column_metadata(i).unwrap_or(&[]);
                    // Signedness is listed for the numeric columns only, in order.
                    let is_unsigned = ty.is_numeric_type() && unsigned.next().unwrap_or(false);
                    kind_of(element_type(ty, m), m, is_unsigned)
                }
                _ => Kind::Bad("no column type"),
            };
            kinds.push(kind);
        }
        Ok(Layout { kinds })
    }

    /// The layout of columns given by type, type metadata and signedness (tests, fuzzing).
    pub fn from_columns(columns: &[(ColumnType, &[u8], bool)]) -> Layout {
        Layout {
            kinds: columns
                .iter()
                .map(|&(ty, m, unsigned)| kind_of(element_type(ty, m), m, unsigned))
                .collect(),
        }
    }

    /// Columns in the table map.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// The columns an image holds (its column bitmap, `present`): read once per rows event.
    pub fn image(&self, present: &bitvec::slice::BitSlice<u8>) -> Result<Image, String> {
        if present.len() > self.kinds.len() {
            return Err(format!(
                "the rows event has {} columns, its table map {}",
                present.len(),
                self.kinds.len()
            ));
        }
        let columns: Vec<(u32, Kind)> = present
            .iter_ones()
            .map(|i| (i as u32, self.kinds[i]))
            .collect();
        Ok(Image {
            null_bytes: columns.len().div_ceil(8),
            columns,
        })
    }
}

/// The columns one rows event's images hold, in table order, with their kinds.
#[derive(Debug)]
pub struct Image {
    columns: Vec<(u32, Kind)>,
    null_bytes: usize,
}

impl Image {
    /// Reads the row image at the start of `data`: `cells[i]` becomes table column `i`'s value
    /// when `wanted[i]` (`None` when the image lacks it), every other column is stepped over.
    /// Returns the bytes the image took (always at least one: its NULL bitmap).
    pub fn read<'a>(
        &self,
        data: &'a [u8],
        wanted: &[bool],
        cells: &mut [Option<Cell<'a>>],
    ) -> Result<usize, String> {
        for c in cells.iter_mut() {
            *c = None;
        }
        if self.columns.is_empty() {
            return Err("a row image without columns".into());
        }
        let nulls = data.get(..self.null_bytes).ok_or_else(|| {
            format!(
                "the NULL bitmap needs {} bytes, {} left",
                self.null_bytes,
                data.len()
            )
        })?;
        let mut at = self.null_bytes;
        for (k, &(i, kind)) in self.columns.iter().enumerate() {
            let i = i as usize;
            let want = wanted.get(i).copied().unwrap_or(false) && i < cells.len();
            if nulls[k / 8] & (1 << (k % 8)) != 0 {
                if want {
                    cells[i] = Some(Cell::Null);
                }
                continue;
            }
            let rest = &data[at..];
            let (skip, len) = kind
                .span(rest)
                .map_err(|m| format!("column {}: {m}", i + 1))?;
            let end = skip
                .checked_add(len)
                .filter(|&e| e <= rest.len())
                .ok_or_else(|| {
                    format!(
                        "column {}: its value claims {len} bytes, {} left",
                        i + 1,
                        rest.len() - skip
                    )
                })?;
            if want {
                cells[i] = Some(
                    kind.decode(&rest[skip..end])
                        .map_err(|m| format!("column {}: {m}", i + 1))?,
                );
            }
            at += end;
        }
        Ok(at)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mysql_common::io::ParseBuf;
    use proptest::prelude::*;
    use ColumnType::*;

    /// Every column type a row image can hold, with metadata choices that matter for it.
    fn types() -> Vec<(ColumnType, Vec<[u8; 2]>)> {
        vec![
            (MYSQL_TYPE_TINY, vec![[0, 0]]),
            (MYSQL_TYPE_SHORT, vec![[0, 0]]),
            (MYSQL_TYPE_INT24, vec![[0, 0]]),
            (MYSQL_TYPE_LONG, vec![[0, 0]]),
            (MYSQL_TYPE_LONGLONG, vec![[0, 0]]),
            (MYSQL_TYPE_FLOAT, vec![[4, 0]]),
            (MYSQL_TYPE_DOUBLE, vec![[8, 0]]),
            (MYSQL_TYPE_TIMESTAMP, vec![[0, 0]]),
            (MYSQL_TYPE_TIME, vec![[0, 0]]),
            (MYSQL_TYPE_DATETIME, vec![[0, 0]]),
            (MYSQL_TYPE_YEAR, vec![[0, 0]]),
            (MYSQL_TYPE_NEWDATE, vec![[0, 0]]),
            (MYSQL_TYPE_BIT, vec![[1, 0], [0, 1], [5, 1], [0, 8], [7, 7]]),
            (MYSQL_TYPE_TIMESTAMP2, (0..=7).map(|d| [d, 0]).collect()),
            (MYSQL_TYPE_DATETIME2, (0..=7).map(|d| [d, 0]).collect()),
            (MYSQL_TYPE_TIME2, (0..=7).map(|d| [d, 0]).collect()),
            (
                MYSQL_TYPE_NEWDECIMAL,
                vec![
                    [1, 0],
                    [5, 2],
                    [10, 2],
                    [9, 9],
                    [18, 9],
                    [20, 10],
                    [65, 30],
                    [65, 0],
                ],
            ),
            (MYSQL_TYPE_ENUM, vec![[247, 1], [247, 2], [247, 3]]),
            (MYSQL_TYPE_SET, vec![[248, 1], [248, 2], [248, 8]]),
            (
                MYSQL_TYPE_BLOB,
                vec![[1, 0], [2, 0], [3, 0], [4, 0], [5, 0]],
            ),
            (MYSQL_TYPE_GEOMETRY, vec![[4, 0]]),
            (
                MYSQL_TYPE_VARCHAR,
                vec![[10, 0], [255, 0], [0, 1], [0xb0, 4]],
            ),
            (MYSQL_TYPE_VAR_STRING, vec![[40, 0], [44, 1]]),
            (
                MYSQL_TYPE_STRING,
                vec![[254, 16], [254, 144], [254, 255], [0xce, 0xfc], [0, 1]],
            ),
            (MYSQL_TYPE_JSON, vec![[4, 0]]),
        ]
    }

    /// `mysql_common`'s value decoder on the same bytes: the value and the bytes it took, an
    /// error, or `None` when it panicked.
    fn theirs(
        ty: ColumnType,
        meta: &[u8],
        unsigned: bool,
        bytes: &[u8],
    ) -> Option<Result<(String, usize), ()>> {
        let r = std::panic::catch_unwind(|| {
            let mut buf = ParseBuf(bytes);
            buf.parse::<BinlogValue<'_>>((ty, meta, unsigned, false))
                .map(|v| (format!("{v:?}"), bytes.len() - buf.len()))
                .map_err(|_| ())
        });
        r.ok()
    }

    /// The relay's reader on the same bytes.
    fn ours(
        ty: ColumnType,
        meta: &[u8],
        unsigned: bool,
        bytes: &[u8],
    ) -> Result<(String, usize), String> {
        let kind = kind_of(element_type(ty, meta), meta, unsigned);
        let (skip, len) = kind.span(bytes)?;
        let end = skip + len;
        if end > bytes.len() {
            return Err("short".into());
        }
        let cell = kind.decode(&bytes[skip..end])?;
        Ok((format!("{:?}", cell.to_binlog()), end))
    }

    fn case() -> impl Strategy<Value = (ColumnType, [u8; 2], bool, Vec<u8>)> {
        let all = types();
        (
            0..all.len(),
            any::<prop::sample::Index>(),
            any::<bool>(),
            prop::collection::vec(any::<u8>(), 0..48),
            any::<bool>(),
        )
            .prop_map(move |(t, m, unsigned, mut bytes, framed)| {
                let (ty, metas) = &all[t];
                let meta = metas[m.index(metas.len())];
                // Half the time a length prefix that fits what follows, so that the values
                // behind length prefixes are compared too, not only their errors.
                let kind = kind_of(*ty, &meta, unsigned);
                if framed {
                    let width = match kind {
                        Kind::Prefixed { width } => Some(width as usize),
                        Kind::Json => Some(4),
                        _ => None,
                    };
                    if let Some(w) = width {
                        let n = (bytes.len() as u32).to_le_bytes();
                        bytes.splice(0..0, n[..w].iter().copied());
                        if w == 1 && bytes.len() > 256 {
                            bytes.truncate(256);
                        }
                    }
                }
                (*ty, meta, unsigned, bytes)
            })
    }

    proptest! {
        // Shrunk failing cases are kept with the other test fixtures, under tests/ (the
        // repository root holds only what belongs there), and re-run first on every run.
        #![proptest_config(ProptestConfig {
            cases: 20_000,
            failure_persistence: Some(Box::new(
                proptest::test_runner::FileFailurePersistence::SourceParallel(
                    "tests/proptest-regressions",
                ),
            )),
            ..ProptestConfig::default()
        })]

        /// For every column type: the same value, from the same bytes, as `mysql_common`'s
        /// decoder (the relay's before), or an error where it errs; never a panic.
        #[test]
        fn every_type_reads_like_mysql_common((ty, meta, unsigned, bytes) in case()) {
            let mine = ours(ty, &meta, unsigned, &bytes);
            // mysql_common 0.37 reads a negative TIME(1|2) with a fraction wrong (it panics
            // in a debug build): the test below checks ours against the server's values.
            let wrong = (ty == MYSQL_TYPE_TIME2
                && matches!(meta[0], 1 | 2)
                && bytes.first().is_some_and(|b| *b < 0x80))
                // Nor does it sign-extend a negative MEDIUMINT (see below).
                || (ty == MYSQL_TYPE_INT24 && !unsigned && bytes.get(2).is_some_and(|b| *b >= 0x80))
                // A DECIMAL digit group out of range is corrupt: an error here, whatever
                // mysql_common makes of it.
                || matches!(&mine, Err(m) if m.contains("digit group"));
            match theirs(ty, &meta, unsigned, &bytes).filter(|_| !wrong) {
                Some(Ok(v)) => prop_assert_eq!(mine, Ok(v), "{:?} {:?} {:x?}", ty, meta, bytes),
                Some(Err(())) => prop_assert!(mine.is_err(), "{:?} {:?} {:x?}: {:?}", ty, meta, bytes, mine),
                // mysql_common panicked (its negative TIME(1|2) fraction, an overflow): ours
                // must not.
                None => {}
            }
        }

        /// Random tables and random images: errors, never a panic, and an image never takes
        /// more bytes than there are.
        #[test]
        fn random_images_never_panic(
            cols in prop::collection::vec((any::<u8>(), any::<[u8; 2]>(), any::<bool>(), any::<bool>()), 1..12),
            data in prop::collection::vec(any::<u8>(), 0..200),
        ) {
            let owned: Vec<(ColumnType, [u8; 2], bool)> = cols
                .iter()
                .map(|(t, m, u, _)| (ColumnType::try_from(*t).unwrap_or(MYSQL_TYPE_NULL), *m, *u))
                .collect();
            let spec: Vec<(ColumnType, &[u8], bool)> =
                owned.iter().map(|(t, m, u)| (*t, &m[..], *u)).collect();
            let layout = Layout::from_columns(&spec);
            let bits: Vec<bool> = cols.iter().map(|c| c.3).collect();
            let mut bv = bitvec::vec::BitVec::<u8>::new();
            bv.extend(bits);
            let image = layout.image(&bv).unwrap();
            let wanted = vec![true; cols.len()];
            let mut cells = vec![None; cols.len()];
            let mut at = 0;
            while at < data.len() {
                match image.read(&data[at..], &wanted, &mut cells) {
                    Ok(n) => {
                        prop_assert!(n >= 1 && at + n <= data.len());
                        at += n;
                    }
                    Err(_) => break,
                }
            }
        }
    }

    #[test]
    fn negative_time_fractions_read_as_the_server_writes_them() {
        // TIME(2) '-00:00:01.50': the server stores int part -2 (offset) and fraction 0x32
        // counting down from the next whole second (`my_time_packed_from_binary`).
        let int = (0x80_0000i64 - 2) as u32;
        let b = [
            (int >> 16) as u8,
            (int >> 8) as u8,
            int as u8,
            256u16.wrapping_sub(50) as u8,
        ];
        let kind = kind_of(MYSQL_TYPE_TIME2, &[2], false);
        assert_eq!(kind.span(&b).unwrap(), (0, 4));
        assert_eq!(
            kind.decode(&b).unwrap(),
            Cell::Time(true, 0, 0, 0, 1, 500_000)
        );
        // TIME(4) '-00:00:01.5000': the same, in two bytes.
        let f = (0x1_0000 - 5000) as u16;
        let b = [b[0], b[1], b[2], (f >> 8) as u8, f as u8];
        let kind = kind_of(MYSQL_TYPE_TIME2, &[4], false);
        assert_eq!(
            kind.decode(&b).unwrap(),
            Cell::Time(true, 0, 0, 0, 1, 500_000)
        );
    }

    #[test]
    fn negative_mediumints_are_sign_extended() {
        let kind = kind_of(MYSQL_TYPE_INT24, &[], false);
        assert_eq!(kind.decode(&[0, 0, 0x80]).unwrap(), Cell::Int(-8_388_608));
        assert_eq!(kind.decode(&[0xff, 0xff, 0xff]).unwrap(), Cell::Int(-1));
        let unsigned = kind_of(MYSQL_TYPE_INT24, &[], true);
        assert_eq!(
            unsigned.decode(&[0xff, 0xff, 0xff]).unwrap(),
            Cell::Int(16_777_215)
        );
    }

    #[test]
    fn corrupt_decimals_are_errors() {
        // DECIMAL(5,2): 3 integer digits (2 bytes), 2 fraction digits (1 byte); 0x80 0x01 0x0c
        // is 1.12, a fraction byte of 0x7f (127) is more than two digits.
        let kind = kind_of(MYSQL_TYPE_NEWDECIMAL, &[5, 2], false);
        assert_eq!(
            kind.decode(&[0x80, 0x01, 0x0c]).unwrap(),
            Cell::Bytes(Cow::Borrowed(&b"1.12"[..]))
        );
        assert!(kind.decode(&[0x80, 0x01, 0x7f]).is_err());
    }

    #[test]
    fn lengths_beyond_the_image_are_errors() {
        let layout = Layout::from_columns(&[
            (MYSQL_TYPE_LONG, &[][..], false),
            (MYSQL_TYPE_BLOB, &[4][..], false),
        ]);
        let mut bv = bitvec::vec::BitVec::<u8>::new();
        bv.extend([true, true]);
        let image = layout.image(&bv).unwrap();
        let mut cells = vec![None; 2];
        // NULL bitmap, the INT, then a BLOB claiming 4 GiB.
        let row = [0u8, 1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, b'x'];
        let e = image.read(&row, &[true, true], &mut cells).unwrap_err();
        assert!(e.contains("column 2") && e.contains("4294967295"), "{e}");
        // The same row with a fitting length reads, and the INT is stepped over when unwanted.
        let row = [0u8, 1, 0, 0, 0, 1, 0, 0, 0, b'x'];
        assert_eq!(
            image.read(&row, &[false, true], &mut cells).unwrap(),
            row.len()
        );
        assert_eq!(cells[0], None);
        assert_eq!(cells[1], Some(Cell::Bytes(Cow::Borrowed(&b"x"[..]))));
        // A NULL bitmap the bytes do not hold.
        assert!(image.read(&[], &[true, true], &mut cells).is_err());
        // A column the table map cannot size is an error only when it holds a value.
        let layout = Layout::from_columns(&[(MYSQL_TYPE_ENUM, &[247, 9][..], false)]);
        let mut one = bitvec::vec::BitVec::<u8>::new();
        one.push(true);
        let image = layout.image(&one).unwrap();
        let mut cells = vec![None; 1];
        assert_eq!(image.read(&[1], &[true], &mut cells).unwrap(), 1);
        assert_eq!(cells[0], Some(Cell::Null));
        assert!(image.read(&[0, 1], &[true], &mut cells).is_err());
        // More columns in the rows event than in its table map.
        let mut three = bitvec::vec::BitVec::<u8>::new();
        three.extend([true, true, true]);
        assert!(layout.image(&three).is_err());
    }
}
