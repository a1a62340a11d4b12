"""The SNI of the common ClientHello, checked in one pass with few calls.

`proto/clienthello.py` is the parser: it reassembles handshake records, names every
fault precisely, and is written to be read. The passthrough engine runs on every new
connection, and there the parser's per-field helpers and its result object are a
measurable share of a connection's CPU. Almost every real hello arrives whole, in one
record, in the first read, and the engine needs only its SNI to route it; for that case
`quick_sni` walks the same fields inline, makes the same checks, and returns the name.

It answers only when it is sure: any input it does not fully accept — more than one
record, a hello not whole yet, no SNI, or anything the parser would refuse — gives
None, and the caller runs `parse_client_hello`, which then answers (or raises with its
reason and alert) as it always does. So the verdict on every input is the parser's:
where this returns a name, the parser returns a `ClientHello` with that `sni` (a
property the tests check on real hellos and on mutations of them).
"""

from __future__ import annotations

from pact_ingress.proto.clienthello import (
    _HOST_RE,
    _MAX_HOSTNAME,
    MAX_CLIENT_HELLO,
    MAX_RECORD_PAYLOAD,
)

#: The parser's own host_name rule and length (one definition: the two must not drift).
_HOST_MATCH = _HOST_RE.fullmatch


def quick_sni(data: bytes) -> str | None:
    """The SNI host_name (as `ClientHello.sni` spells it) of the ClientHello at the start
    of `data`, when that hello is whole in its first record, well-formed, and names a
    host; None when the full parser must decide (see the module doc)."""
    n = len(data)
    # record: handshake(22), version 3.x (x ≤ 3); message: client_hello(1)
    if n < 47 or data[0] != 22 or data[1] != 3 or data[2] > 3 or data[5] != 1:
        return None
    record = (data[3] << 8) | data[4]
    total = 4 + ((data[6] << 16) | (data[7] << 8) | data[8])
    end = 5 + total  # the message's end, as an offset in `data`
    if record > MAX_RECORD_PAYLOAD or total > record or total > MAX_CLIENT_HELLO or end > n:
        return None
    # body (offsets in `data`): legacy_version at 9, random 11..43, session_id at 43
    if total < 39 or data[9] != 3:
        return None
    pos = 44 + data[43]
    if pos + 2 > end or data[43] > 32:
        return None
    size = (data[pos] << 8) | data[pos + 1]  # cipher_suites
    pos += 2 + size
    if pos + 1 > end or size == 0 or size & 1:
        return None
    size = data[pos]  # compression_methods
    pos += 1 + size
    if pos + 2 > end or size == 0:  # (no extensions block: no SNI)
        return None
    if pos + 2 + ((data[pos] << 8) | data[pos + 1]) != end:
        return None
    pos += 2
    sni = alpn = versions = 0
    types = set()
    add = types.add
    count = 0
    while pos < end:  # each pass consumes ≥ 4 bytes of the block
        if end - pos < 4:
            return None
        kind = (data[pos] << 8) | data[pos + 1]
        start = pos + 4
        pos = start + ((data[pos + 2] << 8) | data[pos + 3])
        if pos > end:
            return None
        add(kind)
        count += 1
        if kind == 0:
            sni = start
        elif kind == 16:
            alpn = start
        elif kind == 43:
            versions = start
        # (each extension's end is found again below from its own length field)
    if len(types) != count or not sni:
        return None  # a duplicate (the parser names it), or no server_name
    # server_name: a list of (type, name) entries, exactly filling the extension
    stop = sni + ((data[sni - 2] << 8) | data[sni - 1])
    if stop - sni < 2 or sni + 2 + ((data[sni] << 8) | data[sni + 1]) != stop:
        return None
    pos = sni + 2
    if pos == stop:
        return None
    raw = None
    while pos < stop:
        if pos + 3 > stop:
            return None
        name = pos + 3
        pos = name + ((data[pos + 1] << 8) | data[pos + 2])
        if pos > stop:
            return None
        if data[name - 3] == 0:
            if raw is not None:
                return None
            raw = data[name:pos]
    if raw is None:
        return None
    if alpn:  # a non-empty list of non-empty names, exactly filling the extension
        stop = alpn + ((data[alpn - 2] << 8) | data[alpn - 1])
        if stop - alpn < 2 or alpn + 2 + ((data[alpn] << 8) | data[alpn + 1]) != stop:
            return None
        pos = alpn + 2
        if pos == stop:
            return None
        while pos < stop:
            name = pos + 1
            pos = name + data[pos]
            if pos > stop or name == pos:
                return None
    if versions:  # an even, non-empty list, exactly filling the extension
        size = ((data[versions - 2] << 8) | data[versions - 1]) - 1
        if size < 2 or size & 1 or data[versions] != size:
            return None
    lower = raw.removesuffix(b".").lower()
    if len(lower) > _MAX_HOSTNAME or _HOST_MATCH(lower) is None:
        return None
    return lower.decode("ascii")
