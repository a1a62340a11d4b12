"""ACME as a cluster, seen from outside: two `pact-ingress serve` processes (127.0.0.2
and 127.0.0.3) sharing one redis-server and one pebble, both configured for the same new
terminate host. Exactly one order reaches pebble; both serve the same certificate; and
the CA validates through the instance that did *not* place the order.

Pebble validates every name on one address (its DNS, challtestsrv, answers 127.0.0.1),
so a small forwarder on that address plays the DNS round robin that real deployments
have: each connection of the CA is sent to the instance that does not hold the name's
order lease in Redis. The private key stored in Redis is sealed, never PEM."""

from __future__ import annotations

import base64
import hashlib
import os
import re
import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests.acme_servers import ChallTestSrv, Pebble
from tests.netutil import free_port_on
from tests.redis_server import RedisServer

INSTANCES = ("127.0.0.2", "127.0.0.3")
PREFIX = "pact-ingress:"
#: Every wait here is bounded by this (pebble issues in ~1–2 s; the machine may be loaded).
WAIT = 60.0


def redis_cmd(server: RedisServer, *args: str) -> bytes | None:
    """One command over raw RESP (the test checks what is in Redis, not our client)."""
    out = b"".join(b"$%d\r\n%s\r\n" % (len(a.encode()), a.encode()) for a in args)
    with socket.create_connection((server.host, server.port), timeout=5) as s:
        s.sendall(b"*%d\r\n" % len(args) + out)
        data = b""
        while b"\r\n" not in data:
            data += s.recv(65536)
        head, _, rest = data.partition(b"\r\n")
        if head.startswith(b"$"):
            size = int(head[1:])
            if size < 0:
                return None
            while len(rest) < size + 2:
                rest += s.recv(65536)
            return rest[:size]
        return head


class Instance:
    def __init__(self, tmp: Path, address: str, *, pebble: Pebble, redis: RedisServer,
                 key: Path, host: str, challenge: str) -> None:
        from pact_ingress.identity import keygen

        self.dir = tmp / address
        self.dir.mkdir()
        self.address = address
        node = keygen(self.dir / "node.key")
        self.config = self.dir / "ingress.yaml"
        self.config.write_text(f"""\
state_dir: ./state
listen:
  tls: ["{address}:{pebble.tls_port}"]
  http: ["{address}:{pebble.http_port}"]
{pebble.acme_yaml(challenge)}\
state:
  backend: redis
  url: {redis.url}
  encryption_key_file: {key}
  deadline: 500ms
tenants:
  - name: t
    pins: ["{node.fingerprint}"]
    routes:
      - {{host: {host}, mode: terminate, backend: "127.0.0.1:9", cert: acme}}
""")
        self.log_path = self.dir / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pact_ingress", "--log-format", "text", "serve",
                 "-c", str(self.config)], stdout=log, stderr=log, cwd=self.dir,
                env=dict(os.environ))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


class Forwarder:
    """The CA's view of DNS: each connection goes to the instance not holding the lease."""

    def __init__(self, redis: RedisServer, host: str, by_pid: dict[int, str]) -> None:
        self.redis = redis
        self.lock = f"{PREFIX}acme:lock:{host}"
        self.by_pid = by_pid
        self.sent: list[tuple[str, str]] = []  # (holder address, address forwarded to)
        self.errors: list[str] = []

    async def serve(self, port: int, task_status: trio.TaskStatus[None]) -> None:
        listeners = await trio.open_tcp_listeners(port, host="127.0.0.1")
        task_status.started()
        await trio.serve_listeners(lambda s: self.handle(s, port), listeners)

    async def handle(self, client: trio.SocketStream, port: int) -> None:
        async with client:
            holder = await trio.to_thread.run_sync(redis_cmd, self.redis, "GET", self.lock)
            pid = int(holder.split(b"/")[1]) if holder else -1
            if pid not in self.by_pid:
                self.errors.append(f"CA connected while no instance held the lease: {holder!r}")
                return
            target = next(a for p, a in self.by_pid.items() if p != pid)
            self.sent.append((self.by_pid[pid], target))
            with trio.move_on_after(WAIT):
                upstream = await self._connect(target, port)
                async with upstream:
                    async with trio.open_nursery() as n:
                        n.start_soon(_pipe, client, upstream)
                        n.start_soon(_pipe, upstream, client)


    @staticmethod
    async def _connect(address: str, port: int) -> trio.SocketStream:
        # the instance that did not order may still be starting (both start at once);
        # DNS round robin would point at it all the same
        while True:  # bounded by the caller's move_on_after
            try:
                return await trio.open_tcp_stream(address, port)
            except OSError:
                await trio.sleep(0.05)


async def _pipe(src: trio.SocketStream, dst: trio.SocketStream) -> None:
    try:
        while data := await src.receive_some(65536):
            await dst.send_all(data)
        await dst.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass


def served_fingerprint(address: str, port: int, host: str, root_pem: bytes) -> str | None:
    ctx = ssl.create_default_context(cadata=root_pem.decode())
    try:
        with socket.create_connection((address, port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as tls:
            der = tls.getpeercert(binary_form=True)
    except (OSError, ssl.SSLError):
        return None
    assert der is not None
    return hashlib.sha256(der).hexdigest()


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def challtestsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChallTestSrv]:
    srv = ChallTestSrv(tmp_path_factory.mktemp("challtestsrv")).start()
    yield srv
    srv.stop()


@pytest.mark.parametrize("challenge", ["tls-alpn-01", "http-01"])
async def test_two_instances_one_order_same_cert_validated_by_the_other(
        tmp_path: Path, redis: RedisServer, challtestsrv: ChallTestSrv, challenge: str) -> None:
    host = f"{challenge.replace('-', '')}.cluster.pact.test"
    pebble = Pebble(tmp_path / "pebble", f"127.0.0.1:{challtestsrv.dns_port}",
                    http_port=free_port_on("127.0.0.1", *INSTANCES),
                    tls_port=free_port_on("127.0.0.1", *INSTANCES)).start()
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    key.chmod(0o600)
    instances = [Instance(tmp_path, a, pebble=pebble, redis=redis, key=key, host=host,
                          challenge=challenge) for a in INSTANCES]
    try:
        for inst in instances:  # both at once: they race for the order
            inst.start()
        by_pid = {inst.proc.pid: inst.address for inst in instances if inst.proc}
        forwarder = Forwarder(redis, host, by_pid)
        root = None
        prints: dict[str, str | None] = {}
        async with trio.open_nursery() as nursery:
            for port in (pebble.tls_port, pebble.http_port):
                await nursery.start(forwarder.serve, port)
            with trio.fail_after(WAIT):
                while True:  # until both instances serve a certificate pebble issued
                    for inst in instances:
                        assert inst.proc is not None and inst.proc.poll() is None, inst.log
                    root = root or await trio.to_thread.run_sync(pebble.root_pem)
                    prints = {inst.address: await trio.to_thread.run_sync(
                        served_fingerprint, inst.address, pebble.tls_port, host, root)
                        for inst in instances}
                    if all(prints.values()):
                        break
                    await trio.sleep(0.2)
            nursery.cancel_scope.cancel()
        # the same certificate on both
        assert len(set(prints.values())) == 1, prints
        # exactly one order reached pebble (its WFE logs each new-order request once)
        assert len(re.findall(r"POST /order-plz", pebble.log)) == 1, pebble.log[-3000:]
        logs = [inst.log for inst in instances]
        assert sum(log.count("cert_issued") for log in logs) == 1, logs
        assert sum(log.count("cert_adopted") for log in logs) == 1, logs
        # the CA reached only the instance that did not order, and validated through it
        assert not forwarder.errors, forwarder.errors
        assert forwarder.sent and all(holder != to for holder, to in forwarder.sent)
        orderer = next(i for i, log in zip(instances, logs) if "cert_issued" in log)
        assert {to for _, to in forwarder.sent} == {
            i.address for i in instances if i is not orderer}
        # what Redis holds: a sealed key, never PEM; the lease is gone
        for name in (f"{PREFIX}acme:cert:{host}:key",):
            blob = redis_cmd(redis, "GET", name)
            assert blob and blob.startswith(b"PIS1") and b"BEGIN" not in blob
        account_keys = redis_cmd(redis, "KEYS", f"{PREFIX}acme:account:*:key")
        assert account_keys is not None
        assert redis_cmd(redis, "GET", f"{PREFIX}acme:lock:{host}") is None
    finally:
        for inst in instances:
            inst.stop()
        pebble.stop()
