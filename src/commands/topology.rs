//! `outboxd topology` (declare a consumer group's or the relay's own partition queues): its
//! flags, and turning them into the layouts and sink settings of `sink::topology` and
//! `sink::rabbitmq`, which know nothing of the command line. (The RabbitMQ part of
//! `outboxd check` is the RabbitMQ sink's descriptor's.)

use crate::sink::partition::{self, PartitionRouting, QueueType, MAX_PARTITIONS};
use crate::sink::rabbitmq::{self, RabbitConfig, RabbitSink};
use crate::sink::topology::{validate_name, validate_pattern, Layout, CONSISTENT_HASH};
use crate::sink::{DeclareMode, SinkDsn, SinkKind};
use crate::Error;
use clap::parser::ValueSource;
use clap::ArgMatches;
use std::path::PathBuf;
use std::time::Duration;

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
                let p = partition::PartitionSpec {
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
    let url = super::resolve_dsn(
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
    let sink = SinkDsn::parse(&url)?;
    if sink.kind() != SinkKind::Rabbit {
        return Err(Error::config(
            "topology declares RabbitMQ queues: the sink must be amqp:// or amqps://",
            "pass --sink amqp://user@host:5672/vhost",
        ));
    }
    let sink = RabbitSink::new(RabbitConfig {
        url: sink.url().to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::AMQPValue;

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
}
