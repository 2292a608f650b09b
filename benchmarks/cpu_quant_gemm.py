"""The WNA16 GEMM on CPU (``kernels/csrc/quant_gemm_cpu.cpp``) against what the engine
would otherwise run for the same product, at decode-sized batches.

    .venv/bin/python benchmarks/cpu_quant_gemm.py                     # the default table
    .venv/bin/python benchmarks/cpu_quant_gemm.py --m 1,2,4,8,16,32,64 --shapes 576x49152

Shapes are ``KxN`` (``K`` input columns, ``N`` output rows): SmolLM2-135M's projections
(576 -> 1536, 576, 192 and the tied LM head's 49152; 1536 -> 576) and a Llama-like MLP
(2048 -> 5632, 5632 -> 2048). Per shape and row count ``M`` (fp32 activations):

- ``ours w4 g32`` / ``ours w8 g32`` / ``ours w8 ch``: the C++ kernel on the canonical
  layout (4 bits, group 32; 8 bits, group 32 = GGUF Q8_0; 8 bits, one group per row).
- ``fp32 packed``: the dense fp32 weight in oneDNN's blocked layout
  (``mkldnn._reorder_linear_weight`` + ``_linear_pointwise``: ``PackedLinear``, what the
  engine runs for unquantized weights on CPU).
- ``torch int4``: ``aten._weight_int4pack_mm_for_cpu`` (group 32; x cast to bf16 and the
  result back to fp32, as ``WNA16Weight.linear`` does).
- ``torch int8 ch``: ``aten._weight_int8pack_mm`` (per-channel 8 bits; the same casts,
  plus the rank-one offset correction ``WNA16Weight`` adds).
- ``tiled w4 g32`` / ``tiled w8 g32``: ``WNA16Weight._tiled``, the
  dequantize-8-MB-tiles-then-``F.linear`` fallback (what 8-bit grouped weights ran
  before the kernel, and what larger batches run).

Timing: every variant of a (shape, M) cell runs once per round, in turn, so a slow
stretch of a shared machine hits all of them; each run repeats the call until it lasts
about 20 ms and keeps the mean. The median over ``--rounds`` rounds is reported (ms),
with ``ours w4 g32``'s speed-up over ``fp32 packed`` and ``ours w8 g32``'s over
``tiled w8 g32``. Writes ``benchmarks/results/cpu_quant_gemm.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import machine_info, write_result  # noqa: E402

from kvpilot.engine.quantization.weights import WNA16Weight  # noqa: E402
from kvpilot.kernels import cpu_attention  # noqa: E402
from kvpilot.kernels.cpu_quant_gemm import wna16_gemm  # noqa: E402

SHAPES = ("576x1536", "576x576", "576x192", "576x49152", "1536x576", "2048x5632", "5632x2048")
TARGET_S = 0.02


def _quantized(n: int, k: int, bits: int, group: int, gen: torch.Generator) -> WNA16Weight:
    q = torch.randint(0, 1 << bits, (n, k), generator=gen, dtype=torch.uint8)
    s = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.001).half()
    o = (-s.float() * (1 << (bits - 1))).half()  # a symmetric zero point, as GGUF Q4_0/Q8_0
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous() if bits == 4 else q
    return WNA16Weight(packed, s, o, bits, group, k)


def variants(k: int, n: int, with_tiled: bool) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    gen = torch.Generator().manual_seed(k * n)
    w4, w8, w8c = (_quantized(n, k, 4, 32, gen), _quantized(n, k, 8, 32, gen), _quantized(n, k, 8, k, gen))
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for name, w in (("ours w4 g32", w4), ("ours w8 g32", w8), ("ours w8 ch", w8c)):
        out[name] = lambda x, w=w: wna16_gemm(x, w.qweight, w.scales, w.offsets, w.bits, w.group_size)
    packed = torch.ops.mkldnn._reorder_linear_weight(w4.dequantize(), None)
    out["fp32 packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    # torch's kernels, fed as WNA16Weight.prepare() fed them before the C++ kernel.
    int4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4.unpack().to(torch.int32), 1)
    s4 = w4.scales.float()
    sz = torch.stack((s4.t(), (w4.offsets.float() + 8.0 * s4).t()), dim=-1).to(torch.bfloat16).contiguous()
    out["torch int4"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(
        x.to(torch.bfloat16), int4, 32, sz).float()
    q8 = (w8c.qweight.to(torch.int16) - 128).to(torch.int8)
    s8 = w8c.scales.float()[:, 0]
    corr = w8c.offsets.float()[:, 0] + 128.0 * s8
    s8b = s8.to(torch.bfloat16)

    def int8(x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q8, s8b).float()
        return y + x.sum(-1, keepdim=True) * corr

    out["torch int8 ch"] = int8
    if with_tiled:
        out["tiled w4 g32"] = lambda x: w4._tiled(x, None, torch.float32)
        out["tiled w8 g32"] = lambda x: w8._tiled(x, None, torch.float32)
    # The kernel's answer is checked against the dense product once per shape.
    x = torch.randn(3, k, generator=gen)
    for name, w in (("ours w4 g32", w4), ("ours w8 g32", w8)):
        want = F.linear(x.double(), w.dequantize().double())
        err = float((out[name](x).double() - want).abs().max() / want.abs().max())
        assert err < 1e-5, f"{name} {k}x{n}: relative error {err}"
    return out


def _timed(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        fn(x)
    return (time.perf_counter() - start) / reps


def measure(k: int, n: int, ms: list[int], rounds: int, with_tiled: bool) -> list[dict[str, Any]]:
    fns = variants(k, n, with_tiled)
    rows = []
    for m in ms:
        x = torch.randn(m, k)
        reps = {}
        for name, fn in fns.items():
            fn(x)
            once = max(_timed(fn, x, 1), 1e-6)
            reps[name] = max(1, int(TARGET_S / once))
        times: dict[str, list[float]] = {name: [] for name in fns}
        for r in range(rounds):
            order = list(fns) if r % 2 == 0 else list(reversed(fns))
            for name in order:
                times[name].append(_timed(fns[name], x, reps[name]))
        med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
        row: dict[str, Any] = {"K": k, "N": n, "M": m, "ms": med,
                               "ms_min": {name: min(t) * 1e3 for name, t in times.items()}}
        row["w4_vs_fp32_packed"] = med["fp32 packed"] / med["ours w4 g32"]
        if "tiled w8 g32" in med:
            row["w8_vs_tiled"] = med["tiled w8 g32"] / med["ours w8 g32"]
        rows.append(row)
        print(_line(row), flush=True)
    return rows


COLUMNS = ("ours w4 g32", "ours w8 g32", "ours w8 ch", "fp32 packed", "torch int4", "torch int8 ch",
           "tiled w4 g32", "tiled w8 g32")


def _header() -> str:
    return "| K x N | M | " + " | ".join(COLUMNS) + " | w4 vs fp32 | w8 vs tiled |\n|---|--:|" + \
        "--:|" * (len(COLUMNS) + 2)


def _line(row: dict[str, Any]) -> str:
    cells = [f"{row['ms'][c]:.3f}" if c in row["ms"] else "-" for c in COLUMNS]
    tiled = f"{row['w8_vs_tiled']:.1f}x" if "w8_vs_tiled" in row else "-"
    return f"| {row['K']} x {row['N']} | {row['M']} | " + " | ".join(cells) + \
        f" | {row['w4_vs_fp32_packed']:.1f}x | {tiled} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated KxN")
    p.add_argument("--m", default="1,8,32", help="comma-separated activation row counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--no-tiled", action="store_true", help="skip the slow tiled fallback")
    p.add_argument("--out", default="cpu_quant_gemm", help="result file name under benchmarks/results")
    args = p.parse_args()
    ok, why = cpu_attention.available()
    if not ok:
        raise SystemExit(f"the CPU kernels are unavailable: {why}")
    torch.set_num_threads(args.threads)
    ms = [int(v) for v in args.m.split(",")]
    print(_header())
    rows = []
    with torch.no_grad():
        for shape in args.shapes.split(","):
            k, n = (int(v) for v in shape.split("x"))
            rows += measure(k, n, ms, args.rounds, not args.no_tiled)
    info = machine_info()
    info["torch_threads"] = torch.get_num_threads()
    info["load_average_after"] = os.getloadavg()  # other users of a shared machine
    path = write_result(args.out, {"machine": info, "rounds": args.rounds, "unit": "ms per call, median of rounds",
                                   "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
