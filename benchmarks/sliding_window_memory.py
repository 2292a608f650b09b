"""KV memory of one long generation on an all-sliding-window (Mistral-style) model.

A tiny Mistral checkpoint with random weights (transformers' ``MistralConfig`` /
``MistralForCausalLM``, every layer sliding with window ``--window``) is saved to a
temporary folder and run through the engine (``LLMEngine``, CPU, fp32). One request
(``--prompt`` random tokens) generates until it holds ``4 * window`` tokens, greedy,
EOS ignored. After every engine step the blocks the request holds a reference on
(``KVCacheManager.num_held_blocks``) are recorded, with the pool's usage.

Two runs of the same request:

- ``sliding``: the engine as built, which frees the blocks every layer's window has left
  behind (``KVCacheManager(sliding_window=W)``): the curve should go flat at
  ``cdiv(W, block_size) + 1`` blocks at most once the request is past the window (with
  prefix caching on, once the window has also passed the published prompt blocks);
- ``full``: the same engine with that freeing turned off (``kv.sliding_window = None``
  before the request is added): the memory full attention would hold, growing linearly.

The attention itself slides in both runs, so the greedy tokens must be identical; the
script reports whether they are (a check that no freed block was read inside a window).

Usage: OMP_NUM_THREADS=1 python benchmarks/sliding_window_memory.py [--window 64]
Writes results/sliding_window_memory.json and prints the curve and the ratio at 4W.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from common import machine_info, write_result


def tiny_mistral(path: Path, window: int, max_positions: int, vocab: int = 256) -> None:
    """Save a random 2-layer Mistral (hidden 64, every layer sliding with ``window``)."""
    import torch
    import transformers

    cfg = transformers.MistralConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_theta=10000.0, sliding_window=window)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(cfg).eval()
    with torch.no_grad():  # well-separated logits: greedy paths do not hinge on ties
        for p in model.parameters():
            p.mul_(3.0)
    model.save_pretrained(str(path), safe_serialization=True)


def run_one(path: Path, args: argparse.Namespace, prompt: list[int], free_behind_window: bool) -> dict:
    """Generate ``4 * window - len(prompt)`` tokens for one request; the per-step curve."""
    from kvpilot.engine.config import EngineArgs
    from kvpilot.engine.llm_engine import LLMEngine
    from kvpilot.engine.sampling_params import SamplingParams

    total = 4 * args.window
    engine = LLMEngine(EngineArgs(
        model=str(path), device="cpu", dtype="float32", skip_tokenizer_init=True,
        block_size=args.block_size, max_model_len=total + args.block_size,
        num_gpu_blocks_override=-(-total // args.block_size) + 8,
        max_num_batched_tokens=args.chunk, enable_prefix_caching=not args.no_prefix_caching,
        attention_backend=args.attention_backend))
    try:
        kv = engine.scheduler.kv
        window = kv.sliding_window
        if window is None:
            raise SystemExit("the engine did not get a sliding window: is every layer sliding "
                             "(ModelConfig.all_layers_slide) and the KVCacheManager built with it?")
        if not free_behind_window:
            kv.sliding_window = None
        params = SamplingParams(max_tokens=total - len(prompt), temperature=0.0, ignore_eos=True)
        engine.add_request("r", prompt, params)
        req = engine.scheduler.requests["r"]
        curve: list[tuple[int, int, float]] = []  # (tokens in the sequence, blocks held, pool usage)
        t0 = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            if req.block_ids:
                curve.append((req.num_tokens, kv.num_held_blocks(req), kv.usage))
        elapsed = time.perf_counter() - t0
        return {"window": window, "curve": curve, "output_token_ids": list(req.output_token_ids),
                "seconds": elapsed, "num_blocks": kv.num_blocks}
    finally:
        engine.close()


def held_at(curve: list[tuple[int, int, float]], num_tokens: int) -> int:
    """Blocks held at the last step whose sequence had at most ``num_tokens`` tokens."""
    best = curve[0][1]
    for n, held, _ in curve:
        if n <= num_tokens:
            best = held
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=64, help="sliding window W (tokens)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=24, help="prompt tokens (random ids)")
    ap.add_argument("--chunk", type=int, default=16, help="max_num_batched_tokens (chunked prefill)")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--attention-backend", default="torch")
    ap.add_argument("--no-write", action="store_true", help="print only, do not write results/")
    args = ap.parse_args()

    import torch

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 256, (args.prompt,), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tiny-mistral"
        tiny_mistral(path, args.window, 8 * args.window)
        sliding = run_one(path, args, prompt, free_behind_window=True)
        full = run_one(path, args, prompt, free_behind_window=False)

    w, bs = args.window, args.block_size
    bound = -(-w // bs) + 1
    marks = [w // 2, w, 2 * w, 3 * w, 4 * w - 1]
    rows = [(m, held_at(sliding["curve"], m), held_at(full["curve"], m)) for m in marks]
    s4, f4 = held_at(sliding["curve"], 4 * w), held_at(full["curve"], 4 * w)
    # First sequence length from which the request never holds more than the bound.
    # Expected: about W past the prompt's published blocks (prefix caching on), else
    # about W + block_size.
    flat_from = None
    for n, held, _ in reversed(sliding["curve"]):
        if held > bound:
            break
        flat_from = n
    same = sliding["output_token_ids"] == full["output_token_ids"]

    print(f"window {w}, block_size {bs}, prompt {args.prompt}, chunk {args.chunk}, "
          f"prefix caching {'off' if args.no_prefix_caching else 'on'}")
    print("| tokens | blocks held (sliding) | blocks held (full) |")
    print("|---:|---:|---:|")
    for m, s, f in rows:
        print(f"| {m} | {s} | {f} |")
    print(f"at 4W: {s4} vs {f4} blocks, ratio {s4 / f4:.3f}; bound cdiv(W, bs) + 1 = {bound}; "
          f"flat (<= bound) from {flat_from} tokens on; greedy tokens identical: {same}")
    if not args.no_write:
        out = write_result("sliding_window_memory", {
            "machine": machine_info(),
            "settings": {"window": w, "block_size": bs, "prompt_tokens": args.prompt, "chunk": args.chunk,
                         "prefix_caching": not args.no_prefix_caching,
                         "attention_backend": args.attention_backend},
            "bound_blocks": bound,
            "held_at_4w": {"sliding": s4, "full": f4, "ratio": s4 / f4},
            "flat_from_num_tokens": flat_from,
            "greedy_tokens_identical": same,
            "curve": {"columns": ["num_tokens", "blocks_held", "pool_usage"],
                      "sliding": sliding["curve"], "full": full["curve"]},
            "seconds": {"sliding": sliding["seconds"], "full": full["seconds"]},
        })
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
