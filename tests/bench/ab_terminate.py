"""Before/after for the terminate engine: several pact-ingress trees, HAProxy, one rig.

    git archive <commit> pact_ingress | tar -x -C /tmp/before
    python -m tests.bench.ab_terminate before=/tmp/before after=. \\
        [--phases ka8,ka32,ka1,new8] [--rounds 3] [--seconds 2] [--profile after] \\
        [--upstream h2|http/1.1] [--peer-h1] [--lean] [--lean-epoll] [--epoll-checked]
        [--epoll-checked-h2up]

On a shared machine two separate bench runs cannot be compared: what other work takes
from the proxy core moves every figure by tens of percent. This runs the rig of
`bench_terminate` (the same node, HAProxy peer and ingress config) once, starts one
`pact-ingress serve` per source tree given (each on its own port, all on the proxy
core), and alternates short runs of every phase through HAProxy and every tree, round
after round, so each one sees the same load. Reported: the median µs of proxy CPU per
request (per new connection for `new*` phases) and the ratio to HAProxy's, measured in
the same rounds, and the median of the per-round ratios with their range (the paired
figure: a round's two runs share the host's weather); then each path's µs split into
user space and kernel (the proxy process's /proc utime and stime, each the median of the
rounds), and the TCP segments the machine sent per request during each path's runs (all
of them on loopback: client, proxy and node; `/proc/net/snmp`'s `OutSegs`, so nothing
else may run meanwhile): four is one segment per leg and direction, fewer means a leg
carries several requests per segment. `--profile NAME` then records
that tree under py-spy during a keep-alive run (`--profile-phase`) and prints the same
summary `bench_terminate` does (several names, comma-separated: one after the other).
`--upstream` is the ALPN the node offers, as in `bench_terminate`: by default
`h2,http/1.1`, so HAProxy re-originates over HTTP/2 (one connection multiplexing every
client's requests) while pact-ingress speaks HTTP/1.1 to the node; `http/1.1` makes both
re-originate over HTTP/1.1, which shows how much of HAProxy's lead is its upstream
protocol. `--peer-h1` measures both peers in the same rounds instead: a second HAProxy
(path `haproxy-h1`, the same config but ALPN `http/1.1` towards the node, so it
re-originates as pact-ingress does) beside the default one, and every tree's ratios to
both. `--lean` adds `tests/bench/lean_proxy.py` as a path (HTTP/1.1 phases only):
the plainest terminate proxy on this stack (trio, memory-BIO TLS, llhttp both sides, no
product checks), so a tree's distance from it is about the product's own work and its
distance from HAProxy what the stack costs written the plain way (not a lower bound).
`--lean-epoll` adds `tests/bench/lean_epoll_proxy.py` the same way: the same job without
trio, one thread driving one edge-triggered epoll set of small per-connection state
machines (the passthrough engine's shape), for how cheap Python can make it.
`--epoll-checked` adds `tests/bench/epoll_checked_proxy.py`: that loop with the
product's per-request work done by the product's own sans-I/O pieces (its parsers, the
rate check, target and Host checks, header hygiene, counts, the access log line), for
what a terminate engine of that shape would cost. `--epoll-checked-h2up` adds
`tests/bench/epoll_checked_h2up_proxy.py`: the same with the node leg on one HTTP/2
connection, its frames sent once per batch of events, as HAProxy re-originates (the node
must offer h2: the default `--upstream`), for what a multiplexed node leg would save.

A tree is a directory holding the `pact_ingress` package; `python -m pact_ingress` runs
with it as the working directory, which puts it first on `sys.path`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.bench import bench_terminate as bt
from tests.bench.harness import (
    CORE_LOAD,
    CORE_PROXY,
    Service,
    cpu_seconds,
    free_port,
    pin_self,
    pinned,
    python_module,
    services,
)
from tests.bench.peers import haproxy_argv, haproxy_terminate_cfg

PROFILE_RATE = 400
#: `--peer-h1`: the path of HAProxy re-originating over HTTP/1.1.
PEER_H1 = "haproxy-h1"


def tcp_segments_sent() -> int:
    """TCP segments this machine has sent since boot (every namespace-local socket:
    on loopback, each is also one received)."""
    names, values = (line.split() for line in Path("/proc/net/snmp").read_text()
                     .splitlines() if line.startswith("Tcp:"))
    return int(dict(zip(names, values, strict=True))["OutSegs"])


def profile(rig: bt.Rig, name: str, phase: bt.Phase, tmp: Path, keep: Path | None) -> None:
    """`name` under py-spy for one keep-alive run; the summary `bench_terminate` prints."""
    out = tmp / f"py-spy-{name}.txt"
    argv = pinned(["py-spy", "record", "--pid", str(rig.proxies[name].pid), "--duration", "7",
                   "--rate", str(PROFILE_RATE), "--full-filenames", "--format", "raw",
                   "--output", str(out)], CORE_LOAD)
    spy = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.7)  # attached before the load starts
    run = bt.run_phase(rig, phase, name, 6)
    spy.wait(30)
    if not out.exists():
        print(f"\npy-spy recorded nothing for {name}")
        return
    if keep is not None:
        shutil.copy(out, keep.with_name(f"{keep.stem}-{name}{keep.suffix}"))
    summary = bt.summarise_profile(out.read_text(), 7, PROFILE_RATE)
    print()
    print(bt.profile_markdown(summary, f"py-spy: {name}, {phase.key}, {run.rate:,.0f} req/s"))


def paired(subject: list[float], peer: list[float]) -> str:
    """The median of the per-round ratios subject ÷ peer, and their range. Each round
    measures the two seconds apart, so what the host's other work does to both cancels
    out of a round's ratio; the ratio of the medians (the column before) takes each
    median from different rounds."""
    ratios = sorted(s / p for s, p in zip(subject, peer, strict=True))
    return f"{statistics.median(ratios):.2f}× ({ratios[0]:.2f}–{ratios[-1]:.2f})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trees", nargs="+", help="NAME=DIR: a tree holding pact_ingress")
    p.add_argument("--phases", default="ka8,ka32,ka1,new8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--profile", help="NAME[,NAME…] of trees to profile afterwards")
    p.add_argument("--profile-phase", default="ka8")
    p.add_argument("--upstream", choices=("h2", "http/1.1"), default="h2",
                   help="ALPN the node offers (default h2, falling back to http/1.1; "
                        "http/1.1 makes HAProxy re-originate over HTTP/1.1 too)")
    p.add_argument("--peer-h1", action="store_true",
                   help=f"add a second HAProxy ({PEER_H1}) that re-originates over HTTP/1.1, "
                        "as pact-ingress does, and the ratios to it")
    p.add_argument("--lean", action="store_true",
                   help="add the plain reference proxy (tests/bench/lean_proxy.py) as a path")
    p.add_argument("--lean-epoll", action="store_true",
                   help="add the one-epoll-loop reference (tests/bench/lean_epoll_proxy.py)")
    p.add_argument("--epoll-checked", action="store_true",
                   help="add the one-epoll-loop reference with the product's per-request "
                        "work (tests/bench/epoll_checked_proxy.py)")
    p.add_argument("--epoll-checked-h2up", action="store_true",
                   help="add that reference speaking HTTP/2 to the node over one "
                        "connection (tests/bench/epoll_checked_h2up_proxy.py)")
    p.add_argument("--profile-out", type=Path,
                   help="also keep py-spy's raw stacks (FILE gets -NAME before its suffix)")
    args = p.parse_args(argv)
    trees = dict(t.split("=", 1) for t in args.trees)
    phases = {ph.key: ph for ph in bt.PHASES}
    plan = [phases[k] for k in args.phases.split(",")]
    if cpus := os.cpu_count():
        if cpus >= 2:
            pin_self(CORE_LOAD)
    tmp = Path(tempfile.mkdtemp(prefix="pact-bench-ab-"))
    upstream_alpn = "h2,http/1.1" if args.upstream == "h2" else "http/1.1"
    print(f"load average at start: {os.getloadavg()[0]:.2f}; the node offers "
          f"{upstream_alpn}", file=sys.stderr)
    with services() as started:
        rig = bt.build_rig(tmp, started, upstream_alpn)
        yaml = (tmp / "ingress.yaml").read_text()
        paths = [bt.PEER]
        peers = [bt.PEER]
        if args.peer_h1:
            port = free_port()
            (tmp / "haproxy-h1.cfg").write_text(haproxy_terminate_cfg(
                port=port, pem=tmp / f"{bt.HOST}.pem", backend_port=rig.ports["node"],
                client_pem=tmp / "ingress.pem", alpn="http/1.1"))
            svc = Service(PEER_H1, haproxy_argv(tmp / "haproxy-h1.cfg"), CORE_PROXY,
                          tmp / "haproxy-h1.log")
            started.append(svc)
            svc.start([port])
            rig.proxies[PEER_H1] = svc
            rig.ports[PEER_H1] = port
            paths.append(PEER_H1)
            peers.append(PEER_H1)
        for name, tree in trees.items():
            port = free_port()
            cfg = tmp / f"{name}.yaml"
            cfg.write_text(yaml.replace(f'127.0.0.1:{rig.ports[bt.SUBJECT]}"',
                                        f'127.0.0.1:{port}"')
                           .replace(f"state_dir: {tmp}/state", f"state_dir: {tmp}/state-{name}"))
            svc = Service(name, python_module("pact_ingress", "serve", "-c", str(cfg)),
                          CORE_PROXY, tmp / f"{name}.log",
                          env={"PYTHONPATH": str(Path(tree).resolve())},
                          cwd=Path(tree).resolve())
            started.append(svc)
            svc.start([port])
            rig.proxies[name] = svc
            rig.ports[name] = port
            paths.append(name)
        # `--lean`, `--lean-epoll`, `--epoll-checked[-h2up]`: the flag is the path's name
        references = [n for n in bt.REFERENCES if getattr(args, n.replace("-", "_"))]
        for ref in references:
            if any(ph.h2 for ph in plan):
                raise SystemExit(f"--{ref} speaks HTTP/1.1 only: leave h2 phases out")
            port = free_port()
            svc = Service(ref, python_module(
                bt.REFERENCES[ref], str(port), str(tmp / f"{bt.HOST}.crt"),
                str(tmp / f"{bt.HOST}.key"), str(rig.ports["node"]),
                str(tmp / "ingress.crt"), str(tmp / "ingress.key")), CORE_PROXY,
                tmp / f"{ref}.log")
            started.append(svc)
            svc.start([port])
            rig.proxies[ref] = svc
            rig.ports[ref] = port
            paths.append(ref)
        for path in paths:  # pools filled, every path proven
            for ph in plan:
                run = bt.run_phase(rig, ph, path, 1.0)
                if not run.units and not run.errors and not run.non2xx:
                    run = bt.run_phase(rig, ph, path, 3.0)  # a slow start on a busy machine
                if run.errors or run.non2xx or not run.units:
                    raise SystemExit(f"warm-up {ph.key} via {path} failed:\n{run.raw}")
        cpu: dict[tuple[str, str], list[float]] = {}
        kernel: dict[tuple[str, str], list[float]] = {}
        segments: dict[tuple[str, str], list[float]] = {}
        for rnd in range(args.rounds):
            for ph in plan:
                for path in paths:
                    pid = rig.proxies[path].pid
                    system = cpu_seconds(pid, part="system")
                    sent = tcp_segments_sent()
                    run = bt.run_phase(rig, ph, path, args.seconds)
                    sent = tcp_segments_sent() - sent
                    system = cpu_seconds(pid, part="system") - system
                    if run.errors or run.non2xx or not run.units:
                        raise SystemExit(f"{ph.key} via {path} failed:\n{run.raw}")
                    us = bt.per_request_us(run)
                    assert us is not None
                    cpu.setdefault((ph.key, path), []).append(us)
                    kernel.setdefault((ph.key, path), []).append(system / run.units * 1e6)
                    segments.setdefault((ph.key, path), []).append(sent / run.units)
                    print(f"round {rnd + 1} {ph.key:5} {path:14} {run.rate:9,.0f}/s "
                          f"{us:8.1f} µs  proxy core {run.core_busy[str(CORE_PROXY)]:.0%}",
                          file=sys.stderr, flush=True)
        names = list(trees) + references
        pairs = [(n, peer) for peer in peers for n in names]
        print("| phase | " + " | ".join(f"{p} (µs)" for p in paths) + " | "
              + " | ".join(f"{n} ÷ {peer}" for n, peer in pairs) + " | "
              + " | ".join(f"{n} ÷ {peer}, paired" for n, peer in pairs) + " |")
        print("|---" * (len(paths) + 2 * len(pairs) + 1) + "|")
        for ph in plan:
            med = {p: statistics.median(cpu[(ph.key, p)]) for p in paths}
            print(f"| {ph.label} | " + " | ".join(f"{med[p]:,.1f}" for p in paths) + " | "
                  + " | ".join(f"{med[n] / med[peer]:.2f}×" for n, peer in pairs) + " | "
                  + " | ".join(paired(cpu[(ph.key, n)], cpu[(ph.key, peer)])
                               for n, peer in pairs) + " |")
        print(f"\nmedian of {args.rounds} rounds of {args.seconds:g} s; load average at "
              f"end {os.getloadavg()[0]:.2f}")
        # where the difference lies: the kernel's work (loopback TCP, epoll) is much the
        # same job for every proxy; the rest is each one's own code in user space
        print("\n| phase | " + " | ".join(f"{p}: user / kernel (µs)" for p in paths) + " |")
        print("|---" * (len(paths) + 1) + "|")
        for ph in plan:
            cells = []
            for p in paths:
                rounds = zip(cpu[(ph.key, p)], kernel[(ph.key, p)], strict=True)
                user = statistics.median(total - sys_us for total, sys_us in rounds)
                cells.append(f"{user:,.1f} / {statistics.median(kernel[(ph.key, p)]):,.1f}")
            print(f"| {ph.label} | " + " | ".join(cells) + " |")
        print("\n| phase | " + " | ".join(f"{p}: TCP segments per request" for p in paths)
              + " |")
        print("|---" * (len(paths) + 1) + "|")
        for ph in plan:
            print(f"| {ph.label} | " + " | ".join(
                f"{statistics.median(segments[(ph.key, p)]):.2f}" for p in paths) + " |")
        for name in (args.profile or "").split(","):
            if name:
                profile(rig, name, phases[args.profile_phase], tmp, args.profile_out)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
