"""The plainest terminate proxy on this stack: a reference under pact-ingress's figures.

    python -m tests.bench.lean_proxy PORT CERT KEY NODE_PORT CLIENT_CERT CLIENT_KEY

A bench reference, never a product path. It does what any terminating HTTP/1.1 proxy in
Python on trio must do and nothing more: TLS with the client (`ssl.SSLObject` over memory
BIOs on a non-blocking socket, woken by `trio.lowlevel.wait_readable`, the plumbing the
edge uses), llhttp (`httptools`) parsing each request, a fresh request head serialised,
mutual TLS to the node over a shared pool of kept connections, llhttp parsing the
answer, a fresh response head serialised, the answer written back. No Host or SNI
check, no limits, posture, header hygiene, deadlines, metrics, access log, streaming of
large bodies, pipelining or error answers: a request it cannot handle ends the
connection.

`ab_terminate --lean` runs it on the proxy core beside HAProxy and the trees given, so
the distance between this and pact-ingress is about what the product's own work costs,
and the distance between this and HAProxy what Python on trio, written the plain way,
costs before any of it. It is not a lower bound: it waits through
`trio.lowlevel.wait_readable` (an `epoll_ctl` per wait), which the edge's readiness hub
avoids when it is crowded.
"""

from __future__ import annotations

import socket
import ssl
import sys

import httptools
import trio

READ = 65536


class _Leg:
    """One TLS connection over a non-blocking socket: read and write plaintext."""

    def __init__(self, sock: socket.socket, ctx: ssl.SSLContext, server: bool,
                 sni: str | None = None) -> None:
        self.sock = sock
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.inc, self.out, server_side=server,
                                server_hostname=sni)

    async def _flush(self) -> None:
        data = self.out.read()
        while data:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                await trio.lowlevel.wait_writable(self.sock)
                continue
            data = data[sent:]

    async def _fill(self) -> bool:
        while True:
            try:
                data = self.sock.recv(READ)
            except BlockingIOError:
                await trio.lowlevel.wait_readable(self.sock)
                continue
            if not data:
                return False
            self.inc.write(data)
            return True

    async def handshake(self) -> None:
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._fill():
                    raise ConnectionError("closed in the handshake") from None
        await self._flush()

    async def read(self) -> bytes:
        while True:
            try:
                data = self.tls.read(READ)
            except ssl.SSLWantReadError:
                await self._flush()  # post-handshake messages
                if not await self._fill():
                    return b""
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            await self._flush()
            return data

    async def write(self, data: bytes) -> None:
        self.tls.write(data)
        await self._flush()


class _Message:
    """httptools callbacks gathered into one message: head fields, body, done."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.done = True


_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length",
        b"proxy-connection", b"te", b"upgrade", b"trailer"}


def _head(first: bytes, headers: list[tuple[bytes, bytes]], body: bytes,
          closing: bool = False) -> bytes:
    lines = [first]
    lines += [n + b": " + v for n, v in headers if n.lower() not in _HOP]
    lines.append(b"content-length: " + str(len(body)).encode())
    if closing:
        lines.append(b"connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


async def _message(leg: _Leg, parser: httptools.HttpRequestParser | httptools.HttpResponseParser,
                   msg: _Message) -> bool:
    """Feed `parser` until `msg` is complete; False at a close (or an upgrade). A
    pipelined rest is not handled: the bench's clients wait for each answer."""
    while not msg.done:
        data = await leg.read()
        if not data:
            return False
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            return False
    return True


async def _connect(client_ctx: ssl.SSLContext, node_port: int) -> _Leg:
    up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    up.setblocking(False)
    try:
        up.connect(("127.0.0.1", node_port))
    except BlockingIOError:
        await trio.lowlevel.wait_writable(up)
    back = _Leg(up, client_ctx, server=False, sni="localhost")
    await back.handshake()
    return back


async def _serve(sock: trio.socket.SocketType, server_ctx: ssl.SSLContext,
                 client_ctx: ssl.SSLContext, node_port: int, idle: list[_Leg]) -> None:
    conn = socket.socket(fileno=sock.detach())  # plain socket: no trio wrapper per call
    conn.setblocking(False)
    front = _Leg(conn, server_ctx, server=True)
    try:
        await front.handshake()
        while True:
            req = _Message()
            qparser = httptools.HttpRequestParser(req)
            if not await _message(front, qparser, req):
                return
            back = idle.pop() if idle else await _connect(client_ctx, node_port)
            body = b"".join(req.body)
            first = qparser.get_method() + b" " + req.url + b" HTTP/1.1"
            try:
                await back.write(_head(first, req.headers, body) + body)
                resp = _Message()
                rparser = httptools.HttpResponseParser(resp)
                if not await _message(back, rparser, resp):
                    back.sock.close()
                    return
            except BaseException:
                back.sock.close()
                raise
            idle.append(back)  # the shared pool: kept for the next request from anyone
            answer = b"".join(resp.body)
            first = b"HTTP/1.1 %d OK" % rparser.get_status_code()
            closing = any(n.lower() == b"connection" and v.lower() == b"close"
                          for n, v in req.headers)
            await front.write(_head(first, resp.headers, answer, closing) + answer)
            if closing:
                return
    except (OSError, ssl.SSLError, ConnectionError):
        return
    finally:
        conn.close()


def contexts(cert: str, key: str, client_cert: str, client_key: str
             ) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """The TLS contexts of a reference proxy: toward clients, and toward the node."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    server_ctx.set_alpn_protocols(["http/1.1"])
    client_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client_ctx.check_hostname = False
    client_ctx.verify_mode = ssl.CERT_NONE  # pins nothing: one check fewer than the edge
    client_ctx.load_cert_chain(client_cert, client_key)
    client_ctx.set_alpn_protocols(["http/1.1"])
    return server_ctx, client_ctx


async def main(port: int, cert: str, key: str, node_port: int, client_cert: str,
               client_key: str) -> None:
    server_ctx, client_ctx = contexts(cert, key, client_cert, client_key)
    listener = trio.socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", port))
    listener.listen(512)
    idle: list[_Leg] = []
    async with trio.open_nursery() as nursery:
        while True:
            sock, _ = await listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nursery.start_soon(_serve, sock, server_ctx, client_ctx, node_port, idle)


if __name__ == "__main__":
    a = sys.argv[1:]
    trio.run(main, int(a[0]), a[1], a[2], int(a[3]), a[4], a[5])
