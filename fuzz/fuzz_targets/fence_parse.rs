//! Fuzz target: the fence values clients send (`Lock-Resource` + `Fencing-Token` headers of the
//! HTTP front end, `lockd.fence = '<resource>:<token>'` of the Postgres front end), parsed by
//! `lockd-fence`.
//!
//! Checked: parsing never panics; an accepted token is plain decimal digits and prints back to
//! the same text (one spelling per token); an accepted fence has a valid resource, and printing
//! and parsing it again gives the same fence.
#![no_main]

use libfuzzer_sys::fuzz_target;
use lockd_fence::{Fence, FencingToken, validate_resource};

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(token) = text.parse::<FencingToken>() {
        assert!(text.bytes().all(|b| b.is_ascii_digit()), "{text:?}");
        // Leading zeros are the one other spelling digits allow; they parse to the same value.
        assert_eq!(token.to_string().parse::<FencingToken>(), Ok(token));
        assert_eq!(
            text.trim_start_matches('0').len().max(1),
            token.to_string().len()
        );
    }
    match text.parse::<Fence>() {
        Ok(fence) => {
            assert!(validate_resource(&fence.resource).is_ok(), "{text:?}");
            let again: Fence = fence.to_string().parse().expect("a printed fence parses");
            assert_eq!(again, fence);
        }
        Err(e) => {
            // The message names the value that was refused.
            let _ = e.to_string();
        }
    }
    let _ = validate_resource(text);
});
