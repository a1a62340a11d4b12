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

import struct
from typing import Any

from pact_ingress.proto.clienthello import (
    _HOST_RE,
    _MAX_HOSTNAME,
    MAX_CLIENT_HELLO,
    MAX_RECORD_PAYLOAD,
)

#: The parser's own host_name rule and length (one definition: the two must not drift).
_HOST_MATCH = _HOST_RE.fullmatch
#: The fixed head, up to the session_id length: record type, version major and minor,
#: record length; message type, length (high byte, low 16 bits); legacy_version's major
#: byte; (its minor and the random skipped); session_id length.
_HEAD = struct.Struct(">BBBHBBHB33xB").unpack_from
#: An extension's header (type, length), then its first two (or five) body bytes: the
#: lists' lengths (server_name: list length, name_type, name length).
_EXTENSION = struct.Struct(">HH").unpack_from
_LIST = struct.Struct(">HHH").unpack_from
_ONE_NAME = struct.Struct(">HHHBH").unpack_from
_SHORT = struct.error


def quick_sni(data: bytes | bytearray) -> str | None:
    """The SNI host_name (as `ClientHello.sni` spells it) of the ClientHello at the start
    of `data`, when that hello is whole in its first record, well-formed, and names a
    host; None when the full parser must decide (see the module doc).

    Written for the interpreter: every bytecode counts here, so fixed fields come in one
    `struct` call rather than a subscript each, an extension's header in one, and a hello
    framed as one accepted before (`_WHOLE`) is checked in one call altogether. A read
    past the end of `data` (`struct.error`) can only come from a length field that the
    checks would refuse anyway (see each one), so it declines as they would."""
    if len(data) < 47:
        return None
    if type(data) is not bytes:  # (a bytearray's slices could not key the maps below)
        data = bytes(data)
    # A hello framed exactly as one accepted before (every length and header the checks
    # below read, equal at equal offsets, in a read of the same size) passes them all
    # as that one did: only its host name and ALPN list are left to look up.
    whole = _WHOLE.get(len(data))
    if whole is not None and whole[0](data) == whole[1]:
        name_at, name_end, alpn_at, alpn_end = whole[2]
        if alpn_at == alpn_end or data[alpn_at:alpn_end] in _ALPN_LISTS:
            host = _HOSTS.get(data[name_at:name_end])
            if host is not None:
                return host
        # a name or an ALPN list not remembered: the walk below checks and remembers it
    # record: handshake(22), version 3.x (x ≤ 3); message: client_hello(1)
    kind, major, minor, record, message, high, low, legacy, sid = _HEAD(data)
    total = 4 + ((high << 16) | low)
    end = 5 + total  # the message's end, as an offset in `data`
    # body: legacy_version 3.x, a session_id of at most 32 bytes
    if (kind != 22 or major != 3 or minor > 3 or message != 1 or record > MAX_RECORD_PAYLOAD
            or total > record or total > MAX_CLIENT_HELLO or end > len(data) or total < 39
            or legacy != 3 or sid > 32):
        return None
    pos = 44 + sid
    if pos + 2 > end:
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
    # The extensions' framing: every header, in order, each extension ending where the
    # next begins and the last at `end`, no type twice. A layout seen before (the same
    # headers at the same offsets) is checked in one `struct` call: equal headers at
    # equal offsets are exactly what the walk below would find and accept.
    key = (pos << 20) | end  # (`end` < 2**20: it is bounded by MAX_CLIENT_HELLO)
    start = pos
    layout = _LAYOUTS.get(key)
    if layout is not None and layout[0](data, pos) == layout[1]:
        found = None
        at, alpn, versions = layout[2]
    else:
        # each extension's header offset by type; an extension that overruns the block,
        # or a header cut by its end, leaves `pos` past `end` (or the read past `data`)
        found = {}
        count = 0
        extension = _EXTENSION
        try:
            while pos < end:
                kind, size = extension(data, pos)
                found[kind] = pos
                pos += 4 + size
                count += 1
        except _SHORT:
            return None
        if pos != end or len(found) != count:
            return None  # framing, or a duplicate (the parser names it)
        at = found.get(0)
        alpn = found.get(16)
        versions = found.get(43)
    if at is None:
        return None  # no server_name
    # Past this point every extension lies within `data`: a struct read past its end
    # means an extension shorter than the lengths read, which the checks refuse.
    try:
        # server_name: a list of (type, name) entries, exactly filling the extension;
        # the usual one holds one host_name
        _, size, listed, name_type, length = _ONE_NAME(data, at)
        if name_type == 0 and size == listed + 2 and listed == length + 3:
            raw = data[at + 9:at + 9 + length]
        else:
            raw = _host_name(data, at + 4, at + 4 + size, listed)
            if raw is None:
                return None
        at = alpn
        if at is not None:  # ALPN: a non-empty list of non-empty names, filling it
            _, size, listed = _LIST(data, at)
            pos = at + 6
            stop = at + 4 + size
            if size < 2 or pos + listed != stop or pos == stop:
                return None
            names = data[pos:stop]
            if names not in _ALPN_LISTS:
                while pos < stop:
                    name = pos + 1
                    pos = name + data[pos]
                    if pos > stop or name == pos:
                        return None
                _remember(_ALPN_LISTS, names, True)
        at = versions
        if at is not None:  # supported_versions: an even, non-empty list, filling it
            size = ((data[at + 2] << 8) | data[at + 3]) - 1
            if size < 2 or size & 1 or data[at + 4] != size:
                return None
    except _SHORT:
        return None
    host = _HOSTS.get(raw)
    if host is None:
        lower = raw.removesuffix(b".").lower()
        if len(lower) > _MAX_HOSTNAME or _HOST_MATCH(lower) is None:
            return None
        host = _remember(_HOSTS, raw, lower.decode("ascii"))
    if found is not None:
        _learn(key, found, data, start, end)
    elif len(data) not in _WHOLE:  # (forgotten since, or not learned yet: see `_learn`)
        _learn_whole(layout[3], data, start)  # type: ignore[index]
    return host


#: Answers that depend only on a few bytes, which real clients repeat connection after
#: connection (the served host names, the ALPN list of each client kind): a host_name as
#: sent → the name it routes by, when valid; an ALPN list's bytes → well framed. Only
#: valid inputs are kept, and each map is bounded: a client sending new names every time
#: only makes it forget, never answer differently.
_HOSTS: dict[bytes, str] = {}
_ALPN_LISTS: dict[bytes, bool] = {}
_REMEMBERED = 1024


#: Extension layouts of accepted hellos, by (offset of the first extension, end): the
#: `struct` that reads every header at once, the headers it read then, the offsets of
#: server_name, ALPN and supported_versions, and every header's offset by type. A layout
#: is learned the second time an accepted hello shows it (`_SEEN`: the first time, only
#: its offsets are noted), so a client whose layout changes every time (random extension
#: order, GREASE types) costs a note per hello, not a `struct` made in vain.
_LAYOUTS: dict[int, tuple[Any, tuple[int, ...], tuple[int, int | None, int | None],
                          dict[int, int]]] = {}
_SEEN: dict[int, tuple[tuple[int, int], ...]] = {}


def _learn(key: int, found: dict[int, int], data: bytes, start: int, end: int) -> None:
    """An accepted hello's extension layout (`found`: offset by type, in wire order)."""
    seen = tuple(found.items())
    if _SEEN.get(key) != seen:
        _remember(_SEEN, key, seen)
        return
    fmt = [">"]
    last = start
    for at in found.values():
        if at > last:
            fmt.append(f"{at - last}x")
        fmt.append("HH")
        last = at + 4
    read = struct.Struct("".join(fmt)).unpack_from
    _remember(_LAYOUTS, key, (read, read(data, start),
                              (found[0], found.get(16), found.get(43)), found))
    if len(data) not in _WHOLE:  # the first layout of a size keeps it (no thrashing)
        _learn_whole(found, data, start)


#: Whole-hello layouts of accepted hellos, by the size of the read that held them: the
#: `struct` that reads, in one call, every field `quick_sni`'s checks depend on — the
#: record and message headers, the session_id, cipher_suites, compression_methods and
#: extensions lengths, every extension header, the server_name list and name lengths,
#: the ALPN list length and the supported_versions list length — the values it read
#: then, and where the host name and the ALPN names lie. Learned with an extension
#: layout (an accepted hello seen twice), one per size, bounded.
_WHOLE: dict[int, tuple[Any, tuple[int, ...], tuple[int, int, int, int]]] = {}


def _learn_whole(found: dict[int, int], data: bytes, start: int) -> None:
    """The whole-hello layout of an accepted hello whose extension headers are at the
    offsets `found` (by type), its extensions block's length field at `start` - 2.
    Only the usual server_name (one host_name filling it) is learned: any other goes
    through `_host_name` every time."""
    sid = data[43]
    suites = 44 + sid
    compression = suites + 2 + ((data[suites] << 8) | data[suites + 1])
    fields = [(0, "BBBHBBHB"), (43, "B"), (suites, "H"), (compression, "B"),
              (start - 2, "H")]
    fields += [(at, "HH") for at in found.values()]
    at = found[0]
    _, size, listed, name_type, length = _ONE_NAME(data, at)
    if not (name_type == 0 and size == listed + 2 and listed == length + 3):
        return
    fields.append((at + 4, "HBH"))
    names = (at + 9, at + 9 + length)
    alpn = found.get(16)
    if alpn is None:
        names += (0, 0)
    else:
        fields.append((alpn + 4, "H"))
        names += (alpn + 6, alpn + 4 + ((data[alpn + 2] << 8) | data[alpn + 3]))
    versions = found.get(43)
    if versions is not None:
        fields.append((versions + 4, "B"))
    fmt = [">"]
    last = 0
    for at, code in sorted(fields):
        if at < last:
            return  # overlapping fields: not a layout this can describe
        if at > last:
            fmt.append(f"{at - last}x")
        fmt.append(code)
        last = at + struct.calcsize(">" + code)
    read = struct.Struct("".join(fmt)).unpack_from
    _remember(_WHOLE, len(data), (read, read(data), names))  # type: ignore[arg-type]


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> Any:
    if len(cache) >= _REMEMBERED:
        cache.clear()
    cache[key] = value
    return value


def _host_name(data: bytes, start: int, stop: int, listed: int) -> bytes | None:
    """The host_name of a server_name extension whose body is data[start:stop] and whose
    list length field says `listed`: None unless the list exactly fills the body, is not
    empty, is well framed and holds one host_name."""
    if stop - start < 2 or start + 2 + listed != stop:
        return None
    pos = start + 2
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
    return raw
