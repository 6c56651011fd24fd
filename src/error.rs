//! The library's error type. Every error knows two things the caller needs: whether retrying
//! the same operation can succeed (a reconnect, a backoff), and which process exit code it maps
//! to (docs/configuration.md: 1 error, 2 usage or configuration, 3 stored position lost, 4 leadership
//! lost). A source error carries its [`ErrorKind`] and, from a database server, the
//! [`ServerCode`] it came with, as data: the kind of a server error is decided once, from its
//! code ([`ErrorKind::of_sqlstate`], [`ErrorKind::of_mysql`]), and whether to retry once, from
//! the kind ([`should_retry`]).

use std::fmt;

/// Process exit codes fixed by the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitStatus {
    Done = 0,
    Failed = 1,
    Config = 2,
    PositionLost = 3,
    LeadershipLost = 4,
}

/// What kind of failure an error is: all the retry decision ([`should_retry`]) looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// The connection broke or could not be made (I/O, closed, a connection exception).
    Connection,
    /// The server cannot serve now: starting up or shutting down, out of resources (too many
    /// connections), read-only during a failover, an object still in use (a slot held by a dead
    /// relay's walsender).
    Unavailable,
    /// The operation lost a race with another one: a deadlock, a serialization failure, a lock
    /// wait timeout.
    Conflict,
    /// No answer in time.
    Timeout,
    /// A failure that may pass, of no more specific kind.
    Transient,
    /// Anything else: trying again fails the same way (a syntax error, a missing object, a
    /// value that does not decode).
    Permanent,
}

/// The one retry policy: whether an operation that failed with `kind` may succeed when tried
/// again after a backoff (on a new session).
pub fn should_retry(kind: ErrorKind) -> bool {
    !matches!(kind, ErrorKind::Permanent)
}

impl ErrorKind {
    /// The kind of a server error with this SQLSTATE: connection exceptions (class 08),
    /// operator intervention (57: shutdown, restart, "the database system is starting up"),
    /// insufficient resources (53: too many connections) and "object in use" (55006: a slot
    /// still held by a dead relay's walsender) pass; serialization failures and deadlocks are
    /// conflicts; anything else is permanent.
    pub fn of_sqlstate(code: &str) -> ErrorKind {
        match code {
            "40001" | "40P01" => ErrorKind::Conflict,
            "55006" => ErrorKind::Unavailable,
            c if c.starts_with("08") => ErrorKind::Connection,
            c if c.starts_with("57") || c.starts_with("53") => ErrorKind::Unavailable,
            _ => ErrorKind::Permanent,
        }
    }

    /// The kind of a MySQL/MariaDB server error by its number: too many connections (1040),
    /// shutdown in progress (1053, 1077–1080), network errors (1152–1161), connection killed
    /// or interrupted (1317, 1927), disconnected for inactivity (4031), read-only (1290, 1836:
    /// a failover in progress), lock wait timeouts and deadlocks (1205, 1213).
    pub fn of_mysql(code: u16) -> ErrorKind {
        match code {
            1205 | 1213 => ErrorKind::Conflict,
            1152..=1161 | 1317 | 1927 | 4031 => ErrorKind::Connection,
            1040 | 1053 | 1077..=1080 | 1290 | 1836 => ErrorKind::Unavailable,
            _ => ErrorKind::Permanent,
        }
    }
}

/// The code a database server sent with an error, kept as data so that nothing reads it back
/// out of a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerCode {
    /// The SQLSTATE (both databases send one).
    pub sqlstate: String,
    /// MySQL/MariaDB: the error number.
    pub mysql: Option<u16>,
}

impl ServerCode {
    /// A Postgres server's code.
    pub fn sqlstate(code: &str) -> ServerCode {
        ServerCode {
            sqlstate: code.to_string(),
            mysql: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The operator must change a setting; `fix` is the exact SQL or config line.
    #[error("{problem}\n  fix: {fix}")]
    Config { problem: String, fix: String },

    /// The stored position can no longer be resumed from (slot dropped, binlog purged).
    #[error("stored position lost: {problem}\n  fix: {fix}")]
    PositionLost { problem: String, fix: String },

    /// Another relay took this relay's lease over while it ran.
    #[error("{0}")]
    Leadership(String),

    /// Another live relay holds the lease of this name: this one does not start.
    #[error("{0}")]
    LeaseHeld(String),

    /// A source connection or query failed: how (`kind`), and the server's code when a server
    /// sent one.
    #[error("source: {message}")]
    Source {
        message: String,
        kind: ErrorKind,
        code: Option<ServerCode>,
    },

    /// Data read from the source that cannot be decoded (a protocol violation, not a row
    /// problem: rows that cannot be published become poison records instead).
    #[error("decode: {0}")]
    Decode(String),

    #[error(transparent)]
    #[cfg(feature = "relay")]
    Sink(#[from] crate::sink::SinkError),

    /// Field-level encryption: keyring, schema, or a value that does not decrypt.
    #[error(transparent)]
    Crypto(#[from] crate::crypto::CryptoError),

    #[error("{0}")]
    Other(String),
}

impl Error {
    pub fn config(problem: impl Into<String>, fix: impl Into<String>) -> Self {
        Error::Config {
            problem: problem.into(),
            fix: fix.into(),
        }
    }

    /// A source failure that may pass (`retryable`) or not, of no more specific kind.
    pub fn source(message: impl fmt::Display, retryable: bool) -> Self {
        let kind = match retryable {
            true => ErrorKind::Transient,
            false => ErrorKind::Permanent,
        };
        Error::server(message, kind, None)
    }

    /// A source failure of `kind`, with the server's code when a server sent one.
    pub fn server(message: impl fmt::Display, kind: ErrorKind, code: Option<ServerCode>) -> Self {
        Error::Source {
            message: message.to_string(),
            kind,
            code,
        }
    }

    /// A source operation that got no answer in time.
    pub fn timeout(message: impl fmt::Display) -> Self {
        Error::server(message, ErrorKind::Timeout, None)
    }

    /// The kind of a source error; `None` for the other variants, which the retry policy
    /// never retries (a sink error decides for itself).
    pub fn kind(&self) -> Option<ErrorKind> {
        match self {
            Error::Source { kind, .. } => Some(*kind),
            _ => None,
        }
    }

    /// The SQLSTATE a database server sent with this error.
    pub fn sqlstate(&self) -> Option<&str> {
        match self {
            Error::Source {
                code: Some(code), ..
            } => Some(&code.sqlstate),
            _ => None,
        }
    }

    /// Whether the operation may succeed when tried again after a backoff ([`should_retry`]).
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Source { kind, .. } => should_retry(*kind),
            #[cfg(feature = "relay")]
            Error::Sink(e) => e.is_retryable(),
            _ => false,
        }
    }

    pub fn exit_status(&self) -> ExitStatus {
        match self {
            Error::Config { .. } => ExitStatus::Config,
            #[cfg(feature = "relay")]
            Error::Sink(crate::sink::SinkError::Config { .. }) => ExitStatus::Config,
            Error::PositionLost { .. } => ExitStatus::PositionLost,
            Error::Leadership(_) => ExitStatus::LeadershipLost,
            Error::Crypto(e) if e.is_config() => ExitStatus::Config,
            _ => ExitStatus::Failed,
        }
    }
}

#[cfg(feature = "postgres")]
impl From<tokio_postgres::Error> for Error {
    fn from(e: tokio_postgres::Error) -> Self {
        Error::server(
            crate::db::postgres::describe_pg_error(&e),
            crate::db::postgres::pg_kind(&e),
            e.code().map(|c| ServerCode::sqlstate(c.code())),
        )
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_permanent_failures_are_never_retried() {
        use ErrorKind::*;
        for kind in [Connection, Unavailable, Conflict, Timeout, Transient] {
            assert!(should_retry(kind), "{kind:?}");
        }
        assert!(!should_retry(Permanent));
        assert!(Error::timeout("no answer").is_retryable());
        assert!(!Error::source("bad", false).is_retryable());
        assert!(!Error::config("p", "f").is_retryable());
        assert!(!Error::PositionLost {
            problem: "p".into(),
            fix: "f".into()
        }
        .is_retryable());
    }

    #[test]
    fn server_codes_decide_the_kind_by_their_class_only() {
        use ErrorKind::*;
        for (code, kind) in [
            ("08006", Connection),
            ("08P01", Connection),
            ("57P01", Unavailable),
            ("57P03", Unavailable),
            ("53300", Unavailable),
            ("55006", Unavailable),
            ("40001", Conflict),
            ("40P01", Conflict),
            ("42704", Permanent),
            ("22P02", Permanent),
            ("55000", Permanent),
            ("", Permanent),
        ] {
            assert_eq!(ErrorKind::of_sqlstate(code), kind, "{code}");
        }
        for (code, kind) in [
            (1205, Conflict),
            (1213, Conflict),
            (1158, Connection),
            (4031, Connection),
            (1290, Unavailable),
            (1040, Unavailable),
            (1064, Permanent),
            (1146, Permanent),
        ] {
            assert_eq!(ErrorKind::of_mysql(code), kind, "{code}");
        }
    }

    #[test]
    fn the_code_is_data_not_text() {
        let e = Error::server(
            "the database system is shutting down",
            ErrorKind::Unavailable,
            Some(ServerCode::sqlstate("57P03")),
        );
        assert_eq!(e.sqlstate(), Some("57P03"));
        assert_eq!(e.kind(), Some(ErrorKind::Unavailable));
        // A code only in the words is no code.
        assert_eq!(Error::source("x (SQLSTATE 57P03)", true).sqlstate(), None);
    }
}
