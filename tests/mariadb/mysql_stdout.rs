//! MariaDB source → stdout sink, end to end against the real server: what arrives, what never
//! does, every value type the contract lists decoded exactly, and that the stored position
//! follows only what was written out.

use crate::common;

use common::*;
use mysql_async::prelude::Queryable;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

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

fn ids_of(lines: &[serde_json::Value]) -> Vec<Uuid> {
    lines
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

/// The payload of a stdout line exactly as written (not re-serialised).
fn raw_payload(line: &str) -> String {
    #[derive(serde::Deserialize)]
    struct L<'a> {
        #[serde(borrow)]
        payload: &'a serde_json::value::RawValue,
    }
    serde_json::from_str::<L>(line)
        .unwrap()
        .payload
        .get()
        .to_string()
}

async fn start_streaming(db: &MyDb, args: &[&str]) -> Relay {
    let relay = Relay::start(args);
    wait_for("the relay's binlog dump to be connected", T, || {
        db.streaming()
    })
    .await;
    relay
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_arrive_and_nothing_else() {
    let db = MyDb::create("my_e2e").await;
    let other = MyDb::create("my_e2e_other").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;

    let mut c = db.conn().await;
    my_exec(
        &mut c,
        "CREATE TABLE invoices (id BIGINT AUTO_INCREMENT PRIMARY KEY, total DECIMAL(10,2))",
    )
    .await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();

    let mut expected = my_write_events(&mut c, 50, 100, "invoice.issued").await;
    // A rolled-back transaction: never.
    let rolled_back = {
        let mut tx = c.start_transaction(Default::default()).await.unwrap();
        let id = outbox
            .write(
                &mut tx,
                "invoice.issued",
                "1",
                &serde_json::json!({"rolled": "back"}),
            )
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        id
    };
    // Inserted and deleted in one transaction, beside another table: arrives.
    {
        let mut tx = c.start_transaction(Default::default()).await.unwrap();
        let id = outbox
            .write(
                &mut tx,
                "invoice.voided",
                "2",
                &serde_json::json!({"deleted": true}),
            )
            .await
            .unwrap();
        tx.exec_drop("DELETE FROM outbox WHERE id = ?", (id.as_bytes().to_vec(),))
            .await
            .unwrap();
        tx.query_drop("INSERT INTO invoices (total) VALUES (1)")
            .await
            .unwrap();
        tx.commit().await.unwrap();
        expected.push(id);
    }
    // Another database's outbox: never.
    let other_id = {
        let mut oc = other.conn().await;
        let mut tx = oc.start_transaction(Default::default()).await.unwrap();
        let id = outbox
            .write(
                &mut tx,
                "invoice.issued",
                "3",
                &serde_json::json!({"db": "other"}),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        id
    };
    // Updates of outbox rows (poll-mode bookkeeping by someone else): never events.
    my_exec(&mut c, "UPDATE outbox SET status = 'published' LIMIT 10").await;
    expected.extend(my_write_events(&mut c, 50, 100, "invoice.paid").await);
    assert_eq!(expected.len(), 10_001);

    wait_for("10,001 lines on stdout", T, || {
        let n = relay.line_count();
        async move { n >= 10_001 }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());

    let raw = relay.lines();
    let lines = parse_lines(&raw);
    assert_eq!(lines.len(), 10_001, "exactly the committed outbox rows");
    let got = ids_of(&lines);
    assert_eq!(
        got, expected,
        "commit order, nothing missing, nothing extra"
    );
    assert!(!got.contains(&rolled_back));
    assert!(!got.contains(&other_id));

    // Fields as the contract says, checked against the table.
    for i in [0usize, 4321, 9999] {
        let row: (Vec<u8>, i64, String, Vec<u8>, String) = c
            .exec_first(
                "SELECT id, aggregate_id, topic, payload, DATE_FORMAT(created_at, '%Y-%m-%dT%H:%i:%s.%fZ')
                   FROM outbox WHERE id = ?",
                (expected[i].as_bytes().to_vec(),),
            )
            .await
            .unwrap()
            .unwrap();
        let l = &lines[i];
        assert_eq!(
            row.0,
            expected[i].as_bytes().to_vec(),
            "id bytes in RFC 4122 order"
        );
        assert_eq!(l["aggregate_id"], row.1.to_string());
        assert_eq!(l["topic"], row.2);
        assert_eq!(
            raw_payload(&raw[i]).as_bytes(),
            row.3.as_slice(),
            "payload byte for byte"
        );
        assert_eq!(l["created_at"], row.4, "created_at with microseconds");
    }
    assert_eq!(lines[42]["payload"]["customer"], "Ayşe 🧾");
    let positions: Vec<&str> = lines
        .iter()
        .map(|l| l["position"].as_str().unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "positions increase in commit order"
    );
    assert_eq!(lines[10_000]["topic"], "invoice.paid");

    // The position was stored, at or past the end of the last transaction.
    let (file, pos, gtid) = db.stored(&name).await.expect("a stored position");
    let last: Vec<&str> = positions.last().unwrap().split(':').collect();
    assert_eq!(file, last[0]);
    assert!(
        pos >= last[1].parse::<u64>().unwrap(),
        "{pos} < {}",
        last[1]
    );
    assert!(
        gtid.is_some_and(|g| !g.is_empty()),
        "MariaDB GTID state stored"
    );

    // A restart delivers nothing again (zero duplicates after SIGTERM).
    let relay2 = start_streaming(&db, &run_args(&dsn, &name)).await;
    let more = my_write_events(&mut c, 1, 3, "after.restart").await;
    wait_for("3 new lines", T, || {
        let n = relay2.line_count();
        async move { n >= 3 }
    })
    .await;
    let ids2 = ids_of(&parse_lines(&relay2.lines()));
    assert_eq!(
        ids2, more,
        "only the new events, none from before the restart"
    );
    let set: HashSet<_> = got.iter().collect();
    assert!(ids2.iter().all(|i| !set.contains(i)));
}

/// Runs a relay until `n` lines arrived, stops it, returns the raw lines.
async fn relay_lines(
    db: &MyDb,
    extra: &[&str],
    write: impl std::future::Future<Output = ()>,
    n: usize,
) -> Vec<String> {
    let name = unique("r");
    let dsn = db.dsn();
    let mut args = run_args(&dsn, &name);
    args.extend_from_slice(extra);
    let mut relay = start_streaming(db, &args).await;
    write.await;
    relay.lines_then_stop(n, T).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_ids_bigints_unicode_and_a_megabyte_decode_exactly() {
    let db = MyDb::create("my_values").await;
    let big = format!("{{\"blob\":\"{}\"}}", "x".repeat(1024 * 1024));
    let payloads: Vec<String> = vec![
        r#"{"name":"Ayşe Ğüç 中文 Ελληνικά 🧾🚀","e":"\u00e9"}"#.to_string(),
        r#"{ "spaced" :  [1, 2 ,3] ,"b":null }"#.to_string(),
        r#"[]"#.to_string(),
        big.clone(),
    ];
    let ids: Vec<Vec<u8>> = vec![
        // trailing 0x00 bytes: the binlog drops them, the relay pads them back
        hex("0102030405060708090a0b0c0d0e0000"),
        // not UTF-8 at all
        hex("fffefdfcfbfaf9f8f7f6f5f4f3f2f1f0"),
        // all zero: the binlog sends an empty value
        vec![0u8; 16],
        hex("c0ffee00000000000000000000000001"),
    ];
    let aggs = ["-9223372036854775808", "-1", "0", "9223372036854775807"];
    let write = async {
        let mut c = db.conn().await;
        let mut tx = c.start_transaction(Default::default()).await.unwrap();
        for i in 0..4 {
            tx.exec_drop(
                "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (?, ?, ?, ?, '2026-01-02 03:04:05.000007')",
                (ids[i].clone(), aggs[i], format!("t.{i}"), payloads[i].clone()),
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    };
    let raw = relay_lines(&db, &[], write, 4).await;
    let lines = parse_lines(&raw);
    for i in 0..4 {
        assert_eq!(
            Uuid::parse_str(lines[i]["id"].as_str().unwrap())
                .unwrap()
                .as_bytes()
                .to_vec(),
            ids[i],
            "id {i} byte for byte"
        );
        assert_eq!(lines[i]["aggregate_id"], aggs[i]);
        assert_eq!(
            raw_payload(&raw[i]),
            payloads[i],
            "payload {i} byte for byte"
        );
        assert_eq!(lines[i]["created_at"], "2026-01-02T03:04:05.000007Z");
        assert!(lines[i].get("poison").is_none(), "{}", lines[i]);
    }
    assert_eq!(lines[0]["payload"]["name"], "Ayşe Ğüç 中文 Ελληνικά 🧾🚀");
    assert!(raw[3].len() > 1024 * 1024);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn variant_column_types_decode() {
    let db = MyDb::create("my_variant").await;
    let mut c = db.conn().await;
    my_exec(
        &mut c,
        "DROP TABLE outbox;
         CREATE TABLE outbox (
            note          VARCHAR(10) NULL,
            event_id      CHAR(36) NOT NULL PRIMARY KEY,
            aggregate_id  BIGINT UNSIGNED NOT NULL,
            topic         CHAR(40) NOT NULL,
            payload       LONGTEXT NOT NULL,
            created_at    TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
            headers       JSON NULL,
            version       SMALLINT NULL
         );
         CREATE TABLE outbox2 (
            id            BINARY(16) NOT NULL PRIMARY KEY,
            aggregate_id  BINARY(16) NOT NULL,
            topic         VARCHAR(120) NOT NULL,
            payload       JSON NOT NULL,
            created_at    DATETIME(6) NOT NULL
         );
         CREATE TABLE outbox3 (
            id            BINARY(16) NOT NULL PRIMARY KEY,
            aggregate_id  VARCHAR(64) NOT NULL,
            topic         VARCHAR(120) NOT NULL,
            payload       JSON NOT NULL,
            created_at    DATETIME(6) NOT NULL
         );",
    )
    .await;
    let id = Uuid::now_v7();
    let write = async {
        let mut c = db.conn().await;
        my_exec(&mut c, "SET time_zone = '+05:00'").await;
        c.exec_drop(
            "INSERT INTO outbox (event_id, aggregate_id, topic, payload, created_at, headers, version)
             VALUES (?, 18446744073709551615, 'padded.topic', '{\"k\":1}', '2026-06-22 15:00:00.250000', '{\"tenant\":\"t1\"}', -7)",
            (id.hyphenated().to_string(),),
        )
        .await
        .unwrap();
    };
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(
        &db,
        &[
            "run",
            "--source",
            &dsn,
            "--name",
            &name,
            "--commit-offsets",
            "--column",
            "id=event_id",
        ],
    )
    .await;
    write.await;
    wait_for("1 line", T, || {
        let n = relay.line_count();
        async move { n >= 1 }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let l = &parse_lines(&relay.lines())[0];
    assert_eq!(l["id"], id.hyphenated().to_string());
    assert_eq!(
        l["aggregate_id"], "18446744073709551615",
        "BIGINT UNSIGNED max"
    );
    assert_eq!(
        l["topic"], "padded.topic",
        "CHAR pad spaces are not part of the topic"
    );
    // TIMESTAMP is stored in UTC whatever the session's zone.
    assert_eq!(l["created_at"], "2026-06-22T10:00:00.250000Z");
    assert!(l.get("poison").is_none(), "{l}");

    // BINARY(16) and VARCHAR aggregate ids.
    let agg = Uuid::parse_str("0b7e0000-0000-4000-8000-000000000000").unwrap();
    for (table, agg_value, want) in [
        (
            "outbox2",
            agg.as_bytes().to_vec(),
            agg.hyphenated().to_string(),
        ),
        (
            "outbox3",
            b"customer-42/\xc3\xa9".to_vec(),
            "customer-42/é".to_string(),
        ),
    ] {
        let name = unique("r");
        let mut relay = start_streaming(
            &db,
            &[
                "run",
                "--source",
                &dsn,
                "--name",
                &name,
                "--commit-offsets",
                "--table",
                table,
            ],
        )
        .await;
        c.exec_drop(
            format!("INSERT INTO {table} (id, aggregate_id, topic, payload, created_at) VALUES (?, ?, 'x', '{{}}', NOW(6))"),
            (Uuid::now_v7().as_bytes().to_vec(), agg_value),
        )
        .await
        .unwrap();
        wait_for("1 line", T, || {
            let n = relay.line_count();
            async move { n >= 1 }
        })
        .await;
        relay.signal("TERM");
        assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
        assert_eq!(
            parse_lines(&relay.lines())[0]["aggregate_id"],
            want.as_str()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datetime_is_read_in_the_source_time_zone() {
    let db = MyDb::create("my_tz").await;
    let write = async {
        let mut c = db.conn().await;
        my_exec(
            &mut c,
            "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES
               (UNHEX('00000000000040008000000000000001'), 1, 'summer', '{}', '2026-06-22 12:00:00.123456'),
               (UNHEX('00000000000040008000000000000002'), 1, 'winter', '{}', '2026-01-22 12:00:00.000001')",
        )
        .await;
    };
    let lines =
        parse_lines(&relay_lines(&db, &["--source-time-zone", "Europe/Berlin"], write, 2).await);
    assert_eq!(
        lines[0]["created_at"], "2026-06-22T10:00:00.123456Z",
        "CEST"
    );
    assert_eq!(lines[1]["created_at"], "2026-01-22T11:00:00.000001Z", "CET");
}

/// A mapped column retyped to one the contract cannot read (`created_at` as VARCHAR): the relay
/// stops with exit 2 and the fix at the first row of the new shape and publishes nothing of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retyped_mapped_column_stops_the_relay_with_the_fix() {
    let db = MyDb::create("my_retype").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    let mut c = db.conn().await;
    let before = my_write_events(&mut c, 1, 2, "before.retype").await;
    wait_for("2 lines", T, || {
        let n = relay.line_count();
        async move { n >= 2 }
    })
    .await;
    my_exec(
        &mut c,
        "ALTER TABLE outbox MODIFY created_at VARCHAR(40) NOT NULL",
    )
    .await;
    my_exec(
        &mut c,
        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (UNHEX('0000000000004000800000000000000a'), 1, 'after.retype', '{}', 'yesterday-ish')",
    )
    .await;
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("created_at") && err.contains("fix:"), "{err}");
    assert_eq!(
        ids_of(&parse_lines(&relay.lines())),
        before,
        "nothing of the retyped row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alter_table_is_remapped_by_name_and_a_dropped_column_stops_with_the_fix() {
    let db = MyDb::create("my_alter").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    let mut c = db.conn().await;
    let mut ids = my_write_events(&mut c, 1, 2, "before.alter").await;
    // New columns in front of the mapped ones: a new table map, columns found by name.
    my_exec(&mut c, "ALTER TABLE outbox ADD COLUMN tenant VARCHAR(20) NULL FIRST, ADD COLUMN extra INT NULL AFTER topic").await;
    ids.extend(my_write_events(&mut c, 1, 2, "after.alter").await);
    wait_for("4 lines", T, || {
        let n = relay.line_count();
        async move { n >= 4 }
    })
    .await;
    let lines = parse_lines(&relay.lines());
    assert_eq!(ids_of(&lines), ids);
    assert_eq!(lines[3]["topic"], "after.alter");
    assert_eq!(lines[3]["payload"]["customer"], "Ayşe 🧾");

    // A mapped column renamed away: the next insert stops the relay (exit 2) with the fix,
    // and nothing of that row is published.
    my_exec(
        &mut c,
        "ALTER TABLE outbox CHANGE topic routing_key VARCHAR(120) NOT NULL",
    )
    .await;
    my_exec(
        &mut c,
        "INSERT INTO outbox (id, aggregate_id, routing_key, payload, created_at) VALUES (UNHEX('00000000000040008000000000000009'), 1, 'x', '{}', NOW(6))",
    )
    .await;
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("no column \"topic\"")
            && err.contains("fix:")
            && err.contains("--column topic="),
        "{err}"
    );
    assert_eq!(relay.line_count(), 4, "half a row is never published");

    // The stored position is before the row: after the fix (--column topic=routing_key) it
    // arrives.
    let relay2 = start_streaming(
        &db,
        &[
            "run",
            "--source",
            &dsn,
            "--name",
            &name,
            "--commit-offsets",
            "--column",
            "topic=routing_key",
        ],
    )
    .await;
    wait_for("the row after the fix", T, || {
        let n = relay2.line_count();
        async move { n >= 1 }
    })
    .await;
    let after = parse_lines(&relay2.lines());
    assert_eq!(
        after.last().unwrap()["id"],
        "00000000-0000-4000-8000-000000000009"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_based_insert_stops_the_relay_with_the_fix() {
    let db = MyDb::create("my_stmt").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    let mut c = db.conn().await;
    let before = my_write_events(&mut c, 1, 1, "row.format").await;
    wait_for("the row-format event", T, || {
        let n = relay.line_count();
        async move { n >= 1 }
    })
    .await;
    my_exec(
        &mut c,
        "SET SESSION binlog_format = 'STATEMENT';
         INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (UNHEX('00000000000040008000000000000007'), 1, 'stmt', '{}', '2026-01-01 00:00:00');",
    )
    .await;
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("statement-based INSERT") && err.contains("SET GLOBAL binlog_format = ROW"),
        "{err}"
    );
    assert_eq!(ids_of(&parse_lines(&relay.lines())), before);
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_required_but_not_offered_is_a_configuration_error() {
    let db = MyDb::create("my_tls").await;
    let mut admin = my_connect(None).await;
    let have_ssl = my_value(&mut admin, "SELECT @@have_ssl")
        .await
        .unwrap_or_default();
    let dsn = format!("{}?ssl-mode=require", db.dsn());
    let name = unique("r");
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name]);
    if have_ssl == "YES" {
        // A server with TLS: the relay streams over it.
        wait_for("the relay's binlog dump to be connected", T, || {
            db.streaming()
        })
        .await;
        relay.signal("TERM");
        assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    } else {
        let code = relay.wait_exit(T).await;
        let err = relay.stderr();
        assert_eq!(code, 2, "{err}");
        assert!(
            err.contains("does not offer TLS") && err.contains("fix:"),
            "{err}"
        );
    }
    // A CA file that does not exist is refused before connecting, naming the file.
    let dsn = format!(
        "{}?ssl-mode=verify-full&ssl-ca=/nonexistent/ca.pem",
        db.dsn()
    );
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &unique("r")]);
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("/nonexistent/ca.pem"), "{err}");
}

/// Writes `n` rows directly (not through a relay), with a chosen status and created_at.
async fn seed_rows(
    c: &mut mysql_async::Conn,
    n: usize,
    status: &str,
    created_at: &str,
) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = Uuid::now_v7();
        c.exec_drop(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, status, created_at) VALUES (?, ?, 'seed', '{}', ?, ?)",
            (id.as_bytes().to_vec(), i as i64, status, created_at),
        )
        .await
        .unwrap();
        ids.push(id);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_start_publishes_pending_rows_from_a_consistent_snapshot_then_streams() {
    let db = MyDb::create("my_snap").await;
    let mut c = db.conn().await;
    let _published = seed_rows(&mut c, 2, "published", "2026-01-01 00:00:00.000001").await;
    let pending = seed_rows(&mut c, 3, "pending", "2026-01-01 00:00:01.000002").await;

    // Producers keep writing while the relay takes its snapshot: every row arrives exactly once
    // (MariaDB gives the snapshot's exact binlog position).
    let writer = {
        let mut c = db.conn().await;
        tokio::spawn(async move { my_write_events(&mut c, 100, 10, "during.start").await })
    };
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = Relay::start(&run_args(&dsn, &name));
    let during = writer.await.unwrap();
    let mut expected = pending.clone();
    expected.extend(during.iter().copied());
    wait_for("every pending and new row", T, || {
        let got: HashSet<Uuid> = ids_of(&parse_lines(&relay.lines())).into_iter().collect();
        let all = expected.iter().all(|i| got.contains(i));
        async move { all }
    })
    .await;
    let after = my_write_events(&mut c, 1, 2, "after.start").await;
    expected.extend(after.iter().copied());
    wait_for("the rows after", T, || {
        let n = relay.line_count();
        let want = expected.len();
        async move { n >= want }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let lines = parse_lines(&relay.lines());
    let got = ids_of(&lines);
    assert_eq!(
        got.len(),
        got.iter().collect::<HashSet<_>>().len(),
        "no duplicates"
    );
    assert_eq!(
        got.iter().collect::<HashSet<_>>(),
        expected.iter().collect::<HashSet<_>>()
    );
    assert_eq!(
        &got[..3],
        &pending[..],
        "the snapshot first, in created_at order"
    );
    let positions: Vec<&str> = lines
        .iter()
        .map(|l| l["position"].as_str().unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "snapshot positions sort before streamed ones"
    );
    assert!(
        relay.stderr_plain().contains("consistent snapshot"),
        "{}",
        relay.stderr_plain()
    );

    // Later starts never snapshot again.
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    let more = my_write_events(&mut c, 1, 1, "later").await;
    wait_for("the later row", T, || {
        let n = relay.line_count();
        async move { n >= 1 }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    assert_eq!(ids_of(&parse_lines(&relay.lines())), more);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_start_modes_without_a_status_column() {
    let db = MyDb::create("my_snap_modes").await;
    let mut c = db.conn().await;
    let old = seed_rows(&mut c, 2, "pending", "2026-01-01 00:00:00").await;
    let new = seed_rows(&mut c, 2, "pending", "2026-03-01 12:00:00.5").await;
    my_exec(&mut c, "ALTER TABLE outbox DROP COLUMN status").await;
    let dsn = db.dsn();

    // auto: rows exist and nothing tells which were published: refuse, with the choices.
    let mut relay = Relay::start(&run_args(&dsn, &unique("r")));
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("already holds 4 rows") && err.contains("--snapshot all"),
        "{err}"
    );

    for (mode, want) in [
        ("all", [old.clone(), new.clone()].concat()),
        ("never", vec![]),
        // In a zone where 2026-03-01 12:00:00.5 local is 11:00:00.5Z.
        ("since=2026-03-01T11:00:00.5Z", new.clone()),
    ] {
        let name = unique("r");
        let mut args = run_args(&dsn, &name);
        let m = format!("--snapshot={mode}");
        args.push(&m);
        args.extend_from_slice(&["--source-time-zone", "Europe/Berlin"]);
        let mut relay = start_streaming(&db, &args).await;
        wait_for("the first start to be stored", T, || async {
            db.stored(&name).await.is_some()
        })
        .await;
        relay.signal("TERM");
        assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
        assert_eq!(
            ids_of(&parse_lines(&relay.lines())),
            want,
            "--snapshot {mode}"
        );
    }
}

/// `auto` on an empty table without a status column: the start reads the binlog position,
/// then looks at the table again (a row committed between a first look and the position would
/// otherwise be in neither); still empty, the first start is done at that position and streams
/// what follows, once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_start_auto_on_an_empty_table_without_a_status_column_streams() {
    let db = MyDb::create("my_snap_empty").await;
    let mut c = db.conn().await;
    my_exec(&mut c, "ALTER TABLE outbox DROP COLUMN status").await;
    let dsn = db.dsn();
    let name = unique("r");
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    wait_for("the first start to be stored", T, || async {
        db.stored(&name).await.is_some()
    })
    .await;
    let later = my_write_events(&mut c, 3, 1, "later").await;
    let lines = relay.lines_then_stop(later.len(), T).await;
    assert_eq!(ids_of(&parse_lines(&lines)), later);
    assert!(
        !relay.stderr().contains("publishing them"),
        "nothing appeared while it started: {}",
        relay.stderr()
    );
}

fn outboxd(args: &[&str]) -> (i32, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_setup_status_and_teardown() {
    let db = MyDb::create("my_ops").await;
    let dsn = db.dsn();
    let name = unique("r");

    let (code, out, err) = outboxd(&["check", "--source", &dsn, "--name", &name]);
    assert_eq!(code, 0, "{out}{err}");
    for want in [
        "ok   binlog_row_metadata: FULL",
        "ok   grants",
        "ok   outbox table",
    ] {
        assert!(out.contains(want), "{want}: {out}");
    }
    // A mapping that cannot work: one FAIL line with its fix, exit 1.
    let (code, out, _) = outboxd(&[
        "check",
        "--source",
        &dsn,
        "--name",
        &name,
        "--column",
        "topic=nope",
    ]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL outbox table") && out.contains("fix:"),
        "{out}"
    );

    let (code, out, err) = outboxd(&["setup", "--source", &dsn, "--name", &name]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("state table outboxd_state"), "{out}");

    let mut relay = Relay::start(&run_args(&dsn, &name));
    wait_for("the binlog dump", T, || db.streaming()).await;
    let mut c = db.conn().await;
    my_write_events(&mut c, 2, 5, "ops").await;
    wait_for("10 lines", T, || {
        let n = relay.line_count();
        async move { n >= 10 }
    })
    .await;
    let (code, out, _) = outboxd(&["status", "--source", &dsn, "--name", &name]);
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("binlog dump      connected") && out.contains("(live)"),
        "{out}"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    let (code, out, _) = outboxd(&[
        "offset", "show", "--source", &dsn, "--name", &name, "--json",
    ]);
    assert_eq!(code, 0, "{out}");
    let st: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let (file, pos, gtid) = db.stored(&name).await.unwrap();
    assert_eq!(st["stored_position"], format!("{file}:{pos}"));
    assert_eq!(st["stored_gtid"].as_str(), gtid.as_deref());
    assert_eq!(st["lease_live"], false, "released at the clean stop");
    assert!(st["lag_bytes"].as_u64().is_some());

    let (code, _, err) = outboxd(&["teardown", "--source", &dsn, "--name", &name]);
    assert_eq!(code, 2, "--yes is required: {err}");
    let (code, out, err) = outboxd(&["teardown", "--source", &dsn, "--name", &name, "--yes"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(db.stored(&name).await.is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offset_set_moves_the_binlog_position_back_and_forth() {
    let db = MyDb::create("my_offset").await;
    let dsn = db.dsn();
    let name = unique("r");
    let mut c = db.conn().await;

    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    let first = my_write_events(&mut c, 3, 1, "a").await;
    wait_for("3 lines", T, || {
        let n = relay.line_count();
        async move { n >= 3 }
    })
    .await;
    // Refused while the relay runs.
    let head = my_head().await;
    let at = format!("{}:{}", head.0, head.1);
    let (code, _, err) = outboxd(&[
        "offset",
        "set",
        "--source",
        &dsn,
        "--name",
        &name,
        "--binlog-position",
        &at,
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("is running"), "{err}");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let lines = parse_lines(&relay.lines());
    // Back to the end of the first transaction: the second and third come again.
    let pos: Vec<&str> = lines[0]["position"].as_str().unwrap().split(':').collect();
    let end_of_first = format!("{}:{}", pos[0], pos[1].parse::<u64>().unwrap());
    let (code, out, err) = outboxd(&[
        "offset",
        "set",
        "--source",
        &dsn,
        "--name",
        &name,
        "--binlog-position",
        &end_of_first,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(&end_of_first) && out.contains("gtid"), "{out}");
    let second = my_write_events(&mut c, 1, 2, "b").await;
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    let mut want = first[1..].to_vec();
    want.extend(second.iter().copied());
    wait_for("the replayed and new events", T, || {
        let n = relay.line_count();
        async move { n >= 4 }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    assert_eq!(ids_of(&parse_lines(&relay.lines())), want);

    // Forward to the head: what was written in between is skipped.
    my_write_events(&mut c, 1, 2, "skipped").await;
    let head = my_head().await;
    let (code, _, err) = outboxd(&[
        "offset",
        "set",
        "--source",
        &dsn,
        "--name",
        &name,
        "--binlog-position",
        &format!("{}:{}", head.0, head.1),
    ]);
    assert_eq!(code, 0, "{err}");
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    let third = my_write_events(&mut c, 1, 1, "c").await;
    wait_for("the new event", T, || {
        let n = relay.line_count();
        async move { n >= 1 }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    assert_eq!(ids_of(&parse_lines(&relay.lines())), third);

    // Positions that cannot be: refused with the form to use.
    for bad in [
        "nonsense",
        "mariadb-bin.999999:4",
        &format!("{}:{}", head.0, head.1 + 10_000_000),
    ] {
        let (code, _, err) = outboxd(&[
            "offset",
            "set",
            "--source",
            &dsn,
            "--name",
            &name,
            "--binlog-position",
            bad,
        ]);
        assert_eq!(code, 2, "{bad}: {err}");
        assert!(err.contains("fix:"), "{err}");
    }
}
