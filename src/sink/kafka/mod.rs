//! The Kafka sink (docs/kafka.md): every event becomes one record, keyed by its aggregate id,
//! on the topic its `--routing-key` template names, in the partition Kafka's default
//! partitioner gives the key, written by an idempotent producer (`acks=all`). Records are
//! pipelined within the relay's window; each event is confirmed by its delivery report.
//!
//! No duplicate after a crash, without relying on the broker's transactions (the test broker
//! does not hide aborted records from `read_committed` consumers): before a link first writes
//! to a partition it reads back that partition's tail, and a replayed event whose record the
//! relay already wrote there is acknowledged without producing it again (`tail`).
//!
//! The folder keeps the parts apart: `config` (address, credentials, names, librdkafka
//! settings), `record` (one event as a record), `declare` (topics), `check` (`outboxd check`), `logs` (librdkafka's lines, without a storm),
//! `tail` (the partitioner and what is already written).

pub(crate) mod check;
pub(crate) mod config;
pub(crate) mod declare;
#[cfg(feature = "cli")]
mod flags;
pub(crate) mod logs;
pub(crate) mod record;
pub(crate) mod registry;
pub(crate) mod tail;

pub use config::{KafkaConfig, KafkaOptions};
#[cfg(feature = "cli")]
pub use flags::KafkaFlags as Flags;
pub use registry::{Options, DESCRIPTOR};

use super::{Delivery, Sink, SinkError};
use crate::dsn::redact;
use crate::event::{OutboxEvent, SourcePosition};
use crate::identity::{EventKey, Held, Origin};
use crate::state::Fence;
use futures::FutureExt;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The sink. Create with [`KafkaSink::new`]; the relay calls `connect` before publishing.
pub struct KafkaSink {
    cfg: Arc<KafkaConfig>,
    redacted: String,
    link: Option<Link>,
    /// Events whose record the broker refused as too large, by position, with the reason:
    /// published again as dead records instead of being refused forever.
    refused: Arc<Mutex<HashMap<String, String>>>,
    /// Replayed events acknowledged without producing since the last connect (logged once).
    skipped: u64,
    fence: Option<Fence>,
    /// The relay and the source (`crate::identity`): written on every record, compared with
    /// what a partition's tail holds.
    origin: Origin,
    /// The newest position this process handed to the producer: a record of ours up to it is
    /// this process's own, whatever the source's head was at the start.
    published: Option<SourcePosition>,
}

/// One producer and what it learnt about the topics it writes.
struct Link {
    /// Purges the producer's queue when the lease's gate closes; aborted with the link.
    guard: Option<tokio::task::JoinHandle<()>>,
    producer: FutureProducer<logs::Quiet>,
    admin: declare::Admin,
    /// Partition counts of the event topics seen on this link (declared or checked).
    topics: HashMap<String, i32>,
    /// Per partition written on this link: the identities of the relay's records that were
    /// there when the link first wrote to it.
    written: HashMap<(String, i32), Held>,
}

impl Drop for Link {
    fn drop(&mut self) {
        if let Some(g) = &self.guard {
            g.abort();
        }
    }
}

/// Purges what the producer still holds the moment the lease's gate closes: librdkafka sends
/// from its own queue, so records handed over before a pause would be written after it (see
/// the RabbitMQ sink's `guard_socket`). Their delivery reports fail, and the relay republishes
/// them once it holds the lease again.
async fn guard_queue(fence: Fence, producer: FutureProducer<logs::Quiet>) {
    fence.wait_open().await;
    while let Some(open_for) = fence.closes_in() {
        tokio::time::sleep(open_for).await;
    }
    let purge = rdkafka::producer::PurgeConfig::default().queue().inflight();
    let _ = tokio::task::spawn_blocking(move || producer.purge(purge)).await;
    tracing::warn!(target: "outboxd::sink::kafka", "the lease's gate closed (no renewal for too long): the producer's queue was purged so that nothing queued reaches the broker");
}

/// What a failed delivery means to the relay.
fn delivery_error(e: &KafkaError, timeout: Duration) -> SinkError {
    match e.rdkafka_error_code() {
        Some(RDKafkaErrorCode::MessageTimedOut) => SinkError::ConfirmTimeout(timeout),
        Some(RDKafkaErrorCode::UnknownTopicOrPartition | RDKafkaErrorCode::UnknownTopic) => {
            SinkError::Rejected(format!(
                "the topic does not exist: {e} (create it, or run with --declare auto)"
            ))
        }
        Some(RDKafkaErrorCode::TopicAuthorizationFailed) => SinkError::Config {
            problem: format!("the broker refused the write: {e}"),
            fix: "grant the relay's user WRITE on the topics (and DESCRIBE, READ for reading back a partition's tail)".into(),
        },
        _ => SinkError::Connection(format!("a record was not delivered: {e}")),
    }
}

impl KafkaSink {
    /// Validates the configuration; connects only in [`Sink::connect`].
    pub fn new(cfg: KafkaConfig) -> Result<KafkaSink, crate::Error> {
        cfg.validate()?;
        let relay = cfg.name.clone();
        Ok(KafkaSink {
            redacted: redact(&cfg.url),
            cfg: Arc::new(cfg),
            link: None,
            refused: Arc::default(),
            skipped: 0,
            fence: None,
            origin: Origin {
                relay,
                ..Origin::default()
            },
            published: None,
        })
    }

    fn producer(&self) -> Result<FutureProducer<logs::Quiet>, SinkError> {
        let cfg = &self.cfg;
        let timeout_ms = cfg.op_timeout.as_millis().clamp(1000, 900_000) as u64;
        let mut c = cfg.client()?;
        c.set("enable.idempotence", "true")
            .set("acks", "all")
            // A record not delivered within the confirm timeout fails; the relay reconnects.
            .set("message.timeout.ms", timeout_ms.to_string())
            .set("linger.ms", cfg.options.linger.as_millis().to_string())
            // Topics are the relay's to create (`--declare`), never the broker's by accident.
            .set("allow.auto.create.topics", "false")
            .set(
                "message.max.bytes",
                (cfg.options.max_message_bytes + 64 * 1024)
                    .max(1_000_000)
                    .to_string(),
            );
        c.create_with_context(logs::Quiet)
            .map_err(|e| SinkError::Connection(format!("creating the Kafka producer: {e}")))
    }

    async fn open(&mut self) -> Result<Link, SinkError> {
        let producer = self.producer()?;
        let admin: declare::Admin = self
            .cfg
            .client()?
            .create_with_context(logs::Quiet)
            .map_err(|e| SinkError::Connection(format!("creating the Kafka admin client: {e}")))?;
        declare::ensure(&admin, &self.cfg, &self.cfg.options.dead_topic).await?;
        let guard = self
            .fence
            .clone()
            .map(|f| tokio::spawn(guard_queue(f, producer.clone())));
        Ok(Link {
            guard,
            producer,
            admin,
            topics: HashMap::new(),
            written: HashMap::new(),
        })
    }

    /// Drops the link without blocking the runtime: librdkafka's destroy waits for its
    /// threads, and with a broker gone that takes a while.
    fn drop_link(&mut self) {
        if let Some(old) = self.link.take() {
            tokio::task::spawn_blocking(move || drop(old));
        }
    }

    /// The partition `out` goes to, and whether its event's record is there already. The
    /// first write to a partition on a link reads the partition's tail back.
    async fn place(
        &mut self,
        out: &record::Outgoing,
        event: &OutboxEvent,
    ) -> Result<(i32, bool), SinkError> {
        let position = &event.position;
        let link = self.link.as_mut().expect("connected");
        let partitions = match link.topics.get(&out.topic) {
            Some(n) => *n,
            None => {
                declare::ensure(&link.admin, &self.cfg, &out.topic).await?;
                let (cfg, t) = (self.cfg.clone(), out.topic.clone());
                let n = blocking(move || tail::partitions(&cfg, &t)).await??;
                link.topics.insert(out.topic.clone(), n);
                n
            }
        };
        let partition = record::partition(out, partitions).map_err(|reason| {
            // Published again as a dead record, as a record the broker refused is.
            if let Ok(mut r) = self.refused.lock() {
                r.insert(position.to_string(), reason.clone());
            }
            SinkError::Rejected(reason)
        })?;
        // Poll positions are numbered per process: nothing an earlier process wrote matches.
        if matches!(position, SourcePosition::Poll { .. }) {
            return Ok((partition, false));
        }
        let key = (out.topic.clone(), partition);
        if !link.written.contains_key(&key) {
            let (cfg, t, p) = (self.cfg.clone(), out.topic.clone(), position.clone());
            let limit = self.cfg.options.scan_limit;
            let found = blocking(move || tail::written(&cfg, &t, partition, &p, limit)).await??;
            tracing::debug!(topic = %out.topic, partition, before = %position, found = found.keys.len(), "read back the partition's tail");
            if let Some((offset, newest)) = &found.newest {
                let place = format!("{}/{partition}", out.topic);
                self.origin
                    .check_tail(newest, self.published.as_ref())
                    .map_err(|m| SinkError::Config {
                        problem: format!(
                            "the Kafka sink's last record in {place} (offset {offset}, event {}) {m}",
                            newest.message_id
                        ),
                        fix: self.origin.mismatch_fix(&place),
                    })?;
            }
            link.written.insert(key.clone(), Held::new(found.keys));
        }
        // The id the record carries: the event's, or its dead record's.
        let id = if out.dead.is_some() {
            event.dead_record_id()
        } else {
            event.id
        };
        let there = match link.written.get_mut(&key) {
            Some(w) if w.contains(&EventKey::of(id)) => true,
            Some(w) => {
                w.published(EventKey::of(id));
                false
            }
            None => false,
        };
        Ok((partition, there))
    }
}

async fn blocking<R: Send + 'static>(
    f: impl FnOnce() -> R + Send + 'static,
) -> Result<R, SinkError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| SinkError::Connection(format!("a Kafka client call failed: {e}")))
}

fn headers_of(h: &[(String, String)]) -> OwnedHeaders {
    h.iter()
        .fold(OwnedHeaders::new_with_capacity(h.len()), |acc, (k, v)| {
            acc.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            })
        })
}

impl Sink for KafkaSink {
    fn name(&self) -> &'static str {
        "kafka"
    }

    fn stores_position(&self) -> bool {
        true
    }

    fn guard_wire(&mut self, fence: Fence) {
        self.fence = Some(fence);
    }

    fn set_origin(&mut self, origin: &Origin) {
        self.origin = origin.clone();
    }

    fn is_broken(&self) -> bool {
        self.link.is_none()
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        self.drop_link();
        let link = self.open().await?;
        tracing::info!(
            sink = %self.redacted,
            relay = %self.cfg.name,
            declare = ?self.cfg.declare,
            "connected to Kafka"
        );
        self.skipped = 0;
        self.link = Some(link);
        Ok(())
    }

    async fn publish(&mut self, event: &OutboxEvent) -> Result<Delivery, SinkError> {
        if self.link.is_none() {
            return Err(SinkError::Connection("not connected".into()));
        }
        let refused = self
            .refused
            .lock()
            .ok()
            .and_then(|r| r.get(&event.position.to_string()).cloned());
        let mut out = record::render(&self.cfg, event, refused.as_deref(), &self.origin);
        let (mut partition, there) = self.place(&out, event).await?;
        if self
            .published
            .as_ref()
            .is_none_or(|p| event.position.compare(p) == Some(std::cmp::Ordering::Greater))
        {
            self.published = Some(event.position.clone());
        }
        if there {
            // Written by an earlier life (or before a lost connection): producing it again
            // is the duplicate this check exists to avoid.
            if self.skipped == 0 {
                tracing::info!(position = %event.position, topic = %out.topic, partition, "replayed events already in Kafka are acknowledged without publishing them again");
            }
            self.skipped += 1;
            return Ok(Delivery::Accepted);
        }
        if let Some(reason) = &out.dead {
            tracing::warn!(id = %event.dead_record_id(), position = %event.position, reason = %reason, topic = %out.topic, "poison event: publishing a dead record without the body");
        }
        let link = self.link.as_mut().expect("connected");
        let delivery = loop {
            let rec = FutureRecord {
                topic: &out.topic,
                partition: Some(partition),
                key: Some(out.key.as_bytes()),
                payload: (!out.tombstone).then_some(&out.value[..]),
                timestamp: Some(out.timestamp_ms),
                headers: Some(headers_of(&out.headers)),
            };
            match link.producer.send_result(rec) {
                Ok(d) => break d,
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), _)) => {
                    // librdkafka's queue drains as the broker acknowledges: wait for room.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::MessageSizeTooLarge), _))
                    if out.dead.is_none() =>
                {
                    out = record::render(
                        &self.cfg,
                        event,
                        Some("the record is larger than the producer's message.max.bytes"),
                        &self.origin,
                    );
                    // The dead topic's first partition: dead records keep no order.
                    partition = 0;
                }
                Err((e, _)) => {
                    return Err(SinkError::Connection(format!(
                        "handing a record to the Kafka producer: {e}"
                    )))
                }
            }
        };
        let refused = self.refused.clone();
        let position = event.position.to_string();
        let timeout = self.cfg.op_timeout;
        Ok(Delivery::Pending(
            async move {
                match delivery.await {
                    Ok(Ok(_)) => Ok(()),
                    Ok(Err((e, _))) => {
                        if e.rdkafka_error_code() == Some(RDKafkaErrorCode::MessageSizeTooLarge) {
                            let reason = format!("the broker refused the record: {e} (the topic's max.message.bytes or the broker's message.max.bytes)");
                            if let Ok(mut r) = refused.lock() {
                                r.insert(position, reason.clone());
                            }
                            return Err(SinkError::Rejected(reason));
                        }
                        Err(delivery_error(&e, timeout))
                    }
                    Err(_) => Err(SinkError::Connection(
                        "the Kafka producer was replaced before the delivery report".into(),
                    )),
                }
            }
            .boxed(),
        ))
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        // Every event is Pending until its delivery report: nothing is buffered here.
        Ok(())
    }
}
