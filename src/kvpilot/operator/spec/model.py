"""``spec.model``: where the weights come from (``uri``, grammar in
:mod:`kvpilot.operator.model_uri`), the name they are served as, how s3:// and oci://
models are fetched, and the weights' format (``quantization``)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from kvpilot.operator.model_uri import ModelSource, parse_model_uri, with_fetch_options
from kvpilot.operator.spec.defaults import DEFAULTS
from kvpilot.operator.spec.fields import FieldReader, SpecError, is_dns_subdomain
from kvpilot.sizing.quantization import AUTO, WEIGHT_FORMATS

# The CRD's pattern for model.servedModelName (also checked here for unvalidated specs).
_SERVED_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._/:-]{0,127}$")
# model.quantization (the CRD's enum): auto (absent: the engine reads the format from the
# checkpoint), or a weight format of kvpilot.sizing.quantization, each mapped to vLLM's
# --quantization value (builders.engine_args.quantization_args).
QUANTIZATIONS: tuple[str, ...] = (AUTO, *WEIGHT_FORMATS)


def parse_model(raw: Any, lora: bool = False) -> ModelSource:
    """``spec.model`` -> the model source. ``lora``: the spec turns LoRA on, and the
    engines' adapter downloads read ``model.credentialsSecret`` too (so the Secret is
    allowed whatever the model's scheme). Raises SpecError naming
    ``model.uri``, ``model.servedModelName``, ``model.credentialsSecret`` or
    ``model.ociMount``."""
    model = FieldReader(raw, "model", DEFAULTS)
    uri = model.required_string("uri")
    served = model.string("servedModelName")
    if served is not None and not _SERVED_NAME.fullmatch(served):
        raise SpecError("model.servedModelName", served,
                        "1-128 characters of letters, digits and . _ / : -, starting with a"
                        " letter or digit")
    try:
        source = parse_model_uri(uri, served)
    except ValueError as exc:
        raise SpecError("model.uri", uri, str(exc)) from None
    secret, mount = model.string("credentialsSecret"), model.string("ociMount")
    if secret is not None and not is_dns_subdomain(secret):
        raise SpecError("model.credentialsSecret", secret, "a Secret name (a DNS-1123 subdomain)")
    quantization = AUTO if model.raw.get("quantization") is None else \
        model.choice("quantization", QUANTIZATIONS)
    try:
        source = with_fetch_options(source, secret, mount, lora)
    except ValueError as exc:
        where = "model.ociMount" if mount is not None and "ociMount" in str(exc) else "model.credentialsSecret"
        raise SpecError(where, mount if where == "model.ociMount" else secret, str(exc)) from None
    return dataclasses.replace(source, quantization=quantization)
