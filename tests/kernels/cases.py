"""Kernel test cases shared by the CPU tests (pytest, Triton interpreter) and the GPU
script (benchmarks/gpu_check.py, real shapes, no pytest there): batch builders, case
tables and checks that raise AssertionError with the measured error.

Imports torch and kvpilot.kernels only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from kvpilot.kernels import reference as ref
from kvpilot.kernels.kv4 import GROUP_SCALE_DTYPE, GROUP_SCALE_MAX, GROUP_SIZE, KV4_FORMATS

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
KV4 = tuple(KV4_FORMATS)  # 4-bit cache formats, named by string (storage is uint8)

# (atol = rtol, relative-norm bound) of a kernel's output against the fp32 torch reference
# computed from the same cache contents. bf16/fp16 outputs carry one rounding of the output
# (the interpreter truncates instead of rounding: up to 1 ulp = 2^-7 relative for bf16)
# and, on the GPU, the bf16 rounding of the softmax weights before the P @ V product.
TOLERANCES = {
    torch.float32: (2e-5, 1e-5),
    torch.float16: (4e-3, 2e-3),
    torch.bfloat16: (2e-2, 8e-3),
}


@dataclass
class PagedBatch:
    """A varlen batch over a paged cache whose prefix K/V are already stored; the new
    tokens' K/V are in ``key``/``value`` with their ``slot_mapping`` (not yet stored)."""

    specs: list[tuple[int, int]]  # per sequence: (cached tokens, new tokens)
    q: torch.Tensor  # [num_new, Hq, D]
    key: torch.Tensor  # [num_new, Hkv, D]
    value: torch.Tensor
    slot_mapping: torch.Tensor  # [num_new] int64
    key_cache: torch.Tensor  # [num_blocks, page, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, width] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    scale: float
    extra: dict[str, Any] = field(default_factory=dict)
    key_group_scales: torch.Tensor | None = None  # 4-bit caches: [num_blocks, page, Hkv, D/16]
    value_group_scales: torch.Tensor | None = None
    kv4_format: str | None = None

    @property
    def kv4(self) -> dict[str, Any]:
        """Keyword arguments naming the 4-bit cache's group scales and format."""
        return {
            "key_group_scales": self.key_group_scales,
            "value_group_scales": self.value_group_scales,
            "kv4_format": self.kv4_format,
        }

    @property
    def max_query_len(self) -> int:
        return max(n for _, n in self.specs)

    @property
    def max_seq_len(self) -> int:
        return max(c + n for c, n in self.specs)


def fp8_scale(x: torch.Tensor, dtype: torch.dtype, headroom: float = 2.0) -> torch.Tensor:
    """The engine's calibration rule: ``headroom * amax / finfo.max`` (fp32, 0-d)."""
    return (x.abs().amax().float() * headroom / torch.finfo(dtype).max).clamp_min(1e-8)


def kv4_tensor_scale(x: torch.Tensor, fmt: str, headroom: float = 2.0) -> torch.Tensor:
    """The engine's 4-bit calibration rule: the largest group scale is E4M3's max / headroom."""
    return (x.abs().amax().float() * headroom / (KV4_FORMATS[fmt].qmax * GROUP_SCALE_MAX)).clamp_min(1e-8)


def make_paged_batch(
    specs: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    page: int,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | str | None = None,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random Q/K/V, blocks placed at random (non-contiguous, shuffled) in a pool with
    ``spare_blocks`` unused; the cached prefix stored with the reference ``store_kv``
    (quantized for FP8 caches, scales from the data as the engine calibrates them)."""
    device = torch.device(device)
    cache_dtype = cache_dtype or dtype
    lens = [c + n for c, n in specs]
    nblocks = [math.ceil(n / page) for n in lens]
    total = sum(nblocks) + spare_blocks
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(total, generator=g)
    width = max(nblocks)
    tables = torch.zeros(len(specs), width, dtype=torch.int32)
    at = 0
    for i, nb in enumerate(nblocks):
        tables[i, :nb] = perm[at : at + nb]
        at += nb
    gd = torch.Generator(device=device).manual_seed(seed)
    num_tokens = sum(lens)
    k_all = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gd, device=device).to(dtype)
    v_all = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gd, device=device).to(dtype)
    lens_t = torch.tensor(lens, device=device)
    seq_id = torch.repeat_interleave(torch.arange(len(specs), device=device), lens_t)
    starts = torch.cumsum(lens_t, 0) - lens_t
    pos = torch.arange(num_tokens, device=device) - starts[seq_id]
    bt = tables.to(device)
    slots = bt[seq_id, pos // page].long() * page + pos % page
    ctx = torch.tensor([c for c, _ in specs], device=device)
    cached = pos < ctx[seq_id]
    kv4: dict[str, Any] = {}
    if isinstance(cache_dtype, str):  # a 4-bit format
        k_scale, v_scale = kv4_tensor_scale(k_all, cache_dtype), kv4_tensor_scale(v_all, cache_dtype)
        kc = torch.zeros(total, page, num_kv_heads, head_dim // 2, dtype=torch.uint8, device=device)
        groups = (total, page, num_kv_heads, head_dim // GROUP_SIZE)
        kv4 = {
            "key_group_scales": torch.zeros(groups, device=device).to(GROUP_SCALE_DTYPE),
            "value_group_scales": torch.zeros(groups, device=device).to(GROUP_SCALE_DTYPE),
            "kv4_format": cache_dtype,
        }
    else:
        quant = cache_dtype in FP8
        k_scale = fp8_scale(k_all, cache_dtype) if quant else None
        v_scale = fp8_scale(v_all, cache_dtype) if quant else None
        kc = torch.zeros(total, page, num_kv_heads, head_dim, dtype=cache_dtype, device=device)
    vc = torch.zeros_like(kc)
    ref.store_kv(k_all[cached], v_all[cached], kc, vc, slots[cached], k_scale, v_scale, **kv4)
    new = ~cached
    num_new = int(new.sum())
    q = torch.randn(num_new, num_kv_heads * group, head_dim, generator=gd, device=device).to(dtype)
    qsl = torch.tensor(
        [0, *torch.cumsum(torch.tensor([n for _, n in specs]), 0).tolist()], dtype=torch.int32
    )
    return PagedBatch(
        specs=list(specs),
        q=q,
        key=k_all[new],
        value=v_all[new],
        slot_mapping=slots[new],
        key_cache=kc,
        value_cache=vc,
        block_tables=bt,
        query_start_loc=qsl.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        k_scale=k_scale,
        v_scale=v_scale,
        scale=head_dim**-0.5,
        **kv4,
    )


def store_new_tokens_reference(b: PagedBatch) -> None:
    ref.store_kv(b.key, b.value, b.key_cache, b.value_cache, b.slot_mapping, b.k_scale, b.v_scale, **b.kv4)


def reference_attention(b: PagedBatch) -> torch.Tensor:
    """fp32 oracle over the batch's cache contents (new tokens must be stored)."""
    return ref.paged_attention(
        b.q.float(),
        b.key_cache,
        b.value_cache,
        b.block_tables,
        b.query_start_loc,
        b.seq_lens,
        b.scale,
        b.k_scale,
        b.v_scale,
        **b.kv4,
    )


def assert_attention_close(
    got: torch.Tensor, expect: torch.Tensor, dtype: torch.dtype, what: str
) -> dict[str, float]:
    """Elementwise ``|got - expect| <= tol * (1 + |expect|)`` and a relative-norm bound.
    Returns the measured errors."""
    tol, rel_bound = TOLERANCES[dtype]
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    got = got.float()
    err = (got - expect).abs()
    max_err = float(err.max()) if err.numel() else 0.0
    rel = float((got - expect).norm() / expect.norm().clamp_min(1e-30))
    worst = float((err / (1 + expect.abs())).max()) if err.numel() else 0.0
    assert worst <= tol, f"{what}: max |err| {max_err:.3g} (scaled {worst:.3g}) > tol {tol}"
    assert rel <= rel_bound, f"{what}: relative error {rel:.3g} > {rel_bound}"
    return {"max_abs_err": max_err, "rel_err": rel}


# --------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class AttnCase:
    """One attention test: shapes, dtypes, sequences and optional launch overrides."""

    id: str
    group: int
    num_kv_heads: int
    head_dim: int
    page: int
    dtype: torch.dtype
    cache_dtype: torch.dtype | str  # a str names a 4-bit format (KV4)
    specs: tuple[tuple[int, int], ...]
    num_splits: int | None = None
    config: tuple[tuple[str, int], ...] = ()

    def batch(self, device: str | torch.device = "cpu", seed: int = 0) -> PagedBatch:
        return make_paged_batch(
            list(self.specs),
            num_kv_heads=self.num_kv_heads,
            group=self.group,
            head_dim=self.head_dim,
            page=self.page,
            dtype=self.dtype,
            cache_dtype=self.cache_dtype,
            device=device,
            seed=seed,
        )


F32, BF16, F16, E4M3, E5M2 = (
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
SMALL_TILES = (("BLOCK_N", 16), ("MIN_SPLIT_TOKENS", 16))

# Decode: lengths 1, not multiples of the page, a split per 16 tokens (small tiles) so
# short sequences split, more splits than a short sequence has tiles (empty splits).
DECODE_CASES = [
    AttnCase("g1-f32-p16-d64-auto", 1, 2, 64, 16, F32, F32, ((0, 1), (16, 1), (63, 1), (99, 1))),
    AttnCase(
        "g3-bf16-p8-d64-split3",
        3,
        2,
        64,
        8,
        BF16,
        BF16,
        ((0, 1), (8, 1), (39, 1), (76, 1)),
        3,
        SMALL_TILES,
    ),
    AttnCase(
        "g4-f32-e4m3-p32-d128-split4",
        4,
        2,
        128,
        32,
        F32,
        E4M3,
        ((0, 1), (32, 1), (64, 1), (94, 1)),
        4,
        SMALL_TILES,
    ),
    AttnCase(
        "g8-bf16-e5m2-p16-d64-auto",
        8,
        1,
        64,
        16,
        BF16,
        E5M2,
        ((4, 1), (15, 1), (47, 1)),
        None,
        SMALL_TILES,
    ),
    AttnCase(
        "g3-bf16-e4m3-p16-d128-split2", 3, 1, 128, 16, BF16, E4M3, ((0, 1), (70, 1)), 2, SMALL_TILES
    ),
    AttnCase("g4-f16-p8-d64-direct", 4, 2, 64, 8, F16, F16, ((5, 1), (20, 1)), 1),
]

# Prefill/extend: a single token, fresh prompts, chunks starting and ending mid-block,
# a prefix hit of exactly whole blocks, a long chunk over several query tiles.
PREFILL_SPECS = ((0, 1), (0, 9), (6, 11), (16, 16), (3, 40), (21, 1))
PREFILL_CASES = [
    AttnCase("g1-f32-p16-d64", 1, 2, 64, 16, F32, F32, PREFILL_SPECS),
    AttnCase(
        "g3-bf16-p8-d64-small-tiles",
        3,
        2,
        64,
        8,
        BF16,
        BF16,
        PREFILL_SPECS,
        None,
        (("BLOCK_M", 16), ("BLOCK_N", 16)),
    ),
    AttnCase("g4-f32-e4m3-p32-d128", 4, 1, 128, 32, F32, E4M3, PREFILL_SPECS),
    AttnCase(
        "g8-bf16-e5m2-p16-d64",
        8,
        1,
        64,
        16,
        BF16,
        E5M2,
        PREFILL_SPECS,
        None,
        (("BLOCK_M", 32), ("BLOCK_N", 16)),
    ),
    AttnCase("g3-bf16-e4m3-p16-d128", 3, 1, 128, 16, BF16, E4M3, ((0, 1), (5, 12), (32, 20))),
    AttnCase("g4-f16-p8-d64", 4, 1, 64, 8, F16, F16, ((0, 13), (9, 7))),
]


KV4_PREFILL_CASES = [
    AttnCase("fp4-g1-f32-p16-d64", 1, 2, 64, 16, F32, "fp4_e2m1", PREFILL_SPECS),
    AttnCase("int4-g3-bf16-p8-d64-small-tiles", 3, 2, 64, 8, BF16, "int4", PREFILL_SPECS, None,
             (("BLOCK_M", 16), ("BLOCK_N", 16))),
    AttnCase("int4-g4-f32-p32-d128", 4, 1, 128, 32, F32, "int4", PREFILL_SPECS),
    AttnCase("fp4-g8-bf16-p16-d64", 8, 1, 64, 16, BF16, "fp4_e2m1", PREFILL_SPECS, None,
             (("BLOCK_M", 32), ("BLOCK_N", 16))),
    AttnCase("fp4-g3-f16-p16-d128", 3, 1, 128, 16, F16, "fp4_e2m1", ((0, 1), (5, 12), (32, 20))),
    AttnCase("int4-g1-f32-p8-d96", 1, 2, 96, 8, F32, "int4", ((0, 1), (3, 10), (8, 8))),
]


def run_decode_case(case: AttnCase, device: str | torch.device = "cpu") -> dict[str, float]:
    from kvpilot.kernels.decode_attention import paged_decode_attention

    b = case.batch(device)
    store_new_tokens_reference(b)
    out = paged_decode_attention(
        b.q,
        b.key_cache,
        b.value_cache,
        b.block_tables,
        b.seq_lens,
        b.scale,
        b.k_scale,
        b.v_scale,
        max_seq_len=b.max_seq_len,
        num_splits=case.num_splits,
        config=dict(case.config),
        **b.kv4,
    )
    assert out.dtype == case.dtype and out.shape == b.q.shape
    return assert_attention_close(out, reference_attention(b), case.dtype, f"decode {case.id}")


# 4-bit caches: GQA 1/3/4/8, head_dim 64/128, pages 8/16/32, seq len 1, lengths off the
# page, forced splits (with empty ones), the direct path, bf16/fp16/fp32 queries.
KV4_DECODE_CASES = [
    AttnCase("fp4-g1-f32-p16-d64-auto", 1, 2, 64, 16, F32, "fp4_e2m1", ((0, 1), (16, 1), (63, 1), (99, 1))),
    AttnCase("int4-g3-bf16-p8-d64-split3", 3, 2, 64, 8, BF16, "int4", ((0, 1), (8, 1), (39, 1), (76, 1)), 3,
             SMALL_TILES),
    AttnCase("fp4-g4-f32-p32-d128-split4", 4, 2, 128, 32, F32, "fp4_e2m1", ((0, 1), (32, 1), (64, 1), (94, 1)),
             4, SMALL_TILES),
    AttnCase("int4-g8-bf16-p16-d64-auto", 8, 1, 64, 16, BF16, "int4", ((4, 1), (15, 1), (47, 1)), None,
             SMALL_TILES),
    AttnCase("fp4-g3-bf16-p16-d128-split2", 3, 1, 128, 16, BF16, "fp4_e2m1", ((0, 1), (70, 1)), 2, SMALL_TILES),
    AttnCase("int4-g4-f16-p8-d64-direct", 4, 2, 64, 8, F16, "int4", ((5, 1), (20, 1)), 1),
    AttnCase("fp4-g3-f32-p16-d96-split2", 3, 1, 96, 16, F32, "fp4_e2m1", ((0, 1), (37, 1)), 2, SMALL_TILES),
]


def run_prefill_case(case: AttnCase, device: str | torch.device = "cpu") -> dict[str, float]:
    from kvpilot.kernels.prefill_attention import paged_prefill_attention

    b = case.batch(device)
    store_new_tokens_reference(b)
    out = paged_prefill_attention(
        b.q,
        b.key_cache,
        b.value_cache,
        b.block_tables,
        b.query_start_loc,
        b.seq_lens,
        b.scale,
        b.k_scale,
        b.v_scale,
        max_query_len=b.max_query_len,
        config=dict(case.config),
        **b.kv4,
    )
    assert out.dtype == case.dtype and out.shape == b.q.shape
    return assert_attention_close(out, reference_attention(b), case.dtype, f"prefill {case.id}")


# Store: dtypes in -> cache, heads not a power of two, skipped slots, mid-block slots.
STORE_CASES = [
    ("f32-f32-h3-d64-p16", F32, F32, 3, 64, 16),
    ("bf16-bf16-h8-d128-p8", BF16, BF16, 8, 128, 8),
    ("f16-f16-h2-d64-p32", F16, F16, 2, 64, 32),
    ("f32-e4m3-h3-d64-p32", F32, E4M3, 3, 64, 32),
    ("bf16-e4m3-h8-d128-p16", BF16, E4M3, 8, 128, 16),
    ("bf16-e5m2-h4-d128-p16", BF16, E5M2, 4, 128, 16),
]


def run_store_case(
    case: tuple, device: str | torch.device = "cpu", num_tokens: int = 37, seed: int = 0
) -> None:
    """Kernel and reference write the same bytes; skipped slots stay untouched."""
    from kvpilot.kernels.store_kv import store_kv

    name, dtype, cache_dtype, heads, head_dim, page = case
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    num_blocks = math.ceil(num_tokens / page) * 2 + 1
    # K as a strided view (the model's q/k/v split of one projection), V contiguous.
    qkv = torch.randn(num_tokens, 3 * heads, head_dim, generator=g, device=device).to(dtype)
    k = qkv[:, heads : 2 * heads]
    v = (torch.randn(num_tokens, heads, head_dim, generator=g, device=device) * 3).to(dtype)
    if cache_dtype in FP8:  # outliers beyond the scaled range (clamped) and tiny values
        k[0, 0, :4] = torch.tensor([1e4, -1e4, 1e-6, -1e-6], dtype=dtype)
    cpu = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * page, generator=cpu)[:num_tokens]
    slots[::5] = -1  # skipped: already cached
    slots = slots.to(device)
    quant = cache_dtype in FP8
    ks = fp8_scale(k[1:], cache_dtype) if quant else None
    vs = fp8_scale(v, cache_dtype) if quant else None
    caches = []
    for writer in (ref.store_kv, store_kv):
        kc = torch.full((num_blocks, page, heads, head_dim), 0.5, device=device).to(cache_dtype)
        vc = torch.full_like(kc, 0.5)
        writer(k, v, kc, vc, slots, ks, vs)
        caches.append((kc, vc))
    (rk, rv), (tk, tv) = caches
    for name_, a, b in (("key", rk, tk), ("value", rv, tv)):
        same = a.view(torch.uint8) == b.view(torch.uint8) if quant else a == b
        assert bool(same.all()), (
            f"store {name} {name_}: {int((~same).sum())} elements differ from the reference"
        )
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    flat = tk.view(num_blocks * page, heads, head_dim).float()
    assert bool((flat[untouched] == 0.5).all()), (
        f"store {name}: a slot that was not written changed"
    )


def fp8_rounding_inputs(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of an FP8 format, the midpoints between neighbours (ties),
    points just off the midpoints, and values beyond the range: ``[n]`` fp32."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    vals = torch.unique(codes[torch.isfinite(codes)])
    mids = (vals[1:] + vals[:-1]) / 2
    eps = mids.abs() * 1e-3 + 1e-12
    fmax = torch.finfo(dtype).max
    extra = torch.tensor([fmax * 1.01, -fmax * 1.01, fmax * 100, -fmax * 100, 0.0, -0.0])
    return torch.cat([vals, mids, mids + eps, mids - eps, extra])


def run_fp8_rounding_check(dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
    """The store kernel quantizes exactly like torch (clamp, then round to nearest even)."""
    from kvpilot.kernels.store_kv import store_kv

    x = fp8_rounding_inputs(dtype).to(device)
    n = x.numel()
    head_dim = 64
    pad = (-n) % head_dim
    x = torch.cat([x, torch.zeros(pad, device=x.device)])
    k = x.view(-1, 1, head_dim)
    one = torch.ones((), device=x.device)
    kc = torch.zeros(k.shape[0], 1, 1, head_dim, dtype=dtype, device=x.device)
    vc = torch.zeros_like(kc)
    store_kv(k, k, kc, vc, torch.arange(k.shape[0], device=x.device), one, one)
    expect = ref.quantize(k, dtype, one)
    got = kc.view(-1, 1, head_dim)
    bad = got.view(torch.uint8) != expect.view(torch.uint8)
    if bool(bad.any()):
        i = int(bad.flatten().nonzero()[0])
        raise AssertionError(
            f"{dtype}: {int(bad.sum())} of {n} values quantized differently from torch, e.g. "
            f"{float(k.flatten()[i])!r} -> {float(got.flatten()[i].float())} (torch {float(expect.flatten()[i].float())})"
        )


# 4-bit store: both formats, heads not a power of two, head_dim 64/96/128 (96: half-width
# tiles with masked lanes), pages 8/16/32, bf16/fp16/fp32 inputs.
KV4_STORE_CASES = [
    ("fp4-f32-h3-d64-p16", F32, "fp4_e2m1", 3, 64, 16),
    ("int4-bf16-h8-d128-p8", BF16, "int4", 8, 128, 8),
    ("fp4-f16-h2-d96-p32", F16, "fp4_e2m1", 2, 96, 32),
    ("int4-f32-h3-d96-p16", F32, "int4", 3, 96, 16),
    ("fp4-bf16-h1-d128-p16", BF16, "fp4_e2m1", 1, 128, 16),
]


def run_kv4_store_case(
    case: tuple, device: str | torch.device = "cpu", num_tokens: int = 37, seed: int = 0
) -> None:
    """Kernel and reference write the same codes and group scales; skipped slots stay
    untouched; a group of zeros and a group beyond the calibrated range are included."""
    from kvpilot.kernels.store_kv import store_kv

    name, dtype, fmt, heads, head_dim, page = case
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    num_blocks = math.ceil(num_tokens / page) * 2 + 1
    qkv = torch.randn(num_tokens, 3 * heads, head_dim, generator=g, device=device).to(dtype)
    k = qkv[:, heads : 2 * heads]  # a strided view, as the model's q/k/v split gives it
    v = (torch.randn(num_tokens, heads, head_dim, generator=g, device=device) * 3).to(dtype)
    k_scale, v_scale = kv4_tensor_scale(k, fmt), kv4_tensor_scale(v, fmt)
    k[1, 0, :16] = 0.0  # an all-zero group: scale 0, codes 0
    k[2, 0, 16:32] = 1e4  # far beyond the range: the group scale saturates at E4M3's max
    cpu = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_blocks * page, generator=cpu)
    # 0 and page - 1 are forced below, so they must not be drawn too: a slot written by
    # two tokens keeps whichever write lands last, which the kernel and the reference
    # order differently (at 8,191 tokens on the H200 one row in ~10^4 differed this way).
    slots = slots[(slots != 0) & (slots != page - 1)][:num_tokens]
    slots[::5] = -1
    slots[1:3] = torch.tensor([0, page - 1])  # keep the special tokens stored
    stored = slots[slots >= 0]
    assert stored.unique().numel() == stored.numel(), "every stored token needs its own slot"
    slots = slots.to(device)
    written = []
    for writer in (ref.store_kv, store_kv):
        kc = torch.full((num_blocks, page, heads, head_dim // 2), 0x5A, dtype=torch.uint8, device=device)
        vc = kc.clone()
        groups = (num_blocks, page, heads, head_dim // GROUP_SIZE)
        kg = torch.full(groups, 0.5, device=device).to(GROUP_SCALE_DTYPE)
        vg = kg.clone()
        writer(k, v, kc, vc, slots, k_scale, v_scale, key_group_scales=kg, value_group_scales=vg, kv4_format=fmt)
        written.append((kc, vc, kg.view(torch.uint8), vg.view(torch.uint8)))
    for what, a, b in zip(("key codes", "value codes", "key scales", "value scales"), *written):
        same = a == b
        assert bool(same.all()), f"store {name} {what}: {int((~same).sum())} bytes differ from the reference"
    kc, _, kg, _ = written[1]
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert bool((kc.view(num_blocks * page, -1)[untouched] == 0x5A).all()), f"store {name}: unwritten slot changed"
    half = torch.tensor(0.5).to(GROUP_SCALE_DTYPE).view(torch.uint8).to(device)
    assert bool((kg.view(num_blocks * page, -1)[untouched] == half).all()), f"store {name}: unwritten scale changed"
