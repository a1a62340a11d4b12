"""The stream job's state machine, pure: every legal move, every illegal one refused,
and what the connector counts from a state."""

from __future__ import annotations

import socket

import pytest

from pact_ingress.net.tunnel.stream_job import (
    TRANSITIONS,
    Dial,
    Event,
    Hooks,
    IllegalTransition,
    State,
    StreamJob,
    next_state,
)

S, E = State, Event


def walk(events: list[Event], state: State = S.NEW) -> State:
    for event in events:
        state = next_state(state, event)
    return state


@pytest.mark.parametrize("events, end", [
    # a raw data connection: dialled on its thread, a stream, its answer, its end
    ([E.RUN_DIAL, E.DIALLED, E.FIRST_BYTES, E.ANSWERED, E.CLOSE], S.DONE),
    # the first bytes came right behind DATA_OK
    ([E.RUN_DIAL, E.FIRST_BYTES, E.ANSWERED], S.ACTIVE),
    # a TLS data connection, handed over unwrapped, woken once without data
    ([E.RUN_IDLE, E.FIRST_BYTES, E.NO_BYTES, E.FIRST_BYTES], S.OPENING),
    ([E.RUN_STREAM, E.ANSWERED], S.ACTIVE),
    # its control connection died while it was idle; its thread closes
    ([E.RUN_IDLE, E.STOP, E.CLOSE], S.DONE),
    ([E.RUN_DIAL, E.STOP], S.STOPPING),
    # the connector stops with a stream running
    ([E.RUN_STREAM, E.ANSWERED, E.STOP, E.CLOSE], S.DONE),
    # stopped before its thread ran: closed by whoever stopped it
    ([E.CLOSE], S.DONE),
    # the ingress retired it: EOF while idle
    ([E.RUN_IDLE, E.CLOSE], S.DONE),
])  # fmt: skip
def test_a_life(events: list[Event], end: State) -> None:
    assert walk(events) is end


@pytest.mark.parametrize("state", list(State))
@pytest.mark.parametrize("event", list(Event))
def test_every_move_is_in_the_table_or_refused(state: State, event: Event) -> None:
    if (state, event) in TRANSITIONS:
        assert next_state(state, event) is TRANSITIONS[(state, event)]
    else:
        with pytest.raises(IllegalTransition):
            next_state(state, event)


def test_what_can_never_happen() -> None:
    for state, event in [(S.DONE, E.RUN_IDLE), (S.DONE, E.CLOSE), (S.STOPPING, E.FIRST_BYTES),
                         (S.ACTIVE, E.FIRST_BYTES), (S.IDLE, E.ANSWERED),
                         (S.NEW, E.STOP), (S.STOPPING, E.ANSWERED)]:  # fmt: skip
        with pytest.raises(IllegalTransition):
            next_state(state, event)
    assert not any(start is S.DONE for start, _ in TRANSITIONS)  # DONE is the end


def test_every_state_is_reachable_and_ends() -> None:
    reachable, frontier = {S.NEW}, [S.NEW]
    while frontier:
        state = frontier.pop()
        for (start, _), end in TRANSITIONS.items():
            if start is state and end not in reachable:
                reachable.add(end)
                frontier.append(end)
    assert reachable == set(State)
    for state in set(State) - {S.DONE}:  # CLOSE (or STOP, then CLOSE) ends any life
        assert walk([E.CLOSE], state) is S.DONE or walk([E.STOP, E.CLOSE], state) is S.DONE


def job(first: bytes = b"") -> StreamJob:
    hooks = Hooks(opened=lambda: None, moved=lambda d, n: None, forward_failed=lambda e: None)
    return StreamJob(None, first, ("127.0.0.1", 9), socket.AF_INET, hooks,
                     connect_timeout=1.0, idle_timeout=1.0)


def test_counts_come_from_the_state() -> None:
    fresh = job()
    assert fresh.state is S.NEW and fresh.waiting and not fresh.streaming
    fresh.hand_over(Dial("127.0.0.1", 9, b"", b"", 0.0, 1.0, 1.0))
    for state, waiting, streaming in [(S.DIALING, True, False), (S.IDLE, True, False),
                                      (S.OPENING, False, True), (S.ACTIVE, False, True),
                                      (S.STOPPING, True, False), (S.DONE, False, False)]:
        fresh.state = state
        assert (fresh.waiting, fresh.streaming) == (waiting, streaming), state


def test_a_new_job_stopped_before_its_connection_came_refuses_it() -> None:
    idle = job()
    assert idle.stop_if_idle() is True and idle.state is S.DONE
    a, b = socket.socketpair()
    with a, b:
        assert idle.hand_over(b) is False  # the caller still owns (and closes) it
        assert b.fileno() != -1
    assert idle.run() == "retired"


def test_a_begun_stream_is_not_idle_even_before_its_thread_runs() -> None:
    a, b = socket.socketpair()
    with a:
        begun = job()
        assert begun.hand_over(b, b"\x16\x03\x01") is True
        assert begun.streaming and not begun.waiting
        assert begun.stop_if_idle() is False and begun.state is S.NEW
        begun.stop()
        assert begun.state is S.DONE and b.fileno() == -1
