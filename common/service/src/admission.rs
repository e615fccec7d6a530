//! Places for connections in a phase an untrusted peer can hold open at little cost to itself
//! (a connection at all, a TLS handshake, a Postgres startup): at most so many at once in all, and
//! at most so many from one source address, so one client that opens sockets and sends nothing
//! cannot take every place. Trusted sources (a cluster's own members) take no place from others
//! and have a bound of their own far above their needs; the set of them is a [`TrustedSources`]
//! handle that the owner may replace at any time (members are added, removed and moved at
//! runtime), shared by every phase that trusts the same sources.
//!
//! A refused connection is closed at once rather than made to wait: waiting would let the silent
//! ones hold up everyone behind them in the listen backlog.

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError, RwLock};

/// The places of one phase, shared by every connection that enters it.
#[derive(Clone)]
pub struct SourceSlots {
    table: Arc<Mutex<Table>>,
    total_max: usize,
    per_source_max: usize,
    trusted: TrustedSources,
}

/// Addresses admitted without a place, replaceable while connections come in. Cheap to clone;
/// clones share the set. A connection admitted as trusted stays uncounted after its address
/// leaves the set (it took no place to give back); later ones are counted.
#[derive(Clone, Default)]
pub struct TrustedSources(Arc<RwLock<Arc<[IpAddr]>>>);

impl TrustedSources {
    /// A set of `addresses` (IPv4-mapped IPv6 forms count as IPv4).
    pub fn new(addresses: Vec<IpAddr>) -> Self {
        let t = TrustedSources::default();
        t.set(addresses);
        t
    }

    /// Replaces the set; returns whether it changed.
    pub fn set(&self, addresses: Vec<IpAddr>) -> bool {
        let mut canonical: Vec<IpAddr> = addresses.iter().map(|ip| ip.to_canonical()).collect();
        canonical.sort_unstable();
        canonical.dedup();
        if *self.get() == *canonical {
            return false;
        }
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = canonical.into();
        true
    }

    /// The set now, sorted.
    pub fn get(&self) -> Arc<[IpAddr]> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Whether `address` (in any form: IPv4-mapped counts as IPv4) is in the set now.
    pub fn trusts(&self, address: IpAddr) -> bool {
        self.contains(&address.to_canonical())
    }

    fn contains(&self, canonical: &IpAddr) -> bool {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .binary_search(canonical)
            .is_ok()
    }
}

#[derive(Default)]
struct Table {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
    /// Trusted sources' connections, per source: outside `total`, bounded by
    /// [`TRUSTED_PER_SOURCE_MAX`] only.
    trusted_by_source: HashMap<IpAddr, usize>,
}

/// Connections one trusted source may hold at once. Far above what a member opens (a few
/// channels), so a member is never refused in practice; but an address that became trusted
/// wrongly (a spoofed DNS answer for a member's name, an unauthenticated `AddMember` in open
/// mode) cannot hold descriptors without bound.
pub const TRUSTED_PER_SOURCE_MAX: usize = 1_024;

/// Why a connection got no place.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// All places are held.
    #[error("{max} connections already hold a place")]
    Total {
        /// The bound in all.
        max: usize,
    },
    /// The source's places are held.
    #[error("{max} connections from {address} already hold a place")]
    Source {
        /// The source address.
        address: IpAddr,
        /// The bound per source.
        max: usize,
    },
}

/// A connection's place; given back when dropped, however the connection ends.
#[must_use = "the place is given back when this is dropped"]
pub struct SourceSlot {
    /// The table and source it counts in, and whether it counts as trusted.
    counted: Option<(Arc<Mutex<Table>>, IpAddr, bool)>,
}

impl SourceSlots {
    /// At most `total_max` places, `per_source_max` of them for one address; addresses in
    /// `trusted` (as it is when a connection comes) take no place from others and are admitted
    /// up to [`TRUSTED_PER_SOURCE_MAX`] connections each, whatever the others hold.
    pub fn new(total_max: usize, per_source_max: usize, trusted: TrustedSources) -> Self {
        SourceSlots {
            table: Arc::default(),
            total_max,
            per_source_max,
            trusted,
        }
    }

    /// A place for a connection from `address`, or why there is none.
    pub fn admit(&self, address: IpAddr) -> Result<SourceSlot, Refused> {
        // An IPv4 client of a listener on `[::]` arrives as `::ffff:a.b.c.d`: count it (and
        // trust it) as `a.b.c.d`. IPv6 sources count by full address: a /64 is often a whole
        // subnet or a node's pods, not one host.
        let source = address.to_canonical();
        let trusted = self.trusted.contains(&source);
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if trusted {
            let held = t.trusted_by_source.entry(source).or_insert(0);
            if *held >= TRUSTED_PER_SOURCE_MAX {
                return Err(Refused::Source {
                    address: source,
                    max: TRUSTED_PER_SOURCE_MAX,
                });
            }
            *held += 1;
            return Ok(SourceSlot {
                counted: Some((self.table.clone(), source, true)),
            });
        }
        if t.total >= self.total_max {
            return Err(Refused::Total {
                max: self.total_max,
            });
        }
        if t.by_source.get(&source).copied().unwrap_or(0) >= self.per_source_max {
            return Err(Refused::Source {
                address: source,
                max: self.per_source_max,
            });
        }
        t.total += 1;
        *t.by_source.entry(source).or_insert(0) += 1;
        Ok(SourceSlot {
            counted: Some((self.table.clone(), source, false)),
        })
    }

    /// Places held now (trusted sources' connections not included).
    pub fn held(&self) -> usize {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .total
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let Some((table, source, trusted)) = self.counted.take() else {
            return;
        };
        let mut t = table.lock().unwrap_or_else(PoisonError::into_inner);
        let by_source = if trusted {
            &mut t.trusted_by_source
        } else {
            t.total -= 1;
            &mut t.by_source
        };
        if let Entry::Occupied(mut e) = by_source.entry(source) {
            *e.get_mut() -= 1;
            if *e.get() == 0 {
                e.remove();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// Goal: one source cannot take more than its share, all sources together not more than the
    /// total, trusted sources are never refused, and places come back when dropped. Method:
    /// fill each bound and check the refusal names it.
    #[test]
    fn bounds_per_source_and_in_all_and_trusted_sources_always_pass() {
        let slots = SourceSlots::new(4, 2, TrustedSources::new(vec![ip("10.0.0.9")]));
        let a1 = slots.admit(ip("10.0.0.1")).unwrap();
        let _a2 = slots.admit(ip("10.0.0.1")).unwrap();
        let refused = slots.admit(ip("10.0.0.1")).err().unwrap();
        assert_eq!(
            refused,
            Refused::Source {
                address: ip("10.0.0.1"),
                max: 2
            }
        );
        assert!(refused.to_string().contains("10.0.0.1"), "{refused}");
        let _b1 = slots.admit(ip("10.0.0.2")).unwrap();
        let _b2 = slots.admit(ip("10.0.0.2")).unwrap();
        assert_eq!(
            slots.admit(ip("10.0.0.3")).err(),
            Some(Refused::Total { max: 4 })
        );
        let trusted: Vec<_> = (0..10)
            .map(|_| slots.admit(ip("10.0.0.9")).unwrap())
            .collect();
        assert_eq!(slots.held(), 4, "trusted sources take no place");
        drop(trusted);
        drop(a1);
        assert_eq!(slots.held(), 3);
        let _a3 = slots.admit(ip("10.0.0.1")).unwrap();
        assert_eq!(
            slots.admit(ip("10.0.0.1")).err(),
            Some(Refused::Total { max: 4 })
        );
    }

    /// Goal: an IPv4 client seen through a listener on `[::]` counts as itself (and a trusted
    /// IPv4 member stays trusted); IPv6 addresses count one by one. Method: mapped and plain
    /// forms of one address share its bound; two addresses of one /64 have a bound each.
    #[test]
    fn mapped_ipv4_counts_as_ipv4_and_ipv6_addresses_one_by_one() {
        let slots = SourceSlots::new(100, 2, TrustedSources::new(vec![ip("10.0.0.9")]));
        let _a = slots.admit(ip("10.0.0.1")).unwrap();
        let _b = slots.admit(ip("::ffff:10.0.0.1")).unwrap();
        assert!(slots.admit(ip("10.0.0.1")).is_err());
        let trusted: Vec<_> = (0..5)
            .map(|_| slots.admit(ip("::ffff:10.0.0.9")).unwrap())
            .collect();
        assert_eq!(slots.held(), 2);
        let _c = slots.admit(ip("2001:db8:1:2::1")).unwrap();
        let _d = slots.admit(ip("2001:db8:1:2::1")).unwrap();
        let refused = slots.admit(ip("2001:db8:1:2::1")).err().unwrap();
        assert!(refused.to_string().contains("2001:db8:1:2::1"), "{refused}");
        assert!(slots.admit(ip("2001:db8:1:2::2")).is_ok());
        drop(trusted);
    }

    /// Goal: a source that becomes trusted (a member added at runtime) is admitted beyond the
    /// bounds from then on, one that stops being trusted (a removed member) is counted again,
    /// and a connection admitted while trusted gives back no place it never took. Method:
    /// replace the set between admissions.
    #[test]
    fn a_replaced_set_applies_to_the_next_connection() {
        let trusted = TrustedSources::default();
        let slots = SourceSlots::new(4, 1, trusted.clone());
        let _a = slots.admit(ip("10.0.0.5")).unwrap();
        assert!(slots.admit(ip("10.0.0.5")).is_err());
        assert!(trusted.set(vec![ip("::ffff:10.0.0.5"), ip("10.0.0.5")]));
        assert!(!trusted.set(vec![ip("10.0.0.5")]), "the same set");
        assert_eq!(&*trusted.get(), &[ip("10.0.0.5")]);
        let while_trusted: Vec<_> = (0..8)
            .map(|_| slots.admit(ip("10.0.0.5")).unwrap())
            .collect();
        assert_eq!(slots.held(), 1);
        assert!(trusted.set(Vec::new()));
        assert!(slots.admit(ip("10.0.0.5")).is_err(), "counted again");
        drop(while_trusted);
        assert_eq!(slots.held(), 1, "trusted connections gave back no place");
    }

    /// Goal: a trusted source is admitted whatever the others hold, but not without bound (an
    /// address trusted wrongly cannot take every descriptor), and its places come back.
    /// Method: fill the bound of one trusted address while the untrusted total is full.
    #[test]
    fn a_trusted_source_has_a_large_bound_of_its_own() {
        let slots = SourceSlots::new(1, 1, TrustedSources::new(vec![ip("10.0.0.9")]));
        let _full = slots.admit(ip("10.0.0.1")).unwrap();
        let mut held: Vec<_> = (0..TRUSTED_PER_SOURCE_MAX)
            .map(|_| slots.admit(ip("10.0.0.9")).unwrap())
            .collect();
        let refused = slots.admit(ip("10.0.0.9")).err().unwrap();
        assert_eq!(
            refused,
            Refused::Source {
                address: ip("10.0.0.9"),
                max: TRUSTED_PER_SOURCE_MAX
            }
        );
        held.pop();
        assert!(slots.admit(ip("10.0.0.9")).is_ok());
        assert_eq!(slots.held(), 1);
    }
}
