//! Opening a NATS connection for the relay: credentials and TLS from the configuration, and a
//! client that never reconnects on its own, with every loss reported to the relay — which
//! replaces the client, with backoff, and republishes in order — instead of being papered over
//! while acknowledgements silently go missing.
//!
//! Why the client must not reconnect: messages still queued in it when the connection drops
//! would go out on its new connection, after the ones lost with the old one. The stream would
//! then store a later event before an earlier one, and the relay's republish (deduplicated by
//! `Nats-Msg-Id`) would store the earlier one after it: out of order. The client's own limit
//! (`max_reconnects`) cannot say "none": it counts attempts since the last success and allows
//! at least one. So the client is given a second address that refuses every connection, and
//! a reconnect callback that picks it once the first connection has succeeded: the reconnect
//! fails at once, the client gives up and drops what it still queued.

use super::config::{self, Endpoint, NatsConfig};
use crate::dsn::redact;
use crate::sink::SinkError;
use async_nats::{Client, ConnectErrorKind, ConnectOptions, ReconnectToServer, ServerAddr};
use std::time::Duration;

/// An address nothing can listen on (TCP port 0): every connection to it is refused at once.
const NOWHERE: &str = "nats://127.0.0.1:0";

fn config_err(problem: impl Into<String>, fix: impl Into<String>) -> SinkError {
    SinkError::Config {
        problem: problem.into(),
        fix: fix.into(),
    }
}

/// Connects once, bounded by the operation timeout (for `outboxd check` and tools).
pub(crate) async fn connect(cfg: &NatsConfig) -> Result<Client, SinkError> {
    connect_with_events(cfg, |_| async {}).await
}

/// Connects once, bounded by the operation timeout, with `on_event` told of every connection
/// event. The client reconnects at most once on its own; the relay learns of the loss through
/// `on_event` and replaces the client anyway.
pub(crate) async fn connect_with_events<F, Fut>(
    cfg: &NatsConfig,
    on_event: F,
) -> Result<Client, SinkError>
where
    F: Fn(async_nats::Event) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send + Sync + 'static,
{
    let shown = redact(&cfg.url);
    let ep = config::endpoint(&cfg.url).map_err(|e| config_err(e.to_string(), "fix --sink"))?;
    let opts = options(cfg, &ep).await?.event_callback(on_event);
    let (server, nowhere) = addresses(&ep.address).map_err(|e| {
        config_err(
            format!("cannot use the NATS address {shown}: {e}"),
            "use nats://host:4222 or tls://host:4222",
        )
    })?;
    let pool = vec![server.clone(), nowhere.clone()];
    let opts = opts.reconnect_to_server_callback(move |pool, _| {
        let server = server.clone();
        let nowhere = nowhere.clone();
        async move {
            let connected = pool.iter().any(|s| s.addr == server && s.did_connect);
            Some(ReconnectToServer {
                addr: if connected { nowhere } else { server },
                delay: Some(Duration::ZERO),
            })
        }
    });
    let work = opts.connect(pool);
    match tokio::time::timeout(cfg.op_timeout, work).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(classify(&e, &shown, &ep)),
        Err(_) => Err(SinkError::Connection(format!(
            "connecting to NATS at {shown} took longer than {:?}",
            cfg.op_timeout
        ))),
    }
}

async fn options(cfg: &NatsConfig, ep: &Endpoint) -> Result<ConnectOptions, SinkError> {
    let mut opts = match &ep.creds_file {
        Some(path) => ConnectOptions::with_credentials_file(path)
            .await
            .map_err(|e| {
                config_err(
                    format!(
                        "cannot read the NATS credentials file {}: {e}",
                        path.display()
                    ),
                    "point creds= in --sink at a readable .creds file",
                )
            })?,
        None => ConnectOptions::new(),
    };
    if let (Some(u), Some(p)) = (&ep.user, &ep.password) {
        opts = opts.user_and_password(u.clone(), p.clone());
    }
    if let Some(t) = &ep.token {
        opts = opts.token(t.clone());
    }
    if ep.tls {
        opts = opts.require_tls(true);
    }
    if let Some(ca) = &cfg.ca_file {
        opts = opts.add_root_certificates(ca.clone());
    }
    match (&cfg.cert_file, &cfg.key_file) {
        (Some(c), Some(k)) => opts = opts.add_client_certificate(c.clone(), k.clone()),
        (None, None) => {}
        _ => {
            return Err(config_err(
                "--sink-cert and --sink-key go together",
                "give both (the client certificate and its private key) or neither",
            ))
        }
    }
    Ok(opts
        .name(cfg.connection_name.clone())
        .connection_timeout(cfg.op_timeout)
        .request_timeout(Some(cfg.op_timeout))
        // A dead connection is noticed by pings within seconds, not at the next confirm timeout.
        .ping_interval(std::time::Duration::from_secs(5))
        .max_reconnects(Some(1))
        .ignore_discovered_servers()
        // Room for the whole window in the client's outgoing queue, so a publish never waits
        // for it while the connection is healthy.
        .client_capacity(cfg.window.max(1) * 2 + 64))
}

/// The server's address and the one that refuses (see the module's comment).
fn addresses(address: &str) -> Result<(ServerAddr, ServerAddr), String> {
    let server: ServerAddr = address.parse().map_err(|e| format!("{e}"))?;
    let nowhere: ServerAddr = NOWHERE.parse().map_err(|e| format!("{e}"))?;
    Ok((server, nowhere))
}

fn classify(e: &async_nats::ConnectError, shown: &str, ep: &Endpoint) -> SinkError {
    let text = e.to_string();
    match e.kind() {
        ConnectErrorKind::Authentication | ConnectErrorKind::AuthorizationViolation => config_err(
            format!("NATS at {shown} refused the login ({text})"),
            format!(
                "check the credentials of --sink (nats://user:password@host:4222, nats://token@host:4222 or creds=/path/user.creds; {})",
                if ep.user.is_some() || ep.token.is_some() { "the ones given were refused" } else { "none were given" }
            ),
        ),
        ConnectErrorKind::Tls => config_err(
            format!("TLS with NATS at {shown} failed: {text}"),
            "check --sink-ca (the CA that signed the server's certificate), --sink-cert/--sink-key, that the host name in --sink matches the certificate, and that the server has TLS enabled (tls://) or not (nats://)",
        ),
        ConnectErrorKind::ServerParse => config_err(
            format!("cannot use the NATS address {shown}: {text}"),
            "use nats://host:4222 or tls://host:4222",
        ),
        _ => SinkError::Connection(format!("cannot connect to NATS at {shown}: {text}")),
    }
}
