"""The relay's rules (PACT §9), sans-I/O: what a relay_call must prove, tool arguments,
allow-lists, and the answers — values in, values or refusals out.

Theory of operation
-------------------
A relay stores sealed calls for recipients that are offline and never opens them. What it
can and must check comes from the envelope's public parts and the caller's TLS key:

1. the envelope's shape and protected header (`envelope.decode_header`: canonical JSON,
   exactly the nine members, v, suite, fingerprint shapes, non-empty msg_id);
2. ``cty`` is a call (a result envelope is never queued);
3. ``from`` is the caller: the TLS client key is the only identity a relay has, and a
   caller that could queue under another fingerprint could impersonate it to the node;
4. ``sig`` verifies under that key over ``protected ‖ enc ‖ ct`` — the signature covers the
   ciphertext, which is what lets us verify without a private key;
5. time: ``now < exp`` and ``exp − ts`` ≤ 30 days (no |now − ts| bound: relayed calls are
   bounded by exp alone);
6. ``to`` is a served recipient *and* ``from`` is on its allow-list.

Steps 1–5 depend only on the envelope and the caller, never on whom we serve; step 6 is
last and both of its failures produce one and the same refusal (`PERMISSION_DENIED`), so
the answers cannot tell an unknown recipient from an unlisted sender. Every failure of
1–5 is ``envelope_invalid`` with the reason from `envelope.py`.

The relay only serves sealed calls. A recipient at ``X-PACT-SEAL: none`` would need the
1.0-style unsealed form, but no configuration can say a tenant is at ``none`` (terminate
routes refuse it, passthrough routes carry no seal posture), so every served recipient
is at ``optional`` or ``required`` and MUST get sealed relay calls: arguments that are
not an envelope but look like an unsealed call (``method``/``params``) get
``seal_required``; anything else is ``envelope_invalid``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pact_ingress.envelope import (
    CALL_CTY,
    ENVELOPE_MEMBERS,
    MAX_LIFETIME,
    EnvelopeInvalid,
    Header,
    canonical_envelope,
    check_time,
    decode_signed,
    suite_for,
    verify_decoded,
)
from pact_ingress.identity import PublicKey, is_pin
from pact_ingress.proto import posture
from pact_ingress.proto.posture import MAX_JSON_VALUES, TooManyValues

#: Largest envelope (its four members as compact JSON) the relay queues. PACT's largest
#: inline payload is 5 MiB of media (§12); base64 in the call, sealed, then base64url on
#: the wire makes that ~9 MiB. 12 MiB leaves room for the rest of the call.
MAX_ENVELOPE_BYTES = 12 * 1024 * 1024
#: A request body to /relay/mcp: one envelope plus JSON-RPC framing.
MAX_REQUEST_BYTES = MAX_ENVELOPE_BYTES + 64 * 1024
#: fetch_queued page size when the caller names none, and the most one page holds.
DEFAULT_PAGE = 100
MAX_PAGE = 1000
#: A page also stops once it holds this many envelope bytes (always at least one item),
#: so a page of large items stays a bounded response.
MAX_PAGE_BYTES = 16 * 1024 * 1024
#: ids one ack may name (a page's worth, and then some).
MAX_ACK_IDS = MAX_PAGE
#: Senders on one recipient's allow-list: a node's active contacts; far above a person's.
MAX_ALLOWLIST = 10_000
#: A full queue's answer: try again in this many seconds. Space comes back only when the
#: recipient fetches and acks, which a woken node does within seconds and a polling one
#: within its poll interval; a minute neither hammers us nor strands the sender.
FULL_RETRY_AFTER = 60

#: A queued item lives at most this long (spec §9: min(exp, 30 days) from queueing).
MAX_RETENTION = MAX_LIFETIME

PERMISSION_DENIED = "permission_denied"
ENVELOPE_INVALID = "envelope_invalid"
IDENTITY_REQUIRED = "identity_required"
SEAL_REQUIRED = "seal_required"
RATE_LIMITED = "rate_limited"
TOO_LARGE = "too_large"
UNAVAILABLE = "unavailable"
BAD_REQUEST = "bad_request"

#: The one text a permission refusal carries, whichever of its two causes it was.
PERMISSION_DENIED_TEXT = "the relay does not accept this sender for this recipient"


def sender_share(max_items: int, max_bytes: int) -> tuple[int, int]:
    """The (items, bytes) one sender may hold of a recipient's queue bounds: half of
    each, rounded up, at least one item. The whole-queue bounds alone are first come,
    first served, so one allowed sender could fill the queue and leave every other
    allowed sender refused until the node acks; with half each, one sender alone never
    holds the room the others need. Both stores check it with the whole-queue bounds,
    in the same atomic step as the write, and answer it the same way (`QueueFull`)."""
    return max(1, -(-max_items // 2)), -(-max_bytes // 2)


class Refusal(Exception):
    """A relay call refused with a spec §12 code (`retry_after` only for rate_limited)."""

    def __init__(self, code: str, reason: str, retry_after: int | None = None) -> None:
        super().__init__(f"{code}: {reason}")
        self.code = code
        self.reason = reason
        self.retry_after = retry_after


def denied() -> Refusal:
    return Refusal(PERMISSION_DENIED, PERMISSION_DENIED_TEXT)


@dataclass(frozen=True)
class Accepted:
    """A relay_call that passed every check: what the store needs."""

    header: Header
    envelope: bytes  # the four members as canonical JSON: what fetch_queued hands back
    expires_at: int  # min(exp, now + 30 days), Unix seconds


def check_relay_call(
    arguments: object,
    *,
    caller: str,
    caller_key: PublicKey,
    now: float,
    allowlists: Mapping[str, frozenset[str]],
    seen: dict[str, Any] | None = None,
) -> Accepted:
    """Everything a relay checks before queueing (module docstring); raises `Refusal`.

    `allowlists` maps each served recipient to its allowed senders; a recipient that is
    served but has no list yet maps to an empty set (nobody may queue for it). `seen`,
    when given, receives the header's `to` and `msg_id` as soon as they are decoded (for
    the caller's log line, refusals included). `caller` must be `caller_key`'s
    fingerprint (the connection computed it from the certificate): it is not recomputed.
    """
    if isinstance(arguments, Mapping) and not (set(arguments) & ENVELOPE_MEMBERS) and (
            "method" in arguments or "params" in arguments):
        raise Refusal(SEAL_REQUIRED, "relayed calls must be sealed (PACT §13.4)")
    try:
        header, signed, sig = decode_signed(arguments)  # every member decoded once
        if seen is not None:
            seen.update(to=header.to, msg_id=header.msg_id[:128])
        if header.cty != CALL_CTY:
            raise EnvelopeInvalid(f"cty must be {CALL_CTY}")
        if header.sender != caller:
            raise EnvelopeInvalid("from is not the caller's certificate fingerprint")
        try:
            suite_for(caller_key)
        except TypeError:
            raise EnvelopeInvalid("the caller's key is not P-256 or Ed25519") from None
        verify_decoded(header, signed, sig, caller_key, key_fingerprint=caller)
        check_time(header, now=now, direct=False)
    except EnvelopeInvalid as exc:
        raise Refusal(ENVELOPE_INVALID, exc.reason) from None
    assert isinstance(arguments, Mapping)
    encoded = canonical_envelope(arguments)
    if len(encoded) > MAX_ENVELOPE_BYTES:
        raise Refusal(TOO_LARGE, f"envelope over {MAX_ENVELOPE_BYTES} bytes")
    allowed = allowlists.get(header.to)
    if allowed is None or header.sender not in allowed:
        raise denied()
    expires_at = int(min(header.exp, now + MAX_RETENTION))
    return Accepted(header, encoded, expires_at)


def fetch_limit(arguments: object) -> int:
    """The page size of a fetch_queued call: `limit` clamped to [1, MAX_PAGE]."""
    if not isinstance(arguments, Mapping) or set(arguments) - {"limit"}:
        raise Refusal(BAD_REQUEST, "fetch_queued takes only {\"limit\": N}")
    limit = arguments.get("limit", DEFAULT_PAGE)
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise Refusal(BAD_REQUEST, "limit must be a positive integer")
    return min(limit, MAX_PAGE)


def ack_ids(arguments: object) -> list[int]:
    """The item ids of an ack call; ids that are not item ids are simply unknown ids."""
    if not isinstance(arguments, Mapping) or set(arguments) != {"ids"}:
        raise Refusal(BAD_REQUEST, "ack takes {\"ids\": [...]}")
    ids = arguments["ids"]
    if not isinstance(ids, list):
        raise Refusal(BAD_REQUEST, "ids must be a list")
    if len(ids) > MAX_ACK_IDS:
        raise Refusal(TOO_LARGE, f"at most {MAX_ACK_IDS} ids per ack")
    return sorted({i for i in ids if isinstance(i, int) and not isinstance(i, bool)
                   and 0 < i < 2**63})


def loads(body: bytes) -> Any:
    """A request body as JSON, read by the terminate edge's own reader
    (`proto.posture.loads`), so a caller meets one reading of JSON on every host: UTF-8,
    no NaN / Infinity, no member named twice, at most `MAX_JSON_VALUES` values counted
    before parsing (`TooManyValues`, a ValueError); ValueError (or RecursionError)
    otherwise."""
    return posture.loads(body)


def parse_allowlist(body: bytes) -> tuple[str, ...]:
    """The sender list of an allow-list POST, validated whole (all or nothing)."""
    try:
        doc = loads(body)
    except TooManyValues:
        raise Refusal(BAD_REQUEST, f"body may hold more than {MAX_JSON_VALUES} JSON values"
                      ) from None
    except (ValueError, RecursionError):
        raise Refusal(BAD_REQUEST, "body is not JSON") from None
    if not isinstance(doc, dict) or set(doc) != {"senders"} or not isinstance(
            doc["senders"], list):
        raise Refusal(BAD_REQUEST, 'body must be {"senders": [fingerprints]}')
    senders = doc["senders"]
    if len(senders) > MAX_ALLOWLIST:
        raise Refusal(TOO_LARGE, f"at most {MAX_ALLOWLIST} senders")
    bad = [s for s in senders if not is_pin(s)]
    if bad:
        raise Refusal(BAD_REQUEST, f"not a sha256: fingerprint: {str(bad[0])[:80]!r}")
    return tuple(sorted(set(senders)))


# --- answers -------------------------------------------------------------------------------


def tool_result(data: Mapping[str, Any]) -> dict[str, Any]:
    """A successful MCP tool result: the data as structuredContent and as text."""
    return {"content": [{"type": "text", "text": json.dumps(data)}],
            "structuredContent": dict(data)}


def tool_error(refusal: Refusal) -> dict[str, Any]:
    """The MCP tool error of a refusal (same shape as the terminate edge's refusals)."""
    structured: dict[str, Any] = {"code": refusal.code}
    if refusal.code == RATE_LIMITED:
        structured["retry_after"] = max(1, int(refusal.retry_after or FULL_RETRY_AFTER))
    return {"isError": True,
            "content": [{"type": "text", "text": f"{refusal.code}: {refusal.reason}"}],
            "structuredContent": structured}


def queued(msg_id: str) -> dict[str, Any]:
    return {"status": "queued", "msg_id": msg_id}


TOOLS: list[dict[str, Any]] = [
    {"name": "relay_call",
     "description": "Queue a sealed call for an offline recipient (PACT §9). Arguments are "
                    "the four envelope members; the relay verifies without opening.",
     "inputSchema": {"type": "object", "required": ["protected", "enc", "ct", "sig"],
                     "properties": {k: {"type": "string"} for k in
                                    ("protected", "enc", "ct", "sig")}}},
    {"name": "fetch_queued",
     "description": f"Your queued calls, oldest first (at most {MAX_PAGE} per page, default "
                    f"{DEFAULT_PAGE}). Items stay until acked.",
     "inputSchema": {"type": "object", "properties": {
         "limit": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE}}}},
    {"name": "ack",
     "description": "Delete fetched items from your queue; unknown ids are ignored.",
     "inputSchema": {"type": "object", "required": ["ids"], "properties": {
         "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": MAX_ACK_IDS}}}},
]
