//! Recovery through the table (`--on-position-lost poll`): when the slot is gone, the rows are
//! usually still in the table. The relay opens a fresh slot, publishes again every row that
//! may have been committed after the last confirmed one — with a margin covering long producer
//! transactions — and streams on. Duplicates are allowed; loss is not. The relay runs
//! in-process (its flags and exit codes are not what is tested here).

use crate::common;

use common::inproc::{InProc, Settings};
use common::*;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_slot_is_recovered_through_the_table() {
    a_dropped_slot_is_recovered_through_the_table_on(PG_PORT).await
}

/// [`a_dropped_slot_is_recovered_through_the_table`] on the server at `port` (run per version by `pg_versions` too).
pub(crate) async fn a_dropped_slot_is_recovered_through_the_table_on(port: u16) {
    let db = PgDb::create_on(port, "recover").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    // `run --commit-offsets --on-position-lost poll`, in-process.
    let settings = Settings::new(&name).position_lost_poll();
    let relay = InProc::postgres(&dsn, &settings);
    relay
        .wait_running("slot active", || db.slot_active(&slot))
        .await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();

    // A producer transaction that stays open 1.5 s commits while the relay runs: its gap is
    // recorded with the position.
    let mut slow = db.client().await;
    {
        let mut tx = slow.transaction().await.unwrap();
        outbox
            .write(&mut tx, "slow", "s", &serde_json::json!({"slow": true}))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1500)).await; // the long transaction itself
        tx.commit().await.unwrap();
    }
    // Another one opens now and commits only after the slot is gone.
    let mut long = db.client().await;
    let mut long_tx = long.transaction().await.unwrap();
    let long_id = outbox
        .write(
            &mut long_tx,
            "long",
            "l",
            &serde_json::json!({"long": true}),
        )
        .await
        .unwrap();

    let mut client = db.client().await;
    let before = write_events(&mut client, 5, 10, "before").await;
    relay
        .wait_published("the events before the stop", &before)
        .await;
    wait_for("the gap and commit time stored", T, || async {
        let row = db
            .client()
            .await
            .query_one("SELECT coalesce(commit_gap_ms, 0), position_commit_at IS NOT NULL FROM outboxd_state WHERE name = $1", &[&name])
            .await
            .unwrap();
        row.get::<_, i64>(0) >= 1500 && row.get::<_, bool>(1)
    })
    .await;
    relay.stop().await;

    db.drop_released_slot(&slot).await;
    let while_lost = write_events(&mut client, 3, 10, "while.lost").await;
    long_tx.commit().await.unwrap();

    let again = InProc::postgres(&dsn, &settings);
    again
        .wait_running("the slot again", || db.slot_active(&slot))
        .await;
    let after = write_events(&mut client, 2, 10, "after").await;
    let mut expected: Vec<Uuid> = while_lost.clone();
    expected.push(long_id);
    expected.extend(&after);
    again
        .wait_published(
            "every row committed while the position was lost, and after",
            &expected,
        )
        .await;
    let logs = again.logs();
    assert!(
        logs.contains("POSITION LOST") && logs.contains("replay_since"),
        "said loudly: {logs}"
    );
    again.stop().await;
}

#[test]
fn the_replay_starts_before_the_last_commit_by_the_largest_gap() {
    use chrono::TimeZone;
    let commit = chrono::Utc.with_ymd_and_hms(2026, 6, 22, 10, 0, 0).unwrap();
    let row = outboxd::state::postgres::StateRow {
        name: "x".into(),
        slot: None,
        publication: None,
        epoch: 1,
        lease_holder: None,
        lease_live: false,
        position_lsn: None,
        initialized: true,
        replay_since: None,
        lease_expires_at: None,
        updated_at: None,
        position_commit_at: Some(commit),
        commit_gap_ms: Some(3_600_000),
        created_at: None,
        snapshot_key: None,
        slot_created_lsn: None,
    };
    let small = Duration::from_secs(60);
    // The observed one-hour gap wins over a one-minute margin.
    let since = outboxd::pipeline::recovery_since(&row.stored(), None, small);
    assert!(since <= commit - chrono::Duration::hours(1), "{since}");
    // A larger margin wins over a smaller gap.
    let row2 = outboxd::state::postgres::StateRow {
        commit_gap_ms: Some(10),
        ..row.clone()
    };
    assert_eq!(
        outboxd::pipeline::recovery_since(&row2.stored(), None, Duration::from_secs(600)),
        commit - chrono::Duration::minutes(10)
    );
    // --replay-since wins over both.
    let explicit = commit - chrono::Duration::days(2);
    assert_eq!(
        outboxd::pipeline::recovery_since(&row.stored(), Some(explicit), small),
        explicit
    );
}
