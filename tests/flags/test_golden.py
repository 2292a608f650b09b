"""Golden command lines for ``kvpilot serve`` and the operator's ``engine.extraArgs``
check: today's accepted and refused command lines, pinned so that moving the flags to one
table keeps every parse and every message.

Each case of :data:`CASES` runs through the public entry points: ``kvpilot serve ARGV``
(:func:`kvpilot.cli.main`, with the server's ``run`` replaced) and :func:`parse_spec`
with ``engine.extraArgs = ARGV``. ``golden/cmdlines.json`` holds, per case: for serve,
the fields that differ from a bare ``kvpilot serve`` and the vLLM no-ops it logs, or the
exit status and the error line; for the operator, ``ok`` or the SpecError's message.
The help texts of ``kvpilot serve`` and ``kvpilot generate`` and the docs table of vLLM
flags are pinned byte for byte in ``golden/``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from kvpilot import cli

GOLDEN = Path(__file__).parent / "golden"

CASES: list[list[str]] = [
    # kvpilot's own flags, both spellings of a value, booleans and their --no- forms
    [],
    ["--model", "m", "--port", "9000"],
    ["--port=9000", "--host=0.0.0.0"],
    ["--seed", "-1"],
    ["--served-model-name", "qwen", "--seed", "-1", "--port=8000", "--enable-prefix-caching",
     "--no-kv-cache-key-rotation"],
    ["--no-enable-prefix-caching", "--disable-sliding-window"],
    ["--no-disable-sliding-window", "--calculate-kv-scales", "--skip-tokenizer-init"],
    ["--kv-events-config", '{"enable_kv_cache_events": false}'],
    ["--kv-events-config", "notjson"],
    ["--kv-cache-skip-layers", "0,29", "--kv-cache-dtype", "fp8"],
    ["--kv-cache-skip-layers", "0,x"],
    ["--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
    ["--dtype", "bfloat16", "--device", "cpu", "--load-format", "dummy", "--attention-backend", "torch"],
    ["--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--max-model-len", "1024",
     "--block-size", "32", "--gpu-memory-utilization", "0.5", "--num-gpu-blocks-override", "100",
     "--kv-cache-memory", "0.25", "--drain-timeout", "3", "--max-request-body-bytes", "10",
     "--log-level", "debug", "--tokenizer", "/t", "--chat-template", "{{x}}"],
    ["-tp", "2"], ["-tp=2"], ["--tensor-parallel-size", "2"], ["--tensor-parallel-size=1"],
    ["--api-key=-abc"], ["--api-key", "-abc"], ["--api-key", "k"],
    # argparse's own errors on kvpilot's flags
    ["--port", "abc"], ["--dtype", "fp9"], ["--port"], ["--model", "--port", "1"],
    ["--enable-prefix-caching=true"], ["--calculate-kv-scales=1"], ["--log-level", "loud"],
    # repeated flags
    ["--port", "1", "--port", "2"], ["--enforce-eager", "--enforce-eager"],
    ["--swap-space", "4", "--swap-space=8"], ["--foo", "--foo"],
    ["--enable-prefix-caching", "--no-enable-prefix-caching"],
    # the positional model
    ["Qwen/Q", "--port", "8000"], ["--port", "8000", "/models/m"],
    ["--port", "8000", "--", "/models/m"], ["--", "/models/m"], ["--", "-h"], ["-"],
    ["--enforce-eager", "m.gguf", "-pp", "1"],
    ["A", "--model", "B"], ["--model=B", "A"], ["A", "B"], ["A", "B", "C"],
    ["--", "A", "B"], ["A", "--", "B"],
    # abbreviations and unknown flags
    ["--por=9001"], ["--po", "9001"], ["--hos=0.0.0.0"], ["--kv-cache-dt=fp8"],
    ["--no-enable-prefix"], ["--max_model_len", "512"], ["--max_num_seqs=4"],
    ["--foo", "bar"], ["--foo=bar"], ["--foo", "--port", "1", "m"], ["--tensor-parallel", "2"],
    ["--enable", "x"], ["-x"], ["-tpx"], ["--enforce"], ["--no-headless"],
    # vLLM no-ops
    ["--enforce-eager"], ["--enable-chunked-prefill"], ["--trust-remote-code"],
    ["--no-trust-remote-code"], ["--disable-log-stats"], ["--disable-log-requests"],
    ["--no-enable-log-requests"], ["--disable-frontend-multiprocessing"],
    ["--swap-space", "4"], ["--swap-space=4"], ["--pipeline-parallel-size", "1"], ["-pp=1"],
    ["--pipeline-parallel-size", "1.0"], ["--tokenizer-mode", "'HF'"],
    ["--distributed-executor-backend", "mp"], ["--max-logprobs", "20"], ["--no-enable-lora"],
    ["--uvicorn-log-level", "info"], ["--no-skip-tokenizer-init"],
    ["--no-disable-custom-all-reduce"], ["--ray-workers-use-nsight"],
    ["--no-enable-expert-parallel"], ["--no-enable-auto-tool-choice"],
    ["--guided-decoding-backend", "xgrammar"],
    ["/models/qwen", "--port", "8001", "--enable-chunked-prefill", "--swap-space=4",
     "--disable-log-stats", "--max-num-seqs", "8"],
    # vLLM flags refused, for every value or for some
    ["-ep"], ["--enable-expert-parallel"], ["--pipeline-parallel-size", "2"], ["-pp", "2"],
    ["--distributed-executor-backend", "ray"], ["--no-enforce-eager"],
    ["--no-enable-chunked-prefill"], ["--enable-log-requests"], ["--enable-lora"],
    ["--quantization", "awq"], ["--quantization=awq"], ["-q", "gptq"],
    ["--speculative-config", '{"method": "ngram"}'], ["--lora-modules", "a=/x", "b=/y"],
    ["--lora-modules", "a=/x", "m"], ["--lora-modules"], ["--lora-modules", "--port", "1"],
    ["--max-logprobs", "-1"], ["--max-logprobs", "-1e5"], ["--uvicorn-log-level", "debug"],
    ["--enforce-eager=true"], ["--trust-remote-code=1"], ["--pipeline-parallel-size"],
    ["--swap-space", "--port", "9000"], ["--swap-space", "--", "m"], ["--quantization"],
    ["--headless"], ["--structured-outputs-config", "{}"], ["--guided-decoding-backend", "outlines"],
    ["Qwen/Qwen2.5-0.5B", "--pipeline-parallel-size", "2", "--enforce-eager", "--foo",
     "--port", "8000", "--quantization=awq", "--no-enable-chunked-prefill"],
    ["--seed", "3", "--enable-lora", "--foo", "x", "-pp", "8"],
    ["A", "B", "--foo", "--model", "C"],
    # errors of both kinds: the vLLM check comes first
    ["--port", "abc", "--enable-lora"], ["--enable-lora", "--port"],
    # help skips the checks
    ["--help"], ["-h"], ["--pipeline-parallel-size", "2", "--help"], ["--foo", "-h"],
    # LoRA adapters (vLLM's flags): both module forms, a repeated flag adds, bad modules
    ["--enable-lora", "--lora-modules", "a=/x", "b=/y"],
    ["--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "base_model_name": "m"}'],
    ["--lora-modules", "a=/x", "--lora-modules", "b=/y"], ["--lora-modules=a=/x"],
    ["--lora-modules", "a"], ["--lora-modules", "=/x"], ["--lora-modules", '{"name": "a"}'],
    ["--lora-modules", '{"name": "a", "path": "/x", "x": 1}'], ["--lora-modules", "{nope"],
    ["--max-loras", "2", "--max-lora-rank", "64", "--max-cpu-loras", "4"], ["--max-lora-rank", "x"],
    ["--enable-lora", "--fully-sharded-loras"], ["--enable-lora=1"],
    # as above with a flag still refused (--enable-lora is a kvpilot flag now)
    ["--seed", "3", "--enable-sleep-mode", "--foo", "x", "-pp", "8"],
    ["--port", "abc", "--enable-sleep-mode"], ["--enable-sleep-mode", "--port"],
]


@pytest.fixture
def serve(monkeypatch: pytest.MonkeyPatch):
    """``kvpilot serve ARGV`` -> its golden result (see the module docstring)."""
    from kvpilot.engine.server import cli as serve_cli

    monkeypatch.delenv("KVPILOT_API_KEY", raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(serve_cli, "run", lambda args: seen.append(args) or 0)

    def parsed(argv: list[str]) -> argparse.Namespace:
        seen.clear()
        assert cli.main(["serve", *argv]) == 0
        return seen[0]

    base = {k: v for k, v in vars(parsed([])).items()}

    def result(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
        capsys.readouterr()
        try:
            ns = parsed(argv)
        except SystemExit as exc:
            out, err = capsys.readouterr()
            lines = err.rstrip("\n").splitlines()
            return {"exit": exc.code, "error": lines[-1] if lines else "",
                    "stdout": "help" if out.startswith("usage:") else out}
        fields = {k: repr(v) for k, v in vars(ns).items()
                  if k != "vllm_noop_flags" and (k not in base or base[k] != v)}
        return {"args": fields, "noops": [str(n) for n in ns.vllm_noop_flags]}

    return result


def operator_result(argv: list[str]) -> str:
    from kvpilot.operator.spec import SpecError, parse_spec

    try:
        parse_spec({"model": {"uri": "embedded://smollm2-135m-instruct"},
                    "engine": {"extraArgs": list(argv)}})
    except SpecError as exc:
        return f"{exc.field}={exc.value!r}: {exc}"
    return "ok"


def expected() -> dict[str, Any]:
    return json.loads((GOLDEN / "cmdlines.json").read_text())


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(a) or "(none)" for a in CASES])
def test_serve_command_lines(argv: list[str], serve, capsys: pytest.CaptureFixture[str]) -> None:
    want = expected()[json.dumps(argv)]
    assert serve(argv, capsys) == want["serve"]


@pytest.mark.parametrize("argv", CASES, ids=[" ".join(a) or "(none)" for a in CASES])
def test_operator_extra_args(argv: list[str]) -> None:
    assert operator_result(argv) == expected()[json.dumps(argv)]["operator"]


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_texts(command: str, monkeypatch: pytest.MonkeyPatch,
                    capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("KVPILOT_API_KEY", raising=False)
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    assert capsys.readouterr().out == (GOLDEN / f"{command}_help.txt").read_text()


def test_docs_table() -> None:
    from kvpilot.flags.docs import markdown

    assert markdown() == (GOLDEN / "vllm_flags.md").read_text()


def test_managed_flags() -> None:
    from kvpilot.operator.spec import MANAGED_FLAGS

    assert sorted(MANAGED_FLAGS) == json.loads((GOLDEN / "managed_flags.json").read_text())
