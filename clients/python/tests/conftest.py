"""Real processes for the tests: a three-node lockd cluster, fence-proxy, a tiny upstream HTTP
server. Binaries come from $LOCKD_BIN_DIR (default ../../target/debug relative to this package,
i.e. the workspace's cargo target dir). Every process is stopped by its PID in a finalizer, also
when the test fails."""

from __future__ import annotations

import http.server
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

# grpcio's fork handlers can abort the process when it forks with channels in use (grpc/grpc
# issue 38251); the tests fork (subprocess) all the time, and Python < 3.10 forks for every
# subprocess. Set before grpc is imported; the children inherit it.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

import lockd_client  # noqa: E402

PACKAGE_DIR = Path(__file__).resolve().parent.parent
BIN_DIR = Path(os.environ.get("LOCKD_BIN_DIR") or PACKAGE_DIR / ".." / ".." / "target" / "debug").resolve()
PG_URL = os.environ.get("LOCKD_TEST_PG", "postgres://postgres@127.0.0.1:5432/test")


def binary(name: str) -> str:
    path = BIN_DIR / name
    if not path.is_file():
        pytest.fail("binary %s not found: set LOCKD_BIN_DIR to the directory of lockd, lockctl and fence-proxy" % path)
    return str(path)


class Proc:
    """A child process stopped by its PID (SIGTERM, then SIGKILL) in `stop`."""

    def __init__(self, name: str, args: List[str], log_dir: Path, env: Optional[Dict[str, str]] = None) -> None:
        self.name = name
        self.log_path = log_dir / ("%s.log" % name)
        self._log = open(self.log_path, "ab")
        full_env = dict(os.environ)
        full_env.setdefault("RUST_LOG", "warn,openraft=off")
        full_env.update(env or {})
        self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.pid, sig)

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait(5)

    def stop(self) -> None:
        if self.alive():
            try:
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGTERM)
                self.popen.wait(3)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.popen.wait(5)
            except ProcessLookupError:
                pass
        self._log.close()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""


def random_loopback_ip() -> str:
    return "127.%d.%d.%d" % (random.randint(1, 254), random.randint(0, 255), random.randint(1, 254))


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def wait_tcp(ip: str, port: int, proc: Proc, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not proc.alive():
            raise RuntimeError("%s exited: %s" % (proc.name, proc.log_tail()))
        try:
            with socket.create_connection((ip, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("%s did not listen on %s:%d: %s" % (proc.name, ip, port, proc.log_tail()))


class Cluster:
    """Three lockd nodes on a random 127.x.y.z address, ports 7001-7003, fast elections."""

    def __init__(self, tmp: Path, tls: bool = False) -> None:
        self.ip = random_loopback_ip()
        self.tmp = tmp
        self.nodes: Dict[int, Proc] = {}
        self.ca: Optional[Path] = make_certs(tmp / "tls", self.ip) if tls else None
        for i in (1, 2, 3):
            self.start_node(i)
        self.wait_for_leader()

    def addr(self, i: int) -> str:
        return "%s:%d" % (self.ip, 7000 + i)

    @property
    def endpoints(self) -> List[str]:
        return [self.addr(i) for i in (1, 2, 3)]

    def start_node(self, i: int) -> None:
        args = [binary("lockd"), "--id", str(i), "--listen", self.addr(i), "--data-dir", str(self.tmp / ("node%d" % i))]
        args += ["--heartbeat", "100ms", "--election-timeout", "600ms"]
        if self.ca is not None:
            t = self.tmp / "tls"
            args += ["--tls-cert", str(t / ("node%d.pem" % i)), "--tls-key", str(t / ("node%d-key.pem" % i))]
            args += ["--peer-ca", str(self.ca)]
        for p in (1, 2, 3):
            args += ["--peer", "%d=%s" % (p, self.addr(p))]
        self.nodes[i] = Proc("lockd-%d" % i, args, self.tmp)

    def client(self, **kw) -> lockd_client.Client:
        kw.setdefault("call_timeout", 10.0)
        if self.ca is not None:
            kw.setdefault("tls", lockd_client.TLS(ca=str(self.ca)))
        return lockd_client.Client(self.endpoints, **kw)

    def leader(self, timeout: float = 20.0) -> int:
        """The id of the leader that a majority agrees on and that serves a linearizable read."""
        end = time.monotonic() + timeout
        last = None
        while time.monotonic() < end:
            for i, proc in self.nodes.items():
                if not proc.alive():
                    continue
                try:
                    tls = lockd_client.TLS(ca=str(self.ca)) if self.ca is not None else None
                    with lockd_client.Client([self.addr(i)], call_timeout=1.0, attempt_timeout=1.0, tls=tls) as c:
                        st = c.status()
                        if st.leader_id and self.nodes.get(st.leader_id) and self.nodes[st.leader_id].alive():
                            c.describe("py-test/leader-probe")
                            return int(st.leader_id)
                except lockd_client.LockdError as e:
                    last = e
            time.sleep(0.1)
        raise RuntimeError("no leader within %ss (%s); logs: %s" % (timeout, last, self.nodes[1].log_tail()))

    def wait_for_leader(self) -> int:
        return self.leader()

    def stop(self) -> None:
        for proc in self.nodes.values():
            proc.stop()


def make_certs(d: Path, ip: str) -> Path:
    """A throwaway CA and one certificate per node naming `node-<id>.lockd.lockd` and `ip`, as
    lockd/bench/scripts/cluster3.sh makes them. Returns the CA's path."""
    d.mkdir(parents=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run("req", "-x509", *ec, "-days", "2", "-subj", "/CN=lockd py test CA",
        "-keyout", str(d / "ca-key.pem"), "-out", str(d / "ca.pem"))
    for i in (1, 2, 3):
        run("req", *ec, "-subj", "/CN=lockd node %d" % i, "-keyout", str(d / ("node%d-key.pem" % i)),
            "-out", str(d / ("node%d.csr" % i)))
        (d / ("node%d.ext" % i)).write_text(
            "subjectAltName=DNS:node-%d.lockd.lockd,IP:%s\nextendedKeyUsage=serverAuth,clientAuth\n" % (i, ip)
        )
        run("x509", "-req", "-in", str(d / ("node%d.csr" % i)), "-CA", str(d / "ca.pem"), "-CAkey",
            str(d / "ca-key.pem"), "-days", "2", "-out", str(d / ("node%d.pem" % i)),
            "-extfile", str(d / ("node%d.ext" % i)))
    return d / "ca.pem"


@pytest.fixture(scope="session")
def cluster():
    """One cluster shared by the tests that do not kill nodes."""
    with tempfile.TemporaryDirectory(prefix="lockd-py-") as tmp:
        c = None
        try:
            c = Cluster(Path(tmp))
            yield c
        finally:
            if c is not None:
                c.stop()


@pytest.fixture
def own_cluster():
    """A cluster of the test's own, for tests that kill or pause nodes."""
    with tempfile.TemporaryDirectory(prefix="lockd-py-") as tmp:
        c = None
        try:
            c = Cluster(Path(tmp))
            yield c
        finally:
            if c is not None:
                c.stop()


@pytest.fixture
def tls_cluster():
    """A cluster of the test's own with TLS on every port (a CA made with openssl)."""
    with tempfile.TemporaryDirectory(prefix="lockd-py-") as tmp:
        c = None
        try:
            c = Cluster(Path(tmp), tls=True)
            yield c
        finally:
            if c is not None:
                c.stop()


@pytest.fixture
def client(cluster):
    c = cluster.client()
    yield c
    c.close()


def unique(prefix: str) -> str:
    return "%s/%s" % (prefix, os.urandom(6).hex())


class Upstream:
    """A tiny HTTP service that records every request it gets (method, path, headers, body)."""

    def __init__(self, ip: str) -> None:
        self.requests: List[dict] = []
        upstream = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _record(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length).decode("utf-8", "replace")
                upstream.requests.append(
                    {"method": self.command, "path": self.path, "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
                )
                out = json.dumps({"ok": True}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = _record

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((ip, 0), Handler)
        self.url = "http://%s:%d" % (ip, self.server.server_address[1])
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def writes(self) -> List[dict]:
        return [r for r in self.requests if r["method"] != "GET"]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class HttpProxy:
    def __init__(self, proxy: Proc, url: str, upstream: Upstream) -> None:
        self.proc, self.url, self.upstream = proxy, url, upstream


@pytest.fixture
def http_proxy(tmp_path):
    """fence-proxy http with a redb store in front of an Upstream."""
    ip = random_loopback_ip()
    upstream = Upstream(ip)
    port = free_port(ip)
    proc = None
    try:
        proc = Proc(
            "fence-proxy-http",
            [
                binary("fence-proxy"),
                "http",
                "--listen",
                "%s:%d" % (ip, port),
                "--upstream",
                upstream.url,
                "--store",
                "redb:%s" % (tmp_path / "epochs.redb"),
            ],
            tmp_path,
        )
        wait_tcp(ip, port, proc)
        yield HttpProxy(proc, "http://%s:%d" % (ip, port), upstream)
    finally:
        if proc is not None:
            proc.stop()
        upstream.stop()


def python_child(code: str, env: Dict[str, str]) -> subprocess.Popen:
    full_env = dict(os.environ)
    full_env.update(env)
    return subprocess.Popen(
        [sys.executable, "-u", "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=full_env,
        text=True,
        # Not the package directory: there `import lockd_client` would find the source tree
        # (without its generated stubs) instead of the installed package.
        cwd=tempfile.gettempdir(),
    )
