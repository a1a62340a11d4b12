"""The relay's durable queue: an interface (`RelayStore`) and its SQLite implementation.

Theory of operation
-------------------
The promise is: a relay_call that got a success answer survives `kill -9` and a power
cut. So an item is *committed and fsynced* before its caller is told "queued". SQLite in
WAL mode with ``synchronous=FULL`` gives exactly that per COMMIT (the WAL is fsynced
before COMMIT returns); a crash mid-transaction leaves the WAL's uncommitted tail, which
recovery ignores, so nothing half-written is ever read back.

An fsync costs milliseconds, far more than the insert. **Group commit** makes many
concurrent senders share one: every operation is a job on a queue served by *one* writer
thread (one connection, so no lock contention and no event-loop blocking). The thread
takes the first job, then every job that queued up meanwhile (up to `MAX_BATCH`), runs
them all in one transaction — each inside its own SAVEPOINT, so one job's failure
undoes only that job (an enqueue needs none: it writes one statement, after every check
that can refuse it, and SQLite undoes a failed statement itself) — and COMMITs once.
Consecutive enqueues of a batch that all fit their recipients' bounds go in as one
multi-row INSERT (… RETURNING id: a row the key already held is not returned and is
answered as the duplicate it is); any other case runs them one by one.
Only after COMMIT returned does any job of the batch get its result; a COMMIT that
fails fails the whole batch (`StoreUnavailable`), and their callers answer
``unavailable``. While one COMMIT is fsyncing, the next batch is queueing: the busier
the relay, the more calls each fsync carries.

Results travel back to trio through the trio token (`run_sync_soon`), so nothing but the
job queue is shared between threads: they wake the tasks waiting on their jobs, or, for
`enqueue_soon` (main answering workers' enqueues, thousands a second, without a task
each), call the job's function there. The in-memory mirrors the trio side reads — queue
depth per recipient, allow-lists — are replaced (never mutated in place) by the writer
thread after its COMMIT, so a reader sees the old or the new mapping, both consistent.

Rows are never updated into another shape: ``ack`` sets ``acked = 1`` and drops the
envelope, keeping the (recipient, msg_id) row until the envelope's own exp (which a ts
ahead of now can put past the item's 30-day retention; at most `KEY_RETENTION` after
queueing), so a sender retrying after the recipient acked is still told "queued" (the
duplicate answer) instead of queueing the call a second time. An unacked item past its
expiry is never fetched again: a retry under its key replaces it, as after the purge.
The row keeps its sender: another sender's call under that msg_id is refused
(`MsgIdTaken`), not told "queued" for a call that would never be delivered. `purge`
deletes rows whose ``expires_at`` passed (unacked ones count as expiries) and recounts
depths from the table, which also picks up changes an operator made with
``pact-ingress relay purge``.

**Bounds.** A recipient's queue holds at most `max_items` items and `max_bytes` bytes of
envelopes, and one sender's part of it at most half of each (rounded up, at least one
item: `proto.relay.sender_share`), so one allowed sender alone never takes the room
every other sender needs; beyond either, an enqueue is refused with `QueueFull` (the
relay's ``rate_limited``, integer ``retry_after``) unless it is a duplicate, which is
answered as one even then. Both checks are the writer thread's, in the transaction that
inserts: the whole queue's from the in-memory depths, the sender's by counting its
unacked rows for the recipient (covered by the ``items_sender`` index) — only once the
whole queue is past the share, since no sender's part can be larger than the whole.
Counted from the table, a sender's part follows acks and purges by itself; a duplicate
adds no row, so a retry never counts twice. Workers ask main for every enqueue
(`relay/remote.py`): the check is here, never in a worker.

A store that cannot be opened (unwritable directory, a file that is not a database, a
failed integrity check) or whose COMMIT fails is *broken*: one clear log line, every job
fails with `StoreUnavailable`, the process keeps serving everything else, and opening is
retried at most every `REOPEN_INTERVAL` seconds when a job arrives.
"""

from __future__ import annotations

import json
import os
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio

from pact_ingress.envelope import MAX_PROTECTED_CHARS
from pact_ingress.identity import b64url_decode
from pact_ingress.logs import log
from pact_ingress.proto.relay import FULL_RETRY_AFTER, MAX_PAGE_BYTES, sender_share
from pact_ingress.stats import Stats

#: Jobs one transaction may carry: enough to absorb hundreds of concurrent senders per
#: fsync, few enough that one batch's results never wait behind a huge transaction.
MAX_BATCH = 512
#: Jobs waiting for the writer; beyond this the store is overloaded and says so.
MAX_PENDING = 20_000
#: How long a caller waits for its job before answering unavailable (a disk that hangs).
JOB_TIMEOUT = 30.0
#: A broken store is reopened at most this often (on demand, when a job arrives).
REOPEN_INTERVAL = 10.0
#: An acked item's msg_id key is kept until its envelope expires, but at most this long
#: after it was queued: a ts far ahead (only exp bounds a relayed call) must not keep
#: rows for years; past this the receiver's own msg_id check is what is left.
KEY_RETENTION = 60 * 86400
#: SQLite waits this long for a lock another process (the `relay` CLI) holds.
BUSY_TIMEOUT_MS = 5000
#: A worker's read of the file waits at most this long for a lock (WAL readers rarely
#: meet one); then it asks main instead.
READ_BUSY_TIMEOUT_MS = 1000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS items (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    recipient TEXT NOT NULL,
    sender TEXT NOT NULL,
    msg_id TEXT NOT NULL,
    queued_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    size INTEGER NOT NULL,
    envelope BLOB,
    acked INTEGER NOT NULL DEFAULT 0,
    UNIQUE (recipient, msg_id)
);
CREATE INDEX IF NOT EXISTS items_queue ON items (recipient, acked, id);
CREATE INDEX IF NOT EXISTS items_expiry ON items (expires_at);
CREATE INDEX IF NOT EXISTS items_sender ON items (recipient, sender, acked, size);
CREATE TABLE IF NOT EXISTS allowlists (
    recipient TEXT PRIMARY KEY,
    senders TEXT NOT NULL
);
"""


class StoreUnavailable(Exception):
    """The store cannot take or answer this operation now (broken, overloaded, slow)."""


class MsgIdTaken(Exception):
    """The recipient has an item under this msg_id from another sender. A msg_id is the
    recipient's idempotency key whoever sends it (its own check keys on it alone), so
    the call cannot be stored under it, and answering it as a duplicate would
    acknowledge a call that is never delivered: the sender must use a fresh one."""


class QueueFull(Exception):
    """The recipient's queue is at its item or byte bound."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"queue full; retry after {retry_after} s")
        self.retry_after = retry_after


@dataclass(frozen=True)
class Item:
    id: int
    queued_at: int
    envelope: bytes  # the four envelope members as canonical JSON


@dataclass(frozen=True)
class Enqueued:
    id: int
    duplicate: bool  # the (recipient, msg_id) was queued before: nothing new stored


class RelayStore(Protocol):
    """What the relay needs of a queue store (SQLite here, Redis in `state.relay_store`)."""

    healthy: bool
    last_error: str | None
    #: whether `depths()` tells what waits in the store (False: a shared store that was
    #: away when this instance started and has not been counted since)
    depths_known: bool

    async def open(self) -> None: ...
    def set_bounds(self, max_items: int, max_bytes: int) -> None: ...
    async def probe(self) -> None: ...
    async def refresh(self) -> None: ...

    async def enqueue(self, recipient: str, sender: str, msg_id: str, envelope: bytes,
                      expires_at: int) -> Enqueued: ...
    async def fetch(self, recipient: str, limit: int) -> tuple[list[Item], bool]: ...
    async def ack(self, recipient: str, ids: list[int]) -> int: ...
    async def set_allowlist(self, recipient: str, senders: tuple[str, ...]) -> None: ...
    def allowlists(self) -> dict[str, frozenset[str]]: ...
    def depths(self) -> dict[str, tuple[int, int]]: ...
    async def purge(self) -> int: ...
    async def aclose(self) -> None: ...


@dataclass(eq=False)
class _Job:
    fn: Callable[[sqlite3.Connection], Any]
    writes: bool
    #: the job writes at most one statement, after every check that can refuse it: a
    #: failure leaves nothing behind (SQLite undoes a failed statement), so it needs no
    #: savepoint of its own
    single: bool = False
    #: an enqueue's row (recipient, sender, msg_id, queued_at, expires_at, size,
    #: envelope): consecutive enqueues of a batch go into one multi-row INSERT
    row: tuple[Any, ...] | None = None
    #: what wakes its caller: a waiting task's event, or (`enqueue_soon`) a function
    #: called on the trio thread with the job once it is over
    done: trio.Event | None = None
    callback: Callable[[_Job], None] | None = None
    result: Any = None
    error: BaseException | None = None


class SqliteStore:
    """The relay queue in one SQLite file (WAL, synchronous=FULL), one writer thread."""

    def __init__(self, path: Path, *, max_items: int, max_bytes: int,
                 stats: Stats | None = None, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.stats = stats
        self.clock = clock
        self.healthy = False
        self.last_error: str | None = None
        self._conn: sqlite3.Connection | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._depths: dict[str, tuple[int, int]] = {}
        self.depths_known = True  # this process's own file: counted as it is opened
        self._allowlists: dict[str, frozenset[str]] = {}
        self._published: set[str] = set()  # recipients whose gauges were set
        self._next_open = 0.0
        #: Transactions committed (tests check that concurrent calls shared them).
        self.commits = 0

    # --- lifecycle ---------------------------------------------------------------------

    async def open(self) -> None:
        """Start the writer thread and open the file (a failure leaves the store broken,
        logged, not raised: the ingress serves on and answers relay calls unavailable)."""
        self._token = trio.lowlevel.current_trio_token()
        self._thread = threading.Thread(target=self._run, name="relay-store", daemon=True)
        self._thread.start()
        await self._submit(lambda conn: None, writes=False, allow_broken=True)

    async def aclose(self) -> None:
        if self._thread is None:
            return
        self._jobs.put(None)
        await trio.to_thread.run_sync(self._thread.join)
        self._thread = None

    def set_bounds(self, max_items: int, max_bytes: int) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes

    # --- the trio side -----------------------------------------------------------------

    async def _submit(self, fn: Callable[[sqlite3.Connection], Any], *, writes: bool,
                      allow_broken: bool = False, single: bool = False,
                      row: tuple[Any, ...] | None = None) -> Any:
        job = _Job(fn, writes, single, row, trio.Event())
        self._put(job)
        done = job.done
        assert done is not None
        with trio.move_on_after(JOB_TIMEOUT):
            await done.wait()
        if not done.is_set():
            raise StoreUnavailable(f"relay store did not answer within {JOB_TIMEOUT:g} s")
        error, job.error = job.error, None
        if error is not None:
            if allow_broken and isinstance(error, StoreUnavailable):
                return None
            # raised from here, its traceback holds this frame: with `job` or `error`
            # still pointing at it, that is a cycle keeping the call's envelope alive
            # until a full collection, and a flood of refused calls piles them up
            try:
                raise error
            finally:
                del error
        return job.result

    def _put(self, job: _Job) -> None:
        if self._thread is None:
            raise StoreUnavailable("relay store not running")
        if self._jobs.qsize() >= MAX_PENDING:
            raise StoreUnavailable("relay store overloaded")
        self._jobs.put(job)

    async def probe(self) -> None:
        """A no-op job: reopens a broken store when its retry time has come."""
        await self._submit(lambda conn: None, writes=False, allow_broken=True)

    async def refresh(self) -> None:
        """Nothing to re-read: this process is the file's only writer while it serves."""

    async def enqueue(self, recipient: str, sender: str, msg_id: str, envelope: bytes,
                      expires_at: int) -> Enqueued:
        """Queue one item (durably, before returning) or name the existing one; QueueFull
        when the recipient is at a bound, MsgIdTaken when another sender's item holds the
        msg_id, StoreUnavailable when the store is broken."""
        fn, row = self._enqueue_job(recipient, sender, msg_id, envelope, expires_at)
        return await self._submit(fn, writes=True, single=True,  # type: ignore[no-any-return]
                                  row=row)

    def enqueue_soon(self, recipient: str, sender: str, msg_id: str, envelope: bytes,
                     expires_at: int,
                     then: Callable[[Enqueued | None, BaseException | None], None]) -> None:
        """`enqueue` without a task waiting on it (main answering a worker's enqueues:
        thousands a second): `then(result, None)` or `then(None, error)` is called on
        the trio thread once the job is over — after its COMMIT, as `enqueue` returns.
        No `JOB_TIMEOUT` here: the worker that asked gives up on its own clock.
        StoreUnavailable at once when the store is not running or overloaded."""
        fn, row = self._enqueue_job(recipient, sender, msg_id, envelope, expires_at)

        def over(job: _Job) -> None:
            then(job.result, job.error)

        self._put(_Job(fn, True, True, row, callback=over))

    def _enqueue_job(self, recipient: str, sender: str, msg_id: str, envelope: bytes,
                     expires_at: int
                     ) -> tuple[Callable[[sqlite3.Connection], Enqueued], tuple[Any, ...]]:
        now = int(self.clock())

        def existing(conn: sqlite3.Connection) -> Enqueued | None:
            items, size = self._depths.get(recipient, (0, 0))
            found = _existing(conn, (recipient, sender, msg_id, now, expires_at,
                                     len(envelope), envelope), self.max_bytes - size,
                              sender_share(self.max_items, self.max_bytes)[1])
            if found is None:
                return None
            if found[1]:
                self._depths = {**self._depths, recipient: (items, size + found[1])}
            return found[0]

        def run(conn: sqlite3.Connection) -> Enqueued:
            items, size = self._depths.get(recipient, (0, 0))
            if (items + 1 > self.max_items or size + len(envelope) > self.max_bytes
                    or self._over_share(conn, recipient, sender, items, size,
                                        (1, len(envelope)))):
                # a duplicate is answered as one even at a full queue (or share)
                dup = existing(conn)
                if dup is not None:
                    return dup
                raise QueueFull(FULL_RETRY_AFTER)
            # the usual case in one statement: the (recipient, msg_id) key decides
            cur = conn.execute(
                "INSERT OR IGNORE INTO items (recipient, sender, msg_id, queued_at,"
                " expires_at, size, envelope) VALUES (?, ?, ?, ?, ?, ?, ?)",
                (recipient, sender, msg_id, now, expires_at, len(envelope), envelope))
            if cur.rowcount != 1:
                dup = existing(conn)
                if dup is None:  # ignored for another constraint: none can fail here
                    raise sqlite3.IntegrityError("relay item not stored")
                return dup
            self._depths = {**self._depths, recipient: (items + 1, size + len(envelope))}
            return Enqueued(int(cur.lastrowid or 0), False)

        return run, (recipient, sender, msg_id, now, expires_at, len(envelope), envelope)

    def _over_share(self, conn: sqlite3.Connection, recipient: str, sender: str,
                    items: int, size: int, adding: tuple[int, int],
                    held: dict[tuple[str, str], tuple[int, int]] | None = None) -> bool:
        """Whether `adding` (items, bytes) would put `sender` over its share of the
        recipient's bounds (`proto.relay.sender_share`), counted from the table in the
        writer's transaction. `items`/`size` are the whole queue's: while the whole
        queue plus `adding` fits the share, no sender's part of it can exceed it, so
        the usual enqueue (a queue far from its bounds) costs no query. `held`: the
        counts already read in this transaction, by (recipient, sender)."""
        share_items, share_bytes = sender_share(self.max_items, self.max_bytes)
        if items + adding[0] <= share_items and size + adding[1] <= share_bytes:
            return False
        if held is None:
            held_items, held_bytes = _sender_usage(conn, recipient, sender)
        else:
            if (recipient, sender) not in held:
                held[(recipient, sender)] = _sender_usage(conn, recipient, sender)
            held_items, held_bytes = held[(recipient, sender)]
        return (held_items + adding[0] > share_items
                or held_bytes + adding[1] > share_bytes)

    async def fetch(self, recipient: str, limit: int) -> tuple[list[Item], bool]:
        """The oldest unacked, unexpired items (at most `limit`, and `MAX_PAGE_BYTES` of
        envelopes but always one); `more` says whether others wait behind them."""
        now = int(self.clock())

        def run(conn: sqlite3.Connection) -> tuple[list[Item], bool]:
            return select_page(conn, recipient, now, limit)

        return await self._submit(run, writes=False)  # type: ignore[no-any-return]

    async def ack(self, recipient: str, ids: list[int]) -> int:
        """Drop the named items of this recipient's queue; returns how many were there."""
        if not ids:
            return 0

        def run(conn: sqlite3.Connection) -> int:
            acked = 0
            freed = 0
            for start in range(0, len(ids), 500):  # SQLite's bound-parameter limit
                chunk = ids[start:start + 500]
                marks = ",".join("?" * len(chunk))
                where = f"recipient = ? AND acked = 0 AND id IN ({marks})"
                size = conn.execute(f"SELECT COUNT(*), COALESCE(SUM(size), 0) FROM items "
                                    f"WHERE {where}", (recipient, *chunk)).fetchone()
                # the row (its msg_id key) is kept until the envelope itself expires
                # (bounded: KEY_RETENTION), which can be later than the item's own
                # retention (a future ts): a retry of the acked call until then is
                # the duplicate, never new mail (exp is read from the protected member
                # and what follows it: never whole envelopes)
                keep = [(_envelope_exp(env), i) for i, env in conn.execute(
                    f"SELECT id, substr(envelope, instr(envelope, ?), {_PROTECTED_SPAN})"
                    f" FROM items WHERE {where}", (_PROTECTED, recipient, *chunk))]
                conn.executemany(
                    "UPDATE items SET expires_at = MAX(expires_at, MIN(?, queued_at + "
                    f"{KEY_RETENTION})) WHERE id = ?", [k for k in keep if k[0] is not None])
                conn.execute(f"UPDATE items SET acked = 1, envelope = NULL WHERE {where}",
                             (recipient, *chunk))
                acked += int(size[0])
                freed += int(size[1])
            items, total = self._depths.get(recipient, (0, 0))
            self._depths = {**self._depths,
                            recipient: (max(0, items - acked), max(0, total - freed))}
            return acked

        return await self._submit(run, writes=True)  # type: ignore[no-any-return]

    async def set_allowlist(self, recipient: str, senders: tuple[str, ...]) -> None:
        """Replace the recipient's allow-list (one row: atomic by construction)."""

        def run(conn: sqlite3.Connection) -> None:
            conn.execute("INSERT INTO allowlists (recipient, senders) VALUES (?, ?) ON "
                         "CONFLICT (recipient) DO UPDATE SET senders = excluded.senders",
                         (recipient, "\n".join(senders)))
            self._allowlists = {**self._allowlists, recipient: frozenset(senders)}

        await self._submit(run, writes=True)

    async def purge(self) -> int:
        """Delete what expired; recount depths from the table. Returns unacked expiries."""
        now = int(self.clock())

        def run(conn: sqlite3.Connection) -> int:
            expired = conn.execute("SELECT COUNT(*) FROM items WHERE expires_at <= ? AND "
                                   "acked = 0", (now,)).fetchone()[0]
            conn.execute("DELETE FROM items WHERE expires_at <= ?", (now,))
            self._depths = _count_depths(conn)
            return int(expired)

        return await self._submit(run, writes=True)  # type: ignore[no-any-return]

    def allowlists(self) -> dict[str, frozenset[str]]:
        return self._allowlists

    def depths(self) -> dict[str, tuple[int, int]]:
        """(items, bytes) queued per recipient (unacked; expired ones until purged)."""
        return self._depths

    # --- the writer thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                break
            batch = [job]
            stop = False
            while len(batch) < MAX_BATCH:
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            self._execute(batch)
            if stop:
                break
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _execute(self, batch: list[_Job]) -> None:
        conn = self._connection()
        if conn is None:
            self._fail(batch, StoreUnavailable(f"relay store unavailable: {self.last_error}"))
            return
        saved = (self._depths, self._allowlists)
        try:
            conn.execute("BEGIN IMMEDIATE" if any(j.writes for j in batch) else "BEGIN")
            at = 0
            while at < len(batch):
                end = at + 1
                if batch[at].row is not None:  # a run of enqueues: one statement if it can
                    while end < len(batch) and batch[end].row is not None:
                        end += 1
                    if end - at > 1 and self._insert_many(conn, batch[at:end]):
                        at = end
                        continue
                for job in batch[at:end]:
                    self._run_one(conn, job)
                at = end
            started = time.perf_counter()
            conn.execute("COMMIT")
            if any(j.writes for j in batch):
                self.commits += 1
                if self.stats is not None:
                    self.stats.relay_fsync_seconds.observe(time.perf_counter() - started)
        except sqlite3.Error as exc:
            self._depths, self._allowlists = saved
            self._broken(f"{type(exc).__name__}: {exc}")
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self._fail(batch, StoreUnavailable(f"relay store unavailable: {self.last_error}"))
            return
        except BaseException as exc:  # a bug in a job: fail the batch, keep the thread
            self._depths, self._allowlists = saved
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            log.error("relay_store_internal_error", error=repr(exc))
            self._fail(batch, StoreUnavailable("relay store internal error"))
            return
        self._publish_depths()
        self._deliver(batch)

    @staticmethod
    def _run_one(conn: sqlite3.Connection, job: _Job) -> None:
        if job.single:
            try:
                job.result = job.fn(conn)
            except (QueueFull, MsgIdTaken, sqlite3.IntegrityError,
                    sqlite3.ProgrammingError) as exc:
                # an answer, not a bug: without the writer's frames (which hold `job`,
                # and with it this error: a cycle carrying the envelope)
                job.error = exc.with_traceback(None)
            return
        conn.execute("SAVEPOINT job")
        try:
            job.result = job.fn(conn)
        except (QueueFull, MsgIdTaken, sqlite3.IntegrityError,
                    sqlite3.ProgrammingError) as exc:
            job.error = exc.with_traceback(None)
            conn.execute("ROLLBACK TO job")
        conn.execute("RELEASE job")

    def _insert_many(self, conn: sqlite3.Connection, run: list[_Job]) -> bool:
        """Consecutive enqueues in one INSERT statement (one call into SQLite instead of
        one per item). Only when every item fits its recipient's bounds even if all are
        new; otherwise (or when the statement fails) False: the jobs then run one by one,
        each with its own checks and errors, exactly as alone."""
        depths = dict(self._depths)
        #: per (recipient, sender): what this batch adds, counted as if all were new
        adding: dict[tuple[str, str], tuple[int, int]] = {}
        held: dict[tuple[str, str], tuple[int, int]] = {}
        for job in run:
            assert job.row is not None
            recipient, sender, size = job.row[0], job.row[1], job.row[5]
            items, total = depths.get(recipient, (0, 0))
            if items + 1 > self.max_items or total + size > self.max_bytes:
                return False
            n, b = adding.get((recipient, sender), (0, 0))
            n, b = n + 1, b + size
            # the whole queue as it was (the table, which this batch has not touched
            # yet) and the sender's part of the batch so far
            base = self._depths.get(recipient, (0, 0))
            if self._over_share(conn, recipient, sender, base[0], base[1], (n, b), held):
                return False
            adding[(recipient, sender)] = (n, b)
            depths[recipient] = (items + 1, total + size)
        marks = ",".join(["(?, ?, ?, ?, ?, ?, ?)"] * len(run))
        try:
            rows = conn.execute(
                "INSERT OR IGNORE INTO items (recipient, sender, msg_id, queued_at, expires_at,"
                f" size, envelope) VALUES {marks} RETURNING id, recipient, msg_id",
                [v for job in run for v in job.row]).fetchall()  # type: ignore[union-attr]
        except (sqlite3.IntegrityError, sqlite3.ProgrammingError):
            return False  # SQLite undid the statement; one by one tells which job failed
        inserted = {(r, m): int(i) for i, r, m in rows}
        depths = dict(self._depths)
        for job in run:
            assert job.row is not None
            recipient, msg_id, size = job.row[0], job.row[2], job.row[5]
            item_id = inserted.pop((recipient, msg_id), None)
            if item_id is not None:  # the first of its key in the batch: stored now
                items, total = depths.get(recipient, (0, 0))
                depths[recipient] = (items + 1, total + size)
                job.result = Enqueued(item_id, False)
                continue
            items, total = depths.get(recipient, (0, 0))
            try:
                found = _existing(conn, job.row, self.max_bytes - total,
                                  sender_share(self.max_items, self.max_bytes)[1])
            except (MsgIdTaken, QueueFull) as exc:
                job.error = exc.with_traceback(None)  # see `_run_one`
                continue
            if found is None:
                job.error = sqlite3.IntegrityError("relay item not stored")
            else:
                job.result = found[0]
                depths[recipient] = (items, total + found[1])
        self._depths = depths
        return True

    def _fail(self, batch: list[_Job], exc: BaseException) -> None:
        for job in batch:
            job.error = exc
            job.result = None
        self._deliver(batch)

    def _deliver(self, batch: list[_Job]) -> None:
        """Wake the batch's callers: one hop to the trio thread for the whole batch."""
        assert self._token is not None

        def wake() -> None:
            for job in batch:
                if job.callback is None:
                    assert job.done is not None
                    job.done.set()
                    continue
                try:
                    job.callback(job)
                except Exception as exc:  # noqa: BLE001 - never into trio's run loop
                    log.error("relay_store_callback_failed", error=repr(exc))

        try:
            self._token.run_sync_soon(wake)
        except trio.RunFinishedError:
            pass

    def _publish_depths(self) -> None:
        if self.stats is None:
            return
        depths = self._depths
        # a recount (purge, reopen) leaves out recipients with nothing queued: their
        # gauges go to 0, not stay at what they last held
        for recipient in self._published - depths.keys():
            self.stats.relay_queued_items.labels(recipient).set(0)
            self.stats.relay_queued_bytes.labels(recipient).set(0)
        for recipient, (items, size) in depths.items():
            self.stats.relay_queued_items.labels(recipient).set(items)
            self.stats.relay_queued_bytes.labels(recipient).set(size)
        self._published = set(depths)

    def _connection(self) -> sqlite3.Connection | None:
        if self._conn is not None:
            return self._conn
        now = time.monotonic()
        if now < self._next_open:
            return None
        self._next_open = now + REOPEN_INTERVAL
        try:
            self._conn = _open(self.path)
            self._depths = _count_depths(self._conn)
            self._allowlists = _load_allowlists(self._conn)
        except (sqlite3.Error, OSError) as exc:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
            self._broken(f"{type(exc).__name__}: {exc}")
            return None
        if not self.healthy:
            log.info("relay_store_open", path=str(self.path),
                     items=sum(d[0] for d in self._depths.values()))
        self.healthy = True
        self.last_error = None
        return self._conn

    def _broken(self, error: str) -> None:
        if self.healthy or self.last_error != error:
            log.error("relay_store_unavailable", path=str(self.path), error=error,
                      detail="relay_call is answered 'unavailable' until the store can be "
                             f"opened again (retried every {REOPEN_INTERVAL:g} s); move a "
                             "corrupt file aside or fix the directory's permissions")
        self.healthy = False
        self.last_error = error
        if self._conn is not None:
            try:
                self._conn.close()
            except sqlite3.Error:
                pass
            self._conn = None
        self._next_open = time.monotonic() + REOPEN_INTERVAL


def _open(path: Path) -> sqlite3.Connection:
    """Open (creating if needed) and check the store; raises sqlite3.Error / OSError."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    # SQLite creates the -wal and -shm files (which hold the same envelopes) with the
    # database file's mode, so the file is private before SQLite first opens it
    os.close(os.open(path, os.O_RDONLY | os.O_CREAT, 0o600))
    os.chmod(path, 0o600)
    for leftover in ("-wal", "-shm"):  # made before the file was private
        try:
            os.chmod(f"{path}{leftover}", 0o600)
        except FileNotFoundError:
            pass
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if str(mode).lower() != "wal":
            raise sqlite3.OperationalError(f"cannot use WAL mode (got {mode})")
        conn.execute("PRAGMA synchronous = FULL")
        check = conn.execute("PRAGMA quick_check").fetchone()[0]
        if check != "ok":
            raise sqlite3.DatabaseError(f"integrity check failed: {check}")
        conn.executescript(_SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn


def select_page(conn: sqlite3.Connection, recipient: str, now: int, limit: int
                ) -> tuple[list[Item], bool]:
    """`fetch`'s query, shared by the writer thread and a worker's `FileReader`."""
    rows = conn.execute(
        "SELECT id, queued_at, envelope FROM items WHERE recipient = ? AND acked = 0"
        " AND expires_at > ? ORDER BY id LIMIT ?", (recipient, now, limit + 1)).fetchall()
    items: list[Item] = []
    total = 0
    more = False
    for item_id, queued_at, env in rows:
        if len(items) == limit or (items and total + len(env) > MAX_PAGE_BYTES):
            more = True
            break
        items.append(Item(int(item_id), int(queued_at), bytes(env)))
        total += len(env)
    return items, more


class FileReader:
    """A read-only connection to a store file another process writes: a worker reads
    `fetch` pages here instead of asking main for them.

    Exactly as consistent as asking main: main answers ``queued`` or an ack only after
    its COMMIT returned, and in WAL mode every read transaction started after a COMMIT
    returned (in any process) sees it; each page is one autocommit SELECT read to its
    end, so it is one snapshot and holds no read lock afterwards. The file is opened
    read-only, so this process can never write it. A path that names another file than
    the one opened (main reopened a store that was moved aside) is reopened before the
    query. Any SQLite error closes the connection and raises: the caller asks main."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._inode: tuple[int, int] = (0, 0)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def fetch(self, recipient: str, now: int, limit: int) -> tuple[list[Item], bool]:
        st = os.stat(self.path)
        if self._conn is None or (st.st_dev, st.st_ino) != self._inode:
            self.close()
            conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True,
                                   isolation_level=None, check_same_thread=False)
            conn.execute(f"PRAGMA busy_timeout = {READ_BUSY_TIMEOUT_MS}")
            self._conn, self._inode = conn, (st.st_dev, st.st_ino)
        try:
            return select_page(self._conn, recipient, now, limit)
        except sqlite3.Error:
            self.close()
            raise


def _existing(conn: sqlite3.Connection, row: tuple[Any, ...], room: int, share_bytes: int
              ) -> tuple[Enqueued, int] | None:
    """The item already stored under an enqueue's (recipient, msg_id), and the bytes its
    queue grew by: None when there is none; MsgIdTaken when another sender's.

    An unacked item past its expiry (not purged yet) will never be fetched again: the
    retry of a still-valid envelope replaces it (as it would after the purge) instead of
    being told "queued" for it; QueueFull when its larger envelope does not fit `room`
    (the bytes the recipient's queue has left) or the sender's `share_bytes` (it keeps
    the item count: the row is replaced)."""
    recipient, sender, msg_id, now, _, size, _ = row
    found = conn.execute("SELECT id, sender, acked, expires_at, size FROM items WHERE "
                         "recipient = ? AND msg_id = ?", (recipient, msg_id)).fetchone()
    if found is None:
        return None
    if found[1] != sender:
        raise MsgIdTaken(msg_id)
    if found[2] or found[3] > now:
        return Enqueued(int(found[0]), True), 0
    grown = size - int(found[4])
    if grown > room or (grown > 0 and _sender_usage(conn, recipient, sender)[1] + grown
                        > share_bytes):
        raise QueueFull(FULL_RETRY_AFTER)
    # one statement (an enqueue's job takes no savepoint) making a new row, as after the
    # purge: an id the node fetched before never names this item
    cur = conn.execute(
        "INSERT OR REPLACE INTO items (recipient, sender, msg_id, queued_at, expires_at,"
        " size, envelope) VALUES (?, ?, ?, ?, ?, ?, ?)", row)
    return Enqueued(int(cur.lastrowid or 0), False), grown


_PROTECTED = b'"protected":"'
#: bytes from the protected member's start that hold all of it
_PROTECTED_SPAN = len(_PROTECTED) + MAX_PROTECTED_CHARS + 1


def _envelope_exp(envelope: bytes | None) -> int | None:
    """The protected header's exp of a stored envelope (canonical JSON), or None."""
    if not envelope:
        return None
    try:
        at = envelope.index(_PROTECTED) + len(_PROTECTED)
        protected = envelope[at:envelope.index(b'"', at)]
        exp = json.loads(b64url_decode(protected.decode("ascii")))["exp"]
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        return None
    return exp if isinstance(exp, int) and not isinstance(exp, bool) else None


def _sender_usage(conn: sqlite3.Connection, recipient: str, sender: str) -> tuple[int, int]:
    """(items, bytes) `sender` has queued for `recipient`: unacked, expired ones too until
    purged, as the whole-queue depths count them (the items_sender index covers it)."""
    n, b = conn.execute("SELECT COUNT(*), COALESCE(SUM(size), 0) FROM items WHERE "
                        "recipient = ? AND sender = ? AND acked = 0",
                        (recipient, sender)).fetchone()
    return int(n), int(b)


def _count_depths(conn: sqlite3.Connection) -> dict[str, tuple[int, int]]:
    rows = conn.execute("SELECT recipient, COUNT(*), COALESCE(SUM(size), 0) FROM items "
                        "WHERE acked = 0 GROUP BY recipient")
    return {str(r): (int(n), int(s)) for r, n, s in rows}


def _load_allowlists(conn: sqlite3.Connection) -> dict[str, frozenset[str]]:
    rows = conn.execute("SELECT recipient, senders FROM allowlists")
    return {str(r): frozenset(s for s in str(senders).split("\n") if s) for r, senders in rows}


# --- operator access (the `relay` CLI; works beside a running serve) -----------------------


def inspect(path: Path, now: float) -> list[dict[str, Any]]:
    """Per recipient: queued items and bytes, oldest queued_at, expired-but-unpurged."""
    conn = _open(path)
    try:
        rows = conn.execute(
            "SELECT recipient, COUNT(*), COALESCE(SUM(size), 0), MIN(queued_at), "
            "SUM(expires_at <= ?) FROM items WHERE acked = 0 GROUP BY recipient "
            "ORDER BY recipient", (int(now),)).fetchall()
        allow = _load_allowlists(conn)
    finally:
        conn.close()
    out = [{"recipient": r, "items": int(n), "bytes": int(s), "oldest": int(o),
            "expired": int(e or 0), "allowlist": len(allow.get(r, ()))}
           for r, n, s, o, e in rows]
    for r in sorted(set(allow) - {row["recipient"] for row in out}):
        out.append({"recipient": r, "items": 0, "bytes": 0, "oldest": None, "expired": 0,
                    "allowlist": len(allow[r])})
    return out


def purge_file(path: Path, now: float, *, recipient: str | None = None,
               everything: bool = False) -> int:
    """Delete expired rows (or, with `everything`, all queued items of `recipient`, or of
    every recipient); returns the unacked items removed."""
    conn = _open(path)
    try:
        conn.execute("BEGIN IMMEDIATE")
        where, args = ("expires_at <= ?", [int(now)]) if not everything else ("1", [])
        if recipient is not None:
            where += " AND recipient = ?"
            args.append(recipient)
        n = conn.execute(f"SELECT COUNT(*) FROM items WHERE acked = 0 AND {where}",
                         args).fetchone()[0]
        if everything:
            conn.execute(f"UPDATE items SET acked = 1, envelope = NULL WHERE {where}", args)
        else:
            conn.execute(f"DELETE FROM items WHERE {where}", args)
        conn.execute("COMMIT")
    finally:
        conn.close()
    return int(n)
