"""Turning logits into tokens: penalties, min_tokens, temperature, top-k/top-p/min-p,
per-request seeds, and logprobs.

Order of operations per row (as in vLLM and HF): penalties -> min_tokens mask ->
(greedy: argmax) | (temperature -> top-k -> top-p -> min-p -> sample). Logprobs are
the model's own distribution (log-softmax of the raw logits), as OpenAI reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.core.request import Request


@dataclass
class SamplerOutput:
    """Per sampled row: the token, its logprob (if asked) and the top alternatives.

    Attributes:
        token_ids: ``[num_rows]`` chosen tokens.
        logprobs: per row, the chosen token's logprob, or None if the request asked none.
        top_logprobs: per row, ``[(token_id, logprob)]`` best first (k from the request).
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]


def apply_penalties(logits: torch.Tensor, req: Request) -> None:
    """In place on one row ``[vocab]``.

    - repetition (Keskar et al. 2019, CTRL; HF semantics): tokens seen in prompt or
      output get positive logits divided and negative logits multiplied by the penalty;
    - frequency / presence (OpenAI): ``logit -= freq * count + presence * (count > 0)``
      over output tokens.
    """
    sp = req.sampling_params
    vocab = logits.shape[-1]
    if sp.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({t for t in req.token_ids if t < vocab}), dtype=torch.long, device=logits.device)
        if seen.numel():
            vals = logits[seen]
            logits[seen] = torch.where(vals > 0, vals / sp.repetition_penalty, vals * sp.repetition_penalty)
    if (sp.frequency_penalty or sp.presence_penalty) and req.output_token_ids:
        out = torch.tensor(req.output_token_ids, dtype=torch.long, device=logits.device)
        out = out[out < vocab]
        counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device)
        counts.scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
        logits -= sp.frequency_penalty * counts + sp.presence_penalty * (counts > 0).to(logits.dtype)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside top-k, the top-p nucleus and the min-p floor.
    ``logits`` is one temperature-scaled row ``[vocab]``; returns a new tensor."""
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        drop_sorted = (cum - probs) > top_p  # keep the smallest set reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    """Samples one token per row. Keeps a torch.Generator per seeded request, so a seed
    gives the same tokens whatever else shares the batch.

    Args:
        device: where the logits live.
        seed: seed of the shared generator used by unseeded requests.
    """

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.shared = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        """Forget the request's generator (call when it finishes)."""
        self._generators.pop(request_id, None)

    def _generator(self, req: Request) -> torch.Generator:
        seed = req.sampling_params.seed
        if seed is None:
            return self.shared
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = torch.Generator(device=self.device).manual_seed(seed)
        return gen

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """Sample a token for each row of ``logits`` ``[num_rows, vocab]`` fp32
        (row ``i`` belongs to ``requests[i]``). Does not mutate the requests."""
        n = len(requests)
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        tokens = torch.empty(n, dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, r in enumerate(requests) if r.sampling_params.greedy and self._plain(r)]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        greedy_set = set(greedy_rows)
        for i, req in enumerate(requests):
            if i in greedy_set:
                continue
            tokens[i] = self._sample_row(logits[i].clone(), req)
        token_list = tokens.tolist()
        lps: list[float | None] = [None] * n
        tops: list[list[tuple[int, float]] | None] = [None] * n
        if raw_logprobs is not None:
            for i, req in enumerate(requests):
                k = req.sampling_params.logprobs
                if k is None:
                    continue
                lps[i] = float(raw_logprobs[i, token_list[i]])
                if k > 0:
                    vals, ids = raw_logprobs[i].topk(k)
                    tops[i] = list(zip(ids.tolist(), vals.tolist()))
                else:
                    tops[i] = []
        return SamplerOutput(token_list, lps, tops)

    @staticmethod
    def _plain(req: Request) -> bool:
        """No per-row processing needed before argmax."""
        sp = req.sampling_params
        return not sp.has_penalties and req.num_output_tokens >= sp.min_tokens

    def _sample_row(self, row: torch.Tensor, req: Request) -> int:
        sp = req.sampling_params
        if sp.has_penalties:
            apply_penalties(row, req)
        if req.num_output_tokens < sp.min_tokens:
            banned = [t for t in (*req.eos_token_ids, *sp.stop_token_ids) if t < row.shape[-1]]
            if banned:
                row[torch.tensor(banned, device=row.device)] = float("-inf")
        if sp.greedy:
            return int(row.argmax())
        row = filter_logits(row / sp.temperature, sp.top_k, sp.top_p, sp.min_p)
        probs = row.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(req)))
