"""``kvpilot serve``'s own flags (and ``kvpilot generate``'s engine flags): one table.

Each :class:`Flag` is written once here; from the table come the argparse arguments
(:func:`add_arguments`), :class:`kvpilot.engine.config.EngineArgs`'s defaults
(:func:`engine_defaults`), the option strings the vLLM check knows (:func:`option_strings`)
and the flags the operator sets from spec fields (:data:`MANAGED_FLAGS`, which
``engine.extraArgs`` may not repeat). Names, defaults and meanings follow vLLM's flags
of the same name.

Standard library only, like the rest of :mod:`kvpilot.flags`: the operator imports it and
must not import the engine or torch. Choices that name torch dtypes are the names only;
the engine maps them to torch (:mod:`kvpilot.engine.config`). A value the engine parses
with its own types (``--kv-events-config``) is converted by the ``types`` the engine passes
to :func:`add_arguments`.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["ATTENTION_BACKENDS", "CHAT", "DEFAULT_MAX_NUM_SEQS", "DEVICES", "DTYPES", "ENGINE",
           "FLAGS", "KV_CACHE_DTYPES", "LOAD_FORMATS", "LOG_LEVELS", "LORA", "MANAGED_FLAGS",
           "MAX_LORA_RANKS", "PREFIX_CACHING_HASH_ALGOS", "QUANTIZATIONS", "SERVER", "Flag", "Kind", "LoRAModulePath", "add_arguments",
           "engine_defaults", "option_strings", "parse_layer_list", "parse_lora_module"]

# --dtype values besides "auto" (float32 on CPU, bfloat16 on CUDA).
DTYPES = ("float32", "float", "bfloat16", "float16", "half")
# --kv-cache-dtype values besides "auto" (the model dtype): 16/32-bit floats, FP8, and the
# 4-bit micro-scaled formats (kvpilot.kernels.kv4).
KV_CACHE_DTYPES = ("bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2",
                   "fp4_e2m1", "int4")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")
LOAD_FORMATS = ("auto", "dummy")
# --quantization values: vLLM's names of the checkpoint formats kvpilot reads (the
# checkpoint's own config says which; the flag checks it, or with fp8 quantizes an
# unquantized checkpoint at load), and vLLM's kernel aliases of two of them.
QUANTIZATIONS = ("compressed-tensors", "gptq", "awq", "fp8", "gguf", "gptq_marlin", "awq_marlin")
LOG_LEVELS = ("debug", "info", "warning", "error")
# --max-num-seqs when not given, lowered to --max-num-batched-tokens when that is smaller.
DEFAULT_MAX_NUM_SEQS = 256
# --prefix-caching-hash-algo values: vLLM 0.32's four (sha256 its default), then vLLM
# 0.10's sha256_cbor_64bit, the one llm-d's KV cache indexer v0.3.0 recomputes.
PREFIX_CACHING_HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "sha256_cbor_64bit")
# --max-lora-rank values (vLLM's LoRAConfig.max_lora_rank; 16 by default).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class Kind(enum.Enum):
    """How a flag is written."""

    VALUE = "value"  # --flag VALUE or --flag=VALUE
    SWITCH = "switch"  # --flag (store_true)
    BOOL = "bool"  # --flag / --no-flag (argparse.BooleanOptionalAction)
    MANY = "many"  # --flag V1 V2 ... (one or more values; a repeated flag adds to the list)


@dataclass(frozen=True)
class Flag:
    """One ``kvpilot serve`` flag.

    Attributes:
        name: the long option (``--max-num-seqs``); the attribute is its name without
            the dashes, ``-`` as ``_`` (``max_num_seqs``), as argparse makes it.
        kind: how it is written (:class:`Kind`).
        default: the value when the flag is not given (for the engine flags, also
            :class:`~kvpilot.engine.config.EngineArgs`'s default).
        help: the ``--help`` text; None for none.
        type: converts the text of a value (``int``, ``float``, :func:`parse_layer_list`);
            None keeps the text.
        choices: the values allowed; empty for any.
        metavar: the value's name in ``--help``.
        aliases: other spellings (``-tp``).
        managed: the operator sets it from a spec field; ``engine.extraArgs`` may not
            repeat it (any spelling, ``--no-`` form included).
        default_env: an environment variable whose non-empty value replaces ``default``
            when the parser is built (``KVPILOT_API_KEY``: a Secret, not the pod's args).
    """

    name: str
    kind: Kind = Kind.VALUE
    default: Any = None
    help: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    aliases: tuple[str, ...] = ()
    managed: bool = False
    default_env: str | None = None

    @property
    def dest(self) -> str:
        """The attribute argparse stores the value in (``max_num_seqs``)."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every option string of the flag (the ``--no-`` form of a BOOL included)."""
        names = (self.name, *self.aliases)
        if self.kind is Kind.BOOL:
            names += (f"--no-{self.name[2:]}",)
        return names

    @property
    def takes_value(self) -> bool:
        """Whether the flag takes one value (:attr:`Kind.VALUE`); see :attr:`takes_values`."""
        return self.kind is Kind.VALUE

    @property
    def takes_values(self) -> bool:
        """Whether the flag takes one or more values (:attr:`Kind.MANY`)."""
        return self.kind is Kind.MANY


def parse_layer_list(text: str) -> tuple[int, ...]:
    """``"0,29"`` -> ``(0, 29)``; an empty string is no layers. Raises
    ``argparse.ArgumentTypeError`` naming the bad item."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if not item.isdigit():
            raise argparse.ArgumentTypeError(f"layer indices must be integers >= 0 separated by commas; got {item!r}")
        out.append(int(item))
    return tuple(out)


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: an adapter registered at start-up (vLLM's
    ``LoRAModulePath``).

    Attributes:
        name: the name requests use as ``model``.
        path: the local folder with the adapter's ``adapter_config.json`` and weights.
        base_model_name: the base model it was made for (``parent`` in ``/v1/models``);
            None: the served model.
    """

    name: str
    path: str
    base_model_name: str | None = None


_LORA_MODULE_KEYS = ("name", "path", "base_model_name")


def parse_lora_module(text: str) -> LoRAModulePath:
    """One ``--lora-modules`` value, in either of vLLM's forms: ``name=path``, or a JSON
    object ``{"name": ..., "path": ..., "base_model_name": ...}`` (``base_model_name``
    optional). Raises ``argparse.ArgumentTypeError`` naming the value and what is wrong:
    an empty name or path, JSON that is not such an object, a key other than those three,
    a value that is not a string."""
    text = text.strip()
    if not text.startswith("{"):
        name, eq, path = text.partition("=")
        if not eq or not name.strip() or not path.strip():
            raise argparse.ArgumentTypeError(
                f"{text!r} is neither name=path nor a JSON object "
                '{"name": ..., "path": ..., "base_model_name": ...}')
        return LoRAModulePath(name.strip(), path.strip())
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: a JSON module must be an object")
    unknown = sorted(set(obj) - set(_LORA_MODULE_KEYS))
    if unknown:
        raise argparse.ArgumentTypeError(
            f"{text!r}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)} "
            f"(allowed: {', '.join(_LORA_MODULE_KEYS)})")
    for key in ("name", "path"):
        if not isinstance(obj.get(key), str) or not obj[key].strip():
            raise argparse.ArgumentTypeError(f"{text!r}: {key!r} must be a non-empty string")
    base = obj.get("base_model_name")
    if base is not None and (not isinstance(base, str) or not base.strip()):
        raise argparse.ArgumentTypeError(f"{text!r}: 'base_model_name' must be a non-empty string or null")
    return LoRAModulePath(obj["name"].strip(), obj["path"].strip(), base.strip() if base else None)


V, S, B, M = Kind.VALUE, Kind.SWITCH, Kind.BOOL, Kind.MANY

# The groups of --help, in order: (title, flags).
SERVER: tuple[Flag, ...] = (
    Flag("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)", managed=True),
    Flag("--port", type=int, default=8000, managed=True),
    Flag("--api-key", default=None, default_env="KVPILOT_API_KEY",
         help="require 'Authorization: Bearer <key>' on the API (default: $KVPILOT_API_KEY, "
         "so a Kubernetes Secret can supply it without showing in the pod's args)"),
    Flag("--drain-timeout", type=float, default=120.0, help="seconds to let requests finish on SIGTERM",
         managed=True),
    Flag("--max-request-body-bytes", type=int, default=16 * 1024 * 1024),
    Flag("--log-level", default="info", choices=LOG_LEVELS),
)
CHAT: tuple[Flag, ...] = (
    Flag("--enable-auto-tool-choice", S, default=False,
         help="allow tool_choice \"auto\": the model decides, its calls are parsed by --tool-call-parser"),
    Flag("--tool-call-parser", metavar="NAME",
         help="how tool calls are found in the model's text: hermes, llama3_json or mistral"),
    Flag("--reasoning-parser", metavar="NAME",
         help="split <think>...</think> reasoning into reasoning_content: deepseek_r1 or qwen3"),
    Flag("--chat-template", metavar="FILE_OR_TEMPLATE",
         help="a Jinja chat template (a file, or the template itself) used instead of the tokenizer's"),
)
ENGINE: tuple[Flag, ...] = (
    Flag("--model", managed=True,
         help="GGUF file, HF folder, embedded://smollm2-135m-instruct (default), or "
         "preset:<name> (architecture only, with --load-format dummy)"),
    Flag("--served-model-name", help="model id reported by the API (default: the model's name)",
         managed=True),
    Flag("--tokenizer", help="tokenizer folder (default: the model's own)"),
    Flag("--dtype", default="auto", choices=("auto", *DTYPES)),
    Flag("--device", default="auto", choices=DEVICES, managed=True),
    Flag("--kv-cache-dtype", default="auto", choices=("auto", *KV_CACHE_DTYPES), managed=True),
    Flag("--block-size", type=int, default=16, help="tokens per KV block", managed=True),
    Flag("--max-num-batched-tokens", type=int, default=2048, help="token budget per step",
         managed=True),
    Flag("--max-num-seqs", type=int, default=None, managed=True,
         help=f"running requests at most (default {DEFAULT_MAX_NUM_SEQS}, or "
         "--max-num-batched-tokens when that is lower)"),
    Flag("--max-model-len", type=int, help="context length limit (prompt + output)", managed=True),
    Flag("--enable-prefix-caching", B, default=True, help="reuse KV of shared prefixes (radix cache)",
         managed=True),
    Flag("--gpu-memory-utilization", type=float, default=0.9, managed=True),
    Flag("--num-gpu-blocks-override", type=int, help="exact KV block count"),
    Flag("--kv-cache-memory", type=float, default=1.0, help="KV cache GiB on CPU"),
    Flag("--attention-backend", default="auto", choices=ATTENTION_BACKENDS),
    Flag("--load-format", default="auto", choices=LOAD_FORMATS),
    Flag("--quantization", default=None, choices=QUANTIZATIONS, aliases=("-q",),
         help="weight quantization: the checkpoint's format, checked (default: read from the checkpoint); "
              "fp8 on an unquantized checkpoint quantizes it at load"),
    Flag("--seed", type=int, default=0, help="seed for unseeded sampling"),
    Flag("--kv-cache-key-rotation", B, default=True,
         help="FP8 KV cache: rotate K/Q heads by a Hadamard matrix before quantizing"),
    Flag("--kv-cache-skip-layers", type=parse_layer_list, default=(), metavar="I,J,...",
         help="quantized KV cache: layers kept in the model dtype (comma-separated indices)"),
    Flag("--calculate-kv-scales", S, default=False,
         help="quantized KV cache: learn the scales from the first requests instead of a "
         "fixed start-up calibration (not deterministic: answers depend on earlier traffic)"),
    Flag("--skip-tokenizer-init", S, default=False,
         help="no tokenizer: token ids in and out (dummy benchmarks, preset:<name> models)"),
    Flag("--kv-events-config", metavar="JSON",
         help="publish KV cache events for KV-aware routers (vLLM's flag), e.g. "
         '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
         '"replay_endpoint": "tcp://*:5558"}\''),
    Flag("--prefix-caching-hash-algo", default="sha256", choices=PREFIX_CACHING_HASH_ALGOS,
         help="the block hash KV cache events carry, vLLM's: sha256 (pickle), sha256_cbor, xxhash, "
         "xxhash_cbor, or vLLM 0.10's sha256_cbor_64bit (llm-d's indexer); seeded by PYTHONHASHSEED"),
    Flag("--tensor-parallel-size", type=int, default=1, metavar="N", aliases=("-tp",), managed=True,
         help="split the model over N devices (GPUs: NCCL; CPU: gloo), one process each; N must "
         "divide the attention heads"),
    Flag("--disable-sliding-window", B, default=False,
         help="sliding-window models: full attention, context capped to the window"),
)
# Multi-LoRA serving (vLLM's flags, names, defaults and meanings: LoRAConfig and
# --lora-modules). kvpilot serve only: kvpilot generate has no way to pick an adapter.
LORA: tuple[Flag, ...] = (
    Flag("--enable-lora", B, default=False,
         help="serve LoRA adapters on the base model: requests pick one by its name in `model`"),
    Flag("--lora-modules", M, default=(), type=parse_lora_module, metavar="MODULE",
         help="adapters to load at start-up (needs --enable-lora), each name=path or JSON "
         '\'{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}\''),
    Flag("--max-loras", type=int, default=1, metavar="N",
         help="distinct adapters in one batch at most (needs --enable-lora)"),
    Flag("--max-lora-rank", type=int, default=16, metavar="R",
         help=f"highest adapter rank accepted: one of {', '.join(map(str, MAX_LORA_RANKS))} "
         "(needs --enable-lora)"),
    Flag("--max-cpu-loras", type=int, metavar="N",
         help="adapters kept in host memory at most, >= --max-loras (default: --max-loras; "
         "needs --enable-lora)"),
    Flag("--lora-adapters-file", metavar="PATH",
         help="kvpilot's: a JSON list of {name, uri} adapters (the operator's spec.adapters) "
         "loaded before the server is ready and followed while it runs (needs --enable-lora)"),
)
GROUPS: tuple[tuple[str, tuple[Flag, ...]], ...] = (
    ("server", SERVER), ("chat (vLLM's flags)", CHAT), ("engine", ENGINE),
    ("LoRA adapters (vLLM's flags)", LORA))
# Every kvpilot serve flag, in --help order.
FLAGS: tuple[Flag, ...] = SERVER + CHAT + ENGINE + LORA

# The LoRA flags the operator writes from spec.adapters and spec.engine.lora (vLLM's
# names, and kvpilot's --lora-adapters-file), by name: the table's LoRA entries, where the
# engine defines them, need not be marked managed for the operator to refuse them.
OPERATOR_LORA_FLAGS: tuple[str, ...] = (
    "--enable-lora", "--no-enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras",
    "--lora-adapters-file",
)
# vLLM's --quantization (and -q), which the operator writes from spec.model.quantization
# once the engine takes the flag: named here, like the LoRA flags, so that the operator
# refuses it in engine.extraArgs whether or not (and however) the table above defines it.
OPERATOR_QUANTIZATION_FLAGS: tuple[str, ...] = ("--quantization", "-q")
# Flags the operator derives from spec fields; engine.extraArgs may not repeat them.
MANAGED_FLAGS: tuple[str, ...] = tuple(dict.fromkeys(
    (*(s for f in FLAGS if f.managed for s in f.spellings), *OPERATOR_LORA_FLAGS,
     *OPERATOR_QUANTIZATION_FLAGS)))


def _spellings_are_unique() -> None:
    seen = [s for f in FLAGS for s in f.spellings]
    if len(seen) != len(set(seen)):  # pragma: no cover - a table typo
        raise RuntimeError("kvpilot.flags.serve: an option string is listed twice")


_spellings_are_unique()


def option_strings() -> Iterator[tuple[str, bool]]:
    """Every option string of ``kvpilot serve`` (``-h``/``--help`` included) and whether it
    takes a value (one, or one or more), in --help order."""
    yield "-h", False
    yield "--help", False
    for f in FLAGS:
        for s in f.spellings:
            yield s, f.takes_value or f.takes_values


def engine_defaults() -> dict[str, Any]:
    """The engine flags' defaults by attribute (``{"block_size": 16, ...}``), the LoRA
    flags' included: the one source of :class:`~kvpilot.engine.config.EngineArgs`'s field
    defaults."""
    return {f.dest: f.default for f in ENGINE + LORA}


def add_arguments(parser: argparse.ArgumentParser, flags: tuple[Flag, ...] | None = None, *,
                  types: Mapping[str, Callable[[str], Any]] | None = None) -> None:
    """Put flags of the table on ``parser``, each group under its title (all of them by
    default; ``flags=ENGINE`` for ``kvpilot generate``). ``types`` replaces a flag's
    ``type`` by attribute (``{"kv_events_config": ...}``: the engine's own parsers).
    Mutates ``parser``."""
    wanted = FLAGS if flags is None else flags
    types = types or {}
    for title, group in GROUPS:
        chosen = [f for f in group if f in wanted]
        if not chosen:
            continue
        g = parser.add_argument_group(title)
        for f in chosen:
            default = f.default
            if f.default_env is not None:
                default = os.environ.get(f.default_env) or default
            kw: dict[str, Any] = {"default": default}
            if f.help is not None:
                kw["help"] = f.help
            if f.kind is Kind.SWITCH:
                kw["action"] = "store_true"
            elif f.kind is Kind.BOOL:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                if f.kind is Kind.MANY:
                    # one or more values; a repeated flag adds to them (a fresh list: argparse
                    # extends the default in place)
                    kw.update(action="extend", nargs="+", default=list(default))
                conv = types.get(f.dest, f.type)
                if conv is not None:
                    kw["type"] = conv
                if f.choices:
                    kw["choices"] = list(f.choices)
                if f.metavar is not None:
                    kw["metavar"] = f.metavar
            g.add_argument(f.name, *f.aliases, **kw)
