//! Relays and `outboxd setup` started at the same instant on one fresh database, Postgres and
//! MariaDB: creating the state table, the state rows, the publications and the slots must not
//! race (no `duplicate key value violates unique constraint "pg_type_typname_nsp_index"`, no
//! deadlock on the state row). Relays with different names all start, an `--ha` group has one
//! leader and standbys, and relays sharing a name without `--ha` leave exactly one running while
//! the others exit with the lease-held error.

use crate::common;

use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);
const ROUNDS: usize = 10;

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Db {
    Pg,
    My,
}

impl Db {
    fn streaming(self) -> &'static str {
        match self {
            Db::Pg => "streaming",
            Db::My => "streaming the binlog",
        }
    }
}

/// Starts one relay per `(name, ha)` at once.
fn start_all(dsn: &str, relays: &[(String, bool)]) -> Vec<Relay> {
    let args: Vec<Vec<String>> = relays
        .iter()
        .map(|(name, ha)| {
            let mut a = vec![
                "run".to_string(),
                "--source".into(),
                dsn.to_string(),
                "--name".into(),
                name.clone(),
                "--commit-offsets".into(),
            ];
            if *ha {
                a.push("--ha".into());
            }
            a
        })
        .collect();
    args.iter()
        .map(|a| Relay::start(&a.iter().map(String::as_str).collect::<Vec<_>>()))
        .collect()
}

/// Whether a relay is running its stream, waiting as a standby, or exited (with its code).
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Streaming,
    Standby,
    Exited(i32),
}

async fn settle(db: Db, relay: &mut Relay) -> Outcome {
    let deadline = std::time::Instant::now() + T;
    loop {
        if let Some(status) = relay.child.try_wait().unwrap() {
            // Read everything it wrote.
            let code = status.code().unwrap_or(-1);
            let _ = relay.wait_exit(T).await;
            return Outcome::Exited(code);
        }
        let err = relay.stderr_plain();
        if err.contains("standby: waiting for the lease") {
            return Outcome::Standby;
        }
        if err
            .lines()
            .any(|l| l.contains(db.streaming()) && !l.contains("ERROR"))
        {
            return Outcome::Streaming;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the relay neither streamed nor exited within {T:?}:\n{err}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn stop_all(relays: &mut [Relay]) {
    for r in relays.iter() {
        if r.child.id() > 0 {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &r.child.id().to_string()])
                .status();
        }
    }
    for r in relays.iter_mut() {
        let code = r.wait_exit(T).await;
        assert!(code == 0 || code == 1, "exit {code}:\n{}", r.stderr());
    }
}

/// Five relays at once on a fresh database: three names of their own and an `--ha` pair.
async fn five_at_once(db: Db, dsn: &str, round: usize) {
    let ha = unique("ha");
    let relays: Vec<(String, bool)> = vec![
        (unique("a"), false),
        (unique("b"), false),
        (unique("c"), false),
        (ha.clone(), true),
        (ha, true),
    ];
    let mut running = start_all(dsn, &relays);
    let mut outcomes = Vec::new();
    for r in running.iter_mut() {
        outcomes.push(settle(db, r).await);
    }
    for (i, o) in outcomes.iter().enumerate().take(3) {
        assert_eq!(
            *o,
            Outcome::Streaming,
            "round {round}, relay {i} ({db:?}):\n{}",
            running[i].stderr()
        );
    }
    let mut pair = [&outcomes[3], &outcomes[4]];
    pair.sort_by_key(|o| matches!(o, Outcome::Standby));
    assert_eq!(
        pair,
        [&Outcome::Streaming, &Outcome::Standby],
        "round {round}, the --ha pair ({db:?}):\n{}\n---\n{}",
        running[3].stderr(),
        running[4].stderr()
    );
    stop_all(&mut running).await;
}

/// Five relays with one name and no `--ha`: exactly one runs, the others are refused.
async fn same_name(db: Db, dsn: &str, round: usize) {
    let name = unique("same");
    let relays: Vec<(String, bool)> = (0..5).map(|_| (name.clone(), false)).collect();
    let mut running = start_all(dsn, &relays);
    let mut streaming = 0;
    for r in running.iter_mut() {
        match settle(db, r).await {
            Outcome::Streaming => streaming += 1,
            Outcome::Exited(1) => {
                let err = r.stderr();
                assert!(
                    err.contains("is already running: lease held by"),
                    "round {round} ({db:?}): the lease-held error:\n{err}"
                );
            }
            other => panic!("round {round} ({db:?}): {other:?}:\n{}", r.stderr()),
        }
    }
    assert_eq!(streaming, 1, "round {round} ({db:?}): exactly one runs");
    stop_all(&mut running).await;
}

/// Five `outboxd setup` at once (each creating a second outbox table, the state table, and
/// for Postgres a publication and a slot): all succeed.
async fn setups_at_once(dsn: &str, round: usize) {
    let names: Vec<String> = (0..5).map(|_| unique("s")).collect();
    let mut children: Vec<std::process::Child> = names
        .iter()
        .map(|n| {
            std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
                .args([
                    "setup",
                    "--source",
                    dsn,
                    "--name",
                    n,
                    "--create-table",
                    "--table",
                    "outbox_extra",
                ])
                .env_remove("RUST_LOG")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn outboxd setup")
        })
        .collect();
    for c in children.drain(..) {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "round {round}: setup failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_relays_started_together_all_start() {
    for round in 0..ROUNDS {
        let db = PgDb::create("together").await;
        five_at_once(Db::Pg, &db.dsn(), round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_relays_with_one_name_started_together_leave_one_running() {
    for round in 0..3 {
        let db = PgDb::create("samename").await;
        same_name(Db::Pg, &db.dsn(), round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_setups_started_together_all_succeed() {
    for round in 0..ROUNDS {
        let db = PgDb::create("setups").await;
        setups_at_once(&db.dsn(), round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_relays_started_together_all_start() {
    for round in 0..ROUNDS {
        let db = MyDb::create("together").await;
        five_at_once(Db::My, &db.dsn(), round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_relays_with_one_name_started_together_leave_one_running() {
    for round in 0..3 {
        let db = MyDb::create("samename").await;
        same_name(Db::My, &db.dsn(), round).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_setups_started_together_all_succeed() {
    for round in 0..ROUNDS {
        let db = MyDb::create("setups").await;
        setups_at_once(&db.dsn(), round).await;
    }
}
