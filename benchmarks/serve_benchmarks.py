"""Server benchmarks with `kvpilot bench serve`, each pair measured in one run.

1. ``multi-turn``: an agentic multi-turn workload (contexts grow turn by turn) against
   a server with prefix caching on, then one with ``--no-enable-prefix-caching``:
   prefix-cache hit rate and mean TTFT (goals: hit rate >= 85%, TTFT -80%).
2. ``chunked``: decodes stream while 2,048-token prompts arrive, against
   ``--max-num-batched-tokens 512`` and against a budget that takes a whole prompt
   (4096): p99 inter-token latency of the running decodes.

    .venv/bin/python benchmarks/serve_benchmarks.py [multi-turn] [chunked]

Servers run one at a time (they would share the CPU otherwise), on 127.0.0.1 and free
ports, and are always stopped.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import machine_info, write_result  # noqa: E402
from tests.serverproc import ServerProcess  # noqa: E402

from kvpilot.bench import BenchConfig, RequestSpec, random_text, run_benchmark  # noqa: E402


def serve(*args: str) -> ServerProcess:
    proc = ServerProcess("--kv-cache-memory", "2", "--log-level", "warning", *args)
    proc.wait_ready()
    return proc


def multi_turn() -> dict:
    out = {}
    for name, flags in (("prefix caching on", ()), ("prefix caching off", ("--no-enable-prefix-caching",))):
        proc = serve(*flags)
        try:
            cfg = BenchConfig(
                base_url=proc.url, dataset="multi-turn", num_sessions=8, num_turns=6, system_prompt_len=512,
                turn_input_len=48, output_len=24, max_concurrency=8, seed=0, label=name,
            )
            res = run_benchmark(cfg)
        finally:
            proc.stop()
        out[name] = {"hit_rate": res.prefix_cache["hit_rate"], "ttft_ms": res.summary["ttft_ms"],
                     "e2e_ms": res.summary["e2e_ms"], "completed": res.summary["requests_completed"],
                     "failed": res.summary["requests_failed"]}
        print(f"{name:<20} hit rate {res.prefix_cache['hit_rate']:.1%}  mean TTFT {res.summary['ttft_ms']['mean']:.0f} ms  "
              f"p50 {res.summary['ttft_ms']['p50']:.0f} ms  completed {res.summary['requests_completed']}")
    on, off = out["prefix caching on"], out["prefix caching off"]
    out["ttft_reduction"] = 1 - on["ttft_ms"]["mean"] / off["ttft_ms"]["mean"]
    print(f"mean TTFT reduction with the prefix cache: {out['ttft_reduction']:.1%} (goal >= 80%); "
          f"hit rate {on['hit_rate']:.1%} (goal >= 85%)")
    return out


def chunked() -> dict:
    out = {}
    rng = random.Random(0)
    workload = [RequestSpec(random_text(rng, 2048), 2048, 1, request_class="long-prompt") for _ in range(6)]
    for budget in (512, 4096):
        proc = serve("--max-num-batched-tokens", str(budget), "--max-model-len", "4096")
        try:
            cfg = BenchConfig(base_url=proc.url, request_rate=0.1, background_streams=4, background_input_len=32,
                              background_output_len=4000, seed=0, label=f"budget {budget}")
            res = run_benchmark(cfg, workload)
        finally:
            proc.stop()
        bg = res.by_class["background"]["itl_ms"]
        lp = res.by_class["long-prompt"]["ttft_ms"]
        out[f"budget {budget}"] = {"background_itl_ms": bg, "long_prompt_ttft_ms": lp}
        print(f"budget {budget:<5} decode ITL p50 {bg['p50']:.0f} ms  p99 {bg['p99']:.0f} ms  max-ish; "
              f"long-prompt TTFT mean {lp['mean']:.0f} ms")
    a, b = out["budget 512"]["background_itl_ms"]["p99"], out["budget 4096"]["background_itl_ms"]["p99"]
    out["p99_itl_ratio"] = b / a
    print(f"p99 decode ITL, whole-prompt budget / chunked: {b / a:.2f}x")
    return out


def main() -> None:
    which = sys.argv[1:] or ["multi-turn", "chunked"]
    info = machine_info()
    print(f"# {info['cpu']} x{info['cpu_count']}, torch {info['torch']}, SmolLM2-135M fp32 on CPU")
    for name, fn in (("multi-turn", multi_turn), ("chunked", chunked)):
        if name in which:
            result = {"machine": info, name: fn()}
            print("written", write_result(f"serve_{name.replace('-', '_')}", result))
            print(json.dumps(result[name], indent=1)[:2000])


if __name__ == "__main__":
    main()
