"""The passthrough router alone, as a process: for benching before `serve` can start.

`pact-ingress serve` wires every component (terminate, tunnels, ACME); while some of
them are not in the tree yet it cannot start, but passthrough only needs the router.
This runs exactly what `serve` runs on the passthrough path — the same config loader,
`Router`, `open_listeners`, `Backends` and JSON log setup — and nothing else, so its
numbers are the router's. SIGTERM/SIGINT drain like `serve` does.

    python -m tests.bench.run_router -c CONFIG [--log-format json|text] [--profile OUT]
                                     [--tunnel]

`--tunnel` also runs a `TunnelServer` the way `serve` wires it (identity from the
config's `identity.key`, created if missing; connectors dial `tunnel.hostname`; routes
with `backend: tunnel` open streams through it), for the tunnel bench. Without it the
runner is passthrough-only, as before.

`--profile OUT` runs the router under cProfile and writes pstats data to OUT when it
stops (SIGTERM): `python -m pstats OUT` then `sort tottime`, `stats 30`.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import trio

from pact_ingress.config import Config, load_config
from pact_ingress.identity import load_identity
from pact_ingress.logs import setup as setup_logs
from pact_ingress.net.backends import Backends
from pact_ingress.net.router import Router, open_listeners
from pact_ingress.net.tunnel.server import TunnelServer
from pact_ingress.stats import Stats

#: Seconds open connections get after SIGTERM (a bench stops its proxies when idle).
DRAIN_DEADLINE = 2.0


async def serve(config: Config, tunnel: bool = False) -> None:
    stats = Stats()
    tunnels = make_tunnel_server(config, stats) if tunnel else None
    router = Router(config, stats=stats, backends=Backends(tunnels=tunnels), tunnels=tunnels)
    listeners = await open_listeners([(a.host, a.port) for a in config.listen.tls])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, router, tunnels)
        await router.serve(listeners)
        nursery.cancel_scope.cancel()


def make_tunnel_server(config: Config, stats: Stats) -> TunnelServer:
    """The tunnel server as `serve` builds it: the ingress identity, the config's pins."""
    if config.tunnel_hostname is None:
        raise SystemExit("--tunnel needs `tunnel: {hostname: …}` in the config")
    tunnels = TunnelServer(identity=load_identity(config.identity_key, create=True),
                           stats=stats)
    tunnels.update(config)
    return tunnels


async def _stop_on_signal(router: Router, tunnels: TunnelServer | None) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            if tunnels is not None:  # as `serve` does: GOAWAY to connectors first
                await tunnels.aclose()
            await router.drain(DRAIN_DEADLINE)
            return


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("-c", "--config", required=True, type=Path)
    p.add_argument("--log-format", choices=("json", "text"), default="json")
    p.add_argument("--profile", type=Path, help="write cProfile stats here on exit")
    p.add_argument("--tunnel", action="store_true",
                   help="also run the tunnel server (needs tunnel.hostname in the config)")
    args = p.parse_args()
    setup_logs(args.log_format)
    config = load_config(args.config)
    if args.profile is None:
        trio.run(serve, config, args.tunnel)
        return
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(trio.run, serve, config, args.tunnel)
    finally:
        prof.dump_stats(args.profile)


if __name__ == "__main__":
    main()
