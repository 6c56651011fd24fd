//! `pipeline::run` in the test's own process: a log source against the real database, the
//! relay, the source's own state store, and a `MemorySink` the test reads. The test waits on
//! the sink's confirmations as they happen (`MemoryHandle::wait_confirmed`), never by polling,
//! and stops the run through its cancellation token, as a signal does in the binary.

use outboxd::names::{ColumnMap, TableName};
use outboxd::pipeline::{PositionLostPolicy, RunConfig};
use outboxd::relay::RelayOptions;
use outboxd::sink::format::MessageOptions;
use outboxd::sink::options::SinkOptions;
use outboxd::sink::SinkDsn;
use outboxd::source::mysql::log::{outbox_tables, MyLog, MySqlOptions};
use outboxd::source::postgres::log::{PgLog, PgOptions};
use outboxd::source::snapshot::SnapshotMode;
use outboxd::state::mysql::MyStateStore;
use outboxd::{MemoryHandle, MemorySink, OutboxEvent};
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

/// What a test sets of an in-process run; everything else is `outboxd run`'s default, with
/// the memory sink standing where `--sink stdout --commit-offsets` would (it stores positions
/// as it confirms). Slot and publication are the binary's defaults (`outboxd_<name>`), so a
/// test may hand a relay from a process to an in-process run and back.
#[derive(Debug, Clone)]
pub struct Settings {
    pub name: String,
    /// `--table`, repeated.
    pub tables: Vec<String>,
    /// `--snapshot`.
    pub snapshot: String,
    /// `--on-position-lost poll` (else `fail`).
    pub position_lost_poll: bool,
    /// `--window`.
    pub window: usize,
    /// `--confirm-timeout`.
    pub confirm_timeout: Duration,
    /// `--max-message-bytes`.
    pub max_message_bytes: usize,
}

impl Settings {
    pub fn new(name: &str) -> Settings {
        Settings {
            name: name.to_string(),
            tables: vec!["outbox".into()],
            snapshot: "auto".into(),
            position_lost_poll: false,
            window: outboxd::relay::DEFAULT_WINDOW,
            confirm_timeout: Duration::from_secs(30),
            // 16MiB, the flag's default (it also bounds the Postgres source's wire messages).
            max_message_bytes: 16 * 1024 * 1024,
        }
    }

    pub fn tables(mut self, tables: &[&str]) -> Settings {
        self.tables = tables.iter().map(|t| t.to_string()).collect();
        self
    }

    pub fn snapshot(mut self, mode: &str) -> Settings {
        self.snapshot = mode.into();
        self
    }

    pub fn position_lost_poll(mut self) -> Settings {
        self.position_lost_poll = true;
        self
    }

    pub fn window(mut self, window: usize) -> Settings {
        self.window = window;
        self
    }

    pub fn confirm_timeout(mut self, timeout: Duration) -> Settings {
        self.confirm_timeout = timeout;
        self
    }

    pub fn max_message_bytes(mut self, bytes: usize) -> Settings {
        self.max_message_bytes = bytes;
        self
    }

    /// The `RunConfig` `outboxd run` builds from these flags.
    fn config(&self, stop: &CancellationToken) -> RunConfig {
        // The columns the default message reads, and the aggregate's type where the table has
        // it, as `run` adds them.
        let message = MessageOptions::default();
        let mut columns = ColumnMap::default();
        for name in message.columns() {
            columns.require_extra(name, true);
        }
        columns.require_extra(outboxd::names::Column::AggregateType.name(), false);
        RunConfig {
            name: self.name.clone(),
            tables: self
                .tables
                .iter()
                .map(|t| TableName::parse(t).unwrap())
                .collect(),
            columns,
            // Not built: the run is handed its sink (unless [`InProc::with_sink`] names one).
            sink: SinkDsn::stdout(),
            commit_offsets: true,
            max_inflight_bytes: 64 * 1024 * 1024,
            relay: RelayOptions {
                window: self.window,
                confirm_timeout: self.confirm_timeout,
                stop: Some(stop.clone()),
                ..RelayOptions::default()
            },
            snapshot: SnapshotMode::parse(&self.snapshot).unwrap(),
            on_position_lost: if self.position_lost_poll {
                PositionLostPolicy::Poll
            } else {
                PositionLostPolicy::Fail
            },
            replay_since: None,
            recovery_margin: Duration::from_secs(600),
            ha: false,
            sink_options: SinkOptions {
                message,
                max_message_bytes: self.max_message_bytes,
                ..SinkOptions::default()
            },
            accept_new_source: false,
        }
    }
}

/// The log lines of one run, as the binary would print them on stderr (without colours).
#[derive(Clone, Default)]
pub struct Logs(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Logs {
    /// A subscriber writing into these logs at the binary's default level (info).
    fn dispatch(&self) -> tracing::Dispatch {
        let logs = self.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_max_level(tracing::Level::INFO)
            .with_writer(move || logs.clone())
            .finish()
            .into()
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

impl std::io::Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A relay run in the test's process, as a task of the test's runtime: the in-process
/// counterpart of [`crate::common::Relay`]. Its logs are captured from the run's own task (what
/// it spawns, the lease keeper and the database connections' tasks, logs elsewhere).
pub struct InProc {
    /// The memory sink's handle: what was published and confirmed.
    pub sink: MemoryHandle,
    stop: CancellationToken,
    ended: CancellationToken,
    /// Once the run ended: what the binary would exit with, and its error (empty on success).
    outcome: std::sync::Arc<std::sync::Mutex<Option<(i32, String)>>>,
    logs: Logs,
}

impl InProc {
    /// Starts `pipeline::run` over the database `dsn` (a `postgres://` or `mysql://` URL, the
    /// log source `outboxd run --mode cdc` reads) with a memory sink.
    pub fn start(dsn: &str, settings: &Settings) -> InProc {
        match outboxd::dsn::SourceDsn::parse(dsn).unwrap() {
            outboxd::dsn::SourceDsn::Postgres(_) => Self::postgres(dsn, settings),
            outboxd::dsn::SourceDsn::Mysql(_) => Self::mariadb(dsn, settings),
            _ => panic!("not a database DSN: {dsn}"),
        }
    }

    /// Starts `pipeline::run` over the Postgres database `dsn` (a `postgres://` URL) with a
    /// memory sink.
    pub fn postgres(dsn: &str, settings: &Settings) -> InProc {
        let outboxd::dsn::SourceDsn::Postgres(dsn) = outboxd::dsn::SourceDsn::parse(dsn).unwrap()
        else {
            panic!("not a postgres:// DSN: {dsn}")
        };
        let stop = CancellationToken::new();
        let cfg = settings.config(&stop);
        let source = PgLog {
            dsn,
            name: cfg.name.clone(),
            options: PgOptions {
                slot: format!("outboxd_{}", cfg.name),
                publication: format!("outboxd_{}", cfg.name),
            },
            tables: cfg.tables.clone(),
            columns: cfg.columns.clone(),
            max_wire_message_bytes: outboxd::source::postgres::wire_message_limit(
                cfg.sink_options.max_message_bytes,
            ),
        };
        let (sink, handle) = MemorySink::new();
        let store = source.state_store();
        let shutdown = stop.clone();
        Self::spawn(handle, stop, async move {
            outboxd::pipeline::run(source, store, move || Ok(sink), &cfg, shutdown)
                .await
                .map(drop)
        })
    }

    /// Starts `pipeline::run` over the MariaDB/MySQL database `dsn` (a `mysql://` URL, its
    /// state in `outboxd_state`) with a memory sink.
    pub fn mariadb(dsn: &str, settings: &Settings) -> InProc {
        let outboxd::dsn::SourceDsn::Mysql(dsn) = outboxd::dsn::SourceDsn::parse(dsn).unwrap()
        else {
            panic!("not a mysql:// DSN: {dsn}")
        };
        let stop = CancellationToken::new();
        let cfg = settings.config(&stop);
        let (sink, handle) = MemorySink::new();
        let shutdown = stop.clone();
        Self::spawn(handle, stop, async move {
            let options = MySqlOptions::default();
            let tables = outbox_tables(&dsn, &cfg.tables, &cfg.columns, options.time_zone)?;
            let store = MyStateStore::new(dsn.clone());
            let source = MyLog {
                dsn,
                name: cfg.name.clone(),
                tables,
                options,
            };
            outboxd::pipeline::run(source, store, move || Ok(sink), &cfg, shutdown)
                .await
                .map(drop)
        })
    }

    /// Starts the relay `outboxd run --source DSN --sink SINK --exchange EXCHANGE` runs, in
    /// this process: the sink built through the sink registry as the binary builds it, the
    /// Postgres or MariaDB source. `sink` (the memory sink's handle) sees nothing of such a
    /// run: the test reads the broker.
    pub fn with_sink(dsn: &str, settings: &Settings, sink: &str, exchange: &str) -> InProc {
        let source = outboxd::dsn::SourceDsn::parse(dsn).unwrap();
        let stop = CancellationToken::new();
        let mut cfg = settings.config(&stop);
        cfg.sink = SinkDsn::parse(sink).unwrap();
        cfg.sink_options.exchange = exchange.to_string();
        let (_, handle) = MemorySink::new();
        let shutdown = stop.clone();
        Self::spawn(handle, stop, async move {
            outboxd::pipeline::check_sink(&cfg)?;
            match source {
                outboxd::dsn::SourceDsn::Postgres(dsn) => {
                    let options = PgOptions {
                        slot: format!("outboxd_{}", cfg.name),
                        publication: format!("outboxd_{}", cfg.name),
                    };
                    outboxd::pipeline::run_postgres(dsn, options, cfg, shutdown).await
                }
                outboxd::dsn::SourceDsn::Mysql(dsn) => {
                    outboxd::pipeline::run_mysql(dsn, MySqlOptions::default(), cfg, shutdown).await
                }
                _ => panic!("not a database DSN"),
            }
            .map(drop)
        })
    }

    fn spawn(
        sink: MemoryHandle,
        stop: CancellationToken,
        run: impl Future<Output = Result<(), outboxd::Error>> + Send + 'static,
    ) -> InProc {
        use tracing::instrument::WithSubscriber;
        let logs = Logs::default();
        let ended = CancellationToken::new();
        let outcome = std::sync::Arc::new(std::sync::Mutex::new(None));
        let (done, slot) = (ended.clone(), outcome.clone());
        tokio::spawn(
            async move {
                let outcome = match run.await {
                    Ok(()) => (0, String::new()),
                    Err(e) => {
                        tracing::error!("{e}");
                        (e.exit_status() as i32, e.to_string())
                    }
                };
                *slot.lock().unwrap() = Some(outcome);
                done.cancel();
            }
            .with_subscriber(logs.dispatch()),
        );
        InProc {
            sink,
            stop,
            ended,
            outcome,
            logs,
        }
    }

    /// What the run logged so far.
    pub fn logs(&self) -> String {
        self.logs.text()
    }

    /// Ids of the confirmed events, in confirmation order (duplicates included).
    pub fn ids(&self) -> Vec<uuid::Uuid> {
        self.sink.confirmed_ids()
    }

    /// Waits until every one of `expected` is confirmed, woken by each confirmation. Fails
    /// when the run ends first (with its error and logs) or after [`DEADLINE`].
    pub async fn wait_published(&self, what: &str, expected: &[uuid::Uuid]) {
        // Only the ids confirmed since the last look are checked off: a test may wait for
        // tens of thousands.
        let mut missing: std::collections::HashSet<uuid::Uuid> = expected.iter().copied().collect();
        let mut seen = 0;
        self.wait_until(what, || {
            let ids = self.ids();
            for id in &ids[seen.min(ids.len())..] {
                missing.remove(id);
            }
            seen = ids.len();
            (missing.is_empty(), seen)
        })
        .await
    }

    /// Waits until `cond` holds of the confirmed events (in confirmation order, duplicates
    /// included; each look copies them all, so for runs of a few thousand events), looking
    /// again at each confirmation. Fails when the run ends first (with its error and logs) or
    /// after [`DEADLINE`].
    pub async fn wait_events(&self, what: &str, mut cond: impl FnMut(&[OutboxEvent]) -> bool) {
        self.wait_until(what, || {
            let events = self.sink.confirmed();
            (cond(&events), events.len())
        })
        .await
    }

    /// Looks at `check` (whether it holds, and how many events were confirmed when it looked)
    /// again at each confirmation past that count, until it holds.
    async fn wait_until(&self, what: &str, mut check: impl FnMut() -> (bool, usize)) {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        loop {
            let (done, confirmed) = check();
            if done {
                return;
            }
            tokio::select! {
                _ = self.sink.wait_confirmed(confirmed + 1) => {}
                _ = tokio::time::sleep_until(deadline) => {
                    panic!("timed out after {DEADLINE:?} waiting for {what}\n{}", self.logs());
                }
                _ = self.ended.cancelled() => {
                    if !check().0 {
                        panic!(
                            "the run ended before {what}: {:?}\n{}",
                            self.outcome.lock().unwrap(),
                            self.logs()
                        );
                    }
                    return;
                }
            }
        }
    }

    /// Waits until at least `n` events are confirmed (duplicates included), woken by each
    /// confirmation. Fails when the run ends first or after [`DEADLINE`].
    pub async fn wait_count(&self, what: &str, n: usize) {
        tokio::select! {
            r = tokio::time::timeout(DEADLINE, self.sink.wait_confirmed(n)) => {
                if r.is_err() {
                    panic!("timed out after {DEADLINE:?} waiting for {what}\n{}", self.logs());
                }
            }
            _ = self.ended.cancelled() => {
                if self.ids().len() < n {
                    panic!(
                        "the run ended before {what}: {:?}\n{}",
                        self.outcome.lock().unwrap(),
                        self.logs()
                    );
                }
            }
        }
    }

    /// Polls `cond` (every 50 ms) until it holds; fails when the run ends first or after
    /// [`DEADLINE`]. For conditions only the database shows (a session waiting on a lock).
    pub async fn wait_running<F, Fut>(&self, what: &str, mut cond: F)
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = bool>,
    {
        let deadline = tokio::time::Instant::now() + DEADLINE;
        while !cond().await {
            if self.ended() {
                panic!(
                    "the run ended while waiting for {what}: {:?}\n{}",
                    self.outcome.lock().unwrap(),
                    self.logs()
                );
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "timed out after {DEADLINE:?} waiting for {what}\n{}",
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Whether the run ended (by itself or after [`InProc::stop`]).
    pub fn ended(&self) -> bool {
        self.ended.is_cancelled()
    }

    /// Waits until the run ends by itself (bounded by [`DEADLINE`]), and returns what the
    /// binary would exit with and print: the exit code and the error (empty on success).
    pub async fn exit(&self) -> (i32, String) {
        tokio::time::timeout(DEADLINE, self.ended.cancelled())
            .await
            .unwrap_or_else(|_| panic!("the run did not end within {DEADLINE:?}\n{}", self.logs()));
        self.outcome.lock().unwrap().clone().expect("an outcome")
    }

    /// Stops the run as a SIGTERM stops the binary (graceful: every confirmation awaited, the
    /// last position stored), and fails unless it stops cleanly.
    pub async fn stop(&self) {
        self.stop.cancel();
        let (code, err) = self.exit().await;
        assert_eq!(
            code,
            0,
            "the run stopped with an error: {err}\n{}",
            self.logs()
        );
    }
}

impl Drop for InProc {
    /// A test that fails midway leaves no run behind it (as dropping a `Relay` kills it).
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Ends the lease an in-process run of `name` left behind when it stopped with an error, as
/// its process's exit would: a successor on this host takes a lease whose holder's PID is gone
/// over at once (`holder_is_dead_locally`), but an in-process run's holder has the test's own
/// PID, so its successor would wait out the lease (5 s) instead. Fails unless there was a row.
pub async fn end_lease(db: &crate::common::PgDb, name: &str) {
    let n = db
        .client()
        .await
        .execute(
            "UPDATE outboxd_state SET lease_expires_at = now() WHERE name = $1",
            &[&name],
        )
        .await
        .unwrap();
    assert_eq!(n, 1, "the state row of {name}");
}
