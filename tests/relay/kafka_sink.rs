//! Postgres and MariaDB sources → Kafka, end to end against the local tansu broker
//! (docs/kafka.md): what the topics hold and how (keyed by aggregate, in the partition Kafka's
//! default partitioner gives the key, in commit order, with the `id` header and the relay's
//! headers), where poison goes, and that 20 SIGKILLs with immediate restarts under a writer
//! leave every event exactly once. Each scenario is written once over [`SourceDb`] and runs as
//! `<scenario>::postgres` and `<scenario>::mariadb`.

use crate::common;

use common::kafka::{self, Record};
use common::proxy::FaultProxy;
use common::source_db::{on_both_sources, SourceDb};
use common::*;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

on_both_sources!(events_reach_kafka_keyed_in_order_with_headers_and_poison_is_dead);

/// The crash loop on both sources (the two lives of a loop differ in how each source resumes:
/// a slot confirmed past the stored LSN, a binlog coordinate with its GTID state).
mod sigkill_restarts_leave_every_event_exactly_once {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres() {
        super::sigkill_restarts_leave_every_event_exactly_once::<crate::common::PgDb>().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn mariadb() {
        super::sigkill_restarts_leave_every_event_exactly_once::<crate::common::MyDb>().await
    }
}

/// A test's own names: events go to `<prefix>.<topic>`, dead records to `<prefix>.dead`.
pub struct Topics {
    pub prefix: String,
}

impl Topics {
    pub fn new(tag: &str) -> Topics {
        kafka::require();
        Topics {
            prefix: unique(tag).replace('_', "-"),
        }
    }

    pub fn args(&self) -> Vec<String> {
        vec![
            "--routing-key".into(),
            format!("{}.{{topic}}", self.prefix),
            "--kafka-dead-topic".into(),
            self.dead(),
        ]
    }

    pub fn topic(&self, topic: &str) -> String {
        format!("{}.{topic}", self.prefix)
    }

    pub fn dead(&self) -> String {
        format!("{}.dead", self.prefix)
    }
}

/// `outboxd run` with the Kafka sink `sink` given through the environment.
pub fn start(source: &str, name: &str, t: &Topics, sink: &str, extra: &[&str]) -> Relay {
    let mut args: Vec<String> = vec![
        "run".into(),
        "--source".into(),
        source.into(),
        "--name".into(),
        name.into(),
        "--log-level".into(),
        std::env::var("OUTBOXD_TEST_LOG").unwrap_or_else(|_| "info".into()),
    ];
    args.extend(t.args());
    args.extend(extra.iter().map(|a| a.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Relay::start_with_env(&args, &[("OUTBOXD_SINK", sink)])
}

pub fn id_of(r: &Record) -> Uuid {
    r.header("id")
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("a record without an id header: {r:?}"))
}

/// Every expected id exactly once, nothing else, and within each partition in commit order.
pub fn assert_exactly_once_in_order(records: &[Record], expected: &[Uuid]) {
    let mut counts: HashMap<Uuid, usize> = HashMap::new();
    for r in records {
        *counts.entry(id_of(r)).or_default() += 1;
    }
    let dups: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    for (id, _) in dups.iter().take(3) {
        for r in records.iter().filter(|r| id_of(r) == **id) {
            eprintln!(
                "duplicate {id}: partition {} offset {} position {:?}",
                r.partition,
                r.offset,
                r.header("x-source-position")
            );
        }
    }
    assert!(
        dups.is_empty(),
        "{} ids stored more than once, e.g. {:?}",
        dups.len(),
        &dups[..dups.len().min(3)]
    );
    let have: HashSet<&Uuid> = counts.keys().collect();
    let missing: Vec<&Uuid> = expected.iter().filter(|i| !have.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} events missing, e.g. {:?}",
        missing.len(),
        expected.len(),
        &missing[..missing.len().min(3)]
    );
    assert_eq!(
        records.len(),
        expected.len(),
        "nothing but the expected events"
    );
    let rank: HashMap<&Uuid, usize> = expected.iter().enumerate().map(|(i, u)| (u, i)).collect();
    let mut last: HashMap<i32, usize> = HashMap::new();
    for r in records {
        let at = rank[&id_of(r)];
        if let Some(prev) = last.insert(r.partition, at) {
            assert!(
                prev < at,
                "partition {} holds event #{at} after #{prev}: not commit order",
                r.partition
            );
        }
    }
}

async fn events_reach_kafka_keyed_in_order_with_headers_and_poison_is_dead<D: SourceDb>() {
    let db = D::create("kafkae").await;
    let t = Topics::new("ke");
    let name = unique("r");
    let mut relay = start(
        &db.dsn(),
        &name,
        &t,
        &kafka::url(),
        &["--kafka-partitions", "3"],
    );
    db.wait_streaming(&name).await;
    let expected = db.write(20, 5, "order.placed").await;
    // A topic no Kafka topic can be named after: a dead record with the reason.
    let poison = db.write(1, 1, "bad topic").await;
    let topic = t.topic("order.placed");
    let got = kafka::wait_records(&topic, expected.len(), T).await;
    let dead = kafka::wait_records(&t.dead(), 1, T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    assert_exactly_once_in_order(&got, &expected);
    let partitions: HashSet<i32> = got.iter().map(|r| r.partition).collect();
    assert!(
        partitions.len() > 1,
        "3 partitions, keys spread: {partitions:?}"
    );
    for r in &got {
        let key = r.key.as_deref().expect("keyed by aggregate id");
        assert_eq!(r.header("x-aggregate-id"), Some(key));
        assert_eq!(
            r.partition,
            outboxd::sink::partition::partition_of(key, 3) as i32,
            "Kafka's default partitioner (murmur2) places {key}"
        );
        assert_eq!(r.header("x-outbox-relay"), Some(name.as_str()));
        assert!(D::is_position(r.header("x-source-position").unwrap_or("")));
        let body: serde_json::Value = serde_json::from_slice(&r.value).expect("raw JSON payload");
        assert_eq!(body["total"], "12.50");
    }
    assert_eq!(dead.len(), 1, "one dead record: {dead:?}");
    assert!(dead[0].value.is_empty(), "a dead record has no body");
    assert!(
        dead[0]
            .header("x-dead-reason")
            .unwrap_or("")
            .contains("[A-Za-z0-9._-]"),
        "{:?}",
        dead[0].headers
    );
    assert_eq!(dead[0].header("x-original-topic"), Some("bad topic"));
    assert_eq!(
        dead[0].header("id"),
        Some(poison[0].hyphenated().to_string().as_str())
    );
}

/// 20 SIGKILLs, each followed at once by a restart, while a writer commits all along: every
/// committed event is in Kafka exactly once, in commit order per partition.
async fn sigkill_restarts_leave_every_event_exactly_once<D: SourceDb>() {
    let db = D::create("kafkak").await;
    let t = Topics::new("kk");
    let name = unique("r");
    let life = || {
        start(
            &db.dsn(),
            &name,
            &t,
            &kafka::url(),
            &["--kafka-partitions", "2"],
        )
    };
    let mut relay = life();
    db.wait_streaming(&name).await;
    // About 5 s of writing, so that most of the 20 kills land while the producer writes;
    // transactions of 50 events, so that a kill finds events written but not yet stored.
    let writer = db.write_in_background(80, 25, Duration::from_millis(100), "kill.stream");
    let topic = t.topic("kill.stream");
    let (kills, step) = (20, 80);
    let mut lives = Vec::new();
    for k in 1..=kills {
        kafka::wait_count(&topic, (k * step) as i64, T).await;
        relay.sigkill();
        lives.push(relay.stderr());
        relay = life();
    }
    let expected = writer.await.unwrap();
    let got = kafka::wait_records(&topic, expected.len(), T).await;
    // Past the count: wait until the last life stored a position past the last event, so a
    // late duplicate would have been written by now.
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let got = if got.len() < expected.len() {
        got
    } else {
        kafka::read_all(&topic, true)
    };
    lives.push(relay.stderr());
    let skipped_lives = lives
        .iter()
        .filter(|e| e.contains("already in Kafka are acknowledged without publishing"))
        .count();
    let kafka_lines: Vec<&str> = lives
        .iter()
        .flat_map(|e| e.lines())
        .filter(|l| l.contains("Kafka") || l.contains("resuming") || l.contains("tail"))
        .collect();
    if std::env::var_os("OUTBOXD_TEST_VERBOSE").is_some() {
        eprintln!("{}", kafka_lines.join("\n"));
    }
    assert_exactly_once_in_order(&got, &expected);
    // The kills did leave written events unstored, and a later life found them in Kafka.
    assert!(
        skipped_lives > 0,
        "no life found an event of an earlier one in Kafka: the kills tested nothing"
    );
    eprintln!("{kills} kills: {skipped_lives} lives skipped events already in Kafka");
}

/// A broker of the test's own on a free port behind the TCP proxy, advertising the proxy's
/// port: (the broker's port, the proxy, the broker).
async fn proxied_broker() -> (u16, FaultProxy, kafka::OwnBroker) {
    let broker_port = free_local_port();
    let proxy = FaultProxy::start(([127, 0, 0, 1], broker_port).into())
        .await
        .unwrap();
    let broker = kafka::OwnBroker::start(broker_port, proxy.port());
    (broker_port, proxy, broker)
}

/// A broker of the test's own behind the TCP proxy (its advertised address is the proxy's,
/// so every connection the client makes goes through it): two cuts and a stall while a writer
/// commits lose nothing and duplicate nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_cut_and_stalled_connections_lose_and_duplicate_nothing() {
    let db = PgDb::create("kafkac").await;
    let t = Topics::new("kc");
    let (broker_port, proxy, _broker) = proxied_broker().await;
    let name = unique("r");
    let mut relay = start(
        &db.dsn(),
        &name,
        &t,
        &kafka::url_on(proxy.port()),
        &["--confirm-timeout", "3s"],
    );
    let topic = t.topic("cut.stream");
    let count = |n: i64| {
        let topic = topic.clone();
        async move {
            let t = topic.clone();
            tokio::task::spawn_blocking(move || kafka::count_on(broker_port, &t))
                .await
                .unwrap()
                >= n
        }
    };
    db.wait_streaming(&name).await;
    let writer = db.write_in_background(40, 50, Duration::from_millis(20), "cut.stream");
    for k in 1..=2i64 {
        let accepted = proxy.accepted();
        wait_for(&format!("{} records before cut {k}", k * 400), T, || {
            count(k * 400)
        })
        .await;
        proxy.cut();
        wait_for("the client to reconnect", T, || {
            let now = proxy.accepted();
            async move { now > accepted }
        })
        .await;
    }
    proxy.stall();
    wait_for("a delivery timeout under the stall", T, || {
        let err = relay.stderr();
        async move { err.contains("sink still unavailable") || err.contains("retrying") }
    })
    .await;
    proxy.resume();
    let expected = writer.await.unwrap();
    let got = kafka::wait_records_on(broker_port, &topic, expected.len(), T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let t2 = topic.clone();
    let got = if got.len() < expected.len() {
        got
    } else {
        tokio::task::spawn_blocking(move || kafka::read_all_on(broker_port, &t2, true))
            .await
            .unwrap()
    };
    assert_exactly_once_in_order(&got, &expected);
}

/// `--declare off` with the topic missing: the relay says what is missing and how to create
/// it, publishes nothing and keeps its position; once the topic exists every event arrives
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_missing_topic_under_declare_off_holds_the_relay_back_and_loses_nothing() {
    let db = PgDb::create("kafkao").await;
    let t = Topics::new("ko");
    let name = unique("r");
    kafka::create_topic(&t.dead(), 1).await;
    let mut relay = start(
        &db.dsn(),
        &name,
        &t,
        &kafka::url(),
        &["--declare", "off", "--confirm-timeout", "3s"],
    );
    db.wait_streaming(&name).await;
    let expected = db.write(10, 5, "late.topic").await;
    let topic = t.topic("late.topic");
    relay
        .wait_for_stderr(&["does not exist", "--declare auto"], T)
        .await;
    let t2 = topic.clone();
    assert!(
        !tokio::task::spawn_blocking(move || kafka::topic_exists_on(kafka::PORT, &t2))
            .await
            .unwrap(),
        "--declare off created the topic"
    );
    let stored_before = db.stored_pos(&name).await;
    kafka::create_topic(&topic, 1).await;
    let got = kafka::wait_records(&topic, expected.len(), T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    assert_exactly_once_in_order(&got, &expected);
    let stored_after = db.stored_pos(&name).await;
    assert!(
        stored_after > stored_before,
        "the position moved once the topic existed ({stored_before:?} → {stored_after:?})"
    );
}

/// `outboxd check` with a Kafka sink: `args` after the source and the sink; (success, stdout).
fn kafka_check(dsn: &str, name: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["check", "--source", dsn, "--name", name])
        .args(["--sink", &kafka::url()])
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

/// `check` reports the broker, its support of the idempotent producer, and each topic the
/// relay writes (the dead topic, a constant template's topic): missing ones fail under
/// `--declare passive` with the command that creates them, and pass once they exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_check_reports_the_broker_idempotence_and_missing_topics_with_the_fix() {
    let db = PgDb::create("kafkachk").await;
    let t = Topics::new("kchk");
    let name = unique("r");
    let topic = t.topic("orders");
    let args = [
        "--declare",
        "passive",
        "--kafka-partitions",
        "3",
        "--kafka-dead-topic",
        &t.dead(),
        "--routing-key",
        &topic,
    ];
    let (ok, text) = kafka_check(&db.dsn(), &name, &args);
    assert!(!ok, "missing topics under passive fail check:\n{text}");
    assert!(
        text.contains("ok   kafka connect: 1 broker: 127.0.0.1:9092"),
        "{text}"
    );
    assert!(
        text.contains("ok   kafka idempotent producer: the broker answers InitProducerId"),
        "{text}"
    );
    for (check, missing) in [
        ("kafka dead topic", t.dead()),
        ("kafka topic", topic.clone()),
    ] {
        assert!(
            text.contains(&format!("FAIL {check} {missing}: does not exist")),
            "{missing}:\n{text}"
        );
        assert!(
            text.contains(&format!(
                "kafka-topics.sh --bootstrap-server <broker> --create --topic {missing} --partitions 3 --replication-factor 1"
            )),
            "{missing}:\n{text}"
        );
    }
    // Under auto the relay creates them: a warning that says so.
    let mut auto = args;
    auto[1] = "auto";
    let (_, text) = kafka_check(&db.dsn(), &name, &auto);
    assert!(
        text.contains(&format!("warn kafka topic {topic}: does not exist"))
            && text
                .contains("none needed: the relay creates it (--declare auto) with 3 partition(s)"),
        "{text}"
    );

    kafka::create_topic(&t.dead(), 1).await;
    kafka::create_topic(&topic, 3).await;
    let (_, text) = kafka_check(&db.dsn(), &name, &args);
    assert!(
        text.contains(&format!(
            "ok   kafka dead topic {}: 1 partition(s), replication 1",
            t.dead()
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "ok   kafka topic {topic}: 3 partition(s), replication 1"
        )),
        "{text}"
    );
    assert!(!text.contains("FAIL kafka"), "{text}");

    // A template over the row: the topics already under its constant prefix are listed.
    let template = format!("{}.{{topic}}", t.prefix);
    let (_, text) = kafka_check(
        &db.dsn(),
        &name,
        &["--declare", "passive", "--routing-key", &template],
    );
    assert!(
        text.contains(&format!(
            "the topic template {template} names a topic per event"
        )) && text.contains(&format!("{topic} (3 partition(s), replication 1)")),
        "{text}"
    );
}

/// The broker stopped and started again mid-stream. A broker of the test's own (memory storage,
/// so the one that comes back is empty) behind the TCP proxy; the relay is frozen (SIGSTOP) and
/// its connections cut first, so that what the old broker holds can be read at the stop
/// (nothing else can have been confirmed), then the broker is killed and started again and the
/// relay resumed, while a writer commits all along.
/// The relay does not exit, reconnects, declares its topics again (`--declare auto`), and the new
/// broker holds, once each and in commit order per partition, every event the old one did not
/// hold at the stop. The events the old broker held are gone with its memory: a durable broker
/// would keep them (docs/kafka.md, "The test broker").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_broker_restarted_mid_stream_relay_reconnects_and_delivers_every_unheld_event_once() {
    let db = PgDb::create("kafkar").await;
    let t = Topics::new("kr");
    let (broker_port, proxy, mut broker) = proxied_broker().await;
    let name = unique("r");
    let mut relay = start(
        &db.dsn(),
        &name,
        &t,
        &kafka::url_on(proxy.port()),
        &["--confirm-timeout", "3s", "--kafka-partitions", "2"],
    );
    let topic = t.topic("restart.stream");
    let read = |committed: bool| {
        let topic = topic.clone();
        async move {
            tokio::task::spawn_blocking(move || kafka::read_all_on(broker_port, &topic, committed))
                .await
                .unwrap()
        }
    };
    // Read when nothing more comes (tansu's high watermark lags by up to a batch per
    // partition); the watermarks (quick) while the writer writes.
    let count = |n: usize| {
        let r = read(false);
        async move { r.await.len() >= n }
    };
    let marks = |n: i64| {
        let topic = topic.clone();
        async move {
            tokio::task::spawn_blocking(move || kafka::count_on(broker_port, &topic))
                .await
                .unwrap()
                >= n
        }
    };
    db.wait_streaming(&name).await;
    let mut expected = db.write(10, 20, "restart.stream").await;
    relay
        .wait_running("the first 200 events in Kafka", T, || count(200))
        .await;
    let writer = db.write_in_background(80, 10, Duration::from_millis(50), "restart.stream");
    relay
        .wait_running("the writer's events flowing", T, || marks(260))
        .await;

    // The relay frozen and its connections reset: nothing more reaches the old broker, so
    // what it holds now is everything it will ever have held.
    relay.signal("STOP");
    proxy.cut();
    let held: HashSet<Uuid> = read(false).await.iter().map(id_of).collect();
    broker.restart();
    let t2 = topic.clone();
    assert!(
        !tokio::task::spawn_blocking(move || kafka::topic_exists_on(broker_port, &t2))
            .await
            .unwrap(),
        "the restarted broker is empty (memory storage): the stop did happen"
    );
    relay.signal("CONT");

    expected.extend(writer.await.unwrap());
    let must: Vec<Uuid> = expected
        .iter()
        .filter(|id| !held.contains(id))
        .copied()
        .collect();
    assert!(
        held.len() >= 260 && !must.is_empty(),
        "the stop fell mid-stream: {} held, {} not",
        held.len(),
        must.len()
    );
    relay
        .wait_running(
            "every event the old broker did not hold, on the new one",
            T,
            || {
                let r = read(true);
                let must = must.clone();
                async move {
                    let have: HashSet<Uuid> = r.await.iter().map(id_of).collect();
                    must.iter().all(|id| have.contains(id))
                }
            },
        )
        .await;
    let dead = t.dead();
    assert!(
        tokio::task::spawn_blocking(move || kafka::topic_exists_on(broker_port, &dead))
            .await
            .unwrap(),
        "the dead topic declared again on the new broker"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let connects = relay.stderr().matches("connected to Kafka").count();
    assert!(connects >= 2, "the relay reconnected ({connects} connects)");

    // The new broker: the unheld events once each, in commit order per partition; of the held
    // ones only those whose confirmation the stall kept from the relay (published again).
    let got = read(true).await;
    let rank: HashMap<Uuid, usize> = expected.iter().enumerate().map(|(i, u)| (*u, i)).collect();
    let mut seen = HashSet::new();
    let mut last: HashMap<i32, usize> = HashMap::new();
    for r in &got {
        let id = id_of(r);
        assert!(seen.insert(id), "{id} twice on the new broker");
        let at = *rank
            .get(&id)
            .unwrap_or_else(|| panic!("{id} was never written"));
        if let Some(prev) = last.insert(r.partition, at) {
            assert!(
                prev < at,
                "partition {} holds #{at} after #{prev}",
                r.partition
            );
        }
    }
    let republished = got.iter().filter(|r| held.contains(&id_of(r))).count();
    eprintln!(
        "{} events: {} held at the stop (gone with the broker), {} delivered after it ({republished} of them held but unconfirmed)",
        expected.len(),
        held.len(),
        got.len()
    );
}

/// A broker that cannot be reached (a closed port): every client librdkafka runs logs each
/// failed connect and "all brokers down", several lines a second. Over a bounded run (three
/// failed connects of the relay) each kind of line appears once; the relay's own warning says
/// the sink is unavailable each time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_unreachable_broker_logs_each_librdkafka_error_once_not_a_storm() {
    let db = PgDb::create("kafkaq").await;
    let t = Topics::new("kq");
    let closed = free_local_port();
    let name = unique("r");
    let mut relay = start(
        &db.dsn(),
        &name,
        &t,
        &kafka::url_on(closed),
        &["--confirm-timeout", "2s"],
    );
    wait_for("three failed connects", T, || {
        let n = relay.stderr().matches("sink unavailable").count();
        async move { n >= 3 }
    })
    .await;
    relay.sigkill();
    let err = relay.stderr_plain();
    let lines: Vec<&str> = err.lines().filter(|l| l.contains("librdkafka")).collect();
    assert!(
        lines.iter().any(|l| l.contains("Connection refused")),
        "librdkafka reported the refused connects: {err}"
    );
    assert!(
        lines.len() <= 4,
        "{} librdkafka lines over three failed connects:\n{}",
        lines.len(),
        lines.join("\n")
    );
}

/// docs/migrating-from-debezium.md's Kafka path: Debezium's reference outbox table relayed with
/// `--column debezium` alone gives what the Outbox Event Router gives: topic
/// `outbox.event.<aggregatetype>`, key = `aggregateid` (in the partition Kafka's default
/// partitioner gives it), header `id` = the event id, the payload as the value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_debezium_table_keeps_the_outbox_event_routers_topics_keys_and_id_header() {
    kafka::require();
    let db = PgDb::create("kafkadbz").await;
    let name = unique("r");
    // The aggregate type names the topic: one of the test's own on the shared broker.
    let aggregate_type = unique("Order").replace('_', "-");
    let topic = format!("outbox.event.{aggregate_type}");
    let dead = format!("{aggregate_type}.dead");
    let client = db.client().await;
    client
        .batch_execute(
            "DROP TABLE outbox;
             CREATE TABLE outbox (id uuid NOT NULL PRIMARY KEY, aggregatetype varchar(255) NOT NULL,
               aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)",
        )
        .await
        .unwrap();
    let dsn = db.dsn();
    let sink = kafka::url();
    let mut relay = Relay::start_with_env(
        &[
            "run",
            "--source",
            &dsn,
            "--name",
            &name,
            "--column",
            "debezium",
            "--kafka-dead-topic",
            &dead,
            "--kafka-partitions",
            "3",
        ],
        &[("OUTBOXD_SINK", &sink)],
    );
    wait_for("the relay's slot to be active", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    let events: Vec<(Uuid, &str)> = ["123", "456", "123", "789"]
        .into_iter()
        .map(|key| (Uuid::now_v7(), key))
        .collect();
    for (id, key) in &events {
        client
            .execute(
                "INSERT INTO outbox VALUES ($1, $2, $3, 'OrderCreated', '{\"customerId\": 7}')",
                &[id, &aggregate_type, key],
            )
            .await
            .unwrap();
    }
    let got = kafka::wait_records(&topic, events.len(), T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let expected: Vec<Uuid> = events.iter().map(|(id, _)| *id).collect();
    assert_exactly_once_in_order(&got, &expected);
    for (id, key) in &events {
        let r = got.iter().find(|r| id_of(r) == *id).expect("the event");
        assert_eq!(r.key.as_deref(), Some(*key), "key = aggregateid");
        assert_eq!(
            r.header("id"),
            Some(id.hyphenated().to_string().as_str()),
            "header id = the event id"
        );
        assert_eq!(
            r.partition,
            outboxd::sink::partition::partition_of(key, 3) as i32,
            "Kafka's default partitioner places {key}"
        );
        let value: serde_json::Value = serde_json::from_slice(&r.value).expect("a JSON value");
        assert_eq!(
            value,
            serde_json::json!({"customerId": 7}),
            "value = payload"
        );
    }
}
