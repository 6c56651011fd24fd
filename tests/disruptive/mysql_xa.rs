//! XA transactions on the live MariaDB server → stdout sink: a two-phase XA transaction is
//! published once, at its XA COMMIT and in commit order; a prepared one that is rolled back
//! never; a one-phase one at once; and a relay killed while one is prepared keeps its stored
//! position before the prepare, so the next relay still publishes it at its commit.
//!
//! A start never takes a position after an open XA transaction's prepare that wrote the
//! outbox (refused with the statements that end it); a prepare that holds the position back
//! is shown (metric, WARN, `status`) and bounded by `--xa-prepare-limit`.
//!
//! A prepared XA transaction with outbox rows holds back the stored position of the relays
//! that read it, and an older relay (or one of another build) holds its position for any
//! prepare, so these tests take the `disruptive` binary's lock ([`crate::ALONE`]): beside
//! them, another test's check that a stopped relay stored the head would fail.

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
    let stmts: Vec<String> = rows.iter().map(|r| insert(r)).collect();
    prepare_sql(db, xid, &stmts).await;
}

/// As [`prepare`], with any statements inside the XA transaction.
async fn prepare_sql(db: &MyDb, xid: &str, stmts: &[String]) {
    let mut c = db.conn().await;
    my_exec(&mut c, &format!("XA START '{xid}'")).await;
    for s in stmts {
        my_exec(&mut c, s).await;
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

/// Rolls back, at the end of a test, the XA transactions it prepared and may have left open
/// (a failed assertion would leave them holding relays' positions on the shared server).
struct EndXas(Vec<String>);

impl Drop for EndXas {
    fn drop(&mut self) {
        let xids = std::mem::take(&mut self.0);
        run_detached(async move {
            use mysql_async::prelude::Queryable;
            let mut c = my_connect(None).await;
            for x in xids {
                let _ = c.query_drop(format!("XA ROLLBACK '{x}'")).await;
            }
        });
    }
}

/// An XID as the relay writes it (and as `XA COMMIT` takes it): `X'gtrid',X'',1`.
fn xid_text(xid: &str) -> String {
    let hex: String = xid.bytes().map(|b| format!("{b:02x}")).collect();
    format!("X'{hex}',X'',1")
}

/// Runs an outboxd command to its end: (exit code, stdout, stderr without colours).
async fn command(args: &[&str]) -> (i32, String, String) {
    let mut c = Relay::start(args);
    let code = c.wait_exit(T).await;
    (code, c.lines().join("\n"), c.stderr_plain())
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xa_first_start_refuses_while_an_xa_prepared_before_it_wrote_the_outbox() {
    let _alone = crate::ALONE.lock().await;
    let db = MyDb::create("my_xa_first").await;
    let name = unique("r");
    let dsn = db.dsn();
    let args = run_args(&dsn, &name);
    let (ours, theirs) = (unique("xa_ours"), unique("xa_theirs"));
    let _end = EndXas(vec![ours.clone(), theirs.clone()]);
    // Another application's XA transaction, on a table of its own: it can publish nothing.
    exec(&db, "CREATE TABLE other (a INT)").await;
    prepare_sql(&db, &theirs, &["INSERT INTO other VALUES (1)".to_string()]).await;
    // Prepared before the first start, committed after it: its row is in the binlog before
    // the start position, and not in the snapshot (not committed yet).
    prepare(&db, &ours, &["B1"]).await;

    let mut first = Relay::start(&args);
    let code = first.wait_exit(T).await;
    let err = first.stderr_plain();
    assert_ne!(code, 0, "the first start must refuse; stderr:\n{err}");
    assert!(
        err.contains(&format!(
            "XA COMMIT {}; or XA ROLLBACK {0};",
            xid_text(&ours)
        )),
        "the refusal names the XID and the statements that end it:\n{err}"
    );
    let refusal = err
        .lines()
        .find(|l| l.contains("XA transaction(s) prepared before the start position"))
        .unwrap_or_else(|| panic!("no refusal in:\n{err}"));
    assert!(refusal.contains(&xid_text(&ours)), "{refusal}");
    assert!(
        !refusal.contains(&xid_text(&theirs)),
        "a transaction that wrote no outbox table is no reason to refuse:\n{refusal}"
    );
    assert_eq!(first.line_count(), 0);

    // The fix: end it, start again. Its row is now committed, so the snapshot has it; the other
    // application's prepare, still open, does not stop the start.
    exec(&db, &format!("XA COMMIT '{ours}'")).await;
    let mut again = start_streaming(&db, &args).await;
    exec(&db, &insert("M")).await;
    let lines = again.lines_then_stop(2, T).await;
    assert_eq!(tags(&lines), ["B1", "M"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xa_offset_set_refuses_a_position_after_an_open_prepare_and_names_the_one_before() {
    let _alone = crate::ALONE.lock().await;
    let db = MyDb::create("my_xa_offset").await;
    let name = unique("r");
    let dsn = db.dsn();
    let xid = unique("xa_set");
    let _end = EndXas(vec![xid.clone()]);
    let before = head().await;
    prepare(&db, &xid, &["S1"]).await;
    let start = xa_start_position(&before, &xid).await;
    let after = head().await;

    let set = |at: String| {
        let dsn = dsn.clone();
        let name = name.clone();
        async move {
            command(&[
                "offset",
                "set",
                "--source",
                &dsn,
                "--name",
                &name,
                "--binlog-position",
                &at,
            ])
            .await
        }
    };
    let (code, _, err) = set(format!("{}:{}", after.0, after.1)).await;
    assert_ne!(
        code, 0,
        "a position after the open prepare is refused:\n{err}"
    );
    assert!(
        err.contains(&format!(
            "XA COMMIT {}; or XA ROLLBACK {0};",
            xid_text(&xid)
        )),
        "{err}"
    );
    let named = format!("--binlog-position {}:{}", start.0, start.1);
    assert!(err.contains(&named), "the fix names {named}:\n{err}");
    assert_eq!(db.stored(&name).await, None, "nothing stored");

    // The position the fix names is taken, and the next start publishes the row at its commit.
    let (code, out, err) = set(format!("{}:{}", start.0, start.1)).await;
    assert_eq!(code, 0, "{out}\n{err}");
    let mut relay = start_streaming(&db, &run_args(&dsn, &name)).await;
    exec(&db, &format!("XA COMMIT '{xid}'")).await;
    let lines = relay.lines_then_stop(1, T).await;
    assert_eq!(tags(&lines), ["S1"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xa_a_prepare_that_holds_the_position_is_shown_and_stops_the_relay_at_the_limit() {
    let _alone = crate::ALONE.lock().await;
    let db = MyDb::create("my_xa_pin").await;
    let name = unique("r");
    let dsn = db.dsn();
    let port = free_local_port().to_string();
    let addr = format!("127.0.0.1:{port}");
    let mut args = run_args(&dsn, &name);
    args.extend(["--metrics-addr", &addr]);
    let mut relay = start_streaming(&db, &args).await;

    let (ours, theirs) = (unique("xa_pin"), unique("xa_rowless"));
    let _end = EndXas(vec![ours.clone(), theirs.clone()]);
    exec(&db, "CREATE TABLE other (a INT)").await;
    // Prepared first, but it wrote no outbox row: it holds nothing back.
    prepare_sql(&db, &theirs, &["INSERT INTO other VALUES (1)".to_string()]).await;
    let before = head().await;
    prepare(&db, &ours, &["P1"]).await;
    let floor = xa_start_position(&before, &ours).await;
    exec(&db, &insert("N1")).await;
    wait_for_or_show(&relay, "N1 to be published", || relay.line_count() >= 1).await;
    wait_for(
        "the position to be stored at the prepare with outbox rows",
        T,
        || async {
            db.stored(&name)
                .await
                .is_some_and(|(f, p, _)| f == floor.0 && p >= floor.1)
        },
    )
    .await;
    let stored = db.stored(&name).await.unwrap();
    assert_eq!(
        (stored.0.clone(), stored.1),
        floor,
        "held before its prepare"
    );

    // The metric, from the prepare's time on the server.
    let series = "outboxd_xa_prepared_oldest_age_seconds";
    wait_for("the prepare's age in the metrics", T, || {
        let port = port.parse().unwrap();
        async move { metric_value(&scrape_metrics(port).await, series).is_some_and(|v| v >= 1.0) }
    })
    .await;
    // The WARN once it is older than 10 s, naming it and the statements that end it.
    relay
        .wait_for_stderr(
            &[
                "holds outbox rows",
                &format!("XA COMMIT {};", xid_text(&ours)),
            ],
            T,
        )
        .await;
    assert!(
        !relay.stderr_plain().contains(&xid_text(&theirs)),
        "only the prepare that holds the position is reported:\n{}",
        relay.stderr_plain()
    );
    // `status` names it too.
    let (code, out, err) = command(&["status", "--source", &dsn, "--name", &name]).await;
    assert_eq!(code, 0, "{err}");
    let line = out
        .lines()
        .find(|l| l.starts_with("xa prepare"))
        .unwrap_or_else(|| panic!("no xa prepare line in status:\n{out}"));
    assert!(line.contains(&xid_text(&ours)), "{line}");
    assert!(line.contains("s ago"), "{line}");
    // `check` lists the open prepares with the statements that end them.
    let (_, out, err) = command(&["check", "--source", &dsn, "--name", &name]).await;
    let xa_line = out
        .lines()
        .find(|l| l.contains("prepared XA"))
        .unwrap_or_else(|| panic!("no prepared XA check:\n{out}\n{err}"));
    assert!(xa_line.starts_with("warn"), "{xa_line}");
    assert!(xa_line.contains(&xid_text(&ours)), "{xa_line}");
    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "{}", relay.stderr_plain());

    // Past --xa-prepare-limit the relay stops with the fix; the position stays before the
    // prepare, so nothing is lost.
    let mut limited = args.clone();
    limited.extend(["--xa-prepare-limit", "5s"]);
    let mut stopped = Relay::start(&limited);
    let code = stopped.wait_exit(T).await;
    let err = stopped.stderr_plain();
    assert_ne!(code, 0, "{err}");
    assert!(err.contains("--xa-prepare-limit"), "{err}");
    assert!(
        err.contains(&format!(
            "XA COMMIT {}; or XA ROLLBACK {0};",
            xid_text(&ours)
        )),
        "{err}"
    );
    let stored = db.stored(&name).await.unwrap();
    assert_eq!(
        (stored.0.clone(), stored.1),
        floor,
        "still before the prepare"
    );

    // Ended, the next start publishes its row.
    exec(&db, &format!("XA COMMIT '{ours}'")).await;
    let mut again = start_streaming(&db, &run_args(&dsn, &name)).await;
    wait_for_or_show(&again, "P1 to be published", || {
        tags(&again.lines()).contains(&"P1".to_string())
    })
    .await;
    again.signal("TERM");
    assert_eq!(again.wait_exit(T).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn xa_release_moves_the_position_past_an_expired_prepare_and_names_it() {
    let _alone = crate::ALONE.lock().await;
    let db = MyDb::create("my_xa_release").await;
    let name = unique("r");
    let dsn = db.dsn();
    let mut args = run_args(&dsn, &name);
    args.extend([
        "--xa-prepare-limit",
        "3s",
        "--xa-prepare-expired",
        "release",
    ]);
    let mut relay = start_streaming(&db, &args).await;

    let xid = unique("xa_rel");
    let _end = EndXas(vec![xid.clone()]);
    let before = head().await;
    prepare(&db, &xid, &["R1"]).await;
    let floor = xa_start_position(&before, &xid).await;
    exec(&db, &insert("N1")).await;
    wait_for_or_show(&relay, "N1 to be published", || relay.line_count() >= 1).await;
    let after = head().await;
    relay
        .wait_for_stderr(&["XA PREPARE GIVEN UP", &xid_text(&xid)], T)
        .await;
    // No longer held: the position passes the prepare and N1.
    wait_for(
        "the position to move past the given-up prepare",
        T,
        || async {
            db.stored(&name)
                .await
                .is_some_and(|(f, p, _)| binlog_ge(&(f, p), &after))
        },
    )
    .await;
    assert!(binlog_ge(&after, &floor));
    // Its commit, read while this relay runs, still publishes its row.
    exec(&db, &format!("XA COMMIT '{xid}'")).await;
    let lines = relay.lines_then_stop(2, T).await;
    assert_eq!(tags(&lines), ["N1", "R1"]);
}
