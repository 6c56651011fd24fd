//! The RabbitMQ sink (docs/message-format.md): every event becomes one persistent, `mandatory` message on
//! the topic exchange `<exchange>` with the topic as routing key, and counts as durable only
//! when the broker acknowledged it without returning it first. Events that cannot be messages
//! (poison) become body-less records on the queue `<exchange>.dead`. Recovery is not done here:
//! on any failure the relay calls [`Sink::connect`] again, which builds a fresh connection and
//! channel, and republishes what was unconfirmed, so lapin's own auto-recovery stays off.
//!
//! Topology (declared with `--declare auto`, checked with `passive`, left alone with `off`):
//!
//! - `<exchange>`: durable topic exchange, argument `alternate-exchange = <exchange>.unrouted`;
//! - `<exchange>.unrouted`: durable fanout exchange, bound to the durable queue of the same
//!   name, so an event no queue wants is kept rather than dropped or returned;
//! - `<exchange>.dead`: durable queue for poison records, published to through the default
//!   exchange (routing key = queue name). The default exchange needs no declaration or
//!   binding and cannot be misrouted, so a dead record reaches that queue or is returned.
//!
//! With `--partitions N` (or `--group-partitions`) every message also carries its partition
//! headers, and the relay's own partition layout is declared after the above (see
//! [`super::topology`] and [`super::partition`]).
//!
//! Confirms are pipelined (the relay bounds the window). Without partitions the sink publishes
//! on one channel; with `--partitions N` on one channel per partition (at most
//! [`link::MAX_LANES`]), so the partitions' confirmations overlap instead of queueing behind one
//! channel's. lapin attaches a `basic.return` to
//! whichever confirmation it completes next, which under multiple-acks may be another message
//! than the one returned, so returns are matched to events by `message_id` (= event id) in a
//! per-channel tracker that settles every confirmation only after recording all returns that
//! arrived with or before it.
//!
//! The folder keeps the concerns apart, so each can be read (and changed) without the
//! others: `config` (what the command line hands over, checked once), `link` (one connection
//! and its publishing channel, TLS included), `declare` (the topology, and what a refused
//! declaration means for the operator), `encode` (one event as an AMQP message or a dead
//! record), `confirms` (settling confirmations against returns), `registry` (the sink's
//! descriptor: its settings from the shared ones, and the checks of `outboxd check`) and
//! `flags` (its own flag). This file holds only the
//! sink itself: construction and the [`Sink`] methods the relay calls, which tie the parts
//! together in order.

mod config;
mod confirms;
mod declare;
mod encode;
#[cfg(feature = "cli")]
mod flags;
mod link;
pub(crate) mod registry;
#[cfg(test)]
mod tests;

pub use config::{validate_exchange, RabbitConfig, DEFAULT_MAX_MESSAGE_BYTES, MAX_HEADER_BYTES};
pub(crate) use encode::Outgoing;
pub use encode::{json_to_amqp, table_size};
// The stream sink renders its messages as this one does.
#[cfg(feature = "rabbitmq-stream")]
pub(crate) use encode::render;
#[cfg(feature = "cli")]
pub use flags::RabbitFlags as Flags;
pub use registry::{Options, DESCRIPTOR};

use super::topology;
use super::{Delivery, FlowControl, Sink, SinkError};
use crate::amqp::Endpoint;
use crate::event::OutboxEvent;
use confirms::{lock, Outcome};
use futures::future::BoxFuture;
use futures::FutureExt;
use lapin::options::BasicPublishOptions;
use link::Link;
use std::collections::HashSet;
use std::sync::atomic::AtomicUsize;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio::sync::oneshot;

/// The sink. Create with [`RabbitSink::new`]; the relay calls `connect` before publishing.
pub struct RabbitSink {
    cfg: RabbitConfig,
    /// The broker's URI, its redacted form and the TLS configuration of an `amqps://` sink.
    endpoint: Endpoint,
    link: Option<Link>,
    flow: Arc<FlowControl>,
    /// Exchanges named by rows (a templated `--exchange`) found or declared so far: each is
    /// declared (or checked) once, on a connection of its own.
    known_exchanges: HashSet<String>,
    /// The broker's `max_message_size` once it refused a message for it (0: not known). No
    /// AMQP frame announces it; a larger body would only be refused again, on every retry.
    broker_max_message: Arc<AtomicUsize>,
    /// The lease's gate: every connection is reset the moment it closes (see
    /// [`link::guard_socket`]).
    fence: Option<crate::state::Fence>,
    /// The relay and the source, written on every message (`crate::identity`).
    origin: crate::identity::Origin,
}

impl RabbitSink {
    /// Parses the URL and loads the TLS files; connects only in [`Sink::connect`].
    pub fn new(cfg: RabbitConfig) -> Result<RabbitSink, crate::Error> {
        let files = crate::amqp::TlsFiles {
            ca_file: cfg.ca_file.clone(),
            cert_file: cfg.cert_file.clone(),
            key_file: cfg.key_file.clone(),
        };
        let endpoint = Endpoint::parse(
            &cfg.url,
            "the sink",
            files,
            "--sink-ca/--sink-cert/--sink-key",
        )?;
        if cfg.partitioning.partitions > 0 {
            topology::validate_name("--exchange", &cfg.exchange)?;
        }
        Ok(RabbitSink {
            cfg,
            endpoint,
            link: None,
            flow: Arc::default(),
            known_exchanges: HashSet::new(),
            broker_max_message: Arc::default(),
            fence: None,
            origin: Default::default(),
        })
    }
}

impl Sink for RabbitSink {
    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    fn stores_position(&self) -> bool {
        true
    }

    fn flow_control(&self) -> Option<Arc<FlowControl>> {
        Some(self.flow.clone())
    }

    fn guard_wire(&mut self, fence: crate::state::Fence) {
        self.fence = Some(fence);
    }

    fn set_origin(&mut self, origin: &crate::identity::Origin) {
        self.origin = origin.clone();
    }

    fn is_broken(&self) -> bool {
        self.link
            .as_ref()
            .is_none_or(|l| l.state.borrow().error.is_some())
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        // Always a fresh connection: the old one (if any) is closed by dropping it, and its
        // unsettled confirmations with it.
        self.link = None;
        self.flow.unblock();
        let link = match tokio::time::timeout(self.cfg.op_timeout, self.open()).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(SinkError::Connection(format!(
                    "connecting to RabbitMQ at {} took longer than {:?}",
                    self.endpoint.redacted, self.cfg.op_timeout
                )))
            }
        };
        tracing::info!(
            sink = %self.endpoint.redacted,
            exchange = %self.cfg.exchange,
            declare = ?self.cfg.declare,
            partitions = self.cfg.partitioning.partitions,
            frame_max = link.conn.configuration().frame_max(),
            "connected to RabbitMQ"
        );
        self.link = Some(link);
        Ok(())
    }

    async fn publish(&mut self, event: &OutboxEvent) -> Result<Delivery, SinkError> {
        self.wait_until_writable().await?;
        let route = if event.poison.is_some() {
            Err(String::new())
        } else {
            self.route(event).await?
        };
        let link = self.link.as_ref().expect("checked by wait_until_writable");
        let out = self.render(event, link.header_limit, route);
        if let Some(reason) = &out.dead {
            tracing::warn!(
                id = %event.dead_record_id(),
                position = %event.position,
                reason = %reason,
                queue = %out.routing_key,
                "poison event: publishing a dead-letter record without the body"
            );
        }
        let (done_tx, done_rx) = oneshot::channel();
        let id = match out.dead {
            Some(_) => event.dead_record_id(),
            None => event.id,
        };
        // Events of one aggregate always take the same lane (the partition's), so per-aggregate
        // order holds on the wire; the relay finalises acknowledgements in its own order across
        // lanes, so the stored position still only passes the confirmed prefix of the stream.
        let lane = &link.lanes[lane_of(&event.aggregate_id, &self.cfg, link.lanes.len())];
        let channel = lane.channel.clone();
        let broker_max = self.broker_max_message.clone();
        let Outgoing {
            exchange,
            routing_key,
            body,
            props,
            ..
        } = out;
        let mut fut: BoxFuture<'static, Outcome> = async move {
            let result = match channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    &body,
                    props,
                )
                .await
            {
                Ok(confirm) => confirm.await,
                Err(e) => Err(e),
            };
            // A body over the broker's `max_message_size` closes the channel (406); from now
            // on such a body is dead-lettered (see `render`) instead of refused forever. The
            // limit is recorded before the relay hears of the failure and republishes.
            if let Err(e) = &result {
                encode::learn_size_limit(e, &broker_max);
            }
            Outcome {
                id,
                result,
                done: done_tx,
            }
        }
        .boxed();

        // Start the publish here, under the tracker's lock: the first poll hands the frames to
        // lapin (so they go out in the relay's order) and registers the delivery tag, and the
        // confirmation is tracked before anything can settle it. The socket write and the
        // confirmation then complete in the tracker's task, so publishing is pipelined.
        {
            let t = lock(&lane.tracker);
            // The first poll registers the tracker task's waker with lapin, so the task runs
            // when this write completes and then polls the future (pushed futures are queued to
            // be polled) with its own waker: no wake per publish. Before the task first ran
            // there is no waker yet, and its first run polls everything pushed.
            let waker = t.waker.as_ref();
            let mut cx =
                Context::from_waker(waker.unwrap_or_else(|| futures::task::noop_waker_ref()));
            // On a busy machine the whole round trip can finish inside this first poll; the
            // outcome is then settled by the tracker like any other, after the returns that
            // came before it, and the task is woken to do so.
            let ready = if let Poll::Ready(outcome) = fut.poll_unpin(&mut cx) {
                fut = futures::future::ready(outcome).boxed();
                true
            } else {
                false
            };
            t.pending.push(fut);
            if let (true, Some(w)) = (ready, waker) {
                w.wake_by_ref();
            }
        }

        // A write that does not finish is caught by the relay's confirm timeout; while the
        // broker blocks the connection the confirmation may take as long as the alarm lasts.
        Ok(Delivery::Pending(
            async move {
                done_rx.await.unwrap_or_else(|_| {
                    Err(SinkError::Connection(
                        "the RabbitMQ connection was replaced before the confirmation".into(),
                    ))
                })
            }
            .boxed(),
        ))
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        // Every event is Pending until confirmed: nothing is buffered here.
        Ok(())
    }
}

/// The lane of an event: its partition's (`--partitions N`), folded onto the lanes there are.
fn lane_of(aggregate_id: &str, cfg: &RabbitConfig, lanes: usize) -> usize {
    if lanes <= 1 {
        return 0;
    }
    let p = crate::sink::partition::partition_of(aggregate_id, cfg.partitioning.partitions);
    p as usize % lanes
}
