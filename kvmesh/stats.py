"""Summary statistics of measured samples, one definition for every report.

The demo, the simulator and the benchmarks all print latency percentiles;
they take them from here so that a p99 means the same in each: numpy's
linear interpolation between the two nearest ranks (its default ``method``).
An empty sample summarises to 0.0 rather than NaN, so a run where every
request failed still prints and serialises (JSON has no NaN).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np

from kvmesh.errors import InvalidInput


def percentiles(values: Collection[float], qs: Sequence[float]) -> tuple[float, ...]:
    """The `qs` percentiles (each in [0, 100]) of `values`, sorting them once."""
    for q in qs:
        if not 0.0 <= q <= 100.0:  # also refuses NaN
            raise InvalidInput(f"a percentile must be between 0 and 100, got {q}")
    if not values:
        return tuple(0.0 for _ in qs)
    found = np.percentile(np.fromiter(values, dtype=np.float64, count=len(values)), list(qs))
    return tuple(float(v) for v in found)


def percentile(values: Collection[float], q: float) -> float:
    """The `q` percentile (in [0, 100]) of `values`, interpolated like numpy's default."""
    return percentiles(values, (q,))[0]


def mean(values: Collection[float]) -> float:
    """The arithmetic mean of `values`; 0.0 for none."""
    return math.fsum(values) / len(values) if values else 0.0
