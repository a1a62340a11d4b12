"""Relaying bytes between two streams until both directions are done.

Theory of operation
-------------------
A relay has two independent directions. Each ends when its source says EOF (passed on as
a half-close to the destination, so the other direction keeps flowing — TLS
close_notify semantics and "send, then shutdown(SHUT_WR)" clients need this) or when
either side fails (then the whole relay is torn down: a reset on one side means the
conversation is over).

When both ends are plain TCP sockets (passthrough, and tunnel data connections: the
router hands them over as bare trio sockets, `relay_sockets`) the steady state uses
`os.splice` through a pipe, so payload bytes never enter Python: socket → pipe → socket.
The kernel moves the pages, so a bulk transfer costs a fraction of the CPU of a
recv/send_all copy through Python buffers. The pipe is drained completely before the
next socket → pipe splice, so a slow reader applies backpressure to the writer through
TCP instead of growing a buffer. Any other stream (TLS streams, test memory streams) takes the copy
path, with the same half-close behaviour.

Per-connection cost matters more than per-byte cost for a Python router (with the bytes
in the kernel, what is left per connection is interpreter work: setup is where a Python
proxy loses to a C one), so the hot path is shaped for it:

- a splice is *tried first* and trio's `wait_readable`/`wait_writable` is only used
  after EAGAIN: a ready socket costs one syscall, not an epoll registration and a trip
  through the scheduler;
- one direction runs in the relay's own task and only the other gets a new one;
- a half-close on a bare socket is a plain `shutdown(SHUT_WR)`, not `send_eof()` with its
  scheduler yield;
- the idle timeout is the relay nursery's own cancel scope, whose deadline each moved
  chunk pushes forward — not a watcher task, not a second scope: a relay that ends
  normally raises no `Cancelled` at all;
- pipes come from a small free list (`PIPE_POOL`), because creating and resizing two
  pipes per connection costs tens of µs — a flood of short connections never pays it.

Idle timeout: one clock for both directions; the relay ends when neither direction moved
a byte for `idle_timeout` seconds (a slow client that trickles bytes is not idle; one that
stops is closed).
"""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

import trio

#: Pipe capacity for splicing: a larger pipe moves more per splice(2) call, so fewer calls
#: (each a trip through the interpreter) per megabyte; 1 MiB is the default
#: /proc/sys/fs/pipe-max-size, the most an unprivileged process may ask for. Falls back
#: to the kernel default (64 KiB) when pipe-max-size is set lower.
PIPE_SIZE = 1 << 20
#: Drained pipes kept for reuse. Each costs two fds and (only while it holds data) up to
#: PIPE_SIZE of kernel memory; 256 covers the steady churn of a busy small VPS.
PIPE_POOL = 256
#: Copy-path read size: large enough to amortise the per-call cost of Python, small
#: enough that a relay holds at most this much per direction in memory.
COPY_CHUNK = 256 * 1024
#: Chunks moved back to back before a direction yields to the scheduler, so one busy
#: connection cannot starve the others (and cancellation is seen promptly).
YIELD_EVERY = 16
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)
SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
HAVE_SPLICE = hasattr(os, "splice")
#: Errors from a peer that end a relay (the peer went away).
_PEER_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
_pipes: list[tuple[int, int]] = []
#: One end of a relay: a stream (copy path) or a bare trio socket (splice path).
_End = Any
_Pump = Callable[[Any, Any, Callable[[int], None]], Awaitable[None]]


@dataclass
class RelayResult:
    up: int = 0  # bytes a → b
    down: int = 0  # bytes b → a
    outcome: str = "ok"  # ok | idle_timeout | reset


def _is_plain_socket(stream: trio.abc.Stream) -> bool:
    return type(stream) is trio.SocketStream


async def relay(
    a: trio.abc.Stream,
    b: trio.abc.Stream,
    *,
    idle_timeout: float,
    on_bytes: Callable[[str, int], None] | None = None,
    use_splice: bool = True,
) -> RelayResult:
    """Pump a ↔ b until both directions reach EOF, one side fails, or idleness.

    Does not close the streams; the caller owns them. `on_bytes(direction, n)` is called
    per chunk moved ("up" = a → b) so counters stay live for long connections.
    """
    if use_splice and HAVE_SPLICE and _is_plain_socket(a) and _is_plain_socket(b):
        return await relay_sockets(a.socket, b.socket,  # type: ignore[attr-defined]
                                   idle_timeout=idle_timeout, on_bytes=on_bytes)
    return await _relay(a, b, _copy_direction, idle_timeout, on_bytes)


async def relay_sockets(
    a: trio.socket.SocketType,
    b: trio.socket.SocketType,
    *,
    idle_timeout: float,
    on_bytes: Callable[[str, int], None] | None = None,
) -> RelayResult:
    """`relay` for two bare connected TCP sockets (the router's passthrough hot path
    never wraps them in `SocketStream`s): splice both ways."""
    return await _relay(a, b, _splice_direction, idle_timeout, on_bytes)


async def _relay(a: _End, b: _End, pump: _Pump, idle_timeout: float,
                 on_bytes: Callable[[str, int], None] | None) -> RelayResult:
    result = RelayResult()
    async with trio.open_nursery() as nursery:
        idle = nursery.cancel_scope  # its deadline is the idle clock: no second scope
        idle.deadline = trio.current_time() + idle_timeout

        def mover(direction: str) -> Callable[[int], None]:
            def moved(n: int) -> None:
                idle.deadline = trio.current_time() + idle_timeout
                if direction == "up":
                    result.up += n
                else:
                    result.down += n
                if on_bytes is not None:
                    on_bytes(direction, n)
            return moved

        async def run(src: Any, dst: Any, direction: str) -> None:
            try:
                await pump(src, dst, mover(direction))
            except _PEER_GONE:
                result.outcome = "reset"
                idle.cancel()

        nursery.start_soon(run, b, a, "down")
        await run(a, b, "up")
    if idle.cancelled_caught and result.outcome != "reset":
        result.outcome = "idle_timeout"
    return result


async def _send_eof(stream: trio.abc.Stream) -> None:
    try:
        if isinstance(stream, trio.abc.HalfCloseableStream):
            await stream.send_eof()
        else:
            await stream.aclose()
    except _PEER_GONE:
        pass


def _shutdown_write(sock: trio.socket.SocketType) -> None:
    """Half-close a bare socket (what `SocketStream.send_eof` does, minus a yield)."""
    try:
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the peer is gone already: its direction will see that


async def _copy_direction(
    src: trio.abc.Stream, dst: trio.abc.Stream, moved: Callable[[int], None]
) -> None:
    while True:
        data = await src.receive_some(COPY_CHUNK)
        if not data:
            await _send_eof(dst)
            return
        await dst.send_all(data)
        moved(len(data))


def take_pipe() -> tuple[int, int]:
    """A drained pipe from the free list, or a new one. Safe from any thread (the
    connector's stream threads share the list): list.pop and append are atomic, so a
    pipe is never handed out twice; racing `give_pipe`s may overshoot PIPE_POOL by a
    few, which costs only descriptors."""
    try:
        return _pipes.pop()
    except IndexError:
        pass
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.fcntl(w, _F_SETPIPE_SZ, PIPE_SIZE)
    except OSError:
        pass  # kernel default size still works, only slower
    return r, w


def give_pipe(pipe: tuple[int, int], drained: bool) -> None:
    """Back to the free list if `drained` (and the list has room), else closed."""
    if drained and len(_pipes) < PIPE_POOL:
        _pipes.append(pipe)
    else:  # a pipe still holding bytes must never be handed to another connection
        os.close(pipe[0])
        os.close(pipe[1])


async def _splice_direction(
    src_sock: trio.socket.SocketType, dst_sock: trio.socket.SocketType,
    moved: Callable[[int], None]
) -> None:
    d = Direction("", src_sock.fileno(), dst_sock.fileno())
    pipe = take_pipe()
    try:
        while True:
            wait = pump(d, pipe, moved, YIELD_EVERY)
            if wait is Wait.READ:
                await trio.lowlevel.wait_readable(src_sock)
            elif wait is Wait.WRITE:
                await trio.lowlevel.wait_writable(dst_sock)
            elif wait is Wait.EOF:
                _shutdown_write(dst_sock)
                return
            else:  # a busy direction lets the others (and a cancel) in now and then
                await trio.lowlevel.checkpoint()
    finally:
        give_pipe(pipe, drained=d.pending == 0)


class Wait(Enum):
    """Why `pump` stopped: what the direction waits for next."""

    READ = "read"  # its source has nothing now
    WRITE = "write"  # its destination takes nothing now (bytes wait in the pipe)
    EOF = "eof"  # its source said EOF: the caller half-closes the destination
    BUSY = "busy"  # moved `burst` pipefuls: more may be ready


@dataclass
class Direction:
    """One direction's relay state (sans-I/O: `pump` does the syscalls)."""

    name: str  # "up" | "down" (the connector's stream threads); "" here
    src: int
    dst: int
    pending: int = 0  # bytes in this direction's pipe, not yet taken by dst
    done: bool = False  # src reached EOF and it was passed on, or the relay is over


def pump(d: Direction, pipe: tuple[int, int], moved: Callable[[int], None],
         burst: int) -> Wait:
    """Splice what direction `d` can move now, src → pipe → dst, at most `burst`
    pipefuls; never blocks. The one relay step both relays use: the trio one (waits on
    the scheduler between calls) and the connector's stream threads (wait in poll(2)).

    The pipe is drained before the next fill, so a slow reader holds the writer back
    through TCP instead of a growing buffer. `moved(n)` is called per chunk taken by
    dst. A failed splice (reset, broken pipe) raises OSError: the relay is over.
    """
    for _ in range(burst):
        while d.pending:
            try:
                n = os.splice(pipe[0], d.dst, d.pending, flags=SPLICE_FLAGS)
            except BlockingIOError:
                return Wait.WRITE
            d.pending -= n
            moved(n)
        try:
            n = os.splice(d.src, pipe[1], PIPE_SIZE, flags=SPLICE_FLAGS)
        except BlockingIOError:
            return Wait.READ
        if n == 0:
            d.done = True
            return Wait.EOF
        d.pending = n
    return Wait.BUSY
