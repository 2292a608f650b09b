"""One round of the adapter sync over a fleet, and the status it reports.

::

    ready engine pods  x  spec.adapters
      --sync_pod (in parallel, at most MAX_PARALLEL pods)-->
          GET /v1/models -> {name: root}
          unload every adapter the spec no longer lists, or lists with another uri
          load every spec adapter the pod lacks (the same name with another uri: after
              its unload)
      --> PodResult per pod (what it serves afterwards, what failed and why)
      --> adapters_status: status.adapters, status.adaptersReady, the AdaptersReady
          condition

A pod's calls run one after another (an unload before the load of the same name); pods
run side by side, and one pod's failure (unreachable, a refused load) never stops
another's. An adapter that failed on a pod is tried again next round.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvpilot.operator.adapters.engine_api import AdapterApiError, EngineAdapterApi
from kvpilot.operator.autoscaling.metrics_source import EnginePod
from kvpilot.operator.spec.adapters import AdapterSpec
from kvpilot.operator.spec.inference import InferenceSpec
from kvpilot.operator.status.conditions import Condition

MAX_PARALLEL = 8
# status.adapters[].pods lists at most this many pod names.
MAX_LISTED_PODS = 16
API_KEY_ENV = "KVPILOT_API_KEY"
API_KEY_FLAG = "--api-key"


@dataclass(frozen=True)
class Plan:
    """What one pod needs: names to unload, then adapters to load, in spec order."""

    unload: tuple[str, ...]
    load: tuple[AdapterSpec, ...]

    @property
    def empty(self) -> bool:
        return not self.unload and not self.load


def plan(wanted: Sequence[AdapterSpec], loaded: Mapping[str, str]) -> Plan:
    """The calls that bring a pod serving ``loaded`` (name -> root) to ``wanted``: an
    adapter the spec no longer lists is unloaded; one it lists under another uri is
    unloaded and loaded again; a missing one is loaded."""
    by_name = {a.name: a for a in wanted}
    unload = tuple(name for name, root in sorted(loaded.items())
                   if name not in by_name or by_name[name].uri != root)
    load = tuple(a for a in wanted if loaded.get(a.name) != a.uri)
    return Plan(unload, load)


@dataclass(frozen=True)
class PodResult:
    """One pod after its part of the round.

    Attributes:
        pod: its name.
        serving: name -> root of what it serves now (as listed, then changed by the calls
            that succeeded); empty when it could not be read.
        errors: adapter name -> why its load or unload failed (the engine's text).
        unreachable: why ``GET /v1/models`` failed (None: it answered).
        changes: ``load NAME`` / ``unload NAME`` calls that succeeded, in order.
    """

    pod: str
    serving: Mapping[str, str] = field(default_factory=dict)
    errors: Mapping[str, str] = field(default_factory=dict)
    unreachable: str | None = None
    changes: tuple[str, ...] = ()


def _base_url(pod: EnginePod) -> str | None:
    if not pod.ip:
        return None
    host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
    return f"http://{host}:{pod.port}"


def sync_pod(api: EngineAdapterApi, pod: EnginePod, wanted: Sequence[AdapterSpec]) -> PodResult:
    """Bring one pod to ``wanted``. Never raises: failures are in the result."""
    base = _base_url(pod)
    if base is None:
        return PodResult(pod.name, unreachable="the pod has no IP yet")
    try:
        serving = {a.name: a.root for a in api.loaded(base)}
    except AdapterApiError as exc:
        return PodResult(pod.name, unreachable=str(exc))
    todo = plan(wanted, serving)
    errors: dict[str, str] = {}
    changes: list[str] = []
    for name in todo.unload:
        try:
            api.unload(base, name)
        except AdapterApiError as exc:
            errors[name] = f"unload: {exc}"
            continue
        serving.pop(name, None)
        changes.append(f"unload {name}")
    for adapter in todo.load:
        if adapter.name in serving:
            continue  # its unload failed: the error says so
        try:
            api.load(base, adapter.name, adapter.uri)
        except AdapterApiError as exc:
            errors[adapter.name] = str(exc)
            continue
        serving[adapter.name] = adapter.uri
        changes.append(f"load {adapter.name}")
    return PodResult(pod.name, serving, errors, None, tuple(changes))


def sync_fleet(api: EngineAdapterApi, pods: Sequence[EnginePod],
               wanted: Sequence[AdapterSpec]) -> list[PodResult]:
    """:func:`sync_pod` on every pod, at most MAX_PARALLEL at once; results in pod order."""
    if not pods:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(pods))) as pool:
        return list(pool.map(lambda pod: sync_pod(api, pod, wanted), pods))


def api_key(spec: InferenceSpec) -> str | None:
    """The engines' API key where the spec holds it in plain text: ``KVPILOT_API_KEY``
    with a ``value`` in ``env``, else ``--api-key`` in ``engine.extraArgs``. None
    otherwise (no key, or one from a Secret, which the operator never reads)."""
    for item in spec.pod.env:
        if item.get("name") == API_KEY_ENV and isinstance(item.get("value"), str) and item["value"]:
            return str(item["value"])
    args = spec.engine.extra_args
    for i, arg in enumerate(args):
        if arg == API_KEY_FLAG and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(API_KEY_FLAG + "="):
            return arg.split("=", 1)[1]
    return None


@dataclass(frozen=True)
class AdaptersReport:
    """What a round found. ``status``: the merge patch (``adapters``, ``adaptersReady``);
    ``condition``: AdaptersReady; ``failures``: ``(pod, adapter, message)`` per failed
    load or unload, for Events."""

    status: dict[str, Any]
    condition: Condition
    failures: tuple[tuple[str, str, str], ...]


def adapters_status(wanted: Sequence[AdapterSpec], results: Sequence[PodResult]) -> AdaptersReport:
    """``status.adapters`` (per spec adapter: the ready pods serving it from its uri, the
    first MAX_LISTED_PODS of their names, the last failure), ``status.adaptersReady``
    (adapters every ready pod serves / adapters) and the AdaptersReady condition."""
    entries: list[dict[str, Any]] = []
    complete = 0
    failures = tuple((r.pod, name, message) for r in results for name, message in sorted(r.errors.items()))
    for adapter in wanted:
        pods = [r.pod for r in results if r.serving.get(adapter.name) == adapter.uri]
        entry: dict[str, Any] = {"name": adapter.name, "uri": adapter.uri, "readyPods": len(pods),
                                 "pods": pods[:MAX_LISTED_PODS]}
        failed = [(pod, message) for pod, name, message in failures if name == adapter.name]
        if failed:
            more = f" (and {len(failed) - 1} more pods)" if len(failed) > 1 else ""
            entry["lastError"] = f"{failed[0][0]}: {failed[0][1]}{more}"
        if results and len(pods) == len(results):
            complete += 1
        entries.append(entry)
    status = {"adapters": entries, "adaptersReady": f"{complete}/{len(wanted)}"}
    unreachable = [r for r in results if r.unreachable is not None]
    if failures:
        listed = "; ".join(f"{name} on {pod}: {message}" for pod, name, message in failures[:3])
        more = f" (and {len(failures) - 3} more)" if len(failures) > 3 else ""
        condition = Condition("AdaptersReady", "False", "AdapterLoadFailed", listed + more)
    elif unreachable:
        listed = "; ".join(f"{r.pod}: {r.unreachable}" for r in unreachable[:3])
        condition = Condition("AdaptersReady", "False", "EngineUnreachable",
                              f"{len(unreachable)} of {len(results)} ready pods did not list"
                              f" their adapters: {listed}")
    elif not results:
        condition = Condition("AdaptersReady", "Unknown", "NoReadyPods",
                              "no engine pod is ready; a starting pod loads the adapters"
                              " before it reports ready")
    else:
        condition = Condition("AdaptersReady", "True", "AdaptersLoaded",
                              f"{len(wanted)} adapter(s) on each of {len(results)} ready pod(s)")
    return AdaptersReport(status, condition, failures)
