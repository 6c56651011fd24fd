//! `pipeline::run` in the test's own process: a log source against the real database, the
//! relay, the source's own state store, and a `MemorySink` the test reads. The test waits on
//! the sink's confirmations as they happen (`MemoryHandle::wait_confirmed`), never by polling,
//! and stops the run through its cancellation token, as a signal does in the binary.

use outboxd::names::{ColumnMap, TableName};
use outboxd::pipeline::{PositionLostPolicy, RunConfig};
use outboxd::relay::RelayOptions;
use outboxd::sink::options::SinkOptions;
use outboxd::sink::SinkDsn;
use outboxd::source::snapshot::SnapshotMode;
use std::future::Future;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The longest a test waits for a run (its start, its events, its stop).
pub const DEADLINE: Duration = Duration::from_secs(90);

/// The shared settings of a run of relay `name` over the contract's `outbox` table, stopped by
/// `stop`: a first start publishes the rows already in the table.
pub fn run_config(name: &str, stop: &CancellationToken) -> RunConfig {
    RunConfig {
        name: name.to_string(),
        tables: vec![TableName::parse("outbox").unwrap()],
        columns: ColumnMap::default(),
        // Not built: the test hands the run its own sink.
        sink: SinkDsn::stdout(),
        commit_offsets: false,
        max_inflight_bytes: 64 * 1024 * 1024,
        relay: RelayOptions {
            stop: Some(stop.clone()),
            ..RelayOptions::default()
        },
        snapshot: SnapshotMode::All,
        on_position_lost: PositionLostPolicy::Fail,
        replay_since: None,
        recovery_margin: Duration::from_secs(60),
        ha: false,
        sink_options: SinkOptions::default(),
        accept_new_source: false,
    }
}

/// Runs `run` and `test` side by side: `test` ends by cancelling the run's token, and the run
/// must then stop cleanly. Fails when the run ends (with an error or not) before the test does,
/// or when both together take longer than [`DEADLINE`].
pub async fn beside<R: std::fmt::Debug, T>(
    run: impl Future<Output = Result<R, outboxd::Error>>,
    test: impl Future<Output = T>,
) -> T {
    let mut run = std::pin::pin!(run);
    let mut test = std::pin::pin!(test);
    let both = async {
        let t = tokio::select! {
            r = &mut run => panic!("the run ended before the test did: {r:?}"),
            t = &mut test => t,
        };
        if let Err(e) = run.await {
            panic!("the run stopped with an error: {e}");
        }
        t
    };
    tokio::time::timeout(DEADLINE, both)
        .await
        .unwrap_or_else(|_| panic!("the run and the test did not end within {DEADLINE:?}"))
}

/// The event ids of `events`, in order.
pub fn ids(events: &[outboxd::OutboxEvent]) -> Vec<uuid::Uuid> {
    events.iter().map(|e| e.id).collect()
}
