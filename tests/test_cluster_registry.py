"""The tunnel registry against a real redis-server, in process: two instances' registries
publish and read each other, and what a heartbeat costs Redis does not depend on what
else lives in it (rate-limit buckets, relay queues, another application's keys)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from pact_ingress.model import RedisSettings
from pact_ingress.state.redis import RedisState
from pact_ingress.stats import Stats
from tests.redis_server import RedisServer

FA, FB = "sha256:instance-a", "sha256:instance-b"


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


def _command(redis: RedisServer, *args: str) -> bytes:
    """One raw RESP command (no client library: an operator's redis-cli)."""
    with socket.create_connection((redis.host, redis.port), timeout=30) as s:
        s.sendall(f"*{len(args)}\r\n".encode()
                  + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args))
        data = b""
        while not data.endswith(b"\r\n"):
            data += s.recv(65536)
        return data


def _calls(redis: RedisServer) -> int:
    """Commands Redis has served since the last CONFIG RESETSTAT (without INFO's own)."""
    info = _command(redis, "INFO", "commandstats").decode()
    total = 0
    for line in info.splitlines():
        if line.startswith("cmdstat_") and not line.startswith(("cmdstat_info:",
                                                                "cmdstat_config")):
            total += int(line.split("calls=", 1)[1].split(",", 1)[0])
    return total


async def _state(redis: RedisServer, nursery: trio.Nursery) -> RedisState:
    settings = RedisSettings(host=redis.host, port=redis.port, db=0, deadline=2.0,
                             encryption_key_file=Path("/nonexistent"))
    state = RedisState(settings, Stats(), probe_interval=30)  # no probe during a beat
    await nursery.start(lambda task_status: state.run(task_status=task_status))
    assert state.healthy
    return state


async def _beat_cost(redis: RedisServer, a: RedisState, b: RedisState) -> int:
    await a.registry.beat()
    await b.registry.beat()
    _command(redis, "CONFIG", "RESETSTAT")
    await a.registry.beat()
    return _calls(redis)


async def test_a_heartbeat_costs_the_same_however_many_foreign_keys(
        redis: RedisServer) -> None:
    async with trio.open_nursery() as nursery:
        a, b = await _state(redis, nursery), await _state(redis, nursery)
        a.registry.attach(FA, "127.0.0.2:443", lambda: {"family": 1, "idle": 0})
        b.registry.attach(FB, "127.0.0.3:443", lambda: {"family": 2})
        alone = await _beat_cost(redis, a, b)
        assert a.registry.holders_of("family") == [FB]
        assert b.registry.holders_of("family") == [FA]

        # a busy cluster's Redis: 200,000 rate-limit buckets (or anything else)
        _command(redis, "EVAL", "for i = 1, tonumber(ARGV[1]) do "
                 "redis.call('SET', 'pact-ingress:rl:{192.0.2.' .. i .. '}', '1') end",
                 "0", "200000")
        crowded = await _beat_cost(redis, a, b)
        # the beat touches the registry only: no walk through the whole keyspace
        assert crowded == alone, (alone, crowded)
        assert a.registry.holders_of("family") == [FB]
        assert a.registry.address_of(FB) == "127.0.0.3:443"

        # a foreign writer slips a big key's name into the index: it is never read
        index = a.key("tun", "index")
        _command(redis, "SET", "pact-ingress:relay:big", "x" * 4_000_000)
        _command(redis, "SADD", index, "pact-ingress:relay:big")
        _command(redis, "CONFIG", "RESETSTAT")
        await a.registry.beat()
        info = _command(redis, "INFO", "stats").decode()
        sent = int(info.split("total_net_output_bytes:", 1)[1].split()[0])
        assert sent < 100_000, sent
        assert a.registry.holders_of("family") == [FB]
        assert a.healthy and b.healthy  # the limiter never fell back for it
        nursery.cancel_scope.cancel()


async def test_what_expired_leaves_the_view_and_the_index(redis: RedisServer) -> None:
    async with trio.open_nursery() as nursery:
        a, b = await _state(redis, nursery), await _state(redis, nursery)
        a.registry.attach(FA, "127.0.0.2:443", lambda: {"family": 1})
        held_b = {"family": 1, "other": 1}
        b.registry.attach(FB, "127.0.0.3:443", lambda: dict(held_b))
        for registry in (a.registry, b.registry):
            registry.ttl = 0.3  # what a key lives without a heartbeat
        await b.registry.beat()
        await a.registry.beat()
        assert a.registry.holders_of("family") == [FB]
        assert a.registry.holders_of("other") == [FB]
        held_b["other"] = 0  # B's tunnel for `other` went away: gone at its next beat
        await b.registry.beat()
        await a.registry.beat()
        assert a.registry.holders_of("other") == []
        index = a.key("tun", "index")
        await trio.sleep(0.5)  # B killed: it never beats again, its keys expire
        await a.registry.beat()
        assert a.registry.holders_of("family") == []
        assert set(a.registry.members) == {FA}
        names = _command(redis, "SMEMBERS", index).decode()
        assert FB not in names and "member:" + FA in names  # the index is the truth again
        nursery.cancel_scope.cancel()


async def test_a_clock_stepped_back_does_not_keep_an_old_view_fresh(
        redis: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The view's age is how long ago it was read, whatever the wall clock says: an NTP
    step backwards while Redis is away must not let an instance forward with a view of
    the cluster from minutes ago (holders long dead)."""
    import time as real_time

    from pact_ingress.state import registry as registry_module

    class Clock:
        wall = real_time.time()
        mono = real_time.monotonic()

        def time(self) -> float:
            return self.wall

        def monotonic(self) -> float:
            return self.mono

    clock = Clock()
    monkeypatch.setattr(registry_module, "time", clock)
    async with trio.open_nursery() as nursery:
        a, b = await _state(redis, nursery), await _state(redis, nursery)
        a.registry.attach(FA, "127.0.0.2:443", dict)
        b.registry.attach(FB, "127.0.0.3:443", lambda: {"family": 1})
        await b.registry.beat()
        await a.registry.beat()
        assert a.registry.holders_of("family") == [FB]
        # ten seconds pass without a heartbeat (Redis away), and meanwhile the wall
        # clock is stepped back an hour
        clock.mono += 10
        clock.wall += 10 - 3600
        assert a.registry.stale
        assert a.registry.holders_of("family") == []
        nursery.cancel_scope.cancel()


async def test_a_restarted_instance_drops_its_old_claims_at_its_first_beat(
        redis: RedisServer) -> None:
    """`kill -9` and a restart within the keys' TTL: the new process holds no tunnel yet
    (its connector reconnects with back-off), so peers must not keep forwarding callers
    to it on the strength of what its previous life published."""
    async with trio.open_nursery() as nursery:
        old, b = await _state(redis, nursery), await _state(redis, nursery)
        old.registry.attach(FA, "127.0.0.2:443", lambda: {"family": 2, "other": 0})
        b.registry.attach(FB, "127.0.0.3:443", dict)
        await old.registry.beat()
        await b.registry.beat()
        assert b.registry.holders_of("family") == [FA]

        new = await _state(redis, nursery)  # same key, same address, no tunnel yet
        new.registry.attach(FA, "127.0.0.2:443", lambda: {"family": 0, "other": 0})
        await new.registry.beat()
        await b.registry.beat()
        assert FA in b.registry.members
        assert b.registry.holders_of("family") == []
        nursery.cancel_scope.cancel()


async def test_a_wake_asked_of_the_holders_is_taken_by_one_of_them_once(
        redis: RedisServer) -> None:
    async with trio.open_nursery() as nursery:
        a, b, c = [await _state(redis, nursery) for _ in range(3)]
        a.registry.attach(FA, "127.0.0.2:443", lambda: {"family": 0})
        b.registry.attach(FB, "127.0.0.3:443", lambda: {"family": 1})
        c.registry.attach("sha256:instance-c", "127.0.0.4:443", lambda: {"family": 1})
        woken: list[tuple[str, str]] = []
        for name, state in (("b", b), ("c", c)):
            state.registry.on_wake = lambda tenant, name=name: woken.append((name, tenant))
        for state in (b, c, a):
            await state.registry.beat()
        assert a.registry.ask_wake("nobody") is False  # no holder in the view: not asked
        assert a.registry.ask_wake("family") and a.registry.ask_wake("family")
        await a.registry.beat()
        for _ in range(2):
            await b.registry.beat()
            await c.registry.beat()
        assert len(woken) == 1 and woken[0][1] == "family", woken  # one holder, once
        await a.registry.beat()  # asked once: not asked again
        await b.registry.beat()
        await c.registry.beat()
        assert len(woken) == 1, woken
        nursery.cancel_scope.cancel()
