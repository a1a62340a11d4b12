"""One passthrough connection as a sans-I/O state machine.

Theory of operation
-------------------
The edge engine (`net/edge.py`) serves passthrough connections without a task each: one
epoll set, edge-triggered, every fd registered once and never modified. So readiness
arrives as *edges* — "the client's socket became readable", "the backend's became
writable" — and an edge that is not acted on is lost. This module decides, for one
connection, which I/O step each edge calls for and what follows from its result; the
engine does the syscalls and feeds the results back. No sockets, no clock: `now` is a
parameter, so every transition and every timer is tested without I/O.

States, each moved only as `_NEXT` allows (anything else raises; the moves every connection
makes check the table inline rather than through a call to `_go`):

    HELLO ──routed──> CONNECTING ──head sent──> SPLICING ──both EOF──> CLOSED
      │                   │                         │
      └── closed (refused, handed off, timeout, reset, failure) ───────> CLOSED

* HELLO: reading the ClientHello. An edge on the client → READ_HELLO.
* CONNECTING: the backend connect is under way and the head (an optional PROXY v2 header,
  then the ClientHello) is not all taken. An edge on the backend → SEND_HEAD (a write
  both probes the connect and moves the head). Edges meanwhile are remembered: on
  SPLICING the directions whose source showed data are pumped at once.
* SPLICING: two directions, up (client → backend) and down. Each waits for READ (its
  source) or WRITE (its destination: bytes sit in its pipe) or is DONE (EOF passed on
  as a half-close). An edge pumps the directions that wait for it. Both DONE → CLOSED,
  outcome "ok".

A backend that cannot be reached (every address refused, or no connect within the
connect timeout) ends the connection as "backend_down", answered with alert
internal_error (`alert_for`); one that stops taking the head, or fails after taking
some, as "backend_reset", answered with a close.

One timer per connection, `deadline`, set by the state: `clienthello_timeout` in HELLO,
the connect timeout until the backend takes its first byte then the head timeout, and
in SPLICING the idle timeout, pushed forward by every moved byte. The engine sweeps its
connections once in a while and calls `expired(now)`; no per-connection timer exists.

A socket error (EPOLLERR: a reset) on either side of a connection past HELLO ends it
as "reset" at once, even when no direction waits on that side: a client that aborts
while its backend is silent must not hold the connection until the idle timeout.
"""

from __future__ import annotations

from enum import Enum, IntEnum

from pact_ingress.proto import tls_alert


class State(IntEnum):
    """(An IntEnum: looked up in `_NEXT` on every transition, and an int hashes in C.)"""

    HELLO = 0
    CONNECTING = 1
    SPLICING = 2
    CLOSED = 3


_NEXT = {
    State.HELLO: frozenset({State.CONNECTING, State.CLOSED}),
    State.CONNECTING: frozenset({State.SPLICING, State.CLOSED}),
    State.SPLICING: frozenset({State.CLOSED}),
    State.CLOSED: frozenset(),
}


class Step(Enum):
    """What the engine does next for a connection."""

    READ_HELLO = "read_hello"  # read the client; parse what came so far
    SEND_HEAD = "send_head"  # write what is left of the head to the backend
    PUMP_UP = "pump_up"  # splice client → backend
    PUMP_DOWN = "pump_down"  # splice backend → client
    FAIL = "fail"  # a side reported an error: the connection is over ("reset")


class Flow(Enum):
    """What one direction of a splicing connection waits for."""

    READ = "read"  # its source has nothing now
    WRITE = "write"  # its destination takes nothing now
    DONE = "done"  # EOF seen and passed on


#: The members as plain globals, for the methods below and the engine. On Python 3.11 an
#: Enum class attribute (`State.CLOSED`) goes through the metaclass's `__getattr__` hook,
#: several times the cost of a global, and a connection reads a dozen of them.
S_HELLO, S_CONNECTING, S_SPLICING, S_CLOSED = (State.HELLO, State.CONNECTING, State.SPLICING,
                                               State.CLOSED)
F_READ, F_WRITE, F_DONE = Flow.READ, Flow.WRITE, Flow.DONE
PUMP_UP, PUMP_DOWN = Step.PUMP_UP, Step.PUMP_DOWN

#: Sides of a connection, as the engine tags its fds.
CLIENT = 0
BACKEND = 1
#: Directions.
UP = 0
DOWN = 1

_NOTHING: tuple[Step, ...] = ()
_UP = (Step.PUMP_UP,)
_DOWN = (Step.PUMP_DOWN,)
_BOTH = (Step.PUMP_UP, Step.PUMP_DOWN)
_READ_HELLO = (Step.READ_HELLO,)
_SEND_HEAD = (Step.SEND_HEAD,)
_FAIL = (Step.FAIL,)

#: The outcome a timer gives, by the state it fired in (a connect that never completed is
#: a backend down; a backend that stopped taking the head is one that reset).
_EXPIRED = {
    State.HELLO: "clienthello_timeout",
    State.CONNECTING: "backend_down",
    State.SPLICING: "idle_timeout",
}
#: The TLS alert an outcome is answered with before the close: only a backend that could
#: not be reached gets one (internal_error); a caller cut off mid-relay gets none, the
#: bytes it already has may be a TLS session the backend is in the middle of.
_ALERTS = {"backend_down": tls_alert.INTERNAL_ERROR}


def alert_for(outcome: str) -> int | None:
    """The alert description to send before closing with `outcome`, or None."""
    return _ALERTS.get(outcome)


class TransitionError(RuntimeError):
    """A transition `_NEXT` does not allow: a bug in the caller, never a peer's doing."""


class Passthrough:
    """One connection's state, deadline and directions (see the module docstring).

    The engine subclasses it to hang its sockets and pipes on the same object."""

    __slots__ = ("state", "deadline", "outcome", "up", "down", "connected",
                 "seen", "idle_timeout", "head_timeout")

    def __init__(self, now: float, hello_timeout: float) -> None:
        self.state = S_HELLO
        self.deadline = now + hello_timeout
        self.outcome: str | None = None
        self.up = F_READ
        self.down = F_READ
        #: The backend took a byte of the head: the connect succeeded.
        self.connected = False
        #: Sides whose readable edges arrived before SPLICING (bit per side).
        self.seen = 0
        self.idle_timeout = 0.0
        self.head_timeout = 0.0

    def _go(self, new: State) -> None:
        if new not in _NEXT[self.state]:
            raise TransitionError(f"{self.state.name} -> {new.name}")
        self.state = new

    # --- inputs ----------------------------------------------------------------------

    def ready(self, side: int, readable: bool, writable: bool, error: bool
              ) -> tuple[Step, ...]:
        """An edge on `side`: the steps it calls for (spurious edges call for none)."""
        state = self.state
        if state is S_SPLICING:
            if error:
                return _FAIL
            if side == CLIENT:
                up = readable and self.up is F_READ
                down = writable and self.down is F_WRITE
            else:
                up = writable and self.up is F_WRITE
                down = readable and self.down is F_READ
            if up:
                return _BOTH if down else _UP
            return _DOWN if down else _NOTHING
        if state is S_HELLO:
            return _READ_HELLO if side == CLIENT and (readable or error) else _NOTHING
        if state is S_CONNECTING:
            if side == BACKEND:
                if readable:
                    self.seen |= 1 << BACKEND
                return _SEND_HEAD if (writable or error) else _NOTHING
            if error:
                return _FAIL
            if readable:
                self.seen |= 1 << CLIENT
        return _NOTHING

    def routed(self, now: float, connect_timeout: float, head_timeout: float,
               idle_timeout: float, more_from_client: bool) -> None:
        """The ClientHello named a passthrough route; the backend connect has begun.
        `more_from_client`: the last read may have left bytes in the socket."""
        if S_CONNECTING not in _NEXT[self.state]:  # `_go`, inline
            raise TransitionError(f"{self.state.name} -> CONNECTING")
        self.state = S_CONNECTING
        self.deadline = now + connect_timeout
        self.head_timeout = head_timeout
        self.idle_timeout = idle_timeout
        if more_from_client:
            self.seen |= 1 << CLIENT

    def retry(self, now: float, connect_timeout: float) -> None:
        """The backend address failed before taking a byte; the next one is tried."""
        if self.state is not S_CONNECTING or self.connected:
            raise TransitionError("retry outside a pending connect")
        self.deadline = now + connect_timeout
        self.seen &= ~(1 << BACKEND)

    def backend_failed(self, now: float, next_address: bool, connect_timeout: float
                       ) -> str | None:
        """Writing the head failed. Before the backend took a byte the connect failed:
        the next address is tried if there is one (None), else "backend_down". After,
        the backend went away: "backend_reset". An outcome closes the connection."""
        if self.state is not S_CONNECTING:
            raise TransitionError(f"backend failure in {self.state.name}")
        if self.connected:
            self.close("backend_reset")
            return "backend_reset"
        if next_address:
            self.retry(now, connect_timeout)
            return None
        self.close("backend_down")
        return "backend_down"

    def head_progress(self, now: float, done: bool) -> tuple[Step, ...]:
        """The backend took head bytes (`done`: all of them). Returns the pumps owed to
        edges seen while connecting."""
        if self.state is not S_CONNECTING:
            raise TransitionError(f"head progress in {self.state.name}")
        if not self.connected:
            self.connected = True
            self.deadline = now + self.head_timeout
        if not done:
            return _NOTHING
        self.state = S_SPLICING  # (CONNECTING -> SPLICING: in `_NEXT`)
        self.deadline = now + self.idle_timeout
        seen, self.seen = self.seen, 0
        up = bool(seen & (1 << CLIENT))
        down = bool(seen & (1 << BACKEND))
        if up:
            return _BOTH if down else _UP
        return _DOWN if down else _NOTHING

    def pumped(self, direction: int, flow: Flow, moved: bool, now: float) -> bool:
        """A pump of `direction` stopped, waiting for `flow` (DONE: its EOF was passed
        on); `moved`: bytes went through. True when the connection is over."""
        if self.state is not S_SPLICING:
            raise TransitionError(f"pump in {self.state.name}")
        if moved:
            self.deadline = now + self.idle_timeout
        if direction == UP:
            self.up = flow
        else:
            self.down = flow
        if self.up is F_DONE and self.down is F_DONE:
            self.state = S_CLOSED  # (SPLICING -> CLOSED: in `_NEXT`; `close`, inline)
            self.outcome = "ok"
            return True
        return False

    def close(self, outcome: str) -> None:
        """The connection ends with `outcome` (closing twice is a caller's bug: raises)."""
        if S_CLOSED not in _NEXT[self.state]:  # `_go`, inline
            raise TransitionError(f"{self.state.name} -> CLOSED")
        self.state = S_CLOSED
        self.outcome = outcome

    def expired(self, now: float) -> str | None:
        """The timer's outcome if it fired by `now` (the connection is then CLOSED)."""
        if now < self.deadline or self.state is S_CLOSED:
            return None
        outcome = _EXPIRED[self.state]
        if self.state is S_CONNECTING and self.connected:
            outcome = "backend_reset"
        self.close(outcome)
        return outcome
