"""Reverse-tunnel benchmark: tunnel vs direct passthrough vs `ssh -R`, one run.

    python -m tests.bench.bench_tunnel [--quick] [--json out.json] [--ingress auto]

Four paths carry the same load to the same backends, back to back:

| path | client connects to | what sits in between |
| --- | --- | --- |
| direct | the backend | nothing (context only) |
| passthrough | pact-ingress, SNI `*.direct.test` | the router splices to the backend address |
| tunnel | pact-ingress, SNI `*.tunnel.test` | router → pooled raw data connection → `pact-ingress connect` → backend |
| ssh -R | sshd's forwarded port | sshd → one SSH connection (encrypted, multiplexed) → `ssh` client → backend |

What runs where (2 cores; `--placement`): three machines — the caller's, the VPS and the
home machine — have to share two cores. Default `split`: the **edge** (pact-ingress,
which serves both the passthrough and the tunnel routes, and `sshd`) on core 0 with the
**clients** (load generators, the open-latency probe, this orchestrator); the **home
side** (the connectors, the `ssh` client) on core 1 with the backends — a home node
shares its machine with the services it exposes, and in passthrough the backend stands
on that same core, so both paths put the caller's CPU on the edge core and the home
node's on the home core. `shared` (the layout of earlier runs): clients on core 1 with
the home side, so the tunnel's connector competes with the load generators for one core,
which no real deployment does; reported for comparison.

Metrics and the tunnel's targets (tunnel ÷ passthrough and tunnel ÷ ssh -R):

- bulk MB/s, 1 and 8 streams (`loadgen bulk`, byte count checked): ≥ 0.8× passthrough
  and ≥ 2× ssh -R;
- stream-open latency p50/p99 at a paced 100 opens/s: connect() start → first response
  byte from an echo backend (hello + one byte, echoed at once); the tunnel may add
  ≤ 1 ms p99 over passthrough (difference of the two p99s, each over every round's
  opens pooled). The paths take turns of OPEN_BLOCK seconds, so host noise falls on
  all of them alike; steal reported by the hypervisor meanwhile is noted;
- new TLS connections/s, 1 and 8 clients (`loadgen tls`, full handshake, `GET /`
  answered by HAProxy on core 1): no target, reported for context;
- CPU: edge and home processes' CPU per GB and per TLS connection, from /proc.

One connector per backend (bulk sink, echo, TLS server), because a connector forwards
to one address; each is its own tenant pinned to its own key, the way three home nodes
would be. All three run during every phase; the home CPU figure is their sum (the idle
two only send heartbeats). The `ssh` client carries all three forwards over one SSH
connection, with OpenSSH's default cipher unless `--ssh-cipher` says otherwise.

pact-ingress runs as `python -m pact_ingress serve -c CONFIG` or, while `serve` cannot
start, as `python -m tests.bench.run_router --tunnel -c CONFIG` (same loader, router,
backends and `TunnelServer`); `--ingress auto` tries `serve` first and says which ran.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import random
import selectors
import shutil
import socket
import ssl
import statistics
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pact_ingress.identity import Identity, keygen
from tests.bench import harness
from tests.bench.bench_passthrough import hello_for
from tests.bench.harness import (
    CORE_LOAD,
    CORE_PROXY,
    Check,
    Comparison,
    CpuMeter,
    Row,
    Service,
    ServiceError,
    Target,
    core_busy,
    core_ticks,
    cores_available,
    free_port,
    machine_notes,
    pin_self,
    python_module,
    run_load,
    services,
    steal_ms,
    tool_version,
)
from tests.bench.peers import (
    HAPROXY,
    SSH,
    SSHD,
    haproxy_argv,
    haproxy_backends_cfg,
    make_tls_pem,
    raw_backends_argv,
    ssh_default_cipher,
    ssh_reverse_argv,
    sshd_argv,
    sshd_setup,
)

DIRECT, PASSTHROUGH, SSH_R, TUNNEL = "direct", "passthrough", "ssh -R", "tunnel"
PATHS = (DIRECT, PASSTHROUGH, SSH_R, TUNNEL)
#: Backends, each with a passthrough route `KIND.direct.test` and a tunnel route
#: `KIND.tunnel.test` (16 characters, like the captured ClientHello's SNI, so the
#: rewritten hello keeps every length field).
KINDS = ("bulk", "echo", "tls")
TUNNEL_HOSTNAME = "connect.test"
#: Generous limits for the ingress: the bench, not a limit, must be the cap.
INGRESS_MAX_CONNECTIONS = 4000
INGRESS_IDLE_TIMEOUT = "120s"
#: A core busier than this during a phase was (close to) the bottleneck.
LOAD_BOUND = 0.9
#: Per-operation socket timeout of the latency probe: a stuck open is an error.
IO_TIMEOUT = 10.0
#: Seconds allowed for the tunnels and the ssh forwards to come up.
READY_TIMEOUT = 30.0
#: The byte the latency probe sends after the hello; the echo backend returns it.
PING = b"!"
#: Longest the latency probe blocks in select() (it also wakes for the next open).
MAX_POLL = 0.1
#: Seconds of opens per path per turn: the open phase alternates paths in turns this
#: long (`interleaved_opens`), so every path sees the same stretches of host noise.
OPEN_BLOCK = 1.0
#: The slowest opens kept in the JSON output (where the tail comes from).
SLOWEST_KEPT = 20
#: Resamples for the p99-added interval (`added_interval`): ~1 s per 10k opens a path.
BOOTSTRAP_RESAMPLES = 400


def sni(kind: str, path: str) -> str:
    """The route a path's client names: tunnel routes for the tunnel, else passthrough
    (direct and ssh -R send the same hello; their backends skip it unread)."""
    return f"{kind}.{'tunnel' if path == TUNNEL else 'direct'}.test"


@dataclass(frozen=True)
class Settings:
    seconds: float  # length of each TLS phase
    bulk_bytes: int  # bytes per bulk phase (split over its streams)
    open_rate: float  # stream opens per second in the latency phase
    open_seconds: float  # length of the latency phase
    rounds: int  # each figure is the median over rounds
    warmup: float  # seconds of warm-up load per path


FULL = Settings(seconds=6.0, bulk_bytes=1 << 30, open_rate=100.0, open_seconds=12.0,
                rounds=2, warmup=1.0)
QUICK = Settings(seconds=1.5, bulk_bytes=256 << 20, open_rate=100.0, open_seconds=3.0,
                 rounds=1, warmup=0.3)


# --- the rig -----------------------------------------------------------------------------


@dataclass
class Rig:
    tmp: Path
    ports: dict[str, int]  # backends ("bulk", "echo", "tls"), "ingress", "sshd", "ssh-KIND"
    hellos: dict[str, Path]  # "KIND/PATH" → canned ClientHello file (bulk, echo)
    edge: dict[str, Service]  # path → its edge process (none for direct)
    home: dict[str, list[Service]]  # path → its home-side processes
    load_side: list[Service]
    runner: str
    client_core: int | None  # where load generators run (the probe runs in-process)

    def port(self, path: str, kind: str) -> int:
        if path == DIRECT:
            return self.ports[kind]
        if path == SSH_R:
            return self.ports[f"ssh-{kind}"]
        return self.ports["ingress"]

    def hello(self, kind: str, path: str) -> Path:
        return self.hellos[f"{kind}/{path}"]


def ingress_yaml(tmp: Path, port: int, backends: dict[str, int], pins: dict[str, str]
                 ) -> str:
    """One tenant per backend kind, pinned to that kind's connector key, with a
    passthrough route to the backend address and a tunnel route to its connector."""
    tenants = []
    for kind, backend_port in backends.items():
        tenants.append(f"""\
  - name: {kind}
    pins: ["{pins[kind]}"]
    routes:
      - {{host: {sni(kind, PASSTHROUGH)}, mode: passthrough, backend: "127.0.0.1:{backend_port}"}}
      - {{host: {sni(kind, TUNNEL)}, mode: passthrough, backend: tunnel}}""")
    return f"""\
identity:
  key: {tmp}/ingress.key
state_dir: {tmp}/state
listen:
  tls: ["127.0.0.1:{port}"]
tunnel:
  hostname: {TUNNEL_HOSTNAME}
limits:
  clienthello_timeout: 10s
  idle_timeout: {INGRESS_IDLE_TIMEOUT}
  max_connections: {INGRESS_MAX_CONNECTIONS}
  max_connections_per_ip: {INGRESS_MAX_CONNECTIONS}
tenants:
""" + "\n".join(tenants) + "\n"


def connector_yaml(key: Path, ingress_port: int, ingress_pin: str, forward: int) -> str:
    """A home node's connector config (README, "Connector config"), `connections` left at
    its default."""
    return f"""\
identity: {{key: {key}}}
ingress:
  address: "127.0.0.1:{ingress_port}"
  tunnel_hostname: {TUNNEL_HOSTNAME}
  pin: "{ingress_pin}"
forward: "127.0.0.1:{forward}"
"""


def start_ingress(tmp: Path, cfg: Path, port: int, mode: str, notes: list[str]
                  ) -> tuple[Service, str]:
    argv = {
        "serve": python_module("pact_ingress", "serve", "-c", str(cfg)),
        "router": python_module("tests.bench.run_router", "--tunnel", "-c", str(cfg)),
    }
    return harness.start_ingress_service(
        tmp, port, argv, mode, notes,
        "`tests.bench.run_router --tunnel` (same router, loader, backends, TunnelServer)")


def build_rig(tmp: Path, started: list[Service], ingress_mode: str, notes: list[str],
              ssh_cipher: str | None, client_core: int | None = CORE_LOAD) -> Rig:
    hellos: dict[str, Path] = {}
    for kind in ("bulk", "echo"):
        for path in PATHS:
            hellos[f"{kind}/{path}"] = tmp / f"hello-{kind}-{path.replace(' ', '')}.bin"
            hellos[f"{kind}/{path}"].write_bytes(hello_for(sni(kind, path)))
    hello_len = len(hellos["bulk/direct"].read_bytes())
    ports = {k: free_port() for k in ("bulk", "echo", "tls", "sink", "ingress", "sshd",
                                      "ssh-bulk", "ssh-echo", "ssh-tls")}

    ingress_id = keygen(tmp / "ingress.key", common_name="bench-ingress")
    home_ids: dict[str, Identity] = {
        kind: keygen(tmp / f"home-{kind}.key", common_name=f"bench-home-{kind}")
        for kind in KINDS}
    backends = {k: ports[k] for k in KINDS}
    (tmp / "ingress.yaml").write_text(ingress_yaml(
        tmp, ports["ingress"], backends, {k: i.fingerprint for k, i in home_ids.items()}))
    for kind in KINDS:
        (tmp / f"connector-{kind}.yaml").write_text(connector_yaml(
            home_ids[kind].key_path, ports["ingress"], ingress_id.fingerprint, ports[kind]))
    pem = make_tls_pem(tmp, sni("tls", PASSTHROUGH))
    (tmp / "backends.cfg").write_text(
        haproxy_backends_cfg(tls_port=ports["tls"], pem=pem, sink_port=ports["sink"]))
    sshd_cfg, ssh_key = sshd_setup(tmp)

    # home core: backends first
    load_side = [
        Service("backends (haproxy: tls)", haproxy_argv(tmp / "backends.cfg"), CORE_LOAD,
                tmp / "backends.log"),
        Service("backends (python: bulk, echo)",
                raw_backends_argv(hello_len, bulk=ports["bulk"], echo=ports["echo"]),
                CORE_LOAD, tmp / "raw-backends.log"),
    ]
    started.extend(load_side)
    load_side[0].start([ports["tls"]])
    load_side[1].start([ports["bulk"], ports["echo"]])

    # edge core: pact-ingress and sshd
    ingress, runner = start_ingress(tmp, tmp / "ingress.yaml", ports["ingress"],
                                    ingress_mode, notes)
    started.append(ingress)
    sshd = Service("sshd", sshd_argv(sshd_cfg, ports["sshd"]), CORE_PROXY, tmp / "sshd.log")
    started.append(sshd)
    sshd.start([ports["sshd"]])

    # home side, on the home core: connectors and the ssh client
    connectors = [Service(f"connector ({kind})", python_module(
        "pact_ingress", "connect", "-c", str(tmp / f"connector-{kind}.yaml")), CORE_LOAD,
        tmp / f"connector-{kind}.log") for kind in KINDS]
    for svc in connectors:
        started.append(svc)
        svc.start()
    ssh = Service("ssh -R", ssh_reverse_argv(
        ports["sshd"], ssh_key, {ports[f"ssh-{k}"]: ports[k] for k in KINDS}, ssh_cipher),
        CORE_LOAD, tmp / "ssh.log")
    started.append(ssh)
    ssh.start([ports[f"ssh-{k}"] for k in KINDS], timeout=READY_TIMEOUT)

    rig = Rig(tmp, ports, hellos, {PASSTHROUGH: ingress, TUNNEL: ingress, SSH_R: sshd},
              {PASSTHROUGH: [], TUNNEL: connectors, SSH_R: [ssh]}, load_side, runner,
              client_core)
    wait_tunnels(rig)
    return rig


# --- readiness probes --------------------------------------------------------------------


def probe_echo(port: int, hello: bytes) -> None:
    """hello + one byte, expect that byte back (raises on anything else)."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as s:
        s.sendall(hello + PING)
        if s.recv(len(PING)) != PING:
            raise ConnectionError("no echo")


def probe_bulk(port: int, hello: bytes) -> None:
    """hello, half-close, expect the backend's byte count 0."""
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as s:
        s.sendall(hello)
        s.shutdown(socket.SHUT_WR)
        answer = b""
        for _ in range(8):  # at most 8 reads of the 8-byte answer
            part = s.recv(8 - len(answer))
            if not part:
                break
            answer += part
            if len(answer) == 8:
                break
        if len(answer) != 8 or struct.unpack("!Q", answer)[0] != 0:
            raise ConnectionError(f"bulk backend answered {answer!r}")


def probe_tls(port: int, server_name: str) -> None:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as raw, \
            ctx.wrap_socket(raw, server_hostname=server_name) as tls:
        tls.sendall(b"GET / HTTP/1.0\r\n\r\n")
        head = tls.recv(64)
        if not (head.startswith(b"HTTP/1.") and b" 200 " in head[:16]):
            raise ConnectionError("no 200 from the TLS backend")


def _probes(rig: Rig, path: str) -> list[Callable[[], None]]:
    echo, bulk = rig.hello("echo", path).read_bytes(), rig.hello("bulk", path).read_bytes()
    return [lambda: probe_echo(rig.port(path, "echo"), echo),
            lambda: probe_bulk(rig.port(path, "bulk"), bulk),
            lambda: probe_tls(rig.port(path, "tls"), sni("tls", path))]


def wait_tunnels(rig: Rig) -> None:
    """Every route of every path answers (tunnels up, forwards working), or give up."""
    deadline = time.monotonic() + READY_TIMEOUT
    for path in PATHS:
        for check in _probes(rig, path):
            while True:
                try:
                    check()
                    break
                except (OSError, ssl.SSLError) as exc:
                    if time.monotonic() > deadline:
                        tails = "\n".join(f"--- {s.name}\n{s.log_tail(5)}"
                                          for s in rig.home[path])
                        raise SystemExit(f"{path} not ready after {READY_TIMEOUT:.0f}s: "
                                         f"{exc!r}\n{tails}") from exc
                    time.sleep(0.1)


# --- the stream-open latency probe --------------------------------------------------------


def _percentile(sorted_xs: list[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    rank = max(1, math.ceil(q / 100 * len(sorted_xs)))
    return sorted_xs[rank - 1]


def added_interval(base: list[float], other: list[float], q: float = 99,
                   resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
                   ) -> tuple[float, float]:
    """A 95% bootstrap interval for percentile `q` of `other` minus that of `base`:
    both sample sets resampled with replacement, `resamples` times, fixed seed (the
    same data gives the same interval). It treats opens as independent; host noise
    comes in bursts, so the true uncertainty is wider — it tells a difference the
    samples support from one a few slow opens made."""
    rng = random.Random(seed)
    diffs = sorted(
        _percentile(sorted(rng.choices(other, k=len(other))), q)
        - _percentile(sorted(rng.choices(base, k=len(base))), q)
        for _ in range(resamples))
    return diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]


def _latency_stats(xs: list[float]) -> dict[str, float]:
    """p50/p90/p99/max/mean of already sorted latencies ({} when there are none)."""
    if not xs:
        return {}
    return {"p50": _percentile(xs, 50), "p90": _percentile(xs, 90),
            "p99": _percentile(xs, 99), "max": xs[-1], "mean": statistics.fmean(xs)}


class _Opens:
    """The open-latency probe's state: sockets in flight with their start times."""

    def __init__(self, port: int, payload: bytes) -> None:
        self.addr = ("127.0.0.1", port)
        self.payload = payload
        self.sel = selectors.DefaultSelector()
        self.samples: list[float] = []
        self.error_kinds: dict[str, int] = {}

    def fail(self, sock: socket.socket | None, why: str) -> None:
        self.error_kinds[why] = self.error_kinds.get(why, 0) + 1
        if sock is not None:
            self.sel.unregister(sock)
            sock.close()

    def launch(self) -> None:
        t0 = time.perf_counter()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = sock.connect_ex(self.addr)
        if err not in (0, errno.EINPROGRESS):
            sock.close()
            self.fail(None, errno.errorcode.get(err, str(err)))
            return
        self.sel.register(sock, selectors.EVENT_WRITE, t0)

    def event(self, sock: socket.socket, mask: int, t0: float) -> None:
        if mask & selectors.EVENT_WRITE:  # connected (or failed): send hello + PING
            err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.fail(sock, errno.errorcode.get(err, str(err)))
                return
            try:
                sock.send(self.payload)  # ~520 bytes into an empty send buffer
            except OSError as exc:
                self.fail(sock, type(exc).__name__)
                return
            self.sel.modify(sock, selectors.EVENT_READ, t0)
            return
        try:
            first = sock.recv(len(PING))
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail(sock, type(exc).__name__)
            return
        t1 = time.perf_counter()
        if first != PING:
            self.fail(sock, "closed" if not first else "unexpected_data")
            return
        self.samples.append((t1 - t0) * 1000)
        self.sel.unregister(sock)
        sock.close()


def open_latency(port: int, hello: bytes, rate: float, seconds: float) -> dict[str, Any]:
    """Open `rate × seconds` streams on a fixed schedule whether or not earlier ones have
    answered (a slow path gets several in flight; one started over an interval after its
    slot counts as `late`). Each: non-blocking connect, hello + PING once connected, time
    from before connect() to the first byte back, close. Bounded by the count and by
    `seconds` + IO_TIMEOUT; opens still unanswered then count as `timeout` errors."""
    interval = 1.0 / rate
    count = int(rate * seconds)
    probe = _Opens(port, hello + PING)
    late = launched = 0
    before, stolen = core_ticks(), steal_ms()
    start = time.perf_counter() + 0.05
    hard_stop = start + seconds + IO_TIMEOUT
    now = time.perf_counter()
    while (launched < count or probe.sel.get_map()) and now < hard_stop:
        while launched < count and start + launched * interval <= now:
            if now - (start + launched * interval) > interval:
                late += 1
            probe.launch()
            launched += 1
        wait = MAX_POLL if launched >= count else start + launched * interval - now
        for key, mask in probe.sel.select(min(MAX_POLL, max(0.0, wait))):
            probe.event(key.fileobj, mask, key.data)  # type: ignore[arg-type]
        now = time.perf_counter()
    if launched < count:
        probe.error_kinds["not_started"] = count - launched
    for key in list(probe.sel.get_map().values()):
        probe.fail(key.fileobj, "timeout")  # type: ignore[arg-type]
    probe.sel.close()
    elapsed = now - start
    xs = sorted(probe.samples)
    stats = _latency_stats(xs)
    return {"kind": "open", "units": len(xs), "errors": sum(probe.error_kinds.values()),
            "error_kinds": probe.error_kinds, "elapsed": elapsed,
            "rate": len(xs) / elapsed if elapsed > 0 else 0.0, "late": late,
            "core_busy": core_busy(before, core_ticks()), "ms": stats,
            "steal_ms": steal_ms() - stolen, "slowest_ms": xs[-SLOWEST_KEPT:],
            "samples_ms": xs}


# --- phases --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Phase:
    key: str
    kind: str  # backend kind
    run: Callable[[Rig, str], dict[str, Any]]


def phases(s: Settings) -> list[Phase]:
    bulk_bound = max(30.0, s.bulk_bytes / 20e6)  # even 20 MB/s finishes in time

    def bulk(conns: int) -> Callable[[Rig, str], dict[str, Any]]:
        def run(rig: Rig, path: str) -> dict[str, Any]:
            return run_load(python_module(
                "tests.bench.loadgen", "bulk", "--port", str(rig.port(path, "bulk")),
                "--hello", str(rig.hello("bulk", path)), "--conns", str(conns),
                "--bytes", str(s.bulk_bytes), "--seconds", str(bulk_bound)),
                core=rig.client_core, time_bound=bulk_bound)
        return run

    def tls(procs: int) -> Callable[[Rig, str], dict[str, Any]]:
        def run(rig: Rig, path: str) -> dict[str, Any]:
            return run_load(python_module(
                "tests.bench.loadgen", "tls", "--port", str(rig.port(path, "tls")),
                "--sni", sni("tls", path), "--procs", str(procs),
                "--seconds", str(s.seconds)), core=rig.client_core, time_bound=s.seconds)
        return run

    def opens(rig: Rig, path: str) -> dict[str, Any]:
        return open_latency(rig.port(path, "echo"), rig.hello("echo", path).read_bytes(),
                            s.open_rate, s.open_seconds)

    return [
        Phase("bulk1", "bulk", bulk(1)),
        Phase("bulk8", "bulk", bulk(8)),
        Phase("open", "echo", opens),
        Phase("tls1", "tls", tls(1)),
        Phase("tls8", "tls", tls(8)),
    ]


def run_phase(rig: Rig, phase: Phase, path: str) -> dict[str, Any]:
    """One load run on one path, with the edge's, the home side's and the backends' CPU."""
    pids = {svc.name: svc.pid for svc in rig.load_side}
    if path in rig.edge:
        pids["edge"] = rig.edge[path].pid
    for svc in rig.home.get(path, []):
        pids[f"home:{svc.name}"] = svc.pid
    meter = CpuMeter(pids)
    meter.start()
    res = phase.run(rig, path)
    used = meter.stop()
    res["edge_cpu"] = used.get("edge")
    home = [v for k, v in used.items() if k.startswith("home:")]
    res["home_cpu"] = sum(home) if home else None
    res["backend_cpu"] = sum(v for k, v in used.items() if k in {s.name for s in rig.load_side})
    for svc in [*rig.edge.values(), *(s for group in rig.home.values() for s in group)]:
        if not svc.alive():
            raise ServiceError(svc, f"died during {phase.key} on {path}")
    return res


def warm_up(rig: Rig, s: Settings) -> None:
    """Short bulk, opens and TLS per path: caches and pools warm, every route proven."""
    small = Settings(**{**asdict(s), "bulk_bytes": 32 << 20, "seconds": s.warmup,
                        "open_seconds": s.warmup})
    for phase in phases(small):
        if phase.key in ("bulk8", "tls8"):
            continue
        for path in PATHS:
            res = phase.run(rig, path)
            if res["errors"] or not res["units"]:
                raise SystemExit(f"warm-up {phase.key} via {path} failed: {json.dumps(res)}")


def measure(rig: Rig, s: Settings, log: Callable[[str], None], only: list[str] | None
            ) -> dict[str, dict[str, list[dict[str, Any]]]]:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    plan = [ph for ph in phases(s) if only is None or ph.key in only]
    for rnd in range(s.rounds):
        for phase in plan:
            runs = interleaved_opens(rig, phase, s) if phase.key == "open" else \
                {path: run_phase(rig, phase, path) for path in PATHS}
            for path, res in runs.items():
                results.setdefault(phase.key, {}).setdefault(path, []).append(res)
                extra = (f"p50={res['ms'].get('p50', 0):.3f} ms p99="
                         f"{res['ms'].get('p99', 0):.3f} ms late={res['late']} "
                         f"steal={res['steal_ms']:.0f}ms"
                         if phase.key == "open" else f"rate={res['rate']:14,.1f}")
                log(f"round {rnd + 1}/{s.rounds} {phase.key:5} {path:11} {extra} "
                    f"err={res['errors']} edge_cpu={_fmt_cpu(res['edge_cpu'])} "
                    f"home_cpu={_fmt_cpu(res['home_cpu'])} cores busy: edge "
                    f"{res['core_busy'][str(CORE_PROXY)]:.0%} home "
                    f"{res['core_busy'][str(CORE_LOAD)]:.0%}")
    return results


def interleaved_opens(rig: Rig, phase: Phase, s: Settings) -> dict[str, dict[str, Any]]:
    """The open phase of one round: OPEN_BLOCK-second turns per path, round robin (the
    first path rotating), merged per path. The host's noise (steal, neighbours) comes in
    bursts of seconds; back-to-back phases of 12 s let one path have a quiet phase and
    the next a noisy one, which swung the p99 difference by ±1 ms between runs."""
    blocks = max(1, round(s.open_seconds / OPEN_BLOCK))
    block = Phase(phase.key, phase.kind, lambda r, p: open_latency(
        r.port(p, "echo"), r.hello("echo", p).read_bytes(), s.open_rate, OPEN_BLOCK))
    parts: dict[str, list[dict[str, Any]]] = {path: [] for path in PATHS}
    for b in range(blocks):
        for path in PATHS[b % len(PATHS):] + PATHS[:b % len(PATHS)]:
            parts[path].append(run_phase(rig, block, path))
    return {path: _merge_opens(runs) for path, runs in parts.items()}


def _merge_opens(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One open-phase result from its blocks: samples pooled, counts and CPU summed."""
    xs = sorted(x for r in runs for x in r["samples_ms"])
    errors: dict[str, int] = {}
    for r in runs:
        for kind, n in r["error_kinds"].items():
            errors[kind] = errors.get(kind, 0) + n

    def total(key: str) -> float | None:
        values = [r[key] for r in runs if r.get(key) is not None]
        return sum(values) if values else None

    elapsed = sum(r["elapsed"] for r in runs)
    cores = runs[0]["core_busy"].keys()
    return {"kind": "open", "units": len(xs), "errors": sum(errors.values()),
            "error_kinds": errors, "elapsed": elapsed,
            "rate": len(xs) / elapsed if elapsed > 0 else 0.0,
            "late": sum(r["late"] for r in runs), "steal_ms": total("steal_ms") or 0.0,
            "core_busy": {c: max(r["core_busy"][c] for r in runs) for c in cores},
            "ms": _latency_stats(xs),
            "slowest_ms": xs[-SLOWEST_KEPT:], "samples_ms": xs,
            "edge_cpu": total("edge_cpu"), "home_cpu": total("home_cpu"),
            "backend_cpu": total("backend_cpu")}


def _fmt_cpu(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}s"


# --- the table -------------------------------------------------------------------------------


def _per_unit(cpu_key: str, scale: float) -> Callable[[dict[str, Any]], float | None]:
    def value(r: dict[str, Any]) -> float | None:
        cpu = r.get(cpu_key)
        return None if cpu is None or not r["units"] else cpu / r["units"] * scale
    return value


@dataclass(frozen=True)
class Pooled:
    """A percentile of every round's samples together. A tail needs all of them: the
    median of per-round p99s is the p99 of whichever round was quieter, and one round
    of 800 opens puts p99 at its 8th-slowest open."""
    q: float

    def __call__(self, runs: list[dict[str, Any]]) -> float | None:
        xs = sorted(_samples(runs))
        return _percentile(xs, self.q) if xs else None


BULK_CHECKS = (Check(TUNNEL, PASSTHROUGH, Target(min_ratio=0.8)),
               Check(TUNNEL, SSH_R, Target(min_ratio=2.0)))
#: (name, unit, phase, value of one result, checks)
MetricSpec = tuple[str, str, str, Callable[[dict[str, Any]], float | None] | Pooled,
                   tuple[Check, ...]]
METRICS: list[MetricSpec] = [
    ("bulk, 1 stream", "MB/s", "bulk1", lambda r: r["rate"] / 1e6, BULK_CHECKS),
    ("bulk, 8 streams", "MB/s", "bulk8", lambda r: r["rate"] / 1e6, BULK_CHECKS),
    ("edge CPU, bulk 8 streams", "s/GB", "bulk8", _per_unit("edge_cpu", 1e9), ()),
    ("home CPU, bulk 8 streams", "s/GB", "bulk8", _per_unit("home_cpu", 1e9), ()),
    ("stream open p50 @ 100/s", "ms", "open", Pooled(50), ()),
    ("stream open p99 @ 100/s", "ms", "open", Pooled(99), ()),
    ("new TLS conn/s, 1 client", "conn/s", "tls1", lambda r: r["rate"], ()),
    ("new TLS conn/s, 8 clients", "conn/s", "tls8", lambda r: r["rate"], ()),
    ("edge CPU per TLS conn, 8 clients", "µs", "tls8", _per_unit("edge_cpu", 1e6), ()),
    ("home CPU per TLS conn, 8 clients", "µs", "tls8", _per_unit("home_cpu", 1e6), ()),
]


def _samples(runs: list[dict[str, Any]]) -> list[float]:
    return [x for r in runs for x in r.get("samples_ms", ())]


def _median(results: dict[str, dict[str, list[dict[str, Any]]]], key: str, path: str,
            value: Callable[[dict[str, Any]], float | None] | Pooled) -> float | None:
    """The figure over rounds: pooled samples for a `Pooled` percentile, else the
    median of the rounds' values."""
    if isinstance(value, Pooled):
        return value(results[key][path])
    nums = [v for v in (value(r) for r in results[key][path]) if v is not None]
    return statistics.median(nums) if nums else None


def build_report(results: dict[str, dict[str, list[dict[str, Any]]]], title: str,
                 notes: list[str], shared: bool = False) -> Comparison:
    report = Comparison(title, list(PATHS), [(TUNNEL, PASSTHROUGH), (TUNNEL, SSH_R),
                                             (PASSTHROUGH, DIRECT)])
    for name, unit, key, value, checks in METRICS:
        if key not in results:
            continue
        row = report.add(Row(name, unit, {p: _median(results, key, p, value) for p in PATHS},
                             checks))
        if key == "open" and name.startswith("stream open p99"):
            base = row.values[PASSTHROUGH]
            added: dict[str, float | None] = {}
            for p in PATHS:
                v = row.values[p]
                added[p] = None if v is None or base is None or p in (DIRECT, PASSTHROUGH) \
                    else v - base
            report.add(Row("stream open p99 added over passthrough", "ms", added,
                           (Check(TUNNEL, None, Target(max_ratio=1.0)),), ratios=False))
            base_xs, tunnel_xs = (_samples(results["open"][p]) for p in (PASSTHROUGH, TUNNEL))
            if base_xs and tunnel_xs:
                lo, hi = added_interval(base_xs, tunnel_xs)
                notes.append(f"stream open p99 added by the tunnel: 95% bootstrap interval "
                             f"{lo:.2f} to {hi:.2f} ms ({len(tunnel_xs)} opens per path, "
                             f"resampled as independent; host noise comes in bursts, so "
                             f"the true interval is wider; `--rounds N` narrows it)")
    for key, by_path in results.items():
        for path, runs in by_path.items():
            errs = sum(r["errors"] for r in runs)
            if errs:
                notes.append(f"{key} via {path}: {errs} errors "
                             f"{[r.get('error_kinds') for r in runs if r.get('error_kinds')]}")
            stolen = sum(r.get("steal_ms", 0.0) for r in runs)
            if stolen:
                notes.append(f"{key} via {path}: the hypervisor took {stolen:.0f} ms of CPU "
                             f"during these phases (steal): part of the tail is the host's")
            late = sum(r.get("late", 0) for r in runs)
            if late:
                notes.append(f"{key} via {path}: {late} opens started over one interval "
                             f"late (the probe fell behind its 100/s schedule)")
            load = max(r["core_busy"][str(CORE_LOAD)] for r in runs)
            edge = max(r["core_busy"][str(CORE_PROXY)] for r in runs)
            if path != DIRECT and load > LOAD_BOUND and edge < LOAD_BOUND:
                notes.append(f"{key} via {path}: home core {load:.0%} busy, edge core "
                             f"{edge:.0%}: the home side (backends, connector or ssh"
                             f"{', clients' if shared else ''}) set the pace")
            if path != DIRECT and edge > LOAD_BOUND and load < LOAD_BOUND:
                notes.append(f"{key} via {path}: edge core {edge:.0%} busy, home core "
                             f"{load:.0%}: the edge (proxy{'' if shared else ', clients'}) "
                             f"set the pace")
    report.notes = notes
    return report


# --- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 1.5 s TLS phases, 256 MiB bulk, 3 s of opens, one round")
    p.add_argument("--json", type=Path, help="also write results as JSON here")
    p.add_argument("--ingress", choices=("auto", "serve", "router"), default="auto",
                   help="how to run pact-ingress (default: serve, else the router runner)")
    p.add_argument("--ssh-cipher", help="cipher for ssh -R (default: OpenSSH's choice)")
    p.add_argument("--seconds", type=float, help="override the TLS phase length")
    p.add_argument("--rounds", type=int, help="override the number of rounds")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (configs, logs)")
    p.add_argument("--placement", choices=("split", "shared"), default="split",
                   help="clients on the edge core (split, default) or on the home core "
                        "(shared); see the module docstring")
    p.add_argument("--only", help="comma-separated phases to run: " +
                   ",".join(ph.key for ph in phases(QUICK)))
    args = p.parse_args(argv)
    for tool, pkg in ((HAPROXY, "haproxy"), (SSHD, "openssh-server"), (SSH, "openssh-client")):
        if shutil.which(tool) is None:
            p.error(f"{tool} not found: apt-get install {pkg}")
    s = QUICK if args.quick else FULL
    if args.seconds:
        s = Settings(**{**asdict(s), "seconds": args.seconds})
    if args.rounds:
        s = Settings(**{**asdict(s), "rounds": args.rounds})

    def log(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    notes = machine_notes()
    notes.append(f"OpenSSH: {tool_version([SSH, '-V'])}; HAProxy (TLS backend): "
                 f"{tool_version([HAPROXY, '-v'])}")
    shared = args.placement == "shared"
    client_core: int | None = CORE_LOAD if shared else CORE_PROXY
    if cores_available() >= 2:
        pin_self(client_core)
        if shared:
            notes.append(f"placement shared: edge (pact-ingress, sshd) on core {CORE_PROXY}; "
                         f"home side (connectors, ssh client), backends, clients and "
                         f"orchestrator on core {CORE_LOAD}")
        else:
            notes.append(f"placement split: edge (pact-ingress, sshd), clients and "
                         f"orchestrator on core {CORE_PROXY}; home side (connectors, ssh "
                         f"client) and backends on core {CORE_LOAD}")
    else:
        client_core = None
        notes.append("fewer than 2 cores: NOT pinned, numbers are not comparable")
    tmp = Path(tempfile.mkdtemp(prefix="pact-bench-tunnel-"))
    started_at = time.monotonic()
    with services() as started:
        rig = build_rig(tmp, started, args.ingress, notes, args.ssh_cipher, client_core)
        cipher = args.ssh_cipher or ssh_default_cipher(rig.ports["sshd"])
        notes.append(f"pact-ingress ran as `{rig.runner}`; ssh -R cipher {cipher}; mode "
                     f"{'quick (smoke)' if args.quick else 'full'}: bulk "
                     f"{s.bulk_bytes >> 20} MiB, {s.open_seconds:g} s of opens at "
                     f"{s.open_rate:g}/s, {s.seconds:g} s TLS phases, {s.rounds} round(s), "
                     f"median")
        log(f"rig up in {tmp} (ingress: {rig.runner}); warming up")
        warm_up(rig, s)
        results = measure(rig, s, log, args.only.split(",") if args.only else None)
    title = (f"Reverse tunnel on loopback ({'quick smoke run' if args.quick else 'full run'})")
    report = build_report(results, title, notes, shared)
    return harness.finish(report, json_path=args.json, tmp=tmp, keep=args.keep,
                          started_at=started_at, log=log,
                          payload={"settings": asdict(s), "results": results})


if __name__ == "__main__":
    raise SystemExit(main())
