//! The binlog row images read column by column (the relay's reader of outbox rows) against
//! `mysql_common`'s generic row decoder, the relay's reader before it: every value of every
//! column type the same, on the binlog fixtures (MySQL 5.7/8.x and MariaDB) and on rows the
//! local MariaDB writes into a table with every column type (limits, NULLs, 1-, 2-, 3- and
//! 4-byte length prefixes, fractions of every precision); and the values `mysql_common` gets
//! wrong (the fraction of a negative TIME(1) or TIME(2)) as the server itself prints them.

use crate::common;

use common::*;
use mysql_common::binlog::events::Event;
use mysql_common::binlog::value::BinlogValue;
use mysql_common::value::Value;
use outboxd::source::mysql::file::events_from_bytes;
use std::path::Path;

fn flat(files: &[Vec<outboxd::source::mysql::file::FileEvent>]) -> Vec<&Event> {
    files
        .iter()
        .flatten()
        .flat_map(|e| std::iter::once(&e.event).chain(e.unpacked.iter()))
        .collect()
}

#[test]
fn fixtures_read_column_by_column_like_mysql_common() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mysql-binlogs");
    let mut total = std::collections::BTreeMap::new();
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) == Some("md") {
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        // The truncated fixture is for errors (tests/mariadb/mysql_file.rs).
        let Ok(events) = events_from_bytes(&name, &std::fs::read(&path).unwrap()) else {
            continue;
        };
        let counts = outboxd::fuzzing::compare_row_images(&flat(&[events]), None)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        for (ty, n) in counts {
            *total.entry(ty).or_insert(0) += n;
        }
        files += 1;
    }
    eprintln!("{files} fixtures, values compared per type: {total:?}");
    assert!(files >= 10, "{files} fixtures read");
    for ty in [
        "MYSQL_TYPE_LONG",
        "MYSQL_TYPE_JSON",
        "MYSQL_TYPE_VARCHAR",
        "MYSQL_TYPE_TIMESTAMP2",
    ] {
        assert!(
            total.keys().any(|k| k.contains(ty)),
            "no {ty} value in the fixtures: {total:?}"
        );
    }
}

/// Enum and set members: `'m1','m2',…`.
fn members(n: usize) -> String {
    (1..=n)
        .map(|i| format!("'m{i}'"))
        .collect::<Vec<_>>()
        .join(",")
}

const EVERY_TYPE: &str = "CREATE TABLE every_type (
    pk INT PRIMARY KEY,
    ti TINYINT, tiu TINYINT UNSIGNED, si SMALLINT, siu SMALLINT UNSIGNED,
    mi MEDIUMINT, miu MEDIUMINT UNSIGNED, i INT, iu INT UNSIGNED, bi BIGINT, biu BIGINT UNSIGNED,
    f FLOAT, d DOUBLE,
    dec1 DECIMAL(10,2), dec2 DECIMAL(65,30), dec3 DECIMAL(5,0), dec4 DECIMAL(18,9), dec5 DECIMAL(9,9),
    b1 BIT(1), b13 BIT(13), b64 BIT(64),
    dt DATE, tm TIME, tm3 TIME(3), tm6 TIME(6),
    dtm DATETIME, dtm1 DATETIME(1), dtm3 DATETIME(3), dtm6 DATETIME(6),
    ts TIMESTAMP NULL DEFAULT NULL, ts2 TIMESTAMP(2) NULL DEFAULT NULL, ts6 TIMESTAMP(6) NULL DEFAULT NULL,
    y YEAR,
    c10 CHAR(10) CHARACTER SET latin1, c255 CHAR(255) CHARACTER SET utf8mb4, bin16 BINARY(16),
    vc VARCHAR(10), vc300 VARCHAR(300) CHARACTER SET utf8mb4, vb VARBINARY(20),
    tt TINYTEXT, tx TEXT, mt MEDIUMTEXT, lt LONGTEXT,
    tb TINYBLOB, bl BLOB, mb MEDIUMBLOB, lb LONGBLOB,
    js JSON,
    e ENUM('a','b','c'), e300 ENUM(@E300), st SET('x','y','z'), st64 SET(@S64),
    g GEOMETRY, p POINT,
    u UUID, ip INET6
)";

/// Rows at the types' limits, NULLs, and ordinary values.
const ROWS: &str = "INSERT INTO every_type (pk) VALUES (1);
INSERT INTO every_type VALUES (2,
    -128, 0, -32768, 0, -8388608, 0, -2147483648, 0, -9223372036854775808, 0,
    -1.5, -2.25e300,
    -99999999.99, '-12345678901234567890123456789012345.123456789012345678901234567890', -99999, -123456789.123456789, -0.000000001,
    b'0', b'0', 0,
    '1000-01-01', '-838:59:59', '-838:59:58.999', '-00:00:00.000001',
    '1000-01-01 00:00:00', '1000-01-01 00:00:00.1', '1000-01-01 00:00:00.001', '1000-01-01 00:00:00.000001',
    '1970-01-01 00:00:01', '1970-01-01 00:00:01.01', '1970-01-01 00:00:01.000001',
    1901,
    '', '', '', '', '', '', '', '', '', '', '', '', '', '',
    '{}', 'a', 'm1', '', '',
    ST_GeomFromText('POINT(0 0)'), POINT(1, 2),
    '00000000-0000-0000-0000-000000000000', '::');
INSERT INTO every_type VALUES (3,
    127, 255, 32767, 65535, 8388607, 16777215, 2147483647, 4294967295, 9223372036854775807, 18446744073709551615,
    3.4e38, 1.7976931348623157e308,
    99999999.99, '12345678901234567890123456789012345.123456789012345678901234567890', 99999, 999999999.999999999, 0.999999999,
    b'1', b'1111111111111', 18446744073709551615,
    '9999-12-31', '838:59:59', '838:59:59.999', '838:59:59.999999',
    '9999-12-31 23:59:59', '9999-12-31 23:59:59.9', '9999-12-31 23:59:59.999', '9999-12-31 23:59:59.999999',
    '2038-01-19 03:14:07', '2038-01-19 03:14:07.99', '2038-01-19 03:14:07.999999',
    2155,
    'abcdefghij', REPEAT('é', 255), UNHEX(REPEAT('ff', 16)),
    'ten chars!', REPEAT('ß', 300), UNHEX('00ff00'),
    REPEAT('t', 255), REPEAT('x', 65535), REPEAT('m', 70000), REPEAT('l', 100000),
    UNHEX(REPEAT('00', 255)), REPEAT('b', 65535), REPEAT('n', 70000), REPEAT('o', 100000),
    '{\"a\": [1, 2.5, {\"b\": null}], \"c\": \"ü\", \"d\": true}', 'c', 'm300', 'x,y,z', @ALL64,
    ST_GeomFromText('LINESTRING(0 0, 1 1, 2 3)'), POINT(-1.5, 2.5),
    'f81d4fae-7dec-11d0-a765-00a0c91e6bf6', '2001:db8::1');
INSERT INTO every_type VALUES (4,
    0, 1, -1, 1, -1, 1, -1, 1, -1, 1,
    0.25, 1e-300,
    1499.90, '0.000000000000000000000000000001', 0, -0.5, 0.5,
    b'1', b'101', 5,
    '2026-12-07', '-00:00:01', '-00:00:01.5', '-12:34:56.789012',
    '2026-12-07 12:00:00', '2026-12-07 12:00:00.5', '2026-12-07 12:00:00.123', '2026-12-07 12:00:00.123456',
    '2026-12-07 12:00:00', '2026-12-07 12:00:00.5', '2026-12-07 12:00:00.123456',
    2026,
    'Safak', 'Muhammet Şafak', UNHEX('0192f3a45b6c7d8e9f00112233445566'),
    'invoice', 'invoice.issued', UNHEX('01'),
    'tiny', 'text', 'medium', 'long',
    UNHEX('02'), UNHEX('0304'), 'mb', 'lb',
    '[1, \"two\", {\"3\": [4]}]', 'b', 'm256', 'y', 'm1,m33,m64',
    NULL, POINT(0, 0),
    '0192f3a4-5b6c-7d8e-9f00-112233445566', '::ffff:10.0.0.1');
UPDATE every_type SET vc = 'updated', tm6 = '01:02:03.000004', js = '{\"x\": 1}', e300 = NULL WHERE pk = 4;
DELETE FROM every_type WHERE pk = 2;";

/// The binlog files the server wrote from `first` on, up to and with the one a FLUSH just
/// closed, as events.
async fn binlog_since(
    admin: &mut mysql_async::Conn,
    first: &str,
) -> Vec<Vec<outboxd::source::mysql::file::FileEvent>> {
    use mysql_async::prelude::Queryable;
    my_exec(admin, "FLUSH BINARY LOGS").await;
    let head = my_head().await.0;
    let rows: Vec<mysql_async::Row> = admin.query("SHOW BINARY LOGS").await.unwrap();
    let files: Vec<String> = rows.iter().map(|r| r.get(0).unwrap()).collect();
    let from = files.iter().position(|f| f == first).unwrap();
    let to = files.iter().position(|f| *f == head).unwrap();
    let basename = my_value(admin, "SELECT @@log_bin_basename").await.unwrap();
    let dir = Path::new(&basename).parent().unwrap().to_path_buf();
    files[from..to]
        .iter()
        .map(|f| {
            let bytes = std::fs::read(dir.join(f)).unwrap_or_else(|e| {
                panic!(
                    "the test reads the server's binlog {} (run it as root or as a member of the mysql group): {e}",
                    dir.join(f).display()
                )
            });
            events_from_bytes(f, &bytes).unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_mariadb_column_type_reads_like_mysql_common() {
    let db = MyDb::create("my_types").await;
    let mut admin = my_connect(None).await;
    let first = my_head().await.0;
    let mut c = db.conn().await;
    let all64 = (1..=64)
        .map(|i| format!("m{i}"))
        .collect::<Vec<_>>()
        .join(",");
    my_exec(
        &mut c,
        &EVERY_TYPE
            .replace("@E300", &members(300))
            .replace("@S64", &members(64)),
    )
    .await;
    my_exec(
        &mut c,
        &format!(
            "SET time_zone = '+00:00'; {}",
            ROWS.replace("@ALL64", &format!("'{all64}'"))
        ),
    )
    .await;
    my_exec(
        &mut c,
        "CREATE TABLE neg_time (pk INT PRIMARY KEY, t1 TIME(1), t2 TIME(2), t4 TIME(4));
         INSERT INTO neg_time VALUES
            (1, '-00:00:01.5', '-00:00:01.50', '-00:00:01.5000'),
            (2, '-838:59:58.9', '-838:59:58.99', '-01:00:00.0001'),
            (3, '00:00:00.1', '12:00:00.01', '-00:00:00.0001'),
            (4, '-00:00:00.1', '-00:00:00.01', '00:00:00')",
    )
    .await;
    let files = binlog_since(&mut admin, &first).await;
    let events = flat(&files);

    let counts =
        outboxd::fuzzing::compare_row_images(&events, Some((db.name.as_str(), "every_type")))
            .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("values compared per type: {counts:?}");
    // Every type the table has (UUID and INET6 are fixed-length strings in the binlog, POINT
    // a GEOMETRY, TEXT a BLOB, ENUM and SET are STRING in the table map's type byte).
    for ty in [
        "TINY",
        "SHORT",
        "INT24",
        "LONG",
        "LONGLONG",
        "FLOAT",
        "DOUBLE",
        "NEWDECIMAL",
        "BIT",
        "NEWDATE",
        "TIME2",
        "DATETIME2",
        "TIMESTAMP2",
        "YEAR",
        "STRING",
        "VARCHAR",
        "BLOB",
        "ENUM",
        "SET",
        "GEOMETRY",
    ] {
        let n: usize = counts
            .iter()
            .filter(|(k, _)| *k == &format!("Some(MYSQL_TYPE_{ty})"))
            .map(|(_, n)| n)
            .sum();
        assert!(n >= 2, "{n} MYSQL_TYPE_{ty} values compared: {counts:?}");
    }
    // The inserts (4 rows), the update (before and after) and the delete.
    let images =
        outboxd::fuzzing::read_row_images(&events, (db.name.as_str(), "every_type")).unwrap();
    assert_eq!(images.len(), 4 + 2 + 1, "row images of every_type");

    // Negative TIME(1)/TIME(2) fractions: `mysql_common` 0.37 reads them wrong (its
    // subtraction is unsigned there), the column reader as the server prints them.
    let images =
        outboxd::fuzzing::read_row_images(&events, (db.name.as_str(), "neg_time")).unwrap();
    assert_eq!(images.len(), 4);
    for (row, image) in images.iter().enumerate() {
        for (col, dec) in [(1, 1), (2, 2), (3, 4)] {
            let server = my_value(
                &mut c,
                &format!(
                    "SELECT CAST({} AS CHAR) FROM neg_time WHERE pk = {}",
                    ["", "t1", "t2", "", "t4"][dec],
                    row + 1
                ),
            )
            .await
            .unwrap();
            let ours = match &image[col] {
                Some(BinlogValue::Value(Value::Time(neg, d, h, m, s, us))) => {
                    let frac = format!("{us:06}");
                    format!(
                        "{}{:02}:{m:02}:{s:02}.{}",
                        if *neg { "-" } else { "" },
                        d * 24 + *h as u32,
                        &frac[..dec]
                    )
                }
                other => panic!("row {row} column {col}: {other:?}"),
            };
            assert_eq!(ours, server, "row {} TIME({dec})", row + 1);
        }
    }
}

/// Rows events of tables that are not outbox tables are passed over by their table id alone:
/// their bodies are never read, so not even a corrupt one stops the relay (it stopped at the
/// first, reading the event whole before it looked at the table).
#[test]
fn rows_of_other_tables_are_passed_over_unread() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/mysql-binlogs/mariadb-bin.000001");
    let mut bytes = std::fs::read(&path).unwrap();
    // Every rows event's extra-data length (after the 6-byte table id and 2 flag bytes; a
    // v1 event's column count) claims 65,535 bytes.
    let (mut at, mut mutated) = (4, 0);
    while at + 19 <= bytes.len() {
        let size = u32::from_le_bytes(bytes[at + 9..at + 13].try_into().unwrap()) as usize;
        if matches!(bytes[at + 4], 23..=25 | 30..=32) {
            bytes[at + 19 + 8] = 0xfc;
            bytes[at + 19 + 9] = 0xff;
            bytes[at + 19 + 10] = 0xff;
            mutated += 1;
        }
        at += size;
    }
    assert!(mutated > 0, "the fixture has rows events");
    crate::mysql_file::fix_checksums(&mut bytes);
    // mysql_common cannot read them any more …
    let events = events_from_bytes("mariadb-bin.000001", &bytes).unwrap();
    let unreadable = events
        .iter()
        .filter(|e| matches!(e.event.header().event_type_raw(), 23..=25 | 30..=32))
        .filter(|e| e.event.read_data().is_err())
        .count();
    assert_eq!(unreadable, mutated, "the mutated rows events do not parse");
    // … and the decoder, for an outbox table the file does not write, never tries.
    let table = outboxd::source::mysql::rows::OutboxTable {
        database: "no_such_db".into(),
        table: "outbox".into(),
        columns: Default::default(),
        tz: outboxd::source::mysql::rows::SourceTz::Utc,
        label: None,
    };
    let got = outboxd::source::mysql::file::outbox_events_from_bytes(
        &table,
        "mariadb-bin.000001",
        &bytes,
    )
    .unwrap();
    assert!(got.is_empty());
}
