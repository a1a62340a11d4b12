"""The relay host attacked from outside: a real `pact-ingress serve` (one process, or
main plus two workers) on loopback, hostile callers and recipients, kills and a full disk.

What every test here holds to, whatever the attack:

* every answer is a defined one: strict JSON (RFC 8259: no NaN, UTF-8) with the
  documented JSON-RPC error or MCP tool error and HTTP status; no connection dropped
  unanswered, no traceback or connection error in the log;
* nothing answered ``queued`` is ever lost (kill -9 included), nothing acked comes back,
  nothing is stored beyond a recipient's bounds, no recipient sees another's items;
* the counters (/status, /metrics of the admin endpoint) say what the store holds.
"""

from __future__ import annotations

import json
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pact_ingress.envelope import MAX_PROTECTED_CHARS, canonical_envelope
from pact_ingress.identity import b64url_decode, keygen
from tests.relay_env import (
    RELAY_HOST,
    RelayCaller,
    RelayH2,
    RelayIdentities,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
    relay_socket,
    rpc,
    tool_body,
)
from tests.terminate_env import WAIT, H2Result
from tests.test_relay_workers import HIGH_LIMITS, by_worker, drain_queue, queued


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def strict_json(body: bytes) -> Any:
    """The answer as RFC 8259 reads it: UTF-8, and no NaN / Infinity."""
    return json.loads(body.decode("utf-8"), parse_constant=_no_constant)


def clean_log(serve: RelayServe) -> None:
    text = serve.logs()
    bad = [line for line in text.splitlines()
           if "Traceback" in line or "relay_connection_error" in line
           or "internal_error" in line]
    assert not bad, bad[:3]


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples (every label set)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


def depth(serve: RelayServe) -> tuple[int, int]:
    queues = serve.status()["relay"]["queues"]
    return sum(q["items"] for q in queues), sum(q["bytes"] for q in queues)


def msg_ids(page: dict[str, Any]) -> list[str]:
    return [json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"]
            for i in page["items"]]


class Threads:
    """Threads whose failures fail the test (an assert in a thread is otherwise only a
    warning): `start` them, then `join` re-raises the first error."""

    def __init__(self) -> None:
        self.threads: list[threading.Thread] = []
        self.errors: list[BaseException] = []

    def add(self, fn: Any, *args: Any) -> None:
        def run() -> None:
            try:
                fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the test thread
                self.errors.append(exc)

        self.threads.append(threading.Thread(target=run))

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float = WAIT) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a thread did not finish"
        if self.errors:
            raise self.errors[0]


# --- odd JSON --------------------------------------------------------------------------


def test_odd_json_always_gets_a_defined_json_answer(tmp_path: Path) -> None:
    """Bodies a JSON parser might take but JSON-RPC does not: the answer is always strict
    JSON with a JSON-RPC code, whichever thread parsed the body (over 64 KiB: a worker
    thread, whose stack is shallower than the event loop's), and nothing is queued."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=1)
    try:
        owner = RelayCaller(serve.port, ids.recipient)
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender)
        good = json.loads(tool_body("relay_call", envelope(ids.sender, ids.recipient,
                                                            msg_id="in-a-batch")))
        pad = b" " * (70 * 1024)  # past the inline bound: parsed in a worker thread

        def deep(n: int) -> str:
            return "[" * n + "]" * n

        ping = '{"jsonrpc":"2.0","method":"ping","id":%s}'
        cases: list[tuple[bytes, int, int | None]] = [  # body, HTTP status, JSON-RPC code
            ((ping % "NaN").encode(), 400, -32700),
            ((ping % "Infinity").encode(), 400, -32700),
            ((ping % "-Infinity").encode(), 400, -32700),
            ((ping % "1e999").encode(), 400, -32600),  # a float (infinity, even)
            ((ping % ("9" * 5000)).encode(), 400, -32700),  # past int parsing's bound
            ((ping % "[1]").encode(), 400, -32600),  # ids are strings, numbers or null
            ((ping % '{"a":1}').encode(), 400, -32600),
            ((ping % "true").encode(), 400, -32600),
            ((ping % deep(900)).encode(), 400, -32600),
            ((ping % deep(980)).encode() + pad, 400, None),  # -32700 or -32600
            ((ping % deep(2000)).encode() + pad, 400, -32700),
            (('{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":'
              + deep(980) + '}}').encode() + pad, 200, -32602),
            ((b'{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":"relay_call",'
              b'"arguments":{"protected":NaN,"enc":"","ct":"","sig":""}}}'), 400, -32700),
            ((ping % "1").encode("utf-16"), 400, -32700),  # JSON on the wire is UTF-8
            ((ping % "1").encode("utf-32"), 400, -32700),
            ((ping % '"\xff"').encode("latin-1"), 400, -32700),
            (b"\xef\xbb\xbf" + (ping % "1").encode(), 400, -32700),  # as the edge: no BOM
            ((ping % "1.5").encode(), 400, -32600),  # ids are integers, as on the edge
            ((ping % "1,\"id\":2").encode(), 400, -32700),  # a member named twice
            ((ping % "1").encode() + b"\x00", 400, -32700),
            (json.dumps([good, {"jsonrpc": "2.0"}]).encode(), 400, -32600),  # no batches
            (json.dumps([good]).encode(), 400, -32600),
        ]
        for body, status, code in cases:
            resp = sender.request("POST", "/relay/mcp", body)
            what = body[:60]
            assert resp.status == status, (what, resp.status, resp.body[:120])
            doc = strict_json(resp.body)
            if status == 400:
                assert doc["id"] is None, (what, doc)
                assert doc["error"]["code"] in ((-32700, -32600) if code is None else (code,)
                                                ), (what, doc)
            elif code is not None:
                assert doc["error"]["code"] == code, (what, doc)
        # a member named twice deep inside the call: refused, nothing queued
        call = tool_body("relay_call", envelope(ids.sender, ids.recipient, msg_id="twice"))
        doubled = call.replace(b'"sig": ', b'"sig": "AAAA", "sig": ', 1)
        resp = sender.request("POST", "/relay/mcp", doubled)
        assert resp.status == 400 and strict_json(resp.body)["error"]["code"] == -32700
        # the allow-list body is read by the same rules: refused whole, the list stays
        fp = json.dumps(ids.sender.fingerprint)
        for body in ((f'{{"senders": [{fp}]}}').encode("utf-16"),
                     f'{{"senders": [], "senders": [{fp}]}}'.encode(),
                     f'{{"senders": [{fp}, NaN]}}'.encode(),
                     b"\xef\xbb\xbf" + f'{{"senders": [{fp}]}}'.encode()):
            resp = owner.request("POST", "/relay/allowlist", body)
            assert resp.status == 400 and strict_json(resp.body)["code"] == "bad_request", (
                body[:40], resp.status)
        assert strict_json(owner.allowlist_get().body) == {
            "senders": [ids.sender.fingerprint]}
        # nothing of the batches was queued; the connection still serves
        page = owner.tool("fetch_queued", {})[0]["structuredContent"]
        assert page == {"items": [], "more": False}
        assert sender.rpc(rpc("ping", rpc_id="after"))[0] == {
            "jsonrpc": "2.0", "id": "after", "result": {}}
        clean_log(serve)
    finally:
        serve.stop()


# --- the store file: modes, kill -9 after queued and after ack --------------------------


def serve_with_store(tmp_path: Path, ids: RelayIdentities, store: Path) -> RelayServe:
    """Two workers, the relay's store file at `store`."""

    class Serve(RelayServe):
        def render(self) -> str:
            return super().render().replace("  cert:", f"  store: {store}\n  cert:", 1)

    return Serve(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)


def test_store_files_are_private_and_kill9_keeps_queued_and_acked(tmp_path: Path) -> None:
    """The store (and SQLite's -wal / -shm beside it, which hold the same envelopes) is
    readable by its owner only, also when it sits in a directory others can read; a
    kill -9 of main (its workers exit with it) right after a `queued` answer keeps the
    item, right after an `ack` answer keeps it acked (never handed out again, and its
    msg_id still answered as the duplicate)."""
    ids = relay_identities(tmp_path)
    public = tmp_path / "public"
    public.mkdir(mode=0o755)
    public.chmod(0o755)
    store = public / "relay.sqlite"

    serve = serve_with_store(tmp_path, ids, store)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender, source=groups[1][0])
        assert queued(sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                          msg_id="acked"))[0], "acked")
        page = owner.tool("fetch_queued", {})[0]["structuredContent"]
        assert msg_ids(page) == ["acked"]
        assert owner.tool("ack", {"ids": [page["items"][0]["id"]]})[0][
            "structuredContent"] == {"acked": 1}
        serve.kill9()  # right after the ack was answered
        serve.restart()
        for r in range(2):
            envs = {m: envelope(ids.sender, ids.recipient, msg_id=m)
                    for m in (f"k{r}-1", f"k{r}-2")}
            sender = RelayCaller(serve.port, ids.sender, source=groups[1][0])
            for m, env in envs.items():
                assert queued(sender.tool("relay_call", env)[0], m)
            serve.kill9()  # right after the queued answers
            serve.restart()
            files = [store, *(Path(f"{store}{s}") for s in ("-wal", "-shm"))]
            modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files
                     if f.exists()}
            assert modes and set(modes.values()) == {"0o600"}, modes
            owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
            # the acked item is gone for good, also when its sender retries it
            again = RelayCaller(serve.port, ids.sender, source=groups[1][1])
            assert queued(again.tool("relay_call", envelope(
                ids.sender, ids.recipient, msg_id="acked"))[0], "acked")
            assert set(drain_queue(owner)) == set(envs)
        assert depth(serve) == (0, 0)
        clean_log(serve)
    finally:
        serve.stop()


# --- bounds: exact, with both workers racing ------------------------------------------


def test_bounds_are_exact_with_two_workers_racing(tmp_path: Path) -> None:
    """Calls for two recipients raced through both workers from four addresses, by four
    senders (one each; a sender alone holds at most half a queue): one recipient's queue
    stops exactly at its byte bound (an item that lands right on it fits), the other's
    exactly at its item bound; every other call is `rate_limited` with retry_after 60, a
    duplicate is still answered as one at a full queue, one ack makes room for exactly
    one more, and /status and /metrics say what was stored."""
    ids = relay_identities(tmp_path)
    second = keygen(tmp_path / "second.key", common_name="second")
    # ed25519 like ids.sender: every sender's envelopes of one text have one size
    senders = [ids.sender] + [keygen(tmp_path / f"s{k}.key", ed25519_key=True,
                                     common_name=f"s{k}") for k in range(1, 4)]
    now = int(time.time())
    sender_of: dict[str, Any] = {}

    def env(to: Any, m: str, text: str) -> dict[str, str]:
        sender_of[m] = senders[int(m[2:]) % len(senders)]
        return envelope(sender_of[m], to, msg_id=m, text=text, ts=now, exp=now + 3600)

    big = {f"b-{i:03d}": env(ids.recipient, f"b-{i:03d}", "x" * 600) for i in range(30)}
    small = {f"s-{i:03d}": env(second, f"s-{i:03d}", "") for i in range(30)}
    big_size = {len(canonical_envelope(e)) for e in big.values()}
    small_size = {len(canonical_envelope(e)) for e in small.values()}
    assert len(big_size) == 1 and len(small_size) == 1, (big_size, small_size)
    size_big, size_small = big_size.pop(), small_size.pop()
    max_items, bytes_bound = 10, 7 * size_big  # 7 big items land exactly on the byte bound
    assert max_items * size_small < bytes_bound  # the small ones stop at the item bound
    serve = RelayServe(tmp_path, recipients=[ids.recipient, second], workers=2,
                       max_items=max_items, max_bytes=str(bytes_bound), extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owners = {ids.recipient.fingerprint: RelayCaller(serve.port, ids.recipient,
                                                         source=groups[0][0]),
                  second.fingerprint: RelayCaller(serve.port, second, source=groups[1][0])}
        for owner in owners.values():
            assert owner.allowlist_set([s.fingerprint for s in senders]).status == 200
        work = list(big.items()) + list(small.items())
        sources = groups[0][:2] + groups[1][:2]
        assert len(sources) == len(senders)
        answers: dict[str, dict[str, Any]] = {}
        lock = threading.Lock()
        gate = threading.Barrier(len(sources))

        def racer(k: int) -> None:
            caller = RelayCaller(serve.port, senders[k], source=sources[k])
            try:
                gate.wait(timeout=WAIT)
                for m, e in [(m, e) for m, e in work if sender_of[m] is senders[k]]:
                    result, resp = caller.tool("relay_call", e)
                    assert resp.status == 200, (m, resp.status)
                    with lock:
                        answers[m] = result
            finally:
                caller.close()

        threads = Threads()
        for k in range(len(sources)):
            threads.add(racer, k)
        threads.start()
        threads.join()
        assert len(answers) == len(work)
        ok = {m for m, r in answers.items() if queued(r, m)}
        refused = {m: r for m, r in answers.items() if m not in ok}
        assert all(code_of(r) == "rate_limited" and r["structuredContent"]["retry_after"] == 60
                   for r in refused.values()), list(refused.values())[:2]
        ok_big, ok_small = {m for m in ok if m in big}, {m for m in ok if m in small}
        assert (len(ok_big), len(ok_small)) == (7, max_items)
        assert depth(serve) == (7 + max_items, 7 * size_big + max_items * size_small)
        text = serve.metrics()
        assert metric(text, "pact_ingress_relay_queued_items") == 7 + max_items
        assert metric(text, "pact_ingress_relay_queued_bytes") == (
            7 * size_big + max_items * size_small)
        callers = {id(s): RelayCaller(serve.port, s, source=groups[1][1]) for s in senders}

        def call(m: str) -> dict[str, Any]:
            return callers[id(sender_of[m])].tool("relay_call", big[m])[0]

        dup = min(ok_big)
        assert queued(call(dup), dup)  # full, yet a duplicate
        owner = owners[ids.recipient.fingerprint]
        page = owner.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        assert set(msg_ids(page)) == ok_big and not page["more"]
        assert owner.tool("ack", {"ids": [page["items"][0]["id"]]})[0][
            "structuredContent"] == {"acked": 1}
        # the acked item's sender has room again; then the one holding the least (under
        # its share: 7 items, 4 senders) meets the whole queue's bound
        acked = msg_ids(page)[0]
        again = min(m for m in set(big) - ok_big if sender_of[m] is sender_of[acked])
        assert queued(call(again), again)
        stored = ok_big - {acked} | {again}
        held = {id(s): sum(sender_of[m] is s for m in stored) for s in senders}
        least = min(senders, key=lambda s: held[id(s)])
        assert held[id(least)] < 3
        # never `again` (stored now) nor an id stored before: those are duplicates,
        # answered "queued" even at a full queue
        blocked = min(m for m in set(big) - ok_big - {again} if sender_of[m] is least)
        assert code_of(call(blocked)) == "rate_limited"
        # each recipient holds exactly its own answered calls
        assert set(drain_queue(owner)) == stored
        assert set(drain_queue(owners[second.fingerprint])) == ok_small
        assert depth(serve) == (0, 0)
        clean_log(serve)
    finally:
        serve.stop()


# --- recipients: two fetchers at once, while calls arrive -------------------------------


def test_two_fetchers_of_one_recipient_while_calls_arrive(tmp_path: Path) -> None:
    """The recipient fetches and acks from two connections (one per worker) with pages
    of every size while a sender queues: every queued item reaches a fetcher, each is
    acked exactly once in all (the other ack of it counts 0), nothing stays, another
    recipient sees none of it and cannot ack it, and odd limits are bad_request."""
    ids = relay_identities(tmp_path)
    second = keygen(tmp_path / "second.key", common_name="second")
    serve = RelayServe(tmp_path, recipients=[ids.recipient, second], workers=2,
                       extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        snoop = RelayCaller(serve.port, second, source=groups[1][2])
        for bad in (0, -1, 1.5, "5", True, None, [], {"n": 1}, 2 ** 64 * -1):
            result, resp = owner.tool("fetch_queued", {"limit": bad})
            assert resp.status == 200 and code_of(result) == "bad_request", (bad, result)
        for bad_args in ({"limit": 1, "x": 1}, [], "x", None):
            assert code_of(owner.tool("fetch_queued", bad_args)[0]) == "bad_request"
        total = 60
        sent: set[str] = set()
        done = threading.Event()
        seen: list[set[str]] = [set(), set()]
        acked = [0, 0]
        foreign: list[str] = []

        def sender() -> None:
            caller = RelayCaller(serve.port, ids.sender, source=groups[1][0])
            try:
                for i in range(total):
                    m = f"f-{i}"
                    assert queued(caller.tool("relay_call", envelope(
                        ids.sender, ids.recipient, msg_id=m))[0], m)
                    sent.add(m)
            finally:
                caller.close()
                done.set()

        def fetcher(k: int) -> None:
            caller = RelayCaller(serve.port, ids.recipient, source=groups[k][1])
            limits = [1, 3, 1000, 10 ** 9, 7, 2]
            try:
                empty_after_done = 0
                for n in range(2000):
                    page = caller.tool("fetch_queued", {"limit": limits[n % len(limits)]})[
                        0]["structuredContent"]
                    got = msg_ids(page)
                    seen[k].update(got)
                    # another recipient reading and acking at the same time
                    other = snoop.tool("fetch_queued", {})[0]["structuredContent"]
                    foreign.extend(msg_ids(other))
                    ids_ = [i["id"] for i in page["items"]]
                    if ids_:
                        assert snoop.tool("ack", {"ids": ids_})[0][
                            "structuredContent"] == {"acked": 0}
                    count = caller.tool("ack", {"ids": ids_})[0]["structuredContent"]["acked"]
                    assert 0 <= count <= len(ids_)
                    acked[k] += count
                    if not got and done.is_set():
                        empty_after_done += 1
                        if empty_after_done == 2:
                            return
            finally:
                caller.close()

        snoop_lock = threading.Lock()
        real_tool = snoop.tool

        def locked_tool(name: str, arguments: Any) -> Any:
            with snoop_lock:  # one connection, two threads: one request at a time
                return real_tool(name, arguments)

        snoop.tool = locked_tool  # type: ignore[method-assign]
        threads = Threads()
        threads.add(sender)
        threads.add(fetcher, 0)
        threads.add(fetcher, 1)
        threads.start()
        threads.join(WAIT * 2)
        assert len(sent) == total
        assert seen[0] | seen[1] == sent  # every item reached a fetcher
        assert acked[0] + acked[1] == total  # and was acked exactly once in all
        assert not foreign
        assert owner.tool("fetch_queued", {})[0]["structuredContent"] == {
            "items": [], "more": False}
        assert depth(serve) == (0, 0)
        assert metric(serve.metrics(), "pact_ingress_relay_acked_items_total") == total
        clean_log(serve)
    finally:
        serve.stop()


# --- a full disk ---------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs (needs CAP_SYS_ADMIN, as root in the test container): a real
    ENOSPC under SQLite, which no chmod can give root."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs",
                           str(mnt)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, f"cannot mount a tmpfs for the full-disk test: {done.stderr}"
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_full_disk_answers_unavailable_and_queues_nothing_falsely(
        tmp_path: Path, small_disk: Path) -> None:
    """Large calls into a store on a disk that fills up (main's store, calls through a
    worker): each answer is `queued` or `unavailable`, the processes stay up and say so
    on /status, every `queued` is there to fetch once the disk has room again, and
    nothing answered `unavailable` reached the recipient."""
    ids = relay_identities(tmp_path)
    store = small_disk / "relay.sqlite"

    serve = serve_with_store(tmp_path, ids, store)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender, source=groups[1][0])
        answers: dict[str, str] = {}
        for i in range(30):  # ~130 KiB each: the 1 MiB disk is full well before
            m = f"big-{i}"
            result, resp = sender.tool("relay_call", envelope(
                ids.sender, ids.recipient, msg_id=m, text="y" * 96_000))
            assert resp.status == 200, (m, resp.status)
            answers[m] = "queued" if queued(result, m) else str(code_of(result))
            if list(answers.values()).count("unavailable") >= 3:
                break
        kinds = set(answers.values())
        assert kinds == {"queued", "unavailable"}, answers
        assert serve.proc is not None and serve.proc.poll() is None
        status = serve.status()["relay"]
        assert status["healthy"] is False and status["last_error"]
        # the recipient meanwhile: unavailable, or (a worker reads main's file itself,
        # which a full disk does not stop) a page of answered calls only
        fetched = owner.tool("fetch_queued", {"limit": 1000})[0]
        if code_of(fetched) != "unavailable":
            page = fetched["structuredContent"]
            assert set(msg_ids(page)) <= {m for m, k in answers.items() if k == "queued"}
        # room again: the store comes back by itself (reopened on demand)
        subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
        deadline = time.monotonic() + WAIT
        while True:
            result, _ = sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                           msg_id="after"))
            if queued(result, "after"):
                break
            assert code_of(result) == "unavailable", result
            assert time.monotonic() < deadline, "the store did not come back"
            time.sleep(0.5)
        got = set(drain_queue(owner))
        ok = {m for m, k in answers.items() if k == "queued"}
        assert got == ok | {"after"}, (sorted(got), answers)
        text = serve.metrics()
        assert metric(text, "pact_ingress_relay_refusals_total") >= 3
        assert serve.status()["relay"]["healthy"] is True
        clean_log(serve)
    finally:
        serve.stop()


# --- msg_ids across senders ----------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_a_msg_id_of_one_sender_never_swallows_another_senders_call(
        tmp_path: Path, workers: int) -> None:
    """A msg_id is the recipient's idempotency key whoever sends it, so a second listed
    sender's call under a msg_id another sender's item holds cannot be stored; answered
    `queued` as a duplicate, it would be acknowledged and never delivered. It is refused
    (`bad_request`, nothing stored) and goes through under a fresh msg_id; the first
    sender's own retry is still the duplicate it always was. With two workers the answer
    crosses the worker channel from main's store."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=workers,
                       extra=HIGH_LIMITS)
    try:
        owner = RelayCaller(serve.port, ids.recipient)
        assert owner.allowlist_set([ids.sender.fingerprint, ids.other.fingerprint]
                                   ).status == 200
        first = RelayCaller(serve.port, ids.other)
        second = RelayCaller(serve.port, ids.sender)
        assert queued(first.tool("relay_call", envelope(ids.other, ids.recipient,
                                                         msg_id="1"))[0], "1")
        taken, _ = second.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="1"))
        assert code_of(taken) == "bad_request", taken
        assert "fresh msg_id" in json.dumps(taken)
        assert queued(first.tool("relay_call", envelope(ids.other, ids.recipient,
                                                         msg_id="1"))[0], "1")  # a retry
        assert queued(second.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                          msg_id="2"))[0], "2")
        page = owner.tool("fetch_queued", {})[0]["structuredContent"]
        held = sorted((json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"],
                       json.loads(b64url_decode(i["envelope"]["protected"]))["from"])
                      for i in page["items"])
        assert held == [("1", ids.other.fingerprint), ("2", ids.sender.fingerprint)], held
        clean_log(serve)
    finally:
        serve.stop()


# --- floods and replays --------------------------------------------------------------------


def test_a_flooding_address_is_budgeted_while_a_bystander_is_served(tmp_path: Path) -> None:
    """One address floods relay_call under three listed keys from parallel connections;
    another address on the same worker calls meanwhile. The flooder gets at most each
    (address, key) burst and the address's burst in all, every refusal rate_limited with
    an integer retry_after; the bystander is queued every time; replays of one envelope
    and a msg_id reused with another body are stored once (the first), answered alike."""
    ids = relay_identities(tmp_path)
    third = keygen(tmp_path / "third.key", common_name="third")
    bystander = keygen(tmp_path / "bystander.key", common_name="bystander")
    per_key, per_ip = 60, 100
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=(
        f"limits: {{calls_per_hour_per_ip_key: {per_key}, calls_per_hour_per_ip: {per_ip}}}\n"))
    try:
        from pact_ingress.proto.ratelimit import burst_for

        groups = by_worker()
        flood_ip, calm_ip = groups[0][0], groups[0][1]
        owner = RelayCaller(serve.port, ids.recipient, source=groups[1][0])
        keys = [ids.sender, ids.other, third]
        assert owner.allowlist_set([k.fingerprint for k in [*keys, bystander]]).status == 200
        flood: dict[str, list[str]] = {k.fingerprint: [] for k in keys}
        calm: list[str] = []
        lock = threading.Lock()

        def flooder(k: int, conn: int) -> None:
            ident = keys[k]
            caller = RelayCaller(serve.port, ident, source=flood_ip)
            try:
                for i in range(15):
                    m = f"fl-{k}-{conn}-{i}"
                    result, _ = caller.tool("relay_call", envelope(ident, ids.recipient,
                                                                      msg_id=m))
                    kind = "queued" if queued(result, m) else str(code_of(result))
                    if kind == "rate_limited":
                        retry = result["structuredContent"]["retry_after"]
                        assert isinstance(retry, int) and retry >= 1, result
                    with lock:
                        flood[ident.fingerprint].append(kind)
            finally:
                caller.close()

        def calm_caller() -> None:
            caller = RelayCaller(serve.port, bystander, source=calm_ip)
            try:
                for i in range(5):
                    m = f"calm-{i}"
                    kind = "queued" if queued(caller.tool("relay_call", envelope(
                        bystander, ids.recipient, msg_id=m))[0], m) else "refused"
                    with lock:
                        calm.append(kind)
                    time.sleep(0.05)
            finally:
                caller.close()

        threads = Threads()
        for k in range(3):
            for c in range(2):
                threads.add(flooder, k, c)
        threads.add(calm_caller)
        threads.start()
        threads.join()
        assert calm == ["queued"] * 5
        kinds = {kind for answers in flood.values() for kind in answers}
        assert kinds <= {"queued", "rate_limited"} and sum(map(len, flood.values())) == 90
        counts = {fp: answers.count("queued") for fp, answers in flood.items()}
        # a refill of at most one call meanwhile (60 an hour is one a minute)
        assert all(n <= burst_for(per_key) + 1 for n in counts.values()), counts
        assert sum(counts.values()) <= burst_for(per_ip) + 1, counts
        stored = sum(counts.values()) + 5
        assert depth(serve)[0] == stored
        limited = sum(a.count("rate_limited") for a in flood.values())
        text = serve.metrics()
        assert metric(text, 'pact_ingress_relay_refusals_total{code="rate_limited"}') == limited

        # replays, from an address with budget left: one envelope twice, then its msg_id
        # with another body; one item, the first body
        calm_again = RelayCaller(serve.port, bystander, source=groups[1][1])
        first = envelope(bystander, ids.recipient, msg_id="replay", text="first")
        answers = [calm_again.tool("relay_call", e)[0] for e in (
            first, first, envelope(bystander, ids.recipient, msg_id="replay", text="other"))]
        assert all(queued(a, "replay") for a in answers)
        assert answers[0] == answers[1] == answers[2]
        got = drain_queue(owner)
        assert len(got) == stored + 1 and got["replay"] == first
        clean_log(serve)
    finally:
        serve.stop()


# --- real clients, both HTTP versions, multiplexed streams ------------------------------


def _curl(serve: RelayServe, ident: Any, body: bytes, version: str, tmp: Path
          ) -> tuple[int, bytes]:
    data = tmp / "curl-body.json"
    data.write_bytes(body)
    cert = ["--cert", str(ident.cert_path), "--key", str(ident.key_path)] if ident else []
    done = subprocess.run(
        ["curl", "-sS", "-k", version, "--resolve", f"{RELAY_HOST}:{serve.port}:127.0.0.1",
         "-H", "content-type: application/json", "--data-binary", f"@{data}",
         "-w", "\n%{http_code} %{http_version}", "--max-time", "20", *cert,
         f"https://{RELAY_HOST}:{serve.port}/relay/mcp"],
        check=False, capture_output=True, timeout=30)
    assert done.returncode == 0, done.stderr
    out, _, tail = done.stdout.rpartition(b"\n")
    code, http = tail.decode().split()
    assert http == ("2" if version == "--http2" else "1.1"), (version, http)
    return int(code), out


def _h2_streams(serve: RelayServe, ident: Any, source: str, bodies: list[bytes]
                ) -> list[tuple[int | None, bytes]]:
    """Every body on its own stream of one HTTP/2 connection, all sent before any answer
    is read."""
    conn = RelayH2.__new__(RelayH2)
    conn._start(relay_socket(serve.port, ident, alpn=("h2",), source=source), RELAY_HOST,
                validate=True)
    try:
        sids = []
        for body in bodies:
            sid = conn.conn.get_next_available_stream_id()
            conn._results[sid] = H2Result(None, [], b"")
            conn.conn.send_headers(sid, [(b":method", b"POST"), (b":scheme", b"https"),
                                         (b":authority", RELAY_HOST.encode()),
                                         (b":path", b"/relay/mcp"),
                                         (b"content-type", b"application/json")])
            conn.conn.send_data(sid, body, end_stream=True)
            sids.append(sid)
        conn.sock.sendall(conn.conn.data_to_send())
        conn._pump(until=lambda: all(s in conn._done for s in sids), timeout=WAIT)
        return [(conn._results[s].status, conn._results[s].body) for s in sids]
    finally:
        conn.close()


def test_real_clients_on_both_versions_and_multiplexed_calls_against_the_bound(
        tmp_path: Path) -> None:
    """curl over HTTP/1.1 and HTTP/2 (with and without a client certificate) gets the
    same defined answers; calls multiplexed on HTTP/2 streams of two connections, one
    per worker (and one sender each), stop exactly at the recipient's item bound."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, max_items=8,
                       extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.sender.fingerprint, ids.other.fingerprint]
                                   ).status == 200
        body = tool_body("relay_call", envelope(ids.other, ids.recipient, msg_id="curl"))
        answers = {v: _curl(serve, ids.other, body, v, tmp_path)
                   for v in ("--http2", "--http1.1")}
        assert answers["--http2"] == answers["--http1.1"]  # the duplicate's answer: alike
        status, out = answers["--http2"]
        assert status == 200 and queued(strict_json(out)["result"], "curl")
        for v in ("--http2", "--http1.1"):
            status, out = _curl(serve, None, body, v, tmp_path)
            assert status == 401 and code_of(strict_json(out)["result"]) == \
                "identity_required", (v, out)
            status, out = _curl(serve, ids.other, b'{"id": NaN}', v, tmp_path)
            assert status == 400 and strict_json(out)["error"]["code"] == -32700
        # 2 × 20 calls on the streams of two connections (one per worker), one sender
        # each: 7 places left, of which a sender's share (4 of 8) holds at most 4, and
        # the other one's at most 3 beside its first call
        results: dict[int, list[tuple[int | None, bytes]]] = {}
        senders = (ids.sender, ids.other)

        def blast(k: int) -> None:
            results[k] = _h2_streams(serve, senders[k], groups[k][1], [
                tool_body("relay_call", envelope(senders[k], ids.recipient,
                                                 msg_id=f"h2-{k}-{i}"), rpc_id=i)
                for i in range(20)])

        threads = Threads()
        threads.add(blast, 0)
        threads.add(blast, 1)
        threads.start()
        threads.join()
        ok = set()
        for k, answers_k in results.items():
            for i, (status, out) in enumerate(answers_k):
                assert status == 200, (k, i, status, out[:100])
                result = strict_json(out)["result"]
                if queued(result, f"h2-{k}-{i}"):
                    ok.add(f"h2-{k}-{i}")
                else:
                    assert code_of(result) == "rate_limited", result
        assert len(results) == 2 and len(ok) == 7, (len(results), ok)
        assert set(drain_queue(owner)) == ok | {"curl"}
        clean_log(serve)
    finally:
        serve.stop()


# --- kill -9 amid acks and calls; odd msg_ids ----------------------------------------------


def test_kill9_amid_acks_and_calls_keeps_acked_acked_and_queued_queued(
        tmp_path: Path) -> None:
    """Main killed (its workers exit with it) while the recipient acks from two
    connections (one per worker) and a sender keeps calling: after the restart no item
    whose ack was answered comes back, and every item answered `queued` and not acked is
    there (an ack cut off before its answer may have landed or not)."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        owner.close()
        lock = threading.Lock()
        answered: set[str] = set()
        acked: set[str] = set()  # msg_ids whose ack was answered
        in_flight: set[str] = set()  # msg_ids of an ack sent, its answer not (yet) read
        stop = threading.Event()

        def sender(k: int) -> None:
            caller = RelayCaller(serve.port, ids.sender, source=groups[k][2])
            for i in range(400):
                if stop.is_set():
                    return
                m = f"c{k}-{i}"
                try:
                    result, _ = caller.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                                   msg_id=m))
                except (OSError, ValueError):
                    return  # the process is gone
                if queued(result, m):
                    with lock:
                        answered.add(m)

        def acker(k: int) -> None:
            caller = RelayCaller(serve.port, ids.recipient, source=groups[k][1])
            for _ in range(2000):
                if stop.is_set():
                    return
                try:
                    page = caller.tool("fetch_queued", {"limit": 10})[0]["structuredContent"]
                    names = dict(zip([i["id"] for i in page["items"]], msg_ids(page),
                                     strict=True))
                    with lock:
                        in_flight.update(names.values())
                    result = caller.tool("ack", {"ids": list(names)})[0]
                except (OSError, ValueError, KeyError):
                    return  # the process is gone, or said unavailable to the fetch
                if code_of(result) == "unavailable":
                    return  # main is gone: a worker no longer knows what became of it
                assert "acked" in result["structuredContent"], result
                with lock:
                    acked.update(names.values())

        threads = Threads()
        for k in (0, 1):
            threads.add(sender, k)
            threads.add(acker, k)
        threads.start()
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            with lock:
                if len(acked) >= 60 and len(answered) >= 120:
                    break
            time.sleep(0.01)
        serve.kill9()
        stop.set()
        threads.join()
        assert len(acked) >= 60, (len(acked), len(answered))
        serve.restart()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        found = set(drain_queue(owner))
        assert not found & acked, sorted(found & acked)[:5]
        lost = answered - acked - in_flight - found
        assert not lost, sorted(lost)[:5]
        clean_log(serve)
    finally:
        serve.stop()


def test_odd_msg_ids_are_keys_of_their_own(tmp_path: Path) -> None:
    """msg_ids that differ only in a NUL, case, a trailing space, Unicode normal form, or
    that are near the header's bound: each is its own item, answered with exactly its
    msg_id, and a replay of each is the duplicate."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        # the longest msg_id whose encoded header is right at its bound, and one longer
        longest = 1000
        while len(envelope(ids.sender, ids.recipient, msg_id="x" * (longest + 1))[
                "protected"]) <= MAX_PROTECTED_CHARS:
            longest += 1 if len(envelope(ids.sender, ids.recipient, msg_id="x" * (
                longest + 64))["protected"]) > MAX_PROTECTED_CHARS else 64
        over = envelope(ids.sender, ids.recipient, msg_id="x" * (longest + 1))
        odd = ["a", "a\x00", "a\x00b", "A", "a ", "\u00e9", "e\u0301", "\u202eevil", "\n",
               "x" * longest, "%00", "a\\", '"', "\U0001f600", "NaN", "null", "0", "-0"]
        sender = RelayCaller(serve.port, ids.sender, source=groups[1][0])
        assert code_of(sender.tool("relay_call", over)[0]) == "envelope_invalid"
        envs = {m: envelope(ids.sender, ids.recipient, msg_id=m) for m in odd}
        for m in odd:
            result, resp = sender.tool("relay_call", envs[m])
            assert resp.status == 200 and queued(result, m), (m[:20], result)
        again = RelayCaller(serve.port, ids.sender, source=groups[0][1])
        for m in odd:
            assert queued(again.tool("relay_call", envs[m])[0], m), m[:20]
        got = drain_queue(owner)
        assert set(got) == set(odd) and all(got[m] == envs[m] for m in odd)
        clean_log(serve)
    finally:
        serve.stop()


# --- counters after a purge ------------------------------------------------------------------


async def test_queue_gauges_follow_a_purge_to_zero(tmp_path: Path) -> None:
    """In process, so the relay's clock can move: once the purge has dropped a queue's
    last (expired) items, /metrics' queued items and bytes for it say 0, as /status does,
    not what the queue held before."""
    import trio

    from tests.relay_env import in_process

    ids = relay_identities(tmp_path)
    clock = [time.time()]
    now = int(clock[0])
    labels = {"recipient": ids.recipient.fingerprint}

    def body(port: int, ingress: Any) -> None:
        def gauges() -> tuple[float, float]:
            return (ingress.stats.value("pact_ingress_relay_queued_items", labels),
                    ingress.stats.value("pact_ingress_relay_queued_bytes", labels))

        recipient = RelayCaller(port, ids.recipient)
        sender = RelayCaller(port, ids.sender)
        try:
            assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
            for m in ("e1", "e2"):
                assert queued(sender.tool("relay_call", envelope(
                    ids.sender, ids.recipient, msg_id=m, ts=now, exp=now + 60))[0], m)
        finally:
            recipient.close()
            sender.close()
        items, size = gauges()
        assert items == 2 and size > 0
        clock[0] = now + 61
        assert trio.from_thread.run(ingress.relay.purge) == 2
        assert ingress.relay.status()["queues"] == []
        assert gauges() == (0, 0)

    await in_process(tmp_path, ids, clock, body)


# --- an item larger than a whole queue -------------------------------------------------------


def test_an_item_larger_than_a_senders_share_is_too_large_not_retry_later(
        tmp_path: Path) -> None:
    """An envelope larger than a sender's share of a recipient's byte bound (half of
    it) can never be queued, even into an empty queue: it is `too_large` (retrying it
    in 60 s, as `rate_limited` says, would repeat until it expires); one exactly at the
    share is queued, and then the sender's next is `rate_limited` (its share is full)
    while another sender's still fits."""
    ids = relay_identities(tmp_path)
    now = int(time.time())
    exact = envelope(ids.sender, ids.recipient, msg_id="exact", text="z" * 3000, ts=now)
    share = len(canonical_envelope(exact))
    over = envelope(ids.sender, ids.recipient, msg_id="over", text="z" * 3100, ts=now)
    assert len(canonical_envelope(over)) > share
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2,
                       max_bytes=str(2 * share), extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.sender.fingerprint,
                                    ids.other.fingerprint]).status == 200
        for source in (groups[0][1], groups[1][0]):  # the same answer through either worker
            sender = RelayCaller(serve.port, ids.sender, source=source)
            result, resp = sender.tool("relay_call", over)
            assert resp.status == 200 and code_of(result) == "too_large", result
        assert queued(sender.tool("relay_call", exact)[0], "exact")
        small = envelope(ids.sender, ids.recipient, msg_id="small", text="")
        assert code_of(sender.tool("relay_call", small)[0]) == "rate_limited"
        other = RelayCaller(serve.port, ids.other, source=groups[1][0])
        mine = envelope(ids.other, ids.recipient, msg_id="other", text="")
        assert queued(other.tool("relay_call", mine)[0], "other")
        assert set(drain_queue(owner)) == {"exact", "other"}
        clean_log(serve)
    finally:
        serve.stop()
