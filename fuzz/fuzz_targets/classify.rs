//! Fuzz target: `fence_proxy_postgres::classify::classify`, the reading of client SQL by
//! Postgres's own parser (pg_query) that the Postgres front end's guard placement rests on.
//!
//! Checked, for every text the parser accepts:
//! - no panic, and the same answer twice (the parser is pure);
//! - statement starts increase and lie on character boundaries;
//! - the split the session makes before a final COMMIT holds: the text before the last
//!   statement's start classifies as exactly the earlier statements, and the text from it as
//!   exactly the last statement (session.rs sends the two halves with the guard between them);
//! - every statement's own slice classifies alone as the same kind (no kind depends on context);
//! - a `BEGIN` the proxy rebuilt from the parse tree reads back as the same `BEGIN`.
#![no_main]

use fence_proxy_postgres::classify::{Statement, StatementKind, classify};
use libfuzzer_sys::fuzz_target;

fn kinds(stmts: &[Statement]) -> Vec<StatementKind> {
    stmts.iter().map(|s| s.kind.clone()).collect()
}

fn reclassify(sql: &str, what: &str, whole: &str) -> Vec<StatementKind> {
    match classify(sql) {
        Ok(stmts) => kinds(&stmts),
        Err(e) => panic!("{what} {sql:?} of accepted {whole:?} is refused: {e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(sql) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(stmts) = classify(sql) else {
        return;
    };
    assert_eq!(classify(sql), Ok(stmts.clone()), "{sql:?}");
    for s in &stmts {
        assert!(sql.is_char_boundary(s.start), "{sql:?}: start {}", s.start);
    }
    for w in stmts.windows(2) {
        assert!(w[0].start < w[1].start, "{sql:?}: starts {stmts:?}");
    }
    if let Some((last, earlier)) = stmts.split_last() {
        let prefix = &sql[..last.start];
        assert_eq!(reclassify(prefix, "prefix", sql), kinds(earlier), "{sql:?}");
        let tail = &sql[last.start..];
        assert_eq!(
            reclassify(tail, "tail", sql),
            vec![last.kind.clone()],
            "{sql:?}"
        );
    }
    for (i, s) in stmts.iter().enumerate() {
        let end = stmts.get(i + 1).map_or(sql.len(), |n| n.start);
        let own = &sql[s.start..end];
        assert_eq!(
            reclassify(own, "statement", sql),
            vec![s.kind.clone()],
            "{sql:?}"
        );
        if let StatementKind::Begin(rebuilt) = &s.kind {
            assert_eq!(
                reclassify(rebuilt, "rebuilt BEGIN", sql),
                vec![s.kind.clone()],
                "{sql:?}"
            );
        }
    }
});
