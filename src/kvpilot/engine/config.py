"""Engine arguments (the ``kvpilot serve`` / ``generate`` flags) and their resolution.

:class:`EngineArgs` is what a user asks for; the engine resolves ``auto`` values
against the hardware and the model once, at start-up, and keeps the result frozen in
:class:`ResolvedConfig`.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from typing import Any

import torch

from kvpilot.engine.kv_events import KVEventsConfig, KVEventsConfigError
from kvpilot.flags import serve as flags
from kvpilot.flags.serve import (
    DEFAULT_MAX_NUM_SEQS,
    DEVICES,
    LOAD_FORMATS,
    MAX_LORA_RANKS,
    LoRAModulePath,
    parse_lora_module,
)

__all__ = ["DTYPES", "KV4_CACHE_DTYPES", "KV_CACHE_DTYPES", "EngineArgs", "LoRAModulePath",
           "ResolvedConfig", "parse_kv_events_config", "resolve_device", "resolve_dtype",
           "resolve_kv_cache_dtype"]

# The flag names (kvpilot.flags.serve) -> torch dtypes.
DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}
KV_CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    # 4-bit micro-scaled formats: uint8 storage (two codes per byte) plus an E4M3 scale
    # per 16 values (kvpilot.kernels.kv4).
    "fp4_e2m1": torch.uint8,
    "int4": torch.uint8,
}
if tuple(DTYPES) != flags.DTYPES or tuple(KV_CACHE_DTYPES) != flags.KV_CACHE_DTYPES:  # pragma: no cover
    raise RuntimeError("kvpilot.engine.config: DTYPES / KV_CACHE_DTYPES differ from kvpilot.flags.serve's names")
KV4_CACHE_DTYPES = ("fp4_e2m1", "int4")
# The defaults of the engine flags, by field (one table: kvpilot.flags.serve).
_DEFAULT = flags.engine_defaults()


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config`` JSON -> :class:`KVEventsConfig`; an argparse error naming
    the field, the value and what is allowed otherwise."""
    try:
        return KVEventsConfig.from_json(text)
    except KVEventsConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _lora_module(value: LoRAModulePath | str | dict[str, Any]) -> LoRAModulePath:
    """An ``EngineArgs.lora_modules`` item as :class:`LoRAModulePath`: one already, a
    ``--lora-modules`` string (``name=path`` or JSON), or a dict with its fields. Raises
    ValueError naming ``--lora-modules`` and the value."""
    if isinstance(value, LoRAModulePath):
        return value
    if isinstance(value, dict):
        value = json.dumps(value)
    if not isinstance(value, str):
        raise ValueError(f"--lora-modules: {value!r} is neither name=path nor a JSON object")
    try:
        return parse_lora_module(value)
    except argparse.ArgumentTypeError as e:
        raise ValueError(f"--lora-modules: {e}") from None


def _choice(name: str, value: str, allowed: tuple[str, ...] | list[str]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True)
class EngineArgs:
    """User-facing engine settings; names match vLLM's flags.

    Attributes:
        model: GGUF file, HF folder, ``embedded://smollm2-135m-instruct`` (default) or
            ``preset:<name>`` (an architecture without weights, for ``load_format="dummy"``).
        dtype: activation/weight dtype; ``auto`` = float32 on CPU, bfloat16 on CUDA.
        kv_cache_dtype: ``auto`` (= dtype) or one of :data:`KV_CACHE_DTYPES`.
        kv_cache_memory: GiB for the KV cache on CPU.
        gpu_memory_utilization: share of GPU memory the engine may use in all (CUDA).
        num_gpu_blocks_override: exact number of KV blocks (wins over both above).
        max_model_len: context limit; default min(model's, KV pool's).
        load_format: ``auto`` (real weights) or ``dummy`` (random weights, for benchmarks).
        quantization: vLLM's ``--quantization``: None reads the checkpoint's own format; a
            format name (:data:`~kvpilot.flags.serve.QUANTIZATIONS`) must match it, and
            ``fp8`` on an unquantized checkpoint quantizes its linears at load.
        kv_cache_key_rotation: with an FP8 cache, rotate K and Q heads by a Hadamard
            matrix before quantizing (exact in full precision; lowers FP8 logit error).
        kv_cache_skip_layers: with a quantized KV cache (FP8 or 4-bit), layer indices kept
            in the model dtype instead (``--kv-cache-skip-layers 0,29``), for layers whose
            K/V do not survive quantization.
        calculate_kv_scales: learn a quantized KV cache's scales from the first real
            batches (vLLM's flag of that name) instead of fixing them at start-up; the
            answers then depend on what traffic came first, so it is off by default.
        skip_tokenizer_init: run without a tokenizer (token ids in, token ids out; no
            text, no stop strings), as vLLM's flag of that name.
        kv_events_config: vLLM's ``--kv-events-config``: publish the prefix cache's
            block stores and evictions on ZMQ for KV-aware routers
            (:mod:`kvpilot.engine.kv_events`); a JSON string or a dict is parsed.
        prefix_caching_hash_algo: vLLM's ``--prefix-caching-hash-algo``: the block hash
            the events carry (:class:`~kvpilot.engine.core.kv_events.BlockHasher`), one of
            :data:`~kvpilot.flags.serve.PREFIX_CACHING_HASH_ALGOS`, seeded as vLLM seeds it
            (``PYTHONHASHSEED``). The radix tree matches prefixes by token ids, so the
            algorithm changes only what consumers of the events see.
        tensor_parallel_size: vLLM's ``--tensor-parallel-size``: ranks the model is split
            over (:mod:`kvpilot.engine.distributed`), one process and device each.
        disable_sliding_window: vLLM's flag of that name: run a sliding-window model's
            layers with full attention and cap ``max_model_len`` to the smallest window
            (within the window both are the same computation).
        enable_lora: vLLM's ``--enable-lora``: serve LoRA adapters (PEFT folders) on the
            base model; a request picks one by its name in ``model``. The other LoRA
            fields need it (a value other than their default is refused without it).
        lora_modules: vLLM's ``--lora-modules``: the adapters registered at start-up
            (:class:`LoRAModulePath`; ``name=path`` strings, JSON objects and dicts are
            parsed). Names must be unique.
        max_loras: vLLM's ``--max-loras``: distinct adapters in one batch at most (>= 1).
        max_lora_rank: vLLM's ``--max-lora-rank``: the highest adapter rank accepted, one
            of :data:`~kvpilot.flags.serve.MAX_LORA_RANKS`.
        max_cpu_loras: vLLM's ``--max-cpu-loras``: adapters kept in host memory at most;
            None (not given) resolves to ``max_loras`` here when ``enable_lora``; must be
            >= ``max_loras``.
        lora_adapters_file: kvpilot's ``--lora-adapters-file``: a JSON list of
            ``{"name", "uri"}`` adapters (the operator's ``spec.adapters``), loaded before
            the server is ready and followed while it runs
            (:mod:`kvpilot.engine.lora.file_sync`).
    """

    model: str | None = _DEFAULT["model"]
    served_model_name: str | None = _DEFAULT["served_model_name"]
    tokenizer: str | None = _DEFAULT["tokenizer"]
    dtype: str = _DEFAULT["dtype"]
    device: str = _DEFAULT["device"]
    kv_cache_dtype: str = _DEFAULT["kv_cache_dtype"]
    block_size: int = _DEFAULT["block_size"]
    max_num_batched_tokens: int = _DEFAULT["max_num_batched_tokens"]
    max_num_seqs: int = _DEFAULT["max_num_seqs"]  # None: resolved in __post_init__
    max_model_len: int | None = _DEFAULT["max_model_len"]
    enable_prefix_caching: bool = _DEFAULT["enable_prefix_caching"]
    gpu_memory_utilization: float = _DEFAULT["gpu_memory_utilization"]
    num_gpu_blocks_override: int | None = _DEFAULT["num_gpu_blocks_override"]
    kv_cache_memory: float = _DEFAULT["kv_cache_memory"]
    attention_backend: str = _DEFAULT["attention_backend"]
    load_format: str = _DEFAULT["load_format"]
    quantization: str | None = _DEFAULT["quantization"]
    seed: int = _DEFAULT["seed"]
    kv_cache_key_rotation: bool = _DEFAULT["kv_cache_key_rotation"]
    kv_cache_skip_layers: tuple[int, ...] = _DEFAULT["kv_cache_skip_layers"]
    calculate_kv_scales: bool = _DEFAULT["calculate_kv_scales"]
    skip_tokenizer_init: bool = _DEFAULT["skip_tokenizer_init"]
    kv_events_config: KVEventsConfig | None = _DEFAULT["kv_events_config"]
    prefix_caching_hash_algo: str = _DEFAULT["prefix_caching_hash_algo"]
    disable_sliding_window: bool = _DEFAULT["disable_sliding_window"]
    tensor_parallel_size: int = _DEFAULT["tensor_parallel_size"]
    enable_lora: bool = _DEFAULT["enable_lora"]
    lora_modules: tuple[LoRAModulePath, ...] = _DEFAULT["lora_modules"]
    max_loras: int = _DEFAULT["max_loras"]
    max_lora_rank: int = _DEFAULT["max_lora_rank"]
    max_cpu_loras: int | None = _DEFAULT["max_cpu_loras"]  # None: resolved in __post_init__
    lora_adapters_file: str | None = _DEFAULT["lora_adapters_file"]

    def __post_init__(self) -> None:
        _choice("--dtype", self.dtype, ["auto", *DTYPES])
        _choice("--kv-cache-dtype", self.kv_cache_dtype, ["auto", *KV_CACHE_DTYPES])
        _choice("--device", self.device, DEVICES)
        _choice("--load-format", self.load_format, LOAD_FORMATS)
        _choice("--prefix-caching-hash-algo", self.prefix_caching_hash_algo, flags.PREFIX_CACHING_HASH_ALGOS)
        if self.quantization is not None:
            _choice("--quantization", self.quantization, flags.QUANTIZATIONS)
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"--block-size must be a power of two in [1, 128]; got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"--kv-cache-memory must be > 0 GiB; got {self.kv_cache_memory}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"--num-gpu-blocks-override must be >= 1; got {self.num_gpu_blocks_override}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"--max-num-batched-tokens must be >= 1; got {self.max_num_batched_tokens}")
        if self.max_num_seqs is None:  # vLLM lowers its default to fit a small budget
            object.__setattr__(self, "max_num_seqs", min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens))
        if self.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1; got {self.max_num_seqs}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"--max-num-seqs ({self.max_num_seqs}) must be <= --max-num-batched-tokens "
                f"({self.max_num_batched_tokens}): every running request decodes one token per step; "
                "lower --max-num-seqs or leave it out (its default then fits the budget)"
            )
        if isinstance(self.tensor_parallel_size, bool) or not isinstance(self.tensor_parallel_size, int) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"--tensor-parallel-size must be a whole number >= 1; got {self.tensor_parallel_size!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"--max-model-len must be >= 2; got {self.max_model_len}")
        kv = self.kv_events_config
        if isinstance(kv, str):
            kv = KVEventsConfig.from_json(kv)
        elif isinstance(kv, dict):
            kv = KVEventsConfig.from_dict(kv)
        elif kv is not None and not isinstance(kv, KVEventsConfig):
            raise ValueError(f"--kv-events-config must be a JSON object; got {type(kv).__name__}")
        object.__setattr__(self, "kv_events_config", kv)
        if kv is not None and kv.enable_kv_cache_events and not self.enable_prefix_caching:
            raise ValueError(
                "--kv-events-config: enable_kv_cache_events needs prefix caching (the events report the "
                "prefix cache's blocks); drop --no-enable-prefix-caching or turn the events off")
        object.__setattr__(self, "kv_cache_skip_layers", tuple(self.kv_cache_skip_layers))
        if any(not isinstance(i, int) or i < 0 for i in self.kv_cache_skip_layers):
            raise ValueError(
                f"--kv-cache-skip-layers must be layer indices >= 0; got {list(self.kv_cache_skip_layers)}"
            )
        self._check_lora()

    def _check_lora(self) -> None:
        """Validate the LoRA fields (ValueError naming the flag and what is allowed);
        normalizes ``lora_modules`` to a tuple of :class:`LoRAModulePath` and resolves
        ``max_cpu_loras`` (None -> ``max_loras`` with LoRA on). Mutates ``self`` (frozen: through
        ``object.__setattr__``)."""
        modules = tuple(_lora_module(m) for m in (self.lora_modules or ()))
        object.__setattr__(self, "lora_modules", modules)
        if not self.enable_lora:
            given = [flag for flag, on in (
                ("--lora-modules", bool(modules)),
                ("--max-loras", self.max_loras != _DEFAULT["max_loras"]),
                ("--max-lora-rank", self.max_lora_rank != _DEFAULT["max_lora_rank"]),
                ("--max-cpu-loras", self.max_cpu_loras is not None),
                ("--lora-adapters-file", self.lora_adapters_file is not None),
            ) if on]
            if given:
                raise ValueError(f"{', '.join(given)} need{'s' if len(given) == 1 else ''} --enable-lora "
                                 "(LoRA adapters are served only with it)")
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"--max-loras must be a whole number >= 1; got {self.max_loras!r}")
        if self.max_lora_rank not in MAX_LORA_RANKS or isinstance(self.max_lora_rank, bool):
            raise ValueError(f"--max-lora-rank must be one of {', '.join(map(str, MAX_LORA_RANKS))}; "
                             f"got {self.max_lora_rank!r}")
        if self.max_cpu_loras is None:
            if self.enable_lora:  # vLLM's default; without LoRA it stays None
                object.__setattr__(self, "max_cpu_loras", self.max_loras)
        elif isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int) \
                or self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras!r}) must be >= --max-loras ({self.max_loras})")
        names = [m.name for m in modules]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"--lora-modules: the name{'s' if len(twice) > 1 else ''} "
                             f"{', '.join(map(repr, twice))} given more than once; each adapter needs its own name")

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Put the engine flags (:data:`kvpilot.flags.serve.ENGINE`) on ``parser``, with the
        engine's parser for ``--kv-events-config``. Mutates ``parser``."""
        flags.add_arguments(parser, flags.ENGINE, types={"kv_events_config": parse_kv_events_config})

    @staticmethod
    def add_lora_cli_args(parser: argparse.ArgumentParser) -> None:
        """Put the LoRA flags (:data:`kvpilot.flags.serve.LORA`) on ``parser`` (``kvpilot
        serve`` only). Mutates ``parser``."""
        flags.add_arguments(parser, flags.LORA)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        """The fields ``ns`` has (the rest keep their defaults). Raises ValueError naming
        the flag (see ``__post_init__``)."""
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls) if hasattr(ns, f.name)})


@dataclass(frozen=True)
class ResolvedConfig:
    """What the engine actually runs with, after ``auto`` values are resolved.

    ``sliding_window``: the window W (tokens) when every layer slides, so the KV cache
    frees the blocks behind it and a sequence holds at most ``(cdiv(W, block_size) + 1)
    x block_size`` tokens; None when any layer attends to the whole context (full
    attention, interleaved sliding and full layers, ``--disable-sliding-window``).
    """

    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    kv_cache_dtype_name: str
    attention_backend: str
    num_blocks: int
    block_size: int
    max_model_len: int
    served_model_name: str
    sliding_window: int | None = None
    tensor_parallel_size: int = 1


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype) -> tuple[torch.dtype, str]:
    if name == "auto":
        return dtype, str(dtype).removeprefix("torch.")
    canonical = "fp8_e4m3" if name == "fp8" else name
    return KV_CACHE_DTYPES[name], canonical
