"""OpenAI API request and response bodies (pydantic), plus the vLLM extensions that
users of an OpenAI-compatible engine expect (``top_k``, ``min_p``, ``ignore_eos``,
``cache_salt``, ...). Unknown fields are ignored, as OpenAI-compatible servers do.

Ranges are checked here, so a bad value is a 400 naming the field before anything is
queued; :class:`SamplingParams` checks the same ranges again for the offline API.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvpilot.engine.sampling_params import SamplingParams

NonNegFloat = Annotated[float, Field(ge=0.0)]


class StreamOptions(BaseModel):
    include_usage: bool = False


MAX_STOP_STRINGS = 16


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions. Floats must be finite (NaN and
    infinity are refused by name, not compared with a bound)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extensions
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stop

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def to_sampling_params(self, max_tokens: int, logprobs: int | None, default_temperature: float = 1.0) -> SamplingParams:
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,  # more than max_tokens is refused (400), not clamped
            temperature=default_temperature if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=self.stop_list(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]


# ----------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvpilot"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(message: str, err_type: str, code: int | str | None, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error body."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
