"""The relay queue in Redis when the instance that acknowledged a call dies: two
`pact-ingress serve` processes (127.0.0.2, 127.0.0.3, worker processes by default) on
one real redis-server run as the README requires. A sender keeps queueing via A while A
is killed with SIGKILL; every call A answered `queued` is delivered via B exactly once
per fetch-and-ack, nothing is delivered twice after its ack, and the sender's retries of
the calls A never answered are queued once. With Redis frozen (SIGSTOP) every call is
answered `unavailable`, and the retries after it continues are each stored once."""

from __future__ import annotations

import threading
import time

import pytest

from tests.redis_server import RedisServer
from tests.relay_env import RelayCaller, RelayIdentities, RelayServe, code_of, envelope
from tests.test_relay_cluster import cluster, msg_ids, wait_mode

__all__ = ["cluster"]  # the fixture, shared with the relay cluster tests

CALLS = 24


@pytest.mark.slow
def test_acknowledged_calls_survive_kill9_of_the_acknowledging_instance(
    cluster: tuple[RedisServer, list[RelayServe], RelayIdentities],
) -> None:
    _redis, (a, b), ids = cluster
    recipient_b = RelayCaller(b.port, ids.recipient, b.address)
    sender_a = RelayCaller(a.port, ids.sender, a.address)
    sender_b = RelayCaller(b.port, ids.sender, b.address)
    envelopes = {f"k{n}": envelope(ids.sender, ids.recipient, msg_id=f"k{n}")
                 for n in range(CALLS)}
    acknowledged: list[str] = []
    try:
        assert recipient_b.allowlist_set([ids.sender.fingerprint]).status == 200

        def send() -> None:
            for msg_id, env in envelopes.items():
                try:
                    result, _ = sender_a.tool("relay_call", env)
                except (OSError, ValueError):
                    return  # A is gone
                if result.get("structuredContent") == {"status": "queued",
                                                       "msg_id": msg_id}:
                    acknowledged.append(msg_id)

        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while len(acknowledged) < CALLS // 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        a.kill9()  # main and its workers: mid-stream, no drain
        thread.join(20)
        assert not thread.is_alive()
        assert CALLS // 3 <= len(acknowledged) < CALLS, acknowledged

        # via B: every acknowledged call is there, oldest first, each once
        page = recipient_b.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        fetched = msg_ids(page)
        assert not page["more"]
        assert len(fetched) == len(set(fetched)), fetched
        assert set(acknowledged) <= set(fetched), (acknowledged, fetched)
        # what A stored but could not answer is a call the sender will retry: at most one
        assert len(set(fetched) - set(acknowledged)) <= 1, (acknowledged, fetched)
        assert fetched == sorted(fetched, key=lambda m: int(m[1:]))
        ids_by_msg = {msg_ids({"items": [item]})[0]: item["id"] for item in page["items"]}
        acked = recipient_b.tool("ack", {"ids": list(ids_by_msg.values())})[0]
        assert acked["structuredContent"] == {"acked": len(fetched)}

        # the sender retries everything via B: the delivered ones are duplicates (not
        # queued again), the rest are queued once
        for msg_id, env in envelopes.items():
            result, _ = sender_b.tool("relay_call", env)
            assert result["structuredContent"] == {"status": "queued", "msg_id": msg_id}
            sender_b.tool("relay_call", env)  # and once more, as a nervous sender would
        page = recipient_b.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        assert sorted(msg_ids(page)) == sorted(set(envelopes) - set(fetched))
    finally:
        for caller in (recipient_b, sender_a, sender_b):
            caller.close()
    assert "Traceback" not in b.logs(), b.logs()[-3000:]
    # the survivor never lost Redis over it
    wait_mode(b, "shared")
    assert [e.get("event") for e in b.log_events()].count("state_backend_lost") == 0


@pytest.mark.slow
def test_a_frozen_redis_answers_unavailable_and_the_retry_is_stored_once(
    cluster: tuple[RedisServer, list[RelayServe], RelayIdentities],
) -> None:
    """Redis stopped with SIGSTOP while a sender queues via both instances: each call is
    answered (`unavailable` — never `queued`, never a hang), and once Redis continues
    (and runs what it had read meanwhile) the sender's retries are each queued once:
    the recipient fetches every msg_id exactly once."""
    redis, (a, b), ids = cluster
    recipient = RelayCaller(b.port, ids.recipient, b.address)
    senders = [RelayCaller(s.port, ids.sender, s.address) for s in (a, b)]
    try:
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        envelopes = {f"f{n}": envelope(ids.sender, ids.recipient, msg_id=f"f{n}")
                     for n in range(6)}
        redis.freeze()
        try:
            for n, (msg_id, env) in enumerate(envelopes.items()):
                result, _ = senders[n % 2].tool("relay_call", env)
                assert code_of(result) == "unavailable", result
        finally:
            redis.thaw()
        for serve in (a, b):
            wait_mode(serve, "shared")
        for n, (msg_id, env) in enumerate(envelopes.items()):
            result, _ = senders[(n + 1) % 2].tool("relay_call", env)
            assert result["structuredContent"] == {"status": "queued", "msg_id": msg_id}
        page = recipient.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        assert sorted(msg_ids(page)) == sorted(envelopes), msg_ids(page)
    finally:
        for caller in (recipient, *senders):
            caller.close()
    for serve in (a, b):
        assert "Traceback" not in serve.logs(), serve.logs()[-3000:]
