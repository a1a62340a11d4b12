"""The CLI's side of the admin endpoint: synchronous requests and a terminal rendering.

`pact-ingress status` and `pact-ingress certs renew` talk to the running instance through
`listen.admin`. These are one-shot commands, so this is plain stdlib `http.client` (no
event loop, no dependency); a unix-socket admin address uses a small `HTTPConnection`
subclass whose `connect()` opens an AF_UNIX stream instead of TCP. Every failure becomes
an `AdminError` whose message names the address, so the CLI prints one line.
"""

from __future__ import annotations

import http.client
import json
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pact_ingress.errors import UNPRINTABLE, PactIngressError
from pact_ingress.model import Address

#: Largest admin response we read; a status document of thousands of routes is ~1 MiB.
MAX_RESPONSE_BYTES = 16 * 1024 * 1024


class AdminError(PactIngressError):
    """The admin endpoint could not be reached or answered something unusable."""


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP/1.1 over a unix stream socket (the Host header says `localhost`)."""

    def __init__(self, path: str | Path, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.unix_path = str(path)

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _connection(listen: Address | Path, timeout: float) -> http.client.HTTPConnection:
    if isinstance(listen, Path):
        return UnixHTTPConnection(listen, timeout)
    return http.client.HTTPConnection(listen.host, listen.port, timeout=timeout)


def _where(listen: Address | Path) -> str:
    return f"unix:{listen}" if isinstance(listen, Path) else f"http://{listen}"


def request(
    listen: Address | Path, method: str, path: str, *,
    timeout: float = 5, token: str | None = None,
) -> tuple[int, bytes]:
    """One request; returns (status, body). Raises AdminError when unreachable."""
    conn = _connection(listen, timeout)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        body = resp.read(MAX_RESPONSE_BYTES + 1)
    except (OSError, http.client.HTTPException) as exc:
        raise AdminError(f"admin endpoint {_where(listen)} not reachable: {exc}") from exc
    finally:
        conn.close()
    if len(body) > MAX_RESPONSE_BYTES:
        raise AdminError(f"admin endpoint {_where(listen)}: response over {MAX_RESPONSE_BYTES} B")
    return resp.status, body


def _json(listen: Address | Path, status: int, body: bytes) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise AdminError(f"admin endpoint {_where(listen)}: HTTP {status}, not JSON") from exc
    if not isinstance(data, dict):
        raise AdminError(f"admin endpoint {_where(listen)}: HTTP {status}, not a JSON object")
    return data


def fetch_status(
    listen: Address | Path, timeout: float = 5, *, token: str | None = None
) -> dict[str, Any]:
    """GET /status as a dict (see `schema.STATUS_SCHEMA`)."""
    status, body = request(listen, "GET", "/status", timeout=timeout, token=token)
    if status != 200:
        raise AdminError(f"admin endpoint {_where(listen)}: GET /status answered {status}: "
                         f"{body[:200].decode(errors='replace')}")
    return _json(listen, status, body)


def post(
    listen: Address | Path, path: str, timeout: float = 120, *, token: str | None = None
) -> dict[str, Any]:
    """POST to an action endpoint (/reload, /certs/renew?host=H) → its JSON answer.

    The answer's `ok` tells success; HTTP 422 (refused) still returns the JSON so the CLI
    can print the `message`. The default timeout is long because a renewal orders a cert.
    """
    status, body = request(listen, "POST", path, timeout=timeout, token=token)
    if status in (401, 403, 404, 405):
        raise AdminError(f"admin endpoint {_where(listen)}: POST {path} answered {status}")
    return _json(listen, status, body)


# ---- terminal rendering --------------------------------------------------------------

#: The characters error messages escape (C0 and C1 controls, DEL, line separators): a
#: value printed raw could move the cursor, retitle or clear the operator's terminal (a
#: CA's error text reaches `last_error`), or split a table's row.
_CONTROLS = dict.fromkeys(UNPRINTABLE, "?")


def clean_text(text: str) -> str:
    """`text` with every control character shown as '?' (safe to print to a terminal)."""
    return text.translate(_CONTROLS)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return clean_text(str(value))


def _table(title: str, headers: tuple[str, ...], rows: list[tuple[Any, ...]]) -> list[str]:
    out = [f"{title}:"]
    if not rows:
        return out + ["  (none)"]
    cells = [tuple(_cell(v) for v in row) for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    fmt = "  " + "  ".join(f"{{:<{w}}}" for w in widths)
    out.append(fmt.format(*(h.upper() for h in headers)).rstrip())
    out += [fmt.format(*r).rstrip() for r in cells]
    return out


def _when(at: Any) -> str:
    if not isinstance(at, (int, float)):
        return "-"
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def format_status(d: dict[str, Any]) -> str:
    """A readable plain-text rendering of a status document for `pact-ingress status`.

    Whatever answers on the admin address is rendered: a document of another shape is
    an `AdminError`, and no control character from it reaches the terminal."""
    try:
        return _format_status(d)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise AdminError(f"the admin endpoint's status document has an unexpected shape "
                         f"({type(exc).__name__})") from exc


def _format_status(d: dict[str, Any]) -> str:
    uptime = _cell(round(d.get("uptime_s", 0)))
    version, config = _cell(d.get("version", "?")), _cell(d.get("config", "?"))
    lines = [f"pact-ingress {version}, up {uptime}s, config {config}", ""]
    lines += _table("routes", ("host", "tenant", "mode", "backend", "seal"),
                    [(r.get("host"), r.get("tenant"), r.get("mode"), r.get("backend"),
                      r.get("seal")) for r in d.get("routes", [])])
    lines += [""] + _table("tunnels", ("tenant", "state", "connections", "peer", "since"),
                           [(t.get("tenant"), t.get("state"), t.get("connections"),
                             t.get("peer"), t.get("since")) for t in d.get("tunnels", [])])
    lines += [""] + _table("certificates", ("host", "issuer", "not_after", "next_renewal",
                                            "last_error"),
                           [(c.get("host"), c.get("issuer"), c.get("not_after"),
                             c.get("next_renewal"), c.get("last_error"))
                            for c in d.get("certs", [])])
    relay = d.get("relay")
    if isinstance(relay, dict):
        state = ("ok" if relay.get("healthy")
                 else f"UNAVAILABLE: {_cell(relay.get('last_error'))}")
        store = _cell(relay.get("store"))
        lines += ["", f"relay {_cell(relay.get('host'))}: store {store} {state}"]
        if relay.get("persistence_warning"):
            lines.append("WARNING: relay store can lose items: "
                         f"{_cell(relay['persistence_warning'])}")
        lines += _table("relay queues", ("tenant", "recipient", "items", "bytes"),
                        [(q.get("tenant"), q.get("recipient"), q.get("items"), q.get("bytes"))
                         for q in relay.get("queues", [])])
    if d.get("workers"):
        lines += [""] + _table("workers", ("index", "pid", "state", "restarts", "open",
                                           "requests"),
                               [(w.get("index"), w.get("pid"), w.get("state"),
                                 w.get("restarts"), w.get("open_connections"),
                                 w.get("requests")) for w in d["workers"]])
    lines += [""] + _table("counters", ("name", "value"),
                           sorted(d.get("counters", {}).items()))
    refusals = d.get("recent_refusals", [])[-10:]
    lines += [""] + _table("recent refusals", ("time", "route", "client", "reason"),
                           [(_when(r.get("at")), r.get("route"), r.get("client_ip"),
                             r.get("reason")) for r in reversed(refusals)])
    return "\n".join(lines)
