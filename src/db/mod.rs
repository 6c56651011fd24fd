//! Database clients shared across the crate, one file per database: connecting from a DSN and
//! the error classifier (retryable or not, and the words an operator sees).

#[cfg(feature = "mysql")]
pub(crate) mod mysql;
#[cfg(feature = "postgres")]
pub(crate) mod postgres;
