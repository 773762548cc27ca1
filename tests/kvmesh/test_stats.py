"""kvmesh.stats: the one percentile every report uses."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvmesh.errors import InvalidInput
from kvmesh.stats import mean, percentile, percentiles


def test_percentile_interpolates_between_the_nearest_ranks() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([4.0, 1.0, 3.0, 2.0], 100) == 4.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 0) == 1.0
    assert percentile([5.0], 99) == 5.0


def test_an_empty_sample_summarises_to_zero_not_nan() -> None:
    assert percentile([], 50) == 0.0
    assert percentiles([], (50, 99)) == (0.0, 0.0)
    assert mean([]) == 0.0


@pytest.mark.parametrize("q", [-1.0, 100.5, math.nan])
def test_a_percentile_outside_0_to_100_is_refused(q: float) -> None:
    with pytest.raises(InvalidInput, match="between 0 and 100"):
        percentile([1.0, 2.0], q)


@given(
    st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50),
    st.floats(0, 100),
)
def test_percentiles_agree_with_numpy_and_stay_within_the_sample(
    values: list[float], q: float
) -> None:
    p50, got = percentiles(values, (50, q))
    assert got == pytest.approx(float(np.percentile(values, q)))
    assert min(values) - 1e-6 <= got <= max(values) + 1e-6
    assert p50 == percentile(values, 50)


def test_mean_is_the_arithmetic_mean() -> None:
    assert mean([1.0, 2.0, 6.0]) == 3.0
