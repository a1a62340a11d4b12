"""Relay benchmark: durable relay_call rate with 64 concurrent senders (against the same
serve's plain terminate request rate, measured in the same run), fetch of 1,000 queued
items, and wake latency from enqueue to a connector's on_mail hook.

    python -m tests.bench.bench_relay            # about a minute
    python -m tests.bench.bench_relay --quick    # smoke run
    python -m tests.bench.bench_relay --sources 8   # senders from 8 client addresses

One `pact-ingress serve` (real process) carries a relay host and a terminate route to a
recording home node (`tests.terminate_env.RecordingNode`, HTTP/1.1). Load comes from
`PROCS` processes with `SENDERS / PROCS` threads each, every thread on its own keep-alive
HTTP/1.1 TLS connection with its own client certificate presented; envelopes are sealed
before the clock starts. Both rates are measured with this same generator, so their ratio
is fair even where the generator, not the ingress, is the limit. The markdown table goes
to stdout.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.relay_env import (
    RelayCaller,
    RelayServe,
    envelope,
    relay_identities,
    tool_body,
)
from tests.relay_env import client_context as relay_client_context
from tests.terminate_env import RecordingNode, read_response, request_bytes, rpc

SENDERS = 64
PROCS = 2
TERM_HOST = "term.test"


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def _worker(kind: str, port: int, key: tuple[str, str] | None, bodies: list[bytes], host: str,
            path: str, threads: int, seconds: float, out: Any, proc: int = 0,
            sources: int = 1) -> None:
    """One load process: `threads` keep-alive connections sending `bodies` round robin."""
    import socket

    latencies: list[float] = []
    errors = [0]
    lock = threading.Lock()
    start_at = time.monotonic() + 0.5
    stop_at = start_at + seconds

    def run(n: int) -> None:
        ctx = relay_client_context(None)
        if key is not None:
            ctx.load_cert_chain(*key)
        # `sources` > 1: the connections come from 127.0.0.2… so that the client buckets,
        # and with them the worker processes, differ (one address: one worker)
        conn_no = proc * threads + n
        source = None if sources <= 1 else (f"127.0.0.{2 + conn_no % sources}", 0)
        raw = socket.create_connection(("127.0.0.1", port), timeout=30,
                                       source_address=source)
        sock = ctx.wrap_socket(raw, server_hostname=host)
        mine: list[float] = []
        i = n
        time.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < stop_at:
            body = bodies[i % len(bodies)]
            i += threads * PROCS
            t0 = time.perf_counter()
            sock.sendall(request_bytes("POST", path, host, body=body))
            resp = read_response(sock)
            mine.append(time.perf_counter() - t0)
            if resp.status != 200 or b'"isError": true' in resp.body:
                errors[0] += 1
        sock.close()
        with lock:
            latencies.extend(mine)

    ts = [threading.Thread(target=run, args=(n,)) for n in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    out.put({"kind": kind, "latencies": latencies, "errors": errors[0]})


def load(kind: str, port: int, key: tuple[str, str] | None, bodies: list[bytes], host: str,
         path: str, seconds: float, pid: int | None = None, sources: int = 1
         ) -> dict[str, float]:
    """One rate phase; with `pid`, also that process's CPU (all threads) per request."""
    from tests.bench.harness import cpu_seconds

    ctx = multiprocessing.get_context("fork")
    cpu0 = cpu_seconds(pid) if pid is not None else 0.0
    q = ctx.Queue()
    per = [bodies[p::PROCS] for p in range(PROCS)]
    procs = [ctx.Process(target=_worker, args=(kind, port, key, per[p], host, path,
                                               SENDERS // PROCS, seconds, q, p, sources))
             for p in range(PROCS)]
    for p in procs:
        p.start()
    results = [q.get(timeout=seconds + 120) for _ in procs]
    cpu = cpu_seconds(pid) - cpu0 if pid is not None else float("nan")
    for p in procs:
        p.join()
    lat = [x for r in results for x in r["latencies"]]
    return {"rate": len(lat) / seconds, "p50_ms": _pct(lat, 50) * 1000,
            "p99_ms": _pct(lat, 99) * 1000, "calls": len(lat),
            "errors": sum(r["errors"] for r in results),
            # the workers' connect and close fall inside the CPU window: a slight overcount
            "cpu_us_per_call": cpu / max(1, len(lat)) * 1e6}


def _commits(serve: RelayServe) -> tuple[float, float]:
    """(COMMITs so far, seconds they took) from the serve's metrics."""
    count = total = 0.0
    for line in serve.metrics().splitlines():
        if line.startswith("pact_ingress_relay_commit_seconds_count"):
            count = float(line.split()[-1])
        elif line.startswith("pact_ingress_relay_commit_seconds_sum"):
            total = float(line.split()[-1])
    return count, total


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--sources", type=int, default=1,
                        help="client addresses 127.0.0.2… the senders are spread over "
                             "(both phases; default 1: every sender from 127.0.0.1)")
    args = parser.parse_args()
    seconds = 3.0 if args.quick else 10.0
    wakes = 5 if args.quick else 20
    tmp = Path(tempfile.mkdtemp(prefix="bench-relay-"))
    ids = relay_identities(tmp)
    from pact_ingress.identity import keygen

    node_id = keygen(tmp / "node.key", common_name="node")
    node = RecordingNode(node_id, client_ca=ids.ingress)
    extra = f"""\
  - name: term
    pins: ["{node_id.fingerprint}"]
    routes:
      - host: {TERM_HOST}
        mode: terminate
        backend: "127.0.0.1:{node.port}"
        seal: optional
        cert: {{cert: certs/term.crt, key: certs/term.key}}
limits:                     # budgets far above the load: the rate is what is measured
  calls_per_hour_per_ip: 1000000000
  calls_per_hour_per_ip_key: 1000000000
  max_connections_per_ip: 4000
"""
    serve = RelayServe(tmp, recipients=[ids.recipient], max_items=10_000_000,
                       max_bytes="10GiB", tunnel=True, extra=extra)
    result: dict[str, Any] = {"sources": args.sources}
    try:
        recipient = RelayCaller(serve.port, ids.recipient)
        recipient.allowlist_set([ids.sender.fingerprint])
        print("sealing envelopes…", file=sys.stderr)
        n_env = int(seconds * 3000)
        bodies = [tool_body("relay_call", envelope(ids.sender, ids.recipient,
                                                   msg_id=f"b-{i}", text="x" * 200))
                  for i in range(n_env)]
        term_bodies = [rpc("tools/list", {}, i) for i in range(1000)]
        print("terminate rate…", file=sys.stderr)
        pid = serve.proc.pid if serve.proc is not None else None
        result["terminate"] = load("terminate", serve.port, None, term_bodies, TERM_HOST,
                                   "/mcp", seconds, pid, args.sources)
        print("relay_call rate…", file=sys.stderr)
        sender_files = (str(ids.sender.cert_path), str(ids.sender.key_path))
        commits0 = _commits(serve)
        result["relay_call"] = load("relay_call", serve.port, sender_files,
                                    bodies, "relay.test", "/relay/mcp", seconds, pid,
                                    args.sources)
        commits1 = _commits(serve)
        n_commits = max(1.0, commits1[0] - commits0[0])
        result["relay_call"]["commits"] = n_commits
        result["relay_call"]["commit_ms"] = (commits1[1] - commits0[1]) / n_commits * 1000
        result["relay_call"]["calls_per_commit"] = result["relay_call"]["calls"] / n_commits
        if result["relay_call"]["calls"] >= n_env:
            print("warning: ran out of distinct envelopes; later calls were duplicates",
                  file=sys.stderr)
        # drain what the rate phase queued, then queue exactly 1,000 and fetch them
        print("fetch…", file=sys.stderr)
        from tests.relay_env import RelayCaller as Caller

        while True:
            page = recipient.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
            if not page["items"]:
                break
            recipient.tool("ack", {"ids": [i["id"] for i in page["items"]]})
        sender = Caller(serve.port, ids.sender)
        for i in range(1000):
            sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id=f"f-{i}",
                                               text="x" * 200))
        t0 = time.perf_counter()
        page = recipient.tool("fetch_queued", {"limit": 1000})[0]["structuredContent"]
        one_page = time.perf_counter() - t0
        assert len(page["items"]) == 1000, len(page["items"])
        t0 = time.perf_counter()
        got = 0
        while True:
            page = recipient.tool("fetch_queued", {"limit": 100})[0]["structuredContent"]
            got += len(page["items"])
            recipient.tool("ack", {"ids": [i["id"] for i in page["items"]]})
            if not page["more"]:
                break
        paged = time.perf_counter() - t0
        result["fetch"] = {"one_page_items_per_s": 1000 / one_page,
                           "pages_of_100_with_ack_items_per_s": got / paged}
        print("wake latency…", file=sys.stderr)
        result["wake"] = wake_latency(tmp, serve, ids, sender, wakes)
    finally:
        serve.stop()
        node.stop()
    table(result, seconds)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def wake_latency(tmp: Path, serve: RelayServe, ids: Any, sender: RelayCaller, n: int
                 ) -> dict[str, float]:
    from tests.test_relay_wake import Hook, start_connector, wait_tunnel_up

    hook = Hook()
    connector = start_connector(tmp, serve, ids.recipient.key_path, ids.ingress.fingerprint,
                                f"http://127.0.0.1:{hook.port}/mail")
    samples: list[float] = []
    try:
        wait_tunnel_up(serve)
        time.sleep(0.5)
        for i in range(n):
            env = envelope(ids.sender, ids.recipient, msg_id=f"w-{i}")
            seen = len(hook.posts)
            t0 = time.monotonic()
            sender.tool("relay_call", env)
            if not hook.wait_for(seen + 1, timeout=10):
                continue
            samples.append(hook.posts[seen][0] - t0)
            time.sleep(1.2)  # past the once-a-second wake and hook bounds
    finally:
        connector.terminate()
        connector.wait(timeout=10)
        hook.close()
    return {"samples": len(samples), "p50_ms": _pct(samples, 50) * 1000,
            "p99_ms": _pct(samples, 99) * 1000}


def table(r: dict[str, Any], seconds: float) -> None:
    rc, tm = r["relay_call"], r["terminate"]
    print(f"| measure ({SENDERS} concurrent senders from {r.get('sources', 1)} address(es), "
          f"{seconds:g} s, {os.cpu_count()} cores) | value |")
    print("| --- | --- |")
    print(f"| plain terminate requests/s (tools/list forwarded) | {tm['rate']:.0f} "
          f"(p50 {tm['p50_ms']:.1f} ms, p99 {tm['p99_ms']:.1f} ms) |")
    print(f"| durable relay_call/s | {rc['rate']:.0f} (p50 {rc['p50_ms']:.1f} ms, "
          f"p99 {rc['p99_ms']:.1f} ms; errors {rc['errors']}) |")
    print(f"| relay_call / terminate | {rc['rate'] / tm['rate']:.2f}× |")
    print(f"| store during relay_call: COMMITs, mean COMMIT (fsync), calls per COMMIT | "
          f"{rc['commits']:.0f}, {rc['commit_ms']:.1f} ms, {rc['calls_per_commit']:.1f} |")
    print(f"| serve CPU per request: terminate / relay_call | {tm['cpu_us_per_call']:.0f} µs / "
          f"{rc['cpu_us_per_call']:.0f} µs |")
    print(f"| fetch 1,000 items, one page | {r['fetch']['one_page_items_per_s']:.0f} items/s |")
    print(f"| fetch 1,000 items, pages of 100 + ack | "
          f"{r['fetch']['pages_of_100_with_ack_items_per_s']:.0f} items/s |")
    w = r["wake"]
    print(f"| wake latency, enqueue → hook POST ({w['samples']} samples) | "
          f"p50 {w['p50_ms']:.1f} ms, p99 {w['p99_ms']:.1f} ms |")


if __name__ == "__main__":
    raise SystemExit(main())
