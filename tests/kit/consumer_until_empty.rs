//! `--until-empty` stops only once every message that was in the queue has been processed.
//!
//! The broker counts a message it has already sent to the consumer as unacked, not ready: one
//! on the wire, or in the client library's buffer and not yet handed to a worker, makes the
//! queue read as empty while nothing is in hand. Stopping then hands it back unprocessed. The
//! test widens that moment to a certainty: the broker is reached through a proxy that delays
//! every chunk, and `--prefetch 1` makes the broker send each message only after the previous
//! one's ack, so between an ack and the next delivery's arrival nothing is in hand for longer
//! than the consumer's interval between two looks at the queue.

use crate::common;
use crate::consumer_support;

use common::amqp::mgmt;
use common::proxy::FaultProxy;
use common::*;
use consumer_support::*;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// The queue's ready and unacked counts from the management API.
fn mgmt_counts(queue: &str) -> (u64, u64) {
    let (code, body) = mgmt(
        "GET",
        &format!("queues/%2F/{queue}?columns=messages_ready,messages_unacknowledged"),
        None,
    );
    assert_eq!(code, 200, "queue {queue}: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).expect("queue JSON");
    (
        v["messages_ready"].as_u64().unwrap_or(u64::MAX),
        v["messages_unacknowledged"].as_u64().unwrap_or(u64::MAX),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn until_empty_processes_the_deliveries_already_sent_before_it_stops() {
    const N: usize = 8;
    let db = PgDb::create("until_empty").await;
    let dsn = db.dsn();
    setup_projection(&dsn).await;
    let publisher = publisher().await;
    let q = OwnQueue::declare(&publisher, &unique("until_empty"), "", "", false).await;
    for i in 0..N {
        let customer = format!("cust-{}", i % 3);
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(Uuid::new_v4(), "invoice.issued", &customer, None),
            &invoice_body(i as i64, &customer, 100),
        )
        .await;
    }
    let conn = amqp::connect().await;
    assert_eq!(ready(&conn, &q.name).await, N as u32);

    // 150 ms per chunk each way: an ack and the delivery it makes room for take at least
    // 300 ms, three times the consumer's 100 ms between looks at the queue.
    let broker = FaultProxy::start(([127, 0, 0, 1], amqp::HOST_PORT).into())
        .await
        .unwrap();
    broker.set_delay(Duration::from_millis(150));
    let mut consumer = start_consumer_via(
        &amqp::url_via(broker.port()),
        &dsn,
        &q.name,
        "until_empty",
        &["--prefetch", "1", "--until-empty"],
    );
    let code = consumer.wait_exit(T).await;
    assert_eq!(code, 0, "consumer stderr:\n{}", consumer.stderr());
    assert!(broker.delayed_chunks() > 0, "the proxy delayed nothing");

    let applied = consumer.stats()["applied"].as_i64().unwrap_or(0);
    let left = ready(&conn, &q.name).await;
    assert_eq!(
        (applied, left),
        (N as i64, 0),
        "the consumer stopped with {left} of {N} messages unprocessed (they went back to the \
         queue); stderr:\n{}",
        consumer.stderr()
    );
    let client = db.client().await;
    let ledger: i64 = client
        .query_one("SELECT count(DISTINCT event_id) FROM invoice_ledger", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(ledger, N as i64, "every message's effect");
    let totals: i64 = client
        .query_one(
            "SELECT COALESCE(sum(invoices), 0)::bigint FROM invoice_totals",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(totals, N as i64, "every message counted once in the totals");
    // The broker's own view, which it refreshes every few seconds: nothing ready, nothing
    // unacked.
    wait_for(
        "the management API to show 0 ready and 0 unacked",
        T,
        || {
            let name = q.name.clone();
            async move { mgmt_counts(&name) == (0, 0) }
        },
    )
    .await;
}
