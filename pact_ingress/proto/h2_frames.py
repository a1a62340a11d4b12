"""What both ends of an HTTP/2 connection (RFC 9113) share: the wire's numbers, frame
building, the error types and the events both report. Pure.

The client side's server (`proto.h2_server`, the edge's front) and the node side's
client (`proto.h2_client`, the edge's multiplexed node leg) each import this rather
than each other, so neither end's state machine depends on the other's.
"""

from __future__ import annotations

import enum
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# frame types
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
# flags
END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
MAX_WINDOW = 2**31 - 1
MAX_STREAM_ID = 2**31 - 1
#: A compressed header block may take this many bytes, or this many CONTINUATION frames,
#: before the connection is ended; both far beyond a block whose header list fits a cap.
MAX_BLOCK_BYTES = 64 * 1024
MAX_CONTINUATIONS = 64
#: Streams we reset whose late frames are still ignored rather than ending the connection
#: (the peer sends at most a window's worth per stream before it sees the reset).
RESET_MEMORY = 256

HEAD = struct.Struct(">I B I")  # length << 8 | type, flags, stream id
U32 = struct.Struct(">I")
SETTING = struct.Struct(">HI")
GOAWAY_HEAD = struct.Struct(">II")  # last stream id, error code


class ErrorCode(enum.IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class Setting(enum.IntEnum):
    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6
    ENABLE_CONNECT_PROTOCOL = 0x8


class ConnectionError_(Exception):  # noqa: N801 - not the builtin
    """The peer broke the protocol; GOAWAY with `code` is queued."""

    def __init__(self, code: ErrorCode, why: str) -> None:
        super().__init__(why)
        self.code = code


class StreamClosed(Exception):
    """Nothing more can be sent on this stream (reset, ended, or the connection closed)."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return HEAD.pack(len(payload) << 8 | kind, flags, stream_id) + payload


def unpad(flags: int, payload: bytes) -> bytes | None:
    """A DATA or HEADERS payload without its padding; None when the padding is longer
    than the frame."""
    if not flags & PADDED:
        return payload
    if not payload or payload[0] >= len(payload):
        return None
    return payload[1:len(payload) - payload[0]]


def settings_frame(values: tuple[tuple[int, int], ...]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(SETTING.pack(code, value) for code, value in values))


# -- events both ends report ----------------------------------------------------------

class Event:
    __slots__ = ()


class DataReceived(Event):
    """`flow_length` (payload and padding) is owed back through `acknowledge`."""
    __slots__ = ("stream_id", "data", "flow_length", "ended")

    def __init__(self, stream_id: int, data: bytes, flow_length: int, ended: bool):
        self.stream_id, self.data, self.flow_length, self.ended = (
            stream_id, data, flow_length, ended)


class StreamEnded(Event):
    """The peer ended the stream with trailers (which are dropped: the next hop gets
    none)."""
    __slots__ = ("stream_id",)

    def __init__(self, stream_id: int):
        self.stream_id = stream_id


class StreamReset(Event):
    """By the peer (`remote`), or by us for a stream error (RST_STREAM queued)."""
    __slots__ = ("stream_id", "code", "remote")

    def __init__(self, stream_id: int, code: int, remote: bool):
        self.stream_id, self.code, self.remote = stream_id, code, remote


class WindowUpdated(Event):
    __slots__ = ("stream_id",)

    def __init__(self, stream_id: int):
        self.stream_id = stream_id


class SettingsChanged(Event):
    __slots__ = ()


class SettingsAcked(Event):
    __slots__ = ()


class PingReceived(Event):
    __slots__ = ("ack",)

    def __init__(self, ack: bool):
        self.ack = ack


class PriorityReceived(Event):
    __slots__ = ()


class UnknownFrame(Event):
    __slots__ = ("kind",)

    def __init__(self, kind: int):
        self.kind = kind


SETTINGS_CHANGED = SettingsChanged()
SETTINGS_ACKED = SettingsAcked()
PRIORITY_RECEIVED = PriorityReceived()
