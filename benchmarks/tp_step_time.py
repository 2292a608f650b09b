"""Tensor parallelism on CPU: step time of the embedded SmolLM2 at TP=N against TP=1.

Both engines run in the same process one after the other (the TP=N one spawns N-1 gloo
workers), fp32, the cpu attention backend, the same prompts, greedy with EOS ignored:

- ``prefill``: ``--batch`` prompts of ``--prompt`` tokens, one step each (the budget is
  ``batch x prompt`` tokens), the median over ``--rounds`` after one warm-up round;
- ``decode``: the median step time over ``--decode`` decode steps of the same batch.

Each rank gets ``cpu_threads() / N`` threads, so both runs use the same cores. On a
machine with few cores TP=N is slower than TP=1: its ranks compute smaller matrices and
add a gloo all-reduce per projection. The point on CPU is correctness (the greedy tokens
of both runs are compared and must be equal) and the communication count, which is
printed: all-reduces and all-gathers per step, read from rank 0's counters.

Usage: python benchmarks/tp_step_time.py [--tp 2] [--batch 4] [--prompt 256] [--decode 32]
Writes results/tp_step_time.json.
"""

from __future__ import annotations

import argparse
import statistics
import time

from common import machine_info, write_result


def measure(tp: int, args: argparse.Namespace) -> dict:
    import torch

    from kvpilot.engine.llm import LLM
    from kvpilot.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (args.prompt,), generator=gen).tolist() for _ in range(args.batch)]
    budget = args.batch * args.prompt
    with LLM(tensor_parallel_size=tp, attention_backend="cpu", max_num_batched_tokens=budget,
             max_num_seqs=args.batch, enable_prefix_caching=False) as llm:
        engine = llm.engine
        group = engine.runner.tp
        prefill = []
        for r in range(args.rounds + 1):
            for i, p in enumerate(prompts):
                engine.add_request(f"p{r}-{i}", p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            if r:
                prefill.append(time.perf_counter() - t0)
        for i, p in enumerate(prompts):
            engine.add_request(f"d{i}", p, SamplingParams(max_tokens=args.decode + 1, temperature=0,
                                                          ignore_eos=True))
        engine.step()  # the prefill
        steps, tokens = [], {f"d{i}": [] for i in range(len(prompts))}
        reduces = gathers = 0
        while engine.has_unfinished_requests():
            r0 = group.num_all_reduces if group else 0
            g0 = group.num_all_gathers if group else 0
            t0 = time.perf_counter()
            outs = engine.step()
            steps.append(time.perf_counter() - t0)
            if group:
                reduces, gathers = group.num_all_reduces - r0, group.num_all_gathers - g0
            for o in outs:
                tokens[o.request_id].extend(o.new_token_ids)
        layers = engine.model_config.num_layers
    return {"tp": tp, "prefill_s": statistics.median(prefill), "decode_step_s": statistics.median(steps),
            "all_reduces_per_step": reduces, "all_gathers_per_step": gathers, "layers": layers,
            "tokens": [tokens[k] for k in sorted(tokens)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base = measure(1, args)
    split = measure(args.tp, args)
    same = base["tokens"] == split["tokens"]
    print(f"SmolLM2-135M fp32 CPU, batch {args.batch} x {args.prompt}-token prompts, {args.decode} decode steps")
    for name, key in (("prefill (one step)", "prefill_s"), ("decode step", "decode_step_s")):
        print(f"  {name:20s} TP=1 {base[key] * 1e3:8.1f} ms   TP={args.tp} {split[key] * 1e3:8.1f} ms   "
              f"ratio TP={args.tp}/TP=1 {split[key] / base[key]:.2f}x")
    print(f"  per decode step at TP={args.tp}: {split['all_reduces_per_step']} all-reduces "
          f"(2 x {split['layers']} layers + 1), {split['all_gathers_per_step']} all-gather; "
          f"one StepInputs message per worker")
    print(f"  greedy tokens identical: {same}")
    for r in (base, split):
        r.pop("tokens")
    write_result("tp_step_time", {"machine": machine_info(), "args": vars(args), "tp1": base,
                                  f"tp{args.tp}": split, "tokens_identical": same,
                                  "prefill_ratio": split["prefill_s"] / base["prefill_s"],
                                  "decode_ratio": split["decode_step_s"] / base["decode_step_s"]})


if __name__ == "__main__":
    main()
