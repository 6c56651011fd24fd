//! The data path's internal events, one struct each: where something happens, the code builds
//! the event and calls [`InternalEvent::emit`], which logs it and updates its instruments in
//! one place, so a log line and the metric that counts it cannot drift apart (a reconnect that
//! is logged is also counted, and readiness follows it). Hot-path events that only count
//! ([`EventRead`]) go through the same trait, so every instrument has one writer. Each line
//! keeps the log target of the module it describes (`outboxd::relay`, `outboxd::source::mysql`,
//! …), so `--log-level` filters by module still select it.

use super::get;
use crate::event::{OutboxEvent, SourcePosition};
use chrono::{DateTime, Utc};
use std::fmt::Display;
use std::time::Duration;

/// Which log source an event comes from: its lines keep that source's log target.
#[derive(Clone, Copy, Debug)]
pub enum SourceKind {
    Postgres,
    MySql,
}

/// Something that happened inside the relay: `emit` logs it (when it is worth a line) and
/// counts or sets what the metrics endpoint shows of it.
pub(crate) trait InternalEvent {
    fn emit(self);
}

/// A pipeline (source, relay, sink) runs: from now on `/readyz` reports its parts instead of
/// "starting".
pub(crate) struct PipelineStarted;

impl InternalEvent for PipelineStarted {
    fn emit(self) {
        get().mark_started();
    }
}

/// The source decoded an outbox row and hands it to the relay.
pub(crate) struct EventRead;

impl InternalEvent for EventRead {
    fn emit(self) {
        get().events_read.inc();
    }
}

/// The Postgres replication stream is open from `from`.
pub(crate) struct PgStreaming<'a> {
    pub slot: &'a str,
    pub from: &'a str,
}

impl InternalEvent for PgStreaming<'_> {
    fn emit(self) {
        tracing::info!(target: "outboxd::source::postgres", slot = %self.slot, from = %self.from, "streaming");
        get().source_streaming.set(1);
    }
}

/// The binlog dump stream is open at `file:pos` (and `gtid`), resumed `by` GTID or position.
pub(crate) struct BinlogStreaming<'a> {
    pub file: &'a str,
    pub pos: u64,
    pub gtid: &'a str,
    pub by: &'static str,
    pub server_id: u32,
}

impl InternalEvent for BinlogStreaming<'_> {
    fn emit(self) {
        tracing::info!(
            target: "outboxd::source::mysql",
            file = %self.file, pos = self.pos, gtid = %self.gtid, by = self.by,
            server_id = self.server_id, "streaming the binlog"
        );
        get().source_streaming.set(1);
    }
}

/// A source without a stream (poll mode, binlog files) runs: it counts as streaming while it
/// can read.
pub(crate) struct SourceRunning;

impl InternalEvent for SourceRunning {
    fn emit(self) {
        get().source_streaming.set(1);
    }
}

/// The source's stream is gone and the source connects again: `message` says why and from
/// where it resumes; `error` is the cause when there is one, `timeout` the read timeout that
/// expired, `retry_in` the pause before the next attempt.
pub(crate) struct SourceReconnecting<'a> {
    pub source: SourceKind,
    pub message: &'static str,
    pub error: Option<&'a dyn Display>,
    pub timeout: Option<Duration>,
    pub retry_in: Option<Duration>,
}

impl InternalEvent for SourceReconnecting<'_> {
    fn emit(self) {
        let t = get();
        t.source_streaming.set(0);
        t.reconnect("source");
        // Absent fields are not recorded: each line carries what its cause has. The target is
        // the source's module, as for its other lines (a log filter names modules).
        macro_rules! log_at {
            ($target:literal) => {
                tracing::warn!(
                    target: $target,
                    error = self.error.map(tracing::field::display),
                    timeout = self.timeout.map(tracing::field::debug),
                    retry_in = self.retry_in.map(tracing::field::debug),
                    "{}",
                    self.message
                )
            };
        }
        match self.source {
            SourceKind::Postgres => log_at!("outboxd::source::postgres"),
            SourceKind::MySql => log_at!("outboxd::source::mysql"),
        }
    }
}

/// The log bytes between the server's position and the acknowledged one.
pub(crate) struct SourceLag {
    pub bytes: u64,
}

impl InternalEvent for SourceLag {
    fn emit(self) {
        get()
            .source_lag_bytes
            .set(i64::try_from(self.bytes).unwrap_or(i64::MAX));
    }
}

/// The WAL the replication slot keeps on the server.
pub(crate) struct SlotRetainedWal {
    pub bytes: i64,
}

impl InternalEvent for SlotRetainedWal {
    fn emit(self) {
        get().slot_retained_wal_bytes.set(self.bytes);
    }
}

/// What holds a MySQL/MariaDB relay's stored position back, checked every second: the oldest
/// prepared XA transaction with outbox rows (`xid` `None`: none, the gauge goes to 0), how
/// long ago it was prepared and where the position stays for it. `warn` when its line is due.
pub(crate) struct XaPreparePinning<'a> {
    pub xid: Option<&'a dyn Display>,
    pub age: Duration,
    pub held_at: &'a dyn Display,
    /// How many prepared XA transactions hold the position back.
    pub count: usize,
    pub limit: Duration,
    pub warn: bool,
}

impl InternalEvent for XaPreparePinning<'_> {
    fn emit(self) {
        let t = get();
        let Some(xid) = self.xid else {
            t.xa_prepared_oldest_age_seconds.set(0.0);
            return;
        };
        t.xa_prepared_oldest_age_seconds.set(self.age.as_secs_f64());
        if self.warn {
            tracing::warn!(
                target: "outboxd::source::mysql",
                xid = %xid,
                age_seconds = self.age.as_secs(),
                held_at = %self.held_at,
                prepared = self.count,
                limit = ?self.limit,
                "an XA transaction prepared {}s ago holds outbox rows and is neither committed nor rolled back: the stored position stays before its XA PREPARE, so every restart until it ends publishes again everything committed since (duplicates); end it on the server: XA COMMIT {xid}; or XA ROLLBACK {xid}; (at --xa-prepare-limit the relay stops, or with --xa-prepare-expired release gives it up)",
                self.age.as_secs()
            );
        }
    }
}

/// `--xa-prepare-expired release`: the relay stopped holding its position back for a prepared
/// XA transaction older than `--xa-prepare-limit`. Its rows are published only if its XA
/// COMMIT comes before this process ends; after a restart, never.
pub(crate) struct XaPrepareReleased<'a> {
    pub xid: &'a dyn Display,
    pub age: Duration,
    pub rows: usize,
    pub held_at: &'a dyn Display,
}

impl InternalEvent for XaPrepareReleased<'_> {
    fn emit(self) {
        get().xa_prepares_released.inc();
        tracing::error!(
            target: "outboxd::source::mysql",
            xid = %self.xid,
            age_seconds = self.age.as_secs(),
            rows = self.rows,
            held_at = %self.held_at,
            "XA PREPARE GIVEN UP (--xa-prepare-expired release): the stored position moves past this prepared XA transaction; its {} outbox row(s) are published only if its XA COMMIT is read before this relay stops, never after a restart",
            self.rows
        );
    }
}

/// The Postgres source read a row's message: the transaction `committed` and the server `sent`
/// the message at those times (its clocks), the source read it `read` (this process's). Both
/// stages are wall-clock differences, exact on one host, shifted by the clocks' skew otherwise.
pub(crate) struct RowRead {
    pub committed: Option<DateTime<Utc>>,
    pub sent: Option<DateTime<Utc>>,
    pub read: DateTime<Utc>,
}

impl InternalEvent for RowRead {
    fn emit(self) {
        let t = get();
        let secs = |from: DateTime<Utc>, to: DateTime<Utc>| {
            (to - from).num_microseconds().unwrap_or(0).max(0) as f64 / 1e6
        };
        if let (Some(c), Some(s)) = (self.committed, self.sent) {
            t.stage_commit_sent_seconds.observe(secs(c, s));
        }
        if let Some(s) = self.sent {
            t.stage_sent_read_seconds.observe(secs(s, self.read));
        }
    }
}

/// The relay took `event` from its queue: how long since the source read it.
pub(crate) struct EventTaken<'a> {
    pub event: &'a OutboxEvent,
}

impl InternalEvent for EventTaken<'_> {
    fn emit(self) {
        if let Some(read) = self.event.read_at {
            get()
                .stage_read_taken_seconds
                .observe(read.elapsed().as_secs_f64());
        }
    }
}

/// The sink accepted an event for publishing, `took` after the relay took it from its queue.
pub(crate) struct EventHandedOver {
    pub took: Duration,
}

impl InternalEvent for EventHandedOver {
    fn emit(self) {
        get()
            .stage_taken_published_seconds
            .observe(self.took.as_secs_f64());
    }
}

/// The relay hands `event` to the sink for the first time.
pub(crate) struct EventPublishing<'a> {
    pub event: &'a OutboxEvent,
}

impl InternalEvent for EventPublishing<'_> {
    fn emit(self) {
        let e = self.event;
        match e.poison.as_deref() {
            Some(reason) => {
                tracing::warn!(target: "outboxd::relay", event_id = %e.dead_record_id(), position = %e.position, reason, "poison event: dead-lettered without its body")
            }
            None => {
                tracing::debug!(target: "outboxd::relay", event_id = %e.id, position = %e.position, topic = %e.topic, "publishing")
            }
        }
        get().events_published.inc();
    }
}

/// The sink made `event` durable, `sent_ago` after it was (last) handed over.
pub(crate) struct EventConfirmed<'a> {
    pub event: &'a OutboxEvent,
    pub sent_ago: Duration,
}

impl InternalEvent for EventConfirmed<'_> {
    fn emit(self) {
        let t = get();
        t.events_confirmed.inc();
        if self.event.poison.is_some() {
            t.events_dead_lettered.inc();
        }
        t.publish_confirm_seconds
            .observe(self.sent_ago.as_secs_f64());
        if let Some(committed) = self.event.committed_at {
            let age = (chrono::Utc::now() - committed)
                .num_microseconds()
                .unwrap_or(0) as f64
                / 1e6;
            t.commit_confirm_seconds.observe(age.max(0.0));
            t.source_lag_seconds.set(age.max(0.0));
        }
    }
}

/// An unconfirmed event was published again after a sink failure.
pub(crate) struct EventRepublished;

impl InternalEvent for EventRepublished {
    fn emit(self) {
        get().events_republished.inc();
    }
}

/// The sink reported a published event as already stored and did not store it again (NATS
/// JetStream: the same `Nats-Msg-Id` within the stream's duplicate window).
pub(crate) struct EventDeduplicated;

impl InternalEvent for EventDeduplicated {
    fn emit(self) {
        tracing::debug!(target: "outboxd::sink::nats", "the stream already held a published event: stored once");
        get().events_deduplicated.inc();
    }
}

/// The stream acknowledged an event's first publish as a duplicate of a message that is not
/// this event (another source position, or a copy that could not be read): two events share
/// `id` (a producer reusing ids), and this one was not stored. Unlike a republish, suspicious.
pub(crate) struct DuplicateOfAnotherEvent<'a> {
    pub id: &'a uuid::Uuid,
    pub position: &'a str,
    pub held_position: Option<&'a str>,
    pub held_seq: u64,
}

impl InternalEvent for DuplicateOfAnotherEvent<'_> {
    fn emit(self) {
        tracing::warn!(
            target: "outboxd::sink::nats",
            id = %self.id,
            position = self.position,
            held_position = self.held_position.unwrap_or("unknown"),
            held_seq = self.held_seq,
            "first publish acknowledged as a duplicate of another message with the same Nats-Msg-Id: this event was not stored (do two outbox rows share the id?); counted in outboxd_events_suspicious_duplicates_total"
        );
        get().events_suspicious_duplicates.inc();
    }
}

/// A row's `headers` object set `name`, which the relay reserves: dropped. Logged once per
/// name and process (`first_time`; a producer bug repeats on every row), counted every time.
pub(crate) struct RowHeaderDropped<'a> {
    pub name: &'a str,
    pub event_id: &'a uuid::Uuid,
    pub first_time: bool,
}

impl InternalEvent for RowHeaderDropped<'_> {
    fn emit(self) {
        get().row_headers_dropped.inc();
        if self.first_time {
            tracing::warn!(target: "outboxd::sink::headers", header = %self.name, event_id = %self.event_id, "the row's headers object sets a header name the relay reserves: dropped (counted in outboxd_row_headers_dropped_total; logged once per name)");
        }
    }
}

/// The sink connected (the first time, or again after a failure).
pub(crate) struct SinkConnected;

impl InternalEvent for SinkConnected {
    fn emit(self) {
        get().sink_connected.set(1);
    }
}

/// The sink recovered: connected again and `republished` events sent again.
pub(crate) struct SinkRecovered<'a> {
    pub sink: &'a str,
    pub republished: usize,
}

impl InternalEvent for SinkRecovered<'_> {
    fn emit(self) {
        tracing::info!(
            target: "outboxd::relay",
            sink = self.sink,
            republished = self.republished,
            "sink recovered"
        );
        get().sink_connected.set(1);
    }
}

/// The sink failed to confirm the oldest unconfirmed event (`event`: its id and position; none
/// when nothing was in flight) for `reason`, for the `attempt`-th time in a row; the relay
/// reconnects and republishes it after `retry_in`.
pub(crate) struct SinkRetry<'a> {
    pub cause: &'static str,
    pub event: Option<(&'a uuid::Uuid, &'a SourcePosition)>,
    pub reason: &'a dyn Display,
    pub attempt: u32,
    pub retry_in: Duration,
}

impl InternalEvent for SinkRetry<'_> {
    fn emit(self) {
        let t = get();
        t.sink_retries
            .get_or_create(&super::Cause {
                cause: self.cause.to_string(),
            })
            .inc();
        t.reconnect("sink");
        t.sink_connected.set(0);
        let SinkRetry {
            cause,
            event,
            reason,
            attempt,
            retry_in,
        } = self;
        // The first failure of a run says what failed; the later ones what is still failing.
        let what = match event {
            Some((id, position)) => format!("the oldest unconfirmed event {id} at {position}"),
            None => "nothing in flight".to_string(),
        };
        let (id, position) = match event {
            Some((id, position)) => (id.to_string(), position.to_string()),
            None => (String::new(), String::new()),
        };
        if attempt <= 1 {
            tracing::warn!(target: "outboxd::relay", event_id = %id, position = %position, cause, reason = %reason, attempt, retry_in = ?retry_in,
                "sink failed; reconnecting to republish unconfirmed events in order ({what}: {reason})");
        } else {
            tracing::warn!(target: "outboxd::relay", event_id = %id, position = %position, cause, reason = %reason, attempt, retry_in = ?retry_in,
                "sink still unavailable or refusing ({what}, attempt {attempt}: {reason}); retrying in {retry_in:?}");
        }
    }
}

/// The sink refused `event` in place (a nack: the broker may accept the messages after it)
/// while `behind` later events were already handed to it. Those cannot be recalled, so their
/// first delivery may come before the refused event's: the per-aggregate order guarantee does
/// not hold for them. Logged as an error with the fix, and counted.
pub(crate) struct OrderAtRisk<'a> {
    pub event: Option<(&'a uuid::Uuid, &'a SourcePosition)>,
    pub behind: usize,
}

impl InternalEvent for OrderAtRisk<'_> {
    fn emit(self) {
        get().order_at_risk.inc_by(self.behind as u64);
        let (id, position) = match self.event {
            Some((id, position)) => (id.to_string(), position.to_string()),
            None => (String::new(), String::new()),
        };
        tracing::error!(target: "outboxd::relay", event_id = %id, position = %position, behind = self.behind,
            "the sink refused event {id} at {position} while {} later events were already written: the first-delivery order of the events written after it is not guaranteed (a queue may hold them before it). A queue that refuses when full causes this (RabbitMQ: x-overflow=reject-publish or reject-publish-dlx with x-max-length or x-max-length-bytes, as a queue argument or a policy; NATS: a stream with discard new and a limit). Fix: remove the limit or its reject overflow, or run with --window 1 where per-aggregate order must hold", self.behind);
    }
}

/// The broker blocked the connection (a resource alarm) for `reason`.
pub(crate) struct SinkBlocked<'a> {
    pub reason: &'a dyn Display,
}

impl InternalEvent for SinkBlocked<'_> {
    fn emit(self) {
        tracing::warn!(target: "outboxd::sink::rabbitmq", reason = %self.reason, "RabbitMQ blocked the connection (resource alarm): publishing waits and the stored position stays until it unblocks");
        get().sink_blocked.set(1);
    }
}

/// The broker unblocked the connection.
pub(crate) struct SinkUnblocked;

impl InternalEvent for SinkUnblocked {
    fn emit(self) {
        tracing::info!(target: "outboxd::sink::rabbitmq", "RabbitMQ unblocked the connection: publishing resumes");
        get().sink_blocked.set(0);
    }
}

/// The broker connection or a channel failed with `error`: neither blocked nor connected.
pub(crate) struct SinkConnectionFailed<'a> {
    pub error: &'a dyn Display,
}

impl InternalEvent for SinkConnectionFailed<'_> {
    fn emit(self) {
        tracing::warn!(target: "outboxd::sink::rabbitmq", error = %self.error, "RabbitMQ connection or channel failed");
        let t = get();
        t.sink_blocked.set(0);
        t.sink_connected.set(0);
    }
}

/// The relay stopped publishing: the lease was last renewed `age` ago (never: `None`), not
/// less than `limit`.
pub(crate) struct FenceClosed {
    pub age: Option<Duration>,
    pub limit: Duration,
}

impl InternalEvent for FenceClosed {
    fn emit(self) {
        match self.age {
            Some(age) => {
                get().publishing_fenced.set(1);
                tracing::warn!(
                    target: "outboxd::state",
                    lease_age = ?age,
                    limit = ?self.limit,
                    "publishing paused: the lease was last renewed {:.1}s ago, not less than the self-fence limit {:.1}s; nothing is published until a renewal succeeds (another relay may hold the lease by now)",
                    age.as_secs_f64(),
                    self.limit.as_secs_f64()
                )
            }
            None => {
                tracing::debug!(target: "outboxd::state", "publishing waits for the first lease renewal")
            }
        }
    }
}

/// Publishing resumes after the fence was closed for `closed`.
pub(crate) struct FenceOpened {
    pub closed: Duration,
}

impl InternalEvent for FenceOpened {
    fn emit(self) {
        get().publishing_fenced.set(0);
        tracing::info!(target: "outboxd::state", paused = ?self.closed, "the lease was renewed: publishing resumes");
    }
}

/// The lease was renewed; `stored` when the renewal also stored a newer position.
pub(crate) struct LeaseRenewed {
    pub stored: bool,
}

impl InternalEvent for LeaseRenewed {
    fn emit(self) {
        let t = get();
        t.leader.set(1);
        if self.stored {
            t.position_stored();
        }
    }
}

/// This process no longer holds the lease (released, lost, or given up before it could
/// expire); the reason is the error or log line of whoever ends the run.
pub(crate) struct LeaseEnded;

impl InternalEvent for LeaseEnded {
    fn emit(self) {
        get().leader.set(0);
    }
}

/// A position older than the stored one was about to be stored, and was refused.
pub(crate) struct PositionBackwardsRefused<'a> {
    pub stored: &'a dyn Display,
    pub attempted: &'a dyn Display,
}

impl InternalEvent for PositionBackwardsRefused<'_> {
    fn emit(self) {
        get().position_backwards_refused.inc();
        tracing::error!(target: "outboxd::state::forward", stored = %self.stored, attempted = %self.attempted, "refused to store a position older than the stored one (a relay bug: positions only move forward)");
    }
}

/// A connection to the metrics endpoint was closed unserved, over its connection limit: the
/// oldest one that had sent no request yet, or the new one when every connection was answering.
pub(crate) struct HttpConnectionRefused;

impl InternalEvent for HttpConnectionRefused {
    fn emit(self) {
        get().http_connections_refused.inc();
    }
}
