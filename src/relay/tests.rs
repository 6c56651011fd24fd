//! The relay's in-process tests: the window, ordered acknowledgements, republish after a
//! failure, self-fencing and the never-backwards rule against `MemorySink` and `MemoryStore`
//! on tokio's paused clock, in milliseconds.

use super::*;
use crate::event::SourcePosition;
use crate::sink::memory::{MemoryHandle, MemorySink};
use crate::source::Budget;
use crate::telemetry;

fn event(n: u32) -> OutboxEvent {
    let mut e = crate::sink::test_event();
    e.id = uuid::Uuid::now_v7();
    e.position = SourcePosition::Pg {
        commit_lsn: 0x1000 + n as u64,
        index: 0,
    };
    e.topic = format!("t.{n}");
    e
}

struct Harness {
    tx: mpsc::Sender<SourceMsg>,
    acks: watch::Receiver<Option<Checkpoint>>,
    handle: MemoryHandle,
    budget: Budget,
    relay: tokio::task::JoinHandle<Result<(), crate::Error>>,
}

fn start(opts: RelayOptions) -> Harness {
    let (sink, handle) = MemorySink::new();
    let (tx, rx) = mpsc::channel(1024);
    let (ack_tx, acks) = watch::channel(None);
    let relay = tokio::spawn(async move {
        let mut sink = sink;
        run(&mut sink, rx, ack_tx, &opts, &RelayStats::default()).await
    });
    Harness {
        tx,
        acks,
        handle,
        budget: Budget::new(1 << 20),
        relay,
    }
}

impl Harness {
    /// One event and the checkpoint after it (a one-event transaction).
    async fn send(&self, e: &OutboxEvent) {
        let permit = self.budget.acquire(e.size()).await;
        let commit_lsn = match e.position {
            SourcePosition::Pg { commit_lsn, .. } => commit_lsn,
            _ => unreachable!(),
        };
        self.tx
            .send(SourceMsg::Event(Box::new(e.clone()), permit))
            .await
            .unwrap();
        self.tx
            .send(SourceMsg::Checkpoint(Checkpoint::Lsn(commit_lsn)))
            .await
            .unwrap();
    }

    async fn wait_acked(&mut self, lsn: u64) {
        tokio::time::timeout(
            Duration::from_secs(20),
            self.acks
                .wait_for(|a| matches!(a, Some(Checkpoint::Lsn(l)) if *l >= lsn)),
        )
        .await
        .unwrap_or_else(|_| panic!("checkpoint {lsn:X} acknowledged"))
        .unwrap();
    }
}

async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

// In-process tests under paused time: the tokio clock stands still while any task can run
// and jumps to the next timer once all of them wait, so seconds of relay and lease time
// take milliseconds, and "nothing happened for 5 s" is an exact statement about 5 s of the
// relay's time.

#[tokio::test(start_paused = true)]
async fn a_refused_event_is_retried_at_the_backoffs_pace_then_delivered_in_order() {
    // 1 ms doubling to 20 ms stands for 100 ms doubling to 30 s.
    let cap = Duration::from_millis(20);
    let mut h = start(RelayOptions {
        retry_backoff: (Duration::from_millis(1), cap),
        ..RelayOptions::default()
    });
    let events: Vec<OutboxEvent> = (0..10).map(event).collect();
    let refused = events[2].id;
    h.handle
        .refuse_when(move |e| (e.id == refused).then(|| "no route".to_string()));
    for e in &events {
        h.send(e).await;
    }
    wait_until("the first refusal", || h.handle.refusals() >= 1).await;
    let (c0, r0) = (h.handle.connects(), h.handle.refusals());
    let window = Duration::from_millis(600);
    tokio::time::sleep(window).await;
    let (c1, r1) = (h.handle.connects(), h.handle.refusals());
    // The ramp (1+2+4+8+16 ms) and then one attempt per 10–20 ms: at most ~65 in 600 ms.
    // A fresh backoff per recovery reconnects as fast as the loop turns (thousands).
    let attempts = c1 - c0;
    assert!(
        (10..=70).contains(&attempts),
        "{attempts} reconnects in {window:?} with a {cap:?} cap"
    );
    // Only the refused event is sent again on each attempt, not the window behind it.
    assert_eq!(r1 - r0, attempts, "one refusal per attempt");
    assert_eq!(
        h.handle.confirmed_ids(),
        vec![events[0].id, events[1].id],
        "nothing after the refused event is delivered while it is refused"
    );

    h.handle.accept_all();
    h.wait_acked(0x1000 + 9).await;
    let want: Vec<_> = events.iter().map(|e| e.id).collect();
    assert_eq!(h.handle.confirmed_ids(), want, "every event once, in order");

    // The confirmation reset the pacing: a new refusal starts again at the first step.
    let later = event(10);
    let refused = later.id;
    h.handle
        .refuse_when(move |e| (e.id == refused).then(|| "no route".to_string()));
    let r_before = h.handle.refusals();
    h.send(&later).await;
    let started = Instant::now();
    wait_until("three quick refusals", || {
        h.handle.refusals() >= r_before + 3
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_millis(500),
        "the backoff was reset: {:?}",
        started.elapsed()
    );
    h.handle.accept_all();
    h.wait_acked(0x1000 + 10).await;
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn connect_failures_back_off_and_recover() {
    let mut h = start(RelayOptions {
        retry_backoff: (Duration::from_millis(1), Duration::from_millis(10)),
        ..RelayOptions::default()
    });
    let events: Vec<OutboxEvent> = (0..3).map(event).collect();
    let refused = events[0].id;
    h.handle
        .refuse_when(move |e| (e.id == refused).then(|| "nacked".to_string()));
    h.handle.fail_connects(5);
    for e in &events {
        h.send(e).await;
    }
    wait_until("the injected failures used up", || h.handle.connects() >= 7).await;
    h.handle.accept_all();
    h.wait_acked(0x1000 + 2).await;
    let want: Vec<_> = events.iter().map(|e| e.id).collect();
    assert_eq!(h.handle.confirmed_ids(), want);
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn nothing_is_published_while_the_fence_is_closed() {
    let fence = Fence::new(Duration::from_millis(300));
    let mut h = start(RelayOptions {
        fence: Some(fence.clone()),
        ..RelayOptions::default()
    });
    // Never renewed: closed.
    let first = event(0);
    h.send(&first).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(h.handle.publishes(), 0, "nothing before the first renewal");
    fence.renewed(Instant::now());
    h.wait_acked(0x1000).await;
    assert_eq!(h.handle.confirmed_ids(), vec![first.id]);

    // The renewal ages past the limit: closed again, by time alone.
    wait_until("the fence to close", || !fence.is_open()).await;
    let second = event(1);
    h.send(&second).await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        h.handle.publishes(),
        1,
        "nothing once the renewal is too old"
    );
    // A renewal opens it again: what waited goes out.
    fence.renewed(Instant::now());
    h.wait_acked(0x1001).await;
    assert_eq!(h.handle.confirmed_ids(), vec![first.id, second.id]);
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
}

fn lsn(e: &OutboxEvent) -> u64 {
    match e.position {
        SourcePosition::Pg { commit_lsn, .. } => commit_lsn,
        _ => unreachable!(),
    }
}

fn ids(events: &[OutboxEvent]) -> Vec<uuid::Uuid> {
    events.iter().map(|e| e.id).collect()
}

#[tokio::test(start_paused = true)]
async fn never_more_than_the_window_is_unconfirmed() {
    let mut h = start(RelayOptions {
        window: 3,
        ..RelayOptions::default()
    });
    h.handle.hold_confirms();
    let events: Vec<OutboxEvent> = (0..10).map(event).collect();
    for e in &events {
        h.send(e).await;
    }
    wait_until("a full window", || h.handle.held().len() == 3).await;
    // However long the confirmations take (short of the confirm timeout), nothing more.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(h.handle.published_ids(), ids(&events[..3]));
    // Each confirmation lets exactly one more event out.
    for (i, e) in events.iter().enumerate() {
        assert!(h.handle.confirm(e.id), "event {i} is outstanding");
        let want = (i + 4).min(events.len()) as u64;
        wait_until("the next publish", || h.handle.publishes() == want).await;
        assert!(h.handle.held().len() <= 3, "after confirming event {i}");
    }
    h.wait_acked(lsn(&events[9])).await;
    assert_eq!(
        h.handle.most_held(),
        3,
        "the window was used, never exceeded"
    );
    assert_eq!(h.handle.published_ids(), ids(&events), "each event once");
    assert_eq!(h.handle.confirmed_ids(), ids(&events));
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn the_acknowledged_position_advances_only_over_the_confirmed_prefix() {
    let mut h = start(RelayOptions::default());
    h.handle.hold_confirms();
    let events: Vec<OutboxEvent> = (0..5).map(event).collect();
    for e in &events {
        h.send(e).await;
    }
    wait_until("all five published", || h.handle.held().len() == 5).await;
    // Confirmations out of order; after each, the position the relay may acknowledge: the
    // end of the longest confirmed prefix.
    let steps = [
        (4, None),
        (2, None),
        (0, Some(0)),
        (1, Some(2)),
        (3, Some(4)),
    ];
    for (i, prefix) in steps {
        assert!(h.handle.confirm(events[i].id));
        let want = prefix.map(|j: usize| lsn(&events[j]));
        if let Some(l) = want {
            h.wait_acked(l).await;
        }
        // Ten ack intervals: whatever the relay was going to acknowledge, it has.
        tokio::time::sleep(RelayOptions::default().ack_interval * 10).await;
        assert_eq!(
            *h.acks.borrow(),
            want.map(Checkpoint::Lsn),
            "after confirming event {i}"
        );
    }
    assert_eq!(h.handle.published_ids(), ids(&events));
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_failure_mid_window_republishes_every_unconfirmed_event_in_order() {
    let mut h = start(RelayOptions::default());
    h.handle.hold_confirms();
    let events: Vec<OutboxEvent> = (0..6).map(event).collect();
    for e in &events {
        h.send(e).await;
    }
    wait_until("all six published", || h.handle.held().len() == 6).await;
    assert!(h.handle.confirm(events[0].id));
    assert!(h.handle.confirm(events[1].id));
    h.wait_acked(lsn(&events[1])).await;
    assert!(h.handle.fail(events[2].id, "nacked"));
    // A new connection, and the oldest unconfirmed event alone until it is confirmed.
    wait_until("the failed event sent again", || {
        h.handle.held() == [events[2].id]
    })
    .await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(h.handle.held(), [events[2].id], "the rest wait for it");
    assert_eq!(h.handle.connects(), 2);
    assert!(h.handle.confirm(events[2].id));
    wait_until("the rest sent again", || h.handle.held().len() == 3).await;
    assert_eq!(h.handle.held(), ids(&events[3..]), "in their order");
    for e in &events[3..] {
        assert!(h.handle.confirm(e.id));
    }
    h.wait_acked(lsn(&events[5])).await;
    let mut want = ids(&events);
    want.extend(ids(&events[2..]));
    assert_eq!(
        h.handle.published_ids(),
        want,
        "first attempts, then every unconfirmed event again, in order"
    );
    assert_eq!(h.handle.confirmed_ids(), ids(&events));
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
}

/// A lease keeper on a [`MemoryStore`] beside a relay, as `pipeline::drive` wires them.
struct Keeper {
    store: crate::state::memory::MemoryStoreHandle,
    fence: Fence,
    stop: tokio_util::sync::CancellationToken,
    task: tokio::task::JoinHandle<Result<(), crate::Error>>,
}

/// Takes the lease on `store` and keeps it with the harness's acknowledgements (behind
/// the forward-only guard `drive` puts around every store), opening `fence`.
async fn keep(
    mut store: crate::state::memory::MemoryStore,
    handle: &crate::state::memory::MemoryStoreHandle,
    h: &Harness,
    fence: Fence,
    self_fence: bool,
) -> Keeper {
    use crate::state::{forward::ForwardOnly, StateStore};
    let (lease, resumed) = store.acquire("r1", "host:1:a").await.unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let task = tokio::spawn(crate::state::keep_lease(
        ForwardOnly::new(store, resumed),
        lease,
        h.acks.clone(),
        crate::state::checkpoint::Checkpointer::new(0),
        self_fence,
        fence.clone(),
        stop.clone(),
    ));
    Keeper {
        store: handle.clone(),
        fence,
        stop,
        task,
    }
}

fn fenced() -> (RelayOptions, Fence) {
    let fence = Fence::new(crate::state::SELF_FENCE_AFTER);
    let opts = RelayOptions {
        fence: Some(fence.clone()),
        ..RelayOptions::default()
    };
    (opts, fence)
}

#[tokio::test(start_paused = true)]
async fn failed_renewals_close_the_fence_after_self_fence_after_and_end_the_keeper() {
    use crate::state::{memory::MemoryStore, RENEW_INTERVAL, SELF_FENCE_AFTER};
    let (opts, fence) = fenced();
    let mut h = start(opts);
    let (store, sh) = MemoryStore::new();
    let k = keep(store, &sh, &h, fence, true).await;
    let first = event(0);
    h.send(&first).await;
    h.wait_acked(lsn(&first)).await;
    wait_until("the position stored", || {
        sh.position() == Some(Checkpoint::Lsn(lsn(&first)))
    })
    .await;
    sh.fail_renewals(true);
    let last_renewal = Instant::now() - k.fence.age().expect("renewed");
    tokio::time::sleep_until(last_renewal + SELF_FENCE_AFTER - Duration::from_millis(1)).await;
    assert!(k.fence.is_open(), "open until SELF_FENCE_AFTER has passed");
    tokio::time::sleep(Duration::from_millis(1)).await;
    assert!(!k.fence.is_open(), "closed once it has");
    // While closed, nothing goes out.
    let second = event(1);
    h.send(&second).await;
    let ended = tokio::time::timeout(Duration::from_secs(10), k.task)
        .await
        .expect("the keeper ended")
        .unwrap();
    assert!(
        matches!(ended, Err(crate::Error::Leadership(_))),
        "{ended:?}"
    );
    let after = Instant::now() - last_renewal;
    assert!(
        after >= SELF_FENCE_AFTER && after <= SELF_FENCE_AFTER + RENEW_INTERVAL,
        "ended {after:?} after the last renewal"
    );
    assert!(sh.renewals().1 >= 3, "{:?}", sh.renewals());
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(h.handle.published_ids(), [first.id], "nothing while fenced");
    assert_eq!(sh.position(), Some(Checkpoint::Lsn(lsn(&first))));
    h.relay.abort();
}

#[tokio::test(start_paused = true)]
async fn nothing_is_published_while_failing_renewals_keep_the_fence_closed() {
    use crate::state::memory::MemoryStore;
    let (opts, fence) = fenced();
    let mut h = start(opts);
    let (store, sh) = MemoryStore::new();
    let k = keep(store, &sh, &h, fence, false).await;
    let first = event(0);
    h.send(&first).await;
    h.wait_acked(lsn(&first)).await;
    sh.fail_renewals(true);
    wait_until("the fence to close", || !k.fence.is_open()).await;
    let second = event(1);
    h.send(&second).await;
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(h.handle.published_ids(), [first.id], "nothing while closed");
    assert!(
        !k.task.is_finished(),
        "without --ha the keeper keeps trying"
    );
    // The next successful renewal opens it, and what waited goes out.
    sh.fail_renewals(false);
    h.wait_acked(lsn(&second)).await;
    assert_eq!(h.handle.published_ids(), [first.id, second.id]);
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
    k.stop.cancel();
    k.task.await.unwrap().unwrap();
    assert_eq!(k.store.position(), Some(Checkpoint::Lsn(lsn(&second))));
    assert_eq!(k.store.holder(), None, "released at the stop");
}

#[tokio::test(start_paused = true)]
async fn the_stored_position_never_moves_backwards_across_a_republish_and_a_restart() {
    use crate::state::memory::MemoryStore;
    let refused_before = telemetry::get().position_backwards_refused.get();
    let events: Vec<OutboxEvent> = (0..7).map(event).collect();
    let (store, sh) = MemoryStore::new();

    // First run: a failure mid-window, its republish, and a repeated older checkpoint.
    let (opts, fence) = fenced();
    let mut h = start(opts);
    let k = keep(store, &sh, &h, fence, false).await;
    h.handle.hold_confirms();
    for e in &events[..5] {
        h.send(e).await;
    }
    wait_until("five published", || h.handle.held().len() == 5).await;
    assert!(h.handle.confirm(events[0].id));
    assert!(h.handle.confirm(events[1].id));
    wait_until("the second stored", || {
        sh.position() == Some(Checkpoint::Lsn(lsn(&events[1])))
    })
    .await;
    assert!(h.handle.fail(events[2].id, "nacked"));
    for e in &events[2..5] {
        wait_until("the republish", || h.handle.held().first() == Some(&e.id)).await;
        assert!(h.handle.confirm(e.id));
    }
    h.wait_acked(lsn(&events[4])).await;
    // A source that reconnected repeats a checkpoint it had sent before.
    h.tx.send(SourceMsg::Checkpoint(Checkpoint::Lsn(lsn(&events[1]))))
        .await
        .unwrap();
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
    k.stop.cancel();
    k.task.await.unwrap().unwrap();
    assert_eq!(sh.position(), Some(Checkpoint::Lsn(lsn(&events[4]))));

    // Restart: the source resumes before the stored position and acknowledges from there.
    let (opts, fence) = fenced();
    let mut h = start(opts);
    let k = keep(MemoryStore::reopen(&sh), &sh, &h, fence, false).await;
    assert_eq!(sh.epoch(), 2);
    h.tx.send(SourceMsg::Checkpoint(Checkpoint::Lsn(lsn(&events[2]))))
        .await
        .unwrap();
    h.wait_acked(lsn(&events[2])).await;
    // The keeper hands it to the guard, which refuses it before it reaches the store (the
    // memory store records every position asked of it: the check of `positions()` below
    // would show it).
    wait_until("the older position refused", || {
        telemetry::get().position_backwards_refused.get() > refused_before
    })
    .await;
    for e in &events[5..] {
        h.send(e).await;
    }
    h.wait_acked(lsn(&events[6])).await;
    drop(h.tx);
    h.relay.await.unwrap().unwrap();
    k.stop.cancel();
    k.task.await.unwrap().unwrap();

    let stored = sh.positions();
    assert_eq!(stored.last(), Some(&Checkpoint::Lsn(lsn(&events[6]))));
    for w in stored.windows(2) {
        assert!(!w[0].is_after(&w[1]), "stored {} after {}", w[1], w[0]);
    }
    assert!(
        telemetry::get().position_backwards_refused.get() > refused_before,
        "the older acknowledgement after the restart reached the guard"
    );
}

/// Shutdown while the sink cannot be reached at start and nothing is unconfirmed: the relay
/// ends at once instead of backing off until the caller's shutdown timeout kills it (it used
/// to wait out every backoff step; `outboxd run` against a closed broker port took its whole
/// 30 s shutdown timeout and exited 1).
#[tokio::test(start_paused = true)]
async fn shutdown_while_the_sink_is_unreachable_and_nothing_is_unconfirmed_ends_at_once() {
    let stop = CancellationToken::new();
    let mut h = start(RelayOptions {
        stop: Some(stop.clone()),
        ..RelayOptions::default()
    });
    h.handle.fail_connects(u32::MAX);
    let handle = h.handle.clone();
    // The fault is in place: the relay has failed to connect, and backs off.
    wait_until("two failed connects", || handle.connects() >= 2).await;
    stop.cancel();
    let ended = tokio::time::timeout(Duration::from_millis(50), &mut h.relay).await;
    let r = ended.expect("the relay ended within 50 ms of the shutdown");
    assert!(r.unwrap().is_ok());
    assert_eq!(*h.acks.borrow(), None, "nothing was acknowledged");
    assert!(h.handle.published_ids().is_empty());
}

/// With an unconfirmed event, shutdown does not end the relay's recovery: it keeps trying to
/// deliver the event (within the caller's shutdown timeout), and once the sink is back the
/// event is confirmed and acknowledged before the relay ends.
#[tokio::test(start_paused = true)]
async fn shutdown_with_an_unconfirmed_event_keeps_trying_to_deliver_it() {
    let stop = CancellationToken::new();
    let mut h = start(RelayOptions {
        stop: Some(stop.clone()),
        retry_backoff: (Duration::from_millis(1), Duration::from_millis(20)),
        ..RelayOptions::default()
    });
    h.handle.hold_confirms();
    let e = event(1);
    h.send(&e).await;
    let handle = h.handle.clone();
    wait_until("the event in flight", || handle.held() == vec![e.id]).await;
    h.handle.fail_connects(u32::MAX);
    assert!(h.handle.fail(e.id, "nacked"));
    let before = h.handle.connects();
    stop.cancel();
    wait_until("reconnects after the shutdown", || {
        handle.connects() >= before + 5
    })
    .await;
    assert!(
        !h.relay.is_finished(),
        "the relay gave up its unconfirmed event"
    );
    h.handle.fail_connects(0);
    wait_until("the event republished", || handle.held() == vec![e.id]).await;
    assert!(h.handle.confirm(e.id));
    h.wait_acked(0x1001).await;
    drop(h.tx);
    let r = tokio::time::timeout(Duration::from_secs(5), h.relay)
        .await
        .expect("the relay ended once its input closed");
    assert!(r.unwrap().is_ok());
}

/// A graceful stop while the server's commits queue for longer than a renewal may take (a
/// MariaDB writing a large transaction's binlog): the final position is still stored, so the
/// next start does not publish again what this run confirmed.
#[tokio::test(start_paused = true)]
async fn a_graceful_stop_stores_the_final_position_on_a_server_slower_than_a_renewal() {
    use crate::state::{memory::MemoryStore, RENEW_TIMEOUT};
    let (opts, fence) = fenced();
    let mut h = start(opts);
    let (store, sh) = MemoryStore::new();
    let k = keep(store, &sh, &h, fence, false).await;
    let first = event(0);
    h.send(&first).await;
    h.wait_acked(lsn(&first)).await;
    wait_until("the first position stored", || {
        sh.position() == Some(Checkpoint::Lsn(lsn(&first)))
    })
    .await;
    let slow = RENEW_TIMEOUT * 2;
    sh.slow_renewals(slow);
    let second = event(1);
    h.send(&second).await;
    h.wait_acked(lsn(&second)).await;
    k.stop.cancel();
    let ended = tokio::time::timeout(Duration::from_secs(60), k.task)
        .await
        .expect("the keeper ended")
        .unwrap();
    assert!(ended.is_ok(), "{ended:?}");
    assert!(
        sh.renewals().0 >= 2,
        "the renewals were slowed: {:?}",
        sh.renewals()
    );
    assert_eq!(
        sh.position(),
        Some(Checkpoint::Lsn(lsn(&second))),
        "the final position is stored although each write took {slow:?}"
    );
    assert_eq!(sh.releases(), 1, "and the lease released");
    h.relay.abort();
}

/// The sum and count of one of the process's histograms, from what `/metrics` serves.
fn histogram_totals(name: &str) -> (f64, f64) {
    let text = telemetry::get().render();
    let value = |suffix: &str| {
        let key = format!("outboxd_{name}_{suffix} ");
        text.lines()
            .find_map(|l| l.strip_prefix(&key))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{key} in {text}"))
    };
    (value("sum"), value("count"))
}

/// The stage histograms measure from the moment the source read the row: an event read 30 s
/// before the relay takes it adds those 30 s to read → taken, and every event handed to the
/// sink counts in taken → published. (The histograms are the process's, shared with the tests
/// running beside this one: the 30 s are what no other test's events carry.)
#[tokio::test]
async fn the_stage_histograms_measure_from_the_read_to_the_hand_over() {
    let (taken_sum, taken_n) = histogram_totals("stage_read_taken_seconds");
    let (_, published_n) = histogram_totals("stage_taken_published_seconds");
    let mut h = start(RelayOptions::default());
    let mut old = event(1);
    old.read_at = std::time::Instant::now().checked_sub(Duration::from_secs(30));
    assert!(old.read_at.is_some(), "the host's clock goes back 30 s");
    h.send(&old).await;
    h.send(&event(2)).await;
    h.wait_acked(0x1002).await;
    let (taken_sum_after, taken_n_after) = histogram_totals("stage_read_taken_seconds");
    let (_, published_n_after) = histogram_totals("stage_taken_published_seconds");
    assert!(
        taken_sum_after - taken_sum >= 30.0,
        "read → taken grew by {} s",
        taken_sum_after - taken_sum
    );
    assert!(taken_n_after > taken_n, "the event read counted");
    assert!(
        published_n_after >= published_n + 2.0,
        "both hand-overs counted: {published_n} → {published_n_after}"
    );
}
