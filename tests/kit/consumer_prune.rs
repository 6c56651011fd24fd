//! `outboxd prune` on both databases: exactly the rows older than the window go, in batches,
//! while consumers keep inserting; `--dry-run` deletes nothing; a window under the 1 day
//! replay horizon is refused without `--force`; a second pruner is refused; outbox rows in
//! poll mode go only when published.

use crate::common;
use crate::consumer_support;

use common::*;
use consumer_support::*;
use outboxd::consumer::{Inbox, Message};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(180);

async fn prune(dsn: &str, args: &[&str]) -> Proc {
    let mut all = vec!["prune", "--source", dsn];
    all.extend_from_slice(args);
    let mut p = Proc::start(
        std::path::Path::new(env!("CARGO_BIN_EXE_outboxd")),
        &all,
        &[],
    );
    p.wait_exit(T).await;
    p
}

fn code(p: &Proc) -> i32 {
    p.exit.expect("prune() waits for the exit")
}

/// A prune run's summary line.
fn summary(p: &Proc) -> String {
    p.lines()
        .into_iter()
        .find(|l| l.starts_with("done:") || l.starts_with("dry run:"))
        .unwrap_or_else(|| {
            panic!(
                "no summary; stdout {:?}; stderr:\n{}",
                p.lines(),
                p.stderr()
            )
        })
}

/// Inserts claims for fresh ids until stopped, like live consumers; returns how many.
fn pg_inserting(conninfo: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut c = pg_connect(&conninfo).await;
        let inbox = Inbox::new("live").unwrap();
        let mut n = 0;
        while !stop.load(Ordering::Relaxed) {
            let mut tx = c.transaction().await.unwrap();
            for _ in 0..20 {
                assert!(inbox.claim(&mut tx, Uuid::now_v7()).await.unwrap());
                n += 1;
            }
            tx.commit().await.unwrap();
        }
        n
    })
}

fn my_inserting(db: Arc<MariaDb>, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<u64> {
    tokio::spawn(async move {
        let mut c = db.conn().await;
        let inbox = Inbox::new("live").unwrap();
        let mut n = 0;
        while !stop.load(Ordering::Relaxed) {
            let mut tx = c
                .start_transaction(mysql_async::TxOpts::default())
                .await
                .unwrap();
            for _ in 0..20 {
                let m = Message::new(Uuid::now_v7(), "t", Vec::new());
                assert!(inbox.claim(&mut tx, m.id).await.unwrap());
                n += 1;
            }
            tx.commit().await.unwrap();
        }
        n
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_processed_messages_prune_exactly_the_old_rows_while_consumers_insert() {
    let db = PgDb::create("prune").await;
    let c = db.client().await;
    c.batch_execute(PG_DDL).await.unwrap();
    // 20,000 rows of consumer a and 10,000 of b older than 7 days; 5,000 six days old.
    c.batch_execute(
        "INSERT INTO processed_messages (consumer, message_id, processed_at)
           SELECT CASE WHEN g % 3 = 0 THEN 'b' ELSE 'a' END, gen_random_uuid(),
                  now() - interval '8 days' - g * interval '1 second'
             FROM generate_series(1, 30000) g;
         INSERT INTO processed_messages (consumer, message_id, processed_at)
           SELECT 'a', gen_random_uuid(), now() - interval '6 days' - g * interval '1 second'
             FROM generate_series(1, 5000) g;",
    )
    .await
    .unwrap();
    let count = |sql: &'static str| {
        let c = &c;
        async move { c.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let dsn = db.dsn();

    // A window under a day is refused, with the reason.
    let p = prune(
        &dsn,
        &["--table", "processed_messages", "--older-than", "1h"],
    )
    .await;
    assert_eq!(code(&p), 2, "{}", p.stderr());
    assert!(
        p.stderr().contains("runs its effect twice"),
        "{}",
        p.stderr()
    );
    assert!(p.stderr().contains("--recovery-margin"), "{}", p.stderr());
    assert!(p.stderr().contains("--force"), "{}", p.stderr());
    assert_eq!(
        count("SELECT count(*) FROM processed_messages").await,
        35_000
    );

    // Dry run: counts, deletes nothing.
    let p = prune(
        &dsn,
        &[
            "--table",
            "processed_messages",
            "--older-than",
            "7d",
            "--dry-run",
        ],
    )
    .await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    assert!(
        summary(&p).contains("would delete 30000 rows"),
        "{}",
        summary(&p)
    );
    let p = prune(
        &dsn,
        &[
            "--table",
            "processed_messages",
            "--older-than",
            "1h",
            "--dry-run",
        ],
    )
    .await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    assert!(p.lines().iter().any(|l| l.contains("would be refused")));
    assert_eq!(
        count("SELECT count(*) FROM processed_messages").await,
        35_000
    );

    // A second pruner is refused while one holds the lock.
    let holder = db.client().await;
    holder
        .execute(
            "SELECT pg_advisory_lock(hashtextextended('outboxd_prune:public.processed_messages', 0))",
            &[],
        )
        .await
        .unwrap();
    let p = prune(&dsn, &["--table", "processed_messages"]).await;
    assert_eq!(code(&p), 1);
    assert!(
        p.stderr().contains("another outboxd prune") && p.stderr().contains("backend pid"),
        "{}",
        p.stderr()
    );
    drop(holder);

    // One consumer's rows only.
    let p = prune(
        &dsn,
        &[
            "--table",
            "processed_messages",
            "--consumer",
            "b",
            "--batch",
            "3000",
        ],
    )
    .await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    assert!(
        summary(&p).contains("deleted 10000 rows"),
        "{}",
        summary(&p)
    );
    assert_eq!(
        count("SELECT count(*) FROM processed_messages WHERE consumer = 'b'").await,
        0
    );

    // The rest in batches of 1,000 while consumers insert.
    let stop = Arc::new(AtomicBool::new(false));
    let live = pg_inserting(db.conninfo(), stop.clone());
    wait_for("consumers inserting", T, || async {
        count("SELECT count(*) FROM processed_messages WHERE consumer = 'live'").await > 100
    })
    .await;
    let p = prune(
        &dsn,
        &[
            "--table",
            "processed_messages",
            "--older-than",
            "7d",
            "--batch",
            "1000",
            "--pause",
            "0s",
        ],
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let inserted = live.await.unwrap() as i64;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    let s = summary(&p);
    assert!(
        s.contains("deleted 20000 rows") && s.contains("in 20 batches"),
        "{s}"
    );
    assert!(s.contains("rows/s"), "{s}");
    assert_eq!(
        count("SELECT count(*) FROM processed_messages WHERE processed_at < now() - interval '7 days'").await,
        0
    );
    assert_eq!(
        count("SELECT count(*) FROM processed_messages WHERE consumer = 'a'").await,
        5000,
        "the six-day-old rows stay"
    );
    assert_eq!(
        count("SELECT count(*) FROM processed_messages WHERE consumer = 'live'").await,
        inserted,
        "every row the consumers wrote meanwhile stays"
    );
    eprintln!("postgres processed_messages: {s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_outbox_prune_cdc_all_old_rows_poll_only_published() {
    let db = PgDb::create("prune_ob").await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, status, created_at)
           SELECT gen_random_uuid(), 'a' || g, 'invoice.issued', '{}',
                  CASE WHEN g % 4 = 0 THEN 'pending' ELSE 'published' END,
                  now() - interval '10 days' + g * interval '1 millisecond'
             FROM generate_series(1, 8000) g;
         INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
           SELECT gen_random_uuid(), 'n' || g, 'invoice.issued', '{}', now() - interval '1 hour'
             FROM generate_series(1, 1000) g;",
    )
    .await
    .unwrap();
    let count = |sql: &'static str| {
        let c = &c;
        async move { c.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let dsn = db.dsn();
    // Poll mode: old published rows only (pending ones are still to be sent).
    let p = prune(
        &dsn,
        &[
            "--table",
            "outbox",
            "--mode",
            "poll",
            "--older-than",
            "2d",
            "--batch",
            "500",
        ],
    )
    .await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    assert!(summary(&p).contains("deleted 6000 rows"), "{}", summary(&p));
    assert_eq!(
        count("SELECT count(*) FROM outbox WHERE status = 'pending'").await,
        3000,
        "2,000 old pending rows and the 1,000 new ones stay"
    );
    // CDC mode: the relay never marks rows; every old row goes.
    let p = prune(&dsn, &["--table", "public.outbox", "--older-than", "2d"]).await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    assert!(summary(&p).contains("deleted 2000 rows"), "{}", summary(&p));
    assert_eq!(count("SELECT count(*) FROM outbox").await, 1000);
    // The outbox has no created_at index of its own: the run says how to make pruning cheap.
    assert!(p.stderr().contains("CREATE INDEX"), "{}", p.stderr());
    // Wrong table, and --consumer on an outbox.
    let p = prune(&dsn, &["--table", "nope"]).await;
    assert_eq!(code(&p), 2);
    assert!(p.stderr().contains("does not exist"), "{}", p.stderr());
    let p = prune(&dsn, &["--table", "outbox", "--consumer", "x"]).await;
    assert_eq!(code(&p), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_processed_messages_prune_exactly_the_old_rows_while_consumers_insert() {
    use mysql_async::prelude::Queryable;
    let db = Arc::new(MariaDb::create("prune").await);
    let mut c = db.conn().await;
    // 30,000 rows older than 7 days (a and b), 5,000 six days old.
    c.query_drop(
        "INSERT INTO processed_messages (consumer, message_id, processed_at)
           SELECT IF(seq % 3 = 0, 'b', 'a'), UNHEX(MD5(CONCAT('old', seq))),
                  NOW(6) - INTERVAL 8 DAY - INTERVAL seq SECOND
             FROM seq_1_to_30000;
         INSERT INTO processed_messages (consumer, message_id, processed_at)
           SELECT 'a', UNHEX(MD5(CONCAT('young', seq))), NOW(6) - INTERVAL 6 DAY - INTERVAL seq SECOND
             FROM seq_1_to_5000;",
    )
    .await
    .unwrap();
    let dsn = db.dsn();
    let p = prune(
        &dsn,
        &["--table", "processed_messages", "--older-than", "3h"],
    )
    .await;
    assert_eq!(code(&p), 2, "{}", p.stderr());
    assert!(p.stderr().contains("runs its effect twice"));
    let p = prune(&dsn, &["--table", "processed_messages", "--dry-run"]).await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    assert!(
        summary(&p).contains("would delete 30000 rows"),
        "{}",
        summary(&p)
    );
    assert_eq!(
        db.count("SELECT COUNT(*) FROM processed_messages").await,
        35_000
    );

    // A second pruner is refused while one holds the lock.
    let mut holder = db.conn().await;
    let got: Option<i64> = holder
        .exec_first(
            "SELECT GET_LOCK(?, 10)",
            (format!("outboxd_prune:{}.processed_messages", db.name),),
        )
        .await
        .unwrap();
    assert_eq!(got, Some(1));
    let p = prune(&dsn, &["--table", "processed_messages"]).await;
    assert_eq!(code(&p), 1);
    assert!(
        p.stderr().contains("another outboxd prune") && p.stderr().contains("connection"),
        "{}",
        p.stderr()
    );
    holder.disconnect().await.unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    let live = my_inserting(db.clone(), stop.clone());
    wait_for("consumers inserting", T, || async {
        db.count("SELECT COUNT(*) FROM processed_messages WHERE consumer = 'live'")
            .await
            > 100
    })
    .await;
    let p = prune(
        &dsn,
        &[
            "--table",
            "processed_messages",
            "--batch",
            "1000",
            "--pause",
            "0s",
        ],
    )
    .await;
    stop.store(true, Ordering::Relaxed);
    let inserted = live.await.unwrap() as i64;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    let s = summary(&p);
    assert!(
        s.contains("deleted 30000 rows") && s.contains("in 30 batches"),
        "{s}"
    );
    assert_eq!(
        db.count(
            "SELECT COUNT(*) FROM processed_messages WHERE processed_at < NOW(6) - INTERVAL 7 DAY"
        )
        .await,
        0
    );
    assert_eq!(
        db.count("SELECT COUNT(*) FROM processed_messages WHERE consumer = 'a'")
            .await,
        5000
    );
    assert_eq!(
        db.count("SELECT COUNT(*) FROM processed_messages WHERE consumer = 'live'")
            .await,
        inserted
    );
    eprintln!("mariadb processed_messages: {s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mariadb_outbox_prune_cdc_all_old_rows_poll_only_published() {
    use mysql_async::prelude::Queryable;
    let db = MariaDb::create("prune_ob").await;
    let mut c = db.conn().await;
    c.query_drop(include_str!("../../migrations/mysql/001_outbox.sql"))
        .await
        .unwrap();
    c.query_drop(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, status, created_at)
           SELECT UNHEX(MD5(CONCAT('o', seq))), seq, 'invoice.issued', '{}',
                  IF(seq % 4 = 0, 'pending', 'published'),
                  NOW(6) - INTERVAL 10 DAY + INTERVAL seq MICROSECOND
             FROM seq_1_to_8000;
         INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
           SELECT UNHEX(MD5(CONCAT('n', seq))), seq, 'invoice.issued', '{}', NOW(6) - INTERVAL 1 HOUR
             FROM seq_1_to_1000;",
    )
    .await
    .unwrap();
    let dsn = db.dsn();
    let p = prune(
        &dsn,
        &[
            "--table",
            "outbox",
            "--mode",
            "poll",
            "--older-than",
            "2d",
            "--batch",
            "500",
        ],
    )
    .await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    assert!(summary(&p).contains("deleted 6000 rows"), "{}", summary(&p));
    assert_eq!(
        db.count("SELECT COUNT(*) FROM outbox WHERE status = 'pending'")
            .await,
        3000
    );
    let p = prune(
        &dsn,
        &[
            "--table",
            &format!("{}.outbox", db.name),
            "--older-than",
            "2d",
        ],
    )
    .await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    assert!(summary(&p).contains("deleted 2000 rows"), "{}", summary(&p));
    assert_eq!(db.count("SELECT COUNT(*) FROM outbox").await, 1000);
}

/// Without a terminal (CI, systemd, Kubernetes) a prune says how far it is in plain log lines,
/// never a bar's escapes: counts that only grow, and a last line with every row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_without_a_terminal_logs_progress_lines_not_a_bar() {
    let db = PgDb::create("prune_progress").await;
    let c = db.client().await;
    c.batch_execute(PG_DDL).await.unwrap();
    c.batch_execute(
        "INSERT INTO processed_messages (consumer, message_id, processed_at)
           SELECT 'a', gen_random_uuid(), now() - interval '8 days'
             FROM generate_series(1, 20000) g;
         ANALYZE processed_messages;",
    )
    .await
    .unwrap();
    let dsn = db.dsn();
    let p = prune(
        &dsn,
        &[
            "--table",
            "processed_messages",
            "--batch",
            "1000",
            "--pause",
            "5ms",
            "--progress-interval",
            "20ms",
        ],
    )
    .await;
    assert_eq!(code(&p), 0, "{}", p.stderr());
    let raw = p.stderr();
    // A bar redraws in place (carriage returns, "erase line", a hidden cursor) and fills with
    // "=>"; the log's own colours are the only escapes allowed.
    for bar in ["\r", "\x1b[2K", "\x1b[?25l", "=>"] {
        assert!(
            !raw.contains(bar),
            "a bar drawn without a terminal ({bar:?}):\n{raw}"
        );
    }
    let stderr = strip_colours(&raw);
    let counts: Vec<u64> = stderr
        .lines()
        .filter(|l| l.contains("prune progress"))
        .map(|l| {
            l.split_once(" done=")
                .and_then(|(_, r)| r.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("no done= in {l}"))
        })
        .collect();
    assert!(counts.len() >= 2, "progress lines while pruning:\n{stderr}");
    assert!(counts.windows(2).all(|w| w[0] < w[1]), "{counts:?}");
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("prune finished: 20000 rows")),
        "{stderr}"
    );
    // The planner's estimate, read after ANALYZE, is the table's rows.
    assert!(stderr.contains("estimated_total=~20000"), "{stderr}");
}

/// Text without the log's colour escapes (`ESC [ … m`).
fn strip_colours(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
