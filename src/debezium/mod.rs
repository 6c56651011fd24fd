//! Taking over from Debezium: what a Debezium connector left behind, read as outboxd needs it.
//! `offset` reads the position a connector stored (its offset value, from Kafka Connect's
//! offsets topic or Debezium Server's offset file) into what it says about the source's log;
//! `config` reads a connector's configuration (Kafka Connect JSON or Debezium Server
//! `application.properties`) and writes the outboxd configuration file that does the same,
//! naming each option it cannot carry over and why. Both are pure: the sources resolve an
//! offset against the database (`source::postgres::takeover`, `source::mysql::takeover`) and
//! the command layer prints the file. See docs/migrating-from-debezium.md.

pub(crate) mod config;
pub(crate) mod offset;
