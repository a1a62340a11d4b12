"""One tunnel data connection's life on an OS thread: the connector's data plane.

A `StreamJob` makes one data connection to the ingress (`Dial`: TCP, a preamble, an
expected answer) or takes one made elsewhere (a TLS data connection, unwrapped), and on
its own thread: waits for the first bytes the ingress sends (they mean "this is a stream
now"), connects `forward`, writes them, and splices both ways until both directions are
done — or, if `forward` cannot be reached, answers the ingress with a TLS alert, as a
dead backend would.

Why a thread here when everything else is trio
----------------------------------------------
Every stream's first byte crosses the connector twice (the caller's first flight in, the
home service's first answer out), and a home node's connector shares its machine — often
its core — with the service it forwards to, so the connector's CPU on those crossings
adds straight onto the stream's open latency. With a trio task per stream, much of that
CPU was interpreter work on exactly that path: waking the task through trio's epoll
loop, bookkeeping, the relay nursery and its second task, a scheduler batch before the
answer could be spliced back. A thread parked in poll(2) on its own socket is woken by
the kernel directly and runs straight-line code. The dial runs on the thread too, so a
stream costs the trio thread two wake-ups (its first answer, its end) instead of about
eight. (What this bought, in latency and CPU: the README's "Performance" section.) The
GIL is free at the moments that matter (the trio thread is parked in epoll_wait, every
syscall here releases it). The payload still never enters Python: socket → pipe →
socket with `os.splice`, through pipes from the shared pool (`splice.take_pipe`), held
only while a direction has bytes in flight.

A thread per pooled connection costs a parked thread (a few pages of stack actually
touched) each; the ingress's pool bounds them (and the connector's `MAX_PENDING_DATA`,
`MAX_STREAM_THREADS`).

Ownership and stopping
----------------------
The job owns its sockets: only its thread closes them. Any other thread may call
`stop()` (end it, idle or not: connector shutdown) or `stop_if_idle()` (end it only if
no stream has started on it: its control connection died). Both just `shutdown(2)` the
sockets, under the job's lock and never after the thread closed them, which wakes the
thread's poll; the thread then ends and closes. `state` is one `State`, moved only by
`next_state` (the whole table is `TRANSITIONS`; anything else raises): NEW → DIALING
(its own dial) → IDLE (in the ingress's pool) → OPENING (first bytes read) → ACTIVE
(first answer passed back) → DONE, with STOPPING for a stop while its thread runs. The
connector counts idle and streaming connections from it (`waiting`, `streaming`). The
step to OPENING and `stop_if_idle` exclude each other (both under the job's lock), so a
stream that has begun is never cut off because its control connection went away.

The relay loop itself is `interest` (pure, tested byte by byte) driving poll(2), and on
each wake-up `splice.pump` — the same relay step as the ingress's trio relay: a
direction with bytes in its pipe waits for its destination to take them (backpressure
through TCP, as in `splice.py`), otherwise for its source; EOF is passed on as
`shutdown(SHUT_WR)` so the other direction keeps flowing; an error on either side
ends both (a reset means the conversation is over); no byte either way for
`idle_timeout` seconds ends it too.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from pact_ingress.net.backends import STREAM_OPTIONS
from pact_ingress.net.splice import Direction, Pipe, Wait, give_pipe, pump, take_pipe
from pact_ingress.proto import tls_alert

#: First read from the data connection: a ClientHello (≤ 16 KiB record) fits with room.
FIRST_READ = 64 * 1024
#: Chunks a direction moves back to back before polling again (a busy direction does not
#: need a poll(2) per chunk; the other direction still gets its turn within this many).
BURST = 16
_POLLIN = select.POLLIN
_POLLOUT = select.POLLOUT


class State(Enum):
    """Where a job is in its life. Only `next_state` moves it."""

    NEW = "new"  # made; its thread has not started (a TLS connection may be on its way)
    DIALING = "dialing"  # its thread makes the data connection itself (`Dial`)
    IDLE = "idle"  # in the ingress's pool, parked until a stream's first bytes
    OPENING = "opening"  # first bytes read: forward connecting, first answer not back
    ACTIVE = "active"  # the first answer went back to the ingress
    STOPPING = "stopping"  # stopped while its thread runs: the thread ends and closes
    DONE = "done"  # its sockets are closed


class Event(Enum):
    RUN_DIAL = "run_dial"  # the thread starts with a `Dial` to make
    RUN_IDLE = "run_idle"  # the thread starts with a connection, no stream yet
    RUN_STREAM = "run_stream"  # the thread starts with a connection and first bytes
    DIALLED = "dialled"  # DATA_OK came, nothing after it
    FIRST_BYTES = "first_bytes"  # the ingress sent a stream's first bytes
    NO_BYTES = "no_bytes"  # woken, but there was nothing to read after all
    ANSWERED = "answered"  # the first answer went back
    STOP = "stop"  # stop(), or stop_if_idle() on a job without a stream
    CLOSE = "close"  # its sockets are closed (by its thread, or by stop before it ran)


_RUNNING = (State.DIALING, State.IDLE, State.OPENING, State.ACTIVE)
#: Every legal move; anything else is a bug and raises IllegalTransition.
TRANSITIONS: dict[tuple[State, Event], State] = {
    (State.NEW, Event.RUN_DIAL): State.DIALING,
    (State.NEW, Event.RUN_IDLE): State.IDLE,
    (State.NEW, Event.RUN_STREAM): State.OPENING,
    (State.NEW, Event.CLOSE): State.DONE,  # stopped before its thread ran
    (State.DIALING, Event.DIALLED): State.IDLE,
    (State.DIALING, Event.FIRST_BYTES): State.OPENING,  # they came with DATA_OK
    (State.IDLE, Event.FIRST_BYTES): State.OPENING,
    (State.OPENING, Event.NO_BYTES): State.IDLE,
    (State.OPENING, Event.ANSWERED): State.ACTIVE,
    **{(state, Event.STOP): State.STOPPING for state in _RUNNING},
    **{(state, Event.CLOSE): State.DONE for state in (*_RUNNING, State.STOPPING)},
}


class IllegalTransition(RuntimeError):
    """A job was asked to move where its life does not go."""


def next_state(state: State, event: Event) -> State:
    """The state `event` moves a job in `state` to; IllegalTransition if it cannot."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(f"{event.name} in {state.name}") from None


class ForwardUnreachable(OSError):
    """`forward` refused, timed out or could not be resolved."""


@dataclass
class Hooks:
    """Calls from the job's thread. Each must be cheap and thread-safe: the connector
    passes them to trio (`run_sync_soon`) or to prometheus counters (locked)."""

    #: The stream's first answer went back to the ingress, or the stream ended without
    #: one. Called exactly once per stream, never for a connection that stayed idle.
    opened: Callable[[], None]
    #: Bytes moved: ("up" = ingress → forward | "down", count).
    moved: Callable[[str, int], None]
    #: `forward` could not be reached (the ingress got a TLS alert).
    forward_failed: Callable[[OSError], None]
    #: The job's own `Dial` got its answer (the connection is in the ingress's pool).
    dialled: Callable[[], None] = lambda: None


@dataclass(frozen=True)
class Dial:
    """How a job makes its data connection itself: after `delay`, TCP to host:port,
    `preamble` in one write, `expect` back within `timeout`; then `setup(sock)`.
    Bytes after `expect` are the first stream bytes."""

    host: str
    port: int
    preamble: bytes
    expect: bytes
    delay: float
    connect_timeout: float
    timeout: float
    setup: Callable[[socket.socket], None] = lambda sock: None


def interest(directions: tuple[Direction, ...]) -> dict[int, int]:
    """poll(2) events to wait for, per fd, for the directions still running: bytes in a
    direction's pipe wait for its destination to take them, otherwise for its source."""
    masks: dict[int, int] = {}
    for d in directions:
        if d.done:
            continue
        fd, event = (d.dst, _POLLOUT) if d.pending else (d.src, _POLLIN)
        masks[fd] = masks.get(fd, 0) | event
    return masks


class StreamJob:
    """One data connection's life after its handshake; `run()` on a thread of its own.

    `state` (a `State`) is written only under `_lock` and only through `next_state`;
    other threads may read it at any time (one attribute load).
    """

    def __init__(self, data: socket.socket | Dial | None, first: bytes,
                 forward: tuple[str, int], family: int | None, hooks: Hooks, *,
                 connect_timeout: float, idle_timeout: float) -> None:
        """`data`: the connection to the ingress (non-blocking; the job owns it now), or
        how to make it (`Dial`, on the job's thread), or None to be given later
        (`hand_over`, before `run`). `first`: stream bytes that came with the
        handshake's answer, if any. `forward`: host and port; `family`: AF_INET/AF_INET6
        if host is an IP literal (connected without a lookup), None for a name
        (resolved on the job's thread)."""
        self.state = State.NEW
        #: Why the job's own dial failed (outcome dial_refused / dial_failed).
        self.error: BaseException | None = None
        self._dial: Dial | None = None
        self._data: socket.socket | None = None
        self._first = b""
        self._forward = forward
        self._family = family
        self._fwd: socket.socket | None = None
        self._by_fd: dict[int, socket.socket] = {}
        self._hooks = hooks
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout
        self._lock = threading.Lock()
        self._active = False  # the relay moved a byte since the last poll
        self._answered = False  # this stream's `opened` hook was called
        self._movers = {"up": self._moved_up, "down": self._moved_down}
        if data is not None:
            self.hand_over(data, first)

    # --- any thread ----------------------------------------------------------------------

    @property
    def streaming(self) -> bool:
        """A stream has begun on it (its first bytes came), and it has not ended."""
        state = self.state
        return state in (State.OPENING, State.ACTIVE) or (state is State.NEW
                                                           and bool(self._first))

    @property
    def waiting(self) -> bool:
        """No stream on it yet: being made, or idle in the ingress's pool (a STOPPING
        job is one whose control connection died while it was idle: it is closing)."""
        return self.state is not State.DONE and not self.streaming

    def hand_over(self, data: socket.socket | Dial, first: bytes = b"") -> bool:
        """Give a NEW job its connection (or how to make it). False if the job was
        stopped meanwhile: then the caller still owns `data` and closes it."""
        with self._lock:
            if self.state is not State.NEW:
                return False
            if isinstance(data, Dial):
                self._dial = data
            else:
                self._data = data
                self._by_fd[data.fileno()] = data
            self._first = first
            return True

    def stop(self) -> None:
        """End the job soon, idle or not: its thread notices and closes (a job whose
        thread never started is closed here)."""
        with self._lock:
            self._stop_locked()

    def stop_if_idle(self) -> bool:
        """End the job if no stream has started on it; True if it was idle."""
        with self._lock:
            if self.state is State.DONE or self.streaming:
                return False
            self._stop_locked()  # and no stream can begin now (see _begin)
            return True

    def _to(self, event: Event) -> None:
        """Move on (the caller holds `_lock`)."""
        self.state = next_state(self.state, event)

    def _stop_locked(self) -> None:
        if self.state is State.NEW:  # its thread never ran: close here
            self._close_locked()
            return
        if self.state in (State.STOPPING, State.DONE):
            return
        self._to(Event.STOP)
        for sock in (self._data, self._fwd):
            if sock is not None:
                _shutdown(sock, socket.SHUT_RDWR)

    # --- the job's thread -----------------------------------------------------------------

    def run(self) -> str:
        """Serve the connection; the outcome: retired (EOF or stopped before a stream) |
        dial_refused (no TCP connection) | dial_failed (connected, no answer: `error`) |
        forward_unreachable | ok | reset | idle_timeout."""
        with self._lock:
            if self.state is State.DONE:
                return "retired"
            self._to(Event.RUN_DIAL if self._dial is not None else
                     Event.RUN_STREAM if self._first else Event.RUN_IDLE)
        try:
            if self._dial is not None:
                failed = self._make_data(self._dial)
                if failed:
                    return failed
            first = self._first or self._wait_first()
            if not first:
                return "retired"
            try:
                fwd, rest = self._connect(first)
            except OSError as exc:
                self._refuse(exc)
                return "forward_unreachable"
            if len(rest) < len(first):
                self._hooks.moved("up", len(first) - len(rest))
            return self._relay(fwd, rest)
        finally:
            with self._lock:
                self._close_locked()

    def _make_data(self, dial: Dial) -> str | None:
        """The data connection per `dial`; None when it is ready, else the outcome."""
        if dial.delay:
            time.sleep(dial.delay)
        try:
            sock = socket.create_connection((dial.host, dial.port), dial.connect_timeout)
        except OSError as exc:
            self.error = exc
            return "dial_refused"
        with self._lock:
            self._data = sock
            self._by_fd[sock.fileno()] = sock
            if self.state is State.STOPPING:
                return "retired"
        try:
            for option, value in STREAM_OPTIONS:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            sock.settimeout(dial.timeout)
            sock.sendall(dial.preamble)
            answer = b""
            while len(answer) < len(dial.expect):  # bounded: each read adds ≥ 1 byte
                chunk = sock.recv(FIRST_READ)
                if not chunk:
                    raise ConnectionError("closed before answering")
                answer += chunk
            if not answer.startswith(dial.expect):
                raise ConnectionError("unexpected answer")
            dial.setup(sock)
            sock.setblocking(False)
        except OSError as exc:
            self.error = exc
            return "retired" if self.state is State.STOPPING else "dial_failed"
        self._first = answer[len(dial.expect):]
        if self._first:
            if not self._begin():
                return "retired"
        else:
            with self._lock:
                if self.state is State.DIALING:  # else STOPPING: _wait_first sees it
                    self._to(Event.DIALLED)
        self._hooks.dialled()
        return None

    def _begin(self) -> bool:
        """A stream's first bytes are here: → OPENING, unless stopped (under the lock:
        see stop_if_idle)."""
        with self._lock:
            if self.state is State.STOPPING:
                return False
            self._to(Event.FIRST_BYTES)
            return True

    def _wait_first(self) -> bytes:
        """Park until the ingress sends a stream's first bytes (b"" at EOF or when
        stopped). No timeout, by design: a pooled connection idles until used; the
        ingress retires it (EOF), keepalive finds a dead path, `stop_if_idle` ends it."""
        assert self._data is not None
        poller = select.poll()
        poller.register(self._data, _POLLIN)
        while True:
            poller.poll()
            if not self._begin():
                return b""
            try:
                return os.read(self._data.fileno(), FIRST_READ)
            except BlockingIOError:  # woken without data after all
                with self._lock:
                    if self.state is State.OPENING:  # else STOPPING: the next turn ends
                        self._to(Event.NO_BYTES)
            except OSError:
                return b""

    def _connect(self, first: bytes) -> tuple[socket.socket, bytes]:
        """Connect `forward` and write `first`; returns what did not fit yet."""
        assert self._data is not None
        host, port = self._forward
        if self._family is None:  # a name: resolve and connect, blocking (own thread)
            try:
                fwd = socket.create_connection((host, port), timeout=self._connect_timeout)
            except OSError as exc:
                raise ForwardUnreachable(exc.errno, str(exc)) from exc
            fwd.setblocking(False)
        else:
            fwd = socket.socket(self._family, socket.SOCK_STREAM | socket.SOCK_NONBLOCK
                                | socket.SOCK_CLOEXEC)
        with self._lock:
            self._fwd = fwd
            self._by_fd[fwd.fileno()] = fwd
            if self.state is State.STOPPING:
                raise ForwardUnreachable(errno.ECANCELED, "stopped")
        for option, value in STREAM_OPTIONS:
            fwd.setsockopt(socket.IPPROTO_TCP, option, value)
        if self._family is not None:
            err = fwd.connect_ex((host, port))
            if err not in (0, errno.EINPROGRESS):
                raise ForwardUnreachable(err, os.strerror(err))
        try:
            sent = os.write(fwd.fileno(), first)  # a local forward is connected already
        except BlockingIOError:  # still connecting
            self._wait_connected(fwd)
            sent = 0
        except OSError as exc:  # e.g. refused, seen at the first write
            raise ForwardUnreachable(exc.errno, os.strerror(exc.errno or 0)) from exc
        return fwd, first[sent:]

    def _wait_connected(self, fwd: socket.socket) -> None:
        poller = select.poll()
        poller.register(fwd, _POLLOUT)
        if not poller.poll(self._connect_timeout * 1000):
            raise ForwardUnreachable(errno.ETIMEDOUT, "connect to forward timed out")
        err = fwd.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise ForwardUnreachable(err, os.strerror(err))

    def _refuse(self, exc: OSError) -> None:
        """Answer the ingress (a TLS client) as a dead backend would: an alert, then
        close."""
        assert self._data is not None
        try:
            os.write(self._data.fileno(), tls_alert.alert_record(tls_alert.INTERNAL_ERROR))
        except OSError:
            pass
        if self.state is not State.STOPPING:  # stopped mid-connect: the connector is
            self._hooks.forward_failed(exc)  # going, not forward
        self._answer()

    def _relay(self, fwd: socket.socket, rest: bytes) -> str:
        assert self._data is not None
        up = Direction("up", self._data.fileno(), fwd.fileno())
        down = Direction("down", fwd.fileno(), self._data.fileno())
        # a direction holds a pipe only while it moves bytes, as in the trio relay
        pipes: dict[str, Pipe | None] = {"up": None, "down": None}
        try:
            if rest:  # forward is connected now; the rest of the first bytes (≤
                # FIRST_READ) goes straight to it: a pipe from the pool may be smaller
                try:
                    fwd.settimeout(self._connect_timeout)
                    fwd.sendall(rest)
                    fwd.setblocking(False)
                except OSError:  # forward went away, or stop() shut it down
                    return "reset"
                self._movers["up"](len(rest))
            return self._loop((up, down), pipes)
        finally:
            for d in (up, down):
                pipe = pipes[d.name]
                if pipe is not None:
                    give_pipe(pipe, drained=d.pending == 0)
            self._answer()  # ended before any answer: the stream is over all the same

    def _loop(self, directions: tuple[Direction, Direction],
              pipes: dict[str, Pipe | None]) -> str:
        poller = select.poll()
        registered: dict[int, int] = {}
        deadline = time.monotonic() + self._idle_timeout
        while not all(d.done for d in directions):
            wanted = interest(directions)
            for fd in registered.keys() - wanted.keys():
                poller.unregister(fd)
            for fd, mask in wanted.items():
                if registered.get(fd) != mask:
                    poller.register(fd, mask)  # also modifies an existing registration
            registered = wanted
            left = deadline - time.monotonic()
            if left <= 0:
                return "idle_timeout"
            ready = poller.poll(left * 1000)
            if not ready:
                continue  # the deadline is checked above
            woken = {fd for fd, _ in ready}
            self._active = False
            try:
                for d in directions:
                    if d.done or (d.src not in woken and d.dst not in woken):
                        continue
                    pipe = pipes[d.name] or take_pipe()
                    pipes[d.name] = pipe
                    wait = pump(d, pipe, self._movers[d.name], BURST)
                    if wait is Wait.READ:  # drained: an idle direction holds no pipe
                        give_pipe(pipe, drained=True)
                        pipes[d.name] = None
                    elif wait is Wait.EOF:
                        # pass the EOF on; the other direction keeps going
                        _shutdown(self._by_fd[d.dst], socket.SHUT_WR)
            except OSError:  # a side failed: the relay is over
                return "reset"
            if self._active:
                deadline = time.monotonic() + self._idle_timeout
        return "ok"

    def _moved_up(self, n: int) -> None:
        self._active = True
        self._hooks.moved("up", n)

    def _moved_down(self, n: int) -> None:
        self._active = True
        self._hooks.moved("down", n)
        if not self._answered:
            self._answer()

    def _answer(self) -> None:
        """The stream's first answer went back (or it ended without one): OPENING →
        ACTIVE, and the `opened` hook, once per stream."""
        if self._answered:
            return
        self._answered = True
        with self._lock:
            if self.state is State.OPENING:  # else STOPPING: it stays that way
                self._to(Event.ANSWERED)
        self._hooks.opened()

    def _close_locked(self) -> None:
        self._to(Event.CLOSE)
        for sock in (self._fwd, self._data):
            if sock is not None:
                sock.close()


def _shutdown(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass  # not connected (any more): nothing to wake or pass on
