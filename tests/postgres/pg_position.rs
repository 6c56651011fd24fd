//! Where a Postgres relay's stream starts, and positions it must not trust. A state row carried
//! over from another cluster (a dump and restore, a logical upgrade, a blue/green switch) holds
//! an LSN this server never wrote: resuming from it would skip every event up to it and push
//! the slot there, so it is a lost position (exit 3 with the fix, or `--on-position-lost poll`,
//! which publishes again from the table and forgets the foreign position). A first start takes
//! its position (the slot) before it decides what to publish from the table, so a producer
//! transaction in flight while the slot is created is published; and a first start whose slot
//! was dropped between two of its lives is a lost position, never a new slot created silently.

use crate::common;
use crate::pg_faults::recreate_slot;

use common::inproc::{end_lease, InProc, Settings};
use common::*;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);

/// Far beyond any WAL a test server writes.
const BOGUS: &str = "FFFF/0";

/// `outboxd run --source … --name NAME --commit-offsets [--on-position-lost poll]`, in-process.
fn settings(name: &str, poll: bool) -> Settings {
    let s = Settings::new(name);
    if poll {
        s.position_lost_poll()
    } else {
        s
    }
}

/// A relay that ran once and stopped cleanly, whose state row then got an LSN from "another
/// cluster": `BOGUS` as its stored position.
async fn carried_over(db: &PgDb, name: &str) {
    let slot = format!("outboxd_{name}");
    let relay = InProc::postgres(&db.dsn(), &settings(name, false));
    relay
        .wait_running("slot active", || db.slot_active(&slot))
        .await;
    let mut client = db.client().await;
    let first = write_events(&mut client, 2, 5, "first").await;
    relay.wait_published("the first events", &first).await;
    relay.stop().await;
    let n = client
        .execute(
            "UPDATE outboxd_state SET position_lsn = $2::text::pg_lsn, position = $2 WHERE name = $1",
            &[&name, &BOGUS],
        )
        .await
        .unwrap();
    assert_eq!(n, 1, "the state row of {name}");
}

/// Whether `lsn` is below `BOGUS` (and so not the foreign position).
async fn below_bogus(db: &PgDb, lsn: &str) -> bool {
    db.client()
        .await
        .query_one(
            "SELECT $1::text::pg_lsn < $2::text::pg_lsn",
            &[&lsn, &BOGUS],
        )
        .await
        .unwrap()
        .get(0)
}

/// The slot re-created by hand on the "new" server (the documented fix for a missing slot):
/// the stored position is still ahead of the server's WAL, so the start stops with exit 3
/// instead of resuming from it (which published 0 of 5 and pushed the slot to the bogus LSN);
/// `--on-position-lost poll` then publishes every committed event, and a later plain start
/// streams on from the position recovery stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_position_ahead_of_the_servers_wal_is_a_lost_position() {
    let db = PgDb::create("foreign").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    carried_over(&db, &name).await;
    let new_slot = recreate_slot(&db, &slot).await;
    let mut client = db.client().await;
    let committed = write_events(&mut client, 5, 1, "committed").await;

    let plain = InProc::postgres(&dsn, &settings(&name, false));
    let (code, err) = plain.exit().await;
    assert_eq!(code, 3, "exit 3 = position lost; error:\n{err}");
    assert!(
        err.contains("ahead of this server's WAL") && err.contains("fix:"),
        "{err}"
    );
    assert!(err.contains("--on-position-lost poll"), "the fix: {err}");
    assert!(plain.sink.published_ids().is_empty(), "nothing streamed");
    assert_eq!(
        db.slot_confirmed(&slot).await.as_deref(),
        Some(new_slot.as_str()),
        "the slot is left as it was"
    );

    end_lease(&db, &name).await;
    let recover = InProc::postgres(&dsn, &settings(&name, true));
    recover
        .wait_published("every committed event, replayed", &committed)
        .await;
    let logs = recover.logs();
    assert!(logs.contains("POSITION LOST"), "said loudly: {logs}");
    recover.stop().await;
    let confirmed = db.slot_confirmed(&slot).await.expect("a slot");
    assert!(
        below_bogus(&db, &confirmed).await,
        "the slot was pushed to the foreign position: {confirmed}"
    );

    // Recovery forgot the foreign position: the next plain start streams what follows.
    let after = write_events(&mut client, 3, 1, "after").await;
    let again = InProc::postgres(&dsn, &settings(&name, false));
    again
        .wait_published("the events after recovery", &after)
        .await;
    again.stop().await;
}

/// The slot missing on the "new" server and `--on-position-lost poll` (the other documented
/// fix): recovery publishes the rows again and must also reset the stored position, or the
/// next plain start resumes from the foreign one (the row kept it: a renewal never lowers a
/// position) and publishes nothing of what follows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recovery_forgets_a_stored_position_ahead_of_the_servers_wal() {
    let db = PgDb::create("foreign2").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    carried_over(&db, &name).await;
    db.drop_released_slot(&slot).await;
    let mut client = db.client().await;
    let committed = write_events(&mut client, 5, 1, "committed").await;

    let recover = InProc::postgres(&dsn, &settings(&name, true));
    recover
        .wait_published("every committed event, replayed", &committed)
        .await;
    recover.stop().await;
    let stored: Option<String> = client
        .query_one(
            "SELECT position_lsn::text FROM outboxd_state WHERE name = $1",
            &[&name],
        )
        .await
        .unwrap()
        .get(0);
    let stored = stored.expect("recovery stored a position");
    assert!(
        below_bogus(&db, &stored).await,
        "the foreign position is still stored: {stored}"
    );

    let after = write_events(&mut client, 5, 1, "after").await;
    let again = InProc::postgres(&dsn, &settings(&name, false));
    again
        .wait_published("the events after recovery", &after)
        .await;
    again.stop().await;
    let confirmed = db.slot_confirmed(&slot).await.expect("a slot");
    assert!(
        below_bogus(&db, &confirmed).await,
        "the slot was pushed to the foreign position: {confirmed}"
    );
}

/// `--snapshot auto` on an empty table without a status column, a producer transaction open
/// (its row inserted) while the relay starts for the first time: creating the slot waits for
/// that transaction, which then commits before the slot's consistent point, so the stream does
/// not carry it. The row must come from the table: it was neither in the snapshot (the table
/// looked empty before the slot existed) nor in the stream, before the table was looked at
/// again once the slot existed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transaction_in_flight_at_the_first_start_is_published() {
    let db = PgDb::create("inflight").await;
    let mut client = db.client().await;
    client
        .batch_execute("ALTER TABLE outbox DROP COLUMN status, DROP COLUMN published_at")
        .await
        .unwrap();
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let mut producer = db.client().await;
    let mut tx = producer.transaction().await.unwrap();
    let inflight = outbox
        .write(
            &mut tx,
            "inflight",
            "i",
            &serde_json::json!({"inflight": true}),
        )
        .await
        .unwrap();

    let relay = InProc::postgres(&dsn, &settings(&name, false));
    // The slot's creation waits for every transaction running when it began: ours.
    let app = format!("outboxd_{name}");
    relay
        .wait_running("the slot's creation waiting for the producer", || {
            let (db, app) = (&db, &app);
            async move {
                db.client()
                    .await
                    .query_opt(
                        "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                            AND wait_event_type = 'Lock' AND query ILIKE '%pg_create_logical_replication_slot%'",
                        &[app],
                    )
                    .await
                    .unwrap()
                    .is_some()
            }
        })
        .await;
    tx.commit().await.unwrap();
    relay
        .wait_published("the row of the transaction in flight", &[inflight])
        .await;
    let later = write_events(&mut client, 2, 1, "later").await;
    relay.wait_published("the rows after it", &later).await;
    relay.stop().await;
    assert!(db.slot_confirmed(&slot).await.is_some(), "the slot stays");

    // And a restart streams on from the first start's position: nothing published again
    // but what follows.
    let next = write_events(&mut client, 1, 1, "next").await;
    let again = InProc::postgres(&dsn, &settings(&name, false));
    again
        .wait_published("the row after the restart", &next)
        .await;
    again.stop().await;
    assert_eq!(again.ids(), next, "only what followed the stop");
}

/// A first start's snapshot (`--snapshot all`) interrupted (SIGKILL) after some rows were
/// durable, its slot dropped before the next life, rows committed meanwhile with a key before
/// the stored one (an early `created_at`: a long producer transaction's row). The next life
/// used to create a slot silently and go on after the stored key: those rows were in neither.
/// Now it is a lost position (exit 3 with the fix); `--on-position-lost poll` starts the first
/// start over and publishes every row. The first life is the binary (it is killed); the next
/// ones run in-process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_dropped_during_an_interrupted_first_start_is_a_lost_position() {
    let db = PgDb::create("interrupted").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let client = db.client().await;
    // Far more than a pipe holds (64 KiB) as stdout lines: the first life blocks on its
    // stdout, which nobody reads, in the middle of its snapshot.
    client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_id, topic, payload)
             SELECT gen_random_uuid(), 'a' || g, 'existing', json_build_object('n', g, 'pad', repeat('x', 200))
               FROM generate_series(1, 3000) g",
        )
        .await
        .unwrap();
    let existing: Vec<Uuid> = client
        .query("SELECT id FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();

    let mut first = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "run",
            "--source",
            &dsn,
            "--name",
            &name,
            "--commit-offsets",
            "--snapshot",
            "all",
            // Small batches: several are flushed and confirmed (their keys stored) before the
            // pipe is full, whatever the timing.
            "--window",
            "8",
        ])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .env_remove("RUST_LOG")
        .spawn()
        .unwrap();
    let unread = first.stdout.take();
    wait_for("a durable snapshot row of the first start", T, || async {
        db.client()
            .await
            .query_one(
                "SELECT snapshot_key IS NOT NULL AND initialized_at IS NULL FROM outboxd_state WHERE name = $1",
                &[&name],
            )
            .await
            .ok()
            .is_some_and(|r| r.get(0))
    })
    .await;
    first.kill().unwrap();
    first.wait().unwrap();
    drop(unread);

    db.drop_released_slot(&slot).await;
    let mut early = Vec::new();
    for _ in 0..3 {
        let id = Uuid::new_v4();
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at)
                 VALUES ($1, 'early', 'early', '{\"early\": true}', '2000-01-01T00:00:00Z')",
                &[&id],
            )
            .await
            .unwrap();
        early.push(id);
    }

    let plain = InProc::postgres(&dsn, &settings(&name, false));
    let (code, err) = plain.exit().await;
    assert_eq!(code, 3, "exit 3 = position lost; error:\n{err}");
    assert!(
        err.contains("interrupted first start") && err.contains("fix:"),
        "{err}"
    );
    assert!(err.contains("--on-position-lost poll"), "the fix: {err}");
    assert!(plain.sink.published_ids().is_empty(), "nothing published");
    assert!(
        db.slot_confirmed(&slot).await.is_none(),
        "no slot silently created"
    );

    end_lease(&db, &name).await;
    let recover = InProc::postgres(&dsn, &settings(&name, true).snapshot("all"));
    let mut expected = existing.clone();
    expected.extend(&early);
    recover
        .wait_published("every row, the early ones included", &expected)
        .await;
    recover.stop().await;
}

/// Which rows count as written by another server: a stored position or a recorded slot start
/// past the flush LSN; nothing at or below it, nor a row that holds neither.
#[test]
fn a_row_past_the_servers_flush_lsn_is_foreign() {
    let flush = 0x1_0000_0000;
    let row = outboxd::state::postgres::StateRow {
        name: "x".into(),
        slot: Some("outboxd_x".into()),
        publication: None,
        epoch: 1,
        lease_holder: None,
        lease_live: false,
        position_lsn: Some(0xFFFF_0000_0000),
        initialized: true,
        replay_since: None,
        lease_expires_at: None,
        updated_at: None,
        position_commit_at: None,
        commit_gap_ms: None,
        created_at: None,
        snapshot_key: None,
        slot_created_lsn: Some(0x100),
    };
    let problem = outboxd::state::postgres::foreign_position(&row.name, &row.stored(), flush)
        .expect("foreign");
    assert!(
        problem.contains("stored position FFFF/0")
            && problem.contains("ahead of this server's WAL (flushed up to 1/0)"),
        "{problem}"
    );
    let here = outboxd::state::postgres::StateRow {
        position_lsn: Some(flush),
        ..row.clone()
    };
    assert_eq!(
        outboxd::state::postgres::foreign_position(&here.name, &here.stored(), flush),
        None
    );
    let slot_start = outboxd::state::postgres::StateRow {
        position_lsn: None,
        slot_created_lsn: Some(flush + 1),
        ..row.clone()
    };
    let problem =
        outboxd::state::postgres::foreign_position(&slot_start.name, &slot_start.stored(), flush)
            .expect("foreign");
    assert!(problem.contains("slot start 1/1"), "{problem}");
    let empty = outboxd::state::postgres::StateRow {
        position_lsn: None,
        slot_created_lsn: None,
        ..row
    };
    assert_eq!(
        outboxd::state::postgres::foreign_position(&empty.name, &empty.stored(), flush),
        None
    );
}

/// The store tells the return path a position is stored (so the slot may be confirmed to
/// it) only when the row holds exactly that position: a row that kept a larger one of its own
/// (a renewal never lowers it) did not store it, and confirming the slot on its word would let
/// a later start resume from a position nobody delivered up to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_is_reported_only_for_what_the_row_holds() {
    use outboxd::event::Checkpoint;
    use outboxd::state::StateStore;
    let db = PgDb::create("held").await;
    let name = unique("r");
    let outboxd::dsn::SourceDsn::Postgres(dsn) = outboxd::dsn::SourceDsn::parse(&db.dsn()).unwrap()
    else {
        panic!("a Postgres DSN");
    };
    let checkpoints = outboxd::state::checkpoint::Checkpointer::new(0);
    let rx = checkpoints.upstream();
    let mut store = outboxd::state::postgres::PgStateStore::new(dsn, format!("outboxd_{name}"))
        .with_slot(&format!("outboxd_{name}"))
        .with_publication(&format!("outboxd_{name}"))
        .with_checkpointer(checkpoints);
    let (lease, _) = store.acquire(&name, "test-holder").await.unwrap();
    let commit = outboxd::state::DurableCommit::default();
    store
        .renew(&lease, Some(&Checkpoint::Lsn(0x1000)), &commit)
        .await
        .unwrap();
    assert_eq!(
        rx.borrow().confirm,
        0x1000,
        "a position the row took is reported"
    );

    // The row holds a larger position than any this store wrote.
    db.client()
        .await
        .execute(
            "UPDATE outboxd_state SET position_lsn = $2::text::pg_lsn, position = $2 WHERE name = $1",
            &[&name, &BOGUS],
        )
        .await
        .unwrap();
    store
        .renew(&lease, Some(&Checkpoint::Lsn(0x2000)), &commit)
        .await
        .unwrap();
    assert_eq!(
        rx.borrow().confirm,
        0x1000,
        "0/2000 reported as stored while the row holds {BOGUS}"
    );
}
