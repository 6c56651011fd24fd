//! The README's two-minute tour does what it says, run against the local Postgres: `check`
//! after `setup` exits 0, the tour's INSERT prints the line the README shows (its varying
//! parts — id, time, position — aside), and its `teardown` leaves no slot behind.

use crate::common::source_db::SourceDb;
use crate::common::*;
use std::process::Command;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

/// A stdout line, byte for byte, with its varying values replaced: `"id":"…"` and so on.
fn shape(line: &str) -> String {
    let mut out = line.to_string();
    for k in ["id", "created_at", "position"] {
        let key = format!("\"{k}\":\"");
        if let Some(start) = out.find(&key).map(|i| i + key.len()) {
            if let Some(len) = out[start..].find('"') {
                out.replace_range(start..start + len, "…");
            }
        }
    }
    out
}

fn outboxd(args: &[&str], dsn: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(args)
        .env("OUTBOXD_SOURCE", dsn)
        .output()
        .expect("run outboxd")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readme_tour_prints_what_it_says_and_cleans_up() {
    let readme = readme();
    let tour = readme
        .split("## A two-minute tour")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("the tour");
    // The INSERT the tour runs (psql -c "…", shell-unescaped) and the line it says comes out.
    let insert = tour
        .split("shop -c \"")
        .nth(1)
        .and_then(|s| s.split(")\"\n").next())
        .map(|s| format!("{s})"))
        .expect("the tour's psql -c INSERT")
        .replace("\\\"", "\"");
    let shown = tour
        .lines()
        .find_map(|l| l.strip_prefix("# → "))
        .expect("the tour's expected stdout line");
    assert!(
        tour.contains("outboxd teardown --name shop --yes"),
        "the tour tears down"
    );

    let db = PgDb::create("tour").await;
    let name = unique("tour");
    let dsn = db.dsn();
    let setup = outboxd(&["setup", "--name", &name], &dsn);
    assert!(setup.status.success(), "{setup:?}");
    let check = outboxd(&["check", "--name", &name], &dsn);
    assert!(
        check.status.success(),
        "check after setup exits 0: {check:?}"
    );

    let mut relay = Relay::start_with_env(
        &["run", "--name", &name, "--commit-offsets"],
        &[("OUTBOXD_SOURCE", &dsn)],
    );
    db.wait_streaming(&name).await;
    db.client().await.batch_execute(&insert).await.unwrap();
    wait_lines("the tour's event", &relay, 1, T).await;
    assert_eq!(
        shape(&relay.lines()[0]),
        shape(shown),
        "README's line: {shown}"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0);

    let teardown = outboxd(&["teardown", "--name", &name, "--yes"], &dsn);
    assert!(teardown.status.success(), "{teardown:?}");
    assert!(
        db.slot_confirmed(&format!("outboxd_{name}"))
            .await
            .is_none(),
        "teardown dropped the slot"
    );
}
