//! Review of branch fix-pg-implicit (MEDIUM): a lone `DISCARD ALL` at status `I`, what Npgsql's
//! pool sends on every checkout and PgBouncer's `server_reset_query`, always failed through the
//! proxy: it was wrapped in the proxy's block, where Postgres refuses it (25001).

use bytes::BytesMut;
use lockd_tests::pg::{Attack, wire};

/// Goal: a lone DISCARD ALL works through the proxy as directly, and what it resets is reset:
/// the session's fence (a write after it is unfenced, refused under `--require-fence`),
/// prepared statements (also in the proxy's own bound on tracked names), temporary tables.
/// Method: a session sets a newer fence (token 43) with SET, prepares statements the proxy
/// tracks (BEGIN) and a temporary table, sends DISCARD ALL pipelined with the next group (as
/// Npgsql does), then writes a row of token 41 without setting a fence again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_lone_discard_all_works_and_resets_the_session() {
    lockd_tests::skip_without_postgres!();
    for require_fence in [false, true] {
        let a = Attack::new(require_fence, "discard").await;
        let mut c = a.attacker(None).await;
        let r = c
            .query(&format!("SET lockd.fence = '{}:43'", a.resource))
            .await;
        assert!(r.errors.is_empty(), "SET 43: {r:?}");
        // Names the proxy tracks: it remembers at most 1,000 (limits::MAX_TRACKED_NAMES).
        let mut out = BytesMut::new();
        for i in 0..600 {
            wire::parse(&format!("b{i}"), "BEGIN", &mut out);
        }
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        assert!(r.errors.is_empty(), "600 prepared BEGINs: {:?}", r.errors);
        let r = c.query("CREATE TEMP TABLE scratch (v int)").await;
        assert!(r.errors.is_empty(), "temp table: {r:?}");

        // DISCARD ALL with the next group pipelined behind it, in one write.
        let mut out = BytesMut::new();
        postgres_protocol::message::frontend::query("DISCARD ALL", &mut out).unwrap();
        wire::run("SELECT current_setting('lockd.fence', true)", &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        assert!(
            r.errors.is_empty(),
            "require_fence={require_fence}: DISCARD ALL: {r:?}"
        );
        assert_eq!(r.completions, ["DISCARD ALL"], "{r:?}");
        assert_eq!(r.status, b'I', "{r:?}");
        let r = c.read_until_ready().await;
        assert!(r.errors.is_empty(), "the group behind DISCARD ALL: {r:?}");

        let r = c.query("SELECT * FROM scratch").await;
        assert_eq!(r.first_error(), "42P01", "the temp table is gone: {r:?}");
        let mut out = BytesMut::new();
        wire::bind("", "b0", &mut out);
        wire::execute("", &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        assert_eq!(
            r.first_error(),
            "26000",
            "the prepared statement is gone: {r:?}"
        );
        // 600 more tracked names: over the bound if the proxy still counted the old ones.
        let mut out = BytesMut::new();
        for i in 0..600 {
            wire::parse(&format!("c{i}"), "BEGIN", &mut out);
        }
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        assert!(
            r.errors.is_empty() && r.status == b'I',
            "600 new prepared BEGINs after DISCARD ALL: {:?}",
            r.errors
        );

        // The fence of the SET is gone: the write is unfenced.
        let r = c.query(&a.insert(41)).await;
        if require_fence {
            assert_eq!(r.first_error(), "25006", "unfenced write: {r:?}");
            a.assert_nothing_committed("write after DISCARD ALL under --require-fence")
                .await;
        } else {
            assert!(r.errors.is_empty(), "unfenced write: {r:?}");
            assert_eq!(a.rows_with_token(41).await, 1);
        }
        // The fence 43 was recorded by the SET's guard: the old holder of 42 is stale.
        let mut holder = a.attacker(Some(42)).await;
        let r = holder.query(&a.insert(42)).await;
        assert_eq!(r.first_error(), crate::STALE, "{r:?}");
    }
}
