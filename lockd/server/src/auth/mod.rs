//! Identity and authorization of client calls (`--auth-policy`, `--auth-tokens`).
//!
//! Who calls: a bearer token (`authorization: Bearer <secret>`, checked against
//! `--auth-tokens`) is `token:<name>`; otherwise a client certificate issued by
//! `--tls-client-ca` is `cert:<subject common name>`; a caller with neither is `anonymous`. A
//! node certificate (issued by `--peer-ca`, naming a member) is a node, never a client: a node
//! acts only for the caller whose call it forwards, named in [`FORWARDED_IDENTITY_HEADER`].
//!
//! Forwarding: the node a client called authorizes the call, then forwards it to the leader
//! marked with `lockd-forwarded-by` and the caller's identity; the leader honours both only from
//! a caller that presents a member's node certificate, and authorizes the call again with that
//! identity (the leader's answer is the one that commits). With TLS on, these headers from anyone
//! else are refused with UNAUTHENTICATED: a client can claim neither an identity nor a forward.
//!
//! Without `--auth-policy` lockd runs open (every call allowed, nothing identified), as before;
//! the start-up log says so.
//!
//! # Layout
//! - `policy`: the policy file and its checks.
//! - `tokens`: the tokens file of hashed secrets.

pub(crate) mod policy;
pub(crate) mod tokens;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lockd_api::FORWARDED_HEADER;
use rustls_pki_types::{CertificateDer, UnixTime};
use sha2::{Digest, Sha256};
use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

pub(crate) use policy::{Operation, Policy};
pub(crate) use tokens::Tokens;

use crate::local_peer::{LocalPeers, PeerOwner};
use crate::observe::metrics::NodeMetrics;
use crate::raft::{NodeId, peer_protocol};
use crate::service::errors;
use crate::tls::TlsHandle;

/// Binary gRPC metadata in which a node forwarding a call names the caller it acts for (UTF-8).
pub const FORWARDED_IDENTITY_HEADER: &str = "lockd-forwarded-identity-bin";
/// The header of bearer tokens.
const AUTHORIZATION_HEADER: &str = "authorization";
/// First byte of a request id scoped to an identity (see [`Auth::scope_request_id`]); a control
/// character, which no identity a policy can grant contains. lockd-core owns the convention, so
/// that its messages show the client's own id.
const SCOPE_MARK: char = lockd_core::types::REQUEST_ID_SCOPE_MARK;
/// How long a certificate check is trusted without checking again (expiry, mostly).
const CHECKED_FOR: Duration = Duration::from_secs(60);
/// Certificate checks remembered at most; the cache is cleared when full.
const CHECKED_MAX: usize = 1024;
/// At most one refusal per this interval reaches the log.
const REFUSAL_LOG_EVERY_MS: u64 = 10_000;

/// The files of `--auth-policy` and `--auth-tokens`.
#[derive(Clone, Debug)]
pub(crate) struct AuthFiles {
    pub policy: PathBuf,
    pub tokens: Option<PathBuf>,
}

/// Who a call is from, put in the request's extensions by [`Auth::intercept`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Caller {
    /// `cert:<cn>`, `token:<name>`, `anonymous` or `node:<id>`; `None` without a policy (open
    /// mode identifies nobody).
    pub identity: Option<Arc<str>>,
    /// A member forwarded the call (authenticated by its node certificate with TLS on; without
    /// TLS, as marked, which only stops a second forward).
    pub forwarded: bool,
}

/// What a presented certificate is.
#[derive(Clone, Debug, PartialEq, Eq)]
enum CertIdentity {
    Node(NodeId),
    /// A client certificate of `--tls-client-ca`, by subject common name.
    Client(String),
}

/// A check's outcome, when it was made, and the TLS and membership generations it was made with
/// (a reload on SIGHUP may change the CAs; a member added or removed changes which node
/// certificates count).
type Checked = (Result<CertIdentity, String>, Instant, (u64, u64));

/// Identification and authorization of one node's client calls.
pub(crate) struct Auth {
    /// `None`: open mode.
    policy: Option<Policy>,
    tokens: Tokens,
    /// The node's TLS material, current after every reload; it holds `--tls-client-ca` as trust
    /// anchors: the listener trusts it and the peer CA alike, so a client certificate is checked
    /// again against this CA alone.
    tls: Option<Arc<TlsHandle>>,
    /// The other members, from the Raft membership: the only nodes that forward calls here.
    members: Arc<crate::members::Members>,
    /// Without TLS on loopback: the forwarding headers only from this node's user's processes.
    local: LocalPeers,
    /// Certificate checks by SHA-256 of the leaf: a connection presents the same certificate on
    /// every call, so a call costs one hash.
    checked: Mutex<HashMap<[u8; 32], Checked>>,
    metrics: Arc<NodeMetrics>,
    /// When a refusal was last logged (ms since `started`), to log at most one per interval.
    last_logged_ms: AtomicU64,
    started: Instant,
}

impl Auth {
    /// Loads the policy and tokens (errors name the file, the line and the value) and the
    /// client CA. A policy needs TLS: [`crate::config::NodeConfig::with_auth`] checks that.
    pub fn load(
        files: Option<&AuthFiles>,
        tls: Option<Arc<TlsHandle>>,
        local: LocalPeers,
        members: Arc<crate::members::Members>,
        metrics: Arc<NodeMetrics>,
    ) -> anyhow::Result<Arc<Auth>> {
        let (policy, tokens) = match files {
            Some(f) => {
                let policy = Policy::load(&f.policy).map_err(|e| anyhow::anyhow!(e))?;
                let tokens = match &f.tokens {
                    Some(p) => Tokens::load(p).map_err(|e| anyhow::anyhow!(e))?,
                    None => Tokens::default(),
                };
                (Some(policy), tokens)
            }
            None => (None, Tokens::default()),
        };
        match &policy {
            None => tracing::warn!(
                "lockd: no --auth-policy: every caller may acquire, renew, release and describe \
                 any resource and read the cluster status; give --auth-policy to restrict them"
            ),
            Some(p) => tracing::info!(
                identities = p.identities().len(),
                tokens = !tokens.is_empty(),
                client_certificates = tls
                    .as_ref()
                    .is_some_and(|t| !t.current().client_anchors().is_empty()),
                "lockd: authorization policy loaded"
            ),
        }
        Ok(Arc::new(Auth {
            policy,
            tokens,
            tls,
            members,
            local,
            checked: Mutex::new(HashMap::new()),
            metrics,
            last_logged_ms: AtomicU64::new(0),
            started: Instant::now(),
        }))
    }

    /// The interceptor of the Lock and Cluster services: identifies the caller (or refuses it
    /// with UNAUTHENTICATED) before the body is read.
    pub fn intercept(&self, mut req: Request<()>) -> Result<Request<()>, Status> {
        match self.identify(&req) {
            Ok(caller) => {
                req.extensions_mut().insert(caller);
                Ok(req)
            }
            Err(status) => {
                self.metrics
                    .with(|| metrics::counter!("lockd_auth_unauthenticated_total").increment(1));
                self.log_refusal(req.remote_addr(), status.message());
                Err(status)
            }
        }
    }

    fn identify<T>(&self, req: &Request<T>) -> Result<Caller, Status> {
        let md = req.metadata();
        let marked = md.contains_key(FORWARDED_HEADER);
        let claims_forward = marked || md.contains_key(FORWARDED_IDENTITY_HEADER);
        // Changing the membership (or the leader, the signing key, or taking a backup with the
        // keys) hands the cluster to whoever calls: on a plaintext loopback port, where `lockd
        // dev` allows it without a policy, and in `lockd dev --tls`, only this node's user's
        // processes may.
        if let Some(crate::local_peer::AdminCall(method)) = req.extensions().get().copied()
            && let Some(why) = self
                .local
                .admin_refusal(req.extensions().get::<PeerOwner>(), method)
        {
            return Err(errors::unauthenticated(why));
        }
        if self.tls.is_none() {
            // Without TLS nothing can be authenticated (and no policy is allowed): the mark only
            // keeps a forwarded call from being forwarded again. On a loopback port only this
            // node's user's processes may set it (`crate::local_peer`).
            if claims_forward
                && let Some(why) = self.local.refusal(
                    req.extensions().get::<PeerOwner>(),
                    &format!("{FORWARDED_HEADER} and {FORWARDED_IDENTITY_HEADER} refused"),
                )
            {
                return Err(errors::unauthenticated(why));
            }
            if marked {
                self.same_incarnation(md, None)?;
            }
            return Ok(Caller {
                identity: None,
                forwarded: marked,
            });
        }
        let cert = if claims_forward || self.policy.is_some() {
            self.certificate(req)
        } else {
            None
        };
        let node = match &cert {
            Some(Ok(CertIdentity::Node(id))) => Some(*id),
            _ => None,
        };
        if claims_forward && node.is_none() {
            return Err(errors::unauthenticated(format!(
                "{FORWARDED_HEADER} and {FORWARDED_IDENTITY_HEADER} are accepted only \
                 from the nodes of this cluster (a member's certificate of --peer-ca); this \
                 caller is not one"
            )));
        }
        let forwarded = node.is_some() && marked;
        if forwarded {
            self.same_incarnation(md, node)?;
        }
        if self.policy.is_none() {
            return Ok(Caller {
                identity: None,
                forwarded,
            });
        }
        if forwarded {
            let identity = md
                .get_bin(FORWARDED_IDENTITY_HEADER)
                .and_then(|v| v.to_bytes().ok())
                .and_then(|b| String::from_utf8(b.to_vec()).ok())
                .filter(|s| !s.is_empty())
                .ok_or_else(|| {
                    errors::unauthenticated(format!(
                        "a call forwarded by node {} names no caller in \
                         {FORWARDED_IDENTITY_HEADER}",
                        node.unwrap_or_default()
                    ))
                })?;
            return Ok(Caller {
                identity: Some(identity.into()),
                forwarded: true,
            });
        }
        let identity = if let Some(value) = md.get(AUTHORIZATION_HEADER) {
            let secret = value
                .to_str()
                .ok()
                .and_then(|v| {
                    let (scheme, secret) = v.split_once(' ')?;
                    scheme
                        .eq_ignore_ascii_case("bearer")
                        .then_some(secret.trim())
                })
                .ok_or_else(|| {
                    errors::unauthenticated("the authorization header must be \"Bearer <token>\"")
                })?;
            let name = self.tokens.identify(secret).ok_or_else(|| {
                errors::unauthenticated(
                    "the bearer token is not valid (no token of --auth-tokens has that \
                     secret)",
                )
            })?;
            format!("token:{name}")
        } else {
            match cert {
                None => "anonymous".to_owned(),
                Some(Ok(CertIdentity::Node(id))) => format!("node:{id}"),
                Some(Ok(CertIdentity::Client(cn))) => format!("cert:{cn}"),
                Some(Err(why)) => {
                    return Err(errors::unauthenticated(format!(
                        "the client certificate gives no identity: {why}"
                    )));
                }
            }
        };
        Ok(Caller {
            identity: Some(identity.into()),
            forwarded: false,
        })
    }

    /// A forwarded call must come from this node's cluster incarnation (its restore id, see
    /// `raft::restore_id`), as Raft messages must: FAILED_PRECONDITION naming both ids otherwise.
    /// A call without the id is taken only from a sender of a peer protocol before
    /// `FORWARDS_RESTORE_ID`, on the call or on the sender's Raft traffic (`sender`: the member
    /// its certificate proves, else the one it names): such followers sent none on unary calls
    /// (a rolling upgrade). From a newer one it means a node without an id, such as a member of
    /// the old cluster forwarding to a restored leader. The forward stream always requires it.
    fn same_incarnation(
        &self,
        md: &tonic::metadata::MetadataMap,
        sender: Option<NodeId>,
    ) -> Result<(), Status> {
        let named = md.get(FORWARDED_HEADER).and_then(|v| v.to_str().ok());
        let from = named.map_or_else(|| "the forwarding node".to_owned(), |n| format!("node {n}"));
        let dial = self.members.dial();
        let heard = sender
            .or_else(|| named.and_then(|n| n.parse().ok()))
            .and_then(|n| dial.protocols.of(n));
        let announced = peer_protocol::announced(md)
            .unwrap_or(peer_protocol::OLDEST)
            .max(heard.unwrap_or(peer_protocol::OLDEST));
        let theirs = crate::raft::restore_id::from_metadata(md);
        dial.restore
            .check_forwarded(&from, theirs, announced)
            .map_err(|why| {
                dial.restore.log_mismatch(&why);
                errors::precondition("restore_id", why)
            })
    }

    /// What the caller's certificate is, if it presented one; checked once per certificate and
    /// minute.
    fn certificate<T>(&self, req: &Request<T>) -> Option<Result<CertIdentity, String>> {
        let tls = self.tls.as_ref()?;
        let chain = req.peer_certs()?;
        let leaf = chain.first()?;
        let key: [u8; 32] = Sha256::digest(leaf.as_ref()).into();
        let generation = (tls.generation(), self.members.generation());
        {
            let checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((outcome, at, made_with)) = checked.get(&key)
                && at.elapsed() < CHECKED_FOR
                && *made_with == generation
            {
                return Some(outcome.clone());
            }
        }
        // Outside the lock: signature checks, with the material current now.
        let material = tls.current();
        let outcome = match material.identify_member(&chain, &self.members.others()) {
            Ok(id) => Ok(CertIdentity::Node(id)),
            Err(_) => {
                client_certificate(material.client_anchors(), &chain).map(CertIdentity::Client)
            }
        };
        let mut checked = self.checked.lock().unwrap_or_else(|e| e.into_inner());
        if checked.len() >= CHECKED_MAX {
            checked.clear();
        }
        checked.insert(key, (outcome.clone(), Instant::now(), generation));
        Some(outcome)
    }

    /// Authorizes `op` (on `resource`) for the caller the interceptor identified; returns it.
    /// PERMISSION_DENIED names the identity, the operation and the resource.
    pub fn authorize<T>(
        &self,
        req: &Request<T>,
        op: Operation,
        resource: Option<&str>,
    ) -> Result<Caller, Status> {
        let caller = match req.extensions().get::<Caller>() {
            Some(c) => c.clone(),
            None if self.policy.is_none() && self.tls.is_none() => Caller {
                identity: None,
                forwarded: req.metadata().contains_key(FORWARDED_HEADER),
            },
            // The interceptor did not run: refuse rather than guess.
            None => {
                return Err(errors::permission_denied(
                    "permission denied: the call was not identified",
                    "unidentified",
                    op.as_str(),
                    resource,
                ));
            }
        };
        self.decide(caller, op, resource, req.remote_addr())
    }

    /// Authorizes a call that node `from` forwarded on its forward stream (`service::forward`),
    /// for the caller it names: the same decision as [`Auth::authorize`] makes for a forwarded
    /// unary call, whose identity header the stream's `identity` field replaces. Under a policy a
    /// call without an identity is refused (UNAUTHENTICATED), as the unary forward is.
    pub fn authorize_forwarded(
        &self,
        from: Option<NodeId>,
        identity: Option<&str>,
        op: Operation,
        resource: Option<&str>,
    ) -> Result<Caller, Status> {
        let caller = match (&self.policy, identity.filter(|i| !i.is_empty())) {
            (None, _) => Caller {
                identity: None,
                forwarded: true,
            },
            (Some(_), Some(identity)) => Caller {
                identity: Some(identity.into()),
                forwarded: true,
            },
            (Some(_), None) => {
                self.metrics
                    .with(|| metrics::counter!("lockd_auth_unauthenticated_total").increment(1));
                return Err(errors::unauthenticated(format!(
                    "a call forwarded by node {} names no caller",
                    from.map_or_else(|| "?".to_owned(), |n| n.to_string())
                )));
            }
        };
        self.decide(caller, op, resource, None)
    }

    /// The policy's decision on `caller` doing `op` (on `resource`); refusals are counted and
    /// logged (with `remote`, the caller's address, when known).
    fn decide(
        &self,
        caller: Caller,
        op: Operation,
        resource: Option<&str>,
        remote: Option<std::net::SocketAddr>,
    ) -> Result<Caller, Status> {
        let Some(policy) = &self.policy else {
            return Ok(caller);
        };
        let identity = caller.identity.as_deref().unwrap_or("anonymous");
        let label = || {
            if policy.names(identity) {
                identity.to_owned()
            } else {
                "other".to_owned()
            }
        };
        if policy.allows(identity, op, resource) {
            // Counted once, on the node the client called.
            if !caller.forwarded {
                self.metrics.with(|| {
                    metrics::counter!("lockd_auth_allowed_total", "identity" => label(), "op" => op.as_str())
                        .increment(1)
                });
            }
            return Ok(caller);
        }
        self.metrics.with(|| {
            metrics::counter!("lockd_auth_denied_total", "identity" => label(), "op" => op.as_str())
                .increment(1)
        });
        let status = denied(identity, op, resource);
        self.log_refusal(remote, status.message());
        Err(status)
    }

    /// Whether a reply that lists resources of every tenant (Status's hot lists) may name
    /// `resource` to `caller`: in open mode always; under a policy only to an identity granted
    /// `admin` or `describe` of that resource, since a resource's name is its tenant's business
    /// (`customer-4711/payroll-run`) and the caller could not Describe it either. Neither counted
    /// nor logged: it refuses no call, it leaves names out.
    pub fn may_list(&self, caller: &Caller, resource: &str) -> bool {
        let Some(policy) = &self.policy else {
            return true;
        };
        let identity = caller.identity.as_deref().unwrap_or("anonymous");
        policy.allows(identity, Operation::Admin, None)
            || policy.allows(identity, Operation::Describe, Some(resource))
    }

    /// Whether a policy (`--auth-policy`) decides who may do what; `false` in open mode.
    pub fn has_policy(&self) -> bool {
        self.policy.is_some()
    }

    /// Whether a forwarded call is known to come from a member (TLS with node certificates);
    /// without TLS the forward mark is taken as given.
    pub fn authenticates_nodes(&self) -> bool {
        self.tls.is_some()
    }

    /// Marks a call this node forwards to the leader: by this node, of its cluster incarnation,
    /// for `caller`.
    pub fn mark_forwarded<T>(&self, node: NodeId, caller: &Caller, req: &mut Request<T>) {
        let md = req.metadata_mut();
        // The version tells the leader that a call without a restore id comes from a node that
        // has none (`same_incarnation`).
        self.members.dial().restore.attach(md);
        peer_protocol::attach(md);
        md.insert(
            FORWARDED_HEADER,
            node.to_string().parse().expect("digits are valid metadata"),
        );
        if let Some(identity) = &caller.identity {
            md.insert_bin(
                FORWARDED_IDENTITY_HEADER,
                MetadataValue::from_bytes(identity.as_bytes()),
            );
        }
    }

    /// The request id an Acquire is proposed with. With a policy it is scoped to the caller:
    /// `\u{1}<identity>\u{1}<request_id>`, so the dedup window (keyed by the proposed id) keeps
    /// every identity's ids apart and another identity replaying an id finds nothing of the
    /// first one's. The identity contains no `\u{1}` (policy names have no control characters),
    /// so the form is unambiguous. Open mode proposes the id as the client sent it, so entries
    /// and snapshots stay exactly as before.
    pub fn scope_request_id(&self, caller: &Caller, request_id: &str) -> String {
        match (&self.policy, &caller.identity) {
            (Some(_), Some(identity)) => {
                format!("{SCOPE_MARK}{identity}{SCOPE_MARK}{request_id}")
            }
            _ => request_id.to_owned(),
        }
    }

    /// Logs a refusal, at most one per [`REFUSAL_LOG_EVERY_MS`].
    fn log_refusal(&self, remote: Option<std::net::SocketAddr>, why: &str) {
        let now = self.started.elapsed().as_millis() as u64;
        let last = self.last_logged_ms.load(Ordering::Relaxed);
        if (last == 0 || now.saturating_sub(last) >= REFUSAL_LOG_EVERY_MS)
            && self
                .last_logged_ms
                .compare_exchange(last, now.max(1), Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            tracing::warn!(
                remote = ?remote,
                reason = why,
                "lockd: refused a client call (further refusals in the next 10 s are not logged)"
            );
        }
    }
}

/// The subject common name of a client certificate issued (through the intermediates the caller
/// sent) by `--tls-client-ca` (`anchors`).
fn client_certificate(
    anchors: &[rustls_pki_types::TrustAnchor<'static>],
    chain: &[CertificateDer<'static>],
) -> Result<String, String> {
    if anchors.is_empty() {
        return Err("no --tls-client-ca is configured".to_owned());
    }
    let leaf = chain.first().ok_or("no certificate")?;
    let cert = webpki::EndEntityCert::try_from(leaf)
        .map_err(|e| format!("unreadable certificate: {e}"))?;
    cert.verify_for_usage(
        webpki::ALL_VERIFICATION_ALGS,
        anchors,
        &chain[1..],
        UnixTime::now(),
        webpki::KeyUsage::client_auth(),
        None,
        None,
    )
    .map_err(|e| format!("not a client certificate of --tls-client-ca: {e}"))?;
    common_name(leaf.as_ref())
}

/// The identity and the client's request id of a scoped request id (see
/// [`Auth::scope_request_id`]); `(None, id)` for an id that is not scoped.
pub(crate) fn split_request_id(id: &str) -> (Option<&str>, &str) {
    lockd_core::types::split_scoped_request_id(id)
}

/// PERMISSION_DENIED for `identity` doing `op` (on `resource`).
pub(crate) fn denied(identity: &str, op: Operation, resource: Option<&str>) -> Status {
    let what = match resource {
        Some(r) => format!("{} {r:?}", op.as_str()),
        None => format!("call {} on the cluster", op.as_str()),
    };
    errors::permission_denied(
        format!(
            "permission denied: {identity} may not {what} (not granted by the authorization \
             policy)"
        ),
        identity,
        op.as_str(),
        resource,
    )
}

/// The request types whose resource authorization looks at.
pub(crate) trait Resourced {
    fn resource(&self) -> &str;
}

macro_rules! resourced {
    ($($t:ty),*) => {$(
        impl Resourced for $t {
            fn resource(&self) -> &str {
                &self.resource
            }
        }
    )*};
}
resourced!(
    lockd_api::v1::AcquireRequest,
    lockd_api::v1::RenewRequest,
    lockd_api::v1::ReleaseRequest,
    lockd_api::v1::DescribeRequest
);

/// The subject's one common name.
fn common_name(der: &[u8]) -> Result<String, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("unreadable certificate: {e}"))?;
    let names: Vec<_> = cert.subject().iter_common_name().collect();
    match names.as_slice() {
        [one] => one
            .as_str()
            .map(str::to_owned)
            .map_err(|e| format!("its common name is not text: {e}")),
        [] => Err("its subject has no common name (CN)".to_owned()),
        _ => Err("its subject has several common names (CN)".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scoped_request_ids_split_back() {
        assert_eq!(split_request_id("r1"), (None, "r1"));
        let scoped = format!("{SCOPE_MARK}cert:a{SCOPE_MARK}r{SCOPE_MARK}1");
        assert_eq!(split_request_id(&scoped), (Some("cert:a"), "r\u{1}1"));
        // Messages show the start of the client's own id, never the identity's scope.
        assert_eq!(
            lockd_core::types::shown_request_id(&format!(
                "{SCOPE_MARK}cert:a{SCOPE_MARK}0123456789"
            )),
            "\"01234567…\""
        );
    }

    #[test]
    fn denials_name_identity_operation_and_resource() {
        let s = denied("cert:alice", Operation::Acquire, Some("b/x"));
        assert_eq!(s.code(), tonic::Code::PermissionDenied);
        assert!(
            s.message().starts_with("lockd: ")
                && s.message().contains("cert:alice")
                && s.message().contains("acquire \"b/x\""),
            "{}",
            s.message()
        );
        let s = denied("token:ci", Operation::Admin, None);
        assert!(s.message().contains("admin"), "{}", s.message());
    }
}
