"""The relay store across the worker channel: a worker's `RelayStore`, main's answers.

Theory of operation
-------------------
With `serve --workers N` a worker serves the relay host's connections (TLS, HTTP, the
JSON-RPC, every check of a relay_call including its signature, the caller's budget),
but the queue keeps exactly one writer: main's store (SQLite's group commit, or Redis).
`RemoteStore` is the `RelayStore` a worker's `RelayServer` is given: each queue
operation is a record (`proto.workers.encode_relay`: op, small JSON fields, the
envelope bytes as they are; an enqueue, every relay_call's, packs its fixed fields
instead: `encode_enqueue`, answered by `encode_enqueued`) with an id, and waits for
main's answer of that id.
`StoreService` is main's side: it runs the operation on main's store and answers.
Records travel in batches both ways (`proto.workers.Outbox`): every operation the
worker's tasks started in one scheduler pass goes in one RELAY_ASK, every answer main
has ready in one RELAY_ANSWER — one wakeup and one syscall per burst instead of per
call, which is most of what crossing processes costs.

Durability is main's: an enqueue is answered OK only after main's `store.enqueue`
returned, i.e. after its COMMIT (fsync) or Redis write, so a worker says ``queued``
only for what is durable. Whatever goes wrong between the two — the channel breaks, the
worker or main is killed, no answer within `ASK_TIMEOUT` — the waiting call raises
`StoreUnavailable` and its caller is answered ``unavailable``: at worst an item is
stored and its sender, told unavailable, retries and gets the duplicate answer, never
a ``queued`` for an item that is not there.

Reads of the SQLite store skip the channel: main's state names its file, and a worker
answers `fetch` from its own read-only connection to it (`store.FileReader`: WAL lets
readers in other processes see every committed transaction, and main answers an enqueue
or an ack only after its COMMIT, so the page is exactly the one main would read). A
page of a thousand envelopes then crosses no process boundary. A shared store (Redis)
has no file, and any failure of the direct read (the file moved, a lock held too long)
falls back to asking main; so does a worker told main's store is broken (main probes).

Wakes stay in main: the service wakes the recipient's tenant after every enqueue it
answers queued, a duplicate included (main holds the tunnels).

The two synchronous reads, `allowlists()` and `depths()`, are a worker's copies of
main's, pushed as RELAY_STATE: when a worker starts, whenever main's allow-lists
mapping changes (the store replaces it, never mutates it, so an identity check finds
a change), and when main's store changes health (checked every `STATE_INTERVAL`);
depths ride along (only main reads them: status and has_mail; a worker's copy is
informational). An allow-list change is answered to whoever made it only after every
running worker confirmed the new lists (RELAY_STATE_TAKEN, bounded by `STATE_WAIT`: a
worker that does not read its channel for that long is stuck anyway), so a call that
follows the answer, through whichever worker, is judged against them. A worker that
missed that bound (stopped, starved) may judge a call against older lists, so main
checks an enqueue's sender against its own lists once more and answers ``unavailable``
for a sender no longer on them. Main accepts operations only for the recipients its own
config serves. A shared store (Redis) has a
`refresh` that re-reads what other instances changed: a worker forwards it (one
round trip per tool call, as the Redis store itself costs), main refreshes and pushes
any change before answering.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from pact_ingress.logs import log
from pact_ingress.proto import workers as wp
from pact_ingress.proto.workers import Kind, RelayOp, RelayStatus
from pact_ingress.relay.store import (
    Enqueued,
    FileReader,
    Item,
    MsgIdTaken,
    QueueFull,
    SqliteStore,
    StoreUnavailable,
)

_ENQUEUED = bytes([RelayStatus.ENQUEUED])

#: A worker waits this long for main's answer (main's own store gives up after 30 s).
ASK_TIMEOUT = 35.0
#: An allow-list change waits this long for every worker to confirm the new lists.
STATE_WAIT = 2.0
#: Main looks for changes it was not told of (the store reopened, purges) this often.
STATE_INTERVAL = 1.0


class RemoteStore:
    """A worker's `RelayStore`: main's store, reached over the worker channel."""

    #: a worker's depths are main's copies; main's own store says whether it counted
    depths_known = True

    def __init__(self, send: Callable[[Kind, bytes, int], Awaitable[None]],
                 next_id: Callable[[], int]) -> None:
        self._send = send
        self._next_id = next_id
        #: asks in flight: their wakeup, main's answer once there, when to give up
        self._waiting: dict[int, tuple[trio.Event, list[bytes], float]] = {}
        self._outbox = wp.Outbox()
        self._ready = trio.Event()
        self._allowlists: dict[str, frozenset[str]] = {}
        self._depths: dict[str, tuple[int, int]] = {}
        self._shared = False
        self._gone = False
        self._main_healthy = True  # main's store, as its last word said
        #: main's SQLite file, read directly for `fetch` (None: ask main, e.g. Redis)
        self._reader: FileReader | None = None
        self._reading = trio.CapacityLimiter(1)  # one thread at a time on its connection
        self.clock: Callable[[], float] = time.time
        self.last_error: str | None = None

    @property
    def healthy(self) -> bool:
        return self._main_healthy and not self._gone

    # -- lifecycle: main's store has its own ----------------------------------------

    async def open(self) -> None:
        """Nothing to open: main's store is running."""

    async def aclose(self) -> None:
        self.fail_all()
        if self._reader is not None:
            async with self._reading:  # not under a read in its thread
                self._reader.close()

    def set_bounds(self, max_items: int, max_bytes: int) -> None:
        """Main's store applies the bounds of main's config."""

    async def probe(self) -> None:
        """Ask main to probe its store (it reopens a broken one when that is due)."""
        try:
            out, _ = await self._ask(RelayOp.PROBE, {})
        except StoreUnavailable:
            return
        self._health(bool(out.get("healthy")), out.get("last_error"))

    def _health(self, healthy: bool, error: object) -> None:
        self._main_healthy = healthy
        self.last_error = None if healthy else str(error or "relay store unavailable")

    async def purge(self) -> int:
        return 0  # main purges

    # -- the channel ----------------------------------------------------------------

    async def run(self) -> None:
        """The sender (operations gathered since the last message go in one message) and
        the clock that gives up on asks main left unanswered."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire)
            while not self._gone:
                await self._ready.wait()
                self._ready = trio.Event()
                for payload in self._outbox.take():
                    try:
                        await self._send(Kind.RELAY_ASK, payload, 0)
                    except (OSError, trio.ClosedResourceError):
                        self.fail_all()
                        break
            nursery.cancel_scope.cancel()

    async def _expire(self) -> None:
        """Wake every ask older than `ASK_TIMEOUT` (its caller sees no answer): one sweep a
        second instead of a cancel scope per ask."""
        while True:
            await trio.sleep(1.0)
            now = trio.current_time()
            for event, answer, deadline in list(self._waiting.values()):
                if deadline <= now and not answer:
                    event.set()

    def answered(self, payload: bytes) -> None:
        """A RELAY_ANSWER: the outcomes of operations, by id."""
        for req_id, answer in wp.decode_records(payload):
            waiting = self._waiting.get(req_id)
            if waiting is not None:
                waiting[1].append(answer)
                waiting[0].set()

    def fail_all(self) -> None:
        """The channel to main closed: every waiting call and every later one fails."""
        self._gone = True
        self.last_error = "the main process is unreachable"
        for event, _, _ in self._waiting.values():
            event.set()

    def apply_state(self, doc: dict[str, Any]) -> None:
        lists = doc.get("allowlists")
        if isinstance(lists, dict):
            self._allowlists = {str(k): frozenset(str(s) for s in v)
                                for k, v in lists.items() if isinstance(v, list)}
        depths = doc.get("depths")
        if isinstance(depths, dict):
            self._depths = {str(k): (int(v[0]), int(v[1])) for k, v in depths.items()
                            if isinstance(v, list) and len(v) == 2}
        self._shared = bool(doc.get("shared"))
        path = doc.get("sqlite_path")
        # a reader replaced here may be mid-read in its thread: dropped, not closed (its
        # connection closes when the read is over and nothing holds it)
        if not isinstance(path, str):
            self._reader = None
        elif self._reader is None or str(self._reader.path) != path:
            self._reader = FileReader(Path(path))
        if "healthy" in doc:
            self._health(bool(doc["healthy"]), doc.get("last_error"))

    async def _ask(self, op: RelayOp, doc: dict[str, Any], blob: bytes = b""
                   ) -> tuple[dict[str, Any], bytes]:
        return self._outcome(await self._call(wp.encode_relay(op, doc, blob)))

    async def _call(self, ask: bytes) -> bytes:
        """Main's answer to one encoded ask (`StoreUnavailable` when none comes)."""
        if self._gone:
            raise StoreUnavailable("the main process is unreachable")
        req_id = self._next_id()
        event = trio.Event()
        answer: list[bytes] = []
        self._waiting[req_id] = (event, answer, trio.current_time() + ASK_TIMEOUT)
        try:
            if self._outbox.add(req_id, ask):
                self._ready.set()
            await event.wait()
        finally:
            self._waiting.pop(req_id, None)
        if not answer:
            raise StoreUnavailable("no answer from the main process")
        return answer[0]

    def _outcome(self, answer: bytes) -> tuple[dict[str, Any], bytes]:
        """An `encode_relay` answer: OK's document and bytes, or the failure it names."""
        status, out, rest = wp.decode_relay(answer)
        if status == RelayStatus.OK:
            return out, rest
        if status == RelayStatus.QUEUE_FULL:
            raise QueueFull(int(out.get("retry_after", 1)))  # type: ignore[call-overload]
        if status == RelayStatus.MSG_ID_TAKEN:
            raise MsgIdTaken("")
        reason = str(out.get("reason", "relay store unavailable"))
        if out.get("broken"):  # main's store, not just this call: probe before the next
            self._health(False, reason)
        raise StoreUnavailable(reason)

    # -- RelayStore -----------------------------------------------------------------

    async def refresh(self) -> None:
        if self._shared:
            await self._ask(RelayOp.REFRESH, {})

    async def enqueue(self, recipient: str, sender: str, msg_id: str, envelope: bytes,
                      expires_at: int) -> Enqueued:
        answer = await self._call(wp.encode_enqueue(recipient, sender, msg_id,
                                                    int(expires_at), envelope))
        if answer[:1] == _ENQUEUED:
            return Enqueued(*wp.decode_enqueued(answer))
        self._outcome(answer)  # raises what main's answer says went wrong
        raise StoreUnavailable("unexpected answer from the main process")

    async def fetch(self, recipient: str, limit: int) -> tuple[list[Item], bool]:
        reader = self._reader
        if reader is not None and self.healthy:
            # main's SQLite file, read here: no page crosses the channel (see FileReader
            # for why it sees exactly what main would); on any failure, ask main
            now = int(self.clock())
            try:
                async with self._reading:
                    return await trio.to_thread.run_sync(reader.fetch, recipient, now, limit)
            except (sqlite3.Error, OSError) as exc:
                log.warning("relay_direct_read_failed", error=f"{type(exc).__name__}: {exc}")
        out, blob = await self._ask(RelayOp.FETCH, {"recipient": recipient, "limit": limit})
        items: list[Item] = []
        at = 0
        for item_id, queued_at, size in out["items"]:
            items.append(Item(int(item_id), int(queued_at), blob[at:at + size]))
            at += size
        return items, bool(out["more"])

    async def ack(self, recipient: str, ids: list[int]) -> int:
        out, _ = await self._ask(RelayOp.ACK, {"recipient": recipient, "ids": ids})
        return int(out["acked"])

    async def set_allowlist(self, recipient: str, senders: tuple[str, ...]) -> None:
        await self._ask(RelayOp.SET_ALLOWLIST, {"recipient": recipient,
                                                "senders": list(senders)})

    def allowlists(self) -> dict[str, frozenset[str]]:
        return self._allowlists

    def depths(self) -> dict[str, tuple[int, int]]:
        return self._depths


class StoreService:
    """Main's side: runs workers' asks on the relay's store, pushes its allow-lists."""

    def __init__(self, relay: Any) -> None:
        self.relay = relay  # the RelayServer whose store (and wake) main owns
        self._pushed: object = None  # the allow-lists mapping last pushed
        #: sends RELAY_STATE to every running worker and waits for their confirmations
        self.broadcast: Callable[[bytes], Awaitable[None]] | None = None
        self._pushing = trio.Lock()
        self._pushed_health = True

    def state(self) -> bytes:
        store = self.relay.store
        return wp.encode_json({
            "allowlists": {k: sorted(v) for k, v in store.allowlists().items()},
            "depths": {k: list(v) for k, v in store.depths().items()},
            "shared": not isinstance(store, SqliteStore),
            "sqlite_path": str(store.path) if isinstance(store, SqliteStore) else None,
            "healthy": store.healthy, "last_error": store.last_error})

    async def push_if_changed(self) -> None:
        """Push the allow-lists when the store's mapping is not the one pushed last."""
        async with self._pushing:
            lists = self.relay.store.allowlists()
            if lists is self._pushed or self.broadcast is None:
                return
            self._pushed = lists
            await self.broadcast(self.state())

    async def run(self) -> None:
        """Pick up changes nobody announced: the store (re)opened and read its lists,
        its health changed. Depths ride along with any push; alone they do not cause
        one (only main reads them)."""
        while True:
            await trio.sleep(STATE_INTERVAL)
            try:
                store = self.relay.store
                if store.healthy != self._pushed_health:
                    self._pushed = None  # push even if the lists are the same mapping
                self._pushed_health = store.healthy
                await self.push_if_changed()
            except Exception as exc:  # a push must never end main
                log.error("relay_state_push_failed", error=f"{type(exc).__name__}: {exc}")

    def answer_soon(self, payload: bytes, reply: Callable[[bytes], None]) -> bool:
        """An enqueue answered without a task of its own, when main's store can
        (SQLite, healthy): the checks now, the store's job queued now, `reply(answer)`
        on the trio thread after its COMMIT. False: nothing done, use `answer`.
        A malformed ask raises `ProtocolError` (the channel is dropped), as `answer`."""
        if not payload or payload[0] != RelayOp.ENQUEUE:
            return False
        relay = self.relay
        store = relay.store
        enqueue_soon = getattr(store, "enqueue_soon", None)
        if enqueue_soon is None or not store.healthy:
            return False
        _, doc, blob = wp.decode_ask(payload)
        try:
            recipient, sender = self._enqueue_allowed(doc)

            def then(done: Enqueued | None, error: BaseException | None) -> None:
                if done is not None and error is None:
                    relay.woken(recipient)  # a duplicate too: see `RelayServer.relay_call`
                    reply(wp.encode_enqueued(done.id, done.duplicate))
                elif isinstance(error, QueueFull):
                    reply(wp.encode_relay(RelayStatus.QUEUE_FULL,
                                          {"retry_after": error.retry_after}))
                elif isinstance(error, MsgIdTaken):
                    reply(wp.encode_relay(RelayStatus.MSG_ID_TAKEN, {}))
                elif isinstance(error, StoreUnavailable):
                    reply(self._unavailable(error))
                else:  # as `WorkerPool._relay_ask` answers a failure it did not expect
                    log.error("relay_ask_error", error=f"{type(error).__name__}: {error}")
                    reply(no_service_answer())

            enqueue_soon(recipient, sender, str(doc["msg_id"]), blob,
                         int(doc["expires_at"]), then)  # type: ignore[call-overload]
        except StoreUnavailable as exc:
            reply(self._unavailable(exc))
        return True

    def _unavailable(self, exc: StoreUnavailable) -> bytes:
        return wp.encode_relay(RelayStatus.UNAVAILABLE, {
            "reason": str(exc), "broken": not self.relay.store.healthy})

    def _enqueue_allowed(self, doc: dict[str, Any]) -> tuple[str, str]:
        """(recipient, sender) of an enqueue main takes; StoreUnavailable otherwise."""
        recipient = str(doc["recipient"])
        if recipient not in self.relay.recipients:
            # the worker checked this against its config; main's may be newer (a reload)
            raise StoreUnavailable("not a served recipient (the configuration changed)")
        sender = str(doc["sender"])
        if sender not in self.relay.store.allowlists().get(recipient, ()):
            # The worker judged the call against its copy of the lists. A worker that
            # did not confirm a change within STATE_WAIT (stopped, starved) still holds
            # the old one while the change was already answered: main's copy decides.
            # Unavailable, not a refusal: the sender's retry is judged anew.
            raise StoreUnavailable("the sender is not on the recipient's allow-list")
        return recipient, sender

    async def answer(self, payload: bytes) -> bytes:
        """One worker ask → its RELAY_ANSWER payload."""
        code, doc, blob = wp.decode_ask(payload)
        try:
            op = RelayOp(code)
        except ValueError:
            raise wp.ProtocolError(f"unknown relay op {code}") from None
        try:
            out, rest = await self._run(op, doc, blob)
        except QueueFull as exc:
            return wp.encode_relay(RelayStatus.QUEUE_FULL, {"retry_after": exc.retry_after})
        except MsgIdTaken:
            return wp.encode_relay(RelayStatus.MSG_ID_TAKEN, {})
        except StoreUnavailable as exc:
            return self._unavailable(exc)
        except (KeyError, TypeError, ValueError) as exc:
            raise wp.ProtocolError(f"bad relay {op.name}: {exc!r}") from None
        if op is RelayOp.ENQUEUE:
            return wp.encode_enqueued(out["id"], out["duplicate"])
        return wp.encode_relay(RelayStatus.OK, out, rest)

    async def _run(self, op: RelayOp, doc: dict[str, Any], blob: bytes
                   ) -> tuple[dict[str, Any], bytes]:
        relay = self.relay
        store = relay.store
        if op is RelayOp.PROBE:
            if not store.healthy:
                await store.probe()
            return {"healthy": store.healthy, "last_error": store.last_error}, b""
        if op is not RelayOp.REFRESH and doc.get("recipient") not in relay.recipients:
            # the worker checked this against its config; main's may be newer (a reload)
            raise StoreUnavailable("not a served recipient (the configuration changed)")
        if not store.healthy:
            await store.probe()
            if not store.healthy:
                raise StoreUnavailable("relay store unavailable")
        if op is RelayOp.ENQUEUE:
            recipient, sender = self._enqueue_allowed(doc)
            done = await store.enqueue(recipient, sender, str(doc["msg_id"]),
                                       blob, int(doc["expires_at"]))
            relay.woken(recipient)  # a duplicate too: see `RelayServer.relay_call`
            return {"id": done.id, "duplicate": done.duplicate}, b""
        if op is RelayOp.FETCH:
            items, more = await store.fetch(str(doc["recipient"]), int(doc["limit"]))
            return ({"items": [[i.id, i.queued_at, len(i.envelope)] for i in items],
                     "more": more}, b"".join(i.envelope for i in items))
        if op is RelayOp.ACK:
            ids = doc["ids"]
            if not isinstance(ids, list):
                raise TypeError("ids")
            return {"acked": await store.ack(str(doc["recipient"]),
                                             [int(i) for i in ids])}, b""
        if op is RelayOp.SET_ALLOWLIST:
            senders = doc["senders"]
            if not isinstance(senders, list):
                raise TypeError("senders")
            await store.set_allowlist(str(doc["recipient"]), tuple(str(s) for s in senders))
            await self.push_if_changed()
            return {}, b""
        await store.refresh()  # REFRESH
        await self.push_if_changed()
        return {}, b""


def no_service_answer() -> bytes:
    """What a worker hears when main serves no relay (a reload removed it)."""
    return wp.encode_relay(RelayStatus.UNAVAILABLE, {"reason": "no relay configured"})

