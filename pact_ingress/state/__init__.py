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
tunnel        `LocalRegistry`: this        `RedisRegistry`: a key per (tenant, instance)
registry      process's own tunnels        and per instance, TTL refreshed by heartbeat
=============  ===========================  ===============================================

A backend also has `run` (a task in the ingress's root nursery: connections and health
checks; the local backend has nothing to do) and `status` (the `/status` section).

`local` is exactly what a single instance always did and needs nothing installed; the
Redis client library is imported only when the redis backend is configured.
"""

from __future__ import annotations

from typing import Any, Protocol

import trio

from pact_ingress.model import State
from pact_ingress.state.limiter import Limiter, LocalLimiter
from pact_ingress.state.registry import LocalRegistry, Registry
from pact_ingress.stats import Stats

__all__ = ["Limiter", "LocalLimiter", "LocalState", "StateBackend", "open_state"]


class StateBackend(Protocol):
    limiter: Limiter
    registry: Registry

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None: ...

    def status(self) -> dict[str, Any]: ...


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


def open_state(settings: State, stats: Stats) -> StateBackend:
    """The backend the config names, built once at start."""
    if settings.backend == "redis":
        from pact_ingress.state.redis import RedisState

        assert settings.redis is not None
        return RedisState(settings.redis, stats)
    stats.state_shared.set(0)
    return LocalState()
