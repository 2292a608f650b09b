"""``spec.adapters`` (LoRA adapters served on the base model) and ``spec.engine.lora`` (the
engine's LoRA limits).

An adapter is ``{name, uri}``: clients pick it by giving ``name`` as the request's
``model``, and the engine pod fetches ``uri`` itself (the same fetch code as the
``model-download`` init container, with ``model.credentialsSecret``'s keys in its
environment). URIs: ``s3://BUCKET[/PREFIX]``, ``oci://REGISTRY/REPO[:TAG|@DIGEST]``,
``hf://ORG/NAME`` and ``file:///ABSOLUTE/PATH`` (inside the image or a mounted volume).
``pvc://`` is refused by name: a claim would have to be mounted, which changes the pod
template, so adding such an adapter would roll the fleet.

``spec.engine.lora`` holds vLLM's limits under their flag names: ``maxLoras`` (adapters in
one batch, vLLM's default 1), ``maxLoraRank`` (one of vLLM's ranks, default 16) and
``maxCpuLoras`` (adapters kept in host memory, at least ``maxLoras``; default the
engine's, ``maxLoras``). The defaults do not depend on the adapter list: a default
computed from it would change the pod template, and roll the pods, whenever an adapter is
added or removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kvpilot.fetch.uris import OCI_FORM, S3_FORM, parse_oci, parse_s3
from kvpilot.operator.model_uri import FETCHED
from kvpilot.operator.spec.defaults import DEFAULTS
from kvpilot.operator.spec.fields import FieldReader, SpecError

MAX_ADAPTERS = 64
# OpenAI-compatible model ids (as model.servedModelName; also the CRD's pattern).
ADAPTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
ADAPTER_NAME_RULE = ("1-128 characters of letters, digits and . _ : / -, starting with a letter"
                     " or digit (clients send it as the request's model)")
_HF = re.compile(r"^hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_FILE = re.compile(r"^file:///\S+$")
ADAPTER_FORMS = f"use {S3_FORM}, {OCI_FORM}, hf://ORG/NAME or file:///ABSOLUTE/PATH"
PVC_REFUSED = ("pvc:// adapters are not supported: the claim would have to be mounted, which"
               " changes the pod template and rolls every pod whenever an adapter is added;"
               " mount the claim with spec.volumes/volumeMounts and use file:///MOUNT/PATH")
# vLLM's LoRAConfig.max_lora_rank values.
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
MAX_LORAS = 256
MAX_CPU_LORAS = 4096


@dataclass(frozen=True)
class AdapterSpec:
    """One ``spec.adapters`` entry: the name clients send as ``model`` and where the
    engine fetches the adapter from (``scheme``: s3, oci, hf or file)."""

    name: str
    uri: str
    scheme: str

    @property
    def fetched(self) -> bool:
        """True for the schemes whose download reads ``model.credentialsSecret``."""
        return self.scheme in FETCHED

    def to_json(self) -> dict[str, str]:
        """The entry of the adapters file (``adapters.json``) the engine loads at start-up."""
        return {"name": self.name, "uri": self.uri}


@dataclass(frozen=True)
class LoraSpec:
    """``spec.engine.lora``: the engine's ``--max-loras``, ``--max-lora-rank`` and
    ``--max-cpu-loras`` (None: the engine's default, ``--max-loras``)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None


def adapter_scheme(uri: str) -> str:
    """The scheme of a valid adapter URI; raises ValueError saying what is allowed."""
    if uri.startswith("pvc://"):
        raise ValueError(PVC_REFUSED)
    if uri.startswith("s3://"):
        parse_s3(uri)
        return "s3"
    if uri.startswith("oci://"):
        parse_oci(uri)
        return "oci"
    if _HF.fullmatch(uri):
        return "hf"
    if _FILE.fullmatch(uri):
        return "file"
    raise ValueError(f"unsupported adapter URI: {ADAPTER_FORMS}")


def parse_adapters(raw: Any, served_model_name: str) -> tuple[AdapterSpec, ...]:
    """``spec.adapters`` -> the adapters, in the spec's order. ``served_model_name`` is the
    model id the engine serves the base model as: no adapter may take it. Raises SpecError
    naming ``adapters[i].name`` or ``adapters[i].uri``."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise SpecError("adapters", raw, "a list of {name, uri} objects is required")
    if len(raw) > MAX_ADAPTERS:
        raise SpecError("adapters", f"{len(raw)} entries", f"at most {MAX_ADAPTERS} adapters")
    out: list[AdapterSpec] = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        entry = FieldReader(item, f"adapters[{i}]", {})
        name, uri = entry.required_string("name"), entry.required_string("uri")
        if not ADAPTER_NAME.fullmatch(name):
            raise SpecError(f"adapters[{i}].name", name, ADAPTER_NAME_RULE)
        if name in seen:
            raise SpecError(f"adapters[{i}].name", name, "adapter names must be unique")
        if name == served_model_name:
            raise SpecError(f"adapters[{i}].name", name,
                            "the base model is served under that name (model.servedModelName);"
                            " give the adapter another one")
        if len(uri) > 512:
            raise SpecError(f"adapters[{i}].uri", uri, "at most 512 characters")
        try:
            scheme = adapter_scheme(uri)
        except ValueError as exc:
            raise SpecError(f"adapters[{i}].uri", uri, str(exc)) from None
        seen.add(name)
        out.append(AdapterSpec(name, uri, scheme))
    return tuple(out)


def parse_lora(raw: Any) -> LoraSpec | None:
    """``spec.engine.lora`` with the CRD's defaults, or None when absent. Raises SpecError
    naming ``engine.lora.*``."""
    if raw is None:
        return None
    r = FieldReader(raw, "engine.lora", DEFAULTS)
    lora = LoraSpec(
        max_loras=r.integer("maxLoras", 1, MAX_LORAS),
        max_lora_rank=r.choice("maxLoraRank", MAX_LORA_RANKS),
        max_cpu_loras=r.optional_integer("maxCpuLoras", 1, MAX_CPU_LORAS),
    )
    if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
        raise SpecError("engine.lora.maxCpuLoras", lora.max_cpu_loras,
                        f"must be >= engine.lora.maxLoras ({lora.max_loras}): the adapters of"
                        " a batch are also kept in host memory")
    return lora
