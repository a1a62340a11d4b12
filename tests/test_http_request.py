"""The terminating edge's pure request-head rules: targets, paths, scope, framing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pact_ingress.proto.http_request import (
    BadRequest,
    Scope,
    check_host,
    in_mcp_scope,
    judge_scope,
    parse_target,
)
from pact_ingress.proto.shares import Refused, Shares

JSON = b"application/json"


@pytest.mark.parametrize("raw", [
    b"/mcp", b"https://h.test/mcp", b"http://h.test/mcp", b"HTTPS://h.test:443/mcp",
    b"/mcp?x=1", b"/mcp/", b"/mcp/x", b"/mcp;x", b"/MCP", b"/%6Dcp", b"/%6dcp", b"//mcp",
    b"/x/../mcp", b"/./mcp", b"/mcp%2Fx", b"/Mcp;a=b/", b"/%2e%2e/mcp",
    b"/x/%2E%2E/mcp",
])
def test_every_spelling_of_the_mcp_path_is_in_scope(raw: bytes) -> None:
    assert in_mcp_scope(parse_target(raw).path, "/mcp")


@pytest.mark.parametrize("raw", [b"/", b"/mcpx", b"/mc", b"/x/mcp", b"/mcp/../x", b"/%6Dcpx"])
def test_other_paths_are_not(raw: bytes) -> None:
    assert not in_mcp_scope(parse_target(raw).path, "/mcp")


@pytest.mark.parametrize(("raw", "status"), [
    (b"*", 400), (b"h.test:443", 400), (b"mcp", 400), (b"https://u@h.test/mcp", 400),
    (b"/mcp#frag", 400), (b"/a\\b", 400), (b"/%zz", 400), (b"/%4", 400), (b"/a b", 400),
    (b"/\xc3\xa9", 400), (b"/a\x00", 400), (b"ftp://h.test/mcp", 400), (b"https:///mcp", 400),
    (b"https://[::1/mcp", 400), (b"/" + b"a" * 9000, 414),
])
def test_unreadable_targets_are_refused(raw: bytes, status: int) -> None:
    with pytest.raises(BadRequest) as info:
        parse_target(raw)
    assert info.value.status == status


def test_the_node_gets_the_normalised_origin_form() -> None:
    assert parse_target(b"https://H.test/a/./b/../%6Dcp;x?q=%41").origin_form == b"/a/mcp?q=%41"
    assert parse_target(b"/a%2fb/").origin_form == b"/a%2Fb/"
    assert parse_target(b"/mcp%2fx/..").origin_form == b"/"  # judged as "/", sent as "/"


@given(st.binary(max_size=64))
def test_parse_target_only_ever_refuses_with_bad_request(raw: bytes) -> None:
    try:
        target = parse_target(b"/" + raw)
    except BadRequest:
        return
    again = parse_target(target.origin_form)
    assert again.path == target.path  # normalising is idempotent: the node sees what we judged
    assert in_mcp_scope(again.path, "/mcp") == in_mcp_scope(target.path, "/mcp")


def test_absolute_form_authority_is_checked_like_host() -> None:
    target = parse_target(b"https://other.test/mcp")
    with pytest.raises(BadRequest) as info:
        check_host(b"h.test", target, "h.test", "h.test")
    assert info.value.status == 400  # Host and target disagree
    with pytest.raises(BadRequest) as info:
        check_host(None, target, "h.test", "h.test")
    assert info.value.status == 421
    assert check_host(b"h.test:443", parse_target(b"https://h.test/mcp"), "h.test",
                      "h.test") == "h.test"
    with pytest.raises(BadRequest):
        check_host(None, parse_target(b"/mcp"), "h.test", "h.test")  # no host at all


@pytest.mark.parametrize(("method", "path", "body", "ctype", "cenc", "expect"), [
    ("POST", b"/mcp", True, JSON, None, Scope.MCP_POST),
    ("POST", b"/MCP/x", True, b"text/plain", None, Scope.MCP_POST),
    ("GET", b"/mcp", False, None, None, Scope.PLAIN),
    ("DELETE", b"/mcp", False, None, None, Scope.PLAIN),
    ("PUT", b"/mcp", True, JSON, None, 405),
    ("GET", b"/mcp", True, JSON, None, 405),
    ("POST", b"/mcp", True, JSON, b"gzip", 415),
    ("POST", b"/mcp", True, JSON, b"identity", Scope.MCP_POST),
    ("POST", b"/other", True, JSON, None, 403),
    ("PATCH", b"/other", True, b"application/merge-patch+json; charset=utf-8", None, 403),
    ("POST", b"/other", True, b"text/plain", None, Scope.PLAIN),
    ("GET", b"/other", False, None, None, Scope.PLAIN),
])
def test_scope(method: str, path: bytes, body: bool, ctype: bytes | None,
               cenc: bytes | None, expect: Scope | int) -> None:
    target = parse_target(path)
    if isinstance(expect, Scope):
        assert judge_scope(method, target, "/mcp", has_body=body, content_type=ctype,
                           content_encoding=cenc) is expect
        return
    with pytest.raises(BadRequest) as info:
        judge_scope(method, target, "/mcp", has_body=body, content_type=ctype,
                    content_encoding=cenc)
    assert info.value.status == expect


def test_shares_cap_each_client_and_the_total() -> None:
    shares = Shares(per_client=3, total=5)
    assert shares.take("a", 3) is None
    assert shares.take("a", 1) is Refused.CLIENT
    assert shares.take("b", 3) is Refused.TOTAL
    assert shares.take("b", 2) is None
    shares.give("a", 3)
    shares.give("b", 7)  # never more than held
    assert (shares.held, len(shares)) == (0, 0)


def test_json_is_recognised_however_it_is_spelled() -> None:
    from pact_ingress.proto.http_request import is_json_type
    for value in (b"application/json", b"Application/JSON; charset=utf-8", b"text/json",
                  b"application/merge-patch+json", b"application/json, text/plain",
                  b"text/plain, application/json", b"application/x-json-stream"):
        assert is_json_type(value), value
    assert not is_json_type(b"text/plain") and not is_json_type(None)


def test_content_type_and_encoding_are_single_valued() -> None:
    from pact_ingress.proto.http_request import check_single_valued
    check_single_valued([(b"content-type", b"a/b"), (b"content-encoding", b"gzip")])
    for name in (b"content-type", b"content-encoding"):
        with pytest.raises(BadRequest) as info:
            check_single_valued([(name, b"a"), (b"x", b"y"), (name, b"b")])
        assert info.value.status == 400
