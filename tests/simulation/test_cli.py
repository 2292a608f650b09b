"""kvpilot simulate through the real console entry point."""

import argparse
import json

from kvpilot.cli import main
from kvpilot.simulation.cli import add_arguments


def test_simulate_compares_policies_and_writes_json_and_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "sim.json", tmp_path / "sim.png"
    assert (
        main(
            [
                "simulate",
                "--trace",
                "burst",
                "--replicas",
                "2",
                "--duration",
                "900",
                "--warmup",
                "120",
                "--json",
                str(out_json),
                "--plot",
                str(out_png),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    for policy in ("kvpilot", "hpa", "kpa", "kpa_concurrency", "saturation"):
        assert policy in table
    data = json.loads(out_json.read_text())
    assert {r["policy"] for r in data["results"]} == {"kvpilot", "hpa", "kpa", "kpa_concurrency",
                                                      "saturation"}
    assert len(data["results"][0]["timeline"]["time"]) > 10
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_refuses_an_unknown_policy(capsys):
    assert main(["simulate", "--policies", "kvpilot,vpa", "--duration", "600"]) == 2
    assert "--policies must name kvpilot, hpa, kpa, kpa_concurrency, saturation; got 'vpa'" in capsys.readouterr().err


def test_simulate_refuses_bad_numbers_with_the_flag_and_value(capsys):
    """Found in review: tracebacks for --policies , and --replicas inf; 0 and NaN accepted;
    then messages naming the dataclasses' fields (peak_replicas, targetCacheUsage) rather
    than the flags typed."""
    for argv, message in (
        (["--policies", ","], "--policies must name at least one of"),
        (["--replicas", "inf"], "--replicas must be finite and in (0, 100000]; got inf"),
        (["--max-factor", "0"], "--max-factor must be finite and in [1, 100]; got 0.0"),
        (["--slo-seconds", "nan"], "--slo-seconds must be finite and > 0 seconds; got nan"),
        (["--duration", "0"], "--duration must be finite and in (0, 2592000] seconds"),
        (["--warmup", "600"], "--warmup must be finite and in [0, --duration 600) seconds;"
                              " got 600.0"),
        (["--slo-ttft", "-1"], "--slo-ttft must be finite and in (0, 86400] seconds; got -1.0"),
        (["--slo-itl", "1e6", "--slo-profile", "gpu"],
         "--slo-itl must be finite and in (0, 86400] seconds; got 1000000.0"),
        (["--target-cache-usage", "0.97"],
         "--target-cache-usage must be finite and in (0, 0.95)"),
        (["--target-queue-depth", "0"], "--target-queue-depth must be finite and > 0; got 0.0"),
    ):
        assert main(["simulate", "--duration", "600", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert message in err, (argv, err)
        assert len(err.strip().splitlines()) == 1, err


def test_simulate_compares_routings_with_their_hit_rates(tmp_path, capsys):
    out_json = tmp_path / "sim.json"
    argv = ["simulate", "--trace", "agentic", "--replicas", "10", "--duration", "600",
            "--warmup", "120", "--policies", "kvpilot", "--routing",
            "kv_aware,session_affine,random", "--json", str(out_json)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "hit %" in table and "max share" in table
    rows = {line.split()[1]: line.split() for line in table.splitlines()
            if line.startswith("agentic") and "decisions" not in line}
    assert set(rows) == {"kv_aware", "session_affine", "random"}
    data = json.loads(out_json.read_text())
    assert data["routings"] == ["kv_aware", "session_affine", "random"]
    rate = {r["routing"]: r["prefix_hit_rate"] for r in data["results"]}
    assert rate["random"] < min(rate["kv_aware"], rate["session_affine"])
    assert float(rows["kv_aware"][3]) == round(100 * rate["kv_aware"], 1)
    assert all(r["requests_per_replica"] and 0 < r["max_replica_share"] <= 1
               for r in data["results"])


def test_simulate_refuses_an_unknown_routing(capsys):
    assert main(["simulate", "--routing", "kv_aware,sticky", "--duration", "600"]) == 2
    assert "--routing must name kv_aware, session_affine, random, p2c_kv or all;" \
           " got 'sticky'" in capsys.readouterr().err


def test_simulate_slo_profile_gives_our_policy_the_scoring_targets(tmp_path, capsys):
    """Without --slo-profile our policy runs without an SLO (the targets only score);
    with it, spec.autoscaling.slo carries the targets and its decisions a latency view."""
    from kvpilot.autoscaler.sim import make_trace, simulate
    from kvpilot.autoscaler.sim.calibration import PRESETS
    from kvpilot.autoscaler.sim.controllers import make_policy
    from kvpilot.simulation.cli import scenario_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = ["--replicas", "2", "--duration", "600", "--warmup", "120",
            "--replica-model", "h200-llama3-8b"]
    assert scenario_from_args(parser.parse_args(argv)).slo_profile is None
    assert scenario_from_args(parser.parse_args([*argv, "--slo-profile", "cpu"])).slo_profile == "cpu"
    scenario = scenario_from_args(parser.parse_args([*argv, "--slo-profile", "preset",
                                                     "--slo-ttft", "0.8"]))
    assert scenario.slo_profile == "gpu"
    model = PRESETS["h200-llama3-8b"]
    trace = make_trace("burst", 2, 600, 0, model)
    slo = scenario.spec(trace, model).slo
    assert slo is not None and (slo.ttft_seconds, slo.itl_seconds, slo.profile) == (0.8, 0.05, "gpu")
    policy = make_policy("kvpilot", scenario.spec(trace, model))
    simulate(trace, policy, model, scenario.config(trace))
    assert policy.last is not None and policy.last.latency is not None

    out = tmp_path / "sim.json"
    assert main(["simulate", "--trace", "burst", *argv, "--policies", "kvpilot",
                 "--slo-profile", "preset", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["scenario"]["slo_profile"] == "gpu"
    assert main(["simulate", "--trace", "burst", *argv, "--policies", "kvpilot",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["scenario"]["slo_profile"] is None


def test_simulate_refuses_an_unwritable_output_before_running(tmp_path, capsys):
    missing = tmp_path / "no" / "such"
    for flag, name in (("--json", "x.json"), ("--plot", "x.png")):
        path = str(missing / name)
        assert main(["simulate", "--duration", "600", flag, path]) == 2
        err = capsys.readouterr().err
        assert f"{flag} must be a path in an existing directory; got {path!r}" in err
        assert "requests" not in err  # refused before any run
        assert len(err.strip().splitlines()) == 1
    assert main(["simulate", "--duration", "600", "--json", str(tmp_path)]) == 2
    assert "--json must name a file, not a directory" in capsys.readouterr().err


def test_simulate_refuses_a_run_longer_than_30_days(capsys):
    assert main(["simulate", "--duration", "2592001"]) == 2
    assert ("--duration must be finite and in (0, 2592000] seconds (30 days); got 2592001.0"
            in capsys.readouterr().err)


def test_simulate_warns_when_no_request_was_judged_or_all_were_rejected(capsys):
    argv = ["simulate", "--trace", "burst", "--duration", "600", "--warmup", "120",
            "--policies", "kvpilot,hpa"]
    assert main([*argv, "--replicas", "0.001"]) == 0
    err = capsys.readouterr().err
    assert "warning: burst kv_aware: no request was judged after the warm-up" in err
    assert main([*argv, "--replicas", "2", "--kv-capacity-tokens", "10"]) == 0
    err = capsys.readouterr().err
    assert "warning: burst kv_aware: every request was rejected" in err
    assert main([*argv, "--replicas", "2"]) == 0
    assert "warning" not in capsys.readouterr().err
