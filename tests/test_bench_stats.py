"""The tunnel bench's statistics (pure): nearest-rank percentiles and the bootstrap
interval it reports for the p99 the tunnel adds (tests/bench/bench_tunnel.py)."""

from __future__ import annotations

import random

from tests.bench.bench_tunnel import _percentile, added_interval


def test_nearest_rank_percentile() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert _percentile(xs, 50) == 50.0
    assert _percentile(xs, 99) == 99.0
    assert _percentile([7.0], 99) == 7.0


def test_interval_covers_a_known_shift_and_excludes_none() -> None:
    rng = random.Random(7)
    base = [rng.expovariate(1.0) + 1.0 for _ in range(4000)]
    shifted = [x + 0.5 for x in base]
    lo, hi = added_interval(base, shifted, resamples=200)
    assert lo < 0.5 < hi
    assert lo > 0.0  # a real difference is told from noise


def test_interval_of_the_same_distribution_straddles_zero() -> None:
    rng = random.Random(11)
    a = [rng.expovariate(1.0) for _ in range(4000)]
    b = [rng.expovariate(1.0) for _ in range(4000)]
    lo, hi = added_interval(a, b, resamples=200)
    assert lo < 0.0 < hi


def test_interval_is_reproducible() -> None:
    xs = [float(i % 37) for i in range(1000)]
    ys = [float(i % 41) for i in range(1000)]
    assert added_interval(xs, ys, resamples=50) == added_interval(xs, ys, resamples=50)
