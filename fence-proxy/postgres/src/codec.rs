//! Length-bounded framing of Postgres protocol messages.
//!
//! Every regular message is one type byte and a big-endian `i32` length that counts itself but not
//! the type byte. The decoder checks the length against the bound before buffering the body, and
//! never reserves the declared length up front, so a peer cannot make the proxy allocate more
//! than the bound per message, nor more than it actually sent.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::codec::Decoder;

use crate::limits::MAX_STARTUP_PACKET_BYTES;

/// One complete protocol message, kept as the original bytes so it can be forwarded unchanged.
#[derive(Debug, Clone)]
pub struct Message {
    /// The type byte (`Q`, `P`, `Z`, ...).
    pub tag: u8,
    /// The whole frame: type byte, length and body, exactly as received.
    pub frame: Bytes,
}

impl Message {
    /// The body after the type byte and the length.
    pub fn body(&self) -> &[u8] {
        &self.frame[5..]
    }

    /// Builds a message from a type byte and a body.
    pub fn new(tag: u8, body: &[u8]) -> Message {
        let mut frame = BytesMut::with_capacity(body.len() + 5);
        frame.put_u8(tag);
        frame.put_i32((body.len() + 4) as i32);
        frame.put_slice(body);
        Message {
            tag,
            frame: frame.freeze(),
        }
    }
}

/// Why a peer's bytes could not be framed.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    #[error("message type {tag:?} declares length {len}, below the minimum of 4")]
    BadLength { tag: char, len: i32 },
    #[error("message type {tag:?} of {len} bytes exceeds the limit of {max} bytes")]
    TooLong { tag: char, len: usize, max: usize },
    #[error("startup packet declares length {len}, outside 8..={max}")]
    BadStartupLength { len: i32, max: usize },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Decoder of regular (typed) protocol messages with a bound on the body length.
pub struct MessageCodec {
    /// Largest accepted body, in bytes.
    pub max_body_bytes: usize,
}

impl Decoder for MessageCodec {
    type Item = Message;
    type Error = FrameError;

    fn decode(&mut self, src: &mut BytesMut) -> Result<Option<Message>, FrameError> {
        if src.len() < 5 {
            return Ok(None);
        }
        let tag = src[0];
        let len = i32::from_be_bytes([src[1], src[2], src[3], src[4]]);
        if len < 4 {
            return Err(FrameError::BadLength {
                tag: tag as char,
                len,
            });
        }
        let body = len as usize - 4;
        if body > self.max_body_bytes {
            return Err(FrameError::TooLong {
                tag: tag as char,
                len: body,
                max: self.max_body_bytes,
            });
        }
        let total = body + 5;
        if src.len() < total {
            // No reservation of the declared length: a peer that declares 64 MiB and sends five
            // bytes must not cost 64 MiB. The reader grows the buffer as bytes arrive.
            return Ok(None);
        }
        let frame = src.split_to(total).freeze();
        Ok(Some(Message { tag, frame }))
    }
}

/// Reads one untyped startup-phase packet (length, then a 4-byte code, then the rest) and returns
/// the whole packet including its length prefix.
pub async fn read_startup_packet<R: AsyncRead + Unpin>(
    reader: &mut R,
) -> Result<Bytes, FrameError> {
    let len = reader.read_i32().await?;
    if len < 8 || len as usize > MAX_STARTUP_PACKET_BYTES {
        return Err(FrameError::BadStartupLength {
            len,
            max: MAX_STARTUP_PACKET_BYTES,
        });
    }
    let mut packet = BytesMut::with_capacity(len as usize);
    packet.put_i32(len);
    packet.resize(len as usize, 0);
    reader.read_exact(&mut packet[4..]).await?;
    Ok(packet.freeze())
}

/// Reads a NUL-terminated string from the front of `buf`, advancing past the NUL (lossily
/// decoded: for the server's messages; client messages are read by `frontend`).
pub fn read_cstr(buf: &mut &[u8]) -> Option<String> {
    let end = buf.iter().position(|&b| b == 0)?;
    let s = String::from_utf8_lossy(&buf[..end]).into_owned();
    buf.advance(end + 1);
    Some(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoder_rejects_oversized_frames_before_buffering() {
        let mut codec = MessageCodec { max_body_bytes: 8 };
        let mut src = BytesMut::new();
        src.put_u8(b'Q');
        src.put_i32(4 + 9);
        let err = codec.decode(&mut src).unwrap_err();
        assert!(err.to_string().contains("9 bytes"), "{err}");
    }

    /// Robustness: a peer that declares a large message and sends nothing more must not make the
    /// proxy reserve the declared length.
    #[test]
    fn issue13_robustness_decoder_does_not_reserve_declared_length() {
        let mut codec = MessageCodec {
            max_body_bytes: 64 * 1024 * 1024,
        };
        let mut src = BytesMut::new();
        src.put_u8(b'Q');
        src.put_i32(60 * 1024 * 1024);
        assert!(codec.decode(&mut src).unwrap().is_none());
        assert!(
            src.capacity() < 1024 * 1024,
            "reserved {} bytes for a 5-byte header",
            src.capacity()
        );
    }

    #[test]
    fn decoder_returns_whole_frames() {
        let mut codec = MessageCodec { max_body_bytes: 8 };
        let mut src = BytesMut::new();
        src.extend_from_slice(&Message::new(b'Q', b"x\0").frame);
        src.extend_from_slice(&[b'S', 0, 0]);
        let m = codec.decode(&mut src).unwrap().unwrap();
        assert_eq!(m.tag, b'Q');
        assert_eq!(m.body(), b"x\0");
        assert!(codec.decode(&mut src).unwrap().is_none());
        let mut short = BytesMut::from(&[b'Z', 0, 0, 0, 3][..]);
        assert!(codec.decode(&mut short).is_err());
    }
}
