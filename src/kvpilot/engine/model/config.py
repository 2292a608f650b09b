"""Architecture description of a Llama-family decoder, read from GGUF metadata or a HF
``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# HF ``architectures`` entries and GGUF ``general.architecture`` values we can run.
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")


class UnsupportedModelError(ValueError):
    """The model exists but is not something this engine can run."""


# config.json fields that change the math, and the values the model code implements. A
# checkpoint asking for anything else is refused by name: loading it would run other math
# than it was trained with, and answer wrongly without a word.
SUPPORTED_ACTIVATIONS = ("silu", "swish")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def check_hf_config(cfg: dict[str, Any], where: str) -> None:
    """Refuse a config.json that asks for math the model code does not do.

    Raises:
        UnsupportedModelError: naming ``where`` (the file), the key, its value and what
            is supported.
    """
    def refuse(key: str, value: Any, supported: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{where}: {key} = {value!r} is not supported; {supported}")

    for key in ("hidden_act", "hidden_activation"):
        act = cfg.get(key)
        if act is not None and act not in SUPPORTED_ACTIVATIONS:
            raise refuse(key, act, f"supported: {', '.join(SUPPORTED_ACTIVATIONS)} (SwiGLU MLP)")
    if cfg.get("mlp_bias"):
        raise refuse("mlp_bias", cfg["mlp_bias"], "the MLP projections have no bias here (false)")
    quant = cfg.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "unknown") if isinstance(quant, dict) else quant
        raise refuse("quantization_config.quant_method", method,
                     "weight quantization is not supported: use the unquantized checkpoint"
                     " (KV-cache quantization is --kv-cache-dtype)")
    for key, holder in (("partial_rotary_factor", cfg), ("rope_parameters.partial_rotary_factor",
                                                         cfg.get("rope_parameters"))):
        partial = holder.get("partial_rotary_factor") if isinstance(holder, dict) else None
        if partial is not None and float(partial) != 1.0:
            raise refuse(key, partial, "rotary embeddings cover the whole head (1.0)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None:
            raise refuse(key, cfg[key], "logit soft-capping is not implemented (null)")
    for key in ("rope_scaling", "rope_parameters"):
        scaling = cfg.get(key)
        if isinstance(scaling, dict):
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in SUPPORTED_ROPE_TYPES:
                raise refuse(f"{key}.rope_type", kind, f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of the decoder.

    Attributes:
        architecture: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` or ``phi3``.
        head_dim: per-head size (``hidden_size // num_heads`` unless given).
        attention_bias: q/k/v projections have a bias (Qwen2; Llama's ``attention_bias``).
        o_proj_bias: the output projection has a bias too (Llama's ``attention_bias``).
        qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3's ``q_norm``/``k_norm``).
        rope_scaling: HF ``rope_scaling`` dict (``llama3`` type supported) or None.
        rope_freq_factors: per-frequency divisors from a GGUF ``rope_freqs`` tensor.
        eos_token_ids: tokens that end generation.
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
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    name: str = "model"

    def __post_init__(self) -> None:
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

    # ------------------------------------------------------------------ HF
    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` in a HF model folder.

        Raises:
            UnsupportedModelError: the architecture is not Llama/Mistral/Qwen2/Qwen3/Phi-3, or
                the config asks for math the model does not do (:func:`check_hf_config`).
        """
        path = Path(path)
        cfg = json.loads((path / "config.json").read_text())
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_HF_ARCHITECTURES[a] for a in archs if a in SUPPORTED_HF_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"{path}/config.json declares architectures {archs}; supported: "
                f"{sorted(SUPPORTED_HF_ARCHITECTURES)}"
            )
        check_hf_config(cfg, f"{path}/config.json")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        rope_scaling = cfg.get("rope_scaling")
        params = cfg.get("rope_parameters")  # transformers >= 5 spelling
        if rope_theta is None and isinstance(params, dict):
            rope_theta = params.get("rope_theta")
            if params.get("rope_type", "default") != "default":
                rope_scaling = params
        # Mistral and Phi-3 slide whenever sliding_window is set; Qwen2/3 only with
        # use_sliding_window. Sliding attention is not implemented: the window caps the
        # context (model_runner), which keeps the math exact.
        sliding = (cfg.get("sliding_window")
                   if cfg.get("use_sliding_window", arch in ("mistral", "phi3")) else None)
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            # Llama's attention_bias also puts a bias on o_proj; Qwen2's bias is q/k/v only.
            o_proj_bias=arch != "qwen2" and bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            rope_scaling=rope_scaling,
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=path.name,
        )

    # ---------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str], name: str) -> ModelConfig:
        """Build from GGUF key/values (``general.architecture``, ``<arch>.block_count``...).

        Raises:
            UnsupportedModelError: an architecture other than llama/qwen2.
        """
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_GGUF_ARCHITECTURES)}"
            )

        def key(k: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{k}", default)

        experts = key("expert_count")
        if experts:
            raise UnsupportedModelError(f"{name}: {arch}.expert_count = {experts} (a mixture of experts)"
                                        " is not supported; dense models only")
        scaling_type = key("rope.scaling.type")
        if scaling_type not in (None, "none", "linear"):
            raise UnsupportedModelError(f"{name}: {arch}.rope.scaling.type = {scaling_type!r} is not"
                                        " supported; supported: none, linear")

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        vocab = key("vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", []))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos)] if eos is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // num_heads
        rope_scaling = None
        if key("rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": key("rope.scaling.type"), "factor": key("rope.scaling.factor")}
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=int(key("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=int(head_dim),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_scaling=rope_scaling,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos_ids),
            name=name,
        )
