//! The relay core: takes events from a source in commit order, hands them to a sink with a
//! bounded window of unconfirmed events, and acknowledges a source checkpoint only once every
//! event before it is durable — in the order received, never backwards. On a retryable sink
//! failure (nack, return, confirm timeout, lost connection) it reconnects and republishes every
//! unconfirmed event in the original order: duplicates are possible, loss is not, and neither
//! is reordering of first deliveries — except behind a refusal in place (a nack from a queue
//! that refuses when full): events already written after the refused one cannot be recalled,
//! so the relay flags it ([`OrderAtRisk`]); with `--window 1` nothing is ever written behind.
//!
//! Recovery is paced, so an event the broker keeps refusing (an unroutable return, a nack, a
//! channel closed over a missing exchange) costs a few reconnects a minute, not a storm: the
//! reconnect backoff lasts across recoveries and is reset only by a confirmation, and each
//! recovery first republishes the oldest unconfirmed event alone and waits for its confirmation
//! before the rest follow. Publishing is also gated by the lease ([`RelayOptions::fence`]):
//! nothing is published, republished or flushed while the last renewal is too old.
//!
//! Its in-process tests (paused clock, `MemorySink`, `MemoryStore`) live in `relay/tests.rs`.

use crate::backoff::Backoff;
use crate::event::{Checkpoint, OutboxEvent};
use crate::sink::{Delivery, FlowControl, Sink, SinkError};
use crate::source::{BudgetPermit, SourceMsg};
use crate::state::Fence;
use crate::telemetry::events::{
    EventConfirmed, EventHandedOver, EventPublishing, EventRepublished, EventTaken, InternalEvent,
    OrderAtRisk, SinkConnected, SinkRecovered, SinkRetry,
};
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use futures::{FutureExt, StreamExt};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
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
    /// Cancelled on shutdown. A relay with nothing unconfirmed that waits for its sink
    /// (connecting at start, or reconnecting after the connection broke while idle) ends at
    /// once: nothing it holds is lost, the stored position covers only confirmed events. With
    /// unconfirmed events it keeps trying to deliver them, within the caller's shutdown
    /// timeout, so fewer are sent again after the restart.
    pub stop: Option<CancellationToken>,
}

impl Default for RelayOptions {
    fn default() -> Self {
        RelayOptions {
            window: DEFAULT_WINDOW,
            confirm_timeout: Duration::from_secs(30),
            ack_interval: Duration::from_millis(100),
            fence: None,
            retry_backoff: (Duration::from_millis(100), Duration::from_secs(30)),
            stop: None,
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
    pub(crate) acked_checkpoints: AtomicU64,
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

    if let Some(fence) = &opts.fence {
        sink.guard_wire(fence.clone());
    }
    if connect_with_backoff(sink, opts).await? == Recovery::Stopped {
        return Ok(());
    }
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
                        if matches!(e, SinkError::Nacked(_)) && !confirms.is_empty() {
                            // Confirmations come in publishing order, so every one still
                            // pending is of an event written after the refused one.
                            OrderAtRisk {
                                event: front_event(&queue).map(|e| (&e.id, &e.position)),
                                behind: confirms.len(),
                            }
                            .emit();
                        }
                        let mut w = Window { queue: &mut queue, confirms: &mut confirms, durable: &mut durable, pacing: &mut pacing };
                        if recover(sink, &mut w, e, opts, stats).await? == Recovery::Stopped { return Ok(()); }
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
                        let taken = Instant::now();
                        EventTaken { event: &event }.emit();
                        if event.poison.is_some() {
                            stats.poison.fetch_add(1, Ordering::Relaxed);
                        }
                        gate(opts).await;
                        EventPublishing { event: &event }.emit();
                        let published = publish_one(sink, &event, opts.confirm_timeout).await;
                        EventHandedOver { took: taken.elapsed() }.emit();
                        queue.push_back(Entry::Event { event, _permit: permit, sent: Instant::now() });
                        stats.published.fetch_add(1, Ordering::Relaxed);
                        match published {
                            Ok(confirm) => confirms.push_back(confirm),
                            Err(e) if e.is_retryable() => {
                                let mut w = Window { queue: &mut queue, confirms: &mut confirms, durable: &mut durable, pacing: &mut pacing };
                                if recover(sink, &mut w, e, opts, stats).await? == Recovery::Stopped { return Ok(()); }
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
                    if recover(sink, &mut w, cause, opts, stats).await? == Recovery::Stopped { return Ok(()); }
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

/// How a wait for the sink ended.
#[derive(Debug, PartialEq, Eq)]
enum Recovery {
    /// The sink is back (and, in a recovery, the unconfirmed events are sent again).
    Recovered,
    /// Shutdown came while nothing was unconfirmed: the relay ends without the sink.
    Stopped,
}

/// Sleeps `delay`; true when shutdown came first and `idle` (nothing unconfirmed) allows
/// stopping on it.
async fn backoff_or_stop(delay: Duration, opts: &RelayOptions, idle: bool) -> bool {
    match &opts.stop {
        Some(stop) if idle => {
            tokio::select! {
                _ = stop.cancelled() => true,
                _ = tokio::time::sleep(delay) => false,
            }
        }
        _ => {
            tokio::time::sleep(delay).await;
            false
        }
    }
}

async fn connect_with_backoff<S: Sink>(
    sink: &mut S,
    opts: &RelayOptions,
) -> Result<Recovery, crate::Error> {
    let mut backoff = Backoff::standard();
    loop {
        match sink.connect().await {
            Ok(()) => {
                SinkConnected.emit();
                return Ok(Recovery::Recovered);
            }
            Err(e) if e.is_retryable() => {
                let delay = backoff.next_delay();
                tracing::warn!(sink = sink.name(), error = %e, retry_in = ?delay, "sink unavailable");
                if backoff_or_stop(delay, opts, true).await {
                    return Ok(Recovery::Stopped);
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Reconnects and republishes every unconfirmed event, in order, until the oldest of them is
/// confirmed and the rest are sent, or a non-retryable error says it never will, or shutdown
/// comes while nothing is unconfirmed ([`RelayOptions::stop`]). Every failed
/// attempt is logged with the event it is about and the sink's reason, counted, and followed by
/// the next step of the pacing backoff.
async fn recover<S: Sink>(
    sink: &mut S,
    w: &mut Window<'_>,
    cause: SinkError,
    opts: &RelayOptions,
    stats: &RelayStats,
) -> Result<Recovery, crate::Error> {
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
        let idle = front.is_none();
        if backoff_or_stop(delay, opts, idle).await {
            return Ok(Recovery::Stopped);
        }
        match republish(sink, w, opts, stats).await {
            Ok(republished) => {
                SinkRecovered {
                    sink: sink.name(),
                    republished,
                }
                .emit();
                return Ok(Recovery::Recovered);
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
    // A relay whose lease gate is closed does not reach for the broker at all, not even to
    // connect: it regains the lease first or its keeper stops it (a paused leader resumed
    // after losing its lease opened a new connection through its 64 ms retry before the
    // keeper's exit, writing the protocol header while another relay held the lease).
    gate(opts).await;
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
mod tests;
