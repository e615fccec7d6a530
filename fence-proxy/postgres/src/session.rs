//! One client session after authentication: relays messages both ways and runs every client
//! statement inside a transaction block that the proxy opened and guarded.
//!
//! # The rules
//!
//! - **Every client statement runs inside an explicit block.** When the upstream is idle (status
//!   `I`) and the client sends a statement, the proxy's own `BEGIN` (the client's BEGIN rebuilt
//!   from the parse tree, in its place, when the client's first statement is a BEGIN) runs
//!   first, in the same failure unit as the client's statements: at the head of the client's
//!   simple Query, or in the client's extended-protocol group before its Execute (a FunctionCall
//!   waits for the block to open). Whatever fails the BEGIN (a CancelRequest or a
//!   `statement_timeout` before it runs) then skips the client's statements too. Postgres then
//!   refuses COMMIT inside DO blocks and procedures, and no statement can run in an implicit
//!   transaction that commits on its own. If the client did not open the block itself, the
//!   proxy ends it after the client's statements, as Postgres would have ended the implicit
//!   transaction.
//! - **The guard runs before every commit point.** Before the client's COMMIT, END, PREPARE
//!   TRANSACTION or COMMIT AND CHAIN, and before the proxy's own COMMIT, the proxy runs the guard
//!   function (see `fence_sql`). It reads the fence from the session itself, so a fence changed by
//!   any spelling inside the transaction is checked before the commit. It also runs before the
//!   first data statement of a transaction, and again before the next one after a ROLLBACK TO
//!   or a SET of `lockd.fence`, so a stale session fails early and an unfenced one under
//!   `--require-fence` is made read-only before it writes; in a simple Query the proxy splices
//!   it into the client's text right before that statement (`plan_script`, `rewrite`). Left out
//!   only while the session is known to have no fence (`Session::unfenced_seen`), where it
//!   would do nothing.
//! - **A transaction-ending statement is the last of its query.** Anything after COMMIT or
//!   ROLLBACK in one simple Query would run outside the guarded block; it is refused (0A000). A
//!   COMMIT at the end of a multi-statement query is sent as a query of its own after the guard,
//!   rebuilt from the parse tree (`Statement::commit_sql`): the statements before it may have
//!   changed how the server lexes the client's text.
//! - **Status comes from the upstream.** Each request starts from the status of the last
//!   ReadyForQuery. Inside an extended-protocol group the proxy projects the status along the
//!   path where every message succeeds: an error makes the upstream skip to Sync, and the
//!   proxy's expectations skip with it.
//! - **SQL is read by Postgres's grammar** (`classify`, on a thread with a stack sized for the
//!   deepest tree the text bound allows); text it cannot parse is refused, and so is text with a
//!   backslash while `standard_conforming_strings` is off, non-ASCII text unless
//!   `client_encoding` is UTF8 (both tracked from ParameterStatus; inside a group after an
//!   Execute either may have changed unseen, so both rules apply there too), text that is not
//!   valid UTF-8, and text longer than `MAX_CLASSIFIED_SQL_BYTES`.
//! - **COPY FROM STDIN is followed as the server follows it.** After a statement the proxy
//!   believes to start COPY FROM STDIN, nothing of the proxy's own is sent and the client waits
//!   until the upstream answers (CopyInResponse, an error, or CommandComplete for a wrong kind).
//!   In copy mode the server ignores Flush and Sync, so the proxy drops them and expects no
//!   ReadyForQuery; CopyDone or CopyFail end the mode, and the proxy ends its block after that.
//!
//! # The upstream never holds prepared transaction control
//!
//! A Parse whose text is transaction control (any `TransactionStmt`: BEGIN, COMMIT, ROLLBACK,
//! SAVEPOINT, RELEASE, ROLLBACK TO, PREPARE TRANSACTION, COMMIT/ROLLBACK PREPARED) is never
//! forwarded with that text: the upstream gets [`classify::PLACEHOLDER_SQL`] under the client's
//! name and parameter types, and at the client's Execute the proxy runs the statement rebuilt
//! from the parse tree under its own names (`execute_control`), after the guard where it is a
//! commit point. SQL `PREPARE` cannot make transaction control (its grammar takes SELECT, INSERT,
//! UPDATE, DELETE, MERGE and VALUES only), and a Parse of several statements is refused, so no
//! prepared statement in the upstream is transaction control, and SQL `EXECUTE` (from the
//! client's text, or from dynamic SQL in a function) can neither end the guarded block nor undo
//! its guard with a ROLLBACK TO: it runs a placeholder, which fails. Before this (review of
//! 2026-12-05, second round) `EXECUTE c` of a protocol-prepared COMMIT committed a zombie's rows
//! after the new holder's, and of a ROLLBACK TO undid the read-only setting of an unfenced
//! session under `--require-fence`.
//!
//! # The proxy's own statement never outlives its group, and its names are its own
//!
//! The proxy runs its own statements in a group (`put_internal_with`: Close S, Parse
//! [`INTERNAL_STATEMENT`], Bind [`INTERNAL_PORTAL`], Execute, Close P, Close S), which is the one
//! way a real `COMMIT` (the proxy's, or the client's prepared one rebuilt) is ever a prepared
//! statement upstream. Pipelined with nothing of the client's in between, it exists only while
//! the proxy's own Bind and Execute run. Code run inside that Execute (a deferred trigger at its
//! COMMIT) can reach the statement by dynamic SQL (`EXECUTE 'EXECUTE ...'`), but only after the
//! guard ran, and Postgres 15 then ends the session (FATAL XX000, "EndTransactionBlock: unexpected
//! state END", checked with a raw client): nothing commits. But if one of
//! its messages fails (its Bind because the portal name is taken, its COMMIT at a deferred
//! constraint), Postgres skips the Closes up to Sync and the statement stays. So any error at an
//! internal message, or at a message before one the upstream then skips, or one the proxy cannot
//! place, sets `internal_may_linger`, and at the ReadyForQuery that ends the skip the proxy sends
//! Close S, Close P, Sync (`close_internal_names`; Close works in a failed block). Nothing of the
//! client's runs from the failed message to there: the upstream skips the rest of the group,
//! what the proxy sends after a Sync is its own simple queries, and the client's next request
//! waits for the ReadyForQuery the Closes go out on. Before this (review of 2026-12-05, second
//! round, follow-up) a failed internal Bind left `__lockd_fence_proxy_s | COMMIT` upstream, and
//! SQL `EXECUTE` of it (from the Query, or from dynamic SQL) ended a zombie's block unguarded.
//!
//! A client name starting with [`classify::RESERVED_PREFIX`] (any case) is refused (42939): in
//! Parse, Bind, Describe, Execute and Close (`check_client_name`, replaced by a Parse that fails,
//! so the refusal is an ERROR in the upstream's response order) and in SQL (`classify`:
//! `PREPARE`/`EXECUTE`/`DEALLOCATE`, `DECLARE`/`FETCH`/`MOVE`/`CLOSE` cursors, savepoints). A
//! cursor opened by dynamic SQL under the portal name can still make the proxy's Bind fail: the
//! client's own transaction fails, and the statement is closed as above.
//!
//! Statement and portal names in frames must be ASCII (42602): Postgres converts them from
//! `client_encoding`, so `"\xe9"` under LATIN1 and `"\xc3\xa9"` under UTF8 name one server
//! statement, which the name maps (keyed by bytes) took for two. ASCII reads the same in every
//! client encoding; names in SQL come from text read as UTF-8 (non-ASCII text needs UTF8), so a
//! SQL `DEALLOCATE` of a protocol name finds the same entry the server drops.
//!
//! # Every client frame is read completely
//!
//! Each client message is decoded field by field as Postgres reads it (`crate::frontend`) before
//! anything of it is planned or forwarded; a frame with bytes after its last field, short
//! fields or inconsistent counts ends the session (08P01). A Parse with a byte after its
//! parameter types once failed in the server before the unnamed statement was replaced, while
//! the proxy took the old one for gone.
//!
//! # Why a wrong statement kind can only cost compatibility
//!
//! The kinds of prepared statements and portals are projected as Parse, Bind and Close are sent
//! (a Bind pipelined right behind its Parse must see the Parse's kind) along the path where every
//! message succeeds, which is exact because an error makes the upstream skip to Sync: on an error
//! the failed and skipped messages' projections are undone; a failed Parse of a named statement
//! keeps the old entry (Postgres drops nothing of it); a failed Parse of the unnamed statement
//! makes it unknown (Postgres drops the old one early in the Parse, not when the Parse fails
//! before that), and a Bind of an unknown statement is refused until a Parse of it succeeds or a
//! Close drops it. A client's SQL `DEALLOCATE` drops names as it is sent. The map can still be
//! wrong (SQL `PREPARE`/`DEALLOCATE` from dynamic SQL the proxy does not see, a DEALLOCATE that
//! did not run), so safety rests on rules that hold whatever the kind:
//!
//! - A name the proxy takes for transaction control runs the proxy's own statement at Execute,
//!   never the client's; a name it takes for anything else that holds a placeholder fails
//!   wherever it runs. So a wrong belief never runs transaction control the proxy did not plan.
//! - At projected status `I`, every client Execute, and every Parse, Bind and Describe before
//!   it, is preceded by the proxy's own BEGIN, so no client code runs in an implicit
//!   transaction that commits on its own at Sync (Parse, Bind and Describe run client code: a
//!   domain's CHECK, functions folded by the planner). A block that held no client Execute is
//!   rolled back at Sync, not committed. A Parse of transaction control (the placeholder, which
//!   runs nothing), and a Bind or Describe of a believed BEGIN, go without it (see
//!   `Session::before_client_message`): the server's implicit transaction they start becomes a
//!   block at the proxy's BEGIN in the client's Execute, or at Sync, where the proxy rolls it
//!   back. After a believed transaction end the projected status is `I` again, so the next
//!   statement again gets a BEGIN (and the guard where it needs one); whether the transaction
//!   was guarded is tracked per projected transaction.
//! - The guard runs right before every COMMIT the proxy runs for a client's Execute, and before
//!   the proxy's own COMMIT.
//! - A statement believed to be a setting that really is a data statement runs inside a block:
//!   either the proxy's (which it ends through the guard) or one left open for the client
//!   (status `T`), whose COMMIT again goes through the guard; under `--require-fence` the guard
//!   refuses the commit of an unfenced transaction that wrote.
//! - A wrong "COPY" belief only holds the client until the statement's answer; a wrong "not
//!   COPY" makes the proxy's own messages fail the COPY, which rolls back.
//!
//! # Verified fences (`--verify-key`)
//!
//! Each `SET lockd.fence = '<value>'` the proxy reads (a Query's statements, a Parse, the startup
//! options) is verified before anything of its request goes upstream (`verify`); a verified value
//! gets a proof that every guard call of the session carries. A value that does not verify is
//! refused as Postgres refuses a failed SET: the statement does not run, so the session keeps the
//! fence it had; inside the client's own block the block is aborted (the proxy sends a statement
//! that fails in its place), so nothing after the refused SET commits. Values set any other way
//! reach the guard without a proof, and the guard refuses them.
//!
//! The one place the proxy skips a guard before a client COMMIT is the first Execute of a group
//! that starts in a failed transaction, where the upstream's own status (from ReadyForQuery) says
//! that COMMIT can only roll back.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use futures::StreamExt;
use postgres_protocol::message::frontend;
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::io::{ReadHalf, WriteHalf};
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use crate::classify::{self, ClassifyError, Deallocate, Statement, StatementKind};
use crate::codec::{self, FrameError, Message, MessageCodec};
use crate::config::Config;
use crate::error::{self, ProxyError, ready_for_query};
use crate::fence_sql;
use crate::frontend::{Frontend, Malformed, Target};
use crate::limits::{MAX_GUARDS_PER_QUERY, MAX_NAME_BYTES, MAX_PENDING_UNITS, MAX_TRACKED_NAMES};
use crate::metrics_names::{RequestResult, record_request};
use crate::verify::{Proofs, Verification, Verified};

/// Prepared statement and portal names of the proxy's own extended-protocol work, under the
/// reserved prefix that client names may not use (see the module header).
const INTERNAL_STATEMENT: &str = "__lockd_fence_proxy_s";
const INTERNAL_PORTAL: &str = "__lockd_fence_proxy_p";

/// SQLSTATE of the warning Postgres gives for a BEGIN inside a block, which the proxy causes when
/// it wraps a client's BEGIN in its own block.
const ACTIVE_SQL_TRANSACTION: &str = "25001";

/// SQL the proxy substitutes for a Parse it refuses: it fails at Parse time, so the refusal
/// arrives in the upstream's response order and the upstream skips to Sync.
const REFUSED_PARSE_SQL: &str = "fence-proxy refused this statement";

/// The response a forwarded message still owes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Parse,
    Bind,
    Describe,
    Execute,
    Close,
    /// Sync, simple Query or FunctionCall: answered by ReadyForQuery.
    Ready,
}

impl Unit {
    /// Whether an upstream message of type `tag` is the last response to this unit.
    fn completed_by(self, tag: u8) -> bool {
        match self {
            Unit::Parse => tag == b'1',
            Unit::Bind => tag == b'2',
            Unit::Describe => tag == b'T' || tag == b'n',
            Unit::Execute => matches!(tag, b'C' | b'I' | b's'),
            Unit::Close => tag == b'3',
            Unit::Ready => false,
        }
    }
}

/// What a completed unit changes in the name maps.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Track {
    Nothing,
    /// ParseComplete: the statement now is this. On error: the unnamed statement is unknown.
    Statement(String, Known),
    /// BindComplete: the portal now is this.
    Portal(String, Known),
    /// CloseComplete: the statement or portal is gone.
    CloseStatement(String),
    ClosePortal(String),
}

/// What the second column of a guard call's row (`t`: the session has no fence) may be used for
/// (see `Session::unfenced_seen`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// A guard before a client statement: only a fence it finds counts (the session is then
    /// never taken for unfenced again). A local override may hide a session's fence there.
    FenceOnly,
    /// A guard right before a COMMIT the proxy knows to be one (its own, or the client's text it
    /// parsed), sent at this epoch: an answer "no fence" counts at once.
    AtCommit(u64),
    /// A guard right before a client Execute believed to be a COMMIT, sent at this epoch: an
    /// answer "no fence" counts once that Execute's tag proves it was a COMMIT.
    Tentative(u64),
}

/// What the proxy does when a ReadyForQuery arrives for a simple-protocol unit.
#[derive(Debug, Clone, PartialEq, Eq)]
enum After {
    /// More units of this request were sent already: swallow.
    Continue,
    /// The end of the request: report the status to the client.
    Report,
    /// The prefix of a query whose last statement is a COMMIT: send the guard and the COMMIT
    /// unless the prefix failed. `owns`: the proxy opened the block and rolls it back then.
    CommitPart { sql: String, owns: bool },
    /// The client's statements are done and the proxy opened the block: guard and COMMIT, or
    /// ROLLBACK after an error.
    EndBlock,
    /// The end of an extended-protocol group: roll back the proxy's block if an error left it
    /// failed, then report.
    SyncEnd,
    /// The proxy's BEGIN (and opening guard) ahead of a client FunctionCall: send the call once
    /// the block is open, then end the block; if it did not open, the call never runs.
    Held(bytes::Bytes),
}

/// One of the proxy's statements inside a client's simple Query (see `plan_simple`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lead {
    /// The block's BEGIN: the client's own when `client` (its CommandComplete goes to the client,
    /// in the place of the client's BEGIN the proxy left out of the text), else the proxy's.
    Begin { client: bool },
    /// An opening guard, and what its answer may be used for.
    Guard(Reading),
}

/// A run of statements of a simple Query as the server answers them: one of the proxy's, or so
/// many of the client's. Each statement ends with one CommandComplete (or an error, which ends
/// the Query).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Proxy(Lead),
    Client(usize),
}

/// Where a client statement's text went in a Query the proxy rewrote, in characters (error
/// cursors count characters): it starts at `sent` in the text sent and at `original` in the
/// client's, and is `len` long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Moved {
    sent: i64,
    original: i64,
    len: i64,
}

/// The client's cursor for a cursor `position` (1-based) into the text sent, `None` inside the
/// proxy's own text.
fn original_position(moved: &[Moved], position: i64) -> Option<i64> {
    moved
        .iter()
        .find(|m| position > m.sent && position <= m.sent + m.len)
        .map(|m| position - m.sent + m.original)
}

impl Lead {
    /// Whether its responses are the proxy's own (swallowed, an error is the proxy's).
    fn internal(self) -> bool {
        self != Lead::Begin { client: true }
    }
}

/// One expected response.
#[derive(Debug)]
struct Pending {
    unit: Unit,
    /// The proxy's own message: its responses are swallowed, its first error goes to the client.
    internal: bool,
    /// Whether the proxy owns (must end) the open block once this unit has completed.
    owns_after: bool,
    track: Track,
    /// How to restore the name map if this unit is skipped or fails: which map (`true` =
    /// portals), the name, and its entry before the unit was projected.
    undo: Option<(bool, String, Option<Known>)>,
    /// Drop the 25001 "already a transaction in progress" warning the proxy's block causes.
    suppress_begin_warning: bool,
    /// The proxy's own Execute standing in for a client's (of prepared transaction control): its
    /// CommandComplete goes to the client as the answer to the client's Execute.
    answers_client: bool,
    /// A guard call: its row says whether the session has a fence, and this is what the answer
    /// may be used for.
    reading: Option<Reading>,
    /// A client Execute believed to be a COMMIT: unless its tag says it was one, the guard's
    /// answer before it no longer describes the session.
    confirms_commit: bool,
    /// Replaces the upstream's error for this unit (a Parse the proxy refused).
    refusal: Option<ProxyError>,
    /// A client's lone DISCARD ALL: its CommandComplete means the server dropped every prepared
    /// statement and portal, so the proxy's name maps are cleared.
    discards_all: bool,
    /// A client Execute the proxy believes to start COPY FROM STDIN: if it completes without
    /// entering copy mode (a wrong kind), the client's messages need not wait any longer.
    starts_copy: bool,
    /// A simple Query the proxy rewrote: the runs of its statements and the client's not yet
    /// completed, oldest first (empty when the client's Query went as it came).
    script: VecDeque<Part>,
    /// Where the client's text went in the rewritten Query, for error cursors.
    moved: Vec<Moved>,
    after: After,
}

impl Pending {
    fn new(unit: Unit, owns_after: bool) -> Self {
        Pending {
            unit,
            internal: false,
            owns_after,
            track: Track::Nothing,
            undo: None,
            suppress_begin_warning: false,
            answers_client: false,
            reading: None,
            confirms_commit: false,
            refusal: None,
            discards_all: false,
            starts_copy: false,
            script: VecDeque::new(),
            moved: Vec::new(),
            after: After::Continue,
        }
    }

    fn internal(unit: Unit, owns_after: bool) -> Self {
        Pending {
            internal: true,
            ..Pending::new(unit, owns_after)
        }
    }

    fn ready(internal: bool, owns_after: bool, after: After) -> Self {
        Pending {
            internal,
            after,
            ..Pending::new(Unit::Ready, owns_after)
        }
    }

    /// The proxy statement of a rewritten Query that the next responses belong to, if any.
    fn proxy_part(&self) -> Option<Lead> {
        match self.script.front() {
            Some(Part::Proxy(lead)) => Some(*lead),
            _ => None,
        }
    }

    /// Whether the next responses are the proxy's own: of an internal unit, or of one of the
    /// proxy's statements inside a client's Query.
    fn answering_proxy(&self) -> bool {
        (self.internal && !self.answers_client) || self.proxy_part().is_some_and(Lead::internal)
    }

    /// A statement of a rewritten Query completed (CommandComplete).
    fn statement_completed(&mut self) {
        match self.script.front_mut() {
            Some(Part::Client(n)) if *n > 1 => *n -= 1,
            Some(_) => {
                self.script.pop_front();
            }
            None => {}
        }
    }

    /// `m` (an error or notice) as the client should see it: its cursor mapped back to the
    /// client's text if the proxy rewrote it.
    fn for_client(&self, m: &Message) -> Message {
        if self.moved.is_empty() {
            m.clone()
        } else {
            error::remap_position(m, |p| original_position(&self.moved, p))
        }
    }
}

/// What the proxy knows of one prepared statement or portal.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Known {
    /// What its text was read as. For transaction control (`control`: the statement rebuilt from
    /// the client's text) the upstream holds [`classify::PLACEHOLDER_SQL`] under the name, and
    /// the proxy runs `control` in the place of the client's Execute.
    Kind {
        kind: StatementKind,
        control: Option<String>,
    },
    /// The unnamed statement after a Parse of it failed: Postgres drops the old one early in
    /// the Parse, so it may or may not still be there. A Bind of it is refused until a Parse of
    /// it succeeds or a Close drops it.
    Unknown,
}

impl Known {
    /// An ordinary statement: the default, not stored.
    const ORDINARY: Known = Known::Kind {
        kind: StatementKind::Other,
        control: None,
    };

    /// Its kind as the placement rules read it (an unknown one is ordinary: never a BEGIN, so
    /// the proxy's block opens before it).
    fn kind(&self) -> StatementKind {
        match self {
            Known::Kind { kind, .. } => kind.clone(),
            Known::Unknown => StatementKind::Other,
        }
    }
}

/// The name maps' key for a statement or portal name: the name's bytes, as UTF-8 when they are,
/// else as a NUL (which no name contains) and their hex digits, so that two different names
/// never share an entry.
fn name_key(raw: &[u8]) -> String {
    match std::str::from_utf8(raw) {
        Ok(s) => s.to_owned(),
        Err(_) => std::iter::once('\0')
            .chain(raw.iter().flat_map(|b| {
                let hex = b"0123456789abcdef";
                [
                    hex[usize::from(b >> 4)] as char,
                    hex[usize::from(b & 15)] as char,
                ]
            }))
            .collect(),
    }
}

/// What the proxy knows of prepared statements or portals, projected as the client's messages
/// are sent (see [`Session::project`]). Ordinary statements are the default and are not stored,
/// so real clients stay far below the bounds.
#[derive(Debug, Default)]
struct NameMap {
    kinds: HashMap<String, Known>,
}

impl NameMap {
    fn get(&self, name: &str) -> Known {
        self.kinds.get(name).cloned().unwrap_or(Known::ORDINARY)
    }

    fn set(&mut self, name: String, known: Known) {
        if known == Known::ORDINARY {
            self.kinds.remove(&name);
        } else {
            self.kinds.insert(name, known);
        }
    }

    /// Whether one more entry would pass [`MAX_TRACKED_NAMES`].
    fn full_for(&self, name: &str) -> bool {
        self.kinds.len() >= MAX_TRACKED_NAMES && !self.kinds.contains_key(name)
    }
}

/// Bookkeeping of the outstanding request (a simple Query, a FunctionCall, or an
/// extended-protocol group up to its Sync).
#[derive(Debug)]
struct Request {
    started: Option<Instant>,
    result: RequestResult,
    /// An error already reached the client: later ones of this request are consequences.
    error_sent: bool,
    /// One of the proxy's own statements failed: the client's output that follows is the
    /// consequence (25P02 and the like) and is swallowed.
    internal_failed: bool,
    /// One of the client's statements failed.
    client_failed: bool,
    /// Whether the proxy owns the open block, as of the last completed unit.
    owns: bool,
}

impl Request {
    fn new() -> Self {
        Request {
            started: Some(Instant::now()),
            result: RequestResult::Ok,
            error_sent: false,
            internal_failed: false,
            client_failed: false,
            owns: false,
        }
    }
}

/// Projection of an extended-protocol group along the path where every message succeeds.
#[derive(Debug)]
struct Group {
    /// Transaction status the next message will find.
    status: u8,
    /// The proxy opened the current block and must end it before Sync.
    owns: bool,
    /// A client Execute was sent in this group.
    executed: bool,
    /// A client Execute was sent since the proxy opened its current block: the block may hold
    /// a client statement's writes, so it ends through the guard and COMMIT; without one it
    /// held only what Parse, Bind and Describe ran, and is rolled back.
    block_executed: bool,
    /// At projected status `I`, a Bind or Describe of a client's BEGIN was forwarded outside any
    /// block: the server runs it in an implicit transaction (a Bind reads its parameters, which
    /// may run a domain's CHECK), which the proxy's BEGIN standing in for the client's Execute
    /// turns into the client's block. If the group reaches Sync without that Execute, the proxy
    /// turns it into a block of its own and rolls it back.
    implicit: bool,
    /// An error was received: the upstream skips everything up to Sync.
    failed: bool,
}

/// The upstream's COPY FROM STDIN mode, as the proxy follows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Copy {
    Off,
    /// A statement the proxy believes to be COPY FROM STDIN was forwarded and its answer
    /// (CopyInResponse, an error, or CommandComplete) has not arrived: the client's next messages
    /// wait, because the proxy must not put its own messages behind the COPY.
    Starting,
    /// The upstream reads CopyData (CopyInResponse or CopyBothResponse arrived).
    In,
}

/// What the upstream reported during startup: the transaction status of its first
/// ReadyForQuery and the settings that decide how it reads client SQL.
pub struct Reported {
    pub status: u8,
    pub standard_strings_off: bool,
    pub client_encoding: Option<String>,
    /// The startup fence, verified (`--verify-key` only).
    pub fence: Option<Verified>,
    /// How this session's fences are verified: the verification of its database (`--verify-key`
    /// only; each database has its own proof key).
    pub verification: Option<Arc<Verification>>,
    /// The proxy's read at the session's start found a fence (from the startup options or the
    /// role's and database's defaults): the session is never taken for unfenced (see
    /// `Session::unfenced_seen`). Always true under `--require-fence`, where it is not read.
    pub fenced_at_start: bool,
}

/// Whether the relay loop continues.
enum Flow {
    Continue,
    Close,
}

/// Both ends may be TLS or plain TCP (`crate::upstream::BoxIo`).
pub(crate) type Rx = FramedRead<ReadHalf<crate::upstream::BoxIo>, MessageCodec>;
pub(crate) type Tx = BufWriter<WriteHalf<crate::upstream::BoxIo>>;

/// State of one client session and its upstream connection.
pub struct Session {
    cfg: Arc<Config>,
    client_rx: Rx,
    client_tx: Tx,
    up_rx: Rx,
    up_tx: Tx,
    /// Transaction status of the last ReadyForQuery from the upstream (`I`, `T`, `E`).
    status: u8,
    /// The guard ran in the current transaction (projected); only saves repeated guards before
    /// data statements, never the one before a commit.
    guarded: bool,
    /// The session has no fence (`lockd.fence` unset or empty) as of its last commit and never
    /// had one that a guard saw, `--require-fence` is off, and no client statement since can
    /// have set one: an opening guard would return at once without doing anything, so it is left
    /// out. Only the opening guard: the guard before every commit runs regardless. A session a
    /// guard ever found fenced always gets its opening guard (a stale one must fail before its
    /// statements run: sequences, advisory locks and loopback connections do not roll back).
    ///
    /// The answer comes from the guard right before a commit, once the commit is known to be
    /// one. A value the session set in that transaction with `SET LOCAL` or `set_config(...,
    /// true)` goes away at the commit, so that guard may see an empty local value over a fence
    /// that comes back: hence "never had one" (`ever_fenced`: from the session's start, which
    /// the proxy reads once before the client's first message, any guard's answer, any failed
    /// guard, any `SET lockd.fence` of a value the proxy parses). What may set a fence between
    /// a commit and the next data statement is a client statement the proxy believes to be
    /// transaction control or a SET or RESET that may reach `lockd.fence`
    /// (`StatementKind::Setting::touches_fence`; SHOW, SAVEPOINT, RELEASE and SETs of other
    /// settings cannot), so the state is forgotten on every
    /// such statement other than a COMMIT whose tag proves it was one (a statement SQL `PREPARE`
    /// redefined cannot answer `COMMIT`), on every error, and while a commit guard's answer is
    /// outstanding. A name believed to be SHOW that SQL `PREPARE` redefined as a `SELECT
    /// set_config(...)` runs like any data statement of a session seen unfenced: without its
    /// opening guard, and the guard before its COMMIT reads what it set. Code
    /// that runs after the guard inside COMMIT (a deferred trigger calling `set_config`) is the
    /// one thing not seen: the next transaction's statements then run before its COMMIT guard
    /// refuses them, which only the session's own author can arrange.
    unfenced_seen: bool,
    /// A guard found the session fenced (or gave no clear answer) at some point: it never skips
    /// an opening guard again.
    ever_fenced: bool,
    /// Bumped whenever `unfenced_seen` is forgotten and whenever a commit guard is sent: a
    /// guard's answer counts only if it carries the current value (it is the latest commit
    /// guard, and nothing was forgotten since it was sent).
    fence_epoch: u64,
    /// A current [`Reading::Tentative`] answer "no fence", waiting for the COMMIT's tag (cleared
    /// whenever the epoch moves).
    tentative_unfenced: bool,
    /// `standard_conforming_strings` is off (from ParameterStatus): text with a backslash is
    /// refused because the proxy's parser would read it differently.
    standard_strings_off: bool,
    /// `client_encoding` as the server last reported it (ParameterStatus), `None` before any
    /// report. The server converts client SQL from this encoding before lexing it; the proxy
    /// reads UTF-8, so any other encoding (SJIS, GBK, BIG5 carry 0x5c `\\` as a trailing byte
    /// of a multibyte character) makes the proxy refuse client SQL.
    client_encoding: Option<String>,
    /// Responses still owed by the upstream, oldest first.
    pending: VecDeque<Pending>,
    statements: NameMap,
    portals: NameMap,
    /// The extended-protocol group being forwarded, if any.
    group: Option<Group>,
    /// The outstanding request.
    request: Request,
    /// A Sync, Query or FunctionCall was forwarded and its ReadyForQuery has not reached the
    /// client: the client's next messages wait, so each request starts from a known status.
    awaiting_ready: bool,
    /// Where the upstream is in COPY FROM STDIN (see [`Copy`]).
    copy: Copy,
    /// Upstream messages being assembled for one write.
    out: BytesMut,
    /// Proofs of the fence values verified in this session (`--verify-key` only).
    proofs: Proofs,
    /// The verification of the session's database (`--verify-key` only).
    verification: Option<Arc<Verification>>,
    /// An error arrived where one of the proxy's internal groups (see
    /// [`Self::put_internal_with`]) may have stopped after its Parse and before its final
    /// Close: the upstream may hold the proxy's statement (a real `COMMIT`) and portal. At the
    /// next ReadyForQuery, before anything more of the client's is forwarded, the proxy closes
    /// both (see [`Self::close_internal_names`]).
    internal_may_linger: bool,
}

impl Session {
    pub fn new(
        cfg: Arc<Config>,
        client_rx: Rx,
        client_tx: Tx,
        up_rx: Rx,
        up_tx: Tx,
        reported: Reported,
    ) -> Self {
        let Reported {
            status,
            standard_strings_off,
            client_encoding,
            fence,
            verification,
            fenced_at_start,
        } = reported;
        let mut proofs = Proofs::default();
        if let Some(v) = fence {
            proofs.add(v);
        }
        Session {
            cfg,
            client_rx,
            client_tx,
            up_rx,
            up_tx,
            status,
            guarded: false,
            unfenced_seen: false,
            ever_fenced: fenced_at_start,
            fence_epoch: 0,
            tentative_unfenced: false,
            standard_strings_off,
            client_encoding,
            pending: VecDeque::new(),
            statements: NameMap::default(),
            portals: NameMap::default(),
            group: None,
            request: Request::new(),
            awaiting_ready: false,
            copy: Copy::Off,
            out: BytesMut::new(),
            proofs,
            verification,
            internal_may_linger: false,
        }
    }

    /// Relays until either side closes or `shutdown` fires.
    pub async fn run(mut self, shutdown: CancellationToken) -> anyhow::Result<()> {
        // One wait for the whole session: a fresh `cancelled()` per message would register with
        // and leave the token's waiter list, a mutex every session shares.
        let cancelled = shutdown.cancelled();
        tokio::pin!(cancelled);
        loop {
            // In COPY FROM STDIN the upstream waits for the client's data, so reading the client
            // never stops there; while a COPY's start is unanswered, the client waits.
            let read_client = match self.copy {
                Copy::In => true,
                Copy::Starting => false,
                Copy::Off => !self.awaiting_ready && self.pending.len() < MAX_PENDING_UNITS,
            };
            let flow = tokio::select! {
                msg = self.client_rx.next(), if read_client => {
                    match msg {
                        Some(Ok(m)) => self.on_client(m).await?,
                        Some(Err(e)) => {
                            self.client_frame_error(e).await;
                            Flow::Close
                        }
                        None => Flow::Close,
                    }
                }
                msg = self.up_rx.next() => {
                    match msg {
                        Some(Ok(m)) => self.on_upstream(m).await?,
                        Some(Err(e)) => {
                            self.upstream_gone(format!("sent an unreadable message: {e}")).await;
                            Flow::Close
                        }
                        None => {
                            self.upstream_gone("closed the connection".to_owned()).await;
                            Flow::Close
                        }
                    }
                }
                () = &mut cancelled => {
                    let e = ProxyError::fatal(error::ADMIN_SHUTDOWN, "terminating connection because the proxy is shutting down");
                    let _ = self.client_tx.write_all(&e.to_message().frame).await;
                    let _ = self.client_tx.flush().await;
                    Flow::Close
                }
            };
            if let Flow::Close = flow {
                let mut buf = BytesMut::new();
                frontend::terminate(&mut buf);
                let _ = self.up_tx.write_all(&buf).await;
                let _ = self.up_tx.flush().await;
                let _ = self.client_tx.flush().await;
                return Ok(());
            }
            self.write_out().await?;
            // Flush a direction once its source has nothing more buffered, so a burst of rows is
            // written in few system calls.
            if self.up_rx.read_buffer().is_empty() {
                self.client_tx.flush().await?;
            }
            // While a request is outstanding the client's next messages stay unread, so what was
            // written upstream must go out now even if more client bytes are buffered.
            let holding = match self.copy {
                Copy::In => false,
                Copy::Starting => true,
                Copy::Off => self.awaiting_ready,
            };
            if self.client_rx.read_buffer().is_empty() || holding {
                self.up_tx.flush().await?;
            }
        }
    }

    async fn write_out(&mut self) -> std::io::Result<()> {
        if !self.out.is_empty() {
            let out = self.out.split();
            self.up_tx.write_all(&out).await?;
        }
        Ok(())
    }

    /// The guard call; `at_commit` when it runs right before a COMMIT rather than before a
    /// client statement (see the guard function for why that differs).
    fn guard_sql(&self, at_commit: bool) -> String {
        let proofs = self.verification.as_ref().map(|_| self.proofs.sql_array());
        self.cfg
            .fence_table
            .guard_call(self.cfg.require_fence, proofs.as_deref(), at_commit)
    }

    /// Forgets that the session was seen unfenced: the next data statement gets its opening
    /// guard again.
    fn forget_unfenced(&mut self) {
        self.unfenced_seen = false;
        self.tentative_unfenced = false;
        self.fence_epoch += 1;
    }

    /// What a guard being sent now may read: before a commit, a fresh epoch (until its answer
    /// the session's fence is unknown); `tentative` when the commit is a client Execute whose
    /// tag must confirm it.
    fn reading(&mut self, at_commit: bool, tentative: bool) -> Reading {
        if !at_commit {
            return Reading::FenceOnly;
        }
        self.forget_unfenced();
        if tentative {
            Reading::Tentative(self.fence_epoch)
        } else {
            Reading::AtCommit(self.fence_epoch)
        }
    }

    /// A guard's answer (`unfenced`: its second column was `t`) for what `reading` allows.
    fn take_reading(&mut self, reading: Reading, unfenced: bool) {
        if !unfenced || self.cfg.require_fence {
            self.ever_fenced = true;
            self.forget_unfenced();
            return;
        }
        match reading {
            Reading::FenceOnly => {}
            Reading::AtCommit(epoch) => {
                self.unfenced_seen = epoch == self.fence_epoch && !self.ever_fenced;
            }
            Reading::Tentative(epoch) => {
                self.tentative_unfenced = epoch == self.fence_epoch;
            }
        }
    }

    /// A client Execute believed to be a COMMIT completed with `tag` (`None`: suspended or
    /// empty): the guard's tentative answer before it counts only if it really was a COMMIT.
    fn confirm_commit(&mut self, tag: Option<&str>) {
        let pending = std::mem::take(&mut self.tentative_unfenced);
        if matches!(tag, Some("COMMIT" | "PREPARE TRANSACTION")) {
            self.unfenced_seen = pending && !self.ever_fenced;
        } else {
            self.forget_unfenced();
        }
    }

    /// Whether the opening guard before a data statement can be left out (see `unfenced_seen`).
    fn skip_opening_guard(&self) -> bool {
        self.unfenced_seen && !self.cfg.require_fence
    }

    /// A simple-protocol guard query (`at_commit` as in [`Self::guard_sql`]) as the next unit.
    /// The COMMIT that follows is the proxy's own or the client's parsed text: a real one.
    fn put_guard_query(&mut self, at_commit: bool, owns_after: bool) -> anyhow::Result<()> {
        let guard = self.guard_sql(at_commit);
        self.put_query(&guard)?;
        let mut p = Pending::ready(true, owns_after, After::Continue);
        p.reading = Some(self.reading(at_commit, false));
        self.pending.push_back(p);
        Ok(())
    }

    /// An extended-protocol guard call (see [`Self::put_internal`]); `tentative`: a client
    /// Execute believed to be a COMMIT follows (see [`Reading::Tentative`]).
    fn put_guard(
        &mut self,
        at_commit: bool,
        tentative: bool,
        owns_before: bool,
        owns_after: bool,
    ) -> anyhow::Result<()> {
        let guard = self.guard_sql(at_commit);
        let reading = self.reading(at_commit, tentative);
        self.put_internal_with(&guard, owns_before, owns_after, |p| {
            p.reading = Some(reading)
        })
    }

    /// Verifies every `SET lockd.fence` of `stmts` (with `--verify-key`) and keeps the proofs; the
    /// first value that does not verify refuses the request.
    /// Also: a session that sets a fence is never taken for unfenced again (`ever_fenced`).
    fn verify_fence_sets(&mut self, stmts: &[Statement]) -> Result<(), ProxyError> {
        if stmts
            .iter()
            .any(|s| s.sets_fence.as_deref().is_some_and(|v| !v.is_empty()))
        {
            self.ever_fenced = true;
            self.forget_unfenced();
        }
        let Some(v) = self.verification.as_ref() else {
            return Ok(());
        };
        for value in stmts.iter().filter_map(|s| s.sets_fence.as_deref()) {
            if value.is_empty() {
                continue;
            }
            let verified = v.check(value).inspect_err(|e| {
                tracing::info!(code = e.code, "refusing SET lockd.fence: {}", e.message);
            })?;
            self.proofs.add(verified);
        }
        Ok(())
    }

    /// Refuses a Query whose `SET lockd.fence` did not verify, as Postgres answers a failed SET:
    /// nothing of the query runs, and inside the client's block the block is aborted, which the
    /// proxy achieves by sending a statement that fails in the query's place.
    async fn refuse_fence_set(&mut self, e: ProxyError) -> anyhow::Result<Flow> {
        if self.status != b'T' {
            return self.reject_request(e).await;
        }
        self.start_request();
        self.request.result = RequestResult::Rejected;
        self.put_query(REFUSED_PARSE_SQL)?;
        let mut p = Pending::ready(false, false, After::Report);
        p.refusal = Some(e);
        self.pending.push_back(p);
        Ok(Flow::Continue)
    }

    async fn send_client(&mut self, m: &Message) -> std::io::Result<()> {
        self.client_tx.write_all(&m.frame).await
    }

    /// Answers a whole request (Query or FunctionCall) with a proxy error, without the upstream.
    async fn reject_request(&mut self, e: ProxyError) -> anyhow::Result<Flow> {
        tracing::debug!(code = e.code, "rejecting request: {}", e.message);
        self.send_client(&e.to_message()).await?;
        self.send_client(&ready_for_query(self.status)).await?;
        self.client_tx.flush().await?;
        record_request(RequestResult::Rejected, None);
        Ok(Flow::Continue)
    }

    /// A refusal in the middle of an extended-protocol group that cannot be put in the
    /// upstream's response order: the session ends with a FATAL error.
    async fn refuse_in_group(&mut self, e: ProxyError) -> anyhow::Result<Flow> {
        let e = ProxyError { fatal: true, ..e };
        tracing::info!(code = e.code, "{}", e.message);
        self.send_client(&e.to_message()).await?;
        record_request(RequestResult::Rejected, None);
        Ok(Flow::Close)
    }

    async fn client_frame_error(&mut self, e: FrameError) {
        let code = match e {
            FrameError::TooLong { .. } => error::LIMIT_EXCEEDED,
            _ => error::PROTOCOL_VIOLATION,
        };
        let e = ProxyError::fatal(code, format!("client message refused: {e}"));
        tracing::info!(code = e.code, "{}", e.message);
        let _ = self.client_tx.write_all(&e.to_message().frame).await;
    }

    async fn upstream_gone(&mut self, what: String) {
        let e = ProxyError::fatal(
            error::CONNECTION_FAILURE,
            format!("upstream {} {what}", self.cfg.upstream_addr),
        );
        tracing::info!("{}", e.message);
        let _ = self.client_tx.write_all(&e.to_message().frame).await;
    }

    // ----- client side -------------------------------------------------------------------------

    async fn on_client(&mut self, m: Message) -> anyhow::Result<Flow> {
        tracing::trace!(tag = %(m.tag as char), len = m.frame.len(), pending = self.pending.len(), "client message");
        // Every frame is read completely, as the server reads it, before anything of it is
        // forwarded or planned (see `frontend`): one the proxy does not fully understand never
        // reaches the upstream.
        let decoded = match crate::frontend::decode(m.tag, m.frame.slice(5..)) {
            Ok(d) => d,
            Err(e) => return self.refuse_frame(e).await,
        };
        if self.copy == Copy::In {
            return self.in_copy(m).await;
        }
        match decoded {
            Frontend::Query { text } => self.simple_query(m, &text).await,
            Frontend::FunctionCall => self.function_call(m).await,
            Frontend::Terminate => Ok(Flow::Close),
            // Outside COPY the server ignores them.
            Frontend::CopyData | Frontend::CopyDone | Frontend::CopyFail => {
                self.out.extend_from_slice(&m.frame);
                Ok(Flow::Continue)
            }
            extended => self.extended(m, extended).await,
        }
    }

    /// A client frame that does not decode: the session ends with a protocol violation, as the
    /// server ends it; nothing of the frame (or after it) is forwarded.
    async fn refuse_frame(&mut self, e: Malformed) -> anyhow::Result<Flow> {
        self.refuse_in_group(
            ProxyError::fatal(
                error::PROTOCOL_VIOLATION,
                format!("client message refused: {e}"),
            )
            .with_hint(
                "the proxy forwards only messages it has read completely, as Postgres reads them",
            ),
        )
        .await
    }

    /// A client message while the upstream is in COPY FROM STDIN. The server accepts CopyData,
    /// CopyDone and CopyFail there and ignores Flush and Sync ("for the convenience of client
    /// libraries"), so a Sync creates no expected ReadyForQuery; the proxy drops it rather than
    /// forwarding it, so that a server which left copy mode on an error cannot answer it either
    /// (clients send another Sync after CopyDone or CopyFail, which the group ends with). Any
    /// other message would fail the COPY in a way the proxy cannot follow: the session ends.
    async fn in_copy(&mut self, m: Message) -> anyhow::Result<Flow> {
        match m.tag {
            b'd' => {
                self.out.extend_from_slice(&m.frame);
                Ok(Flow::Continue)
            }
            b'c' | b'f' => {
                // The server leaves copy mode on CopyDone or CopyFail; the proxy's own block
                // ends after it (at the query's ReadyForQuery or the group's next Sync).
                self.copy = Copy::Off;
                self.out.extend_from_slice(&m.frame);
                Ok(Flow::Continue)
            }
            b'S' | b'H' => Ok(Flow::Continue),
            tag => {
                self.refuse_in_group(ProxyError::error(
                    error::PROTOCOL_VIOLATION,
                    format!(
                        "message type {:?} during COPY FROM STDIN; expected CopyData, CopyDone or CopyFail",
                        tag as char
                    ),
                ))
                .await
            }
        }
    }

    /// Encodes a simple Query into the outgoing buffer.
    fn put_query(&mut self, sql: &str) -> anyhow::Result<()> {
        frontend::query(sql, &mut self.out)?;
        Ok(())
    }

    fn start_request(&mut self) {
        self.request = Request::new();
        self.awaiting_ready = true;
    }

    async fn simple_query(&mut self, m: Message, raw: &[u8]) -> anyhow::Result<Flow> {
        if self.group.is_some() {
            return self
                .reject_request(ProxyError::error(
                    error::PROTOCOL_VIOLATION,
                    "simple Query received while an extended-protocol group is open; send Sync first",
                ))
                .await;
        }
        let text = match self.sql_text(raw) {
            Ok(t) => t,
            Err(e) => return self.reject_request(e).await,
        };
        let stmts = match self.read_sql(&text).await {
            Ok(s) => s,
            Err(e) => return self.reject_request(e).await,
        };
        if let Err(e) = self.verify_fence_sets(&stmts) {
            return self.refuse_fence_set(e).await;
        }
        self.forget_deallocated(&stmts);
        if stmts.is_empty() {
            self.start_request();
            self.out.extend_from_slice(&m.frame);
            self.pending
                .push_back(Pending::ready(false, false, After::Report));
            return Ok(Flow::Continue);
        }
        let last = stmts.len() - 1;
        if let Some(i) = stmts.iter().position(|s| s.kind.ends_transaction())
            && i != last
        {
            return self
                .reject_request(
                    ProxyError::error(
                        error::NOT_SUPPORTED,
                        "a statement may not follow COMMIT, END, ROLLBACK, ABORT or PREPARE TRANSACTION in the same query: it would run outside the guarded transaction",
                    )
                    .with_hint("send the statements after the transaction end as a separate query"),
                )
                .await;
        }
        if stmts.len() > 1
            && stmts[last].commit_sql.is_none()
            && matches!(stmts[last].kind, StatementKind::Commit { .. })
        {
            return self
                .reject_request(
                    ProxyError::error(
                        error::NOT_SUPPORTED,
                        "PREPARE TRANSACTION with an identifier that is not printable ASCII at the end of a multi-statement query: the proxy runs it after the statements before it, rebuilt from the parse tree, and rebuilds ASCII identifiers only",
                    )
                    .with_hint("send the PREPARE TRANSACTION as a query of its own, or use an ASCII transaction identifier"),
                )
                .await;
        }
        // A lone COMMIT or ROLLBACK with no transaction open ends nothing; Postgres answers it
        // with a warning.
        if self.status == b'I' && stmts.len() == 1 && stmts[0].kind.ends_transaction() {
            self.start_request();
            self.out.extend_from_slice(&m.frame);
            self.pending
                .push_back(Pending::ready(false, false, After::Report));
            return Ok(Flow::Continue);
        }
        // A lone DISCARD ALL at `I` cannot run inside the proxy's block (Postgres refuses it
        // there, 25001); it runs no client code and writes nothing to commit, so it goes as it
        // came, like a lone COMMIT. What it resets in the server the proxy forgets too: the
        // session's fence (the next data statement gets its opening guard), and, once the
        // server reports it done, the kinds of prepared statements and portals.
        if self.status == b'I' && stmts.len() == 1 && stmts[0].discards_all {
            self.forget_unfenced();
            self.start_request();
            self.out.extend_from_slice(&m.frame);
            let mut p = Pending::ready(false, false, After::Report);
            p.discards_all = true;
            self.pending.push_back(p);
            return Ok(Flow::Continue);
        }
        self.plan_simple(&stmts, ClientOp::Query(text, m)).await
    }

    /// A FunctionCall (fast-path call) is planned like a query of one data statement.
    async fn function_call(&mut self, m: Message) -> anyhow::Result<Flow> {
        if self.group.is_some() {
            return self
                .reject_request(ProxyError::error(
                    error::PROTOCOL_VIOLATION,
                    "FunctionCall received while an extended-protocol group is open; send Sync first",
                ))
                .await;
        }
        let stmts = [Statement {
            kind: StatementKind::Other,
            start: 0,
            sets_fence: None,
            commit_sql: None,
            discards_all: false,
            transaction_control: false,
            control_sql: None,
            deallocates: None,
        }];
        self.plan_simple(&stmts, ClientOp::Message(m)).await
    }

    /// The text of client SQL as the server will read it, or why the proxy cannot know that. The
    /// server converts the bytes from `client_encoding` before lexing; the proxy's parser reads
    /// UTF-8 and never decodes lossily. Every client encoding the server supports is a superset
    /// of ASCII (multibyte characters use lead bytes of 0x80 and above, which is where SJIS, GBK
    /// or BIG5 can hide a 0x5c `\\` as a trailing byte), so ASCII text reads the same in all of
    /// them; non-ASCII text is accepted only while the encoding is UTF8. Inside a group, an
    /// Execute already sent may have changed the encoding (any statement can call
    /// `set_config('client_encoding', ...)`) before its ParameterStatus arrived, so non-ASCII
    /// text is refused there too.
    fn sql_text(&self, raw: &[u8]) -> Result<String, ProxyError> {
        let utf8 = self
            .client_encoding
            .as_deref()
            .is_some_and(|e| e.eq_ignore_ascii_case("UTF8") || e.eq_ignore_ascii_case("UTF-8"));
        if !raw.is_ascii() {
            if !utf8 {
                let shown = self.client_encoding.as_deref().unwrap_or("(not reported)");
                return Err(ProxyError::error(
                    error::CHARACTER_NOT_IN_REPERTOIRE,
                    format!(
                        "client_encoding is {shown} and the query text is not ASCII; the proxy reads non-ASCII SQL as UTF8 only, so it cannot read this query as Postgres would"
                    ),
                )
                .with_hint("SET client_encoding = 'UTF8' (or connect with client_encoding=UTF8)"));
            }
            if self.group.as_ref().is_some_and(|g| g.executed) {
                return Err(ProxyError::error(
                    error::CHARACTER_NOT_IN_REPERTOIRE,
                    "non-ASCII statement text after an Execute in the same pipelined group: an earlier statement may have changed client_encoding, so the proxy cannot read it as Postgres would",
                )
                .with_hint("send a Sync after the Execute, or pass non-ASCII values as parameters"));
            }
        }
        String::from_utf8(raw.to_vec()).map_err(|e| {
            ProxyError::error(
                error::CHARACTER_NOT_IN_REPERTOIRE,
                format!("query text is not valid UTF-8: {e}"),
            )
        })
    }

    /// Classifies client SQL, or says why it is refused. A text too long to parse on the session
    /// thread is parsed on a parser thread while the session thread serves other sessions; the
    /// future borrows nothing of `self`.
    fn read_sql(
        &self,
        text: &str,
    ) -> impl Future<Output = Result<Vec<Statement>, ProxyError>> + Send + 'static {
        // Inside a group, an Execute already sent may have turned the setting off before its
        // ParameterStatus reached the proxy, so a backslash is refused there too.
        let maybe_off =
            self.standard_strings_off || self.group.as_ref().is_some_and(|g| g.executed);
        let refused = (maybe_off && classify::needs_standard_strings(text)).then(|| {
            ProxyError::error(
                error::NOT_SUPPORTED,
                "standard_conforming_strings is (or may be) off and the statement contains a backslash: the proxy cannot read it as Postgres would",
            )
            .with_hint("SET standard_conforming_strings = on in a query of its own; inside a pipelined group, send statements with backslashes before the first Execute or pass values as parameters")
        });
        let text = text.to_owned();
        async move {
            if let Some(e) = refused {
                return Err(e);
            }
            classify::classify_async(text).await.map_err(|e| match e {
                ClassifyError::Syntax(_) => ProxyError::error(error::SYNTAX_ERROR, &e),
                ClassifyError::TooManyStatements => ProxyError::error(error::LIMIT_EXCEEDED, &e),
                ClassifyError::BeginOption(_) => ProxyError::error(error::NOT_SUPPORTED, &e),
                ClassifyError::ReservedName(..) => ProxyError::error(error::RESERVED_NAME, &e),
                ClassifyError::TooLong(_) => ProxyError::error(error::LIMIT_EXCEEDED, &e),
                ClassifyError::Parser(_) => ProxyError::error(error::INTERNAL_ERROR, &e),
            })
        }
    }

    /// What the proxy knows of prepared statements that a client's `DEALLOCATE` drops, it
    /// forgets as the statement is sent (the drop is not transactional). If the statement does
    /// not run after all, a name the proxy then takes for ordinary may still be the placeholder
    /// of transaction control, which fails wherever it runs: fail closed.
    fn forget_deallocated(&mut self, stmts: &[Statement]) {
        for s in stmts {
            match &s.deallocates {
                // The unnamed statement is not one of them (Postgres keeps it apart).
                Some(Deallocate::All) => self.statements.kinds.retain(|name, _| name.is_empty()),
                Some(Deallocate::Name(name)) => {
                    self.statements.kinds.remove(name);
                }
                None => {}
            }
        }
    }

    /// Sends a simple-protocol request wrapped in the guarded block (see the module doc).
    async fn plan_simple(&mut self, stmts: &[Statement], op: ClientOp) -> anyhow::Result<Flow> {
        self.start_request();
        let entry = self.status;
        let last = &stmts[stmts.len() - 1];
        let begins = stmts
            .iter()
            .any(|s| matches!(s.kind, StatementKind::Begin(_)));
        let commit_last = matches!(last.kind, StatementKind::Commit { .. });
        let split = commit_last && stmts.len() > 1;
        let body = if split {
            &stmts[..stmts.len() - 1]
        } else {
            stmts
        };
        if stmts.iter().any(|s| forgets_unfenced(&s.kind)) {
            self.forget_unfenced();
        }
        let skip_guards = self.skip_opening_guard();
        // The proxy opens the block at `I`; it must end it unless the client's statements open a
        // block of their own or end it themselves.
        let owns = entry == b'I' && !begins;
        let guard = self.guard_sql(false);
        // A lone BEGIN opens the block itself: its text is what the proxy parsed, so nothing can
        // run before it outside a block, and no guard is due before it. The proxy's own BEGIN
        // would only make the client's warn (25001), which Postgres writes to its server log,
        // a line per transaction.
        let lone_begin =
            entry == b'I' && stmts.len() == 1 && matches!(stmts[0].kind, StatementKind::Begin(_));

        // The script of the Query the upstream runs: the proxy's statements go *into* the
        // client's simple Query, never in a Query of their own ahead of it. A simple Query is
        // the server's unit of failure, so if anything fails one of them (a stale fence, a
        // CancelRequest or `statement_timeout`, both checked before each statement) the client's
        // statements behind it are skipped with it instead of running, and at `I` committing,
        // in an implicit transaction of their own.
        // - At `I` the block's BEGIN leads. A client BEGIN that starts the text is left out of
        //   it and its form rebuilt from the parse tree leads in its place (no 25001 warning, no
        //   server-log line); its CommandComplete goes to the client.
        // - An opening guard goes right before the first data statement of the block, and again
        //   before the next data statement after anything that may have undone it or changed
        //   what it checked: a ROLLBACK TO (the guard's lock and read-only setting), a SET or
        //   RESET that may reach `lockd.fence`.
        let need = match entry {
            b'I' => true,
            b'T' => !self.guarded,
            // A failed block runs nothing but ROLLBACK, ROLLBACK TO or COMMIT.
            _ => false,
        };
        let guard_sql = (!skip_guards).then_some(guard.as_str());
        let (script, first, need) =
            plan_script(stmts, body, entry == b'I' && !lone_begin, need, guard_sql);
        let guards = script
            .iter()
            .filter(|(p, _)| matches!(p, Part::Proxy(Lead::Guard(_))))
            .count();
        if guards > MAX_GUARDS_PER_QUERY {
            self.awaiting_ready = false;
            return self
                .reject_request(
                    ProxyError::error(
                        error::LIMIT_EXCEEDED,
                        format!(
                            "this query needs {guards} opening guards (a data statement after each ROLLBACK TO or SET of lockd.fence), more than the {MAX_GUARDS_PER_QUERY} the proxy puts into one query"
                        ),
                    )
                    .with_hint("send the statements as several queries"),
                )
                .await;
        }
        self.guarded = !need && !stmts.iter().any(|s| s.kind.ends_transaction());
        let rewritten = script.iter().any(|(p, _)| matches!(p, Part::Proxy(_)));
        // The proxy's own BEGIN ahead of a client BEGIN later in the text makes that one warn.
        let suppress = matches!(
            script.first(),
            Some((Part::Proxy(Lead::Begin { client: false }), _))
        );
        let ends = last.kind.ends_transaction();
        let end_block = owns && !ends;
        let copy = stmts.iter().any(|s| s.kind == StatementKind::CopyIn);
        let after = match &op {
            // The COMMIT runs after the client's statements before it, which may have changed
            // how the server lexes text (`standard_conforming_strings`): it is sent rebuilt
            // from the parse tree, never as the client's text. (A FunctionCall is one
            // statement: never split.)
            ClientOp::Query(..) if split => After::CommitPart {
                sql: last.commit_sql.clone().unwrap_or_default(),
                owns,
            },
            // COPY FROM STDIN reads CopyData next: nothing may follow it yet.
            _ if end_block && copy => After::EndBlock,
            _ if end_block => After::Continue,
            _ => After::Report,
        };
        if commit_last && !split && entry == b'T' {
            // A lone COMMIT inside a block: the guard goes right before it.
            self.put_guard_query(true, false)?;
        }
        let owns_after = if split { owns } else { owns && !ends };
        let mut unit = Pending::ready(false, owns_after, after);
        unit.suppress_begin_warning = suppress;
        match op {
            ClientOp::Query(text, m) => {
                if rewritten || split {
                    let (sql, parts, moved) = rewrite(&text, stmts, body, first, &script);
                    self.put_query(&sql)?;
                    unit.script = parts;
                    unit.moved = moved;
                } else {
                    self.out.extend_from_slice(&m.frame);
                }
            }
            ClientOp::Message(m) if entry == b'I' => {
                // A FunctionCall is a message of its own and cannot share a Query with the
                // proxy's BEGIN: it waits until the upstream reports the block open.
                let mut lead = String::new();
                for (part, sql) in &script {
                    if let Part::Proxy(_) = part {
                        lead.push_str(sql);
                        lead.push_str("; ");
                    }
                }
                self.put_query(&lead)?;
                let mut p = Pending::ready(true, owns, After::Held(m.frame));
                p.reading = (guards > 0).then_some(Reading::FenceOnly);
                self.pending.push_back(p);
                return Ok(Flow::Continue);
            }
            ClientOp::Message(m) => {
                if guards > 0 {
                    // Inside the block: a failed guard aborts it, and the call fails with it.
                    self.put_guard_query(false, false)?;
                }
                self.out.extend_from_slice(&m.frame);
            }
        }
        self.pending.push_back(unit);
        if end_block && !copy && !split {
            self.put_block_end()?;
        }
        Ok(Flow::Continue)
    }

    /// The guard and the proxy's COMMIT after the client's statements in the proxy's block,
    /// pipelined: after an error the guard fails (swallowed) and COMMIT rolls back.
    fn put_block_end(&mut self) -> anyhow::Result<()> {
        self.put_guard_query(true, true)?;
        self.put_query(fence_sql::COMMIT_SQL)?;
        self.pending
            .push_back(Pending::ready(true, false, After::Report));
        Ok(())
    }

    /// Parse, Bind, Describe, Execute, Close, Sync, Flush (`decoded`: the message, read
    /// completely).
    async fn extended(&mut self, m: Message, decoded: Frontend) -> anyhow::Result<Flow> {
        if self.group.is_none() {
            self.request = Request::new();
            self.group = Some(Group {
                status: self.status,
                owns: false,
                executed: false,
                block_executed: false,
                implicit: false,
                failed: false,
            });
        }
        let failed = self.group.as_ref().is_some_and(|g| g.failed);
        if m.tag == b'S' {
            return self.sync(m).await;
        }
        if failed {
            // The upstream skips everything up to Sync and answers none of it.
            self.out.extend_from_slice(&m.frame);
            return Ok(Flow::Continue);
        }
        match decoded {
            Frontend::Parse {
                name,
                text,
                param_types,
            } => self.parse(m, &name, &text, &param_types).await,
            Frontend::Bind { portal, statement } => self.bind(m, &portal, &statement).await,
            Frontend::Execute { portal, .. } => self.execute(m, &portal).await,
            Frontend::Close { target, name } => self.close(m, target, &name).await,
            Frontend::Describe { target, name } => {
                let what = match target {
                    Target::Portal => "portal",
                    Target::Statement => "prepared statement",
                };
                if let Err(e) = Self::check_client_name(&name, what) {
                    return self.refuse_message(e);
                }
                let name = name_key(&name);
                let kind = match target {
                    Target::Portal => self.portals.get(&name),
                    Target::Statement => self.statements.get(&name),
                }
                .kind();
                self.before_client_message(&kind)?;
                let owns = self.group_owns();
                self.pending.push_back(Pending::new(Unit::Describe, owns));
                self.out.extend_from_slice(&m.frame);
                Ok(Flow::Continue)
            }
            // Flush: answered by nothing.
            _ => {
                self.out.extend_from_slice(&m.frame);
                Ok(Flow::Continue)
            }
        }
    }

    fn group_owns(&self) -> bool {
        self.group.as_ref().is_some_and(|g| g.owns)
    }

    /// Opens the proxy's block in the group at projected status `I` (its BEGIN, under the
    /// proxy's internal names, ahead of the client's next message).
    fn open_block(&mut self, g: &mut Group) -> anyhow::Result<()> {
        self.put_internal(fence_sql::BEGIN_SQL, false, true)?;
        g.owns = true;
        g.status = b'T';
        g.block_executed = false;
        // The BEGIN turns an implicit transaction the server had started into this block.
        g.implicit = false;
        self.guarded = false;
        Ok(())
    }

    /// Before a client's Parse, Bind or Describe of a statement or portal of kind `kind`: at
    /// projected status `I` the server would start an implicit transaction for it, which the
    /// client's Sync commits, and each of them can run client code there (a constant coerced to
    /// a domain runs its CHECK at Parse, a parameter of a domain type at Bind, planning folds
    /// functions at Bind, a statement re-analysed at Describe). So the proxy's block opens first,
    /// as before an Execute. The exceptions: a Parse of transaction control, which goes upstream
    /// as the placeholder and runs nothing (see `parse`), and a Bind or Describe of a believed
    /// BEGIN, whose Execute the proxy answers with a BEGIN of its own carrying the client's
    /// options (see `execute_control`): it may read parameters, or be another statement SQL
    /// `PREPARE` put under the name, so the group remembers that an implicit transaction is open,
    /// which the proxy's BEGIN at the Execute turns into the client's block, or the proxy's at
    /// Sync (and rolls back).
    fn before_client_message(&mut self, kind: &StatementKind) -> anyhow::Result<()> {
        let Some(mut g) = self.group.take() else {
            anyhow::bail!("client message outside a group");
        };
        let result = if g.status != b'I' {
            Ok(())
        } else if matches!(kind, StatementKind::Begin(_)) {
            g.implicit = true;
            Ok(())
        } else {
            self.open_block(&mut g)
        };
        self.group = Some(g);
        result
    }

    /// Checks a statement or portal name against [`MAX_NAME_BYTES`].
    fn check_name(name: &[u8], what: &str) -> Result<(), ProxyError> {
        if name.len() > MAX_NAME_BYTES {
            return Err(ProxyError::error(
                error::LIMIT_EXCEEDED,
                format!(
                    "{what} name of {} bytes exceeds the limit of {MAX_NAME_BYTES} bytes",
                    name.len()
                ),
            ));
        }
        Ok(())
    }

    /// Checks a statement or portal name of a client's protocol message (see "Names" in the
    /// module header): names with the proxy's prefix are its own (42939), and a name that is not
    /// ASCII is refused (42602) because Postgres converts it from `client_encoding`, so the proxy
    /// cannot know which server name its bytes are.
    fn check_client_name(name: &[u8], what: &str) -> Result<(), ProxyError> {
        let shown = name.escape_ascii().to_string();
        if classify::is_reserved(name) {
            return Err(ProxyError::error(
                error::RESERVED_NAME,
                format!(
                    "{what} name \"{shown}\" is reserved for the proxy (names starting with {}, in any case, are its own)",
                    classify::RESERVED_PREFIX
                ),
            )
            .with_hint("use another name"));
        }
        if !name.is_ascii() {
            return Err(ProxyError::error(
                error::INVALID_NAME,
                format!(
                    "{what} name \"{shown}\" is not ASCII: Postgres reads names in client_encoding, so the proxy cannot know which name the server would use"
                ),
            )
            .with_hint("use an ASCII name"));
        }
        Ok(())
    }

    /// Refuses one client message of a group with `e` as an ERROR: in its place goes a Parse
    /// that fails under the proxy's own statement name (a syntax error, so nothing is stored),
    /// which keeps the upstream's response order and makes it skip to Sync, as for any failed
    /// message.
    fn refuse_message(&mut self, e: ProxyError) -> anyhow::Result<Flow> {
        tracing::info!(code = e.code, "{}", e.message);
        let mut p = Pending::new(Unit::Parse, self.group_owns());
        p.refusal = Some(e);
        self.out.extend_from_slice(
            &parse_frame(INTERNAL_STATEMENT.as_bytes(), REFUSED_PARSE_SQL, &[]).frame,
        );
        self.pending.push_back(p);
        Ok(Flow::Continue)
    }

    async fn parse(
        &mut self,
        m: Message,
        raw_name: &[u8],
        raw: &[u8],
        param_types: &[u32],
    ) -> anyhow::Result<Flow> {
        if let Err(e) = Self::check_name(raw_name, "prepared statement") {
            return self.refuse_in_group(e).await;
        }
        if let Err(e) = Self::check_client_name(raw_name, "prepared statement") {
            return self.refuse_message(e);
        }
        let name = name_key(raw_name);
        let read = match self.sql_text(raw) {
            Ok(text) => self.read_sql(&text).await,
            Err(e) => Err(e),
        };
        let (known, refusal) = match read {
            // One statement: what it is. A SET of lockd.fence that does not verify fails at
            // Parse, like any refused statement.
            Ok(stmts) if stmts.len() == 1 => match self.verify_fence_sets(&stmts) {
                Err(e) => (Known::ORDINARY, Some(e)),
                // Transaction control the proxy cannot rebuild is refused: the upstream may not
                // hold it (see `Known::Kind`).
                Ok(()) if stmts[0].transaction_control && stmts[0].control_sql.is_none() => (
                    Known::ORDINARY,
                    Some(
                        ProxyError::error(
                            error::NOT_SUPPORTED,
                            "a prepared transaction-control statement naming a savepoint or transaction identifier that is not printable ASCII: the proxy runs prepared transaction control rebuilt from the parse tree, and rebuilds ASCII names only",
                        )
                        .with_hint("send it as a simple query, or use an ASCII name"),
                    ),
                ),
                Ok(()) => {
                    self.forget_deallocated(&stmts);
                    (
                        Known::Kind {
                            kind: stmts[0].kind.clone(),
                            control: stmts[0].control_sql.clone(),
                        },
                        None,
                    )
                }
            },
            // An empty text: an empty statement.
            Ok(stmts) if stmts.is_empty() => (Known::ORDINARY, None),
            // Several: refused as Postgres refuses them, by the proxy, which does not forward
            // what it would read as several statements.
            Ok(_) => (
                Known::ORDINARY,
                Some(ProxyError::error(
                    error::SYNTAX_ERROR,
                    "cannot insert multiple commands into a prepared statement",
                )),
            ),
            Err(e) => (Known::ORDINARY, Some(e)),
        };
        if known != Known::ORDINARY && self.statements.full_for(&name) {
            return self
                .refuse_in_group(ProxyError::error(
                    error::LIMIT_EXCEEDED,
                    format!(
                        "more than {MAX_TRACKED_NAMES} prepared transaction-control or setting statements in one session (at {name:?})"
                    ),
                ))
                .await;
        }
        let control = matches!(
            &known,
            Known::Kind {
                control: Some(_),
                ..
            }
        );
        // The Parse of a transaction-control text is the placeholder's, which runs nothing (no
        // expression, no type input), so it needs no block; every other Parse may run client
        // code (see `before_client_message`).
        if !(refusal.is_none() && control) {
            self.before_client_message(&StatementKind::Other)?;
        }
        let owns = self.group_owns();
        let mut p = Pending::new(Unit::Parse, owns);
        self.project(&mut p, Track::Statement(name, known));
        if let Some(e) = refusal {
            // Replaced by a statement that fails at Parse, so the refusal keeps the upstream's
            // response order and the upstream skips to Sync.
            self.out
                .extend_from_slice(&parse_frame(raw_name, REFUSED_PARSE_SQL, &[]).frame);
            p.refusal = Some(e);
        } else if control {
            // The upstream never holds transaction control as a prepared statement: SQL EXECUTE
            // (from the client's text, a function's dynamic SQL) would run it where the proxy
            // does not see it, ending or undoing the guarded block. It gets the placeholder
            // under the client's name and the client's parameter types; at Execute the proxy
            // runs the statement rebuilt from the parse tree in its place (`execute`).
            self.out.extend_from_slice(
                &parse_frame(raw_name, classify::PLACEHOLDER_SQL, param_types).frame,
            );
        } else {
            self.out.extend_from_slice(&m.frame);
        }
        self.pending.push_back(p);
        Ok(Flow::Continue)
    }

    async fn bind(
        &mut self,
        m: Message,
        raw_portal: &[u8],
        raw_statement: &[u8],
    ) -> anyhow::Result<Flow> {
        if let Err(e) = Self::check_name(raw_portal, "portal") {
            return self.refuse_in_group(e).await;
        }
        if let Err(e) = Self::check_client_name(raw_portal, "portal")
            .and_then(|()| Self::check_client_name(raw_statement, "prepared statement"))
        {
            return self.refuse_message(e);
        }
        let portal = name_key(raw_portal);
        let known = self.statements.get(&name_key(raw_statement));
        if known == Known::Unknown {
            // Fail closed: the old unnamed statement may have outlived a failed Parse (a
            // prepared COMMIT the proxy would no longer see). The Bind is replaced by a Parse
            // that fails under the proxy's own name, so the refusal keeps the upstream's
            // response order and the upstream skips to Sync; no portal is made.
            let mut p = Pending::new(Unit::Bind, self.group_owns());
            p.refusal = Some(
                ProxyError::error(
                    error::INVALID_STATEMENT_NAME,
                    "the unnamed prepared statement is unknown after its last Parse failed: the proxy binds it only after a Parse of it succeeds",
                )
                .with_hint("send a Parse of the unnamed statement before binding it"),
            );
            self.out.extend_from_slice(
                &parse_frame(INTERNAL_STATEMENT.as_bytes(), REFUSED_PARSE_SQL, &[]).frame,
            );
            self.pending.push_back(p);
            return Ok(Flow::Continue);
        }
        if known != Known::ORDINARY && self.portals.full_for(&portal) {
            return self
                .refuse_in_group(ProxyError::error(
                    error::LIMIT_EXCEEDED,
                    format!(
                        "more than {MAX_TRACKED_NAMES} transaction-control portals in one session"
                    ),
                ))
                .await;
        }
        self.before_client_message(&known.kind())?;
        let owns = self.group_owns();
        let mut p = Pending::new(Unit::Bind, owns);
        self.project(&mut p, Track::Portal(portal, known));
        self.pending.push_back(p);
        self.out.extend_from_slice(&m.frame);
        Ok(Flow::Continue)
    }

    /// A Close needs no block at `I`: closing a statement drops its cached plan and closing a
    /// portal there can only drop a WITH HOLD cursor, whose rows were materialised at its
    /// commit; neither runs client code, so the implicit transaction the server starts for it
    /// holds nothing to commit.
    async fn close(&mut self, m: Message, target: Target, raw_name: &[u8]) -> anyhow::Result<Flow> {
        let what = match target {
            Target::Portal => "portal",
            Target::Statement => "prepared statement",
        };
        if let Err(e) = Self::check_client_name(raw_name, what) {
            return self.refuse_message(e);
        }
        let owns = self.group_owns();
        let mut p = Pending::new(Unit::Close, owns);
        let name = name_key(raw_name);
        // Only names the maps hold need remembering; the others are ordinary anyway. A Close
        // drops the name whether or not it existed, so an unknown one is known again (absent).
        let track = match target {
            Target::Statement if self.statements.kinds.contains_key(&name) => {
                Track::CloseStatement(name)
            }
            Target::Portal if self.portals.kinds.contains_key(&name) => Track::ClosePortal(name),
            _ => Track::Nothing,
        };
        self.project(&mut p, track);
        self.pending.push_back(p);
        self.out.extend_from_slice(&m.frame);
        Ok(Flow::Continue)
    }

    /// Parse/Bind/Execute of one statement of the proxy's own under its internal names, closed
    /// right after, so a second one in the same block never finds the portal in use and a
    /// client's DEALLOCATE ALL cannot break the next. The first Close clears a statement left
    /// over when an earlier one failed before its final Close ran (closing a missing statement is
    /// not an error). `owns_before`/`owns_after`: ownership of the block before and after it runs.
    fn put_internal(
        &mut self,
        sql: &str,
        owns_before: bool,
        owns_after: bool,
    ) -> anyhow::Result<()> {
        self.put_internal_with(sql, owns_before, owns_after, |_| {})
    }

    /// [`Self::put_internal`], with `execute` applied to the expectation of its Execute.
    fn put_internal_with(
        &mut self,
        sql: &str,
        owns_before: bool,
        owns_after: bool,
        execute: impl FnOnce(&mut Pending),
    ) -> anyhow::Result<()> {
        frontend::close(b'S', INTERNAL_STATEMENT, &mut self.out)?;
        frontend::parse(INTERNAL_STATEMENT, sql, std::iter::empty(), &mut self.out)?;
        frontend::bind(
            INTERNAL_PORTAL,
            INTERNAL_STATEMENT,
            std::iter::empty(),
            std::iter::empty::<()>(),
            |(), _| Ok(postgres_protocol::IsNull::No),
            std::iter::empty(),
            &mut self.out,
        )
        .map_err(|_| anyhow::anyhow!("encoding the proxy's Bind message"))?;
        frontend::execute(INTERNAL_PORTAL, 0, &mut self.out)?;
        frontend::close(b'P', INTERNAL_PORTAL, &mut self.out)?;
        frontend::close(b'S', INTERNAL_STATEMENT, &mut self.out)?;
        let mut execute = Some(execute);
        for (unit, owns) in [
            (Unit::Close, owns_before),
            (Unit::Parse, owns_before),
            (Unit::Bind, owns_before),
            (Unit::Execute, owns_after),
            (Unit::Close, owns_after),
            (Unit::Close, owns_after),
        ] {
            let mut p = Pending::internal(unit, owns);
            if unit == Unit::Execute
                && let Some(f) = execute.take()
            {
                f(&mut p);
            }
            self.pending.push_back(p);
        }
        Ok(())
    }

    async fn execute(&mut self, m: Message, raw_portal: &[u8]) -> anyhow::Result<Flow> {
        if let Err(e) = Self::check_client_name(raw_portal, "portal") {
            return self.refuse_message(e);
        }
        let known = self.portals.get(&name_key(raw_portal));
        let kind = known.kind();
        let Some(mut g) = self.group.take() else {
            anyhow::bail!("Execute outside a group");
        };
        if let Known::Kind {
            control: Some(sql), ..
        } = &known
        {
            let result = self.execute_control(&mut g, &kind, sql);
            self.group = Some(g);
            result?;
            return Ok(Flow::Continue);
        }
        // Whatever the projected kind says, no client Execute is forwarded outside a block the
        // proxy opened: a kind that is wrong (a name redefined by SQL PREPARE/DEALLOCATE the
        // proxy does not track) then only costs compatibility, never an implicit transaction
        // that commits on its own.
        if g.status == b'I' {
            self.open_block(&mut g)?;
        }
        if forgets_unfenced(&kind) {
            self.forget_unfenced();
        }
        match &kind {
            StatementKind::Setting { touches_fence } => {
                // The next data statement is guarded again, with the fence this sets.
                if *touches_fence {
                    self.guarded = false;
                }
            }
            // Everything else forwarded is a data statement (transaction control is never
            // forwarded: its portals carry `control`).
            _ => {
                if g.status == b'T' && !self.guarded {
                    if !self.skip_opening_guard() {
                        self.put_guard(false, false, g.owns, g.owns)?;
                    }
                    self.guarded = true;
                }
            }
        }
        let starts_copy = kind == StatementKind::CopyIn;
        if starts_copy {
            // The server reads CopyData right after this Execute: nothing of the proxy's own may
            // follow it, so the client's next messages wait for CopyInResponse (or an error, or
            // CommandComplete if the kind was wrong).
            self.copy = Copy::Starting;
        }
        g.executed = true;
        g.block_executed = true;
        let mut p = Pending::new(Unit::Execute, g.owns);
        p.starts_copy = starts_copy;
        self.pending.push_back(p);
        self.group = Some(g);
        self.out.extend_from_slice(&m.frame);
        Ok(Flow::Continue)
    }

    /// A client Execute of a portal of prepared transaction control (`sql`: the statement
    /// rebuilt from the client's text). The upstream's portal holds the placeholder, so the
    /// client's Execute is not forwarded: the proxy runs `sql` under its own names and hands its
    /// CommandComplete (or error) to the client as the answer, after the guard where `sql` is a
    /// commit point. Because the statement is the proxy's own text, what runs is what the
    /// proxy planned for, whatever the client or SQL `PREPARE`/`DEALLOCATE` did to the name:
    /// if the belief is wrong, the client's statement simply does not run (compatibility, never
    /// safety). A BEGIN at `I` opens the client's block itself (no 25001 warning, no line in
    /// the server's log per transaction); everything else runs in a block (the proxy's at `I`).
    fn execute_control(
        &mut self,
        g: &mut Group,
        kind: &StatementKind,
        sql: &str,
    ) -> anyhow::Result<()> {
        let begin_at_idle = g.status == b'I' && matches!(kind, StatementKind::Begin(_));
        if g.status == b'I' && !begin_at_idle {
            self.open_block(g)?;
        }
        if forgets_unfenced(kind) {
            self.forget_unfenced();
        }
        let owns_before = g.owns;
        let mut suppress = false;
        match kind {
            StatementKind::Begin(_) => {
                if begin_at_idle {
                    // The block is the client's at once; an implicit transaction a Bind or
                    // Describe of it started becomes that block.
                    g.status = b'T';
                    g.implicit = false;
                    self.guarded = false;
                } else if g.owns {
                    // Behind statements of this group in the proxy's block: the client turns
                    // that block into its own, as BEGIN turns an implicit transaction into a
                    // block, and the 25001 warning is the proxy's, not the client's. (Inside
                    // the client's own block Postgres warns, as it would directly.)
                    g.owns = false;
                    suppress = true;
                }
            }
            StatementKind::Commit { chain } => {
                let skip_guard = g.status == b'E' && !g.executed;
                if !skip_guard {
                    // If the guard fails, the upstream skips this COMMIT; the proxy then rolls
                    // the block back at Sync, so the client ends at `I` as after any failed
                    // COMMIT.
                    self.put_guard(true, true, true, g.owns)?;
                }
                g.owns = false;
                g.status = if *chain { b'T' } else { b'I' };
                self.guarded = false;
            }
            StatementKind::Rollback { chain } => {
                g.owns = false;
                g.status = if *chain { b'T' } else { b'I' };
                self.guarded = false;
            }
            StatementKind::RollbackTo => {
                if g.status == b'E' {
                    g.status = b'T';
                }
                self.guarded = false;
            }
            // SAVEPOINT and RELEASE; COMMIT PREPARED and ROLLBACK PREPARED, which Postgres
            // refuses inside the block (25001).
            _ => {}
        }
        let commit = matches!(kind, StatementKind::Commit { .. });
        self.put_internal_with(sql, owns_before, g.owns, |p| {
            p.answers_client = true;
            p.confirms_commit = commit;
            p.suppress_begin_warning = suppress;
        })?;
        g.executed = true;
        if !begin_at_idle {
            g.block_executed = true;
        }
        Ok(())
    }

    async fn sync(&mut self, m: Message) -> anyhow::Result<Flow> {
        let Some(g) = self.group.take() else {
            anyhow::bail!("Sync outside a group");
        };
        if g.owns && !g.failed {
            if g.block_executed {
                self.put_guard(true, false, true, true)?;
                self.put_internal(fence_sql::COMMIT_SQL, true, false)?;
            } else {
                // Only Parse, Bind or Describe ran in the block: nothing of it is the client's
                // to keep (prepared statements outlive a rollback; portals end with the
                // transaction either way), and whatever client code they ran is undone.
                self.put_internal(fence_sql::ROLLBACK_SQL, true, false)?;
            }
            self.guarded = false;
        } else if g.implicit && !g.failed && g.status == b'I' {
            // A Bind or Describe of a client's BEGIN without its Execute: the server's implicit
            // transaction becomes the proxy's block and is rolled back.
            self.put_internal(fence_sql::BEGIN_SQL, false, true)?;
            self.put_internal(fence_sql::ROLLBACK_SQL, true, false)?;
            self.guarded = false;
        }
        self.pending
            .push_back(Pending::ready(false, false, After::SyncEnd));
        self.out.extend_from_slice(&m.frame);
        self.awaiting_ready = true;
        Ok(Flow::Continue)
    }

    // ----- upstream side -----------------------------------------------------------------------

    async fn on_upstream(&mut self, m: Message) -> anyhow::Result<Flow> {
        tracing::trace!(tag = %(m.tag as char), len = m.frame.len(), pending = self.pending.len(), "upstream message");
        match m.tag {
            b'Z' => return self.on_ready(m).await,
            b'E' => self.on_error(m).await?,
            b'N' => {
                let suppress = self.pending.front().is_some_and(|p| {
                    p.answering_proxy()
                        || (p.suppress_begin_warning
                            && error::error_code(m.body()).as_deref()
                                == Some(ACTIVE_SQL_TRANSACTION))
                });
                if !suppress {
                    let m = match self.pending.front() {
                        Some(p) => p.for_client(&m),
                        None => m,
                    };
                    self.send_client(&m).await?;
                }
            }
            b'S' => {
                if let Some((name, value)) = parameter_status(m.body()) {
                    match name.as_str() {
                        "standard_conforming_strings" => self.standard_strings_off = value != "on",
                        "client_encoding" => self.client_encoding = Some(value),
                        _ => {}
                    }
                }
                self.send_client(&m).await?;
            }
            b'A' => self.send_client(&m).await?,
            tag => {
                let front = self.pending.front();
                let internal = front.is_some_and(Pending::answering_proxy);
                let rewritten = front.is_some_and(|p| !p.script.is_empty());
                // Only a guard's own row is read: never one of a client statement.
                let reading = match front.and_then(Pending::proxy_part) {
                    Some(Lead::Guard(reading)) => Some(reading),
                    Some(Lead::Begin { .. }) => None,
                    None if rewritten => None,
                    None => front.and_then(|p| p.reading),
                };
                let confirms_commit = front.is_some_and(|p| p.confirms_commit);
                if tag == b'C' && front.is_some_and(|p| p.discards_all) {
                    // Every named statement and every portal is gone; the unnamed statement is
                    // not one of them (Postgres keeps it apart), so what is known of it stays.
                    self.statements.kinds.retain(|name, _| name.is_empty());
                    self.portals.kinds.clear();
                }
                let completes = front.is_some_and(|p| p.unit.completed_by(tag));
                if tag == b'D'
                    && let Some(reading) = reading
                {
                    // The guard's second column: `t` when the session has no fence.
                    let unfenced = data_row_column(m.body(), 1) == Some(&b"t"[..]);
                    self.take_reading(reading, unfenced);
                }
                if confirms_commit && completes {
                    let tag = (tag == b'C')
                        .then(|| codec::read_cstr(&mut m.body()))
                        .flatten();
                    self.confirm_commit(tag.as_deref());
                }
                if completes {
                    let done = self.pending.pop_front().expect("front exists");
                    self.request.owns = done.owns_after;
                    if done.starts_copy && self.copy == Copy::Starting {
                        // A statement the proxy took for COPY FROM STDIN completed without
                        // entering copy mode (a wrong kind): nothing to wait for.
                        self.copy = Copy::Off;
                    }
                }
                if tag == b'C'
                    && rewritten
                    && let Some(p) = self.pending.front_mut()
                {
                    p.statement_completed();
                }
                if matches!(tag, b'G' | b'W') {
                    self.copy = Copy::In;
                }
                if !internal && !self.request.internal_failed {
                    self.send_client(&m).await?;
                }
            }
        }
        Ok(Flow::Continue)
    }

    /// Applies what `track` does to the name maps as the message is sent, so the messages
    /// behind it in the same group (a Bind right after its Parse, an Execute right after its
    /// Bind) see the kind they will find upstream, and keeps the undo for [`Self::on_error`].
    /// Projecting along the path where every message succeeds is exact: an error makes the
    /// upstream skip everything up to Sync, and the skipped units are undone.
    fn project(&mut self, p: &mut Pending, track: Track) {
        let (portal, name, new) = match &track {
            Track::Nothing => return,
            Track::Statement(n, k) => (false, n.clone(), Some(k.clone())),
            Track::Portal(n, k) => (true, n.clone(), Some(k.clone())),
            Track::CloseStatement(n) => (false, n.clone(), None),
            Track::ClosePortal(n) => (true, n.clone(), None),
        };
        let map = if portal {
            &mut self.portals
        } else {
            &mut self.statements
        };
        p.undo = Some((portal, name.clone(), map.kinds.get(&name).cloned()));
        match new {
            Some(kind) => map.set(name, kind),
            None => {
                map.kinds.remove(&name);
            }
        }
        p.track = track;
    }

    fn undo(&mut self, undo: (bool, String, Option<Known>)) {
        let (portal, name, prev) = undo;
        let map = if portal {
            &mut self.portals
        } else {
            &mut self.statements
        };
        match prev {
            Some(kind) => map.set(name, kind),
            None => {
                map.kinds.remove(&name);
            }
        }
    }

    async fn on_error(&mut self, m: Message) -> anyhow::Result<()> {
        // The transaction may roll back, and with it a setting made inside it. A guard that
        // fails found a fence (or runs under --require-fence).
        if self
            .pending
            .front()
            .is_some_and(|p| p.reading.is_some() || matches!(p.proxy_part(), Some(Lead::Guard(_))))
        {
            self.ever_fenced = true;
        }
        self.forget_unfenced();
        // The proxy's own group may have stopped between its Parse and its final Close: the
        // failed unit or one the upstream now skips is one of its messages (or the error cannot
        // be placed at all). Its statement and portal are closed before anything more of the
        // client's goes upstream (`close_internal_names`).
        if self
            .pending
            .front()
            .is_none_or(|p| p.after == After::SyncEnd)
            || self
                .pending
                .iter()
                .take_while(|p| p.unit != Unit::Ready)
                .any(|p| p.internal)
        {
            self.internal_may_linger = true;
        }
        let code = error::error_code(m.body());
        let client_view = self.pending.front().map(|p| p.for_client(&m));
        let (internal, refusal, unnamed_parse) = match self.pending.front_mut() {
            // The proxy's Execute standing in for a client's answers with the client's error.
            Some(p) => (
                (p.internal && !p.answers_client) || p.answering_proxy(),
                p.refusal.take(),
                matches!((p.unit, &p.track), (Unit::Parse, Track::Statement(name, _)) if name.is_empty()),
            ),
            None => (false, None, false),
        };
        // A client statement ran a placeholder (SQL EXECUTE of a name the client prepared as
        // transaction control): say so instead of naming a savepoint the client never made.
        let refusal = refusal.or_else(|| {
            let placeholder = !internal
                && code.as_deref() == Some("3B001")
                && error::error_field(m.body(), b'M')
                    .is_some_and(|msg| msg.contains(classify::PLACEHOLDER_SAVEPOINT));
            placeholder.then(|| {
                ProxyError::error(
                    error::NOT_SUPPORTED,
                    "this prepared statement is transaction control, prepared through the extended protocol: the proxy runs it only as the answer to a protocol Execute of it, never through SQL EXECUTE (which would end or undo the guarded transaction where the proxy does not see it)",
                )
                .with_hint("Bind and Execute the statement, or send the transaction-control statement as a query")
            })
        });
        let m = client_view.unwrap_or(m);
        // The upstream skips everything up to the next Sync; so do the expectations, and the
        // projected name kinds of the failed and skipped messages are undone, newest first.
        let mut skipped = Vec::new();
        while self.pending.front().is_some_and(|p| p.unit != Unit::Ready) {
            skipped.extend(self.pending.pop_front().and_then(|p| p.undo));
        }
        for undo in skipped.into_iter().rev() {
            self.undo(undo);
        }
        // A failed Parse of a named statement leaves the old one as it was (restored above):
        // Postgres drops nothing of it, and refuses to redefine an existing name (42P05). A
        // failed Parse of the unnamed statement may or may not have dropped the old one
        // (Postgres drops it early in the Parse, but not when the Parse fails before that), so
        // it is unknown until a Parse of it succeeds or a Close drops it.
        if unnamed_parse {
            self.statements.set(String::new(), Known::Unknown);
        }
        if let Some(g) = self.group.as_mut() {
            g.failed = true;
        }
        self.copy = Copy::Off;
        let result = if code.as_deref() == Some(error::STALE_TOKEN) {
            RequestResult::Stale
        } else {
            RequestResult::Error
        };
        if self.request.result == RequestResult::Ok {
            self.request.result = result;
        }
        let forward = if internal {
            self.request.internal_failed = true;
            !self.request.error_sent
        } else {
            self.request.client_failed = true;
            !self.request.internal_failed
        };
        if forward {
            self.request.error_sent = true;
            match refusal {
                Some(e) => self.send_client(&e.to_message()).await?,
                None if internal => {
                    let rewritten = self.explain_internal_error(code.as_deref());
                    match rewritten {
                        Some(e) => self.send_client(&e.to_message()).await?,
                        // (A syntax error the server finds before any statement of a Query
                        // runs is charged to the proxy's first statement; its cursor is
                        // mapped to the client's text above, or dropped.)
                        None => self.send_client(&m).await?,
                    }
                }
                None => self.send_client(&m).await?,
            }
        }
        Ok(())
    }

    /// A clear error for the guard's setup problems: the function missing in this database (a
    /// session in another database than the one `init` ran in) or not granted to the role.
    fn explain_internal_error(&self, code: Option<&str>) -> Option<ProxyError> {
        let f = self.cfg.fence_table.guard_signature();
        match code {
            Some("42883") | Some("3F000") => Some(
                ProxyError::error(
                    error::GUARD_MISSING,
                    format!(
                        "the guard function {f} does not exist in this database, so no transaction can be fenced here"
                    ),
                )
                .with_hint(
                    "run `fence-proxy postgres init --upstream postgres://.../<this database>` once per database",
                ),
            ),
            Some("42501") => Some(
                ProxyError::error(
                    error::INSUFFICIENT_PRIVILEGE,
                    format!("this role may not execute the guard function {f}"),
                )
                .with_hint("run `fence-proxy postgres init --grant-to <role>` for the application role"),
            ),
            _ => None,
        }
    }

    async fn on_ready(&mut self, m: Message) -> anyhow::Result<Flow> {
        let status = m.body().first().copied().unwrap_or(b'I');
        self.status = status;
        // Everything before the Ready unit was skipped by an error or answered already.
        let mut ready = None;
        while let Some(p) = self.pending.pop_front() {
            if p.unit == Unit::Ready {
                ready = Some(p);
                break;
            }
        }
        self.copy = Copy::Off;
        if status == b'I' {
            self.guarded = false;
            // Portals live until their transaction ends.
            self.portals.kinds.clear();
        }
        if self.internal_may_linger {
            self.close_internal_names()?;
        }
        let Some(ready) = ready else {
            // A ReadyForQuery nobody asked for: pass it on.
            self.send_client(&m).await?;
            return Ok(Flow::Continue);
        };
        let failed = self.request.client_failed || self.request.internal_failed;
        match ready.after {
            After::Continue => Ok(Flow::Continue),
            After::Report => self.report(status).await,
            After::CommitPart { sql, owns } => {
                if failed {
                    if owns && status == b'E' {
                        self.end_with(fence_sql::ROLLBACK_SQL);
                        Ok(Flow::Continue)
                    } else {
                        self.report(status).await
                    }
                } else {
                    if status == b'T' {
                        self.put_guard_query(true, owns)?;
                    }
                    self.put_query(&sql)?;
                    self.pending
                        .push_back(Pending::ready(false, false, After::Report));
                    self.guarded = false;
                    Ok(Flow::Continue)
                }
            }
            After::EndBlock => match status {
                b'T' => {
                    self.put_guard_query(true, true)?;
                    self.end_with(fence_sql::COMMIT_SQL);
                    Ok(Flow::Continue)
                }
                b'E' => {
                    self.end_with(fence_sql::ROLLBACK_SQL);
                    Ok(Flow::Continue)
                }
                _ => self.report(status).await,
            },
            After::Held(frame) => {
                if !failed && status == b'T' {
                    self.out.extend_from_slice(&frame);
                    self.pending
                        .push_back(Pending::ready(false, true, After::Continue));
                    self.put_block_end()?;
                    Ok(Flow::Continue)
                } else if status == b'E' {
                    self.end_with(fence_sql::ROLLBACK_SQL);
                    Ok(Flow::Continue)
                } else {
                    self.report(status).await
                }
            }
            After::SyncEnd => {
                self.group = None;
                if self.request.owns && status == b'E' {
                    self.end_with(fence_sql::ROLLBACK_SQL);
                    Ok(Flow::Continue)
                } else {
                    self.report(status).await
                }
            }
        }
    }

    /// Closes the proxy's internal statement and portal after an error that may have left them
    /// (see `internal_may_linger`): Close S, Close P, Sync, all answers swallowed. Called on the
    /// ReadyForQuery that ends the upstream's skip: nothing of the client's has been forwarded
    /// since the error (the upstream skipped the rest of the group, the client's next request
    /// waits for this ReadyForQuery, and what the proxy sends itself after a Sync is simple
    /// queries), so these go upstream before any client code can run. Close works in a failed
    /// block and for a name that does not exist.
    fn close_internal_names(&mut self) -> anyhow::Result<()> {
        self.internal_may_linger = false;
        frontend::close(b'S', INTERNAL_STATEMENT, &mut self.out)?;
        frontend::close(b'P', INTERNAL_PORTAL, &mut self.out)?;
        frontend::sync(&mut self.out);
        self.pending
            .push_back(Pending::internal(Unit::Close, false));
        self.pending
            .push_back(Pending::internal(Unit::Close, false));
        self.pending
            .push_back(Pending::ready(true, false, After::Continue));
        Ok(())
    }

    /// Queues the proxy's own COMMIT or ROLLBACK as the request's last unit.
    fn end_with(&mut self, sql: &str) {
        let _ = frontend::query(sql, &mut self.out);
        self.pending
            .push_back(Pending::ready(true, false, After::Report));
        self.guarded = false;
    }

    /// Ends the request: the client gets the final status.
    async fn report(&mut self, status: u8) -> anyhow::Result<Flow> {
        self.send_client(&ready_for_query(status)).await?;
        self.awaiting_ready = false;
        self.group = None;
        record_request(
            self.request.result,
            self.request.started.take().map(|t| t.elapsed()),
        );
        Ok(Flow::Continue)
    }
}

/// The client's part of a simple-protocol request.
enum ClientOp {
    /// A Query message and its text.
    Query(String, Message),
    /// Another message answered by ReadyForQuery (FunctionCall).
    Message(Message),
}

/// The script of a simple Query (see `Session::plan_simple`): the proxy's statements, each with
/// its SQL, and runs of the client's `body` statements. `open`: the proxy opens the block (its
/// BEGIN leads; a client BEGIN that starts the text is replaced by its rebuilt form). `need`:
/// the next data statement needs an opening guard. `guard`: the guard's SQL, `None` where the
/// session is known to have no fence (the need is then met without one). Returns the script,
/// the index of the first client statement in it (1 when a leading client BEGIN was replaced),
/// and whether a data statement after the Query still needs a guard.
fn plan_script<'a>(
    stmts: &'a [Statement],
    body: &[Statement],
    open: bool,
    mut need: bool,
    guard: Option<&'a str>,
) -> (Vec<(Part, &'a str)>, usize, bool) {
    let mut script: Vec<(Part, &str)> = Vec::new();
    let mut first = 0;
    if open {
        match &stmts[0].kind {
            StatementKind::Begin(sql) => {
                script.push((Part::Proxy(Lead::Begin { client: true }), sql.as_str()));
                first = 1;
            }
            _ => script.push((
                Part::Proxy(Lead::Begin { client: false }),
                fence_sql::BEGIN_SQL,
            )),
        }
    }
    for s in body.iter().skip(first) {
        if need && !s.kind.guard_free() {
            if let Some(guard) = guard {
                script.push((Part::Proxy(Lead::Guard(Reading::FenceOnly)), guard));
            }
            need = false;
        }
        match script.last_mut() {
            Some((Part::Client(n), _)) => *n += 1,
            _ => script.push((Part::Client(1), "")),
        }
        if matches!(
            s.kind,
            StatementKind::RollbackTo
                | StatementKind::Setting {
                    touches_fence: true
                }
        ) {
            need = true;
        }
    }
    (script, first, need)
}

/// The text of a simple Query the proxy rewrote (see `Session::plan_simple`): the proxy's
/// statements of `script` and, for its client runs, the client's `body` statements from `first`
/// on, cut from `text` at the statement boundaries Postgres's parser reported (each right after
/// a `;`, where the lexer starts afresh); with the script as the upstream answers it and where
/// the client's text went. A run that starts the client's text keeps what comes before its
/// first statement.
fn rewrite(
    text: &str,
    stmts: &[Statement],
    body: &[Statement],
    first: usize,
    script: &[(Part, &str)],
) -> (String, VecDeque<Part>, Vec<Moved>) {
    let chars = |s: &str| i64::try_from(s.chars().count()).unwrap_or(i64::MAX);
    let end = stmts.get(body.len()).map_or(text.len(), |s| s.start);
    let mut sql = String::new();
    let mut sent = 0;
    let mut parts = VecDeque::with_capacity(script.len());
    let mut moved = Vec::new();
    let mut next = first;
    for (part, proxy_sql) in script {
        parts.push_back(*part);
        match part {
            Part::Proxy(_) => {
                sql.push_str(proxy_sql);
                sql.push_str("; ");
                sent += chars(proxy_sql) + 2;
            }
            Part::Client(n) => {
                let from = if next == 0 { 0 } else { body[next].start };
                let to = body.get(next + n).map_or(end, |s| s.start);
                let slice = &text[from..to];
                let len = chars(slice);
                moved.push(Moved {
                    sent,
                    original: chars(&text[..from]),
                    len,
                });
                sql.push_str(slice);
                sent += len;
                next += n;
            }
        }
    }
    (sql, parts, moved)
}

/// Whether a statement may change `lockd.fence` in a way that makes an earlier guard's reading
/// of it out of date (see `Session::unfenced_seen`): a SET or RESET that may reach it, or a
/// rollback, which undoes SETs. (A data statement calling `set_config` is not seen here; the
/// guard before its COMMIT reads what it set.)
fn forgets_unfenced(kind: &StatementKind) -> bool {
    matches!(
        kind,
        StatementKind::Setting {
            touches_fence: true
        } | StatementKind::Rollback { .. }
            | StatementKind::RollbackTo
    )
}

/// Column `index` of a DataRow body (`None` for SQL NULL or a malformed row).
pub(crate) fn data_row_column(body: &[u8], index: usize) -> Option<&[u8]> {
    let count = usize::from(u16::from_be_bytes(body.get(..2)?.try_into().ok()?));
    if index >= count {
        return None;
    }
    let mut rest = &body[2..];
    for i in 0..=index {
        let len = i32::from_be_bytes(rest.get(..4)?.try_into().ok()?);
        rest = &rest[4..];
        let Ok(len) = usize::try_from(len) else {
            if i == index {
                return None;
            }
            continue;
        };
        let value = rest.get(..len)?;
        if i == index {
            return Some(value);
        }
        rest = &rest[len..];
    }
    None
}

/// A Parse message of `sql` under the client's statement name (its raw bytes), with these
/// parameter types.
fn parse_frame(name: &[u8], sql: &str, param_types: &[u32]) -> Message {
    let mut body = Vec::with_capacity(name.len() + sql.len() + 4 + 4 * param_types.len());
    body.extend_from_slice(name);
    body.push(0);
    body.extend_from_slice(sql.as_bytes());
    body.push(0);
    // At most u16::MAX types: the decoder read them under a 16-bit count.
    let count = u16::try_from(param_types.len()).unwrap_or(u16::MAX);
    body.extend_from_slice(&count.to_be_bytes());
    for t in param_types.iter().take(usize::from(count)) {
        body.extend_from_slice(&t.to_be_bytes());
    }
    Message::new(b'P', &body)
}

/// Name and value of a ParameterStatus body.
fn parameter_status(body: &[u8]) -> Option<(String, String)> {
    let mut rest = body;
    let name = codec::read_cstr(&mut rest)?;
    let value = codec::read_cstr(&mut rest)?;
    Some((name, value))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Statements with the constructs that hide or fake a `;`: quotes, dollar quotes, quoted
    /// identifiers, comments, E'' escapes, BEGIN ATOMIC bodies, multi-action rules, DO blocks,
    /// non-ASCII text; and the kinds the script reacts to.
    const PIECES: &[&str] = &[
        "SELECT 1",
        "SELECT 'a;b', 'it''s; ok'",
        "SELECT $$x; y$$",
        "SELECT $t$ ; $$ ; $t$",
        r#"SELECT 1 AS "we;ird""#,
        "SELECT /* ; */ 2 -- ;\n",
        r"SELECT E'a\'b;'",
        "SELECT 'ü;ñ'",
        "INSERT INTO t VALUES (1)",
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql BEGIN ATOMIC SELECT 1; SELECT 2; END",
        "CREATE RULE r AS ON INSERT TO t DO ALSO (SELECT 1; SELECT 2)",
        "DO $$BEGIN PERFORM 1; END$$",
        "SAVEPOINT s",
        "RELEASE SAVEPOINT s",
        "ROLLBACK TO SAVEPOINT s",
        "SET lockd.fence = 'r:1'",
        "SET LOCAL statement_timeout = 5",
        "SHOW work_mem",
        "RESET ALL",
    ];
    const SEPARATORS: &[&str] = &["; ", ";\n-- c;\n", "; /* ; */ ", ";;", ";"];
    const GUARD: &str = "SELECT lockd_fence_proxy.g(false, NULL, false)";

    /// The text of statement `i` of `stmts` in `sql`, without its `;` and surrounding space.
    fn statement_text<'a>(sql: &'a str, stmts: &[Statement], i: usize) -> &'a str {
        let end = stmts.get(i + 1).map_or(sql.len(), |s| s.start);
        sql[stmts[i].start..end].trim().trim_end_matches(';').trim()
    }

    proptest! {
        /// The Query the proxy sends, read by Postgres's parser, has exactly the statements the
        /// script says, in its order: each of the proxy's where the script puts it, and the
        /// client's with their kinds. So the responses the proxy attributes by counting
        /// CommandCompletes are the ones it expects.
        #[test]
        fn spliced_statements_parse_where_the_script_puts_them(
            begin in any::<bool>(),
            picks in prop::collection::vec((0..PIECES.len(), 0..SEPARATORS.len()), 1..8),
            leading in prop::sample::select(vec!["", "  ", "/* lead; */ ", "-- lead;\n"]),
            trailing in prop::sample::select(vec!["", ";", "; -- tail", " /* t */"]),
            commit in any::<bool>(),
            open in any::<bool>(),
            need in any::<bool>(),
            guarded in any::<bool>(),
        ) {
            let mut text = String::from(leading);
            if begin {
                text.push_str("BEGIN ISOLATION LEVEL SERIALIZABLE; ");
            }
            for (i, (piece, sep)) in picks.iter().enumerate() {
                if i > 0 {
                    text.push_str(SEPARATORS[*sep]);
                }
                text.push_str(PIECES[*piece]);
            }
            if commit {
                text.push_str("; COMMIT");
            }
            text.push_str(trailing);
            let stmts = classify::classify(&text).unwrap();
            let body = if commit { &stmts[..stmts.len() - 1] } else { &stmts[..] };
            let guard = guarded.then_some(GUARD);
            let (script, first, _) = plan_script(&stmts, body, open, need || open, guard);
            let (sql, parts, _) = rewrite(&text, &stmts, body, first, &script);
            prop_assert_eq!(parts.iter().copied().collect::<Vec<_>>(),
                script.iter().map(|(p, _)| *p).collect::<Vec<_>>());
            let sent = classify::classify(&sql).unwrap();
            let mut at = 0;
            let mut client = first;
            for (part, proxy_sql) in &script {
                match part {
                    Part::Proxy(_) => {
                        prop_assert!(at < sent.len(), "{sql}");
                        prop_assert_eq!(statement_text(&sql, &sent, at), *proxy_sql, "{}", sql);
                        at += 1;
                    }
                    Part::Client(n) => {
                        for _ in 0..*n {
                            prop_assert!(at < sent.len(), "{sql}");
                            prop_assert_eq!(&sent[at].kind, &body[client].kind, "{}", sql);
                            prop_assert_eq!(
                                statement_text(&sql, &sent, at),
                                statement_text(&text, &stmts, client),
                                "{}", sql
                            );
                            at += 1;
                            client += 1;
                        }
                    }
                }
            }
            prop_assert_eq!(at, sent.len(), "{}", sql);
            prop_assert_eq!(client, body.len(), "{}", sql);
        }
    }
}
