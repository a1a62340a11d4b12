"""One instance's metrics from several processes: main's registry plus worker reports.

With worker processes every process counts into its own `Stats`; an operator scrapes
the instance, so `/metrics` must show the instance. Workers report their registry as
Prometheus text; here it is parsed and folded into main's families by name and labels:

* counters, histogram buckets/sums/counts and ordinary gauges are **summed** (requests
  served, open connections: each connection is counted by exactly one process);
* `*_created` samples take the **earliest** (the series exists since its first process);
* timestamp gauges (`*_timestamp_seconds`, certificate expiry) and the counts in
  `NOT_SUMMED` take **main's** value (a sum of timestamps means nothing); a worker's copy
  only shows when main has none;
* the flags in `LOWEST` take the **lowest** value: `state_shared` is 1 only while every
  process decides in Redis — what `/status` says — since a worker's own Redis client
  may have fallen back (its decision failed) before main's probe noticed.

Families only a worker has (a route main never served) are added as they come.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

#: Families that state a fact about the instance (how often it fell back) rather than
#: count work: every process with a Redis client switches with main.
NOT_SUMMED = frozenset({"pact_ingress_state_fallbacks"})
#: Flags the instance has only while every process has them (1 = shared).
LOWEST = frozenset({"pact_ingress_state_shared"})


def _key(sample: Any) -> tuple[str, tuple[tuple[str, str], ...]]:
    return sample.name, tuple(sorted(sample.labels.items()))


def merge_families(main: Iterable[Metric], reports: Iterable[str]) -> list[Metric]:
    """Main's families with every worker report folded in (see the module docstring)."""
    families: dict[str, Metric] = {}
    where: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[Metric, int]] = {}
    for fam in main:
        families[fam.name] = fam
        for i, s in enumerate(fam.samples):
            where[_key(s)] = (fam, i)
    for text in reports:
        for fam in text_string_to_metric_families(text):
            mine = families.get(fam.name)
            if mine is None:
                mine = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                   fam.unit)
            keep_main = fam.name in NOT_SUMMED or fam.name.endswith("_timestamp_seconds")
            for s in fam.samples:
                k = _key(s)
                found = where.get(k)
                if found is None:
                    mine.samples.append(s)
                    where[k] = (mine, len(mine.samples) - 1)
                    continue
                owner, i = found
                old = owner.samples[i]
                if keep_main:
                    continue
                value = min(old.value, s.value) if (s.name.endswith("_created")
                                                    or fam.name in LOWEST) \
                    else old.value + s.value
                owner.samples[i] = old._replace(value=value)
    return list(families.values())


class _Fixed:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def exposition(families: list[Metric]) -> bytes:
    """Prometheus text of already collected families."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families))  # type: ignore[arg-type]
    return generate_latest(registry)


def retire(retired: str, report: str) -> str:
    """`retired` (Prometheus text) plus the counters and histograms of `report`, the last
    report of a process that is gone; its gauges are dropped (they described it)."""
    kept = [fam for fam in text_string_to_metric_families(report)
            if fam.type in ("counter", "histogram")]
    if not retired:
        return exposition(kept).decode()
    return exposition(merge_families(list(text_string_to_metric_families(retired)),
                                     [exposition(kept).decode()])).decode()
