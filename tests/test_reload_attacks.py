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
    H2Result,
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


# === helpers for traffic during reloads ====================================================


class Echo:
    """A raw TCP echo server on loopback: the passthrough route's backend."""

    def __init__(self) -> None:
        self.listener = socket.create_server((LOOPBACK, 0))
        self.port = int(self.listener.getsockname()[1])
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:
                pass

    def stop(self) -> None:
        self.listener.close()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


def passthrough_route(echo_port: int) -> str:
    return f"      - {{host: {PT_HOST}, mode: passthrough, backend: '{LOOPBACK}:{echo_port}'}}\n"


def write_atomic(path: Path, text: str) -> None:
    """As an operator's tool (or `tenant add`) should: a reader never sees half a file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def curl() -> str:
    import shutil

    path = shutil.which("curl")
    assert path, "curl is required for this test (apt-get install -y curl)"
    return path


def admin_reload(serve: Serve) -> tuple[int, str]:
    """`curl -X POST /reload`: the HTTP status and the body."""
    import subprocess

    out = subprocess.run([curl(), "-s", "-X", "POST", "-w", "\n%{http_code}", "--max-time",
                          str(WAIT), f"http://{LOOPBACK}:{serve.admin_port}/reload"],
                         capture_output=True, text=True, timeout=WAIT + 5, check=False)
    body, _, code = out.stdout.rpartition("\n")
    return int(code or 0), body


class Traffic:
    """Keep-alive HTTP/1.1 and HTTP/2 clients on a terminate route and passthrough
    connections, each from every given source address, looping (bounded) until
    stopped. Every answer that is not what the route promises is recorded."""

    #: Each client's pause between requests: load, not a busy loop on two shared cores.
    PAUSE = 0.002

    def __init__(self, serve: Serve, sources: list[str], *, max_rounds: int = 20_000,
                 max_seconds: float = 60.0) -> None:
        self.serve, self.max_rounds = serve, max_rounds
        self.deadline = time.monotonic() + max_seconds
        self.stop_event = threading.Event()
        self.failures: list[str] = []
        self.done = {"h1": 0, "h2": 0, "pt": 0}
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=fn, args=(ip,), daemon=True)
                        for ip in sources for fn in (self._h1, self._h2, self._pt)]
        for t in self.threads:
            t.start()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.done[kind] += 1

    def _fail(self, what: str) -> None:
        with self._lock:
            self.failures.append(what)

    def _h1(self, ip: str) -> None:
        sock = tls_socket(self.serve.port, OPT_HOST, source=ip)
        try:
            for i in range(self.max_rounds):
                if self.stop_event.wait(self.PAUSE) or time.monotonic() > self.deadline:
                    return
                sock.sendall(request_bytes("GET", f"/h1/{i}", OPT_HOST))
                resp = read_response(sock)
                if resp.status != 200:
                    return self._fail(f"h1 {ip} #{i}: {resp.status_line}")
                self._count("h1")
        except (OSError, ConnectionError) as exc:
            self._fail(f"h1 {ip}: {exc!r}")
        finally:
            forget(sock)

    def _h2(self, ip: str) -> None:
        conn = H2Conn(self.serve.port, OPT_HOST, source=ip)
        try:
            for i in range(self.max_rounds):
                if self.stop_event.wait(self.PAUSE) or time.monotonic() > self.deadline:
                    return
                res = conn.request("GET", f"/h2/{i}")
                if res.status != 200:
                    return self._fail(f"h2 {ip} #{i}: {res}")
                self._count("h2")
        except (OSError, TimeoutError) as exc:
            self._fail(f"h2 {ip}: {exc!r}")
        finally:
            conn.close()

    def _pt(self, ip: str) -> None:
        sock = socket.create_connection((LOOPBACK, self.serve.port), timeout=WAIT,
                                        source_address=(ip, 0))
        try:
            sock.sendall(HELLO)
            if recv_exact(sock, len(HELLO)) != HELLO:
                return self._fail(f"pt {ip}: hello not echoed")
            for i in range(self.max_rounds):
                if self.stop_event.wait(self.PAUSE) or time.monotonic() > self.deadline:
                    return
                msg = f"ping {ip} {i}".encode()
                sock.sendall(msg)
                if recv_exact(sock, len(msg)) != msg:
                    return self._fail(f"pt {ip} #{i}: echo lost")
                self._count("pt")
        except OSError as exc:
            self._fail(f"pt {ip}: {exc!r}")
        finally:
            sock.close()

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(WAIT)
        assert not any(t.is_alive() for t in self.threads), "a client hung"


#: Budgets far above what the bounded loops can spend: the load is not what is judged.
UNLIMITED = {"calls_per_hour_per_ip": 10_000_000, "calls_per_hour_per_ip_key": 10_000_000}


def route_hosts(serve: Serve) -> set[str]:
    return {r["host"] for r in serve.status()["routes"]}


# === 1. reload storms under traffic ========================================================


@pytest.mark.parametrize("workers", [1, 2])
def test_a_reload_storm_under_traffic_fails_no_request_and_ends_on_the_last_config(
        tmp_path: Path, ids: Identities, node: RecordingNode, workers: int) -> None:
    """SIGHUPs back to back, with `POST /reload` calls among them, while keep-alive
    HTTP/1.1 and HTTP/2 clients and passthrough connections run from addresses of every
    worker. Each config differs (a growing list of routes, a changed limit): no request
    fails, no process dies or is replaced, nothing writes a traceback, no reload is
    refused, and main and every worker end on the last config written."""
    echo = Echo()
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=workers, limits=UNLIMITED,
                  extra_routes=passthrough_route(echo.port))
    traffic = None
    try:
        pids = worker_pids(serve) if workers > 1 else None
        sources = [ips[0] for ips in by_worker().values()]
        traffic = Traffic(serve, sources)
        poll(lambda: all(traffic.done.values()) or traffic.failures, "traffic of every kind")
        rounds = 30
        for k in range(1, rounds + 1):
            serve.limits = {**UNLIMITED, "max_body_bytes": 100_000 + k}
            serve.extra_routes = passthrough_route(echo.port) + "".join(
                f"      - {{host: s{j}.storm.test, mode: passthrough, "
                f"backend: '{LOOPBACK}:9'}}\n" for j in range(k))
            write_atomic(serve.config, serve.render())
            if k % 5 == 0:
                code, body = admin_reload(serve)
                assert code == 200 and json.loads(body)["ok"] is True, (code, body)
            else:
                serve.proc.send_signal(signal.SIGHUP)
            time.sleep(0.02)
        final = {HOST, OPT_HOST, PT_HOST} | {f"s{j}.storm.test" for j in range(rounds)}
        poll(lambda: route_hosts(serve) == final, "main on the last config")
        if workers > 1:
            poll(lambda: all(counts[-1] == len(final)
                             for counts in applied_by(serve).values()), "workers on it too")
        before = dict(traffic.done)
        poll(lambda: all(traffic.done[k] > before[k] for k in before) or traffic.failures,
             "traffic after it")
        traffic.stop()
        assert traffic.failures == []
        assert_no_casualty(serve, pids)
        events = serve.log_events()
        assert not [e for e in events if e.get("event") == "reload_refused"]
        assert sum(e.get("event") == "reloaded" for e in events) >= rounds // 5
        if workers > 1:
            assert set(applied_by(serve)) == {0, 1}
    finally:
        if traffic is not None:
            traffic.stop()
        serve.stop()
        echo.stop()


# === 2. good and bad configs alternating under load ========================================


INCLUDE = "include: tenants.d/*.yaml\n"


def bad_configs(serve: Serve, tmp: Path) -> list[tuple[str, str, Path, str]]:
    """(name, config text, the file the refusal must name, a fragment of its message)
    for configs an operator gets wrong, each with exactly one problem. `serve.render()`
    ends inside the `tenants:` list, so a tenant appended there is one more tenant."""
    base, cfg = serve.render(), serve.config
    lines = (base + INCLUDE).count("\n")
    certs = tmp / "certs"
    (certs / "km.attack.test.crt").write_bytes((certs / f"{HOST}.crt").read_bytes())
    enc = tmp / "enc.key"
    enc.write_text("A" * 43 + "=\n")
    enc.chmod(0o644)

    def tenant(name: str, routes: str) -> str:
        return f"  - name: {name}\n    pins: [\"{serve.node_fp}\"]\n    routes:\n{routes}"

    key_missing = terminate_route("km.attack.test", serve.node.port).replace(
        "certs/km.attack.test.key", "certs/km-missing.key")
    duplicate = f"      - {{host: {OPT_HOST}, mode: passthrough, backend: '{LOOPBACK}:9'}}\n"
    return [
        ("yaml syntax", base + INCLUDE + "  - this is: [not a tenant\n", cfg,
         "YAML syntax error"),
        ("unknown key", base + INCLUDE + "bogus_key: 1\n", cfg,
         f"{lines + 1}: unknown key 'bogus_key'"),
        ("key file missing", base + tenant("km", key_missing) + INCLUDE, cfg,
         "certs/km-missing.key does not exist, but its partner does"),
        ("secret file 0644", base + INCLUDE + "state:\n  backend: redis\n"
         "  url: redis://127.0.0.1:1/0\n  encryption_key_file: enc.key\n", cfg,
         "is readable by every user"),
        ("duplicate host", base + tenant("dup", duplicate) + INCLUDE, cfg,
         f"host '{OPT_HOST}' is already routed by tenant 'attack'"),
        # an included tenant file whose tenant was deleted, its routes left behind
        ("tenant gone", base + INCLUDE, tmp / "tenants.d" / "ghost.yaml",
         "tenant needs 'name'"),
    ]


def test_bad_reloads_alternating_with_good_ones_under_load(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """With `--workers 2` and traffic running: a YAML syntax error, an unknown key, a
    cert whose key file is missing, a secret file readable by every user, a host routed
    twice, an included tenant file whose tenant is gone (its pins and routes left),
    each followed by a good config. Each bad one: exactly one `reload_refused` line
    naming FILE:LINE, no worker touched; each good one: applied by main and both
    workers. Nothing fails, dies or writes a traceback."""
    echo = Echo()
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2, limits=UNLIMITED,
                  extra_routes=passthrough_route(echo.port))
    traffic = None
    (tmp_path / "tenants.d").mkdir()
    try:
        pids = worker_pids(serve)
        traffic = Traffic(serve, [ips[0] for ips in by_worker().values()])
        poll(lambda: all(traffic.done.values()) or traffic.failures, "traffic of every kind")
        cases = bad_configs(serve, tmp_path)
        hosts = {HOST, OPT_HOST, PT_HOST}
        for n, (name, text, where, fragment) in enumerate(cases):
            ghost = tmp_path / "tenants.d" / "ghost.yaml"
            if name == "tenant gone":
                # its name line deleted with the tenant, its pins and routes left behind
                write_atomic(ghost, f"pins: [\"{serve.node_fp}\"]\nroutes:\n  - {{host: "
                             f"ghost.attack.test, mode: passthrough, backend: '{LOOPBACK}:9'}}\n")
            refused_before = [e for e in serve.log_events() if e.get("event") ==
                              "reload_refused"]
            applied_before = applied_by(serve)
            if n % 2:
                write_atomic(serve.config, text)
                code, body = admin_reload(serve)
                assert code == 422, (name, code, body)
                outcome = "reload_refused"
            else:
                outcome = serve.reload(text)
            assert outcome == "reload_refused", (name, outcome)
            refused = [e for e in serve.log_events()
                       if e.get("event") == "reload_refused"][len(refused_before):]
            assert len(refused) == 1, (name, refused)
            line = refused[0]["error"]
            assert line.startswith(f"{where}:") and line.split(":")[1].isdigit(), (name, line)
            assert fragment in line, (name, line)
            assert "\n" not in line, (name, line)
            assert route_hosts(serve) == hosts, name
            ghost.unlink(missing_ok=True)
            # a good one follows: applied everywhere
            hosts = hosts | {f"g{n}.good.test"}
            serve.extra_routes += (f"      - {{host: g{n}.good.test, mode: passthrough, "
                                   f"backend: '{LOOPBACK}:9'}}\n")
            assert serve.reload(serve.render() + INCLUDE) == "reloaded"
            assert route_hosts(serve) == hosts, name
            poll(lambda before=applied_before: all(
                len(applied_by(serve).get(w, [])) == len(before.get(w, [])) + 1 for w in (0, 1)),
                f"both workers take the good config ({name})")
            assert {w: c[-1] for w, c in applied_by(serve).items()} == {0: len(hosts),
                                                                        1: len(hosts)}
        before = dict(traffic.done)
        poll(lambda: all(traffic.done[k] > before[k] for k in before) or traffic.failures,
             "traffic after it")
        traffic.stop()
        assert traffic.failures == []
        assert_no_casualty(serve, pids)
        assert "Traceback" not in serve.logs()
    finally:
        if traffic is not None:
            traffic.stop()
        serve.stop()
        echo.stop()


# === 3. with workers: open connections on every worker follow the reload ===================

GONE_HOST = "gone.attack.test"


def test_open_connections_on_every_worker_follow_reloads_and_ignore_a_bad_one(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """`--workers 2`, keep-alive HTTP/1.1 and HTTP/2 connections opened on each worker
    before any reload. A reload lowering `max_body_bytes` makes the next upload on each
    of them 413; a bad reload (that would also drop a route and the limit) changes
    nothing anywhere; a reload that removes a terminate route makes the next request on
    each connection to it 421. No connection is cut, no process replaced."""
    routes = terminate_route(GONE_HOST, node.port)
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2, limits=UNLIMITED,
                  extra_routes=routes)
    opened: list[Any] = []
    try:
        pids = worker_pids(serve)
        groups = by_worker()
        conns: dict[tuple[int, str], tuple[Any, Any]] = {}
        for w, ips in groups.items():
            for host in (GONE_HOST, OPT_HOST):
                h1 = tls_socket(serve.port, host, source=ips[0])
                h2c = H2Conn(serve.port, host, source=ips[0])
                opened += [h1, h2c]
                conns[(w, host)] = (h1, h2c)
        assert serve.status()["workers"][0]["open_connections"] == 4
        assert serve.status()["workers"][1]["open_connections"] == 4

        def h1_get(sock: Any, host: str) -> int:
            sock.sendall(request_bytes("GET", "/k", host))
            return read_response(sock).status

        upload = b"u" * 2000

        def h2_upload(h2c: H2Conn) -> int | None:
            return h2c.request("POST", "/up", body=upload,
                               content_type="application/octet-stream").status

        for (w, host), (h1, h2c) in conns.items():
            assert h1_get(h1, host) == 200 and h2c.request("GET", "/k").status == 200
            if host == OPT_HOST:
                assert h2_upload(h2c) == 200

        # the limit goes down: every worker applies it to connections already open
        assert serve.reload(limits={**UNLIMITED, "max_body_bytes": 1000}) == "reloaded"
        for w in groups:
            h1, h2c = conns[(w, OPT_HOST)]
            assert h2_upload(h2c) == 413, w
            assert h1_get(h1, OPT_HOST) == 200, w  # the connection is as it was

        # a bad config that would undo both: refused, nobody changes
        bad = serve.render().replace(routes, "").replace("max_body_bytes: 1000",
                                                         "max_body_bytes: 1000000") + "oops\n"
        assert serve.reload(bad) == "reload_refused"
        for w in groups:
            assert h2_upload(conns[(w, OPT_HOST)][1]) == 413, w
            h1, h2c = conns[(w, GONE_HOST)]
            assert h1_get(h1, GONE_HOST) == 200 and h2c.request("GET", "/k").status == 200, w

        # the route goes: the next request on each open connection to it is misdirected
        def gone_seen() -> int:
            return sum(f"host={GONE_HOST}" in ";".join(r.header_values("forwarded"))
                       for r in node.requests())

        gone_before = gone_seen()
        assert gone_before >= 4
        assert serve.reload(extra_routes="") == "reloaded"
        for w in groups:
            h1, h2c = conns[(w, GONE_HOST)]
            assert h2c.request("GET", "/k").status == 421, w
            assert h1_get(h1, GONE_HOST) == 421, w
            h1, h2c = conns[(w, OPT_HOST)]
            assert h1_get(h1, OPT_HOST) == 200 and h2c.request("GET", "/k").status == 200, w
        assert gone_seen() == gone_before  # the node never saw the removed route again
        assert_no_casualty(serve, pids)
    finally:
        for c in opened:
            if isinstance(c, H2Conn):
                c.close()
            else:
                forget(c)
        serve.stop()


# === 4. SIGTERM with reloads and more SIGTERMs ==============================================


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("scenario", ["sigterm_during_reload", "reload_during_drain",
                                      "sigterm_twice"])
def test_sigterm_with_reloads_drains_and_exits_zero(
        tmp_path: Path, ids: Identities, node: RecordingNode, scenario: str,
        workers: int) -> None:
    """Streaming answers in flight (one per worker) and an idle keep-alive connection,
    then SIGTERM together with a reload of a large config (SIGHUP right before it), or
    with reloads during the drain (SIGHUP and `POST /reload`), or twice. Whatever the
    order: every stream finishes whole, the idle connection is closed, every process
    exits 0 (well within the drain deadline), and nothing writes a traceback."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=workers, limits=UNLIMITED)
    streams: list[Any] = []
    idle = None
    try:
        pids = worker_pids(serve) if workers > 1 else {}
        for ips in by_worker().values():
            sock = tls_socket(serve.port, OPT_HOST, source=ips[0])
            streams.append(sock)
            sock.sendall(request_bytes("GET", "/stream?n=8&interval=0.2", OPT_HOST))
            assert read_response(sock, head_only=True).status == 200
        idle = tls_socket(serve.port, OPT_HOST, source=by_worker()[0][0])
        idle.sendall(request_bytes("GET", "/idle", OPT_HOST))
        assert read_response(idle).status == 200
        if scenario == "sigterm_during_reload":
            serve.extra_routes = bulk_routes(1500, "t")
            write_atomic(serve.config, serve.render())
            serve.proc.send_signal(signal.SIGHUP)
            time.sleep(0.05)  # main is reading the config when SIGTERM comes
            serve.proc.send_signal(signal.SIGTERM)
        elif scenario == "reload_during_drain":
            serve.proc.send_signal(signal.SIGTERM)
            poll(lambda: any(e.get("event") == "draining" for e in serve.log_events()),
                 "the drain")
            serve.extra_routes = terminate_route("late.attack.test", node.port)
            write_atomic(serve.config, serve.render())
            serve.proc.send_signal(signal.SIGHUP)
            code, _ = admin_reload(serve)
            assert code in (0, 200), code  # refused at the door once closed, or done
        else:
            serve.proc.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            serve.proc.send_signal(signal.SIGTERM)
        for sock in streams:
            assert read_chunked_body(sock).count(b"data: tick") == 8
        idle.settimeout(WAIT)
        try:
            assert idle.recv(65536) == b""
        except OSError:
            pass  # a reset is closed too
        assert serve.proc.wait(timeout=WAIT) == 0, serve.logs()[-3000:]
        for pid in pids.values():
            poll(lambda pid=pid: not Path(f"/proc/{pid}").exists()
                 or Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z",
                 f"worker {pid} gone")
        logs = serve.logs()
        assert "Traceback" not in logs, logs[logs.find("Traceback") - 200:][:3000]
        events = serve.log_events()
        assert not [e for e in events if e.get("event") in ("worker_exited", "worker_killed")]
        if workers > 1:
            stopped = {e["pid"]: e.get("code") for e in events
                       if e.get("event") == "worker_stopped" and "pid" in e}
            assert stopped == {pid: 0 for pid in pids.values()}, stopped
        assert [e.get("event") for e in events].count("stopped") == 1
    finally:
        for sock in streams:
            forget(sock)
        if idle is not None:
            forget(idle)
        serve.stop()


# === a config path that is no file ==========================================================


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_config_path_that_is_no_regular_file_is_refused_without_blocking(
        tmp_path: Path, ids: Identities, node: RecordingNode, kind: str) -> None:
    """The operator's config path became a named pipe (a tool writing through one, a
    slip of `mkfifo`) or a directory, then SIGHUP: reading it must not wait for a writer
    that never comes — that would stop every connection, the admin endpoint and
    SIGTERM with it. The reload is refused in one line naming the file; the process
    serves on and drains on SIGTERM."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=1, limits=UNLIMITED)
    try:
        good = serve.config.read_text()
        serve.config.unlink()
        if kind == "fifo":
            os.mkfifo(serve.config)
        else:
            serve.config.mkdir()
        serve.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        refused: list[dict[str, Any]] = []
        while not refused and time.monotonic() < deadline:
            refused = [e for e in serve.log_events() if e.get("event") == "reload_refused"]
            time.sleep(0.05)
        assert len(refused) == 1, serve.logs()[-2000:]
        assert refused[0]["error"].startswith(f"{serve.config}:"), refused
        assert exchange(serve.port, request_bytes("GET", "/ok", OPT_HOST),
                        host=OPT_HOST).status == 200
        assert route_hosts(serve) == {HOST, OPT_HOST}
        if kind == "fifo":
            serve.config.unlink()
        else:
            serve.config.rmdir()
        serve.config.write_text(good)
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(timeout=WAIT) == 0
        assert "Traceback" not in serve.logs()
    finally:
        if kind == "fifo" and serve.config.is_fifo():
            # a reader blocked on the pipe gets its EOF, so the process can be stopped
            fd = os.open(serve.config, os.O_WRONLY | os.O_NONBLOCK) if serve.alive() else -1
            if fd >= 0:
                os.close(fd)
        serve.stop()


# === SIGHUP while serve is still starting ===================================================


class HupWhileStarting(Serve):
    """A `Serve` whose config changes, followed by SIGHUP, while the process is still
    starting (its config read, its workers not yet up): a reload from logrotate or a
    script that does not wait for READY."""

    def wait_notify(self, wanted: str, timeout: float = WAIT) -> list[str]:
        if wanted == "READY=1" and not getattr(self, "_hupped", False):
            self._hupped = True
            deadline = time.monotonic() + WAIT
            while self.alive() and time.monotonic() < deadline and not any(
                    e.get("event") == "selfsigned_cert_created" for e in self.log_events()):
                time.sleep(0.01)
            self.extra_routes = f"      - {{host: early.test, mode: passthrough, " \
                                f"backend: '{LOOPBACK}:9'}}\n"
            write_atomic(self.config, self.render())
            self.proc.send_signal(signal.SIGHUP)
        return super().wait_notify(wanted, timeout)


def test_a_sighup_while_serve_starts_neither_kills_it_nor_is_lost(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """SIGHUP's default action ends a process: one that arrives after `serve` read its
    config but before its signal handling is up must not, and the config written
    before it must be the one in force once serving."""
    serve = HupWhileStarting(tmp_path, node, ids.node.fingerprint, workers=2)
    try:
        assert serve.alive()
        poll(lambda: "early.test" in route_hosts(serve), "the config written before SIGHUP")
        assert exchange(serve.port, request_bytes("GET", "/ok", OPT_HOST),
                        host=OPT_HOST).status == 200
        assert "Traceback" not in serve.logs()
    finally:
        serve.stop()


@pytest.mark.parametrize("damage", [b"\x00\x00\x00\x00", b"\x1b[2J", b"\x7f"])
def test_a_config_damaged_by_control_bytes_is_refused_in_one_line_naming_the_line(
        tmp_path: Path, ids: Identities, node: RecordingNode, damage: bytes) -> None:
    """A config file with bytes YAML does not accept (a block of NULs left by a crash
    mid-write, a pasted escape sequence) on some line past the first: the refusal is one
    line naming FILE and that line, like every other config error, and the running
    config stays."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=1, limits=UNLIMITED)
    try:
        text = serve.render().encode()
        lines = text.split(b"\n")
        at = len(lines) - 3  # a line of the last route, well past the first
        lines[at - 1] += b"  " + damage
        serve.config.write_bytes(b"\n".join(lines))
        before = len(serve.log_events())
        serve.proc.send_signal(signal.SIGHUP)
        poll(lambda: any(e.get("event") == "reload_refused"
                         for e in serve.log_events()[before:]), "the refusal")
        refused = [e for e in serve.log_events()[before:] if e.get("event") == "reload_refused"]
        assert len(refused) == 1, refused
        error = refused[0]["error"]
        assert error.startswith(f"{serve.config}:{at}: "), error
        assert "\n" not in error, error
        assert route_hosts(serve) == {HOST, OPT_HOST}
        assert exchange(serve.port, request_bytes("GET", "/ok", OPT_HOST),
                        host=OPT_HOST).status == 200
    finally:
        serve.stop()


def h2_get_started(h2c: H2Conn, path: str) -> int:
    """A whole GET sent on a new stream, its answer left for `H2Conn.wait`."""
    sid = h2c.conn.get_next_available_stream_id()
    h2c._results[sid] = H2Result(None, [], b"")
    h2c.conn.send_headers(sid, [(b":method", b"GET"), (b":scheme", b"https"),
                                (b":authority", h2c.host.encode()), (b":path", path.encode())],
                          end_stream=True)
    h2c.sock.sendall(h2c.conn.data_to_send())
    return sid


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_a_request_in_flight_when_its_route_is_removed_finishes_whole(
        tmp_path: Path, ids: Identities, node: RecordingNode, http2: bool) -> None:
    """A streaming answer under way on each worker when a reload removes its route (and
    with it the route's upstream pool): every stream ends whole, the next request on the
    same connection is 421, and the node sees nothing more for that host."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2, limits=UNLIMITED,
                  extra_routes=terminate_route(GONE_HOST, node.port))
    conns: list[Any] = []
    try:
        pids = worker_pids(serve)
        sids = []
        for ips in by_worker().values():
            if http2:
                h2c = H2Conn(serve.port, GONE_HOST, source=ips[0])
                conns.append(h2c)
                sids.append(h2_get_started(h2c, "/stream?n=16&interval=0.15"))
            else:
                sock = tls_socket(serve.port, GONE_HOST, source=ips[0])
                conns.append(sock)
                sock.sendall(request_bytes("GET", "/stream?n=16&interval=0.15", GONE_HOST))
                assert read_response(sock, head_only=True).status == 200
        # each answer lasts 2.4 s: long enough that the first is still under way when the
        # second starts, however slowly a busy machine opens it
        poll(lambda: node.active_streams == 2, "both streams under way")
        assert serve.reload(extra_routes="") == "reloaded"
        seen = len(node.requests())
        for i, conn in enumerate(conns):
            if http2:
                res = conn.wait(sids[i])
                assert res.status == 200 and res.reset is None, res
                assert res.body.count(b"data: tick") == 16
                assert conn.request("GET", "/after").status == 421
            else:
                assert read_chunked_body(conn).count(b"data: tick") == 16
                conn.sendall(request_bytes("GET", "/after", GONE_HOST))
                assert read_response(conn).status == 421
        assert len(node.requests()) == seen
        assert_no_casualty(serve, pids)
    finally:
        for c in conns:
            if isinstance(c, H2Conn):
                c.close()
            else:
                forget(c)
        serve.stop()


def test_a_lowered_rate_limit_binds_open_connections_on_every_worker(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """Keep-alive connections on both workers spend freely under a high per-IP budget; a
    reload lowers it to 10 calls per hour (a burst of 5): on each of those same
    connections the budget now runs out within a few requests (429 with Retry-After),
    and a refused reload that would raise it again changes nothing."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2, limits=UNLIMITED)
    socks: list[Any] = []
    try:
        pids = worker_pids(serve)
        for ips in by_worker().values():
            socks.append(tls_socket(serve.port, OPT_HOST, source=ips[0]))

        def statuses(sock: Any, n: int) -> list[int]:
            out = []
            for i in range(n):
                sock.sendall(request_bytes("GET", f"/r{i}", OPT_HOST))
                resp = read_response(sock)
                out.append(resp.status)
                if resp.status == 429:
                    assert resp.header("retry-after"), resp.headers
                    break
            return out

        for sock in socks:
            assert statuses(sock, 12) == [200] * 12
        low = {"calls_per_hour_per_ip": 10, "calls_per_hour_per_ip_key": 10}
        assert serve.reload(limits=low) == "reloaded"
        for sock in socks:
            got = statuses(sock, 12)
            assert got[-1] == 429 and len(got) <= 6, got
        assert serve.reload(serve.render().replace("calls_per_hour_per_ip: 10\n",
                                                   "calls_per_hour_per_ip: ten\n")
                            ) == "reload_refused"
        for sock in socks:
            assert statuses(sock, 1) == [429]
        assert_no_casualty(serve, pids)
    finally:
        for sock in socks:
            forget(sock)
        serve.stop()


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT", "SIGTERM+SIGHUP"])
@pytest.mark.parametrize("workers", [1, 2])
def test_stop_signals_repeated_until_exit_still_drain_and_exit_zero(
        tmp_path: Path, ids: Identities, node: RecordingNode, signame: str,
        workers: int) -> None:
    """An impatient operator (or a supervisor and a script at once) sends the stop
    signal to every process again and again, up to the moment each is gone (with
    `+SIGHUP`: reloads to main in between): the drain runs once, the streams in flight
    finish whole, and main and every worker still exit 0 — also when a signal lands
    after a process's event loop is done."""
    signum, *more = (getattr(signal, name) for name in signame.split("+"))
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=workers, limits=UNLIMITED)
    streams: list[Any] = []
    try:
        pids = worker_pids(serve) if workers > 1 else {}
        for ips in by_worker().values():
            sock = tls_socket(serve.port, OPT_HOST, source=ips[0])
            streams.append(sock)
            sock.sendall(request_bytes("GET", "/stream?n=5&interval=0.1", OPT_HOST))
            assert read_response(sock, head_only=True).status == 200
        reader_done: list[int] = []

        def read_streams() -> None:
            for s in streams:
                reader_done.append(read_chunked_body(s).count(b"data: tick"))

        reader = threading.Thread(target=read_streams, daemon=True)
        reader.start()
        targets = [serve.proc.pid, *pids.values()]
        deadline = time.monotonic() + WAIT
        for _ in range(5000):  # bounded: every 3 ms until main is gone
            if serve.proc.poll() is not None or time.monotonic() > deadline:
                break
            for pid in targets:
                try:
                    os.kill(pid, signum)
                    for extra in more if pid == serve.proc.pid else ():
                        os.kill(pid, extra)
                except ProcessLookupError:
                    pass
            time.sleep(0.003)
        assert serve.proc.wait(timeout=WAIT) == 0, serve.logs()[-2000:]
        reader.join(WAIT)
        assert reader_done == [5] * len(streams)
        assert "Traceback" not in serve.logs(), serve.logs()[-3000:]
        events = [e.get("event") for e in serve.log_events()]
        assert events.count("draining") == 1 and events.count("stopped") == 1
        if workers > 1:
            assert events.count("worker_draining") == workers
            ended = {e["pid"]: e.get("code", e.get("signal")) for e in serve.log_events()
                     if e.get("event") in ("worker_stopped", "worker_exited") and "pid" in e}
            assert ended == {pid: 0 for pid in pids.values()}, ended
    finally:
        for sock in streams:
            forget(sock)
        serve.stop()


# === what only a restart changes stays as it started, in workers too ========================


def test_a_reload_changing_the_identity_key_leaves_every_worker_on_the_running_one(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    """The identity key is read at start only. A reload whose config names another key
    file (here one that does not exist yet) is applied with a warning saying so, and a
    worker that dies afterwards is replaced by one that still presents the running
    identity to the node — not one that fails on the new path, or uses another key."""
    serve = Serve(tmp_path, node, ids.node.fingerprint, workers=2, limits=UNLIMITED)
    try:
        pids = worker_pids(serve)
        text = serve.render().replace("identity: {key: ingress.key}",
                                      "identity: {key: rotated/ingress.key}")
        assert "rotated/" in text
        assert serve.reload(text) == "reloaded"
        os.kill(pids[0], signal.SIGKILL)
        poll(lambda: (w := serve.status()["workers"][0])["pid"] != pids[0]
             and w["state"] == "ready"
             or len([e for e in serve.log_events() if e.get("event") == "worker_exited"]) > 1,
             "a new worker 0")
        exited = [e for e in serve.log_events() if e.get("event") == "worker_exited"]
        assert [e["pid"] for e in exited] == [pids[0]], exited
        assert "Traceback" not in serve.logs(), serve.logs()[-3000:]
        node.clear()
        served = serve.status()["workers"][0]["requests"]
        for ip in by_worker()[0]:
            r = exchange(serve.port, request_bytes("GET", "/x", OPT_HOST), host=OPT_HOST,
                         source=ip)
            assert r.status == 200
        assert serve.status()["workers"][0]["requests"] > served  # the new worker's work
        assert {r.peer for r in node.requests()} == {ids.ingress.fingerprint}
        assert serve.status()["identity"] == ids.ingress.fingerprint
        warned = [e for e in serve.log_events() if e.get("event") == "reload_identity_unchanged"]
        assert len(warned) == 1, serve.logs()[-2000:]
    finally:
        serve.stop()


# === the channel to a worker that goes away under waiting writers ===========================


async def test_writers_queued_on_a_full_channel_see_it_closed_not_a_crash() -> None:
    """A worker stops reading, its channel fills, and several of main's tasks wait to
    write (a reload's config, a handoff, a stats question: one on the socket, the rest
    in line for it); then the worker is gone and main closes the channel. Each waiter
    must see the channel closed — the error every caller handles — not another error
    that would escape into main's nursery."""
    import trio
    import trio.testing

    from pact_ingress.net.workers import Channel
    from pact_ingress.proto import workers as wp

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    channel = Channel(mine)
    try:
        frame = wp.encode(wp.Kind.STATS, b"x" * 60_000)[0]
        for _ in range(10_000):  # bounded: the queue holds a few such frames
            if not channel.try_send_frame(frame):
                break
        else:
            raise AssertionError("the channel never filled")
        outcomes: list[str] = []

        async def writer(n: int) -> None:
            try:
                await channel.send(wp.Kind.STATS_ASK, b"", n)
                outcomes.append("sent")
            except (OSError, trio.ClosedResourceError):
                outcomes.append("closed")
            except Exception as exc:  # what must not happen: reported, not raised
                outcomes.append(repr(exc))

        async with trio.open_nursery() as nursery:
            for n in range(3):
                nursery.start_soon(writer, n)
            await trio.testing.wait_all_tasks_blocked()
            channel.close()
        assert outcomes == ["closed"] * 3, outcomes
    finally:
        theirs.close()
        channel.close()
