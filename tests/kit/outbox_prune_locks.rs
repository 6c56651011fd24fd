//! `outboxd prune` of a MySQL/MariaDB outbox never blocks producers. Without an index on the
//! time column a batch's `DELETE … WHERE created_at < ? LIMIT n` scans the clustered index under
//! next-key locks: it waits for a producer's open transaction and, meanwhile, holds the gaps it
//! passed against every other producer's insert (READ COMMITTED does not help: a DELETE takes
//! no semi-consistent reads). So prune refuses such a table with the `ALTER TABLE` that fixes
//! it, and with the index (the shipped DDL has it) its range stays on old rows.

use crate::consumer_support;

use consumer_support::*;
use mysql_async::prelude::Queryable;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

/// The outbox of a CDC setup (no status column, no time index), as many users have it.
const CDC_OUTBOX: &str = "CREATE TABLE outbox (
    id BINARY(16) NOT NULL PRIMARY KEY,
    aggregate_id BIGINT NOT NULL,
    topic VARCHAR(120) NOT NULL,
    payload JSON NOT NULL,
    created_at DATETIME(6) NOT NULL
) ENGINE=InnoDB";

fn prune(dsn: &str) -> Proc {
    Proc::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_outboxd")),
        &[
            "prune",
            "--source",
            dsn,
            "--table",
            "outbox",
            "--older-than",
            "2d",
            "--batch",
            "500",
        ],
        &[],
    )
}

/// Whether a `DELETE` of database `db` waits for a lock now.
async fn delete_waits(probe: &mut mysql_async::Conn, db: &str) -> bool {
    let n: Option<i64> = probe
        .exec_first(
            "SELECT COUNT(*) FROM information_schema.INNODB_TRX t
               JOIN information_schema.PROCESSLIST p ON p.ID = t.trx_mysql_thread_id
              WHERE p.DB = ? AND t.trx_state = 'LOCK WAIT' AND t.trx_query LIKE 'DELETE%'",
            (db,),
        )
        .await
        .unwrap();
    n.unwrap_or(0) > 0
}

/// Runs a prune while a producer's transaction holds a new row at the very end of the primary
/// key; returns (whether the prune's DELETE waited for it, another producer's insert meanwhile,
/// the prune).
async fn prune_beside_an_open_producer(
    db: &MariaDb,
    n: u32,
) -> (bool, Result<(), mysql_async::Error>, Proc) {
    let mut open = db.conn().await;
    open.query_drop("BEGIN").await.unwrap();
    open.exec_drop(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
         VALUES (UNHEX(CONCAT(REPEAT('ff', 15), LPAD(HEX(?), 2, '0'))), 1, 'new', '{}', NOW(6))",
        (n,),
    )
    .await
    .unwrap();
    let mut p = prune(&db.dsn());
    let mut probe = db.conn().await;
    let mut waited = false;
    let deadline = std::time::Instant::now() + T;
    // Until the prune has finished, or its DELETE waits for the open row.
    while p.child.try_wait().unwrap().is_none() {
        if delete_waits(&mut probe, &db.name).await {
            waited = true;
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the prune neither finished nor waited"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut other = db.conn().await;
    other
        .query_drop("SET SESSION innodb_lock_wait_timeout = 3")
        .await
        .unwrap();
    let inserted = other
        .exec_drop(
            "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
             VALUES (UNHEX(MD5(CONCAT('other producer', ?))), 2, 'new', '{}', NOW(6))",
            (n,),
        )
        .await;
    open.query_drop("COMMIT").await.unwrap();
    p.wait_exit(T).await;
    (waited, inserted, p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_prune_neither_waits_for_nor_blocks_producers() {
    let db = MariaDb::create("prune_lk").await;
    let mut c = db.conn().await;
    c.query_drop(CDC_OUTBOX).await.unwrap();
    c.query_drop(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
           SELECT UNHEX(MD5(CONCAT('o', seq))), seq, 'invoice.issued', '{}', NOW(6) - INTERVAL 10 DAY
             FROM seq_1_to_5000",
    )
    .await
    .unwrap();

    // No index on created_at: refused with the fix, nothing deleted, nobody blocked.
    let (waited, inserted, p) = prune_beside_an_open_producer(&db, 1).await;
    assert!(
        !waited,
        "the prune waited for a producer's open transaction"
    );
    assert!(
        inserted.is_ok(),
        "a producer waited behind the prune: {inserted:?}"
    );
    assert_eq!(p.exit, Some(2), "{}", p.stderr());
    assert!(
        p.stderr()
            .contains("ALTER TABLE `outbox` ADD INDEX (`created_at`)"),
        "{}",
        p.stderr()
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM outbox").await, 5002);

    // With the index: the old rows go while a producer's transaction is open, and neither
    // waits for the other.
    c.query_drop("ALTER TABLE outbox ADD INDEX (created_at)")
        .await
        .unwrap();
    let (waited, inserted, p) = prune_beside_an_open_producer(&db, 2).await;
    assert!(
        !waited,
        "the prune waited for a producer's open transaction"
    );
    assert!(
        inserted.is_ok(),
        "a producer waited behind the prune: {inserted:?}"
    );
    assert_eq!(p.exit, Some(0), "{}", p.stderr());
    assert_eq!(
        db.count("SELECT COUNT(*) FROM outbox").await,
        4,
        "the old rows went"
    );
}
