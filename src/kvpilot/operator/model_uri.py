"""``spec.model.uri`` -> where the engine finds the weights.

=========================================  ===========================================
URI                                        engine pod
=========================================  ===========================================
``embedded://smollm2-135m-instruct``       ``--model embedded://...`` (inside the image)
``hf://ORG/NAME``                          an init container downloads the repository
                                           into an emptyDir at /models; ``--model``
                                           points there (the engine itself stays offline)
``pvc://CLAIM[/PATH]``                     the claim mounted read-only at /models;
                                           ``--model /models/PATH``
``file:///ABSOLUTE/PATH``                  ``--model /ABSOLUTE/PATH`` (baked into the image)
=========================================  ===========================================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

EMBEDDED_URI = "embedded://smollm2-135m-instruct"
MODELS_DIR = "/models"
_HF = re.compile(r"^hf://([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)$")
_PVC = re.compile(r"^pvc://([a-z0-9]([-a-z0-9]*[a-z0-9])?)(/[^/\s]\S*)?$")
_FILE = re.compile(r"^file://(/\S+)$")
SUPPORTED = f"use hf://ORG/NAME, pvc://CLAIM[/PATH], file:///ABSOLUTE/PATH or {EMBEDDED_URI}"


@dataclass(frozen=True)
class ModelSource:
    """Where the weights are, as the pod sees them.

    Attributes:
        uri: the spec's URI, unchanged.
        scheme: ``embedded``, ``hf``, ``pvc`` or ``file``.
        model_arg: the ``--model`` value for ``kvpilot serve``.
        served_model_name: ``--served-model-name`` (None = the engine's default).
        hf_repo: ``ORG/NAME`` to download (hf only).
        claim_name: PersistentVolumeClaim mounted at ``/models`` (pvc only).
    """

    uri: str
    scheme: str
    model_arg: str
    served_model_name: str | None
    hf_repo: str | None = None
    claim_name: str | None = None


def parse_model_uri(uri: str, served_model_name: str | None = None) -> ModelSource:
    """Parse a model URI; raises ValueError naming the URI and the supported forms."""
    if uri == EMBEDDED_URI:
        return ModelSource(uri, "embedded", uri, served_model_name)
    if m := _HF.match(uri):
        repo = f"{m.group(1)}/{m.group(2)}"
        # The HF convention: clients ask for the model by its repository id.
        return ModelSource(uri, "hf", f"{MODELS_DIR}/{m.group(1)}--{m.group(2)}",
                           served_model_name or repo, hf_repo=repo)
    if m := _PVC.match(uri):
        if ".." in (m.group(3) or "").split("/"):
            raise ValueError(f"model URI {uri!r}: a pvc:// path may not contain '..' segments"
                             " (it is a path inside the claim)")
        path = MODELS_DIR + (m.group(3) or "")
        return ModelSource(uri, "pvc", path, served_model_name, claim_name=m.group(1))
    if m := _FILE.match(uri):
        return ModelSource(uri, "file", m.group(1), served_model_name)
    raise ValueError(f"unsupported model URI {uri!r}: {SUPPORTED}")
