//! What one run of a relay has got to, as it goes, for a caller that runs several in one
//! process (`outboxd fleet`): whether it waits as a standby or publishes, the holder it waits
//! for, its counts and the position it acknowledged. The process-wide instruments of this
//! module's parent say the same for a process that runs one relay; a fleet needs it per source.
//! The run's code reaches its `Live` through a task-local ([`scope`]), set by the caller around
//! the run's future: the start and the pipeline report here without a field threaded through
//! every configuration a run is built from, and a run outside any scope (`outboxd run`, the
//! tests) reports nowhere.

use std::future::Future;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};

/// Where a run is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// Connecting, checking, taking the lease.
    Starting,
    /// Another relay holds the lease; this one waits for it.
    Standby,
    /// Holds the lease (or needs none) and publishes.
    Running,
}

/// What a publishing run can be asked while it runs.
pub(crate) trait Counts: Send + Sync {
    /// Events handed to the sink (republishes included).
    fn published(&self) -> u64;
    /// Events the sink confirmed.
    fn confirmed(&self) -> u64;
    /// The newest position the relay acknowledged (every event before it confirmed), as text.
    fn position(&self) -> Option<String>;
}

/// One run's state, shared between the run and whoever watches it.
#[derive(Default)]
pub(crate) struct Live {
    phase: AtomicU8,
    holder: Mutex<Option<String>>,
    counts: Mutex<Option<Arc<dyn Counts>>>,
}

impl std::fmt::Debug for Live {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Live")
            .field("phase", &self.phase())
            .finish_non_exhaustive()
    }
}

impl Live {
    pub(crate) fn phase(&self) -> Phase {
        match self.phase.load(Ordering::Relaxed) {
            1 => Phase::Standby,
            2 => Phase::Running,
            _ => Phase::Starting,
        }
    }

    /// The lease holder a standby waits for.
    pub(crate) fn holder(&self) -> Option<String> {
        lock(&self.holder).clone()
    }

    /// The running relay's counts (none before it runs).
    pub(crate) fn counts(&self) -> Option<Arc<dyn Counts>> {
        lock(&self.counts).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A panic while holding one of these plain assignments leaves nothing half-written.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

tokio::task_local! {
    static CURRENT: Arc<Live>;
}

/// Runs `run` with `live` as the place it reports to.
pub(crate) async fn scope<F: Future>(live: Arc<Live>, run: F) -> F::Output {
    CURRENT.scope(live, run).await
}

/// The run waits as a standby for the lease `holder` holds.
pub(crate) fn standby(holder: &str) {
    let _ = CURRENT.try_with(|l| {
        l.phase.store(1, Ordering::Relaxed);
        *lock(&l.holder) = Some(holder.to_string());
    });
}

/// The run publishes; `counts` answers for it from now on.
pub(crate) fn running(counts: Arc<dyn Counts>) {
    let _ = CURRENT.try_with(|l| {
        l.phase.store(2, Ordering::Relaxed);
        *lock(&l.holder) = None;
        *lock(&l.counts) = Some(counts);
    });
}
