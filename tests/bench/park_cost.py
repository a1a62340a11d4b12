"""CPU of one trio task switch: a task parked at the bottom of an await chain and
rescheduled by another task, against a plain call chain of the same depth.

What a request engine driven by callbacks (no task parked per wait) could save at most
per wait. Pinned to one core; every figure is process CPU time over a bounded count.

    python -m tests.bench.park_cost [--depth 15] [--count 200000]
"""

from __future__ import annotations

import argparse
import os
import time

import trio


def _trio_round_trips(depth: int, count: int) -> float:
    """µs of CPU per round trip: the sleeper parks, the waker reschedules it and
    passes a checkpoint (two task switches)."""
    parked: list[trio.lowlevel.Task] = []

    async def bottom() -> None:
        parked.append(trio.lowlevel.current_task())
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.SUCCEEDED)

    async def chain(d: int) -> None:
        if d == 0:
            await bottom()
        else:
            await chain(d - 1)

    async def sleeper() -> None:
        for _ in range(count):
            await chain(depth)

    async def waker() -> None:
        for _ in range(count):
            while not parked:
                await trio.lowlevel.cancel_shielded_checkpoint()
            trio.lowlevel.reschedule(parked.pop())
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def main() -> float:
        start = time.process_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sleeper)
            nursery.start_soon(waker)
        return time.process_time() - start

    return trio.run(main) / count * 1e6


def _plain_calls(depth: int, count: int) -> float:
    def f(d: int) -> int:
        return 0 if d == 0 else f(d - 1)

    start = time.process_time()
    for _ in range(count):
        f(depth)
    return (time.process_time() - start) / count * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=15)
    parser.add_argument("--count", type=int, default=200_000)
    args = parser.parse_args()
    os.sched_setaffinity(0, {0})
    for depth in (0, args.depth):
        trip = _trio_round_trips(depth, args.count)
        plain = _plain_calls(depth, args.count)
        print(f"await chain {depth:2d} deep: {trip:6.2f} µs per park + wake-up round trip "
              f"(two task switches), {trip / 2:6.2f} per switch; a plain call chain "
              f"{plain:5.2f} µs")


if __name__ == "__main__":
    main()
