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
from tests.cluster_env import serve_until_ready
from tests.netutil import free_port
from tests.terminate_env import RecordingNode, json_events

LOOPBACK = "127.0.0.1"
TUNNEL = "tunnel.attack.test"
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
        self._log.flush()
        return self.log_path.read_text(errors="replace")


@dataclass
class World:
    tmp: Path
    port: int = field(default_factory=free_port)
    admin: int = field(default_factory=free_port)

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

    def write_config(self, *, bob: bool) -> None:
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
    pins: ["{self.alina_key.fingerprint}"]
    routes:
      - host: {PT}
        mode: passthrough
        backend: tunnel
{bob_tenant}""")

    # -- processes ----------------------------------------------------------------------

    def start_serve(self) -> None:
        self.proc, ready = serve_until_ready(self.tmp, self.config, ["--workers", "2"],
                                             self._log)
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
        return (got == want and got.get("bob", (0, 0))[1] <= 8
                and doc["counters"].get("open_connections") == control and workers_idle)

    def wait_settled(self, what: str = "the tunnels to settle") -> None:
        try:
            wait_for(self.settled, what)
        except AssertionError:
            raise AssertionError(f"{what}: {self.tunnels()} "
                                 f"{self.status()['counters'].get('open_connections')}\n"
                                 f"{self.logs()[-3000:]}") from None

    def fds(self) -> int:
        assert self.proc is not None
        return fd_count(self.proc)

    # -- invariants -----------------------------------------------------------------------

    def served(self, source: str = LOOPBACK) -> None:
        """Both tenants reach their own node, and only their own."""
        a, b = len(self.alina_node.requests()), len(self.bob_node.requests())
        assert get_status(self.port, PT, source=source) == 200, self.logs()[-2000:]
        assert get_status(self.port, TM, source=source) == 200, self.logs()[-2000:]
        assert len(self.alina_node.requests()) == a + 1
        assert len(self.bob_node.requests()) == b + 1
        assert all(r.headers_host() == PT for r in self.alina_node.requests()[a:])
        assert all(r.headers_host() == TM for r in self.bob_node.requests()[b:])

    def clean_logs(self) -> None:
        for name, text in [("serve", self.logs())] + [
                (n, c.logs()) for n, c in self.connectors.items()]:
            assert "Traceback" not in text, f"{name}:\n{text[-4000:]}"

    def events(self, event: str) -> list[dict[str, Any]]:
        return [e for e in json_events(self.logs()) if e.get("event") == event]


def _host(self: Any) -> str | None:
    values = self.header_values("host")
    return values[0] if values else None


# RecordingNode's records know their headers; which route a request came in on is its Host
setattr(__import__("tests.terminate_env", fromlist=["NodeRequest"]).NodeRequest,
        "headers_host", _host)


def node_connections(node: RecordingNode) -> int:
    with node._lock:
        return len(node._socks)


def get_status(port: int, host: str, *, source: str = LOOPBACK, path: str = "/ping",
               timeout: float = 10.0) -> int | None:
    """One GET: the status code, or None if the connection failed before a response."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        with socket.create_connection((LOOPBACK, port), timeout=timeout,
                                      source_address=(source, 0)) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
                        .encode())
            head = b""
            while b"\r\n" not in head:
                chunk = tls.recv(4096)
                if not chunk:
                    return None
                head += chunk
            return int(head.split(b" ", 2)[1])
    except (OSError, ssl.SSLError, ValueError, IndexError):
        return None


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
    yield world
    world.wait_settled("the tunnels to settle after the attack")
    world.served()
    world.clean_logs()


def test_smoke(fresh: World) -> None:
    print(fresh.tunnels(), fresh.fds())
