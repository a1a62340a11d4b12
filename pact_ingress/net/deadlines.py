"""Deadlines on waits, kept by one sweeping task instead of a cancel scope per wait.

Theory of operation
-------------------
A keep-alive request through the terminate engine waits twice (for the client's next
request, for the node's answer), and each wait has a deadline. A trio cancel scope per
wait is one of the dearest things a request does, although a deadline almost never
fires. Instead, a wait *arms* its deadline in a table (a dict insert) and disarms it
when it returns (a dict delete). One system task per trio run sleeps until the earliest
armed deadline (woken early only when a wait arms an earlier one), fires what is due and
sleeps again, sweeping at most every `SWEEP_SECONDS`: a deadline may fire that much
late, which is nothing next to the seconds-long limits it enforces. Under a steady load
the earliest deadline keeps moving out, so the table is swept about once per timeout,
not once per wait.

Firing means, for an armed:

* socket wait (`wait_readable` / `wait_writable`): `trio.lowlevel.notify_closing` on the
  socket, which wakes its waiters with `ClosedResourceError`; the waiter sees its arm
  fired and raises `trio.TooSlowError` instead. The socket itself stays usable (the next
  wait registers it again), so a late 408 can still be written on it.
* cancel scope: `cancel()` on it (the HTTP/1.1 connection's idle scope, which a drain
  also cancels).
* wait on a `readiness.Watch` (the terminate engine's sockets): the task parked on it
  is woken with `trio.TooSlowError`; nothing else is disturbed.

`notify_closing` wakes every task waiting on that socket, not only the one whose
deadline passed: on the engine's sockets a passed deadline ends the connection (client
gone, node timed out), so the others would learn of it next anyway. A deadline already
due when the wait begins takes the plain path (a cancel scope that fires at once).

With nothing armed the sweeper sleeps until something is, so an idle process does not
wake for it.
"""

from __future__ import annotations

import math
import socket
from collections.abc import Callable
from typing import Any

import trio

from pact_ingress.logs import log

#: How often due deadlines are fired: the most a deadline fires late.
SWEEP_SECONDS = 0.05

_wait_readable = trio.lowlevel.wait_readable
_wait_writable = trio.lowlevel.wait_writable


class _Arm:
    __slots__ = ("deadline", "sock", "scope", "watch", "side", "fired")

    def __init__(self, deadline: float, sock: socket.socket | None,
                 scope: trio.CancelScope | None, watch: Any = None, side: int = 0) -> None:
        self.deadline = deadline
        self.sock = sock
        self.scope = scope
        self.watch = watch  # a `readiness.Watch`: firing wakes its waiter on `side`
        self.side = side
        self.fired = False


class Sweeper:
    """The table of armed deadlines of one trio run and the task that fires them."""

    def __init__(self) -> None:
        self._armed: dict[_Arm, None] = {}
        self._next = math.inf  # when the sweeper wakes next (inf: parked)
        self._made = math.inf  # the earliest deadline armed since the sweep began
        self._wake = trio.Event()
        self.now = clock()
        trio.lowlevel.spawn_system_task(self._run, name="pact_ingress.deadlines")

    def arm(self, deadline: float, *, sock: socket.socket | None = None,
            scope: trio.CancelScope | None = None, watch: Any = None,
            side: int = 0) -> _Arm:
        arm = _Arm(deadline, sock, scope, watch, side)
        self._armed[arm] = None
        if deadline < self._made:
            self._made = deadline
        if deadline < self._next:  # due before the sweeper would look: wake it
            self._next = -math.inf
            self._wake.set()
        return arm

    def disarm(self, arm: _Arm) -> None:
        self._armed.pop(arm, None)

    def sweep(self, now: float) -> float:
        """Fire every armed deadline that is due; the earliest one left (inf: none)."""
        due = []
        earliest = self._made = math.inf
        for arm in self._armed:
            if arm.deadline <= now:
                due.append(arm)
            elif arm.deadline < earliest:
                earliest = arm.deadline
        for arm in due:
            del self._armed[arm]
            arm.fired = True
            try:
                if arm.sock is not None:
                    trio.lowlevel.notify_closing(arm.sock)
                if arm.scope is not None:
                    arm.scope.cancel()
                if arm.watch is not None:
                    arm.watch.fire(arm.side)
            except Exception as exc:  # noqa: BLE001 - a closed socket: nobody waits on it
                log.debug("deadline_fire_failed", error=repr(exc))
        # (what fired may have armed a deadline again: `arm` cannot wake a sweep that
        # is running, so it counts here)
        return min(earliest, self._made)

    async def _run(self) -> None:
        while True:
            now = trio.current_time()
            # sleep until the earliest deadline, but sweep at most every SWEEP_SECONDS:
            # a deadline fires at most that late, and a busy table costs one pass per
            # earliest deadline, not one per wait
            self._next = max(self.sweep(now), now + SWEEP_SECONDS)
            self._wake = trio.Event()
            with trio.move_on_at(self._next):
                await self._wake.wait()


def clock() -> Callable[[], float]:
    """This run's `trio.current_time`, as its clock's own method: the same time for one
    call instead of four (taken once per connection or pool, inside the run)."""
    return trio.lowlevel.current_clock().current_time


_SWEEPER: trio.lowlevel.RunVar[Sweeper] = trio.lowlevel.RunVar("pact_ingress_sweeper")


def sweeper() -> Sweeper:
    """This trio run's sweeper (started on first use)."""
    try:
        return _SWEEPER.get()
    except LookupError:
        s = Sweeper()
        _SWEEPER.set(s)
        return s


async def _wait(wait: object, sock: socket.socket, deadline: float) -> None:
    s = sweeper()
    arm = s.arm(deadline, sock=sock)
    try:
        await wait(sock)  # type: ignore[operator]
    except trio.ClosedResourceError:
        if arm.fired:
            raise trio.TooSlowError() from None
        raise
    finally:
        s.disarm(arm)
    # returned normally: the socket became ready, even if the sweep fired just then


async def wait_readable(sock: socket.socket, deadline: float = math.inf,
                        s: Sweeper | None = None) -> None:
    """Until `sock` is readable; `trio.TooSlowError` once `deadline` passed. `s`: this
    run's sweeper, when the caller keeps it at hand."""
    if deadline == math.inf:
        await _wait_readable(sock)
        return
    if s is None:
        s = sweeper()
    if deadline <= s.now():
        with trio.move_on_at(deadline):  # already due: a checkpoint, then the news
            await _wait_readable(sock)
            return
        raise trio.TooSlowError()
    else:  # `_wait` inline: every request waits here for the node's answer
        arm = s.arm(deadline, sock=sock)
        try:
            await _wait_readable(sock)
        except trio.ClosedResourceError:
            if arm.fired:
                raise trio.TooSlowError() from None
            raise
        finally:
            s.disarm(arm)


async def wait_writable(sock: socket.socket, deadline: float = math.inf) -> None:
    """Until `sock` is writable; `trio.TooSlowError` once `deadline` passed."""
    if deadline == math.inf:
        await _wait_writable(sock)
    elif deadline <= trio.current_time():
        with trio.move_on_at(deadline):
            await _wait_writable(sock)
            return
        raise trio.TooSlowError()
    else:
        await _wait(_wait_writable, sock, deadline)
