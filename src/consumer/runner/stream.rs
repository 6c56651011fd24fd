//! The runner on a RabbitMQ stream (a `rabbitmq-stream://` broker URL): each stream (with
//! `--partitions N`, `<stream>-0` … `<stream>-<N-1>`) is read by one named consumer and
//! processed by one worker, in stream order, through the same worker, retry-in-place and
//! poison policy as a queue's deliveries ([`super::worker`]).
//!
//! - **Offsets on the server.** The consumer's name (`--consumer`) is its offset reference on
//!   every stream. On start it asks the broker for the stored offset (`query_offset`) and
//!   subscribes after it; with none stored it starts at `--stream-start` (first by default).
//!   The offset is stored *after* the inbox transaction committed — once `store_every`
//!   messages were settled since the last store, once `store_interval` passed, and at a
//!   graceful stop — never per message. A crash between a commit and the next store reads the
//!   messages after the stored offset again; their claims in `processed_messages` make them
//!   duplicates (counted in `duplicates`), so each effect still happens once. The re-read is at
//!   most what was settled since the last store: under `store_every` messages, fewer when the
//!   interval passes first.
//! - **Order.** One worker per stream takes messages in offset order; a failing message is
//!   retried in place and nothing behind it is processed meanwhile.
//! - **Broker loss.** A stream message stays valid when the connection that brought it dies,
//!   so the worker keeps what it holds (a message being retried keeps being retried). The
//!   reader reconnects with backoff and subscribes after the last offset it handed to the
//!   worker — the in-memory position, not the stored offset, which lags — and drops anything
//!   at or before it, so nothing is skipped, repeated or reordered.
//! - **Poison.** `park` copies the message, its application properties intact plus the
//!   `x-outboxd-*` reasons (with `x-outboxd-stream` and `x-outboxd-offset`), into the stream
//!   `<stream>.dead` (created when missing) and moves on only once the broker confirmed the
//!   copy; `skip` moves on; `halt` stops every reader with the offset before the message.
//! - **Until empty.** A reader with nothing in hand and nothing arriving looks at the stream's
//!   last chunk; once its own position is past that, it stops (after storing the offset).

use super::options::{OnPoison, RunnerOptions, Stats, StreamStart};
use super::poison::parked_headers;
use super::worker::{worker, Delivered, ACK_TIMEOUT};
use super::{bounded, Processor, Runner, Shared};
use crate::backoff::Backoff;
use crate::consumer::{ConsumerError, Message};
use crate::stream::{StreamEndpoint, BROKER};
use futures::StreamExt;
use lapin::types::AMQPValue;
use lapin::BasicProperties;
use rabbitmq_stream_client::error::{ClientError, ConsumerCreateError, StreamCreateError};
use rabbitmq_stream_client::types::{Message as StreamMessage, OffsetSpecification, ResponseCode};
use rabbitmq_stream_client::{Client, Consumer, Environment, NoDedup, Producer, TlsConfiguration};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// Where the readers connect: the broker URL's endpoint and TLS settings.
struct Target {
    endpoint: StreamEndpoint,
    tls: TlsConfiguration,
}

impl Target {
    /// Reads the broker URL as the stream sink reads its own, with the TLS files given as
    /// URL options (`cacertfile`, `certfile`, `keyfile`) as on an `amqps://` URL.
    fn parse(url: &str) -> Result<Target, ConsumerError> {
        let mut files = [None, None, None];
        let mut bare = url.to_string();
        if let Ok(mut u) = url::Url::parse(url) {
            let mut rest = Vec::new();
            for (k, v) in u.query_pairs() {
                match k.as_ref() {
                    "cacertfile" => files[0] = Some(v.into_owned()),
                    "certfile" => files[1] = Some(v.into_owned()),
                    "keyfile" => files[2] = Some(v.into_owned()),
                    _ => rest.push(format!("{k}={v}")),
                }
            }
            if !rest.is_empty() {
                return Err(ConsumerError::config(
                    format!(
                        "the broker URL {} has options a stream consumer does not take",
                        crate::dsn::redact(url)
                    ),
                    "only cacertfile, certfile and keyfile are read (for rabbitmq-stream+tls://)",
                ));
            }
            u.set_query(None);
            bare = u.to_string();
        }
        let endpoint = StreamEndpoint::parse_as(&bare, &BROKER)?;
        let [ca, cert, key] = files;
        let tls = crate::stream::tls_configuration(&endpoint, ca, cert, key, &BROKER)?;
        Ok(Target { endpoint, tls })
    }

    fn broker_err(&self, what: &str, e: impl std::fmt::Display) -> ConsumerError {
        let text = e.to_string();
        let hint = if text.contains("Connection refused") {
            " (is the stream plugin on? rabbitmq-plugins enable rabbitmq_stream)"
        } else {
            ""
        };
        ConsumerError::Broker {
            message: format!(
                "RabbitMQ stream port at {}: {what}: {text}{hint}",
                self.endpoint.redacted
            ),
            retryable: true,
        }
    }

    /// A refused login or vhost is a setup problem; the rest is the connection.
    fn connect_err(&self, e: ClientError) -> ConsumerError {
        if let ClientError::RequestError(
            code @ (ResponseCode::AuthenticationFailure
            | ResponseCode::AuthenticationFailureLoopback
            | ResponseCode::VirtualHostAccessFailure
            | ResponseCode::SaslError),
        ) = &e
        {
            return ConsumerError::config(
                format!(
                    "RabbitMQ refused the login at {}: {code:?}",
                    self.endpoint.redacted
                ),
                "check the user, password and vhost of the broker URL",
            );
        }
        self.broker_err("connecting", e)
    }
}

/// One stream's position: what the worker settled, what the broker has stored, and the
/// connection the offset is stored on.
struct Progress {
    name: String,
    stream: String,
    /// Offset + 1 of the last message settled this run (0: none).
    processed: AtomicU64,
    /// Offset + 1 of the last offset stored (0: none this run).
    stored: AtomicU64,
    last_store: Mutex<Instant>,
    /// When the last store failed (cleared by a successful one).
    failed: Mutex<Option<Instant>>,
    every: u64,
    interval: Duration,
    /// The current session's connection (offsets are stored on it).
    client: Mutex<Option<Client>>,
    /// The current session's environment, where `--on-poison park` opens its producer on
    /// `<stream>.dead`, one per parked message (parking is rare).
    dead: tokio::sync::Mutex<Option<Environment>>,
    /// Where `park` puts messages.
    dead_stream: String,
    /// The last publishing id used on the `<stream>.dead` producer.
    dead_seq: AtomicU64,
}

impl Progress {
    /// Forgets what was settled and stored: the stream was created again, and the offsets of
    /// the old one mean nothing in it (storing one would skip the new stream's messages).
    fn reset(&self) {
        self.processed.store(0, Ordering::SeqCst);
        self.stored.store(0, Ordering::SeqCst);
    }

    /// Stores the offset of the last settled message when it moved and `force` is set, or
    /// `every` messages were settled, or `interval` passed since the last store.
    async fn store(&self, force: bool) {
        let p = self.processed.load(Ordering::SeqCst);
        let s = self.stored.load(Ordering::SeqCst);
        if p <= s {
            return;
        }
        let due = {
            let last = self.last_store.lock().unwrap_or_else(|e| e.into_inner());
            let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
            // After a failed store, the next waits an interval (not one per message while the
            // connection is down).
            let waiting = failed.is_some_and(|f| f.elapsed() < self.interval);
            !waiting && (p - s >= self.every || last.elapsed() >= self.interval)
        };
        if !force && !due {
            return;
        }
        let client = self
            .client
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let Some(client) = client else { return };
        let offset = p - 1;
        match tokio::time::timeout(
            ACK_TIMEOUT,
            client.store_offset(&self.name, &self.stream, offset),
        )
        .await
        {
            Ok(Ok(())) => {
                *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = None;
                self.stored.fetch_max(p, Ordering::SeqCst);
                *self.last_store.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
                tracing::debug!(stream = %self.stream, offset, "offset stored");
            }
            Ok(Err(e)) => {
                *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                tracing::warn!(stream = %self.stream, offset, error = %e, "cannot store the offset yet (the messages after the stored one are read again after a restart, and found claimed)")
            }
            Err(_) => {
                *self.failed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Instant::now());
                tracing::warn!(stream = %self.stream, offset, "storing the offset took longer than {ACK_TIMEOUT:?}")
            }
        }
    }
}

/// A stream message on its way to the worker.
struct StreamJob {
    offset: u64,
    properties: BasicProperties,
    body: Vec<u8>,
    progress: Arc<Progress>,
}

impl Delivered for StreamJob {
    fn message(&self) -> Result<Message, ConsumerError> {
        // No exchange; the stream stands in for the routing key (the topic is `subject`).
        Message::from_parts(
            "",
            &self.progress.stream,
            false,
            self.properties.clone(),
            self.body.clone(),
        )
    }

    /// A stream message does not depend on the connection that brought it.
    fn gone(&self) -> bool {
        false
    }

    async fn settle(&self, _id: &str, _stats: &Stats) {
        self.progress
            .processed
            .fetch_max(self.offset + 1, Ordering::SeqCst);
        self.progress.store(false).await;
    }

    fn dead_target(&self, _opts: &RunnerOptions) -> String {
        self.progress.dead_stream.clone()
    }

    async fn park(
        &self,
        error: &ConsumerError,
        failures: u32,
        _opts: &RunnerOptions,
    ) -> Result<(), ConsumerError> {
        let props = parked_headers(
            &self.properties,
            error,
            failures,
            &[
                (
                    "x-outboxd-stream",
                    AMQPValue::LongString(self.progress.stream.as_str().into()),
                ),
                (
                    "x-outboxd-offset",
                    AMQPValue::LongLongInt(i64::try_from(self.offset).unwrap_or(i64::MAX)),
                ),
            ],
        );
        // A new id for every attempt: the client cannot take a confirmation for an id it no
        // longer waits for, and an attempt that timed out may still be confirmed late.
        let publishing_id = self.progress.dead_seq.fetch_add(1, Ordering::SeqCst) + 1;
        let msg = crate::stream::to_message(&props, &self.body, publishing_id);
        let dead = &self.progress.dead_stream;
        let unconfirmed = |m: String| ConsumerError::Broker {
            message: format!("parking into the stream {dead:?}: {m}"),
            retryable: true,
        };
        let env = self.progress.dead.lock().await.clone();
        let Some(env) = env else {
            return Err(unconfirmed("not connected yet (reconnecting)".into()));
        };
        let producer = env
            .producer()
            .batch_size(1)
            .build(dead)
            .await
            .map_err(|e| unconfirmed(format!("opening a producer: {e}")))?;
        let r = publish_confirmed(&producer, msg).await.map_err(unconfirmed);
        let _ = tokio::time::timeout(ACK_TIMEOUT, producer.close()).await;
        r
    }
}

/// Publishes `msg` and waits for the broker's confirmation (at most [`PARK_TIMEOUT`]).
async fn publish_confirmed(producer: &Producer<NoDedup>, msg: StreamMessage) -> Result<(), String> {
    // As the sink publishes: `batch_send` with a callback the client calls once per
    // publishing id (its `*_with_confirm` variants can wait past the confirmation).
    let (tx, rx) = tokio::sync::oneshot::channel();
    let tx = Mutex::new(Some(tx));
    producer
        .batch_send(vec![msg], move |r| {
            let outcome = match r {
                Ok(status) if status.confirmed() => Ok(()),
                Ok(status) => Err(format!("refused: {:?}", status.status())),
                Err(e) => Err(e.to_string()),
            };
            if let Some(tx) = tx.lock().unwrap_or_else(|p| p.into_inner()).take() {
                let _ = tx.send(outcome);
            }
            futures::future::ready(())
        })
        .await
        .map_err(|e| e.to_string())?;
    match tokio::time::timeout(PARK_TIMEOUT, rx).await {
        Ok(Ok(r)) => r,
        Ok(Err(_)) => Err("the connection closed before the confirmation".into()),
        Err(_) => Err(format!("no confirmation within {PARK_TIMEOUT:?}")),
    }
}

/// A parked copy not confirmed within this is published again (a second copy may then land).
const PARK_TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `runner` on the streams of its options: one reader and one worker per stream.
pub(super) async fn run<P: Processor>(
    runner: Runner<P>,
    shutdown: CancellationToken,
) -> Result<(), ConsumerError> {
    let opts = runner.opts;
    let target = Arc::new(Target::parse(&opts.broker)?);
    let streams = opts.streams();
    if runner.processors.len() != streams.len() {
        return Err(ConsumerError::config(
            format!(
                "{} processors for {} streams: a stream is read by one worker, in order",
                runner.processors.len(),
                streams.len()
            ),
            "give one processor per stream (RunnerOptions::workers), and --concurrency 1 (use --partitions for parallelism)",
        ));
    }
    if let Some(bad) = streams
        .iter()
        .find(|s| s.is_empty() || s.len() > 250 || s.starts_with("amq."))
    {
        return Err(ConsumerError::config(
            format!("{bad:?} is not a usable stream name"),
            "give the relay's --stream (1 to 250 characters, not starting with amq.)",
        ));
    }
    let stop = shutdown.child_token();
    let mut lanes = Vec::new();
    for (stream, p) in streams.into_iter().zip(runner.processors) {
        let shared = Arc::new(Shared {
            opts: opts.clone(),
            stats: runner.stats.clone(),
            on_commit: runner.on_commit.clone(),
            stop: stop.clone(),
            halted: Mutex::new(None),
            in_flight: AtomicU64::new(0),
        });
        let progress = Arc::new(Progress {
            name: opts.name.clone(),
            processed: AtomicU64::new(0),
            stored: AtomicU64::new(0),
            last_store: Mutex::new(Instant::now()),
            failed: Mutex::new(None),
            every: opts.stream.store_every.max(1),
            interval: opts.stream.store_interval,
            client: Mutex::new(None),
            dead: tokio::sync::Mutex::new(None),
            dead_stream: format!("{}.dead", opts.queue),
            dead_seq: AtomicU64::new(0),
            stream,
        });
        lanes.push(tokio::spawn(lane(p, shared, progress, target.clone())));
    }
    let mut halted = None;
    for l in lanes {
        match l.await {
            Ok(Some(e)) => {
                halted.get_or_insert(e);
            }
            Ok(None) => {}
            Err(e) => tracing::error!(error = %e, "a stream reader panicked"),
        }
    }
    match halted {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// How a session ended without an error.
enum End {
    /// The runner is stopping (signal, halt).
    Stopped,
    /// `until_empty`: the reader is past the stream's last message.
    Drained,
}

/// One stream: its worker, and a reader that (re)connects until the runner stops or, with
/// `until_empty`, the stream is read to its end. Returns the error that halted it.
async fn lane<P: Processor>(
    p: P,
    shared: Arc<Shared>,
    progress: Arc<Progress>,
    target: Arc<Target>,
) -> Option<ConsumerError> {
    let (tx, rx) = mpsc::channel(usize::from(shared.opts.prefetch.max(1)));
    let w = tokio::spawn(worker(p, rx, shared.clone()));
    let mut backoff = Backoff::new(shared.opts.retry_min, shared.opts.retry_max);
    // The offset after the last message handed to the worker (or the resume point), and that
    // message's offset and id.
    let mut next: Option<u64> = None;
    let mut last: Option<(u64, String)> = None;
    while !shared.stop.is_cancelled() {
        if let Some(taken) = &last {
            let check = async {
                let env = crate::stream::environment(&target.endpoint, &target.tls)
                    .await
                    .map_err(|e| target.connect_err(e))?;
                same_stream(&env, &progress.stream, taken).await
            };
            match bounded("checking the stream", check).await {
                // Gone: the reader's open says so.
                Ok(Holds::Same | Holds::NoStream) => {}
                Ok(Holds::Other) => {
                    tracing::error!(
                        stream = %progress.stream,
                        offset = taken.0,
                        "the stream was deleted and created again while the consumer read it: offset {} no longer holds \
                         the message it read there. Its offsets mean nothing in the new stream: reading the new stream \
                         from its first message (the inbox recognises a message it already applied)",
                        taken.0
                    );
                    settle(&shared).await;
                    progress.reset();
                    next = Some(0);
                    last = None;
                }
                Err(e) => {
                    shared.open_failed(e, &progress.stream);
                    if !shared.pause(&mut backoff).await {
                        break;
                    }
                    continue;
                }
            }
        }
        let opening = open(&target, &shared.opts, &progress, &mut next);
        match bounded("opening the stream", opening).await {
            Ok((env, consumer)) => {
                backoff.reset();
                tracing::info!(stream = %progress.stream, consumer = %progress.name, from = ?next, "reading the stream");
                let handle = consumer.handle();
                let r = read(
                    &env,
                    consumer,
                    &tx,
                    &shared,
                    &progress,
                    (&mut next, &mut last),
                )
                .await;
                let _ = tokio::time::timeout(ACK_TIMEOUT, handle.close()).await;
                match r {
                    Ok(End::Drained) => break,
                    Ok(End::Stopped) => {}
                    Err(e) => {
                        tracing::warn!(stream = %progress.stream, error = %e, "stream connection lost; reconnecting (reading on after the last message taken)")
                    }
                }
            }
            Err(e) => shared.open_failed(e, &progress.stream),
        }
        if !shared.pause(&mut backoff).await {
            break;
        }
    }
    // The worker finishes the message in hand (or, drained, everything it was given).
    drop(tx);
    if let Err(e) = w.await {
        tracing::error!(error = %e, "a consumer worker panicked");
    }
    progress.store(true).await;
    let client = progress
        .client
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    progress.dead.lock().await.take();
    if let Some(c) = client {
        let _ = tokio::time::timeout(ACK_TIMEOUT, c.close()).await;
    }
    let halted = shared
        .halted
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    halted
}

/// Connects, finds the stream, works out where to read from (the in-memory position, else
/// the stored offset + 1, else `--stream-start`) and subscribes; with `park`, creates
/// `<stream>.dead` when missing.
async fn open(
    target: &Target,
    opts: &RunnerOptions,
    progress: &Progress,
    next: &mut Option<u64>,
) -> Result<(Environment, Consumer), ConsumerError> {
    let stream = &progress.stream;
    let client = Client::connect(crate::stream::client_options(&target.endpoint, &target.tls))
        .await
        .map_err(|e| target.connect_err(e))?;
    let env = crate::stream::environment(&target.endpoint, &target.tls)
        .await
        .map_err(|e| target.connect_err(e))?;
    let missing = || {
        ConsumerError::config(
            format!("the stream {stream:?} does not exist"),
            "start the relay with --sink rabbitmq-stream://… --stream NAME (--declare auto creates it), or give the right --queue (and --partitions)",
        )
    };
    let meta = client
        .metadata(vec![stream.clone()])
        .await
        .map_err(|e| target.broker_err("reading the stream's metadata", e))?;
    match meta.get(stream).map(|m| &m.response_code) {
        Some(ResponseCode::Ok) => {}
        Some(ResponseCode::StreamDoesNotExist) | None => return Err(missing()),
        Some(code) => {
            return Err(target.broker_err("reading the stream's metadata", format!("{code:?}")))
        }
    }
    let spec = match *next {
        Some(n) => OffsetSpecification::Offset(n),
        None => match client.query_offset(opts.name.clone(), stream).await {
            Ok(stored) => match last_offset(&env, stream).await? {
                // No message at or before the stored offset: the offsets belong to an earlier
                // stream of this name, and read from there this one would be passed over.
                Some(end) if stored > end => {
                    tracing::error!(
                        stream = %stream,
                        consumer = %opts.name,
                        stored,
                        last = end,
                        "the offset stored for this consumer is beyond the stream's last message: the stream was \
                         created again under its name. Reading it from its first message (the inbox recognises a \
                         message it already applied)"
                    );
                    *next = Some(0);
                    OffsetSpecification::First
                }
                _ => {
                    progress.stored.fetch_max(stored + 1, Ordering::SeqCst);
                    *next = Some(stored + 1);
                    tracing::info!(stream = %stream, consumer = %opts.name, stored, "resuming after the stored offset");
                    OffsetSpecification::Offset(stored + 1)
                }
            },
            Err(ClientError::RequestError(ResponseCode::OffsetNotFound)) => {
                tracing::info!(stream = %stream, consumer = %opts.name, start = ?opts.stream.start, "no stored offset: starting at --stream-start");
                match opts.stream.start {
                    StreamStart::First => OffsetSpecification::First,
                    StreamStart::Last => OffsetSpecification::Last,
                    StreamStart::Next => OffsetSpecification::Next,
                }
            }
            Err(e) => return Err(target.broker_err("querying the stored offset", e)),
        },
    };
    if opts.on_poison == OnPoison::Park {
        let dead = &progress.dead_stream;
        match env.stream_creator().create(dead).await {
            Ok(())
            | Err(StreamCreateError::Create {
                status: ResponseCode::StreamAlreadyExists,
                ..
            }) => {}
            Err(StreamCreateError::Create {
                status: ResponseCode::AccessRefused,
                ..
            }) => {
                return Err(ConsumerError::config(
                    format!("the broker refused to create the poison stream {dead:?}"),
                    "grant the user configure permission on it (or create it), or use --on-poison halt|skip",
                ))
            }
            Err(e) => return Err(target.broker_err("creating the poison stream", e)),
        }
        *progress.dead.lock().await = Some(env.clone());
    }
    let consumer = env
        .consumer()
        .name(&opts.name)
        .offset(spec)
        .build(stream)
        .await
        .map_err(|e| match e {
            ConsumerCreateError::StreamDoesNotExist { .. } => missing(),
            ConsumerCreateError::Create {
                status: ResponseCode::AccessRefused,
                ..
            } => ConsumerError::config(
                format!("the broker refused a consumer on the stream {stream:?} (access refused)"),
                "grant the user read permission on the stream",
            ),
            e => target.broker_err("subscribing", e),
        })?;
    let old = progress
        .client
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .replace(client);
    if let Some(old) = old {
        let _ = tokio::time::timeout(ACK_TIMEOUT, old.close()).await;
    }
    Ok((env, consumer))
}

/// How often the reader stores a due offset and, with `until_empty`, looks for the end.
const TICK: Duration = Duration::from_millis(100);
/// With `until_empty`: how long nothing must arrive before the reader looks at the tail.
const QUIET: Duration = Duration::from_millis(300);
/// How long nothing must arrive before the reader checks that its stream is still the one it
/// read: the stream client does not end a subscription whose stream was deleted, so a reader
/// would otherwise wait on it for ever, and read nothing of a stream created again under the
/// name.
const IDLE_CHECK: Duration = Duration::from_secs(5);

/// Hands the stream's messages to the worker in offset order until the connection fails
/// (`Err`), the runner stops, or (`until_empty`) the reader is past the stream's end. `next`
/// and `last`: the offset after the last message handed over, and that message's offset and
/// id (what a reconnect checks the stream still holds).
async fn read(
    env: &Environment,
    mut consumer: Consumer,
    tx: &mpsc::Sender<StreamJob>,
    shared: &Shared,
    progress: &Arc<Progress>,
    (next, last): (&mut Option<u64>, &mut Option<(u64, String)>),
) -> Result<End, ConsumerError> {
    let mut first = true;
    let mut tick = tokio::time::interval(TICK);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_seen = Instant::now();
    let mut checked = Instant::now();
    loop {
        let d = tokio::select! {
            d = consumer.next() => d,
            _ = tick.tick() => {
                progress.store(false).await;
                if last_seen.elapsed() >= IDLE_CHECK && checked.elapsed() >= IDLE_CHECK {
                    checked = Instant::now();
                    still_there(env, progress, last.as_ref()).await?;
                }
                if shared.opts.until_empty
                    && last_seen.elapsed() >= QUIET
                    && shared.in_flight.load(Ordering::SeqCst) == 0
                {
                    last_seen = Instant::now();
                    if past_tail(env, &progress.stream, *next).await? {
                        tracing::info!(stream = %progress.stream, "read to the stream's end with nothing in hand: stopping (--until-empty)");
                        return Ok(End::Drained);
                    }
                }
                continue;
            }
            _ = shared.stop.cancelled() => return Ok(End::Stopped),
        };
        let d = match d {
            Some(Ok(d)) => d,
            Some(Err(e)) => {
                return Err(ConsumerError::Broker {
                    message: format!("reading the stream {:?}: {e}", progress.stream),
                    retryable: true,
                })
            }
            None => {
                return Err(ConsumerError::Broker {
                    message: format!("the connection reading {:?} closed", progress.stream),
                    retryable: true,
                })
            }
        };
        last_seen = Instant::now();
        let offset = d.offset();
        // A subscription starts at the chunk holding the offset asked for: what the worker
        // already has is dropped here, so nothing is repeated or reordered.
        if next.is_some_and(|n| offset < n) {
            continue;
        }
        if std::mem::take(&mut first) {
            if let Some(n) = next.filter(|n| offset > *n) {
                // The broker starts at its first retained chunk when the offset asked for is
                // gone: the messages between were removed before this consumer read them.
                tracing::error!(
                    stream = %progress.stream,
                    from = n,
                    to = offset - 1,
                    "offsets {n} to {} of the stream were removed (retention) before the consumer read them: \
                     their messages were never applied. Raise the stream's retention (max-age, max-length-bytes), \
                     or keep the consumer closer to the stream's end",
                    offset - 1
                );
            }
        }
        let (properties, body) = crate::stream::from_message(d.message());
        let message_id = properties
            .message_id()
            .as_ref()
            .map(|m| m.as_str().to_string())
            .unwrap_or_default();
        let job = StreamJob {
            offset,
            properties,
            body,
            progress: progress.clone(),
        };
        shared.in_flight.fetch_add(1, Ordering::SeqCst);
        tokio::select! {
            r = tx.send(job) => {
                if r.is_err() {
                    if !shared.stop.is_cancelled() {
                        shared.halt(ConsumerError::Handler {
                            message: "a consumer worker ended unexpectedly".into(),
                            retryable: false,
                        });
                    }
                    return Ok(End::Stopped);
                }
                *next = Some(offset + 1);
                *last = Some((offset, message_id));
            }
            _ = shared.stop.cancelled() => {
                shared.in_flight.fetch_sub(1, Ordering::SeqCst);
                return Ok(End::Stopped);
            }
        }
    }
}

/// An idle reader's check that its subscription still reads the stream: the message it read
/// last is still at its offset (else the stream was deleted and created again), or — before
/// it read any — the stream still exists. An `Err` ends the session: the reader reconnects,
/// and its open reports a stream that is gone.
async fn still_there(
    env: &Environment,
    progress: &Progress,
    last: Option<&(u64, String)>,
) -> Result<(), ConsumerError> {
    let stream = &progress.stream;
    let gone = || ConsumerError::Broker {
        message: format!(
            "the stream {stream:?} was deleted (or deleted and created again) under the reader"
        ),
        retryable: true,
    };
    match last {
        Some(taken) => match same_stream(env, stream, taken).await? {
            Holds::Same => Ok(()),
            Holds::Other | Holds::NoStream => Err(gone()),
        },
        None => {
            let client = progress
                .client
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone();
            let Some(client) = client else { return Ok(()) };
            let meta =
                client
                    .metadata(vec![stream.clone()])
                    .await
                    .map_err(|e| ConsumerError::Broker {
                        message: format!("reading the metadata of {stream:?}: {e}"),
                        retryable: true,
                    })?;
            match meta.get(stream).map(|m| &m.response_code) {
                Some(ResponseCode::Ok) => Ok(()),
                _ => Err(gone()),
            }
        }
    }
}

/// Waits until the worker has settled everything it was given (the runner stopping ends the
/// wait too): what it settles after the stream was created again must not be stored on the
/// new stream.
async fn settle(shared: &Shared) {
    while shared.in_flight.load(Ordering::SeqCst) > 0 && !shared.stop.is_cancelled() {
        tokio::time::sleep(TICK).await;
    }
}

/// What a stream holds at the offset a reader read last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Holds {
    /// The message the reader read there, or — removed by retention — a later one.
    Same,
    /// Another message, or none yet: the stream was created again under the name.
    Other,
    /// The stream does not exist.
    NoStream,
}

/// Whether the stream still holds, at `taken.0`, the message with id `taken.1` the reader
/// handed over there: a stream deleted and created again under the same name (what a relay's
/// `--declare auto` does) numbers its messages from 0 again, so the reader's offset there
/// holds another message, or none yet. A message removed by retention is no sign of that: the
/// first one the broker still has, after it, answers.
async fn same_stream(
    env: &Environment,
    stream: &str,
    taken: &(u64, String),
) -> Result<Holds, ConsumerError> {
    let broker = |e: String| ConsumerError::Broker {
        message: format!("checking the stream {stream:?} before reading on: {e}"),
        retryable: true,
    };
    let mut probe = match env
        .consumer()
        .offset(OffsetSpecification::Offset(taken.0))
        .build(stream)
        .await
    {
        Ok(p) => p,
        Err(ConsumerCreateError::StreamDoesNotExist { .. }) => return Ok(Holds::NoStream),
        Err(e) => return Err(broker(e.to_string())),
    };
    let same = loop {
        // Nothing at or after the offset: the stream ends before it, which the stream the
        // reader read never can.
        match tokio::time::timeout(Duration::from_secs(2), probe.next()).await {
            Err(_) => break Holds::Other,
            Ok(None) => return Err(broker("the subscription closed".into())),
            Ok(Some(Err(e))) => return Err(broker(e.to_string())),
            Ok(Some(Ok(d))) if d.offset() < taken.0 => continue,
            Ok(Some(Ok(d))) if d.offset() > taken.0 => break Holds::Same,
            Ok(Some(Ok(d))) => {
                let (properties, _) = crate::stream::from_message(d.message());
                let id = properties
                    .message_id()
                    .as_ref()
                    .map(|m| m.as_str().to_string());
                break if id.as_ref() == Some(&taken.1) {
                    Holds::Same
                } else {
                    Holds::Other
                };
            }
        }
    };
    let _ = tokio::time::timeout(ACK_TIMEOUT, probe.handle().close()).await;
    Ok(same)
}

/// The offset of the stream's last message (`None`: the stream is empty): a subscription at the
/// last chunk, read to its end (the client hands over a chunk's messages together).
async fn last_offset(env: &Environment, stream: &str) -> Result<Option<u64>, ConsumerError> {
    let broker = |e: String| ConsumerError::Broker {
        message: format!("looking for the end of {stream:?}: {e}"),
        retryable: true,
    };
    let mut probe = env
        .consumer()
        .offset(OffsetSpecification::Last)
        .build(stream)
        .await
        .map_err(|e| broker(e.to_string()))?;
    let mut last = None;
    let mut wait = Duration::from_secs(1);
    while let Ok(Some(d)) = tokio::time::timeout(wait, probe.next()).await {
        let d = d.map_err(|e| broker(e.to_string()))?;
        last = Some(last.map_or(d.offset(), |l: u64| l.max(d.offset())));
        wait = Duration::from_millis(50);
    }
    let _ = tokio::time::timeout(ACK_TIMEOUT, probe.handle().close()).await;
    Ok(last)
}

/// Whether the reader's position `next` is past the last message the stream holds: a
/// subscription at the last chunk, read to its end (the client hands over a chunk's messages
/// together). An empty stream (nothing arrives within a second) has no messages to be past.
async fn past_tail(
    env: &Environment,
    stream: &str,
    next: Option<u64>,
) -> Result<bool, ConsumerError> {
    Ok(match (last_offset(env, stream).await?, next) {
        (None, _) => true,
        (Some(_), None) => false,
        (Some(tail), Some(n)) => tail < n,
    })
}
