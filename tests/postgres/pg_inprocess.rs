//! `pipeline::run` over the Postgres source in the test's own process (no binary): a first
//! start publishes the rows already in the table and streams what follows, a graceful stop
//! leaves the position in the state row with the slot confirmed no further, and the next run
//! resumes there and publishes only what was written since.

use crate::common::inproc::{beside, ids, run_config};
use crate::common::{unique, write_events, PgDb};
use outboxd::event::{parse_lsn, SourcePosition};
use outboxd::names::{ColumnMap, TableName};
use outboxd::pipeline;
use outboxd::sink::options::SinkOptions;
use outboxd::source::postgres::log::{PgLog, PgOptions};
use outboxd::{MemorySink, OutboxEvent};
use tokio_util::sync::CancellationToken;

fn source(db: &PgDb, name: &str) -> PgLog {
    let outboxd::dsn::SourceDsn::Postgres(dsn) = outboxd::dsn::SourceDsn::parse(&db.dsn()).unwrap()
    else {
        unreachable!("a postgres:// DSN")
    };
    PgLog {
        dsn,
        name: name.to_string(),
        options: PgOptions {
            slot: format!("{name}_slot"),
            publication: format!("{name}_pub"),
        },
        tables: vec![TableName::parse("outbox").unwrap()],
        columns: ColumnMap::default(),
        max_wire_message_bytes: outboxd::source::postgres::wire_message_limit(
            SinkOptions::default().max_message_bytes,
        ),
    }
}

/// The commit LSN of the newest streamed event (snapshot rows carry none).
fn last_commit(events: &[OutboxEvent]) -> u64 {
    events
        .iter()
        .filter_map(|e| match e.position {
            SourcePosition::Pg { commit_lsn, .. } => Some(commit_lsn),
            _ => None,
        })
        .max()
        .expect("a streamed event")
}

/// What the state row holds for `name`, and where the slot is confirmed.
async fn positions(db: &PgDb, name: &str) -> (u64, u64) {
    let client = db.client().await;
    let row = outboxd::state::postgres::load(&client, name)
        .await
        .unwrap()
        .expect("the relay's state row");
    let stored = row.position_lsn.expect("a stored position");
    let slot = db
        .slot_confirmed(&format!("{name}_slot"))
        .await
        .and_then(|s| parse_lsn(&s))
        .expect("the slot");
    (stored, slot)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_run_publishes_snapshot_then_stream_and_resumes_where_the_state_row_says() {
    let db = PgDb::create("inproc").await;
    let name = unique("inproc");
    let mut client = db.client().await;
    let before = write_events(&mut client, 3, 2, "inproc.before").await;

    // First start: the six rows already there (snapshot), then two streamed.
    let (sink, handle) = MemorySink::new();
    let stop = CancellationToken::new();
    let cfg = run_config(&name, &stop);
    let src = source(&db, &name);
    let store = src.state_store();
    let run = pipeline::run(src, store, move || Ok(sink), &cfg, stop.clone());
    let (streamed, all) = beside(run, async {
        handle.wait_confirmed(before.len()).await;
        let streamed = write_events(&mut client, 1, 2, "inproc.stream").await;
        let all = handle.wait_confirmed(before.len() + streamed.len()).await;
        stop.cancel();
        (streamed, all)
    })
    .await;
    let expected: Vec<_> = before.iter().chain(&streamed).copied().collect();
    assert_eq!(
        ids(&all),
        expected,
        "the snapshot's rows, then the stream's, in order"
    );
    assert_eq!(
        ids(&handle.confirmed()),
        expected,
        "nothing more after the stop"
    );
    let (stored, slot) = positions(&db, &name).await;
    let last = last_commit(&all);
    assert!(
        last <= slot && slot <= stored,
        "the final position reached the server and the row, the slot not past the row: last commit {last:X}, slot {slot:X}, row {stored:X}"
    );

    // Written while no relay runs: the next run resumes from the row and publishes only these.
    let later = write_events(&mut client, 2, 2, "inproc.later").await;
    let (sink, handle) = MemorySink::new();
    let stop = CancellationToken::new();
    let cfg = run_config(&name, &stop);
    let src = source(&db, &name);
    let store = src.state_store();
    let run = pipeline::run(src, store, move || Ok(sink), &cfg, stop.clone());
    let got = beside(run, async {
        let got = handle.wait_confirmed(later.len()).await;
        stop.cancel();
        got
    })
    .await;
    assert_eq!(ids(&got), later, "only what was written since the stop");
    assert_eq!(
        ids(&handle.confirmed()),
        later,
        "no event of the first run again"
    );
    let (stored_again, slot_again) = positions(&db, &name).await;
    assert!(
        stored_again > stored && last_commit(&got) <= slot_again && slot_again <= stored_again,
        "the row and the slot moved past the new events: row {stored_again:X}, slot {slot_again:X}"
    );
}

/// The count of one of the process's histograms, from what `/metrics` serves.
fn histogram_count(name: &str) -> u64 {
    let text = outboxd::telemetry::get().render();
    let key = format!("outboxd_{name}_count ");
    text.lines()
        .find_map(|l| l.strip_prefix(&key))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{key} in {text}"))
}

/// Each streamed row is timed from the server's commit and send times to the hand-over: the
/// stage histograms count it, and the event carries the moment the source read it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streamed_rows_are_timed_stage_by_stage() {
    let db = PgDb::create("stages").await;
    let name = unique("stages");
    let mut client = db.client().await;
    let stages = [
        "stage_commit_sent_seconds",
        "stage_sent_read_seconds",
        "stage_read_taken_seconds",
        "stage_taken_published_seconds",
    ];
    let before: Vec<u64> = stages.iter().map(|s| histogram_count(s)).collect();
    let (sink, handle) = MemorySink::new();
    let stop = CancellationToken::new();
    let cfg = run_config(&name, &stop);
    let src = source(&db, &name);
    let store = src.state_store();
    let run = pipeline::run(src, store, move || Ok(sink), &cfg, stop.clone());
    let (written, got) = beside(run, async {
        // Once one row went through, the slot exists: every row committed from now on is
        // streamed, none is read by the snapshot.
        let first = write_events(&mut client, 1, 1, "stages.first").await;
        handle.wait_confirmed(first.len()).await;
        let written = write_events(&mut client, 3, 2, "stages").await;
        let got = handle.wait_confirmed(first.len() + written.len()).await;
        stop.cancel();
        (written, got[first.len()..].to_vec())
    })
    .await;
    assert_eq!(ids(&got), written);
    assert!(
        got.iter().all(|e| e.read_at.is_some()),
        "every streamed event carries its read time"
    );
    for (stage, before) in stages.iter().zip(before) {
        let after = histogram_count(stage);
        assert!(
            after >= before + written.len() as u64,
            "{stage}: {before} → {after} for {} rows",
            written.len()
        );
    }
}
