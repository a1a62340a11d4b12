"""The epoll-checked reference speaking HTTP/2 to the node: what a multiplexed node leg
would save.

    python -m tests.bench.epoll_checked_h2up_proxy PORT CERT KEY NODE_PORT CLIENT_CERT CLIENT_KEY

A bench reference, never a product path. `epoll_checked_proxy.py` does every keep-alive
request the product's way over HTTP/1.1 to the node, one pooled node connection per
request in flight; HAProxy, given a node that offers h2, multiplexes every client's
requests over one HTTP/2 connection instead, and at 32 connections that is where its lead
grows. This one keeps the client side and every per-request check of that reference and
replaces the node leg with one HTTP/2 connection carrying all requests as streams, its
protocol the product's own client end, `proto.h2_client.H2Client`:

* requests are HEADERS frames (END_STREAM; no request bodies in this bench), their
  blocks encoded by `proto.h2_hpack` (no dynamic table, no Huffman);
* frames for the node are collected while a batch of epoll events is handled and go out
  as one TLS write and one send(2) at its end: the writes the multiplexing saves;
* answers go through the client end whole: every frame checked, every response head
  checked (`split_response`), a block decoded by `hpack` once and then taken from the
  connection's cache (we ask for a table of 0 bytes, so the node's answers repeat byte
  for byte), Content-Length against the DATA, and the windows given back as the answers
  are taken (`acknowledge`);
* the node's stream limit is kept (`can_open`); a stream it resets, refuses or never
  processed (GOAWAY) ends its client.

Left out (as the bench needs none of it): request bodies, retrying a refused stream on
another connection, pinning the node's certificate, and deadlines per stream. So this
is close to what such a node leg costs, not all of it.
"""

from __future__ import annotations

import socket
import ssl
import sys
import time

from pact_ingress.logs import setup
from pact_ingress.proto.h2_client import GoAwayReceived, H2Client, ResponseReceived
from pact_ingress.proto.h2_frames import ConnectionError_, DataReceived, StreamEnded, StreamReset
from pact_ingress.proto.http1_server import (
    Request,
)
from tests.bench import epoll_checked_proxy as checked
from tests.bench import lean_epoll_proxy as lean
from tests.bench import lean_proxy

#: Our windows: a stream's as the product's default, the connection's large enough that
#: 32 streams' answers never wait for it.
STREAM_WINDOW = 256 * 1024
CONNECTION_WINDOW = 1 << 30
_HOP = frozenset({b"host", b"connection", b"keep-alive", b"proxy-connection",
                  b"transfer-encoding", b"upgrade", b"te"})
_AUTHORITY = checked.ROUTE.encode()  # what check_host let through


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")


class _Client(checked._Client):
    """The checked reference's client, sending its request as a stream on the shared
    HTTP/2 node connection."""

    def forward_request(self, req: Request) -> None:
        target, out = self.check_request(req)
        self.sent_at = time.monotonic()
        fields = [(b":method", _b(req.method)), (b":scheme", b"https"),
                  (b":path", _b(target.origin_form)), (b":authority", _AUTHORITY)]
        fields += [(n.lower(), v) for n, v in out if n.lower() not in _HOP]
        self.checks.h2node().request(self, fields)


class _Stream:
    __slots__ = ("client", "status", "headers", "body")

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []


class _H2Node(lean._Leg):
    """One HTTP/2 connection to the node carrying every request as a stream, its
    protocol the product's client end (`proto.h2_client`)."""

    def __init__(self, proxy: H2UpProxy) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", proxy.node_port))
        super().__init__(proxy, sock, proxy.h2_ctx, server=False, sni="localhost")
        self.h2proxy = proxy
        self.shaken = False
        self.streams: dict[int, _Stream] = {}
        self.h2 = H2Client(initial_window=STREAM_WINDOW, connection_window=CONNECTION_WINDOW)
        self.h2.initiate_connection()
        self.dirty = True
        self.advance()

    def request(self, client: _Client, fields: list[tuple[bytes, bytes]]) -> None:
        if not self.h2.can_open():
            client.close()  # the node's stream limit (the bench stays far below it)
            return
        self.streams[self.h2.send_request(fields)] = _Stream(client)
        client.node = None
        self.mark()

    def mark(self) -> None:
        if not self.dirty:
            self.dirty = True
            self.h2proxy.dirty.append(self)

    def send_frames(self) -> None:
        """Everything queued during the batch: one TLS write, one send."""
        self.dirty = False
        if not self.shaken or self.closed:
            return
        self.tls.write(self.h2.take_output())
        self.flush()

    def advance(self) -> None:
        if not self.shaken:
            if not self.shake():
                return
            self.shaken = True
            self.send_frames()
        while (data := self.plaintext()) is not None:
            if not data:
                self.close()
                return
            self.take(data)
        if self.out.pending:
            self.flush()

    def take(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except ConnectionError_:
            self.close()
            return
        streams = self.streams
        for e in events:
            kind = type(e)
            if kind is DataReceived:
                stream = streams.get(e.stream_id)
                self.h2.acknowledge(e.flow_length, e.stream_id)
                if stream is not None:
                    stream.body.append(e.data)
                    if e.ended:
                        self.finish(e.stream_id)
            elif kind is ResponseReceived:
                stream = streams.get(e.stream_id)
                if stream is not None:
                    stream.status, stream.headers = e.status, e.headers
                    if e.ended:
                        self.finish(e.stream_id)
            elif kind is StreamEnded:
                self.finish(e.stream_id)
            elif kind is StreamReset:
                stream = streams.pop(e.stream_id, None)
                if stream is not None:
                    stream.client.close()
            elif kind is GoAwayReceived:
                for sid in e.unprocessed:
                    stream = streams.pop(sid, None)
                    if stream is not None:
                        stream.client.close()
        if self.h2.out:
            self.mark()

    def finish(self, sid: int) -> None:
        stream = self.streams.pop(sid, None)
        if stream is None:
            return
        body = stream.body[0] if len(stream.body) == 1 else b"".join(stream.body)
        stream.client.answer_with(stream.status, stream.headers, body)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self.h2proxy.node is self:
            self.h2proxy.node = None
        streams, self.streams = self.streams, {}
        for stream in streams.values():
            stream.client.close()


class H2UpProxy(checked.CheckedProxy):
    """The checked loop with one HTTP/2 node connection, its frames sent per batch."""

    def __init__(self, port: int, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
                 node_port: int) -> None:
        super().__init__(port, server_ctx, client_ctx, node_port)
        self.h2_ctx = client_ctx
        self.node: _H2Node | None = None
        self.dirty: list[_H2Node] = []

    def h2node(self) -> _H2Node:
        if self.node is None or self.node.closed:
            self.node = _H2Node(self)
            self.dirty.append(self.node)
        return self.node

    def client(self, sock: socket.socket) -> lean._Client:
        return _Client(self, sock)

    def batch_done(self) -> None:
        dirty = self.dirty
        while dirty:
            node = dirty.pop()
            try:
                node.send_frames()
            except checked._FAILED:
                node.close()


def main(port: int, cert: str, key: str, node_port: int, client_cert: str,
         client_key: str) -> None:
    setup(stream=sys.stderr)
    server_ctx, client_ctx = lean_proxy.contexts(cert, key, client_cert, client_key)
    client_ctx.set_alpn_protocols(["h2"])
    H2UpProxy(port, server_ctx, client_ctx, node_port).run()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), a[1], a[2], int(a[3]), a[4], a[5])
