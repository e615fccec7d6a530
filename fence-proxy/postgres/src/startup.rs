//! The startup phase of a client connection: encryption requests, cancel requests, the startup
//! packet (whose `lockd.fence` option is checked early for a clear FATAL error), and
//! authentication relayed to the upstream untouched.

use std::collections::BTreeMap;
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

    let params = startup_params(&packet[8..]);
    // With --verify-key the startup fence must verify (a sequencer, or a plain token under
    // --allow-unsigned) before anything reaches the upstream; its proof goes with every guard
    // call of the session.
    let checked = match &cfg.verification {
        None => startup_fence(&params).map(|f| (f.map(|f| f.to_string()), None)),
        Some(v) => match startup_fence_value(&params) {
            None => Ok((None, None)),
            Some(value) => v
                .check(&value)
                .map(|verified| (Some(value), Some(verified)))
                .map_err(|mut e| {
                    e.fatal = true;
                    e
                }),
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

    // Tracked from ParameterStatus: the session must know how the server lexes strings.
    let mut standard_strings_off = false;
    // The server converts client SQL from client_encoding; the proxy reads UTF-8 only, so it must
    // know the encoding (GUC_REPORT: the server reports it during startup).
    let mut client_encoding: Option<String> = None;
    // Authentication is the upstream's business: relay its requests and the client's answers
    // (cleartext, md5, SASL/SCRAM) byte for byte until the first ReadyForQuery.
    let status = loop {
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
        match without_plus_mechanisms(&msg, upstream_tls) {
            Some(frame) => client_tx.write_all(&frame).await?,
            None => client_tx.write_all(&msg.frame).await?,
        }
        if msg.tag == b'S' {
            let mut body = msg.body();
            match codec::read_cstr(&mut body).as_deref() {
                Some("standard_conforming_strings") => {
                    standard_strings_off = codec::read_cstr(&mut body).as_deref() != Some("on");
                }
                Some("client_encoding") => client_encoding = codec::read_cstr(&mut body),
                _ => {}
            }
        }
        match msg.tag {
            b'Z' => break msg.body().first().copied().unwrap_or(b'I'),
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
                if kind != 0 && kind != 12 {
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
    };
    client_tx.flush().await?;
    client_rx.decoder_mut().max_body_bytes = cfg.max_message_bytes;
    tracing::debug!(
        user = params.get("user").map(String::as_str).unwrap_or(""),
        database = params.get("database").map(String::as_str).unwrap_or(""),
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
            status,
            standard_strings_off,
            client_encoding,
            fence: verified,
        },
    ))))
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

/// The key/value pairs of a StartupMessage body (after the protocol version).
pub fn startup_params(mut body: &[u8]) -> BTreeMap<String, String> {
    let mut params = BTreeMap::new();
    while let Some(key) = codec::read_cstr(&mut body) {
        if key.is_empty() {
            break;
        }
        let Some(value) = codec::read_cstr(&mut body) else {
            break;
        };
        params.insert(key, value);
    }
    params
}

/// The fence given at startup: a `lockd.fence` parameter or `-c lockd.fence=...` /
/// `--lockd.fence=...` inside `options`; the last one wins, as in Postgres.
pub fn startup_fence(params: &BTreeMap<String, String>) -> Result<Option<Fence>, ProxyError> {
    match startup_fence_value(params) {
        None => Ok(None),
        Some(v) => fence_value::parse(&v).map(Some).map_err(|mut e| {
            e.fatal = true;
            e
        }),
    }
}

/// The raw `lockd.fence` value of the startup packet, `None` when absent or empty.
pub fn startup_fence_value(params: &BTreeMap<String, String>) -> Option<String> {
    let mut value = params.get("lockd.fence").cloned();
    if let Some(options) = params.get("options") {
        let words = split_options(options);
        let mut i = 0;
        while i < words.len() {
            let setting = if words[i] == "-c" {
                i += 1;
                words.get(i).map(String::as_str)
            } else if let Some(rest) = words[i].strip_prefix("-c") {
                Some(rest)
            } else {
                words[i].strip_prefix("--")
            };
            if let Some((name, v)) = setting.and_then(|s| s.split_once('='))
                && name.eq_ignore_ascii_case("lockd.fence")
            {
                value = Some(v.to_owned());
            }
            i += 1;
        }
    }
    value.filter(|v| !v.is_empty())
}

/// Splits a libpq `options` string at unescaped whitespace; a backslash keeps the next character.
fn split_options(options: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut chars = options.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let Some(n) = chars.next() {
                    word.push(n);
                }
            }
            c if c.is_whitespace() => {
                if !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
            }
            c => word.push(c),
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
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
}
