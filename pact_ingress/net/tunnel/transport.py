"""How the connector makes one data connection: the two ways, behind one interface.

A `Transport` turns a token into what a `StreamJob` needs: either how to dial (`Dial`,
which the job runs on its own thread) or a connection already made (a socket and any
stream bytes that came with it).

* `RawTransport`, the default: plain TCP to the ingress, `RAW_DATA_MAGIC` and DATA_HELLO
  in one write, DATA_OK back. All of it runs on the job's thread, so a replacement dial
  costs the trio thread nothing. The token alone is the credential (why that is enough:
  the security argument in `net/tunnel/server.py`).
* `TlsTransport`, the fallback for networks that pass only TLS on 443: pinned mutual TLS
  with ALPN `pact-tunnel-data/1`, DATA_HELLO and DATA_OK inside, then TLS unwrapped
  (close_notify both ways) and trio lets go of the socket: from then on the job owns
  it like a raw one. A full handshake on both ends per connection: CPU, not security.

Which one the connector uses, and when it switches, is its policy (`data_transport`:
raw, tls, or auto = raw until raw connections keep failing); this module only makes
connections.
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

import trio

from pact_ingress.errors import RemoteProtocolError
from pact_ingress.net.tunnel.common import read_message, set_keepalive
from pact_ingress.net.tunnel.stream_job import Dial
from pact_ingress.proto.tunnel import frames as tf
from pact_ingress.proto.tunnel.constants import DATA_OK

#: What a transport hands a job: how to dial, or a made connection; then stream bytes
#: that came with DATA_OK (b"" for a `Dial`: the job reads those itself).
Source = tuple[socket.socket | Dial, bytes]


class Transport(Protocol):
    #: "raw" | "tls": logs and the connector's `raw_data`.
    name: str

    async def connect(self, token: bytes, delay: float) -> Source:
        """A data connection for `token`, started `delay` seconds from now (or how to
        make it). Raises if it could not be made; the caller bounds nothing: each
        transport keeps its own deadlines."""
        ...


@dataclass(frozen=True)
class RawTransport:
    host: str
    port: int
    connect_timeout: float
    handshake_timeout: float
    name: str = "raw"

    async def connect(self, token: bytes, delay: float) -> Source:
        # no I/O here: the job dials on its own thread (the delay is slept there too)
        return Dial(self.host, self.port, tf.raw_data_preamble(token), DATA_OK, delay,
                    self.connect_timeout, self.handshake_timeout, set_keepalive), b""


@dataclass(frozen=True)
class TlsTransport:
    #: TCP + TLS to the ingress with the data ALPN, the ingress's pin checked.
    dial: Callable[[], Awaitable[trio.SSLStream[trio.SocketStream]]]
    connect_timeout: float
    handshake_timeout: float
    name: str = "tls"

    async def connect(self, token: bytes, delay: float) -> Source:
        if delay:
            await trio.sleep(delay)
        raw, first = await self._open(token)
        sock = raw.socket
        trio.lowlevel.notify_closing(sock)  # trio forgets the fd: the job owns it now
        return socket.socket(fileno=sock.detach()), first

    async def _open(self, token: bytes) -> tuple[trio.SocketStream, bytes]:
        """The token inside pinned mutual TLS, then TLS unwrapped."""
        decoder = tf.Decoder()
        with trio.fail_after(self.connect_timeout + self.handshake_timeout):
            tls = await self.dial()
        try:
            with trio.fail_after(self.handshake_timeout):
                await tls.send_all(tf.encode(tf.DataHello(token)))
                answer = await read_message(tls, decoder)
                if isinstance(answer, tf.Goaway):
                    raise DataRefused(answer)
                if not isinstance(answer, tf.DataOk) or decoder.buffered:
                    raise RemoteProtocolError(f"expected DATA_OK, got {answer!r}")
                transport, trailing = await tls.unwrap()
        except BaseException:
            await trio.aclose_forcefully(tls)
            raise
        raw = transport
        assert isinstance(raw, trio.SocketStream)
        set_keepalive(raw.socket)  # type: ignore[arg-type]
        return raw, bytes(trailing)


class DataRefused(RemoteProtocolError):
    """The ingress answered a TLS data connection's DATA_HELLO with GOAWAY."""

    def __init__(self, goaway: tf.Goaway) -> None:
        super().__init__(f"{goaway.code.name}: {goaway.reason}")
        self.goaway = goaway

