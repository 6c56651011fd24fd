//! outboxd: a transactional outbox relay. It tails the Postgres WAL (or the MySQL/MariaDB
//! binlog), keeps the INSERTs on the outbox table, publishes each as a persistent message with
//! publisher confirms, and stores its position only past what the sink confirmed.
//!
//! The data path, in module order: [`source`] → [`relay`] → [`sink`], with [`state`] holding
//! the position and lease, and [`connector`] wiring them together for `outboxd run`.
//!
//! # Layout
//!
//! - The data path: [`source`] (Postgres WAL, MySQL/MariaDB binlog, poll mode) sends
//!   [`event::OutboxEvent`]s and [`event::Checkpoint`]s; [`relay`] keeps the window of
//!   unconfirmed events and acknowledges checkpoints in order; [`sink`] publishes (stdout,
//!   RabbitMQ, NATS JetStream, Kafka); [`state`] stores the acknowledged position and keeps the lease.
//! - Startup, resume and recovery: `source::postgres::startup` and `source::mysql::startup`,
//!   one function per source that decides where to start and returns a `StartPlan` (what both
//!   share is in `source::startup`); [`connector`] runs every plan through one `drive`.
//! - The kits users call from their own services: [`outbox`] (the producer's write),
//!   [`consumer`] (idempotent consumers), [`crypto`] (per-field encryption).
//! - Operations: [`telemetry`] (logs, metrics, health; every metric is written by one of the
//!   internal events in `telemetry::events`, which also log); `check`, `status` and `offset` of
//!   each source in `source::postgres::operator` and `source::mysql::operator`.
//! - Leaves every module may use: [`names`] (the table and its columns), [`db`] (the
//!   Postgres and MySQL clients), [`amqp`], [`dsn`], [`tls`], [`secret_file`], [`backoff`],
//!   [`operator`] (the `check` line), [`error`].
//! - The edge: [`commands`], the only module that knows `clap`; `main.rs` maps its result to
//!   exit codes. Nothing in the library imports it.

pub mod amqp;
pub mod backoff;
pub mod commands;
pub mod connector;
pub mod consumer;
pub mod crypto;
pub mod db;
pub mod dsn;
pub mod error;
pub mod event;
#[doc(hidden)]
pub mod fuzzing;
pub mod names;
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
pub use outbox::{ColumnMap, NewEvent, Outbox, OutboxBackend};
