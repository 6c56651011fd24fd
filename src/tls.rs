//! TLS client configuration shared by the database and broker clients: the libpq `sslmode`
//! levels (require = encrypt only, verify-ca = trusted chain, verify-full = chain and host
//! name), a CA file or the Mozilla roots, and an optional client certificate.
//!
//! As in libpq, `require` with a CA file (`sslrootcert`) verifies the chain like `verify-ca`,
//! and a host given as an IP address is matched against the certificate's IP addresses under
//! `verify-full`. Every Postgres connection of the relay, SQL and replication, is verified by
//! the configuration built here, so the two cannot disagree.

use crate::dsn::{TlsMode, TlsSettings};
use crate::Error;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use std::sync::Arc;

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn tls_err(what: impl std::fmt::Display) -> Error {
    Error::config(
        format!("TLS: {what}"),
        "check the CA / certificate / key files named in the DSN (sslrootcert, sslcert, sslkey)",
    )
}

pub(crate) fn load_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, Error> {
    let data = std::fs::read(path).map_err(|e| tls_err(format!("cannot read {path}: {e}")))?;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(&data)
        .collect::<Result<_, _>>()
        .map_err(|e| tls_err(format!("{path}: {e}")))?;
    if certs.is_empty() {
        return Err(tls_err(format!("{path} holds no PEM certificate")));
    }
    Ok(certs)
}

/// A PEM private key, read as every secret file is ([`crate::secret_file`]: owner and mode
/// checked on the open descriptor, as libpq checks `sslkey`).
pub(crate) fn load_key(path: &str) -> Result<PrivateKeyDer<'static>, Error> {
    let data = read_key_file(path)?;
    PrivateKeyDer::from_pem_slice(&data).map_err(|e| match e {
        pem::Error::NoItemsFound => tls_err(format!("{path} holds no PEM private key")),
        e => tls_err(format!("{path}: {e}")),
    })
}

/// The bytes of a private key file, checked as a secret file.
pub(crate) fn read_key_file(path: &str) -> Result<zeroize::Zeroizing<Vec<u8>>, Error> {
    crate::secret_file::read(std::path::Path::new(path)).map_err(|e| {
        let fix = e.fix();
        Error::config(format!("TLS private key: {e}"), fix)
    })
}

fn roots(settings: &TlsSettings) -> Result<RootCertStore, Error> {
    let mut roots = RootCertStore::empty();
    match &settings.ca_file {
        Some(ca) => {
            for cert in load_certs(ca)? {
                roots.add(cert).map_err(|e| tls_err(format!("{ca}: {e}")))?;
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    Ok(roots)
}

/// The verification level `settings` amount to: libpq's `require` verifies the chain when a
/// CA file is given.
pub(crate) fn effective_mode(settings: &TlsSettings) -> TlsMode {
    match settings.mode {
        TlsMode::Require if settings.ca_file.is_some() => TlsMode::VerifyCa,
        mode => mode,
    }
}

pub(crate) use crate::dsn::check_verify_ca;

/// Whether `host` is this machine: a Unix socket directory, `localhost`, or a loopback
/// address. Traffic to it never crosses a network, so an unverified connection is no risk.
pub(crate) fn is_local_host(host: &str) -> bool {
    let h = host.trim_start_matches('[').trim_end_matches(']');
    h.starts_with('/')
        || h.eq_ignore_ascii_case("localhost")
        || h.parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// The start-up warning for a database connection whose server is not verified (sslmode
/// disable, prefer or require without a CA) to a host across a network; `None` when verified
/// or local. `what` names the connection, e.g. `--source (Postgres)`.
pub(crate) fn unverified_warning(what: &str, host: &str, settings: &TlsSettings) -> Option<String> {
    if is_local_host(host) {
        return None;
    }
    let how = match effective_mode(settings) {
        TlsMode::VerifyCa | TlsMode::VerifyFull => return None,
        TlsMode::Disable => "sends the password and every event in clear",
        TlsMode::Prefer => {
            "falls back to plaintext when the server offers no TLS, and checks no certificate"
        }
        TlsMode::Require => "checks no certificate: anyone on the path can impersonate the server",
    };
    Some(format!(
        "{what} to {host} is not verified: its TLS mode {how}; for production use sslmode=verify-full with sslrootcert (ssl-mode=VERIFY_IDENTITY with ssl-ca for MySQL), see docs/operations.md, Production TLS"
    ))
}

/// The same warning for an `amqp://` sink (no TLS at all) to a host across a network.
pub fn plaintext_amqp_warning(url: &str) -> Option<String> {
    let parsed = url::Url::parse(url).ok()?;
    let secure = match parsed.scheme() {
        "amqp" => "amqps://",
        "nats" => "tls://",
        _ => return None,
    };
    let host = parsed.host_str().unwrap_or("localhost");
    if is_local_host(host) {
        return None;
    }
    Some(format!(
        "the sink {scheme}://{host} is not encrypted: the broker password and every event cross the network in clear; for production use {secure} (with --sink-ca for a private CA), see docs/operations.md, Production TLS",
        scheme = parsed.scheme()
    ))
}

/// Logs the source's start-up TLS warning, if it has one.
pub fn warn_if_unverified_source(source: &crate::dsn::SourceDsn) {
    let (what, dsn) = match source {
        crate::dsn::SourceDsn::Postgres(d) => ("the Postgres source (SQL and replication)", d),
        crate::dsn::SourceDsn::Mysql(d) => ("the MySQL source", d),
        crate::dsn::SourceDsn::File(_) => return,
    };
    if let Some(w) = unverified_warning(what, &dsn.host, &dsn.tls) {
        tracing::warn!("{w}");
    }
}

/// The rustls configuration for `settings`; `None` when TLS is disabled.
pub fn client_config(settings: &TlsSettings) -> Result<Option<ClientConfig>, Error> {
    if settings.mode == TlsMode::Disable {
        return Ok(None);
    }
    check_verify_ca(settings, "sslrootcert")?;
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?;
    let builder = match effective_mode(settings) {
        TlsMode::VerifyFull => builder.with_root_certificates(roots(settings)?),
        TlsMode::VerifyCa => {
            let inner = WebPkiServerVerifier::builder_with_provider(
                Arc::new(roots(settings)?),
                provider.clone(),
            )
            .build()
            .map_err(tls_err)?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly(inner)))
        }
        // prefer/require: encryption without verification, as libpq does.
        _ => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider))),
    };
    let config = match (&settings.cert_file, &settings.key_file) {
        (Some(cert), Some(key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(tls_err)?,
        (None, None) => builder.with_no_client_auth(),
        _ => {
            return Err(tls_err(
                "a client certificate needs both sslcert and sslkey",
            ))
        }
    };
    Ok(Some(config))
}

/// The rustls error inside `err` or its causes: TLS handshake failures arrive as an
/// `io::Error` wrapping it (tokio-rustls), which `source()` alone skips over.
pub(crate) fn rustls_cause<'a>(
    err: &'a (dyn std::error::Error + 'static),
) -> Option<&'a rustls::Error> {
    let mut cur = Some(err);
    while let Some(e) = cur {
        if let Some(r) = e.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        if let Some(inner) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            if let Some(r) = inner.downcast_ref::<rustls::Error>() {
                return Some(r);
            }
        }
        cur = e.source();
    }
    None
}

/// A TLS handshake that failed on a certificate or a protocol disagreement: the settings are
/// wrong (exit status 2), retrying cannot help. `what` names the connection, e.g.
/// `Postgres localhost:5432`. (Only the Postgres clients need it: mysql_async reports its own
/// handshake errors.)
#[cfg(any(feature = "postgres", test))]
pub(crate) fn handshake_refused(what: &str, settings: &TlsSettings, err: &rustls::Error) -> Error {
    let mode = match effective_mode(settings) {
        TlsMode::Disable => "disable",
        TlsMode::Prefer => "prefer",
        TlsMode::Require => "require",
        TlsMode::VerifyCa => "verify-ca",
        TlsMode::VerifyFull => "verify-full",
    };
    let ca = settings.ca_file.as_deref().map_or_else(
        || "the Mozilla roots (no sslrootcert)".to_string(),
        |c| c.to_string(),
    );
    let fix = match err {
        rustls::Error::InvalidCertificate(
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
        ) => {
            "connect with a host name the server certificate lists \
             (or use sslmode=verify-ca, which checks the chain only)"
        }
        rustls::Error::InvalidCertificate(
            CertificateError::UnknownIssuer | CertificateError::BadSignature,
        ) => "set sslrootcert to the CA certificate (PEM) that signed the server certificate",
        rustls::Error::InvalidCertificate(_) => {
            "the server certificate is not usable (expired, not yet valid, \
             or not a server certificate): renew it"
        }
        _ => "check sslmode, sslrootcert, sslcert and sslkey in the DSN against the server's TLS setup",
    };
    Error::config(
        format!("TLS handshake with {what} failed (sslmode={mode}, trusting {ca}): {err}"),
        fix,
    )
}

/// verify-ca: the chain must lead to a trusted CA; the host name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// require: any certificate, but the handshake signatures are still checked.
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(mode: TlsMode, ca: Option<&str>) -> TlsSettings {
        TlsSettings {
            mode,
            ca_file: ca.map(str::to_string),
            ..Default::default()
        }
    }

    #[test]
    fn require_with_a_ca_file_verifies_the_chain_as_libpq_does() {
        assert_eq!(
            effective_mode(&settings(TlsMode::Require, Some("/ca.pem"))),
            TlsMode::VerifyCa
        );
        assert_eq!(
            effective_mode(&settings(TlsMode::Require, None)),
            TlsMode::Require
        );
        assert_eq!(
            effective_mode(&settings(TlsMode::VerifyFull, Some("/ca.pem"))),
            TlsMode::VerifyFull
        );
        assert_eq!(
            effective_mode(&settings(TlsMode::Prefer, Some("/ca.pem"))),
            TlsMode::Prefer
        );
    }

    #[test]
    fn configs_and_their_errors() {
        assert!(client_config(&settings(TlsMode::Disable, None))
            .unwrap()
            .is_none());
        for mode in [TlsMode::Prefer, TlsMode::Require, TlsMode::VerifyFull] {
            assert!(client_config(&settings(mode, None)).unwrap().is_some());
        }
        let err = client_config(&settings(TlsMode::VerifyCa, None))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("verify-ca") && err.contains("fix: add sslrootcert="),
            "{err}"
        );
        let err = client_config(&settings(TlsMode::VerifyFull, Some("/nonexistent/ca.pem")))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("TLS") && err.contains("/nonexistent/ca.pem"),
            "{err}"
        );
        let half = TlsSettings {
            mode: TlsMode::Require,
            cert_file: Some("/client.pem".into()),
            ..Default::default()
        };
        assert!(client_config(&half)
            .unwrap_err()
            .to_string()
            .contains("both sslcert and sslkey"));
    }

    #[test]
    fn unverified_remote_connections_are_warned_about_local_ones_not() {
        for local in [
            "localhost",
            "127.0.0.1",
            "127.0.0.2",
            "::1",
            "[::1]",
            "/var/run/postgresql",
        ] {
            assert!(is_local_host(local), "{local}");
            assert!(unverified_warning("x", local, &settings(TlsMode::Disable, None)).is_none());
        }
        for remote in ["db.example", "10.0.0.5", "2001:db8::1", "localhost.example"] {
            assert!(!is_local_host(remote), "{remote}");
        }
        let w = |mode, ca: Option<&str>| {
            unverified_warning("the source", "db.example", &settings(mode, ca))
        };
        for mode in [TlsMode::Disable, TlsMode::Prefer, TlsMode::Require] {
            let text = w(mode, None).expect("warned");
            assert!(
                text.contains("db.example") && text.contains("verify-full"),
                "{text}"
            );
        }
        assert!(w(TlsMode::VerifyFull, None).is_none());
        assert!(w(TlsMode::VerifyCa, Some("/ca.pem")).is_none());
        // libpq's require with a CA file verifies the chain.
        assert!(w(TlsMode::Require, Some("/ca.pem")).is_none());
        assert!(w(TlsMode::Prefer, Some("/ca.pem")).is_some());

        assert!(
            plaintext_amqp_warning("amqp://u:pw@broker.example:5672/%2f")
                .is_some_and(|t| t.contains("broker.example") && !t.contains("pw"))
        );
        assert!(plaintext_amqp_warning("amqp://u:pw@127.0.0.1:5672/%2f").is_none());
        assert!(plaintext_amqp_warning("amqp://localhost").is_none());
        assert!(plaintext_amqp_warning("amqps://broker.example:5671/%2f").is_none());
        assert!(plaintext_amqp_warning("stdout").is_none());
    }

    #[test]
    fn handshake_failures_are_found_inside_io_errors_and_explained() {
        let inner = rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer);
        let io = std::io::Error::new(std::io::ErrorKind::InvalidData, inner);
        #[derive(Debug, thiserror::Error)]
        #[error("connect failed")]
        struct Outer(#[source] std::io::Error);
        let outer = Outer(io);
        let found = rustls_cause(&outer).expect("found through the io::Error");
        assert!(matches!(
            found,
            rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)
        ));
        assert!(rustls_cause(&std::io::Error::other("reset")).is_none());

        let err = handshake_refused(
            "Postgres db:5432",
            &settings(TlsMode::Require, Some("/etc/ca.pem")),
            found,
        );
        assert_eq!(err.exit_status(), crate::ExitStatus::Config);
        assert!(!err.is_retryable());
        let text = err.to_string();
        assert!(
            text.contains("TLS handshake with Postgres db:5432 failed")
                && text.contains("sslmode=verify-ca")
                && text.contains("/etc/ca.pem")
                && text.contains("fix: set sslrootcert"),
            "{text}"
        );
        let name = rustls::Error::InvalidCertificate(CertificateError::NotValidForName);
        assert!(
            handshake_refused("x", &settings(TlsMode::VerifyFull, None), &name)
                .to_string()
                .contains("verify-ca")
        );
    }
}
