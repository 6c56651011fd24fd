//! What a runner is told ([`RunnerOptions`], [`OnPoison`], [`Declare`]: the flags of a
//! consumer binary, parsed in `consumer::cli`) and what it counts ([`Stats`]). Plain data,
//! apart from the loop, so the command line and the tests can build and read it.

use crate::dsn::redact;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// What happens to a message that failed `max_failures` times (`--on-poison`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnPoison {
    /// Stop the consumer, leaving the message in the queue (an operator fixes the cause).
    #[default]
    Halt,
    /// Move it to `<queue>.dead` with the error in headers, then ack it.
    Park,
    /// Log it and ack it: its effect never happens.
    Skip,
}

/// Where a stream consumer starts when the broker holds no offset for its name
/// (`--stream-start`); a stored offset always wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StreamStart {
    /// The first message the stream still holds.
    #[default]
    First,
    /// The last chunk the stream holds.
    Last,
    /// Only messages published after the consumer subscribed.
    Next,
}

/// How a runner reads RabbitMQ streams (a `rabbitmq-stream://` broker URL).
#[derive(Debug, Clone)]
pub struct StreamOptions {
    /// `--partitions N`: read `<stream>-0` … `<stream>-<N-1>` (one reader and one worker each)
    /// instead of `<stream>`; 0 = one stream.
    pub partitions: u32,
    pub start: StreamStart,
    /// Store the offset once this many messages were settled since the last store …
    pub store_every: u64,
    /// … or once this long has passed (and at shutdown). What was processed after the last
    /// stored offset is read again after a crash, and found claimed.
    pub store_interval: Duration,
}

impl Default for StreamOptions {
    fn default() -> Self {
        StreamOptions {
            partitions: 0,
            start: StreamStart::First,
            store_every: 100,
            store_interval: Duration::from_secs(1),
        }
    }
}

/// The queue to declare and bind when the consumer owns its topology (`--bind`).
#[derive(Debug, Clone)]
pub struct Declare {
    /// The relay's exchange (`--exchange`); it must exist (the relay declares it).
    pub exchange: String,
    /// Routing-key patterns bound to the queue (`invoice.#`).
    pub bindings: Vec<String>,
    /// Declare the queue with `x-single-active-consumer` (ordered consumption).
    pub single_active: bool,
}

#[derive(Clone)]
pub struct RunnerOptions {
    /// `amqp://user:pass@host:5672/vhost`: never logged unredacted.
    pub broker: String,
    pub queue: String,
    pub prefetch: u16,
    /// Failures (non-retryable errors) before `on_poison` applies.
    pub max_failures: u32,
    pub on_poison: OnPoison,
    /// In-place retry backoff: first delay and cap.
    pub retry_min: Duration,
    pub retry_max: Duration,
    pub declare: Option<Declare>,
    /// Stop (gracefully) once the queue has nothing ready and nothing is in hand: for batch
    /// runs, drains and benchmarks. What the broker already sent is processed first (the
    /// consumer is cancelled, its stream read to the end, the workers settle it).
    pub until_empty: bool,
    /// Most messages a worker commits in one transaction (of those already delivered; it
    /// never waits to fill a batch). 1 = a transaction per message.
    pub batch_size: usize,
    /// Shown in the broker's connection list.
    pub connection_name: String,
    /// The consumer's name (`--consumer`): on a stream, the name its offset is stored under.
    pub name: String,
    /// Stream reading (used with a `rabbitmq-stream://` broker).
    pub stream: StreamOptions,
}

impl std::fmt::Debug for RunnerOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunnerOptions")
            .field("broker", &redact(&self.broker))
            .field("queue", &self.queue)
            .field("prefetch", &self.prefetch)
            .field("max_failures", &self.max_failures)
            .field("on_poison", &self.on_poison)
            .field("declare", &self.declare)
            .field("until_empty", &self.until_empty)
            .field("batch_size", &self.batch_size)
            .field("name", &self.name)
            .field("stream", &self.stream)
            .finish()
    }
}

impl RunnerOptions {
    pub fn new(broker: &str, queue: &str) -> RunnerOptions {
        RunnerOptions {
            broker: broker.to_string(),
            queue: queue.to_string(),
            prefetch: 64,
            max_failures: 5,
            on_poison: OnPoison::Halt,
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(30),
            declare: None,
            until_empty: false,
            batch_size: 1,
            connection_name: format!("outboxd consumer {queue}"),
            name: queue.to_string(),
            stream: StreamOptions::default(),
        }
    }

    /// Whether the broker URL is a RabbitMQ stream port (`rabbitmq-stream://`,
    /// `rabbitmq-stream+tls://`) rather than AMQP.
    pub fn is_stream(&self) -> bool {
        let b = self.broker.trim_start();
        b.starts_with("rabbitmq-stream://") || b.starts_with("rabbitmq-stream+tls://")
    }

    /// The streams a stream runner reads, in partition order: `<queue>` or, with
    /// `--partitions N`, `<queue>-0` … `<queue>-<N-1>` (the relay's stream sink's names).
    pub fn streams(&self) -> Vec<String> {
        match self.stream.partitions {
            0 => vec![self.queue.clone()],
            n => (0..n).map(|k| format!("{}-{k}", self.queue)).collect(),
        }
    }

    /// How many processors [`super::Runner::new`] needs: `concurrency` on a queue, one per
    /// stream on a stream port.
    pub fn workers(&self, concurrency: usize) -> usize {
        if self.is_stream() {
            self.streams().len()
        } else {
            concurrency
        }
    }

    /// `<queue>.dead`, where `park` puts poison messages.
    pub fn dead_queue(&self) -> String {
        format!("{}.dead", self.queue)
    }
}

/// Counters of one runner (shared with the caller while it runs).
#[derive(Debug, Default)]
pub struct Stats {
    pub applied: AtomicU64,
    pub duplicates: AtomicU64,
    pub stale: AtomicU64,
    /// Attempts that failed with a retryable error.
    pub retries: AtomicU64,
    /// Attempts that failed with a non-retryable error.
    pub failures: AtomicU64,
    pub parked: AtomicU64,
    pub skipped: AtomicU64,
    /// Acks that could not be sent (channel gone): those messages come again.
    pub acks_lost: AtomicU64,
    /// Deliveries of a channel that died before they were started, dropped unprocessed: the
    /// broker redelivers them, in queue order, after any earlier message it also redelivers.
    pub abandoned: AtomicU64,
}

impl Stats {
    /// Messages settled (acked after commit, parked or skipped).
    pub fn settled(&self) -> u64 {
        [
            &self.applied,
            &self.duplicates,
            &self.stale,
            &self.parked,
            &self.skipped,
        ]
        .iter()
        .map(|c| c.load(Ordering::Relaxed))
        .sum()
    }

    pub fn json(&self) -> serde_json::Value {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        serde_json::json!({
            "applied": g(&self.applied),
            "duplicates": g(&self.duplicates),
            "stale": g(&self.stale),
            "retries": g(&self.retries),
            "failures": g(&self.failures),
            "parked": g(&self.parked),
            "skipped": g(&self.skipped),
            "acks_lost": g(&self.acks_lost),
            "abandoned": g(&self.abandoned),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_hide_the_password() {
        let o = RunnerOptions::new("amqp://u:secret@127.0.0.1/", "q");
        assert!(!format!("{o:?}").contains("secret"));
        assert_eq!(o.dead_queue(), "q.dead");
        assert!(!o.is_stream());
        let mut s = RunnerOptions::new("rabbitmq-stream://u:secret@h:5552/", "orders");
        assert!(s.is_stream());
        assert_eq!(s.streams(), ["orders"]);
        s.stream.partitions = 3;
        assert_eq!(s.streams(), ["orders-0", "orders-1", "orders-2"]);
        assert_eq!((s.workers(8), o.workers(8)), (3, 8));
    }
}
