//! The AMQP client pieces every RabbitMQ user in the crate shares — the relay's sink,
//! `outboxd topology` and `check`, and the consumer kit's runner: reading an `amqp://` or
//! `amqps://` URL the way users write it, building the TLS client configuration, connecting
//! (with our own rustls configuration for `amqps://`), and telling a refused login or a
//! certificate problem, which no retry can fix, from a broker that is away. Each caller turns
//! a [`ConnectError`] into its own error type with the fix that fits its flags.

use crate::dsn::redact;
pub(crate) use crate::wire::WireSocket;
use crate::Error;
use lapin::protocol::{AMQPErrorKind, AMQPHardError, AMQPSoftError};
use lapin::tcp::{AMQPUriTcpExt, AsyncTcpStream, RustlsConnector, TLSConfig};
use lapin::uri::{AMQPScheme, AMQPUri};
use lapin::{Connection, ConnectionProperties};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;

/// PEM files for TLS to the broker: the CA to trust, and a client certificate and its key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct TlsFiles {
    pub ca_file: Option<PathBuf>,
    pub cert_file: Option<PathBuf>,
    pub key_file: Option<PathBuf>,
}

impl TlsFiles {
    fn any(&self) -> bool {
        self.ca_file.is_some() || self.cert_file.is_some() || self.key_file.is_some()
    }

    /// Files the URL names in RabbitMQ's query parameters (`cacertfile`, `certfile`,
    /// `keyfile`) fill in those not given already: flags win over the URL.
    fn fill_from(&mut self, url: &url::Url) {
        for (k, v) in url.query_pairs() {
            let slot = match k.as_ref() {
                "cacertfile" => &mut self.ca_file,
                "certfile" => &mut self.cert_file,
                "keyfile" => &mut self.key_file,
                _ => continue,
            };
            if slot.is_none() {
                *slot = Some(PathBuf::from(v.as_ref()));
            }
        }
    }
}

/// A broker to connect to: its URI as lapin wants it, the URL with the password redacted
/// (for every message), and the TLS configuration of an `amqps://` URL.
#[derive(Clone)]
pub(crate) struct Endpoint {
    pub uri: AMQPUri,
    pub redacted: String,
    pub tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The URI holds the password: only the redacted form is shown.
        f.debug_struct("Endpoint")
            .field("url", &self.redacted)
            .field("tls", &self.tls.is_some())
            .finish()
    }
}

impl Endpoint {
    /// Parses `url` (`what` names it in errors: "the sink", "the broker URL") and loads the TLS
    /// files, `files` first, then the URL's query parameters; `flags` names the TLS options as
    /// the user gives them, for the errors. Connects nothing.
    pub(crate) fn parse(
        url: &str,
        what: &str,
        files: TlsFiles,
        flags: &str,
    ) -> Result<Endpoint, Error> {
        let redacted = redact(url);
        let fix = "use amqp://user@host:5672/vhost (amqps:// for TLS)";
        let parsed = url::Url::parse(url)
            .map_err(|e| Error::config(format!("cannot parse {what} {redacted}: {e}"), fix))?;
        let mut uri: AMQPUri = url.parse().map_err(|e: String| {
            Error::config(
                format!(
                    "cannot parse {what} {redacted}: {}",
                    e.replace(url, &redacted)
                ),
                fix,
            )
        })?;
        // lapin takes the host from `Url::domain`, which is empty for IP addresses (it then
        // falls back to "localhost", possibly ::1): use the host as written.
        if let Some(host) = parsed.host_str() {
            uri.authority.host = host.trim_start_matches('[').trim_end_matches(']').into();
        }
        // `amqp://host/` means the vhost "" by the URI spec, which no broker has; everyone
        // who writes it means the default vhost.
        if uri.vhost.is_empty() {
            uri.vhost = "/".into();
        }
        let mut files = files;
        files.fill_from(&parsed);
        let tls = tls_config(&files, uri.scheme == AMQPScheme::AMQPS, flags)?;
        Ok(Endpoint { uri, redacted, tls })
    }

    /// Opens one connection, named `name` in the broker's connection list.
    pub(crate) async fn connect(&self, name: &str) -> Result<Connection, ConnectError> {
        self.connect_with_socket(name).await.map(|(conn, _)| conn)
    }

    /// [`connect`](Self::connect), and a handle on the connection's TCP socket that can reset
    /// it from outside lapin (see [`WireSocket`]).
    pub(crate) async fn connect_with_socket(
        &self,
        name: &str,
    ) -> Result<(Connection, WireSocket), ConnectError> {
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| ConnectError::Other(format!("no runtime for lapin: {e}")))?;
        let props = ConnectionProperties::default().with_connection_name(name.to_string().into());
        let socket = WireSocket::default();
        let slot = socket.clone();
        // amqps://: the TLS handshake with our own rustls configuration (lapin's would add the
        // public roots to the CA file). Either way the TCP connection is made here, as lapin
        // makes it, so that its socket can be kept.
        let connector = self.tls.clone().map(RustlsConnector::from);
        let result = Connection::connector(
            self.uri.clone(),
            runtime,
            async move |uri: AMQPUri, runtime| {
                let mut plain = uri.clone();
                plain.scheme = AMQPScheme::AMQP;
                let stream = plain
                    .connect_with_config_async(TLSConfig::default(), &runtime)
                    .await?;
                if let AsyncTcpStream::Plain(tcp) = &stream {
                    slot.keep(tcp.get_ref().as_fd())?;
                }
                match &connector {
                    Some(c) => Ok(stream.into_rustls(c, &uri.authority.host).await?),
                    None => Ok(stream),
                }
            },
            props,
        )
        .await;
        result
            .map(|conn| (conn, socket))
            .map_err(|e| self.classify(e))
    }

    fn classify(&self, e: lapin::Error) -> ConnectError {
        if let lapin::ErrorKind::ProtocolError(p) = e.kind() {
            if matches!(
                p.kind(),
                AMQPErrorKind::Soft(AMQPSoftError::ACCESSREFUSED)
                    | AMQPErrorKind::Hard(AMQPHardError::NOTALLOWED)
            ) {
                return ConnectError::Login {
                    user: self.uri.authority.userinfo.username.clone(),
                    vhost: self.uri.vhost.clone(),
                    message: p.get_message().to_string(),
                };
            }
        }
        if let lapin::ErrorKind::IOError(io) = e.kind() {
            // rustls reports certificate and handshake problems as InvalidData: retrying
            // cannot fix a certificate.
            if io.kind() == std::io::ErrorKind::InvalidData
                || crate::tls::rustls_cause(io.as_ref()).is_some()
            {
                return ConnectError::Tls(io.to_string());
            }
        }
        ConnectError::Other(e.to_string())
    }
}

/// Why a connection failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(crate) enum ConnectError {
    /// The broker refused the login (user, password or vhost): not retryable.
    #[error("RabbitMQ refused the login of user {user:?} to vhost {vhost:?}: {message}")]
    Login {
        user: String,
        vhost: String,
        message: String,
    },
    /// The TLS handshake failed (certificate, CA, host name): not retryable.
    #[error("TLS with RabbitMQ failed: {0}")]
    Tls(String),
    /// Anything else: the broker is away or the network failed; retryable.
    #[error("{0}")]
    Other(String),
}

/// The TLS client configuration for the broker: `None` for `amqp://` (and then no TLS file
/// may be given), verified against the CA file (or the public roots) for `amqps://`.
pub(crate) fn tls_config(
    files: &TlsFiles,
    amqps: bool,
    flags: &str,
) -> Result<Option<Arc<rustls::ClientConfig>>, Error> {
    if !amqps {
        if files.any() {
            return Err(Error::config(
                format!("{flags} are given but the sink is amqp:// (no TLS)"),
                "use amqps://host:5671/vhost, or drop the TLS options",
            ));
        }
        return Ok(None);
    }
    if files.cert_file.is_some() != files.key_file.is_some() {
        return Err(Error::config(
            "a client certificate needs both --sink-cert and --sink-key",
            "give both, or neither",
        ));
    }
    let path = |p: &Option<PathBuf>| p.as_ref().map(|p| p.to_string_lossy().into_owned());
    let settings = crate::dsn::TlsSettings {
        mode: crate::dsn::TlsMode::VerifyFull,
        ca_file: path(&files.ca_file),
        cert_file: path(&files.cert_file),
        key_file: path(&files.key_file),
    };
    Ok(crate::tls::client_config(&settings)?.map(Arc::new))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client socket whose peer does not read, written to until the kernel holds data for
    /// it: `connected_to` finds it, `reset` drops what was queued and fails every later write,
    /// and the peer sees a reset, not the queued bytes followed by an orderly end.
    #[test]
    fn a_reset_socket_sends_nothing_more() {
        use std::io::{Read, Write};
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        client.set_nonblocking(true).unwrap();
        let chunk = [7u8; 64 * 1024];
        let mut written = 0usize;
        loop {
            match client.write(&chunk) {
                Ok(n) => written += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        assert!(written > 0);

        let found = WireSocket::connected_to(&[addr]);
        assert_eq!(
            found.len(),
            1,
            "exactly the client's socket is connected to {addr}"
        );
        let (fd, socket) = &found[0];
        assert_eq!(*fd, std::os::fd::AsRawFd::as_raw_fd(&client));
        socket.reset().unwrap();

        assert!(client.write(&chunk).is_err(), "nothing more is written");
        // The peer reads at most what had reached it before the reset, then the reset.
        server.set_nonblocking(false).unwrap();
        server
            .set_read_timeout(Some(std::time::Duration::from_secs(10)))
            .unwrap();
        let mut received = 0usize;
        let mut buf = vec![0u8; 64 * 1024];
        let end = loop {
            match server.read(&mut buf) {
                Ok(0) => break None,
                Ok(n) => received += n,
                Err(e) => break Some(e.kind()),
            }
        };
        assert_eq!(
            end,
            Some(std::io::ErrorKind::ConnectionReset),
            "the peer sees a reset after {received} of {written} bytes"
        );
        assert!(received < written, "the queued bytes were dropped");
    }

    #[test]
    fn urls_are_read_as_users_write_them() {
        let e = Endpoint::parse(
            "amqp://guest:secret@127.0.0.1:5672",
            "the sink",
            TlsFiles::default(),
            "--sink-ca",
        )
        .unwrap();
        assert_eq!(e.uri.authority.host, "127.0.0.1");
        assert_eq!(e.uri.vhost, "/");
        assert!(e.tls.is_none());
        assert!(!format!("{e:?}").contains("secret"), "{e:?}");
        let v6 = Endpoint::parse("amqp://[::1]:5672/%2f", "x", TlsFiles::default(), "f").unwrap();
        assert_eq!(v6.uri.authority.host, "::1");
    }

    #[test]
    fn bad_urls_and_tls_files_are_refused_with_the_fix() {
        let err =
            Endpoint::parse("amqp://u:pw@", "the sink", TlsFiles::default(), "f").unwrap_err();
        assert!(!err.to_string().contains("pw"), "{err}");
        let files = TlsFiles {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..Default::default()
        };
        let err = Endpoint::parse("amqp://h/", "the sink", files.clone(), "--sink-ca").unwrap_err();
        assert!(err.to_string().contains("--sink-ca are given"), "{err}");
        let from_query = Endpoint::parse(
            "amqp://h/?cacertfile=/nonexistent/ca.pem",
            "the broker URL",
            TlsFiles::default(),
            "cacertfile",
        )
        .unwrap_err();
        assert!(
            from_query.to_string().contains("cacertfile"),
            "{from_query}"
        );
    }
}
