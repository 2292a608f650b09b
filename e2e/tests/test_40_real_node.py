"""What only a real node can show: the engine image under the pod spec the operator
writes, as a kubelet and containerd enforce it.

- the engine runs as the image's non-root user, with a read-only root filesystem, no
  capabilities, and the writable volumes it needs; ``kubectl exec`` and ``kubectl logs``
  reach it through the kubelet;
- resource requests are what the scheduler sees: a fleet asking for more CPU than the node
  has stays Pending with the scheduler's reason, and the InferenceDeployment says so;
- a memory limit below what the model needs: the kernel's OOM killer ends the engine, the
  kubelet restarts it, and the operator reports the restart on the InferenceDeployment
  (Warning Event ``EngineRestarted``, reason OOMKilled);
- a rolling update drains the old pod through its preStop hook and SIGTERM: a stream in
  flight on it runs to its end.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

from e2e.tests import helpers as h


def _exec(cluster, namespace: str, pod: str, script: str):
    return cluster.kubectl("exec", "-n", namespace, pod, "-c", "engine", "--", "sh", "-c",
                           script, check=False, timeout=60)


def test_engine_runs_non_root_on_a_read_only_root_with_its_volumes(cluster, namespace):
    h.apply(cluster, namespace, h.small_infd("secure", autoscaling=None, replicas=1))
    h.wait_ready(cluster, namespace, "secure", replicas=1, timeout=300)
    (pod,) = h.ready_pods(cluster, namespace, "secure")
    name = pod["metadata"]["name"]

    ids = _exec(cluster, namespace, name, "id -u; id -g")
    assert ids.returncode == 0, ids.stderr
    assert ids.stdout.split() == ["10001", "10001"]
    root = _exec(cluster, namespace, name, "touch /probe")
    assert root.returncode != 0 and "Read-only file system" in root.stderr, root
    for path in ("/tmp", "/cache"):
        ok = _exec(cluster, namespace, name, f"touch {path}/probe && rm {path}/probe")
        assert ok.returncode == 0, (path, ok.stderr)
    caps = _exec(cluster, namespace, name, "grep -E '^(CapEff|NoNewPrivs)' /proc/1/status")
    fields = dict(line.split(":\t") for line in caps.stdout.strip().splitlines())
    assert fields == {"CapEff": "0000000000000000", "NoNewPrivs": "1"}, caps.stdout
    # The engine itself is the container's first process (no shell in between).
    argv = _exec(cluster, namespace, name, "tr '\\0' ' ' < /proc/1/cmdline").stdout
    assert argv.split()[1:3] == ["kvpilot", "serve"] or "kvpilot serve" in argv, argv

    logs = cluster.kubectl("logs", "-n", namespace, name, "-c", "engine").stdout
    assert "8000" in logs, logs[-2000:]  # the server announced its port
    # The CPU image: the kernels built into it are loaded, nothing compiles at start-up,
    # and it carries no compiler and no Triton (docs/operator.md, "The CPU engine image").
    assert "CPU kernels: prebuilt x86-64-v" in logs, logs[-3000:]
    assert "building the CPU kernels" not in logs and "falls back to the torch" not in logs
    # One `command -v` per name: dash's stops at the first name it does not find.
    slim = _exec(cluster, namespace, name, "for c in c++ g++ gcc cc; do command -v $c; done; "
                 "python3 -c 'import triton' 2>&1 | tail -1")
    assert "ModuleNotFoundError" in slim.stdout and "/bin/" not in slim.stdout, slim.stdout
    assert h.completion(pod["status"]["podIP"])["choices"][0]["text"]


def test_requests_beyond_the_node_keep_the_pod_pending_and_are_reported(cluster, namespace):
    doc = h.small_infd("huge", autoscaling=None, replicas=1)
    doc["spec"]["resources"] = {"requests": {"cpu": "64", "memory": "256Mi"}}
    doc["spec"]["router"] = {"enabled": False}
    h.apply(cluster, namespace, doc)

    def unschedulable():
        for pod in h.pods(cluster, namespace, "huge"):
            cond = next((c for c in pod.get("status", {}).get("conditions", [])
                         if c["type"] == "PodScheduled"), None)
            if cond and cond["status"] == "False" and cond.get("reason") == "Unschedulable":
                return cond
        return None

    cond = cluster.wait_for(unschedulable, 60, "the scheduler to refuse the pod")
    assert "Insufficient cpu" in cond["message"], cond
    obj = h.infd(cluster, namespace, "huge")
    ready = h.condition(obj, "Ready")
    assert ready["status"] == "False", ready
    assert obj["status"].get("readyReplicas", 0) == 0


def test_an_oom_killed_engine_is_restarted_and_reported(cluster, namespace):
    doc = h.small_infd("oom", autoscaling=None, replicas=1)
    # SmolLM2 in float32 alone is about 540 MB: the engine cannot load under 300 Mi.
    doc["spec"]["resources"] = {"requests": {"cpu": "100m", "memory": "128Mi"},
                                "limits": {"memory": "300Mi"}}
    doc["spec"]["router"] = {"enabled": False}
    h.apply(cluster, namespace, doc)

    def oom_killed():
        for pod in h.pods(cluster, namespace, "oom"):
            for cs in pod.get("status", {}).get("containerStatuses", []):
                last = cs.get("lastState", {}).get("terminated", {})
                if cs.get("restartCount", 0) >= 1 and last.get("reason") == "OOMKilled":
                    return cs
        return None

    cs = cluster.wait_for(oom_killed, 240, "the kernel to OOM-kill the engine and the "
                          "kubelet to restart it")
    assert cs["lastState"]["terminated"]["exitCode"] == 137

    def reported():
        return [e for e in h.events(cluster, namespace, "oom")
                if e["reason"] == "EngineRestarted" and "OOMKilled" in e["message"]]

    (event, *_) = cluster.wait_for(reported, 60, "the operator's EngineRestarted event")
    assert event["type"] == "Warning" and "limits.memory" in event["message"], event


def _stream(url: str, body: dict, out: dict) -> None:
    """POST a streaming completion; records the text, the finish reason and any error."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    out.update(text="", finish=None, error=None, chunks=0)
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            for raw in response:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                choice = event["choices"][0]
                out["text"] += choice.get("text") or ""
                out["chunks"] += 1
                out["finish"] = choice.get("finish_reason") or out["finish"]
    except Exception as exc:  # reported by the test
        out["error"] = repr(exc)


def test_a_rolling_update_lets_a_stream_on_the_old_pod_finish(cluster, namespace):
    doc = h.small_infd("roll", autoscaling=None, replicas=1)
    doc["spec"]["router"] = {"enabled": False}
    # Room for the drain: the stream below runs well within it.
    doc["spec"]["terminationGracePeriodSeconds"] = 180
    h.apply(cluster, namespace, doc)
    h.wait_ready(cluster, namespace, "roll", replicas=1, timeout=300)
    (old,) = h.ready_pods(cluster, namespace, "roll")
    url = f"http://{old['status']['podIP']}:8000/v1/completions"

    result: dict = {}
    # Long enough to outlast the new pod's start (it loads while this streams): about
    # a minute on two shared cores; ignore_eos keeps it from ending early.
    max_tokens = 900
    body = {"model": "smollm2-135m-instruct", "prompt": "Once upon a time",
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    thread = threading.Thread(target=_stream, args=(url, body, result), daemon=True)
    thread.start()
    cluster.wait_for(lambda: result.get("chunks", 0) >= 5, 60, "the stream to start")

    doc["spec"]["engine"]["maxNumSeqs"] = 16  # a new pod template: the Deployment rolls
    h.apply(cluster, namespace, doc)

    def old_pod_terminating():
        pod = cluster.kubectl("get", "-n", namespace, "pod", old["metadata"]["name"], "-o",
                              "json", check=False)
        return pod.returncode != 0 or json.loads(pod.stdout)["metadata"].get("deletionTimestamp")

    cluster.wait_for(old_pod_terminating, 300, "the rollout to retire the old pod")
    assert thread.is_alive(), f"the stream ended before the old pod was retired: {result}"
    terminating_at = time.monotonic()
    thread.join(240)
    assert not thread.is_alive(), "the stream hung"
    assert result["error"] is None, result
    assert result["finish"] == "length" and result["chunks"] >= max_tokens // 2, result
    # The old pod ran out its drain and went away within its grace period.
    cluster.wait_for(lambda: cluster.kubectl("get", "-n", namespace, "pod",
                                             old["metadata"]["name"], check=False)
                     .returncode != 0, 200 - (time.monotonic() - terminating_at) + 30,
                     "the old pod to exit")
    h.wait_ready(cluster, namespace, "roll", replicas=1, timeout=120)
