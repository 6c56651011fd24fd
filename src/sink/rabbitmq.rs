//! The RabbitMQ sink (docs/message-format.md): every event becomes one persistent, `mandatory` message on
//! the topic exchange `<exchange>` with the topic as routing key, and counts as durable only
//! when the broker acknowledged it without returning it first. Events that cannot be messages
//! (poison) become body-less records on the queue `<exchange>.dead`. Recovery is not done here:
//! on any failure the relay calls [`Sink::connect`] again, which builds a fresh connection and
//! channel, and republishes what was unconfirmed, so lapin's own auto-recovery stays off.
//!
//! Topology (declared with `--declare auto`, checked with `passive`, left alone with `off`):
//!
//! - `<exchange>`: durable topic exchange, argument `alternate-exchange = <exchange>.unrouted`;
//! - `<exchange>.unrouted`: durable fanout exchange, bound to the durable queue of the same
//!   name, so an event no queue wants is kept rather than dropped or returned;
//! - `<exchange>.dead`: durable queue for poison records, published to through the default
//!   exchange (routing key = queue name). The default exchange needs no declaration or
//!   binding and cannot be misrouted, so a dead record reaches that queue or is returned.
//!
//! With `--partitions N` (or `--group-partitions`) every message also carries its partition
//! headers, and the relay's own partition layout is declared after the above (see
//! [`super::topology`] and [`super::partition`]).
//!
//! Confirms are pipelined (the relay bounds the window). lapin attaches a `basic.return` to
//! whichever confirmation it completes next, which under multiple-acks may be another message
//! than the one returned, so returns are matched to events by `message_id` (= event id) in a
//! per-channel tracker that settles every confirmation only after recording all returns that
//! arrived with or before it.

use super::format::{Body, MessageOptions};
use super::headers::{self, HeaderValue};
use super::partition::{PartitionRouting, Partitioning, QueueType};
use super::topology::{self, Layout};
use super::{Delivery, FlowControl, Sink, SinkError};
use crate::dsn::redact;
use crate::event::OutboxEvent;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use lapin::options::{
    BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::tcp::{AMQPUriTcpExt, OwnedTLSConfig, RustlsConnector, TLSConfig};
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{
    BasicProperties, Channel, Confirmation, Connection, ConnectionProperties, ExchangeKind,
};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;
use tokio::sync::{oneshot, watch};
use uuid::Uuid;

/// Default `--max-message-bytes`: 16 MiB.
pub const DEFAULT_MAX_MESSAGE_BYTES: usize = 16 * 1024 * 1024;
/// Encoded message headers above this are a poison event (and never more than fits in one
/// AMQP frame: RabbitMQ sends the properties in a single content-header frame).
pub const MAX_HEADER_BYTES: usize = 128 * 1024;
/// Room left in a frame for the other properties (message id, type, …) and framing.
const FRAME_RESERVE: usize = 4096;
/// Header values of dead-letter records are cut here, so a record always fits in a frame.
const DEAD_VALUE_MAX: usize = 1024;
const APP_ID: &str = "outboxd";

/// How the sink treats the topology (`--declare`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeclareMode {
    /// Declare exchanges, queues and the binding (idempotent; needs configure permission).
    #[default]
    Auto,
    /// Only check that they exist (for users without configure permission).
    Passive,
    /// Assume they exist; check nothing.
    Off,
}

/// Everything the sink needs, already validated by the command line.
#[derive(Clone)]
pub struct RabbitConfig {
    /// `amqp://` or `amqps://` URL, password included: never log it unredacted.
    pub url: String,
    pub exchange: String,
    pub declare: DeclareMode,
    pub max_message_bytes: usize,
    /// Bounds connecting, declaring and each socket write (the relay bounds each
    /// confirmation with the same value): a broker that is away can make lapin wait silently.
    pub op_timeout: Duration,
    /// PEM CA certificate(s) trusted for `amqps://` (in addition to the public roots).
    pub ca_file: Option<PathBuf>,
    /// PEM client certificate and key for `amqps://` with client authentication.
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
    /// Shown in the broker's connection list.
    pub connection_name: String,
    /// `--partitions`, `--group-partitions`, `--queue-type`, `--partition-routing`.
    pub partitioning: Partitioning,
    /// `--dead-queue-type`: the type of the `<exchange>.unrouted` and `<exchange>.dead` queues.
    pub dead_queue_type: QueueType,
    /// `--routing-key`, a templated `--exchange`, `--header`, `--format`.
    pub message: MessageOptions,
}

impl std::fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &redact(&self.url))
            .field("exchange", &self.exchange)
            .field("declare", &self.declare)
            .field("max_message_bytes", &self.max_message_bytes)
            .field("op_timeout", &self.op_timeout)
            .field("ca_file", &self.ca_file)
            .field("cert_file", &self.cert_file)
            .field("dead_queue_type", &self.dead_queue_type)
            .field("key_file", &self.key_file)
            .field("partitioning", &self.partitioning)
            .field("message", &self.message)
            .finish()
    }
}

/// Checks an exchange name: AMQP allows letters, digits, `-_.:` and at most 255 bytes, and
/// the derived names (`.unrouted` is the longest suffix) must fit too.
pub fn validate_exchange(name: &str) -> Result<(), crate::Error> {
    let ok_chars = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | ':'));
    if name.is_empty()
        || !ok_chars
        || name.len() + ".unrouted".len() > 255
        || name.starts_with("amq.")
    {
        return Err(crate::Error::config(
            format!("--exchange {name:?} is not a usable exchange name"),
            "use 1 to 246 characters of [A-Za-z0-9-_.:], not starting with amq., e.g. --exchange outbox",
        ));
    }
    Ok(())
}

fn config_err(problem: impl Into<String>, fix: impl Into<String>) -> SinkError {
    SinkError::Config {
        problem: problem.into(),
        fix: fix.into(),
    }
}

/// The sink. Create with [`RabbitSink::new`]; the relay calls `connect` before publishing.
pub struct RabbitSink {
    cfg: RabbitConfig,
    uri: AMQPUri,
    /// The TLS client configuration of an `amqps://` sink; `None` for `amqp://`.
    tls: Option<Arc<rustls::ClientConfig>>,
    redacted: String,
    link: Option<Link>,
    flow: Arc<FlowControl>,
    /// Exchanges named by rows (a templated `--exchange`) found or declared so far: each is
    /// declared (or checked) once, on a connection of its own.
    known_exchanges: HashSet<String>,
}

/// Broker-side state of one connection, updated from lapin's connection events.
#[derive(Debug, Clone, Default)]
struct LinkState {
    blocked: bool,
    error: Option<String>,
}

/// One connection and its publishing channel, with the tasks that serve it. Dropping it
/// closes the connection and abandons its unsettled confirmations (the relay republishes).
struct Link {
    conn: Connection,
    channel: Channel,
    state: watch::Receiver<LinkState>,
    tracker: Arc<Mutex<Tracker>>,
    header_limit: usize,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Link {
    fn drop(&mut self) {
        // lapin closes the connection when its last handle (ours and the channels held by
        // unsettled publishes) is dropped; aborting the tasks releases those.
        for t in &self.tasks {
            t.abort();
        }
    }
}

impl RabbitSink {
    /// Parses the URL and loads the TLS files; connects only in [`Sink::connect`].
    pub fn new(cfg: RabbitConfig) -> Result<RabbitSink, crate::Error> {
        let redacted = redact(&cfg.url);
        let url = url::Url::parse(&cfg.url).map_err(|e| {
            crate::Error::config(
                format!("cannot parse the sink {redacted}: {e}"),
                "use amqp://user@host:5672/vhost (amqps:// for TLS)",
            )
        })?;
        let mut uri: AMQPUri = cfg.url.parse().map_err(|e: String| {
            crate::Error::config(
                format!(
                    "cannot parse the sink {redacted}: {}",
                    e.replace(&cfg.url, &redacted)
                ),
                "use amqp://user@host:5672/vhost (amqps:// for TLS)",
            )
        })?;
        // lapin takes the host from `Url::domain`, which is empty for IP addresses (it then
        // falls back to "localhost", possibly ::1): use the host as written.
        if let Some(host) = url.host_str() {
            uri.authority.host = host.trim_start_matches('[').trim_end_matches(']').into();
        }
        // `amqp://host/` means the vhost "" by the URI spec, which no broker has; everyone
        // who writes it means the default vhost.
        if uri.vhost.is_empty() {
            uri.vhost = "/".into();
        }
        // TLS files: the flags win over the URL's query parameters (RabbitMQ's URI names).
        let mut cfg = cfg;
        for (k, v) in url.query_pairs() {
            let slot = match k.as_ref() {
                "cacertfile" => &mut cfg.ca_file,
                "certfile" => &mut cfg.cert_file,
                "keyfile" => &mut cfg.key_file,
                _ => continue,
            };
            if slot.is_none() {
                *slot = Some(PathBuf::from(v.as_ref()));
            }
        }
        let tls = tls_config(&cfg, uri.scheme == AMQPScheme::AMQPS)?;
        if cfg.partitioning.partitions > 0 {
            topology::validate_name("--exchange", &cfg.exchange)?;
        }
        Ok(RabbitSink {
            cfg,
            uri,
            tls,
            redacted,
            link: None,
            flow: Arc::default(),
            known_exchanges: HashSet::new(),
        })
    }

    pub(crate) async fn connection(&self) -> Result<Connection, SinkError> {
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| SinkError::Connection(format!("no runtime for lapin: {e}")))?;
        let props = ConnectionProperties::default()
            .with_connection_name(self.cfg.connection_name.clone().into());
        let Some(tls) = &self.tls else {
            return Connection::connect_uri_with_config(
                self.uri.clone(),
                props,
                OwnedTLSConfig::default(),
                runtime,
            )
            .await
            .map_err(|e| self.classify_connect(e));
        };
        // amqps://: the TCP connection as lapin makes it, then the handshake with our own
        // rustls configuration (lapin's would add the public roots to --sink-ca).
        let connector = RustlsConnector::from(tls.clone());
        Connection::connector(
            self.uri.clone(),
            runtime,
            async move |uri: AMQPUri, runtime| {
                let mut plain = uri.clone();
                plain.scheme = AMQPScheme::AMQP;
                let stream = plain
                    .connect_with_config_async(TLSConfig::default(), &runtime)
                    .await?;
                Ok(stream.into_rustls(&connector, &uri.authority.host).await?)
            },
            props,
        )
        .await
        .map_err(|e| self.classify_connect(e))
    }

    /// The relay's own partition layout (`--partitions N`), if any.
    fn own_layout(&self) -> Option<Layout> {
        Layout::relay(&self.cfg.exchange, &self.cfg.partitioning)
    }

    /// Declares (or checks, `--declare passive`) the base topology and then each layout, on
    /// `conn`. Returns warnings about partition counts that changed since the last declaration.
    async fn declare_all(
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
                self.redacted, self.cfg.op_timeout
            ))),
        }
    }

    async fn open(&self) -> Result<Link, SinkError> {
        let conn = self.connection().await?;

        let (state_tx, state_rx) = watch::channel(LinkState::default());
        let mut tasks = vec![tokio::spawn(watch_events(
            conn.events_listener(),
            state_tx,
            self.flow.clone(),
        ))];

        if self.cfg.declare != DeclareMode::Off {
            self.declare_all(&conn, self.own_layout().as_slice())
                .await?;
        }
        let channel = conn.create_channel().await.map_err(io_or_protocol)?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(io_or_protocol)?;

        let frame_max = conn.configuration().frame_max() as usize;
        let header_limit = if frame_max == 0 {
            MAX_HEADER_BYTES
        } else {
            MAX_HEADER_BYTES.min(frame_max.saturating_sub(FRAME_RESERVE))
        };
        let tracker = Arc::new(Mutex::new(Tracker::default()));
        tasks.push(tokio::spawn(drive_confirms(tracker.clone())));
        Ok(Link {
            conn,
            channel,
            state: state_rx,
            tracker,
            header_limit,
            tasks,
        })
    }

    fn classify_connect(&self, e: lapin::Error) -> SinkError {
        let user = self.uri.authority.userinfo.username.clone();
        let vhost = self.uri.vhost.clone();
        if let lapin::ErrorKind::ProtocolError(p) = e.kind() {
            match p.kind() {
                AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED) => {
                    return config_err(
                        format!("RabbitMQ refused the login of user {user:?} to vhost {vhost:?} at {}: {}", self.redacted, p.get_message()),
                        format!("check the user, password and vhost of --sink, and that the user may access the vhost: rabbitmqctl set_permissions -p {vhost:?} {user:?} '.*' '.*' '.*' (or narrower)"),
                    );
                }
                _ => {}
            }
        }
        if let lapin::ErrorKind::IOError(io) = e.kind() {
            // rustls reports certificate and handshake problems as InvalidData: retrying
            // cannot fix a certificate.
            if io.kind() == std::io::ErrorKind::InvalidData
                || crate::tls::rustls_cause(io.as_ref()).is_some()
            {
                return config_err(
                    format!("TLS with RabbitMQ at {} failed: {io}", self.redacted),
                    "check --sink-ca (the CA that signed the broker's certificate), --sink-cert/--sink-key, and that the host name in --sink matches the certificate",
                );
            }
        }
        SinkError::Connection(format!(
            "cannot connect to RabbitMQ at {}: {e}",
            self.redacted
        ))
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
        let vhost = self.uri.vhost.clone();
        let user = self.uri.authority.userinfo.username.clone();
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

    /// Headers of a normal message, or the reason it is poison.
    fn headers(
        &self,
        event: &OutboxEvent,
        body: &Body,
        limit: usize,
    ) -> Result<FieldTable, String> {
        let mut t = FieldTable::default();
        // The row's headers never include a reserved name (see `sink::headers`): a row can
        // neither forge the relay's headers nor route its message elsewhere with `CC`/`BCC`.
        for (k, v) in headers::row_headers(event) {
            let key = ShortString::try_new(k.as_str()).map_err(|_| {
                format!("header name of {} bytes: AMQP allows at most 255", k.len())
            })?;
            t.insert(key, json_to_amqp(v)?);
        }
        // `--header COLUMN=NAME` (names checked at start: none is reserved) wins over the
        // row's headers object.
        for (k, v) in self.cfg.message.column_headers(event) {
            t.insert(k.into(), AMQPValue::LongString(v.into()));
        }
        for (k, v) in body.headers.iter().cloned() {
            t.insert(k.into(), amqp_value(v));
        }
        for (k, v) in standard_headers(event) {
            t.insert(k.into(), v);
        }
        for (k, v) in self.cfg.partitioning.headers(&event.aggregate_id) {
            t.insert(k, v);
        }
        let size = table_size(&t);
        if size > limit {
            return Err(format!(
                "headers encode to {size} bytes, more than the {limit} allowed"
            ));
        }
        Ok(t)
    }

    /// What the event is sent as: a normal message, or a dead-letter record with a reason.
    fn render(
        &self,
        event: &OutboxEvent,
        header_limit: usize,
        route: Result<(String, String), String>,
    ) -> Outgoing {
        let reason = if let Some(p) = &event.poison {
            Some(p.clone())
        } else if event.payload.len() > self.cfg.max_message_bytes {
            Some(format!(
                "payload is {} bytes, more than --max-message-bytes {}",
                event.payload.len(),
                self.cfg.max_message_bytes
            ))
        } else if event.topic.len() > 255 {
            Some(format!(
                "topic is {} bytes: a message type holds at most 255",
                event.topic.len()
            ))
        } else {
            route.as_ref().err().cloned()
        };
        let message = match reason {
            Some(r) => Err(r),
            None => self.cfg.message.body(event).and_then(|body| {
                if body.bytes.len() > self.cfg.max_message_bytes {
                    return Err(format!(
                        "the {:?} body is {} bytes, more than --max-message-bytes {}",
                        self.cfg.message.format,
                        body.bytes.len(),
                        self.cfg.max_message_bytes
                    ));
                }
                let h = self.headers(event, &body, header_limit)?;
                Ok((body, h))
            }),
        };
        let props = BasicProperties::default()
            .with_delivery_mode(2)
            .with_message_id(event.id.hyphenated().to_string().into())
            .with_timestamp(event.created_at.timestamp().max(0) as u64)
            .with_app_id(APP_ID.into());
        match (message, route) {
            (Ok((body, h)), Ok((exchange, routing_key))) => Outgoing {
                exchange,
                routing_key,
                body: body.bytes,
                props: props
                    .with_content_type(body.content_type.into())
                    .with_type(event.topic.clone().into())
                    .with_headers(h),
                dead: None,
            },
            (Ok(_), Err(reason)) | (Err(reason), _) => {
                let mut h = FieldTable::default();
                for (k, v) in [
                    ("x-dead-reason", truncate(&reason)),
                    ("x-source-position", event.position.to_string()),
                    ("x-original-topic", truncate(&event.topic)),
                    ("x-aggregate-id", truncate(&event.aggregate_id)),
                    ("x-outbox-created-at", event.created_at_rfc3339()),
                ] {
                    h.insert(k.into(), AMQPValue::LongString(v.into()));
                }
                h.insert(
                    "x-original-size".into(),
                    AMQPValue::LongLongInt(event.payload.len() as i64),
                );
                Outgoing {
                    exchange: String::new(),
                    routing_key: format!("{}.dead", self.cfg.exchange),
                    body: Bytes::new(),
                    props: props.with_headers(h),
                    dead: Some(reason),
                }
            }
        }
    }

    /// The exchange and routing key of an event, or why it cannot have them (the event then
    /// goes to `<exchange>.dead`). An exchange a row names is declared (`--declare auto`) or
    /// checked (`passive`, `off`: publishing to a missing exchange would close the channel
    /// and loop through reconnects) once, on a connection of its own; a refusal is the row's
    /// dead reason, a connection failure the sink's error (the relay retries).
    async fn route(
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
        let x = match t.render(|n| super::format::lookup(event, n)) {
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
                self.redacted, self.cfg.op_timeout
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

    /// Waits while the broker blocks the connection; fails when the connection is gone.
    async fn wait_until_writable(&mut self) -> Result<(), SinkError> {
        let Some(link) = self.link.as_mut() else {
            return Err(SinkError::Connection("not connected".into()));
        };
        let mut logged = false;
        loop {
            {
                let s = link.state.borrow_and_update();
                if let Some(e) = &s.error {
                    return Err(SinkError::Connection(format!("RabbitMQ connection: {e}")));
                }
                if !s.blocked {
                    break;
                }
            }
            if !logged {
                tracing::info!("publishing waits until RabbitMQ unblocks the connection");
                logged = true;
            }
            if link.state.changed().await.is_err() {
                return Err(SinkError::Connection(
                    "RabbitMQ connection event stream ended".into(),
                ));
            }
        }
        if !link.conn.status().connected() {
            return Err(SinkError::Connection(format!(
                "RabbitMQ connection is not open ({:?})",
                link.conn.status()
            )));
        }
        Ok(())
    }
}

/// One declaration: what it declares (kind, name) and the call.
type DeclareStep<'a> = ((&'static str, String), BoxFuture<'a, lapin::Result<()>>);

/// One message ready to go out.
struct Outgoing {
    exchange: String,
    routing_key: String,
    body: Bytes,
    props: BasicProperties,
    /// The dead-letter reason when this is a poison record.
    dead: Option<String>,
}

impl Sink for RabbitSink {
    fn name(&self) -> &'static str {
        "rabbitmq"
    }

    fn stores_position(&self) -> bool {
        true
    }

    fn flow_control(&self) -> Option<Arc<FlowControl>> {
        Some(self.flow.clone())
    }

    fn is_broken(&self) -> bool {
        self.link
            .as_ref()
            .is_none_or(|l| l.state.borrow().error.is_some())
    }

    async fn connect(&mut self) -> Result<(), SinkError> {
        // Always a fresh connection: the old one (if any) is closed by dropping it, and its
        // unsettled confirmations with it.
        self.link = None;
        self.flow.unblock();
        let link = match tokio::time::timeout(self.cfg.op_timeout, self.open()).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(SinkError::Connection(format!(
                    "connecting to RabbitMQ at {} took longer than {:?}",
                    self.redacted, self.cfg.op_timeout
                )))
            }
        };
        tracing::info!(
            sink = %self.redacted,
            exchange = %self.cfg.exchange,
            declare = ?self.cfg.declare,
            partitions = self.cfg.partitioning.partitions,
            frame_max = link.conn.configuration().frame_max(),
            "connected to RabbitMQ"
        );
        self.link = Some(link);
        Ok(())
    }

    async fn publish(&mut self, event: &OutboxEvent) -> Result<Delivery, SinkError> {
        self.wait_until_writable().await?;
        let route = if event.poison.is_some() {
            Err(String::new())
        } else {
            self.route(event).await?
        };
        let link = self.link.as_ref().expect("checked by wait_until_writable");
        let out = self.render(event, link.header_limit, route);
        if let Some(reason) = &out.dead {
            tracing::warn!(
                id = %event.id,
                position = %event.position,
                reason = %reason,
                queue = %out.routing_key,
                "poison event: publishing a dead-letter record without the body"
            );
        }
        let (done_tx, done_rx) = oneshot::channel();
        let id = event.id;
        let channel = link.channel.clone();
        let Outgoing {
            exchange,
            routing_key,
            body,
            props,
            ..
        } = out;
        let mut fut: BoxFuture<'static, Outcome> = async move {
            let result = match channel
                .basic_publish(
                    exchange.into(),
                    routing_key.into(),
                    BasicPublishOptions {
                        mandatory: true,
                        immediate: false,
                    },
                    &body,
                    props,
                )
                .await
            {
                Ok(confirm) => confirm.await,
                Err(e) => Err(e),
            };
            Outcome {
                id,
                result,
                done: done_tx,
            }
        }
        .boxed();

        // Start the publish here, under the tracker's lock: the first poll hands the frames to
        // lapin (so they go out in the relay's order) and registers the delivery tag, and the
        // confirmation is tracked before anything can settle it. The socket write and the
        // confirmation then complete in the tracker's task, so publishing is pipelined.
        {
            let t = lock(&link.tracker);
            let mut cx = Context::from_waker(futures::task::noop_waker_ref());
            // On a busy machine the whole round trip can finish inside this first poll; the
            // outcome is then settled by the tracker like any other, after the returns that
            // came before it.
            if let Poll::Ready(outcome) = fut.poll_unpin(&mut cx) {
                fut = futures::future::ready(outcome).boxed();
            }
            t.pending.push(fut);
            if let Some(w) = &t.waker {
                w.wake_by_ref();
            }
        }

        // A write that does not finish is caught by the relay's confirm timeout; while the
        // broker blocks the connection the confirmation may take as long as the alarm lasts.
        Ok(Delivery::Pending(
            async move {
                done_rx.await.unwrap_or_else(|_| {
                    Err(SinkError::Connection(
                        "the RabbitMQ connection was replaced before the confirmation".into(),
                    ))
                })
            }
            .boxed(),
        ))
    }

    async fn flush(&mut self) -> Result<(), SinkError> {
        // Every event is Pending until confirmed: nothing is buffered here.
        Ok(())
    }
}

/// What one publish came to.
struct Outcome {
    id: Uuid,
    result: lapin::Result<Confirmation>,
    done: oneshot::Sender<Result<(), SinkError>>,
}

/// The confirmations of one channel.
#[derive(Default)]
struct Tracker {
    pending: FuturesUnordered<BoxFuture<'static, Outcome>>,
    /// Returned messages whose confirmation has not been settled yet, with the broker's
    /// reason.
    returned: HashMap<Uuid, String>,
    waker: Option<Waker>,
}

fn lock(t: &Mutex<Tracker>) -> MutexGuard<'_, Tracker> {
    t.lock().unwrap_or_else(|e| e.into_inner())
}

impl Tracker {
    /// Settles a batch of completed publishes. All returns in the batch are recorded before
    /// any is settled: the return of message X reaches lapin before X's ack and is handed to
    /// the first confirmation completed after it, which completes no later than X's own, so
    /// it is in this batch or an earlier one.
    fn settle(&mut self, batch: Vec<Outcome>) {
        for o in &batch {
            if let Ok(Confirmation::Ack(Some(ret)) | Confirmation::Nack(Some(ret))) = &o.result {
                let returned_id = ret
                    .delivery
                    .properties
                    .message_id()
                    .as_ref()
                    .and_then(|m| Uuid::parse_str(m.as_str()).ok())
                    .unwrap_or(o.id);
                tracing::error!(
                    id = %returned_id,
                    exchange = %ret.delivery.exchange,
                    routing_key = %ret.delivery.routing_key,
                    reply_code = ret.reply_code,
                    reply_text = %ret.reply_text,
                    "RabbitMQ returned a message as unroutable: the topology is broken (is the alternate exchange <exchange>.unrouted bound to its queue? does the queue <exchange>.dead exist?); it is republished after a reconnect until it routes"
                );
                self.returned.insert(
                    returned_id,
                    format!(
                        "RabbitMQ returned it: {} {} (exchange {:?}, routing key {:?})",
                        ret.reply_code,
                        ret.reply_text,
                        ret.delivery.exchange.as_str(),
                        ret.delivery.routing_key.as_str()
                    ),
                );
            }
        }
        for o in batch {
            let returned = self.returned.remove(&o.id);
            let verdict = match (o.result, returned) {
                (Err(e), _) => Err(channel_error(e)),
                (Ok(_), Some(why)) => Err(SinkError::Rejected(format!(
                    "message {} was returned as unroutable: {why}",
                    o.id
                ))),
                (Ok(Confirmation::Ack(_)), None) => Ok(()),
                (Ok(Confirmation::Nack(_)), None) => Err(SinkError::Rejected(format!(
                    "RabbitMQ nacked message {} (a queue it routes to refused it, e.g. one with x-overflow=reject-publish that is full, or the broker could not store it)",
                    o.id
                ))),
                (Ok(Confirmation::NotRequested), None) => Err(SinkError::Connection(
                    "publisher confirms are not enabled on the channel".into(),
                )),
            };
            // The relay may have given up on it (confirm timeout): then nobody listens.
            let _ = o.done.send(verdict);
        }
    }
}

/// Completes the channel's publishes and settles their confirmations, for as long as the
/// channel lives (the task is aborted with its [`Link`]).
async fn drive_confirms(tracker: Arc<Mutex<Tracker>>) {
    futures::future::poll_fn(|cx: &mut Context<'_>| {
        let mut t = lock(&tracker);
        if !t.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            t.waker = Some(cx.waker().clone());
        }
        let mut batch = Vec::new();
        // Drain everything that is ready now, so the batch holds every return that came with
        // or before the confirmations in it.
        while let Poll::Ready(Some(o)) = t.pending.poll_next_unpin(cx) {
            batch.push(o);
        }
        if !batch.is_empty() {
            t.settle(batch);
        }
        Poll::<()>::Pending
    })
    .await
}

/// Follows lapin's connection events: alarms (blocked/unblocked) and connection errors.
async fn watch_events(
    events: impl futures::Stream<Item = lapin::Event> + Send + 'static,
    state: watch::Sender<LinkState>,
    flow: Arc<FlowControl>,
) {
    let mut events = std::pin::pin!(events);
    while let Some(ev) = events.next().await {
        match ev {
            lapin::Event::ConnectionBlocked(reason) => {
                tracing::warn!(%reason, "RabbitMQ blocked the connection (resource alarm): publishing waits and the stored position stays until it unblocks");
                flow.block();
                crate::telemetry::get().sink_blocked.set(1);
                state.send_modify(|s| s.blocked = true);
            }
            lapin::Event::ConnectionUnblocked => {
                tracing::info!("RabbitMQ unblocked the connection: publishing resumes");
                flow.unblock();
                crate::telemetry::get().sink_blocked.set(0);
                state.send_modify(|s| s.blocked = false);
            }
            lapin::Event::Error(e) => {
                tracing::warn!(error = %e, "RabbitMQ connection or channel failed");
                flow.unblock();
                let t = crate::telemetry::get();
                t.sink_blocked.set(0);
                t.sink_connected.set(0);
                state.send_modify(|s| {
                    s.blocked = false;
                    s.error = Some(e.to_string());
                });
            }
            _ => {}
        }
    }
}

/// A failed publish or confirmation. Permission problems cannot heal by reconnecting.
fn channel_error(e: lapin::Error) -> SinkError {
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

fn io_or_protocol(e: lapin::Error) -> SinkError {
    channel_error(e)
}

/// `inequivalent arg 'alternate-exchange' for exchange 'outbox' in vhost '/': received …
/// but current is …` → the part that says what differs.
fn describe_mismatch(text: &str) -> String {
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

/// The relay's own headers in AMQP encoding.
fn standard_headers(event: &OutboxEvent) -> Vec<(&'static str, AMQPValue)> {
    headers::relay_headers(event)
        .into_iter()
        .map(|(k, v)| (k, amqp_value(v)))
        .collect()
}

fn amqp_value(v: HeaderValue) -> AMQPValue {
    match v {
        HeaderValue::Str(s) => AMQPValue::LongString(s.into()),
        HeaderValue::Int(i) => AMQPValue::LongLongInt(i),
    }
}

/// JSON → AMQP field value: strings as long strings, integers as signed 64-bit (larger ones
/// as their decimal text, which loses nothing), other numbers as doubles, arrays as field
/// arrays, objects as nested tables, null as void.
pub fn json_to_amqp(v: &serde_json::Value) -> Result<AMQPValue, String> {
    use serde_json::Value as J;
    Ok(match v {
        J::Null => AMQPValue::Void,
        J::Bool(b) => AMQPValue::Boolean(*b),
        J::Number(n) => match (n.as_i64(), n.as_f64()) {
            (Some(i), _) => AMQPValue::LongLongInt(i),
            (None, _) if n.is_u64() => AMQPValue::LongString(n.to_string().into()),
            (None, Some(f)) => AMQPValue::Double(f),
            (None, None) => AMQPValue::LongString(n.to_string().into()),
        },
        J::String(s) => AMQPValue::LongString(LongString::from(s.as_bytes())),
        J::Array(a) => AMQPValue::FieldArray(FieldArray::from(
            a.iter().map(json_to_amqp).collect::<Result<Vec<_>, _>>()?,
        )),
        J::Object(o) => {
            let mut t = FieldTable::default();
            for (k, v) in o {
                let key = ShortString::try_new(k.as_str()).map_err(|_| {
                    format!("header name of {} bytes: AMQP allows at most 255", k.len())
                })?;
                t.insert(key, json_to_amqp(v)?);
            }
            AMQPValue::FieldTable(t)
        }
    })
}

/// Encoded size of a field table in bytes (AMQP 0-9-1 as RabbitMQ reads it).
pub fn table_size(t: &FieldTable) -> usize {
    4 + t
        .inner()
        .iter()
        .map(|(k, v)| 1 + k.as_str().len() + 1 + value_size(v))
        .sum::<usize>()
}

fn value_size(v: &AMQPValue) -> usize {
    match v {
        AMQPValue::Boolean(_) | AMQPValue::ShortShortInt(_) | AMQPValue::ShortShortUInt(_) => 1,
        AMQPValue::ShortInt(_) | AMQPValue::ShortUInt(_) => 2,
        AMQPValue::LongInt(_) | AMQPValue::LongUInt(_) | AMQPValue::Float(_) => 4,
        AMQPValue::LongLongInt(_) | AMQPValue::Double(_) | AMQPValue::Timestamp(_) => 8,
        AMQPValue::DecimalValue(_) => 5,
        AMQPValue::ShortString(s) => 1 + s.as_str().len(),
        AMQPValue::LongString(s) => 4 + s.len(),
        AMQPValue::ByteArray(b) => 4 + b.len(),
        AMQPValue::FieldArray(a) => {
            4 + a
                .as_slice()
                .iter()
                .map(|v| 1 + value_size(v))
                .sum::<usize>()
        }
        AMQPValue::FieldTable(t) => table_size(t),
        AMQPValue::Void => 0,
    }
}

fn truncate(s: &str) -> String {
    if s.len() <= DEAD_VALUE_MAX {
        return s.to_string();
    }
    let mut end = DEAD_VALUE_MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// TLS for `amqps://`: the broker's certificate is verified, chain and host name. `--sink-ca`
/// replaces the public roots (a private CA is pinned: a certificate from any other CA, public
/// ones included, is refused); without it the Mozilla roots are trusted. A client certificate
/// needs both the certificate and the key; the key is read as a secret file.
fn tls_config(
    cfg: &RabbitConfig,
    amqps: bool,
) -> Result<Option<Arc<rustls::ClientConfig>>, crate::Error> {
    let any = cfg.ca_file.is_some() || cfg.cert_file.is_some() || cfg.key_file.is_some();
    if !amqps {
        if any {
            return Err(crate::Error::config(
                "--sink-ca/--sink-cert/--sink-key are given but the sink is amqp:// (no TLS)",
                "use amqps://host:5671/vhost, or drop the TLS options",
            ));
        }
        return Ok(None);
    }
    if cfg.cert_file.is_some() != cfg.key_file.is_some() {
        return Err(crate::Error::config(
            "a client certificate needs both --sink-cert and --sink-key",
            "give both, or neither",
        ));
    }
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.to_string_lossy().into_owned());
    let settings = crate::dsn::TlsSettings {
        mode: crate::dsn::TlsMode::VerifyFull,
        ca_file: path(&cfg.ca_file),
        cert_file: path(&cfg.cert_file),
        key_file: path(&cfg.key_file),
    };
    Ok(crate::tls::client_config(&settings)?.map(Arc::new))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sink(max: usize) -> RabbitSink {
        RabbitSink::new(RabbitConfig {
            url: "amqp://guest:secret@127.0.0.1:5672".into(),
            exchange: "outbox".into(),
            declare: DeclareMode::Auto,
            max_message_bytes: max,
            op_timeout: Duration::from_secs(5),
            ca_file: None,
            cert_file: None,
            key_file: None,
            connection_name: "test".into(),
            partitioning: Default::default(),
            dead_queue_type: QueueType::Classic,
            message: Default::default(),
        })
        .unwrap()
    }

    fn event() -> OutboxEvent {
        crate::sink::test_event()
    }

    impl RabbitSink {
        /// `render` with the constant exchange (no broker needed).
        fn render_static(&self, event: &OutboxEvent, limit: usize) -> Outgoing {
            let route = self
                .cfg
                .message
                .routing_key(event)
                .map(|rk| (self.cfg.exchange.clone(), rk));
            self.render(event, limit, route)
        }
    }

    #[test]
    fn url_host_vhost_and_redaction() {
        let s = sink(10);
        assert_eq!(s.uri.authority.host, "127.0.0.1");
        assert_eq!(s.uri.vhost, "/");
        assert!(!format!("{:?}", s.cfg).contains("secret"));
        let s2 = RabbitSink::new(RabbitConfig {
            url: "amqp://u:p@[::1]:5673/prod".into(),
            ..s.cfg.clone()
        })
        .unwrap();
        assert_eq!(s2.uri.authority.host, "::1");
        assert_eq!(s2.uri.authority.port, 5673);
        assert_eq!(s2.uri.vhost, "prod");
        let tls_on_plain = RabbitSink::new(RabbitConfig {
            ca_file: Some("/nonexistent".into()),
            ..s.cfg.clone()
        });
        assert!(tls_on_plain.is_err());
    }

    #[test]
    fn message_properties_and_headers() {
        let s = sink(DEFAULT_MAX_MESSAGE_BYTES);
        let mut ev = event();
        ev.headers = Some(
            serde_json::json!({"tenant": "acme", "n": 3, "big": 18446744073709551615u64,
                "f": 1.5, "ok": true, "none": null, "list": [1, "a"], "nested": {"k": "v"},
                "x-source-position": "forged"})
            .as_object()
            .unwrap()
            .clone(),
        );
        let out = s.render_static(&ev, MAX_HEADER_BYTES);
        assert!(out.dead.is_none());
        assert_eq!(out.exchange, "outbox");
        assert_eq!(out.routing_key, "invoice.issued");
        assert_eq!(&out.body[..], br#"{"a": 1}"#);
        let p = &out.props;
        assert_eq!(p.delivery_mode(), &Some(2));
        assert_eq!(
            p.message_id().as_ref().unwrap().as_str(),
            "0190a5c4-7e2b-7000-8000-00000000abcd"
        );
        assert_eq!(p.timestamp(), &Some(1_750_000_000));
        assert_eq!(p.kind().as_ref().unwrap().as_str(), "invoice.issued");
        assert_eq!(p.app_id().as_ref().unwrap().as_str(), "outboxd");
        assert_eq!(
            p.content_type().as_ref().unwrap().as_str(),
            "application/json"
        );
        let h = p.headers().as_ref().unwrap().inner();
        let get = |k: &str| h.get(k).cloned().unwrap();
        assert_eq!(get("x-aggregate-id"), AMQPValue::LongString("agg-1".into()));
        assert_eq!(
            get("x-outbox-created-at"),
            AMQPValue::LongString("2025-06-15T15:06:40.123456Z".into())
        );
        assert_eq!(
            get("x-source-position"),
            AMQPValue::LongString("00000000/016B3748:0000000003".into()),
            "the relay's own header wins over the row's"
        );
        assert_eq!(get("x-aggregate-version"), AMQPValue::LongLongInt(7));
        assert_eq!(get("n"), AMQPValue::LongLongInt(3));
        assert_eq!(
            get("big"),
            AMQPValue::LongString("18446744073709551615".into())
        );
        assert_eq!(get("f"), AMQPValue::Double(1.5));
        assert_eq!(get("ok"), AMQPValue::Boolean(true));
        assert_eq!(get("none"), AMQPValue::Void);
        assert!(matches!(get("list"), AMQPValue::FieldArray(_)));
        assert!(matches!(get("nested"), AMQPValue::FieldTable(_)));
        assert!(!h.contains_key("x-source-gtid"));
    }

    #[test]
    fn partition_headers_with_partitions_on() {
        let mut s = sink(DEFAULT_MAX_MESSAGE_BYTES);
        s.cfg.partitioning = crate::sink::partition::PartitionSpec {
            partitions: 4,
            group_partitions: vec![3],
            ..Default::default()
        }
        .validate()
        .unwrap();
        let out = s.render_static(&event(), MAX_HEADER_BYTES);
        let h = out.props.headers().as_ref().unwrap().inner();
        let p4 = crate::sink::partition::partition_of("agg-1", 4).to_string();
        let p3 = crate::sink::partition::partition_of("agg-1", 3).to_string();
        assert_eq!(
            h.get("x-partition"),
            Some(&AMQPValue::LongString(p4.clone().into()))
        );
        assert_eq!(
            h.get("x-partition-4"),
            Some(&AMQPValue::LongString(p4.into()))
        );
        assert_eq!(
            h.get("x-partition-3"),
            Some(&AMQPValue::LongString(p3.into()))
        );
        // Off: no partition header at all.
        let out = sink(DEFAULT_MAX_MESSAGE_BYTES).render_static(&event(), MAX_HEADER_BYTES);
        let h = out.props.headers().as_ref().unwrap().inner();
        assert!(h.keys().all(|k| !k.as_str().starts_with("x-partition")));
    }

    #[test]
    fn poison_becomes_a_dead_record_without_body() {
        let s = sink(7);
        let out = s.render_static(&event(), MAX_HEADER_BYTES);
        assert_eq!(out.exchange, "");
        assert_eq!(out.routing_key, "outbox.dead");
        assert!(out.body.is_empty());
        assert!(out.dead.as_ref().unwrap().contains("--max-message-bytes 7"));
        let h = out.props.headers().as_ref().unwrap().inner();
        assert_eq!(h.get("x-original-size"), Some(&AMQPValue::LongLongInt(8)));
        assert_eq!(
            h.get("x-original-topic"),
            Some(&AMQPValue::LongString("invoice.issued".into()))
        );
        assert_eq!(out.props.delivery_mode(), &Some(2));
        assert!(out.props.content_type().is_none());

        let s = sink(DEFAULT_MAX_MESSAGE_BYTES);
        let mut ev = event();
        ev.topic = "t".repeat(300);
        assert!(s
            .render_static(&ev, MAX_HEADER_BYTES)
            .dead
            .unwrap()
            .contains("300 bytes"));
        let mut ev = event();
        ev.headers = Some(
            serde_json::json!({ "k".repeat(256): 1 })
                .as_object()
                .unwrap()
                .clone(),
        );
        assert!(s
            .render_static(&ev, MAX_HEADER_BYTES)
            .dead
            .unwrap()
            .contains("header name"));
        let mut ev = event();
        ev.headers = Some(
            serde_json::json!({ "big": "v".repeat(200_000) })
                .as_object()
                .unwrap()
                .clone(),
        );
        assert!(s
            .render_static(&ev, MAX_HEADER_BYTES)
            .dead
            .unwrap()
            .contains("headers encode"));
        let mut ev = event();
        ev.poison = Some("aggregate_id is NULL".into());
        assert_eq!(
            s.render_static(&ev, MAX_HEADER_BYTES).dead.as_deref(),
            Some("aggregate_id is NULL")
        );
    }

    #[test]
    fn table_size_matches_the_wire_encoding() {
        let mut t = FieldTable::default();
        t.insert("a".into(), AMQPValue::LongString("xyz".into()));
        t.insert("b".into(), AMQPValue::LongLongInt(1));
        // 4 (length) + [1+1+1+4+3] + [1+1+1+8]
        assert_eq!(table_size(&t), 4 + 10 + 11);
    }

    #[test]
    fn mismatch_text_names_the_argument() {
        let t = "PRECONDITION_FAILED - inequivalent arg 'alternate-exchange' for exchange 'outbox' in vhost '/': received the value 'outbox.unrouted' of type 'longstr' but current is none";
        let d = describe_mismatch(t);
        assert!(
            d.starts_with("argument \"alternate-exchange\" differs:"),
            "{d}"
        );
        assert!(d.contains("current is none"));
        assert!(validate_exchange("outbox").is_ok());
        assert!(validate_exchange("amq.topic").is_err());
        assert!(validate_exchange("a b").is_err());
        assert!(validate_exchange(&"x".repeat(247)).is_err());
    }
}
