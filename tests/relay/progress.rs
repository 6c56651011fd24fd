//! Long work says how far it got: a first start's snapshot logs progress lines (counts that
//! only grow, an estimated total, a rate and the time left) and a final count equal to the
//! rows, and the `outboxd_progress_*` gauges on `/metrics` say the same as the log.

use crate::common;

use common::source_db::{on_both_sources, SourceDb};
use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);
const ROWS: usize = 10_000;

/// The JSON log lines of target `outboxd::progress` whose message starts with `prefix`: their
/// `fields` objects.
fn progress_lines(stderr: &str, prefix: &str) -> Vec<serde_json::Value> {
    stderr
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["target"] == "outboxd::progress")
        .map(|v| v["fields"].clone())
        .filter(|f| f["message"].as_str().is_some_and(|m| m.starts_with(prefix)))
        .collect()
}

async fn a_snapshot_logs_its_progress_and_the_metrics_agree<D: SourceDb>() {
    let db = D::create("progress").await;
    let expected = db.write(10, ROWS / 10, "progress.snap").await;
    assert_eq!(expected.len(), ROWS);
    let name = unique("r");
    let port = free_local_port();
    let addr = format!("127.0.0.1:{port}");
    let dsn = db.dsn();
    let mut relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--snapshot",
        "all",
        "--log-format",
        "json",
        "--progress-interval",
        "50ms",
        "--metrics-addr",
        &addr,
    ]);
    wait_for("the snapshot's last line", T, || {
        let done = !progress_lines(&relay.stderr(), "snapshot finished").is_empty();
        async move { done }
    })
    .await;
    let stderr = relay.stderr();

    let started = progress_lines(&stderr, "snapshot started");
    assert_eq!(started.len(), 1, "{stderr}");
    assert!(
        started[0]["estimated_total"]
            .as_str()
            .is_some_and(|e| e.starts_with('~')),
        "the total is said as an estimate: {}",
        started[0]
    );
    let lines = progress_lines(&stderr, "snapshot progress");
    assert!(
        lines.len() >= 2,
        "at least two progress lines while {ROWS} rows are read: {lines:?}"
    );
    assert!(
        lines.len() <= 200,
        "a line per interval or tenth, not per row: {} lines",
        lines.len()
    );
    let counts: Vec<u64> = lines.iter().map(|l| l["done"].as_u64().unwrap()).collect();
    assert!(
        counts.windows(2).all(|w| w[0] < w[1]),
        "counts only grow: {counts:?}"
    );
    assert!(
        counts.iter().all(|&c| c > 0 && c <= ROWS as u64),
        "{counts:?}"
    );
    for l in &lines {
        for field in ["estimated_total", "percent", "rate_per_s", "eta_s"] {
            assert!(!l[field].is_null(), "{field} missing from {l}");
        }
    }
    let finished = progress_lines(&stderr, "snapshot finished");
    assert_eq!(finished.len(), 1);
    assert_eq!(finished[0]["done"].as_u64(), Some(ROWS as u64));

    // The gauges say what the log says: every row done, the estimate now the count, the phase
    // over.
    let body = scrape_metrics(port).await;
    assert_eq!(
        metric_value(&body, "outboxd_progress_rows_done"),
        Some(ROWS as f64),
        "{body}"
    );
    assert_eq!(
        metric_value(&body, "outboxd_progress_rows_estimated"),
        Some(ROWS as f64)
    );
    assert_eq!(
        metric_value(&body, "outboxd_progress_phase{phase=\"snapshot\"}"),
        Some(0.0)
    );
    assert_eq!(
        metric_value(&body, "outboxd_progress_eta_seconds"),
        Some(-1.0)
    );

    wait_all_printed(&[&relay], &expected, T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0);
}

on_both_sources!(a_snapshot_logs_its_progress_and_the_metrics_agree);
