"""The model layers (engine/model/layers.py) on their own: the tensor-parallel linears
reduce where they should, packing keeps a row-parallel reduce, the probe stays local,
and the LM head all-gathers the vocabulary slices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.model.config import ModelConfig
from kvpilot.engine.model.layers import (
    MLP,
    ColumnParallelLinear,
    RowParallelLinear,
    can_pack_linears,
    lm_head_logits,
    pack_linears,
    probe_batch_invariance,
    set_tensor_parallel,
)


class FakeGroup:
    """A stand-in TPGroup of ``size`` ranks whose peers hold the same partial sums: an
    all-reduce multiplies by ``size``; it counts its calls."""

    def __init__(self, size: int = 2) -> None:
        self.size = size
        self.num_all_reduces = 0
        self.num_all_gathers = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.num_all_reduces += 1
        return x.mul_(self.size)

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        self.num_all_gathers += 1
        return torch.cat([x] * self.size, dim=-1)


def _config() -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=10, hidden_size=16, intermediate_size=24, num_layers=1,
                       num_heads=2, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=32, tie_word_embeddings=False)


def test_the_parallel_linears_are_linears_and_only_the_row_one_reduces():
    torch.manual_seed(0)
    col, row = ColumnParallelLinear(8, 6), RowParallelLinear(8, 6)
    assert isinstance(col, nn.Linear) and isinstance(row, nn.Linear)
    x = torch.randn(3, 8)
    plain = F.linear(x, row.weight, row.bias)
    assert torch.equal(row(x), plain)  # no group: a plain linear
    group = FakeGroup()
    set_tensor_parallel(nn.Sequential(col, row), group)  # type: ignore[arg-type]
    assert col(x).shape == (3, 6) and group.num_all_reduces == 0
    assert torch.equal(row(x), plain * 2) and group.num_all_reduces == 1


def test_a_shared_experts_mlp_leaves_the_reduce_to_its_block():
    mlp, shared = MLP(_config()), MLP(_config(), 12, reduce_output=False)
    group = FakeGroup()
    set_tensor_parallel(nn.ModuleList([mlp, shared]), group)  # type: ignore[arg-type]
    x = torch.randn(4, 16)
    mlp(x)
    shared(x)
    assert group.num_all_reduces == 1


@pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.float32),
                    reason="this torch build has no oneDNN weight packing")
def test_packing_keeps_the_row_parallel_reduce_and_the_probe_stays_local():
    torch.manual_seed(0)
    model = nn.Sequential(ColumnParallelLinear(8, 8), RowParallelLinear(8, 8))
    group = FakeGroup()
    set_tensor_parallel(model, group)  # type: ignore[arg-type]
    x = torch.randn(3, 8)
    with torch.no_grad():
        expect = model(x)
        count, nbytes = pack_linears(model)
        assert (count, nbytes) == (2, 2 * 8 * 8 * 4)
        torch.testing.assert_close(model(x), expect, rtol=1e-5, atol=1e-5)
    reduces = group.num_all_reduces
    probe_batch_invariance(model)
    assert group.num_all_reduces == reduces  # the probe measures the local products only


def test_the_lm_head_gathers_the_vocabulary_slices_and_drops_the_padding():
    hidden, weight = torch.randn(2, 4), torch.randn(3, 4)
    assert torch.equal(lm_head_logits(hidden, weight, None, 3), F.linear(hidden, weight).float())
    group = FakeGroup()
    logits = lm_head_logits(hidden, weight, group, 5)  # type: ignore[arg-type]
    assert logits.shape == (2, 5) and group.num_all_gathers == 1
