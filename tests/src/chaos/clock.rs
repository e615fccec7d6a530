//! Wrong clocks for chaos runs, made with libfaketime (the `libfaketime` Debian package): each
//! node runs with the library preloaded and reads its faked time from a file of its own, which the
//! harness rewrites while the node runs.
//!
//! Two modes, never together (one preloaded library fakes either the wall clock alone or both):
//! - [`ClockMode::Offsets`] (`chaos --clock`): wall-clock offsets of a minute to six hours, changed
//!   on any node at any time while it runs (the node rereads its file every second); the monotonic
//!   clock stays real (`FAKETIME_DONT_FAKE_MONOTONIC=1`). lockd promises that no offset of any
//!   size changes a lease expiry or a `request_id` outcome.
//! - [`ClockMode::Rates`] (`chaos --clock-rate`): every start of a node draws a rate within
//!   ±[`MAX_RATE_ERROR_PCT`] % for both of its clocks, monotonic included, kept until the process
//!   ends (changing a rate under a running process would make its clock jump). lockd assumes sane
//!   rates: a leader whose clock runs fast ends leases early in real time, so the checks count a
//!   client's lease as [`rate_margin_ttl_ms`] of its ttl, as a client with a safety margin would.
//!
//! Broken variants (`broken`), which the checks must catch: [`ClockMode::Offsets`]
//! (every step moves every node's clocks forward, the monotonic one too: the leader then sees
//! leases run out early, as a lockd that timed leases by the wall clock would) and [`ClockMode::Rates`] with rates of
//! [`BROKEN_RATE_PCT`], far beyond the assumed bound.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// Overrides where the library is looked for.
pub const LIBFAKETIME_ENV: &str = "LOCKD_CHAOS_LIBFAKETIME";
/// Where Debian and a `make install` put the library. The MT variant serializes the library's
/// own cached state between threads; lockd's runtime reads clocks from many threads.
const LIBFAKETIME_PATHS: [&str; 4] = [
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/local/lib/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
];
/// How often (seconds) a faked process rereads its file: an offset change takes effect within it.
const REREAD_S: u32 = 1;
/// Smallest and largest size of a wall-clock offset in [`ClockMode::Offsets`] (1 min, 6 h).
pub const MIN_OFFSET_S: i64 = 60;
pub const MAX_OFFSET_S: i64 = 6 * 3_600;
/// Share of offset steps that set a node's clock right again (offset 0).
const RESET_PERCENT: u32 = 10;
/// Largest forward step of the broken mode (monotonic clock faked too): one hour.
const BROKEN_STEP_MAX_S: i64 = 3_600;
/// The rate bound of [`ClockMode::Rates`]: each clock runs at 95-105 % of real time.
pub const MAX_RATE_ERROR_PCT: u64 = 5;
/// Rates of the broken rate mode, in percent of real time: well past the bound the checks allow.
pub const BROKEN_RATE_PCT: (u64, u64) = (130, 160);
/// Mixed into the run seed so clock draws are a stream of their own.
const CLOCK_SALT: u64 = 0x636c_6f63_6b73_2121;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClockMode {
    /// Wall-clock offsets changed at run time.
    Offsets,
    /// A rate per process start, both clocks.
    Rates,
}

impl ClockMode {
    /// The `chaos` flag of the mode.
    pub fn flag(self) -> &'static str {
        match self {
            ClockMode::Offsets => "--clock",
            ClockMode::Rates => "--clock-rate",
        }
    }
}

/// The lease time a client may count on when the leader's clock may run up to
/// [`MAX_RATE_ERROR_PCT`] % fast: the ttl less that share (a lease the table times as `ttl` ends
/// after `ttl / 1.05` of real time at the earliest, which is more than `ttl × 0.95`).
pub fn rate_margin_ttl_ms(ttl_ms: u64, rate_error_pct: u64) -> u64 {
    ttl_ms * (100 - rate_error_pct.min(100)) / 100
}

/// The faked clocks of one run's nodes.
pub struct FakeClocks {
    pub mode: ClockMode,
    /// The broken variant (see the module docs).
    pub broken: bool,
    lib: PathBuf,
    dir: PathBuf,
    state: Mutex<State>,
}

struct State {
    rng: StdRng,
    /// Current wall-clock offset per node, seconds (index = id - 1).
    offsets_s: Vec<i64>,
    /// Runtime offset changes made so far.
    steps: u64,
    /// Process starts that drew a rate so far.
    rates_drawn: u64,
}

/// libfaketime's spec for an offset and an optional rate: `+7200`, `-60 x1.050000`.
pub fn spec(offset_s: i64, rate_pct_x100: Option<u64>) -> String {
    let mut s = format!("{offset_s:+}");
    if let Some(r) = rate_pct_x100 {
        // Percent with two decimals, written as a factor; '.' is the C locale's separator.
        s.push_str(&format!(" x{}.{:04}", r / 10_000, r % 10_000));
    }
    s
}

/// The libfaketime library to preload: `$LOCKD_CHAOS_LIBFAKETIME`, or the first of the usual
/// places that exists.
pub fn find_library() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(LIBFAKETIME_ENV) {
        let p = PathBuf::from(p);
        anyhow::ensure!(
            p.is_file(),
            "{LIBFAKETIME_ENV}={} is not a file",
            p.display()
        );
        return Ok(p);
    }
    LIBFAKETIME_PATHS
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow::anyhow!(
                "clock faults need libfaketime (Debian package `libfaketime`): none of {LIBFAKETIME_PATHS:?} exists; set {LIBFAKETIME_ENV} to its libfaketimeMT.so.1"
            )
        })
}

impl FakeClocks {
    /// Clocks for `nodes` nodes with their files in `dir`; every node starts right (offset 0,
    /// real rate) except in [`ClockMode::Offsets`], where each starts with a drawn offset.
    pub fn new(
        dir: &Path,
        mode: ClockMode,
        broken: bool,
        seed: u64,
        nodes: u64,
    ) -> anyhow::Result<FakeClocks> {
        let clocks = FakeClocks {
            mode,
            broken,
            lib: find_library()?,
            dir: dir.to_path_buf(),
            state: Mutex::new(State {
                rng: StdRng::seed_from_u64(seed ^ CLOCK_SALT),
                offsets_s: vec![0; nodes as usize],
                steps: 0,
                rates_drawn: 0,
            }),
        };
        for id in 1..=nodes {
            let offset = if mode == ClockMode::Offsets && !broken {
                let mut st = clocks.state.lock().unwrap();
                let o = draw_offset(&mut st.rng);
                st.offsets_s[id as usize - 1] = o;
                o
            } else {
                0
            };
            clocks.write(id, &spec(offset, None))?;
        }
        Ok(clocks)
    }

    fn file(&self, id: u64) -> PathBuf {
        self.dir.join(format!("node{id}.faketime"))
    }

    /// Replaces node `id`'s spec in one rename, so a node rereading it never sees half a line.
    fn write(&self, id: u64, spec: &str) -> anyhow::Result<()> {
        let path = self.file(id);
        let tmp = self.dir.join(format!("node{id}.faketime.new"));
        std::fs::write(&tmp, format!("{spec}\n"))
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, &path)
            .map_err(|e| anyhow::anyhow!("renaming {} to {}: {e}", tmp.display(), path.display()))
    }

    /// Prepares node `id`'s start: in [`ClockMode::Rates`] draws the rate this process will run
    /// at and returns it (percent × 100); then sets the environment that preloads the library.
    pub fn before_start(&self, id: u64, cmd: &mut Command) -> anyhow::Result<Option<u64>> {
        let mut rate = None;
        if self.mode == ClockMode::Rates {
            let mut st = self.state.lock().unwrap();
            let r = if self.broken {
                st.rng
                    .random_range(BROKEN_RATE_PCT.0 * 100..=BROKEN_RATE_PCT.1 * 100)
            } else {
                st.rng.random_range(
                    (100 - MAX_RATE_ERROR_PCT) * 100..=(100 + MAX_RATE_ERROR_PCT) * 100,
                )
            };
            st.rates_drawn += 1;
            drop(st);
            self.write(id, &spec(0, Some(r)))?;
            rate = Some(r);
        }
        cmd.env("LD_PRELOAD", &self.lib)
            .env("FAKETIME_TIMESTAMP_FILE", self.file(id))
            .env("FAKETIME_CACHE_DURATION", REREAD_S.to_string());
        // Only the broken offset mode and the rate mode move the monotonic clock.
        if self.mode == ClockMode::Offsets && !self.broken {
            cmd.env("FAKETIME_DONT_FAKE_MONOTONIC", "1");
        }
        Ok(rate)
    }

    /// One step of [`ClockMode::Offsets`]: a new offset for a node drawn from the clock stream
    /// (any node; a minute to six hours either way, sometimes right again). In the broken mode
    /// every node's clocks step forward by a minute to an hour each, so the leader's always do
    /// (a jump on a follower changes nothing until it leads: a new leader's clock starts afresh).
    /// Returns a description.
    pub fn step(&self, nodes: u64) -> anyhow::Result<String> {
        let changes: Vec<(u64, i64, i64)> = {
            let mut st = self.state.lock().unwrap();
            let ids: Vec<u64> = if self.broken {
                (1..=nodes).collect()
            } else {
                vec![st.rng.random_range(1..=nodes)]
            };
            ids.into_iter()
                .map(|id| {
                    let was = st.offsets_s[id as usize - 1];
                    let offset = if self.broken {
                        was + st.rng.random_range(MIN_OFFSET_S..=BROKEN_STEP_MAX_S)
                    } else {
                        draw_offset(&mut st.rng)
                    };
                    st.offsets_s[id as usize - 1] = offset;
                    st.steps += 1;
                    (id, was, offset)
                })
                .collect()
        };
        let which = if self.broken {
            "wall and monotonic clocks"
        } else {
            "wall clock"
        };
        let mut what = Vec::new();
        for (id, was, offset) in changes {
            self.write(id, &spec(offset, None))?;
            what.push(format!(
                "node {id}'s {which} offset {was:+} s -> {offset:+} s"
            ));
        }
        Ok(what.join("; "))
    }

    /// Each node's current wall-clock offset, seconds.
    pub fn offsets_s(&self) -> Vec<i64> {
        self.state.lock().unwrap().offsets_s.clone()
    }

    /// Runtime offset changes made, and rates drawn at process starts.
    pub fn counts(&self) -> (u64, u64) {
        let st = self.state.lock().unwrap();
        (st.steps, st.rates_drawn)
    }

    /// A next pause between offset steps, ms.
    pub fn next_pause_ms(&self, lo: u64, hi: u64) -> u64 {
        self.state.lock().unwrap().rng.random_range(lo..=hi)
    }
}

fn draw_offset(rng: &mut StdRng) -> i64 {
    if rng.random_range(0..100) < RESET_PERCENT {
        return 0;
    }
    let size = rng.random_range(MIN_OFFSET_S..=MAX_OFFSET_S);
    if rng.random_bool(0.5) { size } else { -size }
}

/// Removes the shared-memory objects libfaketime made for process `pid`: it deletes them itself on
/// a clean exit, but not after SIGKILL, and a later process given the same pid would then run
/// without them.
pub fn remove_shm_of(pid: u32) {
    for name in [
        format!("/dev/shm/faketime_shm_{pid}"),
        format!("/dev/shm/sem.faketime_sem_{pid}"),
    ] {
        let _ = std::fs::remove_file(name);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_are_what_libfaketime_parses() {
        assert_eq!(spec(7_200, None), "+7200");
        assert_eq!(spec(-60, None), "-60");
        assert_eq!(spec(0, Some(10_500)), "+0 x1.0500");
        assert_eq!(spec(0, Some(9_501)), "+0 x0.9501");
        assert_eq!(spec(0, Some(16_000)), "+0 x1.6000");
    }

    #[test]
    fn the_rate_margin_takes_the_bound_off_the_ttl() {
        assert_eq!(rate_margin_ttl_ms(3_000, 5), 2_850);
        assert_eq!(rate_margin_ttl_ms(1_000, 0), 1_000);
        // A lease timed by a clock 5 % fast ends no earlier than this in real time.
        assert!(rate_margin_ttl_ms(3_000, 5) as f64 <= 3_000.0 / 1.05);
    }
}
