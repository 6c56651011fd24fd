//! The version suite: the same test bodies as the rest of this binary, run against each
//! PostgreSQL major version of `scripts/services/postgres-versions.sh` (14, 16, 17, 18 on their
//! own loopback ports; the system 15 on 5432 runs everything else). Each version runs the
//! subset docs/testing.md lists: CDC end to end to stdout and to RabbitMQ (every contract
//! column), both first-start snapshot modes, SIGKILL and restart, a lost slot recovered
//! through the table, `check`, `status`/`teardown` and poll mode. A version whose server is
//! not running fails with the command that starts it.

use crate::common;
use common::{unique, PgDb, Relay, PG_VERSIONS};
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// The port of the private server of major version `major`.
pub(crate) fn port_of(major: u32) -> u16 {
    PG_VERSIONS
        .iter()
        .find(|(m, _)| *m == major)
        .map(|(_, p)| *p)
        .unwrap_or_else(|| panic!("no PostgreSQL {major} in PG_VERSIONS"))
}

/// Runs `outboxd ARGS…` to its end: (exit code, stdout, stderr).
async fn outboxd(args: &[&str]) -> (i32, String, String) {
    let mut r = Relay::start(args);
    let code = r.wait_exit(T).await;
    (code, r.lines().join("\n"), r.stderr())
}

/// `check` and `status` say which server they talk to, and show what only some versions have:
/// the 17+ slot columns, 18's idle-slot timeout.
async fn check_and_status_name_the_version(major: u32) {
    let db = PgDb::create_on(port_of(major), "vers").await;
    let (dsn, name) = (db.dsn(), unique("r"));
    let (code, _, err) = outboxd(&["setup", "--source", &dsn, "--name", &name]).await;
    assert_eq!(code, 0, "{err}");

    let (code, out, err) = outboxd(&["check", "--source", &dsn, "--name", &name]).await;
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(
        out.contains(&format!("ok   server version: PostgreSQL {major}.")),
        "{out}"
    );
    assert_eq!(
        out.contains("idle_replication_slot_timeout"),
        major >= 18,
        "{out}"
    );
    // Below 17 there are no failover slots to speak of.
    assert_eq!(out.contains("is not a failover slot"), major >= 17, "{out}");

    let (code, out, err) = outboxd(&["status", "--source", &dsn, "--name", &name]).await;
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("server           PostgreSQL {major}.")),
        "{out}"
    );
    assert_eq!(
        out.contains("slot (17+)       failover no, synced no"),
        major >= 17,
        "{out}"
    );
}

/// `setup --failover-slot`: a failover slot on 17+, refused below with nothing created.
async fn setup_failover_slot(major: u32) {
    let db = PgDb::create_on(port_of(major), "fslot").await;
    let (dsn, name) = (db.dsn(), unique("r"));
    let slot = format!("outboxd_{name}");
    let (code, out, err) = outboxd(&[
        "setup",
        "--failover-slot",
        "--source",
        &dsn,
        "--name",
        &name,
    ])
    .await;
    let failover: Option<bool> = common::pg_admin_connect(db.port)
        .await
        .query_opt(
            if major >= 17 {
                "SELECT failover FROM pg_replication_slots WHERE slot_name = $1"
            } else {
                "SELECT false FROM pg_replication_slots WHERE slot_name = $1"
            },
            &[&slot],
        )
        .await
        .unwrap()
        .map(|r| r.get(0));
    if major < 17 {
        assert_ne!(code, 0, "{out}");
        assert!(
            err.contains("--failover-slot needs PostgreSQL 17 or later"),
            "{err}"
        );
        assert_eq!(failover, None, "a refused setup created the slot");
        // Nor does it create the outbox table it was asked to create.
        let (code, _, err) = outboxd(&[
            "setup",
            "--failover-slot",
            "--create-table",
            "--table",
            "fresh_outbox",
            "--source",
            &dsn,
            "--name",
            &name,
        ])
        .await;
        assert_ne!(code, 0, "{err}");
        let created: Option<String> = db
            .client()
            .await
            .query_one("SELECT to_regclass('public.fresh_outbox')::text", &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(created, None, "a refused setup created the outbox table");
        return;
    }
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("replication slot {slot} (created, failover)")),
        "{out}"
    );
    assert_eq!(failover, Some(true));
    // Without synchronized_standby_slots the relay could publish what no standby has: warned.
    let (_, out, _) = outboxd(&["check", "--source", &dsn, "--name", &name]).await;
    assert!(
        out.contains("warn failover slot") && out.contains("synchronized_standby_slots"),
        "{out}"
    );
    // A second setup keeps it; status shows it.
    let (code, out, err) = outboxd(&[
        "setup",
        "--failover-slot",
        "--source",
        &dsn,
        "--name",
        &name,
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("(exists, failover)"), "{out}");
    let (_, out, _) = outboxd(&["status", "--source", &dsn, "--name", &name]).await;
    assert!(out.contains("failover yes"), "{out}");
}

/// The two 10,000-event end-to-end bodies, on the versions marked `long` (14 and 18, the
/// oldest and the newest): with them on 16 and 17 too, CI would pass its time budget
/// (docs/testing.md). Every other body runs on every version.
macro_rules! ten_thousand_events {
    (long) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn stdout_end_to_end() {
            crate::pg_stdout::ten_thousand_events_arrive_and_nothing_else_on(port()).await
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn rabbitmq_end_to_end_every_column() {
            crate::pg_rabbitmq::ten_thousand_events_arrive_exactly_as_the_contract_says_on(port())
                .await
        }
    };
    (short) => {};
}

/// One module per version (`pg14::…`, `pg16::…`): each test runs one shared body against
/// that version's server.
macro_rules! version_suite {
    ($($module:ident = $major:literal $long:ident),* $(,)?) => {$(
        mod $module {
            use crate::common::{self, PgDb};
            use crate::{pg_operator, pg_rabbitmq, pg_recovery};

            fn port() -> u16 {
                super::port_of($major)
            }

            ten_thousand_events!($long);

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sigkill_and_restart() {
                pg_rabbitmq::sigkill_mid_stream_loses_nothing_on(port()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn snapshot_pending() {
                pg_operator::first_start_publishes_pending_rows_only_on(port()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn snapshot_all_and_none() {
                pg_operator::first_start_without_a_status_column_on(port()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn lost_slot_recovered_through_the_table() {
                pg_recovery::a_dropped_slot_is_recovered_through_the_table_on(port()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn check() {
                pg_operator::check_reports_each_problem_with_its_fix_on(port()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn setup_status_teardown() {
                pg_operator::status_teardown_and_offset_on(port()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn check_and_status_name_the_version() {
                super::check_and_status_name_the_version($major).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn setup_failover_slot() {
                super::setup_failover_slot($major).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn poll_mode_sigkill_between_publish_and_mark() {
                common::poll::sigkill_between_publish_and_mark(
                    &PgDb::create_on(port(), "pollkill").await,
                )
                .await
            }
        }
    )*};
}

version_suite!(pg14 = 14 long, pg16 = 16 short, pg17 = 17 short, pg18 = 18 long);
