//! Per-aggregate order on RabbitMQ (docs/partitions.md, `--partitions N`, `outboxd topology`): the
//! relay's own partition queues, consumer groups with other partition counts, the declaration
//! modes, and the consistent-hash option — against the real Postgres and RabbitMQ. (The same
//! across a broker restart is in `tests/disruptive/rabbitmq_restart.rs`, the only test binary that may
//! restart the broker.)

use crate::common;

use common::amqp::{self, Topology};
use common::partitions::{by_aggregate, check_layout, write_interleaved};
use common::*;
use lapin::options::QueueDeclareOptions;
use lapin::types::{AMQPValue, FieldTable};
use std::process::Command;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(180);

fn start_relay(db: &PgDb, name: &str, exchange: &str, extra: &[&str]) -> Relay {
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
        "info,lapin=off",
    ];
    args.extend_from_slice(extra);
    Relay::start_with_env(&args, &[("OUTBOXD_SINK", &amqp::url())])
}

/// `outboxd topology …` with the sink in the environment; (exit code, stdout, stderr).
fn topology(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .arg("topology")
        .args(args)
        .env("OUTBOXD_SINK", amqp::url())
        .env("OUTBOXD_LOG_LEVEL", "warn,lapin=off")
        .env_remove("OUTBOXD_PARTITIONS")
        .output()
        .expect("run outboxd topology");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn wal_end(client: &tokio_postgres::Client) -> u64 {
    let s: String = client
        .query_one("SELECT pg_current_wal_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    outboxd::event::parse_lsn(&s).unwrap()
}

async fn wait_confirmed_past(db: &PgDb, slot: &str, lsn: u64) {
    wait_for(
        &format!("slot {slot} confirmed past {lsn:X}"),
        T,
        || async {
            db.slot_confirmed(slot)
                .await
                .and_then(|s| outboxd::event::parse_lsn(&s))
                .is_some_and(|c| c >= lsn)
        },
    )
    .await;
}

/// Stops the relay gracefully once everything committed so far is confirmed.
async fn drain_and_stop(db: &PgDb, slot: &str, relay: &mut Relay) {
    let client = db.client().await;
    let end = wal_end(&client).await;
    wait_confirmed_past(db, slot, end).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
}

/// Whether the relay had to reconnect and republish (another test binary may restart the
/// shared broker): then duplicates are allowed, otherwise none may appear.
fn recovered(relay: &Relay) -> bool {
    relay.stderr_plain().contains("sink failed")
}

async fn take_all_queues(topo: &Topology, queues: &[String]) -> Vec<Vec<lapin::message::Delivery>> {
    let mut out = Vec::new();
    for q in queues {
        out.push(topo.take_all(q).await);
    }
    out
}

/// Declares `queue` again with `args`: Ok when they are the queue's arguments, the broker's
/// refusal text otherwise (the only way AMQP shows a queue's arguments).
async fn redeclare(topo: &Topology, queue: &str, args: FieldTable) -> Result<(), String> {
    let ch = topo.channel().await;
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            durable: true,
            ..Default::default()
        },
        args,
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

fn queue_args(sac: bool, queue_type: &str) -> FieldTable {
    let mut a = FieldTable::default();
    a.insert("x-single-active-consumer".into(), AMQPValue::Boolean(sac));
    a.insert(
        "x-queue-type".into(),
        AMQPValue::LongString(queue_type.into()),
    );
    a
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_aggregates_keep_commit_order_in_four_partitions() {
    let started = Instant::now();
    let db = PgDb::create("part").await;
    let mut topo = Topology::new("xpa").await;
    let queues = topo.adopt_partitions(&topo.exchange.clone(), 4, false);
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(&db, &name, &topo.exchange, &["--partitions", "4"]);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;

    let mut client = db.client().await;
    let written = write_interleaved(&mut client, 200, 50, 8, |_, _| "invoice.issued".into()).await;
    assert_eq!(written.len(), 10_000);
    // Each partition is published on a channel of its own, so their confirms overlap: the
    // relay's connection holds four channels that each carried messages.
    let conn_name = format!("outboxd {name}");
    wait_for(
        "four channels of the relay to carry messages",
        T,
        || async {
            amqp::published_per_channel(&conn_name)
                .iter()
                .filter(|&&n| n > 0)
                .count()
                == 4
        },
    )
    .await;
    drain_and_stop(&db, &slot, &mut relay).await;

    // Declaring (and probing for an earlier N) left the publishing connection alone.
    assert!(
        !relay.stderr().contains("NOT_FOUND"),
        "stderr:\n{}",
        relay.stderr()
    );
    let got = take_all_queues(&topo, &queues).await;
    let expected = by_aggregate(&written);
    let report = check_layout("--partitions 4", &got, Some("x-partition"), true, &expected);
    assert!(
        report.per_queue.iter().all(|&n| n > 0),
        "all four partitions are used: {:?}",
        report.per_queue
    );
    if !recovered(&relay) {
        assert_eq!(report.duplicates, 0, "no fault, no duplicate");
        assert_eq!(report.per_queue.iter().sum::<usize>(), 10_000);
    }
    // The versions of each aggregate arrive in order too (x-aggregate-version).
    for q in &got {
        let mut last: std::collections::HashMap<String, i64> = Default::default();
        for d in q {
            let agg = amqp::header_str(d, "x-aggregate-id").unwrap();
            let Some(AMQPValue::LongLongInt(v)) = amqp::header(d, "x-aggregate-version") else {
                panic!("x-aggregate-version missing");
            };
            let prev = last.insert(agg.clone(), v).unwrap_or(0);
            assert!(
                v > prev || recovered(&relay),
                "{agg}: version {v} after {prev}"
            );
        }
    }
    assert_eq!(topo.queue_len(&topo.unrouted()).await, 0);

    // The queues are as the contract says: durable, single active consumer, classic.
    assert!(redeclare(&topo, &queues[0], queue_args(true, "classic"))
        .await
        .is_ok());
    let refused = redeclare(&topo, &queues[0], queue_args(false, "classic"))
        .await
        .unwrap_err();
    assert!(refused.contains("x-single-active-consumer"), "{refused}");
    eprintln!(
        "per queue {:?}, {} duplicates, {:.1}s",
        report.per_queue,
        report.duplicates,
        started.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consumer_groups_with_other_partition_counts_each_get_everything_in_order() {
    let db = PgDb::create("partg").await;
    let mut topo = Topology::new("xpg").await;
    let x = topo.exchange.clone();
    let own = topo.adopt_partitions(&x, 2, false);
    let ga = unique("ga");
    let gb = unique("gb");
    let gc = unique("gc");
    let qa = topo.adopt_partitions(&ga, 3, true);
    let qb = topo.adopt_partitions(&gb, 5, true);
    let qc = topo.adopt_partitions(&gc, 7, true);

    // Declared before the relay runs, the first one twice (idempotent).
    for (args, times) in [
        (
            vec!["--exchange", &x, "--group", &ga, "--partitions", "3"],
            2,
        ),
        (
            vec![
                "--exchange",
                &x,
                "--group",
                &gb,
                "--partitions",
                "5",
                "--bind",
                "invoice.#",
                "--bind",
                "order.*",
            ],
            1,
        ),
        // Not among the relay's --group-partitions: its events must wait in gc.unrouted.
        (
            vec!["--exchange", &x, "--group", &gc, "--partitions", "7"],
            1,
        ),
    ] {
        for _ in 0..times {
            let (code, out, err) = topology(&args);
            assert_eq!(code, 0, "topology {args:?}: {out}{err}");
            assert!(out.contains("single active consumer"), "{out}");
        }
    }
    let (code, out, err) = topology(&["--exchange", &x, "--group", &ga, "--partitions", "3"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains("warn"), "same N again: no warning: {out}");

    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(
        &db,
        &name,
        &x,
        &["--partitions", "2", "--group-partitions", "3,5"],
    );
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;

    let topics = [
        "invoice.issued",
        "order.created",
        "invoice.paid",
        "audit.logged",
    ];
    let mut client = db.client().await;
    let written = write_interleaved(&mut client, 200, 20, 9, |a, n| {
        topics[(a + n) % topics.len()].to_string()
    })
    .await;
    drain_and_stop(&db, &slot, &mut relay).await;

    let all = by_aggregate(&written);
    let gb_wants = by_aggregate(written.iter().filter(|w| w.topic != "audit.logged"));
    let got_a = take_all_queues(&topo, &qa).await;
    let got_b = take_all_queues(&topo, &qb).await;
    let got_own = take_all_queues(&topo, &own).await;
    let ra = check_layout("group a, N=3", &got_a, Some("x-partition-3"), true, &all);
    let rb = check_layout(
        "group b, N=5",
        &got_b,
        Some("x-partition-5"),
        true,
        &gb_wants,
    );
    let ro = check_layout(
        "relay's own, N=2",
        &got_own,
        Some("x-partition"),
        true,
        &all,
    );
    for (what, r) in [("a", &ra), ("b", &rb), ("own", &ro)] {
        assert!(
            r.per_queue.iter().all(|&n| n > 0),
            "group {what}: every partition used: {:?}",
            r.per_queue
        );
    }
    // The group whose header the relay does not send: nothing lost, nothing in its queues.
    let got_c = take_all_queues(&topo, &qc).await;
    assert!(got_c.iter().all(Vec::is_empty), "group c queues stay empty");
    let parked = topo.take_all(&format!("{gc}.unrouted")).await;
    assert!(
        parked.len() >= written.len(),
        "group c's events wait in its unrouted queue"
    );
    assert_eq!(topo.queue_len(&topo.unrouted()).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passive_relay_on_declared_quorum_queues_and_a_grown_count() {
    let db = PgDb::create("partd").await;
    let mut topo = Topology::new("xpd").await;
    let x = topo.exchange.clone();
    let queues = topo.adopt_partitions(&x, 3, false);
    let name = unique("r");

    // Passive with nothing declared: exit 2, naming what is missing and how to declare it.
    let mut relay = start_relay(
        &db,
        &name,
        &x,
        &["--partitions", "2", "--declare", "passive"],
    );
    assert_eq!(relay.wait_exit(T).await, 2, "stderr:\n{}", relay.stderr());
    let err = relay.stderr();
    assert!(err.contains("does not exist"), "{err}");

    // An administrator declares the base topology and the relay's layout (quorum queues).
    let (code, out, err) = topology(&[
        "--exchange",
        &x,
        "--partitions",
        "2",
        "--queue-type",
        "quorum",
    ]);
    assert_eq!(code, 0, "{out}{err}");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(
        &db,
        &name,
        &x,
        &["--partitions", "2", "--declare", "passive"],
    );
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    let mut client = db.client().await;
    let first = write_interleaved(&mut client, 20, 5, 10, |_, _| "t.a".into()).await;
    drain_and_stop(&db, &slot, &mut relay).await;
    let got = take_all_queues(&topo, &queues[..2]).await;
    check_layout(
        "passive, quorum",
        &got,
        Some("x-partition"),
        true,
        &by_aggregate(&first),
    );
    assert!(redeclare(&topo, &queues[0], queue_args(true, "quorum"))
        .await
        .is_ok());
    let refused = redeclare(&topo, &queues[0], queue_args(true, "classic"))
        .await
        .unwrap_err();
    assert!(refused.contains("x-queue-type"), "{refused}");

    // Three partitions now: the relay declares p2 and warns that aggregates move.
    let mut relay = start_relay(
        &db,
        &name,
        &x,
        &["--partitions", "3", "--queue-type", "quorum"],
    );
    wait_for("the relay to warn about the grown count", T, || {
        let err = relay.stderr_plain();
        async move { err.contains("fewer than 3 partitions") }
    })
    .await;
    let second = write_interleaved(&mut client, 20, 5, 11, |_, _| "t.b".into()).await;
    drain_and_stop(&db, &slot, &mut relay).await;
    let got = take_all_queues(&topo, &queues).await;
    check_layout(
        "after growing to 3",
        &got,
        Some("x-partition"),
        true,
        &by_aggregate(&second),
    );

    // A classic declaration of the quorum queues is refused with the difference and the fix.
    let mut relay = start_relay(&db, &name, &x, &["--partitions", "3"]);
    assert_eq!(relay.wait_exit(T).await, 2, "stderr:\n{}", relay.stderr());
    let err = relay.stderr();
    assert!(err.contains("x-queue-type"), "{err}");
    assert!(err.contains("fix:"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consistent_hash_routing_keeps_each_aggregate_in_one_queue() {
    let db = PgDb::create("partc").await;
    let mut topo = Topology::new("xpc").await;
    let x = topo.exchange.clone();
    let queues = topo.adopt_partitions(&x, 3, false);
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = start_relay(
        &db,
        &name,
        &x,
        &[
            "--partitions",
            "3",
            "--partition-routing",
            "consistent-hash",
        ],
    );
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    let mut client = db.client().await;
    let written = write_interleaved(&mut client, 100, 10, 12, |_, _| "t.c".into()).await;
    drain_and_stop(&db, &slot, &mut relay).await;
    let got = take_all_queues(&topo, &queues).await;
    // The broker's ring places aggregates: no x-partition, and not the murmur2 partition.
    let r = check_layout(
        "consistent-hash",
        &got,
        None,
        false,
        &by_aggregate(&written),
    );
    assert!(r.per_queue.iter().all(|&n| n > 0), "{:?}", r.per_queue);
    assert!(got
        .iter()
        .flatten()
        .all(|d| amqp::header(d, "x-partition").is_none()));

    // `check` looks for the plugin when consistent-hash is asked for.
    let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "check",
            "--source",
            &db.dsn(),
            "--name",
            &name,
            "--exchange",
            &x,
        ])
        .args([
            "--partitions",
            "3",
            "--partition-routing",
            "consistent-hash",
        ])
        .env("OUTBOXD_SINK", amqp::url())
        .env("OUTBOXD_LOG_LEVEL", "warn,lapin=off")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("ok   rabbitmq consistent-hash"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("ok   rabbitmq topology"), "{stdout}");
    // Without the plugin the broker answers as for any unknown exchange type; that answer is
    // what `check` and the relay turn into "enable rabbitmq_consistent_hash_exchange".
    let ch = topo.channel().await;
    let e = ch
        .exchange_declare(
            unique("outboxd_no_such_type").into(),
            lapin::ExchangeKind::Custom("x-outboxd-no-such-type".into()),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    let text = match e.kind() {
        lapin::ErrorKind::ProtocolError(p) => p.get_message().to_string(),
        _ => e.to_string(),
    };
    assert!(
        outboxd::sink::topology::is_unknown_exchange_type(&text),
        "{text}"
    );
}
