//! Prints what one sequencer costs: signing (on the leader, per grant) and verifying (in
//! fence-proxy, per fenced write), as the median of several rounds of many operations.
//!
//! `cargo run --release -p lockd-fence --example sequencer_cost [-- ROUNDS OPS]`

use std::time::Instant;

use lockd_fence::FencingToken;
use lockd_fence::sequencer::{SigningKey, VerifyKeys, decode_text, encode_text};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let rounds: usize = args
        .next()
        .map_or(7, |a| a.parse().expect("ROUNDS is a number"));
    let ops: usize = args
        .next()
        .map_or(20_000, |a| a.parse().expect("OPS is a number"));
    let key = SigningKey::generate();
    let keys = VerifyKeys::new([key.public_key(), SigningKey::generate().public_key()]);
    let resource = "orders/4711";
    let (mut sign_ns, mut verify_ns) = (Vec::new(), Vec::new());
    let mut checksum = 0u64;
    for _ in 0..rounds {
        let started = Instant::now();
        let mut texts = Vec::with_capacity(ops);
        for t in 0..ops as u64 {
            texts.push(encode_text(&key.sign(
                resource,
                FencingToken(t),
                1_700_000_000_000,
            )));
        }
        sign_ns.push(started.elapsed().as_nanos() as f64 / ops as f64);
        let started = Instant::now();
        for text in &texts {
            let bytes = decode_text(text).expect("own encoding decodes");
            let seq = keys
                .verify_for(&bytes, resource, None)
                .expect("own signature verifies");
            checksum = checksum.wrapping_add(seq.token.0);
        }
        verify_ns.push(started.elapsed().as_nanos() as f64 / ops as f64);
    }
    println!(
        "sequencer cost over {rounds} rounds of {ops}: sign+encode {:.1} us, decode+verify {:.1} us \
         (median per operation; one core; checksum {checksum})",
        median(sign_ns) / 1000.0,
        median(verify_ns) / 1000.0
    );
}
