//! Clients that write slowly or stop: a trickling body is not overtaken, a stalled or disconnected
//! writer holds then quarantines, slow headers time out and connections are capped.

use std::time::{Duration, Instant};

use crate::{put, redb_store, time_out};
use lockd_tests::fence_proxy::FenceProxy;
use lockd_tests::http_upstream::{BodyEvent, EarlyAnswerUpstream, HttpUpstream};
use lockd_tests::pg;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Opens a raw HTTP/1.1 write through the proxy whose body has `body_len` bytes, and sends only
/// `first` of them, so that the test decides when (and whether) the rest follows.
async fn open_trickling_write(
    proxy: &FenceProxy,
    resource: &str,
    token: u64,
    body_len: usize,
    first: &[u8],
) -> TcpStream {
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    let head = format!(
        "PUT /obj HTTP/1.1\r\nHost: upstream\r\nLock-Resource: {resource}\r\n\
         Fencing-Token: {token}\r\nContent-Length: {body_len}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(first).await.unwrap();
    s
}

/// Reads a response head from a raw connection and returns it.
async fn read_response_head(s: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut byte))
            .await
            .expect("no response head within 10 s")
            .unwrap();
        assert!(n > 0, "connection closed before a response head: {buf:?}");
        buf.push(byte[0]);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// Waits (at most 10 s) until the upstream has seen the head of `token`'s write of `resource`.
async fn wait_started(upstream: &EarlyAnswerUpstream, resource: &str, token: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !upstream
        .events(resource)
        .iter()
        .any(|e| matches!(e, BodyEvent::Started { token: t, .. } if *t == token))
    {
        assert!(
            Instant::now() < deadline,
            "{resource}: token {token} never reached the upstream: {:?}",
            upstream.events(resource)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The oracle of the early-answer tests: once the head of a write with `newer` arrived at the
/// upstream, no body of a write with `older` may still be read to its end, or cut off, after it.
fn assert_older_body_ended_before_newer_started(
    events: &[BodyEvent],
    resource: &str,
    older: u64,
    newer: u64,
) {
    let started_newer = events
        .iter()
        .position(|e| matches!(e, BodyEvent::Started { token, .. } if *token == newer))
        .unwrap_or_else(|| panic!("{resource}: {newer} never started: {events:?}"));
    let late: Vec<_> = events[started_newer..]
        .iter()
        .filter(|e| {
            matches!(e, BodyEvent::Completed { token, .. } | BodyEvent::Truncated { token, .. }
                if *token == older)
        })
        .collect();
    assert!(
        late.is_empty(),
        "{resource}: the upstream was still reading {older}'s body after {newer}'s write started: \
         {events:?}"
    );
}

/// Goal: an upstream that answers 200 as soon as a request head arrives and
/// only then reads the body must never finish reading token 41's body after token 42's write
/// started: the permit of 41 is held until its body has been forwarded completely.
/// Method: 41 sends its head and a third of its body and then trickles the rest, 100 ms apart;
/// once the upstream has answered 41, 42 writes at full speed. The upstream logs, per request,
/// when the head arrived and when the body was read to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass8_trickling_body_of_41_is_not_overtaken_by_42() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = EarlyAnswerUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(&upstream.url(), &redb_store(&dir), &[])
        .await
        .unwrap();
    let r = pg::unique_name("bypass8");
    let pieces: [&[u8]; 3] = [b"41:part-1;", b"41:part-2;", b"41:part-3;"];
    let body_len = pieces.iter().map(|p| p.len()).sum();

    // Phase 1: 41 is admitted and forwarded; the upstream answers it before reading its body.
    let mut s41 = open_trickling_write(&proxy, &r, 41, body_len, pieces[0]).await;
    wait_started(&upstream, &r, 41).await;

    // Phase 2: 42 writes while 41's body is still on its way.
    let url = proxy.url("/obj");
    let r42 = r.clone();
    let w42 = tokio::spawn(async move {
        lockd_tests::fence_proxy::send(
            "PUT",
            &url,
            &[("Lock-Resource", &r42), ("Fencing-Token", "42")],
            "42:whole",
        )
        .await
        .unwrap()
    });
    // 42 reaches the proxy while 41's body is still on its way; the proxy must hold it, so
    // there is nothing to observe before phase 3 but time.
    tokio::time::sleep(Duration::from_millis(300)).await;

    // Phase 3: the rest of 41's body trickles in; 41 got the upstream's 200.
    for piece in &pieces[1..] {
        s41.write_all(piece).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let head = read_response_head(&mut s41).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    let reply = w42.await.unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");

    // Oracle: 41's body was read whole, and before 42's head arrived.
    let events = upstream.events(&r);
    assert!(
        events.contains(&BodyEvent::Completed {
            resource: r.clone(),
            token: 41,
            body: pieces.concat(),
        }),
        "{events:?}"
    );
    assert_older_body_ended_before_newer_started(&events, &r, 41, 42);
}

/// Goal: the other ways a write's exchange ends (see the test above): the permit is released then,
/// never earlier, and the resource is quarantined because the upstream holds a partial request.
/// Method: an early-answering upstream, `--upstream-timeout 1s --quarantine 1s`. Phase 1: 41's
/// client disconnects half-way through its body. Phase 2: 41's client stalls half-way past the
/// upstream timeout. Each time 42 writes meanwhile and must get 200 only after the upstream saw
/// 41's body end (cut off), and not before the quarantine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_bypass8_disconnect_or_stall_mid_body_holds_then_quarantines() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = EarlyAnswerUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &[
            "--upstream-timeout",
            "1s",
            "--quarantine",
            "1s",
            "--lock-wait",
            "8s",
        ],
    )
    .await
    .unwrap();

    for (phase, disconnect) in [("disconnect", true), ("stall", false)] {
        let r = pg::unique_name(&format!("bypass8-{phase}"));
        let s41 = open_trickling_write(&proxy, &r, 41, 20, b"41:half...").await;
        wait_started(&upstream, &r, 41).await;
        let cut = Instant::now();
        let s41 = if disconnect {
            drop(s41);
            None
        } else {
            Some(s41)
        };
        let reply = put(&proxy, &r, "42", "42:whole").await;
        let waited = cut.elapsed();
        assert_eq!(reply.status, 200, "{phase}: {reply:?}");
        // Disconnect: the quarantine (1 s). Stall: the exchange deadline (1 s) and the quarantine.
        let floor = if disconnect {
            Duration::from_millis(900)
        } else {
            Duration::from_millis(1800)
        };
        assert!(waited >= floor, "{phase}: 42 admitted after {waited:?}");
        let events = upstream.events(&r);
        assert!(
            events.iter().any(
                |e| matches!(e, BodyEvent::Truncated { token: 41, received, .. } if *received == 10)
            ),
            "{phase}: the upstream must see 41's body cut off: {events:?}"
        );
        assert_older_body_ended_before_newer_started(&events, &r, 41, 42);
        drop(s41);
    }
}

/// Waits (at most `within`) for the proxy to close `s`, and returns how long that took.
async fn closed_within(s: &mut TcpStream, within: Duration) -> Duration {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(within.saturating_sub(started.elapsed()), s.read(&mut buf)).await
        {
            Err(_) => panic!("the proxy kept the connection open for {within:?}"),
            Ok(Ok(0)) | Ok(Err(_)) => return started.elapsed(),
            // A 408 or similar before the close is fine; keep reading until the close.
            Ok(Ok(_)) => {}
        }
    }
}

/// Goal (slowloris): a client that sends nothing, or trickles a request head, is
/// disconnected after `--header-read-timeout`, and the proxy keeps serving others.
/// Method: `--header-read-timeout 500ms`; one silent connection, one that sends half a head and
/// then one header byte every 100 ms; both must be closed between 0.4 s and 3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_slowloris_header_read_timeout_closes_connections() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--header-read-timeout", "500ms"],
    )
    .await
    .unwrap();

    // Phase 1: a connection that never sends a byte.
    let mut silent = TcpStream::connect(proxy.addr).await.unwrap();
    // Phase 2: a connection that trickles its head.
    let mut trickle = TcpStream::connect(proxy.addr).await.unwrap();
    trickle
        .write_all(b"PUT /obj HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let trickler = tokio::spawn(async move {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(3) {
            if trickle.write_all(b"X").await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        closed_within(&mut trickle, Duration::from_secs(3)).await;
        started.elapsed()
    });
    let silent_for = closed_within(&mut silent, Duration::from_secs(3)).await;
    assert!(
        silent_for >= Duration::from_millis(400),
        "closed too early: {silent_for:?}"
    );
    let trickled_for = trickler.await.unwrap();
    assert!(
        trickled_for < Duration::from_secs(3),
        "a trickled head kept its connection for {trickled_for:?}"
    );

    // Phase 3: the proxy still serves complete requests.
    assert_eq!(put(&proxy, "slow/1", "1", "x").await.status, 200);
}

/// Goal: `--max-connections` bounds the client connections open at once; past it a new
/// connection is not served until one closes.
/// Method: `--max-connections 2`; two idle connections; a third client's write must not be
/// answered while they stay open, and must be answered once one of them closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn issue13_max_connections_caps_open_connections() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--max-connections", "2", "--header-read-timeout", "30s"],
    )
    .await
    .unwrap();
    // The start-up probe's connection may still be closing; let its slot come back.
    tokio::time::sleep(Duration::from_millis(200)).await;

    let idle_a = TcpStream::connect(proxy.addr).await.unwrap();
    let idle_b = TcpStream::connect(proxy.addr).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let url = proxy.url("/obj");
    let third = tokio::spawn(async move {
        lockd_tests::fence_proxy::send(
            "PUT",
            &url,
            &[("Lock-Resource", "cap/1"), ("Fencing-Token", "1")],
            "x",
        )
        .await
        .unwrap()
    });
    // A fixed wait: what is checked is that the third connection is not served in it.
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert!(
        !third.is_finished(),
        "a third connection was served past --max-connections 2"
    );
    assert!(upstream.writes().is_empty());

    drop(idle_a);
    let reply = tokio::time::timeout(Duration::from_secs(5), third)
        .await
        .expect("the third connection was not served after a slot freed up")
        .unwrap();
    assert_eq!(reply.status, 200, "{reply:?}");
    drop(idle_b);
}

/// A connection to `to` from the loopback address `from`, or `None` if the proxy neither accepts
/// it nor has room for it in the kernel's backlog within 500 ms.
async fn connect_from(from: std::net::Ipv4Addr, to: std::net::SocketAddr) -> Option<TcpStream> {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind((from, 0).into()).unwrap();
    tokio::time::timeout(Duration::from_millis(500), socket.connect(to))
        .await
        .ok()?
        .ok()
}

/// Two distinct random loopback addresses: an attacker's and a victim's.
fn two_addresses() -> (std::net::Ipv4Addr, std::net::Ipv4Addr) {
    let attacker = lockd_tests::process::random_loopback_ip();
    let mut victim = lockd_tests::process::random_loopback_ip();
    while victim == attacker {
        victim = lockd_tests::process::random_loopback_ip();
    }
    (attacker, victim)
}

/// An h2c connection (prior knowledge) from `from` to `proxy`: its sender and the task driving
/// it.
async fn h2c_from(
    from: std::net::Ipv4Addr,
    proxy: &FenceProxy,
) -> (
    hyper::client::conn::http2::SendRequest<http_body_util::Empty<bytes::Bytes>>,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
) {
    let tcp = connect_from(from, proxy.addr).await.unwrap();
    let (sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    (sender, tokio::spawn(connection))
}

/// Sends `request` (raw HTTP/1.1, `Connection: close`) from `from` and returns the response
/// head; fails the test with `what` if it does not come within `within`.
async fn served_within(
    from: std::net::Ipv4Addr,
    proxy: &FenceProxy,
    request: &[u8],
    within: Duration,
    what: &str,
) -> String {
    let started = Instant::now();
    let served = tokio::time::timeout(within, async {
        let mut s = connect_from(from, proxy.addr)
            .await
            .expect("the victim could not connect");
        s.write_all(request).await.unwrap();
        read_response_head(&mut s).await
    })
    .await;
    served.unwrap_or_else(|_| panic!("{what}: not served for {:?}", started.elapsed()))
}

/// A GET a victim sends.
const VICTIM_GET: &[u8] = b"GET /obj HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";

/// Attack: one client address opened as many idle connections as `--max-connections` allows
/// (each kept open by a header byte before the header read timeout): every other client waited
/// in the kernel's backlog until those connections were closed, and the attacker reopened them.
/// Goal: one address holds at most `--max-connections-per-client` (default 256) at once; past
/// it its connections are closed at once, and other clients are served.
/// Method: `--max-connections 512`; 600 idle connections from one address; a GET from another
/// address must be answered within 3 s (on main it waited for the 30 s header read timeout).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_address_cannot_hold_every_connection() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--max-connections", "512", "--header-read-timeout", "30s"],
    )
    .await
    .unwrap();
    let (attacker, victim) = two_addresses();
    let mut held = Vec::new();
    for _ in 0..600 {
        if let Some(s) = connect_from(attacker, proxy.addr).await {
            held.push(s);
        }
    }
    // Let the proxy accept (and, past the bound, close) what it will.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let what = format!(
        "another client, while one address held {} connections",
        held.len()
    );
    let head = served_within(victim, &proxy, VICTIM_GET, Duration::from_secs(3), &what).await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The attacker's connections past its bound were closed by the proxy: of the first 300,
    // at most 256 stay open.
    let mut open = 0;
    for s in held.iter_mut().take(300) {
        let mut byte = [0u8; 1];
        match tokio::time::timeout(Duration::from_millis(20), s.read(&mut byte)).await {
            Err(_) => open += 1,
            Ok(Ok(0)) | Ok(Err(_)) => {}
            Ok(Ok(_)) => panic!("the proxy sent bytes to an idle connection"),
        }
    }
    assert!(open <= 256, "{open} connections of one address stayed open");
    drop(held);
}

/// Attack: one HTTP/2 connection carries 128 requests at once, so one client address with a
/// few connections of slow requests held every place of `--max-in-flight`, and every other
/// client's requests waited behind them. Goal: one address holds at most
/// `--max-in-flight-per-client` (default a quarter of `--max-in-flight`); its further requests
/// wait for its own.
/// Method: `--max-in-flight 16`; one address sends 16 GETs the upstream answers after 3 s, on
/// one h2c connection; a GET from another address must be answered within 1.5 s (on main it
/// waited for the slow ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_address_cannot_hold_every_request_place() {
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--max-in-flight", "16"],
    )
    .await
    .unwrap();
    let (attacker, victim) = two_addresses();
    let (sender, connection) = h2c_from(attacker, &proxy).await;
    let attack_started = Instant::now();
    let mut slow = Vec::new();
    for _ in 0..16 {
        let mut sender = sender.clone();
        let request = hyper::Request::get(proxy.url("/slow"))
            .header(lockd_tests::http_upstream::DELAY_HEADER, "3000")
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        slow.push(tokio::spawn(async move {
            sender.ready().await.unwrap();
            sender.send_request(request).await.map(|r| r.status())
        }));
    }
    // Let the slow requests reach the proxy and take their places.
    tokio::time::sleep(Duration::from_millis(300)).await;

    let head = served_within(
        victim,
        &proxy,
        VICTIM_GET,
        Duration::from_millis(1500),
        "another client, while one address had 16 slow requests",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    // The attacker's requests are all answered in the end: they waited, none was refused, and
    // four at a time (a quarter of 16): four rounds of 3 s.
    for s in slow {
        assert_eq!(s.await.unwrap().unwrap(), 200);
    }
    let all_answered = attack_started.elapsed();
    assert!(
        all_answered >= Duration::from_millis(11_500),
        "16 slow requests of one address were answered in {all_answered:?}: more than 4 at once"
    );
    drop(sender);
    connection.abort();
}

/// Attack (review, MEDIUM): a write task outlives its request when the client resets it, and
/// with the Postgres store its admission runs to its end (up to `--lock-wait`), holding one of
/// the proxy's write slots; the client's own place was given back with the request. One address
/// resetting writes to a resource it keeps busy held every write slot, and every other client's
/// write waited. Goal: the write task keeps its client's place, so one address's tasks stay
/// within `--max-in-flight-per-client`.
/// Method: `--max-in-flight 16` (4 per client), Postgres store, `--lock-wait 8s`; one address
/// holds `r` with a write the upstream takes 3 s for, then sends 64 token-2 writes of `r` on
/// one h2c connection and resets each after 100 ms; a write of another resource from another
/// address must be answered within 1.5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_reset_by_one_client_leave_write_slots_for_others() {
    let table = crate::PgTable::new("fence_http_reset_slots");
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &table.store(),
        &[
            "--store-table",
            &table.name,
            "--max-in-flight",
            "16",
            "--lock-wait",
            "8s",
            "--upstream-timeout",
            "4s",
            // The resource's in-flight mark (upstream timeout + quarantine) ends before the
            // lock wait: writes behind the holder wait for it instead of being refused at once.
            "--quarantine",
            "1s",
        ],
    )
    .await
    .unwrap();
    let (attacker, victim) = two_addresses();
    let (sender, connection) = h2c_from(attacker, &proxy).await;
    let write = |token: &str, delay: &str| {
        hyper::Request::builder()
            .method("DELETE")
            .uri(format!("http://{}/obj", proxy.addr))
            .header("Lock-Resource", "r")
            .header("Fencing-Token", token)
            .header(lockd_tests::http_upstream::DELAY_HEADER, delay)
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap()
    };
    let holder = {
        let mut sender = sender.clone();
        let request = write("1", "3000");
        tokio::spawn(async move {
            sender.ready().await.unwrap();
            sender.send_request(request).await.map(|r| r.status())
        })
    };
    tokio::time::sleep(Duration::from_millis(200)).await;
    // Eight bursts: three writes each get a place (the holder has the fourth) and leave a
    // task behind at their reset, more than the 15 free write slots, with room for a slow
    // machine.
    for _ in 0..8 {
        let mut burst = Vec::new();
        for _ in 0..8 {
            let mut sender = sender.clone();
            sender.ready().await.unwrap();
            burst.push(sender.send_request(write("2", "0")));
        }
        let answered =
            tokio::time::timeout(Duration::from_millis(100), futures::future::join_all(burst))
                .await;
        assert!(answered.is_err(), "answered within 100 ms: {answered:?}");
    }

    let head = served_within(
        victim,
        &proxy,
        b"PUT /obj HTTP/1.1\r\nHost: x\r\nLock-Resource: s\r\nFencing-Token: 1\r\n\
          Content-Length: 1\r\nConnection: close\r\n\r\nx",
        Duration::from_millis(1500),
        "another client's write, while one address's reset writes held the write slots",
    )
    .await;
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(holder.await.unwrap().unwrap(), 200);
    drop(sender);
    connection.abort();
}

/// A GET of `path` over a new h2c connection (prior knowledge) to `proxy`: the response (body
/// unread), the task driving the connection, which ends when the connection does, and the
/// connection's sender (dropping it lets the client close the connection itself).
async fn h2c_get(
    proxy: &FenceProxy,
    path: &str,
) -> (
    hyper::Response<hyper::body::Incoming>,
    tokio::task::JoinHandle<Result<(), hyper::Error>>,
    hyper::client::conn::http2::SendRequest<http_body_util::Empty<bytes::Bytes>>,
) {
    let tcp = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    let connection = tokio::spawn(connection);
    let request = hyper::Request::get(proxy.url(path))
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .unwrap();
    (
        sender.send_request(request).await.unwrap(),
        connection,
        sender,
    )
}

/// Goal: an HTTP/2 connection that has made its requests and then stays quiet does not keep its
/// connection slot for good (hyper closes idle HTTP/1.1 connections by its header timer, but
/// never an idle HTTP/2 one: 4,096 such connections, one GET each, locked every other client
/// out). It is closed `--idle-timeout` after its last request started.
/// Method: `--idle-timeout 1s`; an h2c client (prior knowledge) makes one GET, then sends
/// nothing; the proxy must close the connection between 0.8 s and 5 s after the GET.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_http2_connection_is_closed_after_the_idle_timeout() {
    use http_body_util::BodyExt;
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--idle-timeout", "1s", "--header-read-timeout", "30s"],
    )
    .await
    .unwrap();
    let started = Instant::now();
    let (response, connection, _sender) = h2c_get(&proxy, "/obj").await;
    assert_eq!(response.status(), 200);
    response.into_body().collect().await.unwrap();
    let ended = tokio::time::timeout(Duration::from_secs(5), connection).await;
    let after = started.elapsed();
    eprintln!("the idle HTTP/2 connection ended after {after:?}: {ended:?}");
    assert!(
        ended.is_ok(),
        "an idle HTTP/2 connection stayed open for 5 s"
    );
    assert!(
        after >= Duration::from_millis(800),
        "closed too early: {after:?}"
    );
}

/// Goal: a client that stops reading a response does not hold its connection, the response and
/// the upstream connection behind it for good; it is disconnected `--send-timeout` after the
/// proxy last could write to it, as nginx's `send_timeout` does.
/// Method: an upstream that answers GET with 32 MiB; `--send-timeout 1s`; a raw HTTP/1.1 client
/// sends the GET and reads nothing for 4 s, then reads what is left: the connection must have
/// been closed before the whole body arrived.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_a_response_is_disconnected_after_the_send_timeout() {
    let (upstream_addr, server) = big_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = FenceProxy::start(
        &format!("http://{upstream_addr}"),
        &redb_store(&dir),
        &["--send-timeout", "1s"],
    )
    .await
    .unwrap();
    let mut s = TcpStream::connect(proxy.addr).await.unwrap();
    s.write_all(b"GET /big HTTP/1.1\r\nHost: upstream\r\n\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let mut received = 0usize;
    let mut buf = vec![0u8; 256 * 1024];
    let closed = loop {
        match tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf)).await {
            Err(_) => panic!("the connection neither delivered nor closed for 10 s"),
            Ok(Ok(0)) | Ok(Err(_)) => break true,
            Ok(Ok(n)) => received += n,
        }
        if received >= BIG_BODY {
            break false;
        }
    };
    eprintln!("after 4 s unread: received {received} bytes, then closed: {closed}");
    server.abort();
    assert!(
        closed && received < BIG_BODY,
        "a client that read nothing for 4 s still got the whole {BIG_BODY}-byte body"
    );
}

/// Size of what [`big_upstream`] answers.
const BIG_BODY: usize = 32 * 1024 * 1024;

/// An upstream that answers every request with [`BIG_BODY`] bytes, and the task that serves it.
async fn big_upstream() -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    sized_upstream(BIG_BODY).await
}

/// An upstream that answers every request with `body` bytes (a multiple of 64 KiB).
async fn sized_upstream(body: usize) -> (std::net::SocketAddr, tokio::task::JoinHandle<()>) {
    let upstream = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream_addr = upstream.local_addr().unwrap();
    let server = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = upstream.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") {
                    if s.read(&mut byte).await.unwrap_or(0) == 0 {
                        return;
                    }
                    head.push(byte[0]);
                }
                let answer = format!("HTTP/1.1 200 OK\r\nContent-Length: {body}\r\n\r\n");
                if s.write_all(answer.as_bytes()).await.is_err() {
                    return;
                }
                let chunk = vec![b'x'; 64 * 1024];
                for _ in 0..body / chunk.len() {
                    if s.write_all(&chunk).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (upstream_addr, server)
}

/// Goal: over HTTP/2 a client can stop taking a response without a single blocked write on the
/// socket: it answers pings and reads the socket, but grants no flow-control window, so the
/// proxy has response data it may not send. That client is disconnected `--send-timeout` after
/// the proxy last could send it data too, with the response and its upstream connection.
/// Method: the 32 MiB upstream; `--send-timeout 1s`; an h2c client gets the response head and
/// never reads the body (so grants no window past the first 64 KiB); its connection must end
/// within 6 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_that_grants_no_window_is_disconnected_after_the_send_timeout() {
    let (upstream_addr, server) = big_upstream().await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = FenceProxy::start(
        &format!("http://{upstream_addr}"),
        &redb_store(&dir),
        &["--send-timeout", "1s"],
    )
    .await
    .unwrap();
    let started = Instant::now();
    let (response, connection, _sender) = h2c_get(&proxy, "/big").await;
    assert_eq!(response.status(), 200);
    // Kept, never read: no window beyond the first 64 KiB is granted.
    let _unread = response;
    let ended = tokio::time::timeout(Duration::from_secs(6), connection).await;
    eprintln!(
        "the connection of a client granting no window ended after {:?}: {ended:?}",
        started.elapsed()
    );
    server.abort();
    assert!(
        ended.is_ok(),
        "a client that took no data kept its connection for 6 s"
    );
}

/// Goal: over HTTP/2 a client cannot keep responses in the proxy with stream windows smaller than
/// a response. hyper hands a response body's chunk to h2 whole once its stream may take one byte,
/// so the body is finished in the proxy's eyes (no send timeout runs) while h2 keeps the rest with
/// its stream, for as long as the client answers pings. Such a connection is disconnected within
/// `--send-timeout` of its windows starving (as lockd's port, `flow_watch`).
/// On main it stayed until the idle timeout (60 s) closed it.
/// Method: `--send-timeout 1s`; an h2c client granting 1-byte stream windows makes 100 GETs (the
/// proxy allows 128 at once) and reads none of the bodies; its connection must end within 10 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_http2_client_granting_one_byte_windows_is_disconnected() {
    let upstream = HttpUpstream::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &["--send-timeout", "1s"],
    )
    .await
    .unwrap();
    let tcp = TcpStream::connect(proxy.addr).await.unwrap();
    let mut builder =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder.initial_stream_window_size(1);
    let (mut sender, connection) = builder
        .handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    let started = Instant::now();
    let connection = tokio::spawn(connection);
    let mut calls = Vec::new();
    for i in 0..100 {
        if sender.ready().await.is_err() {
            break;
        }
        let request = hyper::Request::get(proxy.url(&format!("/obj{i}")))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        calls.push(sender.send_request(request));
    }
    let mut kept = Vec::new();
    for call in calls {
        if let Ok(Ok(response)) = tokio::time::timeout(Duration::from_secs(5), call).await {
            kept.push(response);
        }
    }
    let heads = kept.len();
    let ended = tokio::time::timeout(Duration::from_secs(10), connection).await;
    eprintln!(
        "{heads} responses begun with 1-byte windows; the connection ended after {:?}: {}",
        started.elapsed(),
        ended.is_ok()
    );
    assert!(
        ended.is_ok(),
        "a client granting 1-byte windows kept {heads} responses for 10 s"
    );
    drop(kept);
}

/// Goal: the window watch does not close a healthy client whose small windows a large body
/// starves for a while. A proxied body of any size keeps a client's stream window exhausted for
/// as long as the client takes to read and grant more, so fence-proxy's grace before a starved
/// stream counts is its send timeout, not lockd's 1 s (found by review: 33 such downloads would
/// have closed the connection after a second).
/// Method: the default send timeout (60 s); an h2c client with 64 KiB stream windows (and a large
/// connection window) makes 40 GETs of a 256 KiB body at once and reads 64 KiB of each, then
/// pauses 1.5 s, until the end: each window starved about 1.5 s at a time. Every body must
/// arrive whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_readers_of_large_bodies_with_small_windows_are_not_disconnected() {
    use http_body_util::BodyExt;
    const BODY: usize = 256 * 1024;
    const GETS: usize = 40;
    let (upstream_addr, server) = sized_upstream(BODY).await;
    let dir = tempfile::tempdir().unwrap();
    let proxy = FenceProxy::start(&format!("http://{upstream_addr}"), &redb_store(&dir), &[])
        .await
        .unwrap();
    let tcp = TcpStream::connect(proxy.addr).await.unwrap();
    let mut builder =
        hyper::client::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .initial_stream_window_size(65_535)
        .initial_connection_window_size(16 << 20);
    let (mut sender, connection) = builder
        .handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    let connection = tokio::spawn(connection);
    let mut readers = Vec::new();
    for i in 0..GETS {
        sender.ready().await.unwrap();
        let request = hyper::Request::get(proxy.url(&format!("/big{i}")))
            .body(http_body_util::Empty::<bytes::Bytes>::new())
            .unwrap();
        let response = sender.send_request(request);
        readers.push(tokio::spawn(async move {
            let mut body = response.await.ok()?.into_body();
            let (mut got, mut since_pause) = (0, 0);
            while let Some(frame) = body.frame().await {
                let n = frame.ok()?.data_ref().map_or(0, bytes::Bytes::len);
                got += n;
                since_pause += n;
                if since_pause >= 64 * 1024 {
                    since_pause = 0;
                    tokio::time::sleep(Duration::from_millis(1_500)).await;
                }
            }
            Some(got)
        }));
    }
    let mut whole = 0;
    for reader in readers {
        if reader.await.unwrap() == Some(BODY) {
            whole += 1;
        }
    }
    eprintln!(
        "{whole} of {GETS} bodies arrived whole; connection ended: {}",
        connection.is_finished()
    );
    server.abort();
    assert_eq!(whole, GETS, "bodies cut short: the connection was closed");
    assert!(
        !connection.is_finished(),
        "the proxy closed a healthy connection"
    );
}

/// Sends ten bursts of eight DELETEs of `resource` with `token` over one h2c connection, each
/// burst reset after 100 ms (HEADERS with END_STREAM, then RST_STREAM CANCEL when the response
/// future is dropped). None may be answered within those 100 ms.
async fn reset_bursts(proxy: &FenceProxy, resource: &str, token: &str, headers: &[(&str, &str)]) {
    let stream = TcpStream::connect(proxy.addr).await.unwrap();
    let (mut sender, connection) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    let connection = tokio::spawn(connection);
    for _ in 0..10 {
        let mut burst = Vec::new();
        for _ in 0..8 {
            sender.ready().await.unwrap();
            let mut request = hyper::Request::builder()
                .method("DELETE")
                .uri(format!("http://{}/obj", proxy.addr))
                .header("Lock-Resource", resource)
                .header("Fencing-Token", token);
            for (name, value) in headers {
                request = request.header(*name, *value);
            }
            let request = request
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .unwrap();
            burst.push(sender.send_request(request));
        }
        let answered =
            tokio::time::timeout(Duration::from_millis(100), futures::future::join_all(burst))
                .await;
        assert!(answered.is_err(), "answered within 100 ms: {answered:?}");
    }
    drop(sender);
    connection.abort();
}

/// Attack (review, MEDIUM): a write runs in a task of its own that outlives its request, so
/// that its permit is released with the right outcome; but `--max-in-flight` bounded only the
/// requests, not those tasks. An h2c client that sends a write's HEADERS and resets the stream
/// at once left its task behind and freed its request slot: behind a quarantined resource such
/// tasks piled up without bound and were all forwarded together when it ended (77 of 80 with
/// `--max-in-flight 4` on main), and writes reset while an upstream works on them could all be
/// at the upstream at once. Goals: a write whose client goes away before it is admitted is
/// dropped, never forwarded; one admitted already runs to its end, in one of `--max-in-flight`
/// write slots taken before it starts, so at most 4 such writes exist.
/// Method: (1) token 1 of `q` times out (504; quarantine 3 s), then ten bursts of eight
/// token-2 DELETEs of `q`, each reset after 100 ms; (2) the same bursts on `s`, which the
/// upstream takes 1 s to apply, so that the first writes are admitted and forwarded before
/// their reset: they hold the four write slots for that second, in which all later bursts come
/// and find none free (without the bound, 69 of 80 were at the upstream at once on main). Their
/// responses are abandoned, an unknown outcome, so `s` is quarantined after them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_reset_by_the_client_stay_within_max_in_flight() {
    const MAX_IN_FLIGHT: usize = 4;
    let dir = tempfile::tempdir().unwrap();
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&dir),
        &[
            "--max-in-flight",
            &MAX_IN_FLIGHT.to_string(),
            "--upstream-timeout",
            "300ms",
            "--quarantine",
            "3s",
            "--lock-wait",
            "8s",
        ],
    )
    .await
    .unwrap();
    let delay = lockd_tests::http_upstream::DELAY_HEADER;
    time_out(&proxy, "q", "1", 600).await;
    reset_bursts(&proxy, "q", "2", &[]).await;
    // The quarantine ends 3.3 s after token 1's write; a write left waiting would go then.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let forwarded = |resource: &str| {
        upstream
            .writes()
            .iter()
            .filter(|w| w.resource() == Some(resource) && w.token() == Some(2))
            .count()
    };
    assert_eq!(
        forwarded("q"),
        0,
        "writes whose client reset them before admission reached the upstream"
    );

    // A second proxy, whose upstream timeout lets the upstream take its 1 s per write.
    let proxy = FenceProxy::start(
        &upstream.url(),
        &redb_store(&tempfile::tempdir().unwrap()),
        &["--max-in-flight", &MAX_IN_FLIGHT.to_string()],
    )
    .await
    .unwrap();
    reset_bursts(&proxy, "s", "2", &[(delay, "1000")]).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    // Most writes of `s` at the upstream at one time: from each head's arrival to its apply.
    let spans: Vec<_> = upstream
        .writes()
        .iter()
        .filter(|w| w.resource() == Some("s"))
        .map(|w| (w.received, w.at))
        .collect();
    assert!(!spans.is_empty(), "no write of s was forwarded at all");
    let at_once = spans
        .iter()
        .map(|(start, _)| {
            spans
                .iter()
                .filter(|(s, e)| s <= start && start < e)
                .count()
        })
        .max()
        .unwrap_or(0);
    assert!(
        at_once <= MAX_IN_FLIGHT,
        "{at_once} writes of requests reset by their client were at the upstream at once, with \
         --max-in-flight {MAX_IN_FLIGHT}"
    );
    // The proxy still serves within its bound.
    assert_eq!(put(&proxy, "r", "2", "after").await.status, 200);
}

/// Goal: with the Postgres store, whose admission must not be dropped once its record is on the
/// way (`EpochStore::admission_cancel_safe`), writes reset by their client while they wait
/// behind a quarantine still never reach the upstream: each admission ends and its permit is
/// released unused, which clears the record's in-flight mark, so the next holder's write is
/// admitted as soon as the quarantine is over.
/// Method: as the first half of `writes_reset_by_the_client_stay_within_max_in_flight`, with
/// `--lock-wait 8s` long enough for every reset write to be admitted after the quarantine.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_reset_before_admission_with_the_postgres_store_are_not_forwarded() {
    let table = crate::PgTable::new("fence_http_reset");
    let upstream = HttpUpstream::start().await.unwrap();
    let proxy = FenceProxy::start(
        &upstream.url(),
        &table.store(),
        &[
            "--store-table",
            &table.name,
            "--max-in-flight",
            "4",
            "--upstream-timeout",
            "300ms",
            "--quarantine",
            "2s",
            "--lock-wait",
            "8s",
        ],
    )
    .await
    .unwrap();
    time_out(&proxy, "q", "1", 600).await;
    reset_bursts(&proxy, "q", "2", &[]).await;
    // Every reset write still waiting is admitted after the quarantine and released unused.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let started = Instant::now();
    let reply = put(&proxy, "q", "3", "next holder").await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "the next holder waited {:?}",
        started.elapsed()
    );
    let tokens: Vec<_> = upstream
        .writes()
        .iter()
        .filter(|w| w.resource() == Some("q"))
        .map(|w| w.token())
        .collect();
    assert_eq!(
        tokens,
        [Some(1), Some(3)],
        "a write reset before admission reached the upstream"
    );
}
