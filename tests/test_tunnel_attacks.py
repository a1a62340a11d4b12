"""The reverse tunnel attacked from outside: real `pact-ingress serve --workers 2` and
real `pact-ingress connect` processes on loopback, hostile peers on raw sockets.

Two tenants, each with its own home node and connector: `alina` (a passthrough route,
`PT`) and `bob` (a terminate route, `TM`, served by the worker processes, whose upstream
is main's tunnel stream). Every attack ends by checking what must hold whatever was
tried: each tenant's requests reach that tenant's node only, bystanders are served, the
tunnel and connection counts of /status come back to the truth, the processes' fds come
back to their baseline, and no log line is a traceback. Every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import pytest

from pact_ingress.identity import Identity, keygen
from pact_ingress.proto.tunnel import constants as tc
from pact_ingress.proto.tunnel import frames as tf
from tests import cluster_env
from tests.cluster_env import serve_until_ready
from tests.netutil import free_port
from tests.terminate_env import RecordingNode, json_events, read_response

LOOPBACK = "127.0.0.1"
TUNNEL = "tunnel.attack.test"
TUNNEL_CLUSTER = "tunnel.cluster.test"  # tests.cluster_env's
PT = "pt.alina.test"  # alina: passthrough, backend tunnel
TM = "tm.bob.test"  # bob: terminate, backend tunnel
WAIT = 20.0


def wait_for(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = check()
        except Exception:  # the admin endpoint restarting, a process between states
            value = None
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def pids_of(proc: subprocess.Popen[bytes]) -> list[int]:
    pids = [proc.pid]
    with contextlib.suppress(OSError):
        for task in Path(f"/proc/{proc.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
    return pids


def fd_count(proc: subprocess.Popen[bytes]) -> int:
    total = 0
    for pid in pids_of(proc):
        with contextlib.suppress(OSError):
            total += len(os.listdir(f"/proc/{pid}/fd"))
    return total


def connector_sockets(port: int) -> set[str]:
    """`socket:[inode]` of every TCP socket on `port` whose peer is 127.0.0.1 (where the
    connectors dial from; the attacks' callers come from 127.0.0.2 and 127.0.0.3)."""
    out = set()
    local_port = f"{port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, inode = fields[1], fields[2], fields[9]
        if local.endswith(":" + local_port) and remote.startswith("0100007F:"):
            out.add(f"socket:[{inode}]")
    return out


class Connect:
    """One `pact-ingress connect` process for a tenant's node."""

    def __init__(self, directory: Path, key: Identity, ingress_fp: str, port: int,
                 forward: int, connections: int = 2) -> None:
        self.config = directory / "connector.yaml"
        self.config.write_text(f"""\
identity: {{key: {key.key_path}}}
ingress:
  address: "{LOOPBACK}:{port}"
  tunnel_hostname: {TUNNEL}
  pin: "{ingress_fp}"
forward: "{LOOPBACK}:{forward}"
connections: {connections}
""")
        self.connections = connections
        self.log_path = directory / "connector.log"
        self._log: IO[bytes] = open(self.log_path, "ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "connect", "-c", str(self.config)],
            stdout=self._log, stderr=subprocess.STDOUT)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.kill()
        self._log.close()

    def logs(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")


@dataclass
class World:
    tmp: Path
    port: int = field(default_factory=free_port)
    admin: int = field(default_factory=free_port)
    workers: int = 2

    def __post_init__(self) -> None:
        d = self.tmp
        self.ingress = keygen(d / "ingress.key", common_name="ingress")
        self.alina_key = keygen(d / "alina.key", common_name="alina node")
        self.bob_key = keygen(d / "bob.key", common_name="bob node")
        self.stranger = keygen(d / "stranger.key", common_name="stranger")
        self.alina_node = RecordingNode(self.alina_key)
        self.bob_node = RecordingNode(self.bob_key, client_ca=self.ingress)
        self.config = d / "ingress.yaml"
        self.write_config(bob=True)
        self.log_path = d / "serve.log"
        self._log: IO[bytes] = open(self.log_path, "ab")
        self.proc: subprocess.Popen[bytes] | None = None
        self.connectors: dict[str, Connect] = {}

    def write_config(self, *, bob: bool, alina_pins: list[str] | None = None) -> None:
        """Both tenants (bob only with `bob`); alina's pins are her key's unless given."""
        if alina_pins is None:
            alina_pins = [self.alina_key.fingerprint]
        bob_tenant = f"""\
  - name: bob
    pins: ["{self.bob_key.fingerprint}"]
    routes:
      - host: {TM}
        mode: terminate
        backend: tunnel
        cert: {{cert: certs/tm.crt, key: certs/tm.key}}
""" if bob else ""
        self.config.write_text(f"""\
identity: {{key: ingress.key}}
state_dir: state
listen:
  tls: ["{LOOPBACK}:{self.port}"]
  admin: "{LOOPBACK}:{self.admin}"
tunnel: {{hostname: {TUNNEL}}}
limits:
  max_connections_per_ip: 40
  clienthello_timeout: 2s
tenants:
  - name: alina
    pins: [{", ".join(f'"{pin}"' for pin in alina_pins)}]
    routes:
      - host: {PT}
        mode: passthrough
        backend: tunnel
{bob_tenant}""")

    # -- processes ----------------------------------------------------------------------

    def start_serve(self) -> None:
        self.proc, ready = serve_until_ready(self.tmp, self.config,
                                             ["--workers", str(self.workers)], self._log)
        if not ready:
            raise AssertionError(f"serve not READY:\n{self.logs()[-3000:]}")

    def start_connectors(self) -> None:
        for name, key, node in (("alina", self.alina_key, self.alina_node),
                                ("bob", self.bob_key, self.bob_node)):
            directory = self.tmp / f"connect-{name}"
            directory.mkdir(exist_ok=True)
            self.connectors[name] = Connect(directory, key, self.ingress.fingerprint,
                                            self.port, node.port)
        self.wait_settled()

    def close(self) -> None:
        for c in self.connectors.values():
            c.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._log.close()
        self.alina_node.stop()
        self.bob_node.stop()

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    # -- admin --------------------------------------------------------------------------

    def _admin(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{self.admin}{path}", timeout=5) as r:
            return bytes(r.read())

    def status(self) -> dict[str, Any]:
        return dict(json.loads(self._admin("/status")))

    def metrics(self) -> str:
        return self._admin("/metrics").decode()

    def tunnels(self) -> dict[str, tuple[int, int]]:
        """tenant → (live control connections, open streams), as /status says."""
        return {t["tenant"]: (t["connections"], t["streams"])
                for t in self.status()["tunnels"]}

    def settled(self) -> bool:
        """Each tenant holds exactly its connector's control connections; its open
        streams are exactly the connections open at its node (a terminate route's
        upstream pool may keep a few alive between requests); no connection is open at
        the router but those control connections; no worker holds a client."""
        doc = self.status()
        got = {t["tenant"]: (t["connections"], t["streams"]) for t in doc["tunnels"]}
        want = {name: (c.connections, node_connections(node))
                for (name, c), node in zip(self.connectors.items(),
                                           (self.alina_node, self.bob_node))}
        workers_idle = all(w["open_connections"] == 0 for w in doc.get("workers", []))
        control = sum(c.connections for c in self.connectors.values())
        metrics = self.tunnel_metrics()
        return (got == want and metrics == got and got.get("bob", (0, 0))[1] <= 8
                and doc["counters"].get("open_connections") == control and workers_idle)

    def tunnel_metrics(self) -> dict[str, tuple[int, int]]:
        """tenant → (connections, streams), as /metrics says."""
        values: dict[str, dict[str, int]] = {}
        for line in self.metrics().splitlines():
            for name in ("pact_ingress_tunnels{", "pact_ingress_tunnel_streams{"):
                if line.startswith(name):
                    tenant = line.split('tenant="', 1)[1].split('"', 1)[0]
                    values.setdefault(tenant, {})[name] = int(float(line.rsplit(" ", 1)[1]))
        return {t: (v.get("pact_ingress_tunnels{", 0), v.get("pact_ingress_tunnel_streams{", 0))
                for t, v in values.items() if t in self.connectors}

    def wait_settled(self, what: str = "the tunnels to settle") -> None:
        try:
            wait_for(self.settled, what)
        except AssertionError:
            raise AssertionError(f"{what}: {self.tunnels()} "
                                 f"{self.status()['counters'].get('open_connections')}\n"
                                 f"{self.logs()[-3000:]}") from None

    def fds(self) -> int:
        """The serve processes' fds, leaving out the connectors' connections (their idle
        pools grow and shrink with the open rate, by design) and epoll sets (the
        readiness hub's is made once, on the first busy moment); every client
        connection, pipe and anything else counts."""
        assert self.proc is not None
        # a terminate route's tunnel stream opened for a worker is a socketpair between
        # main and the worker (one fd each); the worker's upstream pool keeps some alive
        doc = self.status()
        upstream = 2 * {t["tenant"]: t["streams"] for t in doc["tunnels"]}.get("bob", 0)
        # and the splice keeps drained pipes for reuse, as many as ran at once so far
        pipes = 2 * int(doc["counters"].get("splice_pipes_free", 0))
        pooled = connector_sockets(self.port)
        total = 0
        for pid in pids_of(self.proc):
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        link = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if link not in pooled and link != "anon_inode:[eventpoll]":
                            total += 1
        return total - upstream - pipes

    # -- invariants -----------------------------------------------------------------------

    def served(self, source: str = LOOPBACK) -> None:
        """Both tenants reach their own node, and only their own."""
        for host, mine, other in ((PT, self.alina_node, self.bob_node),
                                  (TM, self.bob_node, self.alina_node)):
            probe = f"/ping?probe={os.urandom(8).hex()}"
            status = get_status(self.port, host, source=source, path=probe)
            assert status == 200, (host, status, self.logs()[-2000:])
            assert [host_of(r) for r in mine.requests() if r.target == probe] == [host]
            assert not [r for r in other.requests() if r.target == probe]

    def clean_logs(self) -> None:
        for name, text in [("serve", self.logs())] + [
                (n, c.logs()) for n, c in self.connectors.items()]:
            assert "Traceback" not in text, f"{name}:\n{text[-4000:]}"

    def events(self, event: str) -> list[dict[str, Any]]:
        return [e for e in json_events(self.logs()) if e.get("event") == event]


def host_of(request: Any) -> str | None:
    """The Host a node saw: which route the request came in on."""
    values = request.header_values("host")
    return values[0] if values else None


def node_connections(node: RecordingNode) -> int:
    with node._lock:
        return len(node._socks)


def get_status(port: int, host: str, *, source: str = LOOPBACK, path: str = "/ping",
               timeout: float = 10.0) -> int | None:
    """One GET: the status code, or None if the connection failed before a response."""
    return cluster_env.get_status(LOOPBACK, port, host, source=source, path=path,
                                  timeout=timeout)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    w = World(tmp_path_factory.mktemp("tunnel-attacks"))
    try:
        w.start_serve()
        w.start_connectors()
        yield w
    finally:
        w.close()


@pytest.fixture
def fresh(world: World) -> Iterator[World]:
    """The shared world, checked whole before and after each attack."""
    assert world.proc is not None and world.proc.poll() is None, world.logs()[-3000:]
    world.wait_settled("the tunnels to settle before the attack")
    world.served()
    fds = world.fds()
    yield world
    world.wait_settled("the tunnels to settle after the attack")
    world.served()
    wait_for(lambda: world.fds() <= fds, f"fds back to {fds} (now {world.fds()})")
    world.clean_logs()


def test_each_tenant_reaches_only_its_own_node_from_every_worker(fresh: World) -> None:
    """The baseline every attack returns to: each route's callers reach their own
    tenant's node, passthrough from main, terminate from whichever worker the caller's
    address is handed to (both workers here), over main's tunnel streams."""
    from pact_ingress.proto.workers import worker_for

    sources = {}
    for last in range(2, 40):
        sources.setdefault(worker_for(f"127.0.0.{last}", 2), f"127.0.0.{last}")
    assert len(sources) == 2
    before = {w["index"]: w["requests"] for w in fresh.status()["workers"]}
    for source in sources.values():
        for _ in range(3):
            fresh.served(source=source)
    after = {w["index"]: w["requests"] for w in fresh.status()["workers"]}
    assert all(after[i] >= before[i] + 3 for i in sources), (before, after)


# --- hostile peers ---------------------------------------------------------------------


def tunnel_tls(port: int, key: Identity | None, alpn: str | None = tc.ALPN_CONTROL, *,
               source: str = LOOPBACK, max_version: ssl.TLSVersion | None = None,
               timeout: float = 5.0) -> ssl.SSLSocket:
    """A TLS connection to the tunnel hostname, presenting `key` (or no certificate)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if alpn is not None:
        ctx.set_alpn_protocols([alpn])
    if key is not None:
        ctx.load_cert_chain(key.cert_path, key.key_path)
    if max_version is not None:
        ctx.maximum_version = max_version
    raw = socket.create_connection((LOOPBACK, port), timeout=timeout,
                                   source_address=(source, 0))
    try:
        return ctx.wrap_socket(raw, server_hostname=TUNNEL)
    except BaseException:
        raw.close()
        raise


def read_until_closed(sock: socket.socket, limit: float = 5.0) -> tuple[bytes, str]:
    """Everything the peer sends until it closes: (bytes, how it ended: eof, reset,
    tls:<reason> or timeout)."""
    data = b""
    deadline = time.monotonic() + limit
    sock.settimeout(0.2)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except ssl.SSLError as exc:
            return data, f"tls:{exc.reason}"
        except ConnectionResetError:
            return data, "reset"
        except OSError as exc:
            return data, f"error:{exc}"
        if not chunk:
            return data, "eof"
        data += chunk
    return data, "timeout"


def read_at_least(sock: socket.socket, size: int, limit: float = 10.0) -> int:
    """Read until `size` bytes came, the peer closed, or `limit` passed: the count."""
    got = 0
    deadline = time.monotonic() + limit
    sock.settimeout(1)
    while got < size and time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        got += len(chunk)
    return got


def frames_in(data: bytes) -> list[tf.Message]:
    decoder, out = tf.Decoder(), []
    decoder.feed(data)
    with contextlib.suppress(tf.FrameError):
        while (msg := decoder.next_message()) is not None:
            out.append(msg)
    return out


def hello() -> bytes:
    return tf.encode(tf.Hello(tf.VERSION, 0, os.urandom(16)))


def first_frames(sock: ssl.SSLSocket, kind: type, count: int, limit: float = 5.0
                 ) -> list[tf.Message]:
    """Read frames until `count` of `kind` arrived (bounded)."""
    decoder, got = tf.Decoder(), []
    deadline = time.monotonic() + limit
    sock.settimeout(limit)
    while sum(isinstance(m, kind) for m in got) < count and time.monotonic() < deadline:
        chunk = sock.recv(4096)
        assert chunk, f"closed after {got}"
        decoder.feed(chunk)
        while (msg := decoder.next_message()) is not None:
            got.append(msg)
    return got


def raw_connection(port: int, payload: bytes, source: str = LOOPBACK) -> socket.socket:
    s = socket.create_connection((LOOPBACK, port), timeout=5, source_address=(source, 0))
    if payload:
        s.sendall(payload)
    return s


def reset(sock: socket.socket) -> None:
    """Abort: RST instead of FIN."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    sock.close()


def tunnel_client_hello() -> bytes:
    """A connector's first flight: a ClientHello for the tunnel hostname, control ALPN."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols([tc.ALPN_CONTROL])
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ctx.wrap_bio(incoming, outgoing, server_hostname=TUNNEL)
    with contextlib.suppress(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def stall_tunnel_slots(port: int, count: int, tls: bool = False) -> list[socket.socket]:
    """`count` connections from 127.0.0.1 that start like a connector's (the raw data
    preamble, or with `tls` every third a ClientHello for the tunnel) and say no more."""
    held = []
    first = tunnel_client_hello()
    for i in range(count):
        if tls and i % 3 == 0:
            held.append(raw_connection(port, first))
        else:
            held.append(raw_connection(port, tf.RAW_DATA_MAGIC + b"\x07"[:i % 2]))
    time.sleep(0.3)
    return held


BAD_CONTROL = {
    "oversized length": bytes([tf.FrameType.PING]) + (tf.MAX_PAYLOAD + 1).to_bytes(2, "big"),
    "unknown type": bytes([200, 0, 0]),
    "short PING": bytes([tf.FrameType.PING, 0, 3, 1, 2, 3]),
    "TOKEN from a connector": tf.encode(tf.Token(b"t" * tf.TOKEN_BYTES)),
    "SPARE from a connector": tf.encode(tf.Spare(b"s" * tf.TOKEN_BYTES)),
    "WELCOME from a connector": tf.encode(tf.Welcome(b"w" * 16, 5000)),
    "a second HELLO": tf.encode(tf.Hello(tf.VERSION, 1, b"h" * 16)),
    "DATA_HELLO on control": tf.encode(tf.DataHello(b"d" * tf.TOKEN_BYTES)),
    "DATA_OK on control": tf.encode(tf.DataOk()),
}


@pytest.mark.parametrize("before_hello", [False, True], ids=["after-hello", "instead-of-hello"])
def test_malformed_control_frames_from_a_valid_key_get_a_protocol_goaway(
        fresh: World, before_hello: bool) -> None:
    """A connector holding a tenant's key but speaking garbage: every malformed,
    unknown, oversized or out-of-order frame ends that connection with a GOAWAY
    PROTOCOL_ERROR and a logged reason; the real connectors never notice."""
    w = fresh
    refused_before = len(w.events("tunnel_refused"))
    for what, bad in BAD_CONTROL.items():
        if before_hello and what == "a second HELLO":
            continue
        with tunnel_tls(w.port, w.alina_key) as tls:
            if not before_hello:
                tls.sendall(hello())
                assert isinstance(first_frames(tls, tf.Welcome, 1)[0], tf.Welcome)
            tls.sendall(bad)
            data, _end = read_until_closed(tls)
        goaways = [m for m in frames_in(data) if isinstance(m, tf.Goaway)]
        assert goaways and goaways[-1].code == tf.GoawayCode.PROTOCOL_ERROR, (what, data)
    expected = len(BAD_CONTROL) - (1 if before_hello else 0)
    refused = wait_for(lambda: len(w.events("tunnel_refused")) >= refused_before + expected
                       and w.events("tunnel_refused"), "the refusals logged")
    assert {e["reason"] for e in refused[refused_before:]} == {"protocol_error"}


def test_truncated_and_trickled_control_frames_end_cleanly(fresh: World) -> None:
    """Half a frame then EOF, half a frame then a reset, a HELLO cut before the handshake
    finished: each connection ends, nothing is kept."""
    w = fresh
    for cut in (1, 2, 5, len(hello()) - 1):
        for abort in (False, True):
            tls = tunnel_tls(w.port, w.alina_key)
            tls.sendall(hello()[:cut])
            if abort:
                reset(tls)
            else:
                tls.close()
    with tunnel_tls(w.port, w.alina_key) as tls:  # a session that ends mid-frame
        tls.sendall(hello())
        first_frames(tls, tf.Welcome, 1)
        tls.sendall(tf.encode(tf.Ping(7))[:5])
    raw = raw_connection(w.port, b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")
    reset(raw)  # a ClientHello cut short, then a reset


def test_unauthenticated_parties_get_no_tunnel(fresh: World) -> None:
    """No client certificate, a key no tenant pins, a wrong ALPN, TLS 1.2, junk: each
    ends without a single tunnel frame but a GOAWAY, with a TLS alert or a logged
    reason; the tenants' tunnels stay as they were."""
    w = fresh
    before = w.tunnels()
    attempts: list[tuple[str, Callable[[], ssl.SSLSocket | socket.socket]]] = [
        ("no certificate", lambda: tunnel_tls(w.port, None)),
        ("unpinned key", lambda: tunnel_tls(w.port, w.stranger)),
        ("unpinned key, data ALPN", lambda: tunnel_tls(w.port, w.stranger, tc.ALPN_DATA)),
        ("pinned key, wrong ALPN", lambda: tunnel_tls(w.port, w.alina_key, "h2")),
        ("pinned key, no ALPN", lambda: tunnel_tls(w.port, w.alina_key, None)),
        ("pinned key, TLS 1.2", lambda: tunnel_tls(w.port, w.alina_key,
                                                   max_version=ssl.TLSVersion.TLSv1_2)),
        ("the ingress's own key", lambda: tunnel_tls(w.port, w.ingress)),
        # no peers configured here: a forward link is refused with an alert
        ("forward link", lambda: tunnel_tls(w.port, w.stranger, tc.ALPN_FORWARD)),
        ("forward link, pinned key", lambda: tunnel_tls(w.port, w.alina_key,
                                                        tc.ALPN_FORWARD)),
    ]
    for what, dial in attempts:
        try:
            sock = dial()
        except (ssl.SSLError, OSError):
            continue  # refused in the handshake: an alert
        with sock:
            with contextlib.suppress(OSError):
                sock.sendall(hello() + tf.encode(tf.Ping(1)))
            data, end = read_until_closed(sock)
        got = frames_in(data)
        assert all(isinstance(m, tf.Goaway) for m in got), (what, got)
        assert end != "timeout", what
    # junk where a ClientHello or the raw preamble should be
    for junk in (b"\x16\x03\x01\x00\x05hello", b"GET / HTTP/1.1\r\n\r\n",
                 tf.RAW_DATA_MAGIC + b"\x07\x00\x20" + os.urandom(32),
                 tf.RAW_DATA_MAGIC + b"\xff" * 64):
        with raw_connection(w.port, junk) as s:
            data, end = read_until_closed(s)
        assert tc.DATA_OK not in data and end != "timeout", junk
    assert w.tunnels() == before
    reasons = {e.get("reason") for e in w.events("tunnel_refused")}
    assert {"unknown_key", "bad_token"} <= reasons, reasons


def test_half_open_flood_on_the_connectors_address_cannot_lock_it_out(fresh: World) -> None:
    """Someone behind the connector's NAT address (here: 127.0.0.1, the connectors' own)
    fills the per-IP cap with connections that start like tunnel connections (the raw
    data preamble, a ClientHello for the tunnel hostname) and then say nothing. The
    connector must still get its data connections in: callers elsewhere are served."""
    w = fresh
    cap = 40  # the config's max_connections_per_ip
    held: list[socket.socket] = []
    try:
        held += stall_tunnel_slots(w.port, cap, tls=True)
        # each stream uses up a pooled data connection; the connector must replace them
        statuses = [get_status(w.port, PT, source="127.0.0.2", timeout=5) for _ in range(12)]
        assert statuses == [200] * 12, statuses
    finally:
        for s in held:
            s.close()


class SilentFlood:
    """From 127.0.0.1 (the connectors' address), as many connections as the accept
    gate lets in, saying nothing, each renewed when the ingress gives up on it: while it
    runs, every new connection from that address is closed at accept (documented: the
    per-address cap is checked before a byte is read)."""

    def __init__(self, port: int, count: int) -> None:
        self.port, self.count = port, count
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        held: list[socket.socket] = []
        deadline = time.monotonic() + 60
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                for s in list(held):
                    try:
                        s.setblocking(False)
                        if s.recv(1) == b"":
                            raise ConnectionResetError
                    except BlockingIOError:
                        continue
                    except OSError:
                        pass
                    held.remove(s)
                    s.close()
                while len(held) < self.count:
                    with contextlib.suppress(OSError):
                        held.append(raw_connection(self.port, b""))
                time.sleep(0.05)
        finally:
            for s in held:
                s.close()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def test_pool_refills_soon_after_data_connections_were_refused(fresh: World) -> None:
    """While the connector's data connections are refused at the door (here: its
    address's accept cap held by silent connections), the TOKENs it was granted are lost
    on the way. Once the door opens again the pool must refill within seconds, not wait
    for the lost TOKENs to expire (TOKEN_TTL)."""
    w = fresh
    flood = SilentFlood(w.port, 40 + 16)  # the config's cap and the peek headroom
    try:
        results: list[int | None] = []
        deadline = time.monotonic() + 20
        while None not in results and len(results) < 80 and time.monotonic() < deadline:
            results.append(get_status(w.port, PT, source="127.0.0.2", timeout=7))
        assert None in results, results  # the pool ran dry: its refills were refused
    finally:
        flood.stop()
    wait_for(lambda: get_status(w.port, PT, source="127.0.0.2", timeout=3) == 200,
             "alina served again", timeout=8)


# --- hostile public clients ----------------------------------------------------------------


def tls_client(port: int, host: str, source: str = LOOPBACK, rcvbuf: int | None = None
               ) -> ssl.SSLSocket:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.settimeout(10)
    raw.bind((source, 0))
    raw.connect((LOOPBACK, port))
    return ctx.wrap_socket(raw, server_hostname=host)


def big_request(host: str, size: int) -> bytes:
    return f"GET /big?bytes={size} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()


def test_clients_aborting_mid_stream_leave_nothing_behind(fresh: World) -> None:
    """Callers of both tunnel routes that reset their connection in the middle of a large
    answer, or pipeline requests and reset before reading: the other tenant is served
    meanwhile, and every tunnel stream, node connection and fd is given back."""
    w = fresh
    for i in range(6):
        for host in (PT, TM):
            s = tls_client(w.port, host, source="127.0.0.2")
            s.sendall(big_request(host, 32 << 20))
            got = 0
            while got < 256 << 10:
                chunk = s.recv(65536)
                assert chunk, host
                got += len(chunk)
            reset(s)
        s = tls_client(w.port, TM, source="127.0.0.2")  # pipelined, then gone
        s.sendall(b"".join(f"GET /ping?{n} HTTP/1.1\r\nHost: {TM}\r\n\r\n".encode()
                           for n in range(8)) + big_request(TM, 8 << 20))
        reset(s)
        w.served(source="127.0.0.3")
    w.wait_settled("streams given back after the aborts")


def test_a_caller_that_stops_reading_holds_only_its_own_stream(fresh: World) -> None:
    """A caller that asks for a large answer and stops reading (its window full, the
    tunnel stream backed up to the node): other callers of the same tenant, and the
    other tenant, are served while it sits there."""
    w = fresh
    stuck = []
    try:
        for host in (PT, TM, PT):
            s = tls_client(w.port, host, source="127.0.0.2", rcvbuf=4096)
            s.sendall(big_request(host, 64 << 20))
            s.recv(1024)  # the answer began; not another byte is read
            stuck.append(s)
        wait_for(lambda: w.tunnels()["alina"][1] >= 2, "the stuck streams open")
        for _ in range(5):
            w.served(source="127.0.0.3")
    finally:
        for s in stuck:
            reset(s)


def test_flood_from_one_address_leaves_another_served(fresh: World) -> None:
    """One address opens the most connections it may, half of them tunnel streams held
    open, half silent; a caller from another address is served, and all of it is given
    back when the flood ends."""
    w = fresh
    flood: list[socket.socket] = []
    try:
        for i in range(20):  # tunnel streams, the inner TLS done, then idle
            flood.append(tls_client(w.port, PT if i % 2 else TM, source="127.0.0.2"))
        for _ in range(36):  # and silent ones up to the accept cap (40 + 16)
            flood.append(raw_connection(w.port, b"", source="127.0.0.2"))
        over = raw_connection(w.port, b"", source="127.0.0.2")  # one too many: closed
        assert read_until_closed(over, 3)[1] in ("eof", "reset")
        over.close()
        for _ in range(3):
            w.served(source="127.0.0.3")
        assert w.tunnels()["alina"][1] >= 10
    finally:
        for s in flood:
            reset(s)


# --- a hostile connector with a valid key ------------------------------------------------------


def test_tokens_are_single_use_and_die_with_their_session(fresh: World) -> None:
    """Two hand-made sessions of alina's key at once: a token works once, in the pool
    of the session that issued it; replayed, or presented after its session ended, it
    is refused and nothing reaches a pool; bob's key cannot use alina's tokens."""
    w = fresh
    one, two = tunnel_tls(w.port, w.alina_key), tunnel_tls(w.port, w.alina_key)
    data: list[socket.socket] = []
    try:
        tokens = []
        for s in (one, two):
            s.sendall(hello())
            tokens.append([m.token for m in first_frames(s, tf.Token, 2)  # type: ignore[attr-defined]
                           if isinstance(m, tf.Token)])
        wait_for(lambda: w.tunnels()["alina"][0] == 4, "four alina sessions")
        ok = raw_connection(w.port, tf.raw_data_preamble(tokens[0][0]))
        ok.settimeout(5)
        assert ok.recv(16) == tc.DATA_OK
        data.append(ok)
        for token in (tokens[0][0], tokens[0][0]):  # replays
            s = raw_connection(w.port, tf.raw_data_preamble(token))
            assert read_until_closed(s)[0] == b""
            s.close()
        # over TLS, with bob's key: the token is alina's
        with tunnel_tls(w.port, w.bob_key, tc.ALPN_DATA) as s:
            s.sendall(tf.encode(tf.DataHello(tokens[1][0])))
            assert tc.DATA_OK not in read_until_closed(s)[0]
        one.close()  # its tokens die with it
        wait_for(lambda: w.tunnels()["alina"][0] == 3, "session one gone")
        s = raw_connection(w.port, tf.raw_data_preamble(tokens[0][1]))
        assert read_until_closed(s)[0] == b""
        s.close()
        # the other session's token is still good: sessions do not void each other
        good = raw_connection(w.port, tf.raw_data_preamble(tokens[1][1]))
        good.settimeout(5)
        assert good.recv(16) == tc.DATA_OK
        data.append(good)
        reasons = [e["reason"] for e in w.events("tunnel_refused")]
        assert reasons.count("token_mismatch") >= 1 and reasons.count("bad_token") >= 3
    finally:
        for s in (one, two, *data):
            s.close()


def test_black_hole_data_connections_hurt_only_their_own_tenant(fresh: World) -> None:
    """A connector with alina's key that takes every token it is given, dials the data
    connections and then neither reads nor writes: the streams it swallows are alina's
    own; bob is served all along, and when it goes everything is given back."""
    w = fresh
    ctl = tunnel_tls(w.port, w.alina_key)
    holes: list[socket.socket] = []
    try:
        ctl.sendall(hello())
        for m in first_frames(ctl, tf.Token, tc_pool_min()):
            if isinstance(m, tf.Token):
                s = raw_connection(w.port, tf.raw_data_preamble(m.token))
                holes.append(s)
        for s in holes:
            s.settimeout(5)
            assert s.recv(16) == tc.DATA_OK
        results = []
        for _ in range(8):  # some of alina's streams land in the hole, and time out there
            results.append(get_status(w.port, PT, source="127.0.0.3", timeout=1))
            probe = f"/ping?probe={os.urandom(8).hex()}"
            assert get_status(w.port, TM, source="127.0.0.3", path=probe) == 200
            assert [r for r in w.bob_node.requests() if r.target == probe]
        assert results.count(200) >= 1, results  # the real connector still gets its share
        assert not [r for r in w.bob_node.requests() if host_of(r) != TM]
    finally:
        ctl.close()
        for s in holes:
            reset(s)


def tc_pool_min() -> int:
    from pact_ingress.proto.tunnel.session import POOL_MIN
    return POOL_MIN


def test_a_connector_connecting_twice_at_once(fresh: World) -> None:
    """A second `connect` for alina (same key, its own slots) while the first runs: both
    are admitted; killing either leaves the other serving; the count of live
    connections follows the processes, not what they once were."""
    w = fresh
    directory = w.tmp / "connect-alina-2"
    directory.mkdir(exist_ok=True)
    second = Connect(directory, w.alina_key, w.ingress.fingerprint, w.port,
                     w.alina_node.port)
    try:
        wait_for(lambda: w.tunnels()["alina"][0] == 4, "both alina connectors up")
        for _ in range(4):
            w.served(source="127.0.0.3")
        w.connectors["alina"].kill()
        wait_for(lambda: w.tunnels()["alina"][0] == 2, "the first one's sessions gone")
        for _ in range(4):
            w.served(source="127.0.0.3")
        w.connectors["alina"].start()
        wait_for(lambda: w.tunnels()["alina"][0] == 4, "the first one back")
    finally:
        second.close()
    assert "Traceback" not in second.logs()


# --- processes dying and configs changing under traffic ------------------------------------


class Traffic:
    """Requests to one host from a thread until stopped; records the outcomes."""

    def __init__(self, w: World, host: str, source: str) -> None:
        self.w, self.host, self.source = w, host, source
        self.results: list[int | None] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + 60
        while not self._stop.is_set() and time.monotonic() < deadline:
            self.results.append(get_status(self.w.port, self.host, source=self.source,
                                           timeout=3))
            time.sleep(0.02)

    def stop(self) -> list[int | None]:
        self._stop.set()
        self._thread.join(10)
        return self.results


def test_connector_killed_and_restarted_during_traffic(fresh: World) -> None:
    """kill -9 of alina's connector while both tenants' callers keep coming, and while a
    large answer is flowing: bob never notices; alina's callers are refused (a TLS
    alert, not a hang) until the restarted connector is back, then served."""
    w = fresh
    bob = Traffic(w, TM, "127.0.0.3")
    alina = Traffic(w, PT, "127.0.0.2")
    try:
        flowing = tls_client(w.port, PT, source="127.0.0.2")
        flowing.sendall(big_request(PT, 4 << 20))
        flowing.recv(1024)
        time.sleep(0.3)
        w.connectors["alina"].kill()
        wait_for(lambda: w.tunnels()["alina"][0] == 0, "alina's tunnel down")
        assert get_status(w.port, PT, source="127.0.0.2", timeout=8) is None
        w.connectors["alina"].start()
        wait_for(lambda: w.tunnels()["alina"][0] == 2, "alina's connector back")
        wait_for(lambda: get_status(w.port, PT, source="127.0.0.2") == 200, "alina served")
        reset(flowing)
    finally:
        bob_results, alina_results = bob.stop(), alina.stop()
    assert bob_results and set(bob_results) == {200}, bob_results
    assert 200 in alina_results


#: A body far larger than every buffer between node and caller (a caller reading 1 KiB
#: through a small receive buffer): a stream carrying it is still in flight at a reload.
ENDLESS = 256 << 20
#: What a stalled caller may still read after its stream was cut: what the edge had
#: already taken off the tunnel connection (a splice's pipe, 1 MiB at most; a worker's
#: socketpair and TLS buffers) and its own buffers. The tunnel connection's receive
#: queue, megabytes by then, is thrown away with the cut.
RESIDUE = 2 << 20


def mid_download(w: World, host: str, source: str) -> ssl.SSLSocket:
    """A caller that asked `host` for an ENDLESS body and read the first bytes of it."""
    s = tls_client(w.port, host, source=source, rcvbuf=16384)
    s.sendall(big_request(host, ENDLESS))
    assert s.recv(1024)
    return s


def read_to_end(sock: socket.socket, limit: float = 10.0) -> tuple[int, bool]:
    """Read until the connection ends (EOF, a reset, a TLS error) or `limit` passed: the
    bytes read, and whether it ended."""
    got = 0
    deadline = time.monotonic() + limit
    sock.settimeout(1)
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(1 << 20)
        except TimeoutError:
            continue
        except (OSError, ssl.SSLError):
            return got, True
        if not chunk:
            return got, True
        got += len(chunk)
    return got, False


def test_reload_drops_and_readds_a_tenant_cutting_its_streams(fresh: World) -> None:
    """SIGHUP with bob gone while bob's callers are mid-answer (and have stopped
    reading) and alina's keep coming; then SIGHUP with bob back: alina is served
    throughout, bob's streams are cut at the reload (what his node had sent and the edge
    not yet relayed is thrown away, not delivered), his connector is told
    its key is unpinned and comes back after the re-add, and no stream or count is left
    over."""
    w = fresh
    alina = Traffic(w, PT, "127.0.0.2")
    mid = []
    try:
        mid = [mid_download(w, TM, "127.0.0.3") for _ in range(2)]
        time.sleep(1.0)  # the callers stall: every buffer on the way fills
        w.write_config(bob=False)
        reload(w)
        wait_for(lambda: "bob" not in w.tunnels(), "bob's tunnel gone from /status")
        for s in mid:
            got, ended = read_to_end(s)
            assert ended and got < RESIDUE, (got, ended)
        assert get_status(w.port, TM, source="127.0.0.3", timeout=5) is None
        w.write_config(bob=True)
        reload(w)
        wait_for(lambda: w.tunnels().get("bob", (0, 0))[0] == 2, "bob's connector back")
    finally:
        results = alina.stop()
        for s in mid:
            s.close()
    assert results and set(results) == {200}, results
    refused = [e for e in json_events(w.connectors["bob"].logs())
               if e.get("event") == "tunnel_key_refused"]
    assert refused and refused[0]["code"] == "KEY_UNPINNED"
    cut = [e for e in w.events("tunnel_streams_cut") if e["tenant"] == "bob"]
    assert cut and all(e["fingerprint"] == w.bob_key.fingerprint for e in cut), cut
    assert sum(e["streams"] for e in cut) >= len(mid), cut


def test_a_revoked_key_s_streams_are_cut_and_the_other_tenant_s_run_on(
        fresh: World) -> None:
    """alina's pin is replaced by another key while her callers hold passthrough
    connections through her tunnel: one mid-download, one idle after an answer (end-to-end
    TLS the edge cannot read). The reload cuts both, through whichever process holds
    them, while bob's caller mid-download on the same edge gets his whole body. Her pin
    back, her connector returns by itself."""
    w = fresh
    bob = tls_client(w.port, TM, source="127.0.0.4", rcvbuf=16384)
    held: list[ssl.SSLSocket] = []
    try:
        size = 8 << 20
        bob.sendall(big_request(TM, size))
        assert bob.recv(1024)
        held.append(mid_download(w, PT, "127.0.0.2"))
        idle = tls_client(w.port, PT, source="127.0.0.3")
        held.append(idle)
        idle.sendall(f"GET /ping HTTP/1.1\r\nHost: {PT}\r\n\r\n".encode())
        assert read_response(idle).status == 200
        before = len(w.events("tunnel_streams_cut"))
        w.write_config(bob=True, alina_pins=[w.stranger.fingerprint])
        reload(w)
        for s in held:
            got, ended = read_to_end(s)
            assert ended and got < ENDLESS // 4, (got, ended)
        assert get_status(w.port, PT, source="127.0.0.2", timeout=5) != 200
        rest = size - 1024
        assert read_at_least(bob, rest) >= rest  # the other tenant's stream runs on
        cut = [e for e in w.events("tunnel_streams_cut")[before:]
               if e["tenant"] == "alina"]
        assert cut and all(e["fingerprint"] == w.alina_key.fingerprint for e in cut), cut
        assert sum(e["streams"] for e in cut) >= len(held), cut
        assert all(e["tenant"] == "alina" for e in w.events("tunnel_streams_cut")[before:])
    finally:
        for s in held + [bob]:
            s.close()
        w.write_config(bob=True)
        reload(w)
    wait_for(lambda: w.tunnels().get("alina", (0, 0))[0] == 2, "alina's connector back")


def test_a_revoked_key_s_streams_are_cut_in_a_single_process(tmp_path: Path) -> None:
    """serve --workers 1: main's own lane holds bob's node connections over his tunnel
    streams, and main's router splices alina's. One reload revoking both keys cuts every
    stream: each stalled caller ends having read less than RESIDUE after the cut, the
    broken node bodies are one warning line each (no traceback), and once re-pinned both
    tenants are served again with no fd left over."""
    w = World(tmp_path, workers=1)
    try:
        w.start_serve()
        w.start_connectors()
        w.served()
        fds = w.fds()
        mid = [mid_download(w, TM, "127.0.0.3") for _ in range(2)]
        mid.append(mid_download(w, PT, "127.0.0.4"))
        time.sleep(1.0)  # the callers stall: every buffer on the way fills
        w.write_config(bob=False, alina_pins=[w.stranger.fingerprint])
        reload(w)
        ends = [read_to_end(s) for s in mid]
        for s in mid:
            s.close()
        assert all(ended and got < RESIDUE for got, ended in ends), ends
        cut = {e["tenant"]: e["streams"] for e in w.events("tunnel_streams_cut")}
        assert cut.get("bob", 0) >= 2 and cut.get("alina", 0) >= 1, cut
        broken = w.events("upstream_body_failed")
        assert broken and all(e["route"] == TM for e in broken), broken
        w.write_config(bob=True)
        reload(w)
        w.wait_settled("both connectors back after the re-pin")
        w.served()
        wait_for(lambda: w.fds() <= fds, f"fds back to {fds} (now {w.fds()})")
        w.clean_logs()
    finally:
        w.close()


def reload(w: World) -> None:
    assert w.proc is not None
    before = len(w.events("reloaded"))
    w.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: len(w.events("reloaded")) > before, "the reload applied")


def test_ingress_restarted_under_connectors(fresh: World) -> None:
    """serve stops (SIGTERM) with streams open and starts again on the same port: both
    connectors come back by themselves and both tenants are served."""
    w = fresh
    open_streams = [tls_client(w.port, host, source="127.0.0.2") for host in (PT, TM)]
    for s, host in zip(open_streams, (PT, TM)):
        s.sendall(big_request(host, 1 << 20))
        s.recv(1024)
    assert w.proc is not None
    w.proc.send_signal(signal.SIGTERM)
    for s in open_streams:
        reset(s)
    assert w.proc.wait(20) == 0, w.logs()[-3000:]
    w.start_serve()
    w.wait_settled("both connectors back after the restart")
    for name, c in w.connectors.items():
        goaways = [e for e in json_events(c.logs()) if e.get("event") == "tunnel_goaway"]
        assert any(e["code"] == "SHUTDOWN" for e in goaways), name


def test_slow_handshakes_on_the_connectors_address_do_not_keep_it_out(fresh: World) -> None:
    """Handshakes for the tunnel hostname that trickle in and stall, from the connector's
    own address, up to its tunnel cap: a connector restarted meanwhile gets its control
    connections back."""
    w = fresh
    first = tunnel_client_hello()
    held = [raw_connection(w.port, b"") for _ in range(40)]
    try:
        for cut in range(10):  # the ClientHello a few bytes at a time
            for s in held:
                s.sendall(first[cut * 4:cut * 4 + 4])
            time.sleep(0.02)
        for s in held:
            s.sendall(first[40:])  # whole now; the handshake is never finished
        w.connectors["bob"].kill()
        wait_for(lambda: "bob" not in w.tunnels() or w.tunnels()["bob"][0] == 0,
                 "bob's tunnel down")
        w.connectors["bob"].start()
        wait_for(lambda: w.tunnels()["bob"][0] == 2, "bob's connector back", timeout=10)
        w.served(source="127.0.0.3")
    finally:
        for s in held:
            s.close()


def test_stalled_forward_links_do_not_take_the_connectors_slots(tmp_path: Path) -> None:
    """With instances forwarding to each other (Redis registry, `state.peers`), a
    ClientHello for the tunnel hostname with the forward ALPN is a tunnel connection too:
    stalled ones from the connector's address, up to its tunnel cap, must not keep the
    connector's data connections out."""
    import base64

    from tests.cluster_env import PT_HOST, Instance, home_node, request
    from tests.cluster_env import Connect as ClusterConnect
    from tests.netutil import free_port_on
    from tests.redis_server import RedisServer
    from tests.tools import require

    require("redis-server")
    redis = RedisServer(tmp_path / "redis")
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    peer = keygen(tmp_path / "peer.key", common_name="peer instance")
    extra = (f"state: {{backend: redis, url: {redis.url}, encryption_key_file: {key},"
             f' deadline: 500ms, peers: ["{peer.fingerprint}"]}}\n'
             "limits: {max_connections_per_ip: 20}\n")
    node = home_node(tmp_path)
    port = free_port_on("127.0.0.2")
    instance = Instance(tmp_path, "127.0.0.2", port, node.identity.fingerprint, extra=extra)
    connect = None
    held: list[socket.socket] = []
    try:
        instance.start()
        connect = ClusterConnect(tmp_path, node.identity, node.port,
                                 [f"127.0.0.2:{port}"], [instance.identity.fingerprint])
        wait_for(lambda: instance.tunnels_up() >= 1, "the tunnel up")
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.set_alpn_protocols([tc.ALPN_FORWARD])
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        with contextlib.suppress(ssl.SSLWantReadError):
            ctx.wrap_bio(incoming, outgoing, server_hostname=TUNNEL_CLUSTER).do_handshake()
        first = outgoing.read()
        for _ in range(20):
            s = socket.create_connection(("127.0.0.2", port), timeout=5,
                                         source_address=(LOOPBACK, 0))
            s.sendall(first)
            held.append(s)
        time.sleep(0.3)
        statuses = [request(instance, PT_HOST, timeout=7) for _ in range(16)]
        assert statuses == [200] * 16, (statuses, instance.logs()[-2000:])
        assert "Traceback" not in instance.logs()
    finally:
        for s in held:
            s.close()
        if connect is not None:
            connect.close()
        instance.close()
        node.stop()
        redis.stop()


def test_callers_of_a_tenant_whose_tunnel_is_down_are_refused_at_once(fresh: World) -> None:
    """alina's connector is gone: a burst of her callers each get an answer (a TLS
    alert) without waiting for a tunnel, bob is served meanwhile, and nothing is left
    counted when alina's connector is back."""
    w = fresh
    w.connectors["alina"].kill()
    try:
        wait_for(lambda: w.tunnels()["alina"][0] == 0, "alina's tunnel down")
        results: list[tuple[bytes, str]] = []

        def one() -> None:
            with tls_client_raw(w.port, PT, "127.0.0.2") as s:
                results.append(read_until_closed(s, 8))

        threads = [threading.Thread(target=one) for _ in range(30)]
        for t in threads:
            t.start()
        probe = f"/ping?probe={os.urandom(8).hex()}"
        assert get_status(w.port, TM, source="127.0.0.3", path=probe) == 200
        for t in threads:
            t.join(15)
        assert len(results) == 30
        assert all(end != "timeout" for _, end in results), results
        alert_internal_error = b"\x15\x03\x03\x00\x02\x02\x50"
        assert all(data == alert_internal_error for data, _ in results), results[:3]
    finally:
        w.connectors["alina"].start()


def tls_client_raw(port: int, host: str, source: str) -> socket.socket:
    """A caller that sends a ClientHello for `host` and reads what comes back as bytes."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    with contextlib.suppress(ssl.SSLWantReadError):
        ctx.wrap_bio(incoming, outgoing, server_hostname=host).do_handshake()
    return raw_connection(port, outgoing.read(), source=source)
