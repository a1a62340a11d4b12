"""The admin endpoint: /metrics, /status, the status page, reload and certificate renewal.

Theory of operation
-------------------
The admin surface is for the operator of this machine, so by default it is reachable only
from this machine: a loopback TCP address or a unix socket (`listen.admin`). Binding any
other address needs two explicit opt-ins, `allow_remote=True` and a bearer `token`; without
them `serve_admin` raises `ConfigError` before a socket exists. With a token every request
must carry `Authorization: Bearer <token>` (compared in constant time).

Two browser attacks reach loopback services and are closed here:
- DNS rebinding (a web page whose name re-resolves to 127.0.0.1 reads /status): on a TCP
  bind without a token, the `Host` header must name a loopback literal or `localhost`.
- Cross-site POST (a page submits a form to 127.0.0.1/reload): action endpoints refuse
  requests that carry browser-only headers (`Origin`, `Sec-Fetch-Site` other than
  `none`). The CLI client (`client.py`) sends neither; the status page has no forms.

Why hypercorn and not a hand-rolled HTTP/1.1 server: it brings h11's strict parsing,
keep-alive, request-size caps and timeouts for free, and the admin endpoint is no hot path
that would pay for its generality; a hand-rolled parser would be one more HTTP
implementation to harden. We create and bind the listening socket ourselves (to check the
resolved address, to make the unix socket mode 0600 before it listens, and to report a TCP
port 0's real port) and hand it to `hypercorn.trio.run.worker_serve(sockets=...)`, the
same entry point `hypercorn.trio.serve` uses after its own bind. The app is a tiny ASGI
callable; every handler is a small function returning (status, headers, body).
"""

from __future__ import annotations

import hmac
import inspect
import ipaddress
import json
import logging
import math
import os
import socket
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from hypercorn.trio.run import worker_serve
from hypercorn.utils import wrap_app
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pact_ingress.admin.page import render_page
from pact_ingress.errors import ConfigError, ListenError
from pact_ingress.logs import log
from pact_ingress.model import Address
from pact_ingress.stats import Stats

StatusFn = Callable[[], dict[str, Any] | Awaitable[dict[str, Any]]]
MetricsFn = Callable[[], Awaitable[bytes]]
ReloadFn = Callable[[], Awaitable[tuple[bool, str]]]
RenewFn = Callable[[str | None], Awaitable[tuple[bool, str]]]

#: File mode of the unix admin socket: owner only (the service user; root bypasses it).
UNIX_SOCKET_MODE = 0o600

#: A token guarding a non-loopback admin bind must be at least this long (~128 bits hex).
MIN_TOKEN_LENGTH = 32

#: Pending connections on the admin socket; it serves one operator, not the public.
ADMIN_BACKLOG = 16

#: Largest request head hypercorn buffers for us (h11's default is 16 KiB).
MAX_REQUEST_HEAD = 16 * 1024

#: No admin endpoint takes a body; a request carrying more than this is answered 413
#: (after it is read to its end, see `AdminApp.__call__`).
MAX_REQUEST_BODY = 64 * 1024

#: A request without the token has its body (if announced no longer than
#: MAX_REQUEST_BODY) read for at most this long before the 401, so that a peer that
#: trickles it holds its connection no longer than this (see `AdminApp.__call__`).
UNAUTHORIZED_BODY_WAIT = 1.0

#: Idle keep-alive connections are closed after this many seconds.
KEEP_ALIVE_SECONDS = 5.0

#: A connection that sends nothing for this long is closed (slow-loris bound). hypercorn
#: applies it to every read, also while our handler runs, so it must exceed the longest
#: action: POST /certs/renew orders a certificate and the CLI waits up to 120 s for it.
READ_TIMEOUT_SECONDS = 180

#: Host header names that are fine on a tokenless loopback bind (DNS-rebinding guard).
_LOOPBACK_HOSTNAMES = frozenset({"localhost", "localhost.localdomain"})

_HTTP_LOG = logging.getLogger("pact_ingress.admin.http")
_HTTP_LOG.setLevel(logging.WARNING)  # hypercorn's "Running on …" banner is not for us


class _AcceptEpisodes(logging.Filter):
    """hypercorn accepts with trio's `serve_listeners`, which logs every accept that
    fails for want of fds, traceback and all, at each 100 ms back-off for as long as the
    shortage lasts. One JSON line per episode instead; that loop reports no success to
    end one, so a failure `gap` seconds after the previous one starts the next."""

    def __init__(self, gap: float = 2.0) -> None:
        super().__init__()
        self.gap = gap
        self.last = -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("accept returned"):
            return True
        if record.created - self.last > self.gap:
            error = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            log.error("admin_accept_failed", error=str(error), backoff_s=0.1)
        self.last = record.created
        return False


_ACCEPT_EPISODES = _AcceptEpisodes()

Headers = list[tuple[bytes, bytes]]
ExtraHeaders = Sequence[tuple[bytes, bytes]]
Response = tuple[int, Headers, bytes]


# ---- binding -------------------------------------------------------------------------

def _is_loopback(ip: str) -> bool:
    return ipaddress.ip_address(ip.split("%", 1)[0]).is_loopback


async def _resolve(addr: Address) -> tuple[int, tuple[Any, ...]]:
    """(family, sockaddr) of the first address `addr.host` resolves to."""
    try:
        infos = await trio.socket.getaddrinfo(addr.host, addr.port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise ConfigError(f"listen.admin {addr}: cannot resolve: {exc}") from exc
    family, _, _, _, sockaddr = infos[0]
    return family, sockaddr


def _check_remote(addr: Address, ip: str, token: str | None, allow_remote: bool) -> None:
    if _is_loopback(ip):
        return
    if not allow_remote or not token:
        raise ConfigError(
            f"listen.admin {addr} ({ip}) is not a loopback address; the admin endpoint "
            "serves metrics, tenant data and reload to whoever reaches it. Bind 127.0.0.1, "
            "::1 or a unix socket, or allow remote access explicitly with a token")
    if len(token) < MIN_TOKEN_LENGTH:
        raise ConfigError(
            f"listen.admin {addr}: a remote admin token needs at least {MIN_TOKEN_LENGTH} chars")


def _bind_tcp(family: int, sockaddr: tuple[Any, ...]) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(sockaddr)
    except OSError:
        sock.close()
        raise
    return sock


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"listen.admin unix:{path}: exists and is not a socket")
    # A socket someone still listens on (another instance's admin endpoint) is not stale:
    # removing it would cut its operator off. Only a refused connect proves it dead.
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(1.0)
        probe.connect(str(path))
    except ConnectionRefusedError:
        pass
    except OSError as exc:
        raise ConfigError(f"listen.admin unix:{path}: exists and cannot be checked: "
                          f"{exc.strerror or exc}") from exc
    else:
        raise ConfigError(f"listen.admin unix:{path}: in use by another process")
    finally:
        probe.close()
    path.unlink()


def _bind_unix(path: Path) -> socket.socket:
    _remove_stale_socket(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(path))
        os.chmod(path, UNIX_SOCKET_MODE)  # before listen(): nobody can connect in between
    except OSError:
        sock.close()
        raise
    return sock


async def _bind(
    listen: Address | Path, token: str | None, allow_remote: bool
) -> tuple[socket.socket, Address | Path]:
    """A bound (not yet listening) socket and the address to report as started."""
    if isinstance(listen, Path):
        try:
            return _bind_unix(listen), listen
        except OSError as exc:
            raise ConfigError(f"listen.admin unix:{listen}: {exc.strerror or exc}") from exc
    family, sockaddr = await _resolve(listen)
    _check_remote(listen, sockaddr[0], token, allow_remote)
    try:
        sock = _bind_tcp(family, sockaddr)
    except OSError as exc:  # the config is fine; the machine is not ready for it
        raise ListenError.binding(str(listen), exc) from exc
    host, port = sock.getsockname()[:2]
    return sock, Address(host, port)


# ---- the ASGI app --------------------------------------------------------------------

def _response(
    status: int, body: bytes, content_type: str, extra: ExtraHeaders = ()
) -> Response:
    headers = [
        (b"content-type", content_type.encode()),
        (b"cache-control", b"no-store"),
        (b"x-content-type-options", b"nosniff"),
        *extra,
    ]
    return status, headers, body


def _json(status: int, data: dict[str, Any]) -> Response:
    return _response(status, json.dumps(data, indent=1).encode() + b"\n", "application/json")


def _error(status: int, message: str, extra: ExtraHeaders = ()) -> Response:
    body = json.dumps({"ok": False, "message": message}).encode() + b"\n"
    return _response(status, body, "application/json", extra)


def _unauthorized(*extra: tuple[bytes, bytes]) -> Response:
    return _error(401, "admin token required", [(b"www-authenticate", b"Bearer"), *extra])


#: For an answer that a shortage (of fds) prevented: worth asking again shortly.
_RETRY_SOON: Headers = [(b"retry-after", b"1")]

_PAGE_HEADERS: Headers = [
    (b"content-security-policy",
     b"default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'none'"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
]


class AdminApp:
    """ASGI app for the admin endpoint; see the module docstring for the guards."""

    def __init__(
        self, *, stats: Stats, status: StatusFn, reload: ReloadFn, renew: RenewFn | None,
        token: str | None, check_host: bool, clock: Callable[[], float] = time.time,
        metrics: MetricsFn | None = None,
    ) -> None:
        self.stats = stats
        self.status = status
        #: The instance's metrics when it is more than this process (worker processes);
        #: None: this process's registry is the instance.
        self.metrics = metrics
        self.reload = reload
        self.renew = renew
        self.token = token
        self.check_host = check_host
        self.clock = clock
        self._action_lock = trio.Lock()  # one reload or renewal at a time

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if self.token is not None and not self._token_given(scope):
            # Checked on the head: a peer without the token is not worth reading a long
            # body for (a large upload, or one trickled in, would hold the connection
            # and its fd for as long as it lasts). `Connection: close` makes hypercorn
            # end the connection after this answer instead of reading on. But a short
            # body is taken to its end first, within UNAUTHORIZED_BODY_WAIT: once our
            # answer has said "close", any byte past the body (a pipelined request) is
            # a protocol error to hypercorn's reader, which then shuts and closes the
            # socket without waiting for the writer — our answer, half written or not
            # at all, was lost. With the body read, those bytes wait (unparsed) until
            # the answer is out. A body still arriving when the wait ends, or one
            # announced longer than MAX_REQUEST_BODY, is answered at once, as before.
            if (not _declares_body_over(scope, MAX_REQUEST_BODY)
                    and await _read_body_briefly(receive) is None):
                return
            status, headers, body = _unauthorized((b"connection", b"close"))
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})
            return
        # Answer only once the request has been read to its end. hypercorn answers a body
        # that breaks the HTTP framing with its own 400 from the task that reads; were our
        # answer being written at that moment, the two writes would collide on the socket
        # and the error would tear down the server and the process with it. After a
        # complete request nothing more is parsed until our answer is out.
        size = await _read_body(receive)
        if size is None:
            return  # the client went away, or hypercorn refused the body and closed
        if size > MAX_REQUEST_BODY:
            status, headers, body = _error(413, "admin requests carry no body")
        else:
            status, headers, body = await self.handle(scope)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    async def _lifespan(receive: Any, send: Any) -> None:
        for _ in range(2):  # startup, then shutdown
            message = await receive()
            kind = message["type"].rsplit(".", 1)[-1]
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return

    async def handle(self, scope: dict[str, Any]) -> Response:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope.get("headers", [])}
        refused = self._guard(headers)
        if refused is not None:
            return refused
        method, path = scope["method"], scope["path"]
        query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
        if method in ("GET", "HEAD") and path in _GETS:
            status, hdrs, body = await _GETS[path](self)
            return status, hdrs, b"" if method == "HEAD" else body
        if method == "POST" and path in _POSTS:
            if _from_browser(headers):
                return _error(403, "action endpoints do not accept browser requests")
            return await _POSTS[path](self, query)
        if path in _GETS or path in _POSTS:
            allow = b"GET, HEAD" if path in _GETS else b"POST"
            return _error(405, f"{method} not allowed on {path}", [(b"allow", allow)])
        return _error(404, f"no such admin resource: {path}")

    def _token_given(self, scope: dict[str, Any]) -> bool:
        """The request carries one `Authorization` with the token (`_bearer_is`); a
        repeated field is no token."""
        given = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
        return len(given) == 1 and _bearer_is(given[0], self.token)

    def _guard(self, headers: dict[str, str]) -> Response | None:
        """Token and Host checks; a refusal response, or None to proceed."""
        if self.token is not None:
            if not _bearer_is(headers.get("authorization", "").encode(), self.token):
                return _unauthorized()
        elif self.check_host and not _loopback_host(headers.get("host", "")):
            return _error(421, "Host header must name a loopback address")
        return None

    # -- GET handlers --

    async def get_metrics(self) -> Response:
        try:
            if self.metrics is not None:
                return _response(200, await self.metrics(), CONTENT_TYPE_LATEST)
            return _response(200, generate_latest(self.stats.registry), CONTENT_TYPE_LATEST)
        except OSError as exc:  # out of fds: the workers' metrics, /proc cannot be read
            log.error("admin_metrics_failed", error=repr(exc))
            return _error(503, f"metrics unavailable: {exc!r}", _RETRY_SOON)

    async def _status_doc(self) -> dict[str, Any] | Response:
        try:
            doc = self.status()
            if inspect.isawaitable(doc):
                doc = await doc
            return doc
        except Exception as exc:
            log.error("admin_status_failed", error=repr(exc))
            if isinstance(exc, OSError):  # out of fds, most likely: it passes
                return _error(503, f"status unavailable: {exc!r}", _RETRY_SOON)
            return _error(500, f"status unavailable: {exc!r}")

    async def get_status(self) -> Response:
        doc = await self._status_doc()
        return doc if isinstance(doc, tuple) else _json(200, doc)

    async def get_page(self) -> Response:
        doc = await self._status_doc()
        if isinstance(doc, tuple):
            return doc
        page = render_page(doc, now=self.clock()).encode()
        return _response(200, page, "text/html; charset=utf-8", _PAGE_HEADERS)

    # -- POST handlers --

    async def post_reload(self, query: dict[str, list[str]]) -> Response:
        async with self._action_lock:
            ok, message = await self.reload()
        return _json(200 if ok else 422, {"ok": ok, "message": message})

    async def post_renew(self, query: dict[str, list[str]]) -> Response:
        if self.renew is None:
            return _error(404, "certificate renewal is not available on this instance")
        hosts = query.get("host") or [""]
        host = hosts[0] or None
        async with self._action_lock:
            ok, message = await self.renew(host)
        return _json(200 if ok else 422, {"ok": ok, "message": message, "host": host})


_GETS: dict[str, Callable[[AdminApp], Awaitable[Response]]] = {
    "/": AdminApp.get_page,
    "/status": AdminApp.get_status,
    "/metrics": AdminApp.get_metrics,
}
_POSTS: dict[str, Callable[[AdminApp, dict[str, list[str]]], Awaitable[Response]]] = {
    "/reload": AdminApp.post_reload,
    "/certs/renew": AdminApp.post_renew,
}


def _bearer_is(value: bytes, token: str | None) -> bool:
    """Is an `Authorization` value `Bearer <token>`? The scheme's name is
    case-insensitive (RFC 9110 §11.1: clients and libraries send `bearer` too); the rest
    is exactly one space and the token, compared in constant time."""
    scheme, space, credentials = value.partition(b" ")
    return (token is not None and space == b" " and scheme.lower() == b"bearer"
            and hmac.compare_digest(credentials, token.encode()))


def _declares_body_over(scope: dict[str, Any], limit: int) -> bool:
    """Does the request head announce a body longer than `limit` by its Content-Length?
    (h11 has checked the field before the app sees the head; a chunked body's size
    is not announced.)"""
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value) > limit
            except ValueError:
                return True
    return False


async def _read_body_briefly(receive: Any) -> int | None:
    """Reads (and drops) the request body for at most UNAUTHORIZED_BODY_WAIT and about
    MAX_REQUEST_BODY bytes; the bytes read, or None when the client went away (or
    hypercorn refused the body). Stopping early leaves the rest unread."""
    size = 0
    with trio.move_on_after(UNAUTHORIZED_BODY_WAIT):
        while size <= MAX_REQUEST_BODY:
            message = await receive()
            if message["type"] != "http.request":
                return None
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                break
    return size


async def _read_body(receive: Any) -> int | None:
    """Reads (and drops) the request body; its size, or None when the request ended
    without one complete (a disconnect, or a framing error hypercorn has answered)."""
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return None
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            return size


def _loopback_host(host: str) -> bool:
    """True when a Host header names this machine's loopback (any port)."""
    name = host.strip().lower()
    if name.startswith("["):
        name = name[1:].split("]", 1)[0]
    elif name.count(":") == 1:
        name = name.split(":", 1)[0]
    if name in _LOOPBACK_HOSTNAMES:
        return True
    try:
        return _is_loopback(name)
    except ValueError:
        return False


def _from_browser(headers: dict[str, str]) -> bool:
    """Requests a web page could make carry Origin or a non-'none' Sec-Fetch-Site."""
    return "origin" in headers or headers.get("sec-fetch-site", "none") != "none"


def _hypercorn_config() -> HypercornConfig:
    config = HypercornConfig()
    config.errorlog = _HTTP_LOG
    config.accesslog = None
    config.include_server_header = False
    config.keep_alive_timeout = KEEP_ALIVE_SECONDS
    config.read_timeout = READ_TIMEOUT_SECONDS
    config.h11_max_incomplete_size = MAX_REQUEST_HEAD
    config.backlog = ADMIN_BACKLOG
    return config


async def serve_admin(
    listen: Address | Path,
    *,
    stats: Stats,
    status: StatusFn,
    reload: ReloadFn,
    renew: RenewFn | None = None,
    token: str | None = None,
    allow_remote: bool = False,
    metrics: MetricsFn | None = None,
    task_status: trio.TaskStatus[Address | Path] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the admin endpoint until cancelled.

    `task_status.started()` receives the bound address: an `Address` with the real port
    (for port 0) or the unix socket `Path`. Raises `ConfigError` for a non-loopback bind
    without `allow_remote` and a token; `ListenError` when the address cannot be bound.
    """
    if token is not None and not token:
        raise ConfigError("admin token must not be empty")
    sock, bound = await _bind(listen, token, allow_remote)
    app = AdminApp(stats=stats, status=status, reload=reload, renew=renew, token=token,
                   check_host=isinstance(bound, Address), metrics=metrics)
    config = _hypercorn_config()
    logging.getLogger("trio.serve_listeners").addFilter(_ACCEPT_EPISODES)  # idempotent
    try:
        sock.listen(ADMIN_BACKLOG)
        sock.setblocking(False)
        asgi: Any = app  # an ASGI callable; hypercorn's Protocol types are stricter than ours
        serve = partial(worker_serve, wrap_app(asgi, config.wsgi_max_body_size, "asgi"),
                        config, sockets=Sockets([], [sock], []))
        async with trio.open_nursery() as nursery:
            await nursery.start(serve)
            log.info("admin_listening", address=str(bound if isinstance(bound, Address)
                                                  else f"unix:{bound}"))
            task_status.started(bound)
    finally:
        sock.close()
        if isinstance(bound, Path):
            _unlink_quietly(bound)


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
