"""The certificate path attacked: hostile TLS-ALPN-01 clients, a flaky CA, reloads that
race an order. Real pebble (challtestsrv as its DNS), the real router on pebble's
TLS-ALPN port and the real CertManager, as in `test_acme_e2e` (whose fixtures and
helpers these reuse).
"""

from __future__ import annotations

import contextlib
import json
import signal
import ssl
import stat
import subprocess
import sys
import types
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import trio
from cryptography import x509

from pact_ingress.acme.tlsalpn import ACME_IDENTIFIER_OID
from pact_ingress.identity import keygen
from pact_ingress.logs import setup as log_setup
from tests import test_acme_e2e as e2e
from tests.acme_servers import ChallTestSrv, Pebble, free_port
from tests.test_acme_e2e import (  # noqa: F401 - _logs: the autouse log fixture
    FAST,
    WAIT,
    _logs,
    acme_config,
    san_names,
    start_edge,
    wait_served,
)

#: the module's CA and its DNS: the end-to-end tests' fixtures
challtestsrv = e2e.challtestsrv
pebble = e2e.pebble


@pytest.fixture
def events(_logs: None, tmp_path: Path) -> Iterator[Path]:  # noqa: F811 - after it
    """A file the package's log lines (text format) go to during the test (`_logs`
    puts the logger back afterwards)."""
    path = tmp_path / "events.log"
    with open(path, "w") as out:
        log_setup("text", stream=out)
        yield path
        log_setup("text")


async def alpn_handshake(port: int, sni: str, alpn: list[str]
                         ) -> tuple[str | None, x509.Certificate]:
    """(negotiated ALPN, certificate) of a handshake that verifies nothing."""
    ctx = ssl.create_default_context()
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    ctx.set_alpn_protocols(alpn)
    tcp = await trio.open_tcp_stream("127.0.0.1", port)
    tls = trio.SSLStream(tcp, ctx, server_hostname=sni)
    try:
        with trio.fail_after(5):
            await tls.do_handshake()
        der = tls.getpeercert(binary_form=True)
        assert der is not None
        return tls.selected_alpn_protocol(), x509.load_der_x509_certificate(der)
    finally:
        await trio.aclose_forcefully(tls)


def is_challenge_cert(cert: x509.Certificate) -> bool:
    try:
        cert.extensions.get_extension_for_oid(ACME_IDENTIFIER_OID)
    except x509.ExtensionNotFound:
        return False
    return True


async def test_a_client_offering_acme_tls_among_others_is_served_like_any_client(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    """RFC 8737: the CA offers `acme-tls/1` alone, and only such a hello is a validation.
    A client that lists it beside h2 or http/1.1 is an ordinary client: once the name has
    its certificate it gets that certificate and h2/http/1.1, not a refusal."""
    host = "mixed.pact.test"
    edge = await start_edge(nursery, tmp_path, pebble,
                            acme_config(tmp_path, pebble, [host], challenges=("tls-alpn-01",)))
    first = await wait_served(edge, host)
    await trio.aclose_forcefully(first.tls)
    for offer, want in ((["h2", "acme-tls/1"], "h2"),
                        (["acme-tls/1", "http/1.1"], "http/1.1")):
        proto, cert = await alpn_handshake(pebble.tls_port, host, offer)
        assert (proto, cert.serial_number) == (want, first.serial), offer
        assert not is_challenge_cert(cert)
    # alone, with nothing pending: refused, never a certificate
    try:
        got = await alpn_handshake(pebble.tls_port, host, ["acme-tls/1"])
    except (trio.BrokenResourceError, ssl.SSLError, OSError):
        got = None
    assert got is None
    assert edge.certs.orders_sent == 1


async def test_a_route_removed_and_added_back_during_its_order_is_ordered_once(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    """Two reloads while a name's order is in flight, the first dropping the route and
    the second bringing it back: the order already running is the name's order (one
    new-order at the CA, one challenge answer at a time), and what it issues is served."""
    host = "flap.pact.test"
    config = acme_config(tmp_path, pebble, [], challenges=("tls-alpn-01",))
    edge = await start_edge(nursery, tmp_path, pebble, config)
    edge.add_host(host)
    with trio.fail_after(WAIT):
        while not edge.certs._hosts[host].busy:  # the scheduler took it up
            await trio.lowlevel.checkpoint()
    with_host = edge.config
    edge.remove_host(host)
    edge.reload(with_host)
    hs = await wait_served(edge, host)
    assert san_names(hs.cert) == [host]
    await trio.aclose_forcefully(hs.tls)
    # (only an installed order is served: a second one would have been sent by now)
    assert edge.certs.orders_sent == 1


# ------------------------------------------------------------------------------ a flaky CA
async def test_a_ca_refusing_half_the_nonces_still_issues(
        nursery: trio.Nursery, tmp_path: Path, challtestsrv: ChallTestSrv,
        events: Path) -> None:
    """Pebble rejects half of the good nonces as badNonce. A refused request is sent
    again with a fresh nonce (several times in a row if need be), so the orders go
    through without being thrown away and started over: each one an order at the CA
    and from the budget (with one retry per request, as the acme library does, about
    nine in ten orders of some eight requests failed here). What still fails is a
    one-line error and is retried with backoff."""
    p = Pebble(tmp_path / "pebble-nonce", f"127.0.0.1:{challtestsrv.dns_port}",
               http_port=free_port(), tls_port=free_port(),
               env={"PEBBLE_WFE_NONCEREJECT": "50"}).start()
    try:
        hosts = [f"nonce{i}.pact.test" for i in range(3)]
        edge = await start_edge(nursery, tmp_path, p,
                                acme_config(tmp_path, p, hosts, challenges=("tls-alpn-01",)))
        for host in hosts:
            hs = await wait_served(edge, host)
            assert san_names(hs.cert) == [host]
            await trio.aclose_forcefully(hs.tls)
        assert all(r.last_error is None for r in edge.certs.inventory())
        # (a request gives up after nine refusals in a row: odds of 1 in 512)
        assert edge.certs.orders_sent <= len(hosts) + 2, edge.certs.orders_sent
        # the fault was real: a fresh nonce is fetched only at the start and after a
        # rejected one (some two dozen requests, each refused with odds of one half)
        assert p.log.count("HEAD /nonce-plz") > 1
        text = events.read_text()
        assert "Traceback" not in text
        for line in text.splitlines():  # failures, if any, are one-line events
            if "cert_order_failed" in line:
                assert "badNonce" in line, line
    finally:
        p.stop()


# ------------------------------------------------------------------------------ kill -9
async def _pipe_to(client: trio.SocketStream, port: int) -> None:
    """Carry `client`'s bytes to 127.0.0.1:`port` and back (bounded by WAIT)."""
    try:
        up = await trio.open_tcp_stream("127.0.0.1", port)
    except OSError:
        return
    async with up:
        async def pipe(a: trio.abc.Stream, b: trio.abc.Stream) -> None:
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                while data := await a.receive_some(65536):
                    await b.send_all(data)
                with contextlib.suppress(OSError):
                    await b.send_eof()

        with trio.move_on_after(WAIT):
            async with trio.open_nursery() as n:
                n.start_soon(pipe, client, up)
                n.start_soon(pipe, up, client)


def _serve(config: Path, log_path: Path) -> subprocess.Popen[bytes]:
    """`pact-ingress serve -c config`, its output appended to `log_path`."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "pact_ingress", "serve", "--workers",
                                 "1", "-c", str(config)], stdout=log, stderr=log)


async def test_serve_killed_mid_order_restarts_into_one_more_order(
        tmp_path: Path, pebble: Pebble) -> None:
    """`pact-ingress serve` is killed (SIGKILL) while the CA validates its first order;
    started again on the same state it reuses its account, orders once more and
    serves the certificate; the store holds one certificate and key (0600) that meta
    names, the account key is 0600, and neither run logged a traceback."""
    host = "killed.pact.test"
    serve_port = free_port()
    node = keygen(tmp_path / "node.key")
    cfg = tmp_path / "ingress.yaml"
    cfg.write_text(pebble.serve_yaml(tls=serve_port, admin=free_port(), pin=node.fingerprint,
                                     host=host))
    orders_before = pebble.log.count("Added order")
    accounts_before = pebble.log.count("accounts in memory")
    procs: list[subprocess.Popen[bytes]] = []
    killed = trio.Event()

    async def gate(client: trio.SocketStream) -> None:
        """pebble's TLS-ALPN-01 port: the first validation kills serve mid-order, the
        later ones reach whichever serve runs now."""
        async with client:
            if not killed.is_set():
                procs[-1].kill()
                procs[-1].wait()
                killed.set()
                return
            await _pipe_to(client, serve_port)

    log_path = tmp_path / "serve.log"
    async with trio.open_nursery() as nursery:
        listeners = await trio.open_tcp_listeners(pebble.tls_port, host="127.0.0.1")
        await nursery.start(trio.serve_listeners, gate, listeners)
        procs.append(_serve(cfg, log_path))
        try:
            with trio.fail_after(WAIT):
                await killed.wait()
            assert procs[0].returncode == -signal.SIGKILL
            procs.append(_serve(cfg, log_path))
            edge = types.SimpleNamespace(pebble=replace(pebble, tls_port=serve_port))
            hs = await wait_served(edge, host)
            assert san_names(hs.cert) == [host]
            await trio.aclose_forcefully(hs.tls)
            assert procs[1].poll() is None
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait(WAIT)
        nursery.cancel_scope.cancel()

    assert pebble.log.count("Added order") - orders_before == 2  # the killed one, one more
    assert pebble.log.count("accounts in memory") - accounts_before == 1  # reused
    certs = tmp_path / "state" / "acme" / "certs" / host
    meta = json.loads((certs / "meta.json").read_text())
    assert sorted(p.name for p in certs.iterdir()) == sorted(
        [f"{meta['serial']}.key", f"{meta['serial']}.pem", "meta.json"])
    assert int(meta["serial"], 16) == hs.serial
    assert stat.S_IMODE((certs / f"{meta['serial']}.key").stat().st_mode) == 0o600
    (key,) = (tmp_path / "state" / "acme" / "accounts").rglob("account.key")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    text = log_path.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]


async def test_ca_gone_mid_order_and_back_the_order_is_retried_and_issued(
        nursery: trio.Nursery, tmp_path: Path, challtestsrv: ChallTestSrv,
        events: Path) -> None:
    """The CA stops while an order waits for its validation and comes back having
    forgotten everything (pebble keeps nothing: not the order, not the account). The
    order fails as one line, backs off, and the retry registers the same key again and
    issues; the name issued before keeps being served throughout."""
    p = Pebble(tmp_path / "pebble-gone", f"127.0.0.1:{challtestsrv.dns_port}",
               http_port=free_port(), tls_port=free_port()).start()
    try:
        old, new = "before.pact.test", "during.pact.test"
        edge = await start_edge(nursery, tmp_path, p,
                                acme_config(tmp_path, p, [old], challenges=("tls-alpn-01",)))
        first = await wait_served(edge, old)
        await trio.aclose_forcefully(first.tls)
        edge.add_host(new)
        with trio.fail_after(WAIT):
            while new not in edge.certs._alpn:  # its challenge is offered: mid-order
                await trio.lowlevel.checkpoint()
        p.stop()
        with trio.fail_after(WAIT):
            while not edge.certs._hosts[new].failures:  # the order ended, failed
                await trio.sleep(0.05)
        still = await wait_served(edge, old, root=False)
        assert still.serial == first.serial
        await trio.aclose_forcefully(still.tls)
        await trio.to_thread.run_sync(p.start)
        hs = await wait_served(edge, new)
        assert san_names(hs.cert) == [new]
        await trio.aclose_forcefully(hs.tls)
        text = events.read_text()
        assert "Traceback" not in text
        failed = [line for line in text.splitlines() if "cert_order_failed" in line]
        assert failed and all("during.pact.test" in line for line in failed)
    finally:
        p.stop()


# ------------------------------------------------------------------------------ reloads
async def test_a_reload_to_another_ca_replaces_certificates_like_a_restart_does(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble, challtestsrv: ChallTestSrv) -> None:
    """The operator moves `acme.directory` to another CA (staging to production) and
    reloads. A restart orders every name from the new CA at once (its certificates are
    the old CA's); a reload must too, not serve the old CA's until their renewal time,
    weeks away. Meanwhile the old certificate keeps serving."""
    host = "moved.pact.test"
    edge = await start_edge(nursery, tmp_path, pebble,
                            acme_config(tmp_path, pebble, [host], challenges=("tls-alpn-01",)))
    first = await wait_served(edge, host)
    await trio.aclose_forcefully(first.tls)
    other = Pebble(tmp_path / "pebble-other", f"127.0.0.1:{challtestsrv.dns_port}",
                   http_port=pebble.http_port, tls_port=pebble.tls_port).start()
    try:
        edge.reload(replace(edge.config, acme=replace(
            edge.config.acme, directory=other.directory, ca_bundle=other.ca_bundle)))
        edge.pebble = other
        hs = await wait_served(edge, host)  # verified against the new CA's root
        assert hs.serial != first.serial
        await trio.aclose_forcefully(hs.tls)
    finally:
        other.stop()


async def test_sighup_dropping_a_name_mid_order_and_adding_another(
        tmp_path: Path, pebble: Pebble) -> None:
    """`pact-ingress serve` orders A; while the CA validates A, SIGHUP to a config
    without A and with B. A is refused from then on (its order ends, abandoned, not
    counted as A's failure, and is not retried: no order for it lingers), B is ordered
    and served, and the process logs no traceback."""
    a, b = "dropped.pact.test", "added.pact.test"
    serve_port = free_port()
    node = keygen(tmp_path / "node.key")
    cfg = tmp_path / "ingress.yaml"

    def config(host: str) -> str:
        return pebble.serve_yaml(tls=serve_port, admin=admin, pin=node.fingerprint, host=host)

    admin = free_port()
    cfg.write_text(config(a))
    orders_before = pebble.log.count("Added order")
    log_path = tmp_path / "serve.log"
    proc = _serve(cfg, log_path)
    reloaded = trio.Event()

    async def refused(host: str) -> bool:
        try:
            await alpn_handshake(serve_port, host, ["h2"])
        except (trio.BrokenResourceError, ssl.SSLError, OSError):
            return True
        return False

    async def gate(client: trio.SocketStream) -> None:
        """pebble's TLS-ALPN-01 port: A's first validation waits for the reload."""
        async with client:
            if not reloaded.is_set():
                reloaded.set()
                cfg.write_text(config(b))
                proc.send_signal(signal.SIGHUP)
                with trio.fail_after(WAIT):
                    while "\"reloaded\"" not in log_path.read_text(errors="replace"):
                        await trio.sleep(0.05)
            await _pipe_to(client, serve_port)

    try:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(pebble.tls_port, host="127.0.0.1")
            await nursery.start(trio.serve_listeners, gate, listeners)
            with trio.fail_after(WAIT):
                await reloaded.wait()
            edge = types.SimpleNamespace(pebble=replace(pebble, tls_port=serve_port))
            hs = await wait_served(edge, b)
            assert san_names(hs.cert) == [b]
            await trio.aclose_forcefully(hs.tls)
            with trio.fail_after(WAIT):  # A's order ends (abandoned: A left the config)
                while f'"host":"{a}"' not in "".join(
                        line for line in log_path.read_text(errors="replace").splitlines()
                        if "cert_order_abandoned" in line):
                    await trio.sleep(0.05)
            assert await refused(a)
            nursery.cancel_scope.cancel()
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(WAIT)
    assert pebble.log.count("Added order") - orders_before == 2  # A's, B's: no retry of A
    text = log_path.read_text(errors="replace")
    assert "Traceback" not in text, text[-3000:]
    assert text.count("cert_order_abandoned") == 1, text[-3000:]
    assert "cert_order_failed" not in text, text[-3000:]


async def test_long_chain_and_reused_authorizations(
        nursery: trio.Nursery, tmp_path: Path, challtestsrv: ChallTestSrv) -> None:
    """A CA with four intermediates that reuses valid authorizations: the first order
    validates, a forced renewal finalizes at once on the authorization it reuses, and
    each served chain verifies to the CA's root."""
    p = Pebble(tmp_path / "pebble-chain", f"127.0.0.1:{challtestsrv.dns_port}",
               http_port=free_port(), tls_port=free_port(),
               env={"PEBBLE_CHAIN_LENGTH": "6", "PEBBLE_AUTHZREUSE": "100"}).start()
    try:
        host = "chain.pact.test"
        edge = await start_edge(nursery, tmp_path, p,
                                acme_config(tmp_path, p, [host], challenges=("tls-alpn-01",)))
        first = await wait_served(edge, host)
        await trio.aclose_forcefully(first.tls)
        with trio.fail_after(WAIT):
            await edge.certs.renew(host)
        second = await wait_served(edge, host, not_serial=first.serial)
        await trio.aclose_forcefully(second.tls)
        assert edge.certs.orders_sent == 2
        stored = edge.certs._hosts[host].cert
        assert stored is not None
        assert len(x509.load_pem_x509_certificates(stored.chain_pem)) >= 5
    finally:
        p.stop()


async def test_certs_renew_takes_a_name_however_it_is_spelled(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    """Host names are case-insensitive and may end in a dot, and the config takes them
    so; `certs renew NAME` (admin: /certs/renew?host=) must too, not answer that the
    route it names is not configured."""
    host = "spelled.pact.test"
    edge = await start_edge(nursery, tmp_path, pebble,
                            acme_config(tmp_path, pebble, [host], challenges=("tls-alpn-01",)))
    first = await wait_served(edge, host)
    await trio.aclose_forcefully(first.tls)
    with trio.fail_after(WAIT):
        await edge.certs.renew("Spelled.PACT.test.")
    second = await wait_served(edge, host, not_serial=first.serial)
    await trio.aclose_forcefully(second.tls)
    assert edge.certs.orders_sent == 2


async def test_an_order_dropped_by_a_reload_does_not_spend_the_names_budget(
        nursery: trio.Nursery, tmp_path: Path, pebble: Pebble) -> None:
    """A reload drops a name while the CA is about to validate it: the validation fails
    (the name is no longer answered), but that is the operator's doing, not a failed
    validation of the name. With one failed validation per hour allowed, the name added
    back is ordered at once, not deferred for an hour."""
    host = "dropped-budget.pact.test"
    config = acme_config(tmp_path, pebble, [], challenges=("tls-alpn-01",))
    edge = await start_edge(nursery, tmp_path, pebble, config,
                            policy=replace(FAST, failed_validations_per_host=1))
    edge.add_host(host)
    with_host = edge.config
    with trio.fail_after(WAIT):
        while host not in edge.certs._alpn:  # offered; the CA has not come yet
            await trio.lowlevel.checkpoint()
    edge.remove_host(host)
    with trio.fail_after(WAIT):
        while edge.certs._leaving:  # the dropped order ended
            await trio.sleep(0.05)
    edge.reload(with_host)
    hs = await wait_served(edge, host)
    assert san_names(hs.cert) == [host]
    await trio.aclose_forcefully(hs.tls)
