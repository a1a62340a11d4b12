"""The epoll-checked reference speaking HTTP/2 to the node: what a multiplexed node leg
would save.

    python -m tests.bench.epoll_checked_h2up_proxy PORT CERT KEY NODE_PORT CLIENT_CERT CLIENT_KEY

A bench reference, never a product path. `epoll_checked_proxy.py` does every keep-alive
request the product's way over HTTP/1.1 to the node, one pooled node connection per
request in flight; HAProxy, given a node that offers h2, multiplexes every client's
requests over one HTTP/2 connection instead, and at 32 connections that is where its lead
grows. This one keeps the client side and every per-request check of that reference and
replaces the node leg with one HTTP/2 connection carrying all requests as streams:

* requests are HEADERS frames (END_STREAM; no request bodies in this bench), their
  blocks encoded by the product's `proto.h2_hpack` (no dynamic table, no Huffman);
* frames for the node are collected while a batch of epoll events is handled and go out
  as one TLS write and one send(2) at its end: the writes the multiplexing saves;
* answers are read frame by frame; a header block is decoded by `hpack.Decoder` (its
  table must follow the node's) unless the same bytes were decoded before with an empty
  table on both sides (we ask for a table of 0 bytes, so after the node's first block
  every block stands alone and the node's answers repeat byte for byte);
* flow control: our stream windows start at 2**31 - 1 and the connection window is topped
  up once half of a large window was used, so a 1 KiB answer costs no WINDOW_UPDATE.

Left out (as the bench needs none of it): request bodies, streams the node resets or
refuses beyond ending their client, GOAWAY handling beyond closing, priority, the node's
SETTINGS_MAX_CONCURRENT_STREAMS (HAProxy allows 100; the bench has at most 32 in flight),
pinning the node's certificate. So this is a floor for such a node leg, not its cost.
"""

from __future__ import annotations

import socket
import ssl
import struct
import sys
import time

import hpack

from pact_ingress.logs import setup
from pact_ingress.proto import h2_hpack
from pact_ingress.proto.http1_server import (
    Request,
)
from tests.bench import epoll_checked_proxy as checked
from tests.bench import lean_epoll_proxy as lean
from tests.bench import lean_proxy

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0, 1, 3, 4, 6, 7, 8, 9)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY = 0x1, 0x1, 0x4, 0x8, 0x20
CONNECTION_WINDOW = 1 << 30
_HEAD = struct.Struct(">HBBBL")  # length (24 bits as 16 + 8), type, flags, stream id
_U32 = struct.Struct(">L")
_HOP = frozenset({b"host", b"connection", b"keep-alive", b"proxy-connection",
                  b"transfer-encoding", b"upgrade", b"te"})
_CACHE_MAX = 256
_AUTHORITY = checked.ROUTE.encode()  # what check_host let through


def _b(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("latin-1")


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    n = len(payload)
    return _HEAD.pack(n >> 8, n & 0xFF, kind, flags, stream) + payload


class _Client(checked._Client):
    """The checked reference's client, sending its request as a stream on the shared
    HTTP/2 node connection."""

    def forward_request(self, req: Request) -> None:
        target, out = self.check_request(req)
        self.sent_at = time.monotonic()
        fields = [(b":method", _b(req.method)), (b":scheme", b"https"),
                  (b":path", _b(target.origin_form)), (b":authority", _AUTHORITY)]
        fields += [(n.lower(), v) for n, v in out if n.lower() not in _HOP]
        self.checks.h2node().request(self, h2_hpack.encode(fields))


class _Stream:
    __slots__ = ("client", "status", "headers", "body")

    def __init__(self, client: _Client) -> None:
        self.client = client
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []


class _H2Node(lean._Leg):
    """One HTTP/2 connection to the node carrying every request as a stream."""

    def __init__(self, proxy: H2UpProxy) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", proxy.node_port))
        super().__init__(proxy, sock, proxy.h2_ctx, server=False, sni="localhost")
        self.h2proxy = proxy
        self.shaken = False
        self.next_id = 1
        self.streams: dict[int, _Stream] = {}
        self.frames: list[bytes] = [
            PREFACE,
            _frame(SETTINGS, 0, 0, struct.pack(">HLHLHL", 0x1, 0, 0x2, 0, 0x4, 2**31 - 1)),
            _frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - 65535))]
        self.dirty = True
        self.buf = b""
        self.window = CONNECTION_WINDOW
        self.decoder = hpack.Decoder()
        self.decoder.max_allowed_table_size = 0
        self.blocks: dict[bytes, list[tuple[bytes, bytes]]] = {}
        self.advance()

    def request(self, client: _Client, block: bytes) -> None:
        sid = self.next_id
        self.next_id += 2
        self.streams[sid] = _Stream(client)
        client.node = None
        self.queue(_frame(HEADERS, END_HEADERS | END_STREAM, sid, block))

    def send_frames(self) -> None:
        """Everything collected during the batch: one TLS write, one send."""
        self.dirty = False
        if not self.shaken or self.closed:
            return
        self.tls.write(b"".join(self.frames))
        self.frames.clear()
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
            self.take(self.buf + data if self.buf else data)
        if self.out.pending:
            self.flush()

    def take(self, data: bytes) -> None:
        view, at, end = memoryview(data), 0, len(data)
        unpack = _HEAD.unpack_from
        while end - at >= 9:
            hi, lo, kind, flags, sid = unpack(data, at)
            n = (hi << 8) | lo
            if end - at - 9 < n:
                break
            payload = view[at + 9:at + 9 + n]
            at += 9 + n
            if kind == DATA:
                self.on_data(sid, flags, payload)
            elif kind == HEADERS:
                self.on_headers(sid, flags, payload)
            elif kind == SETTINGS:
                if not flags & ACK:
                    self.queue(_frame(SETTINGS, ACK, 0))
            elif kind == PING:
                if not flags & ACK:
                    self.queue(_frame(PING, ACK, 0, bytes(payload)))
            elif kind == RST_STREAM:
                stream = self.streams.pop(sid, None)
                if stream is not None:
                    stream.client.close()
            elif kind == GOAWAY:
                self.close()
                return
            elif kind == CONTINUATION:
                raise ssl.SSLError("CONTINUATION: not in this reference")
        self.buf = data[at:] if at < end else b""

    def queue(self, frame: bytes) -> None:
        self.frames.append(frame)
        if not self.dirty:
            self.dirty = True
            self.h2proxy.dirty.append(self)

    def on_headers(self, sid: int, flags: int, payload: memoryview) -> None:
        if flags & PADDED:
            pad = payload[0]
            payload = payload[1:len(payload) - pad]
        if flags & PRIORITY:
            payload = payload[5:]
        block = bytes(payload)
        fields = self.blocks.get(block)
        if fields is None:
            table = self.decoder.header_table
            empty = not table.dynamic_entries
            fields = [(bytes(n), bytes(v)) for n, v in self.decoder.decode(block, raw=True)]
            if empty and not table.dynamic_entries and len(self.blocks) < _CACHE_MAX:
                self.blocks[block] = fields
        stream = self.streams.get(sid)
        if stream is None:
            return
        if fields and fields[0][0] == b":status":
            stream.status = int(fields[0][1])
            stream.headers = fields[1:]
        if flags & END_STREAM:
            self.finish(sid)

    def on_data(self, sid: int, flags: int, payload: memoryview) -> None:
        n = len(payload)
        self.window -= n
        if self.window < CONNECTION_WINDOW // 2:
            self.queue(_frame(WINDOW_UPDATE, 0, 0, _U32.pack(CONNECTION_WINDOW - self.window)))
            self.window = CONNECTION_WINDOW
        stream = self.streams.get(sid)
        if stream is None:
            return
        if flags & PADDED:
            pad = payload[0]
            payload = payload[1:n - pad]
        stream.body.append(bytes(payload))
        if flags & END_STREAM:
            self.finish(sid)

    def finish(self, sid: int) -> None:
        stream = self.streams.pop(sid)
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
