//! Poll mode on MariaDB: several relays on one table, a crash between publish and mark, a
//! broker cut for one relay, and `setup --create-table --mode poll` / `check --mode poll`.

use crate::common;

use common::poll;
use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(120);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_share_a_table_each_event_once() {
    poll::three_relays_each_event_once(&MyDb::create("my_poll3").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_publish_and_mark_republishes() {
    poll::sigkill_between_publish_and_mark(&MyDb::create("my_pollkill").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relays_broker_cut_the_others_carry_on() {
    poll::one_relays_broker_cut(&MyDb::create("my_pollcut").await, "mypollcut").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_creates_the_seeds_table_and_check_validates_it() {
    let db = MyDb::create("my_pollsetup").await;
    let dsn = db.dsn();
    let mut c = db.conn().await;
    my_exec(&mut c, "DROP TABLE outbox").await;
    let run = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_outboxd"))
            .args(args)
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("migrations/mysql/001_outbox.sql"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = run(&[
        "setup",
        "--create-table",
        "--mode",
        "poll",
        "--source",
        &dsn,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("(created)"));
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("idx_dispatch") && text.contains("grants"),
        "{text}"
    );

    // Without the index: a failure with the statement that adds it.
    my_exec(&mut c, "ALTER TABLE outbox DROP KEY idx_dispatch").await;
    let out = run(&["check", "--mode", "poll", "--source", &dsn]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("ADD KEY idx_dispatch (`status`, `created_at`)"),
        "{text}"
    );
    // Without the status column: poll mode refuses to start, with the fix.
    my_exec(&mut c, "ALTER TABLE outbox DROP COLUMN status").await;
    let mut relay = Relay::start(&poll::stdout_args(&dsn, "s", "50ms", "10"));
    let code = relay.wait_exit(T).await;
    assert_eq!(code, 2, "{}", relay.stderr());
    assert!(
        relay
            .stderr()
            .contains("ADD COLUMN status ENUM('pending','published')"),
        "{}",
        relay.stderr()
    );

    // A user without UPDATE on the table: check says which GRANT is missing.
    let user = unique("pollro");
    let mut admin = my_connect(None).await;
    my_exec(
        &mut admin,
        &format!("CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'"),
    )
    .await;
    my_exec(&mut c, "ALTER TABLE outbox ADD COLUMN status ENUM('pending','published') NOT NULL DEFAULT 'pending', ADD KEY idx_dispatch (status, created_at)").await;
    my_exec(
        &mut admin,
        &format!("GRANT SELECT ON `{}`.* TO '{user}'@'%'", db.name),
    )
    .await;
    let ro = format!("mysql://{user}:pw@{MY_HOST}:{MY_PORT}/{}", db.name);
    let out = run(&["check", "--mode", "poll", "--source", &ro]);
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    my_exec(&mut admin, &format!("DROP USER '{user}'@'%'")).await;
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("GRANT SELECT, UPDATE ON"), "{text}");
}
