"""`pact-ingress serve` signalled like an operator or a supervisor having a bad day.

Reloads and stop signals in the phases where they overlap: a SIGHUP while the process
drains, stop signals while it is still starting (while its modules load, while its
workers load theirs — a terminal's Ctrl-C —, while it waits for its state backend, in
the very step it begins to serve), a worker killed meanwhile. Whatever the order, the
contract holds: exit 0, exactly one final log line (`stopped` or
`stopped_before_ready`), no traceback, no worker left, the listener closed, and
systemd told the truth — never READY after STOPPING, every RELOADING followed by READY.

The windows are real waits the test holds: a passthrough connection whose backend (the
test's listener) never closes keeps the drain going; a Redis that takes the first
command and never answers keeps the start-up waiting; the moment a process first
catches a signal is read from /proc. Only the step in which serving begins is reached
in process, by sending the signal from the router's start report.
"""

from __future__ import annotations

import base64
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netutil import free_port
from tests.terminate_env import json_events

LOOPBACK = "127.0.0.1"
WAIT = 20.0
HELLO = (Path(__file__).parent / "vectors" / "clienthello" / "curl.bin").read_bytes()
HELLO_HOST = "www.example.test"  # the SNI in HELLO


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(p) for p in (task / "children").read_text().split()]
    return out


class Run:
    """One `serve --workers N` process with a NOTIFY_SOCKET, its log and its config."""

    def __init__(self, tmp: Path, workers: int, body: str, *, session: bool = False) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.config = tmp / "ingress.yaml"
        self.body = body
        self.write()
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp / "notify.sock"))
        self.told: list[str] = []
        self.log_path = tmp / "serve.log"
        env = dict(os.environ, NOTIFY_SOCKET=str(tmp / "notify.sock"),
                   PYTHONPATH=str(Path(__file__).parents[1]))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pact_ingress", "serve", "-c", str(self.config),
                 "--workers", str(workers)], stdout=log, stderr=subprocess.STDOUT, env=env,
                cwd=tmp, start_new_session=session)  # session: a terminal's job of its own
        self.kids: set[int] = set()

    def write(self, extra: str = "") -> None:
        self.config.write_text(f"state_dir: state\nlisten:\n  tls: [\"{LOOPBACK}:{self.port}\"]\n"
                               f"{self.body}{extra}")

    def wait_told(self, wanted: str) -> None:
        deadline = time.monotonic() + WAIT
        while wanted not in self.told and time.monotonic() < deadline:
            self.notify.settimeout(max(0.01, deadline - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                self.told += self.notify.recv(4096).decode().split("\n")
            if self.proc.poll() is not None:
                break
        assert wanted in self.told, (wanted, self.told, self.logs()[-3000:])

    def wait_event(self, name: str) -> None:
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and self.proc.poll() is None:
            if name in self.events():
                return
            time.sleep(0.02)
        raise AssertionError(f"no {name} logged: {self.logs()[-3000:]}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[str]:
        return [str(e.get("event")) for e in json_events(self.logs())]

    def note_kids(self) -> None:
        with contextlib.suppress(OSError):
            self.kids.update(_children(self.proc.pid))

    def stopped_before_ready(self) -> None:
        """`finish`, and it ended as a start-up stopped: exit 0, the one line that says
        so, nothing reloaded or served."""
        code, finals = self.finish()
        assert code == 0, (code, self.logs()[-3000:])
        assert finals == ["stopped_before_ready"], finals
        events = self.events()
        assert "reloaded" not in events and "serving" not in events, events

    def finish(self) -> tuple[int, list[str]]:
        """Wait for the exit; its code and the final log lines. Asserts the rest of the
        contract: no traceback, no worker left, the port free, the truth told."""
        code = self.proc.wait(timeout=WAIT)
        self.notify.setblocking(False)
        for _ in range(100):  # bounded: what is still queued for the supervisor
            try:
                self.told += self.notify.recv(4096).decode().split("\n")
            except BlockingIOError:
                break
        deadline = time.monotonic() + WAIT
        while any(_alive(p) for p in self.kids) and time.monotonic() < deadline:
            time.sleep(0.02)
        text = self.logs()
        assert "Traceback" not in text and "Exception ignored" not in text, text[-3000:]
        assert not [p for p in self.kids if _alive(p)], (self.kids, text[-3000:])
        told = [m for m in self.told if m in ("READY=1", "RELOADING=1", "STOPPING=1")]
        assert "STOPPING=1" in told, told
        assert "READY=1" not in told[told.index("STOPPING=1"):], told
        for i, msg in enumerate(told):
            assert msg != "RELOADING=1" or "READY=1" in told[i:], told
        with socket.socket() as probe:
            # the listener is closed. SO_REUSEADDR: a connection the edge closed first
            # leaves TIME_WAIT on this port, which is no listener (a bind beside a
            # listener still fails with it)
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((LOOPBACK, self.port))
        finals = [e for e in self.events() if e in ("stopped", "stopped_before_ready")]
        return code, finals

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.kids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.notify.close()


def _redis_that_never_answers(tmp: Path) -> tuple[socket.socket, str]:
    key = tmp / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    key.chmod(0o600)
    redis = socket.create_server((LOOPBACK, 0))
    redis.settimeout(WAIT)
    return redis, (f"state:\n  backend: redis\n  url: redis://{LOOPBACK}:"
                   f"{redis.getsockname()[1]}\n  encryption_key_file: state.key\n")


def test_a_sighup_during_the_drain_tells_systemd_nothing_after_stopping(
        tmp_path: Path) -> None:
    """SIGTERM, then SIGHUP (a valid new config) while a passthrough connection keeps
    the drain going: the drain ends and the process exits 0 with one `stopped` line,
    and READY never follows STOPPING (systemd would take the stopping service for
    running again)."""
    backend = socket.create_server((LOOPBACK, 0))
    backend.settimeout(WAIT)
    routes = (f"tenants:\n  - name: t\n    pins: [\"sha256:{'A' * 43}\"]\n    routes:\n"
              f"      - {{host: {HELLO_HOST}, mode: passthrough, "
              f"backend: \"{LOOPBACK}:{backend.getsockname()[1]}\"}}\n")
    run = Run(tmp_path, 1, routes)
    client = held = None
    try:
        run.wait_told("READY=1")
        client = socket.create_connection((LOOPBACK, run.port), timeout=WAIT)
        client.sendall(HELLO)
        held, _ = backend.accept()
        held.settimeout(WAIT)
        assert held.recv(65536), "the hello did not reach the backend"
        run.proc.send_signal(signal.SIGTERM)
        run.wait_told("STOPPING=1")
        run.write(f"      - {{host: late.test, mode: passthrough, backend: \"{LOOPBACK}:1\"}}\n")
        run.proc.send_signal(signal.SIGHUP)
        run.wait_event("reloaded")
        held.close()
        client.close()
        code, finals = run.finish()
        assert code == 0, run.logs()[-3000:]
        assert finals == ["stopped"], finals
    finally:
        for s in (client, held, backend):
            if s is not None:
                s.close()
        run.close()


def _caught(pid: int) -> set[int]:
    """The signals `pid` has a handler for (SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            mask = int(line.split()[1], 16)
            return {n for n in range(1, 64) if mask >> (n - 1) & 1}
    return set()


def test_signals_while_serve_loads_its_modules_are_noted_not_fatal(tmp_path: Path) -> None:
    """`serve` spends most of a second loading its modules before `app` runs: a SIGHUP
    or a SIGTERM then (systemd stopping a unit it just started, a script's reload)
    must not be the default action's death. The handlers are there before the long
    imports (the YAML and cryptography extensions are not loaded yet when SIGTERM is
    first caught), and SIGHUP, SIGTERM, SIGTERM sent at that moment end the start-up:
    exit 0, one `stopped_before_ready` line, no reload, STOPPING and never READY."""
    run = Run(tmp_path, 1, "")
    maps = None
    try:
        deadline = time.monotonic() + WAIT
        for _ in range(100_000):  # bounded: until serve first catches SIGTERM
            if time.monotonic() > deadline or run.proc.poll() is not None:
                break
            with contextlib.suppress(OSError):
                if signal.SIGTERM in _caught(run.proc.pid):
                    maps = Path(f"/proc/{run.proc.pid}/maps").read_text()
                    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGTERM):
                        run.proc.send_signal(sig)
                    break
        assert maps is not None, ("serve never caught SIGTERM", run.logs()[-3000:])
        assert run.proc.poll() is None or run.proc.returncode == 0, run.logs()[-3000:]
        loaded = [name for name in ("_yaml", "_rust.abi3") if name in maps]
        assert not loaded, f"SIGTERM caught only after loading {loaded}"
        run.stopped_before_ready()
    finally:
        run.close()


@pytest.mark.parametrize("storm", ["hup_term_term", "worker_killed_then_term"])
def test_stop_signals_while_workers_start_leave_no_worker_behind(
        tmp_path: Path, storm: str) -> None:
    """Two workers held in their start-up by a Redis that never answers; then SIGHUP,
    SIGTERM, SIGTERM to main, or a worker SIGKILLed (main respawns it) and SIGTERM.
    The start-up ends: exit 0, one `stopped_before_ready` line, no reload, and at the
    moment main is gone no worker runs on (one still starting reads its channel, and
    so learns that main is gone, only after its own start-up: up to its Redis probe's
    deadline as an orphan, writing after main's last line)."""
    redis, state = _redis_that_never_answers(tmp_path)
    run = Run(tmp_path, 2, state)
    conn = None
    try:
        conn, _ = redis.accept()  # a worker's first probe: the start-up waits for it
        conn.settimeout(WAIT)
        assert conn.recv(4096), "the probe sent no command"
        run.note_kids()
        assert len(run.kids) == 2, run.kids
        if storm == "worker_killed_then_term":
            victim = min(run.kids)
            os.kill(victim, signal.SIGKILL)
            run.wait_event("worker_exited")
            deadline = time.monotonic() + WAIT
            while len(run.kids) < 3 and time.monotonic() < deadline:  # its replacement
                run.note_kids()
                time.sleep(0.01)
            sigs = [signal.SIGTERM]
        else:
            sigs = [signal.SIGHUP, signal.SIGTERM, signal.SIGTERM]
        for sig in sigs:
            run.proc.send_signal(sig)
        run.proc.wait(timeout=WAIT)
        running = [p for p in run.kids if _alive(p)]
        assert not running, ("workers outlive main", running)
        run.stopped_before_ready()
    finally:
        if conn is not None:
            conn.close()
        redis.close()
        run.close()


def test_a_terminals_ctrl_c_while_workers_start_is_no_traceback(tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals its whole foreground process group. Sent while the
    workers are still loading their modules (each already has Python's own SIGINT
    handler, which raises KeyboardInterrupt wherever the import is), it must end
    `serve` as any stop signal before READY does: exit 0, one `stopped_before_ready`
    line, no traceback from any process, no worker left. Main tells its workers when
    to stop; a terminal's signal is not theirs to take."""
    run = Run(tmp_path, 2, "", session=True)
    try:
        deadline = time.monotonic() + WAIT
        for _ in range(100_000):  # bounded: until both workers run Python code
            if time.monotonic() > deadline or run.proc.poll() is not None:
                break
            with contextlib.suppress(OSError):
                workers = [p for p in _children(run.proc.pid) if b"pact_ingress.worker"
                           in Path(f"/proc/{p}/cmdline").read_bytes()]
                if len(workers) == 2 and all(signal.SIGINT in _caught(p) for p in workers):
                    run.note_kids()
                    os.killpg(run.proc.pid, signal.SIGINT)
                    break
        else:
            raise AssertionError("the workers never started")
        assert len(run.kids) >= 2, (run.kids, run.logs()[-3000:])
        run.proc.wait(timeout=WAIT)
        code, finals = run.finish()
        assert code == 0, (code, run.logs()[-3000:])
        assert finals == ["stopped_before_ready"], finals
    finally:
        run.close()


async def test_a_stop_signal_as_serving_starts_is_never_followed_by_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop signal lands in the very step in which the router says it serves: the
    signal task and the start-up wake together, in an order trio picks at random. If
    the signal task goes first it stops the start-up (STOPPING), and the start-up,
    woken already, must not go on to say READY. In process, because only here the
    signal can be put in that step (sent as the router reports started); a few rounds,
    since each order comes half the time."""
    import trio

    from pact_ingress import stopping
    from pact_ingress.app import Ingress
    from pact_ingress.config import load_config

    monkeypatch.setattr(stopping, "_draining", False)  # what `stop` sets stays here
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.setblocking(False)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify.sock"))
    # a SIGTERM left over when the receiver closes is sent again: ignored, not our death
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        for attempt in range(12):  # bounded: each round an order picked at random
            config = tmp_path / f"ingress{attempt}.yaml"
            config.write_text(f"state_dir: state\nlisten:\n  tls: [\"{LOOPBACK}:{free_port()}\"]\n")
            ingress = Ingress(load_config(config))
            serve = ingress.router.serve

            async def signalled_serve(listeners: Any, task_status: Any, serve: Any = serve
                                      ) -> None:
                token = trio.lowlevel.current_trio_token()

                class Status:
                    def started(self, value: Any = None) -> None:
                        # trio hands a signal to its receiver through the loop's
                        # run_sync_soon queue: the report queued behind it wakes the
                        # start-up in the very step that wakes the signal task
                        os.kill(os.getpid(), signal.SIGTERM)
                        token.run_sync_soon(task_status.started, value)

                await serve(listeners, task_status=Status())

            ingress.router.serve = signalled_serve  # type: ignore[method-assign]
            with trio.fail_after(WAIT):
                await ingress.run()
            told = []
            for _ in range(100):  # bounded: this round's messages
                try:
                    told += notify.recv(4096).decode().split("\n")
                except BlockingIOError:
                    break
            told = [m for m in told if m in ("READY=1", "STOPPING=1")]
            assert "STOPPING=1" in told, (attempt, told)
            assert "READY=1" not in told[told.index("STOPPING=1"):], (attempt, told)
            if ingress.stopped_before_ready is not None:  # nothing was served
                assert "READY=1" not in told, (attempt, told)
    finally:
        signal.signal(signal.SIGTERM, previous)
        notify.close()
