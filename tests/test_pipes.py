"""Passthrough pipes are held only while bytes are in flight, within the user's budget.

An idle connection must cost its two sockets and no pipe (counted in a real `serve`
process's /proc/PID/fd); bulk transfers must arrive byte-exact both ways when there are
more of them than pooled pipes; and a process whose user is over the kernel's pipe
budget (F_SETPIPE_SZ refused) must still relay — once with the refusal faked in-process,
once for real: `serve` run as an unprivileged user whose pipe budget another process of
that user has already used up.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

import pact_ingress.net.splice as sp
from tests.netutil import free_port, make_config, route, sha256_stream
from tests.test_passthrough import HELLO, HELLO_SNI, start_router

REPO = Path(__file__).resolve().parent.parent
WAIT = 30.0
#: Idle connections opened against a real `serve`: enough that a few pooled pipes and
#: the process's own descriptors are noise against the per-connection figure.
IDLE_CONNS = 300
#: The whole instance's descriptors per idle passthrough connection: its two sockets,
#: plus a little for pooled pipes.
MAX_FDS_PER_IDLE_CONN = 2.2
#: Concurrent bulk transfers against a pool of SMALL_POOL_PIPES enlarged pipes.
BULK_CONNS = 16
SMALL_POOL_PIPES = 4
BULK_BYTES = 8 << 20  # per direction per connection: several pipefuls
F_GETPIPE_SZ = getattr(fcntl, "F_GETPIPE_SZ", 1032)


# --- peers (threads, blocking sockets: they work the same for in-process and subprocess
# ingresses) --------------------------------------------------------------------------


def digest(seed: bytes, size: int) -> str:
    h = hashlib.sha256()
    for piece in sha256_stream(seed, size):
        h.update(piece)
    return h.hexdigest()


class HashBackend:
    """Reads the hello and an 8-byte connection id, then streams `size` bytes down
    (seeded by the id) while hashing what comes up until EOF; records the up digest."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.up: dict[bytes, str] = {}
        self.errors: list[BaseException] = []
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=512)
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                head = recv_exact(conn, len(HELLO) + 8)
                assert head[:len(HELLO)] == HELLO
                cid = head[len(HELLO):]

                def source() -> None:
                    for piece in sha256_stream(b"down" + cid, self.size):
                        conn.sendall(piece)
                    conn.shutdown(socket.SHUT_WR)

                sender = threading.Thread(target=source, daemon=True)
                sender.start()
                h = hashlib.sha256()
                while chunk := conn.recv(1 << 20):
                    h.update(chunk)
                sender.join()
                self.up[cid] = h.hexdigest()
        except BaseException as exc:
            self.errors.append(exc)

    def close(self) -> None:
        self.sock.close()


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise EOFError(f"EOF after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def bulk_both_ways(port: int, backend: HashBackend, conns: int) -> None:
    """`conns` concurrent connections, each sending `backend.size` bytes up and receiving
    as many down at the same time; every byte checked by sha256 at both ends."""
    down: dict[bytes, str] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        cid = i.to_bytes(8, "big")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
                s.sendall(HELLO + cid)

                def source() -> None:
                    for piece in sha256_stream(b"up" + cid, backend.size):
                        s.sendall(piece)
                    s.shutdown(socket.SHUT_WR)

                sender = threading.Thread(target=source, daemon=True)
                sender.start()
                h = hashlib.sha256()
                while chunk := s.recv(1 << 20):
                    h.update(chunk)
                sender.join()
                down[cid] = h.hexdigest()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(conns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a transfer hung"
    deadline = time.monotonic() + WAIT
    while len(backend.up) < conns and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not backend.errors, backend.errors
    for i in range(conns):
        cid = i.to_bytes(8, "big")
        assert down[cid] == digest(b"down" + cid, backend.size), f"down {i}"
        assert backend.up[cid] == digest(b"up" + cid, backend.size), f"up {i}"


# --- in-process: a pool smaller than the transfers ----------------------------------------


class Watched(sp.PipePool):
    """The pool, counting how many pipes are out at once."""

    def __init__(self, *args: int) -> None:
        super().__init__(*args)
        self.out = self.most_out = 0

    def take(self) -> sp.Pipe:
        self.out += 1
        self.most_out = max(self.most_out, self.out)
        return super().take()

    def give(self, pipe: sp.Pipe, drained: bool) -> None:
        self.out -= 1
        super().give(pipe, drained)


@pytest.mark.parametrize("enlarge", ["allowed", "refused"])
async def test_bulk_both_ways_with_fewer_pipes_than_transfers(
        nursery: trio.Nursery, tmp_path: Path, monkeypatch, enlarge: str):
    pool = Watched(SMALL_POOL_PIPES, 2, sp.PIPE_SIZE)
    monkeypatch.setattr(sp, "POOL", pool)
    if enlarge == "refused":  # what a user over pipe-user-pages-soft gets from the kernel
        real = fcntl.fcntl

        def refuse(fd: int, cmd: int, *args: object) -> object:
            if cmd == sp._F_SETPIPE_SZ:
                raise PermissionError(1, "Operation not permitted")
            return real(fd, cmd, *args)

        monkeypatch.setattr(sp.fcntl, "fcntl", refuse)
    backend = HashBackend(BULK_BYTES)
    try:
        h = await start_router(nursery, make_config(tmp_path, [route(HELLO_SNI, "t",
                                                                      backend.port)]))
        await trio.to_thread.run_sync(bulk_both_ways, h.port, backend, BULK_CONNS)
    finally:
        backend.close()
    assert pool.out == 0  # every pipe came back
    assert pool.most_out > SMALL_POOL_PIPES  # more transfers than pooled pipes at once
    assert pool.big_alive <= SMALL_POOL_PIPES
    if enlarge == "refused":
        assert pool.refused > 0 and pool.big_alive == 0
    else:
        assert pool.refused == 0 and pool.big_alive > 0
    pool.clear()


def test_pipe_budget_fits_the_soft_limit():
    page = 4096
    size, count = sp.pipe_budget(1 << 20, 16384, page)  # the kernel defaults
    assert size == 1 << 20
    assert size * count <= 16384 * page * sp.PIPE_BUDGET_SHARE
    assert count >= 8  # bulk on a handful of connections still gets large pipes
    assert sp.pipe_budget(65536, 16384, page)[0] == 65536  # pipe-max-size lowered
    assert sp.pipe_budget(1 << 20, 64, page)[1] == 1  # a tiny budget: one, not zero


# --- a real `serve`: idle connections and an unprivileged user ---------------------------


def config_text(tls: int, backend: int) -> str:
    return f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls}"]
limits:
  max_connections: 4000
  max_connections_per_ip: 4000
tenants:
  - name: alina
    pins: ["sha256:{'A' * 43}"]
    routes:
      - {{host: {HELLO_SNI}, mode: passthrough, backend: "127.0.0.1:{backend}"}}
"""


def unprivileged(uid: int) -> list[str]:
    """Run as `uid` with no capability that lifts pipe limits (CAP_SYS_RESOURCE,
    CAP_SYS_ADMIN), as the systemd unit's dynamic user does. CAP_DAC_READ_SEARCH only
    lets it read this interpreter and tree wherever they are installed."""
    return [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}",
            "--clear-groups", "--inh-caps=-all,+dac_read_search",
            "--ambient-caps=-all,+dac_read_search"]


@pytest.fixture
def serve(tmp_path: Path) -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(backend: int, prefix: list[str] | None = None) -> tuple[subprocess.Popen, int]:
        port = free_port()
        (tmp_path / "ingress.yaml").write_text(config_text(port, backend))
        log = open(tmp_path / "serve.log", "wb")
        env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONDONTWRITEBYTECODE="1")
        proc = subprocess.Popen(
            [*(prefix or []), sys.executable, "-m", "pact_ingress", "serve", "-c",
             str(tmp_path / "ingress.yaml")], stdout=log, stderr=subprocess.STDOUT,
            env=env, cwd=tmp_path)
        procs.append(proc)
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return proc, port
            except OSError:
                time.sleep(0.05)
        raise AssertionError("serve did not listen: " + (tmp_path / "serve.log").read_text())

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def pipe_sizes(pid: int) -> list[int]:
    """Capacity of every pipe `pid` holds (opened through /proc: the same pipe)."""
    sizes = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        path = f"/proc/{pid}/fd/{name}"
        try:
            if not os.readlink(path).startswith("pipe:"):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            sizes.append(fcntl.fcntl(fd, F_GETPIPE_SZ))
        finally:
            os.close(fd)
    return sizes


def test_idle_connections_hold_no_pipes(serve):
    echo = socket.create_server(("127.0.0.1", 0), backlog=IDLE_CONNS + 16)
    held: list[socket.socket] = []
    try:
        proc, port = serve(echo.getsockname()[1])
        accepted: list[socket.socket] = []

        def one() -> socket.socket:
            s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            s.sendall(HELLO)
            b, _ = echo.accept()
            accepted.append(b)
            assert recv_exact(b, len(HELLO)) == HELLO  # through the relay, up
            b.sendall(b"x" * 5000)  # and some bytes down: both directions used a pipe
            assert recv_exact(s, 5000) == b"x" * 5000
            return s

        one().close()  # warm: the pool has its first pipes, lazy imports are done
        time.sleep(0.2)
        before = fd_count(proc.pid)
        held = [one() for _ in range(IDLE_CONNS)]
        time.sleep(0.2)
        after = fd_count(proc.pid)
        per_conn = (after - before) / IDLE_CONNS
        print(f"\n[idle] {IDLE_CONNS} idle passthrough connections: {after - before} fds "
              f"more ({per_conn:.2f} per connection), pipes held: "
              f"{len(pipe_sizes(proc.pid))}")
        assert per_conn <= MAX_FDS_PER_IDLE_CONN
        # they are alive, not just open: the first and last still relay
        for s, b in ((held[0], accepted[1]), (held[-1], accepted[-1])):
            s.sendall(b"ping")
            assert recv_exact(b, 4) == b"ping"
    finally:
        for s in held:
            s.close()
        echo.close()


def fill_pipe_budget(uid: int) -> subprocess.Popen:
    """A process of `uid` that enlarges pipes until the kernel refuses (the user's soft
    budget is then used up) and holds them until killed; prints how many it got."""
    code = ("import fcntl, os, sys, time\n"
            "held = []\n"
            "while True:\n"
            "    r, w = os.pipe()\n"
            "    held.append((r, w))\n"
            "    try:\n"
            "        fcntl.fcntl(w, 1031, 1 << 20)\n"
            "    except PermissionError:\n"
            "        break\n"
            "print(len(held) - 1, flush=True)\n"
            "time.sleep(3600)\n")
    return subprocess.Popen([*unprivileged(uid), sys.executable, "-c", code],
                            stdout=subprocess.PIPE, text=True)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run serve as another user")
@pytest.mark.parametrize("budget", ["free", "used_up"])
def test_unprivileged_serve_relays_within_its_pipe_budget(serve, tmp_path: Path,
                                                          budget: str):
    uid = 40000 + os.getpid() % 10000  # a user nothing else on this machine runs as
    os.chown(tmp_path, uid, uid)
    filler = None
    if budget == "used_up":
        filler = fill_pipe_budget(uid)
        assert filler.stdout is not None
        enlarged = int(filler.stdout.readline())
        soft = int(Path("/proc/sys/fs/pipe-user-pages-soft").read_text())
        if soft:  # the kernel refused at the user's soft limit: this user is unprivileged
            assert enlarged * (1 << 20) <= soft * os.sysconf("SC_PAGE_SIZE")
    backend = HashBackend(BULK_BYTES)
    try:
        proc, port = serve(backend.port, unprivileged(uid))
        bulk_both_ways(port, backend, BULK_CONNS)
        sizes = pipe_sizes(proc.pid)
        print(f"\n[unprivileged, budget {budget}] pooled pipe sizes: {sorted(set(sizes))}")
        if budget == "used_up":  # every enlargement refused: default-or-smaller pipes
            assert sizes and max(sizes) < sp.PIPE_SIZE
        else:
            assert sp.PIPE_SIZE in sizes
    finally:
        backend.close()
        if filler is not None:
            filler.kill()
            filler.wait()
