"""ACME end to end: real pebble (+ challtestsrv as its DNS, or bind9 for DNS-01), the real
SNI router on pebble's TLS-ALPN port, the real :80 listener on its HTTP port, the real
CertManager, and TLS clients that verify issued chains against pebble's root.

The terminator is a small echo stand-in (the real one proxies to home nodes, which is not
what these tests are about): it completes TLS with the context the router got from
`CertManager.server_context` and echoes lines, so tests can see both which certificate a
handshake got and that an established connection keeps working.
"""

from __future__ import annotations

import logging
import signal
import ssl
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import trio
from cryptography import x509

from pact_ingress import logs
from pact_ingress.acme.manager import CertManager
from pact_ingress.acme.schedule import Policy
from pact_ingress.acme.store import list_store
from pact_ingress.config import Acme, Address, Config, Dns01, Listen, Route, Tenant
from pact_ingress.identity import keygen
from pact_ingress.logs import setup as log_setup
from pact_ingress.net.backends import Backends
from pact_ingress.net.http_listener import serve_http
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.router import Router
from pact_ingress.stats import Stats
from tests.acme_servers import ChallTestSrv, Named, Pebble, free_port
from tests.netutil import make_config, route

#: Every wait in these tests is bounded by this (pebble issues in ~1–2 s).
WAIT = 30.0
#: Fast backoff so the outage test sees several retries in seconds.
FAST = Policy(backoff_base=0.5, backoff_max=2.0, max_sleep=1.0)


# ------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def challtestsrv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChallTestSrv]:
    srv = ChallTestSrv(tmp_path_factory.mktemp("challtestsrv")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def pebble(tmp_path_factory: pytest.TempPathFactory,
           challtestsrv: ChallTestSrv) -> Iterator[Pebble]:
    """A long-lived pebble (default 5-year certs) shared by the module's issuance tests."""
    p = Pebble(tmp_path_factory.mktemp("pebble"), f"127.0.0.1:{challtestsrv.dns_port}",
               http_port=free_port(), tls_port=free_port()).start()
    yield p
    p.stop()


@pytest.fixture
def short_pebble(tmp_path: Path, challtestsrv: ChallTestSrv) -> Iterator[Pebble]:
    """A pebble issuing 6-second certificates: renewal comes due after ~4 s."""
    p = Pebble(tmp_path / "pebble-short", f"127.0.0.1:{challtestsrv.dns_port}",
               http_port=free_port(), tls_port=free_port(), validity=6).start()
    yield p
    p.stop()


# ------------------------------------------------------------------------------ the edge
class EchoTerminator:
    """Stand-in for net.terminate: TLS with the router's context, then echo lines."""

    async def serve(self, stream: ReplayStream, server_ctx: ssl.SSLContext, route: Route,
                    client: tuple[str, int], *, sni: str | None = None) -> None:
        tls = trio.SSLStream(stream, server_ctx, server_side=True)
        try:
            with trio.fail_after(WAIT):
                await tls.do_handshake()
            while True:  # until the client closes (each test closes its connections)
                data = await tls.receive_some(4096)
                if not data:
                    return
                await tls.send_all(data)
        except (trio.BrokenResourceError, trio.TooSlowError, ssl.SSLError, OSError):
            pass


@dataclass
class Edge:
    """Router on pebble's tlsPort, HTTP listener on its httpPort, one CertManager."""

    pebble: Pebble
    config: Config
    certs: CertManager
    stats: Stats
    nursery: trio.Nursery
    roots: list[bytes] = field(default_factory=list)

    def route(self, host: str) -> Route:
        return next(r for r in self.config.routes() if r.host == host)

    def add_host(self, host: str) -> None:
        """Reload with one more terminate route (what SIGHUP does)."""
        routes = [r for r in self.config.routes()] + [
            route(host, "t", 9, mode="terminate", cert="acme")]
        tenant = Tenant(name="t", pins=("sha256:" + "A" * 43,), routes=tuple(routes))
        self.reload(replace(self.config, tenants=(tenant,)))

    def remove_host(self, host: str) -> None:
        """Reload without `host`'s route."""
        tenant = self.config.tenants[0]
        self.reload(replace(self.config, tenants=(replace(tenant, routes=tuple(
            r for r in self.config.routes() if r.host != host)),)))

    def reload(self, config: Config) -> None:
        """What SIGHUP does with `config`: the certificate manager and the router take it."""
        self.config = config
        self.certs.update(config)
        self.router.update(config)

    router: Router | None = None  # set by the fixture


def acme_config(tmp: Path, pebble: Pebble, hosts: list[str], *, challenges: tuple[str, ...],
                dns01: Dns01 | None = None) -> Config:
    cfg = make_config(tmp, [route(h, "t", 9, mode="terminate", cert="acme") for h in hosts])
    acme = Acme(directory=pebble.directory, email="ops@pact.test", agree_tos=True,
                challenges=challenges, ca_bundle=pebble.ca_bundle, dns01=dns01)
    listen = Listen(tls=(Address("127.0.0.1", pebble.tls_port),),
                    http=(Address("127.0.0.1", pebble.http_port),))
    return replace(cfg, acme=acme, listen=listen)


async def start_edge(nursery: trio.Nursery, tmp: Path, pebble: Pebble, config: Config,
                     *, policy: Policy = FAST) -> Edge:
    stats = Stats()
    certs = CertManager(state_dir=tmp / "state", stats=stats, policy=policy)
    certs.update(config)
    router = Router(config, stats=stats, backends=Backends(), terminator=EchoTerminator(),
                    certs=certs)
    listeners = await trio.open_tcp_listeners(pebble.tls_port, host="127.0.0.1")
    await nursery.start(router.serve, listeners)
    await nursery.start(serve_http, Address("127.0.0.1", pebble.http_port), certs)
    await nursery.start(certs.run)
    edge = Edge(pebble, config, certs, stats, nursery)
    edge.router = router
    return edge


@pytest.fixture(autouse=True)
def _logs() -> Iterator[None]:
    """Readable logs on stderr for these long runs. The package logger is process-wide
    (`logs.setup` replaces its handlers and turns propagation off), so it is put back as
    found: tests after these must not inherit it."""
    logger = logging.getLogger("pact_ingress")
    saved = (logger.handlers[:], logger.level, logger.propagate, logs._direct)
    log_setup("text")
    yield
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])
    logger.propagate = saved[2]
    logs._direct = saved[3]


# ------------------------------------------------------------------------------ clients
@dataclass
class Handshake:
    cert: x509.Certificate
    tls: trio.SSLStream[trio.SocketStream]

    @property
    def serial(self) -> int:
        return self.cert.serial_number


async def connect(port: int, host: str, root_pem: bytes | None) -> Handshake:
    """TLS to the router with SNI `host`; with `root_pem` the chain must verify to it."""
    ctx = ssl.create_default_context()
    if root_pem is None:
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    else:
        ctx.load_verify_locations(cadata=root_pem.decode())
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, ctx, server_hostname=host)
    await tls.do_handshake()
    der = tls.getpeercert(binary_form=True)
    return Handshake(x509.load_der_x509_certificate(der), tls)


async def wait_served(edge: Edge, sni: str, *, root: bool = True,
                      not_serial: int | None = None) -> Handshake:
    """Retry handshakes until a certificate (other than `not_serial`) is served."""
    root_pem = edge.pebble.root_pem() if root else None
    with trio.fail_after(WAIT):
        while True:  # bounded by fail_after
            try:
                hs = await connect(edge.pebble.tls_port, sni, root_pem)
            except (trio.BrokenResourceError, ssl.SSLError, OSError):
                await trio.sleep(0.05)
                continue
            if not_serial is None or hs.serial != not_serial:
                return hs
            await trio.aclose_forcefully(hs.tls)
            await trio.sleep(0.1)


def san_names(cert: x509.Certificate) -> list[str]:
    return cert.extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)


# ------------------------------------------------------------------------------ tests
async def test_tls_alpn_01_issuance_served_on_next_handshake(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    """update() with a new terminate host → TLS-ALPN-01 via the real router → served.

    Also measures time-to-certificate (update() → first verified handshake), logged."""
    host = "alpn.pact.test"
    config = acme_config(tmp_path, pebble, [], challenges=("tls-alpn-01",))
    edge = await start_edge(nursery, tmp_path, pebble, config)
    t0 = time.monotonic()
    edge.add_host(host)
    assert edge.certs.server_context(edge.route(host)) is None  # nothing yet: alert, log
    hs = await wait_served(edge, host)
    elapsed = time.monotonic() - t0
    print(f"\nTIME-TO-CERT tls-alpn-01: {elapsed:.2f} s")
    assert san_names(hs.cert) == [host]
    assert edge.certs.orders_sent == 1
    await hs.tls.send_all(b"ping\n")
    assert await hs.tls.receive_some(100) == b"ping\n"
    await hs.tls.aclose()
    # persisted: key 0600, listed offline, metric set
    [info] = list_store(tmp_path / "state")
    assert info.host == host and info.not_after == hs.cert.not_valid_after_utc.timestamp()
    assert info.issuer and info.issuer.startswith("Pebble Intermediate")
    keys = list((tmp_path / "state" / "acme").rglob("*.key"))
    assert len(keys) == 2 and all(k.stat().st_mode & 0o777 == 0o600 for k in keys)
    assert edge.stats.value("pact_ingress_certificate_expiry_timestamp_seconds",
                            {"host": host}) == info.not_after
    assert edge.stats.value("pact_ingress_rejections_total", {"reason": "acme_no_challenge"}) == 0


async def test_http_01_issuance_and_account_reuse(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    """HTTP-01 through the real :80 listener; a restart reuses account and certificate."""
    host = "http.pact.test"
    config = acme_config(tmp_path, pebble, [host], challenges=("http-01",))
    async with trio.open_nursery() as first_run:
        edge = await start_edge(first_run, tmp_path, pebble, config)
        hs = await wait_served(edge, host)
        assert san_names(hs.cert) == [host]
        await hs.tls.aclose()
        first_run.cancel_scope.cancel()
    acct_dir = next((tmp_path / "state" / "acme" / "accounts").iterdir())
    registration = (acct_dir / "registration.json").read_bytes()
    account_key = (acct_dir / "account.key").read_bytes()
    assert (acct_dir / "account.key").stat().st_mode & 0o777 == 0o600
    # "restart": a new edge on the same state_dir serves the stored certificate at once
    edge = await start_edge(nursery, tmp_path, pebble, config)
    assert edge.certs.server_context(edge.route(host)) is not None
    again = await wait_served(edge, host)
    assert again.serial == hs.serial
    await again.tls.aclose()
    assert edge.certs.orders_sent == 0
    # and a forced renewal orders with the same account (no new registration)
    await edge.certs.renew(host)
    assert edge.certs.orders_sent == 1
    assert (acct_dir / "registration.json").read_bytes() == registration
    assert (acct_dir / "account.key").read_bytes() == account_key


async def test_dedup_20_handshakes_one_order(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    host = "dedup.pact.test"
    config = acme_config(tmp_path, pebble, [], challenges=("tls-alpn-01",))
    edge = await start_edge(nursery, tmp_path, pebble, config)
    edge.add_host(host)
    outcomes: list[str] = []

    async def one() -> None:
        try:
            hs = await connect(pebble.tls_port, host, None)
            outcomes.append("cert")
            await hs.tls.aclose()
        except (trio.BrokenResourceError, ssl.SSLError, OSError):
            outcomes.append("alert")

    with trio.fail_after(WAIT):
        async with trio.open_nursery() as n:
            for _ in range(20):
                n.start_soon(one)
    assert len(outcomes) == 20
    hs = await wait_served(edge, host)
    await hs.tls.aclose()
    assert edge.certs.orders_sent == 1


async def test_dns_01_wildcard_with_bind9(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Wildcard route → DNS-01 by RFC 2136 + TSIG into bind9; pebble resolves via bind9."""
    named = Named(tmp_path / "named", "dns.test.", hosts=("www",)).start()
    p = Pebble(tmp_path / "pebble-dns", f"127.0.0.1:{named.port}",
               http_port=free_port(), tls_port=free_port()).start()
    try:
        dns01 = Dns01(Address("127.0.0.1", named.port), "dns.test.", named.key_file)
        config = acme_config(tmp_path, p, ["*.wild.dns.test"], challenges=("dns-01",),
                             dns01=dns01)
        edge = await start_edge(nursery, tmp_path, p, config)
        hs = await wait_served(edge, "anything.wild.dns.test")
        assert san_names(hs.cert) == ["*.wild.dns.test"]
        await hs.tls.aclose()
        # the challenge record was removed again
        import dns.message
        import dns.query
        q = dns.message.make_query("_acme-challenge.wild.dns.test.", "TXT")
        resp = dns.query.udp(q, "127.0.0.1", port=named.port, timeout=2)
        assert resp.answer == []
    finally:
        p.stop()
        named.stop()


async def test_renewal_short_lived_cert_in_flight_unaffected(
        nursery: trio.Nursery, tmp_path: Path, short_pebble: Pebble) -> None:
    host = "renew.pact.test"
    config = acme_config(tmp_path, short_pebble, [host], challenges=("tls-alpn-01",))
    edge = await start_edge(nursery, tmp_path, short_pebble, config)
    first = await wait_served(edge, host)
    # the scheduler renews on its own once a third of the 6 s lifetime remains
    second = await wait_served(edge, host, not_serial=first.serial)
    assert second.cert.not_valid_after_utc > first.cert.not_valid_after_utc
    # the connection made with the old certificate still works
    await first.tls.send_all(b"still here\n")
    assert await first.tls.receive_some(100) == b"still here\n"
    for hs in (first, second):
        await hs.tls.aclose()
    assert edge.stats.value("pact_ingress_certificate_failures_total",
                            {"host": host, "reason": "ca_unreachable"}) == 0


async def test_ca_down_backoff_old_cert_serves_then_recovers(
        nursery: trio.Nursery, tmp_path: Path, short_pebble: Pebble) -> None:
    host = "outage.pact.test"
    config = acme_config(tmp_path, short_pebble, [host], challenges=("tls-alpn-01",))
    edge = await start_edge(nursery, tmp_path, short_pebble, config)
    first = await wait_served(edge, host, root=False)
    await first.tls.aclose()
    short_pebble.stop()
    labels = {"host": host, "reason": "ca_unreachable"}
    with trio.fail_after(WAIT):
        while edge.stats.value("pact_ingress_certificate_failures_total", labels) < 2:
            await trio.sleep(0.1)
    # renewal keeps failing with backoff; the previous certificate is still served
    still = await wait_served(edge, host, root=False)
    assert still.serial == first.serial
    await still.tls.aclose()
    [info] = edge.certs.inventory()
    assert info.last_error and "unreachable" in info.last_error
    short_pebble.start()  # a fresh pebble: it has forgotten our account (re-registered)
    renewed = await wait_served(edge, host, not_serial=first.serial)
    await renewed.tls.aclose()
    assert edge.certs.inventory()[0].last_error is None


async def test_forced_renew_and_unknown_hosts(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    host = "forced.pact.test"
    config = acme_config(tmp_path, pebble, [host], challenges=("tls-alpn-01",))
    edge = await start_edge(nursery, tmp_path, pebble, config)
    first = await wait_served(edge, host)
    await first.tls.aclose()
    lines: list[str] = []
    await edge.certs.renew(host, progress=lines.append)
    assert lines[0] == f"{host}: ordering a new certificate"
    assert lines[-1].startswith(f"{host}: issued by Pebble Intermediate")
    second = await wait_served(edge, host, not_serial=first.serial)
    await second.tls.aclose()
    from pact_ingress.errors import AcmeError
    with pytest.raises(AcmeError, match="not a terminate route"):
        await edge.certs.renew("other.pact.test")
    assert edge.certs.orders_sent == 2



async def test_no_account_without_agree_tos(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    host = "tos.pact.test"
    config = acme_config(tmp_path, pebble, [host], challenges=("tls-alpn-01",))
    assert config.acme is not None
    config = replace(config, acme=replace(config.acme, agree_tos=False))
    edge = await start_edge(nursery, tmp_path, pebble, config)
    with trio.fail_after(WAIT):
        while not edge.certs.inventory()[0].last_error:
            await trio.sleep(0.05)
    assert "agree_tos" in (edge.certs.inventory()[0].last_error or "")
    assert edge.stats.value("pact_ingress_certificate_failures_total",
                            {"host": host, "reason": "tos"}) == 1
    assert not list((tmp_path / "state").rglob("registration.json"))
    assert edge.certs.server_context(edge.route(host)) is None


async def test_serve_process_issues_and_certs_cli_renews(tmp_path: Path, pebble: Pebble) -> None:
    """The real `pact-ingress serve` with an `acme:` block issues on start; `certs list`
    shows it offline; `certs renew HOST` (through the admin endpoint) gets a new one that
    the very next handshake serves."""
    import subprocess
    import sys

    from pact_ingress.identity import keygen

    host = "cli.pact.test"
    admin = free_port()
    node = keygen(tmp_path / "node.key")
    cfg = tmp_path / "ingress.yaml"
    cfg.write_text(pebble.serve_yaml(tls=pebble.tls_port, http=pebble.http_port, admin=admin,
                                     pin=node.fingerprint, host=host))
    cli = [sys.executable, "-m", "pact_ingress"]
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([*cli, "serve", "-c", str(cfg)], stdout=log, stderr=log)
    try:
        import types

        edge = types.SimpleNamespace(pebble=pebble)  # wait_served only needs the CA
        first = await wait_served(edge, host)
        assert san_names(first.cert) == [host]
        await trio.aclose_forcefully(first.tls)

        listing = await trio.run_process([*cli, "certs", "list", "-c", str(cfg)],
                                         capture_stdout=True, capture_stderr=True)
        row = next(l for l in listing.stdout.decode().splitlines() if l.startswith(host))
        assert "acme" in row and "Pebble" in row

        renew = await trio.run_process([*cli, "certs", "renew", host, "-c", str(cfg)],
                                       capture_stdout=True, capture_stderr=True, check=False)
        assert renew.returncode == 0, renew.stderr.decode()
        assert host in renew.stderr.decode()  # the progress line names what it renews
        second = await wait_served(edge, host, not_serial=first.serial)
        assert second.serial != first.serial
        await trio.aclose_forcefully(second.tls)
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT)
        log.close()


def _files_cert(tmp_path: Path, host: str) -> str:
    """A self-signed P-256 certificate for `host` in tmp_path/certs; the route's `cert:`."""
    (tmp_path / "certs").mkdir()
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
                    "-subj", f"/CN={host}", "-addext", f"subjectAltName=DNS:{host}",
                    "-keyout", str(tmp_path / "certs/f.key"), "-out", str(tmp_path / "certs/f.crt")],
                   check=True, capture_output=True)
    return "{cert: certs/f.crt, key: certs/f.key}"


def _files_tenant(tmp_path: Path, files_host: str) -> str:
    """The `tenants:` block of a serve with one certificate-files route (`files_host`,
    a node that is never dialled); a reload appends routes to it."""
    node = keygen(tmp_path / "node.key")
    return (f'tenants:\n  - name: t\n    pins: ["{node.fingerprint}"]\n    routes:\n'
            f'      - {{host: {files_host}, mode: terminate, backend: "127.0.0.1:9", '
            f'cert: {_files_cert(tmp_path, files_host)}}}\n')


@contextmanager
def _serve_process(tmp_path: Path, config: str) -> Iterator[tuple[subprocess.Popen, Path]]:
    """`pact-ingress serve` (two workers) on `config`; (the process, its config file).
    On the way out: stopped, and its log holds no traceback and no refused reload."""
    cfg = tmp_path / "ingress.yaml"
    cfg.write_text(config)
    with open(tmp_path / "serve.log", "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "pact_ingress", "serve", "-c",
                                 str(cfg), "--workers", "2"], stdout=log, stderr=log)
        try:
            yield proc, cfg
        finally:
            proc.terminate()
            proc.wait(timeout=WAIT)
    text = (tmp_path / "serve.log").read_text()
    assert "Traceback" not in text and "reload_refused" not in text, text[-3000:]


@pytest.mark.parametrize("challenge", ["tls-alpn-01", "http-01"])
async def test_a_reload_that_adds_acme_to_a_files_only_serve_issues(
        tmp_path: Path, pebble: Pebble, challenge: str) -> None:
    """`pact-ingress serve` (two worker processes) starts with a certificate-files route
    only, so it has not loaded the ACME client; SIGHUP to a config that adds an `acme:`
    block and an ACME route: the certificate is issued and served, with the challenge
    answered by the running processes (the ACME client loaded on that first order)."""
    files_host, host = "files.pact.test", f"added-{challenge.split('-')[0]}.pact.test"
    head = f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{pebble.tls_port}"]
  http: ["127.0.0.1:{pebble.http_port}"]
  admin: "127.0.0.1:{free_port()}"
"""
    tenant = _files_tenant(tmp_path, files_host)
    with _serve_process(tmp_path, head + tenant) as (proc, cfg):
        edge = types.SimpleNamespace(pebble=pebble)
        files = await wait_served(edge, files_host, root=False)
        assert san_names(files.cert) == [files_host]
        await trio.aclose_forcefully(files.tls)
        cfg.write_text(head + pebble.acme_yaml(challenge) + tenant + f'      - {{host: {host}, '
                       'mode: terminate, backend: "127.0.0.1:9", cert: acme}\n')
        proc.send_signal(signal.SIGHUP)
        issued = await wait_served(edge, host)
        assert san_names(issued.cert) == [host]
        await trio.aclose_forcefully(issued.tls)
        assert proc.poll() is None


async def test_a_reload_that_adds_dns01_to_a_files_only_serve_issues(tmp_path: Path) -> None:
    """As above with DNS-01 (RFC 2136 + TSIG into bind9) for a wildcard route: the
    solver, and dnspython with it, is first loaded by the reload that configures it."""
    named = Named(tmp_path / "named", "dns.test.", hosts=("www",)).start()
    p = Pebble(tmp_path / "pebble-dns", f"127.0.0.1:{named.port}",
               http_port=free_port(), tls_port=free_port()).start()
    try:
        files_host = "files.dns.test"
        head = f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{p.tls_port}"]
  admin: "127.0.0.1:{free_port()}"
"""
        tenant = _files_tenant(tmp_path, files_host)
        with _serve_process(tmp_path, head + tenant) as (proc, cfg):
            edge = types.SimpleNamespace(pebble=p)
            files = await wait_served(edge, files_host, root=False)
            await trio.aclose_forcefully(files.tls)
            dns01 = (f'dns01: {{server: "127.0.0.1:{named.port}", zone: dns.test., '
                     f'tsig_key_file: {named.key_file}}}')
            cfg.write_text(head + p.acme_yaml("dns-01", dns01) + tenant + '      - {host: '
                           '"*.wild.dns.test", mode: terminate, backend: "127.0.0.1:9", '
                           'cert: acme}\n')
            proc.send_signal(signal.SIGHUP)
            issued = await wait_served(edge, "anything.wild.dns.test")
            assert san_names(issued.cert) == ["*.wild.dns.test"]
            await trio.aclose_forcefully(issued.tls)
            assert proc.poll() is None
    finally:
        p.stop()
        named.stop()
