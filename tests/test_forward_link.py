"""The forward link in one process: a real TCP listener serves `Forwarder.handle`, another
`Forwarder` opens links to it. Bytes flow both ways (with half-close) once the holder
says OK; every refusal — unknown peer, no tunnel, wrong key, garbage, a dead address —
ends as a BackendError for the caller and a counted outcome on each side."""

from __future__ import annotations

import functools
import socket
import ssl
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from pact_ingress.errors import BackendError
from pact_ingress.identity import keygen, pinned_client_context
from pact_ingress.net.forward import Forwarder
from pact_ingress.net.replay import ReplayStream
from pact_ingress.proto.tunnel.constants import ALPN_FORWARD
from pact_ingress.stats import Stats

HOST = "tunnel.forward.test"


class Registry:
    def __init__(self, holders: dict[str, str]) -> None:
        self.holders = holders  # fingerprint → address

    def holders_of(self, tenant: str) -> list[str]:
        return list(self.holders)

    def address_of(self, fingerprint: str) -> str | None:
        return self.holders.get(fingerprint)


class Tunnels:
    def __init__(self) -> None:
        self.ends: list[socket.socket] = []
        self.absent = False

    async def open_stream(self, tenant: str) -> trio.abc.Stream:
        if self.absent:
            raise BackendError(f"no live tunnel for tenant {tenant}")
        ours, theirs = socket.socketpair()
        self.ends.append(theirs)
        return trio.SocketStream(trio.socket.from_stdlib_socket(ours))


def _config(peers: list[str]) -> Any:
    return SimpleNamespace(state=SimpleNamespace(redis=SimpleNamespace(peers=tuple(peers))),
                           tunnel_hostname=HOST, routes=lambda: ())


def _count(fwd: Forwarder, side: str, outcome: str) -> float:
    return fwd.stats.forwards.labels(side, outcome)._value.get()


@pytest.fixture
def keys(tmp_path: Path) -> Any:
    return SimpleNamespace(a=keygen(tmp_path / "a.key"), b=keygen(tmp_path / "b.key"),
                           c=keygen(tmp_path / "c.key"))


async def _holder(nursery: trio.Nursery, fwd: Forwarder,
                  admit: Any = None) -> str:
    async def serve(stream: trio.SocketStream) -> None:
        await fwd.handle(ReplayStream(b"", stream), ("127.0.0.1", 1), admit)
        await trio.aclose_forcefully(stream)

    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, serve, 0, host="127.0.0.1"))
    host, port = listeners[0].socket.getsockname()[:2]
    return f"{host}:{port}"


async def test_bytes_flow_after_ok(keys: Any) -> None:
    tunnels = Tunnels()
    b = Forwarder(identity=keys.b, stats=Stats(), registry=Registry({}), tunnels=tunnels,
                  config=_config([keys.a.fingerprint]))
    async with trio.open_nursery() as nursery:
        address = await _holder(nursery, b)
        a = Forwarder(identity=keys.a, stats=Stats(),
                      registry=Registry({keys.b.fingerprint: address}), tunnels=Tunnels(),
                      config=_config([keys.b.fingerprint]))
        link = await a.open("family")
        assert type(link) is trio.SocketStream  # raw TCP: the router splices it
        await link.send_all(b"\x16hello from the caller")
        await link.send_eof()
        with trio.fail_after(5):
            while not tunnels.ends:
                await trio.sleep(0.01)
        home = tunnels.ends[0]
        home.setblocking(False)
        got = b""
        with trio.fail_after(5):
            while not got.endswith(b"caller"):
                await trio.lowlevel.wait_readable(home)
                got += home.recv(100)
        assert got == b"\x16hello from the caller"
        home.sendall(b"the answer")
        home.shutdown(socket.SHUT_WR)  # half-close carried through: the answer still comes
        answer = b""
        with trio.fail_after(5):
            while chunk := await link.receive_some():
                answer += chunk
        assert answer == b"the answer"
        await link.aclose()
        home.close()
        assert _count(a, "out", "ok") == 1
        with trio.fail_after(5):
            while _count(b, "in", "ok") != 1:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("case", ["not_a_peer", "no_tunnel", "wrong_key", "not_listed"])
async def test_refusals(keys: Any, case: str) -> None:
    tunnels = Tunnels()
    tunnels.absent = case == "no_tunnel"
    b_peers = [keys.c.fingerprint] if case == "not_a_peer" else [keys.a.fingerprint]
    b = Forwarder(identity=keys.b, stats=Stats(), registry=Registry({}), tunnels=tunnels,
                  config=_config(b_peers))
    async with trio.open_nursery() as nursery:
        address = await _holder(nursery, b)
        # wrong_key: the registry names C's key for B's address (an impostor's entry)
        named = keys.c.fingerprint if case == "wrong_key" else keys.b.fingerprint
        a_peers = [] if case == "not_listed" else [named]
        a = Forwarder(identity=keys.a, stats=Stats(), registry=Registry({named: address}),
                      tunnels=Tunnels(), config=_config(a_peers))
        with pytest.raises(BackendError):
            await a.open("family")
        expected_out = {"not_a_peer": "refused", "no_tunnel": "no_tunnel",
                        "wrong_key": "pin_mismatch", "not_listed": "no_holder"}[case]
        assert _count(a, "out", expected_out) == 1
        expected_in = {"not_a_peer": "refused_peer", "no_tunnel": "no_tunnel"}.get(case)
        if expected_in is not None:
            with trio.fail_after(5):
                while _count(b, "in", expected_in) != 1:
                    await trio.sleep(0.01)
        assert not tunnels.ends
        nursery.cancel_scope.cancel()


async def test_garbage_preamble_and_dead_address(keys: Any) -> None:
    b = Forwarder(identity=keys.b, stats=Stats(), registry=Registry({}), tunnels=Tunnels(),
                  config=_config([keys.a.fingerprint]))
    async with trio.open_nursery() as nursery:
        address = await _holder(nursery, b)
        host, _, port = address.rpartition(":")
        ctx = pinned_client_context(keys.a, [ALPN_FORWARD])
        tls = trio.SSLStream(await trio.open_tcp_stream(host, int(port)), ctx,
                             server_hostname=HOST)
        await tls.send_all(b"GET / HTTP/1.1\r\n\r\n")
        with trio.fail_after(5):
            try:
                assert await tls.receive_some() == b""
            except (trio.BrokenResourceError, ssl.SSLError):
                pass
            while _count(b, "in", "protocol_error") != 1:
                await trio.sleep(0.01)

        with socket.socket() as s:  # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            dead = f"127.0.0.1:{s.getsockname()[1]}"
        a = Forwarder(identity=keys.a, stats=Stats(),
                      registry=Registry({keys.b.fingerprint: dead}), tunnels=Tunnels(),
                      config=_config([keys.b.fingerprint]))
        with pytest.raises(BackendError):
            await a.open("family")
        assert _count(a, "out", "unreachable") == 1
        a.registry = Registry({keys.b.fingerprint: "0.0.0.0:443"})  # type: ignore[assignment]
        with pytest.raises(BackendError):
            await a.open("family")
        assert _count(a, "out", "no_address") == 1
        nursery.cancel_scope.cancel()


async def test_a_holder_at_its_cap_says_why(keys: Any, caplog: pytest.LogCaptureFixture
                                            ) -> None:
    """A peer's links over the holder's cap of tunnel connections for its address are
    refused with an answer, so the forwarding side can tell its operator what to raise
    instead of suggesting the peer lists are wrong."""
    import logging

    tunnels = Tunnels()
    b = Forwarder(identity=keys.b, stats=Stats(), registry=Registry({}), tunnels=tunnels,
                  config=_config([keys.a.fingerprint]))
    async with trio.open_nursery() as nursery:
        address = await _holder(nursery, b, admit=lambda: False)
        a = Forwarder(identity=keys.a, stats=Stats(),
                      registry=Registry({keys.b.fingerprint: address}), tunnels=Tunnels(),
                      config=_config([keys.b.fingerprint]))
        with caplog.at_level(logging.WARNING, logger="pact_ingress"), \
                pytest.raises(BackendError):
            await a.open("family")
        assert _count(a, "out", "refused") == 1
        with trio.fail_after(5):
            while _count(b, "in", "over_capacity") != 1:
                await trio.sleep(0.01)
        assert not tunnels.ends  # nothing opened for a link that was refused
        failed = [getattr(r, "fields", {}) for r in caplog.records
                  if r.getMessage() == "forward_failed"]
        assert len(failed) == 1 and "max_connections_per_ip" in failed[0]["error"], failed
        nursery.cancel_scope.cancel()
