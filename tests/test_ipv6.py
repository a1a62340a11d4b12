"""IPv6 through real `serve` processes: listeners on [::1] (and [::] beside 127.0.0.1 on
one port), clients from ::1, backends and home nodes on ::1.

What must hold whatever the families:

* a client is named by its own address everywhere: the PROXY v2 header (in the client's
  family, IPv4 as AF_INET, never as a mapped IPv6), `Forwarded` (IPv6 quoted and
  bracketed), the access and refusal log lines, /status;
* ::1 and 127.0.0.1 are two clients, each with its own connection cap; ::1 has one call
  budget, however its requests arrive (HTTP/1.1, HTTP/2, new connections);
* nothing is refused that should be served: a slot given back is a slot again, a v6
  backend is reached from a v4 client and the reverse, a tunnel and the relay work with
  every hop on ::1, the admin endpoint on [::1] answers `Host: [::1]:port`;
* a listen address is written the way the config takes it back (`[::1]:port`).
"""

from __future__ import annotations

import socket
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pact_ingress.identity import keygen
from pact_ingress.proto.proxy_protocol import decode_v2
from pact_ingress.proto.ratelimit import burst_for
from tests import cluster_env
from tests.netutil import free_port, free_port_on
from tests.relay_env import RelayCaller, RelayServe, code_of, envelope, relay_identities
from tests.terminate_env import (
    HOST,
    WAIT,
    H2Conn,
    RecordingNode,
    Serve,
    ServeEnv,
    closed_by_peer,
    exchange,
    forget,
    make_identities,
    read_response,
    request_bytes,
    rpc,
    tls_socket,
)
from tests.test_edge import Backend, eventually
from tests.test_serve import HELLO, Served

if not socket.has_ipv6:  # a requirement of this file, not a reason to pass
    raise RuntimeError("these tests need IPv6 on loopback (::1)")

V4_SNI, V6_SNI = "www.example.test", "six.example.test"  # same length: HELLO's is swapped
PER_IP = 3


class ProxiedBackend(Backend):
    """A raw TCP backend on `host` behind a `proxy_protocol: v2` route: per connection it
    reads the header and the hello, records them, answers `ok` and holds the connection
    until the client closes it."""

    def __init__(self, host: str) -> None:
        self.seen: list[bytes] = []
        super().__init__(self._take, host)

    def _take(self, conn: socket.socket) -> None:
        conn.settimeout(WAIT)
        buf = b""
        try:
            while True:
                header = decode_v2(buf) if buf else None
                if header is not None and len(buf) >= header.length + len(HELLO):
                    break
                chunk = conn.recv(65536)
                if not chunk:
                    return
                buf += chunk
            self.seen.append(buf)
            conn.sendall(b"ok")
            while conn.recv(65536):
                pass
        except ValueError:
            pass


def dial(address: tuple[str, int], sni: str) -> socket.socket:
    s = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET)
    s.settimeout(WAIT)
    s.connect(address)
    s.sendall(HELLO.replace(V4_SNI.encode(), sni.encode()))
    return s


@pytest.fixture(scope="module")
def passthrough(tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[Served, int, int, int, dict[str, ProxiedBackend]]]:
    tmp = tmp_path_factory.mktemp("v6pt")
    backends = {V4_SNI: ProxiedBackend("127.0.0.1"), V6_SNI: ProxiedBackend("::1")}
    both, six, http = free_port_on("127.0.0.1", "::1"), free_port("::1"), free_port("::1")
    text = f"""\
state_dir: state
listen:
  tls: ["127.0.0.1:{both}", "[::]:{both}", "[::1]:{six}"]
  http: ["[::1]:{http}"]
limits:
  max_connections_per_ip: {PER_IP}
tenants:
  - name: edge
    pins: ["sha256:{'A' * 43}"]
    routes:
      - {{host: {V4_SNI}, mode: passthrough, backend: "127.0.0.1:{backends[V4_SNI].port}",
          proxy_protocol: v2}}
      - {{host: {V6_SNI}, mode: passthrough, backend: "[::1]:{backends[V6_SNI].port}",
          proxy_protocol: v2}}
"""
    s = Served(tmp, text)
    try:
        s.wait_notify("READY=1")
        yield s, both, six, http, backends
    finally:
        s.stop()
        for b in backends.values():
            b.close()


def test_passthrough_proxy_v2_names_each_client_in_its_own_family(
        passthrough: tuple[Served, int, int, int, dict[str, ProxiedBackend]]) -> None:
    s, both, six, _, backends = passthrough
    listeners = [("127.0.0.1", both), ("::1", both), ("::1", six)]
    for sni, backend in backends.items():
        for address in listeners:
            before = len(backend.seen)
            with dial(address, sni) as c:
                assert c.recv(2) == b"ok", (sni, address)
                client = c.getsockname()[:2]
            got = backend.seen[before]
            header = decode_v2(got)
            assert header is not None and header.command == "proxy", got[:32]
            family = "inet6" if ":" in address[0] else "inet"
            assert (header.family, header.transport) == (family, "tcp"), (sni, address)
            assert header.src == client and header.dst == address, (header, client)
            assert got[header.length:] == HELLO.replace(V4_SNI.encode(), sni.encode())
    eventually(lambda: len([e for e in s.log_events() if e.get("event") == "conn_close"])
               >= 6, "a conn_close line per connection")
    named = {e["client_ip"] for e in s.log_events() if e.get("event") == "conn_close"}
    assert named == {"127.0.0.1", "::1"}, named


def test_v6_and_v4_clients_have_a_connection_cap_each(
        passthrough: tuple[Served, int, int, int, dict[str, ProxiedBackend]]) -> None:
    """::1 at its cap (over both its listeners) is refused; 127.0.0.1, on the same port,
    is not; a slot ::1 gives back is served again."""
    s, both, six, _, _ = passthrough
    held = []
    try:
        for i in range(PER_IP):
            held.append(dial(("::1", both if i % 2 else six), V6_SNI))
            assert held[-1].recv(2) == b"ok"
        over = dial(("::1", both), V4_SNI)
        assert closed_by_peer(over), "a fourth connection from ::1 was let through"
        over.close()
        with dial(("127.0.0.1", both), V6_SNI) as other:
            assert other.recv(2) == b"ok", "127.0.0.1 was refused for ::1's connections"
        rejected = [e for e in s.log_events() if e.get("event") == "conn_rejected"]
        assert [e["client_ip"] for e in rejected] == ["::1"], rejected
        held.pop().close()

        def served_again() -> bool:
            with dial(("::1", six), V4_SNI) as again:
                try:
                    return again.recv(2) == b"ok"
                except OSError:
                    return False
        eventually(served_again, "::1 served again once it gave a slot back")
    finally:
        for c in held:
            c.close()


def test_listen_addresses_are_logged_as_the_config_writes_them(
        passthrough: tuple[Served, int, int, int, dict[str, ProxiedBackend]]) -> None:
    """`::1:8080` is what the config refuses as ambiguous: the log must not say it."""
    s, both, six, http, _ = passthrough
    events = s.log_events()
    serving = [e for e in events if e.get("event") == "serving"]
    assert serving and serving[0]["tls"] == [f"127.0.0.1:{both}", f"[::]:{both}",
                                             f"[::1]:{six}"], serving
    listening = [e["address"] for e in events if e.get("event") == "http_listening"]
    assert listening == [f"[::1]:{http}"], listening


# --- terminate ---------------------------------------------------------------------------


def _admin_status(port: int, host_header: str) -> int:
    with socket.create_connection(("::1", port), timeout=WAIT) as s:
        s.sendall(f"GET /status HTTP/1.1\r\nHost: {host_header}\r\nConnection: close\r\n\r\n"
                  .encode())
        return read_response(s, head_only=True).status


def test_terminate_on_v6_names_the_client_and_charges_one_budget(tmp_path: Path) -> None:
    rate = 12
    ids = make_identities(tmp_path)
    node = RecordingNode(ids.node, client_ca=ids.ingress, host="::1")
    env = None
    try:
        env = ServeEnv(Serve(tmp_path, node, ids.node.fingerprint, listen_host="::1",
                             backend_host="::1", seal="optional",
                             limits={"calls_per_hour_per_ip": rate,
                                     "max_connections_per_ip": PER_IP}),
                       node, ids, tmp_path)
        serve = env.serve
        # the connection cap first (idle connections hold slots), while budget is whole
        held = [tls_socket(serve.port, source="::1") for _ in range(PER_IP)]
        with pytest.raises((ssl.SSLError, OSError)):  # (the cap is applied at the hello)
            forget(tls_socket(serve.port, source="::1"))
        for c in held:
            forget(c)
        assert serve.wait_open_connections(0) == 0
        # one budget for ::1 whatever carries the calls: HTTP/1.1 and HTTP/2 alternating
        h2 = H2Conn(serve.port, source="::1")
        served, refused = 0, 0
        try:
            for i in range(burst_for(rate) + 3):
                if i % 2:
                    r = h2.request("POST", "/mcp", body=rpc("tools/list", rpc_id=i))
                    status, code = r.status, r.code
                else:
                    resp = exchange(serve.port, request_bytes(
                        "POST", "/mcp", HOST, body=rpc("tools/list", rpc_id=i)), source="::1")
                    status, code = resp.status, resp.code
                assert status == 200, (i, status)
                if code == "rate_limited":
                    refused += 1
                else:
                    assert code is None, code
                    assert refused == 0, "served after a refusal: a second budget"
                    served += 1
        finally:
            h2.close()
        assert (served, refused) == (burst_for(rate), 3)
        forwarded = [r.header_values("forwarded") for r in node.requests()]
        assert forwarded == [['for="[::1]";proto=https;host=' + HOST]] * served, forwarded
        status = serve.status()
        assert {r["client_ip"] for r in status["recent_refusals"]} == {"::1"}, status
        events = serve.log_events()
        named = {e.get("client_ip", e.get("client")) for e in events
                 if e.get("event") in ("request", "refused", "conn_rejected")}
        assert named == {"::1"}, named
        # the admin endpoint on [::1]: a loopback Host is served, another name is not
        port = serve.admin_port
        for ok in (f"[::1]:{port}", "[::1]", f"localhost:{port}", f"127.0.0.1:{port}"):
            assert _admin_status(port, ok) == 200, ok
        for bad in (f"evil.example:{port}", "[::2]", f"localhost.evil.example:{port}"):
            assert _admin_status(port, bad) == 421, bad
        cli = subprocess.run([sys.executable, "-m", "pact_ingress", "status", "-c",
                              str(serve.config)], capture_output=True, text=True,
                             timeout=60, check=False)
        assert cli.returncode == 0 and HOST in cli.stdout, (cli.stdout, cli.stderr)
    finally:
        if env is not None:
            env.stop()
        else:
            node.stop()


# --- tunnel and relay --------------------------------------------------------------------


def test_tunnel_with_every_hop_on_v6(tmp_path: Path) -> None:
    node_key = keygen(tmp_path / "node.key", common_name="node")
    node = RecordingNode(node_key, host="::1")
    port = free_port("::1")
    instance = connect = None
    try:
        instance = cluster_env.Instance(tmp_path, "::1", port, node_key.fingerprint).start()
        connect = cluster_env.Connect(tmp_path, node_key, node.port, [f"[::1]:{port}"],
                                      [instance.identity.fingerprint], forward_host="::1")
        eventually(lambda: instance.tunnels_up() > 0, "the tunnel up over ::1")
        assert cluster_env.request(instance, cluster_env.PT_HOST) == 200
        assert cluster_env.request(instance, cluster_env.TM_HOST) == 200
        terminated = [r for r in node.requests() if r.header_values("forwarded")]
        assert [r.header_values("forwarded") for r in terminated] == [
            [f'for="[::1]";proto=https;host={cluster_env.TM_HOST}']]
        ups = [line for line in instance.logs().splitlines() if '"tunnel_up"' in line]
        assert ups and all('"client_ip":"::1"' in line for line in ups), ups
    finally:
        cluster_env.close_all(connect, [instance] if instance else [])
        node.stop()


def test_relay_over_v6(tmp_path: Path) -> None:
    ids = relay_identities(tmp_path)
    serve = RelayServe(tmp_path, recipients=[ids.recipient], address="::1", workers=1)
    try:
        recipient = RelayCaller(serve.port, ids.recipient, host="::1")
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
        sender = RelayCaller(serve.port, ids.sender, host="::1")
        sent = envelope(ids.sender, ids.recipient, msg_id="v6")
        result, _ = sender.tool("relay_call", sent)
        assert code_of(result) is None, result
        items = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
        assert [i["envelope"] for i in items] == [sent]
        calls = [e for e in serve.log_events() if e.get("event", "").startswith("relay_")
                 and "client_ip" in e]
        assert calls and {e["client_ip"] for e in calls} == {"::1"}, calls
    finally:
        serve.stop()
