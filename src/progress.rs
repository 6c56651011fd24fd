//! How far long work has got, said while it runs: a relay's snapshot of a table, a replay
//! through the table after a lost position, catching up on the WAL after downtime, and the
//! one-shot commands (`reencrypt`, `prune`, a consumer's `--until-empty`). One [`Progress`] per
//! piece of work is fed counts; it decides when a line is due (every
//! [`interval`](configure) — 10 s by default — or at every tenth of an estimated total, never
//! more than once per tenth of the interval), computes the rate and the time left, and keeps
//! the `outboxd_progress_*` gauges ([`gauges`]; registered by `telemetry`) in step with the
//! line. Totals are estimates the caller had cheaply (the planner's row count, the WAL
//! distance); lines and gauges call them so, and a count that overtakes its estimate raises it.
//! With [`configure`]d bars (a one-shot command whose stderr is a terminal, text logs) a
//! command's work draws an `indicatif` bar instead of its periodic lines; the log writer
//! hides the bar while it writes a line ([`while_hidden`]).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;
use tokio::time::Instant;

/// Catch-up starts being reported once the source is this far behind the server's log…
pub(crate) const CATCH_UP_FROM_BYTES: u64 = 16 << 20;
/// …and is over once it is this close again.
pub(crate) const CAUGHT_UP_BYTES: u64 = 1 << 20;

/// What a table read of this process is: a first start's snapshot or a replay ([`table_phase`]).
static TABLE_PHASE_IS_REPLAY: AtomicBool = AtomicBool::new(false);
static INTERVAL_MS: AtomicU64 = AtomicU64::new(10_000);
static BARS: AtomicBool = AtomicBool::new(false);

/// Sets the process's progress settings: the line interval (`--progress-interval`) and whether
/// one-shot commands draw a bar (stderr is a terminal and the log is text). Bars need the
/// `cli` feature; without it they are lines.
pub fn configure(interval: Duration, bars: bool) {
    let ms = u64::try_from(interval.as_millis())
        .unwrap_or(u64::MAX)
        .max(1);
    INTERVAL_MS.store(ms, Ordering::Relaxed);
    BARS.store(bars && cfg!(feature = "cli"), Ordering::Relaxed);
}

/// Whether the rows this process's relay is about to read from its tables are a first start's
/// snapshot or a replay (set by the startup that decided it; a process runs one relay).
pub(crate) fn table_phase(phase: Phase) {
    TABLE_PHASE_IS_REPLAY.store(phase == Phase::Replay, Ordering::Relaxed);
}

fn interval() -> Duration {
    Duration::from_millis(INTERVAL_MS.load(Ordering::Relaxed))
}

/// The relay's long phases, as the `phase` label of `outboxd_progress_phase` names them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Phase {
    /// A first start publishes the rows already in the table.
    Snapshot,
    /// A replay through the table: a lost position's recovery, or `offset set --replay-since`.
    Replay,
    /// Streaming from a position far behind the server's log.
    CatchUp,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Snapshot, Phase::Replay, Phase::CatchUp];

    pub fn label(self) -> &'static str {
        match self {
            Phase::Snapshot => "snapshot",
            Phase::Replay => "replay",
            Phase::CatchUp => "catch-up",
        }
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub(crate) struct PhaseLabel {
    pub phase: String,
}

/// The gauges the relay's phases keep (registered on the metrics endpoint by `telemetry`).
pub(crate) struct Gauges {
    /// 1 while the phase runs.
    pub phase: Family<PhaseLabel, Gauge>,
    /// Rows published so far by the running (or last) snapshot or replay of a table.
    pub rows_done: Gauge,
    /// The estimate of that table's rows to publish (at least `rows_done`).
    pub rows_estimated: Gauge,
    /// WAL bytes between the position read and the server's end, while catching up.
    pub bytes_behind: Gauge,
    /// Estimated seconds left of the running phase; -1 when not known.
    pub eta_seconds: Gauge,
}

/// The table the running (or last) snapshot or replay reads, for [`summary`].
static TABLE: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// What a running relay phase has got to, as one JSON object (`None`: no phase runs): the
/// phase, its table, rows done and the estimate, bytes behind while catching up, the time left
/// and when this was said. The lease keeper stores it with the relay's state, where
/// `outboxd status` reads it.
pub(crate) fn summary() -> Option<String> {
    let g = gauges();
    let phase = Phase::ALL
        .into_iter()
        .find(|p| g.phase.get_or_create(&label(*p)).get() == 1)?;
    let eta = g.eta_seconds.get();
    let mut v = serde_json::json!({
        "phase": phase.label(),
        "eta_s": (eta >= 0).then_some(eta),
    });
    if phase == Phase::CatchUp {
        v["bytes_behind"] = g.bytes_behind.get().into();
    } else {
        v["table"] = TABLE.lock().map(|t| t.clone()).unwrap_or_default().into();
        v["rows_done"] = g.rows_done.get().into();
        v["rows_estimated"] = g.rows_estimated.get().into();
    }
    Some(v.to_string())
}

/// A [`summary`] as `status` says it: `snapshot of public.outbox: 120000 of ~400000 rows
/// (30%), about 21 s left`, `catch-up: 73400320 bytes behind, about 15 s left`.
pub(crate) fn describe(summary: &serde_json::Value) -> String {
    let phase = summary["phase"].as_str().unwrap_or("?");
    let left = match summary["eta_s"].as_i64() {
        Some(s) => format!("about {s} s left"),
        None => "time left unknown".to_string(),
    };
    if let Some(b) = summary["bytes_behind"].as_i64() {
        return format!("{phase}: {b} bytes behind the server, {left}");
    }
    let done = summary["rows_done"].as_i64().unwrap_or(0);
    let total = summary["rows_estimated"].as_i64().unwrap_or(0);
    let percent = match u64::try_from(total) {
        Ok(t) if t > 0 => Percent(done.max(0) as u64, Some(t)).to_string() + "%",
        _ => "?%".to_string(),
    };
    format!(
        "{phase} of {}: {done} of ~{total} rows ({percent}), {left}",
        summary["table"].as_str().unwrap_or("?")
    )
}

/// The process's progress gauges.
pub(crate) fn gauges() -> &'static Gauges {
    static G: OnceLock<Gauges> = OnceLock::new();
    G.get_or_init(|| {
        let g = Gauges {
            phase: Family::default(),
            rows_done: Gauge::default(),
            rows_estimated: Gauge::default(),
            bytes_behind: Gauge::default(),
            eta_seconds: Gauge::default(),
        };
        for p in Phase::ALL {
            g.phase.get_or_create(&label(p)).set(0);
        }
        g.eta_seconds.set(-1);
        g
    })
}

fn label(p: Phase) -> PhaseLabel {
    PhaseLabel {
        phase: p.label().to_string(),
    }
}

fn gauge_value(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

/// What a count counts, for the lines.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Rows,
    Messages,
    Bytes,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::Rows => "rows",
            Unit::Messages => "messages",
            Unit::Bytes => "bytes",
        }
    }
}

/// Who sees the progress besides the lines.
enum Shown {
    /// Lines only.
    Lines,
    /// Lines and the relay's gauges for this phase.
    Relay(Phase),
    /// A terminal bar instead of periodic lines.
    #[cfg(feature = "cli")]
    Bar(indicatif::ProgressBar),
}

/// One piece of long work being counted: see the module paragraph.
pub struct Progress {
    what: &'static str,
    subject: String,
    unit: Unit,
    done: u64,
    estimate: Option<u64>,
    started: Instant,
    last_line: Instant,
    /// The tenth of the estimate the last line was at.
    last_tenth: u64,
    interval: Duration,
    shown: Shown,
    finished: bool,
    /// Periodic lines printed so far.
    lines: u64,
}

impl Progress {
    /// A relay phase over the rows of `table`, with `estimate` rows expected (`None`: unknown).
    /// Sets the phase's gauge and the row gauges.
    pub fn relay(phase: Phase, table: impl ToString, estimate: Option<u64>) -> Progress {
        let g = gauges();
        for p in Phase::ALL {
            g.phase.get_or_create(&label(p)).set(i64::from(p == phase));
        }
        g.rows_done.set(0);
        g.rows_estimated.set(gauge_value(estimate.unwrap_or(0)));
        g.eta_seconds.set(-1);
        let subject = table.to_string();
        if let Ok(mut t) = TABLE.lock() {
            t.clone_from(&subject);
        }
        tracing::info!(
            target: "outboxd::progress",
            phase = phase.label(),
            subject = %subject,
            estimated_total = %Estimate(estimate),
            "{} started", phase.label()
        );
        Progress::new(
            phase.label(),
            subject,
            Unit::Rows,
            estimate,
            Shown::Relay(phase),
        )
    }

    /// The relay's read of `table`'s existing rows, a snapshot or a replay as [`table_phase`]
    /// said.
    pub fn table(table: impl ToString, estimate: Option<u64>) -> Progress {
        let phase = match TABLE_PHASE_IS_REPLAY.load(Ordering::Relaxed) {
            true => Phase::Replay,
            false => Phase::Snapshot,
        };
        Progress::relay(phase, table, estimate)
    }

    /// A one-shot command's work (`what`: `reencrypt`, `prune`, …) over `subject`: a bar when
    /// [`configure`]d so, else lines.
    pub fn command(
        what: &'static str,
        subject: impl ToString,
        unit: Unit,
        estimate: Option<u64>,
    ) -> Progress {
        let subject = subject.to_string();
        #[cfg(feature = "cli")]
        if BARS.load(Ordering::Relaxed) {
            let bar = bar::start(what, &subject, unit, estimate);
            return Progress::new(what, subject, unit, estimate, Shown::Bar(bar));
        }
        Progress::new(what, subject, unit, estimate, Shown::Lines)
    }

    fn new(
        what: &'static str,
        subject: String,
        unit: Unit,
        estimate: Option<u64>,
        shown: Shown,
    ) -> Progress {
        let now = Instant::now();
        Progress {
            what,
            subject,
            unit,
            done: 0,
            estimate,
            started: now,
            last_line: now,
            last_tenth: 0,
            interval: interval(),
            shown,
            finished: false,
            lines: 0,
        }
    }

    /// `n` more done; prints a line when one is due.
    pub fn add(&mut self, n: u64) {
        self.set(self.done.saturating_add(n));
    }

    /// `done` so far (never less than before); prints a line when one is due.
    pub fn set(&mut self, done: u64) {
        self.done = self.done.max(done);
        if let Some(e) = self.estimate {
            // An estimate the count overtook was low: it is at least what is done.
            self.estimate = Some(e.max(self.done));
        }
        match &self.shown {
            Shown::Lines => {}
            Shown::Relay(_) => {
                let g = gauges();
                g.rows_done.set(gauge_value(self.done));
                if let Some(e) = self.estimate {
                    g.rows_estimated.set(gauge_value(e));
                }
            }
            #[cfg(feature = "cli")]
            Shown::Bar(b) => {
                b.set_position(self.done);
                if let Some(e) = self.estimate {
                    b.set_length(e);
                }
                return;
            }
        }
        let now = Instant::now();
        if self.due(now) {
            self.line(now);
        }
    }

    /// The estimate changed (a better one was found): the lines and gauges use it from now on.
    pub fn set_estimate(&mut self, estimate: Option<u64>) {
        self.estimate = estimate.map(|e| e.max(self.done));
        if let Shown::Relay(_) = self.shown {
            gauges()
                .rows_estimated
                .set(gauge_value(self.estimate.unwrap_or(0)));
        }
    }

    pub fn done(&self) -> u64 {
        self.done
    }

    /// Periodic lines printed so far.
    pub fn lines(&self) -> u64 {
        self.lines
    }

    /// Per second since the start.
    pub fn rate(&self) -> f64 {
        let secs = self.started.elapsed().as_secs_f64();
        if secs <= 0.0 {
            return 0.0;
        }
        self.done as f64 / secs
    }

    /// Time left at the rate so far; `None` without an estimate or a rate.
    pub fn eta(&self) -> Option<Duration> {
        let left = self.estimate?.saturating_sub(self.done);
        let rate = self.rate();
        (rate > 0.0).then(|| Duration::from_secs_f64(left as f64 / rate))
    }

    fn tenth(&self) -> u64 {
        match self.estimate {
            Some(e) if e > 0 => self.done.saturating_mul(10) / e,
            _ => 0,
        }
    }

    /// Whether a line is due at `now`: an interval since the last one, or a new tenth of the
    /// estimate reached at least a tenth of the interval after the last line.
    fn due(&self, now: Instant) -> bool {
        let since = now.saturating_duration_since(self.last_line);
        since >= self.interval || (self.tenth() > self.last_tenth && since >= self.interval / 10)
    }

    fn line(&mut self, now: Instant) {
        self.lines += 1;
        self.last_line = now;
        self.last_tenth = self.tenth();
        let eta = self.eta();
        if let Shown::Relay(_) = self.shown {
            gauges().eta_seconds.set(eta_gauge(eta));
        }
        tracing::info!(
            target: "outboxd::progress",
            phase = self.what,
            subject = %self.subject,
            done = self.done,
            estimated_total = %Estimate(self.estimate),
            percent = %Percent(self.done, self.estimate),
            rate_per_s = self.rate().round() as u64,
            eta_s = %Eta(eta),
            "{} progress: {} {}", self.what, self.done, self.unit.name()
        );
    }

    /// The work is over: the last line (every count, how long it took, the rate) and the
    /// phase's gauge back to 0. Also on drop, so an error's early return leaves no phase
    /// running in the metrics (its line then says `interrupted`).
    pub fn finish(mut self) {
        self.end(true);
    }

    fn end(&mut self, complete: bool) {
        if self.finished {
            return;
        }
        self.finished = true;
        match &self.shown {
            Shown::Lines => {}
            Shown::Relay(phase) => {
                let g = gauges();
                g.phase.get_or_create(&label(*phase)).set(0);
                g.rows_done.set(gauge_value(self.done));
                if complete {
                    g.rows_estimated.set(gauge_value(self.done));
                }
                g.eta_seconds.set(-1);
            }
            #[cfg(feature = "cli")]
            Shown::Bar(b) => b.finish_and_clear(),
        }
        if complete {
            tracing::info!(
                target: "outboxd::progress",
                phase = self.what,
                subject = %self.subject,
                done = self.done,
                elapsed_s = self.started.elapsed().as_secs(),
                rate_per_s = self.rate().round() as u64,
                "{} finished: {} {}", self.what, self.done, self.unit.name()
            );
        } else {
            tracing::info!(
                target: "outboxd::progress",
                phase = self.what,
                subject = %self.subject,
                done = self.done,
                estimated_total = %Estimate(self.estimate),
                "{} interrupted at {} {}", self.what, self.done, self.unit.name()
            );
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.end(false);
    }
}

fn eta_gauge(eta: Option<Duration>) -> i64 {
    eta.map(|d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX))
        .unwrap_or(-1)
}

/// An estimate as the lines say it: `~N`, or `unknown`.
struct Estimate(Option<u64>);

impl std::fmt::Display for Estimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(n) => write!(f, "~{n}"),
            None => f.write_str("unknown"),
        }
    }
}

/// Done of an estimate, in percent (at most 99 % until finished: the estimate may be low).
struct Percent(u64, Option<u64>);

impl std::fmt::Display for Percent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.1 {
            Some(e) if e > 0 => write!(f, "{}", (self.0.saturating_mul(100) / e).min(99)),
            _ => f.write_str("unknown"),
        }
    }
}

struct Eta(Option<Duration>);

impl std::fmt::Display for Eta {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(d) => write!(f, "{}", d.as_secs()),
            None => f.write_str("unknown"),
        }
    }
}

/// Catching up on the server's log: fed how far behind the server's end the position read is,
/// whenever the stream says (each WAL message and keepalive). Reports from the first reading
/// of [`CATCH_UP_FROM_BYTES`] or more until [`CAUGHT_UP_BYTES`] or less: bytes behind, the
/// rate at which the distance closes and the time left at that rate.
pub(crate) struct CatchUp {
    what: &'static str,
    running: Option<Closing>,
    interval: Duration,
}

struct Closing {
    first: u64,
    behind: u64,
    started: Instant,
    last_line: Instant,
}

impl Closing {
    /// Bytes per second the distance closes (0 while it does not).
    fn rate(&self, now: Instant) -> f64 {
        let secs = now.saturating_duration_since(self.started).as_secs_f64();
        if secs <= 0.0 {
            return 0.0;
        }
        self.first.saturating_sub(self.behind) as f64 / secs
    }

    fn eta(&self, now: Instant) -> Option<Duration> {
        let rate = self.rate(now);
        (rate > 0.0).then(|| Duration::from_secs_f64(self.behind as f64 / rate))
    }
}

impl CatchUp {
    /// `what` names the log in the lines (`WAL`, `binlog`).
    pub(crate) fn new(what: &'static str) -> CatchUp {
        CatchUp {
            what,
            running: None,
            interval: interval(),
        }
    }

    /// Whether a catch-up is being reported.
    #[cfg(test)]
    fn running(&self) -> bool {
        self.running.is_some()
    }

    /// The position read is `behind` bytes before the server's end.
    pub(crate) fn behind(&mut self, behind: u64) {
        let now = Instant::now();
        let g = gauges();
        match &mut self.running {
            None if behind >= CATCH_UP_FROM_BYTES => {
                g.phase.get_or_create(&label(Phase::CatchUp)).set(1);
                g.bytes_behind.set(gauge_value(behind));
                g.eta_seconds.set(-1);
                tracing::info!(
                    target: "outboxd::progress",
                    phase = Phase::CatchUp.label(),
                    bytes_behind = behind,
                    "catching up: {} bytes of {} behind the server", behind, self.what
                );
                self.running = Some(Closing {
                    first: behind,
                    behind,
                    started: now,
                    last_line: now,
                });
            }
            None => {}
            Some(c) => {
                c.behind = behind;
                g.bytes_behind.set(gauge_value(behind));
                if behind <= CAUGHT_UP_BYTES {
                    g.phase.get_or_create(&label(Phase::CatchUp)).set(0);
                    g.eta_seconds.set(-1);
                    tracing::info!(
                        target: "outboxd::progress",
                        phase = Phase::CatchUp.label(),
                        bytes_behind = behind,
                        elapsed_s = now.saturating_duration_since(c.started).as_secs(),
                        "caught up: {} bytes of {} behind the server", behind, self.what
                    );
                    self.running = None;
                } else if now.saturating_duration_since(c.last_line) >= self.interval {
                    c.last_line = now;
                    let eta = c.eta(now);
                    g.eta_seconds.set(eta_gauge(eta));
                    tracing::info!(
                        target: "outboxd::progress",
                        phase = Phase::CatchUp.label(),
                        bytes_behind = behind,
                        closing_per_s = c.rate(now).round() as u64,
                        eta_s = %Eta(eta),
                        "catch-up progress: {} bytes of {} behind", behind, self.what
                    );
                }
            }
        }
    }
}

/// Runs `write` with the command's bar (if one is drawn) hidden, so a log line does not land
/// in the middle of it.
pub(crate) fn while_hidden<R>(write: impl FnOnce() -> R) -> R {
    #[cfg(feature = "cli")]
    if let Some(b) = bar::current() {
        return b.suspend(write);
    }
    write()
}

#[cfg(feature = "cli")]
mod bar {
    use super::Unit;
    use std::sync::Mutex;

    /// The bar being drawn, for [`super::while_hidden`] (a finished one is ignored).
    static CURRENT: Mutex<Option<indicatif::ProgressBar>> = Mutex::new(None);

    pub(super) fn start(
        what: &str,
        subject: &str,
        unit: Unit,
        estimate: Option<u64>,
    ) -> indicatif::ProgressBar {
        let bar = match estimate {
            Some(n) => indicatif::ProgressBar::new(n),
            None => indicatif::ProgressBar::no_length(),
        };
        bar.set_draw_target(indicatif::ProgressDrawTarget::stderr());
        let template = match (estimate, unit) {
            (Some(_), Unit::Bytes) => "{msg} [{bar:30}] {bytes}/~{total_bytes} ~{eta} left",
            (Some(_), _) => "{msg} [{bar:30}] {human_pos}/~{human_len} ~{eta} left",
            (None, _) => "{msg} {spinner} {human_pos} {elapsed}",
        };
        if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
            bar.set_style(style.progress_chars("=> "));
        }
        bar.set_message(format!("{what} {subject}"));
        bar.enable_steady_tick(std::time::Duration::from_millis(200));
        if let Ok(mut c) = CURRENT.lock() {
            *c = Some(bar.clone());
        }
        bar
    }

    pub(super) fn current() -> Option<indicatif::ProgressBar> {
        let c = CURRENT.lock().ok()?;
        c.as_ref().filter(|b| !b.is_finished()).cloned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::advance;

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    #[tokio::test(start_paused = true)]
    async fn without_an_estimate_a_line_every_interval_and_none_per_row() {
        let mut p = Progress::command("prune", "t", Unit::Rows, None);
        for _ in 0..35 {
            for _ in 0..1000 {
                p.add(1);
            }
            advance(secs(1)).await;
        }
        p.add(0);
        assert_eq!(p.done(), 35_000);
        // 35 s at one line per 10 s: at 10, 20 and 30 s; 35,000 rows made no more.
        assert_eq!(p.lines(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn with_an_estimate_a_line_at_each_tenth() {
        let mut p = Progress::command("reencrypt", "t", Unit::Rows, Some(1000));
        for _ in 0..10 {
            advance(secs(2)).await;
            p.add(100);
        }
        // Every tenth came 2 s (more than a tenth of the interval) after the last line.
        assert_eq!(p.lines(), 10);
    }

    #[tokio::test(start_paused = true)]
    async fn tenths_faster_than_a_tenth_of_the_interval_print_nothing() {
        let mut p = Progress::command("reencrypt", "t", Unit::Rows, Some(1000));
        for _ in 0..1000 {
            advance(Duration::from_micros(500)).await;
            p.add(1);
        }
        assert_eq!(p.lines(), 0, "a 0.5 s job needs no progress line");
    }

    #[tokio::test(start_paused = true)]
    async fn rate_and_time_left_come_from_the_count_and_the_clock() {
        let mut p = Progress::command("prune", "t", Unit::Rows, Some(1000));
        assert_eq!(p.eta(), None, "no rate yet");
        advance(secs(10)).await;
        p.set(250);
        assert_eq!(p.rate(), 25.0);
        assert_eq!(p.eta(), Some(secs(30)));
        // A count never goes back.
        p.set(100);
        assert_eq!(p.done(), 250);
    }

    #[tokio::test(start_paused = true)]
    async fn an_overtaken_estimate_is_raised_and_never_shows_done_early() {
        let mut p = Progress::command("prune", "t", Unit::Rows, Some(10));
        advance(secs(1)).await;
        p.set(50);
        assert_eq!(p.estimate, Some(50));
        assert_eq!(Percent(p.done, p.estimate).to_string(), "99");
        assert_eq!(p.eta(), Some(Duration::ZERO));
        assert_eq!(Percent(5, None).to_string(), "unknown");
        assert_eq!(Estimate(Some(7)).to_string(), "~7");
    }

    /// The one test that reads the process-wide gauges (tests run in parallel).
    #[tokio::test(start_paused = true)]
    async fn the_gauges_follow_the_phases() {
        let g = gauges();
        let phase = |p: Phase| g.phase.get_or_create(&label(p)).get();
        assert_eq!(summary(), None, "no phase runs");
        let mut p = Progress::relay(Phase::Snapshot, "public.outbox", Some(400));
        assert_eq!((phase(Phase::Snapshot), phase(Phase::Replay)), (1, 0));
        assert_eq!(g.rows_estimated.get(), 400);
        advance(secs(11)).await;
        p.add(100);
        assert_eq!(g.rows_done.get(), 100);
        assert_eq!(p.lines(), 1);
        // 100 rows in 11 s: 300 left at 9.09 rows/s.
        assert_eq!(g.eta_seconds.get(), 33);
        let s: serde_json::Value = serde_json::from_str(&summary().unwrap()).unwrap();
        assert_eq!(
            s,
            serde_json::json!({"phase": "snapshot", "table": "public.outbox", "rows_done": 100,
                               "rows_estimated": 400, "eta_s": 33})
        );
        assert_eq!(
            describe(&s),
            "snapshot of public.outbox: 100 of ~400 rows (25%), about 33 s left"
        );
        p.add(200);
        p.finish();
        assert_eq!(phase(Phase::Snapshot), 0);
        assert_eq!((g.rows_done.get(), g.rows_estimated.get()), (300, 300));
        assert_eq!(g.eta_seconds.get(), -1);

        // An error's early return (a drop) ends the phase too.
        let mut r = Progress::relay(Phase::Replay, "public.outbox", None);
        r.add(7);
        assert_eq!(phase(Phase::Replay), 1);
        drop(r);
        assert_eq!(phase(Phase::Replay), 0);
        assert_eq!(g.rows_done.get(), 7);

        // Catch-up: from 16 MiB behind to 1 MiB behind.
        let mut c = CatchUp::new("WAL");
        c.behind(CATCH_UP_FROM_BYTES - 1);
        assert!(!c.running(), "not far enough behind to report");
        c.behind(100 << 20);
        assert!(c.running());
        assert_eq!(phase(Phase::CatchUp), 1);
        assert_eq!(g.bytes_behind.get(), 100 << 20);
        advance(secs(10)).await;
        // 40 MiB closed in 10 s: 60 MiB left at 4 MiB/s.
        c.behind(60 << 20);
        assert_eq!(g.eta_seconds.get(), 15);
        let s: serde_json::Value = serde_json::from_str(&summary().unwrap()).unwrap();
        assert_eq!(
            s,
            serde_json::json!({"phase": "catch-up", "bytes_behind": 60 << 20, "eta_s": 15})
        );
        assert_eq!(
            describe(&s),
            "catch-up: 62914560 bytes behind the server, about 15 s left"
        );
        advance(secs(1)).await;
        c.behind(CAUGHT_UP_BYTES);
        assert!(!c.running());
        assert_eq!(phase(Phase::CatchUp), 0);
        assert_eq!(g.eta_seconds.get(), -1);
        assert_eq!(summary(), None);
    }
}
