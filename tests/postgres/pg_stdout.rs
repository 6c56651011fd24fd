//! Postgres source → stdout sink, end to end against the real server: what arrives, what never
//! does, and that the stored position follows only what was written out.

use crate::common;

use common::*;
use std::collections::HashSet;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_events_arrive_and_nothing_else() {
    ten_thousand_events_arrive_and_nothing_else_on(PG_PORT).await
}

/// [`ten_thousand_events_arrive_and_nothing_else`] on the server at `port` (run per version by `pg_versions` too).
pub(crate) async fn ten_thousand_events_arrive_and_nothing_else_on(port: u16) {
    let db = PgDb::create_on(port, "e2e").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let mut relay = Relay::start(&run_args(&dsn, &name));
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;

    let mut client = db.client().await;
    // Another schema with its own outbox, and another table: neither may arrive.
    client
        .batch_execute(
            "CREATE SCHEMA other; CREATE TABLE other.outbox (LIKE public.outbox INCLUDING ALL);
             CREATE TABLE invoices (id bigserial primary key, total numeric);",
        )
        .await
        .unwrap();
    let outbox_other = outboxd::Outbox::new("other.outbox").unwrap();
    let outbox = outboxd::Outbox::new("outbox").unwrap();

    let mut expected = write_events(&mut client, 50, 100, "invoice.issued").await;
    // A rolled-back transaction: never.
    let rolled_back = {
        let mut tx = client.transaction().await.unwrap();
        let id = outbox
            .write(
                &mut tx,
                "invoice.issued",
                "rb",
                &serde_json::json!({"rolled": "back"}),
            )
            .await
            .unwrap();
        tx.rollback().await.unwrap();
        id
    };
    // Inserted and deleted in one transaction: arrives (the insert is in the log).
    {
        let mut tx = client.transaction().await.unwrap();
        let id = outbox
            .write(
                &mut tx,
                "invoice.voided",
                "gone",
                &serde_json::json!({"deleted": true}),
            )
            .await
            .unwrap();
        tx.execute("DELETE FROM outbox WHERE id = $1", &[&id])
            .await
            .unwrap();
        tx.execute("INSERT INTO invoices (total) VALUES (1)", &[])
            .await
            .unwrap();
        tx.commit().await.unwrap();
        expected.push(id);
    }
    let other_id = {
        let mut tx = client.transaction().await.unwrap();
        let id = outbox_other
            .write(
                &mut tx,
                "invoice.issued",
                "x",
                &serde_json::json!({"schema": "other"}),
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
        id
    };
    expected.extend(write_events(&mut client, 50, 100, "invoice.paid").await);
    assert_eq!(expected.len(), 10_001);

    wait_for("10,001 lines on stdout", T, || {
        let n = relay.line_count();
        async move { n >= 10_001 }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());

    let lines = parse_lines(&relay.lines());
    assert_eq!(lines.len(), 10_001, "exactly the committed outbox rows");
    let got: Vec<uuid::Uuid> = lines
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        got, expected,
        "commit order, nothing missing, nothing extra"
    );
    assert!(!got.contains(&rolled_back));
    assert!(!got.contains(&other_id));

    // Fields as the contract says, checked against the table.
    let row = client
        .query_one(
            "SELECT aggregate_id, topic, payload::text, to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"') FROM outbox WHERE id = $1",
            &[&expected[4321]],
        )
        .await
        .unwrap();
    let l = &lines[4321];
    assert_eq!(l["aggregate_id"], row.get::<_, String>(0));
    assert_eq!(l["topic"], row.get::<_, String>(1));
    let payload_text: String = row.get(2);
    assert_eq!(
        l["payload"],
        serde_json::from_str::<serde_json::Value>(&payload_text).unwrap()
    );
    assert_eq!(l["created_at"], row.get::<_, String>(3));
    assert_eq!(l["payload"]["customer"], "Ayşe 🧾");
    let positions: Vec<&str> = lines
        .iter()
        .map(|l| l["position"].as_str().unwrap())
        .collect();
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "positions increase in commit order"
    );
    assert_eq!(lines[10_000]["topic"], "invoice.paid");

    // The position was stored: the slot moved, and the state row holds it.
    let confirmed = db.slot_confirmed(&slot).await.expect("slot exists");
    let state: String = client
        .query_one(
            "SELECT position FROM outboxd_state WHERE name = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        state, confirmed,
        "state row and slot agree after a clean stop"
    );
    let last_commit =
        outboxd::event::parse_lsn(positions.last().unwrap().split(':').next().unwrap()).unwrap();
    assert!(outboxd::event::parse_lsn(&confirmed).unwrap() > last_commit);

    // A restart delivers nothing again (zero duplicates after SIGTERM).
    let relay2 = Relay::start(&run_args(&dsn, &name));
    wait_for("the restarted relay's slot to be active", T, || {
        db.slot_active(&slot)
    })
    .await;
    let more = write_events(&mut client, 1, 3, "after.restart").await;
    wait_for("3 new lines", T, || {
        let n = relay2.line_count();
        async move { n >= 3 }
    })
    .await;
    let lines2 = parse_lines(&relay2.lines());
    let ids2: Vec<uuid::Uuid> = lines2
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(
        ids2, more,
        "only the new events, none from before the restart"
    );
    let set: HashSet<_> = got.iter().collect();
    assert!(ids2.iter().all(|i| !set.contains(i)));
}
