"""Socket readiness for the terminate engine: one epoll set per trio run, each socket in it
once for its life.

Theory of operation
-------------------
`trio.lowlevel.wait_readable` arms the socket in trio's epoll set for one event
(`EPOLLONESHOT`): an `epoll_ctl` syscall and a little bookkeeping on every wait. A
keep-alive request through the terminate engine waits twice (the client's next request,
the node's answer), so that is paid twice per request, per connection.

Here one system task per trio run (`Hub`) owns its own epoll set. A socket joins it once,
edge-triggered (`EPOLLIN | EPOLLRDHUP | EPOLLET`; `EPOLLOUT` added the first time a write
would block, and kept), the first time its owner has to wait. A wait then only parks the
task on the socket's `Watch` (`wait_task_rescheduled`). The hub waits for its epoll fd
in trio (one `epoll_ctl` per wake, whatever number of sockets became ready), takes every
ready event and wakes the tasks parked on those sockets.

That pays only when a wake-up carries several sockets' events (the hub's own wait costs
what one of trio's does, plus a task switch and an `epoll_wait`), so a socket joins only
while the process is crowded (`HUB_MIN_CONNECTIONS`) and leaves again when it is nearly
idle; outside the hub its owner waits through trio (`net/deadlines.py`).

Edge-triggered means an event arrives when something *new* happens on the socket, so
the rule is the one every caller here already keeps: try the syscall first and wait only
when it would block. An event that arrives while nobody waits is remembered on the Watch
(`readable`), and a caller that waits *without* having tried the syscall (it knows the peer
cannot have answered yet) returns at once when it is set: it then tries the syscall. A
wait after the syscall said "would block" clears it: whatever set it was read since.
Wake-ups can be spurious (an event for bytes already read): callers retry the syscall.
Once the peer's FIN (or an error) was seen, every read wait returns at once: a recv
that takes the last bytes leaves the end unread, unannounced (until a recv still says it
would block: that end was an old file's, reported under a reused number). A recv that
filled its whole buffer may have left bytes behind, which no new event announces: the
caller then sets `readable` itself, so a wait that does not look first returns at once.

* The keep-alive lane (`net/h1_lane.py`): a Watch whose `lane` is set belongs to one
  of its connections; the hub calls `lane(mask)` with its events instead of
  waking a task (the lane keeps its deadlines itself). The lane clears `lane` (and
  marks the Watch readable) before it gives the socket to a task. An HTTP/2
  connection's reader sets `lane` the same way while it is parked and the hub reads for
  it (`H2Connection._read_inline`); its call wakes a waiting writer itself. A Watch
  with `lane` set never leaves the hub.
* Deadlines: armed with the sweeper (`net/deadlines.py`) against the Watch; firing wakes
  the parked task with `trio.TooSlowError`. The socket stays usable.
* Cancellation: the abort callback takes the task off the Watch.
* Close: an owner that closes a socket another task may be waiting on calls
  `Watch.close` first (waiters get `trio.ClosedResourceError`, like
  `trio.lowlevel.notify_closing`). Closing the fd removes it from the epoll set (the
  kernel does that when the last reference goes), so an owner whose tasks have all
  ended just closes it.
* Fd reuse: a Watch belongs to its owner (one `MemoryTLS`), not to the fd number. A new
  socket that gets a closed one's number gets a new Watch, which replaces the old one
  in the hub's table and joins the epoll set as a new file. Should an old file still be
  open elsewhere (a descriptor handed to another process after it joined), its events
  may still come in under the same number: spurious wake-ups, which callers tolerate.
"""

from __future__ import annotations

import math
import os
import select
import socket
from collections.abc import Callable
from typing import Any

import outcome
import trio
from trio.lowlevel import Abort, current_task, reschedule, wait_task_rescheduled

from pact_ingress.logs import log
from pact_ingress.net import deadlines

_EPOLLIN, _EPOLLOUT = select.EPOLLIN, select.EPOLLOUT
_EPOLLRDHUP, _EPOLLET = select.EPOLLRDHUP, select.EPOLLET
_HUP_ERR = select.EPOLLHUP | select.EPOLLERR
#: An event with any of these wakes the reader / the writer.
_WAKES_READER = _EPOLLIN | _EPOLLRDHUP | _HUP_ERR
_WAKES_WRITER = _EPOLLOUT | _HUP_ERR
#: The peer's FIN (or a failure) may come with the last bytes: a recv that takes those
#: leaves the end unread, and no later event would say so.
_ENDS = _EPOLLRDHUP | _HUP_ERR
_READING = _EPOLLIN | _EPOLLRDHUP | _EPOLLET
#: (for a `Watch.lane` call that stands in for waiting tasks: `H2Connection._inline`)
WAKES_READER, WAKES_WRITER, ENDS = _WAKES_READER, _WAKES_WRITER, _ENDS
_BOTH = _READING | _EPOLLOUT
#: Events taken per `epoll_wait`; more are taken at once in another call.
MAX_EVENTS = 256
#: Looks at the epoll set per wake-up of the hub, while each finds something.
MAX_ROUNDS = 4

READ = 0
WRITE = 1

#: Sockets join the hub only while at least this many terminate connections are open in
#: the process (`open_connections`, kept by `net/terminate.py`). The hub pays when one
#: of its wake-ups carries several sockets' events: its own wait on its epoll fd costs
#: what one of trio's waits does, plus a task switch and an `epoll_wait`. A lone busy
#: connection, whose every wake-up carries one event, waits through trio instead. A
#: socket decides at each wait: it joins when the process is crowded, and leaves (one
#: `epoll_ctl`) when fewer than half that many connections are open and nobody waits on
#: it (a pooled node connection outlives the crowd that made it join).
#: `PACT_INGRESS_HUB_MIN_CONNECTIONS` overrides it (0: every socket joins; tests).
HUB_MIN_CONNECTIONS = int(os.environ.get("PACT_INGRESS_HUB_MIN_CONNECTIONS", "4"))
#: Terminate connections open in this process now.
open_connections = 0


def crowded() -> bool:
    """Enough connections are open for the hub to pay."""
    return open_connections >= HUB_MIN_CONNECTIONS


def sparse() -> bool:
    """So few connections are open that a socket in the hub should leave it."""
    return open_connections < HUB_MIN_CONNECTIONS // 2


class Watch:
    """One socket in the hub: the task waiting to read, the one waiting to write, and
    the events that arrived while nobody waited."""

    __slots__ = ("closed", "ended", "failed", "fd", "hub", "lane", "on_fail", "on_fin",
                 "out", "readable", "reader", "writer")

    def __init__(self, hub: Hub, fd: int) -> None:
        self.hub = hub
        self.fd = fd
        self.reader: trio.lowlevel.Task | None = None
        self.writer: trio.lowlevel.Task | None = None
        self.readable = False  # an event came that no reader took yet
        self.ended = False  # the peer closed or the socket failed: reads never block again
        #: EPOLLERR or EPOLLHUP came (a reset or an error; or both directions ended,
        #: which a socket whose owner has not shut its side down sees only so)
        self.failed = False
        #: called (once, then cleared) when such an event comes while no `lane` takes
        #: the socket's events: the trio engine's exchange, while the node is asked,
        #: ends its connection when the client resets it (`Terminator._upstream`)
        self.on_fail: Any = None
        #: the same for the peer's FIN alone (EPOLLRDHUP): that exchange sends what its
        #: TLS engine held for the client, which a client that closed for good answers
        #: with a reset (`MemoryTLS.send_held_nowait`)
        self.on_fin: Any = None
        self.out = False  # EPOLLOUT is in the set for this socket
        self.closed = False
        #: a connection the keep-alive lane drives (`net/h1_lane.py`): its events go to
        #: this call (`lane(mask)`) instead of waking a task
        self.lane: Any = None

    # (methods, not closures made per socket: most sockets the lane drives never wait)
    def _abort_read(self, _: object) -> Abort:
        self.reader = None
        return Abort.SUCCEEDED

    def _abort_write(self, _: object) -> Abort:
        self.writer = None
        return Abort.SUCCEEDED

    async def wait_readable(self, deadline: float = math.inf, tried: bool = True) -> None:
        """Until the socket may be readable. `tried`: the caller's recv just said it
        would block (else it did not try, and an event already seen ends the wait at
        once). `trio.TooSlowError` once `deadline` passed."""
        if self.ended:
            if not tried:
                return
            # the recv said "would block": the end seen was not this socket's (an old
            # file still open elsewhere, reported under the same number)
            self.ended = False
        if tried:
            self.readable = False
        elif self.readable:
            self.readable = False
            return
        if self.reader is not None:
            raise trio.BusyResourceError("another task is already reading this socket")
        if self.closed:
            raise trio.ClosedResourceError()
        self.reader = current_task()
        if deadline == math.inf:
            await wait_task_rescheduled(self._abort_read)
            return
        await self._park_by(deadline, READ, self._abort_read)

    async def wait_writable(self, deadline: float = math.inf) -> None:
        """Until the socket may be writable (the caller's send just said it would
        block); `trio.TooSlowError` once `deadline` passed."""
        if self.writer is not None:
            raise trio.BusyResourceError("another task is already writing this socket")
        if self.closed:
            raise trio.ClosedResourceError()
        if not self.out:
            # reads only until now: writes wait from here on too. The event this
            # produces at once if there is room is a spurious wake-up at worst.
            self.hub.ep.modify(self.fd, _BOTH)
            self.out = True
        self.writer = current_task()
        if deadline == math.inf:
            await wait_task_rescheduled(self._abort_write)
            return
        await self._park_by(deadline, WRITE, self._abort_write)

    async def _park_by(self, deadline: float, side: int, abort: object) -> None:
        sweeper = self.hub.sweeper
        if deadline <= sweeper.now():  # already due: a checkpoint, then the news
            if side == READ:
                self.reader = None
            else:
                self.writer = None
            await trio.lowlevel.checkpoint()
            raise trio.TooSlowError()
        arm = sweeper.arm(deadline, watch=self, side=side)
        try:
            await wait_task_rescheduled(abort)  # type: ignore[arg-type]
        finally:
            sweeper.disarm(arm)

    def fire(self, side: int) -> None:
        """A deadline passed: the task waiting on `side`, if any, gets `TooSlowError`."""
        if side == READ:
            task, self.reader = self.reader, None
        else:
            task, self.writer = self.writer, None
        if task is not None:
            reschedule(task, outcome.Error(trio.TooSlowError()))

    def leave(self) -> bool:
        """Out of the hub (its owner waits through trio from now on), if no task waits
        on it; False (still in) otherwise."""
        if (self.reader is not None or self.writer is not None or self.lane is not None
                or self.on_fail is not None or self.on_fin is not None):
            return False
        self.closed = True
        hub = self.hub
        if hub.watches.get(self.fd) is self:
            del hub.watches[self.fd]
        try:
            hub.ep.unregister(self.fd)
        except OSError:  # not in the set (closed and reused, or never there)
            pass
        return True

    def close(self) -> None:
        """The owner is closing the socket: waiters get `trio.ClosedResourceError`, and
        any later wait too. Call before closing the fd."""
        if self.closed:
            return
        self.closed = True
        self.on_fail = self.on_fin = None
        hub = self.hub
        if hub.watches.get(self.fd) is self:
            del hub.watches[self.fd]
        for task in (self.reader, self.writer):
            if task is not None:
                reschedule(task, outcome.Error(trio.ClosedResourceError()))
        self.reader = self.writer = None


class Hub:
    """The epoll set of one trio run and the system task that wakes its waiters."""

    def __init__(self) -> None:
        self.ep = select.epoll()
        self.watches: dict[int, Watch] = {}
        #: called once each, then forgotten, when the events in hand were all served:
        #: what several callbacks of one wake-up queued goes out in one write (the
        #: multiplexed node sessions, `net/h2_node.py`); only while `serving` (a caller
        #: outside the hub's callbacks acts at once instead: no wake-up may follow)
        self.after: list[Callable[[], None]] = []
        self.serving = False
        self.sweeper = deadlines.sweeper()
        trio.lowlevel.spawn_system_task(self._run, name="pact_ingress.readiness")

    def watch(self, sock: socket.socket) -> Watch:
        """A new Watch for `sock`, in the epoll set from now on (for reading)."""
        fd = sock.fileno()
        old = self.watches.get(fd)
        if old is not None:
            old.close()  # its socket was closed (the number is free again): it is stale
        watch = Watch(self, fd)
        try:
            self.ep.register(fd, _READING)
        except FileExistsError:  # this very file joined before (under another Watch)
            self.ep.modify(fd, _READING)
        self.watches[fd] = watch
        return watch

    async def _run(self) -> None:
        ep = self.ep
        poll = ep.poll
        watches = self.watches
        try:
            while True:
                await trio.lowlevel.wait_readable(ep)
                rounds = 0
                while True:
                    events = poll(0, MAX_EVENTS)
                    if not events:
                        break
                    self.serving = True
                    for fd, mask in events:
                        watch = watches.get(fd)
                        if watch is None:
                            continue
                        lane = watch.lane
                        if lane is not None:
                            try:
                                lane(mask)  # (it catches its own failures)
                            except Exception as exc:  # noqa: BLE001 - never the hub's end
                                log.error("lane_event_failed", error=repr(exc))
                            continue
                        if mask & _WAKES_READER:
                            if mask & _ENDS:
                                watch.ended = True
                                if mask & _HUP_ERR:
                                    watch.failed = True
                                    hook = watch.on_fail
                                    if hook is not None:
                                        watch.on_fail = None
                                        hook()
                                elif watch.on_fin is not None:
                                    hook, watch.on_fin = watch.on_fin, None
                                    hook()
                            task = watch.reader
                            if task is None:
                                watch.readable = True
                            else:
                                watch.reader = None
                                reschedule(task)
                        if mask & _WAKES_WRITER:
                            task = watch.writer
                            if task is not None:
                                watch.writer = None
                                reschedule(task)
                    after = self.after
                    while after:
                        hook = after.pop()
                        try:
                            hook()  # (it catches its own failures)
                        except Exception as exc:  # noqa: BLE001 - never the hub's end
                            log.error("lane_event_failed", error=repr(exc))
                    self.serving = False
                    # what arrived while these were served is taken now, a few times
                    # over: a look costs one epoll_wait, a trip back through trio's
                    # loop to learn of the same events three syscalls and a task switch
                    # (bounded, so the tasks the trio engine runs get their turn)
                    rounds += 1
                    if rounds >= MAX_ROUNDS:
                        break
        finally:
            ep.close()


_HUB: trio.lowlevel.RunVar[Hub] = trio.lowlevel.RunVar("pact_ingress_readiness")


def hub() -> Hub:
    """This trio run's hub (started on first use)."""
    try:
        return _HUB.get()
    except LookupError:
        h = Hub()
        _HUB.set(h)
        return h
