"""Turning logits into tokens: penalties, min_tokens, temperature, top-k/top-p/min-p,
per-request seeds, and logprobs.

Order of operations per row (as in vLLM and HF): logit bias -> structured-output
grammar mask (the whole batch in one call) -> penalties -> min_tokens mask ->
(greedy: argmax) | (temperature -> top-k -> top-p -> min-p -> sample). Logprobs are
the model's own distribution (log-softmax of the raw logits), as OpenAI reports them
and as vLLM does by default (``raw_logprobs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvpilot.engine.core.request import Request
from kvpilot.engine.structured_output import BitmaskBuffer, apply_grammar_masks


@dataclass
class SamplerOutput:
    """Per sampled row: the token, its logprob (if asked) and the top alternatives.

    Attributes:
        token_ids: ``[num_rows]`` chosen tokens (-1 on a failed row).
        logprobs: per row, the chosen token's logprob, or None if the request asked none.
        top_logprobs: per row, ``[(token_id, logprob)]`` best first (k from the request).
        errors: rows that could not sample -> why (a grammar that allows no token, or
            allows only EOS while ``min_tokens`` forbids it); those requests must end
            with an error, the other rows are valid.
    """

    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[list[tuple[int, float]] | None]
    errors: dict[int, str] = field(default_factory=dict)


class NoAllowedToken(Exception):
    """Every token of a row is masked (-inf) before sampling."""


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

    def __init__(self, device: torch.device, seed: int = 0, vocab_size: int | None = None) -> None:
        self.device = device
        self.shared = torch.Generator(device=device).manual_seed(seed)
        self._generators: dict[str, torch.Generator] = {}
        self._bitmask: BitmaskBuffer | None = BitmaskBuffer(vocab_size) if vocab_size else None

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
        (row ``i`` belongs to ``requests[i]``). ``logits`` is mutated (logit bias and
        grammar masks are applied in place); the requests are not."""
        n = len(requests)
        raw_logprobs = None
        if any(r.sampling_params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        self._apply_logit_bias(logits, requests)
        errors: dict[int, str] = {}
        if self._bitmask is not None and any(r.grammar is not None for r in requests):
            errors = apply_grammar_masks(logits, [r.grammar for r in requests], self._bitmask)
        tokens = torch.full((n,), -1, dtype=torch.long, device=logits.device)
        greedy_rows = [i for i, r in enumerate(requests)
                       if r.sampling_params.greedy and self._plain(r) and i not in errors]
        if greedy_rows:
            idx = torch.tensor(greedy_rows, device=logits.device)
            tokens[idx] = logits[idx].argmax(dim=-1)
        greedy_set = set(greedy_rows)
        for i, req in enumerate(requests):
            if i in greedy_set or i in errors:
                continue
            try:
                tokens[i] = self._sample_row(logits[i].clone(), req)
            except NoAllowedToken as e:
                errors[i] = str(e)
        token_list = tokens.tolist()
        lps: list[float | None] = [None] * n
        tops: list[list[tuple[int, float]] | None] = [None] * n
        if raw_logprobs is not None:
            for i, req in enumerate(requests):
                k = req.sampling_params.logprobs
                if k is None or i in errors:
                    continue
                lps[i] = float(raw_logprobs[i, token_list[i]])
                if k > 0:
                    vals, ids = raw_logprobs[i].topk(k)
                    tops[i] = list(zip(ids.tolist(), vals.tolist()))
                else:
                    tops[i] = []
        return SamplerOutput(token_list, lps, tops, errors)

    @staticmethod
    def _apply_logit_bias(logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """Add each request's ``logit_bias`` to its row, in place (ids are checked
        against the vocabulary when the request is added)."""
        for i, req in enumerate(requests):
            bias = req.sampling_params.logit_bias
            if bias:
                ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
                vals = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
                logits[i].index_add_(0, ids, vals)

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
            if req.grammar is not None and not bool(torch.isfinite(row).any()):
                raise NoAllowedToken(
                    f"the structured output is complete after {req.num_output_tokens} tokens, but min_tokens "
                    f"({sp.min_tokens}) forbids ending it")
        if sp.greedy:
            return int(row.argmax())
        row = filter_logits(row / sp.temperature, sp.top_k, sp.top_p, sp.min_p)
        probs = row.softmax(-1)
        return int(torch.multinomial(probs, 1, generator=self._generator(req)))
