"""HTTP/2 streams served in the keep-alive lane: the usual request (no body, checks that
pass, an idle pooled connection to the node, a short answer) without a task switch.

Theory of operation
-------------------
An HTTP/2 request in the trio engine (`net/http2.py`) wakes a stream worker, which runs
the request story through coroutines and parks on the node's socket until the answer
comes: two task switches and a coroutine chain per request, on top of the connection's
reader. This module serves the usual request instead the way the HTTP/1.1 lane
(`net/h1_lane.py`) does: the reader, having dispatched a request whose HEADERS ended the
stream, asks `H2Lane.start`, which runs the same checks synchronously
(`Terminator.lane_story`, as for HTTP/1.1, in the same order, so the checks cannot
differ by path), takes the client's share of the node and an idle pooled connection,
and writes the request (`NodeLeg`). The node's answer is read and parsed from the
readiness hub's callbacks; the whole answer is queued on the stream and sent
(`H2Exchange.respond_whole_now`), counted and logged, and the stream is done: no worker
ever ran for it.

Anything else goes to a stream worker, in one step, with how far the story got
(`Rest`, taken up by `Terminator._then`):

* nothing charged yet (a request with a body, a check that would refuse it, a limiter
  that is not local): the worker serves the stream from the start — `start` says False;
* `Resume.ANSWER` — an answer decided at the edge (rate limited, a seal posture
  refusal, no share left, a node failure, an answer that broke off);
* `Resume.FORWARD` — the checks passed and were charged but no idle connection to the
  node could be used (none idle, a tunnel, a pooled one the node had closed): the
  worker forwards it (`Terminator._forward` takes the share and a connection);
* `Resume.RELAY` — the node's head came but not its whole answer: the worker relays
  the rest (`Upstream.adopt`);
* `Resume.WRITE` — the node's whole answer is here but the client's flow-control
  window (or the connection's outbox) cannot take it now: the worker writes it.

A stream here ends with the client's reset (`abort`: the node's connection is closed,
not reused; counted 499), with its connection (the same), or when its node deadline
passes (the lane's tick: the node's head by the pool's `header_timeout`, the rest of a
short body by `BODY_GRACE`). Phases: UPSTREAM (the request at the node) → ENDED.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pact_ingress.logs import log
from pact_ingress.net.h1_lane import INTERNAL_FAULT, LaneGo, Resume
from pact_ingress.net.http_exchange import ClientGone, HeadTooLarge
from pact_ingress.net.node_leg import Broke, NodeLeg, RouteNodes
from pact_ingress.proto.h2_frames import ErrorCode
from pact_ingress.proto.http_headers import clean_response_headers

if TYPE_CHECKING:
    from pact_ingress.net.h1_lane import Lane
    from pact_ingress.net.http2 import H2Connection, H2Exchange
    from pact_ingress.net.terminate import _Answer, _Connection
    from pact_ingress.net.upstream import _Conn, _Pool
    from pact_ingress.proto.http_upstream import ResponseParser

#: The status a stream ends with when the client reset it, or its connection ended.
CLIENT_CLOSED = 499


class StreamPhase(enum.Enum):
    UPSTREAM = "upstream"  # the request at the node
    ENDED = "ended"  # answered here, aborted, or handed to a stream worker


#: The members as plain globals, for the per-stream steps below: on Python 3.11 an Enum
#: class attribute (`StreamPhase.ENDED`) goes through the metaclass's `__getattr__` hook,
#: about ten times the cost of a global load.
S_UPSTREAM, S_ENDED = StreamPhase.UPSTREAM, StreamPhase.ENDED


@dataclass(slots=True)
class Rest:
    """What a stream worker takes over from the lane (`Terminator._then`)."""

    point: Resume
    answer: _Answer | None = None  # ANSWER; WRITE: the node's whole answer
    go: LaneGo | None = None  # FORWARD, RELAY: the story so far
    entry: _Pool | None = None  # RELAY: the pool, counted in its `active`
    node: _Conn | None = None  # RELAY: the node connection, the head read
    response: ResponseParser | None = None  # RELAY
    stream: None = None  # (an HTTP/2 node stream's relay: the HTTP/1.1 lane's only)


class H2Lane:
    """The lane's side of one HTTP/2 connection: the streams it serves here."""

    def __init__(self, lane: Lane, conn: _Connection, c: H2Connection) -> None:
        self.lane = lane
        self.t = lane.t
        self.conn = conn
        self.c = c
        self.streams: set[_Stream] = set()
        self.nodes = RouteNodes()  # the shares and the pool of the route last used

    def start(self, ex: H2Exchange) -> bool:
        """Serve the stream here (True), or leave it to a stream worker from the start
        (False: nothing was charged)."""
        if not ex.body_done or self.c._closing or self.lane.draining:
            return False
        conn = self.conn
        now = conn.now()
        step = self.t.lane_story(conn, ex, b"", now)
        if step is None:
            return False
        stream = _Stream(self, ex, now)
        try:
            self._go(stream, step, now)
        except Exception as exc:  # noqa: BLE001
            # a fault here ends the stream (giving back what it held), never the reader
            stream.failed(exc)
        return True

    def _go(self, stream: _Stream, step: LaneGo | _Answer, now: float) -> None:
        self.streams.add(stream)
        if type(step) is not LaneGo:
            stream.hand(Rest(Resume.ANSWER, answer=step))  # type: ignore[arg-type]
            return
        stream.go = go = step
        stream.held = go.held
        taken = stream.take_node(self.nodes, go, now)
        if taken is None:
            stream.hand(Rest(Resume.ANSWER, answer=self.lane.too_many))
        elif not taken:
            stream.retry_fresh()  # a worker gets one from the pool
        else:
            self.lane.join_stream(stream)
            stream.ex.lane = stream
            stream.send_request(now)

    def close(self) -> None:
        """The connection is ending: every stream still here ends (499)."""
        for stream in list(self.streams):
            stream.abort()


class _Stream(NodeLeg):
    """One stream served in the lane (its node side: `NodeLeg`)."""

    AT_NODE = S_UPSTREAM

    def __init__(self, h2: H2Lane, ex: H2Exchange, now: float) -> None:
        self.h2 = h2
        self.lane = h2.lane
        self.t = h2.t
        self.conn = h2.conn
        self.request = ex
        self.ex = ex
        self.started = now
        self.held = 0
        self.go: LaneGo | None = None
        self.phase = S_UPSTREAM
        self.leg_init()

    def move(self, to: StreamPhase) -> None:
        if self.phase is S_ENDED and to is not S_ENDED:
            raise AssertionError(f"h2 lane: {self.phase.value} -> {to.value}")
        self.phase = to

    def guarded(self, step: Any, arg: int) -> None:
        try:
            step(arg)
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)

    def failed(self, exc: Exception) -> None:
        if isinstance(exc, (Broke, ClientGone)):
            self.abort()
            return
        log.error("lane_error", route=self.conn.route_host, client=self.conn.client_ip,
                  error=f"{type(exc).__name__}: {exc}")
        self.fault()

    # -- the ends -----------------------------------------------------------------------

    def _leave(self) -> int:
        """Out of the lane, whoever ends the stream; returns the body bytes it held."""
        self.phase = S_ENDED
        self.node_deadline = math.inf
        self.h2.streams.discard(self)
        self.lane.streams.discard(self)
        self.ex.lane = None
        self.node_side = None  # (a reference cycle through the bound method)
        held, self.held = self.held, 0
        return held

    def done(self, status: int, now: float | None = None) -> None:
        """The stream's exchange ends here with `status`: counted, logged, the stream
        given back to its connection."""
        held = self._leave()
        ex = self.ex
        self.t.count(self.conn, ex.method, ex.target, status, self.started, held, now)
        self.h2.c.stream_done(ex)

    def abort(self) -> None:
        """The client reset the stream, or its connection ended: the node's connection
        is closed (not reused) and the stream ends (499)."""
        if self.phase is S_ENDED:
            return
        self.release(False)
        self.drop_response()
        self.lane.h2_aborted += 1
        self.done(CLIENT_CLOSED)

    def fault(self) -> None:
        """A fault of ours: the node's connection is closed (not reused), the stream
        reset with INTERNAL_ERROR (no answer can be trusted now) and counted 500, not
        as the client's loss."""
        if self.phase is S_ENDED:
            return
        self.release(False)
        self.drop_response()
        self.ex.reset(ErrorCode.INTERNAL_ERROR)
        self.done(INTERNAL_FAULT)

    def hand(self, rest: Rest) -> None:
        """A stream worker takes the stream up at `rest.point`."""
        held = self._leave()
        self.lane.h2_handed[rest.point] += 1
        if rest.go is None:
            rest.go = self.go
        self.h2.c.start_with(self.ex, self.t.resumed(self.conn, rest, held, self.started))

    # -- the node leg's outcomes (`NodeLeg`) --------------------------------------------

    def retry_fresh(self) -> None:
        self.release(False)
        self.hand(Rest(Resume.FORWARD))

    def give_up(self, answer: _Answer) -> None:
        self.hand(Rest(Resume.ANSWER, answer=answer))

    def relayed(self, entry: _Pool, node: _Conn, response: ResponseParser) -> None:
        self.hand(Rest(Resume.RELAY, entry=entry, node=node, response=response))

    def broke_off(self) -> None:
        self.hand(Rest(Resume.ANSWER, answer=self.t.broke_off_answer))

    def node_answered(self, now: float) -> None:
        """The node's whole answer is here: queued on the stream and sent."""
        parser = self.response
        assert parser is not None
        headers = clean_response_headers(parser.headers)
        body = parser.take_body()
        status = parser.status
        # (a node that answered before it took our whole request: not reused)
        self.release(parser.keep_alive and not self.node_pending, now)
        self.response = None
        try:
            sent = self.ex.respond_whole_now(status, headers, body)
        except ClientGone:
            self.done(CLIENT_CLOSED, now)
            return
        except HeadTooLarge:
            self.t.note_head_too_large(self.conn)
            self.hand(Rest(Resume.ANSWER, answer=self.t.head_too_large_answer))
            return
        if not sent:  # the client's window cannot take it now: the worker writes it
            self.hand(Rest(Resume.WRITE, answer=self.t.node_answer(status, headers, body)))
            return
        self.lane.h2_served += 1
        self.done(status, now)
