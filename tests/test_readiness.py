"""The readiness hub (`net/readiness.py`) on real sockets: waits end when the socket is
ready, at their deadline, on cancellation or close, and never for another socket."""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import pytest
import trio
import trio.testing

from pact_ingress.net import deadlines, readiness


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    return a, b


async def _recv(watch: readiness.Watch, sock: socket.socket, deadline: float = float("inf"),
                wait_first: bool = False) -> bytes:
    """The callers' rule: try the syscall, wait only when it would block."""
    tried = False
    while True:
        if wait_first:
            await watch.wait_readable(deadline, tried)
        try:
            return sock.recv(4096)
        except BlockingIOError:
            wait_first = tried = True


async def _parked_reads(watch: readiness.Watch, sock: socket.socket,
                        act: Callable[[], object], reads: int = 1) -> list[bytes]:
    """What a reader parked on `watch` gets in `reads` reads when `act` runs once it is
    parked (the nursery waits for it)."""
    got: list[bytes] = []

    async def reader() -> None:
        for _ in range(reads):
            got.append(await _recv(watch, sock, wait_first=True))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()
        assert watch.reader is not None
        act()
    return got


async def test_a_parked_reader_is_woken_by_data_and_again_by_more() -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        for i in range(5):  # the socket stays in the set: every round waits again
            got = await _parked_reads(watch, a, lambda i=i: b.send(b"x%d" % i))
            assert got == [b"x%d" % i]
            assert watch.reader is None


async def test_an_event_seen_before_the_wait_is_not_lost() -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        b.send(b"early")
        await trio.testing.wait_all_tasks_blocked()  # the hub took the event: nobody waited
        assert watch.readable
        # a caller that did not try recv (it thinks nothing can be there yet) returns
        with trio.fail_after(5):
            assert await _recv(watch, a, wait_first=True) == b"early"


async def test_a_deadline_fires_on_a_parked_wait_and_the_socket_stays_usable(
        autojump_clock: trio.testing.MockClock) -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        start = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await _recv(watch, a, start + 3, wait_first=True)
        assert trio.current_time() >= start + 3
        assert not deadlines.sweeper()._armed
        assert watch.reader is None
        b.send(b"after")
        assert await _recv(watch, a, trio.current_time() + 3) == b"after"
        # an answered wait never fires later
        b.send(b"y")
        assert await _recv(watch, a, trio.current_time() + 1, wait_first=True) == b"y"
        await trio.sleep(5)
        assert not deadlines.sweeper()._armed


async def test_a_due_deadline_fails_at_once(autojump_clock: trio.testing.MockClock) -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        with pytest.raises(trio.TooSlowError):
            await watch.wait_readable(trio.current_time() - 1)
        assert watch.reader is None


async def test_cancellation_takes_the_waiter_off() -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        with trio.move_on_after(0.05) as scope:
            await watch.wait_readable()
        assert scope.cancelled_caught
        assert watch.reader is None
        b.send(b"z")  # the next wait works
        with trio.fail_after(5):
            assert await _recv(watch, a, wait_first=True) == b"z"


async def test_two_readers_on_one_socket_are_refused() -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.wait_readable)
            await trio.testing.wait_all_tasks_blocked()
            with pytest.raises(trio.BusyResourceError):
                await watch.wait_readable()
            nursery.cancel_scope.cancel()


async def test_close_wakes_reader_and_writer_and_later_waits_fail() -> None:
    a, b = _pair()
    with b:
        watch = readiness.hub().watch(a)
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        while True:  # fill the send buffer so the writer has to wait
            try:
                a.send(b"\0" * 65536)
            except BlockingIOError:
                break
        errors: list[type[BaseException]] = []

        async def wait(fn) -> None:  # type: ignore[no-untyped-def]
            try:
                await fn()
            except trio.ClosedResourceError as exc:
                errors.append(type(exc))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(wait, watch.wait_readable)
            nursery.start_soon(wait, watch.wait_writable)
            await trio.testing.wait_all_tasks_blocked()
            assert watch.reader is not None and watch.writer is not None
            watch.close()
            a.close()
        assert errors == [trio.ClosedResourceError, trio.ClosedResourceError]
        with pytest.raises(trio.ClosedResourceError):
            await watch.wait_readable()


async def test_a_writer_waits_for_room_then_sends() -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        while True:
            try:
                a.send(b"\0" * 65536)
            except BlockingIOError:
                break

        async def drain() -> None:
            await trio.testing.wait_all_tasks_blocked()
            while True:
                try:
                    b.recv(1 << 20)
                except BlockingIOError:
                    return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            with trio.fail_after(10):
                while True:
                    try:
                        a.send(b"more")
                        break
                    except BlockingIOError:
                        await watch.wait_writable()
        assert watch.out  # writes are watched from now on


async def test_a_reused_fd_number_gets_a_fresh_watch() -> None:
    hub = readiness.hub()
    a, b = _pair()
    fd = a.fileno()
    old = hub.watch(a)
    a.close()  # closed without `Watch.close`: the kernel drops it from the epoll set
    b.close()
    for _ in range(20):  # get a socket with the same number
        c, d = _pair()
        if c.fileno() == fd:
            break
        if d.fileno() == fd:
            c, d = d, c
            break
        c.close()
        d.close()
    else:
        pytest.fail("the freed fd number was not reused")
    with c, d:
        new = hub.watch(c)
        assert new is not old and old.closed
        assert hub.watches[fd] is new
        d.send(b"new socket")
        with trio.fail_after(5):
            assert await _recv(new, c, wait_first=True) == b"new socket"


@pytest.mark.parametrize("count,reverse", [
    (200, True),  # sent in an order unlike the waits'
    # more sockets ready at once than one `epoll_wait` takes (`MAX_EVENTS`): several
    # takes in one hub wake, every parked reader woken
    (readiness.MAX_EVENTS * 3 + 7, False),
], ids=["200_reversed", "beyond_one_epoll_take"])
async def test_many_sockets_each_woken_for_its_own_data(count: int, reverse: bool) -> None:
    hub = readiness.hub()
    pairs = [_pair() for _ in range(count)]
    try:
        watches = [hub.watch(a) for a, _ in pairs]
        got: dict[int, bytes] = {}

        async def reader(i: int) -> None:
            got[i] = await _recv(watches[i], pairs[i][0], wait_first=True)

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(count):
                    nursery.start_soon(reader, i)
                await trio.testing.wait_all_tasks_blocked()
                # all sent before the hub runs
                for i in (reversed(range(count)) if reverse else range(count)):
                    pairs[i][1].send(b"%d" % i)
        assert got == {i: b"%d" % i for i in range(count)}
    finally:
        for a, b in pairs:
            a.close()
            b.close()


async def test_a_peer_close_wakes_the_reader() -> None:
    a, b = _pair()
    with a:
        watch = readiness.hub().watch(a)
        assert await _parked_reads(watch, a, b.close) == [b""]


async def test_the_end_that_came_with_the_last_bytes_is_not_lost() -> None:
    """Data and FIN in one go: the recv that takes the data leaves the end unread; a
    later wait that does not look first still ends at once."""
    a, b = _pair()
    with a:
        watch = readiness.hub().watch(a)

        def last_then_close() -> None:
            b.send(b"last")
            b.close()

        assert await _parked_reads(watch, a, last_then_close, reads=2) == [b"last", b""]


async def test_bytes_left_behind_by_a_full_read_are_found() -> None:
    a, b = _pair()
    with a, b:
        watch = readiness.hub().watch(a)
        b.send(b"x" * 300)
        await trio.testing.wait_all_tasks_blocked()
        assert a.recv(100) == b"x" * 100  # a full buffer: the owner marks the watch
        watch.readable = True
        with trio.fail_after(5):
            assert await _recv(watch, a, wait_first=True) == b"x" * 200


async def test_a_watch_leaves_only_when_nobody_waits_and_then_is_not_woken() -> None:
    hub = readiness.hub()
    a, b = _pair()
    with a, b:
        watch = hub.watch(a)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch.wait_readable)
            await trio.testing.wait_all_tasks_blocked()
            assert not watch.leave()  # a reader is parked: it stays
            b.send(b"1")
        assert a.recv(10) == b"1"
        assert watch.leave()
        assert a.fileno() not in hub.watches
        b.send(b"2")  # no longer in the epoll set: nothing marks it
        await trio.testing.wait_all_tasks_blocked()
        assert not watch.readable
        with pytest.raises(trio.ClosedResourceError):
            await watch.wait_readable()
        # trio's own waits work on it as before, and it can join again
        await trio.lowlevel.wait_readable(a)
        assert a.recv(10) == b"2"
        again = hub.watch(a)
        b.send(b"3")
        with trio.fail_after(5):
            assert await _recv(again, a, wait_first=True) == b"3"


def test_crowded_and_sparse_follow_the_open_connections(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(readiness, "HUB_MIN_CONNECTIONS", 4)
    seen = []
    for n in range(6):
        monkeypatch.setattr(readiness, "open_connections", n)
        seen.append((readiness.crowded(), readiness.sparse()))
    # joins from 4, leaves below 2: between, a socket stays where it is
    assert seen == [(False, True), (False, True), (False, False), (False, False),
                    (True, False), (True, False)]


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """A connected loopback TCP pair (server side non-blocking), as a client leg is."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    server.setblocking(False)
    return server, client


def _reset(sock: socket.socket) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


async def test_on_fail_outlasts_input_and_a_half_close_and_comes_at_a_reset() -> None:
    """`Watch.on_fail` (the trio engine's exchange while the node is asked): an upload
    still coming and a half-close (a client waiting for its answer) do not call it and
    are left unread; the peer's reset does, once. A Watch with it set does not leave."""
    server, client = _tcp_pair()
    with server, client:
        watch = readiness.hub().watch(server)
        calls: list[int] = []
        watch.on_fail = lambda: calls.append(1)
        client.sendall(b"x" * 50_000)  # input
        client.shutdown(socket.SHUT_WR)  # and its end
        with trio.fail_after(5):
            while not watch.ended:  # (the hub has taken these events)
                await trio.sleep(0.01)
        assert not watch.failed and not calls
        assert server.recv(65536, socket.MSG_PEEK)  # nothing was read
        assert not watch.leave()  # armed: the hub keeps it
        _reset(client)
        with trio.fail_after(5):
            while not calls:
                await trio.sleep(0.01)
        assert calls == [1] and watch.failed and watch.on_fail is None
        assert watch.leave()  # disarmed: it may go


async def test_close_disarms_on_fail() -> None:
    server, client = _tcp_pair()
    with client:
        watch = readiness.hub().watch(server)
        watch.on_fail = lambda: pytest.fail("called after close")
        watch.close()
        server.close()
        assert watch.on_fail is None


async def test_on_fin_comes_at_a_half_close_only_once_and_not_for_input() -> None:
    """`Watch.on_fin`: input does not call it, the peer's FIN does (once), and a reset
    after it calls `on_fail`, not `on_fin` again."""
    server, client = _tcp_pair()
    with server, client:
        watch = readiness.hub().watch(server)
        fins: list[int] = []
        fails: list[int] = []
        watch.on_fin = lambda: fins.append(1)
        watch.on_fail = lambda: fails.append(1)
        client.sendall(b"x" * 1000)
        with trio.fail_after(5):
            while not watch.readable:  # (the hub has taken the input's event)
                await trio.sleep(0.01)
        assert not fins and not fails
        assert not watch.leave()  # armed: the hub keeps it
        client.shutdown(socket.SHUT_WR)
        with trio.fail_after(5):
            while not fins:
                await trio.sleep(0.01)
        assert fins == [1] and watch.on_fin is None and not fails
        server.send(b"y")
        client.close()  # with "y" unread: a reset
        with trio.fail_after(5):
            while not fails:
                await trio.sleep(0.01)
        assert fins == [1] and fails == [1]
