"""Reloads and drains attacked by a failing operator and a hostile client at once.

Real `pact-ingress serve` processes (one process and `--workers 2`), real TLS on loopback,
raw sockets, `h2` and curl as clients. What must hold whatever the order of events:

* a reload (SIGHUP or `POST /reload`), good or bad, never stops or replaces a process,
  and never writes a traceback;
* a bad config is refused with one `reload_refused` line naming FILE:LINE, and every
  process keeps the config it ran;
* the config in force at the end is the last one written, in main and in every worker;
* a request that should succeed does, on connections opened before, during and after;
* SIGTERM drains (requests in flight finish) and exits 0, whatever reload or signal
  comes with it.

Every load loop is bounded in count and time; nothing asserts timing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.terminate_env import (
    HOST,
    LOOPBACK,
    OPT_HOST,
    WAIT,
    H2Conn,
    Identities,
    RecordingNode,
    Serve,
    exchange,
    forget,
    make_identities,
    read_chunked_body,
    read_response,
    request_bytes,
    tls_socket,
    unsealed_call_body,
)
from tests.test_workers import by_worker, poll, worker_pids

HELLO = (Path(__file__).parent / "vectors" / "clienthello" / "curl.bin").read_bytes()
PT_HOST = "www.example.test"  # the SNI of the captured ClientHello above


@pytest.fixture
def ids(tmp_path: Path) -> Iterator[Identities]:
    yield make_identities(tmp_path)


@pytest.fixture
def node(ids: Identities) -> Iterator[RecordingNode]:
    n = RecordingNode(ids.node, client_ca=ids.ingress)
    yield n
    n.stop()


def bulk_routes(count: int, tag: str) -> str:
    """`count` passthrough routes with long names: a config whose pickled form spans
    many channel frames (several hundred KiB), as an instance with thousands of tenants
    has."""
    pad = ".".join(["x" * 60] * 3)
    return "".join(f"      - {{host: p{i}.{pad}.{tag}.test, mode: passthrough, "
                   f"backend: '{LOOPBACK}:9'}}\n" for i in range(count))


def terminate_route(host: str, node_port: int, extra: str = "") -> str:
    return f"""\
      - host: {host}
        mode: terminate
        backend: "{LOOPBACK}:{node_port}"
        seal: optional
        cert: {{cert: certs/{host}.crt, key: certs/{host}.key}}
{extra}"""


def applied_by(serve: Serve) -> dict[int, list[int]]:
    """Per worker index, the route counts of the configs it applied, in order."""
    out: dict[int, list[int]] = {}
    for e in serve.log_events():
        if e.get("event") == "worker_config_applied":
            out.setdefault(int(e["worker"]), []).append(int(e["routes"]))
    return out


def assert_no_casualty(serve: Serve, pids: dict[int, int] | None = None) -> None:
    """No process died, none was replaced, nothing wrote a traceback."""
    logs = serve.logs()
    assert serve.alive(), logs[-3000:]
    assert "Traceback" not in logs, logs[logs.find("Traceback") - 200:][:3000]
    exited = [e for e in serve.log_events() if e.get("event") in (
        "worker_exited", "worker_channel_broken", "worker_no_config")]
    assert not exited, exited
    if pids is not None:
        assert worker_pids(serve) == pids


# === a reload's config must reach a worker whole ===========================================


def test_two_reloads_queued_behind_a_slow_worker_reach_it_whole_and_in_order(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """A worker that is slow to read its channel (descheduled, busy: here SIGSTOP) while
    two reloads of a large config follow each other: the second config's frames must not
    slip between the first one's. The worker lives, applies both in order and ends on
    the last one written."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2,
                  extra_routes=bulk_routes(2000, "a"))
    try:
        pids = worker_pids(serve)
        os.kill(pids[0], signal.SIGSTOP)
        try:
            assert serve.reload(extra_routes=bulk_routes(2000, "b")) == "reloaded"
            # the worker wakes while main reads the next config: by the time main sends
            # it, the channel has room again, and the first one's rest is still queued
            serve.extra_routes = bulk_routes(2001, "c")
            serve.config.write_text(serve.render())
            serve.proc.send_signal(signal.SIGHUP)
            time.sleep(0.1)
        finally:
            os.kill(pids[0], signal.SIGCONT)
        poll(lambda: sum(e.get("event") == "reloaded" for e in serve.log_events()) == 2,
             "the second reload")
        poll(lambda: applied_by(serve).get(0, [None])[-1] == 2003
             or not serve.alive() or "Traceback" in serve.logs(), "worker 0 on the last config")
        assert_no_casualty(serve, pids)
        assert applied_by(serve) == {0: [2002, 2003], 1: [2002, 2003]}
    finally:
        serve.stop()


def test_a_reload_while_a_worker_respawns_reaches_the_new_worker_whole(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """A worker dies (OOM kill, here SIGKILL) and the operator reloads while its
    replacement is still starting, so the replacement's first config is still on its
    way: the reload's config must queue behind it, not interleave. The replacement
    starts once (no second death) and ends on the reloaded config."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2,
                  extra_routes=bulk_routes(2000, "a"))
    try:
        pids = worker_pids(serve)
        os.kill(pids[0], signal.SIGKILL)
        poll(lambda: worker_pids(serve)[0] not in (None, pids[0]), "a new worker 0 spawned")
        assert serve.reload(extra_routes=bulk_routes(2001, "c")) == "reloaded"
        poll(lambda: serve.status()["workers"][0]["state"] == "ready"
             and applied_by(serve).get(0, [None])[-1] == 2003
             or "Traceback" in serve.logs() or len(
                 [e for e in serve.log_events() if e.get("event") == "worker_exited"]) > 1,
             "the new worker 0 on the reloaded config")
        exited = [e for e in serve.log_events() if e.get("event") == "worker_exited"]
        assert [e["pid"] for e in exited] == [pids[0]], exited  # the kill, nothing more
        assert "Traceback" not in serve.logs(), serve.logs()[-3000:]
        for ip in by_worker()[0]:
            r = exchange(serve.port, request_bytes("GET", "/x", OPT_HOST), host=OPT_HOST,
                         source=ip)
            assert r.status == 200
    finally:
        serve.stop()
