//! TLS and client access of fence-proxy: the Postgres front end terminating TLS for
//! psql and connecting to an upstream that requires it, `--require-tls`, `--allow-client`, and
//! the HTTP front end over HTTPS towards an https upstream, and certificate reload on SIGHUP
//! (both front ends, listener and upstream side, bad files, no TLS at all).
//!
//! Method: throwaway CAs and certificates (rcgen, `lockd_tests::tls::TestCa`); real psql, real
//! curl, the machine's Postgres, and private Postgres clusters started from the installed server
//! binaries for the upstreams that require TLS. Each test says which attack it refutes.
//!
//! # Layout
//! - `postgres`: the Postgres front end: TLS for psql, `--require-tls`, `--allow-client`, upstreams
//!   that require TLS.
//! - `http`: the HTTP front end over HTTPS, and its epoch store over TLS.
//! - `reload`: certificates, keys and upstream roots reloaded on SIGHUP.

#![allow(
    clippy::unwrap_used,
    reason = "test code: a failed unwrap is a failed test, with its message"
)]

mod http;
mod postgres;
mod reload;

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use fence_proxy_postgres::AccessArgs;
use lockd_tests::pg::{self, PG_DATABASE, PG_USER, direct_url};
use lockd_tests::tls::{Issued, TestCa};

const LOOPBACK: IpAddr = IpAddr::V4(Ipv4Addr::LOCALHOST);

/// Runs psql with a libpq connection string and one command; `env` adds PGOPTIONS and the like.
fn psql(conninfo: &str, sql: &str, env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new("psql");
    cmd.args([
        "-X",
        "--no-psqlrc",
        "-At",
        "-v",
        "ON_ERROR_STOP=1",
        "-v",
        "VERBOSITY=verbose",
    ])
    .arg("-d")
    .arg(conninfo)
    .arg("-c")
    .arg(sql)
    .env_remove("PGSSLMODE")
    .env("PGCONNECT_TIMEOUT", "10")
    .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("running psql (postgresql-client)")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).trim().to_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).trim().to_owned()
}

fn assert_ok(o: &Output, what: &str) -> String {
    assert!(
        o.status.success(),
        "{what} failed: {}\n{}",
        stderr(o),
        stdout(o)
    );
    stdout(o)
}

fn assert_fails_with(o: &Output, needle: &str, what: &str) {
    assert!(!o.status.success(), "{what} succeeded: {}", stdout(o));
    assert!(
        stderr(o).contains(needle),
        "{what}: expected {needle:?} in: {}",
        stderr(o)
    );
}

/// A libpq connection string for the proxy at `addr`, as the shared database's user.
fn via(addr: SocketAddr, ssl: &str) -> String {
    format!(
        "host={} port={} user={PG_USER} dbname={PG_DATABASE} {ssl}",
        addr.ip(),
        addr.port()
    )
}

/// A proxy certificate naming `localhost` and 127.0.0.1, from a fresh CA.
fn proxy_ca(dir: &Path) -> (TestCa, Issued) {
    let ca = TestCa::new(dir, "pxtls").unwrap();
    let cert = ca
        .issue("proxy", &["localhost".to_owned()], &[LOOPBACK])
        .unwrap();
    (ca, cert)
}

fn tls_access(cert: &Issued) -> AccessArgs {
    AccessArgs {
        tls_cert: Some(cert.cert.clone()),
        tls_key: Some(cert.key.clone()),
        ..AccessArgs::default()
    }
}

/// The highest token the shared database's fence table holds for `resource`.
fn recorded_token(resource: &str) -> String {
    let o = psql(
        &direct_url(),
        &format!(
            "SELECT token FROM {} WHERE resource = '{resource}'",
            pg::fence_table()
        ),
        &[],
    );
    assert_ok(&o, "reading the fence table")
}

/// The `/usr/lib/postgresql/*/bin` holding initdb and postgres, or `None` (the test is skipped).
fn server_binaries() -> Option<PathBuf> {
    std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin"))
        .find(|p| p.join("initdb").exists() && p.join("postgres").exists())
}

/// curl with `--cacert` and extra arguments; returns (exit status, HTTP code or body).
fn curl(args: &[&str]) -> Output {
    Command::new("curl")
        .args(["-sS", "--max-time", "10"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("running curl")
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::new(LOOPBACK, port)
}
