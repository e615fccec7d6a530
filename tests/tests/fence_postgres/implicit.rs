//! Review of branch fix-pg-implicit (HIGH): Parse, Bind and Describe at transaction status `I`
//! make the server start an implicit transaction, which the client's Sync commits; user code
//! runs there (a domain CHECK calling a writing function runs when a constant is coerced to the
//! domain at Parse, and when a parameter of the domain type is read at Bind). The proxy opened
//! its block only before an Execute, so a group without one (or the part of a group after a
//! client COMMIT or ROLLBACK) committed that code's writes with no guard.
//!
//! Setup per test: the `Attack` world (resource with token 42 recorded, rows carry the writer's
//! token) plus a function that inserts an attacker row (token 41) and returns true, and a domain
//! whose CHECK calls it. The attacker is fenced with the stale 41, or unfenced under
//! `--require-fence`. The oracle is the table: no row of 41 committed.

use bytes::{BufMut, BytesMut};
use lockd_tests::pg::{Attack, RawConn, wire};
use postgres_protocol::message::frontend;

/// The attack world and the domain `d` whose CHECK inserts a row of token 41, with its oid.
async fn world(require_fence: bool) -> (Attack, String, u32) {
    let a = Attack::new(require_fence, "implicit").await;
    let f = format!("{}_w", a.tbl);
    let d = format!("{}_d", a.tbl);
    a.direct
        .batch_execute(&format!(
            "CREATE FUNCTION {f}(int) RETURNS bool LANGUAGE plpgsql AS \
             $$BEGIN INSERT INTO {tbl} (token) VALUES (41); RETURN true; END$$; \
             CREATE DOMAIN {d} AS int CHECK ({f}(VALUE));",
            tbl = a.tbl
        ))
        .await
        .unwrap();
    let oid: u32 = a
        .direct
        .query_one(&format!("SELECT '{d}'::regtype::oid"), &[])
        .await
        .unwrap()
        .get(0);
    (a, d, oid)
}

/// Writes one attack's messages.
type Builds<'a> = Box<dyn Fn(&mut BytesMut) + 'a>;

/// Parse with parameter types.
fn parse_typed(name: &str, sql: &str, types: &[u32], out: &mut BytesMut) {
    frontend::parse(name, sql, types.iter().copied(), out).unwrap();
}

/// Bind with text parameter values.
fn bind_values(portal: &str, statement: &str, values: &[&str], out: &mut BytesMut) {
    frontend::bind(
        portal,
        statement,
        std::iter::empty(),
        values.iter().copied(),
        |v: &str, buf: &mut BytesMut| {
            buf.put_slice(v.as_bytes());
            Ok(postgres_protocol::IsNull::No)
        },
        std::iter::empty(),
        out,
    )
    .map_err(|_| "bind")
    .unwrap();
}

/// The attacker's session: fenced with the stale 41, or unfenced under `--require-fence`.
async fn attacker(a: &Attack, require_fence: bool) -> RawConn {
    a.attacker((!require_fence).then_some(41)).await
}

/// Goal: no message of the extended protocol runs client code in an implicit transaction that
/// the client's Sync commits. Method: groups with no Execute (Parse of a constant cast to the
/// domain; Parse with a parameter of the domain type and its Bind; Describe of the statement;
/// Bind of a prepared BEGIN whose parameter has the domain type) and groups whose part after a
/// client COMMIT or ROLLBACK has none, each on a fresh attacker session; then the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn review_parse_bind_describe_at_idle_commit_nothing_unguarded() {
    lockd_tests::skip_without_postgres!();
    let mut broken = Vec::new();
    for require_fence in [false, true] {
        let (a, d, oid) = world(require_fence).await;
        let variants: Vec<(&str, Builds<'_>)> = vec![
            (
                "Parse of a constant cast to the domain, Sync",
                Box::new(|out| wire::parse("", &format!("SELECT '{{1}}'::{d}[]"), out)),
            ),
            (
                "Parse with a domain parameter, Bind, Sync",
                Box::new(move |out| {
                    parse_typed("", "SELECT $1", &[oid], out);
                    bind_values("", "", &["1"], out);
                }),
            ),
            (
                "Parse named, Describe statement, Sync",
                Box::new(|out| {
                    wire::parse("n1", &format!("SELECT '{{1}}'::{d}[]"), out);
                    frontend::describe(b'S', "n1", out).unwrap();
                }),
            ),
            (
                "COMMIT inside the group, then Parse and Bind, Sync",
                Box::new(move |out| {
                    wire::run("BEGIN", out);
                    wire::run("COMMIT", out);
                    parse_typed("", "SELECT $1", &[oid], out);
                    bind_values("", "", &["1"], out);
                }),
            ),
            (
                "ROLLBACK inside the group, then Parse, Sync",
                Box::new(|out| {
                    wire::run("BEGIN", out);
                    wire::run("ROLLBACK", out);
                    wire::parse("", &format!("SELECT '{{1}}'::{d}[]"), out);
                }),
            ),
        ];
        for (what, build) in &variants {
            let before = a.attacker_rows().await;
            let mut c = attacker(&a, require_fence).await;
            let mut out = BytesMut::new();
            build(&mut out);
            wire::sync(&mut out);
            c.send(&out).await;
            let r = c.read_until_ready().await;
            eprintln!("require_fence={require_fence}: {what} -> {r:?}");
            assert_eq!(r.status, b'I', "{what}: {r:?}");
            let committed = a.attacker_rows().await - before;
            if committed != 0 {
                broken.push(format!(
                    "require_fence={require_fence}: {what}: {committed} row(s) committed"
                ));
            }
        }
        let before = a.attacker_rows().await;
        // A prepared BEGIN whose (unused) parameter has the domain type: its Bind reads the
        // parameter, so the CHECK runs there too; Sync without the Execute.
        let mut c = attacker(&a, require_fence).await;
        let mut out = BytesMut::new();
        parse_typed("b", "BEGIN", &[oid], &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        assert!(r.errors.is_empty(), "Parse b = BEGIN: {r:?}");
        let mut out = BytesMut::new();
        bind_values("", "b", &["1"], &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        eprintln!("require_fence={require_fence}: Bind of a prepared BEGIN, Sync -> {r:?}");
        let committed = a.attacker_rows().await - before;
        if committed != 0 {
            broken.push(format!(
                "require_fence={require_fence}: Bind of a prepared BEGIN with a domain parameter, Sync: {committed} row(s) committed"
            ));
        }
    }
    assert!(broken.is_empty(), "{broken:#?}");
}

/// Goal: what the proxy adds around Parse, Bind and Describe at `I` changes nothing a client
/// sees of prepared statements: a named statement parsed in a group without an Execute (which
/// the proxy rolls back) is still there in the next group, and so is the unnamed one; the
/// Describe answers come through; an error in the group is the client's own.
/// Method: Parse+Describe+Sync of a named and of the unnamed statement, then Bind/Execute of
/// each in later groups; a Parse with a syntax error; through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_statements_survive_the_proxys_rollback() {
    lockd_tests::skip_without_postgres!();
    let a = Attack::new(false, "implicit").await;
    let mut c = a.attacker(None).await;
    let mut out = BytesMut::new();
    wire::parse("keep", "SELECT 7", &mut out);
    frontend::describe(b'S', "keep", &mut out).unwrap();
    wire::parse("", "SELECT 8", &mut out);
    frontend::describe(b'S', "", &mut out).unwrap();
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    assert!(r.errors.is_empty(), "{r:?}");
    // ParseComplete, ParameterDescription, RowDescription, twice.
    assert_eq!(r.tags, b"1tT1tT", "{r:?}");
    assert_eq!(r.status, b'I');
    for statement in ["keep", ""] {
        let mut out = BytesMut::new();
        wire::bind("", statement, &mut out);
        wire::execute("", &mut out);
        wire::sync(&mut out);
        c.send(&out).await;
        let r = c.read_until_ready().await;
        assert!(r.errors.is_empty(), "Bind/Execute {statement:?}: {r:?}");
        assert_eq!(r.completions, ["SELECT 1"], "{statement:?}: {r:?}");
        assert_eq!(r.status, b'I');
    }
    let mut out = BytesMut::new();
    wire::parse("", "SELEC 1", &mut out);
    wire::sync(&mut out);
    c.send(&out).await;
    let r = c.read_until_ready().await;
    assert_eq!(r.first_error(), "42601", "{r:?}");
    assert_eq!(r.errors.len(), 1, "{r:?}");
    assert_eq!(r.status, b'I');
    let r = c.query("SELECT 1").await;
    assert!(r.errors.is_empty(), "{r:?}");
}
