"""kvpilot.stats: the one percentile the simulator and the benchmarks report."""

from __future__ import annotations

import pytest

from kvpilot.stats import percentile


def test_linear_interpolation_like_numpy():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(iter([4.0, 1.0, 3.0, 2.0]), 0) == 1.0  # any order, any iterable
    assert percentile([1, 2, 3, 4], 100) == 4
    assert percentile(range(1, 101), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0


@pytest.mark.parametrize(("values", "pct", "match"), [
    ([], 50, "no values"),
    ([1.0], -1, r"\[0, 100\], got -1"),
    ([1.0], 100.5, r"\[0, 100\], got 100.5"),
])
def test_bad_input_is_refused(values, pct, match):
    with pytest.raises(ValueError, match=match):
        percentile(values, pct)
