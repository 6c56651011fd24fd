//! Several outbox tables through one relay (`--table` repeated): one slot and one publication
//! on Postgres, one binlog stream on MariaDB; every event arrives once, in commit order, with
//! `x-outbox-table`; one stored position. And Postgres partitioned outbox tables
//! (`publish_via_partition_root`): rows in every partition, one attached later, all arrive
//! under the parent's name. The two-table relays run in-process with the RabbitMQ sink;
//! `setup`, `check` and their messages are the binary's.

use crate::common;

use common::amqp::{header_str, message_id, Topology};
use common::inproc::{InProc, Settings};
use common::*;
use std::collections::HashMap;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

/// What the test wrote, in commit order: (id, table, aggregate, sequence within aggregate).
type Written = Vec<(Uuid, &'static str, String, u64)>;

/// Checks the deliveries against what was written: same ids in commit order, each with its
/// table's name, and every aggregate's sequence strictly increasing.
fn assert_delivered(got: &[lapin::message::Delivery], written: &Written) {
    let ids: Vec<Uuid> = got.iter().map(message_id).collect();
    let want: Vec<Uuid> = written.iter().map(|w| w.0).collect();
    assert_eq!(ids.len(), want.len(), "as many messages as events");
    assert!(ids == want, "messages arrive once each, in commit order");
    let mut last: HashMap<String, u64> = HashMap::new();
    for (d, (_, table, agg, seq)) in got.iter().zip(written) {
        assert_eq!(
            header_str(d, "x-outbox-table").as_deref(),
            Some(*table),
            "x-outbox-table names the row's table"
        );
        assert_eq!(header_str(d, "x-aggregate-id").as_deref(), Some(&agg[..]));
        let body: serde_json::Value = serde_json::from_slice(&d.data).unwrap();
        assert_eq!(body["seq"].as_u64(), Some(*seq));
        if let Some(prev) = last.insert(agg.clone(), *seq) {
            assert!(*seq > prev, "aggregate {agg}: {seq} after {prev}");
        }
    }
}

/// The rows to write, per transaction: (table, aggregate, sequence within the aggregate).
/// Transactions go into one table or both, and aggregates span both tables. MySQL's outbox
/// has an integer aggregate id, hence `numeric`.
fn transactions(numeric: bool) -> Vec<Vec<(&'static str, String, u64)>> {
    let mut seq: HashMap<String, u64> = HashMap::new();
    (0..150usize)
        .map(|t| {
            let tables: &[&'static str] = match t % 3 {
                0 => &["outbox"],
                1 => &["outbox_b"],
                _ => &["outbox_b", "outbox", "outbox_b"],
            };
            tables
                .iter()
                .enumerate()
                .map(|(i, table)| {
                    let k = (t + i) % 7;
                    let agg = if numeric {
                        k.to_string()
                    } else {
                        format!("agg-{k}")
                    };
                    let s = seq.entry(agg.clone()).or_default();
                    *s += 1;
                    (*table, agg, *s)
                })
                .collect()
        })
        .collect()
}

/// `outboxd run --table outbox --table outbox_b --exchange EXCHANGE --sink amqp://…`, in-process
/// (the comma-separated `--table` is `commands::tests::a_comma_separated_table_flag_is_the_flag_repeated`).
fn start_two_table_relay(dsn: &str, name: &str, exchange: &str) -> InProc {
    let settings = Settings::new(name).tables(&["outbox", "outbox_b"]);
    InProc::with_sink(dsn, &settings, &amqp::url(), exchange)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_tables_one_slot_one_publication_one_position() {
    let mut db = PgDb::create("tables").await;
    let mut topo = Topology::new("tables").await;
    let client = db.client().await;
    client
        .batch_execute("CREATE TABLE outbox_b (LIKE outbox INCLUDING ALL)")
        .await
        .unwrap();
    let name = "two";
    let slot = format!("outboxd_{name}");
    db.slots.push(slot.clone());
    let dsn = db.dsn();

    // setup with one table, then with both: the second adds outbox_b and says so.
    let base = ["setup", "--source", &dsn, "--name", name];
    let mut one = Relay::start(&[&base[..], &["--table", "outbox"][..]].concat());
    assert_eq!(one.wait_exit(T).await, 0, "{}", one.stderr());
    let mut two =
        Relay::start(&[&base[..], &["--table", "outbox", "--table", "outbox_b"][..]].concat());
    assert_eq!(two.wait_exit(T).await, 0, "{}", two.stderr());
    let out = two.lines().join("\n");
    assert!(
        out.contains("added \"public\".\"outbox_b\""),
        "setup names the table it added to the publication: {out}"
    );
    let published: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_publication_tables WHERE pubname = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(published, 2, "one publication covers both tables");

    let relay = start_two_table_relay(&dsn, name, &topo.exchange);
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("all", "#").await;
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;

    let mut client = db.client().await;
    let mut written: Written = Vec::new();
    for rows in transactions(false) {
        let mut tx = client.transaction().await.unwrap();
        for (table, agg, seq) in rows {
            let id = outboxd::Outbox::new(table)
                .unwrap()
                .write(
                    &mut tx,
                    "invoice.created",
                    &agg,
                    &serde_json::json!({"seq": seq}),
                )
                .await
                .unwrap();
            written.push((id, table, agg, seq));
        }
        tx.commit().await.unwrap();
    }
    let got = topo.take(&queue, written.len(), T).await;
    assert_delivered(&got, &written);

    let slots: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(slots, 1, "one slot for both tables");
    let states: i64 = client
        .query_one("SELECT count(*) FROM outboxd_state", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(states, 1, "one stored position for both tables");
    relay.stop().await;
    drop(topo);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_two_tables_one_binlog_stream_one_position() {
    use mysql_async::prelude::Queryable;
    let db = MyDb::create("tables").await;
    let mut topo = Topology::new("mytables").await;
    let mut conn = db.conn().await;
    my_exec(&mut conn, "CREATE TABLE outbox_b LIKE outbox").await;
    let name = "mytwo";
    let dsn = db.dsn();
    let mut setup = Relay::start(&[
        "setup", "--source", &dsn, "--name", name, "--table", "outbox", "--table", "outbox_b",
    ]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let relay = start_two_table_relay(&dsn, name, &topo.exchange);
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("all", "#").await;
    wait_for("the relay to stream the binlog", T, || db.streaming()).await;

    let mut written: Written = Vec::new();
    for rows in transactions(true) {
        let mut tx = conn
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .unwrap();
        for (table, agg, seq) in rows {
            let id = outboxd::Outbox::new(table)
                .unwrap()
                .write(
                    &mut tx,
                    "invoice.created",
                    &agg,
                    &serde_json::json!({"seq": seq}),
                )
                .await
                .unwrap();
            written.push((id, table, agg, seq));
        }
        tx.commit().await.unwrap();
    }
    let got = topo.take(&queue, written.len(), T).await;
    assert_delivered(&got, &written);
    let states: Option<i64> = conn
        .query_first("SELECT COUNT(*) FROM outboxd_state")
        .await
        .unwrap();
    assert_eq!(states, Some(1), "one stored position for both tables");
    relay.stop().await;
    drop(topo);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_poll_mode_refuses_several_tables_with_the_fix() {
    let db = PgDb::create("tablespoll").await;
    let dsn = db.dsn();
    let mut relay = Relay::start(&[
        "run",
        "--mode",
        "poll",
        "--commit-offsets",
        "--source",
        &dsn,
        "--table",
        "outbox",
        "--table",
        "outbox_b",
    ]);
    assert_eq!(relay.wait_exit(T).await, 2, "{}", relay.stderr());
    let err = relay.stderr_plain();
    assert!(
        err.contains("poll mode reads one outbox table")
            && err.contains("one poll-mode relay per table"),
        "{err}"
    );
}

const PARTITIONED_DDL: &str = "
CREATE TABLE pout (
    id            uuid         NOT NULL,
    aggregate_id  text         NOT NULL,
    topic         varchar(120) NOT NULL,
    payload       json         NOT NULL,
    status        text         NOT NULL DEFAULT 'pending',
    created_at    timestamptz  NOT NULL DEFAULT now(),
    headers       jsonb,
    version       bigint,
    PRIMARY KEY (id, created_at)            -- a partitioned table's key includes the partition key
) PARTITION BY RANGE (created_at);
CREATE TABLE pout_2024 PARTITION OF pout FOR VALUES FROM ('2024-01-01') TO ('2025-01-01');
CREATE TABLE pout_2025 PARTITION OF pout FOR VALUES FROM ('2025-01-01') TO ('2026-01-01');
CREATE TABLE pout_2026 PARTITION OF pout FOR VALUES FROM ('2026-01-01') TO ('2027-01-01');
";

/// Inserts one row per `created_at`, each in its own transaction; returns the ids.
async fn insert_at(client: &tokio_postgres::Client, times: &[&str]) -> Vec<Uuid> {
    let mut ids = Vec::new();
    for (i, t) in times.iter().enumerate() {
        let id = Uuid::new_v4();
        client
            .execute(
                "INSERT INTO pout (id, aggregate_id, topic, payload, created_at) VALUES ($1, $2, 'invoice.created', $3::text::json, $4::text::timestamptz)",
                &[&id, &format!("agg-{i}"), &format!("{{\"n\": {i}}}"), t],
            )
            .await
            .unwrap();
        ids.push(id);
    }
    ids
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_partitioned_table_every_partition_and_one_attached_later() {
    let mut db = PgDb::create("parted").await;
    let client = db.client().await;
    client.batch_execute(PARTITIONED_DDL).await.unwrap();
    let name = "parted";
    let slot = format!("outboxd_{name}");
    db.slots.push(slot.clone());
    let dsn = db.dsn();

    // A publication that publishes the leaves under their own names is refused with the fix.
    client
        .batch_execute("CREATE PUBLICATION leaves FOR TABLE pout WITH (publish = 'insert')")
        .await
        .unwrap();
    let mut refused = Relay::start(&[
        "setup",
        "--source",
        &dsn,
        "--name",
        name,
        "--table",
        "pout",
        "--publication",
        "leaves",
    ]);
    assert_ne!(refused.wait_exit(T).await, 0);
    let err = refused.stderr_plain();
    assert!(
        err.contains("publish_via_partition_root = true"),
        "the fix is given: {err}"
    );

    let mut setup = Relay::start(&["setup", "--source", &dsn, "--name", name, "--table", "pout"]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        name,
        "--table",
        "pout",
        "--commit-offsets",
    ]);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;

    let mut want = insert_at(
        &client,
        &[
            "2024-03-01T10:00:00Z",
            "2025-07-01T10:00:00Z",
            "2026-02-01T10:00:00Z",
            "2024-12-31T23:59:59Z",
        ],
    )
    .await;
    // A partition created apart and attached while the relay streams, and one created as a
    // partition directly.
    client
        .batch_execute(
            "CREATE TABLE pout_2027 (LIKE pout INCLUDING DEFAULTS);
             ALTER TABLE pout ATTACH PARTITION pout_2027 FOR VALUES FROM ('2027-01-01') TO ('2028-01-01');
             CREATE TABLE pout_2028 PARTITION OF pout FOR VALUES FROM ('2028-01-01') TO ('2029-01-01');",
        )
        .await
        .unwrap();
    want.extend(
        insert_at(
            &client,
            &[
                "2027-05-05T05:05:05Z",
                "2028-01-01T00:00:00Z",
                "2025-01-01T00:00:00Z",
            ],
        )
        .await,
    );
    wait_for("every row on stdout", T, || async {
        relay.line_count() >= want.len()
    })
    .await;
    let lines = parse_lines(&relay.lines());
    let got: Vec<Uuid> = lines
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(got, want, "every partition's rows, once, in commit order");
    assert!(
        lines.iter().all(|l| l.get("table").is_none()),
        "one table: no table field"
    );

    // `check` accepts the partitioned table and the publication.
    let mut check = Relay::start(&["check", "--source", &dsn, "--name", name, "--table", "pout"]);
    check.wait_exit(T).await;
    let out = check.lines().join("\n");
    assert!(
        out.lines()
            .any(|l| l.contains("outbox table") && l.starts_with("ok")),
        "{out}"
    );
    assert!(
        out.lines()
            .any(|l| l.contains("publication") && l.starts_with("ok")),
        "{out}"
    );
    relay.signal("TERM");
}
