"""Hostile clients and failing operators against several `pact-ingress serve` instances
sharing one real redis-server (127.0.0.2 and 127.0.0.3, real TLS over loopback, a real
pinned node behind a terminate route).

What must hold, whatever the order of events:
* one client's budget is one budget across every instance and every worker process:
  the node never sees more of its requests than the burst, however they are spread and
  however many are in flight at once; another client's budget is untouched;
* Redis killed (SIGKILL) or frozen (SIGSTOP) mid-flood: every request is still
  answered, no process dies, nothing logs a traceback, each instance logs one line per
  switch, and once Redis is back the budget is shared again and the metrics say so;
* a wrong password or an unreachable Redis at start is a clear one-line log, not a
  crash, and never prints the password.
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pact_ingress.admin.client import fetch_status
from pact_ingress.identity import keygen
from pact_ingress.model import Address
from tests.cluster_env import get_status, serve_until_ready
from tests.redis_server import RedisServer, free_port
from tests.terminate_env import RecordingNode, json_events

HOST = "flood.cluster.test"
ADDRESSES = ("127.0.0.2", "127.0.0.3")
ATTACKER, BYSTANDER = "127.0.0.20", "127.0.0.21"
#: Route budget: 10 calls/hour per IP → a burst of 5, then one call per 6 minutes, so no
#: call is earned back while a test runs.
PER_IP = 10
BURST = 5
WAIT = 20.0
PASSWORD = "cluster-attack-pass"


class Instance:
    """One `serve` process on its own loopback address; READY by the notify socket."""

    def __init__(self, tmp: Path, address: str, port: int, node: RecordingNode, node_fp: str,
                 state: str, args: tuple[str, ...] = ()) -> None:
        self.dir = tmp / address
        self.dir.mkdir(exist_ok=True)
        self.address = address
        self.port = port
        self.args = args
        self.admin = Address("127.0.0.1", free_port())
        self.config = self.dir / "ingress.yaml"
        self.config.write_text(f"""\
state_dir: ./state
listen:
  tls: ["{address}:{port}"]
  admin: "{self.admin}"
{state}tenants:
  - name: family
    pins: ["{node_fp}"]
    routes:
      - host: {HOST}
        mode: terminate
        backend: 127.0.0.1:{node.port}
        seal: optional
        cert: {{cert: ./cert.pem, key: ./cert.key}}
        limits: {{calls_per_hour_per_ip: {PER_IP}}}
""")
        self.log_path = self.dir / "serve.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115  (lives as long as the process)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        self.proc, ready = serve_until_ready(self.dir, self.config, self.args, self._log,
                                             WAIT)
        if ready:
            return
        self.stop()
        raise AssertionError(f"serve on {self.address} not READY:\n{self.logs()[-3000:]}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def close(self) -> None:
        self.stop()
        self._log.close()

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        return json_events(self.logs())

    def state_events(self) -> list[str]:
        """The instance's switches (main's lines; workers log theirs at debug)."""
        return [e["event"] for e in self.events()
                if str(e.get("event", "")).startswith("state_backend_")]

    def status(self) -> dict[str, Any]:
        return fetch_status(self.admin, timeout=5)

    def metrics(self) -> str:
        with socket.create_connection((self.admin.host, self.admin.port), timeout=5) as s:
            s.sendall(f"GET /metrics HTTP/1.1\r\nHost: {self.admin}\r\n"
                      "Connection: close\r\n\r\n".encode())
            data = b""
            while chunk := s.recv(65536):
                data += chunk
        return data.split(b"\r\n\r\n", 1)[1].decode()

    def metric(self, name: str, labels: str = "") -> float:
        want = f"{name}{{{labels}}}" if labels else name
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith("#"):
                continue
            sample, _, value = line.rpartition(" ")
            if sample == want:
                total += float(value)
        return total

    def wait_mode(self, mode: str, timeout: float = WAIT) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        doc: dict[str, Any] = {}
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                doc = self.status()
                if doc["state"]["mode"] == mode:
                    return doc
            time.sleep(0.05)
        raise AssertionError(f"{self.address} never {mode}: {doc.get('state')}\n"
                             f"{self.logs()[-3000:]}")


def get(instance: Instance, client_ip: str, timeout: float = WAIT) -> int | None:
    """One HTTPS GET from `client_ip` on a fresh connection: its status code, or None if
    the connection failed or timed out before an answer."""
    return get_status(instance.address, instance.port, HOST, source=client_ip,
                      timeout=timeout)


def flood(instances: list[Instance], client_ip: str, n: int, *, threads: int = 6,
          during: Callable[[int], None] | None = None) -> list[tuple[str, int | None]]:
    """`n` requests from `client_ip`, `threads` at a time, spread over `instances` in
    turn; `during(i)` runs (once, in the caller's thread) when request `i` has been
    answered. Returns (instance address, status) per request, in completion order."""
    results: list[tuple[str, int | None]] = []
    lock = threading.Lock()
    done = threading.Event()
    counter = iter(range(n))

    def one() -> None:
        while True:
            with lock:
                i = next(counter, None)
            if i is None:
                return
            instance = instances[i % len(instances)]
            status = get(instance, client_ip)
            with lock:
                results.append((instance.address, status))
                if len(results) == n:
                    done.set()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(one) for _ in range(threads)]
        if during is not None:
            seen = 0
            while not done.is_set() and seen < n:
                with lock:
                    count = len(results)
                if count > seen:
                    during(count)
                    seen = count
                time.sleep(0.005)
        for f in futures:
            f.result(timeout=120)
    return results


def from_node(node: RecordingNode, client_ip: str) -> int:
    """Requests of `client_ip` that reached the node (the ingress names the client)."""
    return sum(1 for r in node.requests()
               if client_ip in r.header_values("x-forwarded-for")
               or client_ip in " ".join(r.header_values("forwarded")))


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, Any]]:
    key = tmp_path / "state.key"
    key.write_bytes(base64.b64encode(os.urandom(32)))
    os.chmod(key, 0o600)
    node_id = keygen(tmp_path / "node.key", common_name="node")
    node = RecordingNode(node_id)
    redis = RedisServer(tmp_path / "redis")
    instances: list[Instance] = []
    env = {"tmp": tmp_path, "key": key, "node": node, "node_fp": node_id.fingerprint,
           "redis": redis, "instances": instances, "port": free_port()}
    try:
        yield env
    finally:
        for instance in instances:
            instance.close()
        redis.stop()
        env["redis"].stop()  # a test may have put another one there
        node.stop()


def state_block(redis: RedisServer, key: Path, *, deadline: str | None = "500ms",
                extra: str = "") -> str:
    """The `state` block; `deadline=None` leaves the default (50 ms). Tests that are not
    about the deadline give 500 ms: a loaded test machine must not turn into a fallback."""
    return (f"state:\n  backend: redis\n  url: {redis.url}\n  encryption_key_file: {key}\n"
            + (f"  deadline: {deadline}\n" if deadline else "") + extra)


def start_cluster(env: dict[str, Any], *, args: tuple[str, ...] = (),
                  deadline: str | None = "500ms") -> list[Instance]:
    state = state_block(env["redis"], env["key"], deadline=deadline)
    for address in ADDRESSES:
        env["instances"].append(Instance(env["tmp"], address, env["port"], env["node"],
                                         env["node_fp"], state, args))
    for instance in env["instances"]:
        instance.wait_mode("shared")
    return list(env["instances"])


def assert_clean(instances: list[Instance]) -> None:
    for instance in instances:
        assert instance.alive(), instance.logs()[-3000:]
        logs = instance.logs()
        assert "Traceback" not in logs, logs[-5000:]
        exits = [e for e in instance.events() if e.get("event") == "worker_exited"]
        assert not exits, exits


# -- one budget, everywhere -------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_concurrent_flood_gets_one_budget_across_instances_and_workers(
    env: dict[str, Any], workers: int,
) -> None:
    instances = start_cluster(env, args=("--workers", str(workers)))
    node: RecordingNode = env["node"]
    attack = flood(instances, ATTACKER, 8 * BURST, threads=8)
    statuses = Counter(s for _, s in attack)
    # every request answered: the burst reached the node, the rest were refused
    assert None not in statuses, statuses
    assert statuses[200] == BURST and statuses[429] == 7 * BURST, statuses
    assert from_node(node, ATTACKER) == BURST
    # the bystander's budget is its own, on both instances
    assert [get(i, BYSTANDER) for i in instances] == [200, 200]
    assert from_node(node, BYSTANDER) == 2
    for instance in instances:
        assert instance.metric("pact_ingress_rate_limit_decisions_total",
                               'where="fallback"') == 0
    assert sum(i.metric("pact_ingress_rate_limit_decisions_total", 'where="shared"')
               for i in instances) == 8 * BURST + 2
    assert_clean(instances)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_flood_at_the_default_deadline_does_not_unshare_the_budget(
    env: dict[str, Any], workers: int,
) -> None:
    """One client's flood keeps the instances' event loops busy for longer than the
    default 50 ms deadline while Redis answers at once: the decisions' own queue for the
    limiter's connections, connecting them, and the health probe must not be taken for
    a slow Redis, or every instance counts alone and the client gets a burst each."""
    instances = start_cluster(env, args=("--workers", str(workers)), deadline=None)
    attack = flood(instances, ATTACKER, 600, threads=48)  # ~1-2 s on 2 cores
    statuses = Counter(s for _, s in attack)
    assert set(statuses) <= {200, 429}, statuses
    for instance in instances:
        assert instance.metric("pact_ingress_rate_limit_decisions_total",
                               'where="fallback"') == 0, instance.state_events()
    assert statuses[200] == BURST and from_node(env["node"], ATTACKER) == BURST, statuses
    assert_clean(instances)


# -- Redis dies or freezes mid-flood ----------------------------------------------------

def kill9(redis: RedisServer) -> None:
    """redis-server killed with SIGKILL: no chance to close its connections cleanly."""
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGKILL)
    redis.proc.wait()
    redis.proc = None


def in_background(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    return thread, out


def wait_answered(results: list[tuple[str, int | None]], n: int) -> None:
    deadline = time.monotonic() + WAIT
    while len(results) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(results) >= n, results


def wait_event(instance: Instance, event: str, count: int = 1, timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if instance.state_events().count(event) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"{instance.address} never logged {event}:\n"
                         f"{instance.logs()[-3000:]}")


def assert_fallback(instance: Instance) -> None:
    """The instance says it decides alone, everywhere it says anything: /status, the
    gauge the README says to alert on, and (within a probe interval) one log line."""
    instance.wait_mode("fallback")
    assert instance.metric("pact_ingress_state_shared") == 0
    wait_event(instance, "state_backend_lost")


def assert_back_to_one_budget(instances: list[Instance], client_ip: str) -> None:
    """Every instance (and each of its workers) shares again: one burst across both."""
    for instance in instances:
        instance.wait_mode("shared")
    statuses = Counter(s for _, s in flood(instances, client_ip, 4 * BURST, threads=4))
    assert statuses == {200: BURST, 429: 3 * BURST}, statuses
    for instance in instances:
        assert instance.metric("pact_ingress_state_shared") == 1
        assert instance.metric("pact_ingress_state_fallbacks_total") == 1
        assert instance.metric("pact_ingress_rate_limit_decisions_total",
                               'where="fallback"') > 0
        # one line per switch, the instance's own (not one per process)
        assert instance.state_events() == [
            "state_backend_connecting", "state_backend_shared", "state_backend_lost",
            "state_backend_shared"], instance.logs()[-5000:]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_redis_killed_mid_flood_falls_back_and_recovers(
    env: dict[str, Any], workers: int,
) -> None:
    instances = start_cluster(env, args=("--workers", str(workers)))
    redis: RedisServer = env["redis"]

    def kill_at(done: int) -> None:
        if done >= 2 * BURST and redis.proc is not None:
            kill9(redis)

    attacked = flood(instances, ATTACKER, 12 * BURST, threads=6, during=kill_at)
    assert redis.proc is None
    statuses = Counter(s for _, s in attacked)
    assert set(statuses) <= {200, 429}, statuses  # every request answered, none failed
    # the shared burst once, then at most each instance's own burst while Redis is away
    assert BURST <= statuses[200] <= BURST + len(instances) * BURST, statuses
    assert from_node(env["node"], ATTACKER) == statuses[200]
    # with Redis gone the bystander is served on both instances
    assert [get(i, BYSTANDER) for i in instances] == [200, 200]
    for instance in instances:
        assert_fallback(instance)

    redis.start()  # same port, empty (no persistence)
    assert_back_to_one_budget(instances, "127.0.0.22")
    assert_clean(instances)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_redis_frozen_mid_flood_never_holds_a_request(
    env: dict[str, Any], workers: int,
) -> None:
    instances = start_cluster(env, args=("--workers", str(workers)), deadline="200ms")
    redis: RedisServer = env["redis"]
    results: list[tuple[str, int | None]] = []
    thread, _ = in_background(lambda: results.extend(
        flood(instances, ATTACKER, 12 * BURST, threads=6)))
    wait_answered(results, 2 * BURST)
    redis.freeze()
    try:
        # Redis is up (it accepts connections) but silent: every request is still
        # answered while it stays frozen, the attacker's and the bystander's alike
        assert [get(i, BYSTANDER, timeout=10) for i in instances] == [200, 200]
        thread.join(60)
        assert not thread.is_alive()
        statuses = Counter(s for _, s in results)
        assert set(statuses) <= {200, 429}, statuses
        assert BURST <= statuses[200] <= BURST + len(instances) * BURST, statuses
        for instance in instances:
            assert_fallback(instance)
    finally:
        redis.thaw()
    assert_back_to_one_budget(instances, "127.0.0.23")
    assert_clean(instances)


# -- Redis full -------------------------------------------------------------------------

def redis_command(redis: RedisServer, *args: str) -> bytes:
    """One raw RESP command (no client library: an operator's redis-cli)."""
    with socket.create_connection((redis.host, redis.port), timeout=5) as s:
        s.sendall(f"*{len(args)}\r\n".encode()
                  + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args))
        return s.recv(4096)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_full_redis_is_one_fallback_not_a_flap(env: dict[str, Any], workers: int) -> None:
    """A Redis out of memory under `noeviction` (what the README allows for the relay)
    answers PING but refuses every write, so no decision can be made there: each
    instance must say so once and stay in fallback (the gauge at 0, so the README's
    alert fires), not switch back and forth at every probe."""
    instances = start_cluster(env, args=("--workers", str(workers)))
    redis: RedisServer = env["redis"]
    assert redis_command(redis, "CONFIG", "SET", "maxmemory-policy", "noeviction") == b"+OK\r\n"
    assert redis_command(redis, "CONFIG", "SET", "maxmemory", "1") == b"+OK\r\n"
    statuses: Counter[int | None] = Counter()
    for _ in range(12):  # three probe intervals of traffic, bounded
        for instance in instances:
            statuses[get(instance, ATTACKER)] += 1
        time.sleep(0.25)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses[200] <= len(instances) * BURST, statuses  # each instance's own budget
    for instance in instances:
        doc = instance.wait_mode("fallback")
        assert "OOM" in (doc["state"]["last_error"] or ""), doc["state"]
        assert instance.state_events() == [
            "state_backend_connecting", "state_backend_shared", "state_backend_lost"], \
            instance.state_events()
        assert instance.metric("pact_ingress_state_shared") == 0
        assert instance.metric("pact_ingress_state_fallbacks_total") == 1

    # room again: both rejoin by themselves, one line each, and share one budget
    assert redis_command(redis, "CONFIG", "SET", "maxmemory", "0") == b"+OK\r\n"
    assert_back_to_one_budget(instances, "127.0.0.24")
    assert_clean(instances)


# -- a switch only a worker sees ----------------------------------------------------------

def poison_buckets(redis: RedisServer, client_ip: str) -> int:
    """Turn `client_ip`'s bucket keys into hashes, as a foreign writer sharing the key
    prefix could: Redis then refuses every decision on them (WRONGTYPE) and nothing
    else. How many keys were turned."""
    reply = redis_command(redis, "KEYS", f"*{client_ip}}}*")
    names = [line for line in reply.decode().split("\r\n")
             if line and line[0] not in "*$"]
    for name in names:
        assert redis_command(redis, "DEL", name) == b":1\r\n"
        assert redis_command(redis, "HSET", name, "f", "v") == b":1\r\n"
    return len(names)


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_refused_decision_is_one_logged_and_counted_switch(
    env: dict[str, Any], workers: int,
) -> None:
    """A decision Redis refuses while Redis itself is fine: the process that made it
    counts alone until its next probe. With worker processes that process is a worker,
    which main's probe cannot see: the instance must still say so in one line and
    count it once."""
    instances = start_cluster(env, args=("--workers", str(workers)))
    redis: RedisServer = env["redis"]
    victim = "127.0.0.25"
    assert [get(i, victim) for i in instances] == [200, 200]
    assert poison_buckets(redis, victim) >= 1
    # the refused decision is made by this instance alone (its own burst), and said
    assert get(instances[0], victim) == 200
    instance = instances[0]
    assert instance.metric("pact_ingress_rate_limit_decisions_total",
                           'where="fallback"') == 1
    wait_event(instance, "state_backend_lost", timeout=3)  # the line comes at once
    lost = [e for e in instance.events() if e.get("event") == "state_backend_lost"]
    assert "WRONGTYPE" in lost[0]["error"], lost
    assert instance.metric("pact_ingress_state_fallbacks_total") == 1
    # Redis itself is fine: the instance rejoins by itself within a probe interval
    wait_event(instance, "state_backend_shared", 2)
    assert_clean(instances)


# -- an operator's mistakes at start ------------------------------------------------------

@pytest.mark.slow
def test_wrong_password_or_no_redis_at_start_serves_alone_and_says_why_once(
    env: dict[str, Any],
) -> None:
    tmp: Path = env["tmp"]
    env["redis"].stop()
    redis = env["redis"] = RedisServer(tmp / "redis-auth", password=PASSWORD)
    wrong = "not-the-" + PASSWORD
    password_file = tmp / "redis.pass"
    password_file.write_text(wrong + "\n")
    os.chmod(password_file, 0o600)
    nobody = free_port()  # nothing listens there
    configs = [
        state_block(redis, env["key"], extra=f"  password_file: {password_file}\n"),
        state_block(redis, env["key"]).replace(f":{redis.port}/", f":{nobody}/"),
    ]
    instances = env["instances"]
    for address, state in zip(ADDRESSES, configs):
        instances.append(Instance(tmp, address, env["port"], env["node"], env["node_fp"],
                                  state))  # READY: a missing Redis does not hold the start
    for instance, why in zip(instances, ("WRONGPASS", "Connect")):
        doc = instance.wait_mode("fallback")
        assert why.lower() in (doc["state"]["last_error"] or "").lower(), doc["state"]
        lines = [e for e in instance.events()
                 if str(e.get("event", "")).startswith("state_backend_")]
        assert [e["event"] for e in lines] == ["state_backend_connecting",
                                              "state_backend_unavailable"], lines
        assert why.lower() in lines[1]["error"].lower(), lines
        # each counts alone, with the route's budget
        statuses = Counter(get(instance, ATTACKER) for _ in range(2 * BURST))
        assert statuses == {200: BURST, 429: BURST}, statuses
        logs = instance.logs()
        assert PASSWORD not in logs and wrong not in logs
        assert "Traceback" not in logs, logs[-3000:]

    # the operator gives Redis the password the instance has: it joins by itself
    assert redis_command_auth(redis, PASSWORD, "CONFIG", "SET", "requirepass", wrong) \
        == b"+OK\r\n+OK\r\n"
    instances[0].wait_mode("shared")
    assert instances[0].state_events()[-1] == "state_backend_shared"
    assert wrong not in instances[0].logs()
    assert_clean(instances)


def redis_command_auth(redis: RedisServer, password: str, *args: str) -> bytes:
    """AUTH, then one command, on one connection; both replies."""
    with socket.create_connection((redis.host, redis.port), timeout=5) as s:
        out = b""
        for command in (("AUTH", password), args):
            s.sendall(f"*{len(command)}\r\n".encode() + b"".join(
                f"${len(a.encode())}\r\n{a}\r\n".encode() for a in command))
            out += s.recv(4096)
        return out
