//! Members named by DNS names: `--peer ID=NAME:PORT`, resolved again on every connect, so a member
//! that comes back on another IP under its name (a replaced VM, a rescheduled pod) needs no change
//! in the Raft membership.
//!
//! The cluster is a `lockd_tests::fleet::Fleet`: names resolve through a hosts file of the run,
//! read by `nss_wrapper`, so nothing on the machine changes; each node listens on a loopback IP of
//! its own and writes its output to a file of the run, which a failed check prints.

use std::time::Duration;

use lockd_api::v1::StatusResponse;
use lockd_tests::fleet::Fleet;

const ARGS: &[&str] = &["--heartbeat", "100ms", "--election-timeout", "600ms"];

/// Node `id`'s status, asked again until it answers (a loaded machine may miss one deadline).
async fn status(f: &Fleet, id: u64) -> StatusResponse {
    lockd_tests::poll::until_async(
        &format!("node {id} answers Status"),
        Duration::from_secs(30),
        || async { f.status(id).await.map_err(|e| format!("{e:#}")) },
    )
    .await
}

/// A fresh resource under `names/<what>` through node `via` only (see `Fleet::acquire_fresh`);
/// a failure prints what that node said.
async fn acquire(f: &Fleet, via: u64, what: &str) -> u64 {
    f.acquire_fresh(&[via], &format!("names/{what}"), Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| panic!("{e:#}\nnode {via} said:\n{}", f.log(via)))
}

/// Goal: a member killed and started again on another IP under the same DNS name rejoins, the
/// leader replicates to it at its new address, and it takes part in a quorum there, with no change
/// to the membership (which keeps the names).
/// Method: three `lockd` processes with `--peer` given as names. A follower is killed, its name
/// moved to a new IP in the hosts file, and it is restarted there on its data dir; after new
/// grants it must reach the leader's commit index, and then, with the old leader killed, it and
/// the third node must elect a leader and grant again. Status lists the members by name
/// throughout; tokens grow at every step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_back_on_another_ip_under_its_name_keeps_replicating() {
    let mut f = Fleet::start_with(3, ARGS, false).await.unwrap();
    let leader = f.wait_for_leader(Duration::from_secs(30)).await.unwrap();
    let members = status(&f, leader).await.members;
    let addresses: Vec<&str> = members.iter().map(|m| m.address.as_str()).collect();
    for id in 1..=3 {
        assert!(
            addresses.contains(&f.member_addr(id).as_str()),
            "the membership keeps the names as written: {addresses:?}"
        );
    }
    let mut last_token = 0;
    for i in 0..5 {
        let token = acquire(&f, leader, &format!("before-{i}")).await;
        assert!(
            token > last_token,
            "tokens grow: {token} after {last_token}"
        );
        last_token = token;
    }

    // A follower moves: killed, its name pointed at a new IP, started there on its data dir.
    let moved = (1..=3).find(|i| *i != leader).unwrap();
    let third = (1..=3).find(|i| *i != leader && *i != moved).unwrap();
    f.kill(moved);
    let old_addr = f.ip_addr(moved);
    f.move_to_new_ip(moved).unwrap();
    f.restart(moved).unwrap();
    assert_ne!(old_addr, f.ip_addr(moved));

    for i in 0..5 {
        let token = acquire(&f, leader, &format!("after-{i}")).await;
        assert!(
            token > last_token,
            "tokens grow: {token} after {last_token}"
        );
        last_token = token;
    }
    // Only the leader sends entries: the moved node reaching the commit index means the leader
    // dialled the name and found the new IP.
    let commit = status(&f, leader).await.commit_index;
    lockd_tests::poll::until_async(
        "the moved node applies the leader's commits",
        Duration::from_secs(30),
        || async {
            match f.status(moved).await {
                Ok(s) if s.applied_index >= commit => Ok(()),
                Ok(s) => Err(format!("applied {} of {commit}", s.applied_index)),
                Err(e) => Err(format!("{e:#}")),
            }
        },
    )
    .await;

    // The first leader goes: the moved node and the third one are the only quorum left.
    f.kill(leader);
    let new_leader = f.wait_for_leader(Duration::from_secs(30)).await.unwrap();
    assert!([moved, third].contains(&new_leader), "leader {new_leader}");
    let token = acquire(&f, moved, "two-left").await;
    assert!(
        token > last_token,
        "tokens grow: {token} after {last_token}"
    );
    let members = status(&f, moved).await.members;
    assert!(
        members
            .iter()
            .any(|m| m.id == moved && m.address == f.member_addr(moved)),
        "the moved member is still listed by its name: {members:?}"
    );
}
