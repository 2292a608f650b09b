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
}
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2")


class UnsupportedModelError(ValueError):
    """The model exists but is not something this engine can run."""


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of the decoder.

    Attributes:
        architecture: ``llama``, ``mistral`` or ``qwen2``.
        head_dim: per-head size (``hidden_size // num_heads`` unless given).
        attention_bias: q/k/v projections have a bias (Qwen2).
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
            UnsupportedModelError: the architecture is not Llama/Mistral/Qwen2.
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
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", arch == "mistral") else None
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
        if key("rope.scaling.type") in ("linear", "yarn"):
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
            rope_scaling=rope_scaling,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos_ids),
            name=name,
        )
