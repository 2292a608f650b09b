"""``spec.router``: what sits in front of the engine pods: a vllm-router Deployment
(``mode: router``, with its policy, replicas, resources and image) or an InferencePool for
the cluster's Gateway API implementation (``mode: gateway``, with the user's endpoint
picker). The same rules as the CRD's CEL."""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.spec.defaults import DEFAULTS
from kvpilot.operator.spec.fields import FieldReader, SpecError

ROUTER_MODES = ("router", "gateway")
# vllm-router's --policy values this operator offers (it has more: random, round_robin...).
ROUTER_POLICIES = ("kv_aware", "cache_aware", "power_of_two", "consistent_hash")
# The request headers vllm-router 0.1.17's consistent_hash policy hashes on, in the order
# it checks them (src/policies/hash_key.rs); it has no flag to name another header, so a
# header outside this list would be ignored and every request hashed on its body instead.
SESSION_HEADERS = ("x-session-id", "x-user-id", "x-tenant-id", "x-correlation-id",
                   "x-request-id", "x-trace-id")
FAILURE_MODES = ("FailClose", "FailOpen")
MAX_ROUTER_REPLICAS = 100


@dataclass(frozen=True)
class EndpointPickerRef:
    """``spec.router.gateway.endpointPickerRef``: the user's endpoint picker (EPP) Service
    the InferencePool hands routing decisions to. ``port`` is its Service port (gRPC ext-proc)."""

    name: str
    port: int
    failure_mode: str


@dataclass(frozen=True)
class RouterSpec:
    """``spec.router``: what sits in front of the engine pods.

    Attributes:
        enabled: False = no router; clients use the engine Service.
        mode: ``router`` (a vllm-router Deployment) or ``gateway`` (an InferencePool for the
            cluster's Gateway API implementation).
        policy: vllm-router's ``--policy`` (router mode).
        session_header: the header consistent_hash routes on (only with that policy).
        replicas: router pods (router mode).
        resources: the router container's requests/limits (a copy; never mutated).
        image: image override; None = the operator's ``--router-image``.
        endpoint_picker: the gateway mode's endpoint picker (None in router mode).
    """

    enabled: bool = True
    mode: str = "router"
    policy: str = "kv_aware"
    session_header: str | None = None
    replicas: int = 1
    resources: Mapping[str, Any] = field(default_factory=lambda: copy.deepcopy(
        DEFAULTS["router.resources"]))
    image: str | None = None
    endpoint_picker: EndpointPickerRef | None = None

    @property
    def runs_router(self) -> bool:
        """True when the operator runs the vllm-router Deployment."""
        return self.enabled and self.mode == "router"

    @property
    def uses_gateway(self) -> bool:
        """True when the operator applies an InferencePool instead."""
        return self.enabled and self.mode == "gateway"

    @property
    def wants_kv_events(self) -> bool:
        """True when the engines must publish KV-cache events (router mode, kv_aware)."""
        return self.runs_router and self.policy == "kv_aware"


_SERVICE_NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def _resources(r: FieldReader) -> dict[str, Any]:
    """``router.resources``: the CRD's default when absent; requests/limits maps only."""
    raw = r.raw.get("resources")
    if raw is None:
        return copy.deepcopy(dict(r.defaults["router.resources"]))
    value = r.mapping("resources")
    for key, quantities in value.items():
        if key not in ("requests", "limits") or not isinstance(quantities, Mapping):
            raise SpecError("router.resources", value,
                            "an object with requests and/or limits maps (core/v1 quantities)")
    return copy.deepcopy(value)


def parse_router(raw: Any) -> RouterSpec:
    """``spec.router`` with the CRD's defaults; the same rules as the CRD's CEL."""
    r = FieldReader(raw, "router", DEFAULTS)
    mode, policy = r.choice("mode", ROUTER_MODES), r.choice("policy", ROUTER_POLICIES)
    header = r.string("sessionHeader")
    if policy == "consistent_hash" and header is None:
        raise SpecError("router.sessionHeader", None,
                        "required when router.policy is consistent_hash: the header clients"
                        f" put the session id in, one of {', '.join(SESSION_HEADERS)}")
    if header is not None and policy != "consistent_hash":
        raise SpecError("router.sessionHeader", header,
                        f"only with router.policy consistent_hash (policy is {policy})")
    if header is not None and header not in SESSION_HEADERS:
        raise SpecError("router.sessionHeader", header,
                        f"one of {', '.join(SESSION_HEADERS)} (the headers vllm-router's"
                        " consistent_hash reads; it cannot be given another)")
    picker = None
    gateway = FieldReader(r.raw.get("gateway"), "router.gateway", DEFAULTS)
    if mode == "gateway":
        if gateway.raw.get("endpointPickerRef") is None:
            raise SpecError("router.gateway.endpointPickerRef", None,
                            "required when router.mode is gateway: the endpoint picker"
                            " Service ({name, port}) the InferencePool hands requests to")
        ref = FieldReader(gateway.raw["endpointPickerRef"], "router.gateway.endpointPickerRef",
                          DEFAULTS)
        name = ref.required_string("name")
        if len(name) > 63 or not _SERVICE_NAME_RE.fullmatch(name):
            raise SpecError("router.gateway.endpointPickerRef.name", name,
                            "a Service name (a DNS-1035 label of at most 63 characters)")
        picker = EndpointPickerRef(name, ref.integer("port", 1, 65535),
                                   ref.choice("failureMode", FAILURE_MODES))
    return RouterSpec(
        enabled=r.boolean("enabled"),
        mode=mode,
        policy=policy,
        session_header=header,
        replicas=r.integer("replicas", 1, MAX_ROUTER_REPLICAS),
        resources=_resources(r),
        image=r.string("image"),
        endpoint_picker=picker,
    )
