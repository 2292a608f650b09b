"""Shared-prefix prefill: prefix caching on vs off, in one run.

Workload: ``--groups`` groups x ``--per-group`` requests; every request of a group
starts with the same ``--prefix-len``-token system prompt followed by its own
``--suffix-len``-token question. Requests arrive group by group (agentic traffic keeps
re-sending the same system prompt). Each request generates ``--output-len`` tokens
(default 1, so the run measures prefill).

    .venv/bin/python benchmarks/shared_prefix.py      # 8 x 8, 512-token prefix

Reports the prefix-cache hit rate (hit tokens / prompt tokens) and the total prefill
time with the cache on and off, and their ratio.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine_info, write_result


def workload(groups: int, per_group: int, prefix_len: int, suffix_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    prompts = []
    for _ in range(groups):
        prefix = [rng.randrange(1000, 20000) for _ in range(prefix_len)]
        for _ in range(per_group):
            prompts.append(prefix + [rng.randrange(1000, 20000) for _ in range(suffix_len)])
    return prompts


def run(loaded, prompts, per_group: int, output_len: int, caching: bool) -> dict:
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(device="cpu", enable_prefix_caching=caching, kv_cache_memory=2.0), loaded=loaded)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for g in range(0, len(prompts), per_group):  # one group at a time
        for i in range(g, g + per_group):
            engine.add_request(f"r{i}", prompts[i], params)
        while engine.has_unfinished_requests():
            engine.step()
    elapsed = time.perf_counter() - t0
    stats = engine.scheduler.prefix_stats
    return {"seconds": elapsed, "queries": stats.queries, "hits": stats.hits,
            "hit_rate": stats.hits / stats.queries if stats.queries else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--suffix-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.model_runner import load_model

    loaded = load_model(EngineArgs(device="cpu", dtype="float32"))
    prompts = workload(args.groups, args.per_group, args.prefix_len, args.suffix_len, args.seed)
    info = machine_info()
    print(f"# {info['cpu']} x{info['cpu_count']}, torch {info['torch']} ({info['torch_threads']} threads)")
    print(f"# {args.groups} groups x {args.per_group} requests, {args.prefix_len}-token shared prefix + "
          f"{args.suffix_len}-token suffix, {args.output_len} output token(s), fp32 CPU")
    off = run(loaded, prompts, args.per_group, args.output_len, caching=False)
    on = run(loaded, prompts, args.per_group, args.output_len, caching=True)
    print(f"{'prefix caching':<16}{'seconds':>10}{'hit rate':>10}")
    for name, r in (("off", off), ("on", on)):
        print(f"{name:<16}{r['seconds']:>10.2f}{r['hit_rate']:>10.1%}")
    speedup = off["seconds"] / on["seconds"]
    print(f"prefill time off/on: {speedup:.2f}x (goal >= 2x); hit rate {on['hit_rate']:.1%} (goal >= 80%)")
    print("written", write_result("shared_prefix", {"machine": info, "args": vars(args), "off": off, "on": on,
                                                    "speedup": speedup}))


if __name__ == "__main__":
    main()
