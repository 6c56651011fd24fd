//! Metrics and health. One process-wide set of instruments (a relay runs one pipeline), each
//! small event on the data path both counts here and logs where it happens. Served on
//! `--metrics-addr` with `/metrics` (OpenMetrics text, which Prometheus scrapes), `/healthz`
//! (the process serves) and `/readyz` (source streaming, sink connected and not blocked; 503
//! with the reason otherwise). Also the log subscriber every binary installs, with the one
//! filter no `--log-level` can lift ([`init_logging`]).

use prometheus_client::encoding::{text::encode, EncodeLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct Cause {
    pub cause: String,
}

/// Every instrument the relay keeps.
pub struct Telemetry {
    registry: Registry,
    pub events_read: Counter,
    pub events_published: Counter,
    pub events_confirmed: Counter,
    pub events_dead_lettered: Counter,
    pub events_republished: Counter,
    /// Published events the sink reported as already stored, so not stored again (NATS
    /// JetStream: the same `Nats-Msg-Id` within the stream's duplicate window).
    pub events_deduplicated: Counter,
    /// Attempts to store a position older than the stored one (a relay bug; refused).
    pub position_backwards_refused: Counter,
    /// Reserved header names a row's `headers` object tried to set (dropped).
    pub row_headers_dropped: Counter,
    /// Connections to the metrics endpoint closed unserved (over its connection limit).
    pub http_connections_refused: Counter,
    pub reconnects: Family<Cause, Counter>,
    /// Failed attempts to get the oldest unconfirmed event confirmed, by cause (see
    /// [`Telemetry::sink_retry`]).
    pub sink_retries: Family<Cause, Counter>,
    pub publish_confirm_seconds: Histogram,
    pub commit_confirm_seconds: Histogram,
    pub source_lag_bytes: Gauge,
    pub source_lag_seconds: Gauge<f64, AtomicU64>,
    pub slot_retained_wal_bytes: Gauge,
    pub leader: Gauge,
    pub source_streaming: Gauge,
    pub sink_connected: Gauge,
    pub sink_blocked: Gauge,
    /// 1 while publishing waits for a lease renewal (the self-fence is closed).
    pub publishing_fenced: Gauge,
    /// Unix time (s) of the last stored position; the age is computed at scrape time.
    position_stored_at: AtomicI64,
    position_age_seconds: Gauge<f64, AtomicU64>,
    /// Set once a pipeline runs; `/readyz` says "starting" before.
    started: AtomicBool,
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
            position_backwards_refused: Counter::default(),
            row_headers_dropped: Counter::default(),
            http_connections_refused: Counter::default(),
            reconnects: Family::default(),
            sink_retries: Family::default(),
            // 100 µs … ~27 min
            publish_confirm_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 24)),
            commit_confirm_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 24)),
            source_lag_bytes: Gauge::default(),
            source_lag_seconds: Gauge::default(),
            slot_retained_wal_bytes: Gauge::default(),
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
        registry.register(
            "events_read",
            "Outbox rows decoded from the source",
            t.events_read.clone(),
        );
        registry.register(
            "events_published",
            "Events handed to the sink (first attempts)",
            t.events_published.clone(),
        );
        registry.register(
            "events_confirmed",
            "Events the sink made durable",
            t.events_confirmed.clone(),
        );
        registry.register(
            "events_dead_lettered",
            "Poison events sent to <exchange>.dead",
            t.events_dead_lettered.clone(),
        );
        registry.register(
            "events_republished",
            "Unconfirmed events published again after a sink failure",
            t.events_republished.clone(),
        );
        registry.register(
            "events_deduplicated",
            "Published events the sink reported as already stored and did not store again (NATS JetStream: the same Nats-Msg-Id within the stream's duplicate window)",
            t.events_deduplicated.clone(),
        );
        registry.register(
            "row_headers_dropped",
            "Header names a row's headers object set that the relay reserves (dropped)",
            t.row_headers_dropped.clone(),
        );
        registry.register(
            "position_backwards_refused",
            "Attempts to store a position older than the stored one (refused; a relay bug)",
            t.position_backwards_refused.clone(),
        );
        registry.register(
            "http_connections_refused",
            "Connections to this endpoint closed unserved, over its connection limit",
            t.http_connections_refused.clone(),
        );
        registry.register(
            "reconnects",
            "Reconnects by cause (source, sink)",
            t.reconnects.clone(),
        );
        registry.register(
            "sink_retries",
            "Failed attempts to get the oldest unconfirmed event confirmed (cause: rejected = returned or nacked, timeout, connection); each is followed by a paced reconnect",
            t.sink_retries.clone(),
        );
        registry.register(
            "publish_confirm_seconds",
            "From handing an event to the sink to its confirmation",
            t.publish_confirm_seconds.clone(),
        );
        registry.register(
            "commit_confirm_seconds",
            "From the source transaction's commit to the event's confirmation",
            t.commit_confirm_seconds.clone(),
        );
        registry.register(
            "source_lag_bytes",
            "Log bytes between the server's position and the acknowledged one",
            t.source_lag_bytes.clone(),
        );
        registry.register(
            "source_lag_seconds",
            "Age of the newest confirmed event's commit when it was confirmed",
            t.source_lag_seconds.clone(),
        );
        registry.register(
            "slot_retained_wal_bytes",
            "WAL the replication slot keeps on the server",
            t.slot_retained_wal_bytes.clone(),
        );
        registry.register(
            "position_age_seconds",
            "Time since the position was last stored",
            t.position_age_seconds.clone(),
        );
        registry.register(
            "leader",
            "1 while this process holds the lease",
            t.leader.clone(),
        );
        registry.register(
            "source_streaming",
            "1 while the source stream is open",
            t.source_streaming.clone(),
        );
        registry.register(
            "sink_connected",
            "1 while the sink is connected",
            t.sink_connected.clone(),
        );
        registry.register(
            "sink_blocked",
            "1 while the broker blocks publishing (resource alarm)",
            t.sink_blocked.clone(),
        );
        registry.register(
            "publishing_fenced",
            "1 while publishing waits for a lease renewal (the last one is older than the self-fence limit)",
            t.publishing_fenced.clone(),
        );
        Telemetry { registry, ..t }
    }

    /// The sink failed to confirm the oldest unconfirmed event (`event_id` at `position`; none
    /// when nothing was in flight) for `reason`, for the `attempt`-th time in a row; the relay
    /// reconnects and republishes it after `retry_in`. Logged and counted by cause.
    pub fn sink_retry(
        &self,
        cause: &'static str,
        event: Option<(&uuid::Uuid, &crate::event::SourcePosition)>,
        reason: &dyn std::fmt::Display,
        attempt: u32,
        retry_in: std::time::Duration,
    ) {
        self.sink_retries
            .get_or_create(&Cause {
                cause: cause.to_string(),
            })
            .inc();
        self.reconnect("sink");
        self.sink_connected.set(0);
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
            tracing::warn!(event_id = %id, position = %position, cause, reason = %reason, attempt, retry_in = ?retry_in,
                "sink failed; reconnecting to republish unconfirmed events in order ({what}: {reason})");
        } else {
            tracing::warn!(event_id = %id, position = %position, cause, reason = %reason, attempt, retry_in = ?retry_in,
                "sink still unavailable or refusing ({what}, attempt {attempt}: {reason}); retrying in {retry_in:?}");
        }
    }

    /// The relay stopped publishing: the lease was last renewed `age` ago (never: `None`),
    /// not less than `limit`.
    pub fn fence_closed(&self, age: Option<std::time::Duration>, limit: std::time::Duration) {
        match age {
            Some(age) => {
                self.publishing_fenced.set(1);
                tracing::warn!(
                    lease_age = ?age,
                    limit = ?limit,
                    "publishing paused: the lease was last renewed {:.1}s ago, not less than the self-fence limit {:.1}s; nothing is published until a renewal succeeds (another relay may hold the lease by now)",
                    age.as_secs_f64(),
                    limit.as_secs_f64()
                )
            }
            None => tracing::debug!("publishing waits for the first lease renewal"),
        }
    }

    /// Publishing resumes after the fence was closed for `closed`.
    pub fn fence_opened(&self, closed: std::time::Duration) {
        self.publishing_fenced.set(0);
        tracing::info!(paused = ?closed, "the lease was renewed: publishing resumes");
    }

    /// The position was stored just now.
    pub fn position_stored(&self) {
        self.position_stored_at
            .store(now_unix() as i64, Ordering::Relaxed);
    }

    pub fn reconnect(&self, cause: &str) {
        self.reconnects
            .get_or_create(&Cause {
                cause: cause.to_string(),
            })
            .inc();
    }

    pub fn mark_started(&self) {
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
    pub fn not_ready(&self) -> Option<&'static str> {
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

/// The process's instruments.
pub fn get() -> &'static Telemetry {
    static T: OnceLock<Telemetry> = OnceLock::new();
    T.get_or_init(Telemetry::new)
}

/// `outboxd health`: one GET of `path` on the relay's metrics address; Ok on 200, otherwise an
/// error carrying the status line and body (the reason /readyz gives).
pub async fn probe(addr: &str, path: &str) -> Result<(), crate::Error> {
    let fail = |what: String| crate::Error::Other(format!("{addr}{path}: {what}"));
    let exchange = async {
        let mut sock = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| fail(format!("cannot connect: {e}")))?;
        sock.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .map_err(|e| fail(e.to_string()))?;
        let mut answer = Vec::new();
        sock.read_to_end(&mut answer)
            .await
            .map_err(|e| fail(e.to_string()))?;
        Ok::<_, crate::Error>(String::from_utf8_lossy(&answer).into_owned())
    };
    let answer = tokio::time::timeout(std::time::Duration::from_secs(5), exchange)
        .await
        .map_err(|_| fail("no answer in 5 s".into()))??;
    let status = answer.lines().next().unwrap_or_default();
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default().trim();
    if status.split_whitespace().nth(1) == Some("200") {
        println!("ok   {path}: {body}");
        Ok(())
    } else {
        Err(fail(format!("{status}: {body}")))
    }
}

/// Most connections served at once: beyond it a new connection is closed at once (so it does
/// not wait in the backlog behind idle ones) and counted. Well below the usual 1024 file
/// descriptors, well above what Prometheus and a prober need.
pub const MAX_CONNECTIONS: usize = 512;
/// A client must send its request head within this time.
pub const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// A whole connection (request and answer, a slow reader of /metrics included) ends after this.
pub const REQUEST_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `/metrics`, `/healthz` and `/readyz` until the process ends, with hyper (HTTP/1.1,
/// one request per connection): at most [`MAX_CONNECTIONS`] at once, each bounded by
/// [`HEADER_TIMEOUT`] and [`REQUEST_DEADLINE`], and accept errors (such as running out of
/// file descriptors) retried with a growing pause instead of a spinning loop.
pub async fn serve(addr: &str) -> Result<std::net::SocketAddr, crate::Error> {
    let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        crate::Error::config(
            format!("--metrics-addr {addr}: {e}"),
            "use a free HOST:PORT, e.g. --metrics-addr 127.0.0.1:9187",
        )
    })?;
    let local = listener
        .local_addr()
        .map_err(|e| crate::Error::Other(e.to_string()))?;
    tracing::info!(addr = %local, "serving /metrics, /healthz and /readyz");
    tokio::spawn(accept_loop(listener));
    Ok(local)
}

async fn accept_loop(listener: tokio::net::TcpListener) {
    use std::time::Duration;
    let permits = std::sync::Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
    let mut pause = Duration::ZERO;
    loop {
        let sock = match listener.accept().await {
            Ok((sock, _)) => {
                pause = Duration::ZERO;
                sock
            }
            Err(e) => {
                if pause.is_zero() {
                    tracing::warn!(error = %e, "metrics endpoint: accept failed; retrying with backoff");
                }
                pause = (pause * 2).clamp(Duration::from_millis(10), Duration::from_secs(1));
                tokio::time::sleep(pause).await;
                continue;
            }
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            get().http_connections_refused.inc();
            drop(sock);
            continue;
        };
        tokio::spawn(async move {
            let _permit = permit;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .keep_alive(false)
                .max_buf_size(16 * 1024)
                .serve_connection(
                    hyper_util::rt::TokioIo::new(sock),
                    hyper::service::service_fn(answer),
                );
            let _ = tokio::time::timeout(REQUEST_DEADLINE, conn).await;
        });
    }
}

type Body = http_body_util::Full<bytes::Bytes>;

async fn answer(
    req: hyper::Request<hyper::body::Incoming>,
) -> Result<hyper::Response<Body>, std::convert::Infallible> {
    use hyper::{Method, StatusCode};
    let t = get();
    let (status, ctype, body) = if req.method() != Method::GET && req.method() != Method::HEAD {
        (
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "use GET\n".to_string(),
        )
    } else {
        match req.uri().path() {
            "/metrics" => (
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                t.render(),
            ),
            "/healthz" => (StatusCode::OK, "text/plain", "ok\n".to_string()),
            "/readyz" => match t.not_ready() {
                None => (StatusCode::OK, "text/plain", "ready\n".to_string()),
                Some(why) => (
                    StatusCode::SERVICE_UNAVAILABLE,
                    "text/plain",
                    format!("not ready: {why}\n"),
                ),
            },
            _ => (
                StatusCode::NOT_FOUND,
                "text/plain",
                "not found\n".to_string(),
            ),
        }
    };
    let mut resp = hyper::Response::new(Body::new(body.into()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static(ctype),
    );
    Ok(resp)
}

/// Whether a log event may be written, whatever `--log-level` enables. The AMQP client's TRACE
/// events print whole frames, and the connection's `Connection.StartOk` frame holds the broker
/// password (the SASL PLAIN response), so they never reach the log; its DEBUG and higher
/// events carry no frames and pass.
pub fn loggable(meta: &tracing::Metadata<'_>) -> bool {
    let amqp = ["lapin", "amq_protocol"]
        .iter()
        .any(|c| meta.target().starts_with(c));
    !(amqp && *meta.level() == tracing::Level::TRACE)
}

/// Installs the stderr log subscriber: `level` is a `tracing` filter (`info`, `debug`,
/// `outboxd=trace,…`; an invalid one falls back to `info`), text or JSON lines, and
/// [`loggable`] on top of it.
pub fn init_logging(level: &str, json: bool) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let filter = tracing_subscriber::EnvFilter::try_new(level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let secrets = tracing_subscriber::filter::filter_fn(loggable);
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry().with(filter);
    if json {
        registry.with(fmt.json().with_filter(secrets)).init();
    } else {
        registry.with(fmt.with_filter(secrets)).init();
    }
}
