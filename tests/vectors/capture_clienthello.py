#!/usr/bin/env python3
"""Capture real ClientHellos as golden vectors for tests/test_clienthello.py.

Each client below is pointed at a loopback TCP listener that is *not* a TLS server: it
accepts one connection, reads until the first handshake message (the ClientHello) is
complete, saves the exact bytes received up to that point, and hangs up. The client then
fails its handshake, which is expected.

The completeness check here is deliberately independent of pact_ingress's parser (record
headers and the 4-byte handshake header only), so the vectors do not inherit its bugs.
Expected SNI/ALPN come from what we told each client to send, never from our parser.

Run from the repository root (needs the clients installed: curl, openssl, gnutls-bin,
chromium; missing ones are skipped):

    python tests/vectors/capture_clienthello.py            # all clients
    python tests/vectors/capture_clienthello.py chromium   # only some

Outputs tests/vectors/clienthello/NAME.bin and updates vectors.json there (expected sni,
alpn, the command line and client version). Vectors are committed; tests never need the
clients.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

OUT = Path(__file__).resolve().parent / "clienthello"
ACCEPT_TIMEOUT = 60.0  # seconds; chromium can take a while to start headless
READ_TIMEOUT = 10.0  # seconds for the whole hello once connected
MAX_CAPTURE = 64 * 1024  # bytes; far above any hello, stops a runaway capture


@dataclass(frozen=True)
class Client:
    name: str
    binary: str
    sni: str | None  # what the client is told to send, normalised (lower case, no dot)
    alpn: tuple[str, ...]
    argv: Callable[[str, str], list[str]]  # (port, scratch dir) -> argv
    version_argv: tuple[str, ...]
    note: str = ""


PY_CLIENT = """
import socket, ssl, sys
ctx = ssl.create_default_context()
ctx.check_hostname = False
ctx.verify_mode = ssl.CERT_NONE
ctx.set_alpn_protocols(["pact-tunnel/1"])
with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=5) as s:
    try:
        ctx.wrap_socket(s, server_hostname="tunnel.family.example")
    except (OSError, ssl.SSLError):
        pass
"""


def _chromium(port: str, scratch: str) -> list[str]:
    profile = f"{scratch}/chromium-profile"
    return [
        "chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
        "--no-first-run", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", f"--user-data-dir={profile}",
        "--host-resolver-rules=MAP somename.test 127.0.0.1",
        f"https://somename.test:{port}/",
    ]  # fmt: skip


def _openssl(port: str, *extra: str) -> list[str]:
    return ["openssl", "s_client", "-connect", f"127.0.0.1:{port}", *extra]


CLIENTS = [
    Client("curl", "curl", "www.example.test", ("h2", "http/1.1"),
           lambda p, _: ["curl", "-sk", "--max-time", "5", "--resolve",
                      f"www.example.test:{p}:127.0.0.1", f"https://www.example.test:{p}/"],
           ("curl", "--version")),
    Client("openssl_sni", "openssl", "alina.family.example", (),
           lambda p, _: _openssl(p, "-servername", "alina.family.example"),
           ("openssl", "version")),
    Client("openssl_nosni", "openssl", None, (),
           lambda p, _: _openssl(p, "-noservername"), ("openssl", "version")),
    Client("openssl_tls12_alpn", "openssl", "mcp.alina.family.example", ("acme-tls/1",),
           lambda p, _: _openssl(p, "-tls1_2", "-servername", "mcp.alina.family.example",
                              "-alpn", "acme-tls/1"),
           ("openssl", "version"), "TLS 1.2 only: no supported_versions extension"),
    Client("openssl_upper_dot", "openssl", "upper.example.test", ("h2", "http/1.1"),
           lambda p, _: _openssl(p, "-servername", "Upper.Example.TEST.", "-alpn", "h2,http/1.1"),
           ("openssl", "version"), "SNI sent as 'Upper.Example.TEST.'"),
    Client("gnutls", "gnutls-cli", "gnutls.example.test", ("h2", "http/1.1"),
           lambda p, _: ["gnutls-cli", "--insecure", "--sni-hostname=gnutls.example.test",
                      "--alpn=h2", "--alpn=http/1.1", "-p", str(p), "127.0.0.1"],
           ("gnutls-cli", "--version")),
    Client("python_ssl", sys.executable, "tunnel.family.example", ("pact-tunnel/1",),
           lambda p, _: [sys.executable, "-c", PY_CLIENT, p],
           (sys.executable, "-c", "import ssl; print(ssl.OPENSSL_VERSION)")),
    Client("chromium", "chromium", "somename.test", ("h2", "http/1.1"), _chromium,
           ("chromium", "--version"), "X25519MLKEM768 key share; GREASE values"),
]  # fmt: skip


def hello_complete(buf: bytes) -> bool:
    """True once handshake records in `buf` carry a full handshake message."""
    payload = b""
    pos = 0
    while len(buf) - pos >= 5 and buf[pos] == 22:
        length = int.from_bytes(buf[pos + 3 : pos + 5], "big")
        payload += buf[pos + 5 : pos + 5 + length]
        if len(payload) >= 4 and len(payload) >= 4 + int.from_bytes(payload[1:4], "big"):
            return True
        pos += 5 + length
    return False


def capture(listener: socket.socket, client: Client) -> bytes:
    port = str(listener.getsockname()[1])
    with tempfile.TemporaryDirectory(prefix="capture-") as scratch:
        return _capture_with(listener, client, client.argv(port, scratch))


def _capture_with(listener: socket.socket, client: Client, argv: list[str]) -> bytes:
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        listener.settimeout(ACCEPT_TIMEOUT)
        conn, _ = listener.accept()
        with conn:
            buf = b""
            deadline = time.monotonic() + READ_TIMEOUT
            while not hello_complete(buf) and len(buf) < MAX_CAPTURE:
                conn.settimeout(max(0.1, deadline - time.monotonic()))
                chunk = conn.recv(65536)
                if not chunk:
                    raise RuntimeError(f"{client.name}: closed after {len(buf)} bytes")
                buf += chunk
            return buf
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def client_version(client: Client) -> str:
    out = subprocess.run(
        client.version_argv, capture_output=True, text=True, timeout=30, check=False
    )
    lines = (out.stdout or out.stderr).strip().splitlines()
    return lines[0] if lines else "?"


def _shown_command(client: Client) -> str:
    argv = client.argv("PORT", "TMP")
    shown = ["<PY_CLIENT>" if a == PY_CLIENT else a for a in argv]
    return " ".join("python" if a == sys.executable else a for a in shown)


def main(only: list[str]) -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    index_path = OUT / "vectors.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    for client in CLIENTS:
        if only and client.name not in only:
            continue
        if shutil.which(client.binary) is None:
            print(f"skip {client.name}: {client.binary} not installed")
            continue
        with socket.create_server(("127.0.0.1", 0)) as listener:
            data = capture(listener, client)
        (OUT / f"{client.name}.bin").write_bytes(data)
        index[f"{client.name}.bin"] = {
            "client": client_version(client),
            "command": _shown_command(client),
            "sni": client.sni,
            "alpn": list(client.alpn),
            "note": client.note,
        }
        print(f"{client.name}: {len(data)} bytes")
    index_path.write_text(json.dumps(dict(sorted(index.items())), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
