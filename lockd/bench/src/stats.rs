//! Latency histograms and error counts per op, and the two renderings of a report: a table for
//! people (stderr) and one JSON object for machines (stdout).

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde_json::{Value, json};

/// Histogram range: 1 µs to 10 minutes, 3 significant digits (0.1 % error).
const HIST_MAX_US: u64 = 600_000_000;
const HIST_SIGFIG: u8 = 3;
/// Percentiles of the table and the JSON, as (label, quantile).
const QUANTILES: [(&str, f64); 4] = [("p50", 0.50), ("p95", 0.95), ("p99", 0.99), ("p999", 0.999)];

/// Error code a call ended with: a gRPC code name, or one of the bench's own.
pub const CLIENT_TIMEOUT: &str = "CLIENT_TIMEOUT";
/// `Release` answered `released=false` for a lease the bench believed current.
pub const NOT_RELEASED: &str = "NOT_RELEASED";

/// One error code of one op: how many, and the first message seen (servers name the values).
#[derive(Clone, Debug, Default)]
pub struct ErrorCount {
    pub count: u64,
    pub sample: String,
}

/// Everything recorded for one op.
pub struct OpStats {
    /// Latency of successful calls in µs.
    pub hist: Histogram<u64>,
    /// Failed calls by code.
    pub errors: BTreeMap<String, ErrorCount>,
    /// Calls the generator wanted to make but could not pick a target for (e.g. a renew while no
    /// lease was idle); they are not sent and not in the histogram.
    pub skipped: u64,
}

/// An empty latency histogram (µs) with the bounds and precision of every figure of the report,
/// so that figures from different histograms compare.
pub fn latency_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, HIST_MAX_US, HIST_SIGFIG)
        .expect("static histogram bounds are valid")
}

/// Records `latency` in a [`latency_histogram`], clamped into its range.
pub fn record_latency(hist: &mut Histogram<u64>, latency: Duration) {
    let us = (latency.as_micros() as u64).clamp(1, HIST_MAX_US);
    hist.record(us).expect("value clamped into range");
}

impl OpStats {
    fn new() -> Self {
        OpStats {
            hist: latency_histogram(),
            errors: BTreeMap::new(),
            skipped: 0,
        }
    }

    pub fn error_total(&self) -> u64 {
        self.errors.values().map(|e| e.count).sum()
    }
}

/// Per-op statistics behind one lock; recording is a few hundred nanoseconds, far below the
/// cost of a call.
pub struct Recorder {
    ops: Mutex<BTreeMap<&'static str, OpStats>>,
}

impl Recorder {
    /// A recorder that reports every op of `ops` (in name order), also one that saw no call.
    pub fn new(ops: &[&'static str]) -> Self {
        Recorder {
            ops: Mutex::new(ops.iter().map(|op| (*op, OpStats::new())).collect()),
        }
    }

    pub fn ok(&self, op: &'static str, latency: Duration) {
        let mut ops = self.ops.lock().expect("recorder lock");
        let stats = ops.entry(op).or_insert_with(OpStats::new);
        record_latency(&mut stats.hist, latency);
    }

    pub fn error(&self, op: &'static str, code: &str, message: &str) {
        let mut ops = self.ops.lock().expect("recorder lock");
        let e = ops
            .entry(op)
            .or_insert_with(OpStats::new)
            .errors
            .entry(code.to_owned())
            .or_default();
        if e.count == 0 {
            e.sample = message.to_owned();
        }
        e.count += 1;
    }

    pub fn skipped(&self, op: &'static str) {
        let mut ops = self.ops.lock().expect("recorder lock");
        ops.entry(op).or_insert_with(OpStats::new).skipped += 1;
    }

    /// (successful calls, failed calls) over all ops so far.
    pub fn totals(&self) -> (u64, u64) {
        let ops = self.ops.lock().expect("recorder lock");
        ops.values().fold((0, 0), |(ok, err), s| {
            (ok + s.hist.len(), err + s.error_total())
        })
    }

    /// Freezes the statistics into a report over `elapsed`.
    pub fn report(&self, elapsed: Duration) -> Report {
        let ops = self.ops.lock().expect("recorder lock");
        Report {
            elapsed,
            ops: ops
                .iter()
                .map(|(name, s)| {
                    (
                        *name,
                        OpReport {
                            ok: s.hist.len(),
                            quantiles_us: QUANTILES
                                .iter()
                                .map(|(_, q)| s.hist.value_at_quantile(*q))
                                .collect(),
                            max_us: s.hist.max(),
                            mean_us: s.hist.mean(),
                            errors: s.errors.clone(),
                            skipped: s.skipped,
                        },
                    )
                })
                .collect(),
        }
    }
}

/// A frozen view of one op.
pub struct OpReport {
    pub ok: u64,
    /// Values at `QUANTILES`, µs.
    pub quantiles_us: Vec<u64>,
    pub max_us: u64,
    pub mean_us: f64,
    pub errors: BTreeMap<String, ErrorCount>,
    pub skipped: u64,
}

impl OpReport {
    pub fn error_total(&self) -> u64 {
        self.errors.values().map(|e| e.count).sum()
    }
}

/// A frozen view of a run's measured phase.
pub struct Report {
    pub elapsed: Duration,
    pub ops: Vec<(&'static str, OpReport)>,
}

impl Report {
    pub fn ok_total(&self) -> u64 {
        self.ops.iter().map(|(_, o)| o.ok).sum()
    }

    pub fn error_total(&self) -> u64 {
        self.ops.iter().map(|(_, o)| o.error_total()).sum()
    }

    /// The p99 latency (µs) of `op`'s successful calls; `None` when it had none.
    pub fn p99_us(&self, op: &str) -> Option<u64> {
        let p99 = QUANTILES.iter().position(|(label, _)| *label == "p99")?;
        self.ops
            .iter()
            .find(|(name, o)| *name == op && o.ok > 0)
            .map(|(_, o)| o.quantiles_us[p99])
    }

    /// Successful calls per second of the measured phase.
    pub fn ok_rate(&self) -> f64 {
        self.ok_total() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }

    /// The human table: one row per op, then the errors by code with a sample message.
    pub fn table(&self) -> String {
        let mut out = String::new();
        out.push_str(&format!(
            "{:<10} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
            "op", "ok", "errors", "p50", "p95", "p99", "p999", "max", "mean"
        ));
        for (name, o) in &self.ops {
            let q: Vec<String> = o.quantiles_us.iter().map(|us| fmt_us(*us)).collect();
            out.push_str(&format!(
                "{:<10} {:>9} {:>7} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}\n",
                name,
                o.ok,
                o.error_total(),
                q[0],
                q[1],
                q[2],
                q[3],
                fmt_us(o.max_us),
                fmt_us(o.mean_us as u64),
            ));
        }
        let mut any = false;
        for (name, o) in &self.ops {
            for (code, e) in &o.errors {
                if !any {
                    out.push_str("errors by code:\n");
                    any = true;
                }
                out.push_str(&format!(
                    "  {name} {code}: {} (first: {})\n",
                    e.count, e.sample
                ));
            }
            if o.skipped > 0 {
                out.push_str(&format!(
                    "  {name}: {} not sent (nothing to pick)\n",
                    o.skipped
                ));
            }
        }
        if !any {
            out.push_str("errors by code: none\n");
        }
        out
    }

    /// Per-op figures as JSON: counts, latencies in milliseconds, errors by code.
    pub fn ops_json(&self) -> Value {
        let mut map = serde_json::Map::new();
        for (name, o) in &self.ops {
            let mut op = serde_json::Map::new();
            op.insert("ok".into(), json!(o.ok));
            op.insert("errors".into(), json!(o.error_total()));
            op.insert("skipped".into(), json!(o.skipped));
            for ((label, _), us) in QUANTILES.iter().zip(&o.quantiles_us) {
                op.insert(format!("{label}_ms"), json!(ms(*us)));
            }
            op.insert("max_ms".into(), json!(ms(o.max_us)));
            op.insert("mean_ms".into(), json!(ms(o.mean_us as u64)));
            let codes: serde_json::Map<String, Value> = o
                .errors
                .iter()
                .map(|(code, e)| (code.clone(), json!({"count": e.count, "sample": e.sample})))
                .collect();
            op.insert("errors_by_code".into(), Value::Object(codes));
            map.insert((*name).into(), Value::Object(op));
        }
        Value::Object(map)
    }
}

/// Milliseconds with µs precision, for JSON.
pub fn ms(us: u64) -> f64 {
    us as f64 / 1000.0
}

/// `850µs`, `12.3ms`, `1.20s`: short and unit-bearing for the table.
pub fn fmt_us(us: u64) -> String {
    if us < 1_000 {
        format!("{us}µs")
    } else if us < 1_000_000 {
        format!("{:.1}ms", us as f64 / 1000.0)
    } else {
        format!("{:.2}s", us as f64 / 1_000_000.0)
    }
}

/// The gRPC code's canonical name (`UNAVAILABLE`, `ABORTED`...).
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_counts_ok_and_errors_per_op() {
        let r = Recorder::new(&["acquire", "release"]);
        r.ok("acquire", Duration::from_millis(2));
        r.ok("acquire", Duration::from_millis(4));
        r.error("release", "UNAVAILABLE", "lockd: no leader");
        r.error("release", "UNAVAILABLE", "lockd: second");
        let rep = r.report(Duration::from_secs(2));
        assert_eq!(rep.ok_total(), 2);
        assert_eq!(rep.error_total(), 2);
        assert!((rep.ok_rate() - 1.0).abs() < 1e-9);
        let table = rep.table();
        assert!(
            table.contains("release UNAVAILABLE: 2 (first: lockd: no leader)"),
            "{table}"
        );
        let json = rep.ops_json();
        assert_eq!(json["acquire"]["ok"], 2);
        assert_eq!(json["release"]["errors_by_code"]["UNAVAILABLE"]["count"], 2);
        let p99 = rep.p99_us("acquire").expect("two acquires");
        assert!((4_000..=4_004).contains(&p99), "p99 of 2 and 4 ms: {p99}µs");
        assert_eq!(rep.p99_us("release"), None, "no successful release");
    }

    #[test]
    fn durations_format_with_units() {
        assert_eq!(fmt_us(850), "850µs");
        assert_eq!(fmt_us(12_345), "12.3ms");
        assert_eq!(fmt_us(1_200_000), "1.20s");
    }
}
