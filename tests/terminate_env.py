"""Black-box harness for terminate-mode attack tests: a real `pact-ingress serve` process
in front of a recording home node, driven by raw sockets and real clients.

Nothing here imports the terminate engine. What a test may observe:

* what the client got on the wire (`RawResponse`, `H2Conn` results, tool output);
* what the home node received (`RecordingNode.requests()`: method, raw target,
  headers, body bytes, the client certificate on the link);
* the admin endpoint of the serve process (`Serve.status()`, `Serve.metrics()`) and its
  process facts (`Serve.rss_kib()`, the JSON log lines).

Fixture API (see tests/test_terminate_attacks.py for use):

    node = RecordingNode(node_identity, client_ca=ingress_identity)   # pinned mTLS node
    serve = Serve(tmp, node, limits={"max_connections_per_ip": 20})  # starts, waits READY
    sock = tls_socket(serve.port, HOST, source="127.0.0.2")          # raw TLS client
    sock.sendall(request_bytes("POST", "/mcp", HOST, body=rpc(...)))
    resp = read_response(sock)
    node.requests()                # list[NodeRequest]; node.unsealed_calls()
    serve.open_connections()       # /status counters.open_connections
    serve.reload(seal="optional")  # rewrite config + SIGHUP, waits for the outcome
    serve.stop(); node.stop()

The node speaks HTTP/1.1 only (ALPN http/1.1), so the edge needs one upstream connection
per in-flight request — the configuration in which one client's slow requests could hold
every pooled connection. Endpoints:

* `GET /stream?n=N&interval=S` — chunked, one small chunk every S seconds (N chunks);
* `GET /big?bytes=N` — a large body written as fast as the edge reads it;
* a path starting `/whole`: answered as below, head and body in one write (the edge then
  has the whole answer in one read);
* anything else: the body is read whole; JSON-RPC requests are answered (tools/list;
  tools/call → a result saying the node *executed* it), other bodies get their size and
  SHA-256 back as JSON.

Every wait is bounded (`WAIT`); every address is loopback (127.0.0.0/8).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import h2.config
import h2.connection
import h2.events
import h11
import pytest

from pact_ingress.envelope import seal
from pact_ingress.identity import Identity, b64url, fingerprint_of_cert_der, keygen, spki_der
from tests.netutil import START_WAIT, free_port, limited, wait_told

LOOPBACK = "127.0.0.1"
#: The attacker's and the bystander's source addresses (Linux routes all 127/8 to lo).
ATTACKER_IP = "127.0.0.2"
BYSTANDER_IP = "127.0.0.3"
HOST = "mcp.attack.test"  # seal: required
OPT_HOST = "opt.attack.test"  # seal: optional, same tenant, same node
WAIT = 20.0

@dataclass
class Identities:
    node: Identity
    ingress: Identity
    caller: Identity


def make_identities(tmp: Path) -> Identities:
    return Identities(node=keygen(tmp / "node.key", common_name="node"),
                      ingress=keygen(tmp / "ingress.key", common_name="ingress"),
                      caller=keygen(tmp / "caller.key", ed25519_key=True, common_name="caller"))


# --- JSON-RPC bodies ---------------------------------------------------------------------


def rpc(method: str, params: dict[str, Any] | None = None, rpc_id: int | str | None = 1) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    if rpc_id is not None:
        message["id"] = rpc_id
    return json.dumps(message).encode()


def unsealed_call_body(text: str = "unsealed", rpc_id: int | str = 1) -> bytes:
    """A substantive, unsealed tools/call: what a `seal: required` node must never see."""
    return rpc("tools/call", {"name": "send_message",
                              "arguments": {"msg_id": f"m-{rpc_id}", "text": text}}, rpc_id)


def sealed_call_body(ids: Identities, *, msg_id: str = "s-1", rpc_id: int | str = 1,
                     ts: int | None = None, exp: int | None = None) -> bytes:
    now = int(time.time())
    ts = now if ts is None else ts
    inner = {"method": "tools/call", "params": {"name": "send_message", "arguments": {
        "msg_id": f"inner-{msg_id}", "text": "sealed hello", "sender": "agent"}},
        "spk": b64url(spki_der(ids.caller.key.public_key()))}
    args = seal(inner, sender_key=ids.caller.key,
                recipient_public_key=ids.node.key.public_key(),  # type: ignore[arg-type]
                msg_id=msg_id, ts=ts, exp=ts + 600 if exp is None else exp)
    return rpc("tools/call", {"name": "sealed_call", "arguments": args}, rpc_id)


def refusal_code(body: bytes) -> str | None:
    """The PACT refusal code in an edge answer (JSON-RPC result.isError), else None."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    for item in doc if isinstance(doc, list) else [doc]:
        result = item.get("result") if isinstance(item, dict) else None
        if isinstance(result, dict) and result.get("isError"):
            sc = result.get("structuredContent")
            if isinstance(sc, dict) and isinstance(sc.get("code"), str):
                return sc["code"]
    return None


# --- the recording home node -------------------------------------------------------------


@dataclass
class NodeRequest:
    """One request as the home node received it."""

    method: str
    target: str
    headers: list[tuple[str, str]]
    peer: str | None  # fingerprint of the client certificate on the link
    body: bytes = b""
    complete: bool = False

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]

    def header_values(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k == name.lower()]

    def rpc_elements(self) -> list[dict[str, Any]]:
        try:
            doc = json.loads(self.body)
        except ValueError:
            return []
        return [m for m in (doc if isinstance(doc, list) else [doc]) if isinstance(m, dict)]

    def unsealed_tool_calls(self) -> list[Any]:
        """Tool names of tools/call elements that are not sealed_call."""
        out = []
        for m in self.rpc_elements():
            if m.get("method") == "tools/call":
                params = m.get("params")
                name = params.get("name") if isinstance(params, dict) else None
                if name != "sealed_call":
                    out.append(name)
        return out

    def looks_like_tool_call(self) -> bool:
        """Any tools/call in the raw bytes, even ones the node could not parse."""
        return b"tools/call" in self.body


def close_node(listener: socket.socket, lock: threading.Lock,
               socks: set[socket.socket]) -> None:
    """A test node's stop: no more accepts, every connection it holds shut and closed
    (its serving threads then end on their next read)."""
    with contextlib.suppress(OSError):
        listener.close()
    with lock:
        held = list(socks)
    for s in held:
        with contextlib.suppress(OSError):
            s.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            s.close()


def tarpit_route(host: str, port: int, limits: str = "") -> str:
    """`extra_routes` YAML for a terminate route whose node accepts no connection (a
    listener at `port` that never calls accept: the edge's connect waits in its
    backlog), so a request there never has its body taken by the node."""
    line = f"        limits: {limits}\n" if limits else ""
    return (f"      - host: {host}\n"
            "        mode: terminate\n"
            f'        backend: "{LOOPBACK}:{port}"\n'
            "        seal: optional\n"
            "        mcp_path: /mcp\n"
            f"        cert: {{cert: certs/{host}.crt, key: certs/{host}.key}}\n" + line)


class RecordingNode:
    """A pinned-mTLS HTTP/1.1 home node on loopback that records every request.

    Thread per connection (stdlib ssl + h11). With `client_ca`, a client certificate is
    required and must be that identity's (the ingress's) self-signed cert.
    """

    def __init__(self, identity: Identity, *, client_ca: Identity | None = None,
                 host: str = LOOPBACK) -> None:
        self.identity = identity
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(identity.cert_path, identity.key_path)
        ctx.set_alpn_protocols(["http/1.1"])
        if client_ca is not None:
            ctx.verify_mode = ssl.CERT_REQUIRED
            ctx.load_verify_locations(cafile=str(client_ca.cert_path))
        self._ctx = ctx
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=1024)
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self._requests: list[NodeRequest] = []
        self._socks: set[socket.socket] = set()
        self._stopped = False
        #: Responses of /stream and /big still being written.
        self.active_streams = 0
        self.connections_total = 0
        threading.Thread(target=self._accept_loop, daemon=True, name="node-accept").start()

    # -- observation ------------------------------------------------------------------

    def requests(self) -> list[NodeRequest]:
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    def unsealed_calls(self) -> list[NodeRequest]:
        return [r for r in self.requests()
                if r.unsealed_tool_calls() or (r.looks_like_tool_call()
                                               and b"sealed_call" not in r.body)]

    def wait_for(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(0.05)
        return predicate()

    def stop(self) -> None:
        self._stopped = True
        close_node(self._listener, self._lock, self._socks)

    # -- serving ----------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                raw, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._socks.add(raw)
                self.connections_total += 1
            threading.Thread(target=self._serve_conn, args=(raw,), daemon=True).start()

    def _serve_conn(self, raw: socket.socket) -> None:
        raw.settimeout(120)
        # A response is written as head, then body: with Nagle the body waits for the
        # head's ACK, which a reader with nothing to say delays by 40 ms.
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            tls = self._ctx.wrap_socket(raw, server_side=True)
            der = tls.getpeercert(binary_form=True)
            peer = fingerprint_of_cert_der(der) if der else None
            conn = h11.Connection(h11.SERVER, max_incomplete_event_size=256 * 1024)
            while not self._stopped:
                if not self._one_exchange(tls, conn, peer):
                    return
                if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                    conn.start_next_cycle()
                else:
                    return
        except (OSError, ssl.SSLError, h11.ProtocolError, ValueError):
            return
        finally:
            with self._lock:
                self._socks.discard(raw)
            with contextlib.suppress(OSError):
                raw.close()

    @staticmethod
    def _next_event(tls: ssl.SSLSocket, conn: h11.Connection) -> Any:
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(tls.recv(65536))
                continue
            return event

    def _one_exchange(self, tls: ssl.SSLSocket, conn: h11.Connection, peer: str | None) -> bool:
        event = self._next_event(tls, conn)
        if not isinstance(event, h11.Request):
            return False
        rec = NodeRequest(event.method.decode(), event.target.decode("latin-1"),
                          [(k.decode().lower(), v.decode("latin-1")) for k, v in event.headers],
                          peer)
        with self._lock:
            self._requests.append(rec)
        body = bytearray()
        while True:
            ev = self._next_event(tls, conn)
            if isinstance(ev, h11.Data):
                body += ev.data
                rec.body = bytes(body)
            elif isinstance(ev, h11.EndOfMessage):
                break
            else:
                return False
        rec.body, rec.complete = bytes(body), True
        url = urlsplit(rec.target)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/stream":
            self._stream(tls, conn, int(query.get("n", "3")), float(query.get("interval", "0.1")))
        elif url.path == "/big":
            self._big(tls, conn, int(query.get("bytes", str(1 << 20))))
        else:
            status, payload = self._answer(rec)
            head = conn.send(h11.Response(status_code=status, headers=[
                ("content-type", "application/json"), ("content-length", str(len(payload)))]))
            # no body to a HEAD request (its head says how long the body would be)
            rest = (conn.send(h11.Data(data=payload)) if payload and rec.method != "HEAD"
                    else b"") + conn.send(h11.EndOfMessage())
            if url.path.startswith("/whole"):  # head and body in one write, as many servers do
                tls.sendall(head + rest)
            else:
                tls.sendall(head)
                if rest:
                    tls.sendall(rest)
        return True

    @staticmethod
    def _send(tls: ssl.SSLSocket, conn: h11.Connection, event: Any) -> None:
        data = conn.send(event)
        if data:
            tls.sendall(data)

    def _stream(self, tls: ssl.SSLSocket, conn: h11.Connection, n: int, interval: float) -> None:
        with self._lock:
            self.active_streams += 1
        try:
            self._send(tls, conn, h11.Response(status_code=200, headers=[
                ("content-type", "text/event-stream")]))
            for i in range(n):
                if self._stopped:
                    raise OSError("node stopped")
                self._send(tls, conn, h11.Data(data=f"id: {i}\ndata: tick\n\n".encode()))
                time.sleep(interval)
            self._send(tls, conn, h11.EndOfMessage())
        finally:
            with self._lock:
                self.active_streams -= 1

    def _big(self, tls: ssl.SSLSocket, conn: h11.Connection, size: int) -> None:
        with self._lock:
            self.active_streams += 1
        try:
            self._send(tls, conn, h11.Response(status_code=200, headers=[
                ("content-type", "application/octet-stream"), ("content-length", str(size))]))
            chunk = b"x" * 65536
            left = size
            while left > 0 and not self._stopped:
                piece = chunk[: min(left, len(chunk))]
                self._send(tls, conn, h11.Data(data=piece))
                left -= len(piece)
            self._send(tls, conn, h11.EndOfMessage())
        finally:
            with self._lock:
                self.active_streams -= 1

    @staticmethod
    def _answer(rec: NodeRequest) -> tuple[int, bytes]:
        try:
            doc = json.loads(rec.body) if rec.body else None
        except ValueError:
            doc = None
        if isinstance(doc, dict) and doc.get("jsonrpc") == "2.0" and "method" in doc:
            if "id" not in doc:
                return 202, b""
            method = doc["method"]
            if method == "tools/list":
                result: dict[str, Any] = {"tools": [{"name": "send_message"},
                                                    {"name": "sealed_call"}]}
            elif method == "tools/call":
                name = (doc.get("params") or {}).get("name")
                result = {"content": [{"type": "text", "text": f"node executed {name}"}],
                          "structuredContent": {"executed": name}}
            else:
                result = {}
            return 200, json.dumps({"jsonrpc": "2.0", "id": doc["id"], "result": result}).encode()
        return 200, json.dumps({"bytes": len(rec.body),
                                "sha256": hashlib.sha256(rec.body).hexdigest(),
                                "target": rec.target}).encode()


# --- the serve process -------------------------------------------------------------------


def hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def json_events(text: str) -> list[dict[str, Any]]:
    """The JSON objects among a process's log lines (any other line is skipped)."""
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                out.append(doc)
    return out


@dataclass
class Serve:
    """`python -m pact_ingress serve -c CONFIG` with two terminate routes on one node.

    `HOST` is `seal: required`, `OPT_HOST` is `seal: optional`; `limits` is the top-level
    limits block (any key of the config's `limits:`). Started (and READY) on construction.
    """

    tmp: Path
    node: RecordingNode
    node_fp: str
    limits: dict[str, Any] = field(default_factory=dict)
    seal: str = "required"
    opt_seal: str = "optional"
    extra_routes: str = ""
    #: More terminate routes to the node, `seal: optional`: (host, inline route limits
    #: YAML such as "{idle_timeout: 1s}", or "" for the top-level ones).
    node_routes: tuple[tuple[str, str], ...] = ()
    workers: int | None = None  # `serve --workers N`; None: the default (one per core)
    nofile: int | None = None  # the serve's RLIMIT_NOFILE (soft and hard), to run it out
    #: Where the TLS and admin listeners bind, and how the routes name the node (an IPv6
    #: literal is written in brackets; a name such as `localhost` as is).
    listen_host: str = LOOPBACK
    backend_host: str = LOOPBACK

    def __post_init__(self) -> None:
        self.port, self.admin_port = free_port(self.listen_host), free_port(self.listen_host)
        self.config = self.tmp / "ingress.yaml"
        self.config.write_text(self.render())
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.tmp / "notify.sock"))
        self.notify.settimeout(WAIT)
        self.log_path = self.tmp / "serve.log"
        self._log = open(self.log_path, "w+b")
        env = dict(os.environ, NOTIFY_SOCKET=str(self.tmp / "notify.sock"))
        workers = [] if self.workers is None else ["--workers", str(self.workers)]
        self.proc = subprocess.Popen(
            [*limited(self.nofile), sys.executable, "-m", "pact_ingress", "serve",
             "-c", str(self.config), *workers],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self.wait_notify("READY=1", timeout=START_WAIT)
        except BaseException:
            self.stop()
            raise

    def render(self) -> str:
        limits = "".join(f"  {k}: {v}\n" for k, v in self.limits.items())
        routes = ""
        for host, posture, route_limits in ((HOST, self.seal, ""), (OPT_HOST, self.opt_seal, ""),
                                            *((h, "optional", lim) for h, lim in self.node_routes)):
            routes += f"""\
      - host: {host}
        mode: terminate
        backend: "{hostport(self.backend_host, self.node.port)}"
        seal: {posture}
        mcp_path: /mcp
        cert: {{cert: certs/{host}.crt, key: certs/{host}.key}}
"""
            if route_limits:
                routes += f"        limits: {route_limits}\n"
        return f"""\
identity: {{key: ingress.key}}
state_dir: state
listen:
  tls: ["{hostport(self.listen_host, self.port)}"]
  admin: "{hostport(self.listen_host, self.admin_port)}"
{"limits:" + chr(10) + limits if limits else ""}tenants:
  - name: attack
    pins: ["{self.node_fp}"]
    routes:
{routes}{self.extra_routes}"""

    # -- process ----------------------------------------------------------------------

    def wait_notify(self, wanted: str, timeout: float = WAIT) -> list[str]:
        told, seen = wait_told(self.notify, wanted, self.proc, timeout)
        if told:
            return seen
        raise AssertionError(f"no {wanted} from serve (exit={self.proc.poll()}); got {seen};"
                             f" log tail:\n{self.logs()[-3000:]}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def log_events(self) -> list[dict[str, Any]]:
        return json_events(self.logs())

    def reload(self, text: str | None = None, **changes: Any) -> str:
        """Write a new config (`text`, or this one re-rendered with `changes`), SIGHUP,
        and wait for the outcome: the log event ("reloaded" / "reload_refused" / ...)."""
        for key, value in changes.items():
            setattr(self, key, value)
        self.config.write_text(text if text is not None else self.render())
        before = len(self.log_events())
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline:
            events = self.log_events()[before:]
            for e in events:
                if e.get("event") in ("reloaded", "reload_refused"):
                    return str(e["event"])
            if not self.alive():
                return f"process exited {self.proc.returncode}"
            time.sleep(0.05)
        return "no reload outcome logged"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.notify.close()
        self._log.close()

    # -- admin ------------------------------------------------------------------------

    def _admin(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://{hostport(self.listen_host, self.admin_port)}{path}",
                                    timeout=10) as r:
            return bytes(r.read())

    def status(self) -> dict[str, Any]:
        return dict(json.loads(self._admin("/status")))

    def metrics(self) -> str:
        return self._admin("/metrics").decode()

    def open_connections(self) -> int:
        return int(self.status()["counters"].get("open_connections", -1))

    def wait_open_connections(self, expected: int = 0, timeout: float = WAIT) -> int:
        """Poll /status until open_connections == expected (bounded); returns the last
        value seen."""
        deadline = time.monotonic() + timeout
        value = self.open_connections()
        while value != expected and time.monotonic() < deadline:
            time.sleep(0.2)
            value = self.open_connections()
        return value

    def pids(self) -> list[int]:
        """The instance's processes: serve and its worker processes (`--workers`)."""
        pids = [self.proc.pid]
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            with contextlib.suppress(OSError):
                pids += [int(p) for p in (task / "children").read_text().split()]
        return pids

    def proc_status(self, field_name: str) -> int:
        """A /proc/PID/status field in KiB (VmRSS, VmHWM), summed over the instance's
        processes (for VmHWM: the sum of each process's peak, an upper bound)."""
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith(field_name + ":"):
                        total += int(line.split()[1])
        if not total:
            raise KeyError(field_name)
        return total

    def rss_kib(self) -> int:
        return self.proc_status("VmRSS")

    def open_fds(self) -> int:
        total = 0
        for pid in self.pids():
            with contextlib.suppress(OSError):
                total += len(os.listdir(f"/proc/{pid}/fd"))
        return total


@dataclass
class ServeEnv:
    """A recording node and a `serve` whose routes lead to it, with their identities."""

    serve: Serve
    node: RecordingNode
    ids: Identities
    tmp: Path

    @classmethod
    def start(cls, tmp: Path, **kw: Any) -> ServeEnv:
        """Fresh identities in `tmp`, the node, then `Serve(..., **kw)`."""
        ids = make_identities(tmp)
        node = RecordingNode(ids.node, client_ca=ids.ingress)
        try:
            serve = Serve(tmp, node, ids.node.fingerprint, **kw)
        except BaseException:
            node.stop()
            raise
        return cls(serve, node, ids, tmp)

    def fresh(self) -> ServeEnv:
        """This one again for the next test (shared by a module): still up, node cleared."""
        assert self.serve.alive(), self.serve.logs()[-3000:]
        self.node.clear()
        return self

    def stop(self) -> None:
        self.serve.stop()
        self.node.stop()


def wait_settled(count: Callable[[], int], want: int, timeout: float = WAIT,
                 settled: float = 1.0) -> int:
    """Until `count()` reaches `want`, or stops growing for `settled` seconds after it
    first moved (what an attack lets through may stop short of what it asked for: the
    edge's caps hold the rest back); bounded by `timeout`. Returns the last count."""
    deadline = time.monotonic() + timeout
    seen, since = -1, time.monotonic()
    while True:
        done = count()
        if done >= want or time.monotonic() >= deadline:
            return done
        if done != seen:
            seen, since = done, time.monotonic()
        elif done and time.monotonic() - since >= settled:
            return done
        time.sleep(0.05)


def module_fixtures(name: str) -> tuple[Any, Any]:
    """A module's `shared` (one serve + node with default limits, for the whole module)
    and `env` (`shared`, still up, its node's record cleared) fixtures:
    `shared, env = module_fixtures("name")`."""

    @pytest.fixture(scope="module")
    def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeEnv]:
        env = ServeEnv.start(tmp_path_factory.mktemp(name))
        yield env
        env.stop()

    @pytest.fixture
    def env(shared: ServeEnv) -> ServeEnv:
        return shared.fresh()

    return shared, env


# --- clients -----------------------------------------------------------------------------


def client_context(alpn: Iterable[str] = ("http/1.1",)) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(list(alpn))
    return ctx


def tls_socket(port: int, host: str = HOST, *, source: str = LOOPBACK,
               alpn: Iterable[str] = ("http/1.1",), rcvbuf: int | None = None,
               timeout: float = WAIT) -> ssl.SSLSocket:
    """A TLS connection to the edge on loopback from `source`, with SNI `host` (from ::1
    to ::1 when `source` is an IPv6 address)."""
    v6 = ":" in source
    raw = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.settimeout(timeout)
    try:
        raw.bind((source, 0))
        raw.connect(("::1" if v6 else LOOPBACK, port))
        return client_context(alpn).wrap_socket(raw, server_hostname=host)
    except BaseException:
        raw.close()
        raise


def request_bytes(method: str, target: str, host: str | None = HOST, *, body: bytes = b"",
                  headers: Iterable[tuple[str, str]] = (), content_type: str | None =
                  "application/json", length: bool = True) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    if host is not None:
        lines.append(f"Host: {host}")
    if content_type is not None and (body or method == "POST"):
        lines.append(f"Content-Type: {content_type}")
    lines.append("Accept: application/json, text/event-stream")
    lines += [f"{k}: {v}" for k, v in headers]
    if length and (body or method == "POST"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class RawResponse:
    status: int
    reason: str
    headers: list[tuple[str, str]]
    body: bytes
    status_line: str

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k == name.lower():
                return v
        return None

    @property
    def code(self) -> str | None:
        return refusal_code(self.body)


class _Reader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buf += chunk
        return bool(chunk)

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            if not self.fill():
                raise ConnectionError("closed mid-line")
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self.fill():
                raise ConnectionError("closed mid-body")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


_READERS: dict[int, _Reader] = {}


def read_response(sock: socket.socket, *, head_only: bool = False) -> RawResponse:
    """Read one HTTP/1.1 response (Content-Length, chunked or close-delimited).

    Bytes after it stay buffered for the next call on the same socket. Raises
    ConnectionError when the connection closes before a status line.
    """
    reader = _READERS.setdefault(id(sock), _Reader(sock))
    if reader.sock is not sock:
        reader = _READERS[id(sock)] = _Reader(sock)
    status_line = reader.line().decode("latin-1")
    while status_line.startswith("HTTP/1.1 1"):  # interim: skip
        while reader.line():
            pass
        status_line = reader.line().decode("latin-1")
    parts = status_line.split(" ", 2)
    status, reason = int(parts[1]), (parts[2] if len(parts) > 2 else "")
    headers = []
    while line := reader.line():
        k, _, v = line.decode("latin-1").partition(":")
        headers.append((k.strip().lower(), v.strip()))
    resp = RawResponse(status, reason, headers, b"", status_line)
    if head_only:
        return resp
    te, cl = resp.header("transfer-encoding"), resp.header("content-length")
    if status in (204, 304):
        return resp
    if te and "chunked" in te.lower():
        resp.body = _chunked_body(reader)
    elif cl is not None:
        resp.body = reader.exact(int(cl))
    else:
        while reader.fill():
            pass
        resp.body, reader.buf = reader.buf, b""
    return resp


class Uploading:
    """A socket face for `read_response` whose `recv` goes on sending `data` while it
    waits for the answer, in the one thread: an `SSLSocket` written by one thread while
    another reads it can send a record the edge takes for a broken connection (OpenSSL's
    objects are not for two threads at once), which looked like the edge dropping an
    early answer about once in eight runs. Sending stops when the edge takes no more."""

    def __init__(self, sock: ssl.SSLSocket, data: bytes) -> None:
        self.sock, self.rest = sock, memoryview(data)
        sock.setblocking(False)

    def recv(self, size: int) -> bytes:
        sock, deadline = self.sock, time.monotonic() + WAIT
        while time.monotonic() < deadline:
            if not sock.pending():
                readable, writable, _ = select.select(
                    [sock], [sock] if self.rest else [], [], 0.5)
                if not readable:
                    if writable:
                        try:
                            self.rest = self.rest[sock.send(self.rest[:65536]):]
                        except (ssl.SSLWantWriteError, ssl.SSLWantReadError):
                            pass
                        except OSError:  # the edge takes no more of it
                            self.rest = self.rest[:0]
                    continue
            try:
                return sock.recv(size)
            except ssl.SSLWantReadError:
                continue
        raise TimeoutError("no answer while uploading")


def _chunked_body(reader: _Reader) -> bytes:
    body = b""
    while True:
        size = int(reader.line().split(b";")[0], 16)
        if size == 0:
            while reader.line():  # trailers
                pass
            return body
        body += reader.exact(size)
        reader.line()


def read_chunked_body(sock: socket.socket) -> bytes:
    """The body of a chunked response whose head `read_response(head_only=True)` read."""
    return _chunked_body(_READERS[id(sock)])


def closed_by_peer(sock: socket.socket, timeout: float = 5.0) -> bool:
    """True when the peer closes (EOF / reset) within `timeout` and sends nothing else."""
    reader = _READERS.get(id(sock))
    if reader is not None and reader.buf:
        return False
    sock.settimeout(timeout)
    try:
        return sock.recv(65536) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def forget(sock: socket.socket) -> None:
    _READERS.pop(id(sock), None)
    with contextlib.suppress(OSError):
        sock.close()


def exchange(port: int, raw: bytes, *, host: str = HOST, source: str = LOOPBACK
             ) -> RawResponse:
    """One request on a fresh HTTP/1.1 TLS connection; returns the response."""
    sock = tls_socket(port, host, source=source)
    try:
        sock.sendall(raw)
        return read_response(sock)
    finally:
        forget(sock)


# --- a raw HTTP/2 client (h2 library, no validation of what we send) ----------------------


@dataclass
class H2Result:
    status: int | None
    headers: list[tuple[str, str]]
    body: bytes
    reset: int | None = None  # RST_STREAM error code
    goaway: bool = False

    @property
    def code(self) -> str | None:
        return refusal_code(self.body)


class H2Conn:
    """HTTP/2 over TLS with `h2`, outbound validation off: any `:path`, any header."""

    def __init__(self, port: int, host: str = HOST, *, source: str = LOOPBACK) -> None:
        self._start(tls_socket(port, host, source=source, alpn=("h2",)), host)

    def _start(self, sock: ssl.SSLSocket, host: str, *, validate: bool = False) -> None:
        """HTTP/2 on `sock` (ALPN h2 already chosen); `validate`: h2's own header checks."""
        self.sock = sock
        assert self.sock.selected_alpn_protocol() == "h2", self.sock.selected_alpn_protocol()
        cfg = h2.config.H2Configuration(client_side=True, header_encoding=None,
                                        validate_outbound_headers=validate,
                                        normalize_outbound_headers=validate,
                                        validate_inbound_headers=validate)
        self.conn = h2.connection.H2Connection(config=cfg)
        self.conn.initiate_connection()
        self.sock.sendall(self.conn.data_to_send())
        self.host = host
        self.goaway = False
        self._results: dict[int, H2Result] = {}
        self._done: set[int] = set()

    def request(self, method: str, path: str, *, body: bytes = b"",
                headers: Iterable[tuple[str, str]] = (), authority: str | None = None,
                content_type: str | None = "application/json", timeout: float = WAIT,
                coalesce: bool = True) -> H2Result:
        """Send HEADERS (+ DATA). `coalesce`: in one `sendall`, as nghttp and Node do (the
        case where DATA arrives with its HEADERS); otherwise HEADERS go out alone and DATA
        50 ms later, as curl does (other tests use that so a lost body cannot mask what they
        test)."""
        sid = self.conn.get_next_available_stream_id()
        hdrs = [(":method", method), (":scheme", "https"),
                (":authority", authority or self.host), (":path", path)]
        if content_type is not None and body:
            hdrs.append(("content-type", content_type))
        hdrs += list(headers)
        enc = [(k.encode(), v.encode()) for k, v in hdrs]
        # recorded before any byte leaves: an early answer (a refusal while the body is
        # still going up) arrives during the upload below and must not be lost
        self._results[sid] = H2Result(None, [], b"")
        self.conn.send_headers(sid, enc, end_stream=not body)
        if body and not coalesce:
            self.sock.sendall(self.conn.data_to_send())
            time.sleep(0.05)
        if body:
            self.send_body(sid, body, timeout=timeout)
        self.sock.sendall(self.conn.data_to_send())
        self._pump(until=lambda: sid in self._done, timeout=timeout)
        return self._results.pop(sid)

    def send_body(self, sid: int, body: bytes, *, timeout: float = WAIT) -> None:
        """`body` on stream `sid` within flow control, its last piece ending the stream;
        nothing more once the stream has ended (an early answer). What is left unsent in
        `conn` goes out with the caller's next `sendall`."""
        view = memoryview(body)
        while view and sid not in self._done:
            window = min(self.conn.local_flow_control_window(sid),
                         self.conn.max_outbound_frame_size)
            if window <= 0:
                self.sock.sendall(self.conn.data_to_send())
                self._pump(until=lambda: self.conn.local_flow_control_window(sid) > 0
                           or sid in self._done, timeout=timeout)
                continue
            piece, view = view[:window], view[window:]
            self.conn.send_data(sid, bytes(piece), end_stream=not view)

    def open_bare(self, method: str, path: str) -> int:
        """HEADERS with no `content-length`, the stream left open: the caller sends what
        follows (`conn.send_data`, then `sock.sendall(conn.data_to_send())`); `wait`
        reads its answer."""
        sid = self.conn.get_next_available_stream_id()
        self._results[sid] = H2Result(None, [], b"")
        self.conn.send_headers(sid, [
            (b":method", method.encode()), (b":scheme", b"https"),
            (b":authority", self.host.encode()), (b":path", path.encode())])
        return sid

    def open_stream(self, method: str, path: str, *, length: int, first: bytes = b"") -> int:
        """HEADERS announcing a `length`-byte body, then only `first` of it: the stream
        stays open for the caller to feed (`conn.send_data`) or leave hanging; `wait`
        reads its answer."""
        sid = self.conn.get_next_available_stream_id()
        self._results[sid] = H2Result(None, [], b"")
        self.conn.send_headers(sid, [
            (b":method", method.encode()), (b":scheme", b"https"),
            (b":authority", self.host.encode()), (b":path", path.encode()),
            (b"content-length", str(length).encode())])
        if first:
            self.conn.send_data(sid, first)
        self.sock.sendall(self.conn.data_to_send())
        return sid

    def burst(self, n: int, path: str = "/", timeout: float = WAIT) -> list[H2Result]:
        """`n` GET streams opened in one write, then all their answers, in order."""
        sids = []
        for _ in range(n):
            sid = self.conn.get_next_available_stream_id()
            self._results[sid] = H2Result(None, [], b"")
            self.conn.send_headers(sid, [
                (b":method", b"GET"), (b":scheme", b"https"),
                (b":authority", self.host.encode()), (b":path", path.encode())],
                end_stream=True)
            sids.append(sid)
        self.sock.sendall(self.conn.data_to_send())
        self._pump(until=lambda: all(s in self._done for s in sids), timeout=timeout)
        return [self._results.pop(s) for s in sids]

    def wait(self, sid: int, timeout: float = WAIT) -> H2Result:
        """The answer of stream `sid` (opened by `open_stream`), once it ended."""
        self._pump(until=lambda: sid in self._done, timeout=timeout)
        return self._results.pop(sid)

    def _pump(self, until: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                raise TimeoutError("h2 response timed out")
            self.sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                data = self.sock.recv(65536)
            except (ConnectionError, ssl.SSLError):
                data = b""
            if not data:
                self.goaway = True
                for sid in list(self._results):
                    self._results[sid].goaway = True
                    self._done.add(sid)
                return
            for ev in self.conn.receive_data(data):
                self._event(ev)
            out = self.conn.data_to_send()
            if out:
                with contextlib.suppress(OSError):
                    self.sock.sendall(out)

    def _event(self, ev: Any) -> None:
        sid = getattr(ev, "stream_id", None)
        res = self._results.get(sid) if sid is not None else None
        if isinstance(ev, h2.events.ResponseReceived) and res is not None:
            hdrs = [(k.decode(), v.decode("latin-1")) for k, v in ev.headers]
            res.headers = hdrs
            res.status = int(dict(hdrs)[":status"])
        elif isinstance(ev, h2.events.DataReceived):
            self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            if res is not None:
                res.body += ev.data
        elif isinstance(ev, h2.events.StreamEnded) and sid is not None:
            self._done.add(sid)
        elif isinstance(ev, h2.events.StreamReset) and sid is not None:
            if res is not None:
                res.reset = int(ev.error_code)
            self._done.add(sid)
        elif isinstance(ev, h2.events.ConnectionTerminated):
            self.goaway = True
            for s, r in self._results.items():
                if ev.last_stream_id is None or s > ev.last_stream_id:
                    r.goaway = True
                    self._done.add(s)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close_connection()
            self.sock.sendall(self.conn.data_to_send())
        with contextlib.suppress(OSError):
            self.sock.close()


def gzip_bytes(data: bytes) -> bytes:
    return gzip.compress(data)
