//! outboxd: a transactional outbox relay. It tails the Postgres WAL (or the MySQL/MariaDB
//! binlog), keeps the INSERTs on the outbox table, publishes each as a persistent message with
//! publisher confirms, and stores its position only past what the sink confirmed.
//!
//! The data path, in module order: [`source`] → [`relay`] → [`sink`], with [`state`] holding
//! the position and lease, and [`connector`] wiring them together for `outboxd run`.

pub mod backoff;
pub mod commands;
pub mod connector;
pub mod consumer;
pub mod crypto;
pub mod dsn;
pub mod error;
pub mod event;
#[doc(hidden)]
pub mod fuzzing;
pub mod operator;
pub mod outbox;
pub mod relay;
pub mod secret_file;
pub mod sink;
pub mod source;
pub mod state;
pub mod telemetry;
pub mod tls;

pub use error::{Error, ExitStatus, Result};
pub use event::{Checkpoint, OutboxEvent, SourcePosition};
pub use outbox::{ColumnMap, NewEvent, Outbox};
