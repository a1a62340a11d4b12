"""What the shared (Redis) rate limiter costs compared with the local one, same run.

    python -m tests.bench.bench_redis_limiter            # about a minute
    python -m tests.bench.bench_redis_limiter --quick    # smoke run

Needs `redis-server` (Debian package redis-server). Two parts, each measuring the local
and the Redis limiter back to back:

1. **Per decision**, in this process: `check_calls` for one IP unit (the charge every
   terminate request makes), sequentially (latency: p50/p99) and from 64 concurrent
   tasks (throughput). CPU is this process's (time.process_time) and redis-server's
   (/proc/PID/stat), per decision.
2. **Per terminate request**: two real `pact-ingress serve` processes, identical but for
   `state:` (local / redis), one terminate route whose node is offline (every request
   is charged, then answered 503 at once, so the edge's own work is what is measured),
   HTTP/1.1 keep-alive requests from one client connection. Client-side latency per
   request, ingress and redis-server CPU per request from /proc/PID/stat.

Both use a 1 s `state.deadline`, so every decision is really made in Redis (a busy
machine would otherwise push some into the local fallback and flatter the figures); the
"shared" column says what share of decisions Redis made. With taskset and two cores, the
ingress (part 2) runs on core 0, redis-server and the client on core 1. `--rounds N`
repeats part 2, alternating which state goes first. Not a test: nothing is asserted; the
table goes to stdout.
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import trio

from pact_ingress.model import RedisSettings
from pact_ingress.proto.ratelimit import Budget
from pact_ingress.state import LocalLimiter
from pact_ingress.state.redis import RedisState
from pact_ingress.stats import Stats
from tests.redis_server import RedisServer, free_port

HOST = "bench.example.test"
#: Budgets that never refuse: the bench measures the decision, not refusals.
BUDGET = Budget(per_ip_key_per_hour=1_000_000_000, per_ip_per_hour=1_000_000_000)
CONCURRENCY = 16
TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc (10 ms resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def pinned(core: int, argv: list[str]) -> list[str]:
    if shutil.which("taskset") and (os.cpu_count() or 1) >= 2:
        return ["taskset", "-c", str(core), *argv]
    return argv


# -- part 1: per decision -------------------------------------------------------------------

async def _decisions(limiter: object, n: int, concurrent: int) -> tuple[float, list[float]]:
    """(wall seconds, per-decision latencies) for n IP-unit decisions."""
    latencies: list[float] = []
    per_task = n // concurrent

    async def worker(w: int) -> None:
        for i in range(per_task):
            started = time.perf_counter()
            await limiter.check_calls(f"10.{w}.{i % 250}.1", (None,), trio.current_time(),  # type: ignore[attr-defined]
                                      budget=BUDGET, scope=HOST)
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for w in range(concurrent):
            nursery.start_soon(worker, w)
    return time.perf_counter() - started, latencies


async def part_decisions(redis: RedisServer, n: int) -> list[tuple[str, ...]]:
    rows = []
    settings = RedisSettings(redis.host, redis.port, 0, Path("/nonexistent"), deadline=1.0)
    state = RedisState(settings, Stats())
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: state.run(task_status=task_status))
        assert state.healthy, state.last_error
        for name, limiter in (("local", LocalLimiter()), ("redis", state.limiter)):
            await _decisions(limiter, 500, 1)  # warm up (connections, script cache)
            for concurrent in (1, CONCURRENCY):
                cpu0, rcpu0 = time.process_time(), cpu_seconds(redis.proc.pid)  # type: ignore[union-attr]
                shared0 = state.stats.value("pact_ingress_rate_limit_decisions_total",
                                            {"where": "shared"})
                wall, lat = await _decisions(limiter, n, concurrent)
                shared = state.stats.value("pact_ingress_rate_limit_decisions_total",
                                           {"where": "shared"}) - shared0
                cpu = time.process_time() - cpu0
                rcpu = cpu_seconds(redis.proc.pid) - rcpu0  # type: ignore[union-attr]
                count = len(lat)
                lat.sort()
                rows.append((
                    f"{name}, {concurrent} at a time", f"{count / wall:,.0f}",
                    f"{lat[count // 2] * 1e6:.0f}", f"{lat[int(count * 0.99)] * 1e6:.0f}",
                    f"{cpu / count * 1e6:.1f}", f"{rcpu / count * 1e6:.1f}",
                    f"{shared / count:.0%}" if name == "redis" else "-"))
        if state.stats.value("pact_ingress_state_fallbacks_total"):
            print(f"Redis was lost during the run: {state.last_error}", file=sys.stderr)
        nursery.cancel_scope.cancel()
    return rows


# -- part 2: per terminate request ----------------------------------------------------------

def _serve(tmp: Path, name: str, port: int, closed: int, state: str) -> subprocess.Popen[bytes]:
    d = tmp / f"serve-{name}"
    d.mkdir()
    (d / "ingress.yaml").write_text(f"""\
state_dir: ./state
listen:
  tls: ["127.0.0.1:{port}"]
{state}
limits:
  calls_per_hour_per_ip: 1000000000
  calls_per_hour_per_ip_key: 1000000000
tenants:
  - name: bench
    pins: ["sha256:{'A' * 43}"]
    routes:
      - host: {HOST}
        mode: terminate
        backend: 127.0.0.1:{closed}
        cert: {{cert: ./cert.pem, key: ./cert.key}}
""")
    log = open(d / "serve.log", "wb")
    proc = subprocess.Popen(pinned(0, [sys.executable, "-m", "pact_ingress", "serve", "-c",
                                       str(d / "ingress.yaml")]), stdout=log, stderr=log)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(1.5)  # the redis backend probes and joins in its first second
            return proc
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"serve {name} did not start: {(d / 'serve.log').read_text()}")


def _keepalive(port: int, n: int) -> list[float]:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["http/1.1"])
    request = f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode()
    latencies = []
    with ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)),
                         server_hostname=HOST) as tls:
        buf = b""
        for _ in range(n):
            started = time.perf_counter()
            tls.sendall(request)
            while b"\r\n\r\n" not in buf:
                buf += tls.recv(65536)
            head, _, buf = buf.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 503"), head[:40]
            length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                              if line.lower().startswith(b"content-length")))
            while len(buf) < length:
                buf += tls.recv(65536)
            buf = buf[length:]
            latencies.append(time.perf_counter() - started)
    return latencies


def part_requests(redis: RedisServer, tmp: Path, n: int, rounds: int = 1
                  ) -> list[tuple[str, ...]]:
    """`rounds` runs of `n` requests per state, alternating which goes first; rates and
    CPU are the median over rounds, latencies pooled."""
    key = tmp / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    closed = free_port()
    redis_state = (f"state: {{backend: redis, url: '{redis.url}', deadline: 1s, "
                   f"encryption_key_file: '{key}'}}")
    procs = {"local": (_serve(tmp, "local", p := free_port(), closed, ""), p),
             "redis": (_serve(tmp, "redis", q := free_port(), closed, redis_state), q)}
    runs: dict[str, list[tuple[float, float, float]]] = {name: [] for name in procs}
    latencies: dict[str, list[float]] = {name: [] for name in procs}
    rows = []
    rpid = redis.proc.pid  # type: ignore[union-attr]
    try:
        for name, (_, port) in procs.items():
            _keepalive(port, 300)  # warm up
        for rnd in range(rounds):
            for name in (list(procs) if rnd % 2 == 0 else list(procs)[::-1]):
                proc, port = procs[name]
                cpu0, rcpu0 = cpu_seconds(proc.pid), cpu_seconds(rpid)
                started = time.perf_counter()
                latencies[name] += _keepalive(port, n)
                wall = time.perf_counter() - started
                runs[name].append((wall, cpu_seconds(proc.pid) - cpu0,
                                   cpu_seconds(rpid) - rcpu0))
        for name, measured in runs.items():
            lat = sorted(latencies[name])
            count = len(lat)
            rate = statistics.median(n / wall for wall, _, _ in measured)
            cpu = statistics.median(c for _, c, _ in measured) / n
            rcpu = statistics.median(r for _, _, r in measured) / n
            spread = ""
            if len(measured) > 1:
                each = sorted(c / n * 1e6 for _, c, _ in measured)
                spread = f" ({each[0]:.0f}–{each[-1]:.0f})"
            rows.append((f"{name} state", f"{rate:,.0f}", f"{lat[count // 2] * 1e6:.0f}",
                         f"{lat[int(count * 0.99)] * 1e6:.0f}", f"{cpu * 1e6:.0f}{spread}",
                         f"{rcpu * 1e6:.1f}", "-"))
    finally:
        for proc, _ in procs.values():
            proc.kill()
            proc.wait()
    return rows


def table(title: str, rows: list[tuple[str, ...]]) -> str:
    head = ("", "per second", "p50 µs", "p99 µs", "our CPU µs each", "redis CPU µs each",
            "shared")
    lines = [f"### {title}", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run, fewer requests")
    parser.add_argument("--rounds", type=int, default=1,
                        help="part 2: runs per state, alternating (median; default 1)")
    args = parser.parse_args()
    decisions, requests = (2_000, 1_000) if args.quick else (40_000, 10_000)
    with tempfile.TemporaryDirectory() as tmp:
        redis = RedisServer(Path(tmp) / "redis")
        if redis.proc is not None and shutil.which("taskset"):
            subprocess.run(["taskset", "-pc", "1", str(redis.proc.pid)],
                           stdout=subprocess.DEVNULL, check=False)
        try:
            print("part 1: per decision...", file=sys.stderr)
            one = trio.run(part_decisions, redis, decisions)
            print("part 2: per terminate request...", file=sys.stderr)
            two = part_requests(redis, Path(tmp), requests, args.rounds)
        finally:
            redis.stop()
    print(table(f"Rate-limit decision, in process ({decisions:,} IP-unit charges)", one))
    print()
    print(table(f"Terminate request, keep-alive, node offline ({requests:,} requests)", two))


if __name__ == "__main__":
    main()
