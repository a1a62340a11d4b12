"""The relay with its default SQLite store under inputs and timings the other relay
attack files do not try: msg_id idempotency across the retention cap, ack and fetch
arguments at their edges, allow-lists at their edges, with one process and with two
workers."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import trio

from tests.relay_env import (
    RELAY_HOST,
    RelayCaller,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
    tool_body,
)
from tests.test_relay_attacks import clean_log, depth
from tests.test_relay_workers import HIGH_LIMITS, queued

DAY = 86400


async def _in_process(tmp_path: Path, ids: Any, clock: list[float], body: Any) -> None:
    """Run `body(port)` in a thread against an in-process ingress whose relay clock is
    `clock[0]`, so retention can be crossed without waiting."""
    from pact_ingress.app import Ingress
    from pact_ingress.config import load_config
    from tests.terminate_env import free_port

    port = free_port()
    (tmp_path / "ingress.yaml").write_text(f"""\
identity: {{key: ingress.key}}
state_dir: state
listen: {{tls: ["127.0.0.1:{port}"]}}
relay: {{host: {RELAY_HOST}, cert: {{cert: relay.crt, key: relay.key}}}}
tenants:
  - {{name: home, pins: ["{ids.recipient.fingerprint}"], relay: true}}
""")
    ingress = Ingress(load_config(tmp_path / "ingress.yaml"))
    ingress.relay.clock = lambda: clock[0]
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: ingress.run(handle_signals=False,
                                                           task_status=task_status))
        try:
            await trio.to_thread.run_sync(body, port, ingress)
        finally:
            await ingress.stop(deadline=1)


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

    await _in_process(tmp_path, ids, clock, body)
