"""``spec.model.quantization``: validated against the weight formats of
:mod:`kvpilot.sizing.quantization`, and written to the engine as vLLM's ``--quantization``
value, which the engine checks against the checkpoint."""

from __future__ import annotations

import kopf
import pytest

from kvpilot.flags import check
from kvpilot.flags import serve as serve_flags
from kvpilot.operator.builders import engine_args as ea
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import run_reconcile
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions
from kvpilot.operator.spec import SpecError, parse_spec
from kvpilot.sizing.quantization import VLLM_QUANTIZATIONS, WEIGHT_FORMATS

from .fakes import Clock, FakeKubeApi, inference

EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}


def spec(quantization=None, **engine):
    model = dict(EMBEDDED) if quantization is None else {**EMBEDDED, "quantization": quantization}
    return parse_spec({"model": model, "engine": engine})


def quantization_flag(args: list[str]) -> str | None:
    return args[args.index("--quantization") + 1] if "--quantization" in args else None


def test_absent_is_auto_and_every_format_name_is_accepted():
    assert spec().model.quantization == "auto"
    for name in ("auto", *WEIGHT_FORMATS):
        assert spec(name).model.quantization == name


@pytest.mark.parametrize("bad", ["int3", "AWQ", "compressed-tensors", "gptq", "", 4, True])
def test_anything_else_is_refused_naming_the_field_the_value_and_the_formats(bad):
    with pytest.raises(SpecError) as info:
        spec(bad)
    err = info.value
    assert (err.field, err.value) == ("model.quantization", bad)
    assert str(err).startswith(f"spec.model.quantization: got {bad!r}; one of auto, fp8,")
    assert "w4a16-g128" in str(err) and str(err).endswith("gguf-q6_k")


@pytest.mark.parametrize(("name", "vllm"), [
    ("fp8", "fp8"), ("fp8-block128", "fp8"),
    ("w8a8-fp8", "compressed-tensors"), ("w8a8-fp8-channel", "compressed-tensors"),
    ("w8a8-int8", "compressed-tensors"), ("w4a16-g32", "compressed-tensors"),
    ("w4a16-g128", "compressed-tensors"), ("w8a16-g64", "compressed-tensors"),
    ("gptq-int4", "gptq"), ("gptq-int8", "gptq"), ("awq", "awq"),
    ("gguf-q8_0", "gguf"), ("gguf-q4_k", "gguf"), ("gguf-q6_k", "gguf"),
])
def test_the_pod_gets_vllms_value(name, vllm):
    args = ea.engine_args(spec(name, extraArgs=["--seed", "3"]))
    assert quantization_flag(args) == vllm
    assert args.count("--quantization") == 1
    assert args[-2:] == ["--seed", "3"]  # extraArgs still come last
    # and the engine's own check accepts the command line the operator wrote
    check.split_vllm_flags(args)


def test_auto_writes_no_flag():
    assert quantization_flag(ea.engine_args(spec())) is None
    assert quantization_flag(ea.engine_args(spec("auto"))) is None


def test_every_value_the_operator_writes_is_one_the_engine_takes():
    assert set(VLLM_QUANTIZATIONS) <= set(serve_flags.QUANTIZATIONS)


def test_the_pod_template_changes_with_the_field():
    """A new value is a new command line, so the Deployment rolls the pods."""
    assert ea.engine_args(spec("awq")) != ea.engine_args(spec("gptq-int4"))
    assert ea.engine_args(spec("w4a16-g32")) == ea.engine_args(spec("w4a16-g128"))


def test_a_bad_value_fails_its_object_only():
    """At reconcile: the object with a bad value gets Ready=False InvalidSpec naming the
    field, its value and the formats, and no children; the next object is served."""
    events: list[tuple[str, str]] = []
    ctx = OperatorContext(api=FakeKubeApi(), options=OperatorOptions(engine_image="e:1"),
                          metrics=OperatorMetrics(), clock=Clock(),
                          post_event=lambda body, type_, reason, message: events.append(
                              (type_, reason)))
    bad = inference("bad", spec={"model": {**EMBEDDED, "quantization": "int3"}})
    good = inference("good", spec={"model": {**EMBEDDED, "quantization": "gptq-int4"}})
    for body in (bad, good):
        ctx.api.put(body)
    with pytest.raises(kopf.PermanentError, match=r"spec\.model\.quantization: got 'int3'") as info:
        run_reconcile(ctx, bad)
    ready = info.value.status["conditions"][0]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "InvalidSpec")
    assert "one of auto, fp8, fp8-block128" in ready["message"]
    assert events == [("Warning", "InvalidSpec")]
    assert ctx.api.writes() == []
    run_reconcile(ctx, good)
    deployment = ctx.api.stored("Deployment", "llm", "good")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert quantization_flag(container["args"]) == "gptq"
    assert ("Deployment", "llm", "bad") not in ctx.api.objects
