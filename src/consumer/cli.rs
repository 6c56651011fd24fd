//! The flags of a consumer binary built on the [`runner`](super::runner) (`ConsumeArgs`):
//! where to consume, where the effect goes and how failures are handled, each also read from
//! `OUTBOXD_<FLAG>`. `examples/invoice_projection.rs` flattens them into its own command line.
//! They live in the library (feature `cli`) because consumer binaries are users' programs;
//! the `outboxd` binary's own commands are in `src/commands/`, outside it.

use super::runner::{Declare, OnPoison, RunnerOptions, StreamOptions, StreamStart};
use super::{ConsumerError, Inbox};
use crate::dsn::{redact, DbDsn, SourceDsn};
use clap::Args;
use std::time::Duration;

/// `30s`, `500ms`, `2m`, `1h`, `7d`, or plain seconds: the one parser of
/// every duration flag, the `outboxd` binary's included.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 30s"))?;
    let secs = match unit {
        "" | "s" => n,
        "ms" => n / 1000.0,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86400.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m, h, d)")),
    };
    // try_from: a value too large for a Duration (or one that overflows to infinity) is an
    // error, not a panic.
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{s:?} is out of range"))
}

/// The flags of a consumer binary: where to consume, where the effect goes, and how failures
/// are handled.
#[derive(Debug, Clone, Args)]
pub struct ConsumeArgs {
    /// Broker URL, amqp://user:pass@host:5672/vhost, or rabbitmq-stream://user:pass@host:5552/vhost
    /// to read a stream (give it in the environment: it holds a password).
    #[arg(long, env = "OUTBOXD_BROKER", hide_env_values = true)]
    pub broker: crate::dsn::DsnArg,
    /// Queue to consume; with a rabbitmq-stream:// broker, the stream (the relay's --stream).
    #[arg(long, visible_alias = "stream", env = "OUTBOXD_QUEUE")]
    pub queue: String,
    /// This consumer's name: the first half of the processed_messages key.
    #[arg(long, env = "OUTBOXD_CONSUMER")]
    pub consumer: String,
    /// Database of the effect and the inbox: postgres://… or mysql://…
    #[arg(long, env = "OUTBOXD_DB", hide_env_values = true)]
    pub db: crate::dsn::DsnArg,
    /// Unacked messages the broker sends ahead.
    #[arg(long, env = "OUTBOXD_PREFETCH", default_value_t = 64)]
    pub prefetch: u16,
    /// Workers (database connections); messages are spread by aggregate, so each aggregate
    /// keeps its order.
    #[arg(long, env = "OUTBOXD_CONCURRENCY", default_value_t = 1)]
    pub concurrency: usize,
    /// Failures of one message before --on-poison applies (retryable errors do not count).
    #[arg(long, env = "OUTBOXD_MAX_FAILURES", default_value_t = 5)]
    pub max_failures: u32,
    /// What to do with a message that failed --max-failures times.
    #[arg(long, env = "OUTBOXD_ON_POISON", value_enum, default_value_t = OnPoison::Halt)]
    pub on_poison: OnPoison,
    /// First delay of the in-place retry.
    #[arg(long, env = "OUTBOXD_RETRY_MIN", value_parser = parse_duration, default_value = "100ms")]
    pub retry_min: Duration,
    /// Longest delay of the in-place retry.
    #[arg(long, env = "OUTBOXD_RETRY_MAX", value_parser = parse_duration, default_value = "30s")]
    pub retry_max: Duration,
    /// Drop messages whose x-aggregate-version is not newer than the last applied one.
    #[arg(long, env = "OUTBOXD_STALE_GATE")]
    pub stale_gate: bool,
    /// Declare the queue and bind it to this exchange (the relay's --exchange).
    #[arg(long, env = "OUTBOXD_EXCHANGE", requires = "bindings")]
    pub exchange: Option<String>,
    /// Routing-key patterns to bind with --exchange (comma separated), e.g. 'invoice.#'.
    #[arg(
        long = "bind",
        env = "OUTBOXD_BIND",
        value_delimiter = ',',
        requires = "exchange"
    )]
    pub bindings: Vec<String>,
    /// With --exchange: declare the queue single-active-consumer (ordered).
    #[arg(long, env = "OUTBOXD_SINGLE_ACTIVE")]
    pub single_active: bool,
    /// Stop once the queue is empty and nothing is in hand (a batch run).
    #[arg(long, env = "OUTBOXD_UNTIL_EMPTY")]
    pub until_empty: bool,
    /// Most messages committed in one transaction (of those already delivered; 1 = one
    /// transaction per message). A failing message is retried alone; order holds.
    #[arg(long, env = "OUTBOXD_BATCH_SIZE", default_value_t = 1)]
    pub batch_size: usize,
    /// Stream only: read <stream>-0 … <stream>-<N-1> (the relay's --partitions N), one reader
    /// and one worker each.
    #[arg(long, env = "OUTBOXD_PARTITIONS", default_value_t = 0)]
    pub partitions: u32,
    /// Stream only: where to start when the broker holds no offset for --consumer.
    #[arg(long, env = "OUTBOXD_STREAM_START", value_enum, default_value_t = StreamStart::First)]
    pub stream_start: StreamStart,
    /// Stream only: store the offset after this many messages (and every --offset-interval,
    /// and at a graceful stop); a crash reads what came after the stored offset again.
    #[arg(long, env = "OUTBOXD_OFFSET_EVERY", default_value_t = 100)]
    pub offset_every: u64,
    /// Stream only: store the offset at least this often while messages are processed.
    #[arg(long, env = "OUTBOXD_OFFSET_INTERVAL", value_parser = parse_duration, default_value = "1s")]
    pub offset_interval: Duration,
}

/// The database a consumer writes to.
pub enum Database {
    Postgres(DbDsn),
    Mysql(DbDsn),
}

impl ConsumeArgs {
    pub fn runner_options(&self) -> Result<RunnerOptions, ConsumerError> {
        for (flag, url, env) in [
            ("--broker", &self.broker, "OUTBOXD_BROKER"),
            ("--db", &self.db, "OUTBOXD_DB"),
        ] {
            let has_password = crate::dsn::has_secret(url);
            if has_password && std::env::var_os(env).is_none() {
                tracing::warn!("the {flag} URL on the command line carries a password, which other users can read in the process list; use {env} instead");
            }
        }
        if self.concurrency == 0 {
            return Err(ConsumerError::config(
                "--concurrency 0 would process nothing",
                "use --concurrency 1",
            ));
        }
        let mut o = RunnerOptions::new(&self.broker, &self.queue);
        if o.is_stream() {
            if self.concurrency > 1 {
                return Err(ConsumerError::config(
                    "--concurrency applies to queues: a stream is read by one worker, in order",
                    "drop --concurrency; read a partitioned stream (--partitions N) for N workers",
                ));
            }
            if self.exchange.is_some() {
                return Err(ConsumerError::config(
                    "--exchange/--bind declare a queue: a stream is the relay's (its --stream)",
                    "drop --exchange and --bind",
                ));
            }
        } else if self.partitions > 0 {
            return Err(ConsumerError::config(
                "--partitions reads a partitioned stream: the broker URL is not rabbitmq-stream://",
                "consume each partition's queue, or read the streams with --broker rabbitmq-stream://…",
            ));
        }
        o.name = self.consumer.clone();
        o.stream = StreamOptions {
            partitions: self.partitions,
            start: self.stream_start,
            store_every: self.offset_every.max(1),
            store_interval: self.offset_interval,
        };
        o.prefetch = self.prefetch.max(1);
        o.max_failures = self.max_failures;
        o.on_poison = self.on_poison;
        o.retry_min = self.retry_min;
        o.retry_max = self.retry_max.max(self.retry_min);
        o.until_empty = self.until_empty;
        o.batch_size = self.batch_size.max(1);
        o.connection_name = format!("outboxd consumer {} on {}", self.consumer, self.queue);
        o.declare = self.exchange.as_ref().map(|x| Declare {
            exchange: x.clone(),
            bindings: self.bindings.clone(),
            single_active: self.single_active,
        });
        Ok(o)
    }

    pub fn inbox(&self) -> Result<Inbox, ConsumerError> {
        let inbox = Inbox::new(&self.consumer)?;
        if self.stale_gate {
            inbox.with_stale_gate(None)
        } else {
            Ok(inbox)
        }
    }

    pub fn database(&self) -> Result<Database, ConsumerError> {
        match SourceDsn::parse(&self.db)? {
            SourceDsn::Postgres(d) => Ok(Database::Postgres(d)),
            SourceDsn::Mysql(d) => Ok(Database::Mysql(d)),
            SourceDsn::File(_) => Err(ConsumerError::config(
                format!("--db {} is not a database", redact(&self.db)),
                "use postgres://user@host:5432/db or mysql://user@host:3306/db",
            )),
        }
    }
}
