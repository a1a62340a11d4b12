"""The relay host on `serve --workers 2`: workers serve its connections, main keeps the
one store.

Real `serve` processes, real TLS with client certificates on loopback. Callers bind
127.0.0.2…127.0.0.9 so both workers get clients (`proto.workers.worker_for` says which
address goes where; /status's open connections per worker confirms it). Every wait is
bounded; nothing asserts timing.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pact_ingress.identity import b64url_decode
from pact_ingress.proto import workers as wp
from pact_ingress.proto.ratelimit import burst_for
from tests.relay_env import RelayCaller, RelayServe, code_of, envelope, relay_identities
from tests.terminate_env import WAIT
from tests.test_workers import poll

SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]
HIGH_LIMITS = "limits: {calls_per_hour_per_ip_key: 1000000, calls_per_hour_per_ip: 1000000}\n"


def by_worker(n: int = 2) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {i: [] for i in range(n)}
    for ip in SOURCES:
        out[wp.worker_for(ip, n)].append(ip)
    assert all(out.values()), f"every worker needs a source address: {out}"
    return out


def queued(result: dict[str, Any], msg_id: str) -> bool:
    return result.get("structuredContent") == {"status": "queued", "msg_id": msg_id}


def drain_queue(recipient: RelayCaller) -> dict[str, dict[str, str]]:
    """Every queued envelope by msg_id (fetched and acked page by page)."""
    found: dict[str, dict[str, str]] = {}
    for _ in range(1000):
        page = recipient.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        for item in page["items"]:
            header = json.loads(b64url_decode(item["envelope"]["protected"]))
            assert header["msg_id"] not in found, "an item came back twice"
            found[header["msg_id"]] = item["envelope"]
        recipient.tool("ack", {"ids": [item["id"] for item in page["items"]]})
        if not page["more"]:
            return found
    raise AssertionError("the queue did not drain")


def metric_total(metrics: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(metrics)
               if fam.name == name for s in fam.samples if s.name == name + "_total"
               and "worker" not in s.labels)


def _two_workers_relay(tmp_path: Path) -> tuple[Any, RelayServe, RelayCaller]:
    """Identities, `serve` with two workers and its relay, and the recipient (from
    worker 0's first address) allowing the sender."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        recipient = RelayCaller(serve.port, ids.recipient, source=by_worker()[0][0])
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
    except BaseException:
        serve.stop()
        raise
    return ids, serve, recipient


def test_calls_through_both_workers_land_in_the_one_store(tmp_path: Path) -> None:
    ids, serve, recipient = _two_workers_relay(tmp_path)
    try:
        groups = by_worker()
        callers = {ip: RelayCaller(serve.port, ids.sender, source=ip)
                   for ips in groups.values() for ip in ips}
        sent: dict[str, dict[str, str]] = {}
        for round_ in range(5):
            for ip, caller in callers.items():
                msg_id = f"{ip}-{round_}"
                env = sent[msg_id] = envelope(ids.sender, ids.recipient, msg_id=msg_id,
                                              text=f"body {msg_id}")
                result, _ = caller.tool("relay_call", env)
                assert queued(result, msg_id), result
        # a retry through the other worker is the duplicate answer, nothing new queued
        again = next(iter(callers.values()))
        first = next(iter(sent))
        assert queued(again.tool("relay_call", sent[first])[0], first)
        # every caller's connection is open on the worker its address belongs to
        workers = {w["index"]: w for w in serve.status()["workers"]}
        for index, ips in groups.items():
            assert workers[index]["open_connections"] >= len(ips), workers
        status = serve.status()["relay"]
        assert [q["items"] for q in status["queues"]] == [len(sent)]
        metrics = serve.metrics()
        assert metric_total(metrics, "pact_ingress_relay_enqueues") == len(sent) + 1
        found = drain_queue(recipient)
        assert found == sent
    finally:
        serve.stop()


def test_worker_killed_mid_relay_call_loses_no_acknowledged_item(tmp_path: Path) -> None:
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        victim = 0
        recipient = RelayCaller(serve.port, ids.recipient, source=groups[1][0])
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        pids = {w["index"]: w["pid"] for w in serve.status()["workers"]}
        sent: dict[str, dict[str, str]] = {}
        answered: set[str] = set()
        outcomes: dict[str, int] = {}
        lock = threading.Lock()
        stop = threading.Event()

        def sender(n: int, ip: str) -> None:
            caller = RelayCaller(serve.port, ids.sender, source=ip)
            for i in range(100_000):
                if stop.is_set():
                    return
                msg_id = f"{ip}-s{n}-{i}"
                env = envelope(ids.sender, ids.recipient, msg_id=msg_id, text=f"b {msg_id}")
                with lock:
                    sent[msg_id] = env
                try:
                    result, _ = caller.tool("relay_call", env)
                except (OSError, ValueError):
                    caller.close()
                    with lock:
                        outcomes["connection_lost"] = outcomes.get("connection_lost", 0) + 1
                    continue
                kind = "queued" if queued(result, msg_id) else str(code_of(result))
                with lock:
                    outcomes[kind] = outcomes.get(kind, 0) + 1
                    if kind == "queued":
                        answered.add(msg_id)

        threads = [threading.Thread(target=sender, args=(n, ip))
                   for n, ip in enumerate(groups[victim] * 2 + groups[1])]
        for t in threads:
            t.start()
        try:
            poll(lambda: len(answered) >= 100, "calls answered before the kill")
            os.kill(pids[victim], signal.SIGKILL)  # mid-stream: its senders keep firing
            before = len(answered)

            def replaced() -> bool:
                w = {x["index"]: x for x in serve.status()["workers"]}[victim]
                return w["pid"] != pids[victim] and w["state"] == "ready"

            poll(replaced, "the killed worker's replacement")
            poll(lambda: len(answered) >= before + 100, "calls answered after the kill")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=WAIT)
        with lock:
            acknowledged = set(answered)
            seen = dict(outcomes)
        print(f"outcomes {seen}")
        # nothing but queued, a lost connection, or an honest unavailable
        assert set(seen) <= {"queued", "connection_lost", "unavailable"}, seen
        found = drain_queue(recipient)
        missing = acknowledged - set(found)
        assert not missing, f"{len(missing)} acknowledged calls lost: {sorted(missing)[:5]}"
        for msg_id, env in found.items():
            assert env == sent[msg_id]
        # the replacement serves the victim's addresses again
        caller = RelayCaller(serve.port, ids.sender, source=groups[victim][0])
        env = envelope(ids.sender, ids.recipient, msg_id="after")
        assert queued(caller.tool("relay_call", env)[0], "after")
        restarts = {w["index"]: w["restarts"] for w in serve.status()["workers"]}
        assert restarts[victim] >= 1 and restarts[1 - victim] == 0, restarts
    finally:
        serve.stop()


def test_allowlist_change_through_one_worker_is_seen_through_the_other(
        tmp_path: Path) -> None:
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        for setter_worker in (0, 1):
            other = 1 - setter_worker
            recipient = RelayCaller(serve.port, ids.recipient, source=groups[setter_worker][0])
            reader = RelayCaller(serve.port, ids.recipient, source=groups[other][0])
            # kept open across the changes: no new handoff orders anything for it
            sender = RelayCaller(serve.port, ids.sender, source=groups[other][0])
            for round_ in range(6):
                allow = round_ % 2 == 0
                senders = [ids.sender.fingerprint] if allow else [ids.other.fingerprint]
                assert recipient.allowlist_set(senders).status == 200
                got = json.loads(reader.allowlist_get().body)["senders"]
                assert got == senders
                msg_id = f"w{setter_worker}-r{round_}"
                result, _ = sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                               msg_id=msg_id))
                if allow:
                    assert queued(result, msg_id), result
                else:
                    assert code_of(result) == "permission_denied", result
            for c in (recipient, reader, sender):
                c.close()
    finally:
        serve.stop()


def test_relay_budget_per_ip_and_key_is_exact_with_two_workers(tmp_path: Path) -> None:
    per_key = 12  # burst 5; the next call refills after 300 s, far beyond this test
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=(
        f"limits: {{calls_per_hour_per_ip_key: {per_key}, calls_per_hour_per_ip: 1000}}\n"))
    expected = burst_for(per_key)
    msg_ids = itertools.count()
    try:
        groups = by_worker()
        recipient = RelayCaller(serve.port, ids.recipient, source="127.0.0.1")
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        for ip in [ips[0] for ips in groups.values()]:
            callers = [RelayCaller(serve.port, ids.sender, source=ip) for _ in range(4)]
            admitted = limited = 0
            for _ in range(4):
                for caller in callers:
                    msg_id = f"lim-{next(msg_ids)}"
                    result, _ = caller.tool("relay_call", envelope(
                        ids.sender, ids.recipient, msg_id=msg_id))
                    if queued(result, msg_id):
                        admitted += 1
                    else:
                        assert code_of(result) == "rate_limited", result
                        limited += 1
            for c in callers:
                c.close()
            assert (admitted, limited) == (expected, 16 - expected), ip
        # the same key from the recipient's address has its own full budget
        assert len(drain_queue(recipient)) == 2 * expected
    finally:
        serve.stop()


# --- the store across the channel, in process ------------------------------------------

class _Relay:
    """What `StoreService` needs of main's RelayServer: the store, recipients, wakes."""

    def __init__(self, store: Any, recipients: dict[str, str]) -> None:
        self.store, self.recipients = store, recipients
        self.woke: list[str] = []

    def woken(self, recipient: str) -> None:
        self.woke.append(recipient)


@pytest.mark.parametrize("soon", [False, True], ids=["task", "soon"])
async def test_remote_store_answers_are_main_stores_and_a_broken_channel_is_unavailable(
        tmp_path: Path, soon: bool) -> None:
    """Both of main's ways to answer: a task per ask (`answer`), and an enqueue taken at
    once with its answer after the COMMIT (`answer_soon`, as `WorkerPool` does)."""
    import trio

    from pact_ingress.proto.workers import Kind
    from pact_ingress.relay.remote import RemoteStore, StoreService
    from pact_ingress.relay.store import QueueFull, SqliteStore, StoreUnavailable

    a, b = "sha256:" + "A" * 43, "sha256:" + "B" * 43
    # b may hold 3 items: its share of the 6 (the refusal crosses the channel alike)
    store = SqliteStore(tmp_path / "q.sqlite", max_items=6, max_bytes=10**6)
    await store.open()
    relay = _Relay(store, {a: "home"})
    service = StoreService(relay)
    pushed: list[bytes] = []

    async def broadcast(payload: bytes) -> None:
        pushed.append(payload)
        remote.apply_state(json.loads(payload))

    service.broadcast = broadcast
    ids = itertools.count(1)
    cut = trio.Event()

    async def send(kind: Kind, payload: bytes, msg_id: int) -> None:
        assert kind is Kind.RELAY_ASK
        if cut.is_set():
            raise OSError("channel closed")

        async def answer(req_id: int, record: bytes) -> None:
            out = await service.answer(record)
            remote.answered(wp.encode_records([(req_id, out)]))

        for req_id, record in wp.decode_records(payload):
            def reply(out: bytes, req_id: int = req_id) -> None:
                remote.answered(wp.encode_records([(req_id, out)]))

            if not (soon and service.answer_soon(record, reply)):
                nursery.start_soon(answer, req_id, record)

    remote = RemoteStore(send, lambda: next(ids))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(remote.run)
            # main checks the sender against its own lists (a stale worker's copy aside)
            with pytest.raises(StoreUnavailable):
                await remote.enqueue(a, b, "m0", b"[0]", 2_000_000_000)
            await remote.set_allowlist(a, (b,))
            first = await remote.enqueue(a, b, "m1", b'{"x":1}', 2_000_000_000)
            again = await remote.enqueue(a, b, "m1", b'{"x":1}', 2_000_000_000)
            assert not first.duplicate and again.duplicate and again.id == first.id
            # a wake for each queued answer, in main: the duplicate's too (its first call
            # may have been stored after that call's answer gave up)
            assert relay.woke == [a, a]
            await remote.enqueue(a, b, "m2", b"[2]", 2_000_000_000)
            await remote.enqueue(a, b, "m3", b"[3]", 2_000_000_000)
            with pytest.raises(QueueFull):
                await remote.enqueue(a, b, "m4", b"[4]", 2_000_000_000)
            items, more = await remote.fetch(a, 2)
            assert [i.envelope for i in items] == [b'{"x":1}', b"[2]"] and more
            assert await remote.ack(a, [i.id for i in items]) == 2
            assert store.depths()[a] == (1, 3)
            await remote.set_allowlist(a, (b,))
            assert remote.allowlists() == {a: frozenset({b})} and pushed
            with pytest.raises(StoreUnavailable):  # main serves no such recipient
                await remote.enqueue(b, a, "m5", b"[5]", 2_000_000_000)
            # concurrent calls travel together, each answered with its own outcome
            got: dict[str, Any] = {}

            async def call(msg_id: str) -> None:
                got[msg_id] = await remote.enqueue(a, b, msg_id, b"[x]", 2_000_000_000)

            await remote.ack(a, [i.id for i in (await remote.fetch(a, 10))[0]])
            async with trio.open_nursery() as inner:
                for msg_id in ("c1", "c2", "c1"):
                    inner.start_soon(call, msg_id)
            assert sorted(got) == ["c1", "c2"]
            await remote.ack(a, [i.id for i in (await remote.fetch(a, 10))[0]])

            async def blocked_send(kind: Kind, payload: bytes, msg_id: int) -> None:
                pass  # main never answers: then the channel closes

            remote._send = blocked_send
            outcome: list[BaseException] = []

            async def waiting() -> None:
                try:
                    await remote.enqueue(a, b, "m7", b"[7]", 2_000_000_000)
                except StoreUnavailable as exc:
                    outcome.append(exc)

            nursery.start_soon(waiting)
            await trio.sleep(0.05)
            remote.fail_all()  # what the worker does when its channel reads EOF
            await trio.sleep(0.05)
            assert len(outcome) == 1 and not remote.healthy
            with pytest.raises(StoreUnavailable):  # and every later call
                await remote.enqueue(a, b, "m8", b"[8]", 2_000_000_000)
            nursery.cancel_scope.cancel()
        # a sender that cannot reach main fails its calls too
        cut.set()
        remote = RemoteStore(send, lambda: next(ids))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(remote.run)
            with pytest.raises(StoreUnavailable):
                await remote.enqueue(a, b, "m6", b"[6]", 2_000_000_000)
            nursery.cancel_scope.cancel()
        items, _ = await store.fetch(a, 10)
        assert items == []  # m6, m7, m8 never reached main
    finally:
        await store.aclose()


def test_a_fetch_through_one_worker_sees_exactly_what_the_other_answered(
        tmp_path: Path) -> None:
    """Workers read fetch pages from main's file directly: an item is in every fetch
    after its ``queued`` answer came through the other worker, and an acked item in none
    after the ack's answer, whichever worker fetches."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        readers = [RelayCaller(serve.port, ids.recipient, source=groups[w][0]) for w in (0, 1)]
        senders = [RelayCaller(serve.port, ids.sender, source=groups[w][-1]) for w in (0, 1)]
        assert readers[0].allowlist_set([ids.sender.fingerprint]).status == 200
        outstanding: dict[str, int | None] = {}  # msg_id → item id once seen
        for n in range(40):
            msg_id = f"m{n}"
            sender, reader = senders[n % 2], readers[(n + 1) % 2]  # the other worker
            result, _ = sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                           msg_id=msg_id))
            assert queued(result, msg_id), result
            outstanding[msg_id] = None
            page = reader.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
            seen = {json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"]: i["id"]
                    for i in page["items"]}
            assert set(seen) == set(outstanding) and not page["more"], (n, seen)
            outstanding.update(seen)
            if n % 3 == 2:  # ack the two oldest through the fetching worker's peer
                done = sorted(outstanding, key=lambda m: outstanding[m] or 0)[:2]
                acked = readers[n % 2].tool("ack", {"ids": [outstanding[m] for m in done]})
                assert acked[0]["structuredContent"] == {"acked": 2}
                for m in done:
                    del outstanding[m]
                for r in readers:  # gone from both workers' next fetch
                    page = r.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
                    assert {i["id"] for i in page["items"]} == set(outstanding.values())
        # no read fell back to asking main (the in-process test below shows the path)
        assert "relay_direct_read_failed" not in serve.logs()
        assert serve.status()["relay"]["queues"][0]["items"] == len(outstanding)
    finally:
        serve.stop()


async def test_remote_fetch_reads_mains_file_exactly_and_asks_main_when_it_cannot(
        tmp_path: Path) -> None:
    import trio

    from pact_ingress.proto.workers import Kind, RelayOp
    from pact_ingress.relay.remote import RemoteStore, StoreService
    from pact_ingress.relay.store import SqliteStore

    a, b = "sha256:" + "A" * 43, "sha256:" + "B" * 43
    now = [1_000_000.0]
    path = tmp_path / "q.sqlite"
    store = SqliteStore(path, max_items=1000, max_bytes=10**7, clock=lambda: now[0])
    await store.open()
    await store.set_allowlist(a, (b,))  # main queues only for a listed sender
    service = StoreService(_Relay(store, {a: "home"}))
    asked: list[RelayOp] = []
    ids = itertools.count(1)

    async def send(kind: Kind, payload: bytes, msg_id: int) -> None:
        for req_id, record in wp.decode_records(payload):
            asked.append(RelayOp(wp.decode_ask(record)[0]))
            remote.answered(wp.encode_records([(req_id, await service.answer(record))]))

    remote = RemoteStore(send, lambda: next(ids))
    remote.clock = lambda: now[0]
    remote.apply_state(json.loads(service.state()))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(remote.run)
            expect: dict[int, int] = {}  # item id → expires_at
            for n in range(30):
                # items expiring at different times: the direct read filters as main does
                expires = int(now[0]) + 5 + n % 4
                done = await remote.enqueue(a, b, f"m{n}", b'{"n":%d}' % n, expires)
                expect[done.id] = expires
                if n % 4 == 3:
                    acked = sorted(expect)[:2]
                    assert await remote.ack(a, acked) == 2
                    for i in acked:
                        del expect[i]
                if n % 7 == 6:
                    now[0] += 2  # some items expire on the way
                asked.clear()
                for limit in (1, 3, 1000):
                    got, more = await remote.fetch(a, limit)
                    main_got, main_more = await store.fetch(a, limit)
                    assert (got, more) == (main_got, main_more)
                    live = sorted(i for i, e in expect.items() if e > now[0])
                    assert [i.id for i in got] == live[:limit]
                    assert more == (len(live) > limit)
                assert asked == []  # all three pages came from the file, none from main
            now[0] += 10  # everything expired: gone from both
            assert await remote.fetch(a, 1000) == ([], False)
            # main says its store is broken: the worker asks main (which probes) instead
            remote.apply_state({"healthy": False, "last_error": "x", "sqlite_path": str(path)})
            asked.clear()
            assert await remote.fetch(a, 10) == ([], False) and asked == [RelayOp.FETCH]
            # the file at the path is replaced: the worker reads the new one, or asks main
            remote.apply_state({"healthy": True, "sqlite_path": str(path)})
            await store.aclose()
            path.rename(tmp_path / "aside.sqlite")
            store = service.relay.store = SqliteStore(
                path, max_items=1000, max_bytes=10**7, clock=lambda: now[0])
            await store.open()
            await store.set_allowlist(a, (b,))
            fresh = await remote.enqueue(a, b, "new", b"[1]", int(now[0]) + 60)
            asked.clear()
            got, _ = await remote.fetch(a, 10)
            assert [i.id for i in got] == [fresh.id] and asked == []
            # an unreadable path: main is asked, no error reaches the caller
            remote.apply_state({"healthy": True, "sqlite_path": str(tmp_path / "none")})
            asked.clear()
            got, _ = await remote.fetch(a, 10)
            assert [i.id for i in got] == [fresh.id] and asked == [RelayOp.FETCH]
            nursery.cancel_scope.cancel()
    finally:
        await remote.aclose()
        await store.aclose()


async def test_an_ask_main_never_answers_fails_after_the_timeout(autojump_clock: Any) -> None:
    import pytest
    import trio

    from pact_ingress.proto.workers import Kind
    from pact_ingress.relay.remote import ASK_TIMEOUT, RemoteStore
    from pact_ingress.relay.store import StoreUnavailable

    sent: list[bytes] = []

    async def send(kind: Kind, payload: bytes, msg_id: int) -> None:
        sent.append(payload)  # main takes it and never answers

    remote = RemoteStore(send, itertools.count(1).__next__)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(remote.run)
        started = trio.current_time()
        with pytest.raises(StoreUnavailable):
            await remote.enqueue("sha256:" + "A" * 43, "b", "m", b"[1]", 2_000_000_000)
        waited = trio.current_time() - started
        assert ASK_TIMEOUT <= waited <= ASK_TIMEOUT + 1.5 and len(sent) == 1
        assert remote._waiting == {}  # nothing left behind
        nursery.cancel_scope.cancel()


def _senders(serve: RelayServe, ids: Any, calls: Callable[[str, RelayCaller], None],
             errors: list[str]) -> list[threading.Thread]:
    """One started thread per address of SOURCES, each running `calls` with its own
    sender connection from that address; what escapes `calls` goes to `errors`."""
    def run(ip: str) -> None:
        try:
            c = RelayCaller(serve.port, ids.sender, source=ip)
            calls(ip, c)
            c.close()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(f"{ip}: {exc!r}")

    threads = [threading.Thread(target=run, args=(ip,)) for ip in SOURCES]
    for t in threads:
        t.start()
    return threads


def test_the_same_msg_ids_raced_through_both_workers_are_stored_once(
        tmp_path: Path) -> None:
    """Every caller, on both workers, sends the same envelopes at once (the same msg_ids,
    odd ones among them: non-ASCII, an emoji, 5 KB long): each call is answered
    queued, and each msg_id is stored exactly once, byte for byte."""
    ids, serve, recipient = _two_workers_relay(tmp_path)
    try:
        msg_ids = [f"race-{i}" for i in range(12)] + [
            "ünïcødé-ключ-鍵", "emoji-\U0001f600", "x" * 5000, "quote\"back\\slash"]
        sent = {m: envelope(ids.sender, ids.recipient, msg_id=m, text=f"body {m[:20]}")
                for m in msg_ids}
        errors: list[str] = []
        start = threading.Barrier(len(SOURCES))

        def calls(ip: str, c: RelayCaller) -> None:
            start.wait(WAIT)
            for m in msg_ids:
                result, _ = c.tool("relay_call", sent[m])
                if not queued(result, m):
                    errors.append(f"{ip} {m[:20]}: {result}")

        threads = _senders(serve, ids, calls, errors)
        for t in threads:
            t.join(2 * WAIT)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert drain_queue(recipient) == sent
    finally:
        serve.stop()


def test_calls_while_the_store_cannot_write_are_unavailable_never_queued_falsely(
        tmp_path: Path) -> None:
    """Callers on both workers fire relay_calls while another process holds the store's
    file locked (an exclusive transaction: every write fails once the busy timeout
    passes), then lets it go. Every call is answered, queued or `unavailable`, none
    hangs; every call answered queued is in the queue afterwards, exactly as sent."""
    import sqlite3
    import time

    ids, serve, recipient = _two_workers_relay(tmp_path)
    try:
        sent: dict[str, dict[str, str]] = {}
        answered: set[str] = set()
        unavailable: set[str] = set()
        errors: list[str] = []
        lock = threading.Lock()
        stop = threading.Event()

        def calls(ip: str, c: RelayCaller) -> None:
            for i in range(5000):  # and at most until `stop`
                if stop.is_set():
                    break
                m = f"{ip}-{i}"
                env = envelope(ids.sender, ids.recipient, msg_id=m, text=f"b {m}")
                with lock:
                    sent[m] = env
                result, _ = c.tool("relay_call", env)
                with lock:
                    if queued(result, m):
                        answered.add(m)
                    elif code_of(result) == "unavailable":
                        unavailable.add(m)
                    else:
                        errors.append(f"{m}: {result}")
                if m in unavailable:
                    time.sleep(0.02)  # as a client backs off

        threads = _senders(serve, ids, calls, errors)
        deadline = time.monotonic() + WAIT
        while len(answered) < 50 and time.monotonic() < deadline:
            time.sleep(0.01)
        holder = sqlite3.connect(tmp_path / "state" / "relay.sqlite", timeout=WAIT)
        try:
            holder.execute("BEGIN EXCLUSIVE")  # mid-stream: nobody else writes now
            before = len(unavailable)
            deadline = time.monotonic() + 3 * WAIT
            while len(unavailable) == before and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            holder.rollback()
            holder.close()
        # released: the store comes back (reopened on demand) and calls are queued again
        after = len(answered)
        deadline = time.monotonic() + 3 * WAIT
        while len(answered) == after and time.monotonic() < deadline and all(
                t.is_alive() for t in threads):
            time.sleep(0.05)
        stop.set()
        for t in threads:
            t.join(3 * WAIT)
        assert not any(t.is_alive() for t in threads)
        assert errors == []
        assert unavailable, "the locked store never answered unavailable"
        assert len(answered) > after, "the store never came back"
        found = drain_queue(recipient)
        assert answered <= set(found), sorted(answered - set(found))[:5]
        for m, env in found.items():
            assert env == sent[m]
    finally:
        serve.stop()
