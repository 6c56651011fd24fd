//! The RabbitMQ stream sink (docs/rabbitmq-stream.md): every event becomes one AMQP 1.0 message
//! in a RabbitMQ stream, published by a **named producer** with a **publishing id** the broker
//! deduplicates on, so a relay that crashes and replays from its stored position does not add
//! a second copy of what the stream already holds.
//!
//! One producer per stream (`--partitions N`: the streams `<stream>-0` … `<stream>-<N-1>`,
//! placed by the same murmur2 hash as the AMQP sink's partitions), named after the relay and
//! the stream, opened only while the lease is held. The publishing ids are computed in `ids`:
//! on every connect the sink asks the broker for the producer's last stored id, and before a
//! stream's first publish it reads back this relay's messages (`read_back`), so the replayed
//! events whose identity the stream holds are confirmed without being sent and every other
//! event continues the sequence. The messages are rendered by the AMQP sink's `render` (the
//! same properties and headers) and converted in `encode`.
//!
//! No sub-entry batching (it would make one publishing id cover several events). The client
//! puts up to its batch size of messages into one frame without checking the frame size, so the
//! sink sends one message per frame and caps a message at what a frame holds; a larger one is
//! a dead record, like a payload over `--max-message-bytes`.
//!
//! Recovery is the relay's: on a failure it calls [`Sink::connect`] again, which opens new
//! connections, reads the producers' state again and so recomputes the ids of the events it
//! republishes. Everything this sink imports from the stream client stays in this folder.

pub(crate) mod check;
pub(crate) mod config;
mod encode;
#[cfg(feature = "cli")]
mod flags;
pub(crate) mod ids;
mod read_back;
pub(crate) mod registry;

pub(crate) use config::StreamEndpoint;
pub use config::StreamSinkConfig;
#[cfg(feature = "cli")]
pub use flags::RabbitStreamFlags as Flags;
pub use registry::{Options, DESCRIPTOR};

use super::{Delivery, Sink, SinkError};
use crate::event::{OutboxEvent, SourcePosition};
use crate::identity::{EventKey, Origin};
use futures::future::BoxFuture;
use futures::FutureExt;
use ids::{Assign, PublishingIds};
use rabbitmq_stream_client::error::{ClientError, ProducerCreateError};
use rabbitmq_stream_client::types::ResponseCode;
use rabbitmq_stream_client::{ClientOptions, Dedup, Environment, Producer, TlsConfiguration};
use std::collections::HashMap;
use std::time::Duration;
use tokio::sync::oneshot;

/// The broker's default `stream.frame_max`: one publish frame holds at most this.
pub(crate) const FRAME_MAX: usize = 1024 * 1024;
/// Encoded headers above this are a poison event.
pub(crate) const MAX_HEADER_BYTES: usize = 64 * 1024;
/// Room in a frame for the message's properties and the frame's own fields.
const FRAME_RESERVE: usize = 4096;
/// A publish frame's own bytes around one message: its size, key, version, publisher id and
/// message count, and the message's publishing id and length.
const PUBLISH_FRAME_OVERHEAD: usize = 4 + 2 + 2 + 1 + 4 + 8 + 4;

/// One stream and its producer.
struct Lane {
    stream: String,
    producer: Producer<Dedup>,
    ids: PublishingIds,
}

/// The sink. Create with [`RabbitStreamSink::new`]; the relay calls `connect` before publishing.
pub struct RabbitStreamSink {
    cfg: StreamSinkConfig,
    endpoint: StreamEndpoint,
    /// The stream client's TLS settings (disabled for `rabbitmq-stream://`).
    tls: TlsConfiguration,
    lanes: Vec<Lane>,
    /// The connection the lanes' producers (and the read-backs) use.
    env: Option<Environment>,
    fence: Option<crate::state::Fence>,
    /// The relay and the source (`crate::identity`): written on every message, compared with
    /// what the stream holds.
    origin: Origin,
    /// The newest position this process handed to a producer: a message of ours up to it is
    /// this process's own, whatever the source's head was at the start.
    published: Option<SourcePosition>,
    /// Events confirmed without being sent since the last connect (the stream held them).
    held: u64,
    /// Streams found or created so far: one `--declare auto` has to create again was deleted
    /// under the relay.
    seen: std::collections::HashSet<String>,
}

fn config_err(problem: impl Into<String>, fix: impl Into<String>) -> SinkError {
    SinkError::Config {
        problem: problem.into(),
        fix: fix.into(),
    }
}

/// Checks a stream name: RabbitMQ's queue names are at most 255 bytes, and `--partitions`
/// appends `-<k>`.
pub(crate) fn validate_stream(name: &str, partitions: u32) -> Result<(), crate::Error> {
    let suffix = if partitions > 0 {
        format!("-{}", partitions - 1).len()
    } else {
        0
    };
    if name.is_empty()
        || name.len() + suffix > 255
        || name.starts_with("amq.")
        || name.chars().any(|c| c.is_control())
    {
        return Err(crate::Error::config(
            format!("--stream {name:?} is not a usable stream name"),
            "use 1 to 250 printable characters, not starting with amq., e.g. --stream outbox",
        ));
    }
    Ok(())
}

/// The stream client's TLS settings for the sink's `--sink-ca`, `--sink-cert`, `--sink-key`.
fn tls_configuration(
    endpoint: &StreamEndpoint,
    cfg: &StreamSinkConfig,
) -> Result<TlsConfiguration, crate::Error> {
    let m = &cfg.message;
    let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
    crate::stream::tls_configuration(
        endpoint,
        path(&m.ca_file),
        path(&m.cert_file),
        path(&m.key_file),
        &crate::stream::SINK,
    )
}

impl RabbitStreamSink {
    /// Parses the URL and checks the names; connects only in [`Sink::connect`].
    pub fn new(mut cfg: StreamSinkConfig) -> Result<RabbitStreamSink, crate::Error> {
        let endpoint = StreamEndpoint::parse(&cfg.url)?;
        validate_stream(&cfg.stream, cfg.message.partitioning.partitions)?;
        // A message travels in one frame: a body that cannot fit is a dead record up front
        // instead of a frame the broker refuses by closing the connection, on every retry.
        cfg.message.max_message_bytes = cfg
            .message
            .max_message_bytes
            .min(FRAME_MAX - MAX_HEADER_BYTES - FRAME_RESERVE);
        let tls = tls_configuration(&endpoint, &cfg)?;
        let relay_name = cfg.relay_name.clone();
        Ok(RabbitStreamSink {
            cfg,
            endpoint,
            tls,
            lanes: Vec::new(),
            env: None,
            fence: None,
            origin: Origin {
                relay: relay_name,
                ..Origin::default()
            },
            published: None,
            held: 0,
            seen: Default::default(),
        })
    }

    fn client_options(&self) -> ClientOptions {
        crate::stream::client_options(&self.endpoint, &self.tls)
    }

    fn connection_err(&self, what: &str, e: impl std::fmt::Display) -> SinkError {
        SinkError::Connection(format!(
            "RabbitMQ stream sink at {}: {what}: {e}",
            self.endpoint.redacted
        ))
    }

    /// Creates the stream (`--declare auto`) or checks that it exists (`passive`); whether it
    /// had to be created.
    async fn declare(
        &self,
        admin: &rabbitmq_stream_client::Client,
        stream: &str,
    ) -> Result<bool, SinkError> {
        use crate::sink::DeclareMode;
        match self.cfg.declare {
            DeclareMode::Off => Ok(false),
            DeclareMode::Auto => {
                let mut args = HashMap::new();
                if let Some(b) = self.cfg.max_bytes {
                    args.insert("max-length-bytes".to_string(), b.to_string());
                }
                if let Some(a) = self.cfg.max_age {
                    args.insert("max-age".to_string(), format!("{}s", a.as_secs().max(1)));
                }
                let r = admin
                    .create_stream(stream, args)
                    .await
                    .map_err(|e| self.connection_err("creating the stream", e))?;
                match r.code() {
                    ResponseCode::Ok => Ok(true),
                    ResponseCode::StreamAlreadyExists => Ok(false),
                    // The name is taken with other arguments: a stream created by another tool
                    // or client (most set a leader locator), or a queue that is not a stream.
                    // (The client spells the code `PrecoditionFailed`.) A stream keeps its own
                    // settings, as documented; anything else is the user's to resolve, not a
                    // broker outage to retry.
                    ResponseCode::PrecoditionFailed => {
                        if self.stream_exists(admin, stream).await? {
                            tracing::info!(
                                stream = %stream,
                                "the stream exists with arguments other than the relay's: it keeps its own                                  (`outboxd check` shows its retention)"
                            );
                            Ok(false)
                        } else {
                            Err(config_err(
                                format!(
                                    "the broker refused to create the stream {stream:?} (precondition failed):                                      a queue of that name exists that is not a stream"
                                ),
                                "publish into another stream (--stream), or delete that queue",
                            ))
                        }
                    }
                    ResponseCode::AccessRefused => Err(config_err(
                        format!("the broker refused to create the stream {stream:?} (access refused)"),
                        "grant the user configure permission on it, or create it and run with --declare passive",
                    )),
                    code => Err(self.connection_err(
                        &format!("creating the stream {stream:?}"),
                        format!("{code:?}"),
                    )),
                }
            }
            DeclareMode::Passive => {
                if self.stream_exists(admin, stream).await? {
                    Ok(false)
                } else {
                    Err(missing_stream(stream))
                }
            }
        }
    }

    /// Whether the broker's metadata lists `stream` as a stream.
    async fn stream_exists(
        &self,
        admin: &rabbitmq_stream_client::Client,
        stream: &str,
    ) -> Result<bool, SinkError> {
        let meta = admin
            .metadata(vec![stream.to_string()])
            .await
            .map_err(|e| self.connection_err("reading the stream's metadata", e))?;
        Ok(matches!(
            meta.get(stream).map(|m| &m.response_code),
            Some(ResponseCode::Ok)
        ))
    }

    async fn open(&mut self) -> Result<(Environment, Vec<Lane>), SinkError> {
        let admin = rabbitmq_stream_client::Client::connect(self.client_options())
            .await
            .map_err(|e| self.connect_err(e))?;
        let env = crate::stream::environment(&self.endpoint, &self.tls)
            .await
            .map_err(|e| self.connect_err(e))?;
        let mut lanes = Vec::new();
        for stream in self.cfg.streams() {
            if self.declare(&admin, &stream).await? && self.seen.contains(&stream) {
                tracing::error!(
                    stream = %stream,
                    "the stream {stream:?} was deleted while the relay published into it, and --declare auto \
                     created it again: the messages it held are gone; the events from the stored position on \
                     are published into the new stream"
                );
            }
            let name = self.cfg.producer_name(&stream);
            let producer = env
                .producer()
                .name(&name)
                .batch_size(1)
                .build(&stream)
                .await
                .map_err(|e| match e {
                    ProducerCreateError::StreamDoesNotExist { .. } => missing_stream(&stream),
                    ProducerCreateError::Create {
                        status: ResponseCode::AccessRefused,
                        ..
                    } => config_err(
                        format!("the broker refused a producer on the stream {stream:?} (access refused)"),
                        "grant the user write permission on the stream",
                    ),
                    ProducerCreateError::Create {
                        status: ResponseCode::StreamDoesNotExist,
                        ..
                    } => missing_stream(&stream),
                    e => self.connection_err(&format!("opening the producer on {stream:?}"), e),
                })?;
            let last = admin
                .query_publisher_sequence(&name, &stream)
                .await
                .map_err(|e| self.connection_err("querying the publisher sequence", e))?;
            tracing::info!(
                stream = %stream,
                producer = %name,
                last_publishing_id = last,
                "opened the stream producer"
            );
            lanes.push(Lane {
                stream,
                producer,
                ids: PublishingIds::new(last),
            });
        }
        let _ = admin.close().await;
        self.seen.extend(lanes.iter().map(|l| l.stream.clone()));
        Ok((env, lanes))
    }

    fn connect_err(&self, e: ClientError) -> SinkError {
        let text = e.to_string();
        if text.contains("Connection refused") {
            return SinkError::Connection(format!(
                "cannot reach the RabbitMQ stream port at {}: {text} (is the stream plugin on? rabbitmq-plugins enable rabbitmq_stream)",
                self.endpoint.redacted
            ));
        }
        self.connection_err("connecting", e)
    }

    /// Closes the producers of the previous connection (their unconfirmed messages are the
    /// relay's to republish).
    async fn close_lanes(&mut self) {
        for lane in self.lanes.drain(..) {
            let _ = tokio::time::timeout(Duration::from_secs(1), lane.producer.close()).await;
        }
        self.env = None;
    }

    /// The stream message of `out` with publishing id `id`, measured as the client will send
    /// it: headers become AMQP 1.0 application properties (a nested one its JSON text, which
    /// can be several times its AMQP 0-9-1 size), so only the encoded message tells whether the
    /// frame fits. One that does not goes as the event's dead record (a frame over the broker's
    /// `frame_max` closes the connection, on every retry).
    fn frame_message(
        &self,
        out: &crate::sink::rabbitmq::Outgoing,
        event: &OutboxEvent,
        id: u64,
    ) -> rabbitmq_stream_client::types::Message {
        use rabbitmq_stream_protocol::codec::Encoder;
        let message = encode::to_message(out, id);
        let size = message.encoded_size() as usize + PUBLISH_FRAME_OVERHEAD;
        if size <= FRAME_MAX || out.dead.is_some() {
            return message;
        }
        let reason = format!(
            "the message is {size} bytes as sent in a stream frame (its headers as AMQP 1.0 application properties, nested ones as JSON text), more than the frame of {FRAME_MAX} bytes the broker takes"
        );
        tracing::warn!(id = %event.dead_record_id(), position = %event.position, reason = %reason, "poison event: publishing a dead-letter record without the body into the stream");
        let dead = crate::sink::rabbitmq::render(
            &self.cfg.message,
            0,
            event,
            MAX_HEADER_BYTES,
            Err(reason),
            &self.origin,
        );
        encode::to_message(&dead, id)
    }

    /// Lane `k`'s read-back, before its first decision after a connect: what the stream holds
    /// of this relay's messages from its end back to the event about to go out.
    async fn read_back(&mut self, k: usize, before: &SourcePosition) -> Result<(), SinkError> {
        let lane = &self.lanes[k];
        // Poll positions are numbered per process: nothing an earlier process wrote matches.
        let found = match (&self.env, before) {
            (_, SourcePosition::Poll { .. }) | (None, _) => Ok(read_back::Found::default()),
            (Some(env), _) => {
                read_back::read_back(
                    env,
                    &lane.stream,
                    &self.origin.relay,
                    (before, lane.ids.last()),
                    self.cfg.op_timeout,
                )
                .await
            }
        };
        let found = match found {
            Ok(f) => f,
            Err(e) => {
                // What is not read back is published again: a duplicate, never a loss.
                tracing::warn!(stream = %lane.stream, error = %e, "could not read back what the stream holds: the events replayed from the stored position are published again under new ids, as duplicates");
                read_back::Found::default()
            }
        };
        tracing::info!(
            stream = %lane.stream,
            read = found.read,
            ours = found.keys.len(),
            before = %before,
            "read back the relay's messages in the stream"
        );
        if let Some((pid, newest)) = &found.newest {
            self.origin
                .check_tail(newest, self.published.as_ref())
                .map_err(|m| {
                    config_err(
                        format!(
                            "the stream {:?}'s last message from the relay {:?} (publishing id {pid}, event {}) {m}",
                            lane.stream, self.origin.relay, newest.message_id
                        ),
                        self.origin.mismatch_fix(&format!("the stream {:?}", lane.stream)),
                    )
                })?;
        }
        self.lanes[k].ids.set_held(found.keys);
        Ok(())
    }
}

fn missing_stream(stream: &str) -> SinkError {
    config_err(
        format!("the stream {stream:?} does not exist"),
        format!(
            "run with --declare auto to create it, or create it: rabbitmqadmin declare queue name={stream} durable=true arguments='{{\"x-queue-type\":\"stream\"}}'"
        ),
    )
}

impl Sink for RabbitStreamSink {
    fn name(&self) -> &'static str {
        "rabbitmq-stream"
    }

    fn stores_position(&self) -> bool {
        true
    }

    fn guard_wire(&mut self, fence: crate::state::Fence) {
        self.fence = Some(fence);
    }

    fn set_origin(&mut self, origin: &Origin) {
        self.origin = origin.clone();
    }

    fn is_broken(&self) -> bool {
        self.lanes.is_empty() || self.lanes.iter().any(|l| l.producer.is_closed())
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        self.close_lanes().await;
        if let Some(f) = &self.fence {
            // Only the lease holder opens the producers: the broker does not keep two
            // connections from using one producer name. The relay may connect while it is
            // still taking the lease, so wait for it (as long as any other connect step).
            if tokio::time::timeout(self.cfg.op_timeout, f.wait_open())
                .await
                .is_err()
            {
                return Err(SinkError::Connection(
                    "the lease is not held: the stream producers stay closed".into(),
                ));
            }
        }
        let (env, lanes) = match tokio::time::timeout(self.cfg.op_timeout, self.open()).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(SinkError::Connection(format!(
                    "connecting to the RabbitMQ stream port at {} took longer than {:?}",
                    self.endpoint.redacted, self.cfg.op_timeout
                )))
            }
        };
        if self.held > 0 {
            tracing::info!(
                held = self.held,
                "events the stream already held were confirmed without being sent again"
            );
        }
        self.held = 0;
        self.lanes = lanes;
        self.env = Some(env);
        Ok(())
    }

    async fn publish(&mut self, event: &OutboxEvent) -> Result<Delivery, SinkError> {
        if let Some(f) = &self.fence {
            if !f.is_open() {
                return Err(SinkError::Connection(
                    "the lease is not held: not publishing into the stream".into(),
                ));
            }
        }
        let lane_count = self.lanes.len();
        if lane_count == 0 {
            return Err(SinkError::Connection(
                "the stream sink is not connected".into(),
            ));
        }
        let k = if lane_count == 1 {
            0
        } else {
            crate::sink::partition::partition_of(&event.aggregate_id, lane_count as u32) as usize
        };
        let out = crate::sink::rabbitmq::render(
            &self.cfg.message,
            0,
            event,
            MAX_HEADER_BYTES,
            Ok((String::new(), String::new())),
            &self.origin,
        );
        let message_id = match &out.dead {
            Some(reason) => {
                tracing::warn!(
                    id = %event.dead_record_id(),
                    position = %event.position,
                    reason = %reason,
                    "poison event: publishing a dead-letter record without the body into the stream"
                );
                event.dead_record_id()
            }
            None => event.id,
        };
        if self.lanes[k].ids.needs_read_back() {
            self.read_back(k, &event.position).await?;
        }
        if self
            .published
            .as_ref()
            .is_none_or(|p| event.position.compare(p) == Some(std::cmp::Ordering::Greater))
        {
            self.published = Some(event.position.clone());
        }
        let lane = &mut self.lanes[k];
        let id = match lane.ids.assign(&EventKey::of(message_id)) {
            Assign::Held => {
                if self.held == 0 {
                    tracing::info!(stream = %lane.stream, position = %event.position, "replayed events the stream already holds are confirmed without sending them again");
                }
                self.held += 1;
                return Ok(Delivery::Pending(futures::future::ready(Ok(())).boxed()));
            }
            Assign::Publish(id) => id,
        };
        let stream = lane.stream.clone();
        let (tx, rx) = oneshot::channel();
        // The client takes an `Fn` callback; it calls it once per publishing id.
        let tx = std::sync::Mutex::new(Some(tx));
        let confirm_stream = stream.clone();
        // `batch_send` with one message goes straight to the connection. Not `send`: that
        // counts the message into the client's batch accumulator only after handing it to the
        // accumulator's channel, so the client's batch timer can take it out first and the
        // count wraps below zero — an overflow panic in a debug build (the broker-restart test
        // met it), a message left for the next 100 ms timer tick in a release build.
        let message = self.frame_message(&out, event, id);
        let lane = &mut self.lanes[k];
        let send = lane.producer.batch_send(vec![message], move |r| {
            let stream = &confirm_stream;
            {
                // A confirmation, or the broker's error code for the message as a retryable
                // refusal: the relay reconnects and republishes (with backoff), which
                // recomputes the ids, so a refused message is never skipped.
                let outcome = match r {
                    Ok(status) if status.confirmed() => Ok(()),
                    Ok(status) => Err(SinkError::Rejected(format!(
                        "the broker refused publishing id {id} on the stream {stream:?}: {:?}",
                        status.status()
                    ))),
                    Err(e) => Err(SinkError::Connection(format!(
                        "publishing id {id} into the stream {stream:?}: {e}"
                    ))),
                };
                if let Some(tx) = tx.lock().unwrap_or_else(|p| p.into_inner()).take() {
                    let _ = tx.send(outcome);
                }
                futures::future::ready(())
            }
        });
        // Bounded like every other broker operation: the client's write to a connection the
        // broker dropped (a stopped node) can wait without end, and the relay would wait with
        // it instead of reconnecting.
        match tokio::time::timeout(self.cfg.op_timeout, send).await {
            Ok(r) => r.map_err(|e| {
                SinkError::Connection(format!("publishing into the stream {stream:?}: {e}"))
            })?,
            Err(_) => {
                return Err(SinkError::Connection(format!(
                    "handing a message to the stream {stream:?} took longer than {:?}",
                    self.cfg.op_timeout
                )))
            }
        }
        let fut: BoxFuture<'static, Result<(), SinkError>> = async move {
            rx.await.unwrap_or_else(|_| {
                Err(SinkError::Connection(format!(
                    "the stream connection was replaced before publishing id {id} was confirmed"
                )))
            })
        }
        .boxed();
        Ok(Delivery::Pending(fut))
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        // Every event is Pending until confirmed: nothing is buffered here.
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::sink::rabbitmq::RabbitConfig;
    use crate::sink::DeclareMode;

    pub(crate) fn message_config() -> RabbitConfig {
        RabbitConfig {
            url: String::new(),
            exchange: "outbox".into(),
            declare: DeclareMode::Auto,
            max_message_bytes: crate::sink::rabbitmq::DEFAULT_MAX_MESSAGE_BYTES,
            op_timeout: Duration::from_secs(5),
            ca_file: None,
            cert_file: None,
            key_file: None,
            connection_name: "test".into(),
            partitioning: Default::default(),
            dead_queue_type: Default::default(),
            message: Default::default(),
        }
    }

    fn cfg(stream: &str, partitions: u32) -> StreamSinkConfig {
        let mut message = message_config();
        message.partitioning.partitions = partitions;
        StreamSinkConfig {
            url: "rabbitmq-stream://guest:secret@127.0.0.1:5552".into(),
            stream: stream.into(),
            declare: DeclareMode::Auto,
            max_bytes: None,
            max_age: None,
            op_timeout: Duration::from_secs(5),
            relay_name: "r1".into(),
            message,
        }
    }

    #[test]
    fn streams_and_producer_names_follow_the_partitions() {
        let c = cfg("orders", 3);
        assert_eq!(c.streams(), ["orders-0", "orders-1", "orders-2"]);
        assert_eq!(c.producer_name("orders-1"), "outboxd.r1.orders-1");
        assert_eq!(cfg("orders", 0).streams(), ["orders"]);
        assert!(!format!("{c:?}").contains("secret"));
    }

    #[test]
    fn bodies_that_cannot_fit_a_frame_are_dead_records() {
        let sink = RabbitStreamSink::new(cfg("orders", 0)).unwrap();
        assert!(sink.cfg.message.max_message_bytes < FRAME_MAX - MAX_HEADER_BYTES);
        let mut big = crate::sink::test_event();
        big.payload = bytes::Bytes::from(vec![b'1'; FRAME_MAX]);
        let out = crate::sink::rabbitmq::render(
            &sink.cfg.message,
            0,
            &big,
            MAX_HEADER_BYTES,
            Ok((String::new(), String::new())),
            &Origin::default(),
        );
        assert!(out.dead.unwrap().contains("--max-message-bytes"));
        assert!(out.body.is_empty());
    }

    #[test]
    fn bad_stream_names_are_refused() {
        for bad in ["", "amq.x", "a\nb", &"x".repeat(255)] {
            let mut c = cfg(bad, 0);
            if bad.len() == 255 {
                c.message.partitioning.partitions = 4;
            }
            assert!(RabbitStreamSink::new(c).is_err(), "{bad:?}");
        }
    }
}
