"""AutoscalingSpec: CRD names in, clear errors for bad values."""

import pytest

from kvpilot.autoscaler import AutoscalingSpec


def test_from_crd_reads_camel_case_and_ignores_unknown_keys():
    spec = AutoscalingSpec.from_crd(
        {
            "minReplicas": 2,
            "maxReplicas": 9,
            "targetCacheUsage": 0.6,
            "targetQueueDepth": 8,
            "startupSeconds": 300,
            "scaleUpStabilizationSeconds": 30,
            "scaleDownStabilizationSeconds": 600,
            "intervalSeconds": 30,
            "metrics": {"source": "pods"},
        }
    )
    assert (spec.min_replicas, spec.max_replicas, spec.target_cache_usage) == (2, 9, 0.6)
    assert spec.forecast_horizon_seconds == 300 + spec.forecast_margin_seconds
    assert AutoscalingSpec.from_crd(spec.to_crd()) == spec


def test_defaults_match_the_crd_defaults():
    spec = AutoscalingSpec.from_crd({"maxReplicas": 4})
    assert spec.to_crd() == {
        "minReplicas": 1,
        "maxReplicas": 4,
        "targetCacheUsage": 0.75,
        "targetQueueDepth": 4.0,
        "targetSaturation": 0.75,
        "startupSeconds": 120.0,
        "scaleUpStabilizationSeconds": 0.0,
        "scaleDownStabilizationSeconds": 300.0,
        "intervalSeconds": 15.0,
        "nodeStartupSeconds": 0.0,  # node headroom off
        "scaleToZeroAfterSeconds": 300.0,  # read only with minReplicas 0
        "activationTimeoutSeconds": 300.0,
    }


@pytest.mark.parametrize(
    ("crd", "message"),
    [
        ({"minReplicas": 5, "maxReplicas": 2},
         "maxReplicas must be >= 1 and >= minReplicas (5); got 2"),
        ({"minReplicas": -1}, "minReplicas must be >= 0 (0 = scale to zero); got -1"),
        ({"minReplicas": 0, "maxReplicas": 0}, "maxReplicas must be >= 1"),
        ({"minReplicas": 0, "scaleToZeroAfterSeconds": 0}, "scaleToZeroAfterSeconds must be > 0"),
        ({"minReplicas": 0, "activationTimeoutSeconds": -5},
         "activationTimeoutSeconds must be > 0; got -5"),
        ({"minReplicas": 1.5}, "minReplicas must be a whole number; got 1.5"),
        ({"targetCacheUsage": -0.1}, "targetCacheUsage must be in (0, 1); got -0.1"),
        ({"targetCacheUsage": 1.0}, "targetCacheUsage must be in (0, 1); got 1.0"),
        ({"targetCacheUsage": 0.97}, "starvation_usage must be in (targetCacheUsage=0.97, 1]"),
        ({"targetQueueDepth": 0}, "targetQueueDepth must be > 0; got 0"),
        ({"startupSeconds": -1}, "startupSeconds must be >= 0; got -1"),
        (
            {"scaleDownStabilizationSeconds": -5},
            "scaleDownStabilizationSeconds must be >= 0; got -5",
        ),
        ({"intervalSeconds": 0}, "intervalSeconds must be > 0; got 0"),
        ({"intervalSeconds": 90}, "forecast_window_seconds must be >= 2 x intervalSeconds (180"),
        ({"maxReplicas": "ten"}, "maxReplicas must be a number; got 'ten'"),
        ({"startupSeconds": float("nan")}, "startupSeconds must be finite"),
        ({"maxReplicas": True}, "maxReplicas must be a number; got True"),
    ],
)
def test_bad_values_name_the_field_the_value_and_what_is_allowed(crd, message):
    with pytest.raises(ValueError) as err:
        AutoscalingSpec.from_crd({"maxReplicas": 10, **crd})
    assert message in str(err.value)


def _autoscaling_defaults(crd_path):
    """``{dotted name under spec.autoscaling: default}`` as a CRD file declares them."""
    import yaml

    crd = yaml.safe_load(crd_path.read_text())
    (version,) = crd["spec"]["versions"]
    root = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
    found = {}

    def walk(node, path):
        for key, sub in node.get("properties", {}).items():
            dotted = f"{path}.{key}" if path else key
            if "default" in sub and sub["default"] != {}:
                found[dotted] = sub["default"]
            walk(sub, dotted)

    walk(root["autoscaling"], "")
    return found


@pytest.mark.parametrize(
    "crd_file",
    ["crds/inferencedeployments.kvpilot.dev.yaml",
     "charts/kvpilot/crds/inferencedeployments.kvpilot.dev.yaml"],
)
def test_the_defaults_table_is_the_crds(crd_file):
    """One table (kvpilot.autoscaler.spec.DEFAULTS) holds spec.autoscaling's defaults; both
    copies of the CRD must declare exactly it, and the dataclass must default to it."""
    from pathlib import Path

    from kvpilot.autoscaler.spec import DEFAULTS

    repo = Path(__file__).resolve().parents[2]
    found = _autoscaling_defaults(repo / crd_file)
    assert found == DEFAULTS
    assert {type(v) for v in found.values()} == {type(v) for v in DEFAULTS.values()}
    defaulted = AutoscalingSpec.from_crd({"maxReplicas": 3})
    assert {k: v for k, v in defaulted.to_crd().items() if k != "maxReplicas"} == {
        k: v for k, v in DEFAULTS.items() if "." not in k and k != "engine"
    }
    assert defaulted.metrics.source == DEFAULTS["metrics.source"]
    assert defaulted.engine == DEFAULTS["engine"] == "kvpilot"
