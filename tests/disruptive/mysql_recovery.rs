//! Recovery through the table on MariaDB (`--on-position-lost poll`): the stored binlog
//! position is purged while the relay is stopped and rows keep arriving (one from a long
//! producer transaction). With `fail` the relay exits 3 with the fix; with `poll` it streams
//! from the current position and publishes again every row created since the last durable
//! commit time minus the margin. Duplicates are allowed; loss is not.
//!
//! Purging binlogs touches the whole server, so only the `disruptive` test binary does it
//! (here and in `mysql_restart`), one test at a time ([`crate::ALONE`]), and it purges only
//! files older than every position another live relay on the server has stored (see
//! [`purge_before`]).

use crate::common;

use common::*;
use mysql_async::prelude::Queryable;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

fn ids(relay: &Relay) -> HashSet<Uuid> {
    parse_lines(&relay.lines())
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

fn seq(file: &str) -> u64 {
    file.rsplit('.')
        .next()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

/// Purges every binlog file before `keep`, once no other live relay on the server (a state row
/// renewed within the last minute, in any database but `mine`) has its position in one of
/// them: other engineers' relays stopped for a moment must not lose theirs.
async fn purge_before(keep: &str, mine: &str) {
    wait_for(
        "every other live relay's stored position to be past the files to purge",
        T,
        || {
            let keep = keep.to_string();
            let mine = mine.to_string();
            async move {
                let mut admin = my_connect(None).await;
                let dbs: Vec<String> = admin
                    .query(
                        "SELECT TABLE_SCHEMA FROM information_schema.TABLES WHERE TABLE_NAME = 'outboxd_state'",
                    )
                    .await
                    .unwrap();
                for db in dbs.into_iter().filter(|d| *d != mine) {
                    let files: Vec<Option<String>> = admin
                        .query(format!(
                            "SELECT binlog_file FROM `{db}`.outboxd_state
                              WHERE updated_at > UTC_TIMESTAMP(6) - INTERVAL 60 SECOND"
                        ))
                        .await
                        .unwrap_or_default();
                    if files.into_iter().flatten().any(|f| seq(&f) < seq(&keep)) {
                        return false;
                    }
                }
                true
            }
        },
    )
    .await;
    // A file stays "in use" until the storage engine's checkpoint covers it: retry.
    wait_for("the older binlogs to be purged", T, || {
        let keep = keep.to_string();
        async move {
            let mut admin = my_connect(None).await;
            let _ = admin
                .query_drop(format!("PURGE BINARY LOGS TO '{keep}'"))
                .await;
            my_value(&mut admin, "SHOW BINARY LOGS").await.as_deref() == Some(keep.as_str()) || {
                let first: Vec<String> = admin.query("SHOW BINARY LOGS").await.unwrap_or_default();
                first.first().is_some_and(|f| seq(f) >= seq(&keep))
            }
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purged_position_is_recovered_through_the_table() {
    let _alone = crate::ALONE.lock().await;
    let db = MyDb::create("my_recover").await;
    let name = unique("r");
    let dsn = db.dsn();
    let run = |policy: &'static str| {
        vec![
            "run".to_string(),
            "--source".into(),
            dsn.clone(),
            "--name".into(),
            name.clone(),
            "--commit-offsets".into(),
            "--on-position-lost".into(),
            policy.into(),
        ]
    };
    let start = |policy: &'static str| {
        let a = run(policy);
        Relay::start(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let mut relay = start("poll");
    wait_for("the binlog dump", T, || db.streaming()).await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();

    // A producer transaction that stays open 1.5 s commits while the relay runs: its gap is
    // recorded with the position.
    let mut slow = db.conn().await;
    {
        let mut tx = slow
            .start_transaction(mysql_async::TxOpts::default())
            .await
            .unwrap();
        outbox
            .write(&mut tx, "slow", "1", &serde_json::json!({"slow": true}))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await; // the long transaction itself
        tx.commit().await.unwrap();
    }
    // Another one opens now and commits only after the position is lost.
    let mut long = db.conn().await;
    let mut long_tx = long
        .start_transaction(mysql_async::TxOpts::default())
        .await
        .unwrap();
    let long_id = outbox
        .write(
            &mut long_tx,
            "long",
            "2",
            &serde_json::json!({"long": true}),
        )
        .await
        .unwrap();

    let mut c = db.conn().await;
    let before = my_write_events(&mut c, 5, 10, "before").await;
    wait_for("the events before the stop", T, || {
        let got = ids(&relay);
        let all = before.iter().all(|i| got.contains(i));
        async move { all }
    })
    .await;
    wait_for("the gap and commit time stored", T, || async {
        let mut c = db.conn().await;
        my_value(
            &mut c,
            &format!(
                "SELECT COALESCE(commit_gap_ms, 0) >= 1500 AND position_commit_at IS NOT NULL FROM outboxd_state WHERE name = '{name}'"
            ),
        )
        .await
        .as_deref()
            == Some("1")
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let (stored_file, _, _) = db.stored(&name).await.unwrap();

    // Written while stopped, in the stored position's file (purged below: only the table
    // still has them) and in the next one.
    let mut while_lost = my_write_events(&mut c, 3, 10, "while.lost").await;
    let mut admin = my_connect(None).await;
    my_exec(&mut admin, "FLUSH BINARY LOGS").await;
    let (head_file, _) = my_head().await;
    assert!(seq(&head_file) > seq(&stored_file));
    while_lost.extend(my_write_events(&mut c, 2, 10, "while.lost.2").await);
    wait_for("the old dump thread to go", T, || async {
        !db.streaming().await
    })
    .await;
    purge_before(&head_file, &db.name).await;

    // fail (the default): exit 3 with the fix, nothing published.
    let mut failed = start("fail");
    let code = failed.wait_exit(T).await;
    let err = failed.stderr();
    assert_eq!(code, 3, "exit 3 = stored position lost; stderr:\n{err}");
    assert!(err.contains("fix:") && err.contains("teardown"), "{err}");
    assert!(failed.lines().is_empty());

    long_tx.commit().await.unwrap();
    let again = start("poll");
    wait_for("the binlog dump again", T, || db.streaming()).await;
    let after = my_write_events(&mut c, 2, 10, "after").await;
    let mut expected: Vec<Uuid> = while_lost.clone();
    expected.push(long_id);
    expected.extend(&after);
    wait_for(
        "every row committed while the position was lost, and after",
        T,
        || {
            let got = ids(&again);
            let all = expected.iter().all(|i| got.contains(i));
            async move { all }
        },
    )
    .await;
    let err = again.stderr_plain();
    assert!(
        err.contains("POSITION LOST") && err.contains("replay_since") && err.contains("rows="),
        "said loudly: {err}"
    );
    // The stored position moved to the new files once the replay was confirmed.
    wait_for("a position in a file that exists", T, || async {
        db.stored(&name)
            .await
            .is_some_and(|(f, _, _)| seq(&f) >= seq(&head_file))
    })
    .await;
}

#[test]
fn mysql_replays_start_a_second_earlier_for_whole_second_commit_times() {
    use chrono::TimeZone;
    let commit = chrono::Utc.with_ymd_and_hms(2026, 6, 22, 10, 0, 0).unwrap();
    let stored = outboxd::state::DurableCommit {
        commit_at: Some(commit),
        max_gap_ms: Some(60_000),
    };
    let since = outboxd::pipeline::replay_start(
        &stored,
        None,
        None,
        Duration::from_secs(1),
        Duration::from_secs(2),
    );
    assert_eq!(since, commit - chrono::Duration::seconds(62));
    // A larger margin wins; --replay-since wins over both.
    let since = outboxd::pipeline::replay_start(
        &stored,
        None,
        None,
        Duration::from_secs(600),
        Duration::from_secs(2),
    );
    assert_eq!(since, commit - chrono::Duration::minutes(10));
    let explicit = commit - chrono::Duration::days(2);
    assert_eq!(
        outboxd::pipeline::replay_start(
            &stored,
            None,
            Some(explicit),
            Duration::from_secs(1),
            Duration::from_secs(2)
        ),
        explicit
    );
}
