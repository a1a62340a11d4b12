"""Fatal TLS alert records, written before any handshake has happened.

The router reads a caller's ClientHello without ever speaking TLS itself. When it cannot
route the connection (unknown SNI, backend down) it still owes the caller a reason, and
the only reason a TLS client can show is an alert. Before the server's first flight no
keys exist, so the alert is a plaintext record (RFC 8446 §5.1, §6; RFC 5246 §7.2):

    ContentType alert(21) | legacy_record_version (2) | length 0x0002 | level 2 | code

Level is always fatal(2): TLS 1.3 treats every alert but close_notify/user_canceled as
fatal anyway, and we close the connection right after sending it. OpenSSL, GnuTLS and
Python's ssl accept a 0x0303 record version for this record whatever version they offered,
which is why that is the default.
"""

from __future__ import annotations

# Alert descriptions (RFC 8446 §6, RFC 7301 §3.2 for no_application_protocol).
UNEXPECTED_MESSAGE = 10
RECORD_OVERFLOW = 22
HANDSHAKE_FAILURE = 40
ILLEGAL_PARAMETER = 47
DECODE_ERROR = 50
PROTOCOL_VERSION = 70
INTERNAL_ERROR = 80
UNRECOGNIZED_NAME = 112
NO_APPLICATION_PROTOCOL = 120

_CONTENT_TYPE_ALERT = 21
_LEVEL_FATAL = 2


def alert_record(description: int, *, version: int = 0x0303) -> bytes:
    """Return the 7-byte plaintext record carrying one fatal alert `description`."""
    if not 0 <= description <= 0xFF:
        raise ValueError(f"alert description out of range: {description}")
    if not 0x0300 <= version <= 0x0304:
        raise ValueError(f"record version out of range: {version:#06x}")
    return bytes(
        (_CONTENT_TYPE_ALERT, version >> 8, version & 0xFF, 0, 2, _LEVEL_FATAL, description)
    )
