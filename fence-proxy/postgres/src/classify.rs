//! What the proxy needs to know about client SQL, read by Postgres's own grammar.
//!
//! The proxy no longer lexes SQL itself: [`classify`] hands the text to `pg_query`, which embeds
//! the server's parser, and sorts each top-level statement into the few kinds the fencing design
//! needs: transaction control (with BEGIN's options), settings (which need no opening guard), COPY
//! FROM STDIN (which the proxy must not pipeline past), and everything else. Text the parser
//! rejects is refused by the caller; nothing is guessed.
//!
//! The lexer differs from the server's in one respect the proxy cannot see from the text alone:
//! with `standard_conforming_strings = off`, a backslash inside `'...'` escapes the next
//! character. Without any backslash the two lexers agree, so the session refuses only text that
//! contains a backslash while the setting is off ([`needs_standard_strings`]).

use pg_query::NodeEnum;
use pg_query::protobuf::{DiscardMode, TransactionStmtKind, VariableSetKind, a_const};

use crate::limits::{MAX_CLASSIFIED_SQL_BYTES, MAX_STATEMENTS_PER_QUERY};
use crate::parser;

/// What one top-level statement means for the fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StatementKind {
    /// `BEGIN` / `START TRANSACTION`, with its options rebuilt as SQL the proxy may send itself
    /// (`BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY`); never the client's text.
    Begin(String),
    /// `COMMIT`, `END`, `PREPARE TRANSACTION`, and `COMMIT AND CHAIN` (`chain`): a commit point,
    /// so the proxy runs the guard right before it.
    Commit {
        /// `AND CHAIN`: a new transaction starts at once.
        chain: bool,
    },
    /// `ROLLBACK`, `ABORT`, `ROLLBACK AND CHAIN`.
    Rollback {
        /// `AND CHAIN`: a new transaction starts at once.
        chain: bool,
    },
    /// `ROLLBACK TO SAVEPOINT`: may undo the guard's row lock or read-only setting, so the next
    /// statement is guarded again.
    RollbackTo,
    /// `SAVEPOINT`, `RELEASE`, `SET`, `RESET`, `SET TRANSACTION`, `SHOW`: touch no table, so they
    /// need no opening guard (and `SET TRANSACTION` must come before any snapshot is taken).
    Setting {
        /// It may change `lockd.fence`: a SET or RESET of it (any spelling the grammar accepts,
        /// any setting under `lockd.`, to be safe) or `RESET ALL`. SHOW, SAVEPOINT, RELEASE and
        /// SETs of other settings cannot, so they leave the proxy's knowledge of the session's
        /// fence as it was (see `Session::unfenced_seen`).
        touches_fence: bool,
    },
    /// `COPY ... FROM STDIN`: the upstream reads CopyData next, so nothing may be pipelined
    /// behind the query.
    CopyIn,
    /// Everything else: may read or write table data.
    Other,
}

impl StatementKind {
    /// Whether the statement ends the transaction (commit or rollback, with or without chain).
    pub fn ends_transaction(&self) -> bool {
        matches!(
            self,
            StatementKind::Commit { .. } | StatementKind::Rollback { .. }
        )
    }

    /// Whether the statement can run before the opening guard: it touches no table data.
    pub fn guard_free(&self) -> bool {
        matches!(
            self,
            StatementKind::Begin(_)
                | StatementKind::Setting { .. }
                | StatementKind::RollbackTo
                | StatementKind::Commit { .. }
                | StatementKind::Rollback { .. }
        )
    }
}

/// One top-level statement: its kind and where it starts in the text (a byte offset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statement {
    /// What the statement does to the transaction and the guard.
    pub kind: StatementKind,
    /// Byte offset of its first character in the query text.
    pub start: usize,
    /// The value a `SET [SESSION | LOCAL] lockd.fence = <constant>` assigns (any spelling of the
    /// name the grammar accepts), for the proxy to verify before it reaches the upstream. Other
    /// ways to change the setting are not seen here; the guard refuses what they set unless the
    /// proxy verified it.
    pub sets_fence: Option<String>,
    /// For a commit point (`COMMIT`, `END`, `COMMIT AND CHAIN`, `PREPARE TRANSACTION`), the same
    /// statement rebuilt from the parse tree, for the proxy to send in its place when it runs
    /// it after other statements of the client's have run (they may have changed how the
    /// server lexes text: `standard_conforming_strings`, `client_encoding`). Its text reads the
    /// same under any of those settings: keywords, and a transaction identifier in an `E''`
    /// literal. `None` for other statements, and for a `PREPARE TRANSACTION` whose identifier
    /// is not printable ASCII.
    pub commit_sql: Option<String>,
    /// `DISCARD ALL`: resets the session (every setting, `lockd.fence` with them, prepared
    /// statements, portals, temporary tables, advisory locks, LISTEN). Postgres runs it only
    /// outside a transaction block, so the proxy forwards it alone at status `I` as it is.
    pub discards_all: bool,
    /// Transaction control: any statement of Postgres's `TransactionStmt` (BEGIN, START
    /// TRANSACTION, COMMIT, END, ROLLBACK, ABORT, SAVEPOINT, RELEASE, ROLLBACK TO, PREPARE
    /// TRANSACTION, COMMIT PREPARED, ROLLBACK PREPARED, with or without AND CHAIN). The proxy never
    /// lets the upstream hold such a statement prepared: SQL `EXECUTE` of it would end or undo a
    /// guarded block where the proxy does not see it.
    pub transaction_control: bool,
    /// For transaction control, the statement rebuilt from the parse tree (keywords, savepoint
    /// names as quoted identifiers, transaction identifiers as `E''` literals: it reads the same
    /// under any lexer setting), for the proxy to run in the place of a prepared one. `None` for
    /// other statements, and for transaction control naming a savepoint or transaction
    /// identifier that is not printable ASCII.
    pub control_sql: Option<String>,
    /// `DEALLOCATE`: the prepared statements it drops.
    pub deallocates: Option<Deallocate>,
}

/// What a `DEALLOCATE` drops.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deallocate {
    /// `DEALLOCATE ALL`.
    All,
    /// `DEALLOCATE [PREPARE] name`.
    Name(String),
}

/// The prefix of the proxy's own names (prepared statements, portals, and the savepoint its
/// placeholder statements name). A client statement naming a savepoint with it is refused
/// (case-insensitively, as a quoted name may differ in case only): that savepoint must never exist.
pub const RESERVED_PREFIX: &str = "__lockd_fence_proxy";

/// Whether `name` starts with [`RESERVED_PREFIX`], in any case (a quoted SQL name may differ from
/// the proxy's in case only; refusing every case is simpler than reasoning about which fold).
pub fn is_reserved(name: &[u8]) -> bool {
    name.get(..RESERVED_PREFIX.len())
        .is_some_and(|p| p.eq_ignore_ascii_case(RESERVED_PREFIX.as_bytes()))
}

/// A name in `node` that the client may not use because it is the proxy's (see
/// [`RESERVED_PREFIX`]): what it names and the name. Savepoints (the placeholder's savepoint
/// must never exist), prepared statements (`PREPARE`, `EXECUTE`, `DEALLOCATE`, also under
/// `EXPLAIN` and `CREATE TABLE ... AS EXECUTE`) and cursors (`DECLARE`, `FETCH`, `MOVE`,
/// `CLOSE`: a cursor is a portal, and one named like the proxy's portal makes every internal
/// Bind fail). These are all the places the grammar puts such a name in a top-level statement.
fn reserved_name(node: &NodeEnum) -> Option<(&'static str, &str)> {
    let (what, name) = match node {
        NodeEnum::TransactionStmt(t) => ("savepoint", t.savepoint_name.as_str()),
        NodeEnum::PrepareStmt(p) => ("prepared statement", p.name.as_str()),
        NodeEnum::ExecuteStmt(e) => ("prepared statement", e.name.as_str()),
        NodeEnum::DeallocateStmt(d) => ("prepared statement", d.name.as_str()),
        NodeEnum::DeclareCursorStmt(d) => ("cursor", d.portalname.as_str()),
        NodeEnum::FetchStmt(f) => ("cursor", f.portalname.as_str()),
        NodeEnum::ClosePortalStmt(c) => ("cursor", c.portalname.as_str()),
        NodeEnum::ExplainStmt(e) => return e.query.as_ref()?.node.as_ref().and_then(reserved_name),
        NodeEnum::CreateTableAsStmt(c) => {
            return c.query.as_ref()?.node.as_ref().and_then(reserved_name);
        }
        _ => return None,
    };
    is_reserved(name.as_bytes()).then_some((what, name))
}

/// What the upstream holds under the name of a client's prepared transaction-control statement
/// (see [`Statement::transaction_control`]): a ROLLBACK TO of a savepoint that cannot exist. It
/// is a transaction-exit statement to Postgres, so its Parse and Bind are accepted in a failed
/// block as the client's ROLLBACK or COMMIT would be; it takes no parameters beyond those the
/// client declared, returns no rows (Describe answers NoData), and whatever runs it (SQL
/// `EXECUTE`, a function's dynamic SQL, a client Execute the proxy misjudged) fails: outside a
/// block (25P01), or because the savepoint does not exist (3B001). It reads the same under
/// any lexer setting (ASCII, no backslash, a quoted identifier).
pub const PLACEHOLDER_SQL: &str =
    "ROLLBACK TO SAVEPOINT \"__lockd_fence_proxy prepared transaction control\"";

/// The savepoint name of [`PLACEHOLDER_SQL`], as the server's errors quote it.
pub const PLACEHOLDER_SAVEPOINT: &str = "__lockd_fence_proxy prepared transaction control";

/// Why a text was not classified.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassifyError {
    /// The Postgres parser rejects the text; its message.
    #[error("the Postgres parser rejects this query: {0}")]
    Syntax(String),
    /// More statements in one query than the proxy classifies.
    #[error("query has more than {MAX_STATEMENTS_PER_QUERY} statements")]
    TooManyStatements,
    /// A `BEGIN` option the proxy cannot rebuild; the option.
    #[error("unsupported BEGIN option {0}")]
    BeginOption(String),
    /// A savepoint, prepared statement or cursor name with the proxy's reserved prefix: what it
    /// names, and the name.
    #[error(
        "{0} name {1:?} is reserved for the proxy (names starting with {RESERVED_PREFIX}, in any case, are its own)"
    )]
    ReservedName(&'static str, String),
    /// The text is longer than the proxy parses; its length in bytes.
    #[error(
        "query text of {0} bytes exceeds the {MAX_CLASSIFIED_SQL_BYTES} bytes the proxy parses; pass large values as parameters or load data with COPY"
    )]
    TooLong(usize),
    /// The parser itself failed (not the query); its message.
    #[error("the proxy could not run its SQL parser: {0}")]
    Parser(String),
}

/// Whether `sql` may only be read with `standard_conforming_strings = on`: it contains a
/// backslash, the one character the two settings lex differently.
pub fn needs_standard_strings(sql: &str) -> bool {
    sql.contains('\\')
}

/// Splits `sql` into its top-level statements with Postgres's parser and classifies each. Empty
/// statements do not appear. Pure: no I/O, safe on any input (a fuzzer calls it).
pub fn classify(sql: &str) -> Result<Vec<Statement>, ClassifyError> {
    check_text(sql)?;
    let parsed = parser::parse_blocking(sql).map_err(|e| ClassifyError::Parser(e.0))?;
    statements(sql, parsed)
}

/// An inline parse slower than this yields the session thread (a common one takes 10-15 µs).
const SLOW_INLINE_PARSE: std::time::Duration = std::time::Duration::from_micros(50);

/// [`classify`] for a session: a short text is parsed on the session thread itself, a longer one
/// on a parser thread while the session thread goes on serving its other sessions.
pub async fn classify_async(sql: String) -> Result<Vec<Statement>, ClassifyError> {
    check_text(&sql)?;
    let started = std::time::Instant::now();
    if let Some(parsed) = parser::parse_here(&sql) {
        // Some short texts take milliseconds (a run of operator characters is lexed in
        // quadratic time): let the thread's other sessions run before this one goes on.
        if started.elapsed() > SLOW_INLINE_PARSE {
            tokio::task::yield_now().await;
        }
        return statements(&sql, parsed);
    }
    // The statements are read off the tree on the parser thread too, so the tree (hundreds of
    // times the text's size) is freed there and never waits in a channel.
    let (tx, rx) = tokio::sync::oneshot::channel();
    parser::parse_on_parser_thread(sql, move |sql, parsed| {
        let _ = tx.send(statements(&sql, parsed));
    })
    .map_err(|e| ClassifyError::Parser(e.0))?;
    rx.await
        .map_err(|_| ClassifyError::Parser("the parser thread panicked".to_owned()))?
}

/// What is refused before parsing: NUL bytes and text over [`MAX_CLASSIFIED_SQL_BYTES`].
fn check_text(sql: &str) -> Result<(), ClassifyError> {
    if sql.contains('\0') {
        return Err(ClassifyError::Syntax("NUL byte in query text".to_owned()));
    }
    if sql.len() > MAX_CLASSIFIED_SQL_BYTES {
        return Err(ClassifyError::TooLong(sql.len()));
    }
    Ok(())
}

/// The statements of a parse result of `sql`.
fn statements(
    sql: &str,
    parsed: Result<pg_query::ParseResult, pg_query::Error>,
) -> Result<Vec<Statement>, ClassifyError> {
    let parsed = parsed.map_err(|e| ClassifyError::Syntax(e.to_string()))?;
    let stmts = &parsed.protobuf.stmts;
    if stmts.len() > MAX_STATEMENTS_PER_QUERY {
        return Err(ClassifyError::TooManyStatements);
    }
    stmts
        .iter()
        .map(|raw| {
            let node = raw.stmt.as_ref().and_then(|n| n.node.as_ref());
            let kind = match node {
                Some(node) => kind_of(node)?,
                None => StatementKind::Other,
            };
            if let Some((what, name)) = node.and_then(reserved_name) {
                return Err(ClassifyError::ReservedName(what, name.to_owned()));
            }
            Ok(Statement {
                kind,
                sets_fence: node.and_then(fence_assignment),
                commit_sql: node.and_then(commit_sql),
                discards_all: matches!(node, Some(NodeEnum::DiscardStmt(d)) if d.target() == DiscardMode::DiscardAll),
                transaction_control: matches!(node, Some(NodeEnum::TransactionStmt(_))),
                control_sql: node.and_then(control_sql),
                deallocates: match node {
                    Some(NodeEnum::DeallocateStmt(d)) if d.isall || d.name.is_empty() => {
                        Some(Deallocate::All)
                    }
                    Some(NodeEnum::DeallocateStmt(d)) => Some(Deallocate::Name(d.name.clone())),
                    _ => None,
                },
                start: usize::try_from(raw.stmt_location)
                    .unwrap_or(0)
                    .min(sql.len()),
            })
        })
        .collect()
}

fn kind_of(node: &NodeEnum) -> Result<StatementKind, ClassifyError> {
    Ok(match node {
        NodeEnum::TransactionStmt(t) => match t.kind() {
            TransactionStmtKind::TransStmtBegin => {
                StatementKind::Begin(begin_sql("BEGIN", &t.options)?)
            }
            // Spelled as the client spelled it: the proxy may run it in the client's place, and
            // the CommandComplete tag ("START TRANSACTION") must be the one the client expects.
            TransactionStmtKind::TransStmtStart => {
                StatementKind::Begin(begin_sql("START TRANSACTION", &t.options)?)
            }
            TransactionStmtKind::TransStmtCommit => StatementKind::Commit { chain: t.chain },
            TransactionStmtKind::TransStmtPrepare => StatementKind::Commit { chain: false },
            TransactionStmtKind::TransStmtRollback => StatementKind::Rollback { chain: t.chain },
            TransactionStmtKind::TransStmtRollbackTo => StatementKind::RollbackTo,
            TransactionStmtKind::TransStmtSavepoint | TransactionStmtKind::TransStmtRelease => {
                StatementKind::Setting {
                    touches_fence: false,
                }
            }
            // COMMIT PREPARED / ROLLBACK PREPARED cannot run inside a block, where the proxy runs
            // every statement; the upstream refuses them.
            _ => StatementKind::Other,
        },
        NodeEnum::VariableSetStmt(set) => StatementKind::Setting {
            touches_fence: set.kind() == VariableSetKind::VarResetAll
                || set
                    .name
                    .as_bytes()
                    .get(..FENCE_NAMESPACE.len())
                    .is_some_and(|prefix| prefix.eq_ignore_ascii_case(FENCE_NAMESPACE.as_bytes())),
        },
        // It resets every setting, as RESET ALL does.
        NodeEnum::DiscardStmt(d) if d.target() == DiscardMode::DiscardAll => {
            StatementKind::Setting {
                touches_fence: true,
            }
        }
        NodeEnum::VariableShowStmt(_) => StatementKind::Setting {
            touches_fence: false,
        },
        NodeEnum::CopyStmt(c) if c.is_from && !c.is_program && c.filename.is_empty() => {
            StatementKind::CopyIn
        }
        _ => StatementKind::Other,
    })
}

/// The constant a `SET lockd.fence = ...` assigns. GUC names are case-insensitive in Postgres, so
/// `SET "LOCKD"."Fence"` is the same setting.
fn fence_assignment(node: &NodeEnum) -> Option<String> {
    let NodeEnum::VariableSetStmt(set) = node else {
        return None;
    };
    if set.kind() != VariableSetKind::VarSetValue
        || !set.name.eq_ignore_ascii_case(FENCE_SETTING)
        || set.args.len() != 1
    {
        return None;
    }
    match set.args[0].node.as_ref()? {
        NodeEnum::AConst(c) => match c.val.as_ref()? {
            a_const::Val::Sval(s) => Some(s.sval.clone()),
            a_const::Val::Ival(i) => Some(i.ival.to_string()),
            a_const::Val::Fval(f) => Some(f.fval.clone()),
            _ => None,
        },
        _ => None,
    }
}

/// A commit point rebuilt from its parse tree (see [`Statement::commit_sql`]).
fn commit_sql(node: &NodeEnum) -> Option<String> {
    let NodeEnum::TransactionStmt(t) = node else {
        return None;
    };
    match t.kind() {
        TransactionStmtKind::TransStmtCommit if t.chain => Some("COMMIT AND CHAIN".to_owned()),
        TransactionStmtKind::TransStmtCommit => Some("COMMIT".to_owned()),
        TransactionStmtKind::TransStmtPrepare => {
            if !t.gid.bytes().all(|b| (0x20..0x7f).contains(&b)) {
                return None;
            }
            let escaped = t.gid.replace('\\', "\\\\").replace('\'', "''");
            Some(format!("PREPARE TRANSACTION E'{escaped}'"))
        }
        _ => None,
    }
}

/// Any transaction-control statement rebuilt from its parse tree (see
/// [`Statement::control_sql`]).
fn control_sql(node: &NodeEnum) -> Option<String> {
    let NodeEnum::TransactionStmt(t) = node else {
        return None;
    };
    let chain = if t.chain { " AND CHAIN" } else { "" };
    Some(match t.kind() {
        TransactionStmtKind::TransStmtBegin => begin_sql("BEGIN", &t.options).ok()?,
        TransactionStmtKind::TransStmtStart => begin_sql("START TRANSACTION", &t.options).ok()?,
        TransactionStmtKind::TransStmtCommit => format!("COMMIT{chain}"),
        TransactionStmtKind::TransStmtRollback => format!("ROLLBACK{chain}"),
        TransactionStmtKind::TransStmtSavepoint => {
            format!("SAVEPOINT {}", quoted_identifier(&t.savepoint_name)?)
        }
        TransactionStmtKind::TransStmtRelease => {
            format!(
                "RELEASE SAVEPOINT {}",
                quoted_identifier(&t.savepoint_name)?
            )
        }
        TransactionStmtKind::TransStmtRollbackTo => {
            format!(
                "ROLLBACK TO SAVEPOINT {}",
                quoted_identifier(&t.savepoint_name)?
            )
        }
        TransactionStmtKind::TransStmtPrepare => {
            format!("PREPARE TRANSACTION {}", escaped_literal(&t.gid)?)
        }
        TransactionStmtKind::TransStmtCommitPrepared => {
            format!("COMMIT PREPARED {}", escaped_literal(&t.gid)?)
        }
        TransactionStmtKind::TransStmtRollbackPrepared => {
            format!("ROLLBACK PREPARED {}", escaped_literal(&t.gid)?)
        }
        TransactionStmtKind::Undefined => return None,
    })
}

/// `name` as a quoted identifier, if it is printable ASCII (quoted identifiers read the same
/// under any `standard_conforming_strings` and any client encoding).
fn quoted_identifier(name: &str) -> Option<String> {
    if name.is_empty() || !name.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return None;
    }
    Some(format!("\"{}\"", name.replace('"', "\"\"")))
}

/// `value` as an `E''` literal, if it is printable ASCII (an `E''` literal reads the same under
/// any `standard_conforming_strings`).
fn escaped_literal(value: &str) -> Option<String> {
    if !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return None;
    }
    let escaped = value.replace('\\', "\\\\").replace('\'', "''");
    Some(format!("E'{escaped}'"))
}

/// The setting that carries a session's fence.
pub const FENCE_SETTING: &str = "lockd.fence";

/// The prefix of the settings a SET may change the fence through, as far as the proxy's
/// knowledge of it goes: `lockd.fence` itself, and, to be safe, any other `lockd.` setting
/// (Postgres compares setting names ignoring ASCII case).
const FENCE_NAMESPACE: &str = "lockd.";

/// Rebuilds `BEGIN` with the client's transaction modes from the parse tree.
fn begin_sql(keyword: &str, options: &[pg_query::protobuf::Node]) -> Result<String, ClassifyError> {
    let mut sql = String::from(keyword);
    for option in options {
        let Some(NodeEnum::DefElem(d)) = option.node.as_ref() else {
            return Err(ClassifyError::BeginOption(format!("{option:?}")));
        };
        let value = d
            .arg
            .as_ref()
            .and_then(|a| a.node.as_ref())
            .and_then(|n| match n {
                NodeEnum::AConst(c) => c.val.clone(),
                _ => None,
            });
        let flag = |v: &Option<a_const::Val>| match v {
            Some(a_const::Val::Ival(i)) => Some(i.ival != 0),
            Some(a_const::Val::Boolval(b)) => Some(b.boolval),
            _ => None,
        };
        let piece = match (d.defname.as_str(), &value) {
            ("transaction_isolation", Some(a_const::Val::Sval(s))) => match s.sval.as_str() {
                level @ ("serializable" | "repeatable read" | "read committed"
                | "read uncommitted") => format!(" ISOLATION LEVEL {}", level.to_uppercase()),
                other => return Err(ClassifyError::BeginOption(format!("isolation {other:?}"))),
            },
            ("transaction_read_only", v) => match flag(v) {
                Some(true) => " READ ONLY".to_owned(),
                Some(false) => " READ WRITE".to_owned(),
                None => return Err(ClassifyError::BeginOption(d.defname.clone())),
            },
            ("transaction_deferrable", v) => match flag(v) {
                Some(true) => " DEFERRABLE".to_owned(),
                Some(false) => " NOT DEFERRABLE".to_owned(),
                None => return Err(ClassifyError::BeginOption(d.defname.clone())),
            },
            (name, _) => return Err(ClassifyError::BeginOption(name.to_owned())),
        };
        sql.push_str(&piece);
    }
    Ok(sql)
}

#[cfg(test)]
mod tests {
    use super::*;
    use StatementKind::*;

    fn kinds(sql: &str) -> Vec<StatementKind> {
        classify(sql).unwrap().into_iter().map(|s| s.kind).collect()
    }

    /// Goal: the awaited classification is the same function as the blocking one, refusals
    /// included. Method: both on a few texts, on a current-thread runtime (a session thread).
    #[tokio::test(flavor = "current_thread")]
    async fn classify_async_agrees_with_classify() {
        for sql in [
            "BEGIN ISOLATION LEVEL SERIALIZABLE; SELECT 1; COMMIT",
            "SET lockd.fence = 'r:1'",
            "SELEC 1",
            "SELECT 1\0",
        ] {
            assert_eq!(
                classify_async(sql.to_owned()).await,
                classify(sql),
                "{sql:?}"
            );
        }
        let long = "x".repeat(MAX_CLASSIFIED_SQL_BYTES + 1);
        assert_eq!(
            classify_async(long.clone()).await,
            Err(ClassifyError::TooLong(long.len()))
        );
    }

    #[test]
    fn commit_points_are_rebuilt_to_read_the_same_under_any_lexer_setting() {
        let rebuilt = |sql: &str| {
            classify(sql)
                .unwrap()
                .into_iter()
                .map(|s| s.commit_sql)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            rebuilt("commit work; end; commit and chain; commit and no chain; select 1"),
            vec![
                Some("COMMIT".to_owned()),
                Some("COMMIT".to_owned()),
                Some("COMMIT AND CHAIN".to_owned()),
                Some("COMMIT".to_owned()),
                None
            ]
        );
        assert_eq!(
            rebuilt(r"prepare transaction 'a\' -- '"),
            vec![Some(r"PREPARE TRANSACTION E'a\\'".to_owned())]
        );
        assert_eq!(
            rebuilt("prepare transaction 'it''s'"),
            vec![Some("PREPARE TRANSACTION E'it''s'".to_owned())]
        );
        assert_eq!(rebuilt("prepare transaction 'ü'"), vec![None]);
        assert_eq!(rebuilt("rollback; rollback prepared 'x'"), vec![None, None]);
    }

    /// Review of 2026-12-05 (second round): every transaction-control statement is marked and
    /// rebuilt from its tree (the proxy runs the rebuilt one in the place of a prepared one),
    /// names that are not printable ASCII are not rebuilt, the proxy's savepoint prefix is
    /// refused in any case, and DEALLOCATE says what it drops.
    #[test]
    fn review_transaction_control_is_rebuilt_from_the_tree() {
        let control = |sql: &str| {
            let s = classify(sql).unwrap().remove(0);
            assert!(s.transaction_control, "{sql}");
            s.control_sql
        };
        for (sql, rebuilt) in [
            ("begin read only", "BEGIN READ ONLY"),
            ("start transaction", "START TRANSACTION"),
            ("commit work", "COMMIT"),
            ("end", "COMMIT"),
            ("commit and chain", "COMMIT AND CHAIN"),
            ("abort", "ROLLBACK"),
            ("rollback and chain", "ROLLBACK AND CHAIN"),
            ("savepoint Sp", "SAVEPOINT \"sp\""),
            ("release \"A\"\"b\"", "RELEASE SAVEPOINT \"A\"\"b\""),
            ("rollback to sp", "ROLLBACK TO SAVEPOINT \"sp\""),
            (
                "prepare transaction 'it''s'",
                "PREPARE TRANSACTION E'it''s'",
            ),
            ("commit prepared 'g'", "COMMIT PREPARED E'g'"),
            ("rollback prepared E'a\\\\b'", "ROLLBACK PREPARED E'a\\\\b'"),
        ] {
            assert_eq!(control(sql).as_deref(), Some(rebuilt), "{sql}");
            // The rebuilt text reads back as the same statement.
            let again = classify(rebuilt).unwrap().remove(0);
            assert_eq!(again.control_sql.as_deref(), Some(rebuilt), "{sql}");
            assert_eq!(again.kind, classify(sql).unwrap()[0].kind, "{sql}");
        }
        assert_eq!(control("savepoint \"ü\""), None);
        assert_eq!(control("commit prepared 'ü'"), None);
        for sql in [
            "select 1",
            "set lockd.fence = 'a:1'",
            "execute c",
            "deallocate c",
        ] {
            let s = classify(sql).unwrap().remove(0);
            assert!(!s.transaction_control && s.control_sql.is_none(), "{sql}");
        }
        for sql in [
            "savepoint __lockd_fence_proxy_x",
            "rollback to \"__LOCKD_FENCE_PROXY prepared transaction control\"",
            "release __lockd_fence_proxy",
            PLACEHOLDER_SQL,
            "prepare __lockd_fence_proxy_s as select 1",
            "execute __lockd_fence_proxy_s",
            "execute \"__LOCKD_FENCE_PROXY_S\"",
            "deallocate prepare __lockd_fence_proxy_s",
            "explain execute __lockd_fence_proxy_s",
            "explain analyze create table t as execute __lockd_fence_proxy_s",
            "create temp table t as execute __lockd_fence_proxy_s",
            "declare __lockd_fence_proxy_p cursor with hold for select 1",
            "explain declare __lockd_fence_proxy_p cursor for select 1",
            "fetch next from __lockd_fence_proxy_p",
            "move __lockd_fence_proxy_p",
            "close __lockd_fence_proxy_p",
        ] {
            assert!(
                matches!(classify(sql), Err(ClassifyError::ReservedName(..))),
                "{sql}"
            );
        }
        let drops = |sql: &str| {
            classify(sql)
                .unwrap()
                .into_iter()
                .map(|s| s.deallocates)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            drops("deallocate a; deallocate prepare \"B\"; deallocate all; select 1"),
            vec![
                Some(Deallocate::Name("a".into())),
                Some(Deallocate::Name("B".into())),
                Some(Deallocate::All),
                None
            ]
        );
    }

    #[test]
    fn transaction_control_and_settings() {
        assert_eq!(
            kinds("begin; insert into t values (';'); -- c;\n /* a /* ; */ */ COMMIT; ;"),
            vec![Begin("BEGIN".into()), Other, Commit { chain: false }]
        );
        assert_eq!(
            kinds("rollback to savepoint a; release a; savepoint b; end; abort"),
            vec![
                RollbackTo,
                Setting {
                    touches_fence: false
                },
                Setting {
                    touches_fence: false
                },
                Commit { chain: false },
                Rollback { chain: false }
            ]
        );
        assert_eq!(
            kinds("commit and chain; rollback and chain; prepare transaction 'x'"),
            vec![
                Commit { chain: true },
                Rollback { chain: true },
                Commit { chain: false }
            ]
        );
        let setting = |touches_fence| Setting { touches_fence };
        assert_eq!(
            kinds("SET \"lockd\".\"fence\" = 'a:1'; show x; reset all; set transaction read only"),
            vec![setting(true), setting(false), setting(true), setting(false)]
        );
        assert_eq!(
            kinds(
                "set \"LOCKD\".\"Fence\" to default; reset lockd.fence; set local lockd.other = 1; \
                 set lockd . fence = 'a:1'; set local statement_timeout = 5; reset search_path; \
                 show lockd.fence; set session characteristics as transaction read only"
            ),
            vec![
                setting(true),
                setting(true),
                setting(true),
                setting(true),
                setting(false),
                setting(false),
                setting(false),
                setting(false)
            ]
        );
        assert_eq!(
            kinds("copy t from stdin; copy t to stdout; copy t from '/x'"),
            vec![CopyIn, Other, Other]
        );
        assert!(kinds("  ").is_empty());
    }

    #[test]
    fn fence_assignments_in_every_spelling_the_grammar_reads() {
        let sets = |sql: &str| -> Vec<Option<String>> {
            classify(sql)
                .unwrap()
                .into_iter()
                .map(|s| s.sets_fence)
                .collect()
        };
        assert_eq!(
            sets(
                "SET lockd.fence = 'a:1'; SET LOCAL \"LOCKD\".\"fence\" TO E'b:\\x32'; SET SESSION lockd.fence = 'c:3'"
            ),
            vec![Some("a:1".into()), Some("b:2".into()), Some("c:3".into())]
        );
        assert_eq!(
            sets(
                "RESET lockd.fence; SET lockd.fence TO DEFAULT; SET search_path = 'a:1'; SELECT 1"
            ),
            vec![None, None, None, None]
        );
        assert_eq!(sets("SET lockd.fence = 7"), vec![Some("7".into())]);
    }

    #[test]
    fn begin_options_are_rebuilt_from_the_tree() {
        assert_eq!(
            kinds("start transaction isolation level repeatable read, read only, deferrable"),
            vec![Begin(
                "START TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY DEFERRABLE".into()
            )]
        );
        // The rebuilt text reads back as itself: the proxy may run it in the client's place.
        for sql in [
            "START TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY DEFERRABLE",
            "BEGIN ISOLATION LEVEL SERIALIZABLE READ WRITE",
            "START TRANSACTION",
        ] {
            assert_eq!(kinds(sql), vec![Begin(sql.into())]);
        }
        assert_eq!(
            kinds("BEGIN READ WRITE NOT DEFERRABLE"),
            vec![Begin("BEGIN READ WRITE NOT DEFERRABLE".into())]
        );
    }

    /// Statement boundaries as Postgres reads them: dollar tags of any bytes >= 0x80 are tags, as
    /// in Postgres.
    #[test]
    fn issue13_bypass5_dollar_tags_with_any_bytes() {
        assert_eq!(
            kinds("SELECT $€$ $$ $€$; COMMIT; INSERT INTO t VALUES (1); SELECT $€$ $$ $€$"),
            vec![Other, Commit { chain: false }, Other, Other]
        );
        let stmts = classify("SELECT 1; COMMIT").unwrap();
        assert_eq!(stmts[1].start, "SELECT 1;".len());
    }

    #[test]
    fn unparsable_text_is_an_error() {
        assert!(matches!(classify("SELEC 1"), Err(ClassifyError::Syntax(_))));
        assert!(matches!(
            classify("SELECT '"),
            Err(ClassifyError::Syntax(_))
        ));
        assert!(needs_standard_strings("SELECT '\\''"));
    }

    /// Review 13: the deepest tree the length bound allows is classified (or refused) without
    /// overflowing a stack, and longer text is refused before parsing.
    #[test]
    fn review13_deep_expressions_and_long_text_do_not_crash() {
        let terms = (MAX_CLASSIFIED_SQL_BYTES - "SELECT 1".len()) / 2;
        let deep = format!("SELECT 1{}", "+1".repeat(terms));
        assert!(deep.len() <= MAX_CLASSIFIED_SQL_BYTES);
        let _ = classify(&deep);
        let long = format!("SELECT 1{}", ",1".repeat(terms + 1));
        assert_eq!(classify(&long), Err(ClassifyError::TooLong(long.len())));
    }
}
