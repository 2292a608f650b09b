"""The benchmark's configuration: one frozen, validated dataclass.

The CLI (``kvpilot bench serve``) builds it from its flags and Python scripts build it
directly; both get the same checks and the same error messages, which name the field, its
flag, the value received and what is allowed. Lengths are in tokens (input lengths are
approximate, see ``text.py``), times in seconds, rates in requests per second.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

DATASETS = ("random", "shared-prefix", "multi-turn")


@dataclass(frozen=True)
class BenchConfig:
    """Everything one benchmark run needs. Not mutated after construction.

    Raises ``ValueError`` from ``__post_init__`` on a bad value.
    """

    # -- target server
    base_url: str = "http://127.0.0.1:8000"  # a trailing "/" or "/v1" is dropped
    model: str | None = None  # None: the first id of GET /v1/models
    api_key: str | None = None  # sent as "Authorization: Bearer <key>"
    metrics_url: str | None = None  # None: <base_url>/metrics
    # -- dataset
    dataset: str = "random"
    num_prompts: int = 100  # random and shared-prefix
    seed: int = 0
    output_len: int = 128  # max_tokens (= min_tokens with ignore_eos) of every request
    random_input_len: int = 1024
    random_range_ratio: float = 0.0  # lengths drawn uniformly in [L*(1-r), L*(1+r)]
    num_groups: int = 4  # shared-prefix: groups of requests sharing one prefix
    shared_prefix_len: int = 1024
    question_len: int = 64  # shared-prefix: each request's own suffix
    num_sessions: int = 8  # multi-turn conversations
    num_turns: int = 5  # user turns per conversation
    turn_input_len: int = 64  # tokens of each new user message
    system_prompt_len: int = 512
    num_system_prompts: int = 1  # session i uses system prompt i % num_system_prompts
    think_time_s: float = 0.0  # pause between a reply and the session's next turn
    # -- load shape
    request_rate: float = math.inf  # Poisson arrivals of requests (sessions for multi-turn)
    max_concurrency: int | None = None  # in-flight limit for the dataset's requests
    background_streams: int = 0  # closed-loop decode streams running under the dataset
    background_input_len: int = 32
    background_output_len: int = 1024
    # -- requests
    ignore_eos: bool = True  # send ignore_eos + min_tokens so every system does equal work
    temperature: float = 0.0
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every request
    # -- run and report
    timeout_s: float = 3600.0  # whole-run bound; unfinished requests count as failed
    request_timeout_s: float | None = None  # per request; None: bounded by timeout_s only
    percentiles: tuple[float, ...] = (50.0, 99.0)
    label: str | None = None  # free text stored with the result (e.g. "caching=on")
    # The share of requests that may fail (or go unsent) with `kvpilot bench serve` still
    # exiting 0 (``failures.py``); the run itself does not read it.
    max_failed_ratio: float = 0.0

    def __post_init__(self) -> None:
        base = self.base_url.strip().rstrip("/")
        if base.endswith("/v1"):
            base = base[: -len("/v1")]
        if not base.startswith(("http://", "https://")):
            _fail("base_url", self.base_url, "an http:// or https:// URL")
        object.__setattr__(self, "base_url", base)
        if self.dataset not in DATASETS:
            _fail("dataset", self.dataset, f"one of {', '.join(DATASETS)}")
        for name in ("num_prompts", "output_len", "random_input_len", "num_groups",
                     "num_sessions", "num_turns", "turn_input_len", "num_system_prompts",
                     "background_input_len", "background_output_len"):
            _check_int(self, name, minimum=1)
        for name in ("shared_prefix_len", "question_len", "system_prompt_len",
                     "background_streams"):
            _check_int(self, name, minimum=0)
        if self.max_concurrency is not None:
            _check_int(self, "max_concurrency", minimum=1)
        if not 0.0 <= self.random_range_ratio < 1.0:
            _fail("random_range_ratio", self.random_range_ratio, "a number in [0, 1)")
        if math.isnan(self.request_rate) or self.request_rate <= 0:
            _fail("request_rate", self.request_rate, "a number > 0, or inf for all at once")
        if not (self.think_time_s >= 0 and math.isfinite(self.think_time_s)):
            _fail("think_time_s", self.think_time_s, "a finite number of seconds >= 0")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            _fail("timeout_s", self.timeout_s, "a finite number of seconds > 0")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            _fail("request_timeout_s", self.request_timeout_s, "a number of seconds > 0")
        if isinstance(self.max_failed_ratio, bool) or not (
                isinstance(self.max_failed_ratio, (int, float))
                and 0.0 <= self.max_failed_ratio <= 1.0):
            _fail("max_failed_ratio", self.max_failed_ratio, "a number in [0, 1]")
        if not self.temperature >= 0:
            _fail("temperature", self.temperature, "a number >= 0")
        if not isinstance(self.extra_body, dict):
            _fail("extra_body", self.extra_body, "a JSON object (dict)")
        pcts = tuple(float(p) for p in self.percentiles)
        if not pcts or any(not 0 <= p <= 100 for p in pcts):
            _fail("percentiles", self.percentiles, "one or more numbers in [0, 100]")
        object.__setattr__(self, "percentiles", pcts)

    @property
    def num_requests(self) -> int:
        """How many dataset requests the run plans to send (background streams excluded)."""
        if self.dataset == "multi-turn":
            return self.num_sessions * self.num_turns
        return self.num_prompts

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready copy, with the API key masked and inf written as the string "inf"."""
        out = asdict(self)
        if out["api_key"] is not None:
            out["api_key"] = "***"
        if math.isinf(out["request_rate"]):
            out["request_rate"] = "inf"
        out["percentiles"] = list(out["percentiles"])
        return out


def flag(name: str) -> str:
    """The CLI flag of a config field (``think_time_s`` -> ``--think-time``)."""
    base = name[: -len("_s")] if name.endswith("_s") else name
    return "--" + base.replace("_", "-")


def _fail(name: str, value: object, allowed: str) -> None:
    raise ValueError(f"{name} ({flag(name)}) must be {allowed}, got {value!r}")


def _check_int(config: BenchConfig, name: str, minimum: int) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(name, value, f"an integer >= {minimum}")
