"""Key rotation and revocation as an operator runs them and as a holder of a revoked key
would exploit them: pins spelled oddly in the config, a node key rotated with two pins
under traffic and then revoked while the edge still holds pooled connections to it, and
a connector that pins only an old ingress identity.

Real `serve` and `connect` processes on loopback (the rigs of tests/terminate_env.py and
tests/test_tunnel_attacks.py); every loop is bounded in count and time.
"""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pact_ingress.config.loader import load_config, load_connector_config
from pact_ingress.errors import ConfigError
from pact_ingress.identity import keygen
from pact_ingress.proto import workers as wp
from tests.relay_env import (
    RelayCaller,
    RelayH2,
    RelayServe,
    code_of,
    envelope,
    relay_identities,
    tool_body,
)
from tests.terminate_env import (
    HOST,
    RecordingNode,
    ServeEnv,
    exchange,
    forget,
    json_events,
    read_response,
    refusal_code,
    request_bytes,
    sealed_call_body,
    tls_socket,
)
from tests.test_reload_attacks import UNLIMITED
from tests.test_tunnel_attacks import (
    TM,
    Connect,
    World,
    get_status,
    node_connections,
    reload,
    wait_for,
)
from tests.test_workers import by_worker, poll, worker_pids

GOOD = "sha256:VMQn-nYYNbmhJNvkkNZO4_43tC4046AWxSTgnb8G3eY"

#: Ways an operator's copy of GOOD can go wrong; none may be taken for any pin.
ODD_SPELLINGS = [
    GOOD.upper(),  # the whole thing upper-cased
    "SHA256:" + GOOD[7:],  # the prefix only
    " " + GOOD,  # quoted with a leading blank
    GOOD + " ",
    GOOD + "=",  # base64 padding kept
    "sha256: " + GOOD[7:],
    "sha256:" + GOOD[7:].replace("-", "+").replace("_", "/"),  # standard alphabet
    "sha384:" + GOOD[7:],  # another hash's prefix
    "sha256:" + GOOD[7:-1] + "Z",  # padding bits set
    "sha256:" + GOOD[7:] + "A",  # one character too many
    "*",
    "sha256:*",
]


@pytest.mark.parametrize("spelling", ODD_SPELLINGS)
def test_an_oddly_spelled_pin_is_refused_at_its_file_and_line(tmp_path: Path,
                                                              spelling: str) -> None:
    """In a tenant file picked up by the include glob, in the connector's ingress.pin
    list: the config is refused, naming that file and the pin's line, never loaded with a
    pin that matches nothing (or everything)."""
    (tmp_path / "tenants.d").mkdir()
    tenant = tmp_path / "tenants.d" / "alina.yaml"
    tenant.write_text(f'name: alina\npins:\n  - "{GOOD[:-1]}A"\n  - "{spelling}"\n'
                      "routes: []\n")
    main = tmp_path / "ingress.yaml"
    main.write_text('identity: {key: ingress.key}\nstate_dir: state\n'
                    'listen: {tls: ["127.0.0.1:8443"]}\ninclude: tenants.d/*.yaml\n')
    with pytest.raises(ConfigError) as info:
        load_config(main)
    text = str(info.value)
    assert re.search(re.escape(str(tenant)) + r":4\b.*pin ", text), text

    key = keygen(tmp_path / "node.key")
    connector = tmp_path / "connector.yaml"
    connector.write_text(f"""\
identity: {{key: {key.key_path}}}
ingress:
  address: "127.0.0.1:443"
  tunnel_hostname: tunnel.example
  pin:
    - "{GOOD}"
    - "{spelling}"
forward: "127.0.0.1:8443"
""")
    with pytest.raises(ConfigError) as info:
        load_connector_config(connector)
    text = str(info.value)
    assert re.search(re.escape(str(connector)) + r":7\b.*ingress\.pin", text), text


# --- a terminate route's node key, rotated and revoked -----------------------------------

#: Client addresses, four for each of two workers (a client's worker is a hash of it).
SOURCES = [ip for w in (0, 1) for ip in [f"127.0.0.{i}" for i in range(2, 60)
                                         if wp.worker_for(f"127.0.0.{i}", 2) == w][:4]]


def _pins_config(env: ServeEnv, pins: list[str], node: RecordingNode) -> str:
    env.serve.node = node
    text = env.serve.render()
    return text.replace(f'pins: ["{env.serve.node_fp}"]',
                        "pins: [" + ", ".join(f'"{p}"' for p in pins) + "]")


def _round(env: ServeEnv) -> list[int]:
    """One GET from every source, each on a fresh client connection (the edge's
    upstream pool, per process, is what carries them to the node)."""
    return [exchange(env.serve.port, request_bytes("GET", "/whole/probe", HOST),
                     source=s).status for s in SOURCES]


@pytest.mark.parametrize("workers", [1, 2])
def test_node_key_rotation_serves_throughout_and_revocation_skips_the_pool(
        tmp_path: Path, workers: int) -> None:
    """pins [OLD] → [OLD, NEW] → the node switches to NEW → [NEW]: every request of every
    step is served. Then the revoked key is back at the node's address while the edge
    holds pooled connections to it: no request reaches it, in any process, and each is
    answered 502 with an `upstream_tls_failed` line; the pooled connections to it close
    with the reload itself. A sealed call addressed to the
    removed key is refused at the edge on connections opened before the removal."""
    env = ServeEnv.start(tmp_path, workers=workers)
    old_node = env.node
    new_key = keygen(tmp_path / "node-new.key", common_name="node new")
    new_node = RecordingNode(new_key, client_ca=env.ids.ingress)
    old, new = env.ids.node.fingerprint, new_key.fingerprint
    try:
        kept: list[ssl.SSLSocket] = []
        steps = [([old], old_node), ([old, new], old_node), ([old, new], new_node),
                 ([new], new_node)]
        for pins, node in steps:
            assert env.serve.reload(_pins_config(env, pins, node)) == "reloaded"
            for _ in range(2):  # the second round goes over the pooled connections
                assert set(_round(env)) == {200}, (pins, env.serve.logs()[-2000:])
            if node is new_node and len(pins) == 2:  # callers' keep-alive connections,
                # open across the next reload
                kept = [tls_socket(env.serve.port, HOST, source=s) for s in SOURCES]
                resp = exchange(env.serve.port, request_bytes(
                    "POST", "/mcp", HOST, body=sealed_call_body(env.ids, msg_id="to-old")))
                assert resp.status == 200 and refusal_code(resp.body) is None, resp.body
        # A sealed call addressed to the removed key, on connections opened while it was
        # pinned, is refused at the edge in every process: the node never sees it.
        seen = len(new_node.requests())
        try:
            for i, sock in enumerate(kept):
                sock.sendall(request_bytes("POST", "/mcp", HOST, body=sealed_call_body(
                    env.ids, msg_id=f"to-old-{i}")))
                resp = read_response(sock)
                assert refusal_code(resp.body) == "envelope_invalid", (resp.status, resp.body)
        finally:
            for sock in kept:
                forget(sock)
        assert len(new_node.requests()) == seen

        # Revoke: warm pools to the OLD node under [OLD], then [NEW] alone, same address.
        assert env.serve.reload(_pins_config(env, [old], old_node)) == "reloaded"
        assert set(_round(env)) == {200}
        reached = len(old_node.requests())
        assert node_connections(old_node) > 0  # pooled, idle
        assert env.serve.reload(_pins_config(env, [new], old_node)) == "reloaded"
        # the pooled connections to the revoked key close with the reload, not with
        # some later request that happens to pass through their process
        wait_for(lambda: node_connections(old_node) == 0,
                 "the revoked node's pooled connections closed", timeout=5.0)
        before = len([e for e in env.serve.log_events()
                      if e.get("event") == "upstream_tls_failed"])
        assert set(_round(env)) == {502}, env.serve.logs()[-2000:]
        assert len(old_node.requests()) == reached, "a request reached the revoked key"
        failed = [e for e in env.serve.log_events()
                  if e.get("event") == "upstream_tls_failed"][before:]
        assert len(failed) >= 1 and all(e["seen"] == old for e in failed), failed
        assert all(e["expected"] == [new] for e in failed), failed
    finally:
        env.stop()
        new_node.stop()


# --- the ingress's own identity, rotated under a connector -------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """serve --workers 2 with alina (passthrough) and bob (terminate) behind their
    connectors; the tests below leave alina as they found it."""
    w = World(tmp_path_factory.mktemp("key-rotation"))
    try:
        w.start_serve()
        w.start_connectors()
        yield w
    finally:
        w.close()


def test_connector_pinning_only_the_old_ingress_key_backs_off_then_two_pins_connect(
        world: World, tmp_path: Path) -> None:
    """The ingress serves a key the connector does not pin: each refusal is one
    `ingress_pin_mismatch` line naming what it expected and saw, and the attempts back
    off (bounded over a window, not a tight loop). With the old and the new pin listed,
    the same connector comes up."""
    w = world
    old_ingress = keygen(tmp_path / "ingress-old.key", common_name="ingress old")
    live = w.tunnels()["alina"][0]
    c = Connect(tmp_path, w.alina_key, old_ingress.fingerprint, w.port, w.alina_node.port,
                connections=2)
    try:
        window = 3.0
        time.sleep(window)
        lines = [e for e in json_events(c.logs()) if e.get("event") == "ingress_pin_mismatch"]
        # two slots, backoff from 0.5 s doubling: about 3 attempts per slot in 3 s
        assert 2 <= len(lines) <= 12, len(lines)
        assert all(e["seen"] == w.ingress.fingerprint
                   and e["expected"] == [old_ingress.fingerprint] for e in lines), lines
        assert w.tunnels()["alina"][0] == live
        assert c.proc is not None and c.proc.poll() is None  # it keeps trying

        c.kill()
        text = c.config.read_text().replace(
            f'pin: "{old_ingress.fingerprint}"',
            f'pin: ["{old_ingress.fingerprint}", "{w.ingress.fingerprint}"]')
        c.config.write_text(text)
        c.start()
        wait_for(lambda: w.tunnels()["alina"][0] == live + 2,
                 "the connector with both ingress pins up")
    finally:
        c.close()
    wait_for(lambda: w.tunnels()["alina"][0] == live, "alina as she was")


# --- a relay recipient's key revoked, then its whole tenant ------------------------------


def _relay_reload(serve: Any, text: str) -> None:
    serve.config.write_text(text)
    before = len([e for e in serve.log_events() if e.get("event") == "reloaded"])
    assert serve.proc is not None
    serve.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: len([e for e in serve.log_events() if e.get("event") == "reloaded"])
             > before, "the reload applied")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_revoked_relay_recipient_is_refused_on_its_open_connections(
        tmp_path: Path, workers: int) -> None:
    """A relay tenant with pins [OLD, NEW]; OLD holds keep-alive HTTP/1.1 connections from
    many addresses (so through every worker) and an HTTP/2 one, with mail queued. After [NEW] alone is reloaded,
    every request of OLD on those same connections — fetch, ack, its allow-list — and
    every call addressed to OLD is `permission_denied`, each logged, while NEW is served.
    Then the whole tenant goes: NEW is refused the same way."""
    ids = relay_identities(tmp_path)
    old, new, sender = ids.other, ids.recipient, ids.sender
    serve = RelayServe(tmp_path, recipients=[old, new], workers=workers)
    callers: list[RelayCaller] = []
    h2_conns: list[RelayH2] = []
    try:
        for who in (old, new):
            assert RelayCaller(serve.port, who).allowlist_set(
                [sender.fingerprint]).status == 200
        send = RelayCaller(serve.port, sender)
        result, _ = send.tool("relay_call", envelope(sender, old, msg_id="to-old"))
        assert result["structuredContent"]["status"] == "queued", result
        callers = [RelayCaller(serve.port, old, source=s) for s in SOURCES]
        for c in callers:  # each connection is up and served before the revocation
            result, _ = c.tool("fetch_queued", {})
            assert len(result["structuredContent"]["items"]) == 1, result
        item = result["structuredContent"]["items"][0]["id"]
        h2 = RelayH2(serve.port, old)  # and one HTTP/2 connection
        h2_conns.append(h2)
        res = h2.request("POST", "/relay/mcp", body=tool_body("fetch_queued", {}))
        assert len(json.loads(res.body)["result"]["structuredContent"]["items"]) == 1

        _relay_reload(serve, serve.render().replace(f'"{old.fingerprint}", ', ""))
        res = h2.request("POST", "/relay/mcp", body=tool_body("fetch_queued", {}))
        assert code_of(json.loads(res.body)["result"]) == "permission_denied", res.body
        for c in callers:
            sock = c.sock
            for name, args in (("fetch_queued", {}), ("ack", {"ids": [item]})):
                result, _ = c.tool(name, args)
                assert code_of(result) == "permission_denied", (name, result)
            assert c.allowlist_get().status != 200
            assert c.allowlist_set([sender.fingerprint]).status != 200
            assert c.sock is sock  # answered on the connection opened before the reload
        result, _ = send.tool("relay_call", envelope(sender, old, msg_id="to-old-2"))
        assert code_of(result) == "permission_denied", result
        refused = [e for e in serve.log_events() if e.get("event") == "relay_fetch_queued"
                   and e.get("caller") == old.fingerprint
                   and e.get("outcome") == "permission_denied"]
        assert len(refused) == len(callers) + 1, refused
        served = RelayCaller(serve.port, new)
        result, _ = send.tool("relay_call", envelope(sender, new, msg_id="to-new"))
        assert result["structuredContent"]["status"] == "queued", result
        result, _ = served.tool("fetch_queued", {})
        assert len(result["structuredContent"]["items"]) == 1, result

        text = serve.render()
        _relay_reload(serve, text[:text.index("tenants:")] + "tenants: []\n")
        result, _ = served.tool("fetch_queued", {})
        assert code_of(result) == "permission_denied", result
        result, _ = send.tool("relay_call", envelope(sender, new, msg_id="to-new-2"))
        assert code_of(result) == "permission_denied", result
    finally:
        for c in callers:
            c.close()
        for h in h2_conns:
            h.close()
        serve.stop()


# --- a tunnel connector's key rotated, the old one revoked while still connected ----------


def _bob_pins(w: World, pins: list[str]) -> None:
    text = w.config.read_text()
    start = text.index("  - name: bob\n    pins: [")
    end = text.index("]", start)
    w.config.write_text(text[:start] + "  - name: bob\n    pins: ["
                        + ", ".join(f'"{p}"' for p in pins) + text[end:])
    reload(w)


def _failures(w: World, rounds: int = 2) -> list[tuple[str, int | None]]:
    """GETs to bob's terminate route over the tunnel from every source; the ones not
    answered 200."""
    out = []
    for _ in range(rounds):
        for s in SOURCES:
            status = get_status(w.port, TM, source=s, path=f"/ping?r={time.monotonic_ns()}")
            if status != 200:
                out.append((s, status))
    return out


def test_tunnel_key_rotation_has_no_outage_and_the_revoked_connector_is_cut_and_backs_off(
        world: World, tmp_path: Path) -> None:
    """bob (terminate over the tunnel, served by two workers) rotates: [OLD, NEW], the
    new connector and node come up beside the old, then OLD is removed while its connector
    is still connected. No request fails at any step; the old connector is cut with
    KEY_UNPINNED, then refused as an unknown key, backing off; nothing reaches the old
    node after the revocation; the new key alone carries bob."""
    w = world
    new_key = keygen(tmp_path / "bob-new.key", common_name="bob node new")
    new_node = RecordingNode(new_key, client_ca=w.ingress)
    old = w.bob_key.fingerprint
    try:
        assert _failures(w) == []
        _bob_pins(w, [old, new_key.fingerprint])
        assert _failures(w) == []
        directory = tmp_path / "connect-bob-new"
        directory.mkdir()
        fresh = Connect(directory, new_key, w.ingress.fingerprint, w.port, new_node.port)
        try:
            wait_for(lambda: w.tunnels().get("bob", (0, 0))[0] == 4, "both bob connectors up")
            assert _failures(w) == []
            _bob_pins(w, [new_key.fingerprint])
            reached = len(w.bob_node.requests())
            assert _failures(w, rounds=3) == [], w.logs()[-3000:]
            assert len(w.bob_node.requests()) == reached, "the revoked node got requests"
            assert w.tunnels()["bob"][0] == 2

            revoked = w.connectors["bob"]
            wait_for(lambda: any(e.get("code") == "UNKNOWN_KEY" for e in json_events(
                revoked.logs()) if e.get("event") == "tunnel_key_refused"),
                "the old connector refused as unknown")
            first = [e.get("code") for e in json_events(revoked.logs())
                     if e.get("event") == "tunnel_key_refused"]
            assert first[0] == "KEY_UNPINNED", first
            start = len(first)
            time.sleep(2.0)
            later = [e for e in json_events(revoked.logs())
                     if e.get("event") == "tunnel_key_refused"][start:]
            assert len(later) <= 8, len(later)  # two slots backing off, not a tight loop
            refused = [e for e in w.events("tunnel_refused")
                       if e.get("reason") == "unknown_key" and e.get("fingerprint") == old]
            assert refused
            assert len(w.bob_node.requests()) == reached
        finally:
            fresh.close()
    finally:
        new_node.stop()


# --- the ingress's key file replaced in place before the restart that would apply it -----


def test_a_worker_respawned_after_the_key_file_changed_keeps_the_running_identity(
        tmp_path: Path) -> None:
    """An operator prepares the ingress key rotation by writing the new key over the
    configured path (`keygen -o identity.key --force`), meaning to restart later. Until
    then the running identity is the one every process presents: a worker that dies and
    is replaced must present it to the node too, not the file's new key (whose
    fingerprint no node pins yet, so that worker's clients would all get 502). A reload
    in between warns that the key changes only on restart."""
    env = ServeEnv.start(tmp_path, workers=2, limits=UNLIMITED)
    try:
        running = env.ids.ingress.fingerprint
        before = worker_pids(env.serve)
        keygen(env.ids.ingress.key_path, common_name="ingress next")  # same path
        # a reload meanwhile says the key is not applied, as for a key at another path
        assert env.serve.reload() == "reloaded"
        warned = [e for e in env.serve.log_events()
                  if e.get("event") == "reload_identity_unchanged"]
        assert len(warned) == 1, env.serve.logs()[-2000:]
        os.kill(before[0], signal.SIGKILL)
        poll(lambda: (w := env.serve.status()["workers"][0])["pid"] != before[0]
             and w["state"] == "ready", "worker 0 replaced")
        env.node.clear()
        statuses = [exchange(env.serve.port, request_bytes("GET", "/whole/x", HOST),
                             source=ip).status for ip in by_worker()[0][:4]]
        assert statuses == [200] * len(statuses), env.serve.logs()[-2000:]
        assert {r.peer for r in env.node.requests()} == {running}
        assert env.serve.status()["identity"] == running
    finally:
        env.stop()
