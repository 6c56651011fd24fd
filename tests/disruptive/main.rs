//! Tests that restart, stop or reconfigure a server every other test shares (Postgres and
//! MariaDB restarts, purged binlogs, a global binlog setting, held XA prepares, RabbitMQ outages
//! and alarms).
//! Cargo runs test binaries one after another, so nothing outside this binary runs while they
//! do, and inside it every test holds [`ALONE`]: one at a time.

#[path = "../common/mod.rs"]
mod common;

/// Held by every test here for its whole run: one server-disturbing test at a time.
static ALONE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

mod mysql_recovery;
mod mysql_restart;
mod mysql_xa;
mod pg_invalidated;
mod pg_restart;
mod rabbitmq_restart;
