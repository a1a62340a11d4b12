"""The preamble of an instance-to-instance forward link, sans-I/O.

After the pinned mutual TLS handshake (ALPN `pact-forward/1`), the forwarding instance
names the tenant whose tunnel it wants (inside TLS); both ends close TLS, and the holder
answers with one byte (why it comes after the TLS shutdown: `net/forward.py`). From then
on the link carries the caller's bytes unchanged, so this is the whole protocol:

    request:  MAGIC (4 bytes) | VERSION (1) | length (1) | tenant (length bytes, ASCII)
    answer:   one byte, an `Answer`

The tenant name is capped (MAX_TENANT, the config's own limit on tenant names) and must
look like a tenant name, so nothing a peer sends can make the receiver buffer more than
REQUEST_MAX bytes or log arbitrary text. Anything else is `ForwardProtocolError`.
"""

from __future__ import annotations

import enum
import re

#: First bytes of a request: a peer speaking something else is told apart at once.
MAGIC = b"PFWD"
VERSION = 1
#: Tenant names are at most 63 characters of [a-z0-9-] (the config says so).
MAX_TENANT = 63
#: The longest request that can be valid; a receiver never buffers more.
REQUEST_MAX = len(MAGIC) + 2 + MAX_TENANT
_TENANT_RE = re.compile(rb"[a-z0-9][a-z0-9-]*")


class ForwardProtocolError(ValueError):
    """A preamble that is not one: wrong magic or version, bad length or name."""


class Answer(enum.IntEnum):
    OK = 0
    #: The receiver holds no live tunnel for the tenant (any more).
    NO_TUNNEL = 1
    #: The receiver refuses this link: it holds as many from the peer's address as its
    #: `limits.max_connections_per_ip` allows.
    REFUSED = 2


def encode_request(tenant: str) -> bytes:
    raw = tenant.encode("ascii")
    if len(raw) > MAX_TENANT or not _TENANT_RE.fullmatch(raw):
        raise ValueError(f"not a tenant name: {tenant!r}")
    return MAGIC + bytes((VERSION, len(raw))) + raw


class RequestDecoder:
    """Feed bytes as they arrive; `tenant` is set once the request is complete.

    Bytes after the request (the caller's first bytes, if the forwarder did not wait for
    the answer) stay in `rest`; this protocol forbids them, and the receiver checks.
    """

    def __init__(self) -> None:
        self._buf = b""
        self.tenant: str | None = None
        self.rest = b""

    def feed(self, data: bytes) -> str | None:
        if self.tenant is not None:
            self.rest += data
            return self.tenant
        self._buf += data
        buf = self._buf
        head = MAGIC[: len(buf)]
        if buf[: len(MAGIC)] != head:
            raise ForwardProtocolError("not a forward request (bad magic)")
        if len(buf) > len(MAGIC) and buf[len(MAGIC)] != VERSION:
            raise ForwardProtocolError(f"unsupported forward version {buf[len(MAGIC)]}")
        if len(buf) < len(MAGIC) + 2:
            return None
        length = buf[len(MAGIC) + 1]
        if not 0 < length <= MAX_TENANT:
            raise ForwardProtocolError(f"tenant name length {length} out of range")
        end = len(MAGIC) + 2 + length
        if len(buf) < end:
            return None
        name = buf[len(MAGIC) + 2:end]
        if not _TENANT_RE.fullmatch(name):
            raise ForwardProtocolError("the tenant name is not [a-z0-9][a-z0-9-]*")
        self.tenant, self.rest, self._buf = name.decode("ascii"), buf[end:], b""
        return self.tenant


def encode_answer(answer: Answer) -> bytes:
    return bytes((answer,))


def decode_answer(data: bytes) -> Answer:
    """The holder's one-byte answer (exactly one byte: it says nothing else before the
    caller's bytes start)."""
    if len(data) != 1:
        raise ForwardProtocolError(f"expected a one-byte answer, got {len(data)} bytes")
    try:
        return Answer(data[0])
    except ValueError:
        raise ForwardProtocolError(f"unknown forward answer {data[0]}") from None
