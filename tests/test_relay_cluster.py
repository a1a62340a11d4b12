"""The relay queue shared by two `pact-ingress serve` processes (127.0.0.2 and 127.0.0.3)
on one real redis-server run as the README requires (`appendonly yes`, `appendfsync
always`), seen from outside: an allow-list set and an item queued via A are seen and
fetched via B; the item survives a Redis restart (its AOF); with Redis stopped
relay_call, fetch and ack answer `unavailable`, and both instances recover by themselves
when it returns."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pact_ingress.identity import b64url_decode
from tests.redis_server import RedisServer
from tests.relay_env import (
    RelayCaller,
    RelayIdentities,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
)
from tests.terminate_env import WAIT

INSTANCES = ("127.0.0.2", "127.0.0.3")
DURABLE = ("--save", "", "--appendonly", "yes", "--appendfsync", "always")


def wait_mode(serve: RelayServe, mode: str) -> None:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if serve.status()["state"]["mode"] == mode:
            return
        time.sleep(0.05)
    raise AssertionError(f"never {mode}: {serve.status()['state']}\n{serve.logs()[-3000:]}")


def msg_ids(page: dict[str, Any]) -> list[str]:
    return [json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"]
            for i in page["items"]]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[RedisServer, list[RelayServe], RelayIdentities]]:
    redis = RedisServer(tmp_path / "redis", extra=DURABLE)
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    ids = relay_identities(tmp_path)
    state = (f"state:\n  backend: redis\n  url: {redis.url}\n  encryption_key_file: {key}\n"
             "  deadline: 500ms  # a loaded test machine must not turn into a fallback\n")
    serves: list[RelayServe] = []
    try:
        for address in INSTANCES:
            (tmp_path / address).mkdir()
            serves.append(RelayServe(tmp_path / address, recipients=[ids.recipient],
                                     extra=state, address=address))
        for serve in serves:
            wait_mode(serve, "shared")
        yield redis, serves, ids
    finally:
        for serve in serves:
            serve.stop()
        redis.stop()


@pytest.mark.slow
def test_queue_shared_across_instances_and_redis_restarts(
    cluster: tuple[RedisServer, list[RelayServe], RelayIdentities],
) -> None:
    redis, (a, b), ids = cluster
    recipient_a = RelayCaller(a.port, ids.recipient, a.address)
    recipient_b = RelayCaller(b.port, ids.recipient, b.address)
    sender_a = RelayCaller(a.port, ids.sender, a.address)
    sender_b = RelayCaller(b.port, ids.sender, b.address)
    try:
        # the allow-list set via A lets the sender in via B too
        assert recipient_a.allowlist_set([ids.sender.fingerprint]).status == 200
        queued = {"status": "queued", "msg_id": "m1"}
        first = envelope(ids.sender, ids.recipient, msg_id="m1")
        assert sender_a.tool("relay_call", first)[0]["structuredContent"] == queued
        assert sender_b.tool("relay_call", first)[0]["structuredContent"] == queued  # dedupe
        page = recipient_b.tool("fetch_queued", {})[0]["structuredContent"]
        assert msg_ids(page) == ["m1"] and not page["more"]
        assert page["items"][0]["envelope"] == first
        for serve in (a, b):
            relay = serve.status()["relay"]
            assert relay["healthy"] and "persistence_warning" not in relay, relay
            assert relay["store"].startswith(f"{redis.url} ("), relay

        # a Redis restart: the unacked item is still there (the AOF), fetched via A
        redis.restart()
        for serve in (a, b):
            wait_mode(serve, "shared")
        page = recipient_a.tool("fetch_queued", {})[0]["structuredContent"]
        assert msg_ids(page) == ["m1"]
        assert recipient_b.tool("ack", {"ids": [page["items"][0]["id"]]}
                                )[0]["structuredContent"] == {"acked": 1}
        assert recipient_a.tool("fetch_queued", {})[0]["structuredContent"]["items"] == []
        # acked, and still answered as the first time rather than queued again
        assert sender_b.tool("relay_call", first)[0]["structuredContent"] == queued
        assert recipient_a.tool("fetch_queued", {})[0]["structuredContent"]["items"] == []

        # Redis stopped: every tool answers unavailable, nothing pretends to be stored
        redis.stop()
        during = envelope(ids.sender, ids.recipient, msg_id="m2")
        assert code_of(sender_a.tool("relay_call", during)[0]) == "unavailable"
        assert code_of(sender_b.tool("relay_call", during)[0]) == "unavailable"
        assert code_of(recipient_b.tool("fetch_queued", {})[0]) == "unavailable"
        assert code_of(recipient_a.tool("ack", {"ids": [1]})[0]) == "unavailable"
        for serve in (a, b):
            wait_mode(serve, "fallback")
            assert not serve.status()["relay"]["healthy"]

        # back: both recover by themselves; the sender's retry is queued once
        redis.start()
        for serve in (a, b):
            wait_mode(serve, "shared")
        queued2 = {"status": "queued", "msg_id": "m2"}
        assert sender_a.tool("relay_call", during)[0]["structuredContent"] == queued2
        page = recipient_b.tool("fetch_queued", {})[0]["structuredContent"]
        assert msg_ids(page) == ["m2"]
    finally:
        for caller in (recipient_a, recipient_b, sender_a, sender_b):
            caller.close()
    for serve in (a, b):  # operational faults are log lines, never tracebacks
        assert "Traceback" not in serve.logs(), serve.logs()[-3000:]
        events = [e.get("event") for e in serve.log_events()]
        assert "relay_store_open" in events and "relay_store_may_lose_items" not in events
