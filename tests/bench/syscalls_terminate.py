"""Where a terminate request's CPU goes, beside HAProxy's: user and kernel time, and the
syscalls each proxy makes, per keep-alive request or per new connection.

    python -m tests.bench.syscalls_terminate [--mode ka|new] [--count N] [--passes 2]

The terminate bench's rig (`bench_terminate.build_rig`: HAProxy as the node, answering
`200` + 1 KiB over pinned mTLS; HAProxy in HTTP mode and `pact-ingress serve` on the
proxy core) driven by `callgrind_terminate`'s clients: 8 threads, each on one keep-alive
connection (`--mode ka`), or each opening new connections that resume its last TLS
session, one `GET /` each (`--mode new`). For each proxy in turn (`--passes` times,
alternated), `perf stat` counts the syscalls in `SYSCALLS` through the kernel's
tracepoints (strace would slow the proxy enough to change what it does), and /proc
gives the process's user and system time over the same requests. Figures are per
request (per connection for `new`).

It answers "is it the kernel or the interpreter": when the syscalls are the same ones
and the system time is close to HAProxy's, the rest of the distance is user space.
Not a test; needs perf (Debian: linux-perf) and a kernel with syscall tracepoints.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench import bench_terminate as bt
from tests.bench import callgrind_terminate as cg
from tests.bench.harness import CORE_LOAD, pin_self, services
from tests.bench.profile_router import user_sys

#: Syscalls counted (those the tracepoints of the running kernel have).
SYSCALLS = ("read", "write", "recvfrom", "sendto", "epoll_wait", "epoll_ctl", "accept4",
            "close", "ioctl", "getsockopt", "setsockopt", "fcntl", "shutdown", "futex",
            "getpid", "socket", "connect", "getsockname", "getpeername", "poll")
TRACEPOINTS = Path("/sys/kernel/tracing/events/syscalls")


def measure(pid: int, port: int, mode: str, count: int) -> dict[str, float]:
    """Per unit: user and system µs and each syscall's count, over `count` units."""
    events = ["task-clock", "context-switches"] + [
        f"syscalls:sys_enter_{name}" for name in SYSCALLS
        if (TRACEPOINTS / f"sys_enter_{name}").exists()]
    perf = subprocess.Popen(["perf", "stat", "-x,", "-e", ",".join(events), "-p", str(pid)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(0.5)  # let it attach
    u0, s0 = user_sys(pid)
    ok = cg._connections(port, count) if mode == "new" else cg._keepalive(port, count)
    u1, s1 = user_sys(pid)
    perf.send_signal(signal.SIGINT)
    out = perf.communicate(timeout=60)[0].decode(errors="replace")
    units = count // cg.THREADS * cg.THREADS
    if ok != units:
        raise SystemExit(f"only {ok} of {units} answered 200")
    row = {"user_us": (u1 - u0) / units * 1e6, "sys_us": (s1 - s0) / units * 1e6}
    for line in out.splitlines():
        fields = line.split(",")
        if len(fields) > 2 and fields[0].replace(".", "", 1).isdigit():
            name = fields[2].removeprefix("syscalls:sys_enter_")
            if name != "task-clock":
                row[name] = float(fields[0]) / units
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ka", "new"), default="ka")
    p.add_argument("--count", type=int, default=None,
                   help="requests (ka, default 8000) or connections (new, default 1600)")
    p.add_argument("--passes", type=int, default=2)
    args = p.parse_args(argv)
    if shutil.which("perf") is None:
        raise SystemExit("perf not found (Debian: apt-get install linux-perf)")
    count = args.count or (8000 if args.mode == "ka" else 1600)
    if (os.cpu_count() or 1) >= 2:
        pin_self(CORE_LOAD)
    tmp = Path(tempfile.mkdtemp(prefix="pact-bench-sys-"))
    rows: list[tuple[str, dict[str, float]]] = []
    with services() as started:
        rig = bt.build_rig(tmp, started, "h2,http/1.1")
        for _ in range(args.passes):
            for name in (bt.PEER, bt.SUBJECT):
                port, pid = rig.ports[name], rig.proxies[name].pid
                cg._connections(port, 8 * cg.THREADS)  # warm: pools filled, paths run
                rows.append((name, measure(pid, port, args.mode, count)))
    shutil.rmtree(tmp, ignore_errors=True)
    unit = "request" if args.mode == "ka" else "connection"
    names = [k for k in rows[0][1] if any(r.get(k) for _, r in rows)]
    print(f"| per {unit} | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for name, row in rows:
        cells = [f"{row.get(k, 0.0):.1f}" if k.endswith("_us") else f"{row.get(k, 0.0):.2f}"
                 for k in names]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
