"""Step time of a quantized KV cache against the model-dtype cache, in one run.

Workload (the same for every cache dtype): one ``--prompt-len``-token prompt prefilled in
chunks of ``--chunk`` tokens (``--max-num-batched-tokens``), then ``--decodes`` greedy
decode steps of that request while ``--batch - 1`` other requests decode beside it. The
engines share the loaded weights; rounds alternate the dtypes so machine noise hits each
alike, and each phase's time is the median over ``--rounds``.

    .venv/bin/python benchmarks/kv_cache_step_time.py            # fp32 vs fp8 vs fp4_e2m1 vs int4

Reports seconds per prefill chunk and per decode step for each dtype and the ratio to the
model-dtype cache (the baseline, ``auto``), in process CPU time by default (``--clock
wall`` for elapsed time): CPU time holds still when other work shares the machine. Goal (docs/engine.md): a quantized cache costs
no more than a few percent of step time on CPU.
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


def one_round(loaded, dtype: str, prompt: list[int], others: list[list[int]], args) -> dict[str, float]:
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineArgs(device="cpu", kv_cache_dtype=dtype, kv_cache_memory=args.kv_cache_memory,
                   max_num_batched_tokens=args.chunk, enable_prefix_caching=False,
                   attention_backend=args.attention_backend),
        loaded=loaded,
    )
    params = SamplingParams(max_tokens=args.decodes + 1, temperature=0.0, ignore_eos=True)
    # The other requests first: short prompts, then they decode while the long one prefills
    # and while it decodes (they outlive it).
    longer = SamplingParams(max_tokens=args.decodes + args.prompt_len // args.chunk + 16, temperature=0.0,
                            ignore_eos=True)
    for i, ids in enumerate(others):
        engine.add_request(f"o{i}", ids, longer)
    engine.step()
    engine.add_request("long", prompt, params)
    prefill, decode = [], []
    while (req := engine.scheduler.requests.get("long")) is not None:
        prefilling = req.is_prefilling
        t0 = args.clock()
        engine.step()
        (prefill if prefilling else decode).append(args.clock() - t0)
    return {"prefill_chunk_s": statistics.median(prefill), "decode_step_s": statistics.median(decode),
            "prefill_steps": len(prefill), "decode_steps": len(decode)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtypes", default="auto,fp8,fp4_e2m1,int4", help="comma-separated; the first is the baseline")
    ap.add_argument("--prompt-len", type=int, default=1500)
    ap.add_argument("--chunk", type=int, default=64, help="--max-num-batched-tokens")
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="requests decoding together")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-memory", type=float, default=0.25)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch"],
                    help="auto: the in-place cpu backend where it builds")
    ap.add_argument("--clock", choices=["cpu", "wall"], default="cpu",
                    help="cpu: process CPU time (steady on a shared machine); wall: elapsed time")
    args = ap.parse_args()
    args.clock = time.process_time if args.clock == "cpu" else time.perf_counter

    import torch

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.model_runner import load_model

    loaded = load_model(EngineArgs(device="cpu"))
    torch.set_num_threads(args.threads)  # after loading, which sets the machine's count
    rng = random.Random(0)
    prompt = [rng.randrange(1000, 20000) for _ in range(args.prompt_len)]
    others = [[rng.randrange(1000, 20000) for _ in range(32)] for _ in range(args.batch - 1)]
    dtypes = args.dtypes.split(",")
    runs: dict[str, list[dict[str, float]]] = {d: [] for d in dtypes}
    for r in range(args.rounds):
        for d in dtypes if r % 2 == 0 else dtypes[::-1]:
            runs[d].append(one_round(loaded, d, prompt, others, args))
    rows = {}
    for d in dtypes:
        rows[d] = {k: statistics.median(x[k] for x in runs[d]) for k in ("prefill_chunk_s", "decode_step_s")}
    base = rows[dtypes[0]]
    print(f"{'kv cache':<10} {'prefill chunk (s)':>18} {'ratio':>7} {'decode step (s)':>16} {'ratio':>7}")
    for d, row in rows.items():
        row["prefill_ratio"] = row["prefill_chunk_s"] / base["prefill_chunk_s"]
        row["decode_ratio"] = row["decode_step_s"] / base["decode_step_s"]
        print(f"{d:<10} {row['prefill_chunk_s']:>18.4f} {row['prefill_ratio']:>7.3f} "
              f"{row['decode_step_s']:>16.4f} {row['decode_ratio']:>7.3f}")
    settings = {k: v for k, v in vars(args).items() if k != "clock"} | {"clock": "cpu" if args.clock is time.process_time else "wall"}
    path = write_result("kv_cache_step_time", {"machine": machine_info(), "args": settings, "results": rows,
                                               "rounds": runs})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
