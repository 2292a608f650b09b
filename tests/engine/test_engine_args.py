"""Engine flags resolved as vLLM resolves them: a small --max-num-batched-tokens lowers the
default --max-num-seqs instead of failing; an explicit conflicting pair is refused by name."""

from __future__ import annotations

import argparse

import pytest

from kvpilot.engine.config import DEFAULT_MAX_NUM_SEQS, EngineArgs, LoRAModulePath


def parse(*argv: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def test_default_max_num_seqs_is_256():
    assert parse().max_num_seqs == DEFAULT_MAX_NUM_SEQS == 256
    assert EngineArgs().max_num_seqs == 256


def test_a_small_token_budget_lowers_the_default_max_num_seqs():
    assert parse("--max-num-batched-tokens", "64").max_num_seqs == 64
    assert EngineArgs(max_num_batched_tokens=8).max_num_seqs == 8


def test_an_explicit_max_num_seqs_is_kept():
    assert parse("--max-num-batched-tokens", "64", "--max-num-seqs", "16").max_num_seqs == 16


def test_an_explicit_conflicting_pair_is_refused_naming_both_flags():
    with pytest.raises(ValueError, match=r"--max-num-seqs \(256\) must be <= --max-num-batched-tokens \(64\)"):
        parse("--max-num-batched-tokens", "64", "--max-num-seqs", "256")


def test_calculate_kv_scales_is_off_unless_asked():
    assert parse().calculate_kv_scales is False
    assert parse("--calculate-kv-scales").calculate_kv_scales is True


# ---------------------------------------------------------------- LoRA (vLLM's flags)

def serve_parse(*argv: str) -> EngineArgs:
    """EngineArgs from ``kvpilot serve``'s parser (the LoRA flags are serve's only)."""
    from kvpilot.engine.server import cli as serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.add_arguments(parser)
    return EngineArgs.from_cli_args(parser.parse_args(list(argv)))


def test_lora_is_off_by_default_with_vllms_defaults():
    args = serve_parse()
    assert (args.enable_lora, args.lora_modules, args.max_loras, args.max_lora_rank, args.max_cpu_loras) == (
        False, (), 1, 16, None)
    assert EngineArgs().lora_modules == ()


def test_lora_flags_parse_both_module_forms_and_resolve_max_cpu_loras():
    args = serve_parse("--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
                       "--lora-modules", "sql=/adapters/sql",
                       '{"name": "chat", "path": "/adapters/chat", "base_model_name": "base"}',
                       "--lora-modules", "x=/adapters/x")
    assert args.enable_lora and (args.max_loras, args.max_lora_rank) == (2, 64)
    assert args.max_cpu_loras == 2  # vLLM's default: --max-loras
    assert args.lora_modules == (LoRAModulePath("sql", "/adapters/sql"),
                                 LoRAModulePath("chat", "/adapters/chat", "base"),
                                 LoRAModulePath("x", "/adapters/x"))
    assert serve_parse("--enable-lora", "--max-loras", "2", "--max-cpu-loras", "5").max_cpu_loras == 5


def test_lora_modules_given_as_strings_or_dicts_are_parsed():
    args = EngineArgs(enable_lora=True, lora_modules=["a=/x", {"name": "b", "path": "/y"}])  # type: ignore[list-item]
    assert args.lora_modules == (LoRAModulePath("a", "/x"), LoRAModulePath("b", "/y"))


@pytest.mark.parametrize(("kw", "message"), [
    ({"lora_modules": (LoRAModulePath("a", "/x"),)}, "--lora-modules needs --enable-lora"),
    ({"max_loras": 2}, "--max-loras needs --enable-lora"),
    ({"max_lora_rank": 32, "max_cpu_loras": 4}, "--max-lora-rank, --max-cpu-loras need --enable-lora"),
    ({"enable_lora": True, "max_lora_rank": 7},
     "--max-lora-rank must be one of 1, 8, 16, 32, 64, 128, 256, 320, 512; got 7"),
    ({"enable_lora": True, "max_loras": 0}, "--max-loras must be a whole number >= 1; got 0"),
    ({"enable_lora": True, "max_loras": 3, "max_cpu_loras": 2}, r"--max-cpu-loras \(2\) must be >= --max-loras \(3\)"),
    ({"enable_lora": True, "lora_modules": ("a=/x", "b=/y", "a=/z")},
     "--lora-modules: the name 'a' given more than once"),
    ({"enable_lora": True, "lora_modules": ("nopath",)}, "--lora-modules: 'nopath' is neither name=path"),
])
def test_lora_settings_are_refused_by_flag_name(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kw)


def test_lora_flags_without_enable_lora_stop_serve_before_the_model_loads(capsys):
    from kvpilot import cli

    assert cli.main(["serve", "--lora-modules", "sql=/adapters/sql"]) == 2
    assert "kvpilot serve: --lora-modules needs --enable-lora" in capsys.readouterr().err


def test_a_bad_lora_module_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        serve_parse("--enable-lora", "--lora-modules", '{"name": "a", "path": "/x", "r": 8}')
    assert "argument --lora-modules: " in capsys.readouterr().err
