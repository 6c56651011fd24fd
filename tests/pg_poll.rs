//! Poll mode on Postgres: several relays on one table, crashes between publish and mark, a
//! broker cut for one relay, and NOTIFY waking a poller early.

mod common;

use common::amqp::Topology;
use common::proxy::FaultProxy;
use common::*;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

fn ids(relay: &Relay) -> Vec<Uuid> {
    parse_lines(&relay.lines())
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

async fn pending(db: &PgDb) -> i64 {
    db.client()
        .await
        .query_one(
            "SELECT count(*) FROM outbox WHERE status = 'pending' OR published_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_share_a_table_each_event_once() {
    let db = PgDb::create("poll3").await;
    let dsn = db.dsn();
    let relays: Vec<Relay> = (0..3)
        .map(|i| {
            Relay::start(&[
                "run",
                "--mode",
                "poll",
                "--source",
                &dsn,
                "--name",
                &format!("p{i}"),
                "--commit-offsets",
                "--poll-interval",
                "50ms",
                "--poll-batch",
                "100",
            ])
        })
        .collect();
    let mut client = db.client().await;
    let expected = write_events(&mut client, 100, 100, "poll.three").await;
    wait_for("every row marked published", T, || async {
        pending(&db).await == 0
    })
    .await;
    let mut counts: HashMap<Uuid, usize> = HashMap::new();
    let mut per_relay = Vec::new();
    for r in &relays {
        let got = ids(r);
        per_relay.push(got.len());
        for i in got {
            *counts.entry(i).or_default() += 1;
        }
    }
    assert!(
        expected.iter().all(|i| counts.get(i) == Some(&1)),
        "every event exactly once across the relays"
    );
    assert_eq!(counts.len(), expected.len(), "nothing else");
    assert!(
        per_relay.iter().all(|&n| n > 0),
        "all three progressed: {per_relay:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_publish_and_mark_republishes() {
    let db = PgDb::create("pollkill").await;
    let dsn = db.dsn();
    let args = [
        "run",
        "--mode",
        "poll",
        "--source",
        &dsn,
        "--name",
        "k",
        "--commit-offsets",
        "--poll-interval",
        "20ms",
        "--poll-batch",
        "50",
    ];
    let mut first = Relay::start(&args);
    let mut client = db.client().await;
    let writer = {
        let mut c = db.client().await;
        tokio::spawn(async move { write_events(&mut c, 60, 100, "poll.kill").await })
    };
    wait_for("some published", T, || {
        let n = first.line_count();
        async move { n >= 1500 }
    })
    .await;
    first.sigkill();
    let before = ids(&first);
    let expected = writer.await.unwrap();
    let second = Relay::start(&args);
    wait_for("every row marked", T, || async { pending(&db).await == 0 }).await;
    let mut all: Vec<Uuid> = before.clone();
    all.extend(ids(&second));
    let got: HashSet<Uuid> = all.iter().copied().collect();
    assert!(expected.iter().all(|i| got.contains(i)), "nothing lost");
    // Rows the first relay printed but had not marked come again.
    let marked_by_first: i64 = client
        .query_one("SELECT count(*) FROM outbox WHERE id = ANY($1)", &[&before])
        .await
        .unwrap()
        .get(0);
    assert_eq!(marked_by_first as usize, before.len());
    let _ = &mut client;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relays_broker_cut_the_others_carry_on() {
    let db = PgDb::create("pollcut").await;
    let mut topo = Topology::new("pollcut").await;
    let dsn = db.dsn();
    let proxy = FaultProxy::start(
        format!("127.0.0.1:{}", common::amqp::HOST_PORT)
            .parse()
            .unwrap(),
    )
    .await
    .unwrap();
    let url_cut = common::amqp::url_via(proxy.port());
    let url = common::amqp::url();
    let mk = |name: &str, sink: &str| {
        Relay::start(&[
            "run",
            "--mode",
            "poll",
            "--source",
            &dsn,
            "--name",
            name,
            "--sink",
            sink,
            "--exchange",
            &topo.exchange,
            "--poll-interval",
            "20ms",
            "--poll-batch",
            "50",
            "--confirm-timeout",
            "2s",
        ])
    };
    let _a = mk("a", &url_cut);
    let _b = mk("b", &url);
    let _c = mk("c", &url);
    topo.wait_declared(T).await;
    let q = topo.bind_queue("all", "#").await;
    let mut client = db.client().await;
    let mut expected = write_events(&mut client, 10, 50, "cut.before").await;
    proxy.block();
    proxy.cut();
    expected.extend(write_events(&mut client, 20, 50, "cut.during").await);
    wait_for(
        "the others publish everything while one is cut off",
        T,
        || async { pending(&db).await == 0 },
    )
    .await;
    proxy.unblock();
    expected.extend(write_events(&mut client, 10, 50, "cut.after").await);
    wait_for("everything marked after the cut", T, || async {
        pending(&db).await == 0
    })
    .await;
    // Duplicates are allowed (a batch released by the cut relay is published by another), so
    // take everything there is once all rows are marked.
    wait_for("at least every event in the queue", T, || async {
        topo.queue_len(&q).await as usize >= expected.len()
    })
    .await;
    let got: HashSet<Uuid> = topo
        .take_all(&q)
        .await
        .iter()
        .map(common::amqp::message_id)
        .collect();
    let lost: Vec<_> = expected.iter().filter(|i| !got.contains(i)).collect();
    assert!(lost.is_empty(), "{} of {} lost", lost.len(), expected.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_a_poller_before_its_interval() {
    let db = PgDb::create("pollnotify").await;
    let dsn = db.dsn();
    let mut setup = Relay::start(&["setup", "--mode", "poll", "--notify", "--source", &dsn]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let relay = Relay::start(&[
        "run",
        "--mode",
        "poll",
        "--notify",
        "--source",
        &dsn,
        "--name",
        "n",
        "--commit-offsets",
        "--poll-interval",
        "1h",
    ]);
    // The first poll happens at start; after it the relay sleeps for an hour unless woken.
    wait_for("the LISTEN session", T, || async {
        pg_connect(PG_ADMIN)
            .await
            .query_opt("SELECT 1 FROM pg_stat_activity WHERE application_name = 'outboxd_listen' AND datname = $1", &[&db.name])
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let mut client = db.client().await;
    let id = write_events(&mut client, 1, 1, "notify").await;
    wait_for(
        "the event, long before the hour",
        Duration::from_secs(10),
        || {
            let n = relay.line_count();
            async move { n >= 1 }
        },
    )
    .await;
    assert_eq!(ids(&relay), id);
}
