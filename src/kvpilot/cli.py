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
}


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
                                         allow_abbrev=False)
        module.add_arguments(parser)
        return int(module.run(parser.parse_args(argv[1:])) or 0)
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
