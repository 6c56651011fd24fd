//! Routing, headers from columns, body formats and the Debezium outbox table, end to end
//! against the real Postgres, MariaDB and RabbitMQ (docs/routing.md,
//! docs/migrating-from-debezium.md): what arrives where, with which headers and body, and
//! which rows go to `.dead` with which reason.

use crate::common;

use common::amqp::{self, header_str, message_id, Topology};
use common::*;
use lapin::message::Delivery;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

fn pg_relay(db: &PgDb, name: &str, extra: &[&str]) -> Relay {
    let dsn = db.dsn();
    let mut args = vec![
        "run",
        "--source",
        &dsn,
        "--name",
        name,
        "--log-level",
        "info,lapin=warn",
    ];
    args.extend_from_slice(extra);
    Relay::start_with_env(&args, &[("OUTBOXD_SINK", &amqp::url())])
}

fn my_relay(db: &MyDb, name: &str, extra: &[&str]) -> Relay {
    let dsn = db.dsn();
    let mut args = vec![
        "run",
        "--source",
        &dsn,
        "--name",
        name,
        "--log-level",
        "info,lapin=warn",
    ];
    args.extend_from_slice(extra);
    Relay::start_with_env(&args, &[("OUTBOXD_SINK", &amqp::url())])
}

fn body_json(d: &Delivery) -> serde_json::Value {
    serde_json::from_slice(&d.data).expect("a JSON body")
}

fn content_type(d: &Delivery) -> String {
    d.properties
        .content_type()
        .as_ref()
        .map(|c| c.as_str().to_string())
        .unwrap_or_default()
}

fn msg_type(d: &Delivery) -> String {
    d.properties
        .kind()
        .as_ref()
        .map(|c| c.as_str().to_string())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_routing_key_and_headers_from_columns_cloudevents_body() {
    let db = PgDb::create("route").await;
    let mut topo = Topology::new("rx").await;
    let name = unique("r");
    let client = db.client().await;
    client
        .batch_execute("ALTER TABLE outbox ADD COLUMN tenant text, ADD COLUMN traceparent text")
        .await
        .unwrap();
    let mut relay = pg_relay(
        &db,
        &name,
        &[
            "--exchange",
            &topo.exchange,
            "--routing-key",
            "{tenant}.{topic}",
            "--header",
            "traceparent=traceparent,tenant=x-tenant",
            "--format",
            "cloudevents",
            "--cloudevents-source",
            "/billing/{tenant}",
        ],
    );
    wait_for("the relay's slot to be active", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, tenant, traceparent) VALUES
               ($1, 'inv-1', 'invoice.issued', '{\"total\": 12}', 'acme', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'),
               ($2, 'inv-2', 'invoice.issued', '{\"total\": 13}', NULL, NULL)",
            &[&a, &b],
        )
        .await
        .unwrap();
    let got = topo.take(&all, 1, T).await;
    let d = &got[0];
    assert_eq!(message_id(d), a);
    assert_eq!(d.routing_key.as_str(), "acme.invoice.issued");
    assert_eq!(content_type(d), "application/cloudevents+json");
    assert_eq!(msg_type(d), "invoice.issued");
    assert_eq!(
        header_str(d, "traceparent").as_deref(),
        Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
    );
    assert_eq!(header_str(d, "x-tenant").as_deref(), Some("acme"));
    assert_eq!(header_str(d, "x-aggregate-id").as_deref(), Some("inv-1"));
    let ce = body_json(d);
    assert_eq!(ce["specversion"], "1.0");
    assert_eq!(ce["id"], a.to_string());
    assert_eq!(ce["source"], "/billing/acme");
    assert_eq!(ce["type"], "invoice.issued");
    assert_eq!(ce["subject"], "inv-1");
    assert_eq!(ce["datacontenttype"], "application/json");
    assert_eq!(ce["data"], serde_json::json!({"total": 12}));
    assert_eq!(
        ce["time"].as_str(),
        header_str(d, "x-outbox-created-at").as_deref()
    );
    // The row without a tenant has no routing key: a dead record saying so.
    let dead = topo.take(&topo.dead(), 1, T).await;
    assert_eq!(message_id(&dead[0]), b);
    let reason = header_str(&dead[0], "x-dead-reason").unwrap();
    assert!(reason.contains("no value for {tenant}"), "{reason}");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    assert_eq!(topo.queue_len(&all).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_exchange_named_by_a_row_is_declared_or_the_row_is_dead() {
    let db = PgDb::create("routex").await;
    let mut topo = Topology::new("bx").await;
    let name = unique("r");
    let tenant = unique("t");
    let client = db.client().await;
    client
        .batch_execute("ALTER TABLE outbox ADD COLUMN tenant text")
        .await
        .unwrap();
    let x = format!("{tenant}.events");
    topo.adopt(
        &[format!("{x}.unrouted")],
        &[x.clone(), format!("{x}.unrouted")],
    );
    let mut relay = pg_relay(
        &db,
        &name,
        &[
            "--exchange",
            "{tenant}.events",
            "--base-exchange",
            &topo.exchange,
            "--format",
            "envelope",
        ],
    );
    wait_for("the relay's slot to be active", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    topo.wait_declared(T).await;
    let (good, bad, good2) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, tenant) VALUES
               ($1, 'a', 'order.placed', '{\"n\": 1}', $4),
               ($2, 'a', 'order.placed', '{\"n\": 2}', 'no spaces allowed'),
               ($3, 'a', 'order.placed', '{\"n\": 3}', $4)",
            &[&good, &bad, &good2, &tenant],
        )
        .await
        .unwrap();
    // The row's exchange was declared with the default exchange's topology: with no queue
    // bound, both good rows wait in its alternate exchange's queue.
    let unrouted = format!("{x}.unrouted");
    wait_for(
        "2 rows in the row's exchange's unrouted queue",
        T,
        || async { topo.queue_len(&unrouted).await == 2 },
    )
    .await;
    let kept = topo.take(&unrouted, 2, T).await;
    assert_eq!(
        kept.iter().map(message_id).collect::<Vec<_>>(),
        vec![good, good2]
    );
    assert_eq!(kept[0].exchange.as_str(), x);
    let env = body_json(&kept[0]);
    assert_eq!(env["id"], good.to_string());
    assert_eq!(env["aggregate"]["id"], "a");
    assert_eq!(env["topic"], "order.placed");
    assert_eq!(env["payload"], serde_json::json!({"n": 1}));
    assert!(env["position"].as_str().unwrap().contains('/'));
    assert!(env["created_at"].as_str().unwrap().ends_with('Z'));
    let dead = topo.take(&topo.dead(), 1, T).await;
    assert_eq!(message_id(&dead[0]), bad);
    let reason = header_str(&dead[0], "x-dead-reason").unwrap();
    assert!(reason.contains("no spaces allowed.events"), "{reason}");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    // One declaration, and no reconnect loop for the bad row.
    assert!(
        !relay.stderr_plain().contains("reconnect"),
        "{}",
        relay.stderr()
    );

    // --declare passive: a row naming an exchange nobody declared goes to .dead, once.
    let name2 = unique("r");
    let missing = unique("nope");
    let mut relay = pg_relay(
        &db,
        &name2,
        &[
            "--exchange",
            "{tenant}.events",
            "--base-exchange",
            &topo.exchange,
            "--declare",
            "passive",
            "--snapshot",
            "never",
        ],
    );
    wait_for("the second relay's slot to be active", T, || {
        db.slot_active(format!("outboxd_{name2}"))
    })
    .await;
    let (m, ok) = (Uuid::now_v7(), Uuid::now_v7());
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, tenant) VALUES
               ($1, 'a', 'order.placed', '{}', $3), ($2, 'a', 'order.placed', '{}', $4)",
            &[&m, &ok, &missing, &tenant],
        )
        .await
        .unwrap();
    let dead = topo.take(&topo.dead(), 1, T).await;
    assert_eq!(message_id(&dead[0]), m);
    let reason = header_str(&dead[0], "x-dead-reason").unwrap();
    assert!(reason.contains("does not exist"), "{reason}");
    let kept = topo.take(&unrouted, 1, T).await;
    assert_eq!(message_id(&kept[0]), ok);
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let _ = client
        .execute(
            "SELECT pg_drop_replication_slot($1)",
            &[&format!("outboxd_{name}")],
        )
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserved_header_names_and_bad_templates_are_refused_at_start() {
    for (args, needle) in [
        (vec!["--header", "v=x-aggregate-version"], "relay's own"),
        (vec!["--header", "to=CC"], "relay's own"),
        (vec!["--routing-key", "{topic"], "not closed"),
        (
            vec!["--exchange", "{tenant}.x", "--partitions", "2"],
            "--partitions needs one exchange",
        ),
    ] {
        let mut all = vec![
            "run",
            "--source",
            "postgres://postgres@127.0.0.1:5432/postgres",
            "--sink",
            "amqp://127.0.0.1:5672",
        ];
        all.extend_from_slice(&args);
        let mut relay = Relay::start(&all);
        let code = relay.wait_exit(T).await;
        assert_eq!(code, 2, "{args:?}: {}", relay.stderr());
        let err = relay.stderr();
        assert!(err.contains(needle), "{args:?}: {err}");
        assert!(err.contains("fix:"), "{args:?}: {err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_bytea_payloads_are_published_as_bytes_with_their_content_type() {
    let db = PgDb::create("bytea").await;
    let mut topo = Topology::new("bt").await;
    let name = unique("r");
    let client = db.client().await;
    client
        .batch_execute(
            "DROP TABLE outbox;
             CREATE TABLE outbox (id uuid PRIMARY KEY, aggregate_id text NOT NULL, topic text NOT NULL,
               payload bytea NOT NULL, mime text, created_at timestamptz NOT NULL DEFAULT now())",
        )
        .await
        .unwrap();
    let mut relay = pg_relay(
        &db,
        &name,
        &[
            "--exchange",
            &topo.exchange,
            "--payload-content-type",
            "application/octet-stream",
            "--column",
            "content_type=mime",
        ],
    );
    wait_for("the relay's slot to be active", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    client
        .execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, mime) VALUES
               ($1, 'a', 'blob.saved', '\\x00ff10', NULL), ($2, 'a', 'text.saved', 'hello, world', 'text/plain')",
            &[&a, &b],
        )
        .await
        .unwrap();
    let got = topo.take(&all, 2, T).await;
    assert_eq!(message_id(&got[0]), a);
    assert_eq!(&got[0].data[..], &[0x00, 0xff, 0x10]);
    assert_eq!(content_type(&got[0]), "application/octet-stream");
    assert_eq!(message_id(&got[1]), b);
    assert_eq!(&got[1].data[..], b"hello, world");
    assert_eq!(content_type(&got[1]), "text/plain");
    assert_eq!(topo.queue_len(&topo.dead()).await, 0);
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}

/// Debezium's reference outbox table (no created_at), relayed with `--column debezium` alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_debezium_table_works_unchanged() {
    let db = PgDb::create("dbz").await;
    let mut topo = Topology::new("dz").await;
    let name = unique("r");
    let client = db.client().await;
    client
        .batch_execute(
            "DROP TABLE outbox;
             CREATE TABLE outbox (id uuid NOT NULL PRIMARY KEY, aggregatetype varchar(255) NOT NULL,
               aggregateid varchar(255) NOT NULL, type varchar(255) NOT NULL, payload jsonb)",
        )
        .await
        .unwrap();
    let mut relay = pg_relay(
        &db,
        &name,
        &["--exchange", &topo.exchange, "--column", "debezium"],
    );
    wait_for("the relay's slot to be active", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    topo.wait_declared(T).await;
    let q = topo.bind_queue("orders", "outbox.event.Order").await;
    let id = Uuid::now_v7();
    let before = chrono::Utc::now() - chrono::Duration::seconds(5);
    client
        .execute(
            "INSERT INTO outbox VALUES ($1, 'Order', '123', 'OrderCreated', '{\"customerId\": 7}')",
            &[&id],
        )
        .await
        .unwrap();
    let got = topo.take(&q, 1, T).await;
    let d = &got[0];
    assert_eq!(message_id(d), id);
    assert_eq!(d.routing_key.as_str(), "outbox.event.Order");
    assert_eq!(msg_type(d), "OrderCreated");
    assert_eq!(
        header_str(d, "id").as_deref(),
        Some(id.to_string().as_str())
    );
    assert_eq!(header_str(d, "x-aggregate-id").as_deref(), Some("123"));
    assert_eq!(body_json(d), serde_json::json!({"customerId": 7}));
    let created = header_str(d, "x-outbox-created-at").unwrap();
    let created = chrono::DateTime::parse_from_rfc3339(&created).unwrap();
    assert!(
        created > before && created < chrono::Utc::now() + chrono::Duration::seconds(5),
        "created_at is the commit time: {created}"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}

/// The same on MariaDB, with the types Debezium's examples use there (CHAR(36), JSON).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_debezium_table_works_unchanged() {
    let db = MyDb::create("dbz").await;
    let mut topo = Topology::new("mdz").await;
    let name = unique("r");
    let mut conn = db.conn().await;
    my_exec(
        &mut conn,
        "DROP TABLE outbox; CREATE TABLE outbox (id CHAR(36) NOT NULL PRIMARY KEY,
           aggregatetype VARCHAR(255) NOT NULL, aggregateid VARCHAR(255) NOT NULL,
           type VARCHAR(255) NOT NULL, payload JSON)",
    )
    .await;
    let mut relay = my_relay(
        &db,
        &name,
        &["--exchange", &topo.exchange, "--column", "debezium"],
    );
    wait_for("the binlog dump", T, || db.streaming()).await;
    topo.wait_declared(T).await;
    let q = topo.bind_queue("orders", "outbox.event.#").await;
    let id = Uuid::now_v7();
    let before = chrono::Utc::now() - chrono::Duration::seconds(5);
    my_exec(
        &mut conn,
        &format!("INSERT INTO outbox VALUES ('{id}', 'Order', '123', 'OrderCreated', '{{\"customerId\": 7}}')"),
    )
    .await;
    let got = topo.take(&q, 1, T).await;
    let d = &got[0];
    assert_eq!(message_id(d), id);
    assert_eq!(d.routing_key.as_str(), "outbox.event.Order");
    assert_eq!(msg_type(d), "OrderCreated");
    assert_eq!(
        header_str(d, "id").as_deref(),
        Some(id.to_string().as_str())
    );
    assert_eq!(header_str(d, "x-aggregate-id").as_deref(), Some("123"));
    assert_eq!(body_json(d), serde_json::json!({"customerId": 7}));
    let created = header_str(d, "x-outbox-created-at").unwrap();
    let created = chrono::DateTime::parse_from_rfc3339(&created).unwrap();
    assert!(
        created > before && created < chrono::Utc::now() + chrono::Duration::seconds(5),
        "created_at is the commit time: {created}"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}

/// MariaDB: a template over an extra column, a header from a column, CloudEvents binary mode,
/// and a TEXT payload that is not JSON published with the content type from its column.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_templates_headers_binary_cloudevents_and_text_payloads() {
    let db = MyDb::create("myroute").await;
    let mut topo = Topology::new("mrx").await;
    let name = unique("r");
    let mut conn = db.conn().await;
    my_exec(
        &mut conn,
        "DROP TABLE outbox; CREATE TABLE outbox (id BINARY(16) NOT NULL PRIMARY KEY,
           aggregate_id BIGINT NOT NULL, topic VARCHAR(120) NOT NULL, payload TEXT NOT NULL,
           ctype VARCHAR(100) NULL, region INT NULL, traceparent VARCHAR(60) NULL,
           created_at DATETIME(6) NOT NULL)",
    )
    .await;
    let mut relay = my_relay(
        &db,
        &name,
        &[
            "--exchange",
            &topo.exchange,
            "--routing-key",
            "r{region}.{topic}",
            "--header",
            "traceparent=traceparent",
            "--format",
            "cloudevents-binary",
            "--column",
            "content_type=ctype",
            "--payload-content-type",
            "application/json",
        ],
    );
    wait_for("the binlog dump", T, || db.streaming()).await;
    topo.wait_declared(T).await;
    let all = topo.bind_queue("all", "#").await;
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    my_exec(
        &mut conn,
        &format!(
            "INSERT INTO outbox VALUES
               (UNHEX('{}'), 5, 'doc.saved', 'plain words', 'text/plain', 7, '00-aa-bb-01', NOW(6)),
               (UNHEX('{}'), 5, 'doc.saved', '{{\"k\": 1}}', NULL, 8, NULL, NOW(6))",
            a.simple(),
            b.simple()
        ),
    )
    .await;
    let got = topo.take(&all, 2, T).await;
    let (d, e) = (&got[0], &got[1]);
    assert_eq!(message_id(d), a);
    assert_eq!(d.routing_key.as_str(), "r7.doc.saved");
    assert_eq!(&d.data[..], b"plain words");
    assert_eq!(content_type(d), "text/plain");
    assert_eq!(header_str(d, "traceparent").as_deref(), Some("00-aa-bb-01"));
    assert_eq!(
        header_str(d, "cloudEvents:specversion").as_deref(),
        Some("1.0")
    );
    assert_eq!(
        header_str(d, "cloudEvents:id").as_deref(),
        Some(a.to_string().as_str())
    );
    assert_eq!(
        header_str(d, "cloudEvents:type").as_deref(),
        Some("doc.saved")
    );
    assert_eq!(header_str(d, "cloudEvents:subject").as_deref(), Some("5"));
    assert_eq!(
        header_str(d, "cloudEvents:source").as_deref(),
        Some("/outboxd")
    );
    assert_eq!(message_id(e), b);
    assert_eq!(e.routing_key.as_str(), "r8.doc.saved");
    assert_eq!(content_type(e), "application/json");
    assert_eq!(header_str(e, "traceparent"), None);
    assert_eq!(body_json(e), serde_json::json!({"k": 1}));
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}
