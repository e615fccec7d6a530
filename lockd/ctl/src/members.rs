//! `lockctl member list | add ID=HOST:PORT | promote ID | remove ID` and `lockctl leader transfer
//! [ID]`: the cluster membership (admin operations, answered by the leader).

use std::time::{Duration, Instant};

use lockd_api::v1::MemberInfo;
use lockd_client::Client;
use serde_json::json;

use crate::cli::{LeaderCommand, MemberCommand};
use crate::exit::{self, Failure};

/// How often `member add` looks at the learner's progress while it catches up.
const CATCH_UP_POLL: Duration = Duration::from_millis(500);

pub async fn member(client: &Client, command: MemberCommand, json: bool) -> Result<u8, Failure> {
    match command {
        MemberCommand::List => {
            let list = client.list_members().await?;
            if json {
                println!(
                    "{}",
                    json!({
                        "leader_id": list.leader_id, "term": list.term,
                        "last_log_index": list.last_log_index, "joint": list.joint,
                        "members": list.members.iter().map(member_json).collect::<Vec<_>>(),
                    })
                );
            } else {
                print_members(&list.members);
                if list.joint {
                    println!("(a membership change is in progress)");
                }
            }
            Ok(exit::OK)
        }
        MemberCommand::Add {
            member,
            no_wait,
            catch_up_timeout,
        } => {
            let mut members = client.add_member(member.id, &member.address).await?;
            if !no_wait {
                let started = Instant::now();
                let mut last_note = Instant::now();
                loop {
                    let list = client.list_members().await?;
                    let me = list.members.iter().find(|m| m.id == member.id).cloned();
                    match me {
                        Some(m) if m.caught_up => {
                            members = list.members;
                            break;
                        }
                        Some(m) => {
                            if !json && last_note.elapsed() >= Duration::from_secs(5) {
                                last_note = Instant::now();
                                eprintln!(
                                    "lockctl: node {} catching up: matched {} of {} ({} behind)",
                                    m.id, m.matched_index, list.last_log_index, m.lag
                                );
                            }
                        }
                        None => {
                            return Err(Failure::new(
                                exit::INTERNAL,
                                "not_a_member",
                                format!(
                                    "node {} was added but is no longer a member (removed meanwhile?)",
                                    member.id
                                ),
                            ));
                        }
                    }
                    if started.elapsed() >= catch_up_timeout {
                        return Err(Failure::new(
                            exit::UNAVAILABLE,
                            "catch_up_timeout",
                            format!(
                                "node {} is a learner but did not catch up within {}; it stays \
                                 a learner: check that it runs and reaches the leader, then \
                                 `lockctl member list`",
                                member.id,
                                humantime::format_duration(catch_up_timeout)
                            ),
                        ));
                    }
                    tokio::time::sleep(CATCH_UP_POLL).await;
                }
            }
            print_change(json, "added", member.id, &members);
            Ok(exit::OK)
        }
        MemberCommand::Promote { id } => {
            let members = client.promote_member(id).await?;
            print_change(json, "promoted", id, &members);
            Ok(exit::OK)
        }
        MemberCommand::Remove { id } => {
            let members = client.remove_member(id).await?;
            print_change(json, "removed", id, &members);
            Ok(exit::OK)
        }
    }
}

pub async fn leader(client: &Client, command: LeaderCommand, json: bool) -> Result<u8, Failure> {
    match command {
        LeaderCommand::Transfer { id } => {
            let moved = client.transfer_leader(id).await?;
            if json {
                println!(
                    "{}",
                    json!({ "leader_id": moved.leader_id, "elapsed_ms": moved.elapsed_ms })
                );
            } else {
                println!(
                    "leader is node {} (transfer took {} ms)",
                    moved.leader_id, moved.elapsed_ms
                );
            }
            Ok(exit::OK)
        }
    }
}

fn member_json(m: &MemberInfo) -> serde_json::Value {
    json!({
        "id": m.id, "address": m.address, "role": m.role, "leader": m.leader,
        "matched_index": m.matched_index, "lag": m.lag, "caught_up": m.caught_up,
    })
}

fn print_change(json: bool, what: &str, id: u64, members: &[MemberInfo]) {
    if json {
        println!(
            "{}",
            json!({
                "done": what, "id": id,
                "members": members.iter().map(member_json).collect::<Vec<_>>(),
            })
        );
    } else {
        println!("{what} node {id}");
        print_members(members);
    }
}

fn print_members(members: &[MemberInfo]) {
    println!(
        "{:>4}  {:<32}  {:<7}  {:<6}  {:>10}  {:>8}  {:<9}",
        "id", "address", "role", "leader", "matched", "lag", "caught_up"
    );
    for m in members {
        println!(
            "{:>4}  {:<32}  {:<7}  {:<6}  {:>10}  {:>8}  {:<9}",
            m.id,
            m.address,
            m.role,
            if m.leader { "yes" } else { "" },
            m.matched_index,
            m.lag,
            if m.caught_up { "yes" } else { "no" }
        );
    }
}
