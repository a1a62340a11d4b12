"""Durability: `kill -9` of a serve that is taking concurrent relay_calls loses no call that
was answered "queued", and leaves nothing half-written.

Senders on their own threads and connections fire relay_calls as fast as the relay
answers; each records the msg_ids whose success answer it read in full. SIGKILL lands in
the middle of that stream. After a restart the recipient drains its queue: every
answered msg_id must be there, every item must be byte-for-byte an envelope that was
sent (calls cut off before their answer may or may not have made it), and SQLite's own
integrity check must pass.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from tests.relay_env import RelayCaller, RelayServe, envelope, relay_identities

SENDERS = 16
#: Answered calls to see before the kill (so it lands mid-stream, not at the start).
BEFORE_KILL = 300


@pytest.mark.parametrize("workers", [1, 2], ids=["one-process", "two-workers"])
def test_kill9_loses_no_acknowledged_call(tmp_path: Path, workers: int) -> None:
    """`workers`: the calls are served in main, or in two workers that send main their
    enqueues packed (main answers each from its store's COMMIT)."""
    ids = relay_identities(tmp_path)
    # one sender key from one address: budgets far above the load, so every call is
    # answered by the store (queued) and none by the limiter
    serve = RelayServe(tmp_path, recipients=[ids.recipient], workers=workers, extra=(
        "limits: {calls_per_hour_per_ip_key: 1000000, calls_per_hour_per_ip: 1000000}\n"))
    try:
        recipient = RelayCaller(serve.port, ids.recipient)
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        recipient.close()
        sent: dict[str, dict[str, str]] = {}
        answered: set[str] = set()
        lock = threading.Lock()
        stop = threading.Event()

        def sender(n: int) -> None:
            # from 127.0.0.2-9: with workers, both of them take calls
            caller = RelayCaller(serve.port, ids.sender, source=f"127.0.0.{2 + n % 8}")
            i = 0
            while not stop.is_set():
                msg_id = f"s{n}-{i}"
                env = envelope(ids.sender, ids.recipient, msg_id=msg_id, text=f"body {msg_id}")
                with lock:
                    sent[msg_id] = env
                try:
                    result, _ = caller.tool("relay_call", env)
                except (OSError, ValueError):
                    return  # the process is gone
                if result.get("structuredContent") == {"status": "queued", "msg_id": msg_id}:
                    with lock:
                        answered.add(msg_id)
                i += 1

        threads = [threading.Thread(target=sender, args=(n,)) for n in range(SENDERS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while len(answered) < BEFORE_KILL and time.monotonic() < deadline:
            time.sleep(0.01)
        serve.kill9()  # mid-stream: the senders are still firing
        stop.set()
        for t in threads:
            t.join(timeout=30)
        with lock:
            acknowledged = set(answered)
        assert len(acknowledged) >= BEFORE_KILL

        store = tmp_path / "state" / "relay.sqlite"
        conn = sqlite3.connect(store)  # recovery of the WAL happens here, as on restart
        try:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        finally:
            conn.close()

        serve.restart()
        recipient = RelayCaller(serve.port, ids.recipient)
        found: dict[str, dict[str, str]] = {}
        for _ in range(1000):
            page = recipient.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
            for item in page["items"]:
                header = json.loads(_b64(item["envelope"]["protected"]))
                found[header["msg_id"]] = item["envelope"]
            recipient.tool("ack", {"ids": [item["id"] for item in page["items"]]})
            if not page["more"]:
                break
        missing = acknowledged - set(found)
        assert not missing, f"{len(missing)} acknowledged calls lost, e.g. {sorted(missing)[:5]}"
        for msg_id, env in found.items():
            assert env == sent[msg_id], f"{msg_id} came back different from what was sent"
        print(f"answered {len(acknowledged)}, stored {len(found)} "
              f"(+{len(found) - len(acknowledged)} cut off before their answer)")
    finally:
        serve.stop()


def _b64(text: str) -> bytes:
    from pact_ingress.identity import b64url_decode

    return b64url_decode(text)
