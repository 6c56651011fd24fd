//! Partition layouts on RabbitMQ: what `run --partitions` and `outboxd topology` declare and
//! how `outboxd check` probes them (docs/partitions.md); the commands themselves are in
//! `commands::topology`.
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

use super::partition::{self, PartitionRouting, QueueType};
use super::SinkError;
use crate::Error;
use lapin::options::{
    ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ExchangeKind};

/// The consistent-hash exchange type (plugin `rabbitmq_consistent_hash_exchange`).
pub const CONSISTENT_HASH: &str = "x-consistent-hash";
pub(crate) const CONSISTENT_HASH_PLUGIN: &str = "rabbitmq_consistent_hash_exchange";
/// The `x-match` mode that matches `x-…` headers too (RabbitMQ ≥ 3.10).
pub(crate) const MATCH_ALL_WITH_X: &str = "all-with-x";

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
    pub(crate) fn changed_count(&self, l: &Layout) -> Option<String> {
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
pub fn validate_pattern(p: &str) -> Result<(), Error> {
    if p.is_empty() || p.len() > 255 {
        return Err(Error::config(
            format!("--bind {p:?} is not a topic pattern"),
            "use a pattern of dot-separated words with * and #, e.g. --bind 'invoice.#'",
        ));
    }
    Ok(())
}

/// One line of `outboxd check`.
pub(crate) fn check_line(
    level: crate::diagnostics::Level,
    check: &str,
    detail: impl Into<String>,
    fix: Option<String>,
) -> crate::diagnostics::CheckLine {
    crate::diagnostics::CheckLine {
        level,
        check: check.into(),
        detail: detail.into(),
        fix,
    }
}

/// Declares and deletes a scratch exchange of type `x-consistent-hash`: the only way AMQP
/// tells whether the plugin is enabled.
pub(crate) async fn consistent_hash_plugin(conn: &Connection) -> crate::diagnostics::CheckLine {
    use crate::diagnostics::Level;
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

    #[test]
    fn probe_reports_a_changed_count() {
        let p = partition::PartitionSpec {
            partitions: 4,
            ..Default::default()
        }
        .validate()
        .unwrap();
        let l = Layout::relay("orders", &p).unwrap();
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
