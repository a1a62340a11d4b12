"""State several ingress instances must agree on, behind one interface per kind.

Theory of operation
-------------------
`state.backend` in the config is read once, at start, by `open_state`, which returns a
backend object holding one implementation per kind of shared state. Components are
handed those objects when they are built and never ask which backend is running: there
is no "if redis" in the data path, and a kind of state added later (certificates, the
tunnel registry) is one more attribute here.

=============  ===========================  ===============================================
kind           local (default)              redis
=============  ===========================  ===============================================
rate limits    `LocalLimiter`: buckets in   `RedisLimiter`: the same buckets in Redis, one
               this process                 atomic script per decision; falls back to a
                                            `LocalLimiter` while Redis is unreachable/slow
ACME           `acme.store.Store`: files    `state.acme.RedisAcmeStore`: account, certs
               under `state_dir`            (keys sealed), one order lease per name,
                                            challenge answers; files stay as its cache
relay queue    `SqliteStore`: one SQLite    `RedisRelayStore`: the same queue in Redis, one
               file under state_dir         script per operation; `unavailable` while
                                            Redis is unreachable/slow
tunnel         `LocalRegistry`: this        `RedisRegistry`: a key per (tenant, instance)
registry       process's own tunnels        and per instance, TTL refreshed by heartbeat
=============  ===========================  ===============================================

A backend also has `run` (a task in the ingress's root nursery: connections and health
checks; the local backend has nothing to do) and `status` (the `/status` section).

`local` is exactly what a single instance always did and needs nothing installed; the
Redis client library is imported only when the redis backend is configured.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import trio

from pact_ingress.model import State
from pact_ingress.state.limiter import Limiter, LocalLimiter
from pact_ingress.state.registry import LocalRegistry, Registry
from pact_ingress.stats import Stats

if TYPE_CHECKING:
    from pact_ingress.model import Relay
    from pact_ingress.relay.store import RelayStore
    from pact_ingress.state.acme import AcmeStore

__all__ = ["Limiter", "LocalLimiter", "LocalState", "StateBackend", "open_state"]


class StateBackend(Protocol):
    limiter: Limiter
    registry: Registry

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None: ...

    def status(self) -> dict[str, Any]: ...

    def acme_store(self, state_dir: Path) -> AcmeStore: ...
    def relay_store(self, relay: Relay, stats: Stats, clock: Callable[[], float]
                    ) -> RelayStore: ...


class LocalState:
    """Everything in this process: one instance, nothing to connect to."""

    def __init__(self) -> None:
        self.limiter = LocalLimiter()
        self.registry = LocalRegistry()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        task_status.started()

    def status(self) -> dict[str, Any]:
        return {"backend": "local", "mode": "local", "since": None, "last_error": None}

    def acme_store(self, state_dir: Path) -> AcmeStore:
        from pact_ingress.acme.store import Store

        return Store(state_dir)
    def relay_store(self, relay: Relay, stats: Stats, clock: Callable[[], float]
                    ) -> RelayStore:
        from pact_ingress.relay.store import SqliteStore

        return SqliteStore(relay.store, max_items=relay.max_items, max_bytes=relay.max_bytes,
                           stats=stats, clock=clock)


def open_state(settings: State, stats: Stats) -> StateBackend:
    """The backend the config names, built once at start."""
    if settings.backend == "redis":
        from pact_ingress.state.redis import RedisState

        assert settings.redis is not None
        return RedisState(settings.redis, stats)
    stats.state_shared.set(0)
    return LocalState()
