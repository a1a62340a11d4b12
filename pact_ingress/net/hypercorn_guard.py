"""A guard for hypercorn's HTTP/2 protocol, for the app we serve on hypercorn over HTTP/2
(the demo node; the relay runs on the edge's own engine).

hypercorn 0.18.0 forgets a stream once its response ends and then raises KeyError,
killing the whole connection with every stream on it, when the client's DATA for that
stream still arrives — which is what happens whenever an app answers before reading the
body. ProtocolWrapper looks its H2 class up in `hypercorn.protocol` at connection time;
swapping it there is the only hook it offers (hence hypercorn is pinned).
"""

from __future__ import annotations

import h2.events
import hypercorn.protocol
from hypercorn.protocol.h2 import H2Protocol


class _GuardedH2Protocol(H2Protocol):
    """hypercorn's H2Protocol, minus a crash: DATA for a stream whose response is done.

    hypercorn 0.18.0 forgets a stream once its response ends and then raises KeyError
    (killing the whole connection, every stream on it) when the client's DATA for that
    stream still arrives — which is exactly what happens when we answer 413/421/refusals
    before reading the body. Such DATA is acknowledged (so the connection's flow-control
    window is not leaked) and dropped. Events are judged one at a time, in order: DATA
    that arrived in the same read as its HEADERS finds its stream created by then.
    """

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        for event in events:
            if isinstance(event, h2.events.DataReceived) and event.stream_id not in self.streams:
                self.connection.acknowledge_received_data(
                    event.flow_controlled_length, event.stream_id)
                continue
            await super()._handle_events([event])


def install_h2_guard() -> None:
    """Make hypercorn build `_GuardedH2Protocol` for HTTP/2 connections (idempotent).

    ProtocolWrapper looks the class up in `hypercorn.protocol` at connection time; this
    process-wide swap is the only hook it offers. Safe for any other hypercorn user in
    the process (the demo node): it only removes a crash.
    """
    hypercorn.protocol.H2Protocol = _GuardedH2Protocol  # type: ignore[misc]
