//! TLS client configuration shared by the database and broker clients: the libpq `sslmode`
//! levels (require = encrypt only, verify-ca = trusted chain, verify-full = chain and host
//! name), a CA file or the Mozilla roots, and an optional client certificate.

use crate::dsn::{TlsMode, TlsSettings};
use crate::Error;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
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

pub fn load_certs(path: &str) -> Result<Vec<CertificateDer<'static>>, Error> {
    let data = std::fs::read(path).map_err(|e| tls_err(format!("cannot read {path}: {e}")))?;
    let certs: Vec<_> = rustls_pemfile::certs(&mut data.as_slice())
        .collect::<Result<_, _>>()
        .map_err(|e| tls_err(format!("{path}: {e}")))?;
    if certs.is_empty() {
        return Err(tls_err(format!("{path} holds no PEM certificate")));
    }
    Ok(certs)
}

fn load_key(path: &str) -> Result<PrivateKeyDer<'static>, Error> {
    let data = std::fs::read(path).map_err(|e| tls_err(format!("cannot read {path}: {e}")))?;
    rustls_pemfile::private_key(&mut data.as_slice())
        .map_err(|e| tls_err(format!("{path}: {e}")))?
        .ok_or_else(|| tls_err(format!("{path} holds no PEM private key")))
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

/// The rustls configuration for `settings`; `None` when TLS is disabled.
pub fn client_config(settings: &TlsSettings) -> Result<Option<ClientConfig>, Error> {
    if settings.mode == TlsMode::Disable {
        return Ok(None);
    }
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(tls_err)?;
    let builder = match settings.mode {
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
