"""The admin status page: one server-rendered HTML document, no scripts, no external assets.

Rendered from the same `/status` document the JSON endpoint returns, so the page can never
show something the API does not. Every value that comes from config or from the network
(hostnames, tenant names, refusal reasons, client addresses, error texts) passes through
`html.escape`; the only markup is the literal template here. Time is an input (`now`) so
"expires in N days" is testable without a clock.
"""

from __future__ import annotations

import html
from datetime import UTC, datetime
from typing import Any

#: A certificate with fewer days left than this is highlighted as a warning.
CERT_WARN_DAYS = 14

#: Refusals shown on the page (the status document may hold more).
PAGE_REFUSALS = 20

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;background:#f4f5f7;
color:#1d2330}
header{background:#1d2330;color:#fff;padding:14px 28px;display:flex;gap:24px;align-items:baseline;
flex-wrap:wrap}
header h1{font-size:18px;margin:0}header span{color:#b8c0d0}
main{padding:8px 28px 28px;max-width:1200px}
section{background:#fff;border:1px solid #dde1e8;border-radius:6px;margin:16px 0;
padding:4px 16px 12px}
h2{font-size:15px;margin:12px 0 8px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 10px 5px 0;border-bottom:1px solid #eef0f4;vertical-align:top}
th{font-weight:600;color:#5a6375;font-size:12px;text-transform:uppercase;letter-spacing:.03em}
code{font:12px ui-monospace,SFMono-Regular,Menlo,monospace;white-space:nowrap}
.pins code{white-space:normal;overflow-wrap:anywhere}.t{white-space:nowrap}
.err{color:#9b1c1c;font-weight:600}
.badge{display:inline-block;padding:1px 8px;border-radius:10px;font-size:12px;font-weight:600}
.up,.ok{background:#dff3e4;color:#17622c}.down,.bad{background:#fbe1e1;color:#9b1c1c}
.warn{background:#fff1cc;color:#7a5600}.muted{color:#8a93a5}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:16px 0 0}
.card{background:#fff;border:1px solid #dde1e8;border-radius:6px;padding:8px 14px;min-width:120px}
.card b{display:block;font-size:20px}.card span{color:#5a6375;font-size:12px}
"""

#: Counters promoted to the summary cards at the top (name in the status document → label).
_CARDS = (
    ("open_connections", "open connections"),
    ("connections_total", "connections"),
    ("http_requests_total", "HTTP requests"),
    ("refusals_total", "refusals"),
    ("rejections_total", "rejected before routing"),
)


def _e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def _table(headers: tuple[str, ...], rows: list[list[str]], empty: str) -> str:
    """A table of already-escaped cells; a muted line when there are no rows."""
    if not rows:
        return f'<p class="muted">{_e(empty)}</p>'
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _section(title: str, content: str, anchor: str) -> str:
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>{content}</section>'


def _badge(text: str, kind: str) -> str:
    return f'<span class="badge {kind}">{_e(text)}</span>'


def _parse_iso(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        dt = datetime.fromisoformat(value)
    except ValueError:
        return None
    return dt if dt.tzinfo else dt.replace(tzinfo=UTC)


def _time(value: Any) -> str:
    """An ISO 8601 timestamp shown as 'YYYY-MM-DD HH:MMZ', kept on one line."""
    dt = _parse_iso(value)
    if dt is None:
        return _e(value or "—")
    text = dt.astimezone(UTC).strftime("%Y-%m-%d %H:%MZ")
    return f'<span class="t" title="{_e(value)}">{_e(text)}</span>'


def _duration(seconds: float) -> str:
    s = int(max(seconds, 0))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    return f"{minutes}m {s}s"


def _routes(status: dict[str, Any]) -> str:
    rows = [
        [f"<code>{_e(r.get('host'))}</code>", _e(r.get("tenant")), _e(r.get("mode")),
         _e(r.get("backend")), _e(r.get("seal") or "—")]
        for r in status.get("routes", [])
    ]
    return _table(("host", "tenant", "mode", "backend", "seal"), rows, "No routes configured.")


def _tenants(status: dict[str, Any]) -> str:
    rows = [
        [_e(t.get("name")),
         '<span class="pins">' + "<br>".join(f"<code>{_e(p)}</code>" for p in t.get("pins", []))
         + "</span>",
         _e(t.get("tunnels_up", 0))]
        for t in status.get("tenants", [])
    ]
    return _table(("tenant", "pins", "tunnels up"), rows, "No tenants configured.")


def _tunnels(status: dict[str, Any]) -> str:
    rows = []
    for t in status.get("tunnels", []):
        state = t.get("state")
        rows.append([
            _e(t.get("tenant")),
            _badge("up" if state == "up" else "down", "up" if state == "up" else "down"),
            _e(t.get("connections", 0)), _e(t.get("streams", "—")),
            _e(t.get("peer") or "—"), _time(t.get("since")),
        ])
    return _table(("tenant", "state", "connections", "streams", "peer", "since"), rows,
                  "No tunnel routes.")


def _cert_expiry(cert: dict[str, Any], now: float) -> str:
    not_after = _parse_iso(cert.get("not_after"))
    if not_after is None:
        return _badge("not issued", "bad")
    left = not_after.timestamp() - now
    if left <= 0:
        return _badge("expired", "bad") + " " + _time(cert.get("not_after"))
    kind = "warn" if left < CERT_WARN_DAYS * 86400 else "ok"
    return f"{_time(cert.get('not_after'))} {_badge('in ' + _duration(left), kind)}"


def _certs(status: dict[str, Any], now: float) -> str:
    rows = [
        [f"<code>{_e(c.get('host'))}</code>", _e(c.get("issuer") or "—"), _cert_expiry(c, now),
         _time(c.get("next_renewal")),
         f'<span class="err">{_e(c["last_error"])}</span>' if c.get("last_error") else "—"]
        for c in status.get("certs", [])
    ]
    return _table(("host", "issuer", "expires", "next renewal", "last error"), rows,
                  "No certificates managed.")


def _refusals(status: dict[str, Any]) -> str:
    recent = list(status.get("recent_refusals", []))[-PAGE_REFUSALS:]
    rows = []
    for r in reversed(recent):  # newest first
        at = r.get("at")
        when = (datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%SZ")
                if isinstance(at, (int, float)) else "—")
        rows.append([f'<span class="t">{_e(when)}</span>', _e(r.get("route")),
                     f"<code>{_e(r.get('client_ip'))}</code>", _e(r.get("reason"))])
    return _table(("time (UTC)", "route", "client", "reason"), rows, "No refusals recorded.")


def _relay(status: dict[str, Any]) -> str:
    relay = status.get("relay")
    if not isinstance(relay, dict):
        return "<p>No relay configured.</p>"
    state = _badge("store ok", "ok") if relay.get("healthy") else _badge(
        f"store unavailable: {relay.get('last_error') or '?'}", "bad")
    if relay.get("persistence_warning"):
        state += " " + _badge(f"can lose items: {relay['persistence_warning']}", "bad")
    rows = [[_e(q.get("tenant") or "—"), f"<code>{_e(q.get('recipient'))}</code>",
             _number(q.get("items")), _number(q.get("bytes"))]
            for q in relay.get("queues", [])]
    return (f"<p><code>{_e(relay.get('host'))}</code> {state}</p>"
            + _table(("tenant", "recipient", "queued items", "queued bytes"), rows,
                     "No queued items."))


def _workers(status: dict[str, Any]) -> str:
    rows = []
    for w in status.get("workers", []):
        state = w.get("state")
        kind = "up" if state == "ready" else "down" if state in ("exited", "respawning") \
            else "warn"
        started = w.get("started")
        when = datetime.fromtimestamp(started, UTC).isoformat() \
            if isinstance(started, (int, float)) else None
        rows.append([_e(w.get("index")), _e(w.get("pid") or "—"), _badge(str(state), kind),
                     _time(when), _number(w.get("restarts")),
                     _number(w.get("open_connections")), _number(w.get("requests"))])
    return _table(("worker", "pid", "state", "started", "restarts", "open connections",
                   "requests"), rows, "")


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return _e(value)


def _counters(status: dict[str, Any]) -> str:
    counters = status.get("counters", {})
    rows = [[f"<code>{_e(k)}</code>", _number(v)] for k, v in sorted(counters.items())]
    return _table(("counter", "value"), rows, "No counters.")


def _cards(status: dict[str, Any]) -> str:
    counters = status.get("counters", {})
    tunnels = status.get("tunnels", [])
    up = sum(1 for t in tunnels if t.get("state") == "up")
    cards = [f"<div class=card><b>{up}/{len(tunnels)}</b><span>tunnels up</span></div>"]
    cards += [
        f"<div class=card><b>{_number(counters[k])}</b><span>{_e(label)}</span></div>"
        for k, label in _CARDS if k in counters
    ]
    return '<div class="cards">' + "".join(cards) + "</div>"


def render_page(status: dict[str, Any], *, now: float) -> str:
    """The whole status page for one `/status` document; `now` is unix seconds."""
    uptime = status.get("uptime_s")
    head = (
        f"<h1>pact-ingress</h1><span>version {_e(status.get('version'))}</span>"
        f"<span>up {_e(_duration(uptime) if isinstance(uptime, (int, float)) else '?')}</span>"
        f"<span>config <code>{_e(status.get('config'))}</code></span>"
    )
    body = "".join([
        _cards(status),
        _section("Routes", _routes(status), "routes"),
        _section("Tenants", _tenants(status), "tenants"),
        _section("Tunnels", _tunnels(status), "tunnels"),
        _section("Certificates", _certs(status, now), "certs"),
        _section("Relay", _relay(status), "relay"),
        _section("Worker processes", _workers(status), "workers") if status.get("workers")
        else "",
        _section("Recent refusals", _refusals(status), "refusals"),
        _section("Counters", _counters(status), "counters"),
    ])
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        "<meta name=viewport content='width=device-width,initial-scale=1'>"
        f"<title>pact-ingress status</title><style>{_CSS}</style></head>"
        f"<body><header>{head}</header><main>{body}</main></body></html>"
    )
