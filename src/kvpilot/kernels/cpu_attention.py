"""Paged decode attention on CPU that reads K/V from the pages in place (C++).

The torch reference (:func:`kvpilot.kernels.reference.paged_decode_attention`) gathers
every block of every decoding sequence into one padded tensor, converts it, and calls
SDPA with a mask: on CPU the copy alone was about 17% of a batch-32 decode step, and
padding to the longest context in a bucket wastes more. The kernel here
(``csrc/paged_attention_cpu.cpp``) walks each sequence's block table and reads each K/V
row where it lies, decoding FP8 and 4-bit rows on the fly through lookup tables, one
(sequence, KV head) per work item over ATen's intra-op thread pool.

It is compiled once per machine with :func:`torch.utils.cpp_extension.load` (g++,
``-O3 -march=native``) into ``$KVPILOT_CACHE_DIR/cpu_kernels`` (default
``~/.cache/kvpilot``); the build directory is keyed by a hash of the source, the torch
version, the compiler and the CPU's flags, so a cache copied to another CPU is never
loaded there. Where no compiler is available :func:`available` says why and the engine
falls back to the torch backend (see :mod:`kvpilot.engine.attention.cpu_backend`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path

import torch

from .kv4 import kv4_format

log = logging.getLogger("kvpilot.engine")

CSRC = Path(__file__).resolve().parent / "csrc"
# One extension: the paged decode attention and the fused layer ops
# (:mod:`kvpilot.kernels.cpu_layer_ops`) of ``csrc/layer_ops_cpu.cpp``.
SOURCES = (CSRC / "paged_attention_cpu.cpp", CSRC / "layer_ops_cpu.cpp")
HEADERS = (CSRC / "cpu_math.h",)
# -fno-trapping-math / -fno-math-errno: no FP exception or errno is ever read, and without
# them GCC keeps a branch per clamp or sqrt and leaves the exp loops scalar.
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno"]

# Cache value kinds; must match ``enum Kind`` in the C++ source.
KINDS: dict[torch.dtype | str, int] = {
    torch.float32: 0,
    torch.bfloat16: 1,
    torch.float16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    "fp4_e2m1": 5,
    "int4": 6,
}
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_lock = threading.Lock()
_state: dict[str, object] = {}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _compiler_version(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build_dir() -> Path:
    """Where the compiled kernels of this source, torch, compiler and CPU live."""
    cxx = os.environ.get("CXX", "c++")
    key = hashlib.sha256()
    for part in (*(src.read_bytes() for src in SOURCES + HEADERS), " ".join(CFLAGS).encode(), torch.__version__.encode(),
                 _compiler_version(cxx).encode(), _cpu_flags().encode()):
        key.update(part)
    root = Path(os.environ.get("KVPILOT_CACHE_DIR", Path.home() / ".cache" / "kvpilot"))
    return root / "cpu_kernels" / key.hexdigest()[:16]


def load() -> None:
    """Compile (once per machine, about a minute) and load the kernels.

    Raises:
        RuntimeError: no C++ compiler, or the build failed (the message says why).
    """
    if _state.get("loaded"):  # every kernel call lands here: no lock once loaded
        return
    with _lock:
        if _state.get("loaded"):
            return
        if "error" in _state:
            raise RuntimeError(str(_state["error"]))
        try:
            if shutil.which(os.environ.get("CXX", "c++")) is None:
                raise RuntimeError("no C++ compiler (c++ / $CXX) on PATH")
            from torch.utils import cpp_extension

            path = build_dir()
            path.mkdir(parents=True, exist_ok=True)
            if not any(path.glob("*.so")):
                log.info("building the CPU kernels in %s (once per machine)", path)
            cpp_extension.load(
                name="kvpilot_cpu_attention",
                sources=[str(src) for src in SOURCES],
                extra_cflags=CFLAGS,
                build_directory=str(path),
                is_python_module=False,
                verbose=False,
            )
        except Exception as e:  # any build failure means: not available
            text = str(e)
            _state["error"] = f"CPU attention kernels unavailable: {text if len(text) < 2000 else text[-2000:]}"
            raise RuntimeError(str(_state["error"])) from e
        _state["loaded"] = True


def available() -> tuple[bool, str]:
    """``(True, "")`` when the kernels load here, else ``(False, why)``."""
    try:
        load()
    except RuntimeError as e:
        return False, str(e)
    return True, ""


def _raw(x: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as ``[num_blocks, block_size, num_kv_heads, row_bytes]`` uint8."""
    return x.contiguous().view(torch.uint8).view(*x.shape[:3], -1)


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    key_group_scales: torch.Tensor | None = None,
    value_group_scales: torch.Tensor | None = None,
    kv4_format: str | None = None,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """One query token per sequence attending to its paged context, K/V read in place.

    Same contract as :func:`kvpilot.kernels.reference.paged_decode_attention`, with
    :func:`kvpilot.kernels.reference.paged_attention`'s ``sliding_window`` W (the query
    at position ``p`` sees keys ``p - W < j <= p``; the pages wholly before that are not
    read, so their block-table entries may point anywhere in range) and
    ``logit_softcap`` c (scores ``s`` become ``c * tanh(s / c)`` before the softmax).

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` fp32, bf16 or fp16 (CPU).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` in
            fp32/bf16/fp16/float8_e4m3fn/float8_e5m2, or a 4-bit cache's uint8
            ``[..., head_dim // 2]`` with ``key_group_scales``/``value_group_scales``
            ``[..., head_dim // 16]`` float8_e4m3fn and ``kv4_format``.
        block_tables: ``[num_seqs, max_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32 context lengths (>= 1) including the query token.
        scale: softmax scale.
        k_scale, v_scale: fp32 0-d tensors the stored values are multiplied by (None = 1).
    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``q.dtype``; a new tensor.
    Raises:
        RuntimeError: the kernels are unavailable; a context longer than its block table,
            a block id outside the cache, a query dtype other than fp32/bf16/fp16.
        ValueError: ``sliding_window`` below 1, ``logit_softcap`` not finite and > 0.
    """
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1 token; got {sliding_window}")
    if logit_softcap is not None and not (0 < logit_softcap < float("inf")):
        raise ValueError(f"logit_softcap must be finite and > 0; got {logit_softcap}")
    load()
    if q.dtype not in QUERY_DTYPES:
        raise RuntimeError(f"CPU paged decode: query dtype {q.dtype} is not one of {QUERY_DTYPES}")
    if kv4_format is not None:
        kind = KINDS[kv4_format_name(kv4_format)]
        assert key_group_scales is not None and value_group_scales is not None
        kg, vg = _raw(key_group_scales), _raw(value_group_scales)
        head_dim = key_cache.shape[-1] * 2
    else:
        if key_cache.dtype not in KINDS:
            raise RuntimeError(f"CPU paged decode: cache dtype {key_cache.dtype} is not supported")
        kind = KINDS[key_cache.dtype]
        kg = vg = torch.empty(0, dtype=torch.uint8)
        head_dim = key_cache.shape[-1]
    one = torch.ones((), dtype=torch.float32)
    kf = one if k_scale is None else k_scale.float().reshape(())
    vf = one if v_scale is None else v_scale.float().reshape(())
    q = q.contiguous()
    out = torch.empty_like(q)
    torch.ops.kvpilot_cpu.paged_decode_attention(
        out, q, _raw(key_cache), _raw(value_cache), kg, vg,
        block_tables.to(torch.int32).contiguous(), seq_lens.to(torch.int32).contiguous(),
        float(scale), kf, vf, kind, head_dim, int(sliding_window or 0), float(logit_softcap or 0.0),
    )
    return out


def kv4_format_name(fmt: str) -> str:
    """The canonical name of a 4-bit format (raises ValueError for an unknown one)."""
    return kv4_format(fmt).name
