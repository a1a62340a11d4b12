"""One HTTP request to the relay host, on the edge's HTTP engine (`net.http_exchange`).

Theory of operation
-------------------
`net.http1` / `net.http2` turn a relay connection into `Exchange`s exactly as they do
for terminate routes; `RelayExchange.run` is the relay's story on one of them, whatever
the HTTP version:

1. **Target** (`proto.http_request.parse_target`, the edge's own rules): a target that
   cannot be read unambiguously → 400; Host / `:authority` / an absolute-form authority
   must name the relay host (421 otherwise). The normalised path is then matched
   *exactly*: ``/relay/mcp`` and ``/relay/allowlist``; anything else → 404 (so
   ``//relay/mcp`` and ``/relay/./mcp`` are the endpoint, as the normaliser reads them,
   and ``/RELAY/mcp`` is not). A wrong method → 405 with ``Allow``.
2. **Body**: a declared length over the endpoint's cap → ``too_large`` (413) before
   reading; otherwise read whole against the same cap and one deadline for the whole
   body (`BODY_TIMEOUT`). Every byte held counts in the server's `buffers` (per client
   address and per process, as the terminate engine counts its bodies): beyond a share
   → ``rate_limited`` (429, this address) or ``unavailable`` (503, the process). A
   client that misses the deadline or leaves is dropped without an answer
   (`net.http_exchange.ClientGone`): nothing was queued.
3. **JSON-RPC** at ``/relay/mcp``: parse (in a worker thread over
   `INLINE_CHECK_BYTES`; a body that may hold more than `proto.posture.MAX_JSON_VALUES`
   values is refused -32600 before it is parsed, as on terminate routes), shape,
   notification (202), identity — a connection without a
   client certificate gets ``identity_required`` (401) for every request that would
   act —, then dispatch to the tools on `RelayServer`.
4. **Answer**: JSON, ``Content-Length``, ``Cache-Control: no-store``. An answer
   given before the body was read first stops the upload (`Exchange.stop_body`: HTTP/1.1
   closes after it, HTTP/2 resets the stream with NO_ERROR).

Nothing here queues anything before step 3 has found a caller key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from pact_ingress import __version__
from pact_ingress.identity import PublicKey
from pact_ingress.logs import log
from pact_ingress.net.http_exchange import BodyBuffer, Exchange, Headers
from pact_ingress.proto import relay as rules
from pact_ingress.proto.http_request import BadRequest, Target, check_host, parse_target
from pact_ingress.proto.ratelimit import Limited, client_bucket
from pact_ingress.proto.relay import Refusal
from pact_ingress.proto.shares import Refused
from pact_ingress.relay.store import StoreUnavailable

T = TypeVar("T")

if TYPE_CHECKING:
    from pact_ingress.relay.server import RelayServer

MCP_PATH = "/relay/mcp"
ALLOWLIST_PATH = "/relay/allowlist"
#: Body of an allow-list POST: MAX_ALLOWLIST fingerprints of ~55 bytes, quoted.
MAX_ALLOWLIST_BODY = 1024 * 1024
#: One deadline for reading a whole request body (slow-loris bound on the largest one).
BODY_TIMEOUT = 60.0
#: MCP protocol version answered when the client names none we can echo.
MCP_VERSION = "2025-06-18"
#: Bodies larger than this are parsed (and their relay_call checked) in a worker thread,
#: one at a time, as the terminate engine does with its large bodies: decoding and
#: verifying megabytes would stall every other connection; below it a thread hand-off
#: costs more CPU than the work it moves (measured: see README, Relay performance).
INLINE_CHECK_BYTES = 64 * 1024
#: fetch_queued calls of one caller being answered at once (its page built or being
#: sent); more are answered rate_limited. One, and one retry of a fetch its client gave
#: up on while the first is still being written.
MAX_FETCHES_IN_FLIGHT = 2

#: The two endpoints spelled exactly, as `parse_target` reads them: the usual request
#: skips the normaliser (every other spelling still goes through it).
_EXACT = {raw.encode(): Target(raw, None, None) for raw in (MCP_PATH, ALLOWLIST_PATH)}

#: Request-body bytes the relay holds at once while reading them: per client address,
#: three maximal calls; per process, what a small VPS can spare. HTTP/2 multiplexes up
#: to 100 streams per connection, so without these one connection could make the relay
#: buffer a gigabyte.
MAX_BUFFERED_PER_CLIENT = 3 * rules.MAX_REQUEST_BYTES
MAX_BUFFERED_TOTAL = 256 * 1024 * 1024

_JSON = (b"content-type", b"application/json")
_dumps = json.JSONEncoder().encode  # `json.dumps` with its defaults, the encoder built once
_NO_STORE = (b"cache-control", b"no-store")


class _TooLarge(Exception):
    """The body is over the endpoint's cap (declared or sent)."""


class _Busy(Exception):
    """Holding this body would cross a buffer share (`MAX_BUFFERED_*`)."""

    def __init__(self, refused: Refused) -> None:
        super().__init__(refused.value)
        self.refused = refused

    def refusal(self) -> Refusal:
        if self.refused is Refused.CLIENT:
            return Refusal(rules.RATE_LIMITED,
                           "too much request data in flight from your address", 1)
        return Refusal(rules.UNAVAILABLE, "the relay is busy")

    @property
    def status(self) -> int:
        return 429 if self.refused is Refused.CLIENT else 503


class RelayExchange:
    """One request to the relay host (module docstring)."""

    def __init__(self, server: RelayServer, caller: tuple[str, PublicKey] | None,
                 client: tuple[str, int], ex: Exchange, bucket: str | None = None) -> None:
        self.server, self.caller, self.client, self.ex = server, caller, client, ex
        self.size = 0  # the request body's length, once read
        self.held = 0  # body bytes this request holds in the server's `buffers`
        # whose share they count in (the connection computes it once for its requests)
        self.bucket = bucket or client_bucket(client[0]) or client[0]

    async def run(self) -> None:
        ex = self.ex
        try:
            target = _EXACT.get(ex.target) or parse_target(ex.target)
            check_host(ex.authority, target, self.server.host, self.server.host)
        except BadRequest as exc:
            await self._json(exc.status, {"code": rules.BAD_REQUEST, "message": exc.why})
            return
        method, path = ex.method, target.path
        if path == MCP_PATH:
            if method != "POST":
                await self._json(405, {"code": "bad_request", "message": "POST only"},
                                 [(b"allow", b"POST")])
            else:
                await self._mcp()
        elif path == ALLOWLIST_PATH:
            if method not in ("GET", "POST"):
                await self._json(405, {"code": "bad_request", "message": "GET or POST"},
                                 [(b"allow", b"GET, POST")])
            else:
                await self._allowlist(method)
        else:
            await self._json(404, {"code": "bad_request", "message": "not found"})

    # --- plumbing ------------------------------------------------------------------------

    async def _body(self, cap: int) -> bytes:
        """The whole body; `_TooLarge` over `cap`, `_Busy` past a buffer share,
        `ClientGone` past the deadline. Every byte is counted in the server's `buffers`
        before it is kept (the caller gives them back, `release`), as it comes: counted
        as declared, heads that send nothing after them would hold the shares."""
        ex = self.ex
        if ex.content_length is not None and ex.content_length > cap:
            raise _TooLarge()
        deadline = trio.current_time() + BODY_TIMEOUT
        body = BodyBuffer()  # about its bytes, however small the chunks
        while chunk := await ex.receive(deadline):
            size = body.size + len(chunk)
            if size > cap:
                raise _TooLarge()
            if size > self.held:
                self._hold(size - self.held)
            body.add(chunk)
        return body.whole()

    def _hold(self, n: int) -> None:
        refused = self.server.buffers.take(self.bucket, n)
        if refused is not None:
            raise _Busy(refused)
        self.held += n

    def release(self) -> None:
        """The request is over: give back the body bytes it held."""
        if self.held:
            self.server.buffers.give(self.bucket, self.held)
            self.held = 0

    async def _send(self, status: int, body: bytes, headers: Headers) -> None:
        ex = self.ex
        ex.stop_body()  # a no-op once the body was read whole
        await ex.respond_whole(status, [*headers, (b"content-length", str(len(body)).encode())],
                               body if ex.method != "HEAD" else b"")

    async def _json(self, status: int, obj: Any,
                    headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self._send(status, json.dumps(obj).encode(), [_JSON, _NO_STORE, *(headers or ())])

    def _refused(self, code: str) -> None:
        self.server.stats.relay_refusals.labels(code).inc()

    # --- /relay/allowlist ----------------------------------------------------------------

    async def _allowlist(self, method: str) -> None:
        if self.caller is None:
            self._refused(rules.IDENTITY_REQUIRED)
            await self._json(401, {"code": rules.IDENTITY_REQUIRED,
                                   "message": "present your PACT key as a client certificate"})
            return
        fp = self.caller[0]
        body = b""
        if method == "POST":
            try:
                body = await self._body(MAX_ALLOWLIST_BODY)
            except _TooLarge:
                self._refused(rules.TOO_LARGE)
                await self._json(413, {"code": rules.TOO_LARGE, "message": "body too large"})
                return
            except _Busy as busy:
                refusal = busy.refusal()
                self._refused(refusal.code)
                await self._json(busy.status, {"code": refusal.code,
                                               "message": refusal.reason},
                                 [(b"retry-after", b"1")])
                return
        server = self.server
        try:
            if fp not in server.recipients:
                raise rules.denied()
            if method == "GET":
                # a shared store's list may have been set via another instance: read
                # what is stored, not this instance's last copy
                await server._ensure_store()
                senders = sorted(server.store.allowlists().get(fp, ()))
                await self._json(200, {"senders": senders})
                return
            parsed = rules.parse_allowlist(body)
            await server._ensure_store()
            await server.set_allowlist(fp, parsed)
        except Refusal as exc:
            self._refused(exc.code)
            status = {rules.PERMISSION_DENIED: 403, rules.TOO_LARGE: 413}.get(exc.code, 400)
            await self._json(status, {"code": exc.code, "message": exc.reason})
            return
        except StoreUnavailable:
            self._refused(rules.UNAVAILABLE)
            await self._json(503, {"code": rules.UNAVAILABLE,
                                   "message": "relay store unavailable"})
            return
        log.info("relay_allowlist", recipient=fp, senders=len(parsed), client_ip=self.client[0])
        await self._json(200, {"senders": len(parsed)})

    # --- /relay/mcp ----------------------------------------------------------------------

    async def _mcp(self) -> None:
        try:
            body = await self._body(rules.MAX_REQUEST_BYTES)
        except _TooLarge:
            self._refused(rules.TOO_LARGE)
            await self._json(413, _rpc(None, result=rules.tool_error(
                Refusal(rules.TOO_LARGE, f"request over {rules.MAX_REQUEST_BYTES} bytes"))))
            return
        except _Busy as busy:
            refusal = busy.refusal()
            self._refused(refusal.code)
            await self._json(busy.status, _rpc(None, result=rules.tool_error(refusal)),
                             [(b"retry-after", b"1")])
            return
        self.size = len(body)
        try:
            message = await self._parse(body)
        except rules.TooManyValues as exc:  # refused unparsed, as the terminate edge does
            await self._json(400, _rpc(None, error=(-32600, f"Invalid Request: {exc}")))
            return
        except (ValueError, RecursionError):
            await self._json(400, _rpc(None, error=(-32700, "Parse error")))
            return
        if not isinstance(message, dict) or not isinstance(message.get("method"), str) or (
                message.get("jsonrpc") != "2.0"):
            what = "batches are not supported" if isinstance(message, list) else \
                "not a JSON-RPC 2.0 request"
            await self._json(400, _rpc(None, error=(-32600, f"Invalid Request: {what}")))
            return
        if "id" not in message:  # a notification: nothing to answer
            await self._send(202, b"", [])
            return
        rpc_id = message["id"]
        if not _valid_id(rpc_id):
            # echoing it would answer with any structure the caller chose (one nested
            # deeper than the event loop's stack can encode, parsed in a thread)
            await self._json(400, _rpc(None, error=(
                -32600, "Invalid Request: id must be a string, integer or null")))
            return
        params = message.get("params")
        params = params if isinstance(params, dict) else {}
        if self.caller is None:
            self._refused(rules.IDENTITY_REQUIRED)
            refusal = Refusal(rules.IDENTITY_REQUIRED,
                              "the relay needs your PACT key as a TLS client certificate")
            if message["method"] == "tools/call":
                await self._json(401, _rpc(rpc_id, result=rules.tool_error(refusal)))
            else:
                await self._json(401, _rpc(rpc_id, error=(
                    -32001, str(refusal), {"code": rules.IDENTITY_REQUIRED})))
            return
        fp = self.caller[0]
        fetching = self.server.fetching
        fetch = message["method"] == "tools/call" and params.get("name") == "fetch_queued"
        if fetch:
            if fetching.get(fp, 0) >= MAX_FETCHES_IN_FLIGHT:
                # pages of one queue are the same oldest items: more at once only hold
                # memory (up to 16 MiB of envelopes each, several times that while built)
                # until a client that may never read takes them
                self._refused(rules.RATE_LIMITED)
                log.info("relay_fetch_queued", caller=fp, client_ip=self.client[0],
                         outcome=rules.RATE_LIMITED, reason="fetches in flight")
                await self._json(200, _rpc(rpc_id, result=rules.tool_error(Refusal(
                    rules.RATE_LIMITED, "another fetch of this queue is still in flight", 1))))
                return
            fetching[fp] = fetching.get(fp, 0) + 1
        try:
            answer = await self._dispatch(rpc_id, message["method"], params)
            await self._send(200, answer if isinstance(answer, bytes)
                             else json.dumps(answer).encode(), [_JSON, _NO_STORE])
        finally:
            if fetch:  # the page is sent (or given up): its slot is free
                left = fetching[fp] - 1
                if left:
                    fetching[fp] = left
                else:
                    del fetching[fp]

    async def _parse(self, body: bytes) -> Any:
        """The JSON document; megabytes of it are parsed in a worker thread (one at a
        time), so a large call does not stall every other connection."""
        if len(body) <= INLINE_CHECK_BYTES:
            return rules.loads(body)
        return await in_thread(rules.loads, body, limiter=self.server.large_slot)

    async def _dispatch(self, rpc_id: Any, method: str, params: dict[str, Any]
                        ) -> dict[str, Any] | bytes:
        if method == "initialize":
            version = params.get("protocolVersion")
            return _rpc(rpc_id, result={
                "protocolVersion": version if isinstance(version, str) else MCP_VERSION,
                "capabilities": {"tools": {"listChanged": False}},
                "serverInfo": {"name": "pact-ingress-relay", "version": __version__}})
        if method == "ping":
            return _rpc(rpc_id, result={})
        if method == "tools/list":
            return _rpc(rpc_id, result={"tools": rules.TOOLS})
        if method != "tools/call":
            return _rpc(rpc_id, error=(-32601, f"Method not found: {method[:64]}"))
        name = params.get("name")
        arguments = params.get("arguments", {})
        if name not in ("relay_call", "fetch_queued", "ack"):
            shown = name[:64] if isinstance(name, str) else type(name).__name__
            return _rpc(rpc_id, error=(-32602, f"Unknown tool: {shown}"))
        result = await self._tool(name, arguments)
        if isinstance(result, str):  # a relay_call queued: its msg_id
            return _queued_answer(rpc_id, result)
        return _rpc(rpc_id, result=result)

    async def _tool(self, name: str, arguments: object) -> dict[str, Any] | str:
        """The tool's MCP result; a relay_call that queued answers its msg_id alone (the
        answer is then built straight as bytes: `_queued_answer`)."""
        assert self.caller is not None
        fp, key = self.caller
        server = self.server
        started = trio.current_time()
        fields: dict[str, Any] = {}
        if name == "relay_call" and isinstance(arguments, dict):
            fields["bytes"] = sum(len(v) for v in arguments.values() if isinstance(v, str))
        try:
            await server._ensure_store()
            if name == "relay_call":
                await self._charge(fp)
                msg_id = await server.relay_call(fp, key, arguments, fields, self.size)
                outcome, result = "ok", msg_id
            else:
                if name == "fetch_queued":
                    data = await server.fetch_queued(fp, arguments)
                    fields = {"items": len(data["items"]), "more": data["more"]}
                else:
                    data = await server.ack(fp, arguments)
                    fields = {"acked": data["acked"]}
                outcome, result = "ok", rules.tool_result(data)
        except Refusal as exc:
            outcome, result = exc.code, rules.tool_error(exc)
            if exc.code != rules.PERMISSION_DENIED:
                fields["reason"] = exc.reason
        except StoreUnavailable as exc:
            outcome = rules.UNAVAILABLE
            result = rules.tool_error(Refusal(rules.UNAVAILABLE, "relay store unavailable"))
            fields["reason"] = str(exc)
        if outcome != "ok":
            self._refused(outcome)
        duration_ms = round((trio.current_time() - started) * 1000, 2)
        if name == "relay_call":
            # the hot tool's line goes with the access lines (buffered, one write for
            # many; any other line flushes them first, so the order holds)
            log.access("relay_relay_call", caller=fp, client_ip=self.client[0],
                       outcome=outcome, duration_ms=duration_ms, **fields)
        else:
            log.info("relay_" + name, caller=fp, client_ip=self.client[0], outcome=outcome,
                     duration_ms=duration_ms, **fields)
        return result

    async def _charge(self, fp: str) -> None:
        """One call of the caller's budget, or `rate_limited` with when to come back."""
        server = self.server
        decision = await server.limiter.check_calls(
            self.client[0], (fp,), trio.current_time(), budget=server.budget,
            scope=server.host)
        if isinstance(decision, Limited):
            raise Refusal(rules.RATE_LIMITED, "over the call budget", decision.retry_after)


async def in_thread(fn: Callable[..., T], *args: Any, limiter: trio.CapacityLimiter) -> T:
    """`trio.to_thread.run_sync(fn, *args)`, with what `fn` raises raised from here
    without the thread's frames.

    An exception's traceback holds its frames, and each frame its callers' (`f_back`),
    up to the thread's own frames, which then hold the exception itself on its way back:
    a reference cycle that keeps the call's body or parsed document (megabytes here)
    alive until a full collection, so a caller whose large calls are all refused would
    pile them up. The exception crosses back bare (no traceback, no chained context:
    it is an answer, such as a refusal, not a bug) and this frame lets go of it."""
    value, error = await trio.to_thread.run_sync(_catching, fn, args, limiter=limiter)
    if error is None:
        return value  # type: ignore[return-value]
    try:
        raise error
    finally:
        del error


def _catching(fn: Callable[..., T], args: tuple[Any, ...]
              ) -> tuple[T | None, Exception | None]:
    try:
        return fn(*args), None
    except Exception as exc:  # noqa: BLE001 - raised again by `in_thread`
        exc.__context__ = exc.__cause__ = None
        return None, exc.with_traceback(None)


def _valid_id(rpc_id: Any) -> bool:
    """A JSON-RPC id as the terminate edge takes it: a string, an integer or null."""
    return rpc_id is None or isinstance(rpc_id, str) or (
        isinstance(rpc_id, int) and not isinstance(rpc_id, bool))


def _queued_answer(rpc_id: Any, msg_id: str) -> bytes:
    """`json.dumps(_rpc(rpc_id, result=rules.tool_result(rules.queued(msg_id))))`, the
    same bytes, built from its two variable parts (the answer of every queued call)."""
    data = f'{{"status": "queued", "msg_id": {_dumps(msg_id)}}}'
    return (f'{{"jsonrpc": "2.0", "id": {_dumps(rpc_id)}, "result": {{"content": '
            f'[{{"type": "text", "text": {_dumps(data)}}}], "structuredContent": {data}}}}}'
            ).encode()


def _rpc(rpc_id: Any, *, result: Any = None, error: tuple[Any, ...] | None = None
         ) -> dict[str, Any]:
    if error is not None:
        err: dict[str, Any] = {"code": error[0], "message": error[1]}
        if len(error) > 2:
            err["data"] = error[2]
        return {"jsonrpc": "2.0", "id": rpc_id, "error": err}
    return {"jsonrpc": "2.0", "id": rpc_id, "result": result}
