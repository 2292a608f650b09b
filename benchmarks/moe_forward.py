"""One MoE forward: the Triton fused kernel against the torch reference loop, in one run.

Workload: ``--tokens`` rows of ``--hidden`` routed (softmax top-``--topk``, renormalised,
as Mixtral) to ``--experts`` SwiGLU experts of ``--intermediate``; random weights scaled
so activations stay O(1). Routing is computed once and shared; what is compared is the
experts' weighted sum, :func:`kvpilot.kernels.fused_moe.fused_moe` (align + two grouped
GEMMs) against :func:`kvpilot.engine.model.moe.moe_experts_reference` (a loop over the
experts that got tokens), on the same inputs.

    .venv/bin/python benchmarks/moe_forward.py                       # CPU: correctness only
    python benchmarks/moe_forward.py --device cuda --tokens 2048 \\
        --hidden 4096 --intermediate 14336 --dtype bfloat16           # GPU: Mixtral-8x7B layer

Always reported: the max abs difference between the two (and, below fp32, each one's
error against an fp32 evaluation of the same inputs). On CUDA also the median time of
each over ``--repeats`` runs (CUDA events, after a warm-up that compiles the kernel) and
the ratio reference time / fused time (above 1: the fused kernel is faster). On CPU the
kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, set here before Triton
is imported), which executes the kernel in Python: its time says nothing about the
kernel, so no time and no ratio are reported there.

Needs only torch and triton (``gpu_check.py`` section ``moe`` calls :func:`measure`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

DTYPES = ("float32", "bfloat16", "float16")
# max |fused - reference| allowed, relative to max |reference|: fp32 is IEEE on both
# sides (same sums, other order); 16-bit outputs round once each (bf16: 2^-8 relative).
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2, "float16": 4e-3}


def _wants_interpreter(device: str) -> bool:
    if device == "cpu":
        return True
    if device == "cuda":
        return False
    import torch

    return not torch.cuda.is_available()


def _setup(device: str) -> None:
    """``TRITON_INTERPRET`` must be set before the kernel module is imported (``triton.jit``
    reads it when it decorates); the repo's ``src`` goes on ``sys.path``."""
    if _wants_interpreter(device):
        if "kvpilot.kernels.fused_moe" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise RuntimeError("the fused MoE kernel was imported before TRITON_INTERPRET=1 was set")
        os.environ["TRITON_INTERPRET"] = "1"
    src = str(ROOT / "src")
    if src not in sys.path:
        sys.path.insert(0, src)


def _median_seconds(fn, device, repeats: int) -> float:
    import torch

    fn()  # warm-up: Triton compiles here
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(tokens: int, hidden: int, intermediate: int, experts: int, topk: int,
            dtype: str = "float32", device: str = "auto", repeats: int = 10, seed: int = 0) -> dict[str, Any]:
    """Correctness always, timing on CUDA only; a JSON-ready dict."""
    _setup(device)
    import torch

    from kvpilot.engine.model.moe import moe_experts_reference, route_topk
    from kvpilot.kernels.fused_moe import fused_moe

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if not 1 <= topk <= experts:
        raise ValueError(f"topk must be in 1..experts ({experts}); got {topk}")
    dev = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                       "cpu" if device == "auto" else device)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if dev.type == "cpu" and not interpreted:
        raise RuntimeError("on CPU the kernel needs TRITON_INTERPRET=1")
    if interpreted and dtype == "bfloat16":
        # Triton 3.9's interpreter returns garbage from tl.dot on bf16 operands (a 16 x 16
        # product off by 1e10; fp16 and fp32 are right), so it cannot judge the kernel.
        raise ValueError("bfloat16 is not checked under the Triton interpreter (its tl.dot on bf16 is "
                         "wrong); use float32 or float16 on CPU, bfloat16 on CUDA")
    dt = getattr(torch, dtype)
    g = torch.Generator(device="cpu").manual_seed(seed)
    x32 = torch.randn(tokens, hidden, generator=g)
    w13_32 = torch.randn(experts, 2 * intermediate, hidden, generator=g) / hidden**0.5
    w2_32 = torch.randn(experts, hidden, intermediate, generator=g) / intermediate**0.5
    logits = torch.randn(tokens, experts, generator=g)
    weights, ids = route_topk(logits, topk, renormalize=topk > 1)
    x, w13, w2 = (t.to(dev, dt) for t in (x32, w13_32, w2_32))
    weights, ids = weights.to(dev), ids.to(dev)

    want = moe_experts_reference(x, w13, w2, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    scale = float(want.float().abs().max())
    diff = float((got.float() - want.float()).abs().max())
    result: dict[str, Any] = {
        "shape": {"tokens": tokens, "hidden": hidden, "intermediate": intermediate,
                  "experts": experts, "topk": topk},
        "dtype": dtype, "device": str(dev), "triton_interpreter": interpreted,
        "tokens_per_expert": torch.bincount(ids.reshape(-1).cpu(), minlength=experts).tolist(),
        "max_abs_diff": diff, "max_abs_reference": scale,
        "tolerance_relative": TOLERANCE[dtype], "ok": bool(diff <= TOLERANCE[dtype] * scale),
        "finite": bool(torch.isfinite(got).all()),
    }
    if dt != torch.float32:  # how far each is from the same math in fp32
        truth = moe_experts_reference(*(t.to(dev, torch.float32) for t in (x, w13, w2)), weights, ids)
        result["max_abs_err_vs_fp32"] = {"fused": float((got.float() - truth).abs().max()),
                                         "reference": float((want.float() - truth).abs().max())}
        del truth
    result["ok"] = result["ok"] and result["finite"]
    del got, want
    if dev.type == "cuda":
        flops = 6 * tokens * topk * hidden * intermediate  # gate+up (2 x h x 2i) and down (2 x i x h)
        ref_s = _median_seconds(lambda: moe_experts_reference(x, w13, w2, weights, ids), dev, repeats)
        fused_s = _median_seconds(lambda: fused_moe(x, w13, w2, weights, ids), dev, repeats)
        result.update(repeats=repeats, reference_ms=ref_s * 1e3, fused_ms=fused_s * 1e3,
                      ratio_reference_over_fused=ref_s / fused_s,
                      reference_tflops=flops / ref_s / 1e12, fused_tflops=flops / fused_s / 1e12)
    else:
        result["timing"] = ("not measured: under the Triton interpreter the kernel runs as Python, "
                            "so its time is not meaningful")
    return result


def environment() -> dict[str, Any]:
    import torch
    import triton

    info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "python": platform.python_version(),
            "torch": torch.__version__, "triton": triton.__version__, "torch_threads": torch.get_num_threads()}
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                info["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
        except (OSError, StopIteration):
            pass
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=None, help="rows (default 64 on CPU, 2048 on CUDA)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 128 CPU, 4096 CUDA)")
    ap.add_argument("--intermediate", type=int, default=None,
                    help="expert intermediate size (default 256 CPU, 14336 CUDA)")
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="default float32 CPU, bfloat16 CUDA")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs on CUDA (median)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None,
                    help="JSON file (default benchmarks/results/moe_forward_<cpu|cuda>.json)")
    args = ap.parse_args(argv)
    cpu = _wants_interpreter(args.device)
    _setup(args.device)
    small = {"tokens": 64, "hidden": 128, "intermediate": 256, "dtype": "float32"}
    large = {"tokens": 2048, "hidden": 4096, "intermediate": 14336, "dtype": "bfloat16"}
    defaults = small if cpu else large
    kw = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in defaults.items()}
    t0 = time.perf_counter()
    try:
        result = measure(experts=args.experts, topk=args.topk, device=args.device, repeats=args.repeats,
                         seed=args.seed, **kw)
    except ValueError as exc:
        print(f"moe_forward: error: {exc}", file=sys.stderr)
        return 2
    result["seconds"] = round(time.perf_counter() - t0, 1)
    payload = {"benchmark": "moe_forward", "environment": environment(), "result": result}
    out = Path(args.out) if args.out else RESULTS / f"moe_forward_{'cpu' if cpu else 'cuda'}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2) + "\n")
    r = result
    line = (f"{r['shape']} {r['dtype']} on {r['device']}: max |fused - reference| = {r['max_abs_diff']:.3g}"
            f" (max |reference| {r['max_abs_reference']:.3g}) -> {'ok' if r['ok'] else 'MISMATCH'}")
    print(line)
    if "ratio_reference_over_fused" in r:
        print(f"reference {r['reference_ms']:.3f} ms, fused {r['fused_ms']:.3f} ms:"
              f" ratio {r['ratio_reference_over_fused']:.2f}x")
    else:
        print(r["timing"])
    print(f"wrote {out}")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
