"""The latency model behind the ``latency`` rule: how many replicas keep a fleet within its
SLO (``spec.autoscaling.slo``) at the load it has, or will have within a start-up.

Two predictions, both per fleet and at the SLO's percentile ``p``:

**Inter-token latency** as a function of the per-replica batch ``b`` (running requests per
replica)::

    itl_p(b) = a + c * b          (seconds; a >= 0, c >= 0)

A decode step reads the weights once (``a``: the step's fixed cost) and does per-request
work (``c``: attention over each request's context, the matrix products' extra rows), and
a decoding request gets one token per step, so a request's ITL is the step time. The line
is fitted online by exponentially-forgetting weighted least squares: every read adds one
sample per pod, ``(num_running, itl.quantile(p))`` over the read window, after the old
samples' weights were multiplied by :data:`FORGETTING`; a prior (two pseudo-points on
the benchmark line ``a0 + c0 * b``, at ``b = 0`` and at the benchmark's batch, of weight
``PRIOR.weight / 2`` each) keeps the fit defined before the first sample and when every
pod runs the same batch (the level is then the data's, the slope mostly the prior's).
The prior's weight fades by :data:`FORGETTING` per informing read, down to
:data:`PRIOR_FLOOR`, so a fleet that has been measured for a while is fitted on its own
numbers (a fixed prior would bias the line towards the benchmark by its share of the
weight for ever). The fitted slope is clamped at 0 (a bigger batch is never faster; the level is
then the weighted mean).

This is the profile-based sizing of NVIDIA Dynamo's SLA planner (pre-deployment profiling
gives ITL against batch/concurrency per replica; the planner divides the predicted load
by the largest per-replica load that meets the ITL target) made online, and llm-d's
predicted-latency scaling (a model trained on live (load, latency) samples predicts the
latency a pod would give and the autoscaler scales before the SLO is missed). Ours is one
line per fleet: two numbers in the CR's status, fitted from histograms every engine
already exports.

**Prefill.** A step that carries a prefill chunk (chunked prefill under the token budget)
costs per prefill token too, and its ITL is the step's, so the fit is a plane::

    itl_p(b, p) = a + c * b + d * p          (d >= 0)

with ``p`` the prefill tokens per step beside the decode rows (a pod's ``step_tokens``
minus its running count, >= 0). Without it a fleet whose tail steps carry prefill puts
that cost into ``a``, above a tight target, and concludes that more replicas do not help;
but a fixed fleet load spreads both the batch and the prefill over ``n`` replicas, so
``a + (c R + d P) / n`` (``R`` requests, ``P`` the fleet's prefill tokens per step) falls
with ``n``: the view's line folds ``d P / R`` into the per-request slope. The third prior
pseudo-point sits at ``(b, p) = (0, prior.prefill)`` on the benchmark's per-token prefill
cost; when the data's prefill never varied (weighted variance under one token squared),
the 3x3 system is singular, or its solution has a negative slope, the fit is the
two-parameter line with ``d = 0``.

Sizing is closed-loop (:func:`kvpilot.autoscaler.windows.closed_loop_itl`): the requests
in flight are the arrival rate times their time in the system, which grows with the ITL, so
``n`` replicas hold ``requests x ITL(n) / ITL_now``, not ``requests``. The rule asks for
the larger of the open-loop count and the fewest replicas whose fixed point meets the
target: the same as before on the way up, and never above the current count while the
prediction there meets the target, but it holds the replicas a momentarily small in-flight
count would let go.

**Time to first token** is predicted as the observed base plus a queue wait that more
replicas shorten::

    ttft_p(n) = base + W / (n * R)
    base = max(0, ttft_p observed - W / (ready * R))

with ``W`` the prompt tokens waiting (``kvpilot:num_waiting_tokens`` summed over the pods)
and ``R`` one replica's prefill rate: its token budget per step
(``--max-num-batched-tokens``, else the observed mean tokens per step) over its step time
(the mean ITL). The observed TTFT is the pooled histogram's quantile over the window; at
the current count the prediction equals it, and only the queue part scales with ``n``:
a TTFT that is long with no queue (long prompts, a slow prefill) is not something more
replicas fix, and the model says so instead of scaling to ``maxReplicas``.

Trust: a read *informs* the ITL fit when its usable samples add up to at least
:data:`MIN_WINDOW_OBSERVATIONS` ITL observations (a sample is usable when its pod ran at
least one request and its window holds at least :data:`MIN_SAMPLE_OBSERVATIONS`). The fit
is *trusted* after :data:`MIN_INFORMED_READS` informing reads; before that it leans on the
prior, which may scale the fleet up but never down (the consolidation check then uses the
observed ITL only). Standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpilot.autoscaler.signals import FleetLoad, LatencyWindow, PodSignals

# Weight kept by the data per read (0.9: a sample's weight halves in ~6.6 reads, about
# 100 s at the default 15 s interval; the effective memory is 1 / (1 - 0.9) = 10 reads).
FORGETTING = 0.9
# A pod's window must hold this many ITL observations for its quantile to be a sample.
MIN_SAMPLE_OBSERVATIONS = 20
# A read informs the fit when its samples hold at least this many ITL observations.
MIN_WINDOW_OBSERVATIONS = 50
# Informing reads before the fit is trusted (may justify holding replicas or letting go).
MIN_INFORMED_READS = 4
# The pooled TTFT histogram needs this many first tokens in the window to be read.
MIN_TTFT_OBSERVATIONS = 10
# The share of one replica's prefill capacity (prefill_capacity) the latency rule sizes
# the fleet's computed prefill for: a prefill queue's wait grows as u / (1 - u), and the
# steps that carry the prefill carry the decodes too.
PREFILL_UTILIZATION_TARGET = 0.4
# The prior's weight fades by FORGETTING per informing read down to this floor, which
# keeps the 2x2 system regular when every sample sits at one batch.
PRIOR_FLOOR = 0.05
# The informing-read count saturates here (the prior has faded to its floor long before).
_READS_CAP = 1000


@dataclass(frozen=True)
class Prior:
    """The benchmark line a fleet starts from.

    Attributes:
        a: seconds, ITL at an empty batch (the step's fixed cost), >= 0.
        c: seconds per running request, >= 0.
        batch: the benchmark's batch (requests per replica), where the second
            pseudo-point sits.
        weight: pseudo-samples (split between the two points); a handful, so a few reads
            of real data outweigh it.
        source: where the numbers come from.
        d: seconds per prefill token scheduled in a step (per replica), >= 0.
        prefill: the prefill tokens per step of the third pseudo-point (at ``b = 0``,
            ``y = a + d * prefill``); 0 leaves the prefill term to the data.
    """

    a: float
    c: float
    batch: float
    weight: float
    source: str
    d: float = 0.0
    prefill: float = 0.0


# CPU: SmolLM2-135M fp32 on the 2-core development VM, one torch thread
# (benchmarks/README.md and results/vllm_cpu.json): ITL p50 77 ms with 8 streams decoding
# ("long prompt: ITL p50 before it") and 227 ms at concurrency 32 ("serve ITL p50"), so
# c0 = (0.227 - 0.077) / 24 = 6.25 ms per request and a0 = 0.077 - 8 x 6.25 ms = 27 ms;
# the batch-8 decode step of results/kv_cache_step_time.json (91 ms) agrees within 15%.
# GPU: Llama-3-8B bf16 on one H200 (benchmarks/README.md, "GPU: the H200", engine section):
# 3,485 output tok/s with 256 sequences gives 256 / 3,485 = 73 ms per step at batch 256;
# the fixed cost is the 16 GB of weights read at ~4.2 TB/s (3.8 ms) plus kernel launches
# without CUDA graphs, taken as 10 ms, so c0 = (0.073 - 0.010) / 256 = 0.25 ms per request.
# Prefill (the ``d`` term): the CPU step-time benchmark (results/step_time_cpu.json) adds
# ~1.5 ms per prefill token to a step; the H200 engine prefills at ~69.5 us per token
# (benchmarks/README.md, GPU section). The third pseudo-point sits at b = 0 and a chunk
# of ``prefill`` tokens (a typical chunk on each).
# Both are p50-ish figures for a p90 target: the prior is optimistic by the tail, one
# reason it is never trusted to scale down.
PRIORS: dict[str, Prior] = {
    "cpu": Prior(a=0.027, c=0.00625, batch=32.0, weight=4.0,
                 source="benchmarks/README.md: CPU serve ITL p50 at 8 and 32 streams;"
                        " results/step_time_cpu.json: ~1.5 ms per prefill token",
                 d=0.0015, prefill=256.0),
    "gpu": Prior(a=0.010, c=0.00025, batch=256.0, weight=4.0,
                 source="benchmarks/README.md: H200 Llama-3-8B engine, 256 sequences;"
                        " ~69.5 us per prefill token",
                 d=0.0000695, prefill=2048.0),
}


@dataclass(frozen=True)
class ItlFit:
    """The fitted line and how far to believe it.

    Attributes:
        a: seconds at an empty batch (>= 0).
        c: seconds per running request per replica (>= 0).
        data_weight: the forgotten-weighted count of real samples behind it.
        informed_reads: reads that informed it (capped).
        trusted: ``informed_reads >= MIN_INFORMED_READS``.
        d: seconds per prefill token per step per replica (>= 0; 0 when the data never
            varied the prefill, the two-parameter fit).
    """

    a: float
    c: float
    data_weight: float
    informed_reads: int
    trusted: bool
    d: float = 0.0

    def predict(self, batch: float, prefill: float = 0.0) -> float:
        """ITL (seconds) at ``batch`` running requests and ``prefill`` prefill tokens per
        step per replica."""
        return self.a + self.c * max(0.0, batch) + self.d * max(0.0, prefill)

    def max_batch(self, target: float) -> float | None:
        """The largest per-replica batch whose predicted ITL is within ``target``
        (seconds); ``math.inf`` when ITL does not grow with the batch and ``a`` meets it;
        None when even an empty batch misses it (more replicas cannot help)."""
        if self.a > target:
            return None
        if self.c <= 0:
            return math.inf
        return (target - self.a) / self.c


@dataclass(frozen=True)
class LatencyModel:
    """The ITL fit's state: weighted sums of the data (forgotten each read) and the read
    counter. Serializable (:meth:`to_dict`) into ``PolicyState.latency`` so an operator
    restart keeps what the fleet taught it.

    The fitted plane is ``itl_p = a + c b + d p`` with ``p`` the prefill tokens a pod
    scheduled per step beside its decode rows (``step_tokens - num_running``, >= 0).

    Attributes:
        percentile: the quantile the samples were read at (a new one starts over).
        s0 / sb / sy / sbb / sby: sum of w, w*b, w*y, w*b^2, w*b*y over the samples
            (b = requests per replica, y = ITL seconds).
        sp / spp / sbp / spy: sum of w*p, w*p^2, w*b*p, w*p*y (p = prefill tokens per
            step). A state written before the prefill term has none: they load as 0,
            i.e. its samples count as prefill-free, and forgetting replaces them within
            ~10 reads.
        informed_reads: reads whose samples held >= ``MIN_WINDOW_OBSERVATIONS``.
    """

    percentile: float
    s0: float = 0.0
    sb: float = 0.0
    sy: float = 0.0
    sbb: float = 0.0
    sby: float = 0.0
    informed_reads: int = 0
    sp: float = 0.0
    spp: float = 0.0
    sbp: float = 0.0
    spy: float = 0.0

    def update(self, samples: Sequence[tuple[float, ...]], observations: float) -> LatencyModel:
        """This read's samples added after the old ones were forgotten (pure: returns a
        new model). ``samples``: ``(batch, itl_seconds)`` or ``(batch, itl_seconds,
        prefill_tokens)`` tuples; ``observations``: the ITL observations behind them
        (counts an informing read). No samples: the old weights are still forgotten, so a
        fleet that stopped reporting slides back to the prior."""
        f = FORGETTING
        s0, sb, sy, sbb, sby, sp, spp, sbp, spy = (
            f * v for v in (self.s0, self.sb, self.sy, self.sbb, self.sby,
                            self.sp, self.spp, self.sbp, self.spy))
        for sample in samples:
            b, y = sample[0], sample[1]
            pf = max(0.0, sample[2]) if len(sample) > 2 else 0.0
            s0 += 1.0
            sb += b
            sy += y
            sbb += b * b
            sby += b * y
            sp += pf
            spp += pf * pf
            sbp += b * pf
            spy += pf * y
        reads = self.informed_reads
        if samples and observations >= MIN_WINDOW_OBSERVATIONS:
            reads = min(_READS_CAP, reads + 1)
        return replace(self, s0=s0, sb=sb, sy=sy, sbb=sbb, sby=sby, sp=sp, spp=spp,
                       sbp=sbp, spy=spy, informed_reads=reads)

    def fit(self, prior: Prior, prefill: bool = True) -> ItlFit:
        """Weighted least squares over the data and the prior's pseudo-points.

        With prefill in the data (its weighted variance above a token's), solves the 3x3
        normal equations of ``y = a + c b + d p`` over the data plus three pseudo-points
        (the prior's two at ``p = 0`` and one at ``(0, prior.prefill)``). It falls back to
        the 2x2 fit of ``y = a + c b`` (``d = 0``; c < 0 clamped to 0 with ``a`` the
        weighted mean, a < 0 to 0) when the prefill never varied, the 3x3 system is
        singular, or its solution has c < 0 or d < 0 (and with ``prefill=False``, the
        line a caller wants where prefill is a minor share). Never raises.
        """
        w = max(prior.weight * FORGETTING ** self.informed_reads, PRIOR_FLOOR) / 2.0
        trusted = self.informed_reads >= MIN_INFORMED_READS
        three = self._fit3(prior, w) if prefill else None
        if three is not None:
            a, c, d = three
            return ItlFit(max(0.0, a), c, self.s0, self.informed_reads, trusted, d)
        points = ((0.0, prior.a), (prior.batch, prior.a + prior.c * prior.batch))
        s0, sb, sy, sbb, sby = self.s0, self.sb, self.sy, self.sbb, self.sby
        for b, y in points:
            s0 += w
            sb += w * b
            sy += w * y
            sbb += w * b * b
            sby += w * b * y
        det = s0 * sbb - sb * sb
        if det <= 1e-12 or s0 <= 0:
            a, c = prior.a, prior.c
        else:
            c = (s0 * sby - sb * sy) / det
            a = (sy - c * sb) / s0
            if c < 0:
                c, a = 0.0, sy / s0
            a = max(0.0, a)
        return ItlFit(a, c, self.s0, self.informed_reads, trusted)

    def _fit3(self, prior: Prior, w: float) -> tuple[float, float, float] | None:
        """``(a, c, d)`` of the three-parameter fit, or None (see :meth:`fit`)."""
        if self.s0 <= 0 or prior.prefill <= 0:
            return None
        mean_p = self.sp / self.s0
        if self.spp / self.s0 - mean_p * mean_p < 1.0:  # prefill never varied
            return None
        points = ((0.0, 0.0, prior.a), (prior.batch, 0.0, prior.a + prior.c * prior.batch),
                  (0.0, prior.prefill, prior.a + prior.d * prior.prefill))
        s0, sb, sp, sy = self.s0, self.sb, self.sp, self.sy
        sbb, sbp, spp = self.sbb, self.sbp, self.spp
        sby, spy = self.sby, self.spy
        for b, pf, y in points:
            s0 += w
            sb += w * b
            sp += w * pf
            sy += w * y
            sbb += w * b * b
            sbp += w * b * pf
            spp += w * pf * pf
            sby += w * b * y
            spy += w * pf * y
        solved = _solve3(((s0, sb, sp), (sb, sbb, sbp), (sp, sbp, spp)), (sy, sby, spy))
        if solved is None:
            return None
        a, c, d = solved
        if c < 0 or d < 0 or not all(math.isfinite(v) for v in solved):
            return None
        return a, c, d

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (inverse of :meth:`from_dict`)."""
        return {"percentile": self.percentile, "s0": self.s0, "sb": self.sb, "sy": self.sy,
                "sbb": self.sbb, "sby": self.sby, "sp": self.sp, "spp": self.spp,
                "sbp": self.sbp, "spy": self.spy, "informedReads": self.informed_reads}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LatencyModel:
        """Read what :meth:`to_dict` wrote. The prefill sums (``sp``, ``spp``, ``sbp``,
        ``spy``) are optional: a state from before the prefill term loads with them 0
        (its samples count as prefill-free until forgotten).

        Raises:
            ValueError: a missing or non-numeric field, a non-finite or negative weight
                sum, a percentile outside (0, 1).
        """
        try:
            model = cls(percentile=float(data["percentile"]), s0=float(data["s0"]),
                        sb=float(data["sb"]), sy=float(data["sy"]), sbb=float(data["sbb"]),
                        sby=float(data["sby"]),
                        informed_reads=int(data.get("informedReads", 0)),
                        sp=float(data.get("sp", 0.0)), spp=float(data.get("spp", 0.0)),
                        sbp=float(data.get("sbp", 0.0)), spy=float(data.get("spy", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed latency model {data!r}: {exc}") from exc
        sums = (model.s0, model.sb, model.sy, model.sbb, model.sby,
                model.sp, model.spp, model.sbp, model.spy)
        if (not all(math.isfinite(v) for v in sums) or model.s0 < 0 or model.spp < 0
                or model.informed_reads < 0):
            raise ValueError(f"malformed latency model {data!r}: sums must be finite,"
                             " weights >= 0")
        if not 0.0 < model.percentile < 1.0:
            raise ValueError(f"malformed latency model: percentile {model.percentile}"
                             " outside (0, 1)")
        return model


def _solve3(m: tuple[tuple[float, float, float], ...], v: tuple[float, float, float]
            ) -> tuple[float, float, float] | None:
    """``x`` with ``m x = v`` by Cramer's rule; None when ``m`` is (nearly) singular
    relative to its scale."""
    def det(r: Sequence[Sequence[float]]) -> float:
        return (r[0][0] * (r[1][1] * r[2][2] - r[1][2] * r[2][1])
                - r[0][1] * (r[1][0] * r[2][2] - r[1][2] * r[2][0])
                + r[0][2] * (r[1][0] * r[2][1] - r[1][1] * r[2][0]))
    d = det(m)
    scale = m[0][0] * m[1][1] * m[2][2]
    if scale <= 0 or abs(d) <= 1e-9 * scale:
        return None
    out = []
    for col in range(3):
        rows = [[v[i] if j == col else m[i][j] for j in range(3)] for i in range(3)]
        out.append(det(rows) / d)
    return out[0], out[1], out[2]


def itl_samples(pods: Sequence[PodSignals], percentile: float
                ) -> tuple[tuple[tuple[float, float, float], ...], float]:
    """``((batch, itl_seconds, prefill_tokens), ...)`` from the pods whose window is
    usable, and the ITL observations behind them. A pod is usable with an ITL window of at
    least :data:`MIN_SAMPLE_OBSERVATIONS` and a running count >= 1 (its batch). The
    prefill is ``step_tokens - num_running`` (>= 0; 0 without ``step_tokens``)."""
    samples: list[tuple[float, float, float]] = []
    observations = 0.0
    for pod in pods:
        if pod.itl is None or pod.num_running is None or pod.num_running < 1:
            continue
        if pod.itl.count < MIN_SAMPLE_OBSERVATIONS:
            continue
        q = pod.itl.quantile(percentile)
        if q is None:
            continue
        b = float(pod.num_running)
        prefill = max(0.0, pod.step_tokens - b) if pod.step_tokens is not None else 0.0
        samples.append((b, q, prefill))
        observations += pod.itl.count
    return tuple(samples), observations


def prefill_per_step(pods: Sequence[PodSignals]) -> float:
    """The fleet's prefill tokens per step summed over the pods (``step_tokens`` minus
    the running count, >= 0): the prefill load that ``n`` replicas share as ``1 / n``."""
    total = 0.0
    for pod in pods:
        if pod.step_tokens is None or pod.num_running is None:
            continue
        total += max(0.0, pod.step_tokens - float(pod.num_running))
    return total


def pooled(windows: Sequence[LatencyWindow]) -> LatencyWindow | None:
    """The windows added up (the fleet's histogram, as ``sum by (le)`` in PromQL). Windows
    whose bucket bounds differ from the first's (another engine version mid-rollout) are
    left out; None for no window."""
    if not windows:
        return None
    bounds = tuple(b for b, _ in windows[0].buckets)
    counts = [0.0] * len(bounds)
    total_sum = 0.0
    for w in windows:
        if tuple(b for b, _ in w.buckets) != bounds:
            continue
        for i, (_, count) in enumerate(w.buckets):
            counts[i] += count
        total_sum += w.sum_seconds
    return LatencyWindow(tuple(zip(bounds, counts)), total_sum)


@dataclass(frozen=True)
class TtftView:
    """The TTFT prediction's inputs (see the module docstring).

    Attributes:
        observed: pooled TTFT at the percentile over the window (seconds).
        waiting_tokens: ``W``, prompt tokens queued on the engines.
        prefill_rate: ``R``, tokens per second one replica prefills; None when unknown
            (no ITL mean or no token budget): the queue part cannot be scaled.
        ready: the ready replicas the observation was made with.
    """

    observed: float
    waiting_tokens: float
    prefill_rate: float | None
    ready: int

    @property
    def base(self) -> float:
        """TTFT that is not queue wait (seconds, >= 0)."""
        if self.prefill_rate is None or self.ready < 1:
            return self.observed
        return max(0.0, self.observed - self.waiting_tokens / (self.ready * self.prefill_rate))

    def predict(self, replicas: int) -> float:
        """TTFT at the percentile with ``replicas`` replicas (seconds)."""
        if self.prefill_rate is None or replicas < 1:
            return self.observed
        return self.base + self.waiting_tokens / (replicas * self.prefill_rate)

    def replicas_for(self, target: float) -> int | None:
        """Fewest replicas whose predicted TTFT is within ``target``; None when none is
        (the base alone misses it, or the rate is unknown and the observation misses it)."""
        if self.predict(max(1, self.ready)) <= target and self.prefill_rate is None:
            return 1
        if self.prefill_rate is None or self.base >= target:
            return None
        if self.waiting_tokens <= 0:
            return 1
        return max(1, ceil_replicas(self.waiting_tokens / (self.prefill_rate * (target - self.base))))


# A hair below 1 so ceil(3.0000000001) from float noise stays 3.
_EPS = 1e-9
# What ceil_replicas answers for an infinite count (a sum of finite rates can overflow);
# the bounds clamp it to maxReplicas.
_UNBOUNDED = 2**31 - 1


def ceil_replicas(x: float) -> int:
    """ceil() that forgives float noise, floored at 0; an infinite ``x`` (a sum of huge,
    finite signals that overflowed) is :data:`_UNBOUNDED` and NaN is 0, never a raise.
    The rules' replica counts and the latency model's share it."""
    if math.isnan(x):
        return 0
    if math.isinf(x):
        return _UNBOUNDED if x > 0 else 0
    return max(0, math.ceil(x - _EPS))


def prefill_capacity(a: float, d: float, budget: int | None) -> float | None:
    """Prompt tokens per second one replica prefills when every step is a full prefill
    chunk: ``budget / (a + d x budget)`` (``a`` the step's fixed cost and ``d`` the cost
    per prefill token, seconds, of the ITL plane); ``1 / d`` without a known budget;
    None when ``d`` is 0 (no prefill cost known)."""
    if d <= 0:
        return None
    if budget is None:
        return 1.0 / d
    return budget / (max(0.0, a) + d * budget)


def prefix_rates(pods: Sequence[PodSignals]) -> tuple[float, float] | None:
    """``(computed, handover)`` in prompt tokens per second: the prefill the fleet
    computes (looked-up tokens less those its prefix caches held, summed over the pods),
    and the largest one pod's cache saves (what its sessions prefill again elsewhere if
    that pod goes). A pod's held tokens count at most its looked-up ones (the two
    counters are read a moment apart). None when no pod reported both rates; pods that
    did not are left out (:func:`prefix_unreported` counts them)."""
    computed = handover = 0.0
    seen = False
    for pod in pods:
        if pod.prompt_token_rate is None or pod.cached_token_rate is None:
            continue
        seen = True
        cached = min(pod.cached_token_rate, pod.prompt_token_rate)
        computed += pod.prompt_token_rate - cached
        handover = max(handover, cached)
    return (computed, handover) if seen else None


def prefix_unreported(pods: Sequence[PodSignals]) -> int:
    """Ready pods without both prefix-cache rates (a pod's first read, an older image)."""
    return sum(1 for p in pods if p.prompt_token_rate is None or p.cached_token_rate is None)


def ttft_view(pods: Sequence[PodSignals], load: FleetLoad, percentile: float,
              prefill_rate: float | None) -> TtftView | None:
    """The fleet's TTFT inputs, or None when fewer than :data:`MIN_TTFT_OBSERVATIONS`
    first tokens are in the pooled window (or no pod has a TTFT histogram).

    ``R`` is ``prefill_rate``, one replica's :func:`prefill_capacity` on the ITL plane
    (a step's time is the plane's, so a budget-sized chunk costs ``a + d x budget``; the
    mean ITL is mostly decode-only steps and overstates it, by 30x on the H200
    profile)."""
    window = pooled([p.ttft for p in pods if p.ttft is not None])
    if window is None or window.count < MIN_TTFT_OBSERVATIONS:
        return None
    observed = window.quantile(percentile)
    if observed is None:
        return None
    waiting = load.waiting_tokens if load.capacity_known else 0.0
    return TtftView(observed, waiting, prefill_rate, len(pods))


@dataclass(frozen=True)
class LatencyView:
    """What the ``latency`` rule and the consolidation check read in one interval.

    Attributes:
        percentile_label: ``p90`` and the like.
        histograms: some ready pod exported an ITL or TTFT histogram window.
        fit: the ITL line (None without an ITL target).
        observed_itl: the pooled ITL at the percentile now (seconds), None when no window
            holds enough observations.
        ttft: the TTFT inputs (None without a TTFT target or enough first tokens).
        requests: the load the ITL is sized for: running plus waiting requests (the
            router's held ones included), times the forecast's growth when it triggers.
        growth: that forecast factor (1 = none).
        max_num_seqs: the per-replica batch cap, None when unknown.
        itl_observations: ITL observations in the pooled window (the fleet's tokens).
        ready: the ready replicas the observations were made with.
        itl_mean: the pooled window's mean ITL (seconds; None when it is too thin): what a
            request's duration, and so the requests in flight, scale with.
        prefill_rate: one replica's :func:`prefill_capacity` (prompt tokens/s), None
            when no prefill cost is known.
        prefill_computed / prefix_handover: :func:`prefix_rates` (tokens/s), None when
            no pod exports the prefix cache counters.
        prefix_unreported: ready pods without those rates (:func:`prefix_unreported`).
    """

    percentile_label: str
    histograms: bool
    fit: ItlFit | None
    observed_itl: float | None
    ttft: TtftView | None
    requests: float
    growth: float
    max_num_seqs: int | None
    itl_observations: float = 0.0
    ready: int = 0
    itl_mean: float | None = None
    prefill_rate: float | None = None
    prefill_computed: float | None = None
    prefix_handover: float | None = None
    prefix_unreported: int = 0

    def prefill_utilization(self, replicas: int) -> float | None:
        """The share of ``replicas`` replicas' prefill capacity that the fleet's computed
        prefill plus one pod's handover would take (0..; None without the rates, the
        capacity, or a replica)."""
        if (self.prefill_rate is None or self.prefill_computed is None
                or self.prefix_handover is None or replicas < 1):
            return None
        return (self.prefill_computed + self.prefix_handover) / (replicas * self.prefill_rate)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary for ``status.autoscaler.lastDecision.latency``."""
        fit, ttft = self.fit, self.ttft
        return {
            "percentile": self.percentile_label,
            "histograms": self.histograms,
            "trusted": None if fit is None else fit.trusted,
            "informedReads": None if fit is None else fit.informed_reads,
            "itlA": None if fit is None else round(fit.a, 6),
            "itlC": None if fit is None else round(fit.c, 8),
            "itlObserved": None if self.observed_itl is None else round(self.observed_itl, 6),
            "ttftObserved": None if ttft is None else round(ttft.observed, 6),
            "ttftBase": None if ttft is None else round(ttft.base, 6),
            "prefillRate": (None if self.prefill_rate is None
                            else round(self.prefill_rate, 3)),
            "prefillComputed": (None if self.prefill_computed is None
                                else round(self.prefill_computed, 3)),
            "prefixHandover": (None if self.prefix_handover is None
                               else round(self.prefix_handover, 3)),
            "requests": round(self.requests, 3),
            "growth": round(self.growth, 4),
        }

    def batch(self, replicas: int) -> float:
        """Requests per replica with ``replicas`` replicas (capped at ``max_num_seqs``)."""
        per = self.requests / max(1, replicas)
        return min(per, float(self.max_num_seqs)) if self.max_num_seqs else per

    def itl_replicas(self, target: float) -> int | None:
        """Fewest replicas whose predicted ITL is within ``target`` at ``requests``; None
        without a fit or when even one request per replica misses it (more replicas than
        requests cannot help)."""
        if self.fit is None:
            return None
        cap = self.fit.max_batch(target)
        if cap is None or cap < 1.0:
            return None
        if self.max_num_seqs is not None:
            cap = min(cap, float(self.max_num_seqs))
        if math.isinf(cap) or self.requests <= 0:
            return 1
        open_loop = ceil_replicas(self.requests / cap)
        # Closed loop (closed_loop): n replicas meet the target when
        # now x (1 - k0) / (1 - c x requests / (n x m)) does, i.e.
        # n >= c x requests / (m x (1 - now x (1 - k0) / target)). At most the current
        # count while the prediction there meets the target (it never scales up on its
        # own); it keeps replicas that the in-flight count now would let go.
        loop = self._loop()
        closed = 0
        if loop is not None:
            now, m, k0 = loop
            floor = now * (1.0 - k0)  # the prediction with unbounded replicas
            if floor < target:
                closed = ceil_replicas(self.fit.c * self.requests / (m * (1.0 - floor / target)))
        return max(1, open_loop, closed)

    def _loop(self) -> tuple[float, float, float] | None:
        """``(now, m, k0)`` of the closed loop: the fit at the current batch, the ITL level
        the requests' duration scales with (the lower of ``now`` and the window's mean, so
        the in-flight count grows the faster of the two ways), and ``c x requests /
        (ready x m)``; None without a fit, requests or ready replicas."""
        fit = self.fit
        if fit is None or self.ready < 1 or self.requests <= 0:
            return None
        now = fit.predict(self.batch(self.ready))
        if now <= 0:
            return None
        m = now
        if self.itl_mean is not None and 0 < self.itl_mean < now:
            m = self.itl_mean
        k0 = fit.c * self.requests / (self.ready * m)
        if k0 >= 1.0:  # the slope alone exceeds the mean: fall back to the fit's level
            m, k0 = now, fit.c * self.requests / (self.ready * now)
        return now, m, k0

    def closed_loop(self, fewer: int) -> float:
        """The ITL (seconds) ``fewer`` replicas would settle at with the load's response
        (see :func:`kvpilot.autoscaler.windows.closed_loop_itl`); never below the
        open-loop prediction; ``math.inf`` when they could not keep up."""
        if fewer < 1:
            return math.inf
        fit = self.fit
        if fit is None:
            return math.inf
        open_loop = fit.predict(self.batch(fewer))
        loop = self._loop()
        if loop is None:
            return open_loop
        now, m, k0 = loop
        k = fit.c * self.requests / (fewer * m)
        if k >= 1.0:
            return math.inf
        return max(open_loop, now * (1.0 - k0) / (1.0 - k))


def observed_itl(pods: Sequence[PodSignals], percentile: float) -> tuple[float | None, float]:
    """The pooled ITL at ``percentile`` over the window (seconds) when it holds at least
    :data:`MIN_SAMPLE_OBSERVATIONS` observations, else None; and the observation count."""
    window = pooled([p.itl for p in pods if p.itl is not None])
    if window is None:
        return None, 0.0
    if window.count < MIN_SAMPLE_OBSERVATIONS:
        return None, window.count
    return window.quantile(percentile), window.count
