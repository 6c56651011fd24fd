//! Crash loops on both sources (stdout sink with `--commit-offsets`): a producer commits a few
//! hundred single-row transactions per second while the relay is SIGKILLed and restarted at
//! once, each life lasting well under two seconds, most under one. Every committed event must be
//! delivered, and the duplicates stay within the window plus a store period's traffic per kill
//! (docs/guarantees.md). A first start that is killed is the hard case: its start position (and
//! its snapshot's progress) must be durable before it publishes anything.

use crate::common;

use common::killloop::{self, Plan};
use common::*;
use std::time::Duration;

const RATE: u32 = 300;
const WINDOW: usize = 100;
/// Per SIGKILL: the window, plus what the producer commits in this long (the store period is
/// 100 ms, the acknowledgement period another 100 ms; the rest is slack for a loaded machine).
const TRAFFIC: Duration = Duration::from_millis(500);
const PREFILL: usize = 2000;

fn ms(v: &[u64]) -> Vec<Duration> {
    v.iter().map(|&m| Duration::from_millis(m)).collect()
}

fn plan(lives: &[u64], produce_after: Option<&'static str>) -> Plan {
    Plan {
        kills: 12,
        lives: ms(lives),
        rate: RATE,
        produce_after,
    }
}

fn args<'a>(dsn: &'a str, name: &'a str, snapshot: &'a str) -> Vec<&'a str> {
    vec![
        "run",
        "--source",
        dsn,
        "--name",
        name,
        "--commit-offsets",
        "--window",
        "100",
        "--snapshot",
        snapshot,
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_loop_from_a_first_start_never() {
    let mut db = PgDb::create("kl_pg_never").await;
    let name = unique("kl");
    db.slots.push(format!("outboxd_{name}"));
    let dsn = db.dsn();
    let out = killloop::run(
        &args(&dsn, &name, "never"),
        &plan(&[400, 700, 500, 900, 600, 800], Some("resuming")),
        Vec::new(),
        || killloop::pg_producer(&db, RATE, "kl.pg"),
    )
    .await;
    out.assert_within(WINDOW, TRAFFIC, 0);
    // Most lives store progress for the next (a few may die before their first event).
    out.assert_progress(out.kills / 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_loop_from_a_first_start_with_a_snapshot() {
    let mut db = PgDb::create("kl_pg_all").await;
    let name = unique("kl");
    db.slots.push(format!("outboxd_{name}"));
    let dsn = db.dsn();
    let mut client = db.client().await;
    let before = write_events(&mut client, 1, PREFILL, "kl.pg.before").await;
    let out = killloop::run(
        &args(&dsn, &name, "all"),
        &plan(&[500, 800, 600, 900, 700], None),
        before,
        || killloop::pg_producer(&db, RATE, "kl.pg"),
    )
    .await;
    // A restart mid-snapshot may read again what the stream from the start position also
    // carries (what was committed since): at most once more in all.
    out.assert_within(WINDOW, TRAFFIC, PREFILL);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_crash_loop_from_a_first_start_never() {
    let db = MyDb::create("kl_my_never").await;
    let name = unique("kl");
    let dsn = db.dsn();
    let out = killloop::run(
        &args(&dsn, &name, "never"),
        &plan(&[400, 700, 500, 900, 600, 800], Some("resuming")),
        Vec::new(),
        || killloop::my_producer(&db, RATE, "kl.my"),
    )
    .await;
    out.assert_within(WINDOW, TRAFFIC, 0);
    // Most lives store progress for the next (a few may die before their first event).
    out.assert_progress(out.kills / 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_crash_loop_from_a_first_start_with_a_snapshot() {
    let db = MyDb::create("kl_my_all").await;
    let name = unique("kl");
    let dsn = db.dsn();
    let mut conn = db.conn().await;
    let before = my_write_events(&mut conn, 1, PREFILL, "kl.my.before").await;
    let out = killloop::run(
        &args(&dsn, &name, "all"),
        &plan(&[500, 800, 600, 900, 700], None),
        before,
        || killloop::my_producer(&db, RATE, "kl.my"),
    )
    .await;
    out.assert_within(WINDOW, TRAFFIC, PREFILL);
}
