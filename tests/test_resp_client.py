"""state.resp_client against a real redis-server (and one fake that stalls mid-reply):
AUTH, SELECT, NOSCRIPT reload, a timed-out connection never reused, reconnecting after
a restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from pact_ingress.model import RedisSettings, Secret
from pact_ingress.proto.resp import RespError
from pact_ingress.state.redis import GCRA_SCRIPT, RedisState
from pact_ingress.state.resp_client import ConnectionLost, RespClient, Script
from pact_ingress.stats import Stats
from tests.redis_server import RedisServer, free_port

PASSWORD = "s3cret-for-tests-only"


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


def _settings(host: str, port: int, **kw: object) -> RedisSettings:
    return RedisSettings(host=host, port=port, encryption_key_file=Path("/nonexistent"),
                         **{"db": 0, **kw})  # type: ignore[arg-type]


async def test_commands_and_select(redis: RedisServer) -> None:
    db0 = RespClient(_settings(redis.host, redis.port))
    db3 = RespClient(_settings(redis.host, redis.port, db=3))
    with trio.fail_after(5):
        assert await db0.execute("PING") == b"PONG"
        assert await db3.execute("SET", "resp:selected", "three") == b"OK"
        assert await db3.execute("GET", "resp:selected") == b"three"
        assert await db0.execute("GET", "resp:selected") is None
        assert await db0.execute("CLIENT", "GETNAME") == b"pact-ingress-limiter"
        with pytest.raises(RespError, match="ERR"):  # an error reply keeps the connection
            await db0.execute("NOSUCHCOMMAND")
        assert db0.connections == 1
        assert await db0.execute("ECHO", "still in step") == b"still in step"
    db0.close()
    db3.close()
    assert db0.connections == 0


async def test_auth_ok_and_wrong(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis", password=PASSWORD)
    try:
        good = RespClient(_settings(server.host, server.port, password=Secret(PASSWORD)))
        bad = RespClient(_settings(server.host, server.port, password=Secret("wrong")))
        none = RespClient(_settings(server.host, server.port))
        with trio.fail_after(5):
            assert await good.execute("PING") == b"PONG"
            with pytest.raises(RespError) as wrong:
                await bad.execute("PING")
            assert wrong.value.kind in ("WRONGPASS", "ERR")
            assert "wrong" not in str(wrong.value)
            with pytest.raises(RespError, match="NOAUTH"):
                await none.execute("PING")
        assert bad.connections == 0 and none.connections == 0
        good.close()
    finally:
        server.stop()


async def test_noscript_is_reloaded_after_script_flush(redis: RedisServer) -> None:
    client = RespClient(_settings(redis.host, redis.port))
    script = Script("return {KEYS[1], ARGV[1]}")
    with trio.fail_after(5):
        await client.execute("SCRIPT", "FLUSH")
        assert await client.evalsha(script, ["k"], ["v"]) == [b"k", b"v"]  # never loaded
        await client.execute("SCRIPT", "FLUSH")
        assert await client.evalsha(script, ["k2"], ["v2"]) == [b"k2", b"v2"]
        assert await client.execute("SCRIPT", "EXISTS", script.sha) == [1]
        with pytest.raises(RespError, match="boom"):  # a script error is a reply
            await client.evalsha(Script("return redis.error_reply('boom')"), [], [])
        assert client.connections == 1
    client.close()


async def test_limiter_survives_script_flush(nursery: trio.Nursery, redis: RedisServer) -> None:
    state = RedisState(_settings(redis.host, redis.port, deadline=2.0), Stats(),
                       probe_interval=60)
    await nursery.start(lambda task_status: state.run(task_status=task_status))
    assert state.healthy
    await state.limiter.resp.execute("SCRIPT", "FLUSH")
    await state.limiter.check_calls("192.0.2.9", [None], 0.0, scope="flush.example")
    assert state.healthy
    assert state.stats.value("pact_ingress_rate_limit_decisions_total",
                             {"where": "shared"}) == 1
    assert state.limiter.script.sha == Script(GCRA_SCRIPT).sha


async def test_timeout_discards_the_connection(tmp_path: Path) -> None:
    """A reply that comes after its caller gave up must not be read as the next one's."""
    server = RedisServer(tmp_path / "redis")
    try:
        client = RespClient(_settings(server.host, server.port))
        with trio.fail_after(5):
            await client.execute("SET", "late", "the late reply")
        server.freeze()
        with trio.move_on_after(0.1) as waited:
            await client.execute("GET", "late")
        assert waited.cancelled_caught
        assert client.connections == 0
        server.thaw()
        with trio.fail_after(5):
            assert await client.execute("ECHO", "mine") == b"mine"
        client.close()
    finally:
        server.stop()


async def test_timeout_mid_reply_discards_the_connection(nursery: trio.Nursery) -> None:
    """A fake Redis that sends half a reply and stalls: the connection is closed, and the
    next request gets a connection of its own."""
    connections = []

    async def fake(stream: trio.SocketStream) -> None:
        connections.append(stream)
        data = b""
        while b"SETNAME" not in data or not data.endswith(b"\r\n"):
            data += await stream.receive_some(4096)
        await stream.send_all(b"+OK\r\n")
        if len(connections) == 1:
            await stream.receive_some(4096)
            await stream.send_all(b"$10\r\nhalf")  # ...and never the rest
            await trio.sleep_forever()
        await stream.receive_some(4096)
        await stream.send_all(b"$5\r\nwhole\r\n")
        await trio.sleep_forever()

    listeners = await nursery.start(
        lambda task_status: trio.serve_tcp(fake, 0, host="127.0.0.1", task_status=task_status))
    port = listeners[0].socket.getsockname()[1]
    client = RespClient(_settings("127.0.0.1", port))
    with trio.move_on_after(0.2) as waited:
        await client.execute("GET", "x")
    assert waited.cancelled_caught and client.connections == 0
    with trio.fail_after(5):
        assert await client.execute("GET", "x") == b"whole"
    assert len(connections) == 2
    client.close()


async def test_reconnects_after_a_restart(tmp_path: Path) -> None:
    server = RedisServer(tmp_path / "redis")
    try:
        client = RespClient(_settings(server.host, server.port))
        with trio.fail_after(5):
            assert await client.execute("PING") == b"PONG"
        server.restart()
        with trio.fail_after(5):
            # the idle connection was closed by Redis: noticed before use, not by failing
            assert await client.execute("PING") == b"PONG"
        assert client.connections == 1
        server.stop()
        with trio.fail_after(5), pytest.raises((ConnectionLost, OSError)):
            await client.execute("PING")
        assert client.connections == 0
        client.close()
    finally:
        server.stop()


async def test_many_callers_share_few_connections_in_turn(redis: RedisServer) -> None:
    """More callers than connections: each waits its turn (first come, first served), so
    none starves while the others loop; never more connections than the cap."""
    client = RespClient(_settings(redis.host, redis.port), max_connections=2)
    worst = 0.0
    peak = 0

    async def caller(i: int) -> None:
        nonlocal worst, peak
        for j in range(100):
            started = trio.current_time()
            assert await client.execute("ECHO", f"{i}/{j}") == f"{i}/{j}".encode()
            worst = max(worst, trio.current_time() - started)
            peak = max(peak, client.connections)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(caller, i)
    assert peak == 2
    assert worst < 0.5, worst  # a fair queue: 16 callers ahead at most, not a starved one
    client.close()


async def test_tls_with_client_certificate(tmp_path: Path) -> None:
    """TLS via the same RedisTLS settings coredis gets: the CA checks Redis, our
    certificate is checked by Redis (tls-auth-clients)."""
    import trustme

    from pact_ingress.model import RedisTLS
    from pact_ingress.state.redis import _tls_context

    ca = trustme.CA()
    server_cert = ca.issue_cert("127.0.0.1")
    client_cert = ca.issue_cert("pact-ingress.test")
    files = {}
    for name, blob in [("ca.pem", ca.cert_pem), ("server.pem", server_cert.cert_chain_pems[0]),
                       ("server.key", server_cert.private_key_pem),
                       ("client.pem", client_cert.cert_chain_pems[0]),
                       ("client.key", client_cert.private_key_pem)]:
        blob.write_to_path(str(tmp_path / name))
        files[name] = tmp_path / name
    tls_port = free_port()
    server = RedisServer(tmp_path / "redis", extra=(
        "--save", "", "--appendonly", "no", "--tls-port", str(tls_port),
        "--tls-cert-file", str(files["server.pem"]), "--tls-key-file", str(files["server.key"]),
        "--tls-ca-cert-file", str(files["ca.pem"]), "--tls-auth-clients", "yes"))
    try:
        tls = RedisTLS(ca_file=files["ca.pem"], cert_file=files["client.pem"],
                       key_file=files["client.key"])
        settings = _settings(server.host, tls_port, tls=tls)
        client = RespClient(settings, ssl_context=_tls_context(settings))
        with trio.fail_after(5):
            assert await client.execute("PING") == b"PONG"
            assert await client.evalsha(Script("return ARGV[1]"), [], ["over tls"]) == \
                b"over tls"
        client.close()
        no_cert = _settings(server.host, tls_port, tls=RedisTLS(ca_file=files["ca.pem"]))
        refused = RespClient(no_cert, ssl_context=_tls_context(no_cert))
        with trio.fail_after(5), pytest.raises((trio.BrokenResourceError, ConnectionLost)):
            await refused.execute("PING")
        assert refused.connections == 0
    finally:
        server.stop()
