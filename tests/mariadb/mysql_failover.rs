//! A MariaDB primary failover under a running relay, on private servers: a primary and a GTID
//! replica (`log_slave_updates`), each a `mariadbd` of the Debian package with its own data
//! directory and port on 127.0.0.1, started by `scripts/services/mariadb-private.sh` (never the
//! shared server on 3306; a start costs about half a second, so every test has its own pair and
//! no test depends on another's topology). A producer writes 1–5 rows per transaction, the
//! primary is SIGKILLed, the replica promoted and the relay started against it. Asserted: every
//! event on the promoted replica published, none that it lacks (with `--sync-replica`), and the
//! path the relay took; the figures (events, duplicates) are printed with `--nocapture`.

use crate::common;
use common::*;
use mysql_async::prelude::Queryable;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(90);

fn script(args: &[&str], extra: &str) {
    let out = Command::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/scripts/services/mariadb-private.sh"
    ))
    .args(args)
    .env("OUTBOXD_MARIADB_EXTRA", extra)
    .output()
    .expect("run scripts/services/mariadb-private.sh");
    assert!(
        out.status.success(),
        "scripts/services/mariadb-private.sh {args:?} failed (it needs root and the mariadb-server package): {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A private MariaDB server; stopped and its directory removed when dropped (and by the
/// script's watchdog when the test binary dies).
struct Maria {
    dir: String,
    port: u16,
}

impl Maria {
    fn start(base: &str, id: u32, extra: &str) -> Maria {
        let m = Maria {
            dir: format!("{base}/s{id}"),
            port: free_local_port(),
        };
        script(
            &[
                "start",
                &m.dir,
                &m.port.to_string(),
                &id.to_string(),
                &std::process::id().to_string(),
            ],
            extra,
        );
        m
    }

    fn kill(&self) {
        script(&["kill", &self.dir], "");
    }

    fn dsn(&self, db: &str) -> String {
        format!("mariadb://root@127.0.0.1:{}/{db}", self.port)
    }

    async fn conn(&self, db: Option<&str>) -> mysql_async::Conn {
        let opts = mysql_async::OptsBuilder::default()
            .ip_or_hostname("127.0.0.1")
            .tcp_port(self.port)
            .user(Some("root"))
            .db_name(db)
            .prefer_socket(false);
        mysql_async::Conn::new(opts)
            .await
            .unwrap_or_else(|e| panic!("private MariaDB on {}: {e}", self.port))
    }

    async fn exec(&self, sql: &str) {
        my_exec(&mut self.conn(None).await, sql).await
    }

    async fn value(&self, sql: &str) -> Option<String> {
        my_value(&mut self.conn(None).await, sql).await
    }

    async fn ids(&self, db: &str) -> std::collections::HashSet<uuid::Uuid> {
        let rows: Vec<Vec<u8>> = self
            .conn(Some(db))
            .await
            .query("SELECT id FROM outbox")
            .await
            .unwrap();
        rows.iter()
            .map(|b| uuid::Uuid::from_slice(b).unwrap())
            .collect()
    }

    /// Replicates from `primary` by GTID and waits until both threads run.
    async fn replicate(&self, primary: &Maria) {
        self.exec(&format!(
            "CHANGE MASTER TO MASTER_HOST='127.0.0.1', MASTER_PORT={}, MASTER_USER='root', MASTER_USE_GTID=slave_pos, MASTER_CONNECT_RETRY=1; START SLAVE",
            primary.port
        ))
        .await;
        wait_for("the replica's threads running", T, || async {
            let row: Option<mysql_async::Row> = self
                .conn(None)
                .await
                .query_first("SHOW SLAVE STATUS")
                .await
                .unwrap();
            row.is_some_and(|r| {
                r.get::<String, _>("Slave_IO_Running").as_deref() == Some("Yes")
                    && r.get::<String, _>("Slave_SQL_Running").as_deref() == Some("Yes")
            })
        })
        .await;
    }

    /// Waits until this replica has applied everything `primary` has logged.
    async fn caught_up(&self, primary: &Maria) {
        let pos = primary
            .value("SELECT @@gtid_binlog_pos")
            .await
            .unwrap_or_default();
        let r = self
            .value(&format!("SELECT MASTER_GTID_WAIT('{pos}', 60)"))
            .await;
        assert_eq!(r.as_deref(), Some("0"), "the replica did not reach {pos}");
    }

    /// Promotes this replica after its primary died: applies what it received, stops
    /// replicating and takes writes.
    async fn promote(&self) {
        wait_for("the replica applied everything it received", T, || async {
            let row: Option<mysql_async::Row> = self
                .conn(None)
                .await
                .query_first("SHOW SLAVE STATUS")
                .await
                .unwrap();
            let io: String = row.and_then(|r| r.get("Gtid_IO_Pos")).unwrap_or_default();
            let applied = self
                .value("SELECT @@gtid_slave_pos")
                .await
                .unwrap_or_default();
            io == applied
        })
        .await;
        self.exec("STOP SLAVE; RESET SLAVE ALL; SET GLOBAL read_only = OFF")
            .await;
    }
}

impl Drop for Maria {
    fn drop(&mut self) {
        let _ = Command::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/scripts/services/mariadb-private.sh"
        ))
        .args(["stop", &self.dir])
        .output();
    }
}

/// A primary and its replica, a database with the outbox table on both.
struct Pair {
    primary: Maria,
    replica: Maria,
    db: String,
    _base: TempDir,
}

struct TempDir(String);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

impl Pair {
    async fn new(replica_extra: &str) -> Pair {
        let base = format!("/tmp/outboxd-myfailover-{}", unique("t"));
        let primary = Maria::start(&base, 1, "");
        let replica = Maria::start(&base, 2, replica_extra);
        replica.replicate(&primary).await;
        let db = unique("fo");
        primary.exec(&format!("CREATE DATABASE `{db}`")).await;
        my_exec(&mut primary.conn(Some(&db)).await, MY_OUTBOX_DDL).await;
        replica.caught_up(&primary).await;
        Pair {
            primary,
            replica,
            db,
            _base: TempDir(base),
        }
    }
}

/// Transactions of 1–5 rows on `conn` until `stop` or the first error; the ids of the
/// transactions whose COMMIT returned.
fn producer(
    mut conn: mysql_async::Conn,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Vec<uuid::Uuid>> {
    tokio::spawn(async move {
        let outbox = outboxd::Outbox::new("outbox").unwrap();
        let mut ids = Vec::new();
        let mut t = 0usize;
        'txn: while !stop.load(Ordering::SeqCst) {
            let Ok(mut tx) = conn.start_transaction(Default::default()).await else {
                break;
            };
            let mut these = Vec::new();
            for i in 0..(1 + t % 5) {
                let Ok(id) = outbox
                    .write(
                        &mut tx,
                        "failover",
                        &format!("{}", (t + i) % 31),
                        &serde_json::json!({ "t": t, "i": i }),
                    )
                    .await
                else {
                    break 'txn;
                };
                these.push(id);
            }
            if tx.commit().await.is_err() {
                break;
            }
            ids.extend(these);
            t += 1;
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        ids
    })
}

fn run_relay(dsn: &str, name: &str, extra: &[&str]) -> Relay {
    let mut args = vec!["run", "--source", dsn, "--name", name, "--commit-offsets"];
    args.extend_from_slice(extra);
    Relay::start(&args)
}

/// What one failover scenario does before the primary dies.
#[derive(Clone, Copy)]
struct Scenario {
    /// The relay waits for the replica (`--sync-replica`).
    sync: bool,
    /// The relay is SIGKILLed just before the primary.
    kill_relay_first: bool,
    /// The replica stops receiving 1.5 s before the primary dies (it lags).
    lag: bool,
}

/// The figures of one failover.
struct Outcome {
    /// Events the promoted replica has (and must all be published).
    on_replica: usize,
    published: Vec<uuid::Uuid>,
    /// Published events the promoted replica does not have.
    phantom: usize,
    committed: usize,
}

async fn failover(s: Scenario) -> Outcome {
    let pair = Pair::new("").await;
    let (primary, replica, db) = (&pair.primary, &pair.replica, &pair.db);
    let name = unique("r");
    let replica_dsn = replica.dsn(db);
    let sync_args: Vec<&str> = if s.sync {
        vec!["--sync-replica", &replica_dsn]
    } else {
        vec![]
    };
    let mut first = run_relay(&primary.dsn(db), &name, &sync_args);
    let stop = Arc::new(AtomicBool::new(false));
    let writer = producer(primary.conn(Some(db)).await, stop.clone());
    wait_lines("300 events published before the failover", &first, 300, T).await;
    if s.sync && !s.lag && !s.kill_relay_first {
        // `check` says whether the relay waits for the replica, and what the replica applied.
        let check = |with: bool| {
            let primary_dsn = primary.dsn(db);
            let replica_dsn = replica_dsn.clone();
            let name = name.clone();
            async move {
                let mut args = vec!["check", "--source", &primary_dsn, "--name", &name];
                if with {
                    args.extend(["--sync-replica", &replica_dsn]);
                }
                let mut c = Relay::start(&args);
                c.wait_exit(T).await;
                c.lines().join("\n")
            }
        };
        let out = check(true).await;
        assert!(
            out.contains("ok   sync replica: 127.0.0.1:")
                && out.contains("replicates by GTID with log_slave_updates"),
            "{out}"
        );
        let out = check(false).await;
        assert!(
            out.contains("warn sync replicas: none named") && out.contains("1 replica(s)"),
            "{out}"
        );
        let mut status = Relay::start(&[
            "status",
            "--source",
            &primary.dsn(db),
            "--name",
            &name,
            "--sync-replica",
            &replica_dsn,
        ]);
        assert_eq!(status.wait_exit(T).await, 0, "{}", status.stderr());
        let out = status.lines().join("\n");
        assert!(
            out.contains("sync replica     127.0.0.1:") && out.contains("applied 0-1-"),
            "{out}"
        );
    }
    if s.lag {
        replica.exec("STOP SLAVE IO_THREAD").await;
        let lagged_at = primary.value("SELECT @@gtid_binlog_pos").await.unwrap();
        wait_for("the primary 1.5 s ahead of its replica", T, || async {
            primary.value("SELECT @@gtid_binlog_pos").await.unwrap() != lagged_at
        })
        .await;
        tokio::time::sleep(Duration::from_millis(1500)).await; // the length of the lag itself
    }
    let t0 = Instant::now();
    if s.kill_relay_first {
        first.sigkill();
    }
    primary.kill();
    stop.store(true, Ordering::SeqCst);
    let committed = writer.await.unwrap();
    if s.lag {
        // The fault: the primary had committed transactions the replica never received.
        let on_replica = replica.ids(db).await;
        assert!(
            committed.iter().any(|i| !on_replica.contains(i)),
            "the replica lacks no committed event: no lag was injected"
        );
        replica.exec("START SLAVE IO_THREAD").await;
    }
    replica.promote().await;
    if !s.kill_relay_first {
        first.sigkill(); // it retries the dead primary; its operator points it elsewhere
    }
    let before = printed_ids(&first);
    let on_replica = replica.ids(db).await;

    let second = run_relay(&replica_dsn, &name, &[]);
    let later = my_write_events(&mut replica.conn(Some(db)).await, 20, 5, "after.failover").await;
    let expected: Vec<uuid::Uuid> = on_replica.iter().copied().chain(later.clone()).collect();
    wait_all_printed(&[&first, &second], &expected, T).await;
    let after = printed_ids(&second);
    let published: Vec<uuid::Uuid> = before.iter().chain(&after).copied().collect();
    assert_none_lost(&expected, &published);
    let survivors = replica.ids(db).await;
    let phantom = published.iter().filter(|i| !survivors.contains(i)).count();
    eprintln!(
        "mariadb failover (sync {}, relay killed first {}, lag {}): {} committed, {} on the promoted replica, {} published before and {} after, {} duplicates, {} published that the new primary lacks, {:.1}s\n{}",
        s.sync,
        s.kill_relay_first,
        s.lag,
        committed.len(),
        on_replica.len(),
        before.len(),
        after.len(),
        dups(&published),
        phantom,
        t0.elapsed().as_secs_f64(),
        second.stderr_plain().lines().filter(|l| l.contains("resuming")).collect::<Vec<_>>().join("\n")
    );
    Outcome {
        on_replica: on_replica.len(),
        published,
        phantom,
        committed: committed.len(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_to_a_promoted_replica_publishes_everything_it_has_and_nothing_else() {
    let o = failover(Scenario {
        sync: true,
        kill_relay_first: false,
        lag: false,
    })
    .await;
    // A transaction whose COMMIT the killed primary never answered may be on the replica.
    assert!(o.on_replica >= 300 && o.committed >= 300);
    assert_eq!(o.phantom, 0, "published events the promoted replica lacks");
    assert!(!o.published.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_with_the_relay_killed_just_before() {
    let o = failover(Scenario {
        sync: true,
        kill_relay_first: true,
        lag: false,
    })
    .await;
    assert_eq!(o.phantom, 0, "published events the promoted replica lacks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_replica_with_sync_replica_publishes_nothing_it_lacks() {
    let o = failover(Scenario {
        sync: true,
        kill_relay_first: false,
        lag: true,
    })
    .await;
    assert_eq!(o.phantom, 0, "published events the promoted replica lacks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_replica_without_sync_replica_loses_published_events() {
    // What --sync-replica prevents: the relay publishes what the replica never receives.
    let o = failover(Scenario {
        sync: false,
        kill_relay_first: false,
        lag: true,
    })
    .await;
    assert!(
        o.phantom > 0,
        "without --sync-replica the relay published only what the lagging replica had"
    );
}

/// A planned switchover to a replica whose binlog file numbers are lower than the primary's
/// (the primary rotated its binlog, the replica did not): the stored position's file is not on
/// the new primary, but it holds the stored GTID state, so the relay resumes there by GTID,
/// stores its position in the new primary's coordinates and publishes nothing twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn switchover_to_lower_binlog_file_numbers_resumes_by_gtid() {
    let pair = Pair::new("").await;
    let (primary, replica, db) = (&pair.primary, &pair.replica, &pair.db);
    for _ in 0..4 {
        primary.exec("FLUSH LOCAL BINARY LOGS").await;
    }
    let name = unique("r");
    let mut first = run_relay(&primary.dsn(db), &name, &[]);
    let before_ids = my_write_events(&mut primary.conn(Some(db)).await, 60, 3, "before").await;
    wait_all_printed(&[&first], &before_ids, T).await;
    replica.caught_up(primary).await;
    first.signal("TERM");
    assert_eq!(first.wait_exit(T).await, 0, "{}", first.stderr());
    let stored: Option<(String, u64, Option<String>)> = replica
        .conn(Some(db))
        .await
        .exec_first(
            "SELECT binlog_file, binlog_pos, gtid_state FROM outboxd_state WHERE name = ?",
            (&name,),
        )
        .await
        .unwrap();
    let (stored_file, _, stored_gtid) = stored.expect("the state row replicated");
    assert_eq!(
        stored_file, "mariadb-bin.000005",
        "the primary's rotated binlog"
    );
    let replica_files: Vec<(String, u64)> = replica
        .conn(None)
        .await
        .query("SHOW BINARY LOGS")
        .await
        .unwrap();
    assert!(
        replica_files
            .iter()
            .all(|(f, _)| f.as_str() < "mariadb-bin.000005"),
        "the replica's binlog numbers are lower: {replica_files:?}"
    );
    // The switchover: the old primary stops taking writes, the replica takes over.
    primary.exec("SET GLOBAL read_only = ON").await;
    replica.promote().await;

    let mut check = Relay::start(&["check", "--source", &replica.dsn(db), "--name", &name]);
    check.wait_exit(T).await;
    let out = check.lines().join("\n");
    assert!(
        out.contains("ok   stored position") && out.contains("resumes by GTID"),
        "{out}"
    );
    assert!(
        out.contains(&format!("stored GTID state {}", stored_gtid.unwrap())),
        "{out}"
    );

    let second = run_relay(&replica.dsn(db), &name, &[]);
    second
        .wait_for_stderr(
            &["resuming by GTID on another binlog", "mariadb-bin.000001:"],
            T,
        )
        .await;
    let later = my_write_events(&mut replica.conn(Some(db)).await, 30, 3, "after").await;
    wait_all_printed(&[&second], &later, T).await;
    let after = printed_ids(&second);
    let republished = after.iter().filter(|i| before_ids.contains(i)).count();
    eprintln!(
        "mariadb switchover to lower binlog numbers: {} events before, {} after, {} published again\n{}",
        before_ids.len(),
        later.len(),
        republished,
        second.stderr_plain().lines().filter(|l| l.contains("GTID")).collect::<Vec<_>>().join("\n")
    );
    assert_eq!(
        republished, 0,
        "a GTID resume at the stored state repeats nothing"
    );
    wait_for(
        "the position stored in the new primary's coordinates",
        T,
        || async {
            let row: Option<(String, u64)> = replica
                .conn(Some(db))
                .await
                .exec_first(
                    "SELECT binlog_file, binlog_pos FROM outboxd_state WHERE name = ?",
                    (&name,),
                )
                .await
                .unwrap();
            let head: Option<mysql_async::Row> = replica
                .conn(None)
                .await
                .query_first("SHOW MASTER STATUS")
                .await
                .unwrap();
            let head_file: String = head.unwrap().get(0).unwrap();
            row.is_some_and(|(f, _)| f == head_file)
        },
    )
    .await;
}

/// A replica promoted without `log_slave_updates` has none of the old primary's transactions in
/// its binlog: a GTID resume there would skip or repeat an unknown stretch, so the relay stops
/// with exit 3 and the fix, never reading from somewhere else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_promoted_without_log_slave_updates_is_refused_with_the_fix() {
    let pair = Pair::new("log_slave_updates=OFF").await;
    let (primary, replica, db) = (&pair.primary, &pair.replica, &pair.db);
    let name = unique("r");
    let mut first = run_relay(&primary.dsn(db), &name, &[]);
    let ids = my_write_events(&mut primary.conn(Some(db)).await, 20, 3, "before").await;
    wait_all_printed(&[&first], &ids, T).await;
    replica.caught_up(primary).await;
    first.signal("TERM");
    assert_eq!(first.wait_exit(T).await, 0, "{}", first.stderr());
    primary.exec("SET GLOBAL read_only = ON").await;
    replica.promote().await;
    let mut second = run_relay(&replica.dsn(db), &name, &[]);
    assert_eq!(second.wait_exit(T).await, 3, "{}", second.stderr());
    let err = second.stderr_plain();
    assert!(
        err.contains("log_slave_updates")
            && err.contains("offset set")
            && err.contains("--on-position-lost poll"),
        "{err}"
    );
    assert_eq!(second.line_count(), 0, "nothing published");
}

/// Without `--sync-replica` a lagging replica lacks published events. With the position in an
/// offset file (outside the replicated database) the relay sees that its stored GTID state is
/// ahead of the promoted replica and stops with exit 3 instead of resuming; with the position
/// in the replicated `outboxd_state` table the row rolled back with the data, so the state it
/// finds is one the new primary holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_state_ahead_of_the_promoted_replica_is_refused() {
    let pair = Pair::new("").await;
    let (primary, replica, db) = (&pair.primary, &pair.replica, &pair.db);
    let dir = format!("/tmp/outboxd-offsets-{}", unique("o"));
    std::fs::create_dir_all(&dir).unwrap();
    let _dir = TempDir(dir.clone());
    let file = format!("{dir}/offsets.json");
    let name = unique("r");
    let mut first = run_relay(&primary.dsn(db), &name, &["--offset-file", &file]);
    let ids = my_write_events(&mut primary.conn(Some(db)).await, 20, 3, "before").await;
    wait_all_printed(&[&first], &ids, T).await;
    replica.caught_up(primary).await;
    replica.exec("STOP SLAVE IO_THREAD").await;
    let lost = my_write_events(&mut primary.conn(Some(db)).await, 20, 3, "lost").await;
    wait_all_printed(&[&first], &lost, T).await;
    first.signal("TERM");
    assert_eq!(first.wait_exit(T).await, 0, "{}", first.stderr());
    primary.kill();
    replica.exec("START SLAVE IO_THREAD").await;
    replica.promote().await;
    let on_replica = replica.ids(db).await;
    assert!(
        lost.iter().all(|i| !on_replica.contains(i)),
        "the fault: the promoted replica lacks the events published after it stopped receiving"
    );
    let mut second = run_relay(&replica.dsn(db), &name, &["--offset-file", &file]);
    assert_eq!(second.wait_exit(T).await, 3, "{}", second.stderr());
    let err = second.stderr_plain();
    assert!(err.contains("history is older than the relay's"), "{err}");
    assert_eq!(second.line_count(), 0, "nothing published");
}

/// `--sync-replica` holds what the replica has not applied (proven with its SQL thread
/// stopped: a relay without the option publishes, the one with it does not until the replica
/// applies), and its cost: commit → stdout latency of both relays on the same transactions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_replica_holds_what_the_replica_lacks_and_its_latency_cost() {
    let pair = Pair::new("").await;
    let (primary, replica, db) = (&pair.primary, &pair.replica, &pair.db);
    let replica_dsn = replica.dsn(db);
    let plain = run_relay(&primary.dsn(db), &unique("plain"), &[]);
    let synced = run_relay(
        &primary.dsn(db),
        &unique("sync"),
        &["--sync-replica", &replica_dsn],
    );
    let warm = my_write_events(&mut primary.conn(Some(db)).await, 1, 1, "warm").await;
    wait_all_printed(&[&plain], &warm, T).await;
    wait_all_printed(&[&synced], &warm, T).await;

    // The replica stops applying: only the relay without the option publishes.
    replica.exec("STOP SLAVE SQL_THREAD").await;
    let held = my_write_events(&mut primary.conn(Some(db)).await, 10, 2, "held").await;
    wait_all_printed(&[&plain], &held, T).await;
    // An observation window for something that must not happen (no condition to wait for).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let early: Vec<_> = printed_ids(&synced)
        .into_iter()
        .filter(|i| held.contains(i))
        .collect();
    assert!(
        early.is_empty(),
        "--sync-replica published {} events the replica had not applied",
        early.len()
    );
    replica.exec("START SLAVE SQL_THREAD").await;
    wait_all_printed(&[&synced], &held, T).await;

    // Latency: single-row transactions 20 ms apart; when each id first appears on stdout.
    let seen: Arc<std::sync::Mutex<std::collections::HashMap<(bool, uuid::Uuid), Instant>>> =
        Default::default();
    let stop = Arc::new(AtomicBool::new(false));
    let watcher = {
        let (seen, stop) = (seen.clone(), stop.clone());
        let mut counts = [plain.line_count(), synced.line_count()];
        let plain_lines = plain.lines.clone();
        let synced_lines = synced.lines.clone();
        tokio::spawn(async move {
            while !stop.load(Ordering::SeqCst) {
                for (i, (sync, l)) in [(false, &plain_lines), (true, &synced_lines)]
                    .into_iter()
                    .enumerate()
                {
                    let now = Instant::now();
                    let new: Vec<String> = l.lock().unwrap()[counts[i]..].to_vec();
                    counts[i] += new.len();
                    for id in ids_of(&new) {
                        seen.lock().unwrap().entry((sync, id)).or_insert(now);
                    }
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
    };
    let mut conn = primary.conn(Some(db)).await;
    let outbox = outboxd::Outbox::new("outbox").unwrap();
    let mut committed = Vec::new();
    for n in 0..200 {
        let mut tx = conn.start_transaction(Default::default()).await.unwrap();
        let id = outbox
            .write(
                &mut tx,
                "latency",
                &n.to_string(),
                &serde_json::json!({ "n": n }),
            )
            .await
            .unwrap();
        // From the COMMIT request: the relay can read the transaction once it is committed.
        let at = Instant::now();
        tx.commit().await.unwrap();
        committed.push((id, at));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ids: Vec<uuid::Uuid> = committed.iter().map(|(i, _)| *i).collect();
    wait_all_printed(&[&plain], &ids, T).await;
    wait_all_printed(&[&synced], &ids, T).await;
    stop.store(true, Ordering::SeqCst);
    watcher.await.unwrap();
    {
        let seen = seen.lock().unwrap();
        let percentiles = |sync: bool| {
            let mut ms: Vec<f64> = committed
                .iter()
                .map(|(id, at)| {
                    seen[&(sync, *id)]
                        .saturating_duration_since(*at)
                        .as_secs_f64()
                        * 1000.0
                })
                .collect();
            ms.sort_by(|a, b| a.partial_cmp(b).unwrap());
            (ms[ms.len() / 2], ms[ms.len() * 99 / 100])
        };
        let (p50, p99) = percentiles(false);
        let (s50, s99) = percentiles(true);
        eprintln!(
            "commit -> stdout, 200 one-row transactions: without --sync-replica p50 {p50:.1} ms, p99 {p99:.1} ms; with it p50 {s50:.1} ms, p99 {s99:.1} ms (one replica on the same host)"
        );
    }

    // Throughput: a burst of 5,000 events in transactions of 50, until each relay printed it.
    let t0 = Instant::now();
    let burst = my_write_events(&mut conn, 100, 50, "burst").await;
    let written = t0.elapsed();
    let mut done = [None, None];
    while done.iter().any(Option::is_none) {
        for (i, r) in [&plain, &synced].into_iter().enumerate() {
            if done[i].is_none() {
                let got: std::collections::HashSet<uuid::Uuid> =
                    printed_ids(r).into_iter().collect();
                if burst.iter().all(|id| got.contains(id)) {
                    done[i] = Some(t0.elapsed());
                }
            }
        }
        assert!(t0.elapsed() < T, "the burst was not relayed in time");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    eprintln!(
        "5,000 events in 100 transactions written in {:.2} s: published by {:.2} s without --sync-replica, {:.2} s with it",
        written.as_secs_f64(),
        done[0].unwrap().as_secs_f64(),
        done[1].unwrap().as_secs_f64()
    );
}

/// One address that moves from server to server (a DNS name or virtual IP moved by a
/// failover tool): a listener whose every new connection goes to the current upstream; moving
/// it cuts the connections that are open.
struct MovingAddress {
    port: u16,
    upstream: Arc<std::sync::atomic::AtomicU16>,
    open: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
    accept: tokio::task::JoinHandle<()>,
}

impl MovingAddress {
    async fn start(upstream: u16) -> MovingAddress {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let target = Arc::new(std::sync::atomic::AtomicU16::new(upstream));
        let open: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>> = Default::default();
        let (t, o) = (target.clone(), open.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                let to = t.load(Ordering::SeqCst);
                o.lock().unwrap().push(tokio::spawn(async move {
                    if let Ok(mut server) = tokio::net::TcpStream::connect(("127.0.0.1", to)).await
                    {
                        let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    }
                }));
            }
        });
        MovingAddress {
            port,
            upstream: target,
            open,
            accept,
        }
    }

    fn move_to(&self, upstream: u16) {
        self.upstream.store(upstream, Ordering::SeqCst);
        for c in self.open.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

impl Drop for MovingAddress {
    fn drop(&mut self) {
        self.accept.abort();
        self.move_to(0);
    }
}

/// A relay running through a switchover behind one address: its reconnect reaches another
/// server whose coordinates differ, so it stops (exit 1) saying so, and its next start resumes
/// there by GTID. The relay's own lease writes go on until the address moves, so the new
/// primary may lack the last of them (and the last position they stored): those count as
/// "transactions without outbox events", never as lost events, and the restart repeats what
/// the older stored position is behind (duplicates).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_relay_whose_address_moves_to_the_new_primary_stops_and_resumes_by_gtid() {
    let pair = Pair::new("").await;
    let (primary, replica, db) = (&pair.primary, &pair.replica, &pair.db);
    for _ in 0..3 {
        primary.exec("FLUSH LOCAL BINARY LOGS").await;
    }
    let address = MovingAddress::start(primary.port).await;
    let dsn = format!("mariadb://root@127.0.0.1:{}/{db}", address.port);
    let name = unique("r");
    let mut first = run_relay(&dsn, &name, &[]);
    first.wait_for_stderr(&["streaming the binlog"], T).await;
    let before = my_write_events(&mut primary.conn(Some(db)).await, 40, 3, "before").await;
    wait_all_printed(&[&first], &before, T).await;
    replica.caught_up(primary).await;
    primary.exec("SET GLOBAL read_only = ON").await;
    replica.promote().await;
    address.move_to(replica.port);
    assert_eq!(first.wait_exit(T).await, 1, "{}", first.stderr());
    let err = first.stderr_plain();
    assert!(
        err.contains("is another one now") && err.contains("resumes there by GTID"),
        "{err}"
    );
    let second = run_relay(&dsn, &name, &[]);
    second
        .wait_for_stderr(&["resuming by GTID on another binlog"], T)
        .await;
    let later = my_write_events(&mut replica.conn(Some(db)).await, 20, 3, "after").await;
    wait_all_printed(&[&second], &later, T).await;
    let again = printed_ids(&second)
        .iter()
        .filter(|i| before.contains(i))
        .count();
    eprintln!(
        "address moved under a running relay: {} events before, {} after, {again} published again",
        before.len(),
        later.len()
    );
    assert!(again <= before.len());
}

/// A transaction larger than `--txn-buffer` is streamed before its commit is known, and larger
/// than `--max-inflight-bytes` it cannot be held whole: `--sync-replica` lets its events go on
/// once the replica applied its GTID, instead of waiting for a checkpoint that the byte budget
/// keeps from coming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sync_replica_relays_a_transaction_larger_than_the_byte_budget() {
    let pair = Pair::new("").await;
    let (primary, replica, db) = (&pair.primary, &pair.replica, &pair.db);
    let replica_dsn = replica.dsn(db);
    let relay = run_relay(
        &primary.dsn(db),
        &unique("big"),
        &[
            "--sync-replica",
            &replica_dsn,
            "--txn-buffer",
            "2000",
            "--max-inflight-bytes",
            "4000",
        ],
    );
    relay.wait_for_stderr(&["streaming the binlog"], T).await;
    let big = my_write_events(&mut primary.conn(Some(db)).await, 1, 500, "big").await;
    let small = my_write_events(&mut primary.conn(Some(db)).await, 5, 2, "after").await;
    let all: Vec<uuid::Uuid> = big.iter().chain(&small).copied().collect();
    wait_all_printed(&[&relay], &all, T).await;
    assert_eq!(dups(&printed_ids(&relay)), 0);
}
