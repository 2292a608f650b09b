"""A tiny closed-loop fleet for policy tests: demand is a level (replica-equivalents of KV),
spread evenly over the ready pods; what does not fit waits as queued prompt tokens.
Pending pods become ready ``startup_steps`` decisions after they were asked for."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable

from kvpilot.autoscaler import (
    AutoscalingSpec,
    Decision,
    FleetSignals,
    PodSignals,
    PolicyState,
    decide,
)

CAP = 100_000  # tokens per replica
TOKENS_PER_REQUEST = 2_000


def pods_for(
    demand: float, ready: int, missing: frozenset[int] = frozenset(), preempting: bool = False
) -> tuple[PodSignals, ...]:
    """Ready pods carrying ``demand`` replica-equivalents evenly (usage capped at 0.99)."""
    per_pod = demand / ready if ready else 0.0
    usage = min(per_pod, 0.99)
    excess_tokens = max(0.0, per_pod - usage) * CAP
    waiting = excess_tokens / TOKENS_PER_REQUEST
    pods = []
    for i in range(ready):
        if i in missing:
            pods.append(PodSignals(f"p{i}"))
            continue
        pods.append(
            PodSignals(
                f"p{i}",
                kv_usage=usage,
                num_waiting=waiting,
                waiting_tokens=excess_tokens,
                num_running=usage * CAP / TOKENS_PER_REQUEST,
                preemption_rate=0.5 if preempting else 0.0,
                kv_capacity_tokens=CAP,
            )
        )
    return tuple(pods)


class Plant:
    """Runs :func:`decide` every ``spec.interval_seconds`` against a demand curve."""

    def __init__(self, spec: AutoscalingSpec, ready: int, startup_steps: int = 8) -> None:
        self.spec = spec
        self.ready = ready
        self.startup_steps = startup_steps
        self.pending: deque[int] = deque()  # step at which each pending pod becomes ready
        self.state = PolicyState()
        self.step = 0
        self.decisions: list[Decision] = []

    @property
    def now(self) -> float:
        return self.step * self.spec.interval_seconds

    def tick(
        self,
        demand: float,
        missing: Callable[[int], frozenset[int]] | None = None,
        ready_override: tuple[PodSignals, ...] | None = None,
    ) -> Decision:
        while self.pending and self.pending[0] <= self.step:
            self.pending.popleft()
            self.ready += 1
        gone = missing(self.ready) if missing else frozenset()
        pods = ready_override if ready_override is not None else pods_for(demand, self.ready, gone)
        d = decide(FleetSignals(pods, len(self.pending)), self.state, self.spec, self.now)
        self.state = d.state
        current = self.ready + len(self.pending)
        if d.desired_replicas > current:
            for _ in range(d.desired_replicas - current):
                self.pending.append(self.step + self.startup_steps)
        elif d.desired_replicas < current:
            for _ in range(current - d.desired_replicas):
                if self.pending:
                    self.pending.pop()
                else:
                    self.ready -= 1
        self.decisions.append(d)
        self.step += 1
        return d

    def run(self, demand_of_step: Callable[[int], float], steps: int) -> list[Decision]:
        return [self.tick(demand_of_step(self.step)) for _ in range(steps)]


def direction_changes(counts: list[int]) -> int:
    """How often the sequence turns (up after down or down after up)."""
    moves = [b - a for a, b in itertools.pairwise(counts) if b != a]
    return sum(1 for a, b in itertools.pairwise(moves) if (a > 0) != (b > 0))
