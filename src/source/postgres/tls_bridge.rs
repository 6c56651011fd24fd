//! TLS for the replication stream.
//!
//! pgwire-replication 0.5's own TLS is not used: its verify-ca still checks the host name (it
//! forgives only rustls's old `NotValidForName`, while rustls 0.23 reports
//! `NotValidForNameContext`), and its verify-full refuses a host given as an IP address. So the
//! relay opens the TCP connection itself, negotiates TLS with the rustls configuration the SQL
//! connection uses ([`crate::tls::client_config`]), and gives pgwire-replication a Unix socket
//! in a fresh private directory (mode 0700) whose one connection is spliced onto the TLS stream.
//! The socket and its directory are removed as soon as that connection is accepted.

use crate::dsn::{DbDsn, TlsMode};
use crate::tls;
use crate::Error;
use rustls::pki_types::ServerName;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpStream, UnixListener};

/// A byte stream to the server: TCP, or TLS over TCP.
pub trait Stream: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Stream for T {}

const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// pgwire-replication connects right after it is started; a socket nobody took goes away.
const ACCEPT_TIMEOUT: Duration = Duration::from_secs(30);
/// The protocol's SSLRequest: length 8, code 80877103.
const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];

/// Connects to the server of `dsn` over TCP and negotiates TLS as its `sslmode` says
/// (`prefer` falls back to plain TCP when the server declines).
pub async fn connect(dsn: &DbDsn) -> Result<Box<dyn Stream>, Error> {
    let what = format!("Postgres {}:{}", dsn.host, dsn.port);
    let config = tls::client_config(&dsn.tls)?;
    let attempt = async {
        let mut tcp = TcpStream::connect((dsn.host.as_str(), dsn.port))
            .await
            .map_err(|e| Error::source(format!("cannot connect to {what}: {e}"), true))?;
        tcp.set_nodelay(true)
            .map_err(|e| Error::source(format!("{what}: {e}"), true))?;
        let Some(config) = config else {
            return Ok(Box::new(tcp) as Box<dyn Stream>);
        };
        tcp.write_all(&SSL_REQUEST)
            .await
            .map_err(|e| Error::source(format!("{what}: sending the TLS request: {e}"), true))?;
        let mut answer = [0u8; 1];
        tcp.read_exact(&mut answer)
            .await
            .map_err(|e| Error::source(format!("{what}: reading the TLS answer: {e}"), true))?;
        if answer[0] != b'S' {
            if dsn.tls.mode == TlsMode::Prefer {
                return Ok(Box::new(tcp) as Box<dyn Stream>);
            }
            return Err(Error::config(
                format!("TLS: {what} does not accept TLS connections"),
                "turn TLS on in the server (ssl = on, ssl_cert_file, ssl_key_file), \
                 or set sslmode=prefer or disable in the DSN",
            ));
        }
        let name = ServerName::try_from(dsn.host.clone()).map_err(|e| {
            Error::config(
                format!("TLS: {:?} is not a host name or IP address: {e}", dsn.host),
                "use the server's host name or IP address in the DSN",
            )
        })?;
        let stream = tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| match tls::rustls_cause(&e) {
                Some(r) => tls::handshake_refused(&what, &dsn.tls, r),
                None => Error::source(format!("TLS handshake with {what}: {e}"), true),
            })?;
        Ok(Box::new(stream) as Box<dyn Stream>)
    };
    tokio::time::timeout(CONNECT_TIMEOUT, attempt)
        .await
        .map_err(|_| {
            Error::source(
                format!("connecting to {what} timed out after {CONNECT_TIMEOUT:?}"),
                true,
            )
        })?
}

/// A directory only this user can enter, removed with everything in it on drop.
struct PrivateDir(PathBuf);

impl PrivateDir {
    fn create() -> Result<PrivateDir, Error> {
        use std::os::unix::fs::DirBuilderExt;
        let path = std::env::temp_dir().join(format!("outboxd-{}", uuid::Uuid::new_v4().simple()));
        std::fs::DirBuilder::new()
            .mode(0o700)
            .create(&path)
            .map_err(|e| {
                Error::config(
                    format!(
                        "cannot create {} for the replication stream's TLS: {e}",
                        path.display()
                    ),
                    "point TMPDIR at a writable directory",
                )
            })?;
        Ok(PrivateDir(path))
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Serves `upstream` to one client on a private Unix socket named as Postgres names its
/// sockets (`<dir>/.s.PGSQL.<port>`); returns the directory, which is the `host` a Postgres
/// client connects to.
pub fn serve(upstream: Box<dyn Stream>, port: u16) -> Result<String, Error> {
    let dir = PrivateDir::create()?;
    let host = dir
        .0
        .to_str()
        .ok_or_else(|| {
            Error::config(
                format!("{} is not UTF-8", dir.0.display()),
                "point TMPDIR at a directory with a UTF-8 path",
            )
        })?
        .to_string();
    let socket = dir.0.join(format!(".s.PGSQL.{port}"));
    let listener = UnixListener::bind(&socket).map_err(|e| {
        Error::config(
            format!("cannot listen on {}: {e}", socket.display()),
            "point TMPDIR at a writable directory with a short path",
        )
    })?;
    tokio::spawn(async move {
        let accepted = tokio::time::timeout(ACCEPT_TIMEOUT, listener.accept()).await;
        drop(listener);
        drop(dir);
        let mut local = match accepted {
            Ok(Ok((local, _))) => local,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "replication TLS socket: accept failed");
                return;
            }
            Err(_) => {
                tracing::debug!("replication TLS socket: nobody connected");
                return;
            }
        };
        let mut upstream = upstream;
        match tokio::io::copy_bidirectional(&mut local, &mut upstream).await {
            Ok((up, down)) => {
                tracing::debug!(up, down, "replication TLS stream closed")
            }
            Err(e) => tracing::debug!(error = %e, "replication TLS stream ended"),
        }
        let _ = upstream.shutdown().await;
    });
    Ok(host)
}
