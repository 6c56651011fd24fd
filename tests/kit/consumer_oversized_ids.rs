//! An aggregate id or type longer than the stale gate's column is the message's data, not a
//! setup problem: the example consumer (`invoice_projection --stale-gate`) hands such a message
//! to `--on-poison` (parked in `<queue>.dead` with the reason, or skipped and counted) and goes
//! on with the next ones; nothing cut short is ever stored in the gate. On MariaDB the columns
//! are `VARBINARY(255)` (type) and `VARBINARY(1024)` (id); on Postgres they are `text`, bounded
//! only by the primary key's index entry (about 2.7 kB), which an id of some kilobytes passes.

use crate::common;
use crate::consumer_e2e::total_stat;
use crate::consumer_support;

use common::*;
use consumer_support::*;
use lapin::types::AMQPValue;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// The database the consumer writes to, for the test's own queries.
enum Db {
    Pg(#[allow(dead_code)] PgDb, tokio_postgres::Client),
    My(MariaDb),
}

impl Db {
    async fn count(&self, sql: &str) -> i64 {
        match self {
            Db::Pg(_, c) => c.query_one(sql, &[]).await.unwrap().get(0),
            Db::My(db) => db.count(sql).await,
        }
    }

    /// How many times event `id` is in the ledger.
    async fn ledger(&self, id: Uuid) -> i64 {
        let key = match self {
            Db::Pg(..) => format!("'{id}'"),
            Db::My(_) => format!("UNHEX('{}')", id.simple()),
        };
        self.count(&format!(
            "SELECT count(*) FROM invoice_ledger WHERE event_id = {key}"
        ))
        .await
    }
}

/// `n` bytes that no compression shortens much (hex of random UUIDs): Postgres compresses
/// long index entries, and a repeated letter would fit the index after all.
fn incompressible(n: usize) -> String {
    let mut s = String::new();
    while s.len() < n {
        s.push_str(&Uuid::new_v4().simple().to_string());
    }
    s.truncate(n);
    s
}

/// An invoice event with `header` set to `value` on top of [`invoice_props`]' headers.
fn props_with(id: Uuid, customer: &str, header: &str, value: &str) -> lapin::BasicProperties {
    let props = invoice_props(id, "invoice.issued", customer, Some(1));
    let mut h = props.headers().clone().unwrap_or_default();
    h.insert(header.into(), AMQPValue::LongString(value.into()));
    props.with_headers(h)
}

/// For `--on-poison park` and `skip`: a healthy invoice, one whose `x-aggregate-id` is
/// `long_id` and one whose `x-aggregate-type` is `long_type`, another healthy invoice. The two
/// oversized ones fail `--max-failures` times and go through the policy; the healthy ones are
/// applied; the gate holds exactly the healthy aggregates. A parked message's error contains
/// `reason`.
async fn oversized_ids_are_poison(
    db: &Db,
    dsn: &str,
    (long_id, long_type): (&str, &str),
    reason: &str,
) {
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let publisher = publisher().await;
    for (n, policy) in [(0i64, "park"), (1, "skip")] {
        let q = OwnQueue::declare(&ch, &unique(&format!("oversize_{policy}")), "", "", true).await;
        let consumer = format!("oversize_{policy}");
        let good = [Uuid::now_v7(), Uuid::now_v7()];
        let bad = [Uuid::now_v7(), Uuid::now_v7()];
        let first = n * 10;
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(good[0], "invoice.issued", "cust-1", Some(1)),
            &invoice_body(first + 1, "cust-1", 100),
        )
        .await;
        publish(
            &publisher,
            "",
            &q.name,
            props_with(bad[0], "cust-2", "x-aggregate-id", long_id),
            &invoice_body(first + 2, "cust-2", 100),
        )
        .await;
        publish(
            &publisher,
            "",
            &q.name,
            props_with(bad[1], "cust-3", "x-aggregate-type", long_type),
            &invoice_body(first + 3, "cust-3", 100),
        )
        .await;
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(good[1], "invoice.issued", "cust-4", Some(1)),
            &invoice_body(first + 4, "cust-4", 100),
        )
        .await;
        let args = [
            "--stale-gate",
            "--on-poison",
            policy,
            "--max-failures",
            "3",
            "--until-empty",
        ];
        // Each run must exit 0: an exit 2 (a "setup" stop) fails here, with its stderr.
        let stopped = drain(
            &conn,
            &q.name,
            || start_consumer(dsn, &q.name, &consumer, &args),
            T,
        )
        .await;
        let log = stopped.iter().map(|p| p.stderr()).collect::<String>();
        for id in good {
            assert_eq!(db.ledger(id).await, 1, "{id} applied once; stderr:\n{log}");
        }
        for id in bad {
            assert_eq!(db.ledger(id).await, 0, "{id} not applied; stderr:\n{log}");
        }
        assert_eq!(total_stat(&stopped, "failures"), 6, "{log}");
        assert_eq!(total_stat(&stopped, "applied"), 2, "{log}");
        // Only the healthy aggregates are in the gate: nothing cut to the column's width.
        let sql = format!(
            "SELECT count(*) FROM consumer_aggregate_versions WHERE consumer = '{consumer}'"
        );
        assert_eq!(db.count(&sql).await, 2, "{log}");
        let dead = format!("{}.dead", q.name);
        if policy == "park" {
            assert_eq!(total_stat(&stopped, "parked"), 2, "{log}");
            let mut parked: Vec<Uuid> = Vec::new();
            for m in take(&conn, &dead, 2).await {
                parked.push(amqp::message_id(&m));
                let err = amqp::header_str(&m, "x-outboxd-error").unwrap();
                assert!(err.contains(reason), "the reason says {reason:?}: {err}");
            }
            parked.sort();
            assert_eq!(parked, bad.to_vec());
        } else {
            assert_eq!(total_stat(&stopped, "skipped"), 2, "{log}");
            assert_eq!(ready(&conn, &dead).await, 0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_oversized_aggregate_ids_go_through_the_poison_policy() {
    let my = MariaDb::create("oversize").await;
    setup_projection(&my.dsn()).await;
    let dsn = my.dsn();
    let db = Db::My(my);
    // One byte over VARBINARY(1024) and VARBINARY(255).
    oversized_ids_are_poison(
        &db,
        &dsn,
        (&"i".repeat(1025), &"t".repeat(256)),
        "longer than column",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_oversized_aggregate_ids_go_through_the_poison_policy() {
    let pg = PgDb::create("oversize").await;
    setup_projection(&pg.dsn()).await;
    let dsn = pg.dsn();
    let client = pg.client().await;
    let db = Db::Pg(pg, client);
    // Past the index entry's limit even after compression (SQLSTATE 54000).
    let long = incompressible(16_000);
    oversized_ids_are_poison(&db, &dsn, (&long, &long), "54000").await;
}

/// The other side of the line: a consumer name longer than a gate table's narrowed `consumer`
/// column is configuration, not the message's data. The consumer stops (exit 2) with the width
/// in its fix, under `--on-poison skip`, and the message stays in the queue, unskipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_consumer_name_too_long_for_the_gate_stops_the_consumer() {
    let my = MariaDb::create("oversize").await;
    setup_projection(&my.dsn()).await;
    let dsn = my.dsn();
    let mut c = my.conn().await;
    my_exec(
        &mut c,
        "ALTER TABLE consumer_aggregate_versions MODIFY consumer VARBINARY(5) NOT NULL",
    )
    .await;
    let _ = c.disconnect().await;
    let db = Db::My(my);
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let publisher = publisher().await;
    let q = OwnQueue::declare(&ch, &unique("oversize_name"), "", "", true).await;
    let id = Uuid::now_v7();
    publish(
        &publisher,
        "",
        &q.name,
        invoice_props(id, "invoice.issued", "cust-1", Some(1)),
        &invoice_body(1, "cust-1", 100),
    )
    .await;
    let args = ["--stale-gate", "--on-poison", "skip", "--max-failures", "3"];
    let mut p = start_consumer(&dsn, &q.name, "billing_projection", &args);
    let code = p.wait_exit(T).await;
    let err = p.stderr();
    assert_eq!(code, 2, "a setup stop; stderr:\n{err}");
    assert!(
        err.contains("at most 5 bytes"),
        "the fix names the width; stderr:\n{err}"
    );
    assert!(!err.contains("poison message"), "{err}");
    assert_eq!(db.ledger(id).await, 0);
    wait_for("the message back in the queue", T, || {
        let (conn, q) = (&conn, &q.name);
        async move { ready(conn, q).await == 1 }
    })
    .await;
}
