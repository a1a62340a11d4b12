"""Abuse of a terminate route from one IP while another IP is measured.

    python -m tests.bench.abuse_terminate            # all phases, about 2 minutes
    python -m tests.bench.abuse_terminate --only slow_body,big_bodies

Starts `pact-ingress demo` (ingress, demo node and connector in one process, loopback
only) and runs each phase from 127.0.0.2 while a probe from another address (a fresh one
per phase, 127.0.0.10 and up, so its own rate budget never runs out) sends one small GET
through the same terminate route every 50 ms, from its own process. Prints, per phase: the probe's requests,
failures, p50 and max latency; the process's RSS before, at the peak and after; and
`open_connections` from the admin endpoint before and after (it must come back). Not a
test: nothing is asserted, the numbers go to the README and the issue notes. Every load
loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import socket
import ssl
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

HOST = "mcp.demo.localhost"
ATTACKER = "127.0.0.2"


@functools.cache
def _ctx(alpn: str = "http/1.1") -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols([alpn])
    return ctx


class Demo:
    def __init__(self, port: int) -> None:
        self.port, self.admin = port, port + 1
        self.log = tempfile.NamedTemporaryFile("w+", prefix="abuse-demo-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "--log-format", "text", "demo",
             "--port", str(port)], stdout=subprocess.PIPE, stderr=self.log, text=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if "is running" in line:
                return
        raise RuntimeError("demo did not start")

    def rss_mib(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return 0.0

    def open_connections(self) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.admin}/status", timeout=5) as r:
            return float(json.load(r)["counters"]["open_connections"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)


def connect(port: int, source: str, alpn: str = "http/1.1") -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=30, source_address=(source, 0))
    return _ctx(alpn).wrap_socket(raw, server_hostname=HOST)


def request(method: str, path: str, body: bytes = b"", ctype: str = "text/plain",
            extra: str = "") -> bytes:
    head = (f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\ncontent-type: {ctype}\r\n"
            f"content-length: {len(body)}\r\n{extra}\r\n")
    return head.encode() + body


def probe(port: int, source: str, stop: Any, out: Any, failures: Any) -> None:
    """Runs in its own process: the attackers' threads must not share its GIL."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            with connect(port, source) as s:
                s.sendall(request("GET", "/_demo/headers"))
                data = s.recv(65536)
                if not data.startswith(b"HTTP/1.1 200"):
                    failures.append(data[:40].decode("latin-1"))
                else:
                    out.append(time.monotonic() - started)
        except OSError as exc:
            failures.append(repr(exc))
        stop.wait(0.05)


def _threads(n: int, target: Callable[[int], None]) -> list[threading.Thread]:
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    return threads


def big_bodies(port: int, seconds: float) -> None:
    """60 connections each POSTing a 5 MiB unsealed MCP body."""
    call = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {
        "name": "echo", "arguments": {"text": "x" * (5 * 1024 * 1024)}}}).encode()

    def one(_: int) -> None:
        try:
            with connect(port, ATTACKER) as s:
                s.sendall(request("POST", "/mcp", call, "application/json"))
                s.recv(65536)
        except OSError:
            pass
    for t in _threads(60, one):
        t.join(seconds)


def slow_body(port: int, seconds: float) -> None:
    """150 connections announcing 1 MiB bodies and sending one byte a second."""
    def one(_: int) -> None:
        try:
            with connect(port, ATTACKER) as s:
                s.sendall(request("POST", "/_demo/upload", b"")[:-2].replace(
                    b"content-length: 0", b"content-length: 1048576") + b"\r\n")
                end = time.monotonic() + seconds
                while time.monotonic() < end:
                    s.sendall(b"x")
                    time.sleep(1)
        except OSError:
            pass
    for t in _threads(150, one):
        t.join(seconds + 5)


def slow_read(port: int, seconds: float) -> None:
    """100 SSE streams that are never read."""
    def one(_: int) -> None:
        try:
            with connect(port, ATTACKER) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.sendall(request("GET", "/mcp?count=100000&interval=0", extra=""))
                time.sleep(seconds)
        except OSError:
            pass
    for t in _threads(100, one):
        t.join(seconds + 5)


def pipelined_abort(port: int, seconds: float) -> None:
    """40 clients pipeline a second request behind an SSE stream, then close or reset."""
    def one(i: int) -> None:
        try:
            s = connect(port, ATTACKER)
            s.sendall(request("GET", "/mcp?count=50&interval=0.2") + request("GET", "/mcp"))
            s.recv(100)
            if i % 2:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass
    for t in _threads(40, one):
        t.join(seconds)
    time.sleep(min(seconds, 3))


def refusal_flood(port: int, seconds: float) -> None:
    """400 unsealed tools/call requests on 8 keep-alive connections."""
    call = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": "echo", "arguments": {"text": "hi"}}}).encode()

    def one(_: int) -> None:
        end = time.monotonic() + seconds
        try:
            with connect(port, ATTACKER) as s:
                for _ in range(50):
                    if time.monotonic() > end:
                        return
                    s.sendall(request("POST", "/mcp", call, "application/json"))
                    s.recv(65536)
        except OSError:
            pass
    for t in _threads(8, one):
        t.join(seconds + 5)


def idle(port: int, seconds: float) -> None:
    """No abuse: the probe's baseline."""
    time.sleep(seconds)


PHASES = {"idle": idle, "big_bodies": big_bodies, "slow_body": slow_body, "slow_read": slow_read,
          "pipelined_abort": pipelined_abort, "refusal_flood": refusal_flood}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=18443)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--only", default=",".join(PHASES))
    args = parser.parse_args()
    demo = Demo(args.port)
    rows = []
    try:
        for n, name in enumerate(args.only.split(",")):
            source = f"127.0.0.{10 + n}"  # a fresh IP per phase: the probe's own budget
            time.sleep(2)
            before_conns, before_rss = demo.open_connections(), demo.rss_mib()
            manager = multiprocessing.Manager()
            stop, lat, fail = manager.Event(), manager.list(), manager.list()
            prober = multiprocessing.Process(target=probe, args=(args.port, source, stop, lat, fail))
            prober.start()
            peak = [before_rss]
            sampler_stop = threading.Event()

            def sample() -> None:
                while not sampler_stop.wait(0.2):
                    peak[0] = max(peak[0], demo.rss_mib())
            sampler = threading.Thread(target=sample)
            sampler.start()
            PHASES[name](args.port, args.seconds)
            stop.set()
            prober.join()
            lat, fail = list(lat), list(fail)
            manager.shutdown()
            deadline = time.monotonic() + 30
            while demo.open_connections() > before_conns and time.monotonic() < deadline:
                time.sleep(0.5)
            sampler_stop.set()
            sampler.join()
            rows.append((name, len(lat), len(fail),
                         1000 * statistics.median(lat) if lat else float("nan"),
                         1000 * max(lat) if lat else float("nan"),
                         before_rss, peak[0], demo.rss_mib(), before_conns,
                         demo.open_connections()))
            print(f"{name} done", file=sys.stderr)
    finally:
        demo.stop()
    print("| phase (from 127.0.0.2) | probe ok | probe failed | probe p50 ms | probe max ms "
          "| RSS MiB before / peak / after | open_connections before / after |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]:.1f} | {r[4]:.1f} | "
              f"{r[5]:.0f} / {r[6]:.0f} / {r[7]:.0f} | {r[8]:.0f} / {r[9]:.0f} |")
    print(f"pid {os.getpid()} done", file=sys.stderr)


if __name__ == "__main__":
    main()
