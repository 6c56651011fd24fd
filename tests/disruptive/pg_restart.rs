//! Postgres restarts mid-stream. Restarting the shared server would pull it from under other
//! tests, so this test lives in the `disruptive` binary (cargo runs test binaries one at a
//! time) and holds its lock ([`crate::ALONE`]) while it runs.

use crate::common;

use common::*;
use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;
use uuid::Uuid;

const T: Duration = Duration::from_secs(120);

fn pg_ctl(action: &str) {
    let version = std::fs::read_dir("/etc/postgresql")
        .expect("a Debian Postgres cluster under /etc/postgresql (run scripts/services.sh)")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .expect("a Postgres version directory");
    let ok = Command::new("pg_ctlcluster")
        .args([
            "--skip-systemctl-redirect",
            &version,
            "main",
            action,
            "-m",
            "fast",
        ])
        .status()
        .expect("pg_ctlcluster")
        .success();
    assert!(ok, "pg_ctlcluster {action} failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_restart_mid_stream_loses_nothing() {
    let _alone = crate::ALONE.lock().await;
    let db = PgDb::create("pgrestart").await;
    let name = unique("r");
    let slot = format!("outboxd_{name}");
    let dsn = db.dsn();
    let mut relay = Relay::start(&["run", "--source", &dsn, "--name", &name, "--commit-offsets"]);
    wait_for("slot active", T, || db.slot_active(&slot)).await;

    let mut client = db.client().await;
    let mut expected = write_events(&mut client, 100, 100, "before.restart").await;
    drop(client);
    // Restart while the relay is still working through the backlog.
    pg_ctl("restart");
    wait_for("Postgres back", T, || async {
        tokio_postgres::connect(PG_ADMIN, tokio_postgres::NoTls)
            .await
            .is_ok()
    })
    .await;
    let mut client = db.client().await;
    expected.extend(write_events(&mut client, 20, 100, "after.restart").await);

    wait_for("every event after the restart", T, || {
        let got: HashSet<Uuid> = relay
            .lines()
            .iter()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["id"]
                    .as_str()
                    .unwrap()
                    .parse()
                    .unwrap()
            })
            .collect();
        let all = expected.iter().all(|i| got.contains(i));
        async move { all }
    })
    .await;
    // The server's walsender holds a fast shutdown until the slot is confirmed up to the
    // shutdown checkpoint, which the relay cannot store any more: it must close the stream
    // (pg_ctl above gives up after 60 s otherwise).
    assert!(
        relay
            .stderr()
            .contains("the server is shutting down: closed the replication stream"),
        "the relay saw the shutdown and let the server stop: {}",
        relay.stderr()
    );
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr());
}
