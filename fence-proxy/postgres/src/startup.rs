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
pub async fn handshake(mut client: TcpStream, cfg: Arc<Config>) -> anyhow::Result<Startup> {
    let mut encryption_requests = 0;
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
            SSL_REQUEST | GSSENC_REQUEST if encryption_requests < MAX_ENCRYPTION_REQUESTS => {
                encryption_requests += 1;
                // 'N': this proxy speaks plain TCP only; libpq then continues unencrypted or
                // gives up, as its sslmode says.
                client.write_all(b"N").await?;
            }
            CANCEL_REQUEST => {
                forward_cancel(&cfg, &packet).await;
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

    let upstream = match connect_upstream(&cfg).await {
        Ok(s) => s,
        Err(e) => {
            refuse(&mut client, e).await;
            return Ok(Startup::Done);
        }
    };
    let (up_read, up_write) = upstream.into_split();
    let (client_read, client_write) = client.into_split();
    let codec = || MessageCodec {
        max_body_bytes: cfg.max_message_bytes,
    };
    let mut up_rx = FramedRead::new(up_read, codec());
    let mut up_tx = BufWriter::new(up_write);
    let mut client_rx = FramedRead::new(client_read, codec());
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
        client_tx.write_all(&msg.frame).await?;
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
                    up_tx.write_all(&answer.frame).await?;
                    up_tx.flush().await?;
                }
            }
            _ => {}
        }
    };
    client_tx.flush().await?;
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

async fn connect_upstream(cfg: &Config) -> Result<TcpStream, ProxyError> {
    let addr = cfg.upstream_addr.as_str();
    match tokio::time::timeout(cfg.connect_timeout, TcpStream::connect(addr)).await {
        Ok(Ok(s)) => {
            let _ = s.set_nodelay(true);
            Ok(s)
        }
        Ok(Err(e)) => Err(ProxyError::fatal(
            error::CONNECTION_FAILURE,
            format!("cannot connect to upstream {addr}: {e}"),
        )),
        Err(_) => Err(ProxyError::fatal(
            error::CONNECTION_FAILURE,
            format!(
                "connecting to upstream {addr} timed out after {} ms",
                cfg.connect_timeout.as_millis()
            ),
        )),
    }
}

/// Relays a CancelRequest to the upstream as is: the client holds the upstream's own backend key,
/// because the proxy passes BackendKeyData through.
async fn forward_cancel(cfg: &Config, packet: &Bytes) {
    match connect_upstream(cfg).await {
        Ok(mut s) => {
            if let Err(e) = s.write_all(packet).await {
                tracing::warn!(upstream = %cfg.upstream_addr, "forwarding cancel request: {e}");
            }
        }
        Err(e) => tracing::warn!("forwarding cancel request: {}", e.message),
    }
}

async fn refuse(client: &mut TcpStream, e: ProxyError) {
    tracing::info!(code = e.code, "refusing client: {}", e.message);
    let _ = client.write_all(&e.to_message().frame).await;
    let _ = client.flush().await;
}

async fn refuse_split(client: &mut BufWriter<tokio::net::tcp::OwnedWriteHalf>, e: ProxyError) {
    tracing::info!(code = e.code, "refusing client: {}", e.message);
    let _ = client.write_all(&e.to_message().frame).await;
    let _ = client.flush().await;
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
