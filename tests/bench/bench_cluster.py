"""Several instances: capacity of two against one, failover after `kill -9`, forwarding.

    python -m tests.bench.bench_cluster                    # every part, about ten minutes
    python -m tests.bench.bench_cluster --quick            # smoke run
    python -m tests.bench.bench_cluster --only capacity,flood --profile
    python -m tests.bench.bench_cluster --only failover,latency,limiter

Needs `redis-server`, `haproxy` and `wrk` (and `py-spy` for `--profile`). Five parts
(`--only` picks some):

1. **capacity** (terminate, HTTP/1.1 keep-alive): `serve` A on 127.0.0.2 pinned to core 0
   and `serve` B on 127.0.0.3 pinned to core 1, one TLS port, both with `state: backend:
   redis` (every request charges the caller's IP in Redis) and one terminate route to the
   same node. The node is HAProxy answering `200` + 1 KiB itself over pinned mutual TLS
   (C, one thread), the load `wrk -t1 -c8` per loaded instance (C; a Lua script points
   it at the instance's address while SNI and Host stay `localhost`). Configurations
   back to back, each round, in alternating order: **one** (only A carries load; wrk,
   the node and redis-server pinned to core 1, B idle), **two** (A and B each under their
   own wrk; wrk, node and redis-server free to run on either core, so they compete with
   the instances) and, for reference, **local** (a third instance L on 127.0.0.4, core
   0, with local state, loaded as A is in "one": what one instance does without Redis).
   Per run: requests/s, each process's CPU from /proc, each core's busy share, the other
   work on the machine (busy time no bench process accounts for), and the rate-limit
   decisions each instance made in Redis (from its admin `/metrics`). The
   capacity of a configuration is its instances' cores × requests per ingress
   CPU-second: what the instances would answer with a whole core each, whatever else
   shares the machine; the raw rate is what this 2-core box delivers with everything
   on it.
2. **flood** (passthrough, no crypto): the canned-ClientHello flood of the passthrough
   bench (`loadgen flood`, 64 connections in flight per instance, Python epoll) to a
   passthrough route whose backend is HAProxy's sink (closes after the hello); same
   instances, same pinning, configurations one and two.
3. **failover**: three `serve` processes (127.0.0.2/.3/.4), one `connect` holding tunnels
   on A and B only (C has none: its callers are always forwarded). Per trial, `kill -9`
   of A, then two probes start at once, one through B (its own tunnel) and one through
   C (forwarded: the registry still names A for up to its TTL, so C may pick the dead A
   first); each makes requests back to back until one succeeds. The time from the kill
   to that first success; then A is restarted, the connector's slot back on it awaited,
   and the registry given 2 s to name A again. p50/p99 over the trials.
4. **latency**: sequential requests (one new TLS connection each) through A (direct: its
   own tunnel) and through C (forwarded), passthrough and terminate.
5. **limiter**: `bench_redis_limiter`'s per-request part: the same terminate request on
   a `serve` with local state and one with Redis state, 4 rounds alternating; latency
   and CPU per request.

`--profile` adds, after capacity and flood, one run of "one" and "two" with py-spy on A
(100 Hz): the shares of its samples by component.

Not a test: nothing is asserted; the tables go to stdout. On a machine shared with other
work, compare the configurations of one run (the "quiet rounds" rows keep only rounds in
which other work took under 0.25 cores), never absolute figures across runs.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pact_ingress.admin.client import request as admin_request
from pact_ingress.identity import keygen
from pact_ingress.model import Address
from tests.bench.bench_passthrough import hello_for
from tests.bench.bench_terminate import BODY_BYTES, parse_wrk
from tests.bench.harness import (
    Service,
    core_busy,
    core_ticks,
    cpu_seconds,
    machine_notes,
    python_module,
    services,
)
from tests.bench.peers import (
    HAPROXY,
    haproxy_argv,
    haproxy_http_backend_cfg,
    haproxy_sink_frontend,
)
from tests.cluster_env import (
    PT_HOST,
    TM_HOST,
    Connect,
    Instance,
    close_all,
    home_node,
    request,
    wait_for,
)
from tests.netutil import free_port_on
from tests.redis_server import RedisServer
from tests.terminate_env import free_port

PARTS = ("capacity", "flood", "failover", "latency", "limiter")
#: The instances of the capacity and flood parts: address, the core each is pinned to, and
#: whether it keeps its state in Redis. The third, with local state, is the reference for
#: what one instance does without a cluster (terminate only).
SCALE_INSTANCES = (("127.0.0.2", 0, True), ("127.0.0.3", 1, True), ("127.0.0.4", 0, False))
#: Configuration → the instances that carry load (indices into SCALE_INSTANCES).
CONFIGS = {"local": (2,), "one": (0,), "two": (0, 1)}
CONFIG_NAMES = {"local": "one instance, local state (core 0)",
                "one": "one instance (core 0)", "two": "two instances (cores 0, 1)"}
#: Configurations per kind, and the ratio columns of its table.
KIND_CONFIGS = {"terminate": ("local", "one", "two"), "flood": ("one", "two")}
KIND_RATIOS = {"terminate": (("two", "one"), ("two", "local")), "flood": (("two", "one"),)}
BOTH_CORES = "0,1"
LOAD_CORE = 1
#: SNI and Host of the terminate requests: wrk takes both from the URL, and `localhost` is
#: the name that resolves here without touching /etc/hosts; the Lua script below points
#: each wrk at its instance's own address.
TM_NAME = "localhost"
FLOOD_SNI = "www.example.test"
HUGE = 1_000_000_000
MAX_CONNS = 4000
WRK_CONNS = 8
FLOOD_INFLIGHT = 64
#: A run is "quiet" when other work on the machine took less than this many cores.
QUIET = 0.25
#: Seconds a run may overrun its own bound before it is treated as hung.
SLACK = 30.0
_WRK_ADDR_LUA = """\
-- connect to the instance's own address; SNI and Host stay those of the URL (wrk resolves
-- and probes the URL's host before any thread starts, so its resolver is replaced)
function wrk.resolve(host, service)
  wrk.addrs = wrk.lookup("{host}", "{port}")
end
function setup(thread)
  thread.addr = wrk.addrs[1]
end
"""


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- capacity and flood: one instance on one core against two, one per core -----------------


def node_cfg(port: int, sink_port: int, pem: Path, client_ca: Path, body: Path) -> str:
    """The cheap upstream, in C: TLS with the node key, every request answered by HAProxy
    itself (the ingress's client certificate requested and checked); and the flood's sink,
    which closes once a complete ClientHello has arrived."""
    return (haproxy_http_backend_cfg(port=port, pem=pem, body=body, alpn="http/1.1",
                                     client_ca=client_ca)
            + haproxy_sink_frontend(sink_port))


def scale_yaml(d: Path, address: str, port: int, admin: int, node_port: int, node_pin: str,
               sink_port: int, state: str) -> str:
    return f"""\
identity: {{key: {d}/ingress.key}}
state_dir: {d}/state
listen:
  tls: ["{address}:{port}"]
  admin: "127.0.0.1:{admin}"
{state}
limits:
  clienthello_timeout: 10s
  idle_timeout: 120s
  max_connections: {MAX_CONNS}
  max_connections_per_ip: {MAX_CONNS}
  calls_per_hour_per_ip_key: {HUGE}
  calls_per_hour_per_ip: {HUGE}
  max_requests_in_flight_per_ip: {MAX_CONNS}
tenants:
  - name: bench
    pins: ["{node_pin}"]
    routes:
      - host: {TM_NAME}
        mode: terminate
        backend: "127.0.0.1:{node_port}"
        seal: optional
        mcp_path: /mcp
        cert: {{cert: {d.parent}/front.crt, key: {d.parent}/front.key}}
      - host: {FLOOD_SNI}
        mode: passthrough
        backend: "127.0.0.1:{sink_port}"
"""


@dataclass
class ScaleRig:
    tmp: Path
    port: int
    instances: list[Service]
    admins: list[Address]
    node: Service
    redis: RedisServer
    hello: Path

    def addresses(self) -> list[str]:
        return [a for a, _, _ in SCALE_INSTANCES]


def build_scale_rig(tmp: Path, started: list[Service], redis: RedisServer) -> ScaleRig:
    key = tmp / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    # deadline 1 s: every decision is made in Redis even on a busy machine (a shorter one
    # would push some into the local fallback and flatter the figures)
    state = (f"state: {{backend: redis, url: '{redis.url}', deadline: 1s, "
             f"encryption_key_file: '{key}'}}")
    node_id = keygen(tmp / "node.key", common_name="bench-node")
    node_pem = tmp / "node.pem"
    node_pem.write_bytes(node_id.cert_path.read_bytes() + node_id.key_path.read_bytes())
    keygen(tmp / "front.key", common_name=TM_NAME)
    body = tmp / "body.txt"
    body.write_bytes(b"o" * (BODY_BYTES - 1) + b"\n")
    port = free_port_on(*(a for a, _, _ in SCALE_INSTANCES))
    node_port, sink_port = free_port(), free_port()
    dirs, idents = [], []
    for address, _, _ in SCALE_INSTANCES:
        d = tmp / address
        d.mkdir()
        dirs.append(d)
        idents.append(keygen(d / "ingress.key", common_name=f"ingress {address}"))
    client_ca = tmp / "instances.pem"  # the node checks either instance's client cert
    client_ca.write_bytes(b"".join(i.cert_path.read_bytes() for i in idents))
    (tmp / "node.cfg").write_text(node_cfg(node_port, sink_port, node_pem, client_ca, body))
    node = Service("node + sink (haproxy)", haproxy_argv(tmp / "node.cfg"), LOAD_CORE,
                   tmp / "node.log")
    started.append(node)
    node.start([node_port, sink_port])
    hello = tmp / "hello.bin"
    hello.write_bytes(hello_for(FLOOD_SNI))
    instances, admins = [], []
    for d, (address, core, shared) in zip(dirs, SCALE_INSTANCES, strict=True):
        admin = free_port()
        (d / "ingress.yaml").write_text(scale_yaml(d, address, port, admin, node_port,
                                                   node_id.fingerprint, sink_port,
                                                   state if shared else ""))
        svc = Service(f"serve {address}", python_module(
            "pact_ingress", "serve", "-c", str(d / "ingress.yaml")), core, d / "serve.log")
        started.append(svc)
        svc.start([port], host=address)
        instances.append(svc)
        admins.append(Address("127.0.0.1", admin))
    rig = ScaleRig(tmp, port, instances, admins, node, redis, hello)
    for admin, (_, _, shared) in zip(admins, SCALE_INSTANCES, strict=True):
        want = "shared" if shared else "local"
        wait_for(lambda a=admin, w=want: _state_mode(a) == w, f"an instance's state: {want}")
    return rig


def _state_mode(admin: Address) -> str | None:
    try:
        status, body = admin_request(admin, "GET", "/status")
        return json.loads(body)["state"]["mode"] if status == 200 else None
    except Exception:
        return None


def _decisions(admin: Address) -> dict[str, float]:
    """`pact_ingress_rate_limit_decisions_total` by `where` (shared / fallback)."""
    _, body = admin_request(admin, "GET", "/metrics")
    out: dict[str, float] = {}
    for m in re.finditer(r'^pact_ingress_rate_limit_decisions_total\{where="(\w+)"\} (\S+)$',
                         body.decode(), re.M):
        out[m[1]] = float(m[2])
    return out


def repin(pid: int, cores: str) -> None:
    """Move a running process, every thread of it, to `cores`."""
    subprocess.run(["taskset", "-a", "-pc", cores, str(pid)], stdout=subprocess.DEVNULL,
                   check=True, timeout=10)


@dataclass
class ScaleRun:
    config: str  # a key of CONFIGS
    units: int
    errors: int
    non2xx: int
    rate: float  # units/s: the sum of the generators' own rates
    wall: float  # the measured window (start of the first to end of the last generator)
    ingress_cpu: list[float]  # per loaded instance
    idle_cpu: float  # the instances without load
    node_cpu: float
    redis_cpu: float
    client_cpu: float
    busy: dict[str, float]
    shared: float = 0.0  # rate-limit decisions made in Redis during the run
    fallback: float = 0.0
    raw: list[str] = field(default_factory=list)

    @property
    def cpu_per_unit_us(self) -> float:
        return sum(self.ingress_cpu) / self.units * 1e6 if self.units else float("nan")

    @property
    def capacity(self) -> float:
        """Units/s the loaded instances would handle with a whole core each."""
        return len(self.ingress_cpu) * 1e6 / self.cpu_per_unit_us

    @property
    def ours(self) -> float:
        """CPU seconds of every process of the bench (instances, node, redis, clients)."""
        return sum(self.ingress_cpu) + self.idle_cpu + self.node_cpu + self.redis_cpu + \
            self.client_cpu

    @property
    def foreign(self) -> float:
        """Cores' worth of other work on the machine during the run: busy time of both
        cores that none of the bench's processes account for (other users' processes,
        and kernel work not charged to a process)."""
        return max(0.0, sum(self.busy.values()) - self.ours / self.wall)

    @property
    def all_cpu_per_unit_us(self) -> float:
        return self.ours / self.units * 1e6 if self.units else float("nan")


def _children_cpu() -> float:
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return c.ru_utime + c.ru_stime


def _run_generators(argvs: list[list[str]], bound: float) -> tuple[list[str], float]:
    """Start every generator at once, wait for all; (their stdout, wall seconds)."""
    started = time.monotonic()
    procs = [subprocess.Popen(a, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for a in argvs]
    outs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=bound + SLACK)
            if proc.returncode != 0:
                raise RuntimeError(f"load generator failed ({proc.returncode}): "
                                   f"{err.decode(errors='replace')[-1500:]}")
            outs.append(out.decode(errors="replace"))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outs, time.monotonic() - started


def scale_run(rig: ScaleRig, kind: str, config: str, seconds: float) -> ScaleRun:
    """One run of `kind` (terminate | flood) in `config` (a key of CONFIGS). With one
    instance loaded, everything else of the bench is pinned to the other core; with two,
    it may run on either."""
    loaded = CONFIGS[config]
    load_cores = str(LOAD_CORE) if len(loaded) == 1 else BOTH_CORES
    for pid in (rig.node.pid, rig.redis.proc.pid):  # type: ignore[union-attr]
        repin(pid, load_cores)
    argvs = []
    for address in (SCALE_INSTANCES[i][0] for i in loaded):
        if kind == "terminate":
            lua = rig.tmp / f"wrk-{address}.lua"
            lua.write_text(_WRK_ADDR_LUA.format(host=address, port=rig.port))
            argv = ["wrk", "-t1", f"-c{WRK_CONNS}", f"-d{max(1, round(seconds))}s",
                    "--timeout", "10s", "-s", str(lua), f"https://{TM_NAME}:{rig.port}/"]
        else:
            argv = python_module("tests.bench.loadgen", "flood", "--host", address,
                                 "--port", str(rig.port), "--hello", str(rig.hello),
                                 "--inflight", str(FLOOD_INFLIGHT), "--seconds", str(seconds))
        argvs.append(["taskset", "-c", load_cores, *argv])
    pids = {"node": rig.node.pid, "redis": rig.redis.proc.pid}  # type: ignore[union-attr]
    pids.update({f"i{n}": svc.pid for n, svc in enumerate(rig.instances)})
    before = {k: cpu_seconds(v) for k, v in pids.items()}
    admins = [rig.admins[i] for i in loaded] if kind == "terminate" else []
    dec0 = [_decisions(a) for a in admins]
    client0, ticks0 = _children_cpu(), core_ticks()
    outs, wall = _run_generators(argvs, seconds)
    busy = core_busy(ticks0, core_ticks())
    client = _children_cpu() - client0
    used = {k: cpu_seconds(v) - before[k] for k, v in pids.items()}
    for svc in (*rig.instances, rig.node):
        if not svc.alive():
            raise RuntimeError(f"{svc.name} died during {kind}/{config}:\n{svc.log_tail()}")
    units = errors = non2xx = 0
    rate = 0.0
    for out in outs:
        if kind == "terminate":
            r = parse_wrk(out)
            units, errors, non2xx = units + r["requests"], errors + r["errors"], \
                non2xx + r["non2xx"]
            rate += r["requests"] / r["elapsed"] if r["elapsed"] else 0.0
        else:
            r = json.loads(out.strip().splitlines()[-1])
            units, errors = units + r["units"], errors + r["errors"]
            rate += r["units"] / r["elapsed"] if r["elapsed"] else 0.0
    run = ScaleRun(config, units, errors, non2xx, rate, wall,
                   [used[f"i{n}"] for n in loaded],
                   sum(used[f"i{n}"] for n in range(len(rig.instances)) if n not in loaded),
                   used["node"], used["redis"], client, busy, raw=outs)
    if kind == "terminate":
        for a, d0 in zip(admins, dec0, strict=True):
            d1 = _decisions(a)
            run.shared += d1.get("shared", 0) - d0.get("shared", 0)
            run.fallback += d1.get("fallback", 0) - d0.get("fallback", 0)
    return run


def measure_scale(rig: ScaleRig, kind: str, rounds: int, seconds: float, warmup: float
                  ) -> dict[str, list[ScaleRun]]:
    configs = KIND_CONFIGS[kind]
    for config in configs:
        scale_run(rig, kind, config, warmup)
    runs: dict[str, list[ScaleRun]] = {c: [] for c in configs}
    for rnd in range(rounds):
        # alternate the order: a machine that gets busier during the run hurts all alike
        for config in (configs if rnd % 2 == 0 else configs[::-1]):
            run = scale_run(rig, kind, config, seconds)
            runs[config].append(run)
            log(f"{kind} round {rnd + 1}/{rounds} {config}: {run.rate:,.0f}/s, "
                f"ingress {run.cpu_per_unit_us:.0f} µs each, capacity {run.capacity:,.0f}/s, "
                f"err={run.errors} non2xx={run.non2xx} shared={run.shared:.0f} "
                f"fallback={run.fallback:.0f}, other work {run.foreign:.2f} cores, cores "
                + " ".join(f"{c}:{b:.0%}" for c, b in run.busy.items()))
    return runs


def _spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}–{format(max(values), fmt)})"


def scale_table(kind: str, runs: dict[str, list[ScaleRun]]) -> str:
    unit = "req" if kind == "terminate" else "conn"
    configs, ratios = KIND_CONFIGS[kind], KIND_RATIOS[kind]
    rows: list[tuple[str, Callable[[ScaleRun], float], str]] = [
        (f"{unit}/s, raw (all on this 2-core machine)", lambda r: r.rate, ",.0f"),
        (f"ingress CPU per {unit} (µs)", lambda r: r.cpu_per_unit_us, ",.0f"),
        ("ingress cores busy (CPU s ÷ wall s, summed)",
         lambda r: sum(r.ingress_cpu) / r.wall, ".2f"),
        (f"capacity: instances × {unit}s per ingress CPU-second ({unit}/s)",
         lambda r: r.capacity, ",.0f"),
        (f"every process's CPU per {unit} (µs: ingress + node + redis + client)",
         lambda r: r.all_cpu_per_unit_us, ",.0f"),
        ("redis-server CPU per unit (µs)", lambda r: r.redis_cpu / r.units * 1e6, ".1f"),
        ("load generator CPU per unit (µs)", lambda r: r.client_cpu / r.units * 1e6, ".1f"),
        ("other work on the machine meanwhile (cores, of 2)", lambda r: r.foreign, ".2f"),
    ]
    head = [kind, *(CONFIG_NAMES[c] for c in configs), *(f"{a} ÷ {b}" for a, b in ratios)]
    lines = ["| " + " | ".join(head) + " |",
             "| --- |" + " ---: |" * (len(head) - 1)]
    for name, get, fmt in rows:
        values = {c: [get(r) for r in runs[c]] for c in configs}
        cells = [_spread(values[c], fmt) for c in configs]
        for a, b in ratios:
            den = statistics.median(values[b])
            cells.append(f"{statistics.median(values[a]) / den:.2f}×" if den else "–")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    # the ratio's own spread: each round's quotient of the same round's runs
    for name, get in ((f"{unit}/s, raw", lambda r: r.rate), ("capacity", lambda r: r.capacity)):
        cells = []
        for a, b in ratios:
            per_round = [get(x) / get(y) for x, y in zip(runs[a], runs[b], strict=True)]
            cells.append(f"{_spread(per_round, '.2f')}×")
        lines.append(f"| {name}, quotient per round |" + " |" * len(configs) + " "
                     + " | ".join(cells) + " |")
    # rounds in which other work took little of the machine in both runs compared: a
    # single pinned instance shares its core with whatever else runs there, and its CPU
    # per unit rises with it (caches, preemption), which flatters the ratio
    for name, get in ((f"{unit}/s, raw", lambda r: r.rate), ("capacity", lambda r: r.capacity)):
        cells = []
        for a, b in ratios:
            quiet = [get(x) / get(y) for x, y in zip(runs[a], runs[b], strict=True)
                     if x.foreign < QUIET and y.foreign < QUIET]
            cells.append(f"{_spread(quiet, '.2f')}× ({len(quiet)} of {len(runs[a])})"
                         if quiet else f"– (0 of {len(runs[a])})")
        lines.append(f"| {name}, quotient in quiet rounds (other work < {QUIET:g} cores) |"
                     + " |" * len(configs) + " " + " | ".join(cells) + " |")
    notes = []
    for cfg, rs in runs.items():
        errs = sum(r.errors + r.non2xx for r in rs)
        if errs:
            notes.append(f"{cfg}: {errs} errors or non-2xx responses")
        fb = sum(r.fallback for r in rs)
        if kind == "terminate":
            share = sum(r.shared for r in rs) / max(1, sum(r.units for r in rs))
            notes.append(f"{cfg}: rate-limit decisions made in Redis per request: "
                         f"{share:.2f}" + (f", {fb:.0f} in the local fallback" if fb else ""))
        cores = {c: statistics.median(r.busy[c] for r in rs) for c in rs[0].busy}
        notes.append(f"{cfg}: cores busy (median) " +
                     ", ".join(f"core {c} {b:.0%}" for c, b in cores.items()) +
                     f"; the instances without load used "
                     f"{statistics.median(r.idle_cpu / r.wall for r in rs):.1%} of a core")
    return "\n".join(lines + [""] + [f"- {n}" for n in notes])


#: py-spy sampling rate (Hz) for `--profile`: low, since it pauses the process per sample.
PROFILE_RATE = 100
#: Where a sample's innermost frame lies, first match wins; the rest by the terminate
#: bench's components.
_OWN_PARTS = (("pact_ingress/state/", "pact-ingress state/ (Redis limiter client)"),
              ("pact_ingress/net/", "pact-ingress net/ (router, terminate, upstream)"),
              ("pact_ingress/proto/", "pact-ingress proto/"),
              ("pact_ingress/", "pact-ingress (other)"))


def _component(filename: str) -> str:
    from tests.bench.bench_terminate import component

    for needle, name in _OWN_PARTS:
        if needle in filename:
            return name
    return component(filename)


def profile_instance(rig: ScaleRig, kind: str, config: str, seconds: float
                     ) -> tuple[ScaleRun, dict[str, float], float, int]:
    """One run of `config` with py-spy sampling instance A: (the run, self share by
    component, inclusive share of the state/ package, samples)."""
    from tests.bench.bench_terminate import _task_frames, parse_collapsed

    out = rig.tmp / f"py-spy-{kind}-{config}.txt"
    spy = subprocess.Popen(
        ["py-spy", "record", "--pid", str(rig.instances[0].pid), "--duration",
         f"{seconds + 1:g}", "--rate", str(PROFILE_RATE), "--full-filenames", "--format",
         "raw", "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)  # attached before the load starts
    run = scale_run(rig, kind, config, seconds)
    try:
        spy.wait(seconds + SLACK)
    except subprocess.TimeoutExpired:
        spy.kill()
        spy.wait()
    stacks = parse_collapsed(out.read_text()) if out.exists() else []
    total = sum(n for _, n in stacks) or 1
    own: Counter[str] = Counter()
    state = 0
    for frames, n in stacks:
        if frames:
            own[_component(frames[-1][1])] += n
            if any("pact_ingress/state/" in f for _, f in _task_frames(frames)):
                state += n
    return run, {k: v / total for k, v in own.most_common()}, state / total, total


def profile_table(kind: str, profiles: dict[str, tuple[ScaleRun, dict[str, float], float,
                                                         int]]) -> str:
    one, two = profiles["one"], profiles["two"]
    lines = [f"| instance A under {kind}, py-spy {PROFILE_RATE} Hz (self share) | one | two |",
             "| --- | ---: | ---: |"]
    for comp in sorted(set(one[1]) | set(two[1]), key=lambda c: -one[1].get(c, 0.0)):
        lines.append(f"| {comp} | {one[1].get(comp, 0.0):.1%} | {two[1].get(comp, 0.0):.1%} |")
    lines.append(f"| inclusive: any frame in pact-ingress state/ | {one[2]:.1%} | {two[2]:.1%} |")
    lines.append(f"| samples | {one[3]:,} | {two[3]:,} |")
    lines.append(f"| ingress CPU per unit in the profiled run (µs) | "
                 f"{one[0].cpu_per_unit_us:,.0f} | {two[0].cpu_per_unit_us:,.0f} |")
    return "\n".join(lines)


def part_scale(tmp: Path, kinds: list[str], rounds: int, seconds: float, warmup: float,
               profile: bool = False) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with services() as started:
        redis = RedisServer(tmp / "redis-scale")
        try:
            rig = build_scale_rig(tmp, started, redis)
            log(f"scale rig up: instances on {rig.addresses()}:{rig.port}")
            for kind in kinds:
                runs = measure_scale(rig, kind, rounds, seconds, warmup)
                out[kind] = runs
                print(f"\n### {kind}: one instance against two ({rounds} rounds of "
                      f"{seconds:g} s, median (min–max))\n", flush=True)
                print(scale_table(kind, runs), flush=True)
                if profile:
                    profiles = {c: profile_instance(rig, kind, c, seconds)
                                for c in ("one", "two")}
                    print("\n" + profile_table(kind, profiles), flush=True)
        finally:
            redis.stop()
    return out


# --- failover and latency: three instances, one connector ---------------------------------


def _first_success(instance: Instance, host: str, since: float, out: list[float],
                   limit: float = 30.0) -> None:
    while time.monotonic() - since < limit:
        if request(instance, host, timeout=5) == 200:
            out.append(time.monotonic() - since)
            return
    out.append(float("inf"))


def part_cluster(tmp: Path, parts: list[str], trials: int, samples: int) -> None:
    redis = RedisServer(tmp / "redis")
    key = tmp / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    node = home_node(tmp)
    port = free_port_on("127.0.0.2", "127.0.0.3", "127.0.0.4")
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

        if "failover" in parts:
            direct: list[float] = []
            forwarded: list[float] = []
            for trial in range(trials):
                killed = time.monotonic()
                a.kill()
                probes = [threading.Thread(target=_first_success, args=(i, PT_HOST, killed, o))
                          for i, o in ((b, direct), (c, forwarded))]
                for t in probes:
                    t.start()
                for t in probes:
                    t.join()
                log(f"failover trial {trial + 1}/{trials}: B {direct[-1]:.3f} s, "
                    f"C {forwarded[-1]:.3f} s")
                a.start()
                wait_for(lambda: a.tunnels_up() >= 1, "the connector back on A", timeout=60)
                wait_for(lambda: request(a, PT_HOST) == 200, "A serving again")
                # C must know A again, or the next trial would start from a registry
                # without A in it (a different situation)
                time.sleep(2.0)
            print(f"\n### Failover after kill -9 of A ({trials} trials), seconds from the "
                  "kill to the first successful request (both probes start at the kill)\n")
            print("| via | p50 | p99 | max |")
            print("| --- | ---: | ---: | ---: |")
            for name, values in (("B (own tunnel)", direct), ("C (forwarded)", forwarded)):
                print(f"| {name} | {_pct(values, .5):.3f} | {_pct(values, .99):.3f} "
                      f"| {max(values):.3f} |", flush=True)

        if "latency" in parts:
            print(f"\n### Request latency, {samples} sequential requests (new TLS connection "
                  "each)\n")
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
                          f"| {_pct(times, .99):.2f} | {dict(failed) or 0} |", flush=True)
    finally:
        close_all(connect, instances)
        redis.stop()
        node.stop()


def part_limiter(tmp: Path, requests: int, rounds: int) -> None:
    from tests.bench.bench_redis_limiter import part_requests, table

    redis = RedisServer(tmp / "redis-limiter")
    try:
        repin(redis.proc.pid, str(LOAD_CORE))  # type: ignore[union-attr]
        rows = part_requests(redis, tmp / "limiter", requests, rounds)
    finally:
        redis.stop()
    print()
    print(table(f"Terminate request, keep-alive, node offline ({rounds} × {requests:,} "
                "requests per state, alternating; median, CPU spread in brackets)", rows),
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smoke run")
    parser.add_argument("--only", help="comma-separated parts: " + ",".join(PARTS))
    parser.add_argument("--rounds", type=int, help="capacity/flood rounds (default 5)")
    parser.add_argument("--seconds", type=float, help="capacity/flood run length (default 5)")
    parser.add_argument("--trials", type=int, help="failover trials (default 12)")
    parser.add_argument("--profile", action="store_true",
                        help="after capacity/flood: one run of each configuration with "
                             "py-spy on instance A, shares by component")
    args = parser.parse_args()
    parts = args.only.split(",") if args.only else list(PARTS)
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    needed = ["redis-server"]
    if {"capacity", "flood"} & set(parts):
        needed += [HAPROXY, "wrk", "taskset"] + (["py-spy"] if args.profile else [])
    missing = [tool for tool in needed if shutil.which(tool) is None]
    if missing:
        parser.error(f"not found: {', '.join(missing)} (apt-get install redis-server haproxy "
                     "wrk util-linux; pip install py-spy)")
    rounds = args.rounds or (1 if args.quick else 5)
    seconds = args.seconds or (2.0 if args.quick else 5.0)
    trials = args.trials or (3 if args.quick else 12)
    samples = 30 if args.quick else 300
    load1, load5, _ = os.getloadavg()
    print(f"- {machine_notes()[0]}; load average at start {load1:.2f} (1 min), "
          f"{load5:.2f} (5 min)", flush=True)
    with tempfile.TemporaryDirectory(prefix="pact-bench-cluster-") as tmp_name:
        tmp = Path(tmp_name)
        kinds = [k for k, part in (("terminate", "capacity"), ("flood", "flood"))
                 if part in parts]
        if kinds:
            (tmp / "scale").mkdir()
            part_scale(tmp / "scale", kinds, rounds, seconds, 1.0 if args.quick else 2.0,
                       args.profile)
        if "failover" in parts or "latency" in parts:
            (tmp / "cluster").mkdir()
            part_cluster(tmp / "cluster", parts, trials, samples)
        if "limiter" in parts:
            (tmp / "limiter").mkdir()
            part_limiter(tmp, 1_000 if args.quick else 5_000, 1 if args.quick else 4)
    load1, _, _ = os.getloadavg()
    print(f"\n- load average at the end {load1:.2f} (1 min)")


if __name__ == "__main__":
    main()
