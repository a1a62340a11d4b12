"""A hostile client against the terminate edge: paths a node's router may read as the
MCP endpoint, and what one client's aborts leave behind.

Run:   python -m pytest tests/test_attacks6.py -v

Real `serve` processes and real TLS on loopback (tests/terminate_env.py); every wait is
bounded, nothing asserts on timing.
"""

from __future__ import annotations

import pytest

from tests.terminate_env import (
    HOST,
    ServeEnv,
    exchange,
    module_fixtures,
    request_bytes,
    unsealed_call_body,
)
from pact_ingress.proto.http_request import in_mcp_scope, parse_target

shared, env = module_fixtures("attacks6")

#: Targets whose path, once a router reads `%2F` / `%5C` as a slash (as the scope rule
#: itself does) and then merges slashes or resolves dot segments (nginx's location
#: matching does both, Go's ServeMux cleans the path), is the MCP endpoint.
ENCODED_SLASH_SPELLINGS = [
    "/%2Fmcp", "/%2fmcp", "/%5Cmcp", "/x%2F..%2Fmcp", "/x%2F%2e%2e%2Fmcp",
    "/%2F%2Fmcp%2F", "/.%2Fmcp", "/a%5C..%5Cmcp",
]


@pytest.mark.parametrize("raw", ENCODED_SLASH_SPELLINGS)
def test_encoded_slashes_merged_or_resolved_are_still_in_scope(raw: str) -> None:
    assert in_mcp_scope(parse_target(raw.encode()).path, "/mcp")


@pytest.mark.parametrize("raw", ["/mcp%2F..%2Fx", "/mcp%2Fx", "/mcp/..%2Fx"])
def test_what_was_in_scope_stays_in_scope(raw: str) -> None:
    # a router that leaves the escapes alone serves these below /mcp
    assert in_mcp_scope(parse_target(raw.encode()).path, "/mcp")


@pytest.mark.parametrize("raw", ["/%2Fmcpx", "/x%2Fmcp", "/%2F..%2Fx"])
def test_other_encoded_paths_are_not(raw: str) -> None:
    assert not in_mcp_scope(parse_target(raw.encode()).path, "/mcp")


@pytest.mark.parametrize("target", ["/%2Fmcp", "/x%2F..%2Fmcp", "/%5Cmcp"])
@pytest.mark.parametrize("content_type", ["text/plain", None])
def test_an_unsealed_call_at_an_encoded_slash_spelling_never_reaches_the_node(
        env: ServeEnv, target: str, content_type: str | None) -> None:
    # the MCP endpoint refuses a body that is not application/json; the same body at a
    # spelling of the endpoint must be refused the same way, not forwarded as a plain POST
    body = unsealed_call_body()
    resp = exchange(env.serve.port, request_bytes(
        "POST", target, HOST, body=body, content_type=content_type), host=HOST)
    assert resp.status == 400, (resp.status, resp.body[:200])
    assert env.node.requests() == []
