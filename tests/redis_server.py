"""A real `redis-server` for tests: its own free loopback port, its own temp directory,
no persistence unless asked; stop, freeze (SIGSTOP: a Redis that is up but silent) and
restart on the same port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

from tests.netutil import free_port
from tests.tools import require

#: A started redis-server must answer PING within this.
START_WAIT = 10.0


def ping(host: str, port: int, password: str | None = None, timeout: float = 1.0) -> bool:
    """A raw RESP PING (no client library: this checks the server, not our client)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            if password is not None:
                s.sendall(f"AUTH {password}\r\n".encode())
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    def __init__(self, workdir: Path, *, password: str | None = None,
                 extra: tuple[str, ...] = ("--save", "", "--appendonly", "no")) -> None:
        self.binary = require("redis-server")
        self.host = "127.0.0.1"
        self.port = free_port()
        self.dir = workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.password = password
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--bind", self.host, "--port", str(self.port),
                "--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"),
                *self.extra]
        if self.password is not None:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + START_WAIT
        while time.monotonic() < deadline:
            if ping(self.host, self.port, self.password, timeout=0.5):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        log = (self.dir / "redis.log").read_text() if (self.dir / "redis.log").exists() else ""
        raise RuntimeError(f"redis-server did not start on {self.port}:\n{log}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a frozen server cannot act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def freeze(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        self.stop()
        self.start()
