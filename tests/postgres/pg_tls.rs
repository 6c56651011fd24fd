//! TLS to Postgres for both connections the relay makes, the SQL session and the replication
//! stream, against the test CA of `scripts/services.sh`: the server certificate is signed by
//! `ca.crt` and names `localhost` and `127.0.0.1`; `ca-other.crt` signed nothing here.
//!
//! - verify-full to `localhost` and to `127.0.0.1` (an IP address the certificate lists): events
//!   arrive, and `pg_stat_ssl` shows the relay's SQL sessions and its walsender encrypted;
//! - the wrong CA: refused under verify-full, verify-ca and require (libpq's require verifies
//!   the chain when sslrootcert is given), exit status 2, naming TLS and the certificate, with
//!   the DSN's password nowhere in the output;
//! - `127.0.0.2` (a proxy to the server; the certificate does not list it): verify-full refuses
//!   the host name, verify-ca and require (no sslrootcert) accept it and deliver;
//! - the same cases opened directly, SQL and replication connection side by side: both accept
//!   or both refuse, with the same error.

use crate::common;

use common::proxy::FaultProxy;
use common::*;
use std::time::Duration;

const T: Duration = Duration::from_secs(60);

/// In every DSN: the server trusts 127.0.0.1, so the password is never checked, but it must
/// never be printed either.
const PASSWORD: &str = "tls-pw-Zq81x";

/// Fails the test unless Postgres serves the certificate the test CA signed for `localhost`.
async fn require_server_tls() {
    let settings = outboxd::dsn::TlsSettings {
        mode: outboxd::dsn::TlsMode::VerifyFull,
        ca_file: Some(tls_file("ca.crt")),
        ..Default::default()
    };
    tls_file("ca-other.crt");
    let config = outboxd::tls::client_config(&settings).unwrap().unwrap();
    let connected = tokio_postgres::connect(
        "host=localhost port=5432 user=postgres dbname=test sslmode=require",
        tokio_postgres_rustls::MakeRustlsConnect::new(config),
    )
    .await;
    if let Err(e) = connected {
        panic!(
            "Postgres on localhost:5432 does not serve a certificate signed by {}: {e:?}. \
             Run `sudo scripts/services.sh` to set up TLS",
            tls_file("ca.crt")
        );
    }
}

fn dsn(host: &str, port: u16, db: &str, query: &str) -> String {
    format!("postgres://postgres:{PASSWORD}@{host}:{port}/{db}?{query}")
}

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

/// A session of the relay as the server sees it.
#[derive(Debug)]
struct Session {
    pid: i32,
    backend_type: String,
    ssl: bool,
    tls_version: Option<String>,
    /// Listed in `pg_stat_replication`: the walsender of a replication connection.
    replication: bool,
}

/// Every session with `application_name`, with its `pg_stat_ssl` row.
async fn sessions(app: &str) -> Vec<Session> {
    let c = pg_connect(PG_ADMIN).await;
    c.query(
        "SELECT a.pid, a.backend_type, s.ssl, s.version, r.pid IS NOT NULL
           FROM pg_stat_activity a
           JOIN pg_stat_ssl s USING (pid)
           LEFT JOIN pg_stat_replication r USING (pid)
          WHERE a.application_name = $1
          ORDER BY a.backend_type, a.pid",
        &[&app],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| Session {
        pid: r.get(0),
        backend_type: r.get(1),
        ssl: r.get(2),
        tls_version: r.get(3),
        replication: r.get(4),
    })
    .collect()
}

/// The pid of the walsender holding `slot`, once there is one other than `not`.
async fn walsender(db: &PgDb, slot: &str, not: Option<i32>, relay: &mut Relay) -> i32 {
    let deadline = std::time::Instant::now() + T;
    loop {
        let c = pg_connect(PG_ADMIN).await;
        // The walsender, not the backend creating the slot (which holds it until then).
        let pid: Option<i32> = c
            .query_one(
                "SELECT max(s.active_pid) FROM pg_replication_slots s
                   JOIN pg_stat_replication r ON r.pid = s.active_pid
                  WHERE s.slot_name = $1 AND s.active",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0);
        if let Some(pid) = pid.filter(|p| Some(*p) != not) {
            return pid;
        }
        if let Some(status) = relay.child.try_wait().unwrap() {
            panic!(
                "outboxd exited with {status} in {}; stderr:\n{}",
                db.name,
                relay.stderr()
            );
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no walsender for {slot} within {T:?}; stderr:\n{}",
            relay.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn wait_lines(relay: &Relay, n: usize, dsn: &str) {
    let deadline = std::time::Instant::now() + T;
    while relay.line_count() < n {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {n} events arrived within {T:?} for {dsn}; stderr:\n{}",
            relay.line_count(),
            relay.stderr()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Runs the relay with `dsn`, writes 3 × 20 events, and checks they all arrive, that its SQL
/// sessions and its walsender use TLS, and that it stops cleanly without printing the password.
/// With `reconnect`, the walsender is terminated halfway: the relay reconnects (over TLS again)
/// and the rest arrives too.
async fn delivers_over_tls(db: &PgDb, dsn: &str, reconnect: bool) {
    let name = unique("tls");
    let slot = format!("outboxd_{name}");
    let app = format!("outboxd_{name}");
    // The replication stream's TLS bridge puts its socket in TMPDIR and removes it at once.
    let tmp = tempfile::tempdir().unwrap();
    let mut relay = Relay::start_with_env(
        &run_args(dsn, &name),
        &[("TMPDIR", tmp.path().to_str().unwrap())],
    );
    let mut pid = walsender(db, &slot, None, &mut relay).await;

    let mut client = db.client().await;
    let mut ids = write_events(&mut client, 3, 20, "invoice.issued").await;
    wait_lines(&relay, ids.len(), dsn).await;
    if reconnect {
        let c = pg_connect(PG_ADMIN).await;
        c.execute("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap();
        pid = walsender(db, &slot, Some(pid), &mut relay).await;
        ids.extend(write_events(&mut client, 2, 20, "invoice.paid").await);
        wait_lines(&relay, ids.len(), dsn).await;
    }
    assert!(
        std::fs::read_dir(tmp.path()).unwrap().next().is_none(),
        "the TLS bridge left files in TMPDIR"
    );

    // The walsender (replication stream) and the SQL sessions (setup, lease) of this relay.
    let seen = sessions(&app).await;
    let walsenders: Vec<_> = seen
        .iter()
        .filter(|s| s.backend_type == "walsender")
        .collect();
    assert!(
        walsenders.len() == 1 && walsenders[0].pid == pid && walsenders[0].replication,
        "one walsender for {app}, pid {pid}, in pg_stat_replication: {seen:?}"
    );
    assert!(
        walsenders[0].ssl && walsenders[0].tls_version.is_some(),
        "the replication stream uses TLS: {seen:?}"
    );
    let sql: Vec<_> = seen
        .iter()
        .filter(|s| s.backend_type == "client backend")
        .collect();
    assert!(
        !sql.is_empty(),
        "the relay's SQL session is there: {seen:?}"
    );
    assert!(
        sql.iter().all(|s| s.ssl && s.tls_version.is_some()),
        "every SQL session of the relay uses TLS: {seen:?}"
    );

    relay.signal("TERM");
    assert_eq!(relay.wait_exit(T).await, 0, "stderr:\n{}", relay.stderr());
    let got: Vec<uuid::Uuid> = parse_lines(&relay.lines())
        .iter()
        .map(|l| l["id"].as_str().unwrap().parse().unwrap())
        .collect();
    assert_eq!(got, ids, "every event, in commit order, nothing else");
    assert!(
        !relay.stderr().contains(PASSWORD),
        "the password was printed:\n{}",
        relay.stderr()
    );
}

/// Runs the relay with `dsn` and expects it to give up on TLS: exit status 2 and a message
/// with `expect`, no slot, nothing on stdout, no password.
async fn refused(db: &PgDb, dsn: &str, expect: &str) {
    let name = unique("tls");
    let mut relay = Relay::start(&run_args(dsn, &name));
    let code = relay.wait_exit(T).await;
    let stderr = relay.stderr();
    assert_eq!(
        code, 2,
        "a configuration error for {dsn}; stderr:\n{stderr}"
    );
    assert!(
        stderr.contains("TLS") && stderr.contains("certificate") && stderr.contains(expect),
        "the error names TLS, the certificate and {expect:?}; stderr:\n{stderr}"
    );
    assert!(
        !stderr.contains(PASSWORD),
        "the password was printed:\n{stderr}"
    );
    assert_eq!(relay.line_count(), 0);
    assert!(
        db.slot_confirmed(&format!("outboxd_{name}"))
            .await
            .is_none(),
        "no slot was created"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_to_localhost_encrypts_sql_and_replication() {
    require_server_tls().await;
    let db = PgDb::create("tls_full").await;
    let query = format!("sslmode=verify-full&sslrootcert={}", tls_file("ca.crt"));
    delivers_over_tls(&db, &dsn("localhost", 5432, &db.name, &query), true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_full_accepts_the_ip_address_the_certificate_lists() {
    require_server_tls().await;
    let db = PgDb::create("tls_ip").await;
    let query = format!("sslmode=verify-full&sslrootcert={}", tls_file("ca.crt"));
    delivers_over_tls(&db, &dsn("127.0.0.1", 5432, &db.name, &query), false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_another_ca_is_refused() {
    require_server_tls().await;
    let db = PgDb::create("tls_wrongca").await;
    let other = tls_file("ca-other.crt");
    for mode in ["verify-full", "verify-ca", "require"] {
        let query = format!("sslmode={mode}&sslrootcert={other}");
        refused(
            &db,
            &dsn("localhost", 5432, &db.name, &query),
            "UnknownIssuer",
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_the_certificate_does_not_list_passes_verify_ca_only() {
    require_server_tls().await;
    // 127.0.0.2 reaches the server through a proxy; the certificate lists localhost and
    // 127.0.0.1 only.
    let proxy = FaultProxy::start_on(
        std::net::Ipv4Addr::new(127, 0, 0, 2),
        "127.0.0.1:5432".parse().unwrap(),
    )
    .await
    .expect("listen on 127.0.0.2");
    let (host, port) = ("127.0.0.2", proxy.port());
    let ca = tls_file("ca.crt");

    let db = PgDb::create("tls_host").await;
    refused(
        &db,
        &dsn(
            host,
            port,
            &db.name,
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        ),
        "not valid for name \"127.0.0.2\"",
    )
    .await;

    delivers_over_tls(
        &db,
        &dsn(
            host,
            port,
            &db.name,
            &format!("sslmode=verify-ca&sslrootcert={ca}"),
        ),
        false,
    )
    .await;

    let db = PgDb::create("tls_require").await;
    delivers_over_tls(&db, &dsn(host, port, &db.name, "sslmode=require"), false).await;
}

/// The relay opens its SQL session first, so a refused certificate never reaches the
/// replication connection above. Here both are opened directly, case by case: each accepts or
/// refuses exactly when the other does, with the same error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sql_and_replication_connections_verify_alike() {
    use outboxd::dsn::SourceDsn;
    use outboxd::source::postgres::{connect_sql, tls_bridge};
    require_server_tls().await;
    let proxy = FaultProxy::start_on(
        std::net::Ipv4Addr::new(127, 0, 0, 2),
        "127.0.0.1:5432".parse().unwrap(),
    )
    .await
    .expect("listen on 127.0.0.2");
    let (ca, other) = (tls_file("ca.crt"), tls_file("ca-other.crt"));
    let p = proxy.port();
    // host, port, query, accepted (else: a piece of the error)
    let cases: Vec<(&str, u16, String, Result<(), &str>)> = vec![
        (
            "localhost",
            5432,
            format!("sslmode=verify-full&sslrootcert={ca}"),
            Ok(()),
        ),
        (
            "127.0.0.1",
            5432,
            format!("sslmode=verify-full&sslrootcert={ca}"),
            Ok(()),
        ),
        (
            "127.0.0.2",
            p,
            format!("sslmode=verify-ca&sslrootcert={ca}"),
            Ok(()),
        ),
        ("127.0.0.2", p, "sslmode=require".into(), Ok(())),
        (
            "127.0.0.2",
            p,
            format!("sslmode=verify-full&sslrootcert={ca}"),
            Err("not valid for name"),
        ),
        (
            "localhost",
            5432,
            format!("sslmode=verify-full&sslrootcert={other}"),
            Err("UnknownIssuer"),
        ),
        (
            "localhost",
            5432,
            format!("sslmode=verify-ca&sslrootcert={other}"),
            Err("UnknownIssuer"),
        ),
        (
            "localhost",
            5432,
            format!("sslmode=require&sslrootcert={other}"),
            Err("UnknownIssuer"),
        ),
        // No sslrootcert: the Mozilla roots, which do not hold the test CA.
        (
            "localhost",
            5432,
            "sslmode=verify-full".into(),
            Err("UnknownIssuer"),
        ),
    ];
    for (host, port, query, want) in cases {
        let url = dsn(host, port, "test", &query);
        let SourceDsn::Postgres(d) = SourceDsn::parse(&url).unwrap() else {
            unreachable!()
        };
        let sql = connect_sql(&d, "outboxd_tls_probe").await.map(|_| ());
        let replication = tls_bridge::connect(&d).await.map(|_| ());
        for (what, got) in [("SQL", sql), ("replication", replication)] {
            match (&want, got) {
                (Ok(()), Ok(())) => {}
                (Err(piece), Err(e)) => {
                    let text = e.to_string();
                    assert_eq!(
                        e.exit_status(),
                        outboxd::ExitStatus::Config,
                        "{what} {url}: {text}"
                    );
                    assert!(
                        text.contains("TLS") && text.contains(piece) && !text.contains(PASSWORD),
                        "{what} connection to {url}: {text}"
                    );
                }
                (want, got) => panic!("{what} connection to {url}: wanted {want:?}, got {got:?}"),
            }
        }
    }
}
