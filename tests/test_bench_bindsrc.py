"""The terminate bench's source-address shim (tests/bench/bindsrc.c): built with the
system C compiler, preloaded into a real client (curl, which cannot be told the address
here: no --interface), it must make every IPv4 TCP connection come from BINDSRC_ADDR,
leave connections alone without it, and refuse to connect from the wrong address when the
address is bad. Also the bench's check that every worker served requests."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests.bench.bench_terminate import ScalingRun, build_bindsrc, check_workers_served


def _peers_of(argv_env: list[tuple[list[str], dict[str, str]]]) -> list[tuple[str, int]]:
    """Run each client against a fresh loopback listener; the peer address it came from
    (or the client's exit code when it never connected)."""
    out: list[tuple[str, int]] = []
    for argv, env in argv_env:
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        srv.settimeout(5)
        port = srv.getsockname()[1]
        seen: list[str] = []

        def accept() -> None:
            try:
                conn, addr = srv.accept()
            except OSError:
                return
            seen.append(addr[0])
            conn.recv(4096)
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            conn.close()

        t = threading.Thread(target=accept)
        t.start()
        res = subprocess.run([*argv, f"http://127.0.0.1:{port}/"], env={**os.environ, **env},
                             capture_output=True, timeout=20, check=False)
        srv.close()
        t.join(15)
        out.append((seen[0] if seen else "", res.returncode))
    return out


def test_shim_binds_the_source_address(tmp_path: Path) -> None:
    shim = str(build_bindsrc(tmp_path))
    curl = ["curl", "-s", "-o", "/dev/null", "--max-time", "10"]
    results = _peers_of([
        (curl, {"LD_PRELOAD": shim, "BINDSRC_ADDR": "127.0.0.2"}),
        (curl, {"LD_PRELOAD": shim, "BINDSRC_ADDR": "127.0.0.4"}),
        (curl, {"LD_PRELOAD": shim}),  # no address: untouched
        (curl, {"LD_PRELOAD": shim, "BINDSRC_ADDR": "not-an-address"}),
    ])
    assert results[0] == ("127.0.0.2", 0)
    assert results[1] == ("127.0.0.4", 0)
    assert results[2] == ("127.0.0.1", 0)
    assert results[3][0] == "" and results[3][1] != 0  # never from 127.0.0.1 by mistake


def _run(workers: dict[str, int]) -> ScalingRun:
    return ScalingRun("pact-ingress, N workers", 100, 0, 1.0, 0.1, 0.0, 0.1, {},
                      worker_requests=workers)


def test_a_worker_that_served_nothing_fails_the_run() -> None:
    check_workers_served(_run({"0": 60, "1": 40}), {0, 1})
    with pytest.raises(SystemExit, match=r"worker\(s\) \[1\] served no request"):
        check_workers_served(_run({"0": 100, "1": 0}), {0, 1})
    with pytest.raises(SystemExit, match="no workers in /status"):
        check_workers_served(_run({}), {0, 1})
