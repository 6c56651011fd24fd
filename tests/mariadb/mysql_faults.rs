//! Faults on the MariaDB → stdout path that need no server restart: a cut or stalled
//! connection (through the TCP fault proxy), `FLUSH BINARY LOGS` and `KILL` of the dump thread
//! mid-stream, GTID and file/position resume, memory flat under a huge transaction on another
//! table, an outbox transaction larger than the relay's buffer, and a relay whose lease was
//! taken over. SIGKILL mid-stream and a second relay with the same name run on both sources
//! from `tests/relay/faults.rs`; server restarts, purged binlogs and the idle-outbox test
//! (which needs a binlog no other test writes to) live in `tests/disruptive/mysql_restart.rs`.

use crate::common;

use common::proxy::FaultProxy;
use common::*;
use mysql_async::prelude::Queryable;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

async fn all_arrived(relay: &Relay, expected: &[Uuid]) -> bool {
    let got: HashSet<Uuid> = ids_of(&relay.lines()).into_iter().collect();
    expected.iter().all(|i| got.contains(i))
}

fn args<'a>(dsn: &'a str, name: &'a str) -> Vec<&'a str> {
    vec!["run", "--source", dsn, "--name", name, "--commit-offsets"]
}

async fn start_streaming(db: &MyDb, args: &[&str]) -> Relay {
    let mut relay = Relay::start(args);
    relay
        .wait_running("the relay's binlog dump to be connected", T, || {
            db.streaming()
        })
        .await;
    relay
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cut_and_stalled_connections_lose_nothing() {
    let db = MyDb::create("my_proxy").await;
    let name = unique("r");
    let proxy = FaultProxy::start(format!("{MY_HOST}:{MY_PORT}").parse().unwrap())
        .await
        .unwrap();
    let dsn = db.dsn_via(proxy.port());
    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;
    let mut c = db.conn().await;

    let mut expected = my_write_events(&mut c, 20, 100, "before.cut").await;
    wait_for("first batch", T, || {
        let n = relay.line_count();
        async move { n >= 1000 }
    })
    .await;
    // Cut every connection while more events are written: the relay reconnects and resumes.
    proxy.cut();
    expected.extend(my_write_events(&mut c, 20, 100, "during.cut").await);
    proxy.cut();
    expected.extend(my_write_events(&mut c, 20, 100, "after.cut").await);
    wait_for("everything after the cuts", T, || {
        all_arrived(&relay, &expected)
    })
    .await;
    // The relay itself saw the cuts and resumed (its log, not only the proxy's count).
    let reconnects = relay.stderr().matches("binlog stream broke").count();
    assert!(
        reconnects >= 2 && proxy.accepted() > 3,
        "the relay reconnected after each cut: {reconnects} reconnects logged, {} connections",
        proxy.accepted()
    );

    // Stall shorter than the read timeout: nothing of it reaches the relay before the resume
    // (checked at once, no waiting: the proxy holds every byte), and after it everything
    // arrives. The long stall below proves the relay's own reaction (a reconnect).
    proxy.stall();
    let stalled = my_write_events(&mut c, 10, 100, "during.stall").await;
    let got: HashSet<Uuid> = ids_of(&relay.lines()).into_iter().collect();
    assert!(
        stalled.iter().all(|i| !got.contains(i)),
        "nothing written during the stall reached the relay before the resume"
    );
    proxy.resume();
    expected.extend(stalled);
    wait_for("everything after the stall", T, || {
        all_arrived(&relay, &expected)
    })
    .await;

    // A stall longer than the read timeout: the relay gives the connection up and reconnects
    // (through the proxy again) once the network is back.
    const GAVE_UP: &str = "no binlog event and no heartbeat in time: reconnecting";
    let accepted = proxy.accepted();
    let gave_up = relay.stderr().matches(GAVE_UP).count();
    proxy.stall();
    let long_stall = my_write_events(&mut c, 5, 100, "during.long.stall").await;
    wait_for(
        "the relay to notice the dead connection (its read timeout) and try again",
        T,
        || {
            let n = proxy.accepted();
            let logged = relay.stderr().matches(GAVE_UP).count();
            async move { n > accepted && logged > gave_up }
        },
    )
    .await;
    proxy.resume();
    expected.extend(long_stall);
    wait_for("everything after the long stall", T, || {
        all_arrived(&relay, &expected)
    })
    .await;
    let got = ids_of(&relay.lines());
    assert_none_lost(&expected, &got);
    assert_eq!(
        dups(&got),
        0,
        "a reconnect resumes at the last transaction boundary"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_binary_logs_and_kill_of_the_dump_thread_lose_nothing() {
    let db = MyDb::create("my_rotate").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;
    let (file0, _) = my_head().await;

    let writer = {
        let mut c = db.conn().await;
        tokio::spawn(async move { my_write_events(&mut c, 300, 20, "rotate.test").await })
    };
    let mut admin = my_connect(None).await;
    let mut kills = 0;
    for round in 0..3 {
        wait_for("progress", T, || {
            let n = relay.line_count();
            async move { n >= 1000 * (round + 1) }
        })
        .await;
        my_exec(&mut admin, "FLUSH BINARY LOGS").await;
        if let Some(id) = db.dump_thread().await {
            my_exec(&mut admin, &format!("KILL {id}")).await;
            kills += 1;
        }
    }
    let expected = writer.await.unwrap();
    wait_for("every event", T, || all_arrived(&relay, &expected)).await;
    let got = ids_of(&relay.lines());
    assert_eq!(got, expected, "in commit order, exactly once");
    assert!(kills >= 2, "the dump thread was killed mid-stream");
    let (file1, _) = my_head().await;
    assert_ne!(file0, file1, "the binlog rotated");
    // The stored position follows into the new files.
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let (stored_file, _, _) = db.stored(&name).await.unwrap();
    assert_ne!(stored_file, file0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_by_gtid_and_by_file_position() {
    let db = MyDb::create("my_resume").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut c = db.conn().await;

    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;
    let first = my_write_events(&mut c, 3, 10, "first").await;
    wait_for("first events", T, || all_arrived(&relay, &first)).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let (_, _, gtid) = db.stored(&name).await.unwrap();
    assert!(
        gtid.as_deref().is_some_and(|g| g.starts_with("0-1-")),
        "{gtid:?}"
    );

    // Written while the relay is down: arrive after a GTID resume, nothing else does.
    let second = my_write_events(&mut c, 3, 10, "second").await;
    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;
    wait_for("second events", T, || all_arrived(&relay, &second)).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    assert_eq!(ids_of(&relay.lines()), second);
    assert!(
        relay.stderr_plain().contains("by=\"gtid\""),
        "{}",
        relay.stderr_plain()
    );

    // A stored position without GTID state (as `offset set` by position leaves it): resumed
    // by file and position, with the same result.
    c.exec_drop(
        "UPDATE outboxd_state SET gtid_state = NULL WHERE name = ?",
        (&name,),
    )
    .await
    .unwrap();
    let third = my_write_events(&mut c, 3, 10, "third").await;
    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;
    wait_for("third events", T, || all_arrived(&relay, &third)).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    assert_eq!(ids_of(&relay.lines()), third);
    assert!(
        relay.stderr_plain().contains("by=\"position\""),
        "{}",
        relay.stderr_plain()
    );
    let (_, _, gtid) = db.stored(&name).await.unwrap();
    assert!(
        gtid.is_some_and(|g| !g.is_empty()),
        "the GTID state is tracked again"
    );
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_100k_row_transaction_on_another_table_keeps_memory_flat() {
    let db = MyDb::create("my_big").await;
    let name = unique("r");
    let dsn = db.dsn();
    let relay = start_streaming(&db, &args(&dsn, &name)).await;
    let pid = relay.child.id();
    let mut c = db.conn().await;
    my_exec(
        &mut c,
        "CREATE TABLE big (id BIGINT PRIMARY KEY, v VARCHAR(300))",
    )
    .await;
    // Warm up: one outbox event through the whole path.
    let warm = my_write_events(&mut c, 1, 1, "warm").await;
    wait_for("warm-up event", T, || all_arrived(&relay, &warm)).await;
    let base = rss_kib(pid);

    let sampler = {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let s = stop.clone();
        let handle = tokio::spawn(async move {
            let mut peak = 0;
            while !s.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_kib(pid));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            peak
        });
        (stop, handle)
    };
    my_exec(
        &mut c,
        "INSERT INTO big (id, v) SELECT seq, REPEAT('y', 250) FROM seq_1_to_100000",
    )
    .await;
    let after = my_write_events(&mut c, 1, 1, "after.big").await;
    let head = db.head_past_writes().await;
    wait_for("the event after the big transaction", T, || {
        all_arrived(&relay, &after)
    })
    .await;
    wait_for(
        "the stored position past the big transaction",
        T,
        || async {
            db.stored(&name)
                .await
                .is_some_and(|(f, p, _)| binlog_ge(&(f, p), &head))
        },
    )
    .await;
    sampler.0.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.1.await.unwrap();
    let grown = peak.saturating_sub(base);
    eprintln!("relay RSS: {base} KiB before, {peak} KiB peak during a ~26 MB transaction on another table");
    assert!(
        grown < 16 * 1024,
        "RSS grew by {grown} KiB (base {base}, peak {peak})"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_transaction_larger_than_the_buffer_arrives_once_in_order() {
    let db = MyDb::create("my_large_tx").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut a = args(&dsn, &name);
    a.extend_from_slice(&["--txn-buffer", "100000"]);
    let mut relay = start_streaming(&db, &a).await;
    let mut c = db.conn().await;
    let small = my_write_events(&mut c, 1, 3, "small").await;
    let large = my_write_events(&mut c, 1, 2000, "large").await;
    let tail = my_write_events(&mut c, 1, 3, "tail").await;
    let mut expected = small.clone();
    expected.extend(large.iter().copied());
    expected.extend(tail.iter().copied());
    wait_for("every event", T, || all_arrived(&relay, &expected)).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let raw = relay.lines();
    assert_eq!(ids_of(&raw), expected, "exactly once, in order");
    assert!(
        relay.stderr().contains("larger than the buffer"),
        "{}",
        relay.stderr()
    );
    // Every event of the large transaction carries its end position.
    let lines = parse_lines(&raw);
    let ends: HashSet<&str> = lines[3..2003]
        .iter()
        .map(|l| l["position"].as_str().unwrap().rsplit_once(':').unwrap().0)
        .collect();
    assert_eq!(ends.len(), 1, "one transaction, one end position: {ends:?}");
    assert!(!ends.iter().next().unwrap().ends_with(":0000000000"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_whose_lease_was_taken_over_stops_with_exit_4() {
    let db = MyDb::create("my_lease").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;
    wait_for("the first start to store its position", T, || async {
        db.stored(&name).await.is_some()
    })
    .await;
    // Another relay's takeover, as `acquire` does it: a new epoch and holder.
    let mut c = db.conn().await;
    c.exec_drop(
        "UPDATE outboxd_state SET epoch = epoch + 1, lease_holder = 'elsewhere:1:x' WHERE name = ?",
        (&name,),
    )
    .await
    .unwrap();
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 4, "exit 4 = leadership lost: {err}");
    assert!(err.contains("lease of relay"), "{err}");
}

/// Another binlog client with the relay's server id — what a second relay of the same name is
/// once it holds the lease — makes the server end the relay's binlog stream (MariaDB error
/// 4052). That is leadership lost, exit 4 with what happened, not a failure (exit 1) that
/// sends a supervisor looking for a bug: restarted, the relay waits for the lease like any
/// standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_binlog_client_with_the_relays_server_id_ends_it_as_leadership_lost() {
    let db = MyDb::create("sameid").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name]);
    common::source_db::SourceDb::wait_streaming(&db, &name).await;
    let id = outboxd::source::mysql::server_id_for(&name);
    let other = my_connect(None).await;
    let stream = other
        .get_binlog_stream(mysql_async::BinlogStreamRequest::new(id))
        .await
        .expect("a binlog stream with the relay's server id");
    let code = relay.wait_exit(T).await;
    drop(stream);
    let err = relay.stderr_plain();
    assert_eq!(code, 4, "{err}");
    assert!(
        err.contains("another relay of the same name holds the lease now")
            && err.contains("error 4052"),
        "{err}"
    );
}
