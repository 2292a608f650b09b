"""Incremental detokenization with stop strings.

Text is produced with ``tokenizers``' :class:`DecodeStream`, which buffers a token whose
bytes end inside a multi-byte UTF-8 character until the character is complete (no
U+FFFD in a stream). Stop strings are searched in the text as it grows; while a request
is still running, the last ``len(longest stop) - 1`` characters are held back from the
stream, so no piece of a stop string that spans several tokens is ever sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from kvpilot.engine.sampling_params import SamplingParams

# Prompt tokens given to the stream as context, so the first output token decodes as it
# would inside the text (leading spaces of SentencePiece tokens, split characters).
_CONTEXT_TOKENS = 8


def backend_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a transformers fast tokenizer."""
    return getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", tokenizer)


class IncrementalDetokenizer:
    """Per-request text state.

    Args:
        tokenizer: a transformers fast tokenizer (or a ``tokenizers.Tokenizer``).
        prompt_token_ids: the prompt (its tail is decoding context).
        params: ``stop``, ``include_stop_str_in_output``, ``skip_special_tokens``.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._tok = backend_tokenizer(tokenizer)
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._stream = DecodeStream(ids=context, skip_special_tokens=params.skip_special_tokens)
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.output_text = ""
        self._sent = 0

    def add_tokens(self, token_ids: Sequence[int]) -> str | None:
        """Append the text of ``token_ids``. Returns the stop string that matched (the
        text is then cut before it, or after it with ``include_stop_str_in_output``),
        else None. Tokens after a match are ignored."""
        for t in token_ids:
            piece = self._stream.step(self._tok, t)
            if not piece:
                continue
            search_from = max(0, len(self.output_text) - self.hold_back)
            self.output_text += piece
            if self.stop:
                hit = self._find_stop(search_from)
                if hit is not None:
                    return hit
        return None

    def _find_stop(self, start: int) -> str | None:
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.output_text = self.output_text[: i + len(s)] if self.include_stop else self.output_text[:i]
        return s

    def take_delta(self, finished: bool) -> str:
        """Text not yet sent; while running, the stop-string hold-back stays unsent."""
        end = len(self.output_text) if finished else max(self._sent, len(self.output_text) - self.hold_back)
        delta = self.output_text[self._sent : end]
        self._sent = end
        return delta
