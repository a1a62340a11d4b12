"""In-process counters, kept in one place so the admin endpoint only exposes them.

Every component that counts something is handed the one `Stats` of its process (the
ingress or the connector builds it and passes it down) and touches these metric objects;
nothing else keeps its own tallies. The metrics live in a private
`CollectorRegistry` per `Stats` so tests can run several ingresses in one process without
their numbers mixing. `recent_refusals` keeps a short, bounded history for the status page.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

#: How many recent refusals the status page shows; a bounded deque, oldest dropped.
RECENT_REFUSALS = 50
#: Buckets for state backend round trips: a Redis call on the same network takes well
#: under a millisecond, and the decision deadline is tens of milliseconds.
STATE_SECONDS_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)


@dataclass(frozen=True)
class Refusal:
    at: float  # wall-clock seconds, for display only
    route: str
    client_ip: str
    reason: str


class _BeforeCollect:
    """Registered first: runs the syncs whenever the registry is collected, so counts a
    hot path keeps as plain numbers are in the families before anything reads them."""

    def __init__(self, syncs: list[Callable[[], None]]) -> None:
        self.syncs = syncs

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> list[Metric]:
        for sync in list(self.syncs):
            sync()
        return []


class Stats:
    """All metric families of one ingress (or connector) instance."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._syncs: list[Callable[[], None]] = []
        r.register(_BeforeCollect(self._syncs))  # type: ignore[arg-type]
        p = "pact_ingress_"
        self.connections = Counter(
            p + "connections", "Closed passthrough connections by route, mode and outcome",
            ["route", "mode", "outcome"], registry=r)
        self.open_connections = Gauge(
            p + "open_connections", "Client connections currently open", registry=r)
        self.splice_pipes_free = Gauge(
            p + "splice_pipes_free", "Drained splice pipes kept for reuse (two fds each)",
            registry=r)
        self.bytes = Counter(
            p + "bytes", "Bytes relayed by route and direction (up = client to backend)",
            ["route", "direction"], registry=r)
        self.rejections = Counter(
            p + "rejections", "Connections refused before routing, by reason",
            ["reason"], registry=r)
        self.requests = Counter(
            p + "http_requests", "Terminated HTTP requests by route and status code",
            ["route", "status"], registry=r)
        self.refusals = Counter(
            p + "refusals", "Requests refused at the edge by route and PACT code",
            ["route", "code"], registry=r)
        self.h2_floods = Counter(
            p + "h2_floods", "HTTP/2 connections closed for flooding, by frame kind",
            ["route", "kind"], registry=r)
        self.lane = Counter(
            p + "terminate_lane",
            "HTTP/1.1 exchanges the keep-alive lane served whole (outcome=served), those "
            "that waited for a new node connection first (outcome=connect), and "
            "connections it handed to the trio engine, by where (outcome=start, answer, "
            "forward, relay, h2, linger); HTTP/2 streams it served whole (h2_served), "
            "those reset or cut off while at the node (h2_abort), and those a stream "
            "worker took up, by where (h2_answer, h2_forward, h2_relay, h2_write)",
            ["outcome"], registry=r)
        self.upstream_seconds = Histogram(
            p + "upstream_response_seconds", "Time to upstream response headers",
            ["route"], registry=r)
        self.tunnels = Gauge(
            p + "tunnels", "Live tunnel connections per tenant", ["tenant"], registry=r)
        self.tunnel_streams = Gauge(
            p + "tunnel_streams", "Streams open through tunnels", ["tenant"], registry=r)
        self.tunnel_events = Counter(
            p + "tunnel_events", "Tunnel connects, disconnects and refusals by reason",
            ["tenant", "event"], registry=r)
        self.forwards = Counter(
            p + "forwards", "Connections forwarded between instances, by side (out: to the "
            "holder of a tunnel; in: from a peer) and outcome", ["side", "outcome"], registry=r)
        self.cert_expiry = Gauge(
            p + "certificate_expiry_timestamp_seconds", "Not-after of the served cert",
            ["host"], registry=r)
        self.cert_failures = Counter(
            p + "certificate_failures", "Certificate order failures by host and reason",
            ["host", "reason"], registry=r)
        self.reloads = Counter(
            p + "config_reloads", "Config reloads by result", ["result"], registry=r)
        self.state_shared = Gauge(
            p + "state_shared", "1 while shared state (Redis) answers, 0 while this instance "
            "decides alone (local backend, or fallback)", registry=r)
        self.state_fallbacks = Counter(
            p + "state_fallbacks", "Times the shared state backend was lost and this "
            "instance fell back to its own counts", registry=r)
        self.state_seconds = Histogram(
            p + "state_backend_seconds", "State backend round trips by operation",
            ["op"], buckets=STATE_SECONDS_BUCKETS, registry=r)
        self.rate_decisions = Counter(
            p + "rate_limit_decisions", "Rate-limit decisions of the shared limiter "
            "by where they were made (shared: Redis, fallback: this process alone)",
            ["where"], registry=r)
        self.relay_queued_items = Gauge(
            p + "relay_queued_items", "Relay items waiting per recipient", ["recipient"],
            registry=r)
        self.relay_queued_bytes = Gauge(
            p + "relay_queued_bytes", "Relay envelope bytes waiting per recipient",
            ["recipient"], registry=r)
        self.relay_enqueues = Counter(
            p + "relay_enqueues", "relay_calls queued (duplicate: answered from the store)",
            ["outcome"], registry=r)
        self.relay_fetched = Counter(
            p + "relay_fetched_items", "Items handed out by fetch_queued", registry=r)
        self.relay_acks = Counter(
            p + "relay_acked_items", "Items deleted by ack", registry=r)
        self.relay_expiries = Counter(
            p + "relay_expired_items", "Unacked items purged at expiry", registry=r)
        self.relay_refusals = Counter(
            p + "relay_refusals", "Relay requests refused, by PACT code", ["code"], registry=r)
        self.relay_fsync_seconds = Histogram(
            p + "relay_commit_seconds", "Relay store COMMIT (fsync) latency", registry=r,
            buckets=(.0005, .001, .002, .005, .01, .02, .05, .1, .25, .5, 1, 2.5))
        self.relay_wakes = Counter(
            p + "relay_wakes", "Wake requests for recipients with a live tunnel", registry=r)
        self.worker_up = Gauge(
            p + "worker_up", "1 while the worker process takes connections (serve "
            "--workers)", ["worker"], registry=r)
        self.worker_restarts = Counter(
            p + "worker_restarts", "Worker processes that exited unexpectedly and were "
            "replaced", ["worker"], registry=r)
        self.worker_open_connections = Gauge(
            p + "worker_open_connections", "Connections handed to the worker and not "
            "yet closed", ["worker"], registry=r)
        self.worker_handoffs = Counter(
            p + "worker_handoffs", "Terminate connections by where they were served "
            "(worker: handed over; main: no worker ready, served by main)", ["served_by"],
            registry=r)
        self.recent_refusals: collections.deque[Refusal] = collections.deque(
            maxlen=RECENT_REFUSALS)

    def before_collect(self, sync: Callable[[], None]) -> None:
        """Call `sync` before every collection of the registry (`/metrics`, status,
        `value`): a hot path that counts in plain numbers moves them into the families
        there (and itself whenever it holds many)."""
        self._syncs.append(sync)

    def refused(self, route: str, client_ip: str, reason: str) -> None:
        """Record a refusal for the status page (counters are incremented by the caller)."""
        self.recent_refusals.append(Refusal(time.time(), route, client_ip, reason))

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of one sample (tests and the status page); 0 when absent."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v
