//! One worker: it takes deliveries from its channel, forms batches of the messages already
//! delivered (`--batch-size`), runs them through its [`Processor`], retries a failing message
//! alone and in place (so nothing overtakes it), and after each commit runs the hook, counts
//! and settles the delivery. What to do once a message has failed too often is
//! [`super::poison`]'s. Written once over [`Delivered`], which an AMQP delivery (settled by its
//! ack) and a stream message (settled by recording its offset as processed) implement.

use super::options::{RunnerOptions, Stats};
use super::poison::poison;
use super::{BatchResult, Job, Processor, Shared};
use crate::backoff::Backoff;
use crate::consumer::{Claim, ConsumerError, Message};
use futures::FutureExt;
use lapin::options::BasicAckOptions;
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// A delivery as a worker sees it: the message to process, and how to settle it.
pub(super) trait Delivered: Send + Sync + 'static {
    /// The message, or why its envelope is unusable ([`ConsumerError::BadMessage`]).
    fn message(&self) -> Result<Message, ConsumerError>;
    /// The session it came on is gone and it will come again: not to be processed here (an
    /// AMQP delivery of a closed channel, which the broker redelivers in queue order).
    fn gone(&self) -> bool;
    /// After its commit, or once skipped or parked: ack it, or record its offset.
    fn settle(&self, id: &str, stats: &Stats) -> impl Future<Output = ()> + Send;
    /// Where `--on-poison park` puts it.
    fn dead_target(&self, opts: &RunnerOptions) -> String;
    /// Copies it, with why it is parked, to [`Delivered::dead_target`]; `Ok` once the broker
    /// confirmed the copy.
    fn park(
        &self,
        error: &ConsumerError,
        failures: u32,
        opts: &RunnerOptions,
    ) -> impl Future<Output = Result<(), ConsumerError>> + Send;
}

impl Delivered for Job {
    fn message(&self) -> Result<Message, ConsumerError> {
        Message::from_parts(
            &self.exchange,
            &self.routing_key,
            self.redelivered,
            self.properties.clone(),
            self.body.clone(),
        )
    }

    fn gone(&self) -> bool {
        self.acker.poisoned()
    }

    async fn settle(&self, id: &str, stats: &Stats) {
        ack(self, id, stats).await
    }

    fn dead_target(&self, opts: &RunnerOptions) -> String {
        opts.dead_queue()
    }

    async fn park(
        &self,
        error: &ConsumerError,
        failures: u32,
        opts: &RunnerOptions,
    ) -> Result<(), ConsumerError> {
        super::poison::park(self, &opts.dead_queue(), error, failures, &opts.queue).await
    }
}

pub(super) async fn worker<P: Processor, J: Delivered>(
    mut p: P,
    mut rx: mpsc::Receiver<J>,
    shared: Arc<Shared>,
) {
    let max = shared.opts.batch_size.max(1);
    let mut pending: std::collections::VecDeque<J> = std::collections::VecDeque::new();
    // The next message goes alone: it stopped a batch.
    let mut alone = false;
    loop {
        if pending.is_empty() {
            match rx.recv().await {
                Some(j) => pending.push_back(j),
                None => break,
            }
        }
        // Stopping: what is not in hand yet stays unacked and goes back to the queue.
        if shared.stop.is_cancelled() {
            shared
                .in_flight
                .fetch_sub(pending.len() as u64, Ordering::SeqCst);
            pending.clear();
            continue;
        }
        while pending.len() < max {
            match rx.try_recv() {
                Ok(j) => pending.push_back(j),
                Err(_) => break,
            }
        }
        drop_dead(&mut pending, &shared);
        if pending.is_empty() {
            continue;
        }
        // The longest run of readable messages at the front makes the batch; an unreadable
        // one goes alone (to the poison path).
        let mut jobs = Vec::new();
        let mut msgs = Vec::new();
        if max > 1 && !alone {
            while jobs.len() < max {
                let Some(Ok(m)) = pending.front().map(J::message) else {
                    break;
                };
                msgs.push(m);
                jobs.extend(pending.pop_front());
            }
        }
        alone = false;
        if jobs.len() <= 1 {
            let job = match jobs.pop() {
                Some(j) => j,
                None => match pending.pop_front() {
                    Some(j) => j,
                    None => continue,
                },
            };
            handle(&mut p, job, &shared).await;
            shared.in_flight.fetch_sub(1, Ordering::SeqCst);
            continue;
        }
        let result = match std::panic::AssertUnwindSafe(p.process_batch(&msgs))
            .catch_unwind()
            .await
        {
            Ok(r) => r,
            Err(panic) => BatchResult {
                committed: Vec::new(),
                failed: Some(panicked(panic)),
            },
        };
        let done = result.committed.len().min(jobs.len());
        for ((job, msg), claim) in jobs.iter().zip(&msgs).zip(&result.committed) {
            settle(job, msg, claim, &shared).await;
        }
        shared.in_flight.fetch_sub(done as u64, Ordering::SeqCst);
        if done < jobs.len() {
            if let (Some(m), Some(e)) = (msgs.get(done), &result.failed) {
                tracing::debug!(id = %m.id, error = %e, "batch stopped here; retrying this message alone");
            }
            for job in jobs.into_iter().skip(done).rev() {
                pending.push_front(job);
            }
            alone = true;
        }
    }
}

/// Drops the deliveries whose channel is gone, unprocessed. The broker redelivers every
/// unacked message of a dead channel, in queue order, on the next session; processing these
/// copies now would let them overtake an earlier message of the same session that is to come
/// again (one given up while retrying in place), and with the stale gate that earlier message
/// would then be dropped as stale. All deliveries of one channel share its poison flag, so once
/// the retried message saw the channel die, every later delivery of it is dropped here.
fn drop_dead<J: Delivered>(pending: &mut std::collections::VecDeque<J>, shared: &Shared) {
    let before = pending.len();
    pending.retain(|j| !j.gone());
    let dropped = (before - pending.len()) as u64;
    if dropped > 0 {
        shared.in_flight.fetch_sub(dropped, Ordering::SeqCst);
        shared.stats.abandoned.fetch_add(dropped, Ordering::Relaxed);
        tracing::info!(
            dropped,
            "channel closed: its queued deliveries are dropped unprocessed (the broker redelivers them in order)"
        );
    }
}

/// A handler that panicked failed its message (the transaction was dropped, so rolled back):
/// the panic counts towards `--max-failures` instead of taking the worker down.
fn panicked(panic: Box<dyn std::any::Any + Send>) -> ConsumerError {
    let what = panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into());
    ConsumerError::Handler {
        message: format!("panicked: {what}"),
        retryable: false,
    }
}

/// After the commit: the hook, the counters, the ack (or the offset).
async fn settle<J: Delivered>(job: &J, msg: &Message, claim: &Claim<()>, shared: &Shared) {
    if let Some(hook) = &shared.on_commit {
        hook(msg, claim);
    }
    let stats = &shared.stats;
    let counter = match claim {
        Claim::Applied(()) => &stats.applied,
        Claim::Duplicate => &stats.duplicates,
        Claim::Stale { .. } => &stats.stale,
    };
    counter.fetch_add(1, Ordering::Relaxed);
    tracing::debug!(id = %msg.id, outcome = claim.kind(), redelivered = msg.redelivered, "committed");
    job.settle(&msg.id.to_string(), stats).await;
}

async fn handle<P: Processor, J: Delivered>(p: &mut P, job: J, shared: &Shared) {
    let opts = &shared.opts;
    let stats = &shared.stats;
    let msg = match job.message() {
        Ok(m) => m,
        Err(e) => return poison(&job, "<no id>", &e, 1, shared).await,
    };
    let mut failures = 0u32;
    let mut backoff = Backoff::new(opts.retry_min, opts.retry_max);
    loop {
        let outcome = match std::panic::AssertUnwindSafe(p.process(&msg))
            .catch_unwind()
            .await
        {
            Ok(r) => r,
            Err(panic) => Err(panicked(panic)),
        };
        match outcome {
            Ok(claim) => return settle(&job, &msg, &claim, shared).await,
            Err(e @ ConsumerError::Config { .. }) => {
                tracing::error!(id = %msg.id, error = %e, "configuration error: stopping (the message stays in the queue)");
                shared.halt(e);
                return;
            }
            Err(e) if e.is_retryable() => {
                stats.retries.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(id = %msg.id, error = %e, "retryable failure; retrying in place");
            }
            Err(e) => {
                failures += 1;
                stats.failures.fetch_add(1, Ordering::Relaxed);
                if failures >= opts.max_failures {
                    return poison(&job, &msg.id.to_string(), &e, failures, shared).await;
                }
                tracing::warn!(id = %msg.id, failures, max = opts.max_failures, error = %e, "message failed; retrying in place");
            }
        }
        // A delivery whose channel is gone will come again (to us after the reconnect, or to
        // another consumer): retrying this copy would only race that one.
        if job.gone() {
            tracing::info!(id = %msg.id, "channel closed while retrying; the broker redelivers the message");
            return;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = shared.stop.cancelled() => {
                tracing::info!(id = %msg.id, "stopping while retrying: the message stays in the queue");
                return;
            }
        }
    }
}

/// An ack is handed to the connection's I/O loop; when the connection dies at that moment
/// the promise may never resolve, so it is bounded.
pub(super) const ACK_TIMEOUT: Duration = Duration::from_secs(5);

pub(super) async fn ack(job: &Job, id: &str, stats: &Stats) {
    match tokio::time::timeout(ACK_TIMEOUT, job.acker.ack(BasicAckOptions::default())).await {
        Ok(Ok(true)) => {}
        Ok(Ok(false) | Err(_)) | Err(_) => {
            stats.acks_lost.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                id,
                "ack not sent (channel gone): the message comes again and is a duplicate"
            );
        }
    }
}
