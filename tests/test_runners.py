"""Handler tasks kept for the next connection (`net/runners.py`): the router serves one
connection after another in the same few tasks, bounded, and a drain or a cancellation
ends the parked ones. The router cases run real TLS over loopback through the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
import trio.lowlevel

from pact_ingress.net import runners as runners_mod
from pact_ingress.net.runners import Runners
from tests.netutil import TEST_TIMEOUT
from tests.test_router_terminate import _Both, _echo_once, _served, _settled
from tests.tls_helpers import WebPKI


async def test_sequential_handlers_reuse_one_task() -> None:
    seen: list[object] = []

    async def handler(n: int) -> None:
        seen.append((n, trio.lowlevel.current_task()))
        await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        runners = Runners(nursery)
        for n in range(20):
            runners.start(handler, n)
            with trio.fail_after(TEST_TIMEOUT):
                while len(seen) <= n or runners.idle == 0:
                    await trio.lowlevel.checkpoint()
        assert [n for n, _ in seen] == list(range(20))
        assert len({id(task) for _, task in seen}) == 1
        assert len(nursery.child_tasks) == 1
        runners.close()
    assert runners.idle == 0


async def test_concurrent_handlers_get_tasks_of_their_own_and_park_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runners_mod, "MAX_IDLE", 3)
    release = trio.Event()
    running: set[object] = set()

    async def handler() -> None:
        running.add(trio.lowlevel.current_task())
        await release.wait()

    async with trio.open_nursery() as nursery:
        runners = Runners(nursery)
        for _ in range(5):
            runners.start(handler)
        with trio.fail_after(TEST_TIMEOUT):
            while len(running) < 5:
                await trio.lowlevel.checkpoint()
        assert len(nursery.child_tasks) == 5  # none waited for another
        release.set()
        with trio.fail_after(TEST_TIMEOUT):
            while len(nursery.child_tasks) > 3:
                await trio.lowlevel.checkpoint()
        assert runners.idle == 3  # the rest ended
        before = set(nursery.child_tasks)
        running.clear()
        for _ in range(3):
            runners.start(handler)  # release is set: each returns at once
        with trio.fail_after(TEST_TIMEOUT):
            while len(running) < 3 or runners.idle < 3:
                await trio.lowlevel.checkpoint()
        assert running <= before and set(nursery.child_tasks) == before
        runners.close()


async def test_a_parked_task_that_is_cancelled_leaves_the_idle_set() -> None:
    async def handler() -> None:
        await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        runners = Runners(nursery)
        runners.start(handler)
        runners.start(handler)
        with trio.fail_after(TEST_TIMEOUT):
            while runners.idle < 2:
                await trio.lowlevel.checkpoint()
        nursery.cancel_scope.cancel()
    assert runners.idle == 0
    assert not nursery.child_tasks


async def test_an_error_in_a_handler_still_reaches_the_nursery() -> None:
    async def handler() -> None:
        raise RuntimeError("boom")

    with pytest.raises(BaseExceptionGroup) as caught:
        async with trio.open_nursery() as nursery:
            Runners(nursery).start(handler)
    assert caught.group_contains(RuntimeError, match="boom")


async def test_the_router_serves_connections_in_reused_tasks_and_drains_promptly(
        tmp_path: Path) -> None:
    """Through the real engine: sequential terminate connections all reach the
    terminator, the router's handler nursery holds one parked task between them (not
    one per connection), and a drain whose deadline is far away ends `serve` as soon as
    the connections are done: parked tasks do not hold it open."""
    pki = WebPKI()
    terminator = _Both()
    async with trio.open_nursery() as outer:
        router, port = await _served(outer, tmp_path, terminator, pki)
        client = pki.client_context(alpn=("http/1.1",))
        for n in range(6):
            payload = f"conn {n}".encode()
            assert await trio.to_thread.run_sync(_echo_once, port, client, payload) == payload
            await _settled(router)
            with trio.fail_after(TEST_TIMEOUT):
                while router._runners.idle == 0:
                    await trio.sleep(0.005)
            assert router._handlers is not None
            # the engine's task and one parked handler task
            assert len(router._handlers.child_tasks) == 2
        assert len(terminator.seen) == 6
        with trio.fail_after(TEST_TIMEOUT):  # the drain deadline is an hour away
            await router.drain(3600)
            while outer.child_tasks:
                await trio.sleep(0.01)
    assert router._runners.idle == 0


async def test_a_parked_task_keeps_nothing_of_the_connection_it_served() -> None:
    """What a handler was given (a connection's socket, its ClientHello bytes, its route)
    is let go once it returns: a parked task does not hold the last connection's
    objects until the next one comes (up to `MAX_IDLE` of them, after a burst)."""
    import gc
    import weakref

    class Thing:
        pass

    done = trio.Event()

    async def handler(thing: Thing) -> None:
        await trio.lowlevel.checkpoint()
        done.set()

    async with trio.open_nursery() as nursery:
        runners = Runners(nursery)
        thing = Thing()
        ref = weakref.ref(thing)
        runners.start(handler, thing)
        del thing
        with trio.fail_after(TEST_TIMEOUT):
            await done.wait()
            while runners.idle == 0:
                await trio.lowlevel.checkpoint()
        gc.collect()
        assert ref() is None, "the parked task still holds its last connection's objects"
        runners.close()
