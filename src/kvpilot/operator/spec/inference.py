"""The whole spec: :func:`parse_spec` reads each section (:mod:`.model`, :mod:`.engine`,
:mod:`.autoscaling`, :mod:`.router`, :mod:`.pod`) and checks the rules that span
sections (replicas or autoscaling, scale to zero needs the router, the KV events flag,
the tensor-parallel size against the pod's GPUs, the name's length while the router
runs)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from kvpilot.autoscaler.spec import AutoscalingSpec
from kvpilot.operator.model_uri import ModelSource
from kvpilot.operator.spec.adapters import AdapterSpec, LoraSpec, parse_adapters
from kvpilot.operator.spec.autoscaling import MAX_REPLICAS, parse_autoscaling
from kvpilot.operator.spec.defaults import DEFAULTS
from kvpilot.operator.spec.engine import KV_EVENTS_FLAG, EngineSpec, parse_engine
from kvpilot.operator.spec.fields import FieldReader, SpecError
from kvpilot.operator.spec.gpus import gpu_count, mig_slices, resolve_tensor_parallel
from kvpilot.operator.spec.model import parse_model
from kvpilot.operator.spec.pod import PodSettings, parse_pod
from kvpilot.operator.spec.router import RouterSpec, parse_router

# The router's Deployment and Service are named NAME-router: a Service name is a DNS-1035
# label of at most 63 characters, so the InferenceDeployment's name gets 56.
MAX_NAME_WITH_ROUTER = 56
_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class InferenceSpec:
    """A whole validated spec. Exactly one of ``replicas``/``autoscaling`` is the source of
    the replica count; with neither the fleet is one static replica."""

    model: ModelSource
    engine: EngineSpec
    replicas: int | None
    autoscaling: AutoscalingSpec | None
    pod: PodSettings
    cost_per_replica_hour: float | None
    router: RouterSpec = field(default_factory=RouterSpec)
    adapters: tuple[AdapterSpec, ...] = ()

    @property
    def lora_enabled(self) -> bool:
        """Whether the engines serve LoRA adapters: ``spec.adapters`` is not empty or
        ``spec.engine.lora`` is set (adapters may then come and go without a rollout)."""
        return bool(self.adapters) or self.engine.lora is not None

    @property
    def lora(self) -> LoraSpec | None:
        """The engine's LoRA limits while LoRA is on (``engine.lora``, else the defaults),
        else None."""
        if not self.lora_enabled:
            return None
        return self.engine.lora or LoraSpec()

    @property
    def static_replicas(self) -> int | None:
        """The fixed replica count, or None when the autoscaler decides."""
        if self.autoscaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


def parse_spec(raw: Any, name: str | None = None) -> InferenceSpec:
    """Validate a raw ``spec`` mapping (as stored, camelCase) into an :class:`InferenceSpec`.

    Applies the CRD defaults for missing fields, so it also accepts specs the API server
    did not default. Raises :class:`SpecError` on the first invalid field.

    Args:
        raw: the ``spec`` as stored.
        name: the InferenceDeployment's ``metadata.name``, checked with the spec when
            given (:func:`check_name`: its form before any field, its length against
            ``spec.router`` after them); None checks the spec alone.
    """
    if name is not None:
        _check_label(name)
    r = FieldReader(raw, "", DEFAULTS)
    source = parse_model(r.raw.get("model"), _lora_on(r.raw))
    if r.raw.get("replicas") is not None and r.raw.get("autoscaling") is not None:
        raise SpecError("replicas", r.raw["replicas"],
                        "spec.replicas and spec.autoscaling are mutually exclusive")
    autoscaling = r.raw.get("autoscaling")
    finops = FieldReader(r.raw.get("finops"), "finops", DEFAULTS)
    engine, router = parse_engine(r.raw.get("engine")), parse_router(r.raw.get("router"))
    if router.wants_kv_events:
        for arg in engine.extra_args:
            if arg.split("=", 1)[0] == KV_EVENTS_FLAG:
                raise SpecError("engine.extraArgs", arg,
                                f"{KV_EVENTS_FLAG} is set by the operator while router.policy"
                                " is kv_aware (the router subscribes to those events)")
    scaling = None if autoscaling is None else parse_autoscaling(autoscaling)
    if scaling is not None and scaling.scale_to_zero and not router.runs_router:
        where = "router.enabled is false" if not router.enabled else f"router.mode is {router.mode}"
        raise SpecError("autoscaling.minReplicas", 0,
                        f">= 1 while {where}: scale to zero needs the operator's router"
                        " (router.mode: router) to hold the first request while an engine"
                        " starts")
    replicas = r.optional_integer("replicas", 0, MAX_REPLICAS)
    adapters = parse_adapters(r.raw.get("adapters"), _served_name(source))
    pod = parse_pod(r)
    if scaling is not None and scaling.slo is not None and (
            gpu_count(pod.resources) > 0 or mig_slices(pod.resources)):
        # The latency model's prior: the H200 benchmark's step times for a GPU pod.
        scaling = dataclasses.replace(scaling, slo=dataclasses.replace(scaling.slo,
                                                                       profile="gpu"))
    spec = InferenceSpec(
        model=source,
        engine=resolve_tensor_parallel(engine, pod.resources),
        replicas=replicas,
        autoscaling=scaling,
        pod=pod,
        cost_per_replica_hour=finops.optional_number("costPerReplicaHour", 0.0, 1e9),
        router=router,
        adapters=adapters,
    )
    if name is not None:
        _check_length(name, spec.router)
    return spec


def _lora_on(raw: Any) -> bool:
    """Whether the raw spec turns LoRA on (a non-empty ``adapters`` list, or
    ``engine.lora``): the engines then download adapters with ``model.credentialsSecret``
    (read before the adapters are validated: the model's section is checked first)."""
    engine = raw.get("engine")
    return bool(raw.get("adapters")) or (isinstance(engine, dict) and engine.get("lora") is not None)


def _served_name(source: ModelSource) -> str:
    """The model id the base model is served as: ``model.servedModelName`` (or the URI's
    own default), else the engine's default, the ``--model`` value."""
    return source.served_model_name or source.model_arg


def check_name(name: str, router: RouterSpec | None = None) -> None:
    """Refuse names that cannot name the child objects and label values (DNS-1035, <= 63;
    <= 56 while the router runs, whose Service is NAME-router). Raises SpecError."""
    _check_label(name)
    if router is not None:
        _check_length(name, router)


def _check_label(name: str) -> None:
    if not (isinstance(name, str) and len(name) <= 63 and _NAME_RE.fullmatch(name)):
        raise SpecError("metadata.name", name,
                        "a DNS-1035 label of at most 63 characters is required")


def _check_length(name: str, router: RouterSpec) -> None:
    if router.runs_router and len(name) > MAX_NAME_WITH_ROUTER:
        raise SpecError("metadata.name", name,
                        f"at most {MAX_NAME_WITH_ROUTER} characters while spec.router runs in"
                        " router mode (its Deployment and Service are named NAME-router)")
