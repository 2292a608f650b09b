"""The ``kvpilot`` console script: a thin dispatcher, the only command-line module at the
package root.

The convention: each component owns its command line in a ``cli.py`` that provides
``add_arguments(parser)`` (its flags, on the parser the dispatcher made) and
``run(args) -> int`` (the exit status); a component with subcommands of its own (``bench``)
adds subparsers there. Each subcommand's module is imported only when it runs, so
``kvpilot operator`` never imports torch."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (the component's cli module, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvpilot.engine.server.cli", "OpenAI-compatible server (vLLM-compatible flags)"),
    "generate": ("kvpilot.engine.cli", "one-shot offline generation"),
    "bench": ("kvpilot.bench.cli", "benchmarks against a running server: bench serve"),
    "operator": ("kvpilot.operator.cli", "run the Kopf operator for InferenceDeployment resources"),
    "kv-calc": ("kvpilot.sizing.cli", "KV-cache sizing: bytes per token, per request, max concurrency per GPU"),
    "simulate": ("kvpilot.simulation.cli", "fleet autoscaling simulator: compare scaling policies on a trace"),
    "build-kernels": ("kvpilot.engine.kernels_cli", "compile the CPU kernels for every x86-64 ISA level into a folder (what the engine image ships)"),
    "fetch-model": ("kvpilot.fetch.cli", "download a model from s3:// or oci:// into a folder (the engine pod's init container)"),
}


EPILOGS: dict[str, str] = {
    "serve": "vLLM command lines work as they are: 'kvpilot serve MODEL' is 'kvpilot serve --model "
             "MODEL'; vLLM flags that change nothing here (--enable-chunked-prefill, "
             "--pipeline-parallel-size 1, ...) are accepted and logged at start-up; any flag "
             "kvpilot cannot honour fails the command, all of them named in one message. The "
             "list: docs/server.md, 'vLLM command lines'.",
}


def parse_serve_args(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """``kvpilot serve``'s arguments, vLLM's command line included (:mod:`kvpilot.flags.check`):
    a positional model becomes ``--model``; the vLLM no-op flags are removed and kept in
    ``args.vllm_noop_flags`` (a list of :class:`kvpilot.flags.check.NoOp`) for start-up to
    log. Exits with status 2 like argparse (SystemExit), the message on stderr, when any
    flag cannot be honoured or is unknown, naming all of them; argparse's own errors
    (a bad value of a kvpilot flag) follow as before."""
    from kvpilot.flags.check import VLLMFlagError, split_vllm_flags

    try:
        rest, noops = split_vllm_flags(argv)
    except VLLMFlagError as e:
        parser.exit(2, f"{parser.prog}: {e}\n")
    args = parser.parse_args(rest)
    args.vllm_noop_flags = noops
    return args


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvpilot", description="kvpilot: paged-KV LLM engine and Kubernetes operator",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Build only the chosen subcommand's parser when possible (avoids importing torch
    # for the operator); fall back to the full parser for help and errors.
    if argv and argv[0] in COMMANDS:
        module = importlib.import_module(COMMANDS[argv[0]][0])
        # No abbreviations: "--por=9001" in an InferenceDeployment's extraArgs must not
        # silently override the --port the operator manages (it is an unknown flag).
        parser = argparse.ArgumentParser(prog=f"kvpilot {argv[0]}", description=COMMANDS[argv[0]][1],
                                         allow_abbrev=False, epilog=EPILOGS.get(argv[0]))
        module.add_arguments(parser)
        if argv[0] == "serve":
            return int(module.run(parse_serve_args(parser, argv[1:])) or 0)
        return int(module.run(parser.parse_args(argv[1:])) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
