"""``kvpilot generate``: one-shot offline generation from the command line (the engine's
``cli.py``; the server's ``kvpilot serve`` is :mod:`kvpilot.engine.server.cli`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt as a user message with the chat template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    parser.add_argument("--log-level", default="WARNING")
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from kvpilot.engine.llm import LLM  # heavy import (torch) only when running

    try:
        engine_args = EngineArgs.from_cli_args(args)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.sampling_seed,
            stop=tuple(args.stop),
        )
    except ValueError as e:
        print(f"kvpilot generate: {e}", file=sys.stderr)
        return 2
    fields = {k: v for k, v in engine_args.__dict__.items() if k != "model"}
    try:
        llm = LLM(engine_args.model, **fields)
    except (FileNotFoundError, ValueError) as e:  # missing/unsupported model, bad sizes
        print(f"kvpilot generate: {e}", file=sys.stderr)
        return 2
    prompts = args.prompt
    if args.chat:
        prompts = [
            llm.tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in prompts
        ]
    try:
        results = llm.generate(prompts, params)
    except InvalidRequestError as e:
        print(f"kvpilot generate: {e}", file=sys.stderr)
        return 2
    for prompt, res in zip(args.prompt, results):
        out = res.outputs[0]
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason}))
        else:
            print(out.text)
    return 0
