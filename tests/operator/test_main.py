"""`kvpilot operator`: flags, environment defaults, clear errors, and no torch import."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

import pytest

from kvpilot.operator.cli import add_arguments, options_from_args


def parse(argv, env=None, monkeypatch=None):
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def test_defaults():
    options = options_from_args(parse([]))
    assert options.engine_image == "kvpilot/engine:0.1.0"
    assert options.router_image == "kvpilot/router:0.1.0"
    assert options.pod_monitor == "auto" and options.resync_seconds == 300
    assert options.namespaces == ()


def test_flags_and_environment(monkeypatch):
    args = parse(["--namespace", "a", "--namespace", "b", "--resync-seconds", "60"],
                 env={"KVPILOT_ENGINE_IMAGE": "my/engine:2", "KVPILOT_POD_MONITOR": "never",
                      "KVPILOT_ROUTER_IMAGE": "my/router:3"},
                 monkeypatch=monkeypatch)
    options = options_from_args(args)
    assert options.namespaces == ("a", "b") and options.resync_seconds == 60
    assert options.engine_image == "my/engine:2" and options.pod_monitor == "never"
    assert options.router_image == "my/router:3"
    assert options_from_args(parse(["--router-image", "r:4"])).router_image == "r:4"
    with pytest.raises(ValueError, match="router_image must be a non-empty image reference"):
        options_from_args(parse(["--router-image", ""]))


def test_pod_monitor_labels(capsys):
    options = options_from_args(parse(["--pod-monitor-label", "release=kps",
                                       "--pod-monitor-label", "team=ml=1"]))
    assert options.pod_monitor_labels == (("release", "kps"), ("team", "ml=1"))
    with pytest.raises(SystemExit):
        parse(["--pod-monitor-label", "release"])
    assert "a label is KEY=VALUE; got 'release'" in capsys.readouterr().err


def test_bad_values_name_the_flag():
    with pytest.raises(ValueError, match=r"resync_seconds must be >= 10; got 1\.0"):
        options_from_args(parse(["--resync-seconds", "1"]))
    with pytest.raises(SystemExit):
        parse(["--pod-monitor", "sometimes"])


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "kvpilot.cli", *args], capture_output=True,
                          text=True, timeout=60, env={**os.environ, **(env or {})})


def test_help_does_not_import_torch():
    code = ("import sys; from kvpilot.cli import main\n"
            "try:\n    main(['operator', '--help'])\nexcept SystemExit:\n    pass\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n"
            "assert 'kvpilot.engine' not in sys.modules\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--engine-image" in result.stdout


def test_without_cluster_configuration_it_says_so(tmp_path):
    result = run_cli("operator", "--metrics-port", "0", "--health-port", "0",
                     env={"KUBECONFIG": str(tmp_path / "missing"), "KUBERNETES_SERVICE_HOST": ""})
    assert result.returncode != 0
    assert "no Kubernetes configuration" in result.stderr
    assert "Traceback" not in result.stderr


def test_leader_election_flags_and_environment(monkeypatch):
    from kvpilot.operator.cli import wants_leader_election

    monkeypatch.delenv("KVPILOT_LEADER_ELECT", raising=False)
    assert wants_leader_election(parse([])) is False  # off unless asked (the chart asks)
    assert wants_leader_election(parse(["--leader-elect"])) is True
    for value, on in (("true", True), ("on", True), ("1", True), ("off", False), ("no", False)):
        monkeypatch.setenv("KVPILOT_LEADER_ELECT", value)
        args = parse([])
        assert wants_leader_election(args) is on and args.leader_election_id == "kvpilot-operator"
    monkeypatch.setenv("KVPILOT_LEADER_ELECT", "true")
    assert wants_leader_election(parse(["--no-leader-elect"])) is False  # the flag wins
    # Found by a fresh-user trial: "enabled" silently meant off (two operators acting).
    monkeypatch.setenv("KVPILOT_LEADER_ELECT", "enabled")
    with pytest.raises(SystemExit, match=r"KVPILOT_LEADER_ELECT='enabled': use one of 1, true, yes, on"):
        wants_leader_election(parse([]))


@pytest.mark.parametrize("argv,message", [
    (["--metrics-port", "70000"], "a TCP port 1-65535, or 0 for off; got '70000'"),
    (["--health-port", "-1"], "a TCP port 1-65535, or 0 for off; got '-1'"),
    (["--leader-election-id", "Bad_ID"], "a Lease name (a DNS-1123 subdomain"),
])
def test_bad_operator_flags_are_refused_before_anything_starts(argv, message, capsys):
    """Found by a fresh-user trial: --metrics-port 70000 ended in an OverflowError
    traceback, and a bad Lease name reached the API server."""
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


def test_leader_election_without_a_namespace_says_so(tmp_path, monkeypatch):
    """Outside a pod, without POD_NAMESPACE, --leader-elect stops with the fix."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    from kvpilot.operator import cli

    monkeypatch.setattr("kvpilot.operator.leader.default_namespace", lambda: None)
    with pytest.raises(SystemExit, match="--leader-elect needs the operator's namespace: set POD_NAMESPACE"):
        cli._lead(parse(["--leader-elect"]), metrics=None)
