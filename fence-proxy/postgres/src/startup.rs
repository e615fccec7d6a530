//! The startup phase of a client connection: encryption requests, cancel requests, the startup
//! packet (whose `lockd.fence` option is checked early for a clear FATAL error),
//! authentication relayed to the upstream untouched, and the proxy's first query on the session
//! (sent behind the AuthenticationOk, answered before the client's ReadyForQuery): the session
//! must be in the very database the proxy checked at start under the name it gave, and without
//! `--require-fence` its fence from the start is read there.

use std::sync::Arc;

use bytes::Bytes;
use futures::StreamExt;
use lockd_fence::Fence;
use tokio::io::{AsyncWriteExt, BufWriter};
use tokio::net::TcpStream;
use tokio_util::codec::FramedRead;

use crate::codec::{self, FrameError, MessageCodec};
use crate::config::Config;
use crate::error::{self, ProxyError};
use crate::fence_value;
use crate::limits::MAX_ENCRYPTION_REQUESTS;
use crate::session::Session;
use crate::upstream::BoxIo;

/// Request codes of the untyped startup packets.
const SSL_REQUEST: i32 = 80_877_103;
const GSSENC_REQUEST: i32 = 80_877_104;
const CANCEL_REQUEST: i32 = 80_877_102;

/// What the startup phase ended with.
pub enum Startup {
    /// An authenticated session, ready for queries.
    Session(Box<Session>),
    /// The connection served its purpose (a cancel request) or was refused; nothing more to do.
    Done,
}

/// Runs the startup phase of one client connection.
pub async fn handshake(tcp: TcpStream, cfg: Arc<Config>) -> anyhow::Result<Startup> {
    let mut encryption_requests = 0;
    // Plain TCP until the client asks for TLS and the proxy has a certificate.
    let mut client: BoxIo = Box::new(tcp);
    let mut tls = false;
    let packet = loop {
        let packet = match codec::read_startup_packet(&mut client).await {
            Ok(p) => p,
            Err(FrameError::Io(e)) => anyhow::bail!("client went away during startup: {e}"),
            Err(e) => {
                refuse(
                    &mut client,
                    ProxyError::fatal(error::PROTOCOL_VIOLATION, &e),
                )
                .await;
                return Ok(Startup::Done);
            }
        };
        let code = i32::from_be_bytes([packet[4], packet[5], packet[6], packet[7]]);
        match code {
            SSL_REQUEST | GSSENC_REQUEST if tls => {
                // Postgres, too, refuses a second negotiation inside an encrypted connection.
                let e = ProxyError::fatal(
                    error::PROTOCOL_VIOLATION,
                    "encryption request on a connection that is already encrypted",
                );
                refuse(&mut client, e).await;
                return Ok(Startup::Done);
            }
            SSL_REQUEST if cfg.client_tls.is_some() => {
                // The configuration current now: a reload reaches the next handshake.
                let acceptor = cfg.client_tls.as_ref().expect("checked above").acceptor();
                client.write_all(b"S").await?;
                client.flush().await?;
                // The startup packet was read with exact reads, so nothing the client sent after
                // the SSLRequest was consumed as plain text: it all goes to the TLS handshake.
                let stream = acceptor
                    .accept(client)
                    .await
                    .map_err(|e| anyhow::anyhow!("TLS handshake with the client failed: {e}"))?;
                client = Box::new(stream);
                tls = true;
            }
            SSL_REQUEST | GSSENC_REQUEST if encryption_requests < MAX_ENCRYPTION_REQUESTS => {
                encryption_requests += 1;
                // 'N': no certificate (SSL) or no GSSAPI at all; libpq then continues
                // unencrypted or gives up, as its sslmode says.
                client.write_all(b"N").await?;
            }
            CANCEL_REQUEST => {
                forward_cancel(&cfg, &packet).await;
                return Ok(Startup::Done);
            }
            _ if (code >> 16) == 3 && cfg.require_tls && !tls => {
                let e = ProxyError::fatal(
                    error::INVALID_AUTHORIZATION,
                    "this proxy requires TLS (--require-tls): connect with sslmode=require, verify-ca or verify-full",
                );
                refuse(&mut client, e).await;
                return Ok(Startup::Done);
            }
            _ if (code >> 16) == 3 => break packet,
            _ => {
                let e = ProxyError::fatal(
                    error::PROTOCOL_VIOLATION,
                    format!(
                        "unsupported startup request code {code} (protocol {}.{}); only protocol 3 is supported",
                        code >> 16,
                        code & 0xffff
                    ),
                );
                refuse(&mut client, e).await;
                return Ok(Startup::Done);
            }
        }
    };

    let pairs = startup_pairs(&packet[8..]);
    // Only the databases checked at start: another database may have no guard, an older one,
    // or one that takes plain tokens where this proxy verifies them.
    let database = startup_database(&pairs);
    let Some((name, served)) = std::str::from_utf8(&database)
        .ok()
        .and_then(|d| cfg.databases.get_key_value(d))
    else {
        let served: Vec<&String> = cfg.databases.keys().collect();
        let e = ProxyError::fatal(
            error::INVALID_AUTHORIZATION,
            format!(
                "database {:?} is not served by this proxy: it serves {served:?} (the --upstream URL's database {:?} and each --allow-database, checked at start)",
                String::from_utf8_lossy(&database),
                cfg.url_database
            ),
        );
        refuse(&mut client, e).await;
        return Ok(Startup::Done);
    };
    // The name was checked at start; that this is still the database checked is the session's
    // first query (`session_start`).
    let served_database = Checked {
        name: name.clone(),
        oid: served.oid,
    };
    let verification = served.verification.clone();
    // With --verify-key the startup fence must verify (a sequencer, or a plain token under
    // --allow-unsigned) before anything reaches the upstream; its proof goes with every guard
    // call of the session.
    let checked = match &verification {
        None => startup_fence(&pairs).map(|f| (f.map(|f| f.to_string()), None)),
        Some(v) => match startup_fence_value(&pairs) {
            Ok(None) => Ok((None, None)),
            Ok(Some(value)) => v
                .check(&value)
                .map(|verified| (Some(value), Some(verified)))
                .map_err(|mut e| {
                    e.fatal = true;
                    e
                }),
            Err(e) => Err(e),
        },
    };
    let (fence, verified) = match checked {
        Ok(f) => f,
        Err(e) => {
            refuse(&mut client, e).await;
            return Ok(Startup::Done);
        }
    };

    let (upstream, upstream_tls) = match connect_upstream(&cfg).await {
        Ok(s) => s,
        Err(e) => {
            refuse(&mut client, e).await;
            return Ok(Startup::Done);
        }
    };
    let (up_read, up_write) = tokio::io::split(upstream);
    let (client_read, client_write) = tokio::io::split(client);
    let codec = || MessageCodec {
        max_body_bytes: cfg.max_message_bytes,
    };
    let mut up_rx = FramedRead::new(up_read, codec());
    let mut up_tx = BufWriter::new(up_write);
    // Until authentication succeeds, a client's messages are answers to the upstream's
    // challenges, which are short: see MAX_AUTH_MESSAGE_BYTES.
    let mut client_rx = FramedRead::new(
        client_read,
        MessageCodec {
            max_body_bytes: crate::limits::MAX_AUTH_MESSAGE_BYTES.min(cfg.max_message_bytes),
        },
    );
    let mut client_tx = BufWriter::new(client_write);

    // The startup packet goes upstream unchanged: lockd.fence is a valid placeholder setting for
    // Postgres, and the guard reads it from there. The proxy only checked it above for a friendly
    // early FATAL; safety does not depend on that check.
    up_tx.write_all(&packet).await?;
    up_tx.flush().await?;

    let mut reported = Parameters::default();
    // The proxy's own first query (see `session_start`) goes upstream right behind the
    // AuthenticationOk: the server reads it once it has finished the session's start and sent
    // its ReadyForQuery, so it costs no round trip of its own.
    let mut start_query = bytes::BytesMut::new();
    postgres_protocol::message::frontend::query(
        &crate::fence_sql::session_start_sql(cfg.require_fence),
        &mut start_query,
    )?;
    let mut start_sent = false;
    // Authentication is the upstream's business: relay its requests and the client's answers
    // (cleartext, md5, SASL/SCRAM) byte for byte until the first ReadyForQuery, which the client
    // gets only once the proxy's query has confirmed the database.
    loop {
        let msg = match up_rx.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                let e = ProxyError::fatal(
                    error::PROTOCOL_VIOLATION,
                    format!("upstream {} during startup: {e}", cfg.upstream_addr),
                );
                refuse_split(&mut client_tx, e).await;
                return Ok(Startup::Done);
            }
            None => {
                let e = ProxyError::fatal(
                    error::CONNECTION_FAILURE,
                    format!(
                        "upstream {} closed the connection during startup",
                        cfg.upstream_addr
                    ),
                );
                refuse_split(&mut client_tx, e).await;
                return Ok(Startup::Done);
            }
        };
        if msg.tag == b'Z' {
            break;
        }
        match without_plus_mechanisms(&msg, upstream_tls) {
            Some(frame) => client_tx.write_all(&frame).await?,
            None => client_tx.write_all(&msg.frame).await?,
        }
        reported.track(&msg);
        match msg.tag {
            b'E' => {
                client_tx.flush().await?;
                return Ok(Startup::Done);
            }
            b'R' => {
                let kind = msg
                    .body()
                    .get(..4)
                    .map(|b| i32::from_be_bytes([b[0], b[1], b[2], b[3]]))
                    .unwrap_or(0);
                // 0 = AuthenticationOk, 12 = SASLFinal: no answer expected.
                if kind == 0 && !start_sent {
                    up_tx.write_all(&start_query).await?;
                    up_tx.flush().await?;
                    start_sent = true;
                } else if kind != 0 && kind != 12 {
                    client_tx.flush().await?;
                    let answer = match client_rx.next().await {
                        Some(Ok(m)) => m,
                        Some(Err(e)) => {
                            let e = ProxyError::fatal(error::PROTOCOL_VIOLATION, &e);
                            refuse_split(&mut client_tx, e).await;
                            return Ok(Startup::Done);
                        }
                        None => anyhow::bail!("client went away during authentication"),
                    };
                    if kind == AUTH_SASL
                        && let Some(reason) = channel_binding_mismatch(&answer, tls, upstream_tls)
                    {
                        refuse_split(
                            &mut client_tx,
                            ProxyError::fatal(error::INVALID_AUTHORIZATION, reason),
                        )
                        .await;
                        return Ok(Startup::Done);
                    }
                    up_tx.write_all(&answer.frame).await?;
                    up_tx.flush().await?;
                }
            }
            _ => {}
        }
    }
    if !start_sent {
        // A server that never said AuthenticationOk (none does): the query goes now.
        up_tx.write_all(&start_query).await?;
        up_tx.flush().await?;
    }
    let started = match session_start(&mut up_rx, &mut client_tx, &mut reported, &cfg).await? {
        Ok(started) => started,
        Err(e) => {
            refuse_split(&mut client_tx, e).await;
            return Ok(Startup::Done);
        }
    };
    if let Err(e) = served_database.confirm(&started) {
        tracing::warn!(database = %served_database.name, "{}", e.message);
        refuse_split(&mut client_tx, e).await;
        return Ok(Startup::Done);
    }
    client_tx.write_all(&started.ready.frame).await?;
    client_tx.flush().await?;
    client_rx.decoder_mut().max_body_bytes = cfg.max_message_bytes;
    let fenced_at_start = cfg.require_fence || !started.unfenced;
    tracing::debug!(
        user = %String::from_utf8_lossy(last(&pairs, "user").unwrap_or_default()),
        database = %String::from_utf8_lossy(&database),
        fence = fence.unwrap_or_default(),
        "session authenticated"
    );
    Ok(Startup::Session(Box::new(Session::new(
        cfg,
        client_rx,
        client_tx,
        up_rx,
        up_tx,
        crate::session::Reported {
            status: started.ready.body().first().copied().unwrap_or(b'I'),
            standard_strings_off: reported.standard_strings_off,
            client_encoding: reported.client_encoding,
            fence: verified,
            verification,
            fenced_at_start,
        },
    ))))
}

/// Settings the server reports (ParameterStatus) that the session must know.
#[derive(Default)]
struct Parameters {
    /// How the server lexes strings (`standard_conforming_strings` off).
    standard_strings_off: bool,
    /// The server converts client SQL from `client_encoding`; the proxy reads UTF-8 only, so it
    /// must know the encoding (GUC_REPORT: the server reports it during startup).
    client_encoding: Option<String>,
}

impl Parameters {
    /// Takes what a ParameterStatus says; other messages change nothing.
    fn track(&mut self, msg: &codec::Message) {
        if msg.tag != b'S' {
            return;
        }
        let mut body = msg.body();
        match codec::read_cstr(&mut body).as_deref() {
            Some("standard_conforming_strings") => {
                self.standard_strings_off = codec::read_cstr(&mut body).as_deref() != Some("on");
            }
            Some("client_encoding") => self.client_encoding = codec::read_cstr(&mut body),
            _ => {}
        }
    }
}

/// The database a session named, as the proxy checked it at start.
struct Checked {
    /// The name the client gave (one of the served names).
    name: String,
    /// Its `pg_database.oid` at the start-up check.
    oid: u32,
}

/// What the proxy's first query on a session (`fence_sql::session_start_sql`) found.
struct Started {
    /// The oid of the database the session is in, as the server wrote it; `None` without a row.
    oid: Option<String>,
    /// The upstream's message when the query failed.
    failed: Option<String>,
    /// The second column was `t`: the session has no fence from its startup options or its
    /// role's and database's defaults (read without `--require-fence` only).
    unfenced: bool,
    /// The ReadyForQuery that ended the query, for the client.
    ready: codec::Message,
}

impl Checked {
    /// Ok only when the session is in the very database the proxy checked at start under the
    /// name the client gave: a database renamed into that name since (a clone made with
    /// `TEMPLATE`, a restore: the same guard, fence table and proof key, and the tokens of the
    /// moment it was copied) would take tokens the original refused. Fails closed: an error of
    /// the query, or no row, refuses the session too.
    fn confirm(&self, started: &Started) -> Result<(), ProxyError> {
        let Checked { name, oid } = self;
        let why = match (&started.failed, &started.oid) {
            (None, Some(found)) if *found == oid.to_string() => return Ok(()),
            (None, Some(found)) => format!(
                "database {name:?} is not the database this proxy checked at start under that name (its oid is {found}, the one checked was {oid}: it was renamed or created since)"
            ),
            (Some(message), _) => format!(
                "cannot confirm that database {name:?} is the one this proxy checked at start: the proxy's query failed: {message}"
            ),
            (None, None) => format!(
                "cannot confirm that database {name:?} is the one this proxy checked at start: the proxy's query gave no oid"
            ),
        };
        Err(ProxyError::fatal(
            error::INVALID_AUTHORIZATION,
            format!(
                "{why}; restart the proxy after renaming or recreating a served database, so that it checks the one now under that name"
            ),
        ))
    }
}

/// Reads the answer to the proxy's first query on a session, up to its ReadyForQuery: nothing of
/// it goes to the client but a ParameterStatus. The outer `Err` is a failed write to the client;
/// the inner one the client's FATAL when the upstream broke off or sent what that query cannot
/// answer.
async fn session_start(
    up_rx: &mut crate::session::Rx,
    client_tx: &mut crate::session::Tx,
    reported: &mut Parameters,
    cfg: &Config,
) -> anyhow::Result<Result<Started, ProxyError>> {
    let mut oid = None;
    let mut failed = None;
    let mut unfenced = false;
    loop {
        let msg = match up_rx.next().await {
            Some(Ok(m)) => m,
            Some(Err(e)) => {
                return Ok(Err(ProxyError::fatal(
                    error::PROTOCOL_VIOLATION,
                    format!("upstream {} during startup: {e}", cfg.upstream_addr),
                )));
            }
            None => {
                return Ok(Err(ProxyError::fatal(
                    error::CONNECTION_FAILURE,
                    format!(
                        "upstream {} closed the connection during startup",
                        cfg.upstream_addr
                    ),
                )));
            }
        };
        match msg.tag {
            b'Z' => {
                return Ok(Ok(Started {
                    oid,
                    failed,
                    unfenced,
                    ready: msg,
                }));
            }
            b'D' => {
                let body = msg.body();
                unfenced = crate::session::data_row_column(body, 1) == Some(&b"t"[..]);
                oid = crate::session::data_row_column(body, 2)
                    .map(|o| String::from_utf8_lossy(o).into_owned());
            }
            b'E' => {
                failed = Some(
                    error::error_field(msg.body(), b'M').unwrap_or_else(|| "no message".to_owned()),
                );
            }
            // Descriptions, completions and notices of the proxy's own query are its own.
            b'T' | b'C' | b'N' => {}
            b'S' => {
                reported.track(&msg);
                client_tx.write_all(&msg.frame).await?;
            }
            other => {
                return Ok(Err(ProxyError::fatal(
                    error::PROTOCOL_VIOLATION,
                    format!(
                        "upstream {} answered the proxy's first query with message {:?}",
                        cfg.upstream_addr, other as char
                    ),
                )));
            }
        }
    }
}

/// Opens a connection to the upstream and negotiates TLS as `--upstream`'s sslmode says. Any
/// failure is the client's FATAL 08006, naming the upstream and the reason.
async fn connect_upstream(cfg: &Config) -> Result<(BoxIo, bool), ProxyError> {
    let addr = cfg.upstream_addr.as_str();
    let connect = async {
        let tcp = TcpStream::connect(addr)
            .await
            .map_err(|e| format!("cannot connect to upstream {addr}: {e}"))?;
        let _ = tcp.set_nodelay(true);
        cfg.upstream_tls
            .negotiate(tcp)
            .await
            .map_err(|e| format!("upstream {addr}: {e}"))
    };
    match tokio::time::timeout(cfg.connect_timeout, connect).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(message)) => Err(ProxyError::fatal(error::CONNECTION_FAILURE, message)),
        Err(_) => Err(ProxyError::fatal(
            error::CONNECTION_FAILURE,
            format!(
                "connecting to upstream {addr} timed out after {} ms",
                cfg.connect_timeout.as_millis()
            ),
        )),
    }
}

/// How long a client outside `--allow-client` may take to show its startup packet before the
/// connection is closed without a word.
const OUTSIDER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Refuses a client outside `--allow-client` with `e`, without TLS and without an upstream
/// connection. libpq shows an error sent in place of the answer to its SSLRequest only as "server
/// sent an error response during SSL exchange", so encryption requests are answered `N` and the
/// error goes in reply to the startup message, where libpq prints it.
pub async fn refuse_outsider(mut client: TcpStream, e: ProxyError) {
    let _ = tokio::time::timeout(OUTSIDER_TIMEOUT, async {
        for _ in 0..=MAX_ENCRYPTION_REQUESTS {
            let Ok(packet) = codec::read_startup_packet(&mut client).await else {
                break;
            };
            let code = i32::from_be_bytes([packet[4], packet[5], packet[6], packet[7]]);
            if code != SSL_REQUEST && code != GSSENC_REQUEST {
                break;
            }
            client.write_all(b"N").await?;
        }
        client.write_all(&e.to_message().frame).await?;
        client.flush().await
    })
    .await;
}

/// AuthenticationSASL: the server lists its SASL mechanisms; the client's next message picks one.
const AUTH_SASL: i32 = 10;

/// AuthenticationSASL from a TLS upstream without its channel-binding (`-PLUS`) mechanisms, or
/// `None` to relay the message as is. Binding cannot pass through the proxy, and libpq refuses
/// a `-PLUS` offer outright on a plain-text connection ("server offered SCRAM-SHA-256-PLUS
/// authentication over a non-SSL connection").
fn without_plus_mechanisms(msg: &crate::codec::Message, upstream_tls: bool) -> Option<Vec<u8>> {
    let body = msg.body();
    if !upstream_tls || msg.tag != b'R' || body.get(..4) != Some(&AUTH_SASL.to_be_bytes()[..]) {
        return None;
    }
    let mut rest = &body[4..];
    let mut kept = Vec::new();
    while let Some(mechanism) = codec::read_cstr(&mut rest) {
        if mechanism.is_empty() {
            break;
        }
        if !mechanism.ends_with("-PLUS") {
            kept.push(mechanism);
        }
    }
    let mut out_body = AUTH_SASL.to_be_bytes().to_vec();
    for m in &kept {
        out_body.extend_from_slice(m.as_bytes());
        out_body.push(0);
    }
    out_body.push(0);
    let mut frame = vec![b'R'];
    frame.extend_from_slice(&(out_body.len() as i32 + 4).to_be_bytes());
    frame.extend_from_slice(&out_body);
    Some(frame)
}

/// Why a client's SASLInitialResponse cannot succeed through the proxy, if it cannot. SCRAM
/// channel binding ties the exchange to the TLS connection the client sees, which ends at the
/// proxy: with TLS on both sides, `SCRAM-SHA-256-PLUS` binds to the proxy's certificate (the
/// upstream's check fails), and the `y` flag ("I could bind, you did not offer it") makes a
/// TLS upstream suspect a downgrade. Both would fail at the upstream with a less helpful message.
fn channel_binding_mismatch(
    answer: &crate::codec::Message,
    client_tls: bool,
    upstream_tls: bool,
) -> Option<String> {
    if !client_tls || !upstream_tls {
        return None;
    }
    let mut body = answer.body();
    let mechanism = codec::read_cstr(&mut body)?;
    // Then an Int32 length and the client-first-message, which opens with the gs2 flag.
    let flag = body.get(4).copied();
    if mechanism.ends_with("-PLUS") || flag == Some(b'y') {
        return Some(format!(
            "SCRAM channel binding cannot pass through the proxy (TLS ends at the proxy; mechanism {mechanism:?}): connect with channel_binding=disable, and verify the proxy with sslmode=verify-full"
        ));
    }
    None
}

/// Relays a CancelRequest to the upstream as is: the client holds the upstream's own backend key,
/// because the proxy passes BackendKeyData through.
async fn forward_cancel(cfg: &Config, packet: &Bytes) {
    match connect_upstream(cfg).await {
        Ok((mut s, _)) => {
            if let Err(e) = s.write_all(packet).await {
                tracing::warn!(upstream = %cfg.upstream_addr, "forwarding cancel request: {e}");
            }
            let _ = s.flush().await;
        }
        Err(e) => tracing::warn!("forwarding cancel request: {}", e.message),
    }
}

async fn refuse(client: &mut BoxIo, e: ProxyError) {
    tracing::info!(code = e.code, "refusing client: {}", e.message);
    let _ = client.write_all(&e.to_message().frame).await;
    let _ = client.flush().await;
    // A TLS client needs the close_notify to read the error before the connection ends.
    let _ = client.shutdown().await;
}

async fn refuse_split(client: &mut crate::session::Tx, e: ProxyError) {
    tracing::info!(code = e.code, "refusing client: {}", e.message);
    let _ = client.write_all(&e.to_message().frame).await;
    let _ = client.flush().await;
    let _ = client.shutdown().await;
}

/// A startup parameter or a setting of `options`: name and value, as bytes.
pub type Pair = (Vec<u8>, Vec<u8>);

/// The key/value pairs of a StartupMessage body (after the protocol version), in order, as
/// bytes: Postgres compares them as bytes and applies them in this order.
pub fn startup_pairs(mut body: &[u8]) -> Vec<Pair> {
    let mut pairs = Vec::new();
    while let Some(key) = read_bytes(&mut body) {
        if key.is_empty() {
            break;
        }
        let Some(value) = read_bytes(&mut body) else {
            break;
        };
        pairs.push((key.to_vec(), value.to_vec()));
    }
    pairs
}

fn read_bytes<'a>(buf: &mut &'a [u8]) -> Option<&'a [u8]> {
    let end = buf.iter().position(|&b| b == 0)?;
    let (s, rest) = buf.split_at(end);
    *buf = &rest[1..];
    Some(s)
}

/// The last value of parameter `name` (Postgres keeps the last of a repeated one).
fn last<'a>(pairs: &'a [Pair], name: &str) -> Option<&'a [u8]> {
    pairs
        .iter()
        .rev()
        .find(|(k, _)| k == name.as_bytes())
        .map(|(_, v)| v.as_slice())
}

/// The database the session connects to, as Postgres picks it: the `database` parameter, or
/// the user's name when it is absent or empty.
pub fn startup_database(pairs: &[Pair]) -> Vec<u8> {
    match last(pairs, "database") {
        Some(db) if !db.is_empty() => db.to_vec(),
        _ => last(pairs, "user").unwrap_or_default().to_vec(),
    }
}

/// The fence given at startup, parsed (see [`startup_fence_value`]).
pub fn startup_fence(pairs: &[Pair]) -> Result<Option<Fence>, ProxyError> {
    match startup_fence_value(pairs)? {
        None => Ok(None),
        Some(v) => fence_value::parse(&v).map(Some).map_err(|mut e| {
            e.fatal = true;
            e
        }),
    }
}

/// The `lockd.fence` value the session starts with, `None` when absent or empty, read as
/// Postgres sets it (`process_startup_options`): first the switches of `options`, then every
/// other parameter in the packet's order, each overriding what came before; setting names
/// compare without ASCII case. `options` that mention `lockd.` but do not read exactly as
/// Postgres reads them are refused (FATAL 22023, naming them): the proxy must check the value
/// Postgres will hold, not a guess.
pub fn startup_fence_value(pairs: &[Pair]) -> Result<Option<String>, ProxyError> {
    let fatal = |message: String| ProxyError::fatal(error::BAD_FENCE, message);
    let mut value: Option<Vec<u8>> = None;
    if let Some(options) = last(pairs, "options") {
        match options_settings(options) {
            Ok(settings) => {
                for (name, v) in settings {
                    if name.eq_ignore_ascii_case(FENCE_SETTING.as_bytes()) {
                        value = Some(v);
                    }
                }
            }
            Err(why) if mentions_lockd(options) => {
                return Err(fatal(format!(
                    "the startup options {:?} name a lockd. setting in a form fence-proxy does not read exactly ({why}): give the fence as -c lockd.fence=<resource>:<token>, --lockd.fence=<resource>:<token> or the lockd.fence startup parameter",
                    String::from_utf8_lossy(options)
                )));
            }
            // Nothing of lockd. in them: whatever they set is not the fence, and Postgres
            // refuses what it cannot read.
            Err(_) => {}
        }
    }
    for (name, v) in pairs {
        let special = ["user", "database", "options", "replication"]
            .iter()
            .any(|s| name == s.as_bytes())
            || name.starts_with(b"_pq_.");
        if !special && name.eq_ignore_ascii_case(FENCE_SETTING.as_bytes()) {
            value = Some(v.clone());
        }
    }
    match value {
        None => Ok(None),
        Some(v) if v.is_empty() => Ok(None),
        Some(v) => String::from_utf8(v).map(Some).map_err(|e| {
            fatal(format!(
                "the startup lockd.fence value {:?} is not UTF-8",
                String::from_utf8_lossy(e.as_bytes())
            ))
        }),
    }
}

/// The setting the guard reads.
const FENCE_SETTING: &str = "lockd.fence";

/// Whether `options` may name a `lockd.` setting, in any case, once backslashes are removed.
fn mentions_lockd(options: &[u8]) -> bool {
    let plain: Vec<u8> = options
        .iter()
        .filter(|&&b| b != b'\\')
        .map(u8::to_ascii_lowercase)
        .collect();
    plain.windows(6).any(|w| w == b"lockd.")
}

/// The switches of `postgres` (its getopt string) that take an argument, in the word or the
/// next one; `-` is `--name=value`.
const SWITCHES_WITH_ARGUMENT: &[u8] = b"BCcDdfhkNprStvW-";
/// The switches that take none (and may be bundled: `-ec name=value` is `-e -c name=value`).
const SWITCHES_ALONE: &[u8] = b"bEeFijlnOPsT";

/// The settings that a startup `options` string makes, `(name, value)` in order, read as
/// Postgres reads it: `pg_split_opts` splits at unescaped ASCII whitespace (a backslash keeps the
/// next byte), then `process_postgres_switches` runs getopt over the words with the server's
/// switches, and `-c name=value` and `--name=value` set `name` (dashes in it read as
/// underscores). `Err` names what this function does not follow exactly or what Postgres
/// refuses (a non-ASCII byte, whose whitespace depends on the server's locale; an unknown
/// switch, a missing argument, a word that is not a switch, a setting without `=`).
fn options_settings(options: &[u8]) -> Result<Vec<Pair>, String> {
    if let Some(b) = options.iter().find(|b| !b.is_ascii()) {
        return Err(format!("byte 0x{b:02x} is not ASCII"));
    }
    let mut words: Vec<Vec<u8>> = Vec::new();
    let mut bytes = options.iter().copied().peekable();
    loop {
        while bytes
            .next_if(|b| b.is_ascii_whitespace() || *b == 0x0b)
            .is_some()
        {}
        if bytes.peek().is_none() {
            break;
        }
        let mut word = Vec::new();
        while let Some(b) = bytes.next_if(|b| !(b.is_ascii_whitespace() || *b == 0x0b)) {
            if b == b'\\' {
                word.extend(bytes.next());
            } else {
                word.push(b);
            }
        }
        words.push(word);
    }
    let mut settings = Vec::new();
    let mut i = 0;
    while i < words.len() {
        let word = &words[i];
        i += 1;
        if word.as_slice() == b"--" {
            if i < words.len() {
                return Err("words after \"--\"".to_owned());
            }
            break;
        }
        if word.len() < 2 || word[0] != b'-' {
            return Err(format!(
                "{:?} is not a switch",
                String::from_utf8_lossy(word)
            ));
        }
        let mut j = 1;
        while j < word.len() {
            let switch = word[j];
            j += 1;
            if SWITCHES_ALONE.contains(&switch) {
                continue;
            }
            if !SWITCHES_WITH_ARGUMENT.contains(&switch) {
                return Err(format!("unknown switch -{}", switch as char));
            }
            let argument = if j < word.len() {
                word[j..].to_vec()
            } else if i < words.len() {
                i += 1;
                words[i - 1].clone()
            } else {
                return Err(format!("-{} without its argument", switch as char));
            };
            if switch == b'c' || switch == b'-' {
                let Some(eq) = argument.iter().position(|&b| b == b'=') else {
                    return Err(format!(
                        "{:?} without =value",
                        String::from_utf8_lossy(&argument)
                    ));
                };
                let name = argument[..eq]
                    .iter()
                    .map(|&b| if b == b'-' { b'_' } else { b })
                    .collect();
                settings.push((name, argument[eq + 1..].to_vec()));
            }
            break;
        }
    }
    Ok(settings)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Goal: a session is admitted only when the proxy's first query found the oid checked at
    /// start; another oid, an error or no row each refuse it with 28000 naming the database.
    #[test]
    fn only_the_checked_database_is_confirmed() {
        let checked = Checked {
            name: "app".to_owned(),
            oid: 16384,
        };
        let started = |oid: Option<&str>, failed: Option<&str>| Started {
            oid: oid.map(str::to_owned),
            failed: failed.map(str::to_owned),
            unfenced: true,
            ready: codec::Message {
                tag: b'Z',
                frame: Bytes::from_static(b"Z\0\0\0\x05I"),
            },
        };
        assert!(checked.confirm(&started(Some("16384"), None)).is_ok());
        for (oid, failed, says) in [
            (
                Some("16385"),
                None,
                "its oid is 16385, the one checked was 16384",
            ),
            (
                Some("16384"),
                Some("canceling statement"),
                "canceling statement",
            ),
            (None, None, "gave no oid"),
        ] {
            let e = checked.confirm(&started(oid, failed)).unwrap_err();
            assert!(e.fatal && e.code == error::INVALID_AUTHORIZATION, "{e:?}");
            assert!(
                e.message.contains("\"app\"")
                    && e.message.contains(says)
                    && e.message.contains("restart the proxy"),
                "{}",
                e.message
            );
        }
    }

    fn params(pairs: &[(&str, &str)]) -> Vec<(Vec<u8>, Vec<u8>)> {
        pairs
            .iter()
            .map(|(k, v)| (k.as_bytes().to_vec(), v.as_bytes().to_vec()))
            .collect()
    }

    fn value(pairs: &[(&str, &str)]) -> Option<String> {
        startup_fence_value(&params(pairs)).unwrap()
    }

    fn refused(pairs: &[(&str, &str)]) -> ProxyError {
        startup_fence_value(&params(pairs)).unwrap_err()
    }

    #[test]
    fn fence_comes_from_options_in_every_spelling() {
        let f = startup_fence(&params(&[("options", "-c lockd.fence=orders:42")])).unwrap();
        assert_eq!(f.unwrap().to_string(), "orders:42");
        let f = startup_fence(&params(&[(
            "options",
            "-c search_path=x --lockd.fence=my\\ orders:7",
        )]))
        .unwrap();
        assert_eq!(f.unwrap().resource, "my orders");
        let f = startup_fence(&params(&[("lockd.fence", "a:1")])).unwrap();
        assert_eq!(f.unwrap().token.0, 1);
        assert_eq!(startup_fence(&params(&[("user", "x")])).unwrap(), None);
    }

    #[test]
    fn malformed_startup_fence_is_fatal_and_names_the_value() {
        let e = startup_fence(&params(&[("options", "-clockd.fence=orders")])).unwrap_err();
        assert!(e.fatal);
        assert_eq!(e.code, error::BAD_FENCE);
        assert!(e.message.contains("\"orders\""), "{}", e.message);
    }

    /// Review L1: Postgres applies `options` first, then the other parameters in order, with
    /// GUC names compared without ASCII case; the last one wins.
    #[test]
    fn parameters_override_options_as_in_postgres() {
        assert_eq!(
            value(&[("lockd.fence", "r:5"), ("options", "-c lockd.fence=r:6")]),
            Some("r:5".into())
        );
        assert_eq!(
            value(&[
                ("options", "-c lockd.fence=garbage"),
                ("lockd.fence", "r:6")
            ]),
            Some("r:6".into())
        );
        assert_eq!(
            value(&[("lockd.fence", "r:5"), ("LOCKD.Fence", "r:7")]),
            Some("r:7".into())
        );
        assert_eq!(
            value(&[("options", "-c lockd.fence=r:1 -c LOCKD.FENCE=r:2")]),
            Some("r:2".into())
        );
        // An empty value later clears it.
        assert_eq!(
            value(&[("options", "-c lockd.fence=r:1"), ("lockd.fence", "")]),
            None
        );
        // The last options parameter is the one Postgres reads.
        assert_eq!(
            value(&[
                ("options", "-c lockd.fence=r:1"),
                ("options", "-c search_path=x")
            ]),
            None
        );
    }

    /// Review L1: `options` is read with getopt over the server's switches, so switches bundle
    /// and take their argument from the rest of the word or from the next word.
    #[test]
    fn options_are_read_with_getopt() {
        for (options, fence) in [
            ("-ec lockd.fence=r:9", "r:9"),
            ("-eclockd.fence=r:9", "r:9"),
            ("-e -c lockd.fence=r:9", "r:9"),
            ("-e-lockd.fence=r:9", "r:9"),
            ("-d 5 -c lockd.fence=r:9", "r:9"),
            ("-d -c -c lockd.fence=r:9", "r:9"),
            (
                "-c lockd.fence=r:8 -c x.y=-clockd.fence=r:1 -c lockd.fence=r:9",
                "r:9",
            ),
            ("-c\tlockd\\.fence=r\\:9", "r:9"),
            ("\x0b-c\x0blockd.fence=r:9\x0c", "r:9"),
            ("-c lockd.fence=a\\ b:9 --", "a b:9"),
            ("-c lockd.fence=r:9\\", "r:9"),
        ] {
            assert_eq!(
                value(&[("options", options)]),
                Some(fence.into()),
                "{options:?}"
            );
        }
        // -d takes the next word as its argument, so it is no setting.
        assert_eq!(value(&[("options", "-d -clockd.fence=r:9")]), None);
        // Another setting whose name only looks alike.
        assert_eq!(value(&[("options", "-c lockd.fence_x=r:9")]), None);
        // Not lockd.: left to Postgres, which refuses what it cannot read.
        assert_eq!(value(&[("options", "-Q -c search_path=x")]), None);
    }

    /// Review L1: options that mention lockd. in a form the proxy does not follow exactly are
    /// refused, naming them.
    #[test]
    fn unreadable_options_naming_lockd_are_refused() {
        for options in [
            "-c\u{a0}lockd.fence=r:9",
            "-Q -c lockd.fence=r:9",
            "x -c lockd.fence=r:9",
            "-- -c lockd.fence=r:9",
            "-c lockd.fence",
            "-c lockd.fence=r:9 -c",
            "-c lockd\\.fence=r:9 -",
        ] {
            let e = refused(&[("options", options)]);
            assert!(e.fatal, "{options:?}");
            assert_eq!(e.code, error::BAD_FENCE, "{options:?}");
            assert!(e.message.contains("lockd."), "{options:?}: {}", e.message);
        }
    }

    #[test]
    fn database_defaults_to_the_user() {
        assert_eq!(startup_database(&params(&[("user", "u")])), b"u");
        assert_eq!(
            startup_database(&params(&[("user", "u"), ("database", "")])),
            b"u"
        );
        assert_eq!(
            startup_database(&params(&[
                ("database", "a"),
                ("user", "u"),
                ("database", "b")
            ])),
            b"b"
        );
    }
}
