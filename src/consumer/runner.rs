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
//!   missing) is no message's fault: it halts whatever the policy.
//! - **Broker loss.** The loop reconnects with backoff; unacked messages come again.
//! - **Shutdown.** When the token is cancelled the consumer is cancelled at the broker, each
//!   worker finishes the message in hand (commit, ack), messages not yet started go back to
//!   the queue when the channel closes, and `run` returns.

use super::{Claim, ConsumerError, Message};
use crate::backoff::Backoff;
use crate::dsn::redact;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::protocol::AMQPErrorKind;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::Acker;
use lapin::{BasicProperties, Channel, Confirmation, Connection};
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// One message, one transaction. Implemented by [`super::postgres::PgProcessor`] and
/// [`super::mysql::MyProcessor`]; implement it directly for other stores.
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

/// What happens to a message that failed `max_failures` times (`--on-poison`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnPoison {
    /// Stop the consumer, leaving the message in the queue (an operator fixes the cause).
    #[default]
    Halt,
    /// Move it to `<queue>.dead` with the error in headers, then ack it.
    Park,
    /// Log it and ack it: its effect never happens.
    Skip,
}

/// The queue to declare and bind when the consumer owns its topology (`--bind`).
#[derive(Debug, Clone)]
pub struct Declare {
    /// The relay's exchange (`--exchange`); it must exist (the relay declares it).
    pub exchange: String,
    /// Routing-key patterns bound to the queue (`invoice.#`).
    pub bindings: Vec<String>,
    /// Declare the queue with `x-single-active-consumer` (ordered consumption).
    pub single_active: bool,
}

#[derive(Clone)]
pub struct RunnerOptions {
    /// `amqp://user:pass@host:5672/vhost`: never logged unredacted.
    pub broker: String,
    pub queue: String,
    pub prefetch: u16,
    /// Failures (non-retryable errors) before `on_poison` applies.
    pub max_failures: u32,
    pub on_poison: OnPoison,
    /// In-place retry backoff: first delay and cap.
    pub retry_min: Duration,
    pub retry_max: Duration,
    pub declare: Option<Declare>,
    /// Stop (gracefully) once the queue has nothing ready and nothing is in hand: for batch
    /// runs, drains and benchmarks.
    pub until_empty: bool,
    /// Most messages a worker commits in one transaction (of those already delivered; it
    /// never waits to fill a batch). 1 = a transaction per message.
    pub batch_size: usize,
    /// Shown in the broker's connection list.
    pub connection_name: String,
}

impl std::fmt::Debug for RunnerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunnerOptions")
            .field("broker", &redact(&self.broker))
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("max_failures", &self.max_failures)
            .field("on_poison", &self.on_poison)
            .field("declare", &self.declare)
            .field("until_empty", &self.until_empty)
            .field("batch_size", &self.batch_size)
            .finish()
    }
}

impl RunnerOptions {
    pub fn new(broker: &str, queue: &str) -> RunnerOptions {
        RunnerOptions {
            broker: broker.to_string(),
            queue: queue.to_string(),
            prefetch: 64,
            max_failures: 5,
            on_poison: OnPoison::Halt,
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(30),
            declare: None,
            until_empty: false,
            batch_size: 1,
            connection_name: format!("outboxd consumer {queue}"),
        }
    }

    /// `<queue>.dead`, where `park` puts poison messages.
    pub fn dead_queue(&self) -> String {
        format!("{}.dead", self.queue)
    }
}

/// Counters of one runner (shared with the caller while it runs).
#[derive(Debug, Default)]
pub struct Stats {
    pub applied: AtomicU64,
    pub duplicates: AtomicU64,
    pub stale: AtomicU64,
    /// Attempts that failed with a retryable error.
    pub retries: AtomicU64,
    /// Attempts that failed with a non-retryable error.
    pub failures: AtomicU64,
    pub parked: AtomicU64,
    pub skipped: AtomicU64,
    /// Acks that could not be sent (channel gone): those messages come again.
    pub acks_lost: AtomicU64,
}

impl Stats {
    /// Messages settled (acked after commit, parked or skipped).
    pub fn settled(&self) -> u64 {
        [
            &self.applied,
            &self.duplicates,
            &self.stale,
            &self.parked,
            &self.skipped,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }

    pub fn json(&self) -> serde_json::Value {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "applied": g(&self.applied),
            "duplicates": g(&self.duplicates),
            "stale": g(&self.stale),
            "retries": g(&self.retries),
            "failures": g(&self.failures),
            "parked": g(&self.parked),
            "skipped": g(&self.skipped),
            "acks_lost": g(&self.acks_lost),
        })
    }
}

/// Called after a message's transaction committed and before its ack (metrics, tests).
pub type CommitHook = Arc<dyn Fn(&Message, &Claim<()>) + Send + Sync>;

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

/// One broker connection: the consuming channel, and the confirm-mode channel `park`
/// publishes on (one publish at a time, so a `basic.return` belongs to that publish).
struct Session {
    conn: Connection,
    channel: Channel,
    /// For `until_empty`: passive declarations of the queue (a failed one closes its channel,
    /// which must not be the consuming one).
    probe: Option<Channel>,
    park: tokio::sync::Mutex<Option<Channel>>,
    tag: String,
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
            // Bounded: a broker that accepts the connection and then stops answering must not
            // hold the consumer forever.
            let opened = match tokio::time::timeout(SESSION_TIMEOUT, open_session(&self.opts)).await
            {
                Ok(r) => r,
                Err(_) => Err(ConsumerError::Broker {
                    message: format!("opening the session took longer than {SESSION_TIMEOUT:?}"),
                    retryable: true,
                }),
            };
            match opened {
                Ok((session, consumer)) => {
                    backoff.reset();
                    tracing::info!(queue = %self.opts.queue, prefetch = self.opts.prefetch, workers = senders.len(), "consuming");
                    let session = Arc::new(session);
                    last = Some(session.clone());
                    if let Err(e) = dispatch(&session, consumer, &senders, &shared).await {
                        tracing::warn!(error = %e, "broker connection lost; reconnecting (unacked messages come again)");
                    }
                }
                Err(e) if !e.is_retryable() => shared.halt(e),
                Err(e) => tracing::warn!(error = %e, "cannot consume yet; retrying"),
            }
            if shared.stop.is_cancelled() {
                break;
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff.next_delay()) => {}
                _ = shared.stop.cancelled() => {}
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

/// Connecting, declaring and starting the consumer together take at most this long.
const SESSION_TIMEOUT: Duration = Duration::from_secs(60);

/// Connects to the broker, read as the relay's sink reads its URL (`crate::amqp`): the host
/// as written, an empty vhost for the default one, and for `amqps://` the CA and client
/// certificate files RabbitMQ's URI parameters name (`cacertfile`, `certfile`, `keyfile`).
pub async fn connect_broker(url: &str, name: &str) -> Result<Connection, ConsumerError> {
    let ep = crate::amqp::Endpoint::parse(
        url,
        "the broker URL",
        crate::amqp::TlsFiles::default(),
        "cacertfile/certfile/keyfile",
    )
    .map_err(|e| match e {
        crate::Error::Config { problem, fix } => ConsumerError::config(problem, fix),
        other => ConsumerError::config(
            other.to_string(),
            "use amqp://user@host:5672/vhost (amqps:// for TLS)",
        ),
    })?;
    let redacted = &ep.redacted;
    match tokio::time::timeout(Duration::from_secs(30), ep.connect(name)).await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(crate::amqp::ConnectError::Login { message, .. })) => Err(ConsumerError::config(
            format!("RabbitMQ refused the login at {redacted}: {message}"),
            "check the user, password and vhost of the broker URL",
        )),
        Ok(Err(crate::amqp::ConnectError::Tls(io))) => Err(ConsumerError::config(
            format!("TLS with RabbitMQ at {redacted} failed: {io}"),
            "check cacertfile (the CA that signed the broker's certificate), certfile/keyfile, and that the host name in the broker URL matches the certificate",
        )),
        Ok(Err(e)) => Err(ConsumerError::Broker {
            message: format!("cannot connect to {redacted}: {e}"),
            retryable: true,
        }),
        Err(_) => Err(ConsumerError::Broker {
            message: format!("no connection to {redacted} within 30s"),
            retryable: true,
        }),
    }
}

/// A refused declaration is a setup problem; anything else is the connection.
fn declare_error(e: lapin::Error, what: &str, fix: &str) -> ConsumerError {
    if let lapin::ErrorKind::ProtocolError(p) = e.kind() {
        if let AMQPErrorKind::Soft(_) = p.kind() {
            return ConsumerError::config(format!("{what}: {}", p.get_message()), fix);
        }
    }
    ConsumerError::from(e)
}

async fn open_session(opts: &RunnerOptions) -> Result<(Session, lapin::Consumer), ConsumerError> {
    let conn = connect_broker(&opts.broker, &opts.connection_name).await?;
    let q = &opts.queue;
    // Declarations on their own channel: a refused one closes it.
    let setup = conn.create_channel().await?;
    match &opts.declare {
        Some(d) => {
            setup
                .exchange_declare(
                    d.exchange.clone().into(),
                    lapin::ExchangeKind::Topic,
                    ExchangeDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    declare_error(
                        e,
                        &format!("exchange {:?} is not there", d.exchange),
                        "start the relay first (it declares its --exchange), or give the right --exchange",
                    )
                })?;
            let mut args = FieldTable::default();
            if d.single_active {
                args.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
            }
            setup
                .queue_declare(
                    q.clone().into(),
                    QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    args,
                )
                .await
                .map_err(|e| {
                    declare_error(
                        e,
                        &format!("cannot declare queue {q:?}"),
                        "a queue of that name exists with other arguments (x-single-active-consumer?): use it as it is (drop --bind) or another --queue",
                    )
                })?;
            for pattern in &d.bindings {
                setup
                    .queue_bind(
                        q.clone().into(),
                        d.exchange.clone().into(),
                        pattern.clone().into(),
                        QueueBindOptions::default(),
                        FieldTable::default(),
                    )
                    .await
                    .map_err(|e| {
                        declare_error(e, &format!("cannot bind {q:?}"), "check permissions")
                    })?;
            }
        }
        None => {
            setup
                .queue_declare(
                    q.clone().into(),
                    QueueDeclareOptions {
                        passive: true,
                        ..Default::default()
                    },
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    declare_error(
                        e,
                        &format!("queue {q:?} does not exist"),
                        "declare it (e.g. outboxd topology), or let the consumer declare and bind it: --exchange outbox --bind 'invoice.#'",
                    )
                })?;
        }
    }
    let park = if opts.on_poison == OnPoison::Park {
        let dead = opts.dead_queue();
        setup
            .queue_declare(
                dead.clone().into(),
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|e| {
                declare_error(
                    e,
                    &format!("cannot declare the poison queue {dead:?}"),
                    "grant configure permission on it, or use --on-poison halt|skip",
                )
            })?;
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        Some(ch)
    } else {
        None
    };
    let _ = setup.close(200, "OK".into()).await;

    let channel = conn.create_channel().await?;
    channel
        .basic_qos(opts.prefetch, BasicQosOptions::default())
        .await?;
    let tag = format!(
        "{}-{}",
        opts.connection_name.replace(' ', "-"),
        uuid::Uuid::new_v4().simple()
    );
    let consumer = channel
        .basic_consume(
            q.clone().into(),
            tag.clone().into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            declare_error(
                e,
                &format!("cannot consume from {q:?}"),
                "check the user's read permission on the queue",
            )
        })?;
    let probe = if opts.until_empty {
        Some(conn.create_channel().await?)
    } else {
        None
    };
    Ok((
        Session {
            conn,
            channel,
            probe,
            park: tokio::sync::Mutex::new(park),
            tag,
        },
        consumer,
    ))
}

/// Hands deliveries to workers until the stream fails (`Err`) or the runner stops (`Ok`, after
/// cancelling the consumer so the broker sends nothing more).
async fn dispatch(
    session: &Arc<Session>,
    mut consumer: lapin::Consumer,
    workers: &[mpsc::Sender<Job>],
    shared: &Shared,
) -> Result<(), ConsumerError> {
    let mut probe = tokio::time::interval(Duration::from_millis(100));
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let next = tokio::select! {
            d = consumer.next() => d,
            _ = probe.tick(), if session.probe.is_some() => {
                if queue_drained(session, shared).await? {
                    tracing::info!(queue = %shared.opts.queue, "the queue is empty and nothing is in hand: stopping (--until-empty)");
                    shared.stop.cancel();
                }
                continue;
            }
            _ = shared.stop.cancelled() => {
                let _ = tokio::time::timeout(
                    ACK_TIMEOUT,
                    session
                        .channel
                        .basic_cancel(session.tag.clone().into(), BasicCancelOptions::default()),
                )
                .await;
                return Ok(());
            }
        };
        let d = match next {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(e.into()),
            None => {
                return Err(ConsumerError::Broker {
                    message: "the broker ended the consumer (queue deleted?)".into(),
                    retryable: true,
                })
            }
        };
        let idx = if workers.len() == 1 {
            0
        } else {
            worker_for(&d.properties, workers.len())
        };
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        let job = Job {
            exchange: d.exchange.to_string(),
            routing_key: d.routing_key.to_string(),
            redelivered: d.redelivered,
            properties: d.properties,
            body: d.data,
            acker: d.acker,
            session: session.clone(),
        };
        tokio::select! {
            r = workers[idx].send(job) => {
                if r.is_err() {
                    // Workers end only when the runner stops; otherwise one panicked.
                    if !shared.stop.is_cancelled() {
                        shared.halt(ConsumerError::Handler {
                            message: "a consumer worker ended unexpectedly".into(),
                            retryable: false,
                        });
                    }
                    return Ok(());
                }
            }
            _ = shared.stop.cancelled() => {}
        }
    }
}

/// Whether nothing is in hand and the queue has nothing ready (checked in that order, so a
/// delivery that arrives in between is not missed).
async fn queue_drained(session: &Session, shared: &Shared) -> Result<bool, ConsumerError> {
    let Some(ch) = &session.probe else {
        return Ok(false);
    };
    if shared.in_flight.load(Ordering::SeqCst) != 0 {
        return Ok(false);
    }
    let q = ch
        .queue_declare(
            shared.opts.queue.clone().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
    Ok(q.message_count() == 0 && shared.in_flight.load(Ordering::SeqCst) == 0)
}

/// The worker for a delivery: by aggregate (per-aggregate order), else by message id.
fn worker_for(props: &BasicProperties, n: usize) -> usize {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let agg = props
        .headers()
        .as_ref()
        .and_then(|t| t.inner().get("x-aggregate-id").cloned());
    match agg {
        Some(AMQPValue::LongString(s)) => s.as_bytes().hash(&mut h),
        Some(AMQPValue::ShortString(s)) => s.as_str().as_bytes().hash(&mut h),
        _ => props
            .message_id()
            .as_ref()
            .map(|s| s.as_str().to_string())
            .hash(&mut h),
    }
    (h.finish() % n as u64) as usize
}

fn parse(job: &Job) -> Result<Message, ConsumerError> {
    Message::from_parts(
        &job.exchange,
        &job.routing_key,
        job.redelivered,
        job.properties.clone(),
        job.body.clone(),
    )
}

async fn worker<P: Processor>(mut p: P, mut rx: mpsc::Receiver<Job>, shared: Arc<Shared>) {
    let max = shared.opts.batch_size.max(1);
    let mut pending: std::collections::VecDeque<Job> = std::collections::VecDeque::new();
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
        // The longest run of readable messages at the front makes the batch; an unreadable
        // one goes alone (to the poison path).
        let mut jobs = Vec::new();
        let mut msgs = Vec::new();
        if max > 1 && !alone {
            while jobs.len() < max {
                let Some(Ok(m)) = pending.front().map(parse) else {
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

/// After the commit: the hook, the counters, the ack.
async fn settle(job: &Job, msg: &Message, claim: &Claim<()>, shared: &Shared) {
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
    ack(job, &msg.id.to_string(), stats).await;
}

async fn handle<P: Processor>(p: &mut P, job: Job, shared: &Shared) {
    let opts = &shared.opts;
    let stats = &shared.stats;
    let msg = match parse(&job) {
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
        if job.acker.poisoned() {
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
const ACK_TIMEOUT: Duration = Duration::from_secs(5);

async fn ack(job: &Job, id: &str, stats: &Stats) {
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

async fn poison(job: &Job, id: &str, error: &ConsumerError, failures: u32, shared: &Shared) {
    let stats = &shared.stats;
    match shared.opts.on_poison {
        OnPoison::Halt => {
            tracing::error!(id, failures, error = %error, "poison message: halting (--on-poison halt); it stays in the queue");
            shared.halt(ConsumerError::Halted {
                id: id.to_string(),
                error: error.to_string(),
            });
        }
        OnPoison::Skip => {
            tracing::error!(id, failures, error = %error, "poison message: skipped (--on-poison skip); its effect never happens");
            stats.skipped.fetch_add(1, Ordering::Relaxed);
            ack(job, id, stats).await;
        }
        OnPoison::Park => {
            let dead = shared.opts.dead_queue();
            let mut backoff = Backoff::new(shared.opts.retry_min, shared.opts.retry_max);
            loop {
                match park(job, &dead, error, failures, &shared.opts.queue).await {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::warn!(id, error = %e, queue = %dead, "cannot park the message yet");
                        if job.acker.poisoned() {
                            return;
                        }
                    }
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff.next_delay()) => {}
                    _ = shared.stop.cancelled() => return,
                }
            }
            tracing::error!(id, failures, error = %error, queue = %dead, "poison message parked");
            stats.parked.fetch_add(1, Ordering::Relaxed);
            ack(job, id, stats).await;
        }
    }
}

/// A parked message not confirmed within this is published again (the ack waits).
const PARK_TIMEOUT: Duration = Duration::from_secs(30);

/// Header values stay below this, so a parked message always fits its frame.
const ERROR_HEADER_MAX: usize = 1024;

/// Publishes the message, body and properties intact, to `<queue>.dead` through the default
/// exchange, with why and where from in `x-outboxd-*` headers; done when the broker confirmed
/// it (and did not return it).
async fn park(
    job: &Job,
    dead: &str,
    error: &ConsumerError,
    failures: u32,
    queue: &str,
) -> Result<(), ConsumerError> {
    let mut text = error.to_string();
    if text.len() > ERROR_HEADER_MAX {
        let mut end = ERROR_HEADER_MAX;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    let mut headers = job.properties.headers().clone().unwrap_or_default();
    let s = |v: &str| AMQPValue::LongString(v.into());
    headers.insert("x-outboxd-error".into(), s(&text));
    headers.insert(
        "x-outboxd-failures".into(),
        AMQPValue::LongLongInt(failures.into()),
    );
    headers.insert("x-outboxd-queue".into(), s(queue));
    headers.insert("x-outboxd-exchange".into(), s(&job.exchange));
    headers.insert("x-outboxd-routing-key".into(), s(&job.routing_key));
    headers.insert(
        "x-outboxd-parked-at".into(),
        s(&chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
    );
    let props = job
        .properties
        .clone()
        .with_headers(headers)
        .with_delivery_mode(2);
    let guard = job.session.park.lock().await;
    let Some(ch) = guard.as_ref() else {
        return Err(ConsumerError::config(
            "no poison queue channel",
            "this is a bug: --on-poison park opens one",
        ));
    };
    let publish = ch.basic_publish(
        ShortString::from(""),
        dead.to_string().into(),
        BasicPublishOptions {
            mandatory: true,
            immediate: false,
        },
        &job.body,
        props,
    );
    let confirm = match tokio::time::timeout(PARK_TIMEOUT, async { publish.await?.await }).await {
        Ok(r) => r?,
        Err(_) => {
            return Err(ConsumerError::Broker {
                message: format!("no confirmation of the parked message within {PARK_TIMEOUT:?}"),
                retryable: true,
            })
        }
    };
    match confirm {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(ConsumerError::Broker {
            message: format!("the broker returned the parked message: queue {dead:?} is missing"),
            retryable: true,
        }),
        other => Err(ConsumerError::Broker {
            message: format!("the broker did not take the parked message: {other:?}"),
            retryable: true,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_aggregate_same_worker() {
        let props = |agg: &str, id: &str| {
            let mut t = FieldTable::default();
            t.insert("x-aggregate-id".into(), AMQPValue::LongString(agg.into()));
            BasicProperties::default()
                .with_message_id(id.into())
                .with_headers(t)
        };
        for n in [2, 3, 8] {
            let a = worker_for(&props("cust-1", "a"), n);
            for id in ["b", "c", "d", "e"] {
                assert_eq!(worker_for(&props("cust-1", id), n), a);
            }
        }
        let spread: std::collections::HashSet<usize> = (0..64)
            .map(|i| worker_for(&props(&format!("cust-{i}"), "x"), 4))
            .collect();
        assert_eq!(spread.len(), 4);
    }

    #[test]
    fn options_hide_the_password() {
        let o = RunnerOptions::new("amqp://u:secret@127.0.0.1/", "q");
        assert!(!format!("{o:?}").contains("secret"));
        assert_eq!(o.dead_queue(), "q.dead");
    }
}
