//! Errors that are no message's fault never reach the poison policy. The example consumer
//! (`invoice_projection`) runs with `--max-failures 3` and `--on-poison skip` or `park` — the
//! policies that would lose healthy messages or move them to `.dead` — as a database user of
//! its own, and the test breaks
//! the database under it: a read-only database (a role whose sessions are read-only, as on a
//! standby behind the DSN after a failover) is retried with backoff until it takes writes
//! again; a revoked privilege and a renamed column stop the consumer (exit 2, with the fix)
//! with the messages left in the queue. Fixed, every message is applied; none was skipped.

use crate::common;
use crate::consumer_support;

use common::*;
use consumer_support::*;
use std::time::{Duration, Instant};
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);
const SKIP: [&str; 4] = ["--on-poison", "skip", "--max-failures", "3"];

/// A login role of this test on the local Postgres; dropped after the database (declare it
/// first).
struct PgRole(String);

impl Drop for PgRole {
    fn drop(&mut self) {
        let name = self.0.clone();
        run_detached(async move {
            let c = pg_connect(PG_ADMIN).await;
            let _ = c
                .batch_execute(&format!("DROP ROLE IF EXISTS {name}"))
                .await;
        });
    }
}

/// A user of this test on the local MariaDB.
struct MyUser(String);

impl Drop for MyUser {
    fn drop(&mut self) {
        let name = self.0.clone();
        run_detached(async move {
            use mysql_async::prelude::Queryable;
            let mut c = my_conn(None).await;
            let _ = c
                .query_drop(format!("DROP USER IF EXISTS '{name}'@'%'"))
                .await;
            let _ = c.disconnect().await;
        });
    }
}

/// Where the effects land, and how the test changes the database under the consumer.
enum Db {
    Pg(#[allow(dead_code)] PgDb, tokio_postgres::Client),
    My(MariaDb),
}

impl Db {
    async fn exec(&self, sql: &str) {
        match self {
            Db::Pg(_, c) => c
                .batch_execute(sql)
                .await
                .unwrap_or_else(|e| panic!("{sql}: {e}")),
            Db::My(db) => {
                let mut c = db.conn().await;
                my_exec(&mut c, sql).await;
                let _ = c.disconnect().await;
            }
        }
    }

    async fn ledger(&self) -> i64 {
        const SQL: &str = "SELECT count(*) FROM invoice_ledger";
        match self {
            Db::Pg(_, c) => c.query_one(SQL, &[]).await.unwrap().get(0),
            Db::My(db) => db.count(SQL).await,
        }
    }
}

/// Publishes three healthy invoices to `queue`.
async fn publish_three(ch: &lapin::Channel, queue: &str, first: i64) {
    for i in first..first + 3 {
        publish(
            ch,
            "",
            queue,
            invoice_props(Uuid::now_v7(), "invoice.issued", "cust-f", None),
            &invoice_body(i, "cust-f", 100),
        )
        .await;
    }
}

/// Panics when the consumer handed a message to the poison policy.
fn assert_nothing_poisoned(c: &Proc) {
    let err = c.stderr();
    assert!(
        !err.contains("poison message"),
        "a healthy message reached the poison policy; stderr:\n{err}"
    );
}

/// Waits for the consumer to exit (panicking at once if it poisons a message meanwhile) and
/// returns its exit code.
async fn exit_without_poisoning(c: &mut Proc) -> i32 {
    let deadline = Instant::now() + T;
    while c.running() {
        assert_nothing_poisoned(c);
        assert!(
            Instant::now() < deadline,
            "the consumer did not stop; stderr:\n{}",
            c.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let code = c.wait_exit(T).await;
    assert_nothing_poisoned(c);
    code
}

/// Breaks the database with `break_sql`, publishes three invoices and runs the consumer with
/// `--on-poison policy`: it must stop (exit 2) with `code` and `fix` in its error, apply
/// nothing, park nothing and leave the three queued. Then `fix_sql` repairs the database and a
/// drain applies them.
#[allow(clippy::too_many_arguments)]
async fn setup_fault_halts(
    policy: &str,
    db: &Db,
    conn: &lapin::Connection,
    ch: &lapin::Channel,
    queue: &str,
    dsn: &str,
    (break_sql, fix_sql): (&str, &str),
    (code, fix): (&str, &str),
    first: i64,
) {
    let before = db.ledger().await;
    db.exec(break_sql).await;
    publish_three(ch, queue, first).await;
    let args = ["--on-poison", policy, "--max-failures", "3"];
    let mut c = start_consumer(dsn, queue, "faults", &args);
    let exit = exit_without_poisoning(&mut c).await;
    let err = c.stderr();
    assert_eq!(
        exit, 2,
        "a setup problem stops the consumer; stderr:\n{err}"
    );
    assert!(err.contains(code), "{code} named; stderr:\n{err}");
    assert!(err.contains(fix), "the fix ({fix}) given; stderr:\n{err}");
    assert_eq!(db.ledger().await, before, "nothing applied");
    wait_for("the three messages back in the queue", T, || async move {
        ready(conn, queue).await == 3
    })
    .await;
    db.exec(fix_sql).await;
    let mut until_empty = args.to_vec();
    until_empty.push("--until-empty");
    let stopped = drain(
        conn,
        queue,
        || start_consumer(dsn, queue, "faults", &until_empty),
        T,
    )
    .await;
    for p in &stopped {
        assert_eq!(p.stats()["skipped"], 0, "{}", p.stderr());
        assert_eq!(p.stats()["parked"], 0, "{}", p.stderr());
    }
    assert_eq!(
        ready(conn, &format!("{queue}.dead")).await,
        0,
        "nothing parked"
    );
    assert_eq!(
        db.ledger().await,
        before + 3,
        "all three applied once fixed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_infrastructure_errors_never_reach_the_poison_policy() {
    let role = PgRole(unique("consumer_role"));
    let r = &role.0;
    let pg = PgDb::create("faults").await;
    setup_projection(&pg.dsn()).await;
    let client = pg.client().await;
    let admin = pg_connect(PG_ADMIN).await;
    admin
        .batch_execute(&format!("CREATE ROLE {r} LOGIN"))
        .await
        .unwrap();
    client
        .batch_execute(&format!(
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {r}"
        ))
        .await
        .unwrap();
    let dsn = format!("postgres://{r}@127.0.0.1:5432/{}", pg.name);
    let db = Db::Pg(pg, client);
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = OwnQueue::declare(&ch, &unique("faults"), "", "", true).await;
    let publisher = publisher().await;

    // Read-only (SQLSTATE 25006): the role's sessions are read-only, as on a standby the DSN
    // points at after a failover. Retried with backoff on a new session, never counted.
    admin
        .batch_execute(&format!(
            "ALTER ROLE {r} SET default_transaction_read_only = on"
        ))
        .await
        .unwrap();
    publish_three(&publisher, &q.name, 1).await;
    let mut c = start_consumer(&dsn, &q.name, "faults", &SKIP);
    // More attempts than --on-poison would have allowed all three messages together.
    wait_for("ten read-only attempts", T, || {
        let err = c.stderr();
        async move {
            assert!(
                !err.contains("poison message"),
                "a healthy message reached the poison policy; stderr:\n{err}"
            );
            err.matches("25006").count() >= 10
        }
    })
    .await;
    assert_eq!(db.ledger().await, 0);
    admin
        .batch_execute(&format!(
            "ALTER ROLE {r} RESET default_transaction_read_only"
        ))
        .await
        .unwrap();
    wait_for(
        "all three applied once the database takes writes",
        T,
        || {
            let (db, c) = (&db, &c);
            async move {
                assert_nothing_poisoned(c);
                db.ledger().await == 3
            }
        },
    )
    .await;
    stop(&mut c, T).await;
    let stats = c.stats();
    assert_eq!(stats["skipped"], 0, "{stats}");
    assert_eq!(stats["failures"], 0, "{stats}");
    assert_eq!(stats["applied"], 3, "{stats}");

    // Permission denied (42501).
    setup_fault_halts(
        "skip",
        &db,
        &conn,
        &publisher,
        &q.name,
        &dsn,
        (
            &format!("REVOKE INSERT ON invoice_ledger FROM {r}"),
            &format!("GRANT INSERT ON invoice_ledger TO {r}"),
        ),
        ("42501", "GRANT"),
        4,
    )
    .await;

    // Unknown column (42703): a migration renamed it under the running consumer.
    setup_fault_halts(
        "park",
        &db,
        &conn,
        &publisher,
        &q.name,
        &dsn,
        (
            "ALTER TABLE invoice_ledger RENAME COLUMN einvoice_key TO einvoice_key_old",
            "ALTER TABLE invoice_ledger RENAME COLUMN einvoice_key_old TO einvoice_key",
        ),
        ("42703", "column"),
        7,
    )
    .await;
    drop(db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_infrastructure_errors_never_reach_the_poison_policy() {
    let user = MyUser(unique("cons"));
    let u = &user.0;
    let my = MariaDb::create("faults").await;
    setup_projection(&my.dsn()).await;
    let n = my.name.clone();
    let dsn = format!("mysql://{u}:pw@127.0.0.1:3306/{n}");
    let db = Db::My(my);
    db.exec(&format!(
        "CREATE USER '{u}'@'%' IDENTIFIED BY 'pw';
         GRANT SELECT, INSERT, UPDATE, DELETE ON `{n}`.processed_messages TO '{u}'@'%';
         GRANT SELECT, INSERT, UPDATE, DELETE ON `{n}`.consumer_aggregate_versions TO '{u}'@'%';
         GRANT SELECT, INSERT, UPDATE, DELETE ON `{n}`.invoice_totals TO '{u}'@'%';
         GRANT SELECT, UPDATE, DELETE ON `{n}`.invoice_ledger TO '{u}'@'%'"
    ))
    .await;
    let conn = amqp::connect().await;
    let ch = conn.create_channel().await.unwrap();
    let q = OwnQueue::declare(&ch, &unique("faults"), "", "", true).await;
    let publisher = publisher().await;

    // Permission denied (1142): no INSERT on the ledger.
    setup_fault_halts(
        "skip",
        &db,
        &conn,
        &publisher,
        &q.name,
        &dsn,
        (
            "DO 1",
            &format!("GRANT INSERT ON `{n}`.invoice_ledger TO '{u}'@'%'"),
        ),
        ("1142", "GRANT"),
        1,
    )
    .await;

    // Unknown column (1054).
    setup_fault_halts(
        "park",
        &db,
        &conn,
        &publisher,
        &q.name,
        &dsn,
        (
            "ALTER TABLE invoice_ledger RENAME COLUMN einvoice_key TO einvoice_key_old",
            "ALTER TABLE invoice_ledger RENAME COLUMN einvoice_key_old TO einvoice_key",
        ),
        ("1054", "column"),
        4,
    )
    .await;
}
