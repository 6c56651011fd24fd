//! Poll mode on MariaDB: several relays on one table, a crash between publish and mark, a
//! broker cut for one relay, and `setup --create-table --mode poll` / `check --mode poll`.

use crate::common;

use common::poll;
use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_share_a_table_each_event_once() {
    poll::three_relays_each_event_once(&MyDb::create("my_poll3").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_publish_and_mark_republishes() {
    poll::sigkill_between_publish_and_mark(&MyDb::create("my_pollkill").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relays_broker_cut_the_others_carry_on() {
    poll::one_relays_broker_cut(&MyDb::create("my_pollcut").await, "mypollcut").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_creates_the_seeds_table_and_check_validates_it() {
    let db = MyDb::create("my_pollsetup").await;
    let dsn = db.dsn();
    let mut c = db.conn().await;
    my_exec(&mut c, "DROP TABLE outbox").await;
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(args)
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("migrations/mysql/001_outbox.sql"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = run(&[
        "setup",
        "--create-table",
        "--mode",
        "poll",
        "--source",
        &dsn,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("(created)"));
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("idx_dispatch") && text.contains("grants"),
        "{text}"
    );

    // Without the index: a failure with the statement that adds it.
    my_exec(&mut c, "ALTER TABLE outbox DROP KEY idx_dispatch").await;
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("ADD KEY idx_dispatch (`status`, `created_at`)"),
        "{text}"
    );
    // Without the status column: poll mode refuses to start, with the fix.
    my_exec(&mut c, "ALTER TABLE outbox DROP COLUMN status").await;
    let mut relay = Relay::start(&poll::stdout_args(&dsn, "s", "50ms", "10"));
    let code = relay.wait_exit(T).await;
    assert_eq!(code, 2, "{}", relay.stderr());
    assert!(
        relay
            .stderr()
            .contains("ADD COLUMN status ENUM('pending','published')"),
        "{}",
        relay.stderr()
    );

    // A user without UPDATE on the table: check says which GRANT is missing.
    let user = unique("pollro");
    let mut admin = my_connect(None).await;
    my_exec(
        &mut admin,
        &format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"),
    )
    .await;
    my_exec(&mut c, "ALTER TABLE outbox ADD COLUMN status ENUM('pending','published') NOT NULL DEFAULT 'pending', ADD KEY idx_dispatch (status, created_at)").await;
    my_exec(
        &mut admin,
        &format!("GRANT SELECT ON `{}`.* TO '{user}'@'%'", db.name),
    )
    .await;
    let ro = format!("mysql://{user}:pw@{MY_HOST}:{MY_PORT}/{}", db.name);
    let out = run(&["check", "--mode", "poll", "--source", &ro]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    my_exec(&mut admin, &format!("DROP USER '{user}'@'%'")).await;
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("GRANT SELECT, UPDATE ON"), "{text}");
}

/// Runs a poll relay until it has published `n` events; returns their ids in publish order.
async fn poll_published(db: &MyDb, name: &str, n: usize) -> Vec<uuid::Uuid> {
    let relay = Relay::start(&poll::stdout_args(&db.dsn(), name, "50ms", "100"));
    wait_for("every event published", T, || {
        let got = relay.line_count();
        async move { got >= n }
    })
    .await;
    poll::ids(&relay)
}

/// A producer other than `Outbox::write` inserts one transaction's rows in one multi-row
/// INSERT: one `NOW(6)` for all of them, and ids that do not rise with insert order (here they
/// fall). The table's `seq` column (AUTO_INCREMENT) breaks the tie, so the rows are published
/// in insert order, version 1 first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seq_column_keeps_insert_order_for_rows_with_one_created_at() {
    let db = MyDb::create("my_pollseq").await;
    let mut c = db.conn().await;
    my_exec(
        &mut c,
        "ALTER TABLE outbox ADD COLUMN seq BIGINT NOT NULL AUTO_INCREMENT, ADD UNIQUE KEY (seq)",
    )
    .await;
    let written: Vec<uuid::Uuid> = (0..5u128)
        .map(|i| uuid::Uuid::from_u128(u128::MAX - i))
        .collect();
    let values: Vec<String> = written
        .iter()
        .enumerate()
        .map(|(i, id)| {
            format!(
                "(UNHEX('{}'), 1, 'order.changed', '{{\"version\": {}}}', NOW(6))",
                id.simple(),
                i + 1
            )
        })
        .collect();
    my_exec(
        &mut c,
        &format!(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES {}",
            values.join(", ")
        ),
    )
    .await;
    assert_eq!(poll_published(&db, "seq", 5).await, written);
}

/// Without a `seq` column, rows with one `created_at` (forced here: the session's clock is
/// fixed) are ordered by id, which `Outbox::write` draws as a UUID v7 rising within the
/// producer process: one transaction's events still come out in insert order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_seq_column_outbox_write_ids_keep_insert_order() {
    let db = MyDb::create("my_pollid").await;
    let mut c = db.conn().await;
    my_exec(&mut c, "SET TIMESTAMP = 1767225600.123456").await;
    let written = my_write_events(&mut c, 1, 20, "order.changed").await;
    let distinct: Option<i64> = {
        use mysql_async::prelude::Queryable;
        c.query_first("SELECT COUNT(DISTINCT created_at) FROM outbox")
            .await
            .unwrap()
    };
    assert_eq!(distinct, Some(1), "the rows share one created_at");
    assert_eq!(poll_published(&db, "id", 20).await, written);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_database_connection_is_reconnected_with_backoff() {
    let db = MyDb::create("my_pollcutdb").await;
    poll::session_loss_reconnects(&db, poll::SessionLoss::ProxyCut, "cutdb").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_sessions_are_reconnected_with_backoff() {
    let db = MyDb::create("my_pollkilldb").await;
    poll::session_loss_reconnects(&db, poll::SessionLoss::ServerKill, "killdb").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_broker_still_sees_progress() {
    poll::slow_broker_still_progresses(&MyDb::create("my_pollslow").await, "mypollslow").await;
}
