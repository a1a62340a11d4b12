"""PROXY protocol v2: golden bytes, round trips, every-offset decoding, fuzzing, and a real
consumer (HAProxy) reporting the caller address we encoded."""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress.errors import RemoteProtocolError
from pact_ingress.proto.proxy_protocol import (
    MAX_V2_PAYLOAD,
    SIGNATURE,
    ProxyHeader,
    ProxyProtocolError,
    decode_v2,
    encode_v2,
    encode_v2_local,
)
from tests.netutil import free_port
from tests.tools import require

# Worked by hand from the spec (proxy-protocol.txt §2.2).
GOLDEN_V4 = bytes.fromhex(
    "0d0a0d0a000d0a515549540a"  # signature
    "21"  # version 2, PROXY
    "11"  # AF_INET, STREAM
    "000c"  # 12 bytes follow
    "c0000201"  # 192.0.2.1
    "c6336402"  # 198.51.100.2
    "c822"  # 51234
    "01bb"  # 443
)
GOLDEN_V6 = bytes.fromhex(
    "0d0a0d0a000d0a515549540a2121"
    "0024"  # 36 bytes follow
    "20010db8000000000000000000000001"  # 2001:db8::1
    "20010db8000000000000000000000002"  # 2001:db8::2
    "0050"  # 80
    "01bb"  # 443
)


def test_golden_ipv4() -> None:
    assert encode_v2(("192.0.2.1", 51234), ("198.51.100.2", 443)) == GOLDEN_V4


def test_golden_ipv6() -> None:
    assert encode_v2(("2001:db8::1", 80), ("[2001:db8::2]", 443)) == GOLDEN_V6


def test_golden_local() -> None:
    assert encode_v2_local() == SIGNATURE + b"\x20\x00\x00\x00"
    header = decode_v2(encode_v2_local())
    assert header == ProxyHeader("local", "unspec", "unspec", None, None, (), 16)


def test_v4_mapped_addresses_are_sent_as_ipv4() -> None:
    mapped = encode_v2(("::ffff:192.0.2.1", 51234), ("::ffff:198.51.100.2", 443))
    assert mapped == GOLDEN_V4


def test_mixed_families_map_ipv4_into_ipv6() -> None:
    header = decode_v2(encode_v2(("192.0.2.1", 1000), ("2001:db8::2", 443)))
    assert header is not None and header.family == "inet6"
    assert header.src == ("::ffff:c000:201", 1000)
    assert header.dst == ("2001:db8::2", 443)


@pytest.mark.parametrize(
    ("src", "dst"),
    [(("not-an-ip", 1), ("127.0.0.1", 2)), (("127.0.0.1", -1), ("127.0.0.1", 2)),
     (("127.0.0.1", 1), ("127.0.0.1", 65536)), (("localhost", 1), ("127.0.0.1", 2))],
)  # fmt: skip
def test_encode_rejects_non_literals_and_bad_ports(src: tuple[str, int],
                                                   dst: tuple[str, int]) -> None:  # fmt: skip
    with pytest.raises(ValueError):
        encode_v2(src, dst)


def test_decode_golden_and_payload_offset() -> None:
    data = GOLDEN_V4 + b"\x16\x03\x01"
    header = decode_v2(data)
    assert header == ProxyHeader("proxy", "inet", "tcp", ("192.0.2.1", 51234),
                                 ("198.51.100.2", 443), (), 28)  # fmt: skip
    assert data[header.length :] == b"\x16\x03\x01"


@pytest.mark.parametrize("golden", [GOLDEN_V4, GOLDEN_V6])
def test_every_prefix_needs_more(golden: bytes) -> None:
    for cut in range(len(golden)):
        assert decode_v2(golden[:cut]) is None, cut
    assert decode_v2(golden) is not None


def test_tlvs_are_returned() -> None:
    tlvs = b"\x01\x00\x02h2" + b"\x02\x00\x09a.example"  # ALPN, AUTHORITY
    body = GOLDEN_V4[16:] + tlvs
    header = decode_v2(GOLDEN_V4[:14] + len(body).to_bytes(2, "big") + body)
    assert header is not None and header.tlvs == ((1, b"h2"), (2, b"a.example"))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"\x16\x03\x01", "not_proxy"),
        (b"PROXY TCP4 1.2.3.4 5.6.7.8 1 2\r\n", "not_proxy"),  # v1 is not accepted
        (b"\r\n\r\n\x00\r\nQUIX", "not_proxy"),
        (SIGNATURE + b"\x11\x11\x00\x00", "malformed"),  # version 1 in the binary form
        (SIGNATURE + b"\x22\x11\x00\x00", "malformed"),  # unknown command
        (SIGNATURE + b"\x21\x41\x00\x00", "malformed"),  # unknown family
        (SIGNATURE + b"\x21\x13\x00\x00", "malformed"),  # unknown transport
        (SIGNATURE + b"\x21\x11\x00\x08" + bytes(8), "malformed"),  # short inet block
        (SIGNATURE + b"\x21\x11\x00\x0e" + bytes(14), "malformed"),  # truncated TLV
        (SIGNATURE + b"\x21\x11\x00\x0f" + bytes(12) + b"\x01\x00\x05", "malformed"),
        (SIGNATURE + b"\x21\x11" + (MAX_V2_PAYLOAD + 1).to_bytes(2, "big"), "too_large"),
    ],
)
def test_decode_errors(data: bytes, reason: str) -> None:
    with pytest.raises(ProxyProtocolError) as info:
        decode_v2(data)
    assert info.value.reason == reason
    assert isinstance(info.value, RemoteProtocolError)


ipv4 = st.ip_addresses(v=4).map(str)


def _not_mapped(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    return isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is None


ipv6 = st.ip_addresses(v=6).filter(_not_mapped).map(str)
ports = st.integers(0, 65535)


@given(st.one_of(st.tuples(ipv4, ipv4), st.tuples(ipv6, ipv6)), ports, ports)
@settings(max_examples=200, deadline=None)
def test_round_trip(hosts: tuple[str, str], sport: int, dport: int) -> None:
    header = decode_v2(encode_v2((hosts[0], sport), (hosts[1], dport)) + b"rest")
    assert header is not None
    assert (header.src, header.dst) == ((hosts[0], sport), (hosts[1], dport))
    assert header.command == "proxy" and header.transport == "tcp"


@given(st.binary(max_size=300))
@settings(max_examples=300, deadline=None)
def test_garbage_only_raises_proxy_protocol_error(tail: bytes) -> None:
    for data in (tail, SIGNATURE + tail):
        try:
            decode_v2(data)
        except ProxyProtocolError:
            pass


# --- HAProxy as the real consumer -------------------------------------------------------

HAPROXY_CFG = """
global
    maxconn 100
defaults
    mode http
    timeout connect 5s
    timeout client 10s
    timeout server 10s
frontend fe
    bind 127.0.0.1:{port} accept-proxy
    http-request return status 200 content-type text/plain lf-string "%[src] %[src_port] %[dst] %[dst_port]"
"""


@pytest.fixture(scope="module")
def haproxy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    haproxy = require("haproxy")
    port = free_port()
    cfg = tmp_path_factory.mktemp("haproxy") / "haproxy.cfg"
    cfg.write_text(HAPROXY_CFG.format(port=port))
    proc = subprocess.Popen([haproxy, "-f", str(cfg), "-db"], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        _wait_listening(port, proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _wait_listening(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(100):  # up to ~10 s
        if proc.poll() is not None:
            output = proc.stdout.read().decode() if proc.stdout else ""
            raise RuntimeError(f"haproxy exited: {output}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("haproxy did not start listening")


def _ask(port: int, header: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(header + b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        response = b""
        while len(response) < 65536:  # bounded; haproxy closes after the response
            chunk = sock.recv(4096)
            if not chunk:
                break
            response += chunk
    assert response.startswith(b"HTTP/1.1 200"), response
    return response.split(b"\r\n\r\n", 1)[1]


@pytest.mark.parametrize(
    ("src", "dst", "expected"),
    [
        (("203.0.113.7", 40001), ("198.51.100.2", 443), b"203.0.113.7 40001 198.51.100.2 443"),
        (("2001:db8::7", 40002), ("2001:db8::2", 443), b"2001:db8::7 40002 2001:db8::2 443"),
        (("::ffff:203.0.113.9", 40003), ("::ffff:198.51.100.2", 443),
         b"203.0.113.9 40003 198.51.100.2 443"),
        (("203.0.113.8", 40004), ("2001:db8::2", 443),
         b"::ffff:203.0.113.8 40004 2001:db8::2 443"),
    ],
)  # fmt: skip
def test_haproxy_reports_the_encoded_source(
    haproxy: int, src: tuple[str, int], dst: tuple[str, int], expected: bytes
) -> None:
    assert _ask(haproxy, encode_v2(src, dst)) == expected


def test_haproxy_local_command_uses_the_real_connection(haproxy: int) -> None:
    body = _ask(haproxy, encode_v2_local())
    assert body.startswith(b"127.0.0.1 ")
    assert body.endswith(f" 127.0.0.1 {haproxy}".encode())
