"""Relay fetch in isolation: serve CPU and wall time per `fetch_queued` page.

Queues 1,000 items (200-byte bodies), then `--rounds` times: one `fetch_queued` of all
1,000 (nothing acked, so every round reads the same page), and, on a second recipient
queue of the same 1,000, pages of 100 each acked (re-queued between rounds). Reports
the mean serve CPU (main and workers, from /proc: 10 ms ticks, so summed over rounds)
and the median client wall time per 1,000 items. Loopback only; every loop is bounded.

    python -m tests.bench.bench_relay_fetch [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    from tests.bench.harness import cpu_seconds
    from tests.relay_env import RelayCaller, RelayServe, envelope, relay_identities

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        ids = relay_identities(tmp)
        serve = RelayServe(tmp, recipients=[ids.recipient], max_items=100_000,
                           extra="limits: {calls_per_hour_per_ip: 1000000000, "
                                 "calls_per_hour_per_ip_key: 1000000000}\n")
        try:
            assert serve.proc is not None
            pid = serve.proc.pid
            recipient = RelayCaller(serve.port, ids.recipient)
            recipient.allowlist_set([ids.sender.fingerprint])
            sender = RelayCaller(serve.port, ids.sender)
            sealed = [envelope(ids.sender, ids.recipient, msg_id=f"f-{i}", text="x" * 200)
                      for i in range(1000)]
            for env in sealed:
                sender.tool("relay_call", env)
            one: list[tuple[float, float]] = []
            for _ in range(args.rounds):
                c0, t0 = cpu_seconds(pid), time.perf_counter()
                page = recipient.tool("fetch_queued", {"limit": 1000})[0]
                t1, c1 = time.perf_counter(), cpu_seconds(pid)
                assert len(page["structuredContent"]["items"]) == 1000
                one.append((c1 - c0, t1 - t0))
            paged: list[tuple[float, float]] = []
            for r in range(args.rounds):
                if r:  # the previous round acked them: queue 1,000 new ones
                    for i, env in enumerate(sealed):
                        sender.tool("relay_call", envelope(
                            ids.sender, ids.recipient, msg_id=f"p{r}-{i}", text="x" * 200))
                c0, t0 = cpu_seconds(pid), time.perf_counter()
                got = 0
                for _ in range(20):
                    body = recipient.tool("fetch_queued", {"limit": 100})[0]
                    items = body["structuredContent"]["items"]
                    got += len(items)
                    recipient.tool("ack", {"ids": [i["id"] for i in items]})
                    if not body["structuredContent"]["more"]:
                        break
                t1, c1 = time.perf_counter(), cpu_seconds(pid)
                assert got == 1000, got
                paged.append((c1 - c0, t1 - t0))
        finally:
            serve.stop()
    for name, rows in (("one page of 1,000", one), ("pages of 100 + ack", paged)):
        cpu = sum(c for c, _ in rows) / len(rows) * 1000  # /proc ticks: sum, then divide
        wall = statistics.median(w for _, w in rows)
        print(f"| {name} | {cpu:.1f} ms serve CPU per 1,000 items | "
              f"{1000 / wall:.0f} items/s (wall, median of {len(rows)}) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
