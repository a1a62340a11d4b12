"""The private channel between the ingress's main process and its worker processes.

Theory of operation
-------------------
Main and each worker share one AF_UNIX SOCK_SEQPACKET socketpair: the kernel keeps
message boundaries and order, carries file descriptors (SCM_RIGHTS) with a message,
and the pair has no filesystem name, so nothing else on the machine can reach it.
This module is the sans-I/O half: message kinds, how a message becomes frames and
frames become a message again, the payload of the one hot message (`Handoff`), which
worker a client belongs to, and the worker's lifecycle as a transition table. The I/O
half (sockets, processes, SCM_RIGHTS) is `net/workers.py`.

A frame is `kind (u8) | flags (u8) | id (u32) | payload`. A message longer than
`MAX_FRAME_PAYLOAD` (a config, a metrics report) is cut into frames of one id with
`MORE` set on all but the last; `Reassembler` joins them per id, so a one-frame message
(a connection handed over) may pass between the pieces of a long one. File descriptors
travel only with one-frame messages.

Which worker serves a client: `worker_for(ip, n)` hashes the client's *rate-limit
bucket* (`proto.ratelimit.client_bucket`: an IPv4 address, an IPv6 /64), so every
connection of one bucket lands in one worker. Every budget a terminate route charges
(the per-IP ceiling, each (IP, key) pair, the per-IP in-flight share and body buffers)
is keyed by that bucket, so one process sees all of a client's traffic and the budgets
stay exactly what a single process enforces — nothing is shared, nothing multiplied
by the number of workers. (A replaced worker's buckets start full in the new process,
as any bucket does when an ingress restarts.) CRC-32 rather than `hash()`: the same
client goes to the same worker index after a restart too (TLS session tickets are per
worker).

The payload of main → worker `CONFIG` is a pickled `Config` (same code on both ends,
and the parent is the trusted side). Everything a worker sends back is JSON or fixed
binary fields: a worker parses what callers send, so main never unpickles its output.
"""

from __future__ import annotations

import enum
import json
import struct
import zlib
from dataclasses import dataclass

from pact_ingress.proto.ratelimit import client_bucket

#: Payload bytes per frame. Well below the default AF_UNIX send buffer (~208 KiB), which
#: bounds one SEQPACKET message; a ClientHello (≤ 16 KiB parsed) plus paths fits one.
MAX_FRAME_PAYLOAD = 64 * 1024
#: A message reassembled from frames may not exceed this (a config with thousands of
#: tenants is a few MiB; anything larger is a bug or a hostile peer).
MAX_MESSAGE = 64 * 1024 * 1024
#: Partial messages one reassembler holds at once (one per concurrent long message).
MAX_PARTIAL = 64
#: File descriptors one message may carry (a handoff and a stream request carry one).
MAX_FDS = 1
#: Bytes read per frame: the largest frame plus its header.
FRAME_READ = MAX_FRAME_PAYLOAD + 64

_HEAD = struct.Struct("!BBI")
MORE = 0x01


class Kind(enum.IntEnum):
    CONFIG = 1         # main → worker: pickled Config (at start and after each reload)
    HANDOFF = 2        # main → worker: a client connection (fd) + `Handoff`
    DRAIN = 3          # main → worker: stop taking work, finish open requests, exit
    STATS_ASK = 4      # main → worker: send a STATS report with this id
    STATS = 5          # worker → main: JSON report (metrics text, refusals, counts)
    READY = 6          # worker → main: config applied, taking connections
    CLOSED = 7         # worker → main: handed-over connections that ended (u64 ids)
    STREAM_OPEN = 8    # worker → main: open the tunnel stream of a route onto this fd
    STREAM_RESULT = 9  # main → worker: b"" = spliced, else the reason it failed
    RELAY_ASK = 10     # worker → main: relay store operations (`encode_records`)
    RELAY_ANSWER = 11  # main → worker: their outcomes, by the operations' ids
    RELAY_STATE = 12   # main → worker: the store's allow-lists (and depths, health)
    RELAY_STATE_TAKEN = 13  # worker → main: that RELAY_STATE (same id) is applied


class ProtocolError(Exception):
    """A frame or message that cannot come from our own peer: the channel is dropped."""


@dataclass(frozen=True)
class Message:
    kind: Kind
    id: int
    payload: bytes


def encode(kind: Kind, payload: bytes = b"", msg_id: int = 0) -> list[bytes]:
    """The frames of one message (at least one, even for an empty payload)."""
    if len(payload) > MAX_MESSAGE:
        raise ProtocolError(f"message of {len(payload)} bytes over {MAX_MESSAGE}")
    view = memoryview(payload)
    frames = []
    while True:
        piece, view = view[:MAX_FRAME_PAYLOAD], view[MAX_FRAME_PAYLOAD:]
        more = MORE if len(view) else 0
        frames.append(_HEAD.pack(kind, more, msg_id) + piece)
        if not more:
            return frames


class Reassembler:
    """Frames in, whole messages out; pieces of a long message are joined per id."""

    def __init__(self) -> None:
        self._partial: dict[tuple[int, int], list[bytes]] = {}
        self._sizes: dict[tuple[int, int], int] = {}

    def feed(self, frame: bytes) -> Message | None:
        """The message `frame` completes, or None while more frames are due."""
        if len(frame) < _HEAD.size:
            raise ProtocolError(f"frame of {len(frame)} bytes")
        raw_kind, flags, msg_id = _HEAD.unpack_from(frame)
        try:
            kind = Kind(raw_kind)
        except ValueError:
            raise ProtocolError(f"unknown message kind {raw_kind}") from None
        if flags & ~MORE:
            raise ProtocolError(f"unknown flags {flags:#x}")
        piece = frame[_HEAD.size:]
        key = (kind, msg_id)
        if not flags & MORE and key not in self._partial:
            return Message(kind, msg_id, piece)  # the common case: one frame, no copy
        size = self._sizes.get(key, 0) + len(piece)
        if size > MAX_MESSAGE:
            raise ProtocolError(f"message over {MAX_MESSAGE} bytes")
        if key not in self._partial and len(self._partial) >= MAX_PARTIAL:
            raise ProtocolError("too many partial messages")
        self._partial.setdefault(key, []).append(piece)
        self._sizes[key] = size
        if flags & MORE:
            return None
        del self._sizes[key]
        return Message(kind, msg_id, b"".join(self._partial.pop(key)))


# --- the handoff of one client connection ----------------------------------------------

_HANDOFF = struct.Struct("!QQHB")
_STR = struct.Struct("!H")
_HAS_SNI = 0x01
_RELAY = 0x02


@dataclass(frozen=True)
class Handoff:
    """What a worker needs besides the fd: who the client is, which route the router
    chose, the certificate main serves for it now, and the bytes already read."""

    conn_id: int
    client_ip: str
    client_port: int
    route_host: str
    sni: str | None
    cert_generation: int  # changes whenever main serves another context for the host
    chain_path: str
    key_path: str
    data: bytes  # the ClientHello bytes the router peeked, replayed first
    relay: bool = False  # the relay host's connection, not a terminate route's


def encode_handoff(h: Handoff) -> bytes:
    flags = (_HAS_SNI if h.sni is not None else 0) | (_RELAY if h.relay else 0)
    out = [_HANDOFF.pack(h.conn_id, h.cert_generation, h.client_port, flags)]
    for text in (h.client_ip, h.route_host, h.sni or "", h.chain_path, h.key_path):
        raw = text.encode("utf-8", "surrogateescape")
        out += [_STR.pack(len(raw)), raw]
    out.append(h.data)
    return b"".join(out)


def decode_handoff(payload: bytes) -> Handoff:
    try:
        conn_id, generation, port, flags = _HANDOFF.unpack_from(payload)
        at = _HANDOFF.size
        texts = []
        for _ in range(5):
            (n,) = _STR.unpack_from(payload, at)
            at += _STR.size
            if at + n > len(payload):
                raise ProtocolError("handoff field runs past the message")
            texts.append(payload[at:at + n].decode("utf-8", "surrogateescape"))
            at += n
    except struct.error as exc:
        raise ProtocolError(f"short handoff: {exc}") from None
    ip, host, sni, chain, key = texts
    if flags & ~(_HAS_SNI | _RELAY):
        raise ProtocolError(f"unknown handoff flags {flags:#x}")
    return Handoff(conn_id, ip, port, host, sni if flags & _HAS_SNI else None, generation,
                   chain, key, payload[at:], bool(flags & _RELAY))


_ID = struct.Struct("!Q")


def encode_closed(conn_ids: list[int]) -> bytes:
    return b"".join(_ID.pack(i) for i in conn_ids)


def decode_closed(payload: bytes) -> list[int]:
    if len(payload) % _ID.size:
        raise ProtocolError("CLOSED payload is not a list of ids")
    return [i for (i,) in _ID.iter_unpack(payload)]


def encode_json(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_json(payload: bytes) -> dict[str, object]:
    try:
        doc = json.loads(payload)
    except ValueError as exc:
        raise ProtocolError(f"bad JSON report: {exc}") from None
    if not isinstance(doc, dict):
        raise ProtocolError("a report is a JSON object")
    return doc


# --- relay store operations a worker asks main for ------------------------------------

class RelayOp(enum.IntEnum):
    ENQUEUE = 1        # `encode_enqueue`: fixed binary fields + the envelope bytes
    FETCH = 2          # {recipient, limit} → {items: [[id, queued_at, size]…], more} + bytes
    ACK = 3            # {recipient, ids} → {acked}
    SET_ALLOWLIST = 4  # {recipient, senders} → {}
    REFRESH = 5        # {} → {} (a shared store: re-read what other instances changed)
    PROBE = 6          # {} → {healthy, last_error} (a broken store: reopen when due)


class RelayStatus(enum.IntEnum):
    OK = 0
    QUEUE_FULL = 1     # {retry_after}
    UNAVAILABLE = 2    # {reason}
    ENQUEUED = 3       # an ENQUEUE's success: `encode_enqueued` (binary, no document)
    MSG_ID_TAKEN = 4   # {}: another sender's item holds the msg_id


_RELAY_HEAD = struct.Struct("!BI")


def encode_relay(code: int, doc: object, blob: bytes = b"") -> bytes:
    """An ask (`code` a `RelayOp`) or an answer (a `RelayStatus`): a JSON document of the
    small fields, then raw bytes (envelopes travel as they are, never re-escaped)."""
    head = json.dumps(doc, separators=(",", ":")).encode()
    return b"".join((_RELAY_HEAD.pack(code, len(head)), head, blob))


def decode_relay(payload: bytes) -> tuple[int, dict[str, object], bytes]:
    """(code, document, blob); the code is checked by whoever knows which enum it is."""
    try:
        code, n = _RELAY_HEAD.unpack_from(payload)
    except struct.error:
        raise ProtocolError("short relay message") from None
    at = _RELAY_HEAD.size
    if at + n > len(payload):
        raise ProtocolError("relay message head runs past the message")
    doc = decode_json(payload[at:at + n])
    return code, doc, payload[at + n:]


# The hot operation, every relay_call's, has fixed fields: packed, not JSON, both ways.
_ENQUEUE = struct.Struct("!BqHHH")  # op, expires_at, then the lengths of three strings
_ENQUEUED = struct.Struct("!BQB")  # status, item id, duplicate


def encode_enqueue(recipient: str, sender: str, msg_id: str, expires_at: int,
                   envelope: bytes) -> bytes:
    """An ENQUEUE ask: `expires_at`, recipient, sender and msg_id (UTF-8), the envelope."""
    r, s, m = (t.encode("utf-8", "surrogatepass") for t in (recipient, sender, msg_id))
    return b"".join((_ENQUEUE.pack(RelayOp.ENQUEUE, expires_at, len(r), len(s), len(m)),
                     r, s, m, envelope))


def decode_ask(payload: bytes) -> tuple[int, dict[str, object], bytes]:
    """An ask as (op, document, blob), whichever its encoding: an ENQUEUE's document has
    the members `encode_relay` would have sent (recipient, sender, msg_id, expires_at)."""
    if not payload or payload[0] != RelayOp.ENQUEUE:
        return decode_relay(payload)
    try:
        _, expires_at, nr, ns, nm = _ENQUEUE.unpack_from(payload)
    except struct.error:
        raise ProtocolError("short relay ENQUEUE") from None
    at = _ENQUEUE.size
    if at + nr + ns + nm > len(payload):
        raise ProtocolError("relay ENQUEUE fields run past the message")
    try:
        texts = [payload[a:b].decode("utf-8", "surrogatepass") for a, b in
                 ((at, at + nr), (at + nr, at + nr + ns), (at + nr + ns, at + nr + ns + nm))]
    except UnicodeDecodeError:
        raise ProtocolError("relay ENQUEUE field is not UTF-8") from None
    doc: dict[str, object] = {"recipient": texts[0], "sender": texts[1], "msg_id": texts[2],
                              "expires_at": expires_at}
    return RelayOp.ENQUEUE, doc, payload[at + nr + ns + nm:]


def encode_enqueued(item_id: int, duplicate: bool) -> bytes:
    return _ENQUEUED.pack(RelayStatus.ENQUEUED, item_id, 1 if duplicate else 0)


def decode_enqueued(payload: bytes) -> tuple[int, bool]:
    """An ENQUEUED answer's (item id, duplicate)."""
    try:
        _, item_id, duplicate = _ENQUEUED.unpack(payload)
    except struct.error:
        raise ProtocolError("bad relay ENQUEUED answer") from None
    return item_id, bool(duplicate)


_RECORD = struct.Struct("!II")
#: Records gathered into one message up to about this many bytes (a larger record goes
#: alone): many operations per message, one wakeup and one syscall each way.
MAX_RECORDS_BYTES = 1024 * 1024


def encode_records(records: list[tuple[int, bytes]]) -> bytes:
    """Operations (or answers) of one message: `id (u32) | length (u32) | payload` each."""
    return b"".join(part for rid, payload in records
                    for part in (_RECORD.pack(rid, len(payload)), payload))


def decode_records(payload: bytes) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    at = 0
    while at < len(payload):
        try:
            rid, n = _RECORD.unpack_from(payload, at)
        except struct.error:
            raise ProtocolError("short relay record") from None
        at += _RECORD.size
        if at + n > len(payload):
            raise ProtocolError("relay record runs past the message")
        out.append((rid, payload[at:at + n]))
        at += n
    return out


class Outbox:
    """Records waiting for the next message of one direction of one channel. Whoever
    adds one wakes the sender task; the sender takes everything gathered meanwhile (the
    tasks that ran in the same scheduler pass), so a burst of operations costs one
    message, not one each."""

    def __init__(self) -> None:
        self._records: list[tuple[int, bytes]] = []
        self._size = 0

    def add(self, rid: int, payload: bytes) -> bool:
        """Queue one; True when the outbox was empty (the sender must be woken)."""
        self._records.append((rid, payload))
        self._size += len(payload) + _RECORD.size
        return len(self._records) == 1

    def take(self) -> list[bytes]:
        """Every queued record, as message payloads of at most ~MAX_RECORDS_BYTES."""
        out: list[bytes] = []
        batch: list[tuple[int, bytes]] = []
        size = 0
        for rid, payload in self._records:
            if batch and size + len(payload) > MAX_RECORDS_BYTES:
                out.append(encode_records(batch))
                batch, size = [], 0
            batch.append((rid, payload))
            size += len(payload) + _RECORD.size
        if batch:
            out.append(encode_records(batch))
        self._records, self._size = [], 0
        return out


# --- which worker ----------------------------------------------------------------------

def worker_for(ip: str, workers: int) -> int:
    """The worker index (0 … workers-1) every connection of `ip`'s bucket goes to."""
    bucket = client_bucket(ip) or ip
    return zlib.crc32(bucket.encode()) % workers


# --- a worker's lifecycle --------------------------------------------------------------

class WorkerState(enum.Enum):
    STARTING = "starting"      # process spawned, config sent, READY not yet seen
    READY = "ready"            # taking connections
    DRAINING = "draining"      # told to drain: finishing open requests, then exits
    EXITED = "exited"          # the process is gone
    RESPAWNING = "respawning"  # gone unexpectedly; a new process starts after a backoff


_NEXT: dict[WorkerState, frozenset[WorkerState]] = {
    WorkerState.STARTING: frozenset({WorkerState.READY, WorkerState.DRAINING,
                                     WorkerState.EXITED}),
    WorkerState.READY: frozenset({WorkerState.DRAINING, WorkerState.EXITED}),
    WorkerState.DRAINING: frozenset({WorkerState.EXITED}),
    WorkerState.EXITED: frozenset({WorkerState.RESPAWNING}),
    WorkerState.RESPAWNING: frozenset({WorkerState.STARTING, WorkerState.EXITED}),
}


class BadTransition(Exception):
    pass


def next_state(current: WorkerState, wanted: WorkerState) -> WorkerState:
    """`wanted`, when the table allows it from `current`; anything else raises."""
    if wanted not in _NEXT[current]:
        raise BadTransition(f"worker state {current.value} → {wanted.value}")
    return wanted


#: Respawn backoff: the first retry soon (a crash is usually one bad connection), then
#: doubling, so a worker that cannot start at all costs a log line every few seconds.
RESPAWN_FIRST = 0.1
RESPAWN_MAX = 5.0
#: A worker that ran this long before exiting counts as healthy: the backoff restarts.
RESPAWN_HEALTHY_AFTER = 10.0


def respawn_delay(failures: int) -> float:
    """Seconds to wait before the `failures`-th consecutive respawn (1 = first)."""
    return min(RESPAWN_MAX, RESPAWN_FIRST * 2 ** max(0, failures - 1))
