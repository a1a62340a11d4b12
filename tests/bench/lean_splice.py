"""The plainest SNI passthrough router on this stack: a reference beside pact-ingress's.

    python -m tests.bench.lean_splice PORT SNI=BACKEND_PORT [SNI=BACKEND_PORT ...]

A bench reference, never a product path. Per connection it does what any SNI router in
Python on trio must do and nothing more: accept, read until the ClientHello's record is
whole, find the server name, connect to that name's backend, send the hello, then copy
both ways (one task each way, plain non-blocking sockets woken by
`trio.lowlevel.wait_readable`) until each side has closed. No limits, deadlines, hello
validation beyond what finding the name needs, metrics, log line or error alerts: an
unknown name or a malformed hello just closes.

`bench_passthrough --lean` runs it on the proxy core beside HAProxy and pact-ingress, so
the distance between this and pact-ingress is what the product's own work costs, and
the distance between this and HAProxy is what Python on trio costs before any of it.
"""

from __future__ import annotations

import socket
import sys

import trio

READ = 65536


def server_name(hello: bytes) -> str | None:
    """The SNI host name of a whole ClientHello record, or None. Only the walk to the
    extension: lengths are trusted as far as the record holds them."""
    try:
        pos = 5 + 4 + 2 + 32  # record header, handshake header, version, random
        pos += 1 + hello[pos]  # session id
        pos += 2 + int.from_bytes(hello[pos:pos + 2], "big")  # cipher suites
        pos += 1 + hello[pos]  # compression methods
        end = pos + 2 + int.from_bytes(hello[pos:pos + 2], "big")
        pos += 2
        while pos + 4 <= end:
            kind = int.from_bytes(hello[pos:pos + 2], "big")
            size = int.from_bytes(hello[pos + 2:pos + 4], "big")
            pos += 4
            if kind == 0:  # server_name: list length, type, name length, name
                length = int.from_bytes(hello[pos + 3:pos + 5], "big")
                return hello[pos + 5:pos + 5 + length].decode("ascii")
            pos += size
    except (IndexError, UnicodeDecodeError):
        return None
    return None


async def _recv(sock: socket.socket) -> bytes:
    while True:
        try:
            return sock.recv(READ)
        except BlockingIOError:
            await trio.lowlevel.wait_readable(sock)


async def _send_all(sock: socket.socket, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[sock.send(view):]
        except BlockingIOError:
            await trio.lowlevel.wait_writable(sock)


async def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := await _recv(src):
            await _send_all(dst, data)
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


async def _serve(sock: trio.socket.SocketType, routes: dict[str, int]) -> None:
    conn = socket.socket(fileno=sock.detach())  # plain socket: no trio wrapper per call
    conn.setblocking(False)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    up: socket.socket | None = None
    try:
        hello = b""
        while len(hello) < 5 or len(hello) < 5 + int.from_bytes(hello[3:5], "big"):
            data = await _recv(conn)
            if not data:
                return
            hello += data
        port = routes.get(server_name(hello) or "")
        if port is None:
            return
        up = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        up.setblocking(False)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            up.connect(("127.0.0.1", port))
        except BlockingIOError:
            await trio.lowlevel.wait_writable(up)
        await _send_all(up, hello)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_pump, conn, up)
            nursery.start_soon(_pump, up, conn)
    except OSError:
        return
    finally:
        conn.close()
        if up is not None:
            up.close()


async def main(port: int, routes: dict[str, int]) -> None:
    listener = trio.socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    await listener.bind(("127.0.0.1", port))
    listener.listen(1024)
    async with trio.open_nursery() as nursery:
        while True:
            sock, _ = await listener.accept()
            nursery.start_soon(_serve, sock, routes)


if __name__ == "__main__":
    routes = {name: int(p) for name, p in (a.split("=", 1) for a in sys.argv[2:])}
    trio.run(main, int(sys.argv[1]), routes)
