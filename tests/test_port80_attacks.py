"""Hostile clients against the public ACME surfaces of a real `pact-ingress serve`.

One `serve` process on loopback (module fixture) with a terminate route ordered from a
real pebble over HTTP-01, a passthrough route, the :80 listener, :443 and the admin
endpoint. Pebble's HTTP-01 validation goes through a small gate in this process on its
way to :80: while the CA's request is in the gate the challenge is certainly pending,
so the gate aims its own requests at the pending token (right and wrong hosts, wrong
methods, near-miss tokens) before it lets the CA's request through. A second gate does
the same on pebble's way to :443 once a reload switches the order to TLS-ALPN-01.
Renewals are forced through the admin endpoint while both ports are flooded.

Each attack asserts a defined answer (a status, a close or a TLS alert) within the
listener's documented deadline, no header injection, a redirect only to the name asked for; the
module's last test asserts the process logged no traceback and holds no more sockets
than before the attacks.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import ssl
import struct
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

import pytest
from cryptography import x509

from pact_ingress.acme.tlsalpn import ACME_IDENTIFIER_OID
from pact_ingress.admin.client import fetch_status, request
from pact_ingress.config import Address
from pact_ingress.identity import keygen
from pact_ingress.net.http_listener import MAX_CONNECTIONS, MAX_HEAD_BYTES, REQUEST_TIMEOUT
from tests.acme_servers import ChallTestSrv, Pebble
from tests.cluster_env import serve_until_ready
from tests.netutil import free_port
from tests.terminate_env import json_events

ACME_HOST = "acme.pact.test"  # terminate, cert: acme (HTTP-01 through the gate)
PASS_HOST = "pass.pact.test"  # passthrough to a closed port
PREFIX = "/.well-known/acme-challenge/"
#: Longest any single exchange may take before we call it a hang: the listener's own
#: deadline plus slack for a loaded 2-core machine.
HANG = REQUEST_TIMEOUT + 5.0
WAIT = 30.0
#: The only header names the :80 listener ever sends.
ALLOWED_HEADERS = {"content-type", "content-length", "connection", "location", "allow"}
ATTACKER = "127.0.0.2"
ATTACKER_TLS = "127.0.0.3"
BYSTANDER = "127.0.0.1"
SLOW = "127.0.0.4"
#: The :443 ClientHello deadline the served config sets (half-done handshakes end by it).
HELLO_TIMEOUT = 4
ALERT_NO_APP_PROTO, ALERT_UNRECOGNIZED_NAME, ALERT_INTERNAL = 120, 112, 80


# ------------------------------------------------------------------------------ raw I/O
@dataclass
class Reply:
    raw: bytes
    reset: bool = False

    @property
    def status(self) -> int | None:
        m = re.match(rb"HTTP/1\.1 (\d{3}) ", self.raw)
        return int(m[1]) if m else None

    def head_and_body(self) -> tuple[list[tuple[str, str]], bytes]:
        head, _, body = self.raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")[1:]
        headers = []
        for line in lines:
            name, sep, value = line.partition(b":")
            assert sep, f"malformed header line {line!r}"
            headers.append((name.decode("ascii").lower(), value.strip().decode("ascii")))
        return headers, body

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.head_and_body()[0] if k == name), None)


def check_well_formed(reply: Reply) -> None:
    """Exactly one answer, only our own header names, no stray CR/LF, body as long as
    Content-Length says (HEAD aside: callers check that)."""
    headers, body = reply.head_and_body()
    assert {k for k, _ in headers} <= ALLOWED_HEADERS, headers
    assert len([k for k, _ in headers if k == "location"]) <= 1
    for _, v in headers:
        assert "\r" not in v and "\n" not in v and "\x00" not in v
    length = int(dict(headers)["content-length"])
    assert len(body) == length, "a second answer or extra bytes after the first"


def connect(port: int, src: str = BYSTANDER, timeout: float = HANG) -> socket.socket:
    s = socket.socket()
    s.settimeout(timeout)
    s.bind((src, 0))
    s.connect(("127.0.0.1", port))
    return s


def read_all(s: socket.socket) -> Reply:
    """Everything until the server closes; a reset is a close too. A timeout (the server
    kept the connection past its deadline) fails the test."""
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return Reply(out, reset=True)
        except TimeoutError:
            raise AssertionError(f"no close within {HANG} s; got {out[:200]!r}") from None
        if not chunk:
            return Reply(out)
        out += chunk


def http80(port: int, raw: bytes, *, src: str = BYSTANDER) -> Reply:
    with connect(port, src) as s:
        try:
            s.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # it may close before taking all of a large request; still read
        return read_all(s)


def get(port: int, target: str, host: str | None, *, method: str = "GET",
        version: str = "HTTP/1.1", extra: bytes = b"", src: str = BYSTANDER) -> Reply:
    head = f"{method} {target} {version}\r\n".encode("latin-1")
    if host is not None:
        head += f"Host: {host}\r\n".encode("latin-1")
    return http80(port, head + extra + b"\r\n", src=src)


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# ------------------------------------------------------------------------------ the gate
class _Listening:
    """A loopback listener on `self.port` serving each connection in a thread of its own
    (`_one`) until `stop`."""

    port: int

    def start(self) -> Self:
        self.sock = socket.create_server(("127.0.0.1", self.port))
        self.sock.settimeout(0.2)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.sock.close()

    def _run(self) -> None:
        while not self.stopping.is_set():
            try:
                c, _ = self.sock.accept()
            except TimeoutError:
                continue
            threading.Thread(target=self._one, args=(c,), daemon=True).start()

    def _one(self, c: socket.socket) -> None:
        raise NotImplementedError


@dataclass
class Gate(_Listening):
    """Pebble's HTTP-01 port: each validation request is read whole, handed to `probe`
    (the challenge is pending then), and only then forwarded to the real :80."""

    target_port: int
    port: int = field(default_factory=free_port)
    seen: list[tuple[str, str]] = field(default_factory=list)  # (host, token)
    probes: list[tuple[str, str, dict[str, object]]] = field(default_factory=list)
    probe: Callable[[str, str], dict[str, object]] | None = None
    answered: list[int | None] = field(default_factory=list)

    def _one(self, c: socket.socket) -> None:
        with c:
            c.settimeout(WAIT)
            head = b""
            while b"\r\n\r\n" not in head and len(head) < 16384:
                chunk = c.recv(4096)
                if not chunk:
                    return
                head += chunk
            target = head.split(b" ")[1].decode()
            found = re.search(rb"\r\nHost: ([^\r:]+)", head, re.IGNORECASE)
            assert found is not None, head
            host = found[1].decode()
            token = target.removeprefix(PREFIX)
            self.seen.append((host, token))
            if self.probe is not None:
                try:
                    got = self.probe(host, token)
                except Exception as exc:  # noqa: BLE001 - reported by the test, CA still served
                    got = {"error": repr(exc)}
                self.probes.append((host, token, got))
            reply = http80(self.target_port, head)
            self.answered.append(reply.status)
            c.sendall(reply.raw)


@dataclass
class TlsGate(_Listening):
    """Pebble's TLS-ALPN-01 port: on each validation connection `probe()` runs first (the
    challenge is pending then), then the CA's bytes are piped to the real :443."""

    target_port: int
    port: int = field(default_factory=free_port)
    probes: list[dict[str, object]] = field(default_factory=list)
    probe: Callable[[], dict[str, object]] | None = None

    def _one(self, c: socket.socket) -> None:
        if self.probe is not None:
            try:
                got = self.probe()
            except Exception as exc:  # noqa: BLE001 - reported by the test, CA still served
                got = {"error": repr(exc)}
            self.probes.append(got)
        with c, socket.create_connection(("127.0.0.1", self.target_port), timeout=WAIT) as up:
            c.settimeout(WAIT)
            back = threading.Thread(target=_pipe, args=(up, c), daemon=True)
            back.start()
            _pipe(c, up)
            back.join(WAIT)


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(65536):
            dst.sendall(data)
        dst.shutdown(socket.SHUT_WR)


# ------------------------------------------------------------------------------ the edge
@dataclass
class Edge:
    tmp: Path
    pebble: Pebble
    gate: Gate
    tls_gate: TlsGate
    config: Path
    http_port: int
    tls_port: int
    admin_port: int
    proc: object = None
    baseline: int = 0  # the serve process's fds once it has its first certificate

    @property
    def pid(self) -> int:
        return self.proc.pid  # type: ignore[attr-defined]

    @property
    def log_text(self) -> str:
        return (self.tmp / "serve.log").read_text(errors="replace")

    def events(self, name: str) -> list[dict[str, object]]:
        return [e for e in json_events(self.log_text) if e.get("event") == name]

    def admin(self) -> Address:
        return Address("127.0.0.1", self.admin_port)


def pending_probe(edge_http: int) -> Callable[[str, str], dict[str, object]]:
    """What the gate checks while a token is pending (returns name → status/body)."""

    def probe(host: str, token: str) -> dict[str, object]:
        p = PREFIX + token
        out: dict[str, object] = {}
        ok = get(edge_http, p, host)
        assert ok.status is not None, ok
        check_well_formed(ok)
        out["exact"] = (ok.status, ok.head_and_body()[1])
        out["upper_host"] = get(edge_http, p, host.upper()).status
        out["host_port"] = get(edge_http, p, host + ":80").status
        out["trailing_dot"] = get(edge_http, p, host + ".").status
        head = get(edge_http, p, host, method="HEAD")
        out["head"] = (head.status, head.head_and_body()[1])
        out["post"] = get(edge_http, p, host, method="POST",
                          extra=b"Content-Length: 0\r\n").status
        out["other_host"] = get(edge_http, p, "other.pact.test").status
        out["passthrough_host"] = get(edge_http, p, PASS_HOST).status
        out["no_host_http10"] = get(edge_http, p, None, version="HTTP/1.0").status
        out["userinfo_host"] = get(edge_http, p, "x@" + host).status
        out["token_plus"] = get(edge_http, p + "A", host).status
        out["token_minus"] = get(edge_http, p[:-1], host).status
        out["token_query"] = get(edge_http, p + "?x=1", host).status
        out["token_slash"] = get(edge_http, p + "/", host).status
        out["token_dotdot"] = get(edge_http, PREFIX + "../" + PREFIX.strip("/") + "/" + token,
                                  host).status
        pct = PREFIX + "".join(f"%{ord(ch):02X}" for ch in token[:2]) + token[2:]
        out["token_percent"] = get(edge_http, pct, host).status
        out["token_lower"] = get(edge_http, PREFIX + token.swapcase(), host).status
        dup = get(edge_http, p, host, extra=b"Host: other.pact.test\r\n")
        out["duplicate_host"] = dup.status
        dup2 = get(edge_http, p, "other.pact.test", extra=f"Host: {host}\r\n".encode())
        out["duplicate_host_swapped"] = dup2.status
        absolute = get(edge_http, f"http://{host}{p}", "other.pact.test")
        out["absolute_form_other_host"] = (absolute.status, absolute.head_and_body()[1])
        return out

    return probe


def alpn_handshake(port: int, sni: str, alpn: list[str]) -> tuple[str | None, x509.Certificate]:
    """(negotiated ALPN, certificate) of a full handshake that verifies nothing."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(alpn)
    with connect(port, timeout=5) as s, ctx.wrap_socket(s, server_hostname=sni) as t:
        der = t.getpeercert(binary_form=True)
        assert der is not None
        return t.selected_alpn_protocol(), x509.load_der_x509_certificate(der)


def is_challenge_cert(cert: x509.Certificate, host: str) -> bool:
    try:
        ext = cert.extensions.get_extension_for_oid(ACME_IDENTIFIER_OID)
    except x509.ExtensionNotFound:
        return False
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return ext.critical and san.get_values_for_type(x509.DNSName) == [host]


def pending_alpn_probe(tls_port: int) -> Callable[[], dict[str, object]]:
    """What the TLS gate checks while a TLS-ALPN-01 challenge is pending."""

    def answer(sni: str, alpn: list[str]) -> object:
        try:
            proto, cert = alpn_handshake(tls_port, sni, alpn)
        except (ssl.SSLError, OSError) as exc:
            return ("refused", type(exc).__name__)
        return (proto, is_challenge_cert(cert, ACME_HOST))

    def probe() -> dict[str, object]:
        return {
            "exact": answer(ACME_HOST, ["acme-tls/1"]),
            "mixed": answer(ACME_HOST, ["h2", "acme-tls/1"]),
            "upper_sni": answer(ACME_HOST.upper(), ["acme-tls/1"]),
            "plain_h2": answer(ACME_HOST, ["h2"]),
            "passthrough": tls_answer(tls_port, py_hello(PASS_HOST, ["acme-tls/1"])),
            "other": tls_answer(tls_port, py_hello("x." + ACME_HOST, ["acme-tls/1"])),
        }

    return probe


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    tmp = tmp_path_factory.mktemp("port80")
    for tool in ("pebble", "pebble-challtestsrv"):  # a missing CA fails, never skips
        assert shutil.which(tool), f"{tool} is not installed (apt-get install pebble)"
    dns = ChallTestSrv(tmp / "challtestsrv").start()
    http_port, tls_port, admin_port = free_port(), free_port(), free_port()
    gate, tls_gate = Gate(http_port), TlsGate(tls_port)
    pebble = Pebble(tmp / "pebble", f"127.0.0.1:{dns.dns_port}", http_port=gate.port,
                    tls_port=tls_gate.port)
    gate.probe = pending_probe(http_port)
    tls_gate.probe = pending_alpn_probe(tls_port)
    gate.start()
    tls_gate.start()
    pebble.start()
    node = keygen(tmp / "node.key")
    cfg = tmp / "ingress.yaml"
    cfg.write_text(f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls_port}"]
  http: ["127.0.0.1:{http_port}"]
  admin: "127.0.0.1:{admin_port}"
{pebble.acme_yaml("http-01")}\
limits:
  clienthello_timeout: {HELLO_TIMEOUT}
tenants:
  - name: t
    pins: ["{node.fingerprint}"]
    routes:
      - {{host: {ACME_HOST}, mode: terminate, backend: "127.0.0.1:9", cert: acme}}
      - {{host: {PASS_HOST}, mode: passthrough, backend: "127.0.0.1:9"}}
""")
    log = open(tmp / "serve.log", "wb")
    proc, ready = serve_until_ready(tmp, cfg, ["--workers", "1"], log)
    e = Edge(tmp, pebble, gate, tls_gate, cfg, http_port, tls_port, admin_port, proc)
    try:
        assert ready, e.log_text[-3000:]
        yield e
    finally:
        proc.terminate()
        try:
            proc.wait(WAIT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()
        gate.stop()
        tls_gate.stop()
        pebble.stop()
        dns.stop()


def served_cert(edge: Edge, *, src: str = BYSTANDER) -> bytes | None:
    """The DER certificate a plain handshake for the ACME host gets, None while none."""
    ctx = ssl.create_default_context(cadata=edge.pebble.root_pem().decode())
    ctx.set_alpn_protocols(["http/1.1"])
    try:
        with connect(edge.tls_port, src, timeout=5) as s, \
                ctx.wrap_socket(s, server_hostname=ACME_HOST) as t:
            return t.getpeercert(binary_form=True)
    except (ssl.SSLError, OSError):
        return None


def wait_served(edge: Edge, not_der: bytes | None = None) -> bytes:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        der = served_cert(edge)
        if der is not None and der != not_der:
            return der
        time.sleep(0.2)
    raise AssertionError("no (new) certificate served: " + edge.log_text[-3000:])


# ------------------------------------------------------------------------------ tests
def test_first_issuance_and_the_pending_token(edge: Edge) -> None:
    """The CA validates through :80; while the token was pending only the exact host and
    token (host case, port and trailing dot aside) got the answer, only by GET/HEAD;
    once issued the token is gone."""
    wait_served(edge)
    time.sleep(0.5)  # the order's last steps (withdrawal, store) end after the swap
    edge.baseline = fd_count(edge.pid)
    assert edge.gate.probes, "pebble never reached :80"
    host, token, got = edge.gate.probes[0]
    assert "error" not in got, got
    assert host == ACME_HOST and re.fullmatch(r"[A-Za-z0-9_-]{16,}", token)
    status, body = got["exact"]  # type: ignore[misc]
    assert status == 200 and body.startswith(token.encode() + b".")  # type: ignore[union-attr]
    assert got["upper_host"] == got["host_port"] == got["trailing_dot"] == 200
    assert got["head"] == (200, b"")
    assert got["post"] == 405
    for name in ("other_host", "passthrough_host", "token_plus", "token_minus",
                 "token_query", "token_slash", "token_dotdot", "token_percent",
                 "token_lower"):
        assert got[name] == 404, name
    assert got["no_host_http10"] == 400
    assert got["userinfo_host"] == 400
    # RFC 9112 §3.2: more than one Host is a 400, whichever comes first
    assert got["duplicate_host"] == got["duplicate_host_swapped"] == 400
    # absolute-form: never the answer for a host the Host header does not name
    assert got["absolute_form_other_host"][0] != 200  # type: ignore[index]
    assert 200 in edge.gate.answered  # the CA itself was answered
    # no longer pending: the same request now is a 404
    after = get(edge.http_port, PREFIX + token, host)
    check_well_formed(after)
    assert after.status == 404


ODD_REQUESTS: list[tuple[str, bytes, set[int | None]]] = [
    # (name, raw request, acceptable statuses; None = closed without an answer)
    ("asterisk", b"OPTIONS * HTTP/1.1\r\nHost: acme.pact.test\r\n\r\n", {308, 400}),
    ("connect", b"CONNECT evil.example:443 HTTP/1.1\r\nHost: evil.example:443\r\n\r\n",
     {308, 400}),
    ("connect_known", b"CONNECT acme.pact.test:443 HTTP/1.1\r\nHost: acme.pact.test\r\n\r\n",
     {308, 400, 405}),
    ("absolute_evil", b"GET http://evil.example/x HTTP/1.1\r\nHost: acme.pact.test\r\n\r\n",
     {308}),
    ("dotdot_token", (b"GET /.well-known/acme-challenge/../../etc/passwd HTTP/1.1\r\n"
                      b"Host: acme.pact.test\r\n\r\n"), {404}),
    ("pct_traversal", (b"GET /.well-known/acme-challenge/%2e%2e%2f%2e%2e%2fetc HTTP/1.1\r\n"
                       b"Host: acme.pact.test\r\n\r\n"), {404}),
    ("overlong_token", b"GET /.well-known/acme-challenge/" + b"A" * 5000 + b" HTTP/1.1\r\n"
     b"Host: acme.pact.test\r\n\r\n", {404}),
    ("nul_in_target", (b"GET /.well-known/acme-challenge/AAAA\x00AAAAAAAAAAAAAAAA HTTP/1.1\r\n"
                       b"Host: acme.pact.test\r\n\r\n"), {400}),
    ("cr_in_target", b"GET /x\rLocation:evil HTTP/1.1\r\nHost: acme.pact.test\r\n\r\n", {400}),
    ("lf_in_target", b"GET /x\nSet-Cookie: a=b HTTP/1.1\r\nHost: acme.pact.test\r\n\r\n",
     {400}),
    ("crlf_in_host", b"GET / HTTP/1.1\r\nHost: acme.pact.test\rSet-Cookie: a=b\r\n\r\n",
     {400}),
    ("nul_in_host", b"GET / HTTP/1.1\r\nHost: acme.pact.test\x00evil\r\n\r\n", {400}),
    ("non_ascii_target", "GET /\u00e9\u4e2d HTTP/1.1\r\nHost: acme.pact.test\r\n\r\n"
     .encode("utf-8"), {308, 400}),
    ("non_ascii_host", "GET / HTTP/1.1\r\nHost: \u00e9vil.example\r\n\r\n".encode("utf-8"),
     {400}),
    ("missing_host_11", b"GET / HTTP/1.1\r\n\r\n", {400}),
    ("missing_host_10", b"GET / HTTP/1.0\r\n\r\n", {400}),
    ("empty_host", b"GET / HTTP/1.1\r\nHost: \r\n\r\n", {400}),
    ("userinfo_host", b"GET / HTTP/1.1\r\nHost: evil.example@acme.pact.test\r\n\r\n", {400}),
    ("ipv6_host", b"GET / HTTP/1.1\r\nHost: [::1]:80\r\n\r\n", {400}),
    ("ipv4_host", b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", {308}),
    ("host_bad_port", b"GET / HTTP/1.1\r\nHost: acme.pact.test:99999999\r\n\r\n", {400}),
    ("host_path", b"GET / HTTP/1.1\r\nHost: acme.pact.test/evil.example\r\n\r\n", {400}),
    ("host_256", b"GET / HTTP/1.1\r\nHost: " + b"a." * 127 + b"ab\r\n\r\n", {400}),
    ("h2_preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00",
     {400, 505, None}),
    ("tls_on_80", b"\x16\x03\x01\x00\x05\x01\x00\x00\x01\x00", {400, None}),
    ("http09", b"GET /\r\n\r\n", {400, None}),
    # h11 takes any HTTP/x.y request line and unfolds obs-fold: answered like any other
    ("http2_version", b"GET / HTTP/2.0\r\nHost: acme.pact.test\r\n\r\n", {308, 400, 505}),
    ("obs_fold", b"GET / HTTP/1.1\r\nHost: acme.pact.test\r\nX: a\r\n b\r\n\r\n", {308, 400}),
    ("space_before_colon", b"GET / HTTP/1.1\r\nHost : evil.example\r\n\r\n", {400}),
    ("te_and_cl", (b"POST / HTTP/1.1\r\nHost: acme.pact.test\r\nContent-Length: 5\r\n"
                   b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n"), {308, 400}),
    # the challenge path logs its Host: quotes, backslashes and bytes over 0x7f stay
    # inside one JSON line (the module's last test reads every line)
    ("challenge_odd_host", (b"GET /.well-known/acme-challenge/" + b"A" * 43 + b" HTTP/1.1\r\n"
                            b'Host: a"b\\c\xff\xfe{"x":1}\r\n\r\n'), {400}),
    ("challenge_long_host", (b"GET /.well-known/acme-challenge/" + b"A" * 43 + b" HTTP/1.1\r\n"
                             b"Host: " + b"h" * 7000 + b"\r\n\r\n"), {400}),
    ("empty", b"", {None}),
    ("only_crlf", b"\r\n\r\n\r\n", {400, None}),
]


@pytest.mark.parametrize("name,raw,ok", ODD_REQUESTS, ids=[r[0] for r in ODD_REQUESTS])
def test_odd_requests_get_a_defined_answer(edge: Edge, name: str, raw: bytes,
                                           ok: set[int | None]) -> None:
    with connect(edge.http_port) as s:
        s.sendall(raw)
        if name == "empty":
            s.shutdown(socket.SHUT_WR)
        reply = read_all(s)
    assert reply.status in ok, (name, reply.raw[:300])
    if reply.status is not None:
        check_well_formed(reply)
        location = reply.header("location")
        if location is not None:  # only ever to https on the name the Host header gave
            asked = re.search(rb"\r\nHost: ([^\r\n]*)", raw)
            assert asked is not None, name
            wanted = asked[1].decode().split(":")[0].rstrip(".").lower()
            assert location.startswith(f"https://{wanted}/"), location


@pytest.mark.parametrize("host", ["evil.example", "EVIL.example:80", "evil.example.",
                                  "acme.pact.test.evil.example", "pact.test", "x.acme.pact.test",
                                  "localhost"])
def test_redirect_goes_to_the_name_asked_for_and_nowhere_else(edge: Edge, host: str) -> None:
    """Any name pointed at this address is sent to https on that same name (what a
    client typing it expects; the answer names nothing the client did not ask for)."""
    reply = get(edge.http_port, "/login?next=1", host)
    check_well_formed(reply)
    assert reply.status == 308, reply.raw[:300]
    name = host.split(":")[0].rstrip(".").lower()
    assert reply.header("location") == f"https://{name}/login?next=1", reply.raw[:300]


@pytest.mark.parametrize("host", [ACME_HOST, ACME_HOST.upper() + ":80", ACME_HOST + ".",
                                  PASS_HOST])
@pytest.mark.parametrize("target", ["/", "//evil.example/x", "/\\evil.example",
                                    "/a%0d%0aSet-Cookie:x=1", "/%00", "/a b"])
def test_redirect_of_a_route_stays_on_it(edge: Edge, host: str, target: str) -> None:
    raw = f"GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
    reply = http80(edge.http_port, raw)
    if reply.status == 400:  # "/a b" is not a request line h11 takes
        return
    assert reply.status == 308
    check_well_formed(reply)
    location = reply.header("location")
    name = host.split(":")[0].rstrip(".").lower()
    assert location is not None
    parsed = urllib.parse.urlsplit(location)
    assert (parsed.scheme, parsed.netloc) == ("https", name), location
    assert not re.search(r"[\x00-\x20\x7f]", location)


def test_head_cap_at_and_over(edge: Edge) -> None:
    """A head just under the cap is answered; one just over is a 431, and a huge one is
    cut off with an answer or a close, never read whole."""
    base = b"GET / HTTP/1.1\r\nHost: acme.pact.test\r\nX-Pad: "
    pad = MAX_HEAD_BYTES - len(base) - 4  # the whole head, final CRLFCRLF included
    at = http80(edge.http_port, base + b"a" * pad + b"\r\n\r\n")
    assert at.status == 308
    over = http80(edge.http_port, base + b"a" * (pad + 1) + b"\r\n\r\n")
    assert over.status == 431 or (over.status is None and over.reset)
    if over.status is not None:
        check_well_formed(over)
    many = http80(edge.http_port, base[:-7] + b"X: y\r\n" * 4000 + b"\r\n")
    assert many.status == 431 or (many.status is None and many.reset)


@pytest.mark.parametrize("method", ["GET", "POST", "PUT"])
def test_bodies_are_never_read(edge: Edge, method: str) -> None:
    body = b"x" * 65536
    raw = (f"{method} /upload HTTP/1.1\r\nHost: {ACME_HOST}\r\nContent-Length: {len(body)}"
           "\r\n\r\n").encode() + body
    reply = http80(edge.http_port, raw)
    # the answer comes, or the unread body makes the close a reset that beats it
    assert reply.status == 308 or (reply.status is None and reply.reset)
    chunked = (f"{method} / HTTP/1.1\r\nHost: {ACME_HOST}\r\nTransfer-Encoding: chunked\r\n"
               "\r\n").encode()
    with connect(edge.http_port) as s:
        s.sendall(chunked + b"10000\r\n")  # and never the rest
        reply = read_all(s)
    assert reply.status == 308 or (reply.status is None and reply.reset)


def test_pipelined_requests_get_one_answer(edge: Edge) -> None:
    one = f"GET /a HTTP/1.1\r\nHost: {ACME_HOST}\r\n\r\n".encode()
    two = f"GET /b HTTP/1.1\r\nHost: {PASS_HOST}\r\n\r\n".encode()
    reply = http80(edge.http_port, one + two + one)
    assert reply.status == 308
    check_well_formed(reply)  # exactly Content-Length bytes after the head: one answer
    assert reply.raw.count(b"HTTP/1.1 ") == 1
    assert reply.header("location") == f"https://{ACME_HOST}/a"


def test_abort_mid_request(edge: Edge) -> None:
    """Half a head then a reset, or a FIN: the listener just closes."""
    for _ in range(20):
        s = connect(edge.http_port)
        s.sendall(b"GET /.well-known/acme-challenge/AAAA")
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # RST
    with connect(edge.http_port) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: acme.pact")
        s.shutdown(socket.SHUT_WR)
        reply = read_all(s)
    assert reply.status in (400, None)


def _hold(port: int, src: str, n: int, first: bytes = b"G") -> list[socket.socket]:
    """n connections from `src`, each having sent `first` and nothing more."""
    held = []
    for _ in range(n):
        try:
            s = connect(port, src)
            s.sendall(first)
        except OSError:
            break
        held.append(s)
    return held


def test_flood_from_one_ip_leaves_room_for_another(edge: Edge) -> None:
    """More idle connections than MAX_CONNECTIONS from one address: another address is
    still answered (a challenge request, a redirect); the flood is closed by the
    deadline and the slots come back."""
    before = fd_count(edge.pid)
    held = _hold(edge.http_port, ATTACKER, MAX_CONNECTIONS + 16)
    try:
        time.sleep(0.5)  # let the listener accept (or close) the whole flood
        redirect = get(edge.http_port, "/", ACME_HOST, src=BYSTANDER)
        assert redirect.status == 308, "the bystander was refused during the flood"
        miss = get(edge.http_port, PREFIX + "A" * 43, ACME_HOST, src=BYSTANDER)
        assert miss.status == 404
    finally:
        for s in held:
            s.close()
    wait_fds(edge, before)


def test_slowloris_is_cut_at_the_deadline(edge: Edge) -> None:
    """A byte a second: the listener closes by its deadline, not when the client stops,
    and its slot comes back."""
    before = fd_count(edge.pid)
    probe = get(edge.http_port, "/", ACME_HOST, src=SLOW)  # this address has its slots
    assert probe.status == 308
    with connect(edge.http_port, SLOW) as s:
        start = time.monotonic()
        closed = False
        for ch in b"GET / HTTP/1.1\r\nHost: acme.pact.test\r\nX: " + b"a" * 60:
            try:
                s.sendall(bytes([ch]))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            s.settimeout(1.0)
            try:
                if s.recv(1024) in (b"",):
                    closed = True
                    break
            except TimeoutError:
                pass
            except ConnectionResetError:
                closed = True
                break
            if time.monotonic() - start > HANG:
                break
        assert closed, "a slow client outlived the request deadline"
    wait_fds(edge, before)


def wait_fds(edge: Edge, baseline: int, slack: int = 2) -> None:
    """The serve process's open fds come back to `baseline` (+ slack) within HANG."""
    deadline = time.monotonic() + HANG
    while fd_count(edge.pid) > baseline + slack and time.monotonic() < deadline:
        time.sleep(0.2)
    assert fd_count(edge.pid) <= baseline + slack, (fd_count(edge.pid), baseline)



# ------------------------------------------------------------------------------ :443
def py_hello(sni: str | None, alpn: list[str]) -> bytes:
    """The ClientHello Python's ssl sends for `sni` and `alpn` (a real, complete one)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(alpn)
    obj = ctx.wrap_bio(ssl.MemoryBIO(), out := ssl.MemoryBIO(), server_hostname=sni)
    with contextlib.suppress(ssl.SSLWantReadError):
        obj.do_handshake()
    return out.read()


def _ext(kind: int, data: bytes) -> bytes:
    return struct.pack(">HH", kind, len(data)) + data


def raw_hello(names: list[bytes], alpn: list[bytes]) -> bytes:
    """A hand-made ClientHello: any SNI bytes (several names too) and ALPN entries."""
    entries = b"".join(b"\x00" + struct.pack(">H", len(n)) + n for n in names)
    protos = b"".join(bytes([len(a)]) + a for a in alpn)
    exts = (_ext(0, struct.pack(">H", len(entries)) + entries)
            + _ext(16, struct.pack(">H", len(protos)) + protos)
            + _ext(43, b"\x02\x03\x04") + _ext(10, b"\x00\x02\x00\x1d"))
    body = (b"\x03\x03" + os.urandom(32) + b"\x00" + b"\x00\x02\x13\x01" + b"\x01\x00"
            + struct.pack(">H", len(exts)) + exts)
    msg = b"\x01" + len(body).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack(">H", len(msg)) + msg


def tls_answer(port: int, hello: bytes, src: str = BYSTANDER) -> tuple[str, int | None]:
    """("alert", description) / ("handshake", None) / ("close", None) for one hello."""
    with connect(port, src) as s:
        s.sendall(hello)
        first = b""
        try:
            while len(first) < 7:
                chunk = s.recv(7 - len(first))
                if not chunk:
                    break
                first += chunk
        except ConnectionResetError:
            pass
        except TimeoutError:
            raise AssertionError("no answer to a ClientHello within the deadline") from None
    if first[:1] == b"\x15" and len(first) == 7:
        return "alert", first[6]
    if first[:1] == b"\x16":
        return "handshake", None
    assert first == b"", first
    return "close", None


ACME = [b"acme-tls/1"]
TLS_CASES: list[tuple[str, bytes, set[tuple[str, int | None]]]] = [
    ("terminate_no_pending", py_hello(ACME_HOST, ["acme-tls/1"]), {("alert", 120)}),
    ("upper_case_sni", py_hello(ACME_HOST.upper(), ["acme-tls/1"]), {("alert", 120)}),
    ("trailing_dot_sni", raw_hello([ACME_HOST.encode() + b"."], ACME),
     {("alert", 120), ("alert", 112)}),
    # not a validation (a CA offers acme-tls/1 alone): served like any client
    ("mixed_h2_first", py_hello(ACME_HOST, ["h2", "acme-tls/1"]), {("handshake", None)}),
    ("mixed_http11_last", py_hello(ACME_HOST, ["acme-tls/1", "http/1.1"]),
     {("handshake", None)}),
    ("acme_twice", raw_hello([ACME_HOST.encode()], ACME * 2), {("alert", 120)}),
    ("passthrough_host", py_hello(PASS_HOST, ["acme-tls/1"]), {("alert", 80)}),
    ("unknown_host", py_hello("nobody.pact.test", ["acme-tls/1"]), {("alert", 112)}),
    ("no_sni", py_hello(None, ["acme-tls/1"]), {("alert", 112)}),
    ("sub_of_terminate", py_hello("x." + ACME_HOST, ["acme-tls/1"]), {("alert", 112)}),
    ("nul_in_sni", raw_hello([ACME_HOST.encode() + b"\x00.evil"], ACME),
     {("alert", 112), ("alert", 50), ("alert", 47), ("close", None)}),
    ("empty_sni", raw_hello([b""], ACME),
     {("alert", 112), ("alert", 50), ("alert", 47), ("close", None)}),
    ("sni_300", raw_hello([b"a." * 149 + b"pact.test"], ACME),
     {("alert", 112), ("alert", 50), ("alert", 47), ("close", None)}),
    ("two_names", raw_hello([ACME_HOST.encode(), b"nobody.pact.test"], ACME),
     {("alert", 120), ("alert", 112), ("alert", 50), ("alert", 47), ("close", None)}),
    ("empty_alpn_name", raw_hello([ACME_HOST.encode()], [b"", b"acme-tls/1"]),
     {("alert", 50), ("alert", 47), ("close", None)}),
    ("plain_h2", py_hello(ACME_HOST, ["h2"]), {("handshake", None)}),
]


@pytest.mark.parametrize("name,hello,ok", TLS_CASES, ids=[c[0] for c in TLS_CASES])
def test_acme_tls_alpn_hellos_get_a_defined_answer(edge: Edge, name: str, hello: bytes,
                                                  ok: set[tuple[str, int | None]]) -> None:
    """acme-tls/1 alone with no challenge pending: alert 120 for a terminate host however
    it is spelled; a passthrough host goes to its node (dead here: 80); anything else is
    112 or a malformed-hello answer. A handshake only for hellos that offer h2 or
    http/1.1 (beside acme-tls/1 or not): those are ordinary clients."""
    assert tls_answer(edge.tls_port, hello) in ok


def _hammer(fn: Callable[[], object], stop: threading.Event, results: list[object],
            limit: int) -> threading.Thread:
    """Call `fn` until `stop` or `limit` calls (bounded), recording each result."""

    def run() -> None:
        for _ in range(limit):
            if stop.is_set():
                return
            try:
                results.append(fn())
            except (OSError, AssertionError) as exc:
                results.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_tls_flood_and_half_hellos_leave_a_bystander_served(edge: Edge) -> None:
    """Half-sent hellos held open and a stream of acme-tls/1 hellos from one address:
    another address still gets its certificate; every flood hello is answered 120; the
    half ones are closed by the ClientHello deadline and the fds come back."""
    before = fd_count(edge.pid)
    hello = py_hello(ACME_HOST, ["acme-tls/1"])
    half = _hold(edge.tls_port, ATTACKER_TLS, 150, first=hello[: len(hello) // 2])
    stop, results = threading.Event(), []  # type: ignore[var-annotated]
    threads = [_hammer(lambda: tls_answer(edge.tls_port, hello, ATTACKER_TLS), stop,
                       results, 150) for _ in range(4)]
    try:
        for _ in range(5):
            assert served_cert(edge) is not None, "the bystander got no certificate"
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT)
    assert results and all(r == ("alert", ALERT_NO_APP_PROTO) for r in results), (
        [r for r in results if r != ("alert", ALERT_NO_APP_PROTO)][:5])
    for s in half:  # each ends by the deadline: a close, never a handshake
        with s:
            reply = read_all(s)
            assert not reply.raw.startswith(b"\x16"), reply.raw[:20]
    wait_fds(edge, before)


JUNK = [raw for name, raw, _ in ODD_REQUESTS if name != "empty"]


def test_renewal_validates_while_both_ports_are_attacked(edge: Edge) -> None:
    """A forced renewal through the admin endpoint while one address holds more :80
    connections than the listener serves and sends junk, and another streams acme-tls/1
    hellos: pebble's validation (from a third address) is answered, the new certificate
    is served, and its token was pending only for its own host."""
    assert edge.baseline, "the first issuance test did not run"
    old = wait_served(edge)
    probes_before = len(edge.gate.probes)
    held = _hold(edge.http_port, ATTACKER, MAX_CONNECTIONS + 16)
    stop, junk_results, tls_results = threading.Event(), [], []  # type: ignore[var-annotated]
    junk = iter(JUNK * 20)
    threads = [
        _hammer(lambda: http80(edge.http_port, next(junk), src=ATTACKER).status, stop,
                junk_results, 200),
        _hammer(lambda: tls_answer(edge.tls_port, py_hello(ACME_HOST, ["acme-tls/1"]),
                                   ATTACKER_TLS), stop, tls_results, 300),
    ]
    try:
        status, body = request(edge.admin(), "POST", f"/certs/renew?host={ACME_HOST}",
                               timeout=WAIT)
        assert status == 200, body
        new = wait_served(edge, not_der=old)
    finally:
        stop.set()
        for t in threads:
            t.join(WAIT)
        for s in held:
            s.close()
    assert new != old
    assert len(edge.gate.probes) > probes_before
    host, token, got = edge.gate.probes[-1]
    assert "error" not in got, got
    assert host == ACME_HOST and got["exact"][0] == 200  # type: ignore[index]
    assert got["other_host"] == got["passthrough_host"] == got["token_plus"] == 404
    assert edge.gate.answered[-1] == 200
    assert get(edge.http_port, PREFIX + token, ACME_HOST).status == 404  # withdrawn
    # the flood was refused or answered, never left hanging
    assert all(not isinstance(r, AssertionError) for r in junk_results + tls_results), (
        [r for r in junk_results + tls_results if isinstance(r, AssertionError)][:3])
    assert all(r == ("alert", ALERT_NO_APP_PROTO) for r in tls_results
               if not isinstance(r, OSError))


def test_tls_alpn_renewal_answers_only_its_host(edge: Edge) -> None:
    """Switched to TLS-ALPN-01 by a reload, a renewal is validated through :443; while it
    was pending the challenge certificate went only to handshakes offering acme-tls/1
    alone for its host, h2 handshakes (acme-tls/1 offered too or not) got the served
    certificate, other names got their usual alerts; afterwards acme-tls/1 is refused
    again."""
    text = edge.config.read_text()
    edge.config.write_text(text.replace("challenges: [http-01]", "challenges: [tls-alpn-01]"))
    status, body = request(edge.admin(), "POST", "/reload", timeout=WAIT)
    assert status == 200, body
    old = wait_served(edge)
    status, body = request(edge.admin(), "POST", f"/certs/renew?host={ACME_HOST}",
                           timeout=WAIT)
    assert status == 200, body
    wait_served(edge, not_der=old)
    assert edge.tls_gate.probes, "pebble never came through the TLS gate"
    got = edge.tls_gate.probes[-1]
    assert "error" not in got, got
    assert got["exact"] == ("acme-tls/1", True)
    assert got["mixed"] == ("h2", False)
    assert got["upper_sni"] == ("acme-tls/1", True)  # DNS names are case-insensitive
    assert got["plain_h2"] == ("h2", False)
    assert got["passthrough"] == ("alert", ALERT_INTERNAL)
    assert got["other"] == ("alert", ALERT_UNRECOGNIZED_NAME)
    after = tls_answer(edge.tls_port, py_hello(ACME_HOST, ["acme-tls/1"]))
    assert after == ("alert", ALERT_NO_APP_PROTO)


def test_zz_no_tracebacks_and_back_to_baseline(edge: Edge) -> None:
    """After every attack: the log holds one JSON event per line and no traceback, the
    process is back to the sockets it had before the attacks, and /status says the
    certificate is fine."""
    wait_fds(edge, edge.baseline)
    text = edge.log_text
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(json_events(text)) == len(lines), [
        line for line in lines if not line.startswith("{")][:5]
    assert not [e for e in json_events(text) if e.get("level") in ("error", "critical")]
    # a challenge request's Host is logged, but never more of it than a name can be
    # (`challenge_long_host` sent 7,000 bytes of it)
    hosts = [e["host"] for e in json_events(text)
             if e.get("event") == "acme_http01_request" and e.get("host")]
    assert hosts and max(map(len, hosts)) <= 259, max(map(len, hosts))
    status = fetch_status(edge.admin())
    cert = next(c for c in status["certs"] if c["host"] == ACME_HOST)
    assert cert["last_error"] is None and cert["not_after"]
    reasons = {r["reason"] for r in status["recent_refusals"]}
    assert "acme_no_challenge" in reasons
