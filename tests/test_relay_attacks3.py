"""The relay with its default SQLite store under inputs and timings the other relay
attack files do not try: msg_id idempotency across the retention cap, ack and fetch
arguments at their edges, allow-lists at their edges, with one process and with two
workers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.relay_env import (
    RelayCaller,
    RelayServe,
    code_of,
    envelope,
    in_process,
    relay_identities,
)
from tests.test_relay_attacks import clean_log, depth
from tests.test_relay_workers import HIGH_LIMITS, by_worker, queued

DAY = 86400


async def test_an_acked_call_retried_after_the_retention_cap_is_not_delivered_again(
        tmp_path: Path) -> None:
    """A relayed call's ts may lie in the future (only exp bounds it), so its envelope can
    outlive the 30-day retention cap. Once the recipient fetched and acked it, the
    sender's retry of the very same envelope (same msg_id, still unexpired) must stay
    the duplicate it is, also after the cap passed and the purge ran: handing it to the
    node a second time is exactly what the msg_id key exists to prevent."""
    ids = relay_identities(tmp_path)
    clock = [float(int(time.time()))]
    now = int(clock[0])
    env = envelope(ids.sender, ids.recipient, msg_id="future", ts=now + 10 * DAY,
                   exp=now + 40 * DAY)

    def body(port: int, ingress: Any) -> None:
        recipient = RelayCaller(port, ids.recipient)
        sender = RelayCaller(port, ids.sender)
        try:
            assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
            assert queued(sender.tool("relay_call", env)[0], "future")
            page = recipient.tool("fetch_queued", {})[0]["structuredContent"]
            got = [i["id"] for i in page["items"]]
            assert len(got) == 1
            assert recipient.tool("ack", {"ids": got})[0]["structuredContent"] == {
                "acked": 1}
            clock[0] = now + 31 * DAY  # past the cap, before exp
            trio.from_thread.run(ingress.relay.purge)
            assert queued(sender.tool("relay_call", env)[0], "future")
            again = recipient.tool("fetch_queued", {})[0]["structuredContent"]
            assert again["items"] == [], "an acked call was queued and delivered twice"
        finally:
            recipient.close()
            sender.close()

    await in_process(tmp_path, ids, clock, body)


def _fp(i: int) -> str:
    """A well-formed fingerprint nobody holds."""
    import base64
    import hashlib

    digest = hashlib.sha256(i.to_bytes(8, "big")).digest()
    return "sha256:" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_ack_and_fetch_arguments_at_their_edges(tmp_path: Path, workers: int) -> None:
    """Acks naming another recipient's ids, ids twice, ids already acked, and ids that
    are no ids (negative, zero, past 2^63, floats, strings, booleans, null, nested, a
    5000-digit number) remove exactly the caller's own named items; odd fetch limits get
    bad_request; every answer is a defined one, the log holds no traceback, and /status
    and /metrics count exactly what is left."""
    from pact_ingress.identity import keygen
    from tests.test_relay_attacks import metric

    ids = relay_identities(tmp_path)
    second = keygen(tmp_path / "second.key", common_name="second")
    serve = RelayServe(tmp_path, recipients=[ids.recipient, second], workers=workers,
                       extra=HIGH_LIMITS)
    try:
        r1 = RelayCaller(serve.port, ids.recipient)
        r2 = RelayCaller(serve.port, second)
        sender = RelayCaller(serve.port, ids.sender)
        for r in (r1, r2):
            assert r.allowlist_set([ids.sender.fingerprint]).status == 200
        for m in ("a1", "a2", "a3"):
            assert queued(sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                             msg_id=m))[0], m)
        assert queued(sender.tool("relay_call", envelope(ids.sender, second,
                                                         msg_id="b1"))[0], "b1")
        page1 = r1.tool("fetch_queued", {})[0]["structuredContent"]
        mine = [i["id"] for i in page1["items"]]
        assert len(mine) == 3 and page1["more"] is False
        # another recipient naming them acks nothing
        assert r2.tool("ack", {"ids": mine})[0]["structuredContent"] == {"acked": 0}
        odd = [-1, 0, 2**63, 2**64, -2**63, float(mine[0]), str(mine[0]), True, None,
               [mine[0]], {"id": mine[0]}, 1e300]
        assert r1.tool("ack", {"ids": odd})[0]["structuredContent"] == {"acked": 0}
        # a number too long for Python's int conversion: a defined error, not a crash
        huge = ('{"jsonrpc":"2.0","id":7,"method":"tools/call","params":{"name":"ack",'
                '"arguments":{"ids":[' + "9" * 5000 + "]}}}").encode()
        resp = r1.request("POST", "/relay/mcp", huge)
        doc = json.loads(resp.body)
        assert resp.status == 400 and doc["error"]["code"] == -32700, (
            resp.status, resp.body[:200])
        for limit in (0, -1, 1.5, "1", True, None, [1]):
            result = r1.tool("fetch_queued", {"limit": limit})[0]
            assert code_of(result) == "bad_request", (limit, result)
        assert r1.tool("ack", {"ids": [mine[0], mine[0]]})[0]["structuredContent"] == {
            "acked": 1}
        assert r1.tool("ack", {"ids": [mine[0]]})[0]["structuredContent"] == {"acked": 0}
        page = r1.tool("fetch_queued", {"limit": 10**30})[0]["structuredContent"]
        assert [i["id"] for i in page["items"]] == mine[1:]
        page2 = r2.tool("fetch_queued", {})[0]["structuredContent"]
        assert len(page2["items"]) == 1
        assert depth(serve)[0] == 3
        assert metric(serve.metrics(), "pact_ingress_relay_queued_items") == 3
        assert r1.tool("ack", {"ids": mine[1:] + [page2["items"][0]["id"]]})[0][
            "structuredContent"] == {"acked": 2}
        assert r2.tool("ack", {"ids": [page2["items"][0]["id"]]})[0][
            "structuredContent"] == {"acked": 1}
        assert depth(serve) == (0, 0)
        text = serve.metrics()
        assert metric(text, "pact_ingress_relay_queued_items") == 0
        assert metric(text, "pact_ingress_relay_queued_bytes") == 0
        for c in (r1, r2, sender):
            c.close()
        clean_log(serve)
    finally:
        serve.stop()


def test_allowlist_posts_at_their_edges(tmp_path: Path) -> None:
    """Empty, duplicated, 10,000-entry, over-long, malformed and self-naming lists: each
    is applied whole or refused whole with its code, and a relay_call is judged by
    exactly the list last applied."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        owner = RelayCaller(serve.port, ids.recipient)
        sender = RelayCaller(serve.port, ids.sender)
        s = ids.sender.fingerprint

        def listed() -> list[str]:
            return list(json.loads(owner.allowlist_get().body)["senders"])

        def call(m: str) -> Any:
            return sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id=m))[0]

        assert owner.allowlist_set([]).status == 200 and listed() == []
        assert code_of(call("e1")) == "permission_denied"
        resp = owner.allowlist_set([s, s, s])
        assert resp.status == 200 and json.loads(resp.body) == {"senders": 1}
        assert listed() == [s] and queued(call("d1"), "d1")
        many = [_fp(i) for i in range(9_999)] + [s]
        resp = owner.allowlist_set(many)
        assert resp.status == 200, resp.body[:200]
        assert sorted(listed()) == sorted(many) and queued(call("m1"), "m1")
        for w, sources in by_worker().items():  # every worker holds the long list
            via = RelayCaller(serve.port, ids.sender, source=sources[0])
            m = f"w{w}"
            assert queued(via.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                          msg_id=m))[0], m)
            via.close()
        over = [_fp(i) for i in range(10_001)]
        resp = owner.allowlist_set(over)
        assert resp.status == 413 and json.loads(resp.body)["code"] == "too_large"
        for bad in (["sha256:short"], [s.upper()], [123], [None], [s + "="], [s, ""],
                    ["sha256:" + "A" * 42 + "B"]):
            resp = owner.allowlist_set(bad)
            assert resp.status == 400, (bad, resp.status)
            assert json.loads(resp.body)["code"] == "bad_request"
        for body in (b'{"senders": "x"}', b'{"senders": [], "x": 1}', b"[]", b"null",
                     b'{"senders": [], "senders": []}', b"\xff", b""):
            resp = owner.request("POST", "/relay/allowlist", body)
            assert resp.status == 400, (body, resp.status)
        assert sorted(listed()) == sorted(many)  # every refusal left the list alone
        resp = owner.allowlist_set([ids.recipient.fingerprint])
        assert resp.status == 200
        assert code_of(call("x1")) == "permission_denied"
        owner.close()
        sender.close()
        clean_log(serve)
    finally:
        serve.stop()


async def test_expiry_is_enforced_at_the_boundary_second_for_exp_and_for_the_cap(
        tmp_path: Path) -> None:
    """One item expiring at its exp, one at the 30-day cap (its exp later still): each is
    fetched the second before and not at the second itself; a purge then removes exactly
    them and the counters say so; a retry of the capped one before its exp is not told
    'queued' for an item nobody will ever fetch."""
    ids = relay_identities(tmp_path)
    clock = [float(int(time.time())) + 0.25]
    t0 = int(clock[0])
    short = envelope(ids.sender, ids.recipient, msg_id="short", ts=t0, exp=t0 + 100)
    capped = envelope(ids.sender, ids.recipient, msg_id="capped", ts=t0 + DAY,
                      exp=t0 + 31 * DAY)

    def body(port: int, ingress: Any) -> None:
        recipient = RelayCaller(port, ids.recipient)
        sender = RelayCaller(port, ids.sender)

        def fetched() -> list[str]:
            page = recipient.tool("fetch_queued", {})[0]["structuredContent"]
            return sorted(json.loads(__import__("base64").urlsafe_b64decode(
                i["envelope"]["protected"] + "==="))["msg_id"] for i in page["items"])

        try:
            assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
            assert queued(sender.tool("relay_call", short)[0], "short")
            assert queued(sender.tool("relay_call", capped)[0], "capped")
            clock[0] = t0 + 99.75
            assert fetched() == ["capped", "short"]
            clock[0] = t0 + 100
            assert fetched() == ["capped"]
            assert code_of(sender.tool("relay_call", short)[0]) == "envelope_invalid"
            assert trio.from_thread.run(ingress.relay.purge) == 1
            clock[0] = t0 + 30 * DAY - 0.5
            assert fetched() == ["capped"]
            stale = [i["id"] for i in recipient.tool("fetch_queued", {})[0][
                "structuredContent"]["items"]]
            clock[0] = t0 + 30 * DAY
            assert fetched() == []
            retry = sender.tool("relay_call", capped)[0]
            if queued(retry, "capped"):
                assert fetched() == ["capped"], "told queued, yet never deliverable"
                # an ack naming what the node fetched before the cap is no ack of this
                assert recipient.tool("ack", {"ids": stale})[0]["structuredContent"] == {
                    "acked": 0}
                assert fetched() == ["capped"]
            assert trio.from_thread.run(ingress.relay.purge) in (0, 1)
            status = ingress.relay.status()
            assert sum(q["items"] for q in status["queues"]) == len(fetched())
        finally:
            recipient.close()
            sender.close()

    await in_process(tmp_path, ids, clock, body)


async def test_a_batch_reviving_expired_items_keeps_depths_true(tmp_path: Path) -> None:
    """Store level, so several enqueues share one transaction (the multi-row path):
    retries of expired, unpurged items beside new calls and another sender's reuse of a
    msg_id. Each gets its defined answer, every retry is fetchable again, and the
    in-memory depths equal a count of the table afterwards (before and after a purge)."""
    from pact_ingress.relay.store import (
        Enqueued,
        MsgIdTaken,
        QueueFull,
        SqliteStore,
        _count_depths,
        _open,
    )

    r, a, b = "sha256:" + "R" * 43, "sha256:" + "A" * 43, "sha256:" + "B" * 43
    clock = [1_800_000_000.0]
    store = SqliteStore(tmp_path / "q.sqlite", max_items=100, max_bytes=10_000,
                        clock=lambda: clock[0])
    await store.open()
    try:
        t0 = int(clock[0])
        for m in ("e1", "e2", "e3"):
            await store.enqueue(r, a, m, b"x" * 100, t0 + 10)
        clock[0] = t0 + 10  # all three expired, none purged
        results: dict[str, Any] = {}

        async def one(m: str, sender: str, size: int) -> None:
            try:
                results[m + sender[-1]] = await store.enqueue(r, sender, m, b"y" * size,
                                                              t0 + 1000)
            except (MsgIdTaken, QueueFull) as exc:
                results[m + sender[-1]] = type(exc).__name__

        async with trio.open_nursery() as nursery:
            for m, sender, size in (("e1", a, 50), ("e2", a, 300), ("n1", a, 10),
                                    ("e3", b, 10), ("e1", a, 50)):
                nursery.start_soon(one, m, sender, size)
        assert results["e3B"] == "MsgIdTaken"
        assert isinstance(results["e1A"], Enqueued) and isinstance(results["e2A"], Enqueued)
        page, _ = await store.fetch(r, 100)
        assert sorted(i.envelope for i in page) == sorted(
            [b"y" * 50, b"y" * 300, b"y" * 10])
        conn = _open(tmp_path / "q.sqlite")
        try:
            assert store.depths() == _count_depths(conn)
        finally:
            conn.close()
        assert await store.purge() == 1  # e3, still expired
        conn = _open(tmp_path / "q.sqlite")
        try:
            assert store.depths() == _count_depths(conn) == {r: (3, 360)}
        finally:
            conn.close()
    finally:
        await store.aclose()


async def test_acked_keys_are_kept_until_exp_but_not_for_ever(tmp_path: Path) -> None:
    """An acked item's key outlives its 30-day retention up to its envelope's exp, so
    a retry stays the duplicate; an exp years ahead (a ts that far ahead is allowed)
    keeps the row no longer than the store's key bound, so acked rows cannot pile up."""
    from pact_ingress.envelope import canonical_envelope
    from pact_ingress.relay.store import KEY_RETENTION, SqliteStore, _open

    ids = relay_identities(tmp_path)
    clock = [1_800_000_000.0]
    t0 = int(clock[0])
    store = SqliteStore(tmp_path / "q.sqlite", max_items=100, max_bytes=100_000,
                        clock=lambda: clock[0])
    await store.open()
    r, s = ids.recipient.fingerprint, ids.sender.fingerprint

    def rows() -> int:
        conn = _open(tmp_path / "q.sqlite")
        try:
            return int(conn.execute("SELECT COUNT(*) FROM items").fetchone()[0])
        finally:
            conn.close()

    try:
        far = canonical_envelope(envelope(ids.sender, ids.recipient, msg_id="far",
                                          ts=t0 + 3 * 365 * DAY, exp=t0 + 3 * 365 * DAY + DAY))
        first = await store.enqueue(r, s, "far", far, t0 + 30 * DAY)
        assert await store.ack(r, [first.id]) == 1
        clock[0] = t0 + KEY_RETENTION - 1
        await store.purge()
        again = await store.enqueue(r, s, "far", far, int(clock[0]) + 30 * DAY)
        assert again.duplicate and again.id == first.id
        clock[0] = t0 + KEY_RETENTION
        await store.purge()
        assert rows() == 0
    finally:
        await store.aclose()


async def test_one_ack_of_a_full_page_spanning_chunks_acks_exactly_it(tmp_path: Path) -> None:
    """A full page (1000 ids: more than one statement's worth of parameters) acked at
    once, mixed with ids of another recipient: exactly the caller's are acked, depths
    and the table agree, and every acked key still answers its retry as a duplicate."""
    from pact_ingress.envelope import canonical_envelope
    from pact_ingress.proto.relay import MAX_ACK_IDS
    from pact_ingress.relay.store import SqliteStore, _count_depths, _open

    ids = relay_identities(tmp_path)
    clock = [float(int(time.time()))]
    t0 = int(clock[0])
    store = SqliteStore(tmp_path / "q.sqlite", max_items=2000, max_bytes=10**8,
                        clock=lambda: clock[0])
    await store.open()
    r, s, other = ids.recipient.fingerprint, ids.sender.fingerprint, ids.other.fingerprint
    env = canonical_envelope(envelope(ids.sender, ids.recipient, msg_id="x"))
    try:
        mine = [(await store.enqueue(r, s, f"m{i}", env, t0 + 3600)).id
                for i in range(MAX_ACK_IDS - 10)]
        theirs = [(await store.enqueue(other, s, f"m{i}", env, t0 + 3600)).id
                  for i in range(10)]
        assert await store.ack(r, sorted(mine + theirs)) == len(mine)
        assert await store.ack(r, mine) == 0
        assert store.depths()[r] == (0, 0) and store.depths()[other] == (10, 10 * len(env))
        conn = _open(tmp_path / "q.sqlite")
        try:
            assert _count_depths(conn) == {
                other: (10, 10 * len(env))}
        finally:
            conn.close()
        for i in (0, 499, 500, MAX_ACK_IDS - 11):
            assert (await store.enqueue(r, s, f"m{i}", env, t0 + 3600)).duplicate
    finally:
        await store.aclose()
