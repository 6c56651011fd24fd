//! High availability (`--ha`): relays with one name share a lease; a standby takes over when
//! the leader dies, and a leader cut off from its database stops publishing by its own clock
//! before its lease can expire — never two publishing at once; a leader paused past its lease
//! (SIGSTOP) and resumed publishes nothing more and exits 4.

mod common;

use common::proxy::FaultProxy;
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_when_the_leader_is_killed() {
    let db = PgDb::create("ha_kill").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let args = [
        "run",
        "--ha",
        "--source",
        &dsn,
        "--name",
        &name,
        "--commit-offsets",
    ];
    let mut leader = Relay::start(&args);
    wait_for("leader streaming", T, || db.slot_active(&slot)).await;
    let standby = Relay::start(&args);
    wait_standby(&standby, T).await;
    let mut client = db.client().await;
    let mut expected = write_events(&mut client, 5, 20, "ha.before").await;
    wait_lines("leader published", &leader, 100, T).await;
    assert_eq!(
        standby.line_count(),
        0,
        "the standby publishes nothing while the leader lives"
    );
    leader.sigkill();
    let killed = Instant::now();
    expected.extend(write_events(&mut client, 5, 20, "ha.after").await);
    wait_lines("the standby publishes", &standby, 1, T).await;
    let failover = killed.elapsed();
    eprintln!("failover after SIGKILL: {failover:?}");
    assert!(
        failover <= Duration::from_secs(10),
        "failover took {failover:?} (bound: 5 s + lease TTL)"
    );
    wait_all_printed(&[&leader, &standby], &expected, T).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_leader_stops_before_the_standby_starts() {
    let db = PgDb::create("ha_stall").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let proxy = FaultProxy::start("127.0.0.1:5432".parse().unwrap())
        .await
        .unwrap();
    let via = db.dsn_via(proxy.port());
    let direct = db.dsn();
    let mut leader = Relay::start(&[
        "run",
        "--ha",
        "--source",
        &via,
        "--name",
        &name,
        "--commit-offsets",
    ]);
    wait_for("leader streaming", T, || db.slot_active(&slot)).await;
    let standby = Relay::start(&[
        "run",
        "--ha",
        "--source",
        &direct,
        "--name",
        &name,
        "--commit-offsets",
    ]);
    wait_standby(&standby, T).await;
    let mut client = db.client().await;
    let mut expected = write_events(&mut client, 2, 10, "ha.before").await;
    wait_lines("leader published", &leader, 20, T).await;

    proxy.stall();
    expected.extend(write_events(&mut client, 2, 10, "ha.during").await);
    // Watch both: when the leader exits and when the standby first publishes.
    let (exited, code, first) = watch_takeover(&mut leader, &standby, T).await;
    assert_eq!(code, 4, "leadership lost: {}", leader.stderr());
    assert!(
        exited <= first,
        "the leader stopped ({exited:?}) before the standby published ({first:?})"
    );
    eprintln!(
        "stalled leader stopped after {:?}; standby published after {:?}",
        exited, first
    );
    proxy.resume();
    wait_all_printed(&[&leader, &standby], &expected, T).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_publishes_nothing_after_it_resumes_and_exits_4() {
    let db = PgDb::create("ha_pause").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let args = [
        "run",
        "--ha",
        "--source",
        &dsn,
        "--name",
        &name,
        "--commit-offsets",
    ];
    let mut leader = Relay::start(&args);
    wait_for("leader streaming", T, || db.slot_active(&slot)).await;
    let standby = Relay::start(&args);
    wait_standby(&standby, T).await;

    // A producer that keeps committing throughout: the paused leader's connection fills with
    // changes it would publish the moment it resumes, if nothing stopped it.
    let written = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (written, stop) = (written.clone(), stop.clone());
        let mut client = db.client().await;
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let ids = write_events(&mut client, 1, 2, "ha.pause").await;
                written.lock().unwrap().extend(ids);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
    };
    wait_lines("leader published", &leader, 40, T).await;
    let (printed, code) = pause_until_taken_over(&mut leader, &standby, 20, T).await;
    assert_eq!(code, 4, "leadership lost: {}", leader.stderr());
    assert_eq!(
        leader.line_count(),
        printed,
        "the resumed leader published nothing more:\n{}",
        leader.stderr()
    );
    stop.store(true, Ordering::Relaxed);
    producer.await.unwrap();
    let expected = written.lock().unwrap().clone();
    wait_all_printed(&[&leader, &standby], &expected, T).await;
}
