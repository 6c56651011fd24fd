//! TLS to MariaDB for every connection the relay makes (SQL sessions, state, binlog dump),
//! against the test CA of `scripts/services.sh`: MariaDB's certificate is signed by `ca.crt` and
//! names `localhost` and `127.0.0.1`; `ca-other.crt` signed nothing here. The relay logs in as
//! a user created `REQUIRE SSL`, so a connection that is not encrypted is refused by the server:
//! events arriving prove the whole relay ran over TLS.
//!
//! - `ssl-mode=VERIFY_CA` and `VERIFY_IDENTITY` (to `localhost`) with the CA, and `REQUIRED`
//!   without one: events arrive;
//! - the wrong CA: refused with exit 2, naming TLS and the fix, the password nowhere in the
//!   output.

use crate::common;

use common::*;
use mysql_async::prelude::Queryable;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);
const PASSWORD: &str = "my-tls-pw-Qa73";

/// A user that can log in only over TLS, with the grants the relay needs; dropped at the end.
struct TlsUser {
    name: String,
}

impl TlsUser {
    async fn create(db: &MyDb) -> TlsUser {
        let name = unique("tls");
        let mut c = my_connect(None).await;
        my_exec(
            &mut c,
            &format!(
                "CREATE USER '{name}'@'%' IDENTIFIED BY '{PASSWORD}' REQUIRE SSL;
                 GRANT ALL ON `{}`.* TO '{name}'@'%';
                 GRANT REPLICATION SLAVE, REPLICATION CLIENT, BINLOG MONITOR ON *.* TO '{name}'@'%'",
                db.name
            ),
        )
        .await;
        // The server itself refuses this user without TLS: what passes below passed over TLS.
        let plain = mysql_async::Conn::new(
            mysql_async::OptsBuilder::default()
                .ip_or_hostname(MY_HOST)
                .tcp_port(MY_PORT)
                .user(Some(name.clone()))
                .pass(Some(PASSWORD))
                .prefer_socket(false),
        )
        .await;
        assert!(
            plain.is_err(),
            "a REQUIRE SSL user logged in without TLS: is TLS on in MariaDB? Run `sudo scripts/services.sh`"
        );
        TlsUser { name }
    }

    fn dsn(&self, host: &str, db: &MyDb, query: &str) -> String {
        format!(
            "mysql://{}:{PASSWORD}@{host}:{MY_PORT}/{}?{query}",
            self.name, db.name
        )
    }
}

impl Drop for TlsUser {
    fn drop(&mut self) {
        let name = self.name.clone();
        run_detached(async move {
            let mut c = my_connect(None).await;
            let _ = c
                .query_drop(format!("DROP USER IF EXISTS '{name}'@'%'"))
                .await;
            let _ = c.disconnect().await;
        });
    }
}

/// Runs a relay on `dsn` (from the environment, never argv) and checks that events written
/// after it streams all arrive.
async fn relays_over_tls(prefix: &str, host: &str, query: &str) {
    let db = MyDb::create(prefix).await;
    let user = TlsUser::create(&db).await;
    let dsn = user.dsn(host, &db, query);
    let name = unique("r");
    let relay = Relay::start_with_env(
        &["run", "--name", &name, "--commit-offsets"],
        &[("OUTBOXD_SOURCE", &dsn)],
    );
    wait_for("the relay's binlog dump over TLS", T, || db.streaming()).await;
    let mut c = db.conn().await;
    let expected = my_write_events(&mut c, 4, 25, "tls.event").await;
    wait_all_printed(&[&relay], &expected, T).await;
    assert!(
        !relay.stderr().contains(PASSWORD),
        "the password is never printed"
    );
    // The state (lease, position) went through TLS as well.
    wait_for("a stored position", T, || {
        let db = &db;
        let name = name.clone();
        async move { db.stored(&name).await.is_some() }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_ca_with_the_test_ca_relays_over_tls() {
    let ca = tls_file("ca.crt");
    relays_over_tls(
        "my_tls_ca",
        MY_HOST,
        &format!("ssl-mode=VERIFY_CA&ssl-ca={ca}"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_identity_to_localhost_relays_over_tls() {
    let ca = tls_file("ca.crt");
    relays_over_tls(
        "my_tls_id",
        "localhost",
        &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_without_a_ca_relays_over_tls() {
    relays_over_tls("my_tls_req", MY_HOST, "ssl-mode=REQUIRED").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wrong_ca_is_refused_with_the_fix() {
    let other = tls_file("ca-other.crt");
    let db = MyDb::create("my_tls_bad").await;
    let user = TlsUser::create(&db).await;
    for mode in ["VERIFY_CA", "VERIFY_IDENTITY", "REQUIRED"] {
        let dsn = user.dsn("localhost", &db, &format!("ssl-mode={mode}&ssl-ca={other}"));
        let mut relay = Relay::start_with_env(
            &["run", "--name", &unique("r")],
            &[("OUTBOXD_SOURCE", &dsn)],
        );
        let code = relay.wait_exit(T).await;
        let err = relay.stderr();
        assert_eq!(code, 2, "{mode}: {err}");
        assert!(err.contains("MySQL TLS"), "{mode}: names TLS: {err}");
        assert!(err.contains("ssl-ca"), "{mode}: names the fix: {err}");
        assert!(
            !err.contains(PASSWORD),
            "{mode}: the password is never printed"
        );
        assert_eq!(relay.line_count(), 0);
    }
}
