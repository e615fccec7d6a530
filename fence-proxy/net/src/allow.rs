//! `--allow-client CIDR`: the networks whose clients the proxy serves at all.
//!
//! Behind the proxy the upstream sees the proxy's address, not the client's, so the network
//! rules the upstream would apply (pg_hba.conf, firewall rules of an HTTP service) no longer
//! tell clients apart. This list puts a network rule back in front of the upstream: a client from
//! elsewhere is refused before any upstream connection is made.

use std::net::IpAddr;

use ipnet::IpNet;

/// The networks allowed to connect; empty allows every address (the default, as before).
#[derive(Clone, Debug, Default)]
pub struct AllowList {
    /// Allowed networks, IPv4 and IPv6, as given.
    nets: Vec<IpNet>,
}

impl AllowList {
    /// Allows clients from `nets`; an empty list allows every address.
    pub fn new(nets: Vec<IpNet>) -> AllowList {
        AllowList { nets }
    }

    /// Whether no restriction is configured.
    pub fn is_open(&self) -> bool {
        self.nets.is_empty()
    }

    /// Whether a client at `ip` may connect. An IPv4 client of a dual-stack listener arrives as
    /// `::ffff:a.b.c.d`; it is matched as the IPv4 address it is.
    pub fn allows(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.is_empty() || self.nets.iter().any(|n| n.contains(&ip))
    }
}

impl std::fmt::Display for AllowList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.nets.is_empty() {
            return f.write_str("any");
        }
        let nets: Vec<String> = self.nets.iter().map(ToString::to_string).collect();
        f.write_str(&nets.join(","))
    }
}

/// Parses one `--allow-client` value: `10.0.0.0/8`, `fd00::/8`, or a single address (`/32` or
/// `/128`). A block with host bits set (`10.0.0.1/8`) is refused: it usually means a typo, and
/// silently widening or narrowing an access rule is worse than a clear error.
pub fn parse_cidr(s: &str) -> Result<IpNet, String> {
    let s = s.trim();
    if let Ok(ip) = s.parse::<IpAddr>() {
        return Ok(IpNet::from(ip));
    }
    let net: IpNet = s.parse().map_err(|_| {
        format!("--allow-client {s:?} is not a network like 10.0.0.0/8, fd00::/8 or an address")
    })?;
    if net.trunc() != net {
        return Err(format!(
            "--allow-client {s:?} has host bits set; did you mean {}?",
            net.trunc()
        ));
    }
    Ok(net)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn networks_and_addresses() {
        let list = AllowList::new(vec![
            parse_cidr("10.1.0.0/16").unwrap(),
            parse_cidr("127.0.0.1").unwrap(),
            parse_cidr("fd00::/8").unwrap(),
        ]);
        assert!(list.allows("10.1.200.3".parse().unwrap()));
        assert!(!list.allows("10.2.0.1".parse().unwrap()));
        assert!(list.allows("127.0.0.1".parse().unwrap()));
        assert!(!list.allows("127.0.0.2".parse().unwrap()));
        assert!(list.allows("fd12::1".parse().unwrap()));
        assert!(!list.allows("fe80::1".parse().unwrap()));
        // A dual-stack listener reports IPv4 clients as mapped IPv6 addresses.
        assert!(list.allows("::ffff:10.1.0.9".parse().unwrap()));
        assert!(!list.allows("::ffff:10.9.0.9".parse().unwrap()));
        assert_eq!(list.to_string(), "10.1.0.0/16,127.0.0.1/32,fd00::/8");
    }

    #[test]
    fn empty_list_allows_everyone() {
        let list = AllowList::default();
        assert!(list.is_open());
        assert!(list.allows("203.0.113.9".parse().unwrap()));
    }

    #[test]
    fn bad_values_are_named() {
        let e = parse_cidr("10.0.0.1/8").unwrap_err();
        assert!(
            e.contains("\"10.0.0.1/8\"") && e.contains("10.0.0.0/8"),
            "{e}"
        );
        let e = parse_cidr("example.com").unwrap_err();
        assert!(e.contains("\"example.com\""), "{e}");
        assert!(parse_cidr("10.0.0.0/33").is_err());
    }
}
