"""`pact-ingress serve` stopped while it is still starting.

systemd (a stop during activation, or its start timeout), a container runtime or a
script may send SIGTERM before the process said READY. It must stop as it would once
serving: exit 0, one line that says it stopped before it was ready, no traceback, no
worker process left behind — not a death by the signal, which supervisors and shells
report as a failure.

The window is a real wait of the start-up: the state backend's first probe. Its Redis
is a listener the test holds, which takes the connection and reads the first command
but never answers; once that command has arrived the start-up is waiting for the probe
(for up to its connect deadline, 2 s), and the signal is sent then.
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

from tests.netutil import free_port
from tests.terminate_env import json_events

LOOPBACK = "127.0.0.1"
WAIT = 20.0


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_while_starting_stops_cleanly(tmp_path: Path) -> None:
    """SIGTERM (twice, as an impatient operator sends it) while the start-up waits for
    Redis: with two workers, the first probe is theirs (main waits for them to be READY
    before its own, and a worker probes before it is), so main is still spawning them:
    exit 0, STOPPING and never READY told to the supervisor, one `stopped_before_ready`
    line naming the signal, nothing served, no traceback from any process, and no
    worker left (main kills and reaps a worker still starting)."""
    workers = 2
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)) + b"\n")
    key.chmod(0o600)
    redis = socket.create_server((LOOPBACK, 0))
    redis.settimeout(WAIT)
    config = tmp_path / "ingress.yaml"
    config.write_text(f"""\
state_dir: state
listen:
  tls: ["{LOOPBACK}:{free_port()}"]
state:
  backend: redis
  url: redis://{LOOPBACK}:{redis.getsockname()[1]}
  encryption_key_file: state.key
""")
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    notify.setblocking(False)
    log_path = tmp_path / "serve.log"
    env = dict(os.environ, NOTIFY_SOCKET=str(tmp_path / "notify.sock"),
               PYTHONPATH=str(Path(__file__).parents[1]))
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "serve", "-c", str(config),
             "--workers", str(workers)], stdout=log, stderr=subprocess.STDOUT, env=env,
            cwd=tmp_path)
    conn = None
    try:
        conn, _ = redis.accept()  # the first probe connects...
        conn.settimeout(WAIT)
        assert conn.recv(4096), "the probe sent no command"  # ...and waits for its answer
        children = _children(proc.pid)
        assert len(children) == workers, children
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if conn is not None:
            conn.close()
        redis.close()
    deadline = time.monotonic() + WAIT
    while any(_alive(p) for p in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in children), children
    text = log_path.read_text(errors="replace")
    events = json_events(text)
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    names = [e.get("event") for e in events]
    assert "serving" not in names, names
    stopped = [e for e in events if e.get("event") in ("stopped", "stopped_before_ready")]
    assert [(e["event"], e.get("signal")) for e in stopped] == \
        [("stopped_before_ready", "SIGTERM")], stopped
    told = []
    for _ in range(100):  # bounded: what the process told its supervisor
        try:
            told += notify.recv(4096).decode().split("\n")
        except BlockingIOError:
            break
    notify.close()
    assert "STOPPING=1" in told and "READY=1" not in told, told


def test_stop_signals_before_the_receiver_are_noted_not_fatal() -> None:
    """Before `serve`'s receiver is open (before trio runs, or while it builds the
    ingress), a stop signal is noted for the receiver to take, once; without noting
    (every other process) it still kills."""
    code = (
        "import os, signal\n"
        "from pact_ingress import stopping\n"
        "stopping.guard(note_early=True)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "print(stopping.take_early(), stopping.take_early(), flush=True)\n"
        "stopping.guard()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('survived', flush=True)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=WAIT, env=env, check=False)
    assert done.stdout.split("\n") == [f"[{int(signal.SIGTERM)}, {int(signal.SIGINT)}] []",
                                       ""], (done.stdout, done.stderr)
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr)
