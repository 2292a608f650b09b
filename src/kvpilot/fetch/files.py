"""Which files of a model folder are fetched, and where they may be written.

The allow-list is the one the ``hf://`` download uses: configs, safetensors and GGUF
weights, tokenizer files; not ``*.bin``/``*.pth`` duplicates of the weights (pickles, and
twice the bytes). Every remote name becomes a path under the destination only after
:func:`local_path` checked it cannot leave it.
"""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path, PurePosixPath

MODEL_FILE_PATTERNS = ("*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.gguf")


def wanted(name: str) -> bool:
    """True when the file's base name matches :data:`MODEL_FILE_PATTERNS`."""
    base = PurePosixPath(name).name
    return any(fnmatch.fnmatchcase(base, p) for p in MODEL_FILE_PATTERNS)


def local_path(dest: Path, relative: str) -> Path:
    """``dest / relative`` for a remote name; raises ValueError for a name that is absolute,
    empty, or has '.', '..' or empty segments (it could write outside ``dest``)."""
    parts = relative.split("/")
    if not relative or relative.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"refusing remote file name {relative!r}: it must be a relative path"
                         " without '.', '..' or empty segments")
    path = dest.joinpath(*parts)
    if os.path.commonpath([dest.resolve(), path.resolve()]) != str(dest.resolve()):
        raise ValueError(f"refusing remote file name {relative!r}: it leaves {dest}")
    return path


def human_bytes(n: float) -> str:
    """``1.5 GiB``, ``12.0 MiB``, ``512 B``."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
