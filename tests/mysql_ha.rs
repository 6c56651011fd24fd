//! MariaDB relays: high availability (`--ha`: a standby takes over when the leader is killed;
//! a leader cut off from the database stops publishing before the standby starts) and the
//! position kept in a file (`--offset-file`: resume without duplicates, a corrupt file is a
//! configuration error with the fix, a second relay on the same file is refused).

mod common;

use common::proxy::FaultProxy;
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(90);

/// `file:end_pos:index` of an event line, ordered like the binlog.
fn position(line: &serde_json::Value) -> (u64, u64, u64) {
    let p = line["position"].as_str().unwrap();
    let mut parts = p.rsplitn(3, ':');
    let index = parts.next().unwrap().parse().unwrap();
    let pos = parts.next().unwrap().parse().unwrap();
    let seq = parts
        .next()
        .unwrap()
        .rsplit('.')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    (seq, pos, index)
}

fn positions(relay: &Relay) -> Vec<(u64, u64, u64)> {
    parse_lines(&relay.lines()).iter().map(position).collect()
}

async fn holder(db: &MyDb, name: &str) -> Option<String> {
    let mut c = db.conn().await;
    my_value(
        &mut c,
        &format!("SELECT lease_holder FROM outboxd_state WHERE name = '{name}'"),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standby_takes_over_when_the_leader_is_killed() {
    let db = MyDb::create("my_ha_kill").await;
    let name = unique("r");
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
    wait_for("leader streaming", T, || db.streaming()).await;
    let standby = Relay::start(&args);
    wait_standby(&standby, T).await;
    let leader_pid = leader.child.id();
    let held = holder(&db, &name).await.unwrap();
    assert!(
        held.contains(&format!(":{leader_pid}:")),
        "the leader holds the lease: {held}"
    );
    let mut c = db.conn().await;
    let mut expected = my_write_events(&mut c, 5, 20, "ha.before").await;
    wait_lines("leader published", &leader, 100, T).await;
    assert_eq!(
        standby.line_count(),
        0,
        "the standby publishes nothing while the leader lives"
    );
    leader.sigkill();
    let killed = Instant::now();
    expected.extend(my_write_events(&mut c, 5, 20, "ha.after").await);
    wait_lines("the standby publishes", &standby, 1, T).await;
    let failover = killed.elapsed();
    eprintln!("MariaDB failover after SIGKILL: {failover:?}");
    assert!(
        failover <= Duration::from_secs(10),
        "failover took {failover:?} (bound: lease TTL 5 s + renewal period + start)"
    );
    wait_all_printed(&[&leader, &standby], &expected, T).await;
    let held = holder(&db, &name).await.unwrap();
    assert!(
        held.contains(&format!(":{}:", standby.child.id())),
        "the standby holds the lease now: {held}"
    );
    // The standby resumed from the leader's stored position, not from its own start: it
    // publishes nothing older than the leader's first event.
    let first_leader = positions(&leader).into_iter().min().unwrap();
    assert!(positions(&standby).iter().all(|p| *p > first_leader));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_leader_stops_before_the_standby_starts() {
    let db = MyDb::create("my_ha_stall").await;
    let name = unique("r");
    let proxy = FaultProxy::start(format!("{MY_HOST}:{MY_PORT}").parse().unwrap())
        .await
        .unwrap();
    let via = db.dsn_via(proxy.port());
    let direct = db.dsn();
    let run = |dsn: &str| {
        Relay::start(&[
            "run",
            "--ha",
            "--source",
            dsn,
            "--name",
            &name,
            "--commit-offsets",
        ])
    };
    let mut leader = run(&via);
    wait_for("leader streaming", T, || db.streaming()).await;
    let standby = run(&direct);
    wait_standby(&standby, T).await;
    let mut c = db.conn().await;
    let mut expected = my_write_events(&mut c, 2, 10, "ha.before").await;
    wait_lines("leader published", &leader, 20, T).await;

    proxy.stall();
    expected.extend(my_write_events(&mut c, 2, 10, "ha.during").await);
    let (exited, code, first) = watch_takeover(&mut leader, &standby, T).await;
    assert_eq!(code, 4, "leadership lost: {}", leader.stderr());
    assert!(
        exited <= first,
        "the leader stopped ({exited:?}) before the standby published ({first:?})"
    );
    eprintln!(
        "MariaDB: stalled leader stopped after {:?}; standby published after {:?}",
        exited, first
    );
    proxy.resume();
    wait_all_printed(&[&leader, &standby], &expected, T).await;
}

/// Nothing on the server makes one binlog reader exclusive: the resumed old leader must stop
/// by itself, before it publishes anything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_publishes_nothing_after_it_resumes_and_exits_4() {
    let db = MyDb::create("my_ha_pause").await;
    let name = unique("r");
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
    wait_for("leader streaming", T, || db.streaming()).await;
    let standby = Relay::start(&args);
    wait_standby(&standby, T).await;

    // A producer that keeps committing throughout: the paused leader's binlog connection
    // fills with transactions it would publish the moment it resumes, if nothing stopped it.
    let written = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let producer = {
        let (written, stop) = (written.clone(), stop.clone());
        let mut c = db.conn().await;
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let ids = my_write_events(&mut c, 1, 2, "ha.pause").await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_offset_file_resumes_without_duplicates_and_refuses_a_second_relay() {
    let db = MyDb::create("my_offfile").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.offset");
    let file_s = file.to_str().unwrap().to_string();
    let name = unique("r");
    let dsn = db.dsn();
    let args = [
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--commit-offsets",
        "--offset-file",
        &file_s,
    ];
    let mut first = Relay::start(&args);
    wait_for("streaming", T, || db.streaming()).await;

    // A second relay on the same file is refused while the first runs.
    let mut second = Relay::start(&args);
    assert_eq!(second.wait_exit(T).await, 1, "{}", second.stderr());
    assert!(
        second.stderr().contains("is in use by another relay"),
        "{}",
        second.stderr()
    );

    let mut c = db.conn().await;
    let before = my_write_events(&mut c, 10, 10, "file.before").await;
    wait_lines("first batch", &first, 100, T).await;
    let head = my_head().await;
    first.signal("TERM");
    assert_eq!(first.wait_exit(T).await, 0, "{}", first.stderr());
    let stored: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let at = (
        stored["binlog_file"].as_str().unwrap().to_string(),
        stored["binlog_pos"].as_u64().unwrap(),
    );
    assert!(
        binlog_ge(&at, &head),
        "the file holds the final position {at:?} (head after the batch: {head:?})"
    );
    assert_eq!(stored["initialized"], true);
    assert_eq!(
        db.stored(&name).await,
        None,
        "nothing was written to outboxd_state"
    );

    let after = my_write_events(&mut c, 10, 10, "file.after").await;
    let second = Relay::start(&args);
    wait_lines("second batch", &second, 100, T).await;
    let got = printed_ids(&second);
    let before: std::collections::HashSet<uuid::Uuid> = before.into_iter().collect();
    assert!(
        got.iter().all(|i| !before.contains(i)),
        "the restart published nothing twice"
    );
    assert_eq!(got, after, "every later event once, in commit order");
    drop(second);

    // A corrupt file: a configuration error naming the fix, nothing published.
    std::fs::write(&file, b"{\"version\": 1, \"name\": ").unwrap();
    let mut bad = Relay::start(&args);
    assert_eq!(bad.wait_exit(T).await, 2, "{}", bad.stderr());
    let err = bad.stderr();
    assert!(err.contains("is not an outboxd offset file"), "{err}");
    assert!(
        err.contains("offset set --offset-file"),
        "the fix is named: {err}"
    );
    assert_eq!(bad.line_count(), 0);

    // The fix works: the position set by hand is where the next start resumes.
    let mark = my_head().await;
    let set = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "offset",
            "set",
            "--source",
            &dsn,
            "--name",
            &name,
            "--offset-file",
            &file_s,
            "--binlog-position",
            &format!("{}:{}", mark.0, mark.1),
        ])
        .output()
        .unwrap();
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let last = my_write_events(&mut c, 1, 5, "file.last").await;
    let third = Relay::start(&args);
    wait_lines("third batch", &third, 5, T).await;
    assert_eq!(printed_ids(&third), last);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offset_file_is_refused_for_postgres() {
    let mut r = Relay::start(&[
        "run",
        "--source",
        "postgres://postgres@127.0.0.1:5432/test",
        "--offset-file",
        "/tmp/outboxd-never.offset",
    ]);
    assert_eq!(r.wait_exit(T).await, 2, "{}", r.stderr());
    assert!(r.stderr().contains("replication slot"), "{}", r.stderr());
}
