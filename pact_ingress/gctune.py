"""The cyclic garbage collector, set for a server that makes many short-lived objects.

A connection makes a few hundred container objects (its TLS wrapper, parser, exchange,
coroutines, tuples of headers) and almost all of them die by reference counting when
it ends. With CPython's default thresholds a young-generation collection runs every
700 net allocations, so it keeps catching a connection's objects while they are still
alive, traverses them, and promotes them to older generations that are traversed
again; every tenth of those collections also walks the whole long-lived heap (modules,
classes, the config). That is interpreter work a C proxy does not do at all.

`settle()`, called once the process is serving (its modules imported, its config
built): one full collection (startup's garbage is freed, not kept), then `gc.freeze()`
moves everything alive into the permanent generation, which collections no longer
walk, and the young generation's threshold is raised so that most of a connection's
objects are gone before the next collection looks. Cycles are still collected, only
later: at most `GEN0_THRESHOLD` net container allocations after they became garbage.
"""

from __future__ import annotations

import gc

#: Net container allocations between young-generation collections (CPython: 700).
GEN0_THRESHOLD = 10_000


def settle() -> None:
    """Collect, freeze what is alive now, and raise the young generation's threshold."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
