"""Attacks on three recent changes, through real `pact-ingress serve` processes on loopback:

- the quick ClientHello check (`proto/hello_fast.quick_sni`) must never route a hello
  differently from the full parser (`proto/clienthello.parse_client_hello`): crafted
  hellos (duplicate SNI, several names, trailing bytes, record/handshake length
  mismatches, trailing dot, upper case, punycode, NUL, …) go through a serve with two
  passthrough routes whose backends say who they are, and the backend reached (or none)
  must be the parser's verdict; the same inputs, and random mutations of them, are
  checked in-process too;
- the relay on `serve --workers 2`: one msg_id raced through both workers at once is
  stored once and both callers get the same kind of answer; a recipient cannot ack or
  fetch another recipient's items; fetch limits of every odd kind never break the
  server nor move the queue.

Every wait is bounded; nothing asserts timing.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import socket
import ssl
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pact_ingress.proto.clienthello import ClientHelloError, parse_client_hello
from pact_ingress.proto.hello_fast import quick_sni
from tests.test_edge import Backend, echo
from tests.test_serve import WAIT, Served, free_port, recv_exact

# --- ClientHello builder -------------------------------------------------------------------


def ext(kind: int, data: bytes) -> bytes:
    return struct.pack(">HH", kind, len(data)) + data


def sni_ext(*names: bytes, types: tuple[int, ...] | None = None) -> bytes:
    types = types or (0,) * len(names)
    entries = b"".join(bytes([t]) + struct.pack(">H", len(n)) + n for t, n in zip(types, names))
    return ext(0, struct.pack(">H", len(entries)) + entries)


ALPN = ext(16, b"\x00\x0c\x02h2\x08http/1.1")
VERSIONS = ext(43, b"\x04\x03\x04\x03\x03")


def hello(exts: list[bytes], *, body_tail: bytes = b"", hs_delta: int = 0,
          rec_delta: int = 0, after: bytes = b"", session: bytes = b"\x11" * 32) -> bytes:
    """One handshake record holding a ClientHello with `exts`; deltas skew the lengths."""
    block = b"".join(exts)
    body = (b"\x03\x03" + b"\x22" * 32 + bytes([len(session)]) + session
            + b"\x00\x04\x13\x01\x13\x02" + b"\x01\x00"
            + struct.pack(">H", len(block)) + block + body_tail)
    msg = b"\x01" + (len(body) + hs_delta).to_bytes(3, "big") + body
    return b"\x16\x03\x01" + struct.pack(">H", len(msg) + rec_delta) + msg + after


A_SNI, B_SNI, ECHO_SNI = "a.attack.test", "b.attack.test", "c.attack.test"


def crafted() -> dict[str, bytes]:
    """Named hellos an attacker might use to make the two checks disagree."""
    a, b = A_SNI.encode(), B_SNI.encode()
    out = {
        "plain_a": hello([sni_ext(a), ALPN, VERSIONS]),
        "plain_b": hello([sni_ext(b)]),
        "upper": hello([sni_ext(a.upper())]),
        "trailing_dot": hello([sni_ext(b + b".")]),
        "two_dots": hello([sni_ext(a + b"..")]),
        "two_names_a_b": hello([sni_ext(a, b)]),
        "other_type_then_b": hello([sni_ext(a, b, types=(1, 0))]),
        "b_then_other_type": hello([sni_ext(b, a, types=(0, 7))]),
        "duplicate_sni_ext": hello([sni_ext(a), sni_ext(b)]),
        "duplicate_alpn": hello([sni_ext(a), ALPN, ALPN]),
        "nul_in_name": hello([sni_ext(a + b"\x00" + b)]),
        "nul_suffix": hello([sni_ext(a + b"\x00")]),
        "idn_punycode": hello([sni_ext(b"xn--bcher-kva.attack.test")]),
        "idn_raw_utf8": hello([sni_ext("bücher.attack.test".encode())]),
        "space": hello([sni_ext(b" " + a)]),
        "tab_suffix": hello([sni_ext(a + b"\t")]),
        "empty_name": hello([sni_ext(b"")]),
        "empty_list": hello([ext(0, b"\x00\x00")]),
        "sni_list_short": hello([ext(0, b"\x00\x05" + b"\x00\x00\x0d" + a)]),
        "sni_list_long": hello([ext(0, struct.pack(">H", len(a) + 4) + b"\x00\x00\x0d" + a
                                    + b"\x00")]),
        "trailing_after_ext_block": hello([sni_ext(a)], body_tail=b"\x00\x00"),
        "bytes_after_hello_in_record": hello([sni_ext(a)], rec_delta=7, after=b"\x00" * 7),
        "record_shorter_than_handshake": hello([sni_ext(a)], rec_delta=-3),
        "handshake_longer": hello([sni_ext(a)], hs_delta=2, rec_delta=2, after=b"\x00\x00"),
        "handshake_shorter": hello([sni_ext(b)], hs_delta=-2),
        "second_record_after": hello([sni_ext(a)], after=b"\x17\x03\x03\x00\x01X"),
        "bad_alpn_empty_name": hello([sni_ext(a), ext(16, b"\x00\x03\x02h2\x00")]),
        "bad_versions_odd": hello([sni_ext(b), ext(43, b"\x03\x03\x04\x03")]),
        "long_session_id": hello([sni_ext(a)], session=b"\x00" * 33),
        "label_64": hello([sni_ext(b"x" * 64 + b".attack.test")]),
        "name_254": hello([sni_ext((b"x" * 62 + b".") * 4 + b"ab")]),
        "underscore": hello([sni_ext(b"a_b.attack.test")]),
        "ip_literal": hello([sni_ext(b"127.0.0.1")]),
    }
    # the same hello split across two records: the quick check must defer to the parser
    whole = out["plain_b"]
    msg = whole[5:]
    out["two_records_b"] = (b"\x16\x03\x01" + struct.pack(">H", 10) + msg[:10]
                            + b"\x16\x03\x01" + struct.pack(">H", len(msg) - 10) + msg[10:])
    return out


def verdict(data: bytes) -> str:
    """The full parser's routing verdict: the SNI, or why there is none."""
    try:
        parsed = parse_client_hello(data)
    except ClientHelloError as e:
        return f"error:{e.reason}"
    if parsed is None:
        return "incomplete"
    return f"sni:{parsed.sni}"


def test_quick_sni_agrees_with_the_parser_on_crafted_and_mutated_hellos() -> None:
    cases = crafted()
    rng = random.Random(4)
    inputs = list(cases.values())
    for base in list(inputs):
        for _ in range(300):
            buf = bytearray(base)
            for _ in range(rng.randint(1, 3)):
                op = rng.randrange(4)
                i = rng.randrange(len(buf))
                if op == 0:
                    buf[i] = rng.randrange(256)
                elif op == 1:
                    del buf[i]
                elif op == 2:
                    buf.insert(i, rng.randrange(256))
                else:
                    buf[i] ^= 0x20  # case flips inside names
            inputs.append(bytes(buf))
    for data in inputs:
        fast = quick_sni(data)
        if fast is not None:
            assert verdict(data) == f"sni:{fast}", data.hex()
        fast = quick_sni(bytearray(data))
        if fast is not None:
            assert verdict(data) == f"sni:{fast}", data.hex()


# --- the same, through a real serve ----------------------------------------------------------


def tagger(tag: bytes):  # type: ignore[no-untyped-def]
    def handle(conn: socket.socket) -> None:
        conn.settimeout(WAIT)
        conn.sendall(tag)  # the edge connects only once it has chosen this route
        while conn.recv(1 << 16):  # read to EOF: closing with unread bytes would reset
            pass
    return handle


@pytest.fixture(scope="module")
def two_routes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    tmp = tmp_path_factory.mktemp("attacks4_pt")
    tls, admin = free_port(), free_port()
    backends = [Backend(tagger(b"A")), Backend(tagger(b"B")), Backend(echo)]
    text = f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls}"]
  admin: "127.0.0.1:{admin}"
limits:
  clienthello_timeout: 3s
tenants:
  - name: edge
    pins: ["sha256:{'A' * 43}"]
    routes:
      - {{host: {A_SNI}, mode: passthrough, backend: "127.0.0.1:{backends[0].port}"}}
      - {{host: {B_SNI}, mode: passthrough, backend: "127.0.0.1:{backends[1].port}"}}
      - {{host: {ECHO_SNI}, mode: passthrough, backend: "127.0.0.1:{backends[2].port}"}}
      - {{host: "xn--bcher-kva.attack.test", mode: passthrough,
          backend: "127.0.0.1:{backends[1].port}"}}
"""
    s = Served(tmp, text)
    try:
        s.wait_notify("READY=1")
        yield tls
    finally:
        s.stop()
        for b in backends:
            b.close()


def routed_to(port: int, data: bytes) -> str:
    """Which backend answered this connection ("A", "B"), or "none" (alert / close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # nothing more comes: an incomplete hello ends here
        got = b""
        while True:
            try:
                chunk = s.recv(64)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
    if got[:1] in (b"A", b"B"):
        return got[:1].decode()
    return "none"


def expected_backend(data: bytes) -> str:
    v = verdict(data)
    return {f"sni:{A_SNI}": "A", f"sni:{B_SNI}": "B",
            "sni:xn--bcher-kva.attack.test": "B"}.get(v, "none")


def test_serve_routes_every_crafted_hello_as_the_parser_does(two_routes: int) -> None:
    cases = crafted()
    seen = {}
    for name, data in cases.items():
        seen[name] = (routed_to(two_routes, data), expected_backend(data), verdict(data))
    wrong = {k: v for k, v in seen.items() if v[0] != v[1]}
    assert not wrong, wrong
    # the attack set is not vacuous: both routes and refusals are exercised
    assert {v[0] for v in seen.values()} == {"A", "B", "none"}


# --- the relay on two workers ----------------------------------------------------------------

from pact_ingress.identity import b64url_decode, keygen  # noqa: E402
from pact_ingress.proto.relay import MAX_ENVELOPE_BYTES  # noqa: E402
from tests.relay_env import (  # noqa: E402
    RELAY_HOST,
    RelayCaller,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
    tool_body,
)
from tests.terminate_env import RawResponse, read_response, request_bytes  # noqa: E402
from tests.test_relay_workers import HIGH_LIMITS, by_worker, drain_queue, queued  # noqa: E402


def answer_kind(result: dict[str, Any], msg_id: str) -> str:
    return "queued" if queued(result, msg_id) else str(code_of(result))


def test_relay_races_and_foreign_queues_on_two_workers(tmp_path: Path) -> None:
    ids = relay_identities(tmp_path)
    second = keygen(tmp_path / "second.key", common_name="second")  # another relay node
    stranger = keygen(tmp_path / "stranger.key", common_name="stranger")
    serve = RelayServe(tmp_path, recipients=[ids.recipient, second], workers=2,
                       extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        owner_b = RelayCaller(serve.port, second, source=groups[1][0])
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        assert owner_b.allowlist_set([ids.sender.fingerprint]).status == 200

        # 1. one msg_id raced through both workers at once, from several addresses each
        racers = [RelayCaller(serve.port, ids.sender, source=ip)
                  for ip in groups[0][:2] + groups[1][:2]]
        rounds = 25
        kinds: dict[str, list[str]] = {}
        sent: dict[str, dict[str, str]] = {}
        lock = threading.Lock()
        for r in range(rounds):
            msg_id = f"race-{r}"
            env = sent[msg_id] = envelope(ids.sender, ids.recipient, msg_id=msg_id)
            gate = threading.Barrier(len(racers))

            def go(caller: RelayCaller, msg_id: str = msg_id,
                   env: dict[str, str] = env, gate: threading.Barrier = gate) -> None:
                gate.wait(timeout=WAIT)
                result, _ = caller.tool("relay_call", env)
                with lock:
                    kinds.setdefault(msg_id, []).append(answer_kind(result, msg_id))

            threads = [threading.Thread(target=go, args=(c,)) for c in racers]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=WAIT)
        odd = {m: k for m, k in kinds.items() if k != ["queued"] * len(racers)}
        assert not odd, odd  # every racer got the same answer: queued (the duplicate's)
        status = serve.status()["relay"]
        assert sum(q["items"] for q in status["queues"]) == rounds  # stored once each

        # 2. the second node sees none of them, and cannot ack them away
        page = owner_b.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        assert page["items"] == []
        mine = owner.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        foreign_ids = [item["id"] for item in mine["items"]]
        assert len(foreign_ids) == rounds
        result = owner_b.tool("ack", {"ids": foreign_ids})[0]
        assert "structuredContent" in result or code_of(result), result
        assert sum(q["items"] for q in serve.status()["relay"]["queues"]) == rounds

        # 3. odd fetch limits: an error or a bounded page, never a 5xx, the queue unmoved
        for limit in (-1, 0, -(2 ** 63), 2 ** 64, 10 ** 30, 1.5, "5", None, True, [], {},
                      float("nan") if False else 1e308):
            result, resp = owner.tool("fetch_queued", {"limit": limit})
            assert resp.status < 500, (limit, resp.status)
            if not code_of(result):
                items = result["structuredContent"]["items"]
                assert len(items) <= rounds
        assert sum(q["items"] for q in serve.status()["relay"]["queues"]) == rounds
        got = {json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"]: i["envelope"]
               for i in owner.tool("fetch_queued", {"limit": 1000})[0]
               ["structuredContent"]["items"]}
        assert got == sent

        # 4. an unknown recipient and an unlisted sender: the same refusal, on both workers
        for ip in (groups[0][0], groups[1][0]):
            caller = RelayCaller(serve.port, ids.sender, source=ip)
            unknown = caller.tool("relay_call", envelope(ids.sender, stranger,
                                                          msg_id=f"u-{ip}"))[0]
            unlisted = RelayCaller(serve.port, ids.other, source=ip).tool(
                "relay_call", envelope(ids.other, ids.recipient, msg_id=f"n-{ip}"))[0]
            assert code_of(unknown) == code_of(unlisted) == "permission_denied"
            assert unknown == unlisted or (
                json.dumps(unknown).replace(f"u-{ip}", "X")
                == json.dumps(unlisted).replace(f"n-{ip}", "X")), (unknown, unlisted)

            # 5. an oversized envelope is refused through either worker, never queued
            big = envelope(ids.sender, ids.recipient, msg_id=f"big-{ip}",
                           text="x" * (MAX_ENVELOPE_BYTES + 4096))
            try:
                result, resp = caller.tool("relay_call", big)
            except (OSError, ValueError):
                pass  # the connection refused outright is a refusal too
            else:
                assert not queued(result, f"big-{ip}"), (resp.status, result)
                assert code_of(result) == "too_large" or resp.status == 413, result
            caller.close()
        assert set(drain_queue(owner)) == set(sent)
        assert drain_queue(owner_b) == {}
    finally:
        serve.stop()


def test_a_stopped_worker_never_queues_for_a_sender_removed_meanwhile(tmp_path: Path) -> None:
    """SIGSTOP a worker for longer than main waits for it to take an allow-list change:
    the change is answered anyway (the documented bound), and a call from the removed
    sender that the stopped worker reads afterwards must not be answered `queued`."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        pids = {w["index"]: w["pid"] for w in serve.status()["workers"]}
        outcomes = []
        for trial in range(3):
            assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
            sender = RelayCaller(serve.port, ids.sender, source=groups[1][0])
            warm = f"warm-{trial}"
            assert queued(sender.tool("relay_call", envelope(
                ids.sender, ids.recipient, msg_id=warm))[0], warm)
            os.kill(pids[1], signal.SIGSTOP)
            try:
                assert owner.allowlist_set([ids.other.fingerprint]).status == 200
                msg_id = f"after-{trial}"
                assert sender.sock is not None
                sender.sock.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, body=(
                    tool_body("relay_call", envelope(ids.sender, ids.recipient,
                                                     msg_id=msg_id)))))
            finally:
                os.kill(pids[1], signal.SIGCONT)
            result = json.loads(read_response(sender.sock).body)["result"]
            outcomes.append(answer_kind(result, msg_id))
            sender.close()
        assert set(outcomes) <= {"permission_denied", "unavailable"}, outcomes
        found = drain_queue(owner)
        assert set(found) == {f"warm-{t}" for t in range(3)}, sorted(found)
    finally:
        serve.stop()


def test_a_worker_never_answers_queued_once_main_is_gone(tmp_path: Path) -> None:
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        callers = [RelayCaller(serve.port, ids.sender, source=groups[w][0]) for w in (0, 1)]
        for w, caller in enumerate(callers):
            assert queued(caller.tool("relay_call", envelope(
                ids.sender, ids.recipient, msg_id=f"pre-{w}"))[0], f"pre-{w}")
        workers = [w["pid"] for w in serve.status()["workers"]]
        serve.kill9()  # main only: its workers may outlive it for a moment
        answers = []
        for w, caller in enumerate(callers):
            for i in range(3):
                msg_id = f"post-{w}-{i}"
                try:
                    result, _ = caller.tool("relay_call", envelope(
                        ids.sender, ids.recipient, msg_id=msg_id))
                except (OSError, ValueError):
                    answers.append("connection_lost")
                    continue
                answers.append(answer_kind(result, msg_id))
        assert "queued" not in answers, answers
        for pid in workers:  # the orphans end by themselves
            deadline = time.monotonic() + WAIT
            while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().split(") ")[-1].startswith("Z"):
                        break
                time.sleep(0.1)
            else:
                if os.path.exists(f"/proc/{pid}"):
                    os.kill(pid, signal.SIGKILL)
                    raise AssertionError(f"worker {pid} outlived main by {WAIT} s")
    finally:
        serve.stop()


# --- terminate: pooled node connections the node closes or talks on ----------------------

import h11  # noqa: E402

from tests.terminate_env import (  # noqa: E402
    OPT_HOST,
    NodeRequest,
    RecordingNode,
    Serve,
    make_identities,
    tls_socket,
)

UNSOLICITED_408 = b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"


class FlakyNode(RecordingNode):
    """Answers each request with its own target (so a desync shows), then, by `mode`:
    "close_after_answer" closes right after every answer (no `Connection: close`);
    "read_then_close" reads a connection's second request whole and closes unanswered;
    "unsolicited_408" writes a 408 on the idle connection shortly after each answer;
    "half_close" answers, then shuts its write side and keeps reading."""

    def __init__(self, identity: Any, *, client_ca: Any, mode: str) -> None:
        self.mode = mode
        self._local = threading.local()  # a thread per connection: its request count
        super().__init__(identity, client_ca=client_ca)

    def _one_exchange(self, tls: Any, conn: h11.Connection, peer: str | None) -> bool:
        event = self._next_event(tls, conn)
        if not isinstance(event, h11.Request):
            return False
        rec = NodeRequest(event.method.decode(), event.target.decode("latin-1"),
                          [(k.decode().lower(), v.decode("latin-1"))
                           for k, v in event.headers], peer)
        body = bytearray()
        while True:
            ev = self._next_event(tls, conn)
            if isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                return False
        rec.body, rec.complete = bytes(body), True
        with self._lock:
            self._requests.append(rec)
        n = self._local.count = getattr(self._local, "count", 0) + 1
        if self.mode == "read_then_close" and n > 1:
            return False  # processed (recorded), never answered
        payload = json.dumps({"target": rec.target, "body": rec.body.decode()}).encode()
        self._send(tls, conn, h11.Response(status_code=200, headers=[
            ("content-type", "application/json"), ("content-length", str(len(payload)))]))
        self._send(tls, conn, h11.Data(data=payload))
        self._send(tls, conn, h11.EndOfMessage())
        if self.mode == "close_after_answer":
            return False
        if self.mode == "unsolicited_408":
            time.sleep(0.05)
            tls.sendall(UNSOLICITED_408)
            return False
        if self.mode == "half_close":
            tls.shutdown(socket.SHUT_WR)
            while tls.recv(65536):
                pass
            return False
        return True


def client_exchange(port: int, method: str, target: str, body: bytes = b"") -> RawResponse:
    sock = tls_socket(port, OPT_HOST)
    try:
        # a form body, not JSON: outside the MCP endpoint only JSON is refused
        sock.sendall(request_bytes(method, target, OPT_HOST, body=body,
                                   content_type="application/x-www-form-urlencoded"))
        return read_response(sock)
    finally:
        sock.close()


@pytest.mark.parametrize("mode", ["close_after_answer", "read_then_close", "unsolicited_408",
                                  "half_close"])
def test_pooled_node_connections_never_duplicate_posts_nor_desync(
        tmp_path: Path, mode: str) -> None:
    ids = make_identities(tmp_path)
    node = FlakyNode(ids.node, client_ca=ids.ingress, mode=mode)
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=1)
    try:
        answers: list[tuple[str, int, bytes]] = []
        lock = threading.Lock()

        def client(c: int) -> None:
            for i in range(8):
                for method in ("GET", "POST"):
                    tag = f"/x?c={c}&i={i}&m={method}"
                    body = tag.encode() if method == "POST" else b""
                    try:
                        resp = client_exchange(serve.port, method, tag, body)
                    except (OSError, ValueError):
                        continue
                    with lock:
                        answers.append((tag, resp.status, resp.body))

        threads = [threading.Thread(target=client, args=(c,)) for c in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert answers
        # no answer is another request's: a 200 carries the caller's own target
        for tag, status, body in answers:
            if status == 200:
                assert json.loads(body)["target"] == tag, (tag, body[:200])
        # a POST reaches the node at most once
        seen: dict[str, int] = {}
        for rec in node.requests():
            if rec.method == "POST":
                seen[rec.target] = seen.get(rec.target, 0) + 1
        twice = {k: v for k, v in seen.items() if v > 1}
        assert not twice, (mode, twice)
        # a GET (replayable) always gets its own answer: a node's idle close or idle 408 is
        # retried once on a fresh connection; a POST may fail (502, or a 408 that raced
        # its send) but is never sent twice
        gets = {s for t, s, _ in answers if t.endswith("m=GET")}
        assert gets == {200}, (mode, gets)
        posts = {s for t, s, _ in answers if t.endswith("m=POST")}
        assert posts <= {200, 408, 502}, (mode, posts)
        assert len(answers) == 4 * 8 * 2  # every client exchange was answered
        # the access log has one line per client exchange, with the status it got
        want = sorted(s for _, s, _ in answers)

        def logged() -> list[int]:
            return sorted(e["status"] for e in serve.log_events()
                          if e.get("event") == "request" and e.get("route") == OPT_HOST)

        deadline = time.monotonic() + WAIT
        while logged() != want and time.monotonic() < deadline:
            time.sleep(0.1)
        assert logged() == want, mode
    finally:
        serve.stop()
        node.stop()


class IdleTimeoutNode(FlakyNode):
    """Answers, then writes an unsolicited 408 on the idle connection and closes it
    (what servers with a short keep-alive timeout do); `said_408` is set after it."""

    def __init__(self, identity: Any, *, client_ca: Any) -> None:
        self.said_408 = threading.Event()
        super().__init__(identity, client_ca=client_ca, mode="plain")

    def _one_exchange(self, tls: Any, conn: h11.Connection, peer: str | None) -> bool:
        if not super()._one_exchange(tls, conn, peer):
            return False
        tls.sendall(UNSOLICITED_408)
        self.said_408.set()
        return False


def test_a_408_the_node_wrote_on_an_idle_pooled_connection_answers_no_request(
        tmp_path: Path) -> None:
    ids = make_identities(tmp_path)
    node = IdleTimeoutNode(ids.node, client_ca=ids.ingress)
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=1)
    try:
        sock = tls_socket(serve.port, OPT_HOST)
        for i in range(6):
            node.said_408.clear()
            sock.sendall(request_bytes("GET", f"/x?i={i}", OPT_HOST))
            resp = read_response(sock)
            # the first GET goes out on a fresh connection; each later one is sent while
            # the previous connection, still pooled, holds the node's 408
            assert resp.status == 200, (i, resp.status, resp.body[:100])
            assert json.loads(resp.body)["target"] == f"/x?i={i}"
            assert node.said_408.wait(WAIT)
            time.sleep(0.05)  # the 408 crosses loopback into the edge's socket buffer
        sock.close()
        gets = [r.target for r in node.requests() if r.method == "GET"]
        assert gets == [f"/x?i={i}" for i in range(6)]  # each once, in order
    finally:
        serve.stop()
        node.stop()


def echo_conn(port: int, *, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.settimeout(WAIT)
    s.connect(("127.0.0.1", port))
    first = hello([sni_ext(ECHO_SNI.encode())])
    s.sendall(first)
    assert recv_exact(s, len(first)) == first
    return s


def test_short_relay_keeps_every_byte_in_order_at_the_probe_boundaries(two_routes: int) -> None:
    rng = random.Random(16)
    sizes = [1, 16383, 16384, 16385, 32767, 32768, 32769, 65536, 3 * 16384 + 1]
    with echo_conn(two_routes) as s:  # ping-pong, every size around the copy probe
        for size in sizes * 2:
            msg = rng.randbytes(size)
            s.sendall(msg)
            assert hashlib.sha256(recv_exact(s, size)).digest() == hashlib.sha256(msg).digest()
    for size in sizes:  # the message, then at once the half-close: both arrive
        with echo_conn(two_routes) as s:
            msg = rng.randbytes(size)
            s.sendall(msg)
            s.shutdown(socket.SHUT_WR)
            got = bytearray()
            while chunk := s.recv(1 << 16):
                got += chunk
            assert bytes(got) == msg, (size, len(got))
    # a slow reader with a small window while 4 MiB of mixed-size writes go through
    with echo_conn(two_routes, rcvbuf=4096) as s:
        parts = [rng.randbytes(rng.choice(sizes)) for _ in range(60)]
        want = hashlib.sha256(b"".join(parts)).hexdigest()
        total = sum(map(len, parts))

        def writer() -> None:
            for part in parts:
                s.sendall(part)

        t = threading.Thread(target=writer)
        t.start()
        got_hash, got = hashlib.sha256(), 0
        while got < total:
            chunk = s.recv(min(4096, total - got))
            assert chunk, f"EOF after {got} of {total} bytes"
            got_hash.update(chunk)
            got += len(chunk)
            if got % 64 == 0:
                time.sleep(0.001)
        t.join(timeout=WAIT)
        assert got_hash.hexdigest() == want
    # a client reset in the middle of a message leaves the edge serving the next one
    for _ in range(20):
        s = echo_conn(two_routes)
        s.sendall(rng.randbytes(rng.choice(sizes)))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()
    with echo_conn(two_routes) as s:
        msg = rng.randbytes(16384)
        s.sendall(msg)
        assert recv_exact(s, len(msg)) == msg


def test_allowlist_toggles_race_relay_calls_through_the_other_worker(tmp_path: Path) -> None:
    """The owner toggles its list through worker 0 while senders call through worker 1:
    a call sent and answered wholly inside one settled state (the change answered before
    the send, the next change begun after the answer) is judged by that state."""
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[0][0])
        assert owner.allowlist_set([ids.other.fingerprint]).status == 200
        lock = threading.Lock()
        state = {"epoch": 0, "allowed": False, "settled": True}
        stop = threading.Event()
        verdicts: list[tuple[bool, str]] = []

        def toggler() -> None:
            for n in range(30):
                allowed = n % 2 == 0
                with lock:
                    state["settled"] = False
                    state["epoch"] += 1
                senders = [ids.sender.fingerprint] if allowed else [ids.other.fingerprint]
                assert owner.allowlist_set(senders).status == 200
                with lock:
                    state["allowed"], state["settled"] = allowed, True
                    state["epoch"] += 1
                    judged = sum(1 for v in verdicts if v[0] is allowed)
                # stay in the settled state until a call was judged in it (a busy
                # machine's calls take longer than a short fixed stay), 1 s at most
                time.sleep(0.02)
                until = time.monotonic() + 1.0
                while time.monotonic() < until:
                    with lock:
                        if sum(1 for v in verdicts if v[0] is allowed) > judged:
                            break
                    time.sleep(0.01)
            stop.set()

        def sender(k: int, ip: str) -> None:
            caller = RelayCaller(serve.port, ids.sender, source=ip)
            for i in range(10_000):
                if stop.is_set():
                    return
                with lock:
                    before = dict(state)
                msg_id = f"t{k}-{i}"
                result, _ = caller.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                               msg_id=msg_id))
                with lock:
                    after = dict(state)
                if before["settled"] and before == after:
                    with lock:
                        verdicts.append((bool(before["allowed"]), answer_kind(result, msg_id)))

        threads = [threading.Thread(target=toggler)] + [
            threading.Thread(target=sender, args=(k, ip)) for k, ip in enumerate(groups[1][:3])]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert verdicts
        wrong = [v for v in verdicts if v != (True, "queued") and v != (False, "permission_denied")]
        assert not wrong, wrong[:5]
        assert {v[0] for v in verdicts} == {True, False}  # both states were exercised
    finally:
        serve.stop()


def test_odd_ack_ids_and_allowlist_bodies_through_a_worker_break_nothing(
        tmp_path: Path) -> None:
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
    try:
        groups = by_worker()
        owner = RelayCaller(serve.port, ids.recipient, source=groups[1][0])
        assert owner.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender, source=groups[1][1])
        assert queued(sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                          msg_id="keep"))[0], "keep")
        workers = [(w["pid"], w["restarts"]) for w in serve.status()["workers"]]
        for bad in (["abc"], [2 ** 70], [-(2 ** 70)], [1.5], [None], "x", [True], [1e308],
                    ["1"], list(range(5000)), {"a": 1}, [[1]], [0], [-1]):
            result, resp = owner.tool("ack", {"ids": bad})
            assert resp.status == 200, (bad, resp.status)
            assert code_of(result) or result["structuredContent"]["acked"] == 0, (bad, result)
        for body in ({"senders": [1]}, {"senders": "x"}, {"senders": None}, [],
                     {"senders": ["x" * 100_000]}, {"senders": ["\ud800"]},
                     {"senders": ["sha256:" + "A" * 43] * 20_000}):
            data = json.dumps(body).encode()
            try:
                resp = owner.request("POST", "/relay/allowlist", data)
            except (ssl.SSLError, OSError):
                # a body far over the cap: the edge answers 413 early and stops reading
                # after 256 KiB, so a client still writing may see the close instead
                assert len(data) > 256 * 1024, str(body)[:60]
                owner.close()
                continue
            assert resp.status in (400, 413), (str(body)[:60], resp.status)
        assert json.loads(owner.allowlist_get().body)["senders"] == [ids.sender.fingerprint]
        # neither worker was restarted, and the item is still there, once
        assert [(w["pid"], w["restarts"]) for w in serve.status()["workers"]] == workers
        assert set(drain_queue(owner)) == {"keep"}
    finally:
        serve.stop()
