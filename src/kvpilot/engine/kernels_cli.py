"""``kvpilot build-kernels``: compile the CPU kernels for every ISA level into a folder an
image ships (:func:`kvpilot.kernels.cpu_attention.build_prebuilt`); engine pods then load
them through ``$KVPILOT_CPU_KERNELS_DIR`` without compiling at start-up."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpilot.kernels.cpu_attention import ISA_LEVELS

    names = [level.name for level in ISA_LEVELS]
    parser.add_argument("--out", type=Path, required=True,
                        help="folder for manifest.json and one library per ISA level")
    parser.add_argument("--isa", action="append", choices=names, default=None,
                        help=f"build only these levels (repeatable; default: {', '.join(names)})")


def run(args: argparse.Namespace) -> int:
    from kvpilot.kernels.cpu_attention import ISA_LEVELS, build_prebuilt

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    levels = tuple(lv for lv in ISA_LEVELS if args.isa is None or lv.name in args.isa)
    start = time.monotonic()
    try:
        built = build_prebuilt(args.out, levels)
    except (RuntimeError, OSError) as e:
        print(f"kvpilot build-kernels: {e}", file=sys.stderr)
        return 1
    print(f"kvpilot build-kernels: {', '.join(built)} in {args.out} "
          f"({time.monotonic() - start:.0f} s)")
    return 0
