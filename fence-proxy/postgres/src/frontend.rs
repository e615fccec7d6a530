//! Complete reading of client (frontend) messages, field by field, as Postgres reads them.
//!
//! The proxy forwards most client frames byte for byte, so it must read each one as the server
//! will: a frame the server reads differently (bytes after the last field, a count that promises
//! more than the frame holds) makes the server do something the proxy did not plan for. In the
//! review of 2026-12-05 a Parse with one byte after its parameter types failed in the server
//! before the unnamed statement was replaced, while the proxy, which had read only the name and
//! the text, took the old statement for gone; the prepared COMMIT that stayed ended a block the
//! proxy believed open. So the session decodes every client frame here first, completely, and a
//! frame that does not decode is never forwarded: the session ends with `08P01`, as the server
//! ends a session on a protocol violation.
//!
//! Counts are read as the server reads them (`pq_getmsgint(msg, 2)`: unsigned 16 bits), value
//! lengths as signed 32 bits where -1 is NULL and any other negative length is refused (as
//! `pq_getmsgbytes` refuses it). Where the server checks two counts against each other in the
//! frame itself (Bind's and FunctionCall's parameter formats), so does the proxy. What depends on
//! server state (the number of parameters a statement takes, a function's arguments) is left to
//! the server, which refuses a mismatch with an error before running anything.

use bytes::Bytes;

/// Whether a Describe or Close names a prepared statement or a portal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    Statement,
    Portal,
}

/// One client message, read completely. Names and texts are the raw bytes the server reads
/// (up to, not including, their NUL); payloads the proxy never interprets are not kept.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Frontend {
    Query {
        text: Bytes,
    },
    Parse {
        name: Bytes,
        text: Bytes,
        /// The parameter types the client declared (an OID each, 0 = unspecified).
        param_types: Vec<u32>,
    },
    Bind {
        portal: Bytes,
        statement: Bytes,
    },
    Execute {
        portal: Bytes,
        max_rows: i32,
    },
    Describe {
        target: Target,
        name: Bytes,
    },
    Close {
        target: Target,
        name: Bytes,
    },
    Sync,
    Flush,
    Terminate,
    FunctionCall,
    CopyData,
    CopyDone,
    CopyFail,
}

/// Why a client frame was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed {what} message: {why}")]
pub struct Malformed {
    /// The message's name (`Parse`, `Bind`, ...) or its type byte.
    pub what: String,
    /// What was wrong, with the values involved.
    pub why: String,
}

/// The name of a message type for errors.
fn message_name(tag: u8) -> String {
    match tag {
        b'Q' => "Query".to_owned(),
        b'P' => "Parse".to_owned(),
        b'B' => "Bind".to_owned(),
        b'E' => "Execute".to_owned(),
        b'D' => "Describe".to_owned(),
        b'C' => "Close".to_owned(),
        b'S' => "Sync".to_owned(),
        b'H' => "Flush".to_owned(),
        b'X' => "Terminate".to_owned(),
        b'F' => "FunctionCall".to_owned(),
        b'd' => "CopyData".to_owned(),
        b'c' => "CopyDone".to_owned(),
        b'f' => "CopyFail".to_owned(),
        other => format!("type {:?}", other as char),
    }
}

/// A cursor over a message body that fails instead of reading past the end.
struct Reader {
    body: Bytes,
    at: usize,
}

impl Reader {
    fn short(&self, field: &str, wanted: usize) -> String {
        format!(
            "{field} needs {wanted} more byte(s) at offset {} of a {}-byte body",
            self.at,
            self.body.len()
        )
    }

    /// A NUL-terminated string (without its NUL).
    fn cstr(&mut self, field: &str) -> Result<Bytes, String> {
        let rest = &self.body[self.at..];
        let Some(end) = rest.iter().position(|&b| b == 0) else {
            return Err(format!(
                "{field} at offset {} has no terminating NUL",
                self.at
            ));
        };
        let s = self.body.slice(self.at..self.at + end);
        self.at += end + 1;
        Ok(s)
    }

    fn bytes(&mut self, field: &str, n: usize) -> Result<Bytes, String> {
        if self.body.len() - self.at < n {
            return Err(self.short(field, n));
        }
        let s = self.body.slice(self.at..self.at + n);
        self.at += n;
        Ok(s)
    }

    fn u8(&mut self, field: &str) -> Result<u8, String> {
        Ok(self.bytes(field, 1)?[0])
    }

    /// A 16-bit count, unsigned as the server reads it.
    fn u16(&mut self, field: &str) -> Result<u16, String> {
        let b = self.bytes(field, 2)?;
        Ok(u16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self, field: &str) -> Result<i32, String> {
        let b = self.bytes(field, 4)?;
        Ok(i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// `n` 16-bit format codes (their values are the server's to check).
    fn formats(&mut self, field: &str, n: u16) -> Result<(), String> {
        self.bytes(field, 2 * usize::from(n)).map(drop)
    }

    /// `n` values, each a 32-bit length (-1 = NULL) and that many bytes.
    fn values(&mut self, field: &str, n: u16) -> Result<(), String> {
        for i in 0..n {
            let len = self.i32(field)?;
            match usize::try_from(len) {
                Ok(len) => {
                    self.bytes(field, len)?;
                }
                Err(_) if len == -1 => {}
                Err(_) => return Err(format!("{field} {i} has the negative length {len}")),
            }
        }
        Ok(())
    }

    fn target(&mut self) -> Result<Target, String> {
        match self.u8("the target")? {
            b'S' => Ok(Target::Statement),
            b'P' => Ok(Target::Portal),
            other => Err(format!(
                "target {:?} is neither 'S' (statement) nor 'P' (portal)",
                other as char
            )),
        }
    }

    /// Nothing may follow the last field.
    fn end(&self) -> Result<(), String> {
        let left = self.body.len() - self.at;
        if left == 0 {
            Ok(())
        } else {
            Err(format!(
                "{left} byte(s) after its last field (at offset {} of a {}-byte body)",
                self.at,
                self.body.len()
            ))
        }
    }
}

/// Parameter or argument format codes: none, one for all, or one per value (the server refuses
/// any other count).
fn check_formats(what: &str, formats: u16, values: u16) -> Result<(), String> {
    if formats > 1 && formats != values {
        return Err(format!(
            "{formats} {what} formats for {values} {what}s (0, 1 or {values} allowed)"
        ));
    }
    Ok(())
}

/// Reads the body of a client message of type `tag` completely (see the module doc). `body` is
/// the frame after its type byte and length.
pub fn decode(tag: u8, body: Bytes) -> Result<Frontend, Malformed> {
    let mut r = Reader { body, at: 0 };
    let read = |r: &mut Reader| -> Result<Frontend, String> {
        let m = match tag {
            b'Q' => Frontend::Query {
                text: r.cstr("the query text")?,
            },
            b'P' => {
                let name = r.cstr("the statement name")?;
                let text = r.cstr("the query text")?;
                let n = r.u16("the parameter type count")?;
                let param_types = (0..n)
                    .map(|_| r.i32("a parameter type").map(|t| t as u32))
                    .collect::<Result<Vec<_>, _>>()?;
                Frontend::Parse {
                    name,
                    text,
                    param_types,
                }
            }
            b'B' => {
                let portal = r.cstr("the portal name")?;
                let statement = r.cstr("the statement name")?;
                let formats = r.u16("the parameter format count")?;
                r.formats("a parameter format", formats)?;
                let params = r.u16("the parameter count")?;
                check_formats("parameter", formats, params)?;
                r.values("parameter", params)?;
                let results = r.u16("the result format count")?;
                r.formats("a result format", results)?;
                Frontend::Bind { portal, statement }
            }
            b'E' => Frontend::Execute {
                portal: r.cstr("the portal name")?,
                max_rows: r.i32("the row limit")?,
            },
            b'D' => Frontend::Describe {
                target: r.target()?,
                name: r.cstr("the name")?,
            },
            b'C' => Frontend::Close {
                target: r.target()?,
                name: r.cstr("the name")?,
            },
            b'S' => Frontend::Sync,
            b'H' => Frontend::Flush,
            b'X' => Frontend::Terminate,
            b'F' => {
                r.i32("the function OID")?;
                let formats = r.u16("the argument format count")?;
                r.formats("an argument format", formats)?;
                let args = r.u16("the argument count")?;
                check_formats("argument", formats, args)?;
                r.values("argument", args)?;
                r.u16("the result format")?;
                Frontend::FunctionCall
            }
            b'd' => {
                // Data the proxy never reads: all of it is the payload.
                r.at = r.body.len();
                Frontend::CopyData
            }
            b'c' => Frontend::CopyDone,
            b'f' => {
                r.cstr("the error message")?;
                Frontend::CopyFail
            }
            _ => return Err("not a message type a client sends in a session".to_owned()),
        };
        r.end()?;
        Ok(m)
    };
    read(&mut r).map_err(|why| Malformed {
        what: message_name(tag),
        why,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use bytes::{BufMut, BytesMut};
    use postgres_protocol::message::frontend;
    use proptest::prelude::*;

    /// Splits encoded frames into (tag, body) pairs.
    fn frames(mut buf: &[u8]) -> Vec<(u8, Bytes)> {
        let mut out = Vec::new();
        while !buf.is_empty() {
            let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            out.push((buf[0], Bytes::copy_from_slice(&buf[5..1 + len])));
            buf = &buf[1 + len..];
        }
        out
    }

    fn decode_all(buf: &[u8]) -> Vec<Result<Frontend, Malformed>> {
        frames(buf)
            .into_iter()
            .map(|(tag, body)| decode(tag, body))
            .collect()
    }

    fn bind(out: &mut BytesMut, formats: &[i16], values: &[Option<&[u8]>], results: &[i16]) {
        frontend::bind(
            "p",
            "s",
            formats.iter().copied(),
            values.iter().copied(),
            |v, buf| match v {
                Some(v) => {
                    buf.put_slice(v);
                    Ok(postgres_protocol::IsNull::No)
                }
                None => Ok(postgres_protocol::IsNull::Yes),
            },
            results.iter().copied(),
            out,
        )
        .map_err(|_| "bind")
        .unwrap();
    }

    /// Every message a well-behaved client sends decodes, with the fields it carries.
    #[test]
    fn well_formed_messages_decode() {
        let mut out = BytesMut::new();
        frontend::query("SELECT 1", &mut out).unwrap();
        frontend::parse("s", "SELECT $1", [23u32, 0], &mut out).unwrap();
        bind(&mut out, &[1], &[Some(b"\0\0\0\x07"), None], &[0, 1]);
        frontend::execute("p", 10, &mut out).unwrap();
        frontend::describe(b'S', "s", &mut out).unwrap();
        frontend::close(b'P', "p", &mut out).unwrap();
        frontend::sync(&mut out);
        frontend::flush(&mut out);
        frontend::copy_done(&mut out);
        frontend::copy_fail("stop", &mut out).unwrap();
        frontend::terminate(&mut out);
        let got = decode_all(&out);
        assert!(got.iter().all(Result::is_ok), "{got:#?}");
        assert_eq!(
            got[1],
            Ok(Frontend::Parse {
                name: Bytes::from_static(b"s"),
                text: Bytes::from_static(b"SELECT $1"),
                param_types: vec![23, 0],
            })
        );
        assert_eq!(
            got[2],
            Ok(Frontend::Bind {
                portal: Bytes::from_static(b"p"),
                statement: Bytes::from_static(b"s"),
            })
        );
        assert_eq!(
            got[3],
            Ok(Frontend::Execute {
                portal: Bytes::from_static(b"p"),
                max_rows: 10
            })
        );
        assert_eq!(
            decode(b'd', Bytes::from_static(b"any\0bytes")),
            Ok(Frontend::CopyData)
        );
        // FunctionCall: oid, 1 format, 2 arguments (one NULL), result format.
        let mut f = BytesMut::new();
        f.put_i32(1234);
        f.put_u16(1);
        f.put_i16(1);
        f.put_u16(2);
        f.put_i32(2);
        f.put_slice(b"ab");
        f.put_i32(-1);
        f.put_i16(0);
        assert_eq!(decode(b'F', f.freeze()), Ok(Frontend::FunctionCall));
    }

    /// The review's frame: a Parse with one byte after its parameter types.
    #[test]
    fn review_parse_with_a_trailing_byte_is_refused() {
        let mut out = BytesMut::new();
        frontend::parse("", "SELECT 1", [], &mut out).unwrap();
        let (tag, body) = frames(&out).remove(0);
        let mut longer = body.to_vec();
        longer.push(0);
        let e = decode(tag, Bytes::from(longer)).unwrap_err();
        assert_eq!(e.what, "Parse");
        assert!(e.why.contains("1 byte(s) after its last field"), "{e}");
    }

    #[test]
    fn short_fields_and_inconsistent_counts_are_refused() {
        let refused = |tag: u8, body: &'static [u8]| decode(tag, Bytes::from_static(body)).is_err();
        // Parse declaring a type it does not carry; without its count; name without its NUL.
        assert!(refused(b'P', b"\0SELECT 1\0\0\x01"));
        assert!(refused(b'P', b"\0SELECT 1\0"));
        assert!(refused(b'P', b"s"));
        // Bind: two formats for no parameter; a negative length other than -1; a value shorter
        // than its length; a byte after the result formats.
        assert!(refused(b'B', b"\0\0\0\x02\0\0\0\0\0\0\0\0"));
        assert!(refused(b'B', b"\0\0\0\0\0\x01\xff\xff\xff\xfe\0\0"));
        assert!(refused(b'B', b"\0\0\0\0\0\x01\0\0\0\x05ab\0\0"));
        assert!(refused(b'B', b"\0\0\0\0\0\0\0\0\0"));
        // Execute without its row limit, or with a byte after it.
        assert!(refused(b'E', b"\0"));
        assert!(refused(b'E', b"\0\0\0\0\0\0"));
        // Describe and Close: unknown target, trailing byte.
        assert!(refused(b'D', b"X\0"));
        assert!(refused(b'C', b"S\0\0"));
        // Messages without fields, with a body.
        for tag in [b'S', b'H', b'X', b'c'] {
            assert!(refused(tag, b"x"), "{}", tag as char);
        }
        // Query: a byte after its NUL, or no NUL.
        assert!(refused(b'Q', b"COMMIT\0\0"));
        assert!(refused(b'Q', b"COMMIT"));
        // FunctionCall: three formats for two arguments; a byte at the end.
        assert!(refused(
            b'F',
            b"\0\0\0\x01\0\x03\0\0\0\0\0\0\0\x02\xff\xff\xff\xff\xff\xff\xff\xff\0\0"
        ));
        assert!(refused(b'F', b"\0\0\0\x01\0\0\0\0\0\0\0"));
        // A type a client does not send in a session (a password message, anything unknown).
        assert!(refused(b'p', b"secret\0"));
        assert!(refused(b'y', b""));
    }

    proptest! {
        /// Strictness both ways: a well-formed Parse or Bind with any fields decodes to exactly
        /// those fields, and the same frame with any bytes appended, or cut short anywhere,
        /// does not decode.
        #[test]
        fn a_frame_decodes_only_when_it_is_exactly_complete(
            name in "[a-z_0-9]{0,12}",
            text in "[ -~]{0,40}",
            types in prop::collection::vec(any::<u32>(), 0..4),
            values in prop::collection::vec(prop::option::of(prop::collection::vec(any::<u8>(), 0..6)), 0..4),
            one_format in any::<bool>(),
            results in prop::collection::vec(0i16..2, 0..3),
            extra in prop::collection::vec(any::<u8>(), 1..4),
            cut in any::<prop::sample::Index>(),
        ) {
            let text = text.replace('\0', "");
            let mut out = BytesMut::new();
            frontend::parse(&name, &text, types.iter().copied(), &mut out).unwrap();
            let formats: Vec<i16> = if one_format { vec![1] } else { vec![0; values.len()] };
            let values: Vec<Option<&[u8]>> = values.iter().map(|v| v.as_deref()).collect();
            bind(&mut out, &formats, &values, &results);
            for (tag, body) in frames(&out) {
                let decoded = decode(tag, body.clone());
                prop_assert!(decoded.is_ok(), "{decoded:?}");
                if let Ok(Frontend::Parse { name: n, text: t, param_types }) = decoded {
                    prop_assert_eq!(&n[..], name.as_bytes());
                    prop_assert_eq!(&t[..], text.as_bytes());
                    prop_assert_eq!(&param_types, &types);
                }
                let mut longer = body.to_vec();
                longer.extend_from_slice(&extra);
                prop_assert!(decode(tag, Bytes::from(longer)).is_err());
                let at = cut.index(body.len());
                let shorter = body.slice(..at);
                prop_assert!(decode(tag, shorter).is_err(), "cut at {}", at);
            }
        }

        /// No input makes the decoder panic, whatever the type byte.
        #[test]
        fn any_bytes_decode_or_are_refused(tag in any::<u8>(), body in prop::collection::vec(any::<u8>(), 0..64)) {
            let _ = decode(tag, Bytes::from(body));
        }
    }
}
