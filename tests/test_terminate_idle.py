"""HTTP/1.1 terminate connections whose first request came with the client's Finished
(in the same segment, as wrk and curl send it): the first request is served
before the connection has any idle scope, and the connection must still be bounded
afterwards like any other — closed past `idle_timeout`, closed at once by a drain — and
still serve later requests. A real `pact-ingress serve`, a raw TLS client that decides
which records share a segment; no timing asserts (waits are bounded)."""

from __future__ import annotations

import signal
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.terminate_env import LOOPBACK, OPT_HOST, WAIT, ServeEnv, client_context


class FinishedWithRequest:
    """A TLS 1.3 client over a bare socket that sends its Finished and its first request
    in one `send`, then reads plaintext responses."""

    def __init__(self, port: int, request: bytes) -> None:
        self.sock = socket.create_connection((LOOPBACK, port), timeout=WAIT)
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = client_context().wrap_bio(self.incoming, self.outgoing,
                                             server_hostname=OPT_HOST)
        self.plain = b""
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self.sock.sendall(self.outgoing.read())
                data = self.sock.recv(65536)
                assert data, "the edge closed during the handshake"
                self.incoming.write(data)
        self.tls.write(request)
        self.sock.sendall(self.outgoing.read())  # Finished + request, one segment

    def send(self, request: bytes) -> None:
        self.tls.write(request)
        self.sock.sendall(self.outgoing.read())

    def _more(self) -> bool:
        data = self.sock.recv(65536)
        if not data:
            return False
        self.incoming.write(data)
        while True:
            try:
                self.plain += self.tls.read(65536)
            except ssl.SSLWantReadError:
                return True
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return False

    def response(self) -> tuple[int, bytes]:
        """Status and body of the next response (Content-Length framed)."""
        while b"\r\n\r\n" not in self.plain:
            assert self._more(), "closed before a response head"
        head, rest = self.plain.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        length = next(int(v) for k, _, v in (line.partition(":") for line in lines[1:])
                      if k.strip().lower() == "content-length")
        while len(rest) < length:
            assert self._more(), "closed mid-body"
            rest = self.plain.split(b"\r\n\r\n", 1)[1]
        self.plain = rest[length:]
        return int(lines[0].split()[1]), rest[:length]

    def closed_by_edge(self) -> bool:
        """Whether the edge ends the connection (bounded by the socket's timeout)."""
        try:
            while self._more():
                pass
        except TimeoutError:
            return False
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


def _get(path: str = "/") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: {OPT_HOST}\r\n\r\n".encode()


@pytest.fixture
def env(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[ServeEnv]:
    idle = getattr(request, "param", "1s")
    e = ServeEnv.start(tmp_path, limits={"idle_timeout": idle})
    yield e
    e.stop()


def test_keep_alive_after_a_first_request_that_came_with_the_finished(env: ServeEnv) -> None:
    client = FinishedWithRequest(env.serve.port, _get("/one"))
    try:
        assert client.response()[0] == 200
        for n in range(3):  # the connection now waits for each request: still served
            client.send(_get(f"/more/{n}"))
            assert client.response()[0] == 200
        assert [r.target for r in env.node.requests()] == [
            "/one", "/more/0", "/more/1", "/more/2"]
    finally:
        client.close()


def test_idle_timeout_still_closes_it(env: ServeEnv) -> None:
    client = FinishedWithRequest(env.serve.port, _get())
    try:
        assert client.response()[0] == 200
        assert client.closed_by_edge()  # past idle_timeout (1 s), well within WAIT
        assert env.serve.wait_open_connections(0) == 0
    finally:
        client.close()


@pytest.mark.parametrize("env", ["300s"], indirect=True)  # only the drain can close it
def test_a_drain_closes_it_at_once(env: ServeEnv) -> None:
    client = FinishedWithRequest(env.serve.port, _get())
    try:
        assert client.response()[0] == 200
        env.serve.proc.send_signal(signal.SIGTERM)
        assert client.closed_by_edge()
        assert env.serve.proc.wait(timeout=WAIT) == 0
    finally:
        client.close()
