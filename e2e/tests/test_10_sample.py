"""Scenarios 1 and 3: the SmolLM2 sample applied with kubectl becomes a Deployment, a
Service and a PodDisruptionBudget whose pods serve SmolLM2; a spec change rolls the pods;
deleting the resource garbage-collects everything and leaves no finalizer behind."""

from __future__ import annotations

import json

from e2e.tests import helpers as h

NAME = "smollm2"


def _engine_args(dep: dict) -> list[str]:
    container = dep["spec"]["template"]["spec"]["containers"][0]
    return container["command"] + container["args"]


def test_sample_serves_and_reports(cluster, namespace):
    cluster.kubectl("apply", "-n", namespace, "-f", str(h.SAMPLE))
    obj = h.wait_ready(cluster, namespace, NAME, replicas=1)

    dep = h.deployment(cluster, namespace, NAME)
    argv = _engine_args(dep)
    assert argv[:2] == ["kvpilot", "serve"]
    assert "--model" in argv
    for flag, value in {"--served-model-name": "smollm2-135m-instruct",
                        "--kv-cache-dtype": "auto", "--max-num-batched-tokens": "2048",
                        "--max-num-seqs": "32", "--block-size": "16", "--max-model-len": "4096",
                        "--port": "8000", "--device": "cpu"}.items():
        assert argv[argv.index(flag) + 1] == value, (flag, argv)
    assert "--enable-prefix-caching" in argv
    owner = dep["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("InferenceDeployment", NAME, True)

    svc = cluster.get_json("-n", namespace, "service", NAME)
    assert svc["spec"]["ports"][0]["port"] == 8000
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    pdb = cluster.get_json("-n", namespace, "pdb", NAME)
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]

    # A real completion through the pod's own address.
    (pod,) = h.ready_pods(cluster, namespace, NAME)
    answer = h.completion(pod["status"]["podIP"])
    assert answer["model"] == "smollm2-135m-instruct"
    assert answer["choices"][0]["text"].strip(), answer
    assert answer["usage"]["completion_tokens"] > 0

    ready = h.condition(obj, "Ready")
    assert ready["status"] == "True" and ready.get("observedGeneration") in (None, obj["metadata"]["generation"])
    assert obj["status"]["observedGeneration"] == obj["metadata"]["generation"]
    # Printer columns, as kubectl prints them, once the autoscaler has read the pod.
    cluster.wait_for(lambda: h.infd(cluster, namespace, NAME)["status"].get("signals", {})
                     .get("cacheUsage") is not None, 90, "the first metrics reading")
    table = cluster.kubectl("get", "-n", namespace, "inferencedeployments").stdout.splitlines()
    assert table[0].split() == ["NAME", "MODEL", "KV-DTYPE", "READY", "DESIRED", "CACHE",
                                "QUEUE", "AGE"]
    row = table[1].split()
    assert row[:5] == [NAME, "embedded://smollm2-135m-instruct", "auto", "1", "1"], table
    assert 0.0 <= float(row[5]) <= 1.0 and row[6] == "0", table
    wide = cluster.kubectl("get", "-n", namespace, "infd", NAME, "-o", "wide").stdout
    assert "COST/H" in wide.splitlines()[0].upper()


def test_update_rolls_and_delete_collects(cluster, namespace):
    doc = h.sample()
    doc["spec"]["engine"]["extraArgs"] = list(h.CPU_ENGINE_ARGS)
    doc["spec"]["terminationGracePeriodSeconds"] = 15
    # The rollout surges one pod: with the sample's 1-CPU request the two-core node has no
    # room for it (the scheduler keeps it Pending), so this fleet asks for less.
    doc["spec"]["resources"] = {"requests": {"cpu": "100m", "memory": "256Mi"}}
    h.apply(cluster, namespace, doc)
    h.wait_ready(cluster, namespace, NAME, replicas=1)
    (old_pod,) = h.ready_pods(cluster, namespace, NAME)
    old_rs = _replicasets(cluster, namespace)

    doc["spec"]["engine"]["maxNumSeqs"] = 16
    h.apply(cluster, namespace, doc)

    seen = set()

    def rolled():
        progressing = h.condition(h.infd(cluster, namespace, NAME), "Progressing") or {}
        seen.add((progressing.get("status"), progressing.get("reason")))
        pods = h.ready_pods(cluster, namespace, NAME)
        dep = h.deployment(cluster, namespace, NAME)
        st = dep.get("status", {})
        done = (st.get("updatedReplicas") == 1 and st.get("replicas") == 1
                and st.get("observedGeneration") == dep["metadata"]["generation"])
        return done and len(pods) == 1 and pods[0]["metadata"]["uid"] != old_pod["metadata"]["uid"] and pods

    (new_pod,) = cluster.wait_for(rolled, 240, "the rollout to a new pod")
    args = new_pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-num-seqs") + 1] == "16"
    assert set(_replicasets(cluster, namespace)) > set(old_rs), "a new ReplicaSet rolled the change"
    h.wait_ready(cluster, namespace, NAME, replicas=1)
    assert h.completion(new_pod["status"]["podIP"])["choices"][0]["text"]
    assert ("True", "RollingOut") in seen, seen  # the rollout was reported while it ran
    cluster.wait_for(lambda: h.condition_is(cluster, namespace, NAME, "Progressing", "False",
                                            "Complete"), 60, "Progressing=False Complete")

    cluster.kubectl("delete", "-n", namespace, "inferencedeployment", NAME, "--timeout=120s")

    def collected():
        out = cluster.kubectl("get", "-n", namespace, "deploy,rs,svc,pdb,pods,infd", "-o",
                              "json").stdout
        return not json.loads(out)["items"]

    cluster.wait_for(collected, 120, "garbage collection of every child")
    gone = cluster.kubectl("get", "-n", namespace, "infd", NAME, check=False)
    assert gone.returncode != 0 and "NotFound" in gone.stderr  # no finalizer kept it


def _replicasets(cluster, namespace) -> list[str]:
    return [rs["metadata"]["name"] for rs in cluster.get_json("-n", namespace, "rs")["items"]]
