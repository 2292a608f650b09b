"""Model shapes and GPU memory sizes for KV sizing (standard library only).

Model presets carry the fields of each model's published HF ``config.json`` that the KV
and weight arithmetic needs; the parameter count is computed from them (and equals the
count printed on each model card, which the tests check). A preset of a quantized
checkpoint also names its format (:mod:`kvpilot.sizing.quantization`), and
:meth:`ModelShape.weight_bytes` sizes its weights in it. :func:`load_model_folder` reads
the same fields from a local HF folder, counting parameters exactly from the
``*.safetensors`` headers when present (unless the checkpoint is quantized: packed
tensors do not count weights), and names the format of its ``quantization_config``.

GPU sizes are the total memory ``nvidia-smi`` reports (MiB), not the marketing number.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.sizing import quantization as quant

MIB = 1024**2


@dataclass(frozen=True)
class ModelShape:
    """What KV sizing needs to know about a Llama-family decoder.

    Attributes mirror HF ``config.json``; ``num_params`` overrides the computed count
    (set from safetensors headers for a local folder); ``quantization`` names the format
    of a quantized checkpoint's weights (``kvpilot.sizing.quantization``; "" for the
    model dtype throughout).
    """

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int
    vocab_size: int
    head_dim: int = 0  # 0 = hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_params: int = 0  # 0 = computed
    # Mixture of experts (Mixtral, Qwen-MoE): every layer sparse when num_experts > 0, each
    # expert a SwiGLU MLP of moe_intermediate_size (0 = intermediate_size, Mixtral's case),
    # plus a router [num_experts, hidden] and, for Qwen2-MoE, a shared expert and its
    # [1, hidden] gate. The KV cache does not depend on any of it.
    num_experts: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    qk_norm: bool = False  # Qwen3, Gemma 3: per-head q/k RMSNorm weights (2 x head_dim per layer)
    norms_per_layer: int = 2  # RMSNorms per decoder layer (Gemma 2/3: 4, around attention and MLP)
    # Sliding-window attention: ``sliding_window`` W tokens (0 = none). With a window,
    # ``num_full_attention_layers`` of the layers attend to the whole context (Gemma 2:
    # every other layer, Gemma 3: one in six) and the rest slide; 0 = every layer slides
    # (Mistral-7B-v0.1). Whether the window saves KV memory is :attr:`kv_window`.
    sliding_window: int = 0
    num_full_attention_layers: int = 0
    quantization: str = ""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_attention_heads", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(
                    f"model {self.name!r}: {name} must be a positive int; got {value!r}"
                )
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"model {self.name!r}: num_attention_heads ({self.num_attention_heads}) must be a"
                f" multiple of num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.head_dim:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.sliding_window < 0 or not 0 <= self.num_full_attention_layers <= self.num_layers:
            raise ValueError(
                f"model {self.name!r}: sliding_window ({self.sliding_window}) must be >= 0 and"
                f" num_full_attention_layers ({self.num_full_attention_layers}) in 0..num_layers"
            )
        if not self.sliding_window or self.num_full_attention_layers == self.num_layers:
            object.__setattr__(self, "sliding_window", 0)
            object.__setattr__(self, "num_full_attention_layers", 0)
        if not self.num_params:
            object.__setattr__(self, "num_params", self.computed_params())

    @property
    def num_sliding_layers(self) -> int:
        """Layers that attend to the last ``sliding_window`` tokens only."""
        return self.num_layers - self.num_full_attention_layers if self.sliding_window else 0

    @property
    def kv_window(self) -> int | None:
        """The window that bounds a sequence's KV memory, or None: W when every layer
        slides, else None. The engine's blocks hold every layer's K/V for their tokens, so
        a block can only go once no layer needs it; with one full-attention layer none
        ever can, and a hybrid model (Gemma 2/3) keeps the whole context on every layer."""
        if self.sliding_window and self.num_sliding_layers == self.num_layers:
            return self.sliding_window
        return None

    def computed_params(self) -> int:
        """Embeddings (+ untied LM head), per layer: q/k/v/o projections (+ qkv bias, + q/k
        norms), the MLP or the experts, and ``norms_per_layer`` RMSNorms; plus the final
        norm."""
        h, q, kv = self.hidden_size, self.num_attention_heads, self.num_kv_heads
        d = self.head_dim
        attn = h * q * d + 2 * h * kv * d + q * d * h
        if self.attention_bias:
            attn += q * d + 2 * kv * d
        if self.qk_norm:
            attn += 2 * d
        if self.num_experts:
            moe_inter = self.moe_intermediate_size or self.intermediate_size
            mlp = self.num_experts * (3 * h * moe_inter + h)  # experts + router rows
            if self.shared_expert_intermediate_size:
                mlp += 3 * h * self.shared_expert_intermediate_size + h
        else:
            mlp = 3 * h * self.intermediate_size
        layer = attn + mlp + self.norms_per_layer * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + self.num_layers * layer + h

    def linear_layers(self) -> tuple[tuple[int, int, int], ...]:
        """The linear layers a weight format quantizes, as ``(in_features, out_features,
        count)``: q, k, v, o and the MLP's gate, up and down projections (each expert's,
        and a shared expert's), in every layer. Not here: embeddings and LM head
        (:meth:`embedding_layers`), biases, norms, a MoE router and a shared expert's
        gate, which formats keep in the model dtype."""
        h, q, kv, d, n = (self.hidden_size, self.num_attention_heads, self.num_kv_heads,
                          self.head_dim, self.num_layers)
        layers = [(h, q * d, n), (h, kv * d, 2 * n), (q * d, h, n)]
        if self.num_experts:
            inter = self.moe_intermediate_size or self.intermediate_size
            layers += [(h, inter, 2 * n * self.num_experts), (inter, h, n * self.num_experts)]
            if self.shared_expert_intermediate_size:
                shared = self.shared_expert_intermediate_size
                layers += [(h, shared, 2 * n), (shared, h, n)]
        else:
            layers += [(h, self.intermediate_size, 2 * n), (self.intermediate_size, h, n)]
        return tuple(layers)

    def embedding_layers(self) -> tuple[tuple[int, int, int], ...]:
        """The token embeddings and the LM head as ``(hidden_size, vocab_size, count)``:
        one table when tied, two otherwise."""
        return ((self.hidden_size, self.vocab_size, 1 if self.tie_word_embeddings else 2),)

    def weight_bytes(self, dtype_bytes: float, quantization: str | None = quant.AUTO) -> quant.WeightBytes:
        """The weights' bytes in memory: the linear layers (:meth:`linear_layers`) in the
        format named ``quantization`` (``"auto"``: the shape's own, :attr:`quantization`;
        None or "": none), embeddings and LM head too when the format quantizes them
        (GGUF), everything else at ``dtype_bytes`` per parameter. Raises ValueError on an
        unknown format name."""
        name = self.quantization if quantization == quant.AUTO else quantization
        if not name:
            return quant.weight_bytes((), (), self.num_params, dtype_bytes)
        linear = sum(i * o * c for i, o, c in self.linear_layers())
        embedding = sum(i * o * c for i, o, c in self.embedding_layers())
        # Norms, biases, a router (and, in a counted folder, whatever else it holds).
        other = max(0, self.num_params - linear - embedding)
        return quant.weight_bytes(self.linear_layers(), self.embedding_layers(), other,
                                  dtype_bytes, name)


def _m(name: str, h: int, inter: int, layers: int, heads: int, kv: int, vocab: int,
       head_dim: int = 0, tied: bool = False, bias: bool = False) -> ModelShape:
    return ModelShape(name, h, inter, layers, heads, kv, vocab, head_dim, tied, bias)


MODEL_PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        _m("smollm2-135m", 576, 1536, 30, 9, 3, 49152, tied=True),
        _m("smollm2-360m", 960, 2560, 32, 15, 5, 49152, tied=True),
        _m("smollm2-1.7b", 2048, 8192, 24, 32, 32, 49152, tied=True),
        _m("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151936, tied=True, bias=True),
        _m("qwen2.5-7b", 3584, 18944, 28, 28, 4, 152064, bias=True),
        _m("qwen2.5-72b", 8192, 29568, 80, 64, 8, 152064, bias=True),
        # Qwen3 dense: head_dim 128 whatever the width (q/k norms add 2 x 128 per layer).
        _m("qwen3-0.6b", 1024, 3072, 28, 16, 8, 151936, head_dim=128, tied=True),
        _m("qwen3-8b", 4096, 12288, 36, 32, 8, 151936, head_dim=128),
        _m("qwen3-32b", 5120, 25600, 64, 64, 8, 151936, head_dim=128),
        _m("llama-2-7b", 4096, 11008, 32, 32, 32, 32000),
        _m("llama-2-13b", 5120, 13824, 40, 40, 40, 32000),
        _m("llama-2-70b", 8192, 28672, 80, 64, 8, 32000),
        _m("llama-3-8b", 4096, 14336, 32, 32, 8, 128256),
        _m("llama-3-70b", 8192, 28672, 80, 64, 8, 128256),
        _m("llama-3.1-8b", 4096, 14336, 32, 32, 8, 128256),
        _m("llama-3.1-70b", 8192, 28672, 80, 64, 8, 128256),
        _m("llama-3.1-405b", 16384, 53248, 126, 128, 8, 128256),
        _m("llama-3.2-1b", 2048, 8192, 16, 32, 8, 128256, head_dim=64, tied=True),
        _m("llama-3.2-3b", 3072, 8192, 28, 24, 8, 128256, head_dim=128, tied=True),
        _m("mistral-7b", 4096, 14336, 32, 32, 8, 32768),  # v0.3: no sliding window
        # Sliding windows. Mistral-7B-v0.1: every layer slides (W 4096), so a sequence's KV
        # stops growing at the window. Gemma 2/3 interleave sliding and full layers (the
        # KV of a hybrid is sized as full attention: see ModelShape.kv_window); 4 norms
        # per layer, tied embeddings. Gemma 3 12B is its text decoder (config.json's
        # text_config; vocab 262208 as there, the vision tower not counted).
        ModelShape("mistral-7b-v0.1", 4096, 14336, 32, 32, 8, 32000, sliding_window=4096),
        ModelShape("gemma-2-9b", 3584, 14336, 42, 16, 8, 256000, head_dim=256,
                   tie_word_embeddings=True, norms_per_layer=4, sliding_window=4096,
                   num_full_attention_layers=21),
        ModelShape("gemma-3-1b", 1152, 6912, 26, 4, 1, 262144, head_dim=256,
                   tie_word_embeddings=True, norms_per_layer=4, qk_norm=True, sliding_window=512,
                   num_full_attention_layers=4),
        ModelShape("gemma-3-12b", 3840, 15360, 48, 16, 8, 262208, head_dim=256,
                   tie_word_embeddings=True, norms_per_layer=4, qk_norm=True, sliding_window=1024,
                   num_full_attention_layers=8),
        # Mixture of experts (hf.co model cards' safetensors totals).
        ModelShape("mixtral-8x7b", 4096, 14336, 32, 32, 8, 32000, num_experts=8),
        ModelShape("qwen3-30b-a3b", 2048, 6144, 48, 32, 4, 151936, head_dim=128, num_experts=128,
                   moe_intermediate_size=768, qk_norm=True),
        ModelShape("qwen1.5-moe-a2.7b", 2048, 5632, 24, 16, 16, 151936, attention_bias=True, num_experts=60,
                   moe_intermediate_size=1408, shared_expert_intermediate_size=5632),
        # Quantized checkpoints (their config.json: the base model's shape, and its
        # quantization_config). RedHatAI's (formerly neuralmagic's) FP8: compressed-tensors,
        # FP8 weights with one scale per tensor, lm_head not quantized. hugging-quants'
        # AWQ: 4-bit, group 128, zero points, lm_head not quantized.
        ModelShape("llama-3.1-8b-instruct-fp8", 4096, 14336, 32, 32, 8, 128256,
                   quantization="w8a8-fp8"),
        ModelShape("llama-3.1-70b-instruct-fp8", 8192, 28672, 80, 64, 8, 128256,
                   quantization="w8a8-fp8"),
        ModelShape("llama-3.1-70b-instruct-awq-int4", 8192, 28672, 80, 64, 8, 128256,
                   quantization="awq"),
        # Qwen's own FP8 releases (transformers' fp8: E4M3 weights, one fp32 scale per
        # 128 x 128 block, lm_head and embeddings in bf16), with the base config's q/k norms.
        ModelShape("qwen3-8b-fp8", 4096, 12288, 36, 32, 8, 151936, head_dim=128, qk_norm=True,
                   quantization="fp8-block128"),
        ModelShape("qwen3-32b-fp8", 5120, 25600, 64, 64, 8, 151936, head_dim=128, qk_norm=True,
                   quantization="fp8-block128"),
    )
}

# Total memory per GPU as nvidia-smi reports it, in MiB.
GPU_MEMORY_MIB: dict[str, int] = {
    "H200": 143771,
    "H100-80GB": 81559,
    "A100-80GB": 81920,
    "A100-40GB": 40960,
    "L40S": 46068,
    "A10G": 23028,
    "L4": 23034,
    "T4": 15360,
}


def model_preset(name: str) -> ModelShape:
    try:
        return MODEL_PRESETS[name.lower()]
    except KeyError:
        raise ValueError(
            f"model preset must be one of {', '.join(MODEL_PRESETS)}; got {name!r}"
            " (or pass a HF model folder)"
        ) from None


def gpu_memory_bytes(name: str) -> int:
    for gpu, mib in GPU_MEMORY_MIB.items():
        if gpu.lower() == name.lower():
            return mib * MIB
    raise ValueError(f"GPU must be one of {', '.join(GPU_MEMORY_MIB)}; got {name!r}")


def _sliding_layers(cfg: Mapping[str, Any]) -> tuple[int, int]:
    """``(sliding_window, num_full_attention_layers)`` the way the engine reads them
    (``kvpilot.engine.model.config``): ``layer_types`` when present; Gemma 2 slides on even
    layers, Gemma 3 on all but every ``sliding_window_pattern``-th (6); Mistral, Mixtral
    and Phi-3 on every layer once ``sliding_window`` is set; Qwen2/Qwen3 only with
    ``use_sliding_window``, on layers ``>= max_window_layers``."""
    kind = cfg.get("model_type")
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window")
    if kind == "gemma2" and window is None:
        window = 4096  # transformers' Gemma2Config default
    if not window:
        return 0, 0
    gemma = kind in ("gemma2", "gemma3", "gemma3_text")
    if not gemma and not cfg.get("use_sliding_window", kind in ("mistral", "mixtral", "phi3")):
        return 0, 0
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        if kind == "gemma2":
            layer_types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        elif gemma:
            pattern = int(cfg.get("sliding_window_pattern") or 6)
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        elif kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            first = int(cfg.get("max_window_layers") or 0)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        else:
            return int(window), 0
    sliding = sum(t == "sliding_attention" for t in layer_types)
    return (int(window), n - sliding) if sliding else (0, 0)


def quantization_from_config(config: Mapping[str, Any]) -> str:
    """The weight format a HF ``config.json`` declares: "" for none, a name of
    :data:`~kvpilot.sizing.quantization.WEIGHT_FORMATS`, or, for a format the table does
    not have, a description of it (``"unknown: gptq, bits 4, group_size 32"``), which
    sizing refuses with the allowed names. Older compressed-tensors checkpoints call the
    field ``compression_config``."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not isinstance(qc, Mapping):
        return ""
    name = quant.format_from_hf_config(qc)
    if name is not None:
        return name
    keys = ("quant_method", "bits", "group_size", "weight_block_size")
    return "unknown: " + ", ".join(f"{k} {qc[k]}" for k in keys if k in qc)


def shape_from_config(name: str, config: Mapping[str, Any]) -> ModelShape:
    """Read a HF ``config.json`` mapping (Llama, Mistral, Mixtral, Qwen2/3 and their MoE,
    Gemma 2/3, SmolLM2 keys), and the format of its ``quantization_config``
    (:func:`quantization_from_config`)."""
    cfg = config.get("text_config", config)  # multimodal wrappers nest the decoder
    kind = cfg.get("model_type")
    gemma = kind in ("gemma2", "gemma3", "gemma3_text")
    try:
        heads = int(cfg["num_attention_heads"])
        window, full_layers = _sliding_layers(cfg)
        return ModelShape(
            name=name,
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg.get("intermediate_size", 0)),
            num_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            vocab_size=int(cfg.get("vocab_size", 0)),
            head_dim=int(cfg.get("head_dim") or (256 if gemma else 0)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", gemma)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("model_type") in ("qwen2", "qwen2_moe"))),
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0),
            moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
            shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
            qk_norm=kind in ("qwen3", "qwen3_moe", "gemma3", "gemma3_text"),
            norms_per_layer=4 if gemma else 2,
            sliding_window=window,
            num_full_attention_layers=full_layers,
            quantization=quantization_from_config(config),
        )
    except KeyError as exc:
        raise ValueError(f"config.json of {name!r} lacks {exc.args[0]!r}") from None


def safetensors_params(folder: Path) -> int:
    """Parameters counted from the headers of every ``*.safetensors`` file (no tensor data
    is read: the header is an 8-byte little-endian length and a JSON table of shapes)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for key, info in header.items():
            if key == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            total += count
    return total


def load_model_folder(folder: str | Path) -> ModelShape:
    """A :class:`ModelShape` from a HF folder's ``config.json`` (+ safetensors headers,
    unless the checkpoint is quantized: a packed int32 holds 8 weights, and scales are
    tensors too, so the headers do not count its parameters)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{folder} has no config.json: pass a HF model folder or a preset name")
    shape = shape_from_config(folder.name, json.loads(config_path.read_text()))
    counted = 0 if shape.quantization else safetensors_params(folder)
    if counted:
        fields = {k: getattr(shape, k) for k in shape.__dataclass_fields__}
        shape = ModelShape(**{**fields, "num_params": counted})
    return shape
