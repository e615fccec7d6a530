//! Fuzz target: the complete reading of client messages by fence-proxy's Postgres front end
//! (`fence-proxy/postgres/src/frontend.rs`), on which rests that the proxy and the server read
//! every forwarded frame alike.
//!
//! The module is private to its crate, so it is compiled here from the very same source file
//! (`#[path]`): what is fuzzed is the shipped code, not a copy.
//!
//! The input's first byte is the message type (mostly one a client sends), the rest its body.
//! Checked against a reading of the body written here from the server's own rules
//! (`pq_getmsgstring`, `pq_getmsgint`, `pq_getmsgbytes`, `pq_getmsgend`), field by field:
//! - decoding never panics, and accepts exactly the bodies that reading accepts;
//! - what it returns (names, texts, types, row limits) is what that reading finds;
//! - the message grammar has no prefix codes: a body that decodes does not decode with its last
//!   byte cut off, nor with a byte appended (CopyData excepted, whose body is all payload).
#![no_main]

#[allow(dead_code, reason = "the target uses part of the shipped module")]
#[path = "../../fence-proxy/postgres/src/frontend.rs"]
mod frontend;

use bytes::Bytes;
use frontend::{Frontend, Target};
use libfuzzer_sys::fuzz_target;

/// Message types a client sends in a session, which most inputs should hit.
const TAGS: &[u8] = b"QPBEDCSHXFdcf";

/// A reader of a body by the server's rules, independent of the one under test.
struct Model<'a> {
    body: &'a [u8],
    at: usize,
}

impl<'a> Model<'a> {
    fn cstr(&mut self) -> Option<&'a [u8]> {
        let rest = &self.body[self.at..];
        let nul = rest.iter().position(|b| *b == 0)?;
        self.at += nul + 1;
        Some(&rest[..nul])
    }

    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.at.checked_add(n)?;
        let s = self.body.get(self.at..end)?;
        self.at = end;
        Some(s)
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_be_bytes([b[0], b[1]]))
    }

    fn i32(&mut self) -> Option<i32> {
        self.take(4).map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    /// `count` values, each a signed length (-1 = NULL) and that many bytes.
    fn values(&mut self, count: u16) -> Option<()> {
        for _ in 0..count {
            match self.i32()? {
                -1 => {}
                n if n < 0 => return None,
                n => {
                    self.take(n as usize)?;
                }
            }
        }
        Some(())
    }

    /// Format codes are two bytes each; their values are the server's business.
    fn formats(&mut self, count: u16) -> Option<()> {
        self.take(2 * count as usize).map(|_| ())
    }

    fn target(&mut self) -> Option<Target> {
        match self.take(1)?[0] {
            b'S' => Some(Target::Statement),
            b'P' => Some(Target::Portal),
            _ => None,
        }
    }

    fn end(&self) -> Option<()> {
        (self.at == self.body.len()).then_some(())
    }
}

/// Formats may be absent, one for all, or one per value.
fn formats_fit(formats: u16, values: u16) -> Option<()> {
    (formats <= 1 || formats == values).then_some(())
}

/// What the server would read from this frame, or `None` where it refuses it.
fn model(tag: u8, body: &[u8]) -> Option<Frontend> {
    let b = |s: &[u8]| Bytes::copy_from_slice(s);
    let mut m = Model { body, at: 0 };
    let msg = match tag {
        b'Q' => Frontend::Query { text: b(m.cstr()?) },
        b'P' => {
            let name = b(m.cstr()?);
            let text = b(m.cstr()?);
            let n = m.u16()?;
            let mut param_types = Vec::new();
            for _ in 0..n {
                param_types.push(m.i32()? as u32);
            }
            Frontend::Parse {
                name,
                text,
                param_types,
            }
        }
        b'B' => {
            let portal = b(m.cstr()?);
            let statement = b(m.cstr()?);
            let formats = m.u16()?;
            m.formats(formats)?;
            let params = m.u16()?;
            formats_fit(formats, params)?;
            m.values(params)?;
            let results = m.u16()?;
            m.formats(results)?;
            Frontend::Bind { portal, statement }
        }
        b'E' => Frontend::Execute {
            portal: b(m.cstr()?),
            max_rows: m.i32()?,
        },
        b'D' | b'C' => {
            let target = m.target()?;
            let name = b(m.cstr()?);
            if tag == b'D' {
                Frontend::Describe { target, name }
            } else {
                Frontend::Close { target, name }
            }
        }
        b'S' => Frontend::Sync,
        b'H' => Frontend::Flush,
        b'X' => Frontend::Terminate,
        b'F' => {
            m.i32()?;
            let formats = m.u16()?;
            m.formats(formats)?;
            let args = m.u16()?;
            formats_fit(formats, args)?;
            m.values(args)?;
            m.u16()?;
            Frontend::FunctionCall
        }
        b'd' => {
            m.at = body.len();
            Frontend::CopyData
        }
        b'c' => Frontend::CopyDone,
        b'f' => {
            m.cstr()?;
            Frontend::CopyFail
        }
        _ => return None,
    };
    m.end()?;
    Some(msg)
}

fuzz_target!(|data: &[u8]| {
    let Some((&first, body)) = data.split_first() else {
        return;
    };
    // Most inputs get a client message type; an eighth keep their byte as it is.
    let tag = if first >= 0xe0 {
        first
    } else {
        TAGS[first as usize % TAGS.len()]
    };
    let decoded = frontend::decode(tag, Bytes::copy_from_slice(body)).ok();
    assert_eq!(decoded, model(tag, body), "tag {tag:#04x}, body {body:02x?}");
    if decoded.is_none() || tag == b'd' {
        return;
    }
    if let Some((_, cut)) = body.split_last() {
        assert!(
            frontend::decode(tag, Bytes::copy_from_slice(cut)).is_err(),
            "tag {tag:#04x}: a body and its cut both decode: {body:02x?}"
        );
    }
    let mut longer = body.to_vec();
    longer.push(0);
    assert!(
        frontend::decode(tag, Bytes::from(longer)).is_err(),
        "tag {tag:#04x}: a body and a byte more both decode: {body:02x?}"
    );
});
