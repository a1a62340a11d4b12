"""`pact-ingress demo` as a user runs it: start, run every printed command, Ctrl-C.

The demo's printed commands are the product's first impression, so the test runs them
exactly as printed (through a shell), in order, and checks what each one must show: the
caller's client-cert fingerprint at the node in passthrough, tools/list forwarded and an
unsealed call refused in terminate mode, a sealed call attributed to the caller (not the
edge), and the node's transport peer being the ingress for the sealed call. Both routes
go through the reverse tunnel, so this is also the terminate-through-tunnel end-to-end
test. Then the relay story: with the node offline a direct call gets 503 while the relay
answers `queued`; back online, the node is woken over its tunnel and fetches, opens
(the plaintext is what was sent) and acks (a second fetch is empty), and its record
shows the call attributed to the caller's key, via the relay.
"""

from __future__ import annotations

import json
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from pact_ingress.demo import PORTS, READY_LINE
from pact_ingress.identity import fingerprint_file
from tests.netutil import LISTEN_PORTS
from tests.tools import require

START_TIMEOUT = 30.0


def free_base_port() -> int:
    """PORTS consecutive free loopback ports (TLS, admin, node, control)."""
    for _ in range(50):
        base = random.choice(LISTEN_PORTS[:-PORTS])  # outside the ephemeral range
        try:
            socks = []
            for p in range(base, base + PORTS):
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
        node_fp = fingerprint_file(state / "node.key")
        commands = [l[2:] for l in lines if l.startswith("$ ")]
        assert len(commands) == 10
        outputs = []
        for cmd in commands:
            r = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=60,
                               check=False)
            assert r.returncode == 0, (cmd, r.stdout, r.stderr)
            outputs.append(r.stdout)

        (echo, tools, plain, sealed, offline, relay_send, online, relay_fetch, calls,
         status) = outputs
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

        # relay: offline means no tunnel
        assert json.loads(offline) == {"connector": "stopped", "tunnels": 0}
        # while offline the direct (terminate) call gets 503, the relay queues the envelope
        sent = _line(relay_send, "call: ")
        assert re.search(r"^direct \(\S+\): HTTP 503 ", relay_send, re.M), relay_send
        queued = _line(relay_send, "relay (relay.demo.localhost): HTTP 200 ")
        assert queued["status"] == "queued"
        # back online: woken over the tunnel; the mail run fetched, opened and acked it
        back = json.loads(online)
        assert back["connector"] == "running" and back["tunnels"] == 2
        assert back["relay_queued"] == 1 and back["woken"] is True
        assert [(i["from"], i["msg_id"]) for i in back["mail_run"]] == [
            (caller_fp, queued["msg_id"])]
        assert back["mail_run"][0]["call"] == sent  # the plaintext is what was sent
        assert back["relay_queued_now"] == 0
        # acked: fetching the node's queue again (with the node's key) finds nothing
        assert f"the relay queue of {node_fp} is empty" in relay_fetch

        # the node's own record: the direct sealed call on a link whose peer was the
        # ingress, and the relayed one attributed to the caller's key
        records = json.loads(calls)
        sealed_calls = [c for c in records if c["sealed"]]
        assert [(c["tool"], c["via"]) for c in sealed_calls] == [
            ("send_message", "direct"), ("send_message", "relay")]
        assert sealed_calls[0]["caller"] == caller_fp
        assert sealed_calls[0]["transport_peer"] == ingress_fp
        assert sealed_calls[1]["caller"] == caller_fp
        assert sealed_calls[1]["msg_id"] == sent["params"]["arguments"]["msg_id"]
        assert not any(c["tool"] == "send_message" and not c["sealed"] for c in records)
        assert re.search(r"demo\s+up\s+2", status)
        assert "relay relay.demo.localhost:" in status and " ok" in status

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def _line(output: str, prefix: str) -> Any:
    """The JSON after `prefix` on the output line that starts with it."""
    line = next((l for l in output.splitlines() if l.startswith(prefix)), None)
    assert line is not None, (prefix, output)
    return json.loads(line[len(prefix):])
