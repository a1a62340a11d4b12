"""The passthrough state machine (`proto/passthrough.py`) without I/O: every transition,
the steps each edge calls for in each state, half-close both ways, backend failures,
timers driven by `now`, and illegal transitions raising. The engine's limits and wire
answers are checked through a real router in tests/test_edge.py."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
)

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
    assert m.expired(CONNECT_T) == "connect_timeout"

    m = connecting(0.0)
    assert m.head_progress(1.0, done=False) == ()  # the backend took part of the head
    assert m.connected and m.deadline == 1.0 + HEAD_T
    assert m.expired(1.0 + HEAD_T - 0.5) is None
    assert m.expired(1.0 + HEAD_T) == "head_timeout"


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
