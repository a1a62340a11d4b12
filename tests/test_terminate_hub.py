"""The terminate engine with its sockets in the readiness hub (`net/readiness.py`): many
keep-alive connections at once, and a client whose last request comes with its FIN.
Real TLS on loopback, the demo node behind pinned mTLS (`tests/test_terminate.py`)."""

from __future__ import annotations

import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from pact_ingress.net import readiness
from tests.test_terminate import HOST, Env, start_env

CLIENTS = 12
REQUESTS = 15


@pytest.fixture
async def env(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Env]:
    e = await start_env(nursery, tmp_path)
    yield e
    await e.terminator.aclose()


async def test_many_keep_alive_connections_all_answered_through_the_hub(env: Env) -> None:
    statuses: list[int] = []

    async def client(i: int) -> None:
        async with env.client(http2=False) as pool:
            for j in range(REQUESTS):
                r = await pool.request("GET", f"https://{HOST}/_demo/headers?c={i}&r={j}")
                statuses.append(r.status)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(CLIENTS):
                nursery.start_soon(client, i)
    assert statuses == [200] * (CLIENTS * REQUESTS)
    assert len(env.node.requests) == CLIENTS * REQUESTS
    # that many connections at once made the process crowded: sockets joined the hub
    assert readiness.hub().watches
    with trio.fail_after(10):
        while env.terminator.open_connections:  # every connection ended, none is stuck
            await trio.sleep(0.01)
    assert readiness.open_connections == 0


def _half_closing_client(port: int, context: ssl.SSLContext, requests: int) -> bytes:
    """`requests` pipelined requests, then the TCP FIN at once; everything read."""
    with (socket.create_connection(("127.0.0.1", port), timeout=20) as raw,
          context.wrap_socket(raw, server_hostname=HOST) as tls):
        tls.sendall(b"".join(
            f"GET /_demo/headers?r={i} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
            for i in range(requests)))
        # the FIN right behind the last request (on a copy of the descriptor: the
        # TLS socket's own shutdown would drop its TLS state)
        with socket.fromfd(tls.fileno(), socket.AF_INET, socket.SOCK_STREAM) as dup:
            dup.shutdown(socket.SHUT_WR)
        data = b""
        while True:
            try:
                chunk = tls.recv(65536)
            except (ssl.SSLError, OSError):
                break
            if not chunk:
                break
            data += chunk
    return data


@pytest.mark.parametrize("requests", [1, 3])
async def test_the_fin_behind_the_last_request_ends_the_connection(
        env: Env, monkeypatch: pytest.MonkeyPatch, requests: int) -> None:
    monkeypatch.setattr(readiness, "HUB_MIN_CONNECTIONS", 0)  # every socket in the hub
    context = env.pki.client_context(["http/1.1"])
    with trio.fail_after(30):
        data = await trio.to_thread.run_sync(
            _half_closing_client, env.port, context, requests)
        # every request answered, and the edge closed the connection (the client's
        # read ended) long before any idle timeout
        assert data.count(b"HTTP/1.1 200 ") == requests
        while env.terminator.open_connections:
            await trio.sleep(0.01)
