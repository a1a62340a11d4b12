"""The epoll engine's writability interest: asked for only once a write has blocked, so
a connection whose every buffer fills must still resume (through a real `serve`)."""

from __future__ import annotations

import hashlib
import random
import socket
import threading

from tests.test_edge import served  # noqa: F401,F811  (a served instance of its own)
from tests.test_serve import HELLO, WAIT, Served


def test_stalled_reader_resumes_both_ways(served: tuple[Served, int, int]):  # noqa: F811
    """A client that stops reading fills every buffer on the way: the engine's writes
    to it, then the echo backend's, then the engine's writes to the backend block. Each
    blocked fd must report writability later (it is asked for only once a write has
    blocked), so once the client reads again every byte arrives, in order."""
    _, tls, _ = served
    size = 48 << 20  # more than the buffers of the chain hold
    block = random.Random(11).randbytes(1 << 20)
    with socket.socket() as c:
        c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)  # stalls sooner
        c.settimeout(WAIT)
        c.connect(("127.0.0.1", tls))
        c.sendall(HELLO)
        sent = threading.Event()

        def writer() -> None:
            for i in range(size >> 20):
                c.sendall(block[i:] + block[:i])
            sent.set()

        w = threading.Thread(target=writer, daemon=True)
        w.start()
        sent.wait(1.0)  # not reading meanwhile: the writer stalls once buffers are full
        want = hashlib.sha256(HELLO)
        for i in range(size >> 20):
            want.update(block[i:] + block[:i])
        got = hashlib.sha256()
        n = 0
        while n < len(HELLO) + size:
            chunk = c.recv(1 << 20)
            assert chunk, "EOF before every byte came back"
            got.update(chunk)
            n += len(chunk)
        w.join(WAIT)
        assert sent.is_set()
    assert n == len(HELLO) + size and got.hexdigest() == want.hexdigest()
