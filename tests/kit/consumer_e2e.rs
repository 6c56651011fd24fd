//! Effectively-once end to end: the relay (`outboxd run`) publishes invoice events from a
//! Postgres outbox, the example consumer (`examples/invoice_projection.rs`) keeps totals per
//! customer, and every kind of repeat is thrown at it — copies published straight to the
//! exchange, messages nacked and requeued, a consumer killed between commit and ack, the relay
//! SIGKILLed mid-stream. The projection must show every event's effect exactly once.
//!
//! Then: two consumer processes racing on duplicated ids; the stale gate; `--on-poison`
//! park/skip/halt and order on a single-active-consumer queue; the same guarantees on MariaDB
//! (events published directly: the MySQL relay is not part of this build).

use crate::common;
use crate::consumer_support;

use common::amqp::Topology;
use common::*;
use consumer_support::*;
use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicNackOptions, BasicQosOptions};
use lapin::types::FieldTable;
use std::collections::{BTreeMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(240);

/// One event as the producer wrote it, and what it must do to the projection.
#[derive(Debug, Clone)]
struct Written {
    id: Uuid,
    customer: String,
    topic: &'static str,
    invoices: i64,
    cents: i64,
    body: String,
}

fn invoice_event(i: usize) -> (String, &'static str, i64, i64, serde_json::Value) {
    let customer = format!("cust-{}", i % 37);
    let cents = 100 + (i as i64 * 7919) % 100_000;
    let (topic, n, c) = if i % 9 == 4 {
        ("invoice.cancelled", -1, -cents)
    } else {
        ("invoice.issued", 1, cents)
    };
    let body = serde_json::json!({"invoice_id": i, "customer": customer, "total_cents": cents});
    (customer, topic, n, c, body)
}

/// What the projection must hold: customer → (invoices, cents).
fn expected_totals(events: &[Written]) -> BTreeMap<String, (i64, i64)> {
    let mut m = BTreeMap::new();
    for e in events {
        let t = m.entry(e.customer.clone()).or_insert((0, 0));
        t.0 += e.invoices;
        t.1 += e.cents;
    }
    m
}

async fn pg_totals(c: &tokio_postgres::Client) -> BTreeMap<String, (i64, i64)> {
    c.query(
        "SELECT customer, invoices, total_cents FROM invoice_totals",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| (r.get(0), (r.get(1), r.get(2))))
    .collect()
}

async fn pg_count(c: &tokio_postgres::Client, sql: &str) -> i64 {
    c.query_one(sql, &[]).await.unwrap().get(0)
}

/// Every event in the ledger exactly once, nothing else, and the totals add up.
async fn assert_exactly_once_pg(c: &tokio_postgres::Client, events: &[Written]) {
    let rows = c
        .query(
            "SELECT event_id, count(*) FROM invoice_ledger GROUP BY event_id",
            &[],
        )
        .await
        .unwrap();
    let twice: Vec<Uuid> = rows
        .iter()
        .filter(|r| r.get::<_, i64>(1) != 1)
        .map(|r| r.get(0))
        .collect();
    assert!(
        twice.is_empty(),
        "{} events applied more than once, e.g. {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    let got: HashSet<Uuid> = rows.iter().map(|r| r.get(0)).collect();
    let want: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    assert_eq!(
        got.len(),
        want.len(),
        "{} missing, {} unexpected",
        want.difference(&got).count(),
        got.difference(&want).count()
    );
    assert_eq!(got, want);
    assert_eq!(pg_totals(c).await, expected_totals(events));
}

pub(crate) fn start_relay(db: &PgDb, name: &str, exchange: &str) -> Proc {
    start_relay_with(db, name, exchange, &[])
}

/// [`start_relay`] with more arguments.
pub(crate) fn start_relay_with(db: &PgDb, name: &str, exchange: &str, extra: &[&str]) -> Proc {
    let dsn = db.dsn();
    let mut args = vec![
        "run",
        "--source",
        &dsn,
        "--name",
        name,
        "--exchange",
        exchange,
        "--log-level",
        "info,lapin=warn",
    ];
    args.extend_from_slice(extra);
    Proc::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_outboxd")),
        &args,
        &[("OUTBOXD_SINK", &amqp::url())],
    )
}

fn stat(p: &Proc, k: &str) -> i64 {
    p.stats()[k].as_i64().unwrap_or(0)
}

pub(crate) fn total_stat(ps: &[Proc], k: &str) -> i64 {
    ps.iter().map(|p| stat(p, k)).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn relay_and_consumer_apply_ten_thousand_events_exactly_once_through_every_repeat() {
    let db = PgDb::create("e2e").await;
    setup_projection(&db.dsn()).await;
    let mut topo = Topology::new("xe").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(&db, &name, &topo.exchange);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("invoices", "invoice.#").await;
    let consumer = "invoice_projection";
    let dsn = db.dsn();

    // Consumer 1 dies right after its 1,500th commit, before that message's ack.
    let mut first = start_consumer(
        &dsn,
        &queue,
        consumer,
        &["--prefetch", "50", "--crash-after-commits", "1500"],
    );

    // 10,000 events in 100 transactions, written while everything runs.
    let conninfo = db.conninfo();
    let writer = tokio::spawn(async move {
        let mut c = pg_connect(&conninfo).await;
        let outbox = outboxd::Outbox::new("outbox").unwrap();
        let mut out = Vec::new();
        for t in 0..100 {
            let mut tx = c.transaction().await.unwrap();
            for k in 0..100 {
                let i = t * 100 + k;
                let (customer, topic, invoices, cents, body) = invoice_event(i);
                let id = outbox
                    .write(&mut tx, topic, &customer, &body)
                    .await
                    .unwrap();
                out.push(Written {
                    id,
                    customer,
                    topic,
                    invoices,
                    cents,
                    body: body.to_string(),
                });
            }
            tx.commit().await.unwrap();
            tokio::task::yield_now().await;
        }
        out
    });

    // The relay is SIGKILLed mid-stream (3,000 rows written, the rest still coming) and
    // restarted: what it had not confirmed is published again.
    let client = db.client().await;
    wait_for("3,000 rows written", T, || async {
        pg_count(&client, "SELECT count(*) FROM outbox").await >= 3000
    })
    .await;
    relay.sigkill();
    let mut relay = start_relay(&db, &name, &topo.exchange);

    // Consumer 1's crash between commit and ack.
    let code = first.wait_exit(T).await;
    assert_ne!(code, 0);
    let crashed_id = crashed_message(&first, 1500);
    let mut second = start_consumer(
        &dsn,
        &queue,
        consumer,
        &["--prefetch", "50", "--batch-size", "20"],
    );

    // A rogue consumer on the same queue nacks 300 deliveries back into it and leaves 20
    // more unacked (within its prefetch of 25) when its channel closes: all of them come
    // again, redelivered.
    {
        let ch = topo.channel().await;
        ch.basic_qos(25, BasicQosOptions::default()).await.unwrap();
        let mut rogue = ch
            .basic_consume(
                queue.clone().into(),
                "rogue".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
        for n in 0..320 {
            let d = tokio::time::timeout(T, rogue.next())
                .await
                .expect("deliveries for the rogue consumer")
                .unwrap()
                .unwrap();
            if n < 300 {
                d.acker
                    .nack(BasicNackOptions {
                        requeue: true,
                        multiple: false,
                    })
                    .await
                    .unwrap();
            }
        }
        ch.close(200, "OK".into()).await.unwrap();
    }

    let events = writer.await.unwrap();
    assert_eq!(events.len(), 10_000);

    // Copies of 700 events published straight to the exchange, as a misbehaving producer or
    // a replay would: same message id, same headers, same body.
    let publisher = publisher().await;
    for e in events.iter().step_by(14).take(700) {
        publish(
            &publisher,
            &topo.exchange,
            e.topic,
            invoice_props(e.id, e.topic, &e.customer, None),
            e.body.as_bytes(),
        )
        .await;
    }

    let end: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let end = outboxd::event::parse_lsn(&end).unwrap();
    wait_for("the relay to confirm every event", T, || async {
        db.slot_confirmed(&slot)
            .await
            .and_then(|s| outboxd::event::parse_lsn(&s))
            .is_some_and(|c| c >= end)
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "relay:\n{}", relay.stderr());

    wait_for("10,000 events in the projection", T, || async {
        pg_count(
            &client,
            "SELECT count(DISTINCT event_id) FROM invoice_ledger",
        )
        .await
            >= 10_000
    })
    .await;
    let conn = amqp::connect().await;
    stop(&mut second, T).await;
    let mut stopped = drain(
        &conn,
        &queue,
        || {
            start_consumer(
                &dsn,
                &queue,
                consumer,
                &["--prefetch", "50", "--until-empty"],
            )
        },
        T,
    )
    .await;
    stopped.push(second);

    eprintln!(
        "consumer stats after the crash: {:?}",
        stopped.iter().map(|p| p.stats()).collect::<Vec<_>>()
    );
    assert_exactly_once_pg(&client, &events).await;
    assert_eq!(
        pg_count(
            &client,
            "SELECT count(*) FROM processed_messages WHERE consumer = 'invoice_projection'"
        )
        .await,
        10_000
    );
    let dups = total_stat(&stopped, "duplicates");
    assert!(
        dups >= 700,
        "the copies (and the crashed commit) came as duplicates: {dups}"
    );
    assert_eq!(total_stat(&stopped, "failures"), 0);
    let ledger_rows_of_crashed = pg_count(
        &client,
        &format!("SELECT count(*) FROM invoice_ledger WHERE event_id = '{crashed_id}'"),
    )
    .await;
    assert_eq!(
        ledger_rows_of_crashed, 1,
        "the message committed before the crash was not applied again"
    );
}

/// Each id published three times, back to back, to one queue read by two consumer processes
/// with two workers each: copies of one id are in flight at the same time in different
/// processes, and the claim lets exactly one commit its effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_consumer_processes_racing_on_duplicated_ids_apply_each_once() {
    let db = PgDb::create("race").await;
    setup_projection(&db.dsn()).await;
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = OwnQueue::declare(&ch, &unique("race"), "", "", false).await;
    let publisher = publisher().await;
    let mut events = Vec::new();
    for i in 0..2000 {
        let (customer, topic, invoices, cents, body) = invoice_event(i);
        let e = Written {
            id: Uuid::now_v7(),
            customer,
            topic,
            invoices,
            cents,
            body: body.to_string(),
        };
        for _ in 0..3 {
            publish(
                &publisher,
                "",
                &q.name,
                invoice_props(e.id, topic, &e.customer, None),
                e.body.as_bytes(),
            )
            .await;
        }
        events.push(e);
    }
    let dsn = db.dsn();
    let start_with = |batch: &'static str| {
        start_consumer(
            &dsn,
            &q.name,
            "racer",
            &[
                "--prefetch",
                "8",
                "--concurrency",
                "2",
                "--batch-size",
                batch,
                "--until-empty",
            ],
        )
    };
    let start = || start_with("1");
    // One process commits message by message, the other four at a time.
    let (mut a, mut b) = (start_with("1"), start_with("4"));
    let client = db.client().await;
    wait_for("2,000 events in the projection", T, || async {
        pg_count(
            &client,
            "SELECT count(DISTINCT event_id) FROM invoice_ledger",
        )
        .await
            >= 2000
    })
    .await;
    assert_eq!(a.wait_exit(T).await, 0, "{}", a.stderr());
    assert_eq!(b.wait_exit(T).await, 0, "{}", b.stderr());
    let mut stopped = vec![a, b];
    if ready(&conn, &q.name).await > 0 {
        stopped.extend(drain(&conn, &q.name, start, T).await);
    }

    assert_exactly_once_pg(&client, &events).await;
    assert_eq!(total_stat(&stopped, "applied"), 2000);
    assert_eq!(total_stat(&stopped, "duplicates"), 4000);
    assert!(
        stat(&stopped[0], "applied") > 0 && stat(&stopped[1], "applied") > 0,
        "both processes applied events: {:?}",
        stopped.iter().map(|p| p.stats()).collect::<Vec<_>>()
    );
}

/// The stale gate in the consumer: an older version arriving after a newer one is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_gate_drops_an_old_version_arriving_after_a_newer_one() {
    let db = PgDb::create("stale").await;
    setup_projection(&db.dsn()).await;
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = OwnQueue::declare(&ch, &unique("stale"), "", "", true).await;
    let publisher = publisher().await;
    // Versions 1, 3, then 2 (late), then 3 again under a new id, then 4.
    let sends = [(1, 100), (3, 300), (2, 200), (3, 333), (4, 400)];
    for (v, cents) in sends {
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(Uuid::now_v7(), "invoice.issued", "cust-s", Some(v)),
            &invoice_body(v, "cust-s", cents),
        )
        .await;
    }
    let stopped = drain(
        &conn,
        &q.name,
        || {
            start_consumer(
                &db.dsn(),
                &q.name,
                "gated",
                &["--stale-gate", "--until-empty"],
            )
        },
        T,
    )
    .await;
    let client = db.client().await;
    assert_eq!(
        pg_totals(&client).await,
        BTreeMap::from([("cust-s".to_string(), (3, 800))]),
        "versions 1, 3 and 4 applied; the late 2 and the repeated 3 dropped"
    );
    assert_eq!(total_stat(&stopped, "stale"), 2);
    assert_eq!(
        pg_count(
            &client,
            "SELECT version FROM consumer_aggregate_versions WHERE consumer = 'gated'"
        )
        .await,
        4
    );
}

/// `--on-poison`: a body the handler cannot read fails `--max-failures` times in place (so on
/// a single-active-consumer queue nothing overtakes it), then is parked, skipped, or halts the
/// consumer with the message left in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn poison_messages_are_parked_skipped_or_halt_in_order() {
    let db = PgDb::create("poison").await;
    setup_projection(&db.dsn()).await;
    let client = db.client().await;
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let publisher = publisher().await;

    for (policy, batch) in [
        ("park", "1"),
        ("skip", "1"),
        ("halt", "1"),
        ("park", "10"),
        ("halt", "10"),
    ] {
        client
            .batch_execute("TRUNCATE invoice_totals, invoice_ledger")
            .await
            .unwrap();
        let q = OwnQueue::declare(&ch, &unique(&format!("poison_{policy}")), "", "", true).await;
        let consumer_name = format!("{policy}_{batch}");
        let good1 = Uuid::now_v7();
        let bad = Uuid::now_v7();
        let good2 = Uuid::now_v7();
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(good1, "invoice.issued", "cust-p", None),
            &invoice_body(1, "cust-p", 100),
        )
        .await;
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(bad, "invoice.issued", "cust-p", None),
            b"{\"total_cents\": \"twelve\"}",
        )
        .await;
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(good2, "invoice.issued", "cust-p", None),
            &invoice_body(2, "cust-p", 200),
        )
        .await;
        let args = [
            "--on-poison",
            policy,
            "--max-failures",
            "3",
            "--prefetch",
            "10",
            "--batch-size",
            batch,
            "--until-empty",
        ];
        let start = || start_consumer(&db.dsn(), &q.name, &consumer_name, &args);
        let ledger = |id: Uuid| {
            let client = &client;
            async move {
                pg_count(
                    client,
                    &format!("SELECT count(*) FROM invoice_ledger WHERE event_id = '{id}'"),
                )
                .await
            }
        };
        match policy {
            "halt" => {
                let mut consumer = start();
                let code = consumer.wait_exit(T).await;
                assert_eq!(code, 1, "{}", consumer.stderr());
                assert!(consumer
                    .stderr()
                    .contains(&format!("halted on poison message {bad}")));
                assert_eq!(ledger(good1).await, 1);
                assert_eq!(
                    ledger(good2).await,
                    0,
                    "nothing overtakes the failing message"
                );
                assert_eq!(ready(&conn, &q.name).await, 2, "bad and good2 stay queued");
                assert_eq!(stat(&consumer, "failures"), 3);
            }
            _ => {
                let stopped = drain(&conn, &q.name, start, T).await;
                assert_eq!(ledger(good1).await, 1);
                assert_eq!(ledger(good2).await, 1);
                assert_eq!(ledger(bad).await, 0);
                assert_eq!(total_stat(&stopped, "failures"), 3);
                let dead = format!("{}.dead", q.name);
                if policy == "park" {
                    assert_eq!(total_stat(&stopped, "parked"), 1);
                    let got = take(&conn, &dead, 1).await;
                    let m = &got[0];
                    assert_eq!(amqp::message_id(m), bad);
                    assert_eq!(m.data, b"{\"total_cents\": \"twelve\"}");
                    let err = amqp::header_str(m, "x-outboxd-error").unwrap();
                    assert!(err.contains("not the expected JSON"), "{err}");
                    assert_eq!(
                        amqp::header(m, "x-outboxd-failures"),
                        Some(lapin::types::AMQPValue::LongLongInt(3))
                    );
                    assert_eq!(
                        amqp::header_str(m, "x-outboxd-queue").as_deref(),
                        Some(q.name.as_str())
                    );
                    assert_eq!(
                        amqp::header_str(m, "x-aggregate-id").as_deref(),
                        Some("cust-p"),
                        "the original headers stay"
                    );
                } else {
                    assert_eq!(total_stat(&stopped, "skipped"), 1);
                    assert_eq!(ready(&conn, &dead).await, 0);
                }
            }
        }
    }
}

/// `--exchange X --bind P --single-active`: the consumer declares its queue (durable, single
/// active consumer) and binds it to the relay's exchange; events published there arrive.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_declares_and_binds_its_own_queue() {
    let db = PgDb::create("declare").await;
    setup_projection(&db.dsn()).await;
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let exchange = unique("xq");
    // The relay declares its exchange; here the test stands in for it.
    ch.exchange_declare(
        exchange.clone().into(),
        lapin::ExchangeKind::Topic,
        lapin::options::ExchangeDeclareOptions {
            durable: true,
            auto_delete: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let queue = format!("{exchange}.invoices");
    let _cleanup = OwnQueue {
        name: queue.clone(),
    };
    let args = [
        "--exchange",
        exchange.as_str(),
        "--bind",
        "invoice.#",
        "--single-active",
    ];
    // No exchange of that name: the fix says to start the relay first.
    let mut p = start_consumer(
        &db.dsn(),
        &queue,
        "declared",
        &["--exchange", "nope_no_such_exchange", "--bind", "invoice.#"],
    );
    assert_eq!(p.wait_exit(T).await, 2, "{}", p.stderr());
    assert!(
        p.stderr().contains("start the relay first"),
        "{}",
        p.stderr()
    );

    let mut consumer = start_consumer(&db.dsn(), &queue, "declared", &args);
    wait_for("the queue to be declared and consumed", T, || async {
        // A channel per probe: a failed passive declaration closes its channel.
        let probe = conn.create_channel().await.unwrap();
        probe
            .queue_declare(
                queue.clone().into(),
                lapin::options::QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .is_ok_and(|q| q.consumer_count() == 1)
    })
    .await;
    let publisher = publisher().await;
    let ids: Vec<Uuid> = (0..20).map(|_| Uuid::now_v7()).collect();
    for (i, id) in ids.iter().enumerate() {
        publish(
            &publisher,
            &exchange,
            "invoice.issued",
            invoice_props(*id, "invoice.issued", "cust-d", None),
            &invoice_body(i as i64, "cust-d", 10),
        )
        .await;
    }
    let client = db.client().await;
    wait_for("20 events applied", T, || async {
        pg_count(&client, "SELECT count(*) FROM invoice_ledger").await == 20
    })
    .await;
    stop(&mut consumer, T).await;
    // Declared single-active-consumer: declaring it without the argument is refused.
    let plain = conn.create_channel().await.unwrap();
    let mismatch = plain
        .queue_declare(
            queue.clone().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    assert!(mismatch.is_err(), "the queue has x-single-active-consumer");
    assert_eq!(
        pg_totals(&client).await,
        BTreeMap::from([("cust-d".to_string(), (20, 200))])
    );
}

/// A queue that is not there, and a database without the inbox tables: the consumer stops
/// with exit 2 and the fix, and the message stays in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn misconfiguration_stops_with_the_fix() {
    let db = PgDb::create("misconf").await;
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();

    let mut p = start_consumer(&db.dsn(), &unique("nowhere"), "c", &[]);
    assert_eq!(p.wait_exit(T).await, 2, "{}", p.stderr());
    assert!(p.stderr().contains("does not exist"), "{}", p.stderr());
    assert!(p.stderr().contains("--bind"), "{}", p.stderr());

    // No migrations applied: the first message halts the consumer, whatever --on-poison says.
    let q = OwnQueue::declare(&ch, &unique("misconf"), "", "", false).await;
    publish(
        &publisher().await,
        "",
        &q.name,
        invoice_props(Uuid::now_v7(), "invoice.issued", "c", None),
        &invoice_body(1, "c", 1),
    )
    .await;
    let mut p = start_consumer(&db.dsn(), &q.name, "c", &["--on-poison", "skip"]);
    assert_eq!(p.wait_exit(T).await, 2, "{}", p.stderr());
    assert!(
        p.stderr().contains("003_processed_messages.sql"),
        "{}",
        p.stderr()
    );
    assert_eq!(ready(&conn, &q.name).await, 1, "the message stays queued");
}

/// Connections cut under the consumer: the broker's (it reconnects; what it had not acked
/// comes again) and the database's (the transaction fails, is retried in place on a new
/// connection; a commit whose answer was lost comes back as a duplicate).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cut_broker_and_database_connections_change_nothing() {
    use common::proxy::FaultProxy;
    let db = PgDb::create("cuts").await;
    setup_projection(&db.dsn()).await;
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = OwnQueue::declare(&ch, &unique("cuts"), "", "", false).await;
    let publisher = publisher().await;
    let mut events = Vec::new();
    for i in 0..3000 {
        let (customer, topic, invoices, cents, body) = invoice_event(i);
        let e = Written {
            id: Uuid::now_v7(),
            customer,
            topic,
            invoices,
            cents,
            body: body.to_string(),
        };
        publish(
            &publisher,
            "",
            &q.name,
            invoice_props(e.id, topic, &e.customer, None),
            e.body.as_bytes(),
        )
        .await;
        events.push(e);
    }
    let broker = FaultProxy::start(([127, 0, 0, 1], amqp::HOST_PORT).into())
        .await
        .unwrap();
    let pg = FaultProxy::start(([127, 0, 0, 1], 5432).into())
        .await
        .unwrap();
    let mut consumer = start_consumer_via(
        &amqp::url_via(broker.port()),
        &db.dsn_via(pg.port()),
        &q.name,
        "cuts",
        &["--prefetch", "20", "--batch-size", "10"],
    );
    let client = db.client().await;
    let applied = |n: i64| {
        let client = &client;
        async move {
            pg_count(
                client,
                "SELECT count(DISTINCT event_id) FROM invoice_ledger",
            )
            .await
                >= n
        }
    };
    for (k, at) in [(1, 500), (2, 1500)] {
        wait_for(&format!("{at} events before broker cut {k}"), T, || {
            applied(at)
        })
        .await;
        let before = broker.accepted();
        broker.cut();
        wait_for("the consumer to reconnect to the broker", T, || {
            let now = broker.accepted();
            async move { now > before }
        })
        .await;
    }
    // The database goes away for a while (connections cut, new ones refused): the consumer's
    // transaction or reconnect fails, and it retries in place until the database is back.
    wait_for("2,000 events before the database outage", T, || {
        applied(2000)
    })
    .await;
    let refused = pg.refused();
    pg.block();
    pg.cut();
    wait_for("the consumer to find the database away", T, || {
        let now = pg.refused();
        async move { now > refused }
    })
    .await;
    let before = pg.accepted();
    pg.unblock();
    wait_for("the consumer to reconnect to the database", T, || {
        let now = pg.accepted();
        async move { now > before }
    })
    .await;
    // And once more, cut wherever it is.
    wait_for("2,500 events before the database cut", T, || applied(2500)).await;
    let before = pg.accepted();
    pg.cut();
    wait_for("the consumer to reconnect to the database", T, || {
        let now = pg.accepted();
        async move { now > before }
    })
    .await;
    wait_for("3,000 events in the projection", T, || applied(3000)).await;
    stop(&mut consumer, T).await;
    let mut stopped = vec![consumer];
    if ready(&conn, &q.name).await > 0 {
        stopped.extend(
            drain(
                &conn,
                &q.name,
                || start_consumer(&db.dsn(), &q.name, "cuts", &["--until-empty"]),
                T,
            )
            .await,
        );
    }
    assert!(
        stopped[0].stderr().contains("broker connection lost"),
        "{}",
        stopped[0].stderr()
    );
    assert!(
        stat(&stopped[0], "retries") >= 1,
        "the outage was retried in place: {:?}",
        stopped[0].stats()
    );
    assert_exactly_once_pg(&client, &events).await;
}

/// The same through the MariaDB relay: binlog → RabbitMQ → the example on MariaDB, with the
/// relay SIGKILLed mid-stream, the consumer aborted between commit and ack, and copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_relay_and_consumer_apply_every_event_exactly_once() {
    let db = MyDb::create("my_e2e").await;
    setup_projection(&db.dsn()).await;
    let mut topo = Topology::new("xm").await;
    let name = unique("r");
    let exchange = topo.exchange.clone();
    let relay_args = |dsn: &str| -> Vec<String> {
        [
            "run",
            "--source",
            dsn,
            "--name",
            &name,
            "--exchange",
            &exchange,
            "--log-level",
            "info,lapin=warn",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    };
    let dsn = db.dsn();
    let start_relay = || {
        let args = relay_args(&dsn);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Proc::start(
            std::path::Path::new(env!("CARGO_BIN_EXE_outboxd")),
            &args,
            &[("OUTBOXD_SINK", &amqp::url())],
        )
    };
    let mut relay = start_relay();
    wait_for("the binlog dump", T, || db.streaming()).await;
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("invoices", "invoice.#").await;
    let mut first = start_consumer(
        &dsn,
        &queue,
        "projection",
        &["--prefetch", "50", "--crash-after-commits", "700"],
    );

    let writer_db = db.name.clone();
    let writer = tokio::spawn(async move {
        let mut c = my_connect(Some(&writer_db)).await;
        let outbox = outboxd::Outbox::new("outbox").unwrap();
        let mut out = Vec::new();
        for t in 0..30 {
            let mut tx = c
                .start_transaction(mysql_async::TxOpts::default())
                .await
                .unwrap();
            for k in 0..100 {
                let i = t * 100 + k;
                let (customer, topic, invoices, cents, body) = invoice_event(i);
                // The contract's MySQL outbox keys aggregates by BIGINT.
                let id = outbox
                    .write(&mut tx, topic, &(i % 37).to_string(), &body)
                    .await
                    .unwrap();
                out.push(Written {
                    id,
                    customer,
                    topic,
                    invoices,
                    cents,
                    body: body.to_string(),
                });
            }
            tx.commit().await.unwrap();
            tokio::task::yield_now().await;
        }
        out
    });
    let my = MariaDbRef(&db.name);
    wait_for("1,000 rows written", T, || async {
        my.count("SELECT COUNT(*) FROM outbox").await >= 1000
    })
    .await;
    relay.sigkill();
    let mut relay = start_relay();

    assert_ne!(first.wait_exit(T).await, 0);
    let crashed_id = crashed_message(&first, 700);
    let mut second = start_consumer(
        &dsn,
        &queue,
        "projection",
        &["--prefetch", "50", "--batch-size", "20"],
    );
    let events = writer.await.unwrap();
    let publisher = publisher().await;
    for e in events.iter().step_by(10) {
        publish(
            &publisher,
            &topo.exchange,
            e.topic,
            invoice_props(e.id, e.topic, &e.customer, None),
            e.body.as_bytes(),
        )
        .await;
    }
    wait_for("3,000 events in the projection", T, || async {
        my.count("SELECT COUNT(DISTINCT event_id) FROM invoice_ledger")
            .await
            >= 3000
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "relay:\n{}", relay.stderr());
    let conn = amqp::connect().await;
    stop(&mut second, T).await;
    drain(
        &conn,
        &queue,
        || start_consumer(&dsn, &queue, "projection", &["--until-empty"]),
        T,
    )
    .await;

    assert_eq!(
        my.count("SELECT COUNT(*) FROM (SELECT event_id FROM invoice_ledger GROUP BY event_id HAVING COUNT(*) <> 1) x")
            .await,
        0,
        "no event applied twice"
    );
    assert_eq!(my.count("SELECT COUNT(*) FROM invoice_ledger").await, 3000);
    let want: HashSet<Uuid> = events.iter().map(|e| e.id).collect();
    let mut c = my_connect(Some(&db.name)).await;
    use mysql_async::prelude::Queryable;
    let got: Vec<Vec<u8>> = c
        .query("SELECT event_id FROM invoice_ledger")
        .await
        .unwrap();
    let got: HashSet<Uuid> = got.iter().map(|b| Uuid::from_slice(b).unwrap()).collect();
    assert_eq!(got, want);
    let totals: Vec<(String, i64, i64)> = c
        .query("SELECT customer, invoices, total_cents FROM invoice_totals")
        .await
        .unwrap();
    let totals: BTreeMap<String, (i64, i64)> =
        totals.into_iter().map(|(k, a, b)| (k, (a, b))).collect();
    assert_eq!(totals, expected_totals(&events));
    assert_eq!(
        my.count(&format!(
            "SELECT COUNT(*) FROM invoice_ledger WHERE event_id = UNHEX('{}')",
            crashed_id.simple()
        ))
        .await,
        1
    );
}

/// Counting queries on a MariaDB database the shared harness created.
struct MariaDbRef<'a>(&'a str);

impl MariaDbRef<'_> {
    async fn count(&self, sql: &str) -> i64 {
        use mysql_async::prelude::Queryable;
        let mut c = my_connect(Some(self.0)).await;
        let v: Option<i64> = c.query_first(sql).await.unwrap();
        let _ = c.disconnect().await;
        v.unwrap_or(0)
    }
}

/// The MySQL/MariaDB side with the same example: events published directly (copies
/// included), the consumer killed between commit and ack, exactly once in the projection.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_consumer_applies_every_event_exactly_once() {
    let db = MariaDb::create("e2e").await;
    setup_projection(&db.dsn()).await;
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = OwnQueue::declare(&ch, &unique("my_e2e"), "", "", false).await;
    let publisher = publisher().await;
    let mut events = Vec::new();
    for i in 0..3000 {
        let (customer, topic, invoices, cents, body) = invoice_event(i);
        events.push(Written {
            id: Uuid::now_v7(),
            customer,
            topic,
            invoices,
            cents,
            body: body.to_string(),
        });
    }
    for (n, e) in events.iter().enumerate() {
        let copies = if n % 10 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            publish(
                &publisher,
                "",
                &q.name,
                invoice_props(e.id, e.topic, &e.customer, None),
                e.body.as_bytes(),
            )
            .await;
        }
    }
    let dsn = db.dsn();
    let mut first = start_consumer(
        &dsn,
        &q.name,
        "projection",
        &["--prefetch", "50", "--crash-after-commits", "700"],
    );
    assert_ne!(first.wait_exit(T).await, 0);
    let crashed_id = crashed_message(&first, 700);
    let restart = || {
        start_consumer(
            &dsn,
            &q.name,
            "projection",
            &[
                "--prefetch",
                "50",
                "--concurrency",
                "2",
                "--batch-size",
                "25",
                "--until-empty",
            ],
        )
    };
    let stopped = drain(&conn, &q.name, restart, T).await;

    assert_eq!(
        db.count("SELECT COUNT(*) FROM (SELECT event_id FROM invoice_ledger GROUP BY event_id HAVING COUNT(*) <> 1) x")
            .await,
        0,
        "no event applied twice"
    );
    assert_eq!(
        db.count("SELECT COUNT(DISTINCT event_id) FROM invoice_ledger")
            .await,
        3000
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM invoice_ledger").await, 3000);
    let want = expected_totals(&events);
    let mut c = db.conn().await;
    use mysql_async::prelude::Queryable;
    let got: Vec<(String, i64, i64)> = c
        .query("SELECT customer, invoices, total_cents FROM invoice_totals")
        .await
        .unwrap();
    let got: BTreeMap<String, (i64, i64)> = got.into_iter().map(|(k, a, b)| (k, (a, b))).collect();
    assert_eq!(got, want);
    assert!(total_stat(&stopped, "duplicates") > 0);
    assert_eq!(
        db.count(&format!(
            "SELECT COUNT(*) FROM invoice_ledger WHERE event_id = UNHEX('{}')",
            crashed_id.simple()
        ))
        .await,
        1,
        "the message committed before the crash was not applied again"
    );
}

/// The id the example names when it aborts after commit `n`, before that message's ack.
fn crashed_message(p: &Proc, n: u64) -> Uuid {
    let err = p.stderr();
    let marker = format!("crash injected after commit {n} (");
    err.split(&marker)
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no crash line for commit {n}:\n{err}"))
}

/// The stale gate cannot be fooled through the outbox row: the relay drops a row's
/// `x-aggregate-version` header (a non-integer, or an integer bigger than the aggregate's
/// next versions) and sends the version column's value, so every event of the aggregate is
/// applied in turn and the consumer never halts. The control at the end shows what the gate
/// does with such a header when it does arrive: a strict consumer halts on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_gate_is_not_fooled_by_a_row_forging_the_version_header() {
    let db = PgDb::create("forgev").await;
    setup_projection(&db.dsn()).await;
    let mut topo = Topology::new("xfv").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(&db, &name, &topo.exchange);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("invoices", "invoice.#").await;

    // One aggregate's events, each committed on its own. The relay sends a row's version
    // column as x-aggregate-version and drops the row's own header of that name: on a row
    // with a version the column wins, on a row without one no version header goes out, so
    // neither the non-integer (which halts a strict consumer) nor the huge integer (after
    // which the gate would drop version 2 as stale) reaches the consumer.
    let customer = "cust-fv";
    let rows = [
        (
            Some(1_i64),
            100_i64,
            Some(serde_json::json!({"x-aggregate-version": "not-an-integer", "tenant": "t1"})),
        ),
        (
            None,
            150,
            Some(serde_json::json!({"x-aggregate-version": "not-an-integer"})),
        ),
        (
            None,
            175,
            Some(serde_json::json!({"x-aggregate-version": 999_999_999_i64})),
        ),
        (Some(2), 200, None),
    ];
    let mut client = db.client().await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    for (version, cents, headers) in &rows {
        let mut tx = client.transaction().await.unwrap();
        outbox
            .write_event(
                &mut tx,
                &outboxd::NewEvent {
                    topic: "invoice.issued",
                    aggregate_id: customer,
                    payload: &serde_json::json!({"invoice_id": cents, "customer": customer, "total_cents": cents}),
                    headers: headers.as_ref(),
                    version: *version,
                },
            )
            .await
            .unwrap();
        tx.commit().await.unwrap();
    }
    let conn = amqp::connect().await;
    wait_for("the four events in the consumer's queue", T, || async {
        ready(&conn, &queue).await >= 4
    })
    .await;
    relay.signal("TERM");
    assert_eq!(
        relay.wait_exit(T).await,
        0,
        "relay stderr:\n{}",
        relay.stderr()
    );

    let stopped = drain(
        &conn,
        &queue,
        || {
            start_consumer(
                &db.dsn(),
                &queue,
                "forged",
                &["--stale-gate", "--on-poison", "halt", "--until-empty"],
            )
        },
        T,
    )
    .await;
    assert_eq!(
        pg_totals(&client).await,
        BTreeMap::from([(customer.to_string(), (4, 625))]),
        "all four applied, version 2 not dropped as stale"
    );
    assert_eq!(total_stat(&stopped, "stale"), 0);
    assert_eq!(total_stat(&stopped, "failures"), 0);
    assert_eq!(
        pg_count(
            &client,
            "SELECT version FROM consumer_aggregate_versions WHERE consumer = 'forged'"
        )
        .await,
        2,
        "the gate holds the relay's version, not the forged 999999999"
    );

    // The control: the same non-integer header published straight to a queue halts the
    // consumer, which is what the relay's drop prevented.
    let ch = conn.create_channel().await.unwrap();
    let q = OwnQueue::declare(&ch, &unique("forgev_control"), "", "", true).await;
    let mut props = invoice_props(Uuid::now_v7(), "invoice.issued", customer, None);
    let mut h = props.headers().clone().unwrap_or_default();
    h.insert(
        "x-aggregate-version".into(),
        lapin::types::AMQPValue::LongString("not-an-integer".into()),
    );
    props = props.with_headers(h);
    publish(
        &publisher().await,
        "",
        &q.name,
        props,
        &invoice_body(4, customer, 400),
    )
    .await;
    let mut consumer = start_consumer(
        &db.dsn(),
        &q.name,
        "forged",
        &["--stale-gate", "--on-poison", "halt", "--until-empty"],
    );
    assert_eq!(consumer.wait_exit(T).await, 1, "{}", consumer.stderr());
    assert!(
        consumer.stderr().contains("halted on poison message")
            && consumer.stderr().contains("not an integer"),
        "{}",
        consumer.stderr()
    );
    assert_eq!(ready(&conn, &q.name).await, 1, "the message stays queued");
}
