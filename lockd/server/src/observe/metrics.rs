//! Prometheus metrics of one node.
//!
//! Each node owns its own recorder instead of the process-global one, because `lockd dev` runs
//! three nodes in one process and each must report its own figures on its own port.

use std::sync::Arc;
use std::time::Duration;

use lockd_service_kit::recorder;
use metrics::Recorder;
use metrics_exporter_prometheus::{PrometheusHandle, PrometheusRecorder};
use tokio_util::sync::CancellationToken;

/// Buckets of `lockd_log_fsync_duration_seconds`, from 100 µs: a local SSD syncs in well under
/// a millisecond, and an fsync of tens of milliseconds is what the alert looks for.
pub const FSYNC_BUCKETS_SECONDS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// A client-facing operation, the `op` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Acquire,
    Renew,
    Release,
    Describe,
}

impl Op {
    pub fn as_str(self) -> &'static str {
        match self {
            Op::Acquire => "acquire",
            Op::Renew => "renew",
            Op::Release => "release",
            Op::Describe => "describe",
        }
    }
}

/// Every `outcome` label of `lockd_requests_total` (see `service::errors::outcome_label`).
const OUTCOMES: [&str; 7] = [
    "ok",
    "held",
    "timeout",
    "not_found",
    "invalid",
    "exhausted",
    "unavailable",
];
const OPS: [Op; 4] = [Op::Acquire, Op::Renew, Op::Release, Op::Describe];

pub struct NodeMetrics {
    recorder: PrometheusRecorder,
    handle: PrometheusHandle,
    /// The series written on every call and every log commit, registered once: through the
    /// macros each write builds its key and looks it up in the registry again.
    hot: HotSeries,
}

/// Handles of the series written on the hot paths; they write to the same storage the
/// macros find, so rendering and upkeep see no difference.
struct HotSeries {
    /// `lockd_requests_total` by op (index in `OPS`) and outcome (index in `OUTCOMES`).
    requests: [[metrics::Counter; OUTCOMES.len()]; OPS.len()],
    /// `lockd_request_duration_seconds` by op.
    durations: [metrics::Histogram; OPS.len()],
    renew_failures: metrics::Counter,
    log_fsync: metrics::Histogram,
    /// `lockd_forwarded_total` by `via`: stream, call.
    forwarded: [metrics::Counter; 2],
}

impl NodeMetrics {
    pub fn new() -> Self {
        // Latency histograms use the buckets shared with fence-proxy (1 ms to 10 s).
        let recorder = recorder::latency_builder()
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(
                    "lockd_log_fsync_duration_seconds".into(),
                ),
                FSYNC_BUCKETS_SECONDS,
            )
            .expect("non-empty bucket list")
            .build_recorder();
        let handle = recorder.handle();
        let hot = metrics::with_local_recorder(&recorder as &dyn Recorder, || {
            HotSeries {
            requests: OPS.map(|op| {
                OUTCOMES.map(|outcome| {
                    metrics::counter!("lockd_requests_total", "op" => op.as_str(), "outcome" => outcome)
                })
            }),
            durations: OPS
                .map(|op| metrics::histogram!("lockd_request_duration_seconds", "op" => op.as_str())),
            renew_failures: metrics::counter!("lockd_renew_failures_total"),
            log_fsync: metrics::histogram!("lockd_log_fsync_duration_seconds"),
            forwarded: ["stream", "call"]
                .map(|via| metrics::counter!("lockd_forwarded_total", "via" => via)),
        }
        });
        let m = NodeMetrics {
            recorder,
            handle,
            hot,
        };
        m.with(|| {
            metrics::describe_counter!("lockd_requests_total", "Client calls answered by this node, by op and outcome.");
            metrics::describe_histogram!("lockd_request_duration_seconds", "Client call latency at this node, by op.");
            metrics::describe_gauge!("lockd_active_locks", "Leases held in this node's copy of the lock table.");
            metrics::describe_gauge!("lockd_waiters", "Queued waiters in this node's copy of the lock table.");
            metrics::describe_counter!("lockd_lease_expirations_total", "Leases that expired without release (applied on this node).");
            metrics::describe_counter!("lockd_renew_failures_total", "Renew calls answered NOT_FOUND by this node.");
            metrics::describe_counter!("lockd_forwarded_total", "Client calls this node forwarded to the leader, by how: on its forward stream (many calls per message) or as a call of their own (waiting acquires, Describe, a leader of an older release).");
            metrics::describe_gauge!("lockd_is_leader", "1 while this node is the Raft leader.");
            metrics::describe_counter!("lockd_leader_changes_total", "Leader changes observed by this node.");
            metrics::describe_histogram!("lockd_raft_commit_duration_seconds", "Time from proposing a batch to its apply.");
            metrics::describe_gauge!("lockd_raft_commit_index", "Highest committed Raft log index known to this node.");
            metrics::describe_gauge!("lockd_raft_term", "Current Raft term of this node.");
            metrics::describe_gauge!("lockd_build_info", "Always 1; the version of this lockd in the `version` label.");
            metrics::describe_gauge!("lockd_peer_protocol", "The peer protocol version a member last announced on its Raft messages, by peer (1: a lockd before the announcement).");
            metrics::describe_gauge!("lockd_cluster_peer_protocol", "The peer protocol version every member speaks (members not heard from count as the oldest this build supports); read on the leader, which hears from every member: a rolling upgrade is complete when the leader's reaches this build's.");
            metrics::describe_histogram!("lockd_log_fsync_duration_seconds", "Time to make one batch of Raft log writes durable (the redb commit, mostly its fsync).");
            metrics::describe_histogram!("lockd_snapshot_duration_seconds", "Time to make a snapshot durable, by kind: build (from the table) or install (from the leader).");
            metrics::describe_gauge!("lockd_snapshot_size_bytes", "Size of the latest snapshot this node built or installed.");
            metrics::describe_gauge!("lockd_log_size_bytes", "Size of the Raft log database file (lockd.redb).");
            metrics::describe_gauge!("lockd_data_dir_free_bytes", "Bytes available to lockd on the data dir's file system.");
            metrics::describe_gauge!("lockd_data_dir_capacity_bytes", "Size of the data dir's file system.");
            metrics::describe_gauge!("lockd_replication_lag_entries", "On the leader: log entries a member has not yet acknowledged, by peer.");
            metrics::describe_gauge!("lockd_clock_offset_seconds", "This node's wall clock minus the leader's stamp on the last applied entry (includes the replication delay; the stamp never goes back).");
            metrics::gauge!("lockd_build_info", "version" => env!("CARGO_PKG_VERSION")).set(1.0);
            for counters in &m.hot.requests {
                for counter in counters {
                    counter.absolute(0);
                }
            }
            metrics::counter!("lockd_lease_expirations_total").absolute(0);
            m.hot.renew_failures.absolute(0);
            for counter in &m.hot.forwarded {
                counter.absolute(0);
            }
            metrics::counter!("lockd_leader_changes_total").absolute(0);
        });
        m
    }

    /// Runs `f` with this node's recorder, so the `metrics` macros inside record here.
    pub fn with<T>(&self, f: impl FnOnce() -> T) -> T {
        metrics::with_local_recorder(&self.recorder as &dyn Recorder, f)
    }

    pub fn request(&self, op: Op, outcome: &'static str, elapsed: Duration) {
        let o = OPS
            .iter()
            .position(|x| *x == op)
            .expect("every op is in OPS");
        match OUTCOMES.iter().position(|x| *x == outcome) {
            Some(i) => self.hot.requests[o][i].increment(1),
            // Not an outcome outcome_label gives; counted all the same.
            None => self.with(|| {
                metrics::counter!("lockd_requests_total", "op" => op.as_str(), "outcome" => outcome)
                    .increment(1)
            }),
        }
        self.hot.durations[o].record(elapsed.as_secs_f64());
        if op == Op::Renew && outcome == "not_found" {
            self.hot.renew_failures.increment(1);
        }
    }

    /// Counts a call this node forwarded: on the forward stream, or as a call of its own.
    pub fn forwarded(&self, streamed: bool) {
        self.hot.forwarded[usize::from(!streamed)].increment(1);
    }

    pub fn render(&self) -> String {
        self.handle.run_upkeep();
        self.handle.render()
    }

    /// Folds recorded histogram samples into their buckets every few seconds until `shutdown`
    /// (see `lockd_service_kit::recorder::upkeep`): a node nobody scrapes would otherwise keep
    /// every latency it recorded.
    pub async fn upkeep(self: Arc<Self>, shutdown: CancellationToken) {
        recorder::upkeep(self.handle.clone(), shutdown).await
    }
}

impl crate::storage::StorageObserver for NodeMetrics {
    fn log_synced(&self, took: Duration) {
        self.hot.log_fsync.record(took.as_secs_f64());
    }
}

impl NodeMetrics {
    /// A snapshot was built or installed (see `AppliedSink::on_snapshot_stored`).
    pub fn snapshot_stored(&self, installed: bool, took: Duration, bytes: u64) {
        let kind = if installed { "install" } else { "build" };
        self.with(|| {
            metrics::histogram!("lockd_snapshot_duration_seconds", "kind" => kind)
                .record(took.as_secs_f64());
            metrics::gauge!("lockd_snapshot_size_bytes").set(bytes as f64);
        });
    }
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}
