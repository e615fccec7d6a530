//! The nemesis: a seeded schedule of faults, one at a time, each held for a while and then lifted.
//! Every kind it draws from comes once per round, in a seeded order. The same seed gives the same
//! sequence of fault kinds, targets (by role) and durations; the
//! interleaving with client operations still depends on timing.
//!
//! The single faults ([`ALL`]) leave a quorum reachable; the composed ones ([`COMPOSED`],
//! `chaos --composed`) put several faults on the cluster at once, most of them leaving no quorum
//! for a while: the cluster tracks those windows (`ChaosCluster::no_quorum`) so that the
//! availability check claims no failure inside them. Clock faults run beside the nemesis, at any
//! time (`clock.rs`, [`run_clock_steps`]).
//!
//! With `chaos --netns` the partitions are made in the kernel (`netns.rs`) and the nemesis also
//! draws the faults only namespaces can make ([`NETNS`]): one-way and bridge cuts, the harness cut
//! from one node, and loss, delay with jitter, and reordering on one node's link.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::clock::FakeClocks;
use super::cluster::{ChaosCluster, NODES};
use super::history::History;
use super::netem::NetemSpec;

/// Largest clock offset a restarted node gets (either direction).
pub const MAX_CLOCK_OFFSET_MS: i64 = 2_000;
/// Mixed into the run seed so the nemesis and the workers draw from different streams.
const NEMESIS_SALT: u64 = 0x6e65_6d65_7369_7321;

/// The faults the nemesis knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    KillLeader,
    KillFollower,
    /// SIGSTOP, later SIGCONT.
    PauseNode,
    IsolateFollower,
    /// The leader alone on one side: a minority that must stop granting.
    IsolateLeader,
    /// A node's client relay forwards requests and drops the replies.
    DropReplies,
    /// Restart a node with its clock shifted (`LOCKD_TEST_CLOCK_OFFSET_MS`).
    ClockJump,
    /// A client stalls past its lease, then writes with its old token.
    PauseClient,
    /// A node loses its disk: killed, data dir deleted, restarted empty. It must catch up
    /// before it votes, campaigns or follows an older term (lockd's vote gate).
    WipeNode,
    /// Composed: two nodes killed (the leader and a follower, or both followers), restarted one
    /// after the other. No quorum until the first is back.
    TwoNodesDown,
    /// Composed: a node killed, another isolated while it is down, the first restarted while the
    /// partition lasts, then the partition healed.
    PartitionDuringRestart,
    /// Composed: a follower wiped and restarted empty, so the leader sends it a snapshot (runs
    /// with composed faults snapshot often), and the leader paused with SIGSTOP right then. The
    /// third node cannot win an election without the empty node's vote, which the vote gate
    /// withholds until it has caught up: no quorum until the leader resumes.
    PauseLeaderInSnapshotInstall,
    /// Composed: a node isolated, another wiped and restarted empty while the partition lasts.
    WipeWhilePartitioned,
    /// `--netns`: packets from one node no longer reach another (the leader and another node,
    /// either way round); the reverse direction still works.
    AsymmetricCut,
    /// `--netns`: two nodes stop hearing each other; the third (the leader or not) hears both.
    BridgePartition,
    /// `--netns`: the harness's packets no longer reach one node; its peers still do.
    ClientCut,
    /// `--netns`: one node's link loses a share of its packets, both directions.
    PacketLoss,
    /// `--netns`: one node's link delays packets, with jitter (which reorders some).
    DelayJitter,
    /// `--netns`: one node's link delays most packets and sends the rest at once, so they
    /// overtake.
    Reorder,
}

pub const ALL: [Fault; 9] = [
    Fault::KillLeader,
    Fault::KillFollower,
    Fault::PauseNode,
    Fault::IsolateFollower,
    Fault::IsolateLeader,
    Fault::DropReplies,
    Fault::ClockJump,
    Fault::PauseClient,
    Fault::WipeNode,
];

/// The composed faults (`chaos --composed` adds them to [`ALL`]).
pub const COMPOSED: [Fault; 4] = [
    Fault::TwoNodesDown,
    Fault::PartitionDuringRestart,
    Fault::PauseLeaderInSnapshotInstall,
    Fault::WipeWhilePartitioned,
];

/// The faults only network namespaces can make (`chaos --netns` adds them to [`ALL`], whose
/// partitions it then also makes in the kernel).
pub const NETNS: [Fault; 6] = [
    Fault::AsymmetricCut,
    Fault::BridgePartition,
    Fault::ClientCut,
    Fault::PacketLoss,
    Fault::DelayJitter,
    Fault::Reorder,
];

/// How long a network fault of [`NETNS`] is held, ms.
const NET_FAULT_HOLD_MS: (u64, u64) = (1_500, 5_000);

/// How long a wipe waits for the other nodes to catch up before it is skipped
/// (`Nemesis::others_caught_up`).
const CAUGHT_UP_WAIT: Duration = Duration::from_secs(15);
/// Loss drawn for [`Fault::PacketLoss`], percent: enough that TCP retransmits all the time, not
/// so much that the link is as good as cut (that is what the partitions are for).
const LOSS_PCT: (u32, u32) = (5, 30);
/// Delay and jitter for [`Fault::DelayJitter`], ms: up to a few heartbeats (100 ms), below the
/// election timeout (600 ms) even both ways with the jitter.
const DELAY_MS: (u64, u64) = (30, 200);
const JITTER_MS: (u64, u64) = (5, 80);
/// [`Fault::Reorder`]: the delay of the delayed packets, and the share sent at once.
const REORDER_DELAY_MS: (u64, u64) = (10, 60);
const REORDER_PCT: (u32, u32) = (10, 50);

/// How long [`Fault::TwoNodesDown`] keeps both nodes down, ms; and the same in the broken mode
/// that hides the outage from the checker, longer than the availability check allows.
const TWO_DOWN_HOLD_MS: (u64, u64) = (1_000, 4_000);
const HIDDEN_OUTAGE_HOLD_MS: (u64, u64) = (15_000, 20_000);
/// How long the nemesis waits for a restarted node to answer before pausing the leader anyway.
const NODE_UP_WAIT: Duration = Duration::from_secs(5);

pub struct Nemesis {
    rng: StdRng,
    history: History,
    /// One flag per worker: [`Fault::PauseClient`] sets one.
    client_pauses: Vec<Arc<AtomicBool>>,
    /// Faults injected, in order (for the report).
    pub injected: Vec<Fault>,
    /// Faults still to draw in this round: every kind once per round, in a seeded order, so even
    /// a short run meets each kind.
    bag: Vec<Fault>,
    /// The fault kinds this nemesis draws from.
    kinds: Vec<Fault>,
    /// The broken mode that keeps two nodes down far longer than the availability check allows
    /// (the run then hides the outage from the checker).
    pub long_outages: bool,
}

impl Nemesis {
    /// A nemesis drawing from `kinds` (all of [`ALL`] in normal runs).
    pub fn new(
        seed: u64,
        kinds: Vec<Fault>,
        history: History,
        client_pauses: Vec<Arc<AtomicBool>>,
    ) -> Nemesis {
        Nemesis {
            rng: StdRng::seed_from_u64(seed ^ NEMESIS_SALT),
            history,
            client_pauses,
            injected: Vec::new(),
            kinds,
            bag: Vec::new(),
            long_outages: false,
        }
    }

    fn draw(&mut self) -> Fault {
        if self.bag.is_empty() {
            self.bag = self.kinds.clone();
            // Fisher-Yates with the seeded RNG.
            for i in (1..self.bag.len()).rev() {
                let j = self.rng.random_range(0..=i);
                self.bag.swap(i, j);
            }
        }
        self.bag.pop().expect("refilled above")
    }

    fn note(&self, what: String) {
        self.history.note("nemesis", what);
    }

    async fn sleep_ms(&mut self, lo: u64, hi: u64) {
        let ms = self.rng.random_range(lo..=hi);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// The current leader, or a node drawn from the RNG when none answers as leader.
    async fn leader(&mut self, cluster: &ChaosCluster) -> u64 {
        let fallback = self.rng.random_range(1..=NODES);
        cluster.current_leader().await.unwrap_or(fallback)
    }

    fn other(&mut self, not: u64) -> u64 {
        let k = self.rng.random_range(1..NODES);
        (not + k - 1) % NODES + 1
    }

    /// Before a fault deletes node `victim`'s data dir: waits until every other node has applied
    /// what the leader has committed, so that none of them is still rejoining after a wipe of its
    /// own. Two nodes without their log at once is beyond what Raft tolerates, and lockd then
    /// waits for good by design (seed 10093: node 1 was wiped while node 3, wiped 8.5 s before,
    /// had not yet caught up, and the cluster never had a quorum again). Gives up after
    /// [`CAUGHT_UP_WAIT`], and the caller then skips the wipe; the history says which.
    async fn others_caught_up(&self, cluster: &ChaosCluster, victim: u64) -> bool {
        let deadline = Instant::now() + CAUGHT_UP_WAIT;
        loop {
            if let Some(leader) = cluster.current_leader().await
                && let Ok(l) = cluster.status(leader).await
            {
                let mut all = true;
                for id in (1..=NODES).filter(|n| *n != victim) {
                    match cluster.status(id).await {
                        Ok(s) if s.applied_index >= l.commit_index && s.applied_index > 0 => {}
                        _ => all = false,
                    }
                }
                if all {
                    return true;
                }
            }
            if Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The node that is neither `a` nor `b` (two different nodes).
    fn third(a: u64, b: u64) -> u64 {
        (1..=NODES)
            .find(|n| *n != a && *n != b)
            .expect("three nodes")
    }

    /// The leader or, half of the time, another node; and the leader.
    async fn leader_or_other(&mut self, cluster: &ChaosCluster) -> (u64, u64) {
        let leader = self.leader(cluster).await;
        let id = if self.rng.random_bool(0.5) {
            leader
        } else {
            self.other(leader)
        };
        (id, leader)
    }

    /// Holds a network fault of [`NETNS`] for a drawn time, lifts it, and lets the cluster
    /// settle.
    async fn hold_network_fault(&mut self, cluster: &mut ChaosCluster) -> anyhow::Result<()> {
        self.sleep_ms(NET_FAULT_HOLD_MS.0, NET_FAULT_HOLD_MS.1)
            .await;
        self.note("lift the network fault".into());
        cluster.heal_network()?;
        self.sleep_ms(500, 1_500).await;
        Ok(())
    }

    /// Injects faults until `until`, then lifts them all. `first` forces the first fault.
    pub async fn run(
        &mut self,
        cluster: &mut ChaosCluster,
        until: Instant,
        first: Option<Fault>,
    ) -> anyhow::Result<()> {
        let mut next = first;
        while Instant::now() < until {
            self.sleep_ms(500, 1_500).await;
            let fault = match next.take() {
                Some(f) => f,
                None => self.draw(),
            };
            self.injected.push(fault);
            self.inject(cluster, fault).await?;
            cluster.heal_all()?;
            self.note(format!("healed after {fault:?}"));
        }
        Ok(())
    }

    async fn inject(&mut self, cluster: &mut ChaosCluster, fault: Fault) -> anyhow::Result<()> {
        match fault {
            Fault::KillLeader | Fault::KillFollower => {
                let leader = self.leader(cluster).await;
                let id = if fault == Fault::KillLeader {
                    leader
                } else {
                    self.other(leader)
                };
                self.note(format!("kill -9 node {id} (leader was {leader})"));
                cluster.kill(id);
                self.sleep_ms(500, 3_000).await;
                self.note(format!("restart node {id}"));
                let offset = cluster.clock_offsets_ms[id as usize - 1];
                cluster.start_node(id, offset)?;
                self.sleep_ms(1_000, 2_000).await;
            }
            Fault::PauseNode => {
                let leader = self.leader(cluster).await;
                let id = if self.rng.random_bool(0.5) {
                    leader
                } else {
                    self.other(leader)
                };
                self.note(format!("SIGSTOP node {id} (leader was {leader})"));
                cluster.pause(id);
                self.sleep_ms(500, 4_000).await;
                self.note(format!("SIGCONT node {id}"));
                cluster.resume(id);
                self.sleep_ms(500, 1_500).await;
            }
            Fault::IsolateFollower | Fault::IsolateLeader => {
                let leader = self.leader(cluster).await;
                let id = if fault == Fault::IsolateLeader {
                    leader
                } else {
                    self.other(leader)
                };
                self.note(format!("isolate node {id} (leader was {leader})"));
                cluster.isolate(id)?;
                self.sleep_ms(1_500, 5_000).await;
                self.note(format!("heal partition of node {id}"));
                cluster.heal_network()?;
                self.sleep_ms(500, 1_500).await;
            }
            Fault::DropReplies => {
                let id = self.rng.random_range(1..=NODES);
                self.note(format!("drop replies of node {id}'s client relay"));
                cluster.drop_replies(id, true);
                self.sleep_ms(1_000, 4_000).await;
                self.note(format!("stop dropping replies of node {id}"));
                cluster.drop_replies(id, false);
            }
            Fault::ClockJump => {
                let leader = self.leader(cluster).await;
                let id = if self.rng.random_bool(0.5) {
                    leader
                } else {
                    self.other(leader)
                };
                let mut offset = self
                    .rng
                    .random_range(-MAX_CLOCK_OFFSET_MS..=MAX_CLOCK_OFFSET_MS);
                if offset == 0 {
                    offset = MAX_CLOCK_OFFSET_MS;
                }
                self.note(format!(
                    "restart node {id} (leader was {leader}) with clock offset {offset} ms"
                ));
                cluster.kill(id);
                cluster.start_node(id, offset)?;
                self.sleep_ms(1_000, 3_000).await;
            }
            Fault::WipeNode => {
                let leader = self.leader(cluster).await;
                let id = if self.rng.random_bool(0.5) {
                    leader
                } else {
                    self.other(leader)
                };
                if !self.others_caught_up(cluster, id).await {
                    self.note(format!(
                        "skip wiping node {id}: another node has not caught up (a second lost log)"
                    ));
                    self.injected.pop();
                    return Ok(());
                }
                self.note(format!(
                    "kill -9 node {id} (leader was {leader}) and delete its data dir"
                ));
                cluster.wipe(id)?;
                self.sleep_ms(500, 3_000).await;
                self.note(format!("restart node {id} empty"));
                let offset = cluster.clock_offsets_ms[id as usize - 1];
                cluster.start_node(id, offset)?;
                // Catching up from the snapshot takes longer than a plain restart.
                self.sleep_ms(2_000, 4_000).await;
            }
            Fault::PauseClient => {
                let w = self.rng.random_range(0..self.client_pauses.len());
                self.note(format!("worker w{w} will stall past its next lease"));
                self.client_pauses[w].store(true, Ordering::SeqCst);
                self.sleep_ms(500, 1_500).await;
            }
            Fault::TwoNodesDown => {
                let (a, leader) = self.leader_or_other(cluster).await;
                let b = self.other(a);
                self.note(format!("kill -9 nodes {a} and {b} (leader was {leader})"));
                cluster.kill(a);
                self.sleep_ms(0, 500).await;
                cluster.kill(b);
                let (lo, hi) = if self.long_outages {
                    HIDDEN_OUTAGE_HOLD_MS
                } else {
                    TWO_DOWN_HOLD_MS
                };
                self.sleep_ms(lo, hi).await;
                self.note(format!("restart node {a}"));
                cluster.start_node(a, cluster.clock_offsets_ms[a as usize - 1])?;
                self.sleep_ms(0, 1_500).await;
                self.note(format!("restart node {b}"));
                cluster.start_node(b, cluster.clock_offsets_ms[b as usize - 1])?;
                self.sleep_ms(1_000, 2_000).await;
            }
            Fault::PartitionDuringRestart => {
                let (down, leader) = self.leader_or_other(cluster).await;
                let cut = self.other(down);
                self.note(format!("kill -9 node {down} (leader was {leader})"));
                cluster.kill(down);
                self.sleep_ms(300, 1_500).await;
                self.note(format!("isolate node {cut} while node {down} is down"));
                cluster.isolate(cut)?;
                self.sleep_ms(500, 2_000).await;
                self.note(format!("restart node {down} while node {cut} is isolated"));
                cluster.start_node(down, cluster.clock_offsets_ms[down as usize - 1])?;
                self.sleep_ms(1_000, 3_000).await;
                self.note(format!("heal partition of node {cut}"));
                cluster.heal_network()?;
                self.sleep_ms(500, 1_500).await;
            }
            Fault::PauseLeaderInSnapshotInstall => {
                let leader = self.leader(cluster).await;
                let follower = self.other(leader);
                if !self.others_caught_up(cluster, follower).await {
                    self.note(format!(
                        "skip wiping follower {follower}: another node has not caught up (a second lost log)"
                    ));
                    self.injected.pop();
                    return Ok(());
                }
                self.note(format!(
                    "kill -9 follower {follower} (leader {leader}) and delete its data dir"
                ));
                cluster.wipe(follower)?;
                self.sleep_ms(300, 1_500).await;
                self.note(format!(
                    "restart node {follower} empty: the leader must send it a snapshot"
                ));
                cluster.start_node(follower, cluster.clock_offsets_ms[follower as usize - 1])?;
                // Pause once the empty node answers, a little later or at once, so that across
                // seeds the pause lands before, while and after the snapshot goes over.
                let deadline = Instant::now() + NODE_UP_WAIT;
                while cluster.status(follower).await.is_err() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                self.sleep_ms(0, 400).await;
                let applied = cluster
                    .status(follower)
                    .await
                    .map(|s| s.applied_index.to_string())
                    .unwrap_or_else(|_| "?".into());
                cluster.pause(leader);
                self.note(format!(
                    "SIGSTOP leader {leader} while node {follower} catches up (it had applied index {applied})"
                ));
                self.sleep_ms(1_000, 4_000).await;
                self.note(format!("SIGCONT node {leader}"));
                cluster.resume(leader);
                self.sleep_ms(2_000, 4_000).await;
            }
            Fault::AsymmetricCut => {
                let (x, leader) = self.leader_or_other(cluster).await;
                let y = self.other(x);
                let (from, to) = if self.rng.random_bool(0.5) {
                    (x, y)
                } else {
                    (y, x)
                };
                self.note(format!(
                    "one-way cut: node {to} reaches node {from}, packets from node {from} no longer reach node {to} (leader was {leader})"
                ));
                cluster.cut_one_way(from, to)?;
                self.hold_network_fault(cluster).await?;
            }
            Fault::BridgePartition => {
                let (bridge, leader) = self.leader_or_other(cluster).await;
                self.note(format!(
                    "bridge partition: node {bridge} hears both others, they do not hear each other (leader was {leader})"
                ));
                cluster.bridge_partition(bridge)?;
                self.hold_network_fault(cluster).await?;
            }
            Fault::ClientCut => {
                let (id, leader) = self.leader_or_other(cluster).await;
                self.note(format!(
                    "the harness's packets no longer reach node {id}; its peers still do (leader was {leader})"
                ));
                cluster.cut_client(id)?;
                self.hold_network_fault(cluster).await?;
            }
            Fault::PacketLoss | Fault::DelayJitter | Fault::Reorder => {
                let (id, leader) = self.leader_or_other(cluster).await;
                let mut spec = NetemSpec {
                    loss_pct: 0,
                    delay_ms: 0,
                    jitter_ms: 0,
                    reorder_pct: 0,
                    seed: self.rng.random(),
                };
                match fault {
                    Fault::PacketLoss => {
                        spec.loss_pct = self.rng.random_range(LOSS_PCT.0..=LOSS_PCT.1)
                    }
                    Fault::DelayJitter => {
                        spec.delay_ms = self.rng.random_range(DELAY_MS.0..=DELAY_MS.1);
                        spec.jitter_ms = self
                            .rng
                            .random_range(JITTER_MS.0..=JITTER_MS.1)
                            .min(spec.delay_ms);
                    }
                    _ => {
                        spec.delay_ms = self
                            .rng
                            .random_range(REORDER_DELAY_MS.0..=REORDER_DELAY_MS.1);
                        spec.reorder_pct = self.rng.random_range(REORDER_PCT.0..=REORDER_PCT.1);
                    }
                }
                self.note(format!(
                    "impair node {id}'s link: {spec} (leader was {leader})"
                ));
                cluster.impair(id, spec)?;
                self.hold_network_fault(cluster).await?;
            }
            Fault::WipeWhilePartitioned => {
                let (cut, leader) = self.leader_or_other(cluster).await;
                let wiped = self.other(cut);
                if !self.others_caught_up(cluster, wiped).await {
                    self.note(format!(
                        "skip wiping node {wiped}: another node has not caught up (a second lost log)"
                    ));
                    self.injected.pop();
                    return Ok(());
                }
                self.note(format!("isolate node {cut} (leader was {leader})"));
                cluster.isolate(cut)?;
                self.sleep_ms(300, 1_000).await;
                self.note(format!(
                    "kill -9 node {wiped} and delete its data dir while node {cut} is isolated"
                ));
                cluster.wipe(wiped)?;
                self.sleep_ms(500, 2_000).await;
                self.note(format!(
                    "restart node {wiped} empty; node {} is its only reachable peer",
                    Self::third(cut, wiped)
                ));
                cluster.start_node(wiped, cluster.clock_offsets_ms[wiped as usize - 1])?;
                self.sleep_ms(1_500, 4_000).await;
                self.note(format!("heal partition of node {cut}"));
                cluster.heal_network()?;
                self.sleep_ms(2_000, 4_000).await;
            }
        }
        Ok(())
    }
}

/// Clock faults beside the nemesis ([`super::clock::ClockMode::Offsets`]): until `until`, every
/// 0.5-4 s one node's wall clock gets a new offset, whatever else the nemesis is doing.
pub async fn run_clock_steps(
    clocks: std::sync::Arc<FakeClocks>,
    history: History,
    until: Instant,
) -> anyhow::Result<()> {
    while Instant::now() < until {
        let pause = clocks.next_pause_ms(500, 4_000);
        tokio::time::sleep(Duration::from_millis(pause)).await;
        let what = clocks.step(NODES)?;
        history.note("clock", what);
    }
    Ok(())
}
