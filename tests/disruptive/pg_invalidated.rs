//! A replication slot invalidated by the server (`wal_status = lost`: `max_slot_wal_keep_size`
//! exceeded while the relay was stopped) is a lost position: exit 3 with the fix under
//! `--on-position-lost fail`, and under `poll` every row committed while the relay was away
//! arrives through the table. Lowering `max_slot_wal_keep_size` applies to every slot on the
//! server, so this test lives in the `disruptive` binary and holds [`crate::ALONE`].

use crate::common;

use common::*;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

/// Sets `max_slot_wal_keep_size` for the server and puts the old value back when dropped,
/// also when the test fails half-way.
struct KeepSize {
    old: String,
}

fn psql(sql: &str) {
    let ok = std::process::Command::new("psql")
        .args([
            "-h",
            "127.0.0.1",
            "-U",
            "postgres",
            "-d",
            "test",
            "-Atqc",
            sql,
        ])
        .status()
        .expect("psql (the postgresql-client package; scripts/services.sh installs it)")
        .success();
    assert!(ok, "psql -c {sql:?} failed");
}

impl KeepSize {
    async fn set(c: &tokio_postgres::Client, value: &str) -> KeepSize {
        let old: String = c
            .query_one("SHOW max_slot_wal_keep_size", &[])
            .await
            .unwrap()
            .get(0);
        psql(&format!(
            "ALTER SYSTEM SET max_slot_wal_keep_size = '{value}'"
        ));
        psql("SELECT pg_reload_conf()");
        KeepSize { old }
    }
}

impl Drop for KeepSize {
    fn drop(&mut self) {
        if self.old == "-1" {
            psql("ALTER SYSTEM RESET max_slot_wal_keep_size");
        } else {
            psql(&format!(
                "ALTER SYSTEM SET max_slot_wal_keep_size = '{}'",
                self.old
            ));
        }
        psql("SELECT pg_reload_conf()");
    }
}

async fn wal_status(c: &tokio_postgres::Client, slot: &str) -> Option<String> {
    c.query_opt(
        "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
        &[&slot],
    )
    .await
    .unwrap()
    .and_then(|r| r.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalidated_slot_is_a_lost_position_then_recovered_through_the_table() {
    let _alone = crate::ALONE.lock().await;
    let db = PgDb::create("pginval").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let run = |extra: &[&str]| {
        let mut args = vec!["run", "--source", &dsn, "--name", &name, "--commit-offsets"];
        args.extend_from_slice(extra);
        Relay::start(&args)
    };
    let mut relay = run(&[]);
    wait_for("slot active", T, || db.slot_active(&slot)).await;
    let mut client = db.client().await;
    let first = write_events(&mut client, 1, 5, "before.stop").await;
    wait_for("5 lines", T, || {
        let n = relay.line_count();
        async move { n >= 5 }
    })
    .await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());

    // Committed while the relay is away; then the WAL the slot needs is removed.
    let away = write_events(&mut client, 3, 1, "while.away").await;
    let admin = pg_connect(PG_ADMIN).await;
    let _keep = KeepSize::set(&admin, "32MB").await;
    client
        .batch_execute("CREATE TABLE wal_filler (b bytea)")
        .await
        .unwrap();
    wait_for("the slot to be invalidated (wal_status lost)", T, || async {
        // About 20 MB of WAL and a checkpoint at each step: the checkpoint invalidates.
        client
            .batch_execute(
                "INSERT INTO wal_filler SELECT decode(repeat(md5(g::text), 64), 'hex') FROM generate_series(1, 10000) g;
                 SELECT pg_switch_wal(); CHECKPOINT;",
            )
            .await
            .unwrap();
        wal_status(&admin, &slot).await.as_deref() == Some("lost")
    })
    .await;

    // The fault is there: exit 3, the slot named invalidated, and the fix.
    let mut failing = run(&["--on-position-lost", "fail"]);
    let code = failing.wait_exit(T).await;
    let err = failing.stderr();
    assert_eq!(code, 3, "{err}");
    assert!(err.contains("invalidated") && err.contains("fix"), "{err}");
    assert_eq!(failing.line_count(), 0, "nothing streamed from a lost slot");

    // Recovery through the table: every row committed while away arrives.
    let recovering = run(&["--on-position-lost", "poll"]);
    let want: HashSet<Uuid> = away.iter().copied().collect();
    wait_for("the rows committed while away", T, || {
        let got: HashSet<Uuid> = ids_of(&recovering.lines()).into_iter().collect();
        let all = want.is_subset(&got);
        async move { all }
    })
    .await;
    let got = ids_of(&recovering.lines());
    assert!(
        got.iter().all(|i| want.contains(i) || first.contains(i)),
        "nothing but the table's rows"
    );
    let mut recovering = recovering;
    recovering.signal("TERM");
    assert_eq!(recovering.wait_exit(T).await, 0, "{}", recovering.stderr());
}
