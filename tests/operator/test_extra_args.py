"""``engine.extraArgs`` is checked as ``kvpilot serve`` checks its command line
(:mod:`kvpilot.flags.check`): a flag the engine accepts passes, one it refuses fails the
spec, with the engine's reasons; the flag table the operator checks against
(:mod:`kvpilot.flags.serve`) is the one the engine's parser is made from."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.flags import check
from kvpilot.flags import serve as serve_flags
from kvpilot.flags import vllm as vf
from kvpilot.operator.spec import MANAGED_FLAGS, SpecError, parse_spec

EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}


def spec_with(extra: list[str]):
    return parse_spec({"model": EMBEDDED, "engine": {"extraArgs": extra}})


def engine_known() -> dict[str, bool]:
    """The engine parser's option strings -> whether each takes a value."""
    pytest.importorskip("torch")
    from kvpilot.engine.server import cli as serve_cli

    parser = argparse.ArgumentParser(allow_abbrev=False)
    serve_cli.add_arguments(parser)
    return {s: a.nargs != 0 for a in parser._actions for s in a.option_strings}


def test_the_operator_knows_the_engines_flags():
    """The option strings the operator checks ``engine.extraArgs`` against (the table in
    kvpilot.flags.serve) are the engine parser's, with whether each takes a value: a
    flag put on the parser outside the table would be refused by the operator."""
    known = engine_known()
    table = dict(serve_flags.option_strings())
    missing = {k: v for k, v in known.items() if table.get(k) != v}
    extra = sorted(set(table) - set(known))
    assert not missing and not extra, (
        f"src/kvpilot/flags/serve.py: add or fix {missing} (True: takes a value); "
        f"remove {extra}")


@pytest.mark.parametrize("extra", [
    ["--attention-backend", "torch", "--seed=7"],
    ["--enforce-eager", "--enable-chunked-prefill", "--trust-remote-code"],
    ["--pipeline-parallel-size", "1", "-pp=1", "--swap-space", "4", "--disable-log-stats"],
    ["--distributed-executor-backend=uni", "--kv-cache-memory", "0.25"],
    ["--lora-modules", "sql=/adapters/sql", '{"name": "b", "path": "/adapters/b"}'],
])
def test_flags_the_engine_accepts_pass(extra):
    assert spec_with(extra).engine.extra_args == tuple(extra)


@pytest.mark.parametrize(("extra", "value", "reason"), [
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2", "pipeline parallelism"),
    (["--pipeline-parallel-size=2"], "--pipeline-parallel-size=2", "pipeline parallelism"),
    (["--no-enforce-eager"], "--no-enforce-eager", "CUDA graphs"),
    (["--rope-theta", "1e6"], "--rope-theta 1e6", "RoPE theta"),
    (["--foo"], "--foo", "not a kvpilot flag"),
    (["--pipeline-parallel-size 2"], "--pipeline-parallel-size 2", "not a kvpilot flag"),
    (["--po", "9001"], "--po", "did you mean --port?"),
    (["Qwen/Qwen2.5-0.5B"], "Qwen/Qwen2.5-0.5B", "the operator sets from model.uri"),
])
def test_flags_the_engine_refuses_fail_the_spec(extra, value, reason):
    with pytest.raises(SpecError) as info:
        spec_with(extra)
    err = info.value
    assert (err.field, err.value) == ("engine.extraArgs", value)
    assert reason in str(err) and "kvpilot serve would fail: 1 " in str(err)


def test_every_refused_argument_is_named_at_once():
    with pytest.raises(SpecError) as info:
        spec_with(["--seed", "3", "--enable-sleep-mode", "--foo", "x", "-pp", "8"])
    assert info.value.value == ["--enable-sleep-mode", "--foo", "-pp 8"]
    assert "3 flags cannot be honoured" in str(info.value)


def test_help_is_refused():
    with pytest.raises(SpecError, match="print its help"):
        spec_with(["--help"])


def test_managed_flags_are_still_refused_first():
    with pytest.raises(SpecError, match="set the matching spec field"):
        spec_with(["--enforce-eager", "--port=9000"])


@pytest.mark.parametrize("extra", [
    ["-tp", "2"], ["-tp=2"], ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=2"],
    ["--tensor-parallel-size", "1"], ["--seed", "3", "-tp", "1"],
])
def test_tensor_parallelism_is_the_spec_fields_not_extra_args(extra):
    """The operator writes --tensor-parallel-size from engine.tensorParallelSize (default:
    the pod's GPU count); any spelling of it in extraArgs is refused, 1 included, naming
    the field to set instead."""
    with pytest.raises(SpecError) as info:
        spec_with(extra)
    err = info.value
    assert err.field == "engine.extraArgs"
    assert err.value == next(a for a in extra if a.startswith(("-tp", "--tensor")))
    assert "set the matching spec field (engine.tensorParallelSize" in str(err)


def test_the_operator_and_the_engine_agree_on_every_table_flag():
    """Each spelling of the table, with a value the entry accepts and one it refuses: the
    spec passes exactly when kvpilot serve's check passes."""
    cases: list[list[str]] = []
    for f in vf.FLAGS:
        for s in f.spellings:
            if s in MANAGED_FLAGS:
                continue  # the operator sets it from the spec: refused whatever the engine says
            if f.arity in (vf.Arity.SWITCH, vf.Arity.BOOL):
                cases.append([s])
            else:
                cases += [[s, (f.accepted.split(" or ")[0] if f.accepted else "7")], [s, "zzz"]]
    for extra in cases:
        try:
            check.split_vllm_flags(extra)
            engine_ok = True
        except check.VLLMFlagError:
            engine_ok = False
        try:
            spec_with(extra)
            operator_ok = True
        except SpecError:
            operator_ok = False
        assert engine_ok == operator_ok, extra


@pytest.mark.parametrize("extra", [
    ["--quantization", "awq"], ["--quantization=fp8"], ["-q", "gptq"], ["-q=gguf"],
])
def test_quantization_is_the_model_fields_not_extra_args(extra):
    """The operator writes --quantization from model.quantization: refused in extraArgs
    (whether or not the engine takes the flag yet), naming the field to set instead."""
    with pytest.raises(SpecError) as info:
        spec_with(extra)
    assert (info.value.field, info.value.value) == ("engine.extraArgs", extra[0])
    assert "set the matching spec field (model.quantization) instead" in str(info.value)
