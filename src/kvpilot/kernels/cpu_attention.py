"""Paged decode attention on CPU that reads K/V from the pages in place (C++).

The torch reference (:func:`kvpilot.kernels.reference.paged_decode_attention`) gathers
every block of every decoding sequence into one padded tensor, converts it, and calls
SDPA with a mask: on CPU the copy alone was about 17% of a batch-32 decode step, and
padding to the longest context in a bucket wastes more. The kernel here
(``csrc/paged_attention_cpu.cpp``) walks each sequence's block table and reads each K/V
row where it lies, decoding FP8 and 4-bit rows on the fly through lookup tables, one
(sequence, KV head) per work item over ATen's intra-op thread pool.

Two ways to get the compiled library, tried in this order by :func:`load`:

1. **Prebuilt** (what the engine image does): ``kvpilot build-kernels --out DIR`` compiles
   the library once per x86-64 vector ISA level of :data:`ISA_LEVELS` (``-march=x86-64-v4``
   with AVX-512, ``-march=x86-64-v3`` with AVX2/FMA) and writes ``DIR/manifest.json``.
   With ``$KVPILOT_CPU_KERNELS_DIR=DIR`` the best level this CPU's flags allow is loaded
   as it is: no compiler, no build, no writable cache. A manifest built from another
   source or torch version, or a CPU that runs none of the levels, is logged and skipped.
2. **Built here**: :func:`torch.utils.cpp_extension.load` (g++, ``-O3 -march=native -fopenmp``) into
   ``$KVPILOT_CACHE_DIR/cpu_kernels`` (default ``~/.cache/kvpilot``), once per machine;
   the build directory is keyed by a hash of the source, the torch version, the compiler
   and the CPU's flags, so a cache copied to another CPU is never loaded there.

Where neither works (no prebuilt level fits and no compiler) :func:`available` says why
and the engine falls back to the torch backend with a warning
(see :mod:`kvpilot.engine.attention.cpu_backend`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .kv4 import kv4_format

log = logging.getLogger("kvpilot.engine")

CSRC = Path(__file__).resolve().parent / "csrc"
# One extension: the paged decode attention, the fused layer ops
# (:mod:`kvpilot.kernels.cpu_layer_ops`) of ``csrc/layer_ops_cpu.cpp`` and the WNA16 GEMM
# (:mod:`kvpilot.kernels.cpu_quant_gemm`) of ``csrc/quant_gemm_cpu.cpp``.
SOURCES = (CSRC / "paged_attention_cpu.cpp", CSRC / "layer_ops_cpu.cpp", CSRC / "quant_gemm_cpu.cpp")
HEADERS = (CSRC / "cpu_math.h",)
# -fno-trapping-math / -fno-math-errno: no FP exception or errno is ever read, and without
# them GCC keeps a branch per clamp or sqrt and leaves the exp loops scalar.
# -fopenmp: at::parallel_for is inlined from ATen's headers as an `omp parallel` region
# (torch's CPU builds use OpenMP), which a translation unit compiled without it ignores:
# every work loop then ran on one thread whatever torch.set_num_threads said. Compile
# only: the GOMP_* calls resolve, when the library is loaded, to the libgomp libtorch_cpu
# already loaded (linking -fopenmp would bring the system's second OpenMP runtime, whose
# threads then compete with torch's: 2-thread calls were 20 times slower, measured).
CFLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-fno-math-errno", "-fopenmp"]
EXTENSION = "kvpilot_cpu_attention"
# Where prebuilt kernels live (``kvpilot build-kernels --out DIR``); unset: build here.
PREBUILT_ENV = "KVPILOT_CPU_KERNELS_DIR"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class IsaLevel:
    """One x86-64 micro-architecture level the prebuilt kernels are compiled for.

    ``march`` is g++'s ``-march`` value; ``flags`` the ``/proc/cpuinfo`` flags a CPU must
    have to run code built for it (the psABI level definitions; LZCNT is ``abm`` there).
    """

    name: str
    march: str
    flags: frozenset[str]

    @property
    def cflags(self) -> list[str]:
        """:data:`CFLAGS` with ``-march=native`` replaced by this level's ``-march``."""
        return [f"-march={self.march}" if f == "-march=native" else f for f in CFLAGS]


_V3_FLAGS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
# Best first: load() picks the first level whose flags the CPU has.
ISA_LEVELS = (
    IsaLevel("x86-64-v4", "x86-64-v4",
             _V3_FLAGS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    IsaLevel("x86-64-v3", "x86-64-v3", _V3_FLAGS),
)

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

# Run in a child Python by build_prebuilt(): cpp_extension.load() with its final
# torch.ops.load_library() made a no-op, so a level is compiled but never loaded (the
# building CPU may lack AVX-512, and one process may register the operators only once).
# argv: name, cflags, build directory, sources...
_BUILD_ONLY = (
    "import sys, torch; from torch.utils import cpp_extension as c; "
    "torch.ops.load_library = lambda path: None; "
    "c.load(name=sys.argv[1], sources=sys.argv[4:], extra_cflags=sys.argv[2].split(), "
    "build_directory=sys.argv[3], is_python_module=False, verbose=False)"
)

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


def cpu_flag_set() -> frozenset[str]:
    """This CPU's ``/proc/cpuinfo`` flags (empty where there is no such file)."""
    line = _cpu_flags()
    return frozenset(line.split(":", 1)[1].split()) if ":" in line else frozenset()


def source_hash() -> str:
    """sha256 over the C++ sources and headers: what a prebuilt library must match."""
    key = hashlib.sha256()
    for src in SOURCES + HEADERS:
        key.update(src.name.encode() + b"\0" + src.read_bytes() + b"\0")
    return key.hexdigest()


def runnable_levels(flags: frozenset[str]) -> list[IsaLevel]:
    """The :data:`ISA_LEVELS` a CPU with ``flags`` runs, best first."""
    return [level for level in ISA_LEVELS if level.flags <= flags]


def pick_level(flags: frozenset[str]) -> IsaLevel | None:
    """The best of :data:`ISA_LEVELS` a CPU with ``flags`` runs (None: none of them)."""
    return next(iter(runnable_levels(flags)), None)


def build_dir() -> Path:
    """Where the compiled kernels of this source, torch, compiler and CPU live."""
    cxx = os.environ.get("CXX", "c++")
    key = hashlib.sha256()
    for part in (source_hash().encode(), " ".join(CFLAGS).encode(), torch.__version__.encode(),
                 _compiler_version(cxx).encode(), _cpu_flags().encode()):
        key.update(part)
    root = Path(os.environ.get("KVPILOT_CACHE_DIR", Path.home() / ".cache" / "kvpilot"))
    return root / "cpu_kernels" / key.hexdigest()[:16]


def _load_prebuilt(root: Path) -> str | None:
    """Load the best prebuilt level in ``root`` this CPU runs; its name, or None (each
    reason logged as a warning) when the manifest is missing, malformed or stale, no
    level fits this CPU, or every fitting library fails to load (the next fitting level
    is tried after one that fails). Never raises."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        if not isinstance(manifest, dict) or not isinstance(manifest.get("levels"), dict) \
                or not all(isinstance(v, str) for v in manifest["levels"].values()):
            raise ValueError("not an object with a 'levels' object of library paths")
        fresh = manifest.get("source") == source_hash() and manifest.get("torch") == torch.__version__
    except (OSError, ValueError) as e:
        log.warning("no usable prebuilt CPU kernels in %s=%s (%s: %s)", PREBUILT_ENV, root,
                    MANIFEST, e)
        return None
    if not fresh:
        log.warning("prebuilt CPU kernels in %s were built from another source or torch "
                    "(torch %s, this is %s); not loaded", root, manifest.get("torch"),
                    torch.__version__)
        return None
    built: dict[str, str] = manifest["levels"]
    flags = cpu_flag_set()
    known = {level.name: level for level in ISA_LEVELS}
    for level in runnable_levels(flags):
        if level.name in built:
            library = root / built[level.name]
            try:
                torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
            except (OSError, RuntimeError) as e:
                log.warning("prebuilt CPU kernels %s (%s) did not load: %s", level.name, library, e)
                continue
            log.info("CPU kernels: prebuilt %s from %s", level.name, root)
            return level.name
    if not built:
        log.warning("prebuilt CPU kernels in %s: the manifest lists no levels", root)
        return None
    lacking = "; ".join(
        f"{name} needs {', '.join(sorted(known[name].flags - flags)) or 'nothing more'}"
        if name in known else f"{name} is not a level this version knows" for name in built)
    log.warning("prebuilt CPU kernels in %s: none of them runs or loads here (%s)", root, lacking)
    return None


def load() -> None:
    """Load the kernels: the prebuilt library for this CPU's ISA level when
    ``$KVPILOT_CPU_KERNELS_DIR`` names one that fits, else compile here (once per
    machine, about a minute) and load that.

    Raises:
        RuntimeError: nothing prebuilt fits and there is no C++ compiler, or the build
            failed (the message says why).
    """
    if _state.get("loaded"):  # every kernel call lands here: no lock once loaded
        return
    with _lock:
        if _state.get("loaded"):
            return
        if "error" in _state:
            raise RuntimeError(str(_state["error"]))
        prebuilt = os.environ.get(PREBUILT_ENV)
        if prebuilt and _load_prebuilt(Path(prebuilt)) is not None:
            _state["loaded"] = True
            return
        try:
            if shutil.which(os.environ.get("CXX", "c++")) is None:
                raise RuntimeError("no C++ compiler (c++ / $CXX) on PATH")
            from torch.utils import cpp_extension

            path = build_dir()
            path.mkdir(parents=True, exist_ok=True)
            if not any(path.glob("*.so")):
                log.info("building the CPU kernels in %s (once per machine)", path)
            cpp_extension.load(
                name=EXTENSION,
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


def build_prebuilt(out: Path, levels: tuple[IsaLevel, ...] = ISA_LEVELS) -> dict[str, str]:
    """Compile the kernels once per ISA level into ``out/<level>/`` and write
    ``out/manifest.json`` (source hash, torch version, level -> library path); what
    ``kvpilot build-kernels`` runs while an image is built.

    Each level is built in its own Python process: one process may register the
    ``kvpilot_cpu`` operators only once. Needs g++ and ninja; the CPU building need not
    run the levels it builds.

    Raises:
        RuntimeError: a level's build failed (the message ends with its output).
        OSError: ``out`` cannot be created or written.
    """
    out.mkdir(parents=True, exist_ok=True)
    # Hashed before compiling (what was compiled), and no manifest while building: a
    # failed build never leaves an old manifest vouching for new libraries.
    source = source_hash()
    (out / MANIFEST).unlink(missing_ok=True)
    built: dict[str, str] = {}
    for level in levels:
        target = out / level.name
        target.mkdir(parents=True, exist_ok=True)
        cflags = " ".join(level.cflags)
        result = subprocess.run(
            [sys.executable, "-c", _BUILD_ONLY, EXTENSION, cflags, str(target),
             *(str(src) for src in SOURCES)],
            capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"building the CPU kernels for {level.name} failed:\n"
                               f"{(result.stdout + result.stderr)[-3000:]}")
        for leftover in target.iterdir():  # object files and ninja's state
            if leftover.name != f"{EXTENSION}.so":
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        built[level.name] = f"{level.name}/{EXTENSION}.so"
        log.info("built the CPU kernels for %s in %s", level.name, target)
    manifest = {"source": source, "torch": torch.__version__,
                "cflags": {lv.name: lv.cflags for lv in levels},
                "compiler": _compiler_version(os.environ.get("CXX", "c++")).splitlines()[:1],
                "levels": built}
    partial = out / f"{MANIFEST}.tmp"
    partial.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(partial, out / MANIFEST)
    return built


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
