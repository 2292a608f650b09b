"""Teacher-forced scoring: the model's log-probabilities of a given token sequence,
computed through the engine's own model runner, attention backend and paged KV cache
(FP8 quantization, scales and key rotation included), chunk by chunk as a chunked
prefill would. Perplexity of a text and position-wise comparisons of two KV cache
settings (benchmarks/kv_cache_quality.py, tests/engine/test_fp8_kv_cache.py) use it.

It runs beside the scheduler, not through it: it borrows free blocks from the engine's
block pool for the duration of the call and gives them back, so the engine must not be
stepping at the same time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.attention.backend import AttentionMetadata
from kvpilot.engine.llm_engine import LLMEngine


@dataclass
class TokenScores:
    """Scores of ``token_ids[1:]``, each given the tokens before it.

    Attributes:
        token_logprobs: ``[n - 1]`` fp32, ``log p(token_ids[i + 1] | token_ids[:i + 1])``.
        argmax: ``[n - 1]`` int64, the greedy prediction at each position.
        logprobs: ``[n - 1, vocab]`` fp32 full distributions, when asked for.
    """

    token_logprobs: torch.Tensor
    argmax: torch.Tensor
    logprobs: torch.Tensor | None = None

    @property
    def perplexity(self) -> float:
        return float(torch.exp(-self.token_logprobs.double().mean()))


@torch.inference_mode()
def score_tokens(
    engine: LLMEngine,
    token_ids: Sequence[int],
    chunk_size: int = 512,
    return_logprobs: bool = False,
) -> TokenScores:
    """Run ``token_ids`` through the model in chunks of ``chunk_size`` tokens.

    ``chunk_size=1`` sends every token as a decode step (the decode path of the backend);
    larger chunks after the first are extends over the cached prefix. An FP8 cache still
    in its calibration window calibrates from the chunks, as it would from batches.

    Raises:
        ValueError: fewer than 2 tokens, or ``chunk_size < 1``.
        OutOfBlocksError: the pool has fewer free blocks than the sequence needs.
    """
    n = len(token_ids)
    if n < 2 or chunk_size < 1:
        raise ValueError(
            f"need >= 2 tokens and chunk_size >= 1; got {n} tokens, chunk_size {chunk_size}"
        )
    runner = engine.runner
    cache = runner.kv_cache
    dev = runner.device
    block_size = cache.block_size
    pool = engine.scheduler.kv.pool
    blocks = pool.take(-(-n // block_size))
    try:
        table = torch.tensor([blocks], dtype=torch.int32, device=dev)
        ids = torch.tensor(list(token_ids), dtype=torch.int64, device=dev)
        target_lp, argmax, full = [], [], []
        for start in range(0, n - 1, chunk_size):
            end = min(n - 1, start + chunk_size)  # the last token is only a target
            slots = [
                blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
            ]
            meta = AttentionMetadata(
                num_decodes=1 if end - start == 1 else 0,
                slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
                query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
                block_tables=table,
                query_start_loc_cpu=[0, end - start],
                seq_lens_cpu=[end],
                max_query_len=end - start,
                max_seq_len=end,
            )
            calibrate = cache.calibrate if cache.calibrating else None
            rows = torch.arange(end - start, device=dev)
            hidden = runner.model(
                ids[start:end], rows + start, meta, cache.layers, runner.backend, rows, calibrate
            )
            lp = torch.log_softmax(runner.model.compute_logits(hidden), dim=-1)
            target_lp.append(lp.gather(1, ids[start + 1 : end + 1, None])[:, 0].cpu())
            argmax.append(lp.argmax(-1).cpu())
            if return_logprobs:
                full.append(lp.cpu())
    finally:
        for b in blocks:
            pool.decref(b)
        pool.release(blocks)
    return TokenScores(
        torch.cat(target_lp), torch.cat(argmax), torch.cat(full) if return_logprobs else None
    )
