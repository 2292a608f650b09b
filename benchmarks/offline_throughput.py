"""Offline throughput: kvpilot's engine vs HF transformers' batched ``generate``.

Same SmolLM2 weights (dequantized from the embedded GGUF), same dtype, same torch
thread count, in one run. Workload: N requests with prompts of uniformly random length
in [min, max] tokens (seeded) and exactly ``--output-len`` output tokens each
(``ignore_eos`` / ``min_new_tokens``), so both systems do the same work.

    .venv/bin/python benchmarks/offline_throughput.py            # 64 x (64..512) + 128
    .venv/bin/python benchmarks/offline_throughput.py --num-requests 16 --output-len 32

Reports output tokens/s and total (prompt + output) tokens/s for both, and the ratio.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from common import machine_info, write_result


def make_prompts(tokenizer, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = [t for t in range(1000, 20000)]
    return [[rng.choice(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_kvpilot(loaded, prompts, output_len, budget) -> float:
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.sampling_params import SamplingParams

    llm = LLM(loaded=loaded, max_num_batched_tokens=budget, max_num_seqs=256, kv_cache_memory=4.0)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    assert all(len(r.outputs[0].token_ids) == output_len for r in results)
    return elapsed


def load_hf():
    from transformers import AutoModelForCausalLM

    from kvpilot.engine.model.loader import embedded_model_path

    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def run_hf(model, prompts, output_len, pad_id) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
            do_sample=False, pad_token_id=pad_id,
        )
    elapsed = time.perf_counter() - t0
    assert out.shape[1] - width == output_len
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2048, help="kvpilot --max-num-batched-tokens")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--repeats", type=int, default=2, help="alternating runs per system; the best is reported")
    args = ap.parse_args()

    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.model_runner import load_model

    loaded = load_model(EngineArgs(device="cpu", dtype="float32"))
    prompts = make_prompts(loaded.tokenizer, args.num_requests, args.min_prompt, args.max_prompt, args.seed)
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = args.num_requests * args.output_len
    info = machine_info()
    print(f"# {info['cpu']} x{info['cpu_count']}, torch {info['torch']} ({info['torch_threads']} threads), "
          f"transformers {info['transformers']}")
    print(f"# {args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens "
          f"({prompt_tokens} in all), {args.output_len} output tokens each, fp32 CPU")
    hf_model = None if args.skip_hf else load_hf()
    runs: dict[str, list[float]] = {"kvpilot": [], "hf_transformers": []}
    for _ in range(args.repeats):  # alternate, so drift in machine speed hits both
        runs["kvpilot"].append(run_kvpilot(loaded, prompts, args.output_len, args.budget))
        if hf_model is not None:
            runs["hf_transformers"].append(run_hf(hf_model, prompts, args.output_len, pad_id=2))
    rows = {name: min(times) for name, times in runs.items() if times}
    print(f"# runs (seconds): {runs}")
    print(f"{'system':<18}{'seconds':>10}{'output tok/s':>15}{'total tok/s':>14}")
    result = {"machine": info, "args": vars(args), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
              "runs_seconds": runs}
    for name, secs in rows.items():
        print(f"{name:<18}{secs:>10.1f}{output_tokens / secs:>15.1f}{(prompt_tokens + output_tokens) / secs:>14.1f}")
        result[name] = {"seconds": secs, "output_tok_s": output_tokens / secs,
                        "total_tok_s": (prompt_tokens + output_tokens) / secs}
    if "hf_transformers" in rows:
        ratio = rows["hf_transformers"] / rows["kvpilot"]
        result["speedup_vs_hf"] = ratio
        print(f"speed-up of kvpilot over HF transformers: {ratio:.2f}x (goal >= 1.5x)")
    print("written", write_result("offline_throughput", result))


if __name__ == "__main__":
    main()
