"""Gemma 2 and Gemma 3 (text) decoders over the same packed varlen batch as
:mod:`kvpilot.engine.model.llama`, built from the same layers
(:mod:`kvpilot.engine.model.layers`) where the math is the same.

What differs from Llama (transformers' ``modeling_gemma2`` / ``modeling_gemma3``, and the
Gemma 2 report, arXiv:2408.00118; Gemma 3 report, arXiv:2503.19786):

- the embeddings are multiplied by ``sqrt(hidden_size)``, a constant rounded to the
  activation dtype first (``55.4256`` becomes ``55.5`` in bf16, as in transformers);
- RMSNorm multiplies by ``1 + weight``: the ``+1`` is folded into the weight when the
  checkpoint is loaded (:meth:`GemmaForCausalLM.load_weights`), so the Llama norm and the
  fused CPU norm kernels run it unchanged. In fp32 that is the same arithmetic as
  transformers; in bf16/fp16 ``1 + w`` is rounded to the dtype once at load (transformers
  adds in fp32 at every call), a difference in the last bit of the norm weight;
- each layer normalizes the attention and MLP outputs too: ``input_layernorm`` ->
  attention -> ``post_attention_layernorm`` -> residual add -> ``pre_feedforward_layernorm``
  -> MLP -> ``post_feedforward_layernorm`` -> residual add;
- the MLP is GeGLU with the tanh approximation of GELU (``gelu_pytorch_tanh``);
- the softmax scale is ``query_pre_attn_scalar ** -0.5``;
- sliding and full attention layers interleave (``ModelConfig.layer_types``): Gemma 2 every
  other layer, Gemma 3 five sliding to one full; the window goes to the attention backend;
- Gemma 2 soft-caps the attention scores (``attn_logit_softcapping``, in the backend) and
  the final logits (``final_logit_softcapping``: ``c * tanh(z / c)`` in fp32 here);
- Gemma 3 normalizes q and k per head (RMSNorm with ``+1``) before RoPE, and its sliding
  layers rotate with their own base (``rope_local_base_freq``, no scaling) while the full
  layers use ``rope_theta`` with the checkpoint's ``rope_scaling``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from kvpilot.engine.attention.backend import AttentionBackend, AttentionMetadata, LayerKVCache
from kvpilot.engine.model.config import ModelConfig
from kvpilot.engine.model.layer_ops import TORCH_LAYER_OPS, TorchLayerOps
from kvpilot.engine.model.layers import MLP, Attention, ForwardContext, RMSNorm
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.rotary import RotaryEmbedding
from kvpilot.engine.quantization.weights import QuantizedWeight


class GemmaAttention(Attention):
    """Llama's attention (fused qkv, optional per-head q/k norm) with Gemma's scale, the
    layer's sliding window and Gemma 2's score soft-cap passed to the backend, and the
    rotary tables of the layer's kind (Gemma 3: local or global)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.scale = config.attention_scale
        self.sliding_window = config.sliding_window_for(layer_idx)
        self.logit_softcap = config.attn_logit_softcapping

    def forward(self, x: torch.Tensor, ctx: ForwardContext, tables: Any = None) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; writes this step's K/V to the layer's cache.
        ``tables``: this layer's rotary state (``ops.rotary_tables``), default ``ctx.rotary``."""
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim), ctx.ops)
            k = self.k_norm(k.reshape(-1, self.head_dim), ctx.ops)
        q, k = ctx.ops.rotary(q.reshape(-1, self.num_heads, self.head_dim),
                              k.reshape(-1, self.num_kv_heads, self.head_dim),
                              ctx.rotary if tables is None else tables)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if ctx.calibrate is not None:
            ctx.calibrate(self.layer_idx, k, v)
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.meta, self.scale,
                                  sliding_window=self.sliding_window, logit_softcap=self.logit_softcap)
        return self.project_out(out)


class GemmaMLP(MLP):
    """GeGLU: ``down(gelu_tanh(gate(x)) * up(x))`` (Shazeer 2020), gate/up fused."""

    def forward(self, x: torch.Tensor, ops: TorchLayerOps = TORCH_LAYER_OPS) -> torch.Tensor:
        y: torch.Tensor = self.down_proj(ops.gelu_tanh_and_mul(self.gate_up_proj(x)))
        return y


class GemmaDecoderLayer(nn.Module):
    """Pre- and post-norms around attention and around the MLP (Gemma 2/3)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.sliding = config.is_sliding_layer(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext,
                tables: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(h, residual)`` in, ``(normed mlp output, residual stream)`` out, as Llama's
        layer: their sum is the layer's output, formed by the next norm's fused add. The
        cpu ops mutate ``h`` and ``residual`` (fresh tensors of this step)."""
        if residual is None:
            residual = h
            h = self.input_layernorm(h, ctx.ops)
        else:
            h, residual = self.input_layernorm.add_forward(h, residual, ctx.ops)
        h = self.post_attention_layernorm(self.self_attn(h, ctx, tables), ctx.ops)
        h, residual = self.pre_feedforward_layernorm.add_forward(h, residual, ctx.ops)
        return self.post_feedforward_layernorm(self.mlp(h, ctx.ops), ctx.ops), residual


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text decoder plus (tied) LM head; loading, packing and the LM
    head are Llama's (:class:`~kvpilot.engine.model.llama.LlamaForCausalLM`).

    Args:
        config: a ``gemma2`` / ``gemma3`` :class:`ModelConfig`.
        max_positions: RoPE table length (the engine's ``max_model_len``).
    """

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_layers))
        # Gemma 3's sliding layers: their own RoPE base, no scaling (None: same as full).
        self.rotary_local: RotaryEmbedding | None = None

    def init_rotary(self, device: torch.device) -> None:
        super().init_rotary(device)
        if self.config.rope_local_theta is not None:
            self.rotary_local = RotaryEmbedding(self.config, self.max_positions, device,
                                                theta=self.config.rope_local_theta, scaling=None)

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
        """As :meth:`LlamaForCausalLM.forward`: ``[num_logits, hidden_size]`` final hidden
        states of the rows in ``logits_indices``. Mutates the KV cache."""
        assert self.rotary is not None, "call init_rotary() first"
        h = self.embed_tokens(input_ids)
        # transformers rounds sqrt(hidden) to the weights' dtype before multiplying.
        h = h * torch.tensor(self.config.hidden_size**0.5, dtype=h.dtype, device=h.device)
        ops = backend.layer_ops
        full = ops.rotary_tables(self.rotary, positions, h.dtype)
        local = full if self.rotary_local is None else ops.rotary_tables(self.rotary_local, positions, h.dtype)
        ctx = ForwardContext(meta, kv_caches, backend, ops, full, calibrate)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, GemmaDecoderLayer)
            h, residual = layer(h, residual, ctx, local if layer.sliding else full)
        assert residual is not None
        return self.norm.add_forward(h[logits_indices], residual[logits_indices], ops)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden]`` -> ``[n, vocab]`` fp32, soft-capped to ``(-c, c)`` when the model
        has ``final_logit_softcapping`` ``c`` (Gemma 2): ``c * tanh(z / c)``."""
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]) -> None:
        """Llama's loading (HF names, q/k/v and gate/up fused), then ``weight += 1`` on every
        RMSNorm: Gemma stores ``w`` and multiplies by ``1 + w``.

        Raises:
            ValueError: as :meth:`LlamaForCausalLM.load_weights`.
        """
        super().load_weights(weights)
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.add_(1.0)
