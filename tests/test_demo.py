"""`pact-ingress demo` as a user runs it: start, run every printed command, Ctrl-C.

The demo's printed commands are the product's first impression, so the test runs them
exactly as printed (through a shell) and checks what each one must show: the caller's
client-cert fingerprint at the node in passthrough, tools/list forwarded and an unsealed
call refused in terminate mode, a sealed call attributed to the caller (not the edge),
and the node's transport peer being the ingress for the sealed call. Both routes go
through the reverse tunnel, so this is also the terminate-through-tunnel end-to-end test.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pact_ingress.demo import READY_LINE
from pact_ingress.identity import fingerprint_file
from tests.tools import require

START_TIMEOUT = 30.0


def free_base_port() -> int:
    """Three consecutive free loopback ports (TLS, admin, node)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base > 65000:
            continue
        try:
            socks = []
            for p in (base, base + 1, base + 2):
                t = socket.socket()
                t.bind(("127.0.0.1", p))
                socks.append(t)
            for t in socks:
                t.close()
            return base
        except OSError:
            for t in socks:
                t.close()
    raise RuntimeError("no free port range")


def test_demo_commands_work_and_ctrl_c_exits_0(tmp_path: Path):
    require("curl")
    port = free_base_port()
    log = open(tmp_path / "demo.log", "w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pact_ingress", "--log-format", "text", "demo",
         "--port", str(port)],
        stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if line.startswith("Ctrl-C stops everything"):
                break
        assert READY_LINE in lines, "\n".join(lines) + open(tmp_path / "demo.log").read()
        state = Path(next(l for l in lines if "state (keys, configs):" in l).split(": ", 1)[1])
        caller_fp = fingerprint_file(state / "caller.key")
        ingress_fp = fingerprint_file(state / "ingress.key")
        commands = [l[2:] for l in lines if l.startswith("$ ")]
        assert len(commands) == 6
        outputs = []
        for cmd in commands:
            r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=30,
                               check=False)
            assert r.returncode == 0, (cmd, r.stdout, r.stderr)
            outputs.append(r.stdout)

        echo, tools, plain, sealed, calls, status = outputs
        # passthrough through the tunnel: the node saw the caller's own client certificate
        assert json.loads(echo)["result"]["structuredContent"]["caller"] == caller_fp
        # terminate: tools/list forwarded to the node
        names = [t["name"] for t in json.loads(tools)["result"]["tools"]]
        assert "sealed_call" in names
        # terminate: unsealed substantive call refused at the edge
        assert '"code":"seal_required"' in plain.replace(" ", "")
        # terminate: sealed call opened at the caller, attributed to the caller's key
        assert "sealed result from" in sealed
        body = json.loads(sealed[sealed.index("{"):])
        assert body["structuredContent"]["caller"] == caller_fp
        # the node's own record: sealed call on a link whose peer was the ingress
        records = json.loads(calls)
        sealed_calls = [c for c in records if c["sealed"]]
        assert [c["tool"] for c in sealed_calls] == ["send_message"]
        assert sealed_calls[0]["caller"] == caller_fp
        assert sealed_calls[0]["transport_peer"] == ingress_fp
        assert not any(c["tool"] == "send_message" and not c["sealed"] for c in records)
        assert re.search(r"demo\s+up\s+2", status)

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
