"""Engine step time over decode batch sizes and prefill chunk sizes, and the simulator's
compute model fitted to it.

    .venv/bin/python benchmarks/step_time_sweep.py              # ~2-3 min on 2 shared cores
    .venv/bin/python benchmarks/step_time_sweep.py --decodes 1 8 --chunks 0 256 --reps 2

For each decode batch ``d`` (``--decodes``) the engine holds ``d`` requests decoding
(64-token prompts, ``ignore_eos``); for each chunk ``p`` (``--chunks``; 0: a decode-only
step) one more request with a ``p``-token prompt and one output token is added, so the
next step schedules exactly ``d`` decode rows and ``p`` prefill tokens (``p + d`` is kept
under the step budget, ``--budget``). That step is timed ``--reps`` times (process CPU
time, ``--threads`` torch threads: steady when other work shares the machine) and the
median kept. Then least squares over the grid, on relative errors (each point weighted
by 1 / its seconds, so the 25 ms decode steps count as much as the 2 s prefill steps)::

    step seconds = base + per_seq x decode rows + per_token x prefill tokens

writes ``benchmarks/results/step_time_cpu.json`` with the grid, the fit, its residuals
and, under ``replica_model``, the simulator's :class:`ReplicaModel` fields
(``prefill_tokens_per_second = 1 / per_token``), which ``kvpilot simulate --calibration``
reads as is. The decode rows' contexts are short (64 prompt tokens plus what they
generated during the sweep, under ~150), so per_seq is the cost of a short-context row;
attention over long contexts costs more.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 8, 24, 48, 64],
                    help="decode batch sizes, increasing")
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 128, 512, 1024],
                    help="prefill tokens in the timed step (0: decode only)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=int, default=2048, help="--max-num-batched-tokens")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kv-cache-memory", type=float, default=2.0, help="GiB")
    ap.add_argument("--kv-capacity-tokens", type=int, default=23_296,
                    help="the serving engine's pool, for replica_model (kvpilot serve on CPU)")
    ap.add_argument("--startup-seconds", type=float, default=20.0,
                    help="process start to /ready, for replica_model")
    ap.add_argument("--out", default="step_time_cpu", help="results/<name>.json")
    args = ap.parse_args()
    if sorted(args.decodes) != args.decodes or args.decodes[0] < 1:
        ap.error(f"--decodes must be increasing and >= 1; got {args.decodes}")
    if min(args.chunks) < 0 or max(args.decodes) + max(args.chunks) > args.budget:
        ap.error(f"--chunks must be >= 0 and max(--decodes) + max(--chunks) <= --budget "
                 f"({args.budget}); got {args.chunks}")

    import numpy as np
    import torch

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.model_runner import load_model
    from kvpilot.engine.sampling_params import SamplingParams

    loaded = load_model(EngineArgs(device="cpu"))
    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineArgs(device="cpu", max_num_batched_tokens=args.budget, max_num_seqs=256,
                   kv_cache_memory=args.kv_cache_memory, enable_prefix_caching=False),
        loaded=loaded,
    )
    rng = random.Random(0)
    long_run = SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    clock = time.process_time
    rows: list[dict[str, float]] = []
    running = 0
    probe = 0
    wall = time.perf_counter()
    for d in args.decodes:
        while running < d:
            engine.add_request(f"d{running}", [rng.randrange(1000, 20000) for _ in range(64)], long_run)
            running += 1
        while any(r.is_prefilling for r in engine.scheduler.requests.values()):
            engine.step()
        engine.step()  # one plain decode step before timing
        for p in args.chunks:
            times = []
            for _ in range(args.reps):
                if p:
                    probe += 1
                    engine.add_request(f"p{probe}", [rng.randrange(1000, 20000) for _ in range(p)], one)
                t0 = clock()
                engine.step()
                times.append(clock() - t0)
            row = {"decode_rows": d, "prefill_tokens": p, "seconds": statistics.median(times),
                   "runs": times}
            rows.append(row)
            print(f"decode rows {d:4d}  prefill tokens {p:5d}  step {row['seconds']:.4f} s", flush=True)
    x = np.array([[1.0, r["decode_rows"], r["prefill_tokens"]] for r in rows])
    y = np.array([r["seconds"] for r in rows])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    base, per_seq, per_token = (float(c) for c in coef)
    fitted = x @ coef
    for r, f in zip(rows, fitted):
        r["fitted"] = float(f)
        r["residual_share"] = float((r["seconds"] - f) / r["seconds"])
    worst = max(abs(r["residual_share"]) for r in rows)
    print(f"fit: step = {base * 1e3:.2f} ms + {per_seq * 1e3:.3f} ms x decode rows"
          f" + {per_token * 1e3:.4f} ms x prefill tokens ({1 / per_token:,.0f} prefill tok/s);"
          f" worst residual {100 * worst:.1f}%")
    physical = base > 0 and per_seq >= 0 and per_token > 0
    payload = {
        "machine": machine_info(),
        "args": vars(args),
        "clock": "process CPU time",
        "wall_seconds": time.perf_counter() - wall,
        "grid": rows,
        "fit": {"base_seconds": base, "per_seq_seconds": per_seq, "per_token_seconds": per_token,
                "worst_residual_share": worst, "weights": "1 / seconds (relative errors)",
                "physical": physical},
        "replica_model": {
            "kv_capacity_tokens": args.kv_capacity_tokens,
            "prefill_tokens_per_second": round(1.0 / per_token, 1),
            "decode_step_base_seconds": round(base, 5),
            "decode_step_per_seq_seconds": round(per_seq, 6),
            "max_num_seqs": 256,
            "max_num_batched_tokens": args.budget,
            "startup_seconds": args.startup_seconds,
        },
    }
    print(f"wrote {write_result(args.out, payload)}")
    if not physical:
        print("error: the fit is not physical (a negative coefficient); rerun on a quieter machine",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
