"""The `/status` document: its JSON Schema and helpers to build the parts we own.

`GET /status` returns whatever the app's `status()` callable assembles; this schema is the
contract between that callable, the status page, `pact-ingress status` and any outside
monitoring. Tests validate a real response against it (jsonschema, draft 2020-12).

Shape, in words:

- `version` (package version), `uptime_s` (seconds since start), `config` (config path)
- `routes`: one per configured route: `host`, `tenant`, `mode` (passthrough|terminate),
  `backend` ("tunnel" or "host:port"), `seal` (terminate routes; null for passthrough)
- `tenants`: `name`, `pins` (sha256:… fingerprints), `tunnels_up` (live connections)
- `tunnels`: one per tenant that has tunnel routes: `tenant`, `state` (up|down),
  `connections`, `streams`, `peer` (remote address of one live connection or null),
  `since` (ISO 8601 UTC of the oldest live connection or null)
- `certs`: one per terminate host: `host`, `issuer`, `not_after`, `next_renewal`
  (ISO 8601 UTC or null when unknown/not yet issued), `last_error` (text or null)
- `counters`: flat `{name: number}`; `counters_from(stats)` fills it from the registry
- `recent_refusals`: newest last: `at` (unix seconds), `route`, `client_ip`, `reason`
- `state`: where shared state lives: `backend` (local|redis), `mode` (local: one
  instance; shared: Redis answers; fallback: Redis lost, this instance counts alone),
  `since` (unix seconds of the last switch, null for local), `last_error` (text or null)
- `cluster`: the tunnel registry: `registry` (local|redis), `stale` (no fresh view of
  Redis), `members` (`fingerprint`, `address`, `last_heartbeat` in unix seconds, `self`)
  and `holders` (tenant → fingerprints of the instances holding its tunnel)
- `workers` (only with `serve --workers N`, N ≥ 2): one per worker process: `index`,
  `pid`, `state` (starting|ready|draining|exited|respawning), `started` (unix seconds
  of the current process's spawn), `restarts` (unexpected exits replaced),
  `open_connections` (handed to it, not yet closed), `requests` (HTTP requests it
  answered). With workers, `counters` and `recent_refusals` cover every process.

Times are ISO 8601 strings where people read them (certificates) and unix seconds where
they come from the event log (refusals), so neither side has to guess a timezone.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from pact_ingress.model import Config
from pact_ingress.stats import Stats

_STR = {"type": "string"}
_STR_OR_NULL = {"type": ["string", "null"]}
_COUNT = {"type": "integer", "minimum": 0}


def _obj(required: dict[str, Any], optional: dict[str, Any] | None = None) -> dict[str, Any]:
    """An object schema with exactly these properties (extra keys are a contract change)."""
    return {
        "type": "object",
        "properties": {**required, **(optional or {})},
        "required": sorted(required),
        "additionalProperties": False,
    }


def _list(item: dict[str, Any]) -> dict[str, Any]:
    return {"type": "array", "items": item}


ROUTE_SCHEMA = _obj(
    {"host": _STR, "tenant": _STR, "mode": {"enum": ["passthrough", "terminate"]},
     "backend": _STR},
    {"seal": {"enum": ["required", "optional", None]}},
)
TENANT_SCHEMA = _obj({"name": _STR, "pins": _list(_STR), "tunnels_up": _COUNT})
TUNNEL_SCHEMA = _obj(
    {"tenant": _STR, "state": {"enum": ["up", "down"]}, "connections": _COUNT},
    {"streams": _COUNT, "peer": _STR_OR_NULL, "since": _STR_OR_NULL},
)
CERT_SCHEMA = _obj(
    {"host": _STR, "issuer": _STR_OR_NULL, "not_after": _STR_OR_NULL,
     "next_renewal": _STR_OR_NULL, "last_error": _STR_OR_NULL},
)
RELAY_QUEUE_SCHEMA = _obj(
    {"recipient": _STR, "tenant": _STR_OR_NULL, "items": _COUNT, "bytes": _COUNT})
RELAY_SCHEMA = _obj(
    {"host": _STR, "store": _STR, "healthy": {"type": "boolean"},
     "queues": _list(RELAY_QUEUE_SCHEMA)},
    {"last_error": _STR_OR_NULL, "persistence_warning": _STR_OR_NULL},
)
REFUSAL_SCHEMA = _obj(
    {"at": {"type": "number"}, "route": _STR, "client_ip": _STR, "reason": _STR})
STATE_SCHEMA = _obj(
    {"backend": {"enum": ["local", "redis"]},
     "mode": {"enum": ["local", "shared", "fallback"]},
     "since": {"type": ["number", "null"]}, "last_error": _STR_OR_NULL},
)
CLUSTER_MEMBER_SCHEMA = _obj(
    {"fingerprint": _STR, "address": _STR_OR_NULL,
     "last_heartbeat": {"type": ["number", "null"]}, "self": {"type": "boolean"}})
WORKER_SCHEMA = _obj(
    {"index": _COUNT, "pid": {"type": ["integer", "null"]},
     "state": {"enum": ["starting", "ready", "draining", "exited", "respawning"]},
     "started": {"type": ["number", "null"]}, "restarts": _COUNT,
     "open_connections": _COUNT, "requests": _COUNT},
    {"state_mode": {"enum": ["shared", "fallback"]}})
CLUSTER_SCHEMA = _obj(
    {"registry": {"enum": ["local", "redis"]}, "stale": {"type": "boolean"},
     "members": _list(CLUSTER_MEMBER_SCHEMA),
     "holders": {"type": "object", "additionalProperties": _list(_STR)}})

#: JSON Schema (draft 2020-12) of the `GET /status` document.
STATUS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "pact-ingress status",
    **_obj({
        "version": _STR,
        "uptime_s": {"type": "number", "minimum": 0},
        "config": _STR,
        "routes": _list(ROUTE_SCHEMA),
        "tenants": _list(TENANT_SCHEMA),
        "tunnels": _list(TUNNEL_SCHEMA),
        "certs": _list(CERT_SCHEMA),
        "counters": {"type": "object", "additionalProperties": {"type": "number"}},
        "recent_refusals": _list(REFUSAL_SCHEMA),
    }, {"identity": _STR, "state": STATE_SCHEMA, "cluster": CLUSTER_SCHEMA,
        "relay": RELAY_SCHEMA, "workers": _list(WORKER_SCHEMA)}),
}


def iso(ts: float | datetime | None) -> str | None:
    """ISO 8601 UTC with a 'Z', seconds precision; None stays None."""
    if ts is None:
        return None
    dt = ts if isinstance(ts, datetime) else datetime.fromtimestamp(ts, UTC)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def routes_from(config: Config) -> list[dict[str, Any]]:
    """The `routes` section from a loaded config."""
    return [
        {"host": r.host, "tenant": r.tenant, "mode": r.mode, "backend": str(r.backend),
         "seal": r.seal if r.mode == "terminate" else None}
        for r in config.routes()
    ]


def tenants_from(config: Config, tunnels_up: dict[str, int]) -> list[dict[str, Any]]:
    """The `tenants` section; `tunnels_up` maps tenant name → live tunnel connections."""
    return [
        {"name": t.name, "pins": list(t.pins), "tunnels_up": tunnels_up.get(t.name, 0)}
        for t in config.tenants
    ]


def counters_from(stats: Stats) -> dict[str, float]:
    """Flat totals per metric family of one process (see `counters_from_families`)."""
    return counters_from_families(stats.registry.collect())


def counters_from_families(families: Iterable[Any]) -> dict[str, float]:
    """Flat totals per metric family (labels summed), without the common name prefix.

    Counters appear as `<name>_total`, gauges as `<name>`, histograms as `<name>_count`;
    the per-label detail stays on /metrics. Timestamp gauges (certificate expiry) are
    left out: a sum of timestamps means nothing, and `certs` carries them per host.
    """
    out: dict[str, float] = {}
    for family in families:
        if family.name.endswith("_timestamp_seconds"):
            continue
        wanted = {"counter": family.name + "_total", "gauge": family.name,
                  "histogram": family.name + "_count"}.get(family.type)
        if wanted is None:
            continue
        total = sum(s.value for s in family.samples if s.name == wanted)
        out[wanted.removeprefix("pact_ingress_")] = total
    return out


def refusals_from(stats: Stats) -> list[dict[str, Any]]:
    """The `recent_refusals` section, oldest first, from the bounded in-memory deque."""
    return [
        {"at": r.at, "route": r.route, "client_ip": r.client_ip, "reason": r.reason}
        for r in stats.recent_refusals
    ]
