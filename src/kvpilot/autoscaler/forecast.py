"""Least-squares trend of KV demand and the time until it exhausts the fleet's KV.

Prometheus' ``predict_linear`` and ``deriv`` fit the same simple linear regression over a
range; we fit it over the policy's own demand samples so the policy stays pure and works
with either metric source.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Trend:
    """A fitted line ``demand(t) = level + slope * (t - now)``.

    Attributes:
        slope: demand units per second (replica-equivalents / s in the policy).
        slope_stderr: standard error of the slope (0 for a perfect fit).
        level: the line's value at ``now`` (the fitted, de-noised current demand).
        samples: how many points were fitted.
        span_seconds: time between the oldest and newest point.
    """

    slope: float
    slope_stderr: float
    level: float
    samples: int
    span_seconds: float

    def at(self, seconds_ahead: float) -> float:
        return self.level + self.slope * seconds_ahead

    @property
    def cautious_slope(self) -> float:
        """The lower end of the slope's two-sided 95% confidence interval (Student's t with
        ``samples - 2`` degrees of freedom): a rise the scatter alone would rarely give."""
        return self.slope - t_critical_95(self.samples - 2) * self.slope_stderr


# Two-sided 95% Student-t critical values by degrees of freedom (standard tables).
_T95 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
)


def t_critical_95(dof: int) -> float:
    """Two-sided 95% critical value of Student's t; 1.96 (the normal) past 20 dof would
    understate it slightly, so the 20-dof value bounds it from above."""
    if dof < 1:
        return math.inf
    return _T95[min(dof, len(_T95)) - 1]


def fit_trend(points: Sequence[tuple[float, float]], now: float) -> Trend | None:
    """Ordinary least squares over ``(time, value)`` points; ``None`` with fewer than 3
    points or when all share one time (no slope can be fitted)."""
    n = len(points)
    if n < 3:
        return None
    mean_t = math.fsum(t for t, _ in points) / n
    mean_v = math.fsum(v for _, v in points) / n
    sxx = math.fsum((t - mean_t) ** 2 for t, _ in points)
    if sxx <= 0.0:
        return None
    sxy = math.fsum((t - mean_t) * (v - mean_v) for t, v in points)
    slope = sxy / sxx
    intercept = mean_v - slope * mean_t
    residual = math.fsum((v - intercept - slope * t) ** 2 for t, v in points)
    stderr = math.sqrt(residual / (n - 2) / sxx)
    span = max(t for t, _ in points) - min(t for t, _ in points)
    return Trend(
        slope=slope,
        slope_stderr=stderr,
        level=mean_v + slope * (now - mean_t),
        samples=n,
        span_seconds=span,
    )


def seconds_to_exhaustion(current: float, slope: float, capacity: float) -> float:
    """Seconds until ``current + slope * s`` reaches ``capacity``: 0 if already there,
    ``inf`` if the demand is flat or falling."""
    if current >= capacity:
        return 0.0
    if slope <= 0.0:
        return math.inf
    return (capacity - current) / slope


def still_rising(points: Sequence[tuple[float, float]], now: float, window: float) -> bool:
    """True when the newest third of ``window`` (at least 3 points) has its own positive
    slope. A level shift (a step) makes the whole-window line rise for a while after it is
    over; requiring the rise to go on at the newest end tells a ramp from a step that
    already happened."""
    recent_points = [p for p in points if p[0] >= now - window / 3.0]
    if len(recent_points) < 3:
        recent_points = list(points[-3:])
    recent = fit_trend(recent_points, now)
    return recent is not None and recent.slope > 0.0
