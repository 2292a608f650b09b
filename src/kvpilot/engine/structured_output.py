"""Structured outputs: constrained decoding with xgrammar.

A request may ask that its output match a JSON schema, any JSON object, a regular
expression, one of a list of strings, or an EBNF (GBNF) grammar
(:class:`StructuredOutputsParams`, vLLM's ``structured_outputs`` and OpenAI's
``response_format``). The grammar engine is xgrammar (Dong et al. 2024, "XGrammar:
Flexible and Efficient Structured Generation Engine for Large Language Models"), the one
vLLM and SGLang ship by default; kvpilot writes no grammar compiler of its own.

Data flow::

    server handler (worker thread)          engine thread, every step
    ─────────────────────────────           ─────────────────────────
    GrammarCompiler.compile(params)   ──>   Request.grammar = GrammarState(compiled)
      (cached by xgrammar per schema)       Sampler: one bitmask [rows, ceil(V/32)] int32,
                                             filled per constrained row, applied to the
                                             batch's logits in one call
                                            after update(): matcher.accept_token(token)

Constrained and free requests share a batch: only the constrained rows' logits are
masked. The matcher advances only when a token is appended to the request's output, and
preemption (by recompute) keeps the output tokens, so the matcher state stays valid
across preemption, chunked prefill and prefix-cache hits without rollback.

With a reasoning parser the constraint starts once the reasoning end marker
(``</think>``) is in the output (:attr:`StructuredOutputsParams.after`); the reasoning
itself is free text.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvpilot.engine.errors import InvalidRequestError

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "; the rest is the message.
_XGR_PREFIX = re.compile(r"^\[[0-9:]+\]\s+\S+:\d+:\s*")
# How long a cached compiled grammar may stay when the cache is full: xgrammar's own LRU,
# bounded in bytes (a 30-field schema is a few hundred KiB on a 49k vocabulary).
GRAMMAR_CACHE_BYTES = 256 * 1024 * 1024

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """What the output must match; exactly one of the kinds is set.

    Attributes:
        json: a JSON schema, serialized (canonical JSON text: keys sorted), so equal
            schemas share one compiled grammar.
        json_object: any JSON object (OpenAI's ``response_format: json_object``).
        regex: a regular expression the whole output matches.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar in xgrammar's (GBNF-compatible) syntax, rule ``root``.
        any_whitespace: JSON kinds may put any whitespace between tokens (vLLM's
            default); False (the default here, vLLM's ``disable_any_whitespace``)
            writes compact JSON, which small models cannot pad with endless blanks.
        strict: JSON schema kinds refuse properties the schema does not list (xgrammar's
            strict mode, what OpenAI's ``strict: true`` promises).
        after: the constraint starts once this text is in the output (the reasoning
            parser's end marker, ``</think>``); None: from the first token.
        param: the request field the constraint came from, named in errors.
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    any_whitespace: bool = False
    strict: bool = True
    after: str | None = None
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        set_kinds = self.kinds()
        if len(set_kinds) != 1:
            raise InvalidRequestError(
                f"{self.param}: give exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(set_kinds) if set_kinds else 'none'}", self.param)
        if self.choice is not None:
            if not self.choice:
                raise InvalidRequestError(f"{self.param}.choice: must list at least one string", self.param)
            bad = next((c for c in self.choice if not isinstance(c, str) or not c), None)
            if bad is not None:
                raise InvalidRequestError(f"{self.param}.choice: every choice must be a non-empty string, got {bad!r}",
                                          self.param)
        for name in ("regex", "grammar", "json"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise InvalidRequestError(f"{self.param}.{name}: must be a non-empty string", self.param)

    def kinds(self) -> list[str]:
        """The kinds that are set (exactly one on a valid instance)."""
        out = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            out.insert(1, "json_object")
        return out

    @staticmethod
    def schema_text(schema: Any, param: str) -> str:
        """A JSON schema (dict, or JSON text) as canonical JSON text. Raises
        InvalidRequestError when it is not a JSON object."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"{param}: the schema is not valid JSON: {e}", param) from None
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{param}: a JSON schema must be an object, got {type(schema).__name__}", param)
        return json.dumps(schema, sort_keys=True, ensure_ascii=False)


def choice_grammar(choices: Sequence[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``. Each choice is a string
    literal; JSON's escapes (``\\"``, ``\\\\``, ``\\n``, ``\\uXXXX``) are the EBNF ones."""
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def _message(e: BaseException) -> str:
    return _XGR_PREFIX.sub("", str(e).strip()).strip()


class GrammarCompiler:
    """Compiles :class:`StructuredOutputsParams` into xgrammar grammars for one
    tokenizer. Thread-safe (the server compiles in worker threads, off the event loop);
    compiled grammars are cached by xgrammar, keyed by the schema text and options.

    Args:
        tokenizer: the model's transformers tokenizer.
        vocab_size: the logits' width (the model's vocabulary, which may exceed the
            tokenizer's: padded rows are never allowed).
        stop_token_ids: the tokens that end a request (EOS); the only tokens allowed
            once the output is complete.
        max_threads: xgrammar's compile threads.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int], max_threads: int = 2) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.stop_token_ids = [int(t) for t in stop_token_ids]
        self._info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                        stop_token_ids=self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(self._info, max_threads=max_threads, cache_enabled=True,
                                             cache_limit_bytes=GRAMMAR_CACHE_BYTES)
        self._lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``params``.

        Raises:
            InvalidRequestError: the schema, regex or grammar cannot be compiled; the
                message is xgrammar's, ``param`` is the request field it came from.
        """
        c = self._compiler
        p = params
        try:
            if p.json is not None:
                return c.compile_json_schema(p.json, any_whitespace=p.any_whitespace, strict_mode=p.strict)
            if p.json_object:
                return c.compile_json_schema('{"type": "object"}', any_whitespace=p.any_whitespace,
                                             strict_mode=False)
            if p.regex is not None:
                return c.compile_regex(p.regex)
            if p.choice is not None:
                return c.compile_grammar(choice_grammar(p.choice))
            assert p.grammar is not None
            return c.compile_grammar(p.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            kind = p.kinds()[0]
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
                    "choice": "choice list", "grammar": "EBNF grammar"}[kind]
            raise InvalidRequestError(f"{p.param}: the {what} cannot be compiled: {_message(e)}", p.param) from None


class GrammarState:
    """One request's matcher over a compiled grammar.

    Attributes:
        matcher: the ``xgrammar.GrammarMatcher``; advanced by :meth:`accept` only.
        active: False until ``params.after`` appears in the output (reasoning first).
        params: what the grammar came from.
    """

    def __init__(self, compiled: Any, params: StructuredOutputsParams, end_token_ids: Sequence[int] = ()) -> None:
        """``end_token_ids``: EOS and stop token ids, banned while the constraint waits for
        ``params.after``: a request that asked for constrained output must not end before
        its answer starts (it runs to ``max_tokens`` instead, ``finish_reason: length``)."""
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.params = params
        self.active = params.after is None
        self.end_token_ids = list(dict.fromkeys(int(t) for t in end_token_ids))

    def accept(self, token_id: int) -> bool:
        """Advance over a sampled token (no-op while inactive). False when the grammar
        refuses it (the sampler masked it, so that is an engine bug)."""
        if not self.active:
            return True
        return bool(self.matcher.accept_token(int(token_id)))

    def update_active(self, output_text: str) -> None:
        """Turn the constraint on once the reasoning end marker is in ``output_text``."""
        if not self.active and self.params.after is not None and self.params.after in output_text:
            self.active = True


class BitmaskBuffer:
    """The batch's token bitmask ``[rows, ceil(vocab / 32)]`` int32 (1 bit per token,
    set = allowed), grown as needed and reused across steps."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._buf: torch.Tensor | None = None

    def rows(self, n: int) -> torch.Tensor:
        import xgrammar as xgr

        if self._buf is None or self._buf.shape[0] < n:
            self._buf = xgr.allocate_token_bitmask(max(n, 8), self.vocab_size)
        return self._buf[:n]


def apply_grammar_masks(logits: torch.Tensor, states: Sequence[GrammarState | None], buffer: BitmaskBuffer) -> dict[int, str]:
    """Mask, in place, the logits of constrained rows to the tokens their grammar allows
    next: every row's bitmask is filled, then applied to the batch in one
    ``xgrammar.apply_token_bitmask_inplace`` call (free rows untouched). Rows still
    waiting for their reasoning to end get their end tokens banned (:class:`GrammarState`).

    Args:
        logits: ``[rows, vocab]`` fp32, mutated.
        states: per row, the request's grammar state (None or inactive: free row).
        buffer: the reusable bitmask.

    Returns:
        rows whose grammar allows no token at all -> why (those requests must end with
        an error; their logits are left as they were).
    """
    import xgrammar as xgr

    for i, s in enumerate(states):  # waiting for the reasoning to end: it may not end the output
        if s is not None and not s.active and s.end_token_ids:
            logits[i, s.end_token_ids] = float("-inf")
    rows = [i for i, s in enumerate(states) if s is not None and s.active]
    if not rows:
        return {}
    mask = buffer.rows(len(states))
    dead: dict[int, str] = {}
    apply_rows: list[int] = []
    for i in rows:
        state = states[i]
        assert state is not None
        if state.matcher.is_terminated():
            dead[i] = "the output already completed its grammar"
            continue
        state.matcher.fill_next_token_bitmask(mask, i)
        if not bool(mask[i].any()):
            dead[i] = "the grammar allows no token at this point of the output"
            continue
        apply_rows.append(i)
    if apply_rows:
        device_mask = mask if logits.device.type == "cpu" else mask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, device_mask, vocab_size=logits.shape[-1], indices=apply_rows)
    return dead
