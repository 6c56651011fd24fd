//! Savepoints, groups that end in `ROLLBACK`, and INCIDENT events in the binlog.
//!
//! A transaction that also wrote a non-transactional table (MEMORY, Aria with
//! TRANSACTIONAL=0, MyISAM) keeps the rows it rolled back to a savepoint in its binlog group,
//! followed by a `ROLLBACK TO` query event, and commits the group; a group that ends in a
//! `ROLLBACK` query is written whole too. None of those rows may be published.
//!
//! In process: groups built from the events of a real MariaDB binlog (the fuzz seed written by
//! fuzz/capture-seeds.sh, whose `outboxd_fuzz`.`outbox` has the default columns) with query
//! events made here, decoded as the file source does. End to end: the relay against the real
//! MariaDB, transactions with MEMORY and Aria side tables.

use crate::common;

use common::inproc::{InProc, Settings};
use common::*;
use mysql_async::prelude::Queryable;
use outboxd::event::SourcePosition;
use outboxd::source::mysql::file::{event_checksum, events_from_bytes, outbox_events_from_bytes};
use outboxd::source::mysql::rows::{OutboxTable, SourceTz};
use outboxd::{Error, OutboxEvent};
use std::path::PathBuf;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);
const NAME: &str = "sp-bin.000001";

fn seed() -> Vec<u8> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/binlog/seed-mariadb");
    std::fs::read(p).unwrap()
}

fn table() -> OutboxTable {
    OutboxTable {
        database: "outboxd_fuzz".into(),
        table: "outbox".into(),
        columns: Default::default(),
        tz: SourceTz::Utc,
        label: None,
    }
}

/// The raw events of the seed this file needs: its format description, a GTID event, the
/// outbox table's map, and three rows events of it: `created` (topic order.created, 1 row),
/// `paid` (order.paid and order.shipped, 2 rows), `blob` (topic blob, 1 row).
struct Parts {
    fde: Vec<u8>,
    gtid: Vec<u8>,
    map: Vec<u8>,
    created: Vec<u8>,
    paid: Vec<u8>,
    blob: Vec<u8>,
}

fn parts() -> Parts {
    let bytes = seed();
    let events = events_from_bytes("seed-mariadb", &bytes).unwrap();
    let raw = |i: usize| {
        let at = events[i].offset as usize;
        bytes[at..at + events[i].event.header().event_size() as usize].to_vec()
    };
    let of_type = |t: u8| -> Vec<usize> {
        (0..events.len())
            .filter(|&i| events[i].event.header().event_type_raw() == t)
            .collect()
    };
    // Write rows of table id 26 (the outbox; 27 is another table), in file order.
    let writes: Vec<usize> = of_type(23)
        .into_iter()
        .chain(of_type(30))
        .filter(|&i| raw(i)[19] == 26)
        .collect();
    assert_eq!(writes.len(), 3, "the seed's three outbox inserts");
    let map = of_type(19)
        .into_iter()
        .find(|&i| raw(i)[19] == 26)
        .expect("the outbox table map");
    Parts {
        fde: raw(of_type(15)[0]),
        gtid: raw(of_type(162)[0]),
        map: raw(map),
        created: raw(writes[0]),
        paid: raw(writes[1]),
        blob: raw(writes[2]),
    }
}

/// A query event (type 2) with `sql` in database `outboxd_fuzz`, without its CRC yet.
fn query(sql: &str) -> Vec<u8> {
    let db = b"outboxd_fuzz";
    let mut ev = vec![0u8; 19];
    ev[4] = 2;
    ev.extend_from_slice(&7u32.to_le_bytes()); // thread id
    ev.extend_from_slice(&0u32.to_le_bytes()); // exec time
    ev.push(db.len() as u8);
    ev.extend_from_slice(&0u16.to_le_bytes()); // error code
    ev.extend_from_slice(&0u16.to_le_bytes()); // no status variables
    ev.extend_from_slice(db);
    ev.push(0);
    ev.extend_from_slice(sql.as_bytes());
    ev.extend_from_slice(&[0; 4]);
    ev
}

/// An XID event (type 16): the end of a transactional group.
fn xid() -> Vec<u8> {
    let mut ev = vec![0u8; 19];
    ev[4] = 16;
    ev.extend_from_slice(&99u64.to_le_bytes());
    ev.extend_from_slice(&[0; 4]);
    ev
}

/// An INCIDENT event (type 26): incident number 1 (LOST_EVENTS) and its message.
fn incident(message: &str) -> Vec<u8> {
    let mut ev = vec![0u8; 19];
    ev[4] = 26;
    ev.extend_from_slice(&1u16.to_le_bytes());
    ev.push(message.len() as u8);
    ev.extend_from_slice(message.as_bytes());
    ev.extend_from_slice(&[0; 4]);
    ev
}

/// One event of a group made here.
enum E {
    /// A GTID event opening a transactional group.
    Begin,
    Q(&'static str),
    Created,
    Paid,
    Blob,
    Xid,
    Incident,
}

/// A binlog file: the seed's format description, then `events` with their sizes, end
/// positions, sequence numbers and checksums set.
fn file(events: &[E]) -> Vec<u8> {
    let p = parts();
    let mut out = b"\xfebin".to_vec();
    out.extend_from_slice(&p.fde);
    let mut seq = 100u64;
    for e in events {
        let mut ev = match e {
            E::Begin => {
                seq += 1;
                let mut g = p.gtid.clone();
                g[19..27].copy_from_slice(&seq.to_le_bytes());
                g
            }
            E::Q(sql) => query(sql),
            E::Xid => xid(),
            E::Incident => incident("error writing to the binary log"),
            rows => {
                let rows = match rows {
                    E::Created => &p.created,
                    E::Paid => &p.paid,
                    _ => &p.blob,
                };
                // Each rows event after the table map, as the server writes them.
                let mut m = p.map.clone();
                finish(&mut m, out.len());
                out.extend_from_slice(&m);
                rows.clone()
            }
        };
        finish(&mut ev, out.len());
        out.extend_from_slice(&ev);
    }
    out
}

/// Sets the header's size and end position for an event written at `at`, and its CRC32.
fn finish(ev: &mut [u8], at: usize) {
    let size = ev.len();
    ev[9..13].copy_from_slice(&(size as u32).to_le_bytes());
    ev[13..17].copy_from_slice(&((at + size) as u32).to_le_bytes());
    let crc = event_checksum(&ev[..size - 4]);
    ev[size - 4..].copy_from_slice(&crc.to_le_bytes());
}

fn decode(events: &[E]) -> Result<Vec<OutboxEvent>, Error> {
    outbox_events_from_bytes(&table(), NAME, &file(events))
}

fn topics(events: &[E]) -> Vec<String> {
    decode(events)
        .unwrap()
        .iter()
        .map(|e| e.topic.to_string())
        .collect()
}

fn index(e: &OutboxEvent) -> u32 {
    match &e.position {
        SourcePosition::Binlog { index, .. } => *index,
        other => panic!("not a binlog position: {other:?}"),
    }
}

#[test]
fn rows_rolled_back_to_a_savepoint_are_not_published() {
    use E::*;
    // The case as the server writes it: the rolled-back insert stays in the group, followed by
    // `ROLLBACK TO`, and the group commits.
    let got = decode(&[
        Begin,
        Q("SAVEPOINT `sp`"),
        Created,
        Q("ROLLBACK TO `sp`"),
        Blob,
        Xid,
    ])
    .unwrap();
    let t: Vec<&str> = got.iter().map(|e| &*e.topic).collect();
    assert_eq!(t, ["blob"], "only the row after the rollback");
    assert_eq!(
        index(&got[0]),
        0,
        "row numbers stay dense: {:?}",
        got[0].position
    );
    // Rows before the savepoint stay; the savepoint's name is an identifier: quoted or not,
    // any case, a doubled backtick inside.
    assert_eq!(
        topics(&[
            Begin,
            Created,
            Q("savepoint `a``b`"),
            Paid,
            Q("rollback work to savepoint `A``B`"),
            Xid,
        ]),
        ["order.created"]
    );
    assert_eq!(
        topics(&[
            Begin,
            Created,
            Q("SAVEPOINT Sp1"),
            Paid,
            Q("ROLLBACK TO SAVEPOINT sp1"),
            Blob,
            Xid,
        ]),
        ["order.created", "blob"]
    );
    // A group with a savepoint nothing rolled back to publishes everything.
    assert_eq!(
        topics(&[Begin, Q("SAVEPOINT `sp`"), Created, Paid, Xid]),
        ["order.created", "order.paid", "order.shipped"]
    );
}

#[test]
fn nested_released_and_moved_savepoints() {
    use E::*;
    // Nested: rolling back to the inner one keeps the outer one's rows; then to the outer.
    assert_eq!(
        topics(&[
            Begin,
            Created,
            Q("SAVEPOINT `outer`"),
            Paid,
            Q("SAVEPOINT `Inner`"),
            Blob,
            Q("ROLLBACK TO `INNER`"),
            Q("ROLLBACK TO `outer`"),
            Xid,
        ]),
        ["order.created"]
    );
    assert_eq!(
        topics(&[
            Begin,
            Q("SAVEPOINT `outer`"),
            Created,
            Q("SAVEPOINT `inner`"),
            Paid,
            Q("ROLLBACK TO `inner`"),
            Blob,
            Xid,
        ]),
        ["order.created", "blob"]
    );
    // A rollback to the outer savepoint forgets the inner one (the server forgets it too): a
    // later `ROLLBACK TO` naming it cannot say which rows it undid.
    let err = decode(&[
        Begin,
        Q("SAVEPOINT `outer`"),
        Created,
        Q("SAVEPOINT `inner`"),
        Q("ROLLBACK TO `outer`"),
        Paid,
        Q("ROLLBACK TO `inner`"),
        Xid,
    ])
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("`inner`") && err.contains(&format!("{NAME}:")) && err.contains("fix:"),
        "{err}"
    );
    // RELEASE forgets the savepoint: the same
    let err = decode(&[
        Begin,
        Q("SAVEPOINT `a`"),
        Created,
        Q("RELEASE SAVEPOINT `a`"),
        Q("ROLLBACK TO `a`"),
        Xid,
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("`a`"), "{err}");
    // … and rolling back to an earlier one still works.
    assert_eq!(
        topics(&[
            Begin,
            Q("SAVEPOINT `a`"),
            Created,
            Q("SAVEPOINT `b`"),
            Paid,
            Q("RELEASE SAVEPOINT `b`"),
            Blob,
            Q("ROLLBACK TO `a`"),
            Xid,
        ]),
        Vec::<String>::new()
    );
    // Declared again under the same name, a savepoint moves to the later place.
    assert_eq!(
        topics(&[
            Begin,
            Q("SAVEPOINT `s`"),
            Created,
            Q("SAVEPOINT `S`"),
            Paid,
            Q("ROLLBACK TO `s`"),
            Xid,
        ]),
        ["order.created"]
    );
}

#[test]
fn a_group_that_ends_in_rollback_publishes_nothing() {
    use E::*;
    let got = decode(&[Begin, Created, Paid, Q("ROLLBACK"), Begin, Blob, Xid]).unwrap();
    let t: Vec<&str> = got.iter().map(|e| &*e.topic).collect();
    assert_eq!(t, ["blob"], "only the next, committed group");
    assert_eq!(index(&got[0]), 0);
}

#[test]
fn an_incident_event_stops_with_its_position_and_the_fix() {
    use E::*;
    let bytes = file(&[Begin, Created, Xid, Incident, Begin, Blob, Xid]);
    let at = events_from_bytes(NAME, &bytes)
        .unwrap()
        .iter()
        .find(|e| e.event.header().event_type_raw() == 26)
        .unwrap()
        .offset;
    let err = outbox_events_from_bytes(&table(), NAME, &bytes).unwrap_err();
    assert!(
        matches!(err, Error::PositionLost { .. }),
        "exit code 3 like a lost position: {err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains(&format!("{NAME}:{at}"))
            && text.contains("LOST_EVENTS")
            && text.contains("error writing to the binary log")
            && text.contains("offset set")
            && text.contains("--binlog-position"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_exits_3_at_an_incident_in_a_binlog_file() {
    // The local MariaDB is a release build: it cannot be made to write an INCIDENT event. The
    // file source reads the same decoder; this runs the binary on such a file.
    use E::*;
    let dir = std::env::temp_dir().join(unique("outboxd_incident"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(NAME);
    std::fs::write(
        &path,
        file(&[Begin, Created, Xid, Incident, Begin, Blob, Xid]),
    )
    .unwrap();
    let mut relay = Relay::start(&[
        "run",
        "--source",
        &format!("file://{}", path.display()),
        "--table",
        "outboxd_fuzz.outbox",
        "--log-level",
        "info",
    ]);
    let code = relay.wait_exit(T).await;
    let err = relay.stderr_plain();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 3, "{err}");
    assert!(
        err.contains("INCIDENT") && err.contains(&format!("{NAME}:")) && err.contains("offset set"),
        "{err}"
    );
    assert!(
        !topics_of(&relay).iter().any(|t| t == "blob"),
        "nothing after the incident"
    );
}

// ---- End to end: the relay against the real MariaDB ------------------------------------------

fn run_args<'a>(dsn: &'a str, name: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--source",
        dsn,
        "--name",
        name,
        "--commit-offsets",
        "--log-level",
        "info",
    ]
}

/// The INSERT of one outbox row with topic `topic`. `UUID()` makes it row-based even in a
/// MIXED-format session (where a plain INSERT would be a statement).
fn ins(topic: &str) -> String {
    format!(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) \
         VALUES (UNHEX(REPLACE(UUID(), '-', '')), 1, '{topic}', JSON_OBJECT('t', '{topic}'), NOW(6))"
    )
}

/// The statements of a transaction, `;`-separated, with `{ins:TOPIC}` standing for [`ins`].
fn txn(parts: &[&str]) -> String {
    parts
        .iter()
        .map(|p| match p.strip_prefix("ins:") {
            Some(topic) => ins(topic),
            None => p.to_string(),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

fn topics_of(relay: &Relay) -> Vec<String> {
    parse_lines(&relay.lines())
        .iter()
        .map(|l| l["topic"].as_str().unwrap().to_string())
        .collect()
}

/// The query events the server wrote since `from` (`SHOW BINLOG EVENTS` Info column).
async fn queries_since(from: &(String, u64)) -> Vec<String> {
    let mut c = my_connect(None).await;
    let rows: Vec<(String, String)> = c
        .query_map(
            format!("SHOW BINLOG EVENTS IN '{}' FROM {}", from.0, from.1),
            |row: mysql_async::Row| {
                (
                    row.get::<String, _>(2).unwrap(),
                    row.get::<Vec<u8>, _>(5)
                        .map(|b| String::from_utf8_lossy(&b).into_owned())
                        .unwrap_or_default(),
                )
            },
        )
        .await
        .unwrap();
    rows.into_iter()
        .filter(|(kind, _)| kind == "Query")
        .map(|(_, info)| info)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn savepoint_rollbacks_beside_non_transactional_tables_are_not_published() {
    let db = MyDb::create("my_savepoint").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut c = db.conn().await;
    my_exec(
        &mut c,
        "CREATE TABLE side_mem (x INT) ENGINE=MEMORY; \
         CREATE TABLE side_aria (x INT) ENGINE=Aria TRANSACTIONAL=0; \
         CREATE TABLE side_inno (x INT) ENGINE=InnoDB",
    )
    .await;
    // `run --commit-offsets`, in-process: what is tested is which rows the binlog reader keeps.
    let relay = InProc::mariadb(&dsn, &Settings::new(&name));
    relay
        .wait_running("the relay's binlog dump", || db.streaming())
        .await;
    let from = my_head().await;

    // The case as reported: a MEMORY write, then a savepoint rolled back.
    my_exec(
        &mut c,
        &txn(&[
            "BEGIN",
            "INSERT INTO side_mem VALUES (1)",
            "SAVEPOINT sp",
            "ins:rolled.back",
            "ROLLBACK TO SAVEPOINT sp",
            "ins:kept",
            "COMMIT",
        ]),
    )
    .await;
    // Nested savepoints beside an Aria table; names in another case.
    my_exec(
        &mut c,
        &txn(&[
            "BEGIN",
            "ins:nested.keep1",
            "SAVEPOINT `outer`",
            "INSERT INTO side_aria VALUES (1)",
            "ins:nested.drop1",
            "SAVEPOINT `Inner`",
            "ins:nested.drop2",
            "ROLLBACK TO `inner`",
            "ins:nested.drop3",
            "ROLLBACK WORK TO SAVEPOINT `OUTER`",
            "ins:nested.keep2",
            "COMMIT",
        ]),
    )
    .await;
    // RELEASE forgets a savepoint; one declared again under its name moves.
    my_exec(
        &mut c,
        &txn(&[
            "BEGIN",
            "INSERT INTO side_inno VALUES (1)",
            "INSERT INTO side_mem VALUES (2)",
            "SAVEPOINT a",
            "ins:release.keep1",
            "RELEASE SAVEPOINT a",
            "SAVEPOINT b",
            "ins:release.keep2",
            "SAVEPOINT B",
            "ins:release.drop",
            "ROLLBACK TO b",
            "COMMIT",
        ]),
    )
    .await;
    // A group the server ends with a ROLLBACK query: a temporary table written in a MIXED
    // session makes it keep the group.
    my_exec(
        &mut c,
        &txn(&[
            "SET SESSION binlog_format = MIXED",
            "BEGIN",
            "ins:whole.rollback1",
            "CREATE TEMPORARY TABLE side_tmp (x INT) ENGINE=MEMORY",
            "INSERT INTO side_tmp VALUES (1)",
            "ins:whole.rollback2",
            "ROLLBACK",
            "DROP TEMPORARY TABLE side_tmp",
            "SET SESSION binlog_format = ROW",
        ]),
    )
    .await;
    // An XA transaction: its rows are held from its prepare to its commit; the undone one is
    // dropped from those.
    let xid = format!("'{}'", db.name);
    my_exec(
        &mut c,
        &txn(&[
            &format!("XA START {xid}"),
            "INSERT INTO side_mem VALUES (3)",
            "SAVEPOINT s",
            "ins:xa.drop",
            "ROLLBACK TO SAVEPOINT s",
            "ins:xa.keep",
            &format!("XA END {xid}"),
            &format!("XA PREPARE {xid}"),
            &format!("XA COMMIT {xid}"),
        ]),
    )
    .await;
    my_exec(&mut c, &ins("end.marker")).await;
    let head = db.head_past_writes().await;

    // The server did keep the undone rows in committed groups (else this proves nothing).
    let queries = queries_since(&from).await;
    for q in [
        "ROLLBACK TO `sp`",
        "ROLLBACK TO `inner`",
        "ROLLBACK TO `OUTER`",
        "ROLLBACK TO `b`",
        "ROLLBACK TO `s`",
        "ROLLBACK",
    ] {
        assert!(
            queries.iter().any(|i| i == q),
            "the binlog holds the query {q:?}: {queries:?}"
        );
    }

    relay
        .wait_events("the end marker", |events| {
            events.iter().any(|e| e.topic == "end.marker")
        })
        .await;
    relay
        .wait_running("the stored position past every group", || async {
            db.stored(&name)
                .await
                .is_some_and(|(f, p, _)| binlog_ge(&(f, p), &head))
        })
        .await;
    relay.stop().await;
    let topics: Vec<String> = relay
        .sink
        .confirmed()
        .into_iter()
        .map(|e| e.topic)
        .collect();
    assert_eq!(
        topics,
        [
            "kept",
            "nested.keep1",
            "nested.keep2",
            "release.keep1",
            "release.keep2",
            "xa.keep",
            "end.marker"
        ],
        "exactly the rows the transactions kept"
    );
    // What was committed in the table agrees.
    let kept: Vec<String> = c
        .query("SELECT topic FROM outbox ORDER BY created_at, topic")
        .await
        .unwrap();
    assert_eq!(kept.len(), 7, "{kept:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_transaction_that_rolls_back_to_a_savepoint_stops_with_the_fix() {
    let db = MyDb::create("my_savepoint_big").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut c = db.conn().await;
    my_exec(&mut c, "CREATE TABLE side_mem (x INT) ENGINE=MEMORY").await;
    // A buffer of a few rows: the transactions below are streamed (scanned to their end
    // first, then read again), not held.
    let mut args = run_args(&dsn, &name);
    args.extend_from_slice(&["--txn-buffer", "2000"]);
    let mut relay = Relay::start(&args);
    relay
        .wait_running("the relay's binlog dump", T, || db.streaming())
        .await;
    let many = |topic: &str| vec![format!("ins:{topic}"); 20];

    // A large group the server ends in ROLLBACK: all of it undone while scanning, nothing
    // sent; the relay goes on.
    let mut parts = vec![
        "SET SESSION binlog_format = MIXED".to_string(),
        "BEGIN".into(),
        "CREATE TEMPORARY TABLE side_tmp (x INT) ENGINE=MEMORY".into(),
        "INSERT INTO side_tmp VALUES (1)".into(),
    ];
    parts.extend(many("whole.rollback"));
    parts.extend([
        "ROLLBACK".into(),
        "DROP TEMPORARY TABLE side_tmp".into(),
        "SET SESSION binlog_format = ROW".into(),
    ]);
    my_exec(
        &mut c,
        &txn(&parts.iter().map(String::as_str).collect::<Vec<_>>()),
    )
    .await;
    my_exec(&mut c, &ins("mid")).await;
    let lines = relay.lines.clone();
    relay
        .wait_running("the row after the rolled-back group", T, || {
            let done = lines.lock().unwrap().iter().any(|l| l.contains("\"mid\""));
            async move { done }
        })
        .await;

    // A large transaction that rolls back to a savepoint while it is scanned: the relay
    // stops before any of it goes out, with the fix.
    let before_big = my_head().await;
    let mut parts = vec![
        "BEGIN".to_string(),
        "INSERT INTO side_mem VALUES (1)".into(),
    ];
    parts.extend(many("big.keep"));
    parts.push("SAVEPOINT sp".into());
    parts.extend(many("big.drop"));
    parts.extend(["ROLLBACK TO SAVEPOINT sp".into(), "COMMIT".into()]);
    exec_parts(&mut c, &parts).await;
    assert_eq!(relay.wait_exit(T).await, 2, "{}", relay.stderr());
    stopped_before(&relay, &db, &name, "ROLLBACK TO `sp`", &before_big).await;

    // One that rolls back while its rows still fit the buffer, and grows past it after: the
    // rows before the rollback would go out first when it is streamed, so it stops too.
    let before_big2 = my_head().await;
    let mut parts = vec![
        "BEGIN".to_string(),
        "INSERT INTO side_mem VALUES (2)".into(),
        "SAVEPOINT sp2".into(),
    ];
    parts.extend(vec!["ins:big2.drop".to_string(); 3]);
    parts.push("ROLLBACK TO SAVEPOINT sp2".into());
    parts.extend(vec!["ins:big2.keep".to_string(); 60]);
    parts.push("COMMIT".into());
    exec_parts(&mut c, &parts).await;
    my_exec(&mut c, &ins("after.big")).await;

    // A buffer that holds the first (40 rows): only its kept rows arrive; the second stops.
    let mut args = run_args(&dsn, &name);
    args.extend_from_slice(&["--txn-buffer", "8000"]);
    let mut relay = Relay::start(&args);
    assert_eq!(relay.wait_exit(T).await, 2, "{}", relay.stderr());
    stopped_before(&relay, &db, &name, "ROLLBACK TO `sp2`", &before_big2).await;
    // (Rows handed to the sink before the stop may not have been written: they were not
    // confirmed, so the next start reads them again.)
    let second = big_topics(&relay);
    assert!(second.iter().all(|t| t == "big.keep"), "{second:?}");
    let mut first_kept = ids_with_topic(&relay, "big.keep");

    // With a buffer that holds the second, only its kept rows arrive.
    let mut args = run_args(&dsn, &name);
    args.extend_from_slice(&["--txn-buffer", "1000000"]);
    let mut relay = Relay::start(&args);
    let lines = relay.lines.clone();
    relay
        .wait_running("the row after the large transactions", T, || {
            let done = lines
                .lock()
                .unwrap()
                .iter()
                .any(|l| l.contains("after.big"));
            async move { done }
        })
        .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let third = big_topics(&relay);
    assert!(
        third.iter().all(|t| t == "big.keep" || t == "big2.keep"),
        "{third:?}"
    );
    assert_eq!(ids_with_topic(&relay, "big2.keep").len(), 60, "{third:?}");
    first_kept.extend(ids_with_topic(&relay, "big.keep"));
    assert_eq!(first_kept.len(), 20, "every kept row of the first one");
}

fn ids_with_topic(relay: &Relay, topic: &str) -> std::collections::HashSet<String> {
    parse_lines(&relay.lines())
        .iter()
        .filter(|l| l["topic"] == topic)
        .map(|l| l["id"].as_str().unwrap().to_string())
        .collect()
}

async fn exec_parts(c: &mut mysql_async::Conn, parts: &[String]) {
    my_exec(
        c,
        &txn(&parts.iter().map(String::as_str).collect::<Vec<_>>()),
    )
    .await;
}

/// The topics of rows of the large transactions (and of the rolled-back group) a relay printed.
fn big_topics(relay: &Relay) -> Vec<String> {
    topics_of(relay)
        .into_iter()
        .filter(|t| t.starts_with("big") || t.starts_with("whole."))
        .collect()
}

/// The relay stopped at the large transaction starting at `before` because of `statement`,
/// with the fix, having published nothing of it, and its stored position stays before it.
async fn stopped_before(
    relay: &Relay,
    db: &MyDb,
    name: &str,
    statement: &str,
    before: &(String, u64),
) {
    let err = relay.stderr_plain();
    assert!(
        err.contains(statement)
            && err.contains("nothing of it was published")
            && err.contains("fix: raise --txn-buffer above"),
        "{err}"
    );
    let prefix = if statement.ends_with("`sp`") {
        "big."
    } else {
        "big2."
    };
    let t = topics_of(relay);
    assert!(
        t.iter()
            .all(|t| !t.starts_with(prefix) && !t.starts_with("whole.")),
        "nothing of the rolled-back group or the stopped transaction: {t:?}"
    );
    let (f, p, _) = db.stored(name).await.expect("a stored position");
    assert!(
        binlog_ge(before, &(f.clone(), p)),
        "the stored position {f}:{p} stays before the transaction at {before:?}"
    );
}
