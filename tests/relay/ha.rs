//! High availability (`--ha`), one scenario per behaviour run on both sources: relays with one
//! name share a lease; a standby takes over when the leader dies (and resumes from the
//! leader's stored position), and a leader cut off from its database stops publishing by its
//! own clock before its lease can expire — never two publishing at once; a leader paused past
//! its lease (SIGSTOP) and resumed publishes nothing more and exits 4. On MariaDB nothing on
//! the server makes one binlog reader exclusive, so there the resumed old leader must stop by
//! itself; on Postgres the standby also ends the old leader's walsender.

use crate::common;

use common::proxy::FaultProxy;
use common::source_db::{on_both_sources, Pos, SourceDb};
use common::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(90);

fn ha_args<'a>(dsn: &'a str, name: &'a str) -> [&'a str; 7] {
    [
        "run",
        "--ha",
        "--source",
        dsn,
        "--name",
        name,
        "--commit-offsets",
    ]
}

/// Each printed event's place in the log (its position and index in the transaction).
fn places(relay: &Relay) -> Vec<(Pos, u64)> {
    parse_lines(&relay.lines())
        .iter()
        .map(|line| {
            let p = line["position"].as_str().unwrap();
            Pos::of_event_indexed(p).unwrap_or_else(|| panic!("not a position: {p}"))
        })
        .collect()
}

async fn the_standby_takes_over_when_the_leader_is_killed<D: SourceDb>() {
    let db = D::create("ha_kill").await;
    let name = unique("r");
    let dsn = db.dsn();
    let args = ha_args(&dsn, &name);
    let mut leader = Relay::start(&args);
    db.wait_streaming(&name).await;
    let standby = Relay::start(&args);
    wait_standby(&standby, T).await;
    let held = db.lease_holder(&name).await.unwrap();
    assert!(
        held.contains(&format!(":{}:", leader.child.id())),
        "the leader holds the lease: {held}"
    );
    let mut expected = db.write(5, 20, "ha.before").await;
    wait_lines("leader published", &leader, 100, T).await;
    assert_eq!(
        standby.line_count(),
        0,
        "the standby publishes nothing while the leader lives"
    );
    // Killed only once the leader stored a position past its first event, so where the
    // standby resumes from is seen in what it publishes.
    let first_leader = places(&leader).into_iter().min().unwrap();
    wait_for(
        "the leader to store a position past its first event",
        T,
        || async {
            db.stored_pos(&name)
                .await
                .is_some_and(|stored| !first_leader.0.after(stored))
        },
    )
    .await;
    leader.sigkill();
    let killed = Instant::now();
    expected.extend(db.write(5, 20, "ha.after").await);
    wait_lines("the standby publishes", &standby, 1, T).await;
    let failover = killed.elapsed();
    eprintln!("{}: failover after SIGKILL: {failover:?}", D::LABEL);
    assert!(
        failover <= Duration::from_secs(10),
        "failover took {failover:?} (bound: lease TTL 5 s + renewal period + start)"
    );
    wait_all_printed(&[&leader, &standby], &expected, T).await;
    let held = db.lease_holder(&name).await.unwrap();
    assert!(
        held.contains(&format!(":{}:", standby.child.id())),
        "the standby holds the lease now: {held}"
    );
    // The standby resumed from the leader's stored position, not from its own start: it
    // publishes nothing older than the leader's first event.
    assert!(places(&standby).iter().all(|p| *p > first_leader));
}

async fn a_stalled_leader_stops_before_the_standby_starts<D: SourceDb>() {
    let db = D::create("ha_stall").await;
    let name = unique("r");
    let proxy = FaultProxy::start(D::server_addr()).await.unwrap();
    let via = db.dsn_via(proxy.port());
    let direct = db.dsn();
    let mut leader = Relay::start(&ha_args(&via, &name));
    db.wait_streaming(&name).await;
    let standby = Relay::start(&ha_args(&direct, &name));
    wait_standby(&standby, T).await;
    let mut expected = db.write(2, 10, "ha.before").await;
    wait_lines("leader published", &leader, 20, T).await;

    proxy.stall();
    expected.extend(db.write(2, 10, "ha.during").await);
    // Watch both: when the leader exits and when the standby first publishes.
    let (exited, code, first) = watch_takeover(&mut leader, &standby, T).await;
    assert_eq!(code, 4, "leadership lost: {}", leader.stderr());
    assert!(
        exited <= first,
        "the leader stopped ({exited:?}) before the standby published ({first:?})"
    );
    eprintln!(
        "{}: stalled leader stopped after {exited:?}; standby published after {first:?}",
        D::LABEL
    );
    proxy.resume();
    wait_all_printed(&[&leader, &standby], &expected, T).await;
}

async fn a_paused_leader_publishes_nothing_after_it_resumes_and_exits_4<D: SourceDb>() {
    let db = D::create("ha_pause").await;
    let name = unique("r");
    let dsn = db.dsn();
    let args = ha_args(&dsn, &name);
    let mut leader = Relay::start(&args);
    db.wait_streaming(&name).await;
    let standby = Relay::start(&args);
    wait_standby(&standby, T).await;

    // A producer that keeps committing throughout: the paused leader's connection fills with
    // changes it would publish the moment it resumes, if nothing stopped it.
    let stop = Arc::new(AtomicBool::new(false));
    let producer = db.write_until(stop.clone(), 2, Duration::from_millis(10), "ha.pause");
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
    let expected = producer.await.unwrap();
    wait_all_printed(&[&leader, &standby], &expected, T).await;
}

/// Bytes the kernel still holds to send on TCP sockets connected to `127.0.0.1:port`
/// (`/proc/net/tcp`: remote port, then `tx_queue`), sockets orphaned by an exited process
/// included.
fn queued_toward(port: u16) -> u64 {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let port = format!(":{port:04X}");
    table
        .lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let (remote, queues) = (f.get(2)?, f.get(4)?);
            remote.ends_with(&port).then(|| {
                u64::from_str_radix(queues.split(':').next().unwrap_or("0"), 16).unwrap_or(0)
            })
        })
        .sum()
}

/// The paused-leader scenario with the RabbitMQ sink under broker back-pressure: the leader
/// publishes through a stalled TCP proxy, so its socket's send buffer is full and lapin holds
/// frames it has not written yet when it is paused. Its successor publishes to an exchange of
/// its own (a test device: the two relays' messages are then told apart by queue). When the
/// leader resumes, its closed gate resets the connection: nothing of it is left queued toward
/// the broker, and what still reaches the broker is only what had left the leader before the
/// pause (here: what sits in the proxy's receive buffer), measured and printed.
async fn a_paused_leader_behind_a_stalled_broker_leaves_nothing_queued<D: SourceDb>() {
    use common::amqp::{self, Topology};
    let db = D::create("ha_wire").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut old = Topology::new("xhl").await;
    let mut new = Topology::new("xhs").await;
    let proxy = FaultProxy::start(([127, 0, 0, 1], amqp::HOST_PORT).into())
        .await
        .unwrap();
    let port = free_local_port();
    let metrics = format!("127.0.0.1:{port}");
    let args = |exchange: &str, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["run", "--ha", "--source", &dsn, "--name", &name]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(["--exchange".to_string(), exchange.to_string()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let leader_args = args(&old.exchange, &["--metrics-addr", &metrics]);
    let leader_args: Vec<&str> = leader_args.iter().map(String::as_str).collect();
    let mut leader = Relay::start_with_env(
        &leader_args,
        &[("OUTBOXD_SINK", &amqp::url_via(proxy.port()))],
    );
    db.wait_streaming(&name).await;
    let standby_args = args(&new.exchange, &[]);
    let standby_args: Vec<&str> = standby_args.iter().map(String::as_str).collect();
    let standby = Relay::start_with_env(&standby_args, &[("OUTBOXD_SINK", &amqp::url())]);
    wait_standby(&standby, T).await;
    old.wait_declared(T).await;
    let from_leader = old.bind_queue("all", "#").await;

    let mut expected = db.write(2, 10, "ha.before").await;
    wait_for("the leader's first events", T, || async {
        old.queue_len(&from_leader).await >= 20
    })
    .await;

    // Back-pressure: the broker's side of the leader's connection stops reading. The leader
    // keeps handing events to lapin until its window is full; they fill the socket's buffer
    // and lapin's queue.
    proxy.stall();
    let published = || async {
        metric_value(
            &scrape_metrics(port).await,
            "outboxd_events_published_total",
        )
        .unwrap_or(0.0)
    };
    let before_stall = published().await;
    expected.extend(db.write(40, 100, "ha.stalled").await);
    wait_for(
        "the leader to hand over the events written during the stall",
        T,
        || async { published().await >= before_stall + 4000.0 },
    )
    .await;
    let handed = published().await - before_stall;
    let reached_before_pause = old.queue_len(&from_leader).await;
    let queued_at_pause = queued_toward(proxy.port());
    eprintln!(
        "{}: {queued_at_pause} bytes queued in the leader's socket toward the stalled broker at the pause",
        D::LABEL
    );
    assert!(
        queued_at_pause > 0,
        "the leader's socket was under back-pressure"
    );

    leader.signal("STOP");
    new.wait_declared(T).await;
    let from_successor = new.bind_queue("all", "#").await;
    expected.extend(db.write(2, 10, "ha.after").await);
    wait_for("the successor to publish", T, || async {
        new.queue_len(&from_successor).await > 0
    })
    .await;
    leader.signal("CONT");
    let code = leader.wait_exit(T).await;
    // On MariaDB the successor's binlog connection (same server id) may end the resumed
    // leader's first: then the source's error stops it (exit 1) before its lease keeper does.
    let kicked = code == 1 && leader.stderr().contains("same server_uuid/server_id");
    assert!(
        code == 4 || kicked,
        "leadership lost, exit {code}: {}",
        leader.stderr()
    );
    // Still stalled: whatever the kernel holds for the broker now would reach it later.
    let left = queued_toward(proxy.port());
    assert_eq!(
        left,
        0,
        "the resumed leader left {left} bytes queued toward the broker (at the pause: {queued_at_pause}):\n{}",
        leader.stderr()
    );

    // What had already left the leader (the proxy's receive buffer) reaches the broker now.
    proxy.resume();
    wait_for("the leader's proxied connection to end", T, || {
        let open = proxy.open_connections();
        async move { open == 0 }
    })
    .await;
    // The broker takes a moment to route what it read last: wait until the count holds still.
    let deadline = Instant::now() + T;
    let mut last = old.queue_len(&from_leader).await;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = old.queue_len(&from_leader).await;
        if now == last {
            break;
        }
        assert!(Instant::now() < deadline, "the leader's queue settles");
        last = now;
    }
    eprintln!(
        "{}: {} messages of the old leader reached the broker after its successor published ({} had before the pause; it handed over {} during the stall)",
        D::LABEL,
        last - reached_before_pause,
        reached_before_pause,
        handed,
    );

    // The successor declares its exchange when it takes over and may publish before the
    // test's queue is bound: those messages are kept in its `.unrouted` queue.
    let unrouted = new.unrouted();
    wait_for("the successor to deliver every event", T, || async {
        let n = new.queue_len(&from_successor).await + new.queue_len(&unrouted).await;
        n as usize + 20 >= expected.len()
    })
    .await;
    let mut got = std::collections::HashSet::new();
    for (topo, queue) in [
        (&new, &from_successor),
        (&new, &unrouted),
        (&old, &from_leader),
    ] {
        got.extend(topo.take_all(queue).await.iter().map(amqp::message_id));
    }
    let lost = expected.iter().filter(|i| !got.contains(i)).count();
    assert_eq!(lost, 0, "every event reached one of the two queues");
}

/// The same with the NATS sink: the leader publishes through a stalled proxy into a stream of
/// its own, its successor directly into another (a test device, to tell their messages apart).
async fn a_paused_nats_leader_behind_a_stalled_server_leaves_nothing_queued<D: SourceDb>() {
    use common::nats::{self, TestStream};
    let db = D::create("ha_wirn").await;
    let name = unique("r");
    let dsn = db.dsn();
    let old = TestStream::new("hnl").await;
    let new = TestStream::new("hns").await;
    let proxy = FaultProxy::start(([127, 0, 0, 1], nats::PORT).into())
        .await
        .unwrap();
    let port = free_local_port();
    let metrics = format!("127.0.0.1:{port}");
    let args = |s: &TestStream, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["run", "--ha", "--source", &dsn, "--name", &name]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend(s.args());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let leader_args = args(&old, &["--metrics-addr", &metrics]);
    let leader_args: Vec<&str> = leader_args.iter().map(String::as_str).collect();
    let mut leader = Relay::start_with_env(
        &leader_args,
        &[("OUTBOXD_SINK", &nats::url_via(proxy.port()))],
    );
    db.wait_streaming(&name).await;
    let standby_args = args(&new, &[]);
    let standby_args: Vec<&str> = standby_args.iter().map(String::as_str).collect();
    let standby = Relay::start_with_env(&standby_args, &[("OUTBOXD_SINK", &nats::url())]);
    wait_standby(&standby, T).await;

    let mut expected = db.write(2, 10, "ha.before").await;
    wait_for("the leader's first events", T, || async {
        old.len().await >= 20
    })
    .await;

    proxy.stall();
    let published = || async {
        metric_value(
            &scrape_metrics(port).await,
            "outboxd_events_published_total",
        )
        .unwrap_or(0.0)
    };
    let before_stall = published().await;
    expected.extend(db.write(40, 100, "ha.stalled").await);
    // The client's queue is bounded: the relay hands over what fits, then waits in the
    // hand-over.
    wait_for("the leader's socket to fill", T, || async {
        queued_toward(proxy.port()) > 0 && published().await >= before_stall + 1000.0
    })
    .await;
    let handed = published().await - before_stall;
    let reached_before_pause = old.len().await;
    let queued_at_pause = queued_toward(proxy.port());
    eprintln!(
        "{}: NATS: {queued_at_pause} bytes queued in the leader's socket toward the stalled server at the pause; {handed} events handed over during the stall",
        D::LABEL
    );

    leader.signal("STOP");
    expected.extend(db.write(2, 10, "ha.after").await);
    wait_for("the successor to publish", T, || async {
        new.len().await > 0
    })
    .await;
    leader.signal("CONT");
    let code = leader.wait_exit(T).await;
    let kicked = code == 1 && leader.stderr().contains("same server_uuid/server_id");
    assert!(
        code == 4 || kicked,
        "leadership lost, exit {code}: {}",
        leader.stderr()
    );
    let left = queued_toward(proxy.port());
    assert_eq!(
        left,
        0,
        "the resumed leader left {left} bytes queued toward the server (at the pause: {queued_at_pause}):\n{}",
        leader.stderr()
    );

    proxy.resume();
    wait_for("the leader's proxied connection to end", T, || {
        let open = proxy.open_connections();
        async move { open == 0 }
    })
    .await;
    // The server takes a moment to store what it read last: wait until the count holds still.
    let deadline = Instant::now() + T;
    let mut last = old.len().await;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let now = old.len().await;
        if now == last {
            break;
        }
        assert!(Instant::now() < deadline, "the leader's stream settles");
        last = now;
    }
    eprintln!(
        "{}: NATS: {} messages of the old leader were stored after its successor published ({} before the pause)",
        D::LABEL,
        last - reached_before_pause,
        reached_before_pause,
    );
    wait_for("the successor to store every event", T, || async {
        new.len().await as usize + 20 >= expected.len()
    })
    .await;
    let mut got = std::collections::HashSet::new();
    got.extend(old.id_counts().await.0);
    got.extend(new.id_counts().await.0);
    let lost = expected.iter().filter(|i| !got.contains(i)).count();
    assert_eq!(lost, 0, "every event reached one of the two streams");
}

/// The case the reset cannot cover, measured: the broker drains the paused leader's socket
/// *during* the pause (its alarm clears), so the kernel sends what was queued while the process
/// is stopped; printed. After the resume the leader must write nothing more (bytes the proxy
/// forwarded from it after SIGCONT): lapin's thread races the gate's reset there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_leader_whose_broker_drains_during_the_pause_writes_nothing_after_it_resumes() {
    use common::amqp::{self, Topology};
    let db = PgDb::create("ha_drain").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut old = Topology::new("xhd").await;
    let new = Topology::new("xhe").await;
    let proxy = FaultProxy::start(([127, 0, 0, 1], amqp::HOST_PORT).into())
        .await
        .unwrap();
    let port = free_local_port();
    let metrics = format!("127.0.0.1:{port}");
    let common_args = ["run", "--ha", "--source", &dsn, "--name", &name];
    let mut leader_args = common_args.to_vec();
    leader_args.extend(["--exchange", &old.exchange, "--metrics-addr", &metrics]);
    let mut leader = Relay::start_with_env(
        &leader_args,
        &[("OUTBOXD_SINK", &amqp::url_via(proxy.port()))],
    );
    db.wait_streaming(&name).await;
    let mut standby_args = common_args.to_vec();
    standby_args.extend(["--exchange", &new.exchange]);
    let standby = Relay::start_with_env(&standby_args, &[("OUTBOXD_SINK", &amqp::url())]);
    wait_standby(&standby, T).await;
    old.wait_declared(T).await;
    let from_leader = old.bind_queue("all", "#").await;
    db.write(2, 10, "ha.before").await;
    wait_for("the leader's first events", T, || async {
        old.queue_len(&from_leader).await >= 20
    })
    .await;

    proxy.stall();
    let published = || async {
        metric_value(
            &scrape_metrics(port).await,
            "outboxd_events_published_total",
        )
        .unwrap_or(0.0)
    };
    let before_stall = published().await;
    db.write(40, 100, "ha.stalled").await;
    wait_for("the leader to hand over the stalled events", T, || async {
        published().await >= before_stall + 4000.0
    })
    .await;
    let queued_at_pause = queued_toward(proxy.port());
    let (up_at_pause, _) = proxy.bytes();

    leader.signal("STOP");
    db.write(2, 10, "ha.after").await;
    wait_for("the successor to publish", T, || async {
        new.queue_len(&new.unrouted()).await > 0
    })
    .await;
    // The broker drains the stopped leader's socket: the kernel sends its queue meanwhile.
    proxy.resume();
    wait_for("the stopped leader's socket to drain", T, || {
        let q = queued_toward(proxy.port());
        async move { q == 0 }
    })
    .await;
    let deadline = Instant::now() + T;
    let mut up_stopped = proxy.bytes().0;
    loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = proxy.bytes().0;
        if now == up_stopped {
            break;
        }
        assert!(Instant::now() < deadline, "the proxy's forwarding settles");
        up_stopped = now;
    }
    leader.signal("CONT");
    let code = leader.wait_exit(T).await;
    assert_eq!(code, 4, "leadership lost: {}", leader.stderr());
    wait_for("the leader's proxied connection to end", T, || {
        let open = proxy.open_connections();
        async move { open == 0 }
    })
    .await;
    let after_resume = proxy.bytes().0 - up_stopped;
    let sent_while_stopped = up_stopped - up_at_pause;
    eprintln!(
        "drained during the pause: {sent_while_stopped} bytes sent while stopped ({queued_at_pause} were queued in the socket at the pause); {after_resume} bytes written after the resume"
    );
    assert_eq!(
        after_resume,
        0,
        "the resumed leader wrote {after_resume} bytes after it resumed:\n{}",
        leader.stderr()
    );
}

on_both_sources!(
    a_paused_nats_leader_behind_a_stalled_server_leaves_nothing_queued,
    the_standby_takes_over_when_the_leader_is_killed,
    a_stalled_leader_stops_before_the_standby_starts,
    a_paused_leader_publishes_nothing_after_it_resumes_and_exits_4,
    a_paused_leader_behind_a_stalled_broker_leaves_nothing_queued,
);
