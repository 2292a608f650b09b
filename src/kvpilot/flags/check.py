"""vLLM command lines for ``kvpilot serve``: :func:`split_vllm_flags` checks a ``vllm
serve``-style command line with argparse, against kvpilot's own flags
(:mod:`kvpilot.flags.serve`) and the vLLM table (:mod:`kvpilot.flags.vllm`).

The check is an argparse parser made from both tables (:func:`check_parser`): kvpilot's
flags take their values as text (argparse types and choices come after, on the real
parser), each spelling of a vLLM flag has an action that judges its value (a no-op, or a
:class:`Problem` with the reason). argparse splits the command line (``--flag value``,
``--flag=value``, ``nargs`` for a vLLM flag taking several values, ``--`` before
positional arguments); prefix matching is off entirely (``allow_abbrev=False``, and the
single-dash prefixes Python 3.11 still matches: ``-t`` is not ``-tp``). What argparse
leaves over is an unknown flag, its value, or a positional argument (the model, as in
``vllm serve MODEL``). Every problem is collected before one :class:`VLLMFlagError`
names them all, where argparse would stop at the first.

Both ``kvpilot serve`` (:mod:`kvpilot.cli`) and the operator's check of
``engine.extraArgs`` (:mod:`kvpilot.operator.spec`, which must not import the engine)
call it, so a flag one accepts the other accepts too.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from kvpilot.flags import serve
from kvpilot.flags.vllm import FLAGS, TABLE, Arity, VLLMFlag

__all__ = ["MODEL_OPTION", "UNKNOWN", "NoOp", "Problem", "VLLMFlagError", "check_parser",
           "split_vllm_flags"]

# vLLM's numbers, negative ones included ("-1", "-.5", "-1e5"): a value, never a flag.
_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
MODEL_OPTION = "--model"
UNKNOWN = "not a kvpilot flag, nor a vLLM flag kvpilot knows"
_MISSING = object()  # the const of a vLLM flag given without its value
_RECORD = "_kvpilot_flag_record"  # the namespace attribute the check's actions write to


@dataclass(frozen=True)
class NoOp:
    """A vLLM flag accepted and removed from the command line: ``arg`` as written
    (``--pipeline-parallel-size 1``), ``reason`` why it changes nothing here."""

    arg: str
    reason: str

    def __str__(self) -> str:
        return f"{self.arg} ({self.reason})"


@dataclass(frozen=True)
class Problem:
    """An argument that cannot be honoured: ``arg`` as written, ``reason`` why."""

    arg: str
    reason: str
    is_flag: bool = True

    def __str__(self) -> str:
        return f"{self.arg} ({self.reason})"


class VLLMFlagError(ValueError):
    """A command line with arguments kvpilot cannot honour; ``problems`` names each one
    with its reason (all of them, not the first only)."""

    def __init__(self, problems: Sequence[Problem]) -> None:
        self.problems = tuple(problems)
        n = len(self.problems)
        what = "flag" if all(p.is_flag for p in self.problems) else "argument"
        head = f"{n} {what}{'' if n == 1 else 's'} cannot be honoured"
        super().__init__(f"{head}: {', '.join(map(str, self.problems))}")


def _is_flag(token: str) -> bool:
    """Whether argparse reads ``token`` as an option string (``-`` alone and negative
    numbers are values)."""
    return token.startswith("-") and token != "-" and not _NUMBER.match(token)


@dataclass
class _Record:
    """What the check's actions saw in one run of the parser over ``tokens``: indices are
    into ``tokens``."""

    tokens: Sequence[str]
    taken: dict[str, int] = field(default_factory=dict)  # option -> occurrences seen
    used: set[int] = field(default_factory=set)  # tokens that are flags or their values
    removed: set[int] = field(default_factory=set)  # no-op flags and their values
    problems: list[tuple[int, Problem]] = field(default_factory=list)
    noops: list[NoOp] = field(default_factory=list)
    models: list[str] = field(default_factory=list)  # values given with --model

    def take(self, option: str) -> int:
        """The index of the next occurrence of ``option`` (``option`` or ``option=...``):
        argparse hands each occurrence to its action (or leaves it over) in order."""
        n = self.taken.get(option, 0)
        self.taken[option] = n + 1
        hits = [i for i, t in enumerate(self.tokens) if _is_flag(t) and t.partition("=")[0] == option]
        return hits[n]


class _Check(argparse.Action):
    """One option string of the check parser: records the token (and its values) as a
    kvpilot flag, a vLLM no-op or a :class:`Problem` (``entry`` None: a kvpilot flag)."""

    def __init__(self, option_strings: list[str], dest: str, entry: VLLMFlag | None = None,
                 **kw: Any) -> None:
        self.entry = entry
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        rec: _Record = getattr(namespace, _RECORD)
        assert option_string is not None  # options only
        i = rec.take(option_string)
        token = rec.tokens[i]
        inline = "=" in token
        given = [] if values is None or values is _MISSING else \
            [values] if isinstance(values, str) else list(values)
        span = {i} if inline else set(range(i, i + 1 + len(given)))
        rec.used |= span
        if self.entry is None:
            if option_string == MODEL_OPTION and given:
                rec.models.append(given[0])
            return
        entry = self.entry
        if entry.arity in (Arity.SWITCH, Arity.BOOL):
            written = token
            verdict = entry.judge(entry.arity is Arity.SWITCH or not option_string.startswith("--no-")
                                  or option_string == entry.name)
        elif not given:
            rec.problems.append((i, Problem(token, _missing_value(entry))))
            return
        else:
            written = token if inline else " ".join([token, *given])
            verdict = entry.judge(" ".join(given))
        if verdict is None:
            rec.noops.append(NoOp(written, entry.noop or ""))
            rec.removed |= span
        else:
            rec.problems.append((i, Problem(written, verdict)))


class _CheckParser(argparse.ArgumentParser):
    """argparse as the check needs it: errors raised (never an exit), vLLM's negative
    numbers read as values, and no prefix matching at all. Python 3.11's argparse still
    matches single-dash prefixes with ``allow_abbrev=False`` (``-t 2`` would be ``-tp 2``,
    a managed flag the operator must see whole), hence ``_get_option_tuples``."""

    def __init__(self) -> None:
        super().__init__(prog="kvpilot serve", add_help=False, allow_abbrev=False,
                         exit_on_error=False)
        self._negative_number_matcher = _NUMBER

    def _get_option_tuples(self, option_string: str) -> list[Any]:
        return []

    def error(self, message: str) -> NoReturn:
        raise argparse.ArgumentError(None, message)


# How many values each arity takes on the check's parser.
_NARGS: dict[Arity, int | str] = {Arity.SWITCH: 0, Arity.BOOL: 0, Arity.ONE: "?", Arity.MANY: "*"}


def check_parser() -> argparse.ArgumentParser:
    """The check's parser: every kvpilot option string (values as text: one at most, any
    number for a flag taking several, ``--lora-modules``) and every spelling of the vLLM
    table, each with its judging action."""
    p = _CheckParser()
    many = {s for f in serve.FLAGS if f.takes_values for s in f.spellings}
    for option, takes_value in serve.option_strings():
        kvpilot_nargs: int | str = ("*" if option in many else "?") if takes_value else 0
        p.add_argument(option, action=_Check, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                       nargs=kvpilot_nargs)
    for f in FLAGS:
        nargs: int | str = _NARGS[f.arity]
        for s in f.spellings:
            if nargs == "?":
                p.add_argument(s, action=_Check, entry=f, dest=argparse.SUPPRESS,
                               default=argparse.SUPPRESS, nargs=nargs, const=_MISSING)
            else:
                p.add_argument(s, action=_Check, entry=f, dest=argparse.SUPPRESS,
                               default=argparse.SUPPRESS, nargs=nargs)
    return p


_PARSER = check_parser()


def _run(tokens: Sequence[str]) -> tuple[_Record, list[str]]:
    """One parse of ``tokens`` (no ``--`` among them): what the actions recorded and what
    argparse left over (unknown flags, their values, positional arguments)."""
    rec = _Record(tokens)
    ns = argparse.Namespace(**{_RECORD: rec})
    _, extras = _PARSER.parse_known_args(list(tokens), ns)
    return rec, extras


def _parse(tokens: Sequence[str], problems: list[tuple[int, Problem]], offset: int = 0
           ) -> tuple[list[NoOp], list[str], set[int], set[int]]:
    """Parse ``tokens`` to the end, past the errors argparse stops at (a switch given a
    value): ``(no-ops, --model values, indices used by flags, indices removed)``, the
    problems appended to ``problems`` with their index; indices are offset by ``offset``."""
    try:
        rec, extras = _run(tokens)
    except argparse.ArgumentError as exc:
        names = set((exc.argument_name or "").split("/"))
        at = next((j for j, t in enumerate(tokens)
                   if _is_flag(t) and "=" in t and t.partition("=")[0] in names), None)
        if at is None:  # pragma: no cover - argparse raises only for a switch's value here
            raise
        noops, models, used, removed = _parse(tokens[:at], problems, offset)
        if tokens[at].partition("=")[0] in TABLE:
            problems.append((offset + at, Problem(tokens[at], "takes no value")))
        # else a kvpilot switch given a value: kept for argparse to refuse in its own words
        more = _parse(tokens[at + 1:], problems, offset + at + 1)
        return (noops + more[0], models + more[1], used | {offset + at} | more[2],
                removed | more[3])
    known = [s for s, _ in serve.option_strings()]
    for token in extras:
        if not _is_flag(token):
            continue  # a positional argument, or an unknown flag's value: by index below
        name = token.partition("=")[0]
        i = rec.take(name)
        rec.used.add(i)
        rec.problems.append((i, Problem(token, _unknown(name, known))))
        if "=" not in token and i + 1 < len(tokens) and not _is_flag(tokens[i + 1]):
            rec.used.add(i + 1)  # an unknown flag's value, most likely: not the model
    problems += [(offset + i, p) for i, p in rec.problems]
    return (rec.noops, rec.models, {offset + i for i in rec.used},
            {offset + i for i in rec.removed})


def split_vllm_flags(argv: Sequence[str], *, positional_reason: str | None = None
                     ) -> tuple[list[str], list[NoOp]]:
    """Check a ``vllm serve``-style command line against kvpilot's flags and the vLLM table.

    Args:
        argv: the arguments after ``serve``.
        positional_reason: None: the first positional argument is the model, as in
            ``vllm serve MODEL`` (it becomes ``--model MODEL``). Otherwise every positional
            argument is refused with this reason (the operator sets ``--model`` itself).

    Returns:
        ``(argv for the kvpilot serve parser, the accepted no-op flags)``: kvpilot's flags
        stay as written, for argparse to convert and check their values; no-op flags are
        removed with their values (``--flag value``, ``--flag=value``, ``--no-flag``).

    Raises:
        VLLMFlagError: naming every argument that cannot be honoured, each with its
            reason: a flag refused for its value, a flag neither kvpilot nor the table
            knows (the token after it, unless flag-like, is taken for its value and not
            reported), a value given to a vLLM flag that takes none, a missing value, a
            second positional argument, or a model given both positionally and with
            ``--model``. With ``-h``/``--help`` nothing is checked (argparse prints the
            help and exits).
    """
    args = list(argv)
    cut = args.index("--") if "--" in args else len(args)
    head, tail = args[:cut], args[cut + 1:]
    if "-h" in head or "--help" in head:
        return args, []
    problems: list[tuple[int, Problem]] = []
    noops, models, used, removed = _parse(head, problems)
    flagged = [p for _, p in sorted(problems, key=lambda ip: ip[0])]
    head_positionals = [i for i in range(len(head)) if i not in used]
    positionals = [head[i] for i in head_positionals] + tail
    out = [t for i, t in enumerate(head) if i not in removed and i not in head_positionals]
    model_at = len(out) if not head_positionals else \
        sum(1 for i in range(head_positionals[0]) if i not in removed)
    if positional_reason is not None:
        flagged += [Problem(p, positional_reason, is_flag=False) for p in positionals]
    elif positionals:
        model, extra = positionals[0], positionals[1:]
        flagged += [Problem(p, "a second positional argument: only the model may be given "
                            "without a flag", is_flag=False) for p in extra]
        if models:
            shown = " ".join(f"{MODEL_OPTION} {m}" for m in models)
            flagged.append(Problem(f"{model} and {shown}", "the model given both as the "
                                   f"positional argument and with {MODEL_OPTION}: give it once",
                                   is_flag=False))
        else:
            out[model_at:model_at] = [MODEL_OPTION, model]
    if flagged:
        raise VLLMFlagError(flagged)
    return out, noops


def _missing_value(entry: VLLMFlag) -> str:
    if entry.noop is None:  # refused whatever the value
        return entry.refused or ""
    return "needs a value" if entry.refused is None else f"needs a value ({entry.accepted} is accepted)"


def _unknown(name: str, known: Sequence[str]) -> str:
    """The reason an option string is unknown, with a hint when one is at hand."""
    names = [*known, *TABLE]
    if "_" in name and name.replace("_", "-") in names:
        return f"{UNKNOWN}: write it {name.replace('_', '-')}"
    near = sorted(n for n in names if n.startswith(name) and n.startswith("--")) \
        if name.startswith("--") and len(name) > 3 else []
    if 0 < len(near) <= 3:
        return f"{UNKNOWN}; abbreviations are not accepted: did you mean {' or '.join(near)}?"
    return UNKNOWN
