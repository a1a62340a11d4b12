"""`serve --workers N`: terminate work in worker processes, the instance still one.

Real `serve` and `connect` processes, real TLS on loopback. Client sockets are bound to
127.0.0.2…127.0.0.9 so that both workers of `--workers 2` get clients (which address
goes where is `proto.workers.worker_for`; /status confirms it). Every wait is bounded;
nothing asserts timing. The message codec is tested sans-I/O at the end.
"""

from __future__ import annotations

import itertools
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pact_ingress.admin.schema import STATUS_SCHEMA
from pact_ingress.proto import workers as wp
from pact_ingress.proto.ratelimit import burst_for
from pact_ingress.proto.workers import Kind, WorkerState
from tests.cluster_env import TM_HOST, Connect, Instance, get_status, home_node
from tests.netutil import free_port
from tests.terminate_env import (
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
    sealed_call_body,
    tls_socket,
    unsealed_call_body,
)

SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]


def by_worker(n: int = 2) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {i: [] for i in range(n)}
    for ip in SOURCES:
        out[wp.worker_for(ip, n)].append(ip)
    assert all(out.values()), f"every worker needs a source address: {out}"
    return out


def poll(check: Callable[[], Any], what: str, timeout: float = WAIT) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def children(pid: int) -> set[int]:
    out: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.update(int(t) for t in text)
    return out


def gone(pid: int) -> bool:
    """The process no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def worker_pids(serve: Serve) -> dict[int, int]:
    return {w["index"]: w["pid"] for w in serve.status()["workers"]}


def counter_total(metrics: str, family: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(metrics)
               if fam.name == family for s in fam.samples if s.name == family + "_total")


@pytest.fixture
def ids(tmp_path: Path) -> Identities:
    return make_identities(tmp_path)


@pytest.fixture
def node(ids: Identities) -> Iterator[RecordingNode]:
    n = RecordingNode(ids.node, client_ca=ids.ingress)
    yield n
    n.stop()


def start(tmp: Path, ids: Identities, node: RecordingNode, **kw: Any) -> Serve:
    return Serve(tmp, node, ids.node.fingerprint, **kw)


# --- spread, posture, metrics ---------------------------------------------------------


def test_two_workers_serve_every_client_and_the_instance_sums(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    serve = start(tmp_path, ids, node, workers=2)
    try:
        pids = worker_pids(serve)
        assert len(pids) == 2 and set(pids.values()) == children(serve.proc.pid)
        made = 0
        for n, ip in enumerate(SOURCES):
            sealed = exchange(serve.port, request_bytes(
                "POST", "/mcp", body=sealed_call_body(ids, msg_id=f"w-{n}", rpc_id=n)),
                source=ip)
            assert sealed.status == 200 and sealed.code is None, (ip, sealed)
            unsealed = exchange(serve.port, request_bytes(
                "POST", "/mcp", body=unsealed_call_body(rpc_id=n)), source=ip)
            assert unsealed.code == "seal_required", (ip, unsealed)
            plain = exchange(serve.port, request_bytes("GET", "/x", OPT_HOST), host=OPT_HOST,
                             source=ip)
            assert plain.status == 200
            made += 3
        for ips in by_worker().values():  # HTTP/2 too, at each worker
            h2 = H2Conn(serve.port, OPT_HOST, source=ips[0])
            try:
                assert h2.request("GET", "/h2").status == 200
            finally:
                h2.close()
            made += 1
        assert node.unsealed_calls() == []
        status = serve.status()
        served = {w["index"]: w["requests"] for w in status["workers"]}
        for index, ips in by_worker().items():
            assert served[index] == 3 * len(ips) + 1, (served, ips)
        assert all(w["state"] == "ready" and w["restarts"] == 0 for w in status["workers"])
        assert status["counters"]["http_requests_total"] == made
        codes = {r["reason"] for r in status["recent_refusals"]}
        assert "seal_required" in codes  # refusals made in workers show on main's page
        jsonschema.validate(status, STATUS_SCHEMA)
        assert b"Worker processes" in serve._admin("/")
        metrics = serve.metrics()
        assert counter_total(metrics, "pact_ingress_http_requests") == made
        assert counter_total(metrics, "pact_ingress_worker_handoffs") == made
        fams = {f.name: f for f in text_string_to_metric_families(metrics)}
        up = {s.labels["worker"]: s.value for s in fams["pact_ingress_worker_up"].samples}
        assert up == {"0": 1.0, "1": 1.0}
        assert "pact_ingress_worker_open_connections" in fams
    finally:
        serve.stop()


def test_one_worker_is_one_process(tmp_path: Path, ids: Identities,
                                   node: RecordingNode) -> None:
    serve = start(tmp_path, ids, node, workers=1)
    try:
        assert exchange(serve.port, request_bytes("GET", "/x", OPT_HOST),
                        host=OPT_HOST).status == 200
        assert children(serve.proc.pid) == set()
        status = serve.status()
        assert "workers" not in status
        assert status["counters"]["http_requests_total"] == 1
    finally:
        serve.stop()


def test_workers_do_not_inherit_systemd_notify(tmp_path: Path, ids: Identities,
                                               node: RecordingNode) -> None:
    """READY comes after the workers are up, from main only: workers have no
    NOTIFY_SOCKET / WATCHDOG_* to speak to systemd with."""
    env_before = dict(os.environ)
    os.environ["WATCHDOG_USEC"] = "60000000"  # armed for main (WATCHDOG_PID unset)
    try:
        serve = start(tmp_path, ids, node, workers=2)
    finally:
        os.environ.clear()
        os.environ.update(env_before)
    try:
        # Serve returned at READY: the workers were ready by then
        assert [w["state"] for w in serve.status()["workers"]] == ["ready", "ready"]
        main_env = Path(f"/proc/{serve.proc.pid}/environ").read_bytes().split(b"\0")
        assert any(v.startswith(b"NOTIFY_SOCKET=") for v in main_env)
        for pid in worker_pids(serve).values():
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert not [v for v in env if v.split(b"=", 1)[0] in (
                b"NOTIFY_SOCKET", b"WATCHDOG_USEC", b"WATCHDOG_PID")], env
    finally:
        serve.stop()


# --- exact limits -----------------------------------------------------------------------


@pytest.mark.parametrize("workers", [1, 2])
def test_a_budget_is_not_multiplied_by_the_workers(
        tmp_path: Path, ids: Identities, node: RecordingNode, workers: int) -> None:
    """One (IP, key) hammering over several connections gets exactly the burst of its
    hourly budget, with one worker or two; a second IP gets its own, exactly too."""
    per_key = 12  # burst 5; the next call refills after 300 s, far beyond this test
    serve = start(tmp_path, ids, node, workers=workers,
                  limits={"calls_per_hour_per_ip_key": per_key,
                          "calls_per_hour_per_ip": 1000})
    expected = burst_for(per_key)
    msg_ids = itertools.count()
    try:
        sources = [ips[0] for ips in by_worker().values()]
        for ip in sources:
            conns = [tls_socket(serve.port, source=ip) for _ in range(4)]
            admitted = limited = 0
            try:
                for round_ in range(4):
                    for sock in conns:
                        n = next(msg_ids)
                        sock.sendall(request_bytes("POST", "/mcp", body=sealed_call_body(
                            ids, msg_id=f"lim-{n}", rpc_id=n)))
                        resp = read_response(sock)
                        if resp.status == 200 and resp.code is None:
                            admitted += 1
                        else:
                            assert resp.code == "rate_limited" or resp.status == 429, resp
                            limited += 1
            finally:
                for sock in conns:
                    forget(sock)
            assert (admitted, limited) == (expected, 16 - expected), ip
    finally:
        serve.stop()


# --- tunnel from any worker --------------------------------------------------------------


def tunnel_get(port: int, source: str, host: str = TM_HOST) -> int | None:
    return get_status("127.0.0.1", port, host, source=source)


def test_a_tunnel_serves_connections_at_every_worker(tmp_path: Path) -> None:
    node = home_node(tmp_path)
    instance = Instance(tmp_path, "127.0.0.1", free_port(), node.identity.fingerprint,
                        args=("--workers", "2"))
    connector = None
    try:
        instance.start()
        connector = Connect(tmp_path, node.identity, node.port, [f"127.0.0.1:{instance.port}"],
                            [instance.identity.fingerprint])
        poll(lambda: instance.tunnels_up() > 0, "the tunnel")
        for ip in SOURCES:
            assert poll(lambda ip=ip: tunnel_get(instance.port, ip) == 200,
                        f"a request from {ip}")
        served = {w["index"]: w["requests"] for w in instance.status()["workers"]}
        assert all(served[i] >= len(ips) for i, ips in by_worker().items()), served
        assert len(node.requests()) >= len(SOURCES)
    finally:
        if connector is not None:
            connector.close()
        instance.close()
        node.stop()


# --- reload -----------------------------------------------------------------------------


NEW_HOST = "new.attack.test"


def test_reload_reaches_every_worker_and_a_bad_one_none(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    serve = start(tmp_path, ids, node, workers=2)
    try:
        pids = worker_pids(serve)
        (tmp_path / "certs").mkdir(exist_ok=True)
        new_route = f"""\
      - host: {NEW_HOST}
        mode: terminate
        backend: "127.0.0.1:{node.port}"
        seal: optional
        cert: {{cert: certs/{NEW_HOST}.crt, key: certs/{NEW_HOST}.key}}
"""
        # many more routes: the pickled config no longer fits one frame (64 KiB)
        bulk = "".join(f"""\
      - host: p{i}.bulk.attack.test
        mode: passthrough
        backend: "127.0.0.1:{node.port}"
""" for i in range(600))
        assert serve.reload(extra_routes=new_route + bulk) == "reloaded"
        from pact_ingress.config import load_config

        assert len(wp.encode(Kind.CONFIG, pickle.dumps(load_config(serve.config)))) > 1
        for ip in SOURCES:
            r = exchange(serve.port, request_bytes("GET", "/n", NEW_HOST), host=NEW_HOST,
                         source=ip)
            assert r.status == 200, (ip, r.status)
        good = serve.config.read_text()
        assert serve.reload(text=good + "  - this is: [not a tenant\n") == "reload_refused"
        assert serve.alive()
        for ip in SOURCES:
            for host in (NEW_HOST, OPT_HOST):
                assert exchange(serve.port, request_bytes("GET", "/n", host), host=host,
                                source=ip).status == 200
        assert worker_pids(serve) == pids
        applied = [e for e in serve.log_events() if e.get("event") == "worker_config_applied"]
        assert {e["worker"] for e in applied} == {0, 1} and len(applied) == 2
    finally:
        serve.stop()


# --- a worker dies ----------------------------------------------------------------------


def test_a_killed_worker_is_replaced_and_the_other_is_undisturbed(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    serve = start(tmp_path, ids, node, workers=2)
    groups = by_worker()
    try:
        pids = worker_pids(serve)
        # a keep-alive connection on worker 1, used before and after worker 0 dies
        other = tls_socket(serve.port, OPT_HOST, source=groups[1][0])
        other.sendall(request_bytes("GET", "/before", OPT_HOST))
        assert read_response(other).status == 200
        for ip in groups[0]:  # counted by worker 0, reported before it dies
            assert exchange(serve.port, request_bytes("GET", "/x", OPT_HOST), host=OPT_HOST,
                            source=ip).status == 200
        made = 1 + len(groups[0])
        assert serve.status()["counters"]["http_requests_total"] == made
        os.kill(pids[0], signal.SIGKILL)
        fresh = poll(lambda: (p := worker_pids(serve))[0] not in (None, pids[0])
                     and serve.status()["workers"][0]["state"] == "ready" and p,
                     "a new worker 0")
        assert fresh[1] == pids[1]
        exited = [e for e in serve.log_events() if e.get("event") == "worker_exited"]
        assert len(exited) == 1 and exited[0]["pid"] == pids[0]
        assert exited[0]["signal"] == "SIGKILL"
        assert "Traceback" not in serve.logs()
        for ip in groups[0]:
            assert exchange(serve.port, request_bytes("GET", "/x", OPT_HOST), host=OPT_HOST,
                            source=ip).status == 200
        other.sendall(request_bytes("GET", "/after", OPT_HOST))
        assert read_response(other).status == 200
        forget(other)
        made += len(groups[0]) + 1
        # the dead worker's counts stay in the instance's sums: no counter goes down
        assert counter_total(serve.metrics(), "pact_ingress_http_requests") == made
        status = serve.status()
        assert status["workers"][0]["restarts"] == 1 and status["workers"][1]["restarts"] == 0
        assert counter_total(serve.metrics(), "pact_ingress_worker_restarts") == 1
    finally:
        serve.stop()


# --- drain ------------------------------------------------------------------------------


def test_sigterm_drains_every_worker_then_all_exit_zero(
        tmp_path: Path, ids: Identities, node: RecordingNode) -> None:
    serve = start(tmp_path, ids, node, workers=2)
    groups = by_worker()
    try:
        pids = worker_pids(serve)
        slow = {i: tls_socket(serve.port, OPT_HOST, source=ips[0])
                for i, ips in groups.items()}
        for sock in slow.values():
            sock.sendall(request_bytes("GET", "/stream?n=6&interval=0.25", OPT_HOST))
            assert read_response(sock, head_only=True).status == 200
        serve.proc.send_signal(signal.SIGTERM)
        for sock in slow.values():
            body = read_chunked_body(sock)
            assert body.count(b"data: tick") == 6
            forget(sock)
        assert serve.proc.wait(timeout=WAIT) == 0
        for pid in pids.values():
            poll(lambda pid=pid: gone(pid), f"worker {pid} to exit")
        stopped = [e for e in serve.log_events() if e.get("event") == "worker_stopped"
                   and "pid" in e and "code" in e]
        assert {e["pid"]: e["code"] for e in stopped} == {pid: 0 for pid in pids.values()}
        assert not [e for e in serve.log_events() if e.get("event") == "worker_exited"]
    finally:
        serve.stop()


def test_workers_do_not_outlive_a_killed_main(tmp_path: Path, ids: Identities,
                                              node: RecordingNode) -> None:
    serve = start(tmp_path, ids, node, workers=2)
    try:
        pids = worker_pids(serve)
        serve.proc.kill()
        serve.proc.wait(timeout=WAIT)
        for pid in pids.values():
            poll(lambda pid=pid: gone(pid), f"worker {pid} to exit after main died")
    finally:
        serve.stop()


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_workers_must_be_a_positive_count(value: str, capsys: pytest.CaptureFixture[str]
                                          ) -> None:
    from pact_ingress.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "-c", "unused.yaml", "--workers", value])
    assert exc.value.code == 2
    assert "--workers" in capsys.readouterr().err


# --- summing processes -----------------------------------------------------------------


def test_metrics_of_processes_fold_into_one_instance() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

    from pact_ingress.admin.merge import exposition, merge_families, retire

    def registry(requests: int, open_: int, expiry: float, created_offset: float,
                 shared: int = 1) -> CollectorRegistry:
        r = CollectorRegistry()
        c = Counter("pact_ingress_http_requests", "x", ["route"], registry=r)
        c.labels("a").inc(requests)
        Gauge("pact_ingress_open_connections", "x", registry=r).set(open_)
        Gauge("pact_ingress_certificate_expiry_timestamp_seconds", "x", ["host"],
              registry=r).labels("a").set(expiry)
        Gauge("pact_ingress_state_shared", "x", registry=r).set(shared)
        return r

    main = registry(1, 2, 1000.0, 0)
    workers = [generate_latest(registry(n, 3, 5.0, 0)).decode() for n in (10, 20)]
    merged = exposition(merge_families(main.collect(), workers)).decode()
    assert counter_total(merged, "pact_ingress_http_requests") == 31
    values = {s.name: s.value for f in text_string_to_metric_families(merged)
              for s in f.samples}
    assert values["pact_ingress_open_connections"] == 2 + 3 + 3
    assert values["pact_ingress_certificate_expiry_timestamp_seconds"] == 1000.0
    assert values["pact_ingress_state_shared"] == 1
    created = [s.value for f in text_string_to_metric_families(merged) for s in f.samples
               if s.name == "pact_ingress_http_requests_created"]
    assert len(created) == 1
    # a worker whose own Redis client fell back: the instance is not shared (as /status)
    alone = generate_latest(registry(0, 0, 5.0, 0, shared=0)).decode()
    merged = exposition(merge_families(main.collect(), [*workers, alone])).decode()
    values = {s.name: s.value for f in text_string_to_metric_families(merged)
              for s in f.samples}
    assert values["pact_ingress_state_shared"] == 0
    gone = retire(retire("", workers[0]), workers[1])
    fams = {f.name for f in text_string_to_metric_families(gone)}
    assert fams == {"pact_ingress_http_requests"}  # gauges died with their process
    assert counter_total(gone, "pact_ingress_http_requests") == 30


# --- the codec, sans I/O ----------------------------------------------------------------


def test_frames_round_trip_split_and_interleaved() -> None:
    big = bytes(range(256)) * 1000  # 256 000 bytes: four frames
    frames = wp.encode(Kind.CONFIG, big, 7)
    assert len(frames) == 4 and all(len(f) <= wp.FRAME_READ for f in frames)
    small = wp.encode(Kind.HANDOFF, b"hello")
    assert len(small) == 1
    r = wp.Reassembler()
    got = []
    for frame in [frames[0], frames[1], small[0], frames[2], frames[3]]:
        msg = r.feed(frame)
        if msg is not None:
            got.append(msg)
    assert got == [wp.Message(Kind.HANDOFF, 0, b"hello"), wp.Message(Kind.CONFIG, 7, big)]
    assert r.feed(wp.encode(Kind.DRAIN)[0]) == wp.Message(Kind.DRAIN, 0, b"")


@pytest.mark.parametrize("frame", [b"", b"\x01\x00", struct.pack("!BBI", 99, 0, 0),
                                   struct.pack("!BBI", 1, 0x80, 0)])
def test_bad_frames_raise(frame: bytes) -> None:
    with pytest.raises(wp.ProtocolError):
        wp.Reassembler().feed(frame)


def test_partial_messages_are_bounded() -> None:
    r = wp.Reassembler()
    more = struct.pack("!BBI", Kind.CONFIG, wp.MORE, 0)
    for i in range(wp.MAX_PARTIAL):
        r.feed(struct.pack("!BBI", Kind.CONFIG, wp.MORE, i) + b"x")
    with pytest.raises(wp.ProtocolError):
        r.feed(struct.pack("!BBI", Kind.STATS, wp.MORE, 1) + b"x")
    with pytest.raises(wp.ProtocolError):
        wp.encode(Kind.CONFIG, b"\0" * (wp.MAX_MESSAGE + 1))
    assert more  # the flag is what makes a frame partial


@pytest.mark.parametrize("sni", [None, "", "mcp.example.test", "xn--bcher-kva.test"])
def test_handoff_round_trip(sni: str | None) -> None:
    h = wp.Handoff(2**63 + 5, "2001:db8::1", 65535, "*.example.test", sni, 42,
                   "/var/lib/x/chain.pem", "/var/lib/x/ké y.key", b"\x16\x03\x01" + bytes(300))
    assert wp.decode_handoff(wp.encode_handoff(h)) == h


def test_truncated_handoffs_raise_at_every_length() -> None:
    payload = wp.encode_handoff(wp.Handoff(1, "127.0.0.2", 4000, "h.test", "h.test", 1,
                                           "/c", "/k", b""))
    for n in range(len(payload)):  # the data field is last and may be empty
        with pytest.raises(wp.ProtocolError):
            wp.decode_handoff(payload[:n])


@pytest.mark.parametrize("msg_id", ["m-1", "ké\u2028\"y", "x" * 5000])
def test_enqueue_asks_and_answers_round_trip(msg_id: str) -> None:
    a, b = "sha256:" + "A" * 43, "sha256:" + "B" * 43
    envelope = b'{"ct":"x"}'
    payload = wp.encode_enqueue(a, b, msg_id, 2**53 - 1, envelope)
    assert wp.decode_ask(payload) == (wp.RelayOp.ENQUEUE, {
        "recipient": a, "sender": b, "msg_id": msg_id, "expires_at": 2**53 - 1}, envelope)
    # the fields before the envelope (which is last and may be empty) cut anywhere
    for n in range(len(payload) - len(envelope)):
        with pytest.raises(wp.ProtocolError):
            wp.decode_ask(payload[:n] if n else b"\x01")
    for item_id, duplicate in ((1, False), (2**63, True)):
        assert wp.decode_enqueued(wp.encode_enqueued(item_id, duplicate)) == (item_id, duplicate)
    with pytest.raises(wp.ProtocolError):
        wp.decode_enqueued(wp.encode_enqueued(1, False)[:-1])
    # every other ask is the JSON document, as before
    other = wp.encode_relay(wp.RelayOp.FETCH, {"recipient": a, "limit": 3})
    assert wp.decode_ask(other) == (wp.RelayOp.FETCH, {"recipient": a, "limit": 3}, b"")


def test_closed_ids_and_reports() -> None:
    ids = [1, 2, 2**64 - 1]
    assert wp.decode_closed(wp.encode_closed(ids)) == ids
    with pytest.raises(wp.ProtocolError):
        wp.decode_closed(b"\0" * 9)
    assert wp.decode_json(wp.encode_json({"a": [1]})) == {"a": [1]}
    for bad in (b"[1]", b"{", b"\xff"):
        with pytest.raises(wp.ProtocolError):
            wp.decode_json(bad)


def test_a_bucket_always_goes_to_one_worker() -> None:
    for n in (2, 3, 8):
        assert {wp.worker_for("2001:db8:1:2::1", n), wp.worker_for("2001:db8:1:2:ff::9", n),
                wp.worker_for("2001:db8:1:2::1%lo", n)} == {wp.worker_for("2001:db8:1:2::", n)}
        assert wp.worker_for("::ffff:10.0.0.1", n) == wp.worker_for("10.0.0.1", n)
        seen = {wp.worker_for(f"10.0.{i // 256}.{i % 256}", n) for i in range(2000)}
        assert seen == set(range(n))


def test_worker_states_follow_the_table() -> None:
    S = WorkerState
    path = [S.STARTING, S.READY, S.EXITED, S.RESPAWNING, S.STARTING, S.READY, S.DRAINING,
            S.EXITED]
    for current, wanted in itertools.pairwise(path):
        assert wp.next_state(current, wanted) is wanted
    for current, wanted in [(S.EXITED, S.READY), (S.DRAINING, S.READY),
                            (S.READY, S.STARTING), (S.RESPAWNING, S.READY)]:
        with pytest.raises(wp.BadTransition):
            wp.next_state(current, wanted)


def test_respawn_backoff_is_bounded() -> None:
    delays = [wp.respawn_delay(n) for n in range(1, 30)]
    assert delays[0] == wp.RESPAWN_FIRST
    assert delays == sorted(delays) and max(delays) == wp.RESPAWN_MAX


# --- signals while starting -----------------------------------------------------------


def _python_code_runs(pid: int) -> bool:
    """The worker's own imports are under way: it is the worker program (not main's copy
    between fork and exec, which maps everything main does) and the ssl module's library
    is mapped (the interpreter's start-up and the package's `__init__` never load it)."""
    try:
        if b"pact_ingress.worker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
            return False
        return "_ssl." in Path(f"/proc/{pid}/maps").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False


def test_a_sighup_while_a_worker_loads_its_modules_does_not_kill_it(tmp_path: Path) -> None:
    """SIGHUP's default action ends a process, and a worker ignored it only once its
    modules were loaded (a good part of a second): `systemctl kill -s HUP`, or a
    `pkill -HUP` matching the service's processes, in that time killed the worker, and
    main respawned it. Each of three workers gets a SIGHUP in the middle of its imports
    and must live on: no worker exits, the ones signalled are the ones serving."""
    count = 3
    config = tmp_path / "ingress.yaml"
    config.write_text(f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{free_port()}"]
  admin: "127.0.0.1:{free_port()}"
tenants:
  - name: hup
    pins: ["sha256:{'A' * 43}"]
    routes:
      - {{host: known.example.test, mode: passthrough, backend: "127.0.0.1:9"}}
""")
    log_path = tmp_path / "serve.log"
    env = dict(os.environ)
    env.pop("NOTIFY_SOCKET", None)
    env["PYTHONPATH"] = str(Path(__file__).parents[1])
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "serve", "-c", str(config),
             "--workers", str(count)], stdout=out, stderr=subprocess.STDOUT, env=env,
            cwd=tmp_path)
    hit: set[int] = set()
    try:
        deadline = time.monotonic() + WAIT
        while len(hit) < count and proc.poll() is None and time.monotonic() < deadline:
            try:
                kids = children(proc.pid)
            except (FileNotFoundError, ProcessLookupError):
                break
            for pid in kids - hit:
                if _python_code_runs(pid):
                    os.kill(pid, signal.SIGHUP)
                    hit.add(pid)
            time.sleep(0.002)
        assert len(hit) == count, log_path.read_text()[-3000:]
        poll(lambda: proc.poll() is not None or '"serving"' in log_path.read_text(),
             "serving")
        assert proc.poll() is None, log_path.read_text()[-3000:]
        text = log_path.read_text()
        assert '"worker_exited"' not in text, text[-3000:]
        assert children(proc.pid) == hit, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=WAIT)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
