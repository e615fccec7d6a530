//! acquire, renew, release, describe and status, with text and JSON output; keys and hold are
//! dispatched to their modules.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lockd_client::{
    AcquireOptions, BearerToken, Client, ClientConfig, ClientTls, LeaseId, ReleaseOutcome,
    RequestId,
};
use lockd_fence::sequencer::encode_text;
use serde_json::json;

use crate::cli::{Cli, Command};
use crate::exit::{self, Failure};
use crate::hold;

/// Runs one command; `Ok` carries the exit code (`hold` passes on its child's).
pub async fn run(cli: Cli) -> Result<u8, Failure> {
    let mut config = ClientConfig::new(cli.endpoints.iter().map(String::as_str));
    config.call_timeout = cli.timeout;
    if let Some(ca) = &cli.cacert {
        config.tls = Some(ClientTls::from_files(
            ca,
            cli.cert.as_deref(),
            cli.key.as_deref(),
        )?);
    }
    if let Some(path) = &cli.auth_token_file {
        config.bearer_token = Some(BearerToken::from_file(path)?);
    }
    let client = Client::with_config(config)?;
    let json = cli.json();
    match cli.command {
        Command::Acquire {
            resource,
            lease,
            request_id,
        } => {
            let mut opts = acquire_options(&lease, cli.timeout);
            // Without the pid: repeating `acquire --request-id ID` from a new process must send
            // the same arguments, or lockd rejects the id as reused.
            opts.holder
                .get_or_insert_with(|| format!("{}/lockctl", lockd_client::config::hostname()));
            if let Some(id) = request_id {
                opts.request_id = Some(RequestId::parse(id)?);
            }
            let granted = client
                .acquire(&resource, opts)
                .await
                .map_err(Failure::from_acquire)?;
            print_fields(
                json,
                json!({
                    "resource": granted.resource,
                    "lease_id": granted.lease_id.as_str(),
                    "fencing_token": granted.fencing_token.0,
                    "lease_ttl_ms": millis(granted.ttl),
                    "expires_at_unix_ms": granted.expires_at_unix_ms,
                    "request_id": granted.request_id.as_str(),
                    "sequencer": encode_text(&granted.sequencer),
                }),
                &[
                    ("lease_id", granted.lease_id.as_str().to_owned()),
                    ("fencing_token", granted.fencing_token.to_string()),
                    ("ttl", humantime::format_duration(granted.ttl).to_string()),
                    ("sequencer", encode_text(&granted.sequencer)),
                ],
            );
            Ok(exit::OK)
        }
        Command::Renew {
            resource,
            lease_id,
            ttl,
        } => {
            let renewed = client
                .renew(&resource, &LeaseId::new(lease_id), ttl)
                .await?;
            print_fields(
                json,
                json!({
                    "resource": resource,
                    "lease_ttl_ms": millis(renewed.ttl),
                    "expires_at_unix_ms": renewed.expires_at_unix_ms,
                }),
                &[
                    ("ttl", humantime::format_duration(renewed.ttl).to_string()),
                    ("expires_at", wall_time(renewed.expires_at_unix_ms)),
                ],
            );
            Ok(exit::OK)
        }
        Command::Release { resource, lease_id } => {
            let lease_id = LeaseId::new(lease_id);
            let shown = lockd_client::lease::abbreviate(lease_id.as_str());
            match client.release_outcome(&resource, &lease_id).await? {
                ReleaseOutcome::Released => {}
                ReleaseOutcome::NotCurrent => {
                    return Err(Failure::new(
                        exit::NOT_FOUND,
                        "not_found",
                        format!(
                            "lease {shown} of {resource:?} is not current (expired, released or superseded); nothing released"
                        ),
                    ));
                }
                // The retry's "not current" may be the first attempt's doing: whether this
                // command released the lease is unknown (it is not held now either way).
                ReleaseOutcome::NotCurrentAfterRetry => {
                    return Err(Failure::new(
                        exit::OUTCOME_UNKNOWN,
                        "outcome_unknown",
                        format!(
                            "lease {shown} of {resource:?} is not current now; an earlier attempt of this release went unanswered and may have released it"
                        ),
                    ));
                }
            }
            print_fields(
                json,
                json!({ "resource": resource, "released": true }),
                &[("released", "true".to_owned())],
            );
            Ok(exit::OK)
        }
        Command::Describe { resource } => {
            let d = client.describe(&resource).await?;
            print_fields(
                json,
                json!({
                    "resource": resource,
                    "held": d.held,
                    "holder": d.holder,
                    "fencing_token": d.fencing_token,
                    "expires_at_unix_ms": d.expires_at_unix_ms,
                    "waiters": d.waiters,
                }),
                &[
                    ("resource", resource.clone()),
                    ("held", d.held.to_string()),
                    ("holder", d.holder.clone()),
                    ("fencing_token", d.fencing_token.to_string()),
                    (
                        "expires_at",
                        if d.held {
                            wall_time(d.expires_at_unix_ms)
                        } else {
                            "-".to_owned()
                        },
                    ),
                    ("waiters", d.waiters.to_string()),
                ],
            );
            Ok(exit::OK)
        }
        Command::Status => {
            let s = client.status().await?;
            let nodes = node_statuses(&s.members, &client).await;
            let members: Vec<_> = s
                .members
                .iter()
                .map(|m| json!({ "id": m.id, "address": m.address }))
                .collect();
            let hot = |list: &[lockd_api::v1::HotResource]| -> Vec<serde_json::Value> {
                list.iter()
                    .map(|h| json!({ "resource": h.resource, "acquires": h.acquires, "waiters": h.waiters }))
                    .collect()
            };
            let hot_text = |list: &[lockd_api::v1::HotResource]| -> String {
                if list.is_empty() {
                    return "-".to_owned();
                }
                list.iter()
                    .map(|h| {
                        format!(
                            "{} ({} acquires, {} waiting)",
                            h.resource, h.acquires, h.waiters
                        )
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            print_fields(
                json,
                json!({
                    "node_id": s.node_id,
                    "role": s.role,
                    "leader_id": s.leader_id,
                    "term": s.term,
                    "commit_index": s.commit_index,
                    "applied_index": s.applied_index,
                    "lag": s.lag,
                    "members": members,
                    "active_locks": s.active_locks,
                    "waiters": s.waiters,
                    "hot_by_acquires": hot(&s.hot_by_acquires),
                    "hot_by_waiters": hot(&s.hot_by_waiters),
                    "nodes": nodes.iter().map(|(id, addr, r)| match r {
                        Ok(n) => json!({
                            "id": id, "address": addr, "role": n.role, "leader_id": n.leader_id,
                            "term": n.term, "commit_index": n.commit_index, "applied_index": n.applied_index,
                            "lag": n.lag, "active_locks": n.active_locks, "waiters": n.waiters,
                        }),
                        Err(e) => json!({ "id": id, "address": addr, "error": e }),
                    }).collect::<Vec<_>>(),
                }),
                &[
                    ("node", s.node_id.to_string()),
                    (
                        "role",
                        if s.role.is_empty() {
                            "-".into()
                        } else {
                            s.role.clone()
                        },
                    ),
                    (
                        "leader",
                        if s.leader_id == 0 {
                            "none known".into()
                        } else {
                            s.leader_id.to_string()
                        },
                    ),
                    ("term", s.term.to_string()),
                    ("commit_index", s.commit_index.to_string()),
                    ("applied_index", s.applied_index.to_string()),
                    ("lag", s.lag.to_string()),
                    (
                        "members",
                        s.members
                            .iter()
                            .map(|m| format!("{}={}", m.id, m.address))
                            .collect::<Vec<_>>()
                            .join(" "),
                    ),
                    ("active_locks", s.active_locks.to_string()),
                    ("waiters", s.waiters.to_string()),
                    ("hot_by_acquires", hot_text(&s.hot_by_acquires)),
                    ("hot_by_waiters", hot_text(&s.hot_by_waiters)),
                ],
            );
            if !json {
                print_nodes(&nodes);
            }
            Ok(exit::OK)
        }
        Command::Keys { command } => crate::keys::run(&client, command, json).await,
        Command::Docs(docs) => docs
            .run(<Cli as clap::CommandFactory>::command())
            .map(|()| exit::OK)
            .map_err(|e| Failure::new(exit::INTERNAL, "internal", e)),
        Command::Member { command } => crate::members::member(&client, command, json).await,
        Command::Leader { command } => crate::members::leader(&client, command, json).await,
        Command::Hold {
            resource,
            lease,
            command,
        } => {
            let opts = acquire_options(&lease, cli.timeout);
            hold::hold(&client, &resource, opts, &command, json).await
        }
        Command::Snapshot { command } => {
            crate::snapshot::run(&client, command, cli.timeout, json).await
        }
    }
}

/// How long `status` waits for each node's own answer: a down node must not stall the report.
const NODE_STATUS_TIMEOUT: Duration = Duration::from_secs(2);

type NodeStatus = (u64, String, Result<lockd_api::v1::StatusResponse, String>);

/// Asks every member for its own view (role, term, indexes, lag), in parallel.
async fn node_statuses(members: &[lockd_api::v1::Member], client: &Client) -> Vec<NodeStatus> {
    let tls = client.config().tls.as_ref();
    let asks = members.iter().map(|m| async move {
        let result = async {
            let scheme = if tls.is_some() { "https" } else { "http" };
            let mut endpoint =
                tonic::transport::Endpoint::from_shared(format!("{scheme}://{}", m.address))
                    .map_err(|e| format!("bad address: {e}"))?;
            if let Some(tls) = tls {
                let mut config = tonic::transport::ClientTlsConfig::new()
                    .ca_certificate(tonic::transport::Certificate::from_pem(&tls.ca_pem));
                if let Some((cert, key)) = &tls.identity {
                    config = config.identity(tonic::transport::Identity::from_pem(cert, key));
                }
                endpoint = endpoint
                    .tls_config(config)
                    .map_err(|e| format!("TLS: {e}"))?;
            }
            let channel = endpoint
                .connect_timeout(NODE_STATUS_TIMEOUT)
                .connect()
                .await
                .map_err(|e| format!("unreachable: {e}"))?;
            let mut req = client.authed(lockd_api::v1::StatusRequest {});
            req.set_timeout(NODE_STATUS_TIMEOUT);
            lockd_api::v1::cluster_client::ClusterClient::new(channel)
                .status(req)
                .await
                .map(|r| r.into_inner())
                .map_err(|s| format!("{}: {}", s.code(), s.message()))
        };
        let result = tokio::time::timeout(NODE_STATUS_TIMEOUT * 2, result)
            .await
            .unwrap_or_else(|_| Err("no answer".to_owned()));
        (m.id, m.address.clone(), result)
    });
    futures::future::join_all(asks).await
}

/// One line per node, as each node sees itself.
fn print_nodes(nodes: &[NodeStatus]) {
    println!();
    println!(
        "{:<4} {:<22} {:<10} {:>6} {:>8} {:>8} {:>6} {:>8} {:>8}",
        "id", "address", "role", "term", "commit", "applied", "lag", "locks", "waiters"
    );
    for (id, addr, r) in nodes {
        match r {
            Ok(n) => println!(
                "{:<4} {:<22} {:<10} {:>6} {:>8} {:>8} {:>6} {:>8} {:>8}",
                id,
                addr,
                n.role,
                n.term,
                n.commit_index,
                n.applied_index,
                n.lag,
                n.active_locks,
                n.waiters
            ),
            Err(e) => println!("{id:<4} {addr:<22} {e}"),
        }
    }
}

pub fn acquire_options(lease: &crate::cli::LeaseArgs, timeout: Duration) -> AcquireOptions {
    AcquireOptions {
        ttl: lease.ttl,
        wait: lease.wait,
        holder: lease.holder.clone(),
        request_id: None,
        timeout: Some(lease.wait.unwrap_or_default() + timeout),
    }
}

/// One JSON object, or aligned `key  value` lines.
fn print_fields(json: bool, object: serde_json::Value, fields: &[(&str, String)]) {
    if json {
        println!("{object}");
        return;
    }
    let width = fields.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (key, value) in fields {
        println!("{key:<width$}  {value}");
    }
}

pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// RFC 3339 rendering of the server's informative wall-clock expiry, with its distance from now.
fn wall_time(unix_ms: i64) -> String {
    let Ok(ms) = u64::try_from(unix_ms) else {
        return unix_ms.to_string();
    };
    let at = UNIX_EPOCH + Duration::from_millis(ms);
    let when = humantime::format_rfc3339_millis(at);
    match at.duration_since(SystemTime::now()) {
        Ok(ahead) => format!("{when} (in {})", round(ahead)),
        Err(e) => format!("{when} ({} ago)", round(e.duration())),
    }
}

/// Rounds to 0.1 s for display.
fn round(d: Duration) -> humantime::FormattedDuration {
    humantime::format_duration(Duration::from_millis(d.as_millis() as u64 / 100 * 100))
}
