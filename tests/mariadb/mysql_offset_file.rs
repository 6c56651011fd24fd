//! MariaDB relays with the position kept in a file (`--offset-file`): resume without
//! duplicates, a corrupt file is a configuration error with the fix, a second relay on the
//! same file is refused; Postgres refuses the flag (its position is the slot's). High
//! availability on both sources is in `tests/relay/ha.rs`.

use crate::common;

use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_offset_file_resumes_without_duplicates_and_refuses_a_second_relay() {
    let db = MyDb::create("my_offfile").await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relay.offset");
    let file_s = file.to_str().unwrap().to_string();
    let name = unique("r");
    let dsn = db.dsn();
    let args = [
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--commit-offsets",
        "--offset-file",
        &file_s,
    ];
    let mut first = Relay::start(&args);
    wait_for("streaming", T, || db.streaming()).await;

    // A second relay on the same file is refused while the first runs.
    let mut second = Relay::start(&args);
    assert_eq!(second.wait_exit(T).await, 1, "{}", second.stderr());
    assert!(
        second.stderr().contains("is in use by another relay"),
        "{}",
        second.stderr()
    );

    let mut c = db.conn().await;
    let before = my_write_events(&mut c, 10, 10, "file.before").await;
    wait_lines("first batch", &first, 100, T).await;
    let head = my_head().await;
    first.signal("TERM");
    assert_eq!(first.wait_exit(T).await, 0, "{}", first.stderr());
    let stored: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    let at = (
        stored["binlog_file"].as_str().unwrap().to_string(),
        stored["binlog_pos"].as_u64().unwrap(),
    );
    assert!(
        binlog_ge(&at, &head),
        "the file holds the final position {at:?} (head after the batch: {head:?})"
    );
    assert_eq!(stored["initialized"], true);
    assert_eq!(
        db.stored(&name).await,
        None,
        "nothing was written to outboxd_state"
    );

    let after = my_write_events(&mut c, 10, 10, "file.after").await;
    let second = Relay::start(&args);
    wait_lines("second batch", &second, 100, T).await;
    let got = printed_ids(&second);
    let before: std::collections::HashSet<uuid::Uuid> = before.into_iter().collect();
    assert!(
        got.iter().all(|i| !before.contains(i)),
        "the restart published nothing twice"
    );
    assert_eq!(got, after, "every later event once, in commit order");
    drop(second);

    // A corrupt file: a configuration error naming the fix, nothing published.
    std::fs::write(&file, b"{\"version\": 1, \"name\": ").unwrap();
    let mut bad = Relay::start(&args);
    assert_eq!(bad.wait_exit(T).await, 2, "{}", bad.stderr());
    let err = bad.stderr();
    assert!(err.contains("is not an outboxd offset file"), "{err}");
    assert!(
        err.contains("offset set --offset-file"),
        "the fix is named: {err}"
    );
    assert_eq!(bad.line_count(), 0);

    // The fix works: the position set by hand is where the next start resumes.
    let mark = my_head().await;
    let set = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args([
            "offset",
            "set",
            "--source",
            &dsn,
            "--name",
            &name,
            "--offset-file",
            &file_s,
            "--binlog-position",
            &format!("{}:{}", mark.0, mark.1),
        ])
        .output()
        .unwrap();
    assert!(
        set.status.success(),
        "{}",
        String::from_utf8_lossy(&set.stderr)
    );
    let last = my_write_events(&mut c, 1, 5, "file.last").await;
    let third = Relay::start(&args);
    wait_lines("third batch", &third, 5, T).await;
    assert_eq!(printed_ids(&third), last);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn offset_file_is_refused_for_postgres() {
    let mut r = Relay::start(&[
        "run",
        "--source",
        "postgres://postgres@127.0.0.1:5432/test",
        "--offset-file",
        "/tmp/outboxd-never.offset",
    ]);
    assert_eq!(r.wait_exit(T).await, 2, "{}", r.stderr());
    assert!(r.stderr().contains("replication slot"), "{}", r.stderr());
}
