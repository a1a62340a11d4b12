"""PROXY protocol version 2: tell a passthrough backend who the caller really is.

In passthrough mode the backend's TCP peer is the ingress (or the tunnel connector), so
the caller's address is lost unless we prepend HAProxy's PROXY protocol v2 header
(https://www.haproxy.org/download/2.6/doc/proxy-protocol.txt, §2.2) before the first
ClientHello byte. The header is binary and fixed-layout:

    12-byte signature | ver/cmd (0x21 = v2 PROXY, 0x20 = v2 LOCAL)
    | family/transport (0x11 TCP over IPv4, 0x21 TCP over IPv6, 0x00 unspecified)
    | length (2, big-endian) | addresses (12 or 36 bytes) | TLVs

Families: when both addresses are IPv4 (including IPv4-mapped IPv6, which is what a
dual-stack `[::]` listener reports for IPv4 callers) we send AF_INET, so backends log
`203.0.113.7`, not `::ffff:203.0.113.7`. When one side is IPv6 and the other IPv4, the
IPv4 one is mapped into IPv6 (`::ffff:a.b.c.d`) and we send AF_INET6: LOCAL would discard
the caller's address, which is the whole point of the header.

`decode_v2` is the sans-I/O reader (used by tests and by the tunnel), shaped like the
ClientHello parser: bytes so far in, header or None out, `ProxyProtocolError` on bytes
that can never become a valid header. The signature is checked as bytes arrive, so a
connection that does not start with it fails at its first differing byte.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

from pact_ingress.errors import RemoteProtocolError

SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
_FIXED = 16  # signature + ver/cmd + family + length

# Largest address+TLV block we accept when decoding. Addresses take at most 216 bytes
# (AF_UNIX); the TLVs senders attach (ALPN, authority, unique id, SSL summary, cloud
# endpoint ids) are tens to hundreds of bytes. 2 KiB bounds what a peer can make us buffer.
MAX_V2_PAYLOAD = 2048

_CMD_LOCAL = 0x20
_CMD_PROXY = 0x21
_FAMILIES = {0x0: "unspec", 0x1: "inet", 0x2: "inet6", 0x3: "unix"}
_TRANSPORTS = {0x0: "unspec", 0x1: "tcp", 0x2: "udp"}
_ADDRESS_BYTES = {"unspec": 0, "inet": 12, "inet6": 36, "unix": 216}
_INET_TCP = 0x11
_INET6_TCP = 0x21

Endpoint = tuple[str, int]


class ProxyProtocolError(RemoteProtocolError):
    """Bytes that are not a valid PROXY v2 header; `reason` is a short machine string."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True)
class ProxyHeader:
    """A decoded header. `src`/`dst` are None for LOCAL, unspec and unix headers."""

    command: Literal["proxy", "local"]
    family: str  # "unspec" | "inet" | "inet6" | "unix"
    transport: str  # "unspec" | "tcp" | "udp"
    src: Endpoint | None
    dst: Endpoint | None
    tlvs: tuple[tuple[int, bytes], ...]
    length: int  # bytes the header occupies; payload starts at data[length:]


def encode_v2(src: Endpoint, dst: Endpoint) -> bytes:
    """PROXY v2 header for a TCP connection from `src` to `dst` (IP literals, ports)."""
    src_ip, dst_ip = _ip(src[0]), _ip(dst[0])
    for port in (src[1], dst[1]):
        if not 0 <= port <= 0xFFFF:
            raise ValueError(f"port out of range: {port}")
    if isinstance(src_ip, ipaddress.IPv4Address) and isinstance(dst_ip, ipaddress.IPv4Address):
        family, packed = _INET_TCP, src_ip.packed + dst_ip.packed
    else:
        family, packed = _INET6_TCP, _as_v6(src_ip).packed + _as_v6(dst_ip).packed
    body = packed + src[1].to_bytes(2, "big") + dst[1].to_bytes(2, "big")
    return SIGNATURE + bytes((_CMD_PROXY, family)) + len(body).to_bytes(2, "big") + body


def encode_v2_local() -> bytes:
    """PROXY v2 LOCAL header: 'no caller address, use the connection's own' (health checks)."""
    return SIGNATURE + bytes((_CMD_LOCAL, 0)) + b"\x00\x00"


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """Parse an IP literal; IPv4-mapped IPv6 becomes plain IPv4. Raises ValueError."""
    addr = ipaddress.ip_address(host.strip("[]"))
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def _as_v6(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv6Address:
    if isinstance(addr, ipaddress.IPv6Address):
        return addr
    return ipaddress.IPv6Address(b"\x00" * 10 + b"\xff\xff" + addr.packed)


def decode_v2(data: bytes | bytearray) -> ProxyHeader | None:
    """Decode the PROXY v2 header at the start of `data`; None while incomplete."""
    prefix = bytes(data[: len(SIGNATURE)])
    if not SIGNATURE.startswith(prefix):
        raise ProxyProtocolError("not_proxy", "no PROXY v2 signature")
    if len(data) < _FIXED:
        return None
    ver_cmd, fam, length = data[12], data[13], int.from_bytes(data[14:16], "big")
    if ver_cmd not in (_CMD_LOCAL, _CMD_PROXY):
        raise ProxyProtocolError("malformed", f"version/command byte {ver_cmd:#04x}")
    family, transport = _FAMILIES.get(fam >> 4), _TRANSPORTS.get(fam & 0xF)
    if family is None or transport is None:
        raise ProxyProtocolError("malformed", f"family/transport byte {fam:#04x}")
    if length > MAX_V2_PAYLOAD:
        raise ProxyProtocolError("too_large", f"{length} bytes of addresses and TLVs")
    if len(data) < _FIXED + length:
        return None
    payload = bytes(data[_FIXED : _FIXED + length])
    if ver_cmd == _CMD_LOCAL:  # the spec: receivers ignore the address block of LOCAL
        return ProxyHeader("local", family, transport, None, None, (), _FIXED + length)
    size = _ADDRESS_BYTES[family]
    if length < size:
        raise ProxyProtocolError("malformed", f"{family} needs {size} address bytes")
    src, dst = _addresses(family, payload[:size])
    return ProxyHeader("proxy", family, transport, src, dst, _tlvs(payload[size:]),
                       _FIXED + length)  # fmt: skip


def _addresses(family: str, block: bytes) -> tuple[Endpoint | None, Endpoint | None]:
    if family not in ("inet", "inet6"):
        return None, None
    width = 4 if family == "inet" else 16
    ip_type = ipaddress.IPv4Address if family == "inet" else ipaddress.IPv6Address
    src_ip, dst_ip = ip_type(block[:width]), ip_type(block[width : 2 * width])
    ports = block[2 * width :]
    src_port, dst_port = int.from_bytes(ports[:2], "big"), int.from_bytes(ports[2:], "big")
    return (str(src_ip), src_port), (str(dst_ip), dst_port)


def _tlvs(block: bytes) -> tuple[tuple[int, bytes], ...]:
    found: list[tuple[int, bytes]] = []
    pos = 0
    while pos < len(block):  # each pass consumes ≥ 3 bytes of a capped block
        if len(block) - pos < 3:
            raise ProxyProtocolError("malformed", "truncated TLV header")
        length = int.from_bytes(block[pos + 1 : pos + 3], "big")
        if pos + 3 + length > len(block):
            raise ProxyProtocolError("malformed", "TLV overruns the header")
        found.append((block[pos], block[pos + 3 : pos + 3 + length]))
        pos += 3 + length
    return tuple(found)
