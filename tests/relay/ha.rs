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

on_both_sources!(
    the_standby_takes_over_when_the_leader_is_killed,
    a_stalled_leader_stops_before_the_standby_starts,
    a_paused_leader_publishes_nothing_after_it_resumes_and_exits_4,
);
