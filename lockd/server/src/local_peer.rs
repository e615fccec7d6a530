//! Who may call the internal services of a plaintext loopback port: processes of this node's own
//! user, by the kernel's word on who owns the connecting socket (as Postgres' `peer`
//! authentication does for its Unix socket). It does not authenticate clients: their calls are
//! never looked at here.
//!
//! Without TLS nothing in a call proves that a member sent it. A loopback `--listen` runs without
//! TLS and without `--insecure-plaintext` (tests, `lockd dev`, the quick start), and such a port
//! is reachable by every local user, and by remote clients through a TLS terminator, sidecar or
//! tunnel on the host. So there the Raft service (`CurrentVote` included: it reveals the
//! incarnation id, vote and last log id a forged message needs), the forward stream and the
//! forwarding headers on the Lock and Cluster services (`lockd-forwarded-by`,
//! `lockd-forwarded-identity-bin`) are served only to connections whose socket belongs to this
//! process's effective uid: the uid every member of `lockd dev`, and nodes started by one
//! operator, run as. With TLS the certificates decide instead; with `--insecure-plaintext` the
//! operator chose to trust the network, and nothing is checked.
//!
//! The admin calls (membership, leader transfer, key rotation, backup) are kept to the same user
//! in that mode too, since `lockd dev` answers them without a policy; and `lockd dev --tls` keeps
//! them so as well ([`LocalPeers::AdminSameUser`]): without a client CA, TLS tells nothing about
//! who calls, and every local user reaches the port. The lookup works on any local socket, TLS or
//! not.
//!
//! How: the caller's socket is the one whose local address is the connection's remote address
//! and whose remote address is the connection's local one, a 4-tuple no other live socket of the
//! network namespace has. On Linux its owner is the `uid` column of its line in `/proc/net/tcp`
//! (`/proc/net/tcp6` for IPv6 and v4-mapped sockets). [`Lookup`] asks once per connection, when
//! the first call that needs it arrives, and keeps the answer in the connection's state
//! (`connections::Open`), so clients that never call an internal service cost nothing and a peer
//! one lookup per connection. A read of the table costs milliseconds however few sockets there
//! are (the kernel walks its whole connection hash table), so one reader on a blocking thread
//! answers every lookup waiting when its read begins, and rests between reads (`look_up`). A
//! line not found,
//! or a table that cannot be read, means "not this user" (fail closed). At start the node finds
//! its own listening socket in the table ([`check_available`]), so a host that hides the table
//! (systemd's `ProcSubset=pid`) or another platform (none has the table) refuses to start in
//! this mode with the reason, instead of refusing its peers later.

use std::convert::Infallible;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{LazyLock, Mutex, PoisonError};
use std::task::{Context, Poll};

use futures::future::{BoxFuture, Either};
use tokio::sync::oneshot;
use tonic::body::Body;
use tonic::server::NamedService;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::auth::FORWARDED_IDENTITY_HEADER;
use lockd_api::FORWARDED_HEADER;

/// The longest rest of the table's reader between two reads (it rests as long as a read took):
/// a read took 14 ms with 150 sockets and 50 ms with 10,000 on a loaded 2-core host, as the
/// kernel walks its whole connection hash table however few sockets there are.
pub const READ_REST_MAX: std::time::Duration = std::time::Duration::from_millis(100);

/// Who the internal services of this node's port are served to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalPeers {
    /// TLS is on (certificates decide who is a member) or `--insecure-plaintext` was given (the
    /// operator trusts everyone who reaches the port): nothing is checked here.
    Unchecked,
    /// A plaintext loopback port: only connections whose socket belongs to this user id.
    SameUser(u32),
    /// TLS is on (certificates decide who is a member), but the node answers admin calls
    /// without a policy (`lockd dev --tls`): those calls only from connections whose socket
    /// belongs to this user id; nothing else is checked here.
    AdminSameUser(u32),
}

/// The owner of a connection's peer socket as the kernel reported it (the reason it is not
/// known otherwise), put in a call's extensions by [`Lookup`] before its interceptor runs.
#[derive(Clone, Debug)]
pub(crate) struct PeerOwner(pub Result<u32, String>);

impl LocalPeers {
    /// The mode of a node: [`LocalPeers::SameUser`] with this process's effective uid when TLS
    /// is off and `--insecure-plaintext` was not given (then `--listen` is on loopback:
    /// `NodeConfig::with_security` refuses anything else); [`LocalPeers::AdminSameUser`] with
    /// TLS when `admin_own_user_only` (`lockd dev --tls`).
    pub fn of(tls: bool, insecure_plaintext: bool, admin_own_user_only: bool) -> Self {
        let uid = || nix::unistd::geteuid().as_raw();
        if tls && admin_own_user_only {
            LocalPeers::AdminSameUser(uid())
        } else if tls || insecure_plaintext {
            LocalPeers::Unchecked
        } else {
            LocalPeers::SameUser(uid())
        }
    }

    /// The user id whose sockets this mode looks up, if it looks any up.
    pub fn uid(&self) -> Option<u32> {
        match *self {
            LocalPeers::Unchecked => None,
            LocalPeers::SameUser(uid) | LocalPeers::AdminSameUser(uid) => Some(uid),
        }
    }

    /// Why a call that only members may make is refused (`what` says what was refused, for the
    /// message), or `None` when it may go on. `owner` is what [`Lookup`] put in the call's
    /// extensions; a call without it (a service built without [`Lookup`]) is refused.
    pub(crate) fn refusal(&self, owner: Option<&PeerOwner>, what: &str) -> Option<String> {
        let LocalPeers::SameUser(uid) = *self else {
            return None;
        };
        let whose = not_same_user(owner, uid)?;
        Some(format!(
            "{what}: on a plaintext loopback port only processes of the same user (uid {uid}) \
             may call the cluster's internal services; {whose}"
        ))
    }

    /// Why an admin call (`method`, one of [`ADMIN_METHODS`]) is refused, or `None` when it may
    /// go on: in both checked modes only this user's processes may make one.
    pub(crate) fn admin_refusal(&self, owner: Option<&PeerOwner>, method: &str) -> Option<String> {
        match *self {
            LocalPeers::Unchecked => None,
            LocalPeers::SameUser(_) => self.refusal(owner, &format!("{method} refused")),
            LocalPeers::AdminSameUser(uid) => {
                let whose = not_same_user(owner, uid)?;
                Some(format!(
                    "{method} refused: this node answers admin calls without a policy (`lockd \
                     dev`), so only processes of the same user (uid {uid}) may make them; {whose}"
                ))
            }
        }
    }
}

/// Why `owner` is not `uid` (for a message), or `None` when it is.
fn not_same_user(owner: Option<&PeerOwner>, uid: u32) -> Option<String> {
    Some(match owner {
        Some(PeerOwner(Ok(theirs))) if *theirs == uid => return None,
        Some(PeerOwner(Ok(theirs))) => format!("this connection belongs to uid {theirs}"),
        Some(PeerOwner(Err(why))) => {
            format!("the owner of this connection is not known ({why})")
        }
        None => "the owner of this connection was not looked up".to_owned(),
    })
}

/// Wraps a service so that each call that needs it carries its connection's `PeerOwner`: every
/// call of an internal service (`all`), or, on a client service, a call that claims to be
/// forwarded by a member. Other calls pass untouched, with no lookup and no allocation.
#[derive(Clone)]
pub struct Lookup<S> {
    inner: S,
    mode: LocalPeers,
    all: bool,
}

impl<S> Lookup<S> {
    /// An internal service (Raft, Forward): every call needs its owner.
    pub fn internal(mode: LocalPeers, inner: S) -> Self {
        Lookup {
            inner,
            mode,
            all: true,
        }
    }

    /// A client service (Lock, Cluster): only calls with a forwarding header need it.
    pub fn forwarding_headers(mode: LocalPeers, inner: S) -> Self {
        Lookup {
            inner,
            mode,
            all: false,
        }
    }
}

impl<S: NamedService> NamedService for Lookup<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, R> tower::Service<http::Request<Body>> for Lookup<S>
where
    S: tower::Service<http::Request<Body>, Response = R, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    R: Send + 'static,
{
    type Response = R;
    type Error = Infallible;
    type Future = Either<S::Future, BoxFuture<'static, Result<R, Infallible>>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<Body>) -> Self::Future {
        let admin = req
            .uri()
            .path()
            .rsplit_once('/')
            .and_then(|(_, method)| ADMIN_METHODS.iter().find(|m| **m == method));
        let needed = match self.mode {
            LocalPeers::Unchecked => false,
            LocalPeers::SameUser(_) => {
                self.all
                    || admin.is_some()
                    || req.headers().contains_key(FORWARDED_HEADER)
                    || req.headers().contains_key(FORWARDED_IDENTITY_HEADER)
            }
            // With TLS the internal services and the forwarding headers are the certificates'.
            LocalPeers::AdminSameUser(_) => admin.is_some(),
        };
        if !needed {
            return Either::Left(self.inner.call(req));
        }
        // The service that was polled ready serves this call; a clone waits for the next.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let addresses = req
            .extensions()
            .get::<TcpConnectInfo>()
            .or_else(|| {
                req.extensions()
                    .get::<TlsConnectInfo<TcpConnectInfo>>()
                    .map(TlsConnectInfo::get_ref)
            })
            .and_then(|c| Some((c.local_addr()?, c.remote_addr()?)));
        if let Some(method) = admin {
            req.extensions_mut().insert(AdminCall(method));
        }
        Either::Right(Box::pin(async move {
            let owner = owner_of(addresses).await;
            req.extensions_mut().insert(PeerOwner(owner));
            inner.call(req).await
        }))
    }
}

/// The Cluster calls that change who is in the cluster, who leads, or which key signs, or that
/// take a backup (the keys included): on a loopback port without TLS, and in `lockd dev --tls`,
/// this node's user's only.
const ADMIN_METHODS: [&str; 6] = [
    "AddMember",
    "PromoteMember",
    "RemoveMember",
    "TransferLeader",
    "RotateSigningKey",
    "SaveSnapshot",
];

/// Put in a call's extensions by [`Lookup`] when it is one of the admin calls (its method's
/// name), for the interceptor.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdminCall(pub &'static str);

/// Checks, before a node sends anything on a connection it opened to a member's port, that the
/// socket that accepted it belongs to this node's user: on a plaintext loopback cluster another
/// local user could otherwise bind the port of a member that is down and take its replication
/// (entries, snapshots with the signing keys, votes) and its forwarded calls.
pub(crate) async fn check_listener(
    stream: &tokio::net::TcpStream,
    uid: u32,
) -> std::io::Result<()> {
    let (local, remote) = (stream.local_addr()?, stream.peer_addr()?);
    match look_up(local, remote).await {
        Ok(theirs) if theirs == uid => Ok(()),
        Ok(theirs) => Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "refusing to talk to {remote}: on a plaintext loopback cluster a member's port \
                 must belong to this node's user (uid {uid}); it belongs to uid {theirs}"
            ),
        )),
        Err(why) => Err(std::io::Error::other(format!(
            "refusing to talk to {remote}: the owner of its socket is not known ({why})"
        ))),
    }
}

/// The owner of the peer socket of the connection between `addresses` (local, remote): cached in
/// the connection's state, looked up on its first call that needs it.
async fn owner_of(addresses: Option<(SocketAddr, SocketAddr)>) -> Result<u32, String> {
    let (local, remote) = addresses
        .ok_or_else(|| "the transport gave no addresses for this connection".to_owned())?;
    match crate::connections::Open::of(local, remote) {
        // Only a found owner is kept: a lookup that failed (a descriptor limit, a read error)
        // is tried again on the next call rather than refusing the connection for good.
        Some(open) => open
            .owner
            .get_or_try_init(|| look_up(local, remote))
            .await
            .copied(),
        // Not one of the accept loop's connections (it registers each): ask every time.
        None => look_up(local, remote).await,
    }
}

/// Lookups waiting for the next read of the table, and whether a reader is running.
type Pending = (
    Vec<(ConnectionKey, oneshot::Sender<Result<u32, String>>)>,
    bool,
);

/// A connection's (local, remote) addresses.
type ConnectionKey = (SocketAddr, SocketAddr);

/// One lookup: joins the lookups waiting for the next read of the table. One reader at a time,
/// on a blocking thread, answers every lookup that was waiting when its read began: a read costs
/// about the same for one connection as for a thousand (the kernel walks its whole hash table),
/// so a flood of connections costs a few reads, and a member's new connection waits for at most
/// two, instead of queueing behind every other lookup.
async fn look_up(local: SocketAddr, remote: SocketAddr) -> Result<u32, String> {
    let (tx, rx) = oneshot::channel();
    let start = {
        let mut pending = PENDING.lock().unwrap_or_else(PoisonError::into_inner);
        pending.0.push(((local, remote), tx));
        !std::mem::replace(&mut pending.1, true)
    };
    if start {
        tokio::task::spawn_blocking(read_while_pending);
    }
    match tokio::time::timeout(LOOKUP_TIMEOUT, rx).await {
        Ok(answer) => answer.unwrap_or_else(|_| Err("the lookup was dropped".to_owned())),
        Err(_) => {
            // A reader that never ran (a runtime shutting down refuses blocking tasks) must not
            // keep every later lookup waiting: the next one starts a reader of its own.
            PENDING.lock().unwrap_or_else(PoisonError::into_inner).1 = false;
            Err(format!(
                "/proc/net/tcp was not read within {} ms",
                LOOKUP_TIMEOUT.as_millis()
            ))
        }
    }
}

/// How long a lookup waits for a read of the table.
const LOOKUP_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

static PENDING: LazyLock<Mutex<Pending>> = LazyLock::new(Mutex::default);

/// Reads the table for the waiting lookups until none waits. After a read it rests as long as
/// the read took, so that lookups never take more than half of a core, whoever asks.
fn read_while_pending() {
    loop {
        let batch = {
            let mut pending = PENDING.lock().unwrap_or_else(PoisonError::into_inner);
            if pending.0.is_empty() {
                pending.1 = false;
                return;
            }
            std::mem::take(&mut pending.0)
        };
        let started = std::time::Instant::now();
        let keys: Vec<ConnectionKey> = batch.iter().map(|(key, _)| *key).collect();
        let found = peer_uids(&keys);
        for ((key, tx), owner) in batch.into_iter().zip(found) {
            let _ = tx.send(owner.ok_or_else(|| {
                format!(
                    "no socket from {} to {} in /proc/net/tcp or tcp6",
                    key.1, key.0
                )
            }));
        }
        std::thread::sleep(started.elapsed().min(READ_REST_MAX));
    }
}

/// Checks at start that the owner of a connection to `listen` (the bound address) can be found:
/// the listening socket's own line must be in the table and owned by `uid`. The error names the
/// cause and the ways out.
pub fn check_available(listen: SocketAddr, uid: u32) -> Result<(), String> {
    let found = find_socket(listen, None, true);
    let why = match found {
        Ok(owner) if owner == uid => return Ok(()),
        Ok(owner) => format!("its line there names uid {owner}, not this process's uid {uid}"),
        Err(why) => why,
    };
    Err(format!(
        "lockd: --listen {listen} is a plaintext loopback port: its internal services (Raft, \
         forwarding) are served only to processes of this user (uid {uid}), found by the \
         owner of each connecting socket in /proc/net/tcp, and this node cannot read that \
         ({why}); give --tls-cert, --tls-key and --peer-ca (`lockd dev --tls`), or \
         --insecure-plaintext to let every local process call them"
    ))
}

/// The uid that owns the socket at the other end of each connection between `local` (this
/// node's) and `remote` (the caller's), in one read of the table; `None` where none is found
/// or the table cannot be read (the reason is logged).
fn peer_uids(connections: &[ConnectionKey]) -> Vec<Option<u32>> {
    let wanted: Vec<(SocketAddr, Option<SocketAddr>)> = connections
        .iter()
        .map(|(local, remote)| (*remote, Some(*local)))
        .collect();
    match find_sockets(&wanted, false) {
        Ok(found) => found,
        Err(why) => {
            tracing::warn!(reason = why, "lockd: cannot read the owners of connections");
            vec![None; connections.len()]
        }
    }
}

/// The owner of the socket bound to `local` and connected to `remote` (`None`: the listening
/// socket of `local` with `listening`).
fn find_socket(
    local: SocketAddr,
    remote: Option<SocketAddr>,
    listening: bool,
) -> Result<u32, String> {
    find_sockets(&[(local, remote)], listening)?
        .pop()
        .flatten()
        .ok_or_else(|| match remote {
            Some(remote) => {
                format!("no socket from {local} to {remote} in /proc/net/tcp or tcp6")
            }
            None => format!("no listening socket on {local} in /proc/net/tcp or tcp6"),
        })
}

/// TCP states whose lines never stand for a live connection's socket (see `include/net/tcp_states.h`):
/// TIME_WAIT (a closed socket's memory, always uid 0), LISTEN, NEW_SYN_RECV (a request not yet
/// accepted).
#[cfg(target_os = "linux")]
const TCP_TIME_WAIT: u8 = 0x06;
#[cfg(target_os = "linux")]
const TCP_ESTABLISHED: u8 = 0x01;
#[cfg(target_os = "linux")]
const TCP_LISTEN: u8 = 0x0A;
#[cfg(target_os = "linux")]
const TCP_NEW_SYN_RECV: u8 = 0x0C;

/// The owners of the sockets bound to each `local` and connected to its `remote` (`None`: the
/// listening socket of `local`, with `listening`), in one pass over the tables; `None` for a
/// socket not found.
#[cfg(target_os = "linux")]
fn find_sockets(
    wanted: &[(SocketAddr, Option<SocketAddr>)],
    listening: bool,
) -> Result<Vec<Option<u32>>, String> {
    use std::collections::HashMap;
    use std::io::BufRead;

    let mut index: HashMap<(SocketAddr, Option<SocketAddr>), Vec<usize>> = HashMap::new();
    for (i, (local, remote)) in wanted.iter().enumerate() {
        index
            .entry((canonical(*local), remote.map(canonical)))
            .or_default()
            .push(i);
    }
    let mut found = vec![None; wanted.len()];
    let mut missing = index.len();
    // An IPv4 address may be on an IPv6 socket too (v4-mapped), listed in tcp6.
    for (i, table) in ["/proc/net/tcp", "/proc/net/tcp6"].iter().enumerate() {
        if missing == 0 {
            break;
        }
        let file = match std::fs::File::open(table) {
            Ok(f) => f,
            // No IPv6 in this kernel: every socket is in the first table.
            Err(e) if i > 0 && e.kind() == std::io::ErrorKind::NotFound => break,
            Err(e) => return Err(format!("reading {table}: {e}")),
        };
        let reader = std::io::BufReader::with_capacity(64 * 1024, file);
        for line in reader.lines() {
            let line = line.map_err(|e| format!("reading {table}: {e}"))?;
            let Some(entry) = Entry::parse(&line) else {
                continue;
            };
            let key = if listening {
                if entry.state != TCP_LISTEN {
                    continue;
                }
                (entry.local, None)
            } else {
                if matches!(entry.state, TCP_TIME_WAIT | TCP_LISTEN | TCP_NEW_SYN_RECV) {
                    continue;
                }
                // A socket no process holds any more (closed, finishing its FIN exchange) is
                // listed as uid 0 with inode 0: it stands for nobody. An established one with
                // inode 0 is accepted by the kernel and not yet by its process, and carries the
                // listening socket's owner.
                if entry.inode == 0 && entry.state != TCP_ESTABLISHED {
                    continue;
                }
                (entry.local, Some(entry.remote))
            };
            if let Some(slots) = index.remove(&key) {
                for slot in slots {
                    found[slot] = Some(entry.uid);
                }
                missing -= 1;
                if missing == 0 {
                    break;
                }
            }
        }
    }
    Ok(found)
}

/// Other platforms list no socket owners where safe code can read them: fail closed.
#[cfg(not(target_os = "linux"))]
fn find_sockets(
    _wanted: &[(SocketAddr, Option<SocketAddr>)],
    _listening: bool,
) -> Result<Vec<Option<u32>>, String> {
    Err("the owner of a TCP socket is read from /proc/net/tcp, which only Linux has".to_owned())
}

/// An address with a v4-mapped IPv6 address as the IPv4 address it stands for.
#[cfg(target_os = "linux")]
fn canonical(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// The fields of one line of `/proc/net/tcp` or `/proc/net/tcp6` that tell a socket apart.
#[cfg(target_os = "linux")]
#[derive(Debug, PartialEq, Eq)]
struct Entry {
    local: SocketAddr,
    remote: SocketAddr,
    state: u8,
    uid: u32,
    /// 0 for a socket no process holds.
    inode: u64,
}

#[cfg(target_os = "linux")]
impl Entry {
    /// `sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid ...`; `None`
    /// for the header line or anything else that is not a socket's line.
    fn parse(line: &str) -> Option<Entry> {
        let mut fields = line.split_ascii_whitespace();
        fields.next()?.strip_suffix(':')?;
        let local = parse_address(fields.next()?)?;
        let remote = parse_address(fields.next()?)?;
        let state = u8::from_str_radix(fields.next()?, 16).ok()?;
        let uid = fields.nth(3)?.parse().ok()?;
        let inode = fields.nth(1)?.parse().ok()?;
        Some(Entry {
            local,
            remote,
            state,
            uid,
            inode,
        })
    }
}

/// `0100007F:1B59` (IPv4) or 32 hex digits and a port (IPv6). The kernel prints each 32-bit word
/// of the address as it lies in memory, read as a native-endian integer, and the port in host
/// order.
#[cfg(target_os = "linux")]
fn parse_address(s: &str) -> Option<SocketAddr> {
    let (ip, port) = s.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |hex: &str| u32::from_str_radix(hex, 16).ok().map(u32::to_ne_bytes);
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(ip)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for (i, chunk) in bytes.chunks_exact_mut(4).enumerate() {
                chunk.copy_from_slice(&word(ip.get(8 * i..8 * i + 8)?)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(canonical(SocketAddr::new(ip, port)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines as a little-endian Linux prints them (the parser reads native order, so these
    /// hold on little-endian hosts only).
    #[cfg(all(target_os = "linux", target_endian = "little"))]
    #[test]
    fn lines_of_the_socket_tables_parse() {
        let v4 = "   3: 0A00007F:C350 0100007F:1B59 01 00000000:00000000 02:000A7D23 00000000 \
                  65534        0 123456 2 0000000000000000 20 4 30 10 -1";
        assert_eq!(
            Entry::parse(v4),
            Some(Entry {
                local: "127.0.0.10:50000".parse().unwrap(),
                remote: "127.0.0.1:7001".parse().unwrap(),
                state: 1,
                uid: 65534,
                inode: 123456,
            })
        );
        // ::1 and a v4-mapped 127.0.0.1, as tcp6 lists them.
        let v6 = "   0: 00000000000000000000000001000000:1B59 0000000000000000FFFF00000100007F:D431 \
                  0A 00000000:00000000 00:00000000 00000000  1000        0 42 1 0000000000000000 100 0 0 10 0";
        let e = Entry::parse(v6).unwrap();
        assert_eq!(e.local, "[::1]:7001".parse().unwrap());
        assert_eq!(e.remote, "127.0.0.1:54321".parse().unwrap());
        assert_eq!((e.state, e.uid), (TCP_LISTEN, 1000));
        // The header and broken lines are no sockets.
        assert_eq!(
            Entry::parse(
                "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode"
            ),
            None
        );
        assert_eq!(Entry::parse("   3: 0A00007F 0100007F:1B59 01"), None);
        assert_eq!(Entry::parse(""), None);
    }

    #[test]
    fn refusals_name_both_users_and_pass_the_own_one() {
        let mode = LocalPeers::SameUser(1000);
        assert_eq!(mode.refusal(Some(&PeerOwner(Ok(1000))), "x"), None);
        let e = mode
            .refusal(Some(&PeerOwner(Ok(65534))), "raft message refused")
            .unwrap();
        assert!(
            e.starts_with("raft message refused: ")
                && e.contains("same user (uid 1000)")
                && e.contains("belongs to uid 65534"),
            "{e}"
        );
        let e = mode
            .refusal(Some(&PeerOwner(Err("gone".into()))), "x")
            .unwrap();
        assert!(e.contains("not known (gone)"), "{e}");
        assert!(mode.refusal(None, "x").unwrap().contains("not looked up"));
        assert_eq!(LocalPeers::Unchecked.refusal(None, "x"), None);
    }

    /// Goal: with TLS in `lockd dev` (`AdminSameUser`) the admin calls are kept to the node's
    /// user, while the internal services and forwarding headers are left to the certificates.
    #[test]
    fn dev_tls_keeps_admin_calls_only_to_the_own_user() {
        assert_eq!(
            LocalPeers::of(true, false, true),
            LocalPeers::AdminSameUser(nix::unistd::geteuid().as_raw())
        );
        assert_eq!(LocalPeers::of(true, false, false), LocalPeers::Unchecked);
        let mode = LocalPeers::AdminSameUser(1000);
        assert_eq!(
            mode.refusal(Some(&PeerOwner(Ok(65534))), "raft message refused"),
            None
        );
        assert_eq!(
            mode.admin_refusal(Some(&PeerOwner(Ok(1000))), "TransferLeader"),
            None
        );
        let e = mode
            .admin_refusal(Some(&PeerOwner(Ok(65534))), "TransferLeader")
            .unwrap();
        assert!(
            e.starts_with("TransferLeader refused: ")
                && e.contains("uid 1000")
                && e.contains("belongs to uid 65534"),
            "{e}"
        );
        assert!(mode.admin_refusal(None, "AddMember").is_some());
        // Without TLS the admin calls are kept as before; unchecked, not at all.
        assert!(
            LocalPeers::SameUser(1000)
                .admin_refusal(Some(&PeerOwner(Ok(65534))), "AddMember")
                .unwrap()
                .starts_with("AddMember refused: ")
        );
        assert_eq!(LocalPeers::Unchecked.admin_refusal(None, "AddMember"), None);
    }

    /// Goal: the lookup finds the owner of a real loopback connection, in both directions, and
    /// the listening socket at start; nothing for a connection that does not exist. Method: a
    /// listener and a connection in this process, whose uid both sockets carry.
    #[cfg(target_os = "linux")]
    #[test]
    fn a_real_loopback_connection_is_found_with_this_users_uid() {
        let uid = nix::unistd::geteuid().as_raw();
        for host in ["127.0.0.1:0", "[::1]:0"] {
            let Ok(listener) = std::net::TcpListener::bind(host) else {
                continue; // no IPv6 on this host
            };
            let addr = listener.local_addr().unwrap();
            check_available(addr, uid).unwrap();
            let client = std::net::TcpStream::connect(addr).unwrap();
            let (_server, remote) = listener.accept().unwrap();
            assert_eq!(remote, client.local_addr().unwrap());
            let nobody: SocketAddr = SocketAddr::new(addr.ip(), 1);
            assert_eq!(
                peer_uids(&[(addr, remote), (addr, nobody), (addr, remote)]),
                vec![Some(uid), None, Some(uid)]
            );
        }
    }

    /// Goal: a node dialling a member's port finds the owner of the socket that accepted it,
    /// also before the listener's process has called `accept` (the kernel lists that socket with
    /// inode 0 and the listener's uid), and refuses a port of another user. Method: a listener
    /// of this process, dialled without accepting; checked against this uid and against another.
    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_dialled_port_must_belong_to_this_user() {
        let uid = nix::unistd::geteuid().as_raw();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let stream = tokio::net::TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        check_listener(&stream, uid).await.unwrap();
        let other = uid.wrapping_add(1);
        let e = check_listener(&stream, other).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
        assert!(
            e.to_string().contains(&format!("uid {other}"))
                && e.to_string().contains(&format!("belongs to uid {uid}")),
            "{e}"
        );
        drop(listener);
    }
}
