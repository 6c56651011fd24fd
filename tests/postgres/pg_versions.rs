//! The version suite: the same test bodies as the rest of this binary, run against each
//! PostgreSQL major version of `scripts/services/postgres-versions.sh` (14, 16, 17, 18 on their
//! own loopback ports; the system 15 on 5432 runs everything else). Each version runs the
//! subset docs/testing.md lists: CDC end to end to stdout and to RabbitMQ (every contract
//! column), both first-start snapshot modes, SIGKILL and restart, a lost slot recovered
//! through the table, `check`, `status`/`teardown` and poll mode. A version whose server is
//! not running fails with the command that starts it.

use crate::common;
use common::PG_VERSIONS;

/// The port of the private server of major version `major`.
pub(crate) fn port_of(major: u32) -> u16 {
    PG_VERSIONS
        .iter()
        .find(|(m, _)| *m == major)
        .map(|(_, p)| *p)
        .unwrap_or_else(|| panic!("no PostgreSQL {major} in PG_VERSIONS"))
}

/// One module per version (`pg14::…`, `pg16::…`): each test runs one shared body against
/// that version's server.
macro_rules! version_suite {
    ($($module:ident = $major:literal),* $(,)?) => {$(
        mod $module {
            use crate::common::{self, PgDb};
            use crate::{pg_operator, pg_rabbitmq, pg_recovery, pg_stdout};

            fn port() -> u16 {
                super::port_of($major)
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn stdout_end_to_end() {
                pg_stdout::ten_thousand_events_arrive_and_nothing_else_on(port()).await
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rabbitmq_end_to_end_every_column() {
                pg_rabbitmq::ten_thousand_events_arrive_exactly_as_the_contract_says_on(port()).await
            }

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
            async fn poll_mode_sigkill_between_publish_and_mark() {
                common::poll::sigkill_between_publish_and_mark(
                    &PgDb::create_on(port(), "pollkill").await,
                )
                .await
            }
        }
    )*};
}

version_suite!(pg14 = 14, pg16 = 16, pg17 = 17, pg18 = 18);
