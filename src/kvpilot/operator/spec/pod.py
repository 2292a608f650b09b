"""The pod-level fields of the spec (top-level, beside ``model`` and ``engine``):
resources, scheduling (nodeSelector, tolerations, affinity, topology spread, priority and
runtime class), env and envFrom, labels and annotations, volumes and mounts, the service
account, pull secrets and the termination grace period. Checked so that nothing takes
kvpilot's own volume names, mount paths or labels."""

from __future__ import annotations

import copy
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.constants import ADAPTERS_DIR, ADAPTERS_VOLUME, CACHE_DIR
from kvpilot.operator.model_uri import MODELS_DIR
from kvpilot.operator.spec.fields import FieldReader, SpecError, is_dns_subdomain


@dataclass(frozen=True)
class PodSettings:
    """Pod-level settings passed to the engine pods. Mappings are copies; never mutated."""

    resources: Mapping[str, Any]
    node_selector: Mapping[str, str]
    tolerations: tuple[Mapping[str, Any], ...]
    affinity: Mapping[str, Any] | None
    env: tuple[Mapping[str, Any], ...]
    pod_annotations: Mapping[str, str]
    service_account_name: str | None
    termination_grace_period_seconds: int
    image_pull_secrets: tuple[str, ...] = ()
    priority_class_name: str | None = None
    pod_labels: Mapping[str, str] = field(default_factory=dict)
    runtime_class_name: str | None = None
    topology_spread_constraints: tuple[Mapping[str, Any], ...] = ()
    volumes: tuple[Mapping[str, Any], ...] = ()
    volume_mounts: tuple[Mapping[str, Any], ...] = ()
    env_from: tuple[Mapping[str, Any], ...] = ()


# The pod's own volumes and where the engine mounts them (builders/pod.py): a user volume
# or mount may not take these names or paths.
RESERVED_VOLUME_NAMES = ("tmp", "cache", "models", "dshm", ADAPTERS_VOLUME)
RESERVED_MOUNT_PATHS = ("/tmp", CACHE_DIR, MODELS_DIR, "/dev/shm", ADAPTERS_DIR)
# Labels kvpilot puts on the pods (selectors, ownership): podLabels may not set them.
RESERVED_LABEL_PREFIXES = ("app.kubernetes.io/", "kvpilot.dev/")
# Labels the Deployment controller puts on the pods it creates.
RESERVED_LABEL_KEYS = ("pod-template-hash",)
_LABEL_KEY_RE = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                           r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE_RE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def _python_hash_seed(value: object) -> bool:
    """A PYTHONHASHSEED Python starts with: "random" or a decimal integer below 2**32."""
    return isinstance(value, str) and (value == "random" or (value.isdigit() and int(value) <= 4294967295))


def parse_pod(r: FieldReader) -> PodSettings:
    """The pod-level fields of the top-level spec ``r`` as :class:`PodSettings` (copies of
    the objects; ``r`` is not mutated). Raises SpecError on the first invalid field."""
    env = r.items("env")
    for item in env:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            raise SpecError("env", item, "each entry needs a string name (a core/v1 EnvVar)")
        if item["name"] == "PYTHONHASHSEED" and "value" in item and not _python_hash_seed(item["value"]):
            raise SpecError("env", dict(item), "PYTHONHASHSEED must be \"random\" or an integer in "
                            "0..4294967295 (Python refuses to start otherwise); it seeds the engines' KV "
                            "block hashes (docs/operator.md)")
    tolerations = r.items("tolerations")
    if not all(isinstance(t, Mapping) for t in tolerations):
        raise SpecError("tolerations", list(tolerations), "a list of core/v1 Toleration objects")
    affinity = r.mapping("affinity") or None
    pull_secrets = r.items("imagePullSecrets")
    for item in pull_secrets:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str) or not item["name"]:
            raise SpecError("imagePullSecrets", item, "each entry is {name: <secret name>}")
    pod_labels = _pod_labels(r.mapping("podLabels"))
    runtime_class = r.string("runtimeClassName")
    if runtime_class is not None and not is_dns_subdomain(runtime_class):
        raise SpecError("runtimeClassName", runtime_class, "a RuntimeClass name (a DNS-1123 subdomain)")
    spread = _objects(r, "topologySpreadConstraints", "a list of core/v1 TopologySpreadConstraint objects")
    for item in spread:
        if not isinstance(item.get("topologyKey"), str) or item.get("whenUnsatisfiable") not in (
                "DoNotSchedule", "ScheduleAnyway") or not isinstance(item.get("maxSkew"), int):
            raise SpecError("topologySpreadConstraints", dict(item),
                            "each needs maxSkew (integer), topologyKey and whenUnsatisfiable "
                            "(DoNotSchedule or ScheduleAnyway)")
    volumes = _objects(r, "volumes", "a list of core/v1 Volume objects")
    names = [v.get("name") for v in volumes]
    for volume in volumes:
        name = volume.get("name")
        if not isinstance(name, str) or not name:
            raise SpecError("volumes", dict(volume), "each volume needs a name")
        if name in RESERVED_VOLUME_NAMES:
            raise SpecError("volumes", name, f"a name other than kvpilot's own volumes "
                                             f"({', '.join(RESERVED_VOLUME_NAMES)})")
        if names.count(name) > 1:
            raise SpecError("volumes", name, "unique volume names")
    mounts = _objects(r, "volumeMounts", "a list of core/v1 VolumeMount objects")
    for mount in mounts:
        if mount.get("name") not in names:
            raise SpecError("volumeMounts", dict(mount), f"a mount of one of spec.volumes ({', '.join(map(str, names)) or 'none'})")
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/"):
            raise SpecError("volumeMounts", dict(mount), "an absolute mountPath")
        # The path the kubelet mounts at: '//models' and '/tmp/../models' are /models. A
        # parent of a reserved path ('/', '/dev') would cover it.
        norm = "/" + posixpath.normpath(path).lstrip("/")
        clash = [p for p in RESERVED_MOUNT_PATHS
                 if norm == p or norm.startswith(p + "/") or p.startswith(norm.rstrip("/") + "/")]
        if clash:
            raise SpecError("volumeMounts", path, f"a path outside kvpilot's own mounts ({', '.join(RESERVED_MOUNT_PATHS)})")
    env_from = _objects(r, "envFrom", "a list of core/v1 EnvFromSource objects")
    for source in env_from:
        refs = [k for k in ("configMapRef", "secretRef") if isinstance(source.get(k), Mapping)]
        if len(refs) != 1 or not isinstance(source[refs[0]].get("name"), str):
            raise SpecError("envFrom", dict(source), "each entry is {configMapRef: {name}} or {secretRef: {name}}, "
                                                     "with an optional prefix")
    return PodSettings(
        pod_labels=pod_labels,
        runtime_class_name=runtime_class,
        topology_spread_constraints=tuple(copy.deepcopy(dict(x)) for x in spread),
        volumes=tuple(copy.deepcopy(dict(x)) for x in volumes),
        volume_mounts=tuple(copy.deepcopy(dict(x)) for x in mounts),
        env_from=tuple(copy.deepcopy(dict(x)) for x in env_from),
        resources=r.mapping("resources"),
        node_selector=r.mapping("nodeSelector"),
        tolerations=tuple(dict(t) for t in tolerations),
        affinity=affinity,
        env=tuple(dict(e) for e in env),
        pod_annotations=r.mapping("podAnnotations"),
        service_account_name=r.string("serviceAccountName"),
        termination_grace_period_seconds=r.integer("terminationGracePeriodSeconds", 0, 86400),
        image_pull_secrets=tuple(item["name"] for item in pull_secrets),
        priority_class_name=r.string("priorityClassName"),
    )


def _objects(r: FieldReader, key: str, what: str) -> tuple[Mapping[str, Any], ...]:
    """``key``'s list of objects; SpecError naming it when an entry is not an object."""
    items = r.items(key)
    if not all(isinstance(x, Mapping) for x in items):
        raise SpecError(key, list(items), what)
    return tuple(items)


def _pod_labels(labels: Mapping[str, Any]) -> dict[str, str]:
    """``podLabels``, checked: valid keys and values, none of kvpilot's own."""
    out: dict[str, str] = {}
    for key, value in labels.items():
        if not isinstance(key, str) or not _LABEL_KEY_RE.fullmatch(key):
            raise SpecError("podLabels", key, "a label key ([prefix/]name, name at most 63 characters)")
        if key.startswith(RESERVED_LABEL_PREFIXES) or key in RESERVED_LABEL_KEYS:
            raise SpecError("podLabels", key, f"a key outside kvpilot's own label prefixes "
                                              f"({', '.join(RESERVED_LABEL_PREFIXES)}) and the "
                                              f"controllers' ({', '.join(RESERVED_LABEL_KEYS)})")
        if not isinstance(value, str) or not _LABEL_VALUE_RE.fullmatch(value):
            raise SpecError(f"podLabels.{key}", value, "a label value (at most 63 characters: "
                                                      "letters, digits, '-', '_', '.')")
        out[key] = value
    return out
