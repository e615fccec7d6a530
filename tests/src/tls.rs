//! Throwaway certificate authorities and certificates for the TLS tests, written as PEM files.
//!
//! A node certificate names `node-<id>.<cluster>.lockd` (what peers check) and the loopback IP
//! clients dial, and is good for both server and client authentication, as lockd's docs ask.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};

/// A certificate authority whose certificate is in `<dir>/<name>-ca.pem`.
pub struct TestCa {
    pub name: String,
    pub cert_path: PathBuf,
    issuer: CertifiedIssuer<'static, KeyPair>,
    dir: PathBuf,
}

/// The files of one issued certificate.
#[derive(Clone, Debug)]
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl TestCa {
    /// A new CA named `name`, its certificate written to `dir`.
    pub fn new(dir: &Path, name: &str) -> anyhow::Result<TestCa> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("lockd test {name} CA"));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        let cert_path = dir.join(format!("{name}-ca.pem"));
        std::fs::write(&cert_path, issuer.pem())?;
        Ok(TestCa {
            name: name.to_owned(),
            cert_path,
            issuer,
            dir: dir.to_path_buf(),
        })
    }

    /// Issues a certificate for `dns` names and `ips`, good for server and client
    /// authentication, written as `<dir>/<file>.pem` and `<dir>/<file>-key.pem`.
    pub fn issue(&self, file: &str, dns: &[String], ips: &[IpAddr]) -> anyhow::Result<Issued> {
        let mut params = CertificateParams::new(dns.to_vec())?;
        for ip in ips {
            params.subject_alt_names.push(SanType::IpAddress(*ip));
        }
        params
            .distinguished_name
            .push(DnType::CommonName, format!("{file} ({})", self.name));
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        let issued = Issued {
            cert: self.dir.join(format!("{file}.pem")),
            key: self.dir.join(format!("{file}-key.pem")),
        };
        std::fs::write(&issued.cert, cert.pem())?;
        std::fs::write(&issued.key, key.serialize_pem())?;
        Ok(issued)
    }

    /// A node certificate of `cluster` for node `id`, also naming `ip`.
    pub fn issue_node(&self, cluster: &str, id: u64, ip: IpAddr) -> anyhow::Result<Issued> {
        self.issue(
            &format!("{}-node{id}", self.name),
            &[format!("node-{id}.{cluster}.lockd")],
            &[ip],
        )
    }
}
