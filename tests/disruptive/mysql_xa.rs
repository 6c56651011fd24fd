//! XA transactions on the live MariaDB server → stdout sink: a two-phase XA transaction is
//! published once, at its XA COMMIT and in commit order; a prepared one that is rolled back
//! never; a one-phase one at once; and a relay killed while one is prepared keeps its stored
//! position before the prepare, so the next relay still publishes it at its commit.
//!
//! A prepared XA transaction holds back the stored position of every relay on the server (no
//! relay can know it holds no outbox row until it ends), so these tests take the
//! `disruptive` binary's lock ([`crate::ALONE`]): beside them, another test's check that a
//! stopped relay stored the head would fail.

use crate::common;

use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);

fn run_args<'a>(dsn: &'a str, name: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--source",
        dsn,
        "--name",
        name,
        "--commit-offsets",
        "--log-level",
        "info",
    ]
}

/// One outbox row whose payload is `{"n": tag}`, in the session's open transaction.
fn insert(tag: &str) -> String {
    format!(
        "INSERT INTO outbox (id, aggregate_id, topic, payload, created_at) \
         VALUES (UNHEX(REPLACE(UUID(), '-', '')), 1, 'xa.test', '{{\"n\": \"{tag}\"}}', NOW(6))"
    )
}

/// The `n` of each stdout line's payload, in the order written.
fn tags(lines: &[String]) -> Vec<String> {
    lines
        .iter()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["payload"]["n"].as_str().unwrap().to_string()
        })
        .collect()
}

/// Runs `XA START; <rows>; XA END; XA PREPARE` for `xid` in a session of its own (a prepared
/// XA transaction outlives its session on MariaDB 10.5+).
async fn prepare(db: &MyDb, xid: &str, rows: &[&str]) {
    let mut c = db.conn().await;
    my_exec(&mut c, &format!("XA START '{xid}'")).await;
    for r in rows {
        my_exec(&mut c, &insert(r)).await;
    }
    my_exec(&mut c, &format!("XA END '{xid}'")).await;
    my_exec(&mut c, &format!("XA PREPARE '{xid}'")).await;
    // Another session may end a prepared XA transaction only once the server has detached it
    // from this one (XAER_NOTA before that): disconnect and wait until the session is gone.
    let id = my_value(&mut c, "SELECT CONNECTION_ID()").await.unwrap();
    c.disconnect().await.unwrap();
    let mut admin = db.conn().await;
    let gone = format!("SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = {id}");
    let deadline = std::time::Instant::now() + T;
    while my_value(&mut admin, &gone).await.as_deref() != Some("0") {
        assert!(
            std::time::Instant::now() < deadline,
            "session {id} still open {T:?} after it disconnected"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn exec(db: &MyDb, sql: &str) {
    let mut c = db.conn().await;
    my_exec(&mut c, sql).await;
}

/// Waits for `cond`; on a timeout, fails with the relay's log.
async fn wait_for_or_show(relay: &Relay, what: &str, cond: impl Fn() -> bool) {
    let deadline = std::time::Instant::now() + T;
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out after {T:?} waiting for {what}; relay log:\n{}",
            relay.stderr_plain()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn start_streaming(db: &MyDb, args: &[&str]) -> Relay {
    let relay = Relay::start(args);
    wait_for("the relay's binlog dump to be connected", T, || {
        db.streaming()
    })
    .await;
    relay
}

/// Where the GTID event of the XA transaction `xid` starts (the position before its
/// prepare), from the server's own listing of the binlog.
async fn xa_start_position(from: &(String, u64), xid: &str) -> (String, u64) {
    use mysql_async::prelude::Queryable;
    let hex: String = xid.bytes().map(|b| format!("{b:02X}")).collect();
    let mut c = my_connect(None).await;
    let rows: Vec<mysql_async::Row> = c
        .query(format!(
            "SHOW BINLOG EVENTS IN '{}' FROM {}",
            from.0, from.1
        ))
        .await
        .unwrap();
    for r in rows {
        let pos: u64 = r.get::<u64, _>("Pos").unwrap();
        // Other databases' statements may hold bytes that are not UTF-8: read them as bytes.
        let info = r
            .get_opt::<Vec<u8>, _>("Info")
            .and_then(Result::ok)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default();
        if info
            .to_ascii_uppercase()
            .contains(&format!("XA START X'{hex}'"))
        {
            return (from.0.clone(), pos);
        }
    }
    panic!("no XA START X'{hex}' in {}:{} onwards", from.0, from.1);
}

async fn head() -> (String, u64) {
    use mysql_async::prelude::Queryable;
    let mut c = my_connect(None).await;
    let row: mysql_async::Row = c.query_first("SHOW MASTER STATUS").await.unwrap().unwrap();
    (
        row.get::<String, _>(0).unwrap(),
        row.get::<u64, _>(1).unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xa_rows_are_published_at_commit_in_commit_order_and_never_when_rolled_back() {
    let _alone = crate::ALONE.lock().await;
    let db = MyDb::create("my_xa").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;

    // Prepared first, committed after an ordinary transaction.
    // XIDs are global to the server: each run has its own.
    let (two, gone, one) = (unique("xa_two"), unique("xa_gone"), unique("xa_one"));
    prepare(&db, &two, &["A1", "A2"]).await;
    exec(&db, &insert("N1")).await;
    // Prepared, then rolled back: never.
    prepare(&db, &gone, &["R1"]).await;
    exec(&db, &format!("XA ROLLBACK '{gone}'")).await;
    // The ordinary transaction is out while the XA transaction is still only prepared.
    wait_for_or_show(&relay, "N1 to be published", || relay.line_count() >= 1).await;
    assert_eq!(
        tags(&relay.lines()),
        ["N1"],
        "nothing of a prepared XA transaction"
    );
    exec(&db, &format!("XA COMMIT '{two}'")).await;
    // One phase: an ordinary commit.
    {
        let mut c = db.conn().await;
        my_exec(&mut c, &format!("XA START '{one}'")).await;
        my_exec(&mut c, &insert("O1")).await;
        my_exec(&mut c, &format!("XA END '{one}'")).await;
        my_exec(&mut c, &format!("XA COMMIT '{one}' ONE PHASE")).await;
    }
    exec(&db, &insert("M")).await;
    let lines = relay.lines_then_stop(5, T).await;
    assert_eq!(tags(&lines), ["N1", "A1", "A2", "O1", "M"]);
    // The XA rows sit at their commit's position, numbered within it.
    let pos = |l: &String| {
        let v: serde_json::Value = serde_json::from_str(l).unwrap();
        v["position"].as_str().unwrap_or_default().to_string()
    };
    let (a1, a2, n1) = (pos(&lines[1]), pos(&lines[2]), pos(&lines[0]));
    assert!(
        a1 > n1 && a2 > a1,
        "positions follow commit order: {n1} {a1} {a2}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_while_an_xa_is_prepared_keeps_its_position_before_the_prepare() {
    let _alone = crate::ALONE.lock().await;
    let db = MyDb::create("my_xa_kill").await;
    let name = unique("r");
    let dsn = db.dsn();
    let args = run_args(&dsn, &name);
    let mut relay = start_streaming(&db, &args).await;

    let before = head().await;
    let xid = unique("xa_held");
    prepare(&db, &xid, &["P1"]).await;
    let floor = xa_start_position(&before, &xid).await;
    exec(&db, &insert("N1")).await;
    exec(&db, &insert("N2")).await;
    wait_for_or_show(&relay, "N1 and N2 to be published", || {
        relay.line_count() >= 2
    })
    .await;
    assert_eq!(tags(&relay.lines()), ["N1", "N2"]);
    // Confirmed and stored: the position stops at the prepare's start, not after N2.
    wait_for("the position to be stored at the prepare", T, || async {
        db.stored(&name)
            .await
            .is_some_and(|(f, p, _)| f == floor.0 && p >= floor.1)
    })
    .await;
    let stored = db.stored(&name).await.unwrap();
    assert_eq!(
        (stored.0.clone(), stored.1),
        floor,
        "held before the prepare"
    );
    relay.sigkill();

    exec(&db, &format!("XA COMMIT '{xid}'")).await;
    exec(&db, &insert("M")).await;
    let mut again = start_streaming(&db, &args).await;
    // The prepare is read again, so its rows come at the commit; N1 and N2 come twice (read
    // again from the held position): duplicates, never a loss.
    let lines = again.lines_then_stop(4, T).await;
    assert_eq!(tags(&lines), ["N1", "N2", "P1", "M"]);
}
