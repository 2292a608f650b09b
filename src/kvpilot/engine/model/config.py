"""The architecture description of a decoder (:class:`ModelConfig`): shapes and
hyper-parameters, whatever file they were read from.

Reading them is elsewhere: a HF ``config.json`` in :mod:`kvpilot.engine.model.hf_config`,
GGUF metadata in :mod:`kvpilot.engine.model.gguf_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# Mixture-of-experts architectures (kvpilot.engine.model.moe for the sparse layers).
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
# How router logits become expert weights (HF's / DeepSeek's ``scoring_func``).
MOE_SCORING_FUNCS = ("softmax", "sigmoid")
# Architectures whose decoder is kvpilot.engine.model.gemma (the rest run llama.py).
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")


class UnsupportedModelError(ValueError):
    """The model exists but is not something this engine can run."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of the decoder.

    Attributes:
        architecture: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` or ``phi3``.
        head_dim: per-head size (``hidden_size // num_heads`` unless given).
        attention_bias: q/k/v projections have a bias (Qwen2; Llama's ``attention_bias``).
        o_proj_bias: the output projection has a bias too (Llama's ``attention_bias``).
        mlp_bias: gate, up and down projections have biases (Llama's ``mlp_bias``).
        qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3's ``q_norm``/``k_norm``).
        rope_scaling: HF ``rope_scaling`` dict (``llama3`` type supported) or None.
        rope_freq_factors: per-frequency divisors from a GGUF ``rope_freqs`` tensor.
        eos_token_ids: tokens that end generation.
        hidden_act: the MLP's gate activation: ``silu`` (SwiGLU) or ``gelu_pytorch_tanh``
            (Gemma's GeGLU).
        query_pre_attn_scalar: Gemma: the softmax scale is ``query_pre_attn_scalar ** -0.5``
            instead of ``head_dim ** -0.5`` (:attr:`attention_scale`).
        attn_logit_softcapping: Gemma 2: attention scores ``s`` become ``c * tanh(s / c)``.
        final_logit_softcapping: Gemma 2: the logits ``z`` become ``c * tanh(z / c)``.
        rope_local_theta: Gemma 3: the RoPE base of the sliding layers
            (``rope_local_base_freq``); the full layers use ``rope_theta`` and
            ``rope_scaling``. None: every layer uses ``rope_theta``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"
    # Gemma 2/3 (kvpilot.engine.model.gemma); the defaults are the Llama family's math.
    hidden_act: str = "silu"
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    # Mixture of experts (kvpilot.engine.model.moe); num_experts 0 = dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_scoring_func: str = "softmax"
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has the sparse MoE block (HF Qwen2-MoE/Qwen3-MoE's
        rule: not in ``mlp_only_layers`` and ``(layer_idx + 1) % decoder_sparse_step == 0``)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)

    def is_sliding_layer(self, layer_idx: int) -> bool:
        """Whether the checkpoint declares layer ``layer_idx`` a sliding one (its
        ``layer_types``, else every layer when the model has a window). Gemma 3 picks the
        layer's RoPE table by this even when the window itself is turned off."""
        if self.layer_types is None:
            return self.sliding_window is not None
        return self.layer_types[layer_idx] == "sliding_attention"

    @property
    def all_layers_slide(self) -> bool:
        """Every layer attends within ``sliding_window`` (Mistral-style): the KV blocks
        behind the window can be freed. False for hybrid models (Gemma 2/3)."""
        return self.sliding_window is not None and all(
            self.sliding_window_for(i) is not None for i in range(self.num_layers))

    def without_sliding_window(self) -> ModelConfig:
        """This config with full attention on every layer (``--disable-sliding-window``);
        ``layer_types`` stays, so per-layer RoPE choices do not change."""
        return replace(self, sliding_window=None)

    def sliding_window_for(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (tokens, the query included), or None
        for full causal attention. With ``layer_types`` (HF names ``"sliding_attention"`` /
        ``"full_attention"``) a layer slides iff its type is ``"sliding_attention"``; without
        it every layer slides iff ``sliding_window`` is set."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.is_sliding_layer(layer_idx) else None

    def __post_init__(self) -> None:
        if self.layer_types is not None:
            bad = sorted(set(self.layer_types) - {"sliding_attention", "full_attention"})
            if bad:
                raise UnsupportedModelError(f"{self.name}: layer_types contains {bad}; supported: "
                                            "'sliding_attention', 'full_attention'")
            if len(self.layer_types) != self.num_layers:
                raise UnsupportedModelError(f"{self.name}: layer_types has {len(self.layer_types)} entries is not "
                                            f"supported; one per layer (num_hidden_layers {self.num_layers})")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise UnsupportedModelError(f"{self.name}: sliding_window = {self.sliding_window!r} is not supported; "
                                        "a whole number of tokens >= 1, or null")
        if self.num_heads % self.num_kv_heads != 0:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attention_scale(self) -> float:
        """The softmax scale: ``query_pre_attn_scalar ** -0.5`` (Gemma) else ``head_dim ** -0.5``."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5
