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

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.model.config import ModelConfig
from kvpilot.engine.model.layer_ops import TORCH_LAYER_OPS, TorchLayerOps
from kvpilot.engine.model.layers import MLP, row_parallel_reduce
from kvpilot.engine.quantization.weights import QuantizedWeight, QuantizedWeightError, cat_rows

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


def moe_experts_quantized(x: torch.Tensor, experts: list[tuple[QuantizedWeight, QuantizedWeight]],
                          topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """:func:`moe_experts_reference` over quantized experts: each expert's ``(w13, w2)``
    product by its format's kernel (:meth:`QuantizedWeight.linear`), on the tokens routed
    to it. ``x`` ``[T, hidden]``; returns ``[T, hidden]`` in ``x``'s dtype."""
    out = torch.zeros_like(x)
    weights = topk_weights.to(x.dtype)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = torch.nonzero(topk_ids == e, as_tuple=True)
        w13, w2 = experts[e]
        h = w13.linear(x[tok])
        inter = h.shape[1] // 2
        h = F.silu(h[:, :inter]) * h[:, inter:]
        out.index_add_(0, tok, w2.linear(h) * weights[tok, slot, None])
    return out


def expert_checkpoint_names(layer: int, expert: int) -> list[str]:
    """The checkpoint modules of one expert, in both namings (Mixtral's
    ``block_sparse_moe.experts.E.w1/w3/w2``, Qwen-MoE's ``mlp.experts.E.gate_proj/up_proj/
    down_proj``): gate, up, down, then the other naming's."""
    mix = f"model.layers.{layer}.block_sparse_moe.experts.{expert}"
    qwen = f"model.layers.{layer}.mlp.experts.{expert}"
    return [f"{mix}.w1", f"{mix}.w3", f"{mix}.w2", f"{qwen}.gate_proj", f"{qwen}.up_proj", f"{qwen}.down_proj"]


def quantize_experts(model: nn.Module, is_quantized: Callable[[str], bool],
                     present: Callable[[str], bool] | None = None) -> set[str]:
    """Make every MoE block whose experts the checkpoint quantizes hold quantized experts
    (:meth:`SparseMoeBlock.make_quantized`), before any weight is read. Returns the
    checkpoint module names that are now loaded as quantized weights. ``present``: as
    :func:`~kvpilot.engine.model.layers.quantize_linears`'s (only the spelling the
    checkpoint has is asked)."""
    names: set[str] = set()
    for mname, block in model.named_modules():
        if not isinstance(block, SparseMoeBlock):
            continue
        layer = int(mname.split(".")[1])
        first = [n for n in expert_checkpoint_names(layer, 0) if present is None or present(n)]
        if any(is_quantized(n) for n in first):
            block.make_quantized()
            for e in range(block.num_experts):
                names.update(n for n in expert_checkpoint_names(layer, e) if present is None or present(n))
    return names


def finish_quantized_experts(model: nn.Module, device: torch.device) -> int:
    """:meth:`SparseMoeBlock.finish_quantized` every block with quantized experts; returns
    their resident bytes."""
    return sum(m.finish_quantized(device, name) for name, m in model.named_modules()
               if isinstance(m, SparseMoeBlock) and m.expert_shards is not None)


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
        self.num_experts, self.moe_inter, self.hidden = e, inter, hidden
        self.w13: nn.Parameter | None = nn.Parameter(torch.empty(e, 2 * inter, hidden))
        self.w2: nn.Parameter | None = nn.Parameter(torch.empty(e, hidden, inter))
        # Quantized experts (make_quantized): the checkpoint's parts, then (w13, w2) per expert.
        self.expert_shards: dict[tuple[int, str], QuantizedWeight] | None = None
        self.quantized_experts: list[tuple[QuantizedWeight, QuantizedWeight]] | None = None
        self.shared_expert: nn.Module | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, config.shared_expert_intermediate_size, reduce_output=False)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def make_quantized(self) -> None:
        """Hold quantized experts instead of the stacked ``w13``/``w2`` (dropped, so they
        are never allocated): call on the meta model, before loading. Mutates the block."""
        self.w13 = None
        self.w2 = None
        self.expert_shards = {}

    def add_expert_shard(self, expert: int, part: str, weight: QuantizedWeight, name: str) -> None:
        """Take expert ``expert``'s ``part`` (``gate``, ``up`` or ``down``).

        Raises:
            QuantizedWeightError: a shape other than the expert's (named ``name``).
        """
        assert self.expert_shards is not None, "make_quantized() first"
        want = [self.hidden, self.moe_inter] if part == "down" else [self.moe_inter, self.hidden]
        if [weight.out_features, weight.in_features] != want:
            raise QuantizedWeightError(f"{name}: quantized weight of shape "
                                       f"{[weight.out_features, weight.in_features]}, expected {want}")
        self.expert_shards[(expert, part)] = weight

    def finish_quantized(self, device: torch.device, name: str) -> int:
        """Join each expert's gate and up by rows and repack every expert for ``device``;
        returns the experts' resident bytes.

        Raises:
            QuantizedWeightError: an expert part missing, or gate and up quantized differently.
        """
        shards = self.expert_shards
        assert shards is not None
        experts: list[tuple[QuantizedWeight, QuantizedWeight]] = []
        for e in range(self.num_experts):
            missing = [p for p in ("gate", "up", "down") if (e, p) not in shards]
            if missing:
                raise QuantizedWeightError(f"{name}.experts.{e}.{missing[0]}: missing from the checkpoint")
            w13 = cat_rows([shards[(e, "gate")], shards[(e, "up")]], f"{name}.experts.{e}.gate_up").prepare(device)
            experts.append((w13, shards[(e, "down")].prepare(device)))
        self.quantized_experts = experts
        self.expert_shards = None
        return sum(a.nbytes + b.nbytes for a, b in experts)

    def forward(self, x: torch.Tensor, ops: TorchLayerOps = TORCH_LAYER_OPS) -> torch.Tensor:
        """``[T, hidden]`` -> ``[T, hidden]`` in ``x``'s dtype: the experts by the Triton
        kernel (:func:`kvpilot.kernels.fused_moe.fused_moe`) on CUDA, by the torch loop
        (:func:`moe_experts_reference`) elsewhere; quantized experts by a loop over the
        experts' own kernels (:func:`moe_experts_quantized`) on both."""
        weights, ids = route_topk(self.gate(x), self.top_k, self.renormalize, self.scoring)
        if self.quantized_experts is not None:
            out = moe_experts_quantized(x, self.quantized_experts, weights, ids)
        elif self.w13 is None or self.w2 is None:
            raise RuntimeError("quantized MoE experts used before finish_quantized()")
        elif x.is_cuda:
            from kvpilot.kernels.fused_moe import fused_moe  # needs Triton, which needs a GPU

            out = fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            out = moe_experts_reference(x, self.w13, self.w2, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x, ops)
        # Row-parallel experts (and shared expert): each rank holds a partial sum.
        return row_parallel_reduce(out, self.tp)
