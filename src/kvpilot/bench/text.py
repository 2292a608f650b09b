"""Random English-ish text of an approximate length in tokens.

The load generator has no tokenizer (it must stay light and work against any server), so
prompt lengths are approximate: every word below is a common lower-case English word that
BPE tokenizers of the Llama, Qwen, GPT and SmolLM families encode as ONE token when it
follows a space, and the sentence-ending ``.`` is one token too. A text asked for ``n``
tokens therefore encodes to about ``n`` tokens (measured on SmolLM2's tokenizer: within a
few percent). The exact count is what the server reports in ``usage.prompt_tokens``,
which the benchmark records next to the target.
"""

from __future__ import annotations

import random

# Common words, one BPE token each after a space (no capitals, no apostrophes).
_WORD_TEXT = """
    the of and to in is it that was for on are as with his they at be this from have or
    by one had not but what all were when we there can an your which their said if do
    will each about how up out them then she many some so these would other into has
    more her two like him see time could no make than first been its who now people my
    made over did down only way find use may water long little very after words called
    just where most know get through back much before go good new write our used me man
    too any day same right look think also around another came come work three word must
    because does part even place well such here take why things help put years different
    away again off went old number great tell men say small every found still between
    name should home big give air line set own under read last never us left end along
    while might next sound below saw something thought both few those always looked show
    large often together asked house world going want school important until form food
    keep children feet land side without boy once animals life enough took sometimes four
    head above kind began almost live page got earth need far hand high year mother light
    parts country father let night following picture being study second eyes soon times
    story boys since white days ever paper hard near sentence better best across during
    today others however sure means knew try told young miles sun ways thing whole
    hear example heard several change answer room sea against top turned learn point city
    play toward five using himself usually
"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

SENTENCE_MIN_WORDS = 6
SENTENCE_MAX_WORDS = 14


def random_text(rng: random.Random, num_tokens: int) -> str:
    """About ``num_tokens`` tokens of random words in sentences ending with ``.``.

    Deterministic for a given ``rng`` state; consumes draws from ``rng``. ``num_tokens``
    <= 0 gives the empty string. The first sentence is not capitalized (capitals would
    cost extra tokens in some vocabularies).
    """
    parts: list[str] = []
    left = num_tokens
    while left > 0:
        words = min(left, rng.randint(SENTENCE_MIN_WORDS, SENTENCE_MAX_WORDS))
        if words == left:  # the text ends here: no full stop
            parts.append(" ".join(rng.choice(WORDS) for _ in range(words)))
            left -= words
        else:
            parts.append(" ".join(rng.choice(WORDS) for _ in range(words - 1)) + ".")
            left -= words  # words - 1 words + one "." token
    return " ".join(parts)
