//! One client session after authentication: relays messages both ways and fences every
//! transaction.
//!
//! The upstream answers messages strictly in order, so the session keeps a queue of the responses
//! it still expects ([`Pending`]). That is what lets it slip its own statements (the fence record,
//! the read-only guard) into the middle of an extended-protocol group and swallow exactly their
//! responses, while everything else reaches the client unchanged.
//!
//! Where the fence goes:
//! - simple Query, upstream idle: the proxy runs `BEGIN; <record>` first, forwards the query, then
//!   COMMITs (or ROLLs BACK after an error) unless the query opened a block of its own;
//! - simple Query inside a block whose fence is not recorded yet: `<record>` first;
//! - extended protocol: before the first data Execute of each transaction, a Parse/Bind/Execute
//!   of `<record>` under a name of the proxy's own, in the same implicit or explicit transaction.
//!
//! Transaction-control and session statements (BEGIN, SET TRANSACTION, SET, SHOW ...) are not
//! preceded by the record, so `BEGIN ISOLATION LEVEL ...` and `SET TRANSACTION` keep working.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use bytes::BytesMut;
use futures::StreamExt;
use lockd_fence::Fence;
use postgres_protocol::message::frontend;
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio_util::codec::FramedRead;
use tokio_util::sync::CancellationToken;

use crate::codec::{self, FrameError, Message, MessageCodec};
use crate::config::Config;
use crate::error::{self, ProxyError, ready_for_query};
use crate::fence_sql;
use crate::fence_value;
use crate::limits::MAX_TRACKED_STATEMENTS;
use crate::metrics_names::{RequestResult, record_request};
use crate::sql::{self, Kind};

/// Name of the prepared statement and portal the proxy uses for its own extended-protocol work.
/// The prefix keeps it apart from names drivers generate (`s0`, `sqlx_s_1`, `__asyncpg_...`).
const INTERNAL_NAME: &str = "__lockd_fence_proxy";

/// SQLSTATE of the warning Postgres gives for a BEGIN inside a block, which the proxy causes when
/// it wraps a multi-statement query that starts with BEGIN.
const ACTIVE_SQL_TRANSACTION: &str = "25001";

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

/// One expected response.
#[derive(Debug)]
struct Pending {
    unit: Unit,
    /// The proxy's own message: its responses are swallowed, its error goes to the client.
    internal: bool,
    /// A fence change that takes effect once this Execute completes.
    fence_change: Option<Option<Fence>>,
    /// For a simple Query the proxy wrapped in its own BEGIN: end the transaction afterwards.
    auto_end: bool,
    /// Drop the 25001 "already a transaction in progress" warning the wrap causes.
    suppress_begin_warning: bool,
}

impl Pending {
    fn new(unit: Unit) -> Self {
        Pending {
            unit,
            internal: false,
            fence_change: None,
            auto_end: false,
            suppress_begin_warning: false,
        }
    }

    fn internal(unit: Unit) -> Self {
        Pending {
            internal: true,
            ..Pending::new(unit)
        }
    }
}

/// Outcome of a simple query the proxy ran on its own.
struct InternalOutcome {
    status: u8,
    error: Option<Message>,
}

/// Whether the relay loop continues.
enum Flow {
    Continue,
    Close,
}

type ClientRx = FramedRead<OwnedReadHalf, MessageCodec>;
type Tx = BufWriter<OwnedWriteHalf>;

/// State of one client session and its upstream connection.
pub struct Session {
    cfg: Arc<Config>,
    client_rx: ClientRx,
    client_tx: Tx,
    up_rx: ClientRx,
    up_tx: Tx,
    /// Transaction status of the last ReadyForQuery (`I`, `T`, `E`), as the client saw it.
    status: u8,
    /// The fence as of the messages forwarded so far; decides what the next transaction records.
    fence: Option<Fence>,
    /// The fence as of the statements the upstream has completed; `fence` falls back to it when
    /// an error discards the rest of a group.
    confirmed_fence: Option<Fence>,
    /// Whether the current upstream transaction already holds the fence record (or the read-only
    /// guard), as of the messages forwarded so far.
    recorded: bool,
    /// Responses still owed by the upstream, oldest first.
    pending: VecDeque<Pending>,
    /// Kinds of prepared statements that are not data statements; absent means data.
    statements: HashMap<String, Kind>,
    /// Same for portals.
    portals: HashMap<String, Kind>,
    /// A Sync or Query was forwarded and its ReadyForQuery has not arrived: the client's next
    /// messages wait, so each request starts with a known transaction status.
    awaiting_ready: bool,
    /// The upstream is in COPY FROM STDIN and needs the client's CopyData although a request is
    /// outstanding.
    copy_in: bool,
    /// An error discarded the rest of the current extended-protocol group.
    group_failed: bool,
    /// When the outstanding request was forwarded.
    request_started: Option<Instant>,
    /// Worst outcome of the outstanding request so far.
    request_result: RequestResult,
}

impl Session {
    pub fn new(
        cfg: Arc<Config>,
        client_rx: ClientRx,
        client_tx: Tx,
        up_rx: ClientRx,
        up_tx: Tx,
        status: u8,
        fence: Option<Fence>,
    ) -> Self {
        Session {
            cfg,
            client_rx,
            client_tx,
            up_rx,
            up_tx,
            status,
            confirmed_fence: fence.clone(),
            fence,
            recorded: false,
            pending: VecDeque::new(),
            statements: HashMap::new(),
            portals: HashMap::new(),
            awaiting_ready: false,
            copy_in: false,
            group_failed: false,
            request_started: None,
            request_result: RequestResult::Ok,
        }
    }

    /// Relays until either side closes or `shutdown` fires.
    pub async fn run(mut self, shutdown: CancellationToken) -> anyhow::Result<()> {
        loop {
            let flow = tokio::select! {
                msg = self.client_rx.next(), if !self.awaiting_ready || self.copy_in => {
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
                () = shutdown.cancelled() => {
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
            // Flush a direction once its source has nothing more buffered, so a burst of rows is
            // written in few system calls.
            if self.up_rx.read_buffer().is_empty() {
                self.client_tx.flush().await?;
            }
            // While a request is outstanding the client's next messages stay unread, so what was
            // written upstream must go out now even if more client bytes are buffered.
            if self.client_rx.read_buffer().is_empty() || (self.awaiting_ready && !self.copy_in) {
                self.up_tx.flush().await?;
            }
        }
    }

    fn guarded(&self) -> bool {
        self.fence.is_some() || self.cfg.require_fence
    }

    /// The statement that guards a transaction: the fence record, or read-only without a fence.
    fn guard_sql(&self) -> String {
        match &self.fence {
            Some(f) => fence_sql::record_fence_sql(&self.cfg.fence_table, f),
            None => fence_sql::READ_ONLY_SQL.to_owned(),
        }
    }

    fn begin_request(&mut self) {
        self.awaiting_ready = true;
        self.request_started = Some(Instant::now());
        self.request_result = RequestResult::Ok;
    }

    async fn send_upstream(&mut self, m: &Message) -> std::io::Result<()> {
        self.up_tx.write_all(&m.frame).await
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

    async fn on_client(&mut self, m: Message) -> anyhow::Result<Flow> {
        tracing::trace!(tag = %(m.tag as char), len = m.frame.len(), pending = self.pending.len(), "client message");
        match m.tag {
            b'Q' => self.simple_query(m).await,
            b'P' => self.parse(m).await,
            b'B' => self.bind(m).await,
            b'E' => self.execute(m).await,
            b'D' => {
                self.pending.push_back(Pending::new(Unit::Describe));
                self.send_upstream(&m).await?;
                Ok(Flow::Continue)
            }
            b'C' => {
                let mut body = m.body();
                if let Some((&variant, rest)) = body.split_first() {
                    body = rest;
                    if let Some(name) = codec::read_cstr(&mut body) {
                        match variant {
                            b'S' => self.statements.remove(&name),
                            _ => self.portals.remove(&name),
                        };
                    }
                }
                self.pending.push_back(Pending::new(Unit::Close));
                self.send_upstream(&m).await?;
                Ok(Flow::Continue)
            }
            b'S' => {
                self.pending.push_back(Pending::new(Unit::Ready));
                self.begin_request();
                self.send_upstream(&m).await?;
                Ok(Flow::Continue)
            }
            b'F' => {
                if self.guarded() {
                    return self
                        .reject_request(ProxyError::error(
                            error::NOT_SUPPORTED,
                            "the FunctionCall message (fast-path function call) cannot be fenced; call the function with SELECT instead",
                        ))
                        .await;
                }
                self.pending.push_back(Pending::new(Unit::Ready));
                self.begin_request();
                self.send_upstream(&m).await?;
                Ok(Flow::Continue)
            }
            b'X' => Ok(Flow::Close),
            // Flush, CopyData, CopyDone, CopyFail and anything unknown: the upstream decides.
            _ => {
                self.send_upstream(&m).await?;
                Ok(Flow::Continue)
            }
        }
    }

    /// Sets the fence (projected and confirmed) after a simple-protocol SET/RESET.
    fn apply_fence_now(&mut self, fence: Option<Fence>) {
        self.fence = fence.clone();
        self.confirmed_fence = fence;
        self.recorded = false;
    }

    async fn simple_query(&mut self, m: Message) -> anyhow::Result<Flow> {
        let mut body = m.body();
        let sql_text = codec::read_cstr(&mut body).unwrap_or_default();
        let Some(kinds) = sql::classify_query(&sql_text) else {
            return self
                .reject_request(ProxyError::error(
                    error::LIMIT_EXCEEDED,
                    format!(
                        "query has more than {} statements",
                        crate::limits::MAX_STATEMENTS_PER_QUERY
                    ),
                ))
                .await;
        };

        let fence_statements = kinds
            .iter()
            .filter(|k| matches!(k, Kind::FenceSet(_) | Kind::FenceLocal))
            .count();
        if kinds.contains(&Kind::FenceLocal) {
            return self
                .reject_request(
                    ProxyError::error(
                        error::NOT_SUPPORTED,
                        "SET LOCAL lockd.fence is not supported: the fence is a session setting",
                    )
                    .with_hint("use SET lockd.fence = '<resource>:<token>'"),
                )
                .await;
        }
        if fence_statements > 0 && kinds.len() > 1 {
            return self
                .reject_request(ProxyError::error(
                    error::NOT_SUPPORTED,
                    format!(
                        "SET/RESET lockd.fence must be sent as a query of its own, not with {} other statement(s)",
                        kinds.len() - 1
                    ),
                ))
                .await;
        }
        if let [Kind::FenceSet(value)] = kinds.as_slice() {
            let fence = match value {
                None => None,
                Some(v) if v.is_empty() && fence_statements == 1 => {
                    return self
                        .reject_request(
                            ProxyError::error(
                                error::BAD_FENCE,
                                format!("cannot read a single lockd.fence value from {sql_text:?}"),
                            )
                            .with_hint("SET lockd.fence = '<resource>:<token>'"),
                        )
                        .await;
                }
                Some(v) => match fence_value::parse(v) {
                    Ok(f) => Some(f),
                    Err(e) => return self.reject_request(e).await,
                },
            };
            // In a failed transaction the upstream refuses the SET too; keep the state alike.
            if self.status != b'E' {
                self.apply_fence_now(fence);
            }
            return self.forward_query(m, Pending::new(Unit::Ready)).await;
        }
        if kinds.contains(&Kind::ResetAll) && self.status != b'E' {
            self.apply_fence_now(None);
        }

        let mut ready = Pending::new(Unit::Ready);
        let has_data = kinds.contains(&Kind::Data);
        if self.guarded() && has_data && self.status != b'E' {
            let first_end = kinds
                .iter()
                .position(|k| matches!(k, Kind::TxnEnd | Kind::RollbackTo));
            if let Some(end) = first_end
                && kinds[end..].contains(&Kind::Data)
            {
                return self
                    .reject_request(ProxyError::error(
                        error::NOT_SUPPORTED,
                        "in a fenced session, a statement may not follow COMMIT, ROLLBACK or ROLLBACK TO SAVEPOINT in the same query: it would run without the fence",
                    ).with_hint("send the statements after the transaction end as a separate query"))
                    .await;
            }
            if !self.pending.is_empty() {
                return self
                    .reject_request(ProxyError::error(
                        error::PROTOCOL_VIOLATION,
                        "simple Query received while an extended-protocol group is open; send Sync first",
                    ))
                    .await;
            }
            if self.status == b'I' {
                let guard = format!("BEGIN; {}", self.guard_sql());
                let outcome = self.run_internal(&guard).await?;
                if let Some(err) = outcome.error {
                    if outcome.status != b'I' {
                        self.run_internal("ROLLBACK").await?;
                    }
                    return self.fail_request(err, b'I').await;
                }
                // A query that opens a block of its own keeps it (and its failed state after an
                // error), as it would directly; otherwise the proxy ends its wrapper block.
                ready.auto_end = !kinds.contains(&Kind::TxnStart);
                ready.suppress_begin_warning = kinds.contains(&Kind::TxnStart);
            } else if !self.recorded {
                let guard = self.guard_sql();
                let outcome = self.run_internal(&guard).await?;
                if let Some(err) = outcome.error {
                    return self.fail_request(err, outcome.status).await;
                }
            }
            self.recorded = true;
        }
        if kinds
            .iter()
            .any(|k| matches!(k, Kind::TxnEnd | Kind::RollbackTo))
        {
            self.recorded = false;
        }
        self.forward_query(m, ready).await
    }

    async fn forward_query(&mut self, m: Message, ready: Pending) -> anyhow::Result<Flow> {
        self.pending.push_back(ready);
        self.begin_request();
        self.send_upstream(&m).await?;
        Ok(Flow::Continue)
    }

    /// Ends a request whose guard statement failed: the client gets the upstream's error (55P03
    /// for a stale token) and the resulting status; its own query never ran.
    async fn fail_request(&mut self, err: Message, status: u8) -> anyhow::Result<Flow> {
        let stale = error::error_code(err.body()).as_deref() == Some(error::STALE_TOKEN);
        self.status = status;
        self.recorded = false;
        self.send_client(&err).await?;
        self.send_client(&ready_for_query(status)).await?;
        self.client_tx.flush().await?;
        record_request(
            if stale {
                RequestResult::Stale
            } else {
                RequestResult::Error
            },
            None,
        );
        Ok(Flow::Continue)
    }

    /// Runs a simple query of the proxy's own while no client request is outstanding, swallowing
    /// its results; notices and asynchronous messages still reach the client.
    async fn run_internal(&mut self, sql_text: &str) -> anyhow::Result<InternalOutcome> {
        debug_assert!(self.pending.is_empty());
        let mut buf = BytesMut::new();
        frontend::query(sql_text, &mut buf)?;
        self.up_tx.write_all(&buf).await?;
        self.up_tx.flush().await?;
        let mut error = None;
        loop {
            let m = match self.up_rx.next().await {
                Some(Ok(m)) => m,
                Some(Err(e)) => anyhow::bail!("upstream {}: {e}", self.cfg.upstream_addr),
                None => anyhow::bail!(
                    "upstream {} closed the connection during the fence statement",
                    self.cfg.upstream_addr
                ),
            };
            match m.tag {
                b'Z' => {
                    let status = m.body().first().copied().unwrap_or(b'I');
                    return Ok(InternalOutcome { status, error });
                }
                b'E' => error = Some(m),
                b'S' | b'A' => self.send_client(&m).await?,
                _ => {}
            }
        }
    }

    async fn parse(&mut self, m: Message) -> anyhow::Result<Flow> {
        let mut body = m.body();
        let name = codec::read_cstr(&mut body).unwrap_or_default();
        let text = codec::read_cstr(&mut body).unwrap_or_default();
        let mut kind = sql::classify_statement(&text);
        let refusal = match &kind {
            Kind::FenceLocal => Some(ProxyError::error(
                error::NOT_SUPPORTED,
                "SET LOCAL lockd.fence is not supported: the fence is a session setting",
            )),
            Kind::FenceSet(Some(v)) if v.is_empty() => Some(ProxyError::error(
                error::BAD_FENCE,
                format!("cannot read a single lockd.fence value from {text:?}"),
            )),
            Kind::FenceSet(Some(v)) => fence_value::parse(v).err(),
            _ => None,
        };
        let forwarded = match refusal {
            // The refusal must arrive in the upstream's response order, so the statement is
            // replaced by one that raises the proxy's error when executed.
            Some(e) => {
                kind = Kind::Session;
                let mut buf = BytesMut::new();
                frontend::parse(
                    &name,
                    &fence_sql::raise_sql(e.code, &e.message),
                    std::iter::empty(),
                    &mut buf,
                )?;
                Message {
                    tag: b'P',
                    frame: buf.freeze(),
                }
            }
            None => m,
        };
        if let Some(reply) = track(&mut self.statements, name, kind) {
            return self.refuse_in_group(reply).await;
        }
        self.pending.push_back(Pending::new(Unit::Parse));
        self.send_upstream(&forwarded).await?;
        Ok(Flow::Continue)
    }

    async fn bind(&mut self, m: Message) -> anyhow::Result<Flow> {
        let mut body = m.body();
        let portal = codec::read_cstr(&mut body).unwrap_or_default();
        let statement = codec::read_cstr(&mut body).unwrap_or_default();
        let kind = self
            .statements
            .get(&statement)
            .cloned()
            .unwrap_or(Kind::Data);
        if let Some(reply) = track(&mut self.portals, portal, kind) {
            return self.refuse_in_group(reply).await;
        }
        self.pending.push_back(Pending::new(Unit::Bind));
        self.send_upstream(&m).await?;
        Ok(Flow::Continue)
    }

    async fn execute(&mut self, m: Message) -> anyhow::Result<Flow> {
        let mut body = m.body();
        let portal = codec::read_cstr(&mut body).unwrap_or_default();
        let kind = self.portals.get(&portal).cloned().unwrap_or(Kind::Data);
        let mut pending = Pending::new(Unit::Execute);
        match kind {
            Kind::Data if self.guarded() && !self.recorded && !self.group_failed => {
                self.inject_guard().await?;
                self.recorded = true;
            }
            Kind::TxnEnd | Kind::RollbackTo => self.recorded = false,
            Kind::FenceSet(value) => {
                // Validated at Parse; a failure there replaced the statement.
                let fence = value.and_then(|v| fence_value::parse(&v).ok());
                self.fence = fence.clone();
                self.recorded = false;
                pending.fence_change = Some(fence);
            }
            Kind::ResetAll => {
                self.fence = None;
                self.recorded = false;
                pending.fence_change = Some(None);
            }
            _ => {}
        }
        self.pending.push_back(pending);
        self.send_upstream(&m).await?;
        Ok(Flow::Continue)
    }

    /// Sends the guard statement as Close/Parse/Bind/Execute/Close under the proxy's own name, so
    /// the client's unnamed statement and portal stay intact. The first Close clears a statement
    /// left over when an earlier guard failed before its final Close ran.
    async fn inject_guard(&mut self) -> anyhow::Result<()> {
        let sql_text = self.guard_sql();
        let mut buf = BytesMut::new();
        frontend::close(b'S', INTERNAL_NAME, &mut buf)?;
        frontend::parse(INTERNAL_NAME, &sql_text, std::iter::empty(), &mut buf)?;
        frontend::bind(
            INTERNAL_NAME,
            INTERNAL_NAME,
            std::iter::empty(),
            std::iter::empty::<()>(),
            |(), _| Ok(postgres_protocol::IsNull::No),
            std::iter::empty(),
            &mut buf,
        )
        .map_err(|_| anyhow::anyhow!("encoding the fence Bind message"))?;
        frontend::execute(INTERNAL_NAME, 0, &mut buf)?;
        frontend::close(b'S', INTERNAL_NAME, &mut buf)?;
        for unit in [
            Unit::Close,
            Unit::Parse,
            Unit::Bind,
            Unit::Execute,
            Unit::Close,
        ] {
            self.pending.push_back(Pending::internal(unit));
        }
        self.up_tx.write_all(&buf).await?;
        Ok(())
    }

    /// A limit hit in the middle of an extended-protocol group: the session cannot keep its
    /// response order, so it ends with a FATAL error.
    async fn refuse_in_group(&mut self, e: ProxyError) -> anyhow::Result<Flow> {
        let e = ProxyError { fatal: true, ..e };
        self.send_client(&e.to_message()).await?;
        record_request(RequestResult::Rejected, None);
        Ok(Flow::Close)
    }

    async fn on_upstream(&mut self, m: Message) -> anyhow::Result<Flow> {
        tracing::trace!(tag = %(m.tag as char), len = m.frame.len(), pending = self.pending.len(), "upstream message");
        match m.tag {
            b'Z' => return self.on_ready(m).await,
            b'E' => {
                let internal = self.pending.front().is_some_and(|p| p.internal);
                let code = error::error_code(m.body());
                let result = if internal && code.as_deref() == Some(error::STALE_TOKEN) {
                    RequestResult::Stale
                } else {
                    RequestResult::Error
                };
                if self.request_result == RequestResult::Ok {
                    self.request_result = result;
                }
                // The upstream skips everything up to the next Sync; so do the expectations.
                while self.pending.front().is_some_and(|p| p.unit != Unit::Ready) {
                    self.pending.pop_front();
                }
                self.group_failed = true;
                self.copy_in = false;
                self.fence = self.confirmed_fence.clone();
                self.send_client(&m).await?;
            }
            b'N' => {
                let suppress = self
                    .pending
                    .front()
                    .is_some_and(|p| p.suppress_begin_warning)
                    && error::error_code(m.body()).as_deref() == Some(ACTIVE_SQL_TRANSACTION);
                if !suppress {
                    self.send_client(&m).await?;
                }
            }
            b'S' | b'A' => self.send_client(&m).await?,
            b'G' | b'W' => {
                self.copy_in = true;
                self.send_client(&m).await?;
            }
            tag => {
                let front = self.pending.front();
                let internal = front.is_some_and(|p| p.internal);
                if let Some(front) = front
                    && front.unit.completed_by(tag)
                {
                    let done = self.pending.pop_front().expect("front exists");
                    if let Some(change) = done.fence_change {
                        self.confirmed_fence = change;
                    }
                }
                if tag == b'C' {
                    self.copy_in = false;
                }
                if !internal {
                    self.send_client(&m).await?;
                }
            }
        }
        Ok(Flow::Continue)
    }

    async fn on_ready(&mut self, m: Message) -> anyhow::Result<Flow> {
        let mut status = m.body().first().copied().unwrap_or(b'I');
        // Everything before the Ready unit was skipped by an error or answered already.
        let mut ready = None;
        while let Some(p) = self.pending.pop_front() {
            if p.unit == Unit::Ready {
                ready = Some(p);
                break;
            }
        }
        self.copy_in = false;
        self.group_failed = false;
        self.fence = self.confirmed_fence.clone();
        if ready.as_ref().is_some_and(|r| r.auto_end) && status != b'I' {
            let end = if status == b'T' { "COMMIT" } else { "ROLLBACK" };
            let outcome = self.run_internal(end).await?;
            if let Some(err) = outcome.error {
                if self.request_result == RequestResult::Ok {
                    self.request_result = RequestResult::Error;
                }
                self.send_client(&err).await?;
            }
            status = outcome.status;
        }
        if status == b'I' {
            self.recorded = false;
            self.portals.clear();
        }
        self.status = status;
        self.send_client(&ready_for_query(status)).await?;
        if ready.is_some() {
            self.awaiting_ready = false;
            record_request(
                self.request_result,
                self.request_started.take().map(|t| t.elapsed()),
            );
        }
        Ok(Flow::Continue)
    }
}

/// Remembers the kind of a statement or portal name; data statements are the default and are not
/// stored. Returns an error when the map is full.
fn track(map: &mut HashMap<String, Kind>, name: String, kind: Kind) -> Option<ProxyError> {
    if kind == Kind::Data {
        map.remove(&name);
        return None;
    }
    if map.len() >= MAX_TRACKED_STATEMENTS && !map.contains_key(&name) {
        return Some(ProxyError::error(
            error::LIMIT_EXCEEDED,
            format!(
                "more than {MAX_TRACKED_STATEMENTS} prepared transaction-control or session statements in one session (at {name:?})"
            ),
        ));
    }
    map.insert(name, kind);
    None
}
