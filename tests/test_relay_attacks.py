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
import os
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from pact_ingress.envelope import canonical_envelope
from pact_ingress.identity import b64url_decode, keygen
from tests.relay_env import (
    RelayCaller,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
    rpc,
    tool_body,
)
from tests.terminate_env import WAIT
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
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def depth(serve: RelayServe) -> tuple[int, int]:
    queues = serve.status()["relay"]["queues"]
    return sum(q["items"] for q in queues), sum(q["bytes"] for q in queues)


def msg_ids(page: dict[str, Any]) -> list[str]:
    return [json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"]
            for i in page["items"]]


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
            ((ping % "1e999").encode(), 400, -32600),  # a float that is no number
            ((ping % ("9" * 5000)).encode(), 400, -32700),  # past int parsing's bound
            ((ping % "[1]").encode(), 400, -32600),  # ids are strings, numbers or null
            ((ping % '{"a":1}').encode(), 400, -32600),
            ((ping % "true").encode(), 400, -32600),
            ((ping % deep(900)).encode(), 400, -32600),
            ((ping % deep(980)).encode() + pad, 400, None),  # -32700 or -32600
            ((ping % deep(2000)).encode() + pad, 400, -32700),
            (('{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":%s}}'
              % deep(980)).encode() + pad, 200, -32602),
            (('{"jsonrpc":"2.0","method":"tools/call","id":1,"params":{"name":"relay_call",'
              '"arguments":{"protected":NaN,"enc":"","ct":"","sig":""}}}').encode(), 400,
             -32700),
            ((ping % "1").encode("utf-16"), 400, -32700),  # JSON on the wire is UTF-8
            ((ping % "1").encode("utf-32"), 400, -32700),
            ((ping % '"\xff"').encode("latin-1"), 400, -32700),
            (b"\xef\xbb\xbf" + (ping % "1").encode(), 200, None),  # a BOM may be ignored
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
        # duplicate members: one reading (the last), answered once
        doc = strict_json(sender.request(
            "POST", "/relay/mcp", b'{"jsonrpc":"2.0","method":"ping","id":1,"id":2}').body)
        assert doc == {"jsonrpc": "2.0", "id": 2, "result": {}}
        # nothing of the batches was queued; the connection still serves
        page = owner.tool("fetch_queued", {})[0]["structuredContent"]
        assert page == {"items": [], "more": False}
        assert sender.rpc(rpc("ping", rpc_id="after"))[0] == {
            "jsonrpc": "2.0", "id": "after", "result": {}}
        clean_log(serve)
    finally:
        serve.stop()


# --- the store file: modes, kill -9 after queued and after ack --------------------------


def test_store_files_are_private_and_kill9_keeps_queued_and_acked(tmp_path: Path) -> None:
    """The store (and SQLite's -wal / -shm beside it, which hold the same envelopes) is
    readable by its owner only, also when it sits in a directory others can read; a
    kill -9 of serve (main and both workers) right after a `queued` answer keeps the
    item, right after an `ack` answer keeps it acked (never handed out again, and its
    msg_id still answered as the duplicate)."""
    ids = relay_identities(tmp_path)
    public = tmp_path / "public"
    public.mkdir(mode=0o755)
    public.chmod(0o755)
    store = public / "relay.sqlite"

    class Serve(RelayServe):
        def render(self) -> str:
            return super().render().replace("  cert:", f"  store: {store}\n  cert:", 1)

    serve = Serve(tmp_path, recipients=[ids.recipient], workers=2, extra=HIGH_LIMITS)
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
            serve.kill9()  # right after the queued answers, main and workers at once
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
