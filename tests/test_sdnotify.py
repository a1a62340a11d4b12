"""sd_notify against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from pact_ingress import sdnotify


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A bound datagram socket, announced through NOTIFY_SOCKET like systemd does."""
    path = tmp_path / "notify.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    yield sock
    sock.close()


def _recv(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


def _pending(sock: socket.socket) -> list[bytes]:
    """Every datagram already queued, without waiting."""
    out: list[bytes] = []
    sock.setblocking(False)
    try:
        for _ in range(1000):  # bound: far more than any test sends
            out.append(sock.recv(4096))
    except BlockingIOError:
        pass
    finally:
        sock.settimeout(2)
    return out


def test_without_notify_socket_everything_is_a_noop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.ready() is False
    assert sdnotify.reloading() is False
    assert sdnotify.stopping() is False


def test_ready(notify_socket: socket.socket) -> None:
    assert sdnotify.ready() is True
    assert _recv(notify_socket) == {"READY": "1"}


def test_ready_with_status(notify_socket: socket.socket) -> None:
    assert sdnotify.ready("serving 3 routes")
    assert _recv(notify_socket) == {"READY": "1", "STATUS": "serving 3 routes"}


def test_reloading_carries_monotonic_usec(notify_socket: socket.socket) -> None:
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    assert sdnotify.reloading()
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    msg = _recv(notify_socket)
    assert msg["RELOADING"] == "1"
    assert before <= int(msg["MONOTONIC_USEC"]) <= after


def test_stopping(notify_socket: socket.socket) -> None:
    assert sdnotify.stopping()
    assert _recv(notify_socket) == {"STOPPING": "1"}


def test_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"pact-ingress-test-{os.getpid()}-{time.monotonic_ns()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(b"\0" + name.encode())
        sock.settimeout(2)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert sdnotify.stopping()
        assert sock.recv(100) == b"STOPPING=1"


def test_unreachable_socket_returns_false(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.ready() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("30000000", None, 30.0),
        ("30000000", "self", 30.0),
        ("30000000", "1", None),  # meant for another process
        ("0", None, None),
        ("garbage", None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for key, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(key, raising=False)
        else:
            monkeypatch.setenv(key, str(os.getpid()) if value == "self" else value)
    assert sdnotify.watchdog_interval() == expected


async def test_watchdog_loop_pings_at_half_interval(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "10000000")  # 10 s → ping every 5 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    start = trio.current_time()
    with trio.move_on_after(22):  # pings at 0, 5, 10, 15, 20
        await sdnotify.watchdog_loop()
    assert trio.current_time() - start == pytest.approx(22)
    assert _pending(notify_socket) == [b"WATCHDOG=1"] * 5


async def test_watchdog_loop_returns_when_unarmed(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    start = trio.current_time()
    await sdnotify.watchdog_loop()
    assert trio.current_time() == start
    assert _pending(notify_socket) == []
