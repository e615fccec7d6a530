//! What a client's HTTP/2 flow-control windows leave on this node, followed from the bytes a
//! connection carries each way: frame headers, and the payloads of the client's SETTINGS and
//! WINDOW_UPDATE frames, nothing else.
//!
//! Used by lockd's ports (`lockd/server/src/connections.rs`) and fence-proxy's HTTP front end.
//!
//! Why: hyper hands an answer to h2 in one piece as soon as flow control grants its stream one
//! byte, and h2 keeps whatever the windows do not let out yet. Answers handed over that way are
//! gone from everything a server sees of its answers (lockd's untaken answers and budget,
//! fence-proxy's send timeout), yet each keeps its stream, headers and bytes in h2, up to the
//! connection's stream limit, for as long as the client answers pings. A client gets there with stream windows smaller than an
//! answer (SETTINGS_INITIAL_WINDOW_SIZE of 1 byte), or by keeping the connection window shut and
//! opening it a byte at a time, each byte letting one more answer into h2.
//!
//! Small windows are legitimate (gRPC core shrinks them under memory pressure, down to 0, and
//! grants each stream what its reader needs), so they are not refused. What is bounded is
//! starvation: a window (a stream's, or the connection's) is *starved* from the moment the node's
//! DATA exhausts it until the client's WINDOW_UPDATEs have granted [`GRANT_PROGRESS`] bytes since,
//! or it stays open for [`IDLE_AFTER_GRANT`] after a grant (then the node had nothing waiting),
//! or the stream ends. SETTINGS move windows but never end a starvation. The
//! connection is closed once a window has been starved for the server's send timeout,
//! or once more than [`STARVED_STREAMS_MAX`] streams have been starved for over
//! [`STARVED_GRACE`] at once (while the connection's window has been starved that long, every
//! answer begun and not ended counts: a byte of it lets hyper hand over a whole answer) (each keeps about 9 KB; a reading client takes its answers within
//! milliseconds). A byte at a time, a window never stops being starved: each grant is used at
//! once. A connection with a starved window is looked at every [`STARVED_GRACE`] until none is.

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Grants that add up to this end a window's starvation: enough for any unary answer of lockd
/// whole (they are well under 16 KiB); a client granting a byte at a time sends over 200 KB of
/// WINDOW_UPDATEs for it.
pub const GRANT_PROGRESS: u32 = 16_384;
/// A window left open this long after a grant was not waited on: the node had nothing for it.
pub const IDLE_AFTER_GRANT: Duration = Duration::from_secs(1);
/// Streams of one connection that may be starved for over [`STARVED_GRACE`] at once: 256 lockd
/// connections from one address then hold at most about 75 MB this way, as lockd's budget allows
/// for answers hyper has not taken.
pub const STARVED_STREAMS_MAX: usize = 32;
/// How long a stream may be starved before it counts against [`STARVED_STREAMS_MAX`].
pub const STARVED_GRACE: Duration = Duration::from_secs(1);
/// Streams of one connection whose windows are followed; h2 keeps at most 1,024 open, so this is
/// never reached unless streams end unseen, and then the connection is closed (fail closed).
const STREAMS_FOLLOWED_MAX: usize = 4_096;

/// The window every HTTP/2 stream and connection starts with.
const DEFAULT_WINDOW: i64 = 65_535;
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER_BYTES: usize = 9;
const DATA: u8 = 0x0;
const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const WINDOW_UPDATE: u8 = 0x8;
const ACK: u8 = 0x1;
const END_STREAM: u8 = 0x1;
const SETTINGS_INITIAL_WINDOW_SIZE: u16 = 0x4;

/// One connection's send windows, as far as starvation goes.
pub struct FlowWatch {
    from_client: Scanner,
    to_client: Scanner,
    connection: Window,
    /// Open streams by id (the client's, odd): each from its HEADERS to the node's END_STREAM or
    /// either side's RST_STREAM.
    streams: HashMap<u32, Window>,
    /// The client's SETTINGS_INITIAL_WINDOW_SIZE.
    initial_stream_window: i64,
    /// When the streams are looked over next (at most every [`STARVED_GRACE`]).
    next_stream_scan: Instant,
    /// A stream window was starved at the last look, or has been since.
    streams_starving: bool,
    /// How long a stream may be starved before it counts against [`STARVED_STREAMS_MAX`].
    grace: Duration,
    /// The highest stream id the client has opened.
    highest_stream: u32,
    /// A stream arrived while [`STREAMS_FOLLOWED_MAX`] were followed: the watch fails closed.
    overflowed: bool,
}

/// One flow-control window the client grants the node.
#[derive(Debug, Clone, Copy)]
struct Window {
    size: i64,
    starved_since: Option<Instant>,
    /// Granted by WINDOW_UPDATEs since the window was last starved anew.
    granted_while_starved: i64,
    granted_at: Option<Instant>,
    /// The node has begun its answer (HEADERS without END_STREAM): while the connection window
    /// is starved, what is left of it may wait in h2.
    answering: bool,
}

impl Window {
    fn new(size: i64) -> Self {
        Window {
            size,
            starved_since: None,
            granted_while_starved: 0,
            granted_at: None,
            answering: false,
        }
    }

    fn sent(&mut self, bytes: i64, now: Instant) {
        if self.was_idle(now) {
            self.starved_since = None;
        }
        self.size -= bytes;
        if self.size <= 0 && self.starved_since.is_none() {
            self.starved_since = Some(now);
            self.granted_while_starved = 0;
        }
    }

    /// A WINDOW_UPDATE: [`GRANT_PROGRESS`] bytes granted since the starvation began end it.
    fn granted(&mut self, bytes: i64, now: Instant) {
        self.size = self.size.saturating_add(bytes);
        self.granted_at = Some(now);
        if self.starved_since.is_some() {
            self.granted_while_starved = self.granted_while_starved.saturating_add(bytes);
            if self.granted_while_starved >= i64::from(GRANT_PROGRESS) {
                self.starved_since = None;
            }
        }
    }

    /// A change of SETTINGS_INITIAL_WINDOW_SIZE: it moves the window but neither ends a
    /// starvation (a raise and a lowering in one frame release nothing) nor starts one (a
    /// lowering sends nothing: what waits behind it waits in hyper, where the server's send timeout sees it, or
    /// starves the window with the next DATA); a window left open by a raise counts as idle only
    /// once it has stayed open.
    fn resized(&mut self, delta: i64, now: Instant) {
        self.size = self.size.saturating_add(delta);
        if delta >= 0 {
            self.granted_at = Some(now);
        }
    }

    /// Open since a grant at least [`IDLE_AFTER_GRANT`] ago.
    fn was_idle(&self, now: Instant) -> bool {
        self.size > 0
            && self
                .granted_at
                .is_some_and(|at| now.saturating_duration_since(at) > IDLE_AFTER_GRANT)
    }

    fn starved_for(&mut self, now: Instant) -> Option<Duration> {
        if self.was_idle(now) {
            self.starved_since = None;
        }
        Some(now.saturating_duration_since(self.starved_since?))
    }
}

/// Why a connection is closed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Starved {
    /// A window (a stream's, or the connection's when `None`) starved this long.
    Window {
        /// The stream, or `None` for the connection's window.
        stream: Option<u32>,
        /// Since the window was starved.
        waited: Duration,
    },
    /// This many streams starved for over the grace (the second field) at once.
    Streams(usize, Duration),
    /// More streams open than the watch follows (h2 allows 1,024: some ended unseen).
    Followed(usize),
}

impl std::fmt::Display for Starved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Starved::Window { stream, waited } => {
                let window = match stream {
                    Some(id) => format!("stream {id}'s"),
                    None => "the connection's".to_owned(),
                };
                write!(
                    f,
                    "the client has kept {window} HTTP/2 window shut for {} s (no grant of \
                     {GRANT_PROGRESS} bytes at once) while the node had data for it",
                    waited.as_secs()
                )
            }
            Starved::Followed(count) => write!(
                f,
                "the client has {count} streams open, more than the node follows"
            ),
            Starved::Streams(count, grace) => write!(
                f,
                "the client has left the answers of {count} streams waiting for their HTTP/2 \
                 windows for over {} s (at most {STARVED_STREAMS_MAX})",
                grace.as_secs()
            ),
        }
    }
}

impl FlowWatch {
    /// A connection's watch, before its first byte, with [`STARVED_GRACE`].
    pub fn new() -> Self {
        Self::with_grace(STARVED_GRACE)
    }

    /// The same with another grace before a starved stream counts against
    /// [`STARVED_STREAMS_MAX`]: a proxy whose answers are bodies of any size, which a client's
    /// small windows legitimately starve for a round trip each, takes its send timeout.
    pub fn with_grace(grace: Duration) -> Self {
        FlowWatch {
            grace,
            from_client: Scanner::new(true),
            to_client: Scanner::new(false),
            connection: Window::new(DEFAULT_WINDOW),
            streams: HashMap::new(),
            initial_stream_window: DEFAULT_WINDOW,
            next_stream_scan: Instant::now(),
            streams_starving: false,
            highest_stream: 0,
            overflowed: false,
        }
    }

    /// Follows bytes the client sent.
    pub fn read(&mut self, bytes: &[u8]) {
        let now = Instant::now();
        if self.from_client.stopped {
            return;
        }
        let FlowWatch {
            from_client,
            connection,
            streams,
            initial_stream_window,
            highest_stream,
            overflowed,
            ..
        } = self;
        from_client.scan(bytes, &mut |frame| match frame {
            Frame::InitialStreamWindow(size) => {
                let delta = i64::from(size) - *initial_stream_window;
                *initial_stream_window = i64::from(size);
                if delta != 0 {
                    for window in streams.values_mut() {
                        window.resized(delta, now);
                    }
                }
            }
            Frame::WindowUpdate {
                stream: 0,
                increment,
            } => {
                connection.granted(i64::from(increment), now);
            }
            Frame::WindowUpdate { stream, increment } => {
                if let Some(window) = streams.get_mut(&stream) {
                    window.granted(i64::from(increment), now);
                }
            }
            // A new stream: client stream ids only grow, so HEADERS on an older id (trailers,
            // or a stream h2 already reset) open nothing.
            Frame::Headers { stream, .. } if stream > *highest_stream => {
                *highest_stream = stream;
                if streams.len() < STREAMS_FOLLOWED_MAX {
                    streams.insert(stream, Window::new(*initial_stream_window));
                } else {
                    *overflowed = true;
                }
            }
            Frame::Headers { .. } => {}
            Frame::Reset { stream } => {
                streams.remove(&stream);
            }
            Frame::Data { .. } => {}
        });
    }

    /// Follows the first `written` bytes of `bufs`, written by the node in one vectored write.
    pub fn wrote_vectored(&mut self, bufs: &[std::io::IoSlice<'_>], written: usize) {
        let mut left = written;
        for buf in bufs {
            if left == 0 {
                break;
            }
            let part = left.min(buf.len());
            self.wrote(&buf[..part]);
            left -= part;
        }
    }

    /// Follows bytes the node wrote.
    pub fn wrote(&mut self, bytes: &[u8]) {
        if self.from_client.stopped {
            // Not HTTP/2: the node's bytes are not frames either.
            return;
        }
        let now = Instant::now();
        let FlowWatch {
            to_client,
            connection,
            streams,
            streams_starving,
            ..
        } = self;
        to_client.scan(bytes, &mut |frame| match frame {
            Frame::Data {
                stream,
                length,
                end_stream,
            } => {
                connection.sent(i64::from(length), now);
                if end_stream {
                    streams.remove(&stream);
                } else if let Some(window) = streams.get_mut(&stream) {
                    window.sent(i64::from(length), now);
                    *streams_starving |= window.starved_since.is_some();
                }
            }
            Frame::Headers {
                stream,
                end_stream: true,
            }
            | Frame::Reset { stream } => {
                streams.remove(&stream);
            }
            Frame::Headers {
                stream,
                end_stream: false,
            } => {
                if let Some(window) = streams.get_mut(&stream) {
                    window.answering = true;
                }
            }
            Frame::InitialStreamWindow(_) | Frame::WindowUpdate { .. } => {}
        });
    }

    /// Why the connection must close, if it must: a window starved for `timeout`, or too many
    /// streams starved at once. The streams are looked over at most every [`STARVED_GRACE`].
    pub fn overdue(&mut self, timeout: Duration) -> Option<Starved> {
        if self.overflowed {
            return Some(Starved::Followed(self.streams.len()));
        }
        let now = Instant::now();
        let connection_starved = self.connection.starved_for(now);
        if let Some(waited) = connection_starved
            && waited >= timeout
        {
            return Some(Starved::Window {
                stream: None,
                waited,
            });
        }
        if !(self.streams_starving || connection_starved.is_some()) || now < self.next_stream_scan {
            return None;
        }
        self.next_stream_scan = now + self.grace.min(STARVED_GRACE);
        // While the connection window has been starved past the grace, every answer begun and
        // not ended may be waiting in h2 (a byte of connection window lets hyper hand over a
        // whole answer): those count as starved streams.
        let connection_past_grace = connection_starved.is_some_and(|w| w > self.grace);
        let (mut starving, mut past_grace, mut longest) = (false, 0, None);
        for (&id, window) in &mut self.streams {
            let Some(waited) = window.starved_for(now) else {
                if connection_past_grace && window.answering {
                    past_grace += 1;
                }
                continue;
            };
            starving = true;
            if waited > self.grace || (connection_past_grace && window.answering) {
                past_grace += 1;
            }
            if longest.is_none_or(|(_, w)| waited > w) {
                longest = Some((id, waited));
            }
        }
        self.streams_starving = starving;
        if past_grace > STARVED_STREAMS_MAX {
            return Some(Starved::Streams(past_grace, self.grace));
        }
        let (stream, waited) = longest?;
        (waited >= timeout).then_some(Starved::Window {
            stream: Some(stream),
            waited,
        })
    }

    /// Whether the connection should be looked at again within [`STARVED_GRACE`] even if
    /// nothing moves on it: a window is starved.
    pub fn starving(&self) -> bool {
        self.streams_starving || self.connection.starved_since.is_some() || self.overflowed
    }
}

impl Default for FlowWatch {
    fn default() -> Self {
        Self::new()
    }
}

/// What the watch takes from a frame.
#[derive(Debug, PartialEq, Eq)]
enum Frame {
    /// A SETTINGS frame (not an acknowledgement) set SETTINGS_INITIAL_WINDOW_SIZE.
    InitialStreamWindow(u32),
    WindowUpdate {
        stream: u32,
        increment: u32,
    },
    Headers {
        stream: u32,
        end_stream: bool,
    },
    /// A DATA frame of this many flow-controlled bytes (padding included).
    Data {
        stream: u32,
        length: u32,
        end_stream: bool,
    },
    Reset {
        stream: u32,
    },
}

/// Reads HTTP/2 frames from one direction of a connection, in whatever pieces the bytes come.
struct Scanner {
    /// Bytes of the client preface still to match (0 once matched, or for the node's side).
    preface_left: usize,
    /// Not HTTP/2 (a metrics scrape over HTTP/1): scanning stopped.
    stopped: bool,
    header: [u8; FRAME_HEADER_BYTES],
    header_len: usize,
    /// The frame being read: its type, flags, stream and payload bytes still to come.
    kind: u8,
    flags: u8,
    stream: u32,
    payload_left: usize,
    /// Payload bytes kept for a SETTINGS entry (6 bytes) or a WINDOW_UPDATE (4 bytes).
    field: [u8; 6],
    field_len: usize,
    /// The last SETTINGS_INITIAL_WINDOW_SIZE of the SETTINGS frame being read: as h2, only the
    /// last of a frame counts, applied at the frame's end.
    initial_window_in_frame: Option<u32>,
}

impl Scanner {
    fn new(client_side: bool) -> Self {
        Scanner {
            preface_left: if client_side { PREFACE.len() } else { 0 },
            stopped: false,
            header: [0; FRAME_HEADER_BYTES],
            header_len: 0,
            kind: 0,
            flags: 0,
            stream: 0,
            payload_left: 0,
            field: [0; 6],
            field_len: 0,
            initial_window_in_frame: None,
        }
    }

    fn scan(&mut self, mut bytes: &[u8], on: &mut impl FnMut(Frame)) {
        while !bytes.is_empty() && !self.stopped {
            if self.preface_left > 0 {
                let at = PREFACE.len() - self.preface_left;
                let n = self.preface_left.min(bytes.len());
                if bytes[..n] != PREFACE[at..at + n] {
                    self.stopped = true;
                    return;
                }
                self.preface_left -= n;
                bytes = &bytes[n..];
            } else if self.header_len < FRAME_HEADER_BYTES {
                let n = (FRAME_HEADER_BYTES - self.header_len).min(bytes.len());
                self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
                self.header_len += n;
                bytes = &bytes[n..];
                if self.header_len == FRAME_HEADER_BYTES {
                    self.start_frame(on);
                }
            } else {
                let n = self.payload_left.min(bytes.len());
                if self.kind == SETTINGS || self.kind == WINDOW_UPDATE {
                    for &byte in &bytes[..n] {
                        self.payload_byte(byte, on);
                    }
                }
                self.payload_left -= n;
                bytes = &bytes[n..];
                if self.payload_left == 0 {
                    self.end_frame(on);
                }
            }
        }
    }

    fn start_frame(&mut self, on: &mut impl FnMut(Frame)) {
        let h = self.header;
        self.payload_left = usize::from(h[0]) << 16 | usize::from(h[1]) << 8 | usize::from(h[2]);
        self.kind = h[3];
        self.flags = h[4];
        self.stream = u32::from_be_bytes([h[5], h[6], h[7], h[8]]) & 0x7fff_ffff;
        self.field_len = 0;
        self.initial_window_in_frame = None;
        let (stream, end_stream) = (self.stream, self.flags & END_STREAM != 0);
        match self.kind {
            DATA => on(Frame::Data {
                stream,
                // 24 bits.
                length: u32::try_from(self.payload_left).unwrap_or(u32::MAX),
                end_stream,
            }),
            HEADERS => on(Frame::Headers { stream, end_stream }),
            RST_STREAM => on(Frame::Reset { stream }),
            _ => {}
        }
        if self.payload_left == 0 {
            self.end_frame(on);
        }
    }

    fn end_frame(&mut self, on: &mut impl FnMut(Frame)) {
        self.header_len = 0;
        if let Some(size) = self.initial_window_in_frame.take() {
            on(Frame::InitialStreamWindow(size));
        }
    }

    fn payload_byte(&mut self, byte: u8, on: &mut impl FnMut(Frame)) {
        if let Some(slot) = self.field.get_mut(self.field_len) {
            *slot = byte;
        }
        self.field_len += 1;
        let f = self.field;
        match self.kind {
            SETTINGS if self.flags & ACK == 0 && self.field_len == 6 => {
                if u16::from_be_bytes([f[0], f[1]]) == SETTINGS_INITIAL_WINDOW_SIZE {
                    self.initial_window_in_frame =
                        Some(u32::from_be_bytes([f[2], f[3], f[4], f[5]]));
                }
                self.field_len = 0;
            }
            WINDOW_UPDATE if self.field_len == 4 => on(Frame::WindowUpdate {
                stream: self.stream,
                increment: u32::from_be_bytes([f[0], f[1], f[2], f[3]]) & 0x7fff_ffff,
            }),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).unwrap().to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn settings(entries: &[(u16, u32)]) -> Vec<u8> {
        let payload: Vec<u8> = entries
            .iter()
            .flat_map(|(id, value)| id.to_be_bytes().into_iter().chain(value.to_be_bytes()))
            .collect();
        frame(SETTINGS, 0, 0, &payload)
    }

    fn window_update(stream: u32, increment: u32) -> Vec<u8> {
        frame(WINDOW_UPDATE, 0, stream, &increment.to_be_bytes())
    }

    fn request(stream: u32) -> Vec<u8> {
        let mut f = frame(HEADERS, 0x4, stream, &[0x83]);
        f.extend(frame(DATA, END_STREAM, stream, &[0; 10]));
        f
    }

    /// A watch that has read the preface, `settings` and a request on each of `streams`, split
    /// into pieces of `piece` bytes.
    fn watch_after(entries: &[(u16, u32)], streams: &[u32], piece: usize) -> FlowWatch {
        let mut bytes = PREFACE.to_vec();
        bytes.extend(settings(entries));
        for &id in streams {
            bytes.extend(request(id));
        }
        let mut watch = FlowWatch::new();
        bytes.chunks(piece).for_each(|c| watch.read(c));
        watch
    }

    fn starved_stream(watch: &mut FlowWatch, id: u32) -> Option<Duration> {
        let now = Instant::now();
        watch.streams.get_mut(&id)?.starved_for(now)
    }

    #[test]
    fn frames_are_read_in_any_split() {
        for piece in 1..64 {
            let watch = watch_after(
                &[(0x3, 100), (SETTINGS_INITIAL_WINDOW_SIZE, 1)],
                &[1, 3],
                piece,
            );
            assert_eq!(watch.initial_stream_window, 1, "pieces of {piece}");
            assert_eq!(watch.streams.len(), 2, "pieces of {piece}");
            assert_eq!(watch.streams[&3].size, 1);
        }
    }

    #[test]
    fn an_answer_larger_than_its_stream_window_starves_it_until_a_large_grant() {
        let mut watch = watch_after(&[(SETTINGS_INITIAL_WINDOW_SIZE, 1)], &[1], 7);
        watch.wrote(&frame(HEADERS, 0x4, 1, &[0x88]));
        assert_eq!(starved_stream(&mut watch, 1), None);
        watch.wrote(&frame(DATA, 0, 1, &[0]));
        assert!(starved_stream(&mut watch, 1).is_some());
        // A byte at a time, used at once: still starved since the first.
        let since = watch.streams[&1].starved_since;
        for _ in 0..10 {
            watch.read(&window_update(1, 1));
            watch.wrote(&frame(DATA, 0, 1, &[0]));
        }
        assert_eq!(watch.streams[&1].starved_since, since);
        assert!(watch.starving());
        assert!(watch.overdue(Duration::ZERO).is_some());
        watch.next_stream_scan = Instant::now();
        assert_eq!(watch.overdue(Duration::from_secs(3_600)), None);
        // A large grant ends it, and the stream's end forgets it.
        watch.read(&window_update(1, GRANT_PROGRESS));
        assert_eq!(starved_stream(&mut watch, 1), None);
        watch.wrote(&frame(HEADERS, 0x4 | END_STREAM, 1, &[0x88]));
        assert!(watch.streams.is_empty());
    }

    #[test]
    fn too_many_streams_starved_past_the_grace_close_the_connection() {
        let ids: Vec<u32> = (0..=u32::try_from(STARVED_STREAMS_MAX).unwrap())
            .map(|i| 2 * i + 1)
            .collect();
        let mut watch = watch_after(&[(SETTINGS_INITIAL_WINDOW_SIZE, 1)], &ids, 64);
        for &id in &ids {
            watch.wrote(&frame(DATA, 0, id, &[0]));
        }
        // Just starved: within the grace.
        assert_eq!(watch.overdue(Duration::from_secs(30)), None);
        let long_ago = Instant::now() - STARVED_GRACE * 2;
        for window in watch.streams.values_mut() {
            window.starved_since = Some(long_ago);
        }
        watch.next_stream_scan = Instant::now();
        assert_eq!(
            watch.overdue(Duration::from_secs(30)),
            Some(Starved::Streams(STARVED_STREAMS_MAX + 1, STARVED_GRACE))
        );
        // One fewer is within the bound.
        watch.read(&frame(RST_STREAM, 0, ids[0], &[0, 0, 0, 8]));
        watch.next_stream_scan = Instant::now();
        assert_eq!(watch.overdue(Duration::from_secs(30)), None);
        assert!(watch.starving());
    }

    #[test]
    fn settings_move_windows_but_never_end_a_starvation() {
        let mut watch = watch_after(&[(SETTINGS_INITIAL_WINDOW_SIZE, 1)], &[1], 100);
        watch.wrote(&frame(DATA, 0, 1, &[0]));
        let since = watch.streams[&1].starved_since;
        assert!(since.is_some());
        // A raise and a lowering in one frame: h2 applies the last only, and so does the watch.
        watch.read(&settings(&[
            (SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20),
            (SETTINGS_INITIAL_WINDOW_SIZE, 1),
        ]));
        assert_eq!(watch.streams[&1].size, 0);
        // In two frames: the raise does not end the starvation, the lowering keeps it.
        watch.read(&settings(&[(SETTINGS_INITIAL_WINDOW_SIZE, 1 << 20)]));
        watch.read(&settings(&[(SETTINGS_INITIAL_WINDOW_SIZE, 1)]));
        assert_eq!(watch.streams[&1].starved_since, since);
    }

    #[test]
    fn answers_begun_while_the_connection_window_starves_count_as_starved_streams() {
        let ids: Vec<u32> = (0..=u32::try_from(STARVED_STREAMS_MAX).unwrap())
            .map(|i| 2 * i + 1)
            .collect();
        let mut watch = watch_after(&[], &ids, 64);
        // The connection window spent; then each answer begun (a byte of window each).
        watch.wrote(&frame(DATA, 0, 1, &vec![0; 65_535]));
        for &id in &ids[1..] {
            watch.read(&window_update(0, 1));
            watch.wrote(&frame(HEADERS, 0x4, id, &[0x88]));
            watch.wrote(&frame(DATA, 0, id, &[0]));
        }
        assert!(watch.starving());
        assert_eq!(
            watch.overdue(Duration::from_secs(30)),
            None,
            "within the grace"
        );
        watch.connection.starved_since = Some(Instant::now() - STARVED_GRACE * 2);
        watch.next_stream_scan = Instant::now();
        // Stream 1 sent DATA but no HEADERS here: the other 32 count, at the bound.
        assert_eq!(watch.overdue(Duration::from_secs(30)), None);
        watch.wrote(&frame(HEADERS, 0x4, 1, &[0x88]));
        assert_eq!(
            watch.overdue(Duration::from_secs(30)),
            None,
            "looked at once per grace"
        );
        watch.next_stream_scan = Instant::now();
        assert_eq!(
            watch.overdue(Duration::from_secs(30)),
            Some(Starved::Streams(STARVED_STREAMS_MAX + 1, STARVED_GRACE))
        );
    }

    #[test]
    fn grants_that_add_up_end_a_starvation() {
        let mut watch = watch_after(&[(SETTINGS_INITIAL_WINDOW_SIZE, 100)], &[1], 100);
        watch.wrote(&frame(DATA, 0, 1, &[0; 100]));
        for _ in 0..15 {
            watch.read(&window_update(1, 1_024));
            watch.wrote(&frame(DATA, 0, 1, &vec![0; 1_024]));
        }
        assert!(watch.streams[&1].starved_since.is_some());
        watch.read(&window_update(1, 1_024));
        assert_eq!(watch.streams[&1].starved_since, None);
    }

    #[test]
    fn older_stream_ids_open_nothing_and_too_many_streams_close_the_connection() {
        let mut watch = watch_after(&[], &[5], 100);
        watch.wrote(&frame(HEADERS, 0x4 | END_STREAM, 5, &[0x88]));
        // The client's trailers on a stream the node has ended, and HEADERS on a lower id.
        watch.read(&frame(HEADERS, 0x4 | END_STREAM, 5, &[0x83]));
        watch.read(&frame(HEADERS, 0x4, 3, &[0x83]));
        assert!(watch.streams.is_empty());
        let ids: Vec<u32> = (0..=u32::try_from(STREAMS_FOLLOWED_MAX).unwrap())
            .map(|i| 7 + 2 * i)
            .collect();
        ids.iter().for_each(|&id| watch.read(&request(id)));
        assert_eq!(watch.streams.len(), STREAMS_FOLLOWED_MAX);
        assert!(watch.starving());
        assert_eq!(
            watch.overdue(Duration::from_secs(30)),
            Some(Starved::Followed(STREAMS_FOLLOWED_MAX))
        );
    }

    #[test]
    fn a_longer_grace_lets_streams_stay_starved_longer() {
        let ids: Vec<u32> = (0..=u32::try_from(STARVED_STREAMS_MAX).unwrap())
            .map(|i| 2 * i + 1)
            .collect();
        let mut bytes = PREFACE.to_vec();
        bytes.extend(settings(&[(SETTINGS_INITIAL_WINDOW_SIZE, 1)]));
        ids.iter().for_each(|&id| bytes.extend(request(id)));
        let mut watch = FlowWatch::with_grace(Duration::from_secs(60));
        watch.read(&bytes);
        for &id in &ids {
            watch.wrote(&frame(DATA, 0, id, &[0]));
        }
        for window in watch.streams.values_mut() {
            window.starved_since = Some(Instant::now() - STARVED_GRACE * 2);
        }
        assert_eq!(watch.overdue(Duration::from_secs(60)), None);
        for window in watch.streams.values_mut() {
            window.starved_since = Some(Instant::now() - Duration::from_secs(59));
        }
        watch.next_stream_scan = Instant::now();
        assert_eq!(watch.overdue(Duration::from_secs(3_600)), None);
        for window in watch.streams.values_mut() {
            window.starved_since = Some(Instant::now() - Duration::from_secs(61));
        }
        watch.next_stream_scan = Instant::now();
        assert_eq!(
            watch.overdue(Duration::from_secs(3_600)),
            Some(Starved::Streams(
                STARVED_STREAMS_MAX + 1,
                Duration::from_secs(60)
            ))
        );
    }

    #[test]
    fn a_window_left_open_after_a_grant_was_not_starved() {
        let mut watch = watch_after(&[(SETTINGS_INITIAL_WINDOW_SIZE, 10)], &[1], 100);
        watch.wrote(&frame(DATA, 0, 1, &[0; 10]));
        let window = watch.streams.get_mut(&1).unwrap();
        let long_ago = Instant::now() - IDLE_AFTER_GRANT * 3;
        window.starved_since = Some(long_ago);
        window.granted(5, long_ago + IDLE_AFTER_GRANT / 2);
        assert_eq!(starved_stream(&mut watch, 1), None);
        // Exhausted again later: starved from then.
        watch.wrote(&frame(DATA, 0, 1, &[0; 5]));
        assert!(starved_stream(&mut watch, 1).unwrap() < IDLE_AFTER_GRANT);
    }

    #[test]
    fn the_connection_window_follows_data_on_every_stream() {
        let mut watch = watch_after(&[], &[1, 3], 1000);
        watch.wrote(&settings(&[(0x3, 1_024)]));
        let mut written = frame(DATA, 0, 1, &vec![0; 30_000]);
        written.extend(frame(DATA, END_STREAM, 3, &vec![0; 35_535]));
        written.chunks(777).for_each(|c| watch.wrote(c));
        assert_eq!(watch.connection.size, 0);
        assert_eq!(watch.streams[&1].size, 65_535 - 30_000);
        assert!(!watch.streams.contains_key(&3));
        assert!(matches!(
            watch.overdue(Duration::ZERO),
            Some(Starved::Window { stream: None, .. })
        ));
        // A stream's grant does not open the connection; the connection's does.
        watch.read(&window_update(1, 60_000));
        assert!(watch.connection.starved_since.is_some());
        watch.read(&window_update(0, 1));
        watch.wrote(&frame(DATA, 0, 1, &[0]));
        assert!(watch.connection.starved_since.is_some());
        watch.read(&window_update(0, 60_000));
        assert_eq!(watch.overdue(Duration::ZERO), None);
    }

    #[test]
    fn resets_and_lowered_settings_are_followed() {
        let mut watch = watch_after(&[], &[1, 3, 5], 9);
        watch.read(&frame(RST_STREAM, 0, 1, &[0, 0, 0, 8]));
        watch.wrote(&frame(RST_STREAM, 0, 3, &[0, 0, 0, 7]));
        assert_eq!(watch.streams.keys().copied().collect::<Vec<_>>(), vec![5]);
        // Lowering the initial window below what a stream has used moves its window but does
        // not starve it (nothing was sent); the next DATA would.
        watch.wrote(&frame(DATA, 0, 5, &[0; 100]));
        watch.read(&settings(&[(SETTINGS_INITIAL_WINDOW_SIZE, 50)]));
        assert_eq!(watch.streams[&5].size, -50);
        assert_eq!(starved_stream(&mut watch, 5), None);
        watch.read(&window_update(5, 51));
        watch.wrote(&frame(DATA, 0, 5, &[0]));
        assert!(starved_stream(&mut watch, 5).is_some());
    }

    #[test]
    fn payloads_that_look_like_frames_are_skipped() {
        let disguised = [settings(&[(SETTINGS_INITIAL_WINDOW_SIZE, 1)]), request(7)].concat();
        let mut bytes = PREFACE.to_vec();
        bytes.extend(frame(DATA, 0, 1, &disguised));
        bytes.extend(frame(HEADERS, 0x4, 3, &disguised));
        let mut watch = FlowWatch::new();
        bytes.chunks(5).for_each(|c| watch.read(c));
        assert_eq!(watch.initial_stream_window, DEFAULT_WINDOW);
        assert_eq!(watch.streams.keys().copied().collect::<Vec<_>>(), vec![3]);
    }

    #[test]
    fn a_vectored_write_is_followed_up_to_what_was_written() {
        let mut watch = watch_after(&[], &[1], 100);
        let data = frame(DATA, 0, 1, &vec![0; 30_000]);
        let (a, b) = data.split_at(5);
        let bufs = [std::io::IoSlice::new(a), std::io::IoSlice::new(b)];
        // The header split across the slices, and only part of the payload written.
        watch.wrote_vectored(&bufs, 20);
        assert_eq!(watch.streams[&1].size, 65_535 - 30_000);
        watch.wrote_vectored(&[std::io::IoSlice::new(&data[20..])], data.len() - 20);
        watch.wrote(&frame(DATA, 0, 1, &[0; 10]));
        assert_eq!(watch.streams[&1].size, 65_535 - 30_010);
    }

    #[test]
    fn bytes_that_are_not_http2_stop_the_scan() {
        let mut watch = FlowWatch::new();
        let mut bytes = b"GET / HTTP/1.1\r\n\r\n".to_vec();
        bytes.extend(settings(&[(SETTINGS_INITIAL_WINDOW_SIZE, 0)]));
        watch.read(&bytes);
        assert_eq!(watch.initial_stream_window, DEFAULT_WINDOW);
        // Nor is the answer read as frames (a body that looks like DATA).
        watch.wrote(&frame(DATA, 0, 1, &vec![0; 70_000]));
        assert!(!watch.starving());
    }
}
