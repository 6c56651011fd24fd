//! MySQL 8 compressed transactions (TRANSACTION_PAYLOAD) built here from the events of a real
//! MySQL 8 binlog fixture: their events are inflated and decoded one at a time, a payload that
//! declares more than `--max-txn-payload-bytes` is refused before anything is inflated (by the
//! decoder, the file source and the command line), and damage is an error, never a panic.

use mysql_common::binlog::events::TransactionPayloadEvent;
use outboxd::source::mysql::decode::{
    payload_too_large, Decoder, PayloadError, PayloadEvents, Step, DEFAULT_PAYLOAD_LIMIT,
};
use outboxd::source::mysql::file::{event_checksum, events_from_bytes, outbox_events_from_bytes};
use outboxd::source::mysql::rows::{OutboxTable, SourceTz};
use std::io::Read;
use std::path::PathBuf;

const FIXTURE: &str = "transaction_compression.000001";

fn fixture() -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mysql-binlogs");
    std::fs::read(p.join(FIXTURE)).unwrap()
}

fn table() -> OutboxTable {
    OutboxTable {
        database: "test".into(),
        table: "outbox".into(),
        columns: Default::default(),
        tz: SourceTz::Utc,
        label: None,
    }
}

/// The fixture's bytes up to its TRANSACTION_PAYLOAD event (magic, format description, …), the
/// offset of that event, and the raw events inside it, split one by one.
fn parts() -> (Vec<u8>, usize, Vec<Vec<u8>>) {
    let bytes = fixture();
    let events = events_from_bytes(FIXTURE, &bytes).unwrap();
    let p = events
        .iter()
        .find(|e| e.event.header().event_type_raw() == 40)
        .unwrap();
    let tpe: TransactionPayloadEvent = p.event.read_event().unwrap();
    let mut raw = Vec::new();
    tpe.decompressed().unwrap().read_to_end(&mut raw).unwrap();
    let mut inner = Vec::new();
    let mut rest = &raw[..];
    while !rest.is_empty() {
        let size = u32::from_le_bytes(rest[9..13].try_into().unwrap()) as usize;
        inner.push(rest[..size].to_vec());
        rest = &rest[size..];
    }
    let at = p.offset as usize;
    (bytes[..at].to_vec(), at, inner)
}

fn lenenc(v: u64) -> Vec<u8> {
    match v {
        0..=0xfa => vec![v as u8],
        0xfb..=0xffff => [&[0xfc][..], &(v as u16).to_le_bytes()].concat(),
        0x1_0000..=0xff_ffff => [&[0xfd][..], &(v as u32).to_le_bytes()[..3]].concat(),
        _ => [&[0xfe][..], &v.to_le_bytes()].concat(),
    }
}

/// A TRANSACTION_PAYLOAD event at file offset `at`: compression type `algorithm` (255 none),
/// the `declared` uncompressed size, `payload` as it is stored; with its CRC32.
fn payload_event(at: usize, algorithm: u64, declared: u64, payload: &[u8]) -> Vec<u8> {
    let mut data = Vec::new();
    for (field, value) in [(1u64, payload.len() as u64), (2, algorithm), (3, declared)] {
        let v = lenenc(value);
        data.extend(lenenc(field));
        data.extend(lenenc(v.len() as u64));
        data.extend(v);
    }
    data.push(0);
    data.extend_from_slice(payload);
    let size = 19 + data.len() + 4;
    let mut ev = Vec::with_capacity(size);
    ev.extend_from_slice(&1_600_000_000u32.to_le_bytes());
    ev.push(40);
    ev.extend_from_slice(&1u32.to_le_bytes());
    ev.extend_from_slice(&(size as u32).to_le_bytes());
    ev.extend_from_slice(&((at + size) as u32).to_le_bytes());
    ev.extend_from_slice(&0u16.to_le_bytes());
    ev.extend(data);
    let crc = event_checksum(&ev);
    ev.extend_from_slice(&crc.to_le_bytes());
    ev
}

/// A binlog file: the fixture's head, then one uncompressed payload of `inner` events.
fn file_with(inner: &[u8], declared: u64) -> Vec<u8> {
    let (mut head, at, _) = parts();
    head.extend(payload_event(at, 255, declared, inner));
    head
}

/// BEGIN, the table map, `rows` copies of the rows event, XID: one big transaction.
fn big_transaction(rows: usize) -> Vec<u8> {
    let (_, _, inner) = parts();
    let kinds: Vec<u8> = inner.iter().map(|e| e[4]).collect();
    let rows_at = kinds
        .iter()
        .position(|k| (23..=32).contains(k))
        .expect("a rows event");
    let mut out = Vec::new();
    for (i, e) in inner.iter().enumerate() {
        if i == rows_at {
            for _ in 0..rows {
                out.extend_from_slice(e);
            }
        } else {
            out.extend_from_slice(e);
        }
    }
    out
}

#[test]
fn a_generated_payload_is_decoded_one_event_at_a_time() {
    const ROWS: usize = 20_000;
    let inner = big_transaction(ROWS);
    let bytes = file_with(&inner, inner.len() as u64);
    let (_, at, _) = parts();
    let events = events_from_bytes("gen.000001", &bytes).unwrap();
    let outer = &events.iter().find(|e| e.offset == at as u64).unwrap().event;

    // Each event of the payload comes out and is decoded before the next is read: one rows
    // event yields its rows at once, the commit comes last, at the payload's end position.
    let mut dec = Decoder::new(vec![table()], "gen.000001", None);
    for e in &events[..events.len() - 1] {
        dec.feed(&e.event).unwrap();
    }
    let mut p = dec.payload_events(outer).unwrap().expect("a payload");
    assert_eq!(p.declared(), inner.len() as u64);
    let (mut fed, mut commits) = (0, Vec::new());
    while let Some(e) = p.next_event().unwrap() {
        fed += 1;
        for step in dec.feed_inner(&e, outer).unwrap() {
            if let Step::Commit { checkpoint, .. } = step {
                commits.push((fed, checkpoint.to_string()));
            }
        }
    }
    assert_eq!(fed, ROWS + 3, "BEGIN, table map, {ROWS} rows events, XID");
    assert_eq!(commits.len(), 1);
    assert_eq!(commits[0].0, ROWS + 3, "committed at the last event");
    let end = at + bytes.len() - at;
    assert!(
        commits[0].1.contains(&format!(":{end}")),
        "at the payload's end {end}: {commits:?}"
    );

    // Damage at the end: every event before it still comes out first (nothing waits for the
    // whole payload), then the error names the offset.
    let mut cut = inner.clone();
    let xid_len = parts().2.last().unwrap().len();
    let last = cut.len() - xid_len;
    cut[last + 9..last + 13].copy_from_slice(&u32::MAX.to_le_bytes());
    let bytes = file_with(&cut, cut.len() as u64);
    let events = events_from_bytes("gen.000001", &bytes);
    let err = events.unwrap_err().to_string();
    assert!(
        err.contains("of the unpacked payload") && err.contains("claims 4294967295 bytes"),
        "{err}"
    );
    let events = {
        // The same bytes framed by hand: the payload event itself is intact.
        let mut framer = outboxd::source::mysql::file::EventFramer::file(&bytes).unwrap();
        let mut v = Vec::new();
        while let Some((_, e)) = framer.next_event().unwrap() {
            v.push(e);
        }
        v
    };
    let outer = events.last().unwrap();
    let mut p = PayloadEvents::open(outer, DEFAULT_PAYLOAD_LIMIT).unwrap();
    let mut before = 0;
    let err = loop {
        match p.next_event() {
            Ok(Some(_)) => before += 1,
            Ok(None) => panic!("the damage was not found"),
            Err(m) => break m,
        }
    };
    assert_eq!(before, ROWS + 2, "all events before the damaged one: {err}");
}

#[test]
fn a_payload_declaring_more_than_the_limit_is_refused_before_inflating() {
    let (_, at, inner) = parts();
    let inner: Vec<u8> = inner.concat();
    // Declares 1 TiB: refused by its header, before a byte is inflated or allocated.
    let bytes = file_with(&inner, 1 << 40);
    let events = {
        let mut framer = outboxd::source::mysql::file::EventFramer::file(&bytes).unwrap();
        let mut v = Vec::new();
        while let Some((_, e)) = framer.next_event().unwrap() {
            v.push(e);
        }
        v
    };
    let outer = events.last().unwrap();
    match PayloadEvents::open(outer, DEFAULT_PAYLOAD_LIMIT) {
        Err(PayloadError::TooLarge { declared, limit }) => {
            assert_eq!((declared, limit), (1 << 40, DEFAULT_PAYLOAD_LIMIT))
        }
        Err(e) => panic!("{e}"),
        Ok(_) => panic!("accepted a payload declaring 1 TiB"),
    }
    // Through the decoder (the path of both sources): a configuration error naming the flag.
    let err = outbox_events_from_bytes(&table(), "gen.000001", &bytes).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("--max-txn-payload-bytes") && text.contains("1099511627776"),
        "{text}"
    );
    assert!(!err.is_retryable(), "{text}");
    // A limit set lower than a real payload refuses it too; the default reads it.
    let dec = Decoder::new(vec![table()], "gen.000001", None).with_limits(1 << 20, 100);
    let e = dec.payload_events(outer);
    assert!(e.is_err());
    let real = file_with(&inner, inner.len() as u64);
    assert!(outbox_events_from_bytes(&table(), "gen.000001", &real).is_ok());
    let limited = {
        let events = events_from_bytes("gen.000001", &real).unwrap();
        let outer = &events.iter().find(|e| e.offset == at as u64).unwrap().event;
        let mut dec = Decoder::new(vec![table()], "gen.000001", None).with_limits(1 << 20, 100);
        dec.feed(outer).map(|_| ()).unwrap_err().to_string()
    };
    assert!(
        limited.contains("--max-txn-payload-bytes (100)"),
        "{limited}"
    );
    // The same message as the constructor's.
    assert!(payload_too_large("f:4", 200, 100)
        .to_string()
        .contains("declares 200 uncompressed bytes"));
}

#[test]
fn a_payload_that_holds_more_or_less_than_it_declares_is_an_error() {
    let (_, _, inner) = parts();
    let inner: Vec<u8> = inner.concat();
    for (declared, needle) in [
        (inner.len() as u64 - 1, "left of the declared size"),
        (inner.len() as u64 + 100, "holds"),
    ] {
        let bytes = file_with(&inner, declared);
        let err = events_from_bytes("gen.000001", &bytes)
            .map(|_| ())
            .unwrap_err()
            .to_string();
        assert!(err.contains(needle), "declared {declared}: {err}");
    }
}

#[test]
fn the_file_source_refuses_a_payload_above_the_flag() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(FIXTURE);
    std::fs::write(&path, fixture()).unwrap();
    let run = |limit: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args([
                "run",
                "--source",
                &format!("file://{}", path.display()),
                "--table",
                "test.outbox",
                "--max-txn-payload-bytes",
                limit,
                "--log-level",
                "warn",
            ])
            .output()
            .unwrap()
    };
    let refused = run("64");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    assert!(
        stderr.contains("--max-txn-payload-bytes (64)") && stderr.contains("raise"),
        "{stderr}"
    );
    let read = run("1MiB");
    assert!(
        read.status.success(),
        "{}",
        String::from_utf8_lossy(&read.stderr)
    );
}
