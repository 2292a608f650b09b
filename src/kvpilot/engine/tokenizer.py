"""Tokenizer and chat template through transformers.

A GGUF file carries its tokenizer; transformers converts it to a fast tokenizer, which
takes seconds, so the converted ``tokenizer.json`` is cached under
``$KVPILOT_CACHE_DIR`` (default ``~/.cache/kvpilot``) keyed by the file's path, size and
modification time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from kvpilot.engine.model.loader import ModelSource

logger = logging.getLogger(__name__)


def cache_dir() -> Path:
    base = os.environ.get("KVPILOT_CACHE_DIR")
    if base:
        return Path(base)
    try:
        return Path.home() / ".cache" / "kvpilot"
    except RuntimeError:  # no home directory
        return Path(tempfile.gettempdir()) / "kvpilot-cache"


def load_tokenizer(source: ModelSource, tokenizer: str | None = None) -> Any:
    """A transformers fast tokenizer for ``source`` (or the folder ``tokenizer``)."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        return AutoTokenizer.from_pretrained(tokenizer)
    if source.kind == "hf":
        return AutoTokenizer.from_pretrained(str(source.path))
    st = source.path.stat()
    key = hashlib.sha256(f"{source.path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = cache_dir() / "tokenizers" / key
    if (cached / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(cached))
    logger.info("converting the GGUF tokenizer of %s (cached in %s)", source.path.name, cached)
    tok = AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cached.parent))
        tok.save_pretrained(str(tmp))
        try:
            tmp.rename(cached)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        logger.warning("could not cache the converted tokenizer in %s: %s", cached, e)
    return tok
