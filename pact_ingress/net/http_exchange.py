"""One request/response exchange as the terminate engine sees it, on either HTTP version.

`net.http1` and `net.http2` turn a client connection into a sequence (HTTP/1.1) or a set
(HTTP/2) of `Exchange` objects; `net.terminate` runs the request story on each without
knowing the version. Every wait on the client inside an exchange takes an absolute
deadline (`trio.current_time()` based) and raises `ClientGone` when it passes, the
client disconnects, or the stream is reset, so no exchange can outlive its budget.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import trio

from pact_ingress.net import readiness
from pact_ingress.net.memory_tls import ServerStream

Headers = list[tuple[bytes, bytes]]


class ClientGone(Exception):
    """The client disconnected, reset the stream, or missed a deadline mid-exchange."""


async def send_to_client(stream: trio.abc.SendStream, data: bytes, timeout: float) -> None:
    """Write to the client connection, both HTTP versions alike: a client that breaks the
    connection or stops reading for `timeout` seconds is gone (`ClientGone`), so a slow
    reader cannot hold a response, and its upstream request, open."""
    if isinstance(stream, ServerStream):  # no cancel scope unless the write has to wait
        try:
            await stream.send_by(data, trio.current_time() + timeout)
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone("client connection broke") from exc
        except trio.TooSlowError:
            raise ClientGone("client did not read in time") from None
    with trio.move_on_after(timeout):
        try:
            await stream.send_all(data)
            return
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise ClientGone("client connection broke") from exc
    raise ClientGone("client did not read in time")


@dataclass
class Exchange(abc.ABC):
    method: str
    target: bytes  # as sent: origin-form or absolute-form (HTTP/1.1), :path (HTTP/2)
    headers: Headers  # lower-case names, no pseudo-headers
    authority: bytes | None  # Host (HTTP/1.1) or :authority (HTTP/2)
    content_length: int | None  # declared, when it was
    body_done: bool  # nothing (more) of the request body will arrive

    @property
    def has_body(self) -> bool:
        """A declared length decides; without one, whether more may still arrive."""
        if self.content_length is not None:
            return self.content_length > 0
        return not self.body_done

    @abc.abstractmethod
    async def receive(self, deadline: float) -> bytes:
        """The next body chunk, b"" once the body is complete; `ClientGone` otherwise."""

    @abc.abstractmethod
    async def respond(self, status: int, headers: Headers) -> None:
        """Send the response head (`headers` already clean, no framing of the client leg)."""

    @abc.abstractmethod
    async def send(self, chunk: bytes) -> None:
        """Send response body bytes; `ClientGone` if the client cannot take them in time."""

    @abc.abstractmethod
    async def end(self) -> None:
        """The response is complete."""

    async def respond_whole(self, status: int, headers: Headers, body: bytes) -> None:
        """`respond`, `send(body)` and `end` at once: the whole response is at hand."""
        await self.respond(status, headers)
        if body:
            await self.send(body)
        await self.end()

    @abc.abstractmethod
    async def abort(self) -> None:
        """The response cannot be completed: make the client see a failure, not a short body."""

    @abc.abstractmethod
    async def wait_gone(self) -> None:
        """Return once the client is known to have gone (used while a response streams)."""

    def reset_watch(self) -> readiness.Watch | None:
        """The client socket's Watch in the readiness hub (joined now if need be), for
        the hub to see a reset while the node is asked (connected to, sent the request,
        awaited), when nothing else would notice one then: None where something does
        (an HTTP/2 connection's reader ends its streams itself). Its `on_fin` is set:
        at the client's FIN, what the TLS engine held for it is sent, which a client
        that closed for good answers with a reset. The caller clears both hooks."""
        return None

    def connection_scope(self) -> trio.CancelScope | None:
        """The scope of the connection's serving, which ends it when cancelled; None if
        it has none (yet)."""
        return None

    def needs_watch(self, response_headers: Headers) -> bool:
        """Must `wait_gone` be watched while this response is relayed? Only where nothing
        else would notice the client leaving in time (see the implementations)."""
        return True

    @abc.abstractmethod
    def stop_body(self) -> None:
        """The answer was given before the request body was read: stop the upload
        (HTTP/2 resets the stream with NO_ERROR; HTTP/1.1 closes after the answer)."""


class BadResponse(Exception):
    """The node's response cannot be expressed on the client's leg (invalid header...)."""


class HeadTooLarge(BadResponse):
    """The answer's head is larger than the client said it takes (HTTP/2's
    SETTINGS_MAX_HEADER_LIST_SIZE): the client's own setting, not the node's fault."""


class BodyBuffer:
    """A request body gathered whole, costing about its bytes however it was cut up: the
    buffer shares count bytes, and a client that sends a byte or two per TLS record (or
    per HTTP/2 DATA frame) makes each a chunk of its own, an object some twenty times its
    size were the chunks kept one by one."""

    __slots__ = ("_first", "_rest", "size")

    def __init__(self) -> None:
        self._first = b""  # the usual body arrives in one chunk: kept as it is, no copy
        self._rest: bytearray | None = None
        self.size = 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        rest = self._rest
        if rest is not None:
            rest += chunk
        elif not self._first:
            self._first = chunk
        else:
            self._rest = bytearray(self._first) + chunk
            self._first = b""

    def whole(self) -> bytes:
        return bytes(self._rest) if self._rest is not None else self._first
