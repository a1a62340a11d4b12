"""The edge's seal-posture check for MCP JSON-RPC (spec §13.3/§13.4). Pure.

Theory of operation
-------------------
A terminate route fronts one home node's MCP endpoint. Before anything reaches the
node, :func:`check_request` looks at the HTTP request and returns a decision:

* :class:`Forward` — send it on. ``caller_keys`` holds one entry per call to charge to
  the rate limiter (the I/O layer asks :class:`~pact_ingress.proto.ratelimit.RateLimiter`
  next, then :func:`refuse_rate_limited` if it says no): a sealed call's key is its
  header's ``from``; everything else is ``None`` (the IP budgets alone, spec §12).
* :class:`Refuse` — answer it here with ``http_status``, ``headers`` and ``body``.

What the posture applies to: ``POST`` at or below the route's ``mcp_path``, compared
as ``proto.http_request.in_mcp_scope`` does (normalised path, case-insensitive,
``;params`` dropped, unreserved escapes decoded), so ``/mcp/``, ``//mcp``, ``/MCP``,
``/mcp;x`` or ``/x/../mcp`` — which some backend router may serve as the same
resource — cannot slip past it. Other methods and paths (``GET`` for an SSE stream,
``DELETE`` ending a session, a landing page) are forwarded untouched and cost one
IP-only unit, so no path is unmetered.

The table, per JSON-RPC element:

============================================  ===================  ===================
element                                       ``seal: required``   ``seal: optional``
============================================  ===================  ===================
``initialize``, ``tools/list``, other
methods, notifications, responses             forward              forward
``tools/call`` of any tool but sealed_call    ``seal_required``    forward
``tools/call`` sealed_call, header passes     forward              forward
``tools/call`` sealed_call, header fails      ``envelope_invalid`` ``envelope_invalid``
============================================  ===================  ===================

Decisions this module makes (and tests):

* **HTTP status.** A refusal is an MCP tool error inside a JSON-RPC *result*, so it
  travels as HTTP 200 (``application/json``): that is what MCP clients surface to the
  calling agent. ``rate_limited`` is also 200 for JSON-RPC, with ``retry_after`` in
  ``structuredContent`` and a ``Retry-After`` header; a rate-limited non-JSON-RPC
  request gets a bare 429 with ``Retry-After``.
* **400s.** Wrong or missing ``Content-Type`` (MCP requires ``application/json``; a
  ``charset`` parameter, if any, must name UTF-8, since a node may decode the body with
  it), a body that is not UTF-8 JSON (``-32700``), or not JSON-RPC 2.0 (``-32600``) —
  answered as a JSON-RPC error with id ``null`` (or the element's id when it had a valid
  one). A body that may hold more than ``MAX_JSON_VALUES`` JSON values is an invalid
  request (``-32600``, id ``null``) judged before it is parsed: what a parse builds
  grows with the number of values, not with the bytes the body budgets count, and the
  edge does not forward what it has not judged (so not ``-32700``: the body may well be
  JSON, and no id is known since nothing was read). Duplicate member names are a parse
  error: the node's parser might keep the other
  duplicate, and a parser differential is exactly how a check gets bypassed. For the
  same reason a member of a message (or of a ``tools/call``'s params) whose name differs
  from a JSON-RPC one only in case is an invalid request: parsers that match names
  case-insensitively read ``Method`` as ``method``.
* **Batches** (JSON arrays, ≤ ``MAX_BATCH_ELEMENTS``) are checked element by element.
  If any element is refused the whole batch is refused — nothing of it is forwarded —
  and the answer is a batch with one entry per refused element (its own code) and one
  per other *request* (``bad_request``: not processed because a sibling was refused),
  so every id the client waits for gets an answer. Responses a client posts back to
  the server are never answered (their ids are the server's, not the client's).
* **Notifications** (no ``id``) are checked like requests. A refused notification still
  gets its refusal, with ``"id": null`` — a silent drop would leave a caller that got
  its framing wrong with no clue.
* **Rate limited** JSON-RPC requests get one ``rate_limited`` refusal per request id
  (a batch answer for a batch); a POST carrying only notifications or responses gets a
  single refusal with ``"id": null``.
* **Ids** may be strings, integers or null (JSON-RPC 2.0); floats, booleans and
  structures are invalid requests. Refusals echo the id with its exact type.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pact_ingress.envelope import EnvelopeInvalid, check_header
from pact_ingress.model import Route, SealPosture, Tenant
from pact_ingress.proto.http_request import BadRequest, in_mcp_scope, parse_target

RpcId = str | int | None

#: Batch cap. MCP 2025-06-18 dropped JSON-RPC batching; clients of 2025-03-26 send a
#: handful of messages at most. 100 bounds the per-request work (one header check per
#: element) far above any real batch; the body cap (max_body_bytes) bounds the rest.
MAX_BATCH_ELEMENTS = 100

#: The most JSON values a body to an MCP endpoint may hold (`value_count`, counted before
#: parsing; over it: -32600 Invalid Request, id null). Byte budgets alone do not bound a
#: parse: CPython builds a 64-byte dict for every 2-byte `{}`, so 6 MiB of them peaked at
#: ~155 MiB. Measured on CPython 3.11 (the decoder here, peak RSS of one parse in a fresh
#: process, decoded text included), a body at this cap peaks at ~10 MiB for empty objects
#: or arrays, ~13 MiB for numbers, ~21 MiB for short strings and ~36 MiB for the dearest
#: shape found (one object of distinct keys with 2-character string values, ~143 bytes
#: per counted value); filled up to the relay's 12 MiB with one long string, ~57 MiB. So
#: a parse stays under ~64 MiB whatever the body, while real calls pass with room to
#: spare: a sealed call's envelope is base64 (no counted character at all), a 10 MiB
#: base64 argument counts ~14, and 12 000 records of 7 members (~21 each) ~252 000.
MAX_JSON_VALUES = 256 * 1024

SEALED_CALL = "sealed_call"
JSON_CONTENT_TYPE = "application/json"

PARSE_ERROR = -32700
INVALID_REQUEST = -32600

#: Codes used here; all are spec §12 codes.
SEAL_REQUIRED = "seal_required"
ENVELOPE_INVALID = "envelope_invalid"
RATE_LIMITED = "rate_limited"
BAD_REQUEST = "bad_request"

_WHY_SEAL_REQUIRED = (
    "this node accepts substantive calls only sealed (X-PACT-SEAL: required); "
    "send the call inside sealed_call"
)
_WHY_SIBLING = "not processed: another call in the same batch was refused"
_JSON_HEADERS = (("content-type", JSON_CONTENT_TYPE),)


@dataclass(frozen=True)
class McpRequest:
    """The parts of an HTTP request the posture looks at."""

    method: str  # HTTP method
    path: str  # request target (path, optionally with ?query)
    content_type: str | None
    body: bytes


@dataclass(frozen=True)
class Policy:
    """A terminate route's posture: seal requirement, MCP path, the tenant's pins."""

    seal: SealPosture
    mcp_path: str
    pins: tuple[str, ...]

    @classmethod
    def for_route(cls, route: Route, tenant: Tenant) -> Policy:
        return cls(route.seal, route.mcp_path, tuple(tenant.pins))


@dataclass(frozen=True)
class Forward:
    """Send the request on after charging one rate-limit unit per `caller_keys` entry.

    `rpc_ids` are the ids of the request elements (what a rate_limited refusal
    answers); `jsonrpc` is False for requests the posture does not apply to.
    """

    caller_keys: tuple[str | None, ...]
    rpc_ids: tuple[RpcId, ...] = ()
    jsonrpc: bool = False
    batch: bool = False


@dataclass(frozen=True)
class Refuse:
    """Answer here. `code` is the first refusal's spec §12 code (for metrics/logs);
    `detail` is a log line that names no body content beyond method and tool names."""

    code: str
    http_status: int
    detail: str
    rpc_ids: tuple[RpcId, ...]
    body: bytes
    headers: tuple[tuple[str, str], ...] = _JSON_HEADERS


Decision = Forward | Refuse


class _Invalid(Exception):
    """Body is not JSON (`PARSE_ERROR`) or not JSON-RPC (`INVALID_REQUEST`)."""

    def __init__(self, rpc_code: int, message: str, rpc_id: RpcId = None) -> None:
        super().__init__(message)
        self.rpc_code, self.message, self.rpc_id = rpc_code, message, rpc_id


@dataclass(frozen=True)
class _Element:
    kind: Literal["request", "notification", "response"]
    rpc_id: RpcId
    label: str  # method (and tool) for the log line
    caller_key: str | None = None
    refusal: tuple[str, str] | None = None  # (code, why)

    @property
    def reply_id(self) -> RpcId:
        """The id a reply to this element carries: a response's id is the server's."""
        return self.rpc_id if self.kind == "request" else None


# --- public API --------------------------------------------------------------------------


def check_request(req: McpRequest, policy: Policy, now: float) -> Decision:
    """Apply the seal posture (the table in the module docstring) to one HTTP request."""
    if req.method.upper() != "POST" or not _in_scope(req.path, policy.mcp_path):
        return Forward(caller_keys=(None,))
    try:
        _check_content_type(req.content_type)
        message = _parse(req.body)
        batch = isinstance(message, list)
        elements = [_classify(m, policy, now) for m in _elements(message)]
    except _Invalid as exc:
        return _invalid(exc)
    refused = [e for e in elements if e.refusal is not None]
    if refused:
        return _refuse(elements, batch)
    return Forward(
        caller_keys=tuple(e.caller_key for e in elements),
        rpc_ids=tuple(e.rpc_id for e in elements if e.kind == "request"),
        jsonrpc=True,
        batch=batch,
    )


def refusal_result(code: str, why: str, retry_after: int | None = None) -> dict[str, Any]:
    """The MCP tool error a refusal carries, as a JSON-RPC `result` value."""
    structured: dict[str, Any] = {"code": code}
    if retry_after is not None:
        structured["retry_after"] = retry_after
    return {
        "isError": True,
        "content": [{"type": "text", "text": f"{code}: {why}"}],
        "structuredContent": structured,
    }


def refuse_rate_limited(forward: Forward, retry_after: int) -> Refuse:
    """The answer for a request `check_request` forwarded but the rate limiter refused."""
    retry_after = max(1, int(retry_after))
    why = f"over the call budget; retry after {retry_after} s"
    headers = (("retry-after", str(retry_after)),)
    detail = f"{RATE_LIMITED}: retry after {retry_after} s"
    if not forward.jsonrpc:
        body = f"{RATE_LIMITED}: {why}\n".encode()
        text_headers = (("content-type", "text/plain; charset=utf-8"), *headers)
        return Refuse(RATE_LIMITED, 429, detail, (), body, text_headers)
    result = refusal_result(RATE_LIMITED, why, retry_after)
    ids: tuple[RpcId, ...] = forward.rpc_ids or (None,)
    replies = [_reply(i, result) for i in ids]
    payload: Any = replies if forward.batch else replies[0]
    return Refuse(RATE_LIMITED, 200, detail, ids, _dump(payload), _JSON_HEADERS + headers)


# --- path and content type ---------------------------------------------------------------


def _in_scope(target: str, mcp_path: str) -> bool:
    """Is `target` the MCP endpoint or below it (`proto.http_request.in_mcp_scope`)?"""
    try:
        path = parse_target(target.encode("latin-1")).path
    except BadRequest:
        return True  # unreadable: judged (and refused) rather than waved through
    return in_mcp_scope(path, mcp_path)


#: The charset values a body may declare: every decoder reads these as UTF-8.
_UTF8_NAMES = frozenset({"utf-8", "utf8"})


def _check_content_type(content_type: str | None) -> None:
    media, *params = (content_type or "").split(";")
    if media.strip().lower() != JSON_CONTENT_TYPE:
        raise _Invalid(INVALID_REQUEST, "Invalid Request: Content-Type must be application/json")
    # The body is judged as UTF-8, but a node may decode it with the declared charset
    # (the MCP TypeScript SDK does, through iconv-lite): under UTF-7 `+AHQ-ools/call` is
    # `tools/call`. So any charset parameter, however spelt and however many, must name
    # UTF-8; splitting on every ";" can only find more of them than a real parser would.
    for param in params:
        name, _, value = param.partition("=")
        if (name.strip().lower().startswith("charset")
                and value.strip().strip('"').lower() not in _UTF8_NAMES):
            raise _Invalid(INVALID_REQUEST, "Invalid Request: the body must be UTF-8")


# --- parsing -----------------------------------------------------------------------------


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        raise ValueError("duplicate member name")
    return obj


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: NaN and Infinity are not JSON (echoed back, they would make an answer no JSON either);
#: a member named twice has no one reading (the node's parser may keep the other one).
_decode = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants).decode


class TooManyValues(ValueError):
    """The body may hold more than `MAX_JSON_VALUES` JSON values: refused unparsed.

    A ValueError, so a caller that only knows "not JSON" still refuses it."""


def value_count(body: bytes) -> int:
    """An upper bound on what parsing `body` builds, counted at C speed without parsing.

    Every JSON value after the first is preceded by a `,` (the next element or member)
    or a `:` (a member's value), and the containers, the dearest values to build, count
    once more for their `{` or `[`. The same characters inside strings are counted too:
    the count can only be too high, which refuses a body, never too low, which would
    let one be parsed."""
    return body.count(b",") + body.count(b":") + body.count(b"{") + body.count(b"[")


def loads(body: bytes) -> Any:
    """A request body as JSON, as every MCP endpoint of the edge reads one (the terminate
    posture here, the relay host through `proto.relay.loads`): UTF-8, no NaN or
    Infinity, no member named twice, at most `MAX_JSON_VALUES` values by `value_count`.

    Raises `TooManyValues` before anything is decoded or parsed when the count is over
    the cap; ValueError (UnicodeError, JSONDecodeError) or RecursionError otherwise."""
    if value_count(body) > MAX_JSON_VALUES:
        raise TooManyValues(f"more than {MAX_JSON_VALUES} JSON values")
    return _decode(body.decode("utf-8"))


def _parse(body: bytes) -> Any:
    try:
        return loads(body)
    except TooManyValues as exc:
        raise _Invalid(INVALID_REQUEST, f"Invalid Request: {exc}") from None
    except (ValueError, RecursionError) as exc:  # UnicodeError, JSONDecodeError included
        raise _Invalid(PARSE_ERROR, "Parse error") from exc


def _elements(message: Any) -> list[Any]:
    if not isinstance(message, list):
        return [message]
    if not message:
        raise _Invalid(INVALID_REQUEST, "Invalid Request: empty batch")
    if len(message) > MAX_BATCH_ELEMENTS:
        raise _Invalid(INVALID_REQUEST, f"Invalid Request: batch over {MAX_BATCH_ELEMENTS}")
    return message


#: Member names the table reads: of a message, and of a tools/call's params.
_RPC_MEMBERS = frozenset({"jsonrpc", "id", "method", "params", "result", "error"})
_CALL_MEMBERS = frozenset({"name", "arguments"})


def _exact_names(obj: dict[str, Any], names: frozenset[str], rpc_id: RpcId) -> None:
    """Refuse a member spelt like one of `names` but for case, or but for what follows a
    NUL. Go's encoding/json (as any Go node may use) matches member names case-insensitively,
    folding U+017F and U+212A onto `s` and `k` too, the last match winning: to it
    `Method` or `paramſ` is the member the edge judged, or replaces it. A parser that
    keeps names as C strings reads `method<NUL>x` as `method` the same way."""
    for key in obj:
        if key not in names and key.partition("\0")[0].casefold() in names:
            raise _Invalid(INVALID_REQUEST,
                           "Invalid Request: a member name differs from a JSON-RPC one "
                           "only in case", rpc_id)


def _valid_id(value: object) -> bool:
    return value is None or isinstance(value, str) or (
        isinstance(value, int) and not isinstance(value, bool)
    )


def _jsonrpc_shape(message: Any) -> tuple[Literal["request", "notification", "response"], RpcId]:
    """Validate one JSON-RPC 2.0 message; return its kind and id."""
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        raise _Invalid(INVALID_REQUEST, "Invalid Request: not a JSON-RPC 2.0 message")
    rpc_id = message.get("id")
    if not _valid_id(rpc_id):
        raise _Invalid(INVALID_REQUEST, "Invalid Request: id must be a string, integer or null")
    _exact_names(message, _RPC_MEMBERS, rpc_id)
    if "method" in message:
        if not isinstance(message["method"], str):
            raise _Invalid(INVALID_REQUEST, "Invalid Request: method is not a string", rpc_id)
        if not isinstance(message.get("params", {}), (dict, list)):
            raise _Invalid(INVALID_REQUEST, "Invalid Request: params is not a structure", rpc_id)
        return ("request" if "id" in message else "notification"), rpc_id
    if "id" in message and (("result" in message) != ("error" in message)):
        return "response", rpc_id
    raise _Invalid(INVALID_REQUEST, "Invalid Request: neither a request nor a response", rpc_id)


#: Method and tool names are caller-chosen: log lines carry at most this much of them.
MAX_LOGGED_NAME = 64


def _loggable(name: str) -> str:
    """A caller-chosen name made safe for a log line: printable ASCII, bounded."""
    cleaned = "".join(c if " " < c < "\x7f" else "?" for c in name[:MAX_LOGGED_NAME])
    return cleaned + ("…" if len(name) > MAX_LOGGED_NAME else "")


# --- the table ---------------------------------------------------------------------------


def _classify(message: Any, policy: Policy, now: float) -> _Element:
    kind, rpc_id = _jsonrpc_shape(message)
    if kind == "response" or message["method"] != "tools/call":
        return _Element(kind, rpc_id, _loggable(message.get("method", "response")))
    params = message.get("params")
    if isinstance(params, dict):
        _exact_names(params, _CALL_MEMBERS, rpc_id)
    tool = params.get("name") if isinstance(params, dict) else None
    label = f"tools/call {_loggable(tool) if isinstance(tool, str) else '?'}"
    if tool != SEALED_CALL:
        if policy.seal == "required":
            return _Element(kind, rpc_id, label, refusal=(SEAL_REQUIRED, _WHY_SEAL_REQUIRED))
        return _Element(kind, rpc_id, label)
    assert isinstance(params, dict)
    try:
        header = check_header(params.get("arguments"), now=now, recipient_pins=policy.pins)
    except EnvelopeInvalid as exc:
        return _Element(kind, rpc_id, label, refusal=(ENVELOPE_INVALID, exc.reason))
    return _Element(kind, rpc_id, label, caller_key=header.sender)


# --- answers -----------------------------------------------------------------------------


def _dump(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":")).encode()


def _reply(rpc_id: RpcId, result: dict[str, Any]) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rpc_id, "result": result}


def _invalid(exc: _Invalid) -> Refuse:
    error = {"code": exc.rpc_code, "message": exc.message}
    body = _dump({"jsonrpc": "2.0", "id": exc.rpc_id, "error": error})
    return Refuse(BAD_REQUEST, 400, f"{BAD_REQUEST}: {exc.message}", (exc.rpc_id,), body)


def _answers(elements: Iterable[_Element]) -> list[tuple[RpcId, str, str]]:
    """(id, code, why) for every element that gets an answer in a refused request."""
    answers = []
    for element in elements:
        if element.refusal is not None:
            answers.append((element.reply_id, *element.refusal))
        elif element.kind == "request":
            answers.append((element.rpc_id, BAD_REQUEST, _WHY_SIBLING))
    return answers


def _refuse(elements: list[_Element], batch: bool) -> Refuse:
    answers = _answers(elements)
    replies = [_reply(rpc_id, refusal_result(code, why)) for rpc_id, code, why in answers]
    first = next(e for e in elements if e.refusal is not None)
    assert first.refusal is not None
    code, why = first.refusal
    detail = f"{code}: {first.label}: {why}"
    if batch:
        detail += f" (batch of {len(elements)} refused)"
    payload: Any = replies if batch else replies[0]
    return Refuse(code, 200, detail, tuple(a[0] for a in answers), _dump(payload))
