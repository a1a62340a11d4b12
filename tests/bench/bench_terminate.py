"""Terminate-mode benchmark: direct vs HAProxy vs pact-ingress, side by side in one run.

    python -m tests.bench.bench_terminate [--quick] [--json out.json] [--no-profile]

It measures keep-alive requests/s and the new-connection rate through terminate +
pinned re-origination, next to HAProxy doing terminate + re-encrypt to the same backend,
with the proxy CPU per request judged against the goals (per keep-alive HTTP/1.1 request
≤ 4× HAProxy's, per new TLS connection ≤ 1.5×, per HTTP/2 request ≤ 200 µs) and a
profile of where pact-ingress's time goes. This module runs all of that in one go.

What runs where (2 cores, `harness.CORE_PROXY` / `harness.CORE_LOAD`):

| core | processes |
| --- | --- |
| 0 | the proxies: HAProxy (`mode http`, one thread), pact-ingress (`python -m pact_ingress serve`) and the hypercorn reference, all started once; only one carries load at a time |
| 1 | the home node (HAProxy answering every request itself: `200` + 1 KiB body, TLS with the node key the ingress pins), the clients (`wrk`, `h2load`), this orchestrator, and py-spy while profiling |

Paths, each carrying the same load to the same node:

- **direct**: the client talks TLS to the node itself (context: what the node alone costs);
- **haproxy**: TLS ends at HAProxy, which re-encrypts to the node, presenting the ingress
  identity as client certificate, ALPN as the node offers, `http-reuse always`;
- **pact-ingress**: TLS ends at pact-ingress's terminate route (its own HTTP/1.1 and
  HTTP/2 legs, `net/http1.py` on llhttp and `net/http2.py`), which re-originates over its
  own pinned mutual-TLS HTTP/1.1 pool (`net/upstream.py`) to the node.
- **hypercorn alone** (reference, on the proxy core): hypercorn's own server (trio
  worker, TLS) answering the same 200 + 1 KiB from a trivial ASGI app, no upstream at
  all: what a Python HTTP server on trio costs here by itself, before a single byte is
  re-originated.

The node requests a client certificate (`verify optional`, trust anchor = the ingress's
self-signed identity cert, which both proxies present), so the proxy→node link is real
mutual TLS; a direct client without a certificate is let in. The route is `seal:
optional` and the requests are plain `GET /` (not the MCP path), so nothing is refused by
posture; the per-IP budgets are set far above anything a run can spend, and every phase
checks that no response was anything but 2xx (so no 429 was counted as a request).

Clients: `wrk` (HTTP/1.1, one thread, `-c 1` / `-c 8`) for keep-alive and, with
`Connection: close`, for new connections (a TLS 1.3 handshake each, resumed: wrk keeps a
slot's session across reconnects and offers its ticket, which HAProxy and the edge both
accept); `h2load` (HTTP/2, 8 connections, one stream each) when installed. The SNI and
Host are `localhost` (wrk and h2load take both from the URL; `localhost` is the one name
that resolves here without touching /etc/hosts).

CPU: `harness.CpuMeter` reads /proc before and after each run; "µs per request" is the
proxy process's CPU ÷ requests answered. The profile is a separate keep-alive run under
`py-spy record` (sampling from the load core), summarised by the module of the innermost
Python frame ("self") and by the share of samples a module is anywhere on the stack
("inclusive"). Its figures are shares of the ingress's busy time, not extra CPU.

Why a hypercorn-alone column: the goals are judged against C; the reference shows how
much of the gap any Python HTTP front on trio pays and how much is pact-ingress's own
work (checks, re-origination).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.bench.harness import (
    CORE_LOAD,
    CORE_PROXY,
    LOAD_SLACK,
    Check,
    Comparison,
    CpuMeter,
    Row,
    Service,
    Target,
    core_busy,
    core_ticks,
    cores_available,
    cpu_seconds,
    free_port,
    machine_notes,
    pin_self,
    pinned,
    python_module,
    services,
    tool_version,
)
from tests.bench.peers import (
    HAPROXY,
    haproxy_argv,
    haproxy_http_backend_cfg,
    haproxy_terminate_cfg,
    make_tls_pem,
)

WRK = "wrk"
H2LOAD = "h2load"
PY_SPY = "py-spy"
DIRECT, PEER, SUBJECT = "direct", "haproxy", "pact-ingress"
#: Reference: hypercorn on its own (trio worker, TLS) answering from a trivial ASGI app,
#: no upstream at all: the floor of pact-ingress's front on this machine.
FLOOR = "hypercorn alone"
PATHS = (DIRECT, PEER, SUBJECT, FLOOR)
PROXIES = (PEER, SUBJECT, FLOOR)
#: SNI and Host of every request: must resolve to 127.0.0.1 for wrk / h2load.
HOST = "localhost"
#: The reference proxies `ab_terminate` and `callgrind_terminate` can put beside the
#: trees (each run as `python -m MODULE PORT CERT KEY NODE_PORT CLIENT_CERT CLIENT_KEY`):
#: path name -> module. The plain trio proxy, the same job on one epoll loop, and that
#: loop with the product's per-request work.
REFERENCES = {"lean": "tests.bench.lean_proxy", "lean-epoll": "tests.bench.lean_epoll_proxy",
              "epoll-checked": "tests.bench.epoll_checked_proxy",
              "epoll-checked-h2up": "tests.bench.epoll_checked_h2up_proxy"}
#: Size of the node's answer body ("a 1 KiB-ish response").
BODY_BYTES = 1024
#: Budgets nothing in a run can exhaust: the limiter is charged but never refuses.
HUGE_BUDGET = 1_000_000_000
INGRESS_MAX_CONNECTIONS = 4000
#: A core busier than this during a run was (close to) the bottleneck.
LOAD_BOUND = 0.9
#: py-spy sampling rate (Hz). It stops the ingress for each sample (consistent stacks;
#: `--nonblocking` lost a third of them to torn reads here), so the rate is kept low.
PROFILE_RATE = 100
#: Rows of the profile's "hottest functions" table.
PROFILE_TOP = 15
#: The goals, on the proxy's CPU (the like-for-like job: HAProxy in HTTP mode with a Host
#: check and a pooled upstream): per keep-alive HTTP/1.1 request at most 4× HAProxy's,
#: per new TLS connection (one request) at most 1.5×. HTTP/2's goal is absolute
#: (`H2_GOAL_US`), judged in the notes.
KEEPALIVE_CPU_GOAL = Target(max_ratio=4.0)
NEW_CONN_CPU_GOAL = Target(max_ratio=1.5)
#: µs of proxy CPU per keep-alive HTTP/2 request (8 connections).
H2_GOAL_US = 200.0


@dataclass(frozen=True)
class Settings:
    seconds: float  # length of each timed run
    rounds: int  # each figure is the median over rounds
    warmup: float  # seconds of keep-alive load per path before measuring
    profile_seconds: float  # py-spy recording length (0: no profile)


FULL = Settings(seconds=5.0, rounds=2, warmup=1.0, profile_seconds=6.0)
QUICK = Settings(seconds=2.0, rounds=1, warmup=0.5, profile_seconds=3.0)


@dataclass(frozen=True)
class Phase:
    key: str
    label: str
    conns: int
    new_conns: bool = False  # `Connection: close`: one TLS handshake per request
    h2: bool = False  # h2load over HTTP/2 instead of wrk over HTTP/1.1


PHASES = (
    Phase("ka1", "keep-alive, 1 conn", 1),
    Phase("ka8", "keep-alive, 8 conns", 8),
    Phase("ka32", "keep-alive, 32 conns", 32),
    Phase("h2ka8", "keep-alive HTTP/2, 8 conns", 8, h2=True),
    Phase("new1", "new TLS conn + 1 request, 1 client", 1, new_conns=True),
    Phase("new8", "new TLS conn + 1 request, 8 clients", 8, new_conns=True),
)


# --- clients ---------------------------------------------------------------------------------


@dataclass
class ClientRun:
    """One client run, in the shape `run_phase` and the report need."""

    units: int  # requests answered with 2xx
    errors: int  # socket errors, failed requests
    non2xx: int
    elapsed: float
    rate: float
    bytes_read: int
    client_cpu: float
    core_busy: dict[str, float]
    proxy_cpu: float | None = None
    node_cpu: float = 0.0
    raw: str = ""


_SIZE = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30}
_TIME = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0}


def wrk_argv(url: str, conns: int, seconds: float, close: bool) -> list[str]:
    # wrk takes whole seconds only.
    argv = [WRK, "-t1", f"-c{conns}", f"-d{max(1, round(seconds))}s", "--timeout", "10s"]
    if close:
        argv += ["-H", "Connection: close"]
    return [*argv, url]


def parse_wrk(text: str) -> dict[str, Any]:
    """Requests, seconds, bytes, errors and non-2xx count from wrk's summary."""
    m = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m), ([\d.]+)([KMG]?B) read", text)
    if m is None:
        raise ValueError(f"unexpected wrk output:\n{text}")
    requests = int(m.group(1))
    elapsed = float(m.group(2)) * _TIME[m.group(3)]
    nbytes = int(float(m.group(4)) * _SIZE[m.group(5)])
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)",
                     text)
    errors = sum(int(x) for x in sock.groups()) if sock else 0
    non2xx_m = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    non2xx = int(non2xx_m.group(1)) if non2xx_m else 0
    return {"requests": requests - non2xx, "elapsed": elapsed, "bytes": nbytes,
            "errors": errors, "non2xx": non2xx}


def h2load_argv(url: str, conns: int, seconds: float) -> list[str]:
    return [H2LOAD, "-t1", f"-c{conns}", "-m1", f"-D{max(1, round(seconds))}", url]


def parse_h2load(text: str) -> dict[str, Any]:
    fin = re.search(r"finished in ([\d.]+)(us|ms|s|m),", text)
    req = re.search(r"requests: \d+ total, \d+ started, \d+ done, (\d+) succeeded, "
                    r"(\d+) failed, (\d+) errored, (\d+) timeout", text)
    codes = re.search(r"status codes: (\d+) 2xx, (\d+) 3xx, (\d+) 4xx, (\d+) 5xx", text)
    traffic = re.search(r"traffic: [\d.]+[KMG]?B \((\d+)\) total", text)
    if fin is None or req is None or codes is None:
        raise ValueError(f"unexpected h2load output:\n{text}")
    ok2xx = int(codes.group(1))
    return {"requests": ok2xx, "elapsed": float(fin.group(1)) * _TIME[fin.group(2)],
            "bytes": int(traffic.group(1)) if traffic else 0,
            "errors": sum(int(x) for x in req.groups()[1:]),
            "non2xx": sum(int(x) for x in codes.groups()[1:])}


def _children_cpu() -> float:
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return c.ru_utime + c.ru_stime


def run_client(argv: Sequence[str], parse: Callable[[str], dict[str, Any]], seconds: float
               ) -> ClientRun:
    """Run a client to completion on the load core; its figures plus both cores' load."""
    cpu0, ticks0 = _children_cpu(), core_ticks()
    res = subprocess.run(pinned(argv, CORE_LOAD), capture_output=True,
                         timeout=seconds + LOAD_SLACK, check=False)
    busy = core_busy(ticks0, core_ticks())
    text = res.stdout.decode(errors="replace")
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({res.returncode}):\n{text}\n"
                           f"{res.stderr.decode(errors='replace')[-2000:]}")
    p = parse(text)
    return ClientRun(units=p["requests"], errors=p["errors"], non2xx=p["non2xx"],
                     elapsed=p["elapsed"],
                     rate=p["requests"] / p["elapsed"] if p["elapsed"] else 0.0,
                     bytes_read=p["bytes"], client_cpu=_children_cpu() - cpu0,
                     core_busy=busy, raw=text)


# --- the rig ---------------------------------------------------------------------------------


@dataclass
class Rig:
    tmp: Path
    ports: dict[str, int]  # node and each of PROXIES
    proxies: dict[str, Service]
    node: Service
    upstream_alpn: str
    notes: list[str] = field(default_factory=list)

    def url(self, path: str) -> str:
        port = self.ports["node" if path == DIRECT else path]
        return f"https://{HOST}:{port}/"


def ingress_yaml(tmp: Path, port: int, node_port: int, node_pin: str,
                 admin_port: int | None = None) -> str:
    """One tenant, one terminate route for `localhost` to the node, pinned to its key."""
    admin = f'\n  admin: "127.0.0.1:{admin_port}"' if admin_port else ""
    return f"""\
identity:
  key: {tmp}/ingress.key
state_dir: {tmp}/state
listen:
  tls: ["127.0.0.1:{port}"]{admin}
limits:
  clienthello_timeout: 10s
  idle_timeout: 120s
  max_connections: {INGRESS_MAX_CONNECTIONS}
  max_connections_per_ip: {INGRESS_MAX_CONNECTIONS}
  calls_per_hour_per_ip_key: {HUGE_BUDGET}
  calls_per_hour_per_ip: {HUGE_BUDGET}
  max_requests_in_flight_per_ip: {INGRESS_MAX_CONNECTIONS}
tenants:
  - name: bench
    pins: ["{node_pin}"]
    routes:
      - host: {HOST}
        mode: terminate
        backend: "127.0.0.1:{node_port}"
        seal: optional
        mcp_path: /mcp
        cert: {{cert: {tmp}/{HOST}.crt, key: {tmp}/{HOST}.key}}
"""


def build_rig(tmp: Path, started: list[Service], upstream_alpn: str) -> Rig:
    from pact_ingress.identity import keygen

    ports = {"node": free_port(), **{name: free_port() for name in PROXIES}}
    ingress_id = keygen(tmp / "ingress.key", common_name="pact-ingress-bench")
    ingress_pem = tmp / "ingress.pem"  # the same client identity for both proxies
    ingress_pem.write_bytes(ingress_id.cert_path.read_bytes() +
                            ingress_id.key_path.read_bytes())
    node_id = keygen(tmp / "node.key", common_name="bench-node")
    node_pem = tmp / "node.pem"
    node_pem.write_bytes(node_id.cert_path.read_bytes() + node_id.key_path.read_bytes())
    front_pem = make_tls_pem(tmp, HOST)  # localhost.key/.crt/.pem: both proxies' front cert
    body = tmp / "body.txt"
    body.write_bytes(b"o" * (BODY_BYTES - 1) + b"\n")

    (tmp / "node.cfg").write_text(haproxy_http_backend_cfg(
        port=ports["node"], pem=node_pem, body=body, alpn=upstream_alpn,
        client_ca=ingress_id.cert_path))
    (tmp / "haproxy.cfg").write_text(haproxy_terminate_cfg(
        port=ports[PEER], pem=front_pem, backend_port=ports["node"], client_pem=ingress_pem,
        alpn=upstream_alpn))
    (tmp / "ingress.yaml").write_text(
        ingress_yaml(tmp, ports[SUBJECT], ports["node"], node_id.fingerprint))

    node = Service("node (haproxy)", haproxy_argv(tmp / "node.cfg"), CORE_LOAD,
                   tmp / "node.log")
    started.append(node)
    node.start([ports["node"]])
    haproxy = Service("haproxy", haproxy_argv(tmp / "haproxy.cfg"), CORE_PROXY,
                      tmp / "haproxy.log")
    started.append(haproxy)
    haproxy.start([ports[PEER]])
    ingress = Service("pact-ingress (serve)", python_module(
        "pact_ingress", "serve", "-c", str(tmp / "ingress.yaml")), CORE_PROXY,
        tmp / "ingress.log")
    started.append(ingress)
    ingress.start([ports[SUBJECT]])
    floor = Service("hypercorn alone", [sys.executable, "-m", "hypercorn", "-k", "trio",
                                        "--certfile", str(tmp / f"{HOST}.crt"),
                                        "--keyfile", str(tmp / f"{HOST}.key"),
                                        "-b", f"127.0.0.1:{ports[FLOOR]}",
                                        "--log-level", "warning", FLOOR_APP],
                    CORE_PROXY, tmp / "floor.log")
    started.append(floor)
    floor.start([ports[FLOOR]])
    return Rig(tmp, ports, {PEER: haproxy, SUBJECT: ingress, FLOOR: floor}, node,
               upstream_alpn)


# --- the floor: hypercorn answering by itself --------------------------------------------

FLOOR_APP = "tests.bench.bench_terminate:floor_app"
_FLOOR_BODY = b"o" * (BODY_BYTES - 1) + b"\n"
_FLOOR_HEADERS = [(b"content-type", b"text/plain"),
                  (b"content-length", str(BODY_BYTES).encode())]


async def floor_app(scope: dict[str, Any], receive: Callable[[], Any],
                    send: Callable[[dict[str, Any]], Any]) -> None:
    """The same answer as the node (200, 1 KiB), from hypercorn's own ASGI loop."""
    if scope["type"] == "lifespan":
        for _ in range(2):  # startup, then shutdown
            msg = await receive()
            done = "startup" if msg["type"] == "lifespan.startup" else "shutdown"
            await send({"type": f"lifespan.{done}.complete"})
            if done == "shutdown":
                return
        return
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": _FLOOR_HEADERS})
    await send({"type": "http.response.body", "body": _FLOOR_BODY})


# --- measuring -------------------------------------------------------------------------------


def client_for(rig: Rig, phase: Phase, path: str, seconds: float
               ) -> tuple[list[str], Callable[[str], dict[str, Any]]]:
    if phase.h2:
        return h2load_argv(rig.url(path), phase.conns, seconds), parse_h2load
    return wrk_argv(rig.url(path), phase.conns, seconds, phase.new_conns), parse_wrk


def run_phase(rig: Rig, phase: Phase, path: str, seconds: float) -> ClientRun:
    """One client run against one path, with the proxy's and the node's CPU."""
    pids = {"node": rig.node.pid}
    if path != DIRECT:
        pids["proxy"] = rig.proxies[path].pid
    meter = CpuMeter(pids)
    argv, parse = client_for(rig, phase, path, seconds)
    meter.start()
    run = run_client(argv, parse, seconds)
    used = meter.stop()
    run.proxy_cpu = used.get("proxy")
    run.node_cpu = used["node"]
    for svc in (*rig.proxies.values(), rig.node):
        if not svc.alive():
            raise RuntimeError(f"{svc.name} died during {phase.key} via {path}:\n"
                               f"{svc.log_tail()}")
    return run


def warm_up(rig: Rig, s: Settings, plan: Sequence[Phase]) -> None:
    """A short run of each kind of client per path: pools filled, every route proven."""
    kinds = {(ph.h2, ph.new_conns): ph for ph in plan}
    for path in PATHS:
        for ph in kinds.values():
            warm = Phase(ph.key, ph.label, min(ph.conns, 8), ph.new_conns, ph.h2)
            run = run_phase(rig, warm, path, s.warmup)
            if not run.units and not run.errors and not run.non2xx:
                # nothing answered yet, nothing failed: on a busy machine the first
                # handshakes can take longer than a short warm-up; give it longer once
                run = run_phase(rig, warm, path, max(3.0, 3 * s.warmup))
            if run.errors or run.non2xx or not run.units:
                raise SystemExit(f"warm-up {ph.key} via {path} failed:\n{run.raw}\n"
                                 f"{rig.proxies.get(path, rig.node).log_tail()}")


def measure(rig: Rig, s: Settings, plan: Sequence[Phase], log: Callable[[str], None]
            ) -> dict[str, dict[str, list[ClientRun]]]:
    results: dict[str, dict[str, list[ClientRun]]] = {}
    for rnd in range(s.rounds):
        for phase in plan:
            for path in PATHS:
                run = run_phase(rig, phase, path, s.seconds)
                results.setdefault(phase.key, {}).setdefault(path, []).append(run)
                cpu = "-" if run.proxy_cpu is None else f"{run.proxy_cpu:.2f}s"
                log(f"round {rnd + 1}/{s.rounds} {phase.key:6} {path:13} "
                    f"rate={run.rate:10,.1f} err={run.errors} non2xx={run.non2xx} "
                    f"proxy_cpu={cpu} cores busy: proxy "
                    f"{run.core_busy[str(CORE_PROXY)]:.0%} load "
                    f"{run.core_busy[str(CORE_LOAD)]:.0%}")
    return results


def per_request_us(run: ClientRun) -> float | None:
    if run.proxy_cpu is None or not run.units:
        return None
    return run.proxy_cpu / run.units * 1e6


def capacity(run: ClientRun) -> float | None:
    """Requests/s the proxy could answer on its whole core at the measured CPU cost: the
    target judged even when the load core, not the proxy, capped the measured rate."""
    us = per_request_us(run)
    return 1e6 / us if us else None


MetricSpec = tuple[str, str, str, Callable[[ClientRun], float | None], Target | None]
RATIOS = [(SUBJECT, DIRECT), (PEER, DIRECT), (SUBJECT, PEER), (FLOOR, PEER)]
METRICS: list[MetricSpec] = [
    ("keep-alive req/s, HTTP/1.1, 1 conn", "req/s", "ka1", lambda r: r.rate, None),
    ("keep-alive req/s, HTTP/1.1, 8 conns", "req/s", "ka8", lambda r: r.rate, None),
    ("keep-alive req/s, HTTP/1.1, 32 conns", "req/s", "ka32", lambda r: r.rate, None),
    ("keep-alive req/s, HTTP/2, 8 conns", "req/s", "h2ka8", lambda r: r.rate, None),
    ("proxy CPU per request, HTTP/1.1, 1 conn", "µs", "ka1", per_request_us, None),
    ("proxy CPU per request, HTTP/1.1, 8 conns", "µs", "ka8", per_request_us,
     KEEPALIVE_CPU_GOAL),
    ("proxy CPU per request, HTTP/1.1, 32 conns", "µs", "ka32", per_request_us,
     KEEPALIVE_CPU_GOAL),
    ("proxy CPU per request, HTTP/2, 8 conns", "µs", "h2ka8", per_request_us, None),
    ("keep-alive capacity of one core, HTTP/1.1 (1 s ÷ CPU per req, 8 conns)", "req/s",
     "ka8", capacity, None),
    ("new TLS conn/s (1 request each), 1 client", "conn/s", "new1", lambda r: r.rate, None),
    ("new TLS conn/s (1 request each), 8 clients", "conn/s", "new8", lambda r: r.rate, None),
    ("proxy CPU per new TLS conn, 8 clients", "µs", "new8", per_request_us,
     NEW_CONN_CPU_GOAL),
]


def build_report(results: dict[str, dict[str, list[ClientRun]]], title: str,
                 notes: list[str]) -> Comparison:
    report = Comparison(title, list(PATHS), RATIOS)
    for name, unit, key, value, target in METRICS:
        if key not in results:
            continue
        values: dict[str, float | None] = {}
        for path in PATHS:
            nums = [v for v in (value(r) for r in results[key].get(path, []))
                    if v is not None]
            values[path] = statistics.median(nums) if nums else None
        checks = (Check(SUBJECT, PEER, target),) if target else ()
        report.add(Row(name, unit, values, checks))
    h2 = [v for v in (per_request_us(r) for r in results.get("h2ka8", {}).get(SUBJECT, []))
          if v is not None]
    if h2:
        h2_us = statistics.median(h2)
        notes.append(f"HTTP/2 goal (≤ {H2_GOAL_US:g} µs of proxy CPU per request, 8 conns): "
                     f"{h2_us:,.1f} µs, {'met' if h2_us <= H2_GOAL_US else 'missed'} "
                     f"(an absolute figure: it moves with what else runs on the host)")
    non2xx = errors = 0
    for key, by_path in results.items():
        for path, runs in by_path.items():
            errs, bad = sum(r.errors for r in runs), sum(r.non2xx for r in runs)
            errors, non2xx = errors + errs, non2xx + bad
            if errs or bad:
                notes.append(f"{key} via {path}: {errs} errors, {bad} non-2xx responses")
            load = max(r.core_busy[str(CORE_LOAD)] for r in runs)
            proxy = max(r.core_busy[str(CORE_PROXY)] for r in runs)
            if path != DIRECT and load > LOAD_BOUND and proxy < LOAD_BOUND:
                notes.append(f"{key} via {path}: load core {load:.0%} busy, proxy core "
                             f"{proxy:.0%}: the clients/node set the pace, not the proxy")
    idle_core = [r.core_busy[str(CORE_PROXY)] for by in results.values()
                 for r in by.get(DIRECT, [])]
    if idle_core:
        notes.append(f"core {CORE_PROXY} was {statistics.median(idle_core):.0%} busy (median) "
                     f"during the direct runs, when no bench process ran on it: other work "
                     f"on the machine (and any kernel network work scheduled there), which "
                     f"also competes with the proxies")
    if not non2xx:
        notes.append("every response in every measured run was 2xx (no 429: the rate "
                     "limiter was charged but never refused)")
    if not errors:
        notes.append("no socket errors in any measured run")
    sizes = {path: [r.bytes_read / r.units for runs in (by.get(path, []) for by in
                                                         results.values())
                    for r in runs if r.units and r.bytes_read]
             for path in PATHS}
    notes.append("bytes read per response (headers + body), median: " + ", ".join(
        f"{p} {statistics.median(v):.0f}" for p, v in sizes.items() if v))
    report.notes = notes
    return report


# --- profile ---------------------------------------------------------------------------------

#: Module → component, first match wins (py-spy `--full-filenames` frames).
COMPONENTS: tuple[tuple[str, str], ...] = (
    ("pact_ingress/net/terminate.py", "pact-ingress terminate.py"),
    ("pact_ingress/net/upstream.py", "pact-ingress upstream.py"),
    ("pact_ingress/net/http2.py", "pact-ingress http2.py"),
    ("pact_ingress/net/http1.py", "pact-ingress http1.py"),
    # its functions' self time is mostly the C under them: SSL_read/SSL_write and the
    # send/recv syscalls (py-spy charges a C call to the Python line making it)
    ("pact_ingress/net/memory_tls.py", "pact-ingress memory_tls.py (TLS + socket I/O)"),
    ("pact_ingress/net/readiness.py", "pact-ingress readiness.py + deadlines.py (waits)"),
    ("pact_ingress/net/deadlines.py", "pact-ingress readiness.py + deadlines.py (waits)"),
    ("pact_ingress/proto/", "pact-ingress proto/ (parsers, checks, head serialising)"),
    ("pact_ingress/logs.py", "pact-ingress logs.py (access line)"),
    ("pact_ingress/", "pact-ingress (other)"),
    ("/hypercorn/", "hypercorn"),
    ("/h11/", "h11"),
    ("/h2/", "h2 + hpack + hyperframe"),
    ("/hpack/", "h2 + hpack + hyperframe"),
    ("/hyperframe/", "h2 + hpack + hyperframe"),
    ("/httpcore/", "httpcore"),
    ("/trio/_ssl.py", "TLS (ssl + trio.SSLStream)"),
    ("/ssl.py", "TLS (ssl + trio.SSLStream)"),
    ("/trio/_socket.py", "socket calls (trio socket wrappers, syscalls)"),
    ("/trio/_highlevel_socket.py", "socket calls (trio socket wrappers, syscalls)"),
    ("/trio/", "trio (scheduler, cancel scopes, locks)"),
    ("/logging/", "logging"),
    ("/json/", "json"),
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def component(filename: str) -> str:
    for needle, name in COMPONENTS:
        if needle in filename:
            return name
    return "other Python (stdlib: contextlib, collections, …)"


def parse_collapsed(text: str) -> list[tuple[list[tuple[str, str]], int]]:
    """py-spy `--format raw` (collapsed stacks: `frame;frame;… count`), outermost first;
    each frame as (function, file)."""
    stacks = []
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = []
        for part in stack.split(";"):
            m = _FRAME.match(part.strip())
            frames.append((m["func"], m["file"]) if m else (part.strip(), ""))
        stacks.append((frames, int(count)))
    return stacks


def summarise_profile(text: str, seconds: float, rate: int) -> dict[str, Any]:
    """Shares of samples: by the innermost frame's component (exclusive), by any frame's
    component (inclusive), and the hottest innermost functions."""
    stacks = parse_collapsed(text)
    total = sum(n for _, n in stacks)
    excl: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    leaf: Counter[str] = Counter()
    ours: Counter[str] = Counter()
    for frames, n in stacks:
        if not frames:
            continue
        func, file = frames[-1]
        excl[component(file)] += n
        leaf[_short(func, file)] += n
        for comp in {component(f) for _, f in _task_frames(frames)}:
            incl[comp] += n
        for name in {_short(fn, f) for fn, f in frames if "pact_ingress/net/" in f}:
            ours[name] += n
    share = (lambda n: n / total) if total else (lambda n: 0.0)
    return {
        "samples": total, "seconds": seconds, "rate_hz": rate,
        "busy_fraction": total / (seconds * rate) if seconds and rate else None,
        "exclusive": {k: share(v) for k, v in excl.most_common()},
        "inclusive": {k: share(v) for k, v in incl.most_common()},
        "top_functions": {k: share(v) for k, v in leaf.most_common(PROFILE_TOP)},
        "ours_inclusive": {k: share(v) for k, v in ours.most_common(PROFILE_TOP)},
    }


def _task_frames(frames: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The running trio task's own frames: those above the scheduler's `unrolled_run`
    (below it sit runpy, the CLI and `trio.run`, on every stack)."""
    for i in range(len(frames) - 1, -1, -1):
        if frames[i][0] == "unrolled_run":
            return frames[i + 1:] or frames[i:]  # the scheduler itself is running
    return frames


def _short(func: str, file: str) -> str:
    return f"{func} ({'/'.join(Path(file).parts[-2:])})"


_OVERLAP_NOTE = ("Inclusive shares overlap (a sample counts for every component on its "
                 "stack): the HTTP legs (`http1.py`, `http2.py`) call `terminate.py`'s "
                 "request story, which calls `upstream.py`, so those cover most samples; "
                 "the self column and the function tables say more. A C call's time "
                 "(TLS, syscalls) counts for the Python function that made it.")


def profile_markdown(p: dict[str, Any], title: str) -> str:
    busy = p.get("busy_fraction")
    sampled = f"{p['samples']:,} samples at {p['rate_hz']} Hz over {p['seconds']:g} s"
    if busy is not None:
        sampled += f" (non-idle samples ≈ {busy:.0%} of the wall time)"
    lines = [f"### {title}", "", sampled + ".", "",
             "| component | self (innermost frame) | inclusive (running task's stack) |",
             "|---|---|---|"]
    for comp in sorted(set(p["exclusive"]) | set(p["inclusive"]),
                       key=lambda c: -p["exclusive"].get(c, 0.0)):
        lines.append(f"| {comp} | {p['exclusive'].get(comp, 0.0):.1%} | "
                     f"{p['inclusive'].get(comp, 0.0):.1%} |")
    lines += ["", _OVERLAP_NOTE, "", "| hottest functions (self) | share |", "|---|---|"]
    lines += [f"| `{fn}` | {v:.1%} |" for fn, v in p["top_functions"].items()]
    lines += ["", "| pact-ingress functions (inclusive: they and all they call) | share |",
              "|---|---|"]
    lines += [f"| `{fn}` | {v:.1%} |" for fn, v in p["ours_inclusive"].items()]
    return "\n".join(lines)


def profile_ingress(rig: Rig, phase: Phase, seconds: float, out: Path,
                    log: Callable[[str], None]) -> dict[str, Any] | None:
    """Keep-alive load on the ingress while py-spy samples it (py-spy on the load core;
    it pauses the ingress briefly per sample, so the rate under profile is a bit lower)."""
    spy = shutil.which(PY_SPY)
    if spy is None:
        log("py-spy not found (pip install py-spy): no profile")
        return None
    pid = rig.proxies[SUBJECT].pid
    argv = pinned([spy, "record", "--pid", str(pid), "--duration", f"{seconds + 1:g}",
                   "--rate", str(PROFILE_RATE), "--full-filenames",
                   "--format", "raw", "--output", str(out)], CORE_LOAD)
    with (rig.tmp / "py-spy.log").open("wb") as spy_log:
        spy_proc = subprocess.Popen(argv, stdout=spy_log, stderr=subprocess.STDOUT)
        time.sleep(0.5)  # attached before the load starts
        run = run_phase(rig, phase, SUBJECT, seconds)
        try:
            spy_proc.wait(seconds + LOAD_SLACK)
        except subprocess.TimeoutExpired:
            spy_proc.kill()
            spy_proc.wait()
    if spy_proc.returncode != 0 or not out.exists():
        log(f"py-spy failed ({spy_proc.returncode}): "
            f"{(rig.tmp / 'py-spy.log').read_text(errors='replace')[-500:]}")
        return None
    summary = summarise_profile(out.read_text(), seconds + 1, PROFILE_RATE)
    summary["load"] = {"phase": phase.key, "rate": run.rate, "errors": run.errors,
                       "non2xx": run.non2xx}
    return summary


# --- worker scaling (`--workers N`) ----------------------------------------------------------

#: Source addresses for the scaling clients: the first two that `proto.workers.worker_for`
#: sends to different workers of a two-worker serve (checked at start).
SCALING_SOURCES = ("127.0.0.2", "127.0.0.4")
#: curl processes per source address (each one keep-alive connection, requests in turn).
SCALING_CONNS_PER_SOURCE = 4
#: wrk / h2load: keep-alive connections per source address (one client process each).
LOADGEN_CONNS_PER_SOURCE = 16
LOADGENS = ("wrk", "h2load", "curl")
SCALING_1W, SCALING_NW = "pact-ingress, 1 worker", "pact-ingress, N workers"
#: The preload shim that gives wrk and h2load a source address (they cannot bind one).
BINDSRC_C = Path(__file__).with_name("bindsrc.c")
#: A run where the rest of the machine (not this bench) used more cores than this is
#: "loaded"; the report gives the medians of the quiet runs separately.
QUIET_OTHER_CORES = 0.15


def build_bindsrc(tmp: Path) -> Path:
    """Compile `bindsrc.c` into `tmp`; without a C compiler there is no honest multi-source
    wrk/h2load run, so stop with the reason."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise SystemExit("--loadgen wrk/h2load needs a C compiler to build "
                         f"{BINDSRC_C.name} (apt-get install gcc), or use --loadgen curl")
    out = tmp / "bindsrc.so"
    res = subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(BINDSRC_C),
                          "-ldl"], capture_output=True, timeout=120, check=False)
    if res.returncode != 0 or not out.exists():
        raise SystemExit(f"building {BINDSRC_C.name} failed ({res.returncode}):\n"
                         f"{res.stderr.decode(errors='replace')[-2000:]}")
    return out


@dataclass
class ScalingRun:
    path: str
    requests: int  # 2xx answers
    failed: int  # socket errors, non-2xx, failed requests
    elapsed: float
    proxy_cpu: float  # the proxy process and its descendants (main + workers)
    main_cpu: float | None  # main process alone (pact-ingress)
    client_cpu: float  # the load generator processes
    core_busy: dict[str, float]
    node_cpu: float = 0.0
    #: CPU seconds the rest of the machine used meanwhile: /proc/stat's busy time of all
    #: cores minus every process of this bench (services, clients, the orchestrator).
    other_cpu: float = 0.0
    #: requests each worker answered during the run (admin /status), by worker index
    worker_requests: dict[str, int] = field(default_factory=dict)
    round: int = 0

    @property
    def rate(self) -> float:
        return self.requests / self.elapsed if self.elapsed else 0.0

    @property
    def us_per_request(self) -> float | None:
        return self.proxy_cpu / self.requests * 1e6 if self.requests else None

    def us(self, cpu: float) -> float | None:
        return cpu / self.requests * 1e6 if self.requests else None

    @property
    def other_cores(self) -> float:
        return self.other_cpu / self.elapsed if self.elapsed else 0.0


def curl_keepalive(port: int, source: str, requests: int) -> list[str]:
    """One keep-alive HTTP/1.1 connection from `source` making `requests` GETs in turn
    (curl reuses the connection across a URL range). Each answer's status goes to stderr."""
    return ["curl", "-sk", "--http1.1", "--interface", source, "-o", "/dev/null",
            "-w", "%{stderr}%{http_code}\n", f"https://{HOST}:{port}/r[1-{requests}]"]


def worker_requests(admin_port: int | None) -> dict[str, int]:
    """Requests answered so far per worker index, from the instance's admin `/status`."""
    if admin_port is None:
        return {}
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{admin_port}/status", timeout=10) as r:
        status = json.load(r)
    return {str(w["index"]): int(w.get("requests") or 0) for w in status.get("workers", [])}


def _self_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def _busy_seconds(before: Mapping[int, tuple[int, int]],
                  after: Mapping[int, tuple[int, int]]) -> float:
    ticks = sum(after[c][0] - before.get(c, after[c])[0] for c in after)
    return ticks / os.sysconf("SC_CLK_TCK")


Drive = Callable[[], tuple[int, int, float]]  # → (2xx answers, failures, seconds)


def measure_scaling(path: str, proxy: Service, node: Service, everyone: Sequence[Service],
                    admin_port: int | None, drive: Drive) -> ScalingRun:
    """Run `drive` (the clients, to completion) and account for every CPU second of the
    machine meanwhile: the proxy's tree, its main process, the node, the clients, and
    what the rest of the machine (other tenants) used."""
    w0 = worker_requests(admin_port)
    ours0 = sum(cpu_seconds(s.pid) for s in everyone)
    proxy0 = cpu_seconds(proxy.pid)
    main0 = cpu_seconds(proxy.pid, descendants=False)
    node0 = cpu_seconds(node.pid)
    kids0, self0, ticks0 = _children_cpu(), _self_cpu(), core_ticks()
    ok, failed, elapsed = drive()
    ticks1 = core_ticks()
    kids = _children_cpu() - kids0
    ours = sum(cpu_seconds(s.pid) for s in everyone) - ours0 + kids + _self_cpu() - self0
    w1 = worker_requests(admin_port)
    for svc in everyone:
        if not svc.alive():
            raise RuntimeError(f"{svc.name} died during a run via {path}:\n{svc.log_tail()}")
    return ScalingRun(
        path, ok, failed, elapsed, cpu_seconds(proxy.pid) - proxy0,
        cpu_seconds(proxy.pid, descendants=False) - main0 if path != PEER else None, kids,
        core_busy(ticks0, ticks1), node_cpu=cpu_seconds(node.pid) - node0,
        other_cpu=max(0.0, _busy_seconds(ticks0, ticks1) - ours),
        worker_requests={k: v - w0.get(k, 0) for k, v in w1.items()})


def drive_curl(port: int, requests: int) -> Drive:
    def run() -> tuple[int, int, float]:
        argvs = [curl_keepalive(port, src, requests) for src in SCALING_SOURCES
                 for _ in range(SCALING_CONNS_PER_SOURCE)]
        started = time.monotonic()
        procs = [subprocess.Popen(a, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for a in argvs]
        codes: Counter[str] = Counter()
        for proc in procs:
            _, err = proc.communicate(timeout=requests + LOAD_SLACK)  # bounded: ≥ 1 req/s
            codes.update(err.decode().split())
        elapsed = time.monotonic() - started
        ok = codes.pop("200", 0)
        return ok, sum(codes.values()), elapsed
    return run


def drive_loadgen(loadgen: str, port: int, shim: Path, conns: int, seconds: float) -> Drive:
    """One wrk (or h2load) process per source address, all at once, each with `conns`
    keep-alive connections bound to its address by the preload shim."""
    url = f"https://{HOST}:{port}/"
    if loadgen == "wrk":
        argv, parse = wrk_argv(url, conns, seconds, close=False), parse_wrk
    else:
        argv, parse = h2load_argv(url, conns, seconds), parse_h2load

    def run() -> tuple[int, int, float]:
        procs = [subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  env={**os.environ, "LD_PRELOAD": str(shim),
                                       "BINDSRC_ADDR": src})
                 for src in SCALING_SOURCES]
        ok = failed = 0
        elapsed = 0.0
        for src, proc in zip(SCALING_SOURCES, procs):
            out, err = proc.communicate(timeout=seconds + LOAD_SLACK)
            text = out.decode(errors="replace")
            if proc.returncode != 0:
                raise RuntimeError(f"{loadgen} from {src} failed ({proc.returncode}):\n"
                                   f"{text}\n{err.decode(errors='replace')[-2000:]}")
            p = parse(text)
            ok += p["requests"]
            failed += p["errors"] + p["non2xx"]
            elapsed = max(elapsed, p["elapsed"])
        return ok, failed, elapsed
    return run


def check_workers_served(run: ScalingRun, expected: set[int]) -> None:
    """Both source addresses must have reached their own worker: a worker that answered
    nothing means the shim did not bind (all clients came from one address) or the
    handoff failed, and the run would compare one worker with one worker."""
    idle = sorted(i for i in expected if run.worker_requests.get(str(i), 0) <= 0)
    if not run.worker_requests or idle:
        seen = run.worker_requests or "no workers in /status"
        raise SystemExit(f"{run.path}: worker(s) {idle or sorted(expected)} served no "
                         f"request (per worker: {seen}); the clients did not reach every "
                         f"worker")


def scaling_main(args: argparse.Namespace, log: Callable[[str], None]) -> int:
    """`--workers N`: keep-alive throughput and CPU per request of `serve --workers 1`
    and `--workers N` (and HAProxy, one thread) under the same clients, nothing pinned:
    the instance may use every core, as in production. Configurations alternate within
    each round, so a change in the machine's other load hits them alike."""
    from pact_ingress.identity import keygen
    from pact_ingress.proto.workers import worker_for

    global SCALING_SOURCES
    n = args.workers
    if n < 2:
        raise SystemExit("--workers N compares N ≥ 2 workers with one")
    if args.sources:  # e.g. two addresses of ONE worker: the handoff's own cost
        SCALING_SOURCES = tuple(args.sources.split(","))
    elif len({worker_for(src, n) for src in SCALING_SOURCES}) != min(n, 2):
        raise SystemExit(f"{SCALING_SOURCES} do not reach two workers of {n}")
    expected = {worker_for(src, n) for src in SCALING_SOURCES}
    loadgen = args.loadgen
    if shutil.which(loadgen) is None:
        raise SystemExit(f"{loadgen} not found")
    conns = args.conns or LOADGEN_CONNS_PER_SOURCE
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    requests = 300 if args.quick else 1500  # curl: per connection
    rounds = args.rounds or (1 if args.quick else 5)
    tmp = Path(tempfile.mkdtemp(prefix="pact-bench-workers-"))
    shim = build_bindsrc(tmp) if loadgen != "curl" else None
    notes = machine_notes()
    notes.append(machine_state())
    reach = ", ".join(f"{src} → worker {worker_for(src, n)}" for src in SCALING_SOURCES)
    if loadgen == "curl":
        notes.append(f"clients: {len(SCALING_SOURCES) * SCALING_CONNS_PER_SOURCE} curl "
                     f"processes ({SCALING_CONNS_PER_SOURCE} per source address: {reach}), "
                     f"each one keep-alive HTTP/1.1 connection making {requests} GETs")
    else:
        proto = "HTTP/1.1" if loadgen == "wrk" else "HTTP/2, one stream per connection"
        notes.append(f"clients: one `{loadgen} -t1 -c{conns}` per source address ({reach}; "
                     f"source bound by the LD_PRELOAD shim {BINDSRC_C.name}), {seconds:g} s, "
                     f"keep-alive {proto}; {tool_version([loadgen, '--version'])}")
    notes.append(f"{rounds} round(s), configurations alternated within each, median and "
                 f"range; nothing pinned (proxies, node and clients share all "
                 f"{os.cpu_count()} CPUs); node: HAProxy `http-request return`, "
                 f"{BODY_BYTES} B body")
    results: dict[str, list[ScalingRun]] = {}
    with services() as started:
        ports = {"node": free_port(), PEER: free_port(), SCALING_1W: free_port(),
                 SCALING_NW: free_port()}
        admin = {SCALING_1W: free_port(), SCALING_NW: free_port()}
        ingress_id = keygen(tmp / "ingress.key", common_name="pact-ingress-bench")
        ingress_pem = tmp / "ingress.pem"
        ingress_pem.write_bytes(ingress_id.cert_path.read_bytes() +
                                ingress_id.key_path.read_bytes())
        node_id = keygen(tmp / "node.key", common_name="bench-node")
        node_pem = tmp / "node.pem"
        node_pem.write_bytes(node_id.cert_path.read_bytes() + node_id.key_path.read_bytes())
        front_pem = make_tls_pem(tmp, HOST)
        body = tmp / "body.txt"
        body.write_bytes(b"o" * (BODY_BYTES - 1) + b"\n")
        (tmp / "node.cfg").write_text(haproxy_http_backend_cfg(
            port=ports["node"], pem=node_pem, body=body, alpn="h2,http/1.1",
            client_ca=ingress_id.cert_path))
        (tmp / "haproxy.cfg").write_text(haproxy_terminate_cfg(
            port=ports[PEER], pem=front_pem, backend_port=ports["node"],
            client_pem=ingress_pem, alpn="h2,http/1.1"))
        node = Service("node (haproxy)", haproxy_argv(tmp / "node.cfg"), None,
                       tmp / "node.log")
        started.append(node)
        node.start([ports["node"]])
        proxies = {PEER: Service("haproxy", haproxy_argv(tmp / "haproxy.cfg"), None,
                                 tmp / "haproxy.log")}
        for path, count in ((SCALING_1W, 1), (SCALING_NW, n)):
            d = tmp / f"w{count}"
            d.mkdir()
            for name in ("ingress.key", "ingress.crt", f"{HOST}.crt", f"{HOST}.key"):
                if (tmp / name).exists():
                    shutil.copy(tmp / name, d / name)
            (d / "ingress.yaml").write_text(ingress_yaml(d, ports[path], ports["node"],
                                                         node_id.fingerprint, admin[path]))
            proxies[path] = Service(path, python_module(
                "pact_ingress", "serve", "-c", str(d / "ingress.yaml"), "--workers",
                str(count)), None, d / "ingress.log")
        for path, svc in proxies.items():
            started.append(svc)
            # the admin port too: /status is read before the first run, and a serve with
            # workers listens there only once its workers are ready
            svc.start([ports[path], *([admin[path]] if path in admin else [])])

        def drive(path: str, warm: bool) -> Drive:
            if shim is None:
                return drive_curl(ports[path], 50 if warm else requests)
            return drive_loadgen(loadgen, ports[path], shim, conns,
                                 1.0 if warm else seconds)

        def one(path: str, warm: bool = False) -> ScalingRun:
            run = measure_scaling(path, proxies[path], node, started, admin.get(path),
                                  drive(path, warm))
            if run.failed or not run.requests:
                raise SystemExit(f"{'warm-up' if warm else 'run'} via {path} failed: {run}\n"
                                 f"{proxies[path].log_tail()}")
            if path == SCALING_NW:
                check_workers_served(run, expected)
            return run

        log(f"rig up in {tmp}; warming up")
        for path in proxies:
            one(path, warm=True)
        for rnd in range(rounds):
            order = [SCALING_1W, SCALING_NW] if rnd % 2 == 0 else [SCALING_NW, SCALING_1W]
            for path in (*order, PEER):
                run = one(path)
                run.round = rnd + 1
                results.setdefault(path, []).append(run)
                log(f"round {rnd + 1}/{rounds} {path:24} rate={run.rate:8,.0f} "
                    f"failed={run.failed} proxy_cpu={run.proxy_cpu:.2f}s "
                    f"µs/req={run.us_per_request or 0:.0f} client={run.client_cpu:.2f}s "
                    f"node={run.node_cpu:.2f}s other={run.other_cores:.2f} cores "
                    f"workers={run.worker_requests}")
    print(scaling_markdown(results, n, notes, loadgen))
    if args.json:
        args.json.write_text(json.dumps({p_: [asdict(r) for r in runs]
                                         for p_, runs in results.items()}, indent=1))
    if args.keep:
        log(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def _spread(vals: Sequence[float], fmt: Callable[[float], str]) -> str:
    if not vals:
        return "—"
    mid = fmt(statistics.median(vals))
    return mid if len(vals) == 1 else f"{mid} ({fmt(min(vals))}–{fmt(max(vals))})"


def scaling_markdown(results: dict[str, list[ScalingRun]], n: int, notes: list[str],
                     loadgen: str) -> str:
    def vals(path: str, fn: Callable[[ScalingRun], float | None]) -> list[float]:
        return [v for v in (fn(r) for r in results.get(path, [])) if v is not None]

    def med(path: str, fn: Callable[[ScalingRun], float | None]) -> float | None:
        v = vals(path, fn)
        return statistics.median(v) if v else None

    ncpu = os.cpu_count() or 1
    f0 = lambda v: f"{v:,.0f}"  # noqa: E731
    f2 = lambda v: f"{v:.2f}"  # noqa: E731
    label = {PEER: "haproxy (1 thread)", SCALING_1W: "pact-ingress, 1 worker",
             SCALING_NW: f"pact-ingress, {n} workers"}
    base_rate = med(SCALING_1W, lambda r: r.rate)
    base_us = med(SCALING_1W, lambda r: r.us_per_request)
    lines = [f"### Terminate keep-alive ({loadgen}), `serve --workers 1` vs `--workers {n}`",
             "", "Medians over the rounds, (min–max) in brackets. CPU per request is µs of "
             "CPU per 2xx answer; \"instance\" is main + workers.", "",
             "| path | req/s | × 1 worker | instance CPU per request (µs) | × 1 worker | "
             "instance cores busy | main's share | client CPU/req (µs) | node CPU/req (µs) "
             "| rest of machine (cores) | ingress-saturated req/s (cores it can use ÷ "
             "CPU/req) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for path in (SCALING_1W, SCALING_NW, PEER):
        if path not in results:
            continue
        rate, us = med(path, lambda r: r.rate), med(path, lambda r: r.us_per_request)
        usable = 1 if path in (PEER, SCALING_1W) else min(n, ncpu)
        main_share = med(path, lambda r: r.main_cpu / r.proxy_cpu
                         if r.main_cpu is not None and r.proxy_cpu else None)
        lines.append(" | ".join([
            f"| {label[path]}", _spread(vals(path, lambda r: r.rate), f0),
            f"{rate / base_rate:.2f}×" if rate and base_rate else "—",
            _spread(vals(path, lambda r: r.us_per_request), f0),
            f"{us / base_us:.2f}×" if us and base_us else "—",
            _spread(vals(path, lambda r: r.proxy_cpu / r.elapsed if r.elapsed else None), f2),
            "—" if main_share is None else f"{main_share:.0%}",
            _spread(vals(path, lambda r: r.us(r.client_cpu)), f0),
            _spread(vals(path, lambda r: r.us(r.node_cpu)), f0),
            _spread(vals(path, lambda r: r.other_cores), f2),
            f"{usable * 1e6 / us:,.0f}" if us else "—"]) + " |")
    # Paired per round: the two configurations ran back to back, so their ratio is less
    # exposed to the machine's other load than the ratio of medians.
    lines += ["", f"Per round ({n} workers ÷ 1 worker, back to back):", "",
              "| round | rest of machine (cores, 1w / Nw) | 1 worker req/s | "
              f"{n} workers req/s | × | × 1 worker on a whole core | 1 worker µs/req | "
              f"{n} workers µs/req | × | requests per worker ({n} workers) | haproxy req/s |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    # (rate ratio, rate ÷ one worker's saturated rate, cpu ratio, other cores)
    paired: list[tuple[float, float, float, float]] = []
    peer_by_round = {r.round: r for r in results.get(PEER, [])}
    for one, many in zip(results.get(SCALING_1W, []), results.get(SCALING_NW, [])):
        if not (one.rate and one.us_per_request and many.us_per_request):
            continue
        rr, cr = many.rate / one.rate, many.us_per_request / one.us_per_request
        # One worker cannot use more than one core: crediting it with a whole one keeps
        # the ratio honest when other tenants took part of its core during its run.
        rs = many.rate * one.us_per_request / 1e6
        other = max(one.other_cores, many.other_cores)
        paired.append((rr, rs, cr, other))
        peer = peer_by_round.get(one.round)
        lines.append(
            f"| {one.round} | {one.other_cores:.2f} / {many.other_cores:.2f} | "
            f"{one.rate:,.0f} | {many.rate:,.0f} | {rr:.2f}× | {rs:.2f}× | "
            f"{one.us_per_request:,.0f} | "
            f"{many.us_per_request:,.0f} | {cr:.2f}× | "
            f"{', '.join(f'w{k}: {v:,}' for k, v in sorted(many.worker_requests.items()))} | "
            f"{peer.rate if peer else 0:,.0f} |")
    out_notes = list(notes)
    if paired:
        quiet = [p for p in paired if p[3] <= QUIET_OTHER_CORES]

        def ratios(ps: list[tuple[float, float, float, float]]) -> str:
            return (f"throughput {_spread([p[0] for p in ps], f2)}× (÷ one worker on a "
                    f"whole core: {_spread([p[1] for p in ps], f2)}×), CPU per request "
                    f"{_spread([p[2] for p in ps], f2)}×")
        out_notes.append(
            f"paired ratios, all {len(paired)} rounds: {ratios(paired)}; rounds where the "
            f"rest of the machine used ≤ {QUIET_OTHER_CORES} cores in both runs "
            f"({len(quiet)}): {ratios(quiet) if quiet else 'none'}")
    totals = []
    for path in (SCALING_1W, SCALING_NW):
        tot = med(path, lambda r: (r.proxy_cpu + r.client_cpu + r.node_cpu) / r.requests * 1e6
                  if r.requests else None)
        if tot:
            totals.append(f"{label[path]}: {tot:,.0f} µs (ceiling {ncpu * 1e6 / tot:,.0f} "
                          f"req/s)")
    if totals:
        out_notes.append(f"CPU per request of everything on the path (instance + clients + "
                         f"node), and the rate {ncpu} CPUs could carry at that cost: "
                         + "; ".join(totals))
    failed = sum(r.failed for runs in results.values() for r in runs)
    out_notes.append(f"failed requests in all measured runs: {failed}")
    return "\n".join([*lines, "", *(f"- {x}" for x in out_notes)])


# --- main ------------------------------------------------------------------------------------


def other_benches() -> list[str]:
    """Command lines of other bench processes running now (they skew every figure)."""
    res = subprocess.run(["pgrep", "-af", "tests.bench"], capture_output=True, timeout=10,
                         check=False)
    me = {str(os.getpid()), str(os.getppid())}
    return [line for line in res.stdout.decode().splitlines()
            if line.split(" ", 1)[0] not in me and "bench_terminate" not in line]


def machine_state() -> str:
    load1, load5, _ = os.getloadavg()
    others = other_benches()
    state = (f"machine state at start: load average {load1:.2f} (1 min), {load5:.2f} "
             f"(5 min) on {os.cpu_count()} CPUs; ")
    if others:
        return state + (f"ANOTHER BENCH WAS RUNNING ({len(others)} processes, e.g. "
                        f"`{others[0].split(' ', 1)[-1][:80]}`): figures are skewed")
    return state + "no other bench running"


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 2 s runs, one round")
    p.add_argument("--json", type=Path, help="also write results as JSON here")
    p.add_argument("--seconds", type=float, help="override the timed run length")
    p.add_argument("--rounds", type=int, help="override the number of rounds")
    p.add_argument("--upstream", choices=("h2", "http/1.1"), default="h2",
                   help="ALPN the node offers (default h2, falling back to http/1.1 "
                        "like a hypercorn node; http/1.1 forces HTTP/1.1 upstream)")
    p.add_argument("--only", help="comma-separated phases: " + ",".join(
        ph.key for ph in PHASES))
    p.add_argument("--no-profile", action="store_true", help="skip the py-spy profile")
    p.add_argument("--profile-phase", default="ka8", choices=[ph.key for ph in PHASES
                                                              if not ph.new_conns],
                   help="the keep-alive phase run under py-spy (default ka8)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (configs, logs)")
    p.add_argument("--sources", metavar="IP,IP",
                   help="with --workers: the clients' source addresses (default "
                        + ",".join(SCALING_SOURCES) + ", which reach different workers)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="instead of the comparison above: keep-alive throughput and CPU "
                        "per request of `serve --workers 1` vs `--workers N` (+ HAProxy), "
                        "clients from two source addresses that reach different workers")
    p.add_argument("--loadgen", choices=LOADGENS, default="wrk",
                   help="with --workers: the clients. wrk (default: HTTP/1.1 keep-alive) or "
                        "h2load (HTTP/2), one process per source address, the address bound "
                        "by the LD_PRELOAD shim tests/bench/bindsrc.c (compiled with cc); "
                        "curl: --interface, several processes, ~140 µs of CPU per request")
    p.add_argument("--conns", type=int, metavar="C",
                   help=f"with --workers and wrk/h2load: connections per source address "
                        f"(default {LOADGEN_CONNS_PER_SOURCE})")
    args = p.parse_args(argv)
    for tool in (HAPROXY, WRK):
        if shutil.which(tool) is None:
            p.error(f"{tool} not found: apt-get install haproxy wrk")
    if args.workers is not None:
        return scaling_main(args, _log)
    s = QUICK if args.quick else FULL
    if args.seconds:
        s = Settings(**{**asdict(s), "seconds": args.seconds})
    if args.rounds:
        s = Settings(**{**asdict(s), "rounds": args.rounds})
    plan = [ph for ph in PHASES if (args.only is None or ph.key in args.only.split(","))
            and (not ph.h2 or shutil.which(H2LOAD))]

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    notes = machine_notes()
    notes.append(machine_state())
    notes.append(f"HAProxy: {tool_version([HAPROXY, '-v'])}; clients: wrk 4.1 (HTTP/1.1), "
                 + (f"{tool_version([H2LOAD, '--version'])} (HTTP/2)" if shutil.which(H2LOAD)
                    else "no h2load (HTTP/2 rows skipped)"))
    if cores_available() >= 2:
        pin_self(CORE_LOAD)
        notes.append(f"proxy under test on core {CORE_PROXY}; node, clients, orchestrator "
                     f"(and py-spy) on core {CORE_LOAD}")
    else:
        notes.append("fewer than 2 cores: NOT pinned, numbers are not comparable")
    upstream_alpn = "h2,http/1.1" if args.upstream == "h2" else "http/1.1"
    notes.append(f"node (HAProxy `http-request return`, {BODY_BYTES} B body) offers ALPN "
                 f"{upstream_alpn}, both proxies re-encrypt with the same client cert, "
                 f"which the node requests and verifies (`verify optional`); HAProxy "
                 f"`verify none` (it cannot pin), pact-ingress pins the node key")
    notes.append(f"mode {'quick (smoke)' if args.quick else 'full'}: {s.seconds:g} s runs, "
                 f"{s.rounds} round(s), median")
    tmp = Path(tempfile.mkdtemp(prefix="pact-bench-terminate-"))
    started_at = time.monotonic()
    profile: dict[str, Any] | None = None
    with services() as started:
        rig = build_rig(tmp, started, upstream_alpn)
        log(f"rig up in {tmp}; warming up")
        warm_up(rig, s, plan)
        results = measure(rig, s, plan, log)
        profiled = next((ph for ph in PHASES if ph.key == args.profile_phase), None)
        if not args.no_profile and s.profile_seconds > 0 and profiled is not None:
            log(f"profiling pact-ingress under {profiled.key} for {s.profile_seconds:g} s")
            profile = profile_ingress(rig, profiled, s.profile_seconds, tmp / "py-spy.txt",
                                      log)
        ingress_log_bytes = (tmp / "ingress.log").stat().st_size
    notes.append(f"pact-ingress wrote {ingress_log_bytes:,} bytes of log in the run")
    title = f"Terminate on loopback ({'quick smoke run' if args.quick else 'full run'})"
    report = build_report(results, title, notes)
    print(report.markdown())
    if profile is not None:
        print()
        print(profile_markdown(profile, f"Where pact-ingress's time goes (py-spy, "
                                        f"{profile['load']['phase']}, "
                                        f"{profile['load']['rate']:,.0f} req/s while sampled)"))
    log(f"done in {time.monotonic() - started_at:.0f} s")
    if args.json:
        raw = {k: {p_: [{**asdict(r), "raw": None} for r in runs] for p_, runs in v.items()}
               for k, v in results.items()}
        args.json.write_text(json.dumps({"report": report.as_json(), "settings": asdict(s),
                                         "profile": profile, "results": raw}, indent=1))
    if args.keep:
        log(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
