//! Stored binlog positions the server's binlog no longer holds as they were read: a binlog
//! that started again (`RESET MASTER`), or another server behind the same address (a
//! failover). Running `RESET MASTER` on the shared MariaDB would break every other test, so the
//! tests stop a relay and then edit its stored position into what such a server would show
//! it: a file after the server's last one, a position past its file's end or inside an event,
//! a GTID state other than the server's at the position, one ahead of the server's binlog.
//! Each must stop the next start with exit 3, the problem and the fix, and publish nothing;
//! `--on-position-lost poll` must recover through the table instead.

use crate::common;

use common::*;
use mysql_async::prelude::Queryable;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

fn ids(relay: &Relay) -> HashSet<Uuid> {
    parse_lines(&relay.lines())
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

fn split(file: &str) -> (&str, u64) {
    let (base, n) = file.rsplit_once('.').unwrap();
    (base, n.parse().unwrap())
}

/// The server's binlog files, oldest first.
async fn server_files() -> Vec<String> {
    let mut admin = my_connect(None).await;
    let rows: Vec<mysql_async::Row> = admin.query("SHOW BINARY LOGS").await.unwrap();
    rows.iter()
        .map(|r| r.get::<String, _>(0).unwrap())
        .collect()
}

struct Case {
    db: MyDb,
    name: String,
    /// Published by the first run, before its position was stored.
    before: Vec<Uuid>,
    /// Written while the relay is stopped: only the table has them for the next start.
    while_stopped: Vec<Uuid>,
    /// The position the first run stored: (file, pos, gtid state).
    stored: (String, u64, Option<String>),
}

impl Case {
    fn args(&self, policy: &str, extra: &[&str]) -> Vec<String> {
        let mut a: Vec<String> = [
            "run",
            "--source",
            &self.db.dsn(),
            "--name",
            &self.name,
            "--commit-offsets",
            "--on-position-lost",
            policy,
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    }

    fn start(&self, policy: &str, extra: &[&str]) -> Relay {
        let a = self.args(policy, extra);
        Relay::start(&a.iter().map(String::as_str).collect::<Vec<_>>())
    }

    /// A relay runs, publishes a few rows and stops gracefully; more rows arrive while it is
    /// stopped.
    async fn new(prefix: &str, extra: &[&str]) -> Case {
        let db = MyDb::create(prefix).await;
        let name = unique("r");
        let mut case = Case {
            db,
            name,
            before: Vec::new(),
            while_stopped: Vec::new(),
            stored: (String::new(), 0, None),
        };
        let mut relay = case.start("fail", extra);
        wait_for("the binlog dump", T, || case.db.streaming()).await;
        let mut c = case.db.conn().await;
        case.before = my_write_events(&mut c, 2, 3, "before").await;
        wait_for("the rows before the stop", T, || {
            let got = ids(&relay);
            let all = case.before.iter().all(|i| got.contains(i));
            async move { all }
        })
        .await;
        relay.signal("TERM");
        assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
        case.while_stopped = my_write_events(&mut c, 2, 3, "while.stopped").await;
        // The next start must not meet the old dump thread (same server id).
        wait_for("the old dump thread to go", T, || async {
            !case.db.streaming().await
        })
        .await;
        if extra.is_empty() {
            case.stored = case.db.stored(&case.name).await.expect("a stored position");
        }
        case
    }

    /// Stores `file:pos` with `gtid` (NULL: a position without GTID state, resumed by file and
    /// position) in the state table, as a server whose binlog changed would leave it.
    async fn edit(&self, file: &str, pos: u64, gtid: Option<&str>) {
        let mut c = self.db.conn().await;
        c.exec_drop(
            "UPDATE outboxd_state SET binlog_file = ?, binlog_pos = ?, gtid_state = ? WHERE name = ?",
            (file, pos, gtid, &self.name),
        )
        .await
        .unwrap();
    }

    /// Starts with `fail` and expects exit 3, nothing published, the problem naming every
    /// `problem` needle and the fix for a binlog that started again.
    async fn expect_lost(&self, extra: &[&str], problem: &[&str]) -> String {
        let mut relay = self.start("fail", extra);
        let code = relay.wait_exit(T).await;
        let err = relay.stderr();
        assert_eq!(code, 3, "exit 3 = stored position lost; stderr:\n{err}");
        assert!(err.contains("stored position lost"), "{err}");
        for needle in problem {
            assert!(err.contains(needle), "the problem names {needle:?}: {err}");
        }
        for needle in [
            "fix:",
            "--on-position-lost poll",
            &format!("outboxd teardown --name {} --yes", self.name),
            "--snapshot since=",
            &format!(
                "outboxd offset set --name {} --binlog-position FILE:POS",
                self.name
            ),
        ] {
            assert!(err.contains(needle), "the fix names {needle:?}: {err}");
        }
        assert!(relay.lines().is_empty(), "nothing published");
        err
    }

    /// `--on-position-lost poll`: the rows written while stopped come from the table, the rows
    /// written after the start from the stream, and the stored position (in the state table or
    /// the offset file `extra` names) moves to the server's binlog.
    async fn expect_recovery(&self, extra: &[&str]) {
        let mut relay = self.start("poll", extra);
        relay
            .wait_running("the binlog dump after recovery", T, || self.db.streaming())
            .await;
        let mut c = self.db.conn().await;
        let after = my_write_events(&mut c, 1, 3, "after").await;
        let expected: Vec<Uuid> = self.while_stopped.iter().chain(&after).copied().collect();
        wait_for("every row written while stopped, and after", T, || {
            let got = ids(&relay);
            let all = expected.iter().all(|i| got.contains(i));
            async move { all }
        })
        .await;
        let err = relay.stderr_plain();
        assert!(
            err.contains("POSITION LOST") && err.contains("replay_since"),
            "said loudly: {err}"
        );
        let files = server_files().await;
        wait_for("a stored position in a file the server has", T, || async {
            self.stored_file(extra)
                .await
                .is_some_and(|f| files.contains(&f))
        })
        .await;
    }

    /// The binlog file of the stored position: in the offset file `extra` names, else in
    /// `outboxd_state`.
    async fn stored_file(&self, extra: &[&str]) -> Option<String> {
        match extra.iter().position(|a| *a == "--offset-file") {
            Some(i) => {
                let stored: serde_json::Value =
                    serde_json::from_slice(&std::fs::read(extra[i + 1]).ok()?).ok()?;
                stored["binlog_file"].as_str().map(str::to_string)
            }
            None => self.db.stored(&self.name).await.map(|(f, _, _)| f),
        }
    }
}

/// Case (a): the stored file comes after the server's last one — after `RESET MASTER` the
/// server has only `…000001`, after a failover another server's lower numbers. By GTID and by
/// position alike; then `poll` recovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_file_after_the_servers_last_is_lost_and_poll_recovers() {
    let case = Case::new("my_lost_a", &[]).await;
    let files = server_files().await;
    let (base, last) = split(files.last().unwrap());
    let gone = format!("{base}.{:06}", last + 5);
    let (_, pos, gtid) = case.stored.clone();
    assert!(gtid.is_some(), "MariaDB stores the GTID state");
    for g in [gtid.as_deref(), None] {
        case.edit(&gone, pos, g).await;
        let err = case
            .expect_lost(
                &[],
                &[
                    &format!("{gone:?}"),
                    &format!("from {}", files[0]),
                    "is not on the server",
                    "RESET MASTER",
                ],
            )
            .await;
        // The server's last file is named too (it may have rotated since the list was read).
        assert!(err.contains(&format!(" to {base}.")), "{err}");
    }
    case.expect_recovery(&[]).await;
}

/// Case (b): the stored file exists but the position is past its end, or past the server's
/// current position in it (a file of the same name created again, shorter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_position_past_its_files_end_is_lost_and_poll_recovers() {
    let case = Case::new("my_lost_b", &[]).await;
    let (head_file, _) = my_head().await;
    let (_, _, gtid) = case.stored.clone();
    // No binlog file grows to 4 GB (max_binlog_size is at most 1 GB), so this stays past the
    // end whatever the other tests write meanwhile.
    let far = 4_000_000_000u64;
    for g in [gtid.as_deref(), None] {
        case.edit(&head_file, far, g).await;
        case.expect_lost(&[], &[&format!("{head_file}:{far}"), "past the"])
            .await;
    }
    case.expect_recovery(&[]).await;
}

/// Case (c), what a size check cannot see: the file exists and is longer than the position,
/// but no event starts there, or the GTID state the server computes there is not the one the
/// relay read (a file created again, now longer), or the relay has read GTIDs the server's
/// binlog never had (an older history: `RESET MASTER`, a failover to a lagging server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_created_again_is_told_by_the_gtid_state_and_event_boundaries() {
    let case = Case::new("my_lost_c", &[]).await;
    let (file, pos, gtid) = case.stored.clone();
    let gtid = gtid.expect("MariaDB stores the GTID state");

    // Inside an event (the stored position is the end of a transaction; one byte before it is
    // inside its commit event): by position and by GTID.
    for g in [None, Some(gtid.as_str())] {
        case.edit(&file, pos - 1, g).await;
        case.expect_lost(
            &[],
            &[&format!("{file}:{}", pos - 1), "no binlog event starts"],
        )
        .await;
    }

    // An event boundary with another GTID state before it than the relay read.
    let mut c = case.db.conn().await;
    let first_boundary = my_value(&mut c, &format!("SELECT BINLOG_GTID_POS('{file}', 4)"))
        .await
        .unwrap_or_default();
    assert_ne!(
        first_boundary, gtid,
        "the file's start is before the stored position"
    );
    case.edit(&file, 4, Some(&gtid)).await;
    case.expect_lost(&[], &["the server's GTID state at", &format!("{gtid:?}")])
        .await;

    // GTIDs the server never wrote: every domain 1000000 transactions ahead of what the relay
    // read (a failover to a server that had not received them, or a binlog started again).
    let ahead: Vec<String> = gtid
        .split(',')
        .map(|g| {
            let (prefix, seq) = g.rsplit_once('-').unwrap();
            format!("{prefix}-{}", seq.parse::<u64>().unwrap() + 1_000_000)
        })
        .collect();
    let ahead = ahead.join(",");
    case.edit(&file, pos, Some(&ahead)).await;
    case.expect_lost(&[], &["has read GTID", "history is older than the relay's"])
        .await;
    case.expect_recovery(&[]).await;
}

/// The same check for a position kept in `--offset-file` (exit 3, the problem and the fix), and
/// `poll` recovering it without the state table an offset-file setup does not have.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offset_file_position_the_server_does_not_have_is_lost() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("offsets.json");
    let p = path.to_str().unwrap().to_string();
    let case = Case::new("my_lost_file", &["--offset-file", &p]).await;
    let mut stored: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let files = server_files().await;
    let (base, last) = split(files.last().unwrap());
    let gone = format!("{base}.{:06}", last + 5);
    stored["binlog_file"] = serde_json::json!(gone);
    std::fs::write(&path, serde_json::to_vec_pretty(&stored).unwrap()).unwrap();
    case.expect_lost(
        &["--offset-file", &p],
        &[&format!("{gone:?}"), "is not on the server"],
    )
    .await;
    // `--on-position-lost poll` recovers with what the offset file holds: an offset-file
    // setup has no `outboxd_state`, and the recovery neither needs nor creates one.
    case.expect_recovery(&["--offset-file", &p]).await;
    let mut c = case.db.conn().await;
    let tables = my_value(
        &mut c,
        "SELECT COUNT(*) FROM information_schema.TABLES
          WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'outboxd_state'",
    )
    .await;
    assert_eq!(tables.as_deref(), Some("0"), "no outboxd_state table");
}
