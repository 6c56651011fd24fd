//! MariaDB source → stdout sink, end to end against the real server: what arrives, what never
//! does, every value type the contract lists decoded exactly, and that the stored position
//! follows only what was written out.

mod common;

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
            .write_mysql(
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
            .write_mysql(
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
            .write_mysql(
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
