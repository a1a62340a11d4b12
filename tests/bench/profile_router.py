"""Where the passthrough router's CPU per new connection goes: flood it, measure, profile.

    python -m tests.bench.profile_router [--ingress serve|router] [--seconds S] [--runs N]
                                         [--tool none|pyspy|strace|perf|perfrec|cprofile]
                                         [--callgraph] [--proxy ingress|haproxy] [--out FILE]
                                         [--load flood|ka32|bulk1|bulk8|bulk100]

The flood phase of `bench_passthrough` (new TCP connection, canned ClientHello, the
backend closes once the hello has arrived, 64 in flight), against pact-ingress only (or,
with `--proxy haproxy`, against HAProxy in TCP mode with the same SNI route, to compare
syscalls and kernel time with the same tools), so one change can be measured in seconds
and a profiler attached to the real process. `--load ka32` measures keep-alive requests
instead, `--load bulk1`/`bulk8`/`bulk100` 4 GiB through 1, 8 or 100 connections (CPU
per GB, split into user and system time: what a bulk transfer costs in Python beside
the kernel's splice):

- `none` (default): `--runs` floods, each printing CPU µs per connection (utime + stime
  of the proxy from /proc, as the bench) and conn/s; then the median;
- `pyspy`: `py-spy record` on the proxy during one flood, collapsed stacks (`--format
  raw`) to `--out`, and a summary: share of samples by leaf function and by our frames;
- `strace`: `strace -c -f` on the proxy during one flood: syscalls per connection;
- `perf`: `perf stat` (task-clock, instructions, context switches, and the count of each
  syscall in `TRACED_SYSCALLS` where the kernel has tracepoints) per connection;
- `perfrec`: `perf record -e cpu-clock` on the proxy during one flood: the share of
  samples by DSO (kernel vs interpreter vs extension modules) and the top symbols —
  the split py-spy cannot see (it counts a syscall's time on the Python line);
  `--callgraph` records call chains (`perf report -g` on the data file);
- `cprofile`: the router runner under cProfile (call counts per connection; its times
  are inflated several times), pstats to `--out` with suffix `.pstats`.

Attached tools slow the proxy (strace by several times): only `none` gives real µs.
Same pinning as the bench: the proxy alone on core 0, the rest on core 1. Not a test.
"""

from __future__ import annotations

import argparse
import collections
import os
import pstats
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.bench.bench_passthrough import SNI, hello_for, ingress_yaml, start_ingress
from tests.bench.harness import (
    CORE_LOAD,
    CORE_PROXY,
    CpuMeter,
    Service,
    free_port,
    pin_self,
    python_module,
    run_load,
    services,
)
from tests.bench.peers import (
    haproxy_argv,
    haproxy_backends_cfg,
    haproxy_passthrough_cfg,
    make_tls_pem,
    raw_backends_argv,
)

#: In-flight connections, as the bench's flood phase.
INFLIGHT = 64
#: Seconds of flood before measuring: imports, caches and pools warm.
WARMUP = 1.0
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Leaf frames listed in the py-spy summary.
TOP = 25
#: Syscalls `--tool perf` counts through tracepoints (strace slows the proxy so much that
#: its wake-up pattern changes: fewer, fuller reads).
TRACED_SYSCALLS = ("splice", "epoll_wait", "epoll_pwait", "epoll_ctl", "recvfrom", "sendto",
                   "accept4", "connect")


#: The load (`--load`): "flood" (new connections; a unit is a connection), "ka32"
#: (1 KiB ping-pong on 32 keep-alive connections through an echo backend; a unit is a
#: request) or "bulk1"/"bulk8"/"bulk100" (`BULK_BYTES` through that many connections
#: into a counting sink; a unit is a byte, shown per GB), as the bench's phases.
LOAD = {"kind": "flood"}
#: Bytes per bulk load: a few seconds of loopback at a proxy's pace.
BULK_BYTES = 4 << 30


def flood(port: int, hello: Path, seconds: float) -> dict[str, Any]:
    if LOAD["kind"] in ("bulk1", "bulk8", "bulk100"):
        size = BULK_BYTES if seconds > WARMUP else BULK_BYTES >> 4
        argv = python_module("tests.bench.loadgen", "bulk", "--hello", str(hello),
                             "--conns", LOAD["kind"][4:], "--bytes", str(size),
                             "--seconds", str(max(30.0, seconds)), "--port", str(port))
        return run_load(argv, core=CORE_LOAD, time_bound=max(30.0, seconds))
    if LOAD["kind"] == "ka32":
        argv = python_module("tests.bench.loadgen", "keepalive", "--hello", str(hello),
                             "--conns", "32", "--seconds", str(seconds), "--port", str(port))
        return run_load(argv, core=CORE_LOAD, time_bound=seconds)
    argv = python_module("tests.bench.loadgen", "flood", "--hello", str(hello),
                         "--inflight", str(INFLIGHT), "--seconds", str(seconds),
                         "--port", str(port))
    return run_load(argv, core=CORE_LOAD, time_bound=seconds)


def user_sys(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of one process, from /proc/PID/stat."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rfind(")") + 2:].split()
    return int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK


def measured(proxy: Service, port: int, hello: Path, seconds: float) -> dict[str, Any]:
    meter = CpuMeter({"proxy": proxy.pid})
    u0, s0 = user_sys(proxy.pid)
    meter.start()
    res = flood(port, hello, seconds)
    res["proxy_cpu"] = meter.stop()["proxy"]
    u1, s1 = user_sys(proxy.pid)
    units = max(res["units"], 1)
    res["us_per_conn"] = res["proxy_cpu"] / units * 1e6
    res["user_us"], res["sys_us"] = (u1 - u0) / units * 1e6, (s1 - s0) / units * 1e6
    return res


def attached(tool: list[str], proxy: Service, port: int, hello: Path, seconds: float
             ) -> tuple[dict[str, Any], str]:
    """One flood with `tool` (which gets `-p PID` style arguments already) attached."""
    proc = subprocess.Popen(tool, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    time.sleep(0.5)  # let it attach
    try:
        res = measured(proxy, port, hello, seconds)
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    return res, out.decode(errors="replace")


#: Leaf-frame file → bucket, first match wins. A leaf that makes a syscall is counted
#: where the call is written (py-spy sees Python frames only); /proc's user/system split
#: (`--tool none`) gives the kernel's share.
BUCKETS = (("pact_ingress/proto/", "pact_ingress parser"), ("pact_ingress/", "pact_ingress"),
           ("trio/_core/", "trio scheduler/core"), ("trio/", "trio sockets"),
           ("prometheus_client/", "prometheus_client"), ("logging/", "logging/json"),
           ("json/", "logging/json"), ("socket.py", "stdlib socket"))


def summarize_pyspy(raw: Path, units: int) -> str:
    """Collapsed stacks → share of samples per bucket of the leaf frame, and top leaves."""
    leaves: collections.Counter[str] = collections.Counter()
    owner: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        leaf = stack.split(";")[-1]
        leaves[leaf] += n
        where = leaf.rpartition("(")[2]
        owner[next((b for key, b in BUCKETS if key in where), "other")] += n
    lines = [f"{total} samples, {units} connections; by the leaf frame's file:"]
    lines += [f"  {v / total:6.1%}  {k}" for k, v in owner.most_common()]
    lines.append("top leaf frames:")
    lines += [f"  {v / total:6.1%}  {k}" for k, v in leaves.most_common(TOP)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ingress", choices=("serve", "router"), default="serve")
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--tool", choices=("none", "pyspy", "strace", "perf", "perfrec",
                                      "cprofile"),
                   default="none")
    p.add_argument("--out", type=Path, default=Path("/tmp/router-profile.txt"))
    p.add_argument("--load", choices=("flood", "ka32", "bulk1", "bulk8", "bulk100"),
                   default="flood",
                   help="new connections (flood), 1 KiB requests on 32 connections, or "
                        "4 GiB through 1, 8 or 100 connections (shown per GB)")
    p.add_argument("--callgraph", action="store_true",
                   help="perfrec: record call chains too (perf report -g on the data)")
    p.add_argument("--proxy", choices=("ingress", "haproxy"), default="ingress",
                   help="the process flooded and measured: pact-ingress or HAProxy in TCP "
                        "mode (the same SNI route), to compare syscalls and kernel time")
    args = p.parse_args(argv)
    pin_self(CORE_LOAD)
    tmp = Path(tempfile.mkdtemp(prefix="pact-prof-"))
    LOAD["kind"] = args.load
    bulk_load = args.load.startswith("bulk")
    name = SNI["keepalive" if args.load == "ka32" else "bulk" if bulk_load else "flood"]
    hello = tmp / "hello.bin"
    hello.write_bytes(hello_for(name))
    sink, tls, port = free_port(), free_port(), free_port()
    (tmp / "backends.cfg").write_text(haproxy_backends_cfg(
        tls_port=tls, pem=make_tls_pem(tmp, SNI["tls"]), sink_port=sink))
    if args.load == "ka32" or bulk_load:  # the echo or bulk server takes sink's place
        sink, bulk = free_port(), free_port()
    (tmp / "ingress.yaml").write_text(ingress_yaml(tmp, port, {name: sink}))
    with services() as started:
        if args.load == "ka32" or bulk_load:
            ports = {"bulk": sink, "echo": bulk} if bulk_load else {"bulk": bulk, "echo": sink}
            backend = Service("echo", raw_backends_argv(len(hello.read_bytes()), **ports),
                              CORE_LOAD, tmp / "echo.log")
        else:
            backend = Service("sink", haproxy_argv(tmp / "backends.cfg"), CORE_LOAD,
                              tmp / "backends.log")
        started.append(backend)
        backend.start([sink])
        cprof = args.out.with_suffix(".pstats") if args.tool == "cprofile" else None
        if args.proxy == "haproxy":
            (tmp / "haproxy.cfg").write_text(haproxy_passthrough_cfg(port, {name: sink}))
            proxy = Service("haproxy", haproxy_argv(tmp / "haproxy.cfg"), CORE_PROXY,
                            tmp / "haproxy.log")
            started.append(proxy)
            proxy.start([port])
            runner = "haproxy"
        else:
            proxy, runner = start_ingress(tmp, tmp / "ingress.yaml", port, args.ingress, [],
                                          cprof)
            started.append(proxy)
        flood(port, hello, WARMUP)
        pid = str(proxy.pid)
        if args.tool == "cprofile":  # deterministic call counts; µs inflated several times
            res = measured(proxy, port, hello, args.seconds)
            proxy.stop()
            print(f"{res['units']} connections; pstats in {cprof}")
            pstats.Stats(str(cprof)).sort_stats("tottime").print_stats(TOP)
        elif args.tool == "none":
            runs = [measured(proxy, port, hello, args.seconds) for _ in range(args.runs)]
            # per connection or request; a bulk load's unit is a byte: shown per GB
            scale, unit, rate = ((1e9 / 1e6, "s/GB", "MB/s") if bulk_load
                                 else (1.0, "µs/conn", "conn/s"))
            rate_scale = 1e-6 if bulk_load else 1.0
            for r in runs:
                print(f"{runner}: {r['us_per_conn'] * scale:7.3f} {unit}  "
                      f"{r['rate'] * rate_scale:8.1f} {rate}  errors={r['errors']}")
            digits = 3 if bulk_load else 1
            print(f"median: {statistics.median(r['us_per_conn'] for r in runs) * scale:.{digits}f}"
                  f" {unit}  {statistics.median(r['rate'] for r in runs) * rate_scale:.1f} "
                  f"{rate}  user "
                  f"{statistics.median(r['user_us'] for r in runs) * scale:.{digits}f}  sys "
                  f"{statistics.median(r['sys_us'] for r in runs) * scale:.{digits}f} ({unit})")
        elif args.tool == "pyspy":
            raw = args.out.with_suffix(".raw")
            res, _ = attached(["py-spy", "record", "--pid", pid, "--format", "raw",
                               "--rate", "250", "--output", str(raw), "--nonblocking"],
                              proxy, port, hello, args.seconds)
            print(summarize_pyspy(raw, res["units"]))
            print(f"collapsed stacks: {raw}")
        elif args.tool == "strace":
            res, out = attached(["strace", "-c", "-f", "-p", pid], proxy, port, hello,
                                args.seconds)
            print(out)
            print(f"connections: {res['units']} (divide 'calls' by this)")
            per = [ln.split() for ln in out.splitlines() if ln[:1] == " " and "%" not in ln]
            rows = [(int(f[3]), f[-1]) for f in per if len(f) >= 5 and f[3].isdigit()]
            for calls, name in sorted(rows, reverse=True):
                print(f"  {calls / max(res['units'], 1):6.2f}  {name}")
        elif args.tool == "perfrec":
            data = args.out.with_suffix(".perf")
            res, _ = attached(["perf", "record", "-e", "cpu-clock", "-F", "2000", "-p", pid,
                               "-o", str(data)] + (["-g"] if args.callgraph else []),
                              proxy, port, hello, args.seconds)
            for sort in ("dso", "sym"):
                report = subprocess.run(
                    ["perf", "report", "-i", str(data), "--sort", sort, "--stdio",
                     "--percent-limit", "1"], capture_output=True, text=True, check=False)
                print("\n".join(ln for ln in report.stdout.splitlines()
                                if ln.strip() and not ln.startswith("#")))
            print(f"connections: {res['units']}; perf data: {data}")
        else:
            events = "task-clock,instructions,cycles,context-switches"
            # syscall counts without strace's slowdown, where the kernel has tracepoints
            events += "".join(f",syscalls:sys_enter_{name}" for name in TRACED_SYSCALLS
                              if Path(f"/sys/kernel/tracing/events/syscalls/sys_enter_{name}"
                                      ).exists())
            res, out = attached(["perf", "stat", "-e", events, "-p", pid], proxy, port,
                                hello, args.seconds)
            print(out)
            print(f"connections: {res['units']}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
