"""The ``kvpilot`` console script's dispatch."""

from __future__ import annotations

import pytest

from kvpilot import cli


@pytest.mark.parametrize("argv", [
    ["serve", "--por=9001"], ["serve", "--po", "9001"], ["serve", "--hos=0.0.0.0"],
    ["serve", "--kv-cache-dt=fp8"], ["serve", "--no-enable-prefix"],
])
def test_abbreviated_flags_are_unknown_not_the_managed_ones(argv, capsys):
    """Found in review: argparse took ``--por=9001`` for ``--port``, so an
    InferenceDeployment's ``engine.extraArgs`` could override the port, host or model the
    operator manages (and fail the probes). Abbreviations are now refused outright, by the
    vLLM flag check (kvpilot.flags.check) before argparse, which names the full flag."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvpilot serve: 1 flag cannot be honoured: {argv[1]} (not a kvpilot flag")
    assert "abbreviations are not accepted: did you mean --" in err


def test_the_api_key_can_come_from_the_environment_and_the_flag_wins(monkeypatch):
    """A key in the pod's args shows in `kubectl get pod -o yaml` and `ps`; a Secret can
    set KVPILOT_API_KEY instead."""
    import argparse

    from kvpilot.engine.server import cli as serve_cli

    monkeypatch.setenv("KVPILOT_API_KEY", "from-secret")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    serve_cli.add_arguments(parser)
    assert parser.parse_args([]).api_key == "from-secret"
    assert parser.parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.setenv("KVPILOT_API_KEY", "")
    parser = argparse.ArgumentParser(allow_abbrev=False)
    serve_cli.add_arguments(parser)
    assert parser.parse_args([]).api_key is None  # empty means no key, not an empty key
