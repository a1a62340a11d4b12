"""`gctune.settle()`: run in a fresh interpreter (it changes the process's collector),
it collects startup's garbage instead of freezing it, freezes what is alive, raises the
young generation's threshold, and cyclic garbage made afterwards is still collected
without anyone calling `gc.collect()`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from pact_ingress.gctune import GEN0_THRESHOLD

ROOT = Path(__file__).resolve().parent.parent

PROGRAM = """
import gc, json, weakref
from pact_ingress import gctune

class Node:
    pass

collected = []
def cycle(tag):
    a, b = Node(), Node()
    a.peer, b.peer = b, a
    weakref.finalize(a, collected.append, tag)

cycle("startup")  # garbage from before: freed by settle, not frozen
gctune.settle()
frozen = gc.get_freeze_count()
threshold = gc.get_threshold()
startup_freed = collected == ["startup"]
cycle("later")
keep = []
for n in range(20 * gctune.GEN0_THRESHOLD):  # allocations alone must trigger collections
    keep.append([n])
    if "later" in collected:
        break
print(json.dumps({"frozen": frozen, "threshold": threshold,
                  "startup_freed": startup_freed, "later_freed": "later" in collected}))
"""


def test_settle_freezes_raises_the_threshold_and_still_collects_cycles() -> None:
    out = subprocess.run([sys.executable, "-c", PROGRAM], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    got = json.loads(out)
    assert got["startup_freed"] is True
    assert got["frozen"] > 1000  # the interpreter's and the package's objects
    assert got["threshold"][0] == GEN0_THRESHOLD
    assert got["later_freed"] is True
