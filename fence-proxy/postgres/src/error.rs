//! Errors the proxy makes itself, and their SQLSTATEs: the one table from condition to code.
//!
//! | condition | SQLSTATE | severity |
//! |---|---|---|
//! | stale fencing token (raised by the guard inside the upstream transaction) | `55P03` lock_not_available | ERROR |
//! | malformed `lockd.fence` value (raised by the guard; FATAL when given as a startup option) | `22023` invalid_parameter_value | ERROR (FATAL at startup) |
//! | with `--verify-key`: a sequencer in `lockd.fence` that does not verify (forged, altered, unknown key, other resource), or a value the proxy did not verify (raised by the guard) | `42501` insufficient_privilege | ERROR (FATAL at startup) |
//! | with `--verify-key` and without `--allow-unsigned`: a plain token in `lockd.fence` | `28000` invalid_authorization_specification | ERROR (FATAL at startup) |
//! | unfenced transaction wrote under `--require-fence` (raised by the guard) | `25006` read_only_sql_transaction | ERROR |
//! | a statement after COMMIT/END/ROLLBACK/ABORT/PREPARE TRANSACTION in one query; a backslash while `standard_conforming_strings` is off; an unsupported BEGIN option | `0A000` feature_not_supported | ERROR |
//! | query text the Postgres parser rejects; several statements in one Parse | `42601` syntax_error | ERROR |
//! | SQL `EXECUTE` of transaction control prepared through the extended protocol; prepared transaction control naming a savepoint or transaction identifier that is not printable ASCII | `0A000` feature_not_supported | ERROR |
//! | a name with the proxy's prefix `__lockd_fence_proxy` (any case): a statement or portal name in Parse, Bind, Describe, Execute or Close; a prepared statement name in SQL `PREPARE`/`EXECUTE`/`DEALLOCATE`; a cursor name in `DECLARE`/`FETCH`/`MOVE`/`CLOSE`; a savepoint name | `42939` reserved_name | ERROR |
//! | a statement or portal name that is not ASCII in a Parse, Bind, Describe, Execute or Close | `42602` invalid_name | ERROR |
//! | Bind of the unnamed statement after a Parse of it failed (unknown to the proxy) | `26000` invalid_sql_statement_name | ERROR |
//! | guard function missing in the session's database | `42883` undefined_function | ERROR |
//! | role not granted EXECUTE on the guard function | `42501` insufficient_privilege | ERROR |
//! | message longer than `--max-message-bytes`, statement or portal name too long, too many tracked names | `54000` program_limit_exceeded | FATAL |
//! | malformed frame (bytes after the last field, short fields, inconsistent counts, a message type a client does not send) or startup packet, unsupported protocol version | `08P01` protocol_violation | FATAL |
//! | upstream unreachable or its connection lost | `08006` connection_failure | FATAL |
//! | `--max-sessions` reached | `53300` too_many_connections | FATAL |
//! | proxy shutting down | `57P01` admin_shutdown | FATAL |
//!
//! Every message starts with `fence-proxy: ` and names the values involved. Errors of the upstream
//! (including `25006` read_only_sql_transaction of a write in a transaction the guard made
//! read-only) pass through unchanged.

use bytes::{BufMut, BytesMut};

use crate::codec::Message;

/// SQLSTATE of a stale fencing token: the session lost the lock it names.
pub const STALE_TOKEN: &str = "55P03";
/// SQLSTATE of a malformed fence value.
pub const BAD_FENCE: &str = "22023";
/// SQLSTATE of a sequencer that does not verify, or a fence value the proxy did not verify.
pub const BAD_SEQUENCER: &str = "42501";
/// SQLSTATE of a plain token where a signed sequencer is required.
pub const SEQUENCER_REQUIRED: &str = "28000";
/// SQLSTATE of a statement shape the proxy cannot fence.
pub const NOT_SUPPORTED: &str = "0A000";
/// SQLSTATE of query text the Postgres parser rejects.
pub const SYNTAX_ERROR: &str = "42601";
/// Query text that is not valid UTF-8, or a session whose client_encoding is not UTF8.
pub const CHARACTER_NOT_IN_REPERTOIRE: &str = "22021";
/// SQLSTATE of a missing guard function (a database where `init` did not run).
pub const GUARD_MISSING: &str = "42883";
/// SQLSTATE of a role that may not execute the guard function.
pub const INSUFFICIENT_PRIVILEGE: &str = "42501";
/// SQLSTATE of a client name (savepoint, prepared statement, portal, cursor) with the proxy's
/// reserved prefix.
pub const RESERVED_NAME: &str = "42939";
/// SQLSTATE of a statement or portal name in a protocol frame that is not ASCII (Postgres reads
/// it in `client_encoding`, the proxy could not know which name the server means).
pub const INVALID_NAME: &str = "42602";
/// SQLSTATE of a Bind of a prepared statement the proxy does not know (the unnamed statement
/// after a failed Parse), as Postgres answers a Bind of a statement that does not exist.
pub const INVALID_STATEMENT_NAME: &str = "26000";
/// SQLSTATE of a size or count limit.
pub const LIMIT_EXCEEDED: &str = "54000";
/// SQLSTATE of a protocol violation by a peer.
pub const PROTOCOL_VIOLATION: &str = "08P01";
/// SQLSTATE of a lost or unreachable upstream.
pub const CONNECTION_FAILURE: &str = "08006";
/// SQLSTATE of the session limit.
pub const TOO_MANY_CONNECTIONS: &str = "53300";
/// SQLSTATE of the proxy's shutdown.
pub const ADMIN_SHUTDOWN: &str = "57P01";
/// invalid_authorization_specification: a client outside `--allow-client`, or without TLS under
/// `--require-tls` (what Postgres answers when no pg_hba.conf line matches).
pub const INVALID_AUTHORIZATION: &str = "28000";
/// The proxy could not run its own machinery (a thread that could not be started).
pub const INTERNAL_ERROR: &str = "XX000";

/// An error the proxy reports to a client itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxyError {
    /// `ERROR` keeps the session; `FATAL` ends it.
    pub fatal: bool,
    /// Five-character SQLSTATE from the table above.
    pub code: &'static str,
    /// The full message, starting with `fence-proxy: `.
    pub message: String,
    /// Optional hint on what to do instead.
    pub hint: Option<String>,
}

impl ProxyError {
    pub fn error(code: &'static str, message: impl std::fmt::Display) -> Self {
        ProxyError {
            fatal: false,
            code,
            message: format!("fence-proxy: {message}"),
            hint: None,
        }
    }

    pub fn fatal(code: &'static str, message: impl std::fmt::Display) -> Self {
        ProxyError {
            fatal: true,
            ..Self::error(code, message)
        }
    }

    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }

    /// The ErrorResponse message carrying this error.
    pub fn to_message(&self) -> Message {
        let severity = if self.fatal { "FATAL" } else { "ERROR" };
        let mut body = BytesMut::new();
        for (field, value) in [
            (b'S', severity),
            (b'V', severity),
            (b'C', self.code),
            (b'M', self.message.as_str()),
        ]
        .into_iter()
        .chain(self.hint.as_deref().map(|h| (b'H', h)))
        {
            body.put_u8(field);
            // A NUL inside a field would end it early on the client side.
            body.put_slice(value.replace('\0', "\\0").as_bytes());
            body.put_u8(0);
        }
        body.put_u8(0);
        Message::new(b'E', &body)
    }
}

/// ReadyForQuery with the given transaction status (`I`, `T` or `E`).
pub fn ready_for_query(status: u8) -> Message {
    Message::new(b'Z', &[status])
}

/// The SQLSTATE of an ErrorResponse body, if it has one.
pub fn error_code(body: &[u8]) -> Option<String> {
    error_field(body, b'C')
}

/// One field of an ErrorResponse or NoticeResponse body.
pub fn error_field(body: &[u8], wanted: u8) -> Option<String> {
    let mut rest = body;
    while let Some((&field, tail)) = rest.split_first() {
        if field == 0 {
            return None;
        }
        let end = tail.iter().position(|&b| b == 0)?;
        if field == wanted {
            return Some(String::from_utf8_lossy(&tail[..end]).into_owned());
        }
        rest = &tail[end + 1..];
    }
    None
}

/// An ErrorResponse or NoticeResponse with its error cursor (`P`, a 1-based character index
/// into the query text the server ran) mapped to the client's text by `original` (for a Query
/// the proxy rewrote); a cursor `original` maps to `None` (into the proxy's own text) is
/// dropped. A message without a cursor, or one the proxy cannot read, is returned as it came.
pub fn remap_position(m: &Message, original: impl Fn(i64) -> Option<i64>) -> Message {
    let body = m.body();
    let mut fields: Vec<(u8, &[u8])> = Vec::new();
    let mut rest = body;
    loop {
        let Some((&field, tail)) = rest.split_first() else {
            return m.clone();
        };
        if field == 0 {
            break;
        }
        let Some(end) = tail.iter().position(|&b| b == 0) else {
            return m.clone();
        };
        fields.push((field, &tail[..end]));
        rest = &tail[end + 1..];
    }
    if !fields.iter().any(|(f, _)| *f == b'P') {
        return m.clone();
    }
    let mut out = Vec::with_capacity(body.len());
    for (field, value) in fields {
        if field == b'P' {
            let moved = std::str::from_utf8(value)
                .ok()
                .and_then(|v| v.parse::<i64>().ok())
                .and_then(&original)
                .filter(|p| *p >= 1);
            match moved {
                Some(p) => {
                    out.push(b'P');
                    out.extend_from_slice(p.to_string().as_bytes());
                    out.push(0);
                }
                None => continue,
            }
        } else {
            out.push(field);
            out.extend_from_slice(value);
            out.push(0);
        }
    }
    out.push(0);
    Message::new(m.tag, &out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_cursor_moves_back_over_the_proxys_statements() {
        let with = |fields: &[(u8, &str)]| {
            let mut body = Vec::new();
            for (f, v) in fields {
                body.push(*f);
                body.extend_from_slice(v.as_bytes());
                body.push(0);
            }
            body.push(0);
            Message::new(b'E', &body)
        };
        let m = with(&[(b'S', "ERROR"), (b'C', "42601"), (b'P', "30"), (b'M', "x")]);
        let moved = remap_position(&m, |p| Some(p - 20));
        assert_eq!(error_field(moved.body(), b'P').as_deref(), Some("10"));
        assert_eq!(error_field(moved.body(), b'M').as_deref(), Some("x"));
        assert_eq!(error_field(moved.body(), b'C').as_deref(), Some("42601"));
        // A cursor inside the proxy's own text is dropped, the rest kept.
        let dropped = remap_position(&m, |_| None);
        assert_eq!(error_field(dropped.body(), b'P'), None);
        assert_eq!(error_field(dropped.body(), b'M').as_deref(), Some("x"));
        assert_eq!(
            error_field(remap_position(&m, |p| Some(p - 30)).body(), b'P'),
            None
        );
        // Without a cursor, or unreadable: unchanged.
        let plain = with(&[(b'C', "22012"), (b'M', "division by zero")]);
        assert_eq!(remap_position(&plain, |p| Some(p - 5)).frame, plain.frame);
        let cut = Message::new(b'E', b"Cabc");
        assert_eq!(remap_position(&cut, |p| Some(p - 5)).frame, cut.frame);
    }

    #[test]
    fn error_response_round_trips_its_fields() {
        let e = ProxyError::error(BAD_FENCE, "fence \"x\" must look like <resource>:<token>")
            .with_hint("use SET lockd.fence = 'orders:42'");
        let m = e.to_message();
        assert_eq!(m.tag, b'E');
        assert_eq!(error_code(m.body()).as_deref(), Some("22023"));
        let msg = error_field(m.body(), b'M').unwrap();
        assert!(msg.starts_with("fence-proxy: fence \"x\""), "{msg}");
        assert_eq!(error_field(m.body(), b'S').as_deref(), Some("ERROR"));
        assert!(error_field(m.body(), b'H').unwrap().contains("orders:42"));
    }
}
