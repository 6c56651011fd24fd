//! A message that failed `--max-failures` times: `halt` stops the runner with it unacked,
//! `skip` acks it without its effect, `park` publishes it with the error to `<queue>.dead` on
//! the session's confirm-mode channel and acks it only once the broker confirmed the copy.

use super::options::OnPoison;
use super::worker::ack;
use super::{Job, Shared};
use crate::backoff::Backoff;
use crate::consumer::ConsumerError;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, ShortString};
use lapin::Confirmation;
use std::sync::atomic::Ordering;
use std::time::Duration;

pub(super) async fn poison(
    job: &Job,
    id: &str,
    error: &ConsumerError,
    failures: u32,
    shared: &Shared,
) {
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
