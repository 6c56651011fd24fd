//! `outboxd check` for a Kafka sink: the brokers answer, they support the idempotent producer
//! the sink writes with, and the topics it writes exist — the dead topic and, when the topic
//! template is constant, the one topic it names (a template over the row names its topics only
//! per event: the topics already there under its constant prefix are listed). A missing topic is
//! a warning under `--declare auto` (the relay creates it) and a failure otherwise, with the
//! `kafka-topics.sh --create` command that makes it.

use super::config::KafkaConfig;
use super::declare::create_fix;
use crate::diagnostics::{line, CheckLine, Level};
use crate::sink::DeclareMode;
use rdkafka::client::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext};
use rdkafka::metadata::{Metadata, MetadataTopic};
use std::sync::Mutex;

/// What librdkafka logged of a broker's ApiVersions answer (its `APIVERSION` debug lines,
/// written when the answer is in, before any other request): whether the list came, and the
/// versions of InitProducerId (the request the idempotent producer starts with) in it.
#[derive(Default)]
struct ApiSupport(Mutex<(bool, Option<String>)>);

impl ClientContext for ApiSupport {
    fn log(&self, level: RDKafkaLogLevel, fac: &str, message: &str) {
        if fac != "APIVERSION" {
            return super::logs::log(level, fac, message);
        }
        let Ok(mut s) = self.0.lock() else { return };
        if message.contains("Broker API support") {
            s.0 = true;
        } else if let Some((_, v)) = message.split_once("ApiKey InitProducerId (22) Versions ") {
            s.1 = Some(v.trim().to_string());
        }
    }

    fn error(&self, e: rdkafka::error::KafkaError, reason: &str) {
        super::logs::error(&e, reason)
    }
}

impl ConsumerContext for ApiSupport {}

/// The metadata of every topic and the features the broker that answered supports.
/// Blocking.
fn metadata(cfg: &KafkaConfig) -> Result<(Metadata, (bool, Option<String>)), String> {
    let client = cfg.client().map_err(|e| e.to_string())?;
    let c: BaseConsumer<ApiSupport> = client
        .clone()
        .set("debug", "feature")
        .set("allow.auto.create.topics", "false")
        .set_log_level(RDKafkaLogLevel::Debug)
        .create_with_context(ApiSupport::default())
        .map_err(|e| format!("creating a Kafka client: {e}"))?;
    let meta = c.fetch_metadata(None, cfg.op_timeout).map_err(|e| {
        let brokers =
            super::config::endpoint(&cfg.url).map_or_else(|_| String::new(), |e| e.brokers);
        format!("no broker of {brokers} answered: {e}")
    })?;
    // librdkafka queues its log lines for the client's poll, one served per call: serve
    // those already queued (the API list came before the metadata answer), up to the
    // InitProducerId line or the end of the queue.
    let support = || c.context().0.lock().map(|s| s.clone()).unwrap_or_default();
    for _ in 0..5000 {
        let _ = c.poll(std::time::Duration::ZERO);
        if support().1.is_some() {
            break;
        }
    }
    let features = support();
    Ok((meta, features))
}

/// `outboxd check` for a Kafka sink (`cfg` validated).
pub(crate) async fn check(cfg: &KafkaConfig) -> Vec<CheckLine> {
    let c = cfg.clone();
    let (meta, features) = match tokio::task::spawn_blocking(move || metadata(&c)).await {
        Ok(Ok(m)) => m,
        Ok(Err(e)) => {
            return vec![line(
                Level::Fail,
                "kafka connect",
                e,
                Some("check the hosts and ports of --sink, TLS (kafkas://) and the SASL user, and that the brokers' advertised listeners are reachable from here".into()),
            )]
        }
        Err(e) => return vec![line(Level::Fail, "kafka connect", e.to_string(), None)],
    };
    let brokers: Vec<String> = meta
        .brokers()
        .iter()
        .map(|b| format!("{}:{} (id {})", b.host(), b.port(), b.id()))
        .collect();
    let mut out = vec![line(
        Level::Ok,
        "kafka connect",
        format!(
            "{} broker{}: {}",
            brokers.len(),
            if brokers.len() == 1 { "" } else { "s" },
            brokers.join(", ")
        ),
        None,
    )];
    out.push(match features {
        (_, Some(versions)) => line(
            Level::Ok,
            "kafka idempotent producer",
            format!("the broker answers InitProducerId (versions {versions}); the sink writes with enable.idempotence=true, acks=all"),
            None,
        ),
        (true, None) => line(
            Level::Fail,
            "kafka idempotent producer",
            "the broker does not support it: no InitProducerId among the requests it answers",
            Some("use a broker that supports the idempotent producer (Apache Kafka 0.11 or later)".into()),
        ),
        (false, None) => line(
            Level::Warn,
            "kafka idempotent producer",
            "the broker's supported requests were not reported: support unknown",
            None,
        ),
    });
    let dead = &cfg.options.dead_topic;
    out.push(topic_line(
        cfg,
        &meta,
        &format!("kafka dead topic {dead}"),
        dead,
    ));
    let template = &cfg.message.routing_key;
    if template.is_constant() {
        let topic = template.to_string();
        out.push(topic_line(
            cfg,
            &meta,
            &format!("kafka topic {topic}"),
            &topic,
        ));
    } else {
        out.push(templated_topics(cfg, &meta, &template.to_string()));
    }
    out
}

fn find<'a>(meta: &'a Metadata, topic: &str) -> Option<&'a MetadataTopic> {
    meta.topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
}

/// `N partitions, replication R`.
fn shape(t: &MetadataTopic) -> (usize, usize) {
    let replication = t
        .partitions()
        .iter()
        .map(|p| p.replicas().len())
        .min()
        .unwrap_or(0);
    (t.partitions().len(), replication)
}

/// One topic the sink writes: exists (its partitions and replication), or missing with the fix.
fn topic_line(cfg: &KafkaConfig, meta: &Metadata, check: &str, topic: &str) -> CheckLine {
    let Some(t) = find(meta, topic) else {
        return match cfg.declare {
            DeclareMode::Auto => line(
                Level::Warn,
                check,
                "does not exist",
                Some(format!(
                    "none needed: the relay creates it (--declare auto) with {} partition(s), replication {}",
                    cfg.options.partitions, cfg.options.replication,
                )),
            ),
            DeclareMode::Passive | DeclareMode::Off => line(
                Level::Fail,
                check,
                format!(
                    "does not exist, and --declare {} does not create it",
                    cfg.declare.as_str()
                ),
                Some(create_fix(cfg, topic)),
            ),
        };
    };
    let (partitions, replication) = shape(t);
    let detail = format!("{partitions} partition(s), replication {replication}");
    if replication < cfg.options.replication as usize {
        return line(
            Level::Warn,
            check,
            format!(
                "{detail}: less than --kafka-replication {}",
                cfg.options.replication
            ),
            Some(format!(
                "kafka-reassign-partitions.sh to raise {topic}'s replication factor to {}",
                cfg.options.replication
            )),
        );
    }
    line(Level::Ok, check, detail, None)
}

/// A template over the row: its topics are known only per event. Lists those already there
/// under the template's constant prefix.
fn templated_topics(cfg: &KafkaConfig, meta: &Metadata, template: &str) -> CheckLine {
    let prefix = template.split('{').next().unwrap_or("");
    let existing: Vec<String> = meta
        .topics()
        .iter()
        .filter(|t| !prefix.is_empty() && t.name().starts_with(prefix) && t.error().is_none())
        .map(|t| {
            let (p, r) = shape(t);
            format!("{} ({p} partition(s), replication {r})", t.name())
        })
        .collect();
    let found = if prefix.is_empty() {
        String::new()
    } else if existing.is_empty() {
        format!("; none under {prefix} exists yet")
    } else {
        format!("; under {prefix}: {}", existing.join(", "))
    };
    let detail = format!("the topic template {template} names a topic per event{found}");
    match cfg.declare {
        DeclareMode::Auto => line(Level::Ok, "kafka topics", format!("{detail}; --declare auto creates each the first time it is written"), None),
        DeclareMode::Passive | DeclareMode::Off => line(
            Level::Warn,
            "kafka topics",
            format!("{detail}; under --declare {} an event whose topic is missing holds the relay back until it is created", cfg.declare.as_str()),
            Some(format!(
                "create each topic the template names before its first event: {}",
                create_fix(cfg, "<topic>")
            )),
        ),
    }
}
