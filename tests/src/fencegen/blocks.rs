//! The attacker's building blocks: each [`Block`] kind has one generator that appends wire steps
//! to a session and updates what the generator believes the session's fence is. Adding an attack
//! is one enum variant and one function.

use rand::RngExt;
use rand::rngs::StdRng;

/// One message (or a group that must stay together) the attacker sends.
#[derive(Clone, Debug)]
pub enum Step {
    /// Simple query protocol: one Query message, possibly several statements.
    Query(String),
    /// Extended protocol.
    Parse {
        name: String,
        sql: String,
    },
    Bind {
        portal: String,
        statement: String,
    },
    Execute {
        portal: String,
    },
    Sync,
    Flush,
    /// COPY FROM STDIN payload, sent right after the COPY query without waiting.
    CopyData(Vec<u8>),
    /// Bytes sent as they are: a frame no driver would build (a field too many, a count that
    /// does not match). Never counted as expecting a ReadyForQuery.
    Raw(Vec<u8>),
    CopyDone,
    /// A CancelRequest for the session's own backend, sent on a connection of its own this many
    /// microseconds after the messages that follow it in the same batch were written.
    Cancel {
        delay_us: u64,
    },
}

/// What the generator believes the session's `lockd.fence` is when a write runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// Certainly a fence of the case's resource with this (stale) token.
    Stale(i64),
    /// Certainly no fence.
    Unfenced,
    /// Could be either (a clear or a set that a rollback may have undone).
    Unknown,
}

impl Claim {
    /// The `token_claimed` column: the token, 0 for unfenced, -1 when unknown.
    pub fn column(self) -> i64 {
        match self {
            Claim::Stale(t) => t,
            Claim::Unfenced => 0,
            Claim::Unknown => -1,
        }
    }
}

/// Everything a block generator needs about its case.
pub struct Ctx<'a> {
    pub rng: &'a mut StdRng,
    pub case_id: i64,
    pub resource: &'a str,
    /// The holder's token T, recorded before the attacker starts. Attackers only ever claim less.
    pub holder_token: i64,
    /// Schema-qualified data table, write function and procedure.
    pub data_table: &'a str,
    pub write_fn: &'a str,
    pub proc_name: &'a str,
    /// Unqualified name of the fence table, for shadowing it with a temporary table.
    pub fence_table_base: &'a str,
    pub gid_prefix: &'a str,
    pub claim: Claim,
    /// Counter for unique statement, cursor and savepoint names within the session.
    pub names: u32,
    pub steps: Vec<Step>,
}

impl Ctx<'_> {
    fn name(&mut self, prefix: &str) -> String {
        self.names += 1;
        format!("{prefix}{}", self.names)
    }

    /// One INSERT of a row claiming the current fence.
    fn write(&self) -> String {
        format!(
            "INSERT INTO {} (case_id, resource, token_claimed, session_kind) VALUES ({}, '{}', {}, 'attacker')",
            self.data_table,
            self.case_id,
            self.resource,
            self.claim.column()
        )
    }

    fn fn_call(&self) -> String {
        format!(
            "{}({}, '{}', {}, 'attacker')",
            self.write_fn,
            self.case_id,
            self.resource,
            self.claim.column()
        )
    }

    fn q(&mut self, sql: impl Into<String>) {
        self.steps.push(Step::Query(sql.into()));
    }

    fn extended(&mut self, sql: impl Into<String>, sync: bool) {
        self.steps.push(Step::Parse {
            name: String::new(),
            sql: sql.into(),
        });
        self.steps.push(Step::Bind {
            portal: String::new(),
            statement: String::new(),
        });
        self.steps.push(Step::Execute {
            portal: String::new(),
        });
        if sync {
            self.steps.push(Step::Sync);
        }
    }

    /// A stale token for the case's resource: T-1 or T-2 (never T or more).
    fn stale_token(&mut self) -> i64 {
        self.holder_token - self.rng.random_range(1..=2)
    }

    /// After a statement that sets a stale fence which may fail or be rolled back.
    fn after_set(&mut self, token: i64) {
        self.claim = match self.claim {
            Claim::Stale(_) => Claim::Stale(token),
            _ => Claim::Unknown,
        };
    }

    /// After a statement that may clear the fence.
    fn after_clear(&mut self) {
        if self.claim != Claim::Unfenced {
            self.claim = Claim::Unknown;
        }
    }
}

/// The kinds of building blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Block {
    SimpleWrite,
    ExtendedWrite,
    PipelineWithoutSync,
    MultiStatement,
    Transaction,
    Savepoints,
    ErrorInBlock,
    CommitAndChain,
    PrepareTransaction,
    DoWithCommit,
    CallWithCommit,
    SqlPrepareReuse,
    StatementNameReuse,
    PreparedControl,
    HoldCursor,
    WritableCte,
    FunctionFromSelect,
    CopyIn,
    SetFence,
    ClearFence,
    SearchPath,
    ConformingStrings,
    OddQuoting,
    ShadowFenceTable,
    Interrupted,
    CodeAtParse,
    ExecuteControl,
    MalformedFrame,
    InternalNames,
}

/// Every block kind, for drawing at random.
pub const ALL: [Block; 29] = [
    Block::SimpleWrite,
    Block::ExtendedWrite,
    Block::PipelineWithoutSync,
    Block::MultiStatement,
    Block::Transaction,
    Block::Savepoints,
    Block::ErrorInBlock,
    Block::CommitAndChain,
    Block::PrepareTransaction,
    Block::DoWithCommit,
    Block::CallWithCommit,
    Block::SqlPrepareReuse,
    Block::StatementNameReuse,
    Block::PreparedControl,
    Block::HoldCursor,
    Block::WritableCte,
    Block::FunctionFromSelect,
    Block::CopyIn,
    Block::SetFence,
    Block::ClearFence,
    Block::SearchPath,
    Block::ConformingStrings,
    Block::OddQuoting,
    Block::ShadowFenceTable,
    Block::Interrupted,
    Block::CodeAtParse,
    Block::ExecuteControl,
    Block::MalformedFrame,
    Block::InternalNames,
];

impl Block {
    /// Appends this block's steps to the session.
    pub fn generate(self, c: &mut Ctx<'_>) {
        match self {
            Block::SimpleWrite => simple_write(c),
            Block::ExtendedWrite => extended_write(c),
            Block::PipelineWithoutSync => pipeline_without_sync(c),
            Block::MultiStatement => multi_statement(c),
            Block::Transaction => transaction(c),
            Block::Savepoints => savepoints(c),
            Block::ErrorInBlock => error_in_block(c),
            Block::CommitAndChain => commit_and_chain(c),
            Block::PrepareTransaction => prepare_transaction(c),
            Block::DoWithCommit => do_with_commit(c),
            Block::CallWithCommit => call_with_commit(c),
            Block::SqlPrepareReuse => sql_prepare_reuse(c),
            Block::StatementNameReuse => statement_name_reuse(c),
            Block::PreparedControl => prepared_control(c),
            Block::HoldCursor => hold_cursor(c),
            Block::WritableCte => writable_cte(c),
            Block::FunctionFromSelect => function_from_select(c),
            Block::CopyIn => copy_in(c),
            Block::SetFence => set_fence(c),
            Block::ClearFence => clear_fence(c),
            Block::SearchPath => search_path(c),
            Block::ConformingStrings => conforming_strings(c),
            Block::OddQuoting => odd_quoting(c),
            Block::ShadowFenceTable => shadow_fence_table(c),
            Block::Interrupted => interrupted(c),
            Block::CodeAtParse => code_at_parse(c),
            Block::ExecuteControl => execute_control(c),
            Block::MalformedFrame => malformed_frame(c),
            Block::InternalNames => internal_names(c),
        }
    }
}

/// Interrupts around a write: a CancelRequest for the session's own backend landing anywhere in
/// the proxy's statements or the client's (up to 1.5 ms after the messages were written), or a
/// `statement_timeout` of 1 ms, which expires on its own while the machine is busy. Whatever
/// they fail, the client's statements must fail with it, never run outside the guarded block.
fn interrupted(c: &mut Ctx<'_>) {
    let w = c.write();
    let delay_us = c.rng.random_range(0..1500);
    match c.rng.random_range(0..4) {
        0 => {
            c.steps.push(Step::Cancel { delay_us });
            c.q(w);
        }
        1 => {
            c.steps.push(Step::Cancel { delay_us });
            c.extended(w, true);
        }
        2 => {
            c.steps.push(Step::Cancel { delay_us });
            c.q(format!("BEGIN; {w}; COMMIT"));
        }
        _ => {
            c.q("SET statement_timeout = 1");
            c.q(w);
            c.q("RESET statement_timeout");
        }
    }
}

fn simple_write(c: &mut Ctx<'_>) {
    let w = c.write();
    c.q(w);
}

fn extended_write(c: &mut Ctx<'_>) {
    let w = c.write();
    c.extended(w, true);
}

/// Extended-protocol messages pipelined without Sync (and sometimes with a Flush), followed by
/// more of them; the next block or the session's end syncs.
fn pipeline_without_sync(c: &mut Ctx<'_>) {
    let w = c.write();
    c.extended("SELECT 1", false);
    c.extended(w, false);
    if c.rng.random_bool(0.5) {
        c.steps.push(Step::Flush);
    }
    if c.rng.random_bool(0.5) {
        c.extended("COMMIT", false);
    }
}

fn multi_statement(c: &mut Ctx<'_>) {
    let w = c.write();
    let sql = match c.rng.random_range(0..3) {
        0 => format!("SELECT 1; {w}; SELECT 2"),
        1 => format!("{w}; {w}"),
        _ => format!("BEGIN; {w}; COMMIT; {w}"),
    };
    c.q(sql);
}

fn transaction(c: &mut Ctx<'_>) {
    let w = c.write();
    let begin = [
        "BEGIN",
        "START TRANSACTION",
        "BEGIN ISOLATION LEVEL SERIALIZABLE",
    ][c.rng.random_range(0..3)];
    let end = ["COMMIT", "END", "ROLLBACK", "COMMIT WORK"][c.rng.random_range(0..4)];
    if c.rng.random_bool(0.5) {
        c.q(begin);
        c.q(w);
        c.q(end);
    } else {
        c.extended(begin, false);
        c.extended(w, false);
        c.extended(end, true);
    }
}

fn savepoints(c: &mut Ctx<'_>) {
    let w = c.write();
    let s = c.name("s");
    let tail = [
        format!("RELEASE SAVEPOINT {s}"),
        format!("ROLLBACK TO SAVEPOINT {s}; {w}"),
        format!("ROLLBACK TO {s}"),
    ][c.rng.random_range(0..3)]
    .clone();
    c.q(format!("BEGIN; SAVEPOINT {s}; {w}; {tail}; COMMIT"));
}

/// A failed block: an error aborts the block, then ROLLBACK (or ROLLBACK TO) and a write in
/// the same Query.
fn error_in_block(c: &mut Ctx<'_>) {
    let w = c.write();
    match c.rng.random_range(0..3) {
        0 => {
            c.q("BEGIN");
            c.q("SELECT 1/0");
            c.q(format!("ROLLBACK; {w}"));
        }
        1 => {
            let s = c.name("s");
            c.q(format!("BEGIN; SAVEPOINT {s}"));
            c.q("SELECT 1/0");
            c.q(format!("ROLLBACK TO SAVEPOINT {s}; {w}"));
            c.q("COMMIT");
        }
        _ => {
            c.q("BEGIN");
            c.extended("SELECT 1/0", true);
            c.extended("ROLLBACK", false);
            c.extended(w, true);
        }
    }
}

fn commit_and_chain(c: &mut Ctx<'_>) {
    let w = c.write();
    c.q(format!("BEGIN; {w}; COMMIT AND CHAIN; {w}; COMMIT"));
}

fn prepare_transaction(c: &mut Ctx<'_>) {
    let w = c.write();
    let gid = format!("{}_{}_{}", c.gid_prefix, c.case_id, c.names);
    c.names += 1;
    c.q(format!("BEGIN; {w}; PREPARE TRANSACTION '{gid}'"));
    c.q(format!("COMMIT PREPARED '{gid}'"));
}

/// COMMIT inside DO, over the extended protocol (and the simple one).
fn do_with_commit(c: &mut Ctx<'_>) {
    let w = c.write();
    let body = format!("DO $$ BEGIN {w}; COMMIT; {w}; END $$");
    if c.rng.random_bool(0.5) {
        c.extended(body, true);
    } else {
        c.q(body);
    }
}

fn call_with_commit(c: &mut Ctx<'_>) {
    let call = format!(
        "CALL {}({}, '{}', {})",
        c.proc_name,
        c.case_id,
        c.resource,
        c.claim.column()
    );
    if c.rng.random_bool(0.5) {
        c.extended(call, true);
    } else {
        c.q(call);
    }
}

/// A statement kind gone stale (SQL): a protocol statement name prepared as harmless, deallocated
/// in SQL and prepared again in SQL as a write, then bound and executed by name.
fn sql_prepare_reuse(c: &mut Ctx<'_>) {
    let w = c.write();
    let s = c.name("gs");
    c.steps.push(Step::Parse {
        name: s.clone(),
        sql: "SHOW work_mem".into(),
    });
    c.steps.push(Step::Sync);
    c.q(format!("DEALLOCATE {s}"));
    c.q(format!("PREPARE {s} AS {w}"));
    if c.rng.random_bool(0.5) {
        c.steps.push(Step::Bind {
            portal: String::new(),
            statement: s.clone(),
        });
        c.steps.push(Step::Execute {
            portal: String::new(),
        });
        c.steps.push(Step::Sync);
    } else {
        c.q(format!("EXECUTE {s}"));
    }
    if c.rng.random_bool(0.5) {
        let deallocate = if c.rng.random_bool(0.5) {
            "DEALLOCATE ALL".to_owned()
        } else {
            format!("DEALLOCATE PREPARE {s}")
        };
        c.q(deallocate);
    }
}

/// Transaction control as named prepared statements (pgbench `-M prepared`, pgjdbc), which the
/// proxy runs in the client's place (BEGIN at `I`) or checks by tag (COMMIT), sometimes
/// redefined in SQL behind the proxy's back: the BEGIN as a write, the COMMIT as a write or as a
/// `set_config` of a stale fence; then a transaction through the names and a write after it.
fn prepared_control(c: &mut Ctx<'_>) {
    let w = c.write();
    let b = c.name("gb");
    let e = c.name("ge");
    let begin = [
        "BEGIN",
        "START TRANSACTION",
        "BEGIN ISOLATION LEVEL REPEATABLE READ",
    ][c.rng.random_range(0..3)];
    let end = ["COMMIT", "END", "COMMIT AND CHAIN", "ROLLBACK"][c.rng.random_range(0..4)];
    for (name, sql) in [(&b, begin), (&e, end)] {
        c.steps.push(Step::Parse {
            name: name.clone(),
            sql: sql.into(),
        });
    }
    c.steps.push(Step::Sync);
    match c.rng.random_range(0..4) {
        0 => c.q(format!("DEALLOCATE {b}; PREPARE {b} AS {w}")),
        1 => c.q(format!("DEALLOCATE {e}; PREPARE {e} AS {w}")),
        2 => {
            let t = c.stale_token();
            c.q(format!(
                "DEALLOCATE {e}; PREPARE {e} AS SELECT set_config('lockd.fence', '{}:{t}', false)",
                c.resource
            ));
            // Whether it ran (and stuck) depends on what came before: from here on the claim
            // of later writes is unknown unless the session was already stale.
            c.after_set(t);
        }
        _ => {}
    }
    let named = |c: &mut Ctx<'_>, statement: &str| {
        c.steps.push(Step::Bind {
            portal: String::new(),
            statement: statement.to_owned(),
        });
        c.steps.push(Step::Execute {
            portal: String::new(),
        });
    };
    named(c, &b);
    c.extended(w.clone(), false);
    named(c, &e);
    c.steps.push(Step::Sync);
    if c.rng.random_bool(0.5) {
        c.extended(w, true);
    } else {
        c.q(w);
    }
}

/// A statement kind gone stale (Parse): Parse a name as a write, then Parse the same name as a read
/// (refused by Postgres with 42P05), then execute it.
fn statement_name_reuse(c: &mut Ctx<'_>) {
    let w = c.write();
    let s = c.name("gn");
    c.steps.push(Step::Parse {
        name: s.clone(),
        sql: w,
    });
    c.steps.push(Step::Sync);
    c.steps.push(Step::Parse {
        name: s.clone(),
        sql: "SHOW work_mem".into(),
    });
    c.steps.push(Step::Sync);
    c.steps.push(Step::Bind {
        portal: String::new(),
        statement: s,
    });
    c.steps.push(Step::Execute {
        portal: String::new(),
    });
    c.steps.push(Step::Sync);
}

fn hold_cursor(c: &mut Ctx<'_>) {
    let cur = c.name("gc");
    let call = c.fn_call();
    c.q(format!(
        "BEGIN; DECLARE {cur} CURSOR WITH HOLD FOR SELECT {call}; COMMIT"
    ));
    c.q(format!("FETCH ALL FROM {cur}; CLOSE {cur}"));
}

fn writable_cte(c: &mut Ctx<'_>) {
    let w = c.write();
    let sql = format!("WITH w AS ({w} RETURNING 1) SELECT count(*) FROM w");
    if c.rng.random_bool(0.5) {
        c.q(sql);
    } else {
        c.extended(sql, true);
    }
}

fn function_from_select(c: &mut Ctx<'_>) {
    let call = c.fn_call();
    let sql = match c.rng.random_range(0..3) {
        0 => format!("SELECT {call}"),
        1 => format!("SELECT 1 FROM (SELECT {call}) AS t"),
        _ => format!("VALUES ({call})"),
    };
    if c.rng.random_bool(0.5) {
        c.q(sql);
    } else {
        c.extended(sql, true);
    }
}

/// User code run by a Parse (and its Bind) alone, with no Execute: the elements of an array of
/// a domain are checked as the literal is parsed, and this domain's CHECK writes a row (the
/// run's `<write_fn>_dom`, whose function reads `case|resource|claim` from the value). At status
/// I the server runs it in an implicit transaction that the Sync commits.
fn code_at_parse(c: &mut Ctx<'_>) {
    let payload = format!("{}|{}|{}", c.case_id, c.resource, c.claim.column());
    let sql = format!("SELECT '{{\"{payload}\"}}'::{}_dom[]", c.write_fn);
    let name = c.name("cp");
    c.steps.push(Step::Parse {
        name: name.clone(),
        sql,
    });
    if c.rng.random_bool(0.5) {
        c.steps.push(Step::Bind {
            portal: String::new(),
            statement: name,
        });
    }
    c.steps.push(Step::Sync);
}

/// Transaction control prepared through the extended protocol and run with SQL `EXECUTE` (from
/// a Query, a Parse, a DO block's dynamic SQL), where the proxy would not see it end or undo its
/// guarded block: a ROLLBACK TO that undoes the guard's read-only setting before a write, a
/// COMMIT (END, COMMIT AND CHAIN, PREPARE TRANSACTION) after a write, a ROLLBACK between
/// statements of one Query (review of 2026-12-05, second round).
fn execute_control(c: &mut Ctx<'_>) {
    let w = c.write();
    let sp = c.name("xs");
    let rt = c.name("xr");
    let cm = c.name("xc");
    let gid = format!("{}_{}_{}", c.gid_prefix, c.case_id, c.names);
    let commit = [
        "COMMIT".to_owned(),
        "END".to_owned(),
        "COMMIT AND CHAIN".to_owned(),
        "ROLLBACK".to_owned(),
        format!("PREPARE TRANSACTION '{gid}'"),
    ][c.rng.random_range(0..5)]
    .clone();
    for (name, sql) in [(&rt, format!("ROLLBACK TO SAVEPOINT {sp}")), (&cm, commit)] {
        c.steps.push(Step::Parse {
            name: name.clone(),
            sql,
        });
    }
    c.steps.push(Step::Sync);
    let execute = |name: &str, how: u32| match how {
        0 => format!("EXECUTE {name}"),
        _ => format!("DO $$BEGIN EXECUTE 'EXECUTE {name}'; END$$"),
    };
    let how = c.rng.random_range(0..2);
    match c.rng.random_range(0..4) {
        0 => {
            c.q("BEGIN");
            c.q(format!("SAVEPOINT {sp}"));
            c.q("SELECT 1");
            c.q(execute(&rt, how));
            c.q(w);
            c.q(execute(&cm, how));
        }
        1 => {
            c.q(format!(
                "BEGIN; SAVEPOINT {sp}; SELECT 1; {}; {w}",
                execute(&rt, how)
            ));
            c.q(execute(&cm, how));
        }
        2 => {
            c.q(format!("{w}; {}; {w}", execute(&cm, how)));
        }
        _ => {
            // The EXECUTE as a protocol statement of its own.
            c.q("BEGIN");
            c.extended(w, false);
            c.extended(execute(&cm, how), true);
        }
    }
    if c.rng.random_bool(0.5) {
        c.q(format!("COMMIT PREPARED '{gid}'"));
    }
}

/// Frames the proxy and Postgres could read differently: a byte after a Parse's parameter types
/// (Postgres fails it before the unnamed statement is replaced, so an unnamed COMMIT parsed just
/// before survives), and the like for Bind, Execute, Describe, Close, Sync and Query; each after
/// an unnamed COMMIT in an open block, followed by that COMMIT's Bind and Execute and a write
/// (review of 2026-12-05, second round). The proxy ends the session.
fn malformed_frame(c: &mut Ctx<'_>) {
    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        crate::pg::wire::frame(tag, body).to_vec()
    }
    let w = c.write();
    let extra: &[u8] = [&b"\0"[..], b"\x01", b"\0\0\0\0"][c.rng.random_range(0..3)];
    let with = |body: &[u8]| [body, extra].concat();
    let bad = match c.rng.random_range(0..7) {
        0 => frame(b'P', &with(b"\0SELECT 1\0\0\0")),
        1 => frame(b'B', &with(b"\0\0\0\0\0\0\0\0")),
        2 => frame(b'E', &with(b"\0\0\0\0\0")),
        3 => frame(b'D', &with(b"S\0")),
        4 => frame(b'C', &with(b"P\0")),
        5 => frame(b'S', extra),
        _ => frame(b'Q', &with(b"SELECT 1\0")),
    };
    c.q("BEGIN");
    c.steps.push(Step::Parse {
        name: String::new(),
        sql: "COMMIT".into(),
    });
    c.steps.push(Step::Raw(bad));
    c.steps.push(Step::Sync);
    c.steps.push(Step::Bind {
        portal: String::new(),
        statement: String::new(),
    });
    c.steps.push(Step::Execute {
        portal: String::new(),
    });
    c.extended(w, true);
}

fn copy_in(c: &mut Ctx<'_>) {
    c.q(format!(
        "COPY {} (case_id, resource, token_claimed, session_kind) FROM STDIN",
        c.data_table
    ));
    let row = format!(
        "{}\t{}\t{}\tattacker\n",
        c.case_id,
        c.resource,
        c.claim.column()
    );
    c.steps.push(Step::CopyData(row.into_bytes()));
    c.steps.push(Step::CopyDone);
}

/// Every spelling of setting `lockd.fence` to a stale value.
fn set_fence(c: &mut Ctx<'_>) {
    let t = c.stale_token();
    let v = format!("{}:{t}", c.resource);
    let local = c.rng.random_range(0..4) == 0;
    let sql = match c.rng.random_range(0..9) {
        0 => format!("SET lockd.fence = '{v}'"),
        1 => format!("SET lockd.fence TO '{v}'"),
        2 => format!("SET SESSION lockd.fence = '{v}'"),
        3 => format!("SET \"lockd\".\"fence\" = '{v}'"),
        4 => format!("SET lockd.\"fence\" = '{v}'"),
        5 => format!("SET U&\"lockd\".U&\"f\\0065nce\" = '{v}'"),
        6 => format!("SELECT set_config('lockd.fence', '{v}', {local})"),
        7 => format!("SET \"LOCKD\".fence = '{v}'"),
        _ => format!("SET lockd.fence = E'{}\\x3a{t}'", c.resource),
    };
    if local {
        let w = c.write();
        let set_local = sql.replacen("SET ", "SET LOCAL ", 1);
        c.q(format!("BEGIN; {set_local}; {w}; COMMIT"));
    } else if c.rng.random_bool(0.5) {
        c.q(sql);
    } else {
        c.extended(sql, true);
    }
    c.after_set(t);
}

/// Clearing the fence, including after a write in the same Query.
fn clear_fence(c: &mut Ctx<'_>) {
    let w = c.write();
    let clear = [
        "RESET lockd.fence",
        "RESET ALL",
        "DISCARD ALL",
        "SET lockd.fence TO DEFAULT",
        "SELECT set_config('lockd.fence', '', false)",
        "RESET \"lockd\".\"fence\"",
    ][c.rng.random_range(0..6)];
    match c.rng.random_range(0..3) {
        0 => c.q(format!("{w}; {clear}")),
        1 => c.q(format!("BEGIN; {clear}; {w}; COMMIT")),
        _ => c.q(clear),
    }
    c.after_clear();
}

fn search_path(c: &mut Ctx<'_>) {
    let sql = [
        "SET search_path = pg_temp",
        "SET search_path TO ''",
        "SET search_path = pg_temp, public",
        "SELECT set_config('search_path', 'pg_catalog', false)",
        "RESET search_path",
    ][c.rng.random_range(0..5)];
    c.q(sql);
}

/// `standard_conforming_strings = off` and a backslash-quoted string that hides a write from a
/// reader that assumes it is on.
fn conforming_strings(c: &mut Ctx<'_>) {
    let w = c.write();
    let set = [
        "SET standard_conforming_strings = off",
        "SET standard_conforming_strings TO 'off'",
        "SELECT set_config('standard_conforming_strings', 'off', false)",
    ][c.rng.random_range(0..3)];
    c.q(set);
    match c.rng.random_range(0..3) {
        0 => c.q(format!("SELECT 'a\\''; {w}; SELECT ''''")),
        1 => c.q(format!("SELECT '\\'; {w}; SELECT \\''")),
        _ => c.q(format!("SELECT E'\\\\'; {w}")),
    }
    if c.rng.random_bool(0.5) {
        c.q("SET standard_conforming_strings = on");
    }
}

/// Dollar tags and identifiers with bytes >= 0x80 that are not letters, U&"" and E'' strings.
fn odd_quoting(c: &mut Ctx<'_>) {
    let w = c.write();
    let tags = ["€", "→", "\u{a0}", "é", "_ü", "x€y", "\u{80}"];
    let tag = tags[c.rng.random_range(0..tags.len())];
    let sql = match c.rng.random_range(0..4) {
        0 => format!("SELECT ${tag}$ $$ ${tag}$; {w}; SELECT ${tag}$ $$ ${tag}$"),
        1 => format!("SELECT 1 AS {tag}a; {w}"),
        2 => format!("SELECT U&'\\0027' AS \"q\"; {w}"),
        _ => format!("SELECT E'\\'' AS q; {w}; SELECT E'\\''"),
    };
    if c.rng.random_bool(0.8) {
        c.q(sql);
    } else {
        // As one statement of the extended protocol, which refuses several.
        c.extended(sql, true);
    }
}

/// A temporary table named like the fence table, then writes.
fn shadow_fence_table(c: &mut Ctx<'_>) {
    let t = c.fence_table_base.to_owned();
    c.q(format!(
        "CREATE TEMP TABLE IF NOT EXISTS {t} (resource text PRIMARY KEY, token bigint NOT NULL, \
         updated_at timestamptz NOT NULL DEFAULT now())"
    ));
    if c.rng.random_bool(0.5) {
        c.q("SET search_path = pg_temp, public");
    }
    let w = c.write();
    c.q(w);
}

/// The proxy's own statement and portal names, and names read in two client encodings (review
/// of 2026-12-05, second round, follow-up): a client portal or cursor named like the proxy's
/// portal makes the proxy's own Bind fail (in a failed block, at a prepared COMMIT's Execute),
/// which once left `__lockd_fence_proxy_s` holding a real COMMIT for SQL `EXECUTE` (from the
/// Query or a DO block); the names themselves in SQL; and a statement name sent as UTF-8 and as
/// LATIN1 (one server name, once two proxy entries: an INSERT taken for SHOW).
fn internal_names(c: &mut Ctx<'_>) {
    const S: &str = "__lockd_fence_proxy_s";
    const P: &str = "__lockd_fence_proxy_p";
    fn frame(tag: u8, body: &[u8]) -> Vec<u8> {
        crate::pg::wire::frame(tag, body).to_vec()
    }
    fn parse(name: &[u8], sql: &str) -> Vec<u8> {
        frame(b'P', &[name, b"\0", sql.as_bytes(), b"\0\0\0"].concat())
    }
    fn close(name: &[u8]) -> Vec<u8> {
        frame(b'C', &[b"S", name, b"\0"].concat())
    }
    fn bind(statement: &[u8]) -> Vec<u8> {
        frame(b'B', &[b"\0", statement, b"\0\0\0\0\0\0\0"].concat())
    }
    let w = c.write();
    let run = if c.rng.random_bool(0.5) {
        format!("EXECUTE {S}")
    } else {
        format!("DO $$BEGIN EXECUTE 'EXECUTE {S}'; END$$")
    };
    match c.rng.random_range(0..5) {
        0 | 1 => {
            // Take the proxy's portal name, fail the block, make the proxy run its own COMMIT.
            c.q("BEGIN");
            if c.rng.random_bool(0.5) {
                let x = c.name("ix");
                c.steps.push(Step::Parse {
                    name: x.clone(),
                    sql: "SELECT 1".to_owned(),
                });
                c.steps.push(Step::Bind {
                    portal: P.to_owned(),
                    statement: x,
                });
                c.steps.push(Step::Sync);
            } else {
                c.q(format!(
                    "DO $$DECLARE k refcursor := '{P}'; BEGIN OPEN k FOR SELECT 1; END$$"
                ));
            }
            c.steps.push(Step::Parse {
                name: String::new(),
                sql: "SELEC".to_owned(),
            });
            c.steps.push(Step::Sync);
            let cm = c.name("ic");
            c.steps.push(Step::Parse {
                name: cm.clone(),
                sql: "COMMIT".to_owned(),
            });
            c.steps.push(Step::Bind {
                portal: String::new(),
                statement: cm,
            });
            c.steps.push(Step::Execute {
                portal: String::new(),
            });
            c.steps.push(Step::Sync);
            c.q("ROLLBACK");
            c.q("BEGIN");
            c.q(w);
            c.q(run);
            c.q("COMMIT");
        }
        2 => {
            // The names in SQL, then ordinary extended-protocol writes.
            let sql = [
                format!("DECLARE {P} CURSOR WITH HOLD FOR SELECT 1"),
                format!("PREPARE {S} AS {w}"),
                format!("EXECUTE {S}"),
                format!("DEALLOCATE {S}"),
                format!("FETCH {P}"),
                format!("CLOSE {P}"),
            ][c.rng.random_range(0..6)]
            .clone();
            c.q(sql);
            c.extended(w.clone(), true);
            c.q(format!("BEGIN; {w}"));
            c.q(run);
            c.q("COMMIT");
        }
        _ => {
            // One server name, two byte spellings.
            let utf8 = "\u{e9}".as_bytes();
            let latin1 = &b"\xe9"[..];
            c.steps.push(Step::Raw(parse(utf8, "SHOW work_mem")));
            c.steps.push(Step::Sync);
            c.q("BEGIN");
            c.q("SET client_encoding = 'LATIN1'");
            c.steps.push(Step::Raw(close(latin1)));
            c.steps.push(Step::Raw(parse(latin1, &w)));
            c.steps.push(Step::Sync);
            c.q("SET client_encoding = 'UTF8'");
            c.steps.push(Step::Raw(bind(utf8)));
            c.steps.push(Step::Execute {
                portal: String::new(),
            });
            c.steps.push(Step::Sync);
            c.q("COMMIT");
        }
    }
}
