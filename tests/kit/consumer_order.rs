//! Queue order across a broker connection loss: the example consumer (`invoice_projection`)
//! retries a message in place, the broker connection is cut under it, and the effects must
//! still land in queue order — the deliveries of the dead session still waiting in the
//! worker are dropped (the broker redelivers them after the retried one), never processed.

use crate::common;
use crate::consumer_support;

use common::proxy::FaultProxy;
use common::*;
use consumer_support::*;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// A trigger that fails the ledger insert of invoice 1 with a serialization failure (a
/// retryable conflict to the consumer) while `gate.closed` is true: the message is retried in
/// place until the test opens the gate.
const GATE: &str = "
CREATE TABLE gate (closed boolean NOT NULL);
INSERT INTO gate VALUES (true);
ALTER TABLE invoice_ledger ADD COLUMN seq bigserial;
CREATE FUNCTION hold_invoice_1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.invoice_id = 1 AND (SELECT closed FROM gate) THEN
        RAISE EXCEPTION 'invoice 1 held by the test' USING ERRCODE = '40001';
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER hold BEFORE INSERT ON invoice_ledger
    FOR EACH ROW EXECUTE FUNCTION hold_invoice_1();";

/// On a single-active-consumer queue with the stale gate on, invoices 1..5 of one customer
/// (versions 1..5) are delivered together; invoice 1 is retried in place, the broker
/// connection is cut, and only then does invoice 1 become applicable. Every invoice is applied
/// once, in queue order, and none is dropped as stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn broker_loss_during_an_in_place_retry_keeps_queue_order() {
    let db = PgDb::create("order_cut").await;
    setup_projection(&db.dsn()).await;
    let client = db.client().await;
    client.batch_execute(GATE).await.unwrap();
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = OwnQueue::declare(&ch, &unique("order_cut"), "", "", true).await;
    let publisher = publisher().await;
    let mut ids = Vec::new();
    for v in 1..=5i64 {
        let id = Uuid::now_v7();
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(id, "invoice.issued", "cust-o", Some(v)),
            &invoice_body(v, "cust-o", v * 100),
        )
        .await;
        ids.push(id);
    }
    let broker = FaultProxy::start(([127, 0, 0, 1], amqp::HOST_PORT).into())
        .await
        .unwrap();
    let mut consumer = start_consumer_via(
        &amqp::url_via(broker.port()),
        &db.dsn(),
        &q.name,
        "ordered",
        &["--stale-gate", "--prefetch", "10"],
    );
    // All five are in the consumer's hands and invoice 1 is being retried in place.
    consumer
        .wait_stderr(
            "invoice 1 retried in place",
            T,
            "retryable failure; retrying in place",
        )
        .await;
    wait_for("all five delivered (none ready)", T, || {
        let (conn, q) = (&conn, &q.name);
        async move { ready(conn, q).await == 0 }
    })
    .await;
    let before = broker.accepted();
    broker.cut();
    consumer
        .wait_stderr(
            "the worker to give up the retried copy",
            T,
            "channel closed while retrying",
        )
        .await;
    wait_for("the consumer to reconnect to the broker", T, || {
        let now = broker.accepted();
        async move { now > before }
    })
    .await;
    client
        .batch_execute("UPDATE gate SET closed = false")
        .await
        .unwrap();
    wait_for("all five claimed", T, || {
        let client = &client;
        async move {
            let n: i64 = client
                .query_one(
                    "SELECT count(*) FROM processed_messages WHERE consumer = 'ordered'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            n == 5
        }
    })
    .await;
    stop(&mut consumer, T).await;
    let applied: Vec<i64> = client
        .query("SELECT invoice_id FROM invoice_ledger ORDER BY seq", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        applied,
        vec![1, 2, 3, 4, 5],
        "effects in queue order, none dropped as stale; consumer stderr:\n{}",
        consumer.stderr()
    );
    let stats = consumer.stats();
    assert_eq!(stats["stale"], 0, "{stats}");
    assert!(
        stats["abandoned"].as_i64().unwrap_or(0) >= 1,
        "the dead session's queued deliveries were dropped: {stats}"
    );
}
