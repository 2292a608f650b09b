"""Least-squares trend and time to exhaustion."""

import math

import pytest

from kvpilot.autoscaler.forecast import fit_trend, seconds_to_exhaustion, t_critical_95


def test_exact_line_is_recovered_with_zero_error():
    points = [(t, 2.0 + 0.01 * t) for t in (0.0, 15.0, 30.0, 45.0)]
    trend = fit_trend(points, now=45.0)
    assert trend.slope == pytest.approx(0.01) and trend.slope_stderr == pytest.approx(
        0.0, abs=1e-12
    )
    assert trend.level == pytest.approx(2.45) and trend.at(100.0) == pytest.approx(3.45)
    assert trend.cautious_slope == pytest.approx(0.01)
    assert (trend.samples, trend.span_seconds) == (4, 45.0)


def test_too_few_or_simultaneous_points_give_no_trend():
    assert fit_trend([(0.0, 1.0), (15.0, 2.0)], 15.0) is None
    assert fit_trend([(5.0, 1.0), (5.0, 2.0), (5.0, 3.0)], 5.0) is None


def test_noise_widens_the_interval_and_few_points_widen_it_more():
    noisy = [(0.0, 1.0), (15.0, 1.3), (30.0, 1.1), (45.0, 1.4)]
    trend = fit_trend(noisy, 45.0)
    assert trend.slope > 0 and trend.cautious_slope < 0  # a rise the noise could give
    assert t_critical_95(1) > t_critical_95(5) > t_critical_95(100) > 1.96


def test_seconds_to_exhaustion():
    assert seconds_to_exhaustion(2.0, 0.01, 3.0) == pytest.approx(100.0)
    assert seconds_to_exhaustion(3.5, 0.01, 3.0) == 0.0
    assert math.isinf(seconds_to_exhaustion(2.0, 0.0, 3.0))
    assert math.isinf(seconds_to_exhaustion(2.0, -1.0, 3.0))
