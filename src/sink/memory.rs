//! An in-memory sink for tests of the relay in one process: it keeps, in order, every event it
//! confirmed (what a consumer bound from the start would see, duplicates included), counts
//! connects and publishes, and fails on request — refusing events a predicate picks, as a
//! broker returns or nacks them, or failing the next connects — so recovery can be driven
//! without a broker. Confirmations are immediate, or held on request
//! ([`MemoryHandle::hold_confirms`]) until the test confirms or fails each one, in any order: a
//! broker whose confirms arrive late or out of order. A test waits for confirmations as they
//! happen ([`MemoryHandle::wait_confirmed`]), never by polling.

use super::{Delivery, Sink, SinkError};
use crate::event::OutboxEvent;
use futures::FutureExt;
use std::sync::{Arc, Mutex, MutexGuard};
use tokio::sync::oneshot;

/// Picks the events to refuse, with the reason to give.
type Refuse = Box<dyn Fn(&OutboxEvent) -> Option<String> + Send>;

/// A confirmation the test has not given yet.
struct Held {
    event: OutboxEvent,
    answer: oneshot::Sender<Result<(), SinkError>>,
}

#[derive(Default)]
struct Shared {
    confirmed: Vec<OutboxEvent>,
    /// Ids of every event handed to the sink, in order (republishes included).
    published: Vec<uuid::Uuid>,
    connects: u64,
    publishes: u64,
    refusals: u64,
    refuse: Option<Refuse>,
    failing_connects: u32,
    hold: bool,
    held: Vec<Held>,
    /// The most confirmations outstanding at once.
    most_held: usize,
    /// How many events are confirmed: told to the waiters of
    /// [`MemoryHandle::wait_confirmed`] at each confirmation.
    count: tokio::sync::watch::Sender<usize>,
}

impl Shared {
    fn confirm(&mut self, event: OutboxEvent) {
        self.confirmed.push(event);
        self.count.send_replace(self.confirmed.len());
    }

    /// Forgets confirmations nobody waits for any more (the relay dropped them on a reconnect).
    fn prune(&mut self) {
        self.held.retain(|h| !h.answer.is_closed());
    }

    /// Answers the oldest outstanding confirmation of `id`; false when there is none.
    fn answer(&mut self, id: uuid::Uuid, verdict: Result<(), SinkError>) -> bool {
        self.prune();
        let Some(i) = self.held.iter().position(|h| h.event.id == id) else {
            return false;
        };
        let h = self.held.remove(i);
        if verdict.is_ok() {
            self.confirm(h.event);
        }
        h.answer.send(verdict).is_ok()
    }
}

/// The sink; [`MemorySink::new`] also returns the handle a test inspects and steers it with.
pub struct MemorySink {
    shared: Arc<Mutex<Shared>>,
}

/// The test's side of a [`MemorySink`].
#[derive(Clone)]
pub struct MemoryHandle {
    shared: Arc<Mutex<Shared>>,
}

fn lock(s: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

impl MemorySink {
    pub fn new() -> (MemorySink, MemoryHandle) {
        let shared = Arc::new(Mutex::new(Shared::default()));
        (
            MemorySink {
                shared: shared.clone(),
            },
            MemoryHandle { shared },
        )
    }
}

impl MemoryHandle {
    /// Another sink on this handle's state: a run restarted (a fleet's source after a failure)
    /// publishes where the first one did.
    pub fn sink(&self) -> MemorySink {
        MemorySink {
            shared: self.shared.clone(),
        }
    }

    /// Refuse (as a retryable rejection) every event `f` gives a reason for, until
    /// [`MemoryHandle::accept_all`].
    pub fn refuse_when(&self, f: impl Fn(&OutboxEvent) -> Option<String> + Send + 'static) {
        lock(&self.shared).refuse = Some(Box::new(f));
    }

    pub fn accept_all(&self) {
        lock(&self.shared).refuse = None;
    }

    /// The next `n` connects fail with a retryable connection error.
    pub fn fail_connects(&self, n: u32) {
        lock(&self.shared).failing_connects = n;
    }

    /// From now on confirmations wait for [`MemoryHandle::confirm`] or [`MemoryHandle::fail`].
    pub fn hold_confirms(&self) {
        lock(&self.shared).hold = true;
    }

    /// Ids of the events whose confirmation is outstanding, oldest first.
    pub fn held(&self) -> Vec<uuid::Uuid> {
        let mut s = lock(&self.shared);
        s.prune();
        s.held.iter().map(|h| h.event.id).collect()
    }

    /// The most confirmations that were outstanding at once.
    pub fn most_held(&self) -> usize {
        lock(&self.shared).most_held
    }

    /// Confirms the oldest outstanding publish of `id`; false when none is outstanding.
    pub fn confirm(&self, id: uuid::Uuid) -> bool {
        lock(&self.shared).answer(id, Ok(()))
    }

    /// Nacks the oldest outstanding publish of `id` (a retryable rejection).
    pub fn fail(&self, id: uuid::Uuid, reason: &str) -> bool {
        let e = SinkError::Nacked(format!("message {id} was nacked: {reason}"));
        lock(&self.shared).answer(id, Err(e))
    }

    /// Ids of every event handed to the sink, in order (republishes included).
    pub fn published_ids(&self) -> Vec<uuid::Uuid> {
        lock(&self.shared).published.clone()
    }

    /// Ids of the confirmed events, in confirmation order (duplicates included).
    pub fn confirmed_ids(&self) -> Vec<uuid::Uuid> {
        lock(&self.shared).confirmed.iter().map(|e| e.id).collect()
    }

    /// The confirmed events, in confirmation order (duplicates included).
    pub fn confirmed(&self) -> Vec<OutboxEvent> {
        lock(&self.shared).confirmed.clone()
    }

    /// Waits until at least `n` events are confirmed (woken by each confirmation), and returns
    /// the confirmed events.
    pub async fn wait_confirmed(&self, n: usize) -> Vec<OutboxEvent> {
        let mut count = lock(&self.shared).count.subscribe();
        // The sender lives in the handle's own shared state, so it is never dropped first.
        let _ = count.wait_for(|c| *c >= n).await;
        self.confirmed()
    }

    pub fn connects(&self) -> u64 {
        lock(&self.shared).connects
    }

    pub fn publishes(&self) -> u64 {
        lock(&self.shared).publishes
    }

    pub fn refusals(&self) -> u64 {
        lock(&self.shared).refusals
    }
}

impl Sink for MemorySink {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn stores_position(&self) -> bool {
        true
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        let mut s = lock(&self.shared);
        s.connects += 1;
        if s.failing_connects > 0 {
            s.failing_connects -= 1;
            return Err(SinkError::Connection("injected connect failure".into()));
        }
        Ok(())
    }

    async fn publish(&mut self, event: &OutboxEvent) -> Result<Delivery, SinkError> {
        let mut s = lock(&self.shared);
        s.publishes += 1;
        s.published.push(event.id);
        if s.hold {
            let (answer, rx) = oneshot::channel();
            s.held.push(Held {
                event: event.clone(),
                answer,
            });
            s.prune();
            s.most_held = s.most_held.max(s.held.len());
            let confirm = async move {
                rx.await.unwrap_or_else(|_| {
                    Err(SinkError::Connection("the memory sink is gone".into()))
                })
            };
            return Ok(Delivery::Pending(confirm.boxed()));
        }
        let refused = s.refuse.as_ref().and_then(|f| f(event));
        let verdict = match refused {
            Some(reason) => {
                s.refusals += 1;
                Err(SinkError::Rejected(format!(
                    "message {} was refused: {reason}",
                    event.id
                )))
            }
            None => {
                s.confirm(event.clone());
                Ok(())
            }
        };
        Ok(Delivery::Pending(futures::future::ready(verdict).boxed()))
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}
