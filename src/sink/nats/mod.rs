//! The NATS JetStream sink (docs/nats.md): every event becomes one message on a subject from
//! the `--subject` template, stored by the stream `--stream`, and counts as durable only when
//! JetStream acknowledged it. `Nats-Msg-Id` is the event id, so within the stream's duplicate
//! window a republished event (after a reconnect, or a relay restarted after a crash) is
//! acknowledged as a duplicate and stored once. Poison events become body-less records on
//! `<prefix>.dead`.
//!
//! Recovery is the relay's: the client never reconnects on its own, a lost connection fails
//! every pending acknowledgement at once, and [`Sink::connect`] builds a fresh client before
//! the relay republishes in order. Acknowledgements are pipelined; the relay bounds the window.
//!
//! The folder keeps the broker's parts apart: `config` (address, credentials, names),
//! `connect` (the client), `declare` (the stream, and `outboxd check`), `publish` (one event
//! as a message).

pub(crate) mod config;
pub(crate) mod connect;
pub(crate) mod declare;
#[cfg(feature = "cli")]
mod flags;
pub(crate) mod publish;
pub(crate) mod registry;

pub use config::NatsConfig;
#[cfg(feature = "cli")]
pub use flags::NatsFlags as Flags;
pub use registry::{Options, DESCRIPTOR};

use super::{Delivery, Sink, SinkError};
use crate::dsn::redact;
use crate::event::{OutboxEvent, SourcePosition};
use crate::state::Fence;
use crate::telemetry::events::{DuplicateOfAnotherEvent, EventDeduplicated, InternalEvent};
use crate::wire::WireSocket;
use async_nats::jetstream::context::{Context, ContextBuilder, PublishErrorKind};
use async_nats::{Client, Event};
use futures::FutureExt;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// The sink. Create with [`NatsSink::new`]; the relay calls `connect` before publishing.
pub struct NatsSink {
    cfg: NatsConfig,
    prefix: String,
    redacted: String,
    link: Option<Link>,
    /// JetStream refusals in a row (a full stream with `discard new`, a store failure), reset
    /// by the next acknowledgement. The relay's recovery succeeds as soon as the republish is
    /// handed over, so without this a refusing stream would be reconnected to in a loop.
    refusals: Arc<AtomicU32>,
    /// The newest source position handed over: an event after it is published for the first
    /// time by this process, one at or before it is a republish after a failure.
    newest: Option<SourcePosition>,
    /// The lease's gate: the connection is reset the moment it closes (see `guard_socket`).
    fence: Option<crate::state::Fence>,
    /// The relay and the source, written on every message (`crate::identity`).
    origin: crate::identity::Origin,
}

/// One client and its JetStream context. Dropping it closes the connection.
struct Link {
    /// Resets the socket when the lease's gate closes; aborted with the link.
    guard: Option<tokio::task::JoinHandle<()>>,
    client: Client,
    js: Context,
    /// Turns true when the connection is lost; never back.
    broken: watch::Receiver<bool>,
    /// The largest message (headers and payload) both the server and the stream take.
    limit: publish::SizeLimit,
}

impl NatsSink {
    /// Validates the configuration; connects only in [`Sink::connect`].
    pub fn new(cfg: NatsConfig) -> Result<NatsSink, crate::Error> {
        cfg.validate()?;
        let prefix = config::subject_prefix(&cfg.subject)?;
        Ok(NatsSink {
            redacted: redact(&cfg.url),
            cfg,
            prefix,
            link: None,
            refusals: Arc::default(),
            newest: None,
            fence: None,
            origin: Default::default(),
        })
    }

    async fn open(&self) -> Result<Link, SinkError> {
        let (tx, rx) = watch::channel(false);
        let broken = tx.clone();
        // async-nats does not hand out its socket: it is found as the one connection to the
        // server's address that appeared with this client.
        let peers = match &self.fence {
            Some(_) => server_addrs(&self.cfg).await,
            None => Vec::new(),
        };
        let before: Vec<i32> = WireSocket::connected_to(&peers)
            .into_iter()
            .map(|(fd, _)| fd)
            .collect();
        let shown = self.redacted.clone();
        let client = connect::connect_with_events(&self.cfg, move |event| {
            let tx = tx.clone();
            let shown = shown.clone();
            async move {
                match event {
                    Event::Disconnected | Event::Closed => {
                        tracing::warn!(sink = %shown, "NATS connection lost");
                        tx.send_replace(true);
                    }
                    Event::ServerError(e) => {
                        tracing::warn!(sink = %shown, error = %e, "NATS server error")
                    }
                    // After a loss, the client's refused reconnect (by design, see `connect`)
                    // reports errors of its own: the loss was already said.
                    Event::ClientError(e) if !*tx.borrow() => {
                        tracing::warn!(sink = %shown, error = %e, "NATS client error")
                    }
                    _ => {}
                }
            }
        })
        .await?;
        let max_payload = client.server_info().max_payload;
        let js = ContextBuilder::new()
            .timeout(self.cfg.op_timeout)
            // The relay's confirm timeout runs out first and says so.
            .ack_timeout(self.cfg.op_timeout + Duration::from_secs(5))
            .max_ack_inflight(self.cfg.window.max(1) + 64)
            .build(client.clone());
        let work = declare::ensure(&js, &self.cfg);
        // Read again at every connect: a stream edited to a smaller `max_msg_size` refuses the
        // event, the relay reconnects, and the event then becomes a dead record.
        let stream_max = match tokio::time::timeout(self.cfg.op_timeout, work).await {
            Ok(r) => r?.map(|info| info.config.max_message_size),
            Err(_) => {
                return Err(SinkError::Connection(format!(
                    "declaring stream {} at NATS {} took longer than {:?}",
                    self.cfg.stream, self.redacted, self.cfg.op_timeout
                )))
            }
        };
        let guard = self.fence.clone().map(|fence| {
            let sockets: Vec<WireSocket> = WireSocket::connected_to(&peers)
                .into_iter()
                .filter(|(fd, _)| !before.contains(fd))
                .map(|(_, s)| s)
                .collect();
            if sockets.is_empty() {
                tracing::warn!(sink = %self.redacted, "the NATS client's socket was not found: a closed lease gate stops publishing at the hand-over only");
            }
            for s in &sockets {
                let _ = s.abort_on_close();
            }
            tokio::spawn(guard_socket(fence, sockets, broken))
        });
        Ok(Link {
            guard,
            client,
            js,
            broken: rx,
            limit: publish::SizeLimit::of(max_payload, stream_max),
        })
    }
}

/// A first publish, kept until its acknowledgement in case the stream calls it a duplicate.
struct FirstPublish {
    js: Context,
    /// The `Nats-Msg-Id` sent.
    id: uuid::Uuid,
    position: SourcePosition,
}

impl FirstPublish {
    /// The stream acknowledged the message as a duplicate of its message `seq`: whether that
    /// copy is this event (same `x-source-position`: an earlier run's publish) or another one
    /// with the same id, which is reported. A copy that cannot be read is reported too: the
    /// event may not be stored.
    async fn held_copy(self, stream: String, seq: u64, timeout: Duration) {
        let read = async {
            let s = self
                .js
                .get_stream(&stream)
                .await
                .map_err(|e| e.to_string())?;
            s.get_raw_message(seq).await.map_err(|e| e.to_string())
        };
        let held = match tokio::time::timeout(timeout, read).await {
            Ok(Ok(m)) => m
                .headers
                .get("x-source-position")
                .map(|v| v.as_str().to_string()),
            Ok(Err(e)) => {
                tracing::warn!(stream, seq, error = %e, "could not read the stream's copy of a duplicate");
                None
            }
            Err(_) => None,
        };
        let ours = self.position.to_string();
        if held.as_deref() != Some(ours.as_str()) {
            DuplicateOfAnotherEvent {
                id: &self.id,
                position: &ours,
                held_position: held.as_deref(),
                held_seq: seq,
            }
            .emit();
        }
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(g) = &self.guard {
            g.abort();
        }
    }
}

/// The server's socket addresses (`--sink` resolved), to find the client's connection by.
async fn server_addrs(cfg: &NatsConfig) -> Vec<std::net::SocketAddr> {
    let Ok(ep) = config::endpoint(&cfg.url) else {
        return Vec::new();
    };
    let hostport = ep
        .address
        .split_once("://")
        .map_or(ep.address.as_str(), |(_, rest)| rest)
        .to_string();
    let found = tokio::net::lookup_host(hostport).await;
    found.map(|a| a.collect()).unwrap_or_default()
}

/// Resets the client's socket the moment the lease's gate closes: the client queues messages
/// and writes them from its own task whenever the socket takes them, so frames queued before
/// a pause would be written after it (see the RabbitMQ sink's `guard_socket`).
async fn guard_socket(fence: Fence, sockets: Vec<WireSocket>, broken: watch::Sender<bool>) {
    fence.wait_open().await;
    while let Some(open_for) = fence.closes_in() {
        tokio::time::sleep(open_for).await;
    }
    for s in &sockets {
        let result = s.reset();
        tracing::warn!(target: "outboxd::sink::nats", reset = ?result, "the lease's gate closed (no renewal for too long): the connection was reset so that nothing queued in the client reaches the server");
    }
    broken.send_replace(true);
}

/// How long to wait before publishing again after `n` refusals in a row: 200 ms doubling to
/// 30 s, jittered by up to a half so that relays sharing a stream do not retry in step.
fn refusal_delay(n: u32) -> Duration {
    // 2^8 × 200 ms is past the cap: the cap is reached (at 9 refusals) and the shift stays small.
    let step = Duration::from_millis(200).saturating_mul(1u32 << n.min(9).saturating_sub(1));
    let step = step.min(Duration::from_secs(30));
    let half = step / 2;
    half + Duration::from_micros(rand::random_range(0..=half.as_micros() as u64))
}

/// What a failed acknowledgement means to the relay.
fn ack_error(e: async_nats::jetstream::context::PublishError, timeout: Duration) -> SinkError {
    match e.kind() {
        PublishErrorKind::TimedOut => SinkError::ConfirmTimeout(timeout),
        PublishErrorKind::BrokenPipe => {
            SinkError::Connection("the NATS connection closed before the acknowledgement".into())
        }
        PublishErrorKind::StreamNotFound => SinkError::Rejected(
            "no JetStream stream captures the subject (was the stream deleted?)".into(),
        ),
        // A full stream with `discard new`, a store failure, …: the relay retries with backoff.
        // The next message may be stored (the stream made room meanwhile): a refusal in place.
        _ => SinkError::Nacked(format!("JetStream refused the message: {e}")),
    }
}

impl Sink for NatsSink {
    fn name(&self) -> &'static str {
        "nats"
    }

    fn stores_position(&self) -> bool {
        true
    }

    fn guard_wire(&mut self, fence: Fence) {
        self.fence = Some(fence);
    }

    fn set_origin(&mut self, origin: &crate::identity::Origin) {
        self.origin = origin.clone();
    }

    fn is_broken(&self) -> bool {
        self.link.as_ref().is_none_or(|l| {
            *l.broken.borrow()
                || l.client.connection_state() == async_nats::connection::State::Disconnected
        })
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        // Always a fresh client: the old one closes when dropped, with its pending acks.
        self.link = None;
        let refused = self.refusals.load(Ordering::Relaxed);
        if refused > 0 {
            let delay = refusal_delay(refused);
            tracing::warn!(stream = %self.cfg.stream, refusals = refused, wait = ?delay, "JetStream keeps refusing messages: waiting before publishing again");
            tokio::time::sleep(delay).await;
        }
        let link = self.open().await?;
        tracing::info!(
            sink = %self.redacted,
            stream = %self.cfg.stream,
            subject = %self.cfg.subject,
            declare = ?self.cfg.declare,
            partitions = self.cfg.partitions,
            max_message = %link.limit,
            "connected to NATS JetStream"
        );
        self.link = Some(link);
        Ok(())
    }

    async fn publish(&mut self, event: &OutboxEvent) -> Result<Delivery, SinkError> {
        let Some(link) = self.link.as_ref() else {
            return Err(SinkError::Connection("not connected".into()));
        };
        if *link.broken.borrow() {
            return Err(SinkError::Connection("the NATS connection was lost".into()));
        }
        let out = publish::render(&self.cfg, &self.prefix, event, link.limit, &self.origin);
        if let Some(reason) = &out.dead {
            tracing::warn!(id = %event.dead_record_id(), position = %event.position, reason = %reason, subject = %out.subject, "poison event: publishing a dead record without the body");
        }
        let send = link
            .js
            .publish_with_headers(out.subject, out.headers, out.payload);
        // Handing over waits only for room in the client's queue; a connection that stopped
        // moving must not hold the relay here.
        let ack = match tokio::time::timeout(self.cfg.op_timeout, send).await {
            Ok(Ok(ack)) => ack,
            Ok(Err(e)) => {
                return Err(SinkError::Connection(format!(
                    "handing a message to NATS failed: {e}"
                )))
            }
            Err(_) => {
                return Err(SinkError::Connection(format!(
                    "handing a message to NATS took longer than {:?}",
                    self.cfg.op_timeout
                )))
            }
        };
        // A republish the stream already held is what the duplicate window is for. A first
        // publish acknowledged as a duplicate is suspect: unless the stream's copy is this same
        // position (published by an earlier run of the relay that was killed before storing
        // it), another event used the same id, and this one was not stored. Poll positions are
        // numbered per process and say nothing across runs: there, rows are marked by their
        // unique id, so a duplicate is a republished row.
        let first = self
            .newest
            .as_ref()
            .is_none_or(|n| event.position.compare(n) == Some(std::cmp::Ordering::Greater));
        let check = (first && !matches!(event.position, SourcePosition::Poll { .. })).then(|| {
            FirstPublish {
                js: link.js.clone(),
                id: if out.dead.is_some() {
                    event.dead_record_id()
                } else {
                    event.id
                },
                position: event.position.clone(),
            }
        });
        if first {
            self.newest = Some(event.position.clone());
        }
        let timeout = self.cfg.op_timeout;
        let stream = self.cfg.stream.clone();
        let mut broken = link.broken.clone();
        let refusals = self.refusals.clone();
        Ok(Delivery::Pending(
            async move {
                let acked = tokio::select! {
                    biased;
                    r = std::future::IntoFuture::into_future(ack) => r,
                    _ = broken.wait_for(|b| *b) => return Err(SinkError::Connection(
                        "the NATS connection was lost before the acknowledgement".into(),
                    )),
                };
                match acked {
                    Ok(a) if a.stream != stream => Err(SinkError::Config {
                        problem: format!("the message was stored by stream {:?}, not by --stream {stream}", a.stream),
                        fix: format!("give --stream {} or change --subject so that only {stream} captures it", a.stream),
                    }),
                    Ok(a) => {
                        refusals.store(0, Ordering::Relaxed);
                        if a.duplicate {
                            // A republished event the stream already held (an earlier
                            // life's, or one sent before a lost connection): stored once.
                            EventDeduplicated.emit();
                            if let Some(check) = check {
                                // Only a report: the confirmation does not wait for it.
                                tokio::spawn(check.held_copy(stream, a.sequence, timeout));
                            }
                        }
                        Ok(())
                    }
                    Err(e) => {
                        let e = ack_error(e, timeout);
                        if matches!(e, SinkError::Rejected(_) | SinkError::Nacked(_)) {
                            refusals.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e)
                    }
                }
            }
            .boxed(),
        ))
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        // Every event is Pending until acknowledged: nothing is buffered here.
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::refusal_delay;
    use std::time::Duration;

    #[test]
    fn refusal_delays_grow_to_a_cap() {
        assert!(refusal_delay(1) <= Duration::from_millis(200));
        assert!(refusal_delay(1) >= Duration::from_millis(100));
        assert!(refusal_delay(4) >= Duration::from_millis(800));
        assert!(refusal_delay(40) <= Duration::from_secs(30));
        assert!(refusal_delay(40) >= Duration::from_secs(15));
    }
}
