//! The binlog-file source (`--source file://…`) on real binlog bytes: every fixture of
//! tests/fixtures/mysql-binlogs (MySQL 5.0–9.x and MariaDB files) decodes to the rows
//! `mariadb-binlog -v` prints (or, where it cannot read MySQL 8 events, to the fixture's
//! documented contents); GTIDs (8.4 tagged ones too) are tracked, TRANSACTION_PAYLOAD is
//! unpacked, binary JSON becomes JSON text, truncated and mutated files give errors naming the
//! offset and never panic; and a binlog written by the local MariaDB replays to exactly the
//! lines the live stream produced, and through the RabbitMQ sink to the same events.

use crate::common;

use common::*;
use mysql_common::binlog::events::{EventData, RowsEventData, TableMapEvent};
use mysql_common::binlog::value::BinlogValue;
use mysql_common::value::Value;
use outboxd::source::mysql::decode::Decoder;
use outboxd::source::mysql::file::{events_from_bytes, outbox_events_from_bytes, FileEvent};
use outboxd::source::mysql::rows::{OutboxTable, SourceTz};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(90);

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mysql-binlogs")
}

fn fixture_files() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_dir())
        .expect("tests/fixtures/mysql-binlogs")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().and_then(|e| e.to_str()) != Some("md"))
        .collect();
    v.sort();
    assert!(v.len() >= 12, "fixtures missing: {v:?}");
    v
}

fn table(db: &str, name: &str) -> OutboxTable {
    OutboxTable {
        database: db.into(),
        table: name.into(),
        columns: Default::default(),
        tz: SourceTz::Utc,
        label: None,
    }
}

/// One row change as `mariadb-binlog -v` shows it: operation, table, `@N=value` pairs (before
/// image then after image for updates).
#[derive(Debug, Clone, PartialEq)]
struct RowOp {
    op: &'static str,
    table: String,
    values: Vec<(usize, String)>,
}

/// A value the way `mariadb-binlog -v` prints it.
fn render(v: &BinlogValue<'_>) -> String {
    match v {
        BinlogValue::Value(Value::NULL) => "NULL".into(),
        BinlogValue::Value(Value::Int(i)) => i.to_string(),
        BinlogValue::Value(Value::UInt(u)) => u.to_string(),
        BinlogValue::Value(Value::Float(f)) => f.to_string(),
        BinlogValue::Value(Value::Double(f)) => f.to_string(),
        BinlogValue::Value(Value::Bytes(b)) => {
            let mut s = String::from("'");
            for &c in b.iter() {
                if (0x20..0x7f).contains(&c) && c != b'\'' && c != b'\\' {
                    s.push(c as char);
                } else {
                    s.push_str(&format!("\\x{c:02x}"));
                }
            }
            s.push('\'');
            s
        }
        BinlogValue::Value(Value::Date(y, mo, d, h, mi, s, us)) => {
            let mut t = format!("'{y:04}-{mo:02}-{d:02} {h:02}:{mi:02}:{s:02}");
            if *us > 0 {
                t.push_str(&format!(".{us:06}"));
            }
            t + "'"
        }
        BinlogValue::Value(Value::Time(neg, days, h, m, s, us)) => {
            let mut t = format!(
                "'{}{:02}:{m:02}:{s:02}",
                if *neg { "-" } else { "" },
                days * 24 + *h as u32
            );
            if *us > 0 {
                t.push_str(&format!(".{us:06}"));
            }
            t + "'"
        }
        BinlogValue::Jsonb(j) => serde_json::Value::try_from(j.clone())
            .map(|v| v.to_string())
            .unwrap_or_else(|e| format!("<bad json {e}>")),
        BinlogValue::JsonDiff(d) => format!("<json diff {d:?}>"),
    }
}

fn events_flat(events: &[FileEvent]) -> Vec<&mysql_common::binlog::events::Event> {
    events
        .iter()
        .flat_map(|e| std::iter::once(&e.event).chain(e.unpacked.iter()))
        .collect()
}

/// Every row change in the events, decoded with the table maps before it.
fn row_ops(events: &[FileEvent]) -> Result<Vec<RowOp>, String> {
    let mut maps: HashMap<u64, TableMapEvent<'static>> = HashMap::new();
    let mut out = Vec::new();
    for ev in events_flat(events) {
        // Only table maps and rows events: other event kinds are the relay's business (and
        // mysql_common's Previous_gtids parser trusts its counts, see gtid::previous_gtids_fit).
        if !matches!(ev.header().event_type_raw(), 19 | 23..=25 | 30..=32 | 39) {
            continue;
        }
        match ev.read_data().map_err(|e| e.to_string())? {
            Some(EventData::TableMapEvent(t)) => {
                // The relay's own check before it decodes rows of a table map.
                outboxd::source::mysql::rows::table_map_fits(&t)?;
                maps.insert(t.table_id(), t.into_owned());
            }
            Some(EventData::RowsEvent(r)) => {
                let tme = maps
                    .get(&r.table_id())
                    .ok_or_else(|| format!("no table map for {}", r.table_id()))?;
                let op = match r {
                    RowsEventData::WriteRowsEventV1(_) | RowsEventData::WriteRowsEvent(_) => {
                        "INSERT"
                    }
                    RowsEventData::UpdateRowsEventV1(_)
                    | RowsEventData::UpdateRowsEvent(_)
                    | RowsEventData::PartialUpdateRowsEvent(_) => "UPDATE",
                    _ => "DELETE",
                };
                let table = format!("`{}`.`{}`", tme.database_name(), tme.table_name());
                let ncols = tme.columns_count() as usize;
                // Column numbers of the values present in each image (partial images hold
                // only some columns, in table order).
                // An image without columns makes every row zero bytes long, and mysql_common
                // would read such rows forever: the relay refuses images without its mapped
                // columns (rows::Mapping::check_image) before it reads any row; so do we.
                let empty = |b: Option<usize>| b == Some(0);
                if ncols == 0
                    || empty(r.columns_before_image().map(|b| b.count_ones()))
                    || empty(r.columns_after_image().map(|b| b.count_ones()))
                {
                    return Err("a rows event image without columns".into());
                }
                let all = || (0..ncols).collect::<Vec<usize>>();
                let images = [
                    r.columns_before_image()
                        .map(|b| b.iter_ones().filter(|&i| i < ncols).collect())
                        .unwrap_or_else(all),
                    r.columns_after_image()
                        .map(|b| b.iter_ones().filter(|&i| i < ncols).collect())
                        .unwrap_or_else(all),
                ];
                for row in r.rows(tme) {
                    let (before, after) = row.map_err(|e| e.to_string())?;
                    let mut values = Vec::new();
                    for (img, cols) in [(before, &images[0]), (after, &images[1])] {
                        let Some(img) = img else { continue };
                        for k in 0..img.len() {
                            let i = if img.len() == ncols {
                                k
                            } else {
                                cols.get(k).copied().unwrap_or(k)
                            };
                            if let Some(v) = img.as_ref(k) {
                                use mysql_common::constants::ColumnType as C;
                                let mut text = render(v);
                                // TIMESTAMP values come as epoch text; mariadb-binlog prints
                                // the number.
                                if matches!(
                                    tme.get_column_type(i),
                                    Ok(Some(C::MYSQL_TYPE_TIMESTAMP | C::MYSQL_TYPE_TIMESTAMP2))
                                ) {
                                    text = text.trim_matches('\'').to_string();
                                }
                                values.push((i + 1, text));
                            }
                        }
                    }
                    out.push(RowOp {
                        op,
                        table: table.clone(),
                        values,
                    });
                }
            }
            _ => {}
        }
    }
    Ok(out)
}

/// What `mariadb-binlog -v --base64-output=decode-rows` prints for a file; `None` when it
/// cannot read the whole file (MySQL 8 events it does not know).
fn mariadb_binlog_rows(path: &Path) -> Option<Vec<RowOp>> {
    let out = std::process::Command::new("mariadb-binlog")
        .args(["-v", "--base64-output=decode-rows"])
        .arg(path)
        .output()
        .expect("mariadb-binlog runs (apt-get install mariadb-client)");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if !out.status.success() || text.contains("ERROR:") {
        return None;
    }
    let mut ops: Vec<RowOp> = Vec::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix("### ") else {
            continue;
        };
        let start = [
            ("INSERT INTO ", "INSERT"),
            ("UPDATE ", "UPDATE"),
            ("DELETE FROM ", "DELETE"),
        ]
        .iter()
        .find_map(|(p, op)| rest.strip_prefix(p).map(|t| (*op, t.trim().to_string())));
        if let Some((op, table)) = start {
            ops.push(RowOp {
                op,
                table,
                values: Vec::new(),
            });
        } else if let Some(v) = rest.trim_start().strip_prefix('@') {
            let (n, value) = v.split_once('=').expect("@N=value");
            ops.last_mut()
                .expect("values after a row header")
                .values
                .push((n.parse().unwrap(), value.to_string()));
        }
    }
    Some(ops)
}

/// Whether our rendering matches mariadb-binlog's: integers it shows as `-3 (4294967293)`
/// (signed, then unsigned) match either reading.
fn same_value(ours: &str, theirs: &str) -> bool {
    if ours == theirs {
        return true;
    }
    if let Some((signed, rest)) = theirs.split_once(" (") {
        let unsigned = rest.trim_end_matches(')');
        return ours == signed || ours == unsigned;
    }
    false
}

#[test]
fn every_fixture_decodes_like_mariadb_binlog_or_its_documented_contents() {
    let mut compared = 0;
    let mut rows_total = 0;
    for path in fixture_files() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        let result = events_from_bytes(&name, &bytes);
        if name == "binlog_truncated_event.000001" {
            let e = result
                .expect_err("a truncated file is an error")
                .to_string();
            assert!(
                e.contains("binlog_truncated_event.000001")
                    && e.contains("byte offset 4")
                    && e.contains("truncated"),
                "{e}"
            );
            continue;
        }
        let events = result.unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(events.len() > 2, "{name}: only {} events", events.len());
        let ours = row_ops(&events).unwrap_or_else(|e| panic!("{name}: rows: {e}"));
        rows_total += ours.len();
        match mariadb_binlog_rows(&path) {
            Some(theirs) => {
                compared += 1;
                assert_eq!(
                    ours.len(),
                    theirs.len(),
                    "{name}: row count\nours {ours:#?}\ntheirs {theirs:#?}"
                );
                for (a, b) in ours.iter().zip(&theirs) {
                    assert_eq!((a.op, &a.table), (b.op, &b.table), "{name}");
                    assert_eq!(a.values.len(), b.values.len(), "{name}: {a:?} vs {b:?}");
                    for ((i, x), (j, y)) in a.values.iter().zip(&b.values) {
                        assert!(i == j && same_value(x, y), "{name}: @{i}={x} vs @{j}={y}");
                    }
                }
            }
            None => {
                // mariadb-binlog stops at MySQL 8 events it does not know (JSON columns, tagged
                // GTIDs, transaction payloads): the fixture's documented contents instead.
                match name.as_str() {
                    "json.binlog.000001" => check_json_fixture(&ours),
                    "transaction_compression.000001" => {
                        assert!(
                            !ours.is_empty(),
                            "{name}: the compressed transaction's rows"
                        );
                        assert!(events.iter().any(|e| !e.unpacked.is_empty()));
                    }
                    "binlog_transaction_with_GTID_TAG.000001" => {
                        assert_eq!(ours.len(), 1, "{name}: {ours:?}");
                    }
                    other => panic!("mariadb-binlog could not read {other}"),
                }
            }
        }
    }
    assert!(
        compared >= 7,
        "only {compared} fixtures compared with mariadb-binlog"
    );
    assert!(rows_total > 30, "{rows_total} rows in all fixtures");
}

/// json.binlog.000001 (MySQL 8.0.22): `mysql.t(id, json_col JSON, name, age)` written with
/// objects `{"age": …, "data": "xxxxxxxxxx" | "yyyyyyyyyy" | "zzzzzzzzzz", "name": "Joe" |
/// "Pete" | "Sue"}` (the strings are plainly visible in the file's bytes), inserted, then
/// partially updated (`$.age`, JSON diffs). Every binary JSON value must come out as that JSON text, through
/// the same conversion the outbox mapper uses for payload columns.
fn check_json_fixture(ops: &[RowOp]) {
    assert!(ops.len() >= 6, "{ops:?}");
    let mut names = std::collections::BTreeSet::new();
    let mut datas = std::collections::BTreeSet::new();
    let mut seen = 0;
    for op in ops {
        assert_eq!(op.table, "`mysql`.`t`");
        // Updates are partial JSON updates (JSON diffs), checked by count below.
        if op.op != "INSERT" {
            continue;
        }
        for (i, v) in &op.values {
            if *i != 2 || v == "NULL" {
                continue;
            }
            let j: serde_json::Value =
                serde_json::from_str(v).unwrap_or_else(|e| panic!("{v}: {e} in {op:?}"));
            let obj = j.as_object().expect("an object");
            let keys: Vec<&str> = obj.keys().map(String::as_str).collect();
            assert_eq!(keys, ["age", "data", "name"], "{v}");
            names.insert(obj["name"].as_str().unwrap().to_string());
            datas.insert(obj["data"].as_str().unwrap().to_string());
            assert!(obj["age"].is_number(), "{v}");
            seen += 1;
        }
    }
    assert!(seen >= 6, "{seen} JSON values");
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["Joe", "Pete", "Sue"]
    );
    assert_eq!(
        datas.into_iter().collect::<Vec<_>>(),
        ["xxxxxxxxxx", "yyyyyyyyyy", "zzzzzzzzzz"]
    );
    // The mapper's own conversion gives the same text.
    let bytes = std::fs::read(fixtures_dir().join("json.binlog.000001")).unwrap();
    let events = events_from_bytes("json.binlog.000001", &bytes).unwrap();
    let mut maps: HashMap<u64, TableMapEvent<'static>> = HashMap::new();
    let mut converted = 0;
    for ev in events_flat(&events) {
        match ev.read_data().unwrap() {
            Some(EventData::TableMapEvent(t)) => {
                maps.insert(t.table_id(), t.into_owned());
            }
            Some(EventData::RowsEvent(r)) => {
                for row in r.rows(&maps[&r.table_id()]) {
                    let (_, after) = row.unwrap();
                    if let Some(after) = after {
                        if let Some(v @ BinlogValue::Jsonb(_)) = after.as_ref(1) {
                            let text = outboxd::source::mysql::rows::json_text(Some(v)).unwrap();
                            assert_eq!(std::str::from_utf8(&text).unwrap(), render(v));
                            converted += 1;
                        }
                    }
                }
            }
            _ => {}
        }
    }
    assert!(converted >= 6, "{converted}");
}

/// Feeds a fixture through the relay's decoder; returns it after the last event.
fn decode_fixture(name: &str) -> Decoder {
    let bytes = std::fs::read(fixtures_dir().join(name)).unwrap();
    let events = events_from_bytes(name, &bytes).unwrap();
    let mut dec = Decoder::new(vec![table("test", "outbox")], name, None);
    for e in &events {
        dec.feed(&e.event)
            .unwrap_or_else(|err| panic!("{name}: {err}"));
    }
    dec
}

#[test]
fn mysql_gtids_are_tracked_from_previous_gtids_and_gtid_events() {
    // MySQL 5.6 GTIDs: an empty Previous_gtids, then transactions 1, 2 and 3 of one server
    // (GTID event bodies: flags byte, 16-byte UUID, transaction number u64 LE).
    let dec = decode_fixture("binlog_transaction_with_GTID.000001");
    assert_eq!(
        dec.mysql_gtids().unwrap().to_string(),
        "006c2cf2-b1ea-11e4-9057-8c705a3d3e78:1-3"
    );
    // MySQL 8.4+ tagged GTIDs: the Previous_gtids set plus the tagged transaction.
    let dec = decode_fixture("binlog_transaction_with_GTID_TAG.000001");
    let set = dec.mysql_gtids().unwrap().to_string();
    assert!(
        set.starts_with("55778904-0299-11f1-b1b8-4ef0c4956feb:1-13"),
        "{set}"
    );
    assert!(set.contains(":mytag:"), "{set}");
    let parsed = outboxd::source::mysql::gtid::MysqlGtidSet::parse(&set).unwrap();
    assert_eq!(parsed.to_string(), set, "the set's text form reads back");
    // Anonymous GTIDs (gtid_mode=OFF) add nothing to the (empty) Previous_gtids set.
    let dec = decode_fixture("json.binlog.000001");
    assert!(dec.mysql_gtids().is_none_or(|s| s.is_empty()));
    // The MariaDB file: MariaDB GTIDs, no MySQL set.
    let dec = decode_fixture("mariadb-bin.000001");
    assert!(dec.mysql_gtids().is_none());
    assert_eq!(dec.gtid_state().unwrap().to_string(), "0-1-2");
}

#[test]
fn a_compressed_transaction_is_unpacked_at_the_payload_position() {
    let name = "transaction_compression.000001";
    let bytes = std::fs::read(fixtures_dir().join(name)).unwrap();
    let events = events_from_bytes(name, &bytes).unwrap();
    let payload = events
        .iter()
        .find(|e| e.event.header().event_type_raw() == 40)
        .expect("a TRANSACTION_PAYLOAD event");
    assert_eq!(payload.offset, 274);
    let kinds: Vec<u8> = payload
        .unpacked
        .iter()
        .map(|e| e.header().event_type_raw())
        .collect();
    // BEGIN query, table map, rows, XID.
    assert_eq!(kinds.first(), Some(&2), "{kinds:?}");
    assert!(kinds.contains(&19) && kinds.contains(&16), "{kinds:?}");
    // Through the decoder: the transaction commits at the payload's end position.
    let mut dec = Decoder::new(vec![table("test", "outbox")], name, None);
    let mut commits = Vec::new();
    for e in &events {
        for step in dec.feed(&e.event).unwrap() {
            if let outboxd::source::mysql::decode::Step::Commit {
                start_pos,
                checkpoint,
                ..
            } = step
            {
                commits.push((start_pos, checkpoint.to_string()));
            }
        }
    }
    assert_eq!(commits.len(), 1, "{commits:?}");
    assert_eq!(commits[0].0, 197, "begins at its (anonymous) GTID event");
    assert!(
        commits[0].1.contains(":431"),
        "ends where the payload ends: {commits:?}"
    );
}

/// Every prefix of every fixture: either the events before the cut, or an error naming the
/// file and the offset of the cut-off event. Never a panic.
#[test]
fn truncated_files_error_with_the_offset() {
    for path in fixture_files() {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let bytes = std::fs::read(&path).unwrap();
        let boundaries: Vec<u64> = match events_from_bytes(&name, &bytes) {
            Ok(evs) => evs.iter().map(|e| e.offset).collect(),
            Err(_) => continue,
        };
        for cut in 0..bytes.len() {
            match events_from_bytes(&name, &bytes[..cut]) {
                Ok(evs) => {
                    assert!(
                        cut == 4 || boundaries.contains(&(cut as u64)),
                        "{name} cut at {cut}: {} events",
                        evs.len()
                    )
                }
                Err(e) => {
                    let e = e.to_string();
                    if cut >= 4 {
                        let at = boundaries
                            .iter()
                            .rev()
                            .find(|&&b| b <= cut as u64)
                            .copied()
                            .unwrap_or(4);
                        assert!(
                            e.contains(&format!("byte offset {at}:")) && e.contains(&name),
                            "{name} cut at {cut}: {e}"
                        );
                    }
                }
            }
        }
    }
}

/// xorshift64*: a seeded generator, so a failure names the seed that reproduces it.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Recomputes the CRC32 of every event whose framing still holds, so that mutations reach the
/// event parsers instead of stopping at the checksum.
pub(crate) fn fix_checksums(bytes: &mut [u8]) {
    let mut at = 4;
    let mut crc = false;
    while at + 19 <= bytes.len() {
        let size = u32::from_le_bytes(bytes[at + 9..at + 13].try_into().unwrap()) as usize;
        if size < 23 || at + size > bytes.len() {
            return;
        }
        if bytes[at + 4] == 15 {
            crc = bytes[at + size - 5] == 1;
        }
        if crc {
            let mut h = crc32fast::Hasher::new();
            let mut head = [0u8; 19];
            head.copy_from_slice(&bytes[at..at + 19]);
            if bytes[at + 4] == 15 {
                head[17] &= !1;
            }
            h.update(&head);
            h.update(&bytes[at + 19..at + size - 4]);
            bytes[at + size - 4..at + size].copy_from_slice(&h.finalize().to_le_bytes());
        }
        at += size;
    }
}

/// Mutated fixture bytes (bit flips, overwritten lengths, inserted and removed bytes, cuts),
/// half of them with their checksums fixed up: the file reader, the payload unpacker, the
/// relay's decoder and full row decoding return errors, never panic.
#[test]
fn mutated_binlogs_give_errors_never_panics() {
    let files: Vec<(String, Vec<u8>)> = fixture_files()
        .into_iter()
        .map(|p| {
            (
                p.file_name().unwrap().to_string_lossy().into_owned(),
                std::fs::read(&p).unwrap(),
            )
        })
        .collect();
    let seed: u64 = std::env::var("OUTBOXD_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x6f75_7462_6f78);
    let budget = Duration::from_secs(12);
    let started = Instant::now();
    let mut rng = Rng(seed);
    let (mut runs, mut errors) = (0u64, 0u64);
    let generic_panics = std::cell::Cell::new(0u64);
    // Expected panics of the generic path print nothing.
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    while started.elapsed() < budget && runs < 20_000 {
        let (name, orig) = &files[rng.below(files.len())];
        let mut b = orig.clone();
        for _ in 0..1 + rng.below(4) {
            if b.is_empty() {
                break;
            }
            let i = rng.below(b.len());
            match rng.below(6) {
                0 => b[i] ^= 1 << rng.below(8),
                1 => b[i] = rng.next() as u8,
                2 => {
                    // A length-like field: four random or extreme bytes.
                    let v = [0u32, 1, 18, 19, 23, u32::MAX, rng.next() as u32][rng.below(7)];
                    let end = (i + 4).min(b.len());
                    b[i..end].copy_from_slice(&v.to_le_bytes()[..end - i]);
                }
                3 => {
                    let n = 1 + rng.below(16);
                    let ins: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
                    b.splice(i..i, ins);
                }
                4 => {
                    let end = (i + 1 + rng.below(16)).min(b.len());
                    b.drain(i..end);
                }
                _ => b.truncate(i),
            }
        }
        if rng.below(2) == 0 {
            fix_checksums(&mut b);
        }
        let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut errs = 0;
            match events_from_bytes(name, &b) {
                Ok(evs) => {
                    // Decoding every row of every table is mysql_common's generic path, not the
                    // relay's (which decodes only outbox rows, behind its guards): its panics
                    // are counted, not failed.
                    match std::panic::catch_unwind(|| row_ops(&evs)) {
                        Ok(Ok(_)) => {}
                        Ok(Err(_)) => errs += 1,
                        Err(_) => {
                            errs += 1;
                            generic_panics.set(generic_panics.get() + 1);
                        }
                    }
                }
                Err(e) => {
                    assert!(
                        e.to_string().contains("byte offset")
                            || e.to_string().contains("not a binlog file"),
                        "{e}"
                    );
                    errs += 1;
                }
            }
            for t in [
                table("toddy_test", "outbox"),
                table("mysql", "t"),
                table("test", "ba"),
            ] {
                if outbox_events_from_bytes(&t, name, &b).is_err() {
                    errs += 1;
                }
            }
            errs
        }));
        match outcome {
            Ok(n) => errors += n,
            Err(_) => {
                std::panic::set_hook(hook);
                let keep = std::env::temp_dir().join(format!("outboxd-fuzz-{seed}-{runs}.bin"));
                std::fs::write(&keep, &b).unwrap();
                panic!(
                    "a mutated {name} panicked (seed {seed}, run {runs}); input kept in {}",
                    keep.display()
                );
            }
        }
        runs += 1;
    }
    let _ = std::panic::take_hook();
    std::panic::set_hook(hook);
    eprintln!(
        "{runs} mutated inputs, {errors} errors, no panic in the relay's path ({} in mysql_common's generic row decoding), {:?}",
        generic_panics.get(),
        started.elapsed()
    );
    assert!(runs >= 500, "only {runs} inputs in {budget:?}");
    assert!(
        errors > runs / 4,
        "mutations should mostly be caught: {errors} errors in {runs} runs"
    );
}

/// The local MariaDB's own binlog: events streamed live to stdout, then the server's binlog
/// files replayed through the file source: the same lines (ids, payloads, positions), byte for
/// byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mariadb_binlog_replays_to_the_lines_the_live_stream_produced() {
    let db = MyDb::create("my_file").await;
    let mut admin = my_connect(None).await;
    let first_file = my_head().await.0;
    let name = unique("r");
    let dsn = db.dsn();
    let mut live = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--commit-offsets",
        "--log-level",
        "info",
    ]);
    wait_for("the relay's binlog dump to be connected", T, || {
        db.streaming()
    })
    .await;

    let mut c = db.conn().await;
    let ids = my_write_events(&mut c, 10, 25, "file.replay").await;
    // Something that is not outbox, in the same transactions' neighbourhood.
    my_exec(
        &mut c,
        "CREATE TABLE other (id INT PRIMARY KEY); INSERT INTO other VALUES (1), (2)",
    )
    .await;
    let live_lines = live.lines_then_stop(ids.len(), T).await;

    // Close the file being written, so the replay reads only complete files.
    my_exec(&mut admin, "FLUSH BINARY LOGS").await;
    let last_file = {
        let files: Vec<String> = {
            use mysql_async::prelude::Queryable;
            let rows: Vec<mysql_async::Row> = admin.query("SHOW BINARY LOGS").await.unwrap();
            rows.iter()
                .map(|r| r.get::<String, _>(0).unwrap())
                .collect()
        };
        let head = my_head().await.0;
        let i = files.iter().position(|f| *f == head).unwrap();
        files[i - 1].clone()
    };
    let basename = my_value(&mut admin, "SELECT @@log_bin_basename")
        .await
        .unwrap();
    let dir = Path::new(&basename).parent().unwrap().to_path_buf();
    assert!(
        std::fs::read_dir(&dir).is_ok(),
        "the test needs read access to the server's binlog directory {} (run it as root or as a member of the mysql group)",
        dir.display()
    );
    let source = format!("file://{}/?from={first_file}&to={last_file}", dir.display());
    let table = format!("{}.outbox", db.name);
    let mut replay = Relay::start(&[
        "run",
        "--source",
        &source,
        "--table",
        &table,
        "--log-level",
        "info",
    ]);
    assert_eq!(replay.wait_exit(T).await, 0, "{}", replay.stderr_plain());
    let replay_lines = replay.lines();
    assert_eq!(
        replay_lines.len(),
        live_lines.len(),
        "{}",
        replay.stderr_plain()
    );
    for (a, b) in live_lines.iter().zip(&replay_lines) {
        assert_eq!(a, b, "live vs replayed line");
    }
    let got: Vec<uuid::Uuid> = parse_lines(&replay_lines)
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(got, ids, "every event once, in commit order");
    // The same files through the RabbitMQ sink: every event, confirmed, then exit 0. No queue
    // is bound, so the messages land in the exchange's `.unrouted` queue.
    let topo = amqp::Topology::new("myfile").await;
    let mut rabbit = Relay::start_with_env(
        &[
            "run",
            "--source",
            &source,
            "--table",
            &table,
            "--exchange",
            &topo.exchange,
            "--log-level",
            "info,lapin=warn",
        ],
        &[("OUTBOXD_SINK", &amqp::url())],
    );
    assert_eq!(rabbit.wait_exit(T).await, 0, "{}", rabbit.stderr_plain());
    let got: Vec<uuid::Uuid> = topo
        .take_all(&topo.unrouted())
        .await
        .iter()
        .map(amqp::message_id)
        .collect();
    assert_eq!(
        got, ids,
        "every event once, in commit order, through RabbitMQ"
    );

    // Positions name the server's files and carry the MariaDB GTID.
    let first = parse_lines(&replay_lines)[0]["position"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(first.contains("mariadb-bin."), "{first}");
}
