"""A sender's share of a recipient's queue, seen from outside: real `pact-ingress serve`
processes with the embedded SQLite store (two workers: every enqueue crosses the worker
channel to main's store) and with the Redis store (a real redis-server). One allowed
sender may hold at most half of a recipient's `max_items` and `max_bytes`; past that it
is answered `rate_limited` with an integer `retry_after`, as a full queue is, and other
allowed senders still get the rest. What a sender holds follows the queue: the node's
acks give it back, and a retry of a queued msg_id takes none."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.redis_server import RedisServer
from tests.relay_env import (
    RelayCaller,
    RelayIdentities,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
)
from tests.test_relay_cluster import DURABLE, wait_mode
from tests.test_relay_workers import HIGH_LIMITS, queued

#: the recipient's item bound in these tests: a share of 4 items per sender
MAX_ITEMS = 8
SHARE = 4


@pytest.fixture(params=["sqlite", "redis"])
def relay(request: pytest.FixtureRequest, tmp_path: Path
          ) -> Iterator[tuple[RelayServe, RelayIdentities]]:
    """A serve with a relay queue of MAX_ITEMS items per recipient on either store, the
    recipient's list already naming `sender` and `other`."""
    ids = relay_identities(tmp_path)
    redis: RedisServer | None = None
    extra = HIGH_LIMITS
    workers = 2
    if request.param == "redis":
        redis = RedisServer(tmp_path / "redis", extra=DURABLE)
        key = tmp_path / "state.key"
        key.write_bytes(base64.b64encode(os.urandom(32)))
        os.chmod(key, 0o600)
        extra += (f"state:\n  backend: redis\n  url: {redis.url}\n"
                  f"  encryption_key_file: {key}\n  deadline: 500ms\n")
        workers = 1
    serve: RelayServe | None = None
    try:
        serve = RelayServe(tmp_path, recipients=[ids.recipient], max_items=MAX_ITEMS,
                           workers=workers, extra=extra)
        if redis is not None:
            wait_mode(serve, "shared")
        owner = RelayCaller(serve.port, ids.recipient)
        assert owner.allowlist_set([ids.sender.fingerprint,
                                    ids.other.fingerprint]).status == 200
        owner.close()
        yield serve, ids
    finally:
        if serve is not None:
            serve.stop()
        if redis is not None:
            redis.stop()


def _flood(caller: RelayCaller, ids: RelayIdentities, sender: Any, prefix: str,
           calls: int = 3 * SHARE) -> tuple[list[str], dict[str, Any]]:
    """Up to `calls` new calls from `sender` until the first refusal: the msg_ids
    queued, and that refusal's result."""
    ok: list[str] = []
    for i in range(calls):
        m = f"{prefix}-{i}"
        result = caller.tool("relay_call", envelope(sender, ids.recipient, msg_id=m))[0]
        if not queued(result, m):
            return ok, result
        ok.append(m)
    raise AssertionError(f"{calls} calls of one sender all queued: no share")


def _rate_limited(result: dict[str, Any]) -> None:
    assert code_of(result) == "rate_limited", result
    retry = result["structuredContent"]["retry_after"]
    assert isinstance(retry, int) and retry >= 1, result


def test_one_sender_filling_the_queue_does_not_starve_another_on_either_store(
    relay: tuple[RelayServe, RelayIdentities],
) -> None:
    serve, ids = relay
    flooder = RelayCaller(serve.port, ids.sender)
    other = RelayCaller(serve.port, ids.other)
    try:
        ok, refusal = _flood(flooder, ids, ids.sender, "flood")
        assert len(ok) == SHARE
        _rate_limited(refusal)
        # the other sender gets the rest of the queue, and then the whole bound holds
        ok_other, refusal = _flood(other, ids, ids.other, "other")
        assert len(ok_other) == MAX_ITEMS - SHARE
        _rate_limited(refusal)
        assert serve.status()["relay"]["queues"][0]["items"] == MAX_ITEMS
    finally:
        flooder.close()
        other.close()


def test_the_flooder_queues_again_after_the_node_acks(
    relay: tuple[RelayServe, RelayIdentities],
) -> None:
    """What a sender holds is given back with the node's acks: after one ack exactly
    one more call fits, after acking everything its whole share again."""
    serve, ids = relay
    flooder = RelayCaller(serve.port, ids.sender)
    owner = RelayCaller(serve.port, ids.recipient)
    try:
        ok, refusal = _flood(flooder, ids, ids.sender, "a")
        assert len(ok) == SHARE
        _rate_limited(refusal)
        page = owner.tool("fetch_queued", {})[0]["structuredContent"]["items"]
        assert len(page) == SHARE
        assert owner.tool("ack", {"ids": [page[0]["id"]]})[0]["structuredContent"] == {
            "acked": 1}
        ok, refusal = _flood(flooder, ids, ids.sender, "b")
        assert len(ok) == 1
        _rate_limited(refusal)
        page = owner.tool("fetch_queued", {})[0]["structuredContent"]["items"]
        assert owner.tool("ack", {"ids": [i["id"] for i in page]})[0][
            "structuredContent"] == {"acked": SHARE}
        ok, refusal = _flood(flooder, ids, ids.sender, "c")
        assert len(ok) == SHARE
        _rate_limited(refusal)
    finally:
        flooder.close()
        owner.close()


def test_a_duplicate_msg_id_retry_is_not_counted_twice(
    relay: tuple[RelayServe, RelayIdentities],
) -> None:
    """A sender retrying a queued call (the same envelope) is told `queued` again and
    spends nothing of its share: after three retries of one call it still queues its
    share's worth of distinct calls, and a retry at a full share is still `queued`."""
    serve, ids = relay
    sender = RelayCaller(serve.port, ids.sender)
    try:
        first = envelope(ids.sender, ids.recipient, msg_id="again")
        for _ in range(4):
            assert queued(sender.tool("relay_call", first)[0], "again")
        ok, refusal = _flood(sender, ids, ids.sender, "next")
        assert len(ok) == SHARE - 1
        _rate_limited(refusal)
        assert queued(sender.tool("relay_call", first)[0], "again")
        assert serve.status()["relay"]["queues"][0]["items"] == SHARE
    finally:
        sender.close()
