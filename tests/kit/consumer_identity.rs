//! The identity of what the inbox compares: an aggregate is its type and its id, and ids and
//! consumer names are compared exactly — byte for byte — on every database. Through the relay
//! (an `aggregate_type` column becomes `x-aggregate-type`), at the inbox on Postgres and
//! MariaDB (whose default collation would merge `ORD-a` with `ord-A`, `café` with `cafe ` and
//! `Billing` with `billing`), and for inbox tables created before, which the kit's setup
//! migrates in place, idempotently.

use crate::common;
use crate::consumer_e2e::start_relay_with;
use crate::consumer_support;

use common::amqp::Topology;
use common::*;
use consumer_support::*;
use outboxd::consumer::{Claim, Inbox, Message};
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// The inbox tables as the first release's migrations created them (compared with the
/// default collation on MariaDB, keyed on the aggregate id alone).
const OLD_MY_DDL: &str = "
CREATE TABLE processed_messages (
    consumer      VARCHAR(100) NOT NULL,
    message_id    BINARY(16)   NOT NULL,
    processed_at  DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, message_id),
    KEY idx_processed_at (processed_at)
) ENGINE = InnoDB;
CREATE TABLE consumer_aggregate_versions (
    consumer      VARCHAR(100) NOT NULL,
    aggregate_id  VARCHAR(255) NOT NULL,
    version       BIGINT       NOT NULL,
    updated_at    DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, aggregate_id)
) ENGINE = InnoDB;";

const OLD_PG_DDL: &str = "
CREATE TABLE processed_messages (
    consumer      varchar(100) NOT NULL,
    message_id    uuid         NOT NULL,
    processed_at  timestamptz  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE INDEX processed_messages_processed_at ON processed_messages (processed_at);
CREATE TABLE consumer_aggregate_versions (
    consumer      varchar(100) NOT NULL,
    aggregate_id  text         NOT NULL,
    version       bigint       NOT NULL,
    updated_at    timestamptz  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_id)
);";

/// The relay (with `relay_args`) publishes what `write` inserts — `n` events — and a
/// `--stale-gate` consumer drains them: the invoice ids it applied, and the consumer.
async fn through_the_relay<W, Fut>(
    db: &PgDb,
    relay_args: &[&str],
    n: usize,
    write: W,
) -> (Vec<i64>, Proc)
where
    W: FnOnce(tokio_postgres::Client) -> Fut,
    Fut: std::future::Future<Output = tokio_postgres::Client>,
{
    setup_projection(&db.dsn()).await;
    let mut topo = Topology::new("xi").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let _relay = start_relay_with(db, &name, &topo.exchange, relay_args);
    wait_for("the relay's slot to be active", T, || db.slot_active(&slot)).await;
    topo.wait_declared(T).await;
    let queue = topo.bind_queue("invoices", "invoice.#").await;
    let client = write(db.client().await).await;
    let conn = amqp::connect().await;
    wait_for("every event published", T, || {
        let (conn, queue) = (&conn, &queue);
        async move { ready(conn, queue).await == n as u32 }
    })
    .await;
    let mut stopped = drain(
        &conn,
        &queue,
        || {
            start_consumer(
                &db.dsn(),
                &queue,
                "gated",
                &["--stale-gate", "--until-empty"],
            )
        },
        T,
    )
    .await;
    let applied = client
        .query(
            "SELECT invoice_id FROM invoice_ledger ORDER BY invoice_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    (applied, stopped.remove(0))
}

/// Through the relay: order 42 version 5, then invoice 42 version 1, from an outbox table with
/// an `aggregate_type` column. Two aggregates: the stale gate applies both.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_gate_tells_aggregate_types_apart_through_the_relay() {
    let db = PgDb::create("ident").await;
    db.client()
        .await
        .batch_execute("ALTER TABLE outbox ADD COLUMN aggregate_type text")
        .await
        .unwrap();
    let (applied, consumer) = through_the_relay(&db, &[], 2, |client| async move {
        for (ty, v, invoice) in [("order", 5i64, 1i64), ("invoice", 1, 2)] {
            let body = String::from_utf8(invoice_body(invoice, "cust-42", 100)).unwrap();
            client
                .execute(
                    "INSERT INTO outbox (id, aggregate_id, aggregate_type, topic, payload, version)
                     VALUES ($1, '42', $2, 'invoice.issued', $3::text::json, $4)",
                    &[&Uuid::now_v7(), &ty, &body, &v],
                )
                .await
                .unwrap();
        }
        client
    })
    .await;
    assert_eq!(
        applied,
        vec![1, 2],
        "invoice 42 v1 is not stale after order 42 v5; consumer stderr:\n{}",
        consumer.stderr()
    );
    assert_eq!(consumer.stats()["stale"].as_i64().unwrap_or(0), 0);
}

/// Through the relay reading two outbox tables: aggregate 42 of `outbox` at versions 9 and 10,
/// then aggregate 42 of `outbox2` at versions 1 and 2. The events carry `x-outbox-table`: four
/// effects, none stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stale_gate_tells_outbox_tables_apart_through_the_relay() {
    let db = PgDb::create("identt").await;
    db.client()
        .await
        .batch_execute("CREATE TABLE outbox2 (LIKE outbox INCLUDING ALL)")
        .await
        .unwrap();
    let tables = ["--table", "outbox", "--table", "outbox2"];
    let (applied, consumer) = through_the_relay(&db, &tables, 4, |client| async move {
        for (table, v, invoice) in [
            ("outbox", 9i64, 1i64),
            ("outbox", 10, 2),
            ("outbox2", 1, 3),
            ("outbox2", 2, 4),
        ] {
            let body = String::from_utf8(invoice_body(invoice, "cust-42", 100)).unwrap();
            client
                .execute(
                    &format!(
                        "INSERT INTO {table} (id, aggregate_id, topic, payload, version)
                         VALUES ($1, '42', 'invoice.issued', $2::text::json, $3)"
                    ),
                    &[&Uuid::now_v7(), &body, &v],
                )
                .await
                .unwrap();
        }
        client
    })
    .await;
    assert_eq!(
        applied,
        vec![1, 2, 3, 4],
        "aggregate 42 of outbox2 is not stale after aggregate 42 of outbox at v10; consumer stderr:\n{}",
        consumer.stderr()
    );
}

/// The inbox tables as the previous release created them: the stale gate keyed on
/// (consumer, aggregate_type, aggregate_id), without the outbox table.
const PREVIOUS_PG_DDL: &str = "
CREATE TABLE processed_messages (
    consumer      varchar(100) COLLATE \"C\" NOT NULL,
    message_id    uuid         NOT NULL,
    processed_at  timestamptz  NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, message_id)
);
CREATE TABLE consumer_aggregate_versions (
    consumer        varchar(100) COLLATE \"C\" NOT NULL,
    aggregate_type  text COLLATE \"C\"         NOT NULL DEFAULT '',
    aggregate_id    text COLLATE \"C\"         NOT NULL,
    version         bigint                   NOT NULL,
    updated_at      timestamptz              NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
);";

const PREVIOUS_MY_DDL: &str = "
CREATE TABLE processed_messages (
    consumer      VARBINARY(100) NOT NULL,
    message_id    BINARY(16)   NOT NULL,
    processed_at  DATETIME(6)  NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, message_id)
) ENGINE = InnoDB;
CREATE TABLE consumer_aggregate_versions (
    consumer        VARBINARY(100)  NOT NULL,
    aggregate_type  VARBINARY(255)  NOT NULL DEFAULT '',
    aggregate_id    VARBINARY(1024) NOT NULL,
    version         BIGINT          NOT NULL,
    updated_at      DATETIME(6)     NOT NULL DEFAULT CURRENT_TIMESTAMP(6),
    PRIMARY KEY (consumer, aggregate_type, aggregate_id)
) ENGINE = InnoDB;";

/// The primary key's columns of the stale gate's table on Postgres, in order.
async fn pg_gate_key(c: &tokio_postgres::Client) -> Vec<String> {
    c.query(
        "SELECT a.attname::text FROM pg_index i
           JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY (i.indkey)
          WHERE i.indrelid = 'consumer_aggregate_versions'::regclass AND i.indisprimary
          ORDER BY array_position(i.indkey::int2[], a.attnum)",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

/// The previous release's tables, with a stored version: setup adds the outbox table to the
/// key (the version kept under table `''`), and a version of the same aggregate id in another
/// outbox table is then another aggregate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn setup_adds_the_outbox_table_to_the_gates_key_in_place() {
    use mysql_async::prelude::Queryable;
    let pg = PgDb::create("migtab").await;
    let mut c = pg.client().await;
    c.batch_execute(PREVIOUS_PG_DDL).await.unwrap();
    c.batch_execute("INSERT INTO consumer_aggregate_versions (consumer, aggregate_type, aggregate_id, version) VALUES ('billing', 'order', '42', 5)")
        .await
        .unwrap();
    let done = outboxd::consumer::setup::postgres(&mut c).await.unwrap();
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(outboxd::consumer::setup::postgres(&mut c)
        .await
        .unwrap()
        .is_empty());
    assert_eq!(
        pg_gate_key(&c).await,
        ["consumer", "outbox_table", "aggregate_type", "aggregate_id"]
    );
    let kept: i64 = c
        .query_one("SELECT count(*) FROM consumer_aggregate_versions WHERE outbox_table = '' AND aggregate_type = 'order' AND version = 5", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, 1, "the stored version is kept, under table ''");
    let inbox = Inbox::new("billing")
        .unwrap()
        .with_stale_gate(None)
        .unwrap();
    for (table, version, want_applied) in [("", 5, false), ("billing.outbox2", 1, true)] {
        let mut tx = c.transaction().await.unwrap();
        let msg = Message::new(Uuid::now_v7(), "t", "{}")
            .with_aggregate("42", Some(version))
            .with_aggregate_type("order");
        let msg = if table.is_empty() {
            msg
        } else {
            msg.with_table(table)
        };
        let claim = inbox
            .run(&mut tx, &msg, |_| async { Ok(()) })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(
            matches!(claim, Claim::Applied(())),
            want_applied,
            "table {table:?}: {claim:?}"
        );
    }

    let my = MariaDb::create("migtab").await;
    let mut m = my.conn().await;
    m.query_drop("DROP TABLE processed_messages, consumer_aggregate_versions")
        .await
        .unwrap();
    m.query_drop(PREVIOUS_MY_DDL).await.unwrap();
    m.query_drop("INSERT INTO consumer_aggregate_versions (consumer, aggregate_type, aggregate_id, version) VALUES ('billing', 'order', '42', 5)")
        .await
        .unwrap();
    let done = outboxd::consumer::setup::mysql(&mut m).await.unwrap();
    assert_eq!(done.len(), 1, "{done:?}");
    assert!(outboxd::consumer::setup::mysql(&mut m)
        .await
        .unwrap()
        .is_empty());
    let key: Vec<String> = m
        .query(format!(
            "SELECT COLUMN_NAME FROM information_schema.STATISTICS
              WHERE TABLE_SCHEMA = '{}' AND TABLE_NAME = 'consumer_aggregate_versions' AND INDEX_NAME = 'PRIMARY'
              ORDER BY SEQ_IN_INDEX",
            my.name
        ))
        .await
        .unwrap();
    assert_eq!(
        key,
        ["consumer", "outbox_table", "aggregate_type", "aggregate_id"]
    );
    assert_eq!(
        my.count("SELECT COUNT(*) FROM consumer_aggregate_versions WHERE outbox_table = '' AND version = 5").await,
        1
    );
}

/// Messages that must all be applied, each with why: the same id under consumer names that
/// differ only in case, and per aggregate a newer version then an older one under an id that
/// differs only in case, accents or trailing spaces (different aggregates, not stale).
fn exact_cases() -> Vec<(Inbox, Message, String)> {
    let id = Uuid::now_v7();
    let mut cases: Vec<(Inbox, Message, String)> = ["Billing", "billing"]
        .into_iter()
        .map(|name| {
            (
                Inbox::new(name).unwrap(),
                Message::new(id, "t", b"{}".to_vec()),
                format!("{name:?} claims the id for itself: consumer names compare exactly"),
            )
        })
        .collect();
    let gated = Inbox::new("gated").unwrap().with_stale_gate(None).unwrap();
    for (newer, older) in [("ORD-a", "ord-A"), ("café", "cafe "), ("x", "x ")] {
        for (agg, version) in [(newer, 5), (older, 1)] {
            cases.push((
                gated.clone(),
                Message::new(Uuid::now_v7(), "t", b"{}".to_vec())
                    .with_aggregate(agg, Some(version)),
                format!("{agg:?} v{version} after {newer:?} v5 is another aggregate"),
            ));
        }
    }
    cases
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_compares_ids_and_consumer_names_exactly() {
    let db = MariaDb::create("exact").await;
    let mut c = db.conn().await;
    for (inbox, msg, why) in exact_cases() {
        let mut tx = c
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .unwrap();
        let claim = inbox
            .run(&mut tx, &msg, |_| async { Ok(()) })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(claim, Claim::Applied(()), "{why}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_compares_ids_and_consumer_names_exactly() {
    let db = PgDb::create("exact").await;
    let mut c = db.client().await;
    c.batch_execute(PG_DDL).await.unwrap();
    for (inbox, msg, why) in exact_cases() {
        let mut tx = c.transaction().await.unwrap();
        let claim = inbox
            .run(&mut tx, &msg, |_| async { Ok(()) })
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(claim, Claim::Applied(()), "{why}");
    }
}

/// Inbox tables of the first release, with rows: the kit's setup (run twice) migrates them to
/// exact comparison and typed aggregates, keeping the rows; afterwards consumer names that
/// differ only in case are different keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn setup_migrates_old_mariadb_inbox_tables_in_place() {
    use mysql_async::prelude::Queryable;
    let db = MariaDb::create("migrate").await;
    let mut c = db.conn().await;
    c.query_drop("DROP TABLE processed_messages, consumer_aggregate_versions")
        .await
        .unwrap();
    c.query_drop(OLD_MY_DDL).await.unwrap();
    let id = Uuid::now_v7();
    c.exec_drop(
        "INSERT INTO processed_messages (consumer, message_id) VALUES ('billing', ?)",
        (id.as_bytes().to_vec(),),
    )
    .await
    .unwrap();
    c.query_drop("INSERT INTO consumer_aggregate_versions (consumer, aggregate_id, version) VALUES ('billing', '42', 5)")
        .await
        .unwrap();
    setup_projection(&db.dsn()).await;
    setup_projection(&db.dsn()).await;
    assert_eq!(
        outboxd::consumer::setup::mysql(&mut c).await.unwrap(),
        Vec::<String>::new(),
        "a migrated database has nothing left to migrate"
    );
    let types: Vec<(String, String)> = c
        .query(format!(
            "SELECT CONCAT(TABLE_NAME, '.', COLUMN_NAME), DATA_TYPE FROM information_schema.COLUMNS
              WHERE TABLE_SCHEMA = '{}' AND TABLE_NAME IN ('processed_messages', 'consumer_aggregate_versions')
                AND COLUMN_NAME IN ('consumer', 'outbox_table', 'aggregate_type', 'aggregate_id')
              ORDER BY 1",
            db.name
        ))
        .await
        .unwrap();
    assert_eq!(
        types,
        vec![
            (
                "consumer_aggregate_versions.aggregate_id".into(),
                "varbinary".into()
            ),
            (
                "consumer_aggregate_versions.aggregate_type".into(),
                "varbinary".into()
            ),
            (
                "consumer_aggregate_versions.consumer".into(),
                "varbinary".into()
            ),
            (
                "consumer_aggregate_versions.outbox_table".into(),
                "varbinary".into()
            ),
            ("processed_messages.consumer".into(), "varbinary".into()),
        ]
    );
    assert_eq!(
        db.count("SELECT COUNT(*) FROM consumer_aggregate_versions WHERE consumer = 'billing' AND aggregate_id = '42' AND version = 5").await,
        1,
        "the stored version is kept"
    );
    c.exec_drop(
        "INSERT INTO processed_messages (consumer, message_id) VALUES ('Billing', ?)",
        (id.as_bytes().to_vec(),),
    )
    .await
    .expect("'Billing' is another consumer than 'billing'");
    assert_eq!(db.count("SELECT COUNT(*) FROM processed_messages").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn setup_migrates_old_postgres_inbox_tables_in_place() {
    let db = PgDb::create("migrate").await;
    let mut c = db.client().await;
    c.batch_execute(OLD_PG_DDL).await.unwrap();
    c.batch_execute("INSERT INTO consumer_aggregate_versions (consumer, aggregate_id, version) VALUES ('billing', '42', 5)")
        .await
        .unwrap();
    setup_projection(&db.dsn()).await;
    setup_projection(&db.dsn()).await;
    assert_eq!(
        outboxd::consumer::setup::postgres(&mut c).await.unwrap(),
        Vec::<String>::new(),
        "a migrated database has nothing left to migrate"
    );
    assert_eq!(
        pg_gate_key(&c).await,
        ["consumer", "outbox_table", "aggregate_type", "aggregate_id"]
    );
    let kept: i64 = c
        .query_one(
            "SELECT count(*) FROM consumer_aggregate_versions WHERE consumer = 'billing' AND aggregate_id = '42' AND version = 5",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(kept, 1, "the stored version is kept");
}
