//! The broker side of the loop: connecting (with the relay's reading of the URL), declaring
//! or checking the topology, opening the consuming, parking and probing channels, and
//! [`dispatch`], which hands each delivery to its worker (by aggregate, so one aggregate's
//! messages stay in queue order) until the stream fails or the runner stops.

use super::options::{OnPoison, RunnerOptions};
use super::worker::ACK_TIMEOUT;
use super::{Job, Shared};
use crate::consumer::ConsumerError;
use crate::progress::{Progress, Unit};
use futures::StreamExt;
use lapin::options::{
    BasicCancelOptions, BasicConsumeOptions, BasicQosOptions, ConfirmSelectOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::protocol::AMQPErrorKind;
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Connection};
use std::hash::{Hash, Hasher};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

/// One broker connection: the consuming channel, and the confirm-mode channel `park`
/// publishes on (one publish at a time, so a `basic.return` belongs to that publish).
pub(super) struct Session {
    pub(super) conn: Connection,
    pub(super) channel: Channel,
    /// For `until_empty`: passive declarations of the queue (a failed one closes its channel,
    /// which must not be the consuming one).
    pub(super) probe: Option<Channel>,
    pub(super) park: tokio::sync::Mutex<Option<Channel>>,
    pub(super) tag: String,
}

/// Connecting, declaring and starting the consumer together take at most this long.
pub(super) const SESSION_TIMEOUT: Duration = Duration::from_secs(60);

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

/// Declares `queue` (or, with `passive`, checks that it exists) on the setup channel; a
/// refusal comes back as a setup problem saying `what` and `fix`.
async fn declare_queue(
    setup: &Channel,
    queue: &str,
    options: QueueDeclareOptions,
    args: FieldTable,
    what: &str,
    fix: &str,
) -> Result<(), ConsumerError> {
    setup
        .queue_declare(queue.to_string().into(), options, args)
        .await
        .map(drop)
        .map_err(|e| declare_error(e, what, fix))
}

pub(super) async fn open_session(
    opts: &RunnerOptions,
) -> Result<(Session, lapin::Consumer), ConsumerError> {
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
            declare_queue(
                &setup,
                q,
                QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                args,
                &format!("cannot declare queue {q:?}"),
                "a queue of that name exists with other arguments (x-single-active-consumer?): use it as it is (drop --bind) or another --queue",
            )
            .await?;
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
            declare_queue(
                &setup,
                q,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
                &format!("queue {q:?} does not exist"),
                "declare it (e.g. outboxd topology), or let the consumer declare and bind it: --exchange outbox --bind 'invoice.#'",
            )
            .await?;
        }
    }
    let park = if opts.on_poison == OnPoison::Park {
        let dead = opts.dead_queue();
        declare_queue(
            &setup,
            &dead,
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
            &format!("cannot declare the poison queue {dead:?}"),
            "grant configure permission on it, or use --on-poison halt|skip",
        )
        .await?;
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
///
/// With `until_empty`, a queue that reads as drained does not stop the runner at once: the
/// broker counts what it already sent (prefetch) as unacked, not ready, so deliveries can still
/// be on the wire or in the consumer's buffer. The consumer is cancelled instead; the broker
/// answers after the last delivery it sent, so the stream yields those and then ends. Once
/// the workers have settled them, the runner stops.
pub(super) async fn dispatch(
    session: &Arc<Session>,
    mut consumer: lapin::Consumer,
    workers: &[mpsc::Sender<Job>],
    shared: &Shared,
) -> Result<(), ConsumerError> {
    let mut probe = tokio::time::interval(Duration::from_millis(100));
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // `until_empty` found the queue drained and cancelled the consumer: what the stream still
    // yields was sent before, and its end is the broker's `cancel-ok`.
    let mut draining = false;
    // `until_empty`: how far the drain is, settled messages of an estimate (settled, in hand
    // and ready at the last look).
    let settled_before = shared.stats.settled();
    let mut drain = session
        .probe
        .as_ref()
        .map(|_| Progress::command("drain", &shared.opts.queue, Unit::Messages, None));
    loop {
        let next = tokio::select! {
            d = async {
                if draining {
                    // After `cancel-ok` every delivery sent before it is already in the
                    // client (frames of one channel arrive in order): the stream yields at
                    // once or has nothing more. lapin was seen once not to end the stream of a
                    // cancelled consumer (a batch run that never stopped): a quiet second is
                    // its end.
                    tokio::time::timeout(DRAIN_QUIET, consumer.next())
                        .await
                        .unwrap_or(None)
                } else {
                    consumer.next().await
                }
            } => d,
            _ = probe.tick(), if session.probe.is_some() && !draining => {
                // Nothing in hand before and after the look, and nothing ready: checked in that
                // order, so a delivery that arrives in between is not missed.
                let idle_before = shared.in_flight.load(Ordering::SeqCst) == 0;
                let ready = queue_ready(session, shared).await?;
                if let Some(p) = &mut drain {
                    let done = shared.stats.settled().saturating_sub(settled_before);
                    let in_hand = shared.in_flight.load(Ordering::SeqCst);
                    p.set_estimate(Some(done + in_hand + u64::from(ready)));
                    p.set(done);
                }
                if idle_before && ready == 0 && shared.in_flight.load(Ordering::SeqCst) == 0 {
                    tracing::info!(queue = %shared.opts.queue, "the queue has nothing ready and nothing is in hand: cancelling the consumer, then finishing what the broker already sent (--until-empty)");
                    cancel_consumer(session).await?;
                    draining = true;
                }
                continue;
            }
            _ = shared.stop.cancelled() => {
                if !draining {
                    let _ = tokio::time::timeout(
                        ACK_TIMEOUT,
                        session
                            .channel
                            .basic_cancel(session.tag.clone().into(), BasicCancelOptions::default()),
                    )
                    .await;
                }
                return Ok(());
            }
        };
        let d = match next {
            Some(Ok(d)) => d,
            Some(Err(e)) => return Err(e.into()),
            None if draining => {
                let r = finish_drained(shared).await;
                if let Some(mut p) = drain.take().filter(|_| r.is_ok()) {
                    p.set(shared.stats.settled().saturating_sub(settled_before));
                    p.finish();
                }
                return r;
            }
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

/// How long a cancelled consumer's stream may stay silent before it counts as ended.
const DRAIN_QUIET: Duration = Duration::from_secs(1);

/// `basic.cancel` for `until_empty`, bounded: a broker that does not answer is a lost
/// connection (the runner reconnects and looks at the queue again).
async fn cancel_consumer(session: &Session) -> Result<(), ConsumerError> {
    match tokio::time::timeout(
        ACK_TIMEOUT,
        session
            .channel
            .basic_cancel(session.tag.clone().into(), BasicCancelOptions::default()),
    )
    .await
    {
        Ok(r) => r.map_err(ConsumerError::from),
        Err(_) => Err(ConsumerError::Broker {
            message: format!(
                "the broker did not confirm cancelling the consumer within {ACK_TIMEOUT:?}"
            ),
            retryable: true,
        }),
    }
}

/// The cancelled consumer's stream has ended: every delivery the broker sent is with a worker.
/// Waits until the workers have settled them all (or the runner is stopped otherwise, by a
/// signal or a halt), then stops the runner.
async fn finish_drained(shared: &Shared) -> Result<(), ConsumerError> {
    // The workers count down `in_flight` without signalling; its reaching zero is checked
    // often enough not to add noticeably to a batch run.
    let mut check = tokio::time::interval(Duration::from_millis(10));
    loop {
        tokio::select! {
            _ = check.tick() => {
                if shared.in_flight.load(Ordering::SeqCst) == 0 {
                    tracing::info!(queue = %shared.opts.queue, "every message sent before the queue read empty is settled: stopping (--until-empty)");
                    shared.stop.cancel();
                    return Ok(());
                }
            }
            _ = shared.stop.cancelled() => return Ok(()),
        }
    }
}

/// How many messages the queue has ready (a passive declaration on the probe channel).
async fn queue_ready(session: &Session, shared: &Shared) -> Result<u32, ConsumerError> {
    let Some(ch) = &session.probe else {
        return Ok(u32::MAX);
    };
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
    Ok(q.message_count())
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
}
