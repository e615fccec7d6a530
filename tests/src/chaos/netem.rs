//! A user-space netem: a forwarder that moves Ethernet frames between two links of a namespace
//! (`AF_PACKET` sockets), losing, delaying (with jitter) and reordering them on the way.
//!
//! Why not `tc qdisc ... netem`: the kernel this suite runs on is built without `sch_netem` (and
//! without the `gact` action that `tc` filters drop with), so [`super::netns`] takes an impaired
//! node's port off the bridge and puts this forwarder between it and a spare port that is on the
//! bridge. Frames are read with their `virtio_net_hdr` (`PACKET_VNET_HDR`), so TCP segmentation
//! and checksum offload survive the trip unchanged.
//!
//! It is not a traffic shaper: no rate limits or queue limits, and it copies every frame.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};

/// `SOL_PACKET` options (linux/if_packet.h).
const PACKET_VNET_HDR: libc::c_int = 15;
const PACKET_IGNORE_OUTGOING: libc::c_int = 23;
/// A GSO frame is up to 64 KiB, after a 10-byte `virtio_net_hdr`.
const FRAME_BYTES_MAX: usize = 65_536 + 64;
/// How often a blocked reader or the sender looks at the stop flag.
const POLL: Duration = Duration::from_millis(50);

/// What the forwarder does to each frame, in both directions, drawn per frame from `seed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NetemSpec {
    /// Share of frames dropped.
    pub loss_pct: u32,
    /// Delay of each frame, plus or minus up to `jitter_ms` (uniform): frames whose delays
    /// cross are reordered, as with netem's jitter.
    pub delay_ms: u64,
    pub jitter_ms: u64,
    /// Share of frames sent at once, without the delay (netem's `reorder`): they overtake the
    /// delayed ones.
    pub reorder_pct: u32,
    pub seed: u64,
}

impl std::fmt::Display for NetemSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "loss {} %, delay {} ms +- {} ms, {} % sent undelayed",
            self.loss_pct, self.delay_ms, self.jitter_ms, self.reorder_pct
        )
    }
}

/// Moves the calling thread into the network namespace bound at `path` (`/run/netns/NAME`).
pub fn enter_netns(path: &str) -> std::io::Result<()> {
    let f = std::fs::File::open(path)?;
    // SAFETY: setns on a descriptor `f` keeps open; it changes this thread's namespace only.
    #[allow(unsafe_code, reason = "FFI: setns has no safe wrapper in libc")]
    let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A raw socket on `ifname` of the current thread's namespace, with virtio headers, not seeing
/// the frames it sends itself, with a receive timeout of [`POLL`].
#[allow(
    unsafe_code,
    reason = "FFI: AF_PACKET sockets and their options have no safe wrapper"
)]
fn packet_socket(ifname: &str) -> std::io::Result<OwnedFd> {
    let err = std::io::Error::last_os_error;
    let name = CString::new(ifname).map_err(std::io::Error::other)?;
    // SAFETY: plain libc calls with valid pointers and the sizes of what they point to; an
    // all-zero sockaddr_ll is a valid value; the descriptor is owned as soon as it exists.
    unsafe {
        let ifindex = libc::if_nametoindex(name.as_ptr());
        if ifindex == 0 {
            return Err(err());
        }
        let proto = (libc::ETH_P_ALL as u16).to_be();
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW, proto as libc::c_int);
        if fd < 0 {
            return Err(err());
        }
        let fd = OwnedFd::from_raw_fd(fd);
        let one: libc::c_int = 1;
        for opt in [PACKET_VNET_HDR, PACKET_IGNORE_OUTGOING] {
            if libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_PACKET,
                opt,
                &one as *const _ as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            ) != 0
            {
                return Err(err());
            }
        }
        let tv = libc::timeval {
            tv_sec: 0,
            tv_usec: POLL.as_micros() as libc::suseconds_t,
        };
        if libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            &tv as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        ) != 0
        {
            return Err(err());
        }
        let mut sll: libc::sockaddr_ll = std::mem::zeroed();
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = ifindex as i32;
        if libc::bind(
            fd.as_raw_fd(),
            &sll as *const _ as *const libc::sockaddr,
            std::mem::size_of::<libc::sockaddr_ll>() as libc::socklen_t,
        ) != 0
        {
            return Err(err());
        }
        Ok(fd)
    }
}

/// A frame waiting for its time: (due, sequence number, direction, bytes).
type Queued = Reverse<(Instant, u64, usize, Vec<u8>)>;

struct Queue {
    frames: Mutex<(BinaryHeap<Queued>, u64)>,
    ready: Condvar,
}

/// A running forwarder; dropping it stops it (frames still queued are lost, as on a cut link).
pub struct Netem {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Netem {
    /// Forwards between links `a` and `b` of the namespace bound at `netns` until dropped.
    pub fn start(netns: &str, a: &str, b: &str, spec: NetemSpec) -> anyhow::Result<Netem> {
        // The sockets belong to the namespace of the thread that makes them, for good; so make
        // them on a thread of their own and leave every other thread where it is.
        let (netns_path, a_name, b_name) = (netns.to_owned(), a.to_owned(), b.to_owned());
        let fds = std::thread::spawn(move || -> std::io::Result<[Arc<OwnedFd>; 2]> {
            enter_netns(&netns_path)?;
            Ok([
                Arc::new(packet_socket(&a_name)?),
                Arc::new(packet_socket(&b_name)?),
            ])
        })
        .join()
        .map_err(|_| anyhow::anyhow!("netem socket thread panicked"))?
        .map_err(|e| anyhow::anyhow!("netem sockets on {a} and {b} in {netns}: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let queue = Arc::new(Queue {
            frames: Mutex::new((BinaryHeap::new(), 0)),
            ready: Condvar::new(),
        });
        let mut threads = Vec::new();
        for (dir, fd) in fds.iter().enumerate() {
            let (fd, stop, queue) = (fd.clone(), stop.clone(), queue.clone());
            let rng = StdRng::seed_from_u64(spec.seed ^ dir as u64);
            threads.push(std::thread::spawn(move || {
                read_loop(&fd, dir, spec, rng, &stop, &queue)
            }));
        }
        {
            let (stop, queue) = (stop.clone(), queue.clone());
            threads.push(std::thread::spawn(move || send_loop(&fds, &stop, &queue)));
        }
        Ok(Netem { stop, threads })
    }
}

impl Drop for Netem {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Reads frames arriving on `fd` (direction `dir`: 0 from link a, 1 from link b) and queues
/// those not lost for the other link.
fn read_loop(
    fd: &OwnedFd,
    dir: usize,
    spec: NetemSpec,
    mut rng: StdRng,
    stop: &AtomicBool,
    queue: &Queue,
) {
    let mut buf = vec![0u8; FRAME_BYTES_MAX];
    while !stop.load(Ordering::SeqCst) {
        // SAFETY: reads at most `buf.len()` bytes into `buf`.
        #[allow(unsafe_code, reason = "FFI: recv on a raw AF_PACKET socket")]
        let n = unsafe {
            libc::recv(
                fd.as_raw_fd(),
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                0,
            )
        };
        if n <= 0 {
            continue;
        }
        if rng.random_range(0..100) < spec.loss_pct {
            continue;
        }
        let delay_ms = if rng.random_range(0..100) < spec.reorder_pct {
            0
        } else {
            let lo = spec.delay_ms.saturating_sub(spec.jitter_ms);
            rng.random_range(lo..=spec.delay_ms + spec.jitter_ms)
        };
        let due = Instant::now() + Duration::from_millis(delay_ms);
        let mut q = queue.frames.lock().unwrap();
        q.1 += 1;
        let seq = q.1;
        q.0.push(Reverse((due, seq, dir, buf[..n as usize].to_vec())));
        queue.ready.notify_one();
    }
}

/// Sends queued frames when they are due, each out of the link it did not come in by.
fn send_loop(fds: &[Arc<OwnedFd>; 2], stop: &AtomicBool, queue: &Queue) {
    while !stop.load(Ordering::SeqCst) {
        let frame = {
            let mut q = queue.frames.lock().unwrap();
            let wait = match q.0.peek() {
                Some(Reverse((due, ..))) => due.saturating_duration_since(Instant::now()),
                None => POLL,
            };
            if wait.is_zero() {
                q.0.pop()
            } else {
                let _ = queue.ready.wait_timeout(q, wait.min(POLL)).unwrap();
                None
            }
        };
        if let Some(Reverse((_, _, dir, bytes))) = frame {
            let out = &fds[1 - dir];
            // SAFETY: reads `bytes.len()` bytes from `bytes`. A failed send is a lost frame.
            #[allow(unsafe_code, reason = "FFI: send on a raw AF_PACKET socket")]
            unsafe {
                libc::send(
                    out.as_raw_fd(),
                    bytes.as_ptr() as *const libc::c_void,
                    bytes.len(),
                    0,
                );
            }
        }
    }
}
