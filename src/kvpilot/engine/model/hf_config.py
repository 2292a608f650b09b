"""Reading a HF ``config.json`` into a :class:`~kvpilot.engine.model.config.ModelConfig`,
and refusing by name what the model code does not implement.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvpilot.engine.model.config import (
    GEMMA_ARCHITECTURES,
    MOE_ARCHITECTURES,
    MOE_SCORING_FUNCS,
    ModelConfig,
    UnsupportedModelError,
)

# HF ``architectures`` entries we can run, and our name for each.
SUPPORTED_HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
# MoE routing options that are not the softmax top-k implemented here: refused by name.
REFUSED_MOE_ROUTING = ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor",
                       "e_score_correction_bias", "n_shared_experts")
# HF architectures refused with a specific reason rather than the generic list.
REFUSED_HF_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "the vision-language Gemma 3 (4B/12B/27B) is not supported; "
    "text-only Gemma3ForCausalLM checkpoints (gemma-3-1b, or a language model extracted from the "
    "multimodal one) are",
}


# config.json fields that change the math, and the values the model code implements. A
# checkpoint asking for anything else is refused by name: loading it would run other math
# than it was trained with, and answer wrongly without a word.
SUPPORTED_ACTIVATIONS = ("silu", "swish")
# Gemma's GeGLU with the tanh approximation of GELU (HF's ACT2FN name).
GEMMA_ACTIVATIONS = ("gelu_pytorch_tanh",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def check_hf_config(cfg: dict[str, Any], where: str, arch: str | None = None) -> None:
    """Refuse a config.json that asks for math the model code does not do.

    ``arch`` (our name, ``gemma2``...) unlocks what only that architecture implements:
    the Gemma models' GeGLU activation and logit soft-capping.

    Raises:
        UnsupportedModelError: naming ``where`` (the file), the key, its value and what
            is supported.
    """
    def refuse(key: str, value: Any, supported: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{where}: {key} = {value!r} is not supported; {supported}")

    gemma = arch in GEMMA_ARCHITECTURES
    for key in REFUSED_MOE_ROUTING:  # DeepSeek-style grouped / biased / sigmoid routing
        value = cfg.get(key)
        if value is None or (key == "scoring_func" and value in MOE_SCORING_FUNCS and arch in MOE_ARCHITECTURES) \
                or (key == "topk_method" and value == "greedy") \
                or (key in ("n_group", "topk_group") and value == 1) or (key == "routed_scaling_factor" and value == 1.0) \
                or (key == "n_shared_experts" and value == 0):
            continue
        raise refuse(key, value, "MoE routing is top-k over all experts (scoring_func softmax or sigmoid on "
                     "a MoE architecture, topk_method greedy, no expert groups, bias or scaling)")
    for key in ("hidden_act", "hidden_activation"):
        act = cfg.get(key)
        if act is None:
            continue
        if gemma and act not in GEMMA_ACTIVATIONS:
            raise refuse(key, act, f"supported for Gemma: {', '.join(GEMMA_ACTIVATIONS)} (GeGLU MLP)")
        if not gemma and act not in SUPPORTED_ACTIVATIONS:
            raise refuse(key, act, f"supported: {', '.join(SUPPORTED_ACTIVATIONS)} (SwiGLU MLP)")
    if cfg.get("mlp_bias") and arch != "llama":
        raise refuse("mlp_bias", cfg["mlp_bias"], "MLP biases are implemented for LlamaForCausalLM only (false)")
    for key, holder in (("partial_rotary_factor", cfg), ("rope_parameters.partial_rotary_factor",
                                                         cfg.get("rope_parameters"))):
        partial = holder.get("partial_rotary_factor") if isinstance(holder, dict) else None
        if partial is not None and float(partial) != 1.0:
            raise refuse(key, partial, "rotary embeddings cover the whole head (1.0)")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key) is not None and not gemma:
            raise refuse(key, cfg[key], "logit soft-capping is implemented for Gemma 2/3 only (null)")
    if gemma and cfg.get("use_bidirectional_attention"):
        raise refuse("use_bidirectional_attention", cfg["use_bidirectional_attention"],
                     "causal attention only (false)")
    for key in ("rope_scaling", "rope_parameters"):
        scaling = cfg.get(key)
        if not isinstance(scaling, dict):
            continue
        # Gemma 3 in transformers >= 5: one dict per layer type.
        nested = {k: v for k, v in scaling.items() if k in ("sliding_attention", "full_attention")}
        for sub, params in (nested.items() if nested else (("", scaling),)):
            if not isinstance(params, dict):
                continue
            kind = params.get("rope_type", params.get("type", "default"))
            prefix = f"{key}.{sub}" if sub else key
            if kind not in SUPPORTED_ROPE_TYPES:
                raise refuse(f"{prefix}.rope_type", kind, f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
            _check_rope_numbers(params, kind, prefix, refuse)


# RoPE scaling parameters that are numbers (transformers' rope_config_validation), and
# those that must be above zero (a factor or a temperature of 0 or below is no scaling).
_ROPE_NUMBERS = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
                 "beta_slow", "mscale", "mscale_all_dim")
_ROPE_POSITIVE = ("factor", "low_freq_factor", "high_freq_factor", "attention_factor", "beta_fast",
                  "beta_slow")


def _check_rope_numbers(params: dict[str, Any], kind: str, prefix: str,
                        refuse: Callable[[str, Any, str], UnsupportedModelError]) -> None:
    """Refuse RoPE scaling parameters the frequencies cannot be computed from: a number
    given as a string or a bool, one that is not finite, a factor or temperature <= 0, a
    ``linear``/``llama3``/``dynamic`` scaling without its factor, ``high_freq_factor`` not
    above ``low_freq_factor`` (llama3 divides by their difference), a non-positive whole
    ``original_max_position_embeddings``, or LongRoPE factor lists that are not lists of
    positive numbers (their length is checked against the head in rotary.py)."""
    def number(v: Any) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)

    for name in _ROPE_NUMBERS:
        value = params.get(name)
        if value is None:
            continue
        if not number(value):
            raise refuse(f"{prefix}.{name}", value, "a finite number")
        if name in _ROPE_POSITIVE and value <= 0:
            raise refuse(f"{prefix}.{name}", value, "a number above 0")
    if kind in ("linear", "llama3", "dynamic") and params.get("factor") is None:
        raise refuse(f"{prefix}.factor", None, f"rope_type {kind!r} needs a factor (a number above 0)")
    if kind == "llama3":
        low, high = params.get("low_freq_factor", 1.0), params.get("high_freq_factor", 4.0)
        if high <= low:
            raise refuse(f"{prefix}.high_freq_factor", high,
                         f"a number above low_freq_factor ({low}): llama3 blends between the two")
    original = params.get("original_max_position_embeddings")
    if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
        raise refuse(f"{prefix}.original_max_position_embeddings", original, "a whole number of tokens >= 1")
    for name in ("short_factor", "long_factor"):
        factors = params.get(name)
        if factors is not None and (not isinstance(factors, list)
                                    or not all(number(f) and f > 0 for f in factors)):
            raise refuse(f"{prefix}.{name}", factors, "a list of numbers above 0 (head_dim / 2 of them)")


def normalize_rope_scaling(scaling: dict[str, Any] | None, cfg: dict[str, Any]) -> dict[str, Any] | None:
    """A copy of a HF ``rope_scaling`` dict with ``rope_type`` set (also from the older
    ``type`` key) and, for the types that need it,
    ``original_max_position_embeddings`` filled in as transformers'
    ``standardize_rope_params`` does: a top-level config value first (Phi-3 keeps it
    there), then the dict's own, then ``max_position_embeddings``. None stays None."""
    if not isinstance(scaling, dict):
        return None
    out = dict(scaling)
    kind = out.get("rope_type", out.get("type", "default"))
    out["rope_type"] = kind
    if out["rope_type"] in ("llama3", "yarn", "longrope"):
        if cfg.get("original_max_position_embeddings") is not None:
            out["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
        elif out.get("original_max_position_embeddings") is None:
            out["original_max_position_embeddings"] = cfg.get("max_position_embeddings", 4096)
    return out


def _gemma_hf_fields(cfg: dict[str, Any], arch: str, where: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The Gemma 2/3 parts of a ``config.json``: ``(cfg with HF's class defaults filled in,
    the Gemma-only ModelConfig fields)``.

    Defaults are those of transformers' ``Gemma2Config`` / ``Gemma3TextConfig`` for keys
    the file omits: ``head_dim`` 256, tied embeddings, ``sliding_window`` 4096,
    ``query_pre_attn_scalar`` 256, soft-capping 50 (attention) / 30 (final) on Gemma 2 and
    none on Gemma 3, and ``layer_types``: Gemma 2 layer ``i`` slides iff ``i`` is even,
    Gemma 3 iff ``(i + 1) % sliding_window_pattern != 0`` (pattern 6). Gemma 3's RoPE:
    full layers ``rope_theta`` (1e6) with ``rope_scaling``, sliding layers
    ``rope_local_base_freq`` (1e4); transformers >= 5 writes both as
    ``rope_parameters: {"full_attention": {...}, "sliding_attention": {...}}``.

    Raises:
        UnsupportedModelError: RoPE scaling on Gemma 3's sliding layers (not implemented).
    """
    cfg = dict(cfg)
    n = int(cfg["num_hidden_layers"])
    cfg.setdefault("head_dim", 256)
    cfg.setdefault("tie_word_embeddings", True)
    cfg.setdefault("sliding_window", 4096)
    cfg["use_sliding_window"] = cfg.get("sliding_window") is not None
    if not cfg.get("layer_types"):
        if arch == "gemma2":
            cfg["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        else:
            pattern = int(cfg.get("sliding_window_pattern") or 6)
            cfg["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    softcaps = {"gemma2": (50.0, 30.0), "gemma3": (None, None)}[arch]
    fields: dict[str, Any] = {
        "hidden_act": cfg.get("hidden_activation") or "gelu_pytorch_tanh",
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping", softcaps[0]),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", softcaps[1]),
    }
    if arch == "gemma3":
        params = cfg.get("rope_parameters")
        if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
            full = dict(params.get("full_attention") or {})
            local = dict(params.get("sliding_attention") or {})
        else:
            full = dict(cfg.get("rope_scaling") or params or {})
            full.setdefault("rope_theta", cfg.get("rope_theta"))
            local = {"rope_theta": cfg.get("rope_local_base_freq")}
        local_kind = local.get("rope_type", local.get("type", "default"))
        if local_kind != "default":
            raise UnsupportedModelError(f"{where}: rope_parameters.sliding_attention.rope_type = {local_kind!r} is "
                                        "not supported; the sliding layers take default RoPE")
        theta = full.pop("rope_theta", None)
        cfg["rope_theta"] = float(theta if theta is not None else 1_000_000.0)
        kind = full.get("rope_type", full.get("type", "default"))
        cfg["rope_scaling"] = full if kind != "default" else None
        cfg.pop("rope_parameters", None)
        theta = local.get("rope_theta")
        fields["rope_local_theta"] = float(theta if theta is not None else 10_000.0)
    return cfg, fields


def _moe_hf_fields(cfg: dict[str, Any], arch: str, where: str) -> dict[str, Any]:
    """The MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE ``config.json`` (HF's class
    defaults where a key is absent); ``{}`` for dense architectures.

    Raises:
        UnsupportedModelError: ``num_experts_per_tok`` outside ``1..num_experts``.
    """
    if arch not in MOE_ARCHITECTURES:
        return {}
    if arch == "mixtral":  # every layer sparse, experts as wide as intermediate_size
        experts, top_k = cfg.get("num_local_experts", 8), cfg.get("num_experts_per_tok", 2)
        fields = dict(moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
    else:
        # transformers >= 5 writes Qwen3-MoE's num_experts as num_local_experts.
        experts = cfg.get("num_experts", cfg.get("num_local_experts", 60 if arch == "qwen2_moe" else 128))
        top_k = cfg.get("num_experts_per_tok", 4 if arch == "qwen2_moe" else 8)
        fields = dict(moe_intermediate_size=cfg.get("moe_intermediate_size", 1408 if arch == "qwen2_moe" else 768),
                      norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                      decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                      mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
        if arch == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = int(cfg.get("shared_expert_intermediate_size", 5632))
    if not 1 <= int(top_k) <= int(experts):
        raise UnsupportedModelError(f"{where}: num_experts_per_tok = {top_k!r} is not supported; "
                                    f"1..num_experts ({experts})")
    fields["moe_scoring_func"] = cfg.get("scoring_func") or "softmax"  # checked in check_hf_config
    return dict(num_experts=int(experts), num_experts_per_tok=int(top_k), **fields)


def read_hf_config(path: str | Path) -> ModelConfig:
    """Read ``config.json`` in a HF model folder.

    Raises:
        UnsupportedModelError: the architecture is not Llama/Mistral/Qwen2/Qwen3/Phi-3, or
            the config asks for math the model does not do (:func:`check_hf_config`).
    """
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = next((SUPPORTED_HF_ARCHITECTURES[a] for a in archs if a in SUPPORTED_HF_ARCHITECTURES), None)
    refused = next((a for a in archs if a in REFUSED_HF_ARCHITECTURES), None)
    if arch is None and refused is not None:
        raise UnsupportedModelError(f"{path}/config.json: architectures = {archs!r}: "
                                    f"{REFUSED_HF_ARCHITECTURES[refused]}")
    if arch is None:
        raise UnsupportedModelError(
            f"{path}/config.json declares architectures {archs}; supported: "
            f"{sorted(SUPPORTED_HF_ARCHITECTURES)}"
        )
    check_hf_config(cfg, f"{path}/config.json", arch)
    gemma: dict[str, Any] = {}
    if arch in GEMMA_ARCHITECTURES:
        cfg, gemma = _gemma_hf_fields(cfg, arch, f"{path}/config.json")
    num_heads = cfg["num_attention_heads"]
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    rope_theta = cfg.get("rope_theta")
    rope_scaling = cfg.get("rope_scaling")
    params = cfg.get("rope_parameters")  # transformers >= 5 spelling
    if rope_theta is None and isinstance(params, dict):
        rope_theta = params.get("rope_theta")
        if params.get("rope_type", params.get("type", "default")) != "default":
            rope_scaling = params
    rope_scaling = normalize_rope_scaling(rope_scaling, cfg)
    # Mistral and Phi-3 slide whenever sliding_window is set (every layer); Qwen2/3
    # only with use_sliding_window, and then (transformers' Qwen2Config) layer i slides
    # iff i >= max_window_layers. config.json's layer_types, when present, wins.
    window = cfg.get("sliding_window")
    if window not in (None, 0) and arch == "llama":
        raise UnsupportedModelError(f"{path}/config.json: sliding_window = {window!r} is not supported for "
                                    "LlamaForCausalLM (null); a sliding-window model declares "
                                    "MistralForCausalLM or another architecture that has one")
    # Checked only where it is used (Qwen configs carry an unused one, some of them 0).
    sliding = (window if cfg.get("use_sliding_window", arch in ("mistral", "phi3", "mixtral")) else None)
    if sliding is not None and (isinstance(sliding, bool) or not isinstance(sliding, int) or sliding < 1):
        raise UnsupportedModelError(f"{path}/config.json: sliding_window = {sliding!r} is not supported; "
                                    "a whole number of tokens >= 1, or null")
    layer_types = cfg.get("layer_types")
    if layer_types is None and sliding is not None and arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        first = int(cfg.get("max_window_layers", 28))
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(cfg["num_hidden_layers"])]
    if layer_types is not None and "sliding_attention" not in layer_types:
        sliding = None
    moe = _moe_hf_fields(cfg, arch, f"{path}/config.json")
    return ModelConfig(
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
        attention_bias=(arch == "qwen2" or bool(cfg.get("attention_bias", False))
                        or (arch == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))),
        # Llama's attention_bias also puts a bias on o_proj; Qwen2's bias is q/k/v only.
        o_proj_bias=arch not in ("qwen2", "qwen2_moe") and bool(cfg.get("attention_bias", False)),
        mlp_bias=bool(cfg.get("mlp_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe", "gemma3"),
        rope_scaling=rope_scaling,
        sliding_window=sliding,
        layer_types=tuple(layer_types) if layer_types is not None and sliding is not None else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        name=path.name,
        **gemma,
        **moe,
    )
