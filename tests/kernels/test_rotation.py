"""Key rotation: orthogonal, so attention is unchanged in exact arithmetic, and it lowers
the FP8 error of logits dominated by outlier channels."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference as ref
from kvpilot.kernels.rotation import hadamard_matrix, key_rotation_matrix, rotate_heads


@pytest.mark.parametrize("n", [64, 128, 80])
def test_rotation_is_orthogonal(n):
    r = key_rotation_matrix(n, torch.float64)
    torch.testing.assert_close(r @ r.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


def test_hadamard_entries_all_have_the_same_magnitude():
    h = hadamard_matrix(64)
    assert torch.allclose(h.abs(), torch.full_like(h, 64**-0.5))
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard_matrix(48)


def test_rotated_attention_equals_plain_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 6, 64, generator=g, dtype=torch.float64)
    k = torch.randn(5, 2, 64, generator=g, dtype=torch.float64)
    r = key_rotation_matrix(64, torch.float64)
    plain = torch.einsum(
        "thd,tkd->thk", q.view(5, 2, 3, 64).flatten(1, 2), k.repeat_interleave(3, 1)
    )
    rot = torch.einsum(
        "thd,tkd->thk",
        rotate_heads(q, r).view(5, 2, 3, 64).flatten(1, 2),
        rotate_heads(k, r).repeat_interleave(3, 1),
    )
    torch.testing.assert_close(rot, plain)


def test_rotation_lowers_fp8_logit_error_with_an_outlier_channel():
    g = torch.Generator().manual_seed(1)
    k = torch.randn(512, 1, 64, generator=g)
    q = torch.randn(1, 1, 64, generator=g)
    k[..., 5] *= 30  # an outlier channel, as in real keys
    q[..., 5] *= 5
    r = key_rotation_matrix(64, torch.float32)

    def logit_error(kk, qq):
        s = kk.abs().max() * 2 / 448
        kq = ref.dequantize(ref.quantize(kk, torch.float8_e4m3fn, s), torch.float32, s)
        return ((kq - kk)[:, 0] @ qq[0, 0]).abs().mean()

    assert logit_error(rotate_heads(k, r), rotate_heads(q, r)) < 0.5 * logit_error(k, q)
