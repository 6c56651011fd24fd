//! The consumer and producer kits against real services: the inbox (`processed_messages`) on
//! Postgres and MariaDB, the AMQP and stream consumer runners end to end, pruning, per-field encryption
//! (library, command line and the documented cross-language format), and the documented
//! least-privilege roles running the relay's commands and the consumer.

#[path = "../common/mod.rs"]
mod common;
#[path = "../consumer_support/mod.rs"]
mod consumer_support;

mod consumer_e2e;
mod consumer_faults;
mod consumer_identity;
mod consumer_inbox;
mod consumer_order;
mod consumer_oversized_ids;
mod consumer_prune;
mod consumer_stream;
mod consumer_until_empty;
mod crypto_cli;
mod crypto_fields;
mod crypto_keys;
mod crypto_mysql;
mod crypto_pg;
mod crypto_php;
mod outbox_prune_locks;
mod privilege;
