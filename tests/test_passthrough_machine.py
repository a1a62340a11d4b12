"""The passthrough state machine (`proto/passthrough.py`) without I/O: every transition,
the steps each edge calls for in each state, half-close both ways, backend failures and
their alert, timers driven by `now`, and illegal transitions raising; then the limits
the engine applies at accept and after the first bytes (the router's, called without
I/O). The wire answers are checked through a real serve in tests/test_edge.py."""

from __future__ import annotations

import itertools
import socket

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pact_ingress.config import Limits
from pact_ingress.net.backends import Backends
from pact_ingress.net.edge import _Conn
from pact_ingress.net.router import PEEK_HEADROOM, Router
from pact_ingress.proto import tls_alert
from pact_ingress.proto.passthrough import (
    BACKEND,
    CLIENT,
    DOWN,
    UP,
    Flow,
    Passthrough,
    State,
    Step,
    TransitionError,
    alert_for,
)
from pact_ingress.stats import Stats
from tests.netutil import make_config, route

HELLO_T, CONNECT_T, HEAD_T, IDLE_T = 10.0, 5.0, 10.0, 300.0


def hello(now: float = 0.0) -> Passthrough:
    return Passthrough(now, HELLO_T)


def connecting(now: float = 0.0, more: bool = False) -> Passthrough:
    m = hello(now)
    m.routed(now, CONNECT_T, HEAD_T, IDLE_T, more)
    return m


def splicing(now: float = 0.0) -> Passthrough:
    m = connecting(now)
    assert m.head_progress(now, done=True) == ()
    return m


EDGES = list(itertools.product((CLIENT, BACKEND), (False, True), (False, True), (False, True)))


# --- HELLO -------------------------------------------------------------------------------


def test_hello_reads_on_client_edges_only() -> None:
    for side, readable, writable, error in EDGES:
        steps = hello().ready(side, readable, writable, error)
        expect = (Step.READ_HELLO,) if side == CLIENT and (readable or error) else ()
        assert steps == expect, (side, readable, writable, error)


def test_hello_timer() -> None:
    m = hello(100.0)
    assert m.expired(100.0 + HELLO_T - 0.001) is None and m.state is State.HELLO
    assert m.expired(100.0 + HELLO_T) == "clienthello_timeout"
    assert m.state is State.CLOSED and m.outcome == "clienthello_timeout"
    assert m.expired(1e9) is None  # a closed connection's timer is spent


def test_hello_can_close_but_not_splice() -> None:
    m = hello()
    with pytest.raises(TransitionError):
        m.head_progress(0.0, done=True)
    with pytest.raises(TransitionError):
        m.pumped(UP, Flow.READ, True, 0.0)
    m.close("refused")
    assert m.state is State.CLOSED and m.outcome == "refused"


# --- CONNECTING ----------------------------------------------------------------------------


def test_connecting_sends_head_on_backend_edges() -> None:
    for side, readable, writable, error in EDGES:
        m = connecting()
        steps = m.ready(side, readable, writable, error)
        if side == BACKEND:
            assert steps == ((Step.SEND_HEAD,) if writable or error else ())
        else:
            assert steps == ((Step.FAIL,) if error else ())


def test_connect_timer_then_head_timer() -> None:
    m = connecting(0.0)
    assert m.deadline == CONNECT_T
    assert m.expired(CONNECT_T) == "backend_down"  # never connected: alert 80
    assert alert_for("backend_down") == tls_alert.INTERNAL_ERROR

    m = connecting(0.0)
    assert m.head_progress(1.0, done=False) == ()  # the backend took part of the head
    assert m.connected and m.deadline == 1.0 + HEAD_T
    assert m.expired(1.0 + HEAD_T - 0.5) is None
    assert m.expired(1.0 + HEAD_T) == "backend_reset"  # it stopped taking it: no alert
    assert alert_for("backend_reset") is None


def test_backend_failure_tries_every_address_then_answers_alert_80() -> None:
    m = connecting(0.0)
    assert m.backend_failed(1.0, next_address=True, connect_timeout=CONNECT_T) is None
    assert m.state is State.CONNECTING and m.deadline == 1.0 + CONNECT_T
    assert m.backend_failed(2.0, next_address=True, connect_timeout=CONNECT_T) is None
    assert m.backend_failed(3.0, next_address=False, connect_timeout=CONNECT_T) == (
        "backend_down")
    assert m.state is State.CLOSED and m.outcome == "backend_down"
    assert alert_for(m.outcome) == tls_alert.INTERNAL_ERROR
    # once the backend took a byte, a failure is a reset, whatever addresses are left
    m = connecting(0.0)
    m.head_progress(0.5, done=False)
    assert m.backend_failed(1.0, next_address=True, connect_timeout=CONNECT_T) == (
        "backend_reset")
    assert alert_for(m.outcome or "") is None
    with pytest.raises(TransitionError):
        splicing().backend_failed(0.0, next_address=False, connect_timeout=CONNECT_T)


def test_outcomes_other_than_an_unreachable_backend_get_no_alert() -> None:
    for outcome in ("ok", "reset", "idle_timeout", "clienthello_timeout", "backend_reset",
                    "error"):
        assert alert_for(outcome) is None


def test_retry_next_address_restarts_the_connect_timer() -> None:
    m = connecting(0.0)
    m.ready(BACKEND, True, False, False)  # an edge of the failed socket
    m.retry(3.0, CONNECT_T)
    assert m.deadline == 3.0 + CONNECT_T and m.state is State.CONNECTING
    assert m.head_progress(4.0, done=True) == ()  # the old socket's edge is not owed
    m2 = connecting(0.0)
    m2.head_progress(0.0, done=False)
    with pytest.raises(TransitionError):  # connected once: no retry elsewhere
        m2.retry(1.0, CONNECT_T)


@pytest.mark.parametrize(("client", "backend", "expect"), [
    (False, False, ()),
    (True, False, (Step.PUMP_UP,)),
    (False, True, (Step.PUMP_DOWN,)),
    (True, True, (Step.PUMP_UP, Step.PUMP_DOWN)),
])  # fmt: skip
def test_edges_seen_while_connecting_are_pumped_on_splicing(
        client: bool, backend: bool, expect: tuple[Step, ...]) -> None:
    m = connecting()
    if client:
        m.ready(CLIENT, True, False, False)
    if backend:
        assert m.ready(BACKEND, True, True, False) == (Step.SEND_HEAD,)
    assert m.head_progress(1.0, done=True) == expect
    assert m.state is State.SPLICING and m.deadline == 1.0 + IDLE_T


def test_bytes_left_behind_the_hello_are_owed_a_pump() -> None:
    m = connecting(more=True)
    assert m.head_progress(0.0, done=True) == (Step.PUMP_UP,)


# --- SPLICING -------------------------------------------------------------------------------


@given(st.sampled_from([Flow.READ, Flow.WRITE, Flow.DONE]),
       st.sampled_from([Flow.READ, Flow.WRITE, Flow.DONE]),
       st.sampled_from(EDGES))
def test_splicing_pumps_exactly_the_directions_waiting_for_the_edge(
        up: Flow, down: Flow, edge: tuple[int, bool, bool, bool]) -> None:
    m = splicing()
    m.up, m.down = up, down
    side, readable, writable, error = edge
    steps = m.ready(side, readable, writable, error)
    if error:
        assert steps == (Step.FAIL,)
        return
    up_wants = ((readable and side == CLIENT and up is Flow.READ)
                or (writable and side == BACKEND and up is Flow.WRITE))
    down_wants = ((readable and side == BACKEND and down is Flow.READ)
                  or (writable and side == CLIENT and down is Flow.WRITE))
    assert (Step.PUMP_UP in steps) == up_wants
    assert (Step.PUMP_DOWN in steps) == down_wants
    assert Step.READ_HELLO not in steps and Step.SEND_HEAD not in steps


@pytest.mark.parametrize("first", [UP, DOWN])
def test_half_close_each_way_then_both(first: int) -> None:
    m = splicing(0.0)
    second = DOWN if first == UP else UP
    assert m.pumped(first, Flow.DONE, True, 1.0) is False  # one EOF: the other flows on
    assert m.state is State.SPLICING
    # the open direction still moves; edges for the finished one call for nothing
    done_side_source = CLIENT if first == UP else BACKEND
    assert m.ready(done_side_source, True, False, False) == ()
    assert m.pumped(second, Flow.WRITE, True, 2.0) is False
    assert m.pumped(second, Flow.DONE, True, 3.0) is True
    assert m.state is State.CLOSED and m.outcome == "ok"


def test_idle_timer_is_pushed_by_moved_bytes_only() -> None:
    m = splicing(0.0)
    assert m.deadline == IDLE_T
    m.pumped(UP, Flow.READ, False, 100.0)  # a pump that moved nothing
    assert m.deadline == IDLE_T
    m.pumped(DOWN, Flow.READ, True, 200.0)
    assert m.deadline == 200.0 + IDLE_T
    assert m.expired(200.0 + IDLE_T - 1) is None
    assert m.expired(200.0 + IDLE_T) == "idle_timeout"
    with pytest.raises(TransitionError):
        m.pumped(UP, Flow.READ, True, 0.0)


def test_error_fails_a_splicing_connection_whatever_waits() -> None:
    for up, down in itertools.product(list(Flow), repeat=2):
        m = splicing()
        m.up, m.down = up, down
        assert m.ready(CLIENT, False, False, True) == (Step.FAIL,)
        assert m.ready(BACKEND, True, True, True) == (Step.FAIL,)


def test_every_transition_outside_the_table_raises() -> None:
    allowed = {(State.HELLO, State.CONNECTING), (State.HELLO, State.CLOSED),
               (State.CONNECTING, State.SPLICING), (State.CONNECTING, State.CLOSED),
               (State.SPLICING, State.CLOSED)}  # fmt: skip
    for a, b in itertools.product(list(State), repeat=2):
        m = hello()
        m.state = a
        if (a, b) in allowed:
            m._go(b)
            assert m.state is b
        else:
            with pytest.raises(TransitionError):
                m._go(b)


def test_closing_twice_raises() -> None:
    m = splicing()
    m.close("reset")
    with pytest.raises(TransitionError):
        m.close("ok")
    assert m.outcome == "reset"


@given(st.lists(st.tuples(st.sampled_from([UP, DOWN]),
                          st.sampled_from([Flow.READ, Flow.WRITE, Flow.DONE]),
                          st.booleans()), max_size=30))
def test_any_pump_sequence_closes_exactly_when_both_directions_are_done(
        seq: list[tuple[int, Flow, bool]]) -> None:
    m = splicing(0.0)
    done = {UP: False, DOWN: False}
    for i, (direction, flow, moved) in enumerate(seq):
        if m.state is State.CLOSED:
            break
        if done[direction]:
            continue  # the engine never pumps a finished direction
        over = m.pumped(direction, flow, moved, float(i))
        done[direction] = flow is Flow.DONE
        assert over == (done[UP] and done[DOWN])
        assert (m.state is State.CLOSED) == over


# --- limits (the router's decisions the engine calls; no I/O) --------------------------


@pytest.fixture
def router(tmp_path) -> Router:  # type: ignore[no-untyped-def]
    limits = Limits(max_connections=100, max_connections_per_ip=3)
    return Router(make_config(tmp_path, [route("a.test", "t", 9)], limits=limits),
                  stats=Stats(), backends=Backends())


def accept(router: Router, who: str) -> str | None:
    """What the engine does at accept: the limit check, then count it as pending."""
    reason = router._over_limit(who)
    if reason is None:
        router._counts.total += 1
        router._counts.pending[who] += 1
    return reason


def test_per_ip_cap_leaves_peek_headroom_then_refuses_at_accept(router: Router) -> None:
    cap = router.limits.max_connections_per_ip
    results = [accept(router, "10.0.0.1") for _ in range(cap + PEEK_HEADROOM + 1)]
    assert results[:cap + PEEK_HEADROOM] == [None] * (cap + PEEK_HEADROOM)
    assert results[-1] == "max_connections_per_ip"
    assert accept(router, "10.0.0.2") is None  # another client is not affected


def test_first_bytes_classify_against_each_kinds_own_cap(router: Router) -> None:
    cap = router.limits.max_connections_per_ip
    for _ in range(2 * cap):  # within cap + PEEK_HEADROOM: all pending
        assert accept(router, "10.0.0.1") is None
    kinds = [router._classify("10.0.0.1", "10.0.0.1", tunnel=False) for _ in range(cap + 1)]
    assert all(k is router._counts.clients for k in kinds[:cap]) and kinds[cap] is None
    tunnels = [router._classify("10.0.0.1", "10.0.0.1", tunnel=True) for _ in range(cap)]
    assert all(k is router._counts.tunnels for k in tunnels)  # the connector's own cap
    assert router._counts.clients["10.0.0.1"] == cap
    assert router._counts.tunnels["10.0.0.1"] == cap


def test_global_cap(router: Router) -> None:
    for i in range(router.limits.max_connections):
        assert accept(router, f"10.0.1.{i}") is None
    assert accept(router, "10.0.2.1") == "max_connections"


def test_the_engine_connection_starts_as_the_machine_does() -> None:
    """The engine's connection sets the machine's fields itself (no call per
    connection): every one of them, to the value `Passthrough.__init__` gives."""
    a, b = socket.socketpair()
    try:
        conn = _Conn(12.5, HELLO_T, a, ("192.0.2.1", 1), "192.0.2.1", None)
        ref = hello(12.5)
        for name in Passthrough.__slots__:
            assert getattr(conn, name) == getattr(ref, name), name
            assert type(getattr(conn, name)) is type(getattr(ref, name)), name
    finally:
        a.close()
        b.close()
