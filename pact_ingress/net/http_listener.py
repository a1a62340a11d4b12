"""The plain-HTTP :80 listener: ACME HTTP-01 answers, everything else 308 → https.

Deliberately tiny and strict. One request per connection (we answer with
`Connection: close`), parsed by h11 with the request head capped at `MAX_HEAD_BYTES`; a
request body is never read. The whole exchange has one deadline (`REQUEST_TIMEOUT`) and
at most `MAX_CONNECTIONS` connections are served at once, at most
`MAX_CONNECTIONS_PER_IP` of them for one client; beyond that new ones are closed at
accept. Nothing here proxies: port 80 carries no application traffic.

After an answer the connection lingers (`net.linger`): closed with bytes the client sent
still unread (a body, a pipelined request), the socket would be reset, and the reset
throws away what our kernel has not delivered yet: the tail of the answer, for a client
with a small window.

`plan_response` is the pure decision (method, target, Host → status, headers, body) so it
is tested without sockets; `handle_http` is the I/O around it.
"""

from __future__ import annotations

import errno
import re
from dataclasses import dataclass, field
from typing import Protocol

import h11
import trio

from pact_ingress.errors import ListenError
from pact_ingress.logs import log
from pact_ingress.model import Address
from pact_ingress.net.linger import linger
from pact_ingress.net.router import client_of
from pact_ingress.net.shortage import ACCEPT_BACKOFF, ShortageEpisode

#: Largest request head we accept (request line + headers); ACME validators send ~300 B.
MAX_HEAD_BYTES = 8 * 1024
#: One deadline for reading the request and writing the answer, seconds.
REQUEST_TIMEOUT = 10.0
#: Connections served at once; more are closed at accept (port 80 is not worth more).
MAX_CONNECTIONS = 1024
#: Connections one client (an IPv4 address, an IPv6 /64) may hold at once, so that one
#: address holding idle connections cannot take the slots a CA's validation needs.
MAX_CONNECTIONS_PER_IP = 32
#: Bytes per receive call.
READ_SIZE = 4096
#: After the answer, how long and how much of what the client still sends is dropped at
#: most while it has not acknowledged the answer (it ends as soon as it has, or closes).
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 * 1024

CHALLENGE_PREFIX = "/.well-known/acme-challenge/"
#: ACME tokens are base64url (RFC 8555 §8.1), at least 128 bits of entropy.
TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{16,256}")
#: Host header: a DNS name, optional port (dropped in the redirect). The redirect goes
#: to the name the client asked for, whatever it is, as a plain-HTTP request for any name
#: pointed at this address is fair; what is not a DNS name (longer than `MAX_NAME`, or
#: not matching) gets 400.
MAX_NAME = 253
HOST_RE = re.compile(r"(?P<name>([a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?\.)*"
                     r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?)\.?(:[0-9]{1,5})?")
#: A redirect target may only carry printable ASCII without spaces.
TARGET_RE = re.compile(r"/[\x21-\x7e]*")


class Http01Answers(Protocol):
    def http01_response(self, host: str, token: str) -> bytes | None: ...


class Http01Lookup(Protocol):
    """Where `handle_http` looks answers up: may ask the shared state (a round trip)."""

    async def find_http01(self, host: str, token: str) -> bytes | None: ...


@dataclass(frozen=True)
class _Found:
    """The one answer looked up for a request, as `plan_response` asks for it."""

    host: str
    token: str
    value: bytes | None

    def http01_response(self, host: str, token: str) -> bytes | None:
        return self.value if (host, token) == (self.host, self.token) else None


async def _look_up(answers: Http01Lookup, target: str, host_header: str | None) -> _Found:
    m = HOST_RE.fullmatch((host_header or "").lower())
    token = target[len(CHALLENGE_PREFIX):] if target.startswith(CHALLENGE_PREFIX) else ""
    if m is None or not TOKEN_RE.fullmatch(token):
        return _Found("", "", None)
    return _Found(m["name"], token, await answers.find_http01(m["name"], token))


@dataclass(frozen=True)
class Answer:
    status: int
    headers: tuple[tuple[str, str], ...]
    body: bytes


def plan_response(method: str, target: str, host_header: str | None,
                  answers: Http01Answers) -> Answer:
    """What to send for one request (pure; see module docstring)."""
    m = HOST_RE.fullmatch((host_header or "").lower())
    if m is None or len(m["name"]) > MAX_NAME:
        return _text(400, "missing or invalid Host header\n")
    host = m["name"]
    if target.startswith(CHALLENGE_PREFIX):
        token = target[len(CHALLENGE_PREFIX):]
        key_authz = answers.http01_response(host, token) if TOKEN_RE.fullmatch(token) else None
        if key_authz is None:
            return _text(404, "no such challenge\n")
        if method not in ("GET", "HEAD"):
            return _text(405, "method not allowed\n", (("Allow", "GET, HEAD"),))
        return Answer(200, (("Content-Type", "application/octet-stream"),), key_authz)
    path = target if TARGET_RE.fullmatch(target) else "/"
    return _text(308, "redirecting to https\n", (("Location", f"https://{host}{path}"),))


def _text(status: int, text: str, extra: tuple[tuple[str, str], ...] = ()) -> Answer:
    return Answer(status, (("Content-Type", "text/plain; charset=utf-8"),) + extra,
                  text.encode())


async def handle_http(stream: trio.abc.Stream, answers: Http01Lookup) -> None:
    """Serve one connection: one request, one answer, close."""
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    answered = False
    try:
        with trio.move_on_after(REQUEST_TIMEOUT):
            request = await _read_request(stream, conn)
            if request is None:
                return
            target = request.target.decode("ascii", "replace")
            host = next((v.decode("ascii", "replace") for k, v in request.headers
                         if k == b"host"), None)
            method = request.method.decode("ascii", "replace")
            answer = plan_response(method, target, host, await _look_up(answers, target, host))
            if target.startswith(CHALLENGE_PREFIX):
                # a Host can be most of the 8 KiB head: the line keeps what a name can be
                log.info("acme_http01_request", host=host if host is None else host[:MAX_NAME + 6],
                         status=answer.status)
            await _send(stream, conn, answer, head_only=method == "HEAD")
            answered = True
    except h11.RemoteProtocolError as exc:
        answered = await _send_raw_error(stream, exc.error_status_hint)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass
    finally:
        try:
            sock = getattr(stream, "socket", None)
            if answered and sock is not None:
                await linger(sock, LINGER_SECONDS, LINGER_BYTES)
        finally:
            await trio.aclose_forcefully(stream)


async def _read_request(stream: trio.abc.Stream, conn: h11.Connection) -> h11.Request | None:
    received = 0
    while True:  # bounded by REQUEST_TIMEOUT and the head cap
        event = conn.next_event()
        if isinstance(event, h11.Request):
            return event
        if event is h11.NEED_DATA:
            # h11 checks its cap only while a head is incomplete, so a head finished by the
            # read that crossed the cap would pass; never read past the cap instead
            if received >= MAX_HEAD_BYTES:
                raise h11.RemoteProtocolError("request head too large", error_status_hint=431)
            data = await stream.receive_some(min(READ_SIZE, MAX_HEAD_BYTES - received))
            received += len(data)
            conn.receive_data(bytes(data))  # b"" = EOF, h11 knows
            continue
        return None  # ConnectionClosed (peer left before a request) or anything unexpected


async def _send(stream: trio.abc.Stream, conn: h11.Connection, answer: Answer, *,
                head_only: bool) -> None:
    headers = list(answer.headers) + [("Content-Length", str(len(answer.body))),
                                      ("Connection", "close")]
    data = conn.send(h11.Response(status_code=answer.status, headers=headers)) or b""
    if not head_only:
        data += conn.send(h11.Data(data=answer.body)) or b""
    data += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(data)


async def _send_raw_error(stream: trio.abc.Stream, status: int) -> bool:
    """The error answer, in at most a second; True once it was handed to the kernel."""
    body = b"bad request\n"
    head = (f"HTTP/1.1 {status} Bad Request\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with trio.move_on_after(1.0):
        try:
            await stream.send_all(head + body)
            return True
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
    return False


async def serve_http(address: Address, answers: Http01Lookup, *,
                     task_status: trio.TaskStatus[tuple[str, int]] = trio.TASK_STATUS_IGNORED
                     ) -> None:
    """Listen on `address` until cancelled; `task_status.started((host, port))` once bound."""
    try:
        listeners = await trio.open_tcp_listeners(address.port, host=address.host)
    except OSError as exc:
        raise ListenError.binding(str(address), exc) from exc
    slots = _Slots()
    bound = listeners[0].socket.getsockname()[:2]
    # as the config writes it (IPv6 in brackets): "::1:8080" is no address one could use
    log.info("http_listening", address=str(Address(str(bound[0]), int(bound[1]))))
    episode = ShortageEpisode("http_accept_error")
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, answers, slots, nursery, episode)
        task_status.started((str(bound[0]), int(bound[1])))


async def _accept_loop(listener: trio.SocketListener, answers: Http01Lookup,
                       slots: _Slots, nursery: trio.Nursery, episode: ShortageEpisode) -> None:
    async with listener:
        while True:  # runs until cancelled; every accepted stream is handled or closed
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and friends: back off, keep listening
                episode.failed(errno.errorcode.get(exc.errno or 0, str(exc)),
                               trio.current_time())
                await trio.sleep(ACCEPT_BACKOFF)
                continue
            if episode.failures:
                episode.accepted(trio.current_time())
            try:
                who = client_of(str(stream.socket.getpeername()[0]))
            except OSError:  # the peer is already gone
                who = None
            if who is None or not slots.take(who):
                await trio.aclose_forcefully(stream)
                continue
            nursery.start_soon(_serve_one, stream, answers, slots, who)


@dataclass
class _Slots:
    """Connections being served, in total and per client (see `MAX_CONNECTIONS_PER_IP`)."""

    free: int = MAX_CONNECTIONS
    by_client: dict[str, int] = field(default_factory=dict)

    def take(self, who: str) -> bool:
        held = self.by_client.get(who, 0)
        if self.free == 0 or held >= MAX_CONNECTIONS_PER_IP:
            return False
        self.free -= 1
        self.by_client[who] = held + 1
        return True

    def give(self, who: str) -> None:
        self.free += 1
        held = self.by_client.pop(who) - 1
        if held:
            self.by_client[who] = held


async def _serve_one(stream: trio.SocketStream, answers: Http01Lookup,
                     slots: _Slots, who: str) -> None:
    try:
        await handle_http(stream, answers)
    finally:
        slots.give(who)
