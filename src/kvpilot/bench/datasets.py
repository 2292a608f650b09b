"""Workloads: what each request sends, built once per run from the config and its seed.

A workload is a list of *units*, one per arrival of the arrival process:

- ``RequestSpec``: one ``/v1/completions`` request with a fixed prompt (datasets
  ``random`` and ``shared-prefix``, and the background decode streams);
- ``SessionSpec``: one agentic conversation on ``/v1/chat/completions`` (dataset
  ``multi-turn``). Its turns are sent one after the other; turn ``t`` carries the system
  prompt, the user messages of turns ``0..t`` and the assistant replies *actually
  received* for turns ``0..t-1``, so the context grows turn by turn and a server with
  prefix caching can reuse everything but the newest message.

Lengths are in tokens, approximate (see ``text.py``); the server's ``usage`` gives the
exact prompt length, which the results record.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from kvpilot.bench.config import BenchConfig
from kvpilot.bench.text import random_text

MAIN = "main"  # request class of the dataset's requests
BACKGROUND = "background"  # request class of the background decode streams


@dataclass(frozen=True)
class RequestSpec:
    """One completions request with a fixed prompt."""

    prompt: str
    target_input_tokens: int  # the length ``prompt`` was generated for (approximate)
    output_len: int  # max_tokens (and min_tokens when ignore_eos is on)
    request_class: str = MAIN
    group: int | None = None  # shared-prefix: index of the shared prefix


@dataclass(frozen=True)
class SessionSpec:
    """One multi-turn chat conversation; ``user_turns[t]`` is the user message of turn t."""

    session_id: int
    system_prompt: str
    user_turns: tuple[str, ...]
    system_prompt_tokens: int  # target lengths (approximate)
    turn_input_tokens: int
    output_len: int  # max_tokens of every turn
    request_class: str = MAIN

    @property
    def num_turns(self) -> int:
        return len(self.user_turns)

    def messages(self, turn: int, replies: Sequence[str]) -> list[dict[str, str]]:
        """The chat messages of turn ``turn`` (0-based).

        ``replies`` are the assistant replies received for turns ``0..turn-1`` (exactly
        ``turn`` of them). Returns a new list; mutates nothing.
        """
        if not 0 <= turn < self.num_turns or len(replies) != turn:
            raise ValueError(f"turn {turn} of {self.num_turns} needs {turn} replies, "
                             f"got {len(replies)}")
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for t in range(turn):
            messages.append({"role": "user", "content": self.user_turns[t]})
            messages.append({"role": "assistant", "content": replies[t]})
        messages.append({"role": "user", "content": self.user_turns[turn]})
        return messages

    def target_input_tokens(self, turn: int) -> int:
        """Approximate prompt length of ``turn``, without chat-template tokens."""
        return (self.system_prompt_tokens + (turn + 1) * self.turn_input_tokens
                + turn * self.output_len)


Unit = RequestSpec | SessionSpec


def build_workload(config: BenchConfig) -> list[Unit]:
    """The dataset's units in arrival order. Deterministic for ``config.seed``."""
    rng = random.Random(config.seed)
    if config.dataset == "random":
        return list(random_requests(config, rng))
    if config.dataset == "shared-prefix":
        return list(shared_prefix_requests(config, rng))
    return list(multi_turn_sessions(config, rng))


def drawn_length(rng: random.Random, length: int, range_ratio: float) -> int:
    """A length drawn uniformly from ``[length*(1-r), length*(1+r)]`` (integers, >= 1)."""
    low = max(1, math.floor(length * (1 - range_ratio)))
    high = max(low, math.ceil(length * (1 + range_ratio)))
    return rng.randint(low, high)


def random_requests(config: BenchConfig, rng: random.Random) -> list[RequestSpec]:
    """``num_prompts`` prompts of random words, input and output lengths drawn around
    ``random_input_len`` and ``output_len`` with ``random_range_ratio``."""
    out = []
    for _ in range(config.num_prompts):
        input_len = drawn_length(rng, config.random_input_len, config.random_range_ratio)
        output_len = drawn_length(rng, config.output_len, config.random_range_ratio)
        out.append(RequestSpec(random_text(rng, input_len), input_len, output_len))
    return out


def shared_prefix_requests(config: BenchConfig, rng: random.Random) -> list[RequestSpec]:
    """``num_prompts`` prompts in ``num_groups`` groups; the prompts of a group share one
    ``shared_prefix_len``-token system prompt and differ in a ``question_len``-token
    question. Groups are assigned round-robin, then the order is shuffled (seeded)."""
    prefixes = [random_text(rng, config.shared_prefix_len) for _ in range(config.num_groups)]
    out = []
    for i in range(config.num_prompts):
        group = i % config.num_groups
        prompt = prefixes[group] + "\n\n" + random_text(rng, config.question_len)
        out.append(RequestSpec(prompt, config.shared_prefix_len + config.question_len,
                               config.output_len, group=group))
    rng.shuffle(out)
    return out


def multi_turn_sessions(config: BenchConfig, rng: random.Random) -> list[SessionSpec]:
    """``num_sessions`` conversations of ``num_turns`` turns; session i uses system prompt
    ``i % num_system_prompts`` (1: all sessions share one, as agents sharing a tool list)."""
    systems = [random_text(rng, config.system_prompt_len)
               for _ in range(config.num_system_prompts)]
    return [
        SessionSpec(
            session_id=i,
            system_prompt=systems[i % config.num_system_prompts],
            user_turns=tuple(random_text(rng, config.turn_input_len)
                             for _ in range(config.num_turns)),
            system_prompt_tokens=config.system_prompt_len,
            turn_input_tokens=config.turn_input_len,
            output_len=config.output_len,
        )
        for i in range(config.num_sessions)
    ]


def background_request(config: BenchConfig, rng: random.Random) -> RequestSpec:
    """One background decode stream: a short prompt and a long output."""
    return RequestSpec(random_text(rng, config.background_input_len),
                       config.background_input_len, config.background_output_len,
                       request_class=BACKGROUND)
