//! Interrupted first-start snapshots on Postgres: the next life reads every row after the last
//! durable one, including rows whose key columns are NULL. Such a row has no key of its own, so
//! it must come before every key in the snapshot's order (then it was durable before any key
//! was stored), never after the last one (then a resume's `key >` filter drops it for good).
//! The killed first life is the binary; the life that resumes runs in-process.

use crate::common;

use common::inproc::{InProc, Settings};
use common::*;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(90);

fn run<'a>(dsn: &'a str, name: &'a str) -> [&'a str; 8] {
    [
        "run",
        "--source",
        dsn,
        "--name",
        name,
        "--commit-offsets",
        "--snapshot",
        "all",
    ]
}

/// (stored snapshot key, first start marked done) of relay `name`.
async fn progress(c: &tokio_postgres::Client, name: &str) -> (Option<String>, bool) {
    // Before the relay created its state table there is no progress.
    c.query_opt(
        "SELECT snapshot_key, initialized_at IS NOT NULL FROM outboxd_state WHERE name = $1",
        &[&name],
    )
    .await
    .ok()
    .flatten()
    .map(|r| (r.get(0), r.get(1)))
    .unwrap_or((None, false))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_snapshot_loses_no_row_whose_created_at_is_null() {
    let db = PgDb::create("snapnull").await;
    let mut client = db.client().await;
    client
        .batch_execute("ALTER TABLE outbox ALTER COLUMN created_at DROP NOT NULL")
        .await
        .unwrap();
    let mut expected = write_events(&mut client, 10, 1000, "snap.timed").await;
    for _ in 0..3 {
        let id = Uuid::new_v4();
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
                 VALUES ($1, 'agg-null', 'snap.null', '{}', NULL)",
                &[&id],
            )
            .await
            .unwrap();
        expected.push(id);
    }

    // The first life is killed once it stored a snapshot key, mid-snapshot.
    let name = unique("r");
    let dsn = db.dsn();
    let mut first = Relay::start(&run(&dsn, &name));
    wait_for("a stored snapshot key", T, || async {
        progress(&client, &name).await.0.is_some()
    })
    .await;
    first.sigkill();
    let (key, done) = progress(&client, &name).await;
    let first_ids = ids_of(&first.lines());
    assert!(
        !done && first_ids.len() < expected.len(),
        "killed mid-snapshot: {} of {} rows, key {key:?}, done {done}",
        first_ids.len(),
        expected.len()
    );

    // The second life (in-process) finishes the snapshot from the key.
    let second = InProc::postgres(&dsn, &Settings::new(&name).snapshot("all"));
    second
        .wait_running("the first start marked done", || async {
            progress(&client, &name).await.1
        })
        .await;
    second.stop().await;
    let got: HashSet<Uuid> = first_ids.into_iter().chain(second.ids()).collect();
    let missing: Vec<&Uuid> = expected.iter().filter(|i| !got.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} rows never published (the 3 without created_at are the last {:?})",
        missing.len(),
        expected.len(),
        &expected[expected.len() - 3..]
    );
}

/// `outboxd status` shows a running snapshot's progress as the relay last stored it (rows done
/// of the estimate, the time left), and nothing once the snapshot is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_a_running_snapshots_progress() {
    const ROWS: i64 = 150_000;
    let db = PgDb::create("snapstatus").await;
    let client = db.client().await;
    client
        .batch_execute(&format!(
            "INSERT INTO outbox (id, aggregate_id, topic, payload)
               SELECT gen_random_uuid(), 'agg-' || (g % 100), 'snap.status', '{{}}'
                 FROM generate_series(1, {ROWS}) g;
             ANALYZE outbox;"
        ))
        .await
        .unwrap();
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = Relay::start(&run(&dsn, &name));
    let status = || {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["status", "--source", &dsn, "--name", &name])
            .output()
            .expect("run outboxd status");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let mut seen = String::new();
    wait_for("status to show the snapshot's progress", T, || {
        let s = status();
        let line = s
            .lines()
            .find(|l| l.starts_with("progress         snapshot of"))
            .map(str::to_string);
        let found = line.is_some();
        if let Some(l) = line {
            seen = l;
        }
        async move { found }
    })
    .await;
    // `progress         snapshot of "public"."outbox": 61234 of ~150000 rows (40%), about 5 s left`
    let (done, total) = seen
        .split_once(": ")
        .and_then(|(_, r)| r.split_once(" of ~"))
        .and_then(|(d, r)| {
            Some((
                d.parse::<i64>().ok()?,
                r.split(' ').next()?.parse::<i64>().ok()?,
            ))
        })
        .unwrap_or_else(|| panic!("unreadable progress line {seen:?}"));
    assert!(done <= total && total >= ROWS / 2, "{seen}");
    assert!(seen.contains("left") && seen.contains('%'), "{seen}");
    wait_for("every row printed", T, || {
        let n = relay.line_count();
        async move { n as i64 >= ROWS }
    })
    .await;
    wait_for("status to show no running phase", T, || {
        let done = status().lines().any(|l| l == "progress         -");
        async move { done }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0);
}
