"""The torch reference's sliding window and logit soft-cap equal dense masked attention."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference


def _dense(q_all: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
           cap: float | None) -> torch.Tensor:
    """HF transformers' eager attention: causal mask, ``kv_idx > q_idx - window``, soft-cap."""
    n, h, _ = q_all.shape
    rep = h // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1).float(), v.repeat_interleave(rep, 1).float()
    s = torch.einsum("qhd,khd->hqk", q_all.float(), kk) * scale
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    qi, ki = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = ki <= qi
    if window is not None:
        mask &= ki > qi - window
    s = s.masked_fill(~mask, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), vv)


@pytest.mark.parametrize("window", [None, 1, 3, 4, 7, 13, 40])
@pytest.mark.parametrize("cap", [None, 5.0])
def test_paged_attention_window_and_softcap(window: int | None, cap: float | None) -> None:
    torch.manual_seed(0)
    bs, nblocks, hkv, h, d = 4, 32, 2, 4, 16
    lens = [13, 9, 20]  # prefill chunks across the window edge, and decodes
    qlens = [1, 9, 6]
    key_cache = torch.zeros(nblocks, bs, hkv, d)
    value_cache = torch.zeros(nblocks, bs, hkv, d)
    perm = torch.randperm(nblocks).tolist()
    tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    qs, expect = [], []
    for i, (n, qn) in enumerate(zip(lens, qlens, strict=True)):
        blocks = [perm.pop() for _ in range(-(-n // bs))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        k, v, q_all = torch.randn(n, hkv, d), torch.randn(n, hkv, d), torch.randn(n, h, d)
        for j in range(n):
            key_cache[blocks[j // bs], j % bs] = k[j]
            value_cache[blocks[j // bs], j % bs] = v[j]
        qs.append(q_all[n - qn:])
        expect.append(_dense(q_all, k, v, 0.3, window, cap)[n - qn:])
    qsl = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32)
    out = reference.paged_attention(torch.cat(qs), key_cache, value_cache, tables, qsl,
                                    torch.tensor(lens, dtype=torch.int32), 0.3,
                                    sliding_window=window, logit_softcap=cap)
    torch.testing.assert_close(out, torch.cat(expect), atol=1e-5, rtol=1e-5)
