"""oneDNN-packed linear weights on CPU (``PackedLinear``) and the batch-invariance probe
that decides, at load, whether a request's bytes can depend on what it is batched with."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.model.layers import (
    PackedLinear,
    QuantizedLinear,
    can_pack_linears,
    probe_batch_invariance,
)

needs_onednn = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.float32),
                                  reason="this torch build has no oneDNN weight packing")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 8, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(96, 64, generator=g), torch.randn(rows, 64, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    layer = PackedLinear(w, b)
    assert (layer.in_features, layer.out_features, layer.nbytes) == (64, 96, 96 * 64 * 4)
    torch.testing.assert_close(layer(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


class _RowLocal(nn.Linear):
    """A product that is row-local by construction: each row in a call of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([super(_RowLocal, self).forward(x[i:i + 1]) for i in range(x.shape[0])])


class _BatchDependent(nn.Linear):
    """A product whose rounding depends on how many rows came in the call (as MKL's
    single-row path differs from its multi-row one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + 1e-6 * out.abs() if x.shape[0] < 8 else out


def test_the_probe_passes_a_row_local_product_and_catches_a_batch_dependent_one():
    ok = nn.Sequential(_RowLocal(32, 16))
    assert probe_batch_invariance(ok) == (True, "1 weight shapes, calls of 1-17 rows against one of 40")

    bad = nn.Sequential(_RowLocal(32, 16), _BatchDependent(32, 24))
    ok_rows, detail = probe_batch_invariance(bad)
    assert not ok_rows and detail.startswith("32x24 product: rows 0..0 alone differ"), detail


@needs_onednn
def test_the_loaded_model_is_packed_and_says_whether_it_is_batch_invariant(smollm2):
    """On fp32 CPU no plain ``nn.Linear`` is left: the embedded GGUF's projections and its
    tied LM head stay quantized (the head is the quantized embedding's table), anything
    dense would be packed; ``packed_bytes`` counts both. The flag set at load agrees with a
    wider check of the head's products (more row counts than the probe)."""
    model = smollm2.model
    assert not [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert isinstance(model.packed_head, (PackedLinear, QuantizedLinear))
    quantized = [m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)]
    assert quantized, "the embedded GGUF serves its weights quantized"
    assert model.packed_bytes == sum(m.nbytes for m in model.modules() if isinstance(m, PackedLinear)) \
        + sum(m.nbytes for m in quantized)
    g = torch.Generator().manual_seed(7)
    head = model.packed_head
    x = torch.randn(200, head.in_features, generator=g)
    with torch.no_grad():
        full = head(x)
        wide = all(torch.equal(head(x[s:s + n]), full[s:s + n]) for n in (1, 4, 5, 16, 31, 64, 129) for s in (0, 7))
    assert model.batch_invariant == probe_batch_invariance(model)[0]
    if model.batch_invariant:
        assert wide, "the probe said invariant but a wider sample of row counts differs"
