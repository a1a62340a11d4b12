"""RESP2, the Redis wire protocol, without I/O: encode a command, parse replies.

Only what a client needs: commands go out as an array of bulk strings; replies come in
as simple strings, errors, integers, bulk strings and arrays (RESP2; nil bulk strings and
nil arrays are ``None``). `Parser` is incremental: `feed` it whatever bytes arrived,
then call `next_reply` until it answers `NEED_DATA`. An error reply (``-ERR ...``) is a
`RespError` *value*, not a raised exception: it is a well-formed answer and the stream
stays in step. Anything that is not RESP raises `RespProtocolError`, and the connection
it came from must be closed (its stream can no longer be trusted to be in step).

Nothing here trusts the peer with memory: every length is checked against a named cap
before anything is allocated or waited for.
"""

from __future__ import annotations

from typing import Final, Union

#: Longest bulk string accepted, in bytes. The limiter's replies are a few bytes
#: ('ok' or a number); 8 MiB leaves room for any other small use while bounding what a
#: confused or hostile peer can make us buffer (Redis's own default is 512 MiB).
MAX_BULK_LENGTH: Final = 8 * 1024 * 1024
#: Most elements in one array. Elements are built one by one as bytes arrive, so this
#: bounds work and list size, not a pre-allocation.
MAX_ARRAY_LENGTH: Final = 1024 * 1024
#: Deepest nesting of arrays. Parsing recurses; this keeps it far from Python's limit.
MAX_NESTING: Final = 32
#: Longest header / simple-string / error / integer line, CRLF excluded. Without it a
#: peer that never sends CRLF would make us buffer without end.
MAX_LINE_LENGTH: Final = 64 * 1024
#: Longest decimal in an integer reply or a length (a signed 64-bit value, its sign).
_MAX_DIGITS: Final = 20


class RespProtocolError(Exception):
    """The bytes are not RESP2 (or exceed a cap): close the connection."""


class RespError(Exception):
    """An error reply from the server, e.g. ``NOSCRIPT No matching script``.

    Returned by the parser as a value; a client raises it when the caller wanted data.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    @property
    def kind(self) -> str:
        """The error's first word (``ERR``, ``NOSCRIPT``, ``WRONGPASS``...)."""
        return self.message.split(" ", 1)[0]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RespError) and other.message == self.message

    def __hash__(self) -> int:
        return hash(self.message)


class _NeedData:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NEED_DATA"


#: `Parser.next_reply`'s answer while a reply is incomplete.
NEED_DATA: Final = _NeedData()

Reply = Union[bytes, int, None, RespError, list["Reply"]]


def _arg(value: bytes | str | int | float) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        raise TypeError("a bool is not a Redis argument")
    if isinstance(value, (int, float)):
        return repr(value).encode()
    raise TypeError(f"not a Redis argument: {type(value).__name__}")


def encode_command(*args: bytes | str | int | float) -> bytes:
    """One command as RESP: an array of bulk strings (str is UTF-8)."""
    if not args:
        raise ValueError("an empty command")
    parts = [b"*%d\r\n" % len(args)]
    append = parts.append
    for value in args:
        # str and bytes first: they are nearly every argument (the hot path's all)
        data = value.encode() if type(value) is str else (
            value if type(value) is bytes else _arg(value))
        append(b"$%d\r\n%b\r\n" % (len(data), data))
    return b"".join(parts)


def _integer(line: bytes) -> int:
    # int() would accept '+', '_', spaces and non-ASCII digits: RESP does not.
    digits = line[1:] if line[:1] == b"-" else line
    if not digits or len(digits) > _MAX_DIGITS or not digits.isdigit():
        raise RespProtocolError(f"not a RESP integer: {line[:32]!r}")
    return int(line)


class Parser:
    """Incremental RESP2 reply parser (see the module docstring)."""

    __slots__ = ("_buf", "_pos", "_broken")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._broken = False

    def feed(self, data: bytes) -> None:
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed by a complete reply."""
        return len(self._buf) - self._pos

    def next_reply(self) -> Reply | _NeedData:
        """The next complete reply, or NEED_DATA; raises RespProtocolError (for good)."""
        if self._broken:
            raise RespProtocolError("the stream is out of step after an earlier error")
        if self._pos >= len(self._buf):
            return NEED_DATA
        try:
            result = self._parse(self._pos, 0)
        except RespProtocolError:
            self._broken = True
            raise
        if result is None:
            return NEED_DATA
        value, self._pos = result
        return value

    def _line(self, start: int) -> int:
        """The index of the CRLF ending the line at `start`, or -1 if it has not come."""
        buf = self._buf
        # the type byte, at most MAX_LINE_LENGTH bytes, CRLF
        end = buf.find(b"\r\n", start, start + MAX_LINE_LENGTH + 3)
        if end < 0:
            if len(buf) - start > MAX_LINE_LENGTH + 2:
                raise RespProtocolError("a line longer than MAX_LINE_LENGTH")
            if buf.find(b"\n", start) >= 0:
                raise RespProtocolError("a bare LF in a line")
            return -1
        return end

    def _parse(self, pos: int, depth: int) -> tuple[Reply, int] | None:
        buf = self._buf
        end = self._line(pos)
        if end < 0:
            return None
        kind = buf[pos]
        line = bytes(buf[pos + 1 : end])
        after = end + 2
        if b"\n" in line or b"\r" in line:
            raise RespProtocolError("a bare CR or LF in a line")
        if kind == 0x24:  # '$' bulk string
            length = _integer(line)
            if length == -1:
                return None, after
            if length < 0 or length > MAX_BULK_LENGTH:
                raise RespProtocolError(f"bulk length {length} outside 0..MAX_BULK_LENGTH")
            stop = after + length
            if len(buf) < stop + 2:
                return None
            if buf[stop : stop + 2] != b"\r\n":
                raise RespProtocolError("a bulk string not followed by CRLF")
            return bytes(buf[after:stop]), stop + 2
        if kind == 0x2B:  # '+' simple string
            return line, after
        if kind == 0x3A:  # ':' integer
            return _integer(line), after
        if kind == 0x2D:  # '-' error
            return RespError(line.decode("utf-8", "replace")), after
        if kind == 0x2A:  # '*' array
            count = _integer(line)
            if count == -1:
                return None, after
            if count < 0 or count > MAX_ARRAY_LENGTH:
                raise RespProtocolError(f"array length {count} outside 0..MAX_ARRAY_LENGTH")
            if depth >= MAX_NESTING:
                raise RespProtocolError("arrays nested deeper than MAX_NESTING")
            items: list[Reply] = []
            for _ in range(count):
                if after >= len(buf):
                    return None
                item = self._parse(after, depth + 1)
                if item is None:
                    return None
                value, after = item
                items.append(value)
            return items, after
        raise RespProtocolError(f"unknown RESP type byte {bytes([kind])!r}")
