//! The clients of a chaos run: workers that acquire, renew, release and write with fencing
//! tokens, each driven by its own seeded RNG, recording every attempt in the history.
//!
//! Workers talk raw gRPC (`lockd.v1`) rather than through `lockd-client`, so that the history sees
//! every attempt of a retried request, with the endpoint it went to; they follow the rules for
//! clients of docs/api.md: a call that timed out or answered `UNAVAILABLE` is retried with the same
//! `request_id`, and a lease's deadline is the time the request was first sent plus its ttl.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use lockd_api::v1::lock_client::LockClient;
use lockd_api::v1::{AcquireRequest, DescribeRequest, ReleaseRequest, RenewRequest};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;

use super::cluster::client_channel;
use super::history::{History, OpKind, Outcome, Target};
use super::register::{WriteResult, put};

/// Lease ttls the workers ask for (the policy minimum is 1 s; short ttls make expiry frequent).
pub const TTLS_MS: [u64; 4] = [1_000, 1_500, 2_000, 3_000];
pub const MAX_TTL_MS: u64 = 3_000;
/// Longest `wait_timeout_ms` a worker asks for.
pub const MAX_WAIT_MS: u64 = 1_500;
/// How long one RPC attempt may take beyond its wait before the worker calls it unknown. Above
/// the 5 s bound of docs/api.md for a node without quorum, so that bound is seen rather than cut.
const ATTEMPT_SLACK: Duration = Duration::from_millis(5_500);
/// How long a worker keeps retrying one acquire whose outcome is unknown.
const ACQUIRE_RETRY_FOR: Duration = Duration::from_secs(10);
/// Bound on one fenced write.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Share of acquire attempts that go through a node's reply-dropping relay.
const VIA_RELAY_PERCENT: u32 = 30;
/// Chance, at each of three points of a round (before the acquire, after each write, after the
/// release), that the worker also reads the lock with `Describe`: enough reads for the
/// linearizability check to catch stale ones, few enough that locks and writes dominate.
const DESCRIBE_PERCENT: u32 = 10;
/// The same chance in [`Mode::StaleDescribes`], so that a short run has many stale answers.
const STALE_DESCRIBE_PERCENT: u32 = 50;
/// Mixed into the run seed for the `Describe` decisions, which draw from a stream of their own so
/// that adding them left every other choice of a seed (resources, ttls, waits, endpoints, renews,
/// releases) as it was.
const DESCRIBE_SALT: u64 = 0x6465_7363_7269_6265;

/// Where the workers send things; the same for every worker.
#[derive(Clone, Debug)]
pub struct Endpoints {
    pub nodes: Vec<SocketAddr>,
    /// The reply-dropping relays, one per node.
    pub relays: Vec<SocketAddr>,
    pub http_proxy: SocketAddr,
    /// The register itself, written directly only in the broken (bypass) mode.
    pub register: SocketAddr,
    /// `fence-proxy postgres` and the table, when the run has a Postgres target.
    pub pg: Option<PgTarget>,
    /// The CA (PEM) of the nodes' certificates when the run uses TLS.
    pub ca_pem: Option<Vec<u8>>,
}

#[derive(Clone, Debug)]
pub struct PgTarget {
    pub proxy: tokio_postgres::Config,
    /// Postgres itself, written directly only in the broken (bypass) mode.
    pub direct: tokio_postgres::Config,
    pub table: String,
}

/// The deliberately broken modes, which show that the checker catches what it exists to catch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Correct,
    /// Writes of a paused client skip the fence.
    PausedClientsBypassFence,
    /// Each worker answers a `Describe` with what it read the previous time for that resource (a
    /// client-side cache, as a read served by a lagging replica would be): stale reads that the
    /// linearizability check must reject.
    StaleDescribes,
    /// With `--clock`: every clock step moves every node's clocks forward, the monotonic clock
    /// too, as if lockd timed leases by the wall clock; leases end early and the checks must say
    /// so.
    ClockMonotonic,
    /// With `--clock-rate`: clocks run 30-60 % fast, far past the 5 % the checks allow for;
    /// leases end early in real time and the checks must say so.
    FastClock,
    /// Two-nodes-down outages held 15-20 s, longer than the availability check allows, and not
    /// told to the checker: it must report them.
    HiddenOutage,
}

impl Mode {
    /// The `--broken` name of the mode (`None` for the correct one).
    pub fn broken_name(self) -> Option<&'static str> {
        match self {
            Mode::Correct => None,
            Mode::PausedClientsBypassFence => Some("bypass-fence"),
            Mode::StaleDescribes => Some("stale-describe"),
            Mode::ClockMonotonic => Some("clock-monotonic"),
            Mode::FastClock => Some("fast-clock"),
            Mode::HiddenOutage => Some("hidden-outage"),
        }
    }

    /// Whether the mode breaks the faked clocks (`clock.rs`).
    pub fn breaks_clocks(self) -> bool {
        matches!(self, Mode::ClockMonotonic | Mode::FastClock)
    }
}

pub struct Worker {
    pub id: usize,
    pub run: String,
    pub resources: Vec<String>,
    pub endpoints: Endpoints,
    pub history: History,
    pub mode: Mode,
    /// Set by the nemesis: after its next grant this worker stalls past its lease, then writes.
    pub pause_next: Arc<AtomicBool>,
    pub stop: CancellationToken,
    rng: StdRng,
    /// Whether and where to `Describe` (see [`DESCRIBE_SALT`]).
    reads: StdRng,
    node_channels: Vec<Channel>,
    relay_channels: Vec<Channel>,
    pg: Option<tokio_postgres::Client>,
    n: u64,
    /// The previous `Describe` answer per resource ([`Mode::StaleDescribes`] only).
    cached_reads: std::collections::HashMap<String, Outcome>,
}

/// What a gRPC status means for the caller: `Fail` only for a final answer from lockd (its
/// ErrorInfo present). UNAVAILABLE is retried with the same request_id even when its reason says
/// nothing was done, so it stays `Unknown` here: a retry may still be granted.
pub fn classify(status: &tonic::Status) -> Outcome {
    use tonic::Code::*;
    let lockd_reason = lockd_api::errors::reason_of(status).map(|(r, _)| r);
    let reason = format!(
        "{:?} {}: {}",
        status.code(),
        lockd_reason.map(|r| r.as_str()).unwrap_or("(no ErrorInfo)"),
        status.message()
    );
    match status.code() {
        Aborted | ResourceExhausted | InvalidArgument | NotFound | DeadlineExceeded
            if lockd_reason.is_some() =>
        {
            Outcome::Fail { reason }
        }
        _ => Outcome::Unknown { reason },
    }
}

/// A lease a worker holds.
struct Held {
    resource: String,
    lease_id: String,
    token: u64,
    ttl: Duration,
    /// The worker's own deadline: first send time (or last acknowledged renew's) plus the ttl.
    deadline: Instant,
}

impl Worker {
    #[allow(
        clippy::too_many_arguments,
        reason = "each is one independent setting of a worker; one call site builds it"
    )]
    pub fn new(
        id: usize,
        seed: u64,
        run: String,
        resources: Vec<String>,
        endpoints: Endpoints,
        history: History,
        mode: Mode,
        stop: CancellationToken,
    ) -> Worker {
        Worker {
            id,
            run,
            resources,
            node_channels: endpoints
                .nodes
                .iter()
                .map(|a| client_channel(*a, endpoints.ca_pem.as_deref()))
                .collect(),
            relay_channels: endpoints
                .relays
                .iter()
                .map(|a| client_channel(*a, endpoints.ca_pem.as_deref()))
                .collect(),
            endpoints,
            history,
            mode,
            pause_next: Arc::new(AtomicBool::new(false)),
            stop,
            rng: StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(id as u64)),
            reads: StdRng::seed_from_u64(
                (seed ^ DESCRIBE_SALT)
                    .wrapping_mul(1_000_003)
                    .wrapping_add(id as u64),
            ),
            pg: None,
            n: 0,
            cached_reads: std::collections::HashMap::new(),
        }
    }

    fn name(&self) -> String {
        format!("w{}", self.id)
    }

    pub async fn run(mut self) {
        while !self.stop.is_cancelled() {
            self.round().await;
        }
    }

    async fn sleep_ms(&mut self, lo: u64, hi: u64) {
        let ms = self.rng.random_range(lo..=hi);
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }

    /// One acquire, hold (renews and writes), release cycle.
    async fn round(&mut self) {
        self.n += 1;
        let resource = self.resources[self.rng.random_range(0..self.resources.len())].clone();
        let ttl_ms = TTLS_MS[self.rng.random_range(0..TTLS_MS.len())];
        let wait_ms = if self.rng.random_bool(0.5) {
            0
        } else {
            self.rng.random_range(200..=MAX_WAIT_MS)
        };
        let request_id = format!("{}-w{}-{}", self.run, self.id, self.n);
        self.maybe_describe(&resource).await;
        let Some(mut held) = self.acquire(&resource, &request_id, ttl_ms, wait_ms).await else {
            self.sleep_ms(20, 200).await;
            return;
        };
        if self.pause_next.swap(false, Ordering::SeqCst) {
            // A client that stalls (GC, SIGSTOP, VM migration) past its lease, then writes with
            // its old token as if nothing happened.
            let stall = held.ttl + Duration::from_millis(self.rng.random_range(800..=2_000));
            self.history.note(
                &self.name(),
                format!(
                    "client stalls {stall:?} holding {:?} token {}",
                    held.resource, held.token
                ),
            );
            tokio::time::sleep(stall).await;
            let bypass = self.mode == Mode::PausedClientsBypassFence;
            self.write(&held, bypass).await;
            self.release(&held).await;
            return;
        }
        let writes = self.rng.random_range(1..=3);
        for _ in 0..writes {
            if self.stop.is_cancelled() {
                break;
            }
            let left = held.deadline.saturating_duration_since(Instant::now());
            if left < held.ttl / 2 && !self.renew(&mut held).await {
                // Lease lost or uncertain: a correct client stops writing.
                self.release(&held).await;
                return;
            }
            self.write(&held, false).await;
            self.maybe_describe(&held.resource).await;
            let pause = (held.ttl.as_millis() as u64 / 4).max(50);
            self.sleep_ms(10, pause).await;
        }
        if self.rng.random_range(0..100) < 85 {
            self.release(&held).await;
            self.maybe_describe(&held.resource).await;
        } else {
            self.history.note(
                &self.name(),
                format!("abandons {:?} token {}", held.resource, held.token),
            );
        }
    }

    /// Now and then (see [`DESCRIBE_PERCENT`]), one `Describe` of `resource` on a node drawn from
    /// the read stream; not retried: an unknown answer constrains nothing.
    async fn maybe_describe(&mut self, resource: &str) {
        let percent = if self.mode == Mode::StaleDescribes {
            STALE_DESCRIBE_PERCENT
        } else {
            DESCRIBE_PERCENT
        };
        if self.reads.random_range(0..100) >= percent || self.stop.is_cancelled() {
            return;
        }
        let node = self.reads.random_range(0..self.node_channels.len());
        let op = self.history.invoke(
            self.name(),
            OpKind::Describe {
                resource: resource.to_owned(),
                via: format!("node-{}", node + 1),
            },
        );
        let mut client = LockClient::new(self.node_channels[node].clone());
        let call = client.describe(DescribeRequest {
            resource: resource.to_owned(),
        });
        let outcome = match tokio::time::timeout(ATTEMPT_SLACK, call).await {
            Ok(Ok(r)) => {
                let r = r.into_inner();
                Outcome::Described {
                    held: r.held,
                    token: r.fencing_token,
                    holder: r.holder,
                }
            }
            Ok(Err(status)) => classify(&status),
            Err(_) => Outcome::Unknown {
                reason: "describe timed out".into(),
            },
        };
        let outcome = match outcome {
            o @ Outcome::Described { .. } if self.mode == Mode::StaleDescribes => self
                .cached_reads
                .insert(resource.to_owned(), o.clone())
                .unwrap_or(o),
            o => o,
        };
        self.history.complete(op, outcome);
    }

    /// Acquire with retries of the same request id while the outcome is unknown.
    async fn acquire(
        &mut self,
        resource: &str,
        request_id: &str,
        ttl_ms: u64,
        wait_ms: u64,
    ) -> Option<Held> {
        let first_sent = Instant::now();
        let give_up = first_sent + ACQUIRE_RETRY_FOR;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let node = self.rng.random_range(0..self.node_channels.len());
            let via_relay = self.rng.random_range(0..100) < VIA_RELAY_PERCENT;
            let (ch, via) = if via_relay {
                (
                    self.relay_channels[node].clone(),
                    format!("relay-{}", node + 1),
                )
            } else {
                (
                    self.node_channels[node].clone(),
                    format!("node-{}", node + 1),
                )
            };
            let op = self.history.invoke(
                self.name(),
                OpKind::Acquire {
                    resource: resource.to_owned(),
                    request_id: request_id.to_owned(),
                    ttl_ms,
                    wait_ms,
                    attempt,
                    via,
                },
            );
            let req = AcquireRequest {
                resource: resource.to_owned(),
                request_id: request_id.to_owned(),
                lease_ttl_ms: ttl_ms,
                wait_timeout_ms: wait_ms,
                holder: self.name(),
            };
            let mut client = LockClient::new(ch);
            let call = client.acquire(req);
            let limit = Duration::from_millis(wait_ms) + ATTEMPT_SLACK;
            let outcome = match tokio::time::timeout(limit, call).await {
                Ok(Ok(r)) => {
                    let r = r.into_inner();
                    Outcome::Granted {
                        lease_id: r.lease_id,
                        token: r.fencing_token,
                    }
                }
                Ok(Err(status)) => classify(&status),
                Err(_) => Outcome::Unknown {
                    reason: format!("no answer within {limit:?}"),
                },
            };
            self.history.complete(op, outcome.clone());
            match outcome {
                Outcome::Granted { lease_id, token } => {
                    return Some(Held {
                        resource: resource.to_owned(),
                        lease_id,
                        token,
                        ttl: Duration::from_millis(ttl_ms),
                        deadline: first_sent + Duration::from_millis(ttl_ms),
                    });
                }
                Outcome::Fail { .. } => return None,
                _ => {
                    if Instant::now() > give_up || self.stop.is_cancelled() {
                        return None;
                    }
                    self.sleep_ms(50, 300).await;
                }
            }
        }
    }

    /// Renews once; true when the renew was acknowledged (the deadline moves on).
    async fn renew(&mut self, held: &mut Held) -> bool {
        let node = self.rng.random_range(0..self.node_channels.len());
        let op = self.history.invoke(
            self.name(),
            OpKind::Renew {
                resource: held.resource.clone(),
                lease_id: held.lease_id.clone(),
                token: held.token,
            },
        );
        let sent = Instant::now();
        let req = RenewRequest {
            resource: held.resource.clone(),
            lease_id: held.lease_id.clone(),
            lease_ttl_ms: 0,
        };
        let mut client = LockClient::new(self.node_channels[node].clone());
        let call = client.renew(req);
        let outcome = match tokio::time::timeout(ATTEMPT_SLACK, call).await {
            Ok(Ok(_)) => Outcome::Done { released: None },
            Ok(Err(status)) => classify(&status),
            Err(_) => Outcome::Unknown {
                reason: "renew timed out".into(),
            },
        };
        let ok = outcome.is_ok();
        self.history.complete(op, outcome);
        if ok {
            held.deadline = sent + held.ttl;
        }
        ok
    }

    async fn release(&mut self, held: &Held) {
        let node = self.rng.random_range(0..self.node_channels.len());
        let op = self.history.invoke(
            self.name(),
            OpKind::Release {
                resource: held.resource.clone(),
                lease_id: held.lease_id.clone(),
                token: held.token,
            },
        );
        let req = ReleaseRequest {
            resource: held.resource.clone(),
            lease_id: held.lease_id.clone(),
        };
        let mut client = LockClient::new(self.node_channels[node].clone());
        let call = client.release(req);
        let outcome = match tokio::time::timeout(ATTEMPT_SLACK, call).await {
            Ok(Ok(r)) => Outcome::Done {
                released: Some(r.into_inner().released),
            },
            Ok(Err(status)) => classify(&status),
            Err(_) => Outcome::Unknown {
                reason: "release timed out".into(),
            },
        };
        self.history.complete(op, outcome);
    }

    /// One fenced write to the HTTP register and, half of the time, one to the Postgres table.
    async fn write(&mut self, held: &Held, bypass: bool) {
        let value = format!(
            "{}-w{}-{}-{}",
            self.run,
            self.id,
            self.n,
            self.history.now_ms()
        );
        self.write_http(held, &value, bypass).await;
        if self.endpoints.pg.is_some() && self.rng.random_bool(0.5) {
            self.write_pg(held, &value, bypass).await;
        }
    }

    async fn write_http(&mut self, held: &Held, value: &str, bypass: bool) {
        let op = self.history.invoke(
            self.name(),
            OpKind::Write {
                target: Target::Http,
                resource: held.resource.clone(),
                token: held.token,
                value: value.to_owned(),
                bypass,
            },
        );
        let addr = if bypass {
            self.endpoints.register
        } else {
            self.endpoints.http_proxy
        };
        let outcome = match put(addr, &held.resource, held.token, value, WRITE_TIMEOUT).await {
            WriteResult::Status(200..=299, _) => Outcome::Done { released: None },
            // Refusals the proxy makes before forwarding: definitely not applied.
            WriteResult::Status(s @ (400 | 412 | 428), e) => Outcome::Fail {
                reason: format!("{s} {e:?}"),
            },
            WriteResult::Status(s, e) => Outcome::Unknown {
                reason: format!("{s} {e:?}"),
            },
            WriteResult::NoReply(e) => Outcome::Unknown { reason: e },
        };
        self.history.complete(op, outcome);
    }

    async fn write_pg(&mut self, held: &Held, value: &str, bypass: bool) {
        let Some(pg) = self.endpoints.pg.clone() else {
            return;
        };
        let op = self.history.invoke(
            self.name(),
            OpKind::Write {
                target: Target::Postgres,
                resource: held.resource.clone(),
                token: held.token,
                value: value.to_owned(),
                bypass,
            },
        );
        let attempt = async {
            // The bypassing client talks to Postgres directly on a connection of its own.
            let mut direct = None;
            let client = if bypass {
                direct = Some(connect(&pg.direct).await?);
                direct.as_ref().unwrap()
            } else {
                if self.pg.is_none() {
                    self.pg = Some(connect(&pg.proxy).await?);
                }
                let c = self.pg.as_ref().unwrap();
                c.batch_execute(&format!(
                    "SET lockd.fence = '{}:{}'",
                    held.resource, held.token
                ))
                .await?;
                c
            };
            let sql = format!(
                "INSERT INTO {} (resource, token, value) VALUES ($1, $2, $3)",
                pg.table
            );
            client
                .execute(&sql, &[&held.resource, &(held.token as i64), &value])
                .await?;
            drop(direct);
            anyhow::Ok(())
        };
        let outcome = match tokio::time::timeout(WRITE_TIMEOUT, attempt).await {
            Ok(Ok(())) => Outcome::Done { released: None },
            Ok(Err(e)) => {
                let code = e
                    .downcast_ref::<tokio_postgres::Error>()
                    .and_then(|e| e.code())
                    .map(|c| c.code().to_owned());
                if code.as_deref() == Some("55P03") {
                    Outcome::Fail {
                        reason: format!("55P03: {e}"),
                    }
                } else {
                    self.pg = None;
                    Outcome::Unknown {
                        reason: format!("{code:?}: {e}"),
                    }
                }
            }
            Err(_) => {
                self.pg = None;
                Outcome::Unknown {
                    reason: "postgres write timed out".into(),
                }
            }
        };
        self.history.complete(op, outcome);
    }
}

async fn connect(config: &tokio_postgres::Config) -> anyhow::Result<tokio_postgres::Client> {
    let (client, conn) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(async move {
        let _ = conn.await;
    });
    Ok(client)
}
