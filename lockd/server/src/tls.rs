//! Mutual TLS between nodes, and TLS for clients, on the node's one gRPC port.
//!
//! Replication and clients share the port (one port per node, docs/api.md "gRPC API"), so the
//! listener asks every caller for a certificate but does not require one: clients may come without.
//! A Raft message is accepted only from a caller whose certificate chains to the **peer CA** (not
//! merely to any CA the listener trusts for clients) and names the node the message claims to come
//! from: `node-<id>.<cluster-id>.lockd` as a DNS subject alternative name. So a client certificate,
//! a certificate of another cluster, or one node impersonating another gets UNAUTHENTICATED, and
//! the message never reaches openraft. The cluster id is also sent on every Raft message
//! (`CLUSTER_ID_HEADER`), so two clusters never mix even where TLS is off.
//!
//! A node's certificate serves three purposes: its server certificate on the port (so it must
//! also name the address clients dial: a DNS or IP SAN), its client certificate towards peers,
//! and its identity in forwarded client calls.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::{CertificateDer, ServerName, UnixTime};

use crate::raft::NodeId;

/// gRPC metadata carrying the sender's cluster id on every Raft message.
pub(crate) const CLUSTER_ID_HEADER: &str = "lockd-cluster-id";

/// The cluster id when `--cluster-id` is not given.
pub const DEFAULT_CLUSTER_ID: &str = "lockd";

/// The DNS name a node's certificate must carry: `node-<id>.<cluster_id>.lockd`.
pub(crate) fn node_name(id: NodeId, cluster_id: &str) -> String {
    format!("node-{id}.{cluster_id}.lockd")
}

/// Checks `--cluster-id`: it becomes a DNS label in certificate names.
pub(crate) fn validate_cluster_id(id: &str) -> Result<(), String> {
    let ok = !id.is_empty()
        && id.len() <= 63
        && id
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !id.starts_with('-')
        && !id.ends_with('-');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "--cluster-id {id:?} must be 1-63 characters of a-z, 0-9 and '-', not starting or \
             ending with '-' (it is part of the node certificates' DNS names)"
        ))
    }
}

/// The certificate files of `--tls-cert`, `--tls-key`, `--peer-ca` and `--tls-client-ca`.
#[derive(Clone, Debug)]
pub(crate) struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub peer_ca: PathBuf,
    pub client_ca: Option<PathBuf>,
}

/// A node's TLS material, loaded and checked at start and again on every SIGHUP.
pub(crate) struct NodeTls {
    cluster_id: String,
    /// This node's id: a certificate that names it besides the member it is checked for names
    /// several nodes, though the members checked against (the others) hold one of them only.
    own_id: NodeId,
    /// The listener's rustls configuration: this node's certificate, and a certificate asked of
    /// every caller, checked against the peer CA and the client CA but not required (clients may
    /// have none).
    server: Arc<rustls::ServerConfig>,
    /// The metrics listener's: the same certificate, HTTP/1.1, no client certificate asked.
    metrics: Arc<rustls::ServerConfig>,
    /// Towards peers: the peer CA as roots, this node's certificate as client identity.
    client: Arc<rustls::ClientConfig>,
    /// The peer CA as a webpki trust anchor, for the check of every Raft caller.
    peer_anchors: Vec<rustls_pki_types::TrustAnchor<'static>>,
    /// `--tls-client-ca` as trust anchors, for client identities (`auth`); empty without it.
    client_anchors: Vec<rustls_pki_types::TrustAnchor<'static>>,
}

fn read(path: &Path, flag: &str) -> anyhow::Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| anyhow::anyhow!("{flag} {}: {e}", path.display()))
}

fn certs_in(pem: &[u8], what: &str) -> anyhow::Result<Vec<CertificateDer<'static>>> {
    use rustls_pki_types::pem::PemObject;
    let certs: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| anyhow::anyhow!("{what}: not PEM certificates: {e}"))?;
    if certs.is_empty() {
        anyhow::bail!("{what}: no certificate in it");
    }
    Ok(certs)
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn roots(certs: &[CertificateDer<'static>], what: &str) -> anyhow::Result<rustls::RootCertStore> {
    let mut roots = rustls::RootCertStore::empty();
    for c in certs {
        roots
            .add(c.clone())
            .map_err(|e| anyhow::anyhow!("{what}: not a CA certificate: {e}"))?;
    }
    Ok(roots)
}

impl NodeTls {
    /// Loads the files and checks that this node's own certificate passes the check its peers
    /// will make, so a wrong certificate fails at start (or a reload fails) with a clear error.
    pub fn load(files: &TlsFiles, id: NodeId, cluster_id: &str) -> anyhow::Result<Arc<NodeTls>> {
        use rustls_pki_types::PrivateKeyDer;
        use rustls_pki_types::pem::PemObject;
        let cert_what = format!("--tls-cert {}", files.cert.display());
        let key_what = format!("--tls-key {}", files.key.display());
        let peer_what = format!("--peer-ca {}", files.peer_ca.display());
        let own = certs_in(&read(&files.cert, "--tls-cert")?, &cert_what)?;
        let key = PrivateKeyDer::from_pem_slice(&read(&files.key, "--tls-key")?)
            .map_err(|e| anyhow::anyhow!("{key_what}: no PEM private key in it: {e}"))?;
        let peer_ca = certs_in(&read(&files.peer_ca, "--peer-ca")?, &peer_what)?;
        let client_ca = match &files.client_ca {
            Some(p) => certs_in(
                &read(p, "--tls-client-ca")?,
                &format!("--tls-client-ca {}", p.display()),
            )?,
            None => Vec::new(),
        };
        let peer_anchors = peer_ca
            .iter()
            .map(|c| {
                webpki::anchor_from_trusted_cert(c)
                    .map(|a| a.to_owned())
                    .map_err(|e| anyhow::anyhow!("{peer_what}: not a CA certificate: {e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        let client_anchors = client_ca
            .iter()
            .map(|c| {
                webpki::anchor_from_trusted_cert(c)
                    .map(|a| a.to_owned())
                    .map_err(|e| anyhow::anyhow!("--tls-client-ca: not a CA certificate: {e}"))
            })
            .collect::<anyhow::Result<Vec<_>>>()?;

        // A client CA that is also the peer CA would let every client certificate stand next to
        // the node certificates; the two roles need two CAs. The same CA re-issued (renewed
        // validity, same key) has other bytes but is the same authority: compared by public key.
        for c in &client_ca {
            for p in &peer_ca {
                if let Some(subject) = same_authority(c, p) {
                    anyhow::bail!(
                        "--tls-client-ca and {peer_what} share a CA ({subject}, the same public \
                         key in both files): a client certificate of it could pass for a node; \
                         use a CA of its own for client certificates"
                    );
                }
            }
        }
        let mut callers = roots(&peer_ca, &peer_what)?;
        for c in &client_ca {
            callers
                .add(c.clone())
                .map_err(|e| anyhow::anyhow!("--tls-client-ca: not a CA certificate: {e}"))?;
        }
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(callers.into(), provider())
                .allow_unauthenticated()
                .build()
                .map_err(|e| anyhow::anyhow!("{peer_what}: {e}"))?;
        let mut server = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_client_cert_verifier(verifier)
            .with_single_cert(own.clone(), key.clone_key())
            .map_err(|e| anyhow::anyhow!("{cert_what} with {key_what}: {e}"))?;
        // gRPC is HTTP/2; clients that use ALPN (most) must be offered h2.
        server.alpn_protocols = vec![b"h2".to_vec()];
        let mut metrics = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(own.clone(), key.clone_key())
            .map_err(|e| anyhow::anyhow!("{cert_what} with {key_what}: {e}"))?;
        metrics.alpn_protocols = vec![b"http/1.1".to_vec()];
        let mut client = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots(&peer_ca, &peer_what)?)
            .with_client_auth_cert(own.clone(), key)
            .map_err(|e| anyhow::anyhow!("{cert_what} with {key_what}: {e}"))?;
        client.alpn_protocols = vec![b"h2".to_vec()];

        let tls = NodeTls {
            cluster_id: cluster_id.to_owned(),
            own_id: id,
            server: Arc::new(server),
            metrics: Arc::new(metrics),
            client: Arc::new(client),
            peer_anchors,
            client_anchors,
        };
        tls.verify_own(&own, id)
            .map_err(|e| anyhow::anyhow!("{cert_what}: its own peers would refuse it: {e}"))?;
        Ok(Arc::new(tls))
    }

    /// `--tls-client-ca` as trust anchors (empty without it).
    pub fn client_anchors(&self) -> &[rustls_pki_types::TrustAnchor<'static>] {
        &self.client_anchors
    }

    /// The gRPC port's TLS configuration.
    pub fn grpc_server(&self) -> Arc<rustls::ServerConfig> {
        self.server.clone()
    }

    /// The metrics listener's TLS configuration.
    pub fn metrics_server(&self) -> Arc<rustls::ServerConfig> {
        self.metrics.clone()
    }

    /// The member that `chain` (leaf first, as the caller presented it) authenticates: the
    /// leaf must be issued directly by the peer CA (intermediates the caller sends are not
    /// trusted), be valid now for client authentication, and name exactly one of `members` as
    /// `node-<id>.<cluster-id>.lockd` and no other node: a wildcard, whatever it matches, or a
    /// certificate naming several nodes (among `members` and this node, which callers leave out
    /// of `members`) is refused. The chain is checked once, whatever the number of members. The
    /// error says which part failed, for the server's log.
    pub fn identify_member(
        &self,
        chain: &[CertificateDer<'static>],
        members: &[NodeId],
    ) -> Result<NodeId, String> {
        let cert = self.verify_chain(chain, webpki::KeyUsage::client_auth())?;
        // A name no node has: a certificate valid for it is a wildcard, refused outright (where
        // it matches one member only, a 2-node cluster's other node, it would otherwise pass).
        if names_dns(&cert, &format!("not-a-node.{}.lockd", self.cluster_id)) {
            return Err(format!(
                "the certificate is a wildcard (*.{}.lockd); a node certificate names one node",
                self.cluster_id
            ));
        }
        let mut known = members.to_vec();
        if !known.contains(&self.own_id) {
            known.push(self.own_id);
        }
        let named: Vec<NodeId> = known
            .iter()
            .copied()
            .filter(|id| self.names(&cert, *id))
            .collect();
        match named.as_slice() {
            [id] if members.contains(id) => Ok(*id),
            [id] => Err(format!(
                "the certificate names this node ({}), not a member it is checked for                  ({members:?})",
                node_name(*id, &self.cluster_id)
            )),
            [] => Err(format!(
                "the certificate names no member as node-<id>.{}.lockd (members {members:?})",
                self.cluster_id
            )),
            several => Err(format!(
                "the certificate names several members {several:?} (a wildcard?); a node \
                 certificate names one node"
            )),
        }
    }

    /// Whether `chain` is a node certificate issued by the peer CA, whichever node it names:
    /// a message from such a sender shows a cluster runs even when the sender is not a member
    /// in this node's view (see `service::raft`).
    pub fn is_node_certificate(&self, chain: &[CertificateDer<'static>]) -> bool {
        self.verify_chain(chain, webpki::KeyUsage::client_auth())
            .is_ok()
    }

    /// Checks the leaf of `chain` against the peer CA alone, for `usage`.
    fn verify_chain<'a>(
        &self,
        chain: &'a [CertificateDer<'static>],
        usage: webpki::KeyUsage,
    ) -> Result<webpki::EndEntityCert<'a>, String> {
        let leaf = chain
            .first()
            .ok_or_else(|| "no client certificate".to_owned())?;
        let cert = webpki::EndEntityCert::try_from(leaf)
            .map_err(|e| format!("unreadable certificate: {e}"))?;
        cert.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &self.peer_anchors,
            &[],
            UnixTime::now(),
            usage,
            None,
            None,
        )
        .map_err(|e| format!("not a node certificate issued by the peer CA: {e}"))?;
        Ok(cert)
    }

    fn names(&self, cert: &webpki::EndEntityCert<'_>, id: NodeId) -> bool {
        names_dns(cert, &node_name(id, &self.cluster_id))
    }

    /// Whether `chain` is this cluster's node certificate for node `id`, good for both the
    /// client and the server side (a node's certificate is both), naming that node alone.
    pub fn verify_own(&self, chain: &[CertificateDer<'static>], id: NodeId) -> Result<(), String> {
        let server = self.verify_chain(chain, webpki::KeyUsage::server_auth())?;
        if !self.names(&server, id) {
            return Err(format!(
                "the certificate does not name {}",
                node_name(id, &self.cluster_id)
            ));
        }
        // `identify_member` refuses a wildcard too.
        self.identify_member(chain, &[id]).map(|_| ())
    }
}

/// The subject of `a` when `a` and `b` are one certificate authority: the same
/// SubjectPublicKeyInfo (whatever the rest of the certificates: a CA re-issued with a new
/// validity or serial, or even under another name, signs with the same key), or the same bytes.
/// `None` when they differ (or one cannot be read: `webpki` refused such files already).
fn same_authority(a: &CertificateDer<'_>, b: &CertificateDer<'_>) -> Option<String> {
    if a == b {
        return Some(subject_of(a));
    }
    let (_, ca) = x509_parser::parse_x509_certificate(a.as_ref()).ok()?;
    let (_, cb) = x509_parser::parse_x509_certificate(b.as_ref()).ok()?;
    (ca.public_key().raw == cb.public_key().raw)
        .then(|| format!("subject {:?}", ca.subject().to_string()))
}

/// `subject "<subject>"` of a certificate, for messages.
fn subject_of(cert: &CertificateDer<'_>) -> String {
    x509_parser::parse_x509_certificate(cert.as_ref()).map_or_else(
        |_| "an unreadable certificate".to_owned(),
        |(_, c)| format!("subject {:?}", c.subject().to_string()),
    )
}

/// The node's current TLS material. SIGHUP loads the files again and, if they pass the start-up
/// checks, swaps them in: new connections (inbound and to peers) use the new certificates,
/// established ones keep theirs, so a rotation drops no call. A reload that fails leaves the
/// previous material in place and says why in the log.
pub(crate) struct TlsHandle {
    files: TlsFiles,
    id: NodeId,
    cluster_id: String,
    current: std::sync::RwLock<Arc<NodeTls>>,
    /// Bumped on every successful reload, so caches of certificate checks start again.
    generation: std::sync::atomic::AtomicU64,
}

impl TlsHandle {
    pub fn load(files: &TlsFiles, id: NodeId, cluster_id: &str) -> anyhow::Result<Arc<TlsHandle>> {
        Ok(Arc::new(TlsHandle {
            current: std::sync::RwLock::new(NodeTls::load(files, id, cluster_id)?),
            files: files.clone(),
            id,
            cluster_id: cluster_id.to_owned(),
            generation: std::sync::atomic::AtomicU64::new(0),
        }))
    }

    pub fn current(&self) -> Arc<NodeTls> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    pub fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Reads the files again; on success the new material serves every new connection.
    pub fn reload(&self) -> anyhow::Result<()> {
        let fresh = NodeTls::load(&self.files, self.id, &self.cluster_id)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }
}

/// Handshakes in progress at most, in all and from one source address. A connection over either
/// bound is closed at once instead of waiting: waiting would let a client that opens sockets and
/// sends nothing hold up everyone behind it in the listen backlog (peers included, whose connect
/// timeout is short). Peers' addresses are exempt.
const HANDSHAKES_MAX: usize = 1024;
const HANDSHAKES_PER_SOURCE_MAX: usize = 32;
/// A handshake that does not finish holds a task and a descriptor; bound it.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Accepts connections on `listener` and completes their TLS handshakes with the material
/// current at accept time, several at once, so a slow or silent client holds up no one else.
/// Failed handshakes are dropped (logged at debug): they never reach the server. `peer_ips`
/// are the members' addresses, never refused for their number of handshakes.
pub(crate) fn incoming(
    listener: tokio::net::TcpListener,
    tls: Arc<TlsHandle>,
    server: fn(&NodeTls) -> Arc<rustls::ServerConfig>,
    connections: lockd_service_kit::admission::SourceSlots,
    peer_ips: lockd_service_kit::admission::TrustedSources,
    shutdown: tokio_util::sync::CancellationToken,
) -> impl futures::Stream<
    Item = std::io::Result<
        crate::connections::Admitted<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>,
    >,
> {
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let handshakes = lockd_service_kit::admission::SourceSlots::new(
        HANDSHAKES_MAX,
        HANDSHAKES_PER_SOURCE_MAX,
        peer_ips,
    );
    let mut refusals = crate::connections::RefusalLog::new();
    tokio::spawn(async move {
        loop {
            let (stream, remote) = tokio::select! {
                _ = shutdown.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors, mostly: back off instead of spinning.
                        tracing::warn!(error = %e, "lockd: accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let place = match connections.admit(remote.ip()) {
                Ok(place) => place,
                Err(why) => {
                    refusals.refused("connection", remote, &why);
                    continue;
                }
            };
            let slot = match handshakes.admit(remote.ip()) {
                Ok(slot) => slot,
                Err(why) => {
                    refusals.refused("TLS handshake", remote, &why);
                    continue;
                }
            };
            let first_bytes_by =
                tokio::time::Instant::now() + crate::connections::FIRST_BYTES_TIMEOUT;
            // With Nagle on, a small reply waits for the peer's delayed ACK (40 ms).
            let _ = stream.set_nodelay(true);
            let addresses = stream.local_addr().ok().map(|local| (local, remote));
            let acceptor = tokio_rustls::TlsAcceptor::from(server(&tls.current()));
            let tx = tx.clone();
            tokio::spawn(async move {
                let handshake =
                    tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                drop(slot);
                match handshake {
                    Ok(Ok(tls_stream)) => {
                        let admitted = crate::connections::Admitted::new(
                            tls_stream,
                            place,
                            first_bytes_by,
                            addresses,
                        );
                        let _ = tx.send(Ok(admitted)).await;
                    }
                    Ok(Err(e)) => tracing::debug!(%remote, error = %e, "TLS handshake failed"),
                    Err(_) => tracing::debug!(%remote, "TLS handshake timed out"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

/// Dials peer `target` over TLS with the material current at connect time, checking that its
/// certificate names `node-<target>.<cluster>.lockd`, from `local_ip` when given.
pub(crate) fn peer_connector(
    tls: Arc<TlsHandle>,
    target: NodeId,
    local_ip: Option<std::net::IpAddr>,
) -> impl tower::Service<
    http::Uri,
    Response = hyper_util::rt::TokioIo<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |uri: http::Uri| {
        let tls = tls.clone();
        async move {
            let stream = dial_uri(&uri, local_ip).await?;
            let node = tls.current();
            let name = ServerName::try_from(node_name(target, &node.cluster_id)).map_err(|e| {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    format!("node name: {e}: {uri}"),
                )
            })?;
            let connector = tokio_rustls::TlsConnector::from(node.client.clone());
            let stream = connector.connect(name, stream).await?;
            Ok(hyper_util::rt::TokioIo::new(stream))
        }
    })
}

/// Without TLS: the same resolution and dialling as [`peer_connector`], plain TCP (rather than
/// tonic's own connector, whose lookups would run beside this node's others).
pub(crate) fn plain_peer_connector(
    local_ip: Option<std::net::IpAddr>,
    same_user: Option<u32>,
) -> impl tower::Service<
    http::Uri,
    Response = hyper_util::rt::TokioIo<tokio::net::TcpStream>,
    Error = std::io::Error,
    Future = impl Send,
> + Clone
+ Send
+ 'static {
    tower::service_fn(move |uri: http::Uri| async move {
        let stream = dial_uri(&uri, local_ip).await?;
        if let Some(uid) = same_user {
            crate::local_peer::check_listener(&stream, uid).await?;
        }
        Ok(hyper_util::rt::TokioIo::new(stream))
    })
}

/// Resolves the host of a peer's `uri` (on every connect: a member back on another IP under its
/// name is found; through [`crate::resolve`], one lookup at a time) and connects to the first
/// address that accepts; errors name the peer's address.
async fn dial_uri(
    uri: &http::Uri,
    local_ip: Option<std::net::IpAddr>,
) -> std::io::Result<tokio::net::TcpStream> {
    let bad = |what: &str| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("{what}: {uri}"))
    };
    let host = uri.host().ok_or_else(|| bad("no host in peer address"))?;
    let port = uri
        .port_u16()
        .ok_or_else(|| bad("no port in peer address"))?;
    let dialled = match crate::resolve::lookup(&format!("{host}:{port}")).await {
        Ok(addrs) => dial_first(&addrs, local_ip).await,
        Err(e) => Err(e),
    };
    dialled.map_err(|e| std::io::Error::new(e.kind(), format!("{uri}: {e}")))
}

/// Connects to the first of `addrs` (a name's addresses, in the resolver's order) that accepts,
/// from `local_ip` when given; addresses of the other IP family than `local_ip` are skipped, as
/// they cannot be reached from it. A name that resolves to `::1` before `127.0.0.1` (localhost)
/// or to a dead address before a live one still connects.
async fn dial_first(
    addrs: &[std::net::SocketAddr],
    local_ip: Option<std::net::IpAddr>,
) -> std::io::Result<tokio::net::TcpStream> {
    let mut failures = Vec::new();
    for addr in addrs {
        if let Some(ip) = local_ip
            && ip.is_ipv4() != addr.is_ipv4()
        {
            failures.push(format!("{addr}: not reachable from {ip}"));
            continue;
        }
        let socket = if addr.is_ipv4() {
            tokio::net::TcpSocket::new_v4()?
        } else {
            tokio::net::TcpSocket::new_v6()?
        };
        if let Some(ip) = local_ip {
            socket.bind(std::net::SocketAddr::new(ip, 0))?;
        }
        match socket.connect(*addr).await {
            Ok(stream) => {
                stream.set_nodelay(true)?;
                return Ok(stream);
            }
            Err(e) => failures.push(format!("{addr}: {e}")),
        }
    }
    Err(std::io::Error::new(
        std::io::ErrorKind::ConnectionRefused,
        if failures.is_empty() {
            "resolves to no address".to_owned()
        } else {
            failures.join("; ")
        },
    ))
}

fn names_dns(cert: &webpki::EndEntityCert<'_>, name: &str) -> bool {
    ServerName::try_from(name).is_ok_and(|n| cert.verify_is_valid_for_subject_name(&n).is_ok())
}

/// Throwaway certificates for `lockd dev --tls`.
pub(crate) mod dev {
    use std::net::{IpAddr, Ipv4Addr};
    use std::path::{Path, PathBuf};

    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose, SanType,
    };

    /// Where the files are: the CA certificate, and `node<id>.pem` / `node<id>-key.pem`.
    pub struct DevCerts {
        pub ca: PathBuf,
        dir: PathBuf,
    }

    impl DevCerts {
        /// Node `id`'s certificate and key.
        pub fn node(&self, id: u64) -> (PathBuf, PathBuf) {
            (
                self.dir.join(format!("node{id}.pem")),
                self.dir.join(format!("node{id}-key.pem")),
            )
        }
    }

    /// Writes a new file `path` with `mode`, also when it replaces one: never through a link
    /// planted in its place (`O_EXCL`). A private key is 0600: whoever reads a node's key is a
    /// member to the others (`ca.pem` and the certificates are public, 0644).
    fn write_new(path: &Path, text: &str, mode: u32) -> anyhow::Result<()> {
        use std::io::Write;
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        let failed = |e: std::io::Error| anyhow::anyhow!("writing {}: {e}", path.display());
        // An older file keeps its mode through a truncating open: remove it first.
        match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(failed(e)),
            _ => {}
        }
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(mode)
            .open(path)
            .map_err(failed)?;
        file.set_permissions(std::fs::Permissions::from_mode(mode))
            .map_err(failed)?;
        file.write_all(text.as_bytes()).map_err(failed)
    }

    /// A new CA and `nodes` node certificates in `dir` (replacing what is there), each naming
    /// `node-<id>.<DEFAULT_CLUSTER_ID>.lockd`, `localhost` and `host`; the keys readable by this
    /// user only.
    pub fn make(dir: &Path, host: Ipv4Addr, nodes: u64) -> anyhow::Result<DevCerts> {
        crate::storage::private_dir(dir)?;
        let write = |name: String, text: String| write_new(&dir.join(&name), &text, 0o644);
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, "lockd dev CA (throwaway)");
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        write("ca.pem".into(), ca.pem())?;
        for id in 1..=nodes {
            let mut params = CertificateParams::new(vec![
                super::node_name(id, super::DEFAULT_CLUSTER_ID),
                "localhost".to_owned(),
            ])?;
            params
                .subject_alt_names
                .push(SanType::IpAddress(IpAddr::V4(host)));
            params
                .distinguished_name
                .push(DnType::CommonName, format!("lockd dev node {id}"));
            params.extended_key_usages = vec![
                ExtendedKeyUsagePurpose::ServerAuth,
                ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, &ca)?;
            write(format!("node{id}.pem"), cert.pem())?;
            write_new(
                &dir.join(format!("node{id}-key.pem")),
                &key.serialize_pem(),
                0o600,
            )?;
        }
        Ok(DevCerts {
            ca: dir.join("ca.pem"),
            dir: dir.to_path_buf(),
        })
    }
}

#[cfg(test)]
mod tests {
    /// Goal (review of 2026-12-05, third round, finding 2): `lockd dev --tls` writes the node
    /// keys readable by this user only, also over files an older version left readable by all.
    /// Method: make the certificates twice in one folder, the second time over a 0644 key.
    #[test]
    fn dev_node_keys_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        let certs = super::dev::make(dir.path(), std::net::Ipv4Addr::LOCALHOST, 2).unwrap();
        let (cert, key) = certs.node(1);
        assert_eq!(mode(&key), 0o600);
        assert_eq!(mode(&cert) & 0o044, 0o044, "certificates stay readable");
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let certs = super::dev::make(dir.path(), std::net::Ipv4Addr::LOCALHOST, 2).unwrap();
        for id in 1..=2 {
            assert_eq!(mode(&certs.node(id).1), 0o600, "node {id}");
        }
    }

    /// Goal: a peer name's dead or unreachable addresses before a live one do not stop the dial,
    /// and when none answers the error names each address and why.
    #[tokio::test]
    async fn dial_first_tries_every_address_of_a_name() {
        let live = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap()
        };
        let v6: std::net::SocketAddr = "[::1]:7001".parse().unwrap();
        let from = Some("127.0.0.1".parse().unwrap());
        let stream = super::dial_first(&[v6, dead, live.local_addr().unwrap()], from)
            .await
            .unwrap();
        assert_eq!(stream.peer_addr().unwrap(), live.local_addr().unwrap());

        let err = super::dial_first(&[v6, dead], from).await.unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("[::1]:7001: not reachable from 127.0.0.1")
                && text.contains(&dead.to_string()),
            "{text}"
        );
        let none = super::dial_first(&[], None).await.unwrap_err();
        assert!(
            none.to_string().contains("resolves to no address"),
            "{none}"
        );
    }

    use super::*;

    /// The certificates `lockd dev --tls` makes pass the check peers make, each only for its
    /// own node.
    #[test]
    fn dev_certificates_pass_the_peer_check_for_their_own_node_only() {
        let dir = tempfile::tempdir().unwrap();
        let certs = dev::make(dir.path(), std::net::Ipv4Addr::LOCALHOST, 3).unwrap();
        let (cert, key) = certs.node(1);
        let files = TlsFiles {
            cert,
            key,
            peer_ca: certs.ca.clone(),
            client_ca: None,
        };
        let tls = NodeTls::load(&files, 1, DEFAULT_CLUSTER_ID).unwrap();
        assert_eq!(tls.cluster_id, DEFAULT_CLUSTER_ID);
        let chain2 = certs_in(&std::fs::read(certs.node(2).0).unwrap(), "node 2").unwrap();
        assert_eq!(tls.identify_member(&chain2, &[1, 2, 3]), Ok(2));
        let e = tls.identify_member(&chain2, &[1, 3]).unwrap_err();
        assert!(e.contains("names no member"), "{e}");
        // Not a member in this view, yet a node certificate of the peer CA (H3 of the
        // membership review: its messages still count as traffic of a running cluster).
        assert!(tls.is_node_certificate(&chain2));
        let other = dev::make(&dir.path().join("other"), std::net::Ipv4Addr::LOCALHOST, 2).unwrap();
        let foreign = certs_in(&std::fs::read(other.node(2).0).unwrap(), "node 2").unwrap();
        assert!(!tls.is_node_certificate(&foreign));
        // Loading node 1's files as node 3 fails at start, naming the file.
        let e = NodeTls::load(&files, 3, DEFAULT_CLUSTER_ID)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("--tls-cert") && e.contains("node-3.lockd.lockd"),
            "{e}"
        );
        assert!(tls.identify_member(&[], &[1]).is_err());
    }

    /// A self-signed CA named `name` on `key`, valid from `from_year`, written to `path`.
    fn test_ca(
        path: &Path,
        name: &str,
        key: &str,
        from_year: i32,
    ) -> rcgen::CertifiedIssuer<'static, rcgen::KeyPair> {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        params.not_before = rcgen::date_time_ymd(from_year, 1, 1);
        let ca =
            rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::from_pem(key).unwrap())
                .unwrap();
        std::fs::write(path, ca.pem()).unwrap();
        ca
    }

    /// A certificate of `ca` for `dns` (server and client authentication); its files.
    fn test_leaf(
        dir: &Path,
        file: &str,
        ca: &rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
        dns: &[&str],
    ) -> (PathBuf, PathBuf) {
        let mut params =
            rcgen::CertificateParams::new(dns.iter().map(|d| d.to_string()).collect::<Vec<_>>())
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, file);
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, ca).unwrap();
        let (c, k) = (
            dir.join(format!("{file}.pem")),
            dir.join(format!("{file}-key.pem")),
        );
        std::fs::write(&c, cert.pem()).unwrap();
        std::fs::write(&k, key.serialize_pem()).unwrap();
        (c, k)
    }

    /// Goal (review of 2026-12-05, third round, finding 3): a client CA that is the peer CA
    /// re-issued (same subject and key, new validity: other bytes) is the same trust anchor, so
    /// it is refused at start as the identical certificate is; a client certificate of it would
    /// otherwise be a node wherever it names one. Method: one key, two self-signed CA
    /// certificates of one name, valid from different years; a node loads with one as
    /// `--peer-ca` and the other as `--tls-client-ca`. Controls: a client CA of its own loads;
    /// the re-issued CA is indeed a peer anchor to the check (a client certificate of it naming
    /// node 2 is a node).
    #[test]
    fn review3_a_reissued_peer_ca_is_not_a_client_ca() {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        let peer = test_ca(&dir.path().join("peer-ca.pem"), "lockd CA", &key, 2024);
        let renewed = test_ca(&dir.path().join("renewed-ca.pem"), "lockd CA", &key, 2025);
        assert_ne!(
            std::fs::read(dir.path().join("peer-ca.pem")).unwrap(),
            std::fs::read(dir.path().join("renewed-ca.pem")).unwrap()
        );
        let (cert, key1) = test_leaf(dir.path(), "node1", &peer, &["node-1.lockd.lockd"]);
        let files = |client_ca: &str| TlsFiles {
            cert: cert.clone(),
            key: key1.clone(),
            peer_ca: dir.path().join("peer-ca.pem"),
            client_ca: Some(dir.path().join(client_ca)),
        };
        // What the check would make of a "client" certificate of the renewed CA.
        let (c2, _) = test_leaf(
            dir.path(),
            "client-as-node2",
            &renewed,
            &["node-2.lockd.lockd"],
        );
        let chain = certs_in(&std::fs::read(&c2).unwrap(), "client").unwrap();
        let other_key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        test_ca(
            &dir.path().join("client-ca.pem"),
            "lockd client CA",
            &other_key,
            2024,
        );
        let own = NodeTls::load(&files("client-ca.pem"), 1, DEFAULT_CLUSTER_ID).unwrap();
        assert_eq!(own.identify_member(&chain, &[2, 3]), Ok(2));

        let e = NodeTls::load(&files("renewed-ca.pem"), 1, DEFAULT_CLUSTER_ID)
            .err()
            .expect("a re-issued peer CA is accepted as the client CA")
            .to_string();
        assert!(
            e.contains("--tls-client-ca") && e.contains("--peer-ca") && e.contains("lockd CA"),
            "{e}"
        );
        // The identical certificate, as before.
        assert!(NodeTls::load(&files("peer-ca.pem"), 1, DEFAULT_CLUSTER_ID).is_err());
    }

    /// Node 1's TLS in a folder of its own, under a new peer CA; with the CA (to issue more
    /// certificates) and node 1's certificate file.
    fn node1_under_a_peer_ca() -> (
        tempfile::TempDir,
        rcgen::CertifiedIssuer<'static, rcgen::KeyPair>,
        Arc<NodeTls>,
        PathBuf,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let key = rcgen::KeyPair::generate().unwrap().serialize_pem();
        let peer = test_ca(&dir.path().join("peer-ca.pem"), "lockd CA", &key, 2024);
        let (cert, key1) = test_leaf(dir.path(), "node1", &peer, &["node-1.lockd.lockd"]);
        let tls = NodeTls::load(
            &TlsFiles {
                cert: cert.clone(),
                key: key1,
                peer_ca: dir.path().join("peer-ca.pem"),
                client_ca: None,
            },
            1,
            DEFAULT_CLUSTER_ID,
        )
        .unwrap();
        (dir, peer, tls, cert)
    }

    /// Goal (review of 2026-12-05, third round, finding 3): a wildcard peer certificate
    /// (`*.<cluster>.lockd`) is no node, also where it matches one member only (a 2-node
    /// cluster's one other node). Method: the peer CA issues such a certificate; the check with
    /// one member, and with two, must refuse it. Control: node 2's own certificate is node 2.
    #[test]
    fn review3_a_wildcard_peer_certificate_is_never_a_node() {
        let (dir, peer, tls, _) = node1_under_a_peer_ca();
        let (wild, _) = test_leaf(dir.path(), "wild", &peer, &["*.lockd.lockd"]);
        let chain = certs_in(&std::fs::read(&wild).unwrap(), "wild").unwrap();
        for members in [&[2][..], &[2, 3][..]] {
            let e = tls.identify_member(&chain, members).unwrap_err();
            assert!(e.contains("wildcard"), "members {members:?}: {e}");
        }
        let (two, _) = test_leaf(dir.path(), "node2", &peer, &["node-2.lockd.lockd"]);
        let chain = certs_in(&std::fs::read(&two).unwrap(), "node2").unwrap();
        assert_eq!(tls.identify_member(&chain, &[2]), Ok(2));
    }

    /// Goal (review of the third round's fixes): a certificate that names two nodes explicitly
    /// is no node either, also where the members it is checked against (the others: callers
    /// leave this node out) hold one of them only, as in a 2-node cluster. Method: the peer CA
    /// issues one certificate for node 1 and node 2; node 1 checks it against `[2]` and
    /// `[2, 3]`. Controls: node 1's own certificate is not a member it is checked for; node 2's
    /// own certificate is node 2.
    #[test]
    fn review3_a_certificate_naming_this_node_and_another_is_no_node() {
        let (dir, peer, tls, cert) = node1_under_a_peer_ca();
        let (both, _) = test_leaf(
            dir.path(),
            "both",
            &peer,
            &["node-1.lockd.lockd", "node-2.lockd.lockd"],
        );
        let chain = certs_in(&std::fs::read(&both).unwrap(), "both").unwrap();
        for members in [&[2][..], &[2, 3][..]] {
            let e = tls.identify_member(&chain, members).unwrap_err();
            assert!(e.contains("several"), "members {members:?}: {e}");
        }
        let own = certs_in(&std::fs::read(&cert).unwrap(), "node1").unwrap();
        let e = tls.identify_member(&own, &[2, 3]).unwrap_err();
        assert!(e.contains("names this node"), "{e}");
        let (two, _) = test_leaf(dir.path(), "node2", &peer, &["node-2.lockd.lockd"]);
        let chain = certs_in(&std::fs::read(&two).unwrap(), "node2").unwrap();
        assert_eq!(tls.identify_member(&chain, &[2, 3]), Ok(2));
    }

    #[test]
    fn cluster_ids_must_be_dns_labels() {
        assert!(validate_cluster_id("prod-eu1").is_ok());
        for bad in ["", "Prod", "a.b", "-a", "a-", "a_b", &"x".repeat(64)] {
            let e = validate_cluster_id(bad).unwrap_err();
            assert!(e.contains("--cluster-id"), "{e}");
        }
    }
}
