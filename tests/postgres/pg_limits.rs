//! Limits on what the Postgres replication stream may send: a message larger than the reader
//! accepts for `--max-message-bytes` stops the relay with the fix, before it is buffered (the
//! library's own limit is 1 GiB).

use crate::common;

use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replication_message_above_the_limit_stops_the_relay_naming_the_flag() {
    let db = PgDb::create("limits").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    // 1 KiB messages: the reader takes rows up to 2 KiB + 1 MiB.
    let mut relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--commit-offsets",
        "--max-message-bytes",
        "1KiB",
        "--log-level",
        "info",
    ]);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    let mut client = db.client().await;
    let small = write_events(&mut client, 1, 1, "limits.small").await;
    wait_for("the small event", T, || async { relay.line_count() >= 1 }).await;
    // A 3 MiB payload: over the reader's limit.
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let big = serde_json::json!({ "blob": "x".repeat(3 * 1024 * 1024) });
    let mut tx = client.transaction().await.unwrap();
    outbox
        .write(&mut tx, "limits.big", "1", &big)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let code = relay.wait_exit(T).await;
    let stderr = relay.stderr_plain();
    assert_ne!(code, 0, "{stderr}");
    assert!(
        stderr.contains("more than the reader accepts")
            && stderr.contains("raise --max-message-bytes"),
        "{stderr}"
    );
    let lines = relay.lines();
    assert_eq!(lines.len(), 1, "only the small event: {lines:?}");
    assert!(lines[0].contains(&small[0].to_string()));
}
