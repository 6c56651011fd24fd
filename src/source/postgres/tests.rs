//! The replication source's unit tests: a server shutting down told from a terminated
//! session, errors classified by SQLSTATE, the reader bounded by the message limit, plain
//! protocol to the TLS bridge, and a server without TLS as a configuration error.

use super::*;
use crate::dsn::SourceDsn;

fn cfg(dsn: &str) -> PgSourceConfig {
    let SourceDsn::Postgres(dsn) = SourceDsn::parse(dsn).unwrap() else {
        panic!("not postgres")
    };
    PgSourceConfig {
        dsn,
        name: "billing".into(),
        tables: vec![TableName::parse("outbox").unwrap()],
        columns: ColumnMap::parse(&[]).unwrap(),
        slot: "outboxd_billing".into(),
        publication: "outboxd_billing".into(),
        status_interval: Duration::from_secs(1),
        snapshot: Vec::new(),
        snapshot_after: None,
        max_wire_message_bytes: wire_message_limit(16 * 1024 * 1024),
    }
}

#[test]
fn a_server_shutting_down_is_told_from_a_terminated_session() {
    let e = |code: &str| {
        Error::server(
            format!("server error (SQLSTATE {code})"),
            crate::ErrorKind::of_sqlstate(code),
            Some(crate::ServerCode::sqlstate(code)),
        )
    };
    assert!(is_server_stopping(&e("57P03")));
    assert!(is_server_stopping(&e("57P02")));
    for code in ["57P01", "08006", "42P01"] {
        assert!(!is_server_stopping(&e(code)), "{code}");
    }
    // The code is what the server sent, never words in a message.
    for m in [
        "the database system is shutting down (SQLSTATE 57P03)",
        "relation \"t_57P03\" does not exist",
    ] {
        assert!(!is_server_stopping(&Error::source(m, true)), "{m}");
    }
    assert!(!is_server_stopping(&Error::Leadership("57P03".into())));
    // pgwire-replication's server errors keep the code they were read with.
    let stopping = wire_error(
        PgWireError::Server("the database system is shutting down (SQLSTATE 57P03)".into()),
        "outboxd_billing",
        "billing",
    );
    assert!(is_server_stopping(&stopping), "{stopping:?}");
}

#[test]
fn replication_errors_are_classified_by_their_sqlstate_only() {
    let server = |m: &str| wire_error(PgWireError::Server(m.into()), "outboxd_billing", "billing");
    // Retryable by code.
    for m in [
        "terminating connection due to administrator command (SQLSTATE 57P01)",
        "the database system is starting up (SQLSTATE 57P03)",
        "replication slot \"outboxd_billing\" is active for PID 4242 (SQLSTATE 55006)",
        "sorry, too many clients already (SQLSTATE 53300)",
        "connection failure (SQLSTATE 08006)",
    ] {
        assert!(server(m).is_retryable(), "{m}");
    }
    // "08" in a name, an LSN or a PID is no connection exception.
    for m in [
        "publication \"pub_2008\" does not exist (SQLSTATE 42704)",
        "syntax error at or near \"0/1A08\" (SQLSTATE 42601)",
        "permission denied for database orders08 (SQLSTATE 42501)",
        "could not find pg_class entry for 16408",
        "invalid LSN 0/08 (SQLSTATE 22P02)",
    ] {
        let e = server(m);
        assert!(!e.is_retryable(), "{m}");
        assert!(!matches!(e, Error::PositionLost { .. }), "{m}");
    }
    let lost = server("replication slot \"outboxd_billing\" does not exist (SQLSTATE 42704)");
    assert!(matches!(lost, Error::PositionLost { .. }), "{lost}");
    assert_eq!(server_sqlstate("x (SQLSTATE 08P01)"), Some("08P01"));
    assert_eq!(server_sqlstate("x (SQLSTATE 08P01) trailing"), None);
    assert_eq!(server_sqlstate("no code"), None);
}

#[test]
fn the_replication_reader_is_bounded_by_the_message_limit() {
    let c = cfg("postgres://app@db.example/orders");
    assert_eq!(
        replication_config(&c, 0, 0, None).max_message_size,
        33 * 1024 * 1024,
        "twice 16 MiB plus 1 MiB, not the library's 1 GiB"
    );
    let err = wire_error(
        PgWireError::MessageTooLarge {
            payload_bytes: 5 * 1024 * 1024,
            limit_bytes: wire_message_limit(1024 * 1024),
        },
        "s",
        "n",
    );
    let text = err.to_string();
    assert!(!err.is_retryable(), "{text}");
    assert!(
        text.contains("--max-message-bytes 2MiB") && text.contains("5242880"),
        "{text}"
    );
}

#[test]
fn replication_speaks_plain_protocol_to_the_tls_bridge() {
    let c = cfg("postgres://app:pw@db.example:6543/orders?sslmode=verify-full&sslrootcert=/ca.pem");
    let bridged = replication_config(&c, 0, 0, Some("/tmp/outboxd-x".into()));
    assert_eq!(bridged.host, "/tmp/outboxd-x");
    assert_eq!(bridged.port, 6543);
    assert_eq!(bridged.tls, TlsConfig::disabled());
    let direct = replication_config(&c, 0, 0, None);
    assert_eq!(direct.host, "db.example");
    assert_eq!(direct.tls, TlsConfig::disabled());
}

/// A server that answers every TLS request with `N`, as Postgres with `ssl = off` does.
async fn server_without_tls() -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut request = [0u8; 8];
                if s.read_exact(&mut request).await.is_ok() {
                    let _ = s.write_all(b"N").await;
                    let _ = s.read(&mut [0u8; 64]).await;
                }
            });
        }
    });
    port
}

#[tokio::test]
async fn a_server_without_tls_is_a_configuration_error_for_both_connections() {
    let port = server_without_tls().await;
    let c = cfg(&format!(
        "postgres://app@127.0.0.1:{port}/orders?sslmode=require"
    ));
    let sql = connect_sql(&c.dsn, "outboxd_test").await.err().unwrap();
    let Err(replication) = tls_bridge::connect(&c.dsn).await else {
        panic!("the replication connection went through without TLS")
    };
    for e in [sql, replication] {
        assert_eq!(e.exit_status(), crate::ExitStatus::Config, "{e}");
        assert!(e.to_string().contains("does not accept TLS"), "{e}");
    }
    // prefer takes the plain connection.
    let c = cfg(&format!(
        "postgres://app@127.0.0.1:{port}/orders?sslmode=prefer"
    ));
    assert!(tls_bridge::connect(&c.dsn).await.is_ok());
}
