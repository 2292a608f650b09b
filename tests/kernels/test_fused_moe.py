"""The Triton fused MoE kernel under the interpreter against the torch reference (a loop
over experts): top-1 and top-2, experts that get no token, sizes not multiples of the
tiles; and the block alignment itself."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.model.moe import moe_experts_reference, route_topk
from kvpilot.kernels.fused_moe import fused_moe, moe_align_block_size


def test_align_sorts_pairs_by_expert_and_pads_each_run():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2]])  # expert 1 gets nothing
    sorted_ids, block_experts, total = moe_align_block_size(ids, 4, 4)
    assert total == 12 and block_experts.tolist() == [0, 2, 3]
    flat = ids.reshape(-1)
    pad = flat.numel()
    runs = sorted_ids.view(3, 4).tolist()
    assert runs == [[1, 4, pad, pad], [0, 2, 5, pad], [3, pad, pad, pad]]
    assert all(int(flat[i]) == int(e) for run, e in zip(runs, block_experts) for i in run if i != pad)


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(("tokens", "experts", "top_k", "hidden", "inter"),
                         [(5, 4, 2, 48, 40), (3, 8, 1, 32, 16), (1, 4, 2, 64, 24), (20, 6, 2, 40, 72)])
def test_fused_moe_matches_the_reference(tokens, experts, top_k, hidden, inter):
    gen = torch.Generator().manual_seed(tokens * 100 + experts)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, -1] = -30.0  # the last expert never wins a token
    weights, ids = route_topk(logits, top_k, renormalize=top_k > 1)
    assert (ids != experts - 1).all()
    got = fused_moe(x, w13, w2, weights, ids)
    want = moe_experts_reference(x, w13, w2, weights, ids)
    assert got.shape == want.shape and got.dtype == want.dtype
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
