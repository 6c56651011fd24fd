//! Poll mode on Postgres: several relays on one table, crashes between publish and mark, a
//! broker cut for one relay, and NOTIFY waking a poller early.

use crate::common;

use common::poll::{self, ids};
use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_share_a_table_each_event_once() {
    poll::three_relays_each_event_once(&PgDb::create("poll3").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_publish_and_mark_republishes() {
    poll::sigkill_between_publish_and_mark(&PgDb::create("pollkill").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relays_broker_cut_the_others_carry_on() {
    poll::one_relays_broker_cut(&PgDb::create("pollcut").await, "pollcut").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_a_poller_before_its_interval() {
    let db = PgDb::create("pollnotify").await;
    let dsn = db.dsn();
    let mut setup = Relay::start(&["setup", "--mode", "poll", "--notify", "--source", &dsn]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let relay = Relay::start(&[
        "run",
        "--mode",
        "poll",
        "--notify",
        "--source",
        &dsn,
        "--name",
        "n",
        "--commit-offsets",
        "--poll-interval",
        "1h",
    ]);
    // The first poll happens at start; after it the relay sleeps for an hour unless woken.
    wait_for("the LISTEN session", T, || async {
        pg_connect(PG_ADMIN)
            .await
            .query_opt("SELECT 1 FROM pg_stat_activity WHERE application_name = 'outboxd_listen' AND datname = $1", &[&db.name])
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let mut client = db.client().await;
    let id = write_events(&mut client, 1, 1, "notify").await;
    wait_for(
        "the event, long before the hour",
        Duration::from_secs(10),
        || {
            let n = relay.line_count();
            async move { n >= 1 }
        },
    )
    .await;
    assert_eq!(ids(&relay), id);
}

/// The role `scripts/services.sh` lets in over TLS only (`hostssl … trust`, `host … reject`).
const TLS_ONLY_ROLE: &str = "outboxd_tls_only";

/// `--mode poll --notify` as a role the server admits over TLS only: the claim session and the
/// LISTEN session both connect (encrypted, verified against the test CA) and NOTIFY wakes the
/// poller. A plain connection as that role is refused first, so the server really demands TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_listens_over_tls_when_the_server_allows_only_tls() {
    let db = PgDb::create("polltls").await;
    let plain = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port=5432 user={TLS_ONLY_ROLE} dbname={} sslmode=disable",
            db.name
        ),
        tokio_postgres::NoTls,
    )
    .await;
    match plain {
        Ok(_) => panic!(
            "{TLS_ONLY_ROLE} logged in without TLS: pg_hba.conf lacks the hostssl-only lines. \
             Run `sudo scripts/services.sh`"
        ),
        Err(e) => assert!(
            format!("{e:?}").contains("no encryption"),
            "{TLS_ONLY_ROLE} must be refused for lack of TLS (run `sudo scripts/services.sh`): {e:?}"
        ),
    }
    let mut setup = Relay::start(&["setup", "--mode", "poll", "--notify", "--source", &db.dsn()]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let dsn = format!(
        "postgres://{TLS_ONLY_ROLE}@127.0.0.1:5432/{}?sslmode=verify-full&sslrootcert={}",
        db.name,
        tls_file("ca.crt")
    );
    let relay = Relay::start(&[
        "run",
        "--mode",
        "poll",
        "--notify",
        "--source",
        &dsn,
        "--name",
        "t",
        "--commit-offsets",
        "--poll-interval",
        "1h",
    ]);
    wait_for("the LISTEN session, over TLS", T, || async {
        pg_connect(PG_ADMIN)
            .await
            .query_opt(
                "SELECT 1 FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                 WHERE a.application_name = 'outboxd_listen' AND a.datname = $1 \
                 AND a.usename = $2 AND s.ssl",
                &[&db.name, &TLS_ONLY_ROLE],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let mut client = db.client().await;
    let id = write_events(&mut client, 1, 1, "tls").await;
    wait_for(
        "the event, woken by NOTIFY long before the hour",
        Duration::from_secs(20),
        || {
            let n = relay.line_count();
            async move { n >= 1 }
        },
    )
    .await;
    assert_eq!(ids(&relay), id);
    assert!(
        !relay.stderr().contains("LISTEN session ended"),
        "{}",
        relay.stderr()
    );
}

/// Writes one transaction of five events of one aggregate (versions 1 to 5) with
/// [`outboxd::Outbox::write_event`], placed so that the heap holds them out of insert order:
/// a page is left with a hole (a published row deleted, the table vacuumed), the first event
/// fills a fresh page of its own (its payload is kept inline), and the next ones no longer fit
/// there and go into the hole on the earlier page. A scan in heap order (a sequential scan, or
/// an index whose equal keys sit in heap order) then returns versions 2 to 5 before version 1.
/// Returns the ids in insert order; panics if the placement did not come out that way, so the
/// test cannot pass for want of reordering.
async fn write_one_transaction_on_reused_pages(db: &PgDb) -> Vec<uuid::Uuid> {
    let client = db.client().await;
    client
        .batch_execute(
            "ALTER TABLE outbox ALTER COLUMN payload SET STORAGE PLAIN;
             INSERT INTO outbox (id, aggregate_id, topic, payload, status)
               VALUES (gen_random_uuid(), 'keep', 'fill', json_build_object('pad', repeat('k', 6000)), 'published'),
                      (gen_random_uuid(), 'hole', 'fill', json_build_object('pad', repeat('h', 1500)), 'published');
             DELETE FROM outbox WHERE aggregate_id = 'hole';",
        )
        .await
        .unwrap();
    // A statement of its own: VACUUM refuses to run in the implicit transaction of a batch.
    client.batch_execute("VACUUM outbox").await.unwrap();
    // A fresh session: it has no insert target page of its own yet, so its first row goes where
    // the free space map says.
    let mut producer = db.client().await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let big = serde_json::json!({ "pad": "x".repeat(7990) });
    let mut ids = Vec::new();
    let mut tx = producer.transaction().await.unwrap();
    for version in 1..=5i64 {
        let small = serde_json::json!({ "version": version });
        let payload = if version == 1 { &big } else { &small };
        let id = outbox
            .write_event(
                &mut tx,
                &outboxd::NewEvent {
                    topic: "order.changed",
                    aggregate_id: "order-1",
                    payload,
                    headers: None,
                    version: Some(version),
                },
            )
            .await
            .unwrap();
        ids.push(id);
    }
    tx.commit().await.unwrap();
    let heap: Vec<i64> = client
        .query(
            "SELECT version FROM outbox WHERE aggregate_id = 'order-1' ORDER BY ctid",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        heap,
        [2, 3, 4, 5, 1],
        "the rows were not placed out of insert order; the scenario reproduces nothing"
    );
    ids
}

/// Runs a poll relay until it has published `n` events; returns their ids in publish order.
async fn poll_published(db: &PgDb, name: &str, n: usize) -> Vec<uuid::Uuid> {
    let relay = Relay::start(&poll::stdout_args(&db.dsn(), name, "50ms", "100"));
    wait_for("every event published", T, || {
        let got = relay.line_count();
        async move { got >= n }
    })
    .await;
    ids(&relay)
}

/// A transaction's events share `created_at` (`now()`, the transaction's start); on reused
/// pages the heap holds them out of insert order. Poll mode breaks the tie by `seq` (an
/// identity column, rising with insert order), so version 1 is published before version 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactions_events_are_published_in_insert_order_on_reused_pages() {
    let db = PgDb::create("pollorder").await;
    let written = write_one_transaction_on_reused_pages(&db).await;
    assert_eq!(poll_published(&db, "order", 5).await, written);
}

/// A table without the `seq` column: the tie-break falls back to the id, which
/// `Outbox::write` draws as a UUID v7 (rising within the producer process).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_seq_column_the_uuid_v7_id_keeps_insert_order() {
    let db = PgDb::create("pollorderid").await;
    db.client()
        .await
        .batch_execute("ALTER TABLE outbox DROP COLUMN IF EXISTS seq")
        .await
        .unwrap();
    let written = write_one_transaction_on_reused_pages(&db).await;
    assert_eq!(poll_published(&db, "orderid", 5).await, written);
}

/// `setup --mode poll` on a table made before the `seq` column: it adds the column (rows
/// already there numbered) and the claim's index, and a second run changes nothing. The relay
/// then keeps a transaction's insert order through `seq`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_adds_the_seq_column_and_its_index_once() {
    let db = PgDb::create("pollseqsetup").await;
    let client = db.client().await;
    client
        .batch_execute("ALTER TABLE outbox DROP COLUMN seq")
        .await
        .unwrap();
    let before = write_events(&mut db.client().await, 2, 3, "before").await;
    let dsn = db.dsn();
    let mut setup = Relay::start(&["setup", "--mode", "poll", "--source", &dsn]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let out = setup.lines().join("\n");
    assert!(
        out.contains("column seq (added)") && out.contains("(created_at, seq) (created)"),
        "{out}"
    );
    let numbered: i64 = client
        .query_one("SELECT count(DISTINCT seq) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(numbered, before.len() as i64, "every existing row numbered");
    let valid: bool = client
        .query_one(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = 'public.outbox_pending_seq'::regclass",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(valid);
    let mut again = Relay::start(&["setup", "--mode", "poll", "--source", &dsn]);
    assert_eq!(again.wait_exit(T).await, 0, "{}", again.stderr());
    let out = again.lines().join("\n");
    assert!(
        out.contains("column seq (exists)") && out.contains("(created_at, seq) (exists)"),
        "{out}"
    );
    let indexes: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE tablename = 'outbox' AND indexdef LIKE '%(created_at, seq)%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // Dropping the column dropped the migration's (created_at, seq) index with it.
    assert_eq!(indexes, 1, "the index setup built, and no second one");
    client.batch_execute("DELETE FROM outbox").await.unwrap();
    let written = write_one_transaction_on_reused_pages(&db).await;
    assert_eq!(poll_published(&db, "seqsetup", 5).await, written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_database_connection_is_reconnected_with_backoff() {
    let db = PgDb::create("pollcutdb").await;
    poll::session_loss_reconnects(&db, poll::SessionLoss::ProxyCut, "cutdb").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_sessions_are_reconnected_with_backoff() {
    let db = PgDb::create("pollkilldb").await;
    poll::session_loss_reconnects(&db, poll::SessionLoss::ServerKill, "killdb").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_broker_still_sees_progress() {
    poll::slow_broker_still_progresses(&PgDb::create("pollslow").await, "pollslow").await;
}

/// The LISTEN session is ended by the server: the relay opens it again (with backoff) and
/// NOTIFY wakes the poller as before, long before its interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_terminated_listen_session_is_reopened() {
    let db = PgDb::create("polllisten").await;
    let dsn = db.dsn();
    let mut setup = Relay::start(&["setup", "--mode", "poll", "--notify", "--source", &dsn]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let relay = Relay::start(&[
        "run",
        "--mode",
        "poll",
        "--notify",
        "--source",
        &dsn,
        "--name",
        "l",
        "--commit-offsets",
        "--poll-interval",
        "1h",
    ]);
    let listen_pid = || async {
        pg_connect(PG_ADMIN)
            .await
            .query_opt(
                "SELECT pid FROM pg_stat_activity WHERE application_name = 'outboxd_listen' AND datname = $1",
                &[&db.name],
            )
            .await
            .unwrap()
            .map(|r| r.get::<_, i32>(0))
    };
    wait_for("the LISTEN session", T, || async {
        listen_pid().await.is_some()
    })
    .await;
    let first = listen_pid().await.unwrap();
    let ended: bool = pg_connect(PG_ADMIN)
        .await
        .query_one("SELECT pg_terminate_backend($1)", &[&first])
        .await
        .unwrap()
        .get(0);
    assert!(ended);
    wait_for("a new LISTEN session", Duration::from_secs(30), || async {
        listen_pid().await.is_some_and(|p| p != first)
    })
    .await;
    let id = write_events(&mut db.client().await, 1, 1, "listen").await;
    wait_for(
        "the event, woken by NOTIFY long before the hour",
        Duration::from_secs(10),
        || {
            let n = relay.line_count();
            async move { n >= 1 }
        },
    )
    .await;
    assert_eq!(ids(&relay), id);
}
