"""The autoscaling spec: what a user asks of the policy (``spec.autoscaling`` on the CR).

One :class:`AutoscalingSpec` for everyone: the operator builds it from the validated CR
(``kvpilot.operator.spec.parse_spec``), the simulator from a scenario
(``kvpilot.autoscaler.sim.compare.Scenario``), and the policy reads it. It is frozen and
validated once in ``__post_init__``; bad values raise ``ValueError`` naming the field (in
the CRD's camelCase), the value received and what is allowed.

:data:`DEFAULTS` is the one table of the CRD's ``default:`` values under
``spec.autoscaling`` (camelCase, dotted below it): the dataclass defaults come from it,
the operator applies it to raw specs, and ``tests/autoscaler/test_spec.py`` compares it
with both copies of the CRD (``crds/`` and the chart's).

The fields below ``metrics`` are policy constants the CRD does not expose (yet); their
defaults are the ones the simulator and benchmark were run with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

# The CRD's defaults under spec.autoscaling (maxReplicas has none: it is required).
DEFAULTS: dict[str, Any] = {
    "minReplicas": 1,
    "targetCacheUsage": 0.75,
    "targetQueueDepth": 4,
    "targetSaturation": 0.75,
    "startupSeconds": 120,
    "scaleUpStabilizationSeconds": 0,
    "scaleDownStabilizationSeconds": 300,
    "intervalSeconds": 15,
    "nodeStartupSeconds": 0,
    "scaleToZeroAfterSeconds": 300,
    "activationTimeoutSeconds": 300,
    "metrics.source": "pods",
    "engine": "kvpilot",
    "slo.percentile": 0.9,
}
METRIC_SOURCES = ("prometheus", "pods")
# Who scales the fleet: ``kvpilot`` (the operator's own loop, this policy) or ``keda`` (the
# operator writes a KEDA ScaledObject and KEDA's HPA scales; the policy is not called).
AUTOSCALING_ENGINES = ("kvpilot", "keda")
# Per-pod KV usage at which the starvation alarm fires; a target must stay below it.
STARVATION_USAGE = 0.95
# What maxReplicas is when a caller (the simulator, a test) does not say.
UNSET_MAX_REPLICAS = 10
# The longest latency target an SLO may name (seconds): a day. Longer is a typo.
MAX_SLO_SECONDS = 86400.0
# The latency model's priors (kvpilot.autoscaler.latency.PRIORS): which benchmark's
# step times a fleet starts from before it has measured its own.
LATENCY_PROFILES = ("cpu", "gpu")

# CRD camelCase name -> dataclass field, for from_crd()/to_crd() and error messages.
_CRD_NAMES = {
    "minReplicas": "min_replicas",
    "maxReplicas": "max_replicas",
    "targetCacheUsage": "target_cache_usage",
    "targetQueueDepth": "target_queue_depth",
    "targetSaturation": "target_saturation",
    "startupSeconds": "startup_seconds",
    "scaleUpStabilizationSeconds": "scale_up_stabilization_seconds",
    "scaleDownStabilizationSeconds": "scale_down_stabilization_seconds",
    "intervalSeconds": "interval_seconds",
    "nodeStartupSeconds": "node_startup_seconds",
    "scaleToZeroAfterSeconds": "scale_to_zero_after_seconds",
    "activationTimeoutSeconds": "activation_timeout_seconds",
}
_FIELD_TO_CRD = {v: k for k, v in _CRD_NAMES.items()}


def _name(field_name: str) -> str:
    return _FIELD_TO_CRD.get(field_name, field_name)


@dataclass(frozen=True)
class MetricsSourceSpec:
    """``spec.autoscaling.metrics``: where the operator reads the engines' signals.

    Attributes:
        source: ``pods`` (scrape each ready pod's ``/metrics``) or ``prometheus``.
        url: the Prometheus base URL (required for ``prometheus``, else unused).

    Raises:
        ValueError: an unknown source, or ``prometheus`` without a URL.
    """

    source: str = DEFAULTS["metrics.source"]
    url: str | None = None

    def __post_init__(self) -> None:
        if self.source not in METRIC_SOURCES:
            raise ValueError(
                f"metrics.source must be one of {', '.join(METRIC_SOURCES)}; got {self.source!r}"
            )
        if self.source == "prometheus" and not self.url:
            raise ValueError("metrics.url is required when metrics.source is prometheus")


@dataclass(frozen=True)
class SloSpec:
    """``spec.autoscaling.slo``: latency targets the fleet is sized for
    (:mod:`kvpilot.autoscaler.latency`, the ``latency`` rule).

    Attributes:
        ttft_seconds: time to first token the ``percentile`` of requests must stay under
            (seconds, in (0, 86400]), or None for no TTFT target.
        itl_seconds: inter-token latency the ``percentile`` of tokens must stay under
            (seconds, in (0, 86400]), or None for no ITL target.
        percentile: which quantile of the engines' histograms is held to the targets, in
            (0, 1) exclusive (0.9 = p90).
        profile: which benchmark prior the ITL model starts from, one of
            :data:`LATENCY_PROFILES` (the CRD does not expose it: the operator sets ``gpu``
            when the engine pod asks for GPUs, else ``cpu``).

    Raises:
        ValueError: a target that is not a number, zero, negative, non-finite or above a
            day; a percentile outside (0, 1); neither target set (an SLO without a target
            would be silently ignored); an unknown profile. The message names the field
            (camelCase, under ``slo.``), the value and what is allowed.
    """

    ttft_seconds: float | None = None
    itl_seconds: float | None = None
    percentile: float = float(DEFAULTS["slo.percentile"])
    profile: str = "cpu"

    def __post_init__(self) -> None:
        for name, crd in (("ttft_seconds", "ttftSeconds"), ("itl_seconds", "itlSeconds")):
            value = getattr(self, name)
            if value is None:
                continue
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or not 0.0 < value <= MAX_SLO_SECONDS):
                raise ValueError(f"slo.{crd} must be a number in (0, {MAX_SLO_SECONDS:g}]"
                                 f" seconds; got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.ttft_seconds is None and self.itl_seconds is None:
            raise ValueError("slo needs ttftSeconds or itlSeconds (or both); got neither")
        p = self.percentile
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 < p < 1.0:
            raise ValueError(f"slo.percentile must be a number in (0, 1), e.g. 0.9; got {p!r}")
        object.__setattr__(self, "percentile", float(p))
        if self.profile not in LATENCY_PROFILES:
            raise ValueError(f"slo profile must be one of {', '.join(LATENCY_PROFILES)};"
                             f" got {self.profile!r}")

    @property
    def quantile_label(self) -> str:
        """``p90`` for 0.9, ``p99.5`` for 0.995: how reasons and signals name it."""
        return f"p{self.percentile * 100:g}"

    @classmethod
    def from_crd(cls, slo: Mapping[str, Any]) -> SloSpec:
        """From ``spec.autoscaling.slo`` (camelCase); an absent percentile takes 0.9.

        Raises:
            ValueError: as the constructor; ``slo`` not a mapping.
        """
        if not isinstance(slo, Mapping):
            raise ValueError(f"slo must be an object; got {slo!r}")
        percentile = slo.get("percentile")
        return cls(ttft_seconds=slo.get("ttftSeconds"), itl_seconds=slo.get("itlSeconds"),
                   percentile=DEFAULTS["slo.percentile"] if percentile is None else percentile)

    def to_crd(self) -> dict[str, float]:
        """The CRD's camelCase form (targets left out when unset; ``profile`` is not in
        the CRD)."""
        out = {"percentile": self.percentile}
        if self.ttft_seconds is not None:
            out["ttftSeconds"] = self.ttft_seconds
        if self.itl_seconds is not None:
            out["itlSeconds"] = self.itl_seconds
        return out


@dataclass(frozen=True)
class AutoscalingSpec:
    """Targets, bounds and windows of the scaling policy.

    Attributes:
        min_replicas: lower bound, >= 0. 0 turns scale to zero on
            (:mod:`kvpilot.autoscaler.zero`): the fleet goes to zero replicas after
            ``scale_to_zero_after_seconds`` without a request and back to one when the
            router holds a request that found no engine; every other rule keeps at least
            one replica (:attr:`floor`).
        max_replicas: upper bound, >= min_replicas.
        target_cache_usage: wanted mean non-evictable KV usage per replica, in (0, 1).
        target_queue_depth: waiting requests per ready replica above which the queue is
            pressure (> 0).
        target_saturation: wanted running requests per replica as a share of the engine's
            ``--max-num-seqs``, in (0, 1]: the batch-slot counterpart of
            ``target_cache_usage``, so a fleet whose batches are busy is kept (and grown)
            even while its KV cache is nearly empty (short prompts, a full batch).
        startup_seconds: how long a new pod takes from creation to serving (>= 0): the
            forecast horizon.
        scale_up_stabilization_seconds: HPA-style window for the reactive rules (headroom,
            queue drain): a scale-up uses the lowest of their recommendations in this window.
            0 (default) = act on the latest observation. The forecast and the starvation
            alarm never wait for it.
        scale_down_stabilization_seconds: a scale-down needs a full window of complete
            observations whose recommendations were all below the current count.
        interval_seconds: how often the operator calls the policy (> 0); also bounds the gap
            between observations that still counts as a continuous window.
        metrics: where the signals come from (the operator reads it; the policy does not).
        engine: who scales the fleet, one of :data:`AUTOSCALING_ENGINES`: ``kvpilot`` (the
            operator's loop calls this policy) or ``keda`` (the operator writes a KEDA
            ScaledObject from these targets instead; the policy is not called). The
            policy does not read it.
        tolerance: dead band around a target, as a ratio (HPA's default 0.1).
        starvation_usage: per-pod KV usage at or above which the starvation alarm fires.
        forecast_window_seconds: span of history the least-squares slope is fitted over.
        forecast_margin_seconds: added to ``startup_seconds`` to form the forecast horizon
            (covers the decision interval and metric lag).
        node_startup_seconds: how long a new GPU node takes to be ready for pods; > 0 turns
            node headroom on (placeholder pods, :mod:`kvpilot.autoscaler.headroom`), 0 (the
            default) leaves it off.
        scale_to_zero_after_seconds: with ``min_replicas`` 0, how long the fleet must be
            idle (no request running, waiting, held at the router or finished) before it
            goes from one replica to zero (> 0).
        activation_timeout_seconds: with ``min_replicas`` 0, how long the router holds a
            request while no engine serves before answering 503 (> 0; the operator turns
            it into the router's retry schedule, the policy does not read it).
        slo: latency targets (:class:`SloSpec`), or None: the ``latency`` rule and the
            latency part of the consolidation check are then off and the fleet is sized
            on KV usage, batch saturation and the queue alone.
    """

    min_replicas: int = DEFAULTS["minReplicas"]
    max_replicas: int = UNSET_MAX_REPLICAS
    target_cache_usage: float = float(DEFAULTS["targetCacheUsage"])
    target_queue_depth: float = float(DEFAULTS["targetQueueDepth"])
    target_saturation: float = float(DEFAULTS["targetSaturation"])
    startup_seconds: float = float(DEFAULTS["startupSeconds"])
    scale_up_stabilization_seconds: float = float(DEFAULTS["scaleUpStabilizationSeconds"])
    scale_down_stabilization_seconds: float = float(DEFAULTS["scaleDownStabilizationSeconds"])
    interval_seconds: float = float(DEFAULTS["intervalSeconds"])
    metrics: MetricsSourceSpec = field(default_factory=MetricsSourceSpec)
    tolerance: float = 0.1
    starvation_usage: float = STARVATION_USAGE
    forecast_window_seconds: float = 120.0
    forecast_margin_seconds: float = 30.0
    node_startup_seconds: float = float(DEFAULTS["nodeStartupSeconds"])
    scale_to_zero_after_seconds: float = float(DEFAULTS["scaleToZeroAfterSeconds"])
    activation_timeout_seconds: float = float(DEFAULTS["activationTimeoutSeconds"])
    engine: str = DEFAULTS["engine"]
    slo: SloSpec | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "slo":
                if value is not None and not isinstance(value, SloSpec):
                    raise ValueError(f"slo must be a SloSpec or None; got {value!r}")
                continue
            if f.name == "engine":
                if value not in AUTOSCALING_ENGINES:
                    raise ValueError(f"engine must be one of {', '.join(AUTOSCALING_ENGINES)};"
                                     f" got {value!r}")
                continue
            if f.name == "metrics":
                if not isinstance(value, MetricsSourceSpec):
                    raise ValueError(f"metrics must be a MetricsSourceSpec; got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{_name(f.name)} must be a number; got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{_name(f.name)} must be finite; got {value!r}")
        for name in ("min_replicas", "max_replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) and not float(value).is_integer():
                raise ValueError(f"{_name(name)} must be a whole number; got {value!r}")
            object.__setattr__(self, name, int(value))
        self._check_ranges()

    def _check_ranges(self) -> None:
        if self.min_replicas < 0:
            raise ValueError(f"minReplicas must be >= 0 (0 = scale to zero); got {self.min_replicas}")
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError(
                f"maxReplicas must be >= 1 and >= minReplicas ({self.min_replicas});"
                f" got {self.max_replicas}"
            )
        if not 0.0 < self.target_cache_usage < 1.0:
            raise ValueError(f"targetCacheUsage must be in (0, 1); got {self.target_cache_usage}")
        if not 0.0 < self.target_saturation <= 1.0:
            raise ValueError(f"targetSaturation must be in (0, 1]; got {self.target_saturation}")
        if self.target_queue_depth <= 0:
            raise ValueError(f"targetQueueDepth must be > 0; got {self.target_queue_depth}")
        if self.engine == "keda" and self.slo is not None:
            raise ValueError("slo is not allowed when engine is keda: KEDA's HPA cannot run"
                             " the latency model (use engine kvpilot for latency targets)")
        if self.interval_seconds <= 0:
            raise ValueError(f"intervalSeconds must be > 0; got {self.interval_seconds}")
        for name in (
            "startup_seconds",
            "scale_up_stabilization_seconds",
            "scale_down_stabilization_seconds",
            "forecast_margin_seconds",
            "node_startup_seconds",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{_name(name)} must be >= 0; got {getattr(self, name)}")
        for name in ("scale_to_zero_after_seconds", "activation_timeout_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{_name(name)} must be > 0; got {getattr(self, name)}")
        if not 0.0 <= self.tolerance < 1.0:
            raise ValueError(f"tolerance must be in [0, 1); got {self.tolerance}")
        if not self.target_cache_usage < self.starvation_usage <= 1.0:
            raise ValueError(
                f"starvation_usage must be in (targetCacheUsage={self.target_cache_usage}, 1];"
                f" got {self.starvation_usage}"
            )
        if self.forecast_window_seconds < 2 * self.interval_seconds:
            raise ValueError(
                f"forecast_window_seconds must be >= 2 x intervalSeconds "
                f"({2 * self.interval_seconds}); got {self.forecast_window_seconds}"
            )

    @property
    def forecast_horizon_seconds(self) -> float:
        """How far ahead the forecast must look: start-up time plus the margin."""
        return self.startup_seconds + self.forecast_margin_seconds

    @property
    def keda(self) -> bool:
        """True when KEDA scales the fleet (``engine: keda``): the operator writes a
        ScaledObject and neither its loop nor its reconcile sets the replica count."""
        return self.engine == "keda"

    @property
    def scale_to_zero(self) -> bool:
        """True when ``minReplicas`` is 0: the fleet may go to zero replicas when idle."""
        return self.min_replicas == 0

    @property
    def floor(self) -> int:
        """The fewest replicas any rule but scale to zero leaves: ``max(1, min_replicas)``."""
        return max(1, self.min_replicas)

    def clamp(self, replicas: int) -> int:
        """``replicas`` limited to [floor, max_replicas] (never 0: only the scale-to-zero
        rule goes to zero, and only the reconcile of a fleet at zero keeps zero)."""
        return max(self.floor, min(self.max_replicas, replicas))

    @classmethod
    def from_crd(cls, autoscaling: Mapping[str, Any]) -> AutoscalingSpec:
        """Build from the CR's ``spec.autoscaling`` mapping (camelCase keys).

        Unknown keys are ignored; absent keys take the defaults. Raises ValueError as the
        constructor does (the operator's ``parse_spec`` checks the CRD's ranges first and
        names the full ``spec.autoscaling...`` path).
        """
        kwargs: dict[str, Any] = {
            _CRD_NAMES[k]: v for k, v in autoscaling.items() if k in _CRD_NAMES
        }
        metrics = autoscaling.get("metrics")
        if isinstance(metrics, Mapping):
            kwargs["metrics"] = MetricsSourceSpec(
                source=metrics.get("source", DEFAULTS["metrics.source"]), url=metrics.get("url")
            )
        if "engine" in autoscaling:
            kwargs["engine"] = autoscaling["engine"]
        if autoscaling.get("slo") is not None:
            kwargs["slo"] = SloSpec.from_crd(autoscaling["slo"])
        return cls(**kwargs)

    def to_crd(self) -> dict[str, Any]:
        """The policy's CRD fields, camelCase (``metrics`` and ``engine`` left out: the
        policy does not read them; ``slo`` only when set, without its ``profile``).
        ``from_crd(spec.to_crd())`` equals a spec with the default metrics, engine and
        profile."""
        out: dict[str, Any] = {crd: getattr(self, name) for crd, name in _CRD_NAMES.items()}
        if self.slo is not None:
            out["slo"] = self.slo.to_crd()
        return out
