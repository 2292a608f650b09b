"""The GPU check: every kernel test at real shapes, then the paged-decode benchmark of the
KV cache dtypes (bf16, FP8 E4M3, int4, fp4_e2m1) side by side, in one run.

Each section runs in its own process (a kernel fault or a hang in one does not lose the
others) and writes ``<out>/<section>.json``; the parent writes ``<out>/summary.json`` and
prints a markdown table.

    python benchmarks/gpu_check.py --out gpu_results           # on the H200
    python benchmarks/gpu_check.py --smoke --out /tmp/gpu      # CPU, Triton interpreter, tiny

Sections:
  env           torch / triton / device, and the device-to-device copy bandwidth
  kernel_tests  the CPU test tables of tests/kernels/cases.py on the device, plus real
                shapes (Llama-3-8B attention: 32 q / 8 KV heads, head_dim 128, page 16;
                contexts up to 8,191, prefill chunks up to 1,024) for every cache dtype
  decode_bench  paged decode, batch 64 x 4,096 context and 1 x 32,768 (a batch that is
                bound by KV reads, and one long context): median time of our split-KV kernel
                per cache dtype, L2 flushed before every run; bytes = K + V read (group scales
                included) + Q + O; speed-up against our bf16 decode in the same run.
                Goal: 4-bit at least 2.5x bf16 at batch 64 x 4,096. Baseline in the same
                run: torch SDPA (flash) over contiguous bf16 K/V of the same shape
                (row ``sdpa_contiguous_bf16``; its "vs bf16" is our paged bf16 time over
                SDPA's, so above 1 means SDPA is faster).

  moe           one MoE forward, the Triton fused kernel (kvpilot.kernels.fused_moe) against
                the torch reference loop over experts, same inputs (benchmarks/moe_forward.py):
                max abs difference, median time of each over 20 runs and the ratio reference /
                fused (above 1: fused is faster). Shapes: Mixtral-8x7B's layer (hidden 4,096,
                intermediate 14,336, top-2 of 8) at 16 and 2,048 tokens in bf16, Qwen3-30B-A3B's
                (hidden 2,048, intermediate 768, top-8 of 128) at 1,024 tokens, and a small fp32
                case (IEEE products, so the two should agree to rounding).

  lora          multi-LoRA SGMV (kvpilot.kernels.lora_sgmv.sgmv_lora) on a Llama-3-8B-like
                projection, bf16: in 4,096, out 4,096 and 14,336, 8 adapter slots of R 16
                (some of rank 8 and 4, their zero tails skipped), a decode batch of 32
                single-token segments (slot -1 and repeated slots among them) and a prefill
                of 4 x 512-token segments. Checked against the torch reference on the same
                inputs (elementwise within 2e-2 + 2e-2 |want|: the section fails otherwise);
                on CUDA timed against the base projection (x @ W^T, cuBLAS) of the same shape:
                median of 50 CUDA-graph replays each (GPU time, no launch cost; capturing
                also shows the launcher never syncs), the eager call's time, and the ratio
                LoRA / base.

  quant_gemm    quantized linear layers (kvpilot.kernels.quant_gemm) at Llama-3-8B's projection
                shapes (K x N: 4,096 x 4,096, 4,096 x 14,336, 14,336 x 4,096), bf16 activations:
                FP8 W8A8 (per-channel weights, dynamic per-token activations, quantizer included)
                at 4,096 tokens, goal >= 1.6x bf16; W4A16 (group 128, asymmetric) at 1, 4 and 16
                tokens, goal >= 2x bf16; INT8 W8A8 at 4,096 tokens and FP8 block-wise 128 x 128
                (4,096 x 4,096) for information. Each row checked against the torch reference on
                the same inputs (elementwise within f x 1e-2 x (|want| + rms(want)), f = 3 for
                FP8 W8A8 (Hopper's FP8 accumulator), else 1: the section fails otherwise); on CUDA
                timed against bf16 torch.matmul of the same shape: median of 30 CUDA-graph replays,
                L2 flushed before each, the speed-up bf16 / kernel (and, for W8A8, the
                quantizer's time and the GEMM's alone). A few alternative launch settings are
                timed beside the defaults (W4A16 at 1 and 16 tokens, FP8 on the first shape) while
                the section is under 40 s: the best is reported, to tune the defaults.

A kernel_tests section killed at its timeout keeps the tests it finished (the JSON is
rewritten after each test).

Needs only torch and triton (the GPU machine has nothing else): the repo's ``src`` and
root are put on ``sys.path``. ``--smoke`` sets ``TRITON_INTERPRET=1`` for the sections and
shrinks every shape so the whole run takes well under a minute on CPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("env", "kernel_tests", "decode_bench", "decode_tune", "engine", "moe", "lora", "quant_gemm")
CACHE_DTYPES = ("bfloat16", "fp8_e4m3", "int4", "fp4_e2m1")


def _setup_path() -> None:
    for p in (ROOT / "src", ROOT):
        if str(p) not in sys.path:
            sys.path.insert(0, str(p))


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------- env
def section_env(smoke: bool) -> dict:
    import torch
    import triton

    device = _device()
    info = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu (Triton interpreter)",
            "interpreter": os.environ.get("TRITON_INTERPRET", "0")}
    n = (1 << 20) if smoke else (1 << 30)  # bytes copied
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = _time(lambda: dst.copy_(src), device, reps=3 if smoke else 20, flush=None)
    info["copy_bandwidth_tb_s"] = 2 * n / statistics.median(times) / 1e12  # read + write
    return info


# ----------------------------------------------------------------------------- timing
def _time(fn, device, reps: int, flush) -> list[float]:
    """Seconds per call, each run after ``flush()`` (L2) when given; CUDA events on GPU."""
    import torch

    fn()  # compile / warm up
    _sync(device)
    out = []
    for _ in range(reps):
        if flush is not None:
            flush()
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            out.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


# ----------------------------------------------------------------------------- tests
def _real_cases():
    import torch
    from tests.kernels.cases import AttnCase

    bf16, e4m3 = torch.bfloat16, torch.float8_e4m3fn
    decode_specs = ((0, 1), (4095, 1), (4096, 1), (333, 1), (8190, 1))
    prefill_specs = ((0, 1024), (1000, 37), (4096, 512), (15, 1), (16, 16))
    decode, prefill = [], []
    for name, cache in (("bf16", bf16), ("e4m3", e4m3), ("int4", "int4"), ("fp4", "fp4_e2m1")):
        decode.append(AttnCase(f"real-{name}-g4-d128-p16", 4, 8, 128, 16, bf16, cache, decode_specs))
        prefill.append(AttnCase(f"real-{name}-g4-d128-p16", 4, 8, 128, 16, bf16, cache, prefill_specs))
    decode.append(AttnCase("real-fp4-g3-d64-p16-smollm2", 3, 3, 64, 16, bf16, "fp4_e2m1", decode_specs))
    prefill.append(AttnCase("real-int4-g3-d64-p16-smollm2", 3, 3, 64, 16, bf16, "int4", prefill_specs))
    return decode, prefill


def section_kernel_tests(smoke: bool, progress: Path | None = None) -> dict:
    import torch
    from tests.kernels import cases as c

    device = _device()
    jobs = []
    tables = [("decode", c.DECODE_CASES + c.KV4_DECODE_CASES, c.run_decode_case),
              ("prefill", c.PREFILL_CASES + c.KV4_PREFILL_CASES, c.run_prefill_case)]
    for kind, table, runner in tables:
        for case in (table[:1] + table[-1:]) if smoke else table:
            jobs.append((f"{kind} {case.id}", lambda case=case, runner=runner: runner(case, device)))
    for case in (c.STORE_CASES[:1] if smoke else c.STORE_CASES):
        jobs.append((f"store {case[0]}", lambda case=case: c.run_store_case(case, device, 37 if smoke else 8191)))
    for case in (c.KV4_STORE_CASES[:1] if smoke else c.KV4_STORE_CASES):
        jobs.append((f"store {case[0]}", lambda case=case: c.run_kv4_store_case(case, device, 37 if smoke else 8191)))
    for dtype in c.FP8[:1] if smoke else c.FP8:
        jobs.append((f"fp8 rounding {dtype}", lambda dtype=dtype: c.run_fp8_rounding_check(dtype, device)))
    if not smoke:
        decode, prefill = _real_cases()
        jobs += [(f"decode {x.id}", lambda x=x: c.run_decode_case(x, device)) for x in decode]
        jobs += [(f"prefill {x.id}", lambda x=x: c.run_prefill_case(x, device)) for x in prefill]
    results = []
    for name, job in jobs:
        t0 = time.perf_counter()
        try:
            measured = job()
            results.append({"test": name, "ok": True, "seconds": round(time.perf_counter() - t0, 2),
                            **(measured or {})})
        except Exception as e:  # recorded, the other tests still run
            results.append({"test": name, "ok": False, "error": f"{type(e).__name__}: {e}"})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if progress is not None:  # a section killed at its timeout keeps what it finished
            progress.write_text(json.dumps({"section": "kernel_tests", "ok": False, "partial": True,
                                            "done": len(results), "of": len(jobs), "results": results}, indent=2))
    return {"passed": sum(r["ok"] for r in results), "failed": sum(not r["ok"] for r in results),
            "results": results}


# ----------------------------------------------------------------------------- decode bench
def _decode_inputs(cache_dtype: str, batch: int, ctx: int, hq: int, hkv: int, d: int, page: int, device, seed=0):
    """Random paged caches of ``cache_dtype`` (valid codes and scales; values do not matter
    for speed), shuffled block tables, and the kernel's keyword arguments."""
    import torch

    from kvpilot.kernels.kv4 import GROUP_SCALE_DTYPE

    g = torch.Generator(device=device).manual_seed(seed)
    nb = batch * (-(-ctx // page))
    tables = torch.randperm(nb, device=device, generator=g).view(batch, -1).to(torch.int32)
    q = torch.randn(batch, hq, d, device=device, generator=g).to(torch.bfloat16)
    one = torch.ones((), device=device)
    kw: dict = {}
    if cache_dtype in ("int4", "fp4_e2m1"):
        kc = torch.randint(0, 256, (nb, page, hkv, d // 2), device=device, generator=g, dtype=torch.uint8)
        vc = torch.randint_like(kc, 0, 256)
        gs = (torch.rand(nb, page, hkv, d // 16, device=device, generator=g) + 0.1).to(GROUP_SCALE_DTYPE)
        kw = {"key_group_scales": gs, "value_group_scales": gs.clone(), "kv4_format": cache_dtype}
        scales = (one * 0.01, one * 0.01)
    else:
        dtype = torch.bfloat16 if cache_dtype == "bfloat16" else torch.float8_e4m3fn
        kc = torch.randn(nb, page, hkv, d, device=device, generator=g).to(dtype)
        vc = torch.randn(nb, page, hkv, d, device=device, generator=g).to(dtype)
        scales = (one, one) if dtype != torch.bfloat16 else (None, None)
    kv_bytes = sum(t.numel() * t.element_size() for t in (kc, vc))
    kv_bytes += sum(t.numel() * t.element_size() for t in (kw.get("key_group_scales"), kw.get("value_group_scales"))
                    if t is not None)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
    return q, kc, vc, tables, seq_lens, scales, kw, kv_bytes


def _sdpa_baseline_row(batch: int, ctx: int, hq: int, hkv: int, d: int, device, flush, smoke: bool,
                       paged_bf16_s: float) -> dict:
    """The named baseline: torch SDPA (flash on CUDA) over *contiguous* bf16 K/V of the
    same shape, one query token per sequence. No paging, no block-table indirection: the
    speed a paged kernel should approach. ``speedup_vs_bf16`` > 1 means SDPA is faster
    than our paged bf16 decode."""
    import torch
    import torch.nn.functional as F

    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(batch, hq, 1, d, device=device, generator=g).to(torch.bfloat16)
    k = torch.randn(batch, hkv, ctx, d, device=device, generator=g).to(torch.bfloat16)
    v = torch.randn_like(k)
    kv_bytes = 2 * k.numel() * k.element_size()

    def call(q=q, k=k, v=v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    sec = statistics.median(_time(call, device, reps=1 if smoke else 30, flush=flush))
    out = call()
    del call
    row = {"batch": batch, "context": ctx, "kv_cache_dtype": "sdpa_contiguous_bf16", "median_us": sec * 1e6,
           "bandwidth_tb_s": (kv_bytes + 2 * q.numel() * q.element_size()) / sec / 1e12, "kv_bytes": kv_bytes,
           "speedup_vs_bf16": paged_bf16_s / sec, "finite": bool(torch.isfinite(out).all())}
    del q, k, v, out
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def section_decode_bench(smoke: bool) -> dict:
    import torch

    from kvpilot.kernels.decode_attention import paged_decode_attention

    device = _device()
    hq, hkv, d, page = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    shapes = [(2, 40)] if smoke else [(64, 4096), (1, 32768)]
    flush_buf = torch.empty(1 << 20 if smoke else 256 << 20, dtype=torch.uint8, device=device)
    flush = None if smoke else (lambda: flush_buf.zero_())
    rows = []
    for batch, ctx in shapes:
        base_s = None
        for cache_dtype in CACHE_DTYPES:
            q, kc, vc, tables, lens, (ks, vs), kw, kv_bytes = _decode_inputs(
                cache_dtype, batch, ctx, hq, hkv, d, page, device)
            out = torch.empty_like(q)

            def call(q=q, kc=kc, vc=vc, tables=tables, lens=lens, ks=ks, vs=vs, kw=kw, out=out, ctx=ctx):
                paged_decode_attention(q, kc, vc, tables, lens, d**-0.5, ks, vs, max_seq_len=ctx, out=out, **kw)

            times = _time(call, device, reps=1 if smoke else 30, flush=flush)
            sec = statistics.median(times)
            moved = kv_bytes + 2 * q.numel() * q.element_size()
            base_s = sec if cache_dtype == "bfloat16" else base_s
            rows.append({"batch": batch, "context": ctx, "kv_cache_dtype": cache_dtype, "median_us": sec * 1e6,
                         "bandwidth_tb_s": moved / sec / 1e12, "kv_bytes": kv_bytes,
                         "speedup_vs_bf16": base_s / sec, "finite": bool(torch.isfinite(out).all())})
            del q, kc, vc, kw, out
            if device.type == "cuda":
                torch.cuda.empty_cache()
        rows.append(_sdpa_baseline_row(batch, ctx, hq, hkv, d, device, flush, smoke, base_s))
    goal = next((r["speedup_vs_bf16"] for r in rows
                 if (r["batch"], r["context"], r["kv_cache_dtype"]) == (64, 4096, "fp4_e2m1")), None)
    return {"shapes": {"num_heads": hq, "num_kv_heads": hkv, "head_dim": d, "page": page},
            "rows": rows, "fp4_speedup_goal_2_5x_met": None if goal is None else goal >= 2.5}


# ----------------------------------------------------------------------------- decode tune
TUNE_CONFIGS = [{"BLOCK_N": n, "num_warps": w, "num_stages": st}
                for n in (32, 64, 128) for w in (4, 8) for st in (2, 3)]


def section_decode_tune(smoke: bool) -> dict:
    """The paged decode's launch settings swept per cache dtype and shape: BLOCK_N x
    num_warps x num_stages (and, for one long sequence, the number of splits), median of
    10 runs with L2 flushed, so :func:`kvpilot.kernels.decode_attention.default_config`
    is chosen from measurements. Reports every point and the best per (shape, dtype)."""
    import torch

    from kvpilot.kernels.decode_attention import paged_decode_attention

    device = _device()
    hq, hkv, d, page = (4, 2, 64, 16) if smoke else (32, 8, 128, 16)
    shapes = [(2, 40)] if smoke else [(64, 4096), (1, 32768)]
    configs = TUNE_CONFIGS[:2] if smoke else TUNE_CONFIGS
    flush_buf = torch.empty(1 << 20 if smoke else 256 << 20, dtype=torch.uint8, device=device)
    flush = None if smoke else (lambda: flush_buf.zero_())
    points, best = [], {}
    for batch, ctx in shapes:
        splits_options = [None] if batch > 1 or smoke else [None, 128]
        for cache_dtype in CACHE_DTYPES:
            q, kc, vc, tables, lens, (ks, vs), kw, kv_bytes = _decode_inputs(
                cache_dtype, batch, ctx, hq, hkv, d, page, device)
            out = torch.empty_like(q)
            for cfg in configs:
                for splits in splits_options:
                    call = functools.partial(paged_decode_attention, q, kc, vc, tables, lens, d**-0.5, ks, vs,
                                             max_seq_len=ctx, out=out, config=cfg, num_splits=splits, **kw)
                    try:
                        sec = statistics.median(_time(call, device, reps=1 if smoke else 10, flush=flush))
                    except Exception as e:  # a config that does not compile (shared memory) is a data point
                        points.append({"batch": batch, "context": ctx, "kv_cache_dtype": cache_dtype, **cfg,
                                       "num_splits": splits, "error": f"{type(e).__name__}: {str(e)[:200]}"})
                        continue
                    row = {"batch": batch, "context": ctx, "kv_cache_dtype": cache_dtype, **cfg,
                           "num_splits": splits, "median_us": sec * 1e6,
                           "bandwidth_tb_s": (kv_bytes + 2 * q.numel() * q.element_size()) / sec / 1e12}
                    points.append(row)
                    key = f"{batch}x{ctx}/{cache_dtype}"
                    if key not in best or row["median_us"] < best[key]["median_us"]:
                        best[key] = row
            del q, kc, vc, kw, out
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"points": points, "best": best}


# ----------------------------------------------------------------------------- engine
def section_engine(smoke: bool) -> dict:
    """The whole engine on the device: Llama-3-8B architecture with random weights
    (``preset:llama-3-8b``, ``load_format="dummy"``), N requests of random token ids
    (seeded, lengths uniform in [lo, hi]) and exactly ``output_len`` output tokens each
    (``ignore_eos``), per KV cache dtype. Reports output and total tokens/s, the KV cache
    capacity in tokens and the wall time of the first step (Triton compile included)."""
    import gc
    import random

    import torch

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.model_runner import load_model
    from kvpilot.engine.sampling_params import SamplingParams

    model, n, lo, hi, output_len = (("preset:tiny-gqa3", 4, 8, 24, 4) if smoke
                                    else ("preset:llama-3-8b", 256, 256, 1024, 256))
    rng = random.Random(0)
    top = 500 if smoke else 20000  # token ids inside the preset's vocabulary
    prompts = [[rng.randrange(10, top) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    rows = []
    t0 = time.perf_counter()
    loaded = load_model(EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True))
    load_s = time.perf_counter() - t0
    for kv in ("auto", "fp8_e4m3", "fp4_e2m1"):
        try:
            llm = LLM(loaded=loaded, model=model, load_format="dummy", kv_cache_dtype=kv, skip_tokenizer_init=True,
                      max_num_batched_tokens=8192 if not smoke else 64, max_num_seqs=256 if not smoke else 8,
                      gpu_memory_utilization=0.85)
            t1 = time.perf_counter()
            llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            first_s = time.perf_counter() - t1
            t2 = time.perf_counter()
            results = llm.generate(prompts, params)
            sec = time.perf_counter() - t2
            out_tokens = sum(len(c.token_ids) for r in results for c in r.outputs)
            in_tokens = sum(len(p) for p in prompts)
            rows.append({"kv_cache_dtype": kv, "ok": out_tokens == n * output_len, "load_s": round(load_s, 1),
                         "warmup_s": round(first_s, 1), "seconds": round(sec, 2),
                         "output_tok_s": out_tokens / sec, "total_tok_s": (in_tokens + out_tokens) / sec,
                         "kv_capacity_tokens": llm.engine.config.num_blocks * llm.engine.config.block_size,
                         "device": str(llm.engine.config.device)})
            del llm, results
        except Exception as e:  # recorded; the next dtype still runs
            rows.append({"kv_cache_dtype": kv, "ok": False, "error": f"{type(e).__name__}: {e}",
                         "trace": traceback.format_exc()[-3000:]})
        gc.collect()  # the KV cache of this dtype goes before the next one is sized
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return {"model": model, "requests": n, "prompt_len": [lo, hi], "output_len": output_len,
            "ok": all(r["ok"] for r in rows), "rows": rows}


# ----------------------------------------------------------------------------- moe
MOE_SHAPES = (  # tokens, hidden, intermediate, experts, top-k, dtype
    (16, 4096, 14336, 8, 2, "bfloat16"),     # Mixtral-8x7B, decode-sized batch
    (2048, 4096, 14336, 8, 2, "bfloat16"),   # Mixtral-8x7B, a prefill chunk
    (1024, 2048, 768, 128, 8, "bfloat16"),   # Qwen3-30B-A3B: many small experts
    (256, 1024, 512, 8, 2, "float32"),       # IEEE on both sides: agreement to rounding
)


def section_moe(smoke: bool) -> dict:
    """benchmarks/moe_forward.py's :func:`measure` per shape; a shape that fails is a row
    with its error, the others still run."""
    import torch
    from moe_forward import measure  # this folder is sys.path[0] (the script runs as a file)

    device = _device()
    shapes = [(8, 64, 48, 8, 2, "float32")] if smoke else MOE_SHAPES
    rows = []
    for tokens, hidden, inter, experts, topk, dtype in shapes:
        try:
            rows.append(measure(tokens, hidden, inter, experts, topk, dtype, device.type,
                                repeats=1 if smoke else 20))
        except Exception as e:  # recorded; the next shape still runs
            rows.append({"shape": {"tokens": tokens, "hidden": hidden, "intermediate": inter,
                                   "experts": experts, "topk": topk}, "dtype": dtype, "ok": False,
                         "error": f"{type(e).__name__}: {e}"})
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"ok": all(r["ok"] for r in rows), "rows": rows}


# ----------------------------------------------------------------------------- lora
LORA_SLOTS, LORA_WIDTH = 8, 16
LORA_RANKS = (16, 16, 8, 16, 4, 16, 16, 8)  # per slot; the rest of the 16 rows are zero


def _lora_segments(kind: str, smoke: bool) -> tuple[list[int], list[int]]:
    """(segment lengths, slot per segment): a decode batch of single-token segments with
    slot -1 (the base model) and repeated slots among them, or a prefill of long ones."""
    if kind == "decode":
        n = 4 if smoke else 32
        return [1] * n, [(i * 5) % (LORA_SLOTS + 1) - 1 for i in range(n)]
    n, length = (2, 20) if smoke else (4, 512)
    return [length] * n, [2, 5, 2, 7][:n]


def _lora_row(kind: str, in_features: int, out_features: int, device, smoke: bool) -> dict:
    import torch

    from kvpilot.kernels.lora_sgmv import sgmv_lora, sgmv_lora_reference

    lens, slots = _lora_segments(kind, smoke)
    tokens = sum(lens)
    g = torch.Generator(device="cpu").manual_seed(out_features + tokens)
    bf16 = torch.bfloat16
    x = torch.randn(tokens, in_features, generator=g).to(device, bf16)
    w = (torch.randn(out_features, in_features, generator=g) / in_features**0.5).to(device, bf16)
    a = torch.randn(LORA_SLOTS, LORA_WIDTH, in_features, generator=g) / in_features**0.5
    b = torch.randn(LORA_SLOTS, out_features, LORA_WIDTH, generator=g) / LORA_WIDTH**0.5
    for slot, rank in enumerate(LORA_RANKS):
        a[slot, rank:] = 0.0
        b[slot, :, rank:] = 0.0
    a, b = a.to(device, bf16), b.to(device, bf16)
    starts = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32, device=device)
    seg_slots = torch.tensor(slots, dtype=torch.int32, device=device)
    ranks = torch.tensor(LORA_RANKS, dtype=torch.int32, device=device)
    y = x @ w.t()  # the base projection's output, which the LoRA delta is added to
    got, want = y.clone(), y.clone()
    sgmv_lora(got, x, a, b, starts, seg_slots, ranks)
    sgmv_lora_reference(want, x, a, b, starts, seg_slots, ranks)
    err = (got.float() - want.float()).abs()
    bound = 2e-2 + 2e-2 * want.float().abs()
    base_rows = torch.repeat_interleave(seg_slots < 0, torch.tensor(lens, device=device))
    row = {"batch": f"{kind} {len(lens)} x {lens[0]}", "tokens": tokens, "segments": len(lens),
           "in": in_features, "out": out_features, "slots": LORA_SLOTS, "width": LORA_WIDTH,
           "dtype": "bfloat16", "max_abs_diff": float(err.max()), "worst_over_bound": float((err / bound).max()),
           "ok": bool((err <= bound).all()) and bool(torch.isfinite(got).all()),
           "delta_max_abs": float((want.float() - y.float()).abs().max())}
    row["ok"] = row["ok"] and bool(torch.equal(got[base_rows], y[base_rows]))  # slot -1: y as it was
    if device.type != "cuda":  # the interpreter's time says nothing about the kernels
        return row
    out = y.clone()

    def lora(out=out):
        sgmv_lora(out, x, a, b, starts, seg_slots, ranks)

    def base(out=out):
        torch.mm(x, w.t(), out=out)

    reps = 50
    row["lora_eager_us"] = statistics.median(_time(lora, device, reps=reps, flush=None)) * 1e6
    row["base_eager_us"] = statistics.median(_time(base, device, reps=reps, flush=None)) * 1e6
    try:
        graphs = {}
        for name, fn in (("lora", lora), ("base", base)):
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
                fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            graphs[name] = graph
        row["lora_us"] = statistics.median(_time(graphs["lora"].replay, device, reps=reps, flush=None)) * 1e6
        row["base_us"] = statistics.median(_time(graphs["base"].replay, device, reps=reps, flush=None)) * 1e6
        row["timing"] = "cuda graph"
    except Exception as e:  # recorded; the eager times stand in
        row["graph_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["lora_us"], row["base_us"], row["timing"] = row["lora_eager_us"], row["base_eager_us"], "eager"
    row["ratio_lora_over_base"] = row["lora_us"] / row["base_us"]
    return row


def section_lora(smoke: bool) -> dict:
    """:func:`_lora_row` per (batch, out_features); a row that raises is a failed row with
    its error, the others still run. ok only if every row agrees with the reference."""
    import torch

    device = _device()
    in_features, outs = (64, (48, 80)) if smoke else (4096, (4096, 14336))
    rows = []
    for kind in ("decode", "prefill"):
        for out_features in outs:
            try:
                rows.append(_lora_row(kind, in_features, out_features, device, smoke))
            except Exception as e:  # recorded; the next shape still runs
                rows.append({"batch": kind, "in": in_features, "out": out_features, "ok": False,
                             "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"ok": all(r["ok"] for r in rows), "ranks": list(LORA_RANKS), "rows": rows}


# ----------------------------------------------------------------------------- quant_gemm
QGEMM_SHAPES = ((4096, 4096), (4096, 14336), (14336, 4096))  # (K, N): Llama-3-8B's projections, in x out
QGEMM_DECODE_TOKENS = (1, 4, 16)
QGEMM_PREFILL_TOKENS = 4096
QGEMM_SWEEP_SECONDS = 40  # the launch-settings sweeps stop once the section has run this long
# Alternatives to the default launch settings, timed beside it (decode W4A16; FP8 W8A8 prefill).
QGEMM_W4_SWEEP = ({"BLOCK_N": 16, "SPLIT_K": 1}, {"BLOCK_N": 16, "SPLIT_K": 2}, {"BLOCK_N": 64, "SPLIT_K": 4})
QGEMM_FP8_SWEEP = (
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 4},
    {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 256, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
)


def _graph_us(fn, device, reps: int, flush) -> tuple[float, str, str | None]:
    """Median microseconds of ``fn`` replayed from a CUDA graph (GPU time, no launch
    cost; capturing also shows the launcher never syncs), each replay after ``flush()``;
    the eager calls' median when capture fails. Returns (us, "cuda graph"/"eager", error)."""
    import torch

    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm-up (compile) off the default stream, as capture wants
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return statistics.median(_time(graph.replay, device, reps=reps, flush=flush)) * 1e6, "cuda graph", None
    except Exception as e:  # recorded; the eager time stands in
        err = f"{type(e).__name__}: {str(e)[:300]}"
        return statistics.median(_time(fn, device, reps=reps, flush=flush)) * 1e6, "eager", err


def _qgemm_case(kind: str, m: int, k: int, n: int, device, seed: int):
    """(kernel call, reference call, tolerance factor) for random quantized weights of
    ``kind`` at [m, k] x [n, k]^T, bf16 activations ~ N(0, 1), weights of O(1/sqrt(k))
    so outputs are O(1); the call takes an optional launch ``config``."""
    import torch

    from kvpilot.kernels import quant_gemm as qg

    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device, torch.bfloat16)
    std = k**-0.5
    if kind == "w4a16_g128":
        group = min(128, k)
        q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.uint8).to(device)
        scales = (torch.rand(n, k // group, generator=g) * 0.5 + 0.75) * (std / 4.6)  # codes - 8 have std 4.6
        zeros = torch.randint(6, 11, scales.shape, generator=g).float()
        s, o = scales.to(device, torch.bfloat16), (-zeros * scales).to(device, torch.bfloat16)
        args = (x, q, s, o, 4, group)
        return (lambda config=None: qg.wna16_gemm(*args, config=config)), (lambda: qg.wna16_gemm_reference(*args)), 1.0
    if kind == "int8_w8a8":
        w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8).to(device)
        ws = torch.full((n,), std / 73.0, device=device)  # uniform codes have std 73
        return ((lambda config=None: qg.int8_gemm(x, w, ws, config=config)),
                (lambda: qg.int8_gemm_reference(x, w, ws)), 1.0)
    block = (128, 128) if kind == "fp8_block128_w8a8" else None
    w = (torch.randn(n, k, generator=g) * 64).to(device, torch.float8_e4m3fn)
    shape = (n,) if block is None else (-(-n // 128), -(-k // 128))
    ws = (torch.rand(shape, generator=g) * 0.5 + 0.75).to(device) * (std / 64)
    # Hopper's FP8 MMA keeps about 14 bits while it sums: three times the bf16 tolerance
    return ((lambda config=None: qg.fp8_gemm(x, w, ws, block=block, config=config)),
            (lambda: qg.fp8_gemm_reference(x, w, ws, block=block)), 3.0)


def _qgemm_row(kind: str, m: int, k: int, n: int, device, smoke: bool, flush, sweep, t_end: float) -> dict:
    """One shape: kernel vs reference (each element within ``f * 1e-2 * (|want| +
    rms(want))``, f 1 or 3 for FP8 W8A8, else the row fails), then on CUDA the kernel's
    time against bf16 ``torch.matmul`` of the same shape (CUDA-graph replays, L2
    flushed before each) and the launch settings of ``sweep`` while time is left."""
    import torch

    from kvpilot.kernels import quant_gemm as qg

    call, reference, factor = _qgemm_case(kind, m, k, n, device, seed=m + k + n)
    got, want = call().float(), reference().float()
    err = (got - want).abs()
    rms = float(want.pow(2).mean().sqrt())
    bound = factor * 1e-2 * (want.abs() + rms)
    row = {"kernel": kind, "tokens": m, "k": k, "n": n, "max_abs_diff": float(err.max()),
           "rel_rms_err": float(err.pow(2).mean().sqrt()) / max(rms, 1e-30),
           "worst_over_bound": float((err / bound).max()),
           "ok": bool((err <= bound).all()) and bool(torch.isfinite(got).all())}
    del got, want, err, bound
    if device.type != "cuda":  # the interpreter's time says nothing about the kernels
        return row
    reps = 30
    w_dense = torch.randn(n, k, device=device, dtype=torch.bfloat16)
    x_dense = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    row["bf16_us"], _, _ = _graph_us(lambda x=x_dense, w=w_dense: torch.matmul(x, w.t()), device, reps, flush)
    row["kernel_us"], row["timing"], graph_error = _graph_us(call, device, reps, flush)
    if graph_error:
        row["graph_error"] = graph_error
    row["speedup_vs_bf16"] = row["bf16_us"] / row["kernel_us"]
    if kind in ("fp8_w8a8", "fp8_block128_w8a8", "int8_w8a8"):  # the activation quantizer's share
        quant = qg.quantize_int8_activations if kind == "int8_w8a8" else qg.quantize_fp8_activations
        kw = {"group_size": 128} if kind == "fp8_block128_w8a8" else {}
        row["quant_us"], _, _ = _graph_us(lambda x=x_dense: quant(x, **kw), device, reps, flush)
        row["speedup_gemm_only"] = row["bf16_us"] / max(row["kernel_us"] - row["quant_us"], 1e-3)
    row["goal"] = {"fp8_w8a8": 1.6, "w4a16_g128": 2.0}.get(kind)
    row["goal_met"] = None if row["goal"] is None else row["speedup_vs_bf16"] >= row["goal"]
    points = []
    for cfg in sweep:
        if time.perf_counter() > t_end:
            row["sweep_cut"] = "time budget spent"
            break
        try:
            us, _, _ = _graph_us(lambda cfg=cfg: call(cfg), device, reps, flush)
            points.append({"config": cfg, "us": us})
        except Exception as e:  # a setting that does not compile is a data point
            points.append({"config": cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"})
    if points:
        row["sweep"] = points
        timed = [p for p in points if "us" in p]
        if timed:
            best = min(timed, key=lambda p: p["us"])
            row["best_sweep_config"], row["best_sweep_us"] = best["config"], best["us"]
    return row


def section_quant_gemm(smoke: bool) -> dict:
    """:func:`_qgemm_row` for FP8 W8A8 (per channel, dynamic per-token activations) and
    INT8 W8A8 at 4,096 tokens, FP8 block-wise 128 x 128 at 4,096 tokens on one shape,
    and W4A16 (group 128, asymmetric) at 1, 4 and 16 tokens, over Llama-3-8B's
    projection shapes; a row that raises is a failed row with its error. ok only if
    every row agrees with its reference; the speed goals are reported, not enforced."""
    import torch

    device = _device()
    t_end = time.perf_counter() + QGEMM_SWEEP_SECONDS
    shapes = ((128, 48), (256, 40)) if smoke else QGEMM_SHAPES
    decode = (1, 3) if smoke else QGEMM_DECODE_TOKENS
    prefill = 20 if smoke else QGEMM_PREFILL_TOKENS
    flush_buf = torch.empty(1 << 20 if smoke else 256 << 20, dtype=torch.uint8, device=device)
    flush = None if smoke else (lambda: flush_buf.zero_())
    plan = [("fp8_w8a8", prefill, k, n, QGEMM_FP8_SWEEP if not smoke and (k, n) == shapes[0] else ())
            for k, n in shapes]
    plan += [("w4a16_g128", m, k, n, QGEMM_W4_SWEEP if not smoke and m in (1, 16) else ())
             for m in decode for k, n in shapes]
    plan += [("int8_w8a8", prefill, k, n, ()) for k, n in shapes]
    plan += [("fp8_block128_w8a8", prefill, *shapes[0], ())]
    rows = []
    for kind, m, k, n, sweep in plan:
        try:
            rows.append(_qgemm_row(kind, m, k, n, device, smoke, flush, sweep, t_end))
        except Exception as e:  # recorded; the next shape still runs
            rows.append({"kernel": kind, "tokens": m, "k": k, "n": n, "ok": False,
                         "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]})
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def goal(kind: str):
        met = [r.get("goal_met") for r in rows if r["kernel"] == kind]
        return None if not met or None in met else all(met)

    return {"ok": all(r["ok"] for r in rows), "rows": rows,
            "fp8_w8a8_goal_1_6x_met": goal("fp8_w8a8"), "w4a16_goal_2x_met": goal("w4a16_g128")}


# ----------------------------------------------------------------------------- driver
def run_section(name: str, smoke: bool, out: Path) -> int:
    _setup_path()
    t0 = time.perf_counter()
    try:
        kw = {"progress": out / f"{name}.json"} if name == "kernel_tests" else {}
        result = {"section": name, "ok": True, **globals()[f"section_{name}"](smoke, **kw)}
    except Exception:
        result = {"section": name, "ok": False, "error": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    if name == "kernel_tests" and result.get("failed"):
        result["ok"] = False
    (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


def render(summary: dict) -> str:
    lines = ["| section | ok | seconds | detail |", "|---|---|---|---|"]
    for name, r in summary["sections"].items():
        detail = ""
        if name == "kernel_tests" and "passed" in r:
            detail = f"{r['passed']} passed, {r['failed']} failed"
        elif name == "kernel_tests" and r.get("partial"):
            done = r["results"]
            detail = (f"{r.get('error', '')}: {sum(x['ok'] for x in done)} passed, "
                      f"{sum(not x['ok'] for x in done)} failed of {r['done']} run, {r['of']} planned")
        elif name == "env" and "device" in r:
            detail = f"{r['device']}, torch {r['torch']}, triton {r['triton']}, copy {r['copy_bandwidth_tb_s']:.2f} TB/s"
        elif not r.get("ok"):
            detail = (r.get("error") or "").strip().splitlines()[-1:][0] if r.get("error") else ""
        lines.append(f"| {name} | {'yes' if r.get('ok') else 'NO'} | {r.get('seconds', '-')} | {detail} |")
    engine = summary["sections"].get("engine", {})
    if engine.get("rows"):
        lines += ["", f"| engine {engine['model']}, {engine['requests']} requests | KV cache | output tok/s | "
                  "total tok/s | seconds |", "|---|---|---|---|---|"]
        for r in engine["rows"]:
            if r.get("ok"):
                lines.append(f"| | {r['kv_cache_dtype']} | {r['output_tok_s']:.0f} | {r['total_tok_s']:.0f} | "
                             f"{r['seconds']} |")
            else:
                lines.append(f"| | {r['kv_cache_dtype']} | FAILED: {r.get('error', '')[:120]} | | |")
    tune = summary["sections"].get("decode_tune", {})
    if tune.get("best"):
        lines += ["", "| decode tune: best | BLOCK_N | warps | stages | splits | median us | TB/s |",
                  "|---|---|---|---|---|---|---|"]
        for key, r in tune["best"].items():
            lines.append(f"| {key} | {r['BLOCK_N']} | {r['num_warps']} | {r['num_stages']} | "
                         f"{r['num_splits'] or 'auto'} | {r['median_us']:.1f} | {r['bandwidth_tb_s']:.2f} |")
    moe = summary["sections"].get("moe", {})
    if moe.get("rows"):
        lines += ["", "| MoE tokens x hidden x inter, top-k of E | dtype | max abs diff | reference ms | "
                  "fused ms | reference / fused |", "|---|---|---|---|---|---|"]
        for r in moe["rows"]:
            s = r["shape"]
            name = f"{s['tokens']} x {s['hidden']} x {s['intermediate']}, top-{s['topk']} of {s['experts']}"
            if "error" in r:
                lines.append(f"| {name} | {r['dtype']} | FAILED: {r['error'][:120]} | | | |")
            elif "fused_ms" in r:
                lines.append(f"| {name} | {r['dtype']} | {r['max_abs_diff']:.3g} | {r['reference_ms']:.3f} | "
                             f"{r['fused_ms']:.3f} | {r['ratio_reference_over_fused']:.2f}x |")
            else:
                lines.append(f"| {name} | {r['dtype']} | {r['max_abs_diff']:.3g} | - | - | interpreter |")
    lora = summary["sections"].get("lora", {})
    if lora.get("rows"):
        lines += ["", "| LoRA SGMV batch | in x out | ok | max abs diff | base us | LoRA us | LoRA / base |",
                  "|---|---|---|---|---|---|---|"]
        for r in lora["rows"]:
            shape = f"{r['in']} x {r['out']}"
            if "error" in r:
                lines.append(f"| {r['batch']} | {shape} | FAILED: {r['error'][:120]} | | | | |")
            elif "lora_us" in r:
                lines.append(f"| {r['batch']} | {shape} | {'yes' if r['ok'] else 'NO'} | {r['max_abs_diff']:.3g} | "
                             f"{r['base_us']:.1f} | {r['lora_us']:.1f} | {r['ratio_lora_over_base']:.3f} |")
            else:
                lines.append(f"| {r['batch']} | {shape} | {'yes' if r['ok'] else 'NO'} | {r['max_abs_diff']:.3g} | "
                             "- | - | interpreter |")
    qgemm = summary["sections"].get("quant_gemm", {})
    if qgemm.get("rows"):
        lines += ["", "| quant GEMM | tokens | K x N | ok | max abs diff | bf16 us | kernel us | speed-up vs bf16 | "
                  "goal | best sweep us |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in qgemm["rows"]:
            head = f"| {r['kernel']} | {r['tokens']} | {r['k']} x {r['n']} |"
            if "error" in r:
                lines.append(f"{head} FAILED: {r['error'][:120]} | | | | | | |")
                continue
            ok = f" {'yes' if r['ok'] else 'NO'} | {r['max_abs_diff']:.3g} |"
            if "kernel_us" in r:
                goal = "-" if r.get("goal") is None else f"{r['goal']}x {'met' if r['goal_met'] else 'MISSED'}"
                alone = f" (GEMM alone {r['speedup_gemm_only']:.2f}x)" if "speedup_gemm_only" in r else ""
                best = f"{r['best_sweep_us']:.1f}" if "best_sweep_us" in r else "-"
                lines.append(f"{head}{ok} {r['bf16_us']:.1f} | {r['kernel_us']:.1f} | "
                             f"{r['speedup_vs_bf16']:.2f}x{alone} | {goal} | {best} |")
            else:
                lines.append(f"{head}{ok} - | - | interpreter | - | - |")
    bench = summary["sections"].get("decode_bench", {})
    if bench.get("rows"):
        lines += ["", "| batch x context | KV cache | median us | TB/s | vs bf16 |", "|---|---|---|---|---|"]
        for r in bench["rows"]:
            lines.append(f"| {r['batch']} x {r['context']} | {r['kv_cache_dtype']} | {r['median_us']:.1f} | "
                         f"{r['bandwidth_tb_s']:.2f} | {r['speedup_vs_bf16']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU under the Triton interpreter, tiny shapes")
    ap.add_argument("--out", default="gpu_results", help="folder for the JSON results")
    ap.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    ap.add_argument("--section", choices=SECTIONS, help=argparse.SUPPRESS)  # child process
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per section")
    ap.add_argument("--deadline", type=float, default=None,
                    help="seconds for the whole run: a section gets at most what is left of it, so the "
                         "summary is written before an outer time limit (the GPU lease's) kills the run")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.section:
        return run_section(args.section, args.smoke, out)
    env = dict(os.environ)
    if args.smoke:
        env["TRITON_INTERPRET"] = "1"
    summary: dict = {"smoke": args.smoke, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {}}
    start = time.monotonic()
    for name in args.sections:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--out", str(out)]
        cmd += ["--smoke"] if args.smoke else []
        timeout = args.timeout
        if args.deadline is not None:
            timeout = min(timeout, args.deadline - (time.monotonic() - start) - 5)
            if timeout < 10:
                summary["sections"][name] = {"ok": False, "error": "not run: the --deadline was spent"}
                print(f"{name}: not run (deadline)", flush=True)
                continue
        try:
            proc = subprocess.run(cmd, env=env, timeout=timeout, capture_output=True, text=True)
            path = out / f"{name}.json"
            result = json.loads(path.read_text()) if path.exists() else {
                "ok": False, "error": f"exit {proc.returncode}: {proc.stderr[-2000:]}"}
        except subprocess.TimeoutExpired:
            path = out / f"{name}.json"
            result = json.loads(path.read_text()) if path.exists() else {}
            result.update(ok=False, error=f"timed out after {timeout:.0f} s")
        summary["sections"][name] = result
        print(f"{name}: {'ok' if result.get('ok') else 'FAILED'}", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(render(summary))
    return 0 if all(r.get("ok") for r in summary["sections"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
