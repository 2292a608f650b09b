"""OpenAI API request and response bodies (pydantic), plus the vLLM extensions that
users of an OpenAI-compatible engine expect (``top_k``, ``min_p``, ``ignore_eos``,
``cache_salt``, structured outputs, tools, ...). A field kvpilot does not implement is
refused with a 400 that names it (``extra="forbid"``): a client that relies on it must
not get an answer that quietly ignored it. docs/server.md lists every accepted field.

Ranges are checked here, so a bad value is a 400 naming the field before anything is
queued; :class:`SamplingParams` checks the same ranges again for the offline API.

The OpenAPI schema (``/openapi.json``) is generated from these models, so it states the
constraints the server enforces: types are strict (``"n": "2"`` or ``"stream": 1`` is a
400, as with OpenAI), and a rule checked elsewhere (the context length, the vocabulary,
an unsupported option) is in the schema where JSON Schema can say it (``maxLength: 0``
for ``suffix``) and in the field's description otherwise. The response models are the
bodies the handlers build, for the schema only (the handlers return plain dicts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    RootModel,
    Tag,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from kvpilot.engine.errors import InvalidRequestError
from kvpilot.engine.sampling_params import MIN_REPETITION_PENALTY, MIN_TEMPERATURE, SamplingParams

NonNegFloat = Annotated[float, Field(ge=0.0)]

MAX_STOP_STRINGS = 16
MAX_N = 128
def _integral(value: Any) -> Any:
    """JSON has one number type: ``2.0`` is the integer 2 (as JSON Schema says), ``2.5``
    is not an integer."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integer request fields: strict (no strings, no booleans), integral floats accepted.
# Bounds go before INTEGRAL inside Annotated (pydantic writes `ge`, not `minimum`, into
# the JSON schema of a bounded Int in a union).
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, INTEGRAL]

# Token ids: the schema cannot know the vocabulary, the server checks it.
TOKEN_ID_SCHEMA: dict[str, Any] = {
    "type": "integer", "minimum": 0,
    "description": "a token id; ids at or above the model's vocabulary size are refused (400)",
}
STOP_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
        {"type": "null"},
    ],
}
PROMPT_SCHEMA: dict[str, Any] = {
    "anyOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}, "minItems": 1},
        {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1},
        {"type": "array", "items": {"type": "array", "items": TOKEN_ID_SCHEMA, "minItems": 1}, "minItems": 1},
    ],
}
SEED_SCHEMA: dict[str, Any] = {
    "anyOf": [{"type": "integer", "minimum": 0, "exclusiveMaximum": 2**63}, {"type": "null"}],
}


def check_stop(stop: str | list[str] | None) -> str | list[str] | None:
    """``stop`` unchanged; raises ValueError (a 400 naming the field) for more than
    MAX_STOP_STRINGS strings or an empty one."""
    stops = [stop] if isinstance(stop, str) else (stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return stop


class StrictModel(BaseModel):
    """Request bodies: JSON types are not coerced (``"2"`` is no integer, ``1`` no
    boolean), floats must be finite, and unknown fields are refused (400 naming them)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(StrictModel):
    include_usage: bool = Field(False, description="end the stream with one chunk carrying `usage` (empty `choices`)")


JsonSchema = Annotated[dict[str, Any] | str, WithJsonSchema({"anyOf": [{"type": "object"}, {"type": "string"}]})]


class StructuredOutputsRequest(StrictModel):
    """vLLM's ``structured_outputs``: exactly one of ``json``, ``json_object``,
    ``regex``, ``choice``, ``grammar``."""

    json_: JsonSchema | None = Field(default=None, alias="json", description="a JSON schema (object, or its JSON text)")
    json_object: bool | None = Field(default=None, description="true: any JSON object")
    regex: str | None = Field(default=None, description="a regular expression the whole output matches")
    choice: list[str] | None = Field(default=None, min_length=1, description="the output is exactly one of these strings")
    grammar: str | None = Field(default=None, description="an EBNF (GBNF) grammar whose start rule is `root`")
    disable_any_whitespace: bool = Field(True, description=(
        "JSON without optional whitespace (the default here; false lets the model put any whitespace "
        "between JSON tokens, as vLLM's default)"))

    model_config = ConfigDict(populate_by_name=True)


class JsonSchemaFormat(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema", description="the JSON schema; absent: any JSON object")
    strict: bool | None = Field(default=None, description=(
        "refuse properties the schema does not list; the output is constrained to the schema either way"))

    model_config = ConfigDict(populate_by_name=True)


class ResponseFormatText(StrictModel):
    type: Literal["text"]


class ResponseFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class ResponseFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


# OpenAI's ``response_format``: the type decides which other field it has.
ResponseFormat = Annotated[ResponseFormatText | ResponseFormatJsonObject | ResponseFormatJsonSchema,
                           Field(discriminator="type")]


GUIDED_BACKENDS = ("auto", "xgrammar")


class SamplingFields(StrictModel):
    """Fields shared by completions and chat completions. Floats must be finite (NaN and
    infinity are refused by name, not compared with a bound)."""

    model: str | None = Field(default=None, description=(
        "the served model name, or a LoRA adapter's name to run with that adapter (`GET /v1/models` lists "
        "both); any other name is a 404"))
    n: Int = Field(1, ge=1, le=MAX_N, description="choices to generate for each prompt")
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, description=(
        f"0 is greedy; default 1; values in (0, {MIN_TEMPERATURE}) are raised to {MIN_TEMPERATURE}, as vLLM does"))
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="nucleus sampling; default 1 (off)")
    stream: bool = Field(False, description="answer with server-sent events (`text/event-stream`)")
    stream_options: StreamOptions | None = Field(default=None, description="only with `stream: true` (400 otherwise)")
    stop: Annotated[str | list[str] | None, WithJsonSchema(STOP_SCHEMA)] = Field(
        None, description=f"at most {MAX_STOP_STRINGS} non-empty stop strings")
    # The OpenAPI document writes bounds as floats: 2**63 - 1 would read as 2**63, 2**63 is exact.
    seed: Annotated[Annotated[int, Field(ge=0, le=2**63 - 1), INTEGRAL] | None, WithJsonSchema(SEED_SCHEMA)] = (
        Field(default=None, description="choice k of n uses seed + k"))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = Field(default=None, description="accepted and ignored")
    # vLLM extensions
    top_k: Int = Field(0, ge=-1, description="keep the k most likely tokens; 0 or -1 is off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    # Logits are divided by it (fp32): a tiny penalty made them infinite (found by schemathesis).
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=100.0, description="1 is off; above 1 discourages repeats")
    min_tokens: Int = Field(0, ge=0, description=(
        "EOS and `stop_token_ids` are ignored until this many tokens exist; more than `max_tokens` "
        "(or than the context leaves) is refused (400)"))
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0), INTEGRAL]] | None = Field(default=None, description=(
        "token ids that end a choice; ids at or above the vocabulary size are refused (400)"))
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=(
        "requests with different salts never share prefix-cache entries"))
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(default=None, description=(
        "token id (as a string) -> bias added to its logit, in [-100, 100]; ids outside the vocabulary are "
        "refused (400)"))
    response_format: ResponseFormat | None = Field(default=None, description=(
        "`json_object` or `json_schema`: the output is constrained to match (xgrammar)"))
    structured_outputs: StructuredOutputsRequest | None = Field(default=None, description="vLLM's structured outputs")
    guided_json: JsonSchema | None = Field(default=None, description="vLLM's older name for structured_outputs.json")
    guided_regex: str | None = Field(default=None, description="vLLM's older name for structured_outputs.regex")
    guided_choice: list[str] | None = Field(default=None, min_length=1, description="vLLM's older name for structured_outputs.choice")
    guided_grammar: str | None = Field(default=None, description="vLLM's older name for structured_outputs.grammar")
    guided_decoding_backend: Literal["auto", "xgrammar"] | None = Field(default=None, description=(
        "only xgrammar (or auto) is available"))
    prompt_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = Field(default=None, description=(
        "log probabilities of every prompt token after the first, and this many alternatives (vLLM's "
        "extension); the prompt is then computed in full (no prefix-cache reuse for it); not with `stream` "
        "(400), as in vLLM"))

    # SGLang's fields, which vllm-router adds to every request it forwards with SGLang's
    # defaults: accepted at those values (nothing to do), any other value refused by name.
    no_stop_trim: Literal[False] = Field(False, description=(
        "sent by vllm-router; only false (stop strings are trimmed; `include_stop_str_in_output: true` "
        "keeps them)"))
    return_hidden_states: Literal[False] = Field(False, description="sent by vllm-router; only false")

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        return check_stop(stop)

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
            logit_bias=self.logit_bias_ids(),
            prompt_logprobs=self.prompt_logprobs,
        )

    def check_prompt_logprobs(self) -> None:
        """Raises InvalidRequestError for ``prompt_logprobs`` on a stream (as vLLM), and
        for ``stream_options`` without ``stream`` (as OpenAI and vLLM)."""
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not available when stream is true (as in vLLM)",
                                      "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true", "stream_options")

    def logit_bias_ids(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with its keys as token ids. Raises InvalidRequestError for a key
        that is not a non-negative integer."""
        out = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise InvalidRequestError(
                    f"logit_bias: keys must be token ids (non-negative integers as strings), got {key!r}", "logit_bias")
            out.append((int(key), bias))
        return tuple(out)


CONTEXT_RULE = ("the prompt's tokens plus `max_tokens` must fit the model's `max_model_len` "
                "(`GET /v1/models`), else 400")


class CompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2},
        {"prompt": ["Once upon a time", "Hello"], "n": 2, "max_tokens": 8, "seed": 7, "stream": True,
         "stream_options": {"include_usage": True}},
    ]})

    prompt: Annotated[str | list[str] | list[Int] | list[list[Int]], WithJsonSchema(PROMPT_SCHEMA)] = Field(
        description=("a text, a batch of texts, token ids, or a batch of token-id lists; each prompt must "
                     f"have at least one token and {CONTEXT_RULE}; prompts x n is at most 256"))
    max_tokens: Annotated[int, Field(ge=0), INTEGRAL] | None = Field(16, description=(
        f"tokens to generate at most; null is the rest of the context; 0 only with `echo`; {CONTEXT_RULE}"))
    echo: bool = Field(False, description="prepend the prompt to each choice's text")
    logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = Field(default=None, description=(
        "log probabilities of the sampled token and this many alternatives; not with `echo` (400)"))
    suffix: Annotated[str | None, WithJsonSchema({"anyOf": [{"type": "string", "maxLength": 0}, {"type": "null"}]})] = (
        Field(default=None, description="not supported: a non-empty suffix is refused (400)"))
    best_of: Annotated[int, Field(ge=1, le=MAX_N), INTEGRAL] | None = Field(default=None, description=(
        "not supported: only null or the value of `n` is accepted (400)"))


class TextPart(StrictModel):
    """A content part; only text parts are supported (any other part is a 400)."""

    type: Annotated[str, WithJsonSchema({"type": "string", "const": "text"})]
    text: Annotated[str | None, WithJsonSchema({"type": "string"})] = None

    model_config = ConfigDict(json_schema_extra={"required": ["type", "text"]})


class ChatMessage(StrictModel):
    """A chat message; other fields (``tool_calls``...) are passed to the chat template."""

    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class FunctionDefinition(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description="a JSON schema of `type: object`")
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8, "stream": True,
         "logprobs": True, "top_logprobs": 2, "stream_options": {"include_usage": True}},
    ]})

    messages: list[ChatMessage] = Field(..., min_length=1, description=(
        "rendered with the model's chat template (one it refuses is a 400); the prompt's tokens "
        "must leave room for at least one output token in `max_model_len`"))
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(
        None, description=f"default: the rest of the context; {CONTEXT_RULE}")
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(
        None, description="the same as `max_tokens`, and wins over it")
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20), INTEGRAL] | None = Field(
        None, description="alternatives per token; needs `logprobs: true` (400)")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    separate_reasoning: Literal[True] = Field(True, description=(
        "sent by vllm-router; only true (with `--reasoning-parser` the reasoning is returned apart, in "
        "`reasoning_content`)"))
    stream_reasoning: Literal[True] = Field(True, description="sent by vllm-router; only true")
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="extra variables for the chat template")
    tools: list[Tool] | None = Field(default=None, max_length=128, description=(
        "functions the model may call; passed to the chat template (every template receives them)"))
    tool_choice: Annotated[Literal["none", "auto", "required"] | NamedToolChoice | None,
                           Field(union_mode="left_to_right")] = Field(default=None, description=(
        "`none`: no calls; `auto` (the default with tools): the model decides, its calls are parsed by "
        "`--tool-call-parser` (needs `--enable-auto-tool-choice`); `required` or a named function: calls "
        "are enforced by constrained decoding, so their arguments always validate"))
    parallel_tool_calls: bool = Field(True, description="false: at most one call (enforced with `required`)")
    include_reasoning: bool = Field(True, description=(
        "with `--reasoning-parser`: return the reasoning as `reasoning_content`; false drops it"))


class TokenizeRequest(StrictModel):
    """Exactly one of ``prompt`` or ``messages``."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
    ]})
    model: str | None = Field(default=None, description=(
        "the served model name or a LoRA adapter's name (the same tokenizer); any other name is a 404"))
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, description="rendered with the chat template, then tokenized")
    add_special_tokens: bool = Field(True, description="for `prompt`")
    add_generation_prompt: bool = Field(True, description="for `messages`")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(StrictModel):
    model: str | None = Field(default=None, description=(
        "the served model name or a LoRA adapter's name (the same tokenizer); any other name is a 404"))
    tokens: list[Annotated[int, Field(ge=0), INTEGRAL, WithJsonSchema(TOKEN_ID_SCHEMA)]]


# ----------------------------------------------------------------- responses
class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


FinishReason = Literal["stop", "length", "abort", "tool_calls"]


class PromptLogprob(BaseModel):
    logprob: float
    rank: int = Field(description="1 is the most likely token")
    decoded_token: str


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = Field(default=None, description="the stop string or token id that ended the choice")
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(default=None, description=(
        "with `prompt_logprobs`: null for the first prompt token, then per token its own and the top entries"))


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionStreamResponse(BaseModel):
    """One event of a completions stream; with ``include_usage`` the last one has empty
    ``choices`` and the ``usage``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments, a JSON object as text")


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="the answer; null when it is only tool calls")
    reasoning_content: str | None = Field(default=None, description="with `--reasoning-parser`: the model's reasoning")
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A call's first delta has its ``id``, ``type`` and ``name`` (and ``arguments: ""``);
    later deltas of the same ``index`` add to its arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = Field(default=None, description="the stop string or token id that ended the choice")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(default=None, description=(
        "with `prompt_logprobs`: the rendered prompt's, as on completions"))


class ChatDelta(BaseModel):
    """``{"role": "assistant", "content": ""}`` opens a choice, ``{"content": ...}`` adds
    text, ``{}`` comes with its ``finish_reason``."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One event of a chat completions stream; with ``include_usage`` the last one has
    empty ``choices`` and the ``usage``."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"]


class ReadyResponse(BaseModel):
    status: Literal["ready"]


class ModelCard(BaseModel):
    """One served model: the base model, or a LoRA adapter on it (`parent` set)."""

    id: str = Field(description="the name requests give as `model`")
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "kvpilot"
    root: str | None = Field(default=None, description="the served model name; for an adapter, its folder")
    parent: str | None = Field(default=None, description=(
        "an adapter's base model (the served model name, or the `base_model_name` it was registered "
        "with); absent on the base model's card"))
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ------------------------------------------------- the Responses API (POST /v1/responses)
# Request bodies: OpenAI's Responses API as vLLM serves it, stateless. Unions are picked by
# a callable discriminator (the item's ``type``, or whether the value is text or a list),
# so a bad value gets the one error of the member it meant, not one per member. Their tags
# are written in brackets: error_handlers._field_path leaves such parts out of ``param``
# (``input.0.content``, not ``input.[items].0.[message].content``).


def _tagged(pick: Callable[[Any], str | None], allowed: str) -> Discriminator:
    """A callable discriminator whose failure names what is ``allowed``."""
    return Discriminator(pick, custom_error_type="invalid_union_member",
                         custom_error_message=f"expected {allowed}")


def _by_type(default: str | None = None) -> Callable[[Any], str | None]:
    """The tag of a value by its ``type`` (``default`` when it has none)."""
    def pick(value: Any) -> str | None:
        kind = value.get("type", default) if isinstance(value, dict) else getattr(value, "type", default)
        return f"[{kind}]" if isinstance(kind, str) else None
    return pick


def _text_or_list(value: Any) -> str | None:
    return "[text]" if isinstance(value, str) else "[list]" if isinstance(value, list) else None


class ResponsesTextPart(StrictModel):
    """A text content part: ``input_text`` (what a client writes) or ``output_text`` (an
    earlier answer sent back). Other parts (images, files, audio, refusals) are a 400."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = Field(default=None, description=(
        "on `output_text` parts sent back: accepted, not used"))
    logprobs: list[dict[str, Any]] | None = Field(default=None, description=(
        "on `output_text` parts sent back: accepted, not used"))


ResponsesContent = Annotated[
    Annotated[str, Tag("[text]")] | Annotated[list[ResponsesTextPart], Tag("[list]")],
    _tagged(_text_or_list, "a string or a list of text parts"),
]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


class ResponsesMessageItem(StrictModel):
    """A message: the user's, the instructions' (``system``, ``developer``) or an earlier
    answer (``assistant``; one with status ``in_progress`` or ``incomplete`` as the last
    item is continued, not answered, as vLLM does)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: ResponsesContent
    id: str | None = Field(default=None, description="accepted, not used")
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = Field(default=None, description=(
        "on an assistant message sent back (the OpenAI SDK's output items carry it): accepted, not used"))


class ResponsesFunctionCallItem(StrictModel):
    """An earlier function call of the model (an output item sent back)."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str = Field(description="the arguments, a JSON object as text")
    id: str | None = Field(default=None, description="accepted, not used")
    status: ItemStatus | None = None
    # Fields of the OpenAI SDK's ResponseFunctionToolCall that a model_dump() of an
    # answer's items carries as null (async_ is the SDK's Python name of `async`).
    async_: Annotated[bool | None, WithJsonSchema({"anyOf": [{"const": False}, {"type": "null"}]})] = Field(
        default=None, validation_alias=AliasChoices("async", "async_"), description=(
            "`async` (the SDK's `model_dump()` writes `async_`): null or false; asynchronous calls are not supported"))
    caller: Annotated[None, WithJsonSchema({"type": "null"})] = Field(default=None, description=(
        "null only (kvpilot's calls are the model's own)"))

    @field_validator("async_")
    @classmethod
    def _not_async(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("only null or false: asynchronous function calls are not supported")
        return value
    namespace: Annotated[None, WithJsonSchema({"type": "null"})] = Field(default=None, description=(
        "null only (tools have no namespaces here)"))


class ResponsesFunctionCallOutputItem(StrictModel):
    """A function call's result, given to the model as a ``tool`` message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: ResponsesContent
    id: str | None = Field(default=None, description="accepted, not used")
    status: ItemStatus | None = None


class ResponsesSummaryText(StrictModel):
    type: Literal["summary_text"]
    text: str


class ResponsesReasoningText(StrictModel):
    type: Literal["reasoning_text"]
    text: str


class ResponsesReasoningItem(StrictModel):
    """Earlier reasoning (an output item sent back): given to the chat template as the
    next assistant message's ``reasoning_content`` (and ``reasoning``), as vLLM does; its
    ``content`` text, else its first summary."""

    type: Literal["reasoning"]
    id: str | None = Field(default=None, description="accepted, not used")
    summary: list[ResponsesSummaryText] = Field(default_factory=list)
    content: list[ResponsesReasoningText] | None = None
    encrypted_content: Annotated[None, WithJsonSchema({"type": "null"})] = Field(default=None, description=(
        "not supported (kvpilot never encrypts reasoning): only null"))
    status: ItemStatus | None = None


ResponsesInputItem = Annotated[
    Annotated[ResponsesMessageItem, Tag("[message]")] | Annotated[ResponsesFunctionCallItem, Tag("[function_call]")] | Annotated[ResponsesFunctionCallOutputItem, Tag("[function_call_output]")] | Annotated[ResponsesReasoningItem, Tag("[reasoning]")],
    _tagged(_by_type("message"), "an item of type message (the default), function_call, function_call_output "
            "or reasoning (item_reference needs stored responses, which kvpilot does not keep)"),
]
ResponsesInput = Annotated[
    Annotated[str, Tag("[text]")] | Annotated[list[ResponsesInputItem], Field(min_length=1), Tag("[list]")],
    _tagged(_text_or_list, "a string (one user message) or a list of input items"),
]


class ResponsesFunctionTool(StrictModel):
    """A function the model may call (the Responses API's flat shape: no ``function``
    wrapper)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(default=None, description=(
        "a JSON schema of `type: object`; absent or null: no arguments"))
    strict: bool | None = Field(default=None, description=(
        "accepted; forced calls (`required`, a named function) follow the schema either way"))


class ResponsesFunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class ResponsesTextFormatText(StrictModel):
    type: Literal["text"]


class ResponsesTextFormatJsonObject(StrictModel):
    type: Literal["json_object"]


class ResponsesTextFormatJsonSchema(StrictModel):
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema", description="the JSON schema the output matches")
    description: str | None = None
    strict: bool | None = Field(default=None, description=(
        "false still constrains to the schema; otherwise properties it does not list are refused too"))

    model_config = ConfigDict(populate_by_name=True)


ResponsesTextFormat = Annotated[
    Annotated[ResponsesTextFormatText, Tag("[text]")] | Annotated[ResponsesTextFormatJsonObject, Tag("[json_object]")] | Annotated[ResponsesTextFormatJsonSchema, Tag("[json_schema]")],
    _tagged(_by_type(), "a format of type text, json_object or json_schema"),
]


class ResponsesTextConfig(StrictModel):
    format: ResponsesTextFormat | None = Field(default=None, description=(
        "`json_object` or `json_schema` (`name`, `schema`, `strict`, `description`): the output is "
        "constrained to match (xgrammar); `text` or absent: free text"))


class ResponsesRequest(StrictModel):
    """``POST /v1/responses``: OpenAI's Responses API, stateless (kvpilot stores nothing),
    with vLLM's extensions (``previous_input_messages``, ``include_reasoning``, the
    sampling fields). Fields it does not implement are refused by name."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"input": "What is 2+2?", "instructions": "Answer briefly.", "max_output_tokens": 16, "temperature": 0},
        {"input": [{"role": "user", "content": "Weather in Paris?"}], "stream": True,
         "tools": [{"type": "function", "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                   "required": ["city"]}}],
         "tool_choice": "required", "max_output_tokens": 40},
    ]})

    model: str | None = Field(default=None, description=(
        "the served model name, or a LoRA adapter's name (`GET /v1/models` lists both); any other name is a 404"))
    input: ResponsesInput = Field(description=(
        "a string (one user message) or a list of items: messages, and earlier `function_call`, "
        "`function_call_output` and `reasoning` items; rendered with the chat template"))
    instructions: str | None = Field(default=None, description="a system message before everything else")
    max_output_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = Field(default=None, description=(
        "default: the rest of the context; the prompt's tokens plus this must fit `max_model_len`, else 400"))
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, description="0 is greedy; default 1")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="nucleus sampling; default 1 (off)")
    tools: list[ResponsesFunctionTool] | None = Field(default=None, max_length=128, description=(
        "functions the model may call (type `function` only); passed to the chat template"))
    tool_choice: Annotated[Literal["none", "auto", "required"] | ResponsesFunctionChoice,
                           Field(union_mode="left_to_right")] | None = Field(default=None, description=(
        "`none`; `auto` (the default with tools: needs `--enable-auto-tool-choice`); `required` or "
        "`{\"type\": \"function\", \"name\"}`: calls enforced by constrained decoding"))
    parallel_tool_calls: bool = Field(True, description="false: at most one call (enforced with `required`)")
    text: ResponsesTextConfig | None = Field(default=None, description="the output's format")
    stream: bool = Field(False, description="answer with server-sent events, one per Responses event type")
    truncation: Literal["disabled"] | None = Field(default=None, description=(
        "`disabled` (OpenAI's default, what the answer says): an input over the context is a 400; "
        "`auto` (dropping the oldest input) is not supported"))
    store: bool = Field(True, description=(
        "accepted, but nothing is stored: the answer says `\"store\": false`"))
    background: Annotated[bool | None, WithJsonSchema({"anyOf": [{"const": False}, {"type": "null"}]})] = Field(
        default=False, description="not supported (needs stored responses): true is a 400")
    previous_response_id: Annotated[str | None, WithJsonSchema({"type": "null"})] = Field(
        default=None, description=(
            "not supported (kvpilot stores no responses): any id is a 400; send the conversation in "
            "`input` or `previous_input_messages`"))
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = Field(
        default=None, max_length=16, description="returned as given, not used")
    user: str | None = Field(default=None, description="accepted, not used")
    include_reasoning: bool = Field(True, description=(
        "with `--reasoning-parser`: return the reasoning as a `reasoning` output item; false drops it"))
    previous_input_messages: list[ChatMessage] | None = Field(default=None, description=(
        "vLLM's: the earlier conversation as chat messages, rendered before `input` (system and developer "
        "messages are left out: `instructions` are this request's); with it an empty `input` string adds "
        "no user message"))
    chat_template_kwargs: dict[str, Any] | None = Field(default=None, description="extra variables for the chat template")
    seed: Annotated[Annotated[int, Field(ge=0, le=2**63 - 1), INTEGRAL] | None, WithJsonSchema(SEED_SCHEMA)] = (
        Field(default=None))
    stop: Annotated[str | list[str] | None, WithJsonSchema(STOP_SCHEMA)] = Field(
        None, description=f"at most {MAX_STOP_STRINGS} non-empty stop strings")
    top_k: Int = Field(0, ge=-1, description="keep the k most likely tokens; 0 or -1 is off")
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, ge=MIN_REPETITION_PENALTY, le=100.0, description="1 is off")
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0), INTEGRAL]] | None = Field(default=None, description=(
        "token ids that end the answer; ids at or above the vocabulary size are refused (400)"))
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(default=None, description=(
        "token id (as a string) -> bias added to its logit, in [-100, 100]"))
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256, description=(
        "requests with different salts never share prefix-cache entries"))

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        return check_stop(stop)


# Response bodies and stream events of the Responses API. Every field is set by the
# handler (none has a default), so the wire carries each one, null included.
class ResponsesOutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any] = Field(description="always empty")
    logprobs: list[Any] = Field(description="always empty (output logprobs are not supported)")


class ResponsesOutputMessage(BaseModel):
    """The answer's text: one ``output_text`` part, none when the model wrote nothing."""

    id: str = Field(description="`msg_` and 32 hex digits")
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[ResponsesOutputText]


class ResponsesOutputReasoning(BaseModel):
    """With ``--reasoning-parser``: the model's reasoning, as ``reasoning_text`` content."""

    id: str = Field(description="`rs_` and 32 hex digits")
    type: Literal["reasoning"]
    summary: list[ResponsesSummaryText] = Field(description="always empty")
    content: list[ResponsesReasoningText]
    status: ItemStatus


class ResponsesOutputFunctionCall(BaseModel):
    """A call the model made; answer it with a ``function_call_output`` item naming
    ``call_id``."""

    id: str = Field(description="`fc_` and 32 hex digits")
    type: Literal["function_call"]
    call_id: str = Field(description="`chatcmpl-tool-` and 32 hex digits (9 characters with `mistral`)")
    name: str
    arguments: str = Field(description="the arguments, a JSON object as text")
    status: ItemStatus


ResponsesOutputItem = Annotated[
    ResponsesOutputMessage | ResponsesOutputReasoning | ResponsesOutputFunctionCall, Field(discriminator="type")]


class ResponsesInputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served from the prefix cache")


class ResponsesOutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="output tokens up to the end of the reasoning (`--reasoning-parser`)")


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponsesInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputTokensDetails
    total_tokens: int


class ResponsesIncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponsesResponse(BaseModel):
    """A response object (vLLM's fields, plus ``store``): the request's settings as they
    ran (``temperature``, ``top_p``, ``max_output_tokens`` resolved), the output items and
    the usage. ``status`` is ``incomplete`` (with ``incomplete_details``) when
    ``max_output_tokens`` cut the answer; ``in_progress`` (no output, no usage) only in
    the first two stream events."""

    id: str = Field(description="`resp_` and the request's `X-Request-Id`, or 32 hex digits")
    created_at: int
    incomplete_details: ResponsesIncompleteDetails | None
    instructions: str | None
    metadata: dict[str, str] | None
    model: str
    object: Literal["response"]
    output: list[ResponsesOutputItem]
    parallel_tool_calls: bool
    temperature: float
    tool_choice: Literal["none", "auto", "required"] | ResponsesFunctionChoice
    tools: list[ResponsesFunctionTool]
    top_p: float
    background: Literal[False]
    max_output_tokens: int
    previous_response_id: None
    status: Literal["completed", "incomplete", "in_progress", "cancelled"]
    store: Literal[False] = Field(description="always false: kvpilot stores no responses")
    text: ResponsesTextConfig | None
    truncation: Literal["disabled"]
    usage: ResponsesUsage | None
    user: str | None


# An event's number in its stream: 0 for the first, then +1 per event.
SequenceNumber = Annotated[int, Field(description="0 for the first event of a stream, then +1 per event")]


class ResponsesCreatedEvent(BaseModel):
    type: Literal["response.created"]
    sequence_number: SequenceNumber
    response: ResponsesResponse


class ResponsesInProgressEvent(BaseModel):
    type: Literal["response.in_progress"]
    sequence_number: SequenceNumber
    response: ResponsesResponse


class ResponsesCompletedEvent(BaseModel):
    """The last event: the whole response, its output the items streamed."""

    type: Literal["response.completed"]
    sequence_number: SequenceNumber
    response: ResponsesResponse


class ResponsesOutputItemAddedEvent(BaseModel):
    type: Literal["response.output_item.added"]
    sequence_number: SequenceNumber
    output_index: int
    item: ResponsesOutputItem


class ResponsesOutputItemDoneEvent(BaseModel):
    type: Literal["response.output_item.done"]
    sequence_number: SequenceNumber
    output_index: int
    item: ResponsesOutputItem


class ResponsesContentPartAddedEvent(BaseModel):
    type: Literal["response.content_part.added"]
    sequence_number: SequenceNumber
    item_id: str
    output_index: int
    content_index: int
    part: ResponsesOutputText | ResponsesReasoningText


class ResponsesContentPartDoneEvent(BaseModel):
    type: Literal["response.content_part.done"]
    sequence_number: SequenceNumber
    item_id: str
    output_index: int
    content_index: int
    part: ResponsesOutputText | ResponsesReasoningText


class ResponsesTextDeltaEvent(BaseModel):
    type: Literal["response.output_text.delta"]
    sequence_number: SequenceNumber
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any]


class ResponsesTextDoneEvent(BaseModel):
    type: Literal["response.output_text.done"]
    sequence_number: SequenceNumber
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any]


class ResponsesReasoningTextDeltaEvent(BaseModel):
    type: Literal["response.reasoning_text.delta"]
    sequence_number: SequenceNumber
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ResponsesReasoningTextDoneEvent(BaseModel):
    type: Literal["response.reasoning_text.done"]
    sequence_number: SequenceNumber
    item_id: str
    output_index: int
    content_index: int
    text: str


class ResponsesFunctionCallArgumentsDeltaEvent(BaseModel):
    type: Literal["response.function_call_arguments.delta"]
    sequence_number: SequenceNumber
    item_id: str
    output_index: int
    delta: str


class ResponsesFunctionCallArgumentsDoneEvent(BaseModel):
    type: Literal["response.function_call_arguments.done"]
    sequence_number: SequenceNumber
    item_id: str
    output_index: int
    name: str
    arguments: str


class ResponsesErrorEvent(BaseModel):
    """A failure after the stream started (an engine error, the drain deadline): the last
    event (OpenAI's ``error`` event)."""

    type: Literal["error"]
    sequence_number: SequenceNumber
    code: str = Field(description="`server_error`, `service_unavailable` or `invalid_value`")
    message: str
    param: str | None


class ResponsesStreamEvent(RootModel[Annotated[
    ResponsesCreatedEvent | ResponsesInProgressEvent | ResponsesCompletedEvent | ResponsesOutputItemAddedEvent
    | ResponsesOutputItemDoneEvent | ResponsesContentPartAddedEvent | ResponsesContentPartDoneEvent
    | ResponsesTextDeltaEvent | ResponsesTextDoneEvent | ResponsesReasoningTextDeltaEvent
    | ResponsesReasoningTextDoneEvent | ResponsesFunctionCallArgumentsDeltaEvent
    | ResponsesFunctionCallArgumentsDoneEvent | ResponsesErrorEvent,
    Field(discriminator="type")]]):
    """One event of a ``POST /v1/responses`` stream (``event: <type>``, then ``data:``
    the event as JSON); no ``[DONE]`` follows the last."""


# ------------------------------------------------- LoRA adapters at runtime
class LoadLoRAAdapterRequest(StrictModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body): register a PEFT adapter folder under a
    name; requests then pick it with ``model``."""

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"lora_name": "sql", "lora_path": "/adapters/sql-lora"}]})
    lora_name: str = Field(description="the name requests will give as `model`; one already loaded is a 400")
    lora_path: str = Field(description=(
        "a folder on the server with the adapter's `adapter_config.json` and `adapter_model.safetensors` "
        "(PEFT's layout); one that cannot be read or does not fit the base model is a 400"))


class UnloadLoRAAdapterRequest(StrictModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body): remove an adapter; requests already
    running with it finish, new ones naming it get a 404."""

    model_config = ConfigDict(json_schema_extra={"examples": [{"lora_name": "sql"}]})
    lora_name: str = Field(description="the adapter's name; one not loaded is a 404")
    lora_int_id: Int | None = Field(default=None, description=(
        "vLLM's integer id of the adapter; when given it must be the named adapter's (else 404)"))


LORA_ADAPTER_OK: dict[str, Any] = {
    "description": "done: a plain-text line, as vLLM answers "
                   "(`Success: LoRA adapter 'sql' added successfully.`)",
    "content": {"text/plain": {"schema": {"type": "string"}}},
}


# ------------------------------------------------- router endpoints (vllm-router)
class ServerInfoResponse(BaseModel):
    """``GET /get_server_info``: what a KV-aware router needs to know about this engine."""

    model_id: str = Field(description="the served model name (the router's cache identity)")
    model_path: str = Field(description="the `--model` value (the embedded model's name when none)")
    served_model_name: str
    instance_id: str = Field(description="unique per process start: hostname, start time and a random suffix")
    kv_block_size: int = Field(description="tokens per KV block (`--block-size`)")
    max_model_len: int | None = Field(description="the context limit; null while the model loads")
    data_parallel_size: int = Field(1, description="always 1 (one engine per process)")
    kv_events: bool = Field(description="KV cache events are published (`GET /kv_event_sources`)")
    version: str


class KVEventSource(BaseModel):
    """One data-parallel rank's KV event publisher, as vLLM reports it."""

    endpoint: str = Field(description="the ZMQ PUB address; a host of 0.0.0.0 or * means every interface of this "
                                      "server (subscribers use the server's own host)")
    replay_endpoint: str | None = Field(description="the ZMQ ROUTER answering replay requests, or null")
    topic: str
    hwm: int
    buffer_steps: int
    max_queue_size: int
    publisher: Literal["zmq"]
    enable_kv_cache_events: Literal[True]
    encoding: Literal["msgpack"] = Field(description="payload encoding (vllm-router 0.1.17 requires it)")
    schema_version: Literal[1] = Field(description="wire schema version (vllm-router 0.1.17 requires 1)")


class KVEventSources(RootModel[dict[str, KVEventSource]]):
    """``GET /kv_event_sources``: publishers keyed by data-parallel rank (``"0"``)."""


class LoadResponse(BaseModel):
    """``GET /get_load``: the engine's live scheduler counts."""

    load: int = Field(description="running + waiting requests (one per choice of `n`)")
    num_running_requests: int
    num_waiting_requests: int


class RenderResponse(BaseModel):
    """A rendered request (vLLM's ``GenerateRequest``): the token ids the engine would
    run for it, chat template included, and its sampling parameters."""

    request_id: str
    token_ids: list[int] = Field(description="exactly the prompt token ids generation would use")
    features: None = Field(default=None, description="multimodal features: always null (text only)")
    sampling_params: dict[str, Any]
    model: str
    stream: bool
    stream_options: StreamOptions | None
    cache_salt: str | None
    priority: int = 0


class RenderResponseList(RootModel[list[RenderResponse]]):
    """``POST /v1/completions/render``: one rendered request per prompt."""


class ErrorDetail(BaseModel):
    message: str
    type: str = Field(description="`invalid_request_error`, `authentication_error`, `request_too_large`, "
                                  "`service_unavailable` or `server_error`")
    param: str | None = Field(description="the request field at fault (dotted for nested ones), or null")
    code: int | str | None = Field(description="`invalid_value`, `model_not_found`, or the HTTP status")


class ErrorResponse(BaseModel):
    """Every error body (OpenAI's)."""

    error: ErrorDetail


def error_body(message: str, err_type: str, code: int | str | None, param: str | None = None) -> ErrorResponse:
    """The OpenAI error body."""
    return ErrorResponse(error=ErrorDetail(message=message, type=err_type, param=param, code=code))
