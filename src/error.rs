//! The library's error type. Every error knows two things the caller needs: whether retrying
//! the same operation can succeed (a reconnect, a backoff), and which process exit code it maps
//! to (docs/configuration.md: 1 error, 2 usage or configuration, 3 stored position lost, 4 leadership
//! lost).

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

    /// A source connection or query failed.
    #[error("source: {message}")]
    Source { message: String, retryable: bool },

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

    pub fn source(message: impl fmt::Display, retryable: bool) -> Self {
        Error::Source {
            message: message.to_string(),
            retryable,
        }
    }

    /// Whether the operation may succeed when tried again after a backoff.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Source { retryable, .. } => *retryable,
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
        let retryable = crate::db::postgres::is_retryable_pg(&e);
        Error::Source {
            message: crate::db::postgres::describe_pg_error(&e),
            retryable,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
