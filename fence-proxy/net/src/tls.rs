//! Certificates and rustls configurations of fence-proxy: its listeners (server side) and its
//! connections to upstreams and stores (client side).
//!
//! Only the files the operator names are trusted: no platform or bundled root store is read,
//! so an upstream's certificate must chain to `--upstream-ca` or the URL's `sslrootcert`.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, ServerConfig,
    SignatureScheme,
};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};

/// The one crypto provider fence-proxy uses: ring, as lockd does.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Every certificate of a PEM file, in order (leaf first for a chain). Fails, naming the file,
/// when it cannot be read or holds no certificate.
pub fn load_certs(path: &Path) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    let certs = CertificateDer::pem_file_iter(path)
        .with_context(|| format!("reading certificates from {}", path.display()))?
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("reading certificates from {}", path.display()))?;
    anyhow::ensure!(
        !certs.is_empty(),
        "{} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        path.display()
    );
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> anyhow::Result<PrivateKeyDer<'static>> {
    PrivateKeyDer::from_pem_file(path)
        .with_context(|| format!("reading a PEM private key from {}", path.display()))
}

/// A root store holding every certificate of the PEM file `path`.
pub fn load_roots(path: &Path) -> anyhow::Result<RootCertStore> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(path)? {
        roots
            .add(cert)
            .with_context(|| format!("{}: not a usable CA certificate", path.display()))?;
    }
    Ok(roots)
}

/// The listener's configuration: this certificate chain and key, and, with `client_ca`, a
/// client certificate issued by that CA required of every client. `alpn` lists the application
/// protocols offered (empty for none).
pub fn server_config(
    cert: &Path,
    key: &Path,
    client_ca: Option<&Path>,
    alpn: &[&[u8]],
) -> anyhow::Result<Arc<ServerConfig>> {
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("choosing TLS versions")?;
    let builder = match client_ca {
        Some(ca) => {
            let roots = Arc::new(load_roots(ca)?);
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
                .build()
                .with_context(|| format!("client CA {}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .with_context(|| {
            format!(
                "certificate {} with key {} (does the key belong to the certificate?)",
                cert.display(),
                key.display()
            )
        })?;
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// How much of a server's certificate the client side checks, after libpq's `sslmode`.
#[derive(Clone, Debug)]
pub enum ServerCheck {
    /// `require` without a root certificate: encrypt, but accept any certificate. Protects
    /// against eavesdropping only, not against an active man in the middle.
    EncryptOnly,
    /// `verify-ca`: the certificate must chain to these roots; its names are not checked.
    Chain(Arc<RootCertStore>),
    /// `verify-full`: chain to these roots and name the host dialled (DNS name or IP address).
    Full(Arc<RootCertStore>),
}

/// The client configuration for `check`, offering `alpn` (empty for none).
pub fn client_config(check: &ServerCheck, alpn: &[&[u8]]) -> anyhow::Result<Arc<ClientConfig>> {
    let provider = provider();
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .context("choosing TLS versions")?;
    let mut config = match check {
        ServerCheck::Full(roots) => builder
            .with_root_certificates(roots.clone())
            .with_no_client_auth(),
        ServerCheck::Chain(roots) => {
            let inner = WebPkiServerVerifier::builder_with_provider(roots.clone(), provider)
                .build()
                .context("building the certificate verifier")?;
            builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(ChainOnly { inner }))
                .with_no_client_auth()
        }
        ServerCheck::EncryptOnly => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate { provider }))
            .with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
    Ok(Arc::new(config))
}

/// The TLS server name for `host`: an IP address when it parses as one, else a DNS name.
pub fn server_name(host: &str) -> anyhow::Result<ServerName<'static>> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_owned())
        .map_err(|e| anyhow::anyhow!("{host:?} is not a valid TLS server name: {e}"))
}

/// `verify-ca`: the full webpki check (chain, validity, usage), except that a certificate which
/// does not name the host is accepted, as libpq does for this mode.
#[derive(Debug)]
struct ChainOnly {
    inner: Arc<WebPkiServerVerifier>,
}

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        // webpki checks the name only after the chain, so this error means the chain is good.
        match self.inner.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
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
        self.inner.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.inner.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.inner.supported_verify_schemes()
    }
}

/// `require`: any certificate, but the handshake signatures are still checked, so the session
/// keys belong to whoever holds that certificate's key.
#[derive(Debug)]
struct AnyCertificate {
    provider: Arc<CryptoProvider>,
}

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
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
            &self.provider.signature_verification_algorithms,
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
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
