"""Sparse Mixture-of-Experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE).

The block follows HF transformers' ``MixtralSparseMoeBlock`` / ``Qwen2MoeSparseMoeBlock``
/ ``Qwen3MoeSparseMoeBlock``:

1. router logits ``x @ gate.T`` ``[T, E]``; scores in fp32: ``softmax`` over experts, or
   an independent ``sigmoid`` per expert when the config's ``scoring_func`` says so;
2. the top-``k`` experts per token (``num_experts_per_tok``); their weights renormalised to
   sum to 1 when ``norm_topk_prob`` (Mixtral always does);
3. each chosen expert is a SwiGLU MLP ``down(silu(gate(x)) * up(x))``; the output is the
   routing-weighted sum over the ``k`` chosen experts;
4. Qwen2-MoE adds a shared expert (a dense SwiGLU MLP) scaled by
   ``sigmoid(shared_expert_gate(x))``.

Expert weights are stacked per layer: ``w13 [E, 2 * moe_inter, hidden]`` (gate rows then
up rows) and ``w2 [E, hidden, moe_inter]``. The expert computation is
:func:`moe_experts_reference` (a loop over experts, only the tokens routed to each) on
CPU and the Triton kernel :mod:`kvpilot.kernels.fused_moe` on CUDA. The shared expert is
the gated MLP of :mod:`kvpilot.engine.model.layers`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.model.config import ModelConfig
from kvpilot.engine.model.layer_ops import TORCH_LAYER_OPS, TorchLayerOps
from kvpilot.engine.model.layers import MLP, row_parallel_reduce

if TYPE_CHECKING:
    from kvpilot.engine.model.layers import TPGroup


def route_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool,
               scoring: str = "softmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing: HF Mixtral / Qwen-MoE (softmax), or sigmoid scores per expert
    (DeepSeek-V3's and llama.cpp's ``expert_gating_func`` sigmoid, without their bias
    and groups, which the config check refuses).

    Args:
        router_logits: ``[T, E]`` any float dtype.
        top_k: experts per token.
        renormalize: divide the chosen weights by their sum (``norm_topk_prob``).
        scoring: ``softmax`` or ``sigmoid``.
    Returns:
        ``(weights [T, k] fp32, expert ids [T, k] int64)``.
    Raises:
        ValueError: another ``scoring``.
    """
    if scoring == "softmax":
        probs = torch.softmax(router_logits.float(), dim=-1)
    elif scoring == "sigmoid":
        probs = torch.sigmoid(router_logits.float())
    else:
        raise ValueError(f"scoring = {scoring!r} is not supported; softmax or sigmoid")
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """The experts' weighted sum, by a loop over experts (only the tokens routed to each).

    Args:
        x: ``[T, hidden]``.
        w13: ``[E, 2 * inter, hidden]`` gate rows then up rows.
        w2: ``[E, hidden, inter]``.
        topk_weights: ``[T, k]`` (cast to ``x``'s dtype, as HF does before the experts).
        topk_ids: ``[T, k]`` int.
    Returns:
        ``[T, hidden]`` in ``x``'s dtype; ``x`` is not mutated.
    """
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    weights = topk_weights.to(x.dtype)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        h = F.linear(x[tok], w13[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[e]) * weights[tok, slot, None]
        out.index_add_(0, tok, y)
    return out


class SparseMoeBlock(nn.Module):
    """Router + stacked experts (+ Qwen2-MoE's gated shared expert) for one layer.

    Parameter names (what :meth:`LlamaForCausalLM.load_weights` fills): ``gate.weight``
    ``[E, hidden]``, ``w13`` ``[E, 2 * moe_inter, hidden]``, ``w2`` ``[E, hidden, moe_inter]``,
    and with a shared expert ``shared_expert.gate_up_proj/down_proj`` and
    ``shared_expert_gate.weight`` ``[1, hidden]``.
    """

    tp: TPGroup | None = None  # set by LlamaForCausalLM.enable_tensor_parallel: one all-reduce per block

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        e, inter, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.scoring = config.moe_scoring_func
        self.gate = nn.Linear(hidden, e, bias=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(e, hidden, inter))
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size, reduce_output=False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor, ops: TorchLayerOps = TORCH_LAYER_OPS) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` in ``x``'s dtype: the experts by the Triton
        kernel (:func:`kvpilot.kernels.fused_moe.fused_moe`) on CUDA, by the torch loop
        (:func:`moe_experts_reference`) elsewhere."""
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize, self.scoring)
        if x.is_cuda:
            from kvpilot.kernels.fused_moe import fused_moe  # needs Triton, which needs a GPU

            out = fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            out = moe_experts_reference(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        # Row-parallel experts (and shared expert): each rank holds a partial sum.
        return row_parallel_reduce(out, self.tp)
