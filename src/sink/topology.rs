//! Partition layouts on RabbitMQ, and the `outboxd topology` command (docs/partitions.md).
//!
//! A layout is N durable queues with single active consumer behind one exchange that picks the
//! queue by partition, fed from the relay's topic exchange by exchange-to-exchange bindings:
//!
//! ```text
//!  relay ──▶ <exchange> (topic) ──#────────▶ <exchange>.partitioned (headers) ──x-partition=k──▶ <exchange>.p<k>
//!                          └──PATTERN─────▶ NAME.partitioned (headers) ──x-partition-<N>=k──▶ NAME.p<k>
//! ```
//!
//! - The relay's own layout (`run --partitions N`, or `topology` without `--group`) is bound
//!   with `#` and routes on `x-partition`; its alternate exchange is `<exchange>.unrouted`.
//! - A consumer group's layout (`topology --group NAME --partitions N --bind PATTERN…`) is bound
//!   with the group's topic patterns and routes on `x-partition-<N>`, which the relay sends for
//!   its own N and for every N in `--group-partitions`; its alternate exchange is
//!   `NAME.unrouted` (fanout, bound to the durable queue of the same name), so an event the
//!   relay sent without the group's header is kept there instead of being dropped.
//!
//! Queue bindings use `x-match = all-with-x`: with plain `all`, RabbitMQ ignores binding
//! arguments whose names start with `x-` and every queue would get every message (measured on
//! RabbitMQ 3.10.8). `all-with-x` needs RabbitMQ 3.10 or later; older brokers refuse the
//! binding (the declaration fails loudly, nothing is misrouted).
//!
//! With `--partition-routing consistent-hash` the partitioned exchange is RabbitMQ's
//! `x-consistent-hash` exchange hashing the header `x-aggregate-id`, every queue bound with
//! weight 1; the broker places aggregates, and its ring can move keys when the broker restarts.

use super::partition::{self, PartitionRouting, QueueType, MAX_PARTITIONS};
use super::rabbitmq::{self, DeclareMode, RabbitConfig, RabbitSink};
use super::SinkError;
use crate::dsn::SinkDsn;
use crate::Error;
use clap::parser::ValueSource;
use clap::ArgMatches;
use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ExchangeKind};
use std::path::PathBuf;
use std::time::Duration;

/// The consistent-hash exchange type (plugin `rabbitmq_consistent_hash_exchange`).
pub const CONSISTENT_HASH: &str = "x-consistent-hash";
pub const CONSISTENT_HASH_PLUGIN: &str = "rabbitmq_consistent_hash_exchange";
/// The `x-match` mode that matches `x-…` headers too (RabbitMQ ≥ 3.10).
pub const MATCH_ALL_WITH_X: &str = "all-with-x";

/// One partitioned layout: what to declare, and how messages reach its queues.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The relay's topic exchange the layout is fed from.
    pub source: String,
    /// `<exchange>` for the relay's own layout, the group's name otherwise.
    pub prefix: String,
    pub partitions: u32,
    /// The header the queues are bound on (`x-partition` or `x-partition-<N>`).
    pub header: String,
    /// Topic patterns binding the partitioned exchange to the source exchange.
    pub patterns: Vec<String>,
    pub queue_type: QueueType,
    pub routing: PartitionRouting,
    /// Whether this is a consumer group (it then has its own `NAME.unrouted`).
    pub group: bool,
}

impl Layout {
    /// The relay's own layout for `run --partitions N` (None when partitions are off).
    pub fn relay(exchange: &str, p: &partition::Partitioning) -> Option<Layout> {
        (p.partitions > 0).then(|| Layout {
            source: exchange.to_string(),
            prefix: exchange.to_string(),
            partitions: p.partitions,
            header: partition::PARTITION_HEADER.to_string(),
            patterns: vec!["#".to_string()],
            queue_type: p.queue_type,
            routing: p.routing,
            group: false,
        })
    }

    /// A consumer group's layout.
    pub fn group(
        exchange: &str,
        name: &str,
        partitions: u32,
        patterns: Vec<String>,
        queue_type: QueueType,
        routing: PartitionRouting,
    ) -> Layout {
        Layout {
            source: exchange.to_string(),
            prefix: name.to_string(),
            partitions,
            header: partition::group_header(partitions),
            patterns,
            queue_type,
            routing,
            group: true,
        }
    }

    /// `<prefix>.partitioned`.
    pub fn exchange(&self) -> String {
        format!("{}.partitioned", self.prefix)
    }

    /// `<prefix>.p<k>`.
    pub fn queue(&self, k: u32) -> String {
        format!("{}.p{k}", self.prefix)
    }

    /// Where messages no partition queue takes go.
    pub fn alternate(&self) -> String {
        if self.group {
            format!("{}.unrouted", self.prefix)
        } else {
            format!("{}.unrouted", self.source)
        }
    }

    fn exchange_kind(&self) -> ExchangeKind {
        match self.routing {
            PartitionRouting::Headers => ExchangeKind::Headers,
            PartitionRouting::ConsistentHash => ExchangeKind::Custom(CONSISTENT_HASH.into()),
        }
    }

    fn exchange_args(&self) -> FieldTable {
        let mut a = FieldTable::default();
        a.insert(
            "alternate-exchange".into(),
            AMQPValue::LongString(self.alternate().into()),
        );
        if self.routing == PartitionRouting::ConsistentHash {
            a.insert(
                "hash-header".into(),
                AMQPValue::LongString("x-aggregate-id".into()),
            );
        }
        a
    }

    /// Arguments of every partition queue.
    pub fn queue_args(&self) -> FieldTable {
        let mut a = FieldTable::default();
        a.insert("x-single-active-consumer".into(), AMQPValue::Boolean(true));
        a.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(self.queue_type.as_str().into()),
        );
        a
    }

    /// Routing key and arguments binding queue `k` to the partitioned exchange.
    pub fn queue_binding(&self, k: u32) -> (String, FieldTable) {
        match self.routing {
            PartitionRouting::Headers => {
                let mut a = FieldTable::default();
                a.insert(
                    "x-match".into(),
                    AMQPValue::LongString(MATCH_ALL_WITH_X.into()),
                );
                a.insert(
                    self.header.clone().into(),
                    AMQPValue::LongString(k.to_string().into()),
                );
                (String::new(), a)
            }
            // The binding key is the queue's weight on the ring.
            PartitionRouting::ConsistentHash => ("1".into(), FieldTable::default()),
        }
    }

    /// What an operator declaring it by hand must create (for error messages and docs).
    pub fn describe(&self) -> String {
        let n = self.partitions;
        let (kind, rule) = match self.routing {
            PartitionRouting::Headers => (
                "headers".to_string(),
                format!("x-match={MATCH_ALL_WITH_X}, {}=<k>", self.header),
            ),
            PartitionRouting::ConsistentHash => (
                format!("{CONSISTENT_HASH} (argument hash-header=x-aggregate-id)"),
                "routing key \"1\" (weight)".to_string(),
            ),
        };
        let unrouted = if self.group {
            format!(
                "; durable fanout exchange {a} bound to durable queue {a}",
                a = self.alternate()
            )
        } else {
            String::new()
        };
        format!(
            "durable {kind} exchange {x} with argument alternate-exchange={ae}, bound to {src} with {patterns}; durable queues {p0} … {plast} with x-single-active-consumer=true and x-queue-type={qt}, each bound to {x} with {rule}{unrouted}",
            x = self.exchange(),
            ae = self.alternate(),
            src = self.source,
            patterns = self.patterns.join(", "),
            p0 = self.queue(0),
            plast = self.queue(n.saturating_sub(1)),
            qt = self.queue_type.as_str(),
        )
    }
}

/// A failed step of a layout declaration.
pub(crate) struct StepFailure {
    pub kind: &'static str,
    pub name: String,
    pub error: lapin::Error,
}

fn fail(kind: &'static str, name: &str) -> impl FnOnce(lapin::Error) -> StepFailure {
    let name = name.to_string();
    move |error| StepFailure { kind, name, error }
}

/// What exists of a layout before it is declared: tells whether N grew since the last
/// declaration (which moves most aggregates to another queue).
///
/// Only `p<N-1>` is looked up in the steady state, and it exists: every failed passive
/// declaration makes lapin log an error, so the relay does not probe for `p<N>` on every
/// connect. A smaller N than before is therefore not detected (see docs/configuration.md).
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Probe {
    pub last: bool,
    pub first: bool,
}

async fn queue_exists(conn: &Connection, name: &str) -> Result<bool, lapin::Error> {
    // A failed passive declaration closes its channel: one channel per probe.
    let ch = conn.create_channel().await?;
    let r = ch
        .queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    match r {
        Ok(_) => {
            let _ = ch.close(200, "OK".into()).await;
            Ok(true)
        }
        Err(e) if is_not_found(&e) => Ok(false),
        Err(e) => Err(e),
    }
}

fn is_not_found(e: &lapin::Error) -> bool {
    matches!(e.kind(), lapin::ErrorKind::ProtocolError(p)
        if matches!(p.kind(), lapin::protocol::AMQPErrorKind::Soft(lapin::protocol::AMQPSoftError::NOTFOUND)))
}

/// Looks for `p<N-1>` and, when it is missing, `p0` of a layout.
pub(crate) async fn probe(conn: &Connection, l: &Layout) -> Result<Probe, lapin::Error> {
    let last = queue_exists(conn, &l.queue(l.partitions - 1)).await?;
    let first = if last || l.partitions == 1 {
        last
    } else {
        queue_exists(conn, &l.queue(0)).await?
    };
    Ok(Probe { last, first })
}

impl Probe {
    /// A warning when the queues found say a smaller N was declared before.
    pub fn changed_count(&self, l: &Layout) -> Option<String> {
        let n = l.partitions;
        (self.first && !self.last).then(|| {
            format!(
                "queue {} exists but {} does not: {} was declared with fewer than {n} partitions before; most aggregates move to another queue now, so their order across the change holds only if the old queues were drained first",
                l.queue(0),
                l.queue(n - 1),
                l.exchange()
            )
        })
    }
}

/// Declares a layout (or, passive, checks that its exchange and queues exist; bindings
/// cannot be checked passively). Queues first, the binding that feeds the layout last, so a
/// message never reaches a partitioned exchange whose queues are not bound yet.
pub(crate) async fn declare_layout(
    conn: &Connection,
    l: &Layout,
    passive: bool,
) -> Result<(), StepFailure> {
    let ch = conn
        .create_channel()
        .await
        .map_err(fail("channel", &l.prefix))?;
    let xopts = ExchangeDeclareOptions {
        passive,
        durable: true,
        ..Default::default()
    };
    let qopts = QueueDeclareOptions {
        passive,
        durable: true,
        ..Default::default()
    };
    if l.group {
        let ae = l.alternate();
        ch.exchange_declare(
            ae.clone().into(),
            ExchangeKind::Fanout,
            xopts,
            FieldTable::default(),
        )
        .await
        .map_err(fail("exchange", &ae))?;
        ch.queue_declare(ae.clone().into(), qopts, FieldTable::default())
            .await
            .map_err(fail("queue", &ae))?;
        if !passive {
            ch.queue_bind(
                ae.clone().into(),
                ae.clone().into(),
                "".into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(fail("binding of queue", &ae))?;
        }
    }
    let x = l.exchange();
    ch.exchange_declare(
        x.clone().into(),
        l.exchange_kind(),
        xopts,
        l.exchange_args(),
    )
    .await
    .map_err(fail("exchange", &x))?;
    for k in 0..l.partitions {
        let q = l.queue(k);
        ch.queue_declare(q.clone().into(), qopts, l.queue_args())
            .await
            .map_err(fail("queue", &q))?;
        if !passive {
            let (key, args) = l.queue_binding(k);
            ch.queue_bind(
                q.clone().into(),
                x.clone().into(),
                key.into(),
                QueueBindOptions::default(),
                args,
            )
            .await
            .map_err(fail("binding of queue", &q))?;
        }
    }
    if !passive {
        for pattern in &l.patterns {
            ch.exchange_bind(
                x.clone().into(),
                l.source.clone().into(),
                pattern.clone().into(),
                ExchangeBindOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(fail("binding of exchange", &x))?;
        }
    }
    let _ = ch.close(200, "OK".into()).await;
    Ok(())
}

/// Checks a consumer group or exchange name: AMQP name characters, not `amq.`, and room for
/// the longest derived name (`.partitioned`).
pub fn validate_name(flag: &str, name: &str) -> Result<(), Error> {
    let ok_chars = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if name.is_empty()
        || !ok_chars
        || name.len() + ".partitioned".len() > 255
        || name.starts_with("amq.")
    {
        return Err(Error::config(
            format!("{flag} {name:?} is not usable for partition queues"),
            format!("use 1 to 243 characters of [A-Za-z0-9-_.:], not starting with amq., e.g. {flag} billing"),
        ));
    }
    Ok(())
}

/// Checks a topic pattern for `--bind`: at most 255 bytes (a binding key is a short string).
fn validate_pattern(p: &str) -> Result<(), Error> {
    if p.is_empty() || p.len() > 255 {
        return Err(Error::config(
            format!("--bind {p:?} is not a topic pattern"),
            "use a pattern of dot-separated words with * and #, e.g. --bind 'invoice.#'",
        ));
    }
    Ok(())
}

/// `outboxd topology`: declare a consumer group's (or the relay's own) partition queues.
#[derive(Debug, Clone, clap::Args)]
pub struct TopologyArgs {
    /// RabbitMQ: amqp://user@host:5672/vhost (amqps:// for TLS).
    #[arg(long, env = "OUTBOXD_SINK", hide_env_values = true)]
    pub sink: Option<crate::dsn::DsnArg>,
    /// File holding the sink URL, or only its password.
    #[arg(long, env = "OUTBOXD_SINK_FILE")]
    pub sink_file: Option<PathBuf>,
    /// The relay's topic exchange (declared too, exactly as the relay declares it).
    #[arg(long, env = "OUTBOXD_EXCHANGE", default_value = "outbox")]
    pub exchange: String,
    /// Consumer group: declares NAME.partitioned and queues NAME.p0 … NAME.p<N-1>, routed on
    /// x-partition-<N>. Without it: the relay's own <exchange>.partitioned and <exchange>.p<k>
    /// (for an administrator declaring them for a relay that runs with --declare passive).
    #[arg(long, env = "OUTBOXD_GROUP")]
    pub group: Option<String>,
    /// Number of partition queues.
    #[arg(long, env = "OUTBOXD_PARTITIONS")]
    pub partitions: u32,
    /// Topic pattern binding the group to the exchange (repeat it, or comma separate; default #).
    #[arg(long = "bind", env = "OUTBOXD_BIND", value_delimiter = ',')]
    pub bind: Vec<String>,
    /// x-queue-type of the partition queues.
    #[arg(long, env = "OUTBOXD_QUEUE_TYPE", value_enum, default_value_t = QueueType::Classic)]
    pub queue_type: QueueType,
    /// headers (the relay computes the partition) or consistent-hash (RabbitMQ's plugin).
    #[arg(long, env = "OUTBOXD_PARTITION_ROUTING", value_enum, default_value_t = PartitionRouting::Headers)]
    pub partition_routing: PartitionRouting,
    /// auto: declare (idempotent); passive: only check that the exchanges and queues exist.
    #[arg(long, env = "OUTBOXD_DECLARE", value_enum, default_value_t = DeclareMode::Auto)]
    pub declare: DeclareMode,
    /// PEM CA certificate trusted for an amqps:// sink.
    #[arg(long, env = "OUTBOXD_SINK_CA")]
    pub sink_ca: Option<PathBuf>,
    /// PEM client certificate for an amqps:// sink (needs --sink-key).
    #[arg(long, env = "OUTBOXD_SINK_CERT")]
    pub sink_cert: Option<PathBuf>,
    /// PEM private key of --sink-cert.
    #[arg(long, env = "OUTBOXD_SINK_KEY")]
    pub sink_key: Option<PathBuf>,
    /// Queue type of <exchange>.unrouted and <exchange>.dead (as `run --dead-queue-type`).
    #[arg(long, env = "OUTBOXD_DEAD_QUEUE_TYPE", value_enum, default_value_t = QueueType::Classic)]
    pub dead_queue_type: QueueType,
}

impl TopologyArgs {
    /// The layout asked for, validated.
    pub fn layout(&self) -> Result<Layout, Error> {
        rabbitmq::validate_exchange(&self.exchange)?;
        validate_name("--exchange", &self.exchange)?;
        if self.partitions == 0 || self.partitions > MAX_PARTITIONS {
            return Err(Error::config(
                format!("--partitions {} is out of range", self.partitions),
                format!("use 1 to {MAX_PARTITIONS}, e.g. --partitions 4"),
            ));
        }
        for p in &self.bind {
            validate_pattern(p)?;
        }
        match &self.group {
            Some(name) => {
                validate_name("--group", name)?;
                if *name == self.exchange {
                    return Err(Error::config(
                        format!("--group {name:?} is the exchange's name: the group's queues would be the relay's own"),
                        "give the group its own name (e.g. --group billing), or drop --group to declare the relay's own partition queues",
                    ));
                }
                let patterns = if self.bind.is_empty() {
                    vec!["#".to_string()]
                } else {
                    self.bind.clone()
                };
                Ok(Layout::group(
                    &self.exchange,
                    name,
                    self.partitions,
                    patterns,
                    self.queue_type,
                    self.partition_routing,
                ))
            }
            None => {
                if !self.bind.is_empty() {
                    return Err(Error::config(
                        "--bind without --group: the relay's own partition queues are bound with #",
                        "add --group NAME for a consumer group with its own topic patterns",
                    ));
                }
                let p = partition::PartitionArgs {
                    partitions: self.partitions,
                    group_partitions: Vec::new(),
                    queue_type: self.queue_type,
                    partition_routing: self.partition_routing,
                }
                .validate()?;
                Ok(Layout::relay(&self.exchange, &p).expect("partitions > 0"))
            }
        }
    }
}

/// Runs `outboxd topology`.
pub async fn run(args: TopologyArgs, m: &ArgMatches) -> Result<(), Error> {
    let layout = args.layout()?;
    if args.declare == DeclareMode::Off {
        return Err(Error::config(
            "--declare off: topology would do nothing",
            "use --declare auto (declare) or --declare passive (check)",
        ));
    }
    let from_argv = m.value_source("sink") == Some(ValueSource::CommandLine);
    let url = crate::cli::resolve_dsn(
        args.sink.as_deref(),
        args.sink_file.as_deref(),
        from_argv,
        "sink",
    )?
    .ok_or_else(|| {
        Error::config(
            "no RabbitMQ given",
            "pass --sink amqp://user@host:5672/vhost (or set OUTBOXD_SINK, or --sink-file)",
        )
    })?;
    let SinkDsn::Amqp(url) = SinkDsn::parse(&url)? else {
        return Err(Error::config(
            "topology declares RabbitMQ queues: the sink must be amqp:// or amqps://",
            "pass --sink amqp://user@host:5672/vhost",
        ));
    };
    let sink = RabbitSink::new(RabbitConfig {
        url,
        exchange: args.exchange.clone(),
        declare: args.declare,
        max_message_bytes: rabbitmq::DEFAULT_MAX_MESSAGE_BYTES,
        op_timeout: Duration::from_secs(30),
        ca_file: args.sink_ca.clone(),
        cert_file: args.sink_cert.clone(),
        key_file: args.sink_key.clone(),
        connection_name: format!(
            "outboxd topology {}",
            args.group.as_deref().unwrap_or(&args.exchange)
        ),
        partitioning: Default::default(),
        dead_queue_type: args.dead_queue_type,
        message: Default::default(),
    })?;
    let passive = args.declare == DeclareMode::Passive;
    let warning = sink
        .declare_layouts(std::slice::from_ref(&layout))
        .await
        .map_err(Error::from)?;
    let verb = if passive { "exists" } else { "declared" };
    println!(
        "ok   exchange {} and its alternate exchange {}.unrouted ({verb})",
        args.exchange, args.exchange
    );
    if layout.group {
        println!(
            "ok   exchange {a} and queue {a} ({verb})",
            a = layout.alternate()
        );
    }
    println!(
        "ok   exchange {} ({}), bound to {} with {} ({verb})",
        layout.exchange(),
        match layout.routing {
            PartitionRouting::Headers => "headers",
            PartitionRouting::ConsistentHash => CONSISTENT_HASH,
        },
        layout.source,
        layout.patterns.join(", ")
    );
    println!(
        "ok   queues {} … {} (single active consumer, {}) ({verb})",
        layout.queue(0),
        layout.queue(layout.partitions - 1),
        layout.queue_type.as_str()
    );
    for w in warning {
        println!("warn {w}");
    }
    match (layout.routing, layout.group) {
        (PartitionRouting::Headers, true) => println!(
            "note the relay must send {h}: run it with --group-partitions {n} (or --partitions {n}); until then the group's events wait in {ae}",
            h = layout.header,
            n = layout.partitions,
            ae = layout.alternate()
        ),
        (PartitionRouting::Headers, false) => println!(
            "note run the relay with --partitions {} (and --declare passive if it may not declare)",
            layout.partitions
        ),
        (PartitionRouting::ConsistentHash, _) => println!(
            "note the broker places aggregates (hash of x-aggregate-id); its ring can move keys when the broker restarts"
        ),
    }
    Ok(())
}

/// The RabbitMQ part of `outboxd check` (flattened into its flags): the same sink flags as
/// `run`. Without `--sink` (or with `stdout`) no sink is checked.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct SinkCheckArgs {
    /// Also check this RabbitMQ sink: amqp://user@host:5672/vhost (amqps:// for TLS).
    #[arg(long, env = "OUTBOXD_SINK", hide_env_values = true)]
    pub sink: Option<crate::dsn::DsnArg>,
    /// File holding the sink URL, or only its password.
    #[arg(long, env = "OUTBOXD_SINK_FILE")]
    pub sink_file: Option<PathBuf>,
    /// The relay's topic exchange.
    #[arg(long, env = "OUTBOXD_EXCHANGE", default_value = "outbox")]
    pub exchange: String,
    /// How the relay treats the topology: with auto, a missing exchange or queue is declared
    /// by the relay (a warning here); with passive it must exist (a failure).
    #[arg(long, env = "OUTBOXD_DECLARE", value_enum, default_value_t = DeclareMode::Auto)]
    pub declare: DeclareMode,
    /// PEM CA certificate trusted for an amqps:// sink.
    #[arg(long, env = "OUTBOXD_SINK_CA")]
    pub sink_ca: Option<PathBuf>,
    /// PEM client certificate for an amqps:// sink (needs --sink-key).
    #[arg(long, env = "OUTBOXD_SINK_CERT")]
    pub sink_cert: Option<PathBuf>,
    /// PEM private key of --sink-cert.
    #[arg(long, env = "OUTBOXD_SINK_KEY")]
    pub sink_key: Option<PathBuf>,
    #[command(flatten)]
    pub partitions: partition::PartitionArgs,
    /// The type `run --dead-queue-type` declares <exchange>.unrouted and <exchange>.dead with
    /// (a passive check accepts either; this only shapes the expectation it reports).
    #[arg(long, env = "OUTBOXD_DEAD_QUEUE_TYPE", value_enum, default_value_t = QueueType::Classic)]
    pub dead_queue_type: QueueType,
}

fn check_line(
    level: crate::operator::Level,
    check: &str,
    detail: impl Into<String>,
    fix: Option<String>,
) -> crate::operator::CheckLine {
    crate::operator::CheckLine {
        level,
        check: check.into(),
        detail: detail.into(),
        fix,
    }
}

/// The RabbitMQ checks of `outboxd check`: connect, the topology the relay uses (its partition
/// queues included), and the consistent-hash plugin when `--partition-routing
/// consistent-hash` asks for it. Never stops at the first failure.
pub async fn check_rabbitmq(
    args: &SinkCheckArgs,
    m: &ArgMatches,
) -> Vec<crate::operator::CheckLine> {
    use crate::operator::Level;
    let mut out = Vec::new();
    let from_argv = m.value_source("sink") == Some(ValueSource::CommandLine);
    let url = match crate::cli::resolve_dsn(
        args.sink.as_deref(),
        args.sink_file.as_deref(),
        from_argv,
        "sink",
    ) {
        Ok(Some(u)) => u,
        Ok(None) => return out,
        Err(e) => {
            out.push(check_line(Level::Fail, "sink", e.to_string(), None));
            return out;
        }
    };
    let url = match SinkDsn::parse(&url) {
        Ok(SinkDsn::Amqp(u)) => u,
        Ok(SinkDsn::Stdout | SinkDsn::Nats(_)) => return out,
        Err(e) => {
            out.push(check_line(Level::Fail, "sink", e.to_string(), None));
            return out;
        }
    };
    let partitioning = match args
        .partitions
        .validate()
        .and_then(|p| rabbitmq::validate_exchange(&args.exchange).map(|_| p))
    {
        Ok(p) => p,
        Err(e) => {
            out.push(check_line(
                Level::Fail,
                "rabbitmq settings",
                e.to_string(),
                None,
            ));
            return out;
        }
    };
    let cfg = RabbitConfig {
        url,
        exchange: args.exchange.clone(),
        declare: DeclareMode::Passive,
        max_message_bytes: rabbitmq::DEFAULT_MAX_MESSAGE_BYTES,
        op_timeout: Duration::from_secs(15),
        ca_file: args.sink_ca.clone(),
        cert_file: args.sink_cert.clone(),
        key_file: args.sink_key.clone(),
        connection_name: "outboxd check".into(),
        partitioning: partitioning.clone(),
        dead_queue_type: args.dead_queue_type,
        message: Default::default(),
    };
    let sink = match RabbitSink::new(cfg) {
        Ok(s) => s,
        Err(e) => {
            out.push(check_line(
                Level::Fail,
                "rabbitmq settings",
                e.to_string(),
                None,
            ));
            return out;
        }
    };
    let conn = match tokio::time::timeout(Duration::from_secs(15), sink.connection()).await {
        Ok(Ok(c)) => {
            out.push(check_line(Level::Ok, "rabbitmq connect", "connected", None));
            c
        }
        Ok(Err(e)) => {
            let (detail, fix) = split_fix(&e);
            out.push(check_line(Level::Fail, "rabbitmq connect", detail, fix));
            return out;
        }
        Err(_) => {
            out.push(check_line(
                Level::Fail,
                "rabbitmq connect",
                "no answer within 15s",
                Some("check the host and port of --sink and that RabbitMQ runs".into()),
            ));
            return out;
        }
    };
    if partitioning.routing == PartitionRouting::ConsistentHash {
        out.push(consistent_hash_plugin(&conn).await);
    }
    let _ = conn.close(200, "OK".into()).await;
    if args.declare != DeclareMode::Off {
        let layouts: Vec<Layout> = Layout::relay(&args.exchange, &partitioning)
            .into_iter()
            .collect();
        let what = match layouts.first() {
            Some(l) => format!(
                "exchange {x}, {x}.unrouted, {x}.dead, {} and queues {} … {}",
                l.exchange(),
                l.queue(0),
                l.queue(l.partitions - 1),
                x = args.exchange
            ),
            None => format!("exchange {x}, {x}.unrouted, {x}.dead", x = args.exchange),
        };
        match sink.declare_layouts(&layouts).await {
            Ok(_) => out.push(check_line(
                Level::Ok,
                "rabbitmq topology",
                format!("{what} exist"),
                None,
            )),
            Err(e) => {
                let (detail, fix) = split_fix(&e);
                let level = match (&e, args.declare) {
                    // The relay declares what is missing itself.
                    (SinkError::Config { .. }, DeclareMode::Auto) => Level::Warn,
                    _ => Level::Fail,
                };
                let detail = if level == Level::Warn {
                    format!("{detail} (the relay declares it with --declare auto)")
                } else {
                    detail
                };
                out.push(check_line(level, "rabbitmq topology", detail, fix));
            }
        }
    }
    out
}

fn split_fix(e: &SinkError) -> (String, Option<String>) {
    match e {
        SinkError::Config { problem, fix } => (problem.clone(), Some(fix.clone())),
        other => (other.to_string(), None),
    }
}

/// Declares and deletes a scratch exchange of type `x-consistent-hash`: the only way AMQP
/// tells whether the plugin is enabled.
async fn consistent_hash_plugin(conn: &Connection) -> crate::operator::CheckLine {
    use crate::operator::Level;
    let name = format!("outboxd.check.{}", uuid::Uuid::new_v4().simple());
    let r = async {
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            name.clone().into(),
            ExchangeKind::Custom(CONSISTENT_HASH.into()),
            ExchangeDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        let _ = ch
            .exchange_delete(name.clone().into(), Default::default())
            .await;
        let _ = ch.close(200, "OK".into()).await;
        Ok::<(), lapin::Error>(())
    }
    .await;
    match r {
        Ok(()) => check_line(
            Level::Ok,
            "rabbitmq consistent-hash",
            format!(
                "exchange type {CONSISTENT_HASH} is available (plugin {CONSISTENT_HASH_PLUGIN})"
            ),
            None,
        ),
        Err(e) => {
            let text = match e.kind() {
                lapin::ErrorKind::ProtocolError(p) => p.get_message().to_string(),
                _ => e.to_string(),
            };
            if is_unknown_exchange_type(&text) {
                let SinkError::Config { problem, fix } = missing_plugin() else {
                    unreachable!()
                };
                check_line(Level::Fail, "rabbitmq consistent-hash", problem, Some(fix))
            } else {
                check_line(
                    Level::Warn,
                    "rabbitmq consistent-hash",
                    format!("could not tell whether the plugin {CONSISTENT_HASH_PLUGIN} is enabled: {text}"),
                    Some(format!("rabbitmq-plugins list {CONSISTENT_HASH_PLUGIN} (on the broker)")),
                )
            }
        }
    }
}

/// The text RabbitMQ uses when an exchange type is unknown (the plugin is not enabled).
pub fn is_unknown_exchange_type(text: &str) -> bool {
    let t = text.to_ascii_lowercase();
    t.contains("exchange type") && (t.contains("unknown") || t.contains("invalid"))
}

/// `SinkError` for a consistent-hash layout on a broker without the plugin.
pub(crate) fn missing_plugin() -> SinkError {
    SinkError::Config {
        problem: format!("RabbitMQ has no exchange type {CONSISTENT_HASH}: the plugin {CONSISTENT_HASH_PLUGIN} is not enabled (needed by --partition-routing consistent-hash)"),
        fix: format!("rabbitmq-plugins enable {CONSISTENT_HASH_PLUGIN} (on every node), or use --partition-routing headers"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(group: Option<&str>, n: u32, bind: &[&str]) -> TopologyArgs {
        TopologyArgs {
            sink: None,
            sink_file: None,
            exchange: "outbox".into(),
            group: group.map(String::from),
            partitions: n,
            bind: bind.iter().map(|s| s.to_string()).collect(),
            queue_type: QueueType::Classic,
            partition_routing: PartitionRouting::Headers,
            declare: DeclareMode::Auto,
            sink_ca: None,
            sink_cert: None,
            sink_key: None,
            dead_queue_type: QueueType::Classic,
        }
    }

    #[test]
    fn group_and_relay_layouts() {
        let g = args(Some("billing"), 8, &["invoice.#", "order.*"])
            .layout()
            .unwrap();
        assert_eq!(g.exchange(), "billing.partitioned");
        assert_eq!(g.queue(7), "billing.p7");
        assert_eq!(g.header, "x-partition-8");
        assert_eq!(g.alternate(), "billing.unrouted");
        assert_eq!(g.patterns, vec!["invoice.#", "order.*"]);
        let (key, b) = g.queue_binding(3);
        assert_eq!(key, "");
        assert_eq!(
            b.inner().get("x-match"),
            Some(&AMQPValue::LongString("all-with-x".into()))
        );
        assert_eq!(
            b.inner().get("x-partition-8"),
            Some(&AMQPValue::LongString("3".into()))
        );
        let q = g.queue_args();
        assert_eq!(
            q.inner().get("x-single-active-consumer"),
            Some(&AMQPValue::Boolean(true))
        );
        assert!(g.describe().contains("x-partition-8=<k>"));

        let own = args(None, 4, &[]).layout().unwrap();
        assert_eq!(own.exchange(), "outbox.partitioned");
        assert_eq!(own.header, "x-partition");
        assert_eq!(own.alternate(), "outbox.unrouted");
        assert_eq!(own.patterns, vec!["#"]);
        assert!(!own.group);

        let default_bind = args(Some("audit"), 2, &[]).layout().unwrap();
        assert_eq!(default_bind.patterns, vec!["#"]);
    }

    #[test]
    fn bad_topology_arguments_are_refused() {
        assert!(args(Some("outbox"), 4, &[]).layout().is_err());
        assert!(args(Some("a b"), 4, &[]).layout().is_err());
        assert!(args(Some("amq.x"), 4, &[]).layout().is_err());
        assert!(args(Some("g"), 0, &[]).layout().is_err());
        assert!(args(Some("g"), MAX_PARTITIONS + 1, &[]).layout().is_err());
        assert!(args(None, 4, &["#"]).layout().is_err());
        assert!(args(Some("g"), 4, &[""]).layout().is_err());
    }

    #[test]
    fn probe_reports_a_changed_count() {
        let l = args(None, 4, &[]).layout().unwrap();
        let p = |first, last| Probe { last, first };
        assert!(p(false, false).changed_count(&l).is_none());
        assert!(p(true, true).changed_count(&l).is_none());
        assert!(p(true, false)
            .changed_count(&l)
            .unwrap()
            .contains("fewer than 4"));
        assert!(is_unknown_exchange_type(
            "COMMAND_INVALID - unknown exchange type 'x-consistent-hash'"
        ));
    }
}
