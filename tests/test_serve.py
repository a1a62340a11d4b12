"""`pact-ingress serve` as systemd runs it: a real process, real signals, sd_notify.

Covers the operational promises: READY once listening; SIGHUP reload picks up a tenant
added with `pact-ingress tenant add` (new connections see it, open ones continue); a bad
config on SIGHUP is refused with FILE:LINE logged and the old config kept; /metrics moves
with traffic; SIGTERM → STOPPING, drain of open connections, exit 0.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pact_ingress.admin.client import fetch_status, request
from pact_ingress.config import Address
from pact_ingress.identity import keygen
from tests.netutil import START_WAIT, free_port, limited, wait_told

HELLO_DIR = Path(__file__).parent / "vectors" / "clienthello"
HELLO = (HELLO_DIR / "curl.bin").read_bytes()  # SNI www.example.test
WAIT = 20.0


class EchoBackend:
    """A thread-free raw TCP echo server in a child process (python -c)."""

    def __init__(self) -> None:
        self.port = free_port()
        code = (
            "import socket,threading\n"
            f"s=socket.create_server(('127.0.0.1',{self.port}))\n"
            "def h(c):\n"
            "  while (d:=c.recv(65536)): c.sendall(d)\n"
            "  c.close()\n"
            "while True:\n"
            "  c,_=s.accept(); threading.Thread(target=h,args=(c,),daemon=True).start()\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("echo backend did not start")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


class Served:
    def __init__(self, tmp: Path, config_text: str, *, nofile: int | None = None) -> None:
        """`nofile`: the serve's RLIMIT_NOFILE (soft and hard), to run it out of fds."""
        self.tmp = tmp
        self.config = tmp / "ingress.yaml"
        self.config.write_text(config_text)
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(tmp / "notify.sock"))
        self.notify.settimeout(WAIT)
        self.log = open(tmp / "serve.log", "w+b")
        env = dict(os.environ, NOTIFY_SOCKET=str(tmp / "notify.sock"))
        self.proc = subprocess.Popen(
            [*limited(nofile), sys.executable, "-m", "pact_ingress", "serve",
             "-c", str(self.config)],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def wait_notify(self, wanted: str) -> list[str]:
        told, seen = wait_told(self.notify, wanted, self.proc,
                               START_WAIT if wanted == "READY=1" else WAIT)
        if told:
            return seen
        raise AssertionError(f"no {wanted} from serve; got {seen}; log:\n{self.logs()}")

    def logs(self) -> str:
        self.log.flush()
        return (self.tmp / "serve.log").read_text()

    def log_events(self) -> list[dict]:
        out = []
        for line in self.logs().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.notify.close()
        self.log.close()


def connect_hello(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
    s.sendall(HELLO)
    return s


def listener_closed(port: int) -> bool:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except (ConnectionRefusedError, ConnectionResetError):
            # reset: the connection sat in the backlog of a listener that then closed
            return True
        time.sleep(0.05)
    return False


def recv_exact(s: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            break
        buf += chunk
    return buf


@pytest.fixture
def echo() -> Iterator[EchoBackend]:
    backend = EchoBackend()
    yield backend
    backend.stop()


def config_text(tls: int, admin: int, echo_port: int) -> str:
    return f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls}"]
  admin: "127.0.0.1:{admin}"
include: tenants.d/*.yaml
tenants:
  - name: alina
    pins: ["sha256:{'A' * 43}"]
    routes:
      - {{host: alina.test, mode: passthrough, backend: "127.0.0.1:{echo_port}"}}
"""


def test_serve_reload_metrics_and_drain(tmp_path: Path, echo: EchoBackend):
    tls, admin = free_port(), free_port()
    served = Served(tmp_path, config_text(tls, admin, echo.port))
    try:
        served.wait_notify("READY=1")
        # the captured hello's SNI is not configured yet: alert unrecognized_name
        with connect_hello(tls) as s:
            assert recv_exact(s, 7) == b"\x15\x03\x03\x00\x02\x02\x70"

        # tenant add (real CLI) + SIGHUP → new connections see the new route
        node = keygen(tmp_path / "node.key")
        add = subprocess.run(
            [sys.executable, "-m", "pact_ingress", "tenant", "add", "www",
             "--host", "www.example.test", "--pin", node.fingerprint,
             "--backend", f"127.0.0.1:{echo.port}", "-c", str(served.config)],
            capture_output=True, text=True, timeout=60, check=False)
        assert add.returncode == 0, add.stderr
        assert "DNS records" in add.stdout
        # invalid pin and duplicate host are refused by the CLI, nothing written
        bad_pin = subprocess.run(
            [sys.executable, "-m", "pact_ingress", "tenant", "add", "eve", "--host",
             "eve.test", "--pin", "sha256:short", "-c", str(served.config)],
            capture_output=True, text=True, timeout=60, check=False)
        assert bad_pin.returncode == 2 and "pin" in bad_pin.stderr
        dup = subprocess.run(
            [sys.executable, "-m", "pact_ingress", "tenant", "add", "eve", "--host",
             "alina.test", "--pin", node.fingerprint, "-c", str(served.config)],
            capture_output=True, text=True, timeout=60, check=False)
        assert dup.returncode == 2 and "alina.test" in dup.stderr
        assert sorted(p.name for p in (tmp_path / "tenants.d").iterdir()) == ["www.yaml"]

        served.proc.send_signal(signal.SIGHUP)
        served.wait_notify("READY=1")
        with connect_hello(tls) as s:
            assert recv_exact(s, len(HELLO)) == HELLO  # echoed through the new route

        # a long-lived connection survives a bad reload and a good one
        long_lived = connect_hello(tls)
        assert recv_exact(long_lived, len(HELLO)) == HELLO
        good = served.config.read_text()
        served.config.write_text(good + "bogus_key: 1\n")
        served.proc.send_signal(signal.SIGHUP)
        served.wait_notify("READY=1")
        refused = [e for e in served.log_events() if e.get("event") == "reload_refused"]
        assert refused and f"{served.config}:" in refused[-1]["error"]
        assert "bogus_key" in refused[-1]["error"]
        served.config.write_text(good)
        with connect_hello(tls) as s:  # old config still in force
            assert recv_exact(s, len(HELLO)) == HELLO
        long_lived.sendall(b"still there")
        assert recv_exact(long_lived, 11) == b"still there"

        # metrics and status from the admin endpoint
        status, body = request(Address("127.0.0.1", admin), "GET", "/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        reloads = {s.labels["result"]: s.value for s in families["pact_ingress_config_reloads"]
                   .samples if s.name.endswith("_total")}
        assert reloads == {"ok": 1.0, "error": 1.0}
        conns = families["pact_ingress_rejections"].samples
        assert any(s.labels.get("reason") == "unknown_sni" and s.value >= 1 for s in conns)
        st = fetch_status(Address("127.0.0.1", admin))
        assert {r["host"] for r in st["routes"]} == {"alina.test", "www.example.test"}

        # SIGTERM: STOPPING, the open connection may finish, then exit 0
        served.proc.send_signal(signal.SIGTERM)
        served.wait_notify("STOPPING=1")
        long_lived.sendall(b"draining")
        assert recv_exact(long_lived, 8) == b"draining"
        assert listener_closed(tls)  # STOPPING is sent just before the listener closes
        long_lived.close()
        assert served.proc.wait(timeout=WAIT) == 0
    finally:
        served.stop()


def test_remote_admin_needs_the_token_file(tmp_path: Path):
    """listen.admin_token_file: the admin endpoint may bind beyond loopback, and every
    request must carry the file's token (checked through the real `serve` process)."""
    tls, admin = free_port(), free_port()
    token = "t" * 40
    (tmp_path / "admin.token").write_text(token + "\n")
    (tmp_path / "admin.token").chmod(0o600)  # a secret: every user's to read is refused
    served = Served(tmp_path, f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{tls}"]
  admin: "0.0.0.0:{admin}"
  admin_token_file: admin.token
tenants: []
""")
    try:
        served.wait_notify("READY=1")
        status, _ = request(Address("127.0.0.1", admin), "GET", "/status")
        assert status == 401
        st = fetch_status(Address("127.0.0.1", admin), token=token)
        assert st["routes"] == []
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=WAIT) == 0
    finally:
        served.stop()


def _terminate_route(host: str, cert: str, key: str) -> str:
    return (f"      - host: {host}\n        mode: terminate\n        backend: '127.0.0.1:9'\n"
            f"        cert:\n          cert: {cert}\n          key: {key}\n")


def test_reload_that_cannot_be_applied_keeps_the_running_config(tmp_path: Path,
                                                                echo: EchoBackend):
    """A SIGHUP whose config cannot be applied is refused with one logged line, whatever
    fails: the validator's FILE:LINE for a cert path below a file, or the file system's
    own error for a directory nothing can be created in. The process lives and serves."""
    tls, admin = free_port(), free_port()
    good = config_text(tls, admin, echo.port).replace("alina.test", "www.example.test")
    served = Served(tmp_path, good)
    try:
        served.wait_notify("READY=1")
        with connect_hello(tls) as s:
            assert recv_exact(s, len(HELLO)) == HELLO
        (tmp_path / "afile").write_text("a file where a directory would have to be\n")
        cases = [  # (config text, expected start of the refusal line)
            (good + _terminate_route("t.test", "afile/t.crt", "keys/t.key"),
             f"{served.config}:15: terminate route 't.test': "),
            (good + _terminate_route("t.test", "/proc/pact-ingress-test/t.crt",
                                     "/proc/pact-ingress-test/t.key"),
             f"{served.config}: cannot apply: FileNotFoundError: "),
        ]
        for n, (text, refusal) in enumerate(cases, 1):
            served.config.write_text(text)
            served.proc.send_signal(signal.SIGHUP)
            served.wait_notify("READY=1")
            assert served.proc.poll() is None, served.logs()
            refused = [e for e in served.log_events() if e.get("event") == "reload_refused"]
            assert len(refused) == n, served.logs()
            assert refused[-1]["error"].startswith(refusal), refused[-1]
            assert "Traceback" not in served.logs()
            with connect_hello(tls) as s:  # the running config still serves
                assert recv_exact(s, len(HELLO)) == HELLO
            st = fetch_status(Address("127.0.0.1", admin))
            assert [r["host"] for r in st["routes"]] == ["www.example.test"]
        # a good config applies afterwards as usual
        served.config.write_text(good)
        served.proc.send_signal(signal.SIGHUP)
        served.wait_notify("READY=1")
        assert any(e.get("event") == "reloaded" for e in served.log_events())
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=WAIT) == 0
    finally:
        served.stop()


@pytest.mark.parametrize("taken_by", ["admin", "tls", "http"])
def test_listen_address_in_use_is_one_line_naming_it(tmp_path: Path, taken_by: str):
    """Another process on a configured port: one line naming the address, exit 1."""
    ports = {name: free_port() for name in ("tls", "admin", "http")}
    config = tmp_path / "ingress.yaml"
    config.write_text(f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{ports['tls']}"]
  http: ["127.0.0.1:{ports['http']}"]
  admin: "127.0.0.1:{ports['admin']}"
tenants: []
""")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[taken_by]))
        taken.listen(1)
        result = subprocess.run(
            [sys.executable, "-m", "pact_ingress", "serve", "-c", str(config)],
            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    said = [line for line in result.stderr.splitlines() if not line.startswith("{")]
    assert said == [f"pact-ingress: cannot listen on 127.0.0.1:{ports[taken_by]}: "
                    "address in use"]


def test_status_into_a_closed_pipe_is_quiet(tmp_path: Path, echo: EchoBackend):
    """`pact-ingress status | head -1`: the reader leaving early is no error to report."""
    tls, admin = free_port(), free_port()
    served = Served(tmp_path, config_text(tls, admin, echo.port))
    try:
        served.wait_notify("READY=1")
        read_end, write_end = os.pipe()
        os.close(read_end)  # like `head` after its first line: every write gets EPIPE
        try:
            result = subprocess.run(
                [sys.executable, "-m", "pact_ingress", "status", "-c", str(served.config)],
                stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=60, check=False)
        finally:
            os.close(write_end)
        assert result.stderr == ""
        assert result.returncode == 128 + signal.SIGPIPE
        with_reader = subprocess.run(
            [sys.executable, "-m", "pact_ingress", "status", "-c", str(served.config)],
            capture_output=True, text=True, timeout=60, check=False)
        assert with_reader.returncode == 0 and "alina.test" in with_reader.stdout
    finally:
        served.stop()
