"""``make e2e-images``: build the images and import them into the node's cached containerd
root before pytest starts, so no test's timeout covers them.

Each step prints a progress line with its time and its bound; a step that fails or runs
past its bound stops the run with that step's log tail (exit status 1), instead of every
scenario erroring at setup. Image builds and the import are killed at their bound (the
import's bound covers all four images together); the cached base and pause steps are
checked after they end. Steps already done (an image in the buildah store, a reference
in containerd) take a second. The times are written to ``timings.json`` in the image cache
(docs/e2e.md, "Timings").

    python -m e2e.prepare            # what `make e2e-images` runs
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from e2e import images, realnode

T = TypeVar("T")

# Bounds per step in seconds, on the slowest machine measured (2 cores, docs/e2e.md): the
# cold times there are under half of each. KVPILOT_E2E_IMAGE_BOUND_FACTOR scales them all.
BOUNDS = {"base": 900, "pause": 120, "engine": 1800, "operator": 600, "router": 600,
          "import": 1200}


def bound(step: str) -> float:
    """``step``'s bound in seconds, times ``$KVPILOT_E2E_IMAGE_BOUND_FACTOR``.

    Raises:
        ValueError: the factor is not a positive finite number (named)."""
    raw = os.environ.get("KVPILOT_E2E_IMAGE_BOUND_FACTOR", "1")
    try:
        factor = float(raw)
    except ValueError:
        factor = -1.0
    if not 0 < factor < float("inf"):
        raise ValueError(f"KVPILOT_E2E_IMAGE_BOUND_FACTOR={raw!r}: must be a positive number")
    return BOUNDS[step] * factor


def _step(name: str, fn: Callable[[], T], timings: dict[str, float]) -> T:
    start = time.monotonic()
    print(f"e2e-images: {name} ...", flush=True)
    value = fn()
    took = time.monotonic() - start
    timings[name] = round(took, 1)
    limit = bound(name.split()[0])
    print(f"e2e-images: {name} done in {took:.0f} s (bound {limit:.0f} s)", flush=True)
    if took > limit:
        raise images.ImageBuildError(f"{name} took {took:.0f} s, over its bound of {limit:.0f} s")
    return value


def prepare() -> dict[str, float]:
    """Build every image (each only when its content hash is new) and import it; the
    seconds each step took."""
    timings: dict[str, float] = {}
    start = time.monotonic()
    with images.Builder() as builder:
        # Each image has its own bound; the base and pause are built by the first image
        # that needs them, so they are their own steps first.
        _step("base", lambda: builder.ensure_base(timeout=bound("base")), timings)
        _step("pause", builder.ensure_pause, timings)
        refs = [_step(image.name, lambda image=image: builder.ensure(image, timeout=bound(image.name)),
                      timings)
                for image in images.ALL]
        imported = _step("import", lambda: realnode.import_offline(
            builder, refs, progress=lambda line: print(f"e2e-images: {line}", flush=True),
            timeout=bound("import")), timings)
        for ref, seconds in imported.items():
            timings[f"import {ref.rsplit('/', 1)[-1].split(':')[0]}"] = round(seconds, 1)
        timings["total"] = round(time.monotonic() - start, 1)
        record = builder.cache / "timings.json"
        record.write_text(json.dumps({"refs": refs, "seconds": timings}, indent=2) + "\n")
    print(f"e2e-images: ready in {timings['total']:.0f} s: {', '.join(refs)}", flush=True)
    return timings


def main() -> int:
    try:
        prepare()
    except (images.ImageBuildError, RuntimeError, OSError, ValueError,
            subprocess.SubprocessError) as e:
        print(f"e2e-images: FAILED: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
