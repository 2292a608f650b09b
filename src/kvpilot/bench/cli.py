"""``kvpilot bench``: the group of benchmark subcommands (today: ``serve``).

Registered in ``kvpilot.cli.COMMANDS``; provides ``add_arguments(parser)`` and
``run(args) -> int`` like every subcommand module.
"""

from __future__ import annotations

import argparse

from kvpilot.bench import serve_cli

SUBCOMMANDS = {"serve": (serve_cli, "load-test an OpenAI-compatible server")}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    sub.required = True
    for name, (module, help_text) in SUBCOMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_text, description=help_text))


def run(args: argparse.Namespace) -> int:
    module, _ = SUBCOMMANDS[args.bench_command]
    return module.run(args)
