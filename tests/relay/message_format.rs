//! docs/message-format.md against the wire: real messages (normal, with row headers, poison →
//! `.dead`, unrouted → `.unrouted`) published by the relay from Postgres and MariaDB through the
//! local RabbitMQ carry exactly the properties and headers the page's tables list — parsed from
//! the page itself, so the doc and the wire cannot drift — and the page's reserved names are
//! exactly those the relay refuses from a row.

use crate::common;

use common::amqp::{self, message_id, Topology};
use common::*;
use lapin::message::Delivery;
use lapin::types::AMQPValue;
use mysql_async::prelude::Queryable;
use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);
const DOC: &str = include_str!("../../docs/message-format.md");

/// The rows of the table marked `<!-- table: NAME -->`: cells with backticks removed.
fn doc_table(name: &str) -> Vec<Vec<String>> {
    let marker = format!("<!-- table: {name} -->");
    let start = DOC
        .find(&marker)
        .unwrap_or_else(|| panic!("docs/message-format.md has no {marker}"));
    let rows: Vec<Vec<String>> = DOC[start + marker.len()..]
        .lines()
        .skip_while(|l| l.trim().is_empty())
        .take_while(|l| l.trim_start().starts_with('|'))
        .skip(2) // header and separator
        .map(|l| {
            l.trim()
                .trim_matches('|')
                .split('|')
                .map(|c| c.trim().replace('`', ""))
                .collect()
        })
        .collect();
    assert!(
        !rows.is_empty(),
        "table {name} in docs/message-format.md is empty"
    );
    rows
}

/// What the page says a message carries under the conditions that hold.
struct Expected {
    message_props: BTreeSet<String>,
    dead_props: BTreeSet<String>,
    /// header → (AMQP type, present-condition)
    headers: Vec<(String, String, String)>,
    dead_headers: Vec<(String, String, String)>,
}

fn expected() -> Expected {
    let props = doc_table("properties");
    let pick = |col: usize| -> BTreeSet<String> {
        props
            .iter()
            .filter(|r| r[col] == "yes")
            .map(|r| r[0].clone())
            .collect()
    };
    let headers = |t: &str| -> Vec<(String, String, String)> {
        doc_table(t)
            .into_iter()
            .map(|r| (r[0].clone(), r[1].clone(), r[2].clone()))
            .collect()
    };
    Expected {
        message_props: pick(2),
        dead_props: pick(3),
        headers: headers("headers"),
        dead_headers: headers("dead-headers"),
    }
}

/// The names of the properties a delivery carries (headers aside).
fn props_of(d: &Delivery) -> BTreeSet<String> {
    let p = &d.properties;
    let mut s = BTreeSet::new();
    let mut add = |name: &str, present: bool| {
        if present {
            s.insert(name.to_string());
        }
    };
    add("content_type", p.content_type().is_some());
    add("content_encoding", p.content_encoding().is_some());
    add("delivery_mode", p.delivery_mode().is_some());
    add("priority", p.priority().is_some());
    add("correlation_id", p.correlation_id().is_some());
    add("reply_to", p.reply_to().is_some());
    add("expiration", p.expiration().is_some());
    add("message_id", p.message_id().is_some());
    add("timestamp", p.timestamp().is_some());
    add("type", p.kind().is_some());
    add("user_id", p.user_id().is_some());
    add("app_id", p.app_id().is_some());
    add("cluster_id", p.cluster_id().is_some());
    s
}

fn headers_of(d: &Delivery) -> BTreeMap<String, AMQPValue> {
    d.properties
        .headers()
        .as_ref()
        .map(|t| {
            t.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

fn amqp_type(v: &AMQPValue) -> &'static str {
    match v {
        AMQPValue::LongString(_) => "long string",
        AMQPValue::LongLongInt(_) => "long long int",
        _ => "other",
    }
}

/// Checks one delivery against the page: properties, and headers = the rows whose condition
/// holds (with their AMQP type) plus the row's own non-reserved headers.
#[track_caller]
fn check(
    d: &Delivery,
    dead: bool,
    holds: &dyn Fn(&str) -> bool,
    partition_counts: &[u32],
    row_headers: &[&str],
    what: &str,
) {
    let e = expected();
    let want_props = if dead {
        &e.dead_props
    } else {
        &e.message_props
    };
    assert_eq!(
        &props_of(d),
        want_props,
        "{what}: properties differ from docs/message-format.md"
    );
    let table = if dead { &e.dead_headers } else { &e.headers };
    let mut want: BTreeMap<String, String> = BTreeMap::new();
    for (name, ty, when) in table {
        if when == "always" || when.split(" or ").any(holds) {
            match name.strip_suffix("<N>") {
                Some(prefix) => {
                    for n in partition_counts {
                        want.insert(format!("{prefix}{n}"), ty.clone());
                    }
                }
                None => {
                    want.insert(name.clone(), ty.clone());
                }
            }
        }
    }
    let got = headers_of(d);
    let relay_got: BTreeMap<String, String> = got
        .iter()
        .filter(|(k, _)| !row_headers.contains(&k.as_str()))
        .map(|(k, v)| (k.clone(), amqp_type(v).to_string()))
        .collect();
    assert_eq!(
        relay_got, want,
        "{what}: the relay's headers (name → AMQP type) differ from docs/message-format.md"
    );
    for h in row_headers {
        assert!(got.contains_key(*h), "{what}: row header {h} kept");
    }
    // Fixed values the page states.
    let p = &d.properties;
    assert_eq!(p.app_id().as_ref().map(|s| s.as_str()), Some("outboxd"));
    assert_eq!(*p.delivery_mode(), Some(2));
    if !dead {
        assert_eq!(
            p.content_type().as_ref().map(|s| s.as_str()),
            Some("application/json")
        );
        assert_eq!(
            p.kind().as_ref().map(|s| s.as_str()),
            Some(d.routing_key.as_str()),
            "{what}: type = topic = routing key"
        );
    }
    let id = message_id(d);
    assert_eq!(
        p.message_id().as_ref().unwrap().as_str(),
        id.hyphenated().to_string(),
        "lowercase hyphenated"
    );
}

/// `x-partition-<N>` is exercised with this N (`--group-partitions`).
const GROUP_N: u32 = 3;

/// A row's headers: kept ones, and reserved ones the relay must drop.
const ROW_HEADERS: &str = r#"{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "tenant_id": 7, "CC": ["other.topic"], "x-source-position": "forged", "X-Death": "x", "x-partition": "9", "Nats-Msg-Id": "n", "cloudevents:id": "c", "x-outboxd-exchange": "forged"}"#;
const KEPT: &[&str] = &["traceparent", "tenant_id"];

#[test]
fn the_reserved_table_is_exactly_the_relays_rule() {
    use outboxd::sink::headers::{is_reserved, RESERVED_NAMES, RESERVED_PREFIXES};
    let rows = doc_table("reserved");
    let doc_prefixes: BTreeSet<&str> = rows
        .iter()
        .filter(|r| r[1] == "prefix")
        .map(|r| r[0].as_str())
        .collect();
    let doc_names: BTreeSet<&str> = rows
        .iter()
        .filter(|r| r[1] == "name")
        .map(|r| r[0].as_str())
        .collect();
    assert_eq!(doc_prefixes, RESERVED_PREFIXES.iter().copied().collect());
    assert_eq!(doc_names, RESERVED_NAMES.iter().copied().collect());
    // Every header the relay itself sends is reserved (a row cannot forge it).
    for (name, _, _) in expected().headers.iter().chain(&expected().dead_headers) {
        let name = name.replace("<N>", "4");
        assert!(
            is_reserved(&name),
            "{name} is listed as the relay's but not reserved"
        );
    }
    let reserved: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(ROW_HEADERS).unwrap();
    for k in reserved.keys() {
        assert_eq!(is_reserved(k), !KEPT.contains(&k.as_str()), "{k}");
    }
}

fn start(source: &str, name: &str, exchange: &str, extra: &[&str]) -> Relay {
    let mut args = vec![
        "run",
        "--source",
        source,
        "--name",
        name,
        "--exchange",
        exchange,
        "--max-message-bytes",
        "300",
        "--log-level",
        "info,lapin=warn",
    ];
    args.extend_from_slice(extra);
    Relay::start_with_env(&args, &[("OUTBOXD_SINK", &amqp::url())])
}

/// Postgres, two outbox tables (`x-outbox-table`), `--group-partitions 3`: a plain event, one
/// with a version and row headers, a poison one (payload over `--max-message-bytes`) and one
/// whose topic no queue is bound to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_messages_carry_exactly_what_the_page_lists() {
    let db = PgDb::create("mf_pg").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE outbox2 (LIKE outbox INCLUDING ALL)")
        .await
        .unwrap();
    let mut topo = Topology::new("mfx").await;
    let name = unique("mf");
    let group = GROUP_N.to_string();
    let mut relay = start(
        &db.dsn(),
        &name,
        &topo.exchange,
        &[
            "--table",
            "outbox",
            "--table",
            "outbox2",
            "--group-partitions",
            &group,
        ],
    );
    topo.wait_declared(T).await;
    let q = topo.bind_queue("invoices", "invoice.#").await;

    let (plain, rich, poison, lost) = (
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
        Uuid::now_v7(),
    );
    let big = format!("{{\"pad\": \"{}\"}}", "x".repeat(400));
    let sql = format!(
        "BEGIN;
         INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ('{plain}', '42', 'invoice.issued', '{{\"n\": 1}}');
         INSERT INTO outbox2 (id, aggregate_id, topic, payload, headers, version) VALUES ('{rich}', '42', 'invoice.paid', '{{\"n\": 2}}', '{ROW_HEADERS}', 3);
         INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ('{poison}', '42', 'invoice.huge', '{big}');
         INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ('{lost}', '42', 'nobody.listens', '{{\"n\": 4}}');
         COMMIT;"
    );
    // The relay must be streaming before the write (a first start on an empty table snapshots
    // nothing and streams from its slot).
    let slot = format!("outboxd_{name}");
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    client.batch_execute(&sql).await.unwrap();

    let msgs = topo.take(&q, 2, T).await;
    let dead = topo.take(&topo.dead(), 1, T).await;
    let unrouted = topo.take(&topo.unrouted(), 1, T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    let holds = |c: &str| c == "several --table" || c == "--group-partitions N";
    const COUNTS: &[u32] = &[GROUP_N];
    assert_eq!(message_id(&msgs[0]), plain);
    check(&msgs[0], false, &holds, COUNTS, &[], "plain message");
    assert_eq!(message_id(&msgs[1]), rich);
    check(
        &msgs[1],
        false,
        &|c| holds(c) || c == "row has a version",
        COUNTS,
        KEPT,
        "message with row headers",
    );
    assert_eq!(
        amqp::header_str(&msgs[1], "x-outbox-table").as_deref(),
        Some("outbox2")
    );
    assert_eq!(
        amqp::header(&msgs[1], "x-aggregate-version"),
        Some(AMQPValue::LongLongInt(3))
    );
    assert_eq!(message_id(&dead[0]), poison);
    assert!(dead[0].data.is_empty(), "a dead record has no body");
    check(&dead[0], true, &|_| false, &[], &[], "dead record");
    assert_eq!(message_id(&unrouted[0]), lost);
    check(&unrouted[0], false, &holds, COUNTS, &[], "unrouted message");
}

/// MariaDB (GTIDs, one table) with `--partitions 2`: a plain event, one with a version and
/// row headers, a poison one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_messages_carry_exactly_what_the_page_lists() {
    let db = MyDb::create("mf_my").await;
    let mut c = db.conn().await;
    my_exec(
        &mut c,
        "ALTER TABLE outbox ADD COLUMN headers JSON NULL, ADD COLUMN version BIGINT NULL",
    )
    .await;
    let mut topo = Topology::new("mfy").await;
    let x = topo.exchange.clone();
    topo.adopt_partitions(&x, 2, false);
    let name = unique("mf");
    let mut relay = start(&db.dsn(), &name, &topo.exchange, &["--partitions", "2"]);
    wait_for("the binlog dump", T, || db.streaming()).await;
    topo.wait_declared(T).await;
    let q = topo.bind_queue("invoices", "invoice.#").await;

    let (plain, rich, poison) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let big = format!("{{\"pad\": \"{}\"}}", "x".repeat(400));
    let mut tx = c
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .unwrap();
    for (id, topic, payload, headers, version) in [
        (
            plain,
            "invoice.issued",
            "{\"n\": 1}".to_string(),
            None,
            None,
        ),
        (
            rich,
            "invoice.paid",
            "{\"n\": 2}".to_string(),
            Some(ROW_HEADERS),
            Some(3i64),
        ),
        (poison, "invoice.huge", big, None, None),
    ] {
        tx.exec_drop(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at, headers, version) VALUES (?, 42, ?, ?, NOW(6), ?, ?)",
            (id.as_bytes().to_vec(), topic, payload, headers, version),
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();

    let msgs = topo.take(&q, 2, T).await;
    let dead = topo.take(&topo.dead(), 1, T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    let holds = |c: &str| c == "server has GTIDs" || c == "--partitions N";
    const COUNTS: &[u32] = &[2];
    assert_eq!(message_id(&msgs[0]), plain);
    check(&msgs[0], false, &holds, COUNTS, &[], "plain message");
    assert_eq!(message_id(&msgs[1]), rich);
    check(
        &msgs[1],
        false,
        &|c| holds(c) || c == "row has a version",
        COUNTS,
        KEPT,
        "message with row headers",
    );
    assert_eq!(message_id(&dead[0]), poison);
    assert!(dead[0].data.is_empty(), "a dead record has no body");
    check(&dead[0], true, &holds, &[], &[], "dead record");
}

// ---------------------------------------------------------------------------------------------
// The queues the records go to: quorum queues, and a pre-declared topology
// ---------------------------------------------------------------------------------------------

const CONFIG_DOC: &str = include_str!("../../docs/configuration.md");

use common::amqp::mgmt;

fn queue_type(queue: &str) -> String {
    let (code, body) = mgmt("GET", &format!("queues/%2F/{queue}"), None);
    assert_eq!(code, 200, "GET queue {queue}: {body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["type"].as_str().unwrap_or_default().to_string()
}

/// A poison event and an unrouted one, in one transaction; checks they reach `.dead` and
/// `.unrouted`.
async fn poison_and_unrouted_arrive(db: &PgDb, topo: &Topology) {
    let (poison, lost) = (Uuid::now_v7(), Uuid::now_v7());
    let big = format!("{{\"pad\": \"{}\"}}", "x".repeat(400));
    db.client()
        .await
        .batch_execute(&format!(
            "BEGIN;
             INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ('{poison}', '1', 'invoice.huge', '{big}');
             INSERT INTO outbox (id, aggregate_id, topic, payload) VALUES ('{lost}', '1', 'nobody.listens', '{{}}');
             COMMIT;"
        ))
        .await
        .unwrap();
    let dead = topo.take(&topo.dead(), 1, T).await;
    assert_eq!(message_id(&dead[0]), poison);
    let unrouted = topo.take(&topo.unrouted(), 1, T).await;
    assert_eq!(message_id(&unrouted[0]), lost);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_queue_type_quorum_declares_quorum_queues() {
    let db = PgDb::create("mf_q").await;
    let topo = Topology::new("mfq").await;
    let name = unique("mf");
    let mut relay = start(
        &db.dsn(),
        &name,
        &topo.exchange,
        &["--dead-queue-type", "quorum"],
    );
    let slot = format!("outboxd_{name}");
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    assert_eq!(queue_type(&topo.dead()), "quorum");
    assert_eq!(queue_type(&topo.unrouted()), "quorum");
    poison_and_unrouted_arrive(&db, &topo).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    // Without the flag the relay declares classic queues: against these quorum ones RabbitMQ
    // refuses (a queue's type cannot change) and the relay says what differs and the fix.
    let mut classic = start(&db.dsn(), &name, &topo.exchange, &[]);
    let code = classic.wait_exit(T).await;
    let err = classic.stderr_plain();
    assert_eq!(
        code, 2,
        "a mismatched queue type is a configuration error: {err}"
    );
    assert!(
        err.contains("x-queue-type") && err.contains(&topo.unrouted()),
        "the error names the argument and the queue: {err}"
    );
}

/// The definitions block of docs/configuration.md, imported as written (with this test's
/// exchange name), and the permission line it gives: the relay runs with `--declare passive`
/// as a user that may configure nothing, and `check --declare passive` accepts the topology.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_pre_declared_topology_works_with_declare_passive() {
    let db = PgDb::create("mf_p").await;
    let topo = Topology::new("mfp").await;
    let x = topo.exchange.clone();

    let marker = "<!-- definitions: passive -->";
    let at = CONFIG_DOC
        .find(marker)
        .expect("docs/configuration.md has the definitions block");
    let block = &CONFIG_DOC[at..];
    let json = &block[block.find("```json").unwrap() + 7..];
    let json = &json[..json.find("```").unwrap()];
    let defs = json.replace("outbox", &x);
    let (code, body) = mgmt("POST", "definitions", Some(&defs));
    assert!(
        code == 200 || code == 201 || code == 204,
        "import: {code} {body}"
    );
    assert_eq!(queue_type(&topo.dead()), "quorum");

    // The documented permissions: configure nothing, write the exchange and the default one.
    let perm_line = CONFIG_DOC
        .lines()
        .find(|l| l.starts_with("rabbitmqctl set_permissions"))
        .expect("the permission line");
    let quoted: Vec<&str> = perm_line.split('\'').skip(1).step_by(2).collect();
    assert_eq!(quoted.len(), 3, "{perm_line}");
    let user = unique("relay");
    let (code, body) = mgmt(
        "PUT",
        &format!("users/{user}"),
        Some(r#"{"password": "pw", "tags": ""}"#),
    );
    assert!(code == 201 || code == 204, "user: {code} {body}");
    struct DropUser(String);
    impl Drop for DropUser {
        fn drop(&mut self) {
            mgmt("DELETE", &format!("users/{}", self.0), None);
        }
    }
    let _user = DropUser(user.clone());
    let perms = serde_json::json!({
        "configure": quoted[0].replace("outbox", &x),
        "write": quoted[1].replace("outbox", &x),
        "read": quoted[2].replace("outbox", &x),
    });
    let (code, body) = mgmt(
        "PUT",
        &format!("permissions/%2F/{user}"),
        Some(&perms.to_string()),
    );
    assert!(code == 201 || code == 204, "permissions: {code} {body}");
    let sink = format!("amqp://{user}:pw@127.0.0.1:5672/%2f");

    let check = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "check",
            "--source",
            &db.dsn(),
            "--exchange",
            &x,
            "--declare",
            "passive",
        ])
        .env("OUTBOXD_SINK", &sink)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&check.stdout);
    let topo_line = out
        .lines()
        .find(|l| l.contains("rabbitmq topology"))
        .unwrap_or_else(|| panic!("check prints the topology line: {out}"));
    assert!(topo_line.starts_with("ok"), "{topo_line}");

    let name = unique("mf");
    let mut relay = Relay::start_with_env(
        &[
            "run",
            "--source",
            &db.dsn(),
            "--name",
            &name,
            "--exchange",
            &x,
            "--declare",
            "passive",
            "--max-message-bytes",
            "300",
            "--log-level",
            "info,lapin=warn",
        ],
        &[("OUTBOXD_SINK", &sink)],
    );
    let slot = format!("outboxd_{name}");
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    poison_and_unrouted_arrive(&db, &topo).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}
