"""Raw TCP backends for the benches: one single-threaded epoll loop, three behaviours.

Every connection starts with a canned ClientHello of known length (the proxies route on
it; a direct connection sends it too, so all paths carry the same bytes). After it:

- `sink`  (connection flood): close as soon as the hello has arrived — the cheapest
  possible backend, so the flood measures the proxy's per-connection cost;
- `bulk`  (throughput): count every byte until EOF, then answer the count as 8 bytes
  big-endian and close, so the client can check nothing was lost;
- `echo`  (keep-alive): send back every byte received.

Why not trio or asyncio: this process shares a core with the load generators, so it
must cost as little CPU per connection as Python allows; a bare `selectors` loop is the
cheapest. It serves until SIGTERM or `--max-seconds`.

    python -m tests.bench.backends --hello-len 517 --sink PORT --bulk PORT --echo PORT
"""

from __future__ import annotations

import argparse
import selectors
import signal
import socket
import struct
import time
from dataclasses import dataclass, field

#: Receive buffer for bulk reads: large reads keep Python's share of a GB small.
BULK_READ = 1 << 20
#: Reads per readiness event for one bulk connection before others get a turn.
BULK_BURST = 64
ECHO_READ = 64 * 1024
#: Accepts per readiness event of a listener.
ACCEPT_BURST = 256
LISTEN_BACKLOG = 4096
#: A backend that was never stopped ends by itself after this long.
DEFAULT_MAX_SECONDS = 3600.0


@dataclass
class Conn:
    sock: socket.socket
    kind: str  # sink | bulk | echo
    skip: int  # hello bytes still to arrive
    count: int = 0
    pending: bytearray = field(default_factory=bytearray)


class Server:
    def __init__(self, hello_len: int) -> None:
        self.hello_len = hello_len
        self.sel = selectors.DefaultSelector()
        self.buf = bytearray(BULK_READ)
        self.view = memoryview(self.buf)
        self.running = True

    def listen(self, host: str, port: int, kind: str) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(LISTEN_BACKLOG)
        s.setblocking(False)
        self.sel.register(s, selectors.EVENT_READ, ("listen", kind))

    def run(self, max_seconds: float) -> None:
        deadline = time.monotonic() + max_seconds
        while self.running and time.monotonic() < deadline:
            for key, mask in self.sel.select(timeout=0.5):
                tag = key.data
                if not isinstance(tag, Conn):
                    self._accept(key.fileobj, tag[1])  # type: ignore[arg-type]
                elif mask & selectors.EVENT_WRITE:
                    self._flush(tag)
                else:
                    self._readable(tag)

    def _accept(self, lsock: socket.socket, kind: str) -> None:
        for _ in range(ACCEPT_BURST):
            try:
                sock, _ = lsock.accept()
            except BlockingIOError:
                return
            except OSError:
                return  # EMFILE etc.: the client will see a timeout/reset and count it
            sock.setblocking(False)
            if kind == "echo":
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Conn(sock, kind, self.hello_len)
            self.sel.register(sock, selectors.EVENT_READ, conn)
            self._readable(conn)  # the hello is often there already

    def _close(self, conn: Conn) -> None:
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    def _readable(self, conn: Conn) -> None:
        if conn.kind == "bulk":
            self._bulk(conn)
            return
        try:
            data = conn.sock.recv(ECHO_READ)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        if not data:
            self._close(conn)
            return
        if conn.skip:
            used = min(conn.skip, len(data))
            conn.skip -= used
            data = data[used:]
            if conn.kind == "sink" and not conn.skip:
                self._close(conn)
                return
        if conn.kind == "echo" and data:
            self._send(conn, data)

    def _bulk(self, conn: Conn) -> None:
        for _ in range(BULK_BURST):
            try:
                n = conn.sock.recv_into(self.view)
            except BlockingIOError:
                return
            except OSError:
                self._close(conn)
                return
            if n == 0:
                if conn.count >= self.hello_len:  # not a bare port probe
                    conn.sock.setblocking(True)
                    try:
                        conn.sock.sendall(struct.pack("!Q", conn.count - self.hello_len))
                    except OSError:
                        pass
                self._close(conn)
                return
            conn.count += n

    def _send(self, conn: Conn, data: bytes) -> None:
        if conn.pending:
            conn.pending += data
            return
        try:
            sent = conn.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._close(conn)
            return
        if sent < len(data):
            conn.pending += data[sent:]
            self.sel.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)

    def _flush(self, conn: Conn) -> None:
        try:
            sent = conn.sock.send(conn.pending)
        except BlockingIOError:
            return
        except OSError:
            self._close(conn)
            return
        del conn.pending[:sent]
        if not conn.pending:
            self.sel.modify(conn.sock, selectors.EVENT_READ, conn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--hello-len", type=int, required=True)
    p.add_argument("--sink", type=int)
    p.add_argument("--bulk", type=int)
    p.add_argument("--echo", type=int)
    p.add_argument("--max-seconds", type=float, default=DEFAULT_MAX_SECONDS)
    args = p.parse_args()
    server = Server(args.hello_len)
    for kind in ("sink", "bulk", "echo"):
        port = getattr(args, kind)
        if port:
            server.listen(args.host, port, kind)

    def stop(*_: object) -> None:
        server.running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    server.run(args.max_seconds)


if __name__ == "__main__":
    main()
