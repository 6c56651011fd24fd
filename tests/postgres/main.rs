//! Postgres CDC end to end: the relay binary against a real Postgres (logical replication)
//! and RabbitMQ or stdout, each test on a database, slot and broker names of its own, two at a
//! time. What restarts or reconfigures a shared server is in `tests/disruptive`.

#[path = "../common/mod.rs"]
mod common;

mod pg_config;
mod pg_failover;
mod pg_faults;
mod pg_inprocess;
mod pg_limits;
mod pg_operator;
mod pg_partitions;
mod pg_poll;
mod pg_position;
mod pg_rabbitmq;
mod pg_recovery;
mod pg_snapshot;
mod pg_stdout;
mod pg_tls;
mod pg_versions;
