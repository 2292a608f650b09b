"""Architecture description of a Llama-family decoder, read from GGUF metadata or a HF
``config.json``."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

# HF ``architectures`` entries and GGUF ``general.architecture`` values we can run.
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
# Mixture-of-experts architectures (kvpilot.engine.model.moe for the sparse layers).
MOE_ARCHITECTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
# MoE routing options that are not the softmax top-k implemented here: refused by name.
# How router logits become expert weights (HF's / DeepSeek's ``scoring_func``).
MOE_SCORING_FUNCS = ("softmax", "sigmoid")
REFUSED_MOE_ROUTING = ("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor",
                       "e_score_correction_bias", "n_shared_experts")
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma2", "gemma3")
# Architectures whose decoder is kvpilot.engine.model.gemma (the rest run llama.py).
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
# HF architectures refused with a specific reason rather than the generic list.
REFUSED_HF_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "the vision-language Gemma 3 (4B/12B/27B) is not supported; "
    "text-only Gemma3ForCausalLM checkpoints (gemma-3-1b, or a language model extracted from the "
    "multimodal one) are",
}


class UnsupportedModelError(ValueError):
    """The model exists but is not something this engine can run."""


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


def _moe_gguf_fields(meta: dict[str, Any], tensor_names: set[str], name: str, arch: str) -> dict[str, Any]:
    """The MoE fields from GGUF metadata (llama.cpp's keys): ``<arch>.expert_count``,
    ``expert_used_count``, ``expert_feed_forward_length`` (Qwen; Mixtral's experts are
    ``feed_forward_length`` wide), ``expert_shared_feed_forward_length`` (Qwen2-MoE),
    ``expert_weights_norm`` (llama.cpp's defaults: Qwen3-MoE and Mixtral renormalise,
    Qwen2-MoE does not). Dense layers are those without a router tensor
    (``blk.N.ffn_gate_inp.weight``).

    Raises:
        UnsupportedModelError: no expert count, a used count outside ``1..count``, or a
            gating function other than softmax (``expert_gating_func``).
    """
    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    experts, top_k = key("expert_count"), key("expert_used_count")
    if not experts or not top_k or not 1 <= int(top_k) <= int(experts):
        raise UnsupportedModelError(f"{name}: {arch}.expert_count = {experts!r}, {arch}.expert_used_count = "
                                    f"{top_k!r} is not supported; 1 <= expert_used_count <= expert_count")
    gating = key("expert_gating_func")
    # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX = 1, _SIGMOID = 2 (3, softmax over
    # the chosen experts' logits only, is not implemented).
    if gating not in (None, 1, 2):
        raise UnsupportedModelError(f"{name}: {arch}.expert_gating_func = {gating!r} is not supported; "
                                    "softmax (1) or sigmoid (2)")
    scale = key("expert_weights_scale")
    if scale is not None and float(scale) != 1.0:  # DeepSeek's routed_scaling_factor
        raise UnsupportedModelError(f"{name}: {arch}.expert_weights_scale = {scale!r} is not supported; 1.0 "
                                    "(routing weights are not scaled)")
    layers = int(key("block_count"))
    dense = tuple(i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
    fields: dict[str, Any] = dict(
        num_experts=int(experts), num_experts_per_tok=int(top_k),
        moe_intermediate_size=int(key("expert_feed_forward_length") or key("feed_forward_length")),
        norm_topk_prob=bool(key("expert_weights_norm", arch != "qwen2moe")), mlp_only_layers=dense,
        moe_scoring_func="sigmoid" if gating == 2 else "softmax")
    if arch == "qwen2moe":
        fields["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length", 0))
    return fields


# GGUF ``<arch>.rope.scaling.type`` values implemented (llama.cpp's names); Phi-3's
# LongRoPE is written without a type, as ``rope_factors_long``/``rope_factors_short`` tensors.
SUPPORTED_GGUF_ROPE_SCALING = ("none", "linear", "yarn", "longrope")


def _gguf_rope_scaling(meta: dict[str, Any], tensor_names: set[str], name: str, arch: str) -> dict[str, Any] | None:
    """The HF-style ``rope_scaling`` dict of a GGUF file (llama.cpp's keys), or None.

    - ``rope.scaling.type`` ``linear``: ``rope.scaling.factor``;
    - ``yarn``: ``factor``, ``rope.scaling.original_context_length`` (default
      ``context_length``, as llama.cpp), ``rope.scaling.yarn_beta_fast`` /
      ``yarn_beta_slow`` (default 32 / 1) and ``yarn_attn_factor`` (transformers'
      ``attention_factor``, written from it by convert_hf_to_gguf.py);
    - LongRoPE (Phi-3; ``rope_factors_long.weight`` / ``rope_factors_short.weight`` tensors,
      type ``longrope`` or none): ``original_context_length`` and ``rope.scaling.attn_factor``;
      :meth:`kvpilot.engine.model.loader.GGUFModelFile.model_config` fills in the two
      factor lists from the tensors.

    Raises:
        UnsupportedModelError: another scaling type, a YaRN extrapolation factor other
            than 1, a YaRN log multiplier (DeepSeek's mscale), a missing factor, an
            attention factor outside LongRoPE, or LongRoPE without both factor tensors.
    """
    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    def refuse(k: str, value: Any, supported: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{name}: {arch}.{k} = {value!r} is not supported; {supported}")

    kind = key("rope.scaling.type")
    if kind not in (None, *SUPPORTED_GGUF_ROPE_SCALING):
        raise refuse("rope.scaling.type", kind, f"supported: {', '.join(SUPPORTED_GGUF_ROPE_SCALING)} (and LongRoPE "
                     "factor tensors)")
    orig = key("rope.scaling.original_context_length") or key("context_length", 4096)
    factors = {"rope_factors_long.weight", "rope_factors_short.weight"} & tensor_names
    attn_factor = key("rope.scaling.attn_factor")
    if kind == "longrope" or factors:
        if len(factors) != 2:
            raise refuse("rope.scaling.type", kind or "longrope", "LongRoPE needs both rope_factors_long.weight and "
                         f"rope_factors_short.weight tensors; the file has {sorted(factors) or 'neither'}")
        return {"rope_type": "longrope", "original_max_position_embeddings": int(orig),
                "attention_factor": float(attn_factor) if attn_factor is not None else None}
    if attn_factor is not None and float(attn_factor) != 1.0:
        raise refuse("rope.scaling.attn_factor", attn_factor, "an attention factor other than 1.0 is implemented with "
                     "LongRoPE factor tensors only")
    factor = key("rope.scaling.factor")
    if kind is None:
        # llama.cpp's default type is linear: a bare factor (or the older
        # rope.scale_linear) still scales.
        factor = factor if factor is not None else key("rope.scale_linear")
        if factor is None or float(factor) == 1.0:
            return None
        kind = "linear"
    if kind == "none":
        return None
    if factor is None or float(factor) <= 0:
        raise refuse("rope.scaling.factor", factor, f"rope.scaling.type {kind!r} needs a positive factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    ext = key("rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) != 1.0:
        raise refuse("rope.scaling.yarn_ext_factor", ext, "YaRN with extrapolation factor 1.0 (transformers' YaRN)")
    log_mul = key("rope.scaling.yarn_log_multiplier")
    if log_mul is not None and float(log_mul) != 0.0:
        raise refuse("rope.scaling.yarn_log_multiplier", log_mul, "YaRN without mscale_all_dim (0.0 or absent)")
    out: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(orig)}
    for gguf_key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                             ("yarn_attn_factor", "attention_factor")):
        value = key(f"rope.scaling.{gguf_key}")
        if value is not None:
            out[hf_key] = float(value)
    return out


def _gguf_layer_types(meta: dict[str, Any], name: str, arch: str, num_layers: int,
                      default_pattern: int) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` of a Gemma 2/3 GGUF: ``<arch>.attention.sliding_window``
    (absent or 0: no window) and ``attention.sliding_window_pattern``, either llama.cpp's
    period ``n`` (layer ``i`` slides iff ``i % n < n - 1``; 0: every layer) or one bool
    per layer; absent, llama.cpp's built-in period: 2 for Gemma 2, 6 for Gemma 3.

    Raises:
        UnsupportedModelError: a per-layer pattern of the wrong length.
    """
    window = gguf_window(meta, arch, name)
    if window is None:
        return None, None
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", default_pattern)
    if isinstance(pattern, (list, tuple)):
        if len(pattern) != num_layers:
            raise UnsupportedModelError(f"{name}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                                        f"is not supported; one per layer ({num_layers})")
        slides = [bool(s) for s in pattern]
    else:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
            raise UnsupportedModelError(f"{name}: {arch}.attention.sliding_window_pattern = {pattern!r} is not "
                                        "supported; an integer >= 0 or one bool per layer")
        n = pattern
        slides = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    if not any(slides):
        return None, None
    return window, tuple("sliding_attention" if s else "full_attention" for s in slides)


def gguf_window(meta: dict[str, Any], arch: str, name: str) -> int | None:
    """``<arch>.attention.sliding_window`` in tokens, None when absent or 0.

    Raises:
        UnsupportedModelError: a value that is not a whole number >= 0.
    """
    window = meta.get(f"{arch}.attention.sliding_window")
    if window is None or (not isinstance(window, bool) and window == 0):
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(f"{name}: {arch}.attention.sliding_window = {window!r} is not supported; "
                                    "a whole number of tokens >= 1 (0: no window)")
    return window


def _gemma_gguf_fields(meta: dict[str, Any], name: str, arch: str, num_layers: int, hidden: int, num_heads: int,
                       head_dim: int) -> dict[str, Any]:
    """The Gemma 2/3 fields of a GGUF file, as llama.cpp reads them: the window and layer
    pattern (:func:`_gguf_layer_types`); the softmax scale ``<arch>.attention.scale`` if
    present, else llama.cpp's rule (``hidden / heads`` for the 27B models, 46 layers on
    Gemma 2 and 62 on Gemma 3, else ``head_dim``, matching their ``query_pre_attn_scalar``);
    ``attn_logit_softcapping`` / ``final_logit_softcapping`` (Gemma 2 default 50 / 30);
    Gemma 3's sliding-layer RoPE base ``rope.freq_base_swa`` (default 10000)."""
    def key(k: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{k}", default)

    window, layer_types = _gguf_layer_types(meta, name, arch, num_layers, 2 if arch == "gemma2" else 6)
    scale = key("attention.scale")
    if scale:
        scalar = float(scale) ** -2
    else:
        big = num_layers == (46 if arch == "gemma2" else 62)
        scalar = float(hidden // num_heads if big else head_dim)
    softcaps = (50.0, 30.0) if arch == "gemma2" else (None, None)
    attn_cap = key("attn_logit_softcapping", softcaps[0])
    final_cap = key("final_logit_softcapping", softcaps[1])
    return dict(
        hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=scalar, sliding_window=window, layer_types=layer_types,
        attn_logit_softcapping=float(attn_cap) if attn_cap else None,
        final_logit_softcapping=float(final_cap) if final_cap else None,
        rope_local_theta=float(key("rope.freq_base_swa", 10000.0)) if arch == "gemma3" else None)


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

    # ---------------------------------------------------------------- GGUF
    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], tensor_names: set[str], name: str) -> ModelConfig:
        """Build from GGUF key/values (``general.architecture``, ``<arch>.block_count``...),
        as llama.cpp's convert_hf_to_gguf.py writes them: llama (Mixtral with experts),
        qwen2, qwen3, qwen2moe, qwen3moe, phi3, gemma2, gemma3. RoPE scaling:
        :func:`_gguf_rope_scaling`; Gemma: :func:`_gemma_gguf_fields`; Phi-3 slides every
        layer when ``attention.sliding_window`` is above 0.

        Raises:
            UnsupportedModelError: another architecture, or a key whose value the model
                code does not implement (named with its value and what is supported).
        """
        arch = meta.get("general.architecture")
        if arch not in SUPPORTED_GGUF_ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_GGUF_ARCHITECTURES)}"
            )

        def key(k: str, default: Any = None) -> Any:
            return meta.get(f"{arch}.{k}", default)

        experts = key("expert_count")
        moe: dict[str, Any] = {}
        if arch in ("qwen2moe", "qwen3moe") or experts:
            moe = _moe_gguf_fields(meta, tensor_names, name, arch)
        rope_scaling = _gguf_rope_scaling(meta, tensor_names, name, arch)

        num_heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        num_layers = int(key("block_count"))
        vocab = key("vocab_size")
        if vocab is None:
            vocab = len(meta.get("tokenizer.ggml.tokens", []))
        eos = meta.get("tokenizer.ggml.eos_token_id")
        eos_ids = [int(eos)] if eos is not None else []
        eot = meta.get("tokenizer.ggml.eot_token_id")
        if eot is not None and int(eot) not in eos_ids:
            eos_ids.append(int(eot))
        # llama.cpp: the head is key_length wide (default hidden / heads); rope.dimension_count
        # says how much of it rotates.
        head_dim = int(key("attention.key_length") or hidden // num_heads)
        for k in ("attention.value_length", "rope.dimension_count"):
            if key(k) is not None and int(key(k)) != head_dim:
                what = "values as wide as keys" if k == "attention.value_length" else "rotary over the whole head"
                raise UnsupportedModelError(f"{name}: {arch}.{k} = {key(k)!r} is not supported; {what} "
                                            f"(head_dim {head_dim})")
        family: dict[str, Any] = {}
        if arch in GEMMA_ARCHITECTURES:
            family = _gemma_gguf_fields(meta, name, arch, num_layers, hidden, num_heads, head_dim)
        elif arch == "phi3" and gguf_window(meta, arch, name) is not None:
            family = dict(sliding_window=gguf_window(meta, arch, name))
        elif gguf_window(meta, arch, name) is not None:  # llama.cpp runs these archs unwindowed
            raise UnsupportedModelError(f"{name}: {arch}.attention.sliding_window = "
                                        f"{meta[f'{arch}.attention.sliding_window']!r} is not supported for arch "
                                        f"{arch!r}; sliding windows load from phi3, gemma2 and gemma3 GGUFs or "
                                        "from the HF folder")
        if arch not in GEMMA_ARCHITECTURES and key("attention.scale") is not None \
                and abs(float(key("attention.scale")) - head_dim ** -0.5) > 1e-6 * head_dim ** -0.5:
            raise UnsupportedModelError(f"{name}: {arch}.attention.scale = {key('attention.scale')!r} is not "
                                        f"supported; head_dim ** -0.5 ({head_dim ** -0.5:.6g}) or absent")
        bos = meta.get("tokenizer.ggml.bos_token_id")
        return cls(
            architecture={"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}.get(arch, "mixtral" if experts else arch),
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=int(key("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            max_position_embeddings=int(key("context_length", 4096)),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names or "blk.0.attn_qkv.bias" in tensor_names,
            o_proj_bias="blk.0.attn_output.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
            rope_scaling=rope_scaling,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=tuple(eos_ids),
            name=name,
            **family,
            **moe,
        )
