//! Switching from a running Debezium connector to outboxd without a gap or a repeat
//! (docs/migrating-from-debezium.md, "Switching over"). A stand-in plays the connector: it
//! publishes part of the outbox's stream and stops the way Debezium leaves its position —
//! on Postgres, its slot confirmed at the end of the last transaction it completed before the
//! one its last record came from, and its offset `{lsn_commit, lsn, txId}` pointing at that
//! record; on MariaDB, its offset `{file, pos, event, row}` at the start of the transaction its
//! last record came from, counting events as the connector does. outboxd takes the offset over
//! (`outboxd offset set --from-debezium`) and runs: everything the stand-in did not publish
//! arrives, nothing it published arrives again.

use crate::common::{self, my_exec, my_value, Relay};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

/// Runs `outboxd args…` to its end: (exit code, stdout, stderr).
async fn outboxd(args: &[&str]) -> (i32, String, String) {
    let mut p = Relay::start(args);
    let code = p.wait_exit(T).await;
    (code, p.lines().join("\n"), p.stderr_plain())
}

/// What the stand-in saw of the slot: per transaction, its xid, end LSN and its outbox
/// inserts (id, LSN).
struct PeekedTx {
    xid: u32,
    end_lsn: u64,
    inserts: Vec<(Uuid, u64)>,
}

/// The transactions `slot` holds, read as a pgoutput client reads them (without consuming).
async fn peek(client: &tokio_postgres::Client, slot: &str, publication: &str) -> Vec<PeekedTx> {
    use outboxd::source::postgres::pgoutput::{decode, Message, Value};
    let rows = client
        .query(
            "SELECT lsn::text, data FROM pg_logical_slot_peek_binary_changes($1, NULL, NULL,
               'proto_version', '1', 'publication_names', $2)",
            &[&slot, &publication],
        )
        .await
        .unwrap();
    let mut outbox_rel = None;
    let mut out = Vec::new();
    let mut open: Option<PeekedTx> = None;
    for r in rows {
        let lsn = outboxd::event::parse_lsn(r.get::<_, &str>(0)).unwrap();
        match decode(bytes::Bytes::from(r.get::<_, Vec<u8>>(1))).unwrap() {
            Message::Relation(rel) if rel.name == "outbox" => outbox_rel = Some(rel.id),
            Message::Begin { xid, .. } => {
                open = Some(PeekedTx {
                    xid,
                    end_lsn: 0,
                    inserts: Vec::new(),
                })
            }
            Message::Insert { relation_id, tuple } if Some(relation_id) == outbox_rel => {
                let Value::Text(id) = &tuple[0] else {
                    panic!("an id")
                };
                let id = Uuid::parse_str(std::str::from_utf8(id).unwrap()).unwrap();
                open.as_mut().unwrap().inserts.push((id, lsn));
            }
            Message::Commit { end_lsn, .. } => {
                let mut tx = open.take().unwrap();
                tx.end_lsn = end_lsn;
                out.push(tx);
            }
            _ => {}
        }
    }
    out
}

async fn pg_insert_tx(client: &mut tokio_postgres::Client, n: usize) -> Vec<Uuid> {
    let tx = client.transaction().await.unwrap();
    let mut ids = Vec::new();
    for _ in 0..n {
        let id = Uuid::now_v7();
        tx.execute(
            "INSERT INTO outbox VALUES ($1, 'Order', 'o-1', 'OrderCreated', '{}')",
            &[&id],
        )
        .await
        .unwrap();
        ids.push(id);
    }
    tx.commit().await.unwrap();
    ids
}

/// Postgres: the stand-in publishes three transactions (2, 1 and 2 outbox rows, a transaction
/// of another table between them) and stops after the third's last row: its slot confirmed at
/// the second's end, its offset at the third's last insert. outboxd takes the slot and the
/// offset over; it publishes the transactions written since, and none of the three. A
/// stand-in stopped inside the third is refused with both choices.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_takeover_from_debeziums_slot_publishes_no_gap_and_no_repeat() {
    let db = common::PgDb::create("dbztake").await;
    let mut client = db.client().await;
    let slot = common::unique("dbz");
    client
        .batch_execute(
            "DROP TABLE outbox;
             CREATE TABLE outbox (id uuid NOT NULL PRIMARY KEY, aggregatetype varchar(255) NOT NULL,
               aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb);
             CREATE TABLE customers (id int PRIMARY KEY);
             CREATE PUBLICATION dbz_publication FOR ALL TABLES",
        )
        .await
        .unwrap();
    client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();
    let mut written = Vec::new();
    written.push(pg_insert_tx(&mut client, 2).await);
    client
        .batch_execute("INSERT INTO customers VALUES (1)")
        .await
        .unwrap();
    written.push(pg_insert_tx(&mut client, 1).await);
    written.push(pg_insert_tx(&mut client, 2).await);

    // The stand-in reads the stream and publishes the three transactions' rows.
    let held = peek(&client, &slot, "dbz_publication").await;
    let txs: Vec<&PeekedTx> = held.iter().filter(|t| !t.inserts.is_empty()).collect();
    assert_eq!(txs.len(), 3, "three outbox transactions in the slot");
    for (tx, ids) in txs.iter().zip(&written) {
        assert_eq!(
            tx.inserts.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
            *ids
        );
    }
    let published: Vec<Uuid> = written.iter().flatten().copied().collect();
    // It stops: its last record is the third transaction's last row, so it confirms the end of
    // the second to its slot and stores the record's offset.
    let (second, third) = (txs[1], txs[2]);
    let lsn_commit = outboxd::event::format_lsn(second.end_lsn);
    client
        .execute(
            "SELECT pg_replication_slot_advance($1, $2::text::pg_lsn)",
            &[&slot, &lsn_commit],
        )
        .await
        .unwrap();
    let offset = |last: u64| {
        format!(
            r#"{{"transaction_id":null,"lsn_proc":{last},"messageType":"INSERT","lsn_commit":{},"lsn":{last},"txId":{},"ts_usec":1700000000000000}}"#,
            second.end_lsn, third.xid
        )
    };
    // Rows committed while the connector was stopped.
    let after_stop = pg_insert_tx(&mut client, 2).await;

    let dsn = db.dsn();
    let name = common::unique("r");
    let base = [
        "--source",
        dsn.as_str(),
        "--name",
        name.as_str(),
        "--slot",
        slot.as_str(),
        "--publication",
        "dbz_publication",
    ];
    // Stopped inside the third transaction: refused, with both choices.
    let inside = offset(third.inserts[0].1);
    let mut args = vec!["offset", "set"];
    args.extend(base);
    args.extend(["--from-debezium", inside.as_str()]);
    let (code, _, err) = outboxd(&args).await;
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("1 of its 2 outbox rows were published") && err.contains("--lsn"),
        "{err}"
    );

    // As Kafka Connect's offsets topic prints it (key, tab, value; the newest record last),
    // in a file.
    let printed = std::env::temp_dir().join(format!("{name}.offsets"));
    std::fs::write(
        &printed,
        format!(
            "[\"outbox-connector\",{{\"server\":\"dbserver1\"}}]\t{}\n[\"outbox-connector\",{{\"server\":\"dbserver1\"}}]\t{}\n",
            offset(third.inserts[0].1),
            offset(third.inserts[1].1)
        ),
    )
    .unwrap();
    let last = printed.to_string_lossy().into_owned();
    let mut args = vec!["offset", "set"];
    args.extend(base);
    args.extend(["--from-debezium", last.as_str()]);
    let (code, out, err) = outboxd(&args).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert_eq!(
        db.slot_confirmed(&slot).await.as_deref(),
        Some(outboxd::event::format_lsn(third.end_lsn).as_str()),
        "the slot moved past the third transaction: {out}"
    );

    let _ = std::fs::remove_file(&printed);
    let mut args = vec!["run"];
    args.extend(base);
    args.extend(["--column", "debezium", "--snapshot", "never"]);
    let mut relay = Relay::start(&args);
    wait_for_slot_active(&db, &slot).await;
    let while_running = pg_insert_tx(&mut client, 1).await;
    let expected: Vec<Uuid> = after_stop.iter().chain(&while_running).copied().collect();
    common::wait_lines("the events after the stand-in", &relay, expected.len(), T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let got = common::printed_ids(&relay);
    assert_eq!(
        got, expected,
        "exactly what the stand-in did not publish, in order"
    );
    assert!(
        got.iter().all(|id| !published.contains(id)),
        "nothing the stand-in published came again"
    );
}

async fn wait_for_slot_active(db: &common::PgDb, slot: &str) {
    common::wait_for("outboxd streaming from the connector's slot", T, || {
        db.slot_active(slot)
    })
    .await;
}

/// One MariaDB transaction of `rows` outbox rows, `per_statement` per INSERT: the ids and the
/// transaction's GTID.
async fn my_insert_tx(
    conn: &mut mysql_async::Conn,
    rows: usize,
    per_statement: usize,
) -> (Vec<Uuid>, String) {
    my_exec(conn, "START TRANSACTION").await;
    let mut ids = Vec::new();
    for chunk in (0..rows).collect::<Vec<_>>().chunks(per_statement) {
        let values: Vec<String> = chunk
            .iter()
            .map(|_| {
                let id = Uuid::now_v7();
                ids.push(id);
                format!("('{id}', 'Order', 'o-1', 'OrderCreated', '{{}}')")
            })
            .collect();
        my_exec(
            conn,
            &format!("INSERT INTO outbox VALUES {}", values.join(", ")),
        )
        .await;
    }
    my_exec(conn, "COMMIT").await;
    let gtid = my_value(conn, "SELECT @@last_gtid").await.unwrap();
    (ids, gtid)
}

/// The binlog events of the transaction with `gtid`, as `SHOW BINLOG EVENTS` lists them:
/// (file, start position of each, event type of each).
async fn binlog_events_of(gtid: &str) -> (String, Vec<(u64, String)>) {
    use mysql_async::prelude::Queryable;
    let mut c = common::my_connect(None).await;
    let logs: Vec<mysql_async::Row> = c.query("SHOW BINARY LOGS").await.unwrap();
    for log in logs.iter().rev() {
        let file: String = log.get(0).unwrap();
        let events: Vec<mysql_async::Row> = c
            .query(format!("SHOW BINLOG EVENTS IN '{file}'"))
            .await
            .unwrap();
        let Some(start) = events.iter().position(|e| {
            let info: Vec<u8> = e.get(5).unwrap_or_default();
            String::from_utf8_lossy(&info).contains(&format!("GTID {gtid}"))
        }) else {
            continue;
        };
        let mut out = Vec::new();
        for e in &events[start..] {
            let kind: String = e.get(2).unwrap();
            out.push((e.get::<u64, _>(1).unwrap(), kind.clone()));
            if kind == "Xid" || kind == "Query" && out.len() > 1 {
                break;
            }
        }
        return (file, out);
    }
    panic!("the transaction {gtid} is in no binlog file");
}

/// MariaDB: the stand-in publishes three transactions (a two-row INSERT; one row; two
/// one-row INSERTs) and stops after the third's last row: its offset is the third's start
/// with the connector's event and row counts (a connector without include.query is not sent
/// ANNOTATE_ROWS events, so it does not count them). outboxd takes the offset over and
/// publishes only what was committed after. Stopped inside the third, or counted with
/// ANNOTATE_ROWS events but taken without --debezium-include-query: refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_takeover_from_debeziums_offset_publishes_no_gap_and_no_repeat() {
    let db = common::MyDb::create("dbztake").await;
    let mut conn = db.conn().await;
    my_exec(
        &mut conn,
        "DROP TABLE outbox; CREATE TABLE outbox (id CHAR(36) NOT NULL PRIMARY KEY,
           aggregatetype VARCHAR(255) NOT NULL, aggregateid VARCHAR(255) NOT NULL,
           type VARCHAR(255) NOT NULL, payload JSON)",
    )
    .await;
    let (first, _) = my_insert_tx(&mut conn, 2, 2).await;
    let (second, _) = my_insert_tx(&mut conn, 1, 1).await;
    let (third, gtid) = my_insert_tx(&mut conn, 2, 1).await;
    let published: Vec<Uuid> = first.iter().chain(&second).chain(&third).copied().collect();

    // The connector's view of the third transaction: its events without ANNOTATE_ROWS.
    let (file, events) = binlog_events_of(&gtid).await;
    let begin = events[0].0;
    let seen: Vec<&str> = events
        .iter()
        .map(|(_, k)| k.as_str())
        .filter(|k| *k != "Annotate_rows")
        .collect();
    let rows_events: Vec<usize> = seen
        .iter()
        .enumerate()
        .filter(|(_, k)| k.starts_with("Write_rows"))
        .map(|(i, _)| i)
        .collect();
    assert_eq!(rows_events.len(), 2, "two INSERTs: {seen:?}");
    let offset = |event: usize, row: usize| {
        format!(
            r#"{{"ts_sec":1700000000,"file":"{file}","pos":{begin},"row":{row},"server_id":1,"event":{event}}}"#
        )
    };
    // Rows committed while the connector was stopped.
    let (after_stop, _) = my_insert_tx(&mut conn, 2, 1).await;

    let dsn = db.dsn();
    let name = common::unique("r");
    let base = [
        "--source",
        dsn.as_str(),
        "--name",
        name.as_str(),
        "--column",
        "debezium",
    ];
    let set = |o: String, extra: &'static [&'static str]| {
        let mut args: Vec<String> = ["offset", "set"].iter().map(|s| s.to_string()).collect();
        args.extend(base.iter().map(|s| s.to_string()));
        args.extend(["--from-debezium".to_string(), o]);
        args.extend(extra.iter().map(|s| s.to_string()));
        args
    };
    let run = |args: Vec<String>| async move {
        let a: Vec<&str> = args.iter().map(String::as_str).collect();
        outboxd(&a).await
    };
    // Stopped after the third transaction's first row.
    let (code, _, err) = run(set(offset(rows_events[0], 1), &[])).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("2 outbox rows, 1 of them published"), "{err}");
    assert!(err.contains("--binlog-position"), "{err}");
    // Counted with ANNOTATE_ROWS events (include.query=true), taken without the flag.
    let annotated: Vec<&str> = events.iter().map(|(_, k)| k.as_str()).collect();
    let last_with_annotate = annotated
        .iter()
        .rposition(|k| k.starts_with("Write_rows"))
        .unwrap();
    assert!(
        annotated.contains(&"Annotate_rows"),
        "MariaDB writes ANNOTATE_ROWS events (binlog_annotate_row_events, on by default): {annotated:?}"
    );
    let (code, _, err) = run(set(offset(last_with_annotate, 1), &[])).await;
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("include.query"), "{err}");
    let (code, out, err) = run(set(
        offset(last_with_annotate, 1),
        &["--debezium-include-query"],
    ))
    .await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("resuming after it"), "{out}");
    // Stopped after its last row.
    let (code, out, err) = run(set(offset(rows_events[1], 1), &[])).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("resuming after it"), "{out}");

    let mut args = vec!["run"];
    args.extend(base);
    let mut relay = Relay::start(&args);
    common::wait_for("the binlog dump", T, || db.streaming()).await;
    let (while_running, _) = my_insert_tx(&mut conn, 1, 1).await;
    let expected: Vec<Uuid> = after_stop.iter().chain(&while_running).copied().collect();
    common::wait_lines("the events after the stand-in", &relay, expected.len(), T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let got = common::printed_ids(&relay);
    assert_eq!(
        got, expected,
        "exactly what the stand-in did not publish, in order"
    );
    assert!(got.iter().all(|id| !published.contains(id)));
}
