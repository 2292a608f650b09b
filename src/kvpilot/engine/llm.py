"""Offline batch generation: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpilot.engine.config import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.model_runner import LoadedModel
from kvpilot.engine.outputs import TokenLogprob
from kvpilot.engine.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    """One generated sequence (choice ``index`` of its prompt)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None


@dataclass
class GenerationResult:
    """All choices of one prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0


class LLM:
    """Offline engine front end.

    Args:
        model: see :class:`EngineArgs` (default: the embedded SmolLM2).
        loaded: share weights already loaded by another engine (same device/dtype).
        **kwargs: any other :class:`EngineArgs` field (``max_num_batched_tokens=...``).
    """

    def __init__(self, model: str | None = None, *, loaded: LoadedModel | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **kwargs), loaded=loaded)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop what this LLM started: tensor-parallel workers, a KV event publisher
        (idempotent; they also end with the process)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text, or token ids) and return results in order.

        ``sampling_params`` is one for all prompts or one per prompt; with ``n > 1``,
        choice ``i`` of a seeded request uses ``seed + i``.

        Raises:
            InvalidRequestError: a prompt is rejected (nothing is left queued).
            Exception: whatever a step raised; this call's requests are aborted first, so
                the LLM keeps serving later calls.
        """
        if isinstance(prompts, str):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        results: list[GenerationResult] = []
        children: dict[str, tuple[int, int]] = {}
        outputs: dict[str, Any] = {}
        added: list[str] = []
        try:
            for p_idx, (prompt, sp) in enumerate(zip(prompts, params)):
                if isinstance(prompt, str):
                    if self.tokenizer is None:
                        raise ValueError("this engine runs without a tokenizer: pass prompts as token ids")
                    ids = self.tokenizer.encode(prompt)
                    text: str | None = prompt
                else:
                    ids, text = [int(t) for t in prompt], None
                rid = f"gen-{next(self._ids)}"
                results.append(GenerationResult(rid, text, list(ids)))
                for i in range(sp.n):
                    child_sp = sp if sp.n == 1 else replace(sp, n=1, seed=None if sp.seed is None else sp.seed + i)
                    cid = f"{rid}-{i}"
                    self.engine.add_request(cid, ids, child_sp, cache_salt=cache_salt)
                    added.append(cid)
                    children[cid] = (p_idx, i)
        except Exception:
            self.engine.abort_request(added)
            raise
        logprobs: dict[str, list[TokenLogprob]] = {cid: [] for cid in children}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.new_logprobs:
                        logprobs[out.request_id].extend(out.new_logprobs)
                    if out.finished:
                        outputs[out.request_id] = out
        except Exception:
            # Leave nothing behind: a failed step's requests would fail every later call.
            self.engine.abort_request([cid for cid in added if cid not in outputs])
            raise
        for cid, (p_idx, i) in children.items():
            out = outputs[cid]
            lp = logprobs[cid] if params[p_idx].logprobs is not None else None
            cum = sum(t.logprob for t in lp) if lp is not None else None
            results[p_idx].outputs.append(
                CompletionOutput(
                    i, out.output_text, list(out.output_token_ids), out.finish_reason, out.stop_reason, lp, cum
                )
            )
            results[p_idx].num_cached_tokens = max(results[p_idx].num_cached_tokens, out.num_cached_tokens)
        return results
