//! What a client can make the proxy hold before it has authenticated.

use std::time::Duration;

use bytes::{BufMut, BytesMut};
use lockd_tests::pg::{self, PgProxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads one backend message: (tag, body).
async fn read_message(s: &mut TcpStream) -> (u8, Vec<u8>) {
    let tag = s.read_u8().await.unwrap();
    let len = s.read_i32().await.unwrap();
    let mut body = vec![0; len as usize - 4];
    s.read_exact(&mut body).await.unwrap();
    (tag, body)
}

/// The SQLSTATE and message of an ErrorResponse body.
fn error_fields(body: &[u8]) -> (String, String) {
    let (mut code, mut message) = (String::new(), String::new());
    for field in body.split(|b| *b == 0) {
        match field.split_first() {
            Some((b'C', v)) => code = String::from_utf8_lossy(v).into_owned(),
            Some((b'M', v)) => message = String::from_utf8_lossy(v).into_owned(),
            _ => {}
        }
    }
    (code, message)
}

async fn send_startup(s: &mut TcpStream, user: &str, database: &str) {
    let mut out = BytesMut::new();
    postgres_protocol::message::frontend::startup_message(
        [("user", user), ("database", database)],
        &mut out,
    )
    .unwrap();
    s.write_all(&out).await.unwrap();
}

/// Goal: before it has authenticated, a client cannot make the proxy buffer a message of
/// `--max-message-bytes` (64 MiB by default; a thousand such clients, 64 GiB): its answers to the
/// upstream's challenges are bounded as Postgres bounds them (65,535 bytes). On main the proxy
/// waited for the whole declared body.
/// Method: a password-protected private cluster; the client answers the password challenge with
/// a message declaring 64 MiB and sends 100 bytes of it; the proxy must refuse it at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_to_the_password_challenge_is_bounded_before_its_body_arrives() {
    lockd_tests::skip_without_postgres!();
    let cluster = pg::PrivateCluster::start()
        .unwrap_or_else(|reason| panic!("cannot start a private Postgres cluster: {reason}"));
    let proxy = PgProxy::start_with(cluster.url("postgres"), false);
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    send_startup(&mut s, "postgres", "postgres").await;
    let (tag, body) = read_message(&mut s).await;
    assert_eq!(tag, b'R', "an authentication request: {body:?}");
    assert_ne!(&body[..4], &[0, 0, 0, 0], "the cluster asks for a password");

    let mut answer = BytesMut::new();
    answer.put_u8(b'p');
    answer.put_i32(64 * 1024 * 1024 - 1 + 4);
    answer.put_slice(&[b'x'; 100]);
    s.write_all(&answer).await.unwrap();
    let (tag, body) = tokio::time::timeout(Duration::from_secs(5), read_message(&mut s))
        .await
        .expect("the proxy answered before the declared 64 MiB arrived");
    let (code, message) = error_fields(&body);
    eprintln!("{code}: {message}");
    assert_eq!(tag, b'E');
    assert_eq!(code, "08P01", "{message}");
    assert!(message.contains("65535"), "names the bound: {message}");
}

/// Goal: a client that opens connections and sends nothing cannot hold every session slot for
/// the startup timeout (on main, `--max-sessions` silent connections locked every client out):
/// one address has at most `--max-startups-per-client` connections in startup, the next is
/// refused at once with 53300 naming the flag, and sessions that finished startup do not count.
/// Method: a proxy with the bound at 3; three silent connections, then a fourth and a real
/// client; then the silent ones closed, and five real sessions at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_connections_from_one_client_hold_a_few_startup_places_not_every_session() {
    lockd_tests::skip_without_postgres!();
    let mut args = pg::proxy_args(pg::direct_url(), pg::fence_table(), false);
    args.max_startups_per_client = 3;
    let proxy = PgProxy::start_args(args);
    let config: tokio_postgres::Config = proxy.url().parse().unwrap();
    // The harness's connect-and-close probe (did the proxy start?) takes a place until the
    // proxy has read its end; a real session behind it, and a moment, see it gone.
    drop(pg::connect(&config).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(TcpStream::connect(proxy.addr).await.unwrap());
    }
    let mut fourth = TcpStream::connect(proxy.addr).await.unwrap();
    let (tag, body) = tokio::time::timeout(Duration::from_secs(5), read_message(&mut fourth))
        .await
        .expect("the fourth connection is refused at once");
    let (code, message) = error_fields(&body);
    eprintln!("fourth: {code}: {message}");
    assert_eq!((tag, code.as_str()), (b'E', "53300"), "{message}");
    assert!(message.contains("--max-startups-per-client"), "{message}");
    let refused = config.connect(tokio_postgres::NoTls).await.err();
    eprintln!("a real client meanwhile: {refused:?}");
    assert!(
        refused.is_some_and(|e| e.code().is_some_and(|c| c.code() == "53300")),
        "a fourth startup from the address was let in"
    );

    drop(silent);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut sessions = Vec::new();
    for _ in 0..5 {
        sessions.push(pg::connect(&config).await);
    }
    for c in &sessions {
        let one: i32 = c.query_one("SELECT 1", &[]).await.unwrap().get(0);
        assert_eq!(one, 1);
    }
}

/// Goal: a flood of connections the proxy refuses (outside `--allow-client`) cannot run it out
/// of descriptors: each refusal waits up to two seconds for the client's startup packet to answer
/// it properly, so at most `REFUSALS_IN_FLIGHT_MAX` wait at once and the others are closed at
/// once, without their error. On main every one waited.
/// Method: `--allow-client 10.0.0.0/8`; the bound plus 40 connections from 127.0.0.1 that send
/// nothing; 40 of them (a few more if a refusal ended meanwhile) must be closed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_connections_beyond_a_bound_are_closed_at_once() {
    lockd_tests::skip_without_postgres!();
    const BOUND: usize = fence_proxy_postgres::limits::REFUSALS_IN_FLIGHT_MAX;
    let access = fence_proxy_postgres::AccessArgs {
        allow_client: vec!["10.0.0.0/8".parse().unwrap()],
        ..Default::default()
    };
    let proxy = PgProxy::start_with_access(pg::direct_url(), false, access).unwrap();
    // The harness's start-up probe is refused too; let its refusal end.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    let mut conns = Vec::new();
    for _ in 0..BOUND + 40 {
        conns.push(TcpStream::connect(proxy.addr).await.unwrap());
    }
    // All at once, well inside the two seconds a waiting refusal lasts.
    let closed = futures::future::join_all(conns.iter_mut().map(|c| async move {
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(500), c.read(&mut byte)).await {
            Err(_) => false,
            Ok(read) => {
                assert!(
                    matches!(read, Ok(0) | Err(_)),
                    "no error before a startup packet"
                );
                true
            }
        }
    }))
    .await;
    let closed_at_once = closed.iter().filter(|c| **c).count();
    eprintln!(
        "{} refused connections: {closed_at_once} closed at once",
        conns.len()
    );
    assert!(
        (40..=60).contains(&closed_at_once),
        "{closed_at_once} of {} refused connections were closed at once",
        conns.len()
    );
}
