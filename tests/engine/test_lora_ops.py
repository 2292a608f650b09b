"""The adapter products (the CPU path, and the CUDA path's Triton kernels under the
interpreter) against their definition, on hand-made segment layouts."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.lora.ops import LoRAMapping, add_lora_cpu, add_lora_reference, add_lora_triton


@pytest.mark.parametrize("lengths,slots", [
    ([5], [0]),                                  # one prefill chunk
    ([1, 1, 1, 1], [0, 1, 0, 1]),                # interleaved decodes: the gather path
    ([1, 1, 7, 3], [-1, 2, 2, -1]),              # adjacent same-slot segments merge
    ([3, 1, 4, 1, 5], [1, -1, 1, 0, 1]),         # one slot in three places
    ([2, 2], [-1, -1]),                          # the base model only
    ([0, 3], [0, 1]),                            # an empty segment
])
@pytest.mark.parametrize("impl", ["cpu", pytest.param("triton", marks=pytest.mark.triton_interpreter)])
def test_products_equal_the_reference(lengths, slots, impl):
    gen = torch.Generator().manual_seed(0)
    slots_n, width, fin, fout = 3, 6, 11, 13
    a = torch.randn(slots_n, width, fin, generator=gen)
    b = torch.randn(slots_n, fout, width, generator=gen)
    widths = [6, 4, 2]
    for s, w in enumerate(widths):  # zero past each slot's width, as the stacks are
        a[s, w:] = 0
        b[s, :, w:] = 0
    mapping = LoRAMapping.build(lengths, slots, torch.device("cpu"))
    t = sum(lengths)
    assert mapping.num_tokens == t
    x = torch.randn(t, fin, generator=gen)
    y0 = torch.randn(t, fout, generator=gen)
    want, got = y0.clone(), y0.clone()
    add_lora_reference(want, x, a, b, mapping)
    if impl == "cpu":
        add_lora_cpu(got, x, a, b, mapping, widths)
    else:  # the CUDA path's kernels, under Triton's interpreter
        add_lora_triton(got, x, a, b, mapping, torch.tensor(widths, dtype=torch.int32))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base_rows = torch.cat([torch.full((n,), s) for n, s in zip(lengths, slots)]) < 0 if t else torch.zeros(0, dtype=torch.bool)
    assert torch.equal(got[base_rows], y0[base_rows])  # base-model rows untouched
    if any(s >= 0 and n for n, s in zip(lengths, slots)):
        assert not torch.equal(got, y0)


def test_mapping_merges_and_gathers():
    m = LoRAMapping.build([1, 1, 2, 1], [0, 1, 1, 0], torch.device("cpu"))
    assert m.seg_lens == [1, 3, 1] and m.seg_slots == [0, 1, 0]
    assert m.perm is not None and m.perm.tolist() == [0, 4, 1, 2, 3]
    assert m.ranges == [(0, 0, 2), (1, 2, 5)]
    contiguous = LoRAMapping.build([2, 3], [1, 0], torch.device("cpu"))
    assert contiguous.perm is None and contiguous.ranges == [(1, 0, 2), (0, 2, 5)]
    with pytest.raises(ValueError, match="differ in length"):
        LoRAMapping.build([1], [0, 1], torch.device("cpu"))
