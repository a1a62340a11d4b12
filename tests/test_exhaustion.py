"""Out of file descriptors, for real: `serve` runs under a low RLIMIT_NOFILE and clients
take every fd it has. A backend connect that finds no fd left answers the client with
the alert and is counted; accept(2) failing with EMFILE backs off and is logged once per
episode (not once per back-off: a shortage lasting minutes would flood the log);
connections already open are unharmed, and once the clients leave new ones are served;
the admin endpoint answers a defined 503 when it has no fd for its answer; a worker with
no fd left for a handed-over connection loses that one, never the others; a terminate
request whose node connection finds no fd is told the edge is busy, not that the node
is offline. And the
terminate body-buffer share of one address, filled by large MCP bodies at once.
No timing asserts: waits are bounded polls of the process's own state and log."""

from __future__ import annotations

import contextlib
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

from tests.terminate_env import (
    OPT_HOST,
    ServeEnv,
    Uploading,
    exchange,
    forget,
    json_events,
    read_response,
    request_bytes,
    rpc,
    tls_socket,
)
from tests.test_edge import (
    ALERT_80,
    DOWN_SNI,
    ECHO_SNI,
    Backend,
    dial,
    echo,
    eventually,
    metric,
    open_fds,
    passthrough_config,
)
from tests.test_serve import HELLO, WAIT, Served, free_port, recv_exact

#: The serve's fd limit: what it opens to start (~16) plus a few dozen connections.
NOFILE = 64
#: Bound on the connections any loop here opens (each serve connection takes 1-2 fds).
MOST = 3 * NOFILE


@contextlib.contextmanager
def starved_serve(tmp: Path) -> Iterator[tuple[Served, int, int]]:
    backend = Backend(echo)
    tls, admin = free_port(), free_port()
    s = Served(tmp, passthrough_config(tls, admin, MOST, {ECHO_SNI: backend.port,
                                                          DOWN_SNI: free_port()}),
               nofile=NOFILE)
    try:
        s.wait_notify("READY=1")
        yield s, tls, admin
    finally:
        s.stop()
        backend.close()


def events(s: Served, name: str) -> list[dict]:
    return [e for e in s.log_events() if e.get("event") == name]


def test_passthrough_out_of_fds_answers_backs_off_once_and_recovers(tmp_path: Path):
    with starved_serve(tmp_path) as (s, tls, admin):
        pid = s.proc.pid
        # spliced connections (two fds each) until a backend connect finds none left:
        # that client gets the alert, the others keep their splice
        held: list[socket.socket] = []
        alerted = False
        for _ in range(MOST):
            c = dial(tls)
            c.sendall(HELLO + b"x")
            got = recv_exact(c, 7)
            if got == ALERT_80:
                assert c.recv(16) == b""  # and closed
                c.close()
                alerted = True
                break
            assert got + recv_exact(c, len(HELLO) - 6) == HELLO + b"x"
            held.append(c)
        assert alerted, "never ran out of fds"

        # clients that say nothing take the last fds; the rest wait in the backlog while
        # accept(2) fails with EMFILE
        idle = [dial(tls) for _ in range(8)]
        eventually(lambda: open_fds(pid) >= NOFILE, "every fd taken")
        eventually(lambda: len(events(s, "accept_failed")) >= 1, "an accept_failed line")
        # the shortage lasts several back-offs (held a while: the admin endpoint shares
        # the shortage, so nothing here can be asked how many), each counted, the
        # episode logged once
        time.sleep(0.5)
        for c in idle:
            c.close()
        for c in held[:3]:  # open connections are unharmed
            c.sendall(b"again")
            assert recv_exact(c, 5) == b"again"
        for c in held:
            c.close()
        # the backlog's leftovers are taken and closed too before the admin endpoint,
        # which shares the fd table, is asked anything
        eventually(lambda: open_fds(pid) < NOFILE - 8, "fds given back")
        eventually(lambda: metric(admin, "pact_ingress_open_connections") == 0,
                   "open_connections back to 0")
        with dial(tls) as c:  # served again
            c.sendall(HELLO + b"y")
            assert recv_exact(c, len(HELLO) + 1) == HELLO + b"y"
        assert metric(admin, "pact_ingress_rejections_total",
                      reason="backend_unreachable") == 1
        failures = metric(admin, "pact_ingress_rejections_total", reason="accept_EMFILE")
        # Logged once per episode, not per failure. The shortage lasted the 0.5 s above,
        # several back-offs, and an episode is one line and one resumed line counting
        # them. It can flap: a connection closing frees an fd that an accept takes, then
        # the next accept fails again (the alerted client's close, the backlog's
        # leftovers taking the fds the idle clients gave back), so there may be more
        # than one episode; each is one pair of lines, whatever its length.
        failed, resumed = events(s, "accept_failed"), events(s, "accept_resumed")
        lines = [e for e in s.log_events() if "accept" in e.get("event", "")]
        assert len(failed) == len(resumed) >= 1, lines
        assert max(e["failures"] for e in resumed) >= 2, lines
        assert sum(e["failures"] for e in resumed) <= failures, (failures, lines)
        assert len(failed) < sum(e["failures"] for e in resumed), lines
        assert "Traceback" not in without_admin_accept(s.logs())


def without_admin_accept(text: str) -> str:
    """The log but for what trio's accept loop under the admin endpoint writes when its
    accept fails (`test_admin_out_of_fds_logs_once` is about that)."""
    return "\n".join(line for line in text.splitlines()
                     if not line.startswith(ADMIN_ACCEPT) and not line.startswith(" ")
                     and line not in ("Traceback (most recent call last):",
                                      "OSError: [Errno 24] Too many open files"))


#: The line trio's `serve_listeners` (hypercorn's accept loop) writes per failed accept.
ADMIN_ACCEPT = "accept returned EMFILE"


def test_admin_out_of_fds_logs_once_and_answers_after(tmp_path: Path):
    with starved_serve(tmp_path) as (s, tls, admin):
        pid = s.proc.pid
        idle = []
        for _ in range(MOST):  # silent clients take every fd
            idle.append(dial(tls))
            if open_fds(pid) >= NOFILE:
                break
        eventually(lambda: open_fds(pid) >= NOFILE, "every fd taken")
        waiting = socket.create_connection(("127.0.0.1", admin), timeout=WAIT)
        waiting.sendall(b"GET /status HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        eventually(lambda: ADMIN_ACCEPT in s.logs() or events(s, "admin_accept_failed"),
                   "the admin accept failed")
        time.sleep(0.5)  # a shortage of several back-offs
        for c in idle:
            c.close()
        eventually(lambda: open_fds(pid) < NOFILE - 8, "fds given back")
        assert waiting.recv(12) == b"HTTP/1.1 200"  # answered once accepted
        waiting.close()
        assert metric(admin, "pact_ingress_open_connections") == 0
        text = s.logs()
        assert "Traceback" not in text
        assert text.count(ADMIN_ACCEPT) + len(events(s, "admin_accept_failed")) <= 1


def test_admin_with_its_last_fd_answers_503_not_a_bare_500(tmp_path: Path):
    """Accepting the admin request takes the last fd; whatever the answer then needs
    (the workers' metrics, /proc) finds none: a defined 503 with Retry-After, a line
    naming the error, and the next request once fds are back is answered in full."""
    with starved_serve(tmp_path) as (s, tls, admin):
        pid = s.proc.pid
        for path in ("/metrics", "/status"):
            idle: list[socket.socket] = []
            for _ in range(MOST):
                if open_fds(pid) >= NOFILE - 1:
                    break
                idle.append(dial(tls))
                # one at a time, each seen accepted: none left in the backlog to take
                # the last fd after the admin request
                eventually(lambda: backlog(tls) == 0, "the client accepted")
            eventually(lambda: open_fds(pid) >= NOFILE - 1, "all fds but one taken")
            with socket.create_connection(("127.0.0.1", admin), timeout=WAIT) as c:
                c.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
                head = recv_head(c)
            for c in idle:
                c.close()
            eventually(lambda: open_fds(pid) < NOFILE - 8, "fds given back")
            assert head.startswith(b"HTTP/1.1 503 "), head
            assert b"\r\nretry-after: 1\r\n" in head.lower(), head
        assert metric(admin, "pact_ingress_open_connections") == 0
        failed = [e for e in s.log_events() if e.get("event") in (
            "admin_metrics_failed", "admin_status_failed")]
        assert {e["event"] for e in failed} == {"admin_metrics_failed", "admin_status_failed"}
        assert all("Too many open files" in e["error"] for e in failed)
        assert not events(s, "Error in ASGI Framework")
        assert "Traceback" not in s.logs()


def backlog(port: int) -> int:
    """Connections waiting in the accept queue of the loopback listener on `port`."""
    with open("/proc/net/tcp") as table:
        for row in table.read().splitlines()[1:]:
            fields = row.split()
            if fields[1] == f"0100007F:{port:04X}" and fields[3] == "0A":  # LISTEN
                return int(fields[4].split(":")[1], 16)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}")


def recv_head(c: socket.socket) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data and len(data) < 65536:
        chunk = c.recv(4096)
        if not chunk:
            break
        data += chunk
    return data


def test_worker_out_of_fds_keeps_its_connections(tmp_path: Path):
    """Terminate connections handed to a worker until it has no fd left for the next
    one: that handoff's fd cannot be installed (the kernel truncates it away), which
    must cost that one connection, never the worker with every connection it holds."""
    env = ServeEnv.start(tmp_path, workers=2, nofile=NOFILE)
    try:
        s = env.serve
        conns: list[ssl.SSLSocket] = []
        for _ in range(2 * MOST):
            try:
                conns.append(tls_socket(s.port, OPT_HOST, timeout=5))
            except OSError:  # this one's fd was lost: the worker is full
                break
        else:
            raise AssertionError("the workers never ran out of fds")
        mcp = request_bytes("POST", "/mcp", OPT_HOST, body=rpc("tools/list"))
        for c in conns[:8]:  # the ones held from before are unharmed: each answered,
            c.sendall(mcp)  # by the node or, no fd left to reach it, a 503 to retry
            answer = read_response(c)
            assert answer.status == 200 or (answer.status == 503 and any(
                k.lower() == "retry-after" for k, _ in answer.headers)), answer.status
        for c in conns:
            c.close()
        # and new ones are served once they left: once the worker has seen them go (a
        # connection made before that may still find it without an fd to spare)
        eventually(lambda: metric(s.admin_port, "pact_ingress_open_connections") == 0,
                   "open_connections back to 0")
        with tls_socket(s.port) as c:
            c.sendall(request_bytes("GET", "/health"))
            assert read_response(c).status > 0
        eventually(lambda: metric(s.admin_port, "pact_ingress_open_connections") == 0,
                   "open_connections back to 0 after the new one")
        assert metric(s.admin_port, "pact_ingress_rejections_total",
                      reason="handoff_EMFILE") >= 1
        names = [e.get("event") for e in json_events(s.logs())]
        assert "worker_channel_broken" not in names and "worker_exited" not in names
        assert names.count("handoff_failed") == 1  # the shortage, logged once
        assert "Traceback" not in s.logs()
    finally:
        env.stop()


def test_body_buffer_cap_per_client_refuses_then_returns_every_byte(tmp_path: Path):
    """One address uploading MCP bodies near the size cap at once, each held just short
    of its end: beyond its buffer share the next is refused (429 + Retry-After) before
    the node sees it; another address is served meanwhile; the held ones, completed,
    are all answered (parsed off the event loop, one at a time); and the share comes
    back whole: the same address can then buffer as much again."""
    env = ServeEnv.start(tmp_path, workers=1)
    try:
        s = env.serve
        body = rpc("tools/list", {"pad": "p" * (5 * 1024 * 1024)})  # 3 fit in 18 MiB, not 4
        head = request_bytes("POST", "/mcp", OPT_HOST, body=body)[: -len(body)]

        def held() -> ssl.SSLSocket:
            c = tls_socket(s.port, OPT_HOST)
            c.sendall(head + body[:-1])  # all but the last byte: buffered, not judged
            return c

        for attempt in range(2):  # the second round finds the share returned
            holding = [held() for _ in range(3)]
            over = tls_socket(s.port, OPT_HOST)
            refused = read_response(Uploading(over, head + body))  # type: ignore[arg-type]
            forget(over)
            assert refused.status == 429, (attempt, refused.status)
            assert refused.header("retry-after") == "1", refused.headers
            bystander = exchange(s.port, request_bytes("POST", "/mcp", OPT_HOST,
                                                       body=rpc("tools/list")),
                                 host=OPT_HOST, source="127.0.0.2")
            assert bystander.status == 200, bystander.status
            for c in holding:
                c.sendall(body[-1:])
            for c in holding:  # every held body answered by the node
                assert read_response(c).status == 200
                forget(c)
        assert "Traceback" not in s.logs()
    finally:
        env.stop()


def test_terminate_out_of_fds_for_the_node_says_the_edge_is_busy(tmp_path: Path):
    """A terminate request whose node connection finds no fd left: the shortage is the
    edge's own, so the client is told the edge is busy (503 + Retry-After), not that its
    home node is offline, and the operator reads one line per shortage naming it, not a
    `node_unreachable` per request; once fds are back the same route is served."""
    env = ServeEnv.start(tmp_path, workers=1, nofile=NOFILE)
    try:
        s = env.serve
        mcp = request_bytes("POST", "/mcp", OPT_HOST, body=rpc("tools/list"))
        conns: list[ssl.SSLSocket] = []
        for _ in range(MOST):  # idle TLS connections until accept(2) fails
            try:
                conns.append(tls_socket(s.port, OPT_HOST, timeout=2))
            except OSError:
                break
        else:
            raise AssertionError("serve never ran out of fds")
        eventually(lambda: open_fds(s.proc.pid) >= NOFILE, "every fd taken")
        answers = []
        for c in conns[:3]:  # each needs a node connection the edge has no fd for
            c.sendall(mcp)
            answers.append(read_response(c))
        for answer in answers:
            assert answer.status == 503, answer.status
            assert answer.header("retry-after") == "1", answer.headers
            assert b"the edge is busy" in answer.body, answer.body
            assert b"offline" not in answer.body, answer.body
        for c in conns:
            c.close()
        eventually(lambda: open_fds(s.proc.pid) < NOFILE - 8, "fds given back")
        served = exchange(s.port, mcp, host=OPT_HOST)
        assert served.status == 200, served.status
        names = [e.get("event") for e in json_events(s.logs())]
        assert "node_unreachable" not in names, names
        assert names.count("upstream_no_fds") == 1, names
        assert names.count("upstream_fds_back") == 1, names
        assert "Traceback" not in without_admin_accept(s.logs())
    finally:
        env.stop()
