"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a packed varlen batch.

Inputs are flat: ``input_ids`` and ``positions`` are ``[num_tokens]`` for the whole step
(decodes and prefill chunks of many requests); attention goes through the pluggable
backend and the paged KV cache. Q/K/V and gate/up projections are fused into single
matrices when the weights are loaded.

The layers themselves (norms, attention, MLP, embeddings, LM head, packed linears) are
:mod:`kvpilot.engine.model.layers`; this module wires them into the decoder and maps a
checkpoint's tensor names onto them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from kvpilot.engine.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvpilot.engine.model.config import ModelConfig
from kvpilot.engine.model.layers import (
    MLP,
    Attention,
    ForwardContext,
    PackedLinear,
    QuantizedEmbedding,
    QuantizedLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    lm_head_logits,
    pack_linears,
    set_tensor_parallel,
)
from kvpilot.engine.model.moe import SparseMoeBlock
from kvpilot.engine.model.rotary import RotaryEmbedding
from kvpilot.engine.quantization.weights import QuantizedWeight

if TYPE_CHECKING:
    from kvpilot.engine.model.layers import TPGroup


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = SparseMoeBlock(config) if config.is_moe_layer(layer_idx) else MLP(config)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, residual)`` in, ``(mlp output, residual stream)`` out: the layer's output
        is their sum, which the next layer's input norm (or the final norm) forms."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h, ctx.ops)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual, ctx.ops)
        h = self.self_attn(h, ctx)
        h, residual = self.post_attention_layernorm.add_forward(h, residual, ctx.ops)
        return self.mlp(h, ctx.ops), residual


# HF checkpoint names of the projections we fuse: (fused module, shard index).
_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
# FP8 KV-cache scales in checkpoints (stored = x / scale): compressed-tensors/llm-compressor
# ``self_attn.{k,v}_scale``, AutoFP8 ``self_attn.kv_scale``, ModelOpt ``{k,v}_proj.{k,v}_scale``.
_KV_SCALE = re.compile(r"layers\.(\d+)\.self_attn\.(?:k_proj\.|v_proj\.)?(k|v|kv)_scale$")
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
# One MoE expert's projection: Mixtral's w1 (gate) / w3 (up) / w2 (down), Qwen-MoE's names.
_EXPERT = re.compile(r"layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
                     r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# Dtypes a dense weight never has: a checkpoint tensor of one is a quantized weight whose
# scales are missing, which must not be widened into a dense parameter as if it were values.
_QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8, torch.uint8, torch.int32)
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head.

    Args:
        config: architecture.
        max_positions: RoPE table length (the engine's ``max_model_len``).
    """

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = nn.Embedding(config.vocab_size,
                                                                                config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.max_positions = max_positions
        self.rotary: RotaryEmbedding | None = None
        # FP8 KV-cache scales found in the checkpoint: layer -> {"k": s, "v": s}.
        self.kv_cache_scales: dict[int, dict[str, float]] = {}
        # Set by pack_linears (CPU): the LM head's packed copy and the packed weights' bytes.
        self.packed_head: nn.Module | None = None
        self.packed_bytes = 0
        self.batch_invariant = False  # set at load by probe_batch_invariance
        self.tp: TPGroup | None = None  # set by enable_tensor_parallel

    def enable_tensor_parallel(self, tp: TPGroup, vocab_size: int) -> None:
        """Make this model one rank of ``tp``: call on a model built (on the meta device)
        from :func:`kvpilot.engine.distributed.rank_config`, before its weights exist. The
        embedding and LM head become vocab-parallel (``vocab_size``: the whole model's);
        the row-parallel projections and MoE blocks all-reduce their outputs. Mutates the
        module tree."""
        self.tp = tp
        hidden = self.config.hidden_size
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden, tp)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(hidden, self.embed_tokens.weight.shape[0], bias=False)
        set_tensor_parallel(self, tp, (RowParallelLinear, SparseMoeBlock))

    def init_rotary(self, device: torch.device) -> None:
        self.rotary = RotaryEmbedding(self.config, self.max_positions, device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[LayerKVCache],
        backend: AttentionBackend,
        logits_indices: torch.Tensor,
        calibrate: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None,
    ) -> torch.Tensor:
        """Run the step and return final hidden states of the rows in ``logits_indices``.

        Args:
            input_ids, positions: ``[num_tokens]`` int64.
            logits_indices: ``[num_logits]`` rows whose next token is wanted.
            calibrate: called per layer with the step's K/V before they are stored
                (FP8 scale calibration from real data).
        Returns:
            ``[num_logits, hidden_size]`` (after the final norm).
        Mutates the KV cache (this step's K/V are written).
        """
        assert self.rotary is not None, "call init_rotary() first"
        h = self.embed_tokens(input_ids)
        ops = backend.layer_ops
        ctx = ForwardContext(meta, kv_caches, backend, ops, ops.rotary_tables(self.rotary, positions, h.dtype),
                             calibrate)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            h, residual = layer(h, residual, ctx)
        assert residual is not None
        # Only the rows whose logits are wanted need the last residual add and norm.
        return self.norm.add_forward(h[logits_indices], residual[logits_indices], ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` fp32 (with tensor parallelism the ranks' vocabulary
        slices, all-gathered: every rank calls this with the same rows)."""
        head: nn.Module | torch.Tensor
        if self.packed_head is not None:
            head = self.packed_head
        elif self.lm_head is None and isinstance(self.embed_tokens, QuantizedEmbedding):
            head = self.embed_tokens.head
        elif isinstance(self.lm_head, QuantizedLinear):  # unpacked (no oneDNN): the module
            head = self.lm_head
        else:
            head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return lm_head_logits(hidden, head, self.tp, self.config.vocab_size)

    @torch.no_grad()
    def pack_linears(self) -> int:
        """Replace every projection with a :class:`PackedLinear` and give the LM head a
        packed copy (the embedding keeps its table: it is a lookup). Call after
        :meth:`load_weights`, on CPU (:func:`can_pack_linears`). Returns how many were
        packed. Mutates the module tree; ``packed_bytes`` counts what the packed weights
        hold, which :meth:`parameters` no longer shows."""
        count, nbytes = pack_linears(self)
        self.packed_bytes += nbytes
        if self.lm_head is None and isinstance(self.embed_tokens, QuantizedEmbedding):
            self.packed_head = self.embed_tokens.head  # kept quantized (its bytes are the embedding's)
        elif self.lm_head is None:
            self.packed_head = PackedLinear(self.embed_tokens.weight, None)
            self.packed_bytes += self.packed_head.nbytes
        else:
            self.packed_head = self.lm_head  # packed above
        return count

    @staticmethod
    def checkpoint_names(name: str) -> list[str]:
        """The checkpoint modules our module ``name`` is loaded from (HF names):
        ``layers.0.self_attn.qkv_proj`` -> its q, k and v projections (or a fused
        ``qkv_proj``), ``layers.0.mlp.gate_up_proj`` -> gate and up, a MoE router ->
        Mixtral's ``block_sparse_moe.gate`` or ``mlp.gate``; the LM head is ``lm_head``."""
        if name == "lm_head":
            return ["lm_head"]
        full = f"model.{name}"
        if name.endswith("self_attn.qkv_proj"):
            return [full.replace("qkv_proj", p) for p in _QKV]
        if name.endswith("gate_up_proj"):
            return [full.replace("gate_up_proj", p) for p in _GATE_UP]
        if name.endswith("mlp.gate") and ".shared_expert" not in name:
            return [full.replace(".mlp.gate", ".block_sparse_moe.gate"), full]
        return [full]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Copy HF-named tensors (``model.layers.0.self_attn.q_proj.weight`` ...) in,
        fusing q/k/v and gate/up. MoE experts' per-expert tensors (Mixtral's
        ``block_sparse_moe.experts.N.w1/w3/w2``, Qwen-MoE's ``mlp.experts.N.gate_proj/
        up_proj/down_proj``) are copied into the layer's stacked ``mlp.w13``/``mlp.w2``; a
        missing one is reported as ``layers.L.mlp.experts.N.gate|up|down``. FP8 KV-cache
        scales are kept in ``kv_cache_scales``. A quantized weight
        (:class:`~kvpilot.engine.quantization.weights.QuantizedWeight`) goes to its
        :class:`QuantizedLinear` (by the same rows), which :func:`finish_quantized` joins.

        Raises:
            ValueError: an unexpected tensor name or shape, or a missing tensor; a
                quantized weight for a layer built dense, or the reverse; quantized MoE
                experts (not supported yet).
        """
        params = dict(self.named_parameters())
        quantized: dict[str, QuantizedLinear] = {}
        for mname, module in self.named_modules():
            if isinstance(module, QuantizedEmbedding):
                quantized[f"{mname}.weight"] = module.inner
            elif isinstance(module, QuantizedLinear) and not mname.endswith(".inner"):
                quantized[f"{mname}.weight"] = module

        qblocks = {mname: m for mname, m in self.named_modules()
                   if isinstance(m, SparseMoeBlock) and m.expert_shards is not None}

        def shape(pname: str) -> tuple[int, ...]:
            return quantized[pname].shape if pname in quantized else tuple(params[pname].shape)

        loaded: set[str] = set()
        c = self.config
        qkv_rows = [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
        inter = c.intermediate_size

        def shards(pname: str) -> set[str]:
            """The pieces ``pname`` is loaded as: the fused projections' row blocks."""
            if pname.endswith("qkv_proj.weight") or pname.endswith("qkv_proj.bias"):
                return {f"{pname}[{qkv_rows[i]}:{qkv_rows[i + 1]}]" for i in range(3)}
            if pname.endswith("gate_up_proj.weight") or pname.endswith("gate_up_proj.bias"):
                half = shape(pname)[0] // 2  # the shared expert's differs
                return {f"{pname}[0:{half}]", f"{pname}[{half}:{2 * half}]"}
            if pname.endswith(".w13") or pname.endswith(".w2"):  # stacked MoE experts
                base = pname.removesuffix(".w13").removesuffix(".w2")
                parts = ("gate", "up") if pname.endswith(".w13") else ("down",)
                return {f"{base}.experts.{e}.{part}" for e in range(params[pname].shape[0]) for part in parts}
            return {pname}

        for name, tensor in weights:
            if isinstance(tensor, QuantizedWeight):
                expert = _EXPERT.search(name)
                if expert is not None:
                    block = qblocks.get(f"layers.{expert.group(1)}.mlp")
                    e, part = int(expert.group(2)), _EXPERT_PART[expert.group(3)]
                    if block is None or e >= block.num_experts:
                        raise ValueError(f"checkpoint tensor {name!r} is a quantized MoE expert "
                                         f"({tensor.describe()}) with no quantized place in the model")
                    block.add_expert_shard(e, part, tensor, name)
                    loaded.add(f"layers.{expert.group(1)}.mlp.experts.{e}.{part}")
                    continue
                target, rows = self._map_name(name, qkv_rows, inter, c.shared_expert_intermediate_size)
                if target is None or (target == "lm_head.weight" and self.lm_head is None):
                    continue
                qlinear = quantized.get(target)
                if qlinear is None:
                    raise ValueError(f"checkpoint tensor {name!r} is quantized ({tensor.describe()}), but the "
                                     f"model's {target!r} was built unquantized (the checkpoint's quantization "
                                     "config does not list it)")
                qlinear.add_shard(rows, tensor, name)
                loaded.update(shards(target) if rows is None else {f"{target}[{rows[0]}:{rows[1]}]"})
                continue
            scale = _KV_SCALE.search(name)
            if scale is not None:
                layer_scales = self.kv_cache_scales.setdefault(int(scale.group(1)), {})
                for kind in ("k", "v") if scale.group(2) == "kv" else (scale.group(2),):
                    layer_scales[kind] = float(tensor.float().max())
                continue
            expert = _EXPERT.search(name)
            if tensor.dtype in _QUANTIZED_DTYPES:
                raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype} without the scales a quantized "
                                 "weight needs (weight_scale, or a quantization_config naming this module)")
            if expert is not None:  # one expert's projection into the layer's stacked tensor
                layer, e, proj = int(expert.group(1)), int(expert.group(2)), expert.group(3)
                part = _EXPERT_PART[proj]
                stacked = params.get(f"layers.{layer}.mlp.{'w2' if part == 'down' else 'w13'}")
                if stacked is None or e >= stacked.shape[0]:
                    raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
                moe_inter = stacked.shape[1] // 2 if part != "down" else stacked.shape[2]
                dst = stacked.data[e]
                if part != "down":
                    dst = dst[:moe_inter] if part == "gate" else dst[moe_inter:]
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                dst.copy_(tensor)
                loaded.add(f"layers.{layer}.mlp.experts.{e}.{part}")
                continue
            target, rows = self._map_name(name, qkv_rows, inter, c.shared_expert_intermediate_size)
            if target is None or (target == "lm_head.weight" and self.lm_head is None):
                continue
            if target in quantized:
                raise ValueError(f"checkpoint tensor {name!r} is unquantized ({tensor.dtype}), but the model's "
                                 f"{target!r} was built for a quantized weight (the checkpoint's quantization config "
                                 "lists it)")
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model ({target!r})")
            dst = param.data if rows is None else param.data[rows[0] : rows[1]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            if rows is not None:
                loaded.add(f"{target}[{rows[0]}:{rows[1]}]")
            else:  # a whole tensor, fused ones included (Phi-3's qkv_proj, gate_up_proj)
                loaded |= shards(target)
        expected = set().union(*(shards(p) for p in (*params, *quantized)))
        expected |= {f"{b}.experts.{e}.{part}" for b, m in qblocks.items() for e in range(m.num_experts)
                     for part in ("gate", "up", "down")}
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:4]}")

    @staticmethod
    def _map_name(name: str, qkv_rows: list[int], inter: int,
                  shared_inter: int = 0) -> tuple[str | None, tuple[int, int] | None]:
        if "rotary_emb.inv_freq" in name:
            return None, None
        name = name.removeprefix("model.")
        for proj, idx in _QKV.items():
            if f"self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), (qkv_rows[idx], qkv_rows[idx + 1])
        name = name.replace(".block_sparse_moe.gate.", ".mlp.gate.")  # Mixtral's router
        for proj, idx in _GATE_UP.items():
            if f"mlp.{proj}." in name:
                return name.replace(proj, "gate_up_proj"), (idx * inter, (idx + 1) * inter)
            if f"mlp.shared_expert.{proj}." in name:  # Qwen2-MoE: its own intermediate size
                return name.replace(proj, "gate_up_proj"), (idx * shared_inter, (idx + 1) * shared_inter)
        return name, None
