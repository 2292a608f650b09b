"""The ``vllm serve`` flags that ``kvpilot serve`` does not have: which are no-ops here and
which cannot be honoured, and why.

A ``vllm serve`` flag is one of three kinds for kvpilot:

(a) a kvpilot flag too (``--model``, ``--max-num-seqs``, ...): it is in
    :mod:`kvpilot.flags.serve` and this table does not list it;
(b) a meaningful no-op: what a vLLM user asks for with it is what kvpilot does anyway
    (``--enable-chunked-prefill``: prefill is always chunked). It is accepted, removed
    from the command line and logged at start-up with the reason;
(c) a flag kvpilot cannot honour (``--pipeline-parallel-size 2``, ``--speculative-model``):
    the command line is refused, naming every such flag with its reason.

Some flags are no-ops for some values and cannot be honoured for others
(``--pipeline-parallel-size 1`` is fine, ``2`` is not; ``--enforce-eager`` is a no-op,
``--no-enforce-eager`` is not): :attr:`VLLMFlag.accepts` decides per value.

The table was sorted from vLLM's ``vllm/engine/arg_utils.py`` (``EngineArgs.add_cli_args``)
and ``vllm/entrypoints/openai/cli_args.py`` (``make_arg_parser``, ``FrontendArgs``),
current flags and a few removed ones still common in scripts (``--swap-space``,
``--disable-log-requests``). :mod:`kvpilot.flags.check` puts it on argparse parsers;
:mod:`kvpilot.flags.docs` renders it as docs/server.md's "vLLM command lines" tables.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["FLAGS", "TABLE", "Arity", "VLLMFlag"]


class Arity(enum.Enum):
    """How a flag is written on vLLM's command line."""

    SWITCH = "switch"  # --flag (store_true)
    BOOL = "bool"  # --flag / --no-flag (argparse.BooleanOptionalAction)
    ONE = "one"  # --flag VALUE or --flag=VALUE
    MANY = "many"  # --flag V1 V2 ... (nargs="+")


# The value a check sees: True/False for --flag/--no-flag, the text of a value otherwise.
Value = bool | str


@dataclass(frozen=True)
class VLLMFlag:
    """One ``vllm serve`` flag that the ``kvpilot serve`` parser does not have.

    Attributes:
        name: the long option (``--tensor-parallel-size``).
        arity: how it is written (:class:`Arity`).
        noop: why it changes nothing here, for the values it accepts; None when no value
            is accepted (category (c)).
        refused: why the other values cannot be honoured; None when every value is a
            no-op (category (b)).
        accepts: whether a value (True/False for ``--flag``/``--no-flag``, else the value's
            text) is a no-op; needed only when both ``noop`` and ``refused`` are given.
        accepted: the accepted values, in words, for the docs (``1``, ``--enforce-eager``).
        aliases: other spellings vLLM accepts (``-tp``).
    """

    name: str
    arity: Arity
    noop: str | None
    refused: str | None
    accepts: Callable[[Value], bool] | None = None
    accepted: str = ""
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.noop is None and self.refused is None:
            raise ValueError(f"{self.name}: a flag is a no-op, refused, or both by value")
        if self.noop is not None and self.refused is not None and self.accepts is None:
            raise ValueError(f"{self.name}: a flag accepted for some values needs accepts()")

    @property
    def category(self) -> str:
        """``no-op``, ``refused``, or ``by value`` (a no-op for some values only)."""
        if self.refused is None:
            return "no-op"
        return "refused" if self.noop is None else "by value"

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every option string this entry answers for (``--no-`` forms of a BOOL included)."""
        names = (self.name, *self.aliases)
        if self.arity is Arity.BOOL:
            names += (f"--no-{self.name[2:]}",)
        return names

    def judge(self, value: Value) -> str | None:
        """None when ``value`` is a no-op here, else the reason it cannot be honoured."""
        if self.refused is None:
            return None
        if self.noop is None:
            return self.refused
        assert self.accepts is not None  # __post_init__
        return None if self.accepts(value) else self.refused


def _noop(name: str, arity: Arity, why: str, *aliases: str) -> VLLMFlag:
    return VLLMFlag(name, arity, noop=why, refused=None, aliases=aliases)


def _refused(name: str, arity: Arity, why: str, *aliases: str) -> VLLMFlag:
    return VLLMFlag(name, arity, noop=None, refused=why, aliases=aliases)


def _if(name: str, arity: Arity, accepted: Sequence[str] | bool, noop: str, refused: str,
        *aliases: str) -> VLLMFlag:
    """A no-op for the ``accepted`` values (for a BOOL: True = ``--flag``, False =
    ``--no-flag``), refused for the others. Numbers compare by value (``1.0`` is ``1``)."""
    if isinstance(accepted, bool):
        want = accepted

        def accepts(value: Value) -> bool:
            return value is want

        words = name if accepted else f"--no-{name[2:]}"
    else:
        allowed = tuple(accepted)

        def accepts(value: Value) -> bool:
            return isinstance(value, str) and any(_same(value, a) for a in allowed)

        words = " or ".join(allowed)
    return VLLMFlag(name, arity, noop=noop, refused=refused, accepts=accepts, accepted=words,
                    aliases=aliases)


def _off(name: str, refused: str) -> VLLMFlag:
    """A vLLM BOOL flag refused when on; its ``--no-`` form is vLLM's default and kvpilot's
    behaviour, a no-op."""
    return _if(name, Arity.BOOL, False, _DEFAULT, refused)


_DEFAULT = "off is vLLM's default and what kvpilot does"


def _same(value: str, allowed: str) -> bool:
    text = value.strip().strip("'\"").lower()
    if text == allowed:
        return True
    try:
        return float(text) == float(allowed)
    except ValueError:
        return False


S, B, ONE, MANY = Arity.SWITCH, Arity.BOOL, Arity.ONE, Arity.MANY
_ONE_GPU = ("kvpilot splits a model over GPUs only by tensor parallelism (--tensor-parallel-size); "
            "otherwise run one engine per GPU, as the operator's replicas do")
_NO_HUB = ("kvpilot loads a local folder or GGUF file and never downloads from the Hugging "
           "Face Hub (the operator's hf:// model URI downloads before the engine starts)")
_NO_GRAPHS = "kvpilot neither compiles the model nor captures CUDA graphs"
_NO_LORA = "fully sharded LoRA layers are not supported; --enable-lora serves adapters without them"
_NO_MM = "kvpilot serves text only (no multimodal inputs)"
_NO_TLS = "kvpilot serves plain HTTP; terminate TLS in front of it (ingress, gateway)"
_NO_CORS = "kvpilot has no CORS middleware; set CORS headers in front of it"
_NO_SPEC = "speculative decoding is not supported"

FLAGS: tuple[VLLMFlag, ...] = (
    # ---- (b) no-ops for every value
    _noop("--trust-remote-code", B,
          "kvpilot never runs code from a model repository: it loads the architectures it "
          "implements itself, so there is nothing to trust or distrust"),
    _noop("--disable-frontend-multiprocessing", S,
          "the HTTP server and the engine already share one process (the engine runs in a "
          "thread)"),
    _noop("--disable-log-requests", S,
          "kvpilot never logs requests (no prompts, no parameters); uvicorn's access log "
          "line stays, as it does in vLLM"),
    _noop("--disable-log-stats", S,
          "kvpilot writes no periodic statistics to the log; /metrics is still served "
          "(vLLM also stops its engine metrics with this flag: kvpilot does not, the "
          "operator's autoscaler reads them)"),
    _noop("--max-log-len", ONE,
          "kvpilot never writes prompts to the log, so there is nothing to truncate"),
    _noop("--swap-space", ONE,
          "kvpilot preempts by recomputation (as vLLM V1 does, which also ignores this "
          "flag): nothing is swapped to CPU memory"),
    _noop("--max-seq-len-to-capture", ONE,
          f"it only bounds CUDA graph capture; {_NO_GRAPHS}"),
    _noop("--disable-custom-all-reduce", B,
          "kvpilot's tensor-parallel all-reduce is torch.distributed's (NCCL, gloo); there is no "
          "custom all-reduce to turn off"),
    _noop("--disable-cascade-attn", B,
          "kvpilot has no cascade attention to use or disable"),
    _noop("--disable-hybrid-kv-cache-manager", B,
          "kvpilot keeps one uniform paged KV cache for every layer (no hybrid manager)"),
    _noop("--max-parallel-loading-workers", ONE,
          "each tensor-parallel rank loads its own shard; there are no batches of loaders to bound"),
    _noop("--ray-workers-use-nsight", B, "kvpilot starts no Ray workers"),
    _noop("--no-skip-tokenizer-init", S, "the tokenizer is loaded by default"),
    _noop("--no-calculate-kv-scales", S,
          "quantized-cache scales are fixed at start-up by default"),
    _noop("--no-enable-auto-tool-choice", S,
          "off is the default: tool_choice \"auto\" needs --enable-auto-tool-choice"),
    # ---- no-ops for some values, refused for the others
    _if("--enable-chunked-prefill", B, True,
        "kvpilot always chunks prefills: each step's --max-num-batched-tokens budget is "
        "shared by decodes and prefill chunks",
        "kvpilot always chunks prefills; it cannot run a whole prompt in one step"),
    _if("--enforce-eager", B, True,
        f"{_NO_GRAPHS}: it always runs eagerly",
        f"{_NO_GRAPHS}; drop --no-enforce-eager"),
    _if("--enable-log-requests", B, False,
        "kvpilot never logs requests",
        "kvpilot does not log requests (prompts, parameters); only uvicorn's access line"),
    _if("--language-model-only", B, True, _NO_MM, _NO_MM),
    _if("--enable-prompt-tokens-details", B, True,
        "usage.prompt_tokens_details.cached_tokens is always reported",
        "usage.prompt_tokens_details is always reported"),
    _if("--async-scheduling", B, False,
        "kvpilot schedules each step after the previous one (no async scheduling)",
        "kvpilot has no async scheduling: each step is scheduled after the previous one"),
    _if("--enable-expert-parallel", B, False,
        "expert parallelism is off: with tensor parallelism every rank holds a slice of every expert",
        "expert parallelism is not supported: with --tensor-parallel-size every rank holds a slice "
        "of every expert instead", "-ep"),
    _off("--enable-sleep-mode", "sleep mode (offloading weights on request) is not supported"),
    _off("--enable-prompt-embeds", "prompt embeddings as input are not supported"),
    _if("--pipeline-parallel-size", ONE, ("1",), _ONE_GPU,
        f"pipeline parallelism is not supported: {_ONE_GPU}", "-pp"),
    _if("--data-parallel-size", ONE, ("1",), "one engine per server",
        "data parallelism inside one server is not supported; run replicas behind a router "
        "(the operator's replicas and spec.router)", "-dp"),
    _if("--distributed-executor-backend", ONE, ("uni", "mp"),
        "kvpilot runs rank 0 inside the server process and spawns the other tensor-parallel "
        "ranks as local processes (vLLM's mp backend)",
        "kvpilot runs rank 0 inside the server process and spawns the other tensor-parallel "
        "ranks as local processes; Ray and external launchers are not supported"),
    _if("--api-server-count", ONE, ("1",), "kvpilot runs one API server process",
        "kvpilot runs one API server process; run more replicas instead", "-asc"),
    _if("--num-scheduler-steps", ONE, ("1",), "kvpilot schedules every step",
        "multi-step scheduling is not supported"),
    _if("--scheduling-policy", ONE, ("fcfs",), "requests are admitted first come, first served",
        "requests are admitted first come, first served; there is no priority scheduling"),
    _if("--preemption-mode", ONE, ("recompute",), "kvpilot preempts by recomputation",
        "kvpilot preempts by recomputation; it cannot swap to CPU memory"),
    _if("--max-logprobs", ONE, ("20",), "kvpilot's limit is 20 logprobs per token, vLLM's default",
        "kvpilot's limit is fixed at 20 logprobs per token (OpenAI's)"),
    _if("--response-role", ONE, ("assistant",), "replies have the role assistant",
        "replies always have the role assistant"),
    _if("--generation-config", ONE, ("vllm",),
        "kvpilot does not apply the model's generation_config.json sampling defaults "
        "(it reads only its EOS ids), as with vLLM's 'vllm' value",
        "kvpilot does not apply generation_config.json sampling defaults (it reads only its "
        "EOS ids): only --generation-config vllm is accepted"),
    _if("--tokenizer-mode", ONE, ("auto", "hf"),
        "kvpilot uses the model's tokenizer through transformers (fast when it has one)",
        "kvpilot uses the model's tokenizer through transformers only"),
    _if("--task", ONE, ("auto", "generate"), "kvpilot generates text",
        "kvpilot only generates text (no embeddings, scores or classification)"),
    _if("--runner", ONE, ("auto", "generate"), "kvpilot generates text",
        "kvpilot only generates text (no pooling or draft runner)"),
    _if("--convert", ONE, ("auto", "none"), "kvpilot runs the model as it is",
        "kvpilot cannot convert a model to a pooling model"),
    _if("--model-impl", ONE, ("auto",), "kvpilot runs its own implementation of the architecture",
        "kvpilot runs its own implementation of the architecture; it cannot choose vLLM's "
        "or transformers'"),
    _if("--stream-interval", ONE, ("1",), "kvpilot streams every token as it is generated",
        "kvpilot streams every token as it is generated"),
    _if("--cpu-offload-gb", ONE, ("0",), "no weights are offloaded to CPU",
        "offloading weights to CPU memory is not supported"),
    _if("--uvicorn-log-level", ONE, ("info",),
        "uvicorn logs at --log-level, info by default",
        "kvpilot's uvicorn logs at --log-level (debug, info, warning, error): use that"),
    # ---- (c) refused for every value
    _refused("--speculative-config", ONE, _NO_SPEC, "-sc"),
    _refused("--speculative-model", ONE, _NO_SPEC),
    _refused("--num-speculative-tokens", ONE, _NO_SPEC),
    _off("--fully-sharded-loras", _NO_LORA),
    _refused("--kv-transfer-config", ONE, "KV transfer (disaggregated prefill) is not supported"),
    _refused("--compilation-config", ONE, _NO_GRAPHS, "-cc"),
    _refused("--cudagraph-capture-sizes", MANY, _NO_GRAPHS),
    _refused("--hf-overrides", ONE, "overriding the model's config.json is not supported"),
    _refused("--override-generation-config", ONE,
             "kvpilot does not apply generation-config sampling defaults"),
    _refused("--rope-scaling", ONE, "overriding the model's RoPE scaling is not supported"),
    _refused("--rope-theta", ONE, "overriding the model's RoPE theta is not supported"),
    _refused("--revision", ONE, _NO_HUB),
    _refused("--code-revision", ONE, _NO_HUB),
    _refused("--tokenizer-revision", ONE, _NO_HUB),
    _refused("--download-dir", ONE, _NO_HUB),
    _refused("--hf-token", ONE, _NO_HUB),
    _refused("--kv-cache-memory-bytes", ONE,
             "use --num-gpu-blocks-override (KV blocks) or, on CPU, --kv-cache-memory (GiB)"),
    _refused("--kv-offloading-size", ONE, "KV cache offloading is not supported"),
    _refused("--kv-offloading-backend", ONE, "KV cache offloading is not supported"),
    _refused("--long-prefill-token-threshold", ONE,
             "prefill chunks share --max-num-batched-tokens; there is no long-prefill limit"),
    _refused("--max-num-partial-prefills", ONE, "partial-prefill limits are not supported"),
    _refused("--max-long-partial-prefills", ONE, "partial-prefill limits are not supported"),
    _refused("--limit-mm-per-prompt", ONE, _NO_MM),
    _refused("--mm-processor-kwargs", ONE, _NO_MM),
    _refused("--allowed-local-media-path", ONE, _NO_MM),
    _if("--guided-decoding-backend", ONE, ("auto", "xgrammar"),
        "structured outputs always use xgrammar",
        "structured outputs use xgrammar only (auto or xgrammar)"),
    _refused("--structured-outputs-config", ONE,
             "structured outputs always use xgrammar with its defaults; there is nothing to configure "
             "(--guided-decoding-backend xgrammar is accepted)"),
    _refused("--logits-processors", MANY, "custom logits processors are not supported"),
    _refused("--logits-processor-pattern", ONE, "custom logits processors are not supported"),
    _refused("--otlp-traces-endpoint", ONE, "OpenTelemetry tracing is not supported"),
    _refused("--collect-detailed-traces", ONE, "OpenTelemetry tracing is not supported"),
    _refused("--show-hidden-metrics-for-version", ONE,
             "kvpilot's metrics have no hidden (deprecated) set; see docs/metrics.md"),
    _off("--enable-eplb", "expert load balancing is not supported"),
    _refused("--worker-cls", ONE, "the worker class cannot be replaced"),
    _refused("--worker-extension-cls", ONE, "the worker class cannot be extended"),
    _refused("--additional-config", ONE, "there are no platform-specific settings"),
    _refused("--headless", S, "kvpilot always serves the API (no multi-node headless mode)"),
    _refused("--grpc", S, "kvpilot serves HTTP only"),
    _refused("--config", ONE, "kvpilot does not read vLLM config files: pass the flags"),
    _refused("--shutdown-timeout", ONE,
             "use --drain-timeout (seconds requests get to finish on SIGTERM)"),
    _refused("--uds", ONE, "kvpilot listens on TCP only (--host, --port)"),
    _refused("--root-path", ONE, "serving under a path prefix is not supported"),
    _refused("--ssl-keyfile", ONE, _NO_TLS),
    _refused("--ssl-certfile", ONE, _NO_TLS),
    _refused("--ssl-ca-certs", ONE, _NO_TLS),
    _refused("--ssl-cert-reqs", ONE, _NO_TLS),
    _off("--enable-ssl-refresh", _NO_TLS),
    _refused("--allowed-origins", ONE, _NO_CORS),
    _refused("--allowed-methods", ONE, _NO_CORS),
    _refused("--allowed-headers", ONE, _NO_CORS),
    _off("--allow-credentials", _NO_CORS),
    _refused("--middleware", ONE, "extra ASGI middleware cannot be added"),
    _off("--disable-fastapi-docs", "the API docs (/docs, /openapi.json) are always served"),
    _off("--disable-uvicorn-access-log", "uvicorn's access log is always on"),
    _off("--enable-request-id-headers", "X-Request-Id is echoed when a request sends one, never generated"),
    _off("--return-tokens-as-token-ids", "logprobs name tokens by their text only"),
    _off("--enable-log-outputs", "kvpilot does not log outputs"),
    _off("--enable-force-include-usage", "a stream carries usage only when stream_options.include_usage asks for it"),
    _off("--enable-server-load-tracking", "use GET /get_load (always served) for the server's load"),
    _off("--enable-tokenizer-info-endpoint", "there is no /tokenizer_info endpoint"),
    _refused("--log-config-file", ONE,
             "kvpilot configures its logging itself (--log-level)"),
)

# Every option string of the table -> its entry.
TABLE: dict[str, VLLMFlag] = {s: f for f in FLAGS for s in f.spellings}
if len(TABLE) != sum(len(f.spellings) for f in FLAGS):  # pragma: no cover - a table typo
    raise RuntimeError("kvpilot.flags.vllm: an option string is listed twice")
