"""``make demo``: the e2e cluster, the SmolLM2 sample, a load ramp, the scaling timeline.

Starts the same cluster as ``make e2e`` (a real node, the chart installed with helm),
applies ``crds/samples/smollm2-cpu.yaml`` (its CPU request lowered to 250m: the node has
two cores, and a 1-CPU request would leave the sample's extra replicas Pending), drives a ramp of ``kvpilot bench
serve`` runs through the router's Service (``smollm2-router``, its ClusterIP through
kube-proxy), so new pods take traffic as soon as they are Ready; keeps sampling the
resource's status and each pod's request count until the fleet is back at minReplicas (or
``--max-seconds``), prints the timeline and plots it, per-pod traffic included, to
``e2e-demo/timeline.png``. Everything it started is
stopped on exit, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import yaml

from e2e import procs
from e2e.cluster import REPO, Cluster
from e2e.load import Ramp, Step
from e2e.tests.helpers import wait_service
from e2e.timeline import Recorder, plot, table

SAMPLE = REPO / "crds" / "samples" / "smollm2-cpu.yaml"
NAME = "smollm2"
DEMO_CPU_REQUEST = "250m"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "e2e-demo")
    parser.add_argument("--max-seconds", type=float, default=900)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    procs.install_signal_handlers()
    cluster = Cluster.create()
    t0 = time.monotonic()
    try:
        print(f"demo: starting the cluster in {cluster.workdir}", flush=True)
        cluster.start()
        sample = yaml.safe_load(SAMPLE.read_text())
        sample["spec"]["resources"]["requests"]["cpu"] = DEMO_CPU_REQUEST
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(sample))
        print(cluster.kubectl("get", "infd").stdout, flush=True)
        ip, port = wait_service(cluster, "default", f"{NAME}-router", timeout=300)
        with Recorder(cluster, "default", NAME) as recorder:
            ramp = Ramp(f"http://{ip}:{port}", [Step(2, 8), Step(8, 32), Step(24, 72),
                                                 Step(48, 144)], args.out).start()
            print(f"demo: load ramp through the router at {ip}:{port} "
                  "(concurrency 2, 8, 24, 48)", flush=True)
            while ramp.running() and time.monotonic() - t0 < args.max_seconds:
                time.sleep(5)
                _progress(recorder)
            ramp.stop()
            print("demo: load stopped; waiting for the scale-down", flush=True)
            while time.monotonic() - t0 < args.max_seconds:
                rows = recorder.rows
                if rows and rows[-1]["deploymentReplicas"] == 1 and any(
                        (r["deploymentReplicas"] or 0) > 1 for r in rows):
                    break
                time.sleep(5)
                _progress(recorder)
        recorder.save(args.out / "timeline.json")
        print(table(recorder.rows), flush=True)
        png = plot(recorder.rows, args.out / "timeline.png",
                   "kvpilot demo: smollm2-cpu sample under a load ramp")
        print(cluster.kubectl("get", "infd", "-o", "wide").stdout)
        print(f"demo: timeline in {args.out / 'timeline.json'}, plot in {png}")
        return 0
    finally:
        cluster.stop()


def _progress(recorder: Recorder) -> None:
    if recorder.rows:
        r = recorder.rows[-1]
        print(f"  t={r['t']:6.0f}s replicas={r['deploymentReplicas']} ready={r['readyReplicas']}"
              f" kv={r['cacheUsage']} running={r['requestsRunning']}"
              f" waiting={r['requestsWaiting']}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
