"""Status fragments of the autoscaler are valid JSON (found on a real API server)."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone

from kvpilot.operator.status.autoscaler import autoscaler_status, json_number


def test_json_number_replaces_non_finite_floats_anywhere():
    value = {"a": math.inf, "b": [1.5, -math.inf, {"c": math.nan}], "d": (2, "x"), "e": None}
    assert json_number(value) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, "x"],
                                  "e": None}


def test_forecast_never_exhausted_is_written_as_null_not_infinity():
    """The forecast rule reports time-to-exhaustion inf for flat demand; kube-apiserver
    refused the whole status patch ("invalid JSON patch") for the Infinity token."""
    decision = {"rule": "hold", "candidates": [
        {"rule": "forecast", "replicas": None, "signal": "kv_demand_trend", "value": math.inf}]}
    status = autoscaler_status(decision, {"demand": [[1.0, math.inf]]},
                               datetime(2026, 1, 1, tzinfo=timezone.utc))
    text = json.dumps(status, allow_nan=False)  # raises on inf/nan
    assert '"value": null' in text
