//! Places of the waiting Acquires parked on the node the client called: at most
//! `--waits-per-source-max` from one source address and `--waits-max` on the node, each held
//! from the call's authorization until it returns.
//!
//! A waiting Acquire (`wait_timeout_ms` > 0) keeps its handler, its HTTP/2 stream and, through a
//! follower, a forwarded call to the leader for up to 5 minutes: about 16 KiB on each node it
//! passes (`receiving::CALL_BYTES`). The table's waiter limits bound the queues per resource and
//! per tenant, but the tenant is a name the client picks, so they bound nothing per client: one
//! address could park 256 connections x 1,024 streams = 262,144 calls (4 GiB) on one node. These
//! places bound them at the edge, before anything is proposed; the replicated table and its apply
//! are untouched, so replicas of different versions still apply alike.
//!
//! A call a member forwarded (see `ParkedWaits::admit`) takes no place on the leader: the
//! follower counted it against its client's address, and counting it again would make the
//! follower's address one source for all its clients. Members' addresses are otherwise counted
//! like any other: an application beside a node calls from the node's address.

use std::net::{IpAddr, Ipv4Addr};

use lockd_service_kit::admission::{Refused, SourceSlot, SourceSlots, TrustedSources};
use tonic::Status;

use crate::service::errors;

/// Default of `--waits-per-source-max`: the per-tenant waiter bound (10,000,
/// `lockd_core::limits::WAITERS_PER_TENANT_DEFAULT`), so one address may park as many waits as
/// one tenant may queue, far more than a client process needs (a worker pool waits with one call
/// per worker), and about 160 MiB of the node at 16 KiB a call.
pub const WAITS_PER_SOURCE_DEFAULT: usize = 10_000;
/// Default of `--waits-max`: about 1 GiB of the node at 16 KiB a call, and what 65,536 waiting
/// clients (more than 6 addresses at their bound) need; the follower's connections to the leader
/// are sized from it (`members::WAITS_PER_CONNECTION`).
pub const WAITS_DEFAULT: usize = 65_536;
/// Largest value of either flag: 1,000,000 waits are about 16 GiB of a node, and the follower
/// then opens up to 1,000 connections to the leader for them, under the 1,024 a member may hold
/// (`lockd_service_kit::admission::TRUSTED_PER_SOURCE_MAX`).
pub const WAITS_FLAG_MAX: usize = 1_000_000;

/// The `limit` a refusal for the source's bound names (ErrorInfo metadata,
/// `lockd_acquire_refusals_total{limit}`).
pub const LIMIT_PER_SOURCE: &str = "waits_per_source_max";
/// The `limit` a refusal for the node's bound names.
pub const LIMIT_NODE: &str = "waits_max";

/// The places of one node's parked waits. Cheap to clone; clones share the places.
#[derive(Clone)]
pub(crate) struct ParkedWaits {
    /// No trusted sources: every address counts, members' included.
    slots: SourceSlots,
    /// The members' addresses: a call marked forwarded from one of them takes no place.
    members: TrustedSources,
    /// Whether a call marked forwarded was authenticated as a member's (TLS: its node
    /// certificate); without TLS the mark is a header anyone can send, so only a member's
    /// address makes it count as forwarded.
    forwards_authenticated: bool,
}

impl ParkedWaits {
    pub fn new(
        per_source_max: usize,
        total_max: usize,
        members: TrustedSources,
        forwards_authenticated: bool,
    ) -> Self {
        ParkedWaits {
            slots: SourceSlots::new(total_max, per_source_max, TrustedSources::default()),
            members,
            forwards_authenticated,
        }
    }

    /// A place for a waiting call from `source` (`None`: the transport gave no address, counted
    /// as one unknown source), or the bound that refuses it (its `limit` name) and the status;
    /// `Ok(None)` for a call a member forwarded (`forwarded` as `auth::Caller` says), which takes
    /// none.
    pub fn admit(
        &self,
        forwarded: bool,
        source: Option<IpAddr>,
    ) -> Result<Option<SourceSlot>, (&'static str, Status)> {
        if forwarded
            && (self.forwards_authenticated || source.is_some_and(|ip| self.members.trusts(ip)))
        {
            return Ok(None);
        }
        let address = source.unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        self.slots.admit(address).map(Some).map_err(|refused| {
            let (limit, why) = match refused {
                Refused::Source { address, max } => (
                    LIMIT_PER_SOURCE,
                    format!(
                        "{} already has {max} waiting Acquires parked on this node, the most one \
                         address may have (--waits-per-source-max {max})",
                        source.map_or_else(
                            || "an unknown address".to_owned(),
                            |_| address.to_string()
                        )
                    ),
                ),
                Refused::Total { max } => (
                    LIMIT_NODE,
                    format!(
                        "this node already has {max} waiting Acquires parked, the most it takes \
                         (--waits-max {max}); a call from {}",
                        source.map_or_else(|| "an unknown address".to_owned(), |ip| ip.to_string())
                    ),
                ),
            };
            let status =
                errors::waits_exhausted(limit, format!("{why}; nothing was done, retry later"));
            (limit, status)
        })
    }

    #[cfg(test)]
    fn held(&self) -> usize {
        self.slots.held()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockd_api::errors::{Reason, reason_of};

    fn ip(s: &str) -> Option<IpAddr> {
        Some(s.parse().unwrap())
    }

    /// Goal: one address parks at most its bound of waits and the node at most its own, the
    /// refusal says which (code, reason, `limit`, the address and the bound), and places come back
    /// when calls end. Method: fill each bound with places held in a vector.
    #[test]
    fn waits_are_bounded_per_source_and_per_node() {
        let parked = ParkedWaits::new(3, 5, TrustedSources::default(), false);
        let mut held: Vec<_> = (0..3)
            .map(|_| parked.admit(false, ip("10.0.0.1")).unwrap().unwrap())
            .collect();
        let Err((limit, refused)) = parked.admit(false, ip("10.0.0.1")) else {
            panic!("admitted over the bound")
        };
        assert_eq!(limit, LIMIT_PER_SOURCE);
        assert_eq!(refused.code(), tonic::Code::ResourceExhausted);
        let (reason, meta) = reason_of(&refused).unwrap();
        assert_eq!(reason, Reason::WaitersExhausted);
        assert_eq!(meta["limit"], LIMIT_PER_SOURCE);
        assert!(
            refused
                .message()
                .starts_with("lockd: 10.0.0.1 already has 3 ")
                && refused.message().contains("--waits-per-source-max 3"),
            "{}",
            refused.message()
        );
        held.extend((0..2).map(|_| parked.admit(false, ip("10.0.0.2")).unwrap().unwrap()));
        let Err((limit, refused)) = parked.admit(false, ip("10.0.0.3")) else {
            panic!("admitted over the bound")
        };
        assert_eq!(limit, LIMIT_NODE);
        let (_, meta) = reason_of(&refused).unwrap();
        assert_eq!(meta["limit"], LIMIT_NODE);
        assert!(
            refused.message().contains("--waits-max 5") && refused.message().contains("10.0.0.3"),
            "{}",
            refused.message()
        );
        held.truncate(2);
        assert_eq!(parked.held(), 2);
        assert!(parked.admit(false, ip("10.0.0.1")).is_ok());
    }

    /// Goal: a call a member forwarded takes no place (the follower counted it), a member's
    /// address is counted like any other for its own calls, and without TLS a forwarding mark
    /// from an address that is not a member's counts (anyone can send the header). Method: a
    /// bound of 1 per source; forwarded calls beyond it.
    #[test]
    fn forwarded_calls_take_no_place_only_from_members() {
        let members = TrustedSources::new(vec!["10.0.0.9".parse().unwrap()]);
        let open = ParkedWaits::new(1, 100, members.clone(), false);
        for _ in 0..10 {
            assert!(open.admit(true, ip("10.0.0.9")).unwrap().is_none());
        }
        let _own = open.admit(false, ip("10.0.0.9")).unwrap().unwrap();
        assert!(
            open.admit(false, ip("10.0.0.9")).is_err(),
            "a member's own calls count"
        );
        let _marked = open.admit(true, ip("10.0.0.1")).unwrap().unwrap();
        assert!(
            open.admit(true, ip("10.0.0.1")).is_err(),
            "a mark from a client's address counts without TLS"
        );
        // With TLS, `forwarded` means a member's certificate: from any address.
        let tls = ParkedWaits::new(1, 100, members, true);
        assert!(tls.admit(true, ip("10.0.0.1")).unwrap().is_none());
        assert_eq!(tls.held(), 0);
    }
}
