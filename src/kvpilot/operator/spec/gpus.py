"""The GPUs a pod asks for (``spec.resources``) and the tensor-parallel size they allow:
whole GPUs are ``*/gpu`` resources (nvidia.com/gpu, amd.com/gpu); NVIDIA MIG slices
(``nvidia.com/mig-*``) are not whole GPUs, and an engine cannot span several."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from kvpilot.operator.spec.engine import EngineSpec
from kvpilot.operator.spec.fields import SpecError

# Resources that are whole GPUs (nvidia.com/gpu, amd.com/gpu) and NVIDIA MIG slices.
GPU_RESOURCE_SUFFIX = "/gpu"
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
# A GPU count written as a quantity string ("4"): what the CRD's rules read with int().
_WHOLE_NUMBER = re.compile(r"^[0-9]+$")


def _asked_resources(resources: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Each resource the pod asks for -> (``resources.limits`` or ``resources.requests``,
    its quantity): the limit, else the request."""
    asked: dict[str, tuple[str, Any]] = {}
    for section in ("requests", "limits"):
        quantities = resources.get(section) or {}
        if not isinstance(quantities, Mapping):
            raise SpecError(f"resources.{section}", quantities,
                            "a map of resource names to quantities")
        asked.update({name: (f"resources.{section}", qty) for name, qty in quantities.items()})
    return asked


def _whole_number(where: str, quantity: Any) -> int:
    """A GPU quantity (4 or "4") as an int; SpecError when it is not a whole number."""
    if isinstance(quantity, int) and not isinstance(quantity, bool) and quantity >= 0:
        return quantity
    if isinstance(quantity, str) and _WHOLE_NUMBER.fullmatch(quantity):
        return int(quantity)
    raise SpecError(where, quantity, "a whole number of GPUs, such as 4 or \"4\"")


def gpu_count(resources: Mapping[str, Any]) -> int:
    """Whole GPUs the pod asks for: the quantities of its ``*/gpu`` resources
    (nvidia.com/gpu, amd.com/gpu; the limit, else the request), summed. 0 for a CPU pod
    and for MIG slices (``nvidia.com/mig-*``), which are not whole GPUs."""
    return sum(_whole_number(f"{where}.{name}", qty)
               for name, (where, qty) in _asked_resources(resources).items()
               if name.endswith(GPU_RESOURCE_SUFFIX))


def nonzero_quantity(quantity: object) -> bool:
    """Whether a resource quantity asks for anything (a limit of 0 asks for none)."""
    return str(quantity).strip() not in ("0", "0.0", "")


def mig_slices(resources: Mapping[str, Any]) -> list[str]:
    """The MIG slice resources the pod asks for at least one of."""
    return sorted(name for name, (_, qty) in _asked_resources(resources).items()
                  if name.startswith(MIG_RESOURCE_PREFIX) and nonzero_quantity(qty))


def resolve_tensor_parallel(engine: EngineSpec, resources: Mapping[str, Any]) -> EngineSpec:
    """``engine`` with its tensor-parallel size resolved and checked against the pod:
    engine.tensorParallelSize, else the pod's whole-GPU count (1 without GPUs). It must
    divide the GPU count (a CPU pod may use any size: the engine runs its workers with
    gloo, for tests) and be 1 on MIG slices. Returns a copy; raises SpecError naming
    ``engine.tensorParallelSize`` or the GPU quantity."""
    gpus = gpu_count(resources)
    explicit = engine.tensor_parallel_size or None
    tp = explicit or max(gpus, 1)
    if gpus and gpus % tp:
        divisors = [d for d in range(1, gpus + 1) if gpus % d == 0]
        gpu_names = ", ".join(n for n in _asked_resources(resources) if n.endswith(GPU_RESOURCE_SUFFIX))
        raise SpecError("engine.tensorParallelSize", tp,
                        f"a divisor of the pod's {gpus} GPUs ({gpu_names}): "
                        f"{', '.join(map(str, divisors))}; one engine runs over"
                        " tensorParallelSize GPUs (leave it unset to use them all)")
    mig = mig_slices(resources)
    if tp > 1 and mig:
        raise SpecError("engine.tensorParallelSize", tp,
                        f"1 on MIG slices ({', '.join(mig)}): a process sees one MIG device,"
                        " so an engine cannot span several")
    return dataclasses.replace(engine, tensor_parallel_size=tp)
