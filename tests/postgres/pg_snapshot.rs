//! Interrupted first-start snapshots on Postgres: the next life reads every row after the last
//! durable one, including rows whose key columns are NULL. Such a row has no key of its own, so
//! it must come before every key in the snapshot's order (then it was durable before any key
//! was stored), never after the last one (then a resume's `key >` filter drops it for good).

use crate::common;

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

    // The second life finishes the snapshot from the key.
    let mut second = Relay::start(&run(&dsn, &name));
    wait_for("the first start marked done", T, || async {
        progress(&client, &name).await.1
    })
    .await;
    second.signal("TERM");
    assert_eq!(second.wait_exit(T).await, 0, "{}", second.stderr());
    let got: HashSet<Uuid> = first_ids
        .into_iter()
        .chain(ids_of(&second.lines()))
        .collect();
    let missing: Vec<&Uuid> = expected.iter().filter(|i| !got.contains(i)).collect();
    assert!(
        missing.is_empty(),
        "{} of {} rows never published (the 3 without created_at are the last {:?})",
        missing.len(),
        expected.len(),
        &expected[expected.len() - 3..]
    );
}
