"""Instructions per passthrough flood connection, counted by callgrind: a figure a busy
machine cannot move.

    python -m tests.bench.callgrind_flood before=/tmp/before after=. [--conns 2000]

The flood phase of `bench_passthrough` (new TCP connection, canned ClientHello, the
backend closes once the hello has arrived, 64 in flight) against `pact-ingress serve`
run under `valgrind --tool=callgrind` with collection off. For each tree: start, warm up
(a flood of `--conns` / 4), switch collection on, run exactly `--conns` connections,
wait until the ingress has closed them all, switch collection off, and report
instructions per connection by shared object (libpython: the interpreter, our Python;
libc). The kernel's work (the syscalls, loopback TCP) is not counted: `strace -c -f`
on the same flood (`profile_router --tool strace`) counts the syscalls.

Instructions are not time, but repeat runs agree within ~1% whatever else the machine
runs, so two trees compare exactly. The idle process between connections adds a little
(the engine's one-second sweep, trio's wait): under a second of it per run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

from tests.bench.bench_passthrough import SNI, hello_for, ingress_yaml
from tests.bench.callgrind_terminate import (
    collect,
    counted,
    print_table,
    require_valgrind,
    serve_under_callgrind,
)
from tests.bench.harness import (
    CORE_LOAD,
    Service,
    free_port,
    pin_self,
    python_module,
    run_load,
    services,
)
from tests.bench.peers import haproxy_argv, haproxy_backends_cfg, make_tls_pem

INFLIGHT = 64


def _flood(port: int, hello: Path, count: int) -> dict:
    argv = python_module("tests.bench.loadgen", "flood", "--hello", str(hello), "--inflight",
                         str(INFLIGHT), "--seconds", "600", "--max", str(count),
                         "--port", str(port))
    res = run_load(argv, core=CORE_LOAD, time_bound=600)
    if res["units"] != count or res["errors"]:
        raise SystemExit(f"flood: {res['units']} of {count} connections, {res['errors']} "
                         f"errors {res.get('error_kinds')}")
    return res


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def measure(name: str, tree: Path, tmp: Path, sink: int, hello: Path, conns: int
            ) -> Counter[str]:
    port = free_port()
    state = tmp / f"state-{name}"
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(ingress_yaml(tmp, port, {SNI["flood"]: sink}).replace(
        f"state_dir: {tmp}/state", f"state_dir: {state}"))
    proc = serve_under_callgrind(name, tree, cfg, tmp, port)
    try:
        _flood(port, hello, max(conns // 4, INFLIGHT))  # warm: caches, pools, every path
        time.sleep(2)
        idle = _open_fds(proc.pid)
        collect(proc, True)
        _flood(port, hello, conns)
        settle = time.monotonic() + 60  # the last client closes have to be read
        while _open_fds(proc.pid) > idle and time.monotonic() < settle:
            time.sleep(0.2)
        collect(proc, False)
    finally:
        proc.terminate()
        proc.wait(60)
    return counted(tmp, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="NAME=DIR: a tree holding pact_ingress")
    p.add_argument("--conns", type=int, default=2000)
    args = p.parse_args(argv)
    require_valgrind()
    if (os.cpu_count() or 1) >= 2:
        pin_self(CORE_LOAD)
    tmp = Path(tempfile.mkdtemp(prefix="pact-bench-cgf-"))
    hello = tmp / "hello.bin"
    hello.write_bytes(hello_for(SNI["flood"]))
    sink, tls = free_port(), free_port()
    (tmp / "backends.cfg").write_text(haproxy_backends_cfg(
        tls_port=tls, pem=make_tls_pem(tmp, SNI["tls"]), sink_port=sink))
    rows: dict[str, Counter[str]] = {}
    with services() as started:
        backend = Service("sink", haproxy_argv(tmp / "backends.cfg"), CORE_LOAD,
                          tmp / "backends.log")
        started.append(backend)
        backend.start([sink])
        for name, tree in (t.split("=", 1) for t in args.trees):
            rows[name] = measure(name, Path(tree).resolve(), tmp, sink, hello, args.conns)
    shutil.rmtree(tmp, ignore_errors=True)
    groups = {"libpython (our Python)": ("libpython3.11", "libpython3"), "libc": ("libc",)}
    print_table(rows, groups, args.conns, "k instructions per flood connection", "{:,.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
