"""Shared helpers for end-to-end tests over loopback: configs, TLS backends, clients.

Everything here runs real sockets on 127.0.0.1 and real TLS; nothing is mocked.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
import ssl
import subprocess
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

import trio

from pact_ingress.config import Address, Backend, Config, Limits, Listen, Route, Tenant
from pact_ingress.identity import Identity, fingerprint_of_cert_der

#: How long a `serve` may take to say READY: a start-up loads modules and spawns worker
#: processes, which a busy machine slows far more than it slows a request. A bound on a
#: wait, not a target.
START_WAIT = 60.0

#: Bounded waits in tests: anything slower than this is a failure, not a hang.
TEST_TIMEOUT = 20.0


def route(host: str, tenant: str, port: int | None, *, mode: str = "passthrough",
          **kw: object) -> Route:
    backend = Backend(None) if port is None else Backend(Address("127.0.0.1", port))
    return Route(host=host, tenant=tenant, mode=mode, backend=backend, **kw)  # type: ignore[arg-type]


def make_config(tmp: Path, routes: Iterable[Route], *, limits: Limits | None = None,
                pins: dict[str, tuple[str, ...]] | None = None,
                tunnel_hostname: str | None = None) -> Config:
    routes = list(routes)
    limits = limits or Limits()
    routes = [replace(r, limits=limits) for r in routes]
    names = dict.fromkeys(r.tenant for r in routes)
    pins = pins or {}
    fake_pin = "sha256:" + "A" * 43
    tenants = tuple(
        Tenant(name=n, pins=pins.get(n, (fake_pin,)),
               routes=tuple(r for r in routes if r.tenant == n))
        for n in names
    )
    return Config(
        path=tmp / "ingress.yaml", identity_key=tmp / "ingress.key", state_dir=tmp / "state",
        listen=Listen(tls=(Address("127.0.0.1", 0),)), tunnel_hostname=tunnel_hostname,
        acme=None, limits=limits, tenants=tenants,
    )


def server_context(ident: Identity, *, client_ca: Iterable[Identity] = (),
                   alpn: Iterable[str] = ()) -> ssl.SSLContext:
    """A stdlib TLS server context. With `client_ca`, client certs are required and each
    listed identity's self-signed cert is trusted as its own anchor: stdlib `ssl` cannot
    accept an arbitrary self-signed client cert, but it can trust the ones it is told."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(ident.cert_path, ident.key_path)
    cas = list(client_ca)
    if cas:
        ctx.verify_mode = ssl.CERT_REQUIRED
        for ca in cas:
            ctx.load_verify_locations(cafile=str(ca.cert_path))
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    return ctx


def client_context(ident: Identity | None = None, alpn: Iterable[str] = ()) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if ident is not None:
        ctx.load_cert_chain(ident.cert_path, ident.key_path)
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    return ctx


@dataclass
class TlsWhoAmI:
    """A TLS HTTP/1.1 backend that answers every request with the client-cert fingerprint
    it saw (or "none") and its own name. Records what it saw in `seen`."""

    ident: Identity
    ctx: ssl.SSLContext
    name: str
    port: int = 0
    seen: list[str | None] = field(default_factory=list)

    async def serve(self, *, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED
                    ) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        task_status.started(self.port)
        await trio.serve_listeners(self._handle, listeners)

    async def _handle(self, tcp: trio.SocketStream) -> None:
        tls = trio.SSLStream(tcp, self.ctx, server_side=True)
        try:
            with trio.fail_after(TEST_TIMEOUT):
                await tls.do_handshake()
                der = tls.getpeercert(binary_form=True)
                fp = fingerprint_of_cert_der(der) if der else None
                self.seen.append(fp)
                buf = b""
                while b"\r\n\r\n" not in buf:
                    chunk = await tls.receive_some(65536)
                    if not chunk:
                        return
                    buf += chunk
                body = f"{self.name} {fp or 'none'}".encode()
                await tls.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n"
                                   b"Connection: close\r\n\r\n%s" % (len(body), body))
                await tls.aclose()
        except (trio.BrokenResourceError, ssl.SSLError, OSError):
            pass
        finally:
            await trio.aclose_forcefully(tcp)


async def https_get(port: int, host: str, ident: Identity | None = None, *,
                    local_address: str | None = None) -> tuple[str, str]:
    """GET / through the ingress with SNI `host` (from `local_address`, another loopback
    address = another client); returns (body, server fingerprint)."""
    with trio.fail_after(TEST_TIMEOUT):
        tcp = await trio.open_tcp_stream("127.0.0.1", port, local_address=local_address)
        tls = trio.SSLStream(tcp, client_context(ident), server_hostname=host)
        await tls.do_handshake()
        server_fp = fingerprint_of_cert_der(tls.getpeercert(binary_form=True))
        await tls.send_all(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = b""
        while True:
            try:
                chunk = await tls.receive_some(65536)
            except trio.BrokenResourceError:
                break
            if not chunk:
                break
            data += chunk
        await trio.aclose_forcefully(tls)
    return data.split(b"\r\n\r\n", 1)[1].decode(), server_fp


def sha256_stream(seed: bytes, size: int, chunk: int = 1 << 20) -> Iterable[bytes]:
    """Deterministic pseudo-random bytes (SHA-256 counter mode, expanded for speed)."""
    block = hashlib.sha256(seed).digest() * (chunk // 32)
    sent = 0
    i = 0
    while sent < size:
        piece = block[: min(chunk, size - sent)]
        # vary each chunk so reordering would be detected
        piece = i.to_bytes(8, "big") + piece[8:] if len(piece) >= 8 else piece
        yield piece
        sent += len(piece)
        i += 1


def _listen_ports() -> range:
    """Where tests pick ports to listen on: below the kernel's ephemeral range, from which
    every outgoing connection's local end is taken — a port picked there could be taken
    by some test's client connection between the pick and the server's bind."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports = range(max(1024, low - 16384), low) if low > 2048 else range(49152, 65536)
    return _share(ports)


def _share(ports: range) -> range:
    """The part of `ports` this test process picks from. The suite runs in several
    processes (pytest-xdist), each remembering only the ports it handed out itself; a
    port another process picked, whose server binds it minutes later (a module's
    servers, started once), was free for this one to pick and bind meanwhile. Each
    process takes a block of its own (a block, so that consecutive ports stay within
    one process's share): no port is offered to two of them."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not worker[2:].isdigit() or not count.isdigit():
        return ports
    n = max(1, int(count))
    k = int(worker[2:]) % n
    size = len(ports) // n
    return ports[k * size:(k + 1) * size]


LISTEN_PORTS = _listen_ports()
#: Ports this process handed out already: free a moment ago is not free for a second
#: caller that asks before the first binds (a config's TLS and admin ports, picked one
#: after the other, came out equal about once in a few thousand picks).
_HANDED: set[int] = set()


def free_port_on(*addresses: str, udp: bool = False) -> int:
    """A TCP (and with `udp` also UDP) port free on every one of `addresses` right now,
    picked at random outside the ephemeral range (a port free on 127.0.0.1 may still be
    held on 127.0.0.2, so every address is tried), never one handed out before."""
    addresses = addresses or ("127.0.0.1",)
    kinds = (socket.SOCK_STREAM, socket.SOCK_DGRAM) if udp else (socket.SOCK_STREAM,)
    if len(_HANDED) > len(LISTEN_PORTS) // 2:  # bounded: the oldest are long bound or gone
        _HANDED.clear()
    for _ in range(200):  # bounded
        port = random.choice(LISTEN_PORTS)
        if port in _HANDED:
            continue
        try:
            for address in addresses:
                for kind in kinds:
                    family = socket.AF_INET6 if ":" in address else socket.AF_INET
                    with socket.socket(family, kind) as s:
                        s.bind((address, port))
        except OSError:
            continue
        _HANDED.add(port)
        return port
    raise RuntimeError(f"no port free on all of {addresses}")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (see `free_port_on`)."""
    return free_port_on(host)


def wait_told(notify: socket.socket, wanted: str, proc: subprocess.Popen[bytes],
              timeout: float) -> tuple[bool, list[str]]:
    """Messages a process sends to its sd_notify socket, until one holds the line
    `wanted` (True), the process has exited (a config it refused: no use waiting on), or
    `timeout` passed (False); with the messages seen."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        notify.settimeout(min(0.25, max(0.05, deadline - time.monotonic())))
        try:
            msg = notify.recv(4096).decode()
        except TimeoutError:
            if proc.poll() is not None:
                break
            continue
        seen.append(msg)
        if wanted in msg.split("\n"):
            return True, seen
    return False, seen


def limited(nofile: int | None) -> list[str]:
    """The command prefix that runs a command under RLIMIT_NOFILE `nofile` (prlimit(1)
    execs it: the pid stays the command's; not preexec_fn, unsafe in a threaded test)."""
    return [] if nofile is None else ["prlimit", f"--nofile={nofile}:{nofile}", "--"]


def bio_handshake(sock: socket.socket, tls: ssl.SSLObject, incoming: ssl.MemoryBIO,
                  outgoing: ssl.MemoryBIO) -> bool:
    """A memory-BIO TLS handshake (either side) over a blocking socket; False when the
    peer closed first. What the last flight left in `outgoing` is the caller's to send
    (a test that wants it in one write with what follows sends them together)."""
    while True:
        try:
            tls.do_handshake()
            return True
        except ssl.SSLWantReadError:
            sock.sendall(outgoing.read())
            data = sock.recv(65536)
            if not data:
                return False
            incoming.write(data)
