"""Where an adapter comes from: a local folder, or a URI the engine fetches itself.

=========================================  ================================================
``/ABSOLUTE/PATH`` or ``file:///ABS/PATH``  the folder as it is (in the image or a volume)
``s3://BUCKET[/PREFIX]``                   :func:`kvpilot.fetch.fetch_model` (the code the
                                           engine pod's ``model-download`` init container
                                           runs; credentials from the environment)
``oci://REGISTRY/REPO[:TAG|@DIGEST]``      the same
``hf://ORG/NAME``                          ``huggingface_hub.snapshot_download`` of the
                                           adapter's files (``HF_TOKEN`` from the environment)
=========================================  ================================================

A fetched adapter lands in ``<cache>/<name>-<hash of the URI>`` (``cache``: the
``KVPILOT_ADAPTER_CACHE`` environment variable, else ``<tmp>/kvpilot-adapters``), written
to a temporary folder first and renamed when complete, so a half-fetched adapter is never
read; a URI fetched before is not fetched again.

The adapters file (``--lora-adapters-file``, written by the operator from
``spec.adapters``) is a JSON list of ``{"name": ..., "uri": ...}`` objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from kvpilot.engine.errors import InvalidRequestError

SCHEMES = ("file://", "s3://", "oci://", "hf://")
_HF = re.compile(r"^hf://([A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)$")
# The files of a PEFT adapter folder.
ADAPTER_PATTERNS = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]


def cache_root() -> Path:
    return Path(os.environ.get("KVPILOT_ADAPTER_CACHE") or Path(tempfile.gettempdir()) / "kvpilot-adapters")


def is_uri(path: str) -> bool:
    return "://" in path


def resolve(location: str, name: str, log: Callable[[str], None]) -> Path:
    """The local folder of the adapter at ``location`` (a path or a URI), fetching it
    first when it is remote. Blocking (network): call off the event loop.

    Raises:
        InvalidRequestError: an unknown scheme, a malformed URI or a failed fetch
            (``param`` ``lora_path``, the message naming the URI and the reason).
    """
    if location.startswith("file://"):
        return Path(location.removeprefix("file://"))
    if not is_uri(location):
        return Path(location)
    if not location.startswith(SCHEMES):
        raise InvalidRequestError(f"lora_path: {location!r} has an unknown scheme; use a local path or "
                                  f"{', '.join(s + '...' for s in SCHEMES)}", "lora_path")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64]
    dest = cache_root() / f"{safe}-{hashlib.sha256(location.encode()).hexdigest()[:16]}"
    if dest.is_dir():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    try:
        if location.startswith("hf://"):
            m = _HF.match(location)
            if m is None:
                raise InvalidRequestError(f"lora_path: {location!r} is not hf://ORG/NAME", "lora_path")
            from huggingface_hub import snapshot_download

            log(f"fetching adapter {name!r} from {location}")
            snapshot_download(repo_id=m.group(1), local_dir=str(tmp), allow_patterns=ADAPTER_PATTERNS)
        else:
            from kvpilot.fetch import fetch_model

            fetch_model(location, tmp, log)
        tmp.rename(dest)
    except InvalidRequestError:
        raise
    except Exception as e:  # the fetch's own error (FetchError, HTTP, auth) with its reason
        raise InvalidRequestError(f"lora_path: fetching {location} failed: {e}", "lora_path") from None
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest


def read_adapters_file(path: str | Path) -> list[tuple[str, str]]:
    """``[(name, uri)]`` of an adapters file (see the module docstring).

    Raises:
        ValueError: unreadable, not a JSON list of objects with string ``name`` and
            ``uri``, or a name twice; the message names the file and the entry.
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"--lora-adapters-file {path}: cannot be read as JSON ({e})") from None
    if not isinstance(data, list):
        raise ValueError(f"--lora-adapters-file {path}: must be a JSON list of {{name, uri}} objects")
    out: list[tuple[str, str]] = []
    for i, entry in enumerate(data):
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str) or not entry["name"] \
                or not isinstance(entry.get("uri"), str) or not entry["uri"]:
            raise ValueError(f"--lora-adapters-file {path}: entry {i} must be an object with non-empty "
                             f"string 'name' and 'uri', got {entry!r}")
        extra = set(entry) - {"name", "uri"}
        if extra:
            raise ValueError(f"--lora-adapters-file {path}: entry {i} has unknown fields {sorted(extra)}")
        if any(entry["name"] == n for n, _ in out):
            raise ValueError(f"--lora-adapters-file {path}: adapter {entry['name']!r} is listed twice")
        out.append((entry["name"], entry["uri"]))
    return out
