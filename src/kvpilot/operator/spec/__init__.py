"""The ``InferenceDeployment`` spec as frozen, validated dataclasses, one module per
section of the CRD's spec.

===================  ==========================================================
module               reads
===================  ==========================================================
``fields``           :class:`SpecError` and :class:`FieldReader`, shared by all
``defaults``         :data:`DEFAULTS`, the CRD's ``default:`` values
``model``            ``spec.model`` (URI, served name, fetch options)
``engine``           ``spec.engine`` (``kvpilot serve`` settings, ``extraArgs``)
``adapters``         ``spec.adapters`` (LoRA adapters) and ``spec.engine.lora`` (limits)
``gpus``             the pod's GPUs and the tensor-parallel size they allow
``autoscaling``      ``spec.autoscaling`` (the policy's ``AutoscalingSpec``)
``router``           ``spec.router`` (vllm-router or an InferencePool)
``pod``              the pod-level fields (resources, scheduling, volumes...)
``inference``        the whole spec: :func:`parse_spec`, :func:`check_name`
===================  ==========================================================

The CRD's schema and CEL rules refuse bad specs at ``kubectl apply``; this package checks
the same rules again, because an object can predate a CRD upgrade or come from a cluster
whose API server skipped validation. :func:`parse_spec` is the only way in: it applies the
CRD's defaults, validates every field and raises :class:`SpecError` naming the field, the
value received and what is allowed. Nothing here talks to Kubernetes (an import-linter
contract keeps Kopf and the kubernetes client out).

:data:`DEFAULTS` must equal the CRD's ``default:`` values (``tests/operator/test_crd.py``
compares them); those under ``autoscaling`` come from the one table in
:data:`kvpilot.autoscaler.spec.DEFAULTS`. ``spec.autoscaling`` becomes the policy's own
:class:`~kvpilot.autoscaler.spec.AutoscalingSpec`: the operator, the simulator and the
policy share one spec.

The names below are the package's API (``MANAGED_FLAGS``: the flags ``engine.extraArgs``
may not repeat); the constants of one section are imported from its module.
"""

from __future__ import annotations

from kvpilot.autoscaler.spec import METRIC_SOURCES, AutoscalingSpec, MetricsSourceSpec
from kvpilot.flags.serve import MANAGED_FLAGS
from kvpilot.operator.spec.defaults import DEFAULTS
from kvpilot.operator.spec.fields import FieldReader, SpecError
from kvpilot.operator.spec.gpus import gpu_count, nonzero_quantity
from kvpilot.operator.spec.inference import InferenceSpec, check_name, parse_spec
from kvpilot.operator.spec.router import EndpointPickerRef, RouterSpec

__all__ = ["DEFAULTS", "MANAGED_FLAGS", "METRIC_SOURCES", "AutoscalingSpec", "EndpointPickerRef",
           "FieldReader", "InferenceSpec", "MetricsSourceSpec", "RouterSpec", "SpecError",
           "check_name", "gpu_count", "nonzero_quantity", "parse_spec"]
