"""Worker processes: main hands terminate connections to them over a private channel.

Theory of operation
-------------------
TLS, HTTP parsing and the seal posture of terminate routes are CPU work, and one
Python process uses one core. With `serve --workers N` (N ≥ 2) the main process stays
the whole ingress of a single process — it alone listens on :443/:80/admin, peeks
ClientHellos and routes, and it alone runs passthrough splices, tunnels, the relay and
its store (one writer), ACME orders and challenge answers, and the cluster registry
and forwards — and spawns N workers (`python -m pact_ingress.worker`) that only run
the terminate engine. Why this split rather than N copies of everything behind
SO_REUSEPORT: a tenant's tunnel, the relay store and ACME state each want exactly one
owner, and the router's ClientHello peek is cheap; what is expensive is what happens
after a terminate route was chosen, and that is what moves.

Where the router would call `Terminator.serve`, it asks this module's `WorkerPool.serve`
(the `Router.handoff` hook). The pool picks the worker by the client's rate-limit bucket
(`proto.workers.worker_for`: every budget stays exact with nothing shared, see there),
sends the accepted socket's fd with SCM_RIGHTS and a `Handoff` header (route host, SNI,
client address, the certificate files main serves for that host now, the peeked
ClientHello), closes main's copy of the fd and waits until the worker reports the
connection `CLOSED`. The waiting handler task keeps the connection in main's counts,
so `max_connections` / `max_connections_per_ip`, `open_connections` and the drain
deadline cover handed-over connections exactly as before. A worker that is not READY
(starting, respawning) or a send that fails means main serves the connection itself
(`worker_handoffs{served_by="main"}`, a `worker_unavailable` line at most every 10 s):
a connection is never dropped for want of a worker.

A worker's tunnel-backed upstream comes through main: the worker makes a socketpair,
sends one end with STREAM_OPEN(route host); main looks the route up in *its* config
(only configured tunnel routes), opens the stream with its own `Backends` (own tunnel,
or a peer instance's), answers STREAM_RESULT and splices the two; the worker then runs
its pinned mTLS to the node over its end as over any tunnel stream.

Certificates: the handoff names the chain and key files main's `CertManager` serves
for the host and a generation number that changes whenever main swaps in another
context; a worker loads a context once per generation. So a worker serves exactly the
certificate main would, picks up a renewal with the first connection after it, and
never orders, stores or answers challenges itself.

Lifecycle: one supervisor task per worker (`_supervise`) spawns it, sends the config,
reads its channel and waits for the process. States move only through
`proto.workers.next_state`. An unexpected exit is logged as one `worker_exited` line
(pid, exit code or signal), counted, and the worker respawned after a bounded backoff;
its connections are gone with it, the other workers' are untouched. Reload: main
reloads; only a config it accepted is pushed to the workers (a refused one never
leaves main). Drain: `drain()` tells every worker (idempotent with the SIGTERM systemd
sends the whole control group); `wait_exited` bounds their exit. A worker exits when
its channel to main closes, so no worker outlives main.

Workers are started without `NOTIFY_SOCKET`, `WATCHDOG_*` or `LISTEN_*` in their
environment: only main speaks to systemd, and it says READY once the workers are.
"""

from __future__ import annotations

import array
import dataclasses
import itertools
import os
import pickle
import signal
import socket
import ssl
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import trio

from pact_ingress.errors import BackendError
from pact_ingress.identity import Identity, identity_pems
from pact_ingress.logs import log
from pact_ingress.model import Config, Route
from pact_ingress.net.backends import Backends
from pact_ingress.net.splice import relay
from pact_ingress.proto import workers as wp
from pact_ingress.proto.workers import Kind, Message, WorkerState
from pact_ingress.stats import Stats

#: How long a handoff may wait for room in a worker's channel (its queue holds only a
#: few messages) before main serves the connection itself.
HANDOFF_WAIT = 0.05
#: How long a handoff waits for a reload's config to reach its worker first.
CONFIG_WAIT = 1.0
#: How long main waits for a worker's first READY at start before declaring READY
#: itself (main serves every connection a worker cannot take, so this is no outage).
START_TIMEOUT = 30.0
#: How long a worker has to answer a STATS question (/metrics, /status).
STATS_TIMEOUT = 2.0
#: A worker's connections served by main are logged at most once per this many seconds.
FALLBACK_LOG_EVERY = 10.0
#: Seconds between reports main asks for unprompted (between scrapes).
REPORT_INTERVAL = 5.0
#: After main's own drain ended, how long workers get to exit before they are killed.
EXIT_TIMEOUT = 10.0
#: Environment variables only main may act on (systemd notify, watchdog, socket
#: activation): a worker that inherited them could claim READY or feed the watchdog.
PRIVATE_ENV = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS",
               "LISTEN_PID", "LISTEN_FDNAMES")


# --- the channel -----------------------------------------------------------------------

class Channel:
    """One end of a SEQPACKET socketpair: frames out (with fds), messages in."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.raw = sock
        self.sock = trio.socket.from_stdlib_socket(sock)
        self._reasm = wp.Reassembler()
        self._ids = itertools.count(1)
        #: The last message received came with fds the kernel could not install in this
        #: process (out of fds: MSG_CTRUNC): they are gone, the message is whole.
        self.fds_lost = False
        # trio lets one task at a time wait for an fd to be writable; handoffs, a reload's
        # config and stats questions all wait on a full channel together, so they queue
        self._writers = trio.Lock()
        # Every CONFIG travels under one id, so two may never be on their way at once:
        # their frames would join into one message. While one is being sent, the newest
        # config waits here (an older one waiting is simply replaced) and follows it.
        self.config_sending = False
        self.config_next: list[bytes] | None = None

    async def wait_writable(self) -> None:
        async with self._writers:
            # closed while this task waited in line (the worker is gone): say so in the
            # error every sender handles; waiting on the dead fd would raise another
            if self.sock.fileno() < 0:
                raise trio.ClosedResourceError("the channel to the worker is closed")
            await trio.lowlevel.wait_writable(self.sock)

    def next_id(self) -> int:
        return next(self._ids) & 0xFFFFFFFF

    def try_send_frame(self, frame: bytes, fds: tuple[int, ...] = ()) -> bool:
        """One frame now, or False when the peer's queue is full."""
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, _fd_bytes(fds))] if fds else []
        try:
            self.raw.sendmsg([frame], anc)
        except BlockingIOError:
            return False
        return True

    async def send(self, kind: Kind, payload: bytes = b"", msg_id: int = 0,
                   fds: tuple[int, ...] = ()) -> None:
        """A whole message; raises OSError when the peer is gone."""
        for i, frame in enumerate(wp.encode(kind, payload, msg_id)):
            while not self.try_send_frame(frame, fds if i == 0 else ()):
                await self.wait_writable()

    async def send_bounded(self, kind: Kind, payload: bytes, timeout: float,
                           fds: tuple[int, ...] = ()) -> bool:
        """A one-frame message within `timeout`; False when it did not fit in time."""
        frames = wp.encode(kind, payload)
        if len(frames) != 1:
            return False  # fds ride on one-frame messages only
        frame = frames[0]
        if self.try_send_frame(frame, fds):
            return True
        with trio.move_on_after(timeout):
            while True:
                await self.wait_writable()
                if self.try_send_frame(frame, fds):
                    return True
        return False

    async def receive(self) -> tuple[Message, list[int]] | None:
        """The next whole message and the fds that came with it; None at EOF."""
        while True:
            try:
                data, anc, flags, _ = self.raw.recvmsg(
                    wp.FRAME_READ, socket.CMSG_SPACE(4 * wp.MAX_FDS),
                    socket.MSG_CMSG_CLOEXEC)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            except (ConnectionResetError, BrokenPipeError):
                return None
            fds = _fds_of(anc)
            if not data:
                for fd in fds:
                    os.close(fd)
                return None
            if flags & socket.MSG_TRUNC:
                for fd in fds:
                    os.close(fd)
                raise wp.ProtocolError("truncated frame")
            # Control data cut short with the frame whole: this process had no fd left
            # for what came with it (the kernel closed those). That costs the message's
            # connection, answered as lost by whoever reads it, never the channel.
            self.fds_lost = bool(flags & socket.MSG_CTRUNC)
            try:
                msg = self._reasm.feed(data)
            except wp.ProtocolError:
                for fd in fds:
                    os.close(fd)
                raise
            if msg is not None:
                return msg, fds
            for fd in fds:  # fds only ride on one-frame messages
                os.close(fd)

    def close(self) -> None:
        self.sock.close()


def _fd_bytes(fds: tuple[int, ...]) -> bytes:
    return array.array("i", fds).tobytes()


def _fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
    out: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds = array.array("i")
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
            out.extend(fds)
    return out


def worker_env() -> dict[str, str]:
    """The environment a worker starts with: main's, minus what only main may use."""
    return {k: v for k, v in os.environ.items() if k not in PRIVATE_ENV}


def default_workers() -> int:
    """Worker processes when `--workers` is not given: one per core this process may
    run on (the affinity mask, not the machine's count: containers and `taskset`).

    Why every core by default: terminate work is CPU-bound and an edge that serves
    terminate routes should use the machine it was given without tuning; more workers
    than cores would only add context switches. On one usable core this is 1, i.e. the
    single process with no children. The price of a worker with nothing to do is an idle
    Python process (tens of MB RSS), which a passthrough-only deployment can save with
    `--workers 1`."""
    return len(os.sched_getaffinity(0))


# --- main's side -----------------------------------------------------------------------

@dataclass(eq=False)
class _Answers:
    """Relay answers gathered for one channel (one worker process): sent in batches."""

    outbox: wp.Outbox = field(default_factory=wp.Outbox)
    ready: trio.Event = field(default_factory=trio.Event)


@dataclass(eq=False)
class _Slot:
    """One worker position (index) and the process currently filling it."""

    index: int
    state: WorkerState = WorkerState.STARTING
    process: trio.Process | None = None
    channel: Channel | None = None
    pid: int | None = None
    started: float | None = None  # wall clock of the current process's spawn
    restarts: int = 0
    open: dict[int, trio.Event] = field(default_factory=dict)
    ready: trio.Event = field(default_factory=trio.Event)  # set at its first READY ever
    asks: dict[int, tuple[trio.Event, list[dict[str, Any]]]] = field(default_factory=dict)
    report: dict[str, Any] = field(default_factory=dict)  # the last STATS it sent
    drain_sent: bool = False
    fallback_logged: float = float("-inf")  # trio time of the last worker_unavailable
    config_pending: trio.Event | None = None  # set when a reload's CONFIG is all sent
    state_taken: dict[int, trio.Event] = field(default_factory=dict)  # RELAY_STATE ids
    relay_out: _Answers | None = None  # relay answers for the current process's channel
    supervised: trio.Event = field(default_factory=trio.Event)  # its supervisor returned

    def move(self, wanted: WorkerState) -> None:
        self.state = wp.next_state(self.state, wanted)


class WorkerPool:
    """Main's side: spawns and supervises the workers, hands connections to them."""

    def __init__(self, count: int, *, config: Config, identity: Identity, stats: Stats,
                 backends: Backends, certs: Any, log_format: str,
                 argv: Callable[[int, int], list[str]] | None = None) -> None:
        if count < 2:
            raise ValueError("a pool has at least two workers (one means no pool)")
        self.count = count
        self.config = config
        # main read them at its own start and a reload changes neither there, so every
        # worker (a replacement too) is given those (the state block it reads as it starts)
        self._at_start = {"identity_key": config.identity_key, "state": config.state}
        # The identity main runs with, handed to each worker with its first config: the
        # key file may have been replaced since (a rotation prepared for the next
        # restart), and a replacement worker reading it would present a key no node pins.
        self._identity = identity_pems(identity)
        self.stats = stats
        self.backends = backends
        self.certs = certs
        self.log_format = log_format
        self._argv = argv or self._default_argv
        self.slots = [_Slot(i) for i in range(count)]
        self._conn_ids = itertools.count(1)
        self._generations: weakref.WeakKeyDictionary[ssl.SSLContext, int] = \
            weakref.WeakKeyDictionary()
        self._next_generation = itertools.count(1)
        self._draining = False
        self._retired = ""  # counters of worker processes that are gone (Prometheus text)
        self._nursery: trio.Nursery | None = None
        #: main's relay store service (`relay.remote.StoreService`), when a relay is served
        self.relay_service: Any = None
        #: Called with (worker index, its report) for every report of a worker whose own
        #: Redis client is in fallback (`app.Ingress` turns one only a worker saw into
        #: the instance's switch: one log line, one count).
        self.on_state_fallback: Callable[[int, dict[str, Any]], None] | None = None
        self._sent = stats.worker_handoffs.labels("worker")
        self._fallback = stats.worker_handoffs.labels("main")
        for slot in self.slots:
            label = str(slot.index)
            stats.worker_up.labels(label).set(0)
            stats.worker_restarts.labels(label)
            stats.worker_open_connections.labels(label).set_function(
                lambda s=slot: len(s.open))

    def _default_argv(self, index: int, fd: int) -> list[str]:
        return [sys.executable, "-m", "pact_ingress.worker", "--index", str(index),
                "--fd", str(fd), "--log-format", self.log_format]

    # -- running --------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
                  ) -> None:
        """Supervise every worker until cancelled; started once each is READY (or
        `START_TIMEOUT` passed: main serves what a missing worker would)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for slot in self.slots:
                nursery.start_soon(self._supervise, slot)
            with trio.move_on_after(START_TIMEOUT):
                for slot in self.slots:
                    await slot.ready.wait()
            late = [s.index for s in self.slots if s.state is not WorkerState.READY]
            if late:
                log.warning("workers_not_ready", workers=late, timeout_s=START_TIMEOUT,
                            detail="main serves their clients until they are")
            log.info("workers_ready", workers=self.count,
                     pids=[s.pid for s in self.slots])
            nursery.start_soon(self._refresh_forever)
            task_status.started()

    async def _supervise(self, slot: _Slot) -> None:
        try:
            await self._supervise_until_drained(slot)
        finally:
            slot.supervised.set()

    async def _supervise_until_drained(self, slot: _Slot) -> None:
        failures = 0
        while True:
            started = trio.current_time()
            code = await self._run_one(slot)
            if self._draining:
                if slot.state is not WorkerState.EXITED:
                    slot.move(WorkerState.EXITED)
                log.info("worker_stopped", worker=slot.index, pid=slot.pid,
                         **_exit_fields(code))
                return
            slot.move(WorkerState.EXITED)
            failures = failures + 1 if trio.current_time() - started < \
                wp.RESPAWN_HEALTHY_AFTER else 1
            delay = wp.respawn_delay(failures)
            log.warning("worker_exited", worker=slot.index, pid=slot.pid,
                        **_exit_fields(code), respawn_in_s=round(delay, 2))
            self.stats.worker_restarts.labels(str(slot.index)).inc()
            slot.restarts += 1
            slot.move(WorkerState.RESPAWNING)
            await trio.sleep(delay)
            if self._draining:
                slot.move(WorkerState.EXITED)
                return
            slot.move(WorkerState.STARTING)

    async def _run_one(self, slot: _Slot) -> int | None:
        """Spawn one process for `slot`, serve its channel until it exits; its code."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            theirs.set_inheritable(True)
            # a process group of its own: a terminal's Ctrl-C (sent to its whole
            # foreground group) reaches main alone, which stops the workers itself; a
            # worker still loading its modules would die of it with a traceback
            process = await trio.lowlevel.open_process(
                self._argv(slot.index, theirs.fileno()), pass_fds=(theirs.fileno(),),
                env=worker_env(), stdin=subprocess.DEVNULL, process_group=0)
        except OSError as exc:
            mine.close()
            log.error("worker_spawn_failed", worker=slot.index, error=str(exc))
            return None
        finally:
            theirs.close()
        slot.process, slot.pid, slot.started = process, process.pid, time.time()
        slot.channel = channel = Channel(mine)
        slot.drain_sent = False
        slot.relay_out = answers = _Answers()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._read, slot, channel)
                nursery.start_soon(self._send_answers, channel, answers)
                try:
                    # through the same queue as a reload's: one may come while this one
                    # is still on its way (the new process is not reading yet)
                    self._send_config(slot, channel, wp.encode(Kind.CONFIG, pickle.dumps(
                        (self.config, self._identity))))
                    if slot.config_pending is not None:  # whole before anything else
                        await slot.config_pending.wait()
                    if self.relay_service is not None:  # before any relay connection
                        await channel.send(Kind.RELAY_STATE, self.relay_service.state())
                except OSError:
                    pass  # it died already; wait() below says how
                await process.wait()
                nursery.cancel_scope.cancel()
        finally:
            if process.returncode is None:
                # cancelled: main's start-up or main itself ends. A worker still starting
                # reads its channel (and sees main gone) only once its own start-up is
                # over, a state probe's deadline later: it goes now, and with it reaped
                # no worker outlives main or writes after its last line
                process.kill()
                with trio.move_on_after(EXIT_TIMEOUT) as reap:
                    reap.shield = True
                    await process.wait()
            channel.close()
            slot.channel = None
            self._lost(slot)
        return process.returncode

    def _lost(self, slot: _Slot) -> None:
        """The process is gone: its connections ended with it; nobody waits for them.
        Its counters (as last reported) stay in the instance's sums, so a counter never
        goes down because a worker was replaced; its gauges go with it."""
        self.stats.worker_up.labels(str(slot.index)).set(0)
        text = slot.report.get("metrics")
        if isinstance(text, str) and text:
            from pact_ingress.admin.merge import retire

            self._retired = retire(self._retired, text)
        slot.report = {}
        for event in slot.open.values():
            event.set()
        slot.open.clear()
        for event, _ in slot.asks.values():
            event.set()
        slot.asks.clear()
        for event in slot.state_taken.values():
            event.set()
        slot.state_taken.clear()

    async def _read(self, slot: _Slot, channel: Channel) -> None:
        while True:
            try:
                got = await channel.receive()
            except wp.ProtocolError as exc:
                log.error("worker_channel_broken", worker=slot.index, error=str(exc))
                self._kill(slot)
                return
            if got is None:
                return  # the worker closed its end: it is exiting; wait() follows
            msg, fds = got
            try:
                self._dispatch(slot, channel, msg, fds)
            except wp.ProtocolError as exc:
                for fd in fds:
                    os.close(fd)
                log.error("worker_channel_broken", worker=slot.index, error=str(exc))
                self._kill(slot)
                return

    def _dispatch(self, slot: _Slot, channel: Channel, msg: Message, fds: list[int]) -> None:
        if msg.kind is Kind.CLOSED:
            for conn_id in wp.decode_closed(msg.payload):
                event = slot.open.pop(conn_id, None)
                if event is not None:
                    event.set()
        elif msg.kind is Kind.STATS:
            waiting = slot.asks.pop(msg.id, None)
            report = wp.decode_json(msg.payload)
            slot.report = report
            if report.get("state_mode") == "fallback" and self.on_state_fallback is not None:
                self.on_state_fallback(slot.index, report)
            if waiting is not None:
                waiting[1].append(report)
                waiting[0].set()
        elif msg.kind is Kind.READY:
            if slot.state is WorkerState.STARTING:
                slot.move(WorkerState.READY)
                self.stats.worker_up.labels(str(slot.index)).set(1)
                slot.ready.set()
                if self._draining:
                    self._nursery_soon(self._send_drain, slot)
        elif msg.kind is Kind.STREAM_OPEN:
            if not fds and channel.fds_lost:  # main out of fds: that stream fails
                self.stats.rejections.labels("stream_fd_lost").inc()
                self._nursery_soon(_answer, channel, msg.id, "edge out of file descriptors")
                return
            if len(fds) != 1:
                raise wp.ProtocolError("STREAM_OPEN without exactly one fd")
            self._nursery_soon(self._open_stream, channel, msg.id,
                               msg.payload.decode("utf-8", "replace"), fds.pop())
        elif msg.kind is Kind.RELAY_ASK:
            answers = slot.relay_out
            assert answers is not None
            service = self.relay_service
            for req_id, payload in wp.decode_records(msg.payload):
                # an enqueue (the usual ask) goes to the store at once, its answer
                # following the COMMIT; anything else gets a task of its own
                if service is None or not self._relay_soon(slot, answers, req_id, payload):
                    self._nursery_soon(self._relay_ask, slot, answers, req_id, payload)
        elif msg.kind is Kind.RELAY_STATE_TAKEN:
            event = slot.state_taken.pop(msg.id, None)
            if event is not None:
                event.set()
        else:
            raise wp.ProtocolError(f"{msg.kind.name} is not a worker's message")

    def _nursery_soon(self, fn: Any, *args: Any) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(fn, *args)

    def _kill(self, slot: _Slot) -> None:
        if slot.process is not None and slot.process.returncode is None:
            slot.process.send_signal(signal.SIGKILL)

    # -- the relay store for workers ------------------------------------------------

    async def _relay_ask(self, slot: _Slot, answers: _Answers, req_id: int,
                         payload: bytes) -> None:
        """A worker's relay store operation, run on main's store and answered (in the
        next batch of its channel: an answer never reaches a replacement process). A
        bug here costs that call (answered unavailable), never main."""
        from pact_ingress.relay.remote import no_service_answer

        service = self.relay_service
        try:
            answer = no_service_answer() if service is None else await service.answer(payload)
        except wp.ProtocolError as exc:
            log.error("worker_channel_broken", worker=slot.index, error=str(exc))
            self._kill(slot)
            return
        except Exception as exc:
            log.error("relay_ask_error", worker=slot.index,
                      error=f"{type(exc).__name__}: {exc}")
            answer = no_service_answer()
        if answers.outbox.add(req_id, answer):
            answers.ready.set()

    def _relay_soon(self, slot: _Slot, answers: _Answers, req_id: int, payload: bytes
                    ) -> bool:
        """`StoreService.answer_soon` of one ask (False: it takes a task); a bug there
        costs that call (answered unavailable), never main."""
        from pact_ingress.relay.remote import no_service_answer

        def reply(answer: bytes) -> None:
            if answers.outbox.add(req_id, answer):
                answers.ready.set()

        try:
            return bool(self.relay_service.answer_soon(payload, reply))
        except wp.ProtocolError:
            raise  # the channel is dropped, as for any malformed message
        except Exception as exc:
            log.error("relay_ask_error", worker=slot.index,
                      error=f"{type(exc).__name__}: {exc}")
            reply(no_service_answer())
            return True

    @staticmethod
    async def _send_answers(channel: Channel, answers: _Answers) -> None:
        while True:
            await answers.ready.wait()
            answers.ready = trio.Event()
            for payload in answers.outbox.take():
                if not await _send_quietly(channel, Kind.RELAY_ANSWER, payload):
                    return  # the worker is gone; its supervisor sees it exit

    async def broadcast_relay_state(self, payload: bytes) -> None:
        """RELAY_STATE to every running worker; returns once each confirmed it (or
        `STATE_WAIT` passed: a worker that does not read its channel serves nothing)."""
        from pact_ingress.relay.remote import STATE_WAIT

        waits: list[trio.Event] = []
        for slot in self.slots:
            channel = slot.channel
            if channel is None or slot.state not in (WorkerState.STARTING,
                                                     WorkerState.READY):
                continue
            state_id = channel.next_id()
            event = slot.state_taken[state_id] = trio.Event()
            try:
                await channel.send(Kind.RELAY_STATE, payload, state_id)
            except (OSError, trio.ClosedResourceError):
                slot.state_taken.pop(state_id, None)
                continue
            waits.append(event)
        with trio.move_on_after(STATE_WAIT):
            for event in waits:
                await event.wait()

    # -- the router's hook ----------------------------------------------------------

    async def serve(self, sock: trio.socket.SocketType, data: bytes, route: Route,
                    client: tuple[str, int], sni: str | None, ctx: ssl.SSLContext) -> bool:
        """Hand a terminate connection to its worker and wait until it ended there;
        False (nothing done) when main must serve it itself."""
        return await self._hand(sock, data, route.host, client, sni, self._generation(ctx),
                                relay=False)

    async def serve_relay(self, sock: trio.socket.SocketType, data: bytes, host: str,
                          client: tuple[str, int], sni: str | None) -> bool:
        """The same for a relay host connection (the worker reloads the relay's
        certificate files when they change, as main's relay server does)."""
        if self.relay_service is None:
            return False
        return await self._hand(sock, data, host, client, sni, 0, relay=True)

    async def _hand(self, sock: trio.socket.SocketType, data: bytes, host: str,
                    client: tuple[str, int], sni: str | None, generation: int, *,
                    relay: bool) -> bool:
        slot = self.slots[wp.worker_for(client[0], self.count)]
        channel = slot.channel
        files = self.certs.cert_files(host)
        if (slot.state is not WorkerState.READY or channel is None or files is None
                or self._draining):
            self._served_here(slot, slot.state.value)
            return False
        pending = slot.config_pending
        if pending is not None:  # a reload's config is still on its way
            # bounded: a worker that stopped reading never takes it, and its clients
            # are then main's to serve, as with a full channel
            with trio.move_on_after(CONFIG_WAIT):
                await pending.wait()
            if not pending.is_set():
                self._served_here(slot, "config of a reload not taken")
                return False
            if slot.config_pending is pending:
                slot.config_pending = None
            if slot.channel is not channel or slot.state is not WorkerState.READY:
                self._served_here(slot, "restarted during a reload")
                return False
        conn_id = next(self._conn_ids)
        header = wp.encode_handoff(wp.Handoff(
            conn_id, client[0], client[1], host, sni, generation,
            str(files[0]), str(files[1]), data, relay))
        done = slot.open[conn_id] = trio.Event()
        try:
            sent = await channel.send_bounded(Kind.HANDOFF, header, HANDOFF_WAIT,
                                              (sock.fileno(),))
        except (OSError, trio.ClosedResourceError):  # the worker went away meanwhile
            sent = False
        if not sent:
            slot.open.pop(conn_id, None)
            self._served_here(slot, "channel full or closed")
            return False
        self._sent.inc()
        sock.close()  # the worker's copy is the connection now: its close ends it
        await done.wait()
        return True

    def _served_here(self, slot: _Slot, why: str) -> None:
        """Counted every time; logged at most once per `FALLBACK_LOG_EVERY` per worker
        (a respawn can leave thousands of connections to main)."""
        self._fallback.inc()
        now = trio.current_time()
        if now - slot.fallback_logged >= FALLBACK_LOG_EVERY and not self._draining:
            slot.fallback_logged = now
            log.warning("worker_unavailable", worker=slot.index, why=why,
                        detail="main serves its clients' terminate connections meanwhile")

    def _generation(self, ctx: ssl.SSLContext) -> int:
        gen = self._generations.get(ctx)
        if gen is None:
            gen = self._generations[ctx] = next(self._next_generation)
        return gen

    # -- tunnel streams for workers -------------------------------------------------

    async def _open_stream(self, channel: Channel, req_id: int, route_host: str,
                           fd: int) -> None:
        """A worker's request for its route's tunnel stream, spliced onto `fd`. A bug
        here costs that stream, never main (it runs in the pool's nursery)."""
        try:
            await self._splice_stream(channel, req_id, route_host, fd)
        except Exception as exc:
            log.error("worker_stream_error", route=route_host,
                      error=f"{type(exc).__name__}: {exc}")

    async def _splice_stream(self, channel: Channel, req_id: int, route_host: str,
                             fd: int) -> None:
        theirs = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
        try:
            route = next((r for r in self.config.routes() if r.host == route_host), None)
            if route is None or route.mode != "terminate" or route.backend.address is not None:
                await _answer(channel, req_id, f"{route_host}: no terminate tunnel route")
                return
            try:
                backend = await self.backends.connect(route)
            except BackendError as exc:
                await _answer(channel, req_id, str(exc) or "tunnel unavailable")
                return
            try:
                if not await _answer(channel, req_id, ""):
                    return
                await relay(theirs, backend, idle_timeout=route.limits.idle_timeout)
            finally:
                await trio.aclose_forcefully(backend)
        finally:
            await trio.aclose_forcefully(theirs)

    # -- config, drain, reports -----------------------------------------------------

    def update(self, config: Config) -> None:
        """A config main accepted: every running worker applies it before anything
        handed to it later. The frames go out now when the channel takes them (it
        usually does); otherwise a task sends the rest, and handoffs to that worker wait
        for it, so no connection reaches a worker ahead of the config it belongs to."""
        self.config = config = dataclasses.replace(config, **self._at_start)
        frames = wp.encode(Kind.CONFIG, pickle.dumps(config))
        for slot in self.slots:
            channel = slot.channel
            if channel is None or self._nursery is None:
                continue  # a worker (re)starting gets `self.config` when it is spawned
            try:
                self._send_config(slot, channel, frames)
            except OSError:
                continue  # it is gone; its supervisor will see it exit

    def _send_config(self, slot: _Slot, channel: Channel, frames: list[bytes]) -> None:
        """One CONFIG's frames: now, as far as the channel takes them, unless another is
        still on its way; the rest by a task, and `slot.config_pending` set once all of
        it (and any config queued behind it) is sent."""
        if channel.config_sending:
            channel.config_next = frames  # the running task sends it next
            return
        rest = list(frames)
        while rest and channel.try_send_frame(rest[0]):
            rest.pop(0)
        if rest:
            assert self._nursery is not None
            channel.config_sending = True
            done = slot.config_pending = trio.Event()
            self._nursery.start_soon(self._send_rest, channel, rest, done)

    @staticmethod
    async def _send_rest(channel: Channel, frames: list[bytes], done: trio.Event) -> None:
        try:
            while frames:
                for frame in frames:
                    while not channel.try_send_frame(frame):
                        await channel.wait_writable()
                frames, channel.config_next = channel.config_next or [], None
        except (OSError, trio.ClosedResourceError):
            pass
        finally:
            channel.config_sending, channel.config_next = False, None
            done.set()

    def drain(self) -> None:
        """Shutdown: no more handoffs; every worker finishes its requests and exits."""
        self._draining = True
        for slot in self.slots:
            if slot.channel is not None and self._nursery is not None:
                self._nursery.start_soon(self._send_drain, slot)

    async def _send_drain(self, slot: _Slot) -> None:
        if slot.drain_sent or slot.channel is None:
            return
        slot.drain_sent = True
        if slot.state in (WorkerState.STARTING, WorkerState.READY):
            slot.move(WorkerState.DRAINING)
        await _send_quietly(slot.channel, Kind.DRAIN, b"")

    async def wait_exited(self, timeout: float = EXIT_TIMEOUT) -> None:
        """After main's drain: wait for every worker process to exit; kill the late."""
        with trio.move_on_after(timeout):
            for slot in self.slots:
                while slot.process is not None and slot.process.returncode is None:
                    await slot.process.wait()
            # and its supervisor has closed the channel and said how it ended
            for slot in self.slots:
                await slot.supervised.wait()
            return
        for slot in self.slots:
            if slot.process is not None and slot.process.returncode is None:
                log.warning("worker_killed", worker=slot.index, pid=slot.pid,
                            why=f"still running {timeout} s after the drain")
                self._kill(slot)

    async def _refresh_forever(self) -> None:
        """Reports kept recent without a scrape: what a worker counted is lost with it
        only back to its last report (see `_lost`)."""
        while True:
            await trio.sleep(REPORT_INTERVAL)
            await self.refresh()

    async def refresh(self, timeout: float = STATS_TIMEOUT) -> None:
        """Ask every running worker for a fresh report (bounded); a worker that does
        not answer keeps its last report."""
        async with trio.open_nursery() as nursery:
            for slot in self.slots:
                if slot.channel is not None and slot.state in (WorkerState.READY,
                                                               WorkerState.DRAINING):
                    nursery.start_soon(self._ask, slot, slot.channel, timeout)

    async def _ask(self, slot: _Slot, channel: Channel, timeout: float) -> None:
        ask_id = channel.next_id()
        event: trio.Event = trio.Event()
        slot.asks[ask_id] = (event, [])
        try:
            with trio.move_on_after(timeout):
                await channel.send(Kind.STATS_ASK, b"", ask_id)
                await event.wait()
        except (OSError, trio.ClosedResourceError):  # gone meanwhile: its last report stays
            pass
        finally:
            slot.asks.pop(ask_id, None)

    def reports(self) -> list[str]:
        """The metrics text of every running worker's last report, and the counters of
        those gone (for /metrics)."""
        live = [str(s.report.get("metrics", "")) for s in self.slots if s.report]
        return [*live, self._retired] if self._retired else live

    def refusals(self) -> list[list[Any]]:
        out: list[list[Any]] = []
        for slot in self.slots:
            refusals = slot.report.get("refusals")
            if isinstance(refusals, list):
                out.extend(r for r in refusals if isinstance(r, list) and len(r) == 4)
        return out

    def status(self) -> list[dict[str, Any]]:
        """The `/status` `workers` section."""
        return [
            {"index": s.index, "pid": s.pid, "state": s.state.value,
             "started": s.started, "restarts": s.restarts, "open_connections": len(s.open),
             "requests": int(s.report.get("requests", 0) or 0),
             **({"state_mode": s.report["state_mode"]}
                if s.report.get("state_mode") in ("shared", "fallback") else {})}
            for s in self.slots
        ]


async def _answer(channel: Channel, req_id: int, error: str) -> bool:
    return await _send_quietly(channel, Kind.STREAM_RESULT, error.encode(), req_id)


async def _send_quietly(channel: Channel, kind: Kind, payload: bytes, msg_id: int = 0) -> bool:
    """Send; a worker that is gone is no error here (its supervisor handles that)."""
    try:
        await channel.send(kind, payload, msg_id)
    except (OSError, trio.ClosedResourceError):
        return False
    return True


def _exit_fields(code: int | None) -> dict[str, Any]:
    if code is None:
        return {"code": None}
    if code < 0:
        try:
            return {"signal": signal.Signals(-code).name}
        except ValueError:
            return {"signal": -code}
    return {"code": code}
