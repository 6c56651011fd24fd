//! What holds for both sources and every sink: randomized fault injection and the kill loop,
//! concurrent starts, NATS JetStream, routing and partitions, the outbox table's shapes, the
//! message format, metrics, and the TCP fault proxy the fault tests rely on.

#[path = "../common/mod.rs"]
mod common;

mod concurrent_start;
mod conformance;
mod debezium;
mod debezium_takeover;
mod exactness;
mod fault_suite;
mod faults;
mod fleet;
mod ha;
mod kafka_broker;
mod kafka_sink;
mod kill_loop;
mod message_format;
mod metrics;
mod nats_restart;
mod nats_sink;
mod progress;
mod proxy_selftest;
mod rabbitmq_stream;
mod refusals;
mod routing;
mod sink_conformance;
mod tables;
