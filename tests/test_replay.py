"""ReplayStream: trio's generic stream conformance suite, and the replayed bytes' own rules."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from pact_ingress.net.replay import ReplayStream


async def _socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    left, right = trio.socket.socketpair()
    return trio.SocketStream(left), trio.SocketStream(right)


async def _fill(stream: trio.abc.SendStream) -> None:
    """Send until the kernel buffers are full (the peer reads nothing)."""

    async def sender() -> None:
        while True:
            await stream.send_all(b"x" * 10000)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()


async def test_check_half_closeable_stream() -> None:
    """With nothing left to replay it behaves like the socket stream it wraps (the router
    hands it on in exactly that state once the peeked bytes are read)."""

    async def maker() -> tuple[ReplayStream, ReplayStream]:
        left, right = await _socket_pair()
        return ReplayStream(b"", left), ReplayStream(b"", right)

    async def clogged() -> tuple[ReplayStream, ReplayStream]:
        left, right = await maker()
        await _fill(left)
        await _fill(right)
        return left, right

    await trio.testing.check_half_closeable_stream(maker, clogged)  # type: ignore[arg-type]


async def test_check_two_way_stream_after_the_replay() -> None:
    """The same suite on streams that did replay bytes first, as a router-built one does:
    the peer's first flight was peeked off the socket and is read back through the stream."""

    async def maker() -> tuple[ReplayStream, ReplayStream]:
        left, right = await _socket_pair()
        await right.send_all(b"client hello")
        peeked = await left.receive_some(5)  # the router reads some of it ...
        stream = ReplayStream(peeked, left)
        got = b""
        while len(got) < len(b"client hello"):  # ... and the next owner sees it all
            got += await stream.receive_some(4)
        assert got == b"client hello"
        assert stream.pending == b""
        return stream, ReplayStream(b"", right)

    await trio.testing.check_two_way_stream(maker, None)


async def test_replayed_bytes_first_then_live() -> None:
    left, right = await _socket_pair()
    stream = ReplayStream(b"abcdef", left)
    assert stream.pending == b"abcdef"
    assert await stream.receive_some(2) == b"ab"
    assert stream.pending == b"cdef"
    await right.send_all(b"live")
    assert await stream.receive_some() == b"cdef"  # never mixed with live bytes
    assert await stream.receive_some() == b"live"
    await stream.aclose()
    await right.aclose()


async def test_take_pending_hands_the_rest_over() -> None:
    left, right = await _socket_pair()
    stream = ReplayStream(b"abc", left)
    await stream.receive_some(1)
    assert stream.take_pending() == b"bc"
    assert stream.pending == b""
    await right.send_all(b"x")
    assert await stream.receive_some() == b"x"
    await stream.aclose()
    await right.aclose()


async def test_replay_path_keeps_the_stream_rules() -> None:
    """While replayed bytes remain, the stream still refuses what any trio stream refuses:
    a size below 1 (b"" would look like EOF) and a read after close."""
    left, right = await _socket_pair()
    stream = ReplayStream(b"abc", left)
    with pytest.raises(ValueError):
        await stream.receive_some(0)
    assert stream.pending == b"abc"
    await stream.aclose()
    with pytest.raises(trio.ClosedResourceError):
        await stream.receive_some()
    await right.aclose()
