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
``s3://BUCKET[/PREFIX]``                   an init container (``kvpilot fetch-model``)
                                           downloads the model files into an emptyDir;
                                           ``--model /models/NAME`` (NAME: the prefix's
                                           last segment, else the bucket)
``oci://REGISTRY/REPO[:TAG|@DIGEST]``      the artifact or image pulled by the same init
                                           container, or mounted as an image volume
                                           (``model.ociMount: ImageVolume``);
                                           ``--model /models/NAME`` (the repository's last
                                           segment)
=========================================  ===========================================

s3 and oci models are served as NAME unless ``servedModelName`` says otherwise (hf models
as ``ORG/NAME``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from kvpilot.fetch.uris import OCI_FORM, S3_FORM, parse_oci, parse_s3

EMBEDDED_URI = "embedded://smollm2-135m-instruct"
MODELS_DIR = "/models"
_HF = re.compile(r"^hf://([A-Za-z0-9][A-Za-z0-9._-]*)/([A-Za-z0-9][A-Za-z0-9._-]*)$")
_PVC = re.compile(r"^pvc://([a-z0-9]([-a-z0-9]*[a-z0-9])?)(/[^/\s]\S*)?$")
_FILE = re.compile(r"^file://(/\S+)$")
SUPPORTED = (f"use hf://ORG/NAME, pvc://CLAIM[/PATH], {S3_FORM}, {OCI_FORM},"
             f" file:///ABSOLUTE/PATH or {EMBEDDED_URI}")
# Schemes an init container fetches with `kvpilot fetch-model` (credentials allowed).
FETCHED = ("s3", "oci")


@dataclass(frozen=True)
class ModelSource:
    """Where the weights are, as the pod sees them.

    Attributes:
        uri: the spec's URI, unchanged.
        scheme: ``embedded``, ``hf``, ``pvc``, ``file``, ``s3`` or ``oci``.
        model_arg: the ``--model`` value for ``kvpilot serve``.
        served_model_name: ``--served-model-name`` (None = the engine's default).
        hf_repo: ``ORG/NAME`` to download (hf only).
        claim_name: PersistentVolumeClaim mounted at ``/models`` (pvc only).
        oci_reference: ``REGISTRY/REPO[:TAG][@DIGEST]`` (oci only: an image volume's
            reference).
        credentials_secret: the Secret whose keys become the download's environment
            (``model.credentialsSecret``; s3 and oci only).
        oci_mount: ``InitContainer`` (pull into an emptyDir) or ``ImageVolume`` (the
            kubelet mounts the image; Kubernetes 1.35+ with a runtime that supports it).
        quantization: ``model.quantization``: the weights' format, a name of
            :data:`kvpilot.sizing.quantization.WEIGHT_FORMATS`, or ``auto`` (the engine
            reads it from the checkpoint).
    """

    uri: str
    scheme: str
    model_arg: str
    served_model_name: str | None
    hf_repo: str | None = None
    claim_name: str | None = None
    oci_reference: str | None = None
    credentials_secret: str | None = None
    oci_mount: str = "InitContainer"
    quantization: str = "auto"

    @property
    def image_volume(self) -> bool:
        """True when the model is an image volume (oci with ``ociMount: ImageVolume``)."""
        return self.scheme == "oci" and self.oci_mount == "ImageVolume"

    @property
    def fetched(self) -> bool:
        """True for the schemes ``kvpilot fetch-model`` downloads (s3, oci)."""
        return self.scheme in FETCHED


OCI_MOUNTS = ("InitContainer", "ImageVolume")


def with_fetch_options(source: ModelSource, credentials_secret: str | None,
                       oci_mount: str | None, lora: bool = False) -> ModelSource:
    """``source`` with ``model.credentialsSecret`` and ``model.ociMount``; raises ValueError
    naming the field when nothing has a use for it. ``lora``: LoRA is on (the engines
    download ``spec.adapters`` with the same Secret)."""
    if credentials_secret is not None and not source.fetched and not lora:
        raise ValueError(f"model.credentialsSecret is for s3:// and oci:// models and for"
                         f" LoRA adapters; this {source.scheme} model has no use for it and"
                         " LoRA is off (hf:// reads HF_TOKEN from env)")
    if oci_mount is not None:
        if oci_mount not in OCI_MOUNTS:
            raise ValueError(f"model.ociMount must be one of {', '.join(OCI_MOUNTS)};"
                             f" got {oci_mount!r}")
        if source.scheme != "oci":
            raise ValueError(f"model.ociMount is for oci:// models; got a {source.scheme} model")
        if oci_mount == "ImageVolume" and credentials_secret is not None and not lora:
            raise ValueError("model.credentialsSecret is not used with model.ociMount ImageVolume:"
                             " the kubelet pulls with the pod's imagePullSecrets")
    return replace(source, credentials_secret=credentials_secret,
                   oci_mount=oci_mount or "InitContainer")


def parse_model_uri(uri: str, served_model_name: str | None = None) -> ModelSource:
    """Parse a model URI; raises ValueError naming the URI and the supported forms."""
    if uri == EMBEDDED_URI:
        return ModelSource(uri, "embedded", uri, served_model_name)
    if m := _HF.fullmatch(uri):
        repo = f"{m.group(1)}/{m.group(2)}"
        # The HF convention: clients ask for the model by its repository id.
        return ModelSource(uri, "hf", f"{MODELS_DIR}/{m.group(1)}--{m.group(2)}",
                           served_model_name or repo, hf_repo=repo)
    if m := _PVC.fullmatch(uri):
        if ".." in (m.group(3) or "").split("/"):
            raise ValueError(f"model URI {uri!r}: a pvc:// path may not contain '..' segments"
                             " (it is a path inside the claim)")
        path = MODELS_DIR + (m.group(3) or "")
        return ModelSource(uri, "pvc", path, served_model_name, claim_name=m.group(1))
    if m := _FILE.fullmatch(uri):
        return ModelSource(uri, "file", m.group(1), served_model_name)
    if uri.startswith("s3://"):
        location = parse_s3(uri)
        return ModelSource(uri, "s3", f"{MODELS_DIR}/{location.name}",
                           served_model_name or location.name)
    if uri.startswith("oci://"):
        ref = parse_oci(uri)
        return ModelSource(uri, "oci", f"{MODELS_DIR}/{ref.name}",
                           served_model_name or ref.name, oci_reference=ref.reference)
    raise ValueError(f"unsupported model URI {uri!r}: {SUPPORTED}")
