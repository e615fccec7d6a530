//! TLS configurations that are read again from their files on demand (fence-proxy reloads them
//! on SIGHUP), so certificates rotate without a restart and without dropping a connection.
//!
//! Each configuration is an `RwLock<Arc<..>>`: a new handshake takes the `Arc` current at that
//! moment, a connection already established keeps the configuration it was made with, and a
//! reload swaps the `Arc`. A rustls `ResolvesServerCert` alone would not do, since the client CA
//! (`--tls-client-ca`) and the upstream roots change too, and they live elsewhere in the config.
//!
//! A [`TlsReloader`] reloads every configuration a front end registered, all or nothing: the new
//! files are all read and checked first, and only if every one passes are they swapped in. A
//! rotation that replaces a certificate and the CA that clients check it against therefore never
//! serves half of it, and a bad file changes nothing.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use rustls::{ClientConfig, ServerConfig};
use tokio_rustls::TlsAcceptor;

use crate::tls::{ServerCheck, client_config, load_roots, server_config};

/// The files of a listener's TLS configuration, as given on the command line.
#[derive(Clone, Debug)]
pub struct ServerTlsFiles {
    /// PEM certificate chain, leaf first (`--tls-cert`).
    pub cert: PathBuf,
    /// PEM private key of `cert` (`--tls-key`).
    pub key: PathBuf,
    /// PEM CA that must have issued every client's certificate (`--tls-client-ca`); `None` asks
    /// for no client certificate.
    pub client_ca: Option<PathBuf>,
    /// Application protocols offered by ALPN, in order of preference (empty for none).
    pub alpn: Vec<Vec<u8>>,
}

impl ServerTlsFiles {
    fn build(&self) -> anyhow::Result<Arc<ServerConfig>> {
        let alpn: Vec<&[u8]> = self.alpn.iter().map(Vec::as_slice).collect();
        server_config(&self.cert, &self.key, self.client_ca.as_deref(), &alpn)
    }

    fn paths(&self) -> Vec<PathBuf> {
        let mut paths = vec![self.cert.clone(), self.key.clone()];
        paths.extend(self.client_ca.clone());
        paths
    }
}

/// A listener's TLS configuration, rebuilt from its files by [`TlsReloader::reload`].
pub struct ReloadableServerConfig {
    files: ServerTlsFiles,
    /// What new handshakes use; replaced whole on reload (connections keep their own `Arc`).
    current: RwLock<Arc<ServerConfig>>,
}

impl std::fmt::Debug for ReloadableServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadableServerConfig")
            .field("files", &self.files)
            .finish_non_exhaustive()
    }
}

impl ReloadableServerConfig {
    /// Reads the files; fails, naming the bad file, as [`server_config`] does.
    pub fn load(files: ServerTlsFiles) -> anyhow::Result<Arc<ReloadableServerConfig>> {
        let current = files.build()?;
        Ok(Arc::new(ReloadableServerConfig {
            files,
            current: RwLock::new(current),
        }))
    }

    /// The configuration a handshake starting now uses.
    pub fn current(&self) -> Arc<ServerConfig> {
        // A poisoned lock still holds a complete configuration: the swap is one assignment.
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// An acceptor for one new connection, with the configuration current now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current())
    }

    /// The files the configuration is read from.
    pub fn files(&self) -> &ServerTlsFiles {
        &self.files
    }

    fn install(&self, fresh: Arc<ServerConfig>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = fresh;
    }
}

/// How an upstream's certificate is checked, with the file its roots come from: a
/// [`ServerCheck`] that can be built again after the file changed.
#[derive(Clone, Debug)]
pub enum ServerCheckFiles {
    /// Any certificate (libpq's `require` without a root); there is no file to reload.
    EncryptOnly,
    /// The chain must lead to a CA of this PEM file (`verify-ca`).
    Chain(PathBuf),
    /// The chain must lead to a CA of this PEM file and name the host (`verify-full`).
    Full(PathBuf),
}

impl ServerCheckFiles {
    fn check(&self) -> anyhow::Result<ServerCheck> {
        Ok(match self {
            ServerCheckFiles::EncryptOnly => ServerCheck::EncryptOnly,
            ServerCheckFiles::Chain(path) => ServerCheck::Chain(Arc::new(load_roots(path)?)),
            ServerCheckFiles::Full(path) => ServerCheck::Full(Arc::new(load_roots(path)?)),
        })
    }

    /// The roots file, if the check has one.
    pub fn path(&self) -> Option<&Path> {
        match self {
            ServerCheckFiles::EncryptOnly => None,
            ServerCheckFiles::Chain(p) | ServerCheckFiles::Full(p) => Some(p),
        }
    }
}

/// The TLS configuration of connections to an upstream, rebuilt from its roots file by
/// [`TlsReloader::reload`].
pub struct ReloadableClientConfig {
    check: ServerCheckFiles,
    alpn: Vec<Vec<u8>>,
    /// The flag or URL parameter the roots come from (`--upstream-ca`, `--upstream sslrootcert`),
    /// for error messages.
    what: String,
    /// What new connections use; replaced whole on reload.
    current: RwLock<Arc<ClientConfig>>,
}

impl std::fmt::Debug for ReloadableClientConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadableClientConfig")
            .field("check", &self.check)
            .field("what", &self.what)
            .finish_non_exhaustive()
    }
}

impl ReloadableClientConfig {
    /// Reads the roots file (if any); `what` names where it was configured, for errors.
    pub fn load(
        check: ServerCheckFiles,
        alpn: &[&[u8]],
        what: &str,
    ) -> anyhow::Result<Arc<ReloadableClientConfig>> {
        let alpn: Vec<Vec<u8>> = alpn.iter().map(|p| p.to_vec()).collect();
        let current = Self::build(&check, &alpn, what)?;
        Ok(Arc::new(ReloadableClientConfig {
            check,
            alpn,
            what: what.to_owned(),
            current: RwLock::new(current),
        }))
    }

    fn build(
        check: &ServerCheckFiles,
        alpn: &[Vec<u8>],
        what: &str,
    ) -> anyhow::Result<Arc<ClientConfig>> {
        let alpn: Vec<&[u8]> = alpn.iter().map(Vec::as_slice).collect();
        let server_check = check
            .check()
            .map_err(|e| anyhow::anyhow!("{what}: {e:#}"))?;
        client_config(&server_check, &alpn)
    }

    /// The configuration a connection opened now uses.
    pub fn current(&self) -> Arc<ClientConfig> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// How the upstream's certificate is checked (the roots file, if any).
    pub fn check(&self) -> &ServerCheckFiles {
        &self.check
    }

    fn install(&self, fresh: Arc<ClientConfig>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = fresh;
    }
}

/// One registered configuration.
enum Reloadable {
    Server(Arc<ReloadableServerConfig>),
    Client(Arc<ReloadableClientConfig>),
}

/// A configuration read again but not yet in use.
enum Staged {
    Server(Arc<ReloadableServerConfig>, Arc<ServerConfig>),
    Client(Arc<ReloadableClientConfig>, Arc<ClientConfig>),
}

/// What [`TlsReloader::reload`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReloadOutcome {
    /// No TLS file is configured: nothing was read.
    Nothing,
    /// Every file was read again and is now in use by new connections.
    Reloaded {
        /// 1 after the first successful reload, counting up (0 is the set read at start).
        generation: u64,
        /// The files read, for the log.
        files: Vec<PathBuf>,
    },
}

#[derive(Default)]
struct ReloaderState {
    items: Vec<Reloadable>,
    /// Successful reloads so far.
    generation: u64,
}

/// Every reloadable TLS configuration of one process. Clones share the same set: the binary
/// keeps one for its SIGHUP handler and hands one to the front end, which registers what it
/// built.
#[derive(Clone, Default)]
pub struct TlsReloader {
    state: Arc<Mutex<ReloaderState>>,
}

impl TlsReloader {
    /// An empty set, which nothing has registered with yet.
    pub fn new() -> TlsReloader {
        TlsReloader::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, ReloaderState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reloads `config` with the others from now on.
    pub fn add_server(&self, config: &Arc<ReloadableServerConfig>) {
        self.lock().items.push(Reloadable::Server(config.clone()));
    }

    /// Reloads `config` with the others from now on; a check without a file (`EncryptOnly`)
    /// has nothing to reload and is not kept.
    pub fn add_client(&self, config: &Arc<ReloadableClientConfig>) {
        if config.check.path().is_some() {
            self.lock().items.push(Reloadable::Client(config.clone()));
        }
    }

    /// Successful reloads so far (0: the files read at start are in use).
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    /// Every file registered, in registration order.
    pub fn files(&self) -> Vec<PathBuf> {
        self.lock()
            .items
            .iter()
            .flat_map(Reloadable::paths)
            .collect()
    }

    /// Reads every registered file again. If all of them load and pass the checks made at start,
    /// new connections use them from now on and the generation goes up by one; otherwise nothing
    /// changes and the error names the file that failed. Connections already established are
    /// never touched. Reads files: call it off the async worker threads.
    pub fn reload(&self) -> anyhow::Result<ReloadOutcome> {
        // Held throughout, so that two reloads (two quick SIGHUPs) do not interleave.
        let mut state = self.lock();
        if state.items.is_empty() {
            return Ok(ReloadOutcome::Nothing);
        }
        let mut staged = Vec::with_capacity(state.items.len());
        for item in &state.items {
            staged.push(match item {
                Reloadable::Server(c) => Staged::Server(c.clone(), c.files.build()?),
                Reloadable::Client(c) => Staged::Client(
                    c.clone(),
                    ReloadableClientConfig::build(&c.check, &c.alpn, &c.what)?,
                ),
            });
        }
        for s in staged {
            match s {
                Staged::Server(c, fresh) => c.install(fresh),
                Staged::Client(c, fresh) => c.install(fresh),
            }
        }
        state.generation += 1;
        Ok(ReloadOutcome::Reloaded {
            generation: state.generation,
            files: state.items.iter().flat_map(Reloadable::paths).collect(),
        })
    }
}

impl Reloadable {
    fn paths(&self) -> Vec<PathBuf> {
        match self {
            Reloadable::Server(c) => c.files.paths(),
            Reloadable::Client(c) => c.check.path().map(Path::to_path_buf).into_iter().collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose,
    };

    /// A new CA and a leaf for `localhost` it issued: (CA PEM, leaf PEM, leaf key PEM).
    fn ca_and_leaf() -> (String, String, String) {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        let key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&key, &ca)
            .unwrap();
        (ca.pem(), leaf.pem(), key.serialize_pem())
    }

    /// A handshake in memory between `server` and a client that trusts only `roots_pem` and
    /// dials `localhost`; the client's error when it refuses the server.
    fn handshake(server: Arc<ServerConfig>, roots_pem: &str) -> Result<(), rustls::Error> {
        use rustls_pki_types::pem::PemObject;
        let mut roots = rustls::RootCertStore::empty();
        for c in rustls_pki_types::CertificateDer::pem_slice_iter(roots_pem.as_bytes()) {
            roots.add(c.unwrap()).unwrap();
        }
        let client = client_config(&ServerCheck::Full(Arc::new(roots)), &[]).unwrap();
        let name = rustls_pki_types::ServerName::try_from("localhost").unwrap();
        let mut c = rustls::ClientConnection::new(client, name).unwrap();
        let mut s = rustls::ServerConnection::new(server).unwrap();
        for _ in 0..10 {
            let mut flight = Vec::new();
            while c.wants_write() {
                c.write_tls(&mut flight).unwrap();
            }
            let mut rd = &flight[..];
            while !rd.is_empty() {
                s.read_tls(&mut rd).unwrap();
                s.process_new_packets()?;
            }
            let mut flight = Vec::new();
            while s.wants_write() {
                s.write_tls(&mut flight).unwrap();
            }
            let mut rd = &flight[..];
            while !rd.is_empty() {
                c.read_tls(&mut rd).unwrap();
                c.process_new_packets()?;
            }
            if !c.is_handshaking() && !s.is_handshaking() {
                return Ok(());
            }
        }
        panic!("the handshake did not finish in 10 flights");
    }

    /// A reload swaps in new files for new handshakes; a bad file set is refused whole, names
    /// the file, and leaves both configurations as they were; a reload with nothing registered
    /// reads nothing.
    #[test]
    fn reload_is_all_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key, ca) = (
            dir.path().join("c.pem"),
            dir.path().join("k.pem"),
            dir.path().join("ca.pem"),
        );
        let (ca1, leaf1, key1) = ca_and_leaf();
        std::fs::write(&cert, &leaf1).unwrap();
        std::fs::write(&key, &key1).unwrap();
        std::fs::write(&ca, &ca1).unwrap();

        let reloader = TlsReloader::new();
        assert_eq!(reloader.reload().unwrap(), ReloadOutcome::Nothing);
        let server = ReloadableServerConfig::load(ServerTlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            client_ca: None,
            alpn: vec![b"h2".to_vec()],
        })
        .unwrap();
        let client =
            ReloadableClientConfig::load(ServerCheckFiles::Full(ca.clone()), &[], "--upstream-ca")
                .unwrap();
        reloader.add_server(&server);
        reloader.add_client(&client);
        let encrypt_only =
            ReloadableClientConfig::load(ServerCheckFiles::EncryptOnly, &[], "x").unwrap();
        reloader.add_client(&encrypt_only);
        assert_eq!(
            reloader.files(),
            vec![cert.clone(), key.clone(), ca.clone()]
        );

        let before_server = server.current();
        let before_client = client.current();
        let (ca2, leaf2, key2) = ca_and_leaf();
        std::fs::write(&cert, &leaf2).unwrap();
        std::fs::write(&key, &key2).unwrap();
        std::fs::write(&ca, &ca2).unwrap();
        let outcome = reloader.reload().unwrap();
        assert!(
            matches!(outcome, ReloadOutcome::Reloaded { generation: 1, .. }),
            "{outcome:?}"
        );
        assert!(!Arc::ptr_eq(&before_server, &server.current()));
        assert!(!Arc::ptr_eq(&before_client, &client.current()));
        // New handshakes present the new certificate; the configuration an established
        // connection holds still presents the old one.
        handshake(server.current(), &ca2).unwrap();
        assert!(handshake(server.current(), &ca1).is_err());
        handshake(before_server.clone(), &ca1).unwrap();
        assert_eq!(server.current().alpn_protocols, vec![b"h2".to_vec()]);

        // A good certificate but a garbage roots file: neither configuration changes.
        let (_, leaf3, key3) = ca_and_leaf();
        std::fs::write(&cert, &leaf3).unwrap();
        std::fs::write(&key, &key3).unwrap();
        std::fs::write(&ca, "not a certificate").unwrap();
        let (s, c) = (server.current(), client.current());
        let e = format!("{:#}", reloader.reload().unwrap_err());
        assert!(
            e.contains(&ca.display().to_string()) && e.contains("--upstream-ca"),
            "{e}"
        );
        assert!(Arc::ptr_eq(&s, &server.current()));
        assert!(Arc::ptr_eq(&c, &client.current()));
        assert_eq!(reloader.generation(), 1);
        handshake(server.current(), &ca2).unwrap();

        // A key that is not the certificate's: refused, naming both files.
        std::fs::write(&ca, &ca2).unwrap();
        std::fs::write(&key, &key2).unwrap();
        let e = format!("{:#}", reloader.reload().unwrap_err());
        assert!(e.contains(&key.display().to_string()), "{e}");
        assert!(Arc::ptr_eq(&s, &server.current()));

        std::fs::write(&key, "garbage").unwrap();
        let e = format!("{:#}", reloader.reload().unwrap_err());
        assert!(e.contains(&key.display().to_string()), "{e}");
        assert_eq!(reloader.generation(), 1);
    }
}
