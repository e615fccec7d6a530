//! Harness for the Postgres front end of fence-proxy: the shared local Postgres, a proxy running
//! in-process on a free port, psql, and a private password-protected Postgres cluster for the
//! authentication pass-through tests.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;

use crate::process::ChildGuard;

/// The Postgres every suite runs against: trust authentication for 127.0.0.1.
pub const PG_HOST: &str = "127.0.0.1";
pub const PG_PORT: u16 = 5432;
pub const PG_USER: &str = "postgres";
pub const PG_DATABASE: &str = "test";

/// How long a started server (proxy or private cluster) may take to accept connections.
const STARTUP_WAIT: Duration = Duration::from_secs(30);

/// URL of the shared Postgres, directly.
pub fn direct_url() -> String {
    format!("postgres://{PG_USER}@{PG_HOST}:{PG_PORT}/{PG_DATABASE}")
}

/// Whether the shared Postgres accepts connections; `Err` names its address and how to start it.
fn reachable() -> Result<(), String> {
    let addr: SocketAddr = format!("{PG_HOST}:{PG_PORT}").parse().unwrap();
    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
        Ok(_) => Ok(()),
        Err(e) => Err(format!(
            "Postgres is not reachable at {addr} ({e}); start it with \
             `pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start` \
             (user {PG_USER}, trust auth, database {PG_DATABASE}: `createdb -h 127.0.0.1 -U postgres test`)"
        )),
    }
}

/// Panics with instructions when the shared Postgres is not reachable. Harness code calls it
/// before its first connection; a test checks [`available`] first (through
/// [`crate::skip_without_postgres`]), so this fires only for a test that forgot to.
pub fn require_postgres() {
    if let Err(why) = reachable() {
        panic!("{why}");
    }
}

/// Whether a test that needs the shared Postgres can run here. When Postgres is unreachable,
/// under CI (env `CI` set) this panics with how to start it: CI must run the Postgres suites,
/// not skip them. Elsewhere it reports the test as skipped, naming how to start Postgres
/// ([`crate::skip::report`]), and returns false.
pub fn available() -> bool {
    match reachable() {
        Ok(()) => true,
        Err(why) if std::env::var_os("CI").is_some() => {
            panic!("{why}. CI is set, so the tests that need Postgres fail instead of skipping")
        }
        Err(why) => {
            crate::skip::report(&why);
            false
        }
    }
}

/// A name unique to this test run, usable as a table name or fence resource.
pub fn unique_name(prefix: &str) -> String {
    use rand::RngExt;
    let n: u64 = rand::rng().random();
    format!("{prefix}_{n:016x}")
}

/// Ports [`free_port`] draws from: below Linux's ephemeral range (32768-60999 by default), from
/// which every `bind(0)` of the tests (upstreams, clients) takes its port. A port handed out by
/// `bind(0)` and released was taken by another test's `bind(0)` before the server bound it (a
/// fence-proxy that could not listen while the test talked to someone else's HTTP server).
const DRAWN_PORTS: std::ops::Range<u16> = 20_000..32_768;

/// A free TCP port on 127.0.0.1 for a server to bind: drawn at random outside the ephemeral
/// range and checked free by binding it (then released for the server to take).
pub fn free_port() -> u16 {
    use rand::RngExt;
    let mut rng = rand::rng();
    for _ in 0..100 {
        let port = rng.random_range(DRAWN_PORTS);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding an ephemeral port")
        .port()
}

/// Waits until the server on `port` takes sessions. An open port is not enough: Postgres
/// listens before recovery ends and answers "the database system is starting up" (57P03)
/// until then, so this asks `pg_isready`, which reports a server that is up even when
/// pg_hba.conf would refuse its probe.
fn wait_ready(pg_isready: &Path, port: u16) -> Result<(), String> {
    let deadline = Instant::now() + STARTUP_WAIT;
    loop {
        let out = Command::new(pg_isready)
            .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-t", "1"])
            .output()
            .map_err(|e| format!("running {}: {e}", pg_isready.display()))?;
        if out.status.success() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!(
                "private postgres on port {port} not ready within {STARTUP_WAIT:?}: {}",
                String::from_utf8_lossy(&out.stdout).trim()
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The Postgres front end of fence-proxy running in-process on its own runtime thread, stopped
/// (shutdown token, then join) on drop.
pub struct PgProxy {
    pub addr: SocketAddr,
    shutdown: CancellationToken,
    thread: Option<std::thread::JoinHandle<anyhow::Result<()>>>,
}

impl PgProxy {
    /// Starts a proxy in front of the shared Postgres.
    pub fn start(require_fence: bool) -> PgProxy {
        Self::start_with(direct_url(), require_fence)
    }

    /// Starts a proxy in front of `upstream`, after installing the guard there.
    pub fn start_with(upstream: String, require_fence: bool) -> PgProxy {
        Self::start_with_access(upstream, require_fence, Default::default())
            .unwrap_or_else(|e| panic!("fence-proxy postgres: {e:#}"))
    }

    /// [`PgProxy::start_with`] with TLS and allow-list flags; an error if the proxy does not
    /// start (for example when it cannot reach the upstream as `sslmode` asks).
    pub fn start_with_access(
        upstream: String,
        require_fence: bool,
        access: fence_proxy_postgres::AccessArgs,
    ) -> anyhow::Result<PgProxy> {
        let fence_table = fence_table();
        if upstream != direct_url() {
            try_init_guard(&upstream, &fence_table)?;
        }
        let mut args = proxy_args(upstream, fence_table, require_fence);
        args.access = access;
        Self::try_start_args(args)
    }

    /// Starts a proxy with these arguments (see [`proxy_args`]) and waits until it accepts.
    pub fn start_args(args: fence_proxy_postgres::Args) -> PgProxy {
        Self::try_start_args(args).unwrap_or_else(|e| panic!("fence-proxy postgres: {e:#}"))
    }

    /// [`PgProxy::start_args`], returning a start-up error.
    pub fn try_start_args(args: fence_proxy_postgres::Args) -> anyhow::Result<PgProxy> {
        let addr = args.listen;
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let thread = std::thread::spawn(move || {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?
                .block_on(fence_proxy_postgres::run(args, token))
        });
        // Accepting, or the run ended (a start-up error, returned here).
        let deadline = Instant::now() + STARTUP_WAIT;
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            if thread.is_finished() {
                return match thread.join() {
                    Ok(Ok(())) => Err(anyhow::anyhow!("fence-proxy postgres ended at once")),
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(anyhow::anyhow!("fence-proxy postgres panicked")),
                };
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "fence-proxy postgres did not accept on {addr} within {STARTUP_WAIT:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(PgProxy {
            addr,
            shutdown,
            thread: Some(thread),
        })
    }

    /// URL of the shared database through this proxy.
    pub fn url(&self) -> String {
        self.url_as(PG_USER, PG_DATABASE)
    }

    pub fn url_as(&self, user: &str, database: &str) -> String {
        format!(
            "postgres://{user}@{}:{}/{database}",
            self.addr.ip(),
            self.addr.port()
        )
    }

    /// A tokio-postgres configuration for this proxy, optionally with a startup fence.
    pub fn config(&self, fence: Option<&str>) -> tokio_postgres::Config {
        let mut c: tokio_postgres::Config = self.url().parse().unwrap();
        if let Some(f) = fence {
            c.options(format!("-c lockd.fence={f}"));
        }
        c
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.shutdown.cancel();
        if let Some(t) = self.thread.take() {
            match t.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => eprintln!("fence-proxy postgres exited with an error: {e}"),
                Err(_) => eprintln!("fence-proxy postgres thread panicked"),
            }
        }
    }
}

/// Arguments of a proxy on a free loopback port in front of `upstream`, without verify keys.
pub fn proxy_args(
    upstream: String,
    fence_table: String,
    require_fence: bool,
) -> fence_proxy_postgres::Args {
    fence_proxy_postgres::Args {
        listen: format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        upstream,
        require_fence,
        max_sessions: 64,
        max_startups_per_client: fence_proxy_postgres::limits::DEFAULT_MAX_STARTUPS_PER_CLIENT,
        max_message_bytes: fence_proxy_postgres::limits::DEFAULT_MAX_MESSAGE_BYTES,
        // Two session threads whatever the machine, so sessions of one test share and split them.
        threads: 2,
        connect_timeout: Duration::from_secs(5),
        startup_timeout: Duration::from_secs(10),
        fence_table,
        access: Default::default(),
        verify_key: Vec::new(),
        allow_unsigned: false,
        allow_database: Vec::new(),
    }
}

/// SQL statements run with psql against the shared database when dropped, each on its own (a
/// failed one does not stop the rest), so a test's roles, schemas and databases go also when it
/// panics half-way.
pub struct SqlOnDrop(pub Vec<String>);

impl Drop for SqlOnDrop {
    fn drop(&mut self) {
        for sql in &self.0 {
            let _ = Command::new("psql")
                .args([
                    "-X",
                    "-q",
                    "-h",
                    PG_HOST,
                    "-U",
                    PG_USER,
                    "-d",
                    PG_DATABASE,
                    "-c",
                ])
                .arg(sql)
                .status();
        }
    }
}

/// Connects with tokio-postgres and drives the connection on the current runtime.
pub async fn connect(config: &tokio_postgres::Config) -> tokio_postgres::Client {
    let (client, connection) = config
        .connect(tokio_postgres::NoTls)
        .await
        .unwrap_or_else(|e| panic!("connecting with {config:?}: {e:?}"));
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

/// Runs `psql` on `url` with `script` as its input file; `env` adds variables such as PGOPTIONS.
pub fn psql(url: &str, script: &Path, vars: &[(&str, &str)], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new("psql");
    cmd.arg("-X")
        .arg("--no-psqlrc")
        .arg("-v")
        .arg("ON_ERROR_STOP=0")
        .arg("-d")
        .arg(url)
        .arg("-f")
        .arg(script);
    for (k, v) in vars {
        cmd.arg("-v").arg(format!("{k}={v}"));
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.stdin(Stdio::null())
        .output()
        .expect("running psql (is the postgresql-client package installed?)")
}

/// A throwaway Postgres cluster with password authentication (scram-sha-256 and md5 roles),
/// started from the installed server binaries, so authentication pass-through can be tested
/// without touching the shared server's pg_hba.conf. Killed and removed on drop.
pub struct PrivateCluster {
    pub port: u16,
    _server: ChildGuard,
    dir: PathBuf,
    /// The server's command line, kept to start it again on the same data dir and port.
    server_cmd: ServerCommand,
}

/// What starts a private cluster's server: binaries, data dir, ids and settings.
struct ServerCommand {
    bin: PathBuf,
    data: PathBuf,
    socket_dir: PathBuf,
    port: u16,
    ids: Option<(u32, u32)>,
    settings: Vec<String>,
}

impl ServerCommand {
    fn spawn(&self) -> Result<ChildGuard, String> {
        use std::os::unix::process::CommandExt;
        let mut cmd = Command::new(self.bin.join("postgres"));
        if let Some((uid, gid)) = self.ids {
            cmd.uid(uid).gid(gid);
        }
        cmd.arg("-D")
            .arg(&self.data)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-c")
            .arg("listen_addresses=127.0.0.1")
            .arg("-c")
            .arg(format!(
                "unix_socket_directories={}",
                self.socket_dir.display()
            ))
            .arg("-c")
            .arg("fsync=off");
        for setting in &self.settings {
            cmd.arg("-c").arg(setting);
        }
        let server = ChildGuard::spawn("private postgres", cmd).map_err(|e| e.to_string())?;
        wait_ready(&self.bin.join("pg_isready"), self.port)?;
        Ok(server)
    }
}

fn is_root() -> bool {
    id_of_self() == Some(0)
}

fn id_of_self() -> Option<u32> {
    let out = Command::new("id").arg("-u").output().ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// `id <flag> postgres`: the uid or gid of the `postgres` OS user.
fn id_of(flag: &str) -> Option<u32> {
    let out = Command::new("id").arg(flag).arg("postgres").output().ok()?;
    if !out.status.success() {
        return None;
    }
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Password of the roles the private cluster creates.
pub const PRIVATE_PASSWORD: &str = "s3cret-fence";

impl PrivateCluster {
    /// Fails with the reason when the server binaries or the `postgres` OS user are
    /// missing.
    pub fn start() -> Result<PrivateCluster, String> {
        Self::start_inner(None, &[])
    }

    /// A private cluster with these extra server settings (`name=value`).
    pub fn start_with(settings: &[&str]) -> Result<PrivateCluster, String> {
        Self::start_inner(None, settings)
    }

    /// A session as `postgres` straight to the cluster, retried for up to five seconds while
    /// the server finishes starting.
    pub async fn admin(&self) -> tokio_postgres::Client {
        let config: tokio_postgres::Config = self.url("postgres").parse().unwrap();
        let mut attempts = 0;
        loop {
            match config.connect(tokio_postgres::NoTls).await {
                Ok((client, connection)) => {
                    tokio::spawn(connection);
                    return client;
                }
                Err(e) if attempts < 50 => {
                    attempts += 1;
                    eprintln!("private cluster not ready yet: {e:?}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("private cluster never accepted a session: {e:?}"),
            }
        }
    }

    /// A private cluster whose server writes its log (at the default `log_min_messages`,
    /// warnings included) to a file, read with [`PrivateCluster::server_log`].
    pub fn start_logging() -> Result<PrivateCluster, String> {
        Self::start_inner(
            None,
            &[
                "logging_collector=on",
                "log_directory=log",
                "log_filename=server.log",
            ],
        )
    }

    /// What the server has logged so far ([`PrivateCluster::start_logging`] only; empty
    /// otherwise). The logging collector writes shortly after the event.
    pub fn server_log(&self) -> String {
        std::fs::read_to_string(self.dir.join("data").join("log").join("server.log"))
            .unwrap_or_default()
    }

    /// A private cluster that accepts only TLS (`ssl=on`, `hostssl` lines only) with this
    /// certificate and key.
    pub fn start_ssl(cert: &Path, key: &Path) -> Result<PrivateCluster, String> {
        Self::start_inner(Some((cert, key)), &[])
    }

    fn start_inner(
        ssl: Option<(&Path, &Path)>,
        settings: &[&str],
    ) -> Result<PrivateCluster, String> {
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .map_err(|e| format!("no /usr/lib/postgresql: {e}"))?
            .filter_map(|e| e.ok())
            .map(|e| e.path().join("bin"))
            .find(|p| p.join("initdb").exists())
            .ok_or("no initdb under /usr/lib/postgresql/*/bin")?;
        let dir = std::env::temp_dir().join(unique_name("lockd_pg_cluster"));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        // As root, the server runs as the `postgres` OS user (initdb refuses root); setting the
        // ids directly, instead of through runuser, keeps the server our own child to kill.
        let ids = if is_root() {
            let uid = id_of("-u").ok_or("no `postgres` OS user")?;
            let gid = id_of("-g").ok_or("no `postgres` OS group")?;
            let status = Command::new("chown")
                .arg("postgres")
                .arg(&dir)
                .status()
                .map_err(|e| e.to_string())?;
            if !status.success() {
                return Err(format!("chown postgres {}: {status}", dir.display()));
            }
            Some((uid, gid))
        } else {
            None
        };
        let run_as_postgres = |program: &Path| {
            use std::os::unix::process::CommandExt;
            let mut c = Command::new(program);
            if let Some((uid, gid)) = ids {
                c.uid(uid).gid(gid);
            }
            c.stdin(Stdio::null());
            c
        };
        let pwfile = dir.join("pw");
        std::fs::write(&pwfile, PRIVATE_PASSWORD).map_err(|e| e.to_string())?;
        let data = dir.join("data");
        let out = run_as_postgres(&bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .arg("-U")
            .arg("postgres")
            .arg("--auth=scram-sha-256")
            .arg(format!("--pwfile={}", pwfile.display()))
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(format!(
                "initdb failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        // md5 entries first for the md5 role, scram for everyone else; with TLS, hostssl
        // lines only, so a plain-text connection matches none and is refused.
        let host = if ssl.is_some() { "hostssl" } else { "host" };
        std::fs::write(
            data.join("pg_hba.conf"),
            format!(
                "{host} all md5_user 127.0.0.1/32 md5\n{host} all all 127.0.0.1/32 scram-sha-256\n"
            ),
        )
        .map_err(|e| e.to_string())?;
        let mut server_settings = Vec::new();
        if let Some((cert, key)) = ssl {
            // Postgres wants its key owned by the server's user and unreadable by others.
            let (cert_copy, key_copy) = (data.join("server.crt"), data.join("server.key"));
            std::fs::copy(cert, &cert_copy).map_err(|e| e.to_string())?;
            std::fs::copy(key, &key_copy).map_err(|e| e.to_string())?;
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&key_copy, std::fs::Permissions::from_mode(0o600))
                .map_err(|e| e.to_string())?;
            if let Some((uid, gid)) = ids {
                for f in [&cert_copy, &key_copy] {
                    std::os::unix::fs::chown(f, Some(uid), Some(gid)).map_err(|e| e.to_string())?;
                }
            }
            server_settings = vec![
                "ssl=on".to_owned(),
                format!("ssl_cert_file={}", cert_copy.display()),
                format!("ssl_key_file={}", key_copy.display()),
            ];
        }
        server_settings.extend(settings.iter().map(|s| (*s).to_owned()));
        let server_cmd = ServerCommand {
            bin,
            data,
            socket_dir: dir.clone(),
            port: free_port(),
            ids,
            settings: server_settings,
        };
        let server = server_cmd.spawn()?;
        Ok(PrivateCluster {
            port: server_cmd.port,
            _server: server,
            dir,
            server_cmd,
        })
    }

    /// Crashes the server (SIGQUIT: immediate shutdown, no checkpoint, every session cut) and
    /// starts it again on the same data dir and port; returns once it takes sessions (after
    /// crash recovery).
    pub fn crash_restart(&mut self) -> Result<(), String> {
        self._server.signal(nix::sys::signal::Signal::SIGQUIT);
        let deadline = Instant::now() + STARTUP_WAIT;
        while self._server.is_running() {
            if Instant::now() > deadline {
                return Err(format!(
                    "private postgres on port {} did not stop on SIGQUIT",
                    self.port
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self._server = self.server_cmd.spawn()?;
        Ok(())
    }

    /// URL of the cluster's `postgres` database for `user`, with the password.
    pub fn url(&self, user: &str) -> String {
        format!(
            "postgres://{user}:{PRIVATE_PASSWORD}@127.0.0.1:{}/postgres",
            self.port
        )
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        // The server is killed by its guard first only if fields drop in order; kill explicitly.
        self._server.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What one request (a simple Query, or an extended-protocol group up to Sync) got back on a
/// [`RawConn`].
#[derive(Debug, Default)]
pub struct RawReply {
    /// `(SQLSTATE, message)` of every ErrorResponse, in order.
    pub errors: Vec<(String, String)>,
    /// SQLSTATEs of every NoticeResponse.
    pub notices: Vec<String>,
    /// Type bytes of every message before ReadyForQuery, in order.
    pub tags: Vec<u8>,
    /// The command tag of every CommandComplete (`BEGIN`, `INSERT 0 1`), in order.
    pub completions: Vec<String>,
    /// The transaction status of the final ReadyForQuery.
    pub status: u8,
    /// BackendKeyData (process ID, secret key), sent once after authentication.
    pub backend_key: Option<(i32, i32)>,
}

impl RawReply {
    /// The SQLSTATE of the first error, or "" when there was none.
    pub fn first_error(&self) -> &str {
        self.errors.first().map(|e| e.0.as_str()).unwrap_or("")
    }
}

/// A bare protocol-3 client over TCP (trust authentication only), so tests can send exactly the
/// message sequences an attacker would: Parse/Bind/Execute without Sync, pipelined groups, names
/// of any size, queries no driver would build.
pub struct RawConn {
    stream: tokio::net::TcpStream,
    buf: bytes::BytesMut,
    /// The key a CancelRequest for this session carries (see [`cancel`]).
    pub backend_key: Option<(i32, i32)>,
}

impl RawConn {
    /// Connects as `user` to `database` at `addr` with startup `options` (e.g. `-c lockd.fence=r:41`).
    pub async fn connect(addr: SocketAddr, user: &str, options: Option<&str>) -> RawConn {
        let mut params = vec![("user", user), ("database", PG_DATABASE)];
        if let Some(o) = options {
            params.push(("options", o));
        }
        let (conn, reply) = RawConn::start(addr, &params).await;
        assert!(
            reply.errors.is_empty(),
            "startup as {user} with {options:?} failed: {:?}",
            reply.errors
        );
        conn
    }

    /// Sends a startup message with exactly these parameters, in this order, and reads up to
    /// the first ReadyForQuery (or the end of the connection, status `X`, after a FATAL).
    pub async fn start(addr: SocketAddr, params: &[(&str, &str)]) -> (RawConn, RawReply) {
        let stream = tokio::net::TcpStream::connect(addr)
            .await
            .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
        RawConn::start_on(stream, params).await
    }

    /// [`RawConn::start`] on a connected stream (one with socket options of the test's own).
    pub async fn start_on(
        stream: tokio::net::TcpStream,
        params: &[(&str, &str)],
    ) -> (RawConn, RawReply) {
        use tokio::io::AsyncWriteExt;
        let mut conn = RawConn {
            stream,
            buf: bytes::BytesMut::new(),
            backend_key: None,
        };
        let mut out = bytes::BytesMut::new();
        postgres_protocol::message::frontend::startup_message(params.iter().copied(), &mut out)
            .unwrap();
        conn.stream.write_all(&out).await.unwrap();
        let reply = conn.read_until_ready().await;
        conn.backend_key = reply.backend_key;
        (conn, reply)
    }

    /// Sends raw bytes (one or more encoded frontend messages).
    pub async fn send(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        self.stream.write_all(bytes).await.unwrap();
    }

    /// Sends a simple Query and reads up to its ReadyForQuery.
    pub async fn query(&mut self, sql: &str) -> RawReply {
        let mut out = bytes::BytesMut::new();
        postgres_protocol::message::frontend::query(sql, &mut out).unwrap();
        self.send(&out).await;
        self.read_until_ready().await
    }

    /// Reads backend messages until ReadyForQuery (or the connection ends).
    /// Sends `bytes` and reads the answer up to ReadyForQuery.
    pub async fn exchange(&mut self, bytes: &[u8]) -> RawReply {
        self.send(bytes).await;
        self.read_until_ready().await
    }

    pub async fn read_until_ready(&mut self) -> RawReply {
        use tokio::io::AsyncReadExt;
        let mut reply = RawReply::default();
        loop {
            while self.buf.len() >= 5 {
                let len = i32::from_be_bytes([self.buf[1], self.buf[2], self.buf[3], self.buf[4]])
                    as usize;
                if self.buf.len() < len + 1 {
                    break;
                }
                let frame = self.buf.split_to(len + 1);
                let tag = frame[0];
                let body = &frame[5..];
                match tag {
                    b'Z' => {
                        reply.status = body[0];
                        return reply;
                    }
                    b'E' => reply.errors.push((field(body, b'C'), field(body, b'M'))),
                    b'N' => reply.notices.push(field(body, b'C')),
                    b'K' if body.len() >= 8 => {
                        reply.backend_key = Some((
                            i32::from_be_bytes([body[0], body[1], body[2], body[3]]),
                            i32::from_be_bytes([body[4], body[5], body[6], body[7]]),
                        ));
                    }
                    b'C' => {
                        let end = body.iter().position(|&b| b == 0).unwrap_or(body.len());
                        reply
                            .completions
                            .push(String::from_utf8_lossy(&body[..end]).into_owned());
                    }
                    _ => {}
                }
                reply.tags.push(tag);
            }
            let n =
                tokio::time::timeout(Duration::from_secs(30), self.stream.read_buf(&mut self.buf))
                    .await
                    .expect("no ReadyForQuery within 30 s")
                    .unwrap();
            if n == 0 {
                reply.status = b'X';
                return reply;
            }
        }
    }
}

/// Sends a CancelRequest for the session with `key` to `addr` (a client sends it on a connection
/// of its own) and returns once it is written and the other end has closed.
pub async fn cancel(addr: SocketAddr, key: (i32, i32)) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = bytes::BytesMut::new();
    postgres_protocol::message::frontend::cancel_request(key.0, key.1, &mut out);
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    stream.write_all(&out).await.unwrap();
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), stream.read_to_end(&mut rest)).await;
}

fn field(body: &[u8], wanted: u8) -> String {
    let mut rest = body;
    while let Some((&f, tail)) = rest.split_first() {
        if f == 0 {
            break;
        }
        let end = tail.iter().position(|&b| b == 0).unwrap_or(tail.len());
        if f == wanted {
            return String::from_utf8_lossy(&tail[..end]).into_owned();
        }
        rest = &tail[(end + 1).min(tail.len())..];
    }
    String::new()
}

/// Encoders for extended-protocol messages with no parameters, for [`RawConn::send`].
/// One attack's world for the raw-wire tests of the Postgres front end: a proxy, a table of
/// rows that carry the writer's token, and a resource whose holder recorded token 42 and wrote
/// one row. The oracle is the table: an attacker row is one whose token is not 42.
pub struct Attack {
    pub proxy: PgProxy,
    pub direct: tokio_postgres::Client,
    pub resource: String,
    pub tbl: String,
}

impl Attack {
    /// `prefix` names the resource and the table (unique per call).
    pub async fn new(require_fence: bool, prefix: &str) -> Attack {
        require_postgres();
        let proxy = PgProxy::start(require_fence);
        let direct = connect(&direct_url().parse().unwrap()).await;
        let resource = unique_name(prefix);
        let tbl = unique_name(prefix);
        direct
            .batch_execute(&format!(
                "CREATE TABLE {tbl} (id bigserial PRIMARY KEY, token bigint NOT NULL)"
            ))
            .await
            .unwrap();
        let holder = connect(&proxy.config(Some(&format!("{resource}:42")))).await;
        holder
            .execute(&format!("INSERT INTO {tbl} (token) VALUES (42)"), &[])
            .await
            .expect("the holder of 42 writes");
        Attack {
            proxy,
            direct,
            resource,
            tbl,
        }
    }

    /// A raw session fenced with `<resource>:<token>` at startup, or unfenced with `None`.
    pub async fn attacker(&self, token: Option<u64>) -> RawConn {
        let options = token.map(|t| format!("-c lockd.fence={}:{t}", self.resource));
        RawConn::connect(self.proxy.addr, PG_USER, options.as_deref()).await
    }

    /// A raw session with startup `options` `-c lockd.fence=<fence>` verbatim, or none.
    pub async fn session(&self, fence: Option<&str>) -> RawConn {
        let options = fence.map(|f| format!("-c lockd.fence={f}"));
        RawConn::connect(self.proxy.addr, PG_USER, options.as_deref()).await
    }

    /// A raw session with these startup `options` verbatim.
    pub async fn session_with(&self, options: &str) -> RawConn {
        RawConn::connect(self.proxy.addr, PG_USER, Some(options)).await
    }

    /// An INSERT carrying `token`.
    pub fn insert(&self, token: i64) -> String {
        format!("INSERT INTO {} (token) VALUES ({token})", self.tbl)
    }

    /// Rows committed with `token`.
    pub async fn rows_with_token(&self, token: i64) -> i64 {
        self.direct
            .query_one(
                &format!("SELECT count(*) FROM {} WHERE token = $1", self.tbl),
                &[&token],
            )
            .await
            .unwrap()
            .get(0)
    }

    /// Rows committed with a token other than 42 (the attacker's).
    pub async fn attacker_rows(&self) -> i64 {
        self.direct
            .query_one(
                &format!("SELECT count(*) FROM {} WHERE token <> 42", self.tbl),
                &[],
            )
            .await
            .unwrap()
            .get(0)
    }

    pub async fn assert_nothing_committed(&self, what: &str) {
        assert_eq!(
            self.attacker_rows().await,
            0,
            "{what}: a row of the attacker committed"
        );
    }

    /// Records `what` in `broken` when an attacker row committed, so that every variant of a
    /// test runs before the test fails.
    pub async fn check(&self, what: &str, broken: &mut Vec<String>) {
        let n = self.attacker_rows().await;
        if n != 0 {
            broken.push(format!("{what}: {n} row(s) of the attacker committed"));
        }
    }
}

pub mod wire {
    use bytes::BytesMut;
    use postgres_protocol::message::frontend;

    pub fn parse(name: &str, sql: &str, out: &mut BytesMut) {
        frontend::parse(name, sql, std::iter::empty(), out).unwrap();
    }

    pub fn bind(portal: &str, statement: &str, out: &mut BytesMut) {
        frontend::bind(
            portal,
            statement,
            std::iter::empty(),
            std::iter::empty::<()>(),
            |(), _| Ok(postgres_protocol::IsNull::No),
            std::iter::empty(),
            out,
        )
        .map_err(|_| "bind")
        .unwrap();
    }

    pub fn execute(portal: &str, out: &mut BytesMut) {
        frontend::execute(portal, 0, out).unwrap();
    }

    pub fn sync(out: &mut BytesMut) {
        frontend::sync(out);
    }

    /// A frame of type `tag` with this body, the length computed: for frames no encoder
    /// would build (bytes after the last field, raw non-UTF-8 names).
    pub fn frame(tag: u8, body: &[u8]) -> BytesMut {
        use bytes::BufMut;
        let mut out = BytesMut::with_capacity(body.len() + 5);
        out.put_u8(tag);
        out.put_i32(i32::try_from(body.len() + 4).unwrap_or(i32::MAX));
        out.put_slice(body);
        out
    }

    /// Parse, Bind and Execute of `sql` in the unnamed statement and portal.
    pub fn run(sql: &str, out: &mut BytesMut) {
        parse("", sql, out);
        bind("", "", out);
        execute("", out);
    }
}

/// The fence table of this test process: a schema of its own, so test binaries running in
/// parallel (and anyone else on the shared Postgres) never share fence rows. Installed with
/// `fence-proxy postgres init`'s library function the first time it is asked for.
pub fn fence_table() -> String {
    static TABLE: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TABLE
        .get_or_init(|| {
            let table = format!("{}.lockd_fence", unique_name("lockd_fence_test"));
            init_guard(&direct_url(), &table);
            table
        })
        .clone()
}

/// Runs `fence-proxy postgres init` for `table` on `upstream` (on a thread of its own, so async
/// tests may call it).
pub fn init_guard(upstream: &str, table: &str) {
    init_guard_with(upstream, table, false);
}

/// [`init_guard`], with `--require-verified` when `require_verified`.
pub fn init_guard_with(upstream: &str, table: &str, require_verified: bool) {
    try_init_guard_with(upstream, table, require_verified)
        .unwrap_or_else(|e| panic!("fence-proxy postgres init: {e:#}"));
}

/// [`init_guard`], returning the error.
pub fn try_init_guard(upstream: &str, table: &str) -> anyhow::Result<()> {
    try_init_guard_with(upstream, table, false)
}

/// [`init_guard_with`], returning the error.
pub fn try_init_guard_with(
    upstream: &str,
    table: &str,
    require_verified: bool,
) -> anyhow::Result<()> {
    try_init(fence_proxy_postgres::InitArgs {
        upstream: upstream.to_owned(),
        fence_table: table.to_owned(),
        grant_to: Vec::new(),
        require_verified,
        token_floor: None,
    })
    .map(drop)
}

/// `fence-proxy postgres init` with these flags (on a thread of its own), returning its report.
pub fn try_init(args: fence_proxy_postgres::InitArgs) -> anyhow::Result<String> {
    std::thread::spawn(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(fence_proxy_postgres::init(&args))
    })
    .join()
    .expect("init thread")
}

/// SQL that lets `role` use this process's guard function, as `init --grant-to` does.
pub fn grant_guard_sql(role: &str) -> String {
    let table = fence_proxy_postgres::fence_sql::FenceTable::parse(&fence_table()).unwrap();
    table.grant_sql(role)
}
