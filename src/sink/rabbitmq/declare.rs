//! The topology: declaring (`--declare auto`) or checking (`passive`) the exchanges and
//! queues outboxd relies on, including exchanges a row names and the partition layouts. It is
//! its own file because most of it is about failure: a refused declaration must say what
//! differs from what outboxd expects and how to fix it, since retrying never helps, and the
//! same mapping of broker errors to config or connection errors serves publishing too.

use super::config::{config_err, validate_exchange};
use super::RabbitSink;
use crate::event::OutboxEvent;
use crate::sink::partition::{PartitionRouting, QueueType};
use crate::sink::topology::{self, Layout};
use crate::sink::DeclareMode;
use crate::sink::SinkError;
use futures::future::BoxFuture;
use futures::FutureExt;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind};

impl RabbitSink {
    /// The relay's own partition layout (`--partitions N`), if any.
    pub(super) fn own_layout(&self) -> Option<Layout> {
        Layout::relay(&self.cfg.exchange, &self.cfg.partitioning)
    }

    /// Declares (or checks, `--declare passive`) the base topology and then each layout, on
    /// `conn`. Returns warnings about partition counts that changed since the last declaration.
    pub(super) async fn declare_all(
        &self,
        conn: &Connection,
        layouts: &[Layout],
    ) -> Result<Vec<String>, SinkError> {
        // A failed declaration closes its channel: use one only for that.
        let ch = conn.create_channel().await.map_err(io_or_protocol)?;
        self.declare(&ch).await?;
        let _ = ch.close(200, "OK".into()).await;
        let passive = self.cfg.declare == DeclareMode::Passive;
        let mut warnings = Vec::new();
        if !passive && !layouts.is_empty() {
            // A probe that finds nothing closes its channel with NOT_FOUND, which lapin reports
            // as an error event of the whole connection (the relay would take the publishing
            // connection for broken): probe on a connection of its own.
            let probing = self.connection().await?;
            let mut result = Ok(());
            for l in layouts {
                match topology::probe(&probing, l).await {
                    Ok(probe) => {
                        if let Some(w) = probe.changed_count(l) {
                            tracing::warn!(layout = %l.exchange(), "{w}");
                            warnings.push(w);
                        }
                    }
                    Err(e) => {
                        result = Err(io_or_protocol(e));
                        break;
                    }
                }
            }
            let _ = probing.close(200, "OK".into()).await;
            result?;
        }
        for l in layouts {
            topology::declare_layout(conn, l, passive)
                .await
                .map_err(|f| self.layout_error(f, l))?;
        }
        Ok(warnings)
    }

    /// `outboxd topology`: one connection that declares the base topology and `layouts`.
    pub async fn declare_layouts(&self, layouts: &[Layout]) -> Result<Vec<String>, SinkError> {
        let work = async {
            let conn = self.connection().await?;
            let r = self.declare_all(&conn, layouts).await;
            let _ = conn.close(200, "OK".into()).await;
            r
        };
        match tokio::time::timeout(self.cfg.op_timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(SinkError::Connection(format!(
                "declaring at RabbitMQ {} took longer than {:?}",
                self.endpoint.redacted, self.cfg.op_timeout
            ))),
        }
    }

    async fn declare(&self, ch: &Channel) -> Result<(), SinkError> {
        self.declare_exchange(
            ch,
            &self.cfg.exchange,
            true,
            self.cfg.declare == DeclareMode::Passive,
        )
        .await
    }

    /// Declares (or, `passive`, checks) exchange `x` with its alternate exchange and queue
    /// `<x>.unrouted`, and with `with_dead` the queue `<x>.dead`.
    async fn declare_exchange(
        &self,
        ch: &Channel,
        x: &str,
        with_dead: bool,
        passive: bool,
    ) -> Result<(), SinkError> {
        let x = &x.to_string();
        let unrouted = format!("{x}.unrouted");
        let dead = format!("{x}.dead");
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
        let mut xargs = FieldTable::default();
        xargs.insert(
            "alternate-exchange".into(),
            AMQPValue::LongString(unrouted.clone().into()),
        );
        // Classic queues are declared without `x-queue-type`, as before the flag existed (a
        // broker whose default queue type is quorum then makes them quorum). A passive
        // declaration checks only that the queue exists, so pre-declared queues of either
        // type are accepted.
        let mut qargs = FieldTable::default();
        if self.cfg.dead_queue_type == QueueType::Quorum {
            qargs.insert(
                "x-queue-type".into(),
                AMQPValue::LongString(QueueType::Quorum.as_str().into()),
            );
        }
        let what = |kind: &'static str, name: &str| (kind, name.to_string());
        // The alternate exchange first, so the main exchange never exists without it.
        let mut steps: Vec<DeclareStep<'_>> = vec![
            (
                what("exchange", &unrouted),
                ch.exchange_declare(
                    unrouted.clone().into(),
                    ExchangeKind::Fanout,
                    xopts,
                    FieldTable::default(),
                )
                .boxed(),
            ),
            (
                what("queue", &unrouted),
                ch.queue_declare(unrouted.clone().into(), qopts, qargs.clone())
                    .map(|r| r.map(|_| ()))
                    .boxed(),
            ),
            (
                what("exchange", x),
                ch.exchange_declare(x.clone().into(), ExchangeKind::Topic, xopts, xargs)
                    .boxed(),
            ),
        ];
        if with_dead {
            steps.push((
                what("queue", &dead),
                ch.queue_declare(dead.clone().into(), qopts, qargs)
                    .map(|r| r.map(|_| ()))
                    .boxed(),
            ));
        }
        for ((kind, name), step) in steps {
            step.await.map_err(|e| {
                self.declare_error(
                    e,
                    kind,
                    &name,
                    &expected_topology(x, self.cfg.dead_queue_type),
                )
            })?;
            if kind == "queue" && name == unrouted && !passive {
                ch.queue_bind(
                    unrouted.clone().into(),
                    unrouted.clone().into(),
                    "".into(),
                    QueueBindOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|e| {
                    self.declare_error(
                        e,
                        "binding of queue",
                        &name,
                        &expected_topology(x, self.cfg.dead_queue_type),
                    )
                })?;
            }
        }
        Ok(())
    }

    /// A failed step of a partition layout's declaration, with the layout as the expectation.
    fn layout_error(&self, f: topology::StepFailure, l: &Layout) -> SinkError {
        if l.routing == PartitionRouting::ConsistentHash {
            if let lapin::ErrorKind::ProtocolError(p) = f.error.kind() {
                if topology::is_unknown_exchange_type(&p.get_message().to_string()) {
                    return topology::missing_plugin();
                }
            }
        }
        let declare = match (l.group, l.routing) {
            (true, _) => format!(
                "outboxd topology --exchange {} --group {} --partitions {}",
                l.source, l.prefix, l.partitions
            ),
            (false, PartitionRouting::Headers) => format!(
                "outboxd topology --exchange {} --partitions {}",
                l.source, l.partitions
            ),
            (false, PartitionRouting::ConsistentHash) => format!(
                "outboxd topology --exchange {} --partitions {} --partition-routing consistent-hash",
                l.source, l.partitions
            ),
        };
        let expected = format!(
            "outboxd expects: {} (`{declare} --queue-type {}` declares it)",
            l.describe(),
            l.queue_type.as_str()
        );
        self.declare_error(f.error, f.kind, &f.name, &expected)
    }

    /// Turns a failed declaration into what differs and how to fix it.
    fn declare_error(&self, e: lapin::Error, kind: &str, name: &str, expected: &str) -> SinkError {
        let vhost = self.endpoint.uri.vhost.clone();
        let user = self.endpoint.uri.authority.userinfo.username.clone();
        let x = &self.cfg.exchange;
        let lapin::ErrorKind::ProtocolError(p) = e.kind() else {
            return io_or_protocol(e);
        };
        let text = p.get_message().to_string();
        let delete = if kind == "exchange" {
            format!("rabbitmqadmin -V {vhost:?} delete exchange name={name} (then re-bind your queues to it)")
        } else {
            format!("rabbitmqadmin -V {vhost:?} delete queue name={name} (its messages are lost: move them first)")
        };
        match p.kind() {
            AMQPErrorKind::Soft(AMQPSoftError::PRECONDITIONFAILED) => config_err(
                format!(
                    "RabbitMQ refused to declare {kind} {name:?} in vhost {vhost:?}: it exists with other settings than outboxd declares ({}). {}",
                    describe_mismatch(&text),
                    expected
                ),
                format!("delete it and let outboxd declare it: {delete}; or keep yours and run with --declare passive (then it must still route every topic somewhere: give {x} the alternate-exchange {x}.unrouted)"),
            ),
            AMQPErrorKind::Soft(AMQPSoftError::NOTFOUND) => config_err(
                format!("{kind} {name:?} does not exist in vhost {vhost:?} (--declare passive only checks). {expected}"),
                "declare it as described, or run with --declare auto (needs configure permission)".to_string(),
            ),
            AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED) => config_err(
                format!("user {user:?} may not declare {kind} {name:?} in vhost {vhost:?}: {text}"),
                format!("grant configure permission (rabbitmqctl set_permissions -p {vhost:?} {user:?} '^{x}(\\..*)?$' '^{x}(\\..*)?$' '^$'), or have an administrator declare the topology and run with --declare passive"),
            ),
            _ => io_or_protocol(e),
        }
    }

    /// The exchange and routing key of an event, or why it cannot have them (the event then
    /// goes to `<exchange>.dead`). An exchange a row names is declared (`--declare auto`) or
    /// checked (`passive`, `off`: publishing to a missing exchange would close the channel
    /// and loop through reconnects) once, on a connection of its own; a refusal is the row's
    /// dead reason, a connection failure the sink's error (the relay retries).
    pub(super) async fn route(
        &mut self,
        event: &OutboxEvent,
    ) -> Result<Result<(String, String), String>, SinkError> {
        let rk = match self.cfg.message.routing_key(event) {
            Ok(rk) => rk,
            Err(why) => return Ok(Err(why)),
        };
        let Some(t) = &self.cfg.message.exchange else {
            return Ok(Ok((self.cfg.exchange.clone(), rk)));
        };
        let x = match t.render(|n| crate::sink::format::lookup(event, n)) {
            Ok(x) => x,
            Err(why) => return Ok(Err(why)),
        };
        if x == self.cfg.exchange || self.known_exchanges.contains(&x) {
            return Ok(Ok((x, rk)));
        }
        if let Err(e) = validate_exchange(&x) {
            return Ok(Err(format!("the row names exchange {x:?}: {e}")));
        }
        let passive = self.cfg.declare != DeclareMode::Auto;
        let work = async {
            let conn = self.connection().await?;
            let r = async {
                let ch = conn.create_channel().await.map_err(io_or_protocol)?;
                self.declare_exchange(&ch, &x, false, passive).await
            }
            .await;
            let _ = conn.close(200, "OK".into()).await;
            r
        };
        let result = match tokio::time::timeout(self.cfg.op_timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(SinkError::Connection(format!(
                "declaring exchange {x:?} at RabbitMQ {} took longer than {:?}",
                self.endpoint.redacted, self.cfg.op_timeout
            ))),
        };
        match result {
            Ok(()) => {
                tracing::info!(exchange = %x, declare = ?self.cfg.declare, "exchange named by a row is ready");
                self.known_exchanges.insert(x.clone());
                Ok(Ok((x, rk)))
            }
            Err(SinkError::Config { problem, .. }) => Ok(Err(format!(
                "the row names exchange {x:?}, which cannot be used: {problem}"
            ))),
            Err(e) => Err(e),
        }
    }
}

/// One declaration: what it declares (kind, name) and the call.
type DeclareStep<'a> = ((&'static str, String), BoxFuture<'a, lapin::Result<()>>);

/// A failed publish or confirmation. Permission problems cannot heal by reconnecting.
pub(super) fn channel_error(e: lapin::Error) -> SinkError {
    if let lapin::ErrorKind::ProtocolError(p) = e.kind() {
        if matches!(p.kind(), AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)) {
            return config_err(
                format!("RabbitMQ refused a publish: {}", p.get_message()),
                "grant the user write permission on the exchange and on the default exchange (for <exchange>.dead): rabbitmqctl set_permissions",
            );
        }
    }
    SinkError::Connection(format!("RabbitMQ channel: {e}"))
}

pub(super) fn io_or_protocol(e: lapin::Error) -> SinkError {
    channel_error(e)
}

/// `inequivalent arg 'alternate-exchange' for exchange 'outbox' in vhost '/': received …
/// but current is …` → the part that says what differs.
pub(super) fn describe_mismatch(text: &str) -> String {
    let t = text.trim_start_matches("PRECONDITION_FAILED - ");
    match (t.find("inequivalent arg '"), t.find(": received")) {
        (Some(a), Some(r)) if r > a => {
            let arg_start = a + "inequivalent arg '".len();
            let arg = t[arg_start..].split('\'').next().unwrap_or("?");
            format!("argument {arg:?} differs:{}", &t[r + 1..])
        }
        _ => t.to_string(),
    }
}

fn expected_topology(x: &str, queue_type: QueueType) -> String {
    let qt = queue_type.as_str();
    format!("outboxd expects: durable topic exchange {x} with argument alternate-exchange={x}.unrouted; durable fanout exchange {x}.unrouted bound to durable {qt} queue {x}.unrouted; durable {qt} queue {x}.dead")
}
