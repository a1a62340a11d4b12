"""Several instances: failover after `kill -9`, and what forwarding costs.

    python -m tests.bench.bench_cluster            # about two minutes
    python -m tests.bench.bench_cluster --quick    # smoke run

Needs `redis-server`. Three `pact-ingress serve` processes on 127.0.0.2/.3/.4 sharing
one Redis, each listing the others in `state.peers`; one `connect` holding tunnels on
A and B only (C has none: its callers are always forwarded). Requests are the harness's
(`tests/cluster_env.request`): one new TLS connection per request.

1. **Failover**: per trial, `kill -9` of A, then requests are made back to back until one
   succeeds — through B (it holds its own tunnel) and through C (forwarded: the
   registry still names A for up to its TTL, so C may pick the dead A first). The time
   from the kill to that first success; then A is restarted and the connector's slot
   back on it is awaited before the next trial. p50/p99 over the trials.
2. **Latency**: sequential requests through A (direct: its own tunnel) and through C
   (forwarded to A or B), passthrough and terminate. Terminate keeps its upstream
   connection, so its forwarded link is mostly reused; passthrough pays the link per
   connection.

Not a test: nothing is asserted; the tables go to stdout.
"""

from __future__ import annotations

import argparse
import base64
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.cluster_env import PT_HOST, TM_HOST, Connect, Instance, home_node, request, wait_for
from tests.redis_server import RedisServer
from tests.terminate_env import free_port


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _first_success(instance: Instance, host: str, since: float, limit: float = 30.0) -> float:
    while time.monotonic() - since < limit:
        if request(instance, host, timeout=5) == 200:
            return time.monotonic() - since
    return float("inf")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    trials = 3 if args.quick else 12
    samples = 30 if args.quick else 300
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        redis = RedisServer(tmp / "redis")
        key = tmp / "state.key"
        key.write_bytes(base64.b64encode(os.urandom(32)))
        os.chmod(key, 0o600)
        node = home_node(tmp)
        port = free_port()
        state = (f"state: {{backend: redis, url: {redis.url}, encryption_key_file: {key},"
                 " deadline: 500ms, peers: [PEERS]}\n"
                 # every terminate request charges the caller's IP: the bench is one IP
                 "limits: {calls_per_hour_per_ip: 10000000}\n")
        instances = [Instance(tmp, addr, port, node.identity.fingerprint, extra=state)
                     for addr in ("127.0.0.2", "127.0.0.3", "127.0.0.4")]
        a, b, c = instances
        fps = [i.identity.fingerprint for i in instances]
        for instance in instances:
            others = [fp for fp in fps if fp != instance.identity.fingerprint]
            instance.config.write_text(
                instance.config.read_text().replace("PEERS", ", ".join(others)))
        connect = None
        try:
            for instance in instances:
                instance.start()
            connect = Connect(tmp, node.identity, node.port,
                              [f"{a.address}:{port}", f"{b.address}:{port}"],
                              [a.identity.fingerprint, b.identity.fingerprint])
            for instance in (a, b):
                wait_for(lambda i=instance: i.tunnels_up() >= 1, f"tunnel on {instance.address}")
            wait_for(lambda: request(c, PT_HOST) == 200, "C forwarding")

            direct: list[float] = []
            forwarded: list[float] = []
            for _ in range(trials):
                killed = time.monotonic()
                a.kill()
                direct.append(_first_success(b, PT_HOST, killed))
                killed = time.monotonic()  # C: measured from its own start, same situation
                forwarded.append(_first_success(c, PT_HOST, killed))
                a.start()
                wait_for(lambda: a.tunnels_up() >= 1, "the connector back on A", timeout=60)
                wait_for(lambda: request(a, PT_HOST) == 200, "A serving again")
            print(f"\nFailover after kill -9 of A ({trials} trials), seconds to the first "
                  "successful request")
            print("| via | p50 | p99 | max |")
            print("| --- | ---: | ---: | ---: |")
            for name, values in (("B (own tunnel)", direct), ("C (forwarded)", forwarded)):
                print(f"| {name} | {_pct(values, .5):.3f} | {_pct(values, .99):.3f} "
                      f"| {max(values):.3f} |")

            print(f"\nRequest latency, {samples} sequential requests (new TLS connection each)")
            print("| route | via | p50 ms | p99 ms | failed |")
            print("| --- | --- | ---: | ---: | ---: |")
            for host, mode in ((PT_HOST, "passthrough"), (TM_HOST, "terminate")):
                for instance, via in ((a, "A, direct"), (c, "C, forwarded")):
                    times: list[float] = []
                    failed: Counter[int | None] = Counter()
                    for _ in range(samples):
                        t0 = time.perf_counter()
                        status = request(instance, host)
                        if status == 200:
                            times.append((time.perf_counter() - t0) * 1000)
                        else:
                            failed[status] += 1
                    print(f"| {mode} | {via} | {statistics.median(times):.2f} "
                          f"| {_pct(times, .99):.2f} | {dict(failed) or 0} |")
        finally:
            if connect is not None:
                connect.close()
            for instance in instances:
                instance.close()
            redis.stop()
            node.stop()


if __name__ == "__main__":
    main()
