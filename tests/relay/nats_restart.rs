//! nats-server restarted mid-stream. The test starts a nats-server of its own (its own port
//! and store directory, so the shared one is never touched), kills it while the relay
//! publishes and starts it again on the same store: every event is stored exactly once. The
//! scenario runs on both sources.

use crate::common;

use common::nats::TestStream;
use common::source_db::SourceDb;
use common::*;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const T: Duration = Duration::from_secs(90);
const SERVER: &str = "/usr/sbin/nats-server";

fn serve(port: u16, store: &std::path::Path) -> Child {
    Command::new(SERVER)
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(store)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot start {SERVER}: {e}; install nats-server (scripts/services.sh does)")
        })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_loses_and_duplicates_nothing_postgres() {
    a_restarted_server_loses_and_duplicates_nothing::<PgDb>().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_loses_and_duplicates_nothing_mariadb() {
    a_restarted_server_loses_and_duplicates_nothing::<MyDb>().await
}

async fn a_restarted_server_loses_and_duplicates_nothing<D: SourceDb>() {
    let store = tempfile::tempdir().unwrap();
    let port = free_local_port();
    let mut server = serve(port, store.path());
    let db = D::create("natsr").await;
    let s = TestStream::on_port("nr", port).await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut args = vec![
        "run".to_string(),
        "--source".into(),
        dsn,
        "--name".into(),
        name.clone(),
        "--confirm-timeout".into(),
        "5s".into(),
    ];
    args.extend(s.args());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let sink = common::nats::url_via(port);
    let mut relay = Relay::start_with_env(&args, &[("OUTBOXD_SINK", &sink)]);
    db.wait_streaming(&name).await;
    let writer = db.write_in_background(40, 50, Duration::from_millis(25), "restart.stream");
    wait_for("500 messages before the restart", T, || async {
        s.len().await >= 500
    })
    .await;
    server.kill().unwrap();
    server.wait().unwrap();
    wait_for("the relay to notice", T, || {
        let e = relay.stderr();
        async move {
            e.contains("NATS connection lost") && e.contains("sink unavailable")
                || e.contains("sink still unavailable")
        }
    })
    .await;
    let mut server = serve(port, store.path());
    let expected = writer.await.unwrap();
    let s = TestStream {
        js: async_nats::jetstream::new(common::nats::connect_port(port).await),
        name: s.name.clone(),
        prefix: s.prefix.clone(),
        port,
    };
    wait_for("every event after the restart", T, || async {
        s.len().await >= expected.len() as u64
    })
    .await;
    relay.wait_for_stderr(&["sink recovered"], T).await;
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    assert!(relay.stderr().contains("sink recovered"));
    let (order, counts) = s.id_counts().await;
    assert!(counts.values().all(|n| *n == 1), "none stored twice");
    assert_eq!(order, expected, "every event once, in commit order");
    server.kill().unwrap();
    let _ = server.wait();
}
