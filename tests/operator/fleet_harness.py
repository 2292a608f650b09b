"""An autoscaled InferenceDeployment ``llm/chat`` on the in-memory API, with its
autoscaler loop, a scripted metric source, a settable clock and recorded Events."""

from __future__ import annotations

import copy

from kvpilot.operator import constants as c
from kvpilot.operator.autoscaling.loop import AutoscalerLoop
from kvpilot.operator.handlers.context import OperatorContext
from kvpilot.operator.handlers.lifecycle import on_spec
from kvpilot.operator.metrics import OperatorMetrics
from kvpilot.operator.options import OperatorOptions

from .fake_sources import FakeSource, SourceFactory, unreachable
from .fakes import Clock, FakeKubeApi, inference

EMBEDDED = {"uri": "embedded://smollm2-135m-instruct"}
AUTO = {"model": EMBEDDED,
        "autoscaling": {"minReplicas": 1, "maxReplicas": 6, "intervalSeconds": 15,
                        "scaleDownStabilizationSeconds": 60},
        "finops": {"costPerReplicaHour": 2.0}}


class Recorder:
    def __init__(self):
        self.events = []

    def __call__(self, body, type_, reason, message):
        self.events.append((type_, reason, message))

    def reasons(self):
        return [reason for _, reason, _ in self.events]


class Fleet:
    """One InferenceDeployment ``llm/chat``, reconciled once, with a loop on it."""

    def __init__(self, spec=AUTO, load=unreachable, replicas=None, factory=None):
        self.source = FakeSource(load)
        self.factory = factory or SourceFactory(self.source)
        self.events = Recorder()
        self.clock = Clock()
        self.api = FakeKubeApi()
        self.ctx = OperatorContext(api=self.api, options=OperatorOptions(engine_image="e:1"),
                                   metrics=OperatorMetrics(), clock=self.clock,
                                   post_event=self.events, source_factory=self.factory)
        self.spec = copy.deepcopy(spec)
        body = inference(spec=self.spec)
        self.api.put(body)
        on_spec(body=body, memo=self.ctx)  # writes the status itself
        if replicas is not None:
            self.api.objects[("Deployment", "llm", "chat")]["spec"]["replicas"] = replicas
        self.events.events.clear()
        self.loop = AutoscalerLoop(self.ctx, self.body())

    def body(self):
        return self.api.stored(c.KIND, "llm", "chat")

    @property
    def status(self):
        return self.body()["status"]

    def condition(self, type_):
        return next(x for x in self.status["conditions"] if x["type"] == type_)

    @property
    def replicas(self):
        return self.api.stored("Deployment", "llm", "chat")["spec"]["replicas"]

    def pods(self, ready, pending=0):
        """Exactly ``ready`` ready pods and ``pending`` starting ones."""
        for key in [k for k in self.api.objects if k[0] == "Pod"]:
            del self.api.objects[key]
        for i in range(ready + pending):
            self.api.add_pod("chat", f"chat-{i}", ready=i < ready, ip=f"10.0.0.{i + 1}")

    def tick(self, advance=15.0):
        self.clock.advance(advance)
        return self.loop.tick(self.body())

    def restart(self):
        """A new operator process: nothing in memory, everything from the object."""
        self.loop.close()
        self.loop = AutoscalerLoop(self.ctx, self.body())
