"""ACME pieces without a CA: scheduling math, the store, the TLS-ALPN-01 certificate, the
:80 listener (pure decisions and over a real socket), the DNS-01 key parser, and the
manager's bookkeeping (file certificates, missing certs, budgets, backoff) with the order
function replaced by fakes. The CA round trips live in test_acme_e2e.py.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import random
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import trio
import trustme
from cryptography import x509

from pact_ingress.acme import issuer as issuer_mod
from pact_ingress.acme.dns01 import challenge_name, read_tsig_key
from pact_ingress.acme.issuer import Issued
from pact_ingress.acme.manager import CertManager
from pact_ingress.acme.schedule import Policy, SlidingWindow, backoff_delay, renewal_time
from pact_ingress.acme.store import Store, host_dir_name, list_store
from pact_ingress.acme.tlsalpn import ACME_IDENTIFIER_OID, challenge_cert
from pact_ingress.config import Acme, CertFiles, Config
from pact_ingress.errors import AcmeError
from pact_ingress.net.http_listener import handle_http, plan_response
from pact_ingress.stats import Stats
from tests.netutil import make_config, route

WAIT = 10.0


# ------------------------------------------------------------------------------ schedule
def test_renewal_at_two_thirds_with_bounded_jitter() -> None:
    policy = Policy(jitter_fraction=0.02)
    rng = random.Random(7)
    times = [renewal_time(0.0, 90.0, policy, rng) for _ in range(200)]
    assert all(60.0 - 1.8 <= t <= 60.0 for t in times)
    assert len(set(times)) > 100  # actually jittered


def test_renewal_of_backdated_fresh_cert_is_in_the_future() -> None:
    policy = Policy(jitter_fraction=0.0)
    at = renewal_time(0.0, 1000.0, policy, random.Random(1), issued_at=900.0)
    assert at == pytest.approx(900.0 + 100.0 * 2 / 3)


def test_backoff_doubles_and_caps() -> None:
    p = Policy(backoff_base=60, backoff_max=3600)
    assert [backoff_delay(n, p) for n in (1, 2, 3, 7, 8, 1000)] == [60, 120, 240, 3600,
                                                                     3600, 3600]


def test_sliding_window() -> None:
    w = SlidingWindow(cap=3, window=100.0)
    for t in (0.0, 10.0, 20.0):
        assert w.available_at(t) == t
        w.record(t)
    assert w.available_at(30.0) == 100.0  # the oldest event leaves the window at 100
    assert w.available_at(100.0) == 100.0
    w.record(100.0)
    assert w.available_at(105.0) == 110.0


# ------------------------------------------------------------------------------ store
def _chain(host: str, days: int = 90) -> tuple[bytes, bytes, trustme.CA]:
    ca = trustme.CA()
    now = datetime.datetime.now(datetime.UTC)
    leaf = ca.issue_cert(host, not_before=now - datetime.timedelta(hours=1),
                         not_after=now + datetime.timedelta(days=days))
    chain = b"".join(p.bytes() for p in leaf.cert_chain_pems)
    return chain, leaf.private_key_pem.bytes(), ca


def test_store_atomic_pair_key_mode_and_offline_listing(tmp_path: Path) -> None:
    store = Store(tmp_path)
    chain, key, _ = _chain("a.example")
    first = store.save_cert("a.example", chain, key, directory="https://ca/dir",
                            next_renewal=123.0)
    assert first.key_path.stat().st_mode & 0o777 == 0o600
    chain2, key2, _ = _chain("a.example")
    second = store.save_cert("a.example", chain2, key2, directory="https://ca/dir",
                             next_renewal=456.0)
    assert not first.chain_path.exists() and not first.key_path.exists()  # old pair removed
    assert store.load_cert("a.example") == second
    store.write_meta("*.w.example", last_error="CA unreachable")
    rows = {r.host: r for r in list_store(tmp_path)}
    assert rows["a.example"].next_renewal == 456.0 and rows["a.example"].source == "acme"
    assert rows["*.w.example"].not_after is None
    assert rows["*.w.example"].last_error == "CA unreachable"
    assert (tmp_path / "acme" / "certs" / "_wildcard_.w.example" / "meta.json").exists()


def test_store_meta_is_the_commit_point(tmp_path: Path) -> None:
    """A pair written but not committed (crash before meta.json) is never loaded."""
    store = Store(tmp_path)
    chain, key, _ = _chain("b.example")
    good = store.save_cert("b.example", chain, key, directory="d", next_renewal=None)
    orphan_chain, _, _ = _chain("b.example")
    (good.chain_path.parent / "ffff.pem").write_bytes(orphan_chain)
    assert store.load_cert("b.example") == good


@pytest.mark.parametrize("bad", ["../etc", "a/b", "", "A..b", "*.*.x", "x.*", "a b",
                                 "a.example\n", "a\n.example"])
def test_store_refuses_non_hostnames(bad: str) -> None:
    with pytest.raises(AcmeError):
        host_dir_name(bad)


# ------------------------------------------------------------------------------ TLS-ALPN-01
def test_tls_alpn_challenge_cert_rfc8737() -> None:
    key_authz = "token123.thumbprint456"
    cert_pem, _ = challenge_cert("h.example", key_authz,
                                 now=datetime.datetime.now(datetime.UTC))
    cert = x509.load_pem_x509_certificate(cert_pem)
    ext = cert.extensions.get_extension_for_oid(ACME_IDENTIFIER_OID)
    assert ext.critical
    digest = hashlib.sha256(key_authz.encode()).digest()
    assert ext.value.value == b"\x04\x20" + digest  # DER OCTET STRING of the digest
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["h.example"]


# ------------------------------------------------------------------------------ :80
class _Answers:
    def http01_response(self, host: str, token: str) -> bytes | None:
        return b"tok.thumb" if (host, token) == ("h.example", "A" * 43) else None

    async def find_http01(self, host: str, token: str) -> bytes | None:
        return self.http01_response(host, token)


@pytest.mark.parametrize("method,target,host,status,location", [
    ("GET", "/.well-known/acme-challenge/" + "A" * 43, "h.example", 200, None),
    ("GET", "/.well-known/acme-challenge/" + "A" * 43, "H.Example:80", 200, None),
    ("GET", "/.well-known/acme-challenge/" + "A" * 43, "other.example", 404, None),
    ("GET", "/.well-known/acme-challenge/../x", "h.example", 404, None),
    ("POST", "/.well-known/acme-challenge/" + "A" * 43, "h.example", 405, None),
    ("GET", "/path?q=1", "h.example:80", 308, "https://h.example/path?q=1"),
    ("GET", "http://evil.example/x", "h.example", 308, "https://h.example/"),
    ("GET", "/", None, 400, None),
    ("GET", "/", "evil.example/x", 400, None),
    # any name pointed at this address is sent to https on that same name, nothing else
    ("GET", "/x", "other.example", 308, "https://other.example/x"),
    # a name longer than DNS allows is no name
    ("GET", "/", "a." * 126 + "ab", 400, None),
    ("GET", "/", "a." * 125 + "abc", 308, "https://" + "a." * 125 + "abc/"),
    # a trailing newline must not slip through a pattern's end anchor
    ("GET", "/", "h.example\n", 400, None),
    ("GET", "/.well-known/acme-challenge/" + "A" * 43 + "\n", "h.example", 404, None),
    ("GET", "/x\n", "h.example", 308, "https://h.example/"),
])
def test_http_plan(method: str, target: str, host: str | None, status: int,
                   location: str | None) -> None:
    ans = plan_response(method, target, host, _Answers())
    assert ans.status == status
    assert dict(ans.headers).get("Location") == location
    if status == 200:
        assert ans.body == b"tok.thumb"


async def _roundtrip(raw: bytes) -> bytes:
    a, b = trio.testing.memory_stream_pair()
    async with trio.open_nursery() as n:
        n.start_soon(handle_http, b, _Answers())
        await a.send_all(raw)
        out = b""
        with trio.fail_after(WAIT):
            while chunk := await a.receive_some(4096):
                out += chunk
    return out


async def test_http_listener_answers_and_caps() -> None:
    ok = await _roundtrip(b"GET /.well-known/acme-challenge/" + b"A" * 43
                          + b" HTTP/1.1\r\nHost: h.example\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200 ") and ok.endswith(b"\r\n\r\ntok.thumb")
    redirect = await _roundtrip(b"GET /x HTTP/1.1\r\nHost: h.example\r\n\r\n")
    assert b"HTTP/1.1 308 " in redirect and b"location: https://h.example/x" in redirect.lower()
    huge = await _roundtrip(b"GET / HTTP/1.1\r\nHost: h\r\nX: " + b"a" * 10000)
    assert huge.startswith(b"HTTP/1.1 431 ")
    garbage = await _roundtrip(b"\x16\x03\x01 not http\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400 ")


async def test_http_listener_real_socket_with_curl(nursery: trio.Nursery) -> None:
    from pact_ingress.config import Address
    from pact_ingress.net.http_listener import serve_http
    from tests.tools import require

    curl = require("curl")
    _, port = await nursery.start(serve_http, Address("127.0.0.1", 0), _Answers())
    url = f"http://127.0.0.1:{port}/.well-known/acme-challenge/{'A' * 43}"
    res = await trio.run_process([curl, "-s", "-H", "Host: h.example", url],
                                 capture_stdout=True)
    assert res.stdout == b"tok.thumb"
    res = await trio.run_process([curl, "-s", "-o", "/dev/null", "-w",
                                  "%{http_code} %{redirect_url}", f"http://127.0.0.1:{port}/a?b"],
                                 capture_stdout=True)
    assert res.stdout == b"308 https://127.0.0.1/a?b"


# ------------------------------------------------------------------------------ DNS-01
def test_tsig_key_file_and_challenge_names(tmp_path: Path) -> None:
    f = tmp_path / "k"
    f.write_text('key "upd.example" {\n\talgorithm hmac-sha256;\n'
                 '\tsecret "c2VjcmV0c2VjcmV0";\n};\n')
    key = read_tsig_key(f)
    assert (key.name, key.algorithm, key.secret) == ("upd.example", "hmac-sha256",
                                                     b"secretsecret")
    assert "secret" not in repr(key).replace("secret=", "")
    f.write_text("nonsense")
    with pytest.raises(AcmeError, match="not a BIND key clause"):
        read_tsig_key(f)
    assert challenge_name("*.w.example") == "_acme-challenge.w.example."
    assert challenge_name("a.example") == "_acme-challenge.a.example."


def test_a_dns01_failure_names_an_ipv6_server_in_brackets(tmp_path: Path) -> None:
    """An IPv6 server written as ::1:53 reads as a port-less address (the config itself
    refuses that spelling): messages name it as the config does, [::1]:53."""
    from pact_ingress.acme.dns01 import Dns01Solver
    from pact_ingress.model import Address, Dns01
    from tests.netutil import free_port

    f = tmp_path / "k"
    f.write_text('key "upd.example" {\n\talgorithm hmac-sha256;\n'
                 '\tsecret "c2VjcmV0c2VjcmV0";\n};\n')
    port = free_port("::1")  # nothing listens there: the update is refused
    solver = Dns01Solver(Dns01(Address("::1", port), "dns.test.", f))
    with pytest.raises(AcmeError) as info:
        solver.present("x.dns.test", "value")
    assert f"to [::1]:{port} failed" in str(info.value), info.value


# ------------------------------------------------------------------------------ manager
def _acme_config(tmp: Path, hosts: list[str], files: dict[str, CertFiles] | None = None
                 ) -> Config:
    routes = [route(h, "t", 9, mode="terminate", cert="acme") for h in hosts]
    routes += [route(h, "t", 9, mode="terminate", cert=cf) for h, cf in (files or {}).items()]
    routes.append(route("pass.example", "t", 9))  # passthrough: never a certificate
    cfg = make_config(tmp, routes)
    return replace(cfg, acme=Acme(directory="https://ca.invalid/dir", email=None,
                                  agree_tos=True, challenges=("tls-alpn-01",)))


def _files(tmp: Path, host: str) -> CertFiles:
    chain, key, _ = _chain(host)
    (tmp / f"{host}.pem").write_bytes(chain)
    (tmp / f"{host}.key").write_bytes(key)
    return CertFiles(tmp / f"{host}.pem", tmp / f"{host}.key")


class FakeCA:
    """Stands in for `issuer.issue` (runs in the worker thread like the real one)."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail = fail
        self.calls: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, account: object, host: str, *, on_order, **kw: object) -> Issued:  # type: ignore[no-untyped-def]
        with self.lock:
            self.calls.append(host)
        on_order()
        if self.fail:
            raise AcmeError(f"simulated {self.fail}", reason=self.fail)
        chain, key, _ = _chain(host, days=90)
        return Issued(chain, key, "tls-alpn-01")


@pytest.fixture
def fake_ca(monkeypatch: pytest.MonkeyPatch) -> FakeCA:
    ca = FakeCA()
    monkeypatch.setattr(issuer_mod, "issue", ca)

    class _Acct:
        cfg = None
        offers_ari = False

    async def no_account(self: CertManager) -> object:
        acct = _Acct()
        acct.cfg = self._acme  # type: ignore[assignment]
        return acct

    monkeypatch.setattr(CertManager, "_get_account", no_account)
    return ca


async def quiet_round(m: CertManager) -> None:
    """Wait for a scheduler round that began with no order running and started none.

    A negative check ("no further order") needs the scheduler to have *looked* at the state
    that should stop it; sleeping a while and hoping it has is either slow or flaky. Such a
    round has seen every finished order's outcome (backoff, spent budget) and decided
    against another one.
    """
    quiet = trio.Event()
    inner = m._start_due

    def start_due(nursery: trio.Nursery) -> float | None:
        busy_before = any(h.busy for h in m._hosts.values())
        try:
            return inner(nursery)
        finally:
            if not busy_before and not any(h.busy for h in m._hosts.values()):
                quiet.set()

    m._start_due = start_due  # type: ignore[method-assign]
    try:
        with trio.fail_after(WAIT):
            await quiet.wait()
    finally:
        m._start_due = inner  # type: ignore[method-assign]


async def test_file_certs_served_and_listed(tmp_path: Path) -> None:
    files = {"f.example": _files(tmp_path, "f.example")}
    m = CertManager(state_dir=tmp_path / "state", stats=Stats())
    cfg = _acme_config(tmp_path, [], files)
    m.update(cfg)
    r = next(r for r in cfg.routes() if r.host == "f.example")
    ctx = m.server_context(r)
    assert isinstance(ctx, ssl.SSLContext)
    [info] = m.inventory()
    assert info.source == "file" and info.not_after and info.issuer
    with pytest.raises(AcmeError, match="not running"):
        await m.renew("f.example")


@contextmanager
def package_log() -> Iterator[list[logging.LogRecord]]:
    """Records of the `pact_ingress` logger, kept by a handler on that logger itself.

    The logger is process-wide and `logs.setup` (CLI entry points, other tests) replaces
    its handlers and turns propagation off; capturing through the root logger (caplog)
    would count whatever an earlier test left configured, not what this one logged.
    """
    logger = logging.getLogger("pact_ingress")
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler, level = Keep(), logger.level
    logger.addHandler(handler)  # never the only handler: no `logs._direct` shortcut
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


async def test_missing_cert_logs_in_progress_once_per_interval(tmp_path: Path) -> None:
    m = CertManager(state_dir=tmp_path / "state", stats=Stats(), wall_clock=lambda: 1000.0)
    cfg = _acme_config(tmp_path, ["new.example"])
    m.update(cfg)
    r = next(r for r in cfg.routes() if r.host == "new.example")
    with package_log() as records:
        for _ in range(5):
            assert m.server_context(r) is None
    events = [rec.getMessage() for rec in records
              if getattr(rec, "fields", {}).get("host") == "new.example"]
    assert events.count("cert_issuance_in_progress") == 1
    assert [i.host for i in m.inventory()] == ["new.example"]  # passthrough not listed


async def test_issue_dedup_and_only_config_hosts(tmp_path: Path, nursery: trio.Nursery,
                                                 fake_ca: FakeCA) -> None:
    m = CertManager(state_dir=tmp_path / "state", stats=Stats())
    cfg = _acme_config(tmp_path, ["a.example", "b.example"])
    m.update(cfg)
    await nursery.start(m.run)
    for _ in range(20):
        for r in cfg.routes():
            if r.mode == "terminate":
                m.server_context(r)
    with trio.fail_after(WAIT):
        while len([i for i in m.inventory() if i.not_after]) < 2:
            await trio.sleep(0.01)
    assert sorted(fake_ca.calls) == ["a.example", "b.example"]
    # a reload dropping b: b is no longer served nor renewed
    m.update(_acme_config(tmp_path, ["a.example"]))
    assert [i.host for i in m.inventory()] == ["a.example"]
    with pytest.raises(AcmeError, match="not a terminate route"):
        await m.renew("b.example")


async def test_failed_validations_budget_defers(tmp_path: Path, nursery: trio.Nursery,
                                                fake_ca: FakeCA) -> None:
    fake_ca.fail = "validation"
    stats = Stats()
    policy = Policy(backoff_base=0.01, backoff_max=0.01, failed_validations_per_host=3,
                    max_sleep=0.05)
    m = CertManager(state_dir=tmp_path / "state", stats=stats, policy=policy)
    m.update(_acme_config(tmp_path, ["v.example"]))
    await nursery.start(m.run)
    with trio.fail_after(WAIT):
        while stats.value("pact_ingress_certificate_failures_total",
                          {"host": "v.example", "reason": "validation"}) < 3:
            await trio.sleep(0.01)
    await quiet_round(m)  # backoff (10 ms) long over: the budget alone stops a 4th attempt
    assert len(fake_ca.calls) == 3
    with pytest.raises(AcmeError, match="deferred by the issuance budget"):
        await m.renew("v.example")
    [info] = list_store(tmp_path / "state")
    assert info.last_error == "simulated validation"


async def test_order_budget_per_account(tmp_path: Path, nursery: trio.Nursery,
                                        fake_ca: FakeCA) -> None:
    policy = Policy(orders_per_window=2, max_sleep=0.05)
    m = CertManager(state_dir=tmp_path / "state", stats=Stats(), policy=policy)
    m.update(_acme_config(tmp_path, ["a.example", "b.example", "c.example"]))
    await nursery.start(m.run)
    with trio.fail_after(WAIT):
        while len(fake_ca.calls) < 2:
            await trio.sleep(0.01)
    await quiet_round(m)  # both orders done, the third host looked at and deferred
    assert len(fake_ca.calls) == 2 and m.orders_sent == 2


async def test_failure_keeps_old_cert_and_backs_off(tmp_path: Path, nursery: trio.Nursery,
                                                    fake_ca: FakeCA) -> None:
    now = [0.0]
    stats = Stats()
    policy = Policy(backoff_base=1000.0, max_sleep=0.05)
    m = CertManager(state_dir=tmp_path / "state", stats=stats, policy=policy,
                    wall_clock=lambda: now[0] or time.time())
    cfg = _acme_config(tmp_path, ["k.example"])
    m.update(cfg)
    await nursery.start(m.run)
    r = next(r for r in cfg.routes() if r.host == "k.example")
    with trio.fail_after(WAIT):
        while (old := m.server_context(r)) is None:
            await trio.sleep(0.01)
    [info] = m.inventory()
    assert info.next_renewal is not None and info.not_after is not None
    fake_ca.fail = "ca_unreachable"
    now[0] = info.next_renewal + 1  # renewal is due
    m.update(cfg)  # wake the scheduler
    with trio.fail_after(WAIT):
        while stats.value("pact_ingress_certificate_failures_total",
                          {"host": "k.example", "reason": "ca_unreachable"}) < 1:
            await trio.sleep(0.01)
    await quiet_round(m)  # the failure seen, the retry put off
    assert len(fake_ca.calls) == 2  # backoff: no immediate retry
    assert m.server_context(r) is old
    assert m.inventory()[0].last_error == "simulated ca_unreachable"


async def test_ari_window_moves_renewal(tmp_path: Path, nursery: trio.Nursery,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CA offering renewalInfo (RFC 9773) decides the renewal time of a stored cert."""
    chain, key, _ = _chain("ari.example")
    Store(tmp_path / "state").save_cert("ari.example", chain, key,
                                        directory="https://ca.invalid/dir", next_renewal=None)
    suggested = datetime.datetime.now(datetime.UTC) + datetime.timedelta(days=3)
    asked: list[bytes] = []

    class _Client:
        def renewal_time(self, cert_pem: bytes) -> tuple[datetime.datetime, datetime.datetime]:
            asked.append(cert_pem)
            return suggested, datetime.datetime.now() + datetime.timedelta(hours=6)

    class _Acct:
        offers_ari = True
        client = _Client()

    async def account(self: CertManager) -> object:
        return _Acct()

    # Hold the store write (worker thread) until the test has looked at the live view:
    # the live view must never run ahead of the store (it once did, and `certs list` /
    # a restart right then would have seen the old plan). No timing involved.
    entered, release = threading.Event(), threading.Event()
    real_write_meta = Store.write_meta

    def gated_write_meta(self: Store, host: str, **changes: object) -> None:
        entered.set()
        release.wait(WAIT)
        real_write_meta(self, host, **changes)

    monkeypatch.setattr(CertManager, "_get_account", account)
    monkeypatch.setattr(Store, "write_meta", gated_write_meta)
    m = CertManager(state_dir=tmp_path / "state", stats=Stats())
    m.update(_acme_config(tmp_path, ["ari.example"]))
    await nursery.start(m.run)
    try:
        with trio.fail_after(WAIT):
            while not entered.is_set():
                await trio.sleep(0.01)
        assert m.inventory()[0].next_renewal != suggested.timestamp()  # not before stored
    finally:
        release.set()
    with trio.fail_after(WAIT):
        while m.inventory()[0].next_renewal != suggested.timestamp():
            await trio.sleep(0.01)
    assert asked == [chain]
    assert list_store(tmp_path / "state")[0].next_renewal == suggested.timestamp()


def test_certs_list_prints_no_raw_control_characters() -> None:
    """`certs list` shows a CA's words (the issuer's name, the last error): an escape
    sequence in them must not reach the operator's terminal as one."""
    from pact_ingress.acme.store import CertInfo
    from pact_ingress.certs_cli import format_rows

    out = format_rows([CertInfo("h.example", "acme", issuer="CA\x1b]0;owned\x07",
                                last_error="urn:acme:error \x1b[2J\x1b[Hbad\r\nnews\x9b1m")])
    assert not any(ord(c) < 32 and c != "\n" or 127 <= ord(c) < 160 for c in out), repr(out)
    assert out.count("\n") == 1  # a header and one row, the error's CR LF shown as '?'
    assert "urn:acme:error ?[2J?[Hbad??news?1m" in out


def test_serve_without_acme_does_not_load_the_acme_client() -> None:
    """What `serve` imports to run routes with certificate files (the manager included)
    leaves the ACME client, requests and dnspython unloaded: they come with the first
    order, challenge or DNS-01 solver, not with every start."""
    import subprocess
    import sys

    code = ("import sys, pact_ingress.app, pact_ingress.acme.manager, pact_ingress.worker\n"
            "print(sorted(m for m in ('acme', 'josepy', 'requests', 'dns', "
            "'pact_ingress.acme.issuer') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


_KILLED_MID_WRITE = """
import os, sys, threading
from pathlib import Path
from pact_ingress.acme.store import Store
# the fault: the rename after the temp file never comes, so kill -9 lands mid-write
os.replace = lambda *a, **k: (print("written", flush=True), threading.Event().wait())
chain, key = Path(sys.argv[2]).read_bytes(), Path(sys.argv[3]).read_bytes()
Store(Path(sys.argv[1])).save_cert("k.example", chain, key, directory="d", next_renewal=None)
"""


def _killed_mid_write(tmp_path: Path, state: Path) -> Path:
    """A real process killed with SIGKILL inside `save_cert`'s first write (the key's):
    the temp file it leaves behind."""
    import signal
    import subprocess
    import sys

    chain, key, _ = _chain("k.example")
    (tmp_path / "chain.pem").write_bytes(chain)
    (tmp_path / "key.pem").write_bytes(key)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_MID_WRITE, str(state),
                             str(tmp_path / "chain.pem"), str(tmp_path / "key.pem")],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "written\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    d = state / "acme" / "certs" / host_dir_name("k.example")
    [left] = [p for p in d.iterdir() if p.name.startswith(".")]
    assert left.read_bytes() == key  # a private key, whole, under a name nobody reads
    return left


def test_a_write_killed_midway_leaves_a_temp_file_the_store_removes_once_old(
        tmp_path: Path) -> None:
    from pact_ingress.acme.store import LEFTOVER_AGE

    state = tmp_path / "state"
    left = _killed_mid_write(tmp_path, state)
    d = left.parent
    kept = [d / ".keep", d / ".meta.json.swp", d / ".x.key.short", d / "abc.key.tmp12345"]
    for p in kept:
        p.write_bytes(b"not ours")
    (d / ".dir.key.abcdefgh").mkdir()  # the right name, but a directory
    store = Store(state)
    now = time.time()
    assert store.remove_leftovers(now) == []  # younger than LEFTOVER_AGE: maybe under way
    assert left.exists()
    assert store.remove_leftovers(now + LEFTOVER_AGE + 1) == [left]
    assert not left.exists()
    assert all(p.exists() for p in kept) and (d / ".dir.key.abcdefgh").is_dir()
    assert store.remove_leftovers(now + LEFTOVER_AGE + 1) == []
    # the store's other directories are swept too; one it never made is no error
    acct = store.account_dir("https://ca/dir")
    acct.mkdir(parents=True)
    (acct / ".account.key.a1b2c3_d").write_bytes(b"partial")
    assert store.remove_leftovers(now + LEFTOVER_AGE + 1) == [acct / ".account.key.a1b2c3_d"]
    assert Store(tmp_path / "nothing").remove_leftovers(now) == []


async def test_the_manager_removes_leftovers_when_it_starts(tmp_path: Path) -> None:
    """A temp file a killed process left is gone once the manager runs, logged in one
    line that names no file (the name may be a key's)."""
    from pact_ingress.acme.store import LEFTOVER_AGE

    state = tmp_path / "state"
    left = _killed_mid_write(tmp_path, state)
    m = CertManager(state_dir=state, stats=Stats(),
                    wall_clock=lambda: time.time() + LEFTOVER_AGE + 1)
    with package_log() as records:
        async with trio.open_nursery() as nursery:
            await nursery.start(m.run)
            with trio.fail_after(10):
                while left.exists():
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()
    [line] = [getattr(r, "fields", {}) for r in records
              if r.getMessage() == "acme_leftovers_removed"]
    assert line == {"count": 1}


async def test_a_reload_that_drops_a_host_drops_its_certificate_series(
        tmp_path: Path, nursery: trio.Nursery, fake_ca: FakeCA) -> None:
    """Failures of a name the config no longer has are not exposed for ever; a name
    that moves from ACME to certificate files keeps its expiry (from the files)."""
    fake_ca.fail = "validation"
    stats = Stats()
    policy = Policy(backoff_base=0.01, backoff_max=0.01, max_sleep=0.05)
    m = CertManager(state_dir=tmp_path / "state", stats=stats, policy=policy)
    m.update(_acme_config(tmp_path, ["v.example", "w.example"]))
    await nursery.start(m.run)
    failures = "pact_ingress_certificate_failures_total"
    with trio.fail_after(WAIT):
        while not all(stats.value(failures, {"host": h, "reason": "validation"})
                      for h in ("v.example", "w.example")):
            await trio.sleep(0.01)
    files = {"w.example": _files(tmp_path, "w.example")}
    m.update(_acme_config(tmp_path, [], files))  # v gone, w served from files now
    await quiet_round(m)
    for host in ("v.example", "w.example"):
        assert stats.registry.get_sample_value(
            failures, {"host": host, "reason": "validation"}) is None, host
    assert stats.registry.get_sample_value(
        "pact_ingress_certificate_expiry_timestamp_seconds", {"host": "w.example"})
    assert stats.registry.get_sample_value(
        "pact_ingress_certificate_expiry_timestamp_seconds", {"host": "v.example"}) is None
    m.update(_acme_config(tmp_path, ["v.example"], files))  # back: counted afresh
    with trio.fail_after(WAIT):
        while not stats.value(failures, {"host": "v.example", "reason": "validation"}):
            await trio.sleep(0.01)
