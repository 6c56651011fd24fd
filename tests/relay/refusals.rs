//! The refusal table of docs/guarantees.md, row by row, on both sources: a broker that keeps
//! refusing one event — it returns it (`NO_ROUTE`: an exchange without an alternate exchange
//! or queue under `--declare off` or `passive`, or a missing `<exchange>.dead` for a poison event), nacks it
//! (a full `x-overflow=reject-publish` queue), or closes the channel (`NOT_FOUND`: the exchange
//! is gone) — costs a few paced reconnects, holds
//! the stored position before the refused event, and once the broker accepts again every event
//! arrives once, in commit order. Each scenario runs as `<scenario>::postgres` and
//! `<scenario>::mariadb`.

use crate::common;

use common::amqp::{self, header_str, message_id, Topology};
use common::source_db::{on_both_sources, Pos, SourceDb};
use common::*;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);
/// How long the refusal is watched for pacing.
const WATCH: Duration = Duration::from_secs(5);

on_both_sources!(
    an_unroutable_event_under_declare_off_is_retried_paced_then_delivered_in_order,
    a_poison_event_without_its_dead_queue_is_retried_paced_then_dead_lettered_in_order,
    a_missing_exchange_closing_the_channel_is_retried_paced_then_delivered_in_order,
    a_full_reject_publish_queue_is_retried_paced_then_delivered_in_order,
    an_unroutable_event_under_declare_passive_is_retried_paced_then_delivered_in_order,
);

/// How the broker refuses, and what makes it accept.
#[derive(Clone, Copy, PartialEq)]
enum Refusal {
    /// Exchange without alternate exchange or queue: `NO_ROUTE`; fixed by binding a queue.
    NoRoute,
    /// Every event poison (`--max-message-bytes 8`) and no `<exchange>.dead`: `NO_ROUTE`;
    /// fixed by declaring the dead queue.
    MissingDead,
    /// No exchange at all: the channel is closed with `NOT_FOUND`; fixed by declaring it.
    NotFound,
    /// `--declare passive` over a pre-declared topology whose exchange has no alternate
    /// exchange (a passive declaration cannot see arguments) and no queue: `NO_ROUTE`; fixed
    /// by binding a queue.
    Passive,
    /// A bound queue with `x-max-length=3`, `x-overflow=reject-publish` and no consumer: the
    /// fourth event is nacked; fixed by consuming. With `--window 1`, the configuration that
    /// keeps first deliveries in order behind such a queue (docs/guarantees.md).
    RejectPublish,
}

async fn declare_exchange(topo: &Topology) {
    topo.channel()
        .await
        .exchange_declare(
            topo.exchange.clone().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await
        .unwrap();
}

async fn refused_then_accepted<D: SourceDb>(kind: Refusal, tag: &str) {
    let db = D::create(tag).await;
    let mut topo = Topology::new(tag).await;
    let pattern = format!("{tag}.#");
    let topic = format!("{tag}.refused");
    let mut queue = None;
    match kind {
        Refusal::NoRoute => declare_exchange(&topo).await,
        Refusal::MissingDead => {
            declare_exchange(&topo).await;
            queue = Some(topo.bind_queue("late", &pattern).await);
        }
        Refusal::NotFound => {}
        Refusal::Passive => {
            declare_exchange(&topo).await;
            let ch = topo.channel().await;
            let unrouted = topo.unrouted();
            ch.exchange_declare(
                unrouted.clone().into(),
                lapin::ExchangeKind::Fanout,
                lapin::options::ExchangeDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
            for q in [unrouted.clone(), topo.dead()] {
                ch.queue_declare(
                    q.into(),
                    lapin::options::QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .unwrap();
            }
            topo.adopt(&[], std::slice::from_ref(&unrouted));
        }
        Refusal::RejectPublish => {
            declare_exchange(&topo).await;
            let q = format!("{}.bounded", topo.exchange);
            let mut qargs = lapin::types::FieldTable::default();
            qargs.insert("x-max-length".into(), lapin::types::AMQPValue::LongInt(3));
            qargs.insert(
                "x-overflow".into(),
                lapin::types::AMQPValue::LongString("reject-publish".into()),
            );
            let ch = topo.channel().await;
            ch.queue_declare(
                q.clone().into(),
                lapin::options::QueueDeclareOptions {
                    durable: true,
                    ..Default::default()
                },
                qargs,
            )
            .await
            .unwrap();
            ch.queue_bind(
                q.clone().into(),
                topo.exchange.clone().into(),
                pattern.clone().into(),
                lapin::options::QueueBindOptions::default(),
                lapin::types::FieldTable::default(),
            )
            .await
            .unwrap();
            topo.adopt(std::slice::from_ref(&q), &[]);
        }
    }
    let name = unique("r");
    let port = free_local_port();
    let addr = format!("127.0.0.1:{port}");
    let mut args = vec![
        "run".to_string(),
        "--source".into(),
        db.dsn(),
        "--name".into(),
        name.clone(),
        "--exchange".into(),
        topo.exchange.clone(),
        "--declare".into(),
        if kind == Refusal::Passive {
            "passive".into()
        } else {
            "off".into()
        },
        "--metrics-addr".into(),
        addr,
        "--log-level".into(),
        "info,lapin=warn".into(),
    ];
    match kind {
        Refusal::MissingDead => args.extend(["--max-message-bytes".into(), "8".into()]),
        Refusal::RejectPublish => args.extend(["--window".into(), "1".into()]),
        _ => {}
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut relay = Relay::start_with_env(&args, &[("OUTBOXD_SINK", &amqp::url())]);
    db.wait_streaming(&name).await;
    let before = db.stored_pos(&name).await;
    let expected = db.write(5, 1, &topic).await;

    // The refusal is named: the event and the broker's reason.
    // The first event refused: the fourth behind a queue that holds three.
    let (refused, reason) = match kind {
        Refusal::NotFound => (0, "NOT_FOUND"),
        Refusal::RejectPublish => (3, "nack"),
        _ => (0, "NO_ROUTE"),
    };
    relay
        .wait_for_stderr(&[&expected[refused].to_string(), reason], T)
        .await;
    wait_for("the refusal to be counted as a reconnect", T, || async {
        sink_reconnects(port).await >= 1.0
    })
    .await;
    let at = sink_reconnects(port).await;
    tokio::time::sleep(WATCH).await;
    let during = sink_reconnects(port).await - at;
    // Paced, 100 ms doubling: at most 7 attempts fit in 5 s (a storm made thousands).
    assert!(
        (1.0..=7.0).contains(&during),
        "{during} reconnects in {WATCH:?}: paced retries, not a storm\n{}",
        relay.stderr()
    );
    // Nothing was confirmed: the stored position has not passed the refused event.
    let held = db.stored_pos(&name).await;

    // The broker accepts again.
    let mut got = Vec::new();
    let q = match kind {
        Refusal::RejectPublish => {
            // Room in the queue: take what it holds, and the rest follows.
            let q = format!("{}.bounded", topo.exchange);
            got = topo.take(&q, refused, T).await;
            q
        }
        Refusal::MissingDead => {
            let dead = topo.dead();
            topo.channel()
                .await
                .queue_declare(
                    dead.clone().into(),
                    lapin::options::QueueDeclareOptions {
                        durable: true,
                        ..Default::default()
                    },
                    lapin::types::FieldTable::default(),
                )
                .await
                .unwrap();
            dead
        }
        Refusal::NotFound => {
            declare_exchange(&topo).await;
            topo.bind_queue("late", &pattern).await
        }
        Refusal::NoRoute | Refusal::Passive => topo.bind_queue("late", &pattern).await,
    };
    got.extend(topo.take(&q, expected.len() - got.len(), T).await);
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let ids: Vec<Uuid> = got.iter().map(message_id).collect();
    assert_eq!(ids, expected, "every event once, in commit order");
    assert_eq!(topo.queue_len(&q).await, 0, "and nothing more");
    if let Some(q) = queue {
        assert_eq!(
            topo.queue_len(&q).await,
            0,
            "poison events reach only .dead"
        );
    }
    let first = header_str(&got[refused], "x-source-position").expect("a source position");
    let first = Pos::of_event(&first).expect("a position");
    assert!(
        held == before || held.is_some_and(|h| first.after(h)),
        "the stored position {held:?} passed the refused event at {first:?}"
    );
    let stored = db.stored_pos(&name).await.expect("a stored position");
    let last = header_str(got.last().unwrap(), "x-source-position").unwrap();
    assert!(
        !Pos::of_event(&last).unwrap().after(stored),
        "after the stop the position {stored:?} covers the last event {last}"
    );
}

async fn an_unroutable_event_under_declare_off_is_retried_paced_then_delivered_in_order<
    D: SourceDb,
>() {
    refused_then_accepted::<D>(Refusal::NoRoute, "rfnr").await;
}

async fn a_poison_event_without_its_dead_queue_is_retried_paced_then_dead_lettered_in_order<
    D: SourceDb,
>() {
    refused_then_accepted::<D>(Refusal::MissingDead, "rfmd").await;
}

async fn a_missing_exchange_closing_the_channel_is_retried_paced_then_delivered_in_order<
    D: SourceDb,
>() {
    refused_then_accepted::<D>(Refusal::NotFound, "rfnf").await;
}

async fn an_unroutable_event_under_declare_passive_is_retried_paced_then_delivered_in_order<
    D: SourceDb,
>() {
    refused_then_accepted::<D>(Refusal::Passive, "rfps").await;
}

async fn a_full_reject_publish_queue_is_retried_paced_then_delivered_in_order<D: SourceDb>() {
    refused_then_accepted::<D>(Refusal::RejectPublish, "rfrp").await;
}
