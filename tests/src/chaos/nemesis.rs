//! The nemesis: a seeded schedule of faults, one at a time, each held for a while and then lifted.
//! Every kind comes once per round of nine, in a seeded order. The same seed gives the same
//! sequence of fault kinds, targets (by role) and durations; the
//! interleaving with client operations still depends on timing.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

use super::cluster::{ChaosCluster, NODES};
use super::history::History;

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
                cluster.isolate(id);
                self.sleep_ms(1_500, 5_000).await;
                self.note(format!("heal partition of node {id}"));
                cluster.heal_network();
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
        }
        Ok(())
    }
}
