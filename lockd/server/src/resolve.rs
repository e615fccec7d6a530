//! Every name lookup of a node, one at a time. A node resolves few names (its members'), so
//! nothing is lost by serializing them, and some resolvers are not safe when lookups run on
//! several threads at once: nss_wrapper 1.1.12, which the test suite preloads to give test names
//! to loopback addresses, crashes the process when a lookup runs while another thread reloads
//! its hosts file (or opens it for the first time). The lock is held by the blocking lookup
//! itself, so a lookup that outlives its caller's timeout still keeps the next one waiting.

use std::io;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

/// Longest a caller waits for one lookup, its wait for the lookups ahead of it included.
pub const NAME_LOOKUP_TIMEOUT: Duration = Duration::from_secs(2);

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// The addresses of `addr` (`host:port`, the host a name, an IPv4 address or a bracketed IPv6
/// address). An address needs no lookup and is answered at once.
pub async fn lookup(addr: &str) -> io::Result<Vec<SocketAddr>> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    let owned = addr.to_owned();
    let job = tokio::task::spawn_blocking(move || {
        let _one = ONE_AT_A_TIME.lock().unwrap_or_else(PoisonError::into_inner);
        owned.as_str().to_socket_addrs().map(Iterator::collect)
    });
    match tokio::time::timeout(NAME_LOOKUP_TIMEOUT, job).await {
        Ok(Ok(found)) => {
            found.map_err(|e| io::Error::new(e.kind(), format!("looking up {addr}: {e}")))
        }
        Ok(Err(e)) => Err(io::Error::other(format!("looking up {addr}: {e}"))),
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!(
                "looking up {addr}: no answer from the resolver within {} s",
                NAME_LOOKUP_TIMEOUT.as_secs()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: addresses are answered without a lookup, names are looked up, a name that does
    /// not exist is an error naming it. Method: `localhost`, literals, a `.invalid` name.
    #[tokio::test]
    async fn literals_at_once_names_looked_up_errors_name_the_address() {
        assert_eq!(
            lookup("127.0.0.1:7001").await.unwrap(),
            vec!["127.0.0.1:7001".parse().unwrap()]
        );
        assert_eq!(
            lookup("[::1]:7001").await.unwrap(),
            vec!["[::1]:7001".parse().unwrap()]
        );
        let local = lookup("localhost:7001").await.unwrap();
        assert!(
            local
                .iter()
                .all(|a| a.port() == 7001 && a.ip().is_loopback()),
            "{local:?}"
        );
        let missing = lookup("no-such-node.invalid:7001").await.unwrap_err();
        assert!(
            missing.to_string().contains("no-such-node.invalid:7001"),
            "{missing}"
        );
    }
}
