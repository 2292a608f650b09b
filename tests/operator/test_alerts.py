"""The shipped alerts: rendered from the chart, checked by `promtool check rules`, unit
tested by `promtool test rules` (each alert fires on a sick deployment's series and stays
quiet on a healthy one), written with metric names that exist, and documented."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from kvpilot.operator.metrics import OperatorMetrics

from .tools import REPO, helm_template, run, tool

pytestmark = pytest.mark.tools  # runs helm and promtool (`make tools`)

PROMTOOL_TESTS = Path(__file__).parent / "promtool" / "alerts_test.yaml"
OPERATIONS = REPO / "docs" / "operations.md"
# docs/architecture.md, "Metrics (engine /metrics)": the engine's series, fixed names.
ENGINE_COUNTERS = {"prefix_cache_queries_total", "prefix_cache_hits_total",
                   "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total"}
ENGINE_GAUGES = {"gpu_cache_usage_factor", "prefix_cache_hit_rate", "num_requests_running",
                 "num_requests_waiting", "num_waiting_tokens", "kv_cache_capacity_tokens",
                 "cache_config_info"}
ENGINE_HISTOGRAMS = {"time_to_first_token_seconds", "inter_token_latency_seconds",
                     "e2e_request_latency_seconds", "request_queue_time_seconds"}
ENGINE_SERIES = {f"kvpilot:{n}" for n in ENGINE_COUNTERS | ENGINE_GAUGES} | {
    f"kvpilot:{h}{suffix}" for h in ENGINE_HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
# The kinds of alert the runbook (docs/operations.md) promises, by the name that implements each.
REQUIRED = {
    "KV cache near full": "KVPilotKVCacheNearFull",
    "KV exhaustion forecast (predict_linear)": "KVPilotKVCacheExhaustionForecast",
    "queue growing": "KVPilotQueueGrowing",
    "preemptions": "KVPilotPreemptions",
    "TTFT SLO burn rate, fast window pair": "KVPilotTTFTBudgetBurnFast",
    "TTFT SLO burn rate, slow window pair": "KVPilotTTFTBudgetBurnSlow",
    "engine pods not ready": "KVPilotEnginePodsNotReady",
    "metrics missing": "KVPilotMetricsMissing",
    "operator down": "KVPilotOperatorDown",
    "operator replicas without a leader": "KVPilotOperatorNoLeader",
    "autoscaler pinned at max": "KVPilotAutoscalerPinnedAtMax",
    "replica flapping": "KVPilotReplicaFlapping",
}


def operator_series() -> set[str]:
    metrics = OperatorMetrics()
    metrics.observe("ns", "x", {"desiredReplicas": 1, "readyReplicas": 1}, {"maxReplicas": 2})
    metrics.count_scale("ns", "x", 1, 2)
    metrics.set_leader(True)  # kvpilot_operator_leader exists with --leader-elect only
    return {s.name for fam in metrics.registry.collect() for s in fam.samples}


@pytest.fixture(scope="module")
def groups() -> list[dict]:
    (rule,) = [d for d in helm_template() if d["kind"] == "PrometheusRule"]
    return rule["spec"]["groups"]


@pytest.fixture(scope="module")
def alerts(groups) -> dict[str, dict]:
    return {r["alert"]: r for g in groups for r in g["rules"]}


@pytest.fixture
def rules_dir(tmp_path, groups) -> Path:
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}, sort_keys=False))
    shutil.copy(PROMTOOL_TESTS, tmp_path / PROMTOOL_TESTS.name)
    return tmp_path


def test_every_required_alert_exists(alerts):
    assert set(REQUIRED.values()) == set(alerts)


def test_promtool_check_rules(rules_dir):
    out = run([tool("promtool"), "check", "rules", "rules.yaml"], cwd=rules_dir).stdout
    assert f"SUCCESS: {len(REQUIRED)} rules found" in out


def test_promtool_test_rules(rules_dir):
    result = run([tool("promtool"), "test", "rules", PROMTOOL_TESTS.name], cwd=rules_dir)
    assert "SUCCESS" in result.stdout


def test_promtool_tests_fail_on_a_broken_alert(rules_dir, groups):
    """The unit tests have teeth: an alert that can never fire makes them fail."""
    broken = json.loads(json.dumps(groups))
    broken[0]["rules"][0]["expr"] = "vector(0) > 1"
    (rules_dir / "rules.yaml").write_text(yaml.safe_dump({"groups": broken}, sort_keys=False))
    result = run([tool("promtool"), "test", "rules", PROMTOOL_TESTS.name], cwd=rules_dir,
                 check=False)
    assert result.returncode != 0 and "KVPilotKVCacheNearFull" in result.stdout + result.stderr


def test_each_alert_is_tested_firing_and_quiet(alerts):
    """Every alert has an eval where it fires, and either an eval where it must not fire
    or a healthy deployment in the same test whose labels never appear in the alerts."""
    tests = yaml.safe_load(PROMTOOL_TESTS.read_text())["tests"]
    fires, quiet = set(), set()
    for test in tests:
        deployments = {m.group(1) for s in test["input_series"]
                       if (m := re.search(r'inference_deployment="([^"]+)"', s["series"]))}
        for case in test["alert_rule_test"]:
            name, expected = case["alertname"], case.get("exp_alerts") or []
            if not expected:
                quiet.add(name)
                continue
            fires.add(name)
            firing = {a["exp_labels"].get("inference_deployment") for a in expected}
            if deployments - firing:
                quiet.add(name)
    assert fires == set(alerts), f"never seen firing: {set(alerts) - fires}"
    assert quiet == set(alerts), f"never seen quiet: {set(alerts) - quiet}"


def test_alerts_use_only_metrics_that_exist(alerts):
    """A misspelt name (a counter without _total, say) is an empty vector forever: the
    alert could never fire (case C17's failure mode, for alerts)."""
    known = ENGINE_SERIES | operator_series()
    for name, rule in alerts.items():
        used = set(re.findall(r"\b(kvpilot[:_][a-z0-9_:]+)", rule["expr"]))
        assert used, name
        assert used <= known, f"{name}: unknown {used - known}"


def test_dashboard_uses_only_metrics_that_exist():
    (config_map,) = [d for d in helm_template() if d["kind"] == "ConfigMap"]
    known = ENGINE_SERIES | operator_series()
    dashboard = json.loads(config_map["data"]["kvpilot.json"])
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if "query" in v
              and isinstance(v["query"], dict)]
    used = set().union(*(re.findall(r"\b(kvpilot[:_][a-z0-9_:]+)", e) for e in exprs))
    assert used <= known, used - known
    assert {"kvpilot:gpu_cache_usage_factor", "kvpilot:num_requests_waiting",
            "kvpilot_operator_desired_replicas"} <= used


def test_alerts_join_on_the_labels_the_operator_and_podmonitor_produce(alerts):
    for name, rule in alerts.items():
        for by in re.findall(r"by \(([^)]*)\)", rule["expr"]):
            assert set(by.replace(" ", "").split(",")) <= {"namespace", "inference_deployment",
                                                           "le"}, name


def test_every_alert_has_a_runbook_section(alerts):
    text = OPERATIONS.read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).strip().replace(" ", "-")
               for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}
    for name, rule in alerts.items():
        assert "runbook_url" not in rule["annotations"]  # no base URL set: no broken link
        anchor = rule["annotations"]["runbook"].split("#", 1)[1].split()[0]
        assert anchor in anchors, f"{name}: docs/operations.md has no section #{anchor}"
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_the_documented_rule_render_command_runs_as_written(groups):
    """docs/operations.md tells clusters without the Prometheus Operator to render the
    rules with one `helm template` command: run exactly that line (helm from `make
    tools`) and get the same rule groups the chart ships."""
    import shlex

    (line,) = re.findall(r"`(helm template [^`]+)`", OPERATIONS.read_text())
    argv = shlex.split(line)
    out = run([tool("helm"), *argv[1:]], cwd=REPO).stdout
    (doc,) = [d for d in yaml.safe_load_all(out) if d]
    assert doc["kind"] == "PrometheusRule" and doc["spec"]["groups"] == groups
