"""Black-box harness for several `pact-ingress serve` instances and one `connect`.

Each instance is its own process on its own loopback address (127.0.0.2, 127.0.0.3…),
with its own identity key and state directory, all on one TLS port; the tenant `family`
has a passthrough route (`PT_HOST`) and a terminate route (`TM_HOST`), both `backend:
tunnel`. The home side is one `pact-ingress connect` process forwarding to a
`RecordingNode` (HTTP/1.1 over TLS with the node's key). `request(instance, host)` makes
one HTTPS GET through an instance and returns the status code, or None when the
connection failed (no tunnel: alert, reset). Every wait is bounded; loopback only.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

from pact_ingress.admin.client import fetch_status
from pact_ingress.identity import Identity, keygen
from pact_ingress.model import Address
from tests.netutil import START_WAIT, wait_told
from tests.terminate_env import RecordingNode, free_port

TUNNEL_HOST = "tunnel.cluster.test"
PT_HOST = "pt.cluster.test"
TM_HOST = "tm.cluster.test"
WAIT = 30.0


def serve_until_ready(directory: Path, config: Path, args: Iterable[str], log: IO[bytes],
                      wait: float = START_WAIT) -> tuple[subprocess.Popen[bytes], bool]:
    """`pact-ingress serve -c config *args`, its output to `log`; returned with whether it
    said READY=1 on its notify socket (in `directory`) within `wait` seconds."""
    notify_path = directory / "notify.sock"
    with contextlib.suppress(FileNotFoundError):
        notify_path.unlink()
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(notify_path))
    env = dict(os.environ, NOTIFY_SOCKET=str(notify_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pact_ingress", "serve", "-c", str(config), *args],
        stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        return proc, wait_told(notify, "READY=1", proc, wait)[0]
    finally:
        notify.close()

class Instance:
    """One `serve` process; `start()` waits for READY, `kill()` is kill -9."""

    def __init__(self, tmp: Path, address: str, port: int, node_fp: str, *,
                 extra: str = "", args: tuple[str, ...] = ()) -> None:
        self.args = args
        self.dir = tmp / address
        self.dir.mkdir(exist_ok=True)
        self.address = address
        self.port = port
        self.admin = Address("127.0.0.1", free_port())
        self.identity = keygen(self.dir / "ingress.key", common_name=f"ingress {address}")
        self.config = self.dir / "ingress.yaml"
        self.config.write_text(f"""\
identity: {{key: ingress.key}}
state_dir: state
listen:
  tls: ["{Address(address, port)}"]
  admin: "{self.admin}"
tunnel: {{hostname: {TUNNEL_HOST}}}
{extra}tenants:
  - name: family
    pins: ["{node_fp}"]
    routes:
      - host: {PT_HOST}
        mode: passthrough
        backend: tunnel
      - host: {TM_HOST}
        mode: terminate
        backend: tunnel
        cert: {{cert: certs/tm.crt, key: certs/tm.key}}
""")
        self.log_path = self.dir / "serve.log"
        self._log = open(self.log_path, "ab")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Instance:
        self.proc, ready = serve_until_ready(self.dir, self.config, self.args, self._log)
        if ready:
            return self
        self.kill()
        raise AssertionError(f"serve on {self.address} not READY:\n{self.logs()[-3000:]}")

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

    def status(self) -> dict[str, Any]:
        return fetch_status(self.admin, timeout=5)

    def tunnels_up(self) -> int:
        try:
            doc = self.status()
        except Exception:
            return 0
        return sum(t["tunnels_up"] for t in doc["tenants"] if t["name"] == "family")


class Connect:
    """One `connect` process towards `addresses`, accepting `pins`."""

    def __init__(self, tmp: Path, node: Identity, node_port: int, addresses: list[str],
                 pins: list[str], connections: int = 1, forward_host: str = "127.0.0.1"
                 ) -> None:
        self.config = tmp / "connector.yaml"
        listed = ", ".join(f'"{a}"' for a in addresses)
        pinned = ", ".join(f'"{p}"' for p in pins)
        self.config.write_text(f"""\
identity: {{key: {node.key_path}}}
ingress:
  address: [{listed}]
  tunnel_hostname: {TUNNEL_HOST}
  pin: [{pinned}]
forward: "{Address(forward_host, node_port)}"
connections: {connections}
""")
        self.log_path = tmp / "connector.log"
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "connect", "-c", str(self.config)],
            stdout=self._log, stderr=subprocess.STDOUT)

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self._log.close()


def close_all(connect: Connect | None, instances: Iterable[Instance]) -> None:
    """Teardown: the home node's `connect` (if it was started), then every instance."""
    if connect is not None:
        connect.close()
    for instance in instances:
        instance.close()


def request(instance: Instance, host: str, timeout: float = 10.0) -> int | None:
    """One GET through `instance` for `host`: the status code, or None if the connection
    failed before a response (no tunnel: TLS alert or reset)."""
    return get_status(instance.address, instance.port, host, timeout=timeout)


def get_status(address: str, port: int, host: str, *, source: str | None = None,
               path: str = "/ping", timeout: float = 10.0) -> int | None:
    """One `GET path` with SNI and Host `host` (from `source` if given): the status code,
    or None if the connection failed before a response (TLS alert or reset)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    bind = None if source is None else (source, 0)
    try:
        with socket.create_connection((address, port), timeout=timeout,
                                      source_address=bind) as raw, \
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


def wait_for(check: Any, what: str, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def home_node(tmp: Path) -> RecordingNode:
    return RecordingNode(keygen(tmp / "node.key", common_name="node"))
