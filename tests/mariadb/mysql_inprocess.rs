//! `pipeline::run` over the MariaDB binlog source in the test's own process (no binary): a
//! first start publishes the rows already in the table and streams what follows, a graceful
//! stop leaves the position in `outboxd_state` past the last event, and the next run resumes
//! there and publishes only what was written since.

use crate::common::inproc::{beside, ids, run_config};
use crate::common::{binlog_ge, my_write_events, unique, MyDb};
use outboxd::event::SourcePosition;
use outboxd::names::{ColumnMap, TableName};
use outboxd::pipeline;
use outboxd::source::mysql::log::{outbox_tables, MyLog, MySqlOptions};
use outboxd::state::mysql::MyStateStore;
use outboxd::{MemorySink, OutboxEvent};
use tokio_util::sync::CancellationToken;

fn source(db: &MyDb, name: &str) -> (MyLog, MyStateStore) {
    let outboxd::dsn::SourceDsn::Mysql(dsn) = outboxd::dsn::SourceDsn::parse(&db.dsn()).unwrap()
    else {
        unreachable!("a mysql:// DSN")
    };
    let options = MySqlOptions::default();
    let tables = outbox_tables(
        &dsn,
        &[TableName::parse("outbox").unwrap()],
        &ColumnMap::default(),
        options.time_zone,
    )
    .unwrap();
    let store = MyStateStore::new(dsn.clone());
    let source = MyLog {
        dsn,
        name: name.to_string(),
        tables,
        options,
    };
    (source, store)
}

/// The binlog end of the newest streamed event's transaction (snapshot rows carry none).
fn last_end(events: &[OutboxEvent]) -> (String, u64) {
    events
        .iter()
        .rev()
        .find_map(|e| match &e.position {
            SourcePosition::Binlog { file, end_pos, .. } => Some((file.clone(), *end_pos)),
            _ => None,
        })
        .expect("a streamed event")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipeline_run_publishes_snapshot_then_binlog_and_resumes_where_the_state_row_says() {
    let db = MyDb::create("inproc").await;
    let name = unique("inproc");
    let mut conn = db.conn().await;
    let before = my_write_events(&mut conn, 3, 2, "inproc.before").await;

    // First start: the six rows already there (snapshot), then two from the binlog.
    let (sink, handle) = MemorySink::new();
    let stop = CancellationToken::new();
    let cfg = run_config(&name, &stop);
    let (src, store) = source(&db, &name);
    let run = pipeline::run(src, store, move || Ok(sink), &cfg, stop.clone());
    let (streamed, all) = beside(run, async {
        handle.wait_confirmed(before.len()).await;
        let streamed = my_write_events(&mut conn, 1, 2, "inproc.stream").await;
        let all = handle.wait_confirmed(before.len() + streamed.len()).await;
        stop.cancel();
        (streamed, all)
    })
    .await;
    let expected: Vec<_> = before.iter().chain(&streamed).copied().collect();
    assert_eq!(
        ids(&all),
        expected,
        "the snapshot's rows, then the binlog's, in order"
    );
    assert_eq!(
        ids(&handle.confirmed()),
        expected,
        "nothing more after the stop"
    );
    let (file, pos, _) = db.stored(&name).await.expect("a stored position");
    let stored = (file, pos);
    assert!(
        binlog_ge(&stored, &last_end(&all)),
        "the stored position {stored:?} covers the last event ({:?})",
        last_end(&all)
    );

    // Written while no relay runs: the next run resumes from the row and publishes only these.
    let later = my_write_events(&mut conn, 2, 2, "inproc.later").await;
    let (sink, handle) = MemorySink::new();
    let stop = CancellationToken::new();
    let cfg = run_config(&name, &stop);
    let (src, store) = source(&db, &name);
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
    let (file, pos, _) = db.stored(&name).await.expect("a stored position");
    let again = (file, pos);
    assert!(
        binlog_ge(&again, &last_end(&got)) && again != stored,
        "the stored position {again:?} moved past the new events ({:?})",
        last_end(&got)
    );
}
