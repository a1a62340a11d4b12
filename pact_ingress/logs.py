"""Structured logs: one JSON object per line by default, `text` for humans.

Callers log events with fields (`log.info("conn_close", route=..., bytes_up=...)`); this
module only formats. It never receives payloads or key material by construction: callers
pass metadata fields only, and `MASKED_FIELDS` are replaced if anyone tries.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

#: Field names that must never reach a log line with their value.
MASKED_FIELDS = frozenset({"key", "private_key", "body", "payload", "token", "secret"})

_LOGGER = logging.getLogger("pact_ingress")


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "event": record.getMessage(),
        }
        out.update(getattr(record, "fields", {}))
        return json.dumps(out, default=str, separators=(",", ":"))


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = " ".join(f"{k}={v}" for k, v in getattr(record, "fields", {}).items())
        return f"{stamp} {record.levelname.lower():5} {record.getMessage()} {fields}".rstrip()


def setup(fmt: str = "json", level: int = logging.INFO, stream: Any = None) -> None:
    """Configure the package logger once (CLI entry points call this)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _TextFormatter())
    _LOGGER.handlers[:] = [handler]
    _LOGGER.setLevel(level)
    _LOGGER.propagate = False


class EventLogger:
    """`log.info("event", field=value, ...)`: one line per call."""

    def _emit(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if not _LOGGER.isEnabledFor(level):
            return
        clean = {k: ("MASKED" if k in MASKED_FIELDS else v) for k, v in fields.items()}
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
