//! Database clients shared across the crate, one file per database: connecting from a DSN and
//! the error classifier (retryable or not, and the words an operator sees).

pub mod mysql;
pub mod postgres;
