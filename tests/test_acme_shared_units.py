"""The pieces ACME-as-a-cluster rests on: sealing (a tampered blob, a blob under another
name, another key: all refused) and the order lease against a real redis-server (one
holder at a time, expiry frees it, only the owner releases or renews it)."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from pact_ingress.model import RedisSettings
from pact_ingress.state.acme import Lease
from pact_ingress.state.redis import RedisState
from pact_ingress.state.seal import MAGIC, Sealer, SealError, read_key_file
from pact_ingress.stats import Stats
from tests.redis_server import RedisServer

KEY = b"k" * 32
NAME = "pact-ingress:acme:cert:h.example:key"
PEM = b"-----BEGIN PRIVATE KEY-----\nMIG...\n-----END PRIVATE KEY-----\n"


# ------------------------------------------------------------------------------ sealing
def test_seal_round_trip_and_not_plaintext() -> None:
    s = Sealer(KEY)
    blob = s.seal(PEM, NAME)
    assert blob.startswith(MAGIC) and b"BEGIN" not in blob
    assert s.open(blob, NAME) == PEM
    assert s.seal(PEM, NAME) != blob  # a fresh nonce each time


def test_tampered_blob_refused() -> None:
    s = Sealer(KEY)
    blob = bytearray(s.seal(PEM, NAME))
    for at in (len(MAGIC) + 8 + 3, len(blob) - 1, len(blob) // 2 + 10):  # nonce, tag, body
        bad = bytearray(blob)
        bad[at] ^= 0x01
        with pytest.raises(SealError, match="does not authenticate"):
            s.open(bytes(bad), NAME)
    with pytest.raises(SealError, match="not a sealed blob"):
        s.open(PEM, NAME)
    with pytest.raises(SealError, match="not a sealed blob"):
        s.open(bytes(blob[:20]), NAME)


def test_blob_moved_to_another_name_refused() -> None:
    s = Sealer(KEY)
    blob = s.seal(PEM, NAME)
    with pytest.raises(SealError, match="does not authenticate"):
        s.open(blob, NAME.replace("h.example", "other.example"))


def test_wrong_key_refused_with_its_id() -> None:
    blob = Sealer(KEY).seal(PEM, NAME)
    other = Sealer(b"o" * 32)
    with pytest.raises(SealError, match="another encryption key"):
        other.open(blob, NAME)
    # the same id with a different key (forged header) still fails authentication
    forged = blob[:len(MAGIC)] + other.key_id + blob[len(MAGIC) + 8:]
    with pytest.raises(SealError, match="does not authenticate"):
        other.open(forged, NAME)


def test_key_file(tmp_path: Path) -> None:
    good = tmp_path / "state.key"
    good.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    assert len(read_key_file(good)) == 32
    short = tmp_path / "short.key"
    short.write_bytes(base64.b64encode(os.urandom(16)))
    with pytest.raises(SealError, match="32 random bytes"):
        read_key_file(short)
    with pytest.raises(SealError, match="cannot read"):
        read_key_file(tmp_path / "missing.key")


# ------------------------------------------------------------------------------ the lease
@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


async def _state(nursery: trio.Nursery, server: RedisServer) -> RedisState:
    settings = RedisSettings(host=server.host, port=server.port, db=0,
                             encryption_key_file=Path("/nonexistent"), deadline=2.0)
    state = RedisState(settings, Stats(), probe_interval=0.05)
    await nursery.start(lambda task_status: state.run(task_status=task_status))
    assert state.healthy
    return state


async def test_lease_one_holder_owner_only_release(nursery: trio.Nursery,
                                                   redis: RedisServer) -> None:
    a_state, b_state = await _state(nursery, redis), await _state(nursery, redis)
    a = Lease(a_state, "pact-ingress:acme:lock:one", ttl=30)
    b = Lease(b_state, "pact-ingress:acme:lock:one", ttl=30)
    assert a.owner != b.owner
    assert await a.acquire()
    assert not await b.acquire()
    assert await b.holder() == a.owner
    # not the owner: neither release nor renew touches it
    assert not await b.release()
    assert not await b.renew()
    assert await a.holder() == a.owner
    assert await a.renew()
    assert await a.release()
    assert await a.holder() is None
    assert not await a.release()  # released once only
    assert await b.acquire()
    assert not await a.acquire()
    assert await b.release()


async def test_lease_of_a_dead_holder_expires_and_renewal_keeps_it(
        nursery: trio.Nursery, redis: RedisServer) -> None:
    state = await _state(nursery, redis)
    dead = Lease(state, "pact-ingress:acme:lock:two", ttl=0.3)
    live = Lease(state, "pact-ingress:acme:lock:two", ttl=0.3)
    assert await dead.acquire()
    assert not await live.acquire()
    await trio.sleep(0.5)  # the holder stopped renewing: the lease is free again
    assert await live.acquire()
    assert not await dead.renew()  # the dead holder cannot take it back by renewing
    for _ in range(4):  # renewed more often than its TTL: held well past it
        await trio.sleep(0.15)
        assert await live.renew()
    assert not await dead.acquire()
    assert await live.holder() == live.owner
    assert not await dead.release()
    assert await live.release()
