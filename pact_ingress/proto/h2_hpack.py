"""HPACK encoding of response header blocks (RFC 7541), without a dynamic table. Pure.

A response block is mostly fields whose values change from one response to the next
(`date`, `content-length`, ids), so a dynamic table buys a few bytes per response and
costs a table search and an eviction scheme on every field. This encoder never indexes:
a field whose name and value are both in the static table is one byte, any other field
is a literal *without indexing* (its name by static index when there is one), and no
string is Huffman coded (shorter on the wire, but a per-byte loop in Python). Fields that
must not be cached by an intermediary (`set-cookie`, `authorization`, ...) are literals
*never indexed* (§6.2.3).

Because nothing is ever inserted, the table this encoder describes is always empty: the
first block of a connection starts with a dynamic table size update to 0 (§6.3), and so
does the first block after the peer changes SETTINGS_HEADER_TABLE_SIZE, so the peer's
decoder never waits for a size update it expects after a reduction.
"""

from __future__ import annotations

from collections.abc import Iterable

from hpack.table import HeaderTable

Header = tuple[bytes, bytes]

_STATIC = HeaderTable.STATIC_TABLE
#: Static index (1-based) of a name and of a whole field.
_NAME_INDEX: dict[bytes, int] = {}
_FIELD_INDEX: dict[Header, int] = {}
for _i, (_name, _value) in enumerate(_STATIC, 1):
    _NAME_INDEX.setdefault(_name, _i)
    if _value:
        _FIELD_INDEX[(_name, _value)] = _i
del _i, _name, _value

_SENSITIVE = frozenset({b"set-cookie", b"authorization", b"proxy-authorization", b"cookie"})

#: A dynamic table size update to 0 (`001` + 5-bit prefix integer 0).
TABLE_SIZE_ZERO = b"\x20"


def _integer(value: int, prefix_bits: int, first: int) -> bytes:
    """`value` as an HPACK integer with an N-bit prefix; `first` holds the bits above it."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes((first | value,))
    out = bytearray((first | limit,))
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    n = len(data)
    if n < 127:
        return bytes((n,)) + data
    return _integer(n, 7, 0) + data


#: Encoded literal prefixes by name: the name part of "literal without indexing" (or
#: "never indexed") fields seen so far; bounded, names are few.
_NAME_PREFIX: dict[bytes, bytes] = {}
_NAME_PREFIX_MAX = 512


def _name_prefix(name: bytes) -> bytes:
    prefix = _NAME_PREFIX.get(name)
    if prefix is not None:
        return prefix
    first = 0x10 if name in _SENSITIVE else 0x00
    index = _NAME_INDEX.get(name)
    prefix = _integer(index, 4, first) if index is not None else bytes((first,)) + _string(name)
    if len(_NAME_PREFIX) < _NAME_PREFIX_MAX:
        _NAME_PREFIX[name] = prefix
    return prefix


#: Encoded fields seen lately (most response fields repeat: server, content-type, a
#: content-length, the date within a second); bounded, forgotten all at once when full.
#: Fields that must never be indexed are not kept.
_FIELDS: dict[Header, bytes] = {}
_FIELDS_MAX = 1024
_FIELD_VALUE_MAX = 256  # longer values are encoded each time


def _field(field: Header) -> bytes:
    index = _FIELD_INDEX.get(field)
    if index is not None:
        return _integer(index, 7, 0x80)
    name, value = field
    n = len(value)
    return _name_prefix(name) + (bytes((n,)) if n < 127 else _integer(n, 7, 0)) + value


def encode(headers: Iterable[Header]) -> bytes:
    """The header block fragment for `headers` (names already lower case)."""
    out = []
    for field in headers:
        try:
            encoded = _FIELDS.get(field)
        except TypeError:  # not bytes (a bytearray): encoded, not kept
            out.append(_field((bytes(field[0]), bytes(field[1]))))
            continue
        if encoded is None:
            encoded = _field(field)
            if len(field[1]) <= _FIELD_VALUE_MAX and field[0] not in _SENSITIVE:
                if len(_FIELDS) >= _FIELDS_MAX:
                    _FIELDS.clear()
                _FIELDS[field] = encoded
        out.append(encoded)
    return b"".join(out)
