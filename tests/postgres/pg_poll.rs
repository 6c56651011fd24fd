//! Poll mode on Postgres: several relays on one table, crashes between publish and mark, a
//! broker cut for one relay, and NOTIFY waking a poller early.

use crate::common;

use common::poll::{self, ids};
use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(90);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_relays_share_a_table_each_event_once() {
    poll::three_relays_each_event_once(&PgDb::create("poll3").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_between_publish_and_mark_republishes() {
    poll::sigkill_between_publish_and_mark(&PgDb::create("pollkill").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relays_broker_cut_the_others_carry_on() {
    poll::one_relays_broker_cut(&PgDb::create("pollcut").await, "pollcut").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_a_poller_before_its_interval() {
    let db = PgDb::create("pollnotify").await;
    let dsn = db.dsn();
    let mut setup = Relay::start(&["setup", "--mode", "poll", "--notify", "--source", &dsn]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let relay = Relay::start(&[
        "run",
        "--mode",
        "poll",
        "--notify",
        "--source",
        &dsn,
        "--name",
        "n",
        "--commit-offsets",
        "--poll-interval",
        "1h",
    ]);
    // The first poll happens at start; after it the relay sleeps for an hour unless woken.
    wait_for("the LISTEN session", T, || async {
        pg_connect(PG_ADMIN)
            .await
            .query_opt("SELECT 1 FROM pg_stat_activity WHERE application_name = 'outboxd_listen' AND datname = $1", &[&db.name])
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let mut client = db.client().await;
    let id = write_events(&mut client, 1, 1, "notify").await;
    wait_for(
        "the event, long before the hour",
        Duration::from_secs(10),
        || {
            let n = relay.line_count();
            async move { n >= 1 }
        },
    )
    .await;
    assert_eq!(ids(&relay), id);
}

/// The role `scripts/services.sh` lets in over TLS only (`hostssl … trust`, `host … reject`).
const TLS_ONLY_ROLE: &str = "outboxd_tls_only";

/// `--mode poll --notify` as a role the server admits over TLS only: the claim session and the
/// LISTEN session both connect (encrypted, verified against the test CA) and NOTIFY wakes the
/// poller. A plain connection as that role is refused first, so the server really demands TLS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_listens_over_tls_when_the_server_allows_only_tls() {
    let db = PgDb::create("polltls").await;
    let plain = tokio_postgres::connect(
        &format!(
            "host=127.0.0.1 port=5432 user={TLS_ONLY_ROLE} dbname={} sslmode=disable",
            db.name
        ),
        tokio_postgres::NoTls,
    )
    .await;
    match plain {
        Ok(_) => panic!(
            "{TLS_ONLY_ROLE} logged in without TLS: pg_hba.conf lacks the hostssl-only lines. \
             Run `sudo scripts/services.sh`"
        ),
        Err(e) => assert!(
            format!("{e:?}").contains("no encryption"),
            "{TLS_ONLY_ROLE} must be refused for lack of TLS (run `sudo scripts/services.sh`): {e:?}"
        ),
    }
    let mut setup = Relay::start(&["setup", "--mode", "poll", "--notify", "--source", &db.dsn()]);
    assert_eq!(setup.wait_exit(T).await, 0, "{}", setup.stderr());
    let dsn = format!(
        "postgres://{TLS_ONLY_ROLE}@127.0.0.1:5432/{}?sslmode=verify-full&sslrootcert={}",
        db.name,
        tls_file("ca.crt")
    );
    let relay = Relay::start(&[
        "run",
        "--mode",
        "poll",
        "--notify",
        "--source",
        &dsn,
        "--name",
        "t",
        "--commit-offsets",
        "--poll-interval",
        "1h",
    ]);
    wait_for("the LISTEN session, over TLS", T, || async {
        pg_connect(PG_ADMIN)
            .await
            .query_opt(
                "SELECT 1 FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid) \
                 WHERE a.application_name = 'outboxd_listen' AND a.datname = $1 \
                 AND a.usename = $2 AND s.ssl",
                &[&db.name, &TLS_ONLY_ROLE],
            )
            .await
            .unwrap()
            .is_some()
    })
    .await;
    let mut client = db.client().await;
    let id = write_events(&mut client, 1, 1, "tls").await;
    wait_for(
        "the event, woken by NOTIFY long before the hour",
        Duration::from_secs(20),
        || {
            let n = relay.line_count();
            async move { n >= 1 }
        },
    )
    .await;
    assert_eq!(ids(&relay), id);
    assert!(
        !relay.stderr().contains("LISTEN session ended"),
        "{}",
        relay.stderr()
    );
}
