//! `mixed --status-callers N`: N tasks inside the bench, each a closed loop of `Cluster.Status`
//! calls on connections of its own, the endpoints taken in turn, for the whole run.
//!
//! They load the nodes the way dashboards and `lockctl status` polling do, without the cost of
//! starting a process per call (which, on a small machine, measures `fork` rather than lockd).
//! Only calls sent inside the measured window are counted; their latency is from the send.

use std::sync::Arc;
use std::time::{Duration, Instant};

use lockd_api::v1::StatusRequest;
use lockd_api::v1::cluster_client::ClusterClient;
use tokio::task::JoinSet;

use crate::call::call;
use crate::pool::Pool;
use crate::stats::{Recorder, Report};

/// The op name in the report.
pub const STATUS_OP: &str = "status";
/// Upper bound of `--status-callers`: each caller holds one connection per endpoint, and more
/// loops than this on a few cores only measure the bench's own scheduling.
pub const STATUS_CALLERS_MAX: usize = 256;

/// The running callers and what they recorded.
pub struct StatusLoad {
    callers: usize,
    recorder: Arc<Recorder>,
    tasks: JoinSet<()>,
}

impl StatusLoad {
    /// Starts `callers` loops (at most `STATUS_CALLERS_MAX`, checked with the other flags) that
    /// run until `end`, counting calls sent in `[measure_start, end)`. Caller `c` starts at
    /// endpoint `c`, so that the calls are spread over the nodes.
    pub fn start(
        pool: &Pool,
        callers: usize,
        measure_start: Instant,
        end: Instant,
        request_timeout: Duration,
    ) -> anyhow::Result<StatusLoad> {
        let recorder = Arc::new(Recorder::new(&[STATUS_OP]));
        let mut tasks = JoinSet::new();
        for c in 0..callers {
            let clients = pool
                .endpoints()
                .iter()
                .map(|addr| pool.channel_to(addr).map(ClusterClient::new))
                .collect::<anyhow::Result<Vec<_>>>()?;
            let recorder = recorder.clone();
            tasks.spawn(async move {
                let mut k = c;
                loop {
                    let sent = Instant::now();
                    if sent >= end {
                        return;
                    }
                    let mut client = clients[k % clients.len()].clone();
                    k += 1;
                    let res = call(
                        sent + request_timeout,
                        request_timeout,
                        client.status(StatusRequest {}),
                    )
                    .await;
                    if sent < measure_start {
                        continue;
                    }
                    match res {
                        Ok(_) => recorder.ok(STATUS_OP, sent.elapsed()),
                        Err(e) => {
                            recorder.error(STATUS_OP, e.code, &e.message);
                            // A failing node answers at once; do not spin on it.
                            tokio::time::sleep(Duration::from_millis(10)).await;
                        }
                    }
                }
            });
        }
        Ok(StatusLoad {
            callers,
            recorder,
            tasks,
        })
    }

    pub fn callers(&self) -> usize {
        self.callers
    }

    /// Waits for the loops to stop (each ends after its last call, at most `request_timeout`
    /// after the end) and freezes their figures over the measured `duration`.
    pub async fn finish(mut self, duration: Duration) -> Report {
        while self.tasks.join_next().await.is_some() {}
        self.recorder.report(duration)
    }
}
