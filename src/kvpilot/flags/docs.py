"""The docs of the serve flags, generated: docs/server.md's "vLLM command lines" tables
(:func:`markdown`, from :mod:`kvpilot.flags.vllm`).

``python -m kvpilot.flags.docs`` prints them; ``--update docs/server.md`` rewrites them
between the markers; ``tests/engine/server/test_vllm_flags.py`` fails when the docs and
the table differ.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from kvpilot.flags.vllm import FLAGS, Arity, VLLMFlag

__all__ = ["BEGIN", "END", "main", "markdown", "update_docs"]


def _doc_name(flag: VLLMFlag, accepted: bool) -> str:
    """How the docs name ``flag`` in the no-op table (``accepted``) or the refused one."""
    on = [flag.name, *flag.aliases]
    off = [f"--no-{flag.name[2:]}"] if flag.arity is Arity.BOOL else []
    if flag.arity is Arity.BOOL and flag.category == "by value":
        names = on if (flag.accepted == flag.name) == accepted else off
    else:
        names = on[:1] + off + on[1:]
    text = " / ".join(f"`{n}`" for n in names)
    if flag.category == "by value" and flag.arity is not Arity.BOOL:
        return f"{text} {flag.accepted}" if accepted else f"{text} other than {flag.accepted}"
    return text


def markdown() -> str:
    """The Markdown of docs/server.md's tables of vLLM flags: one of no-ops, one of flags
    refused (a flag accepted for some values appears in both, with its values)."""
    lines = ["| vLLM flag | a no-op here: |", "|---|---|"]
    lines += [f"| {_doc_name(f, True)} | {f.noop} |" for f in FLAGS if f.noop is not None]
    lines += ["", "| vLLM flag | refused: |", "|---|---|"]
    lines += [f"| {_doc_name(f, False)} | {f.refused} |" for f in FLAGS if f.refused is not None]
    return "\n".join(lines) + "\n"


BEGIN, END = "<!-- vllm-flags: begin (python -m kvpilot.flags.docs --update docs/server.md) -->", \
    "<!-- vllm-flags: end -->"


def update_docs(path: Path) -> bool:
    """Rewrite the tables between the markers in ``path``; True when it changed.
    Raises ValueError when the markers are missing."""
    text = path.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{path}: no {BEGIN!r} ... {END!r} markers")
    new = text[: start + len(BEGIN)] + "\n" + markdown() + text[end:]
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvpilot.flags.docs [--update FILE]``: print the tables, or rewrite them
    in FILE between the markers."""
    p = argparse.ArgumentParser(prog="python -m kvpilot.flags.docs", allow_abbrev=False)
    p.add_argument("--update", type=Path, metavar="FILE")
    ns = p.parse_args(argv)
    if ns.update is None:
        sys.stdout.write(markdown())
    else:
        print(f"{ns.update}: {'updated' if update_docs(ns.update) else 'up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
