//! What touches the whole MariaDB server: a restart mid-stream, purged binlogs (a lost
//! position, exit 3), a global `binlog_row_metadata` change, and the idle-outbox test that
//! needs a binlog no other test writes to (every other database's transaction rightly moves the
//! position). Other MariaDB tests would fail under these or disturb them, so they live in the
//! `disruptive` test binary (cargo runs test binaries one at a time) and take turns with every
//! other test there through its one lock ([`crate::ALONE`]).

use crate::common;

use common::*;
use mysql_async::prelude::Queryable;
use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// One server-wide test at a time (the binary's lock).
use crate::ALONE as SERVER;

fn args<'a>(dsn: &'a str, name: &'a str) -> Vec<&'a str> {
    vec!["run", "--source", dsn, "--name", name, "--commit-offsets"]
}

async fn start_streaming(db: &MyDb, args: &[&str]) -> Relay {
    let relay = Relay::start(args);
    wait_for("the relay's binlog dump to be connected", T, || {
        db.streaming()
    })
    .await;
    relay
}

fn ping() -> bool {
    Command::new("mysqladmin")
        .args([
            "-uroot",
            "-h127.0.0.1",
            "--protocol=TCP",
            "--connect-timeout=2",
            "ping",
        ])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

fn mariadbd_running() -> bool {
    Command::new("start-stop-daemon")
        .args(["--status", "--exec", "/usr/sbin/mariadbd"])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// `mysqladmin shutdown`, then start the server again the way scripts/services.sh does.
async fn restart_mariadb() {
    let ok = Command::new("mysqladmin")
        .args(["-uroot", "-h127.0.0.1", "--protocol=TCP", "shutdown"])
        .status()
        .expect("mysqladmin (run `sudo scripts/services.sh`)")
        .success();
    assert!(ok, "mysqladmin shutdown failed");
    wait_for("mariadbd to exit", T, || async { !mariadbd_running() }).await;
    let _ = Command::new("install")
        .args([
            "-d",
            "-m",
            "0755",
            "-o",
            "mysql",
            "-g",
            "mysql",
            "/run/mysqld",
        ])
        .status();
    let ok = Command::new("start-stop-daemon")
        .args([
            "--start",
            "--oknodo",
            "--background",
            "--exec",
            "/usr/sbin/mariadbd",
        ])
        .status()
        .expect("start-stop-daemon")
        .success();
    assert!(ok, "start-stop-daemon --start mariadbd failed");
    wait_for("MariaDB to answer again", T, || async { ping() }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_restart_mid_stream_loses_nothing() {
    let _turn = SERVER.lock().await;
    let db = MyDb::create("my_restart").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;

    let mut c = db.conn().await;
    let mut expected = my_write_events(&mut c, 100, 100, "before.restart").await;
    drop(c);
    // Restart while the relay may still be working through the backlog.
    restart_mariadb().await;
    let mut c = db.conn().await;
    expected.extend(my_write_events(&mut c, 20, 100, "after.restart").await);

    wait_for("every event after the restart", T, || {
        let got: HashSet<Uuid> = ids_of(&relay.lines()).into_iter().collect();
        let all = expected.iter().all(|i| got.contains(i));
        async move { all }
    })
    .await;
    let err = relay.stderr_plain();
    assert!(
        err.contains("reconnect") || err.contains("resuming from the last transaction boundary"),
        "the relay saw the restart and resumed: {err}"
    );
    let got = ids_of(&relay.lines());
    let set: HashSet<_> = got.iter().collect();
    assert_eq!(
        set.len(),
        got.len(),
        "no duplicates across a server restart"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purged_binlogs_are_a_lost_position() {
    let _turn = SERVER.lock().await;
    let db = MyDb::create("my_purge").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut c = db.conn().await;

    // After the teardown the next run is a first start again: the rows already published
    // stay pending in the table (CDC never updates them), so publish none of them.
    let mut run = args(&dsn, &name);
    run.push("--snapshot=never");
    for by_position in [false, true] {
        let mut relay = start_streaming(&db, &run).await;
        let ids = my_write_events(&mut c, 1, 3, "kept").await;
        wait_for("the events", T, || {
            let n = relay.line_count();
            async move { n >= 3 }
        })
        .await;
        relay.signal("TERM");
        assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
        assert_eq!(ids_of(&relay.lines()), ids);
        if by_position {
            c.exec_drop(
                "UPDATE outboxd_state SET gtid_state = NULL WHERE name = ?",
                (&name,),
            )
            .await
            .unwrap();
        }
        // Written while the relay is stopped, then purged: lost to the binlog. (The server
        // keeps a file a dump thread still reads: wait until the old one noticed its client is
        // gone.)
        my_write_events(&mut c, 1, 3, "purged").await;
        wait_for("the dump thread to go", T, || async {
            !db.streaming().await
        })
        .await;
        let mut admin = my_connect(None).await;
        my_exec(&mut admin, "FLUSH BINARY LOGS").await;
        let (head_file, _) = my_head().await;
        // A file stays "in use" until the storage engine's checkpoint covers it: retry.
        wait_for("the older binlogs to be purged", T, || {
            let head_file = head_file.clone();
            async move {
                let mut admin = my_connect(None).await;
                my_exec(&mut admin, &format!("PURGE BINARY LOGS TO '{head_file}'")).await;
                my_value(&mut admin, "SHOW BINARY LOGS").await.as_deref()
                    == Some(head_file.as_str())
            }
        })
        .await;

        let mut again = Relay::start(&run);
        let code = again.wait_exit(T).await;
        let err = again.stderr();
        assert_eq!(
            code, 3,
            "exit 3 = stored position lost (by_position={by_position}); stderr:\n{err}"
        );
        assert!(
            err.contains("stored position lost") && err.contains("fix:"),
            "{err}"
        );
        assert!(err.contains("teardown"), "the fix says what to do: {err}");
        assert!(again.lines().is_empty());

        // The way out the fix names: teardown, then a fresh start from the current position.
        let out = Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(["teardown", "--source", &dsn, "--name", &name, "--yes"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(db.stored(&name).await.is_none());
    }
}

/// Puts the global setting back whatever happens in the test.
struct RestoreMetadata;

impl Drop for RestoreMetadata {
    fn drop(&mut self) {
        let _ = Command::new("mysql")
            .args([
                "-uroot",
                "-h127.0.0.1",
                "--protocol=TCP",
                "-e",
                "SET GLOBAL binlog_row_metadata = FULL",
            ])
            .status();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn minimal_row_metadata_is_refused_with_the_fix() {
    let _turn = SERVER.lock().await;
    let db = MyDb::create("my_meta").await;
    let dsn = db.dsn();
    let _restore = RestoreMetadata;

    // Mid-stream: the first insert logged without column names stops the relay.
    let name = unique("r");
    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;
    let mut admin = my_connect(None).await;
    my_exec(&mut admin, "SET GLOBAL binlog_row_metadata = MINIMAL").await;
    // New sessions pick the global value up.
    let mut c = db.conn().await;
    my_exec(
        &mut c,
        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) VALUES (UNHEX('00000000000040008000000000000001'), 1, 'x', '{}', NOW(6))",
    )
    .await;
    let code = relay.wait_exit(T).await;
    let err = relay.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("SET GLOBAL binlog_row_metadata = FULL"),
        "{err}"
    );
    assert!(relay.lines().is_empty(), "nothing published without names");

    // At start: refused before streaming.
    let mut again = Relay::start(&args(&dsn, &unique("r")));
    let code = again.wait_exit(T).await;
    let err = again.stderr();
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("binlog_row_metadata is MINIMAL") && err.contains("fix:"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_beside_busy_tables_keeps_the_position_near_the_head_without_a_write_loop() {
    let _turn = SERVER.lock().await;
    let db = MyDb::create("my_idle").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &args(&dsn, &name)).await;
    let mut c = db.conn().await;
    my_exec(
        &mut c,
        "CREATE TABLE busy (id BIGINT AUTO_INCREMENT PRIMARY KEY, v TEXT)",
    )
    .await;
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        let mut c = db.conn().await;
        tokio::spawn(async move {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                c.query_drop("INSERT INTO busy (v) SELECT REPEAT('x', 200) FROM seq_1_to_50")
                    .await
                    .unwrap();
            }
        })
    };
    // While the other table keeps the binlog moving, the stored position passes a head taken
    // mid-load, without any outbox event.
    let head = my_head().await;
    wait_for(
        "the stored position to pass the head taken under load",
        Duration::from_secs(20),
        || async {
            db.stored(&name)
                .await
                .is_some_and(|(f, p, _)| binlog_ge(&(f, p), &head))
        },
    )
    .await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    busy.await.unwrap();

    // Idle now: the position settles and then stays put while the lease is renewed (each
    // renewal is a binlog transaction of its own that must not move it).
    let renewed = || async {
        let mut c = db.conn().await;
        my_value(
            &mut c,
            &format!("SELECT lease_renewed_at FROM outboxd_state WHERE name = '{name}'"),
        )
        .await
        .unwrap()
    };
    let mut settled = db.stored(&name).await.unwrap();
    let mut stable_renewals = 0;
    let mut last_renewal = renewed().await;
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while stable_renewals < 4 {
        assert!(
            std::time::Instant::now() < deadline,
            "the stored position keeps moving while idle: a write loop"
        );
        let r = renewed().await;
        if r != last_renewal {
            last_renewal = r;
            let now = db.stored(&name).await.unwrap();
            if now == settled {
                stable_renewals += 1;
            } else {
                settled = now;
                stable_renewals = 0;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(binlog_ge(&(settled.0.clone(), settled.1), &head));
    assert_eq!(relay.line_count(), 0, "no outbox events were written");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}
