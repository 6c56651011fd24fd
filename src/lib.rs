//! outboxd: a transactional outbox relay. It tails the Postgres WAL (or the MySQL/MariaDB
//! binlog), keeps the INSERTs on the outbox table, publishes each as a persistent message with
//! publisher confirms, and stores its position only past what the sink confirmed.
//!
//! The data path, in module order: [`source`] → [`relay`] → [`sink`], with [`state`] holding
//! the position and lease, and [`pipeline`] wiring them together for `outboxd run`.
//!
//! # What a service calls
//!
//! The documented surface is what this file re-exports, plus the two kit modules:
//!
//! - the producer's write: [`Outbox`], [`NewEvent`], [`ColumnMap`], [`OutboxBackend`];
//! - the idempotent-consumer kit: [`consumer`] ([`consumer::Inbox`], [`consumer::runner`] with
//!   the `rabbitmq` feature);
//! - per-field encryption: [`crypto`];
//! - the events and errors: [`OutboxEvent`], [`Checkpoint`], [`SourcePosition`], [`Error`],
//!   [`ExitStatus`];
//! - with the `relay` feature, the two seams an implementation plugs into: [`Sink`] (with
//!   [`Delivery`], [`SinkError`]) and [`StateStore`] (with [`Stored`], [`Lease`]); with
//!   `test-util` also their in-memory doubles [`MemorySink`] and [`MemoryStore`].
//!
//! Nothing else is public by accident. The other modules are private unless code outside the
//! crate names them: those the repository's tests, benches and fuzz targets reach into (and the
//! binary's command layer, `src/commands/`, a separate crate root) are `#[doc(hidden)] pub`,
//! and inside them only the submodules that code names are `pub`; the rest are `pub(crate)`.
//! Modules only the binary needs (`db`, `debezium`, `diagnostics`, `progress`, `secret_file`)
//! stay private and lend it the few items it calls through one curated list, `internal`
//! (src/internal.rs). `tests/surface/public.rs` holds the lists of public modules and fails
//! when the surface grows past them. None of the hidden modules carries a stability promise.
//!
//! # Features
//!
//! `postgres` and `mysql` (the database clients for the kits), `rabbitmq` (the consumer
//! runner, and with `relay` the RabbitMQ sink), `nats`, `kafka` and `rabbitmq-stream` (each
//! one sink, with `relay`), `relay` (both sources, the relay, the stores, the sink registry and
//! the stdout sink, the metrics server; takes the two databases and no broker), `cli` (the
//! binary, the consumer binaries' flags in `consumer::cli` and each sink's flags; takes `relay`
//! and `rabbitmq`), all on by default; `test-util` (the memory doubles) off. A service that
//! only writes outbox rows builds with `default-features = false, features = ["postgres"]`.
//!
//! # Layout
//!
//! - The data path: [`source`] (Postgres WAL, MySQL/MariaDB binlog, poll mode) sends
//!   [`event::OutboxEvent`]s and [`event::Checkpoint`]s, every row mapped through one
//!   contract (`source::contract`); [`relay`] keeps the window of
//!   unconfirmed events and acknowledges checkpoints in order; [`sink`] publishes (stdout,
//!   RabbitMQ, NATS JetStream, Kafka, RabbitMQ streams: each sink a folder behind its feature,
//!   known to the rest only through its descriptor in the sink registry); [`state`] stores the
//!   acknowledged position and keeps the lease.
//!   Each log source is a sans-IO transaction assembler (`source::postgres::assemble`,
//!   `source::mysql::assemble`, sharing `source::assemble`) driven by an I/O run loop.
//! - The return path: `state::checkpoint::Checkpointer` — relay acknowledgement → state
//!   store → slot confirm (Postgres: never past what the state row holds) → commit times.
//! - Every log source implements one interface, `source::log::LogSource` (a typed position,
//!   one `start_plan` and one `run`); [`pipeline`] is one `run` generic over the source, the
//!   sink and the state store. Startup, resume and recovery are each source's `start_plan`
//!   (`source::postgres::startup`, `source::mysql::startup`), deciding where to start through
//!   the relay's [`StateStore`] and returning a `StartPlan` (one shape for both, in
//!   `source::startup`); `pipeline` runs every plan through one `drive`, which is handed its
//!   sink and state store (in-process tests run it on the memory doubles).
//! - The kits users call from their own services: [`outbox`] (the producer's write),
//!   [`consumer`] (idempotent consumers), [`crypto`] (per-field encryption).
//! - Operations: [`telemetry`] (logs, metrics, health; every metric is written by one of the
//!   internal events in `telemetry::events`, which also log); `check`, `status` and `offset` of
//!   each source in `source::postgres::diagnostics` and `source::mysql::diagnostics`.
//! - Leaves every module may use: [`names`] (the table and its columns, named by the
//!   [`names::Column`] type), `db` (the Postgres and MySQL clients), `amqp`, `wire`, [`dsn`],
//!   [`tls`], `secret_file`, `backoff`, `diagnostics` (the `check` line), [`error`].
//! - The edge: the command layer (`src/commands/`, the only code that knows `clap` besides
//!   the consumer binaries' flags in `consumer::cli`, each sink's own flags, `sink/*/flags`,
//!   and the `ValueEnum` impls of `commands/values.rs`, which the orphan rule keeps in this
//!   crate) is a module of the binary, `main.rs`, which maps its result to exit codes. The
//!   library never imports it.

// A `pub` item outside the surface above says `pub(crate)`: the compiler flags any other. In
// builds with the binary's feature only: without it, what `internal` lends the binary is
// unreachable by design.
#![cfg_attr(feature = "cli", warn(unreachable_pub))]

// The kits: what services link. Consumers read RabbitMQ deliveries, so their kit needs it.
#[cfg(feature = "rabbitmq")]
pub mod consumer;
pub mod crypto;
pub mod error;
pub mod event;
pub mod outbox;

// Leaves the kits and the relay share. Private: each serves several parts that sit behind
// their own features (the kits, the relay, each broker sink, the binary), so a build with
// fewer features leaves some of their items unused; the `allow(dead_code)`s below hold only
// for such builds. The default build, which compiles every part and is linted with
// `-D warnings`, still reports dead code in them.
#[cfg(feature = "rabbitmq")]
mod amqp;
#[cfg(any(feature = "rabbitmq", feature = "relay"))]
mod backoff;
#[cfg_attr(not(all(feature = "relay", feature = "rabbitmq")), allow(dead_code))]
mod db;
#[doc(hidden)]
pub mod dsn;
#[doc(hidden)]
pub mod names;
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod progress;
#[cfg_attr(not(feature = "cli"), allow(dead_code))]
mod secret_file;
#[cfg(feature = "rabbitmq-stream")]
#[doc(hidden)]
pub mod stream;
#[doc(hidden)]
pub mod tls;
#[cfg(any(feature = "rabbitmq", feature = "relay"))]
#[cfg_attr(
    not(all(
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "rabbitmq-stream"
    )),
    allow(dead_code)
)]
mod wire;

// The relay.
// Only the binary translates a Debezium configuration.
#[cfg(feature = "cli")]
mod debezium;
#[cfg(feature = "relay")]
mod diagnostics;
#[cfg(feature = "relay")]
#[doc(hidden)]
pub mod fleet;
#[cfg(all(feature = "relay", feature = "test-util"))]
#[doc(hidden)]
pub mod fuzzing;
#[cfg(feature = "relay")]
#[cfg_attr(
    not(all(
        feature = "rabbitmq",
        feature = "nats",
        feature = "kafka",
        feature = "rabbitmq-stream"
    )),
    allow(dead_code)
)]
mod identity;
#[cfg(feature = "relay")]
#[doc(hidden)]
pub mod pipeline;
#[cfg(feature = "relay")]
#[doc(hidden)]
pub mod relay;
#[cfg(feature = "relay")]
#[doc(hidden)]
pub mod sink;
#[cfg(feature = "relay")]
#[doc(hidden)]
pub mod source;
#[cfg(feature = "relay")]
#[doc(hidden)]
pub mod state;
#[cfg(feature = "relay")]
#[doc(hidden)]
pub mod telemetry;

// `impl clap::ValueEnum` for the library's option enums. The orphan rule keeps a foreign
// trait's impls for this crate's types in this crate, so this one file of the command layer
// (it stays with the others in `src/commands/`) is compiled into the library, under `cli`.
#[cfg(feature = "cli")]
#[path = "commands/values.rs"]
mod values;

// The binary's view of the private modules above: one curated list (src/internal.rs).
#[cfg(feature = "cli")]
#[doc(hidden)]
pub mod internal;

pub use error::{should_retry, Error, ErrorKind, ExitStatus, Result, ServerCode};
pub use event::{Checkpoint, OutboxEvent, SourcePosition};
pub use outbox::{ColumnMap, NewEvent, Outbox, OutboxBackend};

#[cfg(feature = "relay")]
pub use sink::{Delivery, Sink, SinkError};
#[cfg(feature = "relay")]
pub use state::{Lease, StateStore, Stored};

#[cfg(all(feature = "relay", feature = "test-util"))]
pub use sink::memory::{MemoryHandle, MemorySink};
#[cfg(all(feature = "relay", feature = "test-util"))]
pub use state::memory::{MemoryStore, MemoryStoreHandle};
