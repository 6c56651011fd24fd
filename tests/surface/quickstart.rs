//! `scripts/quickstart.sh` (the README's first command) works end to end on this machine: it
//! exits 0, prints the three events of its one transaction as consumed from RabbitMQ (message
//! id, routing key, the relay's headers, body) in commit order, and leaves nothing behind — no
//! database, slot, exchange or queue.

use crate::common;

use common::*;
use std::process::Command;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quickstart_prints_three_events_and_cleans_up() {
    let out = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/quickstart.sh"
        ))
        .env("OUTBOXD_BIN", env!("CARGO_BIN_EXE_outboxd"))
        // scripts/test.sh configured the services already (the quickstart's own call of
        // scripts/services.sh is the same script, idempotent).
        .env("OUTBOXD_SKIP_SERVICES", "1")
        .output()
        .expect("bash runs scripts/quickstart.sh");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "quickstart failed ({:?}):\n{stdout}\n{stderr}",
        out.status
    );

    // The three messages, in commit order, each with an id and the relay's headers.
    let messages: Vec<(&str, &str)> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("message "))
        .map(|l| {
            let (id, rest) = l.split_once("  routing key ").expect("message line");
            (id, rest)
        })
        .collect();
    assert_eq!(
        messages.iter().map(|m| m.1).collect::<Vec<_>>(),
        ["invoice.issued", "invoice.sent", "invoice.paid"],
        "{stdout}"
    );
    for (id, _) in &messages {
        id.parse::<uuid::Uuid>().expect("message id is a UUID");
    }
    let positions: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.trim().strip_prefix("header x-source-position = "))
        .collect();
    assert_eq!(positions.len(), 3, "{stdout}");
    assert!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "positions increase in commit order: {positions:?}"
    );
    assert!(
        stdout.contains("header traceparent = 00-4bf92f"),
        "{stdout}"
    );
    assert!(stdout.contains(r#"body   {"invoice_id": 42, "total": "1499.90"}"#));
    assert!(
        stdout.contains("ok   publication:"),
        "check after setup: {stdout}"
    );
    assert!(stdout.contains("stored position"), "status: {stdout}");
    assert!(
        stdout.contains("outboxd_events_confirmed_total 3"),
        "metrics: {stdout}"
    );
    assert!(stdout.contains("quickstart: ok"), "{stdout}");

    // Nothing left behind.
    let db = stdout
        .lines()
        .find_map(|l| l.strip_prefix("== cleaned up: database "))
        .and_then(|l| l.split(',').next())
        .expect("the cleanup line names the database")
        .to_string();
    let admin = pg_connect(PG_ADMIN).await;
    let left: i64 = admin
        .query_one(
            "SELECT (SELECT count(*) FROM pg_database WHERE datname = $1)
                  + (SELECT count(*) FROM pg_replication_slots WHERE database = $1)",
            &[&db],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0, "database {db} or its slot is left behind");
    let exchange = db.replace("outboxd_demo_", "demo_");
    let conn = common::amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let passive = ch
        .exchange_declare(
            exchange.clone().into(),
            lapin::ExchangeKind::Topic,
            lapin::options::ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await;
    assert!(passive.is_err(), "exchange {exchange} is left behind");
}
