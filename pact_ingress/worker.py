"""A worker process of `pact-ingress serve --workers N`: the terminate engine, fed by main.

Started by main (`net/workers.py`) as `python -m pact_ingress.worker --index I --fd FD`,
where FD is the worker's end of a private SEQPACKET socketpair. Nothing else reaches it:
no listening socket, no admin endpoint, no systemd notification (its environment has
none of that), no certificate orders, no tunnels, no relay store.

What runs here is a reduced ingress: `Terminator` (TLS, HTTP/1.1 and h2, the request
story, the seal posture, the limiter, the upstream pools), its own `Stats`, a `Resolver`
for configured backend addresses, and `WorkerBackends`, which reaches a tunnel-backed
route's node through main (STREAM_OPEN: main splices its tunnel stream onto a socket we
send it, and we run the pinned mTLS to the node over our end as over any tunnel stream).
With a relay in the config it also runs the relay host's engine (`relay.server`: TLS,
HTTP, JSON-RPC, every check and the caller's budget) over `relay.remote.RemoteStore`:
queue operations go to main's one store and are answered from there.

Messages from main (`proto.workers.Kind`):

* CONFIG — a pickled `Config` main accepted: applied as main applies it (routes and
  tenants to the terminator, backend names to the resolver). The first message is one.
* HANDOFF — a client connection (fd) with its `Handoff`: served by the terminator with
  the certificate main named (loaded once per generation), or by the relay engine when
  the handoff says relay; when it ends, its id goes back in a CLOSED message (ids
  batched), which releases main's count of it.
* RELAY_ANSWER — main's outcome of one of our relay store operations (RELAY_ASK).
* RELAY_STATE — main's allow-lists (and depths): applied, then confirmed with
  RELAY_STATE_TAKEN of the same id (an allow-list change is answered only after that).
* DRAIN — also SIGTERM/SIGINT (idempotent): idle keep-alive connections close, requests
  in flight finish (bounded by `DRAIN_DEADLINE`), then the process exits 0.
* STATS_ASK — answered with a JSON report: Prometheus text of this process's registry,
  recent refusals, open connections, requests served.

When the channel closes (main is gone, whatever the reason) the worker exits at once:
no worker outlives its main process. SIGHUP is ignored: reloads come from main.
"""

from __future__ import annotations

import signal

if __name__ == "__main__":
    # SIGHUP's default action ends the process, and loading the modules below takes a
    # good part of a second: ignored first, a SIGHUP sent to every process of the
    # service (`systemctl kill -s HUP`, a `pkill -HUP`) cannot kill a worker that is
    # still starting. Reloads come from main, never a signal.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

import argparse
import math
import os
import pickle
import socket
import ssl
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import trio
from prometheus_client import generate_latest

from pact_ingress import gctune, stopping
from pact_ingress.errors import BackendError
from pact_ingress.logs import bind as bind_log
from pact_ingress.logs import log
from pact_ingress.logs import setup as setup_logs
from pact_ingress.model import Config, Route
from pact_ingress.net.backends import Backends, Resolver
from pact_ingress.net.replay import ReplayStream
from pact_ingress.net.runners import Runners
from pact_ingress.net.shortage import ShortageEpisode
from pact_ingress.net.workers import Channel
from pact_ingress.proto import tls_alert
from pact_ingress.proto import workers as wp
from pact_ingress.proto.workers import Kind
from pact_ingress.relay.remote import RemoteStore
from pact_ingress.stats import Stats

#: Seconds open connections get after DRAIN/SIGTERM (main's own drain uses the same).
DRAIN_DEADLINE = 30.0
#: Connection ids per CLOSED message at most (8 bytes each: one frame).
CLOSED_BATCH = 4096


class MainLink:
    """Requests to main over the channel that wait for an answer (tunnel streams)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self._waiting: dict[int, tuple[trio.Event, list[str]]] = {}

    async def open_stream(self, route_host: str) -> trio.SocketStream:
        """A stream main splices onto `route_host`'s tunnel, or BackendError."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        req_id = self.channel.next_id()
        event = trio.Event()
        answer: list[str] = []
        self._waiting[req_id] = (event, answer)
        try:
            try:
                await self.channel.send(Kind.STREAM_OPEN, route_host.encode(), req_id,
                                        (theirs.fileno(),))
            finally:
                theirs.close()
            await event.wait()
        except BaseException as exc:
            mine.close()
            if isinstance(exc, OSError):
                raise BackendError("the main process is unreachable") from exc
            raise
        finally:
            self._waiting.pop(req_id, None)
        if not answer or answer[0]:
            mine.close()
            raise BackendError(answer[0] if answer else "the main process went away")
        mine.setblocking(False)
        return trio.SocketStream(trio.socket.from_stdlib_socket(mine))

    def answered(self, req_id: int, text: str) -> None:
        waiting = self._waiting.get(req_id)
        if waiting is not None:
            waiting[1].append(text)
            waiting[0].set()

    def fail_all(self) -> None:
        for event, _ in self._waiting.values():
            event.set()


class WorkerBackends(Backends):
    """Configured addresses are dialled here; tunnel routes go through main."""

    def __init__(self, resolver: Resolver, link: MainLink) -> None:
        super().__init__(resolver)
        self.link = link

    async def connect(self, route: Route) -> trio.abc.Stream:
        if route.backend.address is None:
            return await self.link.open_stream(route.host)
        return await super().connect(route)


class Worker:
    def __init__(self, channel: Channel, index: int, *, settle_gc: bool = False) -> None:
        self.channel = channel
        self.index = index
        self.settle_gc = settle_gc  # `gctune.settle()` once ready (the worker process)
        self.stats = Stats()
        self.resolver = Resolver()
        self.link = MainLink(channel)
        self.backends = WorkerBackends(self.resolver, self.link)
        self.terminator: Any = None
        self.state: Any = None
        self.limiter: Any = None
        #: the relay host's engine, when the config has a relay; its store is main's
        self.relay: Any = None
        self.remote = RemoteStore(self._send_quiet_raise, channel.next_id)
        self._relay_files: dict[str, tuple[Path, Path]] = {}
        self._contexts: dict[str, tuple[int, ssl.SSLContext]] = {}
        self._handling = 0
        self._idle = trio.Event()
        self._draining = False
        self._closed_send, self._closed_recv = trio.open_memory_channel[int](math.inf)
        #: Handoffs whose fd this worker had no room for (`_handoff_lost`).
        self._lost = ShortageEpisode("handoff_failed", backoff=False, resumed="handoff_resumed")
        self._root: trio.Nursery | None = None
        self._runners = Runners(None)

    # -- start ----------------------------------------------------------------------

    def _build(self, config: Config, pems: tuple[bytes, bytes]) -> None:
        from pact_ingress.identity import identity_in_memory
        from pact_ingress.net.terminate import Terminator
        from pact_ingress.state import LocalLimiter, open_state

        # main's running identity, not the key file's content now (see WorkerPool)
        identity = identity_in_memory(*pems)
        if config.state.backend == "redis":  # budgets shared with other instances
            self.state = open_state(config.state, self.stats)
            self.state.announce = False  # main logs the instance's switches
            limiter = self.state.limiter
        else:  # this worker's own buckets: exact, since a client always comes here
            limiter = LocalLimiter()
        self.limiter = limiter
        self.terminator = Terminator(identity=identity, backends=self.backends,
                                     stats=self.stats, limiter=limiter)
        self._apply(config)

    async def _send_quiet_raise(self, kind: Kind, payload: bytes, msg_id: int) -> None:
        await self.channel.send(kind, payload, msg_id)

    def cert_files(self, host: str) -> tuple[Path, Path] | None:
        """The relay's certificate files, as main named them with the last handoff."""
        return self._relay_files.get(host)

    def _apply(self, config: Config) -> None:
        self.config = config
        self.resolver.watch(r.backend.address.host for r in config.routes()
                            if r.mode == "terminate" and r.backend.address is not None)
        self.terminator.update(config)
        if config.relay is not None:
            if self.relay is None:
                from pact_ingress.relay.server import RelayServer

                self.relay = RelayServer(config, stats=self.stats, certs=self,
                                         store=self.remote, limiter=self.limiter)
            else:
                self.relay.update(config)
        hosts = {r.host for r in config.routes()}
        for host in self._contexts.keys() - hosts:
            del self._contexts[host]

    async def run(self) -> int:
        first = await self.channel.receive()
        if first is None or first[0].kind is not Kind.CONFIG:
            log.error("worker_no_config", detail="the first message from main is the config")
            return 1
        self._build(*pickle.loads(first[0].payload))
        code = 0
        async with trio.open_nursery() as root:
            self._root = root
            # connections run in parked tasks (cancelled with the root at the end)
            self._runners = Runners(root)
            root.start_soon(self.resolver.refresh_forever)
            if self.state is not None:
                await root.start(self.state.run)
            root.start_soon(self._signals)
            root.start_soon(self._flush_closed)
            root.start_soon(self.remote.run)
            root.start_soon(log.flush_forever)
            if self.settle_gc:
                gctune.settle()  # what lives now lives for the process: out of collections
            try:
                await self.channel.send(Kind.READY, wp.encode_json({"pid": os.getpid()}))
            except OSError:
                pass  # main is gone (stopped while we started): the read below says so
            else:
                log.info("worker_ready", pid=os.getpid())
            try:
                await self._read()
            except wp.ProtocolError as exc:
                log.error("worker_channel_broken", error=str(exc))
                code = 1
            if not self._draining:
                # main died or never started serving: main's own fault (a port in use,
                # a kill) is the line an operator needs, so this one stays at debug
                log.debug("worker_main_gone", detail="the channel to main closed; exiting")
            root.cancel_scope.cancel()
        return code

    # -- the channel ----------------------------------------------------------------

    async def _read(self) -> None:
        while True:
            got = await self.channel.receive()
            if got is None:
                self.link.fail_all()
                self.remote.fail_all()
                return
            msg, fds = got
            if msg.kind is Kind.HANDOFF:
                if not fds and self.channel.fds_lost:
                    self._handoff_lost(wp.decode_handoff(msg.payload))
                    continue
                if self._lost.failures:
                    self._lost.accepted(trio.current_time())
                if len(fds) != 1:
                    for fd in fds:
                        os.close(fd)
                    raise wp.ProtocolError("HANDOFF without exactly one fd")
                assert self._root is not None
                self._handling += 1
                self._start(wp.decode_handoff(msg.payload), fds[0])
                continue
            for fd in fds:
                os.close(fd)
            if msg.kind is Kind.CONFIG:
                self._apply(pickle.loads(msg.payload))
                log.info("worker_config_applied", routes=len(self.config.routes()))
            elif msg.kind is Kind.DRAIN:
                self._start_drain()
            elif msg.kind is Kind.STATS_ASK:
                assert self._root is not None
                self._root.start_soon(self._send_report, msg.id)
            elif msg.kind is Kind.STREAM_RESULT:
                self.link.answered(msg.id, msg.payload.decode("utf-8", "replace"))
            elif msg.kind is Kind.RELAY_ANSWER:
                self.remote.answered(msg.payload)
            elif msg.kind is Kind.RELAY_STATE:
                self.remote.apply_state(wp.decode_json(msg.payload))
                assert self._root is not None
                self._root.start_soon(self._state_taken, msg.id)
            else:
                raise wp.ProtocolError(f"{msg.kind.name} is not main's message")

    def _handoff_lost(self, h: wp.Handoff) -> None:
        """A connection main handed over whose fd this worker had no room for: the
        kernel closed it in passing, unanswered. Counted, logged once per shortage, and
        reported closed so that main's count of it ends."""
        self.stats.rejections.labels("handoff_EMFILE").inc()
        self._lost.failed("EMFILE", trio.current_time())
        self._closed_send.send_nowait(h.conn_id)

    async def _state_taken(self, state_id: int) -> None:
        try:
            await self.channel.send(Kind.RELAY_STATE_TAKEN, b"", state_id)
        except OSError:
            pass

    async def _send_report(self, ask_id: int) -> None:
        try:
            await self.channel.send(Kind.STATS, wp.encode_json(self.report()), ask_id)
        except OSError:
            pass

    def report(self) -> dict[str, Any]:
        requests = sum(s.value for fam in self.stats.registry.collect()
                       if fam.name == "pact_ingress_http_requests"
                       for s in fam.samples if s.name.endswith("_total"))
        return {
            "metrics": generate_latest(self.stats.registry).decode(),
            "refusals": [[r.at, r.route, r.client_ip, r.reason]
                         for r in self.stats.recent_refusals],
            "open": self._handling,
            "requests": int(requests),
            # a worker keeps its own Redis connection: main's view alone could say
            # "shared" while this worker still counts budgets by itself; with when and
            # why it switched, main logs and counts a switch only a worker saw
            **({"state_mode": self.state.status()["mode"], "state_since": self.state.since,
                "state_error": self.state.last_error} if self.state is not None else {}),
        }

    async def _flush_closed(self) -> None:
        """CLOSED ids back to main, batched: whatever ended meanwhile goes in one frame."""
        while True:
            ids = [await self._closed_recv.receive()]
            while len(ids) < CLOSED_BATCH:
                try:
                    ids.append(self._closed_recv.receive_nowait())
                except trio.WouldBlock:
                    break
            try:
                await self.channel.send(Kind.CLOSED, wp.encode_closed(ids))
            except OSError:
                return

    # -- one connection -------------------------------------------------------------

    def _start(self, h: wp.Handoff, fd: int) -> None:
        """A connection main handed over: a plain terminate one goes to the keep-alive
        lane without a task of its own (`Terminator.start_lane`), anything else, or one
        the lane does not take, to a task."""
        try:
            raw = socket.socket(fileno=fd)
        except OSError:
            os.close(fd)
            self._ended(h.conn_id)
            return
        raw.setblocking(False)
        if not h.relay:
            try:
                route = self.terminator.route(h.route_host)
                ctx = self._context(h) if route is not None else None
                if route is not None and ctx is not None and self.terminator.start_lane(
                        raw, h.data, ctx, route, (h.client_ip, h.client_port), h.sni,
                        self._runners.start, partial(self._lane_ended, raw, h.conn_id)):
                    return
            except Exception as exc:  # one connection's bug must not end the worker
                self._handler_error(h, exc)
                raw.close()
                self._ended(h.conn_id)
                return
        self._runners.start(self._serve, h, raw)

    def _lane_ended(self, raw: socket.socket, conn_id: int) -> None:
        raw.close()
        self._ended(conn_id)

    def _handler_error(self, h: wp.Handoff, exc: Exception) -> None:
        self.stats.rejections.labels("handler_error").inc()
        log.error("handler_error", client_ip=h.client_ip, error=f"{type(exc).__name__}: {exc}")

    async def _serve(self, h: wp.Handoff, raw: socket.socket) -> None:
        try:
            await self._serve_socket(h, raw)
        except Exception as exc:  # one connection's bug must not end the worker
            self._handler_error(h, exc)
        finally:
            raw.close()
            self._ended(h.conn_id)

    async def _serve_socket(self, h: wp.Handoff, raw: socket.socket) -> None:
        if h.relay:
            if self.relay is None or self.relay.host != h.route_host:
                log.warning("worker_cannot_serve", route=h.route_host, client_ip=h.client_ip,
                            why="no such relay host in this worker's config")
                self.stats.rejections.labels("worker_cannot_serve").inc()
                try:
                    os.write(raw.fileno(), tls_alert.alert_record(tls_alert.INTERNAL_ERROR))
                except OSError:
                    pass
                return
            self._relay_files[h.route_host] = (Path(h.chain_path), Path(h.key_path))
            stream = ReplayStream(h.data,
                                  trio.SocketStream(trio.socket.from_stdlib_socket(raw)))
            await self.relay.serve(stream, (h.client_ip, h.client_port))
            return
        route = self.terminator.route(h.route_host)
        ctx = self._context(h)
        if route is None or ctx is None:
            log.warning("worker_cannot_serve", route=h.route_host, client_ip=h.client_ip,
                        why="route not in this worker's config" if route is None
                        else "certificate files unreadable")
            self.stats.rejections.labels("worker_cannot_serve").inc()
            try:
                os.write(raw.fileno(), tls_alert.alert_record(tls_alert.INTERNAL_ERROR))
            except OSError:
                pass
            return
        # TLS on the bare socket, the peeked bytes fed first: no trio socket or stream
        await self.terminator.serve_socket(raw, h.data, ctx, route,
                                           (h.client_ip, h.client_port), sni=h.sni)

    def _ended(self, conn_id: int) -> None:
        self._handling -= 1
        self._closed_send.send_nowait(conn_id)
        if self._handling == 0:
            self._idle.set()

    def _context(self, h: wp.Handoff) -> ssl.SSLContext | None:
        """The context main serves for the route now: loaded once per generation; while a
        new one cannot be read (replaced on disk meanwhile) the last one keeps serving."""
        from pact_ingress.acme.manager import served_context

        have = self._contexts.get(h.route_host)
        if have is not None and have[0] == h.cert_generation:
            return have[1]
        try:
            ctx = served_context(Path(h.chain_path), Path(h.key_path))
        except (OSError, ssl.SSLError, ValueError) as exc:
            log.warning("worker_cert_unreadable", route=h.route_host, error=str(exc))
            return have[1] if have is not None else None
        self._contexts[h.route_host] = (h.cert_generation, ctx)
        return ctx

    # -- drain ----------------------------------------------------------------------

    def _start_drain(self) -> None:
        if self._draining:
            return
        self._draining = True
        stopping.draining()
        log.info("worker_draining", open_connections=self._handling)
        assert self._root is not None
        self._root.start_soon(self._drain)

    async def _drain(self) -> None:
        await self.terminator.drain()
        if self.relay is not None:
            self.relay.drain()
        with trio.move_on_after(DRAIN_DEADLINE):
            while self._handling:
                self._idle = trio.Event()
                await self._idle.wait()
        await self.terminator.aclose()
        # let the last CLOSED ids reach main before the channel closes
        with trio.move_on_after(1.0):
            while self._closed_recv.statistics().current_buffer_used:
                await trio.sleep(0.01)
        log.info("worker_stopped")
        assert self._root is not None
        self._root.cancel_scope.cancel()

    async def _signals(self) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as sigs:
            async for _ in sigs:
                self._start_drain()


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads come from main, never a signal
    stopping.guard()
    parser = argparse.ArgumentParser(prog="pact_ingress.worker")
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--log-format", choices=("json", "text"), default="json")
    args = parser.parse_args(argv)
    setup_logs(args.log_format)
    bind_log(worker=args.index)
    sock = socket.socket(fileno=args.fd)
    try:
        code = stopping.run(Worker(Channel(sock), args.index, settle_gc=True).run)
    except KeyboardInterrupt:
        code = 0
    stopping.exiting()
    return code


if __name__ == "__main__":
    sys.exit(main())
