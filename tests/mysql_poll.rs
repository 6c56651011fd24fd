//! Poll mode on MariaDB: several relays on one table, a crash between publish and mark, a
//! broker cut for one relay, and `setup --create-table --mode poll` / `check --mode poll`.

mod common;

use common::amqp::Topology;
use common::proxy::FaultProxy;
use common::*;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

fn ids(relay: &Relay) -> Vec<Uuid> {
    parse_lines(&relay.lines())
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

async fn pending(db: &MyDb) -> i64 {
    let mut c = db.conn().await;
    my_value(
        &mut c,
        "SELECT COUNT(*) FROM outbox WHERE status = 'pending' OR published_at IS NULL",
    )
    .await
    .unwrap()
    .parse()
    .unwrap()
}

fn poll_args<'a>(dsn: &'a str, name: &'a str, interval: &'a str, batch: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--mode",
        "poll",
        "--source",
        dsn,
        "--name",
        name,
        "--commit-offsets",
        "--poll-interval",
        interval,
        "--poll-batch",
        batch,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_share_a_table_each_event_once() {
    let db = MyDb::create("my_poll3").await;
    let dsn = db.dsn();
    let names = ["p0", "p1", "p2"];
    let relays: Vec<Relay> = names
        .iter()
        .map(|n| Relay::start(&poll_args(&dsn, n, "50ms", "100")))
        .collect();
    // 10,000 events written while the three poll.
    let writer = {
        let mut c = db.conn().await;
        tokio::spawn(async move { my_write_events(&mut c, 100, 100, "poll.three").await })
    };
    let expected = writer.await.unwrap();
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
    let twice = counts.values().filter(|&&n| n != 1).count();
    assert_eq!(twice, 0, "every event exactly once across the relays");
    assert!(
        expected.iter().all(|i| counts.get(i) == Some(&1)),
        "every event published"
    );
    assert_eq!(counts.len(), expected.len(), "nothing else");
    assert!(
        per_relay.iter().all(|&n| n > 0),
        "all three progressed: {per_relay:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_publish_and_mark_republishes() {
    let db = MyDb::create("my_pollkill").await;
    let dsn = db.dsn();
    let args = poll_args(&dsn, "k", "20ms", "50");
    let mut first = Relay::start(&args);
    let writer = {
        let mut c = db.conn().await;
        tokio::spawn(async move { my_write_events(&mut c, 60, 100, "poll.kill").await })
    };
    wait_for("some published", T, || {
        let n = first.line_count();
        async move { n >= 1500 }
    })
    .await;
    first.sigkill();
    let before = ids(&first);
    // What the killed relay published but had not marked (its batch's transaction was still
    // open): a plain read does not wait for its locks and sees those rows pending.
    let unmarked: HashSet<Uuid> = {
        use mysql_async::prelude::Queryable;
        let mut c = db.conn().await;
        let rows: Vec<Vec<u8>> = c
            .query("SELECT id FROM outbox WHERE status = 'pending'")
            .await
            .unwrap();
        let pending: HashSet<Uuid> = rows
            .into_iter()
            .map(|b| Uuid::from_slice(&b).unwrap())
            .collect();
        before
            .iter()
            .copied()
            .filter(|i| pending.contains(i))
            .collect()
    };
    let expected = writer.await.unwrap();
    let second = Relay::start(&args);
    wait_for("every row marked", T, || async { pending(&db).await == 0 }).await;
    let again: HashSet<Uuid> = ids(&second).into_iter().collect();
    let mut got: HashSet<Uuid> = before.iter().copied().collect();
    got.extend(&again);
    let lost: Vec<_> = expected.iter().filter(|i| !got.contains(i)).collect();
    assert!(lost.is_empty(), "{} of {} lost", lost.len(), expected.len());
    // Published before the kill, not yet marked: published again, by the second relay.
    let missing: Vec<_> = unmarked.iter().filter(|i| !again.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} published-but-unmarked rows not republished",
        missing.len(),
        unmarked.len()
    );
    eprintln!(
        "killed with {} published-but-unmarked rows; all republished",
        unmarked.len()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relays_broker_cut_the_others_carry_on() {
    let db = MyDb::create("my_pollcut").await;
    let mut topo = Topology::new("mypollcut").await;
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
    let a = mk("a", &url_cut);
    let _b = mk("b", &url);
    let _c = mk("c", &url);
    topo.wait_declared(T).await;
    let q = topo.bind_queue("all", "#").await;
    let mut c = db.conn().await;
    let mut expected = my_write_events(&mut c, 10, 50, "cut.before").await;
    proxy.block();
    proxy.cut();
    expected.extend(my_write_events(&mut c, 20, 50, "cut.during").await);
    wait_for(
        "the others publish everything while one is cut off",
        T,
        || async { pending(&db).await == 0 },
    )
    .await;
    proxy.unblock();
    expected.extend(my_write_events(&mut c, 10, 50, "cut.after").await);
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
    assert!(
        a.stderr().contains("releasing its rows") || proxy.accepted() > 1,
        "the cut relay noticed the cut: {}",
        a.stderr()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_creates_the_seeds_table_and_check_validates_it() {
    let db = MyDb::create("my_pollsetup").await;
    let dsn = db.dsn();
    let mut c = db.conn().await;
    my_exec(&mut c, "DROP TABLE outbox").await;
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(args)
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("migrations/mysql/001_outbox.sql"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = run(&[
        "setup",
        "--create-table",
        "--mode",
        "poll",
        "--source",
        &dsn,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("(created)"));
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("idx_dispatch") && text.contains("grants"),
        "{text}"
    );

    // Without the index: a failure with the statement that adds it.
    my_exec(&mut c, "ALTER TABLE outbox DROP KEY idx_dispatch").await;
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("ADD KEY idx_dispatch (`status`, `created_at`)"),
        "{text}"
    );
    // Without the status column: poll mode refuses to start, with the fix.
    my_exec(&mut c, "ALTER TABLE outbox DROP COLUMN status").await;
    let mut relay = Relay::start(&poll_args(&dsn, "s", "50ms", "10"));
    let code = relay.wait_exit(T).await;
    assert_eq!(code, 2, "{}", relay.stderr());
    assert!(
        relay
            .stderr()
            .contains("ADD COLUMN status ENUM('pending','published')"),
        "{}",
        relay.stderr()
    );

    // A user without UPDATE on the table: check says which GRANT is missing.
    let user = unique("pollro");
    let mut admin = my_connect(None).await;
    my_exec(
        &mut admin,
        &format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"),
    )
    .await;
    my_exec(&mut c, "ALTER TABLE outbox ADD COLUMN status ENUM('pending','published') NOT NULL DEFAULT 'pending', ADD KEY idx_dispatch (status, created_at)").await;
    my_exec(
        &mut admin,
        &format!("GRANT SELECT ON `{}`.* TO '{user}'@'%'", db.name),
    )
    .await;
    let ro = format!("mysql://{user}:pw@{MY_HOST}:{MY_PORT}/{}", db.name);
    let out = run(&["check", "--mode", "poll", "--source", &ro]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    my_exec(&mut admin, &format!("DROP USER '{user}'@'%'")).await;
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("GRANT SELECT, UPDATE ON"), "{text}");
}
