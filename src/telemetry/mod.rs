//! Metrics and health. One process-wide set of instruments (a relay runs one pipeline), written
//! only by the internal events in [`events`] — one struct per event, whose `emit` logs it and
//! counts it — and read by the endpoint in `http`: `--metrics-addr` serves `/metrics`
//! (OpenMetrics text, which Prometheus scrapes), `/healthz` (the process serves) and `/readyz`
//! (source streaming, sink connected and not blocked; 503 with the reason otherwise). Also the
//! log subscriber every binary installs, with the one filter no `--log-level` can lift
//! ([`init_logging`], in `logging`).

// Some events are the broker sinks': with fewer sinks compiled, they are unused.
#[cfg_attr(
    not(all(
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "rabbitmq-stream"
    )),
    allow(dead_code)
)]
pub(crate) mod events;
mod http;
pub(crate) mod live;
mod logging;

pub use http::{fetch, probe, serve, HEADER_TIMEOUT, MAX_CONNECTIONS, REQUEST_DEADLINE};
pub use logging::{init_logging, loggable};

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Cause {
    pub cause: String,
}

/// Every instrument the relay keeps.
pub struct Telemetry {
    registry: Registry,
    pub(crate) events_read: Counter,
    pub(crate) events_published: Counter,
    pub(crate) events_confirmed: Counter,
    pub(crate) events_dead_lettered: Counter,
    pub(crate) events_republished: Counter,
    /// Published events the sink reported as already stored, so not stored again (NATS
    /// JetStream: the same `Nats-Msg-Id` within the stream's duplicate window).
    pub(crate) events_deduplicated: Counter,
    /// First publishes acknowledged as duplicates of another event (the same id at another
    /// source position): that event was not stored.
    pub(crate) events_suspicious_duplicates: Counter,
    /// Attempts to store a position older than the stored one (a relay bug; refused).
    pub(crate) position_backwards_refused: Counter,
    /// Reserved header names a row's `headers` object tried to set (dropped).
    pub(crate) row_headers_dropped: Counter,
    /// Connections to the metrics endpoint closed unserved (over its connection limit).
    pub(crate) http_connections_refused: Counter,
    pub reconnects: Family<Cause, Counter>,
    /// Failed attempts to get the oldest unconfirmed event confirmed, by cause (see
    /// [`events::SinkRetry`]).
    pub(crate) sink_retries: Family<Cause, Counter>,
    /// Events already handed to the sink behind one it refused in place (see
    /// [`events::OrderAtRisk`]).
    pub(crate) order_at_risk: Counter,
    pub(crate) publish_confirm_seconds: Histogram,
    pub(crate) commit_confirm_seconds: Histogram,
    /// The stages before the hand-over, one histogram each (see [`events::RowRead`],
    /// [`events::EventTaken`], [`events::EventHandedOver`]): where an event's latency goes.
    pub(crate) stage_commit_sent_seconds: Histogram,
    pub(crate) stage_sent_read_seconds: Histogram,
    pub(crate) stage_read_taken_seconds: Histogram,
    pub(crate) stage_taken_published_seconds: Histogram,
    pub(crate) source_lag_bytes: Gauge,
    pub(crate) source_lag_seconds: Gauge<f64, AtomicU64>,
    pub(crate) slot_retained_wal_bytes: Gauge,
    /// Age of the oldest prepared XA transaction holding the stored position back (0: none).
    pub(crate) xa_prepared_oldest_age_seconds: Gauge<f64, AtomicU64>,
    /// Prepared XA transactions given up under `--xa-prepare-expired release`.
    pub(crate) xa_prepares_released: Counter,
    pub leader: Gauge,
    pub(crate) source_streaming: Gauge,
    pub(crate) sink_connected: Gauge,
    pub(crate) sink_blocked: Gauge,
    /// 1 while publishing waits for a lease renewal (the self-fence is closed).
    pub(crate) publishing_fenced: Gauge,
    /// Unix time (s) of the last stored position; the age is computed at scrape time.
    position_stored_at: AtomicI64,
    position_age_seconds: Gauge<f64, AtomicU64>,
    /// Set once a pipeline runs; `/readyz` says "starting" before.
    started: AtomicBool,
}

/// The stage histograms' buckets: 50 µs … ~14 s, each 1.5 times the one before.
fn stage_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.00005, 1.5, 32)
}

fn now_unix() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Telemetry {
    fn new() -> Telemetry {
        let mut registry = Registry::with_prefix("outboxd");
        let t = Telemetry {
            events_read: Counter::default(),
            events_published: Counter::default(),
            events_confirmed: Counter::default(),
            events_dead_lettered: Counter::default(),
            events_republished: Counter::default(),
            events_deduplicated: Counter::default(),
            events_suspicious_duplicates: Counter::default(),
            position_backwards_refused: Counter::default(),
            row_headers_dropped: Counter::default(),
            http_connections_refused: Counter::default(),
            reconnects: Family::default(),
            sink_retries: Family::default(),
            order_at_risk: Counter::default(),
            // 100 µs … ~27 min
            publish_confirm_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 24)),
            commit_confirm_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 24)),
            // 50 µs … ~14 s, in steps of 1.5: fine enough to tell a p99 from a p50 per stage.
            stage_commit_sent_seconds: Histogram::new(stage_buckets()),
            stage_sent_read_seconds: Histogram::new(stage_buckets()),
            stage_read_taken_seconds: Histogram::new(stage_buckets()),
            stage_taken_published_seconds: Histogram::new(stage_buckets()),
            source_lag_bytes: Gauge::default(),
            source_lag_seconds: Gauge::default(),
            slot_retained_wal_bytes: Gauge::default(),
            xa_prepared_oldest_age_seconds: Gauge::default(),
            xa_prepares_released: Counter::default(),
            leader: Gauge::default(),
            source_streaming: Gauge::default(),
            sink_connected: Gauge::default(),
            sink_blocked: Gauge::default(),
            publishing_fenced: Gauge::default(),
            position_stored_at: AtomicI64::new(0),
            position_age_seconds: Gauge::default(),
            started: AtomicBool::new(false),
            registry: Registry::default(),
        };
        // Every documented cause is a series from the start, at 0: a family with no series
        // would not show on /metrics at all, and a rate needs the value before the first one.
        for cause in ["source", "sink"] {
            let _ = t.reconnects.get_or_create(&Cause {
                cause: cause.into(),
            });
        }
        for cause in ["rejected", "timeout", "connection"] {
            let _ = t.sink_retries.get_or_create(&Cause {
                cause: cause.into(),
            });
        }
        t.register_counts(&mut registry);
        t.register_latency(&mut registry);
        t.register_health(&mut registry);
        register_progress(&mut registry);
        Telemetry { registry, ..t }
    }

    /// What happened to events and positions: counters that only grow.
    fn register_counts(&self, registry: &mut Registry) {
        registry.register(
            "events_read",
            "Outbox rows decoded from the source",
            self.events_read.clone(),
        );
        registry.register(
            "events_published",
            "Events handed to the sink (first attempts)",
            self.events_published.clone(),
        );
        registry.register(
            "events_confirmed",
            "Events the sink made durable",
            self.events_confirmed.clone(),
        );
        registry.register(
            "events_dead_lettered",
            "Poison events sent to <exchange>.dead",
            self.events_dead_lettered.clone(),
        );
        registry.register(
            "events_republished",
            "Unconfirmed events published again after a sink failure",
            self.events_republished.clone(),
        );
        registry.register(
            "events_deduplicated",
            "Published events the sink reported as already stored and did not store again (NATS JetStream: the same Nats-Msg-Id within the stream's duplicate window)",
            self.events_deduplicated.clone(),
        );
        registry.register(
            "events_suspicious_duplicates",
            "First publishes the sink reported as duplicates of another event (NATS JetStream: the same Nats-Msg-Id at another source position): not stored; do two outbox rows share an id?",
            self.events_suspicious_duplicates.clone(),
        );
        registry.register(
            "row_headers_dropped",
            "Header names a row's headers object set that the relay reserves (dropped)",
            self.row_headers_dropped.clone(),
        );
        registry.register(
            "position_backwards_refused",
            "Attempts to store a position older than the stored one (refused; a relay bug)",
            self.position_backwards_refused.clone(),
        );
        registry.register(
            "http_connections_refused",
            "Connections to this endpoint closed unserved, over its connection limit",
            self.http_connections_refused.clone(),
        );
        registry.register(
            "reconnects",
            "Reconnects by cause (source, sink)",
            self.reconnects.clone(),
        );
        registry.register(
            "sink_retries",
            "Failed attempts to get the oldest unconfirmed event confirmed (cause: rejected = returned or nacked, timeout, connection); each is followed by a paced reconnect",
            self.sink_retries.clone(),
        );
        registry.register(
            "order_at_risk",
            "Events handed to the sink after one it refused in place (a RabbitMQ nack, a full JetStream stream) and before that refusal arrived: their first delivery may precede the refused event's; always 0 with --window 1",
            self.order_at_risk.clone(),
        );
    }

    /// How long confirmations take and how far behind the source and the stored position are.
    fn register_latency(&self, registry: &mut Registry) {
        registry.register(
            "publish_confirm_seconds",
            "From handing an event to the sink to its confirmation",
            self.publish_confirm_seconds.clone(),
        );
        registry.register(
            "commit_confirm_seconds",
            "From the source transaction's commit to the event's confirmation",
            self.commit_confirm_seconds.clone(),
        );
        registry.register(
            "stage_commit_sent_seconds",
            "Postgres: from a transaction's commit to the server sending one of its rows (the walsender's send time: WAL flush, wake-up, decoding)",
            self.stage_commit_sent_seconds.clone(),
        );
        registry.register(
            "stage_sent_read_seconds",
            "Postgres: from the server sending a row to the source reading it (network, the replication client's buffer)",
            self.stage_sent_read_seconds.clone(),
        );
        registry.register(
            "stage_read_taken_seconds",
            "From the source reading a row to the relay taking the event (decoding, the in-flight byte budget, the relay's queue)",
            self.stage_read_taken_seconds.clone(),
        );
        registry.register(
            "stage_taken_published_seconds",
            "From the relay taking an event to the sink accepting it (the lease gate, the publish call)",
            self.stage_taken_published_seconds.clone(),
        );
        registry.register(
            "source_lag_bytes",
            "Log bytes between the server's position and the acknowledged one",
            self.source_lag_bytes.clone(),
        );
        registry.register(
            "source_lag_seconds",
            "Age of the newest confirmed event's commit when it was confirmed",
            self.source_lag_seconds.clone(),
        );
        registry.register(
            "slot_retained_wal_bytes",
            "WAL the replication slot keeps on the server",
            self.slot_retained_wal_bytes.clone(),
        );
        registry.register(
            "xa_prepared_oldest_age_seconds",
            "Age of the oldest prepared XA transaction with outbox rows that holds the stored position back (0: none)",
            self.xa_prepared_oldest_age_seconds.clone(),
        );
        registry.register(
            "xa_prepares_released",
            "Prepared XA transactions the stored position moved past (--xa-prepare-expired release)",
            self.xa_prepares_released.clone(),
        );
        registry.register(
            "position_age_seconds",
            "Time since the position was last stored",
            self.position_age_seconds.clone(),
        );
    }

    /// The process's state: the lease, the source stream, the sink, the self-fence.
    fn register_health(&self, registry: &mut Registry) {
        registry.register(
            "leader",
            "1 while this process holds the lease",
            self.leader.clone(),
        );
        registry.register(
            "source_streaming",
            "1 while the source stream is open",
            self.source_streaming.clone(),
        );
        registry.register(
            "sink_connected",
            "1 while the sink is connected",
            self.sink_connected.clone(),
        );
        registry.register(
            "sink_blocked",
            "1 while the broker blocks publishing (resource alarm)",
            self.sink_blocked.clone(),
        );
        registry.register(
            "publishing_fenced",
            "1 while publishing waits for a lease renewal (the last one is older than the self-fence limit)",
            self.publishing_fenced.clone(),
        );
    }

    /// The position was stored just now.
    fn position_stored(&self) {
        self.position_stored_at
            .store(now_unix() as i64, Ordering::Relaxed);
    }

    fn reconnect(&self, cause: &str) {
        self.reconnects
            .get_or_create(&Cause {
                cause: cause.to_string(),
            })
            .inc();
    }

    fn mark_started(&self) {
        self.started.store(true, Ordering::Relaxed);
    }

    /// The text `/metrics` serves.
    pub fn render(&self) -> String {
        let stored = self.position_stored_at.load(Ordering::Relaxed);
        if stored > 0 {
            self.position_age_seconds.set(now_unix() - stored as f64);
        }
        let mut out = String::new();
        let _ = encode(&mut out, &self.registry);
        out
    }

    /// `None` when ready, else why not.
    pub(crate) fn not_ready(&self) -> Option<&'static str> {
        if !self.started.load(Ordering::Relaxed) {
            return Some("starting");
        }
        if self.source_streaming.get() == 0 {
            return Some("source not streaming");
        }
        if self.sink_connected.get() == 0 {
            return Some("sink not connected");
        }
        if self.sink_blocked.get() != 0 {
            return Some("sink blocked by the broker (resource alarm)");
        }
        None
    }
}

/// How far a long phase has got (`crate::progress` keeps these gauges in step with its lines).
fn register_progress(registry: &mut Registry) {
    let g = crate::progress::gauges();
    registry.register(
        "progress_phase",
        "1 while the phase runs (snapshot, replay, catch-up)",
        g.phase.clone(),
    );
    registry.register(
        "progress_rows_done",
        "Rows the running (or last) snapshot or replay of a table has handed to the sink",
        g.rows_done.clone(),
    );
    registry.register(
        "progress_rows_estimated",
        "Estimated rows of that table's snapshot or replay (the planner's estimate, raised to the rows done; the exact count once finished)",
        g.rows_estimated.clone(),
    );
    registry.register(
        "progress_bytes_behind",
        "WAL bytes between the position read and the server's end, while catching up",
        g.bytes_behind.clone(),
    );
    registry.register(
        "progress_eta_seconds",
        "Estimated seconds left of the running phase at its rate so far (-1: unknown or none running)",
        g.eta_seconds.clone(),
    );
}

/// What a process that runs several relays (`outboxd fleet`) serves beside the process-wide
/// instruments: its sources' states on `/status`, per-source series on `/metrics`, and its own
/// readiness on `/readyz` (the process-wide instruments mix every source's state).
pub trait FleetView: Send + Sync {
    /// The body of `/status` (JSON).
    fn status_json(&self) -> String;
    /// OpenMetrics lines (families with their `# TYPE`/`# HELP`) for `/metrics`.
    fn metrics(&self) -> String;
    /// `None` when ready, else why not.
    fn not_ready(&self) -> Option<String>;
}

static FLEET: OnceLock<std::sync::Arc<dyn FleetView>> = OnceLock::new();

/// Makes the endpoint serve `view` (once per process; a second call is ignored).
pub fn set_fleet(view: std::sync::Arc<dyn FleetView>) {
    let _ = FLEET.set(view);
}

fn fleet() -> Option<&'static std::sync::Arc<dyn FleetView>> {
    FLEET.get()
}

/// The process's instruments.
pub fn get() -> &'static Telemetry {
    static T: OnceLock<Telemetry> = OnceLock::new();
    T.get_or_init(Telemetry::new)
}
