"""``kvpilot bench``: the group of benchmark subcommands (today: ``serve``).

Registered in ``kvpilot.cli.COMMANDS``; provides ``add_arguments(parser)`` and
``run(args) -> int`` like every component's ``cli.py``.

``kvpilot bench serve``: flags -> ``BenchConfig`` -> run -> report and JSON. Exit status:
0 when every request completed (or the share that failed or went unsent is at most
``--max-failed-ratio``, default 0, and at least one completed); 1 otherwise, or when the
run could not start (the reason, with the failure count and first error, on stderr; the
report and ``--result-json`` are written either way); 2 on a bad flag value (argparse's
convention).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpilot.bench.client import BenchError
from kvpilot.bench.config import DATASETS, BenchConfig
from kvpilot.bench.failures import count_failures
from kvpilot.bench.report import format_report
from kvpilot.bench.runner import run_benchmark

DESCRIPTION = (
    "Load generator for any OpenAI-compatible server (kvpilot, vLLM, SGLang): streams "
    "requests with fixed output lengths and reports req/s, tok/s, TTFT/TPOT/ITL/E2E "
    "and the prefix-cache hit rate (from /metrics counter deltas). Lengths are in tokens; "
    "input lengths are approximate (the JSON records the server's exact counts)."
)
D = BenchConfig()  # defaults shown in --help


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows "(default: X)" except where the default is None (the help says what then)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, (dict, Path)):
            return action.help
        return super()._get_help_string(action)


def json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def percentile_list(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated percentiles such as ``50,90,99``."""
    try:
        return tuple(float(p) for p in text.split(",") if p.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated numbers such as 50,99, got {text!r}") from e


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``kvpilot bench serve``; their defaults are ``BenchConfig``'s."""
    parser.description = DESCRIPTION
    parser.formatter_class = _HelpFormatter
    g = parser.add_argument_group("server")
    g.add_argument("--base-url", default=D.base_url,
                   help="server root; requests go to <base-url>/v1/...")
    g.add_argument("--model", default=None,
                   help="model name to request (default: the first id of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--metrics-url", default=None,
                   help="Prometheus endpoint for the hit rate (default: <base-url>/metrics)")

    g = parser.add_argument_group("dataset")
    g.add_argument("--dataset", default=D.dataset, choices=DATASETS,
                   help="random: independent prompts on /v1/completions; shared-prefix: "
                        "groups of prompts sharing a system prompt; multi-turn: chat "
                        "sessions whose history (with the received replies) grows per turn")
    g.add_argument("--num-prompts", type=int, default=D.num_prompts,
                   help="requests to send (random, shared-prefix)")
    g.add_argument("--seed", type=int, default=D.seed, help="seeds prompts and arrivals")
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                   default=D.output_len, help="output tokens of every request (all datasets)")
    g.add_argument("--random-input-len", type=int, default=D.random_input_len,
                   help="random: prompt tokens")
    g.add_argument("--random-range-ratio", type=float, default=D.random_range_ratio,
                   help="random: draw input and output lengths uniformly in "
                        "[L*(1-r), L*(1+r)], 0 <= r < 1")
    g.add_argument("--num-groups", type=int, default=D.num_groups,
                   help="shared-prefix: groups of prompts sharing one prefix")
    g.add_argument("--shared-prefix-len", type=int, default=D.shared_prefix_len,
                   help="shared-prefix: tokens of each group's shared system prompt")
    g.add_argument("--question-len", type=int, default=D.question_len,
                   help="shared-prefix: tokens of each prompt's own question")
    g.add_argument("--num-sessions", type=int, default=D.num_sessions,
                   help="multi-turn: conversations")
    g.add_argument("--num-turns", type=int, default=D.num_turns,
                   help="multi-turn: user turns per conversation (requests = sessions x turns)")
    g.add_argument("--turn-input-len", type=int, default=D.turn_input_len,
                   help="multi-turn: tokens of each new user message")
    g.add_argument("--system-prompt-len", type=int, default=D.system_prompt_len,
                   help="multi-turn: tokens of the system prompt")
    g.add_argument("--num-system-prompts", type=int, default=D.num_system_prompts,
                   help="multi-turn: distinct system prompts (session i uses i %% N; "
                        "1 = all sessions share one)")
    g.add_argument("--think-time", dest="think_time_s", type=float, default=D.think_time_s,
                   metavar="SECONDS",
                   help="multi-turn: seconds between a reply and the session's next turn")

    g = parser.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=D.request_rate,
                   help="Poisson arrivals per second of requests (multi-turn: of sessions); "
                        "inf sends all at once")
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="most dataset requests in flight (default: unlimited)")
    g.add_argument("--background-streams", type=int, default=D.background_streams,
                   help="decode streams (short prompt, long output) kept running while the "
                        "dataset's requests arrive; reported as class 'background'")
    g.add_argument("--background-input-len", type=int, default=D.background_input_len,
                   help="prompt tokens of each background stream")
    g.add_argument("--background-output-len", type=int, default=D.background_output_len,
                   help="output tokens of each background stream (make it outlast the run; "
                        "a finished stream is replaced at once)")

    g = parser.add_argument_group("requests and results")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=D.ignore_eos,
                   help="send ignore_eos and min_tokens = max_tokens (fixed output lengths)")
    g.add_argument("--temperature", type=float, default=D.temperature,
                   help="sampling temperature (the work done does not depend on it)")
    g.add_argument("--extra-body", type=json_object, default={},
                   help="JSON object merged into every request body")
    g.add_argument("--timeout", dest="timeout_s", type=float, default=D.timeout_s,
                   metavar="SECONDS",
                   help="seconds for the whole run; unfinished requests count as failed")
    g.add_argument("--request-timeout", dest="request_timeout_s", type=float, default=None,
                   metavar="SECONDS",
                   help="seconds per request (default: bounded by --timeout only)")
    g.add_argument("--percentiles", type=percentile_list, default="50,99",
                   help="latency percentiles to report, comma-separated")
    g.add_argument("--max-failed-ratio", type=float, default=D.max_failed_ratio,
                   metavar="FRACTION",
                   help="exit 0 even though this share (0..1) of the requests failed or "
                        "was not sent; by default any failed request makes the exit status 1")
    g.add_argument("--label", default=None, help="free text stored with the result")
    g.add_argument("--result-json", type=Path, default=None,
                   help="write config, summaries and per-request records here")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The ``BenchConfig`` of parsed flags; raises ``ValueError`` on a bad value."""
    names = BenchConfig.__dataclass_fields__
    return BenchConfig(**{k: v for k, v in vars(args).items() if k in names})


def run_serve(args: argparse.Namespace) -> int:
    """``kvpilot bench serve``: run the benchmark; print the report; write ``--result-json``. Returns the exit code."""
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"kvpilot bench serve: error: {e}", file=sys.stderr)
        return 2
    try:
        result = run_benchmark(config)
    except BenchError as e:
        print(f"kvpilot bench serve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvpilot bench serve: interrupted", file=sys.stderr)
        return 130
    print(format_report(result))
    data = result.to_json()
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(data, indent=2) + "\n")
        print(f"results written to {args.result_json}")
    failures = count_failures(data)
    if not result.summary.get("requests_completed"):
        print(f"kvpilot bench serve: error: no request completed: {failures.describe()}",
              file=sys.stderr)
        return 1
    if failures.exceeds(config.max_failed_ratio):
        print(f"kvpilot bench serve: error: {failures.describe()} (--max-failed-ratio "
              f"{config.max_failed_ratio:g} allows {100 * config.max_failed_ratio:g}%)",
              file=sys.stderr)
        return 1
    return 0


SUBCOMMANDS: dict[str, tuple[Callable[[argparse.ArgumentParser], None],
                             Callable[[argparse.Namespace], int], str]] = {
    "serve": (add_serve_arguments, run_serve, "load-test an OpenAI-compatible server"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``kvpilot bench`` subcommands, each with its flags."""
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH_COMMAND")
    sub.required = True
    for name, (add, _, help_text) in SUBCOMMANDS.items():
        add(sub.add_parser(name, help=help_text, description=help_text))


def run(args: argparse.Namespace) -> int:
    _, run_command, _ = SUBCOMMANDS[args.bench_command]
    return run_command(args)


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpilot.bench.cli serve ...`` (same as ``kvpilot bench serve ...``)."""
    parser = argparse.ArgumentParser(prog="kvpilot bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
