"""The relay end to end: a real `serve`, real TLS with real client certificates.

Covers the contract: relay_call → fetch_queued → ack; every refusal; allow-list replace;
the same permission_denied for an unknown recipient and an unlisted sender; dedupe; depth
bounds; bad input; HTTP/2; the status document and metrics.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from pact_ingress.admin.client import format_status
from pact_ingress.admin.schema import STATUS_SCHEMA
from pact_ingress.identity import b64url, b64url_decode, keygen
from tests.relay_env import (
    RELAY_HOST,
    RelayCaller,
    RelayH2,
    RelayIdentities,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
    relay_socket,
    rpc,
    tool_body,
)
from tests.terminate_env import forget, read_response, request_bytes


@pytest.fixture
def ids(tmp_path: Path) -> RelayIdentities:
    return relay_identities(tmp_path)


@pytest.fixture
def serve(tmp_path: Path, ids: RelayIdentities) -> Iterator[RelayServe]:
    s = RelayServe(tmp_path, recipients=[ids.recipient], max_items=5, max_bytes="64KiB")
    yield s
    s.stop()


def _callers(serve: RelayServe, ids: RelayIdentities) -> tuple[RelayCaller, RelayCaller]:
    recipient = RelayCaller(serve.port, ids.recipient)
    assert recipient.allowlist_set([ids.sender.fingerprint]).status == 200
    return recipient, RelayCaller(serve.port, ids.sender)


def test_relay_call_fetch_ack(serve: RelayServe, ids: RelayIdentities) -> None:
    recipient, sender = _callers(serve, ids)
    sent = [envelope(ids.sender, ids.recipient, msg_id=f"m-{i}") for i in range(3)]
    before = int(time.time())
    for i, env in enumerate(sent):
        result, resp = sender.tool("relay_call", env)
        assert resp.status == 200 and not result.get("isError"), result
        assert result["structuredContent"] == {"status": "queued", "msg_id": f"m-{i}"}
    page, _ = recipient.tool("fetch_queued", {"limit": 2})
    data = page["structuredContent"]
    assert data["more"] is True
    assert [item["envelope"] for item in data["items"]] == sent[:2]  # oldest first
    assert all(before - 1 <= item["queued_at"] <= time.time() + 1 for item in data["items"])
    # unacked: the same items again (at-least-once)
    again, _ = recipient.tool("fetch_queued", {})
    assert [i["envelope"] for i in again["structuredContent"]["items"]] == sent
    assert again["structuredContent"]["more"] is False
    first_ids = [item["id"] for item in data["items"]]
    acked, _ = recipient.tool("ack", {"ids": [*first_ids, 999_999, "x"]})
    assert acked["structuredContent"] == {"acked": 2}
    rest, _ = recipient.tool("fetch_queued", {})
    assert [i["envelope"] for i in rest["structuredContent"]["items"]] == sent[2:]
    # the sender has no queue of its own (not a served recipient)
    theirs, _ = sender.tool("fetch_queued", {})
    assert code_of(theirs) == "permission_denied"
    # nothing in the log carries an envelope body
    logs = serve.logs()
    assert sent[0]["ct"] not in logs and sent[0]["sig"] not in logs
    calls = [e for e in serve.log_events() if e.get("event") == "relay_relay_call"]
    assert len(calls) == 3 and {c["outcome"] for c in calls} == {"ok"}
    assert calls[0]["caller"] == ids.sender.fingerprint
    assert calls[0]["to"] == ids.recipient.fingerprint and calls[0]["msg_id"] == "m-0"


def test_dedupe_answers_like_the_first(serve: RelayServe, ids: RelayIdentities) -> None:
    recipient, sender = _callers(serve, ids)
    env = envelope(ids.sender, ids.recipient, msg_id="dup")
    first, _ = sender.tool("relay_call", env)
    second, _ = sender.tool("relay_call", env)
    assert first == second and not first.get("isError")
    page, _ = recipient.tool("fetch_queued", {})
    items = page["structuredContent"]["items"]
    assert len(items) == 1
    recipient.tool("ack", {"ids": [items[0]["id"]]})
    third, _ = sender.tool("relay_call", env)  # acked already: still no second copy
    assert third == first
    assert recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"] == []


def test_permission_denied_is_the_same_for_both_causes(
        serve: RelayServe, ids: RelayIdentities, tmp_path: Path) -> None:
    recipient, sender = _callers(serve, ids)
    stranger = keygen(tmp_path / "stranger.key", common_name="stranger")
    unknown_recipient = RelayCaller(serve.port, ids.sender)
    unlisted_sender = RelayCaller(serve.port, ids.other)
    a, ra = unknown_recipient.tool("relay_call", envelope(ids.sender, stranger, msg_id="a"))
    b, rb = unlisted_sender.tool("relay_call", envelope(ids.other, ids.recipient, msg_id="a"))
    assert code_of(a) == code_of(b) == "permission_denied"
    assert (ra.status, ra.body) == (rb.status, rb.body)  # byte for byte


def test_refusals(serve: RelayServe, ids: RelayIdentities, tmp_path: Path) -> None:
    recipient, sender = _callers(serve, ids)
    now = int(time.time())

    def code(env: object, who: RelayCaller = sender) -> str | None:
        return code_of(who.tool("relay_call", env)[0])

    good = envelope(ids.sender, ids.recipient, msg_id="ok")
    # from is not the caller
    assert code(envelope(ids.other, ids.recipient, msg_id="x")) == "envelope_invalid"
    # signature by another key over the same header
    forged = dict(good, sig=envelope(ids.sender, ids.recipient, msg_id="ok")["sig"])
    forged["ct"] = b64url(b64url_decode(good["ct"])[:-1] + b"\0")
    assert code(forged) == "envelope_invalid"
    # result cty
    assert code(envelope(ids.sender, ids.recipient, msg_id="r",
                         cty="application/pact-result+json")) == "envelope_invalid"
    # expired, and a lifetime over 30 days
    assert code(envelope(ids.sender, ids.recipient, msg_id="e", ts=now - 100,
                         exp=now - 1)) == "envelope_invalid"
    assert code(envelope(ids.sender, ids.recipient, msg_id="l", ts=now,
                         exp=now + 31 * 86400)) == "envelope_invalid"
    # truncated / garbage members / missing members
    assert code(dict(good, protected=good["protected"][:-3])) == "envelope_invalid"
    assert code({k: v for k, v in good.items() if k != "sig"}) == "envelope_invalid"
    assert code("not an object") == "envelope_invalid"
    # unsealed form: the relay only takes sealed calls
    assert code({"method": "tools/call", "params": {}}) == "seal_required"
    # no client certificate at all
    anon = RelayCaller(serve.port, None)
    result, resp = anon.tool("relay_call", good)
    assert code_of(result) == "identity_required" and resp.status == 401
    init, resp = anon.rpc(rpc("initialize", {}))
    assert init["error"]["data"]["code"] == "identity_required"
    assert anon.allowlist_get().status == 401
    assert json.loads(anon.allowlist_get().body)["code"] == "identity_required"
    # nothing of the above was queued
    assert recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"] == []
    metrics = serve.metrics()
    assert 'pact_ingress_relay_refusals_total{code="envelope_invalid"}' in metrics


def test_bad_input(serve: RelayServe, ids: RelayIdentities) -> None:
    recipient, sender = _callers(serve, ids)
    resp = sender.request("POST", "/relay/mcp", b"{not json")
    assert resp.status == 400 and json.loads(resp.body)["error"]["code"] == -32700
    resp = sender.request("POST", "/relay/mcp", b"[" + rpc("ping") + b"]")
    assert json.loads(resp.body)["error"]["code"] == -32600
    # an oversized request: refused too_large before it is read
    # (the head alone, declaring the length: the answer comes before any body is sent)
    sock = relay_socket(serve.port, ids.sender)
    try:
        sock.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, length=False,
                                   headers=[("Content-Length", str(13 * 1024 * 1024))]))
        resp = read_response(sock)
    finally:
        forget(sock)
    assert resp.status == 413 and code_of(json.loads(resp.body)["result"]) == "too_large"
    # and a sent body over the cap (no length declared: chunked)
    chunked = RelayCaller(serve.port, ids.sender)
    sock = relay_socket(serve.port, ids.sender)
    try:
        sock.sendall(request_bytes("POST", "/relay/mcp", RELAY_HOST, length=False,
                                   headers=[("Transfer-Encoding", "chunked")]))
        piece = b"a" * (1024 * 1024)
        try:
            for _ in range(14):
                sock.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
        except (ssl.SSLError, OSError):
            pass  # the relay answered and closed before taking it all
        resp = read_response(sock)
    finally:
        forget(sock)
        chunked.close()
    assert resp.status == 413
    # huge pages are clamped, bad limits refused
    assert recipient.tool("fetch_queued", {"limit": 10**9})[0]["structuredContent"][
        "more"] is False
    assert code_of(recipient.tool("fetch_queued", {"limit": 0})[0]) == "bad_request"
    assert code_of(recipient.tool("fetch_queued", {"limit": "9"})[0]) == "bad_request"
    assert code_of(recipient.tool("ack", {"ids": list(range(5000))})[0]) == "too_large"
    # unknown tool, unknown method, a notification
    assert sender.rpc(tool_body("nope", {}))[0]["error"]["code"] == -32602
    assert sender.rpc(rpc("resources/list"))[0]["error"]["code"] == -32601
    resp = sender.request("POST", "/relay/mcp",
                          json.dumps({"jsonrpc": "2.0", "method": "notifications/x"}).encode())
    assert resp.status == 202
    assert sender.request("GET", "/relay/mcp").status == 405
    assert sender.request("GET", "/elsewhere").status == 404
    # tools/list and initialize answer
    tools = sender.rpc(rpc("tools/list"))[0]["result"]["tools"]
    assert [t["name"] for t in tools] == ["relay_call", "fetch_queued", "ack"]
    init = sender.rpc(rpc("initialize", {"protocolVersion": "2025-06-18"}))[0]["result"]
    assert init["protocolVersion"] == "2025-06-18" and "tools" in init["capabilities"]


def test_allowlist_replace(serve: RelayServe, ids: RelayIdentities) -> None:
    recipient, sender = _callers(serve, ids)
    assert json.loads(recipient.allowlist_get().body) == {"senders": [ids.sender.fingerprint]}
    resp = recipient.allowlist_set([ids.other.fingerprint, ids.other.fingerprint])
    assert (resp.status, json.loads(resp.body)) == (200, {"senders": 1})
    assert json.loads(recipient.allowlist_get().body) == {"senders": [ids.other.fingerprint]}
    # the old sender is out now, the new one in
    assert code_of(sender.tool("relay_call", envelope(ids.sender, ids.recipient))[0]) == \
        "permission_denied"
    other = RelayCaller(serve.port, ids.other)
    assert not other.tool("relay_call", envelope(ids.other, ids.recipient))[0].get("isError")
    # invalid lists are refused whole, the list stays
    for bad in (b"{}", b'{"senders": ["sha256:nope"]}', b"[1]", b"garbage"):
        resp = recipient.request("POST", "/relay/allowlist", bad)
        assert resp.status == 400 and json.loads(resp.body)["code"] == "bad_request"
    assert json.loads(recipient.allowlist_get().body) == {"senders": [ids.other.fingerprint]}
    # only the recipient's own list: a sender that is no recipient is denied
    resp = sender.allowlist_set([ids.sender.fingerprint])
    assert resp.status == 403 and json.loads(resp.body)["code"] == "permission_denied"


def test_depth_bounds(serve: RelayServe, ids: RelayIdentities) -> None:
    recipient, sender = _callers(serve, ids)
    assert recipient.allowlist_set([ids.sender.fingerprint,
                                    ids.other.fingerprint]).status == 200
    other = RelayCaller(serve.port, ids.other)
    # a sender's share is 3 of the 5 items; the other sender takes the last 2
    for i in range(3):
        assert not sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                      msg_id=f"d-{i}"))[0].get("isError")
    share, _ = sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="d-3"))
    assert code_of(share) == "rate_limited"
    for i in range(2):
        assert not other.tool("relay_call", envelope(ids.other, ids.recipient,
                                                     msg_id=f"o-{i}"))[0].get("isError")
    full, _ = other.tool("relay_call", envelope(ids.other, ids.recipient, msg_id="o-2"))
    assert code_of(full) == "rate_limited"
    for result in (share, full):
        retry = result["structuredContent"]["retry_after"]
        assert isinstance(retry, int) and retry >= 1
    doc = serve.status()
    jsonschema.validate(doc, STATUS_SCHEMA, cls=jsonschema.Draft202012Validator)
    status = doc["relay"]
    assert status["healthy"] is True
    assert status["queues"][0]["items"] == 5 and status["queues"][0]["tenant"] == "home"
    assert ids.recipient.fingerprint in format_status(doc)
    page = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
    recipient.tool("ack", {"ids": [page[0]["id"]]})  # d-0: the sender's
    assert not sender.tool("relay_call", envelope(ids.sender, ids.recipient,
                                                  msg_id="d-3"))[0].get("isError")
    # bytes: one item over the whole 64 KiB bound (so over a sender's half of it) never
    # fits, not even an empty queue (a queue that is merely full: test_relay_attacks)
    big = envelope(ids.sender, ids.recipient, msg_id="big", text="x" * 70_000)
    recipient.tool("ack", {"ids": [i["id"] for i in page[1:]]})
    assert code_of(sender.tool("relay_call", big)[0]) == "too_large"
    assert "pact_ingress_relay_queued_items{" in serve.metrics()


def test_relay_call_is_charged_to_the_senders_budget(tmp_path: Path,
                                                    ids: RelayIdentities) -> None:
    # 10 calls an hour per (IP, key): a burst of 5, then rate_limited with retry_after
    serve = RelayServe(tmp_path, recipients=[ids.recipient],
                       extra="limits: {calls_per_hour_per_ip_key: 10}\n")
    try:
        recipient, sender = _callers(serve, ids)
        codes = [code_of(sender.tool("relay_call", envelope(
            ids.sender, ids.recipient, msg_id=f"r-{i}"))[0]) for i in range(7)]
        assert codes == [None] * 5 + ["rate_limited"] * 2
        limited, _ = sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="x"))
        retry = limited["structuredContent"]["retry_after"]
        assert isinstance(retry, int) and retry >= 1
        # the recipient's own tools are not the sender's budget
        items = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
        assert len(items) == 5
    finally:
        serve.stop()


def test_http2(serve: RelayServe, ids: RelayIdentities) -> None:
    recipient, _ = _callers(serve, ids)
    conn = RelayH2(serve.port, ids.sender)
    try:
        res = conn.request("POST", "/relay/mcp", body=tool_body(
            "relay_call", envelope(ids.sender, ids.recipient, msg_id="h2")))
        assert res.status == 200
        assert json.loads(res.body)["result"]["structuredContent"]["msg_id"] == "h2"
    finally:
        conn.close()
    anon = RelayH2(serve.port, None)
    try:
        res = anon.request("GET", "/relay/allowlist")
        assert res.status == 401 and json.loads(res.body)["code"] == "identity_required"
    finally:
        anon.close()
    items = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
    assert [i["envelope"]["protected"] for i in items] != []


def test_cli_ls_and_purge(serve: RelayServe, ids: RelayIdentities) -> None:
    recipient, sender = _callers(serve, ids)
    for i in range(2):
        sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id=f"c{i}"))

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "pact_ingress", "relay", *args, "-c",
                               str(serve.config)], capture_output=True, text=True, timeout=30)

    ls = cli("ls")
    assert ls.returncode == 0, ls.stderr
    row = ls.stdout.splitlines()[1].split("\t")
    assert row[:4] == ["home", ids.recipient.fingerprint, "2", row[3]] and int(row[3]) > 0
    refused = cli("purge", "--all")
    assert refused.returncode == 2 and "--recipient" in refused.stderr
    assert cli("purge").stdout.startswith("purged 0 expired")
    done = cli("purge", "--all", "--recipient", ids.recipient.fingerprint)
    assert done.returncode == 0 and done.stdout.startswith("purged 2 queued"), done
    assert recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"] == []


def test_corrupt_store_answers_unavailable(tmp_path: Path, ids: RelayIdentities) -> None:
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "relay.sqlite").write_bytes(b"garbage, not SQLite " * 500)
    serve = RelayServe(tmp_path, recipients=[ids.recipient])
    try:
        sender = RelayCaller(serve.port, ids.sender)
        result, _ = sender.tool("relay_call", envelope(ids.sender, ids.recipient))
        assert code_of(result) == "unavailable"
        recipient = RelayCaller(serve.port, ids.recipient)
        assert code_of(recipient.tool("fetch_queued", {})[0]) == "unavailable"
        assert recipient.allowlist_set([ids.sender.fingerprint]).status == 503
        doc = serve.status()
        jsonschema.validate(doc, STATUS_SCHEMA, cls=jsonschema.Draft202012Validator)
        status = doc["relay"]
        assert status["healthy"] is False and "not a database" in status["last_error"]
        errors = [e for e in serve.log_events() if e.get("event") == "relay_store_unavailable"]
        assert errors and "Traceback" not in serve.logs()
        assert serve.proc is not None and serve.proc.poll() is None  # still serving
    finally:
        serve.stop()


async def test_expiry_on_an_injected_clock(tmp_path: Path, ids: RelayIdentities) -> None:
    """In process, so the relay's clock can be moved: an item expires at min(exp, 30
    days), disappears from fetch at once and is purged (and counted) later."""
    import trio

    from tests.relay_env import relay_ingress

    ingress, port = relay_ingress(tmp_path, ids)
    clock = [time.time()]
    ingress.relay.clock = lambda: clock[0]
    now = int(clock[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(lambda task_status: ingress.run(handle_signals=False,
                                                           task_status=task_status))

        def calls() -> list[str]:
            recipient = RelayCaller(port, ids.recipient)
            sender = RelayCaller(port, ids.sender)
            recipient.allowlist_set([ids.sender.fingerprint])
            sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="soon",
                                               ts=now, exp=now + 60))
            sender.tool("relay_call", envelope(ids.sender, ids.recipient, msg_id="late",
                                               ts=now, exp=now + 30 * 86400))
            clock[0] = now + 61
            page = recipient.tool("fetch_queued", {})[0]["structuredContent"]["items"]
            recipient.close()
            sender.close()
            return [json.loads(b64url_decode(i["envelope"]["protected"]))["msg_id"]
                    for i in page]

        assert await trio.to_thread.run_sync(calls) == ["late"]
        assert await ingress.relay.purge() == 1
        assert ingress.stats.value("pact_ingress_relay_expired_items_total") == 1
        clock[0] = now + 30 * 86400 + 1
        assert await ingress.relay.purge() == 1
        assert ingress.relay.status()["queues"] == []
        await ingress.stop(deadline=1)
