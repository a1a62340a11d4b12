"""Structured logs: one JSON object per line by default, `text` for humans.

Callers log events with fields (`log.info("conn_close", route=..., bytes_up=...)`); this
module only formats. It never receives payloads or key material by construction: callers
pass metadata fields only, and `MASKED_FIELDS` are replaced if anyone tries.
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: Field names that must never reach a log line with their value.
MASKED_FIELDS = frozenset({"key", "private_key", "body", "payload", "token", "secret"})

_LOGGER = logging.getLogger("pact_ingress")


#: Built once: `json.dumps` with options constructs a new encoder on every call.
_ENCODER = json.JSONEncoder(default=str, separators=(",", ":"))
#: Event names as JSON strings: a handful of names, encoded once each.
_EVENT_JSON: dict[str, str] = {}


def _event_json(event: str) -> str:
    encoded = _EVENT_JSON.get(event)
    if encoded is None:
        if len(_EVENT_JSON) > 1024:  # names are constants in code; bound it anyway
            _EVENT_JSON.clear()
        encoded = _EVENT_JSON[event] = _ENCODER.encode(event)
    return encoded
_LEVEL_NAMES = {logging.DEBUG: "debug", logging.INFO: "info", logging.WARNING: "warning",
                logging.ERROR: "error"}


#: The level and event members of `emit_members` lines, by (level, event), encoded once.
_LINE_HEADS: dict[tuple[int, str], str] = {}


def _json_line(created: float, level: str, event: str, fields: dict[str, Any]) -> str:
    out: dict[str, Any] = {"ts": round(created, 3), "level": level, "event": event}
    out.update(fields)
    return _ENCODER.encode(out)


#: Below this magnitude a float rounded to 3 decimals prints as those 3 decimals: doubles
#: there are closer together than 0.0005, so no shorter decimal names the same double.
_MS_EXACT = 1e12
#: The same for one decimal (a request's milliseconds, `EventLogger.request`): doubles
#: there are closer together than 0.05.
_TENTHS_EXACT = 1e14


#: Below this magnitude a text is kept for the interval of (positive) floats that print
#: as it (`ms_repr`): x * 1000 is below 2**42 there, within 2**-11 of the exact product.
_MS_KEPT = 4e9
#: How far inside its millisecond's rounding interval (in ms) a kept interval ends: four
#: times the error of the products and quotients that bound it, so every float in it
#: rounds to the same millisecond (a value next to a half is not kept at all).
_MS_MARGIN = 0.002
_MS_BELOW_HALF = 0.5 - _MS_MARGIN
_MS_ABOVE_HALF = 0.5 + _MS_MARGIN


def _ms_texts() -> Callable[[float], str]:
    """A `ms_repr`: its own last text and the interval of floats that print as it (one
    tuple, replaced whole: a thread reads a consistent one)."""
    last = (0.0, 0.0, "")

    def ms_repr(x: float) -> str:
        """`repr(round(x, 3))`, the text of a line's seconds (`ts`, durations), at a
        fraction of its cost: `round` and `repr` each run the float-to-decimal
        conversion, repr the arbitrary-precision one, twice per connection line. Format
        `.3f` rounds the same way as `round(x, 3)` (the same correctly rounded
        conversion), and in range, stripping the zeros repr would not print gives repr's
        text. Lines come in bursts, and consecutive timestamps (or durations) mostly fall
        in one millisecond: the last text is kept with the interval of floats that
        round to its millisecond, and a float inside it costs two comparisons."""
        nonlocal last
        low, high, text = last
        if low <= x < high:
            return text
        if not -_MS_EXACT < x < _MS_EXACT:
            return repr(round(x, 3))
        text = f"{x:.3f}".rstrip("0")
        if text[-1] == ".":
            text += "0"
        if 0.0 < x < _MS_KEPT:
            scaled = x * 1000.0
            ms = scaled // 1.0
            fraction = scaled - ms  # (exact: both are below 2**42)
            if fraction > _MS_ABOVE_HALF:
                ms += 1.0
            elif fraction >= _MS_BELOW_HALF or not ms:
                # next to a half, only the decimal conversion can tell; and an interval
                # around 0 would take in -0.0 and the negatives, which print "-0.0"
                return text
            last = ((ms - _MS_BELOW_HALF) / 1000.0, (ms + _MS_BELOW_HALF) / 1000.0, text)
        return text

    return ms_repr


#: Durations (a connection's, a request's) and timestamps: each with its own last text.
ms_repr = _ms_texts()
ts_repr = _ms_texts()


_quote = json.encoder.encode_basestring_ascii  # the C string escaper json itself uses
_HEAD_FIELDS = frozenset({"ts", "level", "event"})


def _access_line(created: float, event: str, fields: dict[str, Any]) -> str:
    """`_json_line` + newline for the access log's flat fields, built as one string:
    the same JSON at a third of the encoder's cost (strings go through json's own
    escaper, numbers through repr; anything else through the encoder)."""
    if not _HEAD_FIELDS.isdisjoint(fields):  # a field that replaces the head: as usual
        return _json_line(created, "info", event, fields) + "\n"
    parts = [f'{{"ts":{ts_repr(created)},"level":"info","event":{_quote(event)}']
    for name, value in fields.items():
        kind = type(value)
        if kind is str:
            parts.append(f',{_quote(name)}:{_quote(value)}')
        elif kind is int or (kind is float and math.isfinite(value)):
            parts.append(f',{_quote(name)}:{value!r}')
        else:
            parts.append(f',{_quote(name)}:{_ENCODER.encode(value)}')
    parts.append("}\n")
    return "".join(parts)


def _write_lines(lines: list[str]) -> None:
    """Lines (each ending in a newline) to the JSON handler's stream in one write."""
    handler = _direct
    if handler is None:
        return
    handler.acquire()
    try:
        handler.stream.write("".join(lines))
        handler.stream.flush()
    except Exception:  # noqa: BLE001 - a log that cannot be written must not stop serving
        pass
    finally:
        handler.release()


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return _json_line(record.created, record.levelname.lower(), record.getMessage(),
                          getattr(record, "fields", {}))


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        return f"{stamp} {record.levelname.lower():5} {record.getMessage()} {fields}".rstrip()


def setup(fmt: str = "json", level: int = logging.INFO, stream: Any = None) -> None:
    """Configure the package logger once (CLI entry points call this)."""
    global _direct, _loop_thread
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    _LOGGER.handlers[:] = [handler]
    _LOGGER.setLevel(level)
    _LOGGER.propagate = False
    _direct = handler if fmt == "json" else None
    _loop_thread = threading.get_ident()
    atexit.unregister(log.flush)
    atexit.register(log.flush)  # the last access lines of a process that exits


#: The JSON handler `setup` installed. While it is the logger's only handler, events are
#: formatted and written straight to its stream: the same line, without building a
#: `LogRecord` (caller lookup, pid, thread name…), which cost half of a log call — and
#: the router writes one per connection.
_direct: logging.StreamHandler[Any] | None = None

#: Access lines wait in memory until this many bytes are buffered…
ACCESS_BUFFER_BYTES = 16 * 1024
#: …or this many seconds have passed (`EventLogger.flush_forever`).
ACCESS_FLUSH_INTERVAL = 0.2
#: The thread that buffers access lines (the one `setup` ran on: the event loop's).
_loop_thread = threading.get_ident()

#: Fields every line of this process carries (a worker process: its index).
_bound: dict[str, Any] = {}


def bind(**fields: Any) -> None:
    """Add `fields` to every line this process logs from now on."""
    global _bound_members, _bound_overlaps_request
    _bound.update(fields)
    _bound_members = members(**_bound) + "," if _bound else ""
    _bound_overlaps_request = not REQUEST_FIELDS.isdisjoint(_bound)


#: `_bound` encoded as JSON object members followed by a comma ("" when nothing is bound).
_bound_members = ""
#: The fields of a request line (`EventLogger.request`), in the order they are written.
REQUEST_FIELDS = frozenset({"route", "client_ip", "method", "path", "status", "ms"})
#: A bound field shares a name with a request line's field: such lines take the general
#: path, which decides which value and which place wins.
_bound_overlaps_request = False


def request_prefix(route: str, client_ip: str) -> str:
    """The constant members of a connection's request lines, for `EventLogger.request`."""
    return f'"route":{_quote(route)},"client_ip":{_quote(client_ip)}'


def members(**fields: Any) -> str:
    """`fields` encoded as JSON object members (`"k":v,...`, no braces): the constant part
    of a line that `EventLogger.emit_members` writes many times."""
    return _ENCODER.encode(fields)[1:-1]


class EventLogger:
    """`log.info("event", field=value, ...)`: one line per call.

    A busy loop that logs per connection (the passthrough engine) may *hold* lines:
    between `hold()` and `release()` the JSON lines its own thread emits are kept and
    then written with one write(2), instead of one write(2) and flush per line — the
    same lines, a batch (milliseconds) later. Other threads always write at once.
    The terminate engine's access lines (`access`) are buffered the same way, bounded
    in bytes and in time."""

    def __init__(self) -> None:
        self._held: list[str] | None = None
        self._holder = 0  # thread ident of the holder
        self._held_info = False  # INFO lines go straight to the JSON handler (`hold`)
        self._access: list[str] = []  # buffered access lines, oldest first
        self._access_bytes = 0

    # -- the access log: buffered, as a web server's access log with a buffer ---------

    def access(self, event: str, **fields: Any) -> None:
        """One line per HTTP request. Lines are buffered and written together once
        `ACCESS_BUFFER_BYTES` are waiting, by `flush_forever` at the latest
        `ACCESS_FLUSH_INTERVAL` later, before any other line (order is kept) and at
        exit: a write(2) per request would cost more than the rest of the line. Only
        the event loop's thread calls this."""
        handler = _direct
        if handler is None or _LOGGER.handlers != [handler] or not _LOGGER.isEnabledFor(
                logging.INFO):
            self._emit(logging.INFO, event, fields)
            return
        if not MASKED_FIELDS.isdisjoint(fields):
            fields = {k: ("MASKED" if k in MASKED_FIELDS else v) for k, v in fields.items()}
        if _bound:
            fields = {**_bound, **fields}
        line = _access_line(time.time(), event, fields)
        self._access.append(line)
        self._access_bytes += len(line)
        if self._access_bytes >= ACCESS_BUFFER_BYTES:
            self.flush()

    def request(self, prefix: str, method: str, path: str, status: int, ms: float) -> None:
        """The terminate engine's access line of one request: the same line as
        `access("request", **fields)` with `fields` = `request_fields(route, client_ip)`
        then method, path, status and `round(ms, 1)`, built as one string. `prefix` is
        what `request_prefix` made of the connection's constant fields (once per
        connection, not per request).
        The milliseconds are written with format `.1f`, the text `repr(round(ms, 1))`
        gives below `_TENTHS_EXACT` (both are the correctly rounded decimal), for half
        the cost: `round` and `repr` each run the arbitrary-precision conversion."""
        handler = _direct
        handlers = _LOGGER.handlers
        if (handler is None or len(handlers) != 1 or handlers[0] is not handler
                or _bound_overlaps_request or not _LOGGER.isEnabledFor(logging.INFO)
                or not -_TENTHS_EXACT < ms < _TENTHS_EXACT):
            self.access("request", **json.loads("{" + prefix + "}"), method=method,
                        path=path, status=status, ms=round(ms, 1))
            return
        line = (f'{{"ts":{ts_repr(time.time())},"level":"info","event":"request",'
                f'{_bound_members}{prefix},"method":{_quote(method)},"path":{_quote(path)},'
                f'"status":{status!r},"ms":{ms:.1f}}}\n')
        self._access.append(line)
        self._access_bytes += len(line)
        if self._access_bytes >= ACCESS_BUFFER_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write the buffered access lines now (one write)."""
        lines = self._access
        if not lines:
            return
        self._access, self._access_bytes = [], 0
        _write_lines(lines)

    async def flush_forever(self) -> None:
        """Bound how long an access line waits in the buffer (a task of the process)."""
        import trio

        try:
            while True:
                await trio.sleep(ACCESS_FLUSH_INTERVAL)
                self.flush()
        finally:
            self.flush()

    def hold(self) -> None:
        """Keep this thread's JSON lines until `release` (no-op for other formats)."""
        if _direct is not None:
            self._held = []
            self._holder = threading.get_ident()
            handlers = _LOGGER.handlers
            # what `emit_members` asks of every INFO line, asked once for the lines held
            # (the handlers and levels do not change while a batch runs)
            self._held_info = (len(handlers) == 1 and handlers[0] is _direct
                               and _LOGGER.isEnabledFor(logging.INFO))

    def release(self) -> None:
        """Write the held lines, one write, and stop holding."""
        held, self._held = self._held, None
        if held:
            _write_lines(held)

    def emit_members(self, level: int, event: str, encoded: str, names: frozenset[str]
                     ) -> bool:
        """Write the line of `event` whose fields are encoded already (`encoded`, as
        `members` builds it; `names`: its field names, none of them masked): the same
        line as `log.info(event, **fields)`, without encoding the constant fields again.
        False, and nothing written, unless lines go straight to the JSON handler and no
        bound field shares a name with them: then the caller logs the usual way."""
        held = self._held
        mine = held is not None and self._holder == threading.get_ident()
        if not (mine and level == logging.INFO and self._held_info):
            handler = _direct
            handlers = _LOGGER.handlers
            if (handler is None or len(handlers) != 1 or handlers[0] is not handler
                    or not _LOGGER.isEnabledFor(level)):
                return False
        if _bound and not names.isdisjoint(_bound):
            return False
        head = _LINE_HEADS.get((level, event))
        if head is None:
            if len(_LINE_HEADS) > 1024:  # event names are constants in code; bound it anyway
                _LINE_HEADS.clear()
            head = _LINE_HEADS[level, event] = (
                f'"level":"{_LEVEL_NAMES.get(level, "info")}","event":{_event_json(event)},')
        line = f'{{"ts":{ts_repr(time.time())},{head}{_bound_members}{encoded}}}\n'
        if mine:
            held.append(line)  # type: ignore[union-attr]
            return True
        handler.acquire()
        try:
            handler.stream.write(line)
            handler.stream.flush()
        except Exception:
            pass
        finally:
            handler.release()
        return True

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if not _LOGGER.isEnabledFor(level):
            return
        if MASKED_FIELDS.isdisjoint(fields):
            clean = fields
        else:
            clean = {k: ("MASKED" if k in MASKED_FIELDS else v) for k, v in fields.items()}
        if _bound:
            clean = {**_bound, **clean}
        handler = _direct
        if handler is not None and _LOGGER.handlers == [handler]:
            if self._access and threading.get_ident() == _loop_thread:
                self.flush()  # the access lines before it happened first
            line = _json_line(time.time(), _LEVEL_NAMES.get(level, "info"), event, clean)
            held = self._held
            if held is not None and self._holder == threading.get_ident():
                held.append(line + "\n")
                return
            handler.acquire()
            try:
                handler.stream.write(line + "\n")
                handler.stream.flush()
            except Exception:
                pass
            finally:
                handler.release()
            return
        _LOGGER.log(level, event, extra={"fields": clean})

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, event, fields)


log = EventLogger()
