"""The edge's seal-posture check (`proto/posture.py`, spec §13.3/§13.4): every row of its
table, both postures, batches, notifications, odd JSON, and the rate-limited refusal."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pact_ingress import envelope as E
from pact_ingress.config import Backend, Route, Tenant
from pact_ingress.identity import fingerprint, generate_key
from pact_ingress.proto import posture as P
from pact_ingress.proto.ratelimit import Allowed, Limited, RateLimiter

T0 = 1_800_000_000
SENDER = generate_key()
NODE = generate_key(ed25519_key=True)
PIN = fingerprint(NODE.public_key())
SENDER_FP = fingerprint(SENDER.public_key())
REQUIRED = P.Policy(seal="required", mcp_path="/mcp", pins=(PIN,))
OPTIONAL = P.Policy(seal="optional", mcp_path="/mcp", pins=(PIN,))
BOTH = pytest.mark.parametrize("policy", [REQUIRED, OPTIONAL], ids=["required", "optional"])
SPEC = Path(__file__).parents[2] / "shared" / "spec" / "pact-1.2.txt"
SPEC_CODES = {
    "unknown_contact", "pending_approval", "permission_denied", "invite_invalid",
    "blocked_or_unknown", "too_large", "rate_limited", "unavailable", "bad_request",
    "seal_required", "identity_required", "envelope_invalid", "seal_not_accepted",
}


def _envelope(**kw: Any) -> dict[str, str]:
    args: dict[str, Any] = {"msg_id": "env-1", "ts": T0, "exp": T0 + 600}
    args.update(kw)
    payload = {"method": "tools/call", "params": {"name": "send_message", "arguments": {}}}
    return E.seal(payload, sender_key=SENDER, recipient_public_key=NODE.public_key(), **args)


def _call(tool: str, arguments: Any = None, rpc_id: Any = 1, **extra: Any) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": "tools/call",
                               "params": {"name": tool, "arguments": arguments or {}}}
    if rpc_id is not _NO_ID:
        message["id"] = rpc_id
    message.update(extra)
    return message


_NO_ID = object()


def _sealed(rpc_id: Any = 1, **kw: Any) -> dict[str, Any]:
    return _call("sealed_call", _envelope(**kw), rpc_id)


def _method(name: str, rpc_id: Any = 1) -> dict[str, Any]:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": name, "params": {}}
    if rpc_id is not _NO_ID:
        message["id"] = rpc_id
    return message


def _post(body: Any, *, path: str = "/mcp", ctype: str | None = "application/json",
          method: str = "POST") -> P.McpRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return P.McpRequest(method=method, path=path, content_type=ctype, body=raw)


def _check(body: Any, policy: P.Policy = REQUIRED, **kw: Any) -> P.Decision:
    return P.check_request(_post(body, **kw), policy, T0)


def _refused(decision: P.Decision) -> tuple[P.Refuse, Any]:
    assert isinstance(decision, P.Refuse), decision
    assert ("content-type", "application/json") in decision.headers
    return decision, json.loads(decision.body)


def _tool_error(reply: dict[str, Any], code: str, rpc_id: Any) -> str:
    """Assert `reply` is a refusal for `code` as MCP clients surface it — a tool error
    inside a JSON-RPC result (`proto/posture.py`, "HTTP status") — and return its text."""
    assert reply["jsonrpc"] == "2.0" and "error" not in reply
    assert reply["id"] == rpc_id and type(reply["id"]) is type(rpc_id)
    result = reply["result"]
    assert set(result) == {"isError", "content", "structuredContent"}
    assert result["isError"] is True
    assert result["structuredContent"]["code"] == code
    [content] = result["content"]
    assert content["type"] == "text" and content["text"].startswith(f"{code}: ")
    return str(content["text"])


def _bad(decision: P.Decision, rpc_code: int, rpc_id: Any = None) -> None:
    assert isinstance(decision, P.Refuse), decision
    assert (decision.http_status, decision.code) == (400, "bad_request")
    body = json.loads(decision.body)
    assert body["jsonrpc"] == "2.0" and body["id"] == rpc_id and "result" not in body
    assert body["error"]["code"] == rpc_code


# --- what the posture applies to ---------------------------------------------------------


@pytest.mark.parametrize("method, path", [
    ("GET", "/mcp"), ("DELETE", "/mcp"), ("PUT", "/mcp"), ("POST", "/other"),
    ("POST", "/mcpx"), ("POST", "/"),
])
def test_other_methods_and_paths_are_forwarded_untouched(method: str, path: str) -> None:
    decision = _check(_call("send_message"), method=method, path=path, ctype="text/plain")
    assert decision == P.Forward(caller_keys=(None,))


@pytest.mark.parametrize("path", [
    "/mcp", "/mcp/", "//mcp", "/mcp?session=1", "/x/../mcp", "/./mcp", "/%6Dcp", "/mcp#f",
    "/MCP", "/mcp/x", "/mcp;x", "/mcp%2Fx", "https://h.test/mcp", "/%zz",
])
def test_path_variants_of_the_mcp_path_are_checked(path: str) -> None:
    decision = _check(_call("send_message"), path=path)
    assert isinstance(decision, P.Refuse) and decision.code == "seal_required"


def test_lowercase_post_is_still_post() -> None:
    assert isinstance(_check(_call("send_message"), method="post"), P.Refuse)


def test_policy_for_route() -> None:
    route = Route(host="mcp.a.example", tenant="a", mode="terminate", backend=Backend(None),
                  seal="optional", mcp_path="/rpc")
    tenant = Tenant(name="a", pins=(PIN, "sha256:" + "B" * 43), routes=(route,))
    assert P.Policy.for_route(route, tenant) == P.Policy("optional", "/rpc", tenant.pins)


# --- 400s --------------------------------------------------------------------------------


@pytest.mark.parametrize("ctype", [None, "", "text/plain", "application/jsonx",
                                   "application/x-www-form-urlencoded", "text/event-stream"])
def test_content_type_must_be_json(ctype: str | None) -> None:
    _bad(_check(_method("tools/list"), ctype=ctype), P.INVALID_REQUEST)


@pytest.mark.parametrize("ctype", ["application/json; charset=utf-8", "Application/JSON",
                                   " application/json ;charset=UTF-8"])
def test_content_type_parameters_and_case_are_fine(ctype: str) -> None:
    assert isinstance(_check(_method("tools/list"), ctype=ctype), P.Forward)


@pytest.mark.parametrize("ctype", [
    "application/json; charset=utf-7", "application/json;charset=UTF-7",
    'application/json; charset="utf-7"', "application/json; charset=utf-8; charset=utf-7",
    "application/json; Charset=iso-8859-1", "application/json; charset=utf-16",
    "application/json; charset*=utf-7''", "application/json; charset=",
])
def test_a_charset_other_than_utf8_is_refused(ctype: str) -> None:
    """A node may decode the body with the declared charset (UTF-7 turns `+AHQ-ools/call`
    into `tools/call`); the edge judges UTF-8 only."""
    body = json.dumps(_call("send_message")).replace("tools/call", "+AHQ-ools/call")
    _bad(_check(body.encode(), ctype=ctype), P.INVALID_REQUEST)


@pytest.mark.parametrize("message", [
    {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "Method": "tools/call"},
    {"jsonrpc": "2.0", "id": 1, "result": {}, "METHOD": "tools/call"},
    {"jsonrpc": "2.0", "id": 1, "method": "ping", "Params": {}},
    {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "param\u017f": {}},
    {"jsonrpc": "2.0", "id": 1, "result": {}, "\u212a": 1, "Id": 2},
    _call("sealed_call", _envelope(), 1, params={"name": "sealed_call",
                                                 "arguments": _envelope(), "Name": "x"}),
    _call("sealed_call", _envelope(), 1, params={"name": "sealed_call",
                                                 "arguments": _envelope(), "ARGUMENTS": {}}),
    {"jsonrpc": "2.0", "id": 1, "method": "tools/list", "method\u0000x": "tools/call"},
    _call("sealed_call", _envelope(), 1, params={"name": "sealed_call",
                                                 "arguments": _envelope(), "name\u0000": "x"}),
], ids=["Method", "METHOD-response", "Params", "long-s", "Id", "Name", "ARGUMENTS", "NUL",
        "name-NUL"])
def test_member_names_differing_from_json_rpc_ones_only_in_case_are_refused(
        message: dict[str, Any]) -> None:
    """Go's encoding/json reads `Method` (or `paramſ`) as the member the edge judged; a
    parser that keeps names as C strings reads `method<NUL>x` as `method`."""
    decision = _check(message, OPTIONAL)
    assert isinstance(decision, P.Refuse) and decision.http_status == 400, decision
    assert json.loads(decision.body)["error"]["code"] == P.INVALID_REQUEST


@BOTH
def test_other_members_in_any_case_are_fine(policy: P.Policy) -> None:
    message = {**_method("tools/list"), "Meta": 1, "_META": 2}
    message["params"] = {"Cursor": "x", "NAME": "no tools/call here"}
    assert isinstance(_check(message, policy), P.Forward)
    call = _sealed()
    call["params"]["_Meta"] = {"Progress": 1}
    assert isinstance(_check(call, policy), P.Forward)


@pytest.mark.parametrize("body", [
    b"", b"{", b"\xff\xfe", b"\xef\xbb\xbf{}", b'{"jsonrpc":"2.0","id":NaN,"method":"x"}',
    b'{"jsonrpc":"2.0","id":1,"method":"tools/list","method":"tools/call"}',
    b"[" * 5000 + b"]" * 5000, "\"{}\"".encode("utf-16"), b"1" * 5000,
], ids=["empty", "truncated", "not-utf8", "bom", "nan", "duplicate-member", "deep",
        "utf16", "huge-int"])
def test_body_not_json_is_a_parse_error(body: bytes) -> None:
    _bad(_check(body), P.PARSE_ERROR)


@pytest.mark.parametrize("body, rpc_id", [
    (42, None), ("tools/list", None), (None, None), ({}, None),
    ({"method": "tools/list", "id": 1}, None),  # no "jsonrpc"
    ({"jsonrpc": "1.0", "method": "tools/list", "id": 1}, None),
    ({"jsonrpc": "2.0", "method": 5, "id": 7}, 7),
    ({"jsonrpc": "2.0", "method": "tools/list", "params": "x", "id": "a"}, "a"),
    ({"jsonrpc": "2.0", "method": "tools/list", "id": 1.5}, None),
    ({"jsonrpc": "2.0", "method": "tools/list", "id": True}, None),
    ({"jsonrpc": "2.0", "method": "tools/list", "id": [1]}, None),
    ({"jsonrpc": "2.0", "id": 3}, 3),  # neither request nor response
    ({"jsonrpc": "2.0", "id": 3, "result": {}, "error": {}}, 3),
    ({"jsonrpc": "2.0", "result": {}}, None),  # a response needs an id
    ([], None),
    ([_method("tools/list", i) for i in range(P.MAX_BATCH_ELEMENTS + 1)], None),
    ([_method("tools/list"), 5], None),
])
def test_body_not_json_rpc_is_an_invalid_request(body: Any, rpc_id: Any) -> None:
    _bad(_check(body), P.INVALID_REQUEST, rpc_id)


# --- the JSON value cap: judged before parsing --------------------------------------------

#: A tools/list whose params carry a filler: its own counted characters, outside the filler.
_HEAD = b'{"jsonrpc":"2.0","id":1,"method":"tools/list","params":{"x":'
_TAIL = b"}}"
_FRAME = P.value_count(_HEAD + _TAIL)


def _filler(kind: str, n: int) -> bytes:
    """A JSON value that `value_count` counts exactly `n` times (n ≥ 2)."""
    if kind == "numbers":  # [0,0,...]: `[` and n-1 commas
        return b"[" + b",".join([b"1000"] * n) + b"]"
    if kind == "members":  # {"0":0,...}: `{`, one colon per member, commas between
        m = n // 2
        obj = b"{" + b",".join(b'"%x":0' % i for i in range(m)) + b"}"
        return obj if n % 2 == 0 else b"[" + obj + b"]"
    if kind == "objects":  # [{},{},...]: `[`, then `{` and a comma per object
        return b"[" + b",".join([b"{}"] * (n // 2)) + (b",0]" if n % 2 else b"]")
    if kind == "in-a-string":  # "…,,,…": over-counted, never parsed as values
        return b'"' + b"," * n + b'"'
    raise AssertionError(kind)


def _capped(kind: str, n: int) -> bytes:
    body = _HEAD + _filler(kind, n - _FRAME) + _TAIL
    assert P.value_count(body) == n
    return body


def test_value_count_counts_a_separator_per_value_after_the_first_and_each_container() -> None:
    assert P.value_count(b"0") == 0
    assert P.value_count(b"[1,2,3]") == 3
    assert P.value_count(b'{"a":1,"b":[]}') == 5
    assert P.value_count(b'"a,b:c{d[e"') == 4  # inside a string too: too high, never low


@pytest.mark.parametrize("kind", ["numbers", "members", "objects", "in-a-string"])
def test_a_body_at_the_value_cap_is_judged_one_over_is_refused_unparsed(kind: str) -> None:
    at = _capped(kind, P.MAX_JSON_VALUES)
    assert isinstance(_check(at, OPTIONAL), P.Forward)
    over = _capped(kind, P.MAX_JSON_VALUES + 1)
    _bad(_check(over, OPTIONAL), P.INVALID_REQUEST)
    refusal, reply = _refused(_check(over, OPTIONAL))
    assert str(P.MAX_JSON_VALUES) in reply["error"]["message"]
    assert refusal.rpc_ids == (None,)


def test_the_value_cap_is_judged_before_parsing() -> None:
    """Over the cap and not even JSON: the count answers (-32600), the parser never runs
    (it would say -32700); the same body under the cap is a parse error."""
    broken = b"[" + b"0," * P.MAX_JSON_VALUES  # never closed
    _bad(_check(broken, OPTIONAL), P.INVALID_REQUEST)
    with pytest.raises(P.TooManyValues):
        P.loads(broken)
    _bad(_check(b"[" + b"0," * (P.MAX_JSON_VALUES - 1), OPTIONAL), P.PARSE_ERROR)


def test_the_relay_reads_json_with_the_same_reader_and_cap() -> None:
    from pact_ingress.proto import relay as R

    over = _capped("numbers", P.MAX_JSON_VALUES + 1)
    with pytest.raises(P.TooManyValues):
        R.loads(over)
    assert R.loads(_capped("numbers", P.MAX_JSON_VALUES))["method"] == "tools/list"
    senders = b'{"senders":[' + b",".join([b'"x"'] * P.MAX_JSON_VALUES) + b"]}"
    with pytest.raises(R.Refusal) as refused:
        R.parse_allowlist(senders)
    assert refused.value.code == R.BAD_REQUEST


def test_large_real_calls_pass_the_value_cap() -> None:
    """What real calls look like stays far below the cap: a 10 MiB base64 argument (no
    counted character in it), a sealed call carrying 3 MiB, and 5 000 structured records."""
    blob = base64.b64encode(bytes(range(256)) * (10 * 1024 * 1024 // 4 * 3 // 256)).decode()
    media = _call("send_message", {"text": "hi, there: see {attached}", "media": blob})
    assert len(json.dumps(media)) > 10 * 1024 * 1024
    assert isinstance(_check(media, OPTIONAL), P.Forward)
    _tool_error(json.loads(_refused(_check(media, REQUIRED))[0].body), "seal_required", 1)

    sealed = _call("sealed_call", E.seal(
        {"method": "tools/call", "params": {"name": "send_message",
                                            "arguments": {"media": blob[:3 * 1024 * 1024]}}},
        sender_key=SENDER, recipient_public_key=NODE.public_key(), msg_id="big",
        ts=T0, exp=T0 + 600))
    forward = _check(sealed, REQUIRED)
    assert isinstance(forward, P.Forward) and forward.caller_keys == (SENDER_FP,)

    records = [{"id": i, "name": f"item {i}", "tags": ["a", "b"], "price": i * 1.5,
                "ok": True, "note": "short, plain text", "meta": {"x": 1, "y": 2}}
               for i in range(5000)]
    listing = _call("import_items", {"items": records})
    assert P.value_count(json.dumps(listing).encode()) < P.MAX_JSON_VALUES // 2
    assert isinstance(_check(listing, OPTIONAL), P.Forward)


# --- the table, row by row ---------------------------------------------------------------


@BOTH
@pytest.mark.parametrize("name", [
    "initialize", "tools/list", "resources/read", "prompts/get", "ping", "completion/complete",
])
def test_non_tools_call_methods_are_forwarded(policy: P.Policy, name: str) -> None:
    assert _check(_method(name, 9), policy) == P.Forward((None,), (9,), True, False)


@BOTH
def test_notifications_are_forwarded(policy: P.Policy) -> None:
    decision = _check(_method("notifications/initialized", _NO_ID), policy)
    assert decision == P.Forward((None,), (), True, False)


@BOTH
def test_client_responses_are_forwarded(policy: P.Policy) -> None:
    for reply in ({"jsonrpc": "2.0", "id": 4, "result": {"action": "accept"}},
                  {"jsonrpc": "2.0", "id": "s-1", "error": {"code": -1, "message": "no"}}):
        assert _check(reply, policy) == P.Forward((None,), (), True, False)


def test_unsealed_tools_call_is_refused_seal_required_when_required() -> None:
    refuse, reply = _refused(_check(_call("send_message", {"text": "s3cret-body"}, 7)))
    assert (refuse.code, refuse.http_status, refuse.rpc_ids) == ("seal_required", 200, (7,))
    assert "sealed_call" in _tool_error(reply, "seal_required", 7)
    assert "send_message" in refuse.detail and "s3cret" not in refuse.detail


def test_unsealed_tools_call_is_forwarded_when_optional() -> None:
    decision = _check(_call("send_message", {"text": "hi"}, 7), OPTIONAL)
    assert decision == P.Forward((None,), (7,), True, False)


@pytest.mark.parametrize("params", [None, [], {"arguments": {}}, {"name": 5}, {"name": ""}])
def test_tools_call_without_a_usable_name_counts_as_unsealed(params: Any) -> None:
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call"}
    if params is not None:
        message["params"] = params
    assert _refused(_check(message))[0].code == "seal_required"
    assert isinstance(_check(message, OPTIONAL), P.Forward)


@BOTH
def test_sealed_call_with_valid_header_is_forwarded_with_its_key(policy: P.Policy) -> None:
    decision = _check(_sealed(3), policy)
    assert decision == P.Forward((SENDER_FP,), (3,), True, False)


@BOTH
@pytest.mark.parametrize("arguments, reason", [
    (_envelope(ts=T0 - 400, exp=T0 + 200), "300 s"),
    (_envelope(ts=T0 - 1000, exp=T0 - 1), "expired"),
    (E.seal({}, sender_key=SENDER, recipient_public_key=SENDER.public_key(), msg_id="m",
            ts=T0, exp=T0 + 60), "to is not"),
    (_envelope(cty=E.RESULT_CTY), "cty"),
    (dict(_envelope(), extra="x"), "exactly"),
    ("not an object", "not a JSON object"),
    (None, "not a JSON object"),
])
def test_sealed_call_whose_header_fails_is_envelope_invalid(
    policy: P.Policy, arguments: Any, reason: str
) -> None:
    message = _call("sealed_call", rpc_id="abc")
    message["params"]["arguments"] = arguments
    if arguments is None:
        del message["params"]["arguments"]
    refuse, reply = _refused(_check(message, policy))
    assert (refuse.code, refuse.http_status) == ("envelope_invalid", 200)
    assert reason in _tool_error(reply, "envelope_invalid", "abc")


def test_header_check_uses_the_tenant_pins_and_the_given_now() -> None:
    other_pin = fingerprint(generate_key().public_key())
    stranger = P.Policy("required", "/mcp", (other_pin,))
    assert _refused(_check(_sealed(), stranger))[0].code == "envelope_invalid"
    rotating = P.Policy("required", "/mcp", (other_pin, PIN))
    assert isinstance(_check(_sealed(), rotating), P.Forward)
    later = P.check_request(_post(_sealed()), REQUIRED, T0 + 301)
    assert isinstance(later, P.Refuse) and b"300 s" in later.body


# --- ids and notifications ---------------------------------------------------------------


@pytest.mark.parametrize("rpc_id", [0, -1, 2**62, "0", "", "é", None])
def test_refusals_echo_the_id_exactly(rpc_id: Any) -> None:
    _, reply = _refused(_check(_call("send_message", rpc_id=rpc_id)))
    _tool_error(reply, "seal_required", rpc_id)


def test_refused_notification_is_answered_with_null_id() -> None:
    refuse, reply = _refused(_check(_call("send_message", rpc_id=_NO_ID)))
    assert refuse.rpc_ids == (None,)
    _tool_error(reply, "seal_required", None)


def test_refusal_body_is_exactly_the_design_shape() -> None:
    _, reply = _refused(_check(_call("send_message", rpc_id=7)))
    assert reply == {
        "jsonrpc": "2.0", "id": 7,
        "result": {
            "isError": True,
            "content": [{"type": "text", "text": f"seal_required: {P._WHY_SEAL_REQUIRED}"}],
            "structuredContent": {"code": "seal_required"},
        },
    }


# --- batches -----------------------------------------------------------------------------


@BOTH
def test_batch_of_allowed_elements_is_forwarded_with_a_key_each(policy: P.Policy) -> None:
    batch = [_method("tools/list", 1), _sealed(2), _method("notifications/x", _NO_ID),
             {"jsonrpc": "2.0", "id": 99, "result": {}}, _sealed("s")]
    decision = _check(batch, policy)
    assert decision == P.Forward((None, SENDER_FP, None, None, SENDER_FP), (1, 2, "s"), True, True)


def test_batch_with_a_refused_element_is_refused_whole() -> None:
    batch = [_method("tools/list", 1), _call("send_message", rpc_id=2),
             _method("notifications/x", _NO_ID), {"jsonrpc": "2.0", "id": 99, "result": {}},
             _sealed(3), _call("sealed_call", {"protected": "x"}, rpc_id=4)]
    refuse, replies = _refused(_check(batch))
    assert isinstance(replies, list)
    assert refuse.code == "seal_required" and "batch of 6" in refuse.detail
    assert refuse.rpc_ids == (1, 2, 3, 4)
    assert [r["id"] for r in replies] == [1, 2, 3, 4]
    _tool_error(replies[0], "bad_request", 1)
    _tool_error(replies[1], "seal_required", 2)
    assert "another call" in _tool_error(replies[2], "bad_request", 3)
    _tool_error(replies[3], "envelope_invalid", 4)


def test_batch_refusal_under_optional_names_only_the_bad_envelope() -> None:
    batch = [_call("send_message", rpc_id=1), _call("sealed_call", {}, rpc_id=2)]
    refuse, replies = _refused(_check(batch, OPTIONAL))
    assert refuse.code == "envelope_invalid"
    _tool_error(replies[0], "bad_request", 1)
    _tool_error(replies[1], "envelope_invalid", 2)


def test_single_element_batch_gets_a_batch_answer() -> None:
    _, replies = _refused(_check([_call("send_message", rpc_id=5)]))
    assert isinstance(replies, list) and len(replies) == 1
    _tool_error(replies[0], "seal_required", 5)


# --- rate_limited ------------------------------------------------------------------------


def test_rate_limited_single_request() -> None:
    forward = _check(_sealed(8))
    assert isinstance(forward, P.Forward)
    refuse = P.refuse_rate_limited(forward, 42)
    assert (refuse.code, refuse.http_status, refuse.rpc_ids) == ("rate_limited", 200, (8,))
    assert ("retry-after", "42") in refuse.headers
    reply = json.loads(refuse.body)
    assert "42" in _tool_error(reply, "rate_limited", 8)
    assert reply["result"]["structuredContent"] == {"code": "rate_limited", "retry_after": 42}


def test_rate_limited_batch_answers_every_request_id() -> None:
    forward = _check([_sealed(1), _method("notifications/x", _NO_ID), _method("tools/list", "b")])
    assert isinstance(forward, P.Forward)
    refuse = P.refuse_rate_limited(forward, 0)  # clamped: retry_after is at least 1
    replies = json.loads(refuse.body)
    assert [r["id"] for r in replies] == [1, "b"]
    for reply in replies:
        assert reply["result"]["structuredContent"] == {"code": "rate_limited", "retry_after": 1}


def test_rate_limited_notification_only_post_gets_null_id() -> None:
    forward = _check(_method("notifications/initialized", _NO_ID))
    assert isinstance(forward, P.Forward)
    _tool_error(json.loads(P.refuse_rate_limited(forward, 5).body), "rate_limited", None)


def test_rate_limited_non_json_rpc_request_is_a_429() -> None:
    forward = _check(b"", method="GET")
    assert isinstance(forward, P.Forward) and not forward.jsonrpc
    refuse = P.refuse_rate_limited(forward, 30)
    assert (refuse.http_status, refuse.code) == (429, "rate_limited")
    assert ("retry-after", "30") in refuse.headers
    assert refuse.body.startswith(b"rate_limited:")


def test_posture_then_limiter_then_refusal() -> None:
    limiter = RateLimiter(per_ip_key_per_hour=1, per_ip_per_hour=1000)  # burst 1
    forward = _check(_sealed(1))
    assert isinstance(forward, P.Forward) and forward.caller_keys == (SENDER_FP,)
    first = limiter.check_calls("203.0.113.5", forward.caller_keys, T0)
    second = limiter.check_calls("203.0.113.5", forward.caller_keys, T0)
    assert isinstance(first, Allowed) and isinstance(second, Limited)
    refuse = P.refuse_rate_limited(forward, second.retry_after)
    _tool_error(json.loads(refuse.body), "rate_limited", 1)
    assert ("retry-after", "3600") in refuse.headers


# --- codes and robustness ----------------------------------------------------------------


def test_codes_are_spec_section_12_codes() -> None:
    used = {P.SEAL_REQUIRED, P.ENVELOPE_INVALID, P.RATE_LIMITED, P.BAD_REQUEST}
    assert used <= SPEC_CODES
    if SPEC.exists():
        section = SPEC.read_text().split("§ 12", 1)[1].split("§ 13", 1)[0]
        for code in used:
            assert re.search(rf"\b{code}\b", section), code


def test_log_detail_sanitises_caller_chosen_names() -> None:
    refuse, _ = _refused(_check(_call("evil\n\x1b[31mtool" + "x" * 200)))
    assert "\n" not in refuse.detail and "\x1b" not in refuse.detail
    assert len(refuse.detail) < 300


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.sampled_from(["jsonrpc", "id", "method", "params", "name",
                                       "arguments", "result", "error", "x"]), inner, max_size=5),
    max_leaves=16,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_arbitrary_json_gets_a_decision(value: Any) -> None:
    decision = _check(value)
    assert isinstance(decision, (P.Forward, P.Refuse))
    if isinstance(decision, P.Refuse):
        json.loads(decision.body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_get_a_decision(body: bytes) -> None:
    assert isinstance(_check(body), (P.Forward, P.Refuse))
