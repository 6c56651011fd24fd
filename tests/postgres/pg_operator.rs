//! Day one with the Postgres relay: the first-start snapshot rules (docs/message-format.md) and the
//! operator's commands — check, setup, status, teardown, offset.

use crate::common;

use common::*;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(60);

fn ids(relay: &Relay) -> Vec<Uuid> {
    parse_lines(&relay.lines())
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect()
}

async fn insert_raw(
    client: &tokio_postgres::Client,
    table: &str,
    status: Option<&str>,
    created: &str,
) -> Uuid {
    let id = Uuid::now_v7();
    match status {
        Some(s) => client
            .execute(
                &format!("INSERT INTO {table} (id, aggregate_id, topic, payload, status, created_at) VALUES ($1, 'a', 't', '{{\"k\":1}}', $2, $3::text::timestamptz)"),
                &[&id, &s, &created],
            )
            .await
            .unwrap(),
        None => client
            .execute(
                &format!("INSERT INTO {table} (id, aggregate_id, topic, payload, created_at) VALUES ($1, 'a', 't', '{{\"k\":1}}', $2::text::timestamptz)"),
                &[&id, &created],
            )
            .await
            .unwrap(),
    };
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_start_publishes_pending_rows_only() {
    first_start_publishes_pending_rows_only_on(PG_PORT).await
}

/// [`first_start_publishes_pending_rows_only`] on the server at `port` (run per version by `pg_versions` too).
pub(crate) async fn first_start_publishes_pending_rows_only_on(port: u16) {
    let db = PgDb::create_on(port, "snap1").await;
    let c = db.client().await;
    let p1 = insert_raw(&c, "outbox", Some("pending"), "2026-01-01T00:00:00Z").await;
    let _done = insert_raw(&c, "outbox", Some("published"), "2026-01-01T00:00:01Z").await;
    let p2 = insert_raw(&c, "outbox", Some("pending"), "2026-01-01T00:00:02Z").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("slot active", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    let mut client = db.client().await;
    let live = write_events(&mut client, 1, 1, "live").await;
    wait_for("3 lines", T, || {
        let n = relay.line_count();
        async move { n >= 3 }
    })
    .await;
    assert_eq!(
        ids(&relay),
        vec![p1, p2, live[0]],
        "pending rows in created_at order, then the stream"
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0);
    // A second start does not snapshot again.
    let again = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("slot active again", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    let more = write_events(&mut client, 1, 1, "more").await;
    wait_for("1 line", T, || {
        let n = again.line_count();
        async move { n >= 1 }
    })
    .await;
    assert_eq!(ids(&again), more);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_start_without_a_status_column() {
    first_start_without_a_status_column_on(PG_PORT).await
}

/// [`first_start_without_a_status_column`] on the server at `port` (run per version by `pg_versions` too).
pub(crate) async fn first_start_without_a_status_column_on(port: u16) {
    let db = PgDb::create_on(port, "snap2").await;
    let c = db.client().await;
    c.batch_execute("ALTER TABLE outbox DROP COLUMN status, DROP COLUMN published_at")
        .await
        .unwrap();
    let dsn = db.dsn();

    // Empty: starts without a choice.
    let name = unique("r");
    let mut empty = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("slot active", T, || {
        db.slot_active(format!("outboxd_{name}"))
    })
    .await;
    empty.signal("TERM");
    assert_eq!(empty.wait_exit(T).await, 0);

    let old = insert_raw(&c, "outbox", None, "2026-01-01T00:00:00Z").await;
    let newer = insert_raw(&c, "outbox", None, "2026-03-01T00:00:00Z").await;

    // Non-empty with auto: exit 2 with the count and the three options, and no slot left.
    let name2 = unique("r");
    let mut refused = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name2,
        "--commit-offsets",
    ]);
    assert_eq!(refused.wait_exit(T).await, 2);
    let err = refused.stderr();
    assert!(
        err.contains("2 rows")
            && err.contains("--snapshot all")
            && err.contains("never")
            && err.contains("since="),
        "{err}"
    );
    assert!(db
        .slot_confirmed(&format!("outboxd_{name2}"))
        .await
        .is_none());

    // all: both.
    let mut all = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name2,
        "--commit-offsets",
        "--snapshot",
        "all",
    ]);
    wait_for("2 lines", T, || {
        let n = all.line_count();
        async move { n >= 2 }
    })
    .await;
    assert_eq!(ids(&all), vec![old, newer]);
    all.signal("TERM");
    assert_eq!(all.wait_exit(T).await, 0);

    // since=: only the newer one; never: none.
    let name3 = unique("r");
    let mut since = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name3,
        "--commit-offsets",
        "--snapshot",
        "since=2026-02-01T00:00:00Z",
    ]);
    wait_for("1 line", T, || {
        let n = since.line_count();
        async move { n >= 1 }
    })
    .await;
    wait_for("slot active", T, || {
        db.slot_active(format!("outboxd_{name3}"))
    })
    .await;
    assert_eq!(ids(&since), vec![newer]);
    since.signal("TERM");
    assert_eq!(since.wait_exit(T).await, 0);
    let name4 = unique("r");
    let mut never = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name4,
        "--commit-offsets",
        "--snapshot",
        "never",
    ]);
    wait_for("slot active", T, || {
        db.slot_active(format!("outboxd_{name4}"))
    })
    .await;
    never.signal("TERM");
    assert_eq!(never.wait_exit(T).await, 0);
    assert_eq!(never.line_count(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_while_the_snapshot_runs_arrive() {
    let db = PgDb::create("snap3").await;
    let c = db.client().await;
    c.batch_execute(
        "INSERT INTO outbox (id, aggregate_id, topic, payload)
         SELECT gen_random_uuid(), 'a' || g, 'backlog', json_build_object('g', g) FROM generate_series(1, 30000) g",
    )
    .await
    .unwrap();
    let backlog: Vec<Uuid> = c
        .query("SELECT id FROM outbox", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let name = unique("r");
    let dsn = db.dsn();
    let relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    // Write while the relay starts and snapshots.
    let mut client = db.client().await;
    let during = write_events(&mut client, 20, 10, "during").await;
    let mut expected = backlog.clone();
    expected.extend(&during);
    wait_for("backlog and concurrent rows", T, || {
        let got: HashSet<Uuid> = ids(&relay).into_iter().collect();
        let all = expected.iter().all(|i| got.contains(i));
        async move { all }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_each_problem_with_its_fix() {
    check_reports_each_problem_with_its_fix_on(PG_PORT).await
}

/// [`check_reports_each_problem_with_its_fix`] on the server at `port` (run per version by `pg_versions` too).
pub(crate) async fn check_reports_each_problem_with_its_fix_on(port: u16) {
    let db = PgDb::create_on(port, "check").await;
    let dsn = db.dsn();
    let name = unique("r");
    let run_check = |table: &'static str| {
        let dsn = dsn.clone();
        let name = name.clone();
        async move {
            let mut r =
                Relay::start(&["check", "--source", &dsn, "--name", &name, "--table", table]);
            let code = r.wait_exit(T).await;
            (code, r.lines().join("\n"))
        }
    };
    let (code, out) = run_check("missing_table").await;
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL outbox table") && out.contains("does not exist") && out.contains("fix:"),
        "{out}"
    );

    db.client()
        .await
        .batch_execute("CREATE TABLE wrong (id uuid, aggregate_id text, topic text, payload text, created_at date)")
        .await
        .unwrap();
    let (code, out) = run_check("wrong").await;
    assert_eq!(code, 1);
    assert!(
        out.contains("created_at") && out.contains("timestamptz"),
        "{out}"
    );
    assert!(
        out.contains("FAIL publication") && out.contains("CREATE PUBLICATION"),
        "{out}"
    );
    assert!(out.contains("ok   wal_level"), "{out}");

    let mut setup = Relay::start(&["setup", "--source", &dsn, "--name", &name]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let (code, out) = run_check("outbox").await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("ok   replication slot") && out.contains("ok   publication"),
        "{out}"
    );
    assert!(!out.contains("FAIL"), "{out}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_teardown_and_offset() {
    status_teardown_and_offset_on(PG_PORT).await
}

/// [`status_teardown_and_offset`] on the server at `port` (run per version by `pg_versions` too).
pub(crate) async fn status_teardown_and_offset_on(port: u16) {
    let db = PgDb::create_on(port, "ops").await;
    let dsn = db.dsn();
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("slot active", T, || db.slot_active(&slot)).await;
    let mut client = db.client().await;
    let first = write_events(&mut client, 2, 5, "ops").await;
    wait_for("10 lines", T, || {
        let n = relay.line_count();
        async move { n >= 10 }
    })
    .await;
    let mut st = Relay::start(&["status", "--source", &dsn, "--name", &name, "--json"]);
    assert_eq!(st.wait_exit(T).await, 0, "{}", st.stderr());
    let v: serde_json::Value = serde_json::from_str(&st.lines()[0]).unwrap();
    assert_eq!(v["slot"], slot.as_str());
    assert_eq!(v["slot_active"], true);
    assert!(v["lease_holder"]
        .as_str()
        .unwrap()
        .contains(&format!(":{}:", relay.child.id())));
    assert!(v["lag_bytes"].as_i64().is_some() && v["server_head"].as_str().is_some());

    // offset set is refused while the relay runs.
    let mut refused = Relay::start(&[
        "offset",
        "set",
        "--source",
        &dsn,
        "--name",
        &name,
        "--replay-since",
        "2020-01-01T00:00:00Z",
    ]);
    assert_ne!(refused.wait_exit(T).await, 0);
    assert!(refused.stderr().contains("running"));
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0);

    // Replay: the next start publishes the rows again, then streams.
    let mut set = Relay::start(&[
        "offset",
        "set",
        "--source",
        &dsn,
        "--name",
        &name,
        "--replay-since",
        "2020-01-01T00:00:00Z",
    ]);
    assert_eq!(set.wait_exit(T).await, 0, "{}", set.stderr());
    let replay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("the replayed rows", T, || {
        let n = replay.line_count();
        async move { n >= 10 }
    })
    .await;
    let got: HashSet<Uuid> = ids(&replay).into_iter().collect();
    assert!(first.iter().all(|i| got.contains(i)));
    drop(replay);

    // Skipping backwards is refused with the replay hint.
    let mut back = Relay::start(&[
        "offset", "set", "--source", &dsn, "--name", &name, "--lsn", "0/1",
    ]);
    wait_for("the killed relay's walsender to go", T, || async {
        !db.slot_active(&slot).await
    })
    .await;
    assert_eq!(back.wait_exit(T).await, 2);
    assert!(
        back.stderr().contains("cannot move backwards"),
        "{}",
        back.stderr()
    );

    // Teardown asks for --yes, then leaves no slot, publication or state.
    let mut td = Relay::start(&["teardown", "--source", &dsn, "--name", &name, "--yes"]);
    assert_eq!(td.wait_exit(T).await, 0, "{}", td.stderr());
    assert!(db.slot_confirmed(&slot).await.is_none());
    let c = db.client().await;
    let pubs: i64 = c
        .query_one("SELECT count(*) FROM pg_publication", &[])
        .await
        .unwrap()
        .get(0);
    let rows: i64 = c
        .query_one("SELECT count(*) FROM outboxd_state", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!((pubs, rows), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_the_broker() {
    let db = PgDb::create("checksink").await;
    let dsn = db.dsn();
    let name = unique("r");
    let mut setup = Relay::start(&["setup", "--source", &dsn, "--name", &name]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let exchange = unique("chk");
    let check = |sink: String, exchange: String| {
        let dsn = dsn.clone();
        let name = name.clone();
        async move {
            let mut r = Relay::start_with_env(
                &[
                    "check",
                    "--source",
                    &dsn,
                    "--name",
                    &name,
                    "--exchange",
                    &exchange,
                ],
                &[("OUTBOXD_SINK", &sink)],
            );
            let code = r.wait_exit(T).await;
            (code, r.lines().join("\n"))
        }
    };
    // Unreachable broker: the line says so with the fix; the password never shows.
    let (code, out) = check(
        "amqp://guest:guest-secret@127.0.0.1:1/%2f".into(),
        exchange.clone(),
    )
    .await;
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("FAIL rabbitmq") && !out.contains("guest-secret"),
        "{out}"
    );
    // Reachable, but the relay's topology is not declared yet: the check names what is missing.
    let (_code, out) = check(common::amqp::url(), exchange.clone()).await;
    assert!(
        out.contains("ok   rabbitmq connect")
            && out.contains("rabbitmq topology")
            && out.contains(&exchange),
        "{out}"
    );
    // Declared by a relay run: ok.
    let topo = common::amqp::Topology::new("chk").await;
    let mut relay = Relay::start(&[
        "run",
        "--source",
        &dsn,
        "--name",
        &name,
        "--sink",
        &common::amqp::url(),
        "--exchange",
        &topo.exchange,
    ]);
    topo.wait_declared(T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
    let (code, out) = check(common::amqp::url(), topo.exchange.clone()).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("ok   rabbitmq") && !out.contains("FAIL"),
        "{out}"
    );
}

/// Managed Postgres grants: `check` accepts membership of `rds_replication` (Amazon RDS /
/// Aurora grant logical replication with it, not with the REPLICATION attribute) and says which
/// grant it found; a `cloudsqlsuperuser` member without the attribute is a warning with the fix.
/// The roles are created here as the services name them (cluster-wide, kept: other test runs
/// may use them at the same time; NOLOGIN, granting nothing by themselves).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_accepts_managed_replication_grants_and_names_them() {
    let db = PgDb::create("grants").await;
    let admin = pg_connect(PG_ADMIN).await;
    for r in ["rds_replication", "cloudsqlsuperuser"] {
        admin
            .batch_execute(&format!(
                "DO $$ BEGIN CREATE ROLE {r} NOLOGIN; EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL; END $$"
            ))
            .await
            .unwrap();
    }
    let user = unique("app");
    admin
        .batch_execute(&format!("CREATE ROLE {user} LOGIN"))
        .await
        .unwrap();
    struct DropRole(String);
    impl Drop for DropRole {
        fn drop(&mut self) {
            let user = self.0.clone();
            let _ = std::thread::spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap();
                rt.block_on(async move {
                    if let Ok((c, conn)) =
                        tokio_postgres::connect(PG_ADMIN, tokio_postgres::NoTls).await
                    {
                        tokio::spawn(conn);
                        let _ = c
                            .batch_execute(&format!("DROP ROLE IF EXISTS {user}"))
                            .await;
                    }
                });
            })
            .join();
        }
    }
    let _role = DropRole(user.clone());
    let dsn = format!("postgres://{user}@127.0.0.1:5432/{}", db.name);
    let privilege = || {
        let dsn = dsn.clone();
        async move {
            let mut r = Relay::start(&["check", "--source", &dsn, "--name", "grants"]);
            r.wait_exit(T).await;
            // The check's line and its `fix:` line, if any.
            let lines = r.lines();
            let i = lines
                .iter()
                .position(|l| l.contains("replication privilege"))
                .unwrap_or_else(|| panic!("no replication privilege line: {lines:?}"));
            match lines.get(i + 1) {
                Some(fix) if fix.trim_start().starts_with("fix:") => {
                    format!("{}\n{fix}", lines[i])
                }
                _ => lines[i].clone(),
            }
        }
    };

    let line = privilege().await;
    assert!(
        line.starts_with("FAIL") && line.contains("GRANT rds_replication"),
        "{line}"
    );

    admin
        .batch_execute(&format!("GRANT cloudsqlsuperuser TO {user}"))
        .await
        .unwrap();
    let line = privilege().await;
    assert!(
        line.starts_with("warn")
            && line.contains("cloudsqlsuperuser")
            && line.contains("WITH REPLICATION"),
        "{line}"
    );

    admin
        .batch_execute(&format!("ALTER ROLE {user} WITH REPLICATION"))
        .await
        .unwrap();
    let line = privilege().await;
    assert!(
        line.starts_with("ok")
            && line.contains("REPLICATION attribute")
            && line.contains("Cloud SQL"),
        "{line}"
    );

    admin
        .batch_execute(&format!(
            "ALTER ROLE {user} WITH NOREPLICATION; REVOKE cloudsqlsuperuser FROM {user}; GRANT rds_replication TO {user}"
        ))
        .await
        .unwrap();
    let line = privilege().await;
    assert!(
        line.starts_with("ok") && line.contains("member of rds_replication (Amazon RDS / Aurora)"),
        "{line}"
    );
}
