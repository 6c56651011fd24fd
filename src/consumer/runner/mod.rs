//! The RabbitMQ consumer loop. It takes deliveries from one queue, hands each to a
//! [`Processor`] (one database transaction: claim, effect, commit) and acks only after the
//! commit. A crash between commit and ack is harmless: the broker redelivers, and the claim
//! makes the repeat a duplicate.
//!
//! - **Prefetch** (`basic.qos`) bounds the unacked messages the broker sends ahead.
//! - **Order.** A failing message is retried *in place* with capped exponential backoff: the
//!   worker holds it unacked and takes nothing else meanwhile, so on a single-active-consumer
//!   queue nothing overtakes it. (A requeue would put it back at the head of a classic queue
//!   anyway, and behind later messages on a quorum queue.) With `concurrency > 1` messages are
//!   spread over workers by `x-aggregate-id`, so each aggregate's events still go through one
//!   worker in queue order.
//! - **Failures.** Retryable errors (deadlocks, a lost database connection, a handler's
//!   [`ConsumerError::transient`]) are retried without limit. Other errors count; after
//!   `max_failures` of them `on_poison` decides: `halt` stops the consumer with the message
//!   unacked, `park` publishes it with the error to `<queue>.dead` (with a publisher
//!   confirm) and then acks, `skip` logs and acks. A message without a usable envelope (no
//!   UUID `message_id`) is poison at once. A configuration error (say, the inbox table is
//!   missing, a privilege revoked or a column renamed: `consumer::fault`) is no message's
//!   fault: it halts whatever the policy. A database that cannot take writes (a read-only
//!   standby after a failover) is retried like a lost connection.
//! - **Broker loss.** The loop reconnects with backoff; unacked messages come again, in queue
//!   order. Deliveries of the dead channel still queued in a worker are dropped unprocessed
//!   (they are among those redelivered, behind any message given up mid-retry), so nothing
//!   overtakes the retried message.
//! - **Shutdown.** When the token is cancelled the consumer is cancelled at the broker, each
//!   worker finishes the message in hand (commit, ack), messages not yet started go back to
//!   the queue when the channel closes, and `run` returns.
//! - **Until empty.** Once the queue has nothing ready and nothing is in hand, the consumer is
//!   cancelled at the broker and what it had already sent (counted by the broker as unacked,
//!   not ready) is processed and acked before the runner stops.
//!
//! The files: [`options`] (what the loop is told and what it counts), `amqp` (the broker
//! session: connect, declare, consume, hand out deliveries), `worker` (one message or batch at
//! a time: process, retry in place, settle and ack) and `poison` (halt, skip or park a message
//! that keeps failing).

mod amqp;
pub mod options;
mod poison;
#[cfg(feature = "rabbitmq-stream")]
mod stream;
mod worker;

pub use amqp::connect_broker;
pub use options::{Declare, OnPoison, RunnerOptions, Stats, StreamOptions, StreamStart};

use super::{Claim, ConsumerError, Message};
use crate::backoff::Backoff;
use amqp::{dispatch, open_session, Session, SESSION_TIMEOUT};
use lapin::Acker;
use lapin::BasicProperties;
use std::future::Future;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use worker::{worker, ACK_TIMEOUT};

/// One message, one transaction. Implemented by [`super::InboxProcessor`] for every
/// [`super::Database`]; implement it directly for other stores.
///
/// `process` returns once the transaction committed (then the runner acks) or with the error
/// that rolled it back (then nothing was done, and the runner retries or gives up).
pub trait Processor: Send + 'static {
    fn process(
        &mut self,
        msg: &Message,
    ) -> impl Future<Output = Result<Claim<()>, ConsumerError>> + Send;

    /// Several messages, in order, as few transactions as possible (`--batch-size`): one
    /// commit's flush shared by many messages. The result says how many *leading* messages are
    /// committed, and why the next one stopped the batch; the runner acks the committed ones
    /// and retries the stopping message alone, so a failure never lets a later message overtake
    /// an earlier one. The default runs [`Processor::process`] message by message.
    fn process_batch(&mut self, msgs: &[Message]) -> impl Future<Output = BatchResult> + Send
    where
        Self: Sized,
    {
        async move {
            let mut committed = Vec::with_capacity(msgs.len());
            for m in msgs {
                match self.process(m).await {
                    Ok(c) => committed.push(c),
                    Err(e) => {
                        return BatchResult {
                            committed,
                            failed: Some(e),
                        }
                    }
                }
            }
            BatchResult {
                committed,
                failed: None,
            }
        }
    }
}

/// What [`Processor::process_batch`] committed.
#[derive(Debug)]
pub struct BatchResult {
    /// Claims of the leading messages that are committed (`committed.len()` of them).
    pub committed: Vec<Claim<()>>,
    /// Why the message after them was not: it is retried alone.
    pub failed: Option<ConsumerError>,
}

/// Called after a message's transaction committed and before its ack (metrics, tests).
pub type CommitHook = Arc<dyn Fn(&Message, &Claim<()>) + Send + Sync>;

/// Opening a session, bounded by [`SESSION_TIMEOUT`]: a broker that accepts the connection and
/// then stops answering must not hold the consumer forever.
async fn bounded<T>(
    what: &str,
    open: impl Future<Output = Result<T, ConsumerError>>,
) -> Result<T, ConsumerError> {
    match tokio::time::timeout(SESSION_TIMEOUT, open).await {
        Ok(r) => r,
        Err(_) => Err(ConsumerError::Broker {
            message: format!("{what} took longer than {SESSION_TIMEOUT:?}"),
            retryable: true,
        }),
    }
}

/// The loop: `Runner::new(options, processors).run(shutdown)`. One worker per processor.
pub struct Runner<P> {
    opts: RunnerOptions,
    processors: Vec<P>,
    stats: Arc<Stats>,
    on_commit: Option<CommitHook>,
}

/// A delivery on its way to a worker.
struct Job {
    exchange: String,
    routing_key: String,
    redelivered: bool,
    properties: BasicProperties,
    body: Vec<u8>,
    acker: Acker,
    session: Arc<Session>,
}

/// What the workers share.
struct Shared {
    opts: RunnerOptions,
    stats: Arc<Stats>,
    on_commit: Option<CommitHook>,
    stop: CancellationToken,
    halted: Mutex<Option<ConsumerError>>,
    /// Deliveries received and not yet settled or abandoned (for `until_empty`).
    in_flight: AtomicU64,
}

impl Shared {
    /// A session could not be opened: a setup problem halts the runner, anything else is
    /// retried after the backoff.
    fn open_failed(&self, e: ConsumerError, source: &str) {
        if e.is_retryable() {
            tracing::warn!(source, error = %e, "cannot consume yet; retrying");
        } else {
            self.halt(e);
        }
    }

    /// Waits out the reconnect backoff; `false` when the runner is stopping instead.
    async fn pause(&self, backoff: &mut Backoff) -> bool {
        if self.stop.is_cancelled() {
            return false;
        }
        tokio::select! {
            _ = tokio::time::sleep(backoff.next_delay()) => {}
            _ = self.stop.cancelled() => {}
        }
        !self.stop.is_cancelled()
    }

    fn halt(&self, e: ConsumerError) {
        let mut h = self.halted.lock().unwrap_or_else(|p| p.into_inner());
        if h.is_none() {
            *h = Some(e);
        }
        self.stop.cancel();
    }
}

impl<P: Processor> Runner<P> {
    /// `processors.len()` is the concurrency (at least one).
    pub fn new(opts: RunnerOptions, processors: Vec<P>) -> Runner<P> {
        Runner {
            opts,
            processors,
            stats: Arc::new(Stats::default()),
            on_commit: None,
        }
    }

    pub fn on_commit(mut self, hook: CommitHook) -> Self {
        self.on_commit = Some(hook);
        self
    }

    pub fn stats(&self) -> Arc<Stats> {
        self.stats.clone()
    }

    /// Consumes until `shutdown` is cancelled (returns `Ok`) or a message halts it
    /// ([`ConsumerError::Halted`]) or the setup is wrong ([`ConsumerError::Config`]).
    pub async fn run(self, shutdown: CancellationToken) -> Result<(), ConsumerError> {
        if self.processors.is_empty() {
            return Err(ConsumerError::config(
                "a runner needs at least one processor",
                "pass one processor per concurrent worker",
            ));
        }
        if self.opts.max_failures == 0 {
            return Err(ConsumerError::config(
                "--max-failures 0 would give up before the first attempt",
                "use --max-failures 5",
            ));
        }
        if self.opts.is_stream() {
            #[cfg(feature = "rabbitmq-stream")]
            return stream::run(self, shutdown).await;
            #[cfg(not(feature = "rabbitmq-stream"))]
            return Err(ConsumerError::config(
                "the broker URL is a RabbitMQ stream, and this build has no stream client",
                "build with the rabbitmq-stream feature, or consume a queue (amqp://)",
            ));
        }
        let shared = Arc::new(Shared {
            opts: self.opts.clone(),
            stats: self.stats.clone(),
            on_commit: self.on_commit.clone(),
            stop: shutdown.child_token(),
            halted: Mutex::new(None),
            in_flight: AtomicU64::new(0),
        });
        let capacity = usize::from(self.opts.prefetch.max(1));
        let mut senders = Vec::new();
        let mut workers = Vec::new();
        for p in self.processors {
            let (tx, rx) = mpsc::channel(capacity);
            senders.push(tx);
            workers.push(tokio::spawn(worker(p, rx, shared.clone())));
        }

        let mut backoff = Backoff::new(self.opts.retry_min, self.opts.retry_max);
        let mut last: Option<Arc<Session>> = None;
        while !shared.stop.is_cancelled() {
            match bounded("opening the session", open_session(&self.opts)).await {
                Ok((session, consumer)) => {
                    backoff.reset();
                    tracing::info!(queue = %self.opts.queue, prefetch = self.opts.prefetch, workers = senders.len(), "consuming");
                    let session = Arc::new(session);
                    last = Some(session.clone());
                    if let Err(e) = dispatch(&session, consumer, &senders, &shared).await {
                        tracing::warn!(error = %e, "broker connection lost; reconnecting (unacked messages come again)");
                    }
                }
                Err(e) => shared.open_failed(e, &self.opts.queue),
            }
            if !shared.pause(&mut backoff).await {
                break;
            }
        }

        // Stop: no new deliveries (cancelled in `dispatch`); workers finish the message in
        // hand and skip the rest, which goes back to the queue when the channel closes.
        drop(senders);
        for w in workers {
            if let Err(e) = w.await {
                tracing::error!(error = %e, "a consumer worker panicked");
            }
        }
        if let Some(s) = last {
            let _ = tokio::time::timeout(ACK_TIMEOUT, async {
                let _ = s.channel.close(200, "OK".into()).await;
                let _ = s.conn.close(200, "OK".into()).await;
            })
            .await;
        }
        let halted = shared
            .halted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        match halted {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}
