"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpilot.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from kvpilot.engine.structured_output import StructuredOutputsParams


def _check(cond: bool, param: str, value: object, allowed: str) -> None:
    if not cond:
        raise InvalidRequestError(f"{param} must be {allowed}, got {value!r}", param=param)


# Temperatures in (0, MIN_TEMPERATURE) are raised to it (vLLM does the same): dividing
# fp32 logits by a temperature like 1e-40 makes them infinite.
MIN_TEMPERATURE = 0.01
# The smallest repetition penalty: logits are divided or multiplied by it.
MIN_REPETITION_PENALTY = 0.01


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Field names follow vLLM and the OpenAI API.

    Attributes:
        n: completions per prompt (the front end fans out; choice ``i`` uses ``seed + i``).
        max_tokens: output tokens to generate at most; ``None`` = up to ``max_model_len``.
        min_tokens: EOS and ``stop_token_ids`` are masked until this many tokens exist.
        temperature: 0 = greedy (argmax); otherwise logits are divided by it (values
            below ``MIN_TEMPERATURE`` are raised to it).
        top_p: nucleus sampling mass in (0, 1].
        top_k: keep the k most likely tokens; 0 or -1 = off.
        min_p: drop tokens whose probability is below ``min_p`` x the top probability.
        seed: per-request generator seed; the same seed gives the same tokens whatever
            else is in the batch.
        stop: strings that end generation; excluded from the text unless
            ``include_stop_str_in_output``.
        stop_token_ids: token ids that end generation (in addition to EOS).
        ignore_eos: keep generating past EOS (benchmarks use this for fixed lengths).
        presence_penalty, frequency_penalty: OpenAI-style, over output tokens, in [-2, 2].
        repetition_penalty: CTRL/HF-style, over prompt and output tokens, in [0.01, 100]
            (1 = off).
        logprobs: ``None`` = none; k >= 0 = the sampled token's logprob plus the top k.
        skip_special_tokens: drop special tokens from the detokenized text.
        prompt_logprobs: ``None`` = none; k >= 0 = the logprob of every prompt token
            after the first plus the top k alternatives (vLLM's extension). The prompt is
            then computed in full: the prefix cache is not used for it.
        logit_bias: ``(token_id, bias)`` pairs added to the logits before sampling (OpenAI's
            ``logit_bias``; bias in [-100, 100]; -100 bans a token, 100 all but forces it).
        structured_outputs: the output must match this schema, regex, choice list or
            grammar (:mod:`kvpilot.engine.structured_output`).
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None

    MAX_LOGPROBS = 20
    MAX_LOGIT_BIAS = 100.0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(s for s in self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check(1 <= self.n <= 128, "n", self.n, "an integer in [1, 128]")
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", self.max_tokens, "an integer >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "an integer >= 0")
        if self.max_tokens is not None:
            _check(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"<= max_tokens ({self.max_tokens})",
            )
        _check(math.isfinite(self.temperature), "temperature", self.temperature, "a finite number")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0")
        if 0.0 < self.temperature < MIN_TEMPERATURE:  # vLLM's floor: logits / 1e-40 are infinite
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(self.top_k >= -1, "top_k", self.top_k, "-1, 0 (off) or a positive integer")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty, "in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty, "> 0")
        _check(MIN_REPETITION_PENALTY <= self.repetition_penalty <= 100.0, "repetition_penalty",
               self.repetition_penalty, f"in [{MIN_REPETITION_PENALTY}, 100]")
        if self.logprobs is not None:
            _check(
                0 <= self.logprobs <= self.MAX_LOGPROBS,
                "logprobs",
                self.logprobs,
                f"an integer in [0, {self.MAX_LOGPROBS}]",
            )
        if self.prompt_logprobs is not None:
            _check(0 <= self.prompt_logprobs <= self.MAX_LOGPROBS, "prompt_logprobs", self.prompt_logprobs,
                   f"an integer in [0, {self.MAX_LOGPROBS}]")
        for s in self.stop:
            _check(isinstance(s, str) and len(s) > 0, "stop", s, "a non-empty string")
        for t in self.stop_token_ids:
            _check(t >= 0, "stop_token_ids", t, "non-negative token ids")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        for t, b in self.logit_bias:
            _check(t >= 0, "logit_bias", t, "keyed by non-negative token ids")
            _check(math.isfinite(b) and abs(b) <= self.MAX_LOGIT_BIAS, "logit_bias", b,
                   f"a bias in [-{self.MAX_LOGIT_BIAS:g}, {self.MAX_LOGIT_BIAS:g}]")
        if self.structured_outputs is not None and self.ignore_eos:
            raise InvalidRequestError(
                "ignore_eos cannot be combined with structured outputs: a complete output ends with EOS",
                param="ignore_eos")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
