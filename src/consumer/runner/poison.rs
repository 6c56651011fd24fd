//! A message that failed `--max-failures` times: `halt` stops the runner with it unsettled,
//! `skip` settles it without its effect, `park` copies it with the error to its dead target
//! and settles it only once the broker confirmed the copy. On a queue the copy goes to
//! `<queue>.dead` on the session's confirm-mode channel ([`park`]); what the headers of a
//! parked copy say is [`parked_headers`], for queues and streams alike.

use super::options::OnPoison;
use super::worker::Delivered;
use super::{Job, Shared};
use crate::backoff::Backoff;
use crate::consumer::ConsumerError;
use lapin::options::BasicPublishOptions;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Confirmation};
use std::sync::atomic::Ordering;
use std::time::Duration;

pub(super) async fn poison<J: Delivered>(
    job: &J,
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
            job.settle(id, stats).await;
        }
        OnPoison::Park => {
            let dead = job.dead_target(&shared.opts);
            let mut backoff = Backoff::new(shared.opts.retry_min, shared.opts.retry_max);
            loop {
                match job.park(error, failures, &shared.opts).await {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::warn!(id, error = %e, queue = %dead, "cannot park the message yet");
                        if job.gone() {
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
            job.settle(id, stats).await;
        }
    }
}

/// A parked message not confirmed within this is published again (the ack waits).
const PARK_TIMEOUT: Duration = Duration::from_secs(30);

/// Header values stay below this, so a parked message always fits its frame.
const ERROR_HEADER_MAX: usize = 1024;

/// The properties of a parked copy: those of the message, with why and where from in
/// `x-outboxd-*` headers (`x-outboxd-error`, `-failures`, `-parked-at`, and `from`: the
/// queue, exchange and routing key, or the stream and offset), persistent.
pub(super) fn parked_headers(
    props: &BasicProperties,
    error: &ConsumerError,
    failures: u32,
    from: &[(&str, AMQPValue)],
) -> BasicProperties {
    let mut text = error.to_string();
    if text.len() > ERROR_HEADER_MAX {
        let mut end = ERROR_HEADER_MAX;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    // Only this consumer says why and where from: a message that arrived with `x-outboxd-*`
    // headers of its own (another publisher's, or a copy parked before and sent back) keeps
    // none of them, so nothing it carried can pose as the consumer's account.
    let mut headers: FieldTable = props
        .headers()
        .as_ref()
        .map(|h| {
            h.inner()
                .iter()
                .filter(|(k, _)| !k.as_str().to_ascii_lowercase().starts_with("x-outboxd-"))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect::<std::collections::BTreeMap<_, _>>()
                .into()
        })
        .unwrap_or_default();
    let s = |v: &str| AMQPValue::LongString(v.into());
    headers.insert("x-outboxd-error".into(), s(&text));
    headers.insert(
        "x-outboxd-failures".into(),
        AMQPValue::LongLongInt(failures.into()),
    );
    for (k, v) in from {
        headers.insert((*k).into(), v.clone());
    }
    headers.insert(
        "x-outboxd-parked-at".into(),
        s(&chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Micros, true)),
    );
    props.clone().with_headers(headers).with_delivery_mode(2)
}

/// Publishes the message, body and properties intact, to `<queue>.dead` through the default
/// exchange, with why and where from in `x-outboxd-*` headers; done when the broker confirmed
/// it (and did not return it).
pub(super) async fn park(
    job: &Job,
    dead: &str,
    error: &ConsumerError,
    failures: u32,
    queue: &str,
) -> Result<(), ConsumerError> {
    let s = |v: &str| AMQPValue::LongString(v.into());
    let props = parked_headers(
        &job.properties,
        error,
        failures,
        &[
            ("x-outboxd-queue", s(queue)),
            ("x-outboxd-exchange", s(&job.exchange)),
            ("x-outboxd-routing-key", s(&job.routing_key)),
        ],
    );
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
    fn a_parked_copy_carries_only_this_consumers_account() {
        let mut forged = FieldTable::default();
        forged.insert(
            "x-outboxd-exchange".into(),
            AMQPValue::LongString("forged".into()),
        );
        forged.insert(
            "X-Outboxd-Stream".into(),
            AMQPValue::LongString("forged".into()),
        );
        forged.insert(
            "traceparent".into(),
            AMQPValue::LongString("00-ab-cd-01".into()),
        );
        let props = BasicProperties::default().with_headers(forged);
        let error = ConsumerError::config("bad payload", "fix the producer");
        let parked = parked_headers(
            &props,
            &error,
            5,
            &[("x-outboxd-queue", AMQPValue::LongString("invoices".into()))],
        );
        let h = parked.headers().clone().unwrap();
        let names: Vec<&str> = h.inner().keys().map(|k| k.as_str()).collect();
        assert!(!names.contains(&"X-Outboxd-Stream"), "{names:?}");
        assert!(!names.contains(&"x-outboxd-exchange"), "{names:?}");
        assert!(names.contains(&"traceparent"), "{names:?}");
        assert!(names.contains(&"x-outboxd-queue"), "{names:?}");
        assert!(names.contains(&"x-outboxd-error"), "{names:?}");
    }
}
