//! The relay core: takes events from a source in commit order, hands them to a sink with a
//! bounded window of unconfirmed events, and acknowledges a source checkpoint only once every
//! event before it is durable — in the order received, never backwards. On a retryable sink
//! failure (nack, return, confirm timeout, lost connection) it reconnects and republishes every
//! unconfirmed event in the original order: duplicates are possible, loss and reordering of
//! first deliveries are not.
//!
//! Recovery is paced, so an event the broker keeps refusing (an unroutable return, a nack, a
//! channel closed over a missing exchange) costs a few reconnects a minute, not a storm: the
//! reconnect backoff lasts across recoveries and is reset only by a confirmation, and each
//! recovery first republishes the oldest unconfirmed event alone and waits for its confirmation
//! before the rest follow. Publishing is also gated by the lease ([`RelayOptions::fence`]):
//! nothing is published, republished or flushed while the last renewal is too old.

use crate::backoff::Backoff;
use crate::event::{Checkpoint, OutboxEvent};
use crate::sink::{Delivery, FlowControl, Sink, SinkError};
use crate::source::{BudgetPermit, SourceMsg};
use crate::state::Fence;
use crate::telemetry::events::{
    EventConfirmed, EventPublishing, EventRepublished, InternalEvent, SinkConnected, SinkRecovered,
    SinkRetry,
};
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use futures::{FutureExt, StreamExt};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
// The tokio clock (the same monotonic clock outside paused-time tests): under `start_paused`
// the relay's ack pacing follows the test's virtual time.
use tokio::time::Instant;

/// The default window (`--window`): enough unconfirmed events to keep a persistent queue's
/// confirm pipeline full. A broker confirms persistent messages only after they reach its
/// disk, in batches; with 1,000 in flight the relay idled between batches at about 0.8 of
/// what the broker takes, with 5,000 it reached 0.96 (docs/benchmarks.md). Memory stays
/// bounded by `--max-inflight-bytes` whatever the window; the duplicate bound after a crash
/// grows with it (docs/guarantees.md).
pub const DEFAULT_WINDOW: usize = 5000;

#[derive(Debug, Clone)]
pub struct RelayOptions {
    /// Most events handed to the sink and not yet confirmed.
    pub window: usize,
    /// A confirmation that takes longer is a failure: reconnect and republish.
    pub confirm_timeout: Duration,
    /// Longest time a durable checkpoint waits before it is acknowledged while events keep
    /// arriving (when the input is idle it is acknowledged at once).
    pub ack_interval: Duration,
    /// Publishing (first attempts, republishes and flushes) waits while this is closed: the
    /// lease was last renewed too long ago and another relay may hold it. `None` where no
    /// lease exists (poll mode, binlog files).
    pub fence: Option<Fence>,
    /// Reconnect pacing of recoveries: the first wait, doubled per failure without a
    /// confirmation in between, up to the second.
    pub retry_backoff: (Duration, Duration),
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            window: DEFAULT_WINDOW,
            confirm_timeout: Duration::from_secs(30),
            ack_interval: Duration::from_millis(100),
            fence: None,
            retry_backoff: (Duration::from_millis(100), Duration::from_secs(30)),
        }
    }
}

/// Counters of what went through one relay run, returned to its caller (`run` and tests read
/// them); the process-wide metrics the endpoint serves are written by `telemetry::events`.
#[derive(Debug, Default)]
pub struct RelayStats {
    pub published: AtomicU64,
    pub confirmed: AtomicU64,
    pub republished: AtomicU64,
    pub recoveries: AtomicU64,
    pub poison: AtomicU64,
    pub acked_checkpoints: AtomicU64,
}

enum Entry {
    Event {
        event: Box<OutboxEvent>,
        _permit: BudgetPermit,
        /// When it was (last) handed to the sink: publish→confirm latency.
        sent: Instant,
    },
    Checkpoint(Checkpoint),
}

type Confirm = BoxFuture<'static, Result<(), SinkError>>;

/// Runs until the source closes its channel and every event is confirmed and acknowledged.
/// Graceful shutdown is therefore the source's decision (it stops at a transaction boundary);
/// the caller bounds the wait with its shutdown timeout.
pub async fn run<S: Sink>(
    sink: &mut S,
    mut rx: mpsc::Receiver<SourceMsg>,
    acks: watch::Sender<Option<Checkpoint>>,
    opts: &RelayOptions,
    stats: &RelayStats,
) -> Result<(), crate::Error> {
    let store = sink.stores_position();
    let mut queue: VecDeque<Entry> = VecDeque::new();
    let mut confirms: FuturesOrdered<Confirm> = FuturesOrdered::new();
    let mut durable: Option<Checkpoint> = None;
    let mut acked: Option<Checkpoint> = None;
    let mut input_open = true;
    let mut last_ack = Instant::now();
    let mut pacing = Pacing::new(opts.retry_backoff);
    // Events confirmed since the last flush. A source may hold its position back (a MySQL XA
    // transaction prepared but not committed) while later events are confirmed: their
    // buffered output is flushed once the input is idle even though no new position is.
    let mut unflushed = false;

    connect_with_backoff(sink).await?;
    // An idle relay notices a broken sink connection on this tick, not at the next event.
    let mut health = tokio::time::interval(Duration::from_secs(1));
    health.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    loop {
        if !input_open && queue.is_empty() {
            break;
        }
        let ack_due = durable.is_some() && durable != acked;
        tokio::select! {
            biased;
            res = confirms.next(), if !confirms.is_empty() => {
                match res.expect("checked non-empty") {
                    Ok(()) => {
                        stats.confirmed.fetch_add(1, Ordering::Relaxed);
                        pop_confirmed(&mut queue, &mut durable);
                        pacing.confirmed();
                        unflushed = true;
                    }
                    Err(e) if e.is_retryable() => {
                        let mut w = Window { queue: &mut queue, confirms: &mut confirms, durable: &mut durable, pacing: &mut pacing };
                        recover(sink, &mut w, e, opts, stats).await?;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            msg = rx.recv(), if input_open && confirms.len() < opts.window => {
                match msg {
                    None => input_open = false,
                    Some(SourceMsg::Checkpoint(cp)) => {
                        if queue.is_empty() {
                            advance(&mut durable, cp);
                        } else {
                            queue.push_back(Entry::Checkpoint(cp));
                        }
                    }
                    Some(SourceMsg::Event(event, permit)) => {
                        if event.poison.is_some() {
                            stats.poison.fetch_add(1, Ordering::Relaxed);
                        }
                        gate(opts).await;
                        EventPublishing { event: &event }.emit();
                        let published = publish_one(sink, &event, opts.confirm_timeout).await;
                        queue.push_back(Entry::Event { event, _permit: permit, sent: Instant::now() });
                        stats.published.fetch_add(1, Ordering::Relaxed);
                        match published {
                            Ok(confirm) => confirms.push_back(confirm),
                            Err(e) if e.is_retryable() => {
                                let mut w = Window { queue: &mut queue, confirms: &mut confirms, durable: &mut durable, pacing: &mut pacing };
                                recover(sink, &mut w, e, opts, stats).await?;
                            }
                            Err(e) => return Err(e.into()),
                        }
                    }
                }
            }
            _ = tokio::time::sleep(opts.ack_interval), if ack_due => {}
            _ = health.tick() => {
                if sink.is_broken() {
                    let cause = SinkError::Connection("the connection was lost".into());
                    let mut w = Window { queue: &mut queue, confirms: &mut confirms, durable: &mut durable, pacing: &mut pacing };
                    recover(sink, &mut w, cause, opts, stats).await?;
                }
            }
        }

        if durable.is_some()
            && durable != acked
            && (!input_open || rx.is_empty() || last_ack.elapsed() >= opts.ack_interval)
        {
            // Accepted-but-buffered events become durable only with this flush, so it must
            // come before the acknowledgement that covers them. Flushing makes them visible:
            // gated like a publish.
            gate(opts).await;
            sink.flush().await?;
            unflushed = false;
            if store {
                acks.send_replace(durable.clone());
            }
            stats.acked_checkpoints.fetch_add(1, Ordering::Relaxed);
            acked = durable.clone();
            last_ack = Instant::now();
        } else if unflushed && queue.is_empty() && rx.is_empty() {
            gate(opts).await;
            sink.flush().await?;
            unflushed = false;
        }
    }
    gate(opts).await;
    sink.flush().await?;
    Ok(())
}

/// Waits until the lease allows publishing (at once while it is fresh, or without a lease).
async fn gate(opts: &RelayOptions) {
    if let Some(fence) = &opts.fence {
        if !fence.is_open() {
            fence.wait_open().await;
        }
    }
}

/// Reconnect pacing that lasts across recoveries: consecutive failures without a confirmation
/// in between back off up to the cap (by default 30 s: two to four attempts a minute), and only
/// a confirmation resets it. A fresh backoff per recovery would reconnect many times a second for
/// an event the broker keeps refusing.
struct Pacing {
    backoff: Backoff,
    /// Failed attempts since the last confirmation.
    attempts: u32,
}

impl Pacing {
    fn new((min, max): (Duration, Duration)) -> Pacing {
        Pacing {
            backoff: Backoff::new(min, max),
            attempts: 0,
        }
    }

    /// One more failure: its number in the current run, and the wait before the next attempt.
    fn failed(&mut self) -> (u32, Duration) {
        self.attempts += 1;
        (self.attempts, self.backoff.next_delay())
    }

    fn confirmed(&mut self) {
        if self.attempts > 0 {
            self.attempts = 0;
            self.backoff.reset();
        }
    }
}

/// What a recovery works on: the relay's unconfirmed window and its pacing.
struct Window<'a> {
    queue: &'a mut VecDeque<Entry>,
    confirms: &'a mut FuturesOrdered<Confirm>,
    durable: &'a mut Option<Checkpoint>,
    pacing: &'a mut Pacing,
}

/// The front event was confirmed: drop it, then every checkpoint it was holding back.
fn pop_confirmed(queue: &mut VecDeque<Entry>, durable: &mut Option<Checkpoint>) {
    let front = queue.pop_front();
    debug_assert!(matches!(front, Some(Entry::Event { .. })));
    if let Some(Entry::Event { event, sent, .. }) = front {
        EventConfirmed {
            event: &event,
            sent_ago: sent.elapsed(),
        }
        .emit();
    }
    while let Some(Entry::Checkpoint(_)) = queue.front() {
        if let Some(Entry::Checkpoint(cp)) = queue.pop_front() {
            advance(durable, cp);
        }
    }
}

/// Moves the durable checkpoint forward, never backwards (a source that reconnects may repeat
/// an older one).
fn advance(durable: &mut Option<Checkpoint>, cp: Checkpoint) {
    match durable {
        Some(cur) if !cp.is_after(cur) => {}
        _ => *durable = Some(cp),
    }
}

async fn publish_one<S: Sink>(
    sink: &mut S,
    event: &OutboxEvent,
    confirm_timeout: Duration,
) -> Result<Confirm, SinkError> {
    let flow = sink.flow_control();
    Ok(match sink.publish(event).await? {
        Delivery::Accepted => futures::future::ready(Ok(())).boxed(),
        Delivery::Pending(confirm) => confirm_within(confirm, confirm_timeout, flow).boxed(),
    })
}

/// Waits for one confirmation at most `timeout`, except that a period during which the sink
/// blocked publishing (a broker resource alarm) starts another: an alarm longer than the
/// timeout is flow control, and a reconnect would only republish into the same block. The
/// period is judged by the block count, not only the flag, because the relay may poll this
/// future only after the block ended.
async fn confirm_within(
    mut confirm: Confirm,
    timeout: Duration,
    flow: Option<Arc<FlowControl>>,
) -> Result<(), SinkError> {
    let blocks = |f: &FlowControl| (f.is_blocked(), f.blocks());
    let mut seen = flow.as_deref().map(blocks);
    loop {
        match tokio::time::timeout(timeout, &mut confirm).await {
            Ok(r) => return r,
            Err(_) => {
                let now = flow.as_deref().map(blocks);
                let blocked_meanwhile = match (seen, now) {
                    (Some((was, before)), Some((is, after))) => was || is || after != before,
                    _ => false,
                };
                if !blocked_meanwhile {
                    return Err(SinkError::ConfirmTimeout(timeout));
                }
                seen = now;
            }
        }
    }
}

async fn connect_with_backoff<S: Sink>(sink: &mut S) -> Result<(), crate::Error> {
    let mut backoff = Backoff::standard();
    loop {
        match sink.connect().await {
            Ok(()) => {
                SinkConnected.emit();
                return Ok(());
            }
            Err(e) if e.is_retryable() => {
                let delay = backoff.next_delay();
                tracing::warn!(sink = sink.name(), error = %e, retry_in = ?delay, "sink unavailable");
                tokio::time::sleep(delay).await;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Reconnects and republishes every unconfirmed event, in order, until the oldest of them is
/// confirmed and the rest are sent, or a non-retryable error says it never will. Every failed
/// attempt is logged with the event it is about and the sink's reason, counted, and followed by
/// the next step of the pacing backoff.
async fn recover<S: Sink>(
    sink: &mut S,
    w: &mut Window<'_>,
    cause: SinkError,
    opts: &RelayOptions,
    stats: &RelayStats,
) -> Result<(), crate::Error> {
    let mut cause = cause;
    loop {
        // Old confirmations belong to the broken channel: drop them before republishing.
        *w.confirms = FuturesOrdered::new();
        let (attempt, delay) = w.pacing.failed();
        let front = front_event(w.queue).map(|e| (&e.id, &e.position));
        SinkRetry {
            cause: cause.kind(),
            event: front,
            reason: &cause,
            attempt,
            retry_in: delay,
        }
        .emit();
        stats.recoveries.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(delay).await;
        match republish(sink, w, opts, stats).await {
            Ok(republished) => {
                SinkRecovered {
                    sink: sink.name(),
                    republished,
                }
                .emit();
                return Ok(());
            }
            Err(e) if e.is_retryable() => cause = e,
            Err(e) => return Err(e.into()),
        }
    }
}

fn front_event(queue: &VecDeque<Entry>) -> Option<&OutboxEvent> {
    queue.iter().find_map(|e| match e {
        Entry::Event { event, .. } => Some(&**event),
        Entry::Checkpoint(_) => None,
    })
}

/// One recovery attempt: a fresh connection, then the oldest unconfirmed event alone until it
/// is confirmed, then the others pipelined. Waiting for that one confirmation is what stops a
/// refused event from being answered by an immediate reconnect, costs one message per attempt
/// instead of the whole window, and lets a queue bound while it was refused receive it before
/// the events after it. Returns how many events were sent.
async fn republish<S: Sink>(
    sink: &mut S,
    w: &mut Window<'_>,
    opts: &RelayOptions,
    stats: &RelayStats,
) -> Result<usize, SinkError> {
    sink.connect().await?;
    let mut sent_count = 0;
    let front = w.queue.iter_mut().find_map(|e| match e {
        Entry::Event { event, sent, .. } => Some((&**event, sent)),
        Entry::Checkpoint(_) => None,
    });
    if let Some((event, sent)) = front {
        gate(opts).await;
        let confirm = publish_one(sink, event, opts.confirm_timeout).await?;
        *sent = Instant::now();
        stats.republished.fetch_add(1, Ordering::Relaxed);
        EventRepublished.emit();
        sent_count += 1;
        confirm.await?;
        stats.confirmed.fetch_add(1, Ordering::Relaxed);
        pop_confirmed(w.queue, w.durable);
        w.pacing.confirmed();
    }
    for entry in w.queue.iter_mut() {
        if let Entry::Event { event, sent, .. } = entry {
            gate(opts).await;
            let c = publish_one(sink, event, opts.confirm_timeout).await?;
            w.confirms.push_back(c);
            *sent = Instant::now();
            stats.republished.fetch_add(1, Ordering::Relaxed);
            EventRepublished.emit();
            sent_count += 1;
        }
    }
    Ok(sent_count)
}

#[cfg(test)]
mod tests {
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

    #[tokio::test]
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

    #[tokio::test]
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

    #[tokio::test]
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

    // In-process tests under paused time: the tokio clock stands still while any task can run
    // and jumps to the next timer once all of them wait, so seconds of relay and lease time
    // take milliseconds, and "nothing happened for 5 s" is an exact statement about 5 s of the
    // relay's time. The sink holds confirmations until the test gives them, in any order.

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

    /// A lease keeper on a [`MemoryStore`] beside a relay, as `connector::drive` wires them.
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
        let (_commits_tx, commits) = watch::channel(crate::state::DurableCommit::default());
        let stop = tokio_util::sync::CancellationToken::new();
        let task = tokio::spawn(crate::state::keep_lease(
            ForwardOnly::new(store, resumed),
            lease,
            h.acks.clone(),
            commits,
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
        // memory store panics on a backwards write: the keeper's task would fail).
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
}
