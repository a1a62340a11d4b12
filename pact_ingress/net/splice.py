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
- pipes come from a small free list, because creating and resizing a pipe costs tens of
  µs — a flood of short connections never pays it.

Pipes only while bytes are in flight
------------------------------------
A direction holds a pipe only while it moves bytes: it takes one from the pool when its
source may have something (the first try, and every wake-up from `wait_readable`),
splices through it, and gives it back as soon as the pipe is empty and the source has
nothing more (EAGAIN). A direction waiting for its destination keeps its pipe (bytes are
in it). So an idle connection costs its two sockets and nothing else, and the number of
pipes alive follows the number of transfers in progress, not the number of connections.

The pool must fit what an unprivileged user may have: the kernel charges every pipe's
capacity (empty or not) to its owner, and past `/proc/sys/fs/pipe-user-pages-soft` (64 MiB by
default) it refuses to enlarge a pipe (F_SETPIPE_SZ fails with EPERM) and makes new
ones tiny. The systemd unit runs as a dynamic user, so at start the pool is sized from
that limit (`PIPE_BUDGET_SHARE` of it, in pipes of `PIPE_SIZE`): at most `BIG_PIPES`
enlarged pipes exist at a time. A transfer that finds none free still gets a pipe — a
new one at the kernel's default size, kept in a small second list — so the pool never
makes a transfer wait for another (which could deadlock two directions that depend on
each other) and a refused enlargement only makes that transfer slower, never fails it.

Idle timeout: one clock for both directions; the relay ends when neither direction moved
a byte for `idle_timeout` seconds (a slow client that trickles bytes is not idle; one that
stops is closed).
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import trio

#: Largest pipe capacity asked for: a larger pipe moves more per splice(2) call, so fewer
#: calls (each a trip through the interpreter) per megabyte; 1 MiB is the default
#: /proc/sys/fs/pipe-max-size, the most an unprivileged process may ask for.
PIPE_SIZE_MAX = 1 << 20
#: The share of the user's soft pipe budget (pipe-user-pages-soft) the enlarged pipes may
#: take: the rest is for default-size pipes made when they are all busy, and for anything
#: else the same user runs (a connector, a tool run under the unit's user).
PIPE_BUDGET_SHARE = 0.5
#: Default-size pipes kept for reuse beside the enlarged ones. Each costs two fds and,
#: empty or not, its 64 KiB capacity against the user's budget (the kernel charges
#: capacity, not content): 64 of them let a burst of concurrent transfers stop paying
#: pipe2(2) per transfer for 4 MiB of budget.
SMALL_POOL = 64
_F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def _read_int(path: str, default: int) -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return default


def pipe_budget(max_size: int, soft_pages: int, page: int) -> tuple[int, int]:
    """(capacity, count) of the enlarged pipes: the capacity is PIPE_SIZE_MAX unless
    pipe-max-size is lower; the count fits PIPE_BUDGET_SHARE of the soft per-user limit
    (0 = no limit: then as many as a 64 MiB budget would allow, like the default)."""
    size = max(page, min(PIPE_SIZE_MAX, max_size))
    budget = (soft_pages or 16384) * page * PIPE_BUDGET_SHARE
    return size, max(1, int(budget // size))


#: Pipe capacity for splicing and how many pipes of that size may exist at once, fixed at
#: start from /proc/sys/fs (see the module docstring).
PIPE_SIZE, BIG_PIPES = pipe_budget(
    _read_int("/proc/sys/fs/pipe-max-size", PIPE_SIZE_MAX),
    _read_int("/proc/sys/fs/pipe-user-pages-soft", 16384), os.sysconf("SC_PAGE_SIZE"))
#: Copy-path read size: large enough to amortise the per-call cost of Python, small
#: enough that a relay holds at most this much per direction in memory.
COPY_CHUNK = 256 * 1024
#: Chunks moved back to back before a direction yields to the scheduler, so one busy
#: connection cannot starve the others (and cancellation is seen promptly).
YIELD_EVERY = 16
SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
HAVE_SPLICE = hasattr(os, "splice")
#: Errors from a peer that end a relay (the peer went away).
_PEER_GONE = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)
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


class Pipe(NamedTuple):
    """A non-blocking pipe: read end, write end, and whether it was enlarged to
    PIPE_SIZE (counted against BIG_PIPES) or kept the kernel's default size."""

    r: int
    w: int
    big: bool


class PipePool:
    """Drained pipes for reuse: at most `big` enlarged ones exist at a time (in use or
    free), default-size ones are made when those are all busy and at most `small` of
    them are kept. Safe from any thread: the connector's stream threads share it."""

    def __init__(self, big: int, small: int, size: int) -> None:
        self.big_limit, self.small_limit, self.size = big, small, size
        self.big_alive = 0  # enlarged pipes open, free or in use
        self.refused = 0  # enlargements the kernel refused (over the user's budget)
        self._big: list[Pipe] = []
        self._small: list[Pipe] = []
        self._lock = threading.Lock()

    def take(self) -> Pipe:
        with self._lock:
            if self._big:
                return self._big.pop()
            enlarge = self.big_alive < self.big_limit
            if not enlarge and self._small:
                return self._small.pop()
            if enlarge:
                self.big_alive += 1  # reserved now, released below if refused
        r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        if not enlarge:
            return Pipe(r, w, False)
        try:
            fcntl.fcntl(w, _F_SETPIPE_SZ, self.size)
        except OSError:  # EPERM over the user's budget: the default size still works
            with self._lock:
                self.big_alive -= 1
                self.refused += 1
            return Pipe(r, w, False)
        return Pipe(r, w, True)

    def give(self, pipe: Pipe, drained: bool) -> None:
        with self._lock:
            if drained:
                if pipe.big:
                    self._big.append(pipe)
                    return
                if len(self._small) < self.small_limit:
                    self._small.append(pipe)
                    return
            elif pipe.big:
                self.big_alive -= 1
        # a pipe still holding bytes must never be handed to another connection
        os.close(pipe.r)
        os.close(pipe.w)

    def free(self) -> int:
        """Pipes waiting in the pool (each two fds)."""
        return len(self._big) + len(self._small)

    def clear(self) -> None:
        """Close every free pipe (tests; pipes in use are closed when given back)."""
        with self._lock:
            free, self._big, self._small = self._big + self._small, [], []
            self.big_alive -= sum(p.big for p in free)
        for pipe in free:
            os.close(pipe.r)
            os.close(pipe.w)


#: The process's pipes (the trio relay and the connector's stream threads share it).
POOL = PipePool(BIG_PIPES, SMALL_POOL, PIPE_SIZE)


def take_pipe() -> Pipe:
    """A drained pipe: from the pool, or a new one (never waits)."""
    return POOL.take()


def give_pipe(pipe: Pipe, drained: bool) -> None:
    """Back to the pool if `drained` (and the pool keeps it), else closed."""
    POOL.give(pipe, drained)


async def _splice_direction(
    src_sock: trio.socket.SocketType, dst_sock: trio.socket.SocketType,
    moved: Callable[[int], None]
) -> None:
    d = Direction("", src_sock.fileno(), dst_sock.fileno())
    pipe: Pipe | None = None
    try:
        while True:
            if pipe is None:  # the source may have bytes: tried before any wait
                pipe = take_pipe()
            wait = pump(d, pipe, moved, YIELD_EVERY)
            if wait is Wait.READ:  # drained and nothing to read: an idle direction
                give_pipe(pipe, drained=True)  # holds no pipe
                pipe = None
                await trio.lowlevel.wait_readable(src_sock)
            elif wait is Wait.WRITE:  # bytes in the pipe: it stays ours
                await trio.lowlevel.wait_writable(dst_sock)
            elif wait is Wait.EOF:
                _shutdown_write(dst_sock)
                return
            else:  # a busy direction lets the others (and a cancel) in now and then
                await trio.lowlevel.checkpoint()
    finally:
        if pipe is not None:
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


def pump(d: Direction, pipe: Pipe, moved: Callable[[int], None],
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
