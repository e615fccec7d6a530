//! A fault-injecting TCP relay: it listens on one address, forwards every connection to one
//! target, and applies per-source faults that the nemesis switches at run time.
//!
//! Callers are told apart by their source IP (each lockd node binds its outgoing peer connections
//! to its own `--listen` IP). Two faults exist:
//! - **blackhole** a source: bytes in both directions are read and thrown away, as a cut network
//!   does (the sender sees no error until its own timeout); new connections are accepted and
//!   blackholed too;
//! - **drop replies**: the request bytes reach the target, the reply bytes are thrown away (a reply
//!   lost after the target committed).
//!
//! A connection that lost bytes is "tainted": its byte stream is no longer valid, so when the fault
//! is lifted the relay closes it and the caller reconnects, as after a real network cut.

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// How often a tainted connection checks whether its fault was lifted.
const HEAL_POLL: Duration = Duration::from_millis(50);
/// Copy buffer per direction.
const BUF_BYTES: usize = 16 * 1024;

/// The faults a relay applies now.
#[derive(Default, Debug)]
struct Policy {
    /// Sources whose traffic (both directions) is thrown away.
    blackholed: HashSet<IpAddr>,
    /// Reply bytes (target to caller) of every connection are thrown away.
    drop_replies: bool,
}

/// A handle to a running relay; dropping it stops the relay and closes its connections.
pub struct Relay {
    pub listen: SocketAddr,
    pub target: SocketAddr,
    policy: Arc<Mutex<Policy>>,
    stop: CancellationToken,
}

impl Relay {
    /// Binds `listen` and starts relaying to `target` on the current Tokio runtime.
    pub async fn start(listen: SocketAddr, target: SocketAddr) -> anyhow::Result<Relay> {
        let listener = TcpListener::bind(listen)
            .await
            .map_err(|e| anyhow::anyhow!("relay binding {listen}: {e}"))?;
        let policy = Arc::new(Mutex::new(Policy::default()));
        let stop = CancellationToken::new();
        tokio::spawn(accept_loop(listener, target, policy.clone(), stop.clone()));
        Ok(Relay {
            listen,
            target,
            policy,
            stop,
        })
    }

    /// Throws away all traffic from (and to) callers with source IP `ip` until [`Relay::unblock`].
    pub fn block(&self, ip: IpAddr) {
        self.policy.lock().unwrap().blackholed.insert(ip);
    }

    pub fn unblock(&self, ip: IpAddr) {
        self.policy.lock().unwrap().blackholed.remove(&ip);
    }

    /// Starts or stops throwing away replies.
    pub fn set_drop_replies(&self, on: bool) {
        self.policy.lock().unwrap().drop_replies = on;
    }

    /// Lifts every fault.
    pub fn heal(&self) {
        let mut p = self.policy.lock().unwrap();
        p.blackholed.clear();
        p.drop_replies = false;
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn accept_loop(
    listener: TcpListener,
    target: SocketAddr,
    policy: Arc<Mutex<Policy>>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            a = listener.accept() => a,
        };
        let Ok((inbound, peer)) = accepted else {
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        let _ = inbound.set_nodelay(true);
        tokio::spawn(connection(
            inbound,
            peer.ip(),
            target,
            policy.clone(),
            stop.clone(),
        ));
    }
}

/// Which bytes of one direction pass now.
fn passes(policy: &Mutex<Policy>, source: IpAddr, reply: bool) -> bool {
    let p = policy.lock().unwrap();
    !(p.blackholed.contains(&source) || (reply && p.drop_replies))
}

fn faulted(policy: &Mutex<Policy>, source: IpAddr) -> bool {
    let p = policy.lock().unwrap();
    p.blackholed.contains(&source) || p.drop_replies
}

async fn connection(
    inbound: TcpStream,
    source: IpAddr,
    target: SocketAddr,
    policy: Arc<Mutex<Policy>>,
    stop: CancellationToken,
) {
    let tainted = Arc::new(AtomicBool::new(false));
    let (mut in_read, mut in_write) = inbound.into_split();
    // A blackholed caller cannot reach the target at all: hold its connection open and discard.
    let outbound = if passes(&policy, source, false) {
        TcpStream::connect(target).await.ok()
    } else {
        None
    };
    let Some(outbound) = outbound else {
        tainted.store(true, Ordering::SeqCst);
        let mut buf = vec![0u8; BUF_BYTES];
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(HEAL_POLL) => {
                    if !faulted(&policy, source) { return; }
                }
                n = in_read.read(&mut buf) => match n { Ok(0) | Err(_) => return, Ok(_) => {} },
            }
        }
    };
    let _ = outbound.set_nodelay(true);
    let (mut out_read, mut out_write) = outbound.into_split();
    let up = {
        let (policy, tainted) = (policy.clone(), tainted.clone());
        async move {
            let mut buf = vec![0u8; BUF_BYTES];
            loop {
                let n = match in_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if passes(&policy, source, false) {
                    if out_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                } else {
                    tainted.store(true, Ordering::SeqCst);
                }
            }
        }
    };
    let down = {
        let (policy, tainted) = (policy.clone(), tainted.clone());
        async move {
            let mut buf = vec![0u8; BUF_BYTES];
            loop {
                let n = match out_read.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                if passes(&policy, source, true) {
                    if in_write.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                } else {
                    tainted.store(true, Ordering::SeqCst);
                }
            }
        }
    };
    let healed = async {
        loop {
            tokio::time::sleep(HEAL_POLL).await;
            if tainted.load(Ordering::SeqCst) && !faulted(&policy, source) {
                return;
            }
        }
    };
    // Whichever ends first closes both sockets (dropping the halves).
    tokio::select! {
        _ = stop.cancelled() => {}
        _ = up => {}
        _ = down => {}
        _ = healed => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An echo server behind a relay: passes, blackholes a source, drops replies, heals.
    #[tokio::test]
    async fn relay_passes_blackholes_and_drops_replies() {
        let echo = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let echo_addr = echo.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = echo.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        let port = crate::pg::free_port();
        let relay = Relay::start(format!("127.0.0.1:{port}").parse().unwrap(), echo_addr)
            .await
            .unwrap();
        let roundtrip = |relay_addr: SocketAddr| async move {
            let mut s = TcpStream::connect(relay_addr).await.unwrap();
            s.write_all(b"ping").await.unwrap();
            let mut buf = [0u8; 4];
            tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut buf))
                .await
                .is_ok()
        };
        assert!(roundtrip(relay.listen).await, "healthy relay passes bytes");
        relay.block("127.0.0.1".parse().unwrap());
        assert!(
            !roundtrip(relay.listen).await,
            "blackholed source gets nothing"
        );
        relay.heal();
        assert!(roundtrip(relay.listen).await, "healed relay passes again");
        relay.set_drop_replies(true);
        assert!(!roundtrip(relay.listen).await, "replies are dropped");
        relay.heal();
        assert!(roundtrip(relay.listen).await);
    }
}
