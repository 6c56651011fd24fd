//! MariaDB CDC end to end: the relay binary tailing a real MariaDB binlog (and binlog files)
//! into RabbitMQ or stdout, each test on a database and names of its own, two at a time. What
//! restarts the server, purges its binlogs or changes its globals is in `tests/disruptive`.

#[path = "../common/mod.rs"]
mod common;

mod laravel;
mod mysql_failover;
mod mysql_faults;
mod mysql_file;
mod mysql_hub;
mod mysql_inprocess;
mod mysql_offset_file;
mod mysql_payload;
mod mysql_poll;
mod mysql_position_lost;
mod mysql_rabbitmq;
mod mysql_row_types;
mod mysql_savepoint;
mod mysql_stdout;
mod mysql_tls;
