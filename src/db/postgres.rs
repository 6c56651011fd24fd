//! The Postgres client every part of outboxd uses — the source, the state store, the
//! consumer kit, `prune`, the key store and `check`: SQL sessions made from a DSN (TLS per its
//! `sslmode`), and the one classifier that words a server error and says whether a reconnect
//! may help. A leaf: it imports nothing of the data path, so none of its users depends on
//! another through it.

use crate::dsn::{DbDsn, TlsMode};
use crate::{Error, ErrorKind};
use std::time::Duration;

/// The advisory lock (per database) that serializes what relays and `outboxd setup` create:
/// two sessions running `CREATE TABLE IF NOT EXISTS` (or `CREATE PUBLICATION` after both saw
/// none) at the same instant collide on the catalog's unique indexes
/// (`pg_type_typname_nsp_index`) instead of one of them finding the object there.
pub const SETUP_LOCK: i64 = 0x6f75_7462_6f78_6400; // "outboxd\0"

/// Whether a Postgres error is worth a reconnect ([`crate::should_retry`] of its kind).
pub fn is_retryable_pg(e: &tokio_postgres::Error) -> bool {
    crate::should_retry(pg_kind(e))
}

/// The kind of a Postgres client error: by its SQLSTATE when the server sent one; a closed
/// connection, or an I/O error underneath, is a connection failure; anything else (a value
/// that cannot be serialized, say) is permanent.
pub(crate) fn pg_kind(e: &tokio_postgres::Error) -> ErrorKind {
    if e.is_closed() {
        return ErrorKind::Connection;
    }
    if let Some(code) = e.code() {
        return ErrorKind::of_sqlstate(code.code());
    }
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        if s.is::<std::io::Error>() {
            return ErrorKind::Connection;
        }
        src = s.source();
    }
    ErrorKind::Permanent
}

/// Whether an error says the server is shutting down and takes no new sessions: SQLSTATE
/// 57P03 ("cannot connect now", also said while it starts up) or 57P02 (crash shutdown), as
/// the server sent it. The lease keeper's reconnect meets it first; the source then closes its
/// replication stream, which the server waits for before it can stop (see
/// `source::postgres::run`). A terminated session (57P01) alone does not count:
/// `pg_terminate_backend` says the same to a server that keeps running.
pub fn is_server_stopping(e: &Error) -> bool {
    matches!(e.sqlstate(), Some("57P03" | "57P02"))
}

pub fn describe_pg_error(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut s = format!("{} (SQLSTATE {})", db.message(), db.code().code());
            if let Some(h) = db.hint() {
                s.push_str("; hint: ");
                s.push_str(h);
            }
            s
        }
        None => {
            // tokio-postgres keeps the cause out of its message ("error performing TLS
            // handshake", "error connecting to server"): add it.
            let mut s = e.to_string();
            let mut cause = std::error::Error::source(e);
            while let Some(c) = cause {
                s.push_str(": ");
                s.push_str(&c.to_string());
                cause = c.source();
            }
            s
        }
    }
}

/// The tokio-postgres settings and the TLS configuration (`None`: plain) for a session of
/// `dsn`: every SQL connection of the relay, the poll mode's LISTEN session included, is made
/// from these, so none can ignore the DSN's `sslmode`.
pub(crate) fn sql_config(
    dsn: &DbDsn,
    application: &str,
) -> Result<(tokio_postgres::Config, Option<rustls::ClientConfig>), Error> {
    let mut cfg = tokio_postgres::Config::new();
    if dsn.host.starts_with('/') {
        cfg.host_path(&dsn.host);
    } else {
        cfg.host(&dsn.host);
    }
    cfg.port(dsn.port)
        .user(&dsn.user)
        .dbname(&dsn.database)
        .application_name(application)
        .connect_timeout(Duration::from_secs(10))
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(30));
    if let Some(p) = &dsn.password {
        cfg.password(p);
    }
    // As in libpq, sslmode is ignored on Unix sockets.
    let unix = dsn.host.starts_with('/');
    cfg.ssl_mode(match dsn.tls.mode {
        _ if unix => tokio_postgres::config::SslMode::Disable,
        TlsMode::Disable => tokio_postgres::config::SslMode::Disable,
        TlsMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    let tls = if unix {
        None
    } else {
        crate::tls::client_config(&dsn.tls)?
    };
    Ok((cfg, tls))
}

/// Connects an ordinary SQL session (TLS per the DSN) and drives it in the background.
pub async fn connect_sql(dsn: &DbDsn, application: &str) -> Result<tokio_postgres::Client, Error> {
    let (cfg, tls) = sql_config(dsn, application)?;
    let client = match tls {
        None => {
            let (client, conn) = cfg.connect(tokio_postgres::NoTls).await?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "postgres connection ended");
                }
            });
            client
        }
        Some(tls) => {
            let (client, conn) = cfg
                .connect(tokio_postgres_rustls::MakeRustlsConnect::new(tls))
                .await
                .map_err(|e| tls_connect_error(e, dsn))?;
            tokio::spawn(async move {
                if let Err(e) = conn.await {
                    tracing::debug!(error = %e, "postgres connection ended");
                }
            });
            client
        }
    };
    Ok(client)
}

/// A failed TLS connection: a refused certificate or a server without TLS is a configuration
/// error (exit status 2, not retried); anything else is what it is.
pub(crate) fn tls_connect_error(e: tokio_postgres::Error, dsn: &DbDsn) -> Error {
    let what = format!("Postgres {}:{}", dsn.host, dsn.port);
    if let Some(r) = crate::tls::rustls_cause(&e) {
        return crate::tls::handshake_refused(&what, &dsn.tls, r);
    }
    if describe_pg_error(&e).contains("server does not support TLS") {
        return Error::config(
            format!("TLS: {what} does not accept TLS connections"),
            "turn TLS on in the server (ssl = on, ssl_cert_file, ssl_key_file), \
             or set sslmode=prefer or disable in the DSN",
        );
    }
    Error::from(e)
}
