"""Stop signals (SIGTERM, SIGINT) outside the event loop's own handling.

While a process serves, trio receives the stop signals through a receiver that, when
it closes, puts back the disposition it found. From then until the process is gone
(trio's teardown, the last log flush, the interpreter's exit) that disposition rules:
with the default one, the second SIGTERM of an impatient operator, or a supervisor's
and a script's at once, turns a process that drained and was exiting 0 into one
killed by the signal. `guard()`, called before trio runs, makes that disposition ours:
until a drain began it does what the default would (the process dies of the signal,
as it always did before serving); once one began (`draining()`), it ignores the
signal, since the exit it asks for is already under way; and once the event loop
is done, `exiting()` ignores them for good.

`serve` asks for more (`guard(note_early=True)`): a stop signal that comes while it is
still starting — before trio runs, or before its receiver is open — is noted
(`take_early`) instead of killing the process, and the receiver it opens first thing
picks the noted one up and stops the start-up cleanly: an operator, a supervisor or a
script that stops a service which is not ready yet gets exit 0 and a line that says
so, not a death by the signal. Noting is safe there because nothing `serve` does before
its receiver is open can wait for long (the files it reads are opened without
blocking: `files.read_small`; the network waits come after). The command line asks for
it before it imports what `serve` runs on (most of a second of module loading), and
`hold_hup` notes a SIGHUP from then on too (its default action would end the process),
for `take_hup` once serving: the config written before it may be newer.

`run` is `trio.run` that calls `exiting()` as soon as the main task is done, before
trio's teardown: that teardown closes the socket the signal handlers wake the loop
through before it unhooks it, and a handled signal landing in between is written to a
closed descriptor (a traceback on stderr). An ignored one never reaches a handler.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_draining = False
#: The stop signals noted while starting (None: not noting, see `guard`).
_early: list[int] | None = None
#: A SIGHUP came while starting (see `hold_hup`).
_hup = False


def _handler(signum: int, frame: Any) -> None:
    if _draining:
        return
    if _early is not None:
        _early.append(signum)
        return
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def guard(*, note_early: bool = False) -> None:
    """Install the disposition above for the stop signals (main thread, before trio);
    `note_early`: note them until `take_early` instead of dying of them."""
    global _early
    # asked again (the command line asked first): what was noted stays noted
    _early = (_early if _early is not None else []) if note_early else None
    for signum in _SIGNALS:
        signal.signal(signum, _handler)


def take_early() -> list[int]:
    """The stop signals noted so far; noting ends here (call it with the process's own
    receiver for them open: from then on that receiver gets them)."""
    global _early
    taken, _early = _early or [], None
    return taken


def hold_hup() -> None:
    """Note a SIGHUP instead of dying of it, until `serve`'s receiver takes over."""
    signal.signal(signal.SIGHUP, note_hup)


def note_hup(signum: int = signal.SIGHUP, frame: Any = None) -> None:
    """A SIGHUP came before READY: the reload follows READY (`take_hup`)."""
    global _hup
    _hup = True


def take_hup() -> bool:
    """Whether a SIGHUP was noted since the last call."""
    global _hup
    taken, _hup = _hup, False
    return taken


def draining() -> None:
    """A drain began: stop signals from now on change nothing."""
    global _draining
    _draining = True


def exiting() -> None:
    """The event loop is done: ignore stop signals, and SIGHUP (nothing is left to
    reload), for the rest of the exit. (The interpreter puts the default action back
    for every Python-level handler as it finalizes, but leaves an ignored signal
    ignored.)"""
    for signum in (*_SIGNALS, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def run(main: Callable[[], Awaitable[T]]) -> T:
    """`trio.run(main)`, with the stop signals and SIGHUP ignored from the moment `main`
    returns or raises (see the module doc)."""
    import trio  # here: importing this module must cost nothing (see the module doc)

    async def body() -> T:
        try:
            return await main()
        finally:
            exiting()

    return trio.run(body)
