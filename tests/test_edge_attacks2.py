"""The passthrough edge attacked with odd but legal ClientHellos and refused ones,
through a real `serve` on loopback: a hello cut into many records (one cut inside the
server_name extension) and sent a byte per segment, a hello padded to near the 16 KiB
cap in two records, SNI spellings that name the same host, GREASE and an ECH outer
extension around the SNI; and hellos that must connect nothing (no SNI, an unknown one,
duplicate server_name extensions, an empty name list, a name over 255 bytes). Each
routed one reaches the backend byte for byte as sent; each refused one leaves the
backend untouched, and the process's open connections and fds return to where they
were. hello_fast's quick SNI is checked against the parser on the same hellos."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pact_ingress.net.router import PEEK_HEADROOM
from pact_ingress.proto.clienthello import ClientHelloError, parse_client_hello
from pact_ingress.proto.hello_fast import quick_sni
from tests.test_attacks4 import ext, hello, sni_ext
from tests.test_connector_cli_attacks import events
from tests.test_edge import (
    Backend,
    dial,
    edge_served,
    eventually,
    metric,
    passthrough_config,
)
from tests.test_serve import WAIT, Served, free_port, recv_exact

SNI = "odd.example.test"
PER_IP = 8
ALERT_112 = b"\x15\x03\x03\x00\x02\x02\x70"
ALPN = ext(16, b"\x00\x0c\x02h2\x08http/1.1")
VERSIONS = ext(43, b"\x04\x03\x04\x03\x03")


class Counting:
    """An echoing backend handler that counts the connections it was given."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.accepted = 0

    def __call__(self, conn: socket.socket) -> None:
        with self.lock:
            self.accepted += 1
        while data := conn.recv(1 << 16):
            conn.sendall(data)


COUNT = Counting()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, int, int]]:
    tmp = tmp_path_factory.mktemp("edge-attacks2")
    tls, admin = free_port(), free_port()
    backend = Backend(COUNT)
    try:
        with edge_served(tmp, tls, admin, PER_IP, {SNI: backend.port}) as s:
            yield s, tls, admin
    finally:
        backend.close()


def edge_fds(pid: int, admin: int) -> int:
    """The process's open fds, less its admin listener's accepted sockets (the metric
    scrapes of these tests: the admin server closes them on its own schedule)."""
    admin_inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            port = int(fields[1].rsplit(":", 1)[1], 16)
            if port == admin and fields[3] != "0A":  # not the listener itself
                admin_inodes.add(fields[9])
    count = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if not (link.startswith("socket:[") and link[8:-1] in admin_inodes):
            count += 1
    return count


def settled(admin: int) -> bool:
    return metric(admin, "pact_ingress_open_connections") == 0


def records(message: bytes, cuts: list[int]) -> bytes:
    """The handshake message (handshake header included) framed as several handshake
    records, cut at the given offsets of the message."""
    out = b""
    last = 0
    for at in [*cuts, len(message)]:
        part = message[last:at]
        out += b"\x16\x03\x01" + struct.pack(">H", len(part)) + part
        last = at
    return out


def message_of(wire: bytes) -> bytes:
    """The handshake message of a one-record hello."""
    return wire[5:5 + struct.unpack(">H", wire[3:5])[0]]


def odd_hellos() -> dict[str, bytes]:
    grease = ext(0x0A0A, b"")
    ech = ext(0xFE0D, b"\x00\x00\x01\x00\x01\x42\x00\x20" + bytes(32) + b"\x00\x40" + bytes(64))
    return {
        "plain": hello([sni_ext(SNI.encode()), ALPN, VERSIONS]),
        "upper": hello([sni_ext(SNI.upper().encode()), ALPN, VERSIONS]),
        "trailing_dot": hello([sni_ext(SNI.encode() + b"."), ALPN, VERSIONS]),
        "mixed_dot": hello([sni_ext(b"Odd.Example.TEST."), VERSIONS]),
        "grease_ech": hello([grease, sni_ext(SNI.encode()), ech, ext(0x1A1A, b"\x00"),
                             ALPN, VERSIONS]),
        "other_name_type": hello([sni_ext(b"x", SNI.encode(), types=(7, 0)), ALPN]),
    }


def refused_hellos() -> dict[str, tuple[bytes, bytes]]:
    """name → (hello, what the client gets back before the close)."""
    long_name = b".".join([b"a" * 63] * 4) + b".test"  # 257 bytes
    return {
        "no_sni": (hello([ALPN, VERSIONS]), ALERT_112),
        "unknown": (hello([sni_ext(b"unknown.example.test"), ALPN]), ALERT_112),
        "idn_unknown": (hello([sni_ext(b"xn--bcher-kva.example.test"), ALPN]), ALERT_112),
        "duplicate_sni": (hello([sni_ext(SNI.encode()), ALPN, sni_ext(SNI.encode())]), b""),
        "two_host_names": (hello([sni_ext(SNI.encode(), SNI.encode()), ALPN]), b""),
        "empty_list": (hello([ext(0, b"\x00\x00"), ALPN]), b""),
        "long_name": (hello([sni_ext(long_name), ALPN]), b""),
        "name_with_space": (hello([sni_ext(b"odd .example.test"), ALPN]), b""),
    }


@pytest.mark.parametrize("name", sorted(odd_hellos()))
def test_quick_sni_and_the_parser_agree_on_odd_hellos(name: str) -> None:
    """Twice each (the second time the quick path may answer from what it learned)."""
    wire = odd_hellos()[name]
    for _ in range(3):
        parsed = parse_client_hello(wire)
        assert parsed is not None and parsed.sni == SNI
        assert quick_sni(wire) in (None, SNI)


@pytest.mark.parametrize("name", sorted(refused_hellos()))
def test_quick_sni_declines_what_the_parser_does_not_route(name: str) -> None:
    wire, _ = refused_hellos()[name]
    for _ in range(3):
        try:
            parsed = parse_client_hello(wire)
        except ClientHelloError:
            parsed = None
        got = quick_sni(wire)
        if parsed is None:
            assert got is None
        else:
            assert got in (None, parsed.sni)


def routed_whole(tls: int, wire: bytes, *, bytewise: int = 0) -> None:
    """`wire` (then a tail) reaches the echo backend and comes back byte for byte;
    the first `bytewise` bytes go one byte per segment."""
    tail = b"after the hello"
    with dial(tls) as c:
        for i in range(bytewise):
            c.send(wire[i:i + 1])
        c.sendall(wire[bytewise:] + tail)
        assert recv_exact(c, len(wire) + len(tail)) == wire + tail


def test_odd_spellings_grease_and_ech_route_like_the_plain_hello(
        served: tuple[Served, int, int]) -> None:
    _s, tls, admin = served
    for name, wire in odd_hellos().items():
        before = COUNT.accepted
        routed_whole(tls, wire)
        assert COUNT.accepted == before + 1, name
    eventually(lambda: settled(admin), "open_connections back to 0")


def test_a_hello_cut_mid_extension_over_records_and_bytes_routes_as_whole(
        served: tuple[Served, int, int]) -> None:
    """Records cut inside the handshake header, inside the server_name extension (in
    its name) and elsewhere; the first 120 bytes one TCP segment each."""
    _s, tls, admin = served
    wire = hello([ext(0x0A0A, b""), sni_ext(SNI.encode()), ALPN, VERSIONS])
    message = message_of(wire)
    at = message.index(SNI.encode())
    for cuts in ([2], [at - 3, at + 4], [1, 2, 3, 40, at + 1, at + 2, len(message) - 1],
                 list(range(1, len(message)))[:200]):
        routed_whole(tls, records(message, cuts), bytewise=120)
    eventually(lambda: settled(admin), "open_connections back to 0")


def test_a_hello_near_the_cap_in_two_records_routes_as_whole(
        served: tuple[Served, int, int]) -> None:
    """Padded to 16380 message bytes (the cap is 16384), cut into two records inside
    the server_name extension, the first 60 bytes one segment each."""
    _s, tls, admin = served
    base = hello([sni_ext(SNI.encode()), ALPN, ext(21, b"")])
    pad = 16380 - len(message_of(base))
    wire = hello([sni_ext(SNI.encode()), ALPN, ext(21, bytes(pad))])
    message = message_of(wire)
    assert len(message) == 16380
    at = message.index(SNI.encode())
    routed_whole(tls, wire)
    routed_whole(tls, records(message, [at + 5]), bytewise=60)
    routed_whole(tls, records(message, [8000]))
    eventually(lambda: settled(admin), "open_connections back to 0")


def test_hellos_that_route_nowhere_connect_nothing_and_leak_nothing(
        served: tuple[Served, int, int]) -> None:
    """No SNI and an unknown one get unrecognized_name; malformed server_name
    extensions are closed unanswered; none reaches the backend, in one record or cut
    into records fed a byte at a time; fds and open connections return to baseline."""
    s, tls, admin = served
    pid = s.proc.pid
    eventually(lambda: settled(admin), "open_connections at 0")
    fds = edge_fds(pid, admin)
    before = COUNT.accepted
    for name, (wire, answer) in refused_hellos().items():
        message = message_of(wire)
        for sent, bytewise in ((wire, 0), (records(message, [3, len(message) // 2]), 40)):
            with dial(tls) as c:
                for i in range(bytewise):
                    c.send(sent[i:i + 1])
                c.sendall(sent[bytewise:])
                got = b""
                while chunk := c.recv(100):
                    got += chunk
                assert got == answer, name
    assert COUNT.accepted == before
    eventually(lambda: settled(admin), "open_connections back to 0")
    eventually(lambda: edge_fds(pid, admin) <= fds, f"fds back to {fds}")
    assert s.proc.poll() is None


def refused(c: socket.socket) -> bool:
    """The connection was closed unanswered (a FIN or, at accept, possibly a reset)."""
    try:
        return c.recv(100) == b""
    except ConnectionResetError:
        return True


def test_the_per_ip_cap_is_exact_after_stalls_resets_and_half_closes(
        served: tuple[Served, int, int]) -> None:
    """One address holds PER_IP routed connections and PEEK_HEADROOM more stalled
    mid-hello: one more routed is refused, one more dialled is closed at accept, while
    another address is served. The stalled ones then reset, half-close or just close, the
    routed ones close, and the address again gets exactly PER_IP routed connections; its
    counts and the process's fds return to their baseline."""
    s, tls, admin = served
    pid = s.proc.pid
    eventually(lambda: settled(admin), "open_connections at 0")
    fds = edge_fds(pid, admin)
    wire = odd_hellos()["plain"]
    source = "127.0.0.5"
    for round_ in range(2):
        stalled, held = [], []
        try:
            for _ in range(PER_IP):
                c = dial(tls, source)
                held.append(c)
                c.sendall(wire)
                assert recv_exact(c, len(wire)) == wire
            for _ in range(PEEK_HEADROOM - 1):
                c = dial(tls, source)
                c.sendall(wire[:20])
                stalled.append(c)
            with dial(tls, source) as over:  # the last pending place: shows a hello
                over.sendall(wire)
                assert refused(over), "a routed connection over the per-IP cap"
            eventually(lambda: metric(admin, "pact_ingress_open_connections")
                       == PER_IP + PEEK_HEADROOM - 1, "the stalled connections counted")
            c = dial(tls, source)
            c.sendall(wire[:20])
            stalled.append(c)  # now pending + routed = PER_IP + PEEK_HEADROOM
            with dial(tls, source) as over:
                try:
                    over.sendall(wire)
                except OSError:
                    pass
                assert refused(over), "a connection past the headroom"
            routed_whole(tls, wire)  # another address (127.0.0.1) meanwhile
        finally:
            for i, c in enumerate(stalled):
                if i % 3 == 0:
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif i % 3 == 1:
                    c.shutdown(socket.SHUT_WR)
                c.close()
            for c in held:
                c.close()
        eventually(lambda: settled(admin), f"open_connections back to 0 ({round_})")
    eventually(lambda: edge_fds(pid, admin) <= fds, f"fds back to {fds}")
    assert s.proc.poll() is None


#: The global cap of the second served config, and its (short) ClientHello deadline.
GLOBAL = 10


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Served, int, int]]:
    tmp = tmp_path_factory.mktemp("edge-attacks2-global")
    tls, admin = free_port(), free_port()
    backend = Backend(COUNT)
    text = passthrough_config(tls, admin, 100, {SNI: backend.port}).replace(
        "  clienthello_timeout: 5s\n", f"  clienthello_timeout: 1s\n  max_connections: {GLOBAL}\n")
    assert f"max_connections: {GLOBAL}" in text
    s = Served(tmp, text)
    try:
        s.wait_notify("READY=1")
        yield s, tls, admin
    finally:
        s.stop()
        backend.close()


def test_the_global_cap_is_exact_across_addresses_and_returns_after_stalls(
        capped: tuple[Served, int, int]) -> None:
    """GLOBAL connections from several addresses (routed ones and ones stalled
    mid-hello) fill the cap; one more from a fresh address is closed at accept and
    counted. The stalled ones are closed by the ClientHello deadline, the routed ones by
    their clients (reset, half-close, close); then the cap admits GLOBAL again, and the
    fds are back at their baseline."""
    s, tls, admin = capped
    pid = s.proc.pid
    eventually(lambda: settled(admin), "open_connections at 0")
    fds = edge_fds(pid, admin)
    wire = odd_hellos()["plain"]
    for round_ in range(2):
        before = metric(admin, "pact_ingress_rejections_total", reason="max_connections")
        timeouts = metric(admin, "pact_ingress_rejections_total", reason="clienthello_timeout")
        held = []
        try:
            for i in range(GLOBAL):
                c = dial(tls, f"127.0.1.{i + 1}")
                held.append(c)
                if i % 2:
                    c.sendall(wire[:30])  # stalls mid-hello
                else:
                    c.sendall(wire)
                    assert recv_exact(c, len(wire)) == wire
            eventually(lambda: metric(admin, "pact_ingress_open_connections") == GLOBAL,
                       "the cap full")
            with dial(tls, "127.0.2.1") as over:
                try:
                    over.sendall(wire)
                except OSError:
                    pass
                assert refused(over), "a connection over the global cap"
            assert metric(admin, "pact_ingress_rejections_total",
                          reason="max_connections") == before + 1
            # the stalled ones end at the ClientHello deadline, not by their clients
            eventually(lambda t=timeouts: metric(admin, "pact_ingress_rejections_total",
                                                 reason="clienthello_timeout") == t + GLOBAL // 2,
                       "the stalled connections timed out")
            eventually(lambda: metric(admin, "pact_ingress_open_connections") == GLOBAL // 2,
                       "only the routed ones left")
        finally:
            for i, c in enumerate(held):
                if i % 3 == 0:
                    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                elif i % 3 == 1:
                    try:
                        c.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                c.close()
        eventually(lambda: settled(admin), f"open_connections back to 0 ({round_})")
    eventually(lambda: edge_fds(pid, admin) <= fds, f"fds back to {fds}")
    assert s.proc.poll() is None


def test_a_hello_trickled_slower_than_its_deadline_is_closed(
        capped: tuple[Served, int, int]) -> None:
    """The ClientHello deadline (1 s here) bounds the whole hello, not each read: a
    client sending a byte every 0.2 s (each read well within the deadline) is closed
    long before its hello would be whole, counted as a timeout, and nothing is
    connected."""
    _s, tls, admin = capped
    wire = odd_hellos()["plain"]
    timeouts = metric(admin, "pact_ingress_rejections_total", reason="clienthello_timeout")
    before = COUNT.accepted
    closed_at = None
    with dial(tls, "127.0.3.1") as c:
        c.settimeout(0.2)
        for i in range(40):  # 8 s of trickle at most: a quarter of the hello
            try:
                c.send(wire[i:i + 1])
            except OSError:
                closed_at = i
                break
            try:
                if c.recv(100) == b"":
                    closed_at = i
                    break
            except TimeoutError:
                pass
            except OSError:
                closed_at = i
                break
    assert closed_at is not None, "a trickling client outlived its ClientHello deadline"
    eventually(lambda: metric(admin, "pact_ingress_rejections_total",
                              reason="clienthello_timeout") == timeouts + 1, "counted")
    assert COUNT.accepted == before


# --- the connector against an ingress that speaks garbage ------------------------------------


class GarbageIngress:
    """A TLS server holding the pinned ingress key that answers each control connection
    (and each data connection) with a different wrong thing, counting them."""

    def __init__(self, cert: Path, key: Path, coalesced: bool = False,
                 goaway_ms: int | None = None) -> None:
        from pact_ingress.proto.tunnel.constants import ALPN_CONTROL, ALPN_DATA

        self.coalesced = coalesced
        self.goaway_ms = goaway_ms  # set: every control link gets WELCOME, then GOAWAY

        self.ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self.ctx.load_cert_chain(cert, key)
        self.ctx.set_alpn_protocols([ALPN_CONTROL, ALPN_DATA])
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.lock = threading.Lock()
        self.controls = 0
        self.data = 0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        from pact_ingress.proto.tunnel import frames as tf
        from pact_ingress.proto.tunnel.constants import ALPN_CONTROL

        sock.settimeout(None if self.coalesced else 5)
        try:
            first = sock.recv(len(tf.RAW_DATA_MAGIC), socket.MSG_PEEK)
            if first.startswith(b"PACT"):  # a raw data connection: a wrong answer
                with self.lock:
                    self.data += 1
                sock.recv(100)
                sock.sendall(b"NO!" + os.urandom(20))
                return
            tls = self.ctx.wrap_socket(sock, server_side=True)
            tls.recv(100)  # HELLO (or DATA_HELLO)
            if tls.selected_alpn_protocol() != ALPN_CONTROL:
                with self.lock:
                    self.data += 1
                return
            if self.coalesced:  # WELCOME and a TOKEN in one write (one TLS record)
                tls.sendall(tf.encode(tf.Welcome(os.urandom(tf.ID_BYTES), 30_000))
                            + tf.encode(tf.Token(os.urandom(tf.TOKEN_BYTES))))
                with self.lock:
                    self.controls += 1
                time.sleep(4 * WAIT)  # then silence: no frame behind them
                return
            with self.lock:
                k = self.controls
                self.controls += 1
            welcome = tf.encode(tf.Welcome(os.urandom(tf.ID_BYTES), 1000))
            if self.goaway_ms is not None:
                tls.sendall(welcome + tf.encode(tf.Goaway(
                    tf.GoawayCode.SHUTDOWN, self.goaway_ms, "come back much later")))
                time.sleep(0.3)
                return
            token = tf.encode(tf.Token(os.urandom(tf.TOKEN_BYTES)))
            answers = [
                b"\xee\x00\x00",  # an unknown frame type
                welcome + b"\x05\xff\xff",  # a frame over the length cap
                welcome + b"\x05\x00\x03abc",  # a TOKEN of the wrong size
                os.urandom(200),
                welcome + b"\x06\x00\x05\xff\x00\x00\x00\x00",  # GOAWAY, unknown code
                welcome + tf.encode(tf.Welcome(os.urandom(tf.ID_BYTES), 0)),  # twice
                welcome + token * 3 + b"\x0a\x00\x01x",  # data dials, then a bad WAKE
            ]
            tls.sendall(answers[k % len(answers)])
            time.sleep(0.3)
        except (OSError, ssl.SSLError):
            pass
        finally:
            sock.close()

    def close(self) -> None:
        self.server.close()


@contextlib.contextmanager
def _connector_against(tmp_path: Path, fake: GarbageIngress, node_key: Path, pin: str,
                       connections: int) -> Iterator[tuple[subprocess.Popen[bytes], Path]]:
    """A real `pact-ingress connect` dialling `fake` (pinned as `pin`), its log file; on
    the way out it is stopped (killed if it outlived the test) and `fake` closed."""
    config = tmp_path / "connector.yaml"
    config.write_text(f"""\
identity: {{key: {node_key}}}
ingress:
  address: "127.0.0.1:{fake.port}"
  tunnel_hostname: tunnel.home.test
  pin: "{pin}"
forward: "127.0.0.1:{free_port()}"
connections: {connections}
""")
    log_path = tmp_path / "connect.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pact_ingress", "connect", "-c", str(config)],
            stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc, log_path
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            fake.close()


def test_the_connector_survives_an_ingress_speaking_garbage(tmp_path: Path) -> None:
    """A real `connect` whose pinned ingress answers with unknown frame types, a frame
    over the cap, wrong payload sizes, random bytes, a GOAWAY of no known code, a second
    WELCOME, and data connections refused with garbage: each failure ends that link
    only; the connector keeps dialling, never crashes, and ends with 0 on SIGTERM."""
    from pact_ingress.identity import keygen

    ingress = keygen(tmp_path / "ingress.key", common_name="ingress")
    node = keygen(tmp_path / "node.key", common_name="node")
    fake = GarbageIngress(ingress.cert_path, ingress.key_path)
    with _connector_against(tmp_path, fake, node.key_path, ingress.fingerprint,
                            4) as (proc, log_path):
        eventually(lambda: fake.controls >= 10 or proc.poll() is not None,
                   "ten control connections")
        assert proc.poll() is None, log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log_path.read_text()
    text = log_path.read_text()
    assert "Traceback" not in text, text
    assert "tunnel_control_failed" in text


def test_a_token_in_the_welcomes_record_is_acted_on_at_once(tmp_path: Path) -> None:
    """The control connection is a byte stream: frames the ingress wrote together with
    its WELCOME (one write, so one TLS record, read in one piece) are the connector's to
    act on as they arrive, not once some later frame happens to come. Here a TOKEN rides
    with the WELCOME and nothing follows: the connector must still dial its data
    connection."""
    from pact_ingress.identity import keygen

    ingress = keygen(tmp_path / "ingress.key", common_name="ingress")
    node = keygen(tmp_path / "node.key", common_name="node")
    fake = GarbageIngress(ingress.cert_path, ingress.key_path, coalesced=True)
    with _connector_against(tmp_path, fake, node.key_path, ingress.fingerprint,
                            1) as (proc, log_path):
        eventually(lambda: fake.data >= 1 or proc.poll() is not None,
                   "a data connection dialled with the TOKEN")
        assert proc.poll() is None, log_path.read_text()
        assert fake.controls == 1  # the same link: nothing ended it meanwhile
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0, log_path.read_text()
    assert "Traceback" not in log_path.read_text()


def test_a_goaways_retry_after_is_capped(tmp_path: Path) -> None:
    """GOAWAY(SHUTDOWN)'s retry_after is a 32-bit count of milliseconds: obeyed as sent,
    the largest value parks every slot for about 49 days, so one wrong frame from the
    pinned ingress takes the home node off the net until someone restarts it. The wait
    the connector computes (and logs) must stay within its cap."""
    from pact_ingress.identity import keygen
    from pact_ingress.net.tunnel.connector import GOAWAY_RETRY_CAP

    ingress = keygen(tmp_path / "ingress.key", common_name="ingress")
    node = keygen(tmp_path / "node.key", common_name="node")
    fake = GarbageIngress(ingress.cert_path, ingress.key_path, goaway_ms=0xFFFF_FFFF)
    with _connector_against(tmp_path, fake, node.key_path, ingress.fingerprint,
                            1) as (proc, log_path):
        eventually(lambda: "tunnel_reconnect" in log_path.read_text()
                   or proc.poll() is not None, "a reconnect after the GOAWAY")
        assert proc.poll() is None, log_path.read_text()
        proc.send_signal(signal.SIGTERM)  # the slot is asleep: the stop must not wait
        assert proc.wait(timeout=20) == 0, log_path.read_text()
    text = log_path.read_text()
    goaways = [d for d in events(text, "tunnel_goaway") if d["code"] == "SHUTDOWN"]
    assert goaways and goaways[0]["retry_after_ms"] == 0xFFFF_FFFF, text
    delays = [float(d["delay_s"]) for d in events(text, "tunnel_reconnect")]
    assert delays and all(0 < d <= GOAWAY_RETRY_CAP for d in delays), delays
    assert "Traceback" not in text


def test_a_ping_in_the_hellos_record_is_answered_at_once(tmp_path: Path) -> None:
    """The ingress's side of the same stream rule: a PING the connector wrote together
    with its HELLO gets its PONG without any further frame."""
    from pact_ingress.proto.tunnel import frames as tf
    from pact_ingress.proto.tunnel.constants import ALPN_CONTROL
    from tests.test_connector_cli_attacks import TUNNEL, Edge

    e = Edge(tmp_path)
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        ctx.load_cert_chain(e.node.cert_path, e.node.key_path)
        ctx.set_alpn_protocols([ALPN_CONTROL])
        with socket.create_connection(("127.0.0.1", e.port), timeout=WAIT) as raw, \
                ctx.wrap_socket(raw, server_hostname=TUNNEL) as tls:
            tls.sendall(tf.encode(tf.Hello(tf.VERSION, 3, os.urandom(16)))
                        + tf.encode(tf.Ping(0x5EED)))
            decoder = tf.Decoder()
            seen = []
            tls.settimeout(1.0)
            deadline = time.monotonic() + 5  # the ingress's heartbeat is longer
            while tf.Pong(0x5EED) not in seen and time.monotonic() < deadline:
                try:
                    data = tls.recv(4096)
                except TimeoutError:
                    continue
                if not data:
                    break
                decoder.feed(data)
                while (msg := decoder.next_message()) is not None:
                    seen.append(msg)
            assert isinstance(seen[0], tf.Welcome), seen
            assert tf.Pong(0x5EED) in seen, seen
    finally:
        e.close()
