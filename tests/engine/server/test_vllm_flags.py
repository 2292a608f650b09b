"""vLLM command lines for ``kvpilot serve`` (:mod:`kvpilot.flags`): a ``vllm serve``
command line either works, its no-op flags accepted and logged, or fails with one message
naming every flag kvpilot cannot honour; and docs/server.md lists the same table."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest

from kvpilot import cli
from kvpilot.flags import check, docs
from kvpilot.flags import vllm as vf
from kvpilot.flags.check import NoOp, VLLMFlagError, split_vllm_flags

DOCS = Path(__file__).resolve().parents[3] / "docs" / "server.md"


@pytest.fixture(scope="module")
def known() -> set[str]:
    """The option strings of the real ``kvpilot serve`` parser."""
    from kvpilot.engine.server import cli as serve_cli

    parser = argparse.ArgumentParser(allow_abbrev=False)
    serve_cli.add_arguments(parser)
    return {s for a in parser._actions for s in a.option_strings}


def refused(argv, **kw) -> list[tuple[str, str]]:
    with pytest.raises(VLLMFlagError) as info:
        split_vllm_flags(argv, **kw)
    return [(p.arg, p.reason) for p in info.value.problems]


# ---------------------------------------------------------------- (a) kvpilot's own flags

def test_kvpilot_flags_pass_through_with_their_values():
    """A value that does not start with a dash is never taken for the model, and a
    negative number is a value, not a flag."""
    argv = ["--served-model-name", "qwen", "--seed", "-1", "--port=8000", "--enable-prefix-caching",
            "--no-kv-cache-key-rotation", "--kv-events-config", '{"enable_kv_cache_events": false}']
    assert split_vllm_flags(argv) == (argv, [])


def test_a_kvpilot_flag_wins_over_the_table(known):
    """Nothing in the table shadows a parser flag: argparse handles those."""
    shadowed = sorted(set(vf.TABLE) & set(known))
    assert not shadowed, f"listed in kvpilot.flags.vllm but on the kvpilot serve parser: {shadowed}"


# ---------------------------------------------------------------- (b) no-ops

@pytest.mark.parametrize(("argv", "written"), [
    (["--enforce-eager"], "--enforce-eager"),
    (["--enable-chunked-prefill"], "--enable-chunked-prefill"),
    (["--trust-remote-code"], "--trust-remote-code"),
    (["--no-trust-remote-code"], "--no-trust-remote-code"),
    (["--disable-log-stats"], "--disable-log-stats"),
    (["--disable-log-requests"], "--disable-log-requests"),
    (["--no-enable-log-requests"], "--no-enable-log-requests"),
    (["--disable-frontend-multiprocessing"], "--disable-frontend-multiprocessing"),
    (["--swap-space", "4"], "--swap-space 4"),
    (["--swap-space=4"], "--swap-space=4"),
    (["--pipeline-parallel-size", "1"], "--pipeline-parallel-size 1"),
    (["--distributed-executor-backend", "mp"], "--distributed-executor-backend mp"),
    (["--max-logprobs", "20"], "--max-logprobs 20"),
    (["--uvicorn-log-level", "info"], "--uvicorn-log-level info"),
    (["--no-skip-tokenizer-init"], "--no-skip-tokenizer-init"),
])
def test_no_op_flags_are_removed_and_reported(argv, written):
    out, noops = split_vllm_flags(["--port", "9000", *argv, "--seed", "3"])
    assert out == ["--port", "9000", "--seed", "3"]
    entry = vf.TABLE[written.split()[0].split("=")[0]]
    assert noops == [NoOp(written, entry.noop)]
    assert entry.noop and str(noops[0]) == f"{written} ({entry.noop})"


def test_every_no_op_of_the_table_is_accepted():
    """Each entry's accepted spelling (a value it accepts for value flags) is a no-op."""
    for f in vf.FLAGS:
        if f.noop is None:
            continue
        if f.arity in (vf.Arity.SWITCH, vf.Arity.BOOL):
            flag = f.accepted or f.name if f.category == "by value" else f.name
            argv = [flag]
        else:
            argv = [f.name, f.accepted.split(" or ")[0] if f.accepted else "7"]
        out, noops = split_vllm_flags(argv)
        assert (out, [n.reason for n in noops]) == ([], [f.noop]), argv


# ---------------------------------------------------------------- (c) refused

@pytest.mark.parametrize(("argv", "written", "reason"), [
    (["-ep"], "-ep", "expert parallelism is not supported"),
    (["--pipeline-parallel-size", "2"], "--pipeline-parallel-size 2", "pipeline parallelism"),
    (["--distributed-executor-backend", "ray"], "--distributed-executor-backend ray", "Ray"),
    (["--no-enforce-eager"], "--no-enforce-eager", "CUDA graphs"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill", "always chunks prefills"),
    (["--enable-log-requests"], "--enable-log-requests", "does not log requests"),
    (["--fully-sharded-loras"], "--fully-sharded-loras", "fully sharded LoRA"),
    (["--speculative-config", '{"method": "ngram"}'], '--speculative-config {"method": "ngram"}',
     "speculative decoding"),
    (["--max-logprobs", "-1"], "--max-logprobs -1", "fixed at 20"),
    (["--uvicorn-log-level", "debug"], "--uvicorn-log-level debug", "use that"),
])
def test_flags_kvpilot_cannot_honour_are_refused_with_a_reason(argv, written, reason):
    [(arg, why)] = refused([*argv, "--port", "9000"])
    assert arg == written and reason in why


def test_a_switch_given_a_value_and_a_flag_missing_its_value():
    assert refused(["--enforce-eager=true"]) == [("--enforce-eager=true", "takes no value")]
    assert refused(["--pipeline-parallel-size"]) == [
        ("--pipeline-parallel-size", "needs a value (1 is accepted)")]
    assert refused(["--swap-space", "--port", "9000"]) == [("--swap-space", "needs a value")]


def test_unknown_flags_are_refused_with_a_hint_and_their_value_is_not_the_model():
    assert refused(["--foo", "bar"]) == [("--foo", check.UNKNOWN)]
    [(arg, why)] = refused(["--max_model_len", "512"])
    assert arg == "--max_model_len" and why.endswith("write it --max-model-len")
    [(arg, why)] = refused(["--por=9001"])
    assert arg == "--por=9001" and why.endswith("did you mean --port?")
    [(arg, why)] = refused(["--tensor-parallel", "2"])
    assert "--tensor-parallel-size" in why


def test_every_bad_flag_is_named_in_one_message():
    argv = ["Qwen/Qwen2.5-0.5B", "--pipeline-parallel-size", "2", "--enforce-eager", "--foo",
            "--port", "8000", "--speculative-model=m", "--no-enable-chunked-prefill"]
    with pytest.raises(VLLMFlagError) as info:
        split_vllm_flags(argv)
    msg = str(info.value)
    assert msg.startswith("4 flags cannot be honoured: --pipeline-parallel-size 2 (pipeline parallelism")
    for part in ("--foo (not a kvpilot flag", "--speculative-model=m (speculative",
                 "--no-enable-chunked-prefill (kvpilot always chunks"):
        assert part in msg
    assert "--enforce-eager" not in msg and "--port" not in msg
    one = refused(["--foo"])
    assert len(one) == 1 and str(VLLMFlagError([check.Problem(*one[0])])).startswith("1 flag cannot")


# ---------------------------------------------------------------- the positional model

@pytest.mark.parametrize(("argv", "out"), [
    (["Qwen/Qwen2.5-0.5B", "--port", "8000"], ["--model", "Qwen/Qwen2.5-0.5B", "--port", "8000"]),
    (["--port", "8000", "/models/m"], ["--port", "8000", "--model", "/models/m"]),
    (["--port", "8000", "--", "/models/m"], ["--port", "8000", "--model", "/models/m"]),
    (["--enforce-eager", "m.gguf", "-pp", "1"], ["--model", "m.gguf"]),
])
def test_a_positional_model_becomes_model(argv, out):
    assert split_vllm_flags(argv)[0] == out


def test_the_model_given_both_ways_names_both_values():
    for argv in (["Qwen/A", "--model", "B"], ["--model=B", "Qwen/A"]):
        [(arg, why)] = refused(argv)
        assert arg == "Qwen/A and --model B" and "give it once" in why
    with pytest.raises(VLLMFlagError, match=r"^1 argument cannot be honoured"):
        split_vllm_flags(["A", "--model", "B"])


def test_a_second_positional_argument_is_refused():
    assert refused(["A", "B"]) == [
        ("B", "a second positional argument: only the model may be given without a flag")]


def test_positional_arguments_can_be_refused_outright():
    assert refused(["A", "--seed", "1"], positional_reason="no") == [("A", "no")]


def test_help_skips_the_checks():
    argv = ["--pipeline-parallel-size", "2", "--help"]
    assert split_vllm_flags(argv) == (argv, [])


# ---------------------------------------------------------------- kvpilot serve

def test_serve_refuses_bad_flags_before_anything_loads(monkeypatch, capsys):
    from kvpilot.engine.server import cli as serve_cli

    def run(args):
        raise AssertionError("kvpilot serve ran despite bad flags")

    monkeypatch.setattr(serve_cli, "run", run)
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "Qwen/Qwen2.5-0.5B", "--pipeline-parallel-size", "2", "--enforce-eager",
                  "--foo", "--max-num-seqs", "8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpilot serve: 2 flags cannot be honoured: --pipeline-parallel-size 2 (")
    assert "--foo (not a kvpilot flag, nor a vLLM flag kvpilot knows)" in err


def test_serve_accepts_a_vllm_command_line(monkeypatch):
    from kvpilot.engine.server import cli as serve_cli

    seen: list[argparse.Namespace] = []
    monkeypatch.setattr(serve_cli, "run", lambda args: seen.append(args) or 0)
    assert cli.main(["serve", "/models/qwen", "--port", "8001", "--enable-chunked-prefill",
                     "--swap-space=4", "--disable-log-stats", "--max-num-seqs", "8"]) == 0
    [args] = seen
    assert (args.model, args.port, args.max_num_seqs) == ("/models/qwen", 8001, 8)
    assert [n.arg for n in args.vllm_noop_flags] == [
        "--enable-chunked-prefill", "--swap-space=4", "--disable-log-stats"]


def test_serve_logs_the_no_ops_at_start_up(capsys, caplog):
    """Through the real run(): the no-ops are logged, then a bad --max-num-seqs stops it
    (in EngineArgs, before the model loads)."""
    caplog.set_level(logging.INFO, logger="kvpilot.serve")
    assert cli.main(["serve", "--enforce-eager", "--swap-space", "4", "--max-num-seqs", "0"]) == 2
    assert "--max-num-seqs must be >= 1" in capsys.readouterr().err
    logged = [r.getMessage() for r in caplog.records if r.name == "kvpilot.serve"]
    assert logged == [
        f"vLLM flag --enforce-eager accepted as a no-op: {vf.TABLE['--enforce-eager'].noop}",
        f"vLLM flag --swap-space 4 accepted as a no-op: {vf.TABLE['--swap-space'].noop}",
    ]


def test_serve_help_still_works(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--help", "--pipeline-parallel-size", "2"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--max-num-seqs" in out and "vLLM command lines" in out


# ---------------------------------------------------------------- the table and the docs

def test_the_table_has_every_category():
    cats = {f.category for f in vf.FLAGS}
    assert cats == {"no-op", "refused", "by value"}
    for f in vf.FLAGS:
        assert f.name.startswith("--") and all(a.startswith("-") for a in f.aliases)
        if f.category == "by value":
            assert f.accepted, f.name


def test_docs_list_the_table_as_generated():
    """docs/server.md carries the tables markdown() renders, so the docs and the table
    cannot drift; every option string of the table appears there."""
    text = DOCS.read_text()
    start, end = text.index(docs.BEGIN) + len(docs.BEGIN), text.index(docs.END)
    assert text[start:end] == "\n" + docs.markdown(), (
        "docs/server.md is out of date: run .venv/bin/python -m kvpilot.flags.docs --update docs/server.md")
    section = text[start:end]
    missing = [s for s in vf.TABLE if f"`{s}`" not in section]
    assert not missing, missing


def test_update_docs_rewrites_between_the_markers(tmp_path):
    doc = tmp_path / "server.md"
    doc.write_text(f"intro\n{docs.BEGIN}\nold\n{docs.END}\nrest\n")
    assert docs.update_docs(doc) is True
    assert doc.read_text() == f"intro\n{docs.BEGIN}\n{docs.markdown()}{docs.END}\nrest\n"
    assert docs.update_docs(doc) is False
    (tmp_path / "none.md").write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        docs.update_docs(tmp_path / "none.md")
