"""The deadline sweeper (`net/deadlines.py`): waits end at their deadline, nothing else."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from pact_ingress.net import deadlines, rawsock


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    yield a, b
    a.close()
    b.close()


async def test_a_read_wait_ends_at_its_deadline_and_the_socket_stays_usable(
        pair, autojump_clock: trio.testing.MockClock) -> None:
    a, b = pair
    start = trio.current_time()
    with pytest.raises(trio.TooSlowError):
        await rawsock.recv(a, 100, start + 5)
    late = trio.current_time() - (start + 5)
    assert 0 <= late <= deadlines.SWEEP_SECONDS * 2
    assert not deadlines.sweeper()._armed  # disarmed on the way out
    b.send(b"after")  # the socket was only woken, never closed: the next wait works
    assert await rawsock.recv(a, 100, trio.current_time() + 5) == b"after"


async def test_a_wait_that_is_answered_never_fires(
        pair, autojump_clock: trio.testing.MockClock) -> None:
    a, b = pair

    async def answer() -> None:
        await trio.sleep(1)
        b.send(b"x")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        assert await rawsock.recv(a, 100, trio.current_time() + 2, wait_first=True) == b"x"
    await trio.sleep(5)  # long past the deadline: nothing fires later
    assert not deadlines.sweeper()._armed
    b.send(b"y")
    assert await rawsock.recv(a, 100, trio.current_time() + 1) == b"y"


async def test_a_due_deadline_fails_at_once_without_arming(
        pair, autojump_clock: trio.testing.MockClock) -> None:
    a, _ = pair
    with pytest.raises(trio.TooSlowError):
        await deadlines.wait_readable(a, trio.current_time())


async def test_an_armed_scope_is_cancelled_at_its_deadline_and_only_then(
        autojump_clock: trio.testing.MockClock) -> None:
    sweeper = deadlines.sweeper()
    with trio.CancelScope() as early:
        arm = sweeper.arm(trio.current_time() + 10, scope=early)
        await trio.sleep(3)
        sweeper.disarm(arm)
    assert not early.cancel_called
    await trio.sleep(20)
    assert not early.cancel_called  # disarmed: its deadline never fires
    with trio.CancelScope() as late:
        sweeper.arm(trio.current_time() + 10, scope=late)
        await trio.sleep_forever()
    assert late.cancelled_caught
    assert not sweeper._armed


async def test_the_sweeper_sleeps_until_the_earliest_deadline_or_an_earlier_arm(
        pair, autojump_clock: trio.testing.MockClock) -> None:
    a, _ = pair
    with pytest.raises(trio.TooSlowError):
        await rawsock.recv(a, 100, trio.current_time() + 1)
    await trio.sleep(1)
    sweeper = deadlines.sweeper()
    assert sweeper._next == float("inf")  # nothing armed: it waits to be woken
    with trio.CancelScope() as far:
        sweeper.arm(trio.current_time() + 100, scope=far)
        start = trio.current_time()
        with pytest.raises(trio.TooSlowError):  # an earlier deadline is not left waiting
            await rawsock.recv(a, 100, start + 2)
        assert trio.current_time() - start <= 2 + deadlines.SWEEP_SECONDS * 2
        assert not far.cancel_called
        await trio.sleep_forever()
    assert far.cancelled_caught


async def test_a_deadline_armed_by_what_fires_fires_in_its_turn(
        autojump_clock: trio.testing.MockClock) -> None:
    """A periodic callback that arms its next turn from inside its own firing (the
    keep-alive lane's tick) is not lost: `arm` cannot wake a sweep that is running, so
    the sweep itself counts what was armed meanwhile."""
    sweeper = deadlines.sweeper()
    fired: list[float] = []

    class Tick:
        def fire(self, side: int) -> None:
            fired.append(trio.current_time())
            if len(fired) < 5:
                sweeper.arm(trio.current_time() + 1.0, watch=self)

    start = trio.current_time()
    sweeper.arm(start + 1.0, watch=Tick())
    await trio.sleep(10)
    assert len(fired) == 5
    for turn, at in enumerate(fired, 1):
        assert start + turn <= at <= start + turn * (1 + deadlines.SWEEP_SECONDS * 2)
