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
    monkeypatch.delenv("KVPILOT_LEADER_ELECT", raising=False)
    assert parse([]).leader_elect is False  # off unless asked (the chart asks)
    assert parse(["--leader-elect"]).leader_elect is True
    args = parse([], env={"KVPILOT_LEADER_ELECT": "true"}, monkeypatch=monkeypatch)
    assert args.leader_elect is True and args.leader_election_id == "kvpilot-operator"
    assert parse(["--no-leader-elect"]).leader_elect is False


def test_leader_election_without_a_namespace_says_so(tmp_path, monkeypatch):
    """Outside a pod, without POD_NAMESPACE, --leader-elect stops with the fix."""
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    from kvpilot.operator import cli

    monkeypatch.setattr("kvpilot.operator.leader.default_namespace", lambda: None)
    with pytest.raises(SystemExit, match="--leader-elect needs the operator's namespace: set POD_NAMESPACE"):
        cli._lead(parse(["--leader-elect"]), metrics=None)
