"""Reading GGUF metadata (llama.cpp's keys) into a
:class:`~kvpilot.engine.model.config.ModelConfig`, and refusing by name what the model
code does not implement.
"""

from __future__ import annotations

from typing import Any

from kvpilot.engine.model.config import GEMMA_ARCHITECTURES, ModelConfig, UnsupportedModelError

# GGUF ``general.architecture`` values we can run.
SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe", "phi3", "gemma2", "gemma3")


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


def read_gguf_metadata(meta: dict[str, Any], tensor_names: set[str], name: str) -> ModelConfig:
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
    return ModelConfig(
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
