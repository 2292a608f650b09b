"""Engine arguments (the ``kvpilot serve`` / ``generate`` flags) and their resolution.

:class:`EngineArgs` is what a user asks for; the engine resolves ``auto`` values
against the hardware and the model once, at start-up, and keeps the result frozen in
:class:`ResolvedConfig`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import torch

from kvpilot.engine.kv_events import KVEventsConfig, KVEventsConfigError

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
KV4_CACHE_DTYPES = ("fp4_e2m1", "int4")
DEVICES = ("auto", "cpu", "cuda")
# --max-num-seqs when not given, lowered to --max-num-batched-tokens when that is smaller.
DEFAULT_MAX_NUM_SEQS = 256
LOAD_FORMATS = ("auto", "dummy")


def parse_layer_list(text: str) -> tuple[int, ...]:
    """``"0,29"`` -> ``(0, 29)``; an empty string is no layers. Raises
    ``argparse.ArgumentTypeError`` naming the bad item."""
    out = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        if not item.isdigit():
            raise argparse.ArgumentTypeError(f"layer indices must be integers >= 0 separated by commas; got {item!r}")
        out.append(int(item))
    return tuple(out)


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """``--kv-events-config`` JSON -> :class:`KVEventsConfig`; an argparse error naming
    the field, the value and what is allowed otherwise."""
    try:
        return KVEventsConfig.from_json(text)
    except KVEventsConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
        tensor_parallel_size: vLLM's ``--tensor-parallel-size``: ranks the model is split
            over (:mod:`kvpilot.engine.distributed`), one process and device each.
        disable_sliding_window: vLLM's flag of that name: run a sliding-window model's
            layers with full attention and cap ``max_model_len`` to the smallest window
            (within the window both are the same computation).
    """

    model: str | None = None
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    kv_cache_dtype: str = "auto"
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = None  # type: ignore[assignment]  # resolved in __post_init__
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory: float = 1.0
    attention_backend: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    kv_cache_key_rotation: bool = True
    kv_cache_skip_layers: tuple[int, ...] = ()
    calculate_kv_scales: bool = False
    skip_tokenizer_init: bool = False
    kv_events_config: KVEventsConfig | None = None
    disable_sliding_window: bool = False
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        _choice("--dtype", self.dtype, ["auto", *DTYPES])
        _choice("--kv-cache-dtype", self.kv_cache_dtype, ["auto", *KV_CACHE_DTYPES])
        _choice("--device", self.device, DEVICES)
        _choice("--load-format", self.load_format, LOAD_FORMATS)
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

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = EngineArgs()
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--model",
            default=None,
            help="GGUF file, HF folder, embedded://smollm2-135m-instruct (default), or "
            "preset:<name> (architecture only, with --load-format dummy)",
        )
        g.add_argument("--served-model-name", default=None, help="model id reported by the API (default: the model's name)")
        g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
        g.add_argument("--dtype", default=d.dtype, choices=["auto", *DTYPES])
        g.add_argument("--device", default=d.device, choices=DEVICES)
        g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=["auto", *KV_CACHE_DTYPES])
        g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
        g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens, help="token budget per step")
        g.add_argument("--max-num-seqs", type=int, default=None,
                       help=f"running requests at most (default {DEFAULT_MAX_NUM_SEQS}, or "
                       "--max-num-batched-tokens when that is lower)")
        g.add_argument("--max-model-len", type=int, default=None, help="context length limit (prompt + output)")
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=d.enable_prefix_caching,
            help="reuse KV of shared prefixes (radix cache)",
        )
        g.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
        g.add_argument("--num-gpu-blocks-override", type=int, default=None, help="exact KV block count")
        g.add_argument("--kv-cache-memory", type=float, default=d.kv_cache_memory, help="KV cache GiB on CPU")
        g.add_argument("--attention-backend", default=d.attention_backend, choices=["auto", "cpu", "torch", "triton"])
        g.add_argument("--load-format", default=d.load_format, choices=LOAD_FORMATS)
        g.add_argument("--seed", type=int, default=d.seed, help="seed for unseeded sampling")
        g.add_argument(
            "--kv-cache-key-rotation",
            action=argparse.BooleanOptionalAction,
            default=d.kv_cache_key_rotation,
            help="FP8 KV cache: rotate K/Q heads by a Hadamard matrix before quantizing",
        )
        g.add_argument(
            "--kv-cache-skip-layers",
            type=parse_layer_list,
            default=d.kv_cache_skip_layers,
            metavar="I,J,...",
            help="quantized KV cache: layers kept in the model dtype (comma-separated indices)",
        )
        g.add_argument(
            "--calculate-kv-scales",
            action="store_true",
            default=d.calculate_kv_scales,
            help="quantized KV cache: learn the scales from the first requests instead of a "
            "fixed start-up calibration (not deterministic: answers depend on earlier traffic)",
        )
        g.add_argument(
            "--skip-tokenizer-init",
            action="store_true",
            default=d.skip_tokenizer_init,
            help="no tokenizer: token ids in and out (dummy benchmarks, preset:<name> models)",
        )
        g.add_argument(
            "--kv-events-config",
            type=parse_kv_events_config,
            default=None,
            metavar="JSON",
            help="publish KV cache events for KV-aware routers (vLLM's flag), e.g. "
            '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
            '"replay_endpoint": "tcp://*:5558"}\'',
        )
        g.add_argument(
            "--tensor-parallel-size", "-tp",
            type=int,
            default=d.tensor_parallel_size,
            metavar="N",
            help="split the model over N devices (GPUs: NCCL; CPU: gloo), one process each; N must "
            "divide the attention heads",
        )
        g.add_argument(
            "--disable-sliding-window",
            action=argparse.BooleanOptionalAction,
            default=d.disable_sliding_window,
            help="sliding-window models: full attention, context capped to the window",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
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
