//! Entry points for the fuzz targets in `fuzz/` and the corpus replay in `tests/surface/fuzz_corpus.rs`:
//! each takes raw bytes as they would arrive from the network and runs them through the same
//! parsing and mapping code the relay runs, down to the rendered message. Not an API: hidden
//! from the docs, and nothing else may depend on it. See docs/fuzzing.md.

use crate::source::mysql::decode::{Decoder, Step};
use crate::source::mysql::gtid::{self, GtidState};
use crate::source::mysql::rows::{OutboxTable, SourceTz};
use crate::source::postgres::pgoutput::{self, Message};
use crate::source::postgres::rows::RowMapper;
use crate::{ColumnMap, Error, OutboxEvent};
use bytes::Bytes;

/// What a run decoded before it ended (or failed).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// Source messages or binlog events read.
    pub messages: usize,
    /// Outbox events produced (and rendered).
    pub events: usize,
}

/// Renders an event the way the stdout sink does: the whole path to a message body.
fn render(event: &OutboxEvent) -> Result<(), Error> {
    crate::sink::stdout::render_line(event)
        .map(|_| ())
        .map_err(|e| Error::Decode(format!("render: {e}")))
}

/// A sequence of pgoutput messages, each framed as a big-endian u32 length and its bytes
/// (the XLogData payloads of one replication stream), through the decoder and the row mapper
/// of the outbox table `public.outbox`. Stops at the first error, as the relay does.
pub fn pgoutput(data: &[u8], outcome: &mut Outcome) -> Result<(), Error> {
    let table = crate::outbox::TableName {
        schema: Some("public".into()),
        name: "outbox".into(),
    };
    let mut mapper = RowMapper::new(table, ColumnMap::default());
    let mut txn: Option<(u64, i64, u32)> = None;
    let mut rest = data;
    while !rest.is_empty() {
        let (msg, next) = match rest.get(..4) {
            Some(len) => {
                let n = u32::from_be_bytes([len[0], len[1], len[2], len[3]]) as usize;
                let body = &rest[4..];
                // A frame longer than the input takes what is there: the decoder must cope.
                let n = n.min(body.len());
                (&body[..n], &body[n..])
            }
            None => (rest, &[][..]),
        };
        rest = next;
        outcome.messages += 1;
        match pgoutput::decode(Bytes::copy_from_slice(msg))
            .map_err(|e| Error::Decode(e.to_string()))?
        {
            Message::Begin {
                final_lsn,
                commit_time,
                ..
            } => txn = Some((final_lsn, commit_time, 0)),
            Message::Commit { .. } => txn = None,
            Message::Relation(rel) => mapper.relation(rel)?,
            Message::Insert { relation_id, tuple } => {
                let Some((lsn, time, index)) = txn.as_mut() else {
                    return Err(Error::Decode("insert outside a transaction".into()));
                };
                if let Some(event) = mapper.insert(relation_id, &tuple, *lsn, *index, *time)? {
                    *index += 1;
                    render(&event)?;
                    outcome.events += 1;
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// The outbox table the binlog target maps: `outboxd_fuzz`.`outbox` with the default columns,
/// where fuzz/capture-seeds.sh writes the seeds' rows.
fn binlog_table() -> OutboxTable {
    OutboxTable {
        database: "outboxd_fuzz".into(),
        table: "outbox".into(),
        columns: ColumnMap::default(),
        tz: SourceTz::Utc,
        label: None,
    }
}

/// Event type codes the harness needs before `mysql_common` parses anything.
const FORMAT_DESCRIPTION: u8 = 15;
const CHECKSUM_CRC32: u8 = 1;
const HEADER_LEN: usize = 19;
/// A format description ends in the checksum algorithm (1 byte) and a checksum (4).
const FDE_FOOTER_LEN: usize = 5;

/// The length of the event starting at `pos`, checked against the bytes there: at least its
/// header and `min_body` bytes, at most what is left. Only for repairing checksums: the
/// decoding itself goes through the file source's framer, which checks every event whole
/// before `mysql_common` reads it.
fn event_len(data: &[u8], pos: usize, min_body: usize) -> Result<usize, Error> {
    let cut = || Error::Decode(format!("binlog: the event at byte {pos} is cut off"));
    let header = data.get(pos..pos + HEADER_LEN).ok_or_else(cut)?;
    let size = u32::from_le_bytes([header[9], header[10], header[11], header[12]]) as usize;
    let min_body = if header[4] == FORMAT_DESCRIPTION {
        FDE_FOOTER_LEN
    } else {
        min_body
    };
    if size < HEADER_LEN + min_body {
        return Err(Error::Decode(format!(
            "binlog: the event at byte {pos} claims {size} bytes, less than its header and {min_body} more"
        )));
    }
    if size > data.len() - pos {
        return Err(cut());
    }
    Ok(size)
}

/// Recomputes the CRC32 of every event once a format description announces checksums, so
/// that mutated bytes reach the decoder instead of stopping at the checksum (the server's
/// stream is checksummed too). Inputs that were valid stay unchanged.
fn repair_checksums(data: &mut [u8]) {
    let mut pos = 4;
    let mut crc = false;
    while let Ok(size) = event_len(data, pos, 0) {
        let ev = &mut data[pos..pos + size];
        if ev[4] == FORMAT_DESCRIPTION {
            crc = ev[size - FDE_FOOTER_LEN] == CHECKSUM_CRC32;
        }
        if crc && size >= HEADER_LEN + 4 {
            let sum = crate::source::mysql::file::event_checksum(&ev[..size - 4]);
            ev[size - 4..].copy_from_slice(&sum.to_le_bytes());
        }
        pos += size;
    }
}

/// A binlog file (magic, then events) framed as the file source frames it (every event checked
/// whole before `mysql_common` reads it) and fed to the decoder that maps rows of
/// `outboxd_fuzz`.`outbox` to events, MariaDB GTID tracking included. Stops at the first error.
pub fn binlog(data: &[u8], outcome: &mut Outcome) -> Result<(), Error> {
    let mut bytes = data.to_vec();
    repair_checksums(&mut bytes);
    let name = "fuzz-bin.000001";
    let mut framer = crate::source::mysql::file::EventFramer::file(&bytes)
        .map_err(|m| Error::Decode(format!("{name}: {m}")))?;
    let mut dec = Decoder::new(vec![binlog_table()], name, Some(GtidState::default()));
    while let Some((_, ev)) = framer
        .next_event()
        .map_err(|(at, m)| Error::Decode(format!("{name} at byte {at}: {m}")))?
    {
        outcome.messages += 1;
        for step in dec.feed(&ev)? {
            if let Step::Rows(events) = step {
                for event in &events {
                    render(event)?;
                }
                outcome.events += events.len();
            }
        }
    }
    Ok(())
}

/// One row image read column by column ([`crate::source::mysql::rows::Image`]), the reader the
/// binlog decoder runs on outbox rows, on a table made from the bytes: the first byte gives the
/// number of columns (1–16), then four bytes per column: its type code, two metadata bytes and
/// flags (bit 0: in the image, bit 1: unsigned, bit 2: one metadata byte only, bit 3: none);
/// the rest are row images, read until they end, every value decoded and rendered. Returns
/// the number of images read.
pub fn row_image(data: &[u8]) -> Result<usize, Error> {
    use crate::source::mysql::rows::{render_jsonb, Cell, Layout};
    use mysql_common::constants::ColumnType;
    let short = || Error::Decode("row image: too short for its columns".into());
    let (&n, rest) = data.split_first().ok_or_else(short)?;
    let n = (n % 16) as usize + 1;
    let spec = rest.get(..n * 4).ok_or_else(short)?;
    let rows = &rest[n * 4..];
    let columns: Vec<(ColumnType, &[u8], bool)> = spec
        .chunks(4)
        .map(|c| {
            let ty = ColumnType::try_from(c[0]).unwrap_or(ColumnType::MYSQL_TYPE_NULL);
            let meta = match c[3] & 0b1100 {
                0 => &c[1..3],
                0b0100 => &c[1..2],
                _ => &c[1..1],
            };
            (ty, meta, c[3] & 2 != 0)
        })
        .collect();
    let present_bits: Vec<u8> = {
        let mut b = vec![0u8; n.div_ceil(8)];
        for (i, c) in spec.chunks(4).enumerate() {
            if c[3] & 1 != 0 {
                b[i / 8] |= 1 << (i % 8);
            }
        }
        b
    };
    let present = &bitvec::slice::BitSlice::<u8>::from_slice(&present_bits)[..n];
    let layout = Layout::from_columns(&columns);
    let image = layout.image(present).map_err(Error::Decode)?;
    let wanted = vec![true; n];
    let mut cells = vec![None; n];
    let (mut at, mut images) = (0, 0);
    while at < rows.len() {
        at += image
            .read(&rows[at..], &wanted, &mut cells)
            .map_err(Error::Decode)?;
        images += 1;
        for c in cells.iter().flatten() {
            let _ = format!("{:?}", c.to_binlog());
            if let Cell::Jsonb(raw) = c {
                let _ = render_jsonb(raw);
            }
        }
    }
    Ok(images)
}

/// Every row image of every rows event in `events` (after the table maps they name) read
/// twice: column by column by the relay's reader and by `mysql_common`'s generic row decoder
/// (`BinlogRow`, the relay's reader before it). Any value that differs, or an image one reads
/// and the other does not, is an error naming the event, the row and the column. Only the
/// table `only` (database, table) when given. Returns, per column type, how many non-NULL
/// values were compared.
pub fn compare_row_images(
    events: &[&mysql_common::binlog::events::Event],
    only: Option<(&str, &str)>,
) -> Result<std::collections::BTreeMap<String, usize>, String> {
    use crate::source::mysql::rows::Layout;
    use mysql_common::binlog::events::{EventData, TableMapEvent};
    use mysql_common::binlog::value::BinlogValue;
    use mysql_common::value::Value;
    let mut maps: std::collections::HashMap<u64, (TableMapEvent<'static>, Layout)> =
        Default::default();
    let mut counts = std::collections::BTreeMap::new();
    for (e, ev) in events.iter().enumerate() {
        // Table maps and rows events (partial JSON updates aside: the relay reads inserts).
        if !matches!(ev.header().event_type_raw(), 19 | 23..=25 | 30..=32) {
            continue;
        }
        let at = |m: String| format!("event {e}: {m}");
        match ev.read_data().map_err(|x| at(x.to_string()))? {
            Some(EventData::TableMapEvent(t)) => {
                if only.is_some_and(|(d, n)| {
                    t.database_name_raw() != d.as_bytes() || t.table_name_raw() != n.as_bytes()
                }) {
                    maps.remove(&t.table_id());
                    continue;
                }
                crate::source::mysql::rows::table_map_fits(&t).map_err(at)?;
                let layout = Layout::new(&t).map_err(at)?;
                maps.insert(t.table_id(), (t.into_owned(), layout));
            }
            Some(EventData::RowsEvent(r)) => {
                let Some((tme, layout)) = maps.get(&r.table_id()) else {
                    continue;
                };
                let bitmaps: Vec<_> = [r.columns_before_image(), r.columns_after_image()]
                    .into_iter()
                    .flatten()
                    .collect();
                let ours = our_images(layout, &r).map_err(at)?;
                let mut theirs = Vec::new();
                for row in r.rows(tme) {
                    let (b, a) = row.map_err(|x| at(format!("mysql_common: {x}")))?;
                    theirs.extend(b);
                    theirs.extend(a);
                }
                if ours.len() != theirs.len() {
                    return Err(at(format!(
                        "{} images read, mysql_common read {}",
                        ours.len(),
                        theirs.len()
                    )));
                }
                for (k, (o, t)) in ours.iter().zip(&theirs).enumerate() {
                    let present = bitmaps[k % bitmaps.len()];
                    for (j, i) in present.iter_ones().enumerate() {
                        let mine = o[i].as_ref().map(|c| format!("{:?}", c.to_binlog()));
                        // mysql_common 0.37 reads a negative MEDIUMINT without its sign
                        // (-1 as 16777215): compared as the server means it.
                        let old = t.as_ref(j).map(|v| match (v, &o[i]) {
                            (
                                BinlogValue::Value(Value::Int(t)),
                                Some(crate::source::mysql::rows::Cell::Int(m)),
                            ) if *m < 0 && *t == *m + 0x100_0000 => {
                                format!("{:?}", BinlogValue::Value(Value::Int(*m)))
                            }
                            _ => format!("{v:?}"),
                        });
                        if mine != old {
                            return Err(at(format!(
                                "image {k}, column {}: {mine:?}, mysql_common {old:?}",
                                i + 1
                            )));
                        }
                        if !matches!(o[i], Some(crate::source::mysql::rows::Cell::Null)) {
                            let ty = tme.get_column_type(i).ok().flatten();
                            *counts.entry(format!("{ty:?}")).or_insert(0) += 1;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    Ok(counts)
}

/// Every row image of a rows event read column by column, every column decoded: one list of
/// the table's columns per image (`None`: not in the image), before and after images in turn.
fn our_images<'a>(
    layout: &crate::source::mysql::rows::Layout,
    r: &'a mysql_common::binlog::events::RowsEventData<'a>,
) -> Result<Vec<Vec<Option<crate::source::mysql::rows::Cell<'a>>>>, String> {
    let images = [r.columns_before_image(), r.columns_after_image()]
        .into_iter()
        .flatten()
        .map(|p| layout.image(p))
        .collect::<Result<Vec<_>, _>>()?;
    let n = layout.len();
    let wanted = vec![true; n];
    let rows = r.rows_data();
    let mut ours = Vec::new();
    let mut pos = 0;
    while pos < rows.len() {
        for img in &images {
            let mut cells = vec![None; n];
            pos += img
                .read(&rows[pos..], &wanted, &mut cells)
                .map_err(|m| format!("image {}: {m}", ours.len()))?;
            ours.push(cells);
        }
    }
    Ok(ours)
}

/// The row images of table `only` (database, table) in `events`, read column by column by the
/// relay's reader alone, each value as `mysql_common` represents it (for values its own
/// decoder gets wrong, which [`compare_row_images`] cannot compare).
pub fn read_row_images(
    events: &[&mysql_common::binlog::events::Event],
    only: (&str, &str),
) -> Result<Vec<Vec<Option<mysql_common::binlog::value::BinlogValue<'static>>>>, String> {
    use crate::source::mysql::rows::Layout;
    use mysql_common::binlog::events::EventData;
    let mut maps: std::collections::HashMap<u64, Layout> = Default::default();
    let mut out = Vec::new();
    for ev in events {
        if !matches!(ev.header().event_type_raw(), 19 | 23..=25 | 30..=32) {
            continue;
        }
        match ev.read_data().map_err(|x| x.to_string())? {
            Some(EventData::TableMapEvent(t)) => {
                if t.database_name_raw() == only.0.as_bytes()
                    && t.table_name_raw() == only.1.as_bytes()
                {
                    maps.insert(t.table_id(), Layout::new(&t)?);
                } else {
                    maps.remove(&t.table_id());
                }
            }
            Some(EventData::RowsEvent(r)) => {
                if let Some(layout) = maps.get(&r.table_id()) {
                    for cells in our_images(layout, &r)? {
                        out.push(
                            cells
                                .into_iter()
                                .map(|c| c.map(|c| c.to_binlog().into_owned()))
                                .collect(),
                        );
                    }
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// Whether a panic now would be caught by the binlog decoder's guard around `mysql_common`'s
/// binary JSON parsing (a decode error for the relay, not a crash). The fuzz targets' panic
/// hook passes those by: libFuzzer's hook aborts on every panic, caught or not.
pub fn in_guarded_rows() -> bool {
    crate::source::mysql::decode::in_guarded_rows()
}

/// MariaDB GTID parsing on its own: the bytes as a GTID event body, as a GTID list body, and
/// (as text) as a GTID state such as `0-1-6,1-2-40`, which must survive a round trip.
pub fn gtid(data: &[u8]) -> Result<(), Error> {
    let _ = gtid::parse_gtid_event(data, 1);
    let _ = gtid::parse_gtid_list(data);
    let text = String::from_utf8_lossy(data);
    if let Some(state) = GtidState::parse(&text) {
        let again = GtidState::parse(&state.to_string());
        if again.as_ref() != Some(&state) {
            return Err(Error::Decode(format!(
                "GTID state {text:?} printed as {state} parses as {again:?}"
            )));
        }
    }
    Ok(())
}

/// Key material, event and field of the known-answer vector in docs/encryption.md.
pub(crate) const ENVELOPE_MATERIAL: [u8; 32] = [
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25,
    26, 27, 28, 29, 30, 31,
];
pub(crate) const ENVELOPE_EVENT: &str = "0192f3a4-5b6c-7d8e-9f00-112233445566";
pub(crate) const ENVELOPE_POINTER: &str = "/customer/tax_id";

/// An `enc:v1:` value (the bytes as text) through the parser and, when it parses, the opener
/// with the known-answer vector's key; returns the plaintext.
pub fn envelope(data: &[u8]) -> Result<Vec<u8>, Error> {
    use crate::crypto::envelope;
    let text = String::from_utf8_lossy(data);
    let event = uuid::Uuid::parse_str(ENVELOPE_EVENT).expect("constant");
    let parsed = envelope::parse(&text, ENVELOPE_POINTER)?;
    let plain = envelope::open(&ENVELOPE_MATERIAL, &parsed, event, ENVELOPE_POINTER)?;
    Ok(plain.to_vec())
}
