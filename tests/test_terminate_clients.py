"""Terminate mode driven by httpx, a client the engine was not written against, over HTTP/2
and HTTP/1.1, through a real `python -m pact_ingress serve` (tests/terminate_env.py).

What must hold whatever the client's framing (its DATA frame sizes, how it spreads
concurrent streams, when it sends WINDOW_UPDATE): sealed calls of a few KiB up to about
1 MiB reach the node byte for byte (SHA-256 on both sides), several at once on one
HTTP/2 connection too (within one connection window: see `CONCURRENT_SIZE`); unsealed
calls never reach a `seal: required` node, large or small; large and streamed responses
come back whole. And the HTTP/2 connection's own
lifecycle: closed when idle past `idle_timeout`, never while a stream is open.

Other real HTTP/2 clients (nghttp, h2load, Node's http2) are driven in
tests/test_terminate_attacks.py. Every address is loopback; every wait is bounded.
"""

from __future__ import annotations

import hashlib
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from pact_ingress.envelope import seal
from pact_ingress.identity import b64url, spki_der
from tests.terminate_env import (
    HOST,
    LOOPBACK,
    OPT_HOST,
    WAIT,
    H2Conn,
    Identities,
    RecordingNode,
    Serve,
    make_identities,
    refusal_code,
    rpc,
    unsealed_call_body,
)
from tests.terminate_env import (
    ServeEnv as Env,
)

#: Sizes of the sealed calls sent (bytes of the whole JSON-RPC body, about).
SIZES = (3 * 1024, 48 * 1024, 1024 * 1024)
#: Concurrent streams on the one HTTP/2 connection (below the per-IP in-flight share).
CONCURRENT = 8
#: Size of each concurrent call: together they fit in one connection window (64 KiB), so
#: no httpx stream waits for WINDOW_UPDATE. httpx's HTTP/2 layer (httpcore) deadlocks when
#: several of its streams wait for window at once: the WINDOW_UPDATE one stream reads is
#: not seen by the others, which block in a read the server has no reason to answer
#: (pydantic/httpx2#1133). Large bodies are sent one at a time, above.
CONCURRENT_SIZE = 7 * 1024


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    env = Env.start(tmp_path_factory.mktemp("clients"))
    yield env
    env.stop()


@pytest.fixture
def fresh(env: Env) -> Env:
    return env.fresh()


def _context() -> ssl.SSLContext:
    """The routes' certificates are self-signed: the test checks what arrives, not who
    answered (the edge's identity is covered elsewhere)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def _client_args(http2: bool) -> dict[str, object]:
    return {"http1": not http2, "http2": http2, "verify": _context(),
            "timeout": httpx.Timeout(WAIT)}


def _url(env: Env, path: str) -> str:
    return f"https://{LOOPBACK}:{env.serve.port}{path}"


def _request_args(host: str) -> dict[str, object]:
    """SNI and Host (`:authority` over HTTP/2) name the route; the socket goes to the
    loopback address, as with curl's --connect-to."""
    return {"headers": {"host": host, "content-type": "application/json",
                        "accept": "application/json, text/event-stream"},
            "extensions": {"sni_hostname": host}}


def sealed_call(ids: Identities, size: int, msg_id: str) -> bytes:
    """A sealed tools/call of about `size` bytes (the inner text padded before sealing)."""
    now = int(time.time())
    inner = {"method": "tools/call", "params": {"name": "send_message", "arguments": {
        "msg_id": f"inner-{msg_id}", "text": "p" * max(0, size * 3 // 4 - 900),
        "sender": "agent"}}, "spk": b64url(spki_der(ids.caller.key.public_key()))}
    args = seal(inner, sender_key=ids.caller.key,
                recipient_public_key=ids.node.key.public_key(),  # type: ignore[arg-type]
                msg_id=msg_id, ts=now, exp=now + 600)
    return rpc("tools/call", {"name": "sealed_call", "arguments": args})


def _digest(body: bytes) -> tuple[int, str]:
    return len(body), hashlib.sha256(body).hexdigest()


def _node_digests(env: Env) -> list[tuple[int, str]]:
    return sorted(_digest(r.body) for r in env.node.requests() if r.complete)


def _assert_executed(res: httpx.Response, http2: bool) -> None:
    assert res.http_version == ("HTTP/2" if http2 else "HTTP/1.1"), res.http_version
    assert res.status_code == 200, (res.status_code, res.text[:300])
    assert refusal_code(res.content) is None, res.text[:300]
    assert res.json()["result"]["structuredContent"] == {"executed": "sealed_call"}, res.text


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "h1"])
def test_httpx_sealed_calls_arrive_whole(fresh: Env, http2: bool) -> None:
    env = fresh
    bodies = [sealed_call(env.ids, size, f"seq-{http2}-{size}-{time.monotonic_ns()}")
              for size in SIZES]
    assert len(bodies[-1]) > 1_000_000, len(bodies[-1])
    with httpx.Client(**_client_args(http2)) as client:  # type: ignore[arg-type]
        for body in bodies:
            res = client.post(_url(env, "/mcp"), content=body, **_request_args(HOST))
            _assert_executed(res, http2)
    assert env.node.wait_for(lambda: len(_node_digests(env)) == len(bodies), 5)
    assert _node_digests(env) == sorted(_digest(b) for b in bodies)


async def test_httpx_h2_concurrent_streams_on_one_connection(fresh: Env) -> None:
    env = fresh
    # Other tests' connections have gone before this one opens its own.
    assert await trio.to_thread.run_sync(env.serve.wait_open_connections, 0) == 0
    bodies = [sealed_call(env.ids, CONCURRENT_SIZE, f"conc-{i}-{time.monotonic_ns()}")
              for i in range(CONCURRENT)]
    assert sum(map(len, bodies)) < 65_535
    answers: list[httpx.Response] = []
    async with httpx.AsyncClient(**_client_args(True)) as client:  # type: ignore[arg-type]

        async def call(body: bytes) -> None:
            answers.append(await client.post(_url(env, "/mcp"), content=body,
                                             **_request_args(HOST)))

        with trio.fail_after(WAIT * 2):
            async with trio.open_nursery() as nursery:
                for body in bodies:
                    nursery.start_soon(call, body)
        opened = await trio.to_thread.run_sync(env.serve.open_connections)
    assert opened == 1, f"{opened} client connections for {CONCURRENT} streams"
    assert len(answers) == CONCURRENT
    for res in answers:
        _assert_executed(res, True)
    assert env.node.wait_for(lambda: len(_node_digests(env)) == len(bodies), 5)
    assert _node_digests(env) == sorted(_digest(b) for b in bodies)


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "h1"])
def test_httpx_unsealed_calls_refused(fresh: Env, http2: bool) -> None:
    env = fresh
    small = unsealed_call_body("httpx says hi")
    large = unsealed_call_body("u" * (1024 * 1024))
    with httpx.Client(**_client_args(http2)) as client:  # type: ignore[arg-type]
        for body in (small, large):
            res = client.post(_url(env, "/mcp"), content=body, **_request_args(HOST))
            assert res.http_version == ("HTTP/2" if http2 else "HTTP/1.1")
            assert refusal_code(res.content) is not None, (res.status_code, res.text[:300])
        # the same connection still serves a sealed call afterwards
        ok = sealed_call(env.ids, SIZES[0], f"after-{http2}-{time.monotonic_ns()}")
        _assert_executed(client.post(_url(env, "/mcp"), content=ok, **_request_args(HOST)),
                         http2)
    assert env.node.wait_for(lambda: len(_node_digests(env)) == 1, 5)
    assert env.node.unsealed_calls() == []
    assert _node_digests(env) == [_digest(ok)]


@pytest.mark.parametrize("http2", [True, False], ids=["h2", "h1"])
def test_httpx_large_and_streamed_responses_whole(fresh: Env, http2: bool) -> None:
    env = fresh
    size = 3 * 1024 * 1024 + 17  # many client windows and writer batches
    with httpx.Client(**_client_args(http2)) as client:  # type: ignore[arg-type]
        big = client.get(_url(env, f"/big?bytes={size}"), **_request_args(OPT_HOST))
        assert big.status_code == 200 and big.http_version == (
            "HTTP/2" if http2 else "HTTP/1.1")
        assert big.content == b"x" * size
        with client.stream("GET", _url(env, "/stream?n=6&interval=0.02"),
                           **_request_args(OPT_HOST)) as events:  # type: ignore[arg-type]
            assert events.status_code == 200
            got = b"".join(events.iter_bytes())
    assert got == b"".join(f"id: {i}\ndata: tick\n\n".encode() for i in range(6))


def _eof_within(conn: H2Conn, timeout: float) -> bool:
    """Read (and drop) whatever the edge sends until it closes; False on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        conn.sock.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            if not conn.sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except (ConnectionError, ssl.SSLError):
            return True
    return False


def test_h2_idle_timeout_spares_open_streams(tmp_path: Path) -> None:
    """An HTTP/2 connection with a stream open outlives `idle_timeout` (the stream
    completes whole); with none, it is closed once the timeout has passed."""
    ids = make_identities(tmp_path)
    node = RecordingNode(ids.node, client_ca=ids.ingress)
    serve = None
    try:
        serve = Serve(tmp_path, node, ids.node.fingerprint, limits={"idle_timeout": "1s"})
        conn = H2Conn(serve.port, OPT_HOST)
        try:
            n = 25  # 25 × 0.1 s: well past the idle timeout, one stream open throughout
            res = conn.request("GET", f"/stream?n={n}&interval=0.1", content_type=None)
            assert res.status == 200 and res.reset is None and not res.goaway, res
            assert res.body == b"".join(f"id: {i}\ndata: tick\n\n".encode()
                                        for i in range(n))
            assert _eof_within(conn, 10.0), "an idle HTTP/2 connection was kept open"
        finally:
            conn.close()
    finally:
        if serve is not None:
            serve.stop()
        node.stop()
