"""Passthrough benchmark: direct vs HAProxy vs pact-ingress, side by side in one run.

    python -m tests.bench.bench_passthrough [--quick] [--json out.json] [--ingress auto]

What runs where (2 cores): the proxy under test — HAProxy or pact-ingress, each started
once and idle while the other is measured — on core 0; this orchestrator, the load
generators and the backends on core 1. Each phase runs the same load against the three
paths back to back: a direct connection to the backend, HAProxy, pact-ingress. Both
proxies route by SNI, so one running instance serves every phase (each phase's canned
ClientHello names its own backend):

| phase | load (tests.bench.loadgen) | backend |
| --- | --- | --- |
| new TLS connections/s, 1 and 8 clients | handshake + `GET /`, no resumption | HAProxy terminating TLS (core 1) |
| ClientHello flood | new TCP conn, canned hello, wait for close; 64 in flight | HAProxy sink: reads the hello, closes |
| bulk MB/s, 1, 8 and 100 connections | hello, then N bytes, half-close, count checked | raw sink counting bytes |
| keep-alive 1 KiB requests/s, 1, 8 and 32 connections | 1 KiB ping-pong | raw echo |
| idle connections (`idle10k`, only when asked) | 10,000 connections: hello, then nothing | raw echo |

`idle10k` is pact-ingress only (HAProxy's `maxconn` is sized for the 20,000-fd limit):
the orchestrator holds 10,000 connections open at once, each past its hello and idle,
and reads the whole instance's RSS and open fds from /proc before and while they are
held. Each side then needs more than 20,000 fds, so the orchestrator raises
RLIMIT_NOFILE for itself and the processes it starts when it may (CAP_SYS_RESOURCE);
otherwise it holds as many connections as the limit allows and says so in the notes.

The proxy's CPU is read from /proc before and after each phase (`harness.CpuMeter`), so
"µs per connection" and "s per GB" are the proxy process's own cost. Ratios are to the
direct path of the same run, and pact-ingress ÷ HAProxy is checked against the passthrough
targets: flood conn/s ≥ 0.85×, keep-alive at 32 connections ≥ 0.95×, bulk and the other
keep-alive rows ≥ 1.0×, CPU s/GB ≤ 1.0×.

`--lean` also measures `tests/bench/lean_splice.py` on the proxy core, the plainest SNI
router one writes on trio (read the hello, connect, one copying task each way), and
puts its figures and its per-round ratio to HAProxy in the notes: what pact-ingress's
router gains over the obvious trio design, and what Python on trio costs before it.

`--ingress-uid UID` runs pact-ingress as that uid without CAP_SYS_RESOURCE and
CAP_SYS_ADMIN (`setpriv`), as the systemd unit's dynamic user: the kernel's per-user pipe
budget then applies to it, which it never does to root.

pact-ingress runs as `python -m pact_ingress serve -c CONFIG` (`--ingress serve`), or,
while `serve` cannot start because components are missing, as
`python -m tests.bench.run_router -c CONFIG` (`--ingress router`): the same loader,
router and backends. `--ingress auto` (default) tries `serve` first and says which ran.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pact_ingress.proto.clienthello import parse_client_hello
from tests.bench import harness
from tests.bench.harness import (
    CORE_LOAD,
    CORE_PROXY,
    REPO,
    CpuMeter,
    Metric,
    Report,
    Service,
    ServiceError,
    Target,
    cores_available,
    free_port,
    machine_notes,
    pin_self,
    python_module,
    run_load,
    services,
    tool_version,
)
from tests.bench.peers import (
    HAPROXY,
    haproxy_argv,
    haproxy_backends_cfg,
    haproxy_passthrough_cfg,
    make_tls_pem,
    raw_backends_argv,
)

HELLO_VECTOR = REPO / "tests" / "vectors" / "clienthello" / "curl.bin"
VECTOR_SNI = "www.example.test"
#: One SNI per backend; same length as the vector's, so rewriting keeps every length field.
SNI = {"flood": "www.example.test", "bulk": "blk.example.test",
       "keepalive": "kal.example.test", "tls": "tls.example.test"}
DIRECT, PEER, SUBJECT = "direct", "haproxy", "pact-ingress"
PATHS = (DIRECT, PEER, SUBJECT)
#: `--lean`: tests/bench/lean_splice.py, measured beside the others, reported in the notes
LEAN = "lean"
#: Idle connections held at once by the `idle10k` row.
IDLE_CONNS = 10_000
#: Generous limits for the ingress under test: the bench, not a limit, must be the cap
#: (the idle row holds IDLE_CONNS from one address).
INGRESS_MAX_CONNECTIONS = IDLE_CONNS + 2000
#: Descriptors the ingress needs beside two per idle connection: its listeners, logs and
#: pooled pipes (at most a few hundred).
IDLE_FD_RESERVE = 512
#: The fd limit the idle row asks for (the ingress holds two per connection).
IDLE_NOFILE = 2 * IDLE_CONNS + IDLE_FD_RESERVE
#: Opening an idle connection that takes longer than this means the ingress stopped
#: accepting (out of descriptors): the row then reports what it held.
IDLE_CONNECT_TIMEOUT = 5.0
#: Waiting for the ingress to take every connection: at most this long, or until its fd
#: count has not moved for IDLE_SETTLE_STILL seconds.
IDLE_SETTLE_MAX = 120.0
IDLE_SETTLE_STILL = 3.0
#: Every connection is pinged at once; the ones whose echo is back by then are held.
IDLE_PROBE_WAIT = 15.0
IDLE_KEY = "idle10k"
INGRESS_IDLE_TIMEOUT = "120s"
#: A core busier than this during a phase was (close to) the bottleneck.
LOAD_BOUND = 0.9


@dataclass(frozen=True)
class Settings:
    seconds: float  # length of each timed phase (tls, flood, keep-alive)
    bulk_bytes: int  # bytes per bulk phase (split over its connections)
    flood_inflight: int  # connections open at once in the flood
    rounds: int  # each metric is the median over rounds
    warmup: float  # seconds of flood + keep-alive per path before measuring


FULL = Settings(seconds=6.0, bulk_bytes=1 << 30, flood_inflight=64, rounds=2, warmup=1.0)
QUICK = Settings(seconds=1.5, bulk_bytes=256 << 20, flood_inflight=64, rounds=1, warmup=0.3)


@dataclass(frozen=True)
class Phase:
    key: str
    backend: str  # tls | flood | bulk | keepalive (which SNI/backend it uses)
    argv: tuple[str, ...]  # loadgen arguments after the kind, port added per path
    time_bound: float


def hello_for(sni: str) -> bytes:
    """The captured curl ClientHello with its SNI replaced by `sni` (same length)."""
    raw = HELLO_VECTOR.read_bytes()
    old, new = VECTOR_SNI.encode(), sni.encode()
    assert len(old) == len(new) and raw.count(old) == 1, "vector SNI must appear once"
    hello = raw.replace(old, new)
    parsed = parse_client_hello(hello)
    assert parsed is not None and parsed.sni == sni, f"rewritten hello parses as {parsed}"
    return hello


def phases(s: Settings, hellos: dict[str, Path]) -> list[Phase]:
    t = s.seconds
    bulk_bound = max(30.0, s.bulk_bytes / 50e6)  # even 50 MB/s finishes in time
    return [
        Phase("tls1", "tls", ("tls", "--sni", SNI["tls"], "--procs", "1", "--seconds", str(t)),
              t),
        Phase("tls8", "tls", ("tls", "--sni", SNI["tls"], "--procs", "8", "--seconds", str(t)),
              t),
        Phase("flood", "flood", ("flood", "--hello", str(hellos["flood"]), "--inflight",
                                 str(s.flood_inflight), "--seconds", str(t)), t),
        Phase("bulk1", "bulk", ("bulk", "--hello", str(hellos["bulk"]), "--conns", "1",
                                "--bytes", str(s.bulk_bytes), "--seconds", str(bulk_bound)),
              bulk_bound),
        Phase("bulk8", "bulk", ("bulk", "--hello", str(hellos["bulk"]), "--conns", "8",
                                "--bytes", str(s.bulk_bytes), "--seconds", str(bulk_bound)),
              bulk_bound),
        Phase("bulk100", "bulk", ("bulk", "--hello", str(hellos["bulk"]), "--conns", "100",
                                  "--bytes", str(s.bulk_bytes), "--seconds", str(bulk_bound)),
              bulk_bound),
        Phase("ka1", "keepalive", ("keepalive", "--hello", str(hellos["keepalive"]),
                                   "--conns", "1", "--seconds", str(t)), t),
        Phase("ka8", "keepalive", ("keepalive", "--hello", str(hellos["keepalive"]),
                                   "--conns", "8", "--seconds", str(t)), t),
        Phase("ka32", "keepalive", ("keepalive", "--hello", str(hellos["keepalive"]),
                                    "--conns", "32", "--seconds", str(t)), t),
    ]


# --- the rig: backends and proxies ---------------------------------------------------------


@dataclass
class Rig:
    tmp: Path
    ports: dict[str, int]
    proxies: dict[str, Service]
    load_side: list[Service]
    runner: str
    hellos: dict[str, Path]

    def port(self, path: str, backend: str) -> int:
        if path == DIRECT:
            return self.ports[{"tls": "tls", "flood": "sink", "bulk": "bulk",
                               "keepalive": "echo"}[backend]]
        return self.ports[path]


def ingress_yaml(tmp: Path, port: int, routes: dict[str, int]) -> str:
    route_lines = "\n".join(
        f"      - {{host: {host}, mode: passthrough, backend: \"127.0.0.1:{p}\"}}"
        for host, p in routes.items())
    return f"""\
identity:
  key: {tmp}/ingress.key
state_dir: {tmp}/state
listen:
  tls: ["127.0.0.1:{port}"]
limits:
  clienthello_timeout: 10s
  idle_timeout: {INGRESS_IDLE_TIMEOUT}
  max_connections: {INGRESS_MAX_CONNECTIONS}
  max_connections_per_ip: {INGRESS_MAX_CONNECTIONS}
tenants:
  - name: bench
    pins: ["sha256:{'A' * 43}"]
    routes:
{route_lines}
"""


def as_user(uid: int) -> list[str]:
    """argv prefix: run as `uid` without the capabilities that lift the kernel's pipe
    limits (CAP_SYS_RESOURCE, CAP_SYS_ADMIN), as the systemd unit's dynamic user runs.
    Only CAP_DAC_READ_SEARCH is kept, to read the interpreter wherever it is installed."""
    return [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}",
            "--clear-groups", "--inh-caps=-all,+dac_read_search",
            "--ambient-caps=-all,+dac_read_search"]


def start_ingress(tmp: Path, cfg: Path, port: int, mode: str, notes: list[str],
                  profile: Path | None = None, uid: int | None = None
                  ) -> tuple[Service, str]:
    prefix: list[str] = []
    if uid is not None:
        for path in (tmp, *tmp.iterdir()):  # it writes its key and state there
            os.chown(path, uid, uid)
        prefix = as_user(uid)
        notes.append(f"pact-ingress ran as uid {uid} without CAP_SYS_RESOURCE/CAP_SYS_ADMIN "
                     f"(the systemd unit's limits on pipes apply)")
    argv = {
        "serve": prefix + python_module("pact_ingress", "serve", "-c", str(cfg)),
        "router": prefix + python_module("tests.bench.run_router", "-c", str(cfg)),
    }
    if profile is not None:  # cProfile costs several times the CPU: figures are not real
        argv["router"] += ["--profile", str(profile.resolve())]
        mode = "router"
        notes.append(f"PROFILED under cProfile ({profile}): pact-ingress figures are "
                     f"inflated, use them only to find hot spots")
    return harness.start_ingress_service(
        tmp, port, argv, mode, notes,
        "`tests.bench.run_router` (same router, loader, backends)")


def build_rig(tmp: Path, started: list[Service], ingress_mode: str, notes: list[str],
              profile: Path | None = None, uid: int | None = None,
              lean: bool = False) -> Rig:
    hellos = {k: tmp / f"hello-{k}.bin" for k in ("flood", "bulk", "keepalive")}
    for kind, path in hellos.items():
        path.write_bytes(hello_for(SNI[kind]))
    hello_len = len(hellos["flood"].read_bytes())
    ports = {k: free_port() for k in ("tls", "sink", "bulk", "echo", PEER, SUBJECT)}
    routes = {SNI["tls"]: ports["tls"], SNI["flood"]: ports["sink"],
              SNI["bulk"]: ports["bulk"], SNI["keepalive"]: ports["echo"]}

    pem = make_tls_pem(tmp, SNI["tls"])
    (tmp / "backends.cfg").write_text(
        haproxy_backends_cfg(tls_port=ports["tls"], pem=pem, sink_port=ports["sink"]))
    (tmp / "haproxy.cfg").write_text(haproxy_passthrough_cfg(ports[PEER], routes))
    (tmp / "ingress.yaml").write_text(ingress_yaml(tmp, ports[SUBJECT], routes))

    load_side = [
        Service("backends (haproxy: tls, sink)", haproxy_argv(tmp / "backends.cfg"),
                CORE_LOAD, tmp / "backends.log"),
        Service("backends (python: bulk, echo)",
                raw_backends_argv(hello_len, bulk=ports["bulk"], echo=ports["echo"]),
                CORE_LOAD, tmp / "raw-backends.log"),
    ]
    started.extend(load_side)
    load_side[0].start([ports["tls"], ports["sink"]])
    load_side[1].start([ports["bulk"], ports["echo"]])
    haproxy = Service("haproxy", haproxy_argv(tmp / "haproxy.cfg"), CORE_PROXY,
                      tmp / "haproxy.log")
    started.append(haproxy)
    haproxy.start([ports[PEER]])
    ingress, runner = start_ingress(tmp, tmp / "ingress.yaml", ports[SUBJECT], ingress_mode,
                                    notes, profile, uid)
    started.append(ingress)
    proxies = {PEER: haproxy, SUBJECT: ingress}
    if lean:
        ports[LEAN] = free_port()
        plain = Service(LEAN, python_module(
            "tests.bench.lean_splice", str(ports[LEAN]),
            *(f"{host}={p}" for host, p in routes.items())), CORE_PROXY, tmp / "lean.log")
        started.append(plain)
        plain.start([ports[LEAN]])
        proxies[LEAN] = plain
    return Rig(tmp, ports, proxies, load_side, runner, hellos)


# --- measuring -------------------------------------------------------------------------------


def run_phase(rig: Rig, phase: Phase, path: str) -> dict[str, Any]:
    """One load run against one path, with the proxy's and the load core's CPU."""
    meter_pids = {svc.name: svc.pid for svc in rig.load_side}
    if path != DIRECT:
        meter_pids["proxy"] = rig.proxies[path].pid
    meter = CpuMeter(meter_pids)
    argv = python_module("tests.bench.loadgen", *phase.argv,
                         "--port", str(rig.port(path, phase.backend)))
    meter.start()
    res = run_load(argv, core=CORE_LOAD, time_bound=phase.time_bound)
    used = meter.stop()
    res["proxy_cpu"] = used.get("proxy")
    res["backend_cpu"] = sum(v for k, v in used.items() if k != "proxy")
    for svc in rig.proxies.values():
        if not svc.alive():
            raise ServiceError(svc, f"died during {phase.key} on {path}")
    return res


def per_unit(res: dict[str, Any], scale: float) -> float | None:
    cpu = res.get("proxy_cpu")
    if cpu is None or not res["units"]:
        return None
    return cpu / res["units"] * scale


def capacity(res: dict[str, Any]) -> float | None:
    """Connections per second the proxy could take on its core at the measured cost:
    the flood target judged even when the load core, not the proxy, capped the rate."""
    cost = per_unit(res, 1.0)
    return 1.0 / cost if cost else None


#: metric rows: (name, unit, phase key, value from a result, target)
MetricSpec = tuple[str, str, str, Callable[[dict[str, Any]], float | None], Target | None]
METRICS: list[MetricSpec] = [
    ("new TLS conn/s, 1 client", "conn/s", "tls1", lambda r: r["rate"], None),
    ("new TLS conn/s, 8 clients", "conn/s", "tls8", lambda r: r["rate"], None),
    ("proxy CPU per TLS conn, 8 clients", "µs", "tls8", lambda r: per_unit(r, 1e6), None),
    ("ClientHello flood", "conn/s", "flood", lambda r: r["rate"], Target(min_ratio=0.85)),
    ("proxy CPU per flood conn", "µs", "flood", lambda r: per_unit(r, 1e6), None),
    ("flood capacity of one core (1 s ÷ CPU per conn)", "conn/s", "flood",
     lambda r: capacity(r), Target(min_ratio=0.85)),
    ("bulk, 1 conn", "MB/s", "bulk1", lambda r: r["rate"] / 1e6, Target(min_ratio=1.0)),
    ("bulk, 8 conns", "MB/s", "bulk8", lambda r: r["rate"] / 1e6, Target(min_ratio=1.0)),
    ("proxy CPU, bulk 1 conn", "s/GB", "bulk1", lambda r: per_unit(r, 1e9),
     Target(max_ratio=1.0)),
    ("proxy CPU, bulk 8 conns", "s/GB", "bulk8", lambda r: per_unit(r, 1e9),
     Target(max_ratio=1.0)),
    ("bulk, 100 conns", "MB/s", "bulk100", lambda r: r["rate"] / 1e6, Target(min_ratio=1.0)),
    ("proxy CPU, bulk 100 conns", "s/GB", "bulk100", lambda r: per_unit(r, 1e9),
     Target(max_ratio=1.0)),
    ("keep-alive 1 KiB, 1 conn", "req/s", "ka1", lambda r: r["rate"], Target(min_ratio=1.0)),
    ("keep-alive 1 KiB, 8 conns", "req/s", "ka8", lambda r: r["rate"], Target(min_ratio=1.0)),
    ("proxy CPU per request, 8 conns", "µs", "ka8", lambda r: per_unit(r, 1e6), None),
    ("keep-alive 1 KiB, 32 conns", "req/s", "ka32", lambda r: r["rate"],
     Target(min_ratio=0.95)),
    ("proxy CPU per request, 32 conns", "µs", "ka32", lambda r: per_unit(r, 1e6), None),
]


def raise_nofile(want: int) -> int:
    """Raise this process's fd limit (inherited by everything it starts) to `want` if it
    may; the soft limit in force afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, max(hard, want)))
        except (ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def instance_usage(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of `pid` and its live descendants: the whole instance."""
    rss = fds = 0
    for p in harness.process_tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
            fds += len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            pass  # gone meanwhile
    return rss, fds


def measure_idle(rig: Rig, conns: int, log: Callable[[str], None]) -> dict[str, Any]:
    """Hold `conns` idle passthrough connections (hello sent, then nothing) through
    pact-ingress; the instance's RSS and fds before and while they are held. A
    connection counts as held only if a ping sent on it comes back through the relay:
    an ingress out of descriptors leaves the rest in its accept queue or closes them."""
    pid, port = rig.proxies[SUBJECT].pid, rig.ports[SUBJECT]
    hello = rig.hellos["keepalive"].read_bytes()
    rss0, fds0 = instance_usage(pid)
    socks: list[socket.socket] = []
    started = time.monotonic()
    try:
        for _ in range(conns):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=IDLE_CONNECT_TIMEOUT)
                s.sendall(hello)
            except OSError as exc:  # the accept queue is full: the ingress stopped taking
                log(f"{IDLE_KEY}: connection {len(socks) + 1} failed ({exc}); stop opening")
                break
            socks.append(s)
        opened = time.monotonic() - started
        settle_fds(pid, fds0 + 2 * len(socks))
        held = count_echoing(socks)
        time.sleep(1.0)  # let the probes' pipes go back and the allocator settle
        rss1, fds1 = instance_usage(pid)
    finally:
        for s in socks:
            s.close()
    log(f"{IDLE_KEY}: {len(socks):,} conns opened in {opened:.1f} s, {held:,} held; RSS "
        f"{rss0 / 1e6:.1f} → {rss1 / 1e6:.1f} MB, fds {fds0} → {fds1}")
    return {"asked": conns, "opened": len(socks), "conns": held, "rss_before": rss0,
            "rss": rss1, "fds_before": fds0, "fds": fds1, "open_seconds": opened}


def settle_fds(pid: int, expect: int) -> None:
    """Wait until the instance holds `expect` fds, or its count stops moving."""
    last, still_since = -1, time.monotonic()
    deadline = time.monotonic() + IDLE_SETTLE_MAX
    while time.monotonic() < deadline:
        fds = instance_usage(pid)[1]
        if fds >= expect:
            return
        if fds != last:
            last, still_since = fds, time.monotonic()
        elif time.monotonic() - still_since > IDLE_SETTLE_STILL:
            return
        time.sleep(0.2)


def count_echoing(socks: list[socket.socket]) -> int:
    """How many of `socks` echo a ping back within IDLE_PROBE_WAIT (all probed at once)."""
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, bytes] = {}
    for s in socks:
        s.setblocking(False)
        try:
            s.send(b"ping")
        except OSError:
            continue
        got[s] = b""
        sel.register(s, selectors.EVENT_READ)
    held = 0
    deadline = time.monotonic() + IDLE_PROBE_WAIT
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=0.5):
            s = key.fileobj  # type: ignore[assignment]
            try:
                data = s.recv(64)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            got[s] += data
            if not data or len(got[s]) >= 4:
                sel.unregister(s)
                held += got[s] == b"ping"
    sel.close()
    return held


def idle_metrics(idle: dict[str, Any]) -> list[Metric]:
    n = max(1, idle["conns"])

    def only_subject(v: float) -> dict[str, float | None]:
        return {DIRECT: None, PEER: None, SUBJECT: v}

    return [
        Metric(f"idle passthrough conns held (of {idle['asked']:,} asked)", "conns",
               only_subject(idle["conns"])),
        Metric("RSS of the instance, idle conns held", "MB", only_subject(idle["rss"] / 1e6)),
        Metric("RSS added per idle conn", "KiB",
               only_subject((idle["rss"] - idle["rss_before"]) / n / 1024)),
        Metric("fds of the instance per idle conn", "fds", only_subject(idle["fds"] / n)),
    ]


def warm_up(rig: Rig, s: Settings) -> None:
    """Short flood + keep-alive per path: caches warm, and every route proven to work."""
    for path in paths_of(rig):
        for args in (("flood", "--hello", str(rig.hellos["flood"]), "--seconds", str(s.warmup)),
                     ("keepalive", "--hello", str(rig.hellos["keepalive"]),
                      "--seconds", str(s.warmup)),
                     ("tls", "--sni", SNI["tls"], "--max", "3", "--seconds", str(s.warmup))):
            backend = {"flood": "flood", "keepalive": "keepalive", "tls": "tls"}[args[0]]
            argv = python_module("tests.bench.loadgen", *args,
                                 "--port", str(rig.port(path, backend)))
            res = run_load(argv, core=CORE_LOAD, time_bound=s.warmup + 10)
            if res["errors"] or not res["units"]:
                raise SystemExit(f"warm-up {args[0]} via {path} failed: {json.dumps(res)}")


def measure(rig: Rig, s: Settings, log: Callable[[str], None], only: list[str] | None = None
            ) -> dict[str, dict[str, list[dict[str, Any]]]]:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    plan = [ph for ph in phases(s, rig.hellos) if only is None or ph.key in only]
    for rnd in range(s.rounds):
        for phase in plan:
            for path in paths_of(rig):
                res = run_phase(rig, phase, path)
                results.setdefault(phase.key, {}).setdefault(path, []).append(res)
                log(f"round {rnd + 1}/{s.rounds} {phase.key:6} {path:13} "
                    f"rate={res['rate']:12,.1f} err={res['errors']} "
                    f"proxy_cpu={res['proxy_cpu'] if res['proxy_cpu'] is not None else '-'} "
                    f"cores busy: proxy {res['core_busy'][str(CORE_PROXY)]:.0%} "
                    f"load {res['core_busy'][str(CORE_LOAD)]:.0%}")
    return results


def paths_of(rig: Rig) -> tuple[str, ...]:
    return PATHS + ((LEAN,) if LEAN in rig.proxies else ())


def paired_ratio(by_path: dict[str, list[dict[str, Any]]],
                 value: Callable[[dict[str, Any]], float | None],
                 subject: str = SUBJECT) -> str:
    """pact-ingress ÷ HAProxy round by round: the median and range of the per-round
    ratios. A round measures the two seconds apart, so what the host's other work does
    to both cancels out of its ratio; the table's ratio divides medians that may come
    from different rounds."""
    ratios = sorted(s / p for s, p in ((value(a), value(b)) for a, b in
                                       zip(by_path[subject], by_path[PEER], strict=True))
                    if s is not None and p)
    if not ratios:
        return "no paired rounds"
    return (f"{subject} ÷ haproxy per round: median {statistics.median(ratios):.2f}× "
            f"(range {ratios[0]:.2f}–{ratios[-1]:.2f}× over {len(ratios)} rounds)")


def build_report(results: dict[str, dict[str, list[dict[str, Any]]]], s: Settings,
                 title: str, notes: list[str], idle: dict[str, Any] | None = None) -> Report:
    report = Report(title, baseline=DIRECT, peer=PEER, subject=SUBJECT)
    for name, unit, key, value, target in METRICS:
        if key not in results:
            continue
        values: dict[str, float | None] = {}
        for path in PATHS:
            per_round = [value(r) for r in results[key][path]]
            nums = [v for v in per_round if v is not None]
            values[path] = statistics.median(nums) if nums else None
        report.add(Metric(name, unit, values, target))
        if target is not None and s.rounds > 1:
            notes.append(f"{name}: {paired_ratio(results[key], value)}")
        if LEAN in results[key]:
            nums = [v for v in (value(r) for r in results[key][LEAN]) if v is not None]
            if nums:
                notes.append(f"{name}: plain trio router (lean_splice.py) "
                             f"{statistics.median(nums):,.1f} {unit}; "
                             f"{paired_ratio(results[key], value, LEAN)}")
    if idle is not None:
        for metric in idle_metrics(idle):
            report.add(metric)
    for key, by_path in results.items():
        for path, runs in by_path.items():
            errs = sum(r["errors"] for r in runs)
            if errs:
                kinds = [r.get("error_kinds") for r in runs if r.get("error_kinds")]
                notes.append(f"{key} via {path}: {errs} errors {kinds}")
            load = max(r["core_busy"][str(CORE_LOAD)] for r in runs)
            proxy = max(r["core_busy"][str(CORE_PROXY)] for r in runs)
            if path != DIRECT and load > LOAD_BOUND and proxy < LOAD_BOUND:
                notes.append(f"{key} via {path}: load core {load:.0%} busy, proxy core "
                             f"{proxy:.0%}: the clients/backends set the pace, not the proxy")
    report.notes = notes
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1.5 s phases, 256 MiB bulk, one round")
    p.add_argument("--json", type=Path, help="also write results as JSON here")
    p.add_argument("--ingress", choices=("auto", "serve", "router"), default="auto",
                   help="how to run pact-ingress (default: serve, else the router runner)")
    p.add_argument("--seconds", type=float, help="override the timed phase length")
    p.add_argument("--rounds", type=int, help="override the number of rounds")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (configs, logs)")
    p.add_argument("--profile-ingress", type=Path, metavar="OUT",
                   help="run the router runner under cProfile, pstats to OUT (slow!)")
    p.add_argument("--ingress-uid", type=int, metavar="UID",
                   help="run pact-ingress as this unprivileged uid (needs root and setpriv)")
    p.add_argument("--lean", action="store_true",
                   help="also measure tests/bench/lean_splice.py, the plain trio SNI router on "
                        "this stack (its figures go to the notes)")
    p.add_argument("--only", help="comma-separated phases to run: " + ",".join(
        [ph.key for ph in phases(QUICK, {k: Path() for k in ("flood", "bulk", "keepalive")})]
        + [IDLE_KEY]))
    args = p.parse_args(argv)
    if shutil.which(HAPROXY) is None:
        p.error(f"{HAPROXY} not found: apt-get install haproxy")
    s = QUICK if args.quick else FULL
    if args.seconds:
        s = Settings(**{**asdict(s), "seconds": args.seconds})
    if args.rounds:
        s = Settings(**{**asdict(s), "rounds": args.rounds})

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    notes = machine_notes()
    notes.append(f"HAProxy: {tool_version([HAPROXY, '-v'])}")
    if cores_available() >= 2:
        pin_self(CORE_LOAD)
        notes.append(f"proxy under test on core {CORE_PROXY}; clients, backends and "
                     f"orchestrator on core {CORE_LOAD}")
    else:
        notes.append("fewer than 2 cores: NOT pinned, numbers are not comparable")
    only = args.only.split(",") if args.only else None
    idle_conns = 0
    if only is not None and IDLE_KEY in only:
        limit = raise_nofile(IDLE_NOFILE)
        idle_conns = min(IDLE_CONNS, (limit - IDLE_FD_RESERVE) // 2)
        if idle_conns < IDLE_CONNS:
            notes.append(f"fd limit {limit}: the idle row holds {idle_conns:,} connections, "
                         f"not {IDLE_CONNS:,}")
    tmpdir = tempfile.mkdtemp(prefix="pact-bench-")
    tmp = Path(tmpdir)
    started_at = time.monotonic()
    with services() as started:
        rig = build_rig(tmp, started, args.ingress, notes, args.profile_ingress,
                        args.ingress_uid, args.lean)
        notes.append(f"pact-ingress ran as `{rig.runner}`; mode "
                     f"{'quick (smoke)' if args.quick else 'full'}: {s.seconds:g} s phases, "
                     f"bulk {s.bulk_bytes >> 20} MiB, {s.rounds} round(s), median; flood "
                     f"{s.flood_inflight} in flight")
        log(f"rig up in {tmp} (ingress: {rig.runner}); warming up")
        warm_up(rig, s)
        results = measure(rig, s, log, only)
        idle = measure_idle(rig, idle_conns, log) if idle_conns else None
    title = f"Passthrough on loopback ({'quick smoke run' if args.quick else 'full run'})"
    report = build_report(results, s, title, notes, idle)
    return harness.finish(report, json_path=args.json, tmp=tmp, keep=args.keep,
                          started_at=started_at, log=log,
                          payload={"settings": asdict(s), "results": results, "idle": idle})


if __name__ == "__main__":
    raise SystemExit(main())
