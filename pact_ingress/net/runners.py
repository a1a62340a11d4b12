"""Handler tasks kept for the next connection instead of one new task per connection.

Theory of operation
-------------------
The passthrough engine hands the router every connection it does not serve itself
(most of them terminate connections) and each runs in a handler task. A trio task costs
more to start and to end than the few steps most of these connections take in it: a
task object, a coroutine, its context and its place in the nursery made, and unmade
when it returns (measured: about a fifth of the interpreter work of a connection's
whole start and end outside TLS). So a task that has served its connection does not
end: it parks, and the next connection is handed to it by rescheduling it with the
handler to run (`trio.lowlevel.reschedule`), which costs what waking any waiting task
costs. When no task is parked, a new one is started in the nursery and joins the others
once its first connection ends.

Bounds: at most `MAX_IDLE` tasks stay parked (a burst's extra tasks end as they finish),
so the idle set follows the recent peak of concurrent connections, capped.

Lifetime: the tasks live in the router's handler nursery, so cancelling it (the drain
deadline, shutdown) cancels parked tasks as well as working ones; a parked task leaves
the idle set when cancelled. `close` (accepting has stopped) wakes every parked task to
end and makes the rest end after their connection, so the nursery finishes as soon as
the last connection does.

A handler must leave nothing behind in the task that the next connection could see:
the router's handlers catch their own errors (an exception that escapes ends the task
and reaches the nursery, as it would have before) and keep no context variables.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import outcome
import trio

#: Parked tasks kept at most.
MAX_IDLE = 256

_Job = tuple[Callable[..., Awaitable[None]], tuple[Any, ...]]


class Runners:
    def __init__(self, nursery: trio.Nursery | None) -> None:
        self._nursery = nursery
        self._idle: list[trio.lowlevel.Task] = []
        self._open = nursery is not None

    @property
    def idle(self) -> int:
        """Tasks parked now."""
        return len(self._idle)

    def start(self, handler: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run `handler(*args)` in a parked task, or in a new one when none is parked."""
        idle = self._idle
        if idle:
            trio.lowlevel.reschedule(idle.pop(), outcome.Value((handler, args)))
            return
        assert self._nursery is not None, "not serving"
        self._nursery.start_soon(self._run, handler, args)

    def close(self) -> None:
        """No more parking: parked tasks end now, working ones after their handler."""
        self._open = False
        parked = list(self._idle)
        self._idle.clear()
        for task in parked:
            trio.lowlevel.reschedule(task, outcome.Value(None))

    async def _run(self, handler: Callable[..., Awaitable[None]],
                   args: tuple[Any, ...]) -> None:
        idle = self._idle
        task = trio.lowlevel.current_task()

        def abort(_: Any) -> trio.lowlevel.Abort:
            idle.remove(task)  # cancelled while parked: it is in the set (and only then)
            return trio.lowlevel.Abort.SUCCEEDED

        job: _Job | None = None
        while True:
            await handler(*args)
            # a parked task holds nothing of the connection it served (after a burst,
            # MAX_IDLE of them would keep sockets, hellos and old routes alive)
            args = ()
            job = None
            if not self._open or len(idle) >= MAX_IDLE:
                return
            idle.append(task)
            job = await trio.lowlevel.wait_task_rescheduled(abort)
            if job is None:
                return
            handler, args = job
