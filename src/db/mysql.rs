//! The MySQL/MariaDB client every part of outboxd uses — the binlog source, the state store,
//! poll mode, the consumer kit and `check`: sessions made from a DSN (TLS per its `ssl-mode`,
//! `prefer` falling back to plain), and the one list of server errors worth a retry. A leaf: it
//! imports nothing of the data path.

use crate::dsn::{DbDsn, TlsMode};
use crate::{Error, ErrorKind, ServerCode};
use mysql_async::{Conn, OptsBuilder, SslOpts};
use std::time::Duration;

/// Whether a server error with this number is worth a new attempt (see
/// [`ErrorKind::of_mysql`]).
pub(crate) fn is_retryable_code(code: u16) -> bool {
    crate::should_retry(ErrorKind::of_mysql(code))
}

impl From<mysql_async::Error> for Error {
    fn from(e: mysql_async::Error) -> Self {
        classify(e)
    }
}

/// Maps a client error: connection-level trouble is retryable, refusals carry their fix.
pub fn classify(e: mysql_async::Error) -> Error {
    use mysql_async::{DriverError, Error as E, IoError};
    match e {
        E::Server(s) => {
            let text = format!("{} (error {}, SQLSTATE {})", s.message, s.code, s.state);
            match s.code {
                // Access denied / a privilege missing.
                1044 | 1045 | 1142 | 1227 | 1370 => Error::config(
                    format!("MySQL refused: {text}"),
                    "grant the user what its role needs (docs/operations.md, \"Grants\"); the relay's user: GRANT REPLICATION SLAVE, BINLOG MONITOR ON *.* (MySQL: REPLICATION CLIENT instead of BINLOG MONITOR), SELECT on the outbox table, SELECT, INSERT, UPDATE on outboxd_state; `outboxd check` names each one missing",
                ),
                // ER_SLAVE_SAME_ID (MariaDB): the server ended this binlog stream because
                // another client registered with the same server id. A relay's server id comes
                // from its --name and only the lease holder streams: another relay of this
                // name took over.
                4052 => Error::Leadership(format!(
                    "another binlog client connected with this relay's server id (derived from --name), so the \
                     server ended this relay's stream: another relay of the same name holds the lease now; \
                     this one stops (restarted, it waits as a standby). MySQL: {text}"
                )),
                1049 => Error::config(
                    format!("MySQL: {text}"),
                    "name an existing database in the DSN, e.g. mysql://user@host:3306/app",
                ),
                code => Error::server(
                    format!("MySQL: {text}"),
                    ErrorKind::of_mysql(code),
                    Some(ServerCode {
                        sqlstate: s.state.to_string(),
                        mysql: Some(code),
                    }),
                ),
            }
        }
        // rustls reports a refused certificate as an io::Error wrapping its own error.
        E::Io(IoError::Io(io)) if io.get_ref().is_some_and(|e| e.is::<rustls::Error>()) => {
            Error::config(format!("MySQL TLS: {io}"), TLS_FIX)
        }
        E::Io(IoError::Io(io)) => {
            // Parsing trouble surfaces as io::Error too; it does not go away by retrying.
            let kind = match io.kind() {
                std::io::ErrorKind::InvalidData => ErrorKind::Permanent,
                _ => ErrorKind::Connection,
            };
            Error::server(format!("MySQL connection: {io}"), kind, None)
        }
        E::Io(IoError::Tls(t)) => Error::config(format!("MySQL TLS: {t}"), TLS_FIX),
        E::Driver(DriverError::NoClientSslFlagFromServer) => Error::config(
            "the MySQL server does not offer TLS, but the DSN requires it",
            "enable TLS on the server (ssl_cert, ssl_key), or use ssl-mode=prefer or disable in the DSN",
        ),
        E::Driver(d @ (DriverError::ConnectionClosed | DriverError::PacketOutOfOrder | DriverError::UnexpectedPacket { .. })) => {
            Error::server(format!("MySQL connection: {d}"), ErrorKind::Connection, None)
        }
        E::Driver(d) => Error::source(format!("MySQL client: {d}"), false),
        E::Url(u) => Error::config(format!("MySQL DSN: {u}"), "check the DSN syntax"),
        E::Other(o) => Error::source(format!("MySQL: {o}"), false),
    }
}

/// The server error code of a client error, if it is one.
pub fn server_code(e: &mysql_async::Error) -> Option<u16> {
    match e {
        mysql_async::Error::Server(s) => Some(s.code),
        _ => None,
    }
}

const TLS_FIX: &str =
    "check ssl-mode and ssl-ca in the DSN (verify-ca/verify-full need the server's CA in ssl-ca)";

fn ssl_opts(dsn: &DbDsn) -> Result<Option<SslOpts>, Error> {
    use mysql_async::ClientIdentity;
    use std::path::PathBuf;
    let tls = &dsn.tls;
    if tls.mode == TlsMode::Disable {
        return Ok(None);
    }
    // mysql_async builds its rustls configuration with the process-wide provider: make it the
    // same ring provider the rest of the crate uses (installing twice is a no-op).
    let _ = rustls::crypto::ring::default_provider().install_default();
    let mut opts = SslOpts::default();
    if let Some(ca) = &tls.ca_file {
        // Fail early with a clear message rather than in the handshake.
        crate::tls::load_certs(ca)?;
        opts = opts
            .with_root_certs(vec![PathBuf::from(ca).into()])
            .with_disable_built_in_roots(true);
    }
    opts = match tls.mode {
        // As libpq: `require` with a CA file checks the chain like verify-ca.
        TlsMode::Require if tls.ca_file.is_some() => opts.with_danger_skip_domain_validation(true),
        TlsMode::Prefer | TlsMode::Require => opts.with_danger_accept_invalid_certs(true),
        TlsMode::VerifyCa => opts.with_danger_skip_domain_validation(true),
        _ => opts,
    };
    match (&tls.cert_file, &tls.key_file) {
        (Some(c), Some(k)) => {
            // The key is read here, checked as a secret file, and handed over as bytes.
            let key = crate::tls::read_key_file(k)?;
            opts = opts.with_client_identity(Some(ClientIdentity::new(
                PathBuf::from(c).into(),
                key.to_vec().into(),
            )))
        }
        (None, None) => {}
        _ => {
            return Err(Error::config(
                "a client certificate needs both ssl-cert and ssl-key",
                "add both to the DSN, or neither",
            ))
        }
    }
    Ok(Some(opts))
}

fn opts(dsn: &DbDsn, ssl: Option<SslOpts>, found_rows: bool) -> OptsBuilder {
    OptsBuilder::default()
        .ip_or_hostname(dsn.host.clone())
        .tcp_port(dsn.port)
        .user(Some(dsn.user.clone()))
        .pass(dsn.password.clone())
        .db_name((!dsn.database.is_empty()).then(|| dsn.database.clone()))
        // Never switch to the server's Unix socket behind our back (it would also bypass a
        // proxy in front of the server).
        .prefer_socket(false)
        .tcp_keepalive(Some(Duration::from_secs(30)))
        .tcp_nodelay(true)
        .client_found_rows(found_rows)
        .ssl_opts(ssl)
}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

async fn connect_with(dsn: &DbDsn, found_rows: bool) -> Result<Conn, Error> {
    let ssl = ssl_opts(dsn)?;
    let attempt = |ssl: Option<SslOpts>| async move {
        match tokio::time::timeout(CONNECT_TIMEOUT, Conn::new(opts(dsn, ssl, found_rows))).await {
            Ok(r) => r.map_err(Some),
            Err(_) => Err(None),
        }
    };
    let timed_out = || {
        Error::source(
            format!(
                "MySQL {}:{}: no connection within {CONNECT_TIMEOUT:?}",
                dsn.host, dsn.port
            ),
            true,
        )
    };
    match attempt(ssl).await {
        Ok(c) => Ok(c),
        // prefer: TLS when the server offers it, plain otherwise.
        Err(Some(mysql_async::Error::Driver(
            mysql_async::DriverError::NoClientSslFlagFromServer,
        ))) if dsn.tls.mode == TlsMode::Prefer => attempt(None)
            .await
            .map_err(|e| e.map(classify).unwrap_or_else(timed_out)),
        Err(e) => Err(e.map(classify).unwrap_or_else(timed_out)),
    }
}

/// Connects an ordinary SQL session (TLS per the DSN).
pub async fn connect_sql(dsn: &DbDsn) -> Result<Conn, Error> {
    connect_with(dsn, false).await
}

/// A session whose UPDATEs report matched rows (not changed ones), for the state table.
pub async fn connect_state(dsn: &DbDsn) -> Result<Conn, Error> {
    connect_with(dsn, true).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_list_of_retryable_server_errors() {
        for code in [1040, 1053, 1158, 1205, 1213, 1290, 1317, 1836, 1927, 4031] {
            assert!(is_retryable_code(code), "{code}");
        }
        // Syntax, a missing table, access denied: the same again on every attempt.
        for code in [1064, 1146, 1045, 1142] {
            assert!(!is_retryable_code(code), "{code}");
        }
    }

    #[test]
    fn tls_modes_map_to_client_options() {
        let dsn =
            |q: &str| match crate::dsn::SourceDsn::parse(&format!("mysql://u@h/db{q}")).unwrap() {
                crate::dsn::SourceDsn::Mysql(d) => d,
                _ => unreachable!(),
            };
        assert!(ssl_opts(&dsn("?ssl-mode=disable")).unwrap().is_none());
        let prefer = ssl_opts(&dsn("")).unwrap().unwrap();
        assert!(
            prefer.accept_invalid_certs(),
            "prefer encrypts without verifying"
        );
        let require = ssl_opts(&dsn("?ssl-mode=require")).unwrap().unwrap();
        assert!(require.accept_invalid_certs());
        // verify-ca without ssl-ca is refused when the DSN is parsed (as libpq does).
        assert!(
            crate::dsn::SourceDsn::parse("mysql://u@h/db?ssl-mode=verify-ca")
                .unwrap_err()
                .to_string()
                .contains("ssl-ca")
        );
        let full = ssl_opts(&dsn("?ssl-mode=verify-identity"))
            .unwrap()
            .unwrap();
        assert!(!full.accept_invalid_certs() && !full.skip_domain_validation());
        let missing = ssl_opts(&dsn("?ssl-mode=verify-full&ssl-ca=/nonexistent.pem")).unwrap_err();
        assert!(
            missing.to_string().contains("/nonexistent.pem"),
            "{missing}"
        );
        assert!(
            ssl_opts(&dsn("?ssl-mode=require&ssl-cert=/c.pem")).is_err(),
            "cert without key"
        );
    }
}
