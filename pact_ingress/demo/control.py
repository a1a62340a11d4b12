"""The demo's control: a tiny loopback HTTP endpoint that takes the home node off line and
back, and receives the connector's "you have mail" hook.

Why an endpoint: the relay story needs the node to go away and come back while the rest
keeps running, caused by a command typed in another terminal. Plain HTTP on loopback
(`--port` + 3) is the simplest thing `curl` reaches, and an HTTP answer can wait until the
change has happened, so the next printed command never races it:

* ``POST /offline`` — stop the connector (it drains as `connect` does on SIGTERM); the
  answer comes once the ingress has no live tunnel for the demo tenant, so a direct call
  to the node now gets 503;
* ``POST /online`` — start the connector; the answer comes once its tunnel is up and, when
  the relay holds mail for the node, once the node was woken and ran its mail run (the
  answer shows what that run fetched, opened and acked);
* ``POST /mail`` — the connector's ``on_mail`` URL: the node's mail run — `fetch_queued`
  with the node's key until ``more`` is false, each envelope opened and delivered to the
  demo node (recorded with ``via: relay``), then ``ack``;
* ``GET /`` — whether the connector runs, and every mail run so far.

Waking a node that comes back: the ingress sends WAKE when an item is queued while the
node's tunnel is up; mail queued while it was away makes no wake by itself (a node that
comes back is expected to fetch once). On ``/online`` the demo asks the ingress for one
wake when the relay holds mail for the node — through the call the relay itself makes
for new mail — so the real path runs: WAKE frame → connector → on_mail hook → ``/mail``.

Nothing here is product code: it holds the in-process `Ingress` only to read tunnel state
and the queue depth, and to ask for that wake.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.app_wrappers import ASGIWrapper
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio.tcp_server import TCPServer
from hypercorn.trio.worker_context import WorkerContext
from hypercorn.typing import ConnectionState

from pact_ingress.demo.node import DemoNode, demo_hypercorn_config
from pact_ingress.demo.wire import fetch_open_ack
from pact_ingress.identity import Identity
from pact_ingress.logs import log
from pact_ingress.model import ConnectorConfig
from pact_ingress.net.tunnel.connector import run_connector

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

#: How long a tunnel may take to come up or go away before the control answers 504.
TUNNEL_WAIT = 15.0
#: How long /online waits for the woken node's mail run (the hook runs ≤ 1/s).
MAIL_WAIT = 15.0
#: Request bodies are ignored; this much is read before the connection is dropped.
MAX_BODY = 64 * 1024


class DemoControl:
    """Owns the demo connector's lifecycle and the node's relay mail runs."""

    def __init__(self, *, ingress: Any, connector: ConnectorConfig, node: DemoNode,
                 node_id: Identity, tenant: str, port: int, relay_host: str,
                 grace: float) -> None:
        self.ingress, self.connector, self.node = ingress, connector, node
        self.node_id, self.tenant = node_id, tenant
        self.port, self.relay_host, self.grace = port, relay_host, grace
        self.mail_runs: list[list[dict[str, Any]]] = []
        self._mail_ran = trio.Event()
        self._mail_lock = trio.Lock()
        self._switch_lock = trio.Lock()
        self._nursery: trio.Nursery | None = None
        #: The running connector: its shutdown event, its cancel scope, set when it ended.
        self._running: tuple[trio.Event, trio.CancelScope, trio.Event] | None = None

    # --- the connector -------------------------------------------------------------------

    async def start_connector(self, nursery: trio.Nursery) -> None:
        """Start the connector in `nursery`; wait until the ingress sees all its control
        connections (what the printed status command then shows)."""
        self._nursery = nursery
        stop, scope, done = trio.Event(), trio.CancelScope(), trio.Event()

        async def connector_task(task_status: trio.TaskStatus[object]) -> None:
            try:
                with scope:
                    await run_connector(self.connector, shutdown=stop, grace=self.grace,
                                        task_status=task_status)
            finally:
                done.set()

        await nursery.start(connector_task)
        self._running = (stop, scope, done)
        with trio.fail_after(TUNNEL_WAIT):
            while self.ingress.tunnels.live_tunnels(self.tenant) < self.connector.connections:
                await trio.sleep(0.05)

    async def stop_connector(self) -> None:
        """Drain the connector (cancel it if the drain overruns); wait for its tunnel to go."""
        if self._running is None:
            return
        stop, scope, done = self._running
        self._running = None
        stop.set()
        with trio.move_on_after(self.grace + 1):
            await done.wait()
        scope.cancel()
        await done.wait()
        with trio.fail_after(TUNNEL_WAIT):
            while self.ingress.tunnels.live_tunnels(self.tenant):
                await trio.sleep(0.05)

    # --- the endpoints -------------------------------------------------------------------

    async def offline(self) -> dict[str, Any]:
        async with self._switch_lock:
            await self.stop_connector()
        log.info("demo_node_offline")
        return {"connector": "stopped", "tunnels": self.ingress.tunnels.live_tunnels(self.tenant)}

    async def online(self) -> dict[str, Any]:
        queued = self._queued()
        runs_before = len(self.mail_runs)  # before the tunnel is up: the wake may be quick
        async with self._switch_lock:
            if self._running is None:
                assert self._nursery is not None
                await self.start_connector(self._nursery)
        answer: dict[str, Any] = {"connector": "running",
                                  "tunnels": self.ingress.tunnels.live_tunnels(self.tenant),
                                  "relay_queued": queued, "woken": False}
        if queued:
            # the ingress wakes a node with waiting mail as its tunnel comes up: wait for
            # the mail run that wake causes, so the next printed command sees its result
            with trio.move_on_after(MAIL_WAIT):
                while len(self.mail_runs) == runs_before:
                    await self._mail_ran.wait()
            answer["woken"] = len(self.mail_runs) > runs_before
            log.info("demo_node_online", relay_queued=queued, woken=answer["woken"])
            answer["mail_run"] = self.mail_runs[runs_before] if answer["woken"] else None
            answer["relay_queued_now"] = self._queued()
        return answer

    async def mail(self) -> dict[str, Any]:
        """The node's mail run (the on_mail hook): fetch, open, deliver, ack."""
        async with self._mail_lock:
            items = await fetch_open_ack(
                self.port, self.relay_host, self.node_id,
                deliver=lambda envelope: self.node.sealed_call(envelope, peer=None,
                                                               relayed=True))
            self.mail_runs.append(items)
            self._mail_ran.set()
            self._mail_ran = trio.Event()
        log.info("demo_mail_run", items=len(items))
        return {"fetched_opened_acked": items}

    def _queued(self) -> int:
        relay = getattr(self.ingress, "relay", None)
        if relay is None:
            return 0
        return int(relay.store.depths().get(self.node_id.fingerprint, (0, 0))[0])

    # --- HTTP ----------------------------------------------------------------------------

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        size = 0
        while True:  # bodies carry nothing we need (the hook's is {"queued": 1})
            message = await receive()
            size += len(message.get("body", b""))
            if message["type"] == "http.disconnect" or size > MAX_BODY or not message.get(
                    "more_body", False):
                break
        method, path = scope["method"], scope["path"]
        routes: dict[tuple[str, str], Callable[[], Awaitable[dict[str, Any]]]] = {
            ("POST", "/offline"): self.offline, ("POST", "/online"): self.online,
            ("POST", "/mail"): self.mail, ("GET", "/"): self.state}
        handler = routes.get((method, path))
        if handler is None:
            status, obj = 404, {"error": "POST /offline, POST /online, POST /mail or GET /"}
        else:
            try:
                status, obj = 200, await handler()
            except trio.TooSlowError:
                status, obj = 504, {"error": "timed out waiting for the tunnel"}
            except (RuntimeError, OSError, ValueError, trio.BrokenResourceError) as exc:
                status, obj = 502, {"error": f"{type(exc).__name__}: {exc}"}
        body = (json.dumps(obj, indent=2) + "\n").encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def state(self) -> dict[str, Any]:
        return {"connector": "running" if self._running is not None else "stopped",
                "tunnels": self.ingress.tunnels.live_tunnels(self.tenant),
                "relay_queued": self._queued(), "mail_runs": self.mail_runs}

    async def serve(self, host: str, port: int, *,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the control endpoint on host:port until cancelled."""
        config: HypercornConfig = demo_hypercorn_config()
        listeners = await trio.open_tcp_listeners(port, host=host)

        async def handler(stream: trio.SocketStream) -> None:
            server = TCPServer(ASGIWrapper(self.app), config, WorkerContext(None),
                               ConnectionState({}), stream)  # type: ignore[arg-type]
            try:
                await server.run()
            finally:
                await trio.aclose_forcefully(stream)

        async with trio.open_nursery() as nursery:
            task_status.started()
            await trio.serve_listeners(handler, listeners, handler_nursery=nursery)
