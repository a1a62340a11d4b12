"""Reusable pieces of the loopback benchmarks: pinning, child processes, CPU, tables.

Why a harness and not pytest-benchmark: these benches compare *processes* (a direct
connection, a peer proxy such as HAProxy, and pact-ingress running as its real `serve`
process) under load from other processes, pinned to separate cores, and account the CPU
each proxy process burnt. That is process management and /proc arithmetic, not timing a
Python function. Every later bench (terminate, tunnel) reuses this module: start services
with `Service`, measure with `CpuMeter`, run bounded load generators with `run_load`,
and print a `Report`.

Methodology: the proxy under test runs alone on
`CORE_PROXY`; load generators, backends and this orchestrator share `CORE_LOAD`. Every
number is compared with a direct connection measured in the same run, because this VM's
absolute figures drift (waking an idle vCPU is expensive); ratios within one run are
what is meaningful.

CPU accounting: utime + stime (+ cutime + cstime of reaped children) from
/proc/PID/stat, summed over the process and its live descendants, read before and after
each phase. The per-process figure already includes all of its threads. Resolution is one
clock tick (normally 10 ms), so short phases give coarse CPU figures.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

#: The core the proxy under test runs on (alone).
CORE_PROXY = 0
#: The core for clients, backends and the orchestrator.
CORE_LOAD = 1
#: Seconds a service gets to open its port before the bench gives up on it.
START_TIMEOUT = 20.0
#: Seconds a service gets to exit after SIGTERM before it is killed.
STOP_TIMEOUT = 5.0
#: Slack added to a load generator's own time bound before it is killed as hung.
LOAD_SLACK = 30.0
_CLK_TCK = os.sysconf("SC_CLK_TCK")
REPO = Path(__file__).resolve().parents[2]


# --- pinning ---------------------------------------------------------------------------


def cores_available() -> int:
    return len(os.sched_getaffinity(0))


def pin_self(core: int) -> None:
    """Pin this process (and every child started afterwards) to one core."""
    os.sched_setaffinity(0, {core})


def pinned(argv: Sequence[str], core: int | None) -> list[str]:
    """`argv` run under `taskset -c core` (taskset execs, so the PID is the program's)."""
    if core is None:
        return list(argv)
    return ["taskset", "-c", str(core), *argv]


# --- CPU accounting --------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
    return raw[raw.rfind(")") + 2:].split()


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        fields = _stat_fields(int(entry))
        if fields is not None:
            kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def process_tree(pid: int) -> list[int]:
    """`pid` and its live descendants (a multi-process instance is measured whole)."""
    pids = [pid]
    kids = _children_map()
    i = 0
    while i < len(pids):  # breadth-first over a finite process table
        pids.extend(kids.get(pids[i], ()))
        i += 1
    return pids


#: `cpu_seconds` parts: which /proc/PID/stat fields (man proc: utime(14) stime(15)
#: cutime(16) cstime(17); fields[0] is field 3).
_CPU_FIELDS = {"all": (11, 12, 13, 14), "user": (11, 13), "system": (12, 14)}


def cpu_seconds(pid: int, *, descendants: bool = True, part: str = "all") -> float:
    """CPU seconds (user + system, reaped children included; `part` "user" or "system"
    for one of the two) of `pid` and, by default, its live descendants. 0.0 for a process
    that is gone."""
    pids = process_tree(pid) if descendants else [pid]
    fields_of = _CPU_FIELDS[part]
    total = 0
    for p in pids:
        fields = _stat_fields(p)
        if fields is not None:
            total += sum(int(fields[i]) for i in fields_of)
    return total / _CLK_TCK


def core_ticks() -> dict[int, tuple[int, int]]:
    """Per core: (busy, total) clock ticks since boot, from /proc/stat."""
    out: dict[int, tuple[int, int]] = {}
    for line in Path("/proc/stat").read_text().splitlines():
        name, *rest = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in rest[:8])
        busy = user + nice + system + irq + softirq
        out[int(name[3:])] = (busy, busy + idle + iowait + steal)
    return out


def steal_ms() -> float:
    """Milliseconds of CPU time the hypervisor took from this VM since boot (all cores;
    /proc/stat `steal`). A phase with steal has tails that are not ours."""
    for line in Path("/proc/stat").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            return int(fields[8]) * 1000 / _CLK_TCK
    return 0.0


def core_busy(before: Mapping[int, tuple[int, int]], after: Mapping[int, tuple[int, int]]
              ) -> dict[str, float]:
    """Fraction of each core's time spent busy between two `core_ticks()` readings (by
    anything: another tenant of the machine shows up here too)."""
    out: dict[str, float] = {}
    for core, (busy, total) in after.items():
        b0, t0 = before.get(core, (busy, total))
        out[str(core)] = (busy - b0) / (total - t0) if total > t0 else 0.0
    return out


class CpuMeter:
    """CPU seconds a set of processes spend between `start()` and `stop()`."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self._before: dict[str, float] = {}
        self.used: dict[str, float] = {}

    def start(self) -> None:
        self._before = {n: cpu_seconds(p) for n, p in self.pids.items()}

    def stop(self) -> dict[str, float]:
        self.used = {n: cpu_seconds(p) - self._before[n] for n, p in self.pids.items()}
        return self.used


# --- processes -------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the service binds it right after)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


@dataclass
class Service:
    """A long-running child process (proxy, backend) with its output in a log file."""

    name: str
    argv: list[str]
    core: int | None
    log_path: Path
    env: dict[str, str] | None = None
    cwd: Path = REPO
    proc: subprocess.Popen[bytes] | None = None
    _log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} not started"
        return self.proc.pid

    def start(self, wait_ports: Sequence[int] = (), host: str = "127.0.0.1",
              timeout: float = START_TIMEOUT) -> Service:
        """Start, then wait until every port in `wait_ports` accepts connections."""
        self._log = self.log_path.open("ab")
        env = None if self.env is None else {**os.environ, **self.env}
        self.proc = subprocess.Popen(pinned(self.argv, self.core), stdin=subprocess.DEVNULL,
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=self.cwd)
        deadline = time.monotonic() + timeout
        for port in wait_ports:
            while not port_open(host, port):
                if self.proc.poll() is not None:
                    raise ServiceError(self, f"exited with {self.proc.returncode}")
                if time.monotonic() > deadline:
                    raise ServiceError(self, f"port {port} not open after {timeout:.0f}s")
                time.sleep(0.05)
        return self

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout: float = STOP_TIMEOUT) -> int | None:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self._log is not None:
            self._log.close()
        return self.proc.returncode

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


class ServiceError(RuntimeError):
    def __init__(self, service: Service, why: str) -> None:
        super().__init__(f"{service.name}: {why}\n--- {service.log_path} ---\n"
                         f"{service.log_tail()}")
        self.service = service


@contextmanager
def services() -> Iterator[list[Service]]:
    """A list to append started services to; all are stopped (in reverse) on exit."""
    started: list[Service] = []
    try:
        yield started
    finally:
        for svc in reversed(started):
            svc.stop()


def run_load(argv: Sequence[str], *, core: int | None, time_bound: float) -> dict[str, Any]:
    """Run one load generator to completion and return the JSON object it printed last.

    The generator bounds itself (count and seconds); `time_bound + LOAD_SLACK` is only
    the backstop against a hang."""
    res = subprocess.run(pinned(argv, core), capture_output=True, cwd=REPO,
                         timeout=time_bound + LOAD_SLACK, check=False)
    out = res.stdout.decode().strip().splitlines()
    if res.returncode != 0 or not out:
        raise RuntimeError(f"load generator failed ({res.returncode}): {' '.join(argv)}\n"
                           f"{res.stderr.decode()[-2000:]}")
    return dict(json.loads(out[-1]))


def python_module(module: str, *args: str) -> list[str]:
    """argv for `python -m module args` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def tool_version(argv: Sequence[str]) -> str:
    exe = shutil.which(argv[0])
    if exe is None:
        return "missing"
    res = subprocess.run(list(argv), capture_output=True, timeout=10, check=False)
    text = (res.stdout or res.stderr).decode().strip().splitlines()
    return text[0] if text else "?"


# --- results ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A pass/fail rule on subject ÷ peer (e.g. ≥ 0.75× HAProxy, or CPU ≤ 1.0×)."""

    min_ratio: float | None = None
    max_ratio: float | None = None

    def check(self, ratio: float | None) -> bool | None:
        if ratio is None:
            return None
        if self.min_ratio is not None and ratio < self.min_ratio:
            return False
        return self.max_ratio is None or ratio <= self.max_ratio

    def describe(self, peer: str) -> str:
        if self.min_ratio is not None:
            return f"≥ {self.min_ratio:g}× {peer}"
        if self.max_ratio is not None:
            return f"≤ {self.max_ratio:g}× {peer}"
        return "—"


@dataclass
class Metric:
    """One row: a figure per path (None where it does not apply, e.g. proxy CPU of a
    direct connection)."""

    name: str
    unit: str
    values: dict[str, float | None]
    target: Target | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def fmt_value(v: float | None) -> str:
    if v is None:
        return "—"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 100:
        return f"{v:.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.2f}"


def fmt_ratio(r: float | None) -> str:
    return "—" if r is None else f"{r:.2f}×"


@dataclass
class Report:
    """Three paths compared: `baseline` (direct), `peer` (e.g. haproxy), `subject`."""

    title: str
    baseline: str = "direct"
    peer: str = "haproxy"
    subject: str = "pact-ingress"
    metrics: list[Metric] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, metric: Metric) -> Metric:
        self.metrics.append(metric)
        return metric

    def row(self, m: Metric) -> dict[str, Any]:
        base, peer, subj = (m.values.get(k) for k in (self.baseline, self.peer, self.subject))
        vs_peer = _ratio(subj, peer)
        met = m.target.check(vs_peer) if m.target else None
        return {
            "metric": m.name, "unit": m.unit,
            self.baseline: base, self.peer: peer, self.subject: subj,
            f"{self.subject}/{self.baseline}": _ratio(subj, base),
            f"{self.peer}/{self.baseline}": _ratio(peer, base),
            f"{self.subject}/{self.peer}": vs_peer,
            "target": m.target.describe(self.peer) if m.target else None,
            "met": met, **({"extra": m.extra} if m.extra else {}),
        }

    def markdown(self) -> str:
        b, p, s = self.baseline, self.peer, self.subject
        head = ["metric", b, p, s, f"{s}/{b}", f"{p}/{b}", f"{s}/{p}", "target met?"]
        lines = [f"### {self.title}", "", "| " + " | ".join(head) + " |",
                 "|" + "---|" * len(head)]
        for m in self.metrics:
            r = self.row(m)
            if m.target is None:
                verdict = "—"
            else:
                word = {True: "yes", False: "**no**", None: "?"}[r["met"]]
                verdict = f"{word} ({r['target']})"
            cells = [f"{m.name} ({m.unit})", fmt_value(r[b]), fmt_value(r[p]), fmt_value(r[s]),
                     fmt_ratio(r[f"{s}/{b}"]), fmt_ratio(r[f"{p}/{b}"]),
                     fmt_ratio(r[f"{s}/{p}"]), verdict]
            lines.append("| " + " | ".join(cells) + " |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {n}" for n in self.notes)
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "paths": [self.baseline, self.peer, self.subject],
                "rows": [self.row(m) for m in self.metrics], "notes": self.notes,
                "metrics": [asdict(m) for m in self.metrics]}


def machine_notes() -> list[str]:
    """One line describing where a run happened (kernel, CPU, Python)."""
    cpu = "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    line = (f"{os.uname().sysname} {os.uname().release}, {os.cpu_count()} CPUs ({cpu}), "
            f"Python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M')}")
    return [line]


# --- results with more than three paths (tunnel bench) -------------------------------------


@dataclass(frozen=True)
class Check:
    """A pass/fail rule on one row of a `Comparison`: `num` ÷ `den` within `target`, or,
    with `den` None, the `num` path's own value (e.g. "added p99 ≤ 1 ms")."""

    num: str
    den: str | None
    target: Target

    def value(self, values: Mapping[str, float | None]) -> float | None:
        v = values.get(self.num)
        return v if self.den is None else _ratio(v, values.get(self.den))

    def describe(self, unit: str) -> str:
        if self.den is not None:
            return self.target.describe(self.den)
        bound = self.target.min_ratio if self.target.min_ratio is not None else \
            self.target.max_ratio
        op = "≥" if self.target.min_ratio is not None else "≤"
        return f"{self.num} {op} {bound:g} {unit}"


@dataclass
class Row:
    """One row of a `Comparison`; `ratios=False` for rows where a quotient means nothing
    (differences, such as added latency)."""

    name: str
    unit: str
    values: dict[str, float | None]
    checks: tuple[Check, ...] = ()
    ratios: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


_VERDICT = {True: "yes", False: "**no**", None: "?"}


@dataclass
class Comparison:
    """Any number of paths side by side, chosen ratio columns (`num`, `den`), and rows
    that carry their own checks: the tunnel bench compares four paths and checks the
    tunnel against two of them."""

    title: str
    paths: list[str]
    ratios: list[tuple[str, str]]
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        return row

    def row_dict(self, r: Row) -> dict[str, Any]:
        out: dict[str, Any] = {"metric": r.name, "unit": r.unit}
        out.update({p: r.values.get(p) for p in self.paths})
        for num, den in self.ratios:
            out[f"{num}/{den}"] = (_ratio(r.values.get(num), r.values.get(den))
                                   if r.ratios else None)
        out["checks"] = [{"rule": c.describe(r.unit), "value": c.value(r.values),
                          "met": c.target.check(c.value(r.values))} for c in r.checks]
        if r.extra:
            out["extra"] = r.extra
        return out

    def markdown(self) -> str:
        head = ["metric", *self.paths, *(f"{n}/{d}" for n, d in self.ratios), "target met?"]
        lines = [f"### {self.title}", "", "| " + " | ".join(head) + " |",
                 "|" + "---|" * len(head)]
        for r in self.rows:
            d = self.row_dict(r)
            verdicts = [f"{_VERDICT[c['met']]} ({c['rule']})" for c in d["checks"]]
            cells = [f"{r.name} ({r.unit})", *(fmt_value(d[p]) for p in self.paths),
                     *(fmt_ratio(d[f'{n}/{den}']) for n, den in self.ratios),
                     "; ".join(verdicts) or "—"]
            lines.append("| " + " | ".join(cells) + " |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {n}" for n in self.notes)
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"title": self.title, "paths": self.paths,
                "rows": [self.row_dict(r) for r in self.rows], "notes": self.notes}


def finish(report: Any, *, json_path: Path | None, payload: Mapping[str, Any], tmp: Path,
           keep: bool, started_at: float, log: Any) -> int:
    """The common end of every bench: table to stdout, optional JSON, temp dir cleanup."""
    print(report.markdown())
    log(f"done in {time.monotonic() - started_at:.0f} s")
    if json_path:
        json_path.write_text(json.dumps({"report": report.as_json(), **payload}, indent=1))
    if keep:
        log(f"kept {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


def start_ingress_service(tmp: Path, port: int, argv: Mapping[str, list[str]], mode: str,
                          notes: list[str], fallback_note: str) -> tuple[Service, str]:
    """Start pact-ingress as `serve`, or (mode "auto") fall back to the `router` runner
    when `serve` cannot start, saying so in `notes`. Returns (service, runner used)."""
    order = ["serve", "router"] if mode == "auto" else [mode]
    for runner in order:
        svc = Service(f"pact-ingress ({runner})", argv[runner], CORE_PROXY,
                      tmp / f"ingress-{runner}.log")
        try:
            return svc.start([port]), runner
        except ServiceError as exc:
            svc.stop()
            if runner == order[-1]:
                raise
            why = svc.log_tail(1).strip() or str(exc).splitlines()[0]
            notes.append(f"`serve` could not start ({why[:160]}); measured {fallback_note}")
    raise AssertionError("unreachable")

