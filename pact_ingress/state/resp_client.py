"""A minimal Redis client for the rate limiter's hot path: a few persistent connections,
one command at a time on each, RESP2 via `proto.resp`.

Why it exists next to coredis
-----------------------------
coredis carries everything else (ACME store, relay store, registry, health probe), but a
rate-limit decision through it cost 300–400 µs of ingress CPU (measured with
`tests.bench.bench_redis_limiter`, one decision at a time: 304, 328 and 359 µs in three
runs, 408 µs earlier, against 50–70 µs of redis-server CPU), nearly all of it coredis's
per-call machinery — anyio streams and events, its connection pool, command and
response callbacks. A terminate
request costs ~285 µs in total, so sharing limits made two instances slower than one.
Here a decision is one `send` and usually one `recv` on a socket this task holds:
64–129 µs in the same runs, most of it the kernel's round trip. It does no more than
the limiter needs: connect (TCP or TLS), AUTH, SELECT,
EVALSHA with a NOSCRIPT → SCRIPT LOAD retry.

Rules
-----
* A connection serves one request at a time (no pipelining between callers), so a
  reply always belongs to the request that is waiting for it.
* Every wait (connect, TLS handshake, AUTH, the reply) runs under the caller's deadline;
  this module sets none of its own.
* A connection on which anything went wrong — a timeout or cancellation mid-request, an
  I/O error, a protocol error — is closed, never reused: a late reply would otherwise be
  read as the answer to the next request. An error *reply* (``-ERR ...``) leaves the
  stream in step and the connection is kept. When one connection breaks, the idle ones
  are closed too: they most likely share its fate (a Redis restart), and the next
  request should connect afresh rather than try each dead one in turn.
"""

from __future__ import annotations

import hashlib
import select
import socket
import ssl
from collections import deque
from collections.abc import Sequence
from typing import Union

import outcome
import trio

from pact_ingress.model import RedisSettings
from pact_ingress.proto.resp import NEED_DATA, Parser, Reply, RespError, encode_command

#: Connections per instance for rate-limit decisions. A decision holds one for a single
#: round trip (tens of µs of Redis time), so a few carry a busy edge; more callers queue.
MAX_CONNECTIONS = 4
#: Bytes asked of the socket per receive: every reply of the limiter fits in one.
RECEIVE_SIZE = 16384


class ConnectionLost(Exception):
    """Redis closed the connection (a restart, a kill, `timeout` on its side)."""


class Script:
    """A Lua script by body and SHA1, as EVALSHA wants it."""

    __slots__ = ("body", "sha")

    def __init__(self, body: str) -> None:
        self.body = body.encode()
        self.sha = hashlib.sha1(self.body).hexdigest().encode()


class _Connection:
    """A TLS connection, on trio's streams."""

    __slots__ = ("stream", "parser")

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.parser = Parser()

    async def request(self, data: bytes) -> Reply:
        await self.stream.send_all(data)
        return await self.reply()

    async def reply(self) -> Reply:
        parser = self.parser
        while True:
            reply = parser.next_reply()
            if reply is not NEED_DATA:
                return reply  # type: ignore[return-value]
            chunk = await self.stream.receive_some(RECEIVE_SIZE)
            if not chunk:
                raise ConnectionLost("Redis closed the connection")
            parser.feed(chunk)

    def idle_ok(self) -> bool:
        """Nothing to read on an idle connection: any byte (a TLS close_notify), EOF
        or an error means Redis closed it or it is out of step."""
        stream = self.stream
        inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        if not isinstance(inner, trio.SocketStream):
            return True
        poller = select.poll()
        poller.register(inner.socket.fileno(), select.POLLIN)
        return not poller.poll(0)

    def close(self) -> None:
        """Close at once, without awaiting (safe inside a cancelled scope)."""
        stream = self.stream
        inner = stream.transport_stream if isinstance(stream, trio.SSLStream) else stream
        if isinstance(inner, trio.SocketStream):
            inner.socket.close()


class _PlainConnection:
    """A plain TCP connection on the bare socket. trio's SocketStream yields to the
    scheduler after every send, and each round through trio's loop costs µs per
    decision; here a command is one non-blocking send() (the socket buffer takes it
    whole) and the reply one recv() after one wait_readable — which is also where a
    deadline or a cancellation arrives."""

    __slots__ = ("sock", "parser")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.parser = Parser()

    async def request(self, data: bytes) -> Reply:
        sock = self.sock
        view = memoryview(data)
        while view:
            try:
                sent = sock.send(view)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(sock)
                continue
            view = view[sent:]
        return await self.reply()

    async def reply(self) -> Reply:
        parser = self.parser
        sock = self.sock
        while True:
            reply = parser.next_reply()
            if reply is not NEED_DATA:
                return reply  # type: ignore[return-value]
            try:
                chunk = sock.recv(RECEIVE_SIZE)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(sock)
                continue
            if not chunk:
                raise ConnectionLost("Redis closed the connection")
            parser.feed(chunk)

    def idle_ok(self) -> bool:
        """Nothing to read on an idle connection (see `_Connection.idle_ok`): one
        non-blocking peek, about a µs."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:  # ECONNRESET: Redis is gone
            return False
        return False  # EOF, or bytes nobody asked for

    def close(self) -> None:
        trio.lowlevel.notify_closing(self.sock)
        self.sock.close()


_Conn = Union[_Connection, _PlainConnection]


def _check(reply: Reply) -> Reply:
    if isinstance(reply, RespError):
        raise reply
    return reply


class RespClient:
    """A small pool of connections to the Redis of `settings` (see the module docstring)."""

    def __init__(self, settings: RedisSettings, *, ssl_context: ssl.SSLContext | None = None,
                 max_connections: int = MAX_CONNECTIONS) -> None:
        self.settings = settings
        self.ssl_context = ssl_context
        self.max_connections = max_connections
        self._idle: list[_Conn] = []
        self._open = 0  # idle + in use + connecting
        self._waiting: deque[trio.lowlevel.Task] = deque()
        hello: list[bytes] = []
        if settings.password is not None:
            auth: list[str] = ["AUTH"]
            if settings.username:
                auth.append(settings.username)
            auth.append(settings.password.reveal())
            hello.append(encode_command(*auth))
        if settings.db:
            hello.append(encode_command("SELECT", settings.db))
        hello.append(encode_command("CLIENT", "SETNAME", "pact-ingress-limiter"))
        self._hello = hello

    @property
    def connections(self) -> int:
        """Connections open now (idle, in use or connecting)."""
        return self._open

    # -- the pool ---------------------------------------------------------------------

    async def _acquire(self) -> _Conn:
        while True:
            while self._idle:
                conn = self._idle.pop()
                if conn.idle_ok():
                    return conn
                # closed while idle (a Redis restart, its `timeout`): coredis's pool
                # notices in the background; here it is noticed before use
                conn.close()
                self._open -= 1
            if self._open < self.max_connections:
                self._open += 1
                try:
                    return await self._connect()
                except BaseException:
                    self._open -= 1
                    self._wake(1)
                    raise
            # all in use: wait in line; a released connection is handed to the first in
            # line (were it put back instead, the task that released it would take it
            # again at once and a waiter could starve past any deadline)
            task = trio.lowlevel.current_task()
            self._waiting.append(task)

            def abort(_: object) -> trio.lowlevel.Abort:
                self._waiting.remove(task)
                return trio.lowlevel.Abort.SUCCEEDED

            conn = await trio.lowlevel.wait_task_rescheduled(abort)
            if conn is not None:
                return conn  # type: ignore[no-any-return]
            # None: a connection was closed, so there is room to open one

    def _release(self, conn: _Conn) -> None:
        if self._waiting:
            trio.lowlevel.reschedule(self._waiting.popleft(), outcome.Value(conn))
        else:
            self._idle.append(conn)

    def _wake(self, slots: int) -> None:
        """`slots` connections were closed: that many waiters may open their own."""
        for _ in range(min(slots, len(self._waiting))):
            trio.lowlevel.reschedule(self._waiting.popleft(), outcome.Value(None))

    def _discard(self, conn: _Conn) -> None:
        conn.close()
        self._open -= 1
        # its siblings most likely died with it (a restart): start afresh
        self._wake(1 + self.close())

    async def _connect(self) -> _Conn:
        settings = self.settings
        tcp = await trio.open_tcp_stream(settings.host, settings.port)
        conn: _Conn
        try:
            if self.ssl_context is not None:
                stream = trio.SSLStream(tcp, self.ssl_context, server_hostname=settings.host)
                conn = _Connection(stream)
                await stream.do_handshake()
            else:
                # the bare socket, non-blocking and TCP_NODELAY as trio left it
                conn = _PlainConnection(socket.socket(fileno=tcp.socket.detach()))
        except BaseException:
            tcp.socket.close()
            raise
        try:
            replies = [await conn.request(b"".join(self._hello))]
            for _ in self._hello[1:]:  # every reply read, even after an error
                replies.append(await conn.reply())
            for reply in replies:
                _check(reply)
        except BaseException:
            conn.close()
            raise
        return conn

    async def warm(self) -> None:
        """Open connections up to the pool's size, so that a decision finds one open
        rather than connecting (TCP, AUTH, SELECT) within its own deadline — under a
        flood this process's event loop alone can take longer than that."""
        while self._open < self.max_connections and not self._waiting:
            self._open += 1
            try:
                conn = await self._connect()
            except BaseException:
                self._open -= 1
                self._wake(1)
                raise
            self._release(conn)

    def close(self) -> int:
        """Close the idle connections (those in use close when their request ends);
        how many were closed."""
        closed = len(self._idle)
        while self._idle:
            self._idle.pop().close()
            self._open -= 1
        return closed

    # -- commands ---------------------------------------------------------------------

    async def execute(self, *args: bytes | str | int | float) -> Reply:
        """One command; its reply (an error reply raises `RespError`)."""
        data = encode_command(*args)
        conn = await self._acquire()
        try:
            reply = await conn.request(data)
        except BaseException:
            self._discard(conn)
            raise
        self._release(conn)
        return _check(reply)

    async def script_load(self, script: Script) -> None:
        sha = await self.execute(b"SCRIPT", b"LOAD", script.body)
        if sha != script.sha:
            raise RespError(f"SCRIPT LOAD answered {sha!r}, not the script's SHA1")

    async def evalsha(self, script: Script, keys: Sequence[str], args: Sequence[str]) -> Reply:
        """EVALSHA; a Redis that forgot the script (restart, SCRIPT FLUSH) is given it
        again with SCRIPT LOAD on the same connection, then asked once more."""
        data = encode_command(b"EVALSHA", script.sha, len(keys), *keys, *args)
        conn = await self._acquire()
        try:
            reply = await conn.request(data)
            if isinstance(reply, RespError) and reply.kind == "NOSCRIPT":
                loaded = _check(await conn.request(
                    encode_command(b"SCRIPT", b"LOAD", script.body)))
                if loaded != script.sha:
                    raise RespError(f"SCRIPT LOAD answered {loaded!r}, not the script's SHA1")
                reply = await conn.request(data)
        except RespError:
            self._release(conn)  # an error reply: the stream is still in step
            raise
        except BaseException:
            self._discard(conn)
            raise
        self._release(conn)
        return _check(reply)
