//! `outboxd fleet` in the test's own process (`outboxd::fleet::Fleet`): one fleet runs sources
//! on Postgres and MariaDB, each its own database, from a directory of source files that the
//! test edits while the fleet runs — a file added starts its source, a changed file restarts
//! that source only, a removed file stops it (its lease released) — and a source that cannot
//! start (its database is missing) fails alone, retried with backoff, while the others publish,
//! and starts publishing once its database exists. The test's loader reads each file as a
//! source DSN and runs the pipeline into a `MemorySink` per source, kept across its restarts.

use crate::common::source_db::SourceDb;
use crate::common::{unique, wait_for, MyDb, PgDb};
use futures::future::BoxFuture;
use futures::FutureExt;
use outboxd::dsn::SourceDsn;
use outboxd::fleet::{Fleet, FleetOptions, Loader, Tenant};
use outboxd::names::{ColumnMap, TableName};
use outboxd::pipeline;
use outboxd::sink::options::SinkOptions;
use outboxd::source::mysql::log::{outbox_tables, MyLog, MySqlOptions};
use outboxd::source::postgres::log::{PgLog, PgOptions};
use outboxd::{MemoryHandle, MemorySink};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);

/// A source of the test's fleet: the pipeline over the file's DSN into its own memory sink.
struct TestTenant {
    name: String,
    dsn: SourceDsn,
    sink: MemoryHandle,
}

impl Tenant for TestTenant {
    fn run(&self, stop: CancellationToken) -> BoxFuture<'static, Result<(), outboxd::Error>> {
        let (name, dsn, sink) = (self.name.clone(), self.dsn.clone(), self.sink.clone());
        async move {
            let mut cfg = crate::common::inproc::run_config(&name, &stop);
            cfg.ha = true;
            let table = TableName::parse("outbox").unwrap();
            match dsn {
                SourceDsn::Postgres(dsn) => {
                    let source = PgLog {
                        dsn,
                        name: name.clone(),
                        options: PgOptions {
                            slot: format!("outboxd_{name}"),
                            publication: format!("outboxd_{name}"),
                        },
                        tables: vec![table],
                        columns: ColumnMap::default(),
                        max_wire_message_bytes: outboxd::source::postgres::wire_message_limit(
                            SinkOptions::default().max_message_bytes,
                        ),
                    };
                    let store = source.state_store();
                    pipeline::run(source, store, move || Ok(sink.sink()), &cfg, stop).await?;
                }
                SourceDsn::Mysql(dsn) => {
                    let options = MySqlOptions::default();
                    let tables =
                        outbox_tables(&dsn, &[table], &ColumnMap::default(), options.time_zone)?;
                    let store = outboxd::state::mysql::MyStateStore::new(dsn.clone());
                    let source = MyLog {
                        dsn,
                        name: name.clone(),
                        tables,
                        options,
                    };
                    pipeline::run(source, store, move || Ok(sink.sink()), &cfg, stop).await?;
                }
                SourceDsn::File(_) => unreachable!("the test writes database DSNs"),
            }
            Ok(())
        }
        .boxed()
    }
}

/// The fleet's directory, and each source's sink by name (kept across the source's runs).
struct Harness {
    dir: tempfile::TempDir,
    sinks: Arc<Mutex<BTreeMap<String, MemoryHandle>>>,
}

impl Harness {
    fn new() -> Self {
        Harness {
            dir: tempfile::tempdir().unwrap(),
            sinks: Arc::default(),
        }
    }

    fn loader(&self) -> Loader {
        let sinks = self.sinks.clone();
        Arc::new(move |name: &str, path: &Path| {
            let text = std::fs::read_to_string(path).unwrap();
            let dsn = SourceDsn::parse(text.trim())?;
            let sink = sinks
                .lock()
                .unwrap()
                .entry(name.to_string())
                .or_insert_with(|| MemorySink::new().1)
                .clone();
            Ok(Arc::new(TestTenant {
                name: name.to_string(),
                dsn,
                sink,
            }) as Arc<dyn Tenant>)
        })
    }

    fn fleet(&self) -> Fleet {
        let mut opts = FleetOptions::new(self.dir.path());
        opts.rescan = Duration::from_millis(200);
        opts.retry = (Duration::from_millis(100), Duration::from_millis(800));
        Fleet::new(opts, self.loader())
    }

    fn write(&self, name: &str, dsn: &str) {
        std::fs::write(self.dir.path().join(format!("{name}.toml")), dsn).unwrap();
    }

    fn sink(&self, name: &str) -> MemoryHandle {
        self.sinks.lock().unwrap()[name].clone()
    }

    /// Waits until source `name`'s sink has confirmed every one of `ids`.
    async fn wait_published(&self, name: &str, ids: &[Uuid]) {
        wait_for(&format!("{name}'s {} events", ids.len()), T, || async {
            let have: HashSet<Uuid> = self
                .sinks
                .lock()
                .unwrap()
                .get(name)
                .map(|h| h.confirmed_ids().into_iter().collect())
                .unwrap_or_default();
            ids.iter().all(|id| have.contains(id))
        })
        .await;
    }
}

async fn state_is(fleet: &Arc<outboxd::fleet::status::Status>, name: &str, state: &str) -> bool {
    fleet.state_of(name).is_some_and(|r| r.state == state)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_fleet_runs_sources_on_both_databases_and_follows_its_directory() {
    let (pg_a, pg_b, my_a, my_b) = tokio::join!(
        PgDb::create("fleet_pa"),
        PgDb::create("fleet_pb"),
        MyDb::create("fleet_ma"),
        MyDb::create("fleet_mb")
    );
    let h = Harness::new();
    let names: Vec<String> = ["pa", "pb", "ma", "mb"]
        .iter()
        .map(|p| unique(&format!("fl{p}")))
        .collect();
    h.write(&names[0], &pg_a.dsn());
    h.write(&names[1], &pg_b.dsn());
    h.write(&names[2], &my_a.dsn());
    // A database that does not exist yet: this source fails alone until it does.
    let missing = unique("fleet_missing");
    let missing_dsn = {
        let d = my_b.dsn();
        format!("{}/{missing}", &d[..d.rfind('/').unwrap()])
    };
    h.write(&names[3], &missing_dsn);
    let fleet = h.fleet();
    let status = fleet.status();
    let stop = CancellationToken::new();
    let run = tokio::spawn(fleet.run(stop.clone()));

    pg_a.wait_streaming(&names[0]).await;
    pg_b.wait_streaming(&names[1]).await;
    my_a.wait_streaming(&names[2]).await;
    let (a, b, c) = tokio::join!(
        pg_a.write(3, 2, "fleet.pa"),
        pg_b.write(2, 2, "fleet.pb"),
        my_a.write(3, 2, "fleet.ma")
    );
    h.wait_published(&names[0], &a).await;
    h.wait_published(&names[1], &b).await;
    h.wait_published(&names[2], &c).await;
    // Each source published its own events only.
    let pa: HashSet<Uuid> = h.sink(&names[0]).confirmed_ids().into_iter().collect();
    assert!(
        b.iter().chain(&c).all(|id| !pa.contains(id)),
        "a source published another's events"
    );

    // The source whose database is missing fails alone, named, and is retried.
    wait_for(
        "the missing database's source to fail and be retried",
        T,
        || async {
            status
                .state_of(&names[3])
                .is_some_and(|r| r.runs >= 2 && (r.state == "failing" || r.state == "starting"))
        },
    )
    .await;
    let failing = status.state_of(&names[3]).unwrap();
    for n in &names[..3] {
        assert!(
            state_is(&status, n, "running").await,
            "{n}: {:?}",
            status.state_of(n)
        );
    }
    // The database appears (with its outbox): the next retry starts the source.
    my_b.exec(&format!("CREATE DATABASE {missing}")).await;
    let moved = MyDb {
        name: missing.clone(),
    };
    moved.exec(crate::common::MY_OUTBOX_DDL).await;
    wait_for("the retried source to run", T, || {
        state_is(&status, &names[3], "running")
    })
    .await;
    moved.wait_streaming(&names[3]).await;
    let d = moved.write(2, 1, "fleet.mb").await;
    h.wait_published(&names[3], &d).await;
    assert!(status.state_of(&names[3]).unwrap().runs > failing.runs);

    // A source added mid-run starts.
    let added = unique("fladd");
    h.write(&added, &pg_b.dsn());
    // (same database, its own slot and state: a second relay over pg_b)
    wait_for("the added source to run", T, || {
        state_is(&status, &added, "running")
    })
    .await;
    pg_b.wait_streaming(&added).await;
    let e = pg_b.write(2, 1, "fleet.added").await;
    h.wait_published(&added, &e).await;
    h.wait_published(&names[1], &e).await;

    // A changed file restarts that source only.
    let runs_before: Vec<u64> = names
        .iter()
        .map(|n| status.state_of(n).unwrap().runs)
        .collect();
    h.write(&names[0], &format!("{}\n", pg_a.dsn()));
    wait_for("the changed source to run again", T, || async {
        status
            .state_of(&names[0])
            .is_some_and(|r| r.runs == runs_before[0] + 1 && r.state == "running")
    })
    .await;
    for (i, n) in names.iter().enumerate().skip(1) {
        assert_eq!(
            status.state_of(n).unwrap().runs,
            runs_before[i],
            "{n} restarted with another's file"
        );
    }
    pg_a.wait_streaming(&names[0]).await;
    let f = pg_a.write(2, 1, "fleet.changed").await;
    h.wait_published(&names[0], &f).await;

    // A removed file stops its source: gone from the status, its lease released.
    std::fs::remove_file(h.dir.path().join(format!("{added}.toml"))).unwrap();
    wait_for("the removed source to leave the status", T, || async {
        status.state_of(&added).is_none()
    })
    .await;
    wait_for("the removed source's lease to be released", T, || async {
        pg_b.lease_holder(&added).await.is_none()
    })
    .await;

    stop.cancel();
    tokio::time::timeout(T, run)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    // Every source stopped gracefully: its lease released.
    assert!(pg_a.lease_holder(&names[0]).await.is_none());
    assert!(my_a.lease_holder(&names[2]).await.is_none());
}

/// `outboxd fleet status --addr ADDR`: each source's (name, state), or nothing while the
/// fleet does not answer.
fn fleet_status(addr: &str) -> Vec<(String, String)> {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
        .args(["fleet", "status", "--addr", addr])
        .output()
        .unwrap();
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .skip(1)
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            Some((w.next()?.to_string(), w.next()?.to_string()))
        })
        .collect()
}

fn running(addr: &str) -> Vec<String> {
    fleet_status(addr)
        .into_iter()
        .filter(|(_, s)| s == "running")
        .map(|(n, _)| n)
        .collect()
}

/// The event ids a fleet process printed (stdout sink).
fn printed(relay: &crate::common::Relay) -> HashSet<Uuid> {
    relay
        .lines()
        .iter()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["id"].as_str()?.parse().ok())
        .collect()
}

/// Two `outboxd fleet` processes on one directory of real source files (`run`'s keys): they
/// split the sources between them through the membership table; one is SIGKILLed and the other
/// takes its sources over; every event of every source is printed at least once, and no
/// source ever runs in both at once (each source's lease holder is one process at a time, the
/// lease epoch moves on at the takeover). A file that does not load is reported once, by name,
/// while the others run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_fleet_processes_share_the_sources_and_one_killed_hands_its_sources_over() {
    use crate::common::{free_local_port, Relay};
    let prefixes: Vec<String> = (0..4).map(|i| format!("fleet2_{i}")).collect();
    let dbs = futures::future::join_all(prefixes.iter().map(|p| PgDb::create(p))).await;
    let coord = PgDb::create("fleet2_coord").await;
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..4).map(|i| unique(&format!("f2s{i}"))).collect();
    for (db, name) in dbs.iter().zip(&names) {
        std::fs::write(
            dir.path().join(format!("{name}.toml")),
            format!(
                "source = \"{}\"\nsink = \"stdout\"\ncommit_offsets = true\n",
                db.dsn()
            ),
        )
        .unwrap();
    }
    // A file with a misspelt key: reported with the fix, the others unaffected.
    std::fs::write(
        dir.path().join("broken.toml"),
        "sourse = \"postgres://x@h/db\"\n",
    )
    .unwrap();
    let fleet_name = unique("fl");
    let (addr_a, addr_b) = (
        format!("127.0.0.1:{}", free_local_port()),
        format!("127.0.0.1:{}", free_local_port()),
    );
    let start = |addr: &str| {
        Relay::start(&[
            "fleet",
            "--sources",
            dir.path().to_str().unwrap(),
            "--members",
            &coord.dsn(),
            "--fleet-name",
            &fleet_name,
            "--member-ttl",
            "2s",
            "--rescan-interval",
            "300ms",
            "--metrics-addr",
            addr,
        ])
    };
    let a = start(&addr_a);
    wait_for("fleet A to run all four sources", T, || async {
        running(&addr_a).len() == 4
    })
    .await;
    a.wait_for_stderr(
        &["broken", "unknown key \"sourse\"", "fix: did you mean"],
        T,
    )
    .await;
    let b = start(&addr_b);
    // Each source runs in exactly one process and stands by ("elsewhere") in the other. Which
    // process gets how many is the hash's choice (the members' ids are random): the one that
    // runs more is killed below, so sources always move.
    let states =
        |addr: &str| -> BTreeMap<String, String> { fleet_status(addr).into_iter().collect() };
    wait_for("the two processes to split the sources", T, || async {
        let (sa, sb) = (states(&addr_a), states(&addr_b));
        names.iter().all(|n| {
            let (x, y) = (sa.get(n).map(String::as_str), sb.get(n).map(String::as_str));
            matches!(
                (x, y),
                (Some("running"), Some("elsewhere")) | (Some("elsewhere"), Some("running"))
            )
        })
    })
    .await;
    // Read again at every rescan meanwhile, the broken file was reported once.
    assert_eq!(
        a.stderr().matches("unknown key \"sourse\"").count(),
        1,
        "{}",
        a.stderr()
    );
    assert_eq!(
        states(&addr_a).get("broken").map(String::as_str),
        Some("invalid")
    );
    let (on_a, on_b) = (running(&addr_a), running(&addr_b));
    let (mut victim, mut survivor, survivor_addr, moved) = if on_b.len() >= on_a.len() {
        (b, a, addr_a.clone(), on_b)
    } else {
        (a, b, addr_b.clone(), on_a)
    };
    let mut written: Vec<Vec<Uuid>> = Vec::new();
    for db in &dbs {
        written.push(db.write(3, 2, "fleet2.before").await);
    }
    let all_printed = |a: &Relay, b: &Relay| {
        let mut have = printed(a);
        have.extend(printed(b));
        have
    };
    let (a, b) = (&mut survivor, &mut victim);
    wait_for(
        "every event printed by one process or the other",
        T,
        || async {
            let have = all_printed(a, b);
            written.iter().flatten().all(|id| have.contains(id))
        },
    )
    .await;
    let epochs_before: Vec<i64> =
        futures::future::join_all(dbs.iter().zip(&names).map(|(db, n)| lease_epoch(db, n))).await;

    b.sigkill();
    wait_for(
        "the other process to take the killed process's sources over",
        T,
        || async { running(&survivor_addr).len() == 4 },
    )
    .await;
    for db in &dbs {
        written.push(db.write(2, 2, "fleet2.after").await);
    }
    wait_for(
        "every event, before and after the kill, printed",
        T,
        || async {
            let have = all_printed(a, b);
            written.iter().flatten().all(|id| have.contains(id))
        },
    )
    .await;
    for (i, name) in names.iter().enumerate() {
        let holder = dbs[i].lease_holder(name).await.expect("a lease holder");
        assert!(
            holder.contains(&format!(":{}:", a.child.id())),
            "{name} held by {holder}, not the surviving process"
        );
        let epoch = lease_epoch(&dbs[i], name).await;
        if moved.contains(name) {
            assert!(
                epoch > epochs_before[i],
                "{name}: taken over without a new lease epoch"
            );
        }
    }
    a.signal("TERM");
    assert_eq!(a.wait_exit(T).await, 0, "{}", a.stderr());
    // Stopped gracefully: every lease released.
    for (db, name) in dbs.iter().zip(&names) {
        assert_eq!(
            db.lease_holder(name).await,
            None,
            "{name}'s lease kept after the stop"
        );
    }
}

async fn lease_epoch(db: &PgDb, name: &str) -> i64 {
    db.client()
        .await
        .query_one("SELECT epoch FROM outboxd_state WHERE name = $1", &[&name])
        .await
        .unwrap()
        .get(0)
}

/// Binlog dump threads the server runs for connections to these databases.
async fn dump_threads(dbs: &[MyDb]) -> usize {
    let names: Vec<String> = dbs.iter().map(|d| format!("'{}'", d.name)).collect();
    let mut c = crate::common::my_connect(None).await;
    crate::common::my_value(
        &mut c,
        &format!(
            "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE COMMAND LIKE 'Binlog Dump%' AND DB IN ({})",
            names.join(",")
        ),
    )
    .await
    .and_then(|s| s.parse().ok())
    .unwrap_or(0)
}

/// MariaDB sources of one server in one `outboxd fleet` process read its binlog through one
/// dump connection (the shared stream): every event of every source is printed, written
/// before and after the sources joined the shared stream, the server runs one `Binlog Dump`
/// for the three databases, and a graceful stop releases every lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_sources_of_one_server_share_one_dump_connection_in_a_fleet() {
    use crate::common::{free_local_port, my_write_events, Relay};
    let prefixes: Vec<String> = (0..3).map(|i| format!("fleet_hub{i}")).collect();
    let dbs = futures::future::join_all(prefixes.iter().map(|p| MyDb::create(p))).await;
    let dir = tempfile::tempdir().unwrap();
    let names: Vec<String> = (0..3).map(|i| unique(&format!("fh{i}"))).collect();
    for (db, name) in dbs.iter().zip(&names) {
        std::fs::write(
            dir.path().join(format!("{name}.toml")),
            format!(
                "source = \"{}\"\nsink = \"stdout\"\ncommit_offsets = true\n",
                db.dsn()
            ),
        )
        .unwrap();
    }
    let addr = format!("127.0.0.1:{}", free_local_port());
    let mut fleet = Relay::start(&[
        "fleet",
        "--sources",
        dir.path().to_str().unwrap(),
        "--rescan-interval",
        "300ms",
        "--metrics-addr",
        &addr,
    ]);
    wait_for("the fleet to run its three sources", T, || async {
        running(&addr).len() == 3
    })
    .await;
    let mut written = Vec::new();
    for db in &dbs {
        let mut c = db.conn().await;
        written.extend(my_write_events(&mut c, 2, 2, "fleet.hub.first").await);
    }
    wait_for("every first event printed", T, || async {
        let have = printed(&fleet);
        written.iter().all(|id| have.contains(id))
    })
    .await;
    wait_for(
        "the three sources reading through one dump connection",
        T,
        || async { dump_threads(&dbs).await == 1 },
    )
    .await;
    for db in &dbs {
        let mut c = db.conn().await;
        written.extend(my_write_events(&mut c, 2, 2, "fleet.hub.shared").await);
    }
    wait_for("every event written while shared printed", T, || async {
        let have = printed(&fleet);
        written.iter().all(|id| have.contains(id))
    })
    .await;
    assert_eq!(
        dump_threads(&dbs).await,
        1,
        "still one dump connection after the shared events"
    );
    fleet.signal("TERM");
    assert_eq!(fleet.wait_exit(T).await, 0, "{}", fleet.stderr());
    for (db, name) in dbs.iter().zip(&names) {
        assert_eq!(
            db.lease_holder(name).await,
            None,
            "{name}'s lease kept after the stop"
        );
    }
}
