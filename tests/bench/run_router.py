"""The passthrough router alone, as a process: for benching before `serve` can start.

`pact-ingress serve` wires every component (terminate, tunnels, ACME); while some of
them are not in the tree yet it cannot start, but passthrough only needs the router.
This runs exactly what `serve` runs on the passthrough path — the same config loader,
`Router`, `open_listeners`, `Backends` and JSON log setup — and nothing else, so its
numbers are the router's. SIGTERM/SIGINT drain like `serve` does.

    python -m tests.bench.run_router -c CONFIG [--log-format json|text] [--profile OUT]

`--profile OUT` runs the router under cProfile and writes pstats data to OUT when it
stops (SIGTERM): `python -m pstats OUT` then `sort tottime`, `stats 30`.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import trio

from pact_ingress.config import Config, load_config
from pact_ingress.logs import setup as setup_logs
from pact_ingress.net.backends import Backends
from pact_ingress.net.router import Router, open_listeners
from pact_ingress.stats import Stats

#: Seconds open connections get after SIGTERM (a bench stops its proxies when idle).
DRAIN_DEADLINE = 2.0


async def serve(config: Config) -> None:
    router = Router(config, stats=Stats(), backends=Backends())
    listeners = await open_listeners([(a.host, a.port) for a in config.listen.tls])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, router)
        await router.serve(listeners)
        nursery.cancel_scope.cancel()


async def _stop_on_signal(router: Router) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            await router.drain(DRAIN_DEADLINE)
            return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", required=True, type=Path)
    p.add_argument("--log-format", choices=("json", "text"), default="json")
    p.add_argument("--profile", type=Path, help="write cProfile stats here on exit")
    args = p.parse_args()
    setup_logs(args.log_format)
    config = load_config(args.config)
    if args.profile is None:
        trio.run(serve, config)
        return
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(trio.run, serve, config)
    finally:
        prof.dump_stats(args.profile)


if __name__ == "__main__":
    main()
