//! The inbox against the real databases, without a broker: claim-first semantics (a repeat
//! runs nothing and never raises), concurrent claims of one id (exactly one effect), rollback
//! releasing a claim, deadlocks and serialization failures as typed retryable errors, the
//! stale gate, and on MySQL the warnings `INSERT IGNORE` would otherwise swallow.

use crate::common;
use crate::consumer_support;

use common::*;
use consumer_support::*;
use outboxd::consumer::{Claim, ConsumerError, Inbox, Message};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

const LEDGER_PG: &str = "CREATE TABLE effects (event_id uuid NOT NULL, worker int NOT NULL)";
const LEDGER_MY: &str = "CREATE TABLE effects (event_id BINARY(16) NOT NULL, worker INT NOT NULL)";

async fn pg_setup() -> PgDb {
    let db = PgDb::create("inbox").await;
    let c = db.client().await;
    c.batch_execute(PG_DDL).await.unwrap();
    c.batch_execute(LEDGER_PG).await.unwrap();
    db
}

async fn my_setup() -> MariaDb {
    use mysql_async::prelude::Queryable;
    let db = MariaDb::create("inbox").await;
    db.conn().await.query_drop(LEDGER_MY).await.unwrap();
    db
}

/// One claim-then-effect transaction on Postgres; the effect records `worker` in `effects`.
async fn pg_once(
    c: &mut tokio_postgres::Client,
    inbox: &Inbox,
    msg: &Message,
    worker: i32,
    hold: Duration,
) -> Result<Claim<()>, ConsumerError> {
    let mut tx = c.transaction().await?;
    let claim = inbox
        .run(&mut tx, msg, |tx| async move {
            tx.execute(
                "INSERT INTO effects (event_id, worker) VALUES ($1, $2)",
                &[&msg.id, &worker],
            )
            .await?;
            // Hold the claim a little so concurrent claims of the same id really overlap.
            tokio::time::sleep(hold).await;
            Ok(())
        })
        .await?;
    tx.commit().await?;
    Ok(claim)
}

async fn my_once(
    c: &mut mysql_async::Conn,
    inbox: &Inbox,
    msg: &Message,
    worker: i32,
    hold: Duration,
) -> Result<Claim<()>, ConsumerError> {
    use mysql_async::prelude::Queryable;
    let mut tx = c.start_transaction(mysql_async::TxOpts::default()).await?;
    let claim = inbox
        .run(&mut tx, msg, |tx| async move {
            tx.exec_drop(
                "INSERT INTO effects (event_id, worker) VALUES (?, ?)",
                (msg.id.as_bytes().to_vec(), worker),
            )
            .await?;
            tokio::time::sleep(hold).await;
            Ok(())
        })
        .await?;
    tx.commit().await?;
    Ok(claim)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_repeats_run_nothing_and_rollback_releases_the_claim() {
    let db = pg_setup().await;
    let mut c = db.client().await;
    let inbox = Inbox::new("billing").unwrap();
    let msg = Message::new(Uuid::now_v7(), "invoice.issued", b"{}".to_vec());
    assert_eq!(
        pg_once(&mut c, &inbox, &msg, 1, Duration::ZERO)
            .await
            .unwrap(),
        Claim::Applied(())
    );
    for _ in 0..3 {
        assert_eq!(
            pg_once(&mut c, &inbox, &msg, 1, Duration::ZERO)
                .await
                .unwrap(),
            Claim::Duplicate,
            "a repeat never raises and runs nothing"
        );
    }
    // Another consumer on the same table sees the event once too.
    let other = Inbox::new("shipping").unwrap();
    assert!(pg_once(&mut c, &other, &msg, 2, Duration::ZERO)
        .await
        .unwrap()
        .is_applied());

    // A failing effect rolls back with its claim: the next delivery applies it.
    let failing = Message::new(Uuid::now_v7(), "invoice.issued", b"{}".to_vec());
    {
        let mut tx = c.transaction().await.unwrap();
        let r = inbox
            .run(&mut tx, &failing, |_tx| async {
                Err::<(), _>(ConsumerError::transient("e-invoice API: 503"))
            })
            .await;
        assert!(r.unwrap_err().is_retryable());
        // Dropped without commit: rolled back.
    }
    assert!(pg_once(&mut c, &inbox, &failing, 1, Duration::ZERO)
        .await
        .unwrap()
        .is_applied());
    let n: i64 = c
        .query_one("SELECT count(*) FROM effects", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 3, "billing once, shipping once, the retried one once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_concurrent_claims_of_one_id_give_one_effect() {
    let db = pg_setup().await;
    let inbox = Arc::new(Inbox::new("race").unwrap());
    let ids: Arc<Vec<Uuid>> = Arc::new((0..200).map(|_| Uuid::now_v7()).collect());
    let mut tasks = Vec::new();
    for w in 0..4i32 {
        let (inbox, ids, conninfo) = (inbox.clone(), ids.clone(), db.conninfo());
        tasks.push(tokio::spawn(async move {
            let mut c = pg_connect(&conninfo).await;
            let mut outcomes = Vec::new();
            // Every worker claims every id, in a different order (and the first ten in the
            // same order, held long enough to overlap for sure).
            let mut order: Vec<usize> = (0..ids.len()).collect();
            order[10..].rotate_left(w as usize * 47);
            for i in order {
                let msg = Message::new(ids[i], "t", b"{}".to_vec());
                let hold = if i < 10 {
                    Duration::from_millis(30)
                } else {
                    Duration::ZERO
                };
                loop {
                    match pg_once(&mut c, &inbox, &msg, w, hold).await {
                        Ok(claim) => {
                            outcomes.push(claim);
                            break;
                        }
                        Err(e) if e.is_retryable() => continue,
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            outcomes
        }));
    }
    let mut applied = 0;
    let mut duplicates = 0;
    for t in tasks {
        for o in t.await.unwrap() {
            match o {
                Claim::Applied(()) => applied += 1,
                Claim::Duplicate => duplicates += 1,
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!((applied, duplicates), (200, 600));
    let c = db.client().await;
    let rows = c
        .query(
            "SELECT event_id, count(*) FROM effects GROUP BY event_id HAVING count(*) <> 1",
            &[],
        )
        .await
        .unwrap();
    assert!(
        rows.is_empty(),
        "{} ids with more than one effect",
        rows.len()
    );
    let n: i64 = c
        .query_one("SELECT count(DISTINCT event_id) FROM effects", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_deadlocks_and_serialization_failures_are_typed_and_retryable() {
    let db = pg_setup().await;
    let inbox = Inbox::new("conflicts").unwrap();
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());

    // Deadlock: T1 claims a then b, T2 claims b then a.
    let mut c1 = db.client().await;
    let mut c2 = db.client().await;
    let mut t1 = c1.transaction().await.unwrap();
    let mut t2 = c2.transaction().await.unwrap();
    assert!(inbox.claim(&mut t1, a).await.unwrap());
    assert!(inbox.claim(&mut t2, b).await.unwrap());
    let (r1, r2) = tokio::join!(inbox.claim(&mut t1, b), inbox.claim(&mut t2, a));
    let (ok, err) = match (r1, r2) {
        (Ok(x), Err(e)) => {
            drop(t2);
            t1.commit().await.unwrap();
            (x, e)
        }
        (Err(e), Ok(x)) => {
            drop(t1);
            t2.commit().await.unwrap();
            (x, e)
        }
        other => panic!("expected one deadlock victim: {other:?}"),
    };
    assert!(ok, "the survivor claims the other id");
    assert!(
        matches!(err, ConsumerError::Conflict(ref m) if m.contains("40P01")),
        "{err}"
    );
    assert!(err.is_retryable());

    // REPEATABLE READ: a claim committed after this transaction's snapshot is a serialization
    // failure, not a silent duplicate; run again, it is a plain duplicate.
    let id = Uuid::now_v7();
    let msg = Message::new(id, "t", b"{}".to_vec());
    let mut rr = c1
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .unwrap();
    rr.query_one("SELECT 1", &[]).await.unwrap(); // takes the snapshot
    assert!(pg_once(&mut c2, &inbox, &msg, 2, Duration::ZERO)
        .await
        .unwrap()
        .is_applied());
    let e = inbox.claim(&mut rr, id).await.unwrap_err();
    assert!(
        matches!(e, ConsumerError::Conflict(ref m) if m.contains("40001")),
        "{e}"
    );
    assert!(e.is_retryable());
    drop(rr);
    let mut rr = c1
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .unwrap();
    assert!(
        !inbox.claim(&mut rr, id).await.unwrap(),
        "duplicate on retry"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pg_stale_gate_drops_old_and_equal_versions() {
    let db = pg_setup().await;
    let mut c = db.client().await;
    let inbox = Inbox::new("gate").unwrap().with_stale_gate(None).unwrap();
    let ev = |v: Option<i64>| {
        Message::new(Uuid::now_v7(), "invoice.amended", b"{}".to_vec()).with_aggregate("inv-1", v)
    };
    let mut seen = Vec::new();
    for v in [Some(1), Some(3), Some(2), Some(3), None, Some(4)] {
        seen.push(
            pg_once(&mut c, &inbox, &ev(v), 0, Duration::ZERO)
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        seen,
        vec![
            Claim::Applied(()),
            Claim::Applied(()),
            Claim::Stale {
                version: 2,
                applied: 3
            },
            Claim::Stale {
                version: 3,
                applied: 3
            },
            Claim::Applied(()), // no version: the gate does not apply
            Claim::Applied(()),
        ]
    );
    // Another aggregate and another consumer keep their own versions.
    let other = Message::new(Uuid::now_v7(), "t", b"{}".to_vec()).with_aggregate("inv-2", Some(1));
    assert!(pg_once(&mut c, &inbox, &other, 0, Duration::ZERO)
        .await
        .unwrap()
        .is_applied());
    let without_gate = Inbox::new("gate").unwrap();
    let old = ev(Some(1));
    assert!(
        pg_once(&mut c, &without_gate, &old, 0, Duration::ZERO)
            .await
            .unwrap()
            .is_applied(),
        "the gate is per consumer setting"
    );
    let v: i64 = c
        .query_one(
            "SELECT version FROM consumer_aggregate_versions WHERE consumer = 'gate' AND aggregate_id = 'inv-1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(v, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_repeats_run_nothing_and_rollback_releases_the_claim() {
    let db = my_setup().await;
    let mut c = db.conn().await;
    let inbox = Inbox::new("billing").unwrap();
    let msg = Message::new(Uuid::now_v7(), "invoice.issued", b"{}".to_vec());
    assert!(my_once(&mut c, &inbox, &msg, 1, Duration::ZERO)
        .await
        .unwrap()
        .is_applied());
    for _ in 0..3 {
        assert_eq!(
            my_once(&mut c, &inbox, &msg, 1, Duration::ZERO)
                .await
                .unwrap(),
            Claim::Duplicate
        );
    }
    let failing = Message::new(Uuid::now_v7(), "invoice.issued", b"{}".to_vec());
    {
        let mut tx = c
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .unwrap();
        let r = inbox
            .run(&mut tx, &failing, |_tx| async {
                Err::<(), _>(ConsumerError::permanent("no such customer"))
            })
            .await;
        assert!(!r.unwrap_err().is_retryable());
        tx.rollback().await.unwrap();
    }
    assert!(my_once(&mut c, &inbox, &failing, 1, Duration::ZERO)
        .await
        .unwrap()
        .is_applied());
    assert_eq!(db.count("SELECT COUNT(*) FROM effects").await, 2);
    assert_eq!(db.count("SELECT COUNT(*) FROM processed_messages").await, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_concurrent_claims_of_one_id_give_one_effect() {
    let db = Arc::new(my_setup().await);
    let inbox = Arc::new(Inbox::new("race").unwrap());
    let ids: Arc<Vec<Uuid>> = Arc::new((0..200).map(|_| Uuid::now_v7()).collect());
    let mut tasks = Vec::new();
    for w in 0..4i32 {
        let (inbox, ids, db) = (inbox.clone(), ids.clone(), db.clone());
        tasks.push(tokio::spawn(async move {
            let mut c = db.conn().await;
            let mut outcomes = Vec::new();
            let mut order: Vec<usize> = (0..ids.len()).collect();
            order[10..].rotate_left(w as usize * 47);
            for i in order {
                let msg = Message::new(ids[i], "t", b"{}".to_vec());
                let hold = if i < 10 {
                    Duration::from_millis(30)
                } else {
                    Duration::ZERO
                };
                loop {
                    match my_once(&mut c, &inbox, &msg, w, hold).await {
                        Ok(claim) => {
                            outcomes.push(claim);
                            break;
                        }
                        Err(e) if e.is_retryable() => continue,
                        Err(e) => panic!("{e}"),
                    }
                }
            }
            outcomes
        }));
    }
    let (mut applied, mut duplicates) = (0, 0);
    for t in tasks {
        for o in t.await.unwrap() {
            match o {
                Claim::Applied(()) => applied += 1,
                Claim::Duplicate => duplicates += 1,
                other => panic!("{other:?}"),
            }
        }
    }
    assert_eq!((applied, duplicates), (200, 600));
    assert_eq!(
        db.count("SELECT COUNT(*) FROM (SELECT event_id FROM effects GROUP BY event_id HAVING COUNT(*) <> 1) x")
            .await,
        0,
        "no id has more than one effect"
    );
    assert_eq!(
        db.count("SELECT COUNT(DISTINCT event_id) FROM effects")
            .await,
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_deadlocks_are_typed_retryable_and_ignore_swallows_nothing() {
    use mysql_async::prelude::Queryable;
    let db = my_setup().await;
    let inbox = Inbox::new("conflicts").unwrap();
    let (a, b) = (Uuid::now_v7(), Uuid::now_v7());
    let mut c1 = db.conn().await;
    let mut c2 = db.conn().await;
    c1.query_drop("SET SESSION innodb_lock_wait_timeout = 20")
        .await
        .unwrap();
    c2.query_drop("SET SESSION innodb_lock_wait_timeout = 20")
        .await
        .unwrap();
    let mut t1 = c1
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .unwrap();
    let mut t2 = c2
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .unwrap();
    assert!(inbox.claim(&mut t1, a).await.unwrap());
    assert!(inbox.claim(&mut t2, b).await.unwrap());
    let (r1, r2) = tokio::join!(inbox.claim(&mut t1, b), inbox.claim(&mut t2, a));
    let err = match (r1, r2) {
        (Ok(true), Err(e)) => {
            t2.rollback().await.unwrap();
            t1.commit().await.unwrap();
            e
        }
        (Err(e), Ok(true)) => {
            t1.rollback().await.unwrap();
            t2.commit().await.unwrap();
            e
        }
        other => panic!("expected one deadlock victim: {other:?}"),
    };
    assert!(
        matches!(err, ConsumerError::Conflict(ref m) if m.contains("1213")),
        "{err}"
    );
    assert!(err.is_retryable());
    assert_eq!(db.count("SELECT COUNT(*) FROM processed_messages").await, 2);

    // A column too short for the consumer name: IGNORE would store it cut (warning 1265)
    // and claim ids for a different consumer. The claim fails instead.
    let mut c = db.conn().await;
    c.query_drop(
        "CREATE TABLE pm_short (consumer VARCHAR(4) NOT NULL, message_id BINARY(16) NOT NULL,
           processed_at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), PRIMARY KEY (consumer, message_id))",
    )
    .await
    .unwrap();
    let cut = Inbox::new("billing")
        .unwrap()
        .with_table("pm_short")
        .unwrap();
    let mut tx = c
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .unwrap();
    let e = cut.claim(&mut tx, Uuid::now_v7()).await.unwrap_err();
    tx.rollback().await.unwrap();
    assert!(
        matches!(e, ConsumerError::Config { ref problem, .. } if problem.contains("1265") || problem.contains("1406")),
        "{e}"
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM pm_short").await, 0);

    // A missing table names its migration.
    let missing = Inbox::new("billing").unwrap().with_table("nope").unwrap();
    let mut tx = c
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .unwrap();
    let e = missing.claim(&mut tx, Uuid::now_v7()).await.unwrap_err();
    assert!(
        e.to_string().contains("mysql/003_processed_messages.sql"),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mysql_stale_gate_drops_old_and_equal_versions() {
    let db = my_setup().await;
    let mut c = db.conn().await;
    let inbox = Inbox::new("gate").unwrap().with_stale_gate(None).unwrap();
    let ev = |v: Option<i64>| {
        Message::new(Uuid::now_v7(), "invoice.amended", b"{}".to_vec()).with_aggregate("inv-1", v)
    };
    let mut seen = Vec::new();
    for v in [Some(5), Some(7), Some(6), Some(7), Some(8)] {
        seen.push(
            my_once(&mut c, &inbox, &ev(v), 0, Duration::ZERO)
                .await
                .unwrap(),
        );
    }
    assert_eq!(
        seen,
        vec![
            Claim::Applied(()),
            Claim::Applied(()),
            Claim::Stale {
                version: 6,
                applied: 7
            },
            Claim::Stale {
                version: 7,
                applied: 7
            },
            Claim::Applied(()),
        ]
    );
    assert_eq!(db.count("SELECT COUNT(*) FROM effects").await, 3);
    assert_eq!(
        db.count("SELECT version FROM consumer_aggregate_versions WHERE consumer = 'gate' AND aggregate_id = 'inv-1'")
            .await,
        8
    );
}
