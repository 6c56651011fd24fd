//! What a fleet knows of each of its sources — starting, standby, running, failing (with the
//! reason and when it is retried), a file it could not read, owned by another fleet process —
//! with the counts of its runs; served as `/status` (JSON, read by `outboxd fleet status`),
//! as per-source series on `/metrics`, and as the fleet's readiness.

use crate::telemetry::live::{Live, Phase};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Where a source is, beside what its live run says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// A run is under way (its [`Live`] says whether it starts, waits or publishes).
    Run,
    /// The last run failed; the next starts at `retry_at`.
    Failing {
        reason: String,
        retry_at: SystemTime,
    },
    /// The file could not be read into a run (nothing runs; fixing the file starts it).
    Invalid,
    /// Another fleet process owns it (its fair share; this one stands by).
    Elsewhere,
    /// Stopped (the fleet is stopping).
    Stopped,
}

/// One source as the fleet sees it.
#[derive(Debug, Clone)]
struct Source {
    state: State,
    live: Option<Arc<Live>>,
    /// The file's last problem (set while the file does not load; a run of the previous
    /// version may go on meanwhile).
    config_error: Option<String>,
    /// Runs started since the fleet started (restarts after failures and reloads).
    runs: u64,
    /// What earlier runs published and had confirmed (the live run's counts add to them).
    published_before: u64,
    confirmed_before: u64,
    server: Option<String>,
}

impl Source {
    fn new() -> Self {
        Source {
            state: State::Stopped,
            live: None,
            config_error: None,
            runs: 0,
            published_before: 0,
            confirmed_before: 0,
            server: None,
        }
    }

    /// The state's one-word name.
    fn word(&self) -> &'static str {
        match &self.state {
            State::Run => match self.live.as_ref().map(|l| l.phase()) {
                Some(Phase::Running) => "running",
                Some(Phase::Standby) => "standby",
                _ => "starting",
            },
            State::Failing { .. } => "failing",
            State::Invalid => "invalid",
            State::Elsewhere => "elsewhere",
            State::Stopped => "stopped",
        }
    }

    fn counts(&self) -> (u64, u64, Option<String>) {
        let live = self.live.as_ref().and_then(|l| l.counts());
        (
            self.published_before + live.as_ref().map_or(0, |c| c.published()),
            self.confirmed_before + live.as_ref().map_or(0, |c| c.confirmed()),
            live.and_then(|c| c.position()),
        )
    }

    /// Folds the ended run's counts into the totals.
    fn end_run(&mut self) {
        if let Some(c) = self.live.take().and_then(|l| l.counts()) {
            self.published_before += c.published();
            self.confirmed_before += c.confirmed();
        }
    }
}

/// Every source of one fleet process.
#[derive(Debug, Default)]
pub struct Status {
    sources: Mutex<BTreeMap<String, Source>>,
    /// The first scan of the directory is done.
    scanned: AtomicBool,
}

/// The states all sources are in, for tests and `outboxd fleet status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub name: String,
    /// running, standby, starting, failing, invalid, elsewhere, stopped.
    pub state: &'static str,
    pub reason: Option<String>,
    pub published: u64,
    pub confirmed: u64,
    pub position: Option<String>,
    pub runs: u64,
}

impl Status {
    fn with<R>(&self, name: &str, f: impl FnOnce(&mut Source) -> R) -> R {
        let mut all = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        f(all.entry(name.to_string()).or_insert_with(Source::new))
    }

    pub(super) fn scanned(&self) {
        self.scanned.store(true, Ordering::Relaxed);
    }

    /// A run of `name` starts, reporting to `live`.
    pub(super) fn run_started(&self, name: &str, live: Arc<Live>, server: Option<String>) {
        self.with(name, |s| {
            s.end_run();
            s.state = State::Run;
            s.live = Some(live);
            s.runs += 1;
            s.server = server;
        });
    }

    /// The run of `name` failed with `reason`; the next is in `retry_in`.
    pub(super) fn failing(&self, name: &str, reason: String, retry_in: Duration) {
        self.with(name, |s| {
            s.end_run();
            s.state = State::Failing {
                reason,
                retry_at: SystemTime::now() + retry_in,
            };
        });
    }

    pub(super) fn stopped(&self, name: &str, state: State) {
        self.with(name, |s| {
            s.end_run();
            s.state = state;
        });
    }

    /// The task of `name` ended (its source stopped, removed or owned elsewhere): a source
    /// still listed says it stopped; a removed one stays gone.
    pub(super) fn ended(&self, name: &str) {
        let mut all = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = all.get_mut(name) {
            s.end_run();
            if matches!(s.state, State::Run | State::Failing { .. }) {
                s.state = State::Stopped;
            }
        }
    }

    /// The file of `name` does not load (`None`: it does again).
    pub(super) fn config_error(&self, name: &str, error: Option<String>) {
        self.with(name, |s| {
            if error.is_some() && s.state == State::Stopped {
                s.state = State::Invalid;
            }
            s.config_error = error;
        });
    }

    /// `name` is gone from the directory.
    pub(super) fn remove(&self, name: &str) {
        let mut all = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        all.remove(name);
    }

    /// Every source, by name.
    pub fn rows(&self) -> Vec<Row> {
        let all = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        all.iter()
            .map(|(name, s)| {
                let (published, confirmed, position) = s.counts();
                let reason = match &s.state {
                    State::Failing { reason, .. } => Some(reason.clone()),
                    State::Run => s
                        .live
                        .as_ref()
                        .and_then(|l| l.holder())
                        .map(|h| format!("lease held by {h}")),
                    _ => None,
                }
                .or_else(|| s.config_error.clone());
                Row {
                    name: name.clone(),
                    state: s.word(),
                    reason,
                    published,
                    confirmed,
                    position,
                    runs: s.runs,
                }
            })
            .collect()
    }

    /// The state of `name` (`None`: not a source of this fleet).
    pub fn state_of(&self, name: &str) -> Option<Row> {
        self.rows().into_iter().find(|r| r.name == name)
    }
}

fn unix_ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).unwrap_or_default().as_millis() as u64
}

impl crate::telemetry::FleetView for Status {
    fn status_json(&self) -> String {
        let all = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let sources: Vec<_> = all
            .iter()
            .map(|(name, s)| {
                let (published, confirmed, position) = s.counts();
                let mut v = json!({
                    "name": name,
                    "state": s.word(),
                    "published": published,
                    "confirmed": confirmed,
                    "position": position,
                    "runs": s.runs,
                    "server": s.server,
                });
                if let State::Failing { reason, retry_at } = &s.state {
                    v["reason"] = json!(reason);
                    v["retry_at_ms"] = json!(unix_ms(*retry_at));
                }
                if let Some(h) = s.live.as_ref().and_then(|l| l.holder()) {
                    v["lease_holder"] = json!(h);
                }
                if let Some(e) = &s.config_error {
                    v["config_error"] = json!(e);
                }
                v
            })
            .collect();
        let mut text = json!({ "sources": sources }).to_string();
        text.push('\n');
        text
    }

    fn metrics(&self) -> String {
        use std::fmt::Write;
        let all = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::new();
        out.push_str("# HELP outboxd_fleet_source_state 1 for the state each source of the fleet is in (running, standby, starting, failing, invalid, elsewhere, stopped).\n# TYPE outboxd_fleet_source_state gauge\n");
        for (name, s) in all.iter() {
            let _ = writeln!(
                out,
                "outboxd_fleet_source_state{{source=\"{name}\",state=\"{}\"}} 1",
                s.word()
            );
        }
        let counts: Vec<_> = all.iter().map(|(n, s)| (n, s.counts())).collect();
        for (family, help, pick) in [
            (
                "outboxd_fleet_source_events_published",
                "Events each source handed to its sink (since the fleet started).",
                0,
            ),
            (
                "outboxd_fleet_source_events_confirmed",
                "Events each source's sink confirmed (since the fleet started).",
                1,
            ),
        ] {
            let _ = writeln!(out, "# HELP {family} {help}\n# TYPE {family} counter");
            for (name, (p, c, _)) in &counts {
                let v = if pick == 0 { p } else { c };
                let _ = writeln!(out, "{family}_total{{source=\"{name}\"}} {v}");
            }
        }
        out
    }

    fn not_ready(&self) -> Option<String> {
        if !self.scanned.load(Ordering::Relaxed) {
            return Some("starting".into());
        }
        let all = self.sources.lock().unwrap_or_else(|p| p.into_inner());
        let failing: Vec<&str> = all
            .iter()
            .filter(|(_, s)| matches!(s.state, State::Failing { .. } | State::Invalid))
            .map(|(n, _)| n.as_str())
            .collect();
        if failing.is_empty() {
            None
        } else {
            Some(format!(
                "{} source(s) failing: {}",
                failing.len(),
                failing.join(", ")
            ))
        }
    }
}
