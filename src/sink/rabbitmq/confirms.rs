//! Settling publisher confirms. lapin hands a `basic.return` to whichever confirmation it
//! completes next, not to the message returned, so a confirmation alone cannot say whether
//! its message was routed. This file keeps that bookkeeping in one place: a per-channel
//! [`Tracker`] of the publishes under way, the task that drives it and records every return in
//! a batch before settling any confirmation, and the task that turns lapin's connection events
//! into the link's state and the relay's flow control.

use super::declare::channel_error;
use super::link::LinkState;
use crate::sink::{FlowControl, SinkError};
use crate::telemetry::events::{InternalEvent, SinkBlocked, SinkConnectionFailed, SinkUnblocked};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::StreamExt;
use lapin::Confirmation;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use tokio::sync::{oneshot, watch};
use uuid::Uuid;

/// What one publish came to.
pub(super) struct Outcome {
    pub(super) id: Uuid,
    pub(super) result: lapin::Result<Confirmation>,
    pub(super) done: oneshot::Sender<Result<(), SinkError>>,
}

/// The confirmations of one channel: what the sink's publish and the driving task share.
#[derive(Default)]
pub(super) struct Tracker {
    pub(super) pending: FuturesUnordered<BoxFuture<'static, Outcome>>,
    pub(super) waker: Option<Waker>,
}

/// What only the driving task keeps, outside the lock the sink's publish takes for every event:
/// returned messages whose confirmation has not been settled yet, with the broker's reason.
#[derive(Default)]
struct Returns {
    returned: HashMap<Uuid, String>,
}

pub(super) fn lock(t: &Mutex<Tracker>) -> MutexGuard<'_, Tracker> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

impl Returns {
    /// Settles a batch of completed publishes (and empties it). All returns in the batch are
    /// recorded before any is settled: the return of message X reaches lapin before X's ack
    /// and is handed to the first confirmation completed after it, which completes no later
    /// than X's own, so it is in this batch or an earlier one. Batches are settled one after
    /// the other by the one driving task, so settling outside the tracker's lock keeps that.
    fn settle(&mut self, batch: &mut Vec<Outcome>) {
        for o in batch.iter() {
            if let Ok(Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret))) = &o.result {
                let returned_id = ret
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|m| Uuid::parse_str(m.as_str()).ok())
                    .unwrap_or(o.id);
                tracing::error!(
                    id = %returned_id,
                    exchange = %ret.delivery.exchange,
                    routing_key = %ret.delivery.routing_key,
                    reply_code = ret.reply_code,
                    reply_text = %ret.reply_text,
                    "RabbitMQ returned a message as unroutable: the topology is broken (is the alternate exchange <exchange>.unrouted bound to its queue? does the queue <exchange>.dead exist?); it is republished after a reconnect until it routes"
                );
                self.returned.insert(
                    returned_id,
                    format!(
                        "RabbitMQ returned it: {} {} (exchange {:?}, routing key {:?})",
                        ret.reply_code,
                        ret.reply_text,
                        ret.delivery.exchange.as_str(),
                        ret.delivery.routing_key.as_str()
                    ),
                );
            }
        }
        for o in batch.drain(..) {
            let returned = self.returned.remove(&o.id);
            let verdict = match (o.result, returned) {
                (Err(e), _) => Err(channel_error(e)),
                (Ok(_), Some(why)) => Err(SinkError::Rejected(format!(
                    "message {} was returned as unroutable: {why}",
                    o.id
                ))),
                (Ok(Confirmation::Ack(_)), None) => Ok(()),
                (Ok(Confirmation::Nack(_)), None) => Err(SinkError::Nacked(format!(
                    "RabbitMQ nacked message {} (a queue it routes to refused it, e.g. one with x-overflow=reject-publish that is full, or the broker could not store it)",
                    o.id
                ))),
                (Ok(Confirmation::NotRequested), None) => Err(SinkError::Connection(
                    "publisher confirms are not enabled on the channel".into(),
                )),
            };
            // The relay may have given up on it (confirm timeout): then nobody listens.
            let _ = o.done.send(verdict);
        }
    }
}

/// Completes the channel's publishes and settles their confirmations, for as long as the
/// channel lives (the task is aborted with its [`Link`](super::link::Link)).
pub(super) async fn drive_confirms(tracker: Arc<Mutex<Tracker>>) {
    let mut returns = Returns::default();
    let mut batch = Vec::new();
    futures::future::poll_fn(|cx: &mut Context<'_>| {
        {
            let mut t = lock(&tracker);
            if !t.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                t.waker = Some(cx.waker().clone());
            }
            // Drain everything that is ready now, so the batch holds every return that came
            // with or before the confirmations in it.
            while let Poll::Ready(Some(o)) = t.pending.poll_next_unpin(cx) {
                batch.push(o);
            }
        }
        // Logging a return and answering the relay need no lock: the sink publishes on.
        if !batch.is_empty() {
            returns.settle(&mut batch);
        }
        Poll::<()>::Pending
    })
    .await
}

/// Follows lapin's connection events: alarms (blocked/unblocked) and connection errors.
pub(super) async fn watch_events(
    events: impl futures::Stream<Item = lapin::Event> + Send + 'static,
    state: watch::Sender<LinkState>,
    flow: Arc<FlowControl>,
) {
    let mut events = std::pin::pin!(events);
    while let Some(ev) = events.next().await {
        match ev {
            lapin::Event::ConnectionBlocked(reason) => {
                flow.block();
                SinkBlocked { reason: &reason }.emit();
                state.send_modify(|s| s.blocked = true);
            }
            lapin::Event::ConnectionUnblocked => {
                flow.unblock();
                SinkUnblocked.emit();
                state.send_modify(|s| s.blocked = false);
            }
            lapin::Event::Error(e) => {
                flow.unblock();
                SinkConnectionFailed { error: &e }.emit();
                state.send_modify(|s| {
                    s.blocked = false;
                    s.error = Some(e.to_string());
                });
            }
            _ => {}
        }
    }
}
