//! Fuzz target: the Postgres wire framing of fence-proxy (`fence-proxy/postgres/src/codec.rs`),
//! fed arbitrary bytes in arbitrary splits, as the client and the upstream side both use it.
//!
//! The module is private to its crate, so it is compiled here from the very same source file
//! (`#[path]`) with the crate's own `limits.rs`: what is fuzzed is the shipped code, not a copy.
//!
//! Checked: decoding never panics; every frame returned is exactly `1 + declared length` bytes,
//! starts with its tag and has a body within the bound; the decoder never asks for more buffer
//! than one bounded frame; after an error nothing is returned as a frame; `read_cstr` never
//! panics and consumes only through the first NUL.
#![no_main]

#[allow(dead_code, reason = "the target uses part of the shipped module")]
#[path = "../../fence-proxy/postgres/src/limits.rs"]
mod limits;

#[allow(dead_code, reason = "the target uses part of the shipped module")]
#[path = "../../fence-proxy/postgres/src/codec.rs"]
mod codec;

use bytes::BytesMut;
use libfuzzer_sys::fuzz_target;
use tokio_util::codec::Decoder;

/// A small bound, so that inputs can cross it; the real default is 64 MiB.
const MAX_BODY_BYTES: usize = 512;

/// Slack the buffer may carry beyond twice one bounded frame, as `BytesMut` rounds allocations.
const CAPACITY_SLACK: usize = 64;

fuzz_target!(|data: &[u8]| {
    if data.is_empty() {
        return;
    }
    // The first byte chooses how the rest is cut into reads, as a socket would deliver it.
    let step = (data[0] as usize % 64) + 1;
    let input = &data[1..];
    let mut codec = codec::MessageCodec {
        max_body_bytes: MAX_BODY_BYTES,
    };
    let mut src = BytesMut::new();
    let mut fed = 0;
    let mut failed = false;
    while fed < input.len() && !failed {
        let end = (fed + step).min(input.len());
        src.extend_from_slice(&input[fed..end]);
        fed = end;
        loop {
            let before = src.len();
            match codec.decode(&mut src) {
                Ok(Some(msg)) => {
                    let frame = &msg.frame;
                    assert!(frame.len() >= 5, "frame shorter than its header");
                    assert_eq!(frame[0], msg.tag);
                    let declared =
                        i32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize;
                    assert_eq!(
                        frame.len(),
                        declared + 1,
                        "frame length differs from its header"
                    );
                    assert!(msg.body().len() <= MAX_BODY_BYTES, "body above the bound");
                    assert_eq!(
                        src.len(),
                        before - frame.len(),
                        "consumed more than one frame"
                    );
                }
                Ok(None) => {
                    assert_eq!(src.len(), before, "a partial frame was consumed");
                    // A decoder that reserved what a hostile length declares (up to 2 GiB) would
                    // fail here; BytesMut may double an allocation, hence the factor.
                    assert!(
                        src.capacity() <= 2 * (before + MAX_BODY_BYTES + 5) + CAPACITY_SLACK,
                        "buffer grew to {} for {before} buffered bytes",
                        src.capacity()
                    );
                    break;
                }
                Err(_) => {
                    failed = true;
                    break;
                }
            }
        }
    }

    // read_cstr on the raw input: stops after the first NUL, never panics.
    let mut rest: &[u8] = input;
    if let Some(s) = codec::read_cstr(&mut rest) {
        let nul = input.iter().position(|&b| b == 0).expect("a NUL was found");
        assert_eq!(rest.len(), input.len() - nul - 1);
        assert_eq!(s, String::from_utf8_lossy(&input[..nul]));
    } else {
        assert!(!input.contains(&0));
        assert_eq!(rest.len(), input.len());
    }
});
