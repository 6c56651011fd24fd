//! One connection to the broker and its publishing channels. Kept apart because it is the
//! only part that holds sockets and background tasks: connecting (with our own rustls
//! configuration for `amqps://`), telling a login or certificate problem (which retrying
//! cannot fix) from a broker that is away, and waiting while the broker blocks the
//! connection. A [`Link`] is never repaired: the relay drops it and opens a fresh one.

use super::config::{config_err, FRAME_RESERVE, MAX_HEADER_BYTES};
use super::confirms::{drive_confirms, watch_events, Tracker};
use super::declare::io_or_protocol;
use super::RabbitSink;
use crate::amqp::{ConnectError, WireSocket};
use crate::sink::DeclareMode;
use crate::sink::SinkError;
use crate::state::Fence;
use lapin::options::ConfirmSelectOptions;
use lapin::{Channel, Connection};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Broker-side state of one connection, updated from lapin's connection events.
#[derive(Debug, Clone, Default)]
pub(super) struct LinkState {
    pub(super) blocked: bool,
    pub(super) error: Option<String>,
}

/// Most channels one sink publishes on. With `--partitions N` every partition is published on
/// a channel of its own (partition `p` on lane `p % lanes`), so their confirmations overlap:
/// one channel's confirms are serialised by the broker and cap a single channel well below
/// what the broker can persist. Past a handful of channels the broker's disk is the limit, and
/// each channel costs a process on the broker and a task here, so the count is capped.
pub(super) const MAX_LANES: u32 = 16;

/// One publishing channel and the tracker settling its confirmations. Events of one aggregate
/// always take the same lane, so their order on the wire and in the queue is the relay's.
pub(super) struct Lane {
    pub(super) channel: Channel,
    pub(super) tracker: Arc<Mutex<Tracker>>,
}

/// One connection and its publishing channels, with the tasks that serve them. Dropping it
/// closes the connection and abandons its unsettled confirmations (the relay republishes).
pub(super) struct Link {
    pub(super) conn: Connection,
    pub(super) lanes: Vec<Lane>,
    pub(super) state: watch::Receiver<LinkState>,
    pub(super) header_limit: usize,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

/// How many lanes a sink with `partitions` own partitions (0 = off) publishes on: one without
/// partitions (every event in one channel keeps the relay's total order on the wire), else one
/// per partition up to [`MAX_LANES`].
pub(super) fn lane_count(partitions: u32) -> u32 {
    partitions.clamp(1, MAX_LANES)
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

/// Resets the link's socket the moment the lease's gate closes. The relay checks the gate
/// before it hands an event to lapin, but lapin queues frames without bound and writes them
/// from its own thread whenever the socket takes them: frames queued before a pause (SIGSTOP,
/// a frozen VM) under back-pressure would be written after it, while a successor publishes.
/// The gate closes by time alone, so this sleeps until it would close and looks again; after a
/// pause the sleep is already over when the process resumes. A gate that is closed from the
/// start (no renewal yet) is waited out first: nothing was handed to this link meanwhile.
pub(super) async fn guard_socket(
    fence: Fence,
    socket: WireSocket,
    state: watch::Sender<LinkState>,
) {
    fence.wait_open().await;
    while let Some(open_for) = fence.closes_in() {
        tokio::time::sleep(open_for).await;
    }
    let result = socket.reset();
    let why = "the lease's gate closed (no renewal for too long): the connection was reset so that nothing queued in the client reaches the broker";
    tracing::warn!(target: "outboxd::sink::rabbitmq", reset = ?result, "{why}");
    state.send_modify(|s| {
        if s.error.is_none() {
            s.error = Some(why.into());
        }
    });
}

impl RabbitSink {
    pub async fn connection(&self) -> Result<Connection, SinkError> {
        self.connection_with_socket().await.map(|(conn, _)| conn)
    }

    async fn connection_with_socket(&self) -> Result<(Connection, WireSocket), SinkError> {
        let ep = &self.endpoint;
        ep.connect_with_socket(&self.cfg.connection_name).await.map_err(|e| match e {
            ConnectError::Login { user, vhost, message } => config_err(
                format!("RabbitMQ refused the login of user {user:?} to vhost {vhost:?} at {}: {message}", ep.redacted),
                format!("check the user, password and vhost of --sink, and that the user may access the vhost: rabbitmqctl set_permissions -p {vhost:?} {user:?} '.*' '.*' '.*' (or narrower)"),
            ),
            ConnectError::Tls(io) => config_err(
                format!("TLS with RabbitMQ at {} failed: {io}", ep.redacted),
                "check --sink-ca (the CA that signed the broker's certificate), --sink-cert/--sink-key, and that the host name in --sink matches the certificate",
            ),
            ConnectError::Other(e) => SinkError::Connection(format!(
                "cannot connect to RabbitMQ at {}: {e}",
                ep.redacted
            )),
        })
    }

    pub(super) async fn open(&self) -> Result<Link, SinkError> {
        let (conn, socket) = self.connection_with_socket().await?;

        let (state_tx, state_rx) = watch::channel(LinkState::default());
        let mut tasks = Vec::new();
        if let Some(fence) = &self.fence {
            // Leaving with frames still queued (exit 4 after a pause) must not send them
            // either: the socket's close resets the connection.
            if !socket.is_kept() {
                tracing::warn!("the RabbitMQ socket was not kept: a closed lease gate stops publishing at the hand-over only");
            } else if let Err(e) = socket.abort_on_close() {
                tracing::warn!(error = %e, "cannot make the RabbitMQ socket reset on close");
            }
            tasks.push(tokio::spawn(guard_socket(
                fence.clone(),
                socket,
                state_tx.clone(),
            )));
        }
        tasks.push(tokio::spawn(watch_events(
            conn.events_listener(),
            state_tx,
            self.flow.clone(),
        )));

        if self.cfg.declare != DeclareMode::Off {
            self.declare_all(&conn, self.own_layout().as_slice())
                .await?;
        }
        let mut lanes = Vec::new();
        for _ in 0..lane_count(self.cfg.partitioning.partitions) {
            let channel = conn.create_channel().await.map_err(io_or_protocol)?;
            channel
                .confirm_select(ConfirmSelectOptions::default())
                .await
                .map_err(io_or_protocol)?;
            let tracker = Arc::new(Mutex::new(Tracker::default()));
            tasks.push(tokio::spawn(drive_confirms(tracker.clone())));
            lanes.push(Lane { channel, tracker });
        }

        let frame_max = conn.configuration().frame_max() as usize;
        let header_limit = if frame_max == 0 {
            MAX_HEADER_BYTES
        } else {
            MAX_HEADER_BYTES.min(frame_max.saturating_sub(FRAME_RESERVE))
        };
        Ok(Link {
            conn,
            lanes,
            state: state_rx,
            header_limit,
            tasks,
        })
    }

    /// Waits while the broker blocks the connection; fails when the connection is gone.
    pub(super) async fn wait_until_writable(&mut self) -> Result<(), SinkError> {
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
