"""Two `pact-ingress serve` processes (127.0.0.2 and 127.0.0.3) sharing one real
redis-server, seen from outside: a client alternating between them gets one budget, not
two; with Redis stopped both still answer (each counting alone) and say so on /status;
with Redis back they share again."""

from __future__ import annotations

import base64
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from pact_ingress.admin.client import fetch_status
from pact_ingress.admin.schema import STATUS_SCHEMA
from pact_ingress.model import Address
from tests.redis_server import RedisServer, free_port

HOST = "api.example.test"
INSTANCES = ("127.0.0.2", "127.0.0.3")
#: Route budget: 10 calls/hour per IP → a burst of 5, then one call per 6 minutes.
PER_IP = 10
BURST = 5
WAIT = 20.0


class Instance:
    def __init__(self, tmp: Path, address: str, tls_port: int, redis_url: str, key: Path,
                 closed_port: int) -> None:
        self.dir = tmp / address
        self.dir.mkdir()
        self.address = address
        self.tls_port = tls_port
        self.admin = Address("127.0.0.1", free_port())
        config = self.dir / "ingress.yaml"
        config.write_text(f"""\
state_dir: ./state
listen:
  tls: ["{address}:{tls_port}"]
  admin: "{self.admin}"
state:
  backend: redis
  url: {redis_url}
  encryption_key_file: {key}
  deadline: 500ms  # a loaded test machine must not turn into a fallback
tenants:
  - name: family
    pins: ["sha256:{'A' * 43}"]
    routes:
      - host: {HOST}
        mode: terminate
        backend: 127.0.0.1:{closed_port}
        cert: {{cert: ./cert.pem, key: ./cert.key}}
        limits: {{calls_per_hour_per_ip: {PER_IP}}}
""")
        self.log = open(self.dir / "serve.log", "w+b")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "serve", "-c", str(config)],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                fetch_status(self.admin, timeout=1)
                socket.create_connection((address, tls_port), timeout=1).close()
                return
            except Exception:
                assert self.proc.poll() is None, self.logs()
                time.sleep(0.05)
        raise AssertionError(f"serve on {address} did not start:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        return (self.dir / "serve.log").read_text()

    def events(self, prefix: str) -> list[str]:
        out = []
        for line in self.logs().splitlines():
            try:
                event = json.loads(line).get("event", "")
            except ValueError:
                continue
            if event.startswith(prefix):
                out.append(event)
        return out

    def state(self) -> dict:
        doc = fetch_status(self.admin)
        jsonschema.validate(doc, STATUS_SCHEMA)
        return doc["state"]

    def wait_mode(self, mode: str) -> None:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            doc = fetch_status(self.admin)
            jsonschema.validate(doc, STATUS_SCHEMA)
            if doc["state"]["mode"] == mode:
                # "shared" is the instance's word only when every worker says it too
                if mode == "shared":
                    assert all(w.get("state_mode") == "shared" for w in doc.get("workers", [])
                               if w["state"] == "ready"), doc["workers"]
                return
            time.sleep(0.05)
        raise AssertionError(f"{self.address} never {mode}: {self.state()}\n{self.logs()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def get(instance: Instance, client_ip: str) -> int:
    """One HTTPS request from `client_ip`; its status code (a TLS or socket error fails)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    context.set_alpn_protocols(["http/1.1"])
    raw = socket.create_connection((instance.address, instance.tls_port), timeout=WAIT,
                                   source_address=(client_ip, 0))
    with context.wrap_socket(raw, server_hostname=HOST) as tls:
        tls.sendall(f"GET / HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        head = b""
        while b"\r\n" not in head:
            chunk = tls.recv(4096)
            assert chunk, "connection closed without an answer"
            head += chunk
    return int(head.split(b" ", 2)[1])


def alternate(instances: list[Instance], client_ip: str, n: int) -> list[int]:
    return [get(instances[i % len(instances)], client_ip) for i in range(n)]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[RedisServer, list[Instance]]]:
    redis = RedisServer(tmp_path / "redis")
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    port, closed = free_port(), free_port()  # nothing listens on `closed`: node offline
    instances: list[Instance] = []
    try:
        for address in INSTANCES:
            instances.append(Instance(tmp_path, address, port, redis.url, key, closed))
        for instance in instances:
            instance.wait_mode("shared")
        yield redis, instances
    finally:
        for instance in instances:
            instance.stop()
        redis.stop()


@pytest.mark.slow
def test_one_budget_across_instances_and_redis_faults(
    cluster: tuple[RedisServer, list[Instance]],
) -> None:
    redis, instances = cluster
    # shared: the burst is spent once across both (503: charged, the node is offline)
    statuses = alternate(instances, "127.0.0.9", 4 * BURST)
    assert statuses.count(429) == 3 * BURST, statuses
    assert set(statuses[:BURST]) == {503} and set(statuses[BURST:]) == {429}

    # Redis gone: every request is still answered, each instance counts alone
    redis.stop()
    statuses = alternate(instances, "127.0.0.10", 4 * BURST)
    for instance in instances:
        instance.wait_mode("fallback")
        assert instance.state()["last_error"]
    assert statuses.count(429) == 2 * BURST, statuses  # two budgets now, one per instance
    statuses = alternate(instances, "127.0.0.11", 4 * BURST)
    assert statuses.count(429) == 2 * BURST, statuses

    # Redis back (empty: no persistence): both rejoin and share one budget again
    redis.start()
    for instance in instances:
        instance.wait_mode("shared")
    statuses = alternate(instances, "127.0.0.12", 4 * BURST)
    assert statuses.count(429) == 3 * BURST, statuses

    for instance in instances:  # one line per switch, no tracebacks
        assert instance.events("state_backend_") == [
            "state_backend_connecting", "state_backend_shared", "state_backend_lost",
            "state_backend_shared"], instance.logs()
        assert "Traceback" not in instance.logs()
