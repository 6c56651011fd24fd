//! Sources read the database's log and turn outbox INSERTs into [`OutboxEvent`]s, interleaved
//! with [`Checkpoint`]s after each transaction. They receive back, through a watch channel, the
//! newest checkpoint whose events are all durable; the log sources leave storing it and telling
//! the server to the run's return path (`state::checkpoint`), poll mode marks its rows.

pub(crate) mod assemble;
pub(crate) mod contract;
pub(crate) mod log;
pub mod mysql;
pub mod poll;
pub mod postgres;
pub mod snapshot;
pub(crate) mod startup;

use crate::event::{Checkpoint, OutboxEvent};
use crate::telemetry::events::{EventRead, InternalEvent};
use std::sync::Arc;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

/// What a source sends to the relay, in commit order.
pub enum SourceMsg {
    Event(Box<OutboxEvent>, BudgetPermit),
    Checkpoint(Checkpoint),
}

/// Holds a share of the in-flight byte budget until the event is confirmed (or dropped).
pub struct BudgetPermit(#[allow(dead_code)] Option<OwnedSemaphorePermit>);

/// The in-flight memory bound, in bytes, shared by everything between the source's read and
/// the sink's confirmation. A source waits here before it reads further, so a backlog of any
/// size is held in the database, not in the relay.
#[derive(Clone)]
pub struct Budget {
    bytes: Arc<Semaphore>,
    max: usize,
}

impl Budget {
    pub fn new(max_bytes: usize) -> Self {
        let max = max_bytes.clamp(1, Semaphore::MAX_PERMITS);
        Budget {
            bytes: Arc::new(Semaphore::new(max)),
            max,
        }
    }

    /// Waits until `size` bytes are free. An event larger than the whole budget takes all of
    /// it, so it still passes, alone.
    pub async fn acquire(&self, size: usize) -> BudgetPermit {
        let n = size.clamp(1, self.max).min(u32::MAX as usize) as u32;
        // The semaphore is never closed, so acquiring only waits.
        BudgetPermit(self.bytes.clone().acquire_many_owned(n).await.ok())
    }
}

/// Where a source sends its events: the relay's channel and the byte budget.
pub struct Outlet {
    pub events: mpsc::Sender<SourceMsg>,
    pub budget: Budget,
}

impl Outlet {
    /// Sends an event after reserving its bytes. Errors when the relay is gone.
    pub(crate) async fn send_event(&self, mut event: OutboxEvent) -> Result<(), crate::Error> {
        EventRead.emit();
        // A source that did not note when it read the row read it just now.
        event.read_at.get_or_insert_with(std::time::Instant::now);
        let permit = self.budget.acquire(event.size()).await;
        self.events
            .send(SourceMsg::Event(Box::new(event), permit))
            .await
            .map_err(|_| relay_gone())
    }

    pub(crate) async fn send_checkpoint(&self, cp: Checkpoint) -> Result<(), crate::Error> {
        self.events
            .send(SourceMsg::Checkpoint(cp))
            .await
            .map_err(|_| relay_gone())
    }
}

fn relay_gone() -> crate::Error {
    crate::Error::Other("relay stopped".into())
}

/// The two ends a source uses: where events go, and where durable checkpoints come back.
pub struct SourceLink {
    pub(crate) outlet: Outlet,
    /// The newest checkpoint that is durable downstream; `None` until the first.
    pub acks: tokio::sync::watch::Receiver<Option<Checkpoint>>,
}
