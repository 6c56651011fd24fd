//! One connection to the broker and its publishing channel. Kept apart because it is the
//! only part that holds sockets and background tasks: connecting (with our own rustls
//! configuration for `amqps://`), telling a login or certificate problem (which retrying
//! cannot fix) from a broker that is away, and waiting while the broker blocks the
//! connection. A [`Link`] is never repaired: the relay drops it and opens a fresh one.

use super::config::{config_err, DeclareMode, RabbitConfig, FRAME_RESERVE, MAX_HEADER_BYTES};
use super::confirms::{drive_confirms, watch_events, Tracker};
use super::declare::io_or_protocol;
use super::RabbitSink;
use crate::sink::SinkError;
use lapin::options::ConfirmSelectOptions;
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::tcp::{AMQPUriTcpExt, OwnedTLSConfig, RustlsConnector, TLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Channel, Connection, ConnectionProperties};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// Broker-side state of one connection, updated from lapin's connection events.
#[derive(Debug, Clone, Default)]
pub(super) struct LinkState {
    pub(super) blocked: bool,
    pub(super) error: Option<String>,
}

/// One connection and its publishing channel, with the tasks that serve it. Dropping it
/// closes the connection and abandons its unsettled confirmations (the relay republishes).
pub(super) struct Link {
    pub(super) conn: Connection,
    pub(super) channel: Channel,
    pub(super) state: watch::Receiver<LinkState>,
    pub(super) tracker: Arc<Mutex<Tracker>>,
    pub(super) header_limit: usize,
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

    pub(super) async fn open(&self) -> Result<Link, SinkError> {
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

/// TLS for `amqps://`: the broker's certificate is verified, chain and host name. `--sink-ca`
/// replaces the public roots (a private CA is pinned: a certificate from any other CA, public
/// ones included, is refused); without it the Mozilla roots are trusted. A client certificate
/// needs both the certificate and the key; the key is read as a secret file.
pub(super) fn tls_config(
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
