"""The one-epoll-loop reference with the product's per-request work on it.

    python -m tests.bench.epoll_checked_proxy PORT CERT KEY NODE_PORT CLIENT_CERT CLIENT_KEY

A bench reference, never a product path. `lean_epoll_proxy.py` says what the shape of
the passthrough engine (one thread, one edge-triggered epoll set, a small state machine
per connection) costs for the terminate job with nothing else done; this is the same
loop with what `net/terminate.py` does for each keep-alive HTTP/1.1 request done the
product's way, by the product's own sans-I/O pieces, so that the distance to HAProxy it
measures is the one a terminate engine of that shape would have:

* the client's bytes parsed by `proto.http1_server.H1ServerParser` (its strictness and
  caps), the node's by `proto.http_upstream.ResponseParser` (a new one per request, as
  the pool does);
* per request: the per-IP rate check (`proto.ratelimit.RateLimiter`, the edge's one
  bucket per request), the target parsed and the Host checked against the route
  (`parse_target`, `check_host`, `check_single_valued`), the scope judged
  (`judge_scope`), the per-IP in-flight share taken and given back
  (`proto.shares.Shares`), request headers cleaned with `Forwarded` added and the head
  built (`clean_request_headers`, `request_head`),
  response headers cleaned and the head built with the edge's framing rules
  (`clean_response_headers`, `response_framing`, `response_head`), the time to the
  node's head noted, the answer counted by route and status, one access log line
  (`logs.EventLogger.request`, buffered as the product's is), and the connection's
  idle deadline moved (a number the product's sweeper would read).

What it still leaves out: request bodies (the bench sends none: a request with one ends
the connection), streamed answers, HTTP/2, the seal posture (it judges MCP POST bodies
only), pinning of the node's certificate, timeouts actually firing, reloads, metrics
exposition. The route is the bench rig's: `localhost`, MCP path `/mcp`.
"""

from __future__ import annotations

import socket
import ssl
import sys
import time
from typing import Any

from pact_ingress.logs import log, request_prefix, setup
from pact_ingress.net.terminate import LOG_PATH_MAX, MAX_PENDING_TIMES, UNBOUNDED
from pact_ingress.proto.http1_server import (
    END_OF_MESSAGE,
    NEED_DATA,
    H1ServerParser,
    ParseError,
    Request,
    response_framing,
    response_head,
)
from pact_ingress.proto.http_headers import clean_request_headers, clean_response_headers
from pact_ingress.proto.http_request import (
    BadRequest,
    check_host,
    check_single_valued,
    header,
    judge_scope,
    parse_target,
)
from pact_ingress.proto.http_upstream import ResponseError, ResponseParser, request_head
from pact_ingress.proto.ratelimit import Budget, Limited, RateLimiter, client_bucket
from pact_ingress.proto.shares import Shares
from tests.bench import lean_epoll_proxy as lean
from tests.bench import lean_proxy

ROUTE = "localhost"
MCP_PATH = "/mcp"
IDLE_TIMEOUT = 120.0
#: the bench config's budgets: large enough that nothing is refused
BUDGET = Budget(10**9, 10**9)

_FAILED = (*lean._FAILED, ParseError, BadRequest, ResponseError)


class _Client(lean._Client):
    """A client connection whose requests get the product's parsing and checks."""

    def __init__(self, proxy: CheckedProxy, sock: socket.socket) -> None:
        super().__init__(proxy, sock)
        self.checks = proxy
        self.h1 = H1ServerParser()
        ip = sock.getpeername()[0]
        self.ip, self.bucket = ip, client_bucket(ip) or ip
        self.prefix = request_prefix(ROUTE, ip)
        self.deadline = 0.0  # what the product's once-a-second sweep would read
        self.request: Request | None = None
        self.holding = False  # one unit of the per-IP in-flight share
        self.started = self.sent_at = 0.0

    def take(self, data: bytes) -> None:
        self.h1.feed(data)  # ParseError: the connection ends (the product answers it)
        event = self.h1.next_event()
        if isinstance(event, Request):
            self.forward_request(event)
        elif event is not NEED_DATA:
            raise ParseError(400, "a request body: not in this reference")

    def forward_request(self, req: Request) -> None:
        target, out = self.check_request(req)
        checks = self.checks
        idle = checks.idle
        node = idle.pop() if idle else None
        try:
            if node is None:
                node = _Node(checks)
            self.node = node
            node.parsed = ResponseParser(req.method)
            self.sent_at = time.monotonic()
            node.send(self, request_head(req.method, target.origin_form, out))
        except _FAILED:
            if node is not None:
                node.close()
            self.close()

    def check_request(self, req: Request) -> tuple[Any, list[tuple[bytes, bytes]]]:
        """The product's checks of a whole request head, then its share taken and its
        headers cleaned: (the parsed target, the headers for the node)."""
        checks = self.checks
        now = self.started = time.monotonic()
        self.deadline = now + IDLE_TIMEOUT
        if req.chunked or req.content_length:
            raise ParseError(400, "a request body: not in this reference")
        if self.h1.next_event() is not END_OF_MESSAGE:
            raise AssertionError("llhttp completes a body-less message with its head")
        if isinstance(checks.limiter.check_calls(self.ip, (None,), now, budget=BUDGET,
                                                 scope=ROUTE), Limited):
            raise BadRequest("rate limited", 429)
        target = parse_target(req.target)
        host = check_host(req.host, target, ROUTE, ROUTE)
        check_single_valued(req.headers)
        judge_scope(req.method, target, MCP_PATH, has_body=False, content_type=None,
                    content_encoding=(header(req.headers, b"content-encoding")
                                      if req.method == "POST" else None))
        if checks.inflight.take(self.bucket, 1) is not None:
            raise BadRequest("too many requests in flight", 429)
        self.holding = True
        out = clean_request_headers(req.headers, client_ip=self.ip, host=host)
        self.request = req
        self.closing = not req.keep_alive
        self.state = lean.WAITING
        return target, out

    def answer_parsed(self, parsed: ResponseParser) -> None:
        self.node = None
        self.answer_with(parsed.status, parsed.headers, parsed.take_body())

    def answer_with(self, status: int, headers: list[tuple[bytes, bytes]],
                    body: bytes) -> None:
        """The node's answer, through the product's response work, to the client."""
        checks, req = self.checks, self.request
        assert req is not None
        self._give()
        now = time.monotonic()
        times = checks.header_times
        times.append((ROUTE, now - self.sent_at))
        if len(times) >= MAX_PENDING_TIMES:
            times.clear()  # the product folds them into its histogram here
        if self.closed:
            return
        headers = clean_response_headers(headers)
        framing = response_framing(req.method, req.http_version, status, headers)
        head = response_head(status, headers, framing, close=self.closing)
        key = (ROUTE, status)
        checks.answered[key] = checks.answered.get(key, 0) + 1
        path = req.target.split(b"?", 1)[0][:LOG_PATH_MAX].decode("latin-1")
        log.request(self.prefix, req.method, path, status,
                    round((now - self.started) * 1000, 1))
        try:
            self.tls.write(head + body if body else head)
            self.flush()
            if self.closing:
                self.close()
                return
            self.state = lean.REQUEST
            self.deadline = now + IDLE_TIMEOUT
            self.advance()
        except _FAILED:
            self.close()

    def _give(self) -> None:
        if self.holding:
            self.holding = False
            self.checks.inflight.give(self.bucket, 1)

    def close(self) -> None:
        self._give()
        super().close()


class _Node(lean._Node):
    """A node connection whose answers are read by the product's response parser."""

    parsed: ResponseParser | None = None

    def take(self, data: bytes) -> bool:
        parsed, client = self.parsed, self.client
        if parsed is None or not isinstance(client, _Client):
            self.close()
            return True
        parsed.feed(data)
        if not parsed.done:
            return False
        self.client = self.parsed = None
        if parsed.keep_alive:
            self.proxy.idle.append(self)  # before the answer: its next request may use it
        else:
            self.close()
        client.answer_parsed(parsed)
        return True


class CheckedProxy(lean.Proxy):
    """The loop, with the product's per-request state: the rate limiter, the in-flight
    shares, the counts and header times waiting for the metrics."""

    def __init__(self, port: int, server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext,
                 node_port: int) -> None:
        super().__init__(port, server_ctx, client_ctx, node_port)
        self.limiter = RateLimiter()
        self.inflight = Shares(10**6, UNBOUNDED)
        self.answered: dict[tuple[str, int], int] = {}
        self.header_times: list[tuple[str, float]] = []

    def client(self, sock: socket.socket) -> lean._Client:
        return _Client(self, sock)


def main(port: int, cert: str, key: str, node_port: int, client_cert: str,
         client_key: str) -> None:
    setup(stream=sys.stderr)  # the product's JSON access lines, buffered
    server_ctx, client_ctx = lean_proxy.contexts(cert, key, client_cert, client_key)
    CheckedProxy(port, server_ctx, client_ctx, node_port).run()


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), a[1], a[2], int(a[3]), a[4], a[5])
