//! The consumer side of effectively-once. The relay delivers every event at least once; a
//! consumer turns that into one effect per event by recording the event id in
//! `processed_messages` *in the same transaction as the effect*, claim first:
//!
//! ```text
//! BEGIN;
//!   INSERT INTO processed_messages (consumer, message_id) VALUES (…) ON CONFLICT DO NOTHING;
//!   -- 0 rows: a repeat. Nothing else runs; commit (or roll back) and ack.
//!   -- 1 row:  the effect, in this transaction.
//! COMMIT;   -- then, and only then, ack the message
//! ```
//!
//! Claiming first (rather than checking, then inserting at the end) matters under concurrency:
//! the insert takes the unique-key lock, so a second consumer holding the same id waits for
//! the first transaction and then sees the row (duplicate) or, if the first rolled back, gets
//! the claim itself. Exactly one effect commits.
//!
//! What is here:
//!
//! - [`Inbox`]: the claim, the optional stale gate (drop versions older than or equal to the
//!   last applied one per aggregate) and the "claim, then effect" wrapper ([`Inbox::run`]),
//!   written once in [`inbox`] over [`InboxBackend`], which `tokio-postgres` ([`postgres`]) and
//!   `mysql_async` ([`mysql`]) transactions implement;
//! - [`processor`]: [`InboxProcessor`], one transaction per message (or batch) for the
//!   [`runner`], over [`Database`] ([`postgres::Postgres`], [`mysql::Mysql`]) with your
//!   [`Handler`];
//! - [`fault`]: whose fault a database error is (conflict, database unavailable, setup, or
//!   the message's data), one classification by SQLSTATE / MySQL error number for both
//!   databases;
//! - [`key`]: stable idempotency keys for calls that leave the transaction (payment and
//!   e-invoice APIs);
//! - [`runner`]: a RabbitMQ consumer loop that acks only after commit, retries in place, and
//!   parks, skips or halts on poison;
//! - [`setup`]: creates the inbox tables, and migrates those of an earlier release in place
//!   (idempotently);
//! - [`prune`]: `outboxd prune`, batched deletion of old `processed_messages` and outbox rows;
//! - `cli` (feature `cli`): the flags of consumer binaries built on [`runner`]; those of
//!   `outboxd prune` are the binary's (`src/commands/consumer.rs`).
//!
//! `docs/consumer.md` is the guide; `examples/invoice_projection.rs` is a complete consumer.

#[cfg(all(feature = "cli", feature = "rabbitmq"))]
pub mod cli;
pub mod fault;
pub mod inbox;
pub mod key;
pub mod message;
#[cfg(feature = "mysql")]
pub mod mysql;
#[cfg(feature = "postgres")]
pub mod postgres;
pub mod processor;
pub mod prune;
#[cfg(feature = "rabbitmq")]
pub mod runner;
pub mod setup;

pub use inbox::{Aggregate, InboxBackend};
pub use key::IdempotencyKey;
pub use message::Message;
#[cfg(feature = "mysql")]
pub use mysql::{MyProcessor, Mysql};
#[cfg(feature = "postgres")]
pub use postgres::{PgProcessor, Postgres};
pub use processor::{Database, Handler, InboxProcessor};
#[cfg(feature = "rabbitmq")]
pub use runner::{OnPoison, Processor, RunnerOptions, Stats};

use std::fmt;

/// The default name of the dedupe table (`migrations/*/…_processed_messages.sql`).
pub const PROCESSED_TABLE: &str = "processed_messages";
/// The default name of the stale gate's table (same migration files).
pub const VERSIONS_TABLE: &str = "consumer_aggregate_versions";
/// Longest consumer name: the key column is `varchar(100)` on both databases.
pub const MAX_CONSUMER_LEN: usize = 100;

/// What became of a message inside the caller's transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim<T> {
    /// First time this consumer sees the id: the effect ran and returned `T`. Commit.
    Applied(T),
    /// The id was already processed by this consumer (or is being processed by a concurrent
    /// transaction that then committed): nothing ran.
    Duplicate,
    /// The stale gate dropped it: the aggregate already has version `applied`, this message
    /// carries `version` ≤ `applied`. The id is recorded, the effect did not run.
    Stale { version: i64, applied: i64 },
}

impl<T> Claim<T> {
    pub fn is_applied(&self) -> bool {
        matches!(self, Claim::Applied(_))
    }

    /// Short name for logs and counters.
    pub fn kind(&self) -> &'static str {
        match self {
            Claim::Applied(_) => "applied",
            Claim::Duplicate => "duplicate",
            Claim::Stale { .. } => "stale",
        }
    }

    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Claim<U> {
        match self {
            Claim::Applied(t) => Claim::Applied(f(t)),
            Claim::Duplicate => Claim::Duplicate,
            Claim::Stale { version, applied } => Claim::Stale { version, applied },
        }
    }
}

/// Errors of the consumer kit. Every one says whether running the same transaction again can
/// succeed ([`ConsumerError::is_retryable`]): the runner retries those without counting them
/// as failures of the message, and counts the others towards `--max-failures`.
#[derive(Debug, thiserror::Error)]
pub enum ConsumerError {
    /// Deadlock, serialization failure or lock wait timeout: the database rolled the
    /// transaction back; running it again is the fix.
    #[error("transaction conflict (retry): {0}")]
    Conflict(String),

    /// A database error ([`fault::classify_sql`]): `retryable` when the database cannot take
    /// the write now (connection lost, read-only after a failover: retried with backoff on a
    /// new session); otherwise the message's data broke a rule, which counts towards
    /// `--max-failures`. Schema and grant problems are [`ConsumerError::Config`] instead.
    #[error("database: {message}")]
    Database { message: String, retryable: bool },

    /// The broker connection or channel failed.
    #[error("broker: {message}")]
    Broker { message: String, retryable: bool },

    /// The setup is wrong (a missing table, a bad flag): `fix` says what to do.
    #[error("{problem}\n  fix: {fix}")]
    Config { problem: String, fix: String },

    /// The message's envelope is unusable (no message id, an id that is not a UUID, a
    /// malformed version header). Retrying cannot help: the runner treats it as poison at once.
    #[error("bad message: {0}")]
    BadMessage(String),

    /// The handler failed. Retryable handler errors are retried without limit (a remote API
    /// that is down); the others count towards `--max-failures`.
    #[error("handler: {message}")]
    Handler { message: String, retryable: bool },

    /// `--on-poison halt` stopped the consumer at this message.
    #[error("halted on poison message {id}: {error}")]
    Halted { id: String, error: String },
}

impl ConsumerError {
    pub fn is_retryable(&self) -> bool {
        match self {
            ConsumerError::Conflict(_) => true,
            ConsumerError::Database { retryable, .. }
            | ConsumerError::Broker { retryable, .. }
            | ConsumerError::Handler { retryable, .. } => *retryable,
            ConsumerError::Config { .. }
            | ConsumerError::BadMessage(_)
            | ConsumerError::Halted { .. } => false,
        }
    }

    /// A handler failure that retrying will not fix (bad payload, a business rule): counts
    /// towards `--max-failures`.
    pub fn permanent(e: impl fmt::Display) -> Self {
        ConsumerError::Handler {
            message: e.to_string(),
            retryable: false,
        }
    }

    /// A handler failure that may pass (a remote service that is down): retried in place with
    /// backoff, never counted as a failure of the message.
    pub fn transient(e: impl fmt::Display) -> Self {
        ConsumerError::Handler {
            message: e.to_string(),
            retryable: true,
        }
    }

    pub fn config(problem: impl Into<String>, fix: impl Into<String>) -> Self {
        ConsumerError::Config {
            problem: problem.into(),
            fix: fix.into(),
        }
    }

    /// Whether the database session may be broken (reconnect before the next attempt). A
    /// conflict leaves the session usable; a lost connection does not.
    pub(crate) fn session_lost(&self) -> bool {
        matches!(
            self,
            ConsumerError::Database {
                retryable: true,
                ..
            }
        )
    }
}

#[cfg(feature = "postgres")]
impl From<tokio_postgres::Error> for ConsumerError {
    fn from(e: tokio_postgres::Error) -> Self {
        postgres::classify(&e)
    }
}

#[cfg(feature = "mysql")]
impl From<mysql_async::Error> for ConsumerError {
    fn from(e: mysql_async::Error) -> Self {
        mysql::classify(e)
    }
}

impl From<lapin::Error> for ConsumerError {
    fn from(e: lapin::Error) -> Self {
        ConsumerError::Broker {
            message: e.to_string(),
            retryable: true,
        }
    }
}

impl From<crate::Error> for ConsumerError {
    fn from(e: crate::Error) -> Self {
        match e {
            crate::Error::Config { problem, fix } => ConsumerError::Config { problem, fix },
            other => ConsumerError::Database {
                retryable: other.is_retryable(),
                message: other.to_string(),
            },
        }
    }
}

impl From<ConsumerError> for crate::Error {
    fn from(e: ConsumerError) -> Self {
        match e {
            ConsumerError::Config { problem, fix } => crate::Error::Config { problem, fix },
            ConsumerError::Database { message, retryable } => {
                crate::Error::source(message, retryable)
            }
            other => crate::Error::Other(other.to_string()),
        }
    }
}

/// The inbox of one consumer: its name (the first half of the `processed_messages` key), the
/// tables, and whether the stale gate is on. Cheap to clone; share one per consumer.
#[derive(Debug, Clone)]
pub struct Inbox {
    consumer: String,
    processed: crate::outbox::TableName,
    versions: Option<crate::outbox::TableName>,
}

impl Inbox {
    /// An inbox for `consumer` on `processed_messages`, without the stale gate. The name
    /// separates consumers sharing one table: each sees every event once.
    pub fn new(consumer: &str) -> Result<Inbox, ConsumerError> {
        if consumer.is_empty() || consumer.len() > MAX_CONSUMER_LEN {
            return Err(ConsumerError::config(
                format!(
                    "consumer name {consumer:?} must be 1 to {MAX_CONSUMER_LEN} bytes (the key column is varchar({MAX_CONSUMER_LEN}))"
                ),
                "name the consumer after its service and purpose, e.g. billing_projection",
            ));
        }
        Ok(Inbox {
            consumer: consumer.to_string(),
            processed: table(PROCESSED_TABLE)?,
            versions: None,
        })
    }

    /// Uses another dedupe table (`schema.table` on Postgres, `db.table` on MySQL).
    pub fn with_table(mut self, processed: &str) -> Result<Inbox, ConsumerError> {
        self.processed = table(processed)?;
        Ok(self)
    }

    /// Turns the stale gate on, with its table (default `consumer_aggregate_versions`).
    pub fn with_stale_gate(mut self, versions: Option<&str>) -> Result<Inbox, ConsumerError> {
        self.versions = Some(table(versions.unwrap_or(VERSIONS_TABLE))?);
        Ok(self)
    }

    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    pub fn stale_gate(&self) -> bool {
        self.versions.is_some()
    }
}

fn table(name: &str) -> Result<crate::outbox::TableName, ConsumerError> {
    crate::outbox::TableName::parse(name).map_err(|_| {
        ConsumerError::config(
            format!("{name:?} is not a plain [schema.]table name"),
            "write e.g. processed_messages or app.processed_messages",
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_know_whether_to_retry() {
        assert!(ConsumerError::Conflict("deadlock".into()).is_retryable());
        assert!(ConsumerError::transient("503").is_retryable());
        assert!(!ConsumerError::permanent("bad total").is_retryable());
        assert!(!ConsumerError::BadMessage("no id".into()).is_retryable());
        assert!(!ConsumerError::config("p", "f").is_retryable());
        let lost = ConsumerError::Database {
            message: "closed".into(),
            retryable: true,
        };
        assert!(lost.is_retryable() && lost.session_lost());
        assert!(!ConsumerError::Conflict("x".into()).session_lost());
    }

    #[test]
    fn inbox_names() {
        assert!(Inbox::new("").is_err());
        assert!(Inbox::new(&"c".repeat(101)).is_err());
        let i = Inbox::new("billing").unwrap();
        assert!(!i.stale_gate());
        let i = i.with_stale_gate(None).unwrap();
        assert!(i.stale_gate());
        assert!(Inbox::new("b").unwrap().with_table("a;b").is_err());
        assert_eq!(
            Claim::<()>::Stale {
                version: 1,
                applied: 2
            }
            .kind(),
            "stale"
        );
    }
}
