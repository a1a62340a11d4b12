"""The connector's stream thread (`net/tunnel/stream_job.py`) over real loopback TCP: the
relay state, a stream's life, stopping, refusals. End-to-end through an ingress:
tests/test_tunnel.py."""

from __future__ import annotations

import hashlib
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import pytest

from pact_ingress.net.splice import Direction
from pact_ingress.net.tunnel.stream_job import Hooks, State, StreamJob, interest
from pact_ingress.proto import tls_alert

TIMEOUT = 10.0
#: (ingress side, connector side) of one loopback TCP connection.
Pair = tuple[socket.socket, socket.socket]
HELLO = b"\x16\x03\x01" + os.urandom(300)


# --- the relay's interest (pure) -------------------------------------------------------------

def test_interest_waits_for_sources_while_pipes_are_empty() -> None:
    up, down = Direction("up", 3, 4), Direction("down", 4, 3)
    assert interest((up, down)) == {3: select.POLLIN, 4: select.POLLIN}


def test_interest_waits_for_the_destination_while_bytes_are_pending() -> None:
    up, down = Direction("up", 3, 4, pending=10), Direction("down", 4, 3)
    # fd 4 is both up's destination (full) and down's source: one mask, both events
    assert interest((up, down)) == {4: select.POLLIN | select.POLLOUT}


def test_interest_leaves_out_finished_directions() -> None:
    up, down = Direction("up", 3, 4, done=True), Direction("down", 4, 3, pending=1)
    assert interest((up, down)) == {3: select.POLLOUT}
    down.done = True
    assert interest((up, down)) == {}


# --- real sockets ------------------------------------------------------------------------------

@dataclass
class Calls:
    opened: int = 0
    moved: dict[str, int] = field(default_factory=lambda: {"up": 0, "down": 0})
    failed: list[OSError] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hooks(self) -> Hooks:
        def opened() -> None:
            with self.lock:
                self.opened += 1

        def moved(direction: str, n: int) -> None:
            with self.lock:
                self.moved[direction] += n

        return Hooks(opened=opened, moved=moved, forward_failed=self.failed.append)


@pytest.fixture
def pair() -> Iterator[Pair]:
    """(ingress side, connector side) of one loopback TCP connection; the job under test
    owns (closes) the connector side, the test the ingress side."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        ingress = socket.create_connection(listener.getsockname())
        data, _ = listener.accept()
    data.setblocking(False)
    ingress.settimeout(TIMEOUT)
    with ingress:
        yield ingress, data


def until(check: Callable[[], bool]) -> None:
    """Wait (≤ TIMEOUT) for something another thread does right after its last write."""
    deadline = time.monotonic() + TIMEOUT
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


@contextmanager
def backend(handle: Callable[[socket.socket], None]) -> Iterator[int]:
    """A one-connection TCP server on loopback running `handle` on a thread (it stops
    waiting for the connection when the block ends)."""
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def serve() -> None:
        while not select.select([listener], [], [], 0.05)[0]:
            if done.is_set():
                return
        conn, _ = listener.accept()
        conn.settimeout(TIMEOUT)
        with conn:
            handle(conn)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield listener.getsockname()[1]
    finally:
        done.set()
        t.join(TIMEOUT)
        listener.close()


def echo(conn: socket.socket) -> None:
    while data := conn.recv(1 << 16):
        conn.sendall(data)


def start(job: StreamJob) -> tuple[threading.Thread, list[str]]:
    outcome: list[str] = []
    t = threading.Thread(target=lambda: outcome.append(job.run()), daemon=True)
    t.start()
    return t, outcome


def make_job(data: socket.socket, port: int, calls: Calls, first: bytes = b"",
             idle_timeout: float = 60.0) -> StreamJob:
    return StreamJob(data, first, ("127.0.0.1", port), socket.AF_INET, calls.hooks(),
                     connect_timeout=TIMEOUT, idle_timeout=idle_timeout)


def read_until_eof(sock: socket.socket) -> bytes:
    out = bytearray()
    while chunk := sock.recv(1 << 16):
        out += chunk
    return bytes(out)


def test_stream_echo_and_half_close_pass_through(pair: Pair) -> None:
    calls = Calls()
    ingress, data = pair
    with backend(echo) as port:
        job = make_job(data, port, calls)
        assert job.state is State.NEW and job.waiting  # its thread has not started
        t, outcome = start(job)
        ingress.sendall(HELLO)
        assert ingress.recv(len(HELLO), socket.MSG_WAITALL) == HELLO
        until(lambda: job.state is State.ACTIVE and calls.opened == 1)
        ingress.sendall(b"more")
        ingress.shutdown(socket.SHUT_WR)  # half-close: the echo still comes back
        assert read_until_eof(ingress) == b"more"
        t.join(TIMEOUT)
    assert outcome == ["ok"] and job.state is State.DONE
    assert calls.opened == 1
    assert calls.moved == {"up": len(HELLO) + 4, "down": len(HELLO) + 4}
    assert data.fileno() == -1  # the job closed what it owned


def test_full_duplex_bulk_arrives_intact(pair: Pair) -> None:
    calls = Calls()
    ingress, data = pair
    payload = os.urandom(1 << 20) * 4
    with backend(echo) as port:
        t, outcome = start(make_job(data, port, calls, first=payload[:1000]))

        def send() -> None:
            ingress.sendall(payload[1000:])
            ingress.shutdown(socket.SHUT_WR)

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        got = read_until_eof(ingress)  # echoed while we still send: backpressure both ways
        sender.join(TIMEOUT)
        t.join(TIMEOUT)
    assert hashlib.sha256(got).digest() == hashlib.sha256(payload).digest()
    assert outcome == ["ok"]
    assert calls.moved == {"up": len(payload), "down": len(payload)}


def test_idle_job_stops_if_idle_and_closes_its_connection(pair: Pair) -> None:
    calls = Calls()
    ingress, data = pair
    with backend(echo) as port:
        job = make_job(data, port, calls)
        t, outcome = start(job)
        assert job.stop_if_idle() is True
        t.join(TIMEOUT)
        assert ingress.recv(1) == b""  # the ingress sees its pooled connection close
    assert outcome == ["retired"] and job.state is State.DONE
    assert calls.opened == 0 and calls.moved == {"up": 0, "down": 0}


def test_a_begun_stream_is_not_stopped_as_idle(pair: Pair) -> None:
    calls = Calls()
    ingress, data = pair
    answered = threading.Event()

    def slow_echo(conn: socket.socket) -> None:
        hello = conn.recv(len(HELLO), socket.MSG_WAITALL)
        answered.wait(TIMEOUT)
        conn.sendall(hello)

    with backend(slow_echo) as port:
        job = make_job(data, port, calls)
        t, outcome = start(job)
        ingress.sendall(HELLO)
        until(lambda: job.state is State.OPENING)
        assert job.stop_if_idle() is False  # its control connection died: keeps going
        answered.set()
        assert ingress.recv(len(HELLO), socket.MSG_WAITALL) == HELLO
        ingress.shutdown(socket.SHUT_WR)
        assert read_until_eof(ingress) == b""
        t.join(TIMEOUT)
    assert outcome == ["ok"]


def test_stop_ends_an_active_stream(pair: Pair) -> None:
    calls = Calls()
    ingress, data = pair
    with backend(echo) as port:
        job = make_job(data, port, calls, first=HELLO)
        t, outcome = start(job)
        assert ingress.recv(len(HELLO), socket.MSG_WAITALL) == HELLO
        job.stop()
        t.join(TIMEOUT)
        assert not t.is_alive()
        assert read_until_eof(ingress) == b""
    assert outcome and outcome[0] in ("ok", "reset")


def test_stop_before_the_thread_runs_closes_the_connection(pair: Pair) -> None:
    ingress, data = pair
    job = make_job(data, 9, Calls())  # never connected anywhere
    job.stop()
    assert data.fileno() == -1 and job.state is State.DONE
    assert job.run() == "retired"
    assert ingress.recv(1) == b""


def test_unreachable_forward_answers_with_a_tls_alert(pair: Pair) -> None:
    calls = Calls()
    ingress, data = pair
    with socket.create_server(("127.0.0.1", 0)) as s:
        closed_port = s.getsockname()[1]  # nothing listens there once closed
    job = make_job(data, closed_port, calls, first=HELLO)
    t, outcome = start(job)
    assert read_until_eof(ingress) == tls_alert.alert_record(tls_alert.INTERNAL_ERROR)
    t.join(TIMEOUT)
    assert outcome == ["forward_unreachable"]
    assert len(calls.failed) == 1 and calls.opened == 1


def test_eof_before_any_stream_retires_the_connection(pair: Pair) -> None:
    ingress, data = pair
    job = make_job(data, 9, Calls())
    t, outcome = start(job)
    ingress.close()  # the ingress retired its pooled connection
    t.join(TIMEOUT)
    assert outcome == ["retired"]


@pytest.mark.parametrize("idle_timeout", [0.2])
def test_a_silent_stream_ends_at_the_idle_timeout(pair: Pair, idle_timeout: float) -> None:
    calls = Calls()
    ingress, data = pair
    with backend(echo) as port:
        t, outcome = start(make_job(data, port, calls, first=HELLO,
                                    idle_timeout=idle_timeout))
        assert ingress.recv(len(HELLO), socket.MSG_WAITALL) == HELLO
        t.join(TIMEOUT)  # then nobody sends anything
        assert outcome == ["idle_timeout"]
        assert read_until_eof(ingress) == b""
