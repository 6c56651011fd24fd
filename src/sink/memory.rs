//! An in-memory sink for tests of the relay in one process: it keeps, in order, every event it
//! confirmed (what a consumer bound from the start would see, duplicates included), counts
//! connects and publishes, and fails on request — refusing events a predicate picks, as a
//! broker returns or nacks them, or failing the next connects — so recovery can be driven
//! without a broker. Confirmations are immediate.

use super::{Delivery, Sink, SinkError};
use crate::event::OutboxEvent;
use futures::FutureExt;
use std::sync::{Arc, Mutex, MutexGuard};

/// Picks the events to refuse, with the reason to give.
type Refuse = Box<dyn Fn(&OutboxEvent) -> Option<String> + Send>;

#[derive(Default)]
struct Shared {
    confirmed: Vec<OutboxEvent>,
    connects: u64,
    publishes: u64,
    refusals: u64,
    refuse: Option<Refuse>,
    failing_connects: u32,
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

    /// Ids of the confirmed events, in confirmation order (duplicates included).
    pub fn confirmed_ids(&self) -> Vec<uuid::Uuid> {
        lock(&self.shared).confirmed.iter().map(|e| e.id).collect()
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
                s.confirmed.push(event.clone());
                Ok(())
            }
        };
        Ok(Delivery::Pending(futures::future::ready(verdict).boxed()))
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        Ok(())
    }
}
