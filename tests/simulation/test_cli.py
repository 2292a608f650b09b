"""kvpilot simulate through the real console entry point."""

import json

from kvpilot.cli import main


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
    for policy in ("kvpilot", "hpa", "kpa"):
        assert policy in table
    data = json.loads(out_json.read_text())
    assert {r["policy"] for r in data["results"]} == {"kvpilot", "hpa", "kpa"}
    assert len(data["results"][0]["timeline"]["time"]) > 10
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_refuses_an_unknown_policy(capsys):
    assert main(["simulate", "--policies", "kvpilot,vpa", "--duration", "600"]) == 2
    assert "--policies must name kvpilot, hpa, kpa; got 'vpa'" in capsys.readouterr().err


def test_simulate_refuses_bad_numbers_with_the_flag_and_value(capsys):
    """Found in review: tracebacks for --policies , and --replicas inf; 0 and NaN accepted."""
    for argv, message in (
        (["--policies", ","], "--policies must name at least one of"),
        (["--replicas", "inf"], "peak_replicas must be finite and in (0, 100000]; got inf"),
        (["--max-factor", "0"], "max_factor must be finite and in [1, 100]; got 0.0"),
        (["--slo-seconds", "nan"], "slo_wait_seconds must be finite and > 0; got nan"),
    ):
        assert main(["simulate", "--duration", "600", *argv]) == 2, argv
        assert message in capsys.readouterr().err
