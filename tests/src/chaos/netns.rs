//! Real network faults for `chaos --netns`: each `lockd` node runs in a network namespace of its
//! own, joined to the others by veth pairs and a bridge, and the faults are made in the kernel's
//! packet path rather than by a relay.
//!
//! Why beside the relays (`relay.rs`): a relay cuts at the TCP layer, only on the connections that
//! go through it, and a blackholed caller's handshake still completes. In namespaces the kernel
//! drops packets: handshakes time out, established connections retransmit into nothing, a one-way
//! cut still delivers bytes in the other direction, and loss, delay and reordering act on single
//! packets under TCP. The relays stay for what they do well (dropping replies after the node has
//! committed).
//!
//! # Topology (one per run, subnet `10.213.S.0/24`, S chosen free per run)
//! - namespace `lkdc-<pid>-<k>-hub`: the bridge `br0`, a port `pI` per node, a port `harness` for
//!   the harness, and a spare pair `qI`/`rI` per node (`rI` on the bridge) that [`super::netem`]
//!   forwards through while node I is impaired;
//! - namespace `lkdc-<pid>-<k>-nI`: `eth0` with `10.213.S.(10+I)/24`, the other end of `pI`;
//! - in the harness's namespace, one veth end `lkdc<pid>x<k>` with `10.213.S.1/24` (the only
//!   address this module puts outside its namespaces), so clients reach the nodes.
//!
//! No namespace has a default route and the hub has no address: nothing is forwarded to or from
//! the outside. `<pid>` is the owning process, so leftovers of a run that was killed are recognised
//! and removed by the next one ([`sweep_leftovers`]); a [`Netns`] removes everything when dropped,
//! also on failure or panic.
//!
//! # Faults
//! - a **cut** "packets from A no longer arrive at B" is a policy rule in B's namespace,
//!   `from A iif eth0 blackhole`, placed before the `local` table's rule (moved from priority 0
//!   to 1000 for this): the packets are dropped silently on input, as on a cut link (early demux
//!   is off in the node namespaces so established connections are cut too);
//! - a symmetric partition, a one-way (asymmetric) cut, a bridge partition and a client-to-node
//!   cut are sets of cuts;
//! - loss, delay with jitter and reordering: this kernel has no `sch_netem` (nor `act_gact`), so
//!   [`super::netem`] does in user space what netem does: node I's hub port is taken off the bridge
//!   and a forwarder moves its frames to and from the bridge, dropping, delaying and reordering.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::netem::{Netem, NetemSpec};

/// Start of every name this module makes (namespaces and the harness's veth end).
pub const PREFIX: &str = "lkdc";
/// The private test subnets are `10.213.S.0/24`.
const SUBNET: [u8; 2] = [10, 213];
/// The harness's address on a run's subnet; node I has `10 + I`.
const HARNESS_HOST: u8 = 1;
/// The harness's port on the hub's bridge (`ip` would read a name such as `h` as `help`).
const HUB_HARNESS_PORT: &str = "harness";
/// Priority of the rule that drops packets from host H: `RULE_PRIORITY_BASE + H` (before the
/// `local` table's rule, see [`LOCAL_RULE_PRIORITY`]).
const RULE_PRIORITY_BASE: u32 = 100;

/// Where the `local` table's rule moves to in a node namespace: after the cut rules (at most
/// `RULE_PRIORITY_BASE + 3`), before `main` (32766).
const LOCAL_RULE_PRIORITY: u32 = 1_000;

/// The subnets (third octet) of the runs going on in this process.
static SUBNETS_IN_USE: Mutex<BTreeSet<u8>> = Mutex::new(BTreeSet::new());
/// Makes the names of runs of one process unique.
static NEXT_RUN: AtomicU64 = AtomicU64::new(0);

/// Runs `ip` with `args`; an error carries its stderr.
fn ip(args: &[&str]) -> anyhow::Result<String> {
    let out = Command::new("ip")
        .args(args)
        .output()
        .map_err(|e| anyhow::anyhow!("running ip {}: {e}", args.join(" ")))?;
    anyhow::ensure!(
        out.status.success(),
        "ip {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether this process can make network namespaces; `Err` says why not (for skipping).
pub fn available() -> Result<(), String> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    #[allow(unsafe_code, reason = "FFI: geteuid has no safe wrapper in libc")]
    let euid = unsafe { libc::geteuid() };
    if euid != 0 {
        return Err("network namespaces need root (this process is not)".into());
    }
    // One name per call: runs of one process (`--jobs`) probe at the same moment.
    static NEXT_PROBE: AtomicU64 = AtomicU64::new(0);
    let probe = format!(
        "{PREFIX}-{}-probe{}",
        std::process::id(),
        NEXT_PROBE.fetch_add(1, Ordering::Relaxed)
    );
    ip(&["netns", "add", &probe]).map_err(|e| format!("`ip netns add` does not work here: {e}"))?;
    let _ = ip(&["netns", "del", &probe]);
    Ok(())
}

/// Whether process `pid` is alive (names carry their owner's pid).
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes the namespaces and harness veth ends of runs whose process is gone (a run killed by a
/// signal cannot clean up after itself). Names of live processes are left alone: runs of other
/// processes may be going on.
pub fn sweep_leftovers() {
    let owner = |rest: &str, sep: char, radix: u32| -> Option<u32> {
        rest.split(sep)
            .next()
            .and_then(|p| u32::from_str_radix(p, radix).ok())
    };
    if let Ok(list) = ip(&["netns", "list"]) {
        for name in list.lines().filter_map(|l| l.split_whitespace().next()) {
            if let Some(rest) = name.strip_prefix(&format!("{PREFIX}-"))
                && let Some(pid) = owner(rest, '-', 10)
                && !alive(pid)
            {
                let _ = ip(&["netns", "del", name]);
            }
        }
    }
    if let Ok(list) = ip(&["-o", "link", "show"]) {
        for line in list.lines() {
            // "12: lkdc1f2ax0@if3: <...": the name is the second field, up to '@' or ':'.
            let Some(name) = line
                .split_whitespace()
                .nth(1)
                .and_then(|n| n.split(['@', ':']).next())
            else {
                continue;
            };
            if let Some(rest) = name.strip_prefix(PREFIX)
                && let Some(pid) = owner(rest, 'x', 16)
                && !alive(pid)
            {
                let _ = ip(&["link", "del", name]);
            }
        }
    }
}

/// A third octet for `10.213.S.0/24` that no run of this process uses and no address of the
/// harness's namespace is on (runs of other processes), reserved until dropped.
fn reserve_subnet() -> anyhow::Result<u8> {
    let addrs = ip(&["-o", "-4", "addr", "show"])?;
    let mut used = SUBNETS_IN_USE.lock().unwrap();
    let start: u8 = rand::random();
    for k in 0..=255u8 {
        let s = start.wrapping_add(k);
        let taken = addrs.contains(&format!(" {}.{}.{s}.", SUBNET[0], SUBNET[1]));
        if !taken && used.insert(s) {
            return Ok(s);
        }
    }
    anyhow::bail!("every 10.213.S.0/24 subnet is in use")
}

/// The namespaces, links and faults of one run. Dropping it lifts the faults and removes
/// everything it made; the processes started in its namespaces must have been killed first (a
/// namespace lives on while a process is in it).
pub struct Netns {
    /// `lkdc-<pid>-<k>`: the start of this run's namespace names.
    prefix: String,
    /// The harness's veth end (in the harness's namespace).
    link: String,
    /// Third octet of this run's subnet.
    subnet: u8,
    nodes: u64,
    /// Namespaces made so far (all of them are removed on drop, whatever failed after).
    made: Vec<String>,
    /// The cuts in place: (from host, to node), hosts numbered as in [`Netns::host_ip`].
    cuts: BTreeSet<(u64, u64)>,
    /// The impaired nodes and their forwarders.
    impaired: Vec<(u64, Netem)>,
}

impl Netns {
    /// Makes the namespaces, bridge and links for `nodes` nodes, after removing leftovers of runs
    /// that died.
    pub fn create(nodes: u64) -> anyhow::Result<Netns> {
        sweep_leftovers();
        let k = NEXT_RUN.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let mut n = Netns {
            prefix: format!("{PREFIX}-{pid}-{k}"),
            // At most 15 bytes: "lkdc" + 6 hex digits of a pid + "x" + up to 4 hex digits.
            link: format!("{PREFIX}{pid:x}x{:x}", k & 0xffff),
            subnet: reserve_subnet()?,
            nodes,
            made: Vec::new(),
            cuts: BTreeSet::new(),
            impaired: Vec::new(),
        };
        // On error `n` is dropped, which removes what was made.
        n.build()?;
        Ok(n)
    }

    fn build(&mut self) -> anyhow::Result<()> {
        let hub = self.hub();
        ip(&["netns", "add", &hub])?;
        self.made.push(hub.clone());
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for id in 1..=self.nodes {
            let ns = self.node_ns(id);
            ip(&["netns", "add", &ns])?;
            self.made.push(ns.clone());
            let port = format!("p{id}");
            ip(&[
                "-n", &hub, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns",
                &ns,
            ])?;
            ip(&["-n", &hub, "link", "set", &port, "master", "br0", "up"])?;
            let addr = format!("{}/24", self.host_ip(id));
            ip(&["-n", &ns, "addr", "add", &addr, "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            // The cut rules must come before the `local` table, which the kernel looks up first
            // (priority 0) and which would deliver every packet to this node's address.
            let local = LOCAL_RULE_PRIORITY.to_string();
            ip(&[
                "-n", &ns, "rule", "add", "priority", &local, "lookup", "local",
            ])?;
            ip(&["-n", &ns, "rule", "del", "priority", "0"])?;
            // Every input packet goes through the policy rules, including those of established
            // connections (early demux would route them by the socket's cached route).
            ip(&[
                "netns",
                "exec",
                &ns,
                "sysctl",
                "-qw",
                "net.ipv4.ip_early_demux=0",
            ])?;
            // The spare pair the user-space netem forwards through.
            let (q, r) = (format!("q{id}"), format!("r{id}"));
            ip(&[
                "-n", &hub, "link", "add", &q, "type", "veth", "peer", "name", &r,
            ])?;
            ip(&["-n", &hub, "link", "set", &r, "master", "br0", "up"])?;
            ip(&["-n", &hub, "link", "set", &q, "up"])?;
        }
        ip(&[
            "link",
            "add",
            &self.link,
            "type",
            "veth",
            "peer",
            "name",
            HUB_HARNESS_PORT,
            "netns",
            &hub,
        ])?;
        ip(&[
            "-n",
            &hub,
            "link",
            "set",
            HUB_HARNESS_PORT,
            "master",
            "br0",
            "up",
        ])?;
        let addr = format!("{}/24", self.host_ip(0));
        ip(&["addr", "add", &addr, "dev", &self.link])?;
        ip(&["link", "set", &self.link, "up"])?;
        Ok(())
    }

    fn hub(&self) -> String {
        format!("{}-hub", self.prefix)
    }

    /// The namespace of node `id`.
    pub fn node_ns(&self, id: u64) -> String {
        format!("{}-n{id}", self.prefix)
    }

    /// Host 0 is the harness, host I node I.
    pub fn host_ip(&self, host: u64) -> Ipv4Addr {
        let last = if host == 0 {
            HARNESS_HOST
        } else {
            10 + host as u8
        };
        Ipv4Addr::new(SUBNET[0], SUBNET[1], self.subnet, last)
    }

    /// A command that runs `program` in node `id`'s namespace. `ip netns exec` execs the program
    /// in its own process (it does not fork), so the child's PID is the program's: killing it
    /// by PID kills the node, not a wrapper.
    pub fn command(&self, id: u64, program: &Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.arg("netns")
            .arg("exec")
            .arg(self.node_ns(id))
            .arg(program);
        cmd
    }

    /// Packets from host `from` (0: the harness) no longer arrive at node `to`.
    pub fn cut(&mut self, from: u64, to: u64) -> anyhow::Result<()> {
        if !self.cuts.insert((from, to)) {
            return Ok(());
        }
        let src = format!("{}/32", self.host_ip(from));
        let prio = (RULE_PRIORITY_BASE + from as u32).to_string();
        ip(&[
            "-n",
            &self.node_ns(to),
            "rule",
            "add",
            "from",
            &src,
            "iif",
            "eth0",
            "priority",
            &prio,
            "blackhole",
        ])?;
        Ok(())
    }

    /// Node `id` and each other node stop hearing each other.
    pub fn isolate(&mut self, id: u64) -> anyhow::Result<()> {
        for other in (1..=self.nodes).filter(|o| *o != id) {
            self.cut(id, other)?;
            self.cut(other, id)?;
        }
        Ok(())
    }

    /// Starts the user-space netem on node `id`'s link (both directions).
    pub fn impair(&mut self, id: u64, spec: NetemSpec) -> anyhow::Result<()> {
        anyhow::ensure!(
            !self.impaired.iter().any(|(i, _)| *i == id),
            "node {id} is already impaired"
        );
        let hub = self.hub();
        let (port, spare) = (format!("p{id}"), format!("q{id}"));
        ip(&["-n", &hub, "link", "set", &port, "nomaster"])?;
        match Netem::start(&format!("/run/netns/{hub}"), &port, &spare, spec) {
            Ok(n) => {
                self.impaired.push((id, n));
                Ok(())
            }
            Err(e) => {
                let _ = ip(&["-n", &hub, "link", "set", &port, "master", "br0"]);
                Err(e)
            }
        }
    }

    /// Lifts every cut and impairment.
    pub fn heal(&mut self) -> anyhow::Result<()> {
        let mut first_error = None;
        for (from, to) in std::mem::take(&mut self.cuts) {
            let prio = (RULE_PRIORITY_BASE + from as u32).to_string();
            if let Err(e) = ip(&["-n", &self.node_ns(to), "rule", "del", "priority", &prio]) {
                first_error.get_or_insert(e);
            }
        }
        let hub = self.hub();
        for (id, netem) in std::mem::take(&mut self.impaired) {
            drop(netem);
            if let Err(e) = ip(&[
                "-n",
                &hub,
                "link",
                "set",
                &format!("p{id}"),
                "master",
                "br0",
            ]) {
                first_error.get_or_insert(e);
            }
        }
        first_error.map_or(Ok(()), Err)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        // Stop the forwarders before their links go.
        self.impaired.clear();
        for ns in self.made.drain(..).rev() {
            let _ = ip(&["netns", "del", &ns]);
        }
        // Deleting the hub deletes the harness's end of its pair too; this is for a build that
        // failed between making the pair and moving its end.
        if ip(&["link", "show", &self.link]).is_ok() {
            let _ = ip(&["link", "del", &self.link]);
        }
        SUBNETS_IN_USE.lock().unwrap().remove(&self.subnet);
    }
}

#[cfg(test)]
mod tests {
    use std::net::{SocketAddr, TcpListener, TcpStream};
    use std::time::{Duration, Instant};

    use super::*;
    use crate::chaos::netem::enter_netns;

    const PORT: u16 = 7009;

    /// Whether a TCP connection from host `from`'s namespace to node `to` opens within 700 ms.
    fn connects(n: &Netns, from: u64, to: u64) -> bool {
        let target = SocketAddr::new(n.host_ip(to).into(), PORT);
        let ns = (from != 0).then(|| format!("/run/netns/{}", n.node_ns(from)));
        std::thread::spawn(move || {
            if let Some(ns) = ns {
                enter_netns(&ns).expect("setns");
            }
            TcpStream::connect_timeout(&target, Duration::from_millis(700)).is_ok()
        })
        .join()
        .unwrap()
    }

    /// Whether node `to` becomes reachable from host `from` within 10 s: for what must work, so
    /// that a loaded machine (new links settling, tests running in parallel) does not fail it.
    fn reachable(n: &Netns, from: u64, to: u64) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if connects(n, from, to) {
                return true;
            }
        }
        false
    }

    /// The quickest of three handshakes from the harness to node `to`.
    fn fastest_handshake(n: &Netns, to: u64) -> Duration {
        (0..3)
            .map(|_| {
                let t = Instant::now();
                assert!(connects(n, 0, to), "node {to} unreachable");
                t.elapsed()
            })
            .min()
            .unwrap()
    }

    /// Goal: the cuts and the impairment do to packets what they say. Method: three namespaces
    /// with a listener in each; TCP handshakes between them and from the harness before, during
    /// and after each fault. Skipped (with the reason printed) without root.
    #[test]
    fn cuts_and_impairments_act_on_packets() {
        if let Err(why) = available() {
            crate::skip::report(&why);
            return;
        }
        let mut n = Netns::create(3).unwrap();
        let mut listeners = Vec::new();
        for id in 1..=3 {
            let ns = format!("/run/netns/{}", n.node_ns(id));
            let addr = SocketAddr::new(n.host_ip(id).into(), PORT);
            listeners.push(
                std::thread::spawn(move || {
                    enter_netns(&ns).unwrap();
                    TcpListener::bind(addr).unwrap()
                })
                .join()
                .unwrap(),
            );
        }
        assert!(reachable(&n, 0, 1) && reachable(&n, 1, 2) && reachable(&n, 2, 1));
        assert!(reachable(&n, 0, 2) && reachable(&n, 0, 3) && reachable(&n, 3, 1));
        // One way: packets from 2 do not arrive at 1, so neither handshake completes, while 3
        // reaches both.
        n.cut(2, 1).unwrap();
        assert!(
            !connects(&n, 1, 2),
            "1 -> 2 needs 2's SYN-ACK to arrive at 1"
        );
        assert!(!connects(&n, 2, 1));
        assert!(reachable(&n, 3, 1) && reachable(&n, 3, 2) && reachable(&n, 0, 1));
        n.heal().unwrap();
        assert!(reachable(&n, 1, 2) && reachable(&n, 2, 1));
        // The harness cut off from node 3, its peers not.
        n.cut(0, 3).unwrap();
        assert!(!connects(&n, 0, 3));
        assert!(reachable(&n, 1, 3) && reachable(&n, 0, 1));
        n.heal().unwrap();
        assert!(reachable(&n, 0, 3));
        // 150 ms each way on node 2's link: a handshake takes at least one round trip.
        n.impair(
            2,
            NetemSpec {
                loss_pct: 0,
                delay_ms: 150,
                jitter_ms: 0,
                reorder_pct: 0,
                seed: 1,
            },
        )
        .unwrap();
        let delayed = fastest_handshake(&n, 2);
        assert!(
            delayed >= Duration::from_millis(280),
            "round trip {delayed:?}"
        );
        let undelayed = fastest_handshake(&n, 1);
        assert!(
            undelayed < Duration::from_millis(150),
            "node 1: {undelayed:?}"
        );
        n.heal().unwrap();
        // Total loss on node 1: nothing gets through; healed, all is well again.
        n.impair(
            1,
            NetemSpec {
                loss_pct: 100,
                delay_ms: 0,
                jitter_ms: 0,
                reorder_pct: 0,
                seed: 2,
            },
        )
        .unwrap();
        assert!(!connects(&n, 0, 1));
        n.heal().unwrap();
        assert!(reachable(&n, 0, 1) && reachable(&n, 2, 1));
        drop(listeners);
        let hub = n.hub();
        drop(n);
        assert!(
            !ip(&["netns", "list"]).unwrap().contains(&hub),
            "namespaces removed on drop"
        );
    }
}
