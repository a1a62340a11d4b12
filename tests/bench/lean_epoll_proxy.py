"""The plainest terminate proxy on one epoll loop: how cheap can Python make this job?

    python -m tests.bench.lean_epoll_proxy PORT CERT KEY NODE_PORT CLIENT_CERT CLIENT_KEY

A bench reference, never a product path. It does the job of `lean_proxy.py` (TLS with
the client over memory BIOs, llhttp (`httptools`) parsing each request, a fresh request
head, mutual TLS to the node over a shared pool of kept connections, llhttp parsing the
answer, a fresh response head, the answer written back) with its simplifications
(HTTP/1.1 only; no Host or SNI check, limits, header hygiene, deadlines, metrics, access
log, streaming of large bodies, pipelining or error answers; the node's certificate is
not checked; a request it cannot handle ends the connection), but without trio: one
thread, one edge-triggered `select.epoll` set and a small state machine per connection.

* every socket is registered once (EPOLLIN | EPOLLRDHUP | EPOLLET) and asks for
  EPOLLOUT (one `epoll_ctl` MOD, kept from then on) only when a send would block;
* every step is tried before waiting: a new connection is read right after accept(2)
  (its ClientHello is usually there), a new node connection starts its handshake at
  once, and only EAGAIN leaves a connection waiting for an edge;
* accept(2) runs until EAGAIN; sockets closed during a batch of events are closed
  once the batch is done, so no new socket inherits the batch's events for a fd number.

It exists as the reference for "how cheap can a Python terminate proxy on one epoll loop
be": the passthrough engine (`net/edge.py`) closed its gap to HAProxy by this shape, and
`ab_terminate --lean-epoll` / `callgrind_terminate --lean-epoll` put this one beside
`lean_proxy.py` (the same job, a trio task per connection) and HAProxy.
"""

from __future__ import annotations

import select
import socket
import ssl
import sys

import httptools

from tests.bench import lean_proxy
from tests.bench.lean_proxy import _head

READ = 65536
REGISTER = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET
REGISTER_OUT = REGISTER | select.EPOLLOUT
_READABLE = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_HUP = select.EPOLLRDHUP | select.EPOLLHUP | select.EPOLLERR
_FAILED = (OSError, ssl.SSLError, httptools.HttpParserError, httptools.HttpParserUpgrade)

HANDSHAKE, REQUEST, WAITING = "handshake", "request", "waiting"

class _Message(lean_proxy._Message):
    """The plain proxy's message, reset for the next one instead of made anew: a leg
    keeps one parser for its whole life (llhttp starts over after each message)."""

    reset = lean_proxy._Message.__init__


class _Leg:
    """One TLS connection in the epoll set: ciphertext in and out of its memory BIOs.
    Subclasses say what the plaintext means (`advance`)."""

    def __init__(self, proxy: Proxy, sock: socket.socket, ctx: ssl.SSLContext,
                 server: bool, sni: str | None = None) -> None:
        self.proxy = proxy
        self.sock = sock
        self.fd = sock.fileno()
        self.inc, self.out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = ctx.wrap_bio(self.inc, self.out, server_side=server, server_hostname=sni)
        self.pending = b""  # ciphertext the socket would not take yet
        self.out_asked = False  # EPOLLOUT is in this fd's registration
        self.closed = False
        proxy.legs[self.fd] = self
        proxy.ep.register(self.fd, REGISTER)

    def event(self, mask: int) -> None:
        if mask & select.EPOLLOUT and self.pending:
            self.flush()
        if mask & _READABLE:
            eof = self.fill(mask & _HUP)
            self.advance()
            if eof:
                self.close()

    def fill(self, hup: int) -> bool:
        """The socket's bytes into the incoming BIO; True at EOF. A short read means the
        socket is empty (a later arrival raises a new edge), unless the peer's FIN came
        with this edge: then read on to find the EOF."""
        recv, write = self.sock.recv, self.inc.write
        while True:
            try:
                data = recv(READ)
            except BlockingIOError:
                return False
            if not data:
                return True
            write(data)
            if len(data) < READ and not hup:
                return False

    def flush(self) -> None:
        data = self.pending + self.out.read() if self.pending else self.out.read()
        while data:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                break
            data = data[sent:]
        self.pending = data
        if data and not self.out_asked:
            self.out_asked = True
            self.proxy.ep.modify(self.fd, REGISTER_OUT)

    def shake(self) -> bool:
        """One step of the TLS handshake; True once it is done."""
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:
            self.flush()
            return False
        return True

    def plaintext(self) -> bytes | None:
        """The next plaintext the incoming BIO gives: None when it holds no whole record
        (SSL_read would only say "want read", and dearly), b"" at the peer's close."""
        while self.inc.pending:
            try:
                return self.tls.read(READ)
            except ssl.SSLWantReadError:
                continue  # a record's rest is still to come: the BIO is empty now
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
        return None

    def advance(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            del self.proxy.legs[self.fd]
            self.proxy.ended.append(self.sock)  # closed after the batch (see the doc)


class _Client(_Leg):
    """A client connection: HANDSHAKE -> REQUEST -> WAITING (for the node) -> REQUEST."""

    def __init__(self, proxy: Proxy, sock: socket.socket) -> None:
        super().__init__(proxy, sock, proxy.server_ctx, server=True)
        self.state = HANDSHAKE
        self.msg = _Message()
        self.parser = httptools.HttpRequestParser(self.msg)
        self.closing = False  # the request asked for Connection: close
        self.node: _Node | None = None

    def advance(self) -> None:
        if self.state is HANDSHAKE:
            if not self.shake():
                return
            self.state = REQUEST
            self.flush()
        while self.state is REQUEST:
            data = self.plaintext()
            if data is None:
                if self.out.pending:  # post-handshake messages (session tickets)
                    self.flush()
                return
            if not data:
                self.close()
                return
            self.take(data)

    def take(self, data: bytes) -> None:
        """Plaintext of a request: parsed, and the request forwarded once it is whole."""
        self.parser.feed_data(data)  # a pipelined rest is not handled
        if self.msg.done:
            self.forward()

    def forward(self) -> None:
        msg = self.msg
        body = b"".join(msg.body)
        first = self.parser.get_method() + b" " + msg.url + b" HTTP/1.1"
        self.closing = any(n.lower() == b"connection" and v.lower() == b"close"
                           for n, v in msg.headers)
        data = _head(first, msg.headers, body) + body
        msg.reset()
        self.state = WAITING
        idle = self.proxy.idle
        node = idle.pop() if idle else None
        try:
            if node is None:
                node = _Node(self.proxy)
            self.node = node
            node.send(self, data)
        except _FAILED:  # the node's trouble, not this client's: it ends with it all the same
            if node is not None:
                node.close()
            self.close()

    def answer(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.node = None
        if self.closed:
            return
        try:  # called from the node's event: this client's errors end this client only
            self.tls.write(_head(b"HTTP/1.1 %d OK" % status, headers, body, self.closing)
                           + body)
            self.flush()
            if self.closing:
                self.close()  # what the socket did not take is dropped: enough for the bench
                return
            self.state = REQUEST
            self.advance()
        except _FAILED:
            self.close()

    def close(self) -> None:
        super().close()
        self.node = None  # a node still answering goes back to the pool when done


class _Node(_Leg):
    """A mutual-TLS connection to the node: handshaking, idle in the pool, or carrying
    one client's request and reading its answer."""

    def __init__(self, proxy: Proxy) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(False)
        sock.connect_ex(("127.0.0.1", proxy.node_port))  # in progress: the first send says
        super().__init__(proxy, sock, proxy.client_ctx, server=False, sni="localhost")
        self.shaken = False
        self.client: _Client | None = None
        self.queued = b""  # a request waiting for the handshake
        self.msg = _Message()
        self.parser = httptools.HttpResponseParser(self.msg)
        try:
            self.advance()  # the ClientHello out now, or on EPOLLOUT once connected
        except _FAILED:
            self.close()  # out of the loop's map before the caller sees the error
            raise

    def send(self, client: _Client, data: bytes) -> None:
        self.client = client
        if self.shaken:
            self.tls.write(data)
            self.flush()
        else:
            self.queued = data

    def advance(self) -> None:
        if not self.shaken:
            if not self.shake():
                return
            self.shaken = True
            if self.queued:
                self.tls.write(self.queued)
                self.queued = b""
            self.flush()
        while (data := self.plaintext()) is not None:
            if not data or self.client is None:  # closed, or bytes on an idle connection
                self.close()
                return
            if self.take(data):
                return
        if self.out.pending:  # a post-handshake message to answer
            self.flush()

    def take(self, data: bytes) -> bool:
        """Plaintext of the answer: parsed; True once it went back to its client."""
        self.parser.feed_data(data)
        if not self.msg.done:
            return False
        msg, client = self.msg, self.client
        assert client is not None
        status, headers, body = (self.parser.get_status_code(), msg.headers,
                                 b"".join(msg.body))
        msg.reset()
        self.client = None
        self.proxy.idle.append(self)  # before the answer: its next request may use it
        client.answer(status, headers, body)
        return True

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self in self.proxy.idle:
            self.proxy.idle.remove(self)
        if self.client is not None:  # a request in flight: its client ends with it
            self.client.close()
            self.client = None


class Proxy:
    """The epoll set, the fd -> leg map, the node pool, and the loop."""

    def __init__(self, port: int, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
                 node_port: int) -> None:
        self.server_ctx, self.client_ctx, self.node_port = server_ctx, client_ctx, node_port
        self.ep = select.epoll()
        self.legs: dict[int, _Leg] = {}
        self.idle: list[_Node] = []
        self.ended: list[socket.socket] = []
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", port))
        self.listener.listen(512)
        self.listener.setblocking(False)
        self.ep.register(self.listener.fileno(), select.EPOLLIN | select.EPOLLET)

    def accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError:  # out of fds and the like: the next edge tries again
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client = self.client(sock)
            try:
                client.event(select.EPOLLIN)  # the ClientHello is usually there already
            except _FAILED:
                client.close()

    def client(self, sock: socket.socket) -> _Client:
        """The state machine of a new client connection."""
        return _Client(self, sock)

    def run(self) -> None:
        poll, legs, ended = self.ep.poll, self.legs, self.ended
        lfd = self.listener.fileno()
        while True:
            for fd, mask in poll():
                if fd == lfd:
                    self.accept()
                    continue
                leg = legs.get(fd)
                if leg is None:
                    continue
                try:
                    leg.event(mask)
                except _FAILED:
                    leg.close()
            self.batch_done()
            if ended:
                for sock in ended:
                    sock.close()  # closing the fd also takes it out of the epoll set
                ended.clear()

    def batch_done(self) -> None:
        """Called once per batch of events, before the batch's closed sockets are
        closed: a subclass that collects writes sends them here."""


def main(port: int, cert: str, key: str, node_port: int, client_cert: str,
         client_key: str) -> None:
    server_ctx, client_ctx = lean_proxy.contexts(cert, key, client_cert, client_key)
    Proxy(port, server_ctx, client_ctx, node_port).run()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), a[1], a[2], int(a[3]), a[4], a[5])
