//! Fault scenarios written once and run on both sources (`<scenario>::postgres`,
//! `<scenario>::mariadb`): a relay SIGKILLed mid-stream and restarted loses nothing and
//! repeats only what was in flight; a second relay under a running one's name is refused,
//! naming the holder, and the first is unaffected; the stored position's cadence (an
//! in-process run: no signal or exit code involved). What only one source has (slots dropped
//! or created again, binlog rotation, GTID resume, memory under huge transactions) is in
//! `tests/postgres/pg_faults.rs` and `tests/mariadb/mysql_faults.rs`.

use crate::common;

use common::inproc::{InProc, Settings};
use common::source_db::{on_both_sources, Pos, SourceDb};
use common::*;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

fn args<'a>(dsn: &'a str, name: &'a str) -> [&'a str; 6] {
    ["run", "--source", dsn, "--name", name, "--commit-offsets"]
}

async fn sigkill_mid_stream_then_restart_loses_nothing<D: SourceDb>() {
    let db = D::create("kill").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = Relay::start(&args(&dsn, &name));
    db.wait_streaming(&name).await;

    let writer = db.write_in_background(200, 100, Duration::ZERO, "kill.test");
    wait_for("some events relayed", T, || {
        let n = relay.line_count();
        async move { n >= 3000 }
    })
    .await;
    // Kill only once the stored position covers a relayed event, so the restart must resume
    // mid-stream.
    let first_event = parse_lines(&relay.lines()[..1])[0]["position"]
        .as_str()
        .and_then(Pos::of_event)
        .expect("an event position");
    wait_for("the stored position to pass the first event", T, || async {
        db.stored_pos(&name)
            .await
            .is_some_and(|stored| !first_event.after(stored))
    })
    .await;
    relay.sigkill();
    let first = ids_of(&relay.lines());
    let expected = writer.await.unwrap();
    assert!(
        first.len() < expected.len(),
        "killed mid-stream ({} of {})",
        first.len(),
        expected.len()
    );

    // The restart takes the dead relay's lease at once (same host, dead pid) and resumes.
    let relay2 = Relay::start(&args(&dsn, &name));
    let seen: HashSet<Uuid> = first.iter().copied().collect();
    let missing = expected.iter().filter(|i| !seen.contains(i)).count();
    wait_for("the rest after restart", T, || {
        let got: HashSet<Uuid> = ids_of(&relay2.lines()).into_iter().collect();
        let all = expected.iter().all(|i| seen.contains(i) || got.contains(i));
        async move { all }
    })
    .await;
    let second = ids_of(&relay2.lines());
    let mut all = first.clone();
    all.extend(second.iter().copied());
    assert_none_lost(&expected, &all);
    assert!(missing > 0 && !second.is_empty());
    // Within one life nothing repeats; across the kill only what was in flight: far fewer
    // than the events relayed.
    assert_eq!(dups(&first), 0);
    assert_eq!(dups(&second), 0);
    assert!(dups(&all) < first.len(), "{} duplicates", dups(&all));
    if D::LABEL == "MariaDB" {
        assert!(
            relay2.stderr_plain().contains("by=\"gtid\""),
            "resumed by GTID: {}",
            relay2.stderr_plain()
        );
    }
}

async fn a_second_relay_with_the_same_name_is_refused<D: SourceDb>() {
    let db = D::create("dup").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut first = Relay::start(&args(&dsn, &name));
    db.wait_streaming(&name).await;
    let mut second = Relay::start(&args(&dsn, &name));
    let code = second.wait_exit(T).await;
    let err = second.stderr();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("already running") && err.contains(&format!(":{}:", first.child.id())),
        "names the holder: {err}"
    );
    // The first one is unaffected.
    let ids = db.write(1, 5, "still.running").await;
    wait_for("events through the first relay", T, || {
        let n = first.line_count();
        async move { n >= 5 }
    })
    .await;
    assert_eq!(ids_of(&first.lines()), ids);
    first.signal("TERM");
    assert_eq!(first.wait_exit(T).await, 0);
}

/// The same relay name started in its own PID namespace (as in a container that shares the
/// host name): it sees no `/proc/<pid>` of the holder, yet the holder is alive, so it must be
/// refused like any second relay instead of taking the lease (a new epoch) on that evidence.
async fn a_second_relay_in_another_pid_namespace_is_refused<D: SourceDb>() {
    let db = D::create("dupns").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut first = Relay::start(&args(&dsn, &name));
    db.wait_streaming(&name).await;
    let holder = db
        .lease_holder(&name)
        .await
        .expect("the first relay holds the lease");
    // `--kill-child`: the relay ends with `unshare` if the test kills it.
    let mut cmd = vec![
        "--pid",
        "--fork",
        "--mount-proc",
        "--kill-child",
        env!("CARGO_BIN_EXE_outboxd"),
    ];
    cmd.extend(args(&dsn, &name));
    let mut second = Relay::start_bin("unshare", &cmd, &[]);
    // Until it exits or the lease changes hands, whichever comes first.
    wait_for("the second relay to exit or take the lease", T, || {
        let exited = second.child.try_wait().unwrap().is_some();
        let db = &db;
        let (name, holder) = (&name, &holder);
        async move { exited || db.lease_holder(name).await.as_ref() != Some(holder) }
    })
    .await;
    let now = db.lease_holder(&name).await;
    assert_eq!(
        now.as_ref(),
        Some(&holder),
        "the lease was taken over from a live relay: {}",
        second.stderr()
    );
    let code = second.wait_exit(T).await;
    let err = second.stderr();
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("already running") && err.contains(&holder),
        "names the holder: {err}"
    );
    // The first one is unaffected.
    let ids = db.write(1, 5, "still.running").await;
    wait_for("events through the first relay", T, || {
        let n = first.line_count();
        async move { n >= 5 }
    })
    .await;
    assert_eq!(ids_of(&first.lines()), ids);
    first.signal("TERM");
    assert_eq!(first.wait_exit(T).await, 0);
}

on_both_sources!(
    sigkill_mid_stream_then_restart_loses_nothing,
    a_second_relay_with_the_same_name_is_refused,
    sigint_mid_stream_stops_cleanly_and_a_restart_repeats_nothing,
    the_stored_position_follows_confirms_promptly_never_backwards_and_rests_when_idle,
    a_second_relay_in_another_pid_namespace_is_refused,
);

/// The store cadence (docs/guarantees.md, "Crash loops"): under a steady producer the stored
/// position moves several times a second (each newer durable position stored at most every
/// 100 ms, not on a one-second clock), never backwards; idle, once it covers the last event,
/// it only follows what other databases write (Postgres: the keepalives' WAL end; MariaDB: other
/// transactions' checkpoints), forward.
async fn the_stored_position_follows_confirms_promptly_never_backwards_and_rests_when_idle<
    D: SourceDb,
>() {
    let db = D::create("cadence").await;
    let name = unique("r");
    let relay = InProc::start(&db.dsn(), &Settings::new(&name));
    db.wait_streaming(&name).await;
    let writer = db.write_in_background(150, 2, Duration::from_millis(20), "cadence.test");
    let mut samples = Vec::new();
    while !writer.is_finished() {
        if let Some(p) = db.stored_pos(&name).await {
            samples.push(p);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let expected = writer.await.unwrap();
    assert!(
        samples.windows(2).all(|w| w[0] <= w[1]),
        "the stored position never moves backwards: {samples:?}"
    );
    let mut distinct = samples.clone();
    distinct.dedup();
    eprintln!(
        "{} stored positions in {} samples",
        distinct.len(),
        samples.len()
    );
    // 150 transactions over at least 3 s: a one-second store clock gives about 3 values.
    assert!(
        distinct.len() >= 8,
        "{} stored positions while 150 transactions were relayed over {} samples",
        distinct.len(),
        samples.len()
    );
    relay.wait_published("every event relayed", &expected).await;
    let last = relay
        .sink
        .confirmed()
        .last()
        .and_then(|e| Pos::of_event(&e.position.to_string()))
        .expect("the last event's position");
    wait_for("the stored position to cover the last event", T, || async {
        db.stored_pos(&name)
            .await
            .is_some_and(|stored| !last.after(stored))
    })
    .await;
    let rested = db.stored_pos(&name).await;
    for _ in 0..10 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let now = db.stored_pos(&name).await;
        // Idle, the position follows what other databases write (a Postgres slot the
        // keepalives' WAL end, the binlog position other transactions' checkpoints, at most
        // every 5 s): forward only. The tests beside this one write all along.
        assert!(now >= rested, "idle: {now:?} is behind {rested:?}");
    }
    relay.stop().await;
}

/// Ctrl-C (SIGINT) is a clean stop like SIGTERM: mid-stream, under a producer, the relay
/// finishes at a transaction boundary, waits for the sink, stores its position and exits 0;
/// the restart delivers the rest and not one event twice.
async fn sigint_mid_stream_stops_cleanly_and_a_restart_repeats_nothing<D: SourceDb>() {
    let db = D::create("sigint").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = Relay::start(&args(&dsn, &name));
    db.wait_streaming(&name).await;
    let writer = db.write_in_background(400, 20, Duration::from_millis(5), "sigint.test");
    wait_for("some events relayed", T, || {
        let n = relay.line_count();
        async move { n >= 500 }
    })
    .await;
    relay.signal("INT");
    assert_eq!(
        relay.wait_exit(T).await,
        0,
        "SIGINT is a clean stop:\n{}",
        relay.stderr()
    );
    let first = ids_of(&relay.lines());
    let expected = writer.await.unwrap();
    assert!(
        first.len() < expected.len(),
        "stopped mid-stream ({} of {})",
        first.len(),
        expected.len()
    );
    let relay2 = Relay::start(&args(&dsn, &name));
    let seen: HashSet<Uuid> = first.iter().copied().collect();
    wait_for("the rest after the restart", T, || {
        let got: HashSet<Uuid> = ids_of(&relay2.lines()).into_iter().collect();
        let all = expected.iter().all(|i| seen.contains(i) || got.contains(i));
        async move { all }
    })
    .await;
    let mut all = first.clone();
    all.extend(ids_of(&relay2.lines()));
    assert_none_lost(&expected, &all);
    assert_eq!(dups(&all), 0, "a clean stop leaves nothing to repeat");
}

/// A relay whose broker does not answer stops on SIGTERM at once, with exit 0: it holds
/// nothing unconfirmed, so there is nothing to wait for (it used to back off until its whole
/// shutdown timeout ran out and exit 1). The shutdown timeout is set far above the wait here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_while_the_broker_is_unreachable_stops_at_once() {
    let db = PgDb::create("sigunr").await;
    let name = unique("r");
    let dsn = db.dsn();
    let closed = free_local_port();
    let sink = format!("amqp://guest:guest@127.0.0.1:{closed}/%2f");
    let mut relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--sink",
        &sink,
        "--shutdown-timeout",
        "120s",
    ]);
    // The fault is in place: the relay has tried the closed port twice and backs off.
    wait_for("two failed connects", T, || {
        let n = relay.stderr_plain().matches("sink unavailable").count();
        async move { n >= 2 }
    })
    .await;
    let asked = std::time::Instant::now();
    relay.signal("TERM");
    let code = relay.wait_exit(Duration::from_secs(20)).await;
    assert_eq!(code, 0, "{}", relay.stderr_plain());
    assert!(
        asked.elapsed() < Duration::from_secs(20),
        "took {:?}",
        asked.elapsed()
    );
}
